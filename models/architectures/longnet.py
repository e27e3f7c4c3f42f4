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
import jax.numpy as jnp
from flax import nnx

from jax_ring import nn as ring_nn

from .scratch import decode_model, forward, prefill_model


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

  def validate(self) -> None:
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

  def __call__(self, x, attend, mix=None):  # mix: DecoderLM's convolutions; none here
    x = x + attend(self.attn, self.attn_norm(x))
    return x + self.ffn(self.ffn_norm(x))


class LongNet(nnx.Module):
  """tokens int [B, T] -> logits float32 [B, T, V]; distributed over `seq_axis` of
  `mesh` when given (segments longer than a shard run on sub-rings)."""

  def __init__(self, config: LongNetConfig, *, mesh=None, seq_axis="seq", rngs: nnx.Rngs):
    config.validate()
    self.embed = nnx.Embed(config.vocab_size, config.dim, rngs=rngs)
    self.blocks = nnx.List(
      [LongNetBlock(config, mesh=mesh, seq_axis=seq_axis, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)
    self.head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens, *, segment_ids=None, positions=None):
    if positions is None and tokens.ndim == 2:
      positions = jnp.arange(tokens.shape[1])
    return forward(self, tokens, lambda attn, h: attn(h, segment_ids=segment_ids, positions=positions))

  def init_cache(self, batch_size: int, max_length: int, *, dtype=None) -> None:
    """Empty KV caches in every layer for `max_length` tokens per row (then `prefill`
    and `decode`, or `models.generate`); each new token attends to the cached keys
    its dilated patterns select."""
    for block in self.blocks:
      block.attn.init_cache(batch_size, max_length, dtype=dtype)

  def prefill(self, tokens, *, lengths=None, segment_ids=None):
    """Logits [B, T, V] of a prompt (row b: its first lengths[b] tokens), filling the
    caches from scratch."""
    return prefill_model(self, tokens, lengths=lengths, segment_ids=segment_ids)

  def decode(self, tokens, *, segment_ids=None):
    """Logits [B, Tq, V] of each row's next Tq tokens, appended to the caches."""
    return decode_model(self, tokens, segment_ids=segment_ids)
