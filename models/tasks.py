"""Training tasks: batches that are pure functions of (seed, step, row).

A task yields `Batch(tokens, targets, weights)`: the model reads `tokens` [B, T] and is
scored on `targets` [B, T] where `weights` [B, T] is non-zero (the answer tokens).
Every row is drawn from its own generator seeded by (seed, step, row), so a process in
a multi-host run can build just the rows it holds, and a resumed run sees exactly the
batches an uninterrupted run would.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
  tokens: np.ndarray  # int32 [B, T]
  targets: np.ndarray  # int32 [B, T]: the token expected at each position
  weights: np.ndarray  # float32 [B, T]: 1 where the position is scored, else 0


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
