"""Fine-tuning a loaded model (`models.load`: Llama 3, Qwen 3, Gemma 3) over the ring:
the main job's long documents (the loss on the answers) or windows of a text as data,
and the loop behind `scripts/finetune.py` (warmup, clipping, a progress bar, orbax
state for resuming only the same base model, the result in `models.save`'s layout).
The step is `train.step.Trainer`'s.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ring import nn as ring_nn

from .. import checkpoints, lora
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
  eval_every: int = 0  # evaluation loss every this many steps (0: at the end only, where there is eval data)
  # The ring's passes bounded by the packed rows' longest document (`_bound_documents`);
  # "auto": each batch's own longest, read from its ids while running
  # (`document_bound="auto"`); False: every pass (the same losses, whichever is chosen).
  document_bound: bool | str = True


class StepBatches:
  """Batches that are a function of the step (`document_batch`, `text_batch`), with the
  loader's interface (`pipeline.Loader`): next() -> (arrays, sources), state / restore."""

  def __init__(self, make):
    self.make, self.step = make, 0

  def __next__(self):
    tokens, targets, weights = self.make(self.step)
    self.step += 1
    return dict(tokens=tokens, targets=targets, weights=weights), [f"batch of step {self.step - 1}"]

  def state(self) -> dict:
    return {"step": self.step}

  def restore(self, state: dict) -> None:
    self.step = int(state["step"])


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
    return dict(
      path=str(path), config=config, weights=_files_digest(path), adapter=lora.adapter_record(model)
    )
  flat = nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
  squared = lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)))
  moments = jax.jit(lambda xs: [(jnp.sum(x.astype(jnp.float32)), squared(x)) for x in xs])
  sums = jax.device_get(moments([v[...] for _, v in flat]))
  values = [
    f"{'.'.join(map(str, key))}:{tuple(v.shape)}:{float(a):.4e}:{float(b):.4e}"
    for (key, v), (a, b) in zip(flat, sums)
  ]
  return dict(path=None, config=config, weights=digest("\n".join(values)), adapter=lora.adapter_record(model))


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
  if not what and before.get("adapter") != record.get("adapter"):
    raise ValueError(
      f"{out}/state/ was fine-tuned with adapters {before.get('adapter')} and this run has "
      f"{record.get('adapter')}: not resuming it (remove {out}/state/ or pass another --out)"
    )
  if what:
    raise ValueError(
      f"{out}/state/ was fine-tuned from {before.get('path')}, whose {' and '.join(what)} differ from "
      f"{record['path']}'s: not resuming it (remove {out}/state/ or pass another --out)"
    )
  was, now = before.get("data"), record.get("data") or {}
  if was is None:  # a state written before runs recorded their data
    return
  # The path is shown, not compared: the same data moved elsewhere resumes.
  differ = [k for k in sorted(set(was) | set(now)) if k != "path" and was.get(k) != now.get(k)]
  if differ:
    differ += ["path"] if was.get("path") != now.get("path") else []
    shown = "; ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in differ)
    raise ValueError(
      f"{out}/state/ was fine-tuned on other data ({shown}): not resuming it with this data "
      "(pass the same --data and data settings, remove state/, or pass another --out)"
    )


def data_record(data, config: FinetuneConfig, ids=None, path=None) -> dict:
  """What a run trains on, for `check_resume`: the data's path and format, a hash of
  its tokens and loss weights (the files, tokenizer, template and columns all show
  there) and the settings that make rows and batches of them (row length, batch,
  seed, what became of long examples)."""
  h = hashlib.sha256()
  out = dict(
    path=None if path is None else str(path), length=config.length, batch=config.batch, seed=config.seed
  )
  examples = getattr(data, "examples", None)
  if examples is not None:  # a pipeline.Loader
    for a, m in zip(examples.ids, examples.masks):
      h.update(np.asarray(a, np.int32).tobytes())
      h.update(np.asarray(m, np.float32).tobytes())
    h.update(json.dumps(examples.docs).encode())
    out.update(
      format=examples.format,
      examples=len(examples),
      rows=len(data.rows),
      dropped=len(data.dropped),
    )
  elif ids is not None:
    h.update(np.asarray(ids, np.int32).tobytes())
    out.update(format="text windows")
  else:
    out.update(format="documents")
  out.update(getattr(data, "settings", {}))  # what else makes the rows (grpo's completions)
  out["tokens"] = h.hexdigest()[:16]
  return out


def check_run(model, tokenizer, config: FinetuneConfig, ids=None, *, data=None) -> None:
  """ValueError naming the setting before a run writes anything: steps, lengths the
  model's context or the data cannot take, token ids outside the model's vocabulary."""
  if config.steps < 1:
    raise ValueError(f"steps={config.steps}: at least 1 step")
  if config.batch < 1:
    raise ValueError(f"batch={config.batch}: at least 1 sequence a step")
  context = model.config.context_length
  if config.length > context:
    raise ValueError(f"length={config.length} exceeds the model's context length {context}")
  if data is not None:
    vocab = model.config.vocab_size
    for where, example in zip(data.examples.where, data.examples.ids):
      if len(example) and (example.max() >= vocab or example.min() < 0):
        raise ValueError(
          f"{where}: token id {int(example.max())} is outside the model's vocabulary of {vocab}"
        )
    return
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


DATA_STATE = "data_state.json"  # beside state/: the loader's state at each saved step


def finetune(
  model,
  tokenizer,
  config: FinetuneConfig,
  out: str,
  *,
  text: str | None = None,
  data=None,
  eval_data=None,
  progress=True,
  base: str | None = None,
  run: dict | None = None,
  merge: bool = False,
  objective=None,
  cache_dir=None,
  stop: dict | None = None,
) -> dict:
  """Fine-tunes `model` on the main job's documents, on windows of `text`, or on `data`
  (a `data.pipeline.Loader` of packed rows; `eval_data` another, in order, for the
  evaluation loss every `config.eval_every` steps and at the end), writing:

  - `out/metrics.jsonl` and TensorBoard event files in `out/tb/`, a record as each step
    ends ("step", "loss", "grad_norm", "lr", "tokens" (those not padding), "loss_tokens"
    (the targets with a loss weight), "padding",
    "tokens_per_s", "seconds", and "dropped_tokens" for an MoE with a capacity) and as
    each evaluation ends ("step": the training step it follows, 0-based as the steps'
    own records; "eval_loss");
  - `out/report.json` ("config": `config` and `run`, what the run used; "steps": each
    step's record, the whole history across resumes; "memory": per device param_bytes,
    optimizer_bytes and the step's temp_bytes; "data": the rows' statistics), rewritten
    at every save;
  - `out/base.json` (`base_record`), `out/state/` (orbax: weights, optimizer state, step)
    with `out/data_state.json` (the loader's state there), and `out/checkpoint/`
    (`models.save`'s layout).

  A model with adapters (`models.add_lora`) trains them alone (the base frozen: no
  gradient or AdamW state for it), writes them to `out/adapter/` (PEFT's layout) and,
  with `merge`, the merged model to `out/checkpoint/` (none without).

  A later call resumes from the state (only for the same base model, `check_resume`, and
  never past `config.steps`), continuing the data at exactly the next row: the losses
  are those of a run never stopped. SIGTERM or SIGINT saves the state at the step that
  is running once it ends and returns (report["interrupted"] names the signal). A loss
  or gradient norm that is not finite raises FloatingPointError naming the step and the
  batch's examples, and saves nothing: the last good state stays. Bad settings are
  ValueErrors before anything is written (`check_run`). Returns the report.

  `objective` (`objective.Supervised` by default; `dpo.Preference`): how a batch is
  completed before the step, the loss, and the records of steps and evaluations; the
  run around it is the same for every objective. `cache_dir`: where an objective keeps
  what it computes once for the data (DPO's precomputed reference; default `out`).

  `stop`: a dict a signal handler of the caller's fills with "signal" (the caller's
  handlers then cover its own set-up too, as scripts/finetune.py's do); without it the
  call installs SIGTERM and SIGINT handlers of its own for its whole length. A signal
  before anything is written returns at once (report["interrupted"], nothing on disk);
  one before or during a step saves the state once the step ends; one during the
  export lets it finish (each exported folder appears whole, renamed into place)."""
  import signal

  from . import objective as objectives

  objective = objective or objectives.Supervised()
  handlers = {}
  if stop is None:
    stop = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      with contextlib.suppress(ValueError):  # not the main thread: no handlers, the run just goes on
        handlers[sig] = signal.signal(sig, lambda number, frame: stop.setdefault("signal", number))
  try:
    return _finetune(
      model, tokenizer, config, out, text=text, data=data, eval_data=eval_data, progress=progress, base=base,
      run=run, merge=merge, objective=objective, cache_dir=cache_dir, stop=stop,
    )  # fmt: skip
  finally:
    for sig, old in handlers.items():
      signal.signal(sig, old)


def _finetune(
  model,
  tokenizer,
  config,
  out,
  *,
  text,
  data,
  eval_data,
  progress,
  base,
  run,
  merge,
  objective,
  cache_dir,
  stop,
):
  """`finetune`'s run, with `stop` filled by a signal handler."""
  import signal

  from . import metrics as metrics_io
  from . import objective as objectives
  from .step import make_schedule

  ids = None if text is None or data is not None else np.asarray(tokenizer.encode(text), np.int32)
  check_run(model, tokenizer, config, ids, data=data)
  record = base_record(model, base)
  record["data"] = data_record(data, config, ids, path=(run or {}).get("data"))
  state_dir = os.path.join(out, "state")
  state = None
  if os.path.isdir(state_dir) and os.listdir(state_dir):
    check_resume(out, record)
    state = Checkpoints(state_dir, every=config.save_every or config.steps, keep=1)
    latest = state.latest()
    if latest is not None and latest > config.steps:
      state.close()
      raise ValueError(
        f"{out}/state/ holds {latest} steps done and --steps asks for {config.steps}: not going back "
        "(pass --steps of at least the steps done, or another --out)"
      )
  main = jax.process_index() == 0  # the process that writes the files (all save the state)
  if "signal" in stop:  # during the set-up: nothing written yet, nothing to save
    if state is not None:
      state.close()
    return dict(steps=[], interrupted=signal.Signals(stop["signal"]).name, saved=False)
  if main:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, BASE), "w") as f:
      json.dump(record, f, indent=1)
  tx = make_tx(config.lr, config.warmup, config.steps, config.weight_decay, config.clip)
  schedule = make_schedule(config.lr, config.warmup, config.steps)
  adapters = lora.lora_settings(model) is not None
  bound = None
  if config.document_bound:
    bound = _bound_documents(model, data, eval_data, auto=config.document_bound == "auto")
  trainer = Trainer(
    model,
    tx,
    chunk=config.chunk,
    objective=objective.loss,
    trainable=nnx.LoRAParam if adapters else nnx.Param,
  )
  if data is None:

    def make(step):
      if ids is None:
        return document_batch(tokenizer, config.length, step, batch=config.batch, seed=config.seed)
      return text_batch(ids, config.length, step, batch=config.batch, seed=config.seed)

    data = StepBatches(make)

  def place(arrays):
    names = ("tokens", "targets", "weights") + tuple(sorted(set(arrays) - {"tokens", "targets", "weights"}))
    placed = dict(zip(names, place_batch(model, *(arrays[n] for n in names))))
    rows = {k: placed[k] for k in names[3:]}
    return (placed["tokens"], placed["targets"], placed["weights"]), rows

  if state is None:
    state = Checkpoints(state_dir, every=config.save_every or config.steps, keep=1)
  # Before a resumed state replaces the weights: an objective's reference is the initial ones.
  objective.setup(
    trainer, data, eval_data, place=place, cache=_cache_path(cache_dir or out, record, config, objective)
  )
  first = state.latest() or 0
  if first:
    state.restore(first, trainer)
    data.restore(_data_state(out, first, data))
  if main:
    objective.resume(out, first)
  report_path = os.path.join(out, "report.json")
  report = dict(config=dict(dataclasses.asdict(config), **(run or {})), steps=[])
  if hasattr(data, "summary"):  # a loader of the user's data
    report["data"] = dict(data.summary(), document_bound=bound)
  here = data.state()
  arrays, _ = next(data)  # the first batch, for the compiled step's memory; then back
  data.restore(here)
  args, rows = place(objective.probe(arrays))
  report["memory"] = trainer.memory(*args, **rows)
  history = [r for r in metrics_io.read(out) if "loss" in r and r["step"] < first]
  log = metrics_io.Metrics(out, first) if main else metrics_io.Quiet()

  def save(step):
    state.save(step, trainer, force=True)
    state.manager.wait_until_finished()
    report["steps"] = list(history)
    if main:
      objective.save(out, step)
      _write_data_state(out, step, data.state())
      with open(report_path, "w") as f:
        json.dump(report, f, indent=1)

  def evaluate(step):
    if eval_data is None:
      return
    results = []
    for arrays, _ in _once(eval_data):
      arrays = objective.prepare(arrays)
      args, rows = place(arrays)
      value, stats = trainer.evaluate(*args, **rows)
      results.append((arrays, value, jax.device_get(stats)))
    log.log(dict(step=step, **objective.evaluate(results)))

  steps = range(first, config.steps)
  progress = progress and main
  if progress:
    from tqdm import tqdm

    steps = tqdm(steps, desc="fine-tuning", initial=first, total=config.steps, unit="step")
  try:
    for step in steps:
      if "signal" in stop:  # before this step (during the set-up, or an evaluation)
        save(step)
        report["interrupted"] = signal.Signals(stop["signal"]).name
        return report
      here = data.state()
      arrays, where = next(data)
      start = time.perf_counter()
      try:
        arrays = objective.prepare(arrays)
      except objectives.StopRun:  # saved at this step, its batch still to come
        data.restore(here)
        save(step)
        raise
      args, rows = place(arrays)
      value, out_stats = trainer.step(*args, **rows)
      value, norm = float(value), float(out_stats["grad_norm"])
      seconds = time.perf_counter() - start
      if not (np.isfinite(value) and np.isfinite(norm)):
        shown = ", ".join(where[:8]) + (f" and {len(where) - 8} more" if len(where) > 8 else "")
        raise FloatingPointError(
          f"step {step}: loss {value}, gradient norm {norm}; stopped without saving (the last state is "
          f"step {state.latest() or 0}); the batch's examples: {shown}"
        )
      seg = arrays.get("segment_ids")
      real = int(np.sum(seg >= 0)) if seg is not None else int(arrays["tokens"].size)
      entry = dict(step=step, **objective.record(arrays, value, jax.device_get(out_stats)))
      entry.update(
        grad_norm=norm,
        lr=float(schedule(step)),
        tokens=real,
        padding=round(1.0 - real / arrays["tokens"].size, 6),
        tokens_per_s=round(arrays["tokens"].size / seconds, 1),
        seconds=round(seconds, 3),
      )
      log.log(entry)
      history.append(entry)
      if progress:
        steps.set_postfix(loss=f"{value:.4f}", s=f"{seconds:.1f}")
      done = step + 1
      if config.eval_every and done % config.eval_every == 0 and done < config.steps:
        evaluate(step)
      if "signal" in stop:
        save(done)
        report["interrupted"] = signal.Signals(stop["signal"]).name
        return report
      if config.save_every and done % config.save_every == 0 and done < config.steps:
        save(done)
    evaluate(config.steps - 1)
    save(config.steps)
    report.pop("interrupted", None)
  finally:
    log.close()
    state.close()
  # The AdamW moments are in state/ now; the export below needs only the weights. Freed,
  # they no longer sit beside its host copy of the weights (Gemma 3 270M on 8 devices:
  # the run's peak resident memory was the export's, 2 GiB of moments included).
  trainer.opt_state = None
  tuned = trainer.model()
  if jax.process_count() > 1:  # every process gathers the weights; the first writes them
    from jax.experimental import multihost_utils

    nnx.update(tuned, multihost_utils.process_allgather(nnx.state(tuned, nnx.Param), tiled=True))
  if main and adapters:
    _whole(os.path.join(out, "adapter"), lambda folder: lora.save_lora(tuned, folder))
  if adapters and merge:
    lora.merge_lora(tuned)
  if main and (merge or not adapters):
    _whole(os.path.join(out, "checkpoint"), lambda f: checkpoints.save(tuned, f, tokenizer=tokenizer))
    with open(report_path, "w") as f:
      json.dump(report, f, indent=1)
  return report


def _bound_documents(model, *loaders, auto: bool = False) -> int | str | None:
  """The longest document of the packed rows (`pipeline.Loader.longest_document`, over
  the training and evaluation rows), given to the model's ring as the bound of its passes
  (`jax_ring.nn.set_document_bound`): exact, since no row holds a longer one; with
  `auto`, "auto" (each batch's passes read from its ids while running). None where the
  rows are not packed documents or the model runs no ring."""
  longest = [getattr(loader, "longest_document", None) for loader in loaders if loader is not None]
  if not longest or None in longest:
    return None
  bound = "auto" if auto else max(longest)
  return bound if ring_nn.set_document_bound(model, bound) else None


def _whole(folder, write) -> None:
  """`write(path)` into `folder` + ".part", then renamed to `folder` (an older one
  replaced): a folder that is there is complete, whatever stopped the run."""
  import shutil

  part = folder + ".part"
  shutil.rmtree(part, ignore_errors=True)
  write(part)
  if os.path.isdir(folder):
    old = folder + ".old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    os.replace(part, folder)
    shutil.rmtree(old)
  else:
    os.replace(part, folder)


def _cache_path(folder, record, config, objective):
  """Where an objective keeps what it computes once for a loader's rows (`dpo`'s
  reference log-probabilities): a file named by the rows' tokens and documents, the
  row length, the model's record (`base_record`) and the objective's reference."""

  def path(loader):
    from pathlib import Path

    h = hashlib.sha256()
    for ids, _ in loader.packed:
      h.update(np.asarray(ids, np.int32).tobytes())
    key = [loader.docs, loader.length, loader.batch, config.chunk, record, objective.reference_key]
    h.update(json.dumps(key, default=str).encode())
    return Path(folder) / f"{objective.name}-{h.hexdigest()[:24]}.npz"

  return path


def _once(loader):
  """Every batch of an evaluation loader (`shuffle=False`), from its start."""
  loader.rewind()
  return list(loader)


def _write_data_state(out, step, value) -> None:
  path = os.path.join(out, DATA_STATE)
  with open(path + ".part", "w") as f:
    json.dump({"step": step, "state": value}, f)
  os.replace(path + ".part", path)


def _data_state(out, step, data):
  """The loader's state saved at `step` (`out/data_state.json`)."""
  path = os.path.join(out, DATA_STATE)
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved.get("step") == step:
      return saved["state"]
  raise ValueError(
    f"{out}/state/ is at step {step} but {out}/{DATA_STATE} does not hold the data's place there: "
    "the run cannot continue its data exactly (remove state/ or pass another --out)"
  )
