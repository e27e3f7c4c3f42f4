"""Tokenizers of the checkpoints users have: a Hugging Face `tokenizer.json` (Hugging
Face's `tokenizers` package), a GGUF file's byte-level BPE vocabulary (Llama 3, Qwen:
`tokenizer.ggml.model` "gpt2") and its SentencePiece one (Gemma: "llama").

Each gives `encode(text) -> list[int]` (no BOS), `decode(ids) -> str`, `bos_id`,
`eos_id`, `pad_id`, `add_bos` (whether the model reads BOS before a text) and
`prefix()` ([bos_id] or []), `vocab_size`, `special_ids` (the control tokens a chat template
uses, by their text) and `to_tokenizers()`, the same tokenizer as a
`tokenizers.Tokenizer` (what `models.save` writes as tokenizer.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Pre-tokenizer patterns by GGUF's `tokenizer.ggml.pre`, as the models' own tokenizer.json
# files give them (Meta's Llama 3, Qwen's Qwen 2/3) and llama.cpp's llama-vocab.cpp names
# them; with the NFC normalizer Qwen's tokenizer.json has, and whether a word already in
# the vocabulary skips the merges (Llama 3's "ignore_merges"). "gpt-4o" (Phi-4-mini) is
# OpenAI's o200k_base split (tiktoken's pattern: words split before capitals, an
# apostrophe suffix kept with its word, digits in threes).
BPE_PRE = {
  "llama-bpe": (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    False,
    True,
  ),
  "gpt-4o": (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    False,
    False,
  ),
  "qwen2": (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    True,
    False,
  ),
}
CONTROL, USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's llama_token_type)


def import_tokenizers():
  try:
    import tokenizers
  except ImportError as e:  # pragma: no cover - the extra is installed by the run scripts
    raise ImportError(
      "tokenizer.json and GGUF BPE vocabularies need the tokenizers package: "
      'pip install -e ".[models]" in the checkout'
    ) from e
  return tokenizers


def _check_text(text):
  if not isinstance(text, str):
    raise TypeError(f"text of type {type(text).__name__} must be a str")


def _ids(ids) -> list[int]:
  return [int(i) for i in np.asarray(ids).reshape(-1)]


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the model's special ids. From a tokenizer.json
  (`from_folder`) or a GGUF byte-level BPE vocabulary (`from_gguf`)."""

  def __init__(self, tokenizer, *, bos_id=None, eos_id=None, pad_id=None, add_bos: bool = False):
    self._tok = tokenizer
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.add_bos = bool(add_bos) and bos_id is not None
    self.chat_template = None  # the template's text where the files carry one (`models.chat_template`)
    self.special_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    _check_text(text)
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def prefix(self) -> list[int]:
    """What the model reads before a text: [bos_id] where it was trained with BOS
    (`add_bos`: Llama 3, Gemma), else nothing (Qwen, whose config names a BOS it never
    reads)."""
    return [self.bos_id] if self.add_bos else []

  def decode(self, ids) -> str:
    return self._tok.decode(_ids(ids), skip_special_tokens=False)

  def to_tokenizers(self):
    return self._tok

  @classmethod
  def from_folder(cls, folder: Path) -> HFTokenizer:
    """tokenizer.json of a Hugging Face folder, its special tokens from
    tokenizer_config.json (bos_token, eos_token, pad_token) or config.json's ids."""
    tokenizers = import_tokenizers()
    path = folder / "tokenizer.json"
    try:
      tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a malformed file
      raise ValueError(f"{str(path)!r} is not a tokenizer.json the tokenizers package reads: {e}") from e
    ids = {}
    for name in ("bos", "eos", "pad"):
      ids[name] = _special_id(tok, folder, name)
    add_bos = _adds_bos(tok, folder, ids["bos"])
    out = cls(tok, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], add_bos=add_bos)
    out.chat_template = folder_chat_template(folder)
    return out

  @classmethod
  def from_gguf(cls, gguf_file) -> HFTokenizer:
    """The byte-level BPE ("gpt2") vocabulary of a GGUF file: its tokens, merges and
    pre-tokenizer (`tokenizer.ggml.pre`), control and user-defined tokens as added
    tokens."""
    tokenizers = import_tokenizers()
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    where = str(gguf_file.path)
    pre = gguf_file.field("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE:
      raise ValueError(
        f"tokenizer.ggml.pre={pre!r} of {where!r}: a pre-tokenizer this loader does not know; "
        f"supported: {tuple(BPE_PRE)}"
      )
    pattern, nfc, ignore_merges = BPE_PRE[pre]
    pieces = list(gguf_file.field("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in gguf_file.field("tokenizer.ggml.merges", [])]
    types = gguf_file.field("tokenizer.ggml.token_type", [1] * len(pieces))
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
      tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
      ]
    )
    tok.decoder = decoders.ByteLevel()
    add_pieces(tok, pieces, types)
    field = lambda key: gguf_file.field(f"tokenizer.ggml.{key}_token_id")
    # llama.cpp adds BOS to a BPE vocabulary's text only where the file says so.
    add_bos = bool(gguf_file.field("tokenizer.ggml.add_bos_token", False))
    out = cls(tok, bos_id=field("bos"), eos_id=field("eos"), pad_id=field("padding"), add_bos=add_bos)
    out.chat_template = gguf_file.field("tokenizer.chat_template")
    return out


def folder_chat_template(folder: Path, name: str | None = None) -> str | None:
  """A Hugging Face folder's chat template: tokenizer_config.json's "chat_template" (a
  string, or the one named `name`, default "default", of a list), else the text of
  chat_template.jinja beside it; None where there is neither."""
  config = folder / "tokenizer_config.json"
  if config.is_file():
    found = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if found is not None:
      return pick_template(found, name, str(config))
  jinja = folder / "chat_template.jinja"
  return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def pick_template(found, name, where):
  """`found` (a template, None, or transformers' list of {"name", "template"}) as one
  template: the one named `name` (default "default") of a list."""
  if found is None or isinstance(found, str):
    if name is not None and found is not None:
      raise ValueError(f"name={name!r}: {where} has one unnamed chat template")
    return found
  if isinstance(found, list):
    named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
    want = name or "default"
    if want not in named:
      raise ValueError(f"name={want!r}: {where}'s chat templates are named {sorted(map(str, named))}")
    return named[want]
  raise ValueError(f"{where}: chat_template of type {type(found).__name__}, expected a string or a list")


def add_pieces(tok, pieces, types) -> None:
  """A GGUF vocabulary's control pieces as special added tokens and its user-defined
  ones as added tokens, each matched in the text as written (not normalized)."""
  from tokenizers import AddedToken

  added = [
    AddedToken(p, special=(t == CONTROL), normalized=False)
    for p, t in zip(pieces, types)
    if t in (CONTROL, USER_DEFINED)
  ]
  tok.add_special_tokens([a for a in added if a.special])
  tok.add_tokens([a for a in added if not a.special])


def _special_id(tok, folder: Path, name: str):
  """The id of the bos/eos/pad token: tokenizer_config.json's `{name}_token`, else
  config.json's `{name}_token_id` (the first of a list)."""
  tc = folder / "tokenizer_config.json"
  if tc.is_file():
    value = json.loads(tc.read_text()).get(f"{name}_token")
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str) and tok.token_to_id(value) is not None:
      return tok.token_to_id(value)
  for source in ("config.json", "generation_config.json"):
    path = folder / source
    if path.is_file():
      value = json.loads(path.read_text()).get(f"{name}_token_id")
      if isinstance(value, list):
        value = value[0] if value else None
      if isinstance(value, int):
        return value
  return None


def _adds_bos(tok, folder: Path, bos_id) -> bool:
  """Whether the folder's tokenizer puts BOS before a text, as transformers encodes it:
  tokenizer_config.json's `add_bos_token` where it says (Llama 2's and Gemma's
  tokenizer classes read it), else tokenizer.json's post-processor (Llama 3's template)."""
  if bos_id is None:
    return False
  tc = folder / "tokenizer_config.json"
  if tc.is_file():
    flag = json.loads(tc.read_text()).get("add_bos_token")
    if isinstance(flag, bool):
      return flag
  ids = tok.encode("a", add_special_tokens=True).ids
  return bool(ids) and ids[0] == bos_id


def sentencepiece_to_tokenizers(pieces, scores, types, *, unk_id: int, add_space_prefix: bool):
  """A SentencePiece BPE vocabulary (GGUF's "llama" model: pieces with "▁" for spaces,
  scores, token types) as a `tokenizers.Tokenizer` that tokenizes the same way: the
  merges are every split of a normal piece into two pieces, ranked by the merged
  piece's score (SentencePiece merges the pair whose result scores highest), with byte
  fallback, and control and user-defined pieces as added tokens."""
  tokenizers = import_tokenizers()
  from tokenizers import decoders, models, normalizers

  vocab = {p: i for i, p in enumerate(pieces)}
  normal = [(i, p) for i, (p, t) in enumerate(zip(pieces, types)) if t == 1]
  ranked = []
  for i, p in normal:
    for cut in range(1, len(p)):
      left, right = p[:cut], p[cut:]
      a, b = vocab.get(left), vocab.get(right)
      if a is not None and b is not None and types[a] == 1 and types[b] == 1:
        ranked.append((-float(scores[i]), a, b, left, right))
  ranked.sort()
  merges = [(left, right) for _, _, _, left, right in ranked]
  model = models.BPE(vocab=vocab, merges=merges, unk_token=pieces[unk_id], fuse_unk=True, byte_fallback=True)
  tok = tokenizers.Tokenizer(model)
  steps = [normalizers.Replace(" ", "\u2581")]
  if add_space_prefix:
    steps.insert(0, normalizers.Prepend("\u2581"))
  tok.normalizer = normalizers.Sequence(steps)
  tok.decoder = decoders.Sequence(
    [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
  )
  add_pieces(tok, pieces, types)
  return tok


def save_tokenizer(tokenizer, folder: Path, *, context_length: int) -> None:
  """tokenizer.json and tokenizer_config.json (as transformers writes them, so that
  `AutoTokenizer.from_pretrained(folder)` reads them) of any tokenizer here. Where the
  model reads BOS before a text (`add_bos`), tokenizer.json's post-processor adds it, as
  Llama 3's and Gemma's own files do: transformers' encoding of a text with its special
  tokens is what the model was trained on."""
  from tokenizers import Tokenizer, processors

  tok = Tokenizer.from_str(tokenizer.to_tokenizers().to_str())  # a copy: the caller's stays as it is
  name = lambda i: None if i is None else tok.id_to_token(int(i))
  add_bos = bool(getattr(tokenizer, "add_bos", False))
  if add_bos:
    bos = name(tokenizer.bos_id)
    tok.post_processor = processors.TemplateProcessing(
      single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(tokenizer.bos_id))]
    )
  tok.save(str(folder / "tokenizer.json"))
  decoder = tok.get_added_tokens_decoder()
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": add_bos,
    "add_eos_token": False,
    "bos_token": name(tokenizer.bos_id),
    "eos_token": name(tokenizer.eos_id),
    "pad_token": name(tokenizer.pad_id),
    "model_max_length": context_length,
    "clean_up_tokenization_spaces": False,
    **({"chat_template": tokenizer.chat_template} if getattr(tokenizer, "chat_template", None) else {}),
    "added_tokens_decoder": {
      str(i): {
        "content": t.content,
        "special": t.special,
        "normalized": t.normalized,
        "lstrip": t.lstrip,
        "rstrip": t.rstrip,
        "single_word": t.single_word,
      }
      for i, t in sorted(decoder.items())
    },
  }
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
