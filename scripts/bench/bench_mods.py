"""What each score modifier costs: forward+backward of ring attention with one modifier
(or all of them) against plain attention, timed in interleaved rounds.

Every program is compiled first; each round then runs every one of them `--per-round`
times, and medians are over all rounds, so the machine's slow spells hit every column
alike. B=1, N=8, H=64, float32, `--devices` simulated devices, library defaults; the
ratio column is the modifier's median over plain attention's with the same mask.

    python scripts/bench/bench_mods.py --out docs/benchmarks.md
    python scripts/bench/bench_mods.py --length 2048 --rounds 2 --per-round 1
"""

from __future__ import annotations

import sys

from _harness import fwd_bwd, header, inputs, publish, run_times, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=8192, help="sequence length T")
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument(
    "--rounds", type=int, default=5, help="interleaved rounds (each program timed once per round)"
  )
  p.add_argument("--per-round", type=int, default=2, help="calls per program per round")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'mods' section)")
  return p.parse_args(argv)


def modifiers(heads: int):
  """The columns: name -> ring_attention keyword arguments."""
  import jax
  import jax.numpy as jnp

  import jax_ring

  wave = lambda s, i, j, h: s + 0.1 * jnp.cos(0.01 * (i - j) + h)
  each = {
    "plain": {},
    "logit_soft_cap": dict(logit_soft_cap=30.0),
    "alibi_slopes": dict(alibi_slopes=jax_ring.alibi_slopes(heads)),
    "sinks": dict(sinks=jnp.zeros((heads,), jnp.float32)),
    "score_mod": dict(score_mod=wave),
    "dropout_rate=0.1": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
  }
  together = {k: v for case in each.values() for k, v in case.items()}
  return each | {"all": together}


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_ring

  heads = 8
  mesh = jax.make_mesh((args.devices,), ("seq",))
  sharding = NamedSharding(mesh, P(None, "seq"))
  data = inputs([(1, args.length, heads, 64)] * 4, sharding)
  columns = modifiers(heads)
  programs = {}
  for causal in (False, True):
    for name, options in columns.items():
      attend = lambda q, k, v, c=causal, o=options: jax_ring.ring_attention(
        q, k, v, mesh=mesh, is_causal=c, **o
      )
      programs[name, causal] = jax.jit(fwd_bwd(attend)).lower(*data).compile()
  times = {key: [] for key in programs}
  for r in range(args.rounds):
    for key, compiled in programs.items():
      times[key] += run_times(compiled, *data, repeats=args.per_round, warmup=r == 0)
  lines = header("bench_mods.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines.append(
    f"Forward+backward s, median (min) over {args.rounds} interleaved rounds of {args.per_round} runs, "
    f"T={args.length}, {args.devices} devices, B=1, N={heads}, H=64, float32; x: median over plain's.\n"
  )
  lines.append("| modifier | full | x | causal | x |")
  lines.append("|---|---|---|---|---|")
  for name in columns:
    cells = []
    for causal in (False, True):
      t = times[name, causal]
      cells += [
        f"{np.median(t):.3f} ({np.min(t):.3f})",
        f"{np.median(t) / np.median(times['plain', causal]):.2f}",
      ]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  publish(lines, args.out, "mods", echo=not args.out)


if __name__ == "__main__":
  main()
