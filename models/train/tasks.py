"""Training tasks: batches that are pure functions of (seed, step, row).

A task yields `Batch(tokens, targets, weights)`: the model reads `tokens` [B, T] and is
scored on `targets` [B, T] where `weights` [B, T] is non-zero: 1 marks the answer
tokens (what accuracy counts), a weight in (0, 1) a position that only adds to the loss.
Every row is drawn from its own generator seeded by (seed, step, row), so a process in
a multi-host run can build just the rows it holds, and a resumed run sees exactly the
batches an uninterrupted run would.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
  tokens: np.ndarray  # int32 [B, T]
  targets: np.ndarray  # int32 [B, T]: the token expected at each position
  weights: np.ndarray  # float32 [B, T]: 1 on answer tokens, (0, 1) loss only, 0 unscored


def row_rng(seed: int, step: int, row: int) -> np.random.Generator:
  """The generator of one row of one step's batch."""
  return np.random.default_rng([seed, step, row])


def rows_of(rows, batch_size: int) -> range:
  """The row indices `rows` names (a range or slice; None: the whole batch)."""
  if rows is None:
    return range(batch_size)
  if isinstance(rows, slice):
    return range(*rows.indices(batch_size))
  return rows


@dataclasses.dataclass(frozen=True)
class KeyValueTask:
  """Key-value retrieval over filler tokens.

  Vocabulary: fillers, pair tokens (one per (key, value)), query tokens (one per key),
  answer tokens (one per value). A few pair tokens sit in the first `pair_region`
  positions; the last token asks for one key, and the model must answer that key's
  value at the last position. With the sequence split over devices the pairs live on
  the first device and the question on the last: exact (ring) attention reaches them,
  shard-local attention cannot.
  """

  seq_len: int = 256
  num_pairs: int = 3
  num_keys: int = 4
  num_values: int = 8
  num_fillers: int = 32
  pair_region: int = 32  # pairs sit in the first `pair_region` tokens

  @property
  def pair_base(self):
    return self.num_fillers

  @property
  def query_base(self):
    return self.pair_base + self.num_keys * self.num_values

  @property
  def answer_base(self):
    return self.query_base + self.num_keys

  @property
  def vocab_size(self):
    return self.answer_base + self.num_values

  @property
  def chance(self):
    return 1.0 / self.num_values

  def row(self, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(tokens int [T], answer token) of one example."""
    t = self.seq_len
    tokens = rng.integers(0, self.num_fillers, size=t)
    region = min(self.pair_region, t - 1)
    keys = rng.choice(self.num_keys, self.num_pairs, replace=False)
    values = rng.integers(0, self.num_values, self.num_pairs)
    where = rng.choice(region, self.num_pairs, replace=False)
    tokens[where] = self.pair_base + keys * self.num_values + values
    pick = rng.integers(self.num_pairs)
    tokens[t - 1] = self.query_base + keys[pick]
    return tokens, self.answer_base + values[pick]

  def batch(self, seed: int, step: int, batch_size: int, rows=None) -> Batch:
    """The rows `rows` (default all) of batch `step`: the answer is scored at the last
    position."""
    rows = rows_of(rows, batch_size)
    tokens = np.zeros((len(rows), self.seq_len), np.int32)
    targets = np.zeros_like(tokens)
    weights = np.zeros(tokens.shape, np.float32)
    for i, r in enumerate(rows):
      tokens[i], targets[i, -1] = self.row(row_rng(seed, step, r))
    weights[:, -1] = 1.0
    return Batch(tokens, targets, weights)


# The repository's data/ (models/<here>/this file: three folders up).
DATA = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "data", "shakespeare"
)

NAMES = (
  "Ada", "Basil", "Cora", "Dion", "Edda", "Faro", "Gwen", "Hal", "Ines", "Jory", "Kit", "Lark",
  "Mira", "Ned", "Oona", "Pell", "Quin", "Rosa", "Sten", "Tam", "Ugo", "Vera", "Wren", "Yael",
)  # fmt: skip


@functools.cache
def corpus(directory: str = DATA) -> np.ndarray:
  """The bytes of every .txt file in `directory` (sorted by name), one uint8 array."""
  files = sorted(f for f in os.listdir(directory) if f.endswith(".txt"))
  if not files:
    raise ValueError(f"no .txt files in {directory!r}")
  chunks = []
  for name in files:
    with open(os.path.join(directory, name), "rb") as f:
      chunks.append(np.frombuffer(f.read(), np.uint8))
  return np.concatenate(chunks)


def encode(text: str) -> np.ndarray:
  """Byte tokens of ASCII `text`."""
  return np.frombuffer(text.encode("ascii"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
  """The text of byte tokens (bytes outside ASCII shown as '?')."""
  return bytes(int(t) if 0 <= int(t) < 128 else 63 for t in tokens).decode("ascii")


def _word_start(hay: np.ndarray, cut: int, reach: int = 16) -> int:
  """The first index at or after `cut` (within `reach`) that starts a word, else `cut`."""
  for i in range(cut, min(cut + reach, len(hay))):
    if i == 0 or hay[i - 1] in (32, 10):
      return i
  return cut


@dataclasses.dataclass(frozen=True)
class NeedleTask:
  """Needle in a haystack over real text, tokenized as bytes (vocabulary 256).

  Each row is a window of `seq_len` bytes: Shakespeare (data/shakespeare) with
  `needles` sentences "The code of <name> is <digits>." planted at random depths, then
  a question that repeats one needle's words up to its value, "\\nThe code of <name>
  is ", and the value's `digits` bytes. The model is scored on the value's bytes only
  (teacher forcing); a row is right when every one of them is the argmax. The question's
  own bytes after its newline add to the loss with `question_weight` (they repeat the
  needle's words, so predicting them trains the same copying from far away), and every
  other byte with `text_weight` (next-byte prediction on the text, which teaches the
  byte-level features the copying builds on).

  With the sequence split over p devices, the needle's depth decides which shard holds
  it: shard-local attention can answer only when the needle shares the question's
  (last) shard; ring attention sees every shard.

  `depth` fixes the needle's depth as a fraction range [lo, hi) of the haystack (for
  the evaluation's depth bins; None: uniform). The window start in the corpus, the
  names, values and depths are drawn from the row's generator.
  """

  seq_len: int = 2048
  needles: int = 1
  digits: int = 4
  depth: tuple[float, float] | None = None
  question_weight: float = 0.5
  text_weight: float = 0.1

  def __post_init__(self):
    if not 1 <= self.needles <= len(NAMES):
      raise ValueError(f"NeedleTask.needles={self.needles!r} must be in [1, {len(NAMES)}]")
    if not 1 <= self.digits <= 9:
      raise ValueError(f"NeedleTask.digits={self.digits!r} must be in [1, 9]")
    room = self.seq_len + 1 - self.question_len - self.needles * self.needle_len
    if room < self.needle_len:
      raise ValueError(
        f"NeedleTask.seq_len={self.seq_len} leaves no haystack for {self.needles} needle(s) of "
        f"{self.needle_len} bytes and a question of {self.question_len}"
      )
    if self.depth is not None and not 0.0 <= self.depth[0] < self.depth[1] <= 1.0:
      raise ValueError(f"NeedleTask.depth={self.depth!r} must be (lo, hi) with 0 <= lo < hi <= 1")

  vocab_size = 256

  @property
  def chance(self):
    return 10.0**-self.digits

  @property
  def needle_len(self) -> int:
    return len(self.needle_text("W" * max(map(len, NAMES)), "0" * self.digits))

  @property
  def question_len(self) -> int:
    return len(self.question_text("W" * max(map(len, NAMES)))) + self.digits

  @staticmethod
  def needle_text(name: str, value: str) -> str:
    return f" The code of {name} is {value}. "

  @staticmethod
  def question_text(name: str) -> str:
    return f"\nThe code of {name} is "

  def example(self, rng: np.random.Generator):
    """(bytes [seq_len + 1] of one example, answer start index, needle depths in [0, 1))."""
    text = corpus()
    names = rng.choice(len(NAMES), self.needles, replace=False)
    values = ["".join(map(str, rng.integers(0, 10, self.digits))) for _ in names]
    ask = int(rng.integers(self.needles))
    question = encode(self.question_text(NAMES[names[ask]]) + values[ask])
    needles = [encode(self.needle_text(NAMES[n], v)) for n, v in zip(names, values)]
    hay_len = self.seq_len + 1 - len(question) - sum(len(x) for x in needles)
    start = int(rng.integers(0, len(text) - hay_len))
    hay = text[start : start + hay_len].astype(np.int32)
    lo, hi = self.depth or (0.0, 1.0)
    cuts = np.sort(rng.uniform(lo, hi, self.needles) * hay_len).astype(int)
    cuts = [_word_start(hay, c) for c in cuts]
    pieces, depths, prev = [], [], 0
    for cut, needle in zip(cuts, needles):
      pieces += [hay[prev:cut], needle]
      depths.append(cut / hay_len)
      prev = cut
    pieces += [hay[prev:], question]
    seq = np.concatenate(pieces)
    return seq, len(seq) - self.digits, depths[ask]  # needle i sits at the i-th sorted cut

  def row(self, rng: np.random.Generator):
    """(tokens [T], targets [T], weights [T], depth of the asked needle)."""
    seq, answer, depth = self.example(rng)
    weights = np.full(self.seq_len, self.text_weight, np.float32)
    newline = answer - 1 - int(np.argmax(seq[answer - 1 :: -1] == 10))  # the question's "\n"
    weights[newline : answer - 1] = self.question_weight  # targets: the question's words
    weights[answer - 1 :] = 1.0  # targets[i] = seq[i + 1]: the value's bytes
    return seq[:-1], seq[1:], weights, depth

  def batch(self, seed: int, step: int, batch_size: int, rows=None) -> Batch:
    """The rows `rows` (default all) of batch `step`."""
    rows = rows_of(rows, batch_size)
    tokens = np.zeros((len(rows), self.seq_len), np.int32)
    targets = np.zeros_like(tokens)
    weights = np.zeros(tokens.shape, np.float32)
    for i, r in enumerate(rows):
      tokens[i], targets[i], weights[i], _ = self.row(row_rng(seed, step, r))
    return Batch(tokens, targets, weights)
