"""Core ring attention against the float64 dense reference."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, padded_segments, qkv
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import reference_attention, ring_attention
from jax_ring._kernel import MaskSpec, block_bounds, block_mask, tile_class
from jax_ring.hlo import ring_overlap

TOL = 1e-5
SMALL_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=16, kv_heads=1)  # several passes per call

# name -> (heads, kv_heads, length, options); lengths are deliberately awkward.
CASES = {
  "full": (4, 4, 64, {}),
  "causal": (4, 4, 61, {"is_causal": True}),
  "gqa_causal": (8, 2, 64, {"is_causal": True}),
  "mqa": (4, 1, 50, {}),
  "segments_padding": (4, 2, 64, {"segment_ids": "padded"}),
  "window": (4, 2, 70, {"local_window_size": (9, 4)}),
  "causal_window": (4, 2, 64, {"is_causal": True, "local_window_size": 6}),
}


def _options(case):
  heads, kv_heads, length, options = CASES[case]
  options = dict(options)
  if options.get("segment_ids") == "padded":
    options["segment_ids"] = padded_segments(2, length)
  return options


OPTIONS = {case: _options(case) for case in CASES}
# One reference function per case: compiled once, however many device counts use it.
REFERENCES = {case: functools.partial(reference_attention, **OPTIONS[case]) for case in CASES}


def _run_case(devices, case, **extra):
  heads, kv_heads, length, _ = CASES[case]
  options = OPTIONS[case]
  mesh = make_mesh((devices,), ("seq",))
  args = qkv(2, length, heads, kv_heads, 16)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, **options, **extra)
  return compare_with_reference(fn, REFERENCES[case], args, TOL)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_matches_reference(devices, case):
  _run_case(devices, case)


def test_length_not_dividing_devices_default_blocks():
  mesh = make_mesh((8,), ("seq",))
  args = qkv(1, 1000, 8, 2, 16)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True)
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, TOL)


def test_local_blocks_padded_when_shard_exceeds_block():
  # 4 devices x 37 tokens, blocks of 8/16: every shard is padded locally to 48.
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 148, 4, 2, 8)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, layout="contiguous", block_sizes=SMALL_BLOCKS)
  compare_with_reference(fn, reference_attention, args, TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_two_dimensional_mesh_batch_sharded(causal):
  mesh = make_mesh((2, 4), ("data", "seq"))
  args = qkv(2, 64, 4, 2, 16)
  seg = padded_segments(2, 64)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, batch_axis="data", is_causal=causal, segment_ids=seg, block_sizes=SMALL_BLOCKS
  )
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=causal, segment_ids=seg)
  compare_with_reference(fn, ref, args, TOL)


def test_heads_sharded_gqa():
  mesh = make_mesh((4, 2), ("seq", "heads"))
  args = qkv(1, 48, 8, 2, 16)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, head_axis="heads", is_causal=True, block_sizes=SMALL_BLOCKS
  )
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, TOL)


def test_query_that_sees_nothing_gets_exact_zero_and_zero_gradient():
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(1, 32, 4, 2, 8)
  seg = jnp.asarray(np.r_[np.zeros(20), -np.ones(12)].astype(np.int32))[None]
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, segment_ids=seg, block_sizes=SMALL_BLOCKS)
  out, vjp = jax.vjp(fn, q, k, v)
  assert np.all(np.asarray(out)[:, 20:] == 0)
  dq, dk, dv = (np.asarray(g) for g in vjp(jnp.ones_like(out)))
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  assert np.all(dq[:, 20:] == 0)
  assert np.all(dk[:, 20:] == 0) and np.all(dv[:, 20:] == 0)
  # Queries whose only candidates are padding keys: still exactly 0, never NaN.
  seg2 = jnp.asarray(np.r_[np.zeros(8), -np.ones(24)].astype(np.int32))[None]
  out2 = np.asarray(ring_attention(q, k, v, mesh=mesh, segment_ids=seg2, is_causal=True, local_window_size=2))
  assert np.all(np.isfinite(out2)) and np.all(out2[:, 8:] == 0)


@pytest.mark.parametrize("length", [48, 45])
def test_auto_axis_mesh(length):
  devices = np.asarray(jax.devices()[:4])
  mesh = jax.sharding.Mesh(devices, ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  args = qkv(1, length, 4, 2, 8)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, block_sizes=SMALL_BLOCKS)
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, TOL)


def test_inside_user_jit():
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 64, 4, 2, 8)
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, block_sizes=SMALL_BLOCKS))
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, TOL)


def test_same_result_on_every_device_count():
  args = qkv(1, 40, 4, 2, 8)
  outs = [
    ring_attention(*args, mesh=make_mesh((p,), ("seq",)), is_causal=True, block_sizes=SMALL_BLOCKS)
    for p in (1, 2, 4, 8)
  ]
  for o in outs[1:]:
    np.testing.assert_allclose(np.asarray(o), np.asarray(outs[0]), rtol=2e-5, atol=2e-6)


def _compiled_fwd_bwd(mesh, length, heads=8, head_dim=64, **options):
  sharding = NamedSharding(mesh, P(None, "seq"))
  sds = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32, sharding=sharding)

  def fwd_bwd(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, **options), q, k, v)
    return out, vjp(g)

  return jax.jit(fwd_bwd).lower(sds, sds, sds, sds).compile()


ZIGZAG = {"is_causal": True, "layout": "zigzag"}


@pytest.mark.parametrize("options", [{}, ZIGZAG], ids=["full", "causal_zigzag"])
def test_hlo_uses_only_collective_permute(options):
  text = _compiled_fwd_bwd(make_mesh((8,), ("seq",)), 1024, **options).as_text()
  assert "collective-permute" in text
  for op in ("all-gather", "all-to-all", "reduce-scatter"):
    assert op not in text, f"{op} in the compiled ring attention"


def test_cpu_ring_step_meets_once_per_transfer():
  """On CPU every collective-permute is a meeting of all the ring's devices, so a ring
  step sends what it holds as one bundle: K, V, their int32 positions and segment ids
  in the forward; the same, then the step's dK and dV, in the backward."""
  mesh = make_mesh((4,), ("seq",))
  sds = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
  options = {"is_causal": True, "segment_ids": padded_segments(1, 64)}
  attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, **options)
  forward = jax.jit(attend).lower(sds, sds, sds).compile()
  assert [step.synchronous for step in ring_overlap(forward)] == [1]
  both = _compiled_fwd_bwd(mesh, 64, heads=4, head_dim=16, **options)
  assert sorted(step.synchronous for step in ring_overlap(both)) == [1, 2]


def test_bundled_transfer_is_bit_exact():
  """What `_bundled` joins and splits comes back bit for bit, whatever the dtypes:
  NaN payloads, -0.0, bfloat16 beside int32 (sent as uint16 pairs), booleans apart."""
  mesh = make_mesh((4,), ("seq",))
  bits = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000], np.uint32)
  tree = {
    "f32": jnp.tile(jnp.asarray(bits.view(np.float32)), 8).reshape(4, 8),
    "bf16": jnp.arange(4 * 6, dtype=jnp.bfloat16).reshape(4, 6) - 3,
    "i32": jnp.arange(4 * 3, dtype=jnp.int32).reshape(4, 3) * -7,
    "flag": jnp.arange(4 * 5).reshape(4, 5) % 3 == 0,
  }
  perm = jax_ring._ring.ring_permutation(4, 1)
  send = lambda x: jax.lax.ppermute(x, "seq", perm)
  spec = jax.tree.map(lambda _: P("seq"), tree)
  tree = jax.device_put(tree, NamedSharding(mesh, P("seq")))
  moved = jax.jit(
    jax.shard_map(lambda t: jax_ring._ring._bundled(t, send), mesh=mesh, in_specs=(spec,), out_specs=spec)
  )(tree)
  for name, x in tree.items():
    expected = np.roll(np.asarray(x), 1, axis=0)
    got = np.asarray(moved[name])
    assert got.dtype == expected.dtype, name
    assert got.tobytes() == expected.tobytes(), name


def test_memory_per_device_is_linear_and_divided_by_devices():
  """Per-device memory of forward+backward, from the compiler (deterministic).

  T=32768, N=8, H=64, float32, default block sizes (which send one kv head per pass
  around the ring at these shard lengths): temp at 8 devices at most 1/4 of one
  device's, and linear in the length.
  """
  mesh8 = make_mesh((8,), ("seq",))
  stats = lambda mesh, t, **o: _compiled_fwd_bwd(mesh, t, **o).memory_analysis()
  s8_16k, s8_32k, s1_32k = stats(mesh8, 16384), stats(mesh8, 32768), stats(make_mesh((1,), ("seq",)), 32768)
  total = lambda s: s.temp_size_in_bytes + s.argument_size_in_bytes
  assert s8_32k.temp_size_in_bytes <= 2.2 * s8_16k.temp_size_in_bytes
  assert total(s8_32k) <= total(s1_32k) / 4, (total(s8_32k), total(s1_32k))
  assert s8_32k.temp_size_in_bytes <= s1_32k.temp_size_in_bytes / 4, (s8_32k, s1_32k)


def test_calls_in_one_program_do_not_each_hold_an_accumulator():
  """Every layer of a model is a ring call in one program. Each call's running output
  starts from zeros computed from its queries: from constant zeros, XLA shares one
  array among the calls and copies it for each at the program's start, all live at
  once (17 x 16 MiB per device in Gemma 3 270M's prefill at 32K tokens on 8 devices).
  Compiled, four causal calls hold less than one accumulator more than one call."""
  mesh = make_mesh((8,), ("seq",))
  t, h = 2048, 64
  q = jax.ShapeDtypeStruct((1, t, 4, h), jnp.float32, sharding=NamedSharding(mesh, P(None, "seq")))

  def temp(calls):
    def layers(x):
      for i in range(calls):
        kv = x[:, :, :1] * (i + 1.5)
        x = jax_ring.ring_attention(x, kv, kv, mesh=mesh, seq_axis="seq", is_causal=True)
      return x

    return jax.jit(layers).lower(q).compile().memory_analysis().temp_size_in_bytes

  accumulator = t // 8 * 4 * h * 4  # float32, per device
  one, four = temp(1), temp(4)
  assert four - one < accumulator, (one, four, accumulator)


def test_one_head_per_pass_divides_ring_buffers_by_heads():
  """All 8 heads in one pass hold 8x the ring's buffers of one head per pass: at 8
  devices, one head per pass takes at most 1/4 of the all-at-once temp memory."""
  mesh8 = make_mesh((8,), ("seq",))
  temp = lambda h: (
    _compiled_fwd_bwd(mesh8, 16384, block_sizes=jax_ring.BlockSizes(kv_heads=h))
    .memory_analysis()
    .temp_size_in_bytes
  )
  one, every = temp(1), temp(8)
  assert one <= every / 4, (one, every)


def test_heads_per_pass_chosen_by_shard_length():
  default = jax_ring.BlockSizes()
  assert [default.tokens_per_pass(p) for p in ("cpu", "gpu", "tpu")] == [512, 32768, 4096]
  # On CPU (these tests' backend): at most 512 local tokens x heads per pass.
  assert [default.head_groups(8, t) for t in (64, 128, 256, 512, 4096)] == [1, 2, 4, 8, 8]
  bs = jax_ring.BlockSizes(pass_tokens=4096)
  assert [bs.head_groups(8, t) for t in (256, 512, 1024, 4096, 65536)] == [1, 1, 2, 8, 8]
  assert bs.head_groups(3, 2048) == 3 and bs.head_groups(2, 1000) == 1
  assert jax_ring.BlockSizes(kv_heads=2).head_groups(8, 256) == 4
  assert jax_ring.BlockSizes(kv_heads=8).head_groups(8, 65536) == 1
  # A cuDNN ring step takes up to 256K local tokens x kv heads a pass, on any platform.
  assert default.tokens_per_pass("cpu", kernel="cudnn") == 262144
  assert [default.head_groups(8, t, kernel="cudnn") for t in (32768, 65536, 131072)] == [1, 2, 4]
  assert bs.head_groups(8, 4096, kernel="cudnn") == 8  # an explicit pass_tokens wins


def test_tiles_chosen_by_devices_per_core():
  from jax_ring._tiles import default_tiles, fit_tile_budget, local_blocks

  assert default_tiles("cpu", 8, cores=2) == (256, 256)  # simulated devices share cores
  assert default_tiles("cpu", 8, cores=2, unit=1024) == (1024, 128)
  assert default_tiles("cpu", 2, cores=2) == default_tiles("gpu", 8, cores=2) == (1024, 512)
  bs = jax_ring.BlockSizes()
  fits = lambda length: local_blocks(length, bs, devices=1)  # a device has its own cores
  # Blocks divide the shard where a multiple of 8 (at least 128) does: no padding.
  assert [fits(t) for t in (4096, 1536, 1000, 100)] == [
    (4096, 1024, 512),
    (1536, 768, 512),
    (1000, 1000, 200),
    (100, 100, 100),
  ]
  assert local_blocks(1000, jax_ring.BlockSizes(block_q=8), devices=1) == (1000, 8, 200)
  assert local_blocks(700, bs, devices=1) == (768, 768, 256)  # no such divisor of 700: padded
  assert local_blocks(4096, bs, devices=10**6) == (4096, 256, 256)
  # Shared cores, a shard of 257 to 1024 tokens (a multiple of 128, not in halves): one
  # query block, key blocks of 128.
  shared = lambda length, layout=None: local_blocks(length, bs, devices=10**6, layout=layout)
  assert [shared(t) for t in (1024, 512, 384, 256, 1000, 2048)] == [
    (1024, 1024, 128),
    (512, 512, 128),
    (384, 384, 128),
    (256, 256, 256),
    (1000, 200, 200),
    (2048, 256, 256),
  ]
  assert shared(1024, "zigzag") == (1024, 256, 256)
  # zigzag: blocks within a half, so causal tiles can be skipped
  assert local_blocks(256, bs, devices=10**6, layout="zigzag") == (256, 128, 128)
  assert local_blocks(1024, bs, devices=1, layout="zigzag") == (1024, 512, 512)
  assert local_blocks(600, bs, devices=1, layout="zigzag") == (600, 300, 300)
  assert local_blocks(1300, bs, devices=1, layout="zigzag") == (1536, 512, 512)  # halves unaligned
  # The score tile budget: automatic blocks halve (not below 128) to fit it.
  assert fit_tile_budget(1024, 512, 4, bs) == (512, 512)  # 4 heads x 512 x 512 = 2^20
  assert fit_tile_budget(448, 448, 8, bs) == (224, 448)
  assert fit_tile_budget(256, 256, 64, bs) == (128, 128)
  assert fit_tile_budget(1024, 512, 4, jax_ring.BlockSizes(block_q=1024)) == (1024, 256)


@pytest.mark.parametrize(
  "devices, length, options",
  [
    (2, 2048, {}),
    (1, 1300, {"is_causal": True}),
    (1, 1200, {"is_causal": True}),
    (2, 1200, {"is_causal": True}),
  ],
  ids=[
    "2dev_1024x512_tiles",
    "1dev_causal_512_tiles_padded",
    "1dev_zigzag_exact_600x200",
    "2dev_zigzag_exact_300",
  ],
)
def test_default_tiles_when_devices_have_cores(devices, length, options):
  """Default BlockSizes on a mesh with no more devices than cores: the large tiles
  (1024 x 512 halved to the tile budget, or 512 x 512 where 1024 does not divide; exact
  divisors of the shard where they exist) against the reference."""
  from jax_ring._tiles import local_blocks

  layout = "zigzag" if options else "contiguous"
  local = local_blocks(length // devices, jax_ring.BlockSizes(), devices=devices, layout=layout)
  expected = {(2, 2048): (1024, 512), (1, 1300): (512, 512), (1, 1200): (600, 200), (2, 1200): (300, 300)}
  expected = expected[devices, length]
  assert local[1:] == expected or devices > (os.cpu_count() or 1), local
  mesh = make_mesh((devices,), ("seq",))
  args = qkv(1, length, 4, 2, 8)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, **options)
  compare_with_reference(fn, lambda q, k, v: reference_attention(q, k, v, **options), args, TOL)


def test_max_length_budget_at_8_devices():
  """B=1, N=8, H=64, float32: 512K tokens over 8 devices compile to at most 1 GiB per
  device (temp + arguments) for forward+backward (issue 7's max-length target)."""
  stats = _compiled_fwd_bwd(make_mesh((8,), ("seq",)), 512 * 1024).memory_analysis()
  assert stats.temp_size_in_bytes + stats.argument_size_in_bytes <= 2**30


@functools.partial(jax.jit, static_argnums=0)
def _classes(spec, q_pos, k_pos, q_seg, k_seg):
  """Every tile's class, and whether its mask shows anything / everything: [nq, nk]."""
  qb, kb = block_bounds(q_pos, q_seg), block_bounds(k_pos, k_seg, spec.has_padding)
  pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)

  def one(i, j):
    mask = block_mask(
      spec, q_pos[i], k_pos[j], None if q_seg is None else q_seg[i], None if k_seg is None else k_seg[j]
    )
    mask = jnp.ones((1,), bool) if mask is None else mask
    return tile_class(spec, pick(qb, i), pick(kb, j)), jnp.any(mask), jnp.all(mask)

  i, j = jnp.meshgrid(jnp.arange(q_pos.shape[0]), jnp.arange(k_pos.shape[0]), indexing="ij")
  return jax.vmap(jax.vmap(one))(i, j)


@pytest.mark.parametrize(
  "spec",
  [
    MaskSpec(is_causal=True),
    MaskSpec(window=(5, 3)),
    MaskSpec(is_causal=True, window=(9, 0), has_padding=True),
    MaskSpec(has_padding=True),
    MaskSpec(),
  ],
  ids=["causal", "window", "causal_window_padding", "padding", "segments_only"],
)
def test_tile_class_from_bounds_agrees_with_the_mask(spec):
  """A tile is skipped only if its mask hides everything and runs unmasked only if it
  hides nothing, for arbitrary positions and ids; for blocks of consecutive positions
  (contiguous and zigzag blocks) and one id per block row the classes are exact."""
  rng = np.random.default_rng(0)
  b, nq, nk, bq, bk = 2, 6, 7, 4, 3
  exact_seen = set()
  for trial in range(40):
    sorted_case = trial % 2 == 0
    if sorted_case:  # runs of consecutive positions, one id per block row
      q_pos = rng.integers(0, 60, (nq, 1)) + np.arange(bq)
      k_pos = rng.integers(0, 60, (nk, 1)) + np.arange(bk)
      q_seg = np.repeat(rng.integers(0, 2, (nq, b, 1)), bq, axis=2)
      k_seg = np.repeat(rng.integers(0, 2, (nk, b, 1)), bk, axis=2)
    else:
      q_pos = rng.integers(0, 60, (nq, bq))
      k_pos = rng.integers(0, 60, (nk, bk))
      q_seg = rng.integers(-1, 3, (nq, b, bq))
      k_seg = rng.integers(-1, 3, (nk, b, bk))
    if spec.has_padding:
      if not sorted_case:
        k_pos = np.where(rng.random(k_pos.shape) < (0.5 if trial % 4 == 1 else 0.1), -1, k_pos)
      k_pos[0] = -1  # a block of padding alone
      k_pos[1, -1] = -1  # a block ending in padding
    segs = trial % 3 != 2
    qs, ks = (jnp.asarray(q_seg), jnp.asarray(k_seg)) if segs else (None, None)
    cls, anything, everything = _classes(spec, jnp.asarray(q_pos), jnp.asarray(k_pos), qs, ks)
    cls, anything, everything = (np.asarray(x) for x in (cls, anything, everything))
    assert not np.any((cls == 0) & anything), trial
    assert not np.any((cls == 2) & ~everything), trial
    if sorted_case and (spec.positional or segs):
      np.testing.assert_array_equal(
        cls, np.where(anything, np.where(everything, 2, 1), 0), err_msg=str(trial)
      )
      exact_seen.update(np.unique(cls).tolist())
  assert exact_seen == {0, 1, 2}


@pytest.mark.parametrize(
  "devices, options, split",
  [
    (1, {"is_causal": True}, False),  # nothing goes home
    (2, {"is_causal": True, "segment_ids": padded_segments(2, 44)}, False),  # 3 key blocks a shard
    (2, {"is_causal": True, "segment_ids": padded_segments(2, 64)}, True),
    (3, {"is_causal": True}, True),
    (4, {"local_window_size": (12, 7), "layout": "contiguous"}, True),  # passes both ways
    (4, {"local_window_size": (12, 0), "layout": "contiguous"}, True),  # dK/dV home 2 devices on
    (8, {"is_causal": True, "kernel": "pallas", "segment_ids": padded_segments(2, 256)}, True),
  ],
)
def test_late_dkv_backward_matches_reference(monkeypatch, devices, options, split):
  """The backward that sends each shard's dK/dV one step behind its K/V (what GPUs and
  TPUs run, so that every transfer overlaps compute), run here on CPU: outputs and
  gradients against float64. Where the shard's keys split in halves of whole blocks,
  the local K/V's compute runs as two halves, the last under the send of the last
  pass's dK/dV home (`_ring.OwnHalves`); the test asserts where it did. Two head
  groups; shapes no other test uses, so no compiled program of the other scheme is
  reused."""
  monkeypatch.setattr(jax_ring._ring, "LATE_DKV_PLATFORMS", ("cpu",))
  late, halves = jax_ring._ring._pass_backward_late, jax_ring._ring.own_halves
  ran, splits = [], []
  monkeypatch.setattr(jax_ring._ring, "_pass_backward_late", lambda *a: ran.append(1) or late(*a))
  monkeypatch.setattr(jax_ring._ring, "own_halves", lambda *a: splits.append(halves(*a)) or splits[-1])
  jax.clear_caches()  # the switch is read while tracing: no cached trace of the other scheme
  t = options["segment_ids"].shape[1] if "segment_ids" in options else 44
  q, k, v = qkv(2, t, 4, 2, 16, seed=7)
  mesh = make_mesh((devices,), ("seq",))
  blocks = jax_ring.BlockSizes(block_q=8, block_kv=8, kv_heads=1)
  if "kernel" in options:  # 32-token shards in key blocks of 16
    blocks = jax_ring.BlockSizes(block_q=16, block_kv=16, kv_heads=1)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_sizes=blocks, **options)
  ref = lambda q, k, v: reference_attention(
    q, k, v, **{k: v for k, v in options.items() if k not in ("layout", "kernel")}
  )
  compare_with_reference(fn, ref, (q, k, v), 1e-5)
  assert ran, "the late dK/dV scheme was not traced"
  assert splits and all((s is not None) == split for s in splits), splits
