"""Ring attention: K/V shards rotate around the devices of one mesh axis.

Forward: every device keeps its queries and an online-softmax state (output and
log-sum-exp in the accumulation dtype); K/V blocks, their global positions and segment
ids travel the ring with `ppermute`, the next transfer issued before the current block
is computed. Backward (custom VJP): the ring runs again, and dK/dV accumulators travel
with the K/V they belong to, then one final ppermute brings them home. Residuals are
the local q, k, v, output and log-sum-exp: memory per device is O(seq / devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import _validation, layouts
from jax_ring._blocks import (
  KVBlocks,
  MaskSpec,
  QBlocks,
  chunk_backward,
  chunk_forward,
  finalize,
)
from jax_ring._policy import Policy, get_policy

# Tile sizes when BlockSizes leaves them None: (block_q, block_kv) for CPU meshes with
# more devices than host cores (simulated devices, each program on a fraction of a
# core), and for everything else. Measured on a 2-core CPU (docs/benchmarks.md): with 8
# simulated devices 256 x 256 and 1024 x 512 ran level; with 1 or 2 devices 1024 x 512
# ran 1.2 to 1.8x faster than 256 x 256.
SHARED_CORE_TILES = (256, 256)
TILES = (1024, 512)
MIN_AUTO_TILE = 256


def default_tiles(platform: str, devices: int, cores: int | None = None) -> tuple[int, int]:
  """(block_q, block_kv) for `devices` running at once on `platform`."""
  cores = (os.cpu_count() or 1) if cores is None else cores
  return SHARED_CORE_TILES if platform == "cpu" and devices > cores else TILES


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key block lengths inside a device.

  No score tile larger than [block_q x block_kv] exists per head. None (the default)
  picks per call (`default_tiles`): 256 x 256 on a CPU mesh with more devices than
  cores, else 1024 x 512; halved (not below 256) until they divide the local length
  rounded up to 256.
  """

  block_q: int | None = None
  block_kv: int | None = None
  # KV heads (with their query heads) per pass around the ring. Fewer heads per pass
  # shrink the ring's per-device buffers (blocked copies, K/V and dK/dV in flight,
  # accumulators) by the same factor; more amortize the fixed cost of each ring step,
  # which dominates short shards. None picks per call: the most heads (a divisor of the
  # local kv heads, at least 1) whose local length x heads is at most `pass_tokens`.
  kv_heads: int | None = None
  pass_tokens: int = 4096

  def __post_init__(self):
    for name in ("block_q", "block_kv", "kv_heads", "pass_tokens"):
      value = getattr(self, name)
      if name != "pass_tokens" and value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")

  def head_groups(self, num_kv_heads: int, local_length: int) -> int:
    """How many passes `num_kv_heads` local kv heads take for a shard of `local_length`."""
    if self.kv_heads is None:
      fits = [
        h
        for h in range(1, num_kv_heads + 1)
        if num_kv_heads % h == 0 and h * local_length <= self.pass_tokens
      ]
      return num_kv_heads // max(fits, default=1)
    if self.kv_heads >= num_kv_heads:
      return 1
    if num_kv_heads % self.kv_heads:  # e.g. kv_heads=2 with 3 heads on a device
      raise ValueError(
        f"BlockSizes.kv_heads={self.kv_heads} must divide the number of kv heads on a device, {num_kv_heads}"
      )
    return num_kv_heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class RingConfig:
  """Everything static about one ring attention call (the custom_vjp's nondiff arg)."""

  axis_name: Any
  ring_size: int
  mask: MaskSpec
  scale: float
  policy: Policy
  block_q: int
  block_kv: int
  # Ring schedule: K/V from `steps_back` devices before this one (rotating +1) and
  # `steps_fwd` after it (rotating -1). A full ring is (ring_size - 1, 0).
  steps_back: int
  steps_fwd: int
  # Devices on the mesh axis; when larger than ring_size the axis holds
  # axis_size // ring_size independent rings of consecutive devices (sub-rings).
  axis_size: int | None = None
  # The kv heads (with their query heads) run through the ring in this many groups,
  # one after another.
  head_groups: int = 1


def ring_permutation(ring_size: int, shift: int, axis_size: int | None = None):
  """Pairs (source, destination) that move every shard `shift` devices along its ring.

  With `axis_size` > `ring_size`, devices [i * ring_size, (i + 1) * ring_size) form
  ring i, and shards never leave their ring.
  """
  axis_size = ring_size if axis_size is None else axis_size
  return [
    (base + i, base + (i + shift) % ring_size)
    for base in range(0, axis_size, ring_size)
    for i in range(ring_size)
  ]


def _send(tree, cfg: RingConfig, shift: int):
  perm = ring_permutation(cfg.ring_size, shift, cfg.axis_size)
  return jax.tree.map(lambda x: lax.ppermute(x, cfg.axis_name, perm), tree)


def _pass_forward(cfg: RingConfig, compute, kv, acc, transfers: int, shift: int):
  """Computes with kv, then with `transfers` shards arriving from `shift` direction."""
  if transfers:

    def step(carry, _):
      kv, acc = carry
      incoming = _send(kv, cfg, shift)  # issued before this step's compute
      return (incoming, compute(kv, acc)), None

    (kv, acc), _ = lax.scan(step, (kv, acc), None, length=transfers)
  return compute(kv, acc)


def _pass_backward(cfg: RingConfig, compute, kv, dkv, dq, transfers: int, shift: int, home: int):
  """Like _pass_forward; dK/dV travel with their K/V, then move `home` devices back."""
  if transfers:

    def step(carry, _):
      kv, dkv, dq = carry
      incoming = _send(kv, cfg, shift)
      dq, dkv = compute(kv, dkv, dq)
      return (incoming, _send(dkv, cfg, shift), dq), None

    (kv, dkv, dq), _ = lax.scan(step, (kv, dkv, dq), None, length=transfers)
  dq, dkv = compute(kv, dkv, dq)
  if home % cfg.ring_size:
    dkv = _send(dkv, cfg, home)
  return dkv, dq


def _block_q(x, n):
  """Queries or their like [B, T, K, G, H] -> blocks [T // n, B, K, G, n, H]."""
  b, t, kh, g, h = x.shape
  return x.reshape(b, t // n, n, kh, g, h).transpose(1, 0, 3, 4, 2, 5)


def _unblock_q(x):
  """[nq, B, K, G, n, H] -> [B, nq * n, K, G, H]."""
  nq, b, kh, g, n, h = x.shape
  return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * n, kh, g, h)


def _block_kv(x, n):
  """Keys or values [B, T, K, H] -> blocks [T // n, B, K, n, H]."""
  b, t, kh, h = x.shape
  return x.reshape(b, t // n, n, kh, h).transpose(1, 0, 3, 2, 4)


def _unblock_kv(x):
  """[nk, B, K, n, H] -> [B, nk * n, K, H]."""
  nk, b, kh, n, h = x.shape
  return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * n, kh, h)


def _block_seg(x, n):
  """Segment ids [B, T] -> [T // n, B, n]; None stays None."""
  return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], -1, n), 1, 0)


def _zeros_like_both(shape, dtype, a, b):
  """Zeros that vary over the mesh axes of both a and b (keeps scan carries typed)."""
  zero = jnp.zeros_like(a, shape=(), dtype=dtype) + jnp.zeros_like(b, shape=(), dtype=dtype)
  return jnp.broadcast_to(zero, shape)


class _Inputs(NamedTuple):
  q: jax.Array  # [nq, B, K, G, bq, H] compute dtype, times the softmax scale
  q_pos: jax.Array  # [nq, bq]
  q_seg: jax.Array | None  # [nq, B, bq]
  kv: KVBlocks  # blocks of the local K/V (wire dtype)


def _prepare(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg) -> _Inputs:
  b, t, n, h = q.shape
  kh = k.shape[2]
  pol = cfg.policy
  scaled = q.astype(pol.accum_dtype) * jnp.asarray(cfg.scale, pol.accum_dtype)
  qg = scaled.astype(pol.compute_dtype).reshape(b, t, kh, n // kh, h)
  kv = KVBlocks(
    k=_block_kv(k.astype(pol.transfer_dtype), cfg.block_kv),
    v=_block_kv(v.astype(pol.transfer_dtype), cfg.block_kv),
    pos=k_pos.reshape(-1, cfg.block_kv),
    seg=_block_seg(k_seg, cfg.block_kv),
  )
  return _Inputs(
    _block_q(qg, cfg.block_q), q_pos.reshape(-1, cfg.block_q), _block_seg(q_seg, cfg.block_q), kv
  )


def _as_compute(kv: KVBlocks, policy: Policy) -> KVBlocks:
  return kv._replace(k=kv.k.astype(policy.compute_dtype), v=kv.v.astype(policy.compute_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg):
  return _ring_fwd(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg)[0]


class _Residuals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  out: jax.Array
  lse: jax.Array
  q_pos: jax.Array
  k_pos: jax.Array
  q_seg: jax.Array | None
  k_seg: jax.Array | None


def _ring_forward_state(cfg: RingConfig, x: _Inputs):
  """(out, lse) in accumulation dtype, blocked: [nq, B, K, G, bq, H], [nq, B, K, G, bq]."""
  pol = cfg.policy
  o = _zeros_like_both(x.q.shape, pol.accum_dtype, x.q, x.kv.k)
  m = jnp.full_like(o, -jnp.inf, shape=x.q.shape[:-1])
  l = jnp.zeros_like(m)

  def compute(kv, acc):
    return chunk_forward(cfg.mask, pol, x.q, x.q_pos, x.q_seg, _as_compute(kv, pol), acc)

  acc = _pass_forward(cfg, compute, x.kv, (o, m, l), cfg.steps_back, +1)
  if cfg.steps_fwd:
    acc = _pass_forward(cfg, compute, _send(x.kv, cfg, -1), acc, cfg.steps_fwd - 1, -1)
  return finalize(*acc)


def _head_groups(cfg: RingConfig, q, k):
  """(number of groups, query heads per group, kv heads per group)."""
  groups = cfg.head_groups
  return groups, q.shape[2] // groups, k.shape[2] // groups


def _heads(x, j, width: int):
  """Heads [j * width, (j + 1) * width) of x [B, T, heads, ...] (j may be traced)."""
  return lax.dynamic_slice_in_dim(x, j * width, width, axis=2)


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg):
  # Head groups run one after another, so the ring's buffers (blocked copies, K/V in
  # flight, accumulators) hold one group's heads at a time.
  groups, wq, wk = _head_groups(cfg, q, k)
  out_dtype = cfg.policy.out_dtype(q.dtype)

  def group(out, j):
    x = _prepare(cfg, _heads(q, j, wq), _heads(k, j, wk), _heads(v, j, wk), q_pos, k_pos, q_seg, k_seg)
    o, lse = _ring_forward_state(cfg, x)
    o = _unblock_q(o).reshape(*q.shape[:2], wq, q.shape[3]).astype(out_dtype)
    return lax.dynamic_update_slice_in_dim(out, o, j * wq, axis=2), lse

  out = _zeros_like_both(q.shape, out_dtype, q, k)
  out, lse = lax.scan(group, out, jnp.arange(groups))
  return out, _Residuals(q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg)


def _block_rows(x, block: int):
  """Per-row statistics [B, T, K, G] -> blocked [nq, B, K, G, bq] (the lse layout)."""
  b, t, kh, g = x.shape
  return x.reshape(b, t // block, block, kh, g).transpose(1, 0, 3, 4, 2)


def _unblock_rows(x):
  """Blocked statistics [nq, B, K, G, bq] -> [B, T, K, G]."""
  nq, b, kh, g, n = x.shape
  return x.transpose(1, 0, 4, 2, 3).reshape(b, nq * n, kh, g)


def _ring_backward_state(cfg: RingConfig, x: _Inputs, do, lse, delta):
  """dq, dk, dv (blocked, accumulation dtype) given the blocked dO, lse and delta.

  delta is sum(dO * O) over the head dim, minus the cotangent of lse if lse is an
  output too (d lse_i / d s_ij = p_ij enters the score gradient like -delta does).
  """
  pol = cfg.policy
  # [nq, B, K, G, bq, H] -> [nq, B, K, H, G, bq]: the layout the dK and dV products take.
  heads_first = lambda x: jnp.moveaxis(x, -1, -3)
  qb = QBlocks(
    q=x.q, q_t=heads_first(x.q), do=do, do_t=heads_first(do), lse=lse, delta=delta, pos=x.q_pos, seg=x.q_seg
  )
  dq = _zeros_like_both(x.q.shape, pol.accum_dtype, x.q, x.kv.k)
  shape_t = x.kv.k.shape[:-2] + x.kv.k.shape[:-3:-1]  # dK and dV travel transposed
  zeros_kv = lambda: (
    _zeros_like_both(shape_t, pol.accum_dtype, x.q, x.kv.k),
    _zeros_like_both(shape_t, pol.accum_dtype, x.q, x.kv.v),
  )

  def compute(kv, dkv, dq):
    dq, dk, dv = chunk_backward(cfg.mask, pol, qb, dq, _as_compute(kv, pol), *dkv)
    return dq, (dk, dv)

  back = cfg.steps_back
  (dk, dv), dq = _pass_backward(cfg, compute, x.kv, zeros_kv(), dq, back, +1, -back)
  if cfg.steps_fwd:
    # These K/V started one device ahead and end `steps_fwd` ahead of their owner.
    fwd = cfg.steps_fwd
    (dk2, dv2), dq = _pass_backward(cfg, compute, _send(x.kv, cfg, -1), zeros_kv(), dq, fwd - 1, -1, fwd)
    dk, dv = dk + dk2, dv + dv2
  untranspose = lambda x: jnp.swapaxes(x, -1, -2)
  return dq * jnp.asarray(cfg.scale, pol.accum_dtype), untranspose(dk), untranspose(dv)


def _ring_bwd(cfg: RingConfig, res: _Residuals, g):
  pol = cfg.policy
  groups, wq, wk = _head_groups(cfg, res.q, res.k)
  delta_all = jnp.sum(g.astype(pol.accum_dtype) * res.out.astype(pol.accum_dtype), axis=-1)  # [B, T, N]

  def group(grads, xs):
    j, lse = xs
    q, k, v = _heads(res.q, j, wq), _heads(res.k, j, wk), _heads(res.v, j, wk)
    x = _prepare(cfg, q, k, v, res.q_pos, res.k_pos, res.q_seg, res.k_seg)
    nq, b, kh, grp, bq, h = x.q.shape
    do = _block_q(_heads(g, j, wq).astype(pol.compute_dtype).reshape(b, -1, kh, grp, h), bq)
    delta = _block_rows(_heads(delta_all, j, wq).reshape(b, -1, kh, grp), bq)
    gq, gk, gv = _ring_backward_state(cfg, x, do, lse, delta)
    gq = _unblock_q(gq).reshape(q.shape)
    new = (gq, _unblock_kv(gk), _unblock_kv(gv))
    widths = (wq, wk, wk)
    return tuple(
      lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), j * w, axis=2)
      for a, n, w in zip(grads, new, widths)
    ), None

  zeros = tuple(_zeros_like_both(x.shape, x.dtype, x, res.k) for x in (res.q, res.k, res.v))
  (dq, dk, dv), _ = lax.scan(group, zeros, (jnp.arange(groups), res.lse))
  return dq, dk, dv, None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _local_blocks(
  length: int, bs: BlockSizes, devices: int | None = None, layout: str | None = None
) -> tuple[int, int, int]:
  """(padded local length, block_q, block_kv) so both blocks divide the length.

  `devices` is how many devices run at once (default: those of the current mesh).
  Under the zigzag layout, blocks chosen here stay within one of the shard's two
  halves where they can, so the causal mask can skip whole tiles.
  """
  if devices is None:
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else mesh.size
  auto_q, auto_kv = default_tiles(jax.default_backend(), devices)

  rounded = length if length <= MIN_AUTO_TILE else -(-length // MIN_AUTO_TILE) * MIN_AUTO_TILE

  def fit(block, auto):
    """A given block as is; else the whole length if short, or the largest of auto,
    auto / 2, ..., 256 that divides the length rounded up to 256."""
    if block is not None:
      return block
    auto = min(auto, rounded)
    if layout == "zigzag" and length % 2 == 0 and rounded % (length // 2) == 0:
      auto = min(auto, length // 2)
    while rounded % auto:
      auto //= 2
    return auto

  want_q, want_kv = fit(bs.block_q, auto_q), fit(bs.block_kv, auto_kv)
  padded = length if bs.block_q and bs.block_kv else rounded
  while True:
    bq, bk = min(want_q, padded), min(want_kv, padded)
    if padded % bq == 0 and padded % bk == 0:
      return padded, bq, bk
    padded = -(-padded // math.lcm(bq, bk)) * math.lcm(bq, bk)


def _schedule(layout, window, is_causal, shard_len, ring_size, custom_positions):
  """How many ring steps can hold visible keys, in each direction."""
  full = (ring_size - 1, 0)
  if layout != "contiguous" or custom_positions or window is None:
    return full
  left, right = window
  back = min(ring_size - 1, -(-left // shard_len))
  fwd = 0 if is_causal else min(ring_size - 1 - back, -(-right // shard_len))
  return back, fwd


def pad_seq(x, extra: int, value=0):
  """Pads axis 1 (the sequence) of x with `extra` entries of `value`."""
  if not extra:
    return x
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def check_block_sizes(block_sizes) -> BlockSizes:
  """None -> the defaults; anything but a BlockSizes is a TypeError."""
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes={block_sizes!r} must be a jax_ring.BlockSizes or None")
  return block_sizes


def constrain(x, spec, mesh, in_context: bool):
  """Sharding constraint with a bare spec inside a mesh context, a NamedSharding outside."""
  return lax.with_sharding_constraint(x, spec if in_context else NamedSharding(mesh, spec))


def _check_arguments(query, key, value, segment_ids, local_window_size, scale, block_sizes):
  """The checks both entry points share: ((B, T, N, K), window, scale, block_sizes)."""
  b, t, _, n, k, h = _validation.check_qkv(query, key, value, same_length=True)
  _validation.check_segment_ids(segment_ids, b, t)
  window = _validation.normalize_window(local_window_size)
  scale = _validation.check_scale(scale, h)
  return (b, t, n, k), window, scale, check_block_sizes(block_sizes)


def ring_attention_shard(
  query,
  key,
  value,
  *,
  axis_name,
  is_causal: bool = False,
  segment_ids=None,
  local_window_size=None,
  scale: float | None = None,
  layout: str = "contiguous",
  policy: Policy | str | None = None,
  block_sizes: BlockSizes | None = None,
  positions=None,
  _valid_length: int | None = None,
):
  """Ring attention for code already inside `jax.shard_map`: shards in, shard out.

  Legend: B batch, T local (per-device) length, N query heads, K kv heads, H head dim.

  Args:
    query: [B, T, N, H], this device's shard of the queries.
    key, value: [B, T, K, H], this device's shard of keys and values (N % K == 0).
    axis_name: the mesh axis the sequence is sharded over (the ring).
    is_causal, local_window_size, scale: as in `ring_attention`, on global positions.
    segment_ids: int [B, T], this device's shard; negative ids are padding.
    layout: how global positions map to devices ("contiguous", "striped", "zigzag",
      or "auto": zigzag when causal). The tokens must already be in that layout.
    policy: a `Policy` or preset name; None means `policy_for()` the first device.
    block_sizes: `BlockSizes` for the tiles inside a device.
    positions: int [T] global positions of this shard's tokens; overrides `layout`.

  Returns:
    [B, T, N, H] output shard in the policy's output dtype.
  """
  (b, t, _, _), window, scale, block_sizes = _check_arguments(
    query, key, value, segment_ids, local_window_size, scale, block_sizes
  )
  layout = layouts.resolve(layout, is_causal)
  policy = get_policy(policy)
  with jax.named_scope("jax_ring.ring_attention_shard"):
    ring_size = lax.axis_size(axis_name)
    if positions is None:
      pos = layouts.shard_positions(layout, lax.axis_index(axis_name), t, ring_size)
    else:
      if tuple(positions.shape) != (t,) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
          f"positions shape={tuple(positions.shape)} dtype={positions.dtype} must be int [{t}]"
        )
      pos = positions.astype(jnp.int32)
    has_padding = _valid_length is not None or positions is not None
    if _valid_length is not None:
      pos = jnp.where(pos < _valid_length, pos, -1)
    padded, bq, bk = _local_blocks(t, block_sizes, layout=layout if positions is None else None)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    if padded != t:
      has_padding = True
      extra = padded - t
      query, key, value = (pad_seq(x, extra) for x in (query, key, value))
      pos = jnp.pad(pos, (0, extra), constant_values=-1)
      seg = None if seg is None else pad_seq(seg, extra, -1)
    back, fwd = _schedule(layout, window, is_causal, t, ring_size, positions is not None)
    cfg = RingConfig(
      axis_name=axis_name,
      ring_size=ring_size,
      mask=MaskSpec(is_causal=is_causal, window=window, has_padding=has_padding),
      scale=scale,
      policy=policy,
      block_q=bq,
      block_kv=bk,
      steps_back=back,
      steps_fwd=fwd,
      head_groups=block_sizes.head_groups(key.shape[2], padded),
    )
    out = _ring(cfg, query, key, value, pos, pos, seg, seg)
    return out[:, :t]


def _explicit_axes(mesh) -> tuple:
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)


@dataclasses.dataclass(frozen=True)
class _GlobalConfig:
  mesh: Any
  seq_axis: Any
  batch_axis: Any
  head_axis: Any
  is_causal: bool
  window: tuple[int, int] | None
  scale: float
  layout: str
  policy: Policy
  block_sizes: BlockSizes


def _global_impl(query, key, value, segment_ids, *, gc: _GlobalConfig, in_context: bool):
  """Pads, shards, relayouts, runs the ring, and undoes it all. In a mesh context
  (Explicit axes made Auto by `auto_axes`) specs are bare; otherwise NamedShardings."""
  mesh = gc.mesh
  p = mesh.shape[gc.seq_axis]
  t = query.shape[1]
  padded = layouts.padded_length(gc.layout, t, p)
  if padded != t:
    query, key, value = (pad_seq(x, padded - t) for x in (query, key, value))
    segment_ids = None if segment_ids is None else pad_seq(segment_ids, padded - t, -1)
  spec = P(gc.batch_axis, gc.seq_axis, gc.head_axis, None)
  seg_spec = P(gc.batch_axis, gc.seq_axis)
  args = [constrain(x, spec, mesh, in_context) for x in (query, key, value)]
  specs = [spec, spec, spec]
  if segment_ids is not None:
    args.append(constrain(segment_ids, seg_spec, mesh, in_context))
    specs.append(seg_spec)

  def body(q, k, v, seg=None):
    to = lambda x: layouts.relayout_shard(x, gc.layout, gc.seq_axis, p)
    q, k, v = to(q), to(k), to(v)
    seg = None if seg is None else to(seg)
    out = ring_attention_shard(
      q,
      k,
      v,
      axis_name=gc.seq_axis,
      is_causal=gc.is_causal,
      segment_ids=seg,
      local_window_size=gc.window,
      scale=gc.scale,
      layout=gc.layout,
      policy=gc.policy,
      block_sizes=gc.block_sizes,
      _valid_length=t if padded != t else None,
    )
    return layouts.relayout_shard(out, gc.layout, gc.seq_axis, p, inverse=True)

  sharded = jax.shard_map(body, mesh=None if in_context else mesh, in_specs=tuple(specs), out_specs=spec)
  return sharded(*args)[:, :t]


def call_on_mesh(impl, mesh, out_spec, *args):
  """Calls impl(*args, in_context=...) inside jit. Explicit mesh axes are made Auto for
  the call (`auto_axes`), where XLA may pad uneven shards; the result gets `out_spec`."""
  explicit = _explicit_axes(mesh)
  if not explicit:
    return impl(*args, in_context=False)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.sharding.auto_axes(
      functools.partial(impl, in_context=True), axes=explicit, out_sharding=out_spec
    )(*args)


def place_on_mesh(mesh, seq_axis, batch_axis, head_axis, length, query, key, value, segment_ids):
  """With Explicit axes, arrays are typed by their sharding: put the inputs on the mesh
  first (sharded along the sequence when the axis divides the length)."""
  if not _explicit_axes(mesh):
    return query, key, value, segment_ids
  seq = seq_axis if length % mesh.shape[seq_axis] == 0 else None
  put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
  query, key, value = (put(x, P(batch_axis, seq, head_axis, None)) for x in (query, key, value))
  return query, key, value, put(segment_ids, P(batch_axis, seq))


def output_spec(mesh, seq_axis, batch_axis, head_axis, length):
  """The output's spec: the sequence stays sharded when the axis divides its length."""
  seq = seq_axis if length % mesh.shape[seq_axis] == 0 else None
  return P(batch_axis, seq, head_axis, None)


@functools.partial(jax.jit, static_argnames=("gc",))
def _ring_attention_global(query, key, value, segment_ids, *, gc: _GlobalConfig):
  out_spec = output_spec(gc.mesh, gc.seq_axis, gc.batch_axis, gc.head_axis, query.shape[1])
  impl = functools.partial(_global_impl, gc=gc)
  return call_on_mesh(impl, gc.mesh, out_spec, query, key, value, segment_ids)


def ring_attention(
  query,
  key,
  value,
  *,
  mesh,
  seq_axis="seq",
  batch_axis=None,
  head_axis=None,
  is_causal: bool = False,
  segment_ids=None,
  local_window_size=None,
  scale: float | None = None,
  layout: str = "auto",
  policy: Policy | str | None = None,
  block_sizes: BlockSizes | None = None,
):
  """Exact softmax attention with the sequence sharded over `seq_axis` of `mesh`.

  Legend: B batch, T sequence length, N query heads, K key/value heads (N % K == 0,
  query head n uses kv head n // (N // K)), H head dim.

  Args:
    query: [B, T, N, H] in natural token order.
    key, value: [B, T, K, H].
    mesh: a `jax.sharding.Mesh` with axis `seq_axis` (and optionally batch/head axes).
    seq_axis: mesh axis over which the sequence is sharded; K/V rotate around it.
    batch_axis, head_axis: optional mesh axes for the batch and head dimensions.
    is_causal: query i sees keys j <= i (global positions).
    segment_ids: int [B, T]; query sees key only with equal ids; negative = padding.
    local_window_size: int w or (left, right): query i sees i - left <= j <= i + right.
    scale: logit scale, default 1/sqrt(H).
    layout: "auto" (zigzag when causal, else contiguous), "contiguous", "striped",
      "zigzag": how tokens are placed on devices internally. Input and output stay in
      natural order.
    policy: a `Policy` or a preset name; None means `policy_for` the mesh's first device.
    block_sizes: `BlockSizes`, the tile sizes inside a device.

  Any T works: it is padded internally to what the layout needs, and the padding is
  masked. A query that sees no key gets 0.

  Returns:
    [B, T, N, H], in the policy's output dtype (default: the query's dtype).
  """
  (b, t, n, k), window, scale, block_sizes = _check_arguments(
    query, key, value, segment_ids, local_window_size, scale, block_sizes
  )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
  nb = _validation.check_mesh_axis(mesh, batch_axis, "batch_axis", allow_none=True)
  nh = _validation.check_mesh_axis(mesh, head_axis, "head_axis", allow_none=True)
  named = [a for a in (seq_axis, batch_axis, head_axis) if a is not None]
  if len(set(named)) != len(named):
    raise ValueError(f"{seq_axis=}, {batch_axis=}, {head_axis=} must name different mesh axes")
  _validation.check_divides(b, nb, "batch", "batch_axis", batch_axis)
  _validation.check_divides(k, nh, "num_kv_heads", "head_axis", head_axis)
  layout = layouts.resolve(layout, is_causal)
  policy = get_policy(policy, mesh.devices.flat[0])
  gc = _GlobalConfig(
    mesh, seq_axis, batch_axis, head_axis, is_causal, window, scale, layout, policy, block_sizes
  )
  with jax.named_scope("jax_ring.ring_attention"):
    query, key, value, segment_ids = place_on_mesh(
      mesh, seq_axis, batch_axis, head_axis, t, query, key, value, segment_ids
    )
    return _ring_attention_global(query, key, value, segment_ids, gc=gc)
