"""Preference pairs as TRL 1.x's DPOTrainer tokenizes them, and fitted to a row.

A pair is a prompt with a chosen and a rejected completion. Each of the two sequences
(the prompt, then one completion) is tokenized whole: a standard pair's texts with the
tokenizer's prefix (BOS where the model reads one) and EOS appended to a completion that
lacks it; a conversational pair through the chat template (the prompt with the
generation prompt, and the prompt with each completion's messages). A completion's
tokens start where its sequence parts from the prompt's own tokens (at the prompt's end
when the prompt's tokens are the sequence's start, as they almost always are), and
carry the loss weight; the prompt's carry none.

A pair is one example of two documents, chosen then rejected (`pipeline.Examples.docs`),
which the packer keeps in one row (`pipeline.Loader`), each with its own segment id and
positions from 0. A pair longer than a row is cut as TRL's `truncation_mode` cuts a
sequence: "keep_end" drops tokens from the start, "keep_start" from the end, each
sequence cut to its share of the row (the shorter keeps all it can, `fit_pair`).

Legend: T row length.
"""

from __future__ import annotations

import numpy as np

from . import chat

TRUNCATION = ("keep_end", "keep_start")


def tokenize_pair(tokenizer, record: dict, template: str | None):
  """(ids, mask, docs) of a checked preference record ({"prompt", "chosen",
  "rejected"}: `sources.check`): the chosen sequence's ids then the rejected one's,
  int32; the mask float32, 1 on the completions' tokens; docs the two lengths."""
  conversational = not isinstance(record["chosen"], str)
  if conversational:
    if template is None:
      raise ValueError("conversational pairs need a chat template (--chat-template FILE)")
    ids = lambda messages, **kw: list(
      chat.tokenize_chat(tokenizer, messages, chat_template=template, assistant_mask=False, **kw)
    )
    prompt = ids(record["prompt"], add_generation_prompt=True)
    sequences = [ids(record["prompt"] + record[c]) for c in ("chosen", "rejected")]
  else:
    eos_text = chat.special_tokens(tokenizer).get("eos_token")
    prefix = list(tokenizer.prefix())
    prompt = prefix + tokenizer.encode(record["prompt"])
    sequences = []
    for c in ("chosen", "rejected"):
      text = record[c]
      if eos_text is not None and text.endswith(eos_text):
        text = text[: -len(eos_text)]
      eos = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
      sequences.append(prefix + tokenizer.encode(record["prompt"] + text) + eos)
  out_ids, out_mask = [], []
  for seq in sequences:
    start = _shared(prompt, seq)
    if start >= len(seq):
      raise ValueError("a completion adds no token to its prompt: nothing to learn")
    out_ids += seq
    out_mask += [0.0] * start + [1.0] * (len(seq) - start)
  return np.asarray(out_ids, np.int32), np.asarray(out_mask, np.float32), [len(s) for s in sequences]


def _shared(prompt, seq) -> int:
  """How many leading tokens `seq` shares with `prompt` (at most the prompt's length)."""
  n = 0
  for a, b in zip(prompt, seq):
    if a != b:
      break
    n += 1
  return n


def fit_pair(lengths, length: int) -> tuple[int, int]:
  """How many tokens each of a pair's two sequences (`lengths`) keeps so that both fit
  `length` tokens: all where they fit; else the shorter keeps all it has up to half the
  row and the longer the rest (both half when both are longer: the chosen one the odd
  token)."""
  a, b = (int(n) for n in lengths)
  if a + b <= length:
    return a, b
  half = length // 2
  if a <= half:
    return a, length - a
  if b <= half:
    return length - b, b
  return length - half, half


def truncate_pair(ids, mask, docs, length: int, mode: str = "keep_end"):
  """(ids, mask, docs) of a pair cut to `length` tokens (`fit_pair`): each sequence
  keeps its end ("keep_end") or its start ("keep_start"), as TRL's collator cuts a
  sequence to `max_length`."""
  if mode not in TRUNCATION:
    raise ValueError(f"truncation={mode!r}: expected one of {TRUNCATION}")
  keep = fit_pair(docs, length)
  out_ids, out_mask, at = [], [], 0
  for n, k in zip(docs, keep):
    part = slice(at + n - k, at + n) if mode == "keep_end" else slice(at, at + k)
    out_ids.append(ids[part])
    out_mask.append(mask[part])
    at += n
  return np.concatenate(out_ids), np.concatenate(out_mask), list(keep)


def learns(mask, docs) -> bool:
  """Whether every document of an example has a weighted token after its first (the
  first is predicted by nothing in its row)."""
  at = 0
  for n in docs:
    if not np.any(mask[at + 1 : at + n]):
      return False
    at += n
  return True
