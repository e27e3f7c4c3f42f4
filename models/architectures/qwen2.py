"""Qwen 2.5 (Qwen Team 2024, "Qwen2.5 Technical Report", arXiv 2412.15115): Llama's
pre-norm block with biases on the query, key and value projections (none on the output
projection or the MLP), no per-head norms. The 0.5B, 1.5B and 3B models tie the head to
the embedding; the 7B and larger do not. The -Instruct-1M models are the 7B's shape
with a rotary base of 10^7, an RMSNorm epsilon of 1e-5 and a context of 1,010,000
tokens ("Qwen2.5-1M Technical Report", arXiv 2501.15383).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

from jax_ring import nn as ring_nn

from . import llama, tables
from .decoder import CausalLM, PreNormBlock
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Qwen2", "Qwen2Config"]


@dataclasses.dataclass(frozen=True)
class Qwen2Config(llama.LlamaConfig):
  """Qwen 2.5's hyper-parameters (Llama's fields); the defaults are Qwen2.5-7B's."""

  model_type: ClassVar[str] = "qwen2"
  vocab_size: int = 152064
  dim: int = 3584
  num_layers: int = 28
  num_heads: int = 28
  num_kv_heads: int = 4
  mlp_hidden: int = 18944
  rope_base: float = 1_000_000.0
  rope_scaling: ring_nn.RopeScaling | None = None
  norm_eps: float = 1e-6
  context_length: int = 131072


class Qwen2(CausalLM):
  """Qwen 2.5: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    return PreNormBlock(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, qkv_bias=True)


_SMALL = dict(vocab_size=151936, tie_embeddings=True)
# Released configs: config.json of Qwen/Qwen2.5-0.5B, -1.5B, -3B, -7B, -14B, -32B,
# -72B and Qwen2.5-7B-Instruct-1M on Hugging Face.
CONFIGS = {
  "qwen2.5-0.5b": Qwen2Config(
    dim=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    mlp_hidden=4864,
    context_length=32768,
    **_SMALL,
  ),
  "qwen2.5-1.5b": Qwen2Config(dim=1536, num_heads=12, num_kv_heads=2, mlp_hidden=8960, **_SMALL),
  "qwen2.5-3b": Qwen2Config(
    dim=2048, num_layers=36, num_heads=16, num_kv_heads=2, mlp_hidden=11008, context_length=32768, **_SMALL
  ),
  "qwen2.5-7b": Qwen2Config(),
  "qwen2.5-7b-instruct-1m": Qwen2Config(rope_base=10_000_000.0, norm_eps=1e-5, context_length=1_010_000),
  "qwen2.5-14b": Qwen2Config(dim=5120, num_layers=48, num_heads=40, num_kv_heads=8, mlp_hidden=13824),
  "qwen2.5-32b": Qwen2Config(dim=5120, num_layers=64, num_heads=40, num_kv_heads=8, mlp_hidden=27648),
  "qwen2.5-72b": Qwen2Config(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_hidden=29568),
}


# Llama's tables and the three biases; llama.cpp keeps Qwen's rotary pairing (i, i + H/2).
HF_TENSORS = tables.table(tables.HF_NAMES, tables.LLAMA_PARTS + tables.QKV_BIASES)
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, tables.LLAMA_PARTS + tables.QKV_BIASES)


def config_from_hf(cfg, **overrides) -> Qwen2Config:
  """Qwen 2's config.json: Llama's keys (its q, k, v biases are the architecture's, not a
  key), no sliding windows (`use_sliding_window` true is refused; transformers 4.53 and
  later write `layer_types`, which must be all "full_attention").

  `dual_chunk_attention_config` (the -Instruct-1M models) configures vLLM's
  length extrapolation past the 262,144 tokens those models were trained at;
  transformers' Qwen2 does not read it, and neither does this loader, which runs exact
  attention at the config's rotary base (said in a warning)."""
  llama.full_attention_only(cfg, "Qwen 2.5")
  cfg.expect("use_mrope", False)  # Qwen2-VL's multimodal rotary sections; the text models write false
  if cfg.get("dual_chunk_attention_config") is not None:
    warnings.warn(
      f"{cfg.where}: dual_chunk_attention_config is vLLM's length extrapolation; like transformers, this "
      "loader runs exact attention over every token at the config's rope_theta",
      stacklevel=3,
    )
  return llama.config_from_hf(cfg, cls=Qwen2Config, **overrides)


def hf_config(config) -> dict:
  values = llama.hf_config(config) | dict(use_sliding_window=False)
  values.pop("attention_bias")  # Qwen 2's biases are not a key of its config
  values.pop("mlp_bias")
  return values


def config_from_gguf(gguf_file, **overrides) -> Qwen2Config:
  return llama.config_from_gguf(gguf_file, arch="qwen2", cls=Qwen2Config, **overrides)


# Llama's record (its ignored tensors) with Qwen 2's names, classes and tables.
ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="qwen2",
  config_class=Qwen2Config,
  model_class=Qwen2,
  configs=CONFIGS,
  hf=HFFormat(("qwen2",), "Qwen2ForCausalLM", HF_TENSORS, config_from_hf, hf_config),
  gguf=GGUFFormat("qwen2", GGUF_TENSORS, config_from_gguf),
)
