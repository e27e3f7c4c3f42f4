"""Token layouts over a ring of p devices, and the permutations between them.

A layout says which global positions each device holds. Ring attention computes its
masks from these positions, so every layout gives the same result; layouts differ only
in how evenly causal work is spread over the devices.

- "contiguous": device i holds [i*c, (i+1)*c), c = T/p.
- "striped": device i holds positions t with t mod p == i (T divisible by p*p internally).
- "zigzag": the sequence is cut into 2p chunks; device i holds chunks i and 2p-1-i.
- "auto": zigzag for causal attention, contiguous otherwise; contiguous also for causal
  attention over short shards (at most SHORT_CAUSAL_SHARD tokens a device) where the
  caller gives the shard length (`ring_attention`, `work_report`).

`documents(segment_ids, p)` builds a layout for one packed row from its documents (every
device the same causal score work), returned as a permutation whose shards are the
ring's `positions`.

A model that keeps its activations in one layout through every layer calls
`permutation` once at the input (and `inverse_permutation` at the output), passes the
permuted positions to its rotary embeddings, and calls `ring_attention(...,
token_order="layout")`, which then moves nothing but the ring's K/V
(`models.DecoderLM` with `LMConfig.ring_order`).
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("contiguous", "striped", "zigzag")

# Under "auto", causal shards of at most this many tokens stay contiguous. Zigzag's
# balance saves at most half a shard's tiles per ring step, while its relayout costs
# two ppermutes of half a shard each way and its tiles are half as long; at 128 and
# 256 tokens a device the relayout and the smaller tiles cost more than the balance
# saves (docs/benchmarks.md, "Short causal shards stay contiguous": causal forward+
# backward on 8 devices, contiguous 0.106 vs zigzag 0.143 s at T=1024, 0.267 vs 0.312 s
# at T=2048, level at T=4096).
SHORT_CAUSAL_SHARD = 256


def resolve(layout: str, is_causal: bool, shard_len: int | None = None) -> str:
  """Maps "auto" to the concrete layout (see the module doc); checks the name.
  `shard_len` (tokens a device) lets "auto" keep short causal shards contiguous."""
  match layout:
    case "auto":
      short = shard_len is not None and shard_len <= SHORT_CAUSAL_SHARD
      return "zigzag" if is_causal and not short else "contiguous"
    case "contiguous" | "striped" | "zigzag":
      return layout
    case _:
      raise ValueError(f"Unsupported layout={layout!r}; expected 'auto' or one of {LAYOUTS}")


def multiple(layout: str, num_shards: int, pieces: int = 1) -> int:
  """The total length must be a multiple of this for the layout; `pieces`: each ring
  shard is further split over that many devices (the Ulysses axis), each an equal part."""
  match resolve(layout, False):
    case "contiguous":
      base = num_shards
    case "zigzag":
      base = 2 * num_shards
    case "striped":
      base = num_shards * num_shards
  return math.lcm(base, num_shards * pieces)


def padded_length(layout: str, length: int, num_shards: int) -> int:
  m = multiple(layout, num_shards)
  return -(-length // m) * m


def positions(layout: str, num_shards: int, shard_len: int) -> np.ndarray:
  """Global positions held by each device: int array [num_shards, shard_len] (NumPy,
  so usable under a trace)."""
  return _positions(np, layout, np.arange(num_shards, dtype=np.int32)[:, None], shard_len, num_shards)


def shard_positions(layout: str, index, shard_len: int, num_shards: int):
  """Global positions of the tokens on device `index` (a Python int or a traced scalar)."""
  return _positions(jnp, layout, jnp.asarray(index, dtype=jnp.int32), shard_len, num_shards)


def _positions(xp, layout: str, index, shard_len: int, num_shards: int):
  """The layout's positions of device(s) `index` (broadcast against the offsets), in
  NumPy or jax.numpy (`xp`)."""
  offsets = xp.arange(shard_len, dtype=xp.int32)
  match resolve(layout, False):
    case "contiguous":
      return index * shard_len + offsets
    case "striped":
      return offsets * num_shards + index
    case "zigzag":
      if shard_len % 2:
        raise ValueError(f"zigzag layout needs an even shard length, got shard_len={shard_len}")
      half = shard_len // 2
      first = index * half + offsets[:half]
      second = (2 * num_shards - 1 - index) * half + offsets[:half]
      return xp.concatenate([first, second], axis=-1)


def permutation(layout: str, length: int, num_shards: int) -> np.ndarray:
  """perm such that x[:, perm] is x in the layout (device i holds rows i*c:(i+1)*c)."""
  if length % multiple(layout, num_shards):
    raise ValueError(
      f"length={length} must be a multiple of {multiple(layout, num_shards)} for "
      f"layout={layout!r} over {num_shards} devices; see padded_length"
    )
  return positions(layout, num_shards, length // num_shards).reshape(-1)


def inverse_permutation(layout: str, length: int, num_shards: int) -> np.ndarray:
  """inv such that y[:, inv] undoes y = x[:, perm]."""
  return np.argsort(permutation(layout, length, num_shards))


def to_layout(x, layout: str, num_shards: int, axis: int = 1):
  """Reorders the sequence axis of a global array from natural order into the layout."""
  return jnp.take(x, permutation(layout, x.shape[axis], num_shards), axis=axis)


def from_layout(x, layout: str, num_shards: int, axis: int = 1):
  """Inverse of `to_layout`."""
  return jnp.take(x, inverse_permutation(layout, x.shape[axis], num_shards), axis=axis)


def _zigzag_perms(num_shards: int):
  """Where the two halves of each contiguous shard go in the zigzag layout.

  Device i holds natural chunks 2i and 2i+1 (of 2p); chunk m belongs on device m
  (first half) if m < p, else on device 2p-1-m (second half). Each half is a
  permutation of the devices, so two ppermutes move everything.
  """
  p = num_shards
  dest = lambda m: m if m < p else 2 * p - 1 - m
  first = [(i, dest(2 * i)) for i in range(p)]
  second = [(i, dest(2 * i + 1)) for i in range(p)]
  return first, second


def relayout_shard(x, layout: str, axis_name, num_shards: int, *, inverse: bool = False, axis: int = 1):
  """Inside shard_map: moves a contiguous shard into `layout` (or back, with inverse).

  zigzag costs two ppermutes of half a shard each; striped one all_to_all. Memory
  stays O(shard). Never an all-gather.
  """
  p = num_shards
  layout = resolve(layout, False)
  if layout == "contiguous" or p == 1:
    return x
  x = jnp.moveaxis(x, axis, 1)
  b, n = x.shape[:2]
  rest = x.shape[2:]
  index = lax.axis_index(axis_name)
  if layout == "zigzag":
    first, second = _zigzag_perms(p)
    half = n // 2
    even = index % 2 == 0
    if not inverse:
      r0 = lax.ppermute(x[:, :half], axis_name, first)
      r1 = lax.ppermute(x[:, half:], axis_name, second)
      # Device j gets chunk j (slot 0) through `first` when j is even, else `second`.
      slot0 = jnp.where(even, r0, r1)
      slot1 = jnp.where(even, r1, r0)
      y = jnp.concatenate([slot0, slot1], axis=1)
    else:
      slot0, slot1 = x[:, :half], x[:, half:]
      back0 = jnp.where(even, slot0, slot1)  # what arrived through `first`
      back1 = jnp.where(even, slot1, slot0)
      inv = lambda perm: [(d, s) for s, d in perm]
      h0 = lax.ppermute(back0, axis_name, inv(first))
      h1 = lax.ppermute(back1, axis_name, inv(second))
      y = jnp.concatenate([h0, h1], axis=1)
  else:  # striped
    if n % p:
      raise ValueError(f"striped layout needs shard length {n} divisible by {p} devices")
    if not inverse:
      # Column d of [n/p, p] holds the tokens device d owns; the source index lands
      # in front, which is their order on the receiving device.
      y = x.reshape(b, n // p, p, *rest)
      y = lax.all_to_all(y, axis_name, split_axis=2, concat_axis=1, tiled=True)
      y = y.reshape(b, n, *rest)
    else:
      # Rows [i*n/p, (i+1)*n/p) came from device i: send them back, and interleave
      # what comes back so that row r of device d's column lands at r*p + d.
      y = x.reshape(b, n, 1, *rest)
      y = lax.all_to_all(y, axis_name, split_axis=1, concat_axis=2, tiled=True)
      y = y.reshape(b, n, *rest)
  return jnp.moveaxis(y, 1, axis)


# A document at least 2 * p * SPREAD_PIECE tokens long is spread over every device
# (zig-zag within the document: pieces of SPREAD_PIECE tokens or more); shorter ones
# stay whole on one device where they fit.
SPREAD_PIECE = 128
# A shorter document goes whole to one device while that device's scores stay within
# this fraction over an even share; past it the document is cut.
SLACK = 0.01


def documents(segment_ids, num_shards: int, *, min_piece: int = SPREAD_PIECE) -> np.ndarray:
  """A layout for one packed row that gives every device the same causal score work:
  perm (int [T]) such that x[:, perm] is the row laid out (device i holds rows
  i*c:(i+1)*c, c = T / num_shards), as `permutation` gives for the named layouts.

  `segment_ids` (int [T], concrete; a run of one id is a document, negative ids are
  padding): a query at offset q of its document costs q + 1 scores. Built on the host,
  from the longest document down:
  - a document of at least 2 * num_shards * min_piece tokens, or with more scores
    than an even share of the row's (its sum over devices, / p), is cut into 2p pieces
    and zig-zagged over the devices (device i takes pieces i and 2p - 1 - i), so each
    device gets 1/p of its tokens and of its work; a piece's odd token goes to the
    device with the most room left;
  - shorter documents, then padding, go whole to the device with the least work that
    has room for them (longest processing time first) while its work stays within
    SLACK of an even share; a document that fits nowhere, or would take a device past
    that, is cut into consecutive parts over the devices with room, least work first,
    each part filling its device up to the share; or, in a second plan, zig-zagged
    over every device as the long ones are. The plan whose busiest device computes
    fewer scores is kept.
  Each device keeps its positions in ascending order, so a whole document stays
  contiguous in its shard. Attention over the laid-out row is exact with any layout:
  pass `perm`'s shard of each device as `ring_attention_shard(..., positions=...)`
  (with the laid-out ids); `np.argsort(perm)` undoes it. `jax_ring.work_report(...,
  order=perm)` counts each device's score tiles.
  """
  ids = _check_row(segment_ids, num_shards, min_piece)
  n, p = ids.shape[0], num_shards
  if n == 0 or n % p:
    raise ValueError(f"segment_ids of length {n} must be a positive multiple of num_shards={p}")
  plans = [_plan(ids, p, min_piece, spread) for spread in (False, True)]
  held, _ = min(plans, key=lambda plan: plan[1].max())  # the busiest device's scores
  return np.concatenate([np.concatenate([np.arange(a, b) for a, b in sorted(r)]) for r in held]).astype(
    np.int32
  )


def _check_row(segment_ids, num_shards, min_piece) -> np.ndarray:
  """The ids of one packed row as an array; ValueError naming a bad argument."""
  ids = np.asarray(segment_ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"segment_ids of shape {ids.shape} and dtype {ids.dtype} must be one row: int [T]")
  if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
    raise ValueError(f"num_shards={num_shards!r} must be a positive int")
  if not isinstance(min_piece, int) or isinstance(min_piece, bool) or min_piece < 1:
    raise ValueError(f"min_piece={min_piece!r} must be a positive int")
  return ids


def zigzag_documents(
  segment_ids, num_shards: int, *, min_piece: int = SPREAD_PIECE, tile: int | None = None
) -> np.ndarray:
  """A packed row's documents balanced over the zig-zag ring by rewriting the row itself:
  order (int [T]) such that the row x[:, order], given to the ring as an ordinary row in
  the zig-zag layout (device d holds chunks d and 2p - 1 - d), spreads the score tiles
  (`tile` x `tile`; default: the ring's automatic tiles at this shard length) more evenly
  than the row as it is. Unlike `documents`' permutation it needs no positions given to
  the ring, so each row of a batch can have its own: what a packer records per row
  (`models.data.pipeline.Loader(..., row_layout="documents")`).

  Exact: the ring's masks compare the slots' positions and ids, and every document's
  tokens keep their natural order along the rewritten row, so a query sees exactly its
  document's earlier keys wherever they lie (the rotary positions travel with the
  tokens). Two kinds of order are tried:
  - the documents whole, in another order (`_whole_documents`, a seeded hill climb over
    swaps): no tile is shared more than before, and each document still spans its own
    length, so a bound on documents' lengths holds as it was;
  - `documents`' plans written into the chunks (`_write_zigzag`): a zig-zagged document's
    piece k in chunk k, a document cut over devices in chunk order, each chunk's pieces
    longest first so that pieces of whole tiles start on a tile's edge.
  Kept: the order whose busiest device computes the fewest tiles (`_tiles_per_device`,
  as the kernel decides them, the ids renumbered by `first_seen`); the row as it is
  unless one computes fewer.
  `np.argsort(order)` undoes it. A document cut into pieces spans more of the row than
  its length: `spans` reads the bound the rewritten rows keep.
  """
  ids = _check_row(segment_ids, num_shards, min_piece)
  n, p = ids.shape[0], num_shards
  if n == 0 or n % (2 * p):
    raise ValueError(f"segment_ids of length {n} must be a positive multiple of 2 * num_shards = {2 * p}")
  natural = np.arange(n, dtype=np.int32)
  if p == 1:
    return natural
  if tile is None:
    from jax_ring._tiles import BlockSizes, local_blocks

    _, tile, _ = local_blocks(n // p, BlockSizes(), devices=p, layout="zigzag")
  # The ring computes whole tiles: pieces of spread documents share theirs, so a plan even
  # in scores can load a device with more tiles than zig-zag. Kept: the order whose
  # busiest device computes the fewest tiles; the row as it is unless a plan's is fewer.
  busiest = lambda order: _tiles_per_device(first_seen(ids[order]), p, tile).max()
  best = (natural, busiest(natural))
  whole = _whole_documents(ids, p)
  if busiest(whole) < best[1]:
    best = (whole, busiest(whole))
  # Zig-zagged documents' odd tokens all in the first chunks can leave no room there for
  # documents cut over devices: the odd tokens go last too.
  for spread, odd_last, whole_only in itertools.product((False, True), repeat=3):
    order = _write_zigzag(ids, _plan(ids, p, min_piece, spread, odd_last, whole_only)[0], p)
    if order is not None and busiest(order) < best[1]:
      best = (order, busiest(order))
  return best[0]


def _whole_documents(ids: np.ndarray, p: int, tries: int = 300) -> np.ndarray:
  """The row's documents (runs of one id, padding too) whole and in another order, so
  that the zig-zag ring's devices compute about the same scores: a hill climb over
  swaps of two documents (`tries` of them, seeded: the same order every time), keeping a
  swap that lowers the busiest device's scores (then their sum of squares). Whole
  documents share no more tiles than the row as it is, and each still spans its own
  length, so the bound on documents' lengths is unchanged."""
  n = ids.shape[0]
  starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
  ends = np.r_[starts[1:], n]
  cost = np.where(ids >= 0, np.arange(n) - np.repeat(starts, ends - starts) + 1, 0).astype(np.float64)
  device = np.empty(n, np.int64)  # each slot's device under zig-zag
  device[permutation("zigzag", n, p)] = np.repeat(np.arange(p), n // p)
  build = lambda seq: np.concatenate([np.arange(starts[i], ends[i]) for i in seq])

  def score(seq):
    work = np.bincount(device, weights=cost[build(seq)], minlength=p)
    return work.max(), float(np.sum(work**2))

  seq = list(range(starts.size))
  best = score(seq)
  rng = np.random.default_rng(0)
  for _ in range(tries if starts.size > 1 else 0):
    i, j = (int(x) for x in rng.integers(starts.size, size=2))
    seq[i], seq[j] = seq[j], seq[i]
    now = score(seq)
    if now < best:
      best = now
    else:
      seq[i], seq[j] = seq[j], seq[i]
  return build(seq).astype(np.int32)


def _tiles_per_device(ids: np.ndarray, p: int, tile: int) -> np.ndarray:
  """Score tiles (tile x tile) each device of the zig-zag ring computes for the row
  `ids` (in the row's order) over every pass, as the kernel decides (`_kernel.tile_class`):
  a tile runs unless its keys all come after its queries, its queries are all padding,
  or its queries' and keys' id ranges (smallest to largest, padding left out) are
  apart. Ids that do not rise along the row thus cost tiles whose ranges overlap with
  no id shared; `first_seen` renumbers a rewritten row's ids in the order they appear."""
  n = ids.shape[0]
  if (n // p) % tile:
    tile = math.gcd(tile, n // p)
  where = positions("zigzag", p, n // p).reshape(-1, tile)  # [tiles, tile], device-major
  seg = ids[where]
  lo, hi = where.min(axis=1), where.max(axis=1)
  slo, shi = np.where(seg >= 0, seg, np.iinfo(seg.dtype).max).min(axis=1), seg.max(axis=1)
  runs = (
    (lo[None, :] <= hi[:, None])  # [query tile, key tile]: some key not after some query
    & (shi[:, None] >= 0)
    & ~((shi[:, None] < slo[None, :]) | (shi[None, :] < slo[:, None]))
  )
  return runs.sum(axis=1).reshape(p, -1).sum(axis=1)


def first_seen(segment_ids) -> np.ndarray:
  """Ids renumbered 0, 1, ... in the order they first appear along the last axis
  (negative ids, padding, stay -1): the same documents, and ids that rise along a row of
  whole documents in any order, which the kernels' tile test (by each tile's range of
  ids) needs to skip what no document reaches."""
  ids = np.asarray(segment_ids)
  out = np.full(ids.shape, -1, np.int32)
  for index in np.ndindex(ids.shape[:-1]):
    line = ids[index]
    real = np.flatnonzero(line >= 0)
    _, first, inverse = np.unique(line[real], return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    out[index][real] = rank[inverse]
  return out


def _write_zigzag(ids: np.ndarray, held, p: int):
  """The reordered row (natural index of each slot) that puts `held[d]`'s tokens on
  device d of the zig-zag ring with every document's pieces in chunk order; None where
  they do not fit so. A zig-zagged document's piece k goes to chunk k. A document cut
  over devices in another order keeps each device's count of its tokens, put in one of
  the device's chunks with room (or both, first filled first), and its tokens are
  handed out in chunk order: its devices then hold other parts of it than `held` says."""
  n = ids.shape[0]
  half = n // (2 * p)
  starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
  run = np.cumsum(np.isin(np.arange(n), starts)) - 1  # each position's run (document)
  pieces = {}  # run -> [(start, end, device)]
  for d, ranges in enumerate(held):
    for a, b in ranges:
      if a < b:
        pieces.setdefault(int(run[a]), []).append((a, b, d))
  used = np.zeros(2 * p, np.int64)  # tokens of spread documents in each chunk
  chunks = [[] for _ in range(2 * p)]  # the spread documents' pieces of each chunk
  free = [{} for _ in range(p)]  # the device's other documents: run -> pieces
  zigzag = list(range(p)) + list(range(p))[::-1]
  cut = []
  for r, parts in sorted(pieces.items()):
    parts = sorted(parts)
    devices = [d for _, _, d in parts]
    if ids[starts[r]] < 0 or len(set(devices)) == 1:
      for a, b, d in parts:
        free[d].setdefault(r, []).append(np.arange(a, b))
    elif devices == zigzag:
      for k, (a, b, _) in enumerate(parts):
        chunks[k].append(np.arange(a, b))
        used[k] += b - a
    else:
      cut.append(parts)
  if used.max() > half:
    return None
  for parts in cut:
    count = {}
    for a, b, d in parts:
      count[d] = count.get(d, 0) + b - a
    place = []  # (chunk, device, tokens)
    for d, m in count.items():
      low, high = d, 2 * p - 1 - d
      room = [c for c in (low, high) if used[c] + m <= half]
      if room:
        mine = [(min(room, key=lambda c: (used[c], c)), m)]
      else:
        head = int(half - used[low])
        if used[high] + m - head > half:
          return None
        mine = [(low, head), (high, m - head)]
      for c, k in mine:
        used[c] += k
      place += mine
    at = parts[0][0]
    for c, m in sorted(place):
      chunks[c].append(np.arange(at, at + m))
      at += m
  order = np.empty(n, np.int32)
  where = positions("zigzag", p, 2 * half)  # [p, c]: the row's slot of each device's place
  for d in range(p):
    # Each chunk's spread pieces (one a document at most) first and longest first, so that
    # pieces of whole tiles start on a tile's edge.
    low = sorted(chunks[d], key=lambda x: (-x.size, x[0]))
    high = sorted(chunks[2 * p - 1 - d], key=lambda x: (-x.size, x[0]))
    # The device's other documents, each (its pieces here in order) whole in one half
    # where it fits, longest first into the roomier half; the rest cut between the two
    # (head at the end of the first), so that few documents span the device's two chunks.
    units = sorted((np.concatenate(u) for u in free[d].values()), key=lambda u: (-u.size, u[0]))
    room = [half - int(used[d]), half - int(used[2 * p - 1 - d])]
    halves, split = ([], []), []
    for u in units:
      side = int(room[1] > room[0])
      if u.size <= room[side]:
        halves[side].append(u)
        room[side] -= u.size
      else:
        split.append(u)
    heads, tails = [], []
    for u in split:
      head = min(room[0], u.size)
      heads.append(u[:head])
      tails.append(u[head:])
      room[0] -= head
    tokens = low + halves[0] + heads + high + tails + halves[1]
    mine = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    if mine.size != where[d].size:
      return None
    order[where[d]] = mine
  return order if _keeps_document_order(ids, order) else None


def _keeps_document_order(ids: np.ndarray, order: np.ndarray) -> bool:
  """Every (non-negative) id's tokens in their natural order along the reordered row."""
  moved = ids[order]
  real = np.flatnonzero(moved >= 0)
  by_id = real[np.argsort(moved[real], kind="stable")]  # slots grouped by id, ascending
  same = moved[by_id][1:] == moved[by_id][:-1]
  return bool(np.all(np.diff(order[by_id])[same] > 0))


def spans(segment_ids) -> int:
  """The widest span of one (non-negative) id along the rows (int [..., T]): from its
  first slot to its last, inclusive; the bound on documents' lengths that reordered rows
  (`zigzag_documents`) keep. 0 where no id is non-negative."""
  ids = np.asarray(segment_ids)
  widest = 0
  for line in ids.reshape(-1, ids.shape[-1]):
    at = np.flatnonzero(line >= 0)
    if at.size:
      values = line[at]
      first = {int(v): int(i) for v, i in zip(values[::-1], at[::-1])}
      last = {int(v): int(i) for v, i in zip(values, at)}
      widest = max(widest, max(last[v] - first[v] + 1 for v in last))
  return widest


def _plan(
  ids: np.ndarray,
  p: int,
  min_piece: int,
  spread_misfits: bool,
  odd_last: bool = False,
  whole_only: bool = False,
):
  """(ranges each device holds, scores each computes) of `documents`'s placement; a
  document that fits no device whole within SLACK is zig-zagged over every device
  (`spread_misfits`, where every device has room) or cut into consecutive parts. A
  zig-zagged document's odd tokens lengthen a device's first piece, or its second
  (`odd_last`). `whole_only`: no document is spread for its length or its work, only where
  it fits no device whole."""
  n = ids.shape[0]
  starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
  ends = np.r_[starts[1:], n]
  room = np.full(p, n // p, np.int64)
  work = np.zeros(p, np.float64)
  held = [[] for _ in range(p)]  # natural ranges (start, end) on each device

  def cost(lo, hi):  # scores of a document's queries at offsets [lo, hi)
    return (hi * (hi + 1) - lo * (lo + 1)) / 2

  def most(lo, budget):  # the furthest hi with cost(lo, hi) <= budget
    hi = int((-1 + np.sqrt(1 + 4 * (2 * max(budget, 0) + lo * (lo + 1)))) / 2)
    while cost(lo, hi + 1) <= budget:
      hi += 1
    while hi > lo and cost(lo, hi) > budget:
      hi -= 1
    return hi

  def give(d, start, lo, hi, padding):
    held[d].append((start + lo, start + hi))
    room[d] -= hi - lo
    work[d] += 0.0 if padding else cost(lo, hi)

  share = sum(cost(0, int(e - s)) for s, e in zip(starts, ends) if ids[s] >= 0) / p
  docs = sorted(
    ((int(e - s), int(s), bool(ids[s] < 0)) for s, e in zip(starts, ends)),
    key=lambda x: (x[2], -x[0], x[1]),  # documents longest first, then padding
  )
  for length, start, padding in docs:
    fits = np.flatnonzero(room >= length)
    whole = fits.size and (padding or work[fits].min() + cost(0, length) <= (1 + SLACK) * share)
    if padding or not (
      (not whole_only and (length >= 2 * p * min_piece or cost(0, length) > share))
      or (spread_misfits and not whole)
    ):
      if whole:
        give(int(fits[np.argmin(work[fits])]), start, 0, length, padding)
        continue
    elif np.all(
      room >= 2 * (length // (2 * p))
    ):  # zig-zag over every device (odd tokens fit: room left >= length)
      sizes = np.full(2 * p, length // (2 * p), np.int64)
      extra = np.zeros(p, np.int64)
      for _ in range(length % (2 * p)):  # odd tokens to the most room left
        d = int(np.argmax(room - 2 * sizes[0] - extra))
        extra[d] += 1
      if odd_last:
        sizes[p:] += extra[::-1]
      else:
        sizes[:p] += extra
      at = np.r_[0, np.cumsum(sizes)]
      for piece in range(2 * p):
        give(piece if piece < p else 2 * p - 1 - piece, start, int(at[piece]), int(at[piece + 1]), False)
      continue
    lo = 0
    while lo < length:  # cut over the devices with room, least work first, each to its share
      open_ = np.flatnonzero(room > 0)
      d = int(open_[np.argmin(work[open_])])
      hi = length if padding else most(lo, share - work[d])
      hi = min(hi, lo + int(room[d]), length)
      if hi <= lo:  # every device holds its share already: by room
        hi = lo + int(min(room[d], length - lo))
      give(d, start, lo, hi, padding)
      lo = hi
  return held, work
