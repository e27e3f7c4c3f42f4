"""On one GPU: jax_ring's kernels checked against float64 and timed against cuDNN.

Two parts, both on the first device (a ring of one: one step, but the same kernels,
passes, merges and custom VJP as on a ring of many):

- `--check`: outputs and gradients of `ring_attention` (cuDNN's fused attention per
  ring step on NVIDIA GPUs, the Pallas/Triton kernel and the XLA tiles: `--check-kernels`;
  where cuDNN cannot take a case, its row names the kernel that ran instead), float32
  and bfloat16 policies, full, causal, causal with a window, causal with segment ids,
  GQA, a length that is no multiple of a block, several passes) against
  `reference_attention` in float64 on the same device, as ||x - ref|| / ||ref||; beside
  them the error of `jax.nn.dot_product_attention` on the same inputs and dtype where it
  takes the mask. Fails (exit 1) past the bounds in BOUNDS.
- `--time`: median forward and forward+backward times of the ring (each of `--kernels`) and of
  `jax.nn.dot_product_attention(implementation="cudnn")`, at the shape of Llama-3-8B's
  attention (32 query heads, 8 kv heads, head dim 128, bfloat16), with TFLOP/s and
  their fraction of a bfloat16 8192^3 matmul timed in the same run. FLOPs: 4*B*N*T^2*H
  forward (half when causal), 3.5x that forward+backward.

    python scripts/bench/bench_gpu.py --check --time --out docs/benchmarks.md
    python scripts/bench/bench_gpu.py --check --smoke   # tiny shapes, any platform
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Checked against float64 (||x - ref|| / ||ref||): float32 inputs with "highest"
# matmuls land far under 1e-4; bfloat16 operands between 1e-3 and 1e-2.
BOUNDS = {"float32": 1e-4, "bfloat16": 2e-2}


def _rel(x, ref) -> float:
  import numpy as np

  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(x)):
    return float("nan")
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def _with_vjp(attend):
  """(q, k, v, dO) -> (output, (dq, dk, dv)) of `attend`."""
  import jax

  def both(q, k, v, g):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(g)

  return both


def _cases(smoke: bool):
  """(name, B, T, N, K, H, mask kwargs, block_sizes kwargs, jax.nn kwargs or None)."""
  if smoke:
    return [("causal, GQA, T=200", 1, 200, 4, 2, 32, {"is_causal": True}, {}, {"is_causal": True})]
  return [
    ("full, GQA 8/2, T=1000", 2, 1000, 8, 2, 64, {}, {}, {}),
    ("causal, GQA 8/2, T=1000", 2, 1000, 8, 2, 64, {"is_causal": True}, {}, {"is_causal": True}),
    (
      "causal, window 256",
      1,
      2048,
      4,
      4,
      128,
      {"is_causal": True, "local_window_size": (256, 0)},
      {},
      {"is_causal": True, "local_window_size": (256, 0)},
    ),
    ("causal, segment ids", 2, 1024, 4, 1, 64, {"is_causal": True, "segments": 3}, {}, None),
    # Packed rows: 12 documents of mixed lengths a row, a padded tail on the first.
    ("causal, 12 documents a row", 2, 8192, 8, 2, 128, {"is_causal": True, "segments": 12}, {}, None),
    (
      "causal, window 512",
      1,
      4096,
      8,
      2,
      128,
      {"is_causal": True, "local_window_size": (512, 0)},
      {},
      {"is_causal": True, "local_window_size": (512, 0)},
    ),
    (
      "causal, window 4096",
      1,
      8192,
      8,
      2,
      128,
      {"is_causal": True, "local_window_size": (4096, 0)},
      {},
      {"is_causal": True, "local_window_size": (4096, 0)},
    ),
    (
      "causal, window 512, 12 documents a row",
      1,
      8192,
      4,
      1,
      256,
      {"is_causal": True, "local_window_size": (512, 0), "segments": 12},
      {},
      None,
    ),
    (
      "causal, 4 passes",
      1,
      4096,
      8,
      4,
      128,
      {"is_causal": True},
      {"pass_tokens": 4096},
      {"is_causal": True},
    ),
  ]


def check(args) -> tuple[list[str], bool]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_ring

  dev = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([dev]), ("seq",))
  lines = [
    "| case | kernel | policy | out | dq | dk | dv | jax.nn out / dq (same dtype) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  ok = True
  kernels = args.check_kernels.split(",")
  if dev.platform != "gpu" or "NVIDIA" not in dev.device_kind.upper():
    kernels = [k for k in kernels if k != "cudnn"]
  for name, b, t, n, kh, h, mask, blocks, nn_kw in _cases(args.smoke):
    keys = jax.random.split(jax.random.PRNGKey(t + n), 4)
    q64, k64, v64 = (
      jax.random.normal(keys[0], (b, t, n, h), jnp.float64),
      jax.random.normal(keys[1], (b, t, kh, h), jnp.float64),
      jax.random.normal(keys[2], (b, t, kh, h), jnp.float64),
    )
    g64 = jax.random.normal(keys[3], (b, t, n, h), jnp.float64)
    mask = dict(mask)
    nseg = mask.pop("segments", 0)
    if nseg:
      # Documents of random lengths, and a padded tail (id -1) on the first row.
      cuts = np.sort(np.random.default_rng(t).choice(np.arange(1, t), nseg - 1, replace=False))
      seg = np.zeros((b, t), np.int32)
      for c in cuts:
        seg[:, c:] += 1
      seg[0, t - 37 :] = -1
      mask["segment_ids"] = jnp.asarray(seg)

    def reference(q, k, v, mask=mask):
      return jax_ring.reference_attention(q, k, v, **mask)

    ref, ref_vjp = jax.vjp(reference, q64, k64, v64)
    ref_grads = ref_vjp(g64)
    for policy in args.check_policies.split(","):
      dt = jnp.float32 if policy == "float32" else jnp.bfloat16
      q, k, v, g = (x.astype(dt) for x in (q64, k64, v64, g64))
      nn_err = "-"
      if nn_kw is not None:
        impl = "cudnn" if (dev.platform == "gpu" and dt == jnp.bfloat16) else None

        def dense(q, k, v, nn_kw=nn_kw, impl=impl):
          return jax.nn.dot_product_attention(q, k, v, implementation=impl, **nn_kw)

        try:
          o, (dq_nn, *_) = jax.jit(_with_vjp(dense))(q, k, v, g)
          nn_err = f"{_rel(o, ref):.1e} / {_rel(dq_nn, ref_grads[0]):.1e} ({impl or 'xla'})"
        except Exception as e:  # cuDNN refuses some shapes; say so rather than stop
          nn_err = f"refused: {type(e).__name__}"
      for kernel in kernels:

        def ring(q, k, v, kernel=kernel, policy=policy, mask=mask, blocks=blocks):
          return jax_ring.ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            kernel=kernel,
            policy=policy,
            block_sizes=jax_ring.BlockSizes(**blocks) if blocks else None,
            **mask,
          )

        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as fell_back:
          warnings.simplefilter("always")
          o, grads = jax.jit(_with_vjp(ring))(q, k, v, g)
        errs = [_rel(o, ref)] + [_rel(x, r) for x, r in zip(grads, ref_grads)]
        bound = BOUNDS[policy]
        good = all(e <= bound for e in errs)  # NaN fails
        ok &= good
        ran = kernel
        for w in fell_back:  # kernel="cudnn" where cuDNN cannot take the call
          if "kernel='cudnn' runs" in str(w.message):
            ran = f"cudnn -> {str(w.message).split(' runs ')[1].split(' instead')[0]}"
        lines.append(
          f"| {name} | {ran} | {policy} | "
          + " | ".join(f"{e:.1e}" for e in errs)
          + f" | {nn_err} |"
          + ("" if good else f" **over {bound:.0e}**")
        )
        print(lines[-1], f"({time.perf_counter() - start:.1f} s)", flush=True)
  return lines, ok


def matmul_rate(repeats: int, size: int = 8192) -> float:
  import jax
  import jax.numpy as jnp
  from _harness import median_time

  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.bfloat16)
  return 2 * size**3 / median_time(jax.jit(jnp.matmul), a, b, repeats=repeats)


def _kernel_options(spec: str) -> dict:
  """ring_attention's options for a `--kernels` entry: a kernel's name, or NAME@TOKENS
  for its passes of at most TOKENS local tokens x kv heads (`BlockSizes.pass_tokens`)."""
  import jax_ring

  name, _, tokens = spec.partition("@")
  return dict(kernel=name, block_sizes=jax_ring.BlockSizes(pass_tokens=int(tokens)) if tokens else None)


def _timed_mask(name: str, t: int) -> dict:
  """ring_attention's mask options for a `--masks` entry at length t: "full", "causal",
  "windowW" (causal, W keys back) or "documents" (causal, documents of mixed lengths
  from 256 to 8192 tokens, log-uniform). FLOPs are counted as for causal attention."""
  import jax.numpy as jnp
  import numpy as np

  if name == "full":
    return {"is_causal": False}
  if name == "causal":
    return {"is_causal": True}
  if name.startswith("window"):
    return {"is_causal": True, "local_window_size": (int(name[6:]), 0), "layout": "contiguous"}
  if name == "documents":
    rng = np.random.default_rng(t)
    lengths = np.exp(rng.uniform(np.log(256), np.log(8192), t // 256)).astype(int)
    ids = np.searchsorted(np.cumsum(lengths), np.arange(t), side="right").astype(np.int32)
    return {"is_causal": True, "segment_ids": jnp.asarray(ids[None])}
  raise SystemExit(f"--masks: {name!r} is none of windowW, documents")


def timing(args) -> list[str]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from _harness import fwd_bwd, median_time, memory_mib

  import jax_ring

  dev = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([dev]), ("seq",))
  rate = matmul_rate(args.repeats)
  b, n, kh, h = 1, args.heads, args.kv_heads, args.head_dim
  lines = [
    f"bfloat16 {8192}^3 matmul: {rate / 1e12:.0f} TFLOP/s (median of {args.repeats}).\n",
    "| T | mask | implementation | fwd ms | fwd TFLOP/s | fwd / matmul | fwd+bwd ms | fwd+bwd TFLOP/s "
    "| fwd+bwd / matmul | fwd+bwd temp GiB |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  print(lines[0], flush=True)
  for t in [int(x) for x in args.lengths.split(",")]:
    keys = jax.random.split(jax.random.PRNGKey(t), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kh, h), jnp.bfloat16)
    g = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    for mask_name in ["full", "causal", *filter(None, args.masks.split(","))]:
      causal = mask_name != "full"
      masks = _timed_mask(mask_name, t)
      flops = 4 * b * n * t * t * h * (0.5 if causal else 1.0)
      impls = {
        f"ring, {kern}": (
          lambda q, k, v, kern=kern, masks=masks: jax_ring.ring_attention(
            q, k, v, mesh=mesh, policy="bfloat16", **masks, **_kernel_options(kern)
          )
        )
        for kern in args.kernels.split(",")
      }
      if "segment_ids" not in masks:
        nn_masks = {"is_causal": causal, "local_window_size": masks.get("local_window_size")}
        impls["jax.nn cudnn"] = lambda q, k, v, nn_masks=nn_masks: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn", **nn_masks
        )
      for name, attend in impls.items():
        try:
          fwd = jax.jit(attend).lower(q, k, v).compile()
          both = jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile()
          t_f = median_time(fwd, q, k, v, repeats=args.repeats)
          t_b = median_time(both, q, k, v, g, repeats=args.repeats)
        except Exception as e:  # a refusal is a row, not the end of the run
          lines.append(f"| {t} | {mask_name} | {name} | failed: {type(e).__name__} |")
          print(lines[-1], str(e)[:300], flush=True)
          continue
        lines.append(
          f"| {t} | {mask_name} | {name} | {t_f * 1e3:.2f} | {flops / t_f / 1e12:.0f} | "
          f"{flops / t_f / rate:.2f} | {t_b * 1e3:.2f} | {3.5 * flops / t_b / 1e12:.0f} | "
          f"{3.5 * flops / t_b / rate:.2f} | {memory_mib(both) / 1024:.2f} |"
        )
        print(lines[-1], flush=True)
  return lines


def parse_args(argv=None):
  from jax_ring.models import cli

  p = cli.parser(__doc__)
  p.add_argument("--check", action="store_true", help="outputs and gradients against float64")
  p.add_argument("--time", action="store_true", help="time the kernels against cuDNN")
  p.add_argument("--smoke", action="store_true", help="tiny check shapes (runs on a CPU too)")
  p.add_argument("--lengths", default="4096,16384,65536", help="sequence lengths to time")
  p.add_argument("--heads", type=int, default=32, help="query heads")
  p.add_argument("--kv-heads", type=int, default=8, help="kv heads")
  p.add_argument("--head-dim", type=int, default=128, help="head dim")
  p.add_argument(
    "--kernels",
    default="cudnn,pallas",
    help="ring kernels to time; NAME@TOKENS: passes of at most TOKENS local tokens x kv heads",
  )
  p.add_argument(
    "--check-kernels", default="cudnn,pallas,xla", help="ring kernels to check (cudnn: NVIDIA GPUs only)"
  )
  p.add_argument(
    "--check-policies", default="float32,bfloat16", help="precision policies to check (float32, bfloat16)"
  )
  p.add_argument(
    "--masks",
    default="",
    help="masks timed besides full and causal: windowW (causal, W keys back), documents (default: none)",
  )
  p.add_argument("--repeats", type=int, default=20, help="timed runs after a warm-up (median kept)")
  p.add_argument("--out", default=None, help="Markdown file to hold the tables")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not (args.check or args.time):
    raise SystemExit("bench_gpu.py: nothing to do: pass --check (against float64), --time, or both")

  import jax

  jax.config.update("jax_enable_x64", True)  # the float64 reference
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _harness import header, publish

  dev = jax.devices()[0]
  print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
  lines = header("bench_gpu.py", sys.argv[1:] if argv is None else argv, 1)
  ok = True
  if args.check:
    rows, ok = check(args)
    lines += ["\nOutputs and gradients against float64 (||x - ref|| / ||ref||):\n", *rows]
  if args.time:
    lines += ["", *timing(args)]
  publish(lines, args.out, "gpu", echo=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
