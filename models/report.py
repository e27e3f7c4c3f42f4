"""Plots of training runs: loss and evaluation accuracy curves."""

from __future__ import annotations


def plot_history(histories, path: str) -> None:
  """Training loss and eval accuracy of each history (as `models.training.train`
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
