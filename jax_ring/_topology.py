"""Device order for rings: `ring_mesh`, a mesh whose ring axis follows physical links.

A ring's neighbours (last to first included) exchange a K/V shard at every step. On
TPU slices, chips are linked to their neighbours on a grid (v5e, v6e: 2-d; v4, v5p:
3-d with wrap-around); `jax.make_mesh` orders devices row by row, so on a large slice
ring neighbours such as (7, 0) -> (0, 1) are not linked, and XLA compiles their
transfers synchronous. Here each ring is a Hamiltonian cycle through linked chips: a
tile of the grid with as many chips as the ring has devices, walked as a cycle (a
grid with an even side has one: the rows in a snake, back along the first column).
Elsewhere (GPU, CPU) each process's devices are kept together, so a ring crosses a
host boundary as few times as it must.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def snake(shape: Sequence[int]) -> list[tuple[int, ...]]:
  """Every point of a box of `shape` once, each next to the one before (a
  boustrophedon: the last axis runs forward, then back, ...)."""
  if not shape:
    return [()]
  inner = snake(shape[1:])
  return [(i, *p) for i in range(shape[0]) for p in (inner if i % 2 == 0 else inner[::-1])]


def grid_cycle(shape: Sequence[int]) -> list[tuple[int, ...]]:
  """A Hamiltonian cycle of the grid graph of `shape` (neighbours differ by 1 in one
  coordinate), as the list of its points; where none exists (every side odd), the
  snake path, whose last point then needs a wrap-around link to the first."""
  shape = tuple(shape)
  n = math.prod(shape)
  if n <= 2 or len(shape) < 2:
    return snake(shape)
  # Walk along one axis ("columns", of width w) over the snake of the others ("rows",
  # m of them), back along column 0: a cycle when m is even. Pick the axis so it is.
  for axis in range(len(shape)):
    rest = shape[:axis] + shape[axis + 1 :]
    width, rows = shape[axis], math.prod(rest)
    if rows % 2 == 0 and width >= 2:
      order = snake(rest)
      put = lambda x, r, axis=axis: (*r[:axis], x, *r[axis:])
      cycle = [put(0, order[0])]
      for i, r in enumerate(order):
        xs = range(1, width) if i % 2 == 0 else range(width - 1, 0, -1)
        cycle += [put(x, r) for x in xs]
      cycle += [put(0, r) for r in reversed(order[1:])]
      return cycle
  return snake(shape)


def _tiles(shape: Sequence[int], size: int) -> tuple[int, ...]:
  """The tile of the grid for one ring of `size` chips: dividing every side, with an
  even side where it can (so it has a cycle), then as compact as possible."""
  best = None
  for tile in itertools.product(*[[d for d in range(1, s + 1) if s % d == 0] for s in shape]):
    if math.prod(tile) != size:
      continue
    closed = size <= 2 or any(t % 2 == 0 for t in tile if t > 1) and sum(t > 1 for t in tile) >= 2
    key = (not closed, sum(tile))
    if best is None or key < best[0]:
      best = (key, tile)
  if best is None:
    raise ValueError(f"no tile of {size} chips divides the slice {tuple(shape)}")
  return best[1]


def _chip_rings(devices, size: int) -> list[list]:
  """Rings of `size` devices, each a cycle through linked chips, from TPU coordinates
  (devices of one chip, `core_on_chip`, are neighbours too)."""
  place = {}
  for d in devices:
    place[(*d.coords, getattr(d, "core_on_chip", 0))] = d
  dims = len(next(iter(place)))
  lo = [min(p[i] for p in place) for i in range(dims)]
  shape = [max(p[i] for p in place) - lo[i] + 1 for i in range(dims)]
  if math.prod(shape) != len(place):
    raise ValueError(f"the devices' coordinates do not fill a box: {len(place)} devices in a {shape} box")
  tile = _tiles(shape, size)
  cycle = grid_cycle(tile)
  rings = []
  for corner in snake([s // t for s, t in zip(shape, tile)]):
    origin = [c * t + lo[i] for i, (c, t) in enumerate(zip(corner, tile))]
    rings.append([place[tuple(o + x for o, x in zip(origin, point))] for point in cycle])
  return rings


def _process_rings(devices, size: int) -> list[list]:
  """Rings of `size` devices with each process's devices together (ordered by
  process, then id), so a ring leaves a host only where it must."""
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def ring_mesh(axis_shapes, axis_names, *, ring_axis="seq", devices=None, axis_types=None) -> Mesh:
  """Like `jax.make_mesh`, with devices ordered so that neighbours along `ring_axis`
  (last to first included) are physically linked.

  On TPU (devices with chip `coords`) each ring is a Hamiltonian cycle through linked
  chips; on GPU and CPU each process's devices are kept together, so a ring crosses a
  host boundary as few times as it must.

  Args:
    axis_shapes, axis_names: as in `jax.make_mesh`, e.g. (8, 8) and ("data", "seq").
    ring_axis: the axis ring attention runs over (its `seq_axis`).
    devices: the devices to use, all of them (default `jax.devices()`); may be the
      compile-only devices of `jax.experimental.topologies.get_topology_desc`.
    axis_types: as in `jax.make_mesh` (default: every axis Explicit).

  Returns:
    A `jax.sharding.Mesh`.
  """
  axis_shapes, axis_names = tuple(axis_shapes), tuple(axis_names)
  devices = list(jax.devices() if devices is None else devices)
  grid = device_grid(axis_shapes, axis_names, ring_axis, devices)
  types = tuple(axis_types) if axis_types is not None else (AxisType.Explicit,) * len(axis_names)
  return Mesh(grid, axis_names, axis_types=types)


def device_grid(axis_shapes, axis_names, ring_axis, devices) -> np.ndarray:
  """`devices` as an array of `axis_shapes` (objects) in `ring_mesh`'s order."""
  if len(axis_shapes) != len(axis_names) or not all(isinstance(s, int) and s > 0 for s in axis_shapes):
    raise ValueError(f"{axis_shapes=} must be positive ints, one per name in {axis_names=}")
  if ring_axis not in axis_names:
    raise ValueError(f"ring_axis={ring_axis!r} is not one of {axis_names=}")
  if len(devices) != math.prod(axis_shapes):
    raise ValueError(f"{axis_shapes=} needs {math.prod(axis_shapes)} devices; got {len(devices)}")
  size = axis_shapes[axis_names.index(ring_axis)]
  on_chips = all(getattr(d, "platform", None) == "tpu" and getattr(d, "coords", None) for d in devices)
  rings = _chip_rings(devices, size) if on_chips else _process_rings(devices, size)
  # Fiber g of the ring axis (every other index fixed, in C order) is ring g.
  slots = np.moveaxis(np.arange(len(devices)).reshape(axis_shapes), axis_names.index(ring_axis), -1)
  grid = np.empty(len(devices), dtype=object)
  for ring, fiber in zip(rings, slots.reshape(-1, size)):
    for device, slot in zip(ring, fiber):
      grid[slot] = device
  return grid.reshape(axis_shapes)
