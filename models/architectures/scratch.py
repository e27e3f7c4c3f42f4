"""A decoder-only language model whose attention is selectable: dense, ring, shard-local
or dilated. RMSNorm, rotary embeddings from global positions, GQA, SwiGLU.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import layouts
from jax_ring import nn as ring_nn

from . import decoder

ATTENTION_KINDS = ("dense", "ring", "local", "dilated", "dilated_dense")
# The context length of a model with none built in (`LMConfig`, `LongNetConfig`).
NO_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Hyper-parameters of `DecoderLM`.

  attention: "dense" (one device, the reference), "ring" (exact, over the mesh's seq
  axis), "local" (each shard of the sequence attends only within itself), "dilated"
  (LongNet patterns, over the mesh when given) or "dilated_dense" (their reference).

  window: a sliding window for "ring" and "dense": each token attends to itself and the
  `window` tokens before it (`local_window_size=(window, 0)`); None: all before it.
  remat: recompute each block's feed-forward activations in the backward pass
  (`nnx.remat`) instead of storing them; attention's are kept (the ring's custom VJP
  keeps only O(T / devices) residuals, where `jax.checkpoint` around it made JAX 0.10
  save the forward scan's per-step score tiles: 10x the temp memory at T=8192).
  conv: width of a causal depthwise convolution on each attention input (`ShortConv`;
  0: none). rope_max_wavelength: rotary frequencies of longer wavelength are dropped
  (`jax_ring.nn.rope_frequencies`), so the model runs past its training length without
  meeting rotations it never saw.
  scan_layers: the blocks' parameters stacked along a leading layer axis and run by
  `nnx.scan` (one compiled block for all layers); no decode mode.
  ulysses_axis: a second mesh axis for attention "ring" or "local": the sequence is
  sharded over (seq_axis, ulysses_axis) and attention runs the Ulysses hybrid
  (`jax_ring.ring_attention(..., ulysses_axis=)`); num_heads must divide by its size.
  Generation runs the ring over seq_axis alone.
  attention_kernel: the block kernel of "ring" and "dilated" attention, "auto", "xla" or
  "pallas" (`jax_ring.ring_attention`'s `kernel`).
  global_every: with `window`, every `global_every`-th layer (layers k-1, 2k-1, ...)
  attends to all tokens before it and the others to the window (Gemma 2 and gpt-oss
  alternate: 2); 0: every layer windowed.
  logit_soft_cap, attention_sinks (learned, one per head), alibi (the paper's slopes),
  attention_dropout: score modifiers of "ring", "local" and "dense" attention
  (`jax_ring.nn.RingAttention`'s logit_soft_cap, sinks, alibi, attention_dropout_rate).
  rope_base None: no rotary embeddings (ALiBi models).
  ring_order: run every layer on the ring's token order (attention "ring"): the model
  permutes each batch's tokens into the layout causal ring attention runs in (zigzag)
  once, every layer works on that order (rotary embeddings, masks and segment ids from
  global positions, the short convolution's halo from the chunk before in natural
  order), and no attention call relays its q, k, v and output (`DecoderLM.__call__`'s
  `logits_order`; `ring_permutation`). It changes anything only where the ring's layout
  at the call's length is not contiguous (more than `jax_ring.layouts.SHORT_CAUSAL_SHARD`
  tokens a device). None (default): on there when the length needs no padding (a
  multiple of 2 x devices) and the convolution's halo fits in a chunk; True: on there,
  a ValueError where it cannot be; False: off. The numbers are the natural-order
  model's either way.
  """

  vocab_size: int
  dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_hidden: int = 128
  attention: str = "ring"
  rope_base: float = 10000.0
  rope_max_wavelength: float | None = None
  conv: int = 0
  segment_lengths: tuple[int, ...] = (64,)
  dilation_rates: tuple[int, ...] = (1,)
  max_seq_len: int | None = None
  dtype: str | None = None
  param_dtype: str = "float32"
  policy: str | None = None
  window: int | None = None
  remat: bool = False
  scan_layers: bool = False
  ulysses_axis: str | None = None
  attention_kernel: str = "auto"
  global_every: int = 0
  logit_soft_cap: float | None = None
  attention_sinks: bool = False
  alibi: bool = False
  attention_dropout: float = 0.0
  ring_order: bool | None = None

  # What the shared decoder (`decoder.CausalLM`) reads of every config.
  tie_embeddings = False
  rope_scaling = None
  norm_eps = 1e-6  # flax's RMSNorm default
  context_length = NO_LIMIT  # rotary from global positions: no length is built in

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads

  def validate(self, mesh=None, seq_axis="seq") -> None:
    for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LMConfig.{name}={value!r} must be a positive int")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"LMConfig.attention={self.attention!r} is not one of {ATTENTION_KINDS}")
    if isinstance(self.conv, bool) or not isinstance(self.conv, int) or self.conv < 0:
      raise ValueError(f"LMConfig.conv={self.conv!r} must be an int >= 0 (0: no convolution)")
    if self.dim % self.num_heads:
      raise ValueError(f"LMConfig.dim={self.dim} must be divisible by num_heads={self.num_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"LMConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if isinstance(self.global_every, bool) or not isinstance(self.global_every, int) or self.global_every < 0:
      raise ValueError(
        f"LMConfig.global_every={self.global_every!r} must be an int >= 0 (0: every layer windowed)"
      )
    if self.global_every and self.scan_layers:
      raise ValueError(
        f"LMConfig.global_every={self.global_every} alternates the layers' windows; "
        "scan_layers=True runs one block for all"
      )
    modified = self.logit_soft_cap is not None or self.attention_sinks or self.alibi or self.attention_dropout
    if modified and self.attention.startswith("dilated"):
      raise ValueError(
        "LMConfig.logit_soft_cap, attention_sinks, alibi and attention_dropout apply to attention 'ring', "
        f"'local' and 'dense', not {self.attention!r}"
      )
    if self.ring_order is not None and not isinstance(self.ring_order, bool):
      raise ValueError(f"LMConfig.ring_order={self.ring_order!r} must be None (auto), True or False")
    if self.ring_order and self.attention != "ring":
      raise ValueError(
        f"LMConfig.ring_order=True runs the layers on ring attention's token order; it needs attention "
        f"'ring', not {self.attention!r}"
      )
    if self.rope_base is not None and (self.dim // self.num_heads) % 2:
      raise ValueError(f"head dim {self.dim // self.num_heads} (dim / num_heads) must be even for RoPE")
    if self.window is not None and (
      self.attention not in ("ring", "dense")
      or isinstance(self.window, bool)
      or not isinstance(self.window, int)
      or self.window < 0
    ):
      raise ValueError(
        f"LMConfig.window={self.window!r} must be an int >= 0 with attention 'ring' or 'dense', "
        f"not {self.attention!r}"
      )
    if self.attention in ("ring", "local") and mesh is None:
      raise ValueError(f"LMConfig.attention={self.attention!r} needs a mesh")
    if self.ulysses_axis is not None:
      if self.attention not in ("ring", "local"):
        raise ValueError(
          f"LMConfig.ulysses_axis={self.ulysses_axis!r} needs attention 'ring' or 'local', "
          f"not {self.attention!r}"
        )
      if self.ulysses_axis not in mesh.axis_names or self.ulysses_axis == seq_axis:
        raise ValueError(
          f"LMConfig.ulysses_axis={self.ulysses_axis!r} must be an axis of the mesh {tuple(mesh.axis_names)} "
          f"other than seq_axis={seq_axis!r}"
        )
      if self.num_heads % mesh.shape[self.ulysses_axis]:
        raise ValueError(
          f"LMConfig.num_heads={self.num_heads} must be divisible by the {mesh.shape[self.ulysses_axis]} "
          f"devices of ulysses_axis={self.ulysses_axis!r}"
        )
    if mesh is not None and self.max_seq_len is not None:
      shards = mesh.shape[seq_axis] if seq_axis in mesh.axis_names else None
      if shards is None:
        raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
      axes = repr(seq_axis)
      if self.ulysses_axis is not None:
        shards *= mesh.shape[self.ulysses_axis]
        axes = f"{seq_axis!r} x {self.ulysses_axis!r}"
      if self.max_seq_len < shards:
        raise ValueError(
          f"LMConfig.max_seq_len={self.max_seq_len} is shorter than the {shards} devices of mesh axes "
          f"{axes}: every device needs at least one token"
        )


def make_attention(config: LMConfig, *, mesh, seq_axis, batch_axis, rngs: nnx.Rngs, layer: int = 0):
  """The attention module of block `layer`: the shared decoder's (`decoder.make_attention`)
  with the config's window, Ulysses axis and score modifiers, or LongNet's dilated
  attention for the dilated kinds."""
  common = dict(
    policy=config.policy, rope_base=config.rope_base, rope_max_wavelength=config.rope_max_wavelength
  )
  if config.attention.startswith("dilated"):
    dt, pdt = decoder.dtypes(config)
    return ring_nn.DilatedAttention(
      config.num_heads,
      config.dim,
      segment_lengths=config.segment_lengths,
      dilation_rates=config.dilation_rates,
      kind="dense" if config.attention == "dilated_dense" else "dilated",
      num_kv_heads=config.num_kv_heads,
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      is_causal=True,
      attention_kernel=config.attention_kernel,
      dtype=dt,
      param_dtype=pdt,
      rngs=rngs,
      **common,
    )
  every = config.global_every
  windowed = config.window is not None and not (every and layer % every == every - 1)
  return decoder.make_attention(
    config,
    mesh=mesh,
    seq_axis=seq_axis,
    batch_axis=batch_axis,
    rngs=rngs,
    local_window_size=(config.window, 0) if windowed else None,
    ulysses_axis=config.ulysses_axis if config.attention != "dense" else None,
    logit_soft_cap=config.logit_soft_cap,
    sinks=config.attention_sinks,
    alibi=config.alibi,
    attention_dropout_rate=config.attention_dropout,
    **common,
  )


class ShortConv(nnx.Module):
  """h + a causal depthwise convolution of h over the last `width` tokens:
  out[t] = h[t] + sum_s w[s] * h[t - s], s = 0..width-1 (zeros before the start).

  Placed before attention, it hands every position a summary of the few tokens before
  it, so one attention layer can match "the tokens before here" with "the tokens before
  there" (the induction / associative-recall pattern) without first building a
  previous-token head ("Canon layers", Allen-Zhu 2025, Physics of Language Models 4.1;
  the same idea as the short convolutions of H3 and Mamba). Over a sequence-sharded
  array the shift needs only the last width-1 tokens of the neighbouring shard, which
  XLA exchanges by itself.

  A block calls it as it calls its attention (`CausalLM.hidden`'s `attend`): `__call__`
  in training (`token_order="layout"`: the tokens in the ring's causal layout over
  `shards` devices), `prefill` and `decode`. Segments do not reset it. Decoding keeps
  the last width-1 inputs of each row (`state`, nnx.Cache).
  """

  def __init__(self, dim: int, width: int, *, dtype, param_dtype, rngs: nnx.Rngs, shards: int = 1):
    self.width = width
    self.shards = shards
    init = nnx.initializers.normal(1.0 / width)
    self.kernel = nnx.Param(init(rngs.params(), (width, dim), param_dtype))
    self.dtype = dtype

  def _mix(self, padded, t):
    """padded [..., width-1+t, D] -> [..., t, D]: each of the last t rows plus its window."""
    w = self.kernel[...].astype(self.dtype or padded.dtype)
    k = self.width
    out = padded[..., k - 1 :, :]
    for s in range(k):
      out = out + w[s] * padded[..., k - 1 - s : k - 1 - s + t, :]
    return out

  def __call__(self, h, *, token_order: str = "natural", segment_ids=None, positions=None):
    del segment_ids, positions  # the convolution runs across segments, on the token order
    t = h.shape[1]
    if token_order == "layout":
      layout = layouts.resolve("auto", True, shard_len=-(-t // self.shards))
      return self.chunks(h, _natural_chunks(layout, t, self.shards))
    return self._mix(jnp.pad(h, ((0, 0), (self.width - 1, 0), (0, 0))), t)

  def chunks(self, h, natural):
    """As __call__ on h [B, T, D] whose tokens are in a chunked order: the T tokens are
    len(natural) equal chunks, the c-th being the natural chunk natural[c] (zigzag: 0,
    2p-1, 1, 2p-2, ...). Each chunk's halo is the last width-1 rows of the chunk before
    it in natural order (zeros before the first), so only those rows cross devices."""
    b, t, d = h.shape
    n = len(natural)
    c, halo = t // n, self.width - 1
    x = h.reshape(b, n, c, d)
    slot = np.argsort(natural)  # slot[m]: where natural chunk m sits
    before = np.array([slot[m - 1] if m else 0 for m in natural])
    first = np.asarray(natural) == 0
    tails = x[:, before, c - halo :]  # [B, n, width-1, D]
    tails = jnp.where(first[None, :, None, None], 0, tails)
    return self._mix(jnp.concatenate([tails, x], axis=2), c).reshape(b, t, d)

  def init_cache(self, batch_size: int, dtype) -> None:
    self.state = nnx.Cache(jnp.zeros((batch_size, self.width - 1, self.kernel.shape[1]), dtype))

  def prefill(self, h, lengths=None, segment_ids=None):
    """As __call__; the state becomes each row's last width-1 inputs before lengths[b]."""
    del segment_ids
    b, t, _ = h.shape
    padded = jnp.pad(h, ((0, 0), (self.width - 1, 0), (0, 0)))
    ends = jnp.full((b,), t) if lengths is None else jnp.asarray(lengths)
    index = ends[:, None] + jnp.arange(self.width - 1)[None]  # rows lengths-width+1.. of h, padded
    ring_nn._replace_value(
      self.state, jnp.take_along_axis(padded, index[:, :, None], axis=1).astype(self.state.dtype)
    )
    return self._mix(padded, t)

  def decode(self, h, segment_ids=None):
    """h [B, Tq, D]: the next Tq inputs of each row, after the state."""
    del segment_ids
    t = h.shape[1]
    padded = jnp.concatenate([self.state[...].astype(h.dtype), h], axis=1)
    ring_nn._replace_value(self.state, padded[:, t:].astype(self.state.dtype))
    return self._mix(padded, t)


class Block(nnx.Module):
  """Llama's pre-norm block (`decoder.PreNormBlock`) with the toy's options: a short
  convolution before attention (`LMConfig.conv`) and the feed-forward sub-layer
  recomputed in the backward pass (`LMConfig.remat`)."""

  def __init__(self, config: LMConfig, *, mesh, seq_axis, batch_axis, rngs: nnx.Rngs, layer: int = 0):
    dt, pdt = decoder.dtypes(config)
    self.attn_norm = decoder.rms_norm(config, rngs=rngs)
    shards = mesh.shape[seq_axis] if mesh is not None and seq_axis in mesh.axis_names else 1
    self.conv = (
      ShortConv(config.dim, config.conv, dtype=dt, param_dtype=pdt, rngs=rngs, shards=shards)
      if config.conv
      else None
    )
    self.attn = make_attention(
      config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, layer=layer
    )
    self.mlp_norm = decoder.rms_norm(config, rngs=rngs)
    self.mlp = decoder.GatedMLP(config.dim, config.mlp_hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.remat = config.remat

  def __call__(self, x, attend):
    """attend(module, normalized x) -> a sequence-mixing sub-layer's output in the call's
    mode (`CausalLM.hidden`): the short convolution's, then attention's."""
    h = self.attn_norm(x)
    if self.conv is not None:
      h = attend(self.conv, h)
    x = x + attend(self.attn, h)
    feed_forward = lambda norm, mlp, x: mlp(norm(x))
    if self.remat:
      feed_forward = nnx.remat(feed_forward)
    return x + feed_forward(self.mlp_norm, self.mlp, x)


class DecoderLM(decoder.CausalLM):
  """Decoder-only LM trained from scratch, on the shared decoder (`decoder.CausalLM`):
  tokens int [B, T] -> logits float32 [B, T, V].

  Rotary embeddings use global token positions (natural order), so the numbers do
  not depend on how the ring lays tokens out on devices.

  Beyond `CausalLM`'s calls: `__call__` and `hidden` take `segment_ids` and `positions`,
  and run every layer on the ring's token order where that order is not the natural one
  (`LMConfig.ring_order`), handing back natural order or (`logits_order="ring"`) that
  order; `scan_layers` stacks the blocks' weights; `prefill` gives every position's
  logits.

  Generation (`models.generate`): `init_cache(batch_size, max_length)`, then
  `prefill(prompts, lengths=...)` once and `decode(tokens)` per step; the cache of each
  attention layer is sharded along the sequence like the attention (every kind but
  "local"; the dilated kinds decode their LongNet patterns).
  """

  def __init__(self, config: LMConfig, *, mesh=None, seq_axis="seq", batch_axis=None, rngs: nnx.Rngs):
    super().__init__(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)
    # Every kind keeps the mesh it was given (the loss and the batches are placed on it).
    self.placement = nnx.static((mesh, seq_axis, batch_axis))

  def make_block(self, config, layer: int, *, mesh, seq_axis, batch_axis, rngs):
    return Block(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, layer=layer)

  def make_blocks(self, config, *, mesh, seq_axis, batch_axis, rngs):
    if not config.scan_layers:
      return super().make_blocks(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)
    # One block for every layer (global_every is refused with it), stacked by nnx.vmap.
    one = lambda rngs: self.make_block(
      config, 0, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs
    )
    return nnx.split_rngs(splits=config.num_layers)(nnx.vmap(one, in_axes=0, out_axes=0))(rngs)

  def run_blocks(self, x, attend, *, training: bool, gather: bool = True):
    if not self.config.scan_layers:
      return super().run_blocks(x, attend, training=training, gather=gather)
    step = lambda block, x: block(x, attend)
    return nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)

  def vocab_axes(self):
    return None  # the tables are used whole (`models.train.scratch` places them)

  def embed_input(self, tokens, shard: bool = True):
    return self.embed_tokens(tokens)

  def ring_layout(self, length: int) -> str | None:
    """The layout whose token order every layer runs on for `length` tokens
    (`LMConfig.ring_order`), or None: natural order."""
    config, (mesh, seq_axis, _) = self.config, self.placement
    if config.ring_order is False or config.attention != "ring":
      return None
    p = mesh.shape[seq_axis]
    u = 1 if config.ulysses_axis is None else mesh.shape[config.ulysses_axis]
    layout = layouts.resolve("auto", True, shard_len=-(-length // p))
    multiple = layouts.multiple(layout, p, u)
    if layout == "contiguous":  # short shards: the ring's order is the natural one
      return None
    problem = None
    if length % multiple:
      problem = f"length {length} is not a multiple of {multiple} ({layout} over {p} x {u} devices)"
    elif config.conv and length // (2 * p) < config.conv - 1:
      problem = (
        f"chunks of {length // (2 * p)} tokens are shorter than the convolution's halo {config.conv - 1}"
      )
    if problem is None:
      return layout
    if config.ring_order:
      raise ValueError(f"LMConfig.ring_order=True: cannot keep the ring's order: {problem}")
    return None

  def ring_permutation(self, length: int) -> np.ndarray | None:
    """perm [length] such that tokens[:, perm] is the order the layers run on (the
    order of `logits_order="ring"` logits), or None where it is the natural order."""
    layout = self.ring_layout(length)
    if layout is None:
      return None
    mesh, seq_axis, _ = self.placement
    return layouts.permutation(layout, length, mesh.shape[seq_axis])

  def __call__(self, tokens, *, segment_ids=None, positions=None, logits_order: str = "natural"):
    """Logits [B, T, V] of tokens int [B, T]. `logits_order="ring"`: in the order the
    layers ran on (`ring_permutation(T)`, natural where it is None), so that a loss can
    permute its targets instead of the logits."""
    if logits_order not in ("natural", "ring"):
      raise ValueError(f"logits_order={logits_order!r} must be 'natural' or 'ring'")
    return self.logits(self.hidden(tokens, segment_ids=segment_ids, positions=positions, order=logits_order))

  def hidden(
    self, tokens, attend=None, *, segment_ids=None, positions=None, order: str = "natural", **options
  ):
    """The final normed hidden states [B, T, D] (the head's input, `head.kernel` [D, V]).
    A training call on natural-order tokens runs the layers on the ring's order where
    that differs and hands the states back in natural order, or in the ring's
    (`order="ring"`, as `__call__`'s `logits_order`). `attend` or `options` (`shard`,
    `token_order`): `CausalLM.hidden`'s calls, the tokens already in their order."""
    if order not in ("natural", "ring"):
      raise ValueError(f"order={order!r} must be 'natural' or 'ring'")
    if attend is not None or options.get("token_order", "natural") != "natural":
      return super().hidden(tokens, attend, segment_ids=segment_ids, positions=positions, **options)
    tokens = self.check_tokens(tokens)
    if positions is None:
      positions = jnp.arange(tokens.shape[1])
    perm = self.ring_permutation(tokens.shape[1])
    if perm is None:
      return super().hidden(tokens, segment_ids=segment_ids, positions=positions)
    tokens, segment_ids = self.to_ring_order(tokens), self.to_ring_order(segment_ids)
    positions = jnp.take(positions, perm, axis=-1)
    h = super().hidden(tokens, token_order="layout", segment_ids=segment_ids, positions=positions)
    return h if order == "ring" else self._permute(h, np.argsort(perm))

  def to_ring_order(self, x):
    """x [B, T, ...] in natural order (targets, loss weights) -> the order the layers
    run on at length T (`ring_permutation`), sharded over batch and sequence like the
    attention's inputs; unchanged where that order is the natural one."""
    if x is None:
      return None
    perm = self.ring_permutation(x.shape[1])
    return x if perm is None else self._permute(jnp.asarray(x), perm)

  def embed_tokens(self, tokens):
    """The embeddings [B, T, D] of tokens [B, T]. Under an Explicit mesh the lookup keeps
    the tokens' own sharding, which the gather must be told when they are split over
    the sequence; elsewhere it is `self.embed`."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.explicit_axes:
      return self.embed(tokens)
    table = self.embed.embedding[...].astype(self.embed.dtype or self.embed.embedding.dtype)
    return table.at[tokens].get(out_sharding=P(*jax.typeof(tokens).sharding.spec, None))

  def _permute(self, x, perm):
    """x [B, T, ...] with its tokens taken in the order `perm`, placed like the
    attention's inputs. Under an Explicit mesh x keeps its own sharding, which the
    gather must be told when the sequence is split (feeding sequence-sharded tokens, as
    training does, kept XLA from computing every layer's activations whole)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.explicit_axes:
      return x.at[:, perm].get(out_sharding=jax.typeof(x).sharding.spec)
    return self._place(jnp.take(x, perm, axis=1))

  def _place(self, x):
    """x [B, T, ...] sharded like the attention's inputs (batch, sequence)."""
    mesh, seq_axis, batch_axis = self.placement
    seq = seq_axis if self.config.ulysses_axis is None else (seq_axis, self.config.ulysses_axis)
    spec = P(batch_axis, seq, *([None] * (x.ndim - 2)))
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.explicit_axes:
      # Under jax.set_mesh of an Explicit mesh, arrays carry their sharding in their
      # type: x keeps the one the caller's tokens had (as in natural order).
      return x
    auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    return jax.lax.with_sharding_constraint(x, NamedSharding(auto, spec))

  def init_cache(self, batch_size: int, max_length: int, *, dtype=None) -> None:
    """Empty KV caches in every attention layer for `max_length` tokens per row."""
    if self.config.scan_layers:
      raise ValueError("LMConfig.scan_layers=True has no decode mode; build the model with scan_layers=False")
    if self.config.attention == "local":
      raise ValueError(
        "LMConfig.attention='local' has no decode mode (a training baseline); use 'ring', 'dense' or "
        "'dilated'"
      )
    for block in self.blocks:
      block.attn.init_cache(batch_size, max_length, dtype=dtype)
      if getattr(block, "conv", None) is not None:
        block.conv.init_cache(batch_size, jnp.dtype(dtype or decoder.dtypes(self.config)[0] or jnp.float32))

  def prefill(self, tokens, *, lengths=None, segment_ids=None):
    """Logits [B, T, V] of a prompt (row b: its first lengths[b] tokens), filling the
    caches from scratch."""
    attend = lambda module, h: module.prefill(h, lengths=lengths, segment_ids=segment_ids)
    return self.logits(super().hidden(tokens, attend))

  def decode(self, tokens, *, segment_ids=None):
    """Logits [B, Tq, V] of each row's next Tq tokens, appended to the caches."""
    attend = lambda module, h: module.decode(h, segment_ids=segment_ids)
    return self.logits(super().hidden(tokens, attend, shard=False))


def _natural_chunks(layout: str, length: int, num_shards: int) -> np.ndarray:
  """The layout's order as 2p equal chunks: entry c is the natural index of the c-th
  chunk (zigzag over p devices: 0, 2p-1, 1, 2p-2, ...)."""
  n = 2 * num_shards
  starts = layouts.permutation(layout, length, num_shards).reshape(n, -1)
  if not (np.diff(starts, axis=1) == 1).all():
    raise ValueError(f"layout={layout!r} does not keep chunks of {length // n} tokens together")
  return starts[:, 0] // (length // n)
