"""Compile for hardware that is not here: GPU and TPU targets described by name, and
what their compiled programs show (memory, collectives, overlap, kernel launches).

JAX compiles ahead of time for devices it does not have ("deviceless" AOT) from a
topology description (`jax.experimental.topologies.get_topology_desc`): a GPU's
`GpuTargetConfig` text proto (needs the CUDA plugin and ptxas: the `[aot]` extra), or a TPU slice's
name (needs libtpu, `jax[tpu]`). Nothing runs; `compiled.as_text()` and
`memory_analysis()` tell what would. Set `JAX_PLATFORMS=cpu` (and for TPU targets
`TPU_SKIP_MDS_QUERY=1`, and `ALLOW_MULTIPLE_LIBTPU_LOAD=1` to compile in several
processes at once) before jax is imported: without it the CUDA plugin tries to
start a GPU and does not register. `scripts/aot.py` is the command line over this
module.

    from jax_ring import aot
    mesh = aot.target_mesh("h100x8")
    compiled = aot.compile_attention(mesh, seq_len=65536, heads=32, kv_heads=8, head_dim=128)
    aot.report(compiled)   # memory, collective bytes, overlap per ring step, launch grids
"""

from __future__ import annotations

import dataclasses
import math
import re

# NVIDIA's published figures (H100 SXM5 80GB, A100 SXM4 80GB) in XLA's GpuTargetConfig
# text format (openxla/xla, xla/stream_executor/device_description.proto).
_GPU = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core}
  shared_memory_per_block_optin: {smem_optin}
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {major} minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""
H100 = _GPU.format(
  smem_core=233472,
  smem_optin=232448,
  cores=132,
  fpus=128,
  bandwidth=3352320000000,
  l2=52428800,
  clock=1.98,
  memory=84929347584,
  major=9,
  name="NVIDIA H100 80GB HBM3",
)
A100 = _GPU.format(
  smem_core=167936,
  smem_optin=166912,
  cores=108,
  fpus=64,
  bandwidth=2039000000000,
  l2=41943040,
  clock=1.41,
  memory=85899345920,
  major=8,
  name="NVIDIA A100-SXM4-80GB",
)


@dataclasses.dataclass(frozen=True)
class Target:
  """A compile-only target: `platform` "cuda" (a GPU config and "1x1xN" of them) or
  "tpu" (a slice by name, e.g. "v5e:8x8")."""

  name: str
  platform: str
  devices: int
  topology: str
  config: str | None = None  # GpuTargetConfig text proto
  sms: int | None = None  # streaming multiprocessors per GPU
  memory_bytes: int | None = None  # per device
  link_bytes_per_s: float | None = None  # one direction, to a ring neighbour (`LINKS`)
  peak_flops: float | None = None  # dense bf16 matmul per device (`LINKS`)
  link_source: str = ""  # where those two figures come from (`LINKS`)

  def describe(self):
    """The `jax.experimental.topologies` description of the target. Without the
    compiler for it (the `[aot]` extra) a RuntimeError says what to install."""
    from jax.experimental import topologies

    try:
      if self.platform == "cuda":
        return topologies.get_topology_desc(
          platform="cuda", target_config=self.config, topology=self.topology
        )
      return topologies.get_topology_desc(topology_name=self.topology, platform="tpu")
    except (NotImplementedError, RuntimeError) as e:
      raise RuntimeError(missing_compiler(self, e)) from e


def missing_compiler(t: Target, error: Exception) -> str:
  """What to install to compile for `t`, given the error JAX raised without it."""
  import jax

  what = "the CUDA plugin and ptxas" if t.platform == "cuda" else "libtpu"
  return (
    f"target {t.name!r}: JAX cannot describe a {t.platform} topology here ({error}). Compiling "
    f"for it needs {what} at JAX's version: install the [aot] extra, best in an environment "
    f"of its own (it adds about 2 GB), e.g. `python -m venv .venv-aot && .venv-aot/bin/pip "
    f"install -e '.[aot]'` from a checkout (jax {jax.__version__} here; the extra pins "
    f"jax[tpu] and jax-cuda12-plugin to the version it was tested with)."
  )


GiB = 1 << 30
# (bytes/s one way to a ring neighbour, dense bf16 FLOP/s, where the figures come from).
# A ring step sends to one neighbour while it receives from the other: one direction of
# the link between them. GPUs of an NVSwitch node reach a peer with all their NVLinks.
LINKS = {
  "h100": (
    450e9,
    989e12,
    "NVIDIA H100 SXM5 datasheet: NVLink 4 at 900 GB/s per GPU, both directions (450 GB/s one way); "
    "989 TFLOPS dense bf16 (1,979 with sparsity)",
  ),
  "a100": (
    300e9,
    312e12,
    "NVIDIA A100 SXM4 datasheet: NVLink 3 at 600 GB/s per GPU, both directions; 312 TFLOPS dense bf16",
  ),
  "v5e": (
    50e9,
    197e12,
    "Google Cloud TPU v5e page: ICI 400 GB/s per chip both directions over 4 ports (50 GB/s per port "
    "one way); 197 TFLOPS bf16",
  ),
  "v5p": (
    100e9,
    459e12,
    "Google Cloud TPU v5p page: ICI 4,800 Gbps (600 GB/s) per chip over 6 ports of its 3D torus "
    "(100 GB/s per port one way); 459 TFLOPS bf16",
  ),
  "v6e": (
    100e9,
    918e12,
    "Google Cloud TPU v6e page: ICI 800 GB/s per chip both directions over 4 ports (100 GB/s per port "
    "one way); 918 TFLOPS bf16",
  ),
}


def _target(name, platform, devices, topology, chip, **kw):
  bw, peak, source = LINKS[chip]
  return Target(
    name, platform, devices, topology, link_bytes_per_s=bw, peak_flops=peak, link_source=source, **kw
  )


TARGETS = {
  "h100x8": _target("h100x8", "cuda", 8, "1x1x8", "h100", config=H100, sms=132, memory_bytes=84929347584),
  "h100x1": _target("h100x1", "cuda", 1, "1x1x1", "h100", config=H100, sms=132, memory_bytes=84929347584),
  "a100x8": _target("a100x8", "cuda", 8, "1x1x8", "a100", config=A100, sms=108, memory_bytes=85899345920),
  # TPU HBM per chip: v5e 16 GiB, v5p 95 GiB, v6e 32 GiB (Google Cloud's TPU pages).
  "v5e:2x4": _target("v5e:2x4", "tpu", 8, "v5e:2x4", "v5e", memory_bytes=16 * GiB),
  "v5e:8x8": _target("v5e:8x8", "tpu", 64, "v5e:8x8", "v5e", memory_bytes=16 * GiB),
  "v5e:16x16": _target("v5e:16x16", "tpu", 256, "v5e:16x16", "v5e", memory_bytes=16 * GiB),
  "v5p:2x2x2": _target("v5p:2x2x2", "tpu", 8, "v5p:2x2x2", "v5p", memory_bytes=95 * GiB),
  "v5p:4x4x4": _target("v5p:4x4x4", "tpu", 64, "v5p:4x4x4", "v5p", memory_bytes=95 * GiB),
  "v6e:2x4": _target("v6e:2x4", "tpu", 8, "v6e:2x4", "v6e", memory_bytes=32 * GiB),
}


def target(name: str) -> Target:
  if name not in TARGETS:
    raise ValueError(f"target={name!r} is not one of {sorted(TARGETS)}")
  return TARGETS[name]


def target_mesh(name: str, axis_shapes=None, axis_names=("seq",), *, ring_axis="seq", linked: bool = True):
  """A mesh of the target's compile-only devices: `jax_ring.ring_mesh` (rings through
  linked chips), or with `linked=False` `jax.make_mesh`'s order."""
  import jax
  from jax.experimental import topologies

  from jax_ring._topology import ring_mesh

  t = target(name)
  axis_shapes = (t.devices,) if axis_shapes is None else tuple(axis_shapes)
  devices = t.describe().devices
  if linked:
    return ring_mesh(axis_shapes, axis_names, ring_axis=ring_axis, devices=devices)
  mesh = topologies.make_mesh(t.describe(), axis_shapes, axis_names)
  return mesh.update(axis_types=(jax.sharding.AxisType.Explicit,) * len(axis_names))


def attention_inputs(mesh, *, seq_len, heads, kv_heads, head_dim, batch=1, dtype="bfloat16", seq_axis="seq"):
  """q, k, v as `jax.ShapeDtypeStruct`s sharded along the sequence."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sharding = NamedSharding(mesh, P(None, seq_axis))
  shape = lambda n: jax.ShapeDtypeStruct((batch, seq_len, n, head_dim), jnp.dtype(dtype), sharding=sharding)
  return shape(heads), shape(kv_heads), shape(kv_heads)


def compile_attention(
  mesh,
  *,
  backward: bool = True,
  kernel: str = "auto",
  is_causal: bool = True,
  document_bound: int | str | None = None,
  **shape,
):
  """The compiled forward (+backward) of `ring_attention` on `mesh` for inputs of
  `shape` (`attention_inputs`' arguments). `document_bound`: a packed row's segment ids
  (int32 [batch, seq_len], sharded as q) are an input too, and the call gets the bound."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring._attention import ring_attention

  q, k, v = attention_inputs(mesh, **shape)
  ids = None
  if document_bound is not None:
    ids = jax.ShapeDtypeStruct(
      q.shape[:2], jnp.int32, sharding=NamedSharding(mesh, P(None, shape.get("seq_axis", "seq")))
    )

  def step(q, k, v, ids):
    attend = lambda q, k, v: ring_attention(
      q, k, v, mesh=mesh, is_causal=is_causal, kernel=kernel, segment_ids=ids, document_bound=document_bound
    )
    if not backward:
      return attend(q, k, v)
    out, vjp = jax.vjp(attend, q, k, v)
    return vjp(out)

  with jax.set_mesh(mesh):
    return jax.jit(step).lower(q, k, v, ids).compile()


_TRITON = re.compile(
  r'op_name="[^"]*/(jax_ring_\w+)/pallas_call".*?grid_x = (\d+).*?grid_y = (\d+).*?grid_z = (\d+)'
)


def launch_grids(compiled) -> dict[str, int]:
  """Programs per launch of each Triton kernel in a compiled GPU program (the product
  of its grid), by kernel name; the smallest where a kernel is launched at several
  shapes."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  grids: dict[str, int] = {}
  for line in text.splitlines():
    if "xla.gpu.triton" not in line:
      continue
    for name, *grid in _TRITON.findall(line):
      programs = math.prod(int(g) for g in grid)
      grids[name] = min(grids.get(name, programs), programs)
  return grids


_MOSAIC_BODY = re.compile(
  r'%(jax_ring_tpu_\w+?)(?:\.\d+)? = .*custom_call_target="tpu_custom_call".*?"body":"([^"]+)"'
)


def tpu_grids(compiled) -> dict[str, dict]:
  """Each Mosaic kernel's grid in a compiled TPU program, read back from the kernel
  module the program carries: {name: {"bounds": [...], "parallel": [...]}}, the grid's
  extent per axis and whether the axis is marked parallel (the axes a megacore chip
  splits between its two TensorCores). The smallest grid where a kernel is called at
  several shapes."""
  import base64

  from jax._src.interpreters import mlir
  from jax._src.lib import tpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.passmanager import PassManager

  text = compiled if isinstance(compiled, str) else compiled.as_text()
  grids: dict[str, dict] = {}
  for name, body in _MOSAIC_BODY.findall(text):
    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
      ctx.allow_unregistered_dialects = True
      module = ir.Module.parse(base64.b64decode(body))
      PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
      kernel = str(module)
    bounds = [
      int(b) for b in re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", kernel).group(1).split(",")
    ]
    semantics = re.search(r"dimension_semantics = \[([^\]]*)\]", kernel).group(1)
    parallel = [kind == "parallel" for kind in re.findall(r"dimension_semantics<(\w+)>", semantics)]
    if name not in grids or math.prod(bounds) < math.prod(grids[name]["bounds"]):
      grids[name] = {"bounds": bounds, "parallel": parallel}
  return grids


def report(compiled) -> dict:
  """What a compiled program shows: per-device memory, bytes per collective, each
  ring-step loop's overlap, and the kernels' grids (Triton launches on GPU, Mosaic
  grids on TPU)."""
  from jax_ring import hlo

  text = compiled.as_text()
  memory = compiled.memory_analysis()
  return {
    "temp_mib": memory.temp_size_in_bytes / 2**20,
    "argument_mib": memory.argument_size_in_bytes / 2**20,
    "output_mib": memory.output_size_in_bytes / 2**20,
    "collective_bytes": hlo.collective_bytes(text),
    "outside_loops": _outside_loops(text),
    # Copies and transposes outside every loop of 64 MiB and more: (op, bytes).
    "large_copies": hlo.loop_free_copies(text, 64 * 2**20),
    "ring_steps": [o._asdict() | {"overlapped": o.overlapped} for o in hlo.ring_overlap(text)],
    # Copies between a device and host memory in loops (remat "offload"), and the
    # compute under each.
    "host_transfers": [h._asdict() for h in hlo.host_transfers(text)],
    "collectives": [c._asdict() for c in hlo.collectives(text)],
    "launch_grids": launch_grids(text),
    "tpu_grids": tpu_grids(text) if "tpu_custom_call" in text else {},
    "custom_calls": custom_calls(text),
  }


def attention_hidden(report: dict) -> bool:
  """Every attention ring transfer of a `report`'s program, forward and backward (the
  loops named "... ring step" and the backward's "ring pass edges"), asynchronous and
  with compute under it. The vocabulary's "ring loop"s are not attention (the lookup's
  have no compute to hide under)."""
  steps = [s for s in report["ring_steps"] if s["name"].endswith(("ring step", "ring pass edges"))]
  return bool(steps) and all(s["synchronous"] == 0 and s["exposed"] == 0 for s in steps)


def transfers_hidden(report: dict) -> bool:
  """`attention_hidden`, and every copy between a device and its host's memory in the
  report's loops (remat "offload": "host_transfers") with compute under it, each copy
  back to the device started an iteration before the one that reads it (`prefetched`)."""
  copies = report.get("host_transfers", [])
  back = [c for c in copies if c["direction"] == "from host"]
  return (
    attention_hidden(report) and all(c["compute"] > 0 for c in copies) and all(c["prefetched"] for c in back)
  )


def _outside_loops(text: str) -> dict[str, list[int]]:
  """op -> [count, bytes per device] of the collectives outside every loop
  (`hlo.loop_free_collectives`)."""
  from jax_ring import hlo

  found: dict[str, list[int]] = {}
  for op, size in hlo.loop_free_collectives(text):
    entry = found.setdefault(op, [0, 0])
    entry[0] += 1
    entry[1] += size
  return found


def custom_calls(compiled) -> dict[str, int]:
  """How many custom calls of each target a compiled program makes (Triton kernels are
  "__gpu$xla.gpu.triton", Mosaic kernels "tpu_custom_call")."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  found: dict[str, int] = {}
  for name in re.findall(r'custom_call_target="([^"]+)"', text):
    found[name] = found.get(name, 0) + 1
  return found


def attention_flops(*, seq_len, heads, head_dim, batch=1, is_causal=True, backward=True) -> float:
  """Useful FLOPs of attention by formula (compile-only programs have no cost
  analysis): 4 B T² N H forward (two matmuls), 2.5x that with the backward (five),
  halved when causal."""
  forward = 4 * batch * seq_len**2 * heads * head_dim
  total = forward * (3.5 if backward else 1.0)
  return total / 2 if is_causal else total


def step_balance(report: dict, t: Target, *, seq_len, heads, kv_heads, head_dim, batch=1, is_causal=True):
  """Per ring loop of an attention program's `report`: the bytes a step sends (read from
  the compiled program) over the target's link against the step's FLOPs (by formula)
  at its peak rate, in microseconds. A step is communication-bound where the transfer
  takes longer: then the compute cannot hide it, however the schedule lies.

  The FLOPs of a step: the pass's (forward, or the backward's 2.5x) over the devices,
  the ring's steps (one per device) and the passes of kv heads (`BlockSizes`' default
  for the target and the kernel the program calls). Peak rates are an upper bound on
  speed, so these compute times are lower bounds and the verdict "compute-bound" is the
  cautious one."""
  from jax_ring._tiles import BlockSizes

  local = -(-seq_len // t.devices)
  platform = "gpu" if t.platform == "cuda" else t.platform
  # The ring step's kernel sets the default pass: cuDNN's calls (custom calls named
  # "__cudnn$fmha...") take more heads a pass than the Pallas kernels.
  cudnn = any("cudnn" in name for name in report.get("custom_calls", {}))
  tokens = BlockSizes().tokens_per_pass(platform, kernel="cudnn" if cudnn else None)
  passes = BlockSizes(pass_tokens=tokens).head_groups(kv_heads, local)
  shape = dict(seq_len=seq_len, heads=heads, head_dim=head_dim, batch=batch, is_causal=is_causal)
  forward = attention_flops(backward=False, **shape)
  per_step = {"forward": forward, "backward": 2.5 * forward}
  rows = []
  for loop in report["ring_steps"]:
    step_bytes = loop["hidden_bytes"] + loop["exposed_bytes"]
    direction = "backward" if loop["name"].startswith("backward") else "forward"
    is_step = loop["name"].endswith("ring step")
    flops = per_step[direction] / t.devices / t.devices / passes if is_step else None
    transfer_us = step_bytes / t.link_bytes_per_s * 1e6
    compute_us = None if flops is None else flops / t.peak_flops * 1e6
    rows.append(
      {
        "name": loop["name"],
        "bytes_per_step": step_bytes,
        "exposed_bytes": loop["exposed_bytes"],
        "transfer_us": transfer_us,
        "compute_us": compute_us,
        "bound": None if compute_us is None else ("communication" if transfer_us > compute_us else "compute"),
      }
    )
  return rows


def break_even_tokens(t: Target, *, heads, kv_heads, head_dim, is_causal=True, wire_bytes=2) -> dict:
  """Tokens per device below which a ring step's transfer takes longer than its compute
  at peak, forward and backward, by formula: a step of t tokens sends K and V (and on
  the backward dK and dV in float32) for t tokens, t (K H) values each, plus their int32
  positions, and computes 4 t² N H FLOPs forward (2.5x backward), halved when causal."""
  c = 0.5 if is_causal else 1.0
  forward_bytes = 2 * kv_heads * head_dim * wire_bytes + 4  # per token
  backward_bytes = forward_bytes + 2 * kv_heads * head_dim * 4
  flops_per_token2 = 4 * heads * head_dim * c  # a step's FLOPs / t², forward
  per = lambda nbytes, factor: nbytes * t.peak_flops / (factor * flops_per_token2 * t.link_bytes_per_s)
  return {"forward": per(forward_bytes, 1.0), "backward": per(backward_bytes, 2.5)}


def max_length(fits, low: int, high: int, granularity: int) -> int:
  """The largest multiple of `granularity` in [low, high] for which `fits(length)` is
  true, by bisection (`fits` monotone: true up to some length); 0 when `low` does not
  fit."""
  lo, hi = low // granularity, high // granularity
  if not fits(lo * granularity):
    return 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if fits(mid * granularity):
      lo = mid
    else:
      hi = mid - 1
  return lo * granularity
