"""TRL's DPOTrainer beside `scripts/finetune.py --objective dpo`: the first step's
metrics of each on the same model folder and pairs, side by side. TRL and PyTorch are
not this project's dependencies: run it with a Python that has trl, torch (CPU is
enough) and transformers, and point --finetune-python at one with jax_ring (the
project's .venv).

Both take every pair in one step: TRL one batch of all of them; finetune.py rows of
--length, as many a step as the pairs fill. TRL runs in float32 (bf16 off: TRL 1.x
turns it on by default, and its autocast moves the log-probabilities by 2e-4 of their
size on a tiny Llama).

    python scripts/bench/trl_dpo.py FOLDER PAIRS.jsonl [--loss-type sigmoid|ipo|hinge]
        [--beta B] [--length T] [--devices D] [--finetune-python .venv/bin/python] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

NAMES = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
         "rewards/margins", "rewards/accuracies")  # fmt: skip


def trl_first_step(folder, records, loss_type, beta) -> dict:
  import torch
  import trl
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tok = AutoTokenizer.from_pretrained(folder)
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  with tempfile.TemporaryDirectory() as out:
    args = trl.DPOConfig(
      output_dir=out, per_device_train_batch_size=len(records), max_steps=1, logging_steps=1, report_to=[],
      beta=beta, loss_type=[loss_type], max_length=None, use_cpu=True, save_strategy="no", seed=0,
      bf16=False, fp16=False,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
      model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok
    )
    trainer.train()
  (first,) = [h for h in trainer.state.log_history if "loss" in h][:1]
  return dict(first, version=trl.__version__)


def ours_first_step(args, records) -> dict:
  """finetune.py's first step with a batch of every row (their count read from a first
  run's report), so that it takes each pair once, as TRL's one batch does."""
  rows = None
  with tempfile.TemporaryDirectory() as out:
    for _ in range(2):
      _run_finetune(args, out, rows or 1)
      with open(os.path.join(out, "report.json")) as f:
        counted = json.load(f)["data"]["rows"]
      with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
      if rows == counted:
        return first
      rows = counted
      for name in ("state", "tb"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
      for name in ("metrics.jsonl", "base.json", "data_state.json"):
        if os.path.exists(os.path.join(out, name)):
          os.remove(os.path.join(out, name))
  raise RuntimeError("finetune.py's row count changed between two runs of the same data")


def _run_finetune(args, out, batch):
  command = [
    args.finetune_python, os.path.join(os.path.dirname(__file__), "..", "finetune.py"), args.folder,
    "--data", args.pairs, "--objective", "dpo", "--loss-type", args.loss_type, "--beta", str(args.beta),
    "--length", str(args.length), "--devices", str(args.devices), "--steps", "1", "--no-progress",
    "--batch", str(batch), "--out", out, "--cache-dir", os.path.join(out, "cache"),
  ]  # fmt: skip
  subprocess.run(command, check=True, timeout=1800, stdout=subprocess.DEVNULL)


def parse_args(argv=None):
  # Plain argparse: this runs with TRL's Python, which need not have jax_ring.
  formatter = type(
    "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}
  )
  p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
  p.add_argument("folder", help="a model folder both read (models.save's layout)")
  p.add_argument("pairs", help="a JSONL file of preference pairs")
  p.add_argument("--loss-type", default="sigmoid", choices=("sigmoid", "ipo", "hinge"), help="DPO's loss")
  p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
  p.add_argument("--length", type=int, default=512, help="finetune.py's row length")
  p.add_argument("--devices", type=int, default=2, help="finetune.py's devices")
  p.add_argument("--finetune-python", default=".venv/bin/python", help="a Python with jax_ring")
  p.add_argument("--json", default=None, help="write both steps' metrics here")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  with open(args.pairs) as f:
    records = [json.loads(line) for line in f if line.strip()]
  theirs = trl_first_step(args.folder, records, args.loss_type, args.beta)
  ours = ours_first_step(args, records)
  head = f"TRL {theirs['version']} ({len(records)} pairs) against finetune.py --objective dpo"
  print(f"{head} ({ours['pairs']} pairs):")
  for name in NAMES:
    print(f"  {name:20s} {theirs[name]:14.6f} {ours[name]:14.6f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(trl=theirs, ours=ours), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
