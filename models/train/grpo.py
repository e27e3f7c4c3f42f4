"""Group relative policy optimization (Shao et al., 2024, DeepSeekMath) as TRL 1.x's
GRPOTrainer defines it, with rollouts sampled by the generation engine over the ring
and scored over the ring in packed rows: an objective of the training loop
(`objective.Objective`'s interface).

A step's prompts (`Prompts`: `batch` of them) are each continued `num_generations` (G)
times by `generate.generate` (the sequence-sharded KV cache; temperature, top-k,
top-p), which also gives each sampled token's log-probability. The reward functions
score the completions; the advantages are normalized per group of G
(`group_advantages`). Each completion with its prompt is a document of packed rows
(`packing`), so that long and short completions share rows, and the step's loss
(`policy_loss`) is TRL's on each completion token t of completion i, with the policy's
log-probability p (the logits over the temperature), the sampler's o and the reference's
r:

    ratio  = exp(p - o),  clipped to [1 - epsilon, 1 + epsilon_high]
    loss_t = -min(ratio A_i, clipped A_i) + beta (exp(r - p) - (r - p) - 1)

    grpo     mean over completions of (sum over its tokens) / its token count
    bnpo     sum over all tokens / the step's token count
    dapo     the same within one step (TRL's count over the whole generation batch)
    dr_grpo  sum over all tokens / (completions x max_completion_length)

The old log-probabilities o are the sampler's, kept from sampling for all
`num_iterations` (TRL's mu) steps on the same rollouts: the sampler and the trainer run
one model's code, and at the first iteration they agree (within float32's rounding,
reported as TRL's "sampling/sampling_logp_difference/mean" and "/max"), so the ratio is
1 there. The reference (beta > 0) is the initial weights (with adapters, the base with
the adapters off), its per-token log-probabilities computed once per rollout.

Legend: N completions a step (batch x G), R rows, T row length, P the longest prompt,
C max_completion_length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..data import chat, packing, pipeline, sources
from . import step
from .objective import Objective, StopRun

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
# End-of-turn tokens that end a completion beside EOS (the families' generation_config.json
# lists them): Llama 3's <|eot_id|> and <|eom_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>,
# Phi-3's <|end|>.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")
ROLLOUTS = "rollouts.jsonl"
BUFFER = "grpo_rollout"  # beside state/: the rollout a resumed run's next iterations reuse


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  num_generations: int = 8
  max_completion_length: int = 256
  temperature: float = 1.0
  top_p: float | None = None
  top_k: int | None = None
  beta: float = 0.0
  epsilon: float = 0.2
  epsilon_high: float | None = None  # None: epsilon
  loss_type: str = "dapo"
  scale_rewards: str = "group"
  num_iterations: int = 1
  reward_weights: tuple | None = None  # None: 1 for every function

  def __post_init__(self):
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if not whole(self.num_generations) or self.num_generations < 2:
      raise ValueError(
        f"num_generations={self.num_generations!r}: at least 2 (a group's advantages compare its completions)"
      )
    if not whole(self.max_completion_length) or self.max_completion_length < 1:
      raise ValueError(f"max_completion_length={self.max_completion_length!r}: a positive int")
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or (
      self.temperature <= 0
    ):
      raise ValueError(
        f"temperature={self.temperature!r}: a positive number (the policy's log-probabilities are "
        "those of the logits over it)"
      )
    if self.loss_type not in LOSS_TYPES:
      raise ValueError(f"loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}")
    if self.scale_rewards not in SCALES:
      raise ValueError(f"scale_rewards={self.scale_rewards!r}: expected one of {SCALES}")
    if not (isinstance(self.beta, (int, float)) and self.beta >= 0):
      raise ValueError(f"beta={self.beta!r}: a number >= 0")
    if not (isinstance(self.epsilon, (int, float)) and 0 < self.epsilon < 1):
      raise ValueError(f"epsilon={self.epsilon!r}: in (0, 1)")
    if self.epsilon_high is not None and not (
      isinstance(self.epsilon_high, (int, float)) and self.epsilon_high > 0
    ):
      raise ValueError(f"epsilon_high={self.epsilon_high!r}: a positive number or None")
    if not whole(self.num_iterations) or self.num_iterations < 1:
      raise ValueError(f"num_iterations={self.num_iterations!r}: a positive int")

  @property
  def high(self) -> float:
    return self.epsilon if self.epsilon_high is None else self.epsilon_high


# --- Advantages and the loss, as TRL defines them. ---


def _nanstd(x, axis=None):
  """TRL's `nanstd`: Bessel-corrected over the values that are not NaN (NaN for fewer
  than two)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.nanstd(x, axis=axis, ddof=1)


def group_advantages(per_function, weights, num_generations: int, scale: str = "group") -> dict:
  """TRL's advantages (its "sum_then_normalize") from each function's rewards
  [N, F] (NaN: None, not scored), float64: "rewards" [N] (the weighted sum; NaN where no
  function scored), "advantages" [N] (each minus its group's mean, over the group's or
  the batch's standard deviation + 1e-4 unless `scale` is "none"; 0 where not scored),
  "std" [N] and "zero_std" [N] (the deviation used, and where it is 0)."""
  per_function = np.asarray(per_function, np.float64)
  n, _ = per_function.shape
  if n % num_generations:
    raise ValueError(f"{n} completions are not groups of num_generations={num_generations}")
  unscorable = np.isnan(per_function).all(axis=1)
  rewards = np.nansum(per_function * np.asarray(weights, np.float64)[None, :], axis=1)
  rewards[unscorable] = np.nan
  grouped = rewards.reshape(-1, num_generations)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    mean = np.repeat(np.nanmean(grouped, axis=1), num_generations)
  if scale in ("group", "none"):
    std = np.repeat(_nanstd(grouped, axis=1), num_generations)
  elif scale == "batch":
    std = np.full(n, _nanstd(rewards) if n > 1 else 0.0)
  else:
    raise ValueError(f"scale={scale!r}: expected one of {SCALES}")
  advantages = rewards - mean
  if scale != "none":
    advantages = advantages / (std + 1e-4)
  return dict(
    rewards=rewards,
    advantages=np.nan_to_num(advantages, nan=0.0),
    std=std,
    zero_std=np.isclose(std, 0.0),
  )


def policy_loss(
  logps, old, advantages, mask, completion, config: GRPOConfig, completions: int, reference=None
):
  """TRL's GRPO loss and statistics from per-token arrays [R, T] (any layout: each
  completion's tokens wherever they are): the policy's log-probabilities `logps`, the
  old ones `old`, each token's completion's advantage, `mask` (1 on completion tokens),
  `completion` (the completion each token belongs to, in [0, completions); -1
  elsewhere) and, with beta > 0, the reference's log-probabilities. Returns (loss,
  stats): "kl" (beta > 0), "clip_ratio/low_mean", "/high_mean", "/region_mean" (means
  over the completion tokens), and the log-ratio's mean and largest size there."""
  mask = mask.astype(jnp.float32)
  log_ratio = logps - old
  coef = jnp.exp(log_ratio)
  clipped = jnp.clip(coef, 1 - config.epsilon, 1 + config.high)
  per = -jnp.minimum(coef * advantages, clipped * advantages)
  stats = {}
  count = jnp.maximum(jnp.sum(mask), 1.0)
  mean = lambda x: jnp.sum(x * mask) / count
  if config.beta:
    d = reference - logps
    kl = jnp.exp(d) - d - 1
    per = per + config.beta * kl
    stats["kl"] = jax.lax.stop_gradient(mean(kl))
  total = jnp.sum(per * mask)
  match config.loss_type:
    case "grpo":
      ids = jnp.where(completion >= 0, completion, completions).reshape(-1)
      sums = jax.ops.segment_sum((per * mask).reshape(-1), ids, num_segments=completions + 1)[:-1]
      counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=completions + 1)[:-1]
      value = jnp.mean(sums / jnp.maximum(counts, 1.0))
    case "bnpo" | "dapo":
      value = total / count
    case "dr_grpo":
      value = total / (completions * config.max_completion_length)
    case _:
      raise ValueError(f"loss_type={config.loss_type!r}: expected one of {LOSS_TYPES}")
  stop = jax.lax.stop_gradient
  low = (stop(coef) < 1 - config.epsilon) & (advantages < 0)
  high = (stop(coef) > 1 + config.high) & (advantages > 0)
  f = lambda b: b.astype(jnp.float32)
  size = jnp.abs(stop(log_ratio)) * mask
  stats.update({
    "clip_ratio/low_mean": mean(f(low)),
    "clip_ratio/high_mean": mean(f(high)),
    "clip_ratio/region_mean": mean(f(low | high)),
    "log_ratio/mean": jnp.sum(size) / count,
    "log_ratio/max": jnp.max(size),
  })  # fmt: skip
  return value, stats


# --- Prompts. ---


@dataclasses.dataclass(frozen=True)
class Prompt:
  ids: np.ndarray  # int32: what the model reads before its completion
  value: object  # the record's prompt as given (a string, or messages)
  text: str  # the prompt as the model reads it (a conversation rendered)
  conversational: bool
  columns: dict  # the record's other columns, for the reward functions


def read_prompts(path, tokenizer, *, columns=None, chat_template=None, skip_bad=False):
  """(prompts, where, skipped) of the records at `path` (`sources.lazy_records`): a
  "prompt" column (after `columns`' renaming, {"prompt": the file's name}) holding a
  string (read after the tokenizer's prefix, as TRL tokenizes it) or messages (rendered
  by the chat template with its generation prompt); the other columns kept for the
  reward functions. A bad record is a BadRecord naming its file and line (skipped with
  `skip_bad`)."""
  columns = dict(columns or {})
  prompts, where, skipped = [], [], []
  for at, parse in sources.lazy_records(path):
    try:
      record = parse()
      if isinstance(record, sources.BadRecord):
        raise record
      if not isinstance(record, dict):
        raise sources.BadRecord(at, f"a record is an object of columns, not a {type(record).__name__}")
      record = dict(record)
      for name, source in columns.items():
        if source in record:
          record[name] = record.pop(source)
      if "prompt" not in record:
        raise sources.BadRecord(
          at, f"no 'prompt' column (it has {sorted(record)}); --columns prompt=NAME names it"
        )
      value = record.pop("prompt")
      if isinstance(value, str):
        if not value.strip():
          raise sources.BadRecord(at, "'prompt' is empty")
        ids = list(tokenizer.prefix()) + tokenizer.encode(value)
        text, conversational = value, False
      elif isinstance(value, list) and value:
        sources._check_messages(at, "prompt", value)
        ids = chat.tokenize_chat(
          tokenizer, value, add_generation_prompt=True, chat_template=chat_template, assistant_mask=False
        )
        text, conversational = tokenizer.decode(ids), True
      else:
        raise sources.BadRecord(
          at, f"'prompt' must be a string or a non-empty list of messages, not {value!r:.60}"
        )
      prompts.append(Prompt(np.asarray(ids, np.int32), value, text, conversational, record))
      where.append(at)
    except sources.BadRecord as e:
      if not skip_bad:
        raise
      skipped.append(str(e))
  if not prompts:
    raise ValueError(
      f"{str(path)!r}: no usable prompts" + (f" ({len(skipped)} bad ones skipped)" if skipped else "")
    )
  return prompts, where, skipped


def row_length(longest_prompt: int, config: GRPOConfig, context: int) -> int:
  """The default row: a group's G documents of the longest prompt and completion, in a
  multiple of 128 tokens, within the model's context (at least one document)."""
  doc = longest_prompt + config.max_completion_length
  fits = max(1, min(config.num_generations, context // doc))
  return min(-(-fits * doc // 128) * 128, max(doc, context))


class Prompts:
  """A step's prompts, `batch` of them, visited in an order shuffled by `seed` anew each
  epoch, each prompt for `num_iterations` steps in a row (TRL's mu: the rollouts of the
  step that sampled them serve the next mu - 1 steps too). The loader's interface
  (`pipeline.Loader`): next() -> ({"step", "prompts": indices}, sources), state() /
  restore(). `length`: the rows' tokens (None: `row_length`); `rows_per_step` of them
  hold every step's N documents of prompt and completion however long they come out."""

  def __init__(
    self, prompts, where, skipped, tokenizer, config: GRPOConfig, *, batch: int = 1, length=None,
    seed: int = 0, context: int | None = None,
  ):  # fmt: skip
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
      raise ValueError(f"batch={batch!r} must be a positive int (prompts a step)")
    self.prompts, self.where, self.config, self.batch, self.seed = prompts, where, config, batch, seed
    self.longest_prompt = max(len(p.ids) for p in prompts)
    doc = self.longest_prompt + config.max_completion_length
    if length is None:
      length = row_length(self.longest_prompt, config, context or doc)
    if length < doc:
      raise ValueError(
        f"length={length}: the longest prompt ({self.longest_prompt} tokens) and a completion of up to "
        f"max_completion_length={config.max_completion_length} need rows of at least {doc} tokens"
      )
    self.length = int(length)
    self.completions = batch * config.num_generations
    self.rows_per_step = -(-self.completions // (self.length // doc))
    self.longest_document = doc
    self.pad_id = int(tokenizer.pad_id or 0)
    masks = [np.zeros(len(p.ids), np.float32) for p in prompts]
    self.examples = pipeline.Examples([p.ids for p in prompts], masks, list(where), "prompt", list(skipped))
    self.rows, self.dropped = list(range(len(prompts))), []
    self.step = 0
    # For a resume's check (`finetune.data_record`): what else makes a step's rows.
    self.settings = dict(
      num_generations=config.num_generations,
      max_completion_length=config.max_completion_length,
      num_iterations=config.num_iterations,
    )

  def summary(self) -> dict:
    """The prompts' statistics for a run's report."""
    return dict(
      examples=len(self.prompts),
      longest_prompt=self.longest_prompt,
      rows_per_step=self.rows_per_step,
      row_length=self.length,
      skipped_records=len(self.examples.skipped),
      format="prompt",
    )

  def indices(self, step: int) -> list[int]:
    """The prompts of `step`."""
    n = len(self.prompts)
    out = []
    for q in range(
      (step // self.config.num_iterations) * self.batch, (step // self.config.num_iterations + 1) * self.batch
    ):
      order = np.random.default_rng([self.seed, q // n]).permutation(n)
      out.append(int(order[q % n]))
    return out

  def __iter__(self):
    return self

  def __next__(self):
    step, self.step = self.step, self.step + 1
    idx = self.indices(step)
    return dict(step=np.int64(step), prompts=np.asarray(idx, np.int64)), [self.where[i] for i in idx]

  def state(self) -> dict:
    return {"step": self.step}

  def restore(self, state: dict) -> None:
    self.step = int(state["step"])


def stop_ids(tokenizer) -> list[int]:
  """EOS and the vocabulary's end-of-turn tokens (`END_OF_TURN`)."""
  out = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
  special = getattr(tokenizer, "special_ids", {}) or {}
  return sorted(set(out) | {int(special[t]) for t in END_OF_TURN if t in special})


# --- The objective. ---


def _token_measure(temperature):
  def run(model, tokens, targets, weights, *, chunk=512, **rows):
    rows = {k: v for k, v in rows.items() if k in ("segment_ids", "positions")}
    return step.token_logps(model, tokens, targets, chunk=chunk, temperature=temperature, **rows)[0], {}

  return run


class GRPO(Objective):
  """GRPO as an objective of the training loop. `rewards`: (name, function) pairs,
  each called as TRL calls its reward functions, f(prompts=..., completions=...,
  completion_ids=..., **the records' other columns) -> a float or None a completion;
  `seed`: the sampling keys' (step k samples with fold_in(key(seed), k))."""

  name = "grpo"

  def __init__(self, config: GRPOConfig, rewards, tokenizer, *, seed: int = 0, reference_dtype=None):
    if not rewards:
      raise ValueError("rewards: at least one (name, function) pair")
    for name, fn in rewards:
      if not callable(fn):
        raise TypeError(f"reward {name!r} is a {type(fn).__name__}, not a function")
    weights = config.reward_weights or (1.0,) * len(rewards)
    if len(weights) != len(rewards):
      raise ValueError(
        f"reward_weights={list(weights)}: one weight for each of the {len(rewards)} reward functions"
      )
    self.config, self.rewards, self.weights = config, list(rewards), np.asarray(weights, np.float64)
    self.tokenizer, self.seed, self.reference_dtype = tokenizer, int(seed), reference_dtype
    self.out, self._buffer, self._iteration, self._ref = None, None, 0, None

  def setup(self, trainer, data, eval_data, *, place=None, cache=None) -> None:
    if eval_data is not None:
      raise ValueError(
        "grpo has no evaluation of held-out prompts: leave out --eval-data and --eval-fraction"
      )
    if not isinstance(data, Prompts):
      raise ValueError("grpo takes prompts (`grpo.Prompts`, --data with a 'prompt' column)")
    self.trainer, self.place, self.data = trainer, place, data
    self.completions = data.completions
    self.stop = stop_ids(self.tokenizer)
    if self.config.beta:
      measure = _token_measure
      adapters = bool(jax.tree.leaves(nnx.filter_state(trainer.params, nnx.LoRAParam)))
      from . import dpo

      if adapters:
        self._ref = dpo.Reference.adapters_off(trainer, measure=measure)
      else:
        self._ref = dpo.Reference.initial(trainer, self.reference_dtype, measure=measure)

  # The step's arrays: tokens, targets, weights, segment_ids, positions, and per token
  # "old" (the sampler's log-probability), "advantages", "completion" and "reference".

  def probe(self, arrays: dict) -> dict:
    r, t = self.data.rows_per_step, self.data.length
    zeros = lambda dtype: np.zeros((r, t), dtype)
    out = dict(
      tokens=zeros(np.int32), targets=zeros(np.int32), weights=zeros(np.float32),
      segment_ids=zeros(np.int32) - 1, positions=zeros(np.int32), old=zeros(np.float32),
      advantages=zeros(np.float32), completion=zeros(np.int32) - 1,
    )  # fmt: skip
    if self.config.beta:
      out["reference"] = zeros(np.float32)
    return out

  def prepare(self, arrays: dict) -> dict:
    k = int(arrays["step"])
    first = k - k % self.config.num_iterations
    if self._buffer is None or self._buffer["step"] != first:
      if k != first:
        raise ValueError(
          f"step {k} reuses the rollouts sampled at step {first}, which are not kept here "
          f"({self.out}/{BUFFER}.npz): the run cannot continue them exactly"
        )
      self._buffer = self._rollout(first, [int(i) for i in arrays["prompts"]])
    self._iteration = k - first
    self._prepared_at = time.perf_counter()
    return dict(self._buffer["arrays"])

  def _score(self, name, fn, prompts, completions, ids, columns):
    """One reward function's values [N] (None: NaN); StopRun naming the function and the
    first prompt it raises on."""
    call = lambda sl: fn(
      prompts=prompts[sl], completions=completions[sl], completion_ids=ids[sl],
      **{c: v[sl] for c, v in columns.items()},
    )  # fmt: skip
    try:
      got = call(slice(None))
    except Exception as e:  # noqa: BLE001 - any error of the user's function stops the run, named
      bad = 0
      for i in range(len(prompts)):  # which completion it fails on, alone
        try:
          call(slice(i, i + 1))
        except Exception:  # noqa: BLE001
          bad = i
          break
      where = self._where[bad]
      raise StopRun(
        f"reward function {name} raised {type(e).__name__}: {e} (on the prompt of {where}: "
        f"{str(prompts[bad])!r:.80}); the state is saved at this step"
      ) from None
    if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != len(prompts):
      raise StopRun(
        f"reward function {name} returned {type(got).__name__}"
        + (f" of {len(got)} values" if hasattr(got, "__len__") else "")
        + f" for {len(prompts)} completions: a list of a float or None each"
      )
    out = np.full(len(prompts), np.nan)
    for i, v in enumerate(got):
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise StopRun(
          f"reward function {name} gave {v!r} for a completion of {self._where[i]}: a float or None"
        )
      out[i] = float(v)
    return out

  def _rollout(self, step_index: int, indices: list[int]) -> dict:
    from ..generate import generate

    start = time.perf_counter()
    cfg, data, g = self.config, self.data, self.config.num_generations
    prompts = [data.prompts[i] for i in indices for _ in range(g)]
    index = [i for i in indices for _ in range(g)]
    self._where = [data.where[i] for i in index]
    n, p = len(prompts), data.longest_prompt
    padded = np.full((n, p), data.pad_id, np.int32)
    lengths = np.asarray([len(x.ids) for x in prompts], np.int32)
    for row, x in enumerate(prompts):
      padded[row, : len(x.ids)] = x.ids
    model = self.trainer.model()
    rng = jax.random.fold_in(jax.random.key(self.seed), step_index)
    out = generate(
      model, padded, prompt_lengths=lengths, max_new_tokens=cfg.max_completion_length,
      temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop_tokens=self.stop, rng=rng,
      pad_token=data.pad_id, logprobs=True,
    )  # fmt: skip
    tokens, counts, sampled = (np.asarray(jax.device_get(a)) for a in out)
    del model, out
    ids = [tokens[i, : counts[i]].astype(np.int32) for i in range(n)]
    decode = self.tokenizer.to_tokenizers().decode
    texts = [decode([int(t) for t in c], skip_special_tokens=True) for c in ids]
    completions = [
      [{"role": "assistant", "content": t}] if x.conversational else t for x, t in zip(prompts, texts)
    ]
    values = [x.value for x in prompts]
    names = sorted({c for x in prompts for c in x.columns})
    columns = {c: [x.columns.get(c) for x in prompts] for c in names}
    id_lists = [c.tolist() for c in ids]
    per_function = np.stack(
      [self._score(name, fn, values, completions, id_lists, columns) for name, fn in self.rewards], axis=1
    )
    scored = group_advantages(per_function, self.weights, g, cfg.scale_rewards)
    sampling_seconds = time.perf_counter() - start
    arrays = self._rows(prompts, ids, sampled, scored["advantages"])
    if self._ref is not None:
      arrays["reference"] = self._ref(arrays, cfg.temperature, self.place).astype(np.float32)
    truncated = np.asarray([len(c) == 0 or int(c[-1]) not in self.stop for c in ids])
    sizes = np.asarray([len(c) for c in ids], np.float64)
    rewards = scored["rewards"]
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      metrics = {
        "reward": _finite(np.nanmean(rewards)),
        "reward_std": _finite(_nanstd(rewards)),
        "frac_reward_zero_std": float(np.mean(scored["zero_std"])),
        "completions/mean_length": float(sizes.mean()),
        "completions/min_length": float(sizes.min()),
        "completions/max_length": float(sizes.max()),
        "completions/clipped_ratio": float(truncated.mean()),
        "completions/mean_terminated_length": float(sizes[~truncated].mean()) if (~truncated).any() else 0.0,
      }
      for f, (name, _) in enumerate(self.rewards):
        metrics[f"rewards/{name}/mean"] = _finite(np.nanmean(per_function[:, f]))
        metrics[f"rewards/{name}/std"] = _finite(_nanstd(per_function[:, f]))
    lines = [
      dict(
        step=step_index,
        prompt_index=index[i],
        prompt=prompts[i].text,
        completion=texts[i],
        completion_ids=id_lists[i],
        rewards={name: _finite(per_function[i, f]) for f, (name, _) in enumerate(self.rewards)},
        reward=_finite(rewards[i]),
        advantage=float(scored["advantages"][i]),
      )
      for i in range(n)
    ]
    return dict(
      step=step_index, arrays=arrays, metrics=metrics, lines=lines, sampling_seconds=sampling_seconds
    )

  def _rows(self, prompts, ids, sampled, advantages) -> dict:
    """The step's packed rows of the N documents (prompt, completion), with per token the
    sampler's log-probability, the advantage and the completion's number on the
    positions that predict a completion token."""
    data = self.data
    docs = [
      (
        np.concatenate([x.ids, c]).astype(np.int32),
        np.r_[np.zeros(len(x.ids)), np.ones(len(c))].astype(np.float32),
      )
      for x, c in zip(prompts, ids)
    ]
    plan, dropped = packing.plan([len(d[0]) for d in docs], data.length, long="drop")
    if dropped or len(plan) > data.rows_per_step:
      raise AssertionError(
        f"{len(plan)} rows (dropped {dropped}) for {data.rows_per_step}"
      )  # `Prompts`' bound
    rows = [packing.fill(r, docs, data.length, pad_id=data.pad_id) for r in plan]
    rows += [packing.fill([], docs, data.length, pad_id=data.pad_id)] * (data.rows_per_step - len(rows))
    arrays = pipeline.batch_arrays({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    shape = arrays["tokens"].shape
    old, adv = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    which = np.full(shape, -1, np.int32)
    for r, pieces in enumerate(plan):
      at = 0
      for piece in pieces:
        e = piece.example
        p, c = len(prompts[e].ids), len(ids[e])
        where = slice(at + p - 1, at + p - 1 + c)  # position i predicts token i + 1
        old[r, where] = sampled[e, :c]
        adv[r, where] = advantages[e]
        which[r, where] = e
        at += p + c
    if not np.array_equal(which >= 0, arrays["weights"] > 0):
      raise AssertionError("the completion tokens and the loss weights disagree")
    return dict(arrays, old=old, advantages=adv, completion=which)

  @classmethod
  def compiled(cls, completions: int, config: GRPOConfig = GRPOConfig(beta=0.04)):
    """The objective of a step compiled without data or rewards (`scripts/aot.py
    --objective grpo`): `completions` a step."""
    out = cls.__new__(cls)
    out.config, out.completions = config, completions
    return out

  def rows(self, batch: int, seq_len: int, rows, whole) -> dict:
    """The step's further inputs, abstract, for `step.compile_train_step`: the packed
    rows' segment ids and positions, and per token the old log-probabilities, the
    advantages, the completions' numbers and (beta > 0) the reference's."""
    shape = lambda dtype: jax.ShapeDtypeStruct((batch, seq_len), dtype, sharding=rows)
    out = dict(
      segment_ids=shape(jnp.int32), positions=shape(jnp.int32), old=shape(jnp.float32),
      advantages=shape(jnp.float32), completion=shape(jnp.int32),
    )  # fmt: skip
    if self.config.beta:
      out["reference"] = shape(jnp.float32)
    return out

  def loss(self, model, tokens, targets, weights, *, chunk: int = 512, old=None, advantages=None,
           completion=None, reference=None, segment_ids=None, positions=None):  # fmt: skip
    logps, entropy = step.token_logps(
      model, tokens, targets, chunk=chunk, temperature=self.config.temperature, entropy=True,
      segment_ids=segment_ids, positions=positions,
    )  # fmt: skip
    value, stats = policy_loss(
      logps, old, advantages, weights, completion, self.config, self.completions, reference
    )
    mask = (weights > 0).astype(jnp.float32)
    stats["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    return value, stats

  def record(self, arrays: dict, value: float, stats: dict) -> dict:
    buffer = self._buffer
    out = dict(loss=value, completions=len(buffer["lines"]), loss_tokens=int(np.sum(arrays["weights"] > 0)))
    out.update(buffer["metrics"])
    out["kl"] = float(stats["kl"]) if "kl" in stats else None  # no reference with beta 0
    out["entropy"] = float(stats["entropy"])
    for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
      out[k] = float(stats[k])
    out["iteration"] = self._iteration
    if self._iteration == 0:  # the policy is the sampler's: their log-probabilities agree
      out["sampling/sampling_logp_difference/mean"] = float(stats["log_ratio/mean"])
      out["sampling/sampling_logp_difference/max"] = float(stats["log_ratio/max"])
      if self.out is not None and jax.process_index() == 0:
        with open(os.path.join(self.out, ROLLOUTS), "a", encoding="utf-8") as f:
          f.writelines(json.dumps(line) + "\n" for line in buffer["lines"])
    else:
      out["log_ratio/max"] = float(stats["log_ratio/max"])
    out["seconds/sampling"] = round(buffer["sampling_seconds"], 3) if self._iteration == 0 else 0.0
    out["seconds/training"] = round(time.perf_counter() - self._prepared_at, 3)
    return out

  def evaluate(self, results) -> dict:
    raise ValueError("grpo has no evaluation of held-out prompts")

  def resume(self, out: str, step_index: int) -> None:
    """rollouts.jsonl cut back to the steps before `step_index`, and the rollout that
    step's iteration reuses read back."""
    self.out = out
    path = os.path.join(out, ROLLOUTS)
    if jax.process_index() == 0:
      kept = []
      if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
          for line in f:
            try:
              record = json.loads(line)
            except json.JSONDecodeError:
              break
            if record["step"] < step_index:
              kept.append(line if line.endswith("\n") else line + "\n")
      with open(path + ".part", "w", encoding="utf-8") as f:
        f.writelines(kept)
      os.replace(path + ".part", path)
    if step_index % self.config.num_iterations:
      self._buffer = _read_buffer(
        os.path.join(out, BUFFER), step_index - step_index % self.config.num_iterations
      )

  def save(self, out: str, step_index: int) -> None:
    """The rollout the next steps reuse (mid-way through its iterations), beside the state."""
    path = os.path.join(out, BUFFER)
    if step_index % self.config.num_iterations and self._buffer is not None:
      _write_buffer(path, self._buffer)
    else:
      for suffix in (".npz", ".json"):
        if os.path.exists(path + suffix):
          os.remove(path + suffix)


def _finite(x) -> float | None:
  x = float(x)
  return x if math.isfinite(x) else None


def _write_buffer(path, buffer) -> None:
  np.savez(path + ".part.npz", **buffer["arrays"])
  os.replace(path + ".part.npz", path + ".npz")
  meta = {k: buffer[k] for k in ("step", "metrics", "lines", "sampling_seconds")}
  with open(path + ".part.json", "w", encoding="utf-8") as f:
    json.dump(meta, f)
  os.replace(path + ".part.json", path + ".json")


def _read_buffer(path, step_index: int) -> dict | None:
  if not (os.path.exists(path + ".npz") and os.path.exists(path + ".json")):
    return None
  with open(path + ".json", encoding="utf-8") as f:
    meta = json.load(f)
  if meta["step"] != step_index:
    return None
  with np.load(path + ".npz") as z:
    arrays = {k: z[k] for k in z.files}
  return dict(meta, arrays=arrays)
