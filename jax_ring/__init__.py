"""jax_ring: exact ring attention and LongNet dilated attention for sharded JAX meshes.

Legend used in every docstring: B batch, T query length, S key length, N query heads,
K key/value heads, G = N // K query heads per kv head, H head dim.
"""

__version__ = "0.2.0"

from jax_ring import hlo, layouts
from jax_ring._attention import ring_attention, ring_attention_shard
from jax_ring._choice import KernelChoice, choose_kernel
from jax_ring._decode import (
  KVCache,
  decode_attention,
  decode_attention_shard,
  init_cache,
  prefill_attention,
  update_cache,
)
from jax_ring._dilated import dilated_attention
from jax_ring._merge import merge_attention
from jax_ring._mods import alibi_slopes
from jax_ring._policy import PRESETS, Policy, policy_for
from jax_ring._reference import reference_attention, reference_dilated_attention
from jax_ring._ring import sent_together
from jax_ring._tiles import BlockSizes, mesh_platform
from jax_ring._topology import ring_mesh
from jax_ring._work import work_report


def __getattr__(name: str):
  """`jax_ring.nn` (the Flax modules), `jax_ring.models` and `jax_ring.aot` on first
  use: `import jax_ring` alone does not import Flax."""
  if name in ("nn", "models", "aot"):
    import importlib

    return importlib.import_module(f"jax_ring.{name}")
  raise AttributeError(f"module 'jax_ring' has no attribute {name!r}")


__all__ = [
  "KVCache",
  "alibi_slopes",
  "decode_attention",
  "decode_attention_shard",
  "init_cache",
  "prefill_attention",
  "update_cache",
  "PRESETS",
  "BlockSizes",
  "KernelChoice",
  "Policy",
  "choose_kernel",
  "dilated_attention",
  "hlo",
  "layouts",
  "merge_attention",
  "mesh_platform",
  "nn",
  "policy_for",
  "reference_attention",
  "reference_dilated_attention",
  "sent_together",
  "ring_attention",
  "ring_attention_shard",
  "ring_mesh",
  "work_report",
]
