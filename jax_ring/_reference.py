"""Dense attention written for clarity: the definition every fast path is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ring import _mods, _validation


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


def attention_with_lse(query, key, value, mask, scale, *, modify=None, sinks=None, dropout=None):
  """Dense masked attention; returns output [B, T, N, H] and log-sum-exp [B, N, T].

  A query whose row of `mask` is empty gets output 0 and lse -inf. A NaN or inf in a
  query, or in a key or value the mask lets it see, makes its row non-finite; so does
  a row whose every admitted logit is -inf (0 / 0, as in jax.nn; sinks or not; its
  lse is +inf).
  `modify`: logits [B, N, T, S] -> logits, before the mask; `sinks` [N]: one more
  logit per head in every row's denominator (lse includes it); `dropout`: weights
  [B, N, T, S] -> dropped weights, after the normalization.
  """
  num_heads, num_kv_heads = query.shape[2], key.shape[2]
  groups = num_heads // num_kv_heads
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", query, key, precision="highest") * scale
  if modify is not None:
    logits = modify(logits)
  mask = mask[:, None]  # [B, 1, T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  dead = jnp.any(mask, axis=-1, keepdims=True) & jnp.isneginf(row_max)  # admitted, all -inf
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(logits.dtype)[None, :, None, None], row_max.shape)
    row_max = jnp.maximum(row_max, sink)
  row_max = jax.lax.stop_gradient(row_max)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(unnormalized, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  seen = denom != 0  # a NaN (from a NaN or inf in query or key) is not hidden
  probs = unnormalized / jnp.where(seen, denom, 1.0)
  if dropout is not None:
    probs = dropout(probs)
  # A non-finite value reaches exactly the rows that see its key (the dense product
  # alone would also spread it, as 0 * inf, to the rows that do not).
  finite = jnp.isfinite(value)
  out = jnp.einsum("bnts,bsnh->btnh", probs, jnp.where(finite, value, 0), precision="highest")
  seen_by = jnp.broadcast_to(mask, logits.shape).astype(value.dtype)
  reached = jnp.einsum("bnts,bsnh->btnh", seen_by, (~finite).astype(value.dtype)) > 0
  out = jnp.where(reached | jnp.swapaxes(dead, 1, 2), jnp.nan, out)
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
  return out, jnp.where(dead, jnp.inf, lse)[..., 0]


def reference_attention(
  query,
  key,
  value,
  *,
  is_causal=False,
  segment_ids=None,
  local_window_size=None,
  scale=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  return_residual=False,
  logit_soft_cap=None,
  sinks=None,
  alibi_slopes=None,
  dropout_rate=0.0,
  dropout_rng=None,
  score_mod=None,
  dropout_broadcast=False,
):
  """Dense softmax attention on one device; works in float64.

  Legend: B batch, T query length, S key length, N query heads, K key/value heads,
  G = N // K query heads per key/value head, H head dim.

  Args:
    query: [B, T, N, H] (or [T, N, H], with key and value rank 3 too).
    key, value: [B, S, K, H] with N % K == 0 (GQA/MQA: query head n uses kv head n // G).
    is_causal: query i sees keys j <= i (top-left aligned when T != S).
    segment_ids: int [B, T] (when T == S) or a pair (query ids [B, T], kv ids [B, S]);
      queries see keys with the same id; negative ids are padding (see nothing, seen
      by no one).
    local_window_size: int w or (left, right): query i sees i - left <= j <= i + right.
    scale: logit scale, default 1/sqrt(H).
    query_seq_lengths, key_value_seq_lengths: int [B]: positions at or beyond a row's
      length are padding.
    return_residual: also return the log-sum-exp of each query's logits, [B, T, N]
      (-inf where it sees no key), in the computation's dtype.
    logit_soft_cap, sinks, alibi_slopes, score_mod: the score modifiers' definitions
      (`jax_ring.ring_attention`), with positions 0..T-1 and 0..S-1 and heads 0..N-1.
    dropout_rate, dropout_rng, dropout_broadcast: dropout's definition, as in
      `jax_ring.ring_attention`, with batch rows 0..B-1.

  Returns:
    [B, T, N, H] in the query's dtype; queries that see no key get 0. With
    `return_residual`, (output, lse).
  """
  query, key, value, unbatched = _validation.add_batch_axis(query, key, value)
  b, t, s, _, _, h = _validation.check_qkv(query, key, value)
  q_seg, kv_seg = _validation.split_segment_ids(segment_ids, b, t, s, unbatched)
  is_causal = _validation.check_bool(is_causal, "is_causal")
  return_residual = _validation.check_bool(return_residual, "return_residual")
  q_len = _validation.check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, t, unbatched)
  kv_len = _validation.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s, unbatched)
  q_seg, kv_seg = _validation.apply_lengths(q_seg, kv_seg, q_len, kv_len, jnp.arange(t), jnp.arange(s))
  window = _validation.normalize_window(local_window_size)
  scale = _validation.check_scale(scale, h)
  mask = visibility_mask(
    jnp.arange(t),
    jnp.arange(s),
    is_causal=is_causal,
    window=window,
    q_segment_ids=q_seg,
    k_segment_ids=kv_seg,
  )
  mods, sinks, slopes, seed = _validation.check_score_mods(
    logit_soft_cap,
    sinks,
    alibi_slopes,
    dropout_rate,
    dropout_rng,
    score_mod,
    batch=b,
    heads=query.shape[2],
    dropout_broadcast=dropout_broadcast,
  )
  dtype = jnp.promote_types(query.dtype, jnp.float32)
  q_pos, k_pos = jnp.arange(t)[:, None], jnp.arange(s)[None, :]  # [T, 1], [1, S]
  heads = jnp.arange(query.shape[2])[None, :, None, None]  # [1, N, 1, 1]
  modify = dropout = None
  if mods.on_scores:
    per_row = None if slopes is None else slopes.astype(dtype)[:, :, None, None]
    modify = lambda x: _mods.modify(mods, x, q_pos, k_pos, heads, per_row)[0]
  if mods.dropout > 0:
    rows, each_head = jnp.arange(b)[:, None, None, None], heads
    if mods.dropout_broadcast:
      rows, each_head = 0, 0
    kept = _mods.keep(seed, rows, each_head, q_pos, k_pos, mods.dropout)
    dropout = lambda p: jnp.where(kept, p / (1 - mods.dropout), 0.0)
  out, lse = attention_with_lse(
    query.astype(dtype),
    key.astype(dtype),
    value.astype(dtype),
    mask,
    scale,
    modify=modify,
    sinks=None if sinks is None else sinks.astype(dtype),
    dropout=dropout,
  )
  out, lse = out.astype(query.dtype), jnp.moveaxis(lse, 1, 2)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def dilated_pattern_mask(length: int, num_heads: int, segment_length: int, rate: int):
  """bool [N, T, T]: which query sees which key under one (segment, rate) pattern.

  Head n keeps the positions whose offset from their segment's start is n mod rate;
  a kept query sees the kept keys of its own segment.
  """
  pos = jnp.arange(length)
  segment = pos // segment_length
  offset = pos - segment * segment_length
  kept = (offset[None, :] % rate) == (jnp.arange(num_heads)[:, None] % rate)  # [N, T]
  same_segment = segment[:, None] == segment[None, :]
  return kept[:, :, None] & kept[:, None, :] & same_segment[None]


def reference_dilated_attention(
  query, key, value, *, segment_lengths, dilation_rates, is_causal=False, segment_ids=None, scale=None
):
  """Dense LongNet dilated attention on one device; works in float64.

  Every (segment length, rate) pattern gives an output and a log-sum-exp per query
  and head (see `dilated_pattern_mask`, with causal and segment-id masks on top); the
  patterns are merged by their softmax denominators:
  out = sum_i exp(lse_i - logsumexp_j lse_j) * out_i. A query no pattern selects gets 0.

  Args:
    query: [B, T, N, H]; key, value: [B, T, K, H] (N % K == 0).
    segment_lengths, dilation_rates: equally long sequences of positive ints.
    is_causal, segment_ids, scale: as in `reference_attention`.

  Returns:
    [B, T, N, H] in the query's dtype.
  """
  from jax_ring._dilated import check_patterns

  b, t, _, n, _, h = _validation.check_qkv(query, key, value, same_length=True)
  _validation.check_segment_ids(segment_ids, b, t)
  scale = _validation.check_scale(scale, h)
  is_causal = _validation.check_bool(is_causal, "is_causal")
  lengths, rates = check_patterns(segment_lengths, dilation_rates)
  base = visibility_mask(
    jnp.arange(t), jnp.arange(t), is_causal=is_causal, q_segment_ids=segment_ids, k_segment_ids=segment_ids
  )  # [B or 1, T, T]
  dtype = jnp.promote_types(query.dtype, jnp.float32)
  q, k, v = (x.astype(dtype) for x in (query, key, value))
  outs, lses = [], []
  for w, r in zip(lengths, rates):
    mask = base[:, None] & dilated_pattern_mask(t, n, w, r)[None]  # [B, N, T, T]
    out, lse = _attention_per_head_mask(q, k, v, mask, scale)
    outs.append(out)
    lses.append(lse)
  lse = jnp.stack(lses)  # [m, B, N, T]
  total = jax.nn.logsumexp(lse, axis=0)
  safe = jnp.where(jnp.isneginf(total), 0.0, total)
  weights = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))  # [m, B, N, T]
  out = sum(o * jnp.moveaxis(wt, 1, 2)[..., None] for o, wt in zip(outs, weights))
  return out.astype(query.dtype)


def _attention_per_head_mask(query, key, value, mask, scale):
  """attention_with_lse with a mask [B, N, T, S] that differs per query head."""
  groups = query.shape[2] // key.shape[2]
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)
  per_head = jax.vmap(
    lambda q, k, v, m: attention_with_lse(q[:, :, None], k[:, :, None], v[:, :, None], m, scale),
    in_axes=(2, 2, 2, 1),
    out_axes=(2, 1),
  )
  out, lse = per_head(query, key, value, mask)
  return out[:, :, :, 0], lse[:, :, 0]
