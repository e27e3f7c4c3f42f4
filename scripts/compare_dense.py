"""Ring attention on a device mesh checked against dense attention: error, memory, time.

On a CPU-only machine it simulates 8 devices. For each sequence length it prints the
maximum error against the dense reference (where the dense scores fit in memory), the
per-device memory of forward+backward from the compiler, and the median time.

    python scripts/compare_dense.py [--devices 8] [--lengths 1024 4096 16384] [--causal]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from _bench_utils import fwd_bwd, median_time, memory_mib, simulate_devices


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=8, help="devices in the ring (simulated on CPU)")
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--causal", action="store_true", help="causal mask (zigzag layout)")
  p.add_argument("--max-reference-length", type=int, default=4096, help="longest length checked densely")
  p.add_argument("--out", default="results/compare_dense.json", help="where to write the table as JSON")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_ring

  devices = jax.devices()
  if len(devices) < args.devices:
    sys.exit(f"--devices={args.devices} but only {len(devices)} {devices[0].platform} devices are visible")
  mesh = jax.make_mesh((args.devices,), ("seq",), devices=devices[: args.devices])
  policy = jax_ring.policy_for(devices[0])
  print(f"{args.devices} x {devices[0].device_kind} ({devices[0].platform}), policy: {policy}")
  attend = lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=args.causal)
  forward = jax.jit(attend)

  rows = []
  header = f"{'length':>8} {'devices':>7} {'max |err|':>10} {'MiB/device':>10} {'fwd s':>8} {'fwd+bwd s':>9}"
  print(header)
  print("-" * len(header))
  for length in args.lengths:
    sharding = NamedSharding(mesh, P(None, "seq"))
    keys = jax.random.split(jax.random.PRNGKey(length), 4)
    qshape = (1, length, args.heads, args.head_dim)
    kshape = (1, length, args.kv_heads, args.head_dim)
    q = jax.device_put(jax.random.normal(keys[0], qshape, jnp.float32), sharding)
    k = jax.device_put(jax.random.normal(keys[1], kshape, jnp.float32), sharding)
    v = jax.device_put(jax.random.normal(keys[2], kshape, jnp.float32), sharding)
    g = jax.device_put(jax.random.normal(keys[3], qshape, jnp.float32), sharding)
    compiled = jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile()
    mib = memory_mib(compiled)
    out = jax.block_until_ready(forward(q, k, v))
    times = {"fwd": median_time(forward, q, k, v), "fwd_bwd": median_time(compiled, q, k, v, g)}
    err = None
    if length <= args.max_reference_length:
      ref = jax.jit(lambda q, k, v: jax_ring.reference_attention(q, k, v, is_causal=args.causal))
      err = float(jnp.max(jnp.abs(np.asarray(out) - np.asarray(ref(*(np.asarray(x) for x in (q, k, v)))))))
    rows.append(
      {"length": length, "devices": args.devices, "max_abs_err": err, "mib_per_device": mib, **times}
    )
    err_s = f"{err:10.2e}" if err is not None else f"{'-':>10}"
    print(
      f"{length:8d} {args.devices:7d} {err_s} {mib:10.1f} {times['fwd']:8.3f} {times['fwd_bwd']:9.3f}",
      flush=True,
    )
  out_path = pathlib.Path(args.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps({"causal": args.causal, "rows": rows}, indent=2))
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main()
