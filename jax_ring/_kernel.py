"""The XLA block kernel: attention of query blocks against key blocks, with masks from global positions.

Shapes (BTNH legend, blocked): B batch, K kv heads, G = N // K query heads per kv head,
H head dim, bq / bk block lengths, nq / nk numbers of blocks. Heads come before rows;
each tile is reshaped (for free) to 3-d, [B * K, G * bq, ...], so every product is a
batched matmul with one batch axis whose operands need no copy (scripts/bench/bench_tile.py):

    q blocks   [nq, B, K, G, bq, H]      k, v blocks   [nk, B, K, bk, H]
    q pos      [nq, bq] int32            k pos         [nk, bk] int32 (-1: padding)
    q seg      [nq, B, bq] or None       k seg         [nk, B, bk] or None
    out acc    [nq, B, K, G, bq, H]      row stats     [nq, B, K, G, bq]
    backward:  q, dO also as [nq, B, K, H, G, bq]; dK, dV as [nk, B, K, H, bk]

Queries arrive multiplied by the softmax scale.

Every (query block, key block) pair is classified from the blocks' position and
segment-id ranges (`block_bounds`, `tile_class`), never from the [bq, bk] mask itself:
one the masks rule out entirely is skipped (no matmul, no exponential, no mask), one
they do not touch runs without any mask arithmetic, and only the rest (a causal
diagonal, a window's edge, a segment boundary, padding) build the mask and pay for the
`where` over the scores.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._mods import NO_MODS, ScoreArgs, ScoreMods, keep, modify
from jax_ring._policy import Policy


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the masks. Positions and segment ids are the dynamic part."""

  is_causal: bool = False
  window: tuple[int, int] | None = None
  # Key positions may be -1 (padding): mask them out.
  has_padding: bool = False

  @property
  def positional(self) -> bool:
    return self.is_causal or self.window is not None or self.has_padding


class KVBlocks(NamedTuple):
  """What travels the ring: keys, values, their global positions and segment ids."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  seg: jax.Array | None


@dataclasses.dataclass(frozen=True)
class KVRows:
  """KVBlocks packed as rows: row j of `rows` [nk, W] holds block j of k, v, pos and
  seg side by side, as bits of one dtype (`pack_rows`). On CPU the ring carries and
  sends this one array, and each tile reads its block out of one row (`block`): no
  step joins k, v and their positions into one array for its transfer or splits them
  into separate arrays after it (both copies of the whole shard)."""

  rows: jax.Array
  # Static, per field of KVBlocks present: (name, first column, columns, block shape
  # as bits, dtype).
  pieces: tuple[tuple[str, int, int, tuple[int, ...], jnp.dtype], ...]
  # The dtype of the k and v a block is read as (`as_compute`).
  kv_dtype: jnp.dtype | None = None

  def as_compute(self, dtype) -> KVRows:
    return dataclasses.replace(self, kv_dtype=jnp.dtype(dtype))

  def _field(self, row, piece):
    name, start, width, shape, dtype = piece
    x = bits_as(row[..., start : start + width].reshape(*row.shape[:-1], *shape), dtype)
    if name in ("k", "v") and self.kv_dtype is not None:
      x = x.astype(self.kv_dtype)
    return x

  def block(self, j) -> KVBlocks:
    """Block j of every field, as `_index` gives it from the KVBlocks."""
    row = lax.dynamic_index_in_dim(self.rows, j, keepdims=False)
    fields = {piece[0]: self._field(row, piece) for piece in self.pieces}
    return KVBlocks(fields["k"], fields["v"], fields["pos"], fields.get("seg"))

  def whole(self, name: str):
    """One field of every block: pos [nk, bk], seg [nk, B, bk] (or None)."""
    piece = next((p for p in self.pieces if p[0] == name), None)
    return None if piece is None else self._field(self.rows, piece)


jax.tree_util.register_dataclass(KVRows, data_fields=["rows"], meta_fields=["pieces", "kv_dtype"])


def bits_as(x, dtype):
  """x as `dtype` bit for bit (`lax.bitcast_convert_type`; x itself if already)."""
  return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def carrier_dtype(arrays):
  """The one dtype `arrays` can all be held in as bits (`bits_as`): the largest array's
  dtype where it is the narrowest, else unsigned integers of the narrowest width."""
  width = min(x.dtype.itemsize for x in arrays)
  largest = max(arrays, key=lambda x: x.size).dtype
  return largest if largest.itemsize == width else jnp.dtype(f"uint{8 * width}")


def pack_rows(kv: KVBlocks) -> KVRows | KVBlocks:
  """`kv` as one array of rows (`KVRows`), or as it is when its arrays vary over
  different mesh axes (`shard_map`'s checks keep those apart). The rows' dtype is
  `carrier_dtype`'s: arrays of other dtypes are held as their bits and read back
  unchanged, NaN payloads included."""
  fields = {name: x for name, x in kv._asdict().items() if x is not None}
  if len({jax.typeof(x).manual_axis_type for x in fields.values()}) > 1:
    return kv
  unit = carrier_dtype(list(fields.values()))
  nk = kv.k.shape[0]
  columns, pieces, start = [], [], 0
  for name, x in fields.items():
    bits = bits_as(x, unit)
    columns.append(bits.reshape(nk, -1))
    pieces.append((name, start, columns[-1].shape[1], bits.shape[1:], x.dtype))
    start += columns[-1].shape[1]
  return KVRows(jnp.concatenate(columns, axis=1), tuple(pieces))


def kv_reader(kv: KVBlocks | KVRows):
  """(block(j), positions [nk, bk], segment ids [nk, B, bk] or None) of either form."""
  if isinstance(kv, KVRows):
    return kv.block, kv.whole("pos"), kv.whole("seg")
  return (lambda j: _index(kv, j)), kv.pos, kv.seg


class Tile(NamedTuple):
  """What score modifiers need of one tile: the static modifiers, the tile's global
  query and key positions [bq], [bk] and the call's `ScoreArgs`."""

  mods: ScoreMods
  q_pos: jax.Array
  k_pos: jax.Array
  args: ScoreArgs


def _tile_of(mods: ScoreMods, args, q_pos, k_pos):
  return Tile(mods, q_pos, k_pos, args) if mods.active else None


def _tile_positions(tile: Tile):
  """The tile's query and key positions shaped to broadcast against [B, K, G, bq, bk]:
  [bq, 1] and [1, bk] (positions shared by the batch rows), or [B, 1, 1, bq, 1] and
  [B, 1, 1, 1, bk] (per row, as a KV cache holds them)."""
  qp, kp = tile.q_pos[..., :, None].astype(jnp.int32), tile.k_pos[..., None, :].astype(jnp.int32)
  if qp.ndim == 3:
    qp, kp = qp[:, None, None], kp[:, None, None]
  return qp, kp


def _modified(tile: Tile | None, s, q_shape, derivative: bool = False):
  """(scores, d/ds, d/da): scores s [B * K, G * bq, bk] after the tile's soft-cap, ALiBi
  and score_mod, and with `derivative` their elementwise derivatives with respect to s
  and to the logit after ALiBi (`modify`; None where one is 1)."""
  if tile is None or not tile.mods.on_scores:
    return s, None, None
  b, kh, g, bq = q_shape[:4]
  qp, kp = _tile_positions(tile)
  heads = (tile.args.head0 + jnp.arange(kh * g, dtype=jnp.int32)).reshape(1, kh, g, 1, 1)
  slopes = None if tile.args.slopes is None else tile.args.slopes.reshape(b, kh, g, 1, 1)
  s, d, d_mod = modify(tile.mods, s.reshape(b, kh, g, bq, -1), qp, kp, heads, slopes, derivative=derivative)
  flat = lambda x: None if x is None else x.reshape(b * kh, g * bq, -1)
  return flat(s), flat(d), flat(d_mod)


def _distances(tile: Tile, q_shape):
  """|i - j| of the tile's (query, key) pairs, [B * K, G * bq, bk] float32 (ALiBi's)."""
  b, kh, g, bq = q_shape[:4]
  qp, kp = _tile_positions(tile)
  d = jnp.abs(qp - kp).astype(jnp.float32)
  return jnp.broadcast_to(d, (b, kh, g, bq, d.shape[-1])).reshape(b * kh, g * bq, -1)


def _kept(tile: Tile | None, q_shape, dtype):
  """Dropout's factor per weight of the tile, [B * K, G * bq, bk]: keep / (1 - rate)
  (None without dropout)."""
  if tile is None or tile.mods.dropout == 0:
    return None
  b, kh, g, bq = q_shape[:4]
  rate = tile.mods.dropout
  batch = (tile.args.batch0 + jnp.arange(b, dtype=jnp.int32)).reshape(b, 1, 1, 1, 1)
  heads = (tile.args.head0 + jnp.arange(kh * g, dtype=jnp.int32)).reshape(1, kh, g, 1, 1)
  if tile.mods.dropout_broadcast:
    batch, heads = jnp.zeros((1, 1, 1, 1, 1), jnp.int32), jnp.zeros((1, 1, 1, 1, 1), jnp.int32)
  kept = keep(tile.args.seed, batch, heads, *_tile_positions(tile), rate)
  kept = jnp.broadcast_to(kept, (b, kh, g, bq, kept.shape[-1]))
  return jnp.where(kept, jnp.asarray(1 / (1 - rate), dtype), jnp.zeros((), dtype)).reshape(b * kh, g * bq, -1)


def block_mask(spec: MaskSpec, q_pos, k_pos, q_seg, k_seg):
  """bool [B or 1, bq, bk], or None when nothing is masked."""
  mask = None
  if spec.positional:
    qp, kp = q_pos[:, None], k_pos[None, :]
    mask = jnp.ones((qp.shape[0], kp.shape[1]), bool)
    if spec.has_padding:
      mask = mask & (kp >= 0)
    if spec.is_causal:
      mask = mask & (kp <= qp)
    if spec.window is not None:
      left, right = spec.window
      mask = mask & (kp >= qp - left) & (kp <= qp + right)
    mask = mask[None]
  if q_seg is not None:
    same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0)
    mask = same if mask is None else mask & same
  return mask


def _dot(spec: str, a, b, policy: Policy):
  return jnp.einsum(spec, a, b, precision=policy.precision, preferred_element_type=policy.accum_dtype)


def _rows(x):
  """[B, K, G, bq, ...] -> [B * K, G * bq, ...] (a free reshape)."""
  return x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _flat(x):
  """[B, K, ...] -> [B * K, ...]; K/V blocks, their transposes, per-head row stats."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _scores(q, k, mask, policy: Policy, tile: Tile | None = None):
  """Scores [B * K, G * bq, bk] of pre-scaled queries q [B, K, G, bq, H] against keys
  k [B, K, bk, H], modified (`tile`'s modifiers) and -inf where masked. mask: [B or 1,
  bq, bk], the same for every head, or [B, K, G, bq, bk], one per query head.

  The tile math runs on 3-d arrays, one batch axis: with the size-1 axes of B and G
  kept, the CPU compiler copied every score tile once more before its row maximum.
  """
  s, _, _ = _modified(tile, _dot("xqh,xsh->xqs", _rows(q), _flat(k), policy), q.shape)
  return _where_visible(mask, floor_scores(s), q.shape, -jnp.inf)


def floor_scores(s):
  """Visible scores with -inf (an inf in q or k) raised to the dtype's lowest finite
  value, before the masks write -inf. Beside any finite score such a key still weighs
  exp(-huge) = 0; but a row whose every visible score is -inf keeps its running maximum
  at the floor instead of -inf, so `finalize` tells it (0 / 0 in jax.nn: non-finite)
  from a row the masks leave empty (0)."""
  return jnp.where(s == -jnp.inf, jnp.finfo(s.dtype).min, s)


def floored(m):
  """Rows whose running maximum is still the floor: every visible score was -inf."""
  return m == jnp.finfo(m.dtype).min


def _where_visible(mask, x, q_shape, hidden):
  """x [B * K, G * bq, bk] (a tile in `_rows` layout) with `hidden` where `mask` (as in
  `_scores`; None: nothing hidden) hides a key from a query."""
  if mask is None:
    return x
  b, kh, g, bq = q_shape[:4]
  mask = mask if mask.ndim == 5 else mask[:, None, None]  # [B, K, G, bq, bk]: per query head
  return jnp.where(mask, x.reshape(b, kh, g, bq, -1), hidden).reshape(x.shape)


def block_update(q, k, v, mask, policy: Policy, o, m, l, tile: Tile | None = None):
  """Adds one key block to the unnormalized running state of one query block.

  o [B, K, G, bq, H] is the sum of exp(s - m) v so far, m [B, K, G, bq] the running
  row maximum (-inf before any visible key), l the sum of exp(s - m). Normalizing once
  at the end (`finalize`) instead of per block saves a division and a merge per tile.
  """
  s = _scores(q, k, mask, policy, tile)
  m0, l0 = _rows(m[..., None])[..., 0], _rows(l[..., None])[..., 0]
  m_new = jnp.maximum(m0, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with no visible key yet
  probs = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(m0 - m_safe)
  l_new = l0 * alpha + jnp.sum(probs, axis=-1)
  kept = _kept(tile, q.shape, probs.dtype)  # dropout: from P @ V, not from the normalizer
  weights = probs if kept is None else probs * kept
  pv = _dot("xqs,xsh->xqh", weights.astype(policy.compute_dtype), _flat(v), policy)
  o_new = _rows(o) * alpha[..., None] + pv
  return o_new.reshape(o.shape), m_new.reshape(m.shape), l_new.reshape(l.shape)


def saw_keys(l):
  """Which rows of a softmax denominator `l` saw a key: l != 0. A row the masks leave
  empty has l == 0 exactly (a visible key adds exp(0) = 1 at its row's maximum); a
  NaN (from a NaN or inf in q, k or v) counts as seen, so it reaches the output."""
  return l != 0


def finalize(o, m, l, log_base: float = 1.0):
  """(normalized output, lse) from the running state. Rows that saw no key: 0, -inf;
  a non-finite row stays non-finite (`saw_keys`). A row whose every visible score was
  -inf (`floor_scores`) gets 0 and lse at the floor: merged with partial results that
  saw a finite score it weighs 0, as its keys do; merged with nothing else it stays at
  the floor, until `expose_floored` makes it non-finite. `log_base`: the factor m
  carries (log2(e) when the scores were scaled for exp2)."""
  seen = saw_keys(l)
  dead = floored(m)
  safe_l = jnp.where(seen & ~dead, l, 1.0)
  out = jnp.where((seen & ~dead)[..., None], o / safe_l[..., None], 0.0)
  lse = jnp.where(seen, m / log_base + jnp.log(safe_l), -jnp.inf)
  return out, jnp.where(dead, jnp.finfo(lse.dtype).min, lse)


def expose_floored(out, lse):
  """The merged result as the caller sees it: a row whose lse is still at the floor
  saw only -inf scores, 0 / 0, so its output is NaN and its lse +inf (the backward's
  weights exp(s - lse) are then 0; the NaN reaches dq and dk through delta)."""
  dead = floored(lse)
  return jnp.where(dead[..., None], jnp.nan, out), jnp.where(dead, jnp.inf, lse)


def block_backward(q, q_t, k, v, do, do_t, lse, delta, mask, policy: Policy, tile: Tile | None = None):
  """Gradients of one block given the final lse and delta = sum(dO * O, -1).

  The dK and dV products contract over query rows. With the rows on the left
  operand's last axis they run at the full matmul rate; with a transposed score tile
  they ran at half of it. So q and dO also come transposed, q_t and do_t
  [B, K, H, G, bq], and dK, dV come out transposed, [B, K, H, bk].

  q is pre-scaled, so the dq returned still lacks the factor `scale`; dk is exact.
  Returns dq [B, K, G, bq, H], dk_t, dv_t, all in the accum dtype.
  """
  cd = policy.compute_dtype
  s, ds_raw, ds_alibi = _modified(tile, _dot("xqh,xsh->xqs", _rows(q), _flat(k), policy), q.shape, True)
  s = _where_visible(mask, s, q.shape, -jnp.inf)
  lse = _rows(lse[..., None])[..., 0]
  lse_safe = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
  probs = jnp.exp(s - lse_safe[..., None])
  dp = _dot("xqh,xsh->xqs", _rows(do), _flat(v), policy)
  kept = _kept(tile, q.shape, probs.dtype)
  weights = probs
  if kept is not None:  # the output used p * kept: so do dV and dP
    weights, dp = probs * kept, dp * kept
  ds_s = probs * (dp - _rows(delta[..., None]))  # with respect to the final logit
  # Hidden pairs get exactly 0: p = 0 there, but dp or delta may be NaN (a non-finite
  # value or output elsewhere), and 0 * NaN would reach rows and keys that see nothing.
  # The chain rule through soft-cap and score_mod (ds_raw) comes before that.
  ds = _where_visible(mask, ds_s if ds_raw is None else ds_s * ds_raw, q.shape, 0.0).astype(cd)
  dq = _dot("xqs,xsh->xqh", ds, _flat(k), policy).reshape(q.shape)
  if tile is not None and tile.mods.alibi:
    # d / d slope of s - slope |i - j|: per query row, -sum_j (dL / d that logit) |i - j|;
    # it rides as one more column of dq, which stays on the query's device.
    ds_a = ds_s if ds_alibi is None else ds_s * ds_alibi
    ds_a = _where_visible(mask, ds_a, q.shape, 0.0)
    rows = -jnp.sum(ds_a * _distances(tile, q.shape), axis=-1)  # [B * K, G * bq]
    dq = jnp.concatenate([dq, rows.reshape(*q.shape[:-1], 1).astype(dq.dtype)], axis=-1)
  t_rows = lambda x: x.reshape(x.shape[0] * x.shape[1], x.shape[2], -1)  # [B*K, H, G*bq]
  dk_t = _dot("xhq,xqs->xhs", t_rows(q_t), ds, policy)
  dv_t = _dot("xhq,xqs->xhs", t_rows(do_t), weights.astype(cd), policy)
  shape_t = (*k.shape[:2], k.shape[3], k.shape[2])
  return dq, dk_t.reshape(shape_t), dv_t.reshape(shape_t)


class Bounds(NamedTuple):
  """What a tile's class is decided from, per block: the range of its positions and,
  per batch row, of its segment ids. O(block) to compute, where the mask is O(bq x bk)."""

  lo: jax.Array  # [n] smallest position (of keys, -1 padding left out when masked)
  hi: jax.Array  # [n] largest position
  padded: jax.Array  # [n] bool: some position is -1
  # Ids < 0 (padding) are seen by no query and see no key: the range that decides whether
  # two blocks share a document leaves them out. With them in, a block that ends a row's
  # last document before its padding spanned every earlier id, and its tiles with every
  # earlier block ran masked.
  seg_lo: jax.Array | None  # [n, B] smallest id >= 0 (the dtype's max where there is none)
  seg_hi: jax.Array | None  # [n, B] largest id (< 0 where all are padding)
  seg_padded: jax.Array | None  # [n, B] bool: some id < 0


def lowest_id(seg, axis=None):
  """The smallest id >= 0 over `axis` (padding, < 0, left out; the dtype's max where
  there is none): the low end of a block's range of documents."""
  return jnp.min(jnp.where(seg >= 0, seg, jnp.iinfo(seg.dtype).max), axis=axis)


def block_bounds(pos, seg, skip_padding: bool = False) -> Bounds:
  """Bounds of blocks with positions [n, b] and segment ids [n, B, b] (or None; any
  leading axes, reduced over the last); `skip_padding`: `lo` is over positions >= 0
  (keys, when padding is masked)."""
  valid = jnp.where(pos >= 0, pos, jnp.iinfo(pos.dtype).max) if skip_padding else pos
  seg_lo = seg_hi = seg_padded = None
  if seg is not None:
    seg_lo = lowest_id(seg, axis=-1)
    seg_hi, seg_padded = jnp.max(seg, axis=-1), jnp.any(seg < 0, axis=-1)
  lo, hi, padded = jnp.min(valid, axis=-1), jnp.max(pos, axis=-1), jnp.any(pos < 0, axis=-1)
  return Bounds(lo, hi, padded, seg_lo, seg_hi, seg_padded)


def tile_class(spec: MaskSpec, q: Bounds, k: Bounds):
  """0 when the masks hide the whole tile (skipped), 2 when they hide nothing (no mask
  arithmetic at all), 1 otherwise (masked); from one query and one key block's bounds
  (`block_bounds`, key lo without padding when `spec.has_padding`). Both tests are
  sufficient conditions: a tile that passes neither is masked, exact for any positions."""
  hidden = jnp.zeros((), bool)
  whole = jnp.ones((), bool)
  if spec.has_padding:
    hidden = hidden | (k.hi < 0)
    whole = whole & ~k.padded
  if spec.is_causal:
    hidden = hidden | (k.lo > q.hi)
    whole = whole & (k.hi <= q.lo)
  if spec.window is not None:
    left, right = spec.window
    hidden = hidden | (k.lo > q.hi + right) | (k.hi < q.lo - left)
    whole = whole & (k.lo >= q.hi - left) & (k.hi <= q.lo + right)
  if q.seg_lo is not None:
    # Per batch row: no valid query, or id ranges apart, hide the row; one valid id on
    # both sides shows all of it. The tile is shared by the rows: all must agree.
    apart = (q.seg_hi < 0) | (q.seg_hi < k.seg_lo) | (k.seg_hi < q.seg_lo)
    one = (q.seg_lo == q.seg_hi) & ~q.seg_padded & ~k.seg_padded
    same = one & (k.seg_lo == q.seg_lo) & (k.seg_hi == q.seg_lo)
    hidden = hidden | jnp.all(apart)
    whole = whole & jnp.all(same)
  return jnp.where(hidden, 0, jnp.where(whole, 2, 1)).astype(jnp.int32)


def chunk_forward(
  spec: MaskSpec,
  policy,
  q,
  q_pos,
  q_seg,
  q_bounds: Bounds,
  kv: KVBlocks | KVRows,
  acc,
  mods=NO_MODS,
  args=None,
):
  """Adds the keys of `kv` to the running state (o, m, l) of every query block.
  q_bounds: `block_bounds(q_pos, q_seg)`, the same at every ring step. q and acc may
  also be lists, one entry a block (q [B, K, G, bq, H], acc a tuple (o, m, l)), which
  no step slices or stacks: the blocks are then visited one after another in the
  program, each like a block of the arrays.

  Under masks, only the key blocks from the first to the last visible one are visited
  (`_visible_range`), and each tile's branch reads its key block itself: a tile the
  masks hide costs neither a matmul nor a copy of its blocks."""
  masked = spec.positional or q_seg is not None
  if not masked:
    return dense_forward(policy, q, q_pos, kv, acc, mods, args)
  read, k_pos, k_seg = kv_reader(kv)
  kb = block_bounds(k_pos, k_seg, spec.has_padding)

  def over_q(_, xs):
    q, qp, qs, q_bound, state = xs
    classes = jax.vmap(lambda b: tile_class(spec, q_bound, b))(kb)

    def update(with_mask):
      def compute(j, state):
        k, v, kp, ks = read(j)
        mask = block_mask(spec, qp, kp, qs, ks) if with_mask else None
        return block_update(q, k, v, mask, policy, *state, _tile_of(mods, args, qp, kp))

      return compute

    def body(j, state):
      return lax.switch(classes[j], (lambda j, st: st, update(True), update(False)), j, state)

    lo, hi = _visible_range(classes)
    return None, lax.fori_loop(lo, hi, body, state)

  if isinstance(acc, list):  # query blocks and their states as lists: none sliced or stacked
    seg = lambda i: None if q_seg is None else q_seg[i]
    return [over_q(None, (q[i], q_pos[i], seg(i), _index(q_bounds, i), a))[1] for i, a in enumerate(acc)]
  return _over_blocks_in_place(over_q, (q, q_pos, q_seg, q_bounds), acc)


def dense_forward(policy, q, q_pos, kv: KVBlocks | KVRows, acc, mods=NO_MODS, args=None, k_blocks=None):
  """chunk_forward without masks: every query block against the key blocks
  `k_blocks` (a static range; default all of them), no tile skipped or masked."""
  read, k_pos, _ = kv_reader(kv)
  k_blocks = range(k_pos.shape[0]) if k_blocks is None else k_blocks

  def over_q(_, xs):
    q, qp, state = xs

    def over_k(state, j):
      k, v, kp, _ = read(j)
      return block_update(q, k, v, None, policy, *state, _tile_of(mods, args, qp, kp)), None

    state, _ = lax.scan(over_k, state, jnp.arange(k_blocks.start, k_blocks.stop))
    return None, state

  return _over_blocks_in_place(over_q, (q, q_pos), acc)


def _over_blocks_in_place(over_q, xs, acc):
  """acc with block i replaced by over_q(None, (*xs[i], acc[i]))[1] for every block i,
  in place: the loop carries the state and writes each block back where it was. A scan
  over the blocks stacks its results into a second state beside the first (compiled
  for 8 x H100, the forward of 512K tokens, 8 heads of 128, held 879 MiB of
  temporaries a device that way and 621 MiB this way)."""

  def body(i, acc):
    x = _index(xs, i)
    _, new = over_q(None, (*x, _index(acc, i)))
    return jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, i, 0), acc, new)

  return lax.fori_loop(0, jax.tree.leaves(acc)[0].shape[0], body, acc)


def _index(tree, i):
  """Block i of every array of `tree` (None stays None)."""
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _visible_range(classes):
  """(lo, hi): the blocks from the first to the last whose class is not 0 (hi = lo = 0
  when none is). Tiles outside are never visited; hidden ones inside still skip."""
  visible = classes > 0
  n = classes.shape[0]
  lo = jnp.argmax(visible).astype(jnp.int32)
  hi = (n - jnp.argmax(visible[::-1])).astype(jnp.int32)
  anything = jnp.any(visible)
  return jnp.where(anything, lo, 0), jnp.where(anything, hi, 0)


class QBlocks(NamedTuple):
  """The per-query-block residuals the backward pass walks over."""

  q: jax.Array
  q_t: jax.Array  # [nq, B, K, H, G, bq]
  do: jax.Array
  do_t: jax.Array
  lse: jax.Array
  delta: jax.Array
  pos: jax.Array
  seg: jax.Array | None
  bounds: Bounds  # block_bounds(pos, seg)


def chunk_backward(
  spec: MaskSpec, policy, qb: QBlocks, dq, kv: KVBlocks | KVRows, dk_t, dv_t, mods=NO_MODS, args=None
):
  """Adds the gradient contributions of the pair (all query blocks, kv) to dq, dk, dv.

  dk_t and dv_t are transposed, [nk, B, K, H, bk]; so are their updates. dq and the
  query fields of `qb` (q, q_t, do, do_t, lse, delta) may also be lists, one entry a
  block, as in `chunk_forward`: under masks every key block then visits each listed
  query block through its tile's class, and no tile slices a block out of an array.
  """
  masked = spec.positional or qb.seg is not None
  if not masked:
    return dense_backward(policy, qb, dq, kv, dk_t, dv_t, mods, args)
  read, k_pos, k_seg = kv_reader(kv)
  k_bounds = block_bounds(k_pos, k_seg, spec.has_padding)
  blocks = jnp.arange(k_pos.shape[0])

  if isinstance(dq, list):  # query blocks, their residuals and dq as lists: none sliced per tile

    def over_k_listed(dq, xs):
      j, k_bound, dkb, dvb = xs
      kb, vb, kp, ks = read(j)
      dq = list(dq)
      for i in range(len(dq)):
        listed = lambda i=i: (*(getattr(qb, f)[i] for f in _Q_FIELDS), qb.pos[i], _item(qb.seg, i))
        branches = _tile_branches(spec, policy, listed, kb, vb, kp, ks, mods, args)
        cls = tile_class(spec, _index(qb.bounds, i), k_bound)
        dkb, dvb, dq[i] = lax.switch(cls, branches, dkb, dvb, dq[i])
      return dq, (dkb, dvb)

    dq, (dk_t, dv_t) = lax.scan(over_k_listed, dq, (blocks, k_bounds, dk_t, dv_t))
    return dq, dk_t, dv_t

  # Masked: only the query blocks from the first to the last visible one are visited
  # (`_visible_range`); each tile's class picks skip / masked / whole, and the branch
  # reads its blocks itself, so a skipped tile copies nothing.
  def over_k(dq, xs):
    j, k_bound, dkb, dvb = xs
    kb, vb, kp, ks = read(j)
    classes = jax.vmap(lambda b: tile_class(spec, b, k_bound))(qb.bounds)

    def body(i, carry):
      dkb, dvb, dq = carry
      dqb = lax.dynamic_index_in_dim(dq, i, keepdims=False)
      branches = _tile_branches(spec, policy, lambda: _index(qb, i)[:8], kb, vb, kp, ks, mods, args)
      dkb, dvb, dqb = lax.switch(classes[i], branches, dkb, dvb, dqb)
      return dkb, dvb, lax.dynamic_update_index_in_dim(dq, dqb, i, 0)

    lo, hi = _visible_range(classes)
    dkb, dvb, dq = lax.fori_loop(lo, hi, body, (dkb, dvb, dq))
    return dq, (dkb, dvb)

  dq, (dk_t, dv_t) = lax.scan(over_k, dq, (blocks, k_bounds, dk_t, dv_t))
  return dq, dk_t, dv_t


# The query-side fields of QBlocks a tile's backward reads, before positions and ids.
_Q_FIELDS = ("q", "q_t", "do", "do_t", "lse", "delta")


def _item(x, i):
  return None if x is None else x[i]


def _tile_branches(spec: MaskSpec, policy, q_block, k, v, k_pos, k_seg, mods, args):
  """(skip, masked, whole): updates of (dK, dV, dQ) by the tile of one query block and
  one key block. `q_block()` gives the query block's (q, q_t, do, do_t, lse, delta,
  positions, ids); the branches call it, so a skipped tile reads nothing."""

  def add(with_mask):
    def update(dk, dv, dq):
      q, q_t, do, do_t, lse, delta, qp, qs = q_block()
      mask = block_mask(spec, qp, k_pos, qs, k_seg) if with_mask else None
      tile = _tile_of(mods, args, qp, k_pos)
      g_q, g_k, g_v = block_backward(q, q_t, k, v, do, do_t, lse, delta, mask, policy, tile)
      return dk + g_k, dv + g_v, dq + g_q

    return update

  return (lambda dk, dv, dq: (dk, dv, dq)), add(True), add(False)


def dense_backward(
  policy, qb: QBlocks, dq, kv: KVBlocks | KVRows, dk_t, dv_t, mods=NO_MODS, args=None, k_blocks=None
):
  """chunk_backward without masks, for the key blocks `k_blocks` (a static range;
  default all of them): the dK/dV blocks outside it come back unchanged."""
  read, k_pos, _ = kv_reader(kv)
  lo, hi = (0, k_pos.shape[0]) if k_blocks is None else (k_blocks.start, k_blocks.stop)

  def body(j, carry):  # dK/dV updated in place: blocks outside [lo, hi) are not touched
    dq, dk_t, dv_t = carry
    kb, vb, kp, _ = read(j)

    def over_q(carry, ys):
      q, q_t, do, do_t, l, delta, qp, dqb = ys
      tile = _tile_of(mods, args, qp, kp)
      g_q, g_k, g_v = block_backward(q, q_t, kb, vb, do, do_t, l, delta, None, policy, tile)
      return (carry[0] + g_k, carry[1] + g_v), dqb + g_q

    xs = (*(getattr(qb, f) for f in _Q_FIELDS), qb.pos, dq)
    (dkb, dvb), dq = lax.scan(over_q, (dk_t[j], dv_t[j]), xs)
    put = lambda whole, block: lax.dynamic_update_index_in_dim(whole, block, j, 0)
    return dq, put(dk_t, dkb), put(dv_t, dvb)

  return lax.fori_loop(lo, hi, body, (dq, dk_t, dv_t))
