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
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ring import _choice, _documents, _mosaic, _pallas, _ulysses, _validation, layouts
from jax_ring._kernel import MaskSpec
from jax_ring._mesh import (
  call_on_mesh,
  constrain,
  output_spec,
  pad_seq,
  place_attention_inputs,
  traced_device,
  usable_mesh,
)
from jax_ring._mods import NO_MODS, ScoreArgs, ScoreMods, first_index, with_sinks
from jax_ring._policy import Policy, get_policy
from jax_ring._ring import RingConfig, cudnn_problem, ring, schedule
from jax_ring._tiles import (
  BlockSizes,
  check_block_sizes,
  fit_tile_budget,
  local_blocks,
  mesh_platform,
  quadrant_tiles,
)


def check_arguments(
  query, key, value, segment_ids, local_window_size, scale, block_sizes, *, same_length=False, unbatched=False
):
  """The checks every ring entry point shares, on rank-4 inputs.

  Returns ((B, T, S, N, K), (query ids, kv ids), window, scale, block_sizes); the ids
  are [B, T] and [B, S] or both None (see `_validation.split_segment_ids`)."""
  b, t, s, n, k, h = _validation.check_qkv(query, key, value, same_length=same_length)
  seg = _validation.split_segment_ids(segment_ids, b, t, s, unbatched)
  window = _validation.normalize_window(local_window_size)
  scale = _validation.check_scale(scale, h)
  return (b, t, s, n, k), seg, window, scale, check_block_sizes(block_sizes)


def _check_positions(positions, length: int, name: str):
  if tuple(positions.shape) != (length,) or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(f"{name} shape={tuple(positions.shape)} dtype={positions.dtype} must be int [{length}]")
  return positions.astype(jnp.int32)


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
  kv_positions=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  return_residual: bool = False,
  ulysses_axis=None,
  kernel: str = "auto",
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  score_mod=None,
  dropout_broadcast: bool = False,
  document_bound: int | str | None = None,
  _valid_lengths: tuple[int, int] | None = None,
  _offsets: tuple | None = None,
  _seed=None,
):
  """Ring attention for code already inside `jax.shard_map`: shards in, shard out.

  Legend: B batch, T and S local (per-device) query and key lengths, N query heads,
  K kv heads, H head dim.

  Args:
    query: [B, T, N, H], this device's shard of the queries ([T, N, H] without batch).
    key, value: [B, S, K, H], this device's shard of keys and values (N % K == 0).
    axis_name: the mesh axis the sequence is sharded over (the ring).
    is_causal, local_window_size, scale: as in `ring_attention`, on global positions.
    segment_ids: int [B, T] (when S == T), or a pair (query ids [B, T], kv ids
      [B, S]): this device's shards; negative ids are padding.
    layout: how global positions map to devices: "contiguous" (device i holds tokens
      [i * T, (i + 1) * T)), "striped" or "zigzag"; the tokens must already be in that
      layout (`jax_ring.layouts.to_layout` puts a global array in one). "auto" is
      refused: the shards' layout is the caller's to say.
    policy: a `Policy` or preset name; None means `policy_for` the mesh's devices.
    block_sizes: `BlockSizes` for the tiles inside a device.
    positions: int [T] global positions of this shard's queries; overrides `layout`.
    kv_positions: int [S] global positions of this shard's keys; default `positions`
      (required with `positions` when S != T) or the layout's.
    query_seq_lengths, key_value_seq_lengths: int [B], as in `ring_attention`: a
      query (key) at global position >= its row's length is padding.
    return_residual: also return the log-sum-exp, as in `ring_attention`.
    ulysses_axis: a second mesh axis (size u) that also splits the sequence: the u
      devices at one ring position hold consecutive pieces, in `ulysses_axis` order, of
      that position's ring shard (which is in `layout`); every argument above is this
      device's piece. An all-to-all over it trades the pieces for heads around the ring
      (N must divide by u), and the output comes back as this device's piece.
    kernel: the block kernel, as in `ring_attention`. It, the tiles, the heads per
      pass and the default policy follow the devices of the mesh the surrounding
      `shard_map` runs on (so a program compiled on a CPU host for GPUs or TPUs gets
      their defaults).
    logit_soft_cap, sinks, alibi_slopes, dropout_rate, dropout_rng, score_mod: the
      score modifiers, as in `ring_attention`, for this device's heads: `sinks` [N]
      and `alibi_slopes` [N] or [B, N] are this shard's heads' (and rows'), and
      score_mod's `head` and dropout's batch row and head are indices into this
      shard's heads and rows (positions are global, as everywhere here).
    document_bound: as in `ring_attention`, on the layout's positions (with
      `positions`, or S != T, every pass runs and the bound is not used).

  Returns:
    [B, T, N, H] output shard in the policy's output dtype; with `return_residual`,
    (output, lse [B, T, N] in the accumulation dtype; with `sinks`, the log of the
    softmax's whole denominator, sink included).
  """
  query, key, value, unbatched = _validation.add_batch_axis(query, key, value)
  (_, t, s, n, k), (q_seg, kv_seg), window, scale, block_sizes = check_arguments(
    query, key, value, segment_ids, local_window_size, scale, block_sizes, unbatched=unbatched
  )
  is_causal = _validation.check_bool(is_causal, "is_causal")
  document_bound = _validation.check_document_bound(document_bound, segment_ids, t, s)
  return_residual = _validation.check_bool(return_residual, "return_residual")
  _validation.check_bound_axis(axis_name, "axis_name", "ring_attention_shard")
  if ulysses_axis is not None:
    _validation.check_bound_axis(ulysses_axis, "ulysses_axis", "ring_attention_shard")
  if layout == "auto":
    raise ValueError(
      "ring_attention_shard(layout='auto'): shards come in already laid out, and only the caller knows "
      f"how; pass the layout they are in, one of {layouts.LAYOUTS} ('contiguous': device i holds "
      "tokens [i * T, (i + 1) * T)), or their `positions`. jax_ring.layouts.to_layout(x, layout, "
      "num_devices) puts a global array in a layout before it is sharded."
    )
  q_pos = None if positions is None else _check_positions(positions, t, "positions")
  k_pos = None if kv_positions is None else _check_positions(kv_positions, s, "kv_positions")
  if q_pos is not None and k_pos is None and s != t:
    raise ValueError(f"kv_positions is required with positions when key length S={s} != T={t}")
  group = 1
  if ulysses_axis is not None:
    group = lax.axis_size(ulysses_axis)
    _ulysses.check_heads(n, group, ulysses_axis)
  rate = dropout_rate if _seed is None else 0.0
  mods, sinks, slopes, seed = _validation.check_score_mods(
    logit_soft_cap, sinks, alibi_slopes, rate, dropout_rng, score_mod, batch=query.shape[0], heads=n
  )
  if _seed is not None:
    mods, seed = dataclasses.replace(mods, dropout=float(dropout_rate)), _seed
  if mods.dropout > 0:
    mods = dataclasses.replace(
      mods, dropout_broadcast=_validation.check_bool(dropout_broadcast, "dropout_broadcast")
    )
  batch0, head0 = (0, 0) if _offsets is None else _offsets
  if group > 1:  # this device keeps heads [i * N / u, (i + 1) * N / u) of the N it has
    width = n // group
    first = lax.axis_index(ulysses_axis) * width
    part = lambda x, axis: None if x is None else lax.dynamic_slice_in_dim(x, first, width, axis)
    slopes, sinks, head0 = part(slopes, 1), part(sinks, 0), head0 + first
  args = None
  if mods.active:
    args = ScoreArgs(slopes, seed, jnp.asarray(head0, jnp.int32), jnp.asarray(batch0, jnp.int32))
  device = traced_device()
  policy = get_policy(policy, device)
  kind = getattr(device, "device_kind", None)
  choice = _choice.choose_kernel(kernel, mesh_platform(), query.shape[-1], policy, device_kind=kind)
  if choice.interpret:
    _pallas.check_vma_off(query, "ring_attention_shard")
  with jax.named_scope("jax_ring.ring_attention_shard"):
    if group > 1:
      (query, key, value), (q_seg, kv_seg), (q_pos, k_pos) = _ulysses.enter(
        query, key, value, (q_seg, kv_seg), (q_pos, k_pos), ulysses_axis, group
      )
    out, lse = _ring_shard(
      query,
      key,
      value,
      q_seg,
      kv_seg,
      q_pos,
      k_pos,
      query_seq_lengths,
      key_value_seq_lengths,
      axis_name=axis_name,
      is_causal=is_causal,
      window=window,
      scale=scale,
      layout=layouts.resolve(layout, is_causal),
      policy=policy,
      block_sizes=block_sizes,
      kernel=choice,
      unbatched=unbatched,
      valid_lengths=_valid_lengths,
      mods=mods,
      args=args,
      lse_out=return_residual or sinks is not None,
      bound=document_bound,
    )
    if sinks is not None:
      out, lse = with_sinks(out, lse, sinks)
    if group > 1:
      out, lse = _ulysses.to_sequence(out, ulysses_axis), _ulysses.to_sequence(lse, ulysses_axis)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _ring_shard(
  query,
  key,
  value,
  q_seg,
  kv_seg,
  q_pos,
  k_pos,
  q_len,
  kv_len,
  *,
  axis_name,
  is_causal,
  window,
  scale,
  layout,
  policy,
  block_sizes,
  unbatched,
  valid_lengths,
  kernel: _choice.KernelChoice,
  mods: ScoreMods = NO_MODS,
  args: ScoreArgs | None = None,
  lse_out: bool = False,
  bound: int | None = None,
):
  """The ring on checked rank-4 shards: positions (None: the layout's) to masks, the
  tiles padded, and (output, lse) of the T local queries. `bound`: `document_bound`,
  used where the positions are the layout's and S == T."""
  b, t, s = query.shape[0], query.shape[1], key.shape[1]
  ring_size = lax.axis_size(axis_name)
  q_len = _validation.check_seq_lengths(q_len, "query_seq_lengths", b, t * ring_size, unbatched)
  kv_len = _validation.check_seq_lengths(kv_len, "key_value_seq_lengths", b, s * ring_size, unbatched)
  index = lax.axis_index(axis_name)
  custom = q_pos is not None or k_pos is not None
  if q_pos is None:
    q_pos = layouts.shard_positions(layout, index, t, ring_size)
  if k_pos is None:
    k_pos = q_pos if s == t else layouts.shard_positions(layout, index, s, ring_size)
  has_padding = valid_lengths is not None or custom
  if valid_lengths is not None:
    q_pos = jnp.where(q_pos < valid_lengths[0], q_pos, -1)
    k_pos = jnp.where(k_pos < valid_lengths[1], k_pos, -1)
  q_seg, kv_seg = _validation.apply_lengths(q_seg, kv_seg, q_len, kv_len, q_pos, k_pos)
  back, fwd = schedule(layout, window, is_causal, t, ring_size, custom or s != t)
  runtime = []  # "auto": the schedules the ids pick from while running
  if bound == "auto":
    bound = None
    if not custom and s == t and is_causal and window is None and q_seg is not None:
      runtime = _documents.runtime_schedules(layout, t, ring_size)
  reach = None if custom or s != t else _documents.reach(bound, window, is_causal)
  if reach is not None and _documents.schedule(layout, *reach, t, ring_size) == (back, fwd):
    # The bound skips no pass (the longest document may span the whole ring): the call
    # is the unbounded one, exact for any ids, without the check below. With the check's
    # gather and sort in it, Llama's FSDP step (remat "attention", XLA:CPU's
    # memory-minimizing schedule) failed in XLA:CPU's rendezvous of a ring permute.
    reach = None
  if reach is not None:
    back, fwd = _documents.schedule(layout, *reach, t, ring_size)
  # Rows whose documents break the bound: their output is NaN, not a wrong number.
  beyond = None if reach is None else _documents.rows_beyond(q_seg, q_pos, axis_name, bound)
  pick = None
  if runtime:
    pick = _documents.runtime_pick(q_seg, q_pos, axis_name, [r for r, _ in runtime[:-1]])
  use = kernel.kernel
  auto = kernel.auto
  if use == "cudnn":
    why = cudnn_problem(
      is_causal=is_causal,
      window=window,
      has_padding=has_padding,
      segments=q_seg is not None or kv_seg is not None,
      layout=layout,
      custom=custom,
      t=t,
      s=s,
      mods=mods,
      lse_out=lse_out,
      ring_size=ring_size,
    )
    if why is not None:
      use, auto = _from_cudnn(kernel, why, query.shape[3], policy), True
  use_pallas = use == "pallas"
  why = mods.pallas_problem()
  if use_pallas and why is not None:
    if not auto:
      raise ValueError(f"kernel='pallas': {why}; use kernel='auto' or 'xla'")
    _choice.log_fallback(why)
    use_pallas = False
  if use == "cudnn":  # one block of the whole shard: cuDNN tiles it itself
    padded_t, padded_s, bq, bk = t, s, t, s
  elif use_pallas:
    bq = block_sizes.block_q or _pallas.block_for(t)
    bk = block_sizes.block_kv or _pallas.block_for(s)
    padded_t, padded_s = -(-t // bq) * bq, -(-s // bk) * bk
    problem = _pallas.blocks_problem(padded_t, padded_s, query.shape[3], bq, bk)
    if problem is None and mesh_platform() == "tpu":
      problem = _mosaic.blocks_problem(padded_t, padded_s, bq, bk)
    if problem is not None and not auto:
      raise ValueError(f"kernel='pallas': {problem}")
    if problem is not None:
      _choice.log_fallback(problem)
      use_pallas = False
  if use != "cudnn" and not use_pallas:
    tile_layout = None if custom else layout
    padded_t, bq, _ = local_blocks(t, block_sizes, layout=tile_layout)
    padded_s, _, bk = local_blocks(s, block_sizes, layout=tile_layout)
  if padded_t != t:
    has_padding = True
    query = pad_seq(query, padded_t - t)
    q_pos = jnp.pad(q_pos, (0, padded_t - t), constant_values=-1)
    q_seg = None if q_seg is None else pad_seq(q_seg, padded_t - t, -1)
  if padded_s != s:
    has_padding = True
    key, value = (pad_seq(x, padded_s - s) for x in (key, value))
    k_pos = jnp.pad(k_pos, (0, padded_s - s), constant_values=-1)
    kv_seg = None if kv_seg is None else pad_seq(kv_seg, padded_s - s, -1)
  kernel_name = "cudnn" if use == "cudnn" else "pallas" if use_pallas else "xla"
  groups = block_sizes.head_groups(key.shape[2], max(padded_t, padded_s), kernel=kernel_name)
  rows = b * query.shape[2] // groups
  quadrants = None
  if kernel_name == "xla" and is_causal and window is None and layout == "zigzag" and t == s:
    plain = not (has_padding or mods.active or q_seg is not None or kv_seg is not None)
    quadrants = quadrant_tiles(t, rows, block_sizes) if plain else None
  if quadrants is not None:
    bq, bk = quadrants
  elif kernel_name == "xla":  # the XLA tiles hold whole score tiles in memory; the kernels' stay on chip
    bq, bk = fit_tile_budget(bq, bk, rows, block_sizes)
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
    head_groups=groups,
    kernel=kernel_name,
    mods=mods,
    quadrants=quadrants is not None,
    schedules=tuple(found for _, found in runtime) or None,
  )
  out, lse = ring(cfg, query, key, value, q_pos, k_pos, q_seg, kv_seg, args, pick)
  out, lse = out[:, :t], lse[:, :t]
  if beyond is not None:
    out = jnp.where(beyond[:, None, None, None], jnp.nan, out)
    lse = jnp.where(beyond[:, None, None], jnp.nan, lse)
  return out, lse


def _from_cudnn(kernel: _choice.KernelChoice, why: str, head_dim: int, policy) -> str:
  """The kernel a call runs where cuDNN cannot take it: the Pallas kernel on a GPU that
  supports it, else the XLA tiles; logged ("auto") or warned (kernel="cudnn")."""
  platform = mesh_platform()
  pallas_why = _pallas.unsupported(platform, head_dim, policy)
  use = "pallas" if pallas_why is None and platform != "cpu" else "xla"
  name = "the Pallas kernel" if use == "pallas" else "the XLA tiles"
  if kernel.asked == "cudnn":
    _choice.warn_fallback(why, name)
  else:
    _choice.log_fallback(why, name)
  return use


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
  return_residual: bool = False
  ulysses_axis: Any = None
  kernel: str = "auto"
  mods: ScoreMods = NO_MODS
  laid_out: bool = False  # token_order="layout": inputs and output already in `layout`
  document_bound: int | str | None = None

  @property
  def seq_spec(self):
    """The sequence's entry in the specs: `seq_axis`, or (seq_axis, ulysses_axis)."""
    return self.seq_axis if self.ulysses_axis is None else (self.seq_axis, self.ulysses_axis)


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


def global_impl(
  query,
  key,
  value,
  q_seg,
  kv_seg,
  q_len=None,
  kv_len=None,
  cache=None,
  modifiers=(None, None, None),
  *,
  gc: GlobalConfig,
  in_context: bool,
):
  """Pads, shards, relayouts, runs the ring, and undoes it all. In a mesh context
  (Explicit axes made Auto by `auto_axes`) specs are bare; otherwise NamedShardings.
  Queries [B, T, ...] and keys [B, S, ...] are padded and laid out each by its own
  length; q_len / kv_len are the per-row valid lengths (or None).

  With `cache` (k, v, positions, segment ids of a sequence-sharded KV cache; needs
  S == T and one segment-id array), each device also writes its K/V shard, as the
  layout placed it, into its cache shard; returns (output, cache). `modifiers`: the
  score modifiers' arrays (sinks [N], ALiBi slopes [B, N], dropout seed [2]) or Nones."""
  mesh = gc.mesh
  p = mesh.shape[gc.seq_axis]
  u = 1 if gc.ulysses_axis is None else mesh.shape[gc.ulysses_axis]
  t, s = query.shape[1], key.shape[1]
  # Every device gets an equal piece, and each ring shard (u pieces) suits the layout.
  m = layouts.multiple(gc.layout, p, u)
  padded_t, padded_s = (-(-n // m) * m for n in (t, s))
  if padded_t != t:
    query = pad_seq(query, padded_t - t)
    q_seg = None if q_seg is None else pad_seq(q_seg, padded_t - t, -1)
  if padded_s != s:
    key, value = (pad_seq(x, padded_s - s) for x in (key, value))
    kv_seg = None if kv_seg is None else pad_seq(kv_seg, padded_s - s, -1)
  spec = P(gc.batch_axis, gc.seq_spec, gc.head_axis, None)
  seg_spec = P(gc.batch_axis, gc.seq_spec)
  row_spec = P(gc.batch_axis)
  cache_specs = (spec, spec, seg_spec, seg_spec)
  c = lambda x, sp: None if x is None else constrain(x, sp, mesh, in_context)
  args = [c(query, spec), c(key, spec), c(value, spec), c(q_seg, seg_spec), c(kv_seg, seg_spec)]
  args += [c(q_len, row_spec), c(kv_len, row_spec)]
  specs = [spec, spec, spec, seg_spec, seg_spec, row_spec, row_spec]
  specs = [None if a is None else sp for a, sp in zip(args, specs)]
  sinks, slopes, seed = modifiers
  mod_specs = (P(gc.head_axis), P(gc.batch_axis, gc.head_axis), P())
  args.append(tuple(None if x is None else c(x, sp) for x, sp in zip(modifiers, mod_specs)))
  specs.append(tuple(None if x is None else sp for x, sp in zip(modifiers, mod_specs)))
  if cache is not None:
    args.append(tuple(c(x, sp) for x, sp in zip(cache, cache_specs)))
    specs.append(cache_specs)
  padded = padded_t != t or padded_s != s

  def body(q, k, v, qs, ks, ql, kl, mod_arrays, cache=None):
    sinks, slopes, seed = mod_arrays
    # This device's first batch row and query head among the call's, for dropout's
    # keep decisions and score_mod's head (both on global indices).
    batch0, head0 = first_index(gc.batch_axis, q.shape[0]), first_index(gc.head_axis, q.shape[2])
    to = lambda x: None if x is None else layouts.relayout_shard(x, gc.layout, gc.seq_axis, p)
    back = lambda x: layouts.relayout_shard(x, gc.layout, gc.seq_axis, p, inverse=True)
    if gc.laid_out:  # the caller keeps its tokens in the layout: nothing to move
      to = back = lambda x: x
    if u > 1:  # the group's pieces -> its whole contiguous ring shard, N / u heads
      width = q.shape[2] // u
      part = lambda x, axis: None if x is None else lax.dynamic_slice_in_dim(x, head * width, width, axis)
      head = lax.axis_index(gc.ulysses_axis)
      sinks, slopes, head0 = part(sinks, 0), part(slopes, 1), head0 + head * width
      (q, k, v), (qs, ks), _ = _ulysses.enter(q, k, v, (qs, ks), (), gc.ulysses_axis, u)
      back_ring = back
      back = lambda x: _ulysses.to_sequence(back_ring(x), gc.ulysses_axis)
    q, k, v, qs, ks = to(q), to(k), to(v), to(qs), to(ks)
    res = ring_attention_shard(
      q,
      k,
      v,
      axis_name=gc.seq_axis,
      is_causal=gc.is_causal,
      segment_ids=None if qs is None else (qs, ks),
      local_window_size=gc.window,
      scale=gc.scale,
      layout=gc.layout,
      policy=gc.policy,
      block_sizes=gc.block_sizes,
      query_seq_lengths=ql,
      key_value_seq_lengths=kl,
      return_residual=gc.return_residual,
      kernel=gc.kernel,
      logit_soft_cap=gc.mods.soft_cap,
      sinks=sinks,
      alibi_slopes=slopes,
      dropout_rate=gc.mods.dropout,
      score_mod=gc.mods.score_mod,
      dropout_broadcast=gc.mods.dropout_broadcast,
      document_bound=gc.document_bound,
      _valid_lengths=(t, s) if padded else None,
      _offsets=(batch0, head0),
      _seed=seed,
    )
    res = tuple(back(x) for x in res) if gc.return_residual else back(res)
    if cache is None:
      return res
    pos = layouts.shard_positions(gc.layout, lax.axis_index(gc.seq_axis), k.shape[1], p)
    return res, _write_cache(cache, k, v, ks, jnp.where(pos < t, pos, -1))

  out_spec = (spec, P(gc.batch_axis, gc.seq_spec, gc.head_axis)) if gc.return_residual else spec
  out_specs = out_spec if cache is None else (out_spec, cache_specs)
  # Pallas kernels in interpret mode cannot run under check_vma (jax's interpreter
  # meets the kernel's unvarying constants with varying blocks); see `_pallas.check_vma_off`.
  sharded = jax.shard_map(
    body,
    mesh=None if in_context else mesh,
    in_specs=tuple(specs),
    out_specs=out_specs,
    check_vma=gc.kernel != "pallas",
  )
  unpad = lambda res: tuple(x[:, :t] for x in res) if gc.return_residual else res[:, :t]
  if cache is None:
    return unpad(sharded(*args))
  res, cache = sharded(*args)
  return unpad(res), cache


def result_spec(gc: GlobalConfig, length: int):
  """The spec of ring attention's result on global arrays: the output's, and with
  `return_residual` the lse's ([B, T, N]) beside it."""
  spec = output_spec(gc.mesh, gc.seq_spec, gc.batch_axis, gc.head_axis, length)
  return (spec, P(*spec[:3])) if gc.return_residual else spec


@functools.partial(jax.jit, static_argnames=("gc",))
def _ring_attention_global(query, key, value, q_seg, kv_seg, q_len, kv_len, modifiers, *, gc: GlobalConfig):
  impl = functools.partial(global_impl, gc=gc)
  spec = result_spec(gc, query.shape[1])
  return call_on_mesh(impl, gc.mesh, spec, query, key, value, q_seg, kv_seg, q_len, kv_len, None, modifiers)


def _check_token_order(token_order, layout: str, t: int, s: int, p: int, u: int) -> bool:
  """True when the inputs come in the layout's order (`token_order="layout"`); checks
  that their lengths need no padding."""
  if token_order == "natural":
    return False
  if token_order != "layout":
    raise ValueError(f"token_order={token_order!r} must be 'natural' or 'layout'")
  m = layouts.multiple(layout, p, u)
  for name, n in (("query", t), ("key/value", s)):
    if n % m:
      raise ValueError(
        f"token_order='layout': the {name} length {n} must be a multiple of {m} (layout={layout!r} over "
        f"{p} ring devices{f' x {u} Ulysses devices' if u > 1 else ''}); inputs in the layout's order "
        "cannot be padded"
      )
  return True


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
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  return_residual: bool = False,
  ulysses_axis=None,
  kernel: str = "auto",
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  score_mod=None,
  dropout_broadcast: bool = False,
  token_order: str = "natural",
  mask=None,
  bias=None,
  document_bound: int | str | None = None,
):
  """Exact softmax attention with the sequence sharded over `seq_axis` of `mesh`.

  Legend: B batch, T query length, S key/value length, N query heads, K key/value
  heads (N % K == 0, query head n uses kv head n // (N // K)), H head dim.

  Args:
    query: [B, T, N, H] in natural token order, or [T, N, H] (no batch axis, as
      `jax.nn.dot_product_attention` takes it; then key and value are rank 3 too).
    key, value: [B, S, K, H]. S may differ from T (cross-attention): queries and keys
      are both sharded over `seq_axis`, each by its own length, and K/V rotate.
      Masks compare positions 0..T-1 with 0..S-1, so for T != S the causal mask is
      aligned at the top left (query i sees keys j <= i), as in jax.nn.
    mesh: a `jax.sharding.Mesh` with axis `seq_axis` (and optionally batch/head axes).
    seq_axis: mesh axis over which the sequence is sharded; K/V rotate around it.
    batch_axis, head_axis: optional mesh axes for the batch and head dimensions.
    is_causal: query i sees keys j <= i (global positions).
    segment_ids: int [B, T] when S == T, or a pair (query ids [B, T], kv ids [B, S]):
      a query sees a key only with an equal id; negative ids are padding.
    local_window_size: int w or (left, right): query i sees i - left <= j <= i + right.
    scale: logit scale, default 1/sqrt(H).
    layout: "auto" (zigzag when causal, else contiguous), "contiguous", "striped",
      "zigzag": how tokens are placed on devices internally. Input and output stay in
      natural order.
    policy: a `Policy` or a preset name; None means `policy_for` the mesh's first device.
    block_sizes: `BlockSizes`, the tile sizes inside a device.
    query_seq_lengths: int [B] in [0, T], as in jax.nn: queries at positions >=
      query_seq_lengths[b] are padding and get output 0.
    key_value_seq_lengths: int [B] in [0, S]: keys at positions >= it are masked.
    return_residual: also return the log-sum-exp of each query's scaled logits over
      the keys it sees, lse [B, T, N] in the accumulation dtype (float32), -inf where
      it sees none. Unlike jax.nn's residual (under stop_gradient, in the input
      dtype), it is exact and differentiable; `merge_attention` combines (output,
      lse) pairs computed over disjoint sets of keys.
    ulysses_axis: a second mesh axis (size u) for the Ulysses hybrid (USP): the
      sequence is sharded over (seq_axis, ulysses_axis), and inside the call an
      all-to-all over `ulysses_axis` trades sequence pieces for heads, the ring runs
      over `seq_axis` with N / u heads per device, and the inverse all-to-all restores
      the layout. N (per head_axis shard) must divide by u; K/V heads are split, or
      repeated as little as needed when u does not divide K. Put it on the faster
      interconnect (inside a host): see the README's "Ulysses hybrid".
    kernel: the block kernel each ring step runs: "auto" (the XLA tiles on CPU; on
      an NVIDIA GPU cuDNN's fused attention where it takes the call, else the Pallas
      kernel where it supports it, as on a TPU, else the XLA tiles; each reason is
      logged at INFO on the "jax_ring" logger and returned by `jax_ring.choose_kernel`),
      "xla", "pallas" (interpret mode on a CPU mesh; a ValueError where unsupported:
      head_dim not a power of two in [16, 256], a compute dtype other than float32 /
      bfloat16 / float16, `block_sizes` that are not powers of two >= 16), or "cudnn"
      (each ring step one call of cuDNN's fused attention, bfloat16 or float16 inputs,
      statistics and merges in float32; a ValueError off NVIDIA GPUs; on one, what
      cuDNN cannot take falls back to the Pallas kernel with a warning that says why:
      segment ids, windows, padding, score modifiers, a returned lse or sinks, causal
      attention outside the contiguous and zigzag layouts, float32 inputs, head dims
      not a multiple of 8 up to 256). With the Pallas kernel, local lengths are padded
      to its block (a power of two, 16 to 128, unless `block_sizes` gives one).
    logit_soft_cap: float c: scaled logits s become c * tanh(s / c) (Gemma 2: 50.0).
    sinks: float [N]: per query head, the logit of a virtual key of value 0 that joins
      every row's softmax (gpt-oss's attention sinks); differentiable. With
      `return_residual`, lse includes it.
    alibi_slopes: float [N] or [B, N]: ALiBi, s - slope * |i - j| on global positions;
      differentiable.
    dropout_rate, dropout_rng: dropout on the normalized weights, kept ones scaled by
      1 / (1 - rate); whether a weight is kept is a pure function of (dropout_rng,
      batch row, query head, query position, key position), so the result is the same
      on any number of devices and in any layout. A rate > 0 needs a PRNG key.
      `dropout_broadcast`: one decision per (query, key) for all rows and heads
      (Flax's `broadcast_dropout`).
    score_mod: a function (s, q_pos, k_pos, head) -> s', elementwise on the scaled
      logits (after soft-cap and ALiBi, before the masks), q_pos and k_pos global int
      positions and head the query head, all broadcastable to s; differentiated
      through for q and k (differentiating an array it closes over raises JAX's
      CustomVJPException).
      These modifiers run in the XLA tiles: "auto" falls back to them (logged) and
      kernel="pallas" refuses them, sinks excepted (applied after either kernel).
    token_order: "natural" (default): query, key, value, segment_ids and the output
      are in natural token order, and the call moves them into `layout` and back (two
      collective permutes of half a shard for zigzag, each way). "layout": they are
      already in the layout's order, `jax_ring.layouts.to_layout(x, resolved, p)` with
      resolved = `layouts.resolve(layout, is_causal, shard_len=T // p)` and p the size
      of `seq_axis`, and the output comes back in it: nothing moves. A model that runs
      every layer on that order permutes its tokens once (`models.DecoderLM` does).
      T and S must then be multiples of what the layout needs (`layouts.multiple`,
      with the Ulysses axis' size), since padding would break the order; masks and
      modifiers still see global positions.
    document_bound: int n (packed rows): no document, a run of one segment id, is
      longer than n tokens, so no query sees a key n or more positions away, and the
      ring makes only the passes that can bring such keys (in the contiguous and
      zig-zag layouts, about 2 * (n - 1) / (T / p) of the p - 1 when causal;
      `jax_ring._documents`). Needs `segment_ids` and S == T. A row that breaks it
      gets NaN output (that row only), never a wrong number; concrete ids are checked
      before anything runs (a ValueError naming the row). "auto": the bound is read
      from the ids while running (causal, no window, the contiguous or zig-zag
      layout): the call compiles the passes of documents within 1, 2, 4, ... of the
      layout's chunks (a shard contiguous, half a shard zig-zag) and of the whole
      ring, and every device runs the fewest that hold the batch's longest document
      (a gather of the ids picks; ids that fall along a row take the whole ring), so
      one program serves batches whose documents differ, exact for any ids; elsewhere
      every pass runs. None (default): every pass.
    mask, bias: not accepted (a ValueError that names what to use instead): a dense
      [B, N, T, S] matrix is what ring attention never builds. The masks it usually
      carries are `is_causal`, `local_window_size`, `segment_ids` and the lengths.

  Any T and S work: each is padded internally to what the layout needs, and the
  padding is masked. Where T is not a multiple of the size of `seq_axis`, the output
  comes back replicated along it (every device holds all T rows) instead of sharded;
  that is said once per process at INFO level on the "jax_ring" logger. A query that
  sees no key gets 0 (jax.nn gives such a row the mean of V when it is not padding).

  Returns:
    [B, T, N, H] (or [T, N, H]), in the policy's output dtype (default: the query's
    dtype); with `return_residual`, (output, lse).
  """
  query, key, value, unbatched = _validation.add_batch_axis(query, key, value)
  (b, t, s, n, k), (q_seg, kv_seg), window, scale, block_sizes = check_arguments(
    query, key, value, segment_ids, local_window_size, scale, block_sizes, unbatched=unbatched
  )
  q_len = _validation.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, t, unbatched)
  kv_len = _validation.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s, unbatched)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  mesh = usable_mesh(mesh, query, key, value)
  is_causal = _validation.check_bool(is_causal, "is_causal")
  return_residual = _validation.check_bool(return_residual, "return_residual")
  _validation.refuse_dense(mask, bias)
  _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
  nb = _validation.check_mesh_axis(mesh, batch_axis, "batch_axis", allow_none=True)
  nh = _validation.check_mesh_axis(mesh, head_axis, "head_axis", allow_none=True)
  nu = _validation.check_mesh_axis(mesh, ulysses_axis, "ulysses_axis", allow_none=True)
  named = [a for a in (seq_axis, batch_axis, head_axis, ulysses_axis) if a is not None]
  if len(set(named)) != len(named):
    axes = f"{seq_axis=}, {batch_axis=}, {head_axis=}, {ulysses_axis=}"
    raise ValueError(f"{axes} must name different mesh axes")
  _validation.check_divides(b, nb, "batch", "batch_axis", batch_axis)
  _validation.check_divides(k, nh, "num_kv_heads", "head_axis", head_axis)
  if ulysses_axis is not None:
    _ulysses.check_heads(n // nh, nu, ulysses_axis)
  mods, sinks, slopes, seed = _validation.check_score_mods(
    logit_soft_cap,
    sinks,
    alibi_slopes,
    dropout_rate,
    dropout_rng,
    score_mod,
    batch=b,
    heads=n,
    dropout_broadcast=dropout_broadcast,
  )
  if kernel == "pallas" and mods.pallas_problem() is not None:
    raise ValueError(f"kernel='pallas': {mods.pallas_problem()}; use kernel='auto' or 'xla'")
  _validation.notice_mesh(mesh, "ring_attention", seq_axis, named, t, mesh.shape[seq_axis] * nu)
  layout = layouts.resolve(layout, is_causal, shard_len=-(-t // mesh.shape[seq_axis]))
  laid_out = _check_token_order(token_order, layout, t, s, mesh.shape[seq_axis], nu)
  document_bound = _validation.check_document_bound(document_bound, segment_ids, t, s)
  if document_bound not in (None, "auto"):  # ids in the layout's order go back to natural order for the check
    inverse = np.argsort(layouts.permutation(layout, t, mesh.shape[seq_axis])) if laid_out else None
    _documents.check_concrete(q_seg, document_bound, order=inverse)
  policy = get_policy(policy, mesh.devices.flat[0])
  # Checked here, for the mesh's platform (a ValueError before anything is traced);
  # each shard's call chooses again, "auto" falling back where its blocks do not suit.
  first = mesh.devices.flat[0]
  _choice.choose_kernel(kernel, first.platform, query.shape[-1], policy, device_kind=first.device_kind)
  gc = GlobalConfig(
    mesh,
    seq_axis,
    batch_axis,
    head_axis,
    is_causal,
    window,
    scale,
    layout,
    policy,
    block_sizes,
    return_residual,
    ulysses_axis,
    kernel,
    mods,
    laid_out,
    document_bound,
  )
  with jax.named_scope("jax_ring.ring_attention"):
    placed = place_attention_inputs(
      mesh,
      gc.seq_spec,
      batch_axis,
      head_axis,
      query=query,
      key=key,
      value=value,
      q_seg=q_seg,
      kv_seg=kv_seg,
      q_len=q_len,
      kv_len=kv_len,
    )
    names = ("query", "key", "value", "q_seg", "kv_seg", "q_len", "kv_len")
    res = _ring_attention_global(*(placed[n] for n in names), (sinks, slopes, seed), gc=gc)
  if unbatched:
    res = tuple(x[0] for x in res) if return_residual else res[0]
  return res
