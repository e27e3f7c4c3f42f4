"""The training step of every model here: a cross-entropy that never holds the [T, V]
logits (`chunked_cross_entropy`, over the vocabulary's rings where the table is split),
and `Trainer`, one jitted AdamW step over the model's weights where they live
(replicated, or split over every device with `fsdp=True`: the optimizer's moments
follow them), with its memory from the compiler; `place_batch`; and the step of a named
model compiled for hardware that is not here (`compile_train_step`).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import checkpoints, runtime
from ..architectures import decoder, moe, vocabulary
from ..architectures.decoder import fsdp_spec, is_experts, path_names


def chunked_cross_entropy(
  h,
  table,
  targets,
  weights,
  *,
  chunk: int = 512,
  mesh=None,
  seq_axis=None,
  batch_axis=None,
  table_axes=None,
  transposed: bool = False,
  predictions: bool = False,
  groups: int | None = None,
  group_ids=None,
):
  """sum(weights * cross-entropy(h @ table.T, targets)) / max(sum(weights), 1), with the
  logits made `chunk` tokens at a time and recomputed in the backward pass: at most
  [B, chunk, V] float32 logits exist at once (per device on a mesh), never [T, V]
  (Llama 3's 128K vocabulary at 64K tokens a device: 32 GiB of float32 logits).

  h [B, T, D] (final hidden states), table [V, D] (the head), targets int [B, T],
  weights float [B, T]. With `mesh`, each device scores its own tokens (T split over
  `seq_axis`, a mesh axis or a tuple of them, B over `batch_axis`) and the sums are
  added over the devices. With `table_axes` (the mesh axes `table` is split over along
  V), the table is never gathered: its shards pass each device in a ring
  (`vocabulary.cross_entropy`). `transposed`: `table` is given as [D, V] (an untied head's
  kernel). `predictions`: also the argmax token of every position, int [B, T], from
  the same chunks of logits (returns (loss, predictions); not with `table_axes`).

  `groups` n with `group_ids` int [B, T] (values in [0, n); any other id counts in no
  group): instead of the mean, the sums per row and group, (sum(weights * cross-entropy)
  [B, n], sum(weights) [B, n]): each packed document's negative log-likelihood, say."""
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk={chunk!r} must be a positive int")
  if targets.shape != h.shape[:2] or weights.shape != h.shape[:2]:
    raise ValueError(
      f"targets.shape={tuple(targets.shape)} and weights.shape={tuple(weights.shape)} must be h's [B, T] "
      f"{tuple(h.shape[:2])}"
    )
  if predictions and table_axes:
    raise ValueError(f"predictions=True needs the table whole (table_axes={table_axes!r})")
  if (groups is None) != (group_ids is None) or (groups is not None and predictions):
    raise ValueError(f"groups={groups!r} and group_ids go together, and not with predictions")
  if groups is not None and group_ids.shape != h.shape[:2]:
    raise ValueError(f"group_ids.shape={tuple(group_ids.shape)} must be h's [B, T] {tuple(h.shape[:2])}")
  grouped = groups is not None
  by_group = lambda values, ids: jnp.einsum("bt,btn->bn", values, jax.nn.one_hot(ids, groups or 1))
  weights = weights.astype(jnp.float32)
  length = h.shape[1]
  if transposed and not table_axes:
    table, transposed = table.T, False

  def local(h, targets, weights, ids, table):
    b, t, d = h.shape
    chunk_here = min(chunk, t)
    n = -(-t // chunk_here)
    pad = n * chunk_here - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
    ids = None if ids is None else jnp.pad(ids, ((0, 0), (0, pad)))
    split = lambda a: None if a is None else jnp.moveaxis(a.reshape(b, n, chunk_here, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(_, xs):
      hc, tc, wc, ic = xs
      logits = jnp.einsum("bcd,vd->bcv", hc, table.astype(hc.dtype), preferred_element_type=jnp.float32)
      lse = jax.nn.logsumexp(logits, axis=-1)
      picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
      best = jnp.argmax(logits, axis=-1).astype(jnp.int32) if predictions else None
      summed = by_group((lse - picked) * wc, ic) if grouped else jnp.sum((lse - picked) * wc)
      return None, (summed, best)

    _, (sums, best) = jax.lax.scan(body, None, (split(h), split(targets), split(weights), split(ids)))
    if predictions:
      best = jnp.moveaxis(best, 0, 1).reshape(b, n * chunk_here)[:, :t]
    if grouped:
      return jnp.sum(sums, axis=0), by_group(weights, ids), best
    return jnp.sum(sums), jnp.sum(weights), best

  if mesh is None:
    total, count, best = local(h, targets, weights, group_ids, table)
  else:
    seq_axes = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else (seq_axis,)
    pad = -length % math.prod(mesh.shape[a] for a in seq_axes)
    if pad:  # a length the devices do not divide: padded tokens of weight 0
      h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
      targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
      group_ids = None if group_ids is None else jnp.pad(group_ids, ((0, 0), (0, pad)))
    if batch_axis is not None and h.shape[0] % mesh.shape[batch_axis]:
      batch_axis = None
    axes = seq_axes if batch_axis is None else (batch_axis, *seq_axes)
    # Sums per row and group are added over the sequence's devices alone (rows stay where they are).
    summed_over = seq_axes if grouped else axes

    def ring(h, targets, weights, ids, table):
      chunk_here = min(chunk, h.shape[1])  # a device's tokens, not padded up to a longer chunk
      pad = -h.shape[1] % chunk_here
      h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
      targets, weights = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, weights))
      ids = None if ids is None else jnp.pad(ids, ((0, 0), (0, pad)))
      ce = vocabulary.cross_entropy(h, table, targets, table_axes, chunk_here, axes, transposed)
      if grouped:
        return by_group(ce * weights, ids), by_group(weights, ids), None
      return jnp.sum(ce * weights), jnp.sum(weights), None

    def summed(h, targets, weights, table, ids=None):
      total, count, best = (ring if table_axes else local)(h, targets, weights, ids, table)
      total, count = jax.lax.psum(total, summed_over), jax.lax.psum(count, summed_over)
      # The same sums on every device of the other axes (the ring's table may vary over
      # FSDP's data axis, which the tokens are not split over): their mean, typed alike.
      others = tuple(a for a in mesh.axis_names if a not in axes)
      if others:
        size = math.prod(mesh.shape[a] for a in others)
        total, count = jax.lax.psum(total, others) / size, jax.lax.psum(count, others) / size
      return total, count, best

    rows = P(batch_axis, seq_axes)
    sums = P(batch_axis) if grouped else P()
    total, count, best = jax.shard_map(
      summed,
      mesh=mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)),
      in_specs=(P(batch_axis, seq_axes, None), rows, rows, _table_spec(table_axes, transposed))
      + ((rows,) if grouped else ()),
      out_specs=(sums, sums, rows if predictions else None),
    )(h, targets, weights, table, *((group_ids,) if grouped else ()))
    best = best[:, :length] if predictions else None
  if grouped:
    return total, count
  value = total / jnp.maximum(count, 1.0)
  return (value, best) if predictions else value


def token_cross_entropy(
  h,
  table,
  targets,
  *,
  chunk: int = 512,
  mesh=None,
  seq_axis=None,
  batch_axis=None,
  table_axes=None,
  transposed: bool = False,
  entropy: bool = False,
):
  """Each token's cross-entropy float32 [B, T] of the logits h @ table.T against
  `targets` (`chunked_cross_entropy`'s chunks, mesh and vocabulary ring, without the
  sum), and with `entropy` each position's entropy of the softmax [B, T] (a statistic:
  no gradient flows through it); returns (cross-entropy, entropy or None)."""
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk={chunk!r} must be a positive int")
  if targets.shape != h.shape[:2]:
    raise ValueError(f"targets.shape={tuple(targets.shape)} must be h's [B, T] {tuple(h.shape[:2])}")
  if transposed and not table_axes:
    table, transposed = table.T, False
  length = h.shape[1]

  def run(h, targets, table):
    b, t, _ = h.shape
    c = min(chunk, t)
    pad = -t % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    if table_axes:
      ce = vocabulary.cross_entropy(h, table, targets, table_axes, c, axes, transposed)
      ent = None
      if entropy:
        stop = jax.lax.stop_gradient
        ent = vocabulary.entropy(stop(h), stop(table), table_axes, c, axes, transposed)
      return ce[:, :t], None if ent is None else ent[:, :t]
    n = (t + pad) // c
    split = lambda a: jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(_, xs):
      hc, tc = xs
      logits = jnp.einsum("bcd,vd->bcv", hc, table.astype(hc.dtype), preferred_element_type=jnp.float32)
      lse = jax.nn.logsumexp(logits, axis=-1)
      picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
      ent = None
      if entropy:
        stopped = jax.lax.stop_gradient(logits)
        ent = jax.lax.stop_gradient(lse) - jnp.sum(jax.nn.softmax(stopped, axis=-1) * stopped, axis=-1)
      return None, (lse - picked, ent)

    _, (ce, ent) = jax.lax.scan(body, None, (split(h), split(targets)))
    whole = lambda a: None if a is None else jnp.moveaxis(a, 0, 1).reshape(b, n * c)[:, :t]
    return whole(ce), whole(ent)

  if mesh is None:
    axes = ()
    return run(h, targets, table)
  axes = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else (seq_axis,)
  pad = -length % math.prod(mesh.shape[a] for a in axes)
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  if batch_axis is not None and h.shape[0] % mesh.shape[batch_axis]:
    batch_axis = None
  axes = axes if batch_axis is None else (batch_axis, *axes)
  rows = P(batch_axis, axes[1:] if batch_axis is not None else axes)
  ce, ent = jax.shard_map(
    run,
    mesh=mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)),
    in_specs=(P(*rows, None), rows, _table_spec(table_axes, transposed)),
    out_specs=(rows, rows if entropy else None),
  )(h, targets, table)
  return ce[:, :length], None if ent is None else ent[:, :length]


def _like_hidden(model, x):
  """x [B, T] split over the sequence (and batch) as the model's hidden states are."""
  mesh, seq_axis, batch_axis = model.placement
  if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis]:
    batch_axis = None
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  return jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(batch_axis, seq_axis)))


def _table_spec(axes, transposed):
  if not axes:
    return P()
  return P(None, axes) if transposed else P(axes, None)


def loss(
  model,
  tokens,
  targets,
  weights,
  *,
  chunk: int = 512,
  segment_ids=None,
  positions=None,
  groups: int | None = None,
  group_ids=None,
):
  """The model's chunked cross-entropy of `targets` after `tokens` (`chunked_cross_entropy`).
  Packed rows: `segment_ids` and `positions` [B, T] as the model takes them (each
  example attends only within itself, with its own rotary positions); `weights` must
  then be 0 where a target is another example's token. `groups` and `group_ids` [B, T]:
  the sums per row and group instead of the mean (`chunked_cross_entropy`)."""
  rows = dict(segment_ids=segment_ids, positions=positions)
  rows = {k: v for k, v in rows.items() if v is not None}
  perm = model.ring_permutation(tokens.shape[1])
  if perm is None:
    h = model.hidden(tokens, **rows)
  else:  # every layer in the ring's order: the loss sums over tokens in any order
    laid = lambda a: _like_hidden(model, jnp.take(jnp.asarray(a), perm, axis=1))
    tokens, targets, weights = (laid(a) for a in (tokens, targets, weights))
    group_ids = None if group_ids is None else laid(group_ids)
    rows = {k: laid(v) for k, v in rows.items()}
    h = model.hidden(tokens, token_order="layout", **rows)
  table, axes = model.head_table()
  if axes is None:  # the table whole on every device
    table = model.head_weights()
  transposed = axes is not None and model.head is not None
  with jax.named_scope("jax_ring.loss_head"):  # the head and its softmax, named for profiles
    return chunked_cross_entropy(
      h,
      table,
      targets,
      weights,
      chunk=chunk,
      **placement(model),
      table_axes=axes,
      transposed=transposed,
      groups=groups,
      group_ids=group_ids,
    )


def token_logps(
  model, tokens, targets, *, chunk: int = 512, temperature: float = 1.0, entropy: bool = False,
  segment_ids=None, positions=None,
):  # fmt: skip
  """Each target's log-probability float32 [B, T] under the softmax of the model's
  logits over `temperature` after `tokens` (packed rows as `loss` takes them), in the
  tokens' order; and with `entropy` each position's entropy of that softmax [B, T] (a
  statistic, no gradient), else None. The logits are linear in the final hidden states,
  which are divided by the temperature (in their dtype) before the head."""
  rows = dict(segment_ids=segment_ids, positions=positions)
  rows = {k: v for k, v in rows.items() if v is not None}
  perm = model.ring_permutation(tokens.shape[1])
  if perm is None:
    h = model.hidden(tokens, **rows)
  else:  # the ring's order through the layers, then back to the tokens' order
    laid = lambda a: _like_hidden(model, jnp.take(jnp.asarray(a), perm, axis=1))
    tokens, targets = laid(tokens), laid(targets)
    rows = {k: laid(v) for k, v in rows.items()}
    h = model.hidden(tokens, token_order="layout", **rows)
  if temperature != 1.0:
    h = h / jnp.asarray(temperature, h.dtype)
  table, axes = model.head_table()
  if axes is None:
    table = model.head_weights()
  transposed = axes is not None and model.head is not None
  ce, ent = token_cross_entropy(
    h, table, targets, chunk=chunk, **placement(model), table_axes=axes, transposed=transposed,
    entropy=entropy,
  )  # fmt: skip
  if perm is not None:
    back = np.argsort(np.asarray(perm))
    ce = _like_hidden(model, jnp.take(ce, back, axis=1))
    ent = None if ent is None else _like_hidden(model, jnp.take(ent, back, axis=1))
  return -ce, ent


def placement(model, seq_axis=None) -> dict:
  """`chunked_cross_entropy`'s mesh, seq_axis and batch_axis for a model's hidden states
  (its `placement`; `seq_axis` where the tokens are split over more axes than its own)."""
  mesh, own, batch_axis = model.placement
  return dict(mesh=mesh, seq_axis=own if seq_axis is None else seq_axis, batch_axis=batch_axis)


@functools.cache
def make_tx(lr: float, warmup: int, steps: int, weight_decay: float, clip: float, end: float = 0.1):
  """AdamW (float32 moments) with linear warmup then cosine decay to `end` x `lr`, after
  clipping the gradients' global norm at `clip`; cached, so that runs with the same
  settings share one optimizer and hence one compiled step."""
  schedule = make_schedule(lr, warmup, steps, end)
  return optax.chain(clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))


def make_schedule(lr: float, warmup: int, steps: int, end: float = 0.1):
  """`make_tx`'s learning rate at each step (0-based): a linear warmup whose first step
  already trains, lr / warmup at step 0 up to `lr` at step warmup - 1 (`warmup` 0 or 1:
  `lr` from the first step), then cosine decay to `end` x `lr` at the last step, steps - 1.
  optax's schedule from 0 gives its first update a rate of 0 (transformers' warmup
  does too: its first optimizer step runs before the scheduler's first step), which
  leaves the first step's weights as they were; here the rate at step k is optax's at
  k + 1."""
  base = optax.warmup_cosine_decay_schedule(
    0.0, lr, warmup_steps=max(warmup, 1), decay_steps=max(steps, warmup + 1), end_value=lr * end
  )
  return lambda count: base(count + 1)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax's `clip_by_global_norm` as one multiplication by min(1, max_norm / norm).
  optax divides by the norm and selects between the two, which XLA's CPU fusion kept as
  a second array of each gradient's size where two updates (the moments) read it: the
  embedding's 80 MiB a device for Gemma 3 270M on 8 devices."""

  def update(updates, state, params=None):
    del params
    scale = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def per_device_bytes(tree) -> int:
  """Bytes the first device holds of `tree`'s arrays (what each device holds, for the
  even splits and the replicated arrays here)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += leaf.addressable_shards[0].data.nbytes
  return total


def unsplit_bytes(model) -> int:
  """Bytes a device holds of the weights FSDP cannot split (no dimension the device
  count divides: `decoder.fsdp_spec`); 0 without FSDP or where every weight splits."""
  mesh = model.placement[0]
  if not getattr(model, "fsdp", False) or mesh is None:
    return 0
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  split = lambda path, v: fsdp_spec(v.shape, mesh, experts=is_experts(path, v.shape))
  return sum(v[...].nbytes for path, v in flat if v[...].ndim and split(path, v) == P())


def cross_entropy(model, tokens, targets, weights, *, chunk: int = 512, **rows):
  """A loaded model's objective for `Trainer`: (`loss`, statistics: "dropped_tokens",
  the (token, expert) pairs its MoE layers dropped for capacity, where they have one,
  `moe.set_capacity`). `rows`: packed rows' segment_ids and positions (`loss`)."""
  value = loss(model, tokens, targets, weights, chunk=chunk, **rows)
  if not jax.tree.leaves(nnx.state(model, moe.DroppedTokens)):
    return value, {}
  return value, {"dropped_tokens": moe.dropped_tokens(model)}


class Trainer:
  """The training step of every model here: the model's weights, their AdamW state
  (split as the weights are: replicated, or over every device with FSDP) and one jitted
  step, `step(tokens, targets, weights) -> (loss, stats)`: stats holds the gradient's
  global norm ("grad_norm") and what the objective reports beside its loss.
  `evaluate(...)` gives (loss, stats) without a step; `model()` the model with the
  current weights.

  objective(model, tokens, targets, weights, chunk=) -> (loss, dict of scalars): by
  default a loaded model's chunked cross-entropy (`cross_entropy`); `DecoderLM`s train
  with `models.training.loss_and_accuracy`. `trainable`: which weights the step trains
  (an nnx filter: all of them, or `nnx.LoRAParam` for adapters only)."""

  def __init__(self, model, tx, *, chunk: int = 512, objective=cross_entropy, trainable=nnx.Param):
    # `trainable`: the weights the step updates (an nnx filter; `nnx.LoRAParam`: the
    # adapters only, the rest frozen: no gradient or optimizer state for them).
    self.graphdef, params, rest = nnx.split(model, trainable, ...)
    # The blocks a training call runs as a scan keep their weights stacked here, trained
    # and frozen alike (`decoder.stack_blocks`, MaxText's scanned layers): a step that
    # took them one array a block would stack a copy of them, and of their gradients,
    # every step (Gemma 3 270M on 8 devices in float32: 48 MiB of the step's
    # temporaries a device).
    self.plan = model.scan_plan() if isinstance(model, decoder.CausalLM) else None
    self.params = decoder.stack_blocks(params, self.plan, stack=_stack_placed)
    self.rest = decoder.stack_blocks(rest, self.plan, stack=_stack_placed)
    # The blocks' own arrays, now copied into the stacks: the first step deletes them,
    # as it deletes (donates) the model's other trained arrays.
    self._stacked_from = _stacked_arrays(params, self.plan) + _stacked_arrays(rest, self.plan)
    # What the compile needs to know of layer inputs kept in host memory (`_program`).
    offload = isinstance(model, decoder.CausalLM) and model.remat == "offload"
    self._offload = model.config if offload else None
    self.tx, self.chunk = tx, chunk
    self.opt_state = tx.init(self.params)
    self.opt_state = jax.tree.map(_on_mesh(model), self.opt_state)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    self._step = jax.jit(
      functools.partial(_step, self.graphdef, tx, objective, chunk, self.plan),
      donate_argnums=(0, 2),
      out_shardings=(shardings(self.params), shardings(self.opt_state), None, None),
    )
    self._evaluate = jax.jit(
      functools.partial(evaluate_objective, self.graphdef, objective, chunk, self.plan)
    )
    self._programs = {}

  def _program(self, tokens, targets, weights, rows):
    """The step compiled once per batch shape and placement, for `step`, `memory` and
    `compiled` alike (a jitted call would compile the program `compiled` made again:
    twice the compile's host memory, 0.6 GiB for Gemma 3 270M on 8 devices)."""
    arrays = (tokens, targets, weights, *rows.values())
    key = (tuple(rows), *((a.shape, a.dtype, getattr(a, "sharding", None)) for a in arrays))
    if key not in self._programs:
      extra = (rows,) if rows else ()  # without rows, the program takes the six arguments it always took
      lowered = self._step.lower(self.params, self.rest, self.opt_state, tokens, targets, weights, *extra)
      self._programs[key] = compile_with(lowered, self._compiler_options(tokens))
      runtime.release_free_memory()
    return self._programs[key]

  def _compiler_options(self, tokens) -> dict:
    """The step's XLA options on this machine's devices: `CPU_COMPILER_OPTIONS` on CPUs,
    `TPU_COMPILER_OPTIONS` on TPUs, `offload_compiler_options` on GPUs."""
    leaves = [x for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)]
    device = next(iter(leaves[0].devices())) if leaves else jax.devices()[0]
    if device.platform == "cpu":
      return dict(CPU_COMPILER_OPTIONS)
    if device.platform == "tpu":
      return dict(TPU_COMPILER_OPTIONS)
    if self._offload is None or device.platform not in ("gpu", "cuda"):
      return {}
    config = self._offload
    local = tokens.addressable_shards[0].data.size if isinstance(tokens, jax.Array) else np.size(tokens)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return offload_compiler_options(
      device.platform, host_bytes=offloaded_bytes(config, local), device_bytes=limit
    )

  def release(self) -> None:
    """Deletes the trainer's weights and optimizer state on the devices (and the
    blocks' arrays it copied into its stacks), for a restore to replace them
    (`state.Checkpoints.restore`)."""
    _delete(jax.tree.leaves((self.params, self.opt_state)))
    self._drop_copied()

  def _drop_copied(self) -> None:
    """Deletes the blocks' own arrays that the stacks copied (the model's)."""
    _delete(self._stacked_from)
    self._stacked_from = []

  def step(self, tokens, targets, weights, **rows):
    """One AdamW step on a batch: (loss, stats). Packed rows take `segment_ids` and
    `positions` [B, T] (`loss`); an objective may take more arrays (`dpo`'s reference)."""
    rows = _rows(**rows)
    extra = (rows,) if rows else ()
    program = self._program(tokens, targets, weights, rows)
    self._drop_copied()
    self.params, self.opt_state, value, stats = program(
      self.params, self.rest, self.opt_state, tokens, targets, weights, *extra
    )
    return value, stats

  def evaluate(self, tokens, targets, weights, **rows):
    return self._evaluate(self.params, self.rest, tokens, targets, weights, _rows(**rows))

  def compiled(self, tokens, targets, weights, **rows):
    """The step compiled for these shapes (`memory_analysis()`, `as_text()`)."""
    return self._program(tokens, targets, weights, _rows(**rows))

  def weights(self):
    """The trained weights as the model lays them out (each block's its own arrays:
    copies of the stacks' slices), an `nnx.State`."""
    return decoder.unstack_blocks(self.params, self.plan)

  def model(self):
    """The model with the current weights (each block's its own arrays again: copies of
    the stacks' slices)."""
    unstack = lambda state: decoder.unstack_blocks(state, self.plan)
    return nnx.merge(self.graphdef, unstack(self.params), unstack(self.rest))

  def memory(self, tokens, targets, weights, **rows) -> dict:
    """Per device: the trained weights' and the optimizer state's bytes, the step's
    compiled temporaries, and the frozen weights' bytes ("frozen_bytes", where some are)."""
    temp = self.compiled(tokens, targets, weights, **rows).memory_analysis().temp_size_in_bytes
    out = dict(
      param_bytes=per_device_bytes(self.params),
      optimizer_bytes=per_device_bytes(self.opt_state),
      temp_bytes=int(temp),
    )
    frozen = per_device_bytes(nnx.filter_state(self.rest, nnx.Param))
    if frozen:  # weights the step does not train (adapters: the base)
      out["frozen_bytes"] = frozen
    return out


def _on_mesh(model):
  """The optimizer's scalars (its step count) replicated on the model's mesh, beside the
  moments, which optax makes with zeros_like and so placed as the weights they follow.
  Each process places its own copy (the same on all)."""
  mesh = model.placement[0]
  if mesh is None:
    return lambda x: x
  whole = NamedSharding(mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)), P())

  def place(x):
    if not (isinstance(x, jax.Array) and x.ndim == 0):
      return x
    value = np.asarray(x)
    return jax.make_array_from_callback((), whole, lambda index: value[index])

  return place


def _rows(**rows) -> dict:
  """A packed batch's other arrays (segment_ids, positions, ...), those given, for the objective."""
  return {k: v for k, v in sorted(rows.items()) if v is not None}


# XLA:CPU orders a program for concurrency by default, which keeps more of its buffers
# alive at once; its memory-minimizing order gave Gemma 3 270M's step in float32 on 8
# simulated devices at 1,024 tokens 213.2 MiB of temporaries a device where the default
# gave 237.8, a peak of 5.36 GiB resident where the default gave 5.79, in the same step
# time (24.1 and 22.9 s; 24.1 and 22.6 s by default: docs/training.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

# XLA:TPU runs the FSDP gathers (which it compiles as all-reduces) and the gradients'
# all-reduces synchronously by default, and expert parallelism's all-to-alls too. These
# make them asynchronous and let the compiler fuse their steps with compute ("async
# collective fusion"; the all-gather and all-reduce sets are MaxText's
# `benchmarks/xla_flags_library.py` CF_FOR_ALL_GATHER and CF_FOR_ALL_REDUCE). Compiled
# for v5p:4x4x4, Qwen3-30B-A3B's offloaded step at 1M tokens exposed 37 of its 1,189
# MiB of gathers a layer in the forward, where it exposed all of them, and 1,225 of
# 2,377 MiB in the backward, where it exposed all (docs/training.md). An option this
# libtpu lacks is left out with a warning (`compile_with`).
TPU_COMPILER_OPTIONS = {
  "xla_tpu_enable_async_collective_fusion": True,
  "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
  "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
  "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
  "xla_tpu_overlap_compute_collective_tc": True,
  "xla_enable_async_all_gather": True,
  "xla_enable_async_all_reduce": True,
  "xla_tpu_enable_async_all_to_all": True,
}


def compile_with(lowered, options: dict):
  """`lowered.compile` with the XLA options `options`, leaving out, with a warning, each
  that this XLA does not have (an option's name can change between libtpu or jaxlib
  versions; XLA refuses a program with an unknown one)."""
  options = dict(options)
  while True:
    try:
      return lowered.compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:
      unknown = re.search(r"No such compile option: '([^']+)'", str(e))
      if not unknown or unknown.group(1) not in options:
        raise
      warnings.warn(
        f"XLA here has no compile option {unknown.group(1)!r}: the step compiles without it", stacklevel=2
      )
      del options[unknown.group(1)]


def offloaded_bytes(config, tokens_per_device: int, dtype=None) -> int:
  """The bytes a device keeps in host memory under remat "offload": every layer's input,
  [its tokens, D] in the compute dtype (`dtype`, else the config's; `decoder.LAYER_INPUT`)."""
  dt = dtype or decoder.dtypes(config)[0] or decoder.dtypes(config)[1]
  return config.num_layers * tokens_per_device * config.dim * jnp.dtype(dt).itemsize


# How many collectives XLA:GPU's scheduler may keep in flight at once in a step with
# offloaded layer inputs (1 by default). With one, a layer's weight gathers waited for
# the attention's ring transfers: Qwen3-30B-A3B's expert gathers (3 x 384 MiB a layer)
# ran with no compute under them in the forward and backward passes, as did its
# gradients' reduce-scatters (3 x 432 MiB); with 8 all of them run under compute
# (`decoder._prefetched_offload_scan` gathers a layer's weights a layer ahead). 2 and 4
# left some exposed (4 layers at 1M tokens, compiled for 8 x H100, 2026-11-28).
OVERLAP_LIMIT = 8


def offload_compiler_options(platform: str, *, host_bytes: int, device_bytes: int | None) -> dict:
  """XLA options for a step that keeps its layer inputs in host memory (remat
  "offload"). XLA:GPU's latency-hiding scheduler keeps a program under the device's
  memory times `xla_gpu_memory_limit_slop_factor` / 100 (95 by default), and counts
  the host-memory stack of layer inputs as device memory, as the rematerialization pass
  before it does (`scripts/aot.py` explains its warning). Past that limit it gives up
  overlap for memory: Llama-3.1-8B's step at 4M tokens on 8 x H100 (128 GiB of layer
  inputs in host memory a device, 58.8 GiB of device memory) ran its backward ring
  steps synchronously. The factor here sets the limit to the device plus 8 x the host
  bytes. The scheduler's estimate runs past the device plus the stack, by how much is
  not reported: for Qwen3-30B-A3B's step at 1M (24 GiB of host stack) a factor of 138
  (the device plus 1.25 x the stack) left backward ring steps synchronous and 153 did
  not; Llama-3.1-8B's at 4M was overlapped from 249 to 400. With the layers' weights
  gathered a layer ahead, Qwen3-30B-A3B's expert gathers ran exposed in both passes at
  the device plus twice the stack, in the backward at 4 x, and under compute at 8 x and
  16 x, at a peak of 74.8 GiB (compiled 2026-11-28). `step_memory` still checks the
  compiled program against the device alone. With it, `OVERLAP_LIMIT` collectives in
  flight at once. Empty off GPUs or with nothing in host memory."""
  if platform not in ("gpu", "cuda") or host_bytes <= 0 or not device_bytes:
    return {}
  return {
    "xla_gpu_memory_limit_slop_factor": math.ceil(100 * (device_bytes + 8 * host_bytes) / device_bytes),
    "xla_gpu_experimental_parallel_collective_overlap_limit": OVERLAP_LIMIT,
  }


def _stack_placed(rows):
  """A stacked weight [steps, blocks in the run, ...] from its blocks' arrays, split as
  each of them is (`decoder.stack_blocks`)."""
  stacked = jnp.stack([jnp.stack(row) for row in rows])
  sharding = _stacked_sharding(rows[0][0])
  return stacked if sharding is None else jax.device_put(stacked, sharding)


def _stacked_sharding(weight):
  """Where a stack [steps, blocks in the run, ...] of arrays placed as `weight` goes:
  each block's part split as `weight` is; None for a weight without a NamedSharding."""
  sharding = getattr(weight, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (len(weight.shape) - len(sharding.spec))
  return NamedSharding(sharding.mesh, P(None, None, *spec))


def _delete(arrays) -> None:
  for array in arrays:
    if isinstance(array, jax.Array) and not array.is_deleted():
      array.delete()


def _stacked_arrays(state, plan) -> list:
  """The arrays of `state` that `decoder.stack_blocks` copies into its stacks."""
  if plan is None:
    return []
  scanned = {i for run in plan for step in run for i in step}
  return [
    var[...]
    for path, var in nnx.to_flat_state(state)
    if len(path) > 1 and path[0] == "blocks" and path[1] in scanned and isinstance(var[...], jax.Array)
  ]


def _as_model(graphdef, plan, params, rest):
  """The model a step's objective calls (a copy: the calls set counts, `decoder.Tally`,
  inside the gradient's trace, and `rest`'s variables belong to the step's), and the
  context in which its calls read the scanned blocks' weights from their stacks."""
  rest = rest if isinstance(rest, tuple) else (rest,)
  unstack = lambda state: decoder.unstack_blocks(state, plan)
  model = nnx.merge(graphdef, unstack(params), *map(unstack, rest), copy=True)
  if plan is None:
    return model, contextlib.nullcontext()
  return model, decoder.stacked_blocks(model, (params, *rest))


def _step(graphdef, tx, objective, chunk, plan, params, rest, opt_state, tokens, targets, weights, rows=None):
  def value(p):
    model, stacked = _as_model(graphdef, plan, p, rest)
    with stacked:
      return objective(model, tokens, targets, weights, chunk=chunk, **(rows or {}))

  (loss_value, stats), grads = jax.value_and_grad(value, has_aux=True)(params)
  with jax.named_scope("jax_ring.optimizer"):  # named for profiles (bench_train_gpu.py --profile)
    updates, opt_state = tx.update(grads, opt_state, params)
    stats = dict(stats, grad_norm=optax.tree.norm(grads))
    return optax.apply_updates(params, updates), opt_state, loss_value, stats


def evaluate_objective(graphdef, objective, chunk, plan, params, rest, tokens, targets, weights, rows=None):
  """`objective` of the model `graphdef` with `params` and `rest` (the blocks' weights
  stacked as `plan` says, as `Trainer` keeps them), on one batch, without a step."""
  model, stacked = _as_model(graphdef, plan, params, rest)
  with stacked:
    return objective(model, tokens, targets, weights, chunk=chunk, **(rows or {}))


def place_batch(model, *arrays):
  """Arrays [B, T] split as the model's hidden states are (T over the seq axis, B over
  the batch axis), when the shapes divide; arrays of other shapes replicated."""
  mesh, seq_axis, batch_axis = model.placement
  if mesh is None:
    return tuple(jnp.asarray(a) for a in arrays)
  b, t = arrays[0].shape
  batch_axis = batch_axis if batch_axis is not None and b % mesh.shape[batch_axis] == 0 else None
  spec = P(batch_axis, seq_axis if t % mesh.shape[seq_axis] == 0 else None)
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  # Arrays of another shape than the first's ([B, slots] per document, say) are whole on every device.
  where = lambda a: NamedSharding(auto, spec if np.shape(a) == (b, t) else P())
  return tuple(jax.device_put(np.asarray(a), where(a)) for a in arrays)


# --- Compiling a training step for hardware that is not here. ---


def compile_train_step(
  name: str,
  mesh,
  *,
  seq_len: int,
  batch: int = 1,
  remat: str = "full",
  dtype: str = "bfloat16",
  param_dtype: str = "float32",
  chunk: int = 1024,
  layers: int | None = None,
  capacity_factor: float | None = None,
  lora_rank: int | None = None,
  lora_alpha: float | None = None,
  device_bytes: int | None = None,
  objective=None,
  objective_rows=None,
):
  """One whole AdamW step of the named model (`models.config(name)`) with `fsdp=True`,
  per-layer `remat` and the chunked loss, over `mesh`'s "seq" axis, compiled with
  abstract weights (nothing allocated): the `Compiled` program. Weights and AdamW
  moments in `param_dtype`, computed in `dtype`; the ring's kernel is the target's
  default. `layers`: the model with that many of its blocks (a quicker compile of the
  same step's shapes; None: all). `capacity_factor`: a mixture of experts' capacity
  (`moe.set_capacity`; None: every pair runs). `lora_rank`: low-rank adapters
  (`models.add_lora`, alpha `lora_alpha`, default 2 x rank) on every projection (the
  attention's alone for a mixture of experts) are all the step trains: the base stays
  in `param_dtype` with no gradient or optimizer state, the adapters and their AdamW
  moments float32. `device_bytes`: a device's memory, for the scheduler's limit with
  remat "offload" (`offload_compiler_options`). `objective`: the step's loss (`Trainer`'s
  objective; None: the next token's cross-entropy), with `objective_rows(batch, seq_len,
  rows, whole)` the further inputs it takes, abstract (`rows`: the sharding of [B, T]
  arrays, `whole`: a replicated one), as `dpo.compiled_rows` gives DPO's."""
  # Training past the released context (as long-context fine-tuning does): the model
  # takes sequences up to seq_len, with its rotary settings as released.
  cfg = checkpoints.config(name)
  if layers is not None and (not isinstance(layers, int) or layers < 1):
    raise ValueError(f"layers={layers!r}: a positive number of blocks, or None for all")
  cfg = dataclasses.replace(
    cfg, context_length=max(cfg.context_length, seq_len), num_layers=layers or cfg.num_layers
  )
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  from .. import lora

  def make():
    model = checkpoints.build(
      cfg, mesh=auto, fsdp=True, remat=remat, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)
    )
    if lora_rank is not None:
      targets = ("q", "k", "v", "o") if hasattr(cfg, "num_experts") else lora.ALL  # experts: attention only
      alpha = lora_alpha if lora_alpha is not None else 2.0 * lora_rank
      lora.add_lora(model, rank=lora_rank, alpha=alpha, targets=targets)
    return model

  with jax.set_mesh(auto):
    model = nnx.eval_shape(make)
    if capacity_factor is not None:
      moe.set_capacity(model, capacity_factor)
    spec = lambda path, shape: NamedSharding(auto, _fsdp_or_whole(path, shape, auto))
    abstract = lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(path, x.shape))
    if lora_rank is None:
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    else:  # the adapters train; the frozen base is an argument like the rest
      graphdef, params, frozen, others = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
      rest = (jax.tree_util.tree_map_with_path(abstract, frozen), others)
    params = jax.tree_util.tree_map_with_path(abstract, params)
    # The scanned blocks' weights stacked, as `Trainer` keeps them.
    plan = model.scan_plan()
    params = decoder.stack_blocks(params, plan, stack=_stack_abstract)
    stack = lambda state: decoder.stack_blocks(state, plan, stack=_stack_abstract)
    rest = tuple(map(stack, rest)) if isinstance(rest, tuple) else stack(rest)
    tx = make_tx(1e-5, 100, 1000, 0.1, 1.0)
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    # The moments split as the weights they follow (as `Trainer`'s, made by zeros_like):
    # placed by their own shapes, a stack of experts [layers, 1, E, ...] split along its
    # layers, not its experts.
    opt_state = _placed_as(jax.eval_shape(tx.init, plain), params, auto)
    rows = NamedSharding(auto, P(None, "seq"))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows)
    weights = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=rows)
    extra = ()
    if objective_rows is not None:
      extra = (objective_rows(batch, seq_len, rows, NamedSharding(auto, P())),)
    loss_fn = cross_entropy if objective is None else objective
    step = jax.jit(functools.partial(_step, graphdef, tx, loss_fn, chunk, plan), donate_argnums=(0, 2))
    options = dict(TPU_COMPILER_OPTIONS) if auto.devices.flat[0].platform == "tpu" else {}
    if remat == "offload":
      host = offloaded_bytes(cfg, batch * seq_len // auto.shape["seq"], dtype)
      options |= offload_compiler_options(
        auto.devices.flat[0].platform, host_bytes=host, device_bytes=device_bytes
      )
    return compile_with(step.lower(params, rest, opt_state, tokens, tokens, weights, *extra), options)


def _placed_as(state, params, mesh):
  """`state` (abstract) with each leaf whose path ends in a weight's path placed as that
  weight (AdamW's moments), the rest (the step count) replicated."""
  where = {tuple(path): leaf.sharding for path, leaf in jax.tree_util.tree_leaves_with_path(params)}

  def place(path, leaf):
    path = tuple(path)
    found = next((where[path[i:]] for i in range(len(path)) if path[i:] in where), None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=found or NamedSharding(mesh, P()))

  return jax.tree_util.tree_map_with_path(place, state)


def _stack_abstract(rows):
  """`_stack_placed` for abstract weights (`jax.ShapeDtypeStruct`s)."""
  first = rows[0][0]
  shape = (len(rows), len(rows[0]), *first.shape)
  return jax.ShapeDtypeStruct(shape, first.dtype, sharding=_stacked_sharding(first))


def _fsdp_or_whole(path, shape, mesh):
  return fsdp_spec(shape, mesh, experts=is_experts(path_names(path), shape)) if len(shape) else P()


def step_memory(compiled, device_bytes: int) -> dict:
  """A compiled step's memory per device: its arguments (weights, optimizer state,
  batch), outputs, temporaries, the outputs that reuse donated arguments (alias), and
  the peak the device must hold at once (arguments + outputs - alias + temporaries);
  `fits`: the peak within `device_bytes`. `host_temp_bytes`: the temporaries the step
  keeps in host memory for the device (remat "offload": the layers' inputs)."""
  m = compiled.memory_analysis()
  out = dict(
    argument_bytes=int(m.argument_size_in_bytes),
    output_bytes=int(m.output_size_in_bytes),
    temp_bytes=int(m.temp_size_in_bytes),
    alias_bytes=int(m.alias_size_in_bytes),
  )
  out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  out["fits"] = out["peak_bytes"] <= device_bytes
  out["host_temp_bytes"] = int(getattr(m, "host_temp_size_in_bytes", 0) or 0)
  return out
