"""Train a small decoder LM on long-context key-value retrieval on a ("data", "seq")
mesh (models.training): AdamW with warmup + cosine decay and clipping, periodic
evaluation, orbax checkpoints with resume, history.json and a loss-curve PNG.

The (key, value) pairs sit in the first shard of the sequence and the question at its
end: exact (ring) attention reaches them, shard-local attention cannot.

    python scripts/train.py --attention ring --steps 300 --seq-len 256
    python scripts/train.py --attention local --steps 300      # the shard-local baseline
    python scripts/train.py --resume --ckpt-dir checkpoints/ring --steps 600
"""

from __future__ import annotations

import argparse
import json

from models.cli import add_config_flags, config_from_flags
from models.runtime import simulate_devices
from models.tasks import KeyValueTask
from models.training import TrainConfig, train


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator")
  p.add_argument("--seq-len", type=int, default=256, help="tokens per example")
  p.add_argument("--pairs", type=int, default=3, help="(key, value) pairs per example")
  add_config_flags(p, TrainConfig)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  simulate_devices(args.devices)
  history = train(
    config_from_flags(TrainConfig, args), KeyValueTask(seq_len=args.seq_len, num_pairs=args.pairs)
  )
  last = history["eval"][-1] if history["eval"] else {}
  print(json.dumps({"attention": args.attention, "steps": history["step"][-1:], **last}))


if __name__ == "__main__":
  main()
