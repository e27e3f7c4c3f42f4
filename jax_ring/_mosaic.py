"""jax_ring's position-aware block kernels in Pallas, TPU (Mosaic) style.

The contract of `_pallas` (same arguments, same results), on a TPU's terms:

- a grid over (batch, head, query block, key block), the key block innermost and
  sequential, the running softmax state in VMEM scratch: each step brings one K/V
  block into VMEM (a whole long shard, as the GPU kernel's loop reads it, would not
  fit there);
- every block 2-d with a full or (8, 128)-aligned trailing pair: positions and
  segment ids travel as a column [T, 1] for queries and a row [1, S] for keys, the
  lse as [B, N, T, 1];
- the bounds a tile is skipped by (`_pallas.hidden`, the same test) are computed
  outside the kernel and prefetched into SMEM as scalars, exact for any positions.

Shared with the GPU kernels: the mask (`_pallas.mask_of`), the skip test, the score
and gradient tile math. Tested on CPU in interpret mode and lowered for TPU with
`jax.export(..., platforms=("tpu",))` (tests/test_pallas.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_ring import _pallas
from jax_ring._kernel import MaskSpec, floored, saw_keys

# Key blocks are lane-aligned (the score tile's last axis); query blocks sublane-aligned.
MIN_BLOCK_K = 128
MIN_BLOCK_Q = 8


def blocks_problem(tq: int, tk: int, block_q: int, block_k: int) -> str | None:
  """Why Mosaic cannot tile the shards with these blocks, or None."""
  for name, block, length, least in (
    ("block_q", block_q, tq, MIN_BLOCK_Q),
    ("block_k", block_k, tk, MIN_BLOCK_K),
  ):
    if length % block or (block % least and block != length):
      return (
        f"{name}={block}: the TPU kernel needs the shard length {length} or a multiple of {least} dividing it"
      )
  return None


def check_blocks(tq: int, tk: int, block_q: int, block_k: int) -> None:
  """ValueError unless the blocks tile the shard the way Mosaic needs."""
  problem = blocks_problem(tq, tk, block_q, block_k)
  if problem is not None:
    raise ValueError(problem)


def _bounds(pos, seg, block: int, keys: bool, b: int):
  """Per batch row and block, flat int32 [B * n * 4]: (lowest position (valid ones,
  for keys), highest position, lowest segment id, highest id); ids 0 without ids."""
  lo, hi, ids = _pallas.block_bounds(pos, seg, block, keys)
  s_lo, s_hi = ids if ids is not None else (jnp.zeros((b, lo.shape[0]), jnp.int32),) * 2
  s_lo = jnp.minimum(s_lo, jnp.iinfo(jnp.int32).max)  # a block of padding alone: int64's max
  pos_part = jnp.broadcast_to(jnp.stack([lo, hi]), (b, 2, lo.shape[0]))
  both = jnp.concatenate([pos_part, jnp.stack([s_lo, s_hi], axis=1)], axis=1)
  return both.transpose(0, 2, 1).reshape(-1).astype(jnp.int32)


def _read_bounds(ref, bi, i, n: int, has_seg: bool):
  """(lo, hi, (seg lo, seg hi) or None) of block i (of n) of batch row bi, from SMEM."""
  at = (bi * n + i) * 4
  seg = (ref[at + 2], ref[at + 3]) if has_seg else None
  return ref[at], ref[at + 1], seg


def _operands(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: MaskSpec, block_q: int, block_k: int):
  """(the two prefetched bounds arrays, the kernels' first operands): q, k, v, then
  positions and ids as the kernels read them, queries [T, 1] and keys [1, S], ids
  [B, T, 1] and [B, 1, S] (left out without ids)."""
  b = q.shape[0]
  bounds = (_bounds(q_pos, q_seg, block_q, False, b), _bounds(k_pos, k_seg, block_k, spec.has_padding, b))
  seg = () if q_seg is None else (q_seg[:, :, None], k_seg[:, None, :])
  return bounds, (q, k, v, q_pos[:, None], k_pos[None, :], *seg)


def _forward_kernel(*refs, spec: MaskSpec, nq: int, nk: int, has_seg: bool, precision):
  qb_ref, kb_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, o_ref, lse_ref, o_acc, m_acc, l_acc = rest if has_seg else (None, None, *rest)
  bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    o_acc[...] = jnp.zeros(o_acc.shape, jnp.float32)
    m_acc[...] = jnp.full(m_acc.shape, -jnp.inf, jnp.float32)
    l_acc[...] = jnp.zeros(l_acc.shape, jnp.float32)

  def visit():
    qs, ks = (None, None) if not has_seg else (qs_ref[...], ks_ref[...])
    mask = _pallas.mask_of(spec, qp_ref[...], kp_ref[...], qs, ks)
    s = _pallas.scores(q_ref[...], k_ref[...], mask, precision)
    m = m_acc[...]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    v = v_ref[...]
    o_acc[...] = o_acc[...] * alpha + _pallas.dot(p.astype(v.dtype), v, (1, 0), precision)
    l_acc[...] = l_acc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    m_acc[...] = m_new

  q_bounds, k_bounds = _read_bounds(qb_ref, bi, i, nq, has_seg), _read_bounds(kb_ref, bi, j, nk, has_seg)
  _when_visible(spec, q_bounds, k_bounds, visit)

  @pl.when(j == nk - 1)
  def _():
    l = l_acc[...]
    seen, dead = saw_keys(l), floored(m_acc[...])
    safe_l = jnp.where(seen, l, 1.0)
    out = jnp.where(seen, o_acc[...] / safe_l, 0.0)
    o_ref[...] = jnp.where(dead, 0.0, out).astype(o_ref.dtype)  # see _kernel.finalize
    lse_ref[...] = jnp.where(dead, m_acc[...], jnp.where(seen, m_acc[...] + jnp.log(safe_l), -jnp.inf))


def _when_visible(spec, q_bounds, k_bounds, body):
  """body() unless the masks hide the whole tile."""
  hidden = _pallas.hidden(spec, q_bounds, k_bounds)
  if hidden is None:
    body()
  else:
    pl.when(jnp.logical_not(hidden))(body)


def _specs(has_seg: bool, block_q: int, block_k: int, h: int, q_of, k_of):
  """BlockSpecs of q, k, v, query and key positions and ids, given the maps from the
  grid to (batch row, query head, query block) and (batch row, kv head, key block)."""
  q_map = lambda *g: (*q_of(*g)[:2], q_of(*g)[2], 0)
  k_map = lambda *g: (*k_of(*g)[:2], k_of(*g)[2], 0)
  specs = [
    pl.BlockSpec((None, None, block_q, h), q_map),
    pl.BlockSpec((None, None, block_k, h), k_map),
    pl.BlockSpec((None, None, block_k, h), k_map),
    pl.BlockSpec((block_q, 1), lambda *g: (q_of(*g)[2], 0)),
    pl.BlockSpec((1, block_k), lambda *g: (0, k_of(*g)[2])),
  ]
  if has_seg:
    specs += [
      pl.BlockSpec((None, block_q, 1), lambda *g: (q_of(*g)[0], q_of(*g)[2], 0)),
      pl.BlockSpec((None, 1, block_k), lambda *g: (k_of(*g)[0], 0, k_of(*g)[2])),
    ]
  return specs


_TPU = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


@_pallas.kernel_jit
def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, spec, block_q, block_k, interpret=False, precision=None):
  """`_pallas.forward` on a TPU: (out [B, N, Tq, H], lse [B, N, Tq]), float32."""
  b, n, tq, h = q.shape
  kh, tk = k.shape[1], k.shape[2]
  check_blocks(tq, tk, block_q, block_k)
  g, nq, nk = n // kh, tq // block_q, tk // block_k
  has_seg = q_seg is not None
  bounds, args = _operands(q, k, v, q_pos, k_pos, q_seg, k_seg, spec, block_q, block_k)
  # grid (batch row, query head, query block, key block); the prefetched bounds come first.
  q_of = lambda bi, ni, i, j, *_: (bi, ni, i)
  k_of = lambda bi, ni, i, j, *_: (bi, lax.div(ni, jnp.int32(g)), j)  # lax.div: Mosaic has no floor division
  kernel = functools.partial(_forward_kernel, spec=spec, nq=nq, nk=nk, has_seg=has_seg, precision=precision)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, n, nq, nk),
    in_specs=_specs(has_seg, block_q, block_k, h, q_of, k_of),
    out_specs=[
      pl.BlockSpec((None, None, block_q, h), lambda bi, ni, i, j, *_: (bi, ni, i, 0)),
      pl.BlockSpec((None, None, block_q, 1), lambda bi, ni, i, j, *_: (bi, ni, i, 0)),
    ],
    scratch_shapes=[pltpu.VMEM((block_q, h), jnp.float32)] + [pltpu.VMEM((block_q, 1), jnp.float32)] * 2,
  )
  out, lse = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=[_pallas.out_shape((b, n, tq, h), *args), _pallas.out_shape((b, n, tq, 1), *args)],
    interpret=interpret,
    compiler_params=_TPU,
    name="jax_ring_tpu_forward",
  )(*bounds, *args)
  return out, lse[..., 0]


def _tile(
  spec, precision, has_seg, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, qs_ref, ks_ref
):
  """(p, ds) of the current tile from the global lse and delta ([bq, 1] columns)."""
  qs, ks = (qs_ref[...], ks_ref[...]) if has_seg else (None, None)
  mask = _pallas.mask_of(spec, qp_ref[...], kp_ref[...], qs, ks)
  s = _pallas.scores(q_ref[...], k_ref[...], mask, precision)
  lse = lse_ref[...]
  p = jnp.exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse))
  dp = _pallas.dot(do_ref[...], v_ref[...], (1, 1), precision)
  # Hidden pairs: exactly 0 (p is, but dp or delta may be NaN; see _kernel.block_backward).
  return p, jnp.where(mask, p * (dp - delta_ref[...]), 0.0)


def _dq_kernel(*refs, spec: MaskSpec, nq: int, nk: int, has_seg: bool, precision):
  qb_ref, kb_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc = rest if has_seg else (None, None, *rest)
  bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  def visit():
    tile = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, qs_ref, ks_ref)
    _, ds = _tile(spec, precision, has_seg, *tile)
    k = k_ref[...]
    dq_acc[...] += _pallas.dot(ds.astype(k.dtype), k, (1, 0), precision)

  _when_visible(
    spec, _read_bounds(qb_ref, bi, i, nq, has_seg), _read_bounds(kb_ref, bi, j, nk, has_seg), visit
  )

  @pl.when(j == nk - 1)
  def _():
    dq_ref[...] = dq_acc[...]


def _dkv_kernel(*refs, spec: MaskSpec, nq: int, nk: int, groups: int, has_seg: bool, precision):
  qb_ref, kb_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = (
    rest if has_seg else (None, None, *rest)
  )
  bi, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(t == 0)
  def _():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def visit():
    tile = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, qs_ref, ks_ref)
    p, ds = _tile(spec, precision, has_seg, *tile)
    q, do = q_ref[...], do_ref[...]
    dk_acc[...] += _pallas.dot(ds.astype(q.dtype), q, (0, 0), precision)
    dv_acc[...] += _pallas.dot(p.astype(do.dtype), do, (0, 0), precision)

  i = lax.rem(t, jnp.int32(nq))
  _when_visible(
    spec, _read_bounds(qb_ref, bi, i, nq, has_seg), _read_bounds(kb_ref, bi, j, nk, has_seg), visit
  )

  @pl.when(t == groups * nq - 1)
  def _():
    dk_ref[...] = dk_acc[...]
    dv_ref[...] = dv_acc[...]


@_pallas.kernel_jit
def backward(
  q,
  k,
  v,
  do,
  lse,
  delta,
  q_pos,
  k_pos,
  q_seg,
  k_seg,
  *,
  spec,
  block_q,
  block_k,
  interpret=False,
  precision=None,
):
  """`_pallas.backward` on a TPU: (dq [B, N, Tq, H] lacking the scale, dk, dv), float32."""
  b, n, tq, h = q.shape
  kh, tk = k.shape[1], k.shape[2]
  check_blocks(tq, tk, block_q, block_k)
  g, nq, nk = n // kh, tq // block_q, tk // block_k
  has_seg = q_seg is not None
  bounds, args = _operands(q, k, v, q_pos, k_pos, q_seg, k_seg, spec, block_q, block_k)
  args += (do, lse[..., None], delta[..., None])
  options = dict(spec=spec, nq=nq, nk=nk, has_seg=has_seg, precision=precision)

  def call(kernel, grid, q_of, k_of, out_specs, out_shape, scratch, name):
    q_map = lambda *gr: (*q_of(*gr), 0)
    rows = [
      pl.BlockSpec((None, None, block_q, h), q_map),
      pl.BlockSpec((None, None, block_q, 1), q_map),
      pl.BlockSpec((None, None, block_q, 1), q_map),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=grid,
      in_specs=_specs(has_seg, block_q, block_k, h, q_of, k_of) + rows,
      out_specs=out_specs,
      scratch_shapes=scratch,
    )
    return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret, compiler_params=_TPU, name=name
    )(*bounds, *args)

  # dq: grid (batch row, query head, query block, key block), key blocks innermost.
  q_of = lambda bi, ni, i, j, *_: (bi, ni, i)
  k_of = lambda bi, ni, i, j, *_: (bi, lax.div(ni, jnp.int32(g)), j)
  dq = call(
    functools.partial(_dq_kernel, **options),
    (b, n, nq, nk),
    q_of,
    k_of,
    pl.BlockSpec((None, None, block_q, h), lambda bi, ni, i, j, *_: (bi, ni, i, 0)),
    _pallas.out_shape((b, n, tq, h), *args),
    [pltpu.VMEM((block_q, h), jnp.float32)],
    "jax_ring_tpu_backward_dq",
  )
  # dk, dv: grid (batch row, kv head, key block, (query head of the group, query
  # block)), the group's query blocks innermost (GQA sums there).
  q_of = lambda bi, ki, j, t, *_: (bi, ki * g + lax.div(t, jnp.int32(nq)), lax.rem(t, jnp.int32(nq)))
  k_of = lambda bi, ki, j, t, *_: (bi, ki, j)
  key = pl.BlockSpec((None, None, block_k, h), lambda bi, ki, j, t, *_: (bi, ki, j, 0))
  dk, dv = call(
    functools.partial(_dkv_kernel, groups=g, **options),
    (b, kh, nk, g * nq),
    q_of,
    k_of,
    [key, key],
    [_pallas.out_shape((b, kh, tk, h), *args)] * 2,
    [pltpu.VMEM((block_k, h), jnp.float32)] * 2,
    "jax_ring_tpu_backward_dkv",
  )
  return dq, dk, dv
