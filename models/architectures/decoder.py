"""What every pretrained decoder here shares: the checks of its config and its tokens,
the attention module (ring, dense or shard-local), the pre-norm block of Llama and
Qwen, and `CausalLM`, the model around the blocks (embedding, final norm, head,
prompt fill and decoding on the sequence-sharded KV cache).

An architecture (`gemma`, `llama`, `qwen3`) is a module of its own: a frozen config,
its block, and the tables that map a file's tensor names onto the model.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import layouts
from jax_ring import nn as ring_nn

from . import vocabulary

ATTENTION_KINDS = ("ring", "dense", "local")
KERNELS = ("auto", "xla", "pallas", "cudnn")
# What each block keeps for the backward pass (`CausalLM`'s `remat`): "none" keeps every
# activation; "full" its input alone (the rest recomputed); "attention" its input and
# attention's output and log-sum-exp (jax_ring names them), so the ring's forward is not
# run again in the backward; the projections and MLP are recomputed. "offload": as
# "full", with each layer's input kept in host memory (`pinned_host`) instead of the
# device's, copied out in the forward pass and back in the backward pass (MaxText's
# offloaded decoder-layer inputs are the model).
LAYER_INPUT = "jax_ring.layer_input"
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "attention": jax.checkpoint_policies.save_only_these_names(
    "jax_ring.attention_out", "jax_ring.attention_lse"
  ),
  "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
  ),
}
# The most of its own tokens a device runs through a block's feed-forward at once in a
# long call (`feed_forward`): Llama-3.1-8B's MLP holds [tokens, 14,336] activations
# and their gradients, 28 KiB a token each in bfloat16.
FF_TOKENS = 16384


class Tally(nnx.Variable):
  """A count a module sets on each call (an int32 scalar over every device: an MoE
  layer's dropped tokens, `moe.DroppedTokens`). The forward's own transformations
  (`feed_forward`'s chunks, a block under remat or FSDP, the blocks' scan) carry it out
  of their traces and back onto the module, summed over a call's chunks, so that it
  holds the whole call's count in training as in inference."""


def set_tallies(module, state) -> None:
  """nnx.update(module, state) for counts (`Tally`), skipped where the module cannot
  take them: a call traced with the model closed over (`jax.jit(lambda t: model(t))`)
  keeps no count; a call through `nnx.jit`, split and merge, or eagerly does."""
  with contextlib.suppress(flax.errors.TraceContextError):
    nnx.update(module, state)


def path_names(path) -> tuple:
  """A pytree path's dictionary keys (an nnx.State's names)."""
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _tallies(module):
  """The module's `Tally` state, or None where it has none (every other model's
  programs stay as they were)."""
  state = nnx.state(module, Tally)
  return state if jax.tree.leaves(state) else None


# The config fields every architecture's config has (the loader and `models.save` read them).
POSITIVE_INTS = (
  "vocab_size",
  "dim",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_hidden",
  "context_length",
)


def float_dtype(value, name: str):
  """`value` as a floating jnp dtype (None stays None); a ValueError names `name` else."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise ValueError(f"{name}={value!r} is not a dtype; expected a float dtype such as 'bfloat16'") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name}={value!r} is not a floating dtype; expected 'float32', 'bfloat16' or 'float16'")
  return dtype


def is_experts(name, shape) -> bool:
  """Whether the weight at `name` (a dotted path, or a path's tuple of names) of `shape`
  is an MoE layer's stack of experts ([E, D, F] gate and up, [E, F, D] down on the
  layer `mlp`: `moe.MoE`)."""
  parts = tuple(name.split(".")) if isinstance(name, str) else tuple(str(p) for p in name)
  return len(shape) == 3 and parts[-2:] in (("mlp", "gate"), ("mlp", "up"), ("mlp", "down"))


def fsdp_spec(shape, mesh, *, experts: bool = False) -> P:
  """Where FSDP puts a weight of `shape` on `mesh`: its largest dimension the device
  count divides split over every axis of the mesh together; replicated where no
  dimension divides. A stack of experts (`experts`, `is_experts`) is split along the
  experts where their count divides: each device holds whole experts, which expert
  parallelism runs where they lie (`moe.MoE.expert_parallel`)."""
  n = mesh.size
  if experts and shape[0] % n == 0:
    return P(tuple(mesh.axis_names), *([None] * (len(shape) - 1)))
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % n == 0:
      spec = [None] * len(shape)
      spec[dim] = tuple(mesh.axis_names)
      return P(*spec)
  return P()


def gather_weight(p, mesh, dtype=None, *, experts: bool = False):
  """An FSDP weight whole on every device (in `dtype`, when given, for a float weight);
  its cotangent is placed back on the weight's shards (`fsdp_spec`): a reduce-scatter
  at the point of use."""
  whole = NamedSharding(mesh, P())
  split = NamedSharding(mesh, fsdp_spec(p.shape, mesh, experts=experts))
  cast = dtype if dtype is not None and jnp.issubdtype(p.dtype, jnp.floating) else p.dtype

  @jax.custom_vjp
  def gather(p):
    return jax.lax.with_sharding_constraint(p.astype(cast), whole)

  def fwd(p):
    return gather(p), None

  def bwd(_, g):
    return (jax.lax.with_sharding_constraint(g.astype(p.dtype), split),)

  gather.defvjp(fwd, bwd)
  return gather(p)


def check_config(config, mesh, seq_axis, extra_ints=()) -> None:
  """ValueError naming the first field of `config` (or argument) that cannot run."""
  cls = type(config).__name__
  for name in POSITIVE_INTS + tuple(extra_ints):
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{cls}.{name}={value!r} must be a positive int")
  if config.num_heads % config.num_kv_heads:
    raise ValueError(
      f"{cls}.num_heads={config.num_heads} must be a multiple of num_kv_heads={config.num_kv_heads}"
    )
  if config.head_dim % 2:
    raise ValueError(f"{cls}.head_dim={config.head_dim} must be even for rotary embeddings")
  if config.rope_scaling is not None and not isinstance(config.rope_scaling, ring_nn.RopeScaling):
    raise ValueError(f"{cls}.rope_scaling={config.rope_scaling!r} must be a jax_ring.nn.RopeScaling or None")
  float_dtype(config.dtype, "dtype")
  if float_dtype(config.param_dtype, "param_dtype") is None:
    raise ValueError(f"{cls}.param_dtype=None: expected a float dtype such as 'float32'")
  if config.attention not in ATTENTION_KINDS:
    raise ValueError(f"attention={config.attention!r} is not one of {ATTENTION_KINDS}")
  if config.attention_kernel not in KERNELS:
    raise ValueError(f"attention_kernel={config.attention_kernel!r} is not one of {KERNELS}")
  if config.attention != "dense" and not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"attention={config.attention!r} needs mesh= a jax.sharding.Mesh; got {mesh!r}")
  if isinstance(mesh, jax.sharding.Mesh) and seq_axis not in mesh.axis_names:
    raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")


def dtypes(config):
  """(compute dtype or None, parameter dtype) of a config."""
  return float_dtype(config.dtype, "dtype"), float_dtype(config.param_dtype, "param_dtype")


class Attention(ring_nn.RingAttention):
  """`jax_ring.nn.RingAttention` whose "dense" kind is `jax.nn.dot_product_attention`
  (XLA: every score computed, then masked), the models' one-device reference, written
  apart from the ring's code. `query_scale` multiplies the queries after their rotary
  embedding (Gemma 3 27B scales logits by query_pre_attn_scalar^-1/2, not H^-1/2)."""

  def __init__(self, *args, query_scale: float = 1.0, **kwargs):
    super().__init__(*args, **kwargs)
    self.query_scale = float(query_scale)

  def project(self, x, positions):
    q, k, v = super().project(x, positions)
    if self.query_scale != 1.0:
      q = q * jnp.asarray(self.query_scale, q.dtype)
    return q, k, v

  def attend(self, q, k, v, segment_ids, token_order: str = "natural"):
    modified = self.sinks is not None or self.alibi_slopes is not None or self.attention_dropout_rate > 0
    modified = modified or any(o is not None for o in dict(self.score_options).values())
    if self.kind != "dense" or segment_ids is not None or modified:
      # jax.nn.dot_product_attention has no segments or score modifiers: the dense kind
      # with them is jax_ring's reference (`jax_ring.reference_attention`).
      return super().attend(q, k, v, segment_ids, token_order)
    o = dict(self.options)
    return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=o["local_window_size"], implementation="xla"
    )


def make_attention(config, *, mesh, seq_axis, rngs, batch_axis=None, **options) -> Attention:
  """Causal attention of `config`'s shape (GQA, no biases), the placement of the model."""
  dt, pdt = dtypes(config)
  return Attention(
    config.num_heads,
    config.dim,
    kind=config.attention,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    mesh=mesh if config.attention != "dense" else None,
    seq_axis=seq_axis,
    batch_axis=batch_axis if config.attention != "dense" else None,
    is_causal=True,
    attention_kernel=config.attention_kernel,
    dtype=dt,
    param_dtype=pdt,
    rngs=rngs,
    **options,
  )


class GatedMLP(nnx.Module):
  """A gated feed-forward, down(activation(gate(x)) * up(x)) (Shazeer 2020, "GLU
  Variants Improve Transformer"): SwiGLU with silu (the default), GeGLU with GELU."""

  def __init__(self, dim: int, hidden: int, *, activation=jax.nn.silu, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.activation = activation
    self.gate = nnx.Linear(dim, hidden, **kw)
    self.up = nnx.Linear(dim, hidden, **kw)
    self.down = nnx.Linear(hidden, dim, **kw)

  def __call__(self, x):
    return self.down(self.activation(self.gate(x)) * self.up(x))


def rms_norm(config, size=None, *, rngs) -> nnx.RMSNorm:
  dt, pdt = dtypes(config)
  return nnx.RMSNorm(size or config.dim, epsilon=config.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)


def chunk_tokens(per: int, most: int | None = None) -> int:
  """The tokens of each of a device's `per` that `feed_forward` runs at once: all of
  them where they are at most `most` (FF_TOKENS when None, read when traced), else the
  largest part of `per` in equal chunks of at most `most`."""
  most = FF_TOKENS if most is None else most
  if per <= most:
    return per
  return per // next(k for k in range(2, per + 1) if per % k == 0 and per // k <= most)


_GROUPS = contextvars.ContextVar("jax_ring_feed_forward_groups", default=1)


def feed_forward_groups() -> int:
  """How many chunks the `feed_forward` call being traced runs each device's tokens
  in (1 outside one, or where it runs them at once): an MoE layer's rule for expert
  parallelism counts its transfers over all of them (`moe.MoE.expert_parallel`)."""
  return _GROUPS.get()


def feed_forward(fn, modules, x, placement, most: int | None = None):
  """fn(modules, x) for a feed-forward sub-layer `fn` that treats every token alone
  (norms, the MLP), over x [B, T, D] split along T over the mesh's `seq` devices
  (`placement`: mesh, seq_axis, batch_axis). Where a device holds more than `most`
  tokens, it runs them in equal chunks of at most `most`, one after the other, each
  under `jax.checkpoint`: the backward pass recomputes one chunk's activations at a
  time instead of holding all of them (at 128K tokens a device, Llama-3.1-8B's MLP
  held 3.5 GiB per [T, 14,336] array). Each device's tokens stay on it: chunk i is
  the i-th slice of every device's own tokens. Results equal fn(modules, x)'s.
  `most`: FF_TOKENS when None (read when traced)."""
  mesh, seq_axis, batch_axis = placement
  shards = 1 if mesh is None else mesh.shape[seq_axis]
  b, t, d = x.shape
  per = t // shards
  if t % shards or chunk_tokens(per, most) == per:
    return fn(modules, x)
  k = per // chunk_tokens(per, most)
  graphdef, state = nnx.split(modules)
  place = lambda a: a
  if mesh is not None:
    # Whole on every device inside the loop, so that the weights' gradients add up over
    # the chunks there and reach their shards once (left to the partitioner, each
    # chunk's went back to the shards: 8 x the reduce-scatters at 1M tokens).
    auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    state = jax.lax.with_sharding_constraint(state, NamedSharding(auto, P()))
    batch = batch_axis if batch_axis is not None and b % mesh.shape[batch_axis] == 0 else None
    place = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(auto, P(batch, seq_axis)))
  xs = place(x.reshape(b, shards, k, per // k, d))  # chunk i: xs[:, :, i], a slice of every device's tokens
  tallies = _tallies(modules)

  def call(state, h):  # the chunk's result, and the counts it set (`Tally`)
    copy = nnx.merge(graphdef, state)
    return fn(copy, h), (None if tallies is None else nnx.state(copy, Tally))

  run = jax.checkpoint(call)
  chunk = lambda i: jax.lax.dynamic_index_in_dim(xs, i, axis=2, keepdims=False)
  groups = _GROUPS.set(k)
  try:
    out = jax.eval_shape(run, state, chunk(0))[0]
  finally:
    _GROUPS.reset(groups)

  # Each chunk's result written in place into one [B, shards, k, T / (shards k), D]
  # array: no stacked copy of the chunks to transpose back; the chunks' counts summed.
  def one(i, carry):
    ys, total = carry
    y, counts = run(state, chunk(i))
    total = None if total is None else jax.tree.map(jnp.add, total, counts)
    return jax.lax.dynamic_update_index_in_dim(ys, y, i, axis=2), total

  # Zeros made from x (constant ones XLA would share among the layers and make at the
  # program's start, every layer's alive at once); every slot is written over.
  ys = jnp.zeros((b, shards, k, *out.shape[2:]), out.dtype) + (xs[..., :1] * 0).astype(out.dtype)
  zero = None if tallies is None else jax.tree.map(jnp.zeros_like, tallies)
  groups = _GROUPS.set(k)
  try:
    ys, total = jax.lax.fori_loop(0, k, one, (place(ys), zero))
  finally:
    _GROUPS.reset(groups)
  if total is not None:
    set_tallies(modules, total)
  return ys.reshape(b, t, -1)


def rotary_attention(config, *, mesh, seq_axis, rngs, batch_axis=None, **options) -> Attention:
  """`make_attention` with the config's rotary base and scaling (Llama's kind of block)."""
  rope = dict(rope_base=config.rope_base, rope_scaling=config.rope_scaling)
  return make_attention(
    config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, **rope, **options
  )


class PreNormBlock(nnx.Module):
  """x + attn(norm(x)), then x + mlp(norm(x)) with a SwiGLU MLP: Llama's block, and
  Qwen 3's (whose attention adds an RMSNorm on each query and key head)."""

  def __init__(
    self, config, *, mesh, seq_axis, rngs: nnx.Rngs, batch_axis=None, make_mlp=None, **attention_options
  ):
    """`make_mlp(rngs)`: the feed-forward module, where it is not the gated MLP of the
    config's width (a mixture of experts: `moe.MoE`)."""
    dt, pdt = dtypes(config)
    self.attn_norm = rms_norm(config, rngs=rngs)
    self.attn = rotary_attention(
      config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs, **attention_options
    )
    self.mlp_norm = rms_norm(config, rngs=rngs)
    if make_mlp is None:
      self.mlp = GatedMLP(config.dim, config.mlp_hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
    else:
      self.mlp = make_mlp(rngs)
    self.placement = nnx.static((mesh, seq_axis, batch_axis))

  def __call__(self, x, attend):
    x = x + attend(self.attn, self.attn_norm(x))
    mlp = lambda m, h: m[1](m[0](h))
    return x + feed_forward(mlp, (self.mlp_norm, self.mlp), x, self.placement)


class CausalLM(nnx.Module):
  """A decoder: tokens int [B, T] -> logits float32 [B, T, V], T from 1 up to the
  context length (any T: the ring pads a length its devices do not divide).

  `hidden(tokens)` gives the final normed states [B, T, D] and `logits(h)` their
  logits, so a caller can score a few positions of a long sequence without the
  [T, V] array. Generation (`models.generate`): `init_cache(batch, max_length)`,
  `prefill(tokens, lengths=)` (logits [B, V] at each row's last prompt token),
  `decode(tokens)`.

  Placement: `mesh` and `seq_axis` (the ring's axis), `batch_axis` (a mesh axis the
  batch is split over, or None). `fsdp`: the weights are stored split over the mesh's
  devices (`fsdp_spec`; placed so by `models.load` and `models.build`) and each block's
  are gathered where the block runs; their gradients come back reduce-scattered.
  `remat`: what each block keeps for the backward pass (`REMAT_POLICIES`).

  A subclass sets `make_block(config, layer, mesh=, seq_axis=, batch_axis=, rngs=)` and
  `embed_scale(config)`; `config.tie_embeddings` False adds an output head.
  """

  def __init__(
    self,
    config,
    *,
    mesh=None,
    seq_axis="seq",
    batch_axis=None,
    fsdp: bool = False,
    remat: str = "none",
    rngs: nnx.Rngs,
  ):
    config.validate(mesh, seq_axis)
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT_POLICIES)}")
    if not isinstance(fsdp, bool):
      raise TypeError(f"fsdp={fsdp!r} must be a bool")
    if fsdp and config.attention == "dense":
      raise ValueError(
        "fsdp=True splits the weights over a mesh's devices; attention='dense' runs on one device"
      )
    if batch_axis is not None and (
      not isinstance(mesh, jax.sharding.Mesh) or batch_axis not in mesh.axis_names
    ):
      raise ValueError(f"batch_axis={batch_axis!r} is not an axis of the mesh {mesh!r}")
    self.config = config
    ring_mesh = mesh if config.attention != "dense" else None
    batch_axis = batch_axis if ring_mesh is not None else None
    self.placement = nnx.static((ring_mesh, seq_axis, batch_axis))
    self.fsdp, self.remat = fsdp, remat
    dt, pdt = dtypes(config)
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.blocks = self.make_blocks(config, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs)
    for _, module in nnx.iter_graph(self.blocks):  # FSDP splits an MoE layer's experts (`moe.MoE`)
      if isinstance(module, nnx.Module) and hasattr(module, "weights_split"):
        module.weights_split = bool(fsdp)
    self.norm = self.make_norm(config, rngs=rngs)
    if config.tie_embeddings:
      self.head = nnx.data(None)
    else:
      self.head = nnx.Linear(
        config.dim, config.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt, rngs=rngs
      )

  def make_block(self, config, layer: int, *, mesh, seq_axis, batch_axis, rngs):
    raise NotImplementedError

  def make_blocks(self, config, *, mesh, seq_axis, batch_axis, rngs):
    """The blocks, `make_block`'s for each layer in an `nnx.List` (run one by one, or as
    a scan over their stacked weights in training: `_scanned_blocks`)."""
    make = lambda i: self.make_block(
      config, i, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, rngs=rngs
    )
    return nnx.List([make(i) for i in range(config.num_layers)])

  def make_norm(self, config, *, rngs):
    """The final norm, before the head."""
    return rms_norm(config, rngs=rngs)

  @staticmethod
  def embed_scale(config) -> float:
    return 1.0

  def check_tokens(self, tokens, name="tokens"):
    """tokens as an int array [B, T] after checking them: ValueError on a wrong shape or
    dtype, an empty or over-long sequence, or (when the values are known, outside jit)
    an id outside [0, vocab_size). Lists and NumPy arrays are accepted."""
    if isinstance(tokens, (list, tuple, np.ndarray)):
      array = np.asarray(tokens)
      if array.dtype == object or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(f"{name} must be token ids (ints) [batch, seq]; got an array of {array.dtype}")
      tokens = jnp.asarray(array.astype(np.int32))
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"{name} shape={tuple(tokens.shape)} dtype={tokens.dtype} must be int [batch, seq]")
    if tokens.shape[1] == 0 or tokens.shape[0] == 0:
      raise ValueError(f"{name} shape={tuple(tokens.shape)}: needs at least one row of at least one token")
    if tokens.shape[1] > self.config.context_length:
      raise ValueError(
        f"{name} of length {tokens.shape[1]} exceed the context length {self.config.context_length}"
      )
    if not isinstance(tokens, jax.core.Tracer):  # values known: read on the host
      host = np.asarray(tokens)
      bad = (host < 0) | (host >= self.config.vocab_size)
      if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
          f"{name} holds the id {int(host[where])} at {where}: token ids must be in "
          f"[0, {self.config.vocab_size}) (the vocabulary size)"
        )
    return tokens

  def _auto_mesh(self):
    mesh = self.placement[0]
    return mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))

  def _shard(self, x):
    """x [B, T, D] split over the mesh's seq axis, as the attention wants it."""
    mesh, seq_axis, batch_axis = self.placement
    if mesh is None or x.shape[1] % mesh.shape[seq_axis]:
      return x  # an uneven length: the attention pads it (and outside jit a constraint cannot)
    if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis]:
      batch_axis = None
    return jax.lax.with_sharding_constraint(
      x, NamedSharding(self._auto_mesh(), P(batch_axis, seq_axis, None))
    )

  @staticmethod
  def _split_weights(block, shape) -> frozenset:
    """The paths of the weights a block's modules use where they lie for a call on
    input of `shape`, not gathered (an MoE layer's experts under expert parallelism,
    `moe.MoE.split_weights`)."""
    return frozenset(
      tuple(path) + (name,)
      for path, module in nnx.iter_graph(block)
      if isinstance(module, nnx.Module) and hasattr(module, "split_weights")
      for name in module.split_weights(shape)
    )

  def _gathered(self, params, after=None, keep=frozenset()):
    """A block's weights whole on every device (FSDP: gathered where they are used), in
    the compute dtype when the model has one (bfloat16 moves half float32's bytes; the
    float32 weights stay split). In the backward pass each weight's gradient goes back
    to its shards right there (`gather_weight`), so no layer's whole gradient waits for
    the others'. `after`: an array the gathers wait for (the block's input), so that the
    compiler cannot gather every layer's weights at the start and hold them all.
    `keep`: the paths of weights left split (`_split_weights`)."""
    mesh = self._auto_mesh()
    dt = dtypes(self.config)[0]
    if after is not None:
      # A data dependence the compiler keeps (an optimization barrier did not survive
      # its partitioning): each shard plus 0 x one element of `after`, still split.
      zero = jax.lax.stop_gradient(jnp.nan_to_num(after.reshape(-1)[0]) * 0)

      def split(path, p):
        spec = fsdp_spec(p.shape, mesh, experts=is_experts(path_names(path), p.shape))
        return jax.lax.with_sharding_constraint(p + zero.astype(p.dtype), NamedSharding(mesh, spec))

      params = jax.tree_util.tree_map_with_path(split, params)

    def gather(path, p):
      name = path_names(path)
      if name in keep:  # used where it lies, split along the experts, in the compute dtype
        return p.astype(dt or p.dtype)
      return gather_weight(p, mesh, dt, experts=is_experts(name, p.shape))

    return jax.tree_util.tree_map_with_path(gather, params)

  def _run_block(self, block, x, attend, training: bool, gather: bool):
    """One block; in training calls under its remat policy. With FSDP and `gather` its
    weights are gathered for it (training, prefill); without `gather` (decode) it uses
    them where they lie and the compiler moves the activations to them (a decode step's
    are a few KiB, where gathering every weight per token would move the whole model)."""
    policy = REMAT_POLICIES[self.remat] if training else None
    if not (self.fsdp and gather) and policy is None:
      return block(x, attend)
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def run(params, rest, x):
      x = checkpoint_name(x, LAYER_INPUT)  # what "offload" keeps, in host memory
      if self.fsdp and gather:
        keep = self._split_weights(block, x.shape)
        params = self._gathered(params, after=None if training else x, keep=keep)
      copy = nnx.merge(graphdef, params, rest)
      return copy(x, attend), nnx.state(copy, nnx.Not(nnx.Param))

    if policy is not None:
      run = jax.checkpoint(run, policy=policy)
    y, after = run(params, rest, x)
    if not training:  # a prefill fills the caches of the copy: back to the block
      nnx.update(block, after)
    elif _tallies(block) is not None:  # the counts the call set (`Tally`)
      set_tallies(block, nnx.filter_state(after, Tally))
    return y

  def ring_permutation(self, length: int):
    """perm [length] such that tokens[:, perm] is the order every layer's ring runs in
    at `length` tokens (the balanced causal layout), where all layers share one layout
    that is not the natural order and `length` fits it; else None. A training call on
    tokens in that order (`hidden(..., token_order="layout")`) relays nothing per layer."""
    mesh, seq_axis, _ = self.placement
    if mesh is None or self.config.attention != "ring":
      return None
    found = {block.attn.token_layout(length) for block in self.blocks}
    if len(found) != 1:
      return None
    (layout,) = found
    shards = mesh.shape[seq_axis]
    if layout == "contiguous" or length % layouts.multiple(layout, shards):
      return None
    return layouts.permutation(layout, length, shards)

  def hidden(
    self,
    tokens,
    attend=None,
    *,
    shard: bool = True,
    token_order: str = "natural",
    segment_ids=None,
    positions=None,
  ):
    """The final normed hidden states [B, T, D] (the head's input). `token_order=
    "layout"`: the tokens come in `ring_permutation(T)`'s order, and the states go out
    in it (training calls). `shard=False` (decoding a few tokens): the tokens stay
    whole on every device and FSDP's weights are used where they lie, not gathered.

    `attend(module, h)` runs one of a block's sequence-mixing modules (its attention,
    and a short convolution where the block has one) on its normed input `h` in the
    call's mode: None for a training call (`module(h, ...)` with `token_order`,
    `segment_ids` and `positions` where given), `module.prefill(h, ...)` filling the
    caches, `module.decode(h)` appending to them."""
    tokens = self.check_tokens(tokens)
    training = attend is None
    if token_order not in ("natural", "layout") or (token_order == "layout" and not training):
      raise ValueError(f"token_order={token_order!r}: 'natural', or 'layout' for training calls")
    if token_order == "layout" and self.ring_permutation(tokens.shape[1]) is None:
      raise ValueError(f"token_order='layout': no single ring layout at length {tokens.shape[1]}")
    if training:
      given = dict(segment_ids=segment_ids, positions=positions)
      given = {k: v for k, v in given.items() if v is not None}
      if token_order == "layout":
        given["token_order"] = token_order
      attend = lambda module, h: module(h, **given)
    x = self.embed_input(tokens, shard)
    return self.norm(self.run_blocks(x, attend, training=training, gather=shard))

  def embed_input(self, tokens, shard: bool = True):
    """The blocks' input [B, T, D]: the tokens' embeddings (scaled where the family
    scales them), split over the sequence (`shard`) or whole (decoding)."""
    x = self._lookup(tokens) if shard else self.embed(tokens)
    scale = self.embed_scale(self.config)
    if scale != 1.0:
      x = x * jnp.asarray(scale, x.dtype)
    return self._shard(x) if shard else x

  def run_blocks(self, x, attend, *, training: bool, gather: bool = True):
    """x through every block: in training as a scan over their stacked weights where
    they repeat (`_scanned_blocks`), else one by one (`_run_block`)."""
    scanned = self._scanned_blocks(x, attend) if training else None
    if scanned is not None:
      return scanned
    for i, block in enumerate(self.blocks):
      with jax.named_scope(f"layer_{i}"):  # names the compiled program's ops by layer (scripts/aot.py)
        x = self._run_block(block, x, attend, training, gather=gather)
    return x

  def scan_plan(self):
    """How a training call runs the blocks as a scan (`_scanned_blocks`): one list per
    run of alike consecutive blocks in the period, holding for each of the scan's steps
    the indices of that run's blocks ([[0], [1], ...] for Llama; Gemma 3 270M: [[0..4],
    [6..10], [12..16]] and [[5], [11], [17]]). None where a training call runs the
    blocks one by one. `stack_blocks` stacks a state's weights this way ahead of the
    call (what `train.step.Trainer` keeps), so that the call does not stack them."""
    planned = self._plan()
    if planned is None:
      return None
    _, period, groups, runs = planned
    return [[[g * period + k for k in run] for g in range(groups)] for run in runs]

  def _plan(self):
    """(each block's split, the period, the whole periods, the runs of alike blocks in
    a period) of the training scan, or None (`scan_plan`)."""
    policy = REMAT_POLICIES[self.remat]
    if len(self.blocks) < 2 or (policy is None and not self.fsdp):
      return None
    splits = [nnx.split(block, nnx.Param, ...) for block in self.blocks]
    period = _period([g for g, _, _ in splits])
    if period is None or len(splits) // period < 2:
      return None
    # A period's consecutive alike blocks (Gemma 3's five windowed ones) run as a scan of
    # their own inside the period's: unrolled, XLA combined their gradients' reductions
    # into one and held all five layers' gathered weights and gradients at once.
    runs = []
    for k in range(period):
      if runs and splits[k][0] == splits[runs[-1][-1]][0]:
        runs[-1].append(k)
      else:
        runs.append([k])
    return splits, period, len(splits) // period, runs

  def _scanned_blocks(self, x, attend):
    """A training call's blocks as one `lax.scan` over their stacked weights, where the
    blocks repeat with a period p (Llama and Qwen: every block alike, p = 1; Gemma 3:
    five windowed blocks and a global one, p = 6) and FSDP or remat is on: the scan's
    body runs p blocks, and the backward pass then recomputes, gathers and reduces one
    period's layers at a time (unrolled, XLA was free to run every layer's recomputation
    at once and held every layer's gradient until one combined reduction: Gemma 3 270M's
    18 layers at 1,024 tokens on 8 devices, 1.3 GiB of temporaries a device). Layers
    past the last whole period run after the scan, one by one. None with fewer than two
    periods, or no period. The weights come stacked from `stacked_blocks` where the
    caller has them so (the trainer), else the call stacks them: a copy of every
    scanned block's weights, and of their gradients, for the call."""
    planned = self._plan()
    if planned is None:
      return None
    policy = REMAT_POLICIES[self.remat]
    splits, period, groups, runs = planned
    stacked = (_STACKED.get() or {}).get(id(self))
    if stacked is None:
      stack = lambda *xs: jnp.stack(xs)
      stacked = [
        tuple(
          jax.tree.map(
            stack,
            *[jax.tree.map(stack, *[splits[g * period + k][part] for k in run]) for g in range(groups)],
          )
          for part in (1, 2)
        )
        for run in runs
      ]
    graphdefs = [splits[run[0]][0] for run in runs]

    # The layer inputs the backward pass keeps (a stack [layers, B, T, D]) travel as
    # [B, T D / 128, 128]: as [B, T, D], XLA's GPU layout assignment gave the backward
    # loop's copy of the stack the layout its weight-gradient GEMMs read (T minor) and
    # transposed the whole stack once, holding it twice (32 GiB each for Llama-3.1-8B
    # at 1M tokens on 8 x H100); folded, the stack keeps one layout, and each layer's
    # input is transposed where the layer runs.
    b, t, d = x.shape
    fold = math.gcd(d, 128)
    folded = lambda x: x.reshape(b, t * (d // fold), fold)

    counted = any(_tallies(block) is not None for block in self.blocks)
    keeps = {g: self._split_weights(self.blocks[run[0]], x.shape) for g, run in zip(graphdefs, runs)}

    def one(graphdef, x, p, r):  # a block's output, and the counts it set (`Tally`)
      if self.fsdp:
        p = self._gathered(p, keep=keeps[graphdef])
      copy = nnx.merge(graphdef, p, r)
      return copy(x, attend), (nnx.state(copy, Tally) if counted else None)

    if period > 1 and policy is not None:
      # Each block of a period under the policy too: the period's backward recomputes
      # one block's activations, gathered weights and gradients at a time.
      one = jax.checkpoint(one, policy=policy, static_argnums=(0,))

    def run_of(graphdef, x, layers):  # a run's output, and its layers' counts stacked
      if jax.tree.leaves(layers)[0].shape[0] == 1:
        x, counts = one(graphdef, x, *jax.tree.map(lambda a: a[0], layers))
        return x, jax.tree.map(lambda c: c[None], counts)

      def step(x, layer):
        y, counts = one(graphdef, x.reshape(b, t, d), *layer)
        return folded(y), counts

      x, counts = jax.lax.scan(step, folded(x), layers)
      return x.reshape(b, t, d), counts

    def body(x, layers):
      x = checkpoint_name(x, LAYER_INPUT).reshape(b, t, d)  # what "offload" keeps, in host memory
      counts = []
      for graphdef, run_layers in zip(graphdefs, layers):
        x, c = run_of(graphdef, x, run_layers)
        counts.append(c)
      return folded(x), counts

    if self.remat == "offload" and period == 1:
      # Every block alike (Llama, Qwen, Mistral, mixtures of experts): each layer's
      # input comes back from host memory, and its weights are gathered, one layer
      # ahead (`_prefetched_offload_scan`).
      graphdef = graphdefs[0]
      keep = keeps[graphdef]

      def gather(p):
        return self._gathered(p, keep=keep) if self.fsdp else p

      def layer(x, p, r):
        copy = nnx.merge(graphdef, p, r)
        return folded(copy(x.reshape(b, t, d), attend)), (nnx.state(copy, Tally) if counted else None)

      x, counts = _prefetched_offload_scan(layer, gather, folded(x), *stacked[0])
      counts = [jax.tree.map(lambda a: a[:, None], counts)] if counted else None
    else:
      if policy is not None:
        body = jax.checkpoint(body, policy=policy)
      x, counts = jax.lax.scan(body, folded(x), stacked)
    x = x.reshape(b, t, d)
    if counted:  # each layer's counts [groups, run length, ...] back onto its block
      for run, c in zip(runs, counts):
        for g in range(groups):
          for j, k in enumerate(run):
            set_tallies(self.blocks[g * period + k], jax.tree.map(lambda a, g=g, j=j: a[g, j], c))
    for block in self.blocks[groups * period :]:
      x = self._run_block(block, x, attend, True, gather=True)
    return x

  def vocab_axes(self):
    """The mesh axes the vocabulary tables (embedding, head) are split over along the
    vocabulary, as `models.load` and `models.build` place them, or None."""
    mesh, seq_axis, _ = self.placement
    if mesh is None:
      return None
    v, d = self.config.vocab_size, self.config.dim
    if self.fsdp:
      first = fsdp_spec((v, d), mesh)[0] if len(fsdp_spec((v, d), mesh)) else None
      first = (first,) if isinstance(first, str) else first
      return tuple(first) if first else None
    return (seq_axis,) if v % mesh.shape[seq_axis] == 0 else None

  def _rows_spec(self, shape):
    """How tokens [B, T] split for the vocabulary rings, or None where they cannot."""
    mesh, seq_axis, batch_axis = self.placement
    if shape[1] % mesh.shape[seq_axis]:
      return None
    if batch_axis is not None and shape[0] % mesh.shape[batch_axis]:
      batch_axis = None
    return P(batch_axis, seq_axis)

  def _lookup(self, tokens):
    """The embeddings of `tokens`; with a table split along the vocabulary, the ring
    lookup (`vocabulary.embed`): no device gathers the table."""
    axes = self.vocab_axes()
    rows = None if axes is None else self._rows_spec(tokens.shape)
    if rows is None:
      return self.embed(tokens)
    dt = self.embed.dtype or self.embed.embedding.dtype
    token_axes = tuple(a for a in rows if a is not None)
    return jax.shard_map(
      lambda table, t: vocabulary.embed(table, t, axes, token_axes),
      mesh=self._auto_mesh(),
      in_specs=(P(axes, None), rows),
      out_specs=P(*rows, None),
    )(self.embed.embedding[...].astype(dt), tokens)

  def head_table(self):
    """The output head where it lives, as stored: the embedding [V, D] when tied, else
    the head's kernel [D, V]; and the mesh axes it is split over along the vocabulary
    (None: it is used whole)."""
    table = self.embed.embedding[...] if self.head is None else self.head.kernel[...]
    return table, self.vocab_axes()

  def head_weights(self):
    """The output head as [V, D] (the embedding when tied), whole (gathered under FSDP)."""
    table = self.head_table()[0]
    table = table if self.head is None else table.T
    return self._gathered(table) if self.fsdp else table

  def logits(self, h):
    """Logits float32 [..., V] of hidden states [..., D]."""
    dt = self.embed.dtype or h.dtype
    # The head where it lies (split along the vocabulary under FSDP): each device makes
    # the logits of its own rows of the table; only [..., V] logits move.
    table = self.head_table()[0]
    table = table if self.head is None else table.T
    return jnp.einsum("...d,vd->...v", h.astype(dt), table.astype(dt)).astype(jnp.float32)

  def __call__(self, tokens, *, segment_ids=None, positions=None):
    """Logits float32 [B, T, V]. Packed rows (`models.pack`): `segment_ids` int [B, T]
    (a token attends only to tokens of its own id; a negative id is padding, which
    attends to and is seen by nothing) and `positions` int [B, T] (the rotary positions:
    each example's from 0), so that each example's logits are those of it run alone.
    Outside a trace the forward runs as one jitted program: run op by op, its many small
    programs with collectives could be in flight at once, which on simulated CPU devices
    can deadlock XLA's client (`runtime.simulate_devices`)."""
    tokens = self.check_tokens(tokens)
    segment_ids, positions = self.check_rows(tokens, segment_ids, positions)
    if isinstance(tokens, jax.core.Tracer):
      return self.logits(self.hidden(tokens, segment_ids=segment_ids, positions=positions))
    return _forward(self, tokens, segment_ids, positions)

  def check_rows(self, tokens, segment_ids, positions):
    """`segment_ids` and `positions` as int arrays of the tokens' [B, T] (None stays
    None); ValueError naming the one of another shape or type, or (when known) a
    position outside [0, context length)."""
    out = []
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
      if value is None:
        out.append(None)
        continue
      if isinstance(value, (list, tuple, np.ndarray)):
        value = np.asarray(value)
        if not np.issubdtype(value.dtype, np.integer):
          raise ValueError(f"{name} of dtype {value.dtype} must be ints [batch, seq]")
        value = jnp.asarray(value.astype(np.int32))
      if tuple(value.shape) != tuple(tokens.shape) or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(
          f"{name} shape={tuple(value.shape)} dtype={value.dtype} must be int of the tokens' shape "
          f"{tuple(tokens.shape)}"
        )
      if name == "positions" and not isinstance(value, jax.core.Tracer):
        host = np.asarray(value)
        if host.min() < 0 or host.max() >= self.config.context_length:
          raise ValueError(
            f"positions hold {int(host.min())}..{int(host.max())}: rotary positions must be in "
            f"[0, {self.config.context_length}) (the context length)"
          )
      out.append(value)
    return tuple(out)

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
    tokens = self.check_tokens(tokens)
    h = self.hidden(tokens, lambda attn, h: attn.prefill(h, lengths=lengths))
    ends = jnp.full((tokens.shape[0],), tokens.shape[1]) if lengths is None else jnp.asarray(lengths)
    at_last = jnp.arange(tokens.shape[1])[None, :, None] == (ends - 1)[:, None, None]
    return self.logits(jnp.sum(jnp.where(at_last, h, 0), axis=1))

  def decode(self, tokens):
    """Logits [B, Tq, V] of each row's next Tq tokens, appended to the caches."""
    return self.logits(self.hidden(tokens, lambda attn, h: attn.decode(h), shard=False))


@nnx.jit
def _forward(model, tokens, segment_ids=None, positions=None):
  return model.logits(model.hidden(tokens, segment_ids=segment_ids, positions=positions))


# The scanned blocks' weights, stacked ahead of a training call (`stacked_blocks`), by
# the id of the model they belong to.
_STACKED = contextvars.ContextVar("jax_ring_stacked_blocks", default=None)
SCANNED = "scanned_blocks"  # where `stack_blocks` puts them in a model's state


@contextlib.contextmanager
def stacked_blocks(model, states):
  """Within it, `model`'s training calls take the scanned blocks' weights from `states`
  (the model's states as `stack_blocks` left them, e.g. the trained and the frozen
  weights) instead of stacking the blocks' own: the blocks' own are then not read."""
  runs = []
  for r in range(len(model.scan_plan())):
    parts = [st[SCANNED][r] for st in states if SCANNED in st and r in st[SCANNED]]
    whole = nnx.merge_state(*parts) if len(parts) > 1 else parts[0]
    runs.append(tuple(nnx.split_state(whole, nnx.Param, ...)))
  token = _STACKED.set({**(_STACKED.get() or {}), id(model): runs})
  try:
    yield
  finally:
    _STACKED.reset(token)


def _prefetched_offload_scan(layer, gather, x, weights, rest):
  """lax.scan of `layer(x, gathered weights, rest) -> (x, counts)` over the layers of
  `weights` and `rest` (each [layers, 1, ...], a run of one block) for remat "offload",
  with a backward pass of its own: (x, the layers' counts stacked).

  The forward keeps each layer's input in host memory and gathers the next layer's
  weights (`gather`, FSDP's all-gather) while the layer runs. The backward recomputes
  each layer from its input and, while it does, copies the next layer's input back and
  gathers its weights, one layer ahead, so that both run under a layer's compute; each
  layer's weight gradients are reduce-scattered where the layer's backward ends. Where
  XLA placed the copies for a checkpoint policy, each waited for its own layer
  (Llama-3.1-8B's 4 GiB a layer at 4M tokens on 8 x H100 with nothing under them), and
  each layer's gather came before its compute. Cotangents come for the weights being
  differentiated alone (adapters: not the frozen base); the rest (counters) gets none."""
  host, device = jax.memory.Space.Host, jax.memory.Space.Device
  primal = jax.custom_derivatives.CustomVJPPrimal
  traced = {}  # which weights the caller differentiates, read where the forward is traced
  n = jax.tree.leaves(weights)[0].shape[0]
  at = lambda tree, i: jax.tree.map(lambda a: a[i, 0], tree)

  @jax.custom_vjp
  def run(x, weights, rest):
    def step(x, i):
      return layer(x, gather(at(weights, i)), at(rest, i))

    return jax.lax.scan(step, x, jnp.arange(n))

  def forward(x, weights, rest):
    is_primal = lambda a: isinstance(a, primal)
    traced["wanted"] = [p.perturbed for p in jax.tree.leaves(weights, is_leaf=is_primal)]
    x, weights, rest = jax.tree.map(lambda p: p.value, (x, weights, rest), is_leaf=is_primal)

    def step(carry, i):
      x, here = carry
      ahead = gather(at(weights, jnp.minimum(i + 1, n - 1)))  # the next layer's, under this one
      y, counts = layer(x, here, at(rest, i))
      return (y, ahead), (jax.device_put(x, host), counts)

    (y, _), (inputs, counts) = jax.lax.scan(step, (x, gather(at(weights, 0))), jnp.arange(n))
    return (y, counts), (inputs, weights, rest)

  def backward(saved, cotangents):
    inputs, weights, rest = saved
    dy = cotangents[0]
    if isinstance(dy, jax.custom_derivatives.SymbolicZero):
      dy = jnp.zeros(inputs.shape[1:], inputs.dtype)
    leaves, tree = jax.tree.flatten(weights)
    chosen = [k for k, w in enumerate(traced["wanted"]) if w]
    gathered = lambda own: jax.tree.leaves(gather(jax.tree.unflatten(tree, own)))

    def with_chosen(all_leaves, trained):  # all_leaves with the differentiated ones replaced
      full = list(all_leaves)
      for k, v in zip(chosen, trained):
        full[k] = v
      return full

    def step(carry, i):
      dy, x, here = carry  # here: layer i's weights, gathered
      back = jnp.maximum(i - 1, 0)
      x_ahead = jax.device_put(inputs[back], device)  # the next layer back's input and weights
      ahead = gathered([a[back, 0] for a in leaves])
      others = at(rest, i)

      def one(x, trained):
        return layer(x, jax.tree.unflatten(tree, with_chosen(here, trained)), others)[0]

      _, pull = jax.vjp(one, x, [here[k] for k in chosen])
      dx, dgathered = pull(dy)
      own = [a[i, 0] for a in leaves]

      def gather_chosen(trained):  # the gather's transpose: the gradients reduce-scattered
        g = gathered(with_chosen(own, trained))
        return [g[k] for k in chosen]

      _, pull_gather = jax.vjp(gather_chosen, [own[k] for k in chosen])
      (dweights,) = pull_gather(dgathered)
      return (dx, x_ahead, ahead), dweights

    last = [a[n - 1, 0] for a in leaves]
    start = (dy, jax.device_put(inputs[n - 1], device), gathered(last))
    (dx, _, _), dchosen = jax.lax.scan(step, start, jnp.arange(n), reverse=True)
    dleaves = [jnp.zeros_like(a) for a in leaves]
    for k, d in zip(chosen, dchosen):
      dleaves[k] = d.reshape(leaves[k].shape)
    return dx, jax.tree.unflatten(tree, dleaves), None

  run.defvjp(forward, backward, symbolic_zeros=True)
  return run(x, weights, rest)


def stack_blocks(state, plan, stack):
  """`state` (a model's, or part of it: `nnx.split`'s) with the weights of the blocks a
  training scan runs (`plan`: `CausalLM.scan_plan()`) moved into one array per weight
  and run of alike blocks, [steps, blocks in the run, ...], under `state[SCANNED][r]`;
  the blocks past the last whole period stay where they were. `stack(list of lists of
  arrays) -> array` makes each stacked array (placed, or abstract: `train.step`).
  `unstack_blocks` undoes it."""
  if plan is None:
    return state
  flat = list(nnx.to_flat_state(state))
  owner = {
    i: (r, g, j) for r, run in enumerate(plan) for g, step in enumerate(run) for j, i in enumerate(step)
  }
  kept, by_leaf = [], {}
  for path, var in flat:
    if len(path) > 1 and path[0] == "blocks" and path[1] in owner:
      r, g, j = owner[path[1]]
      by_leaf.setdefault((r, path[2:]), {})[(g, j)] = var
    else:
      kept.append((path, var))
  for (r, rest), parts in by_leaf.items():
    rows = [[parts[(g, j)].get_value() for j in range(len(step))] for g, step in enumerate(plan[r])]
    kept.append(((SCANNED, r, *rest), parts[(0, 0)].replace(stack(rows))))
  return nnx.from_flat_state(kept)


def unstack_blocks(state, plan):
  """`stack_blocks`' state with each scanned block's weights back in its own place (as
  slices of the stacked arrays: copies, outside a traced function)."""
  if plan is None:
    return state
  flat = []
  for path, var in nnx.to_flat_state(state):
    if path[0] != SCANNED:
      flat.append((path, var))
      continue
    r, rest = path[1], path[2:]
    for g, step in enumerate(plan[r]):
      for j, i in enumerate(step):
        flat.append((("blocks", i, *rest), var.replace(var.get_value()[g, j])))
  return nnx.from_flat_state(flat)


def _period(graphdefs) -> int | None:
  """The smallest p with graphdefs[i] == graphdefs[i + p] for every i, or None."""
  n = len(graphdefs)
  for p in range(1, n // 2 + 1):
    if all(graphdefs[i] == graphdefs[i + p] for i in range(n - p)):
      return p
  return None


def embed_scale_sqrt_dim(config) -> float:
  return math.sqrt(config.dim)
