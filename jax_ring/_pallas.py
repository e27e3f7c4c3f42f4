"""jax_ring's position-aware block kernels in Pallas, GPU (Triton) style.

One contract, the one the ring's XLA tiles (`_kernel`) follow, for a query shard
against one K/V shard:

    q        [B, N, Tq, H]   pre-scaled queries; head n reads kv head n // (N // K)
    k, v     [B, K, Tk, H]   no repeat for GQA: the index map picks the kv head
    q_pos    [Tq] int32      global positions;  k_pos [Tk] int32, -1 = padding
    q_seg    [B, Tq] int32   segment ids or None; k_seg [B, Tk] (separate from q's)

`forward` returns the block's output [B, N, Tq, H] (float32) and its natural-log
lse [B, N, Tq] (float32); a row that sees no key gets 0 and -inf, never the mean of V.
`backward` takes the global lse and delta = sum(dO * O, -1) (both [B, N, Tq]) and
returns dq (still lacking the softmax scale, as `_kernel.block_backward`'s), dk, dv.

A tile whose position (and segment id) bounds rule it out entirely is skipped with a
branch inside the kernel's loop over tiles, the same test as `_kernel.tile_class`.
The kernels run on CPU in interpret mode (`interpret=True`), which is how they are
tested here; `jax.export` with `platforms=("cuda",)` lowers them to Triton without a GPU.

Also here: what the TPU kernels (`_mosaic`) share (`mask_of`, `hidden`, `scores`,
`dot`, `out_shape`) and why the kernels cannot take a call (`unsupported`, used by
`_choice.choose_kernel`); the ring calls the kernels through `_ring._run_kernel`, per
platform.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import ManualAxisType

from jax_ring._kernel import MaskSpec, finalize, floor_scores, lowest_id
from jax_ring._kernel import block_bounds as _tile_bounds

# Triton wants power-of-two tiles of at least 16 rows for its dot.
MIN_BLOCK = 16
# The largest block the ring gives the kernel (a [128 x 128] float32 score tile per
# program, the size the Pallas GPU attention in jax uses).
MAX_BLOCK = 128
MAX_HEAD_DIM = 256
# Platforms with a Pallas kernel here: GPUs run this module's (Triton) kernels, TPUs
# `_mosaic`'s; "cpu" interprets them (asked for by name only).
_PALLAS_PLATFORMS = ("gpu", "cuda", "rocm", "tpu", "cpu")
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_vma_off(x, caller: str) -> None:
  """ValueError when `x` is typed as varying over a manual mesh axis: inside
  `jax.shard_map(..., check_vma=True)`, where jax's Pallas interpreter fails (it
  evaluates the kernel's unvarying constants against varying blocks)."""
  varying = jax.typeof(x).manual_axis_type.varying
  if varying:
    raise ValueError(
      f"{caller}(kernel='pallas') on CPU runs the kernel in interpret mode, which needs "
      f"jax.shard_map(..., check_vma=False); the query varies over {sorted(varying)} under check_vma=True"
    )


def block_for(length: int) -> int:
  """The Pallas block for a local length: the smallest power of two >= the length,
  clamped to [MIN_BLOCK, MAX_BLOCK]; the ring pads the length to a multiple of it."""
  return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(length - 1, 0).bit_length()))


def unsupported(platform: str, head_dim: int, policy) -> str | None:
  """Why the Pallas kernel cannot run this call, or None when it can."""
  if platform not in _PALLAS_PLATFORMS:
    return f"platform {platform!r} has no Pallas kernel here (GPU, TPU; CPU interpreted)"
  if head_dim < MIN_BLOCK or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
    return f"head_dim={head_dim}: the Pallas kernel needs a power of two in [{MIN_BLOCK}, {MAX_HEAD_DIM}]"
  if policy.compute_dtype not in _DTYPES:
    return f"compute dtype {policy.compute_dtype}: the Pallas kernel takes float32, bfloat16 or float16"
  if policy.accum_dtype != jnp.float32:
    return f"accumulation dtype {policy.accum_dtype}: the Pallas kernel accumulates in float32"
  return None


def blocks_problem(tq: int, tk: int, head_dim: int, block_q: int, block_k: int) -> str | None:
  """Why Triton cannot tile the shards with these blocks, or None."""
  for name, block, length in (("block_q", block_q, tq), ("block_k", block_k, tk)):
    if block < MIN_BLOCK or block & (block - 1) or length % block:
      need = f"a power of two >= {MIN_BLOCK} that divides the shard length {length}"
      return f"{name}={block}: the Pallas kernel needs {need}"
  if head_dim < MIN_BLOCK or head_dim & (head_dim - 1):
    return f"head_dim={head_dim}: the Pallas kernel needs a power of two >= {MIN_BLOCK}"
  return None


def check_blocks(tq: int, tk: int, head_dim: int, block_q: int, block_k: int) -> None:
  """ValueError unless the blocks tile the shard the way Triton needs."""
  problem = blocks_problem(tq, tk, head_dim, block_q, block_k)
  if problem is not None:
    raise ValueError(problem)


def hidden(spec: MaskSpec, q_bounds, k_bounds):
  """True when the masks hide the whole tile (`_kernel.tile_class` == 0), from the
  blocks' bounds (`_query_bounds`, `_key_bounds`); None when no mask can hide a tile."""
  (q_lo, q_hi, q_seg), (k_lo, k_hi, k_seg) = q_bounds, k_bounds
  hidden = None
  either = lambda a, b: b if a is None else a | b
  if spec.has_padding:
    hidden = either(hidden, k_hi < 0)
  if spec.is_causal:
    hidden = either(hidden, k_lo > q_hi)
  if spec.window is not None:
    left, right = spec.window
    hidden = either(hidden, (k_lo > q_hi + right) | (k_hi < q_lo - left))
  if q_seg is not None:
    (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg, k_seg
    hidden = either(hidden, (qs_hi < 0) | (qs_hi < ks_lo) | (ks_hi < qs_lo))
  return hidden


def _unless(hidden, visit, carry):
  """visit(carry), skipped (a branch in the kernel) where the tile is hidden."""
  return visit(carry) if hidden is None else lax.cond(hidden, lambda c: c, visit, carry)


def _skip_hidden(has_range: bool, has_seg: bool, hidden, visit, carry):
  """`_unless` where the loop has no range, or segment ids can hide tiles inside it;
  else visit(carry): a range from positions leaves out the hidden tiles at either end,
  a tile inside it is computed and masked (exact), and the loop, without a branch,
  stays software-pipelined (a branch around the loads made Triton's causal kernels on
  an H100 no faster than full attention)."""
  if has_range and not has_seg:
    return visit(carry)
  return _unless(hidden, visit, carry)


def _mask(spec: MaskSpec, qp, kp, qs, ks):
  """bool [bq, bk]: which keys each query sees (positions, padding, segment ids), or
  None when no mask applies (full attention without padding)."""
  if not spec.positional and qs is None:
    return None
  return mask_of(
    spec, qp[:, None], kp[None, :], None if qs is None else qs[:, None], None if ks is None else ks[None, :]
  )


def mask_of(spec: MaskSpec, qp, kp, qs, ks):
  """`_mask` from a column of query positions [bq, 1] and a row of key positions
  [1, bk] (ids likewise, or None), the form both kernels can broadcast."""
  mask = kp >= 0
  if spec.is_causal:
    mask = mask & (kp <= qp)
  if spec.window is not None:
    left, right = spec.window
    mask = mask & (kp >= qp - left) & (kp <= qp + right)
  if qs is not None:
    mask = mask & (qs == ks) & (qs >= 0)
  return mask


_BIG = jnp.iinfo(jnp.int32).max
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Launch:
  """How one Triton kernel tiles its program: `rows` of the block a program holds (query
  rows for the forward and dq, key rows for dk/dv), `step` rows of the other side per
  loop iteration, and Triton's `num_warps` and `num_stages` (software pipelining)."""

  rows: int
  step: int
  num_warps: int
  num_stages: int

  def blocks(self, rows: int, step: int) -> tuple[int, int]:
    """(rows, step) no larger than the ring's blocks, which they then divide (all are
    powers of two)."""
    return min(self.rows, rows), min(self.step, step)

  def params(self):
    # Triton, not Mosaic GPU (pallas_call's default GPU lowering since jax 0.10).
    return pl_triton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The Triton launch of each kernel (`forward`, `dq`, `dkv`), and whether the
  softmax exponentials run as exp2 of log2(e)-scaled scores (the GPU's native ex2
  instruction, as FlashAttention's Triton kernels do) rather than libdevice's expf."""

  forward: Launch
  dq: Launch
  dkv: Launch
  exp2: bool = True


def tuning_for(dtype, head_dim: int) -> Tuning:
  """The Triton launches for a compute dtype and head dim: the fastest of the launches
  timed on an H100 (scripts/bench/bench_triton.py, docs/benchmarks.md) at head dims 64
  and 128 in bfloat16, and smaller blocks where rows are wider, to stay within the
  227 KiB of shared memory a block may use (float32 at 128 x 128 asked for 257 KiB)."""
  row = jnp.dtype(dtype).itemsize * head_dim  # bytes of one row of q, k or v
  grads = Launch(64, 64, 4, 2)  # dq and dk/dv at both head dims timed
  if row <= 128:  # bfloat16/float16 up to H=64, float32 up to H=32
    return Tuning(Launch(128, 64, 8, 3), grads, grads)
  if row <= 256:  # H=128 in 16 bits, H=64 in float32
    return Tuning(Launch(128, 64, 4, 2), grads, grads)
  if row <= 512:
    return Tuning(grads, grads, grads)
  small = Launch(32, 32, 4, 1)  # float32 at H=256
  return Tuning(small, small, small)


def _tuning(tuning, dtype, head_dim: int, interpret) -> Tuning:
  """`tuning`, else the compiled kernels' defaults; interpreted (CPU), the ring's own
  blocks in one iteration each (as few interpreted steps as possible) unless asked."""
  if tuning is not None:
    return tuning
  if interpret:
    whole = Launch(1 << 30, 1 << 30, 4, 1)
    return Tuning(whole, whole, whole, exp2=False)
  return tuning_for(dtype, head_dim)


def _key_bounds(kp, ks):
  """(lowest valid position, highest position, (lowest id >= 0, highest id) or None) of
  one key block (ids < 0, padding, left out of the lowest, as `_kernel.block_bounds`)."""
  return jnp.min(jnp.where(kp >= 0, kp, _BIG)), jnp.max(kp), _id_range(ks)


def _id_range(ids):
  """(lowest id >= 0 (`_kernel.lowest_id`), highest id) of one block, or None."""
  return None if ids is None else (lowest_id(ids), jnp.max(ids))


def _query_bounds(qp, qs):
  """The same for a query block (every position counts)."""
  return jnp.min(qp), jnp.max(qp), _id_range(qs)


def _ids(pos_ref, seg_ref, window):
  """Positions and segment ids (or None) of the block `window`."""
  return pos_ref[window], None if seg_ref is None else seg_ref[window]


def _loop(n: int, body, init, range_ref=None):
  """fori_loop over int32 indices, also under jax_enable_x64 (Triton and the int32
  block arithmetic want them): over [0, n), or over the program's [first, end) from
  `range_ref` (`_ranges`), a loop with dynamic bounds that Triton still pipelines."""
  if range_ref is None:
    return lax.fori_loop(jnp.int32(0), jnp.int32(n), body, init)
  return lax.fori_loop(range_ref[0], range_ref[1], body, init)


def block_bounds(pos, seg, block: int, keys: bool):
  """`_kernel.block_bounds` of flat positions [T] and segment ids [B, T] in blocks of
  `block`, computed outside a kernel (`keys`: the lowest valid position, as
  `_key_bounds`): lowest and highest position [n], and the lowest and highest segment
  id [B, n] (None without ids)."""
  ids = None if seg is None else seg.reshape(seg.shape[0], -1, block)
  bounds = _tile_bounds(pos.reshape(-1, block), ids, skip_padding=keys)
  return bounds.lo, bounds.hi, None if seg is None else (bounds.seg_lo, bounds.seg_hi)


def _block_bounds(pos, seg, block: int, keys: bool, programs: bool):
  """`block_bounds` shaped to broadcast as [B, programs, steps]: [n, 1] where the
  blocks are the programs', [1, n] where they are the loop's steps."""
  lo, hi, ids = block_bounds(pos, seg, block, keys)
  at = (lambda x: x[..., :, None]) if programs else (lambda x: x[..., None, :])
  return at(lo), at(hi), None if ids is None else tuple(map(at, ids))


def _ranges(spec: MaskSpec, b: int, q_pos, q_seg, k_pos, k_seg, rows: int, step: int, queries: bool):
  """int32 [B, programs, 2]: for each program's block of `rows` (query rows when
  `queries`, else key rows), the first and one-past-the-last block of `step` rows of
  the other side that the masks do not hide (`hidden`); [0, 0) where all are hidden.
  None where no mask can hide a tile. Blocks hidden between the two (segment ids,
  positions out of order) are skipped inside the loop, or computed and masked."""
  qb = _block_bounds(q_pos, q_seg, rows if queries else step, keys=False, programs=queries)
  kb = _block_bounds(k_pos, k_seg, step if queries else rows, keys=True, programs=not queries)
  hid = hidden(spec, qb, kb)
  if hid is None:
    return None
  n_prog = (q_pos.shape[0] if queries else k_pos.shape[0]) // rows
  n_step = (k_pos.shape[0] if queries else q_pos.shape[0]) // step
  seen = ~jnp.broadcast_to(hid, (b, n_prog, n_step))
  some = jnp.any(seen, axis=2)
  first = jnp.argmax(seen, axis=2)
  end = n_step - jnp.argmax(seen[..., ::-1], axis=2)
  return jnp.stack([jnp.where(some, first, 0), jnp.where(some, end, 0)], axis=2).astype(jnp.int32)


def _unpack(rest, has_seg: bool, has_range: bool, outputs: int):
  """(q ids ref, k ids ref, range ref, *output refs), None for those not passed."""
  seg = rest[:2] if has_seg else (None, None)
  rest = rest[2:] if has_seg else rest
  rng = rest[0] if has_range else None
  outs = rest[1:] if has_range else rest
  return (*seg, rng, *outs[:outputs])


def dot(a, b, contract, precision=None):
  """2-d dot in float32: contract = (axis of a, axis of b)."""
  dims = ((contract[:1], contract[1:]), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def scores(q, k, mask, precision, log2: bool = False):
  """Masked scores q k^T in float32 (hidden pairs -inf), times log2(e) when `log2`."""
  s = dot(q, k, (1, 1), precision)
  if log2:
    s = s * _LOG2E
  s = floor_scores(s)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _exp(x, log2: bool):
  return jnp.exp2(x) if log2 else jnp.exp(x)


def _forward_kernel(
  *refs, spec: MaskSpec, block_k: int, nk: int, has_seg: bool, has_range: bool, precision, log2: bool
):
  q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, range_ref, o_ref, lse_ref = _unpack(rest, has_seg, has_range, 2)
  q = q_ref[...]
  qp, qs = _ids(qp_ref, qs_ref, slice(None))
  q_bounds = _query_bounds(qp, qs)
  bq, h = q.shape

  def body(j, carry):
    window = pl.ds(j * block_k, block_k)
    kp, ks = _ids(kp_ref, ks_ref, window)

    def visit(carry):
      o, m, l = carry
      s = scores(q, k_ref[window, :], _mask(spec, qp, kp, qs, ks), precision, log2)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = _exp(s - m_safe[:, None], log2)
      alpha = _exp(m - m_safe, log2)
      v = v_ref[window, :]
      return (
        o * alpha[:, None] + dot(p.astype(v.dtype), v, (1, 0), precision),
        m_new,
        l * alpha + jnp.sum(p, axis=1),
      )

    return _skip_hidden(has_range, has_seg, hidden(spec, q_bounds, _key_bounds(kp, ks)), visit, carry)

  init = (
    jnp.zeros((bq, h), jnp.float32),
    jnp.full((bq,), -jnp.inf, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  o, m, l = _loop(nk, body, init, range_ref)
  out, lse = finalize(o, m, l, _LOG2E if log2 else 1.0)
  o_ref[...], lse_ref[...] = out.astype(o_ref.dtype), lse


def out_shape(shape, *like):
  """A float32 kernel output that varies over every manual mesh axis `like` varies
  over (what `jax.shard_map`'s check_vma needs to type the kernel's result)."""
  varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in like if x is not None))
  return jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=ManualAxisType(varying=varying))


# Every kernel entry point (here and in `_mosaic`): jitted, the mask and the tiling static.
kernel_jit = functools.partial(
  jax.jit, static_argnames=("spec", "block_q", "block_k", "interpret", "precision")
)
# The GPU kernels also take a `Tuning` (None: `tuning_for` the dtype and head dim).
_gpu_jit = functools.partial(
  jax.jit, static_argnames=("spec", "block_q", "block_k", "interpret", "precision", "tuning")
)


def _range_specs(ranges, index_map):
  """The BlockSpec of a program's [first, end) (`_ranges`), or none."""
  return [] if ranges is None else [pl.BlockSpec((None, None, 2), index_map)]


def _bind(kernel, spec, has_seg: bool, ranges, precision, tuning: Tuning, **loop):
  """`kernel` with its static arguments: the mask, which optional inputs it gets, the
  matmul precision, exp2 or exp, and its loop's (`loop`)."""
  return functools.partial(
    kernel,
    spec=spec,
    has_seg=has_seg,
    has_range=ranges is not None,
    precision=precision,
    log2=tuning.exp2,
    **loop,
  )


def _maybe(x) -> tuple:
  return () if x is None else (x,)


def _segment_specs(has_seg: bool, q_map, k_map, q_len: int, k_len: int):
  """BlockSpecs of the query and key segment ids ([B, Tq], [B, Tk]), or none."""
  if not has_seg:
    return []
  return [pl.BlockSpec((None, q_len), q_map), pl.BlockSpec((None, k_len), k_map)]


@_gpu_jit
def forward(
  q,
  k,
  v,
  q_pos,
  k_pos,
  q_seg,
  k_seg,
  *,
  spec: MaskSpec,
  block_q: int,
  block_k: int,
  interpret=False,
  precision=None,
  tuning: Tuning | None = None,
):
  """(out [B, N, Tq, H] float32, lse [B, N, Tq] float32) of pre-scaled q against k, v.
  `block_q`, `block_k`: the ring's blocks (they divide Tq, Tk); a program takes at
  most `block_q` query rows and steps through at most `block_k` keys (`tuning`)."""
  b, n, tq, h = q.shape
  kh, tk = k.shape[1], k.shape[2]
  check_blocks(tq, tk, h, block_q, block_k)
  tuning = _tuning(tuning, q.dtype, h, interpret)
  launch = tuning.forward
  block_q, block_k = launch.blocks(block_q, block_k)
  g = n // kh
  has_seg = q_seg is not None
  ranges = _ranges(spec, b, q_pos, q_seg, k_pos, k_seg, block_q, block_k, queries=True)
  kernel = _bind(_forward_kernel, spec, has_seg, ranges, precision, tuning, block_k=block_k, nk=tk // block_k)
  in_specs = [
    pl.BlockSpec((None, None, block_q, h), lambda i, bi, ni: (bi, ni, i, 0)),
    pl.BlockSpec((None, None, tk, h), lambda i, bi, ni: (bi, ni // g, 0, 0)),
    pl.BlockSpec((None, None, tk, h), lambda i, bi, ni: (bi, ni // g, 0, 0)),
    pl.BlockSpec((block_q,), lambda i, bi, ni: (i,)),
    pl.BlockSpec((tk,), lambda i, bi, ni: (0,)),
    *_segment_specs(has_seg, lambda i, bi, ni: (bi, i), lambda i, bi, ni: (bi, 0), block_q, tk),
    *_range_specs(ranges, lambda i, bi, ni: (bi, i, 0)),
  ]
  out_specs = [
    pl.BlockSpec((None, None, block_q, h), lambda i, bi, ni: (bi, ni, i, 0)),
    pl.BlockSpec((None, None, block_q), lambda i, bi, ni: (bi, ni, i)),
  ]
  args = (q, k, v, q_pos, k_pos) + ((q_seg, k_seg) if has_seg else ()) + _maybe(ranges)
  shapes = [out_shape((b, n, tq, h), *args), out_shape((b, n, tq), *args)]
  return pl.pallas_call(
    kernel,
    grid=(tq // block_q, b, n),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=shapes,
    interpret=interpret,
    compiler_params=launch.params(),
    name="jax_ring_forward",
  )(*args)


def _tile_grads(spec, precision, log2, q, do, lse, delta, qp, qs, k, v, kp, ks):
  """(p, ds) of one tile from the global lse and delta: p = exp(s - lse), masked;
  with `log2`, lse comes in log2 units (`backward` scales it)."""
  mask = _mask(spec, qp, kp, qs, ks)
  s = scores(q, k, mask, precision, log2)
  p = _exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, None], log2)
  dp = dot(do, v, (1, 1), precision)
  ds = p * (dp - delta[:, None])
  # Hidden pairs: exactly 0 (p is, but dp or delta may be NaN; see _kernel.block_backward).
  return p, ds if mask is None else jnp.where(mask, ds, 0.0)


def _dq_kernel(
  *refs, spec: MaskSpec, block_k: int, nk: int, has_seg: bool, has_range: bool, precision, log2: bool
):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, range_ref, dq_ref = _unpack(rest, has_seg, has_range, 1)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qp, qs = _ids(qp_ref, qs_ref, slice(None))
  q_bounds = _query_bounds(qp, qs)

  def body(j, dq):
    window = pl.ds(j * block_k, block_k)
    kp, ks = _ids(kp_ref, ks_ref, window)

    def visit(dq):
      k = k_ref[window, :]
      _, ds = _tile_grads(spec, precision, log2, q, do, lse, delta, qp, qs, k, v_ref[window, :], kp, ks)
      return dq + dot(ds.astype(k.dtype), k, (1, 0), precision)

    return _skip_hidden(has_range, has_seg, hidden(spec, q_bounds, _key_bounds(kp, ks)), visit, dq)

  dq_ref[...] = _loop(nk, body, jnp.zeros(q.shape, jnp.float32), range_ref)


def _dkv_kernel(
  *refs,
  spec: MaskSpec,
  block_q: int,
  nq: int,
  has_seg: bool,
  has_range: bool,
  precision,
  log2: bool,
):
  """dk, dv partial sums of one query head's queries (q, dO, lse, delta: that head's)."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest = refs
  qs_ref, ks_ref, range_ref, dk_ref, dv_ref = _unpack(rest, has_seg, has_range, 2)
  k, v = k_ref[...], v_ref[...]
  kp, ks = _ids(kp_ref, ks_ref, slice(None))
  k_bounds = _key_bounds(kp, ks)  # the same for every query block

  def body(i, carry):
    window = pl.ds(i * block_q, block_q)
    qp, qs = _ids(qp_ref, qs_ref, window)

    def visit(carry):
      dk, dv = carry
      q, do = q_ref[window, :], do_ref[window, :]
      p, ds = _tile_grads(
        spec, precision, log2, q, do, lse_ref[window], delta_ref[window], qp, qs, k, v, kp, ks
      )
      return dk + dot(ds.astype(q.dtype), q, (0, 0), precision), dv + dot(
        p.astype(do.dtype), do, (0, 0), precision
      )

    return _skip_hidden(has_range, has_seg, hidden(spec, _query_bounds(qp, qs), k_bounds), visit, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = _loop(nq, body, (zeros, zeros), range_ref)
  dk_ref[...], dv_ref[...] = dk, dv


@_gpu_jit
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
  spec: MaskSpec,
  block_q: int,
  block_k: int,
  interpret=False,
  precision=None,
  tuning: Tuning | None = None,
):
  """(dq [B, N, Tq, H], dk, dv [B, K, Tk, H]), float32, from the global lse and delta
  [B, N, Tq]; dq lacks the softmax scale (q came pre-scaled). Blocks as `forward`'s."""
  b, n, tq, h = q.shape
  kh, tk = k.shape[1], k.shape[2]
  check_blocks(tq, tk, h, block_q, block_k)
  tuning = _tuning(tuning, q.dtype, h, interpret)
  if tuning.exp2:  # p = exp2(s log2(e) - lse log2(e))
    lse = lse * _LOG2E
  g = n // kh
  has_seg = q_seg is not None
  seg_args = (q_seg, k_seg) if has_seg else ()
  args = (q, k, v, do, lse, delta, q_pos, k_pos, *seg_args)
  dq = _dq_call(args, spec, tuning, precision, interpret, *tuning.dq.blocks(block_q, block_k))
  dk, dv = _dkv_call(args, spec, tuning, precision, interpret, *tuning.dkv.blocks(block_k, block_q))
  by_kv_head = lambda x: x.reshape(b, kh, g, tk, h).sum(axis=2) if g > 1 else x
  return dq, by_kv_head(dk), by_kv_head(dv)


def _ids_of(args):
  """(q positions, q ids, k positions, k ids) of the backward's arguments."""
  q_seg, k_seg = args[8:10] if len(args) > 8 else (None, None)
  return args[6], q_seg, args[7], k_seg


def _dims(args):
  """(B, N, Tq, H, Tk, G, has segment ids) of the backward's arguments."""
  (b, n, tq, h), (kh, tk) = args[0].shape, args[1].shape[1:3]
  return b, n, tq, h, tk, n // kh, len(args) > 8


def _dq_call(args, spec, tuning, precision, interpret, block_q, block_k):
  b, n, tq, h, tk, g, has_seg = _dims(args)
  ranges = _ranges(spec, b, *_ids_of(args), block_q, block_k, queries=True)

  # dq: a program per (query block, batch row, query head), looping over key blocks.
  row = lambda i, bi, ni: (bi, ni, i, 0)
  kv_of_head = lambda i, bi, ni: (bi, ni // g, 0, 0)
  stat = lambda i, bi, ni: (bi, ni, i)
  dq = pl.pallas_call(
    _bind(_dq_kernel, spec, has_seg, ranges, precision, tuning, block_k=block_k, nk=tk // block_k),
    grid=(tq // block_q, b, n),
    in_specs=[
      pl.BlockSpec((None, None, block_q, h), row),
      pl.BlockSpec((None, None, tk, h), kv_of_head),
      pl.BlockSpec((None, None, tk, h), kv_of_head),
      pl.BlockSpec((None, None, block_q, h), row),
      pl.BlockSpec((None, None, block_q), stat),
      pl.BlockSpec((None, None, block_q), stat),
      pl.BlockSpec((block_q,), lambda i, bi, ni: (i,)),
      pl.BlockSpec((tk,), lambda i, bi, ni: (0,)),
      *_segment_specs(has_seg, lambda i, bi, ni: (bi, i), lambda i, bi, ni: (bi, 0), block_q, tk),
      *_range_specs(ranges, lambda i, bi, ni: (bi, i, 0)),
    ],
    out_specs=pl.BlockSpec((None, None, block_q, h), row),
    out_shape=out_shape((b, n, tq, h), *args),
    interpret=interpret,
    compiler_params=tuning.dq.params(),
    name="jax_ring_backward_dq",
  )(*args, *_maybe(ranges))
  return dq


def _dkv_call(args, spec, tuning, precision, interpret, block_k, block_q):
  b, n, tq, h, tk, g, has_seg = _dims(args)
  ranges = _ranges(spec, b, *_ids_of(args), block_k, block_q, queries=False)

  # dk, dv: a program per (key block, batch row, query head), looping over that head's
  # query blocks; the G query heads of a kv head write partial sums, added after (GQA
  # without repeating K/V). A program per query head, not per kv head, launches as
  # many programs as the forward, enough to fill a GPU's SMs where one kv head at 8K
  # tokens a device would leave half of an H100's 132 idle (64 programs).
  heads = lambda j, bi, ni: (bi, ni, 0, 0)
  stats = lambda j, bi, ni: (bi, ni, 0)
  key = lambda j, bi, ni: (bi, ni // g, j, 0)
  partial = lambda j, bi, ni: (bi, ni, j, 0)
  dk, dv = pl.pallas_call(
    _bind(_dkv_kernel, spec, has_seg, ranges, precision, tuning, block_q=block_q, nq=tq // block_q),
    grid=(tk // block_k, b, n),
    in_specs=[
      pl.BlockSpec((None, None, tq, h), heads),
      pl.BlockSpec((None, None, block_k, h), key),
      pl.BlockSpec((None, None, block_k, h), key),
      pl.BlockSpec((None, None, tq, h), heads),
      pl.BlockSpec((None, None, tq), stats),
      pl.BlockSpec((None, None, tq), stats),
      pl.BlockSpec((tq,), lambda j, bi, ni: (0,)),
      pl.BlockSpec((block_k,), lambda j, bi, ni: (j,)),
      *_segment_specs(has_seg, lambda j, bi, ni: (bi, 0), lambda j, bi, ni: (bi, j), tq, block_k),
      *_range_specs(ranges, lambda j, bi, ni: (bi, j, 0)),
    ],
    out_specs=[pl.BlockSpec((None, None, block_k, h), partial)] * 2,
    out_shape=[out_shape((b, n, tk, h), *args)] * 2,
    interpret=interpret,
    compiler_params=tuning.dkv.params(),
    name="jax_ring_backward_dkv",
  )(*args, *_maybe(ranges))
  return dk, dv
