"""A NaN or inf in q, k or v is never hidden: it reaches every output row whose mask
admits it, as in `jax.nn.dot_product_attention` given the same mask as a dense matrix,
in every path (the XLA tiles, both Pallas kernels interpreted, the shard entry point,
prefill and decode, dilated attention, the Ulysses hybrid) and in the gradients. Rows
the mask keeps from a poisoned query or key stay exact; rows that see no key give 0.

Every poison case is one batch row of a single call, so one compile checks them all.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward_and_vjp, make_mesh, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import reference_attention, reference_dilated_attention, ring_attention

T, N, K, H = 64, 4, 2, 16
SPOT = (21, 1, 3)  # (position, head, channel) of the poisoned entry
# (tensor, value) per batch row; the last row is clean. "q+": -inf in q where every
# key is positive, so each score the poisoned query sees is -inf (0 / 0 in jax.nn).
CASES = [(w, x) for w in "qkv" for x in (np.nan, np.inf, -np.inf)] + [("q+", -np.inf), (None, None)]
PAD = 4  # the last PAD tokens are padding (segment id -1): they see nothing
TOL = 1e-5


@functools.cache
def poisoned(seed=0):
  """q [B, T, N, H], k, v [B, T, K, H] float32 (row b poisoned as CASES[b]) and the
  segment ids [B, T] (one segment, the tail padding)."""
  rng = np.random.default_rng(seed)
  b = len(CASES)
  q = rng.standard_normal((b, T, N, H)).astype(np.float32)
  k = rng.standard_normal((b, T, K, H)).astype(np.float32)
  v = rng.standard_normal((b, T, K, H)).astype(np.float32)
  pos, head, channel = SPOT
  for row, (which, value) in enumerate(CASES):
    if which is not None:
      target = {"q": q, "q+": q, "k": k, "v": v}[which]
      target[row, pos, head if which[0] == "q" else head // (N // K), channel] = value
    if which == "q+":
      k[row, :, head // (N // K), channel] = np.abs(k[row, :, head // (N // K), channel]) + 0.1
  seg = np.zeros((b, T), np.int32)
  seg[:, T - PAD :] = -1
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg)


def dense_mask(seg, is_causal, window=None):
  """bool [B, 1, T, T]: the mask ring attention applies, for jax.nn."""
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  mask = np.ones((T, T), bool)
  if is_causal:
    mask &= j <= i
  if window is not None:
    mask &= (j >= i - window[0]) & (j <= i + window[1])
  seg = np.asarray(seg)
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
  return jnp.asarray(mask[None] & same)[:, None]


def bad_rows(x):
  """bool [B, T, N]: rows with a NaN or inf."""
  return ~np.isfinite(np.asarray(x, np.float64)).all(-1)


def sees_value(mask, row):
  """bool [T, N]: the (query, head) rows that see the poisoned key and value of `row`:
  the mask admits the key, and the head reads its kv head."""
  admits = np.asarray(mask)[row, 0, :, SPOT[0]]
  heads = np.arange(N) // (N // K) == SPOT[1] // (N // K)
  return admits[:, None] & heads[None]


def check_rows(out, expected_out, seg, mask):
  """Per case row: non-finite rows as jax.nn's (q, k) or a superset of the rows that
  see the value (v; jax.nn spreads it to all), finite rows equal to the float64
  reference, rows that see nothing exactly 0."""
  q, k, v, _ = poisoned()
  nn = jax.nn.dot_product_attention(q, k, v, mask=mask)
  ours, theirs, ref = bad_rows(out), bad_rows(nn), bad_rows(expected_out)
  for row, (which, _) in enumerate(CASES):
    if which == "v":
      sees = sees_value(mask, row)
      assert ours[row][sees].all(), f"case {CASES[row]}: a row that sees the value is finite"
      np.testing.assert_array_equal(ref[row], sees)
    elif which == "q+":  # jax.nn's finite mask value turns 0 / 0 into the masked keys' mean
      np.testing.assert_array_equal(ours[row], ref[row], err_msg=f"case {CASES[row]}")
      assert ref[row].sum() == 1 and ref[row][SPOT[:2]], "the reference hides 0 / 0"
    else:
      np.testing.assert_array_equal(ours[row], theirs[row], err_msg=f"case {CASES[row]}")
      np.testing.assert_array_equal(ref[row], theirs[row], err_msg=f"reference, case {CASES[row]}")
  finite = ~ours
  got, want = np.asarray(out, np.float64), np.asarray(expected_out, np.float64)
  assert rel_err(np.where(finite[..., None], got, 0), np.where(finite[..., None], want, 0)) < TOL
  sees_nothing = ~np.asarray(mask)[:, 0].any(-1)  # [B, T]
  assert sees_nothing[:, -PAD:].all()
  assert (got[sees_nothing] == 0).all(), "a row that sees no key is not exactly 0"
  assert bad_rows(out)[-1].sum() == 0  # the clean row


@functools.cache
def reference(is_causal):
  q, k, v, seg = poisoned()
  wide = (x.astype(jnp.float64) for x in (q, k, v))
  return reference_attention(*wide, is_causal=is_causal, segment_ids=seg)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_ring_attention_propagates_every_poison(devices, kernel):
  q, k, v, seg = poisoned()
  mesh = make_mesh((devices,), ("seq",))
  # Blocks of 16: several tiles a device (3 devices hold 22 tokens: Pallas pads to its own).
  blocks = None if (kernel, devices) == ("pallas", 3) else jax_ring.BlockSizes(block_q=16, block_kv=16)
  out = ring_attention(q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, block_sizes=blocks, kernel=kernel)
  check_rows(out, reference(True), seg, dense_mask(seg, True))


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_poisoned_gradients_are_not_finite_and_no_wider_than_jax_nn(kernel):
  """d/d(q, k, v) of a loss on a poisoned output: non-finite, and only where jax.nn's
  dense gradient is non-finite too (the ring spreads a poison no further: hidden
  pairs add exactly 0, though a matmul still meets 0 * NaN as jax.nn's does)."""
  q, k, v, seg = poisoned()
  mesh = make_mesh((4,), ("seq",))
  mask = dense_mask(seg, True)
  cot = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
  ring = lambda *a: ring_attention(*a, mesh=mesh, is_causal=True, segment_ids=seg, kernel=kernel)
  ours = forward_and_vjp(ring)((q, k, v), cot)[1]  # one jitted program each
  theirs = forward_and_vjp(lambda *a: jax.nn.dot_product_attention(*a, mask=mask))((q, k, v), cot)[1]
  # jax.nn's finite mask value hides the "q+" row's 0 / 0. There the poison may reach
  # its own dq row, dv of the keys it sees, and dk of its kv head (dK = dS^T Q meets
  # 0 * -inf in every key's row, as in jax.nn's "q" -inf case).
  plus, (pos, head, _) = CASES.index(("q+", -np.inf)), SPOT
  reach = np.zeros((3, T, N), bool)
  reach[0, pos, head] = True
  reach[1, :, head // (N // K)] = True
  reach[2, : pos + 1, head // (N // K)] = True
  for name, g, r, allowed in zip("qkv", ours, theirs, reach[[0, 1, 2]]):
    bad, nn_bad = bad_rows(g), bad_rows(r)
    nn_bad[plus] = allowed[:, : g.shape[2]]
    assert not (bad & ~nn_bad).any(), f"d{name}: non-finite where jax.nn's gradient is finite"
    assert not bad[-1].any(), f"d{name} of the clean row"
  for row in range(len(CASES) - 1):
    assert any(bad_rows(g)[row].any() for g in ours), f"case {CASES[row]}: every gradient finite"
  for g in ours:
    assert (np.asarray(g)[-1, T - PAD :] == 0).all(), "padding's gradient is not 0"


def test_shard_entry_point_and_window():
  """ring_attention_shard in the caller's shard_map (contiguous shards), with a window."""
  q, k, v, seg = poisoned()
  mesh = make_mesh((4,), ("seq",))
  window = (9, 3)

  def inner(q, k, v, seg):
    return jax_ring.ring_attention_shard(
      q, k, v, axis_name="seq", local_window_size=window, segment_ids=seg, layout="contiguous"
    )

  seq = P(None, "seq")
  with jax.set_mesh(mesh):  # the caller's shard_map over an Explicit mesh wants typed inputs
    args = [jax.device_put(x, NamedSharding(mesh, seq)) for x in (q, k, v, seg)]
    out = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 4, out_specs=seq))(*args)
  wide = (x.astype(jnp.float64) for x in (q, k, v))
  expected = reference_attention(*wide, local_window_size=window, segment_ids=seg)
  check_rows(out, expected, seg, dense_mask(seg, False, window))


def test_ulysses_hybrid():
  q, k, v, seg = poisoned()
  mesh = make_mesh((2, 4), ("u", "seq"))
  out = ring_attention(q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, ulysses_axis="u")
  check_rows(out, reference(True), seg, dense_mask(seg, True))


def test_prefill_and_decode():
  """Prefill of the first 48 tokens, then decoding the rest one by one: each output
  row non-finite exactly where the reference's is (q, k) or where it sees the value."""
  q, k, v, seg = poisoned()
  mesh = make_mesh((4,), ("seq",))
  prompt = 48
  cache = jax_ring.init_cache(q.shape[0], T, K, H, mesh=mesh)
  out, cache = jax_ring.prefill_attention(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache, mesh=mesh)
  outs = [out]
  for t in range(prompt, T - PAD):
    cache = jax_ring.update_cache(cache, k[:, t : t + 1], v[:, t : t + 1], mesh=mesh)
    outs.append(jax_ring.decode_attention(q[:, t : t + 1], cache, mesh=mesh))
  got = jnp.concatenate(outs, axis=1)
  want = reference(True)[:, : T - PAD]
  mask = dense_mask(seg, True)
  for row, (which, _) in enumerate(CASES):
    expected = bad_rows(want)[row]
    if which == "v":  # decoding: exactly the rows that see it; prefill's tiles may spread it
      assert bad_rows(got)[row][expected].all()
      np.testing.assert_array_equal(bad_rows(got)[row][prompt:], expected[prompt:])
    else:
      np.testing.assert_array_equal(bad_rows(got)[row], expected, err_msg=f"case {CASES[row]}")
  finite = ~bad_rows(got)
  assert rel_err(np.where(finite[..., None], got, 0), np.where(finite[..., None], want, 0)) < TOL
  assert np.asarray(mask).any()


def test_dilated_attention():
  q, k, v, seg = poisoned()
  mesh = make_mesh((4,), ("seq",))
  patterns = dict(segment_lengths=(16, 64), dilation_rates=(1, 2), is_causal=True)
  out = jax_ring.dilated_attention(q, k, v, mesh=mesh, segment_ids=seg, **patterns)
  wide = (x.astype(jnp.float64) for x in (q, k, v))
  want = reference_dilated_attention(*wide, segment_ids=seg, **patterns)
  for row, (which, _) in enumerate(CASES):
    expected = bad_rows(want)[row]
    got = bad_rows(out)[row]
    if which == "v":
      assert got[expected].all(), f"case {CASES[row]}"
    else:
      np.testing.assert_array_equal(got, expected, err_msg=f"case {CASES[row]}")
  finite = ~bad_rows(out)
  assert rel_err(np.where(finite[..., None], out, 0), np.where(finite[..., None], want, 0)) < TOL


def test_reference_is_exact_for_a_poisoned_value():
  """The definition: a non-finite value reaches exactly the rows that see its key
  (jax.nn's dense product also spreads it, as 0 * inf, to every other row)."""
  q, k, v, seg = poisoned()
  mask = dense_mask(seg, True)
  row = CASES.index(("v", np.nan))
  np.testing.assert_array_equal(bad_rows(reference(True))[row], sees_value(mask, row))
  heads = sees_value(mask, row).any(0)  # the heads that read the poisoned kv head
  assert bad_rows(jax.nn.dot_product_attention(q, k, v, mask=mask))[row][:, heads].all()


def test_a_query_whose_every_score_is_minus_inf_is_not_hidden():
  """The "q+" case really is 0 / 0 (every score -inf, none +inf): jax.nn without a mask
  gives NaN there (with a dense mask its finite mask value hands the row to the masked
  keys instead). The ring returns a non-finite row, not an empty row's 0."""
  q, k, v, seg = poisoned()
  mask = dense_mask(seg, True)
  row, (pos, head, _) = CASES.index(("q+", -np.inf)), SPOT
  scores = np.einsum(
    "h,sh->s", np.asarray(q[row, pos, head], np.float64), np.asarray(k[row, : pos + 1, head // 2])
  )
  assert (scores == -np.inf).all() and np.asarray(mask)[row, 0, pos, : pos + 1].all()
  assert bad_rows(jax.nn.dot_product_attention(q, k, v))[row, pos, head]
  out = ring_attention(q, k, v, mesh=make_mesh((2,), ("seq",)), is_causal=True, segment_ids=seg)
  assert bad_rows(out)[row].sum() == 1 and bad_rows(out)[row, pos, head]


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_minus_inf_scores_weigh_nothing_beside_finite_ones(kernel):
  """Keys whose every score is -inf fill the first device's shard: the queries that see
  only them are 0 / 0 (non-finite), and every later query, which also sees finite
  scores on the other devices' steps, equals the float64 reference over those."""
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, T, N, H)).astype(np.float32)
  k = rng.standard_normal((1, T, K, H)).astype(np.float32)
  v = rng.standard_normal((1, T, K, H)).astype(np.float32)
  q[..., 0] = np.abs(q[..., 0]) + 0.1
  k[:, : T // 4, :, 0] = -np.inf  # device 0 of 4 holds exactly these keys
  mesh = make_mesh((4,), ("seq",))
  out = np.asarray(ring_attention(q, k, v, mesh=mesh, is_causal=True, kernel=kernel, layout="contiguous"))
  assert bad_rows(out)[0, : T // 4].all() and not bad_rows(out)[0, T // 4 :].any()
  i = np.arange(T)[:, None]
  want = np.zeros((T, N, H))
  for n in range(N):  # the later queries, by hand over the finite keys
    kn, vn = k[0, T // 4 :, n // (N // K)].astype(np.float64), v[0, T // 4 :, n // (N // K)]
    s = q[0, :, n].astype(np.float64) @ kn.T / np.sqrt(H)
    s = np.where(np.arange(T // 4, T)[None] <= i, s, -np.inf)[T // 4 :]
    p = np.exp(s - s.max(-1, keepdims=True))
    want[T // 4 :, n] = (p / p.sum(-1, keepdims=True)) @ vn
  assert rel_err(out[0, T // 4 :], want[T // 4 :]) < TOL
