"""Global arrays to shards and back: padding, placement on the mesh, `shard_map` calls
on Explicit and Auto meshes.

The public functions take global arrays in natural token order. They pad the sequence
(`pad_seq`), put host inputs on the mesh (`place_on_mesh`), and run their per-device
body under `shard_map` inside jit (`call_on_mesh`), which on a mesh with Explicit axes
makes those axes Auto for the call, so uneven shards may be padded by XLA. Inside,
`constrain` pins the layout of the padded arrays; `output_spec` gives the result's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def pad_seq(x, extra: int, value=0):
  """Pads axis 1 (the sequence) of x with `extra` entries of `value`."""
  if not extra:
    return x
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def constrain(x, spec, mesh, in_context: bool):
  """Sharding constraint with a bare spec inside a mesh context, a NamedSharding outside."""
  return lax.with_sharding_constraint(x, spec if in_context else NamedSharding(mesh, spec))


def explicit_axes(mesh) -> tuple:
  """The names of the mesh's axes of type Explicit."""
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)


def call_on_mesh(impl, mesh, out_spec, *args):
  """Calls impl(*args, in_context=...) inside jit. Explicit mesh axes are made Auto for
  the call (`auto_axes`), where XLA may pad uneven shards; the result gets `out_spec`."""
  explicit = explicit_axes(mesh)
  if not explicit:
    return impl(*args, in_context=False)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return jax.sharding.auto_axes(
      functools.partial(impl, in_context=True), axes=explicit, out_sharding=out_spec
    )(*args)


def place_on_mesh(mesh, seq_axis, batch_axis, head_axis, length, query, key, value, segment_ids):
  """With Explicit axes, arrays are typed by their sharding: put the inputs on the mesh
  first (sharded along the sequence when the axis divides the length)."""
  if not explicit_axes(mesh):
    return query, key, value, segment_ids
  seq = seq_axis if length % mesh.shape[seq_axis] == 0 else None
  put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
  query, key, value = (put(x, P(batch_axis, seq, head_axis, None)) for x in (query, key, value))
  return query, key, value, put(segment_ids, P(batch_axis, seq))


def output_spec(mesh, seq_axis, batch_axis, head_axis, length):
  """The output's spec: the sequence stays sharded when the axis divides its length."""
  seq = seq_axis if length % mesh.shape[seq_axis] == 0 else None
  return P(batch_axis, seq, head_axis, None)
