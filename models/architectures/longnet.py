"""A LongNet-style decoder (Ding et al. 2023) on jax_ring's dilated attention.

As in LongNet's official implementation (torchscale, built on Magneto): pre-LayerNorm
blocks with a sub-layer LayerNorm inside both sub-layers (on the attention output
before its projection, and on the FFN's hidden layer before its second matmul), GELU
feed-forward, and dilated attention with patterns (segment length, dilation rate).
Positions are rotary (from global positions) instead of LongNet's xPos.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jax_ring import nn as ring_nn

from .scratch import NO_LIMIT, DecoderLM


@dataclasses.dataclass(frozen=True)
class LongNetConfig:
  vocab_size: int
  dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int | None = None
  ffn_hidden: int = 256
  segment_lengths: tuple[int, ...] = (64, 128, 256)
  dilation_rates: tuple[int, ...] = (1, 2, 4)
  rope_base: float = 10000.0
  reference: bool = False  # dense reference dilated attention (tests)
  policy: str | None = None

  # What the shared decoder (`decoder.CausalLM`, through `DecoderLM`) reads of every config.
  dtype = None
  param_dtype = "float32"
  tie_embeddings = False
  conv = 0
  ulysses_axis = None
  ring_order = None
  scan_layers = False
  context_length = NO_LIMIT

  @property
  def attention(self) -> str:
    return "dilated_dense" if self.reference else "dilated"

  def validate(self, mesh=None, seq_axis="seq") -> None:
    for name in ("vocab_size", "dim", "num_layers", "num_heads", "ffn_hidden"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LongNetConfig.{name}={value!r} must be a positive int")
    if self.dim % self.num_heads:
      raise ValueError(f"LongNetConfig.dim={self.dim} must be divisible by num_heads={self.num_heads}")


class SubLNFeedForward(nnx.Module):
  """fc2(LayerNorm(gelu(fc1(x)))): Magneto's sub-LN feed-forward."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.norm(jax.nn.gelu(self.fc1(x))))


class LongNetBlock(nnx.Module):
  def __init__(self, config: LongNetConfig, *, mesh, seq_axis, rngs: nnx.Rngs):
    self.attn_norm = nnx.LayerNorm(config.dim, rngs=rngs)
    self.attn = ring_nn.DilatedAttention(
      config.num_heads,
      config.dim,
      segment_lengths=config.segment_lengths,
      dilation_rates=config.dilation_rates,
      kind="dense" if config.reference else "dilated",
      num_kv_heads=config.num_kv_heads,
      mesh=mesh,
      seq_axis=seq_axis,
      is_causal=True,
      policy=config.policy,
      rope_base=config.rope_base,
      sub_layer_norm=True,
      rngs=rngs,
    )
    self.ffn_norm = nnx.LayerNorm(config.dim, rngs=rngs)
    self.ffn = SubLNFeedForward(config.dim, config.ffn_hidden, rngs=rngs)

  def __call__(self, x, attend):
    x = x + attend(self.attn, self.attn_norm(x))
    return x + self.ffn(self.ffn_norm(x))


class LongNet(DecoderLM):
  """tokens int [B, T] -> logits float32 [B, T, V]; distributed over `seq_axis` of
  `mesh` when given (segments longer than a shard run on sub-rings). The shared decoder
  (`decoder.CausalLM`, as `DecoderLM`'s calls) with LongNet's blocks and final
  LayerNorm.

  Generation: `init_cache(batch_size, max_length)` empties a KV cache in every layer,
  then `prefill` and `decode` (or `models.generate`); each new token attends to the
  cached keys its dilated patterns select."""

  def __init__(self, config: LongNetConfig, *, mesh=None, seq_axis="seq", rngs: nnx.Rngs):
    super().__init__(config, mesh=mesh, seq_axis=seq_axis, rngs=rngs)

  def make_block(self, config, layer: int, *, mesh, seq_axis, batch_axis, rngs):
    return LongNetBlock(config, mesh=mesh, seq_axis=seq_axis, rngs=rngs)

  def make_norm(self, config, *, rngs):
    return nnx.LayerNorm(config.dim, rngs=rngs)
