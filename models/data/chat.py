"""Chat templates: a model's own Jinja template rendered as transformers renders it
(`apply_chat_template`), and the tokens of the assistant's turns marked for the loss.

Where a template has `{% generation %}` blocks (TRL's training templates), the tokens
those blocks produce are the assistant's, as transformers' `assistant_masks` marks them.
Where it has none, the conversation is rendered once more with each assistant
content between two private-use marks, which must change nothing else in the text: a
turn's span runs from its content's start (where the template keeps only the content's
tail, as Qwen 3's keeps what follows an earlier turn's reasoning, from that tail's
start) to the end of the last whole token after it that the conversation rendered
through the turn shares with the whole one: the turn's text and the template's
end-of-turn marker. The ids are always those of the one plain rendering.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

# Private-use characters around a generation block's output while rendering: their
# places give the blocks' spans, and they are removed before tokenizing.
_OPEN, _CLOSE = "\ue000", "\ue001"


def chat_template(source, *, name: str | None = None) -> str | None:
  """The chat template of a tokenizer (its `chat_template` attribute, read where it was
  loaded from), a Hugging Face folder (tokenizer_config.json's "chat_template", a string
  or a list of named templates, else chat_template.jinja beside it), a GGUF file (its
  `tokenizer.chat_template` key) or a .jinja file; None where there is none. `name`
  picks one of a list of named templates (default: "default")."""
  from ..formats import tokenizer_json

  if not isinstance(source, (str, os.PathLike)):
    return tokenizer_json.pick_template(getattr(source, "chat_template", None), name, "the tokenizer")
  path = Path(source)
  if path.is_dir():
    return tokenizer_json.folder_chat_template(path, name)
  if path.is_file():
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic == b"GGUF":
      from ..formats.gguf import GGUFFile

      return tokenizer_json.pick_template(GGUFFile(path).field("tokenizer.chat_template"), name, str(path))
    return path.read_text(encoding="utf-8")
  raise ValueError(f"source={str(source)!r} is neither a tokenizer, a folder nor a file")


_template_of = chat_template  # for tokenize_chat, whose argument of that name shadows it


def _environment():
  """Jinja2's immutable sandbox with transformers' settings and helpers (trim_blocks,
  lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
  does not escape HTML) and the `{% generation %}` tag."""
  import jinja2
  from jinja2 import nodes
  from jinja2.ext import Extension, loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(Extension):
    tags = {"generation"}

    def parse(self, parser):
      line = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

    def _mark(self, caller):
      return _OPEN + caller() + _CLOSE

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env


_compiled = {}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def render_chat(template: str, messages, *, add_generation_prompt=False, tools=None, **special):
  """(text, spans): `template` rendered over `messages` (keys whose value is None
  dropped, as transformers does) with `special`'s tokens (bos_token, eos_token, ...),
  and the [start, end) character spans of its generation blocks. A template that
  raises raises (jinja2's TemplateError)."""
  if not isinstance(template, str):
    raise TypeError(f"template of type {type(template).__name__} must be the template's text")
  if template not in _compiled:
    _compiled[template] = _environment().from_string(template)
  messages = _plain_messages(messages)
  text = _compiled[template].render(
    messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **special
  )
  spans, out, at = [], [], 0
  for piece in text.split(_OPEN):
    if out:  # every piece after the first opens a block
      body, sep, rest = piece.partition(_CLOSE)
      if not sep or _CLOSE in rest:
        raise ValueError("a {% generation %} block of the chat template is nested or not closed")
      spans.append((at, at + len(body)))
      piece = body + rest
    elif _CLOSE in piece:
      raise ValueError("the chat template closes a {% generation %} block it did not open")
    out.append(piece)
    at += len(piece)
  return "".join(out), spans


def _plain_messages(messages):
  if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
    raise TypeError(
      f"messages must be a list of dicts ({{'role', 'content'}}); got {type(messages).__name__}"
    )
  plain = []
  for i, m in enumerate(messages):
    for key in ("role", "content"):
      if isinstance(m.get(key), str) and (_OPEN in m[key] or _CLOSE in m[key]):
        raise ValueError(f"messages[{i}][{key!r}] holds U+E000 or U+E001, which rendering reserves")
    plain.append({k: v for k, v in m.items() if v is not None})
  return plain


def special_tokens(tokenizer) -> dict:
  """The template's variables for the tokenizer's special tokens (bos_token,
  eos_token, pad_token, unk_token), as transformers passes its special_tokens_map."""
  tok = tokenizer.to_tokenizers()
  out = {}
  for name in ("bos", "eos", "pad", "unk"):
    i = getattr(tokenizer, f"{name}_id", None)
    if i is not None and tok.id_to_token(int(i)) is not None:
      out[f"{name}_token"] = tok.id_to_token(int(i))
  return out


def tokenize_chat(
  tokenizer, messages, *, add_generation_prompt=False, chat_template=None, tools=None, assistant_mask=True
):
  """(ids, assistant_mask): `messages` rendered with the tokenizer's chat template (or
  `chat_template`, its text) and tokenized as transformers' `apply_chat_template(...,
  tokenize=True)` does (the rendered text with no special tokens added: the template
  writes them); the mask (int [len(ids)]) is 1 on every token that overlaps an
  assistant turn (the generation blocks where the template has them, else each
  assistant turn's own rendering: see the module's docstring). ValueError where there
  is no template or an assistant turn cannot be found. `assistant_mask=False`: the ids alone (no
  assistant turn is looked for)."""
  import numpy as np

  template = chat_template if chat_template is not None else _template_of(tokenizer)
  if template is None:
    raise ValueError(
      "the tokenizer has no chat template (tokenizer_config.json's chat_template, chat_template.jinja or "
      "the GGUF file's tokenizer.chat_template): pass one (chat_template=, --chat-template FILE)"
    )
  special = special_tokens(tokenizer)
  text, spans = render_chat(
    template, messages, add_generation_prompt=add_generation_prompt, tools=tools, **special
  )
  encode = lambda t: tokenizer.to_tokenizers().encode(t, add_special_tokens=False)
  encoding = encode(text)
  if not assistant_mask:
    return np.asarray(encoding.ids, np.int32)
  if not spans and not _GENERATION.search(template):
    spans = _turn_spans(template, messages, text, encoding, tools, special, add_generation_prompt)
  ids = np.asarray(encoding.ids, np.int32)
  mask = np.zeros(len(ids), np.int32)
  for t, (start, end) in enumerate(encoding.offsets):
    if any(start < e and end > s for s, e in spans):
      mask[t] = 1
  return ids, mask


def _turn_spans(template, messages, text, encoding, tools, special, add_generation_prompt=False):
  """Each assistant turn's span in `text` (tokenized as `encoding`), from one more
  rendering of the whole conversation with each assistant content between two
  private-use marks: the span runs from the content's start (or, where the template
  keeps only its end, as Qwen 3's keeps what follows an earlier turn's reasoning, from
  the start of the content's tail it kept) to the end of the last token, after the
  content, that the conversation rendered through the turn shares with `text` (the
  template's end of turn; Phi-3's EOS only after the last). The marks must change
  nothing else in the rendering."""
  for inner in (False, True):  # marks around the content, else around it less its outer whitespace
    marked = [_marked(m, inner) for m in messages]
    shown = render_chat(template, marked, add_generation_prompt=add_generation_prompt, tools=tools, **special)
    clean, marks = _unmark(shown[0])
    turns = [i for i, m in enumerate(messages) if m is not marked[i]]
    closes = [at for kind, at in marks if kind == _MARK_CLOSE]
    if clean == text and len(closes) == len(turns):
      break
  else:
    raise ValueError(
      "the chat template renders an assistant turn's text otherwise when it holds other characters, so "
      "its tokens cannot be found; use a template with {% generation %} blocks (--chat-template FILE; "
      "TRL's training templates have them)"
    )
  ends = [end for _, end in encoding.offsets]
  spans, previous = [], 0
  for i, close in zip(turns, closes):
    content = messages[i]["content"].strip() if inner else messages[i]["content"]
    opens = [at for kind, at in marks if kind == _MARK_OPEN and previous <= at <= close]
    if opens:
      start = opens[-1]
    else:  # the template kept the content's tail only
      kept = 0
      while kept < min(close, len(content)) and text[close - kept - 1] == content[len(content) - kept - 1]:
        kept += 1
      start = close - kept
      while start < close and text[start].isspace():  # a template that keeps a tail strips it
        start += 1
    if content.strip() and not text[start:close].strip():
      raise ValueError(f"messages[{i}] (assistant): the chat template leaves none of its content")
    through, through_marks = _unmark(render_chat(template, marked[: i + 1], tools=tools, **special)[0])
    after = through[[at for kind, at in through_marks if kind == _MARK_CLOSE][-1] :]
    same = 0
    while same < min(len(after), len(text) - close) and after[same] == text[close + same]:
      same += 1
    # Whole tokens only: a token the shared text cuts (a different special token that
    # starts alike) is not the turn's.
    end = max([e for e in ends if close < e <= close + same], default=close)
    spans.append((start, end))
    previous = close
  return spans


_MARK_OPEN, _MARK_CLOSE = "\ue002", "\ue003"


def _marked(message, inner: bool = False):
  """An assistant message with string content, its content between the marks (`inner`:
  inside the content's outer whitespace, for a template that trims it); the message
  itself otherwise."""
  if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
    return message
  content = message["content"]
  if _MARK_OPEN in content or _MARK_CLOSE in content:
    raise ValueError("an assistant message holds U+E002 or U+E003, which finding its tokens reserves")
  core = content.strip() if inner else content
  at = content.find(core) if core else 0
  return dict(message, content=content[:at] + _MARK_OPEN + core + _MARK_CLOSE + content[at + len(core) :])


def _unmark(shown: str):
  """(the text without the marks, [(mark, its place in that text)])."""
  out, marks = [], []
  at = 0
  for ch in shown:
    if ch in (_MARK_OPEN, _MARK_CLOSE):
      marks.append((ch, at))
    else:
      out.append(ch)
      at += 1
  return "".join(out), marks
