"""Fine-tuning a loaded model (`models.load`: Llama 3, Qwen 3, Gemma 3) over the ring:
a cross-entropy that never holds the [T, V] logits (`chunked_cross_entropy`), one jitted
AdamW step over the model's weights where they live (replicated, or split over every
device with `fsdp=True`: the optimizer's moments follow them), the batches of the main
job's long documents (the loss on the answers) or of a text, and the loop behind
`scripts/finetune.py` (warmup, clipping, a progress bar, orbax state for resuming, the
result in `models.save`'s layout).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import checkpoints, vocab


def chunked_cross_entropy(
  h,
  table,
  targets,
  weights,
  *,
  chunk: int = 512,
  mesh=None,
  seq_axis=None,
  batch_axis=None,
  table_axes=None,
  transposed: bool = False,
  predictions: bool = False,
):
  """sum(weights * cross-entropy(h @ table.T, targets)) / max(sum(weights), 1), with the
  logits made `chunk` tokens at a time and recomputed in the backward pass: at most
  [B, chunk, V] float32 logits exist at once (per device on a mesh), never [T, V]
  (Llama 3's 128K vocabulary at 64K tokens a device: 32 GiB of float32 logits).

  h [B, T, D] (final hidden states), table [V, D] (the head), targets int [B, T],
  weights float [B, T]. With `mesh`, each device scores its own tokens (T split over
  `seq_axis`, a mesh axis or a tuple of them, B over `batch_axis`) and the sums are
  added over the devices. With `table_axes` (the mesh axes `table` is split over along
  V), the table is never gathered: its shards pass each device in a ring
  (`vocab.cross_entropy`). `transposed`: `table` is given as [D, V] (an untied head's
  kernel). `predictions`: also the argmax token of every position, int [B, T], from
  the same chunks of logits (returns (loss, predictions); not with `table_axes`)."""
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk={chunk!r} must be a positive int")
  if targets.shape != h.shape[:2] or weights.shape != h.shape[:2]:
    raise ValueError(
      f"targets.shape={tuple(targets.shape)} and weights.shape={tuple(weights.shape)} must be h's [B, T] "
      f"{tuple(h.shape[:2])}"
    )
  if predictions and table_axes:
    raise ValueError(f"predictions=True needs the table whole (table_axes={table_axes!r})")
  weights = weights.astype(jnp.float32)
  length = h.shape[1]
  if transposed and not table_axes:
    table, transposed = table.T, False

  def local(h, targets, weights, table):
    b, t, d = h.shape
    chunk_here = min(chunk, t)
    n = -(-t // chunk_here)
    pad = n * chunk_here - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
    split = lambda a: jnp.moveaxis(a.reshape(b, n, chunk_here, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(_, xs):
      hc, tc, wc = xs
      logits = jnp.einsum("bcd,vd->bcv", hc, table.astype(hc.dtype), preferred_element_type=jnp.float32)
      lse = jax.nn.logsumexp(logits, axis=-1)
      picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
      best = jnp.argmax(logits, axis=-1).astype(jnp.int32) if predictions else None
      return None, (jnp.sum((lse - picked) * wc), best)

    _, (sums, best) = jax.lax.scan(body, None, (split(h), split(targets), split(weights)))
    if predictions:
      best = jnp.moveaxis(best, 0, 1).reshape(b, n * chunk_here)[:, :t]
    return jnp.sum(sums), jnp.sum(weights), best

  if mesh is None:
    total, count, best = local(h, targets, weights, table)
  else:
    seq_axes = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else (seq_axis,)
    pad = -length % math.prod(mesh.shape[a] for a in seq_axes)
    if pad:  # a length the devices do not divide: padded tokens of weight 0
      h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
      targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
    if batch_axis is not None and h.shape[0] % mesh.shape[batch_axis]:
      batch_axis = None
    axes = seq_axes if batch_axis is None else (batch_axis, *seq_axes)

    def ring(h, targets, weights, table):
      chunk_here = min(chunk, h.shape[1])  # a device's tokens, not padded up to a longer chunk
      pad = -h.shape[1] % chunk_here
      h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
      targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
      ce = vocab.cross_entropy(h, table, targets, table_axes, chunk_here, axes, transposed)
      return jnp.sum(ce * weights), jnp.sum(weights), None

    def summed(h, targets, weights, table):
      total, count, best = (ring if table_axes else local)(h, targets, weights, table)
      total, count = jax.lax.psum(total, axes), jax.lax.psum(count, axes)
      # The same sums on every device of the other axes (the ring's table may vary over
      # FSDP's data axis, which the tokens are not split over): their mean, typed alike.
      others = tuple(a for a in mesh.axis_names if a not in axes)
      if others:
        size = math.prod(mesh.shape[a] for a in others)
        total, count = jax.lax.psum(total, others) / size, jax.lax.psum(count, others) / size
      return total, count, best

    rows = P(batch_axis, seq_axes)
    total, count, best = jax.shard_map(
      summed,
      mesh=mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)),
      in_specs=(P(batch_axis, seq_axes, None), rows, rows, _table_spec(table_axes, transposed)),
      out_specs=(P(), P(), rows if predictions else None),
    )(h, targets, weights, table)
    best = best[:, :length] if predictions else None
  value = total / jnp.maximum(count, 1.0)
  return (value, best) if predictions else value


def _like_hidden(model, x):
  """x [B, T] split over the sequence (and batch) as the model's hidden states are."""
  mesh, seq_axis, batch_axis = model.placement
  if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis]:
    batch_axis = None
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  return jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(batch_axis, seq_axis)))


def _table_spec(axes, transposed):
  if not axes:
    return P()
  return P(None, axes) if transposed else P(axes, None)


def loss(model, tokens, targets, weights, *, chunk: int = 512):
  """The model's chunked cross-entropy of `targets` after `tokens` (`chunked_cross_entropy`)."""
  mesh, seq_axis, batch_axis = model.placement
  perm = model.ring_permutation(tokens.shape[1])
  if perm is None:
    h = model.hidden(tokens)
  else:  # every layer in the ring's order: the loss sums over tokens in any order
    tokens, targets, weights = (jnp.take(jnp.asarray(a), perm, axis=1) for a in (tokens, targets, weights))
    tokens, targets, weights = (_like_hidden(model, a) for a in (tokens, targets, weights))
    h = model.hidden(tokens, token_order="layout")
  table, axes = model.head_table()
  if axes is None:  # the table whole on every device
    table = model.head_weights()
  return chunked_cross_entropy(
    h,
    table,
    targets,
    weights,
    chunk=chunk,
    mesh=mesh,
    seq_axis=seq_axis,
    batch_axis=batch_axis,
    table_axes=axes,
    transposed=axes is not None and model.head is not None,
  )


@functools.cache
def make_tx(lr: float, warmup: int, steps: int, weight_decay: float, clip: float, end: float = 0.1):
  """AdamW (float32 moments) with linear warmup then cosine decay to `end` x `lr`, after
  clipping the gradients' global norm at `clip`; cached, so that runs with the same
  settings share one optimizer and hence one compiled step."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1), end_value=lr * end
  )
  return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))


def per_device_bytes(tree) -> int:
  """Bytes the first device holds of `tree`'s arrays (what each device holds, for the
  even splits and the replicated arrays here)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += leaf.addressable_shards[0].data.nbytes
  return total


def unsplit_bytes(model) -> int:
  """Bytes a device holds of the weights FSDP cannot split (no dimension the device
  count divides: `decoder.fsdp_spec`); 0 without FSDP or where every weight splits."""
  mesh = model.placement[0]
  if not getattr(model, "fsdp", False) or mesh is None:
    return 0
  from .decoder import fsdp_spec

  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  return sum(v[...].nbytes for _, v in flat if v[...].ndim and fsdp_spec(v.shape, mesh) == P())


def cross_entropy(model, tokens, targets, weights, *, chunk: int = 512):
  """A loaded model's objective for `Trainer`: (`loss`, no other statistics)."""
  return loss(model, tokens, targets, weights, chunk=chunk), {}


class Trainer:
  """The training step of every model here: the model's weights, their AdamW state
  (split as the weights are: replicated, or over every device with FSDP) and one jitted
  step, `step(tokens, targets, weights) -> (loss, stats)`: stats holds the gradient's
  global norm ("grad_norm") and what the objective reports beside its loss.
  `evaluate(...)` gives (loss, stats) without a step; `model()` the model with the
  current weights.

  objective(model, tokens, targets, weights, chunk=) -> (loss, dict of scalars): by
  default a loaded model's chunked cross-entropy (`cross_entropy`); `DecoderLM`s train
  with `models.training.loss_and_accuracy`."""

  def __init__(self, model, tx, *, chunk: int = 512, objective=cross_entropy):
    self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
    self.tx, self.chunk = tx, chunk
    self.opt_state = tx.init(self.params)
    self.opt_state = jax.tree.map(_on_mesh(model), self.opt_state)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    self._step = jax.jit(
      functools.partial(_step, self.graphdef, tx, objective, chunk),
      donate_argnums=(0, 2),
      out_shardings=(shardings(self.params), shardings(self.opt_state), None, None),
    )
    self._evaluate = jax.jit(functools.partial(_evaluate, self.graphdef, objective, chunk))
    self._programs = {}

  def _program(self, tokens, targets, weights):
    """The step compiled once per batch shape and placement, for `step`, `memory` and
    `compiled` alike (a jitted call would compile the program `compiled` made again:
    twice the compile's host memory, 0.6 GiB for Gemma 3 270M on 8 devices)."""
    key = tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in (tokens, targets, weights))
    if key not in self._programs:
      lowered = self._step.lower(self.params, self.rest, self.opt_state, tokens, targets, weights)
      self._programs[key] = lowered.compile()
    return self._programs[key]

  def step(self, tokens, targets, weights):
    self.params, self.opt_state, value, stats = self._program(tokens, targets, weights)(
      self.params, self.rest, self.opt_state, tokens, targets, weights
    )
    return value, stats

  def evaluate(self, tokens, targets, weights):
    return self._evaluate(self.params, self.rest, tokens, targets, weights)

  def compiled(self, tokens, targets, weights):
    """The step compiled for these shapes (`memory_analysis()`, `as_text()`)."""
    return self._program(tokens, targets, weights)

  def model(self):
    return nnx.merge(self.graphdef, self.params, self.rest)

  def memory(self, tokens, targets, weights) -> dict:
    """Per device: the weights' and the optimizer state's bytes, and the step's
    compiled temporaries."""
    temp = self.compiled(tokens, targets, weights).memory_analysis().temp_size_in_bytes
    return dict(
      param_bytes=per_device_bytes(self.params),
      optimizer_bytes=per_device_bytes(self.opt_state),
      temp_bytes=int(temp),
    )


def _on_mesh(model):
  """The optimizer's scalars (its step count) replicated on the model's mesh, beside the
  moments, which optax makes with zeros_like and so placed as the weights they follow.
  Each process places its own copy (the same on all)."""
  mesh = model.placement[0]
  if mesh is None:
    return lambda x: x
  whole = NamedSharding(mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)), P())

  def place(x):
    if not (isinstance(x, jax.Array) and x.ndim == 0):
      return x
    value = np.asarray(x)
    return jax.make_array_from_callback((), whole, lambda index: value[index])

  return place


def _step(graphdef, tx, objective, chunk, params, rest, opt_state, tokens, targets, weights):
  def value(p):
    return objective(nnx.merge(graphdef, p, rest), tokens, targets, weights, chunk=chunk)

  (loss_value, stats), grads = jax.value_and_grad(value, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  stats = dict(stats, grad_norm=optax.tree.norm(grads))
  return optax.apply_updates(params, updates), opt_state, loss_value, stats


def _evaluate(graphdef, objective, chunk, params, rest, tokens, targets, weights):
  return objective(nnx.merge(graphdef, params, rest), tokens, targets, weights, chunk=chunk)


# --- Data. ---


def document_batch(tokenizer, length: int, step: int, *, batch: int = 1, seed: int = 0):
  """`batch` documents of the main job's pass-key task, each `length` tokens: filler
  with five facts at five depths, then one question and its answer; the loss is on the
  answer's tokens. The documents are a function of (seed, step, row). Returns (tokens,
  targets, weights), each [B, length]."""
  from . import long_context

  rows = []
  for row in range(batch):
    rng = np.random.default_rng([seed, step, row])
    depths = sorted(rng.uniform(0.02, 0.98, 5).tolist())
    pick = int(rng.integers(5))
    room = _answer_room(tokenizer)
    if length - room < 16:
      raise ValueError(
        f"length={length} leaves no room for a document before its question and answer ({room} tokens)"
      )
    doc = long_context.make_document(
      tokenizer, "passkey", length - room, depths, seed=seed * 1_000_003 + step * 97 + row
    )
    q = doc.questions[pick]
    prompt = tokenizer.encode(q.prompt)
    answer = tokenizer.encode(" " + q.answer + ".")
    ids = list(doc.tokens) + prompt + answer
    ids = ids + [tokenizer.pad_id or 0] * (length - len(ids))
    scored = np.zeros(length, np.float32)
    start = len(doc.tokens) + len(prompt)
    scored[start - 1 : start - 1 + len(answer)] = 1.0  # position i predicts token i + 1
    rows.append((ids, scored))
  ids = np.asarray([r[0] for r in rows], np.int32)
  targets = np.concatenate([ids[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)
  return ids, targets, np.asarray([r[1] for r in rows])


def _answer_room(tokenizer) -> int:
  """The most tokens a question of `document_batch` and its answer take with this
  tokenizer (the main job's ROOM at least): each fact's prompt with its longest answer
  (a pass key's five digits bounded by its characters, plus one for a space piece). A
  fine-grained vocabulary needs more than ROOM; cut off, an answer would carry no loss."""
  from . import long_context

  most = long_context.ROOM
  for label, pool in long_context.FACTS[:5]:
    _, prompt = long_context.needle_text("passkey", label, "")
    answers = [len(" 12345.") + 1] if pool is None else [len(tokenizer.encode(f" {a}.")) for a in pool]
    most = max(most, len(tokenizer.encode(prompt)) + max(answers))
  return most


def _least_length(tokenizer) -> int:
  """The shortest `document_batch` length with this tokenizer: BOS, the five facts with
  their longest answers, 16 tokens of filler, the question and its answer."""
  from . import long_context

  needles = 0
  for label, pool in long_context.FACTS[:5]:
    answers = ["12345"] if pool is None else pool
    needles += max(len(tokenizer.encode(long_context.needle_text("passkey", label, a)[0])) for a in answers)
  return len(tokenizer.prefix()) + needles + 16 + _answer_room(tokenizer)


def text_batch(ids: np.ndarray, length: int, step: int, *, batch: int = 1, seed: int = 0):
  """`batch` windows of `length` + 1 tokens of a tokenized text, at offsets that are a
  function of (seed, step, row); the loss on every next token."""
  if len(ids) < length + 2:
    raise ValueError(f"the text has {len(ids)} tokens; --length {length} needs at least {length + 2}")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(ids) - length - 1, batch)
  windows = np.stack([ids[s : s + length + 1] for s in starts]).astype(np.int32)
  return windows[:, :-1], windows[:, 1:], np.ones((batch, length), np.float32)


def place_batch(model, *arrays):
  """Arrays [B, T] split as the model's hidden states are (T over the seq axis, B over
  the batch axis), when the shapes divide."""
  mesh, seq_axis, batch_axis = model.placement
  if mesh is None:
    return tuple(jnp.asarray(a) for a in arrays)
  b, t = arrays[0].shape
  batch_axis = batch_axis if batch_axis is not None and b % mesh.shape[batch_axis] == 0 else None
  spec = P(batch_axis, seq_axis if t % mesh.shape[seq_axis] == 0 else None)
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  return tuple(jax.device_put(np.asarray(a), NamedSharding(auto, spec)) for a in arrays)


# --- The loop. ---


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  length: int = 1024
  steps: int = 4
  batch: int = 1
  lr: float = 1e-5
  warmup: int = 1
  weight_decay: float = 0.0
  clip: float = 1.0
  chunk: int = 512
  seed: int = 0
  save_every: int = 0  # orbax state for resuming every this many steps (0: at the end only)


BASE = "base.json"  # beside report.json: what the state in state/ was fine-tuned from


def base_record(model, path=None) -> dict:
  """What a fine-tuning run starts from: the base model's path, and fingerprints of its
  config (config.json's hyper-parameters) and of its original weights: of the weight
  files at `path` (each file's size and 64 blocks of 1 MiB spread over it: a second
  or so for any size), else of the loaded parameters (each one's shape, sum and sum of
  squares to 4 digits)."""
  digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
  config = digest(json.dumps(checkpoints.config_json(model.config), sort_keys=True))
  if path is not None:
    return dict(path=str(path), config=config, weights=_files_digest(path))
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  squared = lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)))
  moments = jax.jit(lambda xs: [(jnp.sum(x.astype(jnp.float32)), squared(x)) for x in xs])
  sums = jax.device_get(moments([v[...] for _, v in flat]))
  values = [
    f"{'.'.join(map(str, key))}:{tuple(v.shape)}:{float(a):.4e}:{float(b):.4e}"
    for (key, v), (a, b) in zip(flat, sums)
  ]
  return dict(path=None, config=config, weights=digest("\n".join(values)))


def _files_digest(path, blocks: int = 64, block: int = 2**20) -> str:
  """A hash of the weight files at `path` (a GGUF file, or a folder's safetensors)."""
  path = os.fspath(path)
  files = (
    [path]
    if os.path.isfile(path)
    else sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
  )
  h = hashlib.sha256()
  for name in files:
    size = os.path.getsize(name)
    h.update(f"{os.path.basename(name)}:{size}".encode())
    with open(name, "rb") as f:
      for i in range(blocks):
        f.seek(max(0, size - block) * i // max(blocks - 1, 1))
        h.update(f.read(block))
  return h.hexdigest()[:16]


def check_resume(out: str, record: dict) -> None:
  """ValueError (one line, naming both models) unless the state under `out` was
  fine-tuned from the model `record` describes (`base_record`)."""
  found = os.path.join(out, BASE)
  if not os.path.exists(found):
    raise ValueError(
      f"{out}/state/ holds a fine-tuning state with no {BASE} saying which model it came from; "
      f"not resuming it for {record['path']} (remove {out}/state/ or pass another --out)"
    )
  with open(found) as f:
    before = json.load(f)
  what = [k for k in ("config", "weights") if before.get(k) != record[k]]
  if what:
    raise ValueError(
      f"{out}/state/ was fine-tuned from {before.get('path')}, whose {' and '.join(what)} differ from "
      f"{record['path']}'s: not resuming it (remove {out}/state/ or pass another --out)"
    )


def check_run(model, tokenizer, config: FinetuneConfig, ids=None) -> None:
  """ValueError naming the setting before a run writes anything: steps, lengths the
  model's context or the data cannot take."""
  if config.steps < 1:
    raise ValueError(f"steps={config.steps}: at least 1 step")
  if config.batch < 1:
    raise ValueError(f"batch={config.batch}: at least 1 sequence a step")
  context = model.config.context_length
  if config.length > context:
    raise ValueError(f"length={config.length} exceeds the model's context length {context}")
  if ids is None:
    least = _least_length(tokenizer)
    if config.length < least:
      raise ValueError(
        f"length={config.length}: the documents need at least {least} tokens with this tokenizer "
        "(a document, then its question and answer)"
      )
  elif len(ids) < config.length + 2:
    raise ValueError(
      f"the text has {len(ids)} tokens; length={config.length} needs at least {config.length + 2}"
    )


def finetune(
  model,
  tokenizer,
  config: FinetuneConfig,
  out: str,
  *,
  text: str | None = None,
  progress=True,
  base: str | None = None,
) -> dict:
  """Fine-tunes `model` on the main job's documents (or on `text`), writing
  `out/report.json` ("steps": [{"loss", "seconds"}], "memory": per device param_bytes,
  optimizer_bytes and the step's temp_bytes), `out/base.json` (`base_record`: the base
  model's path `base` and fingerprints of its config and weights), `out/state/` (orbax:
  weights, optimizer state, step; a later call resumes from it, only for the same base
  model: `check_resume`) and `out/checkpoint/` (`models.save`'s layout, with the
  tokenizer). Bad settings are ValueErrors before anything is written (`check_run`).
  Returns the report."""
  from .training import Checkpoints

  ids = None if text is None else np.asarray(tokenizer.encode(text), np.int32)
  check_run(model, tokenizer, config, ids)
  record = base_record(model, base)
  if os.path.isdir(os.path.join(out, "state")) and os.listdir(os.path.join(out, "state")):
    check_resume(out, record)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, BASE), "w") as f:
    json.dump(record, f, indent=1)
  tx = make_tx(config.lr, config.warmup, config.steps, config.weight_decay, config.clip)
  trainer = Trainer(model, tx, chunk=config.chunk)

  def batch(step):
    if ids is None:
      arrays = document_batch(tokenizer, config.length, step, batch=config.batch, seed=config.seed)
    else:
      arrays = text_batch(ids, config.length, step, batch=config.batch, seed=config.seed)
    return place_batch(model, *arrays)

  report_path = os.path.join(out, "report.json")
  report = dict(config=dataclasses.asdict(config), steps=[])
  state = Checkpoints(os.path.join(out, "state"), every=config.save_every or config.steps, keep=1)
  first = 0
  latest = state.latest()
  if latest is not None:
    state.restore(latest, trainer)
    first = latest
    if os.path.exists(report_path):
      with open(report_path) as f:
        report["steps"] = json.load(f)["steps"][:first]
  report["memory"] = trainer.memory(*batch(first))
  steps = range(first, config.steps)
  if progress:
    from tqdm import tqdm

    steps = tqdm(steps, desc="fine-tuning", initial=first, total=config.steps, unit="step")
  for step in steps:
    start = time.perf_counter()
    value, stats = trainer.step(*batch(step))
    value = float(value)
    seconds = time.perf_counter() - start
    report["steps"].append(dict(loss=value, seconds=round(seconds, 3), grad_norm=float(stats["grad_norm"])))
    if progress:
      steps.set_postfix(loss=f"{value:.4f}", s=f"{seconds:.1f}")
    if not np.isfinite(value):
      raise FloatingPointError(f"step {step}: the loss is {value}")
    if config.save_every and (step + 1) % config.save_every == 0:
      state.save(step + 1, trainer, force=True)
  state.save(config.steps, trainer, force=True)
  state.close()
  checkpoints.save(trainer.model(), os.path.join(out, "checkpoint"), tokenizer=tokenizer)
  with open(report_path, "w") as f:
    json.dump(report, f, indent=1)
  return report


# --- Compiling a training step for hardware that is not here. ---


def compile_train_step(
  name: str,
  mesh,
  *,
  seq_len: int,
  batch: int = 1,
  remat: str = "full",
  dtype: str = "bfloat16",
  param_dtype: str = "float32",
  chunk: int = 1024,
  layers: int | None = None,
):
  """One whole AdamW step of the named model (`models.config(name)`) with `fsdp=True`,
  per-layer `remat` and the chunked loss, over `mesh`'s "seq" axis, compiled with
  abstract weights (nothing allocated): the `Compiled` program. Weights and AdamW
  moments in `param_dtype`, computed in `dtype`; the ring's kernel is the target's
  default. `layers`: the model with that many of its blocks (a quicker compile of the
  same step's shapes; None: all)."""
  from . import checkpoints

  # Training past the released context (as long-context fine-tuning does): the model
  # takes sequences up to seq_len, with its rotary settings as released.
  cfg = checkpoints.config(name)
  if layers is not None and (not isinstance(layers, int) or layers < 1):
    raise ValueError(f"layers={layers!r}: a positive number of blocks, or None for all")
  cfg = dataclasses.replace(
    cfg, context_length=max(cfg.context_length, seq_len), num_layers=layers or cfg.num_layers
  )
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  with jax.set_mesh(auto):
    model = nnx.eval_shape(
      lambda: checkpoints.build(
        cfg, mesh=auto, fsdp=True, remat=remat, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)
      )
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    spec = lambda shape: NamedSharding(auto, _fsdp_or_whole(shape, auto))
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x.shape))
    params = jax.tree.map(abstract, params)
    tx = make_tx(1e-5, 100, 1000, 0.1, 1.0)
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_state = jax.tree.map(abstract, jax.eval_shape(tx.init, plain))
    rows = NamedSharding(auto, P(None, "seq"))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows)
    weights = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=rows)
    step = jax.jit(functools.partial(_step, graphdef, tx, cross_entropy, chunk), donate_argnums=(0, 2))
    return step.lower(params, rest, opt_state, tokens, tokens, weights).compile()


def _fsdp_or_whole(shape, mesh):
  from .decoder import fsdp_spec

  return fsdp_spec(shape, mesh) if len(shape) else P()


def step_memory(compiled, device_bytes: int) -> dict:
  """A compiled step's memory per device: its arguments (weights, optimizer state,
  batch), outputs, temporaries, the outputs that reuse donated arguments (alias), and
  the peak the device must hold at once (arguments + outputs - alias + temporaries);
  `fits`: the peak within `device_bytes`."""
  m = compiled.memory_analysis()
  out = dict(
    argument_bytes=int(m.argument_size_in_bytes),
    output_bytes=int(m.output_size_in_bytes),
    temp_bytes=int(m.temp_size_in_bytes),
    alias_bytes=int(m.alias_size_in_bytes),
  )
  out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  out["fits"] = out["peak_bytes"] <= device_bytes
  return out
