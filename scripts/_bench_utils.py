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


def run_times(fn, *args, repeats: int = 3, warmup: bool = True) -> list[float]:
  """Wall times of `repeats` runs of fn(*args), after one warm-up run unless `warmup`
  is False (for an already compiled function whose runs take minutes)."""
  import jax

  if warmup:
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return samples


def median_time(fn, *args, repeats: int = 3, warmup: bool = True) -> float:
  """Median wall time of fn(*args) over `repeats` runs (see `run_times`)."""
  import numpy as np

  return float(np.median(run_times(fn, *args, repeats=repeats, warmup=warmup)))


def matmul_rate(repeats: int, stat=None) -> float:
  """FLOP/s of a 4096^3 float32 matmul on one device; `stat` of the run times
  (default the median)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32), jax.devices()[0])
  samples = run_times(jax.jit(lambda x: x @ x), a, repeats=max(repeats, 3))
  return 2 * 4096**3 / float((stat or np.median)(samples))


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
