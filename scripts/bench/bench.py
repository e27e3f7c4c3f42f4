"""Benchmark suite: jax_ring against jax.nn.dot_product_attention (one device) and the
original authors' `ringattention` package (PyPI 0.1.2), measured in the same run.

For each length, device count, mask and dtype it reports the median forward and
forward+backward time, per-device memory (temp + arguments from the compiler's
memory_analysis() of forward+backward) and attention FLOP/s as a fraction of a 4096^3
float32 matmul timed in the same run: forward counts 4*B*N*T^2*H FLOPs (half when
causal), forward+backward 3.5x that (the FlashAttention-2 convention). A max-length
finder then looks for the longest sequence whose compiled forward+backward fits a
per-device budget (compile only, nothing runs), for jax_ring and the reference.

    python scripts/bench/bench.py --quick                   # under 3 minutes, results/bench/
    python scripts/bench/bench.py                           # the full suite -> docs/benchmarks.md
    python scripts/bench/bench.py --lengths 8192 --devices 8 --no-max-length

The reference package is optional (`pip install -e ".[bench]"`); it needs a small
import shim on current JAX (`jax.lib.xla_bridge` is gone), which lives here, not in
the library. Without it, its rows are skipped with a message.
"""

from __future__ import annotations

import os
import sys
import time

from _harness import (
  fwd_bwd,
  header,
  inputs,
  matmul_rate,
  measure,
  memory_mib,
  publish,
  simulate_devices,
)

from jax_ring.models import cli

QUICK = dict(lengths="1024,2048", devices="1,8", causal="both", dtypes="float32", repeats=2, budget_mib=32)


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--quick", action="store_true", help="small sweep and budget; writes under results/bench")
  p.add_argument("--lengths", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
  p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts for the ring")
  p.add_argument(
    "--causal",
    choices=["no", "yes", "both"],
    default="both",
    help="masks to time: full (no), causal (yes) or both",
  )
  p.add_argument("--dtypes", default="float32,bfloat16", help="input dtypes (policy = input dtype)")
  p.add_argument("--batch", type=int, default=1, help="batch size B")
  p.add_argument("--heads", type=int, default=8, help="query heads N (kv heads K = N)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument(
    "--repeats", type=int, default=3, help="timed runs per configuration after a warm-up (the median is kept)"
  )
  p.add_argument("--dense-max-length", type=int, default=8192, help="longest T for the one-device dense row")
  p.add_argument("--impls", default="jax_ring,ringattention,dense", help="which implementations to run")
  p.add_argument(
    "--kernel",
    default="auto",
    choices=["auto", "xla", "pallas"],
    help="jax_ring's block kernel (auto: the Pallas kernel on a GPU, the XLA tiles on CPU)",
  )
  p.add_argument(
    "--dense-implementation",
    default=None,
    choices=["xla", "cudnn"],
    help="jax.nn.dot_product_attention's implementation for the dense row (cudnn: on a GPU)",
  )
  p.add_argument("--ra-chunk", type=int, default=512, help="largest ringattention query/key chunk size")
  p.add_argument(
    "--budget-mib", type=float, default=1024.0, help="per-device budget of the max-length finder"
  )
  p.add_argument(
    "--max-length-devices", default="1,2,4,8", help="comma-separated device counts of the max-length table"
  )
  p.add_argument(
    "--matmul-size", type=int, default=4096, help="side of the matmul the FLOP/s are compared with"
  )
  p.add_argument("--no-max-length", action="store_true", help="skip the max-length table")
  p.add_argument("--no-sweep", action="store_true", help="skip the timing sweep")
  p.add_argument("--out", default=None, help="Markdown file to hold the tables (default: see --quick)")
  p.add_argument("--plot-dir", default=None, help="folder for the PNG plots (default: beside --out)")
  args = p.parse_args(argv)
  if args.quick:
    defaults = p.parse_args([])
    for name, value in QUICK.items():
      if getattr(args, name) == getattr(defaults, name):
        setattr(args, name, value)
  args.out = args.out or ("results/bench/quick.md" if args.quick else "docs/benchmarks.md")
  # Plots go beside the tables: docs/img for docs/benchmarks.md, else --out's folder (a
  # run written elsewhere must not replace the plots docs/benchmarks.md shows).
  beside = "docs/img" if os.path.normpath(args.out) == os.path.normpath("docs/benchmarks.md") else None
  args.plot_dir = args.plot_dir or beside or os.path.dirname(args.out) or "."
  args.lengths = [int(x) for x in str(args.lengths).split(",")]
  args.devices = [int(x) for x in str(args.devices).split(",")]
  args.max_length_devices = [int(x) for x in str(args.max_length_devices).split(",")]
  args.dtypes = str(args.dtypes).split(",")
  args.impls = str(args.impls).split(",")
  args.causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
  return args


def import_ringattention():
  """The reference package's pure-JAX ring attention, or (None, why)."""
  import types

  import jax

  if not hasattr(jax.lib, "xla_bridge"):
    # ringattention/__init__.py reads jax.lib.xla_bridge.get_backend().platform.
    shim = types.ModuleType("jax.lib.xla_bridge")
    shim.get_backend = lambda: types.SimpleNamespace(platform=jax.default_backend())
    jax.lib.xla_bridge = shim
    sys.modules["jax.lib.xla_bridge"] = shim
  try:
    from ringattention import ringattention_jax
  except Exception as e:  # ImportError, or the package failing on this JAX
    return None, f"{type(e).__name__}: {e}"
  return ringattention_jax, None


class Suite:
  def __init__(self, args):
    import jax

    self.args = args
    self.jax = jax
    self.ra, self.ra_missing = import_ringattention()

  def mesh(self, d):
    from jax.sharding import AxisType

    return self.jax.make_mesh((d,), ("seq",), axis_types=(AxisType.Explicit,), devices=self.jax.devices()[:d])

  def ra_chunk(self, shard: int) -> int:
    """The reference's chunk size: the largest of ra_chunk, its halves, down to 128, that
    divides the shard (it needs chunks that tile the shard exactly)."""
    chunk = self.args.ra_chunk
    while chunk > 128 and shard % chunk:
      chunk //= 2
    return min(chunk, shard)

  def attention(self, impl, length, d, causal, dtype):
    """(function of q, k, v, input sharding)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    import jax_ring

    if impl == "dense":
      impl = self.args.dense_implementation
      fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
      return fn, SingleDeviceSharding(jax.devices()[0])
    mesh = self.mesh(d)
    sharding = NamedSharding(mesh, P(None, "seq"))
    if impl == "jax_ring":
      kernel = self.args.kernel
      fn = lambda q, k, v: jax_ring.ring_attention(
        q, k, v, mesh=mesh, is_causal=causal, policy=dtype, kernel=kernel
      )
      return fn, sharding
    chunk = self.ra_chunk(length // d)
    kwargs = dict(
      causal_block_size=1 if causal else None,
      query_chunk_size=chunk,
      key_chunk_size=chunk,
      deterministic=True,
      dropout_rng=None,
      attn_pdrop=0.0,
      dtype=jnp.dtype(dtype),
      policy=jax.checkpoint_policies.nothing_saveable,
      precision=None,
      prevent_cse=True,
    )
    ring = lambda q, k, v: self.ra(q, k, v, None, None, None, "seq", True, kwargs)
    spec = P(None, "seq")
    fn = jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    return fn, sharding

  def supports(self, impl, length, d):
    if impl == "ringattention":
      return self.ra is not None and length % d == 0 and (length // d) % self.ra_chunk(length // d) == 0
    return True

  def shapes(self, length, dtype, sharding):
    import jax

    a = self.args
    shape = (a.batch, length, a.heads, a.head_dim)
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for _ in range(4)]

  def measure(self, impl, length, d, causal, dtype):
    """(fwd s, fwd+bwd s, MiB/device, output) for one configuration."""
    attend, sharding = self.attention(impl, length, d, causal, dtype)
    a = self.args
    shape = (a.batch, length, a.heads, a.head_dim)
    return measure(attend, *inputs([shape] * 4, sharding, dtype), repeats=a.repeats)

  def fits(self, impl, length, d, budget_mib) -> bool:
    import jax
    import jax.numpy as jnp

    attend, sharding = self.attention(impl, length, d, False, "float32")
    compiled = jax.jit(fwd_bwd(attend)).lower(*self.shapes(length, jnp.float32, sharding)).compile()
    return memory_mib(compiled) <= budget_mib

  def max_length(self, impl, d, budget_mib, step: int) -> int:
    """Longest multiple of `step` that fits: doubling, then bisection to 1/32."""
    lo, hi = 0, step
    while self.fits(impl, hi, d, budget_mib):
      lo, hi = hi, hi * 2
    while hi - lo > max(step, lo // 32):
      mid = (lo + hi) // 2 // step * step
      if mid in (lo, hi):
        break
      lo, hi = (mid, hi) if self.fits(impl, mid, d, budget_mib) else (lo, mid)
    return lo


def flops(args, length, causal) -> float:
  f = 4.0 * args.batch * args.heads * length * length * args.head_dim
  return f / 2 if causal else f


def plot(rows, path_prefix: str) -> list[str]:
  """Time and memory against length, one line per (implementation, devices); float32."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []
  for causal in sorted({r["causal"] for r in rows}):
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    lines = {}
    for r in rows:
      if r["causal"] == causal and r["dtype"] == "float32":
        lines.setdefault(f"{r['impl']} x{r['devices']}", []).append(r)
    for label, rs in sorted(lines.items()):
      rs = sorted(rs, key=lambda r: r["length"])
      xs = [r["length"] for r in rs]
      ax_t.plot(xs, [r["fwd_bwd"] for r in rs], marker="o", label=label)
      ax_m.plot(xs, [r["mib"] for r in rs], marker="o", label=label)
    mask = "causal" if causal else "full"
    ax_t.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="fwd+bwd seconds", title=mask)
    ax_m.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB per device", title=mask)
    for ax in (ax_t, ax_m):
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    fig.tight_layout()
    path = f"{path_prefix}_{mask}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(max(args.devices + args.max_length_devices))
  import jax
  import numpy as np

  t_start = time.perf_counter()
  suite = Suite(args)
  lines = header("bench.py", sys.argv[1:] if argv is None else argv, jax.device_count())
  # The ceiling is the faster of a measurement before and one after the sweep, so a
  # moment of contention on the host cannot inflate the fractions.
  mm = f"{args.matmul_size}^3 float32 matmul on one device"
  rate = matmul_rate(args.repeats, size=args.matmul_size)
  print(f"{mm}: {rate / 1e9:.1f} GFLOP/s", flush=True)
  if suite.ra is None:
    lines.append(f"ringattention rows skipped: the package is not importable ({suite.ra_missing}).\n")
    print(lines[-1].strip(), flush=True)
  impls = [i for i in ("jax_ring", "ringattention", "dense") if i in args.impls]
  import jax_ring

  platform = jax.devices()[0].platform
  for dtype in args.dtypes:
    choice = jax_ring.choose_kernel(args.kernel, platform, args.head_dim, jax_ring.PRESETS[dtype])
    lines.append(f"jax_ring's kernel ({dtype}, --kernel {args.kernel}): {choice.kernel}; {choice.reason}.\n")
    print(lines[-1].strip(), flush=True)
  rows = []
  if not args.no_sweep:
    for length in args.lengths:
      for causal in args.causal:
        for dtype in args.dtypes:
          first = None  # the first output of this (T, mask, dtype): the others are compared with it
          for impl in impls:
            counts = [1] if impl == "dense" else args.devices
            if impl == "dense" and length > args.dense_max_length:
              continue
            for d in counts:
              if not suite.supports(impl, length, d):
                continue
              t_fwd, t_both, mib, out = suite.measure(impl, length, d, causal, dtype)
              if first is None:
                first = np.asarray(out, np.float32)
              diff = float(np.max(np.abs(np.asarray(out, np.float32) - first)))
              row = dict(impl=impl, devices=d, length=length, causal=causal, dtype=dtype)
              row.update(fwd=t_fwd, fwd_bwd=t_both, mib=mib, diff=diff)
              rows.append(row)
              print(row, flush=True)
    # The ceiling is the faster of a measurement before and one after the sweep, so a
    # moment of contention on the host cannot inflate the fractions.
    after = matmul_rate(args.repeats, size=args.matmul_size)
    print(f"{mm}, after the sweep: {after / 1e9:.1f} GFLOP/s", flush=True)
    lines.append(
      f"\n{mm}: {rate / 1e9:.1f} GFLOP/s before the sweep, "
      f"{after / 1e9:.1f} after; the fractions use the higher.\n"
    )
    rate = max(rate, after)
    a = args
    lines.append(f"B={a.batch}, N={a.heads}, H={a.head_dim}; ringattention chunks up to {a.ra_chunk}.\n")
    lines.append(
      "| impl | devices | T | mask | dtype | fwd s | fwd+bwd s | MiB/device | fwd / matmul "
      "| fwd+bwd / matmul | max abs diff vs first row |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
      f = flops(args, r["length"], r["causal"])
      mask = "causal" if r["causal"] else "full"
      lines.append(
        f"| {r['impl']} | {r['devices']} | {r['length']} | {mask} | {r['dtype']} "
        f"| {r['fwd']:.3f} | {r['fwd_bwd']:.3f} | {r['mib']:.1f} | {f / r['fwd'] / rate:.2f} "
        f"| {3.5 * f / r['fwd_bwd'] / rate:.2f} | {r['diff']:.1e} |"
      )
    os.makedirs(args.plot_dir, exist_ok=True)
    for path in plot(rows, os.path.join(args.plot_dir, "bench")):
      lines.append(f"\n![{os.path.basename(path)}]({os.path.relpath(path, os.path.dirname(args.out))})")
  if not args.no_max_length:
    budget = args.budget_mib
    lines.append(
      f"\nMax length: the longest T (a multiple of devices x 128) whose forward+backward "
      f"compiles to at most {budget:g} MiB per device (temp + arguments), B={args.batch}, N={args.heads}, "
      f"H={args.head_dim}, float32, non-causal.\n"
    )
    finders = [i for i in ("jax_ring", "ringattention") if i in args.impls]
    finders = [i for i in finders if i != "ringattention" or suite.ra is not None]
    lines.append("| devices | " + " | ".join(finders) + " |")
    lines.append("|---" * (len(finders) + 1) + "|")
    for d in args.max_length_devices:
      found = [suite.max_length(impl, d, budget, d * 128) for impl in finders]
      lines.append(f"| {d} | " + " | ".join(f"{n:,}" for n in found) + " |")
      print(lines[-1], flush=True)
  lines.append(f"\nWhole run: {time.perf_counter() - t_start:.0f} s.")
  publish(lines, args.out, "quick" if args.quick else "full", echo=True)


if __name__ == "__main__":
  main()
