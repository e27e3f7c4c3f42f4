"""Causal zigzag ring steps by quadrants: the shard's queries as one block, a step whose
visible keys form one rectangle run without masks (`_ring.RingConfig.quadrants`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, padded_segments, qkv

import jax_ring
from jax_ring import BlockSizes, reference_attention, ring_attention
from jax_ring._kernel import MaskSpec, block_bounds
from jax_ring._ring import _quadrant_kind
from jax_ring._tiles import quadrant_tiles

TOL = 1e-5
MANY = 10**6  # devices per core: a mesh that shares the host's cores


def _zigzag(device: int, devices: int, length: int) -> np.ndarray:
  """Positions on `device`: chunks `device` and 2 * devices - 1 - device of the sequence."""
  half = length // 2
  chunk = lambda c: np.arange(c * half, (c + 1) * half, dtype=np.int32)
  return np.concatenate([chunk(device), chunk(2 * devices - 1 - device)])


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_quadrant_kind_follows_the_zigzag_schedule(devices):
  """Keys from an earlier device: every query sees exactly the keys' first half (1);
  from a later one: only the queries' second half sees them, all of them (2); its own
  keys: the diagonal, by masked tiles (0)."""
  length, block = 512, 128
  spec = MaskSpec(is_causal=True)
  for d in range(devices):
    q_halves = block_bounds(jnp.asarray(_zigzag(d, devices, length).reshape(2, -1)), None)
    for e in range(devices):
      k_pos = jnp.asarray(_zigzag(e, devices, length).reshape(-1, block))
      expected = 1 if e < d else 2 if e > d else 0
      assert int(_quadrant_kind(spec, q_halves, k_pos)) == expected, (d, e)


def test_quadrant_kind_of_other_masks_takes_the_tiles():
  """Windows, padding and positions that are not zigzag halves go by the masked tiles."""
  q_halves = block_bounds(jnp.asarray(_zigzag(1, 4, 512).reshape(2, -1)), None)
  k_pos = jnp.asarray(_zigzag(0, 4, 512).reshape(-1, 128))
  assert int(_quadrant_kind(MaskSpec(is_causal=True), q_halves, k_pos)) == 1
  assert int(_quadrant_kind(MaskSpec(is_causal=True, window=(100, 0)), q_halves, k_pos)) == 0
  padded = k_pos.at[0, :5].set(-1)
  assert int(_quadrant_kind(MaskSpec(is_causal=True, has_padding=True), q_halves, padded)) == 0
  reversed_keys = jnp.asarray(_zigzag(0, 4, 512)[::-1].reshape(-1, 128).copy())
  assert int(_quadrant_kind(MaskSpec(is_causal=True), q_halves, reversed_keys)) == 0


def test_quadrant_tiles_where_full_attention_is_one_block():
  auto = BlockSizes()
  assert quadrant_tiles(1024, 1, auto, devices=MANY) == (1024, 128)
  assert quadrant_tiles(512, 8, auto, devices=MANY) == (512, 128)
  assert quadrant_tiles(256, 1, auto, devices=MANY) == (256, 128)
  assert quadrant_tiles(2048, 1, auto, devices=MANY) is None  # longer shards: the halves' tiles
  assert quadrant_tiles(384, 1, auto, devices=MANY) is None  # halves of 192: not whole key blocks
  assert quadrant_tiles(1024, 16, auto, devices=MANY) is None  # a tile over TILE_ELEMENTS
  assert quadrant_tiles(1024, 1, BlockSizes(block_q=256), devices=MANY) is None
  assert quadrant_tiles(1024, 1, auto, devices=1) is None  # a device per core


@pytest.fixture
def quadrant_calls(monkeypatch):
  """Every mesh shares the cores (so 1 and 2 devices run by quadrants too); counts the
  programs traced by quadrants, forward and backward."""
  monkeypatch.setattr(jax_ring._tiles, "devices_here", lambda size: MANY)
  jax.clear_caches()  # read while tracing: a cached trace of the same shapes would skip it
  calls = {"forward": 0, "backward": 0}
  for name, wrapped in (
    ("forward", jax_ring._ring._quadrant_forward),
    ("backward", jax_ring._ring._quadrant_backward),
  ):

    def spy(*args, name=name, wrapped=wrapped):
      calls[name] += 1
      return wrapped(*args)

    monkeypatch.setattr(jax_ring._ring, f"_quadrant_{name}", spy)
  return calls


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_quadrants_match_reference(devices, quadrant_calls):
  """Output, lse and every gradient against float64, with GQA and a batch of 2."""
  mesh = make_mesh((devices,), ("seq",))
  args = qkv(2, 512 * devices, 4, 2, 16)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, is_causal=True, layout="zigzag", return_residual=True
  )
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, return_residual=True)
  compare_with_reference(fn, ref, args, TOL)
  assert quadrant_calls["forward"] >= 1 and quadrant_calls["backward"] >= 1


@pytest.mark.parametrize(
  "options",
  [
    {"segment_ids": padded_segments(1, 2048)},
    {"local_window_size": 300},
    {"block_sizes": BlockSizes(block_q=256)},
  ],
  ids=["segments", "window", "given_blocks"],
)
def test_masks_beyond_causal_keep_the_tiles(options, quadrant_calls):
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 2048, 2, 2, 16)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, layout="zigzag", **options)
  ref_options = {k: v for k, v in options.items() if k != "block_sizes"}
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, **ref_options)
  compare_with_reference(fn, ref, args, TOL)
  assert quadrant_calls == {"forward": 0, "backward": 0}


def test_quadrants_memory_beside_the_tiles(quadrant_calls):
  """Quadrants keep the residuals in a second form (the listed blocks and the second
  half of the queries): compiled memory per device stays within a quarter more than
  the halves' tiles take (at T=8192 on 8 devices, N=8, H=64: 15.2 against 13.0 MiB of
  temporaries)."""
  mesh = make_mesh((8,), ("seq",))
  sds = jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.float32)

  def temp_mib(block_sizes):
    attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, block_sizes=block_sizes)
    both = jax.jit(lambda q, k, v, g: jax.vjp(attend, q, k, v)[1](g))
    return both.lower(sds, sds, sds, sds).compile().memory_analysis().temp_size_in_bytes / 2**20

  quadrants, tiles = temp_mib(BlockSizes()), temp_mib(BlockSizes(block_q=256, block_kv=256))
  assert quadrant_calls["forward"] >= 1 and quadrant_calls["backward"] >= 1
  assert quadrants <= 1.25 * tiles, (quadrants, tiles)
