"""OLMo 2 (Team OLMo 2024, "2 OLMo 2 Furious", arXiv 2501.00656): a decoder whose
norms come after each sub-layer, x + norm(attn(x)) and x + norm(mlp(x)), with no norm
before them, and an RMSNorm over all heads' width on the projected queries and keys
([N x H] and [K x H]) before the rotary embeddings. SwiGLU MLP, no biases, an untied
head.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx

from jax_ring import nn as ring_nn

from . import llama, tables
from .decoder import CausalLM, GatedMLP, dtypes, feed_forward, rms_norm, rotary_attention
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Olmo2", "Olmo2Config"]


@dataclasses.dataclass(frozen=True)
class Olmo2Config(llama.LlamaConfig):
  """OLMo 2's hyper-parameters (Llama's fields); the defaults are OLMo-2-1124-7B's."""

  model_type: ClassVar[str] = "olmo2"
  vocab_size: int = 100352
  num_kv_heads: int = 32
  mlp_hidden: int = 11008
  rope_base: float = 500_000.0
  rope_scaling: ring_nn.RopeScaling | None = None
  norm_eps: float = 1e-6
  context_length: int = 4096


class PostNormBlock(nnx.Module):
  """x + norm(attn(x)), then x + norm(mlp(x)): OLMo 2's block."""

  def __init__(self, config, *, mesh, seq_axis, rngs: nnx.Rngs, batch_axis=None):
    dt, pdt = dtypes(config)
    over_heads = dict(qk_norm_epsilon=config.norm_eps, qk_norm_over_heads=True)
    self.attn = rotary_attention(
      config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, **over_heads
    )
    self.post_attn_norm = rms_norm(config, rngs=rngs)
    self.mlp = GatedMLP(config.dim, config.mlp_hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.post_mlp_norm = rms_norm(config, rngs=rngs)
    self.placement = nnx.static((mesh, seq_axis, batch_axis))

  def __call__(self, x, attend):
    x = x + self.post_attn_norm(attend(self.attn, x))
    mlp = lambda m, h: m[1](m[0](h))
    return x + feed_forward(mlp, (self.mlp, self.post_mlp_norm), x, self.placement)


class Olmo2(CausalLM):
  """OLMo 2: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    return PostNormBlock(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)


# Released configs: config.json of allenai/OLMo-2-0425-1B, OLMo-2-1124-7B and
# OLMo-2-1124-13B on Hugging Face.
CONFIGS = {
  "olmo-2-1b": Olmo2Config(dim=2048, num_layers=16, num_heads=16, num_kv_heads=16, mlp_hidden=8192),
  "olmo-2-7b": Olmo2Config(),
  "olmo-2-13b": Olmo2Config(dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, mlp_hidden=13824),
}

_PARTS = ("embed", "norm", "head", "query", "key", "value", "out", "gate", "up", "down")
_NORMS = ("query_norm", "key_norm", "post_attn_norm", "post_mlp_norm")
_HF_LAYER = "model.layers.{i}."
# transformers' names: the norm after attention keeps Llama's name for the norm before the MLP.
HF_NAMES = tables.HF_NAMES | {
  "post_attn_norm": _HF_LAYER + "post_attention_layernorm.weight",
  "post_mlp_norm": _HF_LAYER + "post_feedforward_layernorm.weight",
}
HF_TENSORS = tables.table(HF_NAMES, _PARTS + _NORMS)
# llama.cpp's olmo2: rotary pairs as Hugging Face's (no reordering of the rows).
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, _PARTS + _NORMS)


def config_from_hf(cfg, **overrides) -> Olmo2Config:
  """OLMo 2's config.json: Llama's keys (its `attention_bias` false, `rope_scaling` null,
  `pad_token_id`)."""
  cfg.expect("clip_qkv", None)  # OLMo 1's clipping of q, k, v; OLMo 2 sets none
  return llama.config_from_hf(cfg, cls=Olmo2Config, **overrides)


def hf_config(config) -> dict:
  values = llama.hf_config(config)
  values.pop("mlp_bias")  # not a key of OLMo 2's config
  return values


def config_from_gguf(gguf_file, **overrides) -> Olmo2Config:
  return llama.config_from_gguf(gguf_file, arch="olmo2", cls=Olmo2Config, **overrides)


ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="olmo2",
  config_class=Olmo2Config,
  model_class=Olmo2,
  configs=CONFIGS,
  # transformers' Olmo2Config: an epsilon of 1e-5 where a file gives none.
  hf=HFFormat(
    ("olmo2",), "Olmo2ForCausalLM", HF_TENSORS, config_from_hf, hf_config, defaults={"rms_norm_eps": 1e-5}
  ),
  gguf=GGUFFormat("olmo2", GGUF_TENSORS, config_from_gguf),
)
