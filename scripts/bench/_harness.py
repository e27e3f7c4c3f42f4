"""The benchmark harness the bench_*.py scripts share: random inputs on a sharding,
compiled forward and forward+backward programs, medians of timed runs, per-device
memory from the compiler, the matmul rate that FLOP/s are compared with, Markdown
headers and sections of docs/benchmarks.md.

Times are medians of `repeats` runs after one warm-up, with `block_until_ready`;
memory per device is temp + arguments from `memory_analysis()` of the same program.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

from jax_ring.models.runtime import simulate_devices

__all__ = [
  "Measured",
  "add_lm_args",
  "fwd_bwd",
  "header",
  "inputs",
  "lm_config",
  "matmul_rate",
  "measure",
  "median_time",
  "memory_mib",
  "publish",
  "run_times",
  "simulate_devices",
  "write_section",
]


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


def matmul_rate(repeats: int, stat=None, size: int = 4096) -> float:
  """FLOP/s of a size^3 float32 matmul on one device; `stat` of the run times
  (default the median)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32), jax.devices()[0])
  samples = run_times(jax.jit(lambda x: x @ x), a, repeats=max(repeats, 3))
  return 2 * size**3 / float((stat or np.median)(samples))


def add_lm_args(parser) -> None:
  """The options of a DecoderLM benchmark: devices, width, layers, heads, kv heads,
  vocabulary, batch."""
  parser.add_argument("--devices", type=int, default=8, help="simulated devices on the sequence axis")
  parser.add_argument("--dim", type=int, default=256, help="model width")
  parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="query heads")
  parser.add_argument("--kv-heads", type=int, default=2, help="kv heads")
  parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
  parser.add_argument("--batch", type=int, default=1, help="batch size")


def lm_config(args, **fields):
  """The `LMConfig` of `add_lm_args`' options (MLP 4 x width, ring attention), with
  `fields` changed."""
  from jax_ring.models import LMConfig

  return LMConfig(
    vocab_size=args.vocab,
    dim=args.dim,
    num_layers=args.layers,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    mlp_hidden=4 * args.dim,
    attention="ring",
    **fields,
  )


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


def inputs(shapes, sharding, dtype="float32", seed: int = 0):
  """Standard-normal arrays of `shapes` in `dtype`, placed with `sharding`."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [
    jax.device_put(jax.random.normal(k, s, jnp.float32).astype(dtype), sharding) for k, s in zip(keys, shapes)
  ]


class Measured(NamedTuple):
  fwd: float  # median seconds of the forward
  fwd_bwd: float  # median seconds of forward + backward
  mib: float  # per-device MiB (temp + arguments) of forward + backward
  out: object  # the forward's output


def measure(attend, q, k, v, g, repeats: int = 3) -> Measured:
  """Compiles attend(q, k, v) and its forward+backward with cotangent g, then times both."""
  import jax

  fwd = jax.jit(attend).lower(q, k, v).compile()
  both = jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile()
  t_fwd = median_time(fwd, q, k, v, repeats=repeats)
  t_both = median_time(both, q, k, v, g, repeats=repeats)
  return Measured(t_fwd, t_both, memory_mib(both), fwd(q, k, v))


def header(script: str, argv, num_devices: int) -> list[str]:
  """Markdown heading with the command, then the date, machine, devices and jax version."""
  import datetime
  import platform

  import jax

  device = jax.devices()[0]
  return [
    f"\n### `{' '.join([f'python scripts/bench/{script}', *argv])}`\n",
    f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
    f"{num_devices} x {device.device_kind} ({device.platform}), jax {jax.__version__}\n",
  ]


def write_section(path: str, tag: str, text: str) -> None:
  """Replaces the section between this tag's markers in `path` (appends it if absent)."""
  start, end = f"<!-- bench.py {tag} -->", f"<!-- /bench.py {tag} -->"
  block = f"{start}\n{text.strip()}\n{end}\n"
  old = ""
  if os.path.exists(path):
    with open(path) as f:
      old = f.read()
  if start in old and end in old:
    new = old[: old.index(start)] + block + old[old.index(end) + len(end) + 1 :]
  else:
    new = old + ("\n" if old and not old.endswith("\n") else "") + block
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(new)


def publish(lines, out: str | None, tag: str, echo: bool = False) -> str:
  """The table's lines as Markdown text: printed whole when `echo` (scripts that do not
  print rows as they go), written as section `tag` of `out` when given; returns it."""
  text = "\n".join(lines) + "\n"
  if echo:
    print(text)
  if out:
    write_section(out, tag, text)
    print(f"wrote {out}")
  return text
