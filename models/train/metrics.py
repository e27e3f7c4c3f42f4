"""A run's record as it runs: `metrics.jsonl` (one JSON object a line, appended and
flushed as each step or evaluation ends, so that it survives a kill) and TensorBoard
event files under `tb/` (tensorboardX: no TensorFlow), the same scalars in both."""

from __future__ import annotations

import json
import math
import os

METRICS = "metrics.jsonl"


def read(out) -> list[dict]:
  """The records of `out/metrics.jsonl` (none where there is no file); a last line a
  kill cut short is left out."""
  path = os.path.join(out, METRICS)
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


class Metrics:
  """Appends each record to `out/metrics.jsonl` and its numbers to TensorBoard. Opened
  to resume at `step`, it first drops the records of steps from `step` on (a run killed
  after its last saved state logged steps it will take again), and writes the event
  files anew from the records it keeps: TensorBoard then shows every step once, however
  the run before was stopped (a purge step only hides what a later file repeats, and a
  step logged after the last save was lost with the next run's purge)."""

  def __init__(self, out, step: int = 0, tensorboard: bool = True):
    os.makedirs(out, exist_ok=True)
    kept = [r for r in read(out) if r.get("step", 0) < step]
    path = os.path.join(out, METRICS)
    with open(path + ".part", "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".part", path)
    self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
    self._tb = None
    if tensorboard:
      import shutil

      from tensorboardX import SummaryWriter

      shutil.rmtree(os.path.join(out, "tb"), ignore_errors=True)
      self._tb = SummaryWriter(os.path.join(out, "tb"))
      for record in kept:
        self._scalars(record)
      self._tb.flush()

  def log(self, record: dict) -> None:
    """One record: "step" and scalars (others, such as lists, go to the JSONL only)."""
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      self._scalars(record)
      self._tb.flush()

  def _scalars(self, record: dict) -> None:
    for name, value in record.items():
      if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        self._tb.add_scalar(name, value if math.isfinite(value) else float("nan"), record["step"])

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class Quiet:
  """`Metrics` for the processes that write nothing (all but the first of several)."""

  def log(self, record: dict) -> None:
    pass

  def close(self) -> None:
    pass
