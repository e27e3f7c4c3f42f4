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
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import nn as ring_nn

from .transformer import GatedMLP

ATTENTION_KINDS = ("ring", "dense", "local")


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """Gemma 3's hyper-parameters; the defaults are Gemma 3 270M's."""

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
  norm_eps: float = 1e-6
  context_length: int = 32768
  attention: str = "ring"
  dtype: str | None = None  # compute dtype (None: float32)
  param_dtype: str = "float32"

  def is_global(self, layer: int) -> bool:
    return (layer + 1) % self.global_every == 0

  def validate(self, mesh, seq_axis) -> None:
    for name in (
      "vocab_size",
      "dim",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "mlp_hidden",
      "window",
      "global_every",
      "context_length",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GemmaConfig.{name}={value!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"GemmaConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION_KINDS}")
    if self.attention != "dense" and not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(f"attention={self.attention!r} needs mesh= a jax.sharding.Mesh; got {mesh!r}")
    if isinstance(mesh, jax.sharding.Mesh) and seq_axis not in mesh.axis_names:
      raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")


gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)


class GemmaAttention(ring_nn.RingAttention):
  """`jax_ring.nn.RingAttention` whose "dense" kind is `jax.nn.dot_product_attention`
  (XLA: every score computed, then masked), the model's one-device reference, written
  apart from the ring's code."""

  def attend(self, q, k, v, segment_ids, token_order: str = "natural"):
    if self.kind != "dense":
      return super().attend(q, k, v, segment_ids, token_order)
    o = dict(self.options)
    return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=o["local_window_size"], implementation="xla"
    )


class GemmaBlock(nnx.Module):
  def __init__(self, config: GemmaConfig, layer: int, *, mesh, seq_axis, rngs: nnx.Rngs):
    dt, pdt = _dtype(config.dtype), jnp.dtype(config.param_dtype)
    norm = lambda: nnx.RMSNorm(config.dim, epsilon=config.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)
    is_global = config.is_global(layer)
    self.attn_norm = norm()
    self.attn = GemmaAttention(
      config.num_heads,
      config.dim,
      kind=config.attention,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      mesh=mesh if config.attention != "dense" else None,
      seq_axis=seq_axis,
      is_causal=True,
      local_window_size=None if is_global else (config.window - 1, 0),
      # A window's ring stops where the window ends only in the contiguous layout.
      layout="auto" if is_global else "contiguous",
      rope_base=config.rope_base if is_global else config.local_rope_base,
      qk_norm_epsilon=config.norm_eps,
      dtype=dt,
      param_dtype=pdt,
      rngs=rngs,
    )
    self.post_attn_norm = norm()
    self.mlp_norm = norm()
    self.mlp = GatedMLP(
      config.dim, config.mlp_hidden, activation=gelu_tanh, dtype=dt, param_dtype=pdt, rngs=rngs
    )  # GeGLU
    self.post_mlp_norm = norm()

  def __call__(self, x, attend):
    x = x + self.post_attn_norm(attend(self.attn, self.attn_norm(x)))
    return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Gemma(nnx.Module):
  """Gemma 3: tokens int [B, T] -> logits float32 [B, T, V], T up to the context length.

  `hidden(tokens)` gives the final normed states [B, T, D] and `logits(h)` their
  logits, so a caller can score a few positions of a long sequence without the
  [T, V] array (V = 262,144: 34 GB of float32 at T = 32K).

  Generation (`models.generate`): `init_cache(batch, max_length)`, `prefill(tokens,
  lengths=)` (logits [B, V] at each row's last prompt token), `decode(tokens)`.
  """

  def __init__(self, config: GemmaConfig, *, mesh=None, seq_axis="seq", rngs: nnx.Rngs):
    config.validate(mesh, seq_axis)
    self.config = config
    self.placement = nnx.static((mesh if config.attention != "dense" else None, seq_axis))
    dt, pdt = _dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.blocks = nnx.List(
      [GemmaBlock(config, i, mesh=mesh, seq_axis=seq_axis, rngs=rngs) for i in range(config.num_layers)]
    )
    self.norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)

  def _check_tokens(self, tokens, name="tokens"):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"{name} shape={tuple(tokens.shape)} dtype={tokens.dtype} must be int [batch, seq]")
    if tokens.shape[1] > self.config.context_length:
      raise ValueError(
        f"{name} of length {tokens.shape[1]} exceed the context length {self.config.context_length}"
      )

  def _shard(self, x):
    """x [B, T, D] split over the mesh's seq axis, as the attention wants it."""
    mesh, seq_axis = self.placement
    if mesh is None or x.shape[1] % mesh.shape[seq_axis]:
      return x  # an uneven length: the attention pads it (and outside jit a constraint cannot)
    auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    return jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(None, seq_axis, None)))

  def hidden(self, tokens, attend=None, *, shard: bool = True):
    """The final normed hidden states [B, T, D] (the head's input)."""
    self._check_tokens(tokens)
    if attend is None:
      attend = lambda attn, h: attn(h)
    x = self.embed(tokens)
    x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
    x = self._shard(x) if shard else x
    for block in self.blocks:
      x = block(x, attend)
    return self.norm(x)

  def logits(self, h):
    """Logits float32 [..., V] of hidden states [..., D] (the head is the embedding)."""
    return self.embed.attend(h).astype(jnp.float32)

  def __call__(self, tokens):
    return self.logits(self.hidden(tokens))

  def init_cache(self, batch_size: int, max_length: int, *, dtype=None) -> None:
    """Empty KV caches in every layer for `max_length` tokens per row."""
    if self.config.attention == "local":
      raise ValueError("attention='local' has no decode mode (a baseline); load with 'ring' or 'dense'")
    if max_length > self.config.context_length:
      raise ValueError(
        f"max_length={max_length} (prompt and new tokens) exceeds the context length "
        f"{self.config.context_length}"
      )
    for block in self.blocks:
      block.attn.init_cache(batch_size, max_length, dtype=dtype)

  def prefill(self, tokens, *, lengths=None):
    """Logits [B, V] at each row's last prompt token (row b: its first lengths[b]
    tokens), filling the caches from scratch."""
    self._check_tokens(tokens)
    h = self.hidden(tokens, lambda attn, h: attn.prefill(h, lengths=lengths))
    ends = jnp.full((tokens.shape[0],), tokens.shape[1]) if lengths is None else jnp.asarray(lengths)
    at_last = jnp.arange(tokens.shape[1])[None, :, None] == (ends - 1)[:, None, None]
    return self.logits(jnp.sum(jnp.where(at_last, h, 0), axis=1))

  def decode(self, tokens):
    """Logits [B, Tq, V] of each row's next Tq tokens, appended to the caches."""
    return self.logits(self.hidden(tokens, lambda attn, h: attn.decode(h), shard=False))


# GGUF tensor names (llama.cpp's gemma3 map) -> the module's parameter paths; "{i}" is
# the layer. Linear kernels are transposed: GGUF stores (out, in), nnx.Linear [in, out].
GGUF_TENSORS = {
  "token_embd.weight": ("embed.embedding", False),
  "output_norm.weight": ("norm.scale", False),
  "blk.{i}.attn_norm.weight": ("blocks.{i}.attn_norm.scale", False),
  "blk.{i}.attn_q.weight": ("blocks.{i}.attn.query.kernel", True),
  "blk.{i}.attn_k.weight": ("blocks.{i}.attn.key.kernel", True),
  "blk.{i}.attn_v.weight": ("blocks.{i}.attn.value.kernel", True),
  "blk.{i}.attn_q_norm.weight": ("blocks.{i}.attn.query_norm.scale", False),
  "blk.{i}.attn_k_norm.weight": ("blocks.{i}.attn.key_norm.scale", False),
  "blk.{i}.attn_output.weight": ("blocks.{i}.attn.out.kernel", True),
  "blk.{i}.post_attention_norm.weight": ("blocks.{i}.post_attn_norm.scale", False),
  "blk.{i}.ffn_norm.weight": ("blocks.{i}.mlp_norm.scale", False),
  "blk.{i}.ffn_gate.weight": ("blocks.{i}.mlp.gate.kernel", True),
  "blk.{i}.ffn_up.weight": ("blocks.{i}.mlp.up.kernel", True),
  "blk.{i}.ffn_down.weight": ("blocks.{i}.mlp.down.kernel", True),
  "blk.{i}.post_ffw_norm.weight": ("blocks.{i}.post_mlp_norm.scale", False),
}


def config_from_gguf(gguf_file, **overrides) -> GemmaConfig:
  """The GemmaConfig a gemma3 GGUF file's metadata describes."""
  f = lambda key: gguf_file.field(f"gemma3.{key}")
  key_len, value_len = f("attention.key_length"), f("attention.value_length")
  if key_len != value_len:
    raise ValueError(f"gemma3.attention.key_length={key_len} != value_length={value_len}: not supported")
  if gguf_file.field("gemma3.final_logit_softcapping") is not None:
    raise ValueError("gemma3.final_logit_softcapping is set: Gemma 3 has none, and this loader applies none")
  return GemmaConfig(
    vocab_size=len(gguf_file.field("tokenizer.ggml.tokens")),
    dim=int(f("embedding_length")),
    num_layers=int(f("block_count")),
    num_heads=int(f("attention.head_count")),
    num_kv_heads=int(f("attention.head_count_kv")),
    head_dim=int(key_len),
    mlp_hidden=int(f("feed_forward_length")),
    window=int(f("attention.sliding_window")),
    rope_base=float(f("rope.freq_base")),
    norm_eps=float(f("attention.layer_norm_rms_epsilon")),
    context_length=int(f("context_length")),
    **overrides,
  )


def _dtype(name):
  return None if name is None else jnp.dtype(name)
