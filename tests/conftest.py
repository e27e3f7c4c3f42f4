"""Test set-up: 8 simulated CPU devices, fast compiles and float64 for the references."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags = f"{flags} --xla_force_host_platform_device_count=8"
# The tests' shapes are tiny: compiling dominates, and LLVM's optimizations cost more
# than they save (the suite runs in 0.6 of the time at level 0; results are unchanged,
# timings are measured by scripts/bench*.py at the default level). Subprocesses
# (multi-host tests) inherit the flag.
if "xla_backend_optimization_level" not in flags:
  flags = f"{flags} --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


def make_mesh(shape, names):
  shape = tuple(shape)
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def rel_err(actual, expected):
  actual = jnp.asarray(actual, jnp.float64)
  expected = jnp.asarray(expected, jnp.float64)
  return float(jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-30))


def qkv(batch, length, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (batch, length, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dtype)
  return q, k, v


def padded_segments(batch, length, seed=1):
  """Random runs of segment ids, with a tail of padding (-1) in each row."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length - 4), size=3, replace=False))
    row = np.zeros(length, np.int32)
    for i, c in enumerate(cuts):
      row[c:] = i + 1
    row[length - rng.integers(2, 5) :] = -1
    rows.append(row)
  return jnp.asarray(np.stack(rows))


def _forward_and_vjp(fn):
  """One jitted program: (outputs, input gradients for cotangent `cot`) of fn."""

  def run(args, cot):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cot)

  return jax.jit(run)


def compare_with_reference(fn, ref_fn, args, tol, seed=3):
  """Asserts fn matches ref_fn (run in float64) in output and every input gradient.
  Both run as one jitted forward+backward program each (eager dispatch of the float64
  reference costs several times its compile)."""
  shape = jax.eval_shape(fn, *args)
  cot = jax.random.normal(jax.random.PRNGKey(seed), shape.shape, jnp.float32).astype(shape.dtype)
  out, grads = _forward_and_vjp(fn)(tuple(args), cot)
  args64 = tuple(a.astype(jnp.float64) for a in args)
  ref, ref_grads = _forward_and_vjp(ref_fn)(args64, cot.astype(jnp.float64))
  assert out.shape == ref.shape
  assert bool(jnp.all(jnp.isfinite(out)))
  err = rel_err(out, ref)
  assert err < tol, f"output rel err {err:.2e} >= {tol}"
  for name, g, rg, a in zip("qkv", grads, ref_grads, args):
    assert g.dtype == a.dtype, f"d{name} dtype {g.dtype} != input dtype {a.dtype}"
    assert bool(jnp.all(jnp.isfinite(g)))
    e = rel_err(g, rg)
    assert e < tol, f"d{name} rel err {e:.2e} >= {tol}"
  return out, grads


@pytest.fixture
def x64():
  return True
