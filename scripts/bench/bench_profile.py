"""Where ring attention's time goes, from a profile: each compiled program (forward,
forward+backward) runs once under `jax.profiler.trace`, and the trace's per-operation
events (one per executed HLO operation, on every simulated device's thread) are summed
by what the operation does, read from the compiled HLO:

- matmul: dots, alone or fused (XLA's CPU backend fuses a dot with its neighbours);
- exp: fusions that compute an exponential (the softmax's, with the max, subtract and
  sum XLA fused into them) without a dot;
- masks: other fusions with a select or compare (masks, tile classes);
- transfers: collective-permute (a copy between devices on CPU);
- copies: copy, transpose, dynamic-slice/update-slice, concatenate and pad, alone or as
  the only kind of work of a fusion;
- other: everything else (elementwise updates, reductions, loop and branch bookkeeping).

An event lasts from an operation's start to its end on its device's thread, so a
collective-permute's includes the wait for the slowest device of the ring (on CPU the
devices meet at every transfer); the table gives the transfers' share of all events,
and each other category's share of the rest (the compute). Beside it: the program's
rate, and the rate of its tile matmuls alone (the same dots, of the same shapes and
count, in a loop on every device with nothing else), both as fractions of a 4096^3
float32 matmul on one device timed in the same run.

  python scripts/bench/bench_profile.py --out docs/benchmarks.md
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from _harness import fwd_bwd, header, inputs, matmul_rate, median_time, publish, simulate_devices

from jax_ring.models import cli

CATEGORIES = ("matmul", "exp", "masks", "transfers", "copies", "other")
_COPY_OPS = {
  "copy",
  "transpose",
  "dynamic-slice",
  "dynamic-update-slice",
  "concatenate",
  "pad",
  "slice",
  "bitcast",
  "reshape",
  "broadcast",
  "parameter",
  "tuple",
  "get-tuple-element",
  "constant",
}


# An instruction whose result is a scalar: `%name = s32[] op(...)`.
_SCALAR = re.compile(r"= [a-z0-9]+\[\]")


def parse_args(argv):
  p = cli.parser(__doc__)
  p.add_argument("--devices", type=int, default=8, help="simulated devices on the sequence axis")
  p.add_argument("--length", type=int, default=8192, help="sequence length T")
  p.add_argument("--heads", type=int, default=8, help="query heads N (and kv heads)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim H")
  p.add_argument("--causal", action="store_true", help="causal attention (default: full)")
  p.add_argument("--repeats", type=int, default=3, help="timed runs of each program (median)")
  p.add_argument("--out", default=None, help="Markdown file for the table (its 'profile' section)")
  return p.parse_args(argv)


def categorize(hlo: str) -> dict[str, str]:
  """HLO instruction name -> category, for every instruction of the program."""
  comps: dict[str, list[tuple[str, str, str]]] = {}
  name = None
  for line in hlo.splitlines():
    header_match = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(", line)
    if header_match and line.rstrip().endswith("{"):
      name = header_match.group(1)
      comps[name] = []
    elif line.strip() == "}":
      name = None
    elif name is not None and (m := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(", line)):
      comps[name].append((m.group(1), m.group(2), line))

  def ops_of(comp: str, seen=()) -> set[str]:
    found = set()
    for _, op, line in comps.get(comp, ()):
      if _SCALAR.search(line):  # index arithmetic (a dynamic slice's bounds), not data
        continue
      found.add(op)
      if op == "fusion" and (c := re.search(r"calls=%?([\w.\-]+)", line)) and c.group(1) not in seen:
        found |= ops_of(c.group(1), (*seen, comp))
    return found

  kinds = {}
  for lines in comps.values():
    for inst, op, line in lines:
      if op in ("while", "conditional", "call"):  # their events span the operations inside
        continue
      ops = {op}
      if op == "fusion" and (c := re.search(r"calls=%?([\w.\-]+)", line)):
        ops = ops_of(c.group(1))
      if "dot" in ops or "convolution" in ops or (op == "custom-call" and "matmul" in line.lower()):
        kinds[inst] = "matmul"
      elif "exponential" in ops:
        kinds[inst] = "exp"
      elif "collective-permute" in op:
        kinds[inst] = "transfers"
      elif ops <= _COPY_OPS:
        kinds[inst] = "copies"
      elif "select" in ops or "compare" in ops:
        kinds[inst] = "masks"
      else:
        kinds[inst] = "other"
  return kinds


def profile(compiled, args_, kinds: dict[str, str]) -> dict[str, float]:
  """Busy microseconds per category over one run of `compiled` under the profiler."""
  import jax

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      jax.block_until_ready(compiled(*args_))
    (path,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  busy: dict[str, float] = collections.defaultdict(float)
  for event in events:
    if event.get("ph") == "X" and event.get("name") in kinds:
      busy[kinds[event["name"]]] += float(event.get("dur", 0.0))
  return busy


def tile_matmuls(mesh, args, backward: bool) -> float:
  """Median seconds of the ring's tile matmuls alone: on every device, for every ring
  step and head, the dots of every (query block, key block) tile of the library's
  default blocks for the shard (`local_blocks`; zigzag halves when causal), two a
  tile in the forward loop and five in the backward one, with nothing else."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import BlockSizes
  from jax_ring._tiles import local_blocks

  p = args.devices
  shard = args.length // p
  _, bq, bk = local_blocks(shard, BlockSizes(), devices=p, layout="zigzag" if args.causal else None)
  n = max(shard // bq, shard // bk)  # blocks a shard, of the longer kind
  tiles = int(p * args.heads * (shard // bq) * (shard // bk) * (0.5 if args.causal else 1.0))
  x = jax.device_put(
    jax.random.normal(jax.random.PRNGKey(0), (p * n, max(bq, bk), args.head_dim)),
    NamedSharding(mesh, P("seq")),
  )

  def body(x):
    def block(i, j, rows):
      return lax.dynamic_index_in_dim(x, (i + j) % n, keepdims=False)[:rows]

    def forward(i, acc):
      q, k, v = block(i, 0, bq), block(i, 1, bk), block(i, 2, bk)
      return acc + (q @ k.T) @ v

    def backward_tile(i, acc):  # S again, dP = dO V^T, dV = S^T dO, dQ = dP K, dK = dP^T Q
      q, k, v, do = block(i, 0, bq), block(i, 1, bk), block(i, 2, bk), block(i, 3, bq)
      s, dp = q @ k.T, do @ v.T
      return acc + (s.T @ do).sum() + dp @ k + (dp.T @ q).sum()

    acc = lax.fori_loop(0, tiles, forward, jnp.zeros((bq, args.head_dim), x.dtype) + 0 * x[0, 0])
    if backward:
      acc = acc + lax.fori_loop(0, tiles, backward_tile, jnp.zeros_like(acc))
    return acc[None]

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("seq"), out_specs=P("seq")))
  return median_time(run.lower(x).compile(), x, repeats=args.repeats)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  simulate_devices(args.devices)
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import ring_attention

  mesh = jax.make_mesh((args.devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  shape = (1, args.length, args.heads, args.head_dim)
  q, k, v, g = inputs([shape] * 4, NamedSharding(mesh, P(None, "seq")))
  attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=args.causal)
  programs = {
    "forward": (jax.jit(attend).lower(q, k, v).compile(), (q, k, v), 1.0),
    "forward+backward": (jax.jit(fwd_bwd(attend)).lower(q, k, v, g).compile(), (q, k, v, g), 3.5),
  }
  rate = matmul_rate(args.repeats)
  fwd_flops = 4 * args.length**2 * args.heads * args.head_dim * (0.5 if args.causal else 1.0)
  lines = header("bench_profile.py", sys.argv[1:] if argv is None else argv, args.devices)
  lines += [
    f"T={args.length}, B=1, N={args.heads}, H={args.head_dim}, float32, "
    f"{'causal' if args.causal else 'full'}, {args.devices} devices, library defaults. "
    f"4096^3 float32 matmul: {rate / 1e9:.1f} GFLOP/s. Shares are of the busy time summed over "
    "the devices' threads in one profiled run; rates use the median of unprofiled runs.\n",
    "| program | s | of matmul rate | tile matmuls alone | transfers (waits included) | "
    + " | ".join(c for c in CATEGORIES if c != "transfers")
    + " |",
    "|---|---|---|---|---|" + "---|" * (len(CATEGORIES) - 1),
  ]
  for label, (compiled, call_args, factor) in programs.items():
    kinds = categorize(compiled.as_text())
    seconds = median_time(compiled, *call_args, repeats=args.repeats)
    busy = profile(compiled, call_args, kinds)
    total = sum(busy.values()) or 1.0
    flops = fwd_flops * factor
    compute = total - busy["transfers"] or 1.0
    shares = " | ".join(f"{busy[c] / compute:.2f}" for c in CATEGORIES if c != "transfers")
    alone = tile_matmuls(mesh, args, backward=factor != 1.0)
    lines.append(
      f"| {label} | {seconds:.3f} | {flops / seconds / rate:.2f} | {flops / alone / rate:.2f} "
      f"| {busy['transfers'] / total:.2f} | {shares} |"
    )
    print(lines[-1], flush=True)
  return publish(lines, args.out, "profile", echo=True)


if __name__ == "__main__":
  main()
