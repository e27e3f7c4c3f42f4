"""What masks cost: causal attention in each layout and a local window, each timed
against full attention in the same run, and the work tables (score tiles per ring step
and device, from `jax_ring.work_report`) that explain the ratios.

    python scripts/bench/bench_masks.py                     # T=8192 on 8 devices
    python scripts/bench/bench_masks.py --lengths 8192 32768 --layouts zigzag --out docs/benchmarks.md
    python scripts/bench/bench_masks.py --suite work        # the tables only, no timing
"""

from __future__ import annotations

import sys

from _harness import header, inputs, measure, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument(
    "--suite",
    choices=["time", "work", "all"],
    default="all",
    help="what to measure: times, work counts (score blocks computed) or all",
  )
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument("--lengths", type=int, nargs="+", default=[8192], help="sequence lengths T")
  p.add_argument(
    "--layouts", nargs="+", default=["contiguous", "striped", "zigzag"], help="layouts to compare"
  )
  p.add_argument("--window", type=int, default=512, help="local window (0: no window row)")
  p.add_argument("--heads", type=int, default=8, help="heads N")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (the median is kept)")
  p.add_argument("--out", default=None, help="Markdown file for the tables (its 'masks' section)")
  return p.parse_args(argv)


def timing_lines(args) -> list[str]:
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_ring

  mesh = jax.make_mesh((args.devices,), ("seq",), devices=jax.devices()[: args.devices])
  sharding = NamedSharding(mesh, P(None, "seq"))
  lines = [
    f"B=1, N={args.heads}, H={args.head_dim}, float32, {args.devices} devices; medians of "
    f"{args.repeats}; every ratio is against the full row of the same T, measured in the same run.\n",
    "| T | mask | layout | fwd s | fwd+bwd s | fwd / full | fwd+bwd / full |",
    "|---|---|---|---|---|---|---|",
  ]
  for t in args.lengths:
    qkvg = inputs([(1, t, args.heads, args.head_dim)] * 4, sharding)
    rows = [("full", "contiguous", {})]
    rows += [("causal", layout, {"is_causal": True, "layout": layout}) for layout in args.layouts]
    if args.window:
      rows.append((f"window {args.window}", "contiguous", {"local_window_size": args.window}))
    full = None
    for mask, layout, options in rows:
      attend = lambda q, k, v, o=options: jax_ring.ring_attention(q, k, v, mesh=mesh, **o)
      m = measure(attend, *qkvg, repeats=args.repeats)
      full = full or m
      lines.append(
        f"| {t} | {mask} | {layout} | {m.fwd:.3f} | {m.fwd_bwd:.3f} | {m.fwd / full.fwd:.2f} "
        f"| {m.fwd_bwd / full.fwd_bwd:.2f} |"
      )
      print(lines[-1], flush=True)
  return lines


def work_lines(args) -> list[str]:
  import jax_ring

  lines = []
  t = args.lengths[0]
  for layout in args.layouts:
    report = jax_ring.work_report(layout=layout, num_devices=args.devices, seq_len=t, is_causal=True)
    blocks = jax_ring.work_report(layout=layout, num_devices=args.devices, seq_len=t)[0, 0]
    lines.append(
      f"\nCausal work, layout={layout}, T={t}, p={args.devices}: score tiles per ring step (rows) "
      f"and device (columns); a full step is {blocks} tiles.\n"
    )
    lines.append("| step | " + " | ".join(f"dev {d}" for d in range(args.devices)) + " | busiest |")
    lines.append("|---" * (args.devices + 2) + "|")
    for s, row in enumerate(report):
      lines.append(f"| {s} | " + " | ".join(str(x) for x in row) + f" | {row.max()} |")
    lines.append(f"\nTotal over the ring: {report.sum()}; sum of per-step maxima: {report.max(1).sum()}.")
  return lines


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  lines = header("bench_masks.py", sys.argv[1:] if argv is None else argv, args.devices)
  if args.suite in ("time", "all"):
    lines += timing_lines(args)
  if args.suite in ("work", "all"):
    lines += work_lines(args)
  return publish(lines, args.out, "masks", echo=True)


if __name__ == "__main__":
  main()
