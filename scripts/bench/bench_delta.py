"""What `Policy.exact_delta` buys and costs under the bf16 policy: the backward's delta
= rowsum(dO * O) from the float32 output (kept for the backward) or from the output
after its cast to bf16.

For each shape: the error of the output and of dQ, dK, dV against the float64 dense
reference (relative norm error, and the share of JAX's bf16 test tolerance, |g - ref|
<= 0.2 + 0.2 |ref|, that the worst entry uses), jax.nn.dot_product_attention's own
errors beside them (on one device), and per device the bytes the forward keeps for
the backward (the vjp residuals) and the forward+backward's temp memory, both from the
compiler's memory_analysis().

    python scripts/bench/bench_delta.py
    python scripts/bench/bench_delta.py --out docs/benchmarks.md
"""

from __future__ import annotations

import functools
import sys

from _harness import header, publish, simulate_devices

from jax_ring.models import cli

# (name, B, T, N, K, H, devices, options): the first is JAX's test_sdpa_large_head_size.
SHAPES = [
  ("JAX large head", 2, 64, 2, 2, 256, 2, {"is_causal": True, "scale": 1.0}),
  ("causal GQA", 1, 2048, 8, 2, 64, 8, {"is_causal": True}),
]


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'delta' section)")
  return p.parse_args(argv)


def _errors(grads, ref):
  import numpy as np

  rows = []
  for g, r in zip(grads, ref):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    rel = float(np.linalg.norm(g - r) / np.linalg.norm(r))
    used = float(np.max(np.abs(g - r) / (0.2 + 0.2 * np.abs(r))))
    rows.append(f"{rel:.1e} / {used:.2f}")
  return rows


def table_lines() -> list[str]:
  import jax
  import jax.numpy as jnp

  import jax_ring

  jax.config.update("jax_enable_x64", True)
  lines = [
    "bf16 inputs and the `bfloat16` policy (bf16 matmul inputs and wire, float32 statistics). "
    "Each error cell: relative norm error vs the float64 reference / share of JAX's bf16 "
    "tolerance (0.2 + 0.2 |ref|) the worst entry uses. Residuals: what the forward keeps "
    "for the backward, per device.\n",
    "| shape | devices | delta from | out | dQ | dK | dV | residuals KiB | fwd+bwd temp KiB |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, b, t, n, k, h, devices, options in SHAPES:
    mesh = jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices])
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)]
    q, kk, v, g = (jax.random.normal(x, s, jnp.float32).astype(jnp.bfloat16) for x, s in zip(keys, shapes))
    wide = [x.astype(jnp.float64) for x in (q, kk, v)]
    ref = functools.partial(jax_ring.reference_attention, **options)
    ref_out, ref_vjp = jax.vjp(ref, *wide)
    expected = [ref_out, *ref_vjp(g.astype(jnp.float64))]
    shape = f"{name}: B={b} T={t} N={n} K={k} H={h}"
    for exact in (True, False):
      policy = jax_ring.Policy(compute_dtype=jnp.bfloat16, precision="default", exact_delta=exact)
      attend = functools.partial(jax_ring.ring_attention, mesh=mesh, policy=policy, **options)

      def both(q, k, v, g, attend=attend):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(g)

      forward = jax.jit(lambda q, k, v, attend=attend: jax.vjp(attend, q, k, v)[1])
      kept = forward.lower(q, kk, v).compile().memory_analysis().output_size_in_bytes
      program = jax.jit(both).lower(q, kk, v, g).compile()
      temp = program.memory_analysis().temp_size_in_bytes
      out, grads = program(q, kk, v, g)
      errs = _errors([out, *grads], expected)
      label = "float32 output (exact_delta=True)" if exact else "bf16 output (exact_delta=False)"
      lines.append(
        f"| {shape} | {devices} | {label} | {' | '.join(errs)} | {kept / 1024:.0f} | {temp / 1024:.0f} |"
      )
      print(lines[-1], flush=True)
    # jax.nn on one device, its default (XLA) implementation, for comparison.
    nn = lambda q, k, v, options=options: jax.nn.dot_product_attention(q, k, v, **options)
    out, vjp = jax.vjp(nn, q, kk, v)
    errs = _errors([out, *vjp(g)], expected)
    lines.append(f"| {shape} | 1 | jax.nn.dot_product_attention | {' | '.join(errs)} | | |")
    print(lines[-1], flush=True)
  lines += model_lines()
  return lines


def model_lines() -> list[str]:
  """The same choice for a whole training step: bench_lm_memory's DecoderLM."""
  import jax.numpy as jnp
  from bench_lm_memory import parse_args as lm_args
  from bench_lm_memory import step_memory

  import jax_ring

  args = lm_args([])
  t = 16384
  lines = [
    f"\nA whole training step (bench_lm_memory.py's DecoderLM: dim {args.dim}, {args.layers} layers, "
    f"{args.heads} heads, {args.kv_heads} kv heads, ring attention, T={t} over {args.devices} devices, "
    "bf16 activations and policy, no remat), compiled: per-device MiB of arguments + temp.\n",
    "| delta from | MiB per device |",
    "|---|---|",
  ]
  for exact in (True, False):
    policy = jax_ring.Policy(compute_dtype=jnp.bfloat16, precision="default", exact_delta=exact)
    mib = step_memory(args, t, remat=False, scan=False, policy=policy, dtype="bfloat16")
    lines.append(
      f"| {'float32 output (exact_delta=True)' if exact else 'bf16 output (exact_delta=False)'} | {mib:.1f} |"
    )
    print(lines[-1], flush=True)
  return lines


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(max(s[6] for s in SHAPES))
  lines = header("bench_delta.py", sys.argv[1:] if argv is None else argv, max(s[6] for s in SHAPES))
  lines += table_lines()
  return publish(lines, args.out, "delta", echo=True)


if __name__ == "__main__":
  main()
