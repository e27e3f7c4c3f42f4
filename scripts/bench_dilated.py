"""Dilated attention (LongNet) at long lengths on simulated (or real) devices.

For each length: forward+backward median time of --repeats runs of the compiled
program (no warm-up run: compilation is timed apart) and per-device
memory (temp and arguments from the compiler's memory_analysis()), with B=1, N=4,
H=64, float32 and the LongNet patterns w=(2048, 4096, 8192, 16384), r=(1, 2, 4, 8).

    python scripts/bench_dilated.py --lengths 65536 131072 262144 524288 1048576 \\
        --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
import time

from _harness import header, inputs, median_time, simulate_devices


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072, 262144, 524288, 1048576])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--segments", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
  p.add_argument("--rates", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--out", default=None, help="append the Markdown here (default: print only)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_ring

  devices = jax.devices()
  mesh = jax.make_mesh((args.devices,), ("seq",), devices=devices[: args.devices])
  sharding = NamedSharding(mesh, P(None, "seq", None, None))
  pattern = dict(segment_lengths=tuple(args.segments), dilation_rates=tuple(args.rates))

  def loss(q, k, v):
    return jnp.sum(jax_ring.dilated_attention(q, k, v, mesh=mesh, **pattern).astype(jnp.float32))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  lines = header("bench_dilated.py", sys.argv[1:], args.devices) + [
    f"Dilated attention forward+backward, B=1, N={args.heads}, H={args.head_dim}, float32, "
    f"w={tuple(args.segments)}, r={tuple(args.rates)}, sequence over {args.devices} devices.\n",
    "| tokens | compile s | fwd+bwd s | s per 64K tokens | temp MiB/device | args MiB/device |",
    "|---|---|---|---|---|---|",
  ]
  print("\n".join(lines), flush=True)
  for length in args.lengths:
    q, k, v = inputs([(1, length, args.heads, args.head_dim)] * 3, sharding)
    start = time.perf_counter()
    compiled = step.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    seconds = median_time(compiled, q, k, v, repeats=args.repeats, warmup=False)
    row = (
      f"| {length:,} | {compile_s:.1f} | {seconds:.2f} | {seconds / (length / 65536):.2f} | "
      f"{mem.temp_size_in_bytes / 2**20:.1f} | {mem.argument_size_in_bytes / 2**20:.1f} |"
    )
    lines.append(row)
    print(row, flush=True)
    del q, k, v, compiled
  if args.out:
    with open(args.out, "a") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
