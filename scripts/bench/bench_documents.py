"""Packed rows over the ring against what their documents cost: with and without
`document_bound`, in interleaved rounds.

A row's ideal share is its documents' causal score work (the sum of L^2 / 2) over one
causal document as long as the row (T^2 / 2). Each row is timed forward and backward
through `ring_attention` (causal, float32, B=1, 4 query and 2 kv heads of 64,
`--devices` simulated devices), and its measured share is its time over one causal
document's of T in the same rounds. Rows (`--rows`, each its own seed-fixed order):

- "1k": T / 1,024 documents of 1,024 tokens;
- "mixed": 16,384, 8,192, 4,096, 2,048, 1,024 and 4 x 256 tokens, shuffled (seed 0),
  scaled to T and padded;
- "tail": lengths drawn from a heavy-tailed mix (log-normal, median 1,024, 99th
  percentile near 16K, capped at T; seed 0) until the row is full.

Five ways each: every pass, `document_bound=` (the longest document), zig-zag's order
given to `ring_attention_shard` as data (`positions=`), the per-document layout
(`layouts.documents`: the row already in its order, as a model keeps it, its positions
given the same way), and the row reordered as the packer records it
(`layouts.zigzag_documents`, `models.Loader(..., row_layout="documents")`: an ordinary
row to `ring_attention` in the zig-zag layout, bounded by its widest document's span,
`layouts.spans`); `--ways` picks some of them (the others' cells are "-"). A second
table counts each device's scores under zig-zag and the per-document layout; a third
(with "reordered") each device's score tiles as the kernels run them (by each tile's
positions and range of ids: `work_report`'s count where ids rise along the row), the row as it
is and reordered: on simulated devices that share a few cores the time follows the sum
of the devices' work, where devices that run at once wait for the busiest. `--tiles N`
sets every program's tiles to N x N; `--layout` the ring's layout for the rows' every-pass
and bounded programs (the one document of T keeps "auto", zig-zag).

    python scripts/bench/bench_documents.py --length 32768 --out docs/benchmarks.md
"""

from __future__ import annotations

import sys

from _harness import fwd_bwd, header, inputs, publish, run_times, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=32768, help="tokens a row (T)")
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument("--rows", default="1k,mixed,tail", help="comma-separated rows: 1k, mixed, tail")
  p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each program timed once a round)")
  p.add_argument(
    "--tiles",
    type=int,
    default=None,
    help="block_q = block_kv for every program (default: the automatic tiles)",
  )
  p.add_argument(
    "--ways",
    default=",".join(WAYS),
    help="comma-separated ways to run each row: every (pass), bounded, zigzag-data, per-document, reordered",
  )
  p.add_argument(
    "--layout",
    default="auto",
    choices=("auto", "contiguous", "zigzag"),
    help="the ring's layout for the rows' every-pass and bounded programs (the one document keeps 'auto')",
  )
  p.add_argument(
    "--counts-only",
    action="store_true",
    help="only the tables counted from the ids (scores, tiles): no program compiled or timed",
  )
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'documents' section)")
  args = p.parse_args(argv)
  args.ways = args.ways.split(",")
  if not args.ways or not set(args.ways) <= set(WAYS):
    p.error(f"--ways={','.join(args.ways)}: expected some of {', '.join(WAYS)}")
  return args


WAYS = ("every", "bounded", "zigzag-data", "per-document", "reordered")


def row_lengths(name: str, t: int):
  """The documents' lengths of row `name` (they fill at most t tokens)."""
  import numpy as np

  rng = np.random.default_rng(0)
  if name == "1k":
    return [1024] * (t // 1024)
  if name == "mixed":
    scale = t / 32768
    lengths = [int(n * scale) for n in (16384, 8192, 4096, 2048, 1024, 256, 256, 256, 256)]
    return [int(n) for n in rng.permutation([n for n in lengths if n > 0])]
  if name == "tail":  # log-normal: median 1,024, sigma so that the 99th percentile is ~16K
    out, room = [], t
    while room > 0:
      n = int(min(room, t, max(1, rng.lognormal(np.log(1024), np.log(16) / 2.326))))
      out.append(n)
      room -= n
    return out
  raise ValueError(f"--rows: unknown row {name!r} (expected 1k, mixed or tail)")


def segment_row(lengths, t: int):
  import numpy as np

  row = np.full(t, -1, np.int32)
  at = 0
  for i, n in enumerate(lengths):
    row[at : at + n] = i
    at += n
  return row


def work_per_device(seg, order, p: int) -> list[int]:
  """Scores each device's queries compute with the row in `order`: a query at offset q
  of its document computes q + 1; padding (negative ids) none."""
  import numpy as np

  start = np.r_[0, np.flatnonzero(seg[1:] != seg[:-1]) + 1]
  first = np.repeat(start, np.diff(np.r_[start, seg.size]))
  cost = np.where(seg >= 0, np.arange(seg.size) - first + 1, 0)
  return [int(x) for x in cost[np.asarray(order).reshape(p, -1)].sum(axis=1)]


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import BlockSizes, layouts, ring_attention, ring_attention_shard
  from jax_ring._tiles import local_blocks

  t, p = args.length, args.devices
  mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
  sharding = NamedSharding(mesh, P(None, "seq"))
  q, g = inputs([(1, t, 4, 64), (1, t, 4, 64)], sharding)
  k, v = inputs([(1, t, 2, 64), (1, t, 2, 64)], sharding, seed=1)
  programs = {}
  tiles = None if args.tiles is None else BlockSizes(block_q=args.tiles, block_kv=args.tiles)

  def add(name, seg, bound, layout="auto"):
    if args.counts_only:
      return
    seg = None if seg is None else jax.device_put(jnp.asarray(seg[None]), sharding)
    options = dict(segment_ids=seg, document_bound=bound, block_sizes=tiles, layout=layout)
    attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, **options)
    fn = jax.jit(fwd_bwd(attend))
    programs[name] = fn.lower(q, k, v, g).compile()

  def add_ordered(name, seg, order):
    """The row in `order` (as a model keeps its activations), its positions given to
    the ring as data: every pass runs."""
    if args.counts_only:
      return
    ids = jax.device_put(jnp.asarray(seg[order][None]), sharding)
    pos = jax.device_put(jnp.asarray(order, jnp.int32), NamedSharding(mesh, P("seq")))
    inner = lambda q, k, v, ids, pos: ring_attention_shard(
      q, k, v, axis_name="seq", is_causal=True, segment_ids=ids, positions=pos, block_sizes=tiles
    )
    spec = P(None, "seq")
    sharded = jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4 + (P("seq"),), out_specs=spec)
    fn = jax.jit(fwd_bwd(lambda q, k, v: sharded(q, k, v, ids, pos)))
    programs[name] = fn.lower(q, k, v, g).compile()

  def add_balanced(name, seg):
    """The row in `layouts.documents`'s order: each device's scores even."""
    order = layouts.documents(seg, p)
    add_ordered(name, seg, order)
    busiest = lambda o: max(work_per_device(seg, o, p))
    balance[name.split()[0]] = (
      busiest(layouts.permutation("zigzag", t, p)),
      busiest(order),
      sum(work_per_device(seg, order, p)) / p,
    )

  balance = {}
  tile_counts = {}  # row -> (tiles of each device as it is, reordered)
  # Tiles counted as the kernels decide them (`layouts._tiles_per_device`: by each tile's
  # positions and range of ids), which for ids that rise along the row (as they, and the
  # reordered rows' renumbered ids, do) is `work_report`'s count (tests/test_documents.py
  # checks both); `work_report` tests every score, which at 131K takes minutes a row.
  _, tile, _ = local_blocks(t // p, tiles or BlockSizes(), devices=p, layout="zigzag")
  count_tiles = lambda ids: layouts._tiles_per_device(ids, p, tile)
  add("one document", None, None)
  shares = {}
  for row in args.rows.split(","):
    lengths = row_lengths(row, t)
    seg = segment_row(lengths, t)
    shares[row] = (len(lengths), max(lengths), sum(n * n for n in lengths) / (t * t))
    if "every" in args.ways:
      add(f"{row} every", seg, None, args.layout)
    if "bounded" in args.ways:
      add(f"{row} bounded", seg, max(lengths), args.layout)
    if "zigzag-data" in args.ways:
      add_ordered(f"{row} zigzag-data", seg, layouts.permutation("zigzag", t, p))
    if "per-document" in args.ways:
      add_balanced(f"{row} per-document", seg)
    if "reordered" in args.ways:
      moved = layouts.first_seen(seg[layouts.zigzag_documents(seg, p)])
      add(f"{row} reordered", moved, layouts.spans(moved), "zigzag")
      tile_counts[row] = (count_tiles(seg), count_tiles(moved))
  times = {name: [] for name in programs}
  for _ in range(args.rounds):
    for name, fn in programs.items():
      times[name] += run_times(fn, q, k, v, g, repeats=1, warmup=not times[name])
  med = {name: float(np.median(ts)) for name, ts in times.items()}
  lines = header("bench_documents.py", sys.argv[1:] if argv is None else argv, p)
  if args.counts_only:
    lines.append(f"T = {t:,} tokens, causal; counted from the ids, nothing compiled or timed.")
  whole = med.get("one document")
  lines += (
    []
    if args.counts_only
    else [
      f"T = {t:,} tokens, causal, float32, 4/2 heads of 64, forward and backward; one causal document "
      f"of T: {whole:.2f} s (median of {args.rounds} interleaved rounds); tiles: "
      f"{'automatic' if tiles is None else f'{args.tiles} x {args.tiles}'}; the rows' layout: {args.layout}.",
      "",
      "| row | documents | longest | ideal share | every pass: s | share | over ideal "
      "| document_bound: s | share | over ideal | zig-zag as positions: s | share | over ideal "
      "| per-document layout: s | share | over ideal | reordered rows: s | share | over ideal |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
  )
  for row, (count, longest, ideal) in shares.items() if not args.counts_only else ():
    cells = [f"| {row} | {count} | {longest:,} | {ideal:.3f} |"]
    for way in WAYS:
      seconds = med.get(f"{row} {way}")
      if seconds is None:
        cells.append(" - | - | - |")
      else:
        cells.append(f" {seconds:.2f} | {seconds / whole:.3f} | {seconds / whole / ideal:.2f}x |")
    lines.append("".join(cells))
  if balance:  # the per-document layout's rows
    lines += [
      "",
      "Scores of the busiest device over the mean (a query at offset q of its document "
      "computes q + 1), counted from the ids:",
      "",
      "| row | zig-zag | per-document layout |",
      "|---|---|---|",
    ]
  for row, (zigzag, balanced, mean) in balance.items():
    lines.append(f"| {row} | {zigzag / mean:.3f} | {balanced / mean:.3f} |")
  if tile_counts:
    whole_tiles = count_tiles(np.zeros(t, np.int32)).max()
    lines += [
      "",
      "Score tiles of the busiest device (zig-zag, every pass, as the kernels skip them), over one causal "
      f"document's busiest ({whole_tiles:,}): what sets a step's time where the devices run at once.",
      "",
      "| row | ideal share | as it is: tiles | share | over ideal | busiest / mean "
      "| reordered: tiles | share | over ideal | busiest / mean |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
  for row, counts in tile_counts.items():
    ideal = shares[row][2]
    cells = [f"| {row} | {ideal:.3f} |"]
    for c in counts:
      share = c.max() / whole_tiles
      cells.append(f" {c.max():,} | {share:.3f} | {share / ideal:.2f}x | {c.max() / c.mean():.2f} |")
    lines.append("".join(cells))
  publish(lines, args.out, "documents", echo=True)


if __name__ == "__main__":
  main()
