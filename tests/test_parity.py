"""Parity with `jax.nn.dot_product_attention`: rank-3 inputs, the log-sum-exp
(`return_residual`), per-row lengths, separate query / key-value segment ids,
cross-attention (S != T), and the bf16 backward's delta."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_close,
  compare_with_reference,
  cut_segments,
  forward_and_vjp,
  make_mesh,
  qkv,
  rel_err,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import merge_attention, reference_attention, ring_attention

TOL = 1e-5
SMALL_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=16, kv_heads=1)
# Queries and keys of different, awkward lengths: every layout pads both, differently.
B, T, S, N, K, H = 2, 37, 53, 4, 2, 8


# Every new argument at once, one mask per layout (the layouts place queries and keys
# on devices by their own lengths).
Q_LENGTHS = jnp.array([30, 0], jnp.int32)  # row 1: every query is padding
KV_LENGTHS = jnp.array([S, 11], jnp.int32)
PAIR_IDS = (cut_segments(T, [9, 20]), cut_segments(S, [12, 30], pad_from=45))
CASES = {
  "contiguous": {
    "local_window_size": (5, 3),
    "segment_ids": PAIR_IDS,
    "query_seq_lengths": Q_LENGTHS,
    "key_value_seq_lengths": KV_LENGTHS,
  },
  "zigzag": {"is_causal": True, "segment_ids": PAIR_IDS, "query_seq_lengths": Q_LENGTHS},
  "striped": {"is_causal": True, "local_window_size": 6, "key_value_seq_lengths": KV_LENGTHS},
}
# One reference per case, compiled once for every device count.
REFERENCES = {
  name: functools.partial(reference_attention, return_residual=True, **options)
  for name, options in CASES.items()
}


@pytest.mark.parametrize("layout", sorted(CASES))
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_cross_attention_lengths_ids_and_lse_match_reference(devices, layout):
  """Output and lse, and the gradients of a loss on both, against float64."""
  options = CASES[layout]
  mesh = make_mesh((devices,), ("seq",))
  q, _, _ = qkv(B, T, N, K, H)
  _, k, v = qkv(B, S, N, K, H, seed=1)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, layout=layout, block_sizes=SMALL_BLOCKS, return_residual=True, **options
  )
  (out, lse), _ = compare_with_reference(fn, REFERENCES[layout], (q, k, v), TOL)
  chex.assert_shape([out, lse], [(B, T, N, H), (B, T, N)])
  chex.assert_type(lse, jnp.float32)
  if "query_seq_lengths" in options:  # padded queries: output 0, lse -inf
    assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(jnp.isneginf(lse[1])))


def test_rank3_inputs_as_jax_nn_takes_them():
  """[T, N, H] in, [T, N, H] and lse [T, N] out; ids without batch axis, lengths [1]."""
  mesh = make_mesh((3,), ("seq",))
  q, _, _ = qkv(1, T, N, K, H)
  _, k, v = qkv(1, S, N, K, H, seed=1)
  options = {
    "is_causal": True,
    "segment_ids": (PAIR_IDS[0][0], PAIR_IDS[1][0]),
    "query_seq_lengths": jnp.array([33], jnp.int32),
    "key_value_seq_lengths": jnp.array([40], jnp.int32),
  }
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, return_residual=True, **options
  )
  ref = lambda q, k, v: reference_attention(q, k, v, return_residual=True, **options)
  (out, lse), _ = compare_with_reference(fn, ref, (q[0], k[0], v[0]), TOL)
  chex.assert_shape([out, lse], [(T, N, H), (T, N)])


@functools.cache
def _jax_nn_inputs(dtype, t, s):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return normal(ks[0], (2, t, 4, 32)), normal(ks[1], (2, s, 2, 32)), normal(ks[2], (2, s, 2, 32)), ks[3]


@pytest.mark.parametrize(
  "dtype, t, s, options, padded, tols",
  [
    # JAX's testDotProductAttentionMask (nn_test.py) cases in float32, with T != S
    # (jax.nn's causal mask is top-left aligned) and GQA.
    (jnp.float32, 96, 128, {"is_causal": True}, True, (TOL,) * 4),
    (jnp.float32, 96, 128, {"is_causal": True, "local_window_size": (3, 2)}, False, (TOL,) * 4),
    # The same test's bfloat16 case and tolerances: out .01, dQ .02, dK .02, dV .01.
    (jnp.bfloat16, 128, 128, {"is_causal": True}, True, (0.01, 0.02, 0.02, 0.01)),
  ],
  ids=["float32_cross_padding", "float32_cross_window", "bfloat16_padding"],
)
def test_matches_jax_nn_dot_product_attention(dtype, t, s, options, padded, tols):
  """Against jax.nn.dot_product_attention itself; `padded` uses JAX's lengths
  (queries T/2, T/4; keys S/4, S/2), with which every query that is not padding still
  sees a key (where none is seen, jax.nn returns the mean of V and jax_ring 0). The
  bf16 case runs under the bf16 policy."""
  q, k, v, key = _jax_nn_inputs(dtype, t, s)
  lengths = {}
  if padded:
    lengths = {
      "query_seq_lengths": jnp.array([t // 2, t // 4], jnp.int32),
      "key_value_seq_lengths": jnp.array([s // 4, s // 2], jnp.int32),
    }
  mesh = make_mesh((4,), ("seq",))
  policy = "bfloat16" if dtype == jnp.bfloat16 else "float32"
  ours = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, policy=policy, return_residual=True, **options, **lengths
  )
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, return_residual=True, **options, **lengths)
  cot = jax.random.normal(key, (q.shape[0], t, q.shape[2], q.shape[3]), jnp.float32).astype(dtype)

  @functools.partial(jax.jit, static_argnums=0)  # one program each, not op-by-op dispatch
  def run(fn, q, k, v, cot):
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    return out, lse, vjp((cot, jnp.zeros_like(lse)))

  out, lse, grads = run(ours, q, k, v, cot)
  ref, ref_lse, ref_grads = run(theirs, q, k, v, cot)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  for name, a, b, tol in zip(["out", "dq", "dk", "dv"], [out, *grads], [ref, *ref_grads], tols):
    assert a.dtype == b.dtype, name
    if dtype == jnp.float32:
      assert rel_err(a, b) < tol, name
    else:  # JAX's assertAllClose: |a - b| <= atol + rtol |b|, atol = rtol = tol
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert np.all(np.abs(a - b) <= tol + tol * np.abs(b)), name
  # jax.nn's lse (in the input dtype) agrees on the queries that are not padding.
  q_len = lengths.get("query_seq_lengths", jnp.array([t, t]))
  valid = jnp.arange(t)[None, :, None] < q_len[:, None, None]
  err = jnp.max(jnp.where(valid, jnp.abs(lse - ref_lse.astype(jnp.float32)), 0))
  assert float(err) < (1e-5 if dtype == jnp.float32 else 0.05)
  assert bool(jnp.all(jnp.isneginf(lse) == ~valid))


def _tolerance_used(grad, ref, tol=0.2):
  """max |g - ref| / (atol + rtol |ref|) with JAX's atol = rtol = 0.2 (1.0 = at the edge)."""
  g, r = np.asarray(grad, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(g - r) / (tol + tol * np.abs(r))))


def test_exact_delta_shrinks_the_bf16_backward_error():
  """JAX's test_sdpa_large_head_size (B, T, N, H = 2, 64, 2, 256, causal, scale 1,
  bf16): with the delta from the float32 output (the default), dK uses less of the
  test's tolerance than with the delta from the bf16 output, and dQ no more."""
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, cot = (jax.random.normal(x, (2, 64, 2, 256), jnp.float32).astype(jnp.bfloat16) for x in ks)
  mesh = make_mesh((2,), ("seq",))
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, scale=1.0)
  wide = tuple(x.astype(jnp.float64) for x in (q, k, v))
  ref_grads = forward_and_vjp(ref)(wide, cot.astype(jnp.float64))[1]
  used = {}
  for exact in (True, False):
    policy = jax_ring.Policy(compute_dtype=jnp.bfloat16, precision="default", exact_delta=exact)
    fn = lambda q, k, v, policy=policy: ring_attention(
      q, k, v, mesh=mesh, is_causal=True, scale=1.0, policy=policy
    )
    grads = forward_and_vjp(fn)((q, k, v), cot)[1]
    used[exact] = [_tolerance_used(g, r) for g, r in zip(grads, ref_grads)]
  assert all(u < 1.0 for u in used[True]), used
  assert used[True][1] < used[False][1], used  # dK
  assert used[True][0] <= used[False][0] * 1.05, used  # dQ


def test_merge_attention_of_two_key_sets_equals_attention_over_both():
  """(output, lse) of queries against two disjoint key sets, merged, equal attention
  over all keys, in value and in every gradient (the lse's cotangent is exact)."""
  mesh = make_mesh((4,), ("seq",))
  q, _, _ = qkv(B, T, N, K, H)
  _, k, v = qkv(B, S, N, K, H, seed=1)
  ids = PAIR_IDS
  split = 29

  def pieces(q, k, v):
    first = ring_attention(
      q, k[:, :split], v[:, :split], mesh=mesh, return_residual=True,
      segment_ids=(ids[0], ids[1][:, :split]), block_sizes=SMALL_BLOCKS,
    )  # fmt: skip
    second = reference_attention(
      q, k[:, split:], v[:, split:], return_residual=True, segment_ids=(ids[0], ids[1][:, split:])
    )
    out, lse = merge_attention(first, second)
    return out, lse

  whole = lambda q, k, v: reference_attention(q, k, v, return_residual=True, segment_ids=ids)
  (out, lse), _ = compare_with_reference(pieces, whole, (q, k, v), TOL)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32


def test_merge_attention_checks_its_pieces():
  o, lse = jnp.zeros((2, 5, 4, 8)), jnp.zeros((2, 5, 4))
  with pytest.raises(TypeError, match=r"two or more \(output, lse\) pairs, got 1"):
    merge_attention((o, lse))
  with pytest.raises(ValueError, match=r"piece 1: output.shape=\(2, 5, 4, 8\), lse.shape=\(2, 5\)"):
    merge_attention((o, lse), (o, lse[..., 0]))


def test_shard_function_cross_attention_inside_shard_map():
  """ring_attention_shard with S != T, lengths and the lse, in the caller's shard_map
  (contiguous shards), equals the float64 reference; positions without kv_positions
  for S != T is an error."""
  mesh = make_mesh((2,), ("seq",))
  t, s = 36, 52
  q, _, _ = qkv(B, t, N, K, H)
  _, k, v = qkv(B, s, N, K, H, seed=1)
  lengths = {"query_seq_lengths": jnp.array([30, 7], jnp.int32), "key_value_seq_lengths": jnp.array([52, 20])}
  rows, seq = P(None), P(None, "seq")

  def inner(q, k, v, ql, kl):
    return jax_ring.ring_attention_shard(
      q, k, v, axis_name="seq", is_causal=True, return_residual=True, block_sizes=SMALL_BLOCKS,
      query_seq_lengths=ql, key_value_seq_lengths=kl,
    )  # fmt: skip

  sharded = jax.jit(
    jax.shard_map(inner, mesh=mesh, in_specs=(seq, seq, seq, rows, rows), out_specs=(seq, seq))
  )
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = [put(x, seq) for x in (q, k, v)] + [put(lengths[n], rows) for n in sorted(lengths, reverse=True)]
  out, lse = sharded(*args)
  wide = (x.astype(jnp.float64) for x in (q, k, v))
  ref, ref_lse = reference_attention(*wide, is_causal=True, return_residual=True, **lengths)
  assert_close(out, ref, TOL)
  assert_close(lse, ref_lse, TOL, "lse")

  def positions_only(q, k, v):
    return jax_ring.ring_attention_shard(q, k, v, axis_name="seq", positions=jnp.arange(t // 2))

  with pytest.raises(
    ValueError, match=r"kv_positions is required with positions when key length S=26 != T=18"
  ):
    jax.shard_map(positions_only, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)(*args[:3])


def test_kv_cache_prefill_still_needs_equal_lengths():
  mesh = make_mesh((2,), ("seq",))
  cache = jax_ring.init_cache(1, 16, K, H, mesh=mesh)
  q, _, _ = qkv(1, 8, N, K, H)
  _, k, v = qkv(1, 6, N, K, H)
  with pytest.raises(ValueError, match=r"key length=6 must equal query length=8"):
    jax_ring.prefill_attention(q, k, v, cache, mesh=mesh)
