"""Global arrays to shards and back: padding, placement on the mesh, `shard_map` calls
on Explicit and Auto meshes.

The public functions take global arrays in natural token order. They pad the sequence
(`pad_seq`), put host inputs on the mesh (`place_on_mesh`), and run their per-device
body under `shard_map` inside jit (`call_on_mesh`), which on a mesh with Explicit axes
makes those axes Auto for the call, so uneven shards may be padded by XLA. Inside,
`constrain` pins the layout of the padded arrays; `output_spec` gives the result's.

In a multi-process run (`jax.distributed`), global jax.Arrays pass through untouched;
host (NumPy) arrays stand for the whole global array, must be the same on every
process (checked by checksum), and are assembled without a gather: each process
copies only the slices its own devices hold.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
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


def traced_device():
  """The (abstract) device of the mesh being traced under, e.g. inside `shard_map`: its
  platform and device kind; None outside any mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else getattr(mesh, "abstract_device", None)


def usable_mesh(mesh, *inputs):
  """The mesh a public call runs on: `mesh`, or its Auto twin (the same devices and
  axis names, every axis Auto) where `mesh` has Explicit axes (`jax.make_mesh`'s
  default), no mesh context is active and no input is typed by Explicit axes. An
  array typed by Explicit axes needs `jax.set_mesh` for every later operation on it
  (indexing, a sum, `jax.grad`'s cotangent); outside that context, inputs that are
  plain arrays give results sharded the same way but typed Auto, which work as any
  sharded array does. Under `jax.set_mesh(mesh)`, or with inputs already typed by
  the Explicit mesh, results keep their Explicit types (explicit in, explicit out)."""
  if (
    explicit_axes(mesh)
    and jax.sharding.get_abstract_mesh().empty
    and not any(_typed_explicit(x) for x in inputs if x is not None)
  ):
    return mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  return mesh


def _typed_explicit(x) -> bool:
  """Whether x's type carries Explicit mesh axes (a jax.Array or tracer put on an
  Explicit mesh)."""
  try:
    sharding = jax.typeof(x).sharding
  except Exception:  # NumPy arrays and Python scalars carry no sharding type
    return False
  return bool(getattr(getattr(sharding, "mesh", None), "explicit_axes", ()))


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


def _is_host_value(x) -> bool:
  """A concrete array every process holds whole (NumPy, or a jax.Array on this
  process's devices only), as opposed to a global jax.Array or a tracer."""
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array):
    return x.is_fully_addressable
  return True


def _fingerprint(x) -> int:
  """A checksum of an array's shape, dtype and bytes."""
  x = np.ascontiguousarray(x)
  return zlib.crc32(x.view(np.uint8).reshape(-1), zlib.crc32(f"{x.shape}{x.dtype}".encode()))


def _gather_small(local: np.ndarray) -> np.ndarray:
  """Every device's copy of its process's small `local` array: [devices, ...]. One
  jitted identity over all devices; works under grad and vjp, unlike
  `multihost_utils.process_allgather`, which needs a clean trace state."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
  rows = np.broadcast_to(local, (jax.local_device_count(), *local.shape))
  shape = (jax.device_count(), *local.shape)
  spread = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")), rows, shape)
  return np.asarray(jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))(spread))


def _staging() -> bool:
  """Whether JAX is tracing a program (jit, scan, ...) here, where concrete arrays
  become constants of the program."""
  return isinstance(jnp.zeros(()), jax.core.Tracer)


def check_same_on_every_process(named: dict) -> None:
  """Raises ValueError if a host array differs between processes. Compares checksums
  (a few bytes per process), never the arrays themselves."""
  names = list(named)
  if _staging():
    raise ValueError(
      f"{', '.join(names)}: host (NumPy) arrays inside jax.jit in a multi-process run would become "
      "per-process constants that nothing checks. Pass global jax.Arrays, built outside jit with "
      "jax.make_array_from_process_local_data(sharding, local_data, global_shape) or "
      "jax.make_array_from_callback."
    )
  local = np.asarray([_fingerprint(named[n]) for n in names], np.uint32)
  every = _gather_small(local)  # [devices, inputs]
  differ = [n for i, n in enumerate(names) if np.any(every[:, i] != every[0, i])]
  if differ:
    raise ValueError(
      f"{', '.join(differ)}: host (NumPy) arrays differ between the {jax.process_count()} processes. In "
      "a multi-process run a host array stands for the whole global array, so every process must pass "
      "the same values. To give each process only its own part, build a global jax.Array with "
      "jax.make_array_from_process_local_data(sharding, local_data, global_shape) and pass that."
    )


def to_global(x, sharding):
  """A host array (the same on every process) as a global jax.Array with `sharding`:
  each process copies only the slices its own devices hold (no gather)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place(mesh, arrays: dict) -> dict:
  """name -> (array or None, PartitionSpec): the arrays put on the mesh where jit would
  not do it right by itself. With Explicit axes they are typed by their sharding, so
  they go through `device_put`; in a multi-process run host arrays become global
  arrays (`to_global`) after a check that every process holds the same values. Global
  jax.Arrays and tracers pass through. Returns name -> array."""
  multi = jax.process_count() > 1
  out = {name: x for name, (x, _) in arrays.items()}
  if not multi and not explicit_axes(mesh):
    # Arrays typed by an Explicit mesh (the caller's, outside jax.set_mesh; see
    # `usable_mesh`) are moved to this Auto one: the two types do not mix.
    for name, (x, spec) in arrays.items():
      if x is not None and _typed_explicit(x):
        out[name] = jax.device_put(x, NamedSharding(mesh, spec))
    return out
  if multi:
    host = {n: x for n, (x, _) in arrays.items() if x is not None and _is_host_value(x)}
    if host:
      check_same_on_every_process(host)
    for name, x in host.items():
      out[name] = to_global(x, NamedSharding(mesh, arrays[name][1]))
  else:
    for name, (x, spec) in arrays.items():
      if x is not None:
        out[name] = jax.device_put(x, NamedSharding(mesh, spec))
  return out


def axes_size(mesh, axes) -> int:
  """The number of devices along a mesh axis or a tuple of axes."""
  return int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))


def place_attention_inputs(mesh, seq_axis, batch_axis, head_axis, **arrays) -> dict:
  """`place` for the inputs of an attention call, by name: "query", "key", "value"
  ([B, L, heads, H]), "q_seg" / "kv_seg" / "segment_ids" ([B, L]), "q_len" / "kv_len"
  ([B]); None entries stay None. Each sequence is sharded when the axis (or tuple of
  axes) divides its own length."""
  seq = lambda x: seq_axis if x.shape[1] % axes_size(mesh, seq_axis) == 0 else None
  specs = {}
  for name, x in arrays.items():
    if x is None:
      specs[name] = (None, None)
    elif x.ndim == 1:
      specs[name] = (x, P(batch_axis))
    elif x.ndim == 2:
      specs[name] = (x, P(batch_axis, seq(x)))
    else:
      specs[name] = (x, P(batch_axis, seq(x), head_axis, None))
  return place(mesh, specs)


def place_on_mesh(mesh, seq_axis, batch_axis, head_axis, query, key, value, segment_ids):
  """`place_attention_inputs` for (query, key, value, segment_ids)."""
  placed = place_attention_inputs(
    mesh, seq_axis, batch_axis, head_axis, query=query, key=key, value=value, segment_ids=segment_ids
  )
  return placed["query"], placed["key"], placed["value"], placed["segment_ids"]


def output_spec(mesh, seq_axis, batch_axis, head_axis, length):
  """The output's spec: the sequence stays sharded when the axis divides its length."""
  seq = seq_axis if length % axes_size(mesh, seq_axis) == 0 else None
  return P(batch_axis, seq, head_axis, None)
