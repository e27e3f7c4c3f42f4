"""Examples packed into rows of a fixed length, best-fit decreasing: the longest example
first, each into the fullest row it still fits (a new row where none has room). Each
example is a segment of its row: its own segment id, positions from 0, and a loss weight
of 0 on its first token, so that no token attends to, or is predicted from, another
example (the model's `segment_ids` and `positions`).

An example longer than a row is split into pieces of a row each (the last shorter) that
go on in consecutive rows with their positions continuing, truncated to a row, or
dropped (`long`).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

LONG = ("split", "truncate", "drop")


@dataclasses.dataclass(frozen=True)
class Piece:
  """Tokens [start, stop) of example `example`, packed into a row."""

  example: int
  start: int
  stop: int


def plan(lengths, length: int, *, long: str = "split") -> tuple[list[list[Piece]], list[int]]:
  """(rows, dropped): each row the pieces it holds in order, from the examples' token
  counts `lengths`; `dropped` the examples left out (empty ones, and longer ones with
  long="drop"). Deterministic: ties go to the earlier example and the earlier row."""
  if isinstance(length, bool) or not isinstance(length, int) or length < 1:
    raise ValueError(f"length={length!r} must be a positive int (tokens a row)")
  if long not in LONG:
    raise ValueError(f"long={long!r}: expected one of {LONG}")
  rows: list[list[Piece]] = []
  free: list[
    tuple[int, int]
  ] = []  # (room left, row), sorted: the fullest row that fits is found by bisection
  dropped, whole = [], []
  for i, n in enumerate(int(n) for n in lengths):
    if n <= 0 or (n > length and long == "drop"):
      dropped.append(i)
    elif n > length and long == "split":
      full, rest = divmod(n, length)
      rows.extend([Piece(i, k * length, (k + 1) * length)] for k in range(full))
      if rest:  # the last piece opens the next row, which later examples may fill
        rows.append([Piece(i, full * length, n)])
        bisect.insort(free, (length - rest, len(rows) - 1))
    else:
      whole.append((min(n, length), i))
  for n, i in sorted(whole, key=lambda x: (-x[0], x[1])):
    at = bisect.bisect_left(free, (n, -1))
    if at == len(free):
      rows.append([Piece(i, 0, n)])
      room, row = length - n, len(rows) - 1
    else:
      room, row = free.pop(at)
      rows[row].append(Piece(i, 0, n))
      room -= n
    if room:
      bisect.insort(free, (room, row))
  return rows, dropped


def fill(pieces, examples, length: int, *, pad_id: int = 0, docs=None) -> dict:
  """One row from its pieces: "tokens" and "segment_ids" (1, 2, ... a piece; 0 on
  padding) and "positions" int32 [length], "loss_mask" float32 [length] (the piece's
  weights, 0 on its first token, which nothing before it in the row predicts). `docs`:
  each example's documents' lengths (None: one document an example): a whole example
  of several (a preference pair) gives each its own segment, positions from 0."""
  tokens = np.full(length, pad_id, np.int32)
  segments = np.zeros(length, np.int32)
  positions = np.zeros(length, np.int32)
  weights = np.zeros(length, np.float32)
  at, k = 0, 0
  for p in pieces:
    ids, mask = examples[p.example]
    parts = docs[p.example] if docs is not None and docs[p.example] is not None else [p.stop - p.start]
    if len(parts) > 1 and (p.start, p.stop) != (0, len(ids)):
      raise ValueError(f"example {p.example} of {len(parts)} documents is cut into pieces: pack it whole")
    start = p.start
    for n in parts:
      k += 1
      tokens[at : at + n] = ids[start : start + n]
      segments[at : at + n] = k
      positions[at : at + n] = np.arange(start, start + n) - (0 if len(parts) == 1 else start)
      weights[at : at + n] = mask[start : start + n]
      weights[at] = 0.0
      at, start = at + n, start + n
  return dict(tokens=tokens, segment_ids=segments, positions=positions, loss_mask=weights)


def check_examples(examples) -> list[tuple[np.ndarray, np.ndarray]]:
  """The examples as (int32 ids, float32 loss mask) pairs; TypeError or ValueError
  naming the first that is not an (ids, loss_mask) pair of one length."""
  out = []
  for i, example in enumerate(examples):
    if not isinstance(example, (tuple, list)) or len(example) != 2:
      raise TypeError(f"examples[{i}] must be an (ids, loss_mask) pair; got {type(example).__name__}")
    ids, mask = np.asarray(example[0]), np.asarray(example[1])
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
      raise TypeError(f"examples[{i}]: ids of shape {ids.shape} and dtype {ids.dtype}, expected int [n]")
    if mask.shape != ids.shape:
      raise ValueError(f"examples[{i}]: loss_mask of shape {mask.shape} must be the ids' {ids.shape}")
    out.append((ids.astype(np.int32), mask.astype(np.float32)))
  return out


def pack(examples, length: int, *, long: str = "split", pad_id: int = 0) -> list[dict]:
  """`examples` (a sequence of (ids, loss_mask): int and float arrays of one length,
  the mask the weight of each token) packed into rows of `length` tokens, best-fit
  decreasing (`plan`): a list of dicts of [length] arrays "tokens" (int32; `pad_id` on
  padding), "segment_ids" (int32: 1, 2, ... an example in the row, 0 only on padding),
  "positions" (int32: 0 at each example's first token, continuing over the pieces of a
  split one) and "loss_mask" (float32: the weight of predicting that token from the one
  before it, so 0 on each piece's first token and on padding). Every example appears
  once, whole or split (`long`: "split", "truncate" to a row, or "drop" those longer
  than a row); empty examples are left out."""
  examples = check_examples(examples)
  rows, _ = plan([len(ids) for ids, _ in examples], length, long=long)
  return [fill(pieces, examples, length, pad_id=pad_id) for pieces in rows]


def padding_fraction(rows) -> float:
  """The fraction of the rows' tokens that are padding (segment id 0)."""
  total = sum(len(r["segment_ids"]) for r in rows)
  return sum(int(np.sum(r["segment_ids"] == 0)) for r in rows) / max(total, 1)
