"""The demo: ring attention lets a model use context that lives on another device.

Trains the same small decoder LM twice on long-context key-value retrieval
(models.train.tasks.KeyValueTask), with the sequence split over the devices of a mesh: once
with exact ring attention, once with shard-local attention. The (key, value) pairs sit
in the first shard and the question in the last, so only the ring model can answer.
Prints a summary table and writes results/demo/report.json and results/demo/report.png.

On a CPU-only machine it simulates 8 devices; with GPUs or TPUs it uses them.

    python scripts/demo.py [--steps 600] [--seq-len 256] [--time-budget 270]
"""

from __future__ import annotations

import json
import os
import time

from jax_ring.models import cli, runtime


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--steps", type=int, default=600, help="most training steps per model")
  p.add_argument("--seq-len", type=int, default=256, help="tokens per example")
  p.add_argument("--batch", type=int, default=16, help="examples per training step")
  p.add_argument("--time-budget", type=float, default=270.0, help="seconds of training per model")
  p.add_argument("--target-accuracy", type=float, default=0.95, help="ring training stops here")
  p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial parameters")
  p.add_argument("--out", default="results/demo", help="folder for the report")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  runtime.add_flags(p)
  return p.parse_args(argv)


def run(args, log=print):
  """Trains both models; returns the report dict."""
  import jax

  from jax_ring.models.train.scratch import TrainConfig, train
  from jax_ring.models.train.tasks import KeyValueTask

  task = KeyValueTask(seq_len=args.seq_len)
  report = {"task": vars(task) | {"vocab_size": task.vocab_size, "chance": task.chance}, "runs": {}}
  devices = jax.devices()
  log(f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}); sequence of {args.seq_len} tokens")
  ring_steps = None
  for attention in ("ring", "local"):
    config = TrainConfig(
      attention=attention,
      steps=ring_steps or args.steps,
      batch=args.batch,
      seed=args.seed,
      out=os.path.join(args.out, attention),
      time_budget=args.time_budget,
      eval_every=25,
      target_accuracy=args.target_accuracy if attention == "ring" else None,
      progress=not args.no_progress,
    )
    start = time.perf_counter()
    history, model = train(config, task, log=log, return_model=True)
    seconds = time.perf_counter() - start
    final = history["eval"][-1]
    report["runs"][attention] = {
      "steps": history["step"][-1],
      "seconds": seconds,
      "final_train_loss": history["loss"][-1],
      "eval_loss": final["loss"],
      "eval_accuracy": final["accuracy"],
      "devices": history["devices"],
      "history": history,
    }
    if attention == "ring":  # the trained model in use: it answers fresh questions
      report["runs"][attention]["answers"] = answer_questions(model, task, args.seed, count=8)
    # The shard-local model gets as many steps as the ring model needed.
    ring_steps = ring_steps or history["step"][-1]
  return report


def answer_questions(model, task, seed: int, count: int):
  """`count` fresh examples (seeds training never saw): the question is each prompt's
  last token; `models.generate` writes one token after it (greedy, with the KV cache)."""
  import numpy as np

  from jax_ring.models.generate import generate
  from jax_ring.models.train.tasks import row_rng

  rows = [task.row(row_rng(seed + 50_000, 0, r)) for r in range(count)]
  prompts = np.stack([tokens for tokens, _ in rows])
  out = generate(model, prompts, max_new_tokens=1)
  answers = np.asarray(out.tokens)[:, 0]
  return [
    {
      "question_key": int(tokens[-1] - task.query_base),
      "truth": int(answer - task.answer_base),
      "answer": int(a - task.answer_base),
    }
    for (tokens, answer), a in zip(rows, answers)
  ]


def main(argv=None):
  args = parse_args(argv)
  runtime.setup(args)
  from jax_ring.models.train.scratch import plot_history

  report = run(args, log=print if runtime.is_main_process() else lambda *_: None)
  if not runtime.is_main_process():
    return
  runs = report["runs"]
  chance = report["task"]["chance"]
  print()
  print("| attention | devices | steps | train s | eval loss | eval accuracy | chance |")
  print("|---|---|---|---|---|---|---|")
  for name, r in runs.items():
    print(
      f"| {name} | {r['devices']} | {r['steps']} | {r['seconds']:.0f} | {r['eval_loss']:.3f} | "
      f"{r['eval_accuracy']:.3f} | {chance:.3f} |"
    )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  plot_history([r["history"] for r in runs.values()], os.path.join(args.out, "report.png"))
  answers = runs["ring"].get("answers", [])
  right = sum(a["answer"] == a["truth"] for a in answers)
  print(f"\nThe ring model answers {len(answers)} fresh questions by generation (models.generate):")
  for a in answers:
    print(f"  key {a['question_key']} -> value {a['answer']} (truth {a['truth']})")
  print(f"  {right} of {len(answers)} right")
  gap = runs["ring"]["eval_accuracy"] - runs["local"]["eval_accuracy"]
  print(f"\nring - local accuracy: {gap:+.3f}. Report: {args.out}/report.json, {args.out}/report.png")


if __name__ == "__main__":
  main()
