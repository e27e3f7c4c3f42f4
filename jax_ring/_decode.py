"""Decoding from a sequence-sharded KV cache: exact attention of new tokens against
every cached token, with no K/V moving between devices.

Each device attends the new queries to its own shard of the cache and keeps the
partial result (output o_d, log-sum-exp lse_d); the partials are merged exactly by
their softmax denominators: M = max_d lse_d, w_d = exp(lse_d - M),
out = sum_d w_d o_d / sum_d w_d. That is two all-reduces, a max of lse (B x Tq x N
values) and a sum of [w_d o_d, w_d] (B x Tq x N x (H + 1) values), whatever the cache
length ("Tree Attention", Shyam et al. 2024, arXiv 2408.04093). Rotating the cache
around the ring instead would move 2 x S x K x H values per new token.

The cache (`KVCache`) holds global positions per slot (-1: empty), so its layout on
the devices is free: the prompt is written where the ring's layout put it (no
relayout), and each new token goes to the next device in turn (round-robin, as vLLM's
context parallelism does), so every device's fill differs by at most one and decode
cost stays balanced. Slots fill from the front of each device's shard; a device loops
only over its filled tiles, so cost follows the fill, not the capacity.

Legend: B batch, Tq new tokens, S cache capacity, N query heads, K kv heads,
G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import _validation, layouts
from jax_ring._attention import GlobalConfig, check_arguments, global_impl
from jax_ring._dilated import check_patterns
from jax_ring._kernel import Tile, block_update, expose_floored, finalize
from jax_ring._merge import merge_local, merge_partials
from jax_ring._mesh import call_on_mesh, constrain, output_spec, place, place_on_mesh, usable_mesh
from jax_ring._mods import NO_MODS, ScoreArgs, ScoreMods, first_index, with_sinks
from jax_ring._policy import Policy, get_policy
from jax_ring._ring import zeros_varying_like
from jax_ring._tiles import BlockSizes

# Key tiles of the cache a device visits per loop step, at most (the local capacity
# is a multiple of the tile; see `cache_tile`).
CACHE_TILE = 1024
MIN_CACHE_TILE = 256


class KVCache(NamedTuple):
  """A key/value cache sharded along the sequence over a mesh axis.

  Device d holds slots [d * S / p, (d + 1) * S / p) of `k`, `v`, `positions` and
  `segment_ids`; its filled slots are a prefix of its shard (`prefilled` from the
  prompt, then every p-th appended token).

  Attributes:
    k, v: [B, S, K, H] cached keys and values.
    positions: int32 [B, S], the global position of each slot's token; -1 = empty.
    segment_ids: int32 [B, S], the segment id of each slot's token.
    lengths: int32 [B], tokens of each row so far (the next token's position).
    prefilled: int32 [], slots per device the prompt filled.
    appended: int32 [], tokens appended (per row) since the prompt.
  """

  k: jax.Array
  v: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  lengths: jax.Array
  prefilled: jax.Array
  appended: jax.Array

  @property
  def capacity(self) -> int:
    """S, the slots per row over all devices (at least `init_cache`'s max_length; see
    there for what a row may hold)."""
    return self.k.shape[1]


@dataclasses.dataclass(frozen=True)
class CacheAxes:
  """The mesh axes a cache is sharded over."""

  mesh: Any
  seq_axis: Any
  batch_axis: Any = None
  head_axis: Any = None

  @property
  def devices(self) -> int:
    return self.mesh.shape[self.seq_axis]

  def specs(self) -> KVCache:
    """The PartitionSpec of every field."""
    kv = P(self.batch_axis, self.seq_axis, self.head_axis, None)
    rows = P(self.batch_axis, self.seq_axis)
    return KVCache(kv, kv, rows, rows, P(self.batch_axis), P(), P())

  def query_spec(self) -> P:
    """New tokens' queries, keys and values: replicated along the sequence axis."""
    return P(self.batch_axis, None, self.head_axis, None)


def _check_axes(mesh, seq_axis, batch_axis, head_axis, *inputs) -> CacheAxes:
  """The axes of a cache call, on the mesh `usable_mesh` gives for these inputs."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
  _validation.check_mesh_axis(mesh, batch_axis, "batch_axis", allow_none=True)
  _validation.check_mesh_axis(mesh, head_axis, "head_axis", allow_none=True)
  named = [a for a in (seq_axis, batch_axis, head_axis) if a is not None]
  if len(set(named)) != len(named):
    raise ValueError(f"{seq_axis=}, {batch_axis=}, {head_axis=} must name different mesh axes")
  _validation.notice_mesh(mesh, "KV cache", seq_axis, named)
  return CacheAxes(usable_mesh(mesh, *inputs), seq_axis, batch_axis, head_axis)


def local_capacity(max_length: int, devices: int) -> int:
  """Slots per device for `max_length` tokens per row: room for the padding the
  prompt's layout adds and for the round-robin's unevenness, rounded to whole tiles."""
  local = -(-max_length // devices) + 3
  if local > MIN_CACHE_TILE:
    local = -(-local // MIN_CACHE_TILE) * MIN_CACHE_TILE
  return local


def cache_tile(local: int, block_kv: int | None = None) -> int:
  """The key tile for a local capacity: `block_kv` if it divides it, else the largest of
  1024, 512, 256 that does, or the whole shard if it is shorter."""
  if block_kv is not None and local % block_kv == 0:
    return block_kv
  for tile in (CACHE_TILE, CACHE_TILE // 2, MIN_CACHE_TILE):
    if local % tile == 0:
      return tile
  return local


def init_cache(
  batch_size: int,
  max_length: int,
  num_kv_heads: int,
  head_dim: int,
  *,
  mesh,
  seq_axis="seq",
  batch_axis=None,
  head_axis=None,
  dtype=jnp.float32,
) -> KVCache:
  """An empty `KVCache` for `max_length` tokens per row (prompt and generated),
  sharded over `seq_axis` of `mesh` (and optionally the batch and kv heads).

  Legend: B = batch_size, K = num_kv_heads, H = head_dim.

  The capacity S (`KVCache.capacity`) is a little more than `max_length`: each of the
  p devices gets ceil(max_length / p) + 3 slots (rounded up to 256 past 256), room for
  the padding a prompt's layout adds and for the round-robin's unevenness.

  What a row may hold: a prompt takes its whole buffer, the prompt array's length T
  (padded to a multiple of 2p under zigzag, of p contiguous), whatever `lengths` says
  of its real tokens; each appended token takes one slot, on the next device in turn.
  A prompt buffer of T plus n appended tokens always fits when T + n <= max_length
  (with prefill's default layouts); more may fit, up to the capacity, but is not
  promised. A call that would overflow a device's slots raises a ValueError (checked
  when the cache's counters are concrete, as they are outside jit).
  """
  axes = _check_axes(mesh, seq_axis, batch_axis, head_axis)
  for name, value in (
    ("batch_size", batch_size),
    ("max_length", max_length),
    ("num_kv_heads", num_kv_heads),
    ("head_dim", head_dim),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  nb = mesh.shape[batch_axis] if batch_axis is not None else 1
  _validation.check_divides(batch_size, nb, "batch_size", "batch_axis", batch_axis)
  nh = mesh.shape[head_axis] if head_axis is not None else 1
  _validation.check_divides(num_kv_heads, nh, "num_kv_heads", "head_axis", head_axis)
  s = axes.devices * local_capacity(max_length, axes.devices)
  return _empty_cache(batch_size, s, num_kv_heads, head_dim, jnp.dtype(dtype), axes)


@functools.cache
def _empty_cache_program(b: int, s: int, k: int, h: int, dtype, axes: CacheAxes):
  """The jitted program that makes an empty cache of this shape (cached: compiled once;
  the arrays are not cached, so a call inside a caller's jit traces it instead)."""

  def make():
    zeros = jnp.zeros((b, s, k, h), dtype)
    rows = jnp.zeros((b, s), jnp.int32)
    scalar = jnp.zeros((), jnp.int32)
    return KVCache(zeros, zeros, rows - 1, rows, jnp.zeros((b,), jnp.int32), scalar, scalar)

  shardings = KVCache(*(NamedSharding(axes.mesh, spec) for spec in axes.specs()))
  return jax.jit(make, out_shardings=shardings)


def _empty_cache(b: int, s: int, k: int, h: int, dtype, axes: CacheAxes) -> KVCache:
  return _empty_cache_program(b, s, k, h, dtype, axes)()


def check_cache(cache, axes: CacheAxes, num_heads: int | None = None, head_dim: int | None = None):
  """Validates a KVCache against the mesh and, optionally, the queries' heads."""
  if not isinstance(cache, KVCache):
    raise TypeError(
      f"cache must be a jax_ring.KVCache (from jax_ring.init_cache), got {type(cache).__name__}"
    )
  b, s, k, h = cache.k.shape
  if cache.v.shape != cache.k.shape:
    raise ValueError(f"cache.v.shape={tuple(cache.v.shape)} must equal cache.k.shape={tuple(cache.k.shape)}")
  if tuple(cache.positions.shape) != (b, s) or tuple(cache.segment_ids.shape) != (b, s):
    raise ValueError(
      f"cache.positions.shape={tuple(cache.positions.shape)} and cache.segment_ids.shape="
      f"{tuple(cache.segment_ids.shape)} must be (batch, capacity)={(b, s)}"
    )
  if s % axes.devices:
    raise ValueError(
      f"cache capacity {s} must be divisible by the {axes.devices} devices of {axes.seq_axis!r}"
    )
  _check_same_mesh(cache, axes.mesh)
  if num_heads is not None and num_heads % k:
    raise ValueError(f"num_heads={num_heads} must be a multiple of the cache's num_kv_heads={k}")
  if head_dim is not None and head_dim != h:
    raise ValueError(f"query head_dim={head_dim} must equal the cache's head_dim={h}")
  return b, s, k, h


def _describe(mesh) -> str:
  ids = [d.id for d in mesh.devices.flat]
  return f"{dict(mesh.shape)} over devices {ids}"


def _check_same_mesh(cache, mesh) -> None:
  """ValueError naming both meshes when the cache's arrays live on a mesh with other
  devices or axes than the call's (JAX would say only "incompatible devices")."""
  if isinstance(cache.k, jax.core.Tracer):  # under jit: JAX places the traced arrays
    return
  sharding = getattr(cache.k, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return
  held = sharding.mesh
  same = tuple(held.axis_names) == tuple(mesh.axis_names) and [d.id for d in held.devices.flat] == [
    d.id for d in mesh.devices.flat
  ]
  if not same:
    raise ValueError(
      f"the cache lives on mesh {_describe(held)}, but this call's mesh is {_describe(mesh)}: pass the "
      "mesh the cache was made with (init_cache(..., mesh=)), or move the cache there first"
    )


def _concrete(x) -> int | None:
  """The value of an int scalar that is not traced, else None."""
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return int(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def check_room(cache: KVCache, devices: int, new_tokens: int) -> None:
  """ValueError if appending `new_tokens` per row overflows a device's shard (checked
  when the cache's counters are concrete; under jit the caller must plan the room,
  as `models.generate` does)."""
  prefilled, appended = _concrete(cache.prefilled), _concrete(cache.appended)
  if prefilled is None or appended is None:
    return
  local = cache.capacity // devices
  need = prefilled + -(-(appended + new_tokens) // devices)
  if need > local:
    raise ValueError(
      f"the cache is full: {new_tokens} new tokens per row need {need} slots on some device, but each "
      f"holds {local} (capacity {cache.capacity} over {devices} devices, {prefilled} filled by the prompt, "
      f"{appended} appended); make it with a larger max_length"
    )


def device_fill(prefilled, appended, index, devices: int):
  """Filled slots on device `index`: its prompt slots plus every `devices`-th
  appended token starting with token `index`."""
  return prefilled + jnp.maximum(appended - index + devices - 1, 0) // devices


def append_shard(cache: KVCache, k, v, segment_ids, index, devices: int) -> KVCache:
  """Writes the new tokens' k, v [B, Tq, K, H] into this device's cache shard: token j
  goes to device (appended + j) mod p, at its next free slot. Counters and lengths
  are advanced by the caller (they are not sharded)."""
  tq = k.shape[1]
  local = cache.k.shape[1]
  n = cache.appended + jnp.arange(tq)
  mine = n % devices == index
  slots = jnp.where(mine, cache.prefilled + n // devices, local)  # `local`: dropped
  pos = cache.lengths[:, None] + jnp.arange(tq)[None]  # [B, Tq]
  put = lambda x, new: x.at[:, slots].set(new.astype(x.dtype), mode="drop")
  return cache._replace(
    k=put(cache.k, k),
    v=put(cache.v, v),
    positions=put(cache.positions, pos.astype(jnp.int32)),
    segment_ids=put(cache.segment_ids, segment_ids.astype(jnp.int32)),
  )


def _decode_mask(q_pos, q_seg, k_pos, k_seg, window):
  """bool [B, Tq, bk]: which new query sees which cached key (causal, window, segments)."""
  qp, kp = q_pos[:, :, None], k_pos[:, None, :]
  mask = (kp >= 0) & (kp <= qp)
  if window is not None:
    left, right = window
    mask = mask & (kp >= qp - left) & (kp <= qp + right)
  return mask & (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0)


def _pattern_mask(q_pos, k_pos, num_heads: int, kv_heads: int, pattern):
  """bool [B, K, G, Tq, bk]: LongNet's (segment length w, rate r) pattern on global
  positions, per query head n = k * G + g: both positions in one segment of w, and both
  offsets from the segment's start equal to n modulo r (`dilated_pattern_mask`)."""
  w, r = pattern
  heads = (jnp.arange(num_heads) % r).reshape(kv_heads, -1)[None, :, :, None]  # [1, K, G, 1]
  q_keep = ((q_pos % w) % r)[:, None, None, :] == heads  # [B, K, G, Tq]
  k_keep = ((k_pos % w) % r)[:, None, None, :] == heads  # [B, K, G, bk]
  same = (q_pos // w)[:, :, None] == (k_pos // w)[:, None, :]  # [B, Tq, bk]
  return q_keep[..., None] & k_keep[..., None, :] & same[:, None, None]


def local_partial(
  q,
  cache: KVCache,
  q_pos,
  q_seg,
  fill,
  *,
  window,
  scale: float,
  policy: Policy,
  tile: int,
  pattern=None,
  mods: ScoreMods = NO_MODS,
  args: ScoreArgs | None = None,
):
  """This device's (output, lse) of queries q [B, Tq, N, H] at positions q_pos [B, Tq]
  against its cache shard, visiting only the tiles below `fill` (skipping those every
  mask rules out): output [B, Tq, N, H] and lse [B, Tq, N] in the accumulation dtype.
  pattern: a LongNet (segment length, rate) on top of the causal mask (`_pattern_mask`).
  mods, args: score modifiers (`jax_ring._mods`) on these heads, as in the ring."""
  b, tq, n, h = q.shape
  kh = cache.k.shape[2]
  acc = policy.accum_dtype
  qs = (q.astype(acc) * jnp.asarray(scale, acc)).astype(policy.compute_dtype)
  qs = qs.reshape(b, tq, kh, n // kh, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, Tq, H]
  o = zeros_varying_like(qs.shape, acc, qs, cache.k)  # varies over the mesh axes the loop does
  m = jnp.full_like(o, -jnp.inf, shape=qs.shape[:-1])
  l = jnp.zeros_like(m)

  def visit(t, state):
    start = t * tile
    take = lambda x: lax.dynamic_slice_in_dim(x, start, tile, axis=1)
    k = take(cache.k).astype(policy.compute_dtype).transpose(0, 2, 1, 3)  # [B, K, bk, H]
    v = take(cache.v).astype(policy.compute_dtype).transpose(0, 2, 1, 3)
    k_pos = take(cache.positions)
    mask = _decode_mask(q_pos, q_seg, k_pos, take(cache.segment_ids), window)
    if pattern is not None:
      mask = mask[:, None, None] & _pattern_mask(q_pos, k_pos, n, kh, pattern)
    scores = Tile(mods, q_pos, k_pos, args) if mods.active else None
    compute = lambda st: block_update(qs, k, v, mask, policy, *st, scores)
    return lax.cond(jnp.any(mask), compute, lambda st: st, state)

  tiles = (fill + tile - 1) // tile
  o, m, l = lax.fori_loop(0, tiles, visit, (o, m, l))
  o, lse = finalize(o, m, l)
  return o.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, h), lse.transpose(0, 3, 1, 2).reshape(b, tq, n)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The static part of one decode_attention call. patterns: LongNet's (segment
  length, rate) pairs for dilated decoding (None: plain causal attention)."""

  axis_name: Any
  window: tuple[int, int] | None
  scale: float
  policy: Policy
  tile: int | None
  patterns: tuple[tuple[int, int], ...] | None = None
  mods: ScoreMods = NO_MODS  # soft-cap, ALiBi, score_mod (decoding has no dropout)


def _decode_shard(
  cfg: DecodeConfig, query, cache: KVCache, segment_ids, modifiers=(None, None), offsets=(0, 0)
):
  """Per device: (merged output in the policy's output dtype, lse [B, Tq, N] float).
  modifiers: (sinks [N], ALiBi slopes [B, N]) of this device's heads and rows, or
  Nones; offsets: the global index of its first batch row and query head."""
  devices = lax.axis_size(cfg.axis_name)
  index = lax.axis_index(cfg.axis_name)
  tq = query.shape[1]
  q_pos = cache.lengths[:, None] - tq + jnp.arange(tq)[None]
  fill = device_fill(cache.prefilled, cache.appended, index, devices)
  tile = cache_tile(cache.k.shape[1], cfg.tile)
  sinks, slopes = modifiers
  args = None
  if cfg.mods.active:
    args = ScoreArgs(slopes, None, jnp.asarray(offsets[1], jnp.int32), jnp.asarray(offsets[0], jnp.int32))
  partial = functools.partial(
    local_partial,
    query,
    cache,
    q_pos,
    segment_ids,
    fill,
    scale=cfg.scale,
    policy=cfg.policy,
    tile=tile,
    mods=cfg.mods,
    args=args,
  )
  if cfg.patterns is None:
    o, lse = partial(window=cfg.window)
  else:  # every pattern on this shard, merged here; one merge over the devices for all
    o, lse = merge_local(*zip(*(partial(window=None, pattern=p) for p in cfg.patterns)))
  out, lse = expose_floored(*merge_partials(o, lse, cfg.axis_name))
  if sinks is not None:
    out, lse = with_sinks(out, lse, sinks)
  return out.astype(cfg.policy.out_dtype(query.dtype)), lse


def _check_new(query, name: str, b: int, h: int | None = None):
  if not hasattr(query, "shape") or not hasattr(query, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(query).__name__}")
  if query.ndim != 4:
    raise ValueError(
      f"{name}.shape={tuple(query.shape)} must have rank 4: [batch, new tokens, heads, head_dim]"
    )
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise TypeError(f"{name}.dtype={query.dtype} must be a floating dtype")
  if query.shape[0] != b:
    raise ValueError(f"{name} batch={query.shape[0]} must equal the cache's batch={b}")
  if h is not None and query.shape[3] != h:
    raise ValueError(f"{name} head_dim={query.shape[3]} must equal the cache's head_dim={h}")


def _check_decode_patterns(segment_lengths, dilation_rates, window, head_axis):
  """((w, r), ...) of dilated decoding, or None for plain causal attention."""
  if segment_lengths is None and dilation_rates is None:
    return None
  if segment_lengths is None or dilation_rates is None:
    raise ValueError(
      f"segment_lengths={segment_lengths!r} and dilation_rates={dilation_rates!r}: give both "
      "(dilated decoding) or neither"
    )
  lengths, rates = check_patterns(segment_lengths, dilation_rates)
  if window is not None:
    raise ValueError(f"local_window_size={window!r} cannot be combined with dilated patterns")
  if head_axis is not None:
    raise ValueError(f"head_axis={head_axis!r}: dilated decoding keeps every head on each device")
  return tuple(zip(lengths, rates))


def _new_segment_ids(segment_ids, b: int, tq: int):
  if segment_ids is None:
    return jnp.zeros((b, tq), jnp.int32)
  _validation.check_segment_ids(segment_ids, b, tq)
  return jnp.asarray(segment_ids, jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "axes", "return_residual"))
def _decode_global(
  query, cache, segment_ids, modifiers, *, cfg: DecodeConfig, axes: CacheAxes, return_residual: bool
):
  mesh = axes.mesh
  qspec = axes.query_spec()
  specs = axes.specs()
  seg_spec = P(axes.batch_axis, None)
  lse_spec = P(axes.batch_axis, None, axes.head_axis)

  mod_specs = (P(axes.head_axis), P(axes.batch_axis, axes.head_axis))

  def impl(query, cache, segment_ids, modifiers, *, in_context):
    c = lambda x, sp: constrain(x, sp, mesh, in_context)
    cache = KVCache(*(c(x, sp) for x, sp in zip(cache, specs)))
    modifiers = tuple(None if x is None else c(x, sp) for x, sp in zip(modifiers, mod_specs))

    def body(query, cache, segment_ids, modifiers):
      offsets = (first_index(axes.batch_axis, query.shape[0]), first_index(axes.head_axis, query.shape[2]))
      return _decode_shard(cfg, query, cache, segment_ids, modifiers, offsets)

    sharded = jax.shard_map(
      body,
      mesh=None if in_context else mesh,
      in_specs=(
        qspec,
        specs,
        seg_spec,
        tuple(None if x is None else sp for x, sp in zip(modifiers, mod_specs)),
      ),
      out_specs=(qspec, lse_spec),
    )
    return sharded(c(query, qspec), cache, c(segment_ids, seg_spec), modifiers)

  out_specs = (qspec, lse_spec)
  out, lse = call_on_mesh(impl, mesh, out_specs, query, cache, segment_ids, modifiers)
  return (out, lse.astype(jnp.float32)) if return_residual else out


def decode_attention(
  query,
  cache: KVCache,
  *,
  mesh,
  seq_axis="seq",
  batch_axis=None,
  head_axis=None,
  segment_ids=None,
  local_window_size=None,
  scale: float | None = None,
  policy: Policy | str | None = None,
  block_kv: int | None = None,
  segment_lengths=None,
  dilation_rates=None,
  return_residual: bool = False,
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  score_mod=None,
):
  """Attention of Tq new tokens against a sequence-sharded `KVCache` that already holds
  them (`update_cache` first): exact, with no K/V moving between devices.

  Legend: B batch, Tq new tokens, S cache capacity, N query heads, K kv heads
  (N % K == 0), H head dim.

  Args:
    query: [B, Tq, N, H], the queries of the last Tq tokens of each row, at global
      positions lengths[b] - Tq ... lengths[b] - 1 (causal among them).
    cache: a `KVCache` sharded over `seq_axis` (and `batch_axis`, `head_axis`).
    mesh, seq_axis, batch_axis, head_axis: the mesh and axes of the cache.
    segment_ids: int [B, Tq]; a query sees cached keys of its own id (default 0, the
      cache's default); negative: sees nothing.
    local_window_size: int w or (left, right), on global positions.
    scale: logit scale, default 1/sqrt(H).
    policy: a `Policy` or preset name; None means `policy_for` the mesh's first device.
    block_kv: cache tile per loop step (default: up to 1024 dividing the shard).
    segment_lengths, dilation_rates: LongNet patterns: decode causal dilated attention
      (`jax_ring.dilated_attention(..., is_causal=True)`, patterns on global positions)
      instead of full causal attention; no window, no head_axis.
    return_residual: also return the log-sum-exp [B, Tq, N] (float32), as
      `jax.nn.dot_product_attention` does.
    logit_soft_cap, sinks, alibi_slopes, score_mod: the score modifiers, as in
      `ring_attention` (positions are the tokens' global ones), so a model trained
      with them decodes with them; not with dilated patterns.

  Each device attends to its shard's filled tiles only, then the partial results are
  merged by two all-reduces, a max and a sum (see the module docstring). Rows that see no key get 0.
  For inference: it has no gradient (the tile loop is a while loop).

  Returns:
    [B, Tq, N, H] in the policy's output dtype (and the lse if `return_residual`).
  """
  axes = _check_axes(mesh, seq_axis, batch_axis, head_axis, query, getattr(cache, "k", None))
  return_residual = _validation.check_bool(return_residual, "return_residual")
  b, _, _, h = check_cache(cache, axes)
  _check_new(query, "query", b, h)
  check_cache(cache, axes, num_heads=query.shape[2], head_dim=query.shape[3])
  segment_ids = _new_segment_ids(segment_ids, b, query.shape[1])
  window = _validation.normalize_window(local_window_size)
  scale = _validation.check_scale(scale, h)
  if block_kv is not None and (isinstance(block_kv, bool) or not isinstance(block_kv, int) or block_kv < 1):
    raise ValueError(f"block_kv={block_kv!r} must be a positive int or None")
  patterns = _check_decode_patterns(segment_lengths, dilation_rates, window, head_axis)
  mods, sinks, slopes = _decode_mods(
    logit_soft_cap, sinks, alibi_slopes, score_mod, b, query.shape[2], patterns
  )
  policy = get_policy(policy, mesh.devices.flat[0])
  cfg = DecodeConfig(seq_axis, window, scale, policy, block_kv, patterns, mods)
  with jax.named_scope("jax_ring.decode_attention"):
    query, segment_ids = _place(axes, query=query, segment_ids=segment_ids)
    return _decode_global(
      query, cache, segment_ids, (sinks, slopes), cfg=cfg, axes=axes, return_residual=return_residual
    )


def _decode_mods(logit_soft_cap, sinks, alibi_slopes, score_mod, batch: int, heads: int, patterns):
  """(ScoreMods, sinks, slopes) of a decoding call: the ring's modifiers less dropout."""
  mods, sinks, slopes, _ = _validation.check_score_mods(
    logit_soft_cap, sinks, alibi_slopes, 0.0, None, score_mod, batch=batch, heads=heads
  )
  if patterns is not None and (mods.active or sinks is not None):
    raise ValueError(
      "score modifiers (logit_soft_cap, sinks, alibi_slopes, score_mod) and dilated patterns "
      "(segment_lengths, dilation_rates): one or the other"
    )
  return mods, sinks, slopes


def decode_attention_shard(
  query,
  cache: KVCache,
  *,
  axis_name,
  segment_ids=None,
  local_window_size=None,
  scale: float | None = None,
  policy: Policy | str | None = None,
  block_kv: int | None = None,
  segment_lengths=None,
  dilation_rates=None,
  return_residual: bool = False,
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  score_mod=None,
):
  """`decode_attention` for code already inside `jax.shard_map`: query [B, Tq, N, H]
  the same on every device of `axis_name`, `cache` this device's shard (its k, v
  [B, S / p, K, H], positions and segment ids [B, S / p]; lengths and counters as in
  the global cache). Returns the merged output (and lse), the same on every device.
  The score modifiers as in `decode_attention`, for this device's heads and rows
  (score_mod's `head` indexes them)."""
  if not isinstance(cache, KVCache):
    raise TypeError(f"cache must be a jax_ring.KVCache shard, got {type(cache).__name__}")
  _validation.check_bound_axis(axis_name, "axis_name", "decode_attention_shard")
  return_residual = _validation.check_bool(return_residual, "return_residual")
  b, _, _, h = cache.k.shape
  _check_new(query, "query", b, h)
  if query.shape[2] % cache.k.shape[2]:
    raise ValueError(
      f"num_heads={query.shape[2]} must be a multiple of the cache's num_kv_heads={cache.k.shape[2]}"
    )
  segment_ids = _new_segment_ids(segment_ids, b, query.shape[1])
  window = _validation.normalize_window(local_window_size)
  patterns = _check_decode_patterns(segment_lengths, dilation_rates, window, None)
  mods, sinks, slopes = _decode_mods(
    logit_soft_cap, sinks, alibi_slopes, score_mod, b, query.shape[2], patterns
  )
  cfg = DecodeConfig(
    axis_name, window, _validation.check_scale(scale, h), get_policy(policy), block_kv, patterns, mods
  )
  with jax.named_scope("jax_ring.decode_attention_shard"):
    out, lse = _decode_shard(cfg, query, cache, segment_ids, (sinks, slopes))
  return (out, lse.astype(jnp.float32)) if return_residual else out


def _place(axes: CacheAxes, **arrays):
  """The new tokens' arrays on the mesh (see `jax_ring._mesh.place`), in order."""
  qspec, seg_spec = axes.query_spec(), P(axes.batch_axis, None)
  specs = {name: (x, seg_spec if name == "segment_ids" else qspec) for name, x in arrays.items()}
  return tuple(place(axes.mesh, specs).values())


@functools.partial(jax.jit, static_argnames=("axes",))
def _update_global(cache, k, v, segment_ids, *, axes: CacheAxes):
  mesh = axes.mesh
  specs = axes.specs()
  qspec = axes.query_spec()
  seg_spec = P(axes.batch_axis, None)

  def body(cache, k, v, segment_ids):
    devices = lax.axis_size(axes.seq_axis)
    return append_shard(cache, k, v, segment_ids, lax.axis_index(axes.seq_axis), devices)

  def impl(cache, k, v, segment_ids, *, in_context):
    c = lambda x, sp: constrain(x, sp, mesh, in_context)
    cache = KVCache(*(c(x, sp) for x, sp in zip(cache, specs)))
    sharded = jax.shard_map(
      body, mesh=None if in_context else mesh, in_specs=(specs, qspec, qspec, seg_spec), out_specs=specs
    )
    return sharded(cache, c(k, qspec), c(v, qspec), c(segment_ids, seg_spec))

  new = call_on_mesh(impl, mesh, specs, cache, k, v, segment_ids)
  tq = k.shape[1]
  return new._replace(lengths=cache.lengths + tq, appended=cache.appended + tq)


def update_cache(
  cache: KVCache, key, value, *, mesh, seq_axis="seq", batch_axis=None, head_axis=None, segment_ids=None
) -> KVCache:
  """Appends Tq new tokens per row: key, value [B, Tq, K, H] at global positions
  lengths[b] ... lengths[b] + Tq - 1, each token on the next device in turn
  (round-robin), so every device's fill differs by at most one.

  segment_ids: int [B, Tq] of the new tokens (default 0).
  Raises ValueError when a device's shard has no room left (checked when the cache's
  counters are concrete).
  """
  axes = _check_axes(mesh, seq_axis, batch_axis, head_axis, key, getattr(cache, "k", None))
  b, _, k, h = check_cache(cache, axes)
  for name, x in (("key", key), ("value", value)):
    _check_new(x, name, b, h)
    if x.shape[2] != k:
      raise ValueError(f"{name} kv heads={x.shape[2]} must equal the cache's num_kv_heads={k}")
  if key.shape != value.shape:
    raise ValueError(f"key.shape={tuple(key.shape)} must equal value.shape={tuple(value.shape)}")
  if jnp.dtype(key.dtype) != jnp.dtype(cache.k.dtype):
    raise TypeError(f"key.dtype={key.dtype} must equal the cache's dtype={cache.k.dtype}")
  check_room(cache, axes.devices, key.shape[1])
  segment_ids = _new_segment_ids(segment_ids, b, key.shape[1])
  with jax.named_scope("jax_ring.update_cache"):
    key, value, segment_ids = _place(axes, key=key, value=value, segment_ids=segment_ids)
    return _update_global(cache, key, value, segment_ids, axes=axes)


@functools.partial(jax.jit, static_argnames=("gc",))
def _prefill_global(query, key, value, segment_ids, cache, modifiers, *, gc: GlobalConfig):
  t = query.shape[1]
  kv, rows = P(gc.batch_axis, gc.seq_axis, gc.head_axis, None), P(gc.batch_axis, gc.seq_axis)
  out_specs = (output_spec(gc.mesh, gc.seq_axis, gc.batch_axis, gc.head_axis, t), (kv, kv, rows, rows))
  impl = functools.partial(global_impl, gc=gc)
  return call_on_mesh(
    impl, gc.mesh, out_specs, query, key, value, segment_ids, segment_ids, None, None, cache, modifiers
  )


def prompt_rows(lengths, segment_ids, b: int, t: int):
  """(lengths int32 [B], segment ids or None) of a prompt of T tokens per row whose row
  b is its first lengths[b] tokens (None: all T): the rest gets segment id -1 (padding,
  which sees nothing and is seen by no one). ValueError for lengths of the wrong shape
  or dtype, or (when concrete) outside [0, T]."""
  if lengths is None:
    return jnp.full((b,), t, jnp.int32), segment_ids
  if (
    not hasattr(lengths, "shape")
    or tuple(lengths.shape) != (b,)
    or not jnp.issubdtype(lengths.dtype, jnp.integer)
  ):
    raise ValueError(f"lengths must be an int array of shape (batch,)=({b},), got {lengths!r}")
  concrete = None if isinstance(lengths, jax.core.Tracer) else np.asarray(lengths)
  if concrete is not None and ((concrete < 0) | (concrete > t)).any():
    raise ValueError(f"lengths={concrete.tolist()} must lie in [0, prompt length {t}]")
  lengths = jnp.asarray(lengths, jnp.int32)
  valid = jnp.arange(t)[None] < lengths[:, None]
  base = jnp.zeros((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return lengths, jnp.where(valid, base, -1)


def prefill_attention(
  query,
  key,
  value,
  cache: KVCache,
  *,
  mesh,
  seq_axis="seq",
  batch_axis=None,
  head_axis=None,
  lengths=None,
  segment_ids=None,
  local_window_size=None,
  scale: float | None = None,
  layout: str = "auto",
  policy: Policy | str | None = None,
  block_sizes: BlockSizes | None = None,
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  score_mod=None,
):
  """Causal ring attention over a prompt that also writes its keys and values into
  `cache`, where the ring's layout put them (no relayout): (output, cache).

  Legend: B batch, T prompt length, N query heads, K kv heads, H head dim.

  Args:
    query: [B, T, N, H]; key, value: [B, T, K, H], in natural order (positions 0..T-1).
    cache: a `KVCache` from `init_cache` with room for the prompt; it is written from
      scratch (whatever it held is dropped).
    lengths: int [B] in [0, T], the prompt length of each row (default T): row b's
      prompt is its first lengths[b] tokens; the rest is padding, which sees nothing,
      is seen by no one, and is not cached. Generation continues at lengths[b].
    segment_ids: int [B, T] as in `ring_attention` (negative: padding, not cached).
    mesh, seq_axis, batch_axis, head_axis: as in `ring_attention`.
    local_window_size, scale, layout, policy, block_sizes: as in `ring_attention`
      (the mask is causal).
    logit_soft_cap, sinks, alibi_slopes, score_mod: as in `ring_attention`.

  Returns:
    ([B, T, N, H] output, the filled cache).
  """
  axes = _check_axes(mesh, seq_axis, batch_axis, head_axis, query, key, value, getattr(cache, "k", None))
  mesh = axes.mesh
  (b, t, _, n, k), _, window, scale, block_sizes = check_arguments(
    query, key, value, segment_ids, local_window_size, scale, block_sizes, same_length=True
  )
  cb, cs, ck, ch = check_cache(cache, axes, num_heads=n, head_dim=query.shape[3])
  if (cb, ck) != (b, k):
    raise ValueError(
      f"cache batch={cb}, num_kv_heads={ck} must equal the prompt's batch={b}, num_kv_heads={k}"
    )
  if jnp.dtype(key.dtype) != jnp.dtype(cache.k.dtype):
    raise TypeError(f"key.dtype={key.dtype} must equal the cache's dtype={cache.k.dtype}")
  layout = layouts.resolve(layout, True)
  local = layouts.padded_length(layout, t, axes.devices) // axes.devices
  if local > cs // axes.devices:
    raise ValueError(
      f"a prompt of {t} tokens takes {local} slots per device in the {layout} layout, but the cache holds "
      f"{cs // axes.devices} per device (capacity {cs}); make it with a larger max_length"
    )
  lengths, segment_ids = prompt_rows(lengths, segment_ids, b, t)
  mods, sinks, slopes = _decode_mods(logit_soft_cap, sinks, alibi_slopes, score_mod, b, n, None)
  policy = get_policy(policy, mesh.devices.flat[0])
  gc = GlobalConfig(
    mesh, seq_axis, batch_axis, head_axis, True, window, scale, layout, policy, block_sizes, mods=mods
  )
  with jax.named_scope("jax_ring.prefill_attention"):
    placed = place_on_mesh(mesh, seq_axis, batch_axis, head_axis, query, key, value, segment_ids)
    lengths = place(mesh, {"lengths": (lengths, P(batch_axis))})["lengths"]
    fields = (cache.k, cache.v, cache.positions, cache.segment_ids)
    out, (ck, cv, cpos, cseg) = _prefill_global(*placed, fields, (sinks, slopes, None), gc=gc)
  zero = jnp.zeros((), jnp.int32)
  return out, KVCache(ck, cv, cpos, cseg, lengths, zero + local, zero)
