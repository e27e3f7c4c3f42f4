r"""Dilated attention (LongNet) at long lengths on simulated (or real) devices.

For each length: forward+backward median time of --repeats runs of the compiled
program (no warm-up run: compilation is timed apart), its useful FLOP rate, per-device
memory (temp and arguments from the compiler's memory_analysis()) and the process's
peak resident memory so far, with B=1, N=4, H=64, float32 and the LongNet patterns
w=(2048, 4096, 8192, 16384), r=(1, 2, 4, 8). The first row is ring attention
(non-causal) at --ring-length tokens with the same heads, whose useful FLOP rate the
dilated rows are compared with.

Useful FLOPs of forward+backward count the score and output products only, 3.5x the
forward's: 3.5 x 4 x T x T x N x H for full attention, and 3.5 x 4 x T x sum_i(w_i / r_i^2)
x N x H for the dilated patterns (a segment of w tokens keeps w / r of them per head).

    python scripts/bench/bench_dilated.py --lengths 65536 131072 262144 524288 1048576 \
        --out docs/benchmarks.md
"""

from __future__ import annotations

import resource
import sys
import time

from _harness import header, inputs, median_time, publish, simulate_devices

from jax_ring.models import cli


def peak_rss_gib() -> float:
  """Peak resident memory of this process so far, GiB (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def useful_flops(length: int, heads: int, head_dim: int, segments=None, rates=None) -> float:
  """Forward+backward FLOPs of the score and output products (see the module doc);
  full attention when `segments` is None. Segments longer than the sequence count as it."""
  if segments is None:
    return 3.5 * 4 * length * length * heads * head_dim
  per_token = sum(min(w, length) / r**2 for w, r in zip(segments, rates))
  return 3.5 * 4 * length * per_token * heads * head_dim


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument(
    "--lengths",
    type=int,
    nargs="+",
    default=[65536, 131072, 262144, 524288, 1048576],
    help="sequence lengths T",
  )
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the sequence axis")
  p.add_argument("--heads", type=int, default=4, help="heads N")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument(
    "--segments", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="LongNet segment lengths w_i"
  )
  p.add_argument(
    "--rates",
    type=int,
    nargs="+",
    default=[1, 2, 4, 8],
    help="LongNet dilation rates r_i (one per segment length)",
  )
  p.add_argument("--repeats", type=int, default=1, help="timed runs after a warm-up (the median is kept)")
  p.add_argument("--ring-length", type=int, default=8192, help="tokens of the ring attention row")
  p.add_argument("--out", default=None, help="write the table into this Markdown file (default: print only)")
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

  def ring_loss(q, k, v):
    return jnp.sum(jax_ring.ring_attention(q, k, v, mesh=mesh).astype(jnp.float32))

  lines = header("bench_dilated.py", sys.argv[1:], args.devices) + [
    f"Forward+backward, B=1, N={args.heads}, H={args.head_dim}, float32, sequence over "
    f"{args.devices} devices; dilated w={tuple(args.segments)}, r={tuple(args.rates)}. "
    "GFLOP/s counts useful FLOPs (module doc of the script); 'of ring' divides it by the "
    "ring row's; peak RSS is the whole process's so far.\n",
    "| attention | tokens | compile s | fwd+bwd s | s per 64K tokens | GFLOP/s | of ring "
    "| temp MiB/device | args MiB/device | temp / args | peak RSS GiB |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  print("\n".join(lines), flush=True)
  runs = [("ring", args.ring_length, ring_loss, None)]
  runs += [("dilated", n, loss, (args.segments, args.rates)) for n in args.lengths]
  ring_rate = None
  for name, length, fn, pat in runs:
    q, k, v = inputs([(1, length, args.heads, args.head_dim)] * 3, sharding)
    step = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = step.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    ring = name == "ring"  # seconds per run: median of 3 after a warm-up
    repeats = max(3, args.repeats) if ring else args.repeats
    seconds = median_time(compiled, q, k, v, repeats=repeats, warmup=ring)
    rate = useful_flops(length, args.heads, args.head_dim, *(pat or ())) / seconds
    ring_rate = ring_rate or rate
    temp, argb = mem.temp_size_in_bytes / 2**20, mem.argument_size_in_bytes / 2**20
    row = (
      f"| {name} | {length:,} | {compile_s:.1f} | {seconds:.2f} | {seconds / (length / 65536):.2f} | "
      f"{rate / 1e9:.1f} | {rate / ring_rate:.2f} | {temp:.1f} | {argb:.1f} | {temp / argb:.2f} | "
      f"{peak_rss_gib():.1f} |"
    )
    lines.append(row)
    print(row, flush=True)
    del q, k, v, compiled
  publish(lines, args.out, "dilated")


if __name__ == "__main__":
  main()
