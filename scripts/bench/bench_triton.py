"""On one GPU: the Triton launches of jax_ring's Pallas kernels, timed one by one.

Calls the block kernels directly (one query shard against one K/V shard, as one ring
step does) with each `Launch` of a list (rows a program holds, rows per loop step,
num_warps, num_stages) and exp against exp2, and prints the median time of each, its
TFLOP/s, and its largest relative difference from the first variant's result (a
variant that computes something else shows there). Then `--widths` runs the default
`tuning_for` every compute dtype and head dim, forward and backward at a small shape,
against float64: a launch that asks for more shared memory than the GPU has fails
there, not in a user's run.

    python scripts/bench/bench_triton.py --length 16384 --head-dim 128
    python scripts/bench/bench_triton.py --widths
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FORWARD = [
  (128, 128, 4, 2, False),
  (128, 128, 4, 2, True),
  (128, 64, 4, 2, True),
  (128, 64, 4, 3, True),
  (128, 64, 8, 3, True),
  (128, 128, 8, 2, True),
  (128, 128, 8, 3, True),
  (64, 64, 4, 3, True),
  (128, 32, 4, 3, True),
  (64, 128, 4, 2, True),
]
BACKWARD = [
  (128, 128, 4, 2, False),
  (128, 128, 4, 2, True),
  (128, 32, 4, 3, True),
  (128, 64, 4, 2, True),
  (128, 64, 8, 3, True),
  (64, 64, 4, 2, True),
  (128, 32, 8, 4, True),
  (64, 32, 4, 3, True),
  (128, 16, 4, 4, True),
]


def _rel(x, ref) -> float:
  import numpy as np

  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(x)):
    return float("nan")
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def sweep(args) -> None:
  import jax
  import jax.numpy as jnp
  from _harness import median_time

  from jax_ring import _pallas
  from jax_ring._kernel import MaskSpec

  b, n, kh, h, t = 1, args.heads, args.kv_heads, args.head_dim, args.length
  dt = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q = (jax.random.normal(keys[0], (b, n, t, h), jnp.float32) * h**-0.5).astype(dt)
  k, v = (jax.random.normal(x, (b, kh, t, h), jnp.float32).astype(dt) for x in keys[1:3])
  do = jax.random.normal(keys[3], (b, n, t, h), jnp.float32).astype(dt)
  pos = jnp.arange(t, dtype=jnp.int32)
  for causal in (False, True):
    spec = MaskSpec(is_causal=causal)
    mask = "causal" if causal else "full"
    flops = 4 * b * n * t * t * h * (0.5 if causal else 1.0)
    common = dict(spec=spec, block_q=min(128, t), block_k=min(128, t))
    first = None
    for rows, step, warps, stages, exp2 in FORWARD:
      launch = _pallas.Launch(rows, step, warps, stages)
      tuning = _pallas.Tuning(launch, launch, launch, exp2)
      fn = jax.jit(
        lambda q, k, v, tuning=tuning, common=common: _pallas.forward(
          q, k, v, pos, pos, None, None, tuning=tuning, interpret=args.interpret, **common
        )
      )
      try:
        out, lse = fn(q, k, v)
        sec = median_time(fn, q, k, v, repeats=args.repeats)
      except Exception as e:
        print(f"{mask} forward {launch} exp2={exp2}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      first = first or (out, lse)
      print(
        f"{mask} forward {rows}x{step} w{warps} s{stages} exp2={exp2}: {sec * 1e3:.2f} ms "
        f"{flops / sec / 1e12:.0f} TFLOP/s diff {_rel(out, first[0]):.1e}",
        flush=True,
      )
    out, lse = first
    delta = jnp.sum(out * do.astype(jnp.float32), -1)
    for part, call in (("dq", _pallas._dq_call), ("dkv", _pallas._dkv_call)):
      ref = None
      for rows, step, warps, stages, exp2 in BACKWARD:
        launch = _pallas.Launch(rows, step, warps, stages)
        tuning = _pallas.Tuning(launch, launch, launch, exp2)
        lse_in = lse * _pallas._LOG2E if exp2 else lse

        def fn(q, k, v, do, lse_in, delta, tuning=tuning, call=call, launch=launch, spec=spec):
          a = (q, k, v, do, lse_in, delta, pos, pos)
          return call(a, spec, tuning, None, args.interpret, *launch.blocks(min(128, t), min(128, t)))

        fn = jax.jit(fn)
        try:
          res = fn(q, k, v, do, lse_in, delta)
          sec = median_time(fn, q, k, v, do, lse_in, delta, repeats=args.repeats)
        except Exception as e:
          print(f"{mask} {part} {launch} exp2={exp2}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
          continue
        res = res if isinstance(res, tuple) else (res,)
        ref = ref or res
        diff = max(_rel(x, r) for x, r in zip(res, ref))
        # dq: 2 matmuls of the tile's 4 in the backward (s and dp recomputed: 3 + 1); dkv: 4.
        share = 3 if part == "dq" else 4
        print(
          f"{mask} {part} {rows}x{step} w{warps} s{stages} exp2={exp2}: {sec * 1e3:.2f} ms "
          f"{share / 2 * flops / sec / 1e12:.0f} TFLOP/s diff {diff:.1e}",
          flush=True,
        )


def widths(args) -> bool:
  """The default tuning of every compute dtype and head dim against float64."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_ring

  jax.config.update("jax_enable_x64", True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  ok = True
  for policy in ("float32", "bfloat16", "float16"):
    for h in (16, 32, 64, 128, 256):
      keys = jax.random.split(jax.random.PRNGKey(h), 4)
      b, t, n, kh = 1, 1024, 4, 2
      q64 = jax.random.normal(keys[0], (b, t, n, h), jnp.float64)
      k64, v64 = (jax.random.normal(x, (b, t, kh, h), jnp.float64) for x in keys[1:3])
      g64 = jax.random.normal(keys[3], (b, t, n, h), jnp.float64)
      ref, vjp = jax.vjp(lambda q, k, v: jax_ring.reference_attention(q, k, v, is_causal=True), q64, k64, v64)
      refs = (ref, *vjp(g64))
      dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[policy]

      def ring(q, k, v, policy=policy):
        return jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True, kernel="pallas", policy=policy)

      @jax.jit
      def both(q, k, v, g, ring=ring):
        o, f = jax.vjp(ring, q, k, v)
        return (o, *f(g))

      try:
        got = both(*(x.astype(dt) for x in (q64, k64, v64, g64)))
        errs = [_rel(x, r) for x, r in zip(got, refs)]
        bound = 1e-4 if policy == "float32" else 2e-2
        good = all(e <= bound for e in errs)
        line = " ".join(f"{e:.1e}" for e in errs)
      except Exception as e:
        good, line = False, f"failed {type(e).__name__}: {str(e)[:200]}"
      ok &= good
      print(f"widths {policy} H={h}: {line} {'ok' if good else 'FAIL'}", flush=True)
  return ok


def parse_args(argv=None):
  from jax_ring.models import cli

  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=16384, help="query and key shard length")
  p.add_argument("--heads", type=int, default=32, help="query heads")
  p.add_argument("--kv-heads", type=int, default=8, help="kv heads")
  p.add_argument("--head-dim", type=int, default=128, help="head dim")
  p.add_argument("--dtype", default="bfloat16", help="input dtype of the timed kernels")
  p.add_argument("--repeats", type=int, default=10, help="timed runs after a warm-up (median kept)")
  p.add_argument("--widths", action="store_true", help="the default tuning of every dtype and head dim")
  p.add_argument("--no-sweep", action="store_true", help="skip the timed launches")
  p.add_argument("--interpret", action="store_true", help="interpret the kernels (a CPU smoke test)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  ok = True
  if not args.no_sweep:
    sweep(args)
  if args.widths:
    ok = widths(args)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
