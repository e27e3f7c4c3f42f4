"""Short shards (and any others), jax_ring against the reference, timed in interleaved rounds.

On a shared or noisy machine two configurations timed one after the other can differ
by 20% from the machine alone. Here every configuration (implementation x mask) of a
length is compiled first, then each round runs every one of them `--per-round` times,
and the medians are over all rounds: slow spells hit every configuration alike.
Forward+backward, B=1, N=8, H=64, float32, `--devices` simulated devices. Extra
jax_ring columns force a layout (`--layouts`) or tokens x heads per pass around the
ring (`--pass-tokens`, `BlockSizes.pass_tokens`); a second table gives each program's
memory per device (temp + arguments, from the compiler).

    python scripts/bench/bench_short.py --out docs/benchmarks.md
    python scripts/bench/bench_short.py --lengths 8192 --pass-tokens 4096 --rounds 4 --per-round 2
"""

from __future__ import annotations

import sys

from _harness import fwd_bwd, header, inputs, memory_mib, publish, run_times, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--lengths", default="1024,2048", help="comma-separated sequence lengths T")
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument(
    "--rounds", type=int, default=6, help="interleaved rounds (each program timed once per round)"
  )
  p.add_argument("--per-round", type=int, default=3, help="calls per program per round (the median is kept)")
  p.add_argument(
    "--impls",
    default="jax_ring,ringattention",
    help="comma-separated implementations: jax_ring, ringattention",
  )
  p.add_argument(
    "--layouts", default="", help="extra jax_ring columns with these layouts forced, e.g. zigzag,contiguous"
  )
  p.add_argument(
    "--pass-tokens",
    default="",
    help="extra jax_ring columns with BlockSizes(pass_tokens=...), e.g. 4096,1024",
  )
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'short' section)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import numpy as np
  from bench import Suite
  from bench import parse_args as bench_args

  import jax_ring

  suite = Suite(bench_args([]))
  impls = [i for i in args.impls.split(",") if i != "ringattention" or suite.ra is not None]
  forced = [x for x in args.layouts.split(",") if x]
  impls += [f"jax_ring {x}" for x in forced]
  impls += [f"jax_ring pass_tokens={int(x)}" for x in args.pass_tokens.split(",") if x]
  lines = header("bench_short.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines.append(
    f"Forward+backward s, median (min) over {args.rounds} interleaved rounds of {args.per_round} runs, "
    f"{args.devices} devices, B=1, N=8, H=64, float32.\n"
  )
  lines.append("| T | mask | " + " | ".join(impls) + " |")
  lines.append("|---|---|" + "---|" * len(impls))
  memory = {}
  for length in (int(x) for x in args.lengths.split(",")):
    programs = {}
    for causal in (False, True):
      for impl in impls:
        if impl.startswith("jax_ring "):  # a forced layout or pass size
          _, sharding = suite.attention("jax_ring", length, args.devices, causal, "float32")
          forced = impl.split()[1]
          kwargs = (
            dict(block_sizes=jax_ring.BlockSizes(pass_tokens=int(forced.split("=")[1])))
            if forced.startswith("pass_tokens=")
            else dict(layout=forced)
          )
          attend = lambda q, k, v, c=causal, m=sharding.mesh, kw=kwargs: jax_ring.ring_attention(
            q, k, v, mesh=m, is_causal=c, **kw
          )
        elif suite.supports(impl, length, args.devices):
          attend, sharding = suite.attention(impl, length, args.devices, causal, "float32")
        else:
          continue
        data = inputs([(1, length, 8, 64)] * 4, sharding)
        programs[impl, causal] = (jax.jit(fwd_bwd(attend)).lower(*data).compile(), data)
    times = {key: [] for key in programs}
    for r in range(args.rounds):
      for key, (compiled, data) in programs.items():
        times[key] += run_times(compiled, *data, repeats=args.per_round, warmup=r == 0)
    for causal in (False, True):
      cells = [
        f"{np.median(times[i, causal]):.4f} ({np.min(times[i, causal]):.4f})" if (i, causal) in times else "-"
        for i in impls
      ]
      lines.append(f"| {length} | {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")
      print(lines[-1], flush=True)
      memory[length, causal] = [
        f"{memory_mib(programs[i, causal][0]):.1f}" if (i, causal) in programs else "-" for i in impls
      ]
  lines.append("\nMiB per device (temp + arguments of the same programs):\n")
  lines.append("| T | mask | " + " | ".join(impls) + " |")
  lines.append("|---|---|" + "---|" * len(impls))
  for (length, causal), cells in memory.items():
    lines.append(f"| {length} | {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")
  publish(lines, args.out, "short", echo=not args.out)


if __name__ == "__main__":
  main()
