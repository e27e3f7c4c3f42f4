"""`jax_ring.ring_mesh`: neighbours along the ring axis (last to first included) are
linked chips on TPU slices, and on GPU/CPU each process's devices stay together."""

import itertools
import types

import jax
import numpy as np
import pytest

import jax_ring
from jax_ring._topology import device_grid, grid_cycle


def _linked(a, b) -> bool:
  return sum(abs(x - y) for x, y in zip(a, b)) == 1


def _chips(shape, cores=1):
  """Stand-ins for a TPU slice's devices: one per (chip, core), with coordinates."""
  points = itertools.product(*[range(s) for s in shape])
  return [
    types.SimpleNamespace(coords=list(p), core_on_chip=c, platform="tpu", id=i * cores + c, process_index=0)
    for i, p in enumerate(points)
    for c in range(cores)
  ]


@pytest.mark.parametrize("shape", [(2, 4), (8, 8), (16, 16), (4, 4, 4), (2, 2, 2), (3, 4), (2, 4, 1)])
def test_grid_cycle_is_hamiltonian(shape):
  cycle = grid_cycle(shape)
  assert sorted(cycle) == sorted(itertools.product(*[range(s) for s in shape]))
  assert all(_linked(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle)))


@pytest.mark.parametrize(
  "slice_shape, axis_shapes, axis_names",
  [
    ((8, 8, 1), (64,), ("seq",)),  # v5e 8x8, one ring
    ((16, 16, 1), (256,), ("seq",)),  # v5e 16x16
    ((4, 4, 4), (64,), ("seq",)),  # v5p 4x4x4
    ((2, 4, 1), (8,), ("seq",)),  # v5e / v6e 2x4
    ((8, 8, 1), (8, 8), ("data", "seq")),  # 8 rings of 8
    ((16, 16, 1), (16, 16), ("seq", "data")),  # the ring axis first
    ((4, 4, 4), (4, 16), ("data", "seq")),
  ],
)
def test_every_ring_step_crosses_one_link(slice_shape, axis_shapes, axis_names):
  devices = device_grid(axis_shapes, axis_names, "seq", _chips(slice_shape))
  ring_size = axis_shapes[axis_names.index("seq")]
  grid = np.moveaxis(devices, axis_names.index("seq"), -1).reshape(-1, ring_size)
  for ring in grid:
    for a, b in zip(ring, np.roll(ring, -1)):
      assert _linked(a.coords, b.coords), (a.coords, b.coords)
  assert len({d.id for d in devices.flat}) == devices.size


def test_row_major_order_is_what_it_fixes():
  """jax.make_mesh's row-major order on an 8x8 slice: ring neighbours such as the end
  of one row and the start of the next are not linked."""
  chips = _chips((8, 8, 1))
  assert not all(_linked(chips[i].coords, chips[(i + 1) % 64].coords) for i in range(64))


def test_processes_stay_together_on_gpu_and_cpu():
  """Devices of 4 processes, listed interleaved: each ring of 8 holds two whole
  processes' devices, so it crosses a host boundary twice (the least it can)."""
  devices = [types.SimpleNamespace(platform="gpu", id=i, process_index=i % 4) for i in range(16)]
  for ring in device_grid((2, 8), ("data", "seq"), "seq", devices):
    processes = [d.process_index for d in ring]
    assert sum(a != b for a, b in zip(processes, np.roll(processes, -1))) == 2, processes


def test_cpu_mesh_runs_ring_attention():
  mesh = jax_ring.ring_mesh((2, 4), ("data", "seq"), devices=jax.devices()[:8])
  assert mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
  q = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 4, 16))
  out = jax_ring.ring_attention(q, q, q, mesh=mesh, batch_axis="data", is_causal=True)
  ref = jax_ring.reference_attention(q, q, q, is_causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match=r"ring_axis='ring' is not one of"):
    jax_ring.ring_mesh((8,), ("seq",), ring_axis="ring")
  with pytest.raises(ValueError, match=r"needs 4 devices; got 8"):
    jax_ring.ring_mesh((4,), ("seq",), devices=jax.devices()[:8])
