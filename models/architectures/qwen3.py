"""Qwen 3 (Qwen Team 2025, "Qwen3 Technical Report", arXiv 2505.09388), the dense
models: Llama's pre-norm block with an RMSNorm on each query and key head before the
rotary embeddings, and no biases. The small models tie the head to the embedding.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax_ring import nn as ring_nn

from . import llama, tables
from .decoder import CausalLM, PreNormBlock
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Qwen3", "Qwen3Config"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config(llama.LlamaConfig):
  """Qwen 3's hyper-parameters (Llama's fields); the defaults are Qwen3-8B's."""

  model_type: ClassVar[str] = "qwen3"
  vocab_size: int = 151936
  num_layers: int = 36
  mlp_hidden: int = 12288
  rope_base: float = 1_000_000.0
  rope_scaling: ring_nn.RopeScaling | None = None
  norm_eps: float = 1e-6
  context_length: int = 40960


class Qwen3(CausalLM):
  """Qwen 3: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    return PreNormBlock(
      config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, qk_norm_epsilon=config.norm_eps
    )


# Released configs: config.json of Qwen/Qwen3-0.6B, Qwen3-1.7B, Qwen3-4B and Qwen3-8B
# on Hugging Face.
CONFIGS = {
  "qwen3-0.6b": Qwen3Config(dim=1024, num_layers=28, num_heads=16, mlp_hidden=3072, tie_embeddings=True),
  "qwen3-1.7b": Qwen3Config(dim=2048, num_layers=28, num_heads=16, mlp_hidden=6144, tie_embeddings=True),
  "qwen3-4b": Qwen3Config(dim=2560, num_layers=36, mlp_hidden=9728, tie_embeddings=True),
  "qwen3-8b": Qwen3Config(),
}


# Llama's tables and the per-head norms; llama.cpp keeps Qwen's rotary pairing (i, i + H/2).
HF_TENSORS = tables.table(tables.HF_NAMES, tables.LLAMA_PARTS + tables.QK_NORMS)
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, tables.LLAMA_PARTS + tables.QK_NORMS)


def config_from_hf(cfg, **overrides) -> Qwen3Config:
  """Qwen 3's config.json: Llama's keys, no sliding windows. transformers 4.53 and later
  write `layer_types`, every layer "full_attention" without `use_sliding_window`
  (which is refused); a sliding layer among them is refused too."""
  llama.full_attention_only(cfg, "Qwen 3")
  return llama.config_from_hf(cfg, cls=Qwen3Config, **overrides)


def hf_config(config) -> dict:
  return llama.hf_config(config) | dict(use_sliding_window=False)


def config_from_gguf(gguf_file, **overrides) -> Qwen3Config:
  return llama.config_from_gguf(gguf_file, arch="qwen3", cls=Qwen3Config, **overrides)


# Llama's record (its ignored tensors) with Qwen 3's names, classes and tables.
ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="qwen3",
  config_class=Qwen3Config,
  model_class=Qwen3,
  configs=CONFIGS,
  hf=HFFormat(("qwen3",), "Qwen3ForCausalLM", HF_TENSORS, config_from_hf, hf_config),
  gguf=GGUFFormat("qwen3", GGUF_TENSORS, config_from_gguf),
)
