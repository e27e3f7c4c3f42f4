"""LongNet dilated attention on one device and over a ring of devices.

Pattern i (segment length w, dilation rate r) cuts the sequence into segments
[k*w, (k+1)*w); query head n keeps, inside each segment, the positions whose offset
from the segment start is n mod r, and attends to the kept keys of its own segment.
The patterns are merged by their softmax denominators, which makes the result one
softmax over the union of every pattern's keys. That view also gives the backward
pass: each pattern's gradient is the plain attention gradient evaluated with the
merged log-sum-exp and the merged output (so nothing per pattern is saved).

How a pattern runs (legend: B batch, T local length, K kv heads, G = N // K):

- Heads are regrouped into "virtual kv heads" (k, c), c < C, each with one offset
  s = (k*G + c) mod r shared by the G // C query heads it serves; for MHA each head is
  its own virtual head. Virtual heads fold into the batch, so the selection offset,
  the padding and the segment are per batch row, and the block kernel of the ring
  sees plain (dense) attention over the selected tokens.
- local: the segment fits in a shard. The shard splits into whole segments, each
  gathered to ceil(w / r) slots and attended independently: no communication.
  Local patterns run chunk by chunk over the shard (`local_chunk`, `_by_chunks`), so
  their copies exist for one chunk at a time.
- ring: a segment spans g devices. Each device gathers its part of the segment and
  the selected K/V rotate around a sub-ring of those g devices, so only 1/r of the
  tokens (per head) cross the wire.

Positions used for causal masking are slot indices within the segment, which order
the selected tokens exactly as their global positions do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ring import _choice, _pallas, _validation
from jax_ring._kernel import MaskSpec, expose_floored
from jax_ring._mesh import call_on_mesh, constrain, output_spec, pad_seq, place_on_mesh, usable_mesh
from jax_ring._policy import Policy, get_policy
from jax_ring._ring import RingConfig, prepare, ring_backward_state, ring_forward_state, zeros_varying_like
from jax_ring._tiles import (
  BlockSizes,
  block_q,
  block_rows,
  check_block_sizes,
  local_blocks,
  unblock_kv,
  unblock_q,
  unblock_rows,
)


@dataclasses.dataclass(frozen=True)
class Pattern:
  """How one (segment length, dilation rate) pattern is laid out on the devices."""

  segment: int  # effective segment length (the whole padded sequence if w >= T)
  rate: int
  ring: int  # devices per segment: 1 = local
  piece: int  # tokens of one segment on one device
  pieces: int  # segments (or parts of one) per device
  slots: int  # selected tokens per piece and virtual head


def _slots(piece: int, rate: int, offsets) -> int:
  """Slots needed so slot j <-> selected index floor(o/r) + j covers [o, o + piece)."""
  return max(-(-(o % rate + piece) // rate) for o in offsets)


def plan(length: int, devices: int, segment_lengths, dilation_rates) -> tuple[int, tuple[Pattern, ...]]:
  """(shard length, patterns): the smallest shard length >= ceil(length / devices)
  for which every segment either lies inside one shard or covers whole shards of a
  group of devices that divides the axis. Power-of-two segments need no extra padding.
  """
  shard = -(-length // devices)
  while True:
    patterns = []
    for w, r in zip(segment_lengths, dilation_rates):
      seg = w if w < length else devices * shard
      if seg <= shard and (devices == 1 or shard % seg == 0):
        pieces = -(-shard // seg)
        patterns.append(Pattern(seg, r, 1, seg, pieces, _slots(seg, r, [0])))
      elif seg % shard == 0 and devices % (seg // shard) == 0:
        g = seg // shard
        patterns.append(Pattern(seg, r, g, shard, 1, _slots(shard, r, [i * shard for i in range(g)])))
      else:
        break
    else:
      return shard, tuple(patterns)
    shard += 1


@dataclasses.dataclass(frozen=True)
class DilatedConfig:
  axis_name: Any  # None on one device
  devices: int
  patterns: tuple[Pattern, ...]
  is_causal: bool
  scale: float
  policy: Policy
  block_sizes: BlockSizes
  num_kv_heads: int
  groups: int  # query heads per kv head
  kernel: str = "xla"  # the ring's block kernel (RingConfig.kernel)


def _virtual_heads(cfg: DilatedConfig, rate: int) -> tuple[int, np.ndarray]:
  """(C, offsets [K, C]): query head j of kv head k belongs to virtual head j mod C."""
  g = cfg.groups
  c = rate if (g > rate and g % rate == 0) else g
  k = np.arange(cfg.num_kv_heads)[:, None]
  return c, (k * g + np.arange(c)[None, :]) % rate


class _Layout:
  """Index maps between this device's tokens and a pattern's slots (traced offsets)."""

  def __init__(self, cfg: DilatedConfig, pat: Pattern, shard: int):
    self.pat = pat
    self.c, offsets = _virtual_heads(cfg, pat.rate)
    self.offsets = jnp.asarray(offsets, jnp.int32)  # [K, C]
    ring = pat.ring > 1
    start = (lax.axis_index(cfg.axis_name) % pat.ring) * shard if ring else jnp.zeros((), jnp.int32)
    self.start = start  # offset of the piece inside its segment
    self.first = start // pat.rate  # selected index of slot 0
    r = pat.rate
    # slot j, virtual head (k, c) -> token index inside the piece
    rel = (self.first + jnp.arange(pat.slots))[:, None, None] * r + self.offsets[None]
    idx = rel - start
    self.slot_valid = (idx >= 0) & (idx < pat.piece) & (rel < pat.segment)  # [n, K, C]
    self.slot_index = jnp.clip(idx, 0, pat.piece - 1)
    # token u, virtual head -> slot (when the token is selected for that head)
    rel = (start + jnp.arange(pat.piece))[:, None, None] - self.offsets[None]
    self.token_selected = rel % r == 0  # [piece, K, C]
    self.token_slot = jnp.clip(rel // r - self.first, 0, pat.slots - 1)
    self.positions = self.first + jnp.arange(pat.slots, dtype=jnp.int32)


def _pieces(x, pat: Pattern, fill=0):
  """[B, T, ...] -> [B, pieces, piece, ...], padding the shard to whole pieces."""
  x = pad_seq(x, pat.pieces * pat.piece - x.shape[1], fill)
  return x.reshape(x.shape[0], pat.pieces, pat.piece, *x.shape[2:])


def _fold(x):
  """[B, P, n, K, C, ...] -> [B * P * K * C, n, ...]."""
  x = jnp.moveaxis(x, 2, 4)
  return x.reshape(-1, *x.shape[4:])


def _unfold(x, b, pat: Pattern, k, c):
  """Inverse of _fold: [B * P * K * C, n, ...] -> [B, P, n, K, C, ...]."""
  x = x.reshape(b, pat.pieces, k, c, *x.shape[1:])
  return jnp.moveaxis(x, 4, 2)


def _gather(x, lay: _Layout, fill=0):
  """Pieces [B, P, piece, K, C, ...] -> slots [B, P, n, K, C, ...]."""
  extra = x.ndim - 5
  idx = lay.slot_index.reshape(1, 1, *lay.slot_index.shape, *([1] * extra))
  valid = lay.slot_valid.reshape(idx.shape)
  return jnp.where(valid, jnp.take_along_axis(x, idx, axis=2), fill)


def _scatter(x, lay: _Layout, t: int, fill=0):
  """Slots [B, P, n, K, C, ...] -> tokens [B, T, K, C, ...] (fill where unselected)."""
  extra = x.ndim - 5
  idx = lay.token_slot.reshape(1, 1, *lay.token_slot.shape, *([1] * extra))
  sel = lay.token_selected.reshape(idx.shape)
  y = jnp.where(sel, jnp.take_along_axis(x, idx, axis=2), fill)
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :t]


def _heads_to_virtual(x, k, c):
  """[B, T, N, ...] -> [B, T, K, C, G // C, ...] (query head j of group k -> (j mod C, j // C))."""
  b, t, n = x.shape[:3]
  x = x.reshape(b, t, k, n // k // c, c, *x.shape[3:])
  return jnp.swapaxes(x, 3, 4)


def _virtual_to_heads(x):
  """Inverse of _heads_to_virtual."""
  b, t, k, c, gc = x.shape[:5]
  return jnp.swapaxes(x, 3, 4).reshape(b, t, k * c * gc, *x.shape[5:])


class _Selected:
  """One pattern's selected tokens of this device, folded for the ring kernel."""

  def __init__(self, cfg: DilatedConfig, pat: Pattern, q, k, v, seg):
    b, t, n, h = q.shape
    kh = k.shape[2]
    self.b, self.t, self.kh = b, t, kh
    self.lay = lay = _Layout(cfg, pat, t)
    c = lay.c
    self.c = c
    if cfg.kernel == "pallas":
      bq = bk = _pallas.block_for(pat.slots)
      self.n_pad = -(-pat.slots // bq) * bq
    else:
      self.n_pad, bq, bk = local_blocks(pat.slots, cfg.block_sizes)
    self.pad = self.n_pad - pat.slots
    qs = _gather(_pieces(_heads_to_virtual(q, kh, c), pat), lay)
    kv_pieces = lambda x: _pieces(jnp.broadcast_to(x[:, :, :, None], (b, t, kh, c, h)), pat)
    ks, vs = _gather(kv_pieces(k), lay), _gather(kv_pieces(v), lay)
    segs = _pieces(jnp.broadcast_to(seg[:, :, None, None], (b, t, kh, c)), pat, fill=-1)
    segs = _gather(segs, lay, fill=-1)
    self.q = self.pad_slots(_fold(qs))  # [B', n, G // C, H]
    self.k = self.pad_slots(_fold(ks)[:, :, None])  # [B', n, 1, H]
    self.v = self.pad_slots(_fold(vs)[:, :, None])
    self.seg = self.pad_slots(_fold(segs), -1)  # [B', n]
    pos = jnp.pad(lay.positions, (0, self.pad), constant_values=-1)
    self.inputs = lambda ring_cfg: prepare(ring_cfg, self.q, self.k, self.v, pos, pos, self.seg, self.seg)
    self.ring = RingConfig(
      axis_name=cfg.axis_name,
      ring_size=pat.ring,
      mask=MaskSpec(is_causal=cfg.is_causal),
      scale=cfg.scale,
      policy=cfg.policy,
      block_q=bq,
      block_kv=bk,
      steps_back=pat.ring - 1,
      steps_fwd=0,
      axis_size=cfg.devices,
      kernel=cfg.kernel,
    )

  def pad_slots(self, x, fill=0):
    return pad_seq(x, self.pad, fill)

  def gather_rows(self, x, fill=0.0):
    """Per-query-head rows [B, T, N, ...] -> folded slots [B', n_pad, G // C, ...]."""
    pieces = _pieces(_heads_to_virtual(x, self.kh, self.c), self.lay.pat)
    return self.pad_slots(_fold(_gather(pieces, self.lay, fill)), fill)

  def scatter_rows(self, x, fill=0.0):
    """Folded slots [B', n_pad, G // C, ...] -> [B, T, N, ...]."""
    x = _unfold(x[:, : self.lay.pat.slots], self.b, self.lay.pat, self.kh, self.c)
    return _virtual_to_heads(_scatter(x, self.lay, self.t, fill))

  def scatter_kv(self, x):
    """Folded slots [B', n_pad, 1, H] -> [B, T, K, H], summed over virtual heads."""
    x = _unfold(x[:, : self.lay.pat.slots, 0], self.b, self.lay.pat, self.kh, self.c)
    return jnp.sum(_scatter(x, self.lay, self.t), axis=3)


def local_chunk(cfg: DilatedConfig, shard: int) -> tuple[int, tuple[Pattern, ...]]:
  """(chunk length, the local patterns laid out on one chunk).

  Local segments never cross a chunk made of whole segments of every local pattern,
  so the local patterns run chunk after chunk (`_by_chunks`) and their copies (gathered,
  folded and blocked q, k, v, scores) exist for one chunk at a time, not for the shard.
  The chunk is the largest multiple of the local segments' lcm that divides the shard
  and holds at most `block_sizes.tokens_per_pass()` tokens x kv heads (at least the lcm);
  the whole shard where no such multiple divides it (one device with padded pieces).
  """
  local = [p for p in cfg.patterns if p.ring == 1]
  if not local:
    return shard, ()
  unit = math.lcm(*(p.segment for p in local))
  if shard % unit:
    return shard, tuple(local)
  most = max(unit, cfg.block_sizes.tokens_per_pass() // cfg.num_kv_heads)
  chunk = max(c for c in range(unit, min(most, shard) + 1, unit) if shard % c == 0)
  return chunk, tuple(dataclasses.replace(p, pieces=chunk // p.segment) for p in local)


def _by_chunks(fn, chunk: int, *xs):
  """fn over [B, chunk, ...] slices of [B, T, ...] arrays, one chunk after another; fn
  returns a tuple of [B, chunk, ...] arrays, written in place into [B, T, ...] ones.
  (A loop over indices rather than `lax.map` over split inputs: the loop reads the
  inputs where they are, where `lax.map` copied each into its loop state.)"""
  t = xs[0].shape[1]
  if chunk == t:
    return fn(*xs)
  parts = lambda i: tuple(lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1) for x in xs)
  shapes = jax.eval_shape(lambda: fn(*parts(0)))

  def body(i, outs):
    return tuple(
      lax.dynamic_update_slice_in_dim(o, y, i * chunk, axis=1) for o, y in zip(outs, fn(*parts(i)))
    )

  init = tuple(zeros_varying_like((y.shape[0], t, *y.shape[2:]), y.dtype, *xs) for y in shapes)
  return lax.fori_loop(0, t // chunk, body, init)


def _merge(out, lse, o, l):
  """Two partial softmax results over disjoint keys -> one (accumulation dtype)."""
  new = jnp.logaddexp(lse, l)
  safe = jnp.where(jnp.isneginf(new), 0.0, new)
  return out * jnp.exp(lse - safe)[..., None] + o * jnp.exp(l - safe)[..., None], new


def _forward_patterns(cfg: DilatedConfig, patterns, q, k, v, seg, out=None, lse=None):
  """Output and lse of `patterns` merged into (out, lse) (default: nothing seen yet)."""
  acc = cfg.policy.accum_dtype
  out = jnp.zeros(q.shape, acc) if out is None else out
  lse = jnp.full(q.shape[:3], -jnp.inf, acc) if lse is None else lse
  for pat in patterns:
    with jax.named_scope(f"pattern_w{pat.segment}_r{pat.rate}"):
      sel = _Selected(cfg, pat, q, k, v, seg)
      o, l = ring_forward_state(sel.ring, sel.inputs(sel.ring))
      o = sel.scatter_rows(unblock_q(o)[:, :, 0])
      l = sel.scatter_rows(unblock_rows(l)[:, :, 0], -jnp.inf)
      out, lse = _merge(out, lse, o, l)
  return out, lse


def _forward(cfg: DilatedConfig, q, k, v, seg):
  """Merged output [B, T, N, H] and lse [B, T, N], both in the accumulation dtype."""
  chunk, local = local_chunk(cfg, q.shape[1])
  out, lse = _by_chunks(functools.partial(_forward_patterns, cfg, local), chunk, q, k, v, seg)
  rings = tuple(p for p in cfg.patterns if p.ring > 1)
  return expose_floored(*_forward_patterns(cfg, rings, q, k, v, seg, out, lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dilated(cfg: DilatedConfig, q, k, v, seg):
  out, _ = _forward(cfg, q, k, v, seg)
  return out.astype(cfg.policy.out_dtype(q.dtype))


def _dilated_fwd(cfg: DilatedConfig, q, k, v, seg):
  out, lse = _forward(cfg, q, k, v, seg)
  kept = out.astype(cfg.policy.delta_dtype(q.dtype))  # what the backward's delta uses
  return out.astype(cfg.policy.out_dtype(q.dtype)), (q, k, v, seg, kept, lse)


def _backward_patterns(cfg: DilatedConfig, patterns, q, k, v, seg, g, lse, delta):
  """dq, dk, dv (accumulation dtype) of `patterns`, given the merged lse and delta."""
  pol = cfg.policy
  acc = pol.accum_dtype
  dq = jnp.zeros(q.shape, acc)
  dk = jnp.zeros(k.shape, acc)
  dv = jnp.zeros(v.shape, acc)
  for pat in patterns:
    with jax.named_scope(f"pattern_w{pat.segment}_r{pat.rate}"):
      sel = _Selected(cfg, pat, q, k, v, seg)
      x = sel.inputs(sel.ring)
      bq = sel.ring.block_q
      do = block_q(sel.gather_rows(g.astype(pol.compute_dtype))[:, :, None], bq)
      rows = lambda r, fill, sel=sel, bq=bq: block_rows(sel.gather_rows(r, fill)[:, :, None], bq)
      gq, gk, gv = ring_backward_state(sel.ring, x, do, rows(lse, -jnp.inf), rows(delta, 0.0))
      dq = dq + sel.scatter_rows(unblock_q(gq)[:, :, 0])
      dk = dk + sel.scatter_kv(unblock_kv(gk))
      dv = dv + sel.scatter_kv(unblock_kv(gv))
  return dq, dk, dv


def _dilated_bwd(cfg: DilatedConfig, res, g):
  q, k, v, seg, out, lse = res
  acc = cfg.policy.accum_dtype
  delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1)  # [B, T, N]
  chunk, local = local_chunk(cfg, q.shape[1])
  grads = _by_chunks(functools.partial(_backward_patterns, cfg, local), chunk, q, k, v, seg, g, lse, delta)
  rings = tuple(p for p in cfg.patterns if p.ring > 1)
  if rings:
    more = _backward_patterns(cfg, rings, q, k, v, seg, g, lse, delta)
    grads = tuple(a + b for a, b in zip(grads, more))
  dq, dk, dv = grads
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


dilated.defvjp(_dilated_fwd, _dilated_bwd)


def check_patterns(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Validates the two pattern lists; returns them as tuples of ints."""
  lists = {}
  for name, value in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
    if isinstance(value, (int, np.integer)) or not hasattr(value, "__len__"):
      raise TypeError(f"{name}={value!r} must be a sequence of positive ints, e.g. (2048, 4096)")
    items = tuple(value)
    if not items:
      raise ValueError(f"{name}={value!r} must not be empty")
    for item in items:
      if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < 1:
        raise ValueError(f"{name}={value!r} must hold positive ints; got {item!r}")
    lists[name] = tuple(int(i) for i in items)
  w, r = lists["segment_lengths"], lists["dilation_rates"]
  if len(w) != len(r):
    raise ValueError(
      f"segment_lengths={segment_lengths!r} and dilation_rates={dilation_rates!r} must have the same "
      f"length (one rate per segment length), got {len(w)} and {len(r)}"
    )
  return w, r


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "seq_axis", "batch_axis", "length"))
def _dilated_global(query, key, value, segment_ids, *, cfg, mesh, seq_axis, batch_axis, length):
  t = query.shape[1]
  if segment_ids is None:
    segment_ids = jnp.zeros(query.shape[:2], jnp.int32)
  seg = pad_seq(segment_ids.astype(jnp.int32), length - t, -1)
  query, key, value = (pad_seq(x, length - t) for x in (query, key, value))
  if mesh is None:
    return dilated(cfg, query, key, value, seg)[:, :t]

  spec, seg_spec = P(batch_axis, seq_axis, None, None), P(batch_axis, seq_axis)

  def impl(q, k, v, s, *, in_context):
    c = lambda x, sp: constrain(x, sp, mesh, in_context)
    args = c(q, spec), c(k, spec), c(v, spec), c(s, seg_spec)
    body = functools.partial(dilated, cfg)
    sharded = jax.shard_map(
      body,
      mesh=None if in_context else mesh,
      in_specs=(spec, spec, spec, seg_spec),
      out_specs=spec,
      check_vma=cfg.kernel != "pallas",  # as in `_attention.global_impl`
    )
    return sharded(*args)[:, :t]

  return call_on_mesh(impl, mesh, output_spec(mesh, seq_axis, batch_axis, None, t), query, key, value, seg)


def dilated_attention(
  query,
  key,
  value,
  *,
  segment_lengths,
  dilation_rates,
  mesh=None,
  seq_axis="seq",
  batch_axis=None,
  is_causal: bool = False,
  segment_ids=None,
  scale: float | None = None,
  policy: Policy | str | None = None,
  block_sizes: BlockSizes | None = None,
  kernel: str = "auto",
):
  """LongNet dilated attention (Ding et al. 2023, "LongNet: Scaling Transformers to
  1,000,000,000 Tokens"), exact, on one device or over `seq_axis` of `mesh`.

  Legend: B batch, T sequence length, N query heads, K kv heads (N % K == 0), H head dim.

  Pattern i cuts the sequence into segments of `segment_lengths[i]` tokens (the last
  may be short); in each segment head n keeps the positions whose offset from the
  segment start is n mod `dilation_rates[i]`, and its kept queries attend to its kept
  keys of the same segment. Patterns are merged by their softmax denominators (one
  softmax over all the keys a query reaches); a query no pattern selects gets 0.

  Args:
    query: [B, T, N, H] in natural order; key, value: [B, T, K, H].
    segment_lengths, dilation_rates: equally long sequences of positive ints.
    mesh: None (one device) or a `jax.sharding.Mesh` whose `seq_axis` shards the
      sequence. Segments that fit in a shard run locally; longer ones run a ring over
      the group of devices they span, carrying only the selected keys and values.
    batch_axis: optional mesh axis for the batch.
    is_causal: query i sees keys j <= i (on top of the pattern).
    segment_ids: int [B, T]; equal ids attend, negative ids are padding.
    scale: logit scale, default 1/sqrt(H).
    policy: a `Policy` or preset name; None means `policy_for` the mesh's first device.
    block_sizes: `BlockSizes` for the tiles of the attention inside a device.
    kernel: the block kernel of every pattern's attention: "auto", "xla" or "pallas",
      as in `jax_ring.ring_attention` (the platform is the mesh's, or JAX's default
      backend without a mesh).

  Any T works: the sequence is padded to a shard length at which every segment either
  fits in a shard or spans whole shards (with power-of-two segments and device counts
  that is at most the next multiple of the device count), and the padding is masked.

  Returns:
    [B, T, N, H] in the policy's output dtype (default: the query's dtype).
  """
  b, t, _, n, k, h = _validation.check_qkv(query, key, value, same_length=True)
  _validation.check_segment_ids(segment_ids, b, t)
  scale = _validation.check_scale(scale, h)
  lengths, rates = check_patterns(segment_lengths, dilation_rates)
  block_sizes = check_block_sizes(block_sizes)
  if mesh is None:
    devices, policy = 1, get_policy(policy)
    if batch_axis is not None:
      raise ValueError(f"batch_axis={batch_axis!r} needs a mesh; got mesh=None")
  else:
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh or None")
    mesh = usable_mesh(mesh, query, key, value)
    devices = _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
    nb = _validation.check_mesh_axis(mesh, batch_axis, "batch_axis", allow_none=True)
    if batch_axis is not None and batch_axis == seq_axis:
      raise ValueError(f"batch_axis={batch_axis!r} and seq_axis={seq_axis!r} must be different mesh axes")
    _validation.check_divides(b, nb, "batch", "batch_axis", batch_axis)
    _validation.notice_mesh(mesh, "dilated_attention", seq_axis, (seq_axis, batch_axis), t)
    policy = get_policy(policy, mesh.devices.flat[0])
  platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
  choice = _choice.choose_kernel(kernel, platform, h, policy, kernels=("auto", "xla", "pallas"))
  shard, patterns = plan(t, devices, lengths, rates)
  cfg = DilatedConfig(
    axis_name=None if mesh is None else seq_axis,
    devices=devices,
    patterns=patterns,
    is_causal=_validation.check_bool(is_causal, "is_causal"),
    scale=scale,
    policy=policy,
    block_sizes=block_sizes,
    num_kv_heads=k,
    groups=n // k,
    kernel=choice.kernel,
  )
  with jax.named_scope("jax_ring.dilated_attention"):
    if mesh is not None:
      query, key, value, segment_ids = place_on_mesh(
        mesh, seq_axis, batch_axis, None, query, key, value, segment_ids
      )
    return _dilated_global(
      query,
      key,
      value,
      segment_ids,
      cfg=cfg,
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      length=shard * devices,
    )
