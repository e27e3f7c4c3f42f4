"""Decoding from a sequence-sharded KV cache: jax_ring's one all-reduce of partial
results against two baselines run in the same process on the same cache.

- jax_ring: `update_cache` + `decode_attention` (each device attends the new token to
  its own shard, the partials merged by one all-reduce of B x N x (H + 2) values);
- ring: the same per-shard kernel, but the cache shards rotate around the ring
  (`ppermute`) as ring attention would move them, p - 1 transfers of 2 x S/p x K x H;
- all-gather: every device gathers the whole cache and attends to all of it.

The caches are filled directly with random keys and values (positions contiguous per
device, as a prompt in the contiguous layout leaves them), so the long lengths cost
no prefill. One attention layer, N query heads over K kv heads, float32. The decode
step is the append (`update_cache`, shared by all three) plus the attention; memory per
device is the compiled attention's arguments + temp from `memory_analysis()`.
Prefill (ring attention writing the cache) is timed at the lengths given by
--prefill-lengths, for each of --batches while batch x length stays within
--prefill-token-cap (causal attention's forward grows as T^2: a 512K prefill takes
about 16x a 128K one).

  python scripts/bench/bench_decode.py --out docs/benchmarks.md
"""

from __future__ import annotations

import functools
import sys
import time

from _harness import header, median_time, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the sequence axis")
  p.add_argument(
    "--lengths",
    type=int,
    nargs="*",
    default=[32768, 131072, 524288],
    help="cache lengths S to decode against",
  )
  p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes B")
  p.add_argument("--heads", type=int, default=8, help="query heads N")
  p.add_argument("--kv-heads", type=int, default=2, help="kv heads K")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--repeats", type=int, default=5, help="timed decode steps (the median is kept)")
  p.add_argument(
    "--prefill-lengths", type=int, nargs="*", default=[32768], help="prompt lengths whose prefill is timed"
  )
  p.add_argument(
    "--prefill-token-cap", type=int, default=1 << 18, help="time prefills of at most this many tokens (B x T)"
  )
  p.add_argument(
    "--gather-limit-gib",
    type=float,
    default=6.0,
    help="skip the all-gather baseline when the gathered caches of all devices exceed this",
  )
  p.add_argument("--out", default=None, help="write the tables into this Markdown file")
  p.add_argument("--section", default="decode", help="the section of --out to (re)write")
  return p.parse_args(argv)


def build(args):
  """The jitted programs, closed over the mesh."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding

  import jax_ring
  from jax_ring._decode import CacheAxes, KVCache, cache_tile, device_fill, local_partial
  from jax_ring._policy import get_policy

  mesh = jax.make_mesh((args.devices,), ("seq",))
  axes = CacheAxes(mesh, "seq")
  specs = axes.specs()
  qspec = axes.query_spec()
  policy = get_policy("float32")
  scale = args.head_dim**-0.5

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def filled(b, s, key):
    """A cache of capacity for s tokens holding s random tokens, contiguous per device."""
    empty = jax_ring.init_cache(b, s, args.kv_heads, args.head_dim, mesh=mesh)
    cap = empty.capacity
    local = cap // args.devices
    per = s // args.devices
    kk, kv = jax.random.split(key)
    shape = (b, cap, args.kv_heads, args.head_dim)
    slot = jnp.arange(cap)
    dev, j = slot // local, slot % local
    pos = jnp.where(j < per, dev * per + j, -1).astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    return KVCache(
      jax.random.normal(kk, shape, jnp.float32),
      jax.random.normal(kv, shape, jnp.float32),
      jnp.broadcast_to(pos, (b, cap)),
      jnp.zeros((b, cap), jnp.int32),
      jnp.full((b,), s, jnp.int32),
      zero + per,
      zero,
    )

  def shard_program(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(qspec, specs), out_specs=qspec, check_vma=False))

  def q_info(cache):
    b = cache.k.shape[0]
    return cache.lengths[:, None] - 1, jnp.zeros((b, 1), jnp.int32)

  def ring_body(q, cache):
    p, i = lax.axis_size("seq"), lax.axis_index("seq")
    q_pos, q_seg = q_info(cache)
    tile = cache_tile(cache.k.shape[1])
    perm = [(d, (d + 1) % args.devices) for d in range(args.devices)]

    def step(carry, s):
      o, lse, shard = carry
      fill = device_fill(cache.prefilled, cache.appended, (i - s) % p, p)
      o2, lse2 = local_partial(
        q, shard, q_pos, q_seg, fill, window=None, scale=scale, policy=policy, tile=tile
      )
      o, lse = jax_ring.merge_attention((o, lse), (o2, lse2))
      moved = KVCache(*(lax.ppermute(x, "seq", perm) for x in shard[:4]), *shard[4:])
      return (o, lse, moved), None

    b, tq, n, h = q.shape
    o0 = jnp.zeros((b, tq, n, h), jnp.float32)
    lse0 = jnp.full((b, tq, n), -jnp.inf, jnp.float32)
    (o, _, _), _ = lax.scan(step, (o0, lse0, cache), jnp.arange(args.devices))
    return o

  def gather_body(q, cache):
    q_pos, q_seg = q_info(cache)
    full = KVCache(*(lax.all_gather(x, "seq", axis=1, tiled=True) for x in cache[:4]), *cache[4:])
    tile = cache_tile(cache.k.shape[1])
    o, _ = local_partial(
      q, full, q_pos, q_seg, full.k.shape[1], window=None, scale=scale, policy=policy, tile=tile
    )
    return o

  def ours(q, cache):
    return jax_ring.decode_attention(q, cache, mesh=mesh, policy=policy)

  @functools.partial(jax.jit, donate_argnums=0)
  def append(cache, k, v):
    return jax_ring.update_cache(cache, k, v, mesh=mesh)

  programs = {
    "jax_ring": jax.jit(ours),
    "ring": shard_program(ring_body),
    "all-gather": shard_program(gather_body),
  }
  replicated = NamedSharding(mesh, qspec)
  return mesh, filled, programs, append, replicated


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_ring

  mesh, filled, programs, append, replicated = build(args)
  lines = header("bench_decode.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += [
    f"One attention layer, N={args.heads} query heads over K={args.kv_heads} kv heads, H={args.head_dim}, "
    f"float32, one new token per row, {args.devices} devices; the cache holds S tokens. ms per token = "
    "append + attention (median of "
    f"{args.repeats}); memory = per-device arguments + temp of the compiled attention; 'max diff' = largest "
    "difference of the baselines' outputs from jax_ring's.\n",
    "| B | S | jax_ring ms/token | tokens/s | ring ms/token | all-gather ms/token | ring / jax_ring | "
    "jax_ring MiB (temp) | ring MiB (temp) | all-gather MiB (temp) | max diff |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  if not args.lengths:
    lines = lines[:2]
  print("\n".join(lines), flush=True)
  itemsize = 4
  for b in args.batches:
    for s in args.lengths:
      cache = filled(b, s, jax.random.PRNGKey(s + b))
      keys = jax.random.split(jax.random.PRNGKey(b), 3)
      q = jax.device_put(jax.random.normal(keys[0], (b, 1, args.heads, args.head_dim)), replicated)
      k, v = (
        jax.device_put(jax.random.normal(x, (b, 1, args.kv_heads, args.head_dim)), replicated)
        for x in keys[1:]
      )
      cache = append(cache, k, v)
      t_append = []
      for _ in range(args.repeats):  # appends time the donated in-place update; keep the last cache
        cache = append(cache, k, v)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        cache = append(cache, k, v)
        jax.block_until_ready(cache)
        t_append.append(time.perf_counter() - start)
      t_append = float(np.median(t_append))
      gathered = args.devices * s * b * args.kv_heads * args.head_dim * 2 * itemsize / 2**30
      row, outs = {}, {}
      for name, prog in programs.items():
        if name == "all-gather" and gathered > args.gather_limit_gib:
          row[name] = None
          continue
        compiled = prog.lower(q, cache).compile()
        stats = compiled.memory_analysis()
        mib = (stats.argument_size_in_bytes + stats.temp_size_in_bytes) / 2**20
        temp = stats.temp_size_in_bytes / 2**20
        t = median_time(compiled, q, cache, repeats=args.repeats)
        outs[name] = np.asarray(compiled(q, cache))
        row[name] = (t + t_append, mib, temp)
      diff = max(float(np.abs(o - outs["jax_ring"]).max()) for o in outs.values())
      ours, ring, gat = row["jax_ring"], row["ring"], row["all-gather"]
      cells = [b, f"{s // 1024}K", f"{ours[0] * 1e3:.1f}", f"{b / ours[0]:.1f}", f"{ring[0] * 1e3:.1f}"]
      cells.append(f"{gat[0] * 1e3:.1f}" if gat else f"skipped ({gathered:.0f} GiB gathered)")
      cells += [
        f"{ring[0] / ours[0]:.1f}x",
        f"{ours[1]:.0f} ({ours[2]:.1f})",
        f"{ring[1]:.0f} ({ring[2]:.0f})",
      ]
      cells += [f"{gat[1]:.0f} ({gat[2]:.0f})" if gat else "-", f"{diff:.1e}"]
      lines.append("| " + " | ".join(map(str, cells)) + " |")
      print(lines[-1], flush=True)
      del cache
  if args.prefill_lengths:
    lines += [
      "",
      "Prefill: causal ring attention over a prompt of T tokens (zigzag layout) that also writes its keys "
      "and values into the cache; one layer, forward only.\n",
      "| B | T | prefill s | tokens/s |",
      "|---|---|---|---|",
    ]
    for t in args.prefill_lengths:
      for b in args.batches:
        if b * t > args.prefill_token_cap:
          continue
        keys = jax.random.split(jax.random.PRNGKey(t), 3)
        q = jax.random.normal(keys[0], (b, t, args.heads, args.head_dim), jnp.float32)
        k, v = (jax.random.normal(x, (b, t, args.kv_heads, args.head_dim), jnp.float32) for x in keys[1:])
        cache = jax_ring.init_cache(b, t + 256, args.kv_heads, args.head_dim, mesh=mesh)
        run = lambda q, k, v, cache: jax_ring.prefill_attention(q, k, v, cache, mesh=mesh, policy="float32")
        secs = median_time(run, q, k, v, cache, repeats=max(1, args.repeats // 2))
        lines.append(f"| {b} | {t // 1024}K | {secs:.2f} | {b * t / secs:.0f} |")
        print(lines[-1], flush=True)
  return publish(lines, args.out, args.section)


if __name__ == "__main__":
  main()
