"""One process of a multi-process check, started by scripts/launch.py from
tests/test_multihost.py: ring and dilated attention on one global 8-device mesh that
spans the processes, against the float64 reference, outputs and gradients.

Prints "ok <name>" per check; any failure raises, so the process exits non-zero and the
launcher stops the job.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring.models import runtime

TOL = 1e-5


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gather(x):
  """The whole of a global array on this process."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_inputs(length, heads, kv_heads, head_dim, seed):
  rng = np.random.default_rng(seed)  # the same values on every process
  q = rng.standard_normal((2, length, heads, head_dim)).astype(np.float32)
  k = rng.standard_normal((2, length, kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((2, length, kv_heads, head_dim)).astype(np.float32)
  g = rng.standard_normal((2, length, heads, head_dim)).astype(np.float32)
  return q, k, v, g


def padded_segments(length):
  seg = np.zeros((2, length), np.int32)
  seg[0, length // 3 :] = 1
  seg[1, length // 2 :] = 2
  seg[:, length - 5 :] = -1
  return seg


def check(name, fn, ref_fn, host, mesh):
  """fn on the mesh against ref_fn in float64: the forward from host (NumPy) inputs,
  and the gradients of global arrays."""
  q, k, v, g = host
  out = gather(fn(q, k, v))

  @jax.jit  # one program: op-by-op dispatch of the reference costs more than its compile
  def reference(q, k, v, g):
    ref, ref_vjp = jax.vjp(ref_fn, q, k, v)
    return ref, ref_vjp(g)

  ref, ref_grads = reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, g)))
  err = rel_err(out, ref)
  assert err < TOL, f"{name}: output rel err {err:.2e}"
  spec = NamedSharding(mesh, P())
  glob = [jax.make_array_from_callback(x.shape, spec, lambda i, x=x: x[i]) for x in (q, k, v, g)]
  _, vjp = jax.vjp(fn, *glob[:3])
  grads = [gather(x) for x in vjp(glob[3])]
  for label, a, b in zip("qkv", grads, ref_grads):
    e = rel_err(a, b)
    assert e < TOL, f"{name}: d{label} rel err {e:.2e}"
  print(f"ok {name}", flush=True)


def main():
  assert runtime.initialize_distributed(), "run me under scripts/launch.py"
  jax.config.update("jax_enable_x64", True)  # the references run in float64
  jax.config.update("jax_enable_x64", True)
  assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
  # Tile defaults count the devices this process drives, not the global mesh's.
  from jax_ring._tiles import devices_here

  assert devices_here(8) == 4, devices_here(8)
  explicit = jax.make_mesh((8,), ("seq",))
  auto = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))

  # Causal zigzag, segment ids with padding, GQA, a length 8 devices do not divide.
  seg = padded_segments(61)
  opts = dict(is_causal=True, segment_ids=seg)
  for label, mesh in (("explicit", explicit), ("auto", auto)):
    check(
      f"ring_causal_zigzag_segments_gqa_{label}",
      lambda q, k, v, mesh=mesh: jax_ring.ring_attention(q, k, v, mesh=mesh, layout="zigzag", **opts),
      lambda q, k, v: jax_ring.reference_attention(q, k, v, **opts),
      host_inputs(61, 4, 2, 8, seed=0),
      mesh,
    )

  # Inputs built per process: each gives only its half of the sequence.
  q, k, v, _ = host_inputs(64, 4, 2, 8, seed=1)
  sharding = NamedSharding(auto, P(None, "seq"))
  half = slice(32 * jax.process_index(), 32 * (jax.process_index() + 1))
  local = [jax.make_array_from_process_local_data(sharding, x[:, half], x.shape) for x in (q, k, v)]
  out = gather(jax_ring.ring_attention(*local, mesh=auto, is_causal=True))
  ref = jax_ring.reference_attention(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), is_causal=True)
  assert rel_err(out, ref) < TOL, rel_err(out, ref)
  print("ok ring_process_local_inputs", flush=True)

  # Dilated: the 64-token segments span all 8 devices, so their sub-ring crosses the
  # process boundary; the 16-token ones span 2 devices of one process.
  pattern = dict(segment_lengths=(16, 64), dilation_rates=(1, 2), is_causal=True)
  check(
    "dilated_subring_across_processes",
    lambda q, k, v: jax_ring.dilated_attention(q, k, v, mesh=explicit, **pattern),
    lambda q, k, v: jax_ring.reference_dilated_attention(q, k, v, **pattern),
    host_inputs(61, 4, 2, 8, seed=2),
    explicit,
  )

  # Host inputs that differ between processes: a clear error, never a wrong answer.
  q, k, v, _ = host_inputs(64, 4, 2, 8, seed=3 + jax.process_index())
  for label, mesh in (("explicit", explicit), ("auto", auto)):
    try:
      jax_ring.ring_attention(q, k, v, mesh=mesh)
    except ValueError as e:
      assert "make_array_from_process_local_data" in str(e) and "query" in str(e), e
    else:
      raise AssertionError(f"differing host inputs on the {label} mesh were accepted")
  print("ok differing_host_inputs_rejected", flush=True)
  print("all checks passed", flush=True)


if __name__ == "__main__":
  sys.exit(main())
