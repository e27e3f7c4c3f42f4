"""The public ring attention entry points: arguments checked, then the ring run on
global arrays (`ring_attention`) or on shards inside the caller's `shard_map`
(`ring_attention_shard`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ring import _validation, layouts
from jax_ring._kernel import MaskSpec
from jax_ring._mesh import call_on_mesh, constrain, output_spec, pad_seq, place_on_mesh
from jax_ring._policy import Policy, get_policy
from jax_ring._ring import RingConfig, ring, schedule
from jax_ring._tiles import BlockSizes, check_block_sizes, local_blocks


def check_arguments(query, key, value, segment_ids, local_window_size, scale, block_sizes):
  """The checks every ring entry point shares: ((B, T, N, K), window, scale, block_sizes)."""
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
  (b, t, _, _), window, scale, block_sizes = check_arguments(
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
    padded, bq, bk = local_blocks(t, block_sizes, layout=layout if positions is None else None)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    if padded != t:
      has_padding = True
      extra = padded - t
      query, key, value = (pad_seq(x, extra) for x in (query, key, value))
      pos = jnp.pad(pos, (0, extra), constant_values=-1)
      seg = None if seg is None else pad_seq(seg, extra, -1)
    back, fwd = schedule(layout, window, is_causal, t, ring_size, positions is not None)
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
    out = ring(cfg, query, key, value, pos, pos, seg, seg)
    return out[:, :t]


@dataclasses.dataclass(frozen=True)
class GlobalConfig:
  """Everything static about one ring attention call on global arrays."""

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


def _write_cache(cache, k, v, seg, pos):
  """This device's K/V shard (in the ring's layout) into the front of its cache shard
  (k, v [B, S / p, K, H], positions and ids [B, S / p]); every other slot empty.
  Tokens with a negative segment id (padding) are stored as empty slots."""
  ck, cv, cpos, cseg = cache
  b, t = k.shape[:2]
  row_pos = jnp.broadcast_to(pos[None], (b, t))
  if seg is not None:
    row_pos = jnp.where(seg >= 0, row_pos, -1)
  seg = jnp.zeros((b, t), jnp.int32) if seg is None else seg
  at_front = lambda x, new: lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), 0, axis=1)
  return (
    at_front(ck, k),
    at_front(cv, v),
    at_front(jnp.full_like(cpos, -1), row_pos),
    at_front(cseg, seg),
  )


def global_impl(query, key, value, segment_ids, cache=None, *, gc: GlobalConfig, in_context: bool):
  """Pads, shards, relayouts, runs the ring, and undoes it all. In a mesh context
  (Explicit axes made Auto by `auto_axes`) specs are bare; otherwise NamedShardings.

  With `cache` (k, v, positions, segment ids of a sequence-sharded KV cache), each
  device also writes its K/V shard, as the layout placed it, into its cache shard;
  returns (output, cache)."""
  mesh = gc.mesh
  p = mesh.shape[gc.seq_axis]
  t = query.shape[1]
  padded = layouts.padded_length(gc.layout, t, p)
  if padded != t:
    query, key, value = (pad_seq(x, padded - t) for x in (query, key, value))
    segment_ids = None if segment_ids is None else pad_seq(segment_ids, padded - t, -1)
  spec = P(gc.batch_axis, gc.seq_axis, gc.head_axis, None)
  seg_spec = P(gc.batch_axis, gc.seq_axis)
  cache_specs = (spec, spec, seg_spec, seg_spec)
  c = lambda x, sp: constrain(x, sp, mesh, in_context)
  args = [c(x, spec) for x in (query, key, value)]
  specs = [spec, spec, spec]
  args.append(None if segment_ids is None else c(segment_ids, seg_spec))
  specs.append(None if segment_ids is None else seg_spec)
  if cache is not None:
    args.append(tuple(c(x, sp) for x, sp in zip(cache, cache_specs)))
    specs.append(cache_specs)

  def body(q, k, v, seg, cache=None):
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
    out = layouts.relayout_shard(out, gc.layout, gc.seq_axis, p, inverse=True)
    if cache is None:
      return out
    pos = layouts.shard_positions(gc.layout, lax.axis_index(gc.seq_axis), k.shape[1], p)
    return out, _write_cache(cache, k, v, seg, jnp.where(pos < t, pos, -1))

  out_specs = spec if cache is None else (spec, cache_specs)
  sharded = jax.shard_map(body, mesh=None if in_context else mesh, in_specs=tuple(specs), out_specs=out_specs)
  if cache is None:
    return sharded(*args)[:, :t]
  out, cache = sharded(*args)
  return out[:, :t], cache


@functools.partial(jax.jit, static_argnames=("gc",))
def _ring_attention_global(query, key, value, segment_ids, *, gc: GlobalConfig):
  out_spec = output_spec(gc.mesh, gc.seq_axis, gc.batch_axis, gc.head_axis, query.shape[1])
  impl = functools.partial(global_impl, gc=gc)
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
  (b, t, n, k), window, scale, block_sizes = check_arguments(
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
  gc = GlobalConfig(
    mesh, seq_axis, batch_axis, head_axis, is_causal, window, scale, layout, policy, block_sizes
  )
  with jax.named_scope("jax_ring.ring_attention"):
    query, key, value, segment_ids = place_on_mesh(
      mesh, seq_axis, batch_axis, head_axis, t, query, key, value, segment_ids
    )
    return _ring_attention_global(query, key, value, segment_ids, gc=gc)
