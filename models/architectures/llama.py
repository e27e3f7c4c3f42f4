"""Llama 3 (Meta 2024, "The Llama 3 Herd of Models", arXiv 2407.21783): a pre-norm
decoder (RMSNorm, GQA attention with rotary embeddings, SwiGLU MLP) whose every layer
runs over the ring. Llama 3.1 and 3.2 stretch their rotary frequencies by the "llama3"
rule (`jax_ring.nn.RopeScaling`); the 3.2 1B and 3B models tie the head to the
embedding.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jax_ring import nn as ring_nn

from ..formats import config_json
from . import decoder, tables
from .decoder import CausalLM, PreNormBlock
from .record import Architecture, GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Llama", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama 3's hyper-parameters; the defaults are Llama 3.1 8B's."""

  model_type: ClassVar[str] = "llama"
  vocab_size: int = 128256
  dim: int = 4096
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  mlp_hidden: int = 14336
  rope_base: float = 500_000.0
  rope_scaling: ring_nn.RopeScaling | None = ring_nn.RopeScaling("llama3", factor=8.0)
  norm_eps: float = 1e-5
  context_length: int = 131072
  tie_embeddings: bool = False
  attention: str = "ring"
  attention_kernel: str = "auto"  # the ring's block kernel (`jax_ring.ring_attention`'s `kernel`)
  dtype: str | None = None
  param_dtype: str = "float32"

  def validate(self, mesh, seq_axis) -> None:
    decoder.check_config(self, mesh, seq_axis)


class Llama(CausalLM):
  """Llama 3: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    return PreNormBlock(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)


_LLAMA3_1 = ring_nn.RopeScaling("llama3", factor=8.0)
_LLAMA3_2 = ring_nn.RopeScaling("llama3", factor=32.0)
# Released configs: config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B
# and Llama-3.1-70B on Hugging Face.
CONFIGS = {
  "llama-3.2-1b": LlamaConfig(
    dim=2048, num_layers=16, head_dim=64, mlp_hidden=8192, rope_scaling=_LLAMA3_2, tie_embeddings=True
  ),
  "llama-3.2-3b": LlamaConfig(
    dim=3072, num_layers=28, num_heads=24, mlp_hidden=8192, rope_scaling=_LLAMA3_2, tie_embeddings=True
  ),
  "llama-3.1-8b": LlamaConfig(rope_scaling=_LLAMA3_1),
  "llama-3.1-70b": LlamaConfig(
    dim=8192, num_layers=80, num_heads=64, mlp_hidden=28672, rope_scaling=_LLAMA3_1
  ),
}

# llama.cpp reorders each query and key head's rows ("Tq", "Tk": `tables`).
HF_TENSORS = tables.table(tables.HF_NAMES, tables.LLAMA_PARTS)
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, tables.LLAMA_PARTS, {"query": "Tq", "key": "Tk"})
# Tensors a file may hold that the model does not use (its rotary frequencies, which
# the model computes; llama.cpp's Llama 3.1 factors are read as its config).
IGNORED = ("rope_freqs.weight", "model.layers.{i}.self_attn.rotary_emb.inv_freq")


def config_from_hf(cfg, cls=LlamaConfig, **overrides):
  """The config of a Llama (or Qwen 3: `cls`) config.json (`config_json.ConfigReader`)."""
  cfg.expect("hidden_act", "silu")
  cfg.expect("mlp_bias", False)
  cfg.expect("pretraining_tp", 1)
  theta, scaling = cfg.rope()
  return cls(
    **config_json.decoder_fields(cfg),
    rope_base=theta,
    rope_scaling=scaling,
    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    **overrides,
  )


def full_attention_only(cfg, family: str) -> None:
  """Refuses a config.json that makes any layer a sliding-window one (Qwen 2.5's and
  Qwen 3's): `use_sliding_window` true, or (transformers 4.53 and later) `layer_types`
  other than every layer "full_attention". `sliding_window` and `max_window_layers`
  matter only with `use_sliding_window`, so they are read and left."""
  cfg.expect("use_sliding_window", False)
  cfg.get("sliding_window")
  cfg.get("max_window_layers")
  types = cfg.get("layer_types")
  layers = cfg.int("num_hidden_layers")
  if types is not None and (
    not isinstance(types, list) or len(types) != layers or any(t != "full_attention" for t in types)
  ):
    raise ValueError(
      f"{cfg.where}: layer_types={types!r} must name {layers} layers, all full_attention: sliding-window "
      f"layers are not applied for {family}, so the checkpoint is refused"
    )


def hf_config(config) -> dict:
  return config_json.decoder_keys(config) | dict(
    hidden_act="silu",
    rope_scaling=config_json.rope_scaling_json(config.rope_scaling),
    mlp_bias=False,
    tie_word_embeddings=config.tie_embeddings,
  )


def config_from_gguf(gguf_file, arch="llama", cls=LlamaConfig, experts=None, **overrides):
  """The config a llama (or qwen3: `arch`, `cls`) GGUF file's metadata describes.
  `experts(reader) -> fields`: a mixture of experts' own fields, read from the same
  metadata (None: the file must have no experts)."""
  f = gguf_file.arch_reader(arch)
  if experts is None:
    f.expect("expert_count", 0)
    f.expect("expert_used_count", 0)
  else:
    overrides = experts(f) | overrides
  dim, heads = f.int("embedding_length"), f.int("attention.head_count")
  head_dim = int(f.get("attention.key_length", dim // heads))
  if f.get("attention.value_length", head_dim) != head_dim:
    raise ValueError(f"{arch}.attention.value_length != key_length in {str(gguf_file.path)!r}: not supported")
  if f.get("rope.dimension_count", head_dim) != head_dim:
    raise ValueError(
      f"{arch}.rope.dimension_count={f.get('rope.dimension_count')} of {str(gguf_file.path)!r}: rotary "
      f"embeddings on part of a head ({head_dim}) are not supported"
    )
  base = float(f.get("rope.freq_base", 10000.0))
  scaling = f.rope_scaling()
  if "rope_freqs.weight" in gguf_file.tensor_types:
    if scaling is not None:
      raise ValueError(f"{str(gguf_file.path)!r} has both rope.scaling.type and rope_freqs.weight")
    scaling = scaling_from_factors(np.asarray(gguf_file.tensor("rope_freqs.weight")), head_dim, base)
  return cls(**gguf_fields(f, gguf_file, head_dim, base, scaling), **overrides)


def gguf_fields(f, gguf_file, head_dim: int, rope_base: float, rope_scaling) -> dict:
  """The config fields the decoders read alike from a GGUF file's metadata (`f`, its
  `ArchReader`), with the head width and rotary embeddings the family worked out."""
  return dict(
    vocab_size=gguf_file.vocab_size,
    dim=f.int("embedding_length"),
    num_layers=f.int("block_count"),
    num_heads=f.int("attention.head_count"),
    num_kv_heads=f.int("attention.head_count_kv"),
    head_dim=head_dim,
    mlp_hidden=f.int("feed_forward_length"),
    rope_base=rope_base,
    rope_scaling=rope_scaling,
    norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-5)),
    context_length=f.int("context_length"),
    tie_embeddings="output.weight" not in gguf_file.tensor_types,
  )


def scaling_from_factors(factors, head_dim: int, base: float) -> ring_nn.RopeScaling:
  """llama.cpp's per-frequency divisors (`rope_freqs.weight`) as the "llama3" rule they
  came from, where one gives them (checked by recomputing them); else the divisors as
  they are (which `models.save` cannot write to config.json).

  The rule divides by 1 below one wavelength, by `factor` above another, and between
  them 1 / divisor = 1 / factor + s (1 - 1 / factor) with s = A / wavelength - B linear
  in 1 / wavelength, A = original_max_position_embeddings / (high - low), B = low /
  (high - low): two in-between frequencies give A and B, and low = 1 fixes the rest.
  With fewer, Llama 3.1's and 3.2's released values are tried."""
  factors = np.asarray(factors, np.float64)
  inv_freq = (1.0 / (base ** (np.arange(head_dim // 2) / (head_dim // 2)))).astype(np.float32)
  factor = float(factors.max())
  candidates = [ring_nn.RopeScaling("llama3", factor=f) for f in (8.0, 16.0, 32.0)]
  between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
  if between.sum() >= 2 and factor > 1:
    wavelength = 2 * np.pi / inv_freq.astype(np.float64)[between]
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    a, intercept = np.polyfit(1 / wavelength, smooth, 1)
    b = -intercept
    if a > 0 and b > 0:
      candidates.insert(
        0,
        ring_nn.RopeScaling(
          "llama3",
          factor=factor,
          low_freq_factor=1.0,
          high_freq_factor=float(1 + 1 / b),
          original_max_position_embeddings=round(a / b),
        ),
      )
  for rule in candidates:
    if np.allclose(np.asarray(rule.divisors(inv_freq)), factors, rtol=1e-5):
      return rule
  return ring_nn.RopeScaling("factors", factors=tuple(float(f) for f in factors))


def has_experts(gguf_file) -> bool:
  """Whether a GGUF file's metadata gives its architecture experts (llama.cpp writes
  Mixtral as "llama" with `llama.expert_count`)."""
  return bool(gguf_file.field(f"{gguf_file.architecture}.expert_count", 0))


ARCHITECTURE = Architecture(
  "llama",
  LlamaConfig,
  Llama,
  CONFIGS,
  hf=HFFormat(("llama",), "LlamaForCausalLM", HF_TENSORS, config_from_hf, hf_config),
  gguf=GGUFFormat("llama", GGUF_TENSORS, config_from_gguf, accepts=lambda f: not has_experts(f)),
  ignored=IGNORED,
)
