"""Fine-tuning a loaded model (`models.load`: Llama 3, Qwen 3, Gemma 3) over the ring:
the main job's long documents (the loss on the answers) or windows of a text as data,
and the loop behind `scripts/finetune.py` (warmup, clipping, a progress bar, orbax
state for resuming only the same base model, the result in `models.save`'s layout).
The step is `train.step.Trainer`'s.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import checkpoints
from ..eval import long_context
from .state import Checkpoints
from .step import Trainer, make_tx, place_batch

# --- Data. ---


def document_batch(tokenizer, length: int, step: int, *, batch: int = 1, seed: int = 0):
  """`batch` documents of the main job's pass-key task, each `length` tokens: filler
  with five facts at five depths, then one question and its answer; the loss is on the
  answer's tokens. The documents are a function of (seed, step, row). Returns (tokens,
  targets, weights), each [B, length]."""
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
  tokenizer (the main job's ANSWER_ROOM at least): each fact's prompt with its longest answer
  (a pass key's five digits bounded by its characters, plus one for a space piece). A
  fine-grained vocabulary needs more than ANSWER_ROOM; cut off, an answer would carry no loss."""
  most = long_context.ANSWER_ROOM
  for label, pool in long_context.FACTS[:5]:
    _, prompt = long_context.needle_text("passkey", label, "")
    answers = [len(" 12345.") + 1] if pool is None else [len(tokenizer.encode(f" {a}.")) for a in pool]
    most = max(most, len(tokenizer.encode(prompt)) + max(answers))
  return most


def _least_length(tokenizer) -> int:
  """The shortest `document_batch` length with this tokenizer: BOS, the five facts with
  their longest answers, 16 tokens of filler, the question and its answer."""
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
    record = dict(loss=value, seconds=round(seconds, 3), grad_norm=float(stats["grad_norm"]))
    if "dropped_tokens" in stats:  # an MoE with a capacity (`moe.set_capacity`)
      record["dropped_tokens"] = int(stats["dropped_tokens"])
    report["steps"].append(record)
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
