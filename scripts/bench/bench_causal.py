"""Full and causal ring attention timed in interleaved rounds: each round times the
forward and the forward+backward of each, and a 4096^3 float32 matmul on one device
between the lengths. Causal runs twice: on inputs in natural order, which the call
relays into the zigzag layout and its output back (`token_order="natural"`, the
default), and on inputs already in that layout (`token_order="layout"`, what
`models.DecoderLM` runs by default). Reports per length the medians, each program's
rate as a fraction of the matmul rate (forward 4*B*N*T^2*H FLOPs, half when causal;
forward+backward 3.5x that), and causal / full for every round with the median and the
range over the rounds. `--variants` adds rows of causal attention on ring-order inputs
with other tiles (`BQxBK`) or other tokens x kv heads per pass (`pass=N`). `--parts`
adds full attention over half the scores in the two shapes a causal zigzag ring step
takes when it is one rectangle (`_tiles.quadrant_tiles`): every query against the
first half of the keys, and the second half of the queries against every key. Their
time against full's is the least a causal step costs besides its diagonal one.

  python scripts/bench/bench_causal.py --out docs/benchmarks.md
  python scripts/bench/bench_causal.py --lengths 8192 --variants 512x128 256x128 pass=2048
  python scripts/bench/bench_causal.py --lengths 8192 --rounds 7 --variants 256x256 --parts
"""

from __future__ import annotations

import sys
import time

from _harness import fwd_bwd, header, inputs, matmul_rate, publish, simulate_devices

from jax_ring.models import cli

# (row label, is_causal, token_order); "layout" takes the operands permuted into the
# zigzag layout once, outside the timed programs.
MASKS = (("full", False, "natural"), ("causal", True, "natural"), ("causal, ring order", True, "layout"))


def parse_args(argv):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the sequence axis")
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="sequence lengths T")
  p.add_argument("--heads", type=int, default=8, help="query heads N (and kv heads)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--rounds", type=int, default=5, help="interleaved rounds after a warm-up round")
  p.add_argument(
    "--variants",
    nargs="*",
    default=[],
    help="extra causal ring-order rows: BQxBK tiles or pass=N tokens x kv heads per pass",
  )
  p.add_argument(
    "--parts", action="store_true", help="full attention rows over half the keys, and over half the queries"
  )
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'causal' section)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  variants = [_variant(v) for v in args.variants]
  simulate_devices(args.devices)
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import BlockSizes, layouts, ring_attention

  mesh = jax.make_mesh((args.devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  lines = header("bench_causal.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += [
    f"B=1, N={args.heads}, H={args.head_dim}, float32, {args.devices} devices, library defaults; "
    f"{args.rounds} interleaved rounds after a warm-up. Rates: fractions of the matmul timed before and "
    "after each length (the higher).\n",
    "| T | mask | fwd s | fwd+bwd s (min-max) | fwd / matmul | fwd+bwd / matmul |",
    "|---|---|---|---|---|---|",
  ]
  ratios = []
  for length in args.lengths:
    shape = (1, length, args.heads, args.head_dim)
    sharding = NamedSharding(mesh, P(None, "seq"))
    q, k, v, g = inputs([shape] * 4, sharding)
    zigzag = [jax.device_put(layouts.to_layout(x, "zigzag", args.devices), sharding) for x in (q, k, v, g)]
    programs = {}
    # (label, is_causal, token_order, blocks, operands: None for q, k, v, g in the order)
    rows = [(*m, BlockSizes(), None) for m in MASKS]
    for name, fields in variants:
      rows.append((f"causal, ring order, {name}", True, "layout", BlockSizes(**fields), None))
    half = lambda x, n=length // 2, to=sharding: jax.device_put(x[:, :n], to)
    if args.parts:
      rows.append(("full, half the keys", False, "natural", BlockSizes(), (q, half(k), half(v), g)))
      rows.append(("full, half the queries", False, "natural", BlockSizes(), (half(q), k, v, half(g))))
    for mask, causal, order, blocks, operands in rows:
      attend = lambda q, k, v, causal=causal, order=order, blocks=blocks: ring_attention(
        q, k, v, mesh=mesh, is_causal=causal, token_order=order, block_sizes=blocks
      )
      x = operands or (zigzag if order == "layout" else (q, k, v, g))
      programs[mask] = (
        jax.jit(attend).lower(*x[:3]).compile(),
        jax.jit(fwd_bwd(attend)).lower(*x).compile(),
        x,
        causal or operands is not None,  # half of full's scores
      )
    rate = matmul_rate(3)
    times = {mask: ([], []) for mask in programs}
    for round_ in range(args.rounds + 1):
      for mask, (fwd, both, x, _) in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(fwd(*x[:3]))
        middle = time.perf_counter()
        jax.block_until_ready(both(*x))
        end = time.perf_counter()
        if round_:
          times[mask][0].append(middle - start)
          times[mask][1].append(end - middle)
      print(length, round_, {c: (t[0][-1:], t[1][-1:]) for c, t in times.items()}, flush=True)
    rate = max(rate, matmul_rate(3))
    for mask, (fwd, both) in times.items():
      flops = 4 * length**2 * args.heads * args.head_dim * (0.5 if programs[mask][3] else 1.0)
      f, b = float(np.median(fwd)), float(np.median(both))
      lines.append(
        f"| {length} | {mask} | {f:.3f} | {b:.3f} ({min(both):.3f}-{max(both):.3f}) "
        f"| {flops / f / rate:.2f} | {3.5 * flops / b / rate:.2f} |"
      )
      if mask != "full":
        ratios.append((length, mask, [c / f for c, f in zip(times[mask][1], times["full"][1])]))
    print(*lines[-len(programs) :], sep="\n", flush=True)
  lines += ["", "Causal / full forward+backward, round by round:", ""]
  lines += ["| T | causal | each round | median | range |", "|---|---|---|---|---|"]
  for length, mask, per_round in ratios:
    each = ", ".join(f"{r:.3f}" for r in per_round)
    lines.append(
      f"| {length} | {mask} | {each} | {float(np.median(per_round)):.3f} "
      f"| {min(per_round):.3f}-{max(per_round):.3f} |"
    )
  return publish(lines, args.out, "causal", echo=True)


def _variant(text: str) -> tuple[str, dict]:
  """'512x128' -> tiles, 'pass=2048' -> tokens x kv heads per pass (row name, BlockSizes fields)."""
  if text.startswith("pass="):
    return f"{text[5:]} tokens a pass", dict(pass_tokens=int(text[5:]))
  bq, _, bk = text.partition("x")
  if not (bq.isdigit() and bk.isdigit()):
    raise SystemExit(f"--variants: {text!r} is neither BQxBK (e.g. 512x128) nor pass=N")
  return f"{bq} x {bk} tiles", dict(block_q=int(bq), block_kv=int(bk))


if __name__ == "__main__":
  main()
