"""Train a small decoder LM on long-context retrieval on a ("data", "seq") mesh
(models.train.scratch): AdamW with warmup + cosine decay and clipping, periodic
evaluation, orbax checkpoints with resume, history.json and a loss-curve PNG.

Two tasks (models.train.tasks): `--task kv`, synthetic key-value pairs in the first shard and
the question at the end; `--task needle`, a needle sentence planted at a random depth
of real text (Shakespeare, bytes) and a question at the end. Exact (ring) attention
reaches the first shard, shard-local attention cannot.

    python scripts/train.py --attention ring --steps 300 --seq-len 256
    python scripts/train.py --attention local --steps 300      # the shard-local baseline
    python scripts/train.py --resume --ckpt-dir checkpoints/ring --steps 600
    python scripts/train.py --task needle --seq-len 512 --save-params needle.npz

Several processes (each with --devices devices): on one box through the launcher,

    python scripts/launch.py --processes 2 --devices-per-process 4 -- scripts/train.py --data 2

on a cluster with one command per node (or none of these flags under Slurm, Open MPI
or Cloud TPU, which `jax.distributed.initialize()` detects by itself):

    python scripts/train.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
"""

from __future__ import annotations

import json

from jax_ring.models import cli, runtime
from jax_ring.models.cli import add_config_flags, config_from_flags
from jax_ring.models.train.scratch import TrainConfig, train
from jax_ring.models.train.tasks import KeyValueTask, NeedleTask


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--seq-len", type=int, default=256, help="tokens per example")
  p.add_argument("--task", choices=("kv", "needle"), default="kv", help="the training task")
  p.add_argument("--pairs", type=int, default=3, help="kv: (key, value) pairs per example")
  p.add_argument("--needles", type=int, default=1, help="needle: needles per example")
  p.add_argument("--digits", type=int, default=4, help="needle: digits of each needle's value")
  add_config_flags(p, TrainConfig)
  runtime.add_flags(p)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  runtime.setup(args)
  if args.task == "kv":
    task = KeyValueTask(seq_len=args.seq_len, num_pairs=args.pairs)
  else:
    task = NeedleTask(seq_len=args.seq_len, needles=args.needles, digits=args.digits)
  history = train(config_from_flags(TrainConfig, args), task)
  last = history["eval"][-1] if history["eval"] else {}
  if runtime.is_main_process():
    print(json.dumps({"attention": args.attention, "steps": history["step"][-1:], **last}))


if __name__ == "__main__":
  main()
