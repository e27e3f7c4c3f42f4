"""A mixture-of-experts feed-forward (Shazeer et al. 2017, "Outrageously Large Neural
Networks"; Mixtral and Qwen3-MoE's form): a router scores each token against every
expert, the token goes to its `top_k` experts, and its output is their gated MLPs'
outputs weighted by the router's probabilities.

By default the experts run as grouped matrix products (`jax.lax.ragged_dot`) over the
tokens sorted by expert: each expert multiplies only the tokens routed to it, with no
capacity and no token dropped. With a capacity factor c (`capacity_factor`, GShard's
and Switch Transformer's rule) each expert takes at most C = min(N, ceil(c N K / E))
of a group's N tokens, and the experts run as one batched product over an [E, C, D]
buffer (`run_experts_with_capacity`); an expert's pairs past C are dropped (that token
goes on without that expert's output, its residual intact) and counted
(`DroppedTokens`, `dropped_tokens`). A group is what one device routes in one call:
its own tokens of the batch (one feed-forward chunk of them in a long call,
`decoder.feed_forward`), in the order it holds them; each expert keeps its group's
first C. Over a mesh every device routes its own tokens (a `shard_map` over the
sequence and batch axes): the tokens keep their places in the ring's sequence order.
The experts' weights come to the tokens (whole on every device: FSDP gathers them
where the block runs), or, for short calls with a capacity, stay split over the
devices while each expert's rows go to its device and back (expert parallelism,
`MoE.expert_parallel`, chosen by the bytes each moves).

Legend: N tokens, D model width, E experts, K experts per token, F an expert's hidden
width.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import decoder

__all__ = [
  "DroppedTokens",
  "MoE",
  "balance_loss",
  "capacity",
  "dropped_tokens",
  "make_mlp",
  "route",
  "run_experts",
  "run_experts_with_capacity",
  "set_capacity",
  "slot_pieces",
]


def route(x, router, top_k: int, normalize: bool):
  """(weights [N, K], experts int32 [N, K], router probabilities [N, E]; float32 or wider) of
  tokens x [N, D] under router [D, E]: the softmax of the logits over experts, its
  `top_k` largest (exact ties to the lower expert index, `jax.lax.top_k`'s order;
  transformers' `torch.topk` leaves theirs unspecified), renormalized to sum to one
  where `normalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always)."""
  wide = jnp.promote_types(x.dtype, jnp.float32)  # float32 at least (float64 stays)
  logits = jnp.einsum("nd,de->ne", x, router.astype(x.dtype)).astype(wide)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts, probs


def run_experts(x, weights, experts, gate, up, down, activation=jax.nn.silu):
  """sum_k weights[n, k] * down(activation(gate(x[n])) * up(x[n])) of expert
  experts[n, k], for x [N, D] and the experts' stacked weights gate, up [E, D, F] and
  down [E, F, D]: the N K (token, expert) pairs sorted by expert, three grouped matrix
  products, and each pair's output added back to its token."""
  n, k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = order // k  # the token of each sorted pair
  sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
  xs = jnp.take(x, rows, axis=0)
  h = activation(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
  y = jax.lax.ragged_dot(h.astype(down.dtype), down, sizes)
  y = y * jnp.take(weights.reshape(-1), order)[:, None].astype(y.dtype)
  return jnp.zeros((n, y.shape[-1]), y.dtype).at[rows].add(y)


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """The most (token, expert) pairs one expert takes from a group of `tokens` tokens:
  ceil(factor tokens top_k / num_experts), at least 1, at most `tokens` (a token goes
  to an expert once: past that nothing can be dropped)."""
  return max(1, min(tokens, math.ceil(factor * tokens * top_k / num_experts)))


def slot_pieces(capacity: int, pieces: int) -> list[tuple[int, int]]:
  """The [lo, hi) ranges of an expert's `capacity` slots in `pieces` pieces (fewer
  when there are fewer slots), as even as they divide: the earlier ones one larger."""
  pieces = max(1, min(pieces, capacity))
  size, extra = divmod(capacity, pieces)
  bounds = np.cumsum([0] + [size + (i < extra) for i in range(pieces)])
  return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


# Expert parallelism's buffers travel in this many pieces of each expert's slots, so
# that the all-to-alls of one piece run while the experts compute on another
# (Tutel's pipelining of the capacity dimension: Hwang et al., MLSys 2023, "Tutel: Adaptive
# Mixture-of-Experts at Scale").
EP_PIECES = 8


def run_experts_with_capacity(
  x, weights, experts, gate, up, down, capacity: int, activation=jax.nn.silu, *, axis=None, pieces=None
):
  """(`run_experts`'s output with each expert taking at most `capacity` pairs, the
  number of pairs dropped: int32). The pairs sorted by expert (by token within one),
  the first `capacity` of each expert written to its rows of an [E, capacity, D]
  buffer, three batched matrix products over it, and each kept pair's output added
  back to its token; a dropped pair adds nothing.

  `axis` (inside `shard_map`; expert parallelism): gate, up and down are this
  device's E / n experts of the n devices of `axis`, the i-th slice of the experts;
  the buffer's rows for each device's experts go to it and their outputs come back
  (`jax.lax.all_to_all`, there and back), in `pieces` pieces of the slots (default
  `EP_PIECES`; `slot_pieces`) so that XLA can send one while the experts run on
  another. Every row is computed alone, so the pieces change no value."""
  pieces = EP_PIECES if pieces is None else pieces
  n, k = experts.shape
  devices = 1 if axis is None else jax.lax.axis_size(axis)
  e = gate.shape[0] * devices
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = order // k  # the token of each sorted pair
  chosen = jnp.take(flat, order)
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  slot = (
    jnp.arange(n * k, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[chosen]
  )  # place in its expert's queue
  keep = slot < capacity
  dest = jnp.where(keep, chosen * capacity + slot, e * capacity)  # past the buffer: dropped
  buf = jnp.zeros((e * capacity, x.shape[-1]), x.dtype).at[dest].set(jnp.take(x, rows, axis=0), mode="drop")
  buf = buf.reshape(e, capacity, -1)

  def mlp(rows):  # [..., E', C', D] under the E' experts of gate, up, down
    h = activation(jnp.einsum("...ecd,edf->...ecf", rows, gate)) * jnp.einsum("...ecd,edf->...ecf", rows, up)
    return jnp.einsum("...ecf,efd->...ecd", h.astype(down.dtype), down)

  if axis is None:
    out = mlp(buf)
  else:  # pieces of the slots: one's rows travel while another's run
    outs = []
    for lo, hi in slot_pieces(capacity, pieces):
      # [sources, E / n, C', D]: every device's rows for this one's experts
      part = jax.lax.all_to_all(buf[:, lo:hi], axis, 0, 0, tiled=True)
      part = mlp(part.reshape(devices, e // devices, hi - lo, -1)).reshape(e, hi - lo, -1)
      outs.append(jax.lax.all_to_all(part, axis, 0, 0, tiled=True))  # back to its source
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  out = out.reshape(e * capacity, -1)
  y = jnp.take(out, dest, axis=0, mode="fill", fill_value=0)
  y = y * jnp.take(weights.reshape(-1), order)[:, None].astype(y.dtype)
  dropped = jnp.sum(~keep, dtype=jnp.int32)
  return jnp.zeros((n, y.shape[-1]), y.dtype).at[rows].add(y), dropped


class DroppedTokens(decoder.Tally):
  """The (token, expert) pairs an MoE layer with a capacity dropped in its last call,
  over every device (int32): a token counts once for each of its experts that had no
  room for it."""


def set_capacity(model, factor: float | None):
  """Gives every MoE layer of `model` the capacity factor `factor` (see `MoE`; None:
  no capacity, every pair runs). Read when a call is traced: set it before building a
  `Trainer` or jitting a call. Returns the number of layers set; a model without MoE
  layers is refused."""
  if factor is not None and (
    isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0
  ):
    raise ValueError(f"capacity_factor={factor!r}: expected a number > 0, or None for no capacity")
  layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
  if not layers:
    raise ValueError(
      f"model {type(model).__name__} has no mixture-of-experts layer to give a capacity_factor"
    )
  for layer in layers:
    layer.capacity_factor = None if factor is None else float(factor)
    if factor is None and hasattr(layer, "dropped"):
      del layer.dropped
    elif factor is not None and not hasattr(layer, "dropped"):
      layer.dropped = DroppedTokens(np.zeros((), np.int32))  # NumPy: no device needed (deviceless compiles)
  return len(layers)


def dropped_tokens(model) -> jax.Array:
  """The pairs every MoE layer of `model` dropped in its last call, summed (int32; 0
  for a model without capacity). A training step reports it as "dropped_tokens"."""
  counts = jax.tree.leaves(nnx.state(model, DroppedTokens))
  return sum(counts, jnp.zeros((), jnp.int32))


@jax.custom_vjp
def _with_loss(y, loss):
  """y, unchanged; in the backward pass `loss` receives the gradient 1, as if it were
  added to the training loss (DeepSeek-V2's AddAuxiliaryLoss does this in PyTorch)."""
  return y


_with_loss.defvjp(lambda y, loss: (y, loss), lambda loss, g: (g, jnp.ones_like(loss)))


def balance_loss(probs, experts, num_experts: int, axes=None):
  """This device's part of the router's load-balancing loss (Switch Transformer, Fedus
  et al. 2021; transformers' `load_balancing_loss_func` for one layer): E sum_e f_e P_e,
  f_e the (token, expert) pairs that chose expert e over the N tokens, P_e expert e's
  mean router probability over them. N and the counts are over every device of `axes`
  (psum); the value is E sum_e f_e (this device's probabilities of e, summed) / N, so
  the devices' values add up to the loss and each one's gradient reaches its own
  tokens."""
  counts = jnp.zeros((num_experts,), probs.dtype).at[experts.reshape(-1)].add(1.0)
  tokens = jnp.asarray(probs.shape[0], probs.dtype)
  if axes:
    counts, tokens = jax.lax.psum(counts, axes), jax.lax.psum(tokens, axes)
  f = jax.lax.stop_gradient(counts / tokens)
  return num_experts * jnp.sum(f * jnp.sum(probs, axis=0)) / tokens


class MoE(nnx.Module):
  """The mixture-of-experts feed-forward: x [..., D] -> [..., D].

  router: nnx.Linear [D, E] (no bias); gate, up [E, D, F] and down [E, F, D] stacked
  over the experts. `placement` (mesh, seq_axis, batch_axis): where the tokens lie;
  each device routes its own.

  `balance`: the weight of this layer's load-balancing loss (`balance_loss`) in the
  gradients: the architectures give the config's `router_aux_loss_coef` divided by the
  number of sparse layers (the mean over layers). The loss is added in the backward
  pass alone, so a training step's gradients include it while the loss it reports and
  every forward value are the model's. Its statistics are over the call's tokens: a
  long call's feed-forward chunks (`decoder.feed_forward`) each count their own.

  `capacity_factor`: None (every pair runs, `run_experts`), or c > 0: each expert takes
  at most `capacity(N, top_k, E, c)` of a group's N tokens (`run_experts_with_capacity`)
  and `dropped` (`DroppedTokens`) holds the pairs the last call dropped.
  """

  def __init__(
    self,
    dim: int,
    hidden: int,
    num_experts: int,
    top_k: int,
    *,
    normalize: bool,
    balance: float = 0.0,
    capacity_factor: float | None = None,
    placement=(None, "seq", None),
    activation=jax.nn.silu,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.router = nnx.Linear(
      dim, num_experts, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), param_dtype))
    self.up = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), param_dtype))
    self.down = nnx.Param(init(rngs.params(), (num_experts, hidden, dim), param_dtype))
    self.top_k, self.normalize, self.activation = top_k, normalize, activation
    self.balance = float(balance)
    self.num_experts, self.hidden = num_experts, hidden
    self.weights_split = False  # FSDP's split of the experts (`decoder.CausalLM` sets it)
    self.capacity_factor = capacity_factor
    if capacity_factor is not None:
      self.dropped = DroppedTokens(np.zeros((), np.int32))
    self.dtype = dtype
    self.placement = nnx.static(tuple(placement))

  def expert_parallel(self, tokens: int, groups: int = 1) -> bool:
    """Whether a call that runs `groups` groups of `tokens` tokens a device (a long
    call's feed-forward chunks, `decoder.feed_forward`) splits the experts over the
    devices of the sequence axis (expert parallelism: each device runs E / n experts,
    and the tokens' rows go to them and back) rather than gathering them (FSDP). Only
    with a capacity, FSDP-split weights (split along the experts,
    `decoder.fsdp_spec`, so that they run where they lie) and a mesh whose other axes
    are 1; then by the elements each moves per layer, a forward with its
    recomputation and backward, all in the compute dtype: expert parallelism 6 E C D
    a group (each [E, C, D] buffer there and back, three times: the compiled step's
    all-to-alls), FSDP 9 E D F once for all the groups (two gathers of the three
    stacks and the reduce-scatter of their gradients, the transpose of the gather of
    their compute-dtype copies: the compiled step's). Experts that do not divide over
    the devices stay with FSDP, with a warning saying so."""
    mesh, seq_axis, _ = self.placement
    if self.capacity_factor is None or not self.weights_split or mesh is None:
      return False
    n = mesh.shape[seq_axis]
    if n == 1 or any(mesh.shape[a] > 1 for a in mesh.axis_names if a != seq_axis):
      return False
    if self.num_experts % n:
      warnings.warn(
        f"MoE: num_experts={self.num_experts} does not divide over the {n} devices of axis {seq_axis!r}, "
        "so the experts are gathered on every device (FSDP), not split over them (expert parallelism)",
        stacklevel=2,
      )
      return False
    c = capacity(tokens, self.top_k, self.num_experts, self.capacity_factor)
    return 6 * groups * c < 9 * self.hidden

  def split_weights(self, shape) -> tuple[str, ...]:
    """The weights a call on a block's input of `shape` [B, T, D] uses where they lie
    (split over the experts), not gathered: gate, up and down under expert
    parallelism (`expert_parallel`), else none."""
    mesh, seq_axis, _ = self.placement
    if mesh is None or len(shape) != 3 or shape[1] % mesh.shape[seq_axis]:
      return ()
    per = shape[1] // mesh.shape[seq_axis]
    chunk = decoder.chunk_tokens(per)
    return ("gate", "up", "down") if self.expert_parallel(shape[0] * chunk, per // chunk) else ()

  def _local(self, x, router, gate, up, down, axes=None, experts_axis=None):
    """(output, pairs dropped over every device of `axes`); `experts_axis`: the
    experts split over it (`run_experts_with_capacity`'s `axis`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts, probs = route(x2, router, self.top_k, self.normalize)
    if self.capacity_factor is None:
      y = run_experts(x2, weights, experts, gate, up, down, self.activation)
      dropped = jnp.zeros((), jnp.int32)
    else:
      most = capacity(x2.shape[0], self.top_k, self.num_experts, self.capacity_factor)
      y, dropped = run_experts_with_capacity(
        x2, weights, experts, gate, up, down, most, self.activation, axis=experts_axis
      )
      if axes:
        dropped = jax.lax.psum(dropped, axes)
    if self.balance:
      y = _with_loss(y, self.balance * balance_loss(probs, experts, self.num_experts, axes))
    return y.reshape(shape), dropped

  def __call__(self, x):
    dt = self.dtype or x.dtype
    x = x.astype(dt)
    params = [p[...].astype(dt) for p in (self.router.kernel, self.gate, self.up, self.down)]
    mesh, seq_axis, batch_axis = self.placement
    if mesh is None or x.ndim < 3 or x.shape[1] % mesh.shape[seq_axis]:
      y, dropped = self._local(x, *params)  # one device, or tokens the mesh does not split evenly
    else:
      if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis]:
        batch_axis = None
      rows = P(batch_axis, seq_axis, *([None] * (x.ndim - 2)))
      axes = (seq_axis,) if batch_axis is None else (batch_axis, seq_axis)
      auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
      # A group: this device's tokens of the call (x [B, T, ...] split along T), one
      # of `feed_forward`'s chunks in a long call.
      tokens = x.shape[0] * math.prod(x.shape[1:-1]) // mesh.shape[seq_axis]
      split = self.expert_parallel(tokens, decoder.feed_forward_groups())
      experts = P(seq_axis) if split else P()
      local = lambda x, *params: self._local(x, *params, axes=axes, experts_axis=seq_axis if split else None)
      y, dropped = jax.shard_map(
        local,
        mesh=auto,
        in_specs=(rows, P(), experts, experts, experts),
        out_specs=(rows, P()),
        check_vma=False,
      )(x, *params)
    if self.capacity_factor is not None:
      decoder.set_tallies(self, nnx.State({"dropped": DroppedTokens(dropped)}))
    return y


def make_mlp(config, hidden: int, *, normalize: bool, sparse_layers: int, mesh, seq_axis, batch_axis):
  """`decoder.PreNormBlock`'s `make_mlp` for a config's mixture of experts: its expert
  count, experts per token and compute dtypes, experts of width `hidden`, the
  load-balancing loss's weight `router_aux_loss_coef` / `sparse_layers` (its mean over
  the layers), and the tokens placed as the model's (none with dense attention)."""
  dt, pdt = decoder.dtypes(config)
  placement = (mesh if config.attention != "dense" else None, seq_axis, batch_axis)
  return lambda rngs: MoE(
    config.dim,
    hidden,
    config.num_experts,
    config.num_experts_per_tok,
    normalize=normalize,
    balance=config.router_aux_loss_coef / sparse_layers,
    placement=placement,
    dtype=dt,
    param_dtype=pdt,
    rngs=rngs,
  )
