"""Packed rows whose documents differ from row to row: every pass, the data's longest
document as `document_bound`, and `document_bound="auto"` (the bound read from each
row's ids while running), each one program for every row, in interleaved rounds.

Rows of T tokens are drawn from a heavy-tailed length mix like that of fine-tuning
data (log-normal, median 1,024 (`--median`), 99th percentile 16 times that; `--long` documents of
`--long-length` tokens put into the first rows, as a few long ones are in real data;
seed `--seed`), each filled to T and timed forward and backward through
`ring_attention` (causal, float32, B=1, 4 query and 2 kv heads of 64, `--devices`
simulated devices). A static bound must hold the longest document of all the data, so
every row pays for the longest; "auto" runs each row with the fewest passes that hold
its own longest (the schedule each row picks is in the table, from
`_documents.picked_schedule`). A row's ideal share is its documents' causal score work
(the sum of L^2 / 2) over one causal document of T; its measured share is its time over
that document's in the same rounds.

    python scripts/bench/bench_document_batches.py --length 131072 --out docs/benchmarks.md
"""

from __future__ import annotations

import sys

from _harness import fwd_bwd, header, inputs, publish, run_times, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=131072, help="tokens a row (T)")
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument("--rows", type=int, default=6, help="rows drawn from the length mix")
  p.add_argument("--long", type=int, default=1, help="rows that get one long document (the first ones)")
  p.add_argument(
    "--long-length", type=int, default=None, help="tokens of each long document (default: half of --length)"
  )
  p.add_argument("--median", type=int, default=1024, help="the length mix's median document (tokens)")
  p.add_argument("--seed", type=int, default=0, help="seed of the length mix")
  p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each row timed once a round)")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'document-batches' section)")
  args = p.parse_args(argv)
  if not 0 <= args.long <= args.rows:
    p.error(f"--long={args.long}: expected 0 to --rows={args.rows}")
  if args.long_length is None:
    args.long_length = args.length // 2
  if not 1 <= args.long_length <= args.length:
    p.error(f"--long-length={args.long_length}: expected 1 to --length={args.length}")
  return args


def row_lengths(
  t: int, rows: int, long: int, long_length: int, seed: int, median: int = 1024
) -> list[list[int]]:
  """Each row's documents' lengths: log-normal draws (median `median`, sigma so that the
  99th percentile is 16 times it) until the row is full, the first `long` rows starting
  with one document of `long_length`."""
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  for i in range(rows):
    lengths = [long_length] if i < long else []
    room = t - sum(lengths)
    while room > 0:
      n = int(min(room, max(1, rng.lognormal(np.log(median), np.log(16) / 2.326))))
      lengths.append(n)
      room -= n
    out.append([int(n) for n in rng.permutation(lengths)])
  return out


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import _documents, layouts, ring_attention

  t, p = args.length, args.devices
  mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
  sharding = NamedSharding(mesh, P(None, "seq"))
  q, g = inputs([(1, t, 4, 64), (1, t, 4, 64)], sharding)
  k, v = inputs([(1, t, 2, 64), (1, t, 2, 64)], sharding, seed=1)
  rows = row_lengths(t, args.rows, args.long, args.long_length, args.seed, args.median)
  ids = []
  for lengths in rows:
    row = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])
    ids.append(jax.device_put(jnp.asarray(row[None]), sharding))
  longest = max(max(lengths) for lengths in rows)

  def program(bound):
    def attend(q, k, v, seg):
      return ring_attention(q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, document_bound=bound)

    step = jax.jit(lambda q, k, v, g, seg: fwd_bwd(lambda q, k, v: attend(q, k, v, seg))(q, k, v, g))
    compiled = step.lower(q, k, v, g, ids[0]).compile()  # one program for every row
    return lambda seg: lambda: compiled(q, k, v, g, seg)

  ways = {"every": program(None), "bounded": program(longest), "auto": program("auto")}
  one_document = jax.jit(fwd_bwd(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True)))
  one_document = one_document.lower(q, k, v, g).compile()
  whole = lambda: one_document(q, k, v, g)
  times = {("one", None): []}
  times |= {(way, i): [] for way in ways for i in range(len(rows))}
  for _ in range(args.rounds):
    times[("one", None)] += run_times(whole, repeats=1, warmup=not times[("one", None)])
    for i, seg in enumerate(ids):
      for way, make in ways.items():
        times[(way, i)] += run_times(make(seg), repeats=1, warmup=not times[(way, i)])
  med = {key: float(np.median(ts)) for key, ts in times.items()}
  one = med[("one", None)]
  layout = layouts.resolve("auto", True, shard_len=-(-t // p))  # what the calls run
  shard = layouts.padded_length(layout, t, p) // p
  lines = header("bench_document_batches.py", sys.argv[1:] if argv is None else argv, p)
  lines += [
    f"T = {t:,} tokens, causal, float32, 4/2 heads of 64, forward and backward; {len(rows)} rows, the "
    f"first {args.long} with a document of {args.long_length:,}, the rest of the mix (seed {args.seed}); "
    f"the data's longest document {longest:,}; one causal document of T: {one:.2f} s (median of "
    f"{args.rounds} interleaved rounds).",
    "",
    "| row | documents | longest | ideal share | passes each way (auto) | every pass: over ideal "
    "| bound {longest:,}: over ideal | auto: over ideal | auto against the bound |".replace(
      "{longest:,}", f"{longest:,}"
    ),
    "|---|---|---|---|---|---|---|---|---|",
  ]
  total = {way: 0.0 for way in ways}
  ideal_total = 0.0
  for i, lengths in enumerate(rows):
    ideal = sum(n * n for n in lengths) / (t * t)
    ideal_total += ideal
    row_ids = np.concatenate([np.full(n, j) for j, n in enumerate(lengths)])
    picked = _documents.picked_schedule(row_ids, layout, shard, p)
    passes = "every" if picked in (None, (p - 1, 0)) else f"{picked[0]} and {picked[1]}"
    over = {way: med[(way, i)] / one / ideal for way in ways}
    for way in ways:
      total[way] += med[(way, i)]
    lines.append(
      f"| {i} | {len(lengths)} | {max(lengths):,} | {ideal:.3f} | {passes} | {over['every']:.2f}x "
      f"| {over['bounded']:.2f}x | {over['auto']:.2f}x | {med[('auto', i)] / med[('bounded', i)]:.2f} |"
    )
  lines.append(
    f"| all | | | {ideal_total:.3f} | | {total['every'] / one / ideal_total:.2f}x "
    f"| {total['bounded'] / one / ideal_total:.2f}x | {total['auto'] / one / ideal_total:.2f}x "
    f"| {total['auto'] / total['bounded']:.2f} |"
  )
  publish(lines, args.out, "document-batches", echo=True)
  return {"rows": rows, "longest": longest, "seconds": {f"{w} {i}": s for (w, i), s in med.items()}}


if __name__ == "__main__":
  main()
