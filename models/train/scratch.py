"""Training a model from scratch (`DecoderLM`) on a task over a ("data", "seq") mesh:
AdamW with warmup + cosine decay and gradient clipping (optax), periodic evaluation,
orbax checkpoints with resume from the latest, a history of losses and its plot.

    from jax_ring.models.train.tasks import KeyValueTask
    from jax_ring.models.train.scratch import TrainConfig, train

    history = train(TrainConfig(attention="ring", steps=300), KeyValueTask(seq_len=256))

The loss is the cross-entropy of the scored positions of each batch (the task's
`weights`), made from the final hidden states a chunk of tokens at a time; accuracy is
the fraction of rows whose every answer token (weight 1) is the argmax; positions of
weight in (0, 1) add to the loss only. The step is `train.step.Trainer`'s, the one that
fine-tunes loaded models: with `fsdp=True` the weights and their AdamW moments are split
over all the mesh's devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ..architectures.decoder import fsdp_spec
from ..architectures.scratch import DecoderLM, LMConfig
from . import step as train_step
from .state import Checkpoints

ATTENTIONS = ("ring", "local", "dense", "dilated")


def _field(default, help: str, **kw):
  return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything about one training run but the task."""

  attention: str = _field("ring", "attention of the model", choices=ATTENTIONS)
  data: int = _field(1, "size of the mesh's data axis")
  seq: int | None = _field(None, "size of the seq axis (default: devices / (data x ulysses))")
  ulysses: int = _field(
    1, "size of a Ulysses axis 'u' (ring/local attention: all-to-all inside groups of this many, ring across)"
  )
  steps: int = _field(300, "length of the learning-rate schedule, in steps")
  batch: int = _field(16, "global batch size")
  dim: int = _field(64, "model width")
  layers: int = _field(2, "transformer blocks")
  heads: int = _field(4, "query heads")
  kv_heads: int = _field(2, "key/value heads")
  window: int | None = _field(None, "sliding attention window in tokens (ring/dense; default: none)")
  global_every: int = _field(
    0, "with --window: every this many-th layer attends globally (Gemma 2: 2; 0: none)"
  )
  logit_soft_cap: float | None = _field(None, "soft-cap the attention logits at this value (Gemma 2: 50)")
  attention_sinks: bool = _field(False, "a learned attention sink per head (gpt-oss)")
  alibi: bool = _field(False, "ALiBi position biases (with the rotary embeddings)")
  remat: bool = _field(False, "recompute activations in the backward pass (nnx.remat)")
  fsdp: bool = _field(
    False, "split every weight and its AdamW moments over all the mesh's devices (not with dense attention)"
  )
  chunk: int = _field(512, "tokens per chunk of the loss's logits (never [T, vocab] at once)")
  conv: int = _field(0, "width of a causal depthwise convolution before each attention (0: none)")
  rope_max_wavelength: float | None = _field(
    None, "drop rotary frequencies of longer wavelength (p-RoPE; for running past the training length)"
  )
  lr: float = _field(3e-3, "peak learning rate")
  warmup: int = _field(30, "warmup steps")
  weight_decay: float = _field(0.01, "AdamW weight decay")
  clip: float = _field(1.0, "global gradient-norm clip")
  eval_every: int = _field(50, "evaluate every this many steps")
  eval_batches: int = _field(8, "batches per evaluation (0: none)")
  seed: int = _field(0, "seed of the parameters and the data")
  init: str | None = _field(None, "start from the parameters in this .npz (save_params of an earlier run)")
  save_params: str | None = _field(None, "write the final parameters to this .npz")
  ckpt_dir: str | None = _field(None, "orbax checkpoints here (default: none)")
  ckpt_every: int = _field(100, "checkpoint every this many steps")
  ckpt_keep: int = _field(2, "checkpoints kept, the latest ones (0: all)")
  resume: bool = _field(False, "continue from the latest checkpoint in --ckpt-dir")
  stop_after: int | None = _field(None, "stop at this step of the schedule (an interruption)")
  target_accuracy: float | None = _field(None, "stop once eval accuracy reaches this")
  time_budget: float | None = _field(None, "stop after this many seconds of training")
  out: str | None = _field("results/train", "folder for history.json and loss.png (empty: none)")
  progress: bool = _field(True, "progress bar")

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f"TrainConfig.attention={self.attention!r} is not one of {ATTENTIONS}")
    if self.fsdp and self.attention == "dense":
      raise ValueError(
        "TrainConfig.fsdp=True splits the weights over a mesh; attention='dense' runs on one device"
      )
    for name in ("data", "ulysses", "steps", "batch", "eval_every", "ckpt_every", "chunk"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TrainConfig.{name}={value!r} must be a positive int")
    if self.resume and not self.ckpt_dir:
      raise ValueError("TrainConfig.resume=True needs ckpt_dir")


def make_mesh(data: int, seq: int, ulysses: int = 1):
  """A ("data", "seq") mesh with Auto axes over the first data * seq devices; with
  ulysses > 1, ("data", "seq", "u") over data * seq * ulysses."""
  if data * seq * ulysses > jax.device_count():
    raise ValueError(
      f"data={data} x seq={seq} x ulysses={ulysses} devices, but only {jax.device_count()} are visible"
    )
  shape, names = (data, seq, ulysses), ("data", "seq", "u")
  if ulysses == 1:
    shape, names = shape[:2], names[:2]
  devices = jax.devices()[: data * seq * ulysses]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def model_config(config: TrainConfig, task) -> LMConfig:
  """The `LMConfig` of the model a run trains on `task`."""
  return LMConfig(
    vocab_size=task.vocab_size,
    dim=config.dim,
    num_layers=config.layers,
    num_heads=config.heads,
    num_kv_heads=config.kv_heads,
    mlp_hidden=2 * config.dim,
    attention=config.attention,
    segment_lengths=(task.seq_len,),
    dilation_rates=(1,),
    max_seq_len=task.seq_len,
    policy="float32",
    window=config.window,
    global_every=config.global_every,
    logit_soft_cap=config.logit_soft_cap,
    attention_sinks=config.attention_sinks,
    alibi=config.alibi,
    remat=config.remat,
    conv=config.conv,
    rope_max_wavelength=config.rope_max_wavelength,
    ulysses_axis="u" if config.ulysses > 1 else None,
  )


def build(config: TrainConfig, task, mesh):
  """(model, optax transformation): the model's weights placed on the mesh, replicated
  or, with `config.fsdp`, split over all its devices (`decoder.fsdp_spec`)."""
  kind = config.attention
  model = DecoderLM(
    model_config(config, task),
    mesh=None if kind == "dense" else mesh,
    batch_axis="data" if kind != "dense" and config.data > 1 else None,
    rngs=nnx.Rngs(config.seed),
  )
  nnx.update(model, place(nnx.state(model), mesh, config.fsdp))
  return model, make_tx(config.lr, config.warmup, config.steps, config.weight_decay, config.clip)


def save_params(model, path: str) -> None:
  """The model's parameters as one .npz (keys: '/'-joined paths), from process 0."""
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  arrays = {"/".join(map(str, key)): np.asarray(jax.device_get(var.get_value())) for key, var in flat}
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:  # np.savez would append .npz to a path without it
      np.savez(f, **arrays)


def load_params(model, path: str, mesh, fsdp: bool = False) -> None:
  """Sets the model's parameters from `save_params`'s .npz, placed on `mesh` as `build`
  places them; ValueError naming the first path or shape that differs."""
  state = nnx.state(model, nnx.Param)
  flat = nnx.to_flat_state(state)
  with np.load(path) as saved:
    keys = {"/".join(map(str, key)) for key, _ in flat}
    if keys != set(saved.files):
      missing, extra = sorted(keys - set(saved.files)), sorted(set(saved.files) - keys)
      raise ValueError(
        f"init={path!r} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}"
      )
    for key, var in flat:
      name = "/".join(map(str, key))
      value = saved[name]
      if value.shape != var.get_value().shape:
        raise ValueError(
          f"init={path!r}: {name} has shape {value.shape}, this model's has {var.get_value().shape}"
        )
      var.set_value(jnp.asarray(value, var.get_value().dtype))
  nnx.update(model, place(nnx.from_flat_state(flat), mesh, fsdp))


def place(tree, mesh, fsdp: bool = False):
  """Every array of `tree` on `mesh`: replicated, or with `fsdp` split over all its
  devices along a dimension their count divides (`decoder.fsdp_spec`). With several
  processes each copies its own (identical: same seed) values to its devices; nothing
  crosses processes."""

  def sharding(x):
    return NamedSharding(mesh, fsdp_spec(x.shape, mesh) if fsdp and x.ndim else P())

  if jax.process_count() == 1:
    return jax.tree.map(lambda x: jax.device_put(x, sharding(x)), tree)
  to_global = lambda x: jax.make_array_from_callback(x.shape, sharding(x), lambda index: np.asarray(x)[index])
  return jax.tree.map(to_global, tree)


def replicate(tree, mesh):
  """Every array of `tree` replicated over `mesh` (`place` without FSDP)."""
  return place(tree, mesh)


def make_tx(lr: float, warmup: int, steps: int, weight_decay: float, clip: float):
  """AdamW with warmup + cosine decay to 5% of `lr`, and clipping (`train_step.make_tx`)."""
  return train_step.make_tx(lr, warmup, steps, weight_decay, clip, end=0.05)


def rows_right(logits, targets, weights):
  """bool [B]: every answer token of the row (weight 1) is the argmax."""
  return jnp.all((jnp.argmax(logits, -1) == targets) | (weights < 1), axis=-1)


def loss_and_accuracy(model, tokens, targets, weights, *, chunk: int = 512):
  """(weighted mean cross-entropy of the scored positions, {"accuracy": the fraction of
  rows whose answer tokens, those of weight 1, are all the argmax}), from the final
  hidden states `chunk` tokens at a time (`train_step.chunked_cross_entropy`): never
  [T, vocab] logits. `Trainer`'s objective for a `DecoderLM`."""
  # The states stay in the order the layers ran on (`LMConfig.ring_order`); the targets
  # and weights follow them, and neither sum depends on the order.
  h = model.hidden(tokens, order="ring")
  targets, weights = model.to_ring_order(targets), model.to_ring_order(weights)
  mesh, seq_axis, _ = model.placement
  if mesh is not None and model.config.ulysses_axis is not None:
    seq_axis = (seq_axis, model.config.ulysses_axis)
  kernel, placement = model.head.kernel[...], train_step.placement(model, seq_axis)
  value, predicted = train_step.chunked_cross_entropy(
    h, kernel, targets, weights, chunk=chunk, **placement, transposed=True, predictions=True
  )
  right = jnp.all((predicted == targets) | (weights < 1), axis=-1)
  return value, {"accuracy": jnp.mean(right)}


def _batch_spec(config: TrainConfig) -> P:
  if config.attention == "dense":
    return P()
  return P("data" if config.data > 1 else None, ("seq", "u") if config.ulysses > 1 else "seq")


def process_block(sharding, shape) -> tuple[slice, ...]:
  """The block of a global array of `shape` that this process's devices hold (one
  slice per axis): the bounding box of their shards, which for the meshes here is
  exactly what they hold."""
  index_map = sharding.addressable_devices_indices_map(tuple(shape))
  block = []
  for axis, size in enumerate(shape):
    starts = [idx[axis].indices(size)[0] for idx in index_map.values()]
    stops = [idx[axis].indices(size)[1] for idx in index_map.values()]
    block.append(slice(min(starts), max(stops)))
  return tuple(block)


def place_batch(task, seed: int, step: int, batch_size: int, mesh, spec: P):
  """Batch `step` of `task` on the mesh, sharded by `spec` over (batch, sequence).
  Each process builds only the rows its devices hold (`task.batch(..., rows=)`) and
  hands its block to `jax.make_array_from_process_local_data`."""
  sharding = NamedSharding(mesh, spec)
  shape = (batch_size, task.seq_len)
  if jax.process_count() == 1:
    return tuple(jax.device_put(x, sharding) for x in task.batch(seed, step, batch_size))
  rows, cols = process_block(sharding, shape)
  local = task.batch(seed, step, batch_size, rows=range(rows.start, rows.stop))
  return tuple(jax.make_array_from_process_local_data(sharding, x[:, cols], shape) for x in local)


def evaluate(trainer, task, config: TrainConfig, mesh):
  """(mean loss, mean accuracy) over `eval_batches` held-out batches."""
  losses, accs = [], []
  for i in range(config.eval_batches):
    batch = place_batch(task, config.seed + 10_000, i, config.batch, mesh, _batch_spec(config))
    loss, stats = trainer.evaluate(*batch)
    losses.append(float(loss))
    accs.append(float(stats["accuracy"]))
  return float(np.mean(losses)), float(np.mean(accs))


def train(config: TrainConfig, task, log=print, return_model: bool = False):
  """Trains a `DecoderLM` on `task`; returns the history dict (also written to
  `config.out`): "step", "loss", "accuracy", "seconds" lists, "eval" entries; with
  `return_model`, (history, the trained model).

  In a multi-process run (`jax.distributed` initialized) every process calls this
  with the same arguments: each builds only its own rows and columns of every batch,
  orbax writes one checkpoint to the shared `ckpt_dir` from all of them, and only
  process 0 logs, shows progress and writes `out`.
  """
  from tqdm import tqdm

  main = jax.process_index() == 0
  log = log if main else (lambda *_: None)
  if config.attention == "dense":
    data, seq = 1, 1
  else:
    data, seq = config.data, config.seq or jax.device_count() // (config.data * config.ulysses)
  mesh = make_mesh(data, seq, config.ulysses if config.attention != "dense" else 1)
  model, tx = build(config, task, mesh)
  if config.init:
    load_params(model, config.init, mesh, config.fsdp)
  # The one training step of the codebase (`train_step.Trainer`), with this model's loss.
  trainer = train_step.Trainer(model, tx, chunk=config.chunk, objective=loss_and_accuracy)
  spec = _batch_spec(config)

  ckpt = Checkpoints(config.ckpt_dir, config.ckpt_every, config.ckpt_keep) if config.ckpt_dir else None
  start = 0
  if config.resume:
    latest = ckpt.latest()
    if latest is not None:
      ckpt.restore(latest, trainer)
      start = latest
      log(f"resumed from step {latest} in {config.ckpt_dir}")
  history = {"step": [], "loss": [], "accuracy": [], "eval": [], "seconds": [], "attention": config.attention}
  bar = tqdm(
    range(start, config.steps), disable=not (config.progress and main), desc=config.attention, leave=False
  )
  t0 = time.perf_counter()
  for step in bar:
    loss, stats = trainer.step(*place_batch(task, config.seed, step, config.batch, mesh, spec))
    loss = float(loss)
    history["step"].append(step + 1)
    history["loss"].append(loss)
    history["accuracy"].append(float(stats["accuracy"]))
    history["seconds"].append(time.perf_counter() - t0)
    bar.set_postfix(loss=f"{loss:.3f}")
    if ckpt is not None:
      ckpt.save(step + 1, trainer)
    done = step + 1 == config.steps
    if config.eval_batches and ((step + 1) % config.eval_every == 0 or done):
      ev_loss, ev_acc = evaluate(trainer, task, config, mesh)
      history["eval"].append({"step": step + 1, "loss": ev_loss, "accuracy": ev_acc})
      if not config.progress:
        log(f"step {step + 1}: loss {loss:.4f}, eval loss {ev_loss:.4f}, eval accuracy {ev_acc:.3f}")
      if config.target_accuracy is not None and ev_acc >= config.target_accuracy:
        break
    if config.time_budget is not None and time.perf_counter() - t0 > config.time_budget:
      break
    if config.stop_after is not None and step + 1 >= config.stop_after:
      break
  if ckpt is not None:
    ckpt.save(history["step"][-1] if history["step"] else start, trainer, force=True)
    ckpt.close()
  final_eval = not history["eval"] or history["eval"][-1]["step"] != history["step"][-1]
  if config.eval_batches and history["step"] and final_eval:
    ev_loss, ev_acc = evaluate(trainer, task, config, mesh)
    history["eval"].append({"step": history["step"][-1], "loss": ev_loss, "accuracy": ev_acc})
  model = trainer.model()
  if config.save_params:
    save_params(model, config.save_params)
  history["chance"] = task.chance
  history["devices"] = int(np.prod(list(mesh.shape.values())))
  if config.out and main:
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "history.json"), "w") as f:
      json.dump(history, f, indent=1)
    plot_history([history], os.path.join(config.out, "loss.png"))
  return (history, model) if return_model else history


def plot_history(histories, path: str) -> None:
  """Training loss and eval accuracy of each history (as `train`
  returns them), side by side, written to the PNG `path`."""
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
