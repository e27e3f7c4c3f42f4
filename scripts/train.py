"""Train a small decoder LM on a long-context key-value retrieval task on a
("data", "seq") mesh: AdamW with warmup + cosine decay and gradient clipping (optax),
periodic evaluation, orbax checkpoints with resume from the latest, a loss curve PNG.

The task: a sequence of filler tokens holds a few (key, value) pair tokens in its
first shard; its last token asks for one key, and the model must answer that key's
value at the last position. With the sequence split over the "seq" axis, the answer
lives on another device than the question: exact (ring) attention can reach it,
shard-local attention cannot.

    python scripts/train.py --attention ring --steps 300 --seq-len 256
    python scripts/train.py --attention local --steps 300      # the shard-local baseline
    python scripts/train.py --resume --ckpt-dir checkpoints/ring --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _bench_utils import simulate_devices  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Task:
  """Key-value retrieval. Vocabulary: fillers, pair tokens (key, value), query tokens
  (key), answer tokens (value)."""

  seq_len: int = 256
  num_pairs: int = 3
  num_keys: int = 4
  num_values: int = 8
  num_fillers: int = 32
  pair_region: int = 32  # pairs sit in the first `pair_region` tokens

  @property
  def pair_base(self):
    return self.num_fillers

  @property
  def query_base(self):
    return self.pair_base + self.num_keys * self.num_values

  @property
  def answer_base(self):
    return self.query_base + self.num_keys

  @property
  def vocab_size(self):
    return self.answer_base + self.num_values

  @property
  def chance(self):
    return 1.0 / self.num_values

  def batch(self, seed: int, step: int, batch_size: int):
    """(tokens int32 [B, T], answer token int32 [B]), a pure function of (seed, step)."""
    import numpy as np

    rng = np.random.default_rng([seed, step])
    t, b = self.seq_len, batch_size
    tokens = rng.integers(0, self.num_fillers, size=(b, t))
    answers = np.zeros(b, np.int64)
    region = min(self.pair_region, t - 1)
    for i in range(b):
      keys = rng.choice(self.num_keys, self.num_pairs, replace=False)
      values = rng.integers(0, self.num_values, self.num_pairs)
      where = rng.choice(region, self.num_pairs, replace=False)
      tokens[i, where] = self.pair_base + keys * self.num_values + values
      pick = rng.integers(self.num_pairs)
      tokens[i, t - 1] = self.query_base + keys[pick]
      answers[i] = self.answer_base + values[pick]
    return tokens.astype(np.int32), answers.astype(np.int32)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--attention", default="ring", choices=["ring", "local", "dense", "dilated"])
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator")
  p.add_argument("--data", type=int, default=1, help="size of the mesh's data axis")
  p.add_argument("--seq", type=int, default=None, help="size of the seq axis (default: devices / data)")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=30)
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--clip", type=float, default=1.0)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--eval-batches", type=int, default=8, help="0: no evaluation")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ckpt-dir", default=None, help="orbax checkpoints here (default: none)")
  p.add_argument("--ckpt-every", type=int, default=100)
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  p.add_argument("--stop-after", type=int, default=None, help="stop at this step (an interruption)")
  p.add_argument("--target-accuracy", type=float, default=None, help="stop once eval reaches it")
  p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
  p.add_argument("--out", default="results/train", help="folder for history.json and loss.png")
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def setup_devices(count: int):
  """Real accelerators when present; otherwise `count` simulated CPU devices."""
  simulate_devices(count)
  import jax

  return jax.devices()


def make_mesh(data: int, seq: int):
  import jax
  from jax.sharding import AxisType

  devices = jax.devices()[: data * seq]
  return jax.make_mesh((data, seq), ("data", "seq"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def build(args, task: Task, mesh):
  """(model, optimizer) for the arguments."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from models import DecoderLM, LMConfig

  kind = args.attention
  config = LMConfig(
    vocab_size=task.vocab_size,
    dim=args.dim,
    num_layers=args.layers,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    mlp_hidden=2 * args.dim,
    attention=kind,
    segment_lengths=(task.seq_len,),
    dilation_rates=(1,),
    max_seq_len=task.seq_len,
    policy="float32",
  )
  model = DecoderLM(
    config,
    mesh=None if kind == "dense" else mesh,
    batch_axis="data" if kind != "dense" and args.data > 1 else None,
    rngs=nnx.Rngs(args.seed),
  )
  tx = make_tx(args.lr, args.warmup, args.steps, args.weight_decay, args.clip)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  # Replicated on the mesh from the start, as the train step returns them: the second
  # step then reuses the first step's executable.
  replicated = NamedSharding(mesh, P())
  for obj in (model, optimizer):
    nnx.update(obj, jax.device_put(nnx.state(obj), replicated))
  return model, optimizer


@functools.cache
def make_tx(lr: float, warmup: int, steps: int, weight_decay: float, clip: float):
  """AdamW with warmup + cosine decay and clipping; cached, so that runs with the same
  settings share one optimizer graph and hence the compiled train step."""
  import optax

  schedule = optax.warmup_cosine_decay_schedule(
    0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1), end_value=lr * 0.05
  )
  return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))


@functools.cache
def make_steps():
  """The jitted train and eval steps, shared by every run in a process (a second run
  with the same model structure and mesh reuses the compiled step)."""
  import jax.numpy as jnp
  import optax
  from flax import nnx

  def loss_and_accuracy(model, tokens, answers):
    logits = model(tokens)[:, -1]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == answers)

  @nnx.jit
  def train_step(model, optimizer, tokens, answers):
    (loss, acc), grads = nnx.value_and_grad(loss_and_accuracy, has_aux=True)(model, tokens, answers)
    optimizer.update(model, grads)
    return loss, acc

  @nnx.jit
  def eval_step(model, tokens, answers):
    return loss_and_accuracy(model, tokens, answers)

  return train_step, eval_step


def evaluate(eval_step, model, task: Task, args, shard):
  import numpy as np

  losses, accs = [], []
  for i in range(args.eval_batches):
    tokens, answers = task.batch(args.seed + 10_000, i, args.batch)
    loss, acc = eval_step(model, *shard(tokens, answers))
    losses.append(float(loss))
    accs.append(float(acc))
  return float(np.mean(losses)), float(np.mean(accs))


class Checkpoints:
  """Model and optimizer state with orbax; data order is a function of the step, so a
  resumed run sees exactly the batches an uninterrupted one would."""

  def __init__(self, directory, every: int):
    import orbax.checkpoint as ocp

    self.ocp = ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def latest(self):
    return self.manager.latest_step()

  @staticmethod
  def _states(model, optimizer):
    from flax import nnx

    return {"model": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}

  def save(self, step: int, model, optimizer, force=False):
    from flax import nnx

    if step in self.manager.all_steps():
      return
    pure = {name: nnx.to_pure_dict(s) for name, s in self._states(model, optimizer).items()}
    self.manager.save(step, args=self.ocp.args.StandardSave(pure), force=force)

  def restore(self, step: int, model, optimizer):
    import jax
    import numpy as np
    from flax import nnx

    states = self._states(model, optimizer)
    target = {name: nnx.to_pure_dict(s) for name, s in states.items()}
    restored = self.manager.restore(step, args=self.ocp.args.StandardRestore(target))
    # Host arrays: jit places them on the mesh like freshly initialized parameters.
    restored = jax.tree.map(np.asarray, restored)
    for name, state in states.items():
      nnx.replace_by_pure_dict(state, restored[name])
    nnx.update(model, states["model"])
    nnx.update(optimizer, states["optimizer"])

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def train(args, task: Task | None = None, log=print):
  """Runs training; returns the history dict (also written to args.out)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from tqdm import tqdm

  task = task or Task(seq_len=args.seq_len, num_pairs=args.pairs)
  if args.attention == "dense":
    data, seq = 1, 1
  else:
    data, seq = args.data, args.seq or jax.device_count() // args.data
  if data * seq > jax.device_count():
    raise ValueError(f"--data={data} x --seq={seq} devices, but only {jax.device_count()} are visible")
  mesh = make_mesh(data, seq)
  model, optimizer = build(args, task, mesh)
  train_step, eval_step = make_steps()

  def shard(tokens, answers):
    if args.attention == "dense":
      return jax.numpy.asarray(tokens), jax.numpy.asarray(answers)
    data = "data" if args.data > 1 else None
    return (
      jax.device_put(tokens, NamedSharding(mesh, P(data, "seq"))),
      jax.device_put(answers, NamedSharding(mesh, P(data))),
    )

  ckpt = Checkpoints(args.ckpt_dir, args.ckpt_every) if args.ckpt_dir else None
  start = 0
  if args.resume:
    if ckpt is None:
      raise ValueError("--resume needs --ckpt-dir")
    latest = ckpt.latest()
    if latest is not None:
      ckpt.restore(latest, model, optimizer)
      start = latest
      log(f"resumed from step {latest} in {args.ckpt_dir}")
  history = {"step": [], "loss": [], "accuracy": [], "eval": [], "seconds": [], "attention": args.attention}
  bar = tqdm(range(start, args.steps), disable=args.no_progress, desc=args.attention, leave=False)
  t0 = time.perf_counter()
  for step in bar:
    tokens, answers = task.batch(args.seed, step, args.batch)
    loss, acc = train_step(model, optimizer, *shard(tokens, answers))
    loss = float(loss)
    history["step"].append(step + 1)
    history["loss"].append(loss)
    history["accuracy"].append(float(acc))
    history["seconds"].append(time.perf_counter() - t0)
    bar.set_postfix(loss=f"{loss:.3f}")
    if ckpt is not None:
      ckpt.save(step + 1, model, optimizer)
    done = step + 1 == args.steps
    if args.eval_batches and ((step + 1) % args.eval_every == 0 or done):
      ev_loss, ev_acc = evaluate(eval_step, model, task, args, shard)
      history["eval"].append({"step": step + 1, "loss": ev_loss, "accuracy": ev_acc})
      if args.no_progress:
        log(f"step {step + 1}: loss {loss:.4f}, eval loss {ev_loss:.4f}, eval accuracy {ev_acc:.3f}")
      if args.target_accuracy is not None and ev_acc >= args.target_accuracy:
        break
    if args.time_budget is not None and time.perf_counter() - t0 > args.time_budget:
      break
    if args.stop_after is not None and step + 1 >= args.stop_after:
      break
  if ckpt is not None:
    ckpt.save(history["step"][-1] if history["step"] else start, model, optimizer, force=True)
    ckpt.close()
  final_eval = not history["eval"] or history["eval"][-1]["step"] != history["step"][-1]
  if args.eval_batches and history["step"] and final_eval:
    ev_loss, ev_acc = evaluate(eval_step, model, task, args, shard)
    history["eval"].append({"step": history["step"][-1], "loss": ev_loss, "accuracy": ev_acc})
  history["chance"] = task.chance
  history["devices"] = int(np.prod(list(mesh.shape.values())))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "history.json"), "w") as f:
      json.dump(history, f, indent=1)
    plot([history], os.path.join(args.out, "loss.png"))
  return history


def plot(histories, path: str) -> None:
  """Training loss and eval accuracy of each history, side by side."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
  for h in histories:
    ax_loss.plot(h["step"], h["loss"], label=h["attention"])
    ax_acc.plot(
      [e["step"] for e in h["eval"]], [e["accuracy"] for e in h["eval"]], marker="o", label=h["attention"]
    )
  if histories and "chance" in histories[0]:
    ax_acc.axhline(histories[0]["chance"], color="gray", linestyle=":", label="chance")
  ax_loss.set(xlabel="step", ylabel="training loss", yscale="log")
  ax_acc.set(xlabel="step", ylabel="eval accuracy", ylim=(0, 1.02))
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  setup_devices(args.devices)
  history = train(args)
  last = history["eval"][-1] if history["eval"] else {}
  print(json.dumps({"attention": args.attention, "steps": history["step"][-1:], **last}))


if __name__ == "__main__":
  main()
