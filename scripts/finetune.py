"""Fine-tunes a pretrained model (a GGUF file or a Hugging Face folder: Llama 3, Qwen 3,
Gemma 3) over the ring: every layer's attention over the devices, AdamW with warmup,
cosine decay and clipping, the loss chunked so the [T, vocab] logits never exist, the
weights and optimizer state split over the devices with --fsdp (models.train.finetune).

Data: the main job's long documents (filler with five facts, then a question; the loss
on the answer's tokens), or windows of a text file (--text; the loss on every token).

    python scripts/finetune.py PATH [--length T] [--steps N] [--devices D] [--fsdp | --no-fsdp]
        [--lr LR] [--out DIR] [--text FILE] [--remat attention]

Writes DIR/report.json ("steps": loss and seconds of each step; "memory": per device
param_bytes, optimizer_bytes and the step's compiled temp_bytes), DIR/state/ (orbax:
weights, optimizer state and step; run again with more --steps to go on from there)
and DIR/checkpoint/ (models.save's layout: models.load and transformers read it).
"""

from __future__ import annotations

import argparse
import resource

from jax_ring.models import cli, runtime


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("path", help="a GGUF file or a Hugging Face folder")
  p.add_argument("--length", type=int, default=1024, help="tokens per sequence")
  p.add_argument(
    "--steps", type=int, default=4, help="optimizer steps in all (a resumed run goes on to this)"
  )
  p.add_argument("--batch", type=int, default=1, help="sequences per step")
  p.add_argument("--devices", type=int, default=8, help="devices of the ring (simulated on a CPU)")
  p.add_argument(
    "--fsdp", action=argparse.BooleanOptionalAction, default=True, help="split weights and AdamW"
  )
  p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
  p.add_argument("--warmup", type=int, default=1, help="warmup steps")
  p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
  p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
  p.add_argument("--chunk", type=int, default=512, help="tokens per chunk of the loss")
  p.add_argument(
    "--remat",
    default="attention",
    choices=("none", "full", "attention", "offload"),
    help="what a layer keeps (offload: its input, in host memory)",
  )
  p.add_argument("--dtype", default=None, help="compute and weight dtype (default float32)")
  p.add_argument(
    "--capacity-factor",
    type=float,
    default=None,
    help="a mixture of experts: each expert takes at most this x its even share of a device's tokens "
    "(dropped pairs are counted in report.json); default: none dropped",
  )
  p.add_argument("--text", default=None, help="train on windows of this text file instead of the documents")
  p.add_argument(
    "--save-every", type=int, default=0, help="orbax state every this many steps (0: at the end)"
  )
  p.add_argument("--seed", type=int, default=0, help="seed of the data")
  p.add_argument("--out", default="results/finetune", help="folder for report.json, state/ and checkpoint/")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  for name in ("steps", "devices", "length", "batch"):
    if getattr(args, name) < 1:
      raise SystemExit(f"finetune.py: --{name} {getattr(args, name)}: must be at least 1")
  runtime.simulate_devices(args.devices)
  import jax
  from flax import nnx

  from jax_ring import models
  from jax_ring.models.train import finetune
  from jax_ring.models.train import step as train_step

  mesh = jax.make_mesh((args.devices,), ("seq",), devices=jax.devices()[: args.devices])
  model, tokenizer = models.load(args.path, mesh=mesh, fsdp=args.fsdp, remat=args.remat, dtype=args.dtype)
  if tokenizer is None:
    raise SystemExit(
      f"{args.path}: no tokenizer.json beside the weights; the data needs the model's tokenizer"
    )
  if args.capacity_factor is not None:
    from jax_ring.models.architectures import moe

    try:
      moe.set_capacity(model, args.capacity_factor)
    except ValueError as e:
      raise SystemExit(f"finetune.py: --capacity-factor: {e}") from None
  text = None
  if args.text is not None:
    with open(args.text, encoding="utf-8") as f:
      text = f.read()
  config = finetune.FinetuneConfig(
    length=args.length,
    steps=args.steps,
    batch=args.batch,
    lr=args.lr,
    warmup=args.warmup,
    weight_decay=args.weight_decay,
    clip=args.clip,
    chunk=args.chunk,
    seed=args.seed,
    save_every=args.save_every,
  )
  if args.fsdp and args.devices > 1:
    whole = train_step.unsplit_bytes(model)
    if whole:
      total = train_step.per_device_bytes(nnx.state(model, nnx.Param)) * args.devices
      print(
        f"finetune.py: warning: --devices {args.devices} divides no dimension of some weights, which FSDP "
        f"keeps whole on every device: {whole / 2**20:.0f} MiB a device of {total / 2**20:.0f} MiB "
        "(their AdamW moments too); a device count that divides the model's widths (2, 4, 8) splits them all"
      )
  try:
    report = finetune.finetune(model, tokenizer, config, args.out, text=text, base=args.path)
  except ValueError as e:
    raise SystemExit(f"finetune.py: {e}") from None
  memory = report["memory"]
  steps = report["steps"]
  print(
    f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} over {len(steps)} steps; "
    f"per device: weights {memory['param_bytes'] / 2**20:.1f} MiB, "
    f"optimizer {memory['optimizer_bytes'] / 2**20:.1f} MiB, "
    f"step temporaries {memory['temp_bytes'] / 2**20:.1f} MiB; "
    + (
      f"dropped (token, expert) pairs {steps[-1]['dropped_tokens']} in the last step; "
      if "dropped_tokens" in steps[-1]
      else ""
    )
    + f"peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
  )
  print(f"wrote {args.out}/report.json, {args.out}/state/ and {args.out}/checkpoint/")
  return report


if __name__ == "__main__":
  main()
