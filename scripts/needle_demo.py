r"""The demo: needle in a haystack over real text, split across the devices of a mesh.

Each example is a window of Shakespeare (data/shakespeare, byte tokens) with a needle
sentence, "The code of <name> is <digits>.", planted at a random depth, and a question
at the end, "The code of <name> is ", that the model answers with the digits
(models.train.tasks.NeedleTask). The sequence is split over the devices (8 simulated on a
CPU), so the needle's depth decides which device holds it.

The same `models.DecoderLM` is trained three ways from the same start: exact ring
attention; shard-local attention (each device attends within its own shard only);
and a sliding window of one shard's length. Then each is evaluated by needle depth
(8 bins, one per shard) and context length (T/4, T/2, T), and the ring model answers
fresh questions with `models.generate`. Prints a table and writes
results/demo/report.json and results/demo/report.png (heatmaps and loss curves).

Training starts from `--init` (default data/needle_init.npz): parameters from a short
training stage at 256 tokens on one device (800 steps, about 4 minutes here) that the
project's own command produced,

    python scripts/train.py --task needle --seq-len 256 --devices 1 --attention ring \
        --dim 128 --layers 2 --heads 4 --kv-heads 2 --conv 4 --rope-max-wavelength 256 \
        --batch 16 --lr 3e-3 --warmup 100 --steps 800 --eval-every 100 --eval-batches 2 \
        --no-progress --out results/needle_init --save-params data/needle_init.npz

This demo is the long-context stage
(progressive context extension, 8x the length) and the evaluation. Two choices of the
model make the extension work: a short causal convolution before each attention
(`LMConfig.conv`), with which the copying circuit forms in a few hundred steps, and
rotary embeddings without the frequencies slower than the short stage's length
(`LMConfig.rope_max_wavelength`), so longer distances bring no unseen rotations.
`--init none` starts from scratch.

    bash scripts/run_demo.sh [--seq-len 2048] [--steps 60] [--quick]
"""

from __future__ import annotations

import json
import os
import time

from jax_ring.models import cli, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INIT = os.path.join(ROOT, "data", "needle_init.npz")


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--seq-len", type=int, default=2048, help="training context length T")
  p.add_argument("--steps", type=int, default=60, help="training steps per model")
  p.add_argument("--batch", type=int, default=8, help="examples per training step")
  p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
  p.add_argument("--time-budget", type=float, default=None, help="seconds of training per model")
  p.add_argument("--init", default=INIT, help="start parameters (.npz); 'none' for a fresh model")
  p.add_argument("--bins", type=int, default=8, help="needle depth bins")
  p.add_argument("--eval-rows", type=int, default=16, help="examples per (length, depth) cell")
  p.add_argument("--answers", type=int, default=4, help="questions answered by generation")
  p.add_argument("--seed", type=int, default=0, help="seed of the data and the evaluation")
  p.add_argument("--out", default="results/demo", help="folder for report.json and report.png")
  p.add_argument(
    "--quick", action="store_true", help="tiny run for tests: T=512, 4 steps, 2 rows a cell, no held-out loss"
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  runtime.add_flags(p)
  args = p.parse_args(argv)
  if args.quick:
    args.seq_len, args.steps, args.eval_rows, args.answers = 512, 4, 2, 2
  if args.seq_len < 512:
    p.error(f"--seq-len={args.seq_len}: the shortest evaluated context, T/4, needs at least 128 bytes")
  return args


MODEL = dict(dim=128, layers=2, heads=4, kv_heads=2, conv=4, rope_max_wavelength=256.0)  # the shipped start


def kinds(seq_len: int, devices: int) -> dict[str, dict]:
  """The three ways to train: TrainConfig fields and a label."""
  shard = seq_len // devices
  return {
    "ring": dict(config=dict(attention="ring"), label="ring (exact)"),
    "local": dict(config=dict(attention="local"), label="shard-local"),
    "window": dict(config=dict(attention="ring", window=shard), label=f"sliding window {shard}"),
  }


def run(args, log=print):
  """Trains and evaluates the three models; returns the report dict."""
  import jax

  from jax_ring.models.eval.long_context import accuracy_grid, generated_answers
  from jax_ring.models.train.scratch import TrainConfig, _batch_spec, make_mesh, train
  from jax_ring.models.train.tasks import NeedleTask

  devices = jax.device_count()
  task = NeedleTask(seq_len=args.seq_len)
  lengths = [args.seq_len // 4, args.seq_len // 2, args.seq_len]
  init = None if args.init in (None, "", "none") else args.init
  if init is not None and not os.path.exists(init):
    raise ValueError(f"--init={init!r} does not exist; pass --init none to start from scratch")
  report = {
    "task": {"seq_len": task.seq_len, "needles": task.needles, "digits": task.digits, "chance": task.chance},
    "devices": devices,
    "lengths": lengths,
    "bins": args.bins,
    "init": init,
    "runs": {},
  }
  d = jax.devices()[0]
  log(
    f"{devices} x {d.device_kind} ({d.platform}); T={args.seq_len} bytes, {args.seq_len // devices} a device"
  )
  for name, kind in kinds(args.seq_len, devices).items():
    config = TrainConfig(
      steps=args.steps,
      batch=args.batch,
      lr=args.lr,
      warmup=max(1, min(20, args.steps // 5)),
      seed=args.seed,
      init=init,
      eval_every=max(args.steps, 1),
      eval_batches=0 if args.quick else 1,  # the grid below is the evaluation that counts
      time_budget=args.time_budget,
      out=None,
      progress=not args.no_progress,
      **MODEL,
      **kind["config"],
    )
    start = time.perf_counter()
    history, model = train(config, task, log=log, return_model=True)
    seconds = time.perf_counter() - start
    mesh = make_mesh(1, devices)
    grid = accuracy_grid(
      model, task, lengths, args.bins, args.eval_rows, args.seed, mesh, _batch_spec(config)
    )
    entry = {
      "label": kind["label"],
      "config": kind["config"],
      "steps": history["step"][-1],
      "train_seconds": round(seconds, 1),
      "final_loss": history["loss"][-1],
      "grid": grid.tolist(),
      "history": {k: history[k] for k in ("step", "loss", "accuracy", "seconds")},
    }
    if name != "local" and args.answers:  # shard-local attention has no decode mode
      entry["answers"] = generated_answers(model, task, args.answers, args.seed)
    report["runs"][name] = entry
    log(
      f"{name}: {entry['steps']} steps in {seconds:.0f} s; accuracy at T={args.seq_len} by depth bin: "
      + " ".join(f"{a:.2f}" for a in grid[-1])
    )
  return report


def main(argv=None):
  args = parse_args(argv)
  runtime.setup(args)
  from jax_ring.models.eval.long_context import plot_report

  report = run(args, log=print if runtime.is_main_process() else lambda *_: None)
  if not runtime.is_main_process():
    return
  bins = args.bins
  print()
  print(
    f"Exact-answer accuracy at T={args.seq_len} by needle depth bin (chance {report['task']['chance']:g}):"
  )
  print("| attention | steps | train s | " + " | ".join(f"bin {j}" for j in range(bins)) + " | mean |")
  print("|---|---|---|" + "---|" * (bins + 1))
  for r in report["runs"].values():
    row = r["grid"][-1]
    cells = " | ".join(f"{a:.2f}" for a in row)
    print(f"| {r['label']} | {r['steps']} | {r['train_seconds']:.0f} | {cells} | {sum(row) / bins:.2f} |")
  for name, r in report["runs"].items():
    for a in r.get("answers", []):
      mark = "right" if a["answer"] == a["truth"] else "wrong"
      print(
        f"{name}: depth {a['depth']:.2f}, {a['question']!r} -> {a['answer']!r} (truth {a['truth']!r}, {mark})"
      )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  plot_report(report, os.path.join(args.out, "report.png"))
  print(f"\nReport: {args.out}/report.json, {args.out}/report.png")


if __name__ == "__main__":
  main()
