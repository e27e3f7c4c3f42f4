"""A DecoderLM training step with every layer on the ring's token order
(`LMConfig.ring_order`) against the same model in natural order, ring attention over 8
devices: step time, per-device memory and model FLOP/s as a fraction of the matmul rate.

In natural order each causal layer's attention moves q, k and v into the zigzag layout
and its output back, in the forward and again in the backward; in ring order the batch
is permuted once and no layer moves anything but the ring's own K/V. Both programs are
compiled first; then each round times one step of each in turn (AdamW update included,
parameters donated), and the table gives the medians and the spread over the rounds.

Model FLOPs per step: 6 x (parameters in matmuls: everything but the embedding table)
x tokens, plus 6 x T^2 x D x B per layer for causal attention (4 B T^2 D for Q K^T and
P V over the whole square, half of it causal, and the backward twice the forward). The
fraction divides FLOP/s by a 4096^3 float32 matmul on one device timed before and after.

  python scripts/bench/bench_lm_order.py --out docs/benchmarks.md
"""

from __future__ import annotations

import sys
import time

from _harness import add_lm_args, header, lm_config, matmul_rate, memory_mib, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv):
  p = cli.parser(__doc__)
  add_lm_args(p)
  p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="sequence lengths")
  p.add_argument("--rounds", type=int, default=3, help="timed steps of each model, interleaved")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'lm-order' section)")
  return p.parse_args(argv)


def build_step(args, seq_len: int, ring_order: bool):
  """(compiled step, its arguments, per-device MiB, temp MiB, model FLOPs per step)."""
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring.models import DecoderLM
  from jax_ring.models.train.scratch import loss_and_accuracy, make_mesh, replicate

  mesh = make_mesh(1, args.devices)
  cfg = lm_config(args, policy="float32", ring_order=ring_order)
  model = DecoderLM(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  if ring_order and model.ring_layout(seq_len) is None:
    raise SystemExit(f"T={seq_len}: the ring runs contiguous on {args.devices} devices; nothing to compare")
  graphdef, params = nnx.split(model, nnx.Param)
  params = replicate(params, mesh)
  tx = optax.adamw(1e-4)
  opt_state = replicate(tx.init(params), mesh)
  rng = np.random.default_rng(0)
  on_seq = NamedSharding(mesh, P(None, "seq"))
  batch = lambda: jax.device_put(rng.integers(0, args.vocab, (args.batch, seq_len)).astype(np.int32), on_seq)
  tokens, targets = batch(), batch()
  weights = jax.device_put(np.ones((args.batch, seq_len), np.float32), on_seq)

  def train_step(params, opt_state, tokens, targets, weights):
    def loss(params):
      value, _ = loss_and_accuracy(nnx.merge(graphdef, params), tokens, targets, weights)
      return value

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  step_args = (params, opt_state, tokens, targets, weights)
  compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(*step_args).compile()
  stats = compiled.memory_analysis()
  leaves = jax.tree_util.tree_leaves_with_path(params)
  matmul_params = sum(x.size for path, x in leaves if "embed" not in jax.tree_util.keystr(path))
  b, t, d = args.batch, seq_len, args.dim
  flops = 6 * matmul_params * b * t + args.layers * 6 * b * t * t * d
  return compiled, step_args, memory_mib(compiled), stats.temp_size_in_bytes / 2**20, flops


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  simulate_devices(args.devices)
  import jax
  import numpy as np

  lines = header("bench_lm_order.py", sys.argv[1:] if argv is None else argv, args.devices)
  before = matmul_rate(3)
  print(f"matmul: {before / 1e9:.1f} GFLOP/s", flush=True)
  rows = []
  for seq_len in args.lengths:
    built = {order: build_step(args, seq_len, order) for order in (False, True)}
    state = {order: built[order][1] for order in built}
    times = {order: [] for order in built}
    for _ in range(args.rounds + 1):  # the first round warms up
      for order, (compiled, *_rest) in built.items():
        params, opt_state, *batch = state[order]
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, *batch)
        jax.block_until_ready(loss)
        times[order].append(time.perf_counter() - start)
        state[order] = (params, opt_state, *batch)
    for order, (_, _, mib, temp, flops) in built.items():
      samples = times[order][1:]
      rows.append((seq_len, order, float(np.median(samples)), min(samples), max(samples), mib, temp, flops))
      print(rows[-1], flush=True)
    del built, state
  after = matmul_rate(3)
  rate = max(before, after)
  lines += [
    f"DecoderLM training step (forward, backward, AdamW), width {args.dim}, {args.layers} layers, "
    f"{args.heads} heads over {args.kv_heads} kv heads, MLP {4 * args.dim}, vocabulary {args.vocab}, "
    f"batch {args.batch}, float32, causal ring attention over {args.devices} devices (zigzag); "
    f"medians of {args.rounds} interleaved steps (min-max after them). 4096^3 float32 matmul: "
    f"{before / 1e9:.1f} GFLOP/s before, {after / 1e9:.1f} after; the fraction uses the higher.\n",
    "| T | ring order | step s (min-max) | natural / ring order | MiB/device | temp MiB/device "
    "| model GFLOP/s | of matmul |",
    "|---|---|---|---|---|---|---|---|",
  ]
  base = {r[0]: r[2] for r in rows if not r[1]}
  for seq_len, order, med, lo, hi, mib, temp, flops in rows:
    ratio = f"{base[seq_len] / med:.2f}" if order else ""
    lines.append(
      f"| {seq_len} | {'on' if order else 'off'} | {med:.2f} ({lo:.2f}-{hi:.2f}) | {ratio} | {mib:.1f} "
      f"| {temp:.1f} | {flops / med / 1e9:.1f} | {flops / med / rate:.2f} |"
    )
  return publish(lines, args.out, "lm-order", echo=True)


if __name__ == "__main__":
  main()
