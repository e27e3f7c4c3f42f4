"""A bound on documents' lengths, and the ring passes it leaves (`document_bound=`).

A packed row's documents are runs of one segment id, and a query sees only keys of its
own document. If no document is longer than n tokens, no query sees a key n or more
positions away from it, as under a window of n - 1 each way: the ring needs only the
passes that bring such keys (`schedule`). Which passes those are depends on where the
layout puts each position. Contiguous shards of t tokens: ceil((n - 1) / t) back (and as
many forward when not causal). Zig-zag shards, two chunks of t / 2 each (device d holds
chunks d and 2p - 1 - d): a chunk's neighbours sit one device back on the first half of
the sequence and one device forward on the second, so k = ceil((n - 1) / (t / 2)) passes
each way. Striped: one token of each p consecutive ones per device, min(p - 1, n - 1)
back. Where the passes each way add up to the whole ring, the ring is left as it was.

The bound is a promise about data. A row that breaks it (two tokens of one id n or more
apart) would lose keys that the skipped passes hold; instead its output is NaN, that
row's only (`rows_beyond`), and a call on concrete ids raises before anything runs
(`check_concrete`). A bound that skips no pass is the unbounded call, without that
check: nothing is lost, whatever the ids.

"auto" reads the bound from the ids while running (`runtime_schedules`, `runtime_pick`):
the causal call compiles the passes of a few bounds (1, 2, 4, ... of the layout's chunks,
and the whole ring) as the branches of one switch, and a gather of every device's ids
gives each device the same index, the fewest passes that hold the batch's longest
document. Every device runs the same branch, so every transfer has its partner. Ids that
fall along a row (an id may then come back after another) take the whole ring, so no ids
can lose a key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring import layouts


def reach(bound: int | None, window, is_causal: bool) -> tuple[int, int] | None:
  """(left, right): how far back and ahead of a query its keys can lie, under the
  bound and the window together; None when the bound adds nothing to the window."""
  if bound is None:
    return None
  left = right = bound - 1
  if window is not None:
    if window[0] <= left and (is_causal or window[1] <= right):
      return None  # the window alone is as tight: the bound changes no pass
    left, right = min(left, window[0]), min(right, window[1])
  return left, 0 if is_causal else right


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
  """A device's positions as runs [first, last] of consecutive integers."""
  cuts = np.flatnonzero(np.diff(row) != 1) + 1
  return [(int(part[0]), int(part[-1])) for part in np.split(row, cuts)]


def schedule(layout: str, left: int, right: int, shard_len: int, ring_size: int) -> tuple[int, int]:
  """(steps_back, steps_fwd): the fewest passes each way that bring every key within
  `left` positions before a query or `right` after it, in `layout` (the full ring,
  (ring_size - 1, 0), where the two ways would make as many passes)."""
  p = ring_size
  full = (p - 1, 0)
  if p == 1:
    return full
  if layouts.resolve(layout, False) == "striped":
    # Device d holds positions d, d + p, ...: the token o back lies o devices back.
    back = min(p - 1, left)
    fwd = min(p - 1 - back, right)
    return (back, fwd) if back + fwd < p - 1 else full
  runs = [_runs(row) for row in layouts.positions(layout, p, shard_len)]

  def sees(q_runs, k_runs) -> bool:  # some query q and key k with -right <= q - k <= left
    return any(a - e <= left and b - c >= -right for a, b in q_runs for c, e in k_runs)

  needed = {o for o in range(p) for d in range(p) if sees(runs[d], runs[(d - o) % p])}
  best = full
  for back in range(p):
    later = [o for o in needed if o > back]
    fwd = p - min(later) if later else 0
    if back + fwd < best[0] + best[1]:
      best = (back, fwd)
  return best


def check_concrete(segment_ids, bound: int, *, order=None, name: str = "segment_ids") -> None:
  """ValueError naming the first row with two tokens of one (non-negative) id
  `bound` or more positions apart; nothing for traced ids (the call's own check,
  `rows_beyond`, covers them). `order`: the indices that put the ids in natural order."""
  if isinstance(segment_ids, jax.core.Tracer):
    return
  ids = np.asarray(segment_ids)
  if order is not None:
    ids = ids[..., order]
  for row, line in enumerate(ids.reshape(-1, ids.shape[-1])):
    # Sorted by id, positions ascending within each: every token's distance from its
    # id's first one (O(T log T) a row).
    at = np.flatnonzero(line >= 0)
    by_id = np.argsort(line[at], kind="stable")
    values, places = line[at][by_id], at[by_id]
    starts = np.concatenate([[True], values[1:] != values[:-1]])
    first = np.maximum.accumulate(np.where(starts, np.arange(len(values)), 0))
    far = np.flatnonzero(places - places[first] >= bound)
    if far.size:
      value = values[far[0]]
      at = np.flatnonzero(line == value)
      raise ValueError(
        f"document_bound={bound}: {name} row {row} has id {int(value)} at positions {int(at[0])} "
        f"and {int(at[-1])}, {int(at[-1] - at[0])} apart; every document must lie within "
        f"{bound} tokens (raise document_bound, or leave it None to run every ring pass)"
      )


def rows_beyond(seg, pos, axis_name, bound: int):
  """bool [B]: rows where two tokens of one id lie `bound` or more positions apart,
  over the whole ring (inside shard_map: `seg` [B, t] this device's ids, negative on
  padding; `pos` [t] their global positions, negative on padding)."""
  seg = lax.all_gather(seg, axis_name, axis=1, tiled=True)
  pos = lax.all_gather(pos, axis_name, axis=0, tiled=True)
  pos = jnp.broadcast_to(pos, seg.shape)
  valid = (seg >= 0) & (pos >= 0)
  top = jnp.iinfo(jnp.int32).max
  key = jnp.where(valid, seg, top)
  key, pos = lax.sort((key, jnp.where(valid, pos, top)), dimension=1, num_keys=2)
  # Sorted by (id, position): a run of one id starts where the id changes; each
  # token's distance from its run's first token is its distance from the id's first.
  index = jnp.arange(key.shape[1])
  starts = jnp.concatenate([jnp.ones_like(key[:, :1], bool), key[:, 1:] != key[:, :-1]], axis=1)
  first = lax.cummax(jnp.where(starts, index, 0), axis=1)
  span = pos - jnp.take_along_axis(pos, first, axis=1)
  return jnp.any((key != top) & (span >= bound), axis=1)


# `document_bound="auto"`: the bound read from the ids while running. The call compiles
# the passes of a few bounds (`runtime_schedules`: one chunk of the layout, two, four, ...
# and the whole ring), and every device runs the same one (`runtime_pick`).


def runtime_schedules(layout: str, shard_len: int, ring_size: int) -> list[tuple[int | None, tuple]]:
  """[(reach, (steps_back, steps_fwd)), ...], fewest passes first: the causal schedules a
  run-time bound picks from, each with the longest reach it serves (a query's distance
  back to its document's first token; `schedule` at that reach), the last the whole
  ring (reach None: any). The reaches are 1, 2, 4, ... of the layout's chunks (a shard
  contiguous, half a shard zig-zag). Empty where there is nothing to pick: one device,
  the striped layout (one token of each p on each device), or a chunk's first bound
  already the whole ring."""
  p = ring_size
  full = (p - 1, 0)
  name = layouts.resolve(layout, False)
  unit = shard_len if name == "contiguous" else shard_len // 2
  if p == 1 or name == "striped" or unit < 1:
    return []
  out, chunks = [], 1
  while (found := schedule(name, chunks * unit, 0, shard_len, p)) != full:
    out.append((chunks * unit, found))
    chunks *= 2
  return [*out, (None, full)] if out else []


def runtime_pick(seg, pos, axis_name, reaches):
  """int32 scalar, the same on every device of the ring: the index of the first of
  `reaches` (ascending) that covers this batch's documents, `len(reaches)` (the whole
  ring) where none does or where a row's ids decrease (its documents may then not be
  runs, and only the whole ring is sure to hold their keys); the largest over the
  program's other manual mesh axes (data-parallel rings pick alike). Inside shard_map: `seg`
  [B, t] this device's ids, negative on padding; `pos` [t] their global positions,
  negative on padding. A document's reach is its last token's distance from its first;
  ids that rise along each row make each id one run (padding between two tokens of an
  id counts in its reach)."""
  seg = lax.all_gather(seg, axis_name, axis=1, tiled=True)
  pos = lax.all_gather(pos, axis_name, axis=0, tiled=True)
  b, total = seg.shape
  where = jnp.where(pos >= 0, pos, total)  # padding lands past the end and is dropped
  ids = jnp.full((b, total), -1, seg.dtype).at[:, where].set(seg, mode="drop")  # natural order
  valid = ids >= 0
  ids = jnp.where(valid, ids, -1)
  # The largest id before each token: a rising row's tokens of one id start where it is passed.
  before = jnp.concatenate([jnp.full((b, 1), -1, ids.dtype), lax.cummax(ids, axis=1)[:, :-1]], axis=1)
  falls = jnp.any(valid & (ids < before))
  index = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total))
  first = lax.cummax(jnp.where(valid & (ids > before), index, -1), axis=1)
  reach = jnp.max(jnp.where(valid, index - first, 0))
  pick = jnp.sum(reach > jnp.asarray(reaches, jnp.int32)).astype(jnp.int32)
  pick = jnp.where(falls, jnp.int32(len(reaches)), pick)
  # The other manual axes (a batch split over data-parallel rings, heads, Ulysses): the
  # largest pick of all, so that every device of the program runs the same branch.
  ring = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
  others = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a not in ring)
  return lax.pmax(pick, others) if others else pick


def picked_schedule(ids, layout: str, shard_len: int, ring_size: int) -> tuple[int, int] | None:
  """The schedule `runtime_pick` chooses for concrete ids (int [..., T] in natural
  order, negative on padding), on the host; None where "auto" picks nothing (no
  schedules to pick from: every pass runs)."""
  schedules = runtime_schedules(layout, shard_len, ring_size)
  if not schedules:
    return None
  reach = 0
  for line in np.asarray(ids).reshape(-1, np.shape(ids)[-1]):
    at = np.flatnonzero(line >= 0)
    values = line[at]
    if np.any(np.diff(values) < 0):
      return schedules[-1][1]
    for value in np.unique(values):
      where = at[values == value]
      reach = max(reach, int(where[-1] - where[0]))
  return next(found for limit, found in schedules if limit is None or reach <= limit)
