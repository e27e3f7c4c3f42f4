"""What an objective is to the training loop (`finetune.finetune`, written once): how a
batch is completed on the host before the step (`prepare`; `probe` the same shapes
without the work, for the compiled step's memory), the loss the step differentiates
(`loss`, `step.Trainer`'s objective), the records it writes for a training step
(`record`) and an evaluation (`evaluate`), and what it keeps beside the run's state
(`resume`, `save`). Supervised fine-tuning (`Supervised`, here), preference tuning
(`dpo.Preference`) and reinforcement learning from rewards (`grpo.GRPO`) are such
parts; `OBJECTIVES` names them for `scripts/finetune.py --objective`.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import numpy as np

from . import step


class StopRun(ValueError):
  """An objective's error that ends the run once its state is saved at the step that
  raised it (a reward function that raised, say): the run resumes there."""


class Objective:
  """The loop's defaults: nothing set up, batches as they come, nothing kept."""

  name = "objective"
  reference_key = None  # what names an objective's reference (`dpo`) in its cached files' names

  def setup(self, trainer, data, eval_data, *, place=None, cache=None) -> None:
    """Called once the step's weights exist, before a resumed state replaces them:
    `place(arrays)` puts a batch on the devices, `cache(loader)` names a file for what
    the objective computes once for a loader's rows."""

  def prepare(self, arrays: dict) -> dict:
    """A batch's arrays as the step takes them (`tokens`, `targets`, `weights` and the
    rows' other arrays)."""
    return arrays

  def probe(self, arrays: dict) -> dict:
    """Arrays of the shapes `prepare` gives (for the compiled step's memory)."""
    return self.prepare(arrays)

  def resume(self, out: str, step: int) -> None:
    """Before the first step run here (`step`: 0, or the saved state's): what the
    objective keeps under `out` is brought back to that step."""

  def save(self, out: str, step: int) -> None:
    """Beside the state saved at `step`: what the objective needs to go on from it."""


class Supervised(Objective):
  """The next token's cross-entropy on the weighted tokens (`step.cross_entropy`)."""

  name = "sft"

  def loss(self, model, tokens, targets, weights, *, chunk: int = 512, **rows):
    return step.cross_entropy(model, tokens, targets, weights, chunk=chunk, **rows)

  def record(self, arrays: dict, value: float, stats: dict) -> dict:
    """The step's own entries of its metrics.jsonl record."""
    out = dict(loss=value, loss_tokens=int(np.sum(arrays["weights"] > 0)))
    if "dropped_tokens" in stats:  # an MoE with a capacity (`moe.set_capacity`)
      out["dropped_tokens"] = int(stats["dropped_tokens"])
    return out

  def evaluate(self, results) -> dict:
    """An evaluation's record from its batches' (arrays, loss, stats): the loss over
    every weighted token."""
    total = count = 0.0
    for arrays, value, _ in results:
      n = float(np.sum(arrays["weights"]))
      total, count = total + float(value) * n, count + n
    return dict(eval_loss=total / max(count, 1.0))


def make(name: str, **settings):
  """The objective `name` ("sft", "dpo", "grpo") with its settings."""
  import importlib

  # The parts are found by name (they build on this module: no import cycle).
  parts = {"sft": None, "dpo": ("dpo", "Preference"), "grpo": ("grpo", "GRPO")}
  if name not in parts:
    raise ValueError(f"objective={name!r}: expected one of {OBJECTIVES}")
  if parts[name] is None:
    return Supervised(**settings)
  module, cls = parts[name]
  return getattr(importlib.import_module(f"{__package__}.{module}"), cls)(**settings)


OBJECTIVES = ("sft", "dpo", "grpo")
