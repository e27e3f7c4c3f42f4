"""LongNet dilated attention against its float64 dense definition."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, padded_segments, qkv

import jax_ring
from jax_ring import dilated_attention, reference_dilated_attention
from jax_ring._dilated import DilatedConfig, local_chunk, plan
from jax_ring.hlo import collective_bytes

TOL = 1e-5
SMALL_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=8)

# name -> (heads, kv_heads, length, segment_lengths, dilation_rates, options).
# 53 is divisible by no segment; 100 > 53 is longer than the sequence; 24 and 40 are
# longer than a shard on 4 and 8 devices; rates 3 and 5 divide no segment.
CASES = {
  "mixed_causal_gqa": (8, 2, 53, (5, 24, 100), (1, 3, 2), {"is_causal": True}),
  "mixed_segments": (4, 4, 53, (8, 40), (3, 5), {"segment_ids": "padded"}),
  "mqa_rates": (4, 1, 48, (12, 48), (2, 4), {}),
}


def _case(name):
  heads, kv_heads, length, w, r, options = CASES[name]
  options = dict(options)
  if options.get("segment_ids") == "padded":
    options["segment_ids"] = padded_segments(2, length)
  args = qkv(2, length, heads, kv_heads, 8, seed=5)
  return args, dict(segment_lengths=w, dilation_rates=r, **options)


# One reference function per case: compiled once for every device count.
REFERENCES = {name: functools.partial(reference_dilated_attention, **_case(name)[1]) for name in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("devices", [None, 2, 4, 8])
def test_matches_reference(devices, case):
  args, options = _case(case)
  mesh = None if devices is None else make_mesh((devices,), ("seq",))
  fn = lambda q, k, v: dilated_attention(q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, **options)
  compare_with_reference(fn, REFERENCES[case], args, TOL)


def test_sub_rings_with_the_late_dkv_backward(monkeypatch):
  """The backward GPUs and TPUs run (dK/dV one step behind their K/V; the local K/V's
  compute in two halves of its keys, the last under the dK/dV's send home:
  `_ring.OwnHalves`) over sub-rings of 2 devices and a dilated ring of 8, here on CPU:
  outputs and gradients against float64."""
  monkeypatch.setattr(jax_ring._ring, "LATE_DKV_PLATFORMS", ("cpu",))
  halves, splits = jax_ring._ring.own_halves, []
  monkeypatch.setattr(jax_ring._ring, "own_halves", lambda *a: splits.append(halves(*a)) or splits[-1])
  jax.clear_caches()  # the switch is read while tracing
  args = qkv(2, 128, 4, 2, 8, seed=9)
  # Segments of 32 over shards of 16 (two key blocks: halves) and of 128 at rate 2 (8
  # selected keys a shard: one block, unsplit).
  options = dict(segment_lengths=(32, 128), dilation_rates=(1, 2), is_causal=True)
  mesh = make_mesh((8,), ("seq",))
  fn = lambda q, k, v: dilated_attention(q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, **options)
  compare_with_reference(fn, functools.partial(reference_dilated_attention, **options), args, TOL)
  assert {s is not None for s in splits} == {True, False}, splits


def test_same_output_on_every_device_count():
  args, options = _case("mixed_causal_gqa")
  outs = [
    dilated_attention(*args, mesh=make_mesh((d,), ("seq",)), block_sizes=SMALL_BLOCKS, **options)
    for d in (1, 2, 4, 8)
  ]
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], rtol=0, atol=2e-6)


def test_shard_length_not_dividing_rate_on_a_ring():
  # 40 tokens on 4 devices: shards of 10, segments of 20 span 2 devices, rate 3 does
  # not divide the shard, so the slot offsets differ from device to device.
  args = qkv(1, 40, 6, 2, 8, seed=2)
  mesh = make_mesh((4,), ("seq",))
  options = dict(segment_lengths=(20,), dilation_rates=(3,), is_causal=True)
  fn = lambda q, k, v: dilated_attention(q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, **options)
  ref = lambda q, k, v: reference_dilated_attention(q, k, v, **options)
  compare_with_reference(fn, ref, args, TOL)


# Local patterns run chunk by chunk; pass_tokens=2 makes each chunk the lcm of the
# local segments (32 tokens, 8 on 8 devices): 128 tokens give 4 chunks on 1 device, 2 on
# 3 (shards of 64 there, the last one all padding) and 2 on 8 devices, where the
# 32-token segments span 2 devices and run as a sub-ring beside the chunks.
CHUNKED = dict(
  segment_lengths=(4, 8, 32), dilation_rates=(1, 2, 4), is_causal=True, segment_ids=padded_segments(2, 128)
)
CHUNKED_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=8, pass_tokens=2)
CHUNKED_REFERENCE = functools.partial(reference_dilated_attention, **CHUNKED)


@pytest.mark.parametrize("devices, chunks", [(None, 4), (3, 2), (8, 2)])
def test_local_patterns_chunk_by_chunk(devices, chunks):
  mesh = None if devices is None else make_mesh((devices,), ("seq",))
  length, kv_heads = 128, 2
  shard, patterns = plan(length, devices or 1, CHUNKED["segment_lengths"], CHUNKED["dilation_rates"])
  cfg = DilatedConfig(None, devices or 1, patterns, True, 1.0, None, CHUNKED_BLOCKS, kv_heads, 4)
  chunk, local = local_chunk(cfg, shard)
  assert (shard // chunk, len(local)) == (chunks, 2 if devices == 8 else 3)
  args = qkv(2, length, 8, kv_heads, 8, seed=4)
  fn = lambda q, k, v: dilated_attention(q, k, v, mesh=mesh, block_sizes=CHUNKED_BLOCKS, **CHUNKED)
  compare_with_reference(fn, CHUNKED_REFERENCE, args, TOL)


def test_chunks_bound_the_memory_of_local_patterns():
  # 8 devices x 8192 tokens, two local patterns: chunks of 512 tokens (the lcm; on CPU
  # pass_tokens is 512, 128 per kv head) against the whole shard at once (a pass_tokens
  # no chunk reaches).
  mesh = make_mesh((8,), ("seq",))
  q, k, v = qkv(1, 65536, 4, 4, 32)
  temp = {}
  for name, blocks in (("chunks", None), ("shard", jax_ring.BlockSizes(pass_tokens=1 << 30))):
    fn = lambda q, k, v, blocks=blocks: dilated_attention(
      q, k, v, segment_lengths=(256, 512), dilation_rates=(1, 2), mesh=mesh, block_sizes=blocks
    )
    loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v))
    mem = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis()
    temp[name] = mem.temp_size_in_bytes
    args = mem.argument_size_in_bytes
  assert temp["chunks"] <= 3 * args, (temp, args)
  assert temp["chunks"] < temp["shard"] / 2, temp


EXPECTED_T8_W4_R2 = {
  # head 0 keeps offsets 0, 2 of each segment of 4; head 1 keeps offsets 1, 3.
  0: [
    [1, 0, 1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1, 0, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1, 0, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
  ],
  1: [
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 0, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 0, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1, 0, 1],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1, 0, 1],
  ],
}


def _visibility(fn):
  """Which key each query sees, read from outputs: zero queries weigh the keys they see
  equally, and one-hot values make output[i, n, j] > 0 exactly when i sees j."""
  t, n = 8, 2
  q = jnp.zeros((1, t, n, t), jnp.float32)
  k = jnp.zeros((1, t, n, t), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32)[None, :, None, :], (1, t, n, t))
  out = fn(q, k, v)[0]  # [T, N, T]
  return np.asarray(out > 0).astype(int).transpose(1, 0, 2)  # [N, T, T]


@pytest.mark.parametrize("devices", [None, 2, 4])
def test_literal_pattern_t8_w4_r2(devices):
  expected = np.array([EXPECTED_T8_W4_R2[0], EXPECTED_T8_W4_R2[1]])
  mesh = None if devices is None else make_mesh((devices,), ("seq",))
  got = _visibility(
    lambda q, k, v: dilated_attention(q, k, v, segment_lengths=(4,), dilation_rates=(2,), mesh=mesh)
  )
  np.testing.assert_array_equal(got, expected)
  ref = _visibility(
    lambda q, k, v: reference_dilated_attention(q, k, v, segment_lengths=(4,), dilation_rates=(2,))
  )
  np.testing.assert_array_equal(ref, expected)


def test_unselected_query_gets_zero_and_zero_gradient():
  # One pattern with rate 4 on 2 heads: offsets 2 and 3 are selected by no head.
  q, k, v = qkv(1, 16, 2, 2, 8)
  fn = lambda q, k, v: dilated_attention(q, k, v, segment_lengths=(8,), dilation_rates=(4,))
  out, vjp = jax.vjp(fn, q, k, v)
  pos = np.arange(16) % 8 % 4
  assert bool(jnp.all(out[:, pos >= 2] == 0))
  dq, dk, dv = vjp(jnp.ones_like(out))
  assert bool(jnp.all(jnp.isfinite(dq)))
  assert bool(jnp.all(dq[:, pos >= 2] == 0))
  assert bool(jnp.all(dk[:, pos >= 2] == 0))


def _compiled(mesh, length, rate, heads=2):
  q, k, v = qkv(1, length, heads, heads, 16)
  fn = lambda q, k, v: dilated_attention(
    q, k, v, segment_lengths=(length // 4,), dilation_rates=(rate,), mesh=mesh
  )
  loss = lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()


def test_hlo_traffic_falls_by_the_rate_and_no_all_gather():
  # 8 devices, 512 tokens: shards of 64, segments of 128 span 2 devices (a sub-ring).
  mesh = make_mesh((8,), ("seq",))
  moved = {}
  for rate in (1, 2, 4):
    ops = collective_bytes(_compiled(mesh, 512, rate))
    assert not {"all-gather", "all-to-all", "reduce-scatter"} & set(ops), f"rate {rate}: {ops}"
    moved[rate] = ops["collective-permute"]
  assert moved[1] > 0
  for rate in (2, 4):
    assert moved[1] / moved[rate] == pytest.approx(rate, rel=0.05), moved


def test_local_segments_need_no_communication():
  mesh = make_mesh((4,), ("seq",))
  text = _compiled(mesh, 256, 2).as_text()  # segments of 64 = one shard each
  assert "collective-permute" not in text


def test_memory_grows_linearly_with_length():
  mesh = make_mesh((8,), ("seq",))
  # Heads per pass change with short shards: from 4096 to 8192 tokens temp grows 2.8x
  # with the CPU default of 512 tokens x heads a pass (6.0 -> 17.1 MB; 1.9x with 4096,
  # from 9.1 MB), then 1.16x to 16384. Linear growth is checked from 8192 on.
  temp = {}
  for length in (8192, 16384):
    q, k, v = qkv(1, length, 4, 4, 32)
    fn = lambda q, k, v: dilated_attention(
      q, k, v, segment_lengths=(256, 1024, 4096), dilation_rates=(1, 2, 4), mesh=mesh
    )
    loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v))
    mem = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis()
    temp[length] = mem.temp_size_in_bytes
  assert temp[16384] <= 2.2 * temp[8192], temp


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (dict(segment_lengths=(4, 8), dilation_rates=(1,)), "same length"),
    (dict(segment_lengths=(), dilation_rates=()), "must not be empty"),
    (dict(segment_lengths=(0,), dilation_rates=(1,)), "segment_lengths"),
    (dict(segment_lengths=(4,), dilation_rates=(-2,)), "dilation_rates"),
    (dict(segment_lengths=(4.5,), dilation_rates=(1,)), "segment_lengths"),
    (dict(segment_lengths=4, dilation_rates=(1,)), "segment_lengths"),
    (dict(segment_lengths=(4,), dilation_rates=(1,), mesh="cpu"), "mesh"),
  ],
)
def test_bad_patterns_raise(kwargs, match):
  q, k, v = qkv(1, 16, 2, 2, 8)
  with pytest.raises((ValueError, TypeError), match=match):
    dilated_attention(q, k, v, **kwargs)
  if "mesh" not in kwargs:
    with pytest.raises((ValueError, TypeError), match=match):
      reference_dilated_attention(q, k, v, **kwargs)


def test_bad_arrays_raise():
  q, k, v = qkv(1, 16, 3, 2, 8)
  with pytest.raises(ValueError, match="num_heads=3"):
    dilated_attention(q, k, v, segment_lengths=(4,), dilation_rates=(1,))
  q, k, v = qkv(1, 16, 2, 2, 8)
  with pytest.raises(ValueError, match="seq_axis='rows'"):
    dilated_attention(
      q, k, v, segment_lengths=(4,), dilation_rates=(1,), mesh=make_mesh((2,), ("seq",)), seq_axis="rows"
    )
