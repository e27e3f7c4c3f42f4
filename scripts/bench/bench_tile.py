"""The matmuls of one attention tile, timed one at a time on every device at once.

Each device runs a scan over `--tiles` tiles of `--heads` heads, block x block scores
and head dim `--head-dim`; the table gives GFLOP/s over all devices for each product
in the operand layouts the kernel could use, next to a 4096^3 float32 matmul on one
device. It is how the kernel's layouts were chosen: a product that contracts over the
query rows of a row-major score tile (p^T dO) makes the CPU compiler transpose the
tile first, and runs at about half the rate of the others (docs/benchmarks.md).

    python scripts/bench/bench_tile.py                       # 8 simulated devices
    python scripts/bench/bench_tile.py --devices 1 --out docs/benchmarks.md
"""

from __future__ import annotations

import sys

from _harness import header, matmul_rate, publish, run_times, simulate_devices

from jax_ring.models import cli

# name -> (einsum over [heads, ...] operands, lhs dims, rhs dims); s: score rows or
# columns (block), h: head dim.
PRODUCTS = {
  "scores q k^T": ("kqh,ksh->kqs", ("q", "h"), ("s", "h")),
  "p v": ("kqs,ksh->kqh", ("q", "s"), ("s", "h")),
  "dV = p^T dO, p row-major": ("kqs,kqh->ksh", ("q", "s"), ("q", "h")),
  "dV^T = dO^T p, dO kept transposed": ("khq,kqs->khs", ("h", "q"), ("q", "s")),
  "dq = ds k": ("kqs,ksh->kqh", ("q", "s"), ("s", "h")),
}


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices running tiles at once")
  p.add_argument("--heads", type=int, default=4, help="query heads per tile")
  p.add_argument("--block", type=int, default=256, help="block_q = block_kv")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--tiles", type=int, default=32, help="tiles per device per timed call")
  p.add_argument("--repeats", type=int, default=5, help="timed calls (the median is kept)")
  p.add_argument("--matmul-size", type=int, default=4096, help="side of the reference matmul")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'tile' section)")
  return p.parse_args(argv)


def product_rate(args, spec, lhs_dims, rhs_dims) -> float:
  """GFLOP/s of `spec` summed over `--tiles` tiles on each of `--devices` devices."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  size = {"q": args.block, "s": args.block, "h": args.head_dim}
  n = args.devices * args.tiles
  mesh = jax.make_mesh((args.devices,), ("d",), devices=jax.devices()[: args.devices])
  sharding = NamedSharding(mesh, P("d"))
  shape = lambda dims: (n, args.heads, *(size[d] for d in dims))
  a = jax.device_put(jnp.ones(shape(lhs_dims), jnp.float32), sharding)
  b = jax.device_put(jnp.ones(shape(rhs_dims), jnp.float32), sharding)

  def tiles(a, b):
    out = jax.eval_shape(lambda x, y: jnp.einsum(spec, x, y), a[0], b[0])
    init = jnp.zeros(out.shape, jnp.float32) + 0 * a[0, 0, 0, 0]  # varies over the mesh
    step = lambda acc, xy: (acc + jnp.einsum(spec, *xy, precision="highest"), None)
    return lax.scan(step, init, (a, b))[0][None]

  fn = jax.jit(jax.shard_map(tiles, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  flops = 2.0 * n * args.heads * args.block * args.block * args.head_dim
  # the fastest run: the one least disturbed by other load on the host
  return flops / min(run_times(fn, a, b, repeats=args.repeats)) / 1e9


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax

  lines = header("bench_tile.py", sys.argv[1:] if argv is None else argv, jax.device_count())
  lines.append(
    f"{args.devices} devices at once, {args.tiles} tiles each of {args.heads} heads, "
    f"{args.block} x {args.block} scores, head dim {args.head_dim}; fastest of {args.repeats}.\n"
  )
  lines += ["| product | GFLOP/s |", "|---|---|"]
  for name, (spec, lhs, rhs) in PRODUCTS.items():
    lines.append(f"| {name} (`{spec}`) | {product_rate(args, spec, lhs, rhs):.3g} |")
    print(lines[-1], flush=True)
  rate = matmul_rate(args.repeats, stat=min, size=args.matmul_size)
  lines.append(f"| {args.matmul_size}^3 matmul, one device | {rate / 1e9:.3g} |")
  print(lines[-1], flush=True)
  return publish(lines, args.out, "tile")


if __name__ == "__main__":
  main()
