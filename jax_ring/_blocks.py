"""Attention of query blocks against key blocks, with masks from global positions.

Shapes (BTNH legend, blocked): B batch, K kv heads, G = N // K query heads per kv head,
H head dim, bq / bk block lengths, nq / nk numbers of blocks.

    q blocks   [nq, B, bq, K, G, H]      k, v blocks   [nk, B, bk, K, H]
    q pos      [nq, bq] int32            k pos         [nk, bk] int32 (-1: padding)
    q seg      [nq, B, bq] or None       k seg         [nk, B, bk] or None
    out acc    [nq, B, bq, K, G, H]      lse acc       [nq, B, K, G, bq]

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


def _scores(q, k, mask, scale, policy: Policy):
  s = jnp.einsum(
    "bqkgh,bskh->bkgqs",
    q,
    k,
    precision=policy.precision,
    preferred_element_type=policy.accum_dtype,
  )
  s = s * jnp.asarray(scale, policy.accum_dtype)
  if mask is not None:
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
  return s


def block_forward(q, k, v, mask, scale, policy: Policy):
  """One block: normalized output [B, bq, K, G, H] and lse [B, K, G, bq], both accum dtype.

  Rows that see no key get output 0 and lse -inf.
  """
  s = _scores(q, k, mask, scale, policy)
  row_max = jnp.max(s, axis=-1)
  row_max = jnp.where(jnp.isneginf(row_max), 0.0, row_max)
  probs = jnp.exp(s - row_max[..., None])
  denom = jnp.sum(probs, axis=-1)
  out = jnp.einsum(
    "bkgqs,bskh->bqkgh",
    probs.astype(policy.compute_dtype),
    v,
    precision=policy.precision,
    preferred_element_type=policy.accum_dtype,
  )
  seen = denom > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, denom, 1.0), 0.0)
  out = out * jnp.moveaxis(inv, -1, 1)[..., None]
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
  return out, lse


def merge(out_a, lse_a, out_b, lse_b):
  """Merges two partial softmax results over disjoint key sets (by their denominators)."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w_a = jnp.moveaxis(jnp.exp(lse_a - safe), -1, 1)[..., None]
  w_b = jnp.moveaxis(jnp.exp(lse_b - safe), -1, 1)[..., None]
  return out_a * w_a + out_b * w_b, lse


def block_backward(q, k, v, do, lse, delta, mask, scale, policy: Policy):
  """Gradients of one block given the final lse and delta = sum(dO * O, -1).

  Returns dq [B, bq, K, G, H], dk, dv [B, bk, K, H], all in the accum dtype.
  """
  s = _scores(q, k, mask, scale, policy)
  lse_safe = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
  probs = jnp.exp(s - lse_safe[..., None])
  cd, acc, prec = policy.compute_dtype, policy.accum_dtype, policy.precision
  dv = jnp.einsum("bkgqs,bqkgh->bskh", probs.astype(cd), do, precision=prec, preferred_element_type=acc)
  dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, precision=prec, preferred_element_type=acc)
  ds = (probs * (dp - delta[..., None]) * jnp.asarray(scale, acc)).astype(cd)
  dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k, precision=prec, preferred_element_type=acc)
  dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q, precision=prec, preferred_element_type=acc)
  return dq, dk, dv


def chunk_forward(spec: MaskSpec, scale, policy, q, q_pos, q_seg, kv: KVBlocks, out, lse):
  """Adds the keys of `kv` to the running (out, lse) of every query block."""

  def over_q(_, xs):
    qb, qp, qs, o, l = xs

    def over_k(carry, ys):
      kb, vb, kp, ks = ys
      mask = block_mask(spec, qp, kp, qs, ks)

      def compute(o, l):
        ob, lb = block_forward(qb, kb, vb, mask, scale, policy)
        return merge(o, l, ob, lb)

      if mask is None:
        return compute(*carry), None
      return lax.cond(jnp.any(mask), compute, lambda o, l: (o, l), *carry), None

    (o, l), _ = lax.scan(over_k, (o, l), tuple(kv))
    return None, (o, l)

  _, (out, lse) = lax.scan(over_q, None, (q, q_pos, q_seg, out, lse))
  return out, lse


class QBlocks(NamedTuple):
  """The per-query-block residuals the backward pass walks over."""

  q: jax.Array
  do: jax.Array
  lse: jax.Array
  delta: jax.Array
  pos: jax.Array
  seg: jax.Array | None


def chunk_backward(spec: MaskSpec, scale, policy, qb: QBlocks, dq, kv: KVBlocks, dk, dv):
  """Adds the gradient contributions of the pair (all query blocks, kv) to dq, dk, dv."""

  def over_k(dq, xs):
    kb, vb, kp, ks, dkb, dvb = xs

    def over_q(carry, ys):
      q, do, l, delta, qp, qs, dqb = ys
      mask = block_mask(spec, qp, kp, qs, ks)

      def compute(dkb, dvb, dqb):
        g_q, g_k, g_v = block_backward(q, kb, vb, do, l, delta, mask, scale, policy)
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
