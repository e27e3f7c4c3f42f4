"""Needle-in-a-haystack evaluation: accuracy by needle depth and context length, the
answers a model generates, and the heatmap.

Legend: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from ..train.scratch import place_batch, rows_right
from ..train.tasks import NeedleTask, decode, row_rng


def depth_bins(n: int) -> list[tuple[float, float]]:
  """`n` equal bins of needle depth over [0, 1)."""
  edges = np.linspace(0.0, 1.0, n + 1)
  return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:])]


@functools.cache
def _rows_right():
  @nnx.jit
  def answered(model, tokens, targets, weights):
    """bool [B]: the row's answer is the argmax at every answer token."""
    return rows_right(model(tokens), targets, weights)

  return answered


class _Bins:
  """The examples of several depth bins as one batch: rows [j * rows, (j + 1) * rows)
  are row 0..rows-1 of bin j's batch (`probes[j].batch(seed, j, rows)`), so a batch
  of every bin is the bins' batches stacked, and a process builds only its rows."""

  def __init__(self, probes, seed: int, rows: int):
    self.probes, self.seed, self.rows = probes, seed, rows
    self.seq_len = probes[0].seq_len

  def batch(self, seed, step, batch_size, rows=None):
    del seed, step, batch_size  # fixed by the bins
    rows = range(len(self.probes) * self.rows) if rows is None else rows
    parts = []
    for j, probe in enumerate(self.probes):
      mine = [r - j * self.rows for r in rows if j * self.rows <= r < (j + 1) * self.rows]
      if mine:
        parts.append(probe.batch(self.seed, j, self.rows, rows=mine))
    return type(parts[0])(*(np.concatenate(x) for x in zip(*parts)))


def accuracy_grid(model, task: NeedleTask, lengths, bins: int, rows: int, seed: int, mesh, spec):
  """Exact-answer accuracy [len(lengths), bins]: for each context length and depth bin,
  the fraction of `rows` fresh examples (seeds disjoint from training's) answered
  right under teacher forcing. One call per length evaluates every bin."""
  grid = np.zeros((len(lengths), bins))
  for i, length in enumerate(lengths):
    probes = [dataclasses.replace(task, seq_len=length, depth=depth) for depth in depth_bins(bins)]
    stacked = _Bins(probes, seed + 20_000 + i, rows)
    batch = place_batch(stacked, 0, 0, bins * rows, mesh, spec)
    right = np.asarray(_rows_right()(model, *batch)).reshape(bins, rows)
    grid[i] = right.mean(axis=1)
  return grid


def generated_answers(model, task: NeedleTask, count: int, seed: int):
  """`count` fresh examples answered by `models.generate` (greedy): a list of dicts
  with the needle's depth, the question's name, the truth and the model's answer."""
  from ..generate import generate

  prompts, truths, depths = [], [], []
  for r in range(count):
    seq, answer, depth = task.example(row_rng(seed + 30_000, 0, r))
    prompts.append(seq[:answer])
    truths.append(decode(seq[answer:]))
    depths.append(depth)
  out = generate(model, np.stack(prompts), max_new_tokens=task.digits)
  tokens = np.asarray(jax.device_get(out.tokens))
  results = []
  for r in range(count):
    question = decode(prompts[r]).rsplit("\n", 1)[-1]  # the prompt ends with the question
    results.append(
      {
        "depth": round(float(depths[r]), 3),
        "question": question,
        "truth": truths[r],
        "answer": decode(tokens[r]),
      }
    )
  return results


def plot_report(report: dict, path: str) -> None:
  """One heatmap of accuracy (context length x needle depth) per attention kind, and
  the training loss curves, in one PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = report["runs"]
  lengths, bins = report["lengths"], report["bins"]
  fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.6 * (len(runs) + 1), 3.6))
  for n, (ax, run) in enumerate(zip(axes, runs.values())):
    grid = np.asarray(run["grid"])
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(bins), [f"{(j + 0.5) / bins:.2f}" for j in range(bins)], fontsize=7)
    ax.set_yticks(range(len(lengths)), [str(t) for t in lengths] if n == 0 else [])
    ax.set(xlabel="needle depth (bin centre)", title=run["label"])
    if n == 0:
      ax.set_ylabel("context length (bytes)")
    for i in range(grid.shape[0]):
      for j in range(grid.shape[1]):
        ax.text(
          j,
          i,
          f"{grid[i, j]:.2f}",
          ha="center",
          va="center",
          fontsize=6,
          color="w" if grid[i, j] < 0.6 else "k",
        )
  fig.colorbar(image, ax=axes[: len(runs)].tolist(), shrink=0.8, label="exact-answer accuracy")
  ax = axes[-1]
  for name, run in runs.items():
    h = run["history"]
    ax.plot(h["step"], h["loss"], label=name)
  ax.set(xlabel="step", ylabel="training loss (weighted bytes)", yscale="log", title="training")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
