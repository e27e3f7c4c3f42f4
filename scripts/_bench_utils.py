"""Helpers shared by the scripts: simulated devices, medians of timed runs, the
forward+backward program and its compiled memory."""

from __future__ import annotations

import os
import time


def simulate_devices(count: int) -> None:
  """On a CPU-only host, asks XLA for `count` devices. Call before importing jax."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def median_time(fn, *args, repeats: int = 3, warmup: bool = True) -> float:
  """Median wall time of fn(*args) over `repeats` runs, after one warm-up run unless
  `warmup` is False (for an already compiled function whose runs take minutes)."""
  import jax
  import numpy as np

  if warmup:
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return float(np.median(samples))


def fwd_bwd(attend):
  """(q, k, v, dO) -> (output, (dq, dk, dv)) of attention function `attend`."""
  import jax

  def both(q, k, v, g):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(g)

  return both


def memory_mib(compiled) -> float:
  """Per-device temp + argument memory of a compiled program, in MiB."""
  stats = compiled.memory_analysis()
  return (stats.temp_size_in_bytes + stats.argument_size_in_bytes) / 2**20


def header(script: str, argv, num_devices: int) -> list[str]:
  """Markdown heading with the command, then the date, machine, devices and jax version."""
  import datetime
  import platform

  import jax

  device = jax.devices()[0]
  return [
    f"\n### `{' '.join([f'python scripts/{script}', *argv])}`\n",
    f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
    f"{num_devices} x {device.device_kind} ({device.platform}), jax {jax.__version__}\n",
  ]
