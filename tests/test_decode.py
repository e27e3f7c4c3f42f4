"""Decoding from a sequence-sharded KV cache against the float64 reference over the
whole sequence: prefill (ring attention that fills the cache), round-robin appends,
decode_attention's output and log-sum-exp, and the compiled decode step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import decode_attention, init_cache, prefill_attention, update_cache
from jax_ring.hlo import collective_bytes

TOL = 2e-6  # absolute, float32 against float64


def _data(batch, total, heads, kv_heads, head_dim=8, seed=0):
  """q, k, v [B, total, ...] float32, indexed by global position."""
  rng = np.random.default_rng(seed)
  shape = lambda n: (batch, total, n, head_dim)
  return tuple(rng.standard_normal(shape(n)).astype(np.float32) for n in (heads, kv_heads, kv_heads))


def _at(x, positions):
  """Rows of x [B, T, ...] at positions [B, n]."""
  return np.take_along_axis(x, positions[:, :, None, None], axis=1)


def _decode_run(
  devices,
  *,
  heads=4,
  kv_heads=2,
  prompt=21,
  lengths=(21, 13, 0),
  tq=3,
  steps=2,
  layout="auto",
  window=None,
  patterns=None,
  mods=None,
):
  """Prefill, then `steps` rounds of appending tq tokens per row and decoding them;
  every output and lse checked against the reference over the whole sequence.
  patterns: ((segment lengths), (rates)) of dilated decoding, checked against
  `reference_dilated_attention` (outputs; the prefill, which fills the cache, is causal
  attention over the prompt and is checked as that). mods: score modifiers for prefill,
  decode and the reference alike; the window applies to the prefill too."""
  mods = mods or {}
  lengths = np.asarray(lengths, np.int32)
  b, total = len(lengths), prompt + tq * steps
  q, k, v = _data(b, total, heads, kv_heads)
  mesh = make_mesh((devices,), ("seq",))
  cache = init_cache(b, total, kv_heads, q.shape[-1], mesh=mesh)
  head = lambda x: x[:, :prompt]
  out, cache = prefill_attention(
    head(q),
    head(k),
    head(v),
    cache,
    mesh=mesh,
    lengths=lengths,
    layout=layout,
    local_window_size=window,
    **mods,
  )
  # Row b holds positions [0, lengths[b] + tq * steps); the rest of its row is padding.
  valid = np.arange(total)[None] < (lengths + tq * steps)[:, None]
  seg = jnp.asarray(np.where(valid, 0, -1), jnp.int32)
  as64 = lambda x: jnp.asarray(x, jnp.float64)
  options = dict(is_causal=True, segment_ids=seg, local_window_size=window, return_residual=True, **mods)
  ref, ref_lse = jax.jit(lambda q, k, v: jax_ring.reference_attention(q, k, v, **options))(
    as64(q), as64(k), as64(v)
  )
  ref, ref_lse = np.asarray(ref), np.asarray(ref_lse)
  # The prefill is causal attention (with the window) over each row's prompt.
  prompt_valid = np.arange(prompt)[None] < lengths[:, None]
  expected = np.where(prompt_valid[:, :, None, None], ref[:, :prompt], 0.0)
  np.testing.assert_allclose(np.asarray(out), expected, atol=TOL, rtol=0)
  dilated = {}
  if patterns is not None:
    dilated = dict(segment_lengths=patterns[0], dilation_rates=patterns[1])
    ref_fn = lambda q, k, v: jax_ring.reference_dilated_attention(
      q, k, v, is_causal=True, segment_ids=seg, **dilated
    )
    ref = np.asarray(jax.jit(ref_fn)(as64(q), as64(k), as64(v)))
  for step in range(steps):
    pos = lengths[:, None] + step * tq + np.arange(tq)[None]
    cache = update_cache(cache, _at(k, pos), _at(v, pos), mesh=mesh)
    o, lse = decode_attention(
      _at(q, pos), cache, mesh=mesh, local_window_size=window, return_residual=True, **dilated, **mods
    )
    np.testing.assert_allclose(np.asarray(o), _at(ref, pos), atol=TOL, rtol=0)
    if patterns is not None:
      continue
    np.testing.assert_allclose(
      np.asarray(lse), np.take_along_axis(ref_lse, pos[:, :, None], axis=1), atol=TOL
    )
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + tq * steps)
  return cache


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_decode_matches_reference_gqa_rows_of_different_lengths(devices):
  # Rows of 21, 13 and 0 prompt tokens (the last is empty until decoding starts).
  cache = _decode_run(devices)
  # Round-robin appends: the appended tokens per device differ by at most one.
  positions = np.asarray(cache.positions)[0].reshape(devices, -1)
  appended = (positions >= 21).sum(axis=1)  # row 0's prompt is positions 0..20
  assert appended.sum() == 6 and appended.max() - appended.min() <= 1, appended


SCORE_MODS = dict(
  logit_soft_cap=1.5,
  sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]),
  alibi_slopes=jnp.asarray([[0.5, 0.25, 0.125, 0.0625]] * 3),
  score_mod=lambda s, i, j, h: s + 0.2 * jnp.cos(0.3 * (i - j) + h),
)


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_prefill_and_decode_with_score_modifiers(devices):
  """Soft-cap, sinks, ALiBi and a score_mod in prefill and decoding, on global
  positions (rows of different lengths, so a token's position differs by row)."""
  _decode_run(devices, mods=SCORE_MODS, window=(9, 0) if devices == 3 else None)


def test_decode_cache_shorter_than_the_devices():
  # 3 prompt tokens on 8 devices: most devices hold only padding; MQA; one token per step.
  _decode_run(8, heads=2, kv_heads=1, prompt=3, lengths=(3, 1), tq=1, steps=3)


@pytest.mark.parametrize("devices", [3, 8])
def test_decode_with_a_window(devices):
  _decode_run(devices, window=(5, 0), lengths=(21, 9, 2))


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_dilated_decode_matches_the_dilated_reference(devices):
  # Two patterns: segments of 8 at rate 1 and of 16 at rate 2 (heads 0, 2 keep the even
  # offsets, heads 1, 3 the odd ones); rows of 21, 13 and 0 prompt tokens.
  _decode_run(devices, patterns=((8, 16), (1, 2)))


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_decode_after_every_prompt_layout(layout):
  _decode_run(4, layout=layout, prompt=16, lengths=(16, 7, 0))


def test_decode_attention_shard_inside_shard_map():
  """The shard variant in the caller's shard_map over an Explicit mesh: under
  jax.set_mesh the cache is typed by that mesh, as the caller's shard_map wants."""
  mesh = make_mesh((4,), ("seq",))
  q, k, v = _data(2, 12, 4, 2)
  new = lambda x: x[:, 10:12]
  with jax.set_mesh(mesh):
    cache = init_cache(2, 12, 2, 8, mesh=mesh)
    _, cache = prefill_attention(q[:, :10], k[:, :10], v[:, :10], cache, mesh=mesh)
    cache = update_cache(cache, new(k), new(v), mesh=mesh)
    expected = decode_attention(new(q), cache, mesh=mesh)
    specs = jax_ring.KVCache(P(None, "seq"), P(None, "seq"), P(None, "seq"), P(None, "seq"), P(), P(), P())
    inner = lambda q, c: jax_ring.decode_attention_shard(q, c, axis_name="seq")
    got = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P(), specs), out_specs=P()))(new(q), cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-6)


def test_decode_step_moves_partials_not_the_cache():
  """The compiled update + decode step: all-reduce only, and neither its collective
  bytes nor its temp memory grow with the cache length."""
  mesh = make_mesh((8,), ("seq",))

  def step(cache, q, k, v):
    cache = update_cache(cache, k, v, mesh=mesh)
    return decode_attention(q, cache, mesh=mesh), cache

  stats = {}
  for length in (2048, 8192):
    cache = jax.eval_shape(lambda n=length: init_cache(2, n, 2, 16, mesh=mesh))
    new = lambda n: jax.ShapeDtypeStruct((2, 1, n, 16), jnp.float32)
    compiled = jax.jit(step).lower(cache, new(4), new(2), new(2)).compile()
    stats[length] = (collective_bytes(compiled), compiled.memory_analysis().temp_size_in_bytes)
  for length, (ops, _) in stats.items():
    assert set(ops) == {"all-reduce"}, (length, ops)
    # Two all-reduces: the max of lse (B x Tq x N) and the sum of [w o, w] (B x Tq x N x (H + 1)).
    assert ops["all-reduce"] == 4 * (2 * 4 + 2 * 4 * (16 + 1)), (length, ops)
  assert stats[2048][0] == stats[8192][0]  # bytes on the wire: independent of the cache
  assert stats[8192][1] <= stats[2048][1] * 1.05, stats  # temp memory: too


def _zeros(shape, dtype=np.float32):
  return np.zeros(shape, dtype), np.zeros(shape, dtype)


@pytest.mark.parametrize(
  "call, error, match",
  [
    (lambda c, m: prefill_attention(*_data(2, 40, 4, 2)[:3], c, mesh=m), ValueError, "prompt of 40 tokens"),
    (lambda c, m: update_cache(c, *_zeros((2, 1, 4, 8)), mesh=m), ValueError, "kv heads=4"),
    (lambda c, m: update_cache(c, *_zeros((2, 1, 2, 8), np.float64), mesh=m), TypeError, "dtype"),
    (lambda c, m: decode_attention(_zeros((2, 1, 3, 8))[0], c, mesh=m), ValueError, "num_heads=3"),
    (lambda c, m: decode_attention(_zeros((2, 1, 4, 8))[0], "cache", mesh=m), TypeError, "KVCache"),
    (lambda c, m: update_cache(c, *_zeros((2, 20, 2, 8)), mesh=m), ValueError, "the cache is full"),
  ],
)
def test_bad_input_is_named(call, error, match):
  """A prompt longer than the cache, mismatched heads or dtypes, a full cache."""
  mesh = make_mesh((2,), ("seq",))
  cache = init_cache(2, 10, 2, 8, mesh=mesh)
  with pytest.raises(error, match=match):
    call(cache, mesh)


def test_init_cache_inside_jit_leaves_no_tracer_behind():
  mesh = make_mesh((2,), ("seq",))
  inside = jax.jit(lambda: jnp.sum(jax_ring.init_cache(1, 16, 1, 8, mesh=mesh).k))()
  outside = jax_ring.init_cache(1, 16, 1, 8, mesh=mesh)  # same shape: once a leaked tracer
  assert float(inside) == 0.0 and float(jnp.sum(outside.k)) == 0.0
  assert (np.asarray(outside.positions) == -1).all()


@pytest.mark.parametrize("devices", [1, 3, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_max_length_is_what_a_row_may_hold(devices, layout):
  """init_cache(max_length): a prompt buffer of T plus n appended tokens fits whenever
  T + n <= max_length (the capacity is p * (ceil(max_length / p) + 3)); appending past
  a device's slots is a ValueError that names the capacity."""
  mesh = make_mesh((devices,), ("seq",))
  max_length = 20
  for t in (1, 7, max_length):
    cache = init_cache(1, max_length, 1, 8, mesh=mesh)
    assert cache.capacity == devices * (-(-max_length // devices) + 3) >= max_length
    x = np.ones((1, t, 1, 8), np.float32)
    _, cache = prefill_attention(x, x, x, cache, mesh=mesh, layout=layout)
    if t < max_length:
      new = np.ones((1, max_length - t, 1, 8), np.float32)
      cache = update_cache(cache, new, new, mesh=mesh)
    assert int(cache.lengths[0]) == max_length
  room = cache.capacity // devices - int(cache.prefilled) - -(-(max_length - t) // devices)
  past = np.ones((1, devices * room + 1, 1, 8), np.float32)
  with pytest.raises(ValueError, match=rf"capacity {cache.capacity} over {devices} devices"):
    update_cache(cache, past, past, mesh=mesh)
