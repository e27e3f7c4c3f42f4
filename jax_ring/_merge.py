"""Exact merges of attention computed in pieces: (output, log-sum-exp) pairs over
disjoint sets of keys combine into the attention over their union."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_ring._kernel import saw_keys


def _merge(o, lse, top_of, total_of):
  """The exact merge of partial results (o [..., H], lse [...]) given how to take the
  max (`top_of`) and the sum (`total_of`) over the partials: w = exp(lse - max), then
  sum(w * o) / sum(w). Rows no partial saw: 0, -inf."""
  top = lax.stop_gradient(top_of(lse))  # any shift gives the same result
  safe = jnp.where(jnp.isneginf(top), 0.0, top)
  w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))
  total = total_of(jnp.concatenate([o * w[..., None], w[..., None]], axis=-1))
  num, den = total[..., :-1], total[..., -1]
  seen = saw_keys(den)
  out = jnp.where(seen[..., None], num / jnp.where(seen, den, 1.0)[..., None], 0.0)
  return out, jnp.where(seen, safe + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)


def merge_partials(o, lse, axis_name):
  """Exact merge over `axis_name` of per-device (o [..., H], lse [...]): one pmax of
  lse and one psum of [w * o, w] with w = exp(lse - max). Rows no device saw: 0, -inf."""
  return _merge(o, lse, lambda x: lax.pmax(x, axis_name), lambda x: lax.psum(x, axis_name))


def merge_local(outs, lses):
  """The same merge over a list of partials on one device: LongNet's merge of its
  patterns."""
  first = lambda reduce: lambda x: reduce(x, axis=0)
  return _merge(jnp.stack(outs), jnp.stack(lses), first(jnp.max), first(jnp.sum))


def merge_attention(*pieces):
  """Attention over the union of disjoint key sets, from each set's (output, lse).

  Legend: B batch, T queries, N heads, H head dim (any leading axes work).

  Args:
    *pieces: two or more pairs (output [..., T, N, H], lse [..., T, N]), e.g. from
      `ring_attention(..., return_residual=True)` over different keys (a cached
      prefix and new tokens, draft and target contexts, ...); lse -inf where a
      piece's keys are all hidden from a query.

  Returns:
    (output, lse): the output in the first piece's output dtype, the lse in float32
    (or wider, if a piece's lse is); exact (the same weights softmax over all keys
    gives) and differentiable. A query no piece sees gets 0 and -inf.
  """
  if len(pieces) < 2 or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pieces):
    raise TypeError(f"merge_attention takes two or more (output, lse) pairs, got {len(pieces)} arguments")
  first_out = pieces[0][0]
  for i, (o, lse) in enumerate(pieces):
    if tuple(o.shape) != tuple(first_out.shape) or tuple(lse.shape) != tuple(o.shape[:-1]):
      raise ValueError(
        f"piece {i}: output.shape={tuple(o.shape)}, lse.shape={tuple(lse.shape)}; expected output "
        f"{tuple(first_out.shape)} and lse {tuple(first_out.shape[:-1])}"
      )
  dtype = jnp.result_type(jnp.float32, *(lse.dtype for _, lse in pieces))
  out, lse = merge_local([o.astype(dtype) for o, _ in pieces], [lse.astype(dtype) for _, lse in pieces])
  return out.astype(first_out.dtype), lse
