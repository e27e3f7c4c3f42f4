"""Attention of query blocks against key blocks, with masks from global positions.

Shapes (BTNH legend, blocked): B batch, K kv heads, G = N // K query heads per kv head,
H head dim, bq / bk block lengths, nq / nk numbers of blocks. Heads come before rows,
so every product below is a plain batched matmul over (B, K) with no transposes:

    q blocks   [nq, B, K, G, bq, H]      k, v blocks   [nk, B, K, bk, H]
    q pos      [nq, bq] int32            k pos         [nk, bk] int32 (-1: padding)
    q seg      [nq, B, bq] or None       k seg         [nk, B, bk] or None
    out acc    [nq, B, K, G, bq, H]      row stats     [nq, B, K, G, bq]

Queries arrive multiplied by the softmax scale.

Every (query block, key block) pair that the masks rule out entirely is skipped with
`lax.cond`: no matmul, no exponential.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

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


def _scores(q, k, mask, policy: Policy):
  """Scores [B, K, G, bq, bk] of pre-scaled queries, -inf where masked."""
  s = jnp.einsum(
    "bkgqh,bksh->bkgqs", q, k, precision=policy.precision, preferred_element_type=policy.accum_dtype
  )
  if mask is not None:
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
  return s


def block_update(q, k, v, mask, policy: Policy, o, m, l):
  """Adds one key block to the unnormalized running state of one query block.

  o [B, K, G, bq, H] is the sum of exp(s - m) v so far, m [B, K, G, bq] the running
  row maximum (-inf before any visible key), l the sum of exp(s - m). Normalizing once
  at the end (`finalize`) instead of per block saves a division and a merge per tile.
  """
  s = _scores(q, k, mask, policy)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with no visible key yet
  probs = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(m - m_safe)
  l = l * alpha + jnp.sum(probs, axis=-1)
  pv = jnp.einsum(
    "bkgqs,bksh->bkgqh",
    probs.astype(policy.compute_dtype),
    v,
    precision=policy.precision,
    preferred_element_type=policy.accum_dtype,
  )
  return o * alpha[..., None] + pv, m_new, l


def finalize(o, m, l):
  """(normalized output, lse) from the running state. Rows that saw no key: 0, -inf."""
  seen = l > 0
  safe_l = jnp.where(seen, l, 1.0)
  out = jnp.where(seen[..., None], o / safe_l[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
  return out, lse


def block_backward(q, k, v, do, lse, delta, mask, policy: Policy):
  """Gradients of one block given the final lse and delta = sum(dO * O, -1).

  q is pre-scaled, so the dq returned still lacks the factor `scale`; dk is exact.
  Returns dq [B, K, G, bq, H], dk, dv [B, K, bk, H], all in the accum dtype.
  """
  s = _scores(q, k, mask, policy)
  lse_safe = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
  probs = jnp.exp(s - lse_safe[..., None])
  cd, acc, prec = policy.compute_dtype, policy.accum_dtype, policy.precision
  dv = jnp.einsum("bkgqs,bkgqh->bksh", probs.astype(cd), do, precision=prec, preferred_element_type=acc)
  dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v, precision=prec, preferred_element_type=acc)
  ds = (probs * (dp - delta[..., None])).astype(cd)
  dq = jnp.einsum("bkgqs,bksh->bkgqh", ds, k, precision=prec, preferred_element_type=acc)
  dk = jnp.einsum("bkgqs,bkgqh->bksh", ds, q, precision=prec, preferred_element_type=acc)
  return dq, dk, dv


def chunk_forward(spec: MaskSpec, policy, q, q_pos, q_seg, kv: KVBlocks, acc):
  """Adds the keys of `kv` to the running state (o, m, l) of every query block."""

  def over_q(_, xs):
    qb, qp, qs, state = xs

    def over_k(state, ys):
      kb, vb, kp, ks = ys
      mask = block_mask(spec, qp, kp, qs, ks)
      compute = lambda st: block_update(qb, kb, vb, mask, policy, *st)
      if mask is None:
        return compute(state), None
      return lax.cond(jnp.any(mask), compute, lambda st: st, state), None

    state, _ = lax.scan(over_k, state, tuple(kv))
    return None, state

  _, acc = lax.scan(over_q, None, (q, q_pos, q_seg, acc))
  return acc


class QBlocks(NamedTuple):
  """The per-query-block residuals the backward pass walks over."""

  q: jax.Array
  do: jax.Array
  lse: jax.Array
  delta: jax.Array
  pos: jax.Array
  seg: jax.Array | None


def chunk_backward(spec: MaskSpec, policy, qb: QBlocks, dq, kv: KVBlocks, dk, dv):
  """Adds the gradient contributions of the pair (all query blocks, kv) to dq, dk, dv."""

  def over_k(dq, xs):
    kb, vb, kp, ks, dkb, dvb = xs

    def over_q(carry, ys):
      q, do, l, delta, qp, qs, dqb = ys
      mask = block_mask(spec, qp, kp, qs, ks)

      def compute(dkb, dvb, dqb):
        g_q, g_k, g_v = block_backward(q, kb, vb, do, l, delta, mask, policy)
        return (dkb + g_k, dvb + g_v), dqb + g_q

      def skip(dkb, dvb, dqb):
        return (dkb, dvb), dqb

      if mask is None:
        return compute(*carry, dqb)
      return lax.cond(jnp.any(mask), compute, skip, *carry, dqb)

    (dkb, dvb), dq = lax.scan(over_q, (dkb, dvb), (*qb, dq))
    return dq, (dkb, dvb)

  dq, (dk, dv) = lax.scan(over_k, dq, (*kv, dk, dv))
  return dq, dk, dv
