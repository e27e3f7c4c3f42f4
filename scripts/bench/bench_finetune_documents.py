"""A fine-tuning step on packed rows of documents through `scripts/finetune.py`, with
the ring's passes bounded by the rows' longest document (what finetune.py does), by each
batch's own longest, read from its ids while running (`--bound-per-batch`), and with
every pass (`--every-pass`), on the same data and devices.

The model: Llama-3.2-1B's architecture shrunk to `--layers` blocks of width `--dim`
(heads of 64, 4 query heads a kv head, a byte-level tokenizer of 256 bytes and Llama
3's special tokens; random weights), so that on a CPU the attention, which the bound
changes, is most of the step. The data: one JSON Lines file of texts whose lengths in
tokens (bytes) are drawn from `--mix`: "tail", log-normal with median 1,024 and 99th
percentile near 16K, capped at `--cap` (seed 0); "1k", documents of 1,024. finetune.py
packs them into rows of `--length` (best-fit decreasing); each run takes `--steps`
steps, and the table gives the median of each run's step seconds after its first
(compiling) step, from metrics.jsonl, and the losses' largest difference between the
two runs. `--remat full` by default, the setting of the recorded numbers: with finetune.py's own
default ("attention"), rows of 16,384 tokens of the tail mix on 8 simulated devices then
stopped in XLA:CPU's collective rendezvous (a bound that skips no pass still compiled
its check; no longer, see the training guide).

    python scripts/bench/bench_finetune_documents.py --length 16384 --out docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _harness import header, publish

from jax_ring.models import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--length", type=int, default=16384, help="tokens a packed row")
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the ring")
  p.add_argument("--mix", default="tail", choices=["tail", "1k"], help="the documents' lengths")
  p.add_argument("--cap", type=int, default=8192, help="the longest document the tail mix draws")
  p.add_argument("--steps", type=int, default=4, help="steps a run (the first compiles)")
  p.add_argument("--layers", type=int, default=2, help="the model's blocks")
  p.add_argument("--remat", default="full", help="finetune.py's --remat (see the docstring)")
  p.add_argument("--dim", type=int, default=256, help="the model's width")
  p.add_argument("--timeout", type=float, default=1800, help="seconds a run's process may take (SIGKILL)")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'finetune documents' section)")
  args = p.parse_args(argv)
  if args.steps < 2:
    p.error(f"--steps={args.steps}: at least 2 (the first compiles)")
  if args.dim % 256:
    p.error(f"--dim={args.dim}: a multiple of 256 (heads of 64, 4 a kv head)")
  return args


def lengths(mix: str, total: int, cap: int, seed: int = 0) -> list[int]:
  """Documents' lengths in tokens, drawn until they hold `total` tokens."""
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  while sum(out) < total:
    if mix == "1k":
      out.append(1024)
    else:
      out.append(int(min(cap, max(16, rng.lognormal(np.log(1024), np.log(16) / 2.326)))))
  return out


def make_folder(path: str, layers: int, dim: int) -> None:
  """A small Llama with a byte-level tokenizer (a token a byte), saved as a model folder."""
  import dataclasses

  import tokenizers
  from tokenizers import AddedToken, decoders, pre_tokenizers

  from jax_ring import models
  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
  wrapped = HFTokenizer(
    tok, bos_id=tok.token_to_id(SPECIALS[0]), eos_id=tok.token_to_id(SPECIALS[1]), add_bos=True
  )
  cfg = dataclasses.replace(
    models.config("llama-3.2-1b"),
    num_layers=layers,
    dim=dim,
    num_heads=dim // 64,
    num_kv_heads=dim // 256,
    head_dim=64,
    mlp_hidden=2 * dim,
    vocab_size=512,
  )
  models.save(models.build(cfg, attention="dense"), path, tokenizer=wrapped)


def write_data(path: str, sizes: list[int]) -> None:
  """Texts of `sizes` bytes (ASCII letters and spaces: a token a byte, BOS and EOS added)."""
  import numpy as np

  rng = np.random.default_rng(1)
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
  with open(path, "w") as f:
    for n in sizes:
      text = letters[rng.integers(0, letters.size, max(1, n - 2))].tobytes().decode()
      f.write(json.dumps({"text": text}) + "\n")


def run(folder: str, data: str, out: str, args, *more: str) -> dict:
  """One finetune.py run in a process of its own: its step records and report."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "finetune.py"), folder, "--data", data]
  cmd += ["--length", str(args.length), "--devices", str(args.devices), "--steps", str(args.steps)]
  cmd += ["--batch", "1", "--lr", "1e-4", "--remat", args.remat, "--no-progress", "--out", out, *more]
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
  if done.returncode != 0:
    raise SystemExit(f"bench_finetune_documents.py: finetune.py failed: {done.stderr[-2000:]}")
  with open(os.path.join(out, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  with open(os.path.join(out, "report.json")) as f:
    report = json.load(f)
  steps = [r for r in records if "loss" in r]
  return dict(steps=steps, report=report, wall=time.perf_counter() - start)


def main(argv=None):
  import numpy as np

  args = parse_args(argv)
  sizes = lengths(args.mix, (args.steps + 1) * args.length, args.cap)
  with tempfile.TemporaryDirectory() as tmp:
    folder, data = os.path.join(tmp, "model"), os.path.join(tmp, "docs.jsonl")
    make_folder(folder, args.layers, args.dim)
    write_data(data, sizes)
    runs = {
      "bounded": run(folder, data, os.path.join(tmp, "bounded"), args),
      "per batch": run(folder, data, os.path.join(tmp, "auto"), args, "--bound-per-batch"),
      "every pass": run(folder, data, os.path.join(tmp, "every"), args, "--every-pass"),
    }
  step_s = {k: float(np.median([s["seconds"] for s in r["steps"][1:]])) for k, r in runs.items()}
  losses = {k: np.array([s["loss"] for s in r["steps"]]) for k, r in runs.items()}
  bound = runs["bounded"]["report"]["data"]["document_bound"]
  tokens = float(np.mean([s["tokens"] for s in runs["bounded"]["steps"]]))
  shard = args.length // args.devices
  lines = header("bench_finetune_documents.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += [
    f"A Llama of {args.layers} blocks of width {args.dim} (heads of 64, 4 a kv head, random weights, "
    f"remat {args.remat!r}), "
    f"rows of {args.length:,} tokens on {args.devices} devices ({shard:,} a device), batch 1, "
    f"{args.steps} steps a run; {len(sizes)} documents of the {args.mix!r} mix "
    f"(median {int(np.median(sizes)):,}, longest {max(sizes):,} tokens), "
    f"{tokens:,.0f} tokens a row not padding; the bound (the longest document packed): {bound}.",
    "",
    "| run | step s (median after the first) | tokens/s | first step s |",
    "|---|---|---|---|",
  ]
  for name, r in runs.items():
    first = r["steps"][0]["seconds"]
    lines.append(f"| {name} | {step_s[name]:.2f} | {tokens / step_s[name]:,.0f} | {first:.1f} |")
  diff = max(float(np.max(np.abs(losses["bounded"] - losses[k]))) for k in ("every pass", "per batch"))
  lines += [
    "",
    f"Every pass over bounded: {step_s['every pass'] / step_s['bounded']:.2f}x the step time; per batch "
    f"over bounded: {step_s['per batch'] / step_s['bounded']:.2f}x; the losses' largest difference between "
    f"the runs: {diff:.1e}.",
  ]
  publish(lines, args.out, "finetune documents", echo=True)
  every_bound = runs["every pass"]["report"]["data"]["document_bound"]
  return dict(step_s=step_s, bound=bound, every_bound=every_bound, loss_diff=diff)


if __name__ == "__main__":
  main()
