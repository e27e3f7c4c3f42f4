"""Several independent programs with collectives in flight at once on 8 simulated CPU
devices, dispatched back to back from one thread (tests/test_runtime.py runs this in a
process of its own, killed past a hard timeout): with XLA's CPU pool at its default
size this deadlocks in the collectives' rendezvous; `runtime.simulate_devices` sizes it
so that it cannot. Prints "done" when every chain has finished."""

import sys

from jax_ring.models import runtime

if sys.argv[1:] == ["--default-pool"]:  # XLA's own size here: max(cores, devices) threads
  import os

  os.environ["NPROC"] = "1"
runtime.simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((8,), ("seq",))
perm = [(i, (i + 1) % 8) for i in range(8)]


def chain(k):
  def body(x):
    for _ in range(k):
      x = jax.lax.ppermute(x, "seq", perm) * 1.0001 + jax.lax.psum(x, "seq") * 1e-6
    return x

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("seq"), out_specs=P("seq")))


programs = [chain(k) for k in (1, 2, 3, 4)]
xs = [jax.device_put(jnp.full((8 * 128, 128), float(i)), jax.NamedSharding(mesh, P("seq"))) for i in range(4)]
for _ in range(300):
  xs = [f(x) for f, x in zip(programs, xs)]  # independent chains: nothing waits between them
for x in xs:
  x.block_until_ready()
print("done", flush=True)
