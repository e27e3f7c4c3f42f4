"""Pure ring vs the Ulysses hybrid vs pure Ulysses on the same devices.

For each mesh (ulysses, seq) of the devices, causal attention at length T: forward and
forward+backward medians, per-device memory (temp + arguments of the forward+backward,
from the compiler), and the bytes each device's collectives produce in the
forward+backward (from the compiled HLO, `jax_ring.hlo.collective_bytes`), split into
all-to-all and collective-permute. (1, p) is the pure ring, (p, 1) pure Ulysses.

    python scripts/bench/bench_ulysses.py
    python scripts/bench/bench_ulysses.py --length 32768 --out docs/benchmarks.md
"""

from __future__ import annotations

import sys
import time

from _harness import fwd_bwd, header, measure, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices (u x ring)")
  p.add_argument("--length", type=int, default=32768, help="sequence length T")
  p.add_argument("--heads", type=int, default=8, help="query heads N")
  p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2], help="kv head counts K to compare")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up (the median is kept)")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'ulysses' section)")
  return p.parse_args(argv)


def meshes(devices: int, heads: int) -> list[tuple[int, int]]:
  """(ulysses, seq) shapes whose Ulysses size divides the heads, pure ring first."""
  return [(u, devices // u) for u in range(1, devices + 1) if devices % u == 0 and heads % u == 0]


def table_lines(args) -> list[str]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_ring
  from jax_ring.hlo import collective_bytes

  lines = [
    f"Causal, B=1, T={args.length}, N={args.heads}, H={args.head_dim}, float32, {args.devices} devices. "
    "Bytes: what each device's collectives produce in one forward+backward, from the compiled HLO "
    "(loops counted per iteration).\n",
    "| mesh (ulysses, seq) | K | fwd s | fwd+bwd s | MiB/device | all-to-all MiB | "
    "collective-permute MiB | total MiB moved | max diff vs pure ring |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  mib = lambda n: f"{n / 2**20:.1f}"
  for kv in args.kv_heads:
    baseline = None
    for u, p in meshes(args.devices, args.heads):
      mesh = jax.make_mesh((u, p), ("u", "seq"), devices=jax.devices()[: args.devices])
      sharding = NamedSharding(mesh, P(None, ("seq", "u")))
      key = jax.random.split(jax.random.PRNGKey(0), 4)
      shape = lambda n: (1, args.length, n, args.head_dim)
      q, k, v, g = (
        jax.device_put(jax.random.normal(kk, shape(n), jnp.float32), sharding)
        for kk, n in zip(key, (args.heads, kv, kv, args.heads))
      )
      attend = lambda q, k, v, mesh=mesh: jax_ring.ring_attention(
        q, k, v, mesh=mesh, ulysses_axis="u", is_causal=True
      )
      both = jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile()
      moved = collective_bytes(both)
      m = measure(attend, q, k, v, g, repeats=args.repeats)
      out = np.asarray(m.out)
      baseline = out if baseline is None else baseline
      diff = float(np.max(np.abs(out - baseline)))
      a2a, perm = moved.get("all-to-all", 0), moved.get("collective-permute", 0)
      other = set(moved) - {"all-to-all", "collective-permute"}
      if other:
        raise RuntimeError(f"mesh {(u, p)}: unexpected collectives {sorted(other)}")
      lines.append(
        f"| ({u}, {p}) | {kv} | {m.fwd:.2f} | {m.fwd_bwd:.2f} | {m.mib:.0f} | {mib(a2a)} | {mib(perm)} | "
        f"{mib(a2a + perm)} | {diff:.1e} |"
      )
      print(lines[-1], flush=True)
  return lines


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  start = time.perf_counter()
  lines = header("bench_ulysses.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += table_lines(args)
  lines.append(f"\nWhole run: {time.perf_counter() - start:.0f} s.")
  publish(lines, args.out, "ulysses", echo=True)


if __name__ == "__main__":
  main()
