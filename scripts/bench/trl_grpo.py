"""TRL's GRPO loss beside `scripts/finetune.py --objective grpo`'s first step, on the same
rollouts: finetune.py samples the completions and scores them (its rollouts.jsonl), and
TRL's `GRPOTrainer._compute_loss` takes those prompts, completions and advantages on
the same model folder; the loss and the gradient norm of each are printed side by side.
The sampling itself is not compared (the two draw from different generators); what is
compared is everything after it: the per-token log-probabilities, the clipped ratio,
the loss type's normalization and the gradient. TRL and PyTorch are not this project's
dependencies: run it with a Python that has trl, torch (CPU is enough) and
transformers, and point --finetune-python at one with jax_ring (the project's .venv).

Plain-text prompts only (TRL tokenizes them with the folder's tokenizer, special tokens
added, as finetune.py does); the reward is the completion's length in characters, so
that the advantages within a group differ. TRL runs in float32.

    python scripts/bench/trl_grpo.py FOLDER PROMPTS.jsonl [--loss-type grpo|bnpo|dr_grpo|dapo]
        [--num-generations G] [--max-completion-length N] [--devices D]
        [--finetune-python .venv/bin/python] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

REWARD = "def length(prompts, completions, **kw):\n  return [float(len(c)) for c in completions]\n"


def ours_first_step(args, out) -> tuple[dict, list[dict]]:
  """finetune.py's first step (every prompt in it): its metrics and its rollouts."""
  with open(args.prompts) as f:
    count = sum(1 for line in f if line.strip())
  reward = os.path.join(out, "reward_length.py")
  with open(reward, "w") as f:
    f.write(REWARD)
  command = [
    args.finetune_python, os.path.join(os.path.dirname(__file__), "..", "finetune.py"), args.folder,
    "--data", args.prompts, "--objective", "grpo", "--reward", f"{reward}:length",
    "--num-generations", str(args.num_generations),
    "--max-completion-length", str(args.max_completion_length), "--loss-type", args.loss_type, "--beta", "0",
    "--batch", str(count), "--steps", "1", "--lr", "1e-6", "--length", str(args.length),
    "--devices", str(args.devices), "--no-progress", "--out", os.path.join(out, "run"),
  ]  # fmt: skip
  env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", ".."))
  subprocess.run(command, check=True, env=env, timeout=1800)
  with open(os.path.join(out, "run", "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  with open(os.path.join(out, "run", "rollouts.jsonl")) as f:
    rollouts = [json.loads(line) for line in f if line.strip()]
  return first, rollouts


def trl_loss(args, rollouts, out) -> dict:
  """TRL's `_compute_loss` on `rollouts` (its train mode), and the gradient's norm."""
  import torch
  import trl
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tok = AutoTokenizer.from_pretrained(args.folder)
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
  config = trl.GRPOConfig(
    output_dir=os.path.join(out, "trl"), num_generations=args.num_generations,
    max_completion_length=args.max_completion_length, loss_type=args.loss_type, beta=0.0,
    per_device_train_batch_size=len(rollouts), use_cpu=True, report_to=[], bf16=False, fp16=False, seed=0,
  )  # fmt: skip
  prompts = sorted({r["prompt"] for r in rollouts})
  zero = lambda prompts, completions, **kw: [0.0] * len(completions)
  dataset = Dataset.from_list([{"prompt": p} for p in prompts])
  trainer = trl.GRPOTrainer(
    model=model, reward_funcs=[zero], args=config, train_dataset=dataset, processing_class=tok
  )
  prompt_ids = tok(text=[r["prompt"] for r in rollouts])["input_ids"]
  width_p = max(map(len, prompt_ids))
  width_c = max(len(r["completion_ids"]) for r in rollouts)
  pad = tok.pad_token_id
  left = lambda ids: [pad] * (width_p - len(ids)) + ids
  right = lambda ids: ids + [pad] * (width_c - len(ids))
  inputs = dict(
    prompt_ids=torch.tensor([left(ids) for ids in prompt_ids]),
    prompt_mask=torch.tensor([[0] * (width_p - len(ids)) + [1] * len(ids) for ids in prompt_ids]),
    completion_ids=torch.tensor([right(r["completion_ids"]) for r in rollouts]),
    completion_mask=torch.tensor(
      [[1] * len(r["completion_ids"]) + [0] * (width_c - len(r["completion_ids"])) for r in rollouts]
    ),
    advantages=torch.tensor([r["advantage"] for r in rollouts], dtype=torch.float32),
    num_items_in_batch=torch.tensor(float(sum(len(r["completion_ids"]) for r in rollouts))),
  )
  trainer.current_gradient_accumulation_steps = 1
  model.train()
  model.zero_grad()
  loss = trainer._compute_loss(model, inputs)
  loss.backward()
  norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
  return dict(loss=loss.item(), grad_norm=norm.item(), version=trl.__version__, torch=torch.__version__)


def parse_args(argv=None):
  # Plain argparse: this runs with TRL's Python, which need not have jax_ring.
  formatter = type(
    "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}
  )
  p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
  p.add_argument("folder", help="a model folder both read (models.save's layout)")
  p.add_argument("prompts", help="a JSONL file of {'prompt': text}")
  p.add_argument(
    "--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo"), help="GRPO's loss"
  )
  p.add_argument("--num-generations", type=int, default=4, help="completions of each prompt")
  p.add_argument("--max-completion-length", type=int, default=16, help="tokens of a completion at most")
  p.add_argument("--length", type=int, default=128, help="finetune.py's row length")
  p.add_argument("--devices", type=int, default=2, help="finetune.py's devices")
  p.add_argument("--finetune-python", default=".venv/bin/python", help="a Python with jax_ring")
  p.add_argument("--json", default=None, help="write both sides here")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  with tempfile.TemporaryDirectory() as out:
    ours, rollouts = ours_first_step(args, out)
    theirs = trl_loss(args, rollouts, out)
  versions = f"TRL {theirs['version']}, torch {theirs['torch']}"
  print(f"{len(rollouts)} completions, loss type {args.loss_type}, {versions}")
  print("| | finetune.py | TRL |")
  print("|---|---|---|")
  for name in ("loss", "grad_norm"):
    print(f"| {name} | {ours[name]:.7g} | {theirs[name]:.7g} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(ours=ours, trl=theirs, completions=len(rollouts)), f, indent=1)


if __name__ == "__main__":
  main()
