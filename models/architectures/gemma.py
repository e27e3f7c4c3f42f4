"""Gemma 3 (text): a decoder whose attention layers are ring attention over a mesh.

Per layer: RMSNorm -> attention (GQA; an RMSNorm on each query and key head, then
rotary embeddings) -> RMSNorm -> residual add; RMSNorm -> GeGLU MLP (tanh GELU) ->
RMSNorm -> residual add. Every `global_every`-th layer attends to every token before it
with RoPE base `rope_base`; the others see a window of `window` tokens (the token and
the window - 1 before it) with base `local_rope_base`. Embeddings are scaled by
sqrt(dim) and tied to the output head. (Gemma Team 2025, "Gemma 3 Technical Report",
arXiv 2503.19786.)

Attention "ring" runs every layer over the mesh: windowed layers in the contiguous
layout, whose ring stops after the steps the window reaches (one neighbour when a
device holds at least window - 1 tokens), global layers in the balanced causal layout.
"dense" is `jax.nn.dot_product_attention` on one device (the reference), "local" each
shard attending within itself.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
from flax import nnx

from jax_ring import nn as ring_nn

from ..formats import config_json
from . import decoder, tables
from .decoder import ATTENTION_KINDS, CausalLM
from .record import Architecture, GGUFFormat, HFFormat

__all__ = ["ATTENTION_KINDS", "CONFIGS", "Gemma", "GemmaConfig"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """Gemma 3's hyper-parameters; the defaults are Gemma 3 270M's.

  rope_scaling: a `jax_ring.nn.RopeScaling` of the global layers' frequencies (Gemma 3
  4B, 12B and 27B: linear, factor 8); the windowed layers are never scaled.
  query_pre_attn_scalar: logits are scaled by its -1/2 power (None: head_dim's; 27B:
  168 for head_dim 128)."""

  model_type: ClassVar[str] = "gemma3_text"
  vocab_size: int = 262144
  dim: int = 640
  num_layers: int = 18
  num_heads: int = 4
  num_kv_heads: int = 1
  head_dim: int = 256
  mlp_hidden: int = 2048
  window: int = 512  # a windowed layer's query sees itself and the window - 1 tokens before it
  global_every: int = 6  # layers global_every - 1, 2 * global_every - 1, ... attend to everything
  rope_base: float = 1_000_000.0  # global layers
  local_rope_base: float = 10_000.0  # windowed layers
  rope_scaling: ring_nn.RopeScaling | None = None  # global layers
  query_pre_attn_scalar: float | None = None
  norm_eps: float = 1e-6
  context_length: int = 32768
  tie_embeddings: bool = True
  attention: str = "ring"
  attention_kernel: str = "auto"  # the ring's block kernel (`jax_ring.ring_attention`'s `kernel`)
  dtype: str | None = None  # compute dtype (None: float32)
  param_dtype: str = "float32"

  def is_global(self, layer: int) -> bool:
    return (layer + 1) % self.global_every == 0

  def validate(self, mesh, seq_axis) -> None:
    decoder.check_config(self, mesh, seq_axis, extra_ints=("window", "global_every"))
    if self.tie_embeddings is not True:
      raise ValueError(f"GemmaConfig.tie_embeddings={self.tie_embeddings!r}: Gemma 3's head is its embedding")
    scalar = self.query_pre_attn_scalar
    if scalar is not None and not (isinstance(scalar, (int, float)) and scalar > 0):
      raise ValueError(f"GemmaConfig.query_pre_attn_scalar={scalar!r} must be a positive number or None")


gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)
GemmaAttention = decoder.Attention


class GemmaBlock(nnx.Module):
  def __init__(self, config: GemmaConfig, layer: int, *, mesh, seq_axis, rngs: nnx.Rngs, batch_axis=None):
    dt, pdt = decoder.dtypes(config)
    norm = lambda: decoder.rms_norm(config, rngs=rngs)
    is_global = config.is_global(layer)
    scalar = config.query_pre_attn_scalar
    self.attn_norm = norm()
    self.attn = decoder.make_attention(
      config,
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      rngs=rngs,
      local_window_size=None if is_global else (config.window - 1, 0),
      # A window's ring stops where the window ends only in the contiguous layout.
      layout="auto" if is_global else "contiguous",
      rope_base=config.rope_base if is_global else config.local_rope_base,
      rope_scaling=config.rope_scaling if is_global else None,
      qk_norm_epsilon=config.norm_eps,
      query_scale=1.0 if scalar is None else (config.head_dim / scalar) ** 0.5,
    )
    self.post_attn_norm = norm()
    self.mlp_norm = norm()
    self.mlp = decoder.GatedMLP(
      config.dim, config.mlp_hidden, activation=gelu_tanh, dtype=dt, param_dtype=pdt, rngs=rngs
    )  # GeGLU
    self.post_mlp_norm = norm()
    self.placement = nnx.static((mesh, seq_axis, batch_axis))

  def __call__(self, x, attend):
    x = x + self.post_attn_norm(attend(self.attn, self.attn_norm(x)))
    mlp = lambda m, h: m[2](m[1](m[0](h)))
    return x + decoder.feed_forward(mlp, (self.mlp_norm, self.mlp, self.post_mlp_norm), x, self.placement)


class Gemma(CausalLM):
  """Gemma 3: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`);
  embeddings scaled by sqrt(D), the head tied to them."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    return GemmaBlock(config, layer, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)

  embed_scale = staticmethod(decoder.embed_scale_sqrt_dim)


# Released configs (config.json of each google/gemma-3-* repository on Hugging Face;
# the 4B, 12B and 27B values are their "text_config"s).
CONFIGS = {
  "gemma-3-270m": GemmaConfig(),
  "gemma-3-1b": GemmaConfig(dim=1152, num_layers=26, mlp_hidden=6912),
  "gemma-3-4b": GemmaConfig(
    vocab_size=262208,
    dim=2560,
    num_layers=34,
    num_heads=8,
    num_kv_heads=4,
    mlp_hidden=10240,
    window=1024,
    rope_scaling=ring_nn.RopeScaling("linear", factor=8.0),
    context_length=131072,
  ),
  "gemma-3-12b": GemmaConfig(
    vocab_size=262208,
    dim=3840,
    num_layers=48,
    num_heads=16,
    num_kv_heads=8,
    mlp_hidden=15360,
    window=1024,
    rope_scaling=ring_nn.RopeScaling("linear", factor=8.0),
    context_length=131072,
  ),
  "gemma-3-27b": GemmaConfig(
    vocab_size=262208,
    dim=5376,
    num_layers=62,
    num_heads=32,
    num_kv_heads=16,
    head_dim=128,
    mlp_hidden=21504,
    window=1024,
    rope_scaling=ring_nn.RopeScaling("linear", factor=8.0),
    query_pre_attn_scalar=168.0,
    context_length=131072,
  ),
}

_PARTS = (
  "embed", "norm", "attn_norm", "query", "key", "value", "query_norm", "key_norm", "out",
  "post_attn_norm", "mlp_norm", "gate", "up", "down", "post_mlp_norm",
)  # fmt: skip
_NORMS = ("norm", "attn_norm", "query_norm", "key_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
# Hugging Face stores Gemma's RMSNorm weights as w for x * (1 + w) ("+1"); llama.cpp as
# 1 + w. Gemma 3 norms the attention's output and the MLP's, and calls the MLP's
# input norm pre_feedforward_layernorm.
HF_TENSORS = tables.table(
  tables.HF_NAMES
  | {
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
  },
  _PARTS,
  dict.fromkeys(_NORMS, "+1"),
)
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, _PARTS)
# Gemma 3's text defaults (transformers' Gemma3TextConfig), for the keys a file (a
# multimodal folder's text_config among them) leaves out.
HF_DEFAULTS = dict(
  vocab_size=262208,
  hidden_size=2304,
  intermediate_size=9216,
  num_hidden_layers=26,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=256,
  rms_norm_eps=1e-6,
  rope_theta=1_000_000.0,
  rope_local_base_freq=10_000.0,
  sliding_window=4096,
  query_pre_attn_scalar=256,
  max_position_embeddings=131072,
)


def config_from_hf(cfg, **overrides) -> GemmaConfig:
  """The GemmaConfig of a Gemma 3 config.json (`config_json.ConfigReader`); every key that
  changes the computation is applied or refused."""
  cfg.expect("hidden_activation", "gelu_pytorch_tanh", also=("hidden_act",))
  cfg.expect("final_logit_softcapping", None)
  cfg.expect("attn_logit_softcapping", None)
  cfg.expect("use_bidirectional_attention", False)
  fields = config_json.decoder_fields(cfg)
  global_every = layer_period(cfg, fields["num_layers"])
  full, full_scaling = cfg.rope("full_attention")
  local, local_scaling = cfg.rope("sliding_attention", default_theta=cfg.get("rope_local_base_freq", 10000.0))
  if local_scaling is not None:
    raise ValueError(
      f"{cfg.where}: rope scaling on the sliding-window layers is not supported (Gemma 3 has none)"
    )
  scalar = cfg.get("query_pre_attn_scalar", fields["head_dim"])
  return GemmaConfig(
    **fields,
    window=cfg.int("sliding_window"),
    global_every=int(global_every),
    rope_base=full,
    local_rope_base=local,
    rope_scaling=full_scaling,
    query_pre_attn_scalar=None if float(scalar) == fields["head_dim"] else float(scalar),
    **overrides,
  )


def layer_period(cfg, layers: int) -> int:
  """Every k-th layer is global: k as transformers reads it. `layer_types` (4.53 and
  later) where given, else `sliding_window_pattern` (6 where absent). transformers 4.54
  and later also write `_sliding_window_pattern`, an attribute set from
  `sliding_window_pattern` (6 where absent) that no version reads back: it is read and
  left, as transformers leaves it. A `sliding_window_pattern` that disagrees with
  `layer_types` (which transformers would follow) is refused: the file says two things."""
  cfg.get("_sliding_window_pattern")
  pattern = cfg.get("sliding_window_pattern")
  if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1):
    raise ValueError(f"{cfg.where}: sliding_window_pattern={pattern!r} must be a positive int")
  types = cfg.get("layer_types")
  if types is None:
    return 6 if pattern is None else pattern
  period = hf_global_every(types, layers)
  if pattern is not None and pattern != period:
    raise ValueError(
      f"{cfg.where}: sliding_window_pattern={pattern} disagrees with layer_types={types!r} (a global "
      f"layer every {period}); the checkpoint is refused"
    )
  return period


def hf_global_every(types, layers: int) -> int:
  """The period of a `layer_types` list whose every k-th layer is "full_attention"."""
  full = [i for i, t in enumerate(types) if t == "full_attention"]
  if len(types) != layers or not full or any(t not in ("full_attention", "sliding_attention") for t in types):
    raise ValueError(
      f"layer_types={types!r} must name {layers} layers as full_attention or sliding_attention"
    )
  k = full[0] + 1
  if full != list(range(k - 1, layers, k)):
    raise ValueError(f"layer_types={types!r}: only every k-th layer global (a period) is supported")
  return k


def hf_config(config: GemmaConfig) -> dict:
  """config.json for `config`, as transformers writes a Gemma3ForCausalLM's."""
  types = ["full_attention" if config.is_global(i) else "sliding_attention" for i in range(config.num_layers)]
  return config_json.decoder_keys(config) | dict(
    hidden_activation="gelu_pytorch_tanh",
    rope_local_base_freq=config.local_rope_base,
    rope_scaling=config_json.rope_scaling_json(config.rope_scaling),
    sliding_window=config.window,
    sliding_window_pattern=config.global_every,
    layer_types=types,
    query_pre_attn_scalar=_as_int("query_pre_attn_scalar", config.query_pre_attn_scalar or config.head_dim),
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    tie_word_embeddings=True,
  )


def _as_int(name: str, value) -> int:
  """A field transformers declares an int (its strict config classes refuse 256.0)."""
  if float(value) != int(value):
    raise ValueError(
      f"GemmaConfig.{name}={value!r}: config.json holds an int here (transformers declares it so)"
    )
  return int(value)


def config_from_gguf(gguf_file, **overrides) -> GemmaConfig:
  """The GemmaConfig a gemma3 GGUF file's metadata describes."""
  f = gguf_file.arch_reader("gemma3")
  f.expect("final_logit_softcapping", None)
  f.expect("attn_logit_softcapping", None)
  key_len, value_len = f.int("attention.key_length"), f.int("attention.value_length")
  if key_len != value_len:
    raise ValueError(f"gemma3.attention.key_length={key_len} != value_length={value_len}: not supported")
  layers, dim, heads = f.int("block_count"), f.int("embedding_length"), f.int("attention.head_count")
  # llama.cpp scales the 27B model's queries by (dim / heads)^-1/2 and the others' by
  # head_dim^-1/2 (llama-model.cpp, LLM_ARCH_GEMMA3); the 27B has 62 layers.
  scalar = dim / heads if layers == 62 else None
  pattern = f.get("attention.sliding_window_pattern", 6)
  if isinstance(pattern, list):  # per layer: True where the layer is windowed
    pattern = hf_global_every(["sliding_attention" if w else "full_attention" for w in pattern], layers)
  return GemmaConfig(
    vocab_size=gguf_file.vocab_size,
    dim=dim,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=f.int("attention.head_count_kv"),
    head_dim=key_len,
    mlp_hidden=f.int("feed_forward_length"),
    window=f.int("attention.sliding_window"),
    global_every=int(pattern),
    rope_base=float(f.get("rope.freq_base", 1_000_000.0)),
    rope_scaling=f.rope_scaling(),
    query_pre_attn_scalar=scalar,
    norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
    context_length=f.int("context_length"),
    **overrides,
  )


ARCHITECTURE = Architecture(
  "gemma3",
  GemmaConfig,
  Gemma,
  CONFIGS,
  hf=HFFormat(
    ("gemma3_text",),
    "Gemma3ForCausalLM",
    HF_TENSORS,
    config_from_hf,
    hf_config,
    defaults=HF_DEFAULTS,
    multimodal=("gemma3",),
    # Where a multimodal folder keeps the text model's tensors (transformers 4.x, 5.x).
    text_prefixes=("language_model.model.", "model.language_model."),
  ),
  gguf=GGUFFormat("gemma3", GGUF_TENSORS, config_from_gguf),
)
