r"""Rollouts on one GPU: G completions of N new tokens each from one prompt, sampled
(temperature 1, no stop token, so every completion is N tokens long), by jax_ring's
`generate` (the model's KV cache, the prompt through one jitted prefill and the new
tokens through one jitted loop) and, with `--torch`, by transformers' `generate` on the
same random model, each in a process of its own (killed past `--timeout`).

    python scripts/bench/bench_rollout.py --model llama-3.2-1b --prompt 512 --completions 8 \
        --new-tokens 4096 --torch --json out.json

Per implementation: seconds for the rollout (median of `--repeats` after a first run,
which compiles jax_ring's programs), new tokens per second (G x N over that), and peak
device memory. Weights are random, in bfloat16, as are the peer's (SDPA attention, its
own KV cache). `--tiny` shrinks the model to 2 small layers and a vocabulary of 512, for a
run on a CPU (peak memory is then null).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_train_gpu import model_config, run_worker, torch_available

from jax_ring.models import cli


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--model", default="llama-3.2-1b", help="a name of models.config")
  p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
  p.add_argument("--completions", type=int, default=8, help="completions G of the prompt")
  p.add_argument("--new-tokens", type=int, default=4096, help="tokens N of each completion")
  p.add_argument("--repeats", type=int, default=2, help="timed rollouts after the first")
  p.add_argument("--torch", action="store_true", help="also transformers' generate, where importable")
  p.add_argument("--tiny", action="store_true", help="2 small layers: a run on a CPU")
  p.add_argument("--timeout", type=float, default=300, help="seconds for each implementation's process")
  p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON (default: none)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "jax" or "torch"
  args = p.parse_args(argv)
  for name in ("prompt", "completions", "new_tokens", "repeats"):
    if getattr(args, name) < (0 if name == "repeats" else 1):
      p.error(
        f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {0 if name == 'repeats' else 1}"
      )
  return args


def prompt_tokens(args, vocab: int):
  """The one prompt, repeated for each completion: int32 [G, P]."""
  import numpy as np

  row = np.random.default_rng(0).integers(0, vocab, args.prompt).astype(np.int32)
  return np.tile(row, (args.completions, 1))


def _median(times):
  return sorted(times)[len(times) // 2] if times else None


def jax_row(args) -> dict:
  import jax
  import numpy as np

  from jax_ring import models
  from jax_ring.models.generate import generate

  cfg = model_config(args.model, args.tiny)
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  model = models.build(cfg, mesh=mesh, dtype="bfloat16", param_dtype="bfloat16")
  prompts = prompt_tokens(args, cfg.vocab_size)
  times, lengths = [], None
  for i in range(args.repeats + 1):
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=args.new_tokens, temperature=1.0, rng=jax.random.key(i))
    lengths = np.asarray(out.lengths)  # waits for the rollout
    if i:
      times.append(time.perf_counter() - start)
    else:
      first = time.perf_counter() - start
  stats = jax.devices()[0].memory_stats() or {}
  return dict(
    impl="jax_ring",
    first_s=round(first, 2),
    rollout_s=round(_median(times) if times else first, 4),
    new_tokens=int(lengths.sum()),
    peak_bytes=stats.get("peak_bytes_in_use"),
  )


def torch_row(args) -> dict:
  import torch
  import transformers

  from jax_ring import models

  cfg = model_config(args.model, args.tiny)
  values = models.checkpoints.config_json(cfg)
  cls = getattr(transformers, values["architectures"][0])
  config = transformers.AutoConfig.for_model(**values)
  config._attn_implementation = "sdpa"
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.manual_seed(0)
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(device):
    model = cls(config)
  torch.set_default_dtype(torch.float32)
  model.eval()
  prompts = torch.tensor(prompt_tokens(args, cfg.vocab_size), device=device, dtype=torch.long)
  n = args.new_tokens
  times, new = [], 0
  for _ in range(args.repeats + 1):
    if device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
      out = model.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
        max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
      )  # fmt: skip
    if device == "cuda":
      torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    new = int(out.shape[0] * (out.shape[1] - prompts.shape[1]))
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return dict(
    impl="torch+transformers",
    first_s=round(times[0], 2),
    rollout_s=round(_median(times[1:] or times), 4),
    new_tokens=new,
    peak_bytes=peak,
  )


def run_row(args, impl: str) -> dict:
  """The row of `impl` in a process of its own (SIGKILL past --timeout)."""
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--model", args.model]
  cmd += ["--prompt", str(args.prompt), "--completions", str(args.completions)]
  cmd += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
  return dict(impl=impl) | run_worker(cmd + (["--tiny"] if args.tiny else []), args.timeout)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.worker:
    print(json.dumps(jax_row(args) if args.worker == "jax" else torch_row(args)), flush=True)
    return {}
  rows = [run_row(args, "jax")]
  if args.torch:
    why = torch_available()
    rows.append(dict(impl="torch+transformers", error=why) if why else run_row(args, "torch"))
  expected = args.completions * args.new_tokens
  for row in rows:
    row.setdefault("rollout_s", None)
    seconds = row["rollout_s"]
    row["tokens_per_s"] = round(expected / seconds, 1) if seconds else None
    if "new_tokens" in row and row["new_tokens"] != expected:
      row["error"] = f"{row['new_tokens']} new tokens, not {expected}"
  print(f"{args.model}{' (tiny)' if args.tiny else ''}: {args.completions} completions of {args.new_tokens} "
        f"tokens from a prompt of {args.prompt}")  # fmt: skip
  print("| implementation | rollout s | new tokens/s | peak GiB |")
  print("|---|---|---|---|")
  for row in rows:
    peak = row.get("peak_bytes")
    cells = [
      row["impl"],
      row["rollout_s"],
      row["tokens_per_s"],
      None if peak is None else round(peak / 2**30, 1),
    ]
    print(
      "| "
      + " | ".join("-" if c is None else str(c) for c in cells)
      + " |"
      + (f" {row['error']}" if row.get("error") else "")
    )
  report = dict(
    rows=rows, model=args.model, tiny=args.tiny, prompt=args.prompt, completions=args.completions,
    new_tokens=args.new_tokens,
  )  # fmt: skip
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
