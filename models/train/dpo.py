"""Direct preference optimization (Rafailov et al., 2023) as TRL 1.x's DPOTrainer defines
it, over packed pairs on the ring: an objective of the training loop
(`objective.Supervised`'s interface).

Each row holds whole pairs, a pair's chosen then rejected sequence each a document of
its own (`data.preference`): segment k + 1 of a row is its slot k, pair k // 2, chosen
where k is even. A sequence's log-probability is the sum over its completion's tokens
(the weighted targets) of log p(token | the tokens before it in its document), from one
pass of the model over the packed row (`step.loss` with groups). With policy and
reference log-probabilities pi and r, and the completions' token counts n:

    delta = (pi_chosen - r_chosen) - (pi_rejected - r_rejected)
    sigmoid  -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta)
    hinge    max(0, 1 - beta delta)
    ipo      ((pi_c - r_c) / n_c - (pi_r - r_r) / n_r - 1 / (2 beta))^2

each pair's loss averaged over the step's pairs. e is `label_smoothing` (the
conservative DPO of TRL before 1.0; TRL 1.x's sigmoid is e = 0). The metrics are TRL's,
means over the step's pairs: rewards/chosen beta (pi_c - r_c), rewards/rejected,
rewards/margins their difference, rewards/accuracies the fraction with chosen's reward
above rejected's, logps/chosen pi_c, logps/rejected pi_r.

The reference (`Reference`) is by default the initial weights: with adapters, the same
model with every adapter's matrices zero (the base, bit for bit: no second copy); without,
a frozen copy of the initial weights. It may also be another model (TRL's `ref_model`).
Its log-probabilities come to the step as the batch's "reference" [B, slots], computed
just before it, or once for all rows before training (`precompute`).

Legend: B batch, T sequence length, S slots (documents) a row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import step
from .objective import Objective

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
METRICS = (
  "rewards/chosen",
  "rewards/rejected",
  "rewards/margins",
  "rewards/accuracies",
  "logps/chosen",
  "logps/rejected",
)


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  loss_type: str = "sigmoid"
  beta: float = 0.1
  label_smoothing: float = 0.0

  def __post_init__(self):
    if self.loss_type not in LOSS_TYPES:
      raise ValueError(f"loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}")
    if not (isinstance(self.beta, (int, float)) and self.beta > 0):
      raise ValueError(f"beta={self.beta!r}: a positive number")
    if not 0.0 <= self.label_smoothing < 0.5:
      raise ValueError(f"label_smoothing={self.label_smoothing!r}: in [0, 0.5)")
    if self.label_smoothing and self.loss_type != "sigmoid":
      raise ValueError(f"label_smoothing={self.label_smoothing} applies to loss_type 'sigmoid' alone")


def sequence_logps(model, tokens, targets, weights, *, slots: int, chunk: int = 512, **rows):
  """(log-probabilities [B, S], weighted token counts [B, S]) of each packed document:
  segment k + 1's in slot k (`rows["segment_ids"]`, padding -1 in none)."""
  ids = rows["segment_ids"] - 1
  nll, counts = step.loss(model, tokens, targets, weights, chunk=chunk, groups=slots, group_ids=ids, **rows)
  return -nll, counts


def pair_losses(policy, reference, counts, config: DPOConfig):
  """Each pair's loss and the rewards [B, P] from the slots' log-probabilities
  [B, 2P] of the policy and the reference and their completions' token counts."""
  pi_c, pi_r = policy[:, 0::2], policy[:, 1::2]
  ref_c, ref_r = reference[:, 0::2], reference[:, 1::2]
  ratio_c, ratio_r = pi_c - ref_c, pi_r - ref_r
  delta = ratio_c - ratio_r
  beta = config.beta
  match config.loss_type:
    case "sigmoid":
      e = config.label_smoothing
      per = -(1 - e) * jax.nn.log_sigmoid(beta * delta) - e * jax.nn.log_sigmoid(-beta * delta)
    case "hinge":
      per = jax.nn.relu(1 - beta * delta)
    case "ipo":
      n_c, n_r = jnp.maximum(counts[:, 0::2], 1.0), jnp.maximum(counts[:, 1::2], 1.0)
      per = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    case _:
      raise ValueError(f"Unsupported loss_type {config.loss_type!r}")
  return per, beta * ratio_c, beta * ratio_r


def compiled_rows(batch: int, seq_len: int, rows, whole) -> dict:
  """DPO's further step inputs, abstract, for `step.compile_train_step`: each row one
  pair (its two sequences, seq_len / 2 tokens each, two documents), its segment ids and
  positions split as the tokens (`rows`), and the two reference log-probabilities
  (`whole`)."""
  return dict(
    segment_ids=jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows),
    positions=jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows),
    reference=jax.ShapeDtypeStruct((batch, 2), jnp.float32, sharding=whole),
  )


class Reference:
  """The reference model's log-probabilities of a batch's documents: `graphdef` merged
  with `params` and `rest` (stacked as `plan` says, as `step.Trainer` keeps them)."""

  def __init__(self, graphdef, params, rest, plan, chunk: int = 512, measure=None):
    # `measure(key)`: the objective the reference runs for `__call__`'s `slots` (any
    # hashable key): each document's log-probability by default (`_logps_only`).
    self.params, self.rest = params, rest
    measure = measure or _logps_only
    self._run = functools.lru_cache(maxsize=None)(
      lambda slots: jax.jit(functools.partial(step.evaluate_objective, graphdef, measure(slots), chunk, plan))
    )

  @classmethod
  def adapters_off(cls, trainer, measure=None):
    """The trainer's model with its adapters' matrices zero: the base it adapts."""
    zero = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))(trainer.params)
    return cls(trainer.graphdef, zero, trainer.rest, trainer.plan, trainer.chunk, measure)

  @classmethod
  def initial(cls, trainer, dtype=None, measure=None):
    """A frozen copy of the trainer's weights as they are now (in `dtype`, or theirs)."""
    copy = lambda x: jnp.copy(x) if dtype is None else x.astype(dtype)
    frozen = jax.jit(lambda t: jax.tree.map(copy, t))(trainer.params)
    return cls(trainer.graphdef, frozen, trainer.rest, trainer.plan, trainer.chunk, measure)

  @classmethod
  def of_model(cls, model, chunk: int = 512):
    """Another model (TRL's `ref_model`), with the same tokenizer."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return cls(graphdef, params, rest, None, chunk)

  def __call__(self, arrays: dict, slots, place) -> np.ndarray:
    """The log-probabilities [B, slots] of the batch `arrays` (placed by `place`; with
    another `measure`, what it gives for the key `slots`)."""
    args, rows = place({k: v for k, v in arrays.items() if k != "reference"})
    value, _ = self._run(slots)(self.params, self.rest, *args, rows)
    return np.asarray(jax.device_get(value), np.float32)


def _logps_only(slots):
  def run(model, tokens, targets, weights, *, chunk=512, **rows):
    return sequence_logps(model, tokens, targets, weights, slots=slots, chunk=chunk, **rows)[0], {}

  return run


class Preference(Objective):
  """DPO as an objective of the training loop (`objective.Supervised`'s
  interface). `reference`: "initial" (the initial
  weights: adapters off, or a frozen copy in `reference_dtype`), or a model
  (`Reference.of_model`'s, named for the cache by `reference_key`). `precompute`: the
  reference's log-probabilities of every row computed once, before training (`setup`),
  and the step holds one model."""

  name = "dpo"

  def __init__(
    self,
    config: DPOConfig = DPOConfig(),
    *,
    reference="initial",
    reference_dtype=None,
    precompute=False,
    reference_key=None,
  ):
    self.config, self.reference, self.reference_dtype = config, reference, reference_dtype
    # What names the reference in a cached file's name ("initial": the run's own model,
    # which the file's name holds already; another model: its record, else nothing is cached).
    self.reference_key = "initial" if reference == "initial" else reference_key
    self.precompute, self._ref, self._place = precompute, None, None

  def setup(self, trainer, data, eval_data, *, place=None, cache=None) -> None:
    self._place = place
    loaders = [x for x in (data, eval_data) if x is not None]
    self.slots = max(x.slots for x in loaders)
    for x in loaders:  # one shape of "reference" for every batch: one compiled step
      x.slots = self.slots
    adapters = bool(jax.tree.leaves(nnx.filter_state(trainer.params, nnx.LoRAParam)))
    if self.reference != "initial":
      self._ref = Reference.of_model(self.reference, trainer.chunk)
    elif adapters:
      self._ref = Reference.adapters_off(trainer)
    elif self.precompute:  # the weights as they are, before any step: no copy
      self._ref = Reference(trainer.graphdef, trainer.params, trainer.rest, trainer.plan, trainer.chunk)
    else:
      self._ref = Reference.initial(trainer, self.reference_dtype)
    if self.precompute:
      for loader in (data, eval_data):
        if loader is not None:
          loader.set_reference(self.table(loader, cache))
      self._ref = None  # the step holds one model

  def table(self, loader, cache=None) -> list:
    """Each example's documents' reference log-probabilities, from every row of
    `loader` once in order; read from `cache(loader)` (a path) where an earlier run wrote
    them, and written there (not for another model without a `reference_key`)."""
    path = None if cache is None or self.reference_key is None else cache(loader)
    if path is not None and path.is_file():
      with np.load(path) as z:
        flat, lengths = z["values"], z["lengths"]
      return [list(v) for v in np.split(flat, np.cumsum(lengths)[:-1])]
    values = [[0.0] * len(d) for d in loader.docs]
    for arrays, rows in loader.in_order():
      got = self._ref(arrays, loader.slots, self._place)
      for b, i in enumerate(rows):
        k = 0
        for p in loader.rows[i]:
          for j in range(len(loader.docs[p.example])):
            values[p.example][j] = float(got[b, k])
            k += 1
    if path is not None:
      path.parent.mkdir(parents=True, exist_ok=True)
      part = path.with_suffix(".part.npz")
      np.savez(
        part,
        values=np.asarray([v for x in values for v in x], np.float64),
        lengths=np.asarray([len(x) for x in values], np.int64),
      )
      part.replace(path)
    return values

  def prepare(self, arrays: dict) -> dict:
    if "reference" in arrays:
      return arrays
    return dict(arrays, reference=self._ref(arrays, self.slots, self._place))

  def loss(self, model, tokens, targets, weights, *, chunk: int = 512, reference=None, **rows):
    policy, counts = sequence_logps(
      model, tokens, targets, weights, slots=reference.shape[1], chunk=chunk, **rows
    )
    per, chosen, rejected = pair_losses(policy, reference, counts, self.config)
    valid = ((counts[:, 0::2] > 0) & (counts[:, 1::2] > 0)).astype(jnp.float32)
    pairs = jnp.sum(valid)
    mean = lambda x: jnp.sum(x * valid) / jnp.maximum(pairs, 1.0)
    stop = jax.lax.stop_gradient
    stats = {
      "pairs": pairs,
      "rewards/chosen": mean(stop(chosen)),
      "rewards/rejected": mean(stop(rejected)),
      "rewards/margins": mean(stop(chosen - rejected)),
      "rewards/accuracies": mean((stop(chosen) > stop(rejected)).astype(jnp.float32)),
      "logps/chosen": mean(stop(policy[:, 0::2])),
      "logps/rejected": mean(stop(policy[:, 1::2])),
    }
    return mean(per), stats

  def record(self, arrays: dict, value: float, stats: dict) -> dict:
    out = dict(loss=value, pairs=int(stats["pairs"]), loss_tokens=int(np.sum(arrays["weights"] > 0)))
    out.update({k: float(stats[k]) for k in METRICS})
    return out

  def evaluate(self, results) -> dict:
    """Means over every evaluation pair (each batch's means weighted by its pairs)."""
    pairs = sum(float(stats["pairs"]) for _, _, stats in results)
    weigh = lambda get: sum(get(v, s) * float(s["pairs"]) for _, v, s in results) / max(pairs, 1.0)
    out = dict(eval_loss=weigh(lambda v, s: float(v)), eval_pairs=int(pairs))
    out.update({f"eval_{k}": weigh(lambda v, s, k=k: float(s[k])) for k in METRICS})
    return out
