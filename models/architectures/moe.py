"""A mixture-of-experts feed-forward (Shazeer et al. 2017, "Outrageously Large Neural
Networks"; Mixtral and Qwen3-MoE's form): a router scores each token against every
expert, the token goes to its `top_k` experts, and its output is their gated MLPs'
outputs weighted by the router's probabilities.

The experts run as grouped matrix products (`jax.lax.ragged_dot`) over the tokens
sorted by expert: each expert multiplies only the tokens routed to it, with no
capacity and no token dropped (`dropped_tokens` is 0 by construction). Over a mesh
every device routes its own tokens (a `shard_map` over the sequence and batch axes):
the tokens keep their places in the ring's sequence order, and the experts' weights
come to the tokens (whole on every device: FSDP gathers them where the block runs).

Legend: N tokens, D model width, E experts, K experts per token, F an expert's hidden
width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import decoder

__all__ = ["MoE", "balance_loss", "make_mlp", "route", "run_experts"]


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
    self.dtype = dtype
    self.placement = nnx.static(tuple(placement))

  def _local(self, x, router, gate, up, down, axes=None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, experts, probs = route(x2, router, self.top_k, self.normalize)
    y = run_experts(x2, weights, experts, gate, up, down, self.activation)
    if self.balance:
      y = _with_loss(y, self.balance * balance_loss(probs, experts, gate.shape[0], axes))
    return y.reshape(shape)

  def __call__(self, x):
    dt = self.dtype or x.dtype
    x = x.astype(dt)
    params = [p[...].astype(dt) for p in (self.router.kernel, self.gate, self.up, self.down)]
    mesh, seq_axis, batch_axis = self.placement
    if mesh is None or x.ndim < 3 or x.shape[1] % mesh.shape[seq_axis]:
      return self._local(x, *params)  # one device, or tokens the mesh does not split evenly
    if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis]:
      batch_axis = None
    rows = P(batch_axis, seq_axis, *([None] * (x.ndim - 2)))
    axes = (seq_axis,) if batch_axis is None else (batch_axis, seq_axis)
    auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    local = lambda x, *params: self._local(x, *params, axes=axes)
    return jax.shard_map(
      local, mesh=auto, in_specs=(rows, P(), P(), P(), P()), out_specs=rows, check_vma=False
    )(x, *params)


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
