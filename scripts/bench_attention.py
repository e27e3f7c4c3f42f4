"""Benchmarks of ring attention on simulated (or real) devices, written as Markdown.

Times are medians of --repeats runs after one warm-up, with block_until_ready; memory
per device is temp + arguments from the compiler's memory_analysis() of the same
program. Ratios compare programs measured in the same run.

    python scripts/bench_attention.py --suite core      # ring vs dense, T=8192
    python scripts/bench_attention.py --suite balance   # causal and window savings
    python scripts/bench_attention.py --suite work      # work tables at p=8 (no timing)
    python scripts/bench_attention.py --suite policy    # float32 vs bfloat16 policy
"""

from __future__ import annotations

import argparse
import sys

from _bench_utils import fwd_bwd, header, median_time, memory_mib, simulate_devices


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--suite", choices=["core", "balance", "work", "policy", "all"], default="all")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--window-length", type=int, default=16384)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
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
  lines = header("bench_attention.py", sys.argv[1:], args.devices)

  def inputs(length, sharding):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (1, length, args.heads, args.head_dim)
    return [jax.device_put(jax.random.normal(k, shape, jnp.float32), sharding) for k in keys]

  def measure(attend, length, sharding):
    q, k, v, g = inputs(length, sharding)
    fwd = jax.jit(attend).lower(q, k, v).compile()
    both = jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile()
    mib = memory_mib(both)
    time = lambda fn, *xs: median_time(fn, *xs, repeats=args.repeats)
    return time(fwd, q, k, v), time(both, q, k, v, g), mib

  ring_sharding = NamedSharding(mesh, P(None, "seq"))
  if args.suite in ("core", "all"):
    t = args.length
    lines.append(f"\nB=1, T={t}, N={args.heads}, H={args.head_dim}, float32, non-causal.\n")
    lines.append("| implementation | devices | fwd s | fwd+bwd s | MiB/device (fwd+bwd) |")
    lines.append("|---|---|---|---|---|")
    ring = lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh)
    r = measure(ring, t, ring_sharding)
    lines.append(f"| jax_ring.ring_attention | {args.devices} | {r[0]:.3f} | {r[1]:.3f} | {r[2]:.1f} |")
    one = jax.sharding.SingleDeviceSharding(devices[0])
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    d = measure(dense, t, one)
    lines.append(f"| jax.nn.dot_product_attention | 1 | {d[0]:.3f} | {d[1]:.3f} | {d[2]:.1f} |")
    print("\n".join(lines[-4:]), flush=True)
  if args.suite in ("balance", "all"):
    t = args.length
    lines.append(f"\nCausal vs full, B=1, T={t}, N={args.heads}, H={args.head_dim}, float32.\n")
    lines.append("| mask | layout | fwd s | fwd+bwd s | fwd+bwd / full |")
    lines.append("|---|---|---|---|---|")
    full = measure(lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh), t, ring_sharding)
    lines.append(f"| full | contiguous | {full[0]:.3f} | {full[1]:.3f} | 1.00 |")
    for layout in ("contiguous", "striped", "zigzag"):
      c = measure(
        lambda q, k, v, lay=layout: jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True, layout=lay),
        t,
        ring_sharding,
      )
      lines.append(f"| causal | {layout} | {c[0]:.3f} | {c[1]:.3f} | {c[1] / full[1]:.2f} |")
      print(lines[-1], flush=True)
    tw, w = args.window_length, args.window
    lines.append(f"\nLocal window {w} vs full, T={tw}, contiguous, float32.\n")
    lines.append("| mask | fwd s | fwd+bwd s | fwd+bwd / full |")
    lines.append("|---|---|---|---|")
    fullw = measure(lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh), tw, ring_sharding)
    win = measure(
      lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh, local_window_size=w), tw, ring_sharding
    )
    lines.append(f"| full | {fullw[0]:.3f} | {fullw[1]:.3f} | 1.00 |")
    lines.append(f"| window {w} | {win[0]:.3f} | {win[1]:.3f} | {win[1] / fullw[1]:.3f} |")
    print("\n".join(lines[-2:]), flush=True)
  if args.suite in ("policy", "all"):
    t = args.length
    lines.append(f"\nPrecision policies, B=1, T={t}, N={args.heads}, H={args.head_dim}, non-causal.\n")
    lines.append("| policy | fwd s | fwd+bwd s | fwd+bwd / float32 |")
    lines.append("|---|---|---|---|")
    base = None
    for name in ("float32", "bfloat16"):
      r = measure(
        lambda q, k, v, n=name: jax_ring.ring_attention(q, k, v, mesh=mesh, policy=n), t, ring_sharding
      )
      base = base or r[1]
      lines.append(f"| {name} | {r[0]:.3f} | {r[1]:.3f} | {r[1] / base:.2f} |")
      print(lines[-1], flush=True)
  if args.suite in ("work", "all"):
    for layout in ("contiguous", "striped", "zigzag"):
      report = jax_ring.work_report(
        layout=layout, num_devices=args.devices, seq_len=args.length, is_causal=True
      )
      blocks = jax_ring.work_report(layout=layout, num_devices=args.devices, seq_len=args.length)[0, 0]
      lines.append(
        f"\nCausal work, layout={layout}, T={args.length}, p={args.devices}: score blocks per ring "
        f"step (rows) and device (columns); a full step is {blocks} blocks.\n"
      )
      lines.append("| step | " + " | ".join(f"dev {d}" for d in range(args.devices)) + " | busiest |")
      lines.append("|---" * (args.devices + 2) + "|")
      for s, row in enumerate(report):
        lines.append(f"| {s} | " + " | ".join(str(x) for x in row) + f" | {row.max()} |")
      lines.append(f"\nTotal over the ring: {report.sum()}; sum of per-step maxima: {report.max(1).sum()}.")
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "a") as f:
      f.write(text)


if __name__ == "__main__":
  main()
