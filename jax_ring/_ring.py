"""The ring: K/V shards rotate around the devices of one mesh axis.

Forward: every device keeps its queries and an online-softmax state (output and
log-sum-exp in the accumulation dtype); K/V blocks, their global positions and segment
ids travel the ring with `ppermute`, the next transfer issued before the current block
is computed. Backward (custom VJP): the ring runs again, and dK/dV accumulators follow
the K/V they belong to one step behind (so every step's transfer is issued before its
compute), then one final ppermute brings them home. Residuals are
the local q, k, v, output and log-sum-exp: memory per device is O(seq / devices).

What other modules use: `RingConfig`, `ring_permutation`, `schedule`, `prepare` with
`ring_forward_state` / `ring_backward_state` (the passes on blocked inputs, which
dilated attention runs over its sub-rings), and `ring` (the differentiable whole).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_ring import _cudnn, _mosaic, _pallas
from jax_ring._kernel import (
  Bounds,
  KVBlocks,
  KVRows,
  MaskSpec,
  QBlocks,
  bits_as,
  block_bounds,
  carrier_dtype,
  chunk_backward,
  chunk_forward,
  dense_backward,
  dense_forward,
  expose_floored,
  finalize,
  kv_reader,
  pack_rows,
  tile_class,
)
from jax_ring._merge import merge_local
from jax_ring._mods import ScoreArgs, ScoreMods, group_args
from jax_ring._policy import Policy
from jax_ring._tiles import (
  block_kv,
  block_q,
  block_rows,
  block_seg,
  mesh_platform,
  unblock_kv,
  unblock_q,
  unblock_rows,
)


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
  # The block kernel of every ring step: "xla" (`_kernel`'s tiles) or "pallas"
  # (`_pallas`, blocks block_q x block_kv; interpreted where lowered for CPU).
  kernel: str = "xla"
  # Score modifiers (soft-cap, ALiBi, score_mod, dropout): the XLA tiles only.
  mods: ScoreMods = ScoreMods()
  # The XLA tiles' causal zigzag steps by quadrants (`_quadrant_kind`): the shard's
  # queries are one block (block_q = the local length), and a ring step whose visible
  # keys form one rectangle (all queries x the first half of the keys, or the second
  # half of the queries x all keys) runs it without masks; others take the masked
  # tiles over listed blocks of the queries (`_diagonal_blocks`). Set from
  # `_tiles.quadrant_tiles`.
  quadrants: bool = False
  # `document_bound="auto"`: the (steps_back, steps_fwd) schedules that the ids pick from
  # while running (`_documents.runtime_schedules`), every device the same one
  # (`ring`'s `pick`); steps_back and steps_fwd are then the whole ring's, the last.
  schedules: tuple[tuple[int, int], ...] | None = None

  @property
  def home_shift(self) -> int:
    """How far along the ring the backward's last pass leaves a shard's dK/dV: a pass
    rotating +1 ends `steps_back` devices after the owner, one rotating -1 (after a
    first move of -1) `steps_fwd` before it."""
    return self.steps_fwd if self.steps_fwd else -self.steps_back


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


def schedule(layout, window, is_causal, shard_len, ring_size, custom_positions):
  """(steps_back, steps_fwd): how many ring steps can hold visible keys, each way."""
  full = (ring_size - 1, 0)
  if layout != "contiguous" or custom_positions or window is None:
    return full
  left, right = window
  back = min(ring_size - 1, -(-left // shard_len))
  fwd = 0 if is_causal else min(ring_size - 1 - back, -(-right // shard_len))
  return back, fwd


def _send(tree, cfg: RingConfig, shift: int):
  """Every array of `tree` to the device `shift` places along the ring. On CPU and GPU
  the arrays travel bundled into one (`_bundled`): one transfer a step. On GPU, XLA
  keeps about one collective in flight and runs a second permute of a step
  synchronously on the compute stream ("is_sync":true); sent apart, the late scheme's
  dK/dV were that second permute, exposed in every backward step on 8 x H100
  (`hlo.ring_overlap`). XLA's TPU scheduler overlaps several transfers with a step's
  compute, and there a bundle left the Pallas forward's transfer with nothing under it
  (v6e), so on TPU each array is its own permute."""
  perm = ring_permutation(cfg.ring_size, shift, cfg.axis_size)
  return sent_together(tree, lambda x: lax.ppermute(x, cfg.axis_name, perm))


def sent_together(tree, send):
  """send(x) for every array of `tree` going the same way, as the ring sends its own:
  bundled into one transfer on CPU and GPU (`_bundled`: XLA keeps about one collective
  in flight on a GPU and runs a second synchronously), one permute each on TPU (whose
  scheduler overlaps several; see `_send`). `send`: e.g. `lambda x: lax.ppermute(x,
  axis, perm)`, inside `shard_map`."""
  if mesh_platform() == "tpu":
    return jax.tree.map(send, tree)
  return _bundled(tree, send)


def _bundled(tree, send):
  """send(x) for every array of `tree`, with the arrays bundled into one and sent once.
  A CPU device's collective-permute is a copy at which all the ring's devices meet;
  XLA copies each array once more before it anyway (the loop still reads it), so one
  bundle costs no more bytes and needs one meeting, not one per array (dK and dV, or
  the Pallas kernels' K, V and positions; the XLA tiles' K/V already travel as one
  array, `pack_rows`). Arrays of other dtypes travel as bits of `carrier_dtype` and
  come back unchanged, NaN payloads included."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    # Under shard_map's checks, arrays varying over different mesh axes stay apart;
    # booleans have no bit pattern to convert, so each dtype of them goes alone.
    kind = x.dtype if x.dtype == jnp.bool_ else None
    groups.setdefault((kind, jax.typeof(x).manual_axis_type), []).append(i)
  out = list(leaves)
  for (kind, _), members in groups.items():
    if len(members) == 1 or kind is not None:
      for i in members:
        out[i] = send(leaves[i])
      continue
    # Only the small arrays (positions, segment ids) change type, and all are joined
    # as rows of one length: on CPU, fused 1-d concatenations of unequal sizes, or
    # ones converting their large operands, ran 10-20x slower than this (0.8-3 ms
    # against 0.05 ms for K, V and positions at T=8192 on 8 devices, from a profile).
    unit = carrier_dtype([leaves[i] for i in members])
    bits = [bits_as(leaves[i], unit) for i in members]
    row = math.gcd(*(b.size for b in bits))
    sent = send(jnp.concatenate([b.reshape(-1, row) for b in bits]))
    start = 0
    for i, b in zip(members, bits):
      x = leaves[i]
      piece = sent[start : start + b.size // row].reshape(b.shape)
      out[i] = bits_as(piece, x.dtype)
      start += b.size // row
  return treedef.unflatten(out)


@jax.named_scope("forward_ring_pass")  # names its transfers outside the steps (hlo.loop_name)
def _pass_forward(cfg: RingConfig, compute, kv, acc, transfers: int, shift: int):
  """Computes with kv, then with `transfers` shards arriving from `shift` direction."""
  if transfers:

    @jax.named_scope("forward_ring_step")  # the loop's name in compiled programs (hlo.ring_overlap)
    def step(carry, _):
      kv, acc = carry
      incoming = _send(kv, cfg, shift)  # issued before this step's compute
      return (incoming, compute(kv, acc)), None

    kv, acc = _steps(step, (kv, acc), transfers)
  return compute(kv, acc)


def _steps(step, carry, n: int):
  """The carry after `n` ring steps `step(carry, None) -> (carry, None)`, as a loop.
  XLA inlines a loop of one iteration, and then its GPU scheduler put none of the
  step's compute under the step's transfer (a bound of one chunk each way on 8 x H100:
  the K/V sends' starts and dones with only small fusions between them). On GPUs
  (`ONE_STEP_LOOP_PLATFORMS`) a single step stays a loop: its trip count passes an
  optimization barrier, which XLA cannot see through and `hlo.trip_count` reads.
  Elsewhere, and for more steps, `lax.scan`."""
  if n == 1 and mesh_platform() in ONE_STEP_LOOP_PLATFORMS:
    count = lax.optimization_barrier(jnp.int32(n))
    return lax.fori_loop(0, count, lambda _, c: step(c, None)[0], carry)
  carry, _ = lax.scan(step, carry, None, length=n)
  return carry


# Platforms where a ring pass of one step stays a loop (`_steps`). Not TPU: compiled
# for v5e 2x4 with a bound of one chunk, the one-step backward loop of the Pallas
# kernel held none of its compute and both its transfers read exposed, where inlined
# they ran beside the compute of the loop around them. The tests add "cpu" here.
ONE_STEP_LOOP_PLATFORMS = ("gpu", "cuda", "rocm")

# Platforms whose backward sends each shard's dK/dV one step behind its K/V
# (`_pass_backward`), so that the transfer runs beside the step's compute. A CPU's
# ppermute is a synchronous copy, which the late scheme cannot hide, only add a fresh
# accumulator and a sum to per step (interleaved runs at T=1024-8192 on 8 devices gave
# it 0.98-1.05x the time, within this machine's noise); so on CPU the accumulators
# travel with their K/V. The tests add "cpu" here to run the late scheme.
LATE_DKV_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


class OwnHalves(NamedTuple):
  """The local K/V cut in two halves of its keys, for the late scheme's backward: the
  pass's first compute takes `first` (the later keys), under the first K/V transfer,
  and the last compute after every pass takes `last` (the earlier keys, which see the
  most queries under a causal mask), under the send of the last pass's dK/dV home.
  Unsplit, that send comes after the last compute with nothing left to run under it:
  32 MiB exposed per head group on 8 x H100 at 64K tokens of Llama-3-8B's attention
  with the XLA tiles, 4 MiB on TPU v5e 2x4 (`docs/guides/kernels.md`). `zeros()`: a
  half's zero dK/dV; `add(full, d, i)`: whole-shard dK/dV `full` with a half's dK/dV d
  added to half i (0 the earlier keys)."""

  first: Any
  last: Any
  zeros: Any
  add: Any


def _half(x, i: int, axis: int):
  n = x.shape[axis] // 2
  return lax.slice_in_dim(x, i * n, (i + 1) * n, axis=axis)


def own_halves(cfg: RingConfig, kv, cut, zeros_kv, axis: int, keys: int, unit: int) -> OwnHalves | None:
  """OwnHalves of the local K/V where the late scheme runs (LATE_DKV_PLATFORMS) and dK/dV
  go home at all, else None. `cut(kv, i)`: half i of the K/V; dK/dV's keys lie along
  `axis`; the shard's `keys` (in blocks or tokens) must split into halves of whole
  multiples of `unit` (else None: the send home stays after the last compute)."""
  if mesh_platform() not in LATE_DKV_PLATFORMS:
    return None
  if not cfg.home_shift % cfg.ring_size or keys % (2 * unit):
    return None

  def add(full, d, i):
    put = lambda f, x: lax.dynamic_update_slice_in_dim(f, _half(f, i, axis) + x, i * x.shape[axis], axis)
    return jax.tree.map(put, full, d)

  zeros = lambda: jax.tree.map(lambda z: _half(z, 0, axis), zeros_kv())
  return OwnHalves(cut(kv, 1), cut(kv, 0), zeros, add)


@jax.named_scope("backward_ring_pass")
def _pass_backward(
  cfg: RingConfig, compute, kv, zeros_kv, dq, transfers: int, shift: int, own: OwnHalves | None = None
):
  """Like _pass_forward; dK/dV travel with their K/V (`_pass_backward_with`) or, where
  transfers run beside compute (`LATE_DKV_PLATFORMS`), one device behind
  (`_pass_backward_late`). They end where their K/V do: the caller sends them home.
  (dkv, dq). `own` (late scheme only): the first compute takes `own.first`, not kv."""
  if mesh_platform() in LATE_DKV_PLATFORMS:
    return _pass_backward_late(cfg, compute, kv, zeros_kv, dq, transfers, shift, own)
  return _pass_backward_with(cfg, compute, kv, zeros_kv, dq, transfers, shift)


def _pass_backward_with(cfg: RingConfig, compute, kv, zeros_kv, dq, transfers: int, shift: int):
  """dK/dV travel with their K/V: each step sends its K/V, computes, then sends the
  updated dK/dV, which waits for the compute."""
  dkv = zeros_kv()
  if transfers:

    @jax.named_scope("backward_ring_step")
    def step(carry, _):
      kv, dkv, dq = carry
      incoming = _send(kv, cfg, shift)
      dq, dkv = compute(kv, dkv, dq)
      return (incoming, _send(dkv, cfg, shift), dq), None

    kv, dkv, dq = _steps(step, (kv, dkv, dq), transfers)
  dq, dkv = compute(kv, dkv, dq)
  return dkv, dq


def _pass_backward_late(
  cfg: RingConfig, compute, kv, zeros_kv, dq, transfers: int, shift: int, own: OwnHalves | None = None
):
  """Each shard's dK/dV follow it one device behind.

  A step sends the K/V it holds together with the finished dK/dV of the shard it held
  one step before, both before its own compute, so the whole step's compute hides the
  transfer (sending dK/dV with their own K/V would wait for that compute). The dK/dV
  arriving meanwhile are those of the shard now in hand, from the devices before; the
  step's own share is added to them once it is computed. With `own`, the first
  compute covers only `own.first`, the later half of the keys."""
  send = lambda tree: _send(tree, cfg, shift)
  incoming = send(kv) if transfers else None
  if own is None:
    dq, dkv = compute(kv, zeros_kv(), dq)
  else:
    dq, d = compute(own.first, own.zeros(), dq)
    dkv = own.add(zeros_kv(), d, 1)
  if transfers:

    @jax.named_scope("backward_ring_step")
    def step(carry, _):
      kv, dkv, dq = carry
      (after, arrived) = send((kv, dkv))
      dq, mine = compute(kv, zeros_kv(), dq)
      return (after, jax.tree.map(jnp.add, arrived, mine), dq), None

    kv, dkv, dq = _steps(step, (incoming, dkv, dq), transfers - 1)

    def last(carry, _):  # sends no K/V on
      kv, dkv, dq = carry
      arrived = send(dkv)
      dq, mine = compute(kv, zeros_kv(), dq)
      return (kv, jax.tree.map(jnp.add, arrived, mine), dq), None

    if transfers == 1 and mesh_platform() in ONE_STEP_LOOP_PLATFORMS:  # the pass's one loop
      _, dkv, dq = _steps(jax.named_scope("backward_ring_step")(last), (kv, dkv, dq), 1)
    else:
      (_, dkv, dq), _ = last((kv, dkv, dq), None)
  return dkv, dq


def zeros_varying_like(shape, dtype, *like):
  """Zeros that vary over the mesh axes of every array in `like` (keeps loop carries typed)."""
  zero = sum(jnp.zeros_like(x, shape=(), dtype=dtype) for x in like)
  return jnp.broadcast_to(zero, shape)


def zeros_from(x, dtype, *like):
  """Zeros of x's shape computed from x (x * 0 where x is finite), varying over the mesh
  axes of x and of every array in `like`. XLA folds constant zeros into one array per
  program, so every loop that starts from them copies that array, and its CPU scheduler
  runs all those copies at the program's start; zeros computed from x wait for x."""
  return jnp.where(jnp.isfinite(x), x * 0, 0).astype(dtype) + zeros_varying_like((), dtype, x, *like)


class Inputs(NamedTuple):
  """One device's blocked ring inputs (see `prepare`)."""

  q: jax.Array  # [nq, B, K, G, bq, H] compute dtype, times the softmax scale
  q_pos: jax.Array  # [nq, bq]
  q_seg: jax.Array | None  # [nq, B, bq]
  kv: KVBlocks  # blocks of the local K/V (wire dtype)
  args: ScoreArgs | None = None  # the score modifiers' arrays for these heads


def prepare(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg, args: ScoreArgs | None = None) -> Inputs:
  """Blocks this device's q [B, T, N, H] (scaled) and k, v [B, T, K, H] with their
  positions [T] and segment ids [B, T] (or None) for the ring passes."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  pol = cfg.policy
  scaled = q.astype(pol.accum_dtype) * jnp.asarray(cfg.scale, pol.accum_dtype)
  qg = scaled.astype(pol.compute_dtype).reshape(b, t, kh, n // kh, h)
  kv = KVBlocks(
    k=block_kv(k.astype(pol.transfer_dtype), cfg.block_kv),
    v=block_kv(v.astype(pol.transfer_dtype), cfg.block_kv),
    pos=k_pos.reshape(-1, cfg.block_kv),
    seg=block_seg(k_seg, cfg.block_kv),
  )
  return Inputs(
    block_q(qg, cfg.block_q), q_pos.reshape(-1, cfg.block_q), block_seg(q_seg, cfg.block_q), kv, args
  )


def _as_compute(kv: KVBlocks | KVRows, policy: Policy) -> KVBlocks | KVRows:
  if isinstance(kv, KVRows):
    return kv.as_compute(policy.compute_dtype)
  return kv._replace(k=kv.k.astype(policy.compute_dtype), v=kv.v.astype(policy.compute_dtype))


def _traveling(kv: KVBlocks) -> KVBlocks | KVRows:
  """The form the XLA tiles' K/V travel the ring in: on CPU one array of rows
  (`pack_rows`: one transfer a step, and nothing to join before it or split after it),
  elsewhere the blocks as they are."""
  return pack_rows(kv) if mesh_platform() == "cpu" else kv


def _forward_passes(cfg: RingConfig, compute, kv, acc):
  """acc after `compute(kv, acc)` with every K/V shard the schedule visits."""
  acc = _pass_forward(cfg, compute, kv, acc, cfg.steps_back, +1)
  if cfg.steps_fwd:
    acc = _pass_forward(cfg, compute, _send(kv, cfg, -1), acc, cfg.steps_fwd - 1, -1)
  return acc


@jax.named_scope("backward_ring_pass")
def _send_home(cfg: RingConfig, dkv, shift: int):
  return _send(dkv, cfg, shift) if shift % cfg.ring_size else dkv


def _backward_passes(cfg: RingConfig, compute, kv, zeros_kv, dq, own: OwnHalves | None = None):
  """((dk, dv) of the local K/V, dq) after `compute(kv, dkv, dq)` with every K/V shard
  the schedule visits; dK/dV follow their K/V and come home: the last pass leaves them
  `cfg.home_shift` devices from their owner. With `own`, the local K/V's compute is
  split: the later half of its keys first, the earlier half after the last pass, with
  the last pass's dK/dV on their way home meanwhile."""
  back = cfg.steps_back
  dkv, dq = _pass_backward(cfg, compute, kv, zeros_kv, dq, back, +1, own)
  here = None
  if cfg.steps_fwd:
    # The first pass's dK/dV go home under the second pass's compute; that pass's K/V
    # started one device ahead and end `steps_fwd` ahead of their owner (`home_shift`).
    here = _send_home(cfg, dkv, -back)
    dkv, dq = _pass_backward(cfg, compute, _send(kv, cfg, -1), zeros_kv, dq, cfg.steps_fwd - 1, -1)
  if own is None:
    dkv = _send_home(cfg, dkv, cfg.home_shift)
  else:
    # The send home and the last compute start together, once the last pass is done
    # (the barrier holds the K/V too: the Pallas kernels take no dq), and the dK/dV go
    # in the pass's layout, with no conversion between that and their send. With the
    # Pallas kernels dK and dV go as one array (`_bundled`): sent apart, XLA's v5e
    # scheduler started the second after the last compute; with the XLA tiles they go
    # apart, as bundled v5p and v6e exposed them (compiled at 64K, `scripts/aot.py`).
    dkv, dq, last = lax.optimization_barrier((dkv, dq, own.last))
    if cfg.kernel == "pallas":
      perm = ring_permutation(cfg.ring_size, cfg.home_shift, cfg.axis_size)
      dkv = _bundled(dkv, lambda x: lax.ppermute(x, cfg.axis_name, perm))
    else:
      dkv = _send_home(cfg, dkv, cfg.home_shift)
    dq, d = compute(last, own.zeros(), dq)
    dkv = own.add(dkv, d, 0)
  return (dkv if here is None else jax.tree.map(jnp.add, here, dkv)), dq


def ring_forward_state(cfg: RingConfig, x: Inputs):
  """(out, lse) in accumulation dtype, blocked: [nq, B, K, G, bq, H], [nq, B, K, G, bq]."""
  if cfg.kernel == "pallas":
    return _pallas_forward_state(cfg, x)
  if cfg.kernel == "cudnn":
    return _cudnn_forward_state(cfg, x)
  pol = cfg.policy
  # From the queries, not constant zeros: Gemma 3 270M's prefill at 32K tokens on 8
  # devices held 17 copies of a constant accumulator from its start, 16 MiB each.
  o = zeros_from(x.q, pol.accum_dtype, x.kv.k)
  m = jnp.full_like(o, -jnp.inf, shape=x.q.shape[:-1])
  l = jnp.zeros_like(m)
  q_bounds = block_bounds(x.q_pos, x.q_seg)  # once, outside the ring's loop

  def compute(kv, acc):
    return chunk_forward(
      cfg.mask, pol, x.q, x.q_pos, x.q_seg, q_bounds, _as_compute(kv, pol), acc, cfg.mods, x.args
    )

  compute = _quadrant_forward(cfg, x) if cfg.quadrants else compute
  return finalize(*_forward_passes(cfg, compute, _traveling(x.kv), (o, m, l)))


def ring_backward_state(cfg: RingConfig, x: Inputs, do, lse, delta, out=None):
  """dq, dk, dv (blocked, accumulation dtype) given the blocked dO, lse and delta.

  delta is sum(dO * O) over the head dim, minus the cotangent of lse if lse is an
  output too (d lse_i / d s_ij = p_ij enters the score gradient like -delta does).
  `out`: the blocked output O, which the cuDNN kernel takes in delta's place (it
  computes sum(dO * O) itself, so its calls never have an lse cotangent: `cudnn_problem`).
  """
  if cfg.kernel == "pallas":
    return _pallas_backward_state(cfg, x, do, lse, delta)
  if cfg.kernel == "cudnn":
    return _cudnn_backward_state(cfg, x, do, lse, out)
  pol = cfg.policy
  # [nq, B, K, G, bq, H] -> [nq, B, K, H, G, bq]: the layout the dK and dV products take.
  heads_first = lambda x: jnp.moveaxis(x, -1, -3)
  qb = QBlocks(
    q=x.q,
    q_t=heads_first(x.q),
    do=do,
    do_t=heads_first(do),
    lse=lse,
    delta=delta,
    pos=x.q_pos,
    seg=x.q_seg,
    bounds=block_bounds(x.q_pos, x.q_seg),  # once, outside the ring's loop
  )
  # With ALiBi, dq carries one more column: each query row's share of d loss / d slope.
  extra = 1 if cfg.mods.alibi else 0
  dq = zeros_varying_like(x.q.shape[:-1] + (x.q.shape[-1] + extra,), pol.accum_dtype, x.q, x.kv.k)
  shape_t = x.kv.k.shape[:-2] + x.kv.k.shape[:-3:-1]  # dK and dV travel transposed
  zeros_kv = lambda: (
    zeros_varying_like(shape_t, pol.accum_dtype, x.q, x.kv.k),
    zeros_varying_like(shape_t, pol.accum_dtype, x.q, x.kv.v),
  )

  def compute(kv, dkv, dq):
    dq, dk, dv = chunk_backward(cfg.mask, pol, qb, dq, _as_compute(kv, pol), *dkv, cfg.mods, x.args)
    return dq, (dk, dv)

  compute = _quadrant_backward(cfg, qb, x.args) if cfg.quadrants else compute
  # Halves of whole blocks; by quadrants, halves of an even number of blocks each.
  nk = x.kv.k.shape[0]
  cut = lambda kv, i: _traveling(jax.tree.map(lambda a: _half(a, i, 0), kv))
  own = own_halves(cfg, x.kv, cut, zeros_kv, 0, nk, 2 if cfg.quadrants else 1)
  (dk, dv), dq = _backward_passes(cfg, compute, _traveling(x.kv), zeros_kv, dq, own)
  untranspose = lambda x: jnp.swapaxes(x, -1, -2)
  scale = jnp.asarray(cfg.scale, pol.accum_dtype)
  if extra:  # the slope column lacks no scale
    h = x.q.shape[-1]
    return jnp.concatenate([dq[..., :h] * scale, dq[..., h:]], axis=-1), untranspose(dk), untranspose(dv)
  return dq * scale, untranspose(dk), untranspose(dv)


# Quadrants (RingConfig.quadrants): the shard's queries are one block [1, ..., t, ...]
# and its keys `nk` blocks; the zigzag layout puts two chunks of the sequence in each
# shard's halves, so every ring step's 2 x 2 quadrants (query half, key half) are
# each hidden, whole or split by the causal diagonal.
def _split_rows(x, n: int, axis: int):
  """A one-block array [1, ..., t (at `axis`, counted from the end), ...] as a list of
  n blocks [..., t / n, ...] of consecutive rows (without the leading 1)."""
  y = x[0]
  at, size = y.ndim + axis, y.shape[axis] // n
  return [lax.slice_in_dim(y, i * size, (i + 1) * size, axis=at) for i in range(n)]


def _joined_rows(parts, axis: int):
  """Inverse of `_split_rows`."""
  return jnp.concatenate(parts, axis=parts[0].ndim + axis)[None]


def _diagonal_blocks(t: int) -> int:
  """How many query blocks (`_split_rows`) a shard of t tokens takes in a step that is
  not one rectangle: at most 8 of 256 rows or more where they divide the halves, else
  the halves. As lists, no step slices or stacks them."""
  size = max(256, t // 8)
  return t // size if (t // 2) % size == 0 else 2


def _second_half(x, axis: int):
  """Rows [t / 2, t) of a one-block array, kept one block."""
  t = x.shape[axis]
  return lax.slice_in_dim(x, t // 2, t, axis=x.ndim + axis)


def _put_second_half(x, half, axis: int):
  """x with `_second_half` replaced by `half`."""
  return lax.dynamic_update_slice_in_dim(x, half, x.shape[axis] - half.shape[axis], axis=x.ndim + axis)


def _quadrant_kind(spec: MaskSpec, q_halves: Bounds, k_pos):
  """What a ring step computes, from the bounds of the query halves and the key
  positions [nk, bk]: 1 when every query sees exactly the first half of the keys, all
  of it (a rectangle without masks); 2 when the second half of the queries sees all
  the keys and the first half none; else 0 (every tile by its class, masked where it
  must be). Exact for any positions: 1 and 2 are sufficient conditions."""
  k_halves = block_bounds(k_pos.reshape(2, -1), None, spec.has_padding)
  c = jax.vmap(lambda q: jax.vmap(lambda k: tile_class(spec, q, k))(k_halves))(q_halves)  # [q half, k half]
  whole, hidden = c == 2, c == 0
  keys_first = whole[0, 0] & whole[1, 0] & hidden[0, 1] & hidden[1, 1]
  queries_second = hidden[0, 0] & hidden[0, 1] & whole[1, 0] & whole[1, 1]
  return jnp.where(keys_first, 1, jnp.where(queries_second, 2, 0))


# Where the rows of each array of the forward state and of QBlocks are (from the end).
_STATE_ROWS = (-2, -1, -1)
_QBLOCK_ROWS = dict(q=-2, q_t=-1, do=-2, do_t=-1, lse=-1, delta=-1, pos=-1)


def _quadrant_forward(cfg: RingConfig, x: Inputs):
  """The forward step `compute(kv, acc)` by quadrants."""
  pol = cfg.policy
  t = x.q.shape[-2]
  n = _diagonal_blocks(t)
  q_n, pos_n = _split_rows(x.q, n, -2), x.q_pos.reshape(n, -1)
  bounds_n = block_bounds(pos_n, None)
  bounds_h = block_bounds(x.q_pos.reshape(2, -1), None)
  q_2, pos_2 = _second_half(x.q, -2), _second_half(x.q_pos, -1)

  def compute(kv, acc):
    kv = _as_compute(kv, pol)
    _, k_pos, _ = kv_reader(kv)
    nk = k_pos.shape[0]

    def by_blocks(acc):
      parts = [_split_rows(a, n, r) for a, r in zip(acc, _STATE_ROWS)]
      out = chunk_forward(cfg.mask, pol, q_n, pos_n, None, bounds_n, kv, list(zip(*parts)), cfg.mods, x.args)
      return tuple(_joined_rows(list(a), r) for a, r in zip(zip(*out), _STATE_ROWS))

    def keys_first(acc):
      return dense_forward(pol, x.q, x.q_pos, kv, acc, cfg.mods, x.args, range(nk // 2))

    def queries_second(acc):
      part = tuple(_second_half(a, r) for a, r in zip(acc, _STATE_ROWS))
      out = dense_forward(pol, q_2, pos_2, kv, part, cfg.mods, x.args)
      return tuple(_put_second_half(a, o, r) for a, o, r in zip(acc, out, _STATE_ROWS))

    kind = _quadrant_kind(cfg.mask, bounds_h, k_pos)
    return lax.switch(kind, (by_blocks, keys_first, queries_second), acc)

  return compute


def _quadrant_backward(cfg: RingConfig, qb: QBlocks, args):
  """The backward step `compute(kv, dkv, dq)` by quadrants."""
  pol = cfg.policy
  t = qb.q.shape[-2]
  n = _diagonal_blocks(t)
  split = {name: _split_rows(getattr(qb, name), n, r) for name, r in _QBLOCK_ROWS.items() if name != "pos"}
  pos_n = qb.pos.reshape(n, -1)
  qb_n = qb._replace(**split, pos=pos_n, seg=None, bounds=block_bounds(pos_n, None))
  bounds_h = block_bounds(qb.pos.reshape(2, -1), None)
  qb_2 = qb._replace(
    **{name: _second_half(getattr(qb, name), r) for name, r in _QBLOCK_ROWS.items()}, seg=None
  )

  def compute(kv, dkv, dq):
    kv = _as_compute(kv, pol)
    _, k_pos, _ = kv_reader(kv)
    nk = k_pos.shape[0]

    def by_blocks(dq, dk, dv):
      dq_n, dk, dv = chunk_backward(cfg.mask, pol, qb_n, _split_rows(dq, n, -2), kv, dk, dv, cfg.mods, args)
      return _joined_rows(dq_n, -2), dk, dv

    def keys_first(dq, dk, dv):
      return dense_backward(pol, qb, dq, kv, dk, dv, cfg.mods, args, range(nk // 2))

    def queries_second(dq, dk, dv):
      part, dk, dv = dense_backward(pol, qb_2, _second_half(dq, -2), kv, dk, dv, cfg.mods, args)
      return _put_second_half(dq, part, -2), dk, dv

    kind = _quadrant_kind(cfg.mask, bounds_h, k_pos)
    dq, dk, dv = lax.switch(kind, (by_blocks, keys_first, queries_second), dq, *dkv)
    return dq, (dk, dv)

  return compute


# The Pallas kernels take heads before rows, unblocked: q [B, N, T, H] (N = K * G, head
# k * G + g), k, v [B, K, S, H], positions [T], ids [B, T]. The ring's inputs are
# converted once per call, and the K/V shards travel the ring in that layout.
def _q_natural(x):
  """[nq, B, K, G, bq, ...] -> [B, K * G, nq * bq, ...]."""
  nq, b, kh, g, bq = x.shape[:5]
  x = jnp.moveaxis(x, 0, 3)  # [B, K, G, nq, bq, ...]
  return x.reshape(b, kh * g, nq * bq, *x.shape[5:])


def _q_blocked(x, like):
  """Inverse of _q_natural, to the blocked shape of `like` [nq, B, K, G, bq, ...]."""
  nq, b, kh, g, bq = like.shape[:5]
  return jnp.moveaxis(x.reshape(b, kh, g, nq, bq, *x.shape[3:]), 3, 0)


def _seg_natural(seg):
  """Blocked ids [n, B, b] -> [B, n * b]; None stays None."""
  return None if seg is None else jnp.moveaxis(seg, 0, 1).reshape(seg.shape[1], -1)


def _kv_natural(kv: KVBlocks) -> KVBlocks:
  """Blocks [nk, B, K, bk, H] -> [B, K, S, H]; positions [S]; ids [B, S]."""
  unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1], x.shape[2], -1, x.shape[4])
  return KVBlocks(unblock(kv.k), unblock(kv.v), kv.pos.reshape(-1), _seg_natural(kv.seg))


def _kv_blocked(x, block: int):
  """[B, K, S, H] -> [nk, B, K, bk, H]."""
  b, kh, s, h = x.shape
  return jnp.moveaxis(x.reshape(b, kh, s // block, block, h), 2, 0)


def _pallas_args(x: Inputs):
  """(q, q positions, q ids, K/V) of this device in the kernels' layout."""
  return _q_natural(x.q), x.q_pos.reshape(-1), _seg_natural(x.q_seg), _kv_natural(x.kv)


# Which kernels run interpreted where the program is lowered for CPU: "gpu" (`_pallas`)
# or "tpu" (`_mosaic`, which tests select by setting this).
INTERPRET_STYLE = "gpu"


def _run_kernel(name: str, *args, **options):
  """The kernel `name` ("forward" or "backward") per platform the program is lowered
  for: Triton (`_pallas`) on CUDA and ROCm, Mosaic (`_mosaic`) on TPU where the blocks
  suit it, interpreted on CPU. So one traced program runs on a CPU mesh and exports
  for a GPU or TPU (`jax.export`)."""
  gpu, tpu = getattr(_pallas, name), getattr(_mosaic, name)
  run = lambda kernel, interpret: functools.partial(kernel, interpret=interpret, **options)
  branches = dict(cuda=run(gpu, False), rocm=run(gpu, False))
  q, k = args[:2]
  if _mosaic.blocks_problem(q.shape[2], k.shape[2], options["block_q"], options["block_k"]) is None:
    branches["tpu"] = run(tpu, False)
  branches["cpu"] = run(tpu if INTERPRET_STYLE == "tpu" else gpu, True)
  return lax.platform_dependent(*args, **branches)


def _kernel_options(cfg: RingConfig):
  return dict(
    spec=cfg.mask,
    block_q=cfg.block_q,
    block_k=cfg.block_kv,
    precision=cfg.policy.precision,
  )


def _pallas_forward_state(cfg: RingConfig, x: Inputs):
  """ring_forward_state with the Pallas kernel: each step's (out, lse) merged exactly
  into the running pair."""
  q, q_pos, q_seg, kv = _pallas_args(x)
  opts = _kernel_options(cfg)
  out = zeros_from(q, jnp.float32, x.kv.k)
  lse = jnp.full_like(out, -jnp.inf, shape=q.shape[:-1])

  # A step merges the previous step's kernel result and then runs its own kernel, so
  # the kernel is the step's last compute: XLA's TPU scheduler, which starts a
  # transfer as late as its estimate of the transfer's time allows, would otherwise
  # start it after the kernel and hide it under the merge alone (v5p, v6e).
  def compute(kv, acc):
    merged = merge_local(*zip(acc[:2], acc[2:]))
    kv = _as_compute(kv, cfg.policy)
    return (*merged, *_run_kernel("forward", q, kv.k, kv.v, q_pos, kv.pos, q_seg, kv.seg, **opts))

  out, lse, *last = _forward_passes(cfg, compute, kv, (out, lse, out, lse))
  out, lse = merge_local(*zip((out, lse), last))
  return _q_blocked(out, x.q), _q_blocked(lse, x.q)


def _pallas_backward_state(cfg: RingConfig, x: Inputs, do, lse, delta):
  """ring_backward_state with the Pallas kernel."""
  q, q_pos, q_seg, kv = _pallas_args(x)
  opts = _kernel_options(cfg)
  do, lse, delta = _q_natural(do), _q_natural(lse), _q_natural(delta)
  dq = zeros_varying_like(q.shape, jnp.float32, x.q, x.kv.k)
  zeros_kv = lambda: (
    zeros_varying_like(kv.k.shape, jnp.float32, x.q, x.kv.k),
    zeros_varying_like(kv.v.shape, jnp.float32, x.q, x.kv.v),
  )

  def compute(kv, dkv, dq):
    kv = _as_compute(kv, cfg.policy)
    args = (q, kv.k, kv.v, do, lse, delta, q_pos, kv.pos, q_seg, kv.seg)
    gq, gk, gv = _run_kernel("backward", *args, **opts)
    return dq + gq, (dkv[0] + gk, dkv[1] + gv)

  cut = lambda kv, i: KVBlocks(
    _half(kv.k, i, 2), _half(kv.v, i, 2), _half(kv.pos, i, 0), None if kv.seg is None else _half(kv.seg, i, 1)
  )
  own = own_halves(cfg, kv, cut, zeros_kv, 2, kv.k.shape[2], cfg.block_kv)
  (dk, dv), dq = _backward_passes(cfg, compute, kv, zeros_kv, dq, own)
  scale = jnp.asarray(cfg.scale, jnp.float32)
  return _q_blocked(dq, x.q) * scale, _kv_blocked(dk, cfg.block_kv), _kv_blocked(dv, cfg.block_kv)


def cudnn_problem(
  *, is_causal, window, has_padding, segments, layout, custom, t, s, mods, lse_out, ring_size=2
):
  """Why cuDNN cannot run this call's ring steps (None: it can). Each step must be one
  rectangle of its queries and keys under cuDNN's masks (`_cudnn_kinds`): the
  contiguous and zigzag layouts give that for causal attention and every layout for
  full attention; a causal window needs the contiguous layout (its edge is then on the
  diagonal step, which cuDNN's sliding window takes, or on a step whose offset is known
  when tracing, which runs in XLA: `_edge_rectangle`), and documents (segment ids) need
  causal attention (each step then sees at most one document of its keys' earlier
  shard, or the diagonal's own: `_step_sequences`). On a ring of one device every
  layout is contiguous."""
  if has_padding:
    return (
      "padding (a length the layout does not divide, or per-row lengths): cuDNN's masks take no positions"
    )
  if mods.active:
    return f"cuDNN does not apply {', '.join(mods.names())} (the XLA tiles do)"
  if lse_out:
    return "the lse is an output (return_residual or sinks): cuDNN's backward takes no cotangent for it"
  if is_causal and (custom or layout not in ("contiguous", "zigzag")):
    how = "custom positions" if custom else f"the {layout} layout"
    return (
      f"causal attention with {how}: only the contiguous and zigzag layouts make each step one cuDNN call"
    )
  if is_causal and t != s:
    return f"causal attention with key length {s} != query length {t}"
  if window is not None and not is_causal:
    return "local_window_size without is_causal: cuDNN's sliding window looks back only"
  if window is not None and layout != "contiguous" and ring_size > 1:
    return f"local_window_size with the {layout} layout: cuDNN's window runs in the contiguous layout"
  if segments and not is_causal:
    return "segment ids without is_causal: cuDNN's packed documents run under the causal mask here"
  return None


class _Kind(NamedTuple):
  """One call of a cuDNN ring step: the rectangle of its query rows ("all", "first" or
  "second" half) and key rows, and its mask ("whole": every query sees every key;
  "causal": query row i sees key row j <= i, cuDNN's CAUSAL aligned at the top left,
  and the window back from it). `edge`: the offset of the step's first query position
  from its first key's, for a step whose window edge crosses it (run in XLA)."""

  name: str
  rows_q: str | None
  rows_k: str | None
  causal: bool
  edge: int | None = None


# A cuDNN ring step is one call on one rectangle of the step's (queries, keys), chosen
# from the positions (`_cudnn_kind`). Queries and keys are in ascending positions within
# a shard in the contiguous and zigzag layouts (`cudnn_problem`), which makes "causal" on
# rows the causal mask on positions.
_CUDNN_KINDS = (
  _Kind("hidden", None, None, False),
  _Kind("whole", "all", "all", False),
  _Kind("keys_first", "all", "first", False),  # zigzag: the shard's keys are earlier, by one chunk
  _Kind("queries_second", "second", "all", False),  # zigzag: the shard's keys are later, by one chunk
  _Kind("causal", "all", "all", True),  # the own shard (its queries' positions are its keys')
  _Kind("causal_second", "second", "all", True),  # the later half of the own keys (OwnHalves)
)
# Documents per cuDNN call on the diagonal step: more run in further calls, this many at
# a time (cuDNN's statistics of a packed call take [B * this, heads, T] floats).
MAX_DOCUMENTS = 16


def _cudnn_kinds(cfg: RingConfig, t: int) -> tuple[_Kind, ...]:
  """The kinds of this call's steps: `_CUDNN_KINDS`, and under a causal window in the
  contiguous layout one "edge" kind per ring step (offset j * t) that the window's
  edge crosses."""
  kinds = list(_CUDNN_KINDS)
  if cfg.mask.window is not None and cfg.mask.is_causal:
    left = cfg.mask.window[0]
    for j in range(1, cfg.steps_back + 1):
      d = j * t
      if d + t - 1 > left and d - t + 1 <= left:
        kinds.append(_Kind("edge", "all", "all", False, d))
  edges = [k.edge for k in kinds if k.edge is not None]
  if edges:
    rows, first = min((_edge_rectangle(k, left, t) for k in kinds if k.edge is not None), key=lambda r: r[1])
    logging.getLogger("jax_ring").info(
      "jax_ring: cuDNN runs every ring step but those whose queries start %s positions after their keys: "
      "the window's edge crosses them, which cuDNN's sliding window (counted back from each call's own "
      "diagonal) cannot say; they run in XLA on at most %d x %d scores a head",
      " or ".join(map(str, edges)),
      rows,
      t - first,
    )
  return tuple(kinds)


def _edge_rectangle(kind: _Kind, left: int, t: int):
  """(query rows, first key row) of an edge step that can see anything: the window
  shows query row i the key rows from i + offset - left on."""
  delta = kind.edge - left
  return min(t, t - delta), max(0, delta)


def _rows(x, which: str, axis: int = 2):
  """All rows of x along `axis`, its first half or its second half."""
  n = x.shape[axis]
  match which:
    case "all":
      return x
    case "first":
      return lax.slice_in_dim(x, 0, n // 2, axis=axis)
    case "second":
      return lax.slice_in_dim(x, n // 2, n, axis=axis)
  raise ValueError(f"Unsupported rows {which!r}")


def _put_rows(x, which: str, new, axis: int = 2):
  """x with `_rows(x, which)` replaced by `new`."""
  if which == "all":
    return new
  start = 0 if which == "first" else x.shape[axis] - new.shape[axis]
  return lax.dynamic_update_slice_in_dim(x, new, start, axis=axis)


def _cudnn_kind(cfg: RingConfig, kinds, q_pos, k_pos):
  """The index in `kinds` of the one call a step runs, from the positions of its
  queries [T] and keys [S]: each kind's condition is that its rectangle is exactly what
  the causal mask and the window let through (an edge kind: that the step's offset is
  its own). None matching (which the admitted layouts never give) is len(kinds): the
  step's output is NaN, never a wrong number. Full attention is always "whole" (a
  Python int)."""
  if not cfg.mask.is_causal:
    return 1
  t, s = q_pos.shape[0], k_pos.shape[0]
  lo, hi = jnp.min, jnp.max
  half = lambda x, which: _rows(x, which, axis=0)
  left = None if cfg.mask.window is None else cfg.mask.window[0]

  def seen(q, k):  # the window shows every query of q every key of k
    return True if left is None else hi(q) - lo(k) <= left

  hidden = hi(q_pos) < lo(k_pos)
  if left is not None:
    hidden = hidden | (lo(q_pos) - hi(k_pos) > left)
  conditions = [
    hidden,
    (lo(q_pos) >= hi(k_pos)) & seen(q_pos, k_pos),
    (lo(q_pos) >= hi(half(k_pos, "first")))
    & (hi(q_pos) < lo(half(k_pos, "second")))
    & seen(q_pos, half(k_pos, "first"))
    if s % 2 == 0
    else False,
    (hi(half(q_pos, "first")) < lo(k_pos))
    & (lo(half(q_pos, "second")) >= hi(k_pos))
    & seen(half(q_pos, "second"), k_pos)
    if t % 2 == 0
    else False,
  ]
  if s <= t:
    later = q_pos[s:]
    conditions.append(jnp.all(q_pos[:s] == k_pos) & (True if s == t else lo(later) >= hi(k_pos)))
  else:
    conditions.append(False)
  if 2 * s == t:
    conditions.append(jnp.all(half(q_pos, "second") == k_pos) & (hi(half(q_pos, "first")) < lo(k_pos)))
  else:
    conditions.append(False)
  for kind in kinds[len(conditions) :]:  # edges: contiguous shards at the kind's offset
    conditions.append((q_pos[0] - k_pos[0] == kind.edge) & (t == s))
  index = jnp.int32(len(kinds))
  for i in reversed(range(len(conditions))):
    index = jnp.where(conditions[i], i, index)
  return index


def _cudnn_branches(kinds, t: int, s: int):
  """The kinds a step of t queries against s keys may be (the others' rectangles do
  not exist at these lengths): indices into `kinds`, for `lax.switch`."""
  usable = []
  for i, kind in enumerate(kinds):
    if (kind.rows_q == "second" and t % 2) or (kind.rows_k == "first" and s % 2):
      continue
    if kind.name == "causal" and s > t or kind.name == "causal_second" and 2 * s != t:
      continue
    if kind.name == "edge" and s != t:
      continue
    usable.append(i)
  return usable


def _cudnn_step(kinds, kind, run, hidden, *args):
  """run(kind's call) through `lax.switch` over the kinds a step can be, `hidden(*args)`
  for no call, and NaNs where no kind matched."""
  if isinstance(kind, int):
    return run(kinds[kind], *args)
  t, s = args[0].shape[2], args[1].shape[2]
  usable = _cudnn_branches(kinds, t, s)
  branches = [hidden if i == 0 else functools.partial(run, kinds[i]) for i in usable]
  branches.append(lambda *a: jax.tree.map(lambda x: x * jnp.nan, hidden(*a)))
  index = jnp.full((len(kinds) + 1,), len(usable), jnp.int32)
  index = index.at[jnp.asarray(usable)].set(jnp.arange(len(usable), dtype=jnp.int32))
  return lax.switch(index[kind], branches, *args)


# --- Documents (segment ids) in cuDNN's steps. ---
#
# Each document is one run of equal ids, in position order (`_documents_contiguous`
# checks it once per call; otherwise the output is NaN). A diagonal step ("causal"
# kinds: queries and keys are the same tokens) is then one packed call whose sequences
# are the rows' runs; a step whose keys all come before its queries ("whole" kinds)
# shares at most one document between them, the queries' first run and the keys' last.


def _runs(seg, first, count: int):
  """(starts, lengths) [B, count] of runs first, ..., first + count - 1 (in row order)
  of equal non-negative ids in seg [B, T] (`first` [B, 1] or an int); -1 past the
  last run."""
  t = seg.shape[1]
  valid = seg >= 0
  differs = seg[:, 1:] != seg[:, :-1]
  edge = jnp.ones_like(seg[:, :1], bool)
  starts = valid & jnp.concatenate([edge, differs], axis=1)
  ends = valid & jnp.concatenate([differs, edge], axis=1)
  rank = jnp.cumsum(starts, axis=1) - 1  # the run each row belongs to
  chosen = (rank >= first) & (rank < first + count)
  begin, end = _nth_true(starts & chosen, count), _nth_true(ends & chosen, count)
  del t
  return begin, jnp.where(begin >= 0, end - begin + 1, -1)


def _nth_true(mask, count: int):
  """[B, T] -> [B, count]: the positions of each row's first `count` true entries, -1
  past its last. Comparisons, not `jnp.nonzero`'s scatter: XLA:CPU makes a scatter a
  loop, and these run in every cuDNN step's branches."""
  rank = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, -1)  # [B, T]
  hit = rank[:, None, :] == jnp.arange(count, dtype=rank.dtype)[None, :, None]  # [B, count, T]
  return jnp.where(jnp.any(hit, axis=2), jnp.argmax(hit, axis=2), -1).astype(jnp.int32)


def _run_count(seg):
  """Runs of equal non-negative ids per row [B]."""
  differs = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return jnp.sum((seg >= 0) & differs, axis=1)


def _with_end(offsets):
  """[B, M] -> [B, M + 1]: cuDNN's offsets have one entry more."""
  return jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)


def _diagonal_sequences(seg, group: int):
  """The packed call of runs [group * MAX_DOCUMENTS, ...) of a diagonal step's rows."""
  start, length = _runs(seg, group * MAX_DOCUMENTS, MAX_DOCUMENTS)
  return _cudnn.Sequences(length, length, _with_end(start), _with_end(start))


def _shared_sequence(q_seg, k_seg):
  """(the packed call of the one document the queries' first run and the keys' last run
  share, whether any row has one [B])."""
  q_start, q_len = _runs(q_seg, 0, 1)
  k_start, k_len = _runs(k_seg, _run_count(k_seg)[:, None] - 1, 1)
  ids = lambda seg, start: jnp.take_along_axis(seg, jnp.maximum(start, 0), axis=1)
  shared = (q_start >= 0) & (k_start >= 0) & (ids(q_seg, q_start) == ids(k_seg, k_start))
  none = jnp.full_like(q_len, -1)
  two = lambda x: jnp.concatenate([jnp.where(shared, x, -1), none], axis=1)  # cuDNN packs 2 or more
  seqs = _cudnn.Sequences(two(q_len), two(k_len), _with_end(two(q_start)), _with_end(two(k_start)))
  return seqs, jnp.any(shared)


def _documents_contiguous(cfg: RingConfig, q_seg, q_pos):
  """[B] bool: each row's documents (non-negative ids) are each one run in position
  order over the whole ring, which the cuDNN steps assume (`_step_sequences`)."""
  ids = lax.all_gather(q_seg, cfg.axis_name)  # [A, B, T]
  pos = lax.all_gather(q_pos, cfg.axis_name)  # [A, T]
  if cfg.axis_size and cfg.axis_size > cfg.ring_size:  # this device's sub-ring
    first = lax.axis_index(cfg.axis_name) // cfg.ring_size * cfg.ring_size
    ids = lax.dynamic_slice_in_dim(ids, first, cfg.ring_size, axis=0)
    pos = lax.dynamic_slice_in_dim(pos, first, cfg.ring_size, axis=0)
  b = ids.shape[1]
  order = jnp.argsort(pos.reshape(-1))
  ids = jnp.moveaxis(ids, 1, 0).reshape(b, -1)[:, order]
  ranked = jnp.sort(jnp.where(ids >= 0, ids, -1), axis=1)
  distinct = _run_count(ranked)
  return _run_count(ids) == distinct


def _step_sequences(kind: _Kind, q_seg, k_seg):
  """For a "whole" kind with documents: (its packed call, whether to call at all)."""
  return _shared_sequence(_rows(q_seg, kind.rows_q, 1), _rows(k_seg, kind.rows_k, 1))


def _diagonal_groups(q_seg):
  """Packed calls a diagonal step needs: ceil(runs / MAX_DOCUMENTS), at least 1."""
  return jnp.maximum(1, -(-jnp.max(_run_count(q_seg)) // MAX_DOCUMENTS))


def _edge_mask(cfg: RingConfig, kind: _Kind, q_pos, k_pos, q_seg, k_seg):
  """(query rows, first key row, mask [B or 1, rows, keys]) of an edge step."""
  left = cfg.mask.window[0]
  rows, first = _edge_rectangle(kind, left, q_pos.shape[0])
  qp, kp = q_pos[:rows], k_pos[first:]
  seen = ((kp[None] <= qp[:, None]) & (qp[:, None] - kp[None] <= left))[None]
  if q_seg is not None:
    qs, ks = q_seg[:, :rows], k_seg[:, first:]
    seen = seen & (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] >= 0)
  return rows, first, seen


def _cudnn_window(cfg: RingConfig):
  return None if cfg.mask.window is None else cfg.mask.window[0]


def _cudnn_forward_state(cfg: RingConfig, x: Inputs):
  """ring_forward_state with cuDNN's fused attention: each step one call (`_cudnn_kinds`),
  its (out, lse) in float32 merged exactly into the running pair's rows it covers."""
  q, q_pos, q_seg, kv = _pallas_args(x)
  out = zeros_from(q, jnp.float32, x.kv.k)
  lse = jnp.full_like(out, -jnp.inf, shape=q.shape[:-1])
  kinds = _cudnn_kinds(cfg, q.shape[2])
  window = _cudnn_window(cfg)

  def merge(out, lse, rows_q, o, l):
    mo, ml = merge_local([_rows(out, rows_q), o], [_rows(lse, rows_q), l])
    return _put_rows(out, rows_q, mo), _put_rows(lse, rows_q, ml)

  def run(kind, q, k, v, k_pos, k_seg, out, lse):
    rq, rk = kind.rows_q, kind.rows_k
    if kind.name == "edge":
      rows, first, seen = _edge_mask(cfg, kind, q_pos, k_pos, q_seg, k_seg)
      o, l = _cudnn.dense_forward(q[:, :, :rows], k[:, :, first:], v[:, :, first:], seen)
      mo, ml = merge_local([out[:, :, :rows], o], [lse[:, :, :rows], l])
      return out.at[:, :, :rows].set(mo), lse.at[:, :, :rows].set(ml)
    qs, ks, vs = _rows(q, rq), _rows(k, rk), _rows(v, rk)
    if q_seg is None:
      o, l = _cudnn.forward(qs, ks, vs, causal=kind.causal, window=window if kind.causal else None)
      return merge(out, lse, rq, o, l)
    if kind.causal:  # the diagonal: its documents, MAX_DOCUMENTS a call
      seg = _rows(q_seg, rq, 1)

      def group(g, acc):
        o, l = _cudnn.forward(qs, ks, vs, causal=True, window=window, seqs=_diagonal_sequences(seg, g))
        return merge(*acc, rq, o, l)

      return lax.fori_loop(0, _diagonal_groups(seg), group, (out, lse))
    seqs, any_shared = _step_sequences(kind, q_seg, k_seg)
    call = lambda acc: merge(*acc, rq, *_cudnn.forward(qs, ks, vs, causal=False, seqs=seqs))
    return lax.cond(any_shared, call, lambda acc: acc, (out, lse))

  def compute(kv, acc):
    kv = _as_compute(kv, cfg.policy)
    kind = _cudnn_kind(cfg, kinds, q_pos, kv.pos)
    hidden = lambda q, k, v, k_pos, k_seg, out, lse: (out, lse)
    return _cudnn_step(kinds, kind, run, hidden, q, kv.k, kv.v, kv.pos, kv.seg, *acc)

  out, lse = _forward_passes(cfg, compute, kv, (out, lse))
  return _q_blocked(out, x.q), _q_blocked(lse, x.q)


def _cudnn_backward_state(cfg: RingConfig, x: Inputs, do, lse, out):
  """ring_backward_state with cuDNN's fused attention: each step's call's backward from
  the global output and lse, its dq, dk and dv added in float32 to the rows it covers."""
  q, q_pos, q_seg, kv = _pallas_args(x)
  do, lse, out = _q_natural(do), _q_natural(lse), _q_natural(out)
  dq = zeros_varying_like(q.shape, jnp.float32, x.q, x.kv.k)
  zeros_kv = lambda: (
    zeros_varying_like(kv.k.shape, jnp.float32, x.q, x.kv.k),
    zeros_varying_like(kv.v.shape, jnp.float32, x.q, x.kv.v),
  )
  kinds = _cudnn_kinds(cfg, q.shape[2])
  window = _cudnn_window(cfg)
  add = lambda acc, rows, g: _put_rows(acc, rows, _rows(acc, rows) + g)

  def run(kind, q, k, v, k_pos, k_seg, dq, dk, dv):
    rq, rk = kind.rows_q, kind.rows_k
    if kind.name == "edge":
      rows, first, seen = _edge_mask(cfg, kind, q_pos, k_pos, q_seg, k_seg)
      cut = lambda a: a[:, :, :rows]
      gq, gk, gv = _cudnn.dense_backward(
        cut(q), k[:, :, first:], v[:, :, first:], cut(out), cut(do), lse[:, :, :rows], seen
      )
      return dq.at[:, :, :rows].add(gq), dk.at[:, :, first:].add(gk), dv.at[:, :, first:].add(gv)
    qs = lambda a: _rows(a, rq)
    ins = (qs(q), _rows(k, rk), _rows(v, rk), qs(out), qs(do), qs(lse))

    def call(acc, **options):
      dq, dk, dv = acc
      gq, gk, gv = _cudnn.backward(*ins, **options)
      return add(dq, rq, gq), add(dk, rk, gk), add(dv, rk, gv)

    if q_seg is None:
      return call((dq, dk, dv), causal=kind.causal, window=window if kind.causal else None)
    if kind.causal:
      seg = _rows(q_seg, rq, 1)
      group = lambda g, acc: call(acc, causal=True, window=window, seqs=_diagonal_sequences(seg, g))
      return lax.fori_loop(0, _diagonal_groups(seg), group, (dq, dk, dv))
    seqs, any_shared = _step_sequences(kind, q_seg, k_seg)
    return lax.cond(any_shared, lambda acc: call(acc, causal=False, seqs=seqs), lambda acc: acc, (dq, dk, dv))

  def compute(kv, dkv, dq):
    kv = _as_compute(kv, cfg.policy)
    kind = _cudnn_kind(cfg, kinds, q_pos, kv.pos)
    hidden = lambda q, k, v, k_pos, k_seg, dq, dk, dv: (dq, dk, dv)
    dq, dk, dv = _cudnn_step(kinds, kind, run, hidden, q, kv.k, kv.v, kv.pos, kv.seg, dq, *dkv)
    return dq, (dk, dv)

  cut = lambda kv, i: KVBlocks(
    _half(kv.k, i, 2), _half(kv.v, i, 2), _half(kv.pos, i, 0), None if kv.seg is None else _half(kv.seg, i, 1)
  )
  own = own_halves(cfg, kv, cut, zeros_kv, 2, kv.k.shape[2], 1)
  (dk, dv), dq = _backward_passes(cfg, compute, kv, zeros_kv, dq, own)
  scale = jnp.asarray(cfg.scale, jnp.float32)
  return _q_blocked(dq, x.q) * scale, _kv_blocked(dk, cfg.block_kv), _kv_blocked(dv, cfg.block_kv)


def _head_groups(cfg: RingConfig, q, k):
  """(number of groups, query heads per group, kv heads per group)."""
  groups = cfg.head_groups
  return groups, q.shape[2] // groups, k.shape[2] // groups


def _heads(x, j, width: int):
  """Heads [j * width, (j + 1) * width) of x [B, T, heads, ...] (j may be traced)."""
  return lax.dynamic_slice_in_dim(x, j * width, width, axis=2)


def _scheduled(cfg: RingConfig, pick, run):
  """run(cfg), or with `cfg.schedules`, run with the schedule `pick` names (an int32
  scalar the same on every device: the branch's collectives are matched on all)."""
  if cfg.schedules is None:
    return run(cfg)
  configs = [dataclasses.replace(cfg, steps_back=b, steps_fwd=f, schedules=None) for b, f in cfg.schedules]
  return lax.switch(pick, [functools.partial(run, c) for c in configs])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg, args: ScoreArgs | None = None, pick=None):
  """Ring attention of this device's q [B, T, N, H] against every device's k, v
  [B, S, K, H], positions [T] / [S] and segment ids [B, T] / [B, S] (or None).

  Returns (out [B, T, N, H] in the policy's output dtype, lse [B, T, N] in the
  accumulation dtype, -inf where a query sees no key). Both are differentiable: the
  cotangent of lse enters the backward as a shift of delta. `args`: the score
  modifiers' arrays (`cfg.mods`) for these query heads; of them, the ALiBi slopes
  get a gradient (summed over the ring's devices unless they vary over it). `pick`:
  with `cfg.schedules`, which of them runs (`_documents.runtime_pick`)."""
  outputs, _ = _ring_fwd(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg, args, pick)
  return outputs


class _Residuals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  out: jax.Array  # in the policy's delta dtype
  lse: jax.Array  # [B, T, N]
  q_pos: jax.Array
  k_pos: jax.Array
  q_seg: jax.Array | None
  k_seg: jax.Array | None
  args: ScoreArgs | None
  pick: jax.Array | None


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, k_pos, q_seg, k_seg, args=None, pick=None):
  # Head groups run one after another, so the ring's buffers (blocked copies, K/V in
  # flight, accumulators) hold one group's heads at a time.
  groups, wq, wk = _head_groups(cfg, q, k)
  pol = cfg.policy
  b, t = q.shape[:2]

  def group(carry, j):
    out, lse = carry
    x = prepare(
      cfg,
      _heads(q, j, wq),
      _heads(k, j, wk),
      _heads(v, j, wk),
      q_pos,
      k_pos,
      q_seg,
      k_seg,
      group_args(args, j * wq, wq),
    )
    o, l = expose_floored(*_scheduled(cfg, pick, lambda c: ring_forward_state(c, x)))
    o = unblock_q(o).reshape(b, t, wq, q.shape[3])
    l = unblock_rows(l).reshape(b, t, wq)
    put = lambda a, new: lax.dynamic_update_slice_in_dim(a, new.astype(a.dtype), j * wq, axis=2)
    return (put(out, o), put(lse, l)), None

  # The output is kept in the dtype the backward's delta wants (see Policy.exact_delta)
  # and cast once for the caller.
  kept = zeros_varying_like(q.shape, pol.delta_dtype(q.dtype), q, k)
  lse = zeros_varying_like(q.shape[:3], pol.accum_dtype, q, k)
  (kept, lse), _ = lax.scan(group, (kept, lse), jnp.arange(groups))
  if cfg.kernel == "cudnn" and q_seg is not None:  # documents split over the ring: not what the calls assume
    apart = ~_documents_contiguous(cfg, q_seg, q_pos)  # once a call, not once a head group
    kept = jnp.where(apart[:, None, None, None], jnp.nan, kept)
  # Named, so that a rematerialization policy can keep them for the backward instead of
  # running the ring's forward again (jax.checkpoint_policies.save_only_these_names).
  kept = checkpoint_name(kept, "jax_ring.attention_out")
  lse = checkpoint_name(lse, "jax_ring.attention_lse")
  out = kept.astype(pol.out_dtype(q.dtype))
  return (out, lse), _Residuals(q, k, v, kept, lse, q_pos, k_pos, q_seg, k_seg, args, pick)


def _ring_bwd(cfg: RingConfig, res: _Residuals, g):
  pol = cfg.policy
  acc = pol.accum_dtype
  g_out, g_lse = g
  groups, wq, wk = _head_groups(cfg, res.q, res.k)
  # d lse_i / d s_ij = p_ij, so lse's cotangent enters every score gradient as -delta does.
  delta_all = jnp.sum(g_out.astype(acc) * res.out.astype(acc), axis=-1) - g_lse.astype(acc)  # [B, T, N]

  def group(grads, j):
    q, k, v = _heads(res.q, j, wq), _heads(res.k, j, wk), _heads(res.v, j, wk)
    x = prepare(cfg, q, k, v, res.q_pos, res.k_pos, res.q_seg, res.k_seg, group_args(res.args, j * wq, wq))
    nq, b, kh, grp, bq, h = x.q.shape
    do = block_q(_heads(g_out, j, wq).astype(pol.compute_dtype).reshape(b, -1, kh, grp, h), bq)
    rows = lambda r: block_rows(_heads(r, j, wq).reshape(b, -1, kh, grp), bq)
    out = None
    if cfg.kernel == "cudnn":
      out = block_q(_heads(res.out, j, wq).astype(pol.compute_dtype).reshape(b, -1, kh, grp, h), bq)
    backward = lambda c: ring_backward_state(c, x, do, rows(res.lse), rows(delta_all), out)
    gq, gk, gv = _scheduled(cfg, res.pick, backward)
    new = [unblock_q(gq[..., :h] if cfg.mods.alibi else gq).reshape(q.shape), unblock_kv(gk), unblock_kv(gv)]
    widths = [wq, wk, wk]
    if cfg.mods.alibi:  # the rows' shares of d loss / d slope, summed over the rows
      new.append(jnp.sum(unblock_rows(gq[..., h]).reshape(b, -1, wq), axis=1))
      widths.append(wq)
    return tuple(
      lax.dynamic_update_slice_in_dim(a, n.astype(a.dtype), j * w, axis=1 if a.ndim == 2 else 2)
      for a, n, w in zip(grads, new, widths)
    ), None

  zeros = [zeros_varying_like(x.shape, x.dtype, x, res.k) for x in (res.q, res.k, res.v)]
  if cfg.mods.alibi:
    zeros.append(zeros_varying_like(res.args.slopes.shape, acc, res.q, res.k))
  grads, _ = lax.scan(group, tuple(zeros), jnp.arange(groups))
  dq, dk, dv = grads[:3]
  d_args = None
  if cfg.mods.alibi:
    d_slopes = grads[3]
    # One slope serves the queries of every device on the ring: their shares add up,
    # unless each device holds a copy of its own (slopes that vary over the ring axis).
    if cfg.axis_name not in jax.typeof(res.args.slopes).manual_axis_type.varying:
      d_slopes = lax.psum(d_slopes, cfg.axis_name)
    d_args = ScoreArgs(d_slopes.astype(res.args.slopes.dtype), None, None, None)
  return dq, dk, dv, None, None, None, None, d_args, None


ring.defvjp(_ring_fwd, _ring_bwd)
