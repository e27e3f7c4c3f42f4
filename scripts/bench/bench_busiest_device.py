"""Packed rows as devices that run at once would take them: each device's ring passes
timed alone, the busiest device's sum against one causal document's.

On this machine the simulated devices share a few cores, so a ring's time follows the
sum of its devices' work (`bench_documents.py`). Devices that run at once wait for the
busiest instead. This benchmark times that busiest device: the ring call's own
configuration (tiles, schedule, kernel: the `RingConfig` that `ring_attention` builds for
the row) is run on one device for each device d and each shard its passes visit (the
local one, then `steps_back` devices back and `steps_fwd` ahead), d's queries against
that shard's keys, forward and backward, with their global positions and ids: the
tiles, and the tiles skipped by their range of ids, are the ring's. Device d's time is
the sum over its passes; a row's measured share is the busiest device's time over one
causal document's busiest, against the ideal share (the documents' sum of L^2 / 2 over
T^2 / 2). Beside it, the same passes with the keys' ids moved past every query's, so
that every tile is skipped: what the passes cost without a score. What this leaves
out: the transfers (on the GPUs compiled for they run under the compute,
`scripts/aot.py`), the merges of a pass's results and the relayout to zig-zag and
back.

Rows as in `bench_documents.py` (1k, mixed, tail), each as it is with `document_bound`
its longest document, and reordered for the zig-zag ring (`layouts.zigzag_documents`,
bound by its widest document's span), causal, float32, 4/2 heads of 64.

    python scripts/bench/bench_busiest_device.py --length 32768 --out docs/benchmarks.md
"""

from __future__ import annotations

import dataclasses
import sys

from _harness import header, median_time, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=32768, help="tokens a row (T)")
  p.add_argument("--devices", type=int, default=8, help="devices on the ring")
  p.add_argument("--rows", default="1k,mixed,tail", help="comma-separated rows: 1k, mixed, tail")
  p.add_argument("--rounds", type=int, default=2, help="timings of each pass (their median is kept)")
  p.add_argument("--tiles", type=int, default=None, help="every program's tiles N x N (default: automatic)")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'busiest device' section)")
  return p.parse_args(argv)


def ring_config(mesh, q, k, v, seg, bound, tiles):
  """The `RingConfig` that `ring_attention` builds for this call (traced, not run)."""
  import jax

  from jax_ring import _attention, ring_attention

  found = []
  real = _attention.ring

  def spy(cfg, *args):
    found.append(cfg)
    return real(cfg, *args)

  _attention.ring = spy
  jax.clear_caches()  # a cached trace of the same call would not build the config again
  try:
    options = dict(segment_ids=seg, document_bound=bound, block_sizes=tiles, layout="zigzag")
    jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, **options)).lower(q, k, v)
  finally:
    _attention.ring = real
  (cfg,) = found
  return cfg


def _one_device(cfg):
  """The ring's configuration for one pass on one device, and that device's mesh."""
  import jax

  one = dataclasses.replace(cfg, ring_size=1, steps_back=0, steps_fwd=0, axis_size=None, schedules=None)
  return one, jax.make_mesh((1,), (cfg.axis_name,), devices=jax.devices()[:1])


def _passes(cfg, p: int, t: int, seg):
  """(device, [(shard, arguments), ...]) for each device: its queries' shard (zig-zag),
  the shards its passes visit in order, and each pass's arguments (q and k positions
  and ids: global positions, ids or None) beside the shards' token indices."""
  import numpy as np

  from jax_ring import layouts

  c = t // p
  order = layouts.permutation("zigzag", t, p)
  offsets = [0, *range(1, cfg.steps_back + 1), *(-o for o in range(1, cfg.steps_fwd + 1))]
  tokens = lambda d: order[d * c : (d + 1) * c]
  ids = lambda d: None if seg is None else np.asarray(seg)[None, tokens(d)]
  for d in range(p):
    yield d, [(tokens(d), tokens((d - o) % p), ids(d), ids((d - o) % p)) for o in offsets]


def device_outputs(cfg, p: int, q, k, v, seg, d: int):
  """Device d's attention output (natural float [1, c, heads, 64]), its passes each run
  alone as `device_seconds` times them and merged by their log-sum-exps here."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from jax_ring import _ring

  one, mesh = _one_device(cfg)
  call = lambda *a: _ring.ring(one, *a)
  fn = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P(),) * 7, out_specs=(P(), P())))
  _, passes = list(_passes(cfg, p, q.shape[1], seg))[d]
  outs, lses = [], []
  for qi, ki, q_seg, k_seg in passes:
    out, lse = fn(q[:, qi], k[:, ki], v[:, ki], qi.astype(np.int32), ki.astype(np.int32), q_seg, k_seg)
    outs.append(np.asarray(out, np.float64))
    lses.append(np.asarray(lse, np.float64))
  lse = np.logaddexp.reduce(np.stack(lses), axis=0)
  weights = [np.exp(np.where(np.isfinite(x), x - lse, -np.inf))[..., None] for x in lses]
  return sum(w * o for w, o in zip(weights, outs))


def device_seconds(cfg, p: int, q, k, v, g, seg, rounds: int, apart: bool = False):
  """Seconds of each device's passes, each (device, shard) pair timed alone on one
  device: [p]. q, k, v, g: natural order [1, T, heads, 64]; seg: ids [T] or None.
  `apart`: the keys' ids moved past every query's, so that every tile is skipped: what
  the passes cost besides their tiles' scores (the loop over the tiles, each tile's
  test, the blocking of the inputs and the gradients' sums)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from jax_ring import _ring

  one, mesh = _one_device(cfg)

  def pass_fwd_bwd(q, k, v, g, q_pos, k_pos, q_seg, k_seg):
    def loss(q, k, v):
      out, _ = _ring.ring(one, q, k, v, q_pos, k_pos, q_seg, k_seg)
      return jnp.sum(out * g)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  fn = jax.jit(jax.shard_map(pass_fwd_bwd, mesh=mesh, in_specs=(P(),) * 8, out_specs=(P(),) * 3))
  seconds = np.zeros(p)
  compiled = None
  for d, passes in _passes(cfg, p, q.shape[1], seg):
    for qi, ki, q_seg, k_seg in passes:
      if apart:
        k_seg = k_seg + int(np.max(seg)) + 1
      args = (q[:, qi], k[:, ki], v[:, ki], g[:, qi], qi.astype(np.int32), ki.astype(np.int32), q_seg, k_seg)
      args = tuple(None if a is None else jnp.asarray(a) for a in args)
      if compiled is None:
        compiled = fn.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
      seconds[d] += median_time(compiled, *args, repeats=rounds, warmup=False)
  return seconds


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import numpy as np
  from bench_documents import row_lengths, segment_row
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import BlockSizes, layouts

  t, p = args.length, args.devices
  if t % (2 * p):
    raise ValueError(f"--length={t} must be a multiple of 2 x --devices={2 * p} (zig-zag chunks)")
  mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
  sharding = NamedSharding(mesh, P(None, "seq"))
  rng = np.random.default_rng(0)
  q, g = (rng.standard_normal((1, t, 4, 64)).astype(np.float32) for _ in range(2))
  k, v = (rng.standard_normal((1, t, 2, 64)).astype(np.float32) for _ in range(2))
  placed = [jax.device_put(x, sharding) for x in (q, k, v)]
  tiles = None if args.tiles is None else BlockSizes(block_q=args.tiles, block_kv=args.tiles)

  def busiest(seg, bound):
    ids = None if seg is None else jax.device_put(seg[None], sharding)
    cfg = ring_config(mesh, *placed, ids, bound, tiles)
    seconds = device_seconds(cfg, p, q, k, v, g, seg, args.rounds)
    if seg is None:
      return seconds, cfg
    return seconds, cfg, device_seconds(cfg, p, q, k, v, g, seg, args.rounds, apart=True)

  whole, whole_cfg = busiest(None, None)
  rows = {}
  for row in args.rows.split(","):
    lengths = row_lengths(row, t)
    seg = segment_row(lengths, t)
    ideal = sum(n * n for n in lengths) / (t * t)
    moved = layouts.first_seen(seg[layouts.zigzag_documents(seg, p)])
    found = [busiest(seg, max(lengths)), busiest(moved, layouts.spans(moved))]
    rows[row] = (len(lengths), max(lengths), ideal, found)
  lines = header("bench_busiest_device.py", sys.argv[1:] if argv is None else argv, p)
  lines += [
    f"T = {t:,} tokens, causal, float32, 4/2 heads of 64, forward and backward, each device's passes "
    f"timed alone on one device (median of {args.rounds}); one causal document of T: busiest device "
    f"{whole.max():.3f} s, mean {whole.mean():.3f} s (tiles {whole_cfg.block_q} x {whole_cfg.block_kv}).",
    "",
    "| row | documents | longest | ideal share | bounded: busiest s | share | over ideal | busiest / mean "
    "| passes | every tile skipped: s | reordered: busiest s | share | over ideal | busiest / mean | passes "
    "| every tile skipped: s |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row, (count, longest, ideal, found) in rows.items():
    cells = [f"| {row} | {count} | {longest:,} | {ideal:.3f} |"]
    for seconds, cfg, skipped in found:
      share = seconds.max() / whole.max()
      passes = 1 + cfg.steps_back + cfg.steps_fwd
      even = seconds.max() / seconds.mean()
      fixed = skipped[np.argmax(seconds)]  # the busiest device's passes with nothing to compute
      cells.append(
        f" {seconds.max():.3f} | {share:.3f} | {share / ideal:.2f}x | {even:.2f} | {passes} | {fixed:.3f} |"
      )
    lines.append("".join(cells))
  publish(lines, args.out, "busiest device", echo=True)
  return {row: found for row, (*_, found) in rows.items()} | {"whole": whole}


if __name__ == "__main__":
  main()
