"""Dense attention written for clarity: the definition every fast path is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ring import _validation


def visibility_mask(
  q_positions,
  k_positions,
  *,
  is_causal=False,
  window=None,
  q_segment_ids=None,
  k_segment_ids=None,
):
  """Which query sees which key: bool [B or 1, T, S] from global positions and ids."""
  qp = q_positions[:, None]
  kp = k_positions[None, :]
  mask = jnp.ones(qp.shape[:1] + kp.shape[1:], dtype=bool)
  if is_causal:
    mask = mask & (kp <= qp)
  if window is not None:
    left, right = window
    mask = mask & (kp >= qp - left) & (kp <= qp + right)
  mask = mask[None]
  if q_segment_ids is not None:
    same = q_segment_ids[:, :, None] == k_segment_ids[:, None, :]
    mask = mask & same & (q_segment_ids[:, :, None] >= 0)
  return mask


def attention_with_lse(query, key, value, mask, scale):
  """Dense masked attention; returns output [B, T, N, H] and log-sum-exp [B, N, T].

  A query whose row of `mask` is empty gets output 0 and lse -inf.
  """
  num_heads, num_kv_heads = query.shape[2], key.shape[2]
  groups = num_heads // num_kv_heads
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", query, key, precision="highest") * scale
  mask = mask[:, None]  # [B, 1, T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(unnormalized, axis=-1, keepdims=True)
  seen = denom > 0
  probs = unnormalized / jnp.where(seen, denom, 1.0)
  out = jnp.einsum("bnts,bsnh->btnh", probs, value, precision="highest")
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)[..., 0]
  return out, lse


def reference_attention(
  query, key, value, *, is_causal=False, segment_ids=None, local_window_size=None, scale=None
):
  """Dense softmax attention on one device; works in float64.

  Legend: B batch, T query length, S key length, N query heads, K key/value heads,
  G = N // K query heads per key/value head, H head dim.

  Args:
    query: [B, T, N, H].
    key, value: [B, S, K, H] with N % K == 0 (GQA/MQA: query head n uses kv head n // G).
    is_causal: query i sees keys j <= i.
    segment_ids: int [B, T] (requires T == S); queries see keys with the same id;
      negative ids are padding (see nothing, seen by no one).
    local_window_size: int w or (left, right): query i sees i - left <= j <= i + right.
    scale: logit scale, default 1/sqrt(H).

  Returns:
    [B, T, N, H] in the query's dtype; queries that see no key get 0.
  """
  b, t, s, _, _, h = _validation.check_qkv(query, key, value, same_length=segment_ids is not None)
  _validation.check_segment_ids(segment_ids, b, t)
  window = _validation.normalize_window(local_window_size)
  scale = _validation.check_scale(scale, h)
  mask = visibility_mask(
    jnp.arange(t),
    jnp.arange(s),
    is_causal=is_causal,
    window=window,
    q_segment_ids=segment_ids,
    k_segment_ids=segment_ids,
  )
  dtype = jnp.promote_types(query.dtype, jnp.float32)
  out, _ = attention_with_lse(query.astype(dtype), key.astype(dtype), value.astype(dtype), mask, scale)
  return out.astype(query.dtype)
