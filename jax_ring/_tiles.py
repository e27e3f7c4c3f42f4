"""Tiles inside a device: their sizes, and the reshapes between sequences and blocks.

Legend: B batch, T local (per-device) length, K kv heads, G = N // K query heads per
kv head, H head dim; bq / bk block lengths, nq / nk numbers of blocks.

    queries   [B, T, K, G, H]  <->  [nq, B, K, G, bq, H]    (block_q / unblock_q)
    keys      [B, T, K, H]     <->  [nk, B, K, bk, H]       (block_kv / unblock_kv)
    row stats [B, T, K, G]     <->  [nq, B, K, G, bq]       (block_rows / unblock_rows)
    ids       [B, T]           ->   [n, B, b]               (block_seg)
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

# Tile sizes when BlockSizes leaves them None: (block_q, block_kv) for CPU meshes with
# more devices than host cores (simulated devices, each program on a fraction of a
# core), and for everything else. Measured on a 2-core CPU (docs/benchmarks.md): with 8
# simulated devices 256 x 256 and 1024 x 512 ran level; with 1 or 2 devices 1024 x 512
# ran 1.2 to 1.8x faster than 256 x 256.
SHARED_CORE_TILES = (256, 256)
TILES = (1024, 512)
# On shared cores, a shard (not split into zigzag halves) of more than 256 and at most
# SHARED_CORE_WHOLE_Q tokens, a multiple of SHARED_CORE_SHORT_KV, is one query block
# against key blocks of SHARED_CORE_SHORT_KV: no tile then copies a query block, its
# accumulators or (backward) its residuals out of the shard. Full attention on 8
# devices of a 2-core CPU, against 256 x 256 in interleaved runs: T=8192 (1024 x 128)
# 0.93-0.99x the time forward and 0.93-0.97x forward+backward over four runs, T=4096
# (512 x 128) 0.96x and 0.95x; with the query side split (T=32768: 1024 x 128, T=2048:
# 256 x 128, causal halves: 512 x 128) it was level or slower, so those keep 256 x 256.
SHARED_CORE_WHOLE_Q = 1024
SHARED_CORE_SHORT_KV = 128
MIN_AUTO_TILE = 256
# Smallest automatic block that divides a shard exactly (below it, the shard is padded).
MIN_EXACT_TILE = 128
# Largest automatic score tile, in elements (batch x query heads of a pass x bq x bk):
# 4 MiB in float32. The forward keeps one such tile live, the backward about three;
# past this, short shards on few devices spent more on tiles than on their inputs
# (at T=1024 on one device, 4 heads x 1024 x 512 tiles took 26 of 34 MiB).
TILE_ELEMENTS = 1 << 20
# Tokens x kv heads per pass around the ring when BlockSizes.pass_tokens is None: on
# CPU, and elsewhere. Measured on a 2-core CPU with a 32 MiB L3 shared by the simulated
# devices (docs/benchmarks.md, issue 19, session 13): against 4096, passes of at most
# 512 tokens x heads took 0.80-1.02x the time forward+backward at every shape measured
# (0.88-0.96x at T=8192 on 8 devices), in 0.3-0.8x the memory; 128 or 256 (fewer heads
# at 128 tokens a device) were slower there, up to 1.5x causal. Elsewhere the 4096 of
# before stays (unmeasured: there a ring step's latency may weigh more than the cache).
CPU_PASS_TOKENS = 512
PASS_TOKENS = 4096
# On GPUs a pass holds more: the Pallas kernels launch a program per (block of 128
# queries or keys, query head), so 32K tokens x kv heads a pass give at least 256
# programs (an H100 has 132 SMs) at any shard length; unmeasured on a device.
GPU_PASS_TOKENS = 32768
# cuDNN's fused attention tiles each call itself and keeps its scores on chip: a pass
# costs only its float32 accumulators (output, lse, dq, dk, dv: about 5 x 4 bytes x
# tokens x heads x head dim), so a ring step with cuDNN takes every kv head of a shard
# up to 256K tokens x kv heads (Llama-3.2-1B's 8 kv heads at 32K) in one call: fewer,
# larger calls and no slicing of heads.
CUDNN_PASS_TOKENS = 262144


def default_tiles(
  platform: str, devices: int, cores: int | None = None, unit: int | None = None
) -> tuple[int, int]:
  """(block_q, block_kv) for `devices` running at once on `platform`; `unit`: the
  shard length the blocks divide, when it is not split into zigzag halves."""
  cores = (os.cpu_count() or 1) if cores is None else cores
  if platform != "cpu" or devices <= cores:
    return TILES
  if unit is not None and MIN_AUTO_TILE < unit <= SHARED_CORE_WHOLE_Q and unit % SHARED_CORE_SHORT_KV == 0:
    return unit, SHARED_CORE_SHORT_KV
  return SHARED_CORE_TILES


def mesh_platform() -> str:
  """The platform of the devices of the mesh being traced under (a `shard_map`'s or
  `jax.set_mesh`'s), else JAX's default backend: so a program compiled on a CPU host
  for GPUs or TPUs (`jax.experimental.topologies`) gets their defaults, not the host's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return getattr(device, "platform", None) or jax.default_backend()


def devices_here(mesh_size: int) -> int:
  """How many devices of a mesh of `mesh_size` run on this process's cores: in a
  multi-process run the mesh spans every process, but each drives only its own."""
  return max(1, min(mesh_size, jax.local_device_count()))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key block lengths inside a device.

  No score tile larger than [block_q x block_kv] exists per head. None (the default)
  picks per call (`default_tiles`): 256 x 256 on a CPU mesh with more devices than
  cores (there a shard of 257 to 1024 tokens, a multiple of 128, not in zigzag halves,
  is one query block against key blocks of 128, and so is a causal zigzag shard of at
  most 1024 tokens whose steps run by quadrants, `quadrant_tiles`), else 1024 x 512;
  then the largest
  divisor of the local length up to that size (a multiple of 8, at least 128), or,
  where there is none, the size halved (not below 256) until it divides the length
  rounded up to 256; then halved (not below 128)
  while a score tile (batch x query heads of a pass x block_q x block_kv) is over
  TILE_ELEMENTS.
  """

  block_q: int | None = None
  block_kv: int | None = None
  # KV heads (with their query heads) per pass around the ring. Fewer heads per pass
  # shrink the ring's per-device buffers (blocked copies, K/V and dK/dV in flight,
  # accumulators) by the same factor; more amortize the fixed cost of each ring step,
  # which dominates short shards. None picks per call: the most heads (a divisor of the
  # local kv heads, at least 1) whose local length x heads is at most `pass_tokens`
  # (`tokens_per_pass`: None is CPU_PASS_TOKENS on CPU, GPU_PASS_TOKENS on GPU, else
  # PASS_TOKENS; the platform is the mesh's, `mesh_platform`).
  # Dilated attention's local patterns run in chunks of at most `pass_tokens` tokens x
  # kv heads (at least one segment of each; `_dilated.local_chunk`).
  kv_heads: int | None = None
  pass_tokens: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv", "kv_heads", "pass_tokens"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int or None")

  def tokens_per_pass(self, platform: str | None = None, kernel: str | None = None) -> int:
    """`pass_tokens`, or where None the default of `platform` (`mesh_platform()`) and
    the ring step's `kernel` ("cudnn": CUDNN_PASS_TOKENS)."""
    if self.pass_tokens is not None:
      return self.pass_tokens
    if kernel == "cudnn":
      return CUDNN_PASS_TOKENS
    platform = mesh_platform() if platform is None else platform
    match platform:
      case "cpu":
        return CPU_PASS_TOKENS
      case "gpu" | "cuda" | "rocm":
        return GPU_PASS_TOKENS
      case _:
        return PASS_TOKENS

  def head_groups(self, num_kv_heads: int, local_length: int, kernel: str | None = None) -> int:
    """How many passes `num_kv_heads` local kv heads take for a shard of `local_length`
    (`kernel`: the ring step's, as `tokens_per_pass` takes it)."""
    if self.kv_heads is None:
      most = self.tokens_per_pass(kernel=kernel)
      fits = [h for h in range(1, num_kv_heads + 1) if num_kv_heads % h == 0 and h * local_length <= most]
      return num_kv_heads // max(fits, default=1)
    if self.kv_heads >= num_kv_heads:
      return 1
    if num_kv_heads % self.kv_heads:  # e.g. kv_heads=2 with 3 heads on a device
      raise ValueError(
        f"BlockSizes.kv_heads={self.kv_heads} must divide the number of kv heads on a device, {num_kv_heads}"
      )
    return num_kv_heads // self.kv_heads


def check_block_sizes(block_sizes) -> BlockSizes:
  """None -> the defaults; anything but a BlockSizes is a TypeError."""
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes={block_sizes!r} must be a jax_ring.BlockSizes or None")
  return block_sizes


def _exact_block(unit: int, auto: int) -> int | None:
  """The largest divisor of `unit` that is at most `auto`, a multiple of 8 and at least
  MIN_EXACT_TILE (or `unit` itself when it is at most `auto`); None if there is none."""
  if unit <= auto:
    return unit
  for d in range(auto - auto % 8, MIN_EXACT_TILE - 1, -8):
    if unit % d == 0:
      return d
  return None


def local_blocks(
  length: int, bs: BlockSizes, devices: int | None = None, layout: str | None = None
) -> tuple[int, int, int]:
  """(padded local length, block_q, block_kv) so both blocks divide the length.

  `devices` is how many devices run at once on this process's cores (default: those
  of the current mesh that this process drives, `devices_here`).
  Automatic blocks divide the length itself where they can (the largest divisor up to
  the default tile that is a multiple of 8, not below MIN_EXACT_TILE): no padding, so
  no mask arithmetic. Otherwise the length is rounded up to a multiple of 256 and the
  blocks are the default tile, halved until they divide it.
  Under the zigzag layout, blocks stay within one of the shard's two halves where they
  can, so the causal mask can skip whole tiles.
  """
  if devices is None:
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else devices_here(mesh.size)
  halves = layout == "zigzag" and length % 2 == 0
  unit = length // 2 if halves else length
  auto_q, auto_kv = default_tiles(mesh_platform(), devices, unit=None if halves else unit)
  exact = [
    b if b is not None else _exact_block(unit, a) for b, a in ((bs.block_q, auto_q), (bs.block_kv, auto_kv))
  ]
  if None not in exact and length % exact[0] == 0 and length % exact[1] == 0:
    return length, exact[0], exact[1]

  rounded = length if length <= MIN_AUTO_TILE else -(-length // MIN_AUTO_TILE) * MIN_AUTO_TILE

  def fit(block, auto):
    """A given block as is; else the whole length if short, or the largest of auto,
    auto / 2, ..., 256 that divides the length rounded up to 256."""
    if block is not None:
      return block
    auto = min(auto, rounded)
    if halves and rounded % (length // 2) == 0:
      auto = min(auto, length // 2)
    while rounded % auto:
      auto //= 2
    return auto

  want_q, want_kv = fit(bs.block_q, auto_q), fit(bs.block_kv, auto_kv)
  padded = length if bs.block_q and bs.block_kv else rounded
  while True:
    bq, bk = min(want_q, padded), min(want_kv, padded)
    if padded % bq == 0 and padded % bk == 0:
      return padded, bq, bk
    padded = -(-padded // math.lcm(bq, bk)) * math.lcm(bq, bk)


def quadrant_tiles(
  length: int, rows: int, bs: BlockSizes, devices: int | None = None
) -> tuple[int, int] | None:
  """(block_q, block_kv) = (length, SHARED_CORE_SHORT_KV) when a causal zigzag shard
  of `length` tokens runs by quadrants (`_ring.RingConfig.quadrants`), else None.

  That is where full attention's shard is one query block (`default_tiles`): on a CPU
  mesh with more devices than cores, automatic blocks, a shard of at most
  SHARED_CORE_WHOLE_Q tokens whose halves are whole key blocks, and a score tile of
  `rows` (batch x query heads of a pass) x length x block_kv within TILE_ELEMENTS.
  Measured on 8 devices of a 2-core CPU against the halves' 256 x 256 tiles, in
  interleaved rounds (docs/benchmarks.md): causal at T=8192 took 0.91-0.92x their
  forward time and 0.96-0.97x their forward+backward in two runs; at T=32768
  (4096-token shards, one block then too large for the cache) 1.09x their
  forward+backward in 3 rounds, so longer shards keep them.
  """
  if devices is None:
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else devices_here(mesh.size)
  bk = SHARED_CORE_SHORT_KV
  automatic = bs.block_q is None and bs.block_kv is None
  shared = mesh_platform() == "cpu" and devices > (os.cpu_count() or 1)
  fits = length <= SHARED_CORE_WHOLE_Q and length % (2 * bk) == 0 and rows * length * bk <= TILE_ELEMENTS
  return (length, bk) if automatic and shared and fits else None


def fit_tile_budget(bq: int, bk: int, rows: int, bs: BlockSizes) -> tuple[int, int]:
  """(bq, bk), the automatic ones halved (the larger first, not below MIN_EXACT_TILE)
  until a score tile of `rows` (batch x query heads per pass) x bq x bk elements is at
  most TILE_ELEMENTS. Halves of a block still divide the length it divided."""
  halvable = lambda block, given: given is None and block % 2 == 0 and block // 2 >= MIN_EXACT_TILE
  while rows * bq * bk > TILE_ELEMENTS:
    if halvable(bq, bs.block_q) and (bq >= bk or not halvable(bk, bs.block_kv)):
      bq //= 2
    elif halvable(bk, bs.block_kv):
      bk //= 2
    else:
      break
  return bq, bk


def block_q(x, n):
  """Queries or their like [B, T, K, G, H] -> blocks [T // n, B, K, G, n, H]."""
  b, t, kh, g, h = x.shape
  return x.reshape(b, t // n, n, kh, g, h).transpose(1, 0, 3, 4, 2, 5)


def unblock_q(x):
  """[nq, B, K, G, n, H] -> [B, nq * n, K, G, H]."""
  nq, b, kh, g, n, h = x.shape
  return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * n, kh, g, h)


def block_kv(x, n):
  """Keys or values [B, T, K, H] -> blocks [T // n, B, K, n, H]."""
  b, t, kh, h = x.shape
  return x.reshape(b, t // n, n, kh, h).transpose(1, 0, 3, 2, 4)


def unblock_kv(x):
  """[nk, B, K, n, H] -> [B, nk * n, K, H]."""
  nk, b, kh, n, h = x.shape
  return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * n, kh, h)


def block_seg(x, n):
  """Segment ids [B, T] -> [T // n, B, n]; None stays None."""
  return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], -1, n), 1, 0)


def block_rows(x, block: int):
  """Per-row statistics [B, T, K, G] -> blocked [nq, B, K, G, bq] (the lse layout)."""
  b, t, kh, g = x.shape
  return x.reshape(b, t // block, block, kh, g).transpose(1, 0, 3, 4, 2)


def unblock_rows(x):
  """Blocked statistics [nq, B, K, G, bq] -> [B, T, K, G]."""
  nq, b, kh, g, n = x.shape
  return x.transpose(1, 0, 4, 2, 3).reshape(b, nq * n, kh, g)
