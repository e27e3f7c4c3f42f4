"""Per-device memory of forward+backward at short shards: jax_ring against the reference.

Compile only (nothing runs): temp + arguments from `memory_analysis()` of the jitted
forward+backward, B=1, N=8, H=64, float32, non-causal, for each length and device
count. These are the sizes where the fixed overhead (padding, tiles, copies) shows,
and where the max-length finder of `bench.py --quick` (32 MiB) works.

    python scripts/bench/bench_memory.py --out docs/benchmarks.md
"""

from __future__ import annotations

import sys

from _harness import fwd_bwd, header, memory_mib, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--lengths", default="512,768,896,1024,1536,2048", help="comma-separated sequence lengths T")
  p.add_argument("--devices", default="1,2,4", help="comma-separated device counts")
  p.add_argument(
    "--impls",
    default="jax_ring,ringattention",
    help="comma-separated implementations: jax_ring, ringattention",
  )
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'memory' section)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  lengths = [int(x) for x in args.lengths.split(",")]
  devices = [int(x) for x in args.devices.split(",")]
  simulate_devices(max(devices))
  import jax
  import jax.numpy as jnp
  from bench import Suite
  from bench import parse_args as bench_args

  suite = Suite(bench_args([]))
  impls = [i for i in args.impls.split(",") if i != "ringattention" or suite.ra is not None]
  lines = header("bench_memory.py", sys.argv[1:] if argv is None else argv, max(devices))
  lines.append(
    "Per-device MiB (temp + arguments) of forward+backward, B=1, N=8, H=64, float32, non-causal.\n"
  )
  lines.append("| devices | T | " + " | ".join(impls) + " |")
  lines.append("|---|---|" + "---|" * len(impls))
  for d in devices:
    for length in lengths:
      cells = []
      for impl in impls:
        if not suite.supports(impl, length, d):
          cells.append("-")
          continue
        attend, sharding = suite.attention(impl, length, d, False, "float32")
        shapes = suite.shapes(length, jnp.float32, sharding)
        compiled = jax.jit(fwd_bwd(attend)).lower(*shapes).compile()
        cells.append(f"{memory_mib(compiled):.1f}")
      lines.append(f"| {d} | {length} | " + " | ".join(cells) + " |")
      print(lines[-1], flush=True)
  publish(lines, args.out, "memory", echo=not args.out)


if __name__ == "__main__":
  main()
