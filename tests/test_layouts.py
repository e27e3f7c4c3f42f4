"""Layouts: permutations, positions, every layout x mask against the reference, work."""

import functools

import jax
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, padded_segments, qkv
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import layouts, reference_attention, ring_attention, work_report


def test_positions_small_cases():
  np.testing.assert_array_equal(layouts.positions("contiguous", 2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
  np.testing.assert_array_equal(layouts.positions("striped", 2, 4), [[0, 2, 4, 6], [1, 3, 5, 7]])
  np.testing.assert_array_equal(layouts.positions("zigzag", 2, 4), [[0, 1, 6, 7], [2, 3, 4, 5]])


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_permutation_round_trip(layout, p):
  n = layouts.padded_length(layout, 100, p)
  x = np.arange(n)[None]
  there = layouts.to_layout(x, layout, p)
  np.testing.assert_array_equal(layouts.from_layout(there, layout, p), x)
  np.testing.assert_array_equal(np.asarray(there).reshape(p, -1), layouts.positions(layout, p, n // p))
  np.testing.assert_array_equal(
    layouts.permutation(layout, n, p)[layouts.inverse_permutation(layout, n, p)], np.arange(n)
  )


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_relayout_inside_shard_map_matches_permutation(layout, p):
  mesh = make_mesh((p,), ("seq",))
  n = layouts.padded_length(layout, 64, p)
  x = jax.device_put(np.arange(2 * n).reshape(2, n).astype(np.float32), NamedSharding(mesh, P(None, "seq")))
  f = jax.shard_map(
    lambda s: layouts.relayout_shard(s, layout, "seq", p),
    mesh=mesh,
    in_specs=P(None, "seq"),
    out_specs=P(None, "seq"),
  )
  g = jax.shard_map(
    lambda s: layouts.relayout_shard(s, layout, "seq", p, inverse=True),
    mesh=mesh,
    in_specs=P(None, "seq"),
    out_specs=P(None, "seq"),
  )
  moved = np.asarray(jax.jit(f)(x))
  np.testing.assert_array_equal(moved, np.asarray(layouts.to_layout(np.asarray(x), layout, p)))
  np.testing.assert_array_equal(np.asarray(jax.jit(g)(jax.device_put(moved, x.sharding))), np.asarray(x))


MASKS = {
  "causal": {"is_causal": True},
  "causal_window": {"is_causal": True, "local_window_size": (7, 0)},
  "window": {"local_window_size": (5, 9)},
  "segments_gqa": {"segment_ids": "padded", "is_causal": True},
}


LENGTH = 53  # divides neither 2p nor p*p


@functools.cache
def _mask_options(mask):
  options = dict(MASKS[mask])
  if options.get("segment_ids") == "padded":
    options["segment_ids"] = padded_segments(2, LENGTH)
  return options


@functools.cache
def _reference(mask):
  """One reference function per mask: its float64 program compiles once for the eight
  (layout, device count) cases that use it."""
  return functools.partial(reference_attention, **_mask_options(mask))


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("layout", ["striped", "zigzag"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_every_layout_and_mask_matches_reference(p, layout, mask):
  options = _mask_options(mask)
  mesh = make_mesh((p,), ("seq",))
  args = qkv(2, LENGTH, 4, 2, 8)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, layout=layout, block_sizes=jax_ring.BlockSizes(4, 4, kv_heads=1), **options
  )
  compare_with_reference(fn, _reference(mask), args, 1e-5)


def test_auto_layout_keeps_short_causal_shards_contiguous():
  short = layouts.SHORT_CAUSAL_SHARD
  assert layouts.resolve("auto", True, short) == "contiguous"
  assert layouts.resolve("auto", True, short + 1) == "zigzag"
  assert layouts.resolve("auto", True) == "zigzag"  # no shard length given (shard functions)
  assert layouts.resolve("auto", False, 10**6) == "contiguous"
  assert layouts.resolve("zigzag", True, 8) == "zigzag"  # a named layout is kept
  # work_report applies the same rule: 8 devices x 128 tokens is the contiguous table.
  blocks = jax_ring.BlockSizes(64, 64)
  report = lambda layout, n: work_report(
    layout=layout, num_devices=8, seq_len=n, is_causal=True, block_sizes=blocks
  )
  np.testing.assert_array_equal(report("auto", 8 * short), report("contiguous", 8 * short))
  np.testing.assert_array_equal(report("auto", 8 * 2 * short), report("zigzag", 8 * 2 * short))
  assert not np.array_equal(report("contiguous", 8 * short), report("zigzag", 8 * short))


def test_work_report_without_mask_counts_every_block_pair():
  got = work_report(layout="contiguous", num_devices=4, seq_len=64, block_sizes=jax_ring.BlockSizes(4, 8))
  np.testing.assert_array_equal(got, np.full((4, 4), (16 // 4) * (16 // 8)))


def test_work_report_causal_contiguous_by_hand():
  # p=4, 16 tokens, 4 per device, blocks of 2: 2x2 block pairs per step.
  got = work_report(
    layout="contiguous", num_devices=4, seq_len=16, is_causal=True, block_sizes=jax_ring.BlockSizes(2, 2)
  )
  # Step 0: own keys, the lower block triangle (3). Step s: keys of device d - s,
  # all 4 blocks when d >= s, none when they come from a later device.
  expected = [[3, 3, 3, 3], [0, 4, 4, 4], [0, 0, 4, 4], [0, 0, 0, 4]]
  np.testing.assert_array_equal(got, expected)


def test_work_report_causal_zigzag_by_hand():
  # Device i holds chunks i and 7-i. Own keys: (i,i), (7-i,i), (7-i,7-i) = 3 blocks.
  # Keys of device j != i: (7-i, j) always; (i, j) iff j < i; (7-i, 7-j) iff j > i: 2.
  got = work_report(
    layout="zigzag", num_devices=4, seq_len=16, is_causal=True, block_sizes=jax_ring.BlockSizes(2, 2)
  )
  np.testing.assert_array_equal(got, [[3] * 4] + [[2] * 4] * 3)
  full = 4  # block pairs per step without a mask
  assert got[1:].max() == full // 2  # the busiest device does half a full step


def test_work_report_window_skips_ring_steps():
  # 8 devices x 4 tokens, window (4, 0): only the previous device's keys are needed.
  got = work_report(
    layout="contiguous",
    num_devices=8,
    seq_len=32,
    is_causal=True,
    local_window_size=(4, 0),
    block_sizes=jax_ring.BlockSizes(4, 4),
  )
  np.testing.assert_array_equal(got[0], [1] * 8)
  np.testing.assert_array_equal(got[1], [0] + [1] * 7)
  assert not got[2:].any()


def test_work_report_striped_causal_balanced():
  got = work_report(
    layout="striped", num_devices=4, seq_len=64, is_causal=True, block_sizes=jax_ring.BlockSizes(4, 4)
  )
  # Every device runs the same number of blocks at every step.
  assert all(len(set(row)) == 1 for row in got.tolist())
