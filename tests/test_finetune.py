"""Training a loaded model's architecture over the ring: FSDP (every weight and AdamW
moment split over all the mesh's devices) equals the replicated model's steps on (8,)
and (2, 4) meshes; the chunked cross-entropy equals a float64 NumPy one and the full
loss; the remat policies keep what they name (counted in the compiled program); the
per-device bytes are the total / devices; scripts/finetune.py writes its report and a
checkpoint that loads, and resumes."""

import dataclasses
import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import forward_and_vjp, make_mesh, rel_err
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import hlo, models
from jax_ring import nn as ring_nn
from jax_ring.models.architectures import decoder
from jax_ring.models.train import finetune
from jax_ring.models.train import step as train_step

# Sizes every device count here divides (8): FSDP splits every weight.
SMALL = models.LlamaConfig(
  vocab_size=256,
  dim=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  mlp_hidden=128,
  context_length=512,
)
QWEN = models.Qwen3Config(
  vocab_size=256,
  dim=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  mlp_hidden=128,
  context_length=512,
)
STEP_TOL = 1e-5


def _batch(batch=2, length=64, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (batch, length)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  weights = (rng.random((batch, length)) < 0.7).astype(np.float32)
  return tokens, targets, weights


def _model(config, mesh, fsdp, batch_axis=None, remat="none"):
  return models.build(config, mesh=mesh, fsdp=fsdp, batch_axis=batch_axis, remat=remat, rngs=nnx.Rngs(3))


MESHES = [((8,), ("seq",), None), ((2, 4), ("data", "seq"), "data")]


@pytest.mark.parametrize("shape, names, batch_axis", MESHES)
def test_fsdp_steps_equal_the_replicated_model(shape, names, batch_axis):
  """Three AdamW steps (warmup, clipping) of the FSDP model and of the replicated one:
  the same losses, gradient norms and weights within 1e-5, and the weights and moments
  stay split."""
  _fsdp_equals_replicated(SMALL, shape, names, batch_axis)


# Phi-3's kind: half of each head rotates, LongRoPE, a window of 24 keys.
PHI3 = dict(
  rope_dim=8,
  sliding_window=24,
  rope_scaling=ring_nn.RopeScaling(
    "longrope", factors=(1.0, 1.2, 1.5, 2.0), long_factors=(1.0, 3.0, 6.0, 9.0),
    original_max_position_embeddings=16, attention_factor=1.2,
  ),
)  # fmt: skip


@pytest.mark.parametrize(
  "family, extra",
  [(models.Qwen2Config, {}), (models.Olmo2Config, {}), (models.Phi3Config, PHI3)],
  ids=["qwen2", "olmo2", "phi3"],
)
def test_fsdp_steps_of_other_blocks_equal_the_replicated_model(family, extra):
  """The same for Qwen 2.5's block (its query, key and value biases), OLMo 2's (norms
  after the sub-layers, q/k norms over all heads' width) and Phi-3's (partial rotary,
  LongRoPE, a window): every weight trains split over the 8 devices."""
  config = family(**{f.name: getattr(SMALL, f.name) for f in dataclasses.fields(SMALL)} | extra)
  _fsdp_equals_replicated(config, *MESHES[0])


def _fsdp_equals_replicated(config, shape, names, batch_axis):
  mesh = make_mesh(shape, names)
  tx = train_step.make_tx(3e-3, 1, 10, 0.01, 1.0)
  trainers = [
    train_step.Trainer(_model(config, mesh, fsdp, batch_axis), tx, chunk=16) for fsdp in (False, True)
  ]
  start = jax.tree.map(np.asarray, trainers[0].weights())
  for step in range(3):
    batch = train_step.place_batch(trainers[0].model(), *_batch(seed=step))
    (l0, s0), (l1, s1) = (t.step(*batch) for t in trainers)
    n0, n1 = s0["grad_norm"], s1["grad_norm"]
    assert abs(float(l0) - float(l1)) <= STEP_TOL * abs(float(l0))
    assert abs(float(n0) - float(n1)) <= STEP_TOL * abs(float(n0))
  p0, p1 = (t.weights() for t in trainers)
  assert rel_err(p0["embed"]["embedding"][...], start["embed"]["embedding"][...]) > 1e-3  # the steps moved it
  assert jax.tree.structure(p0) == jax.tree.structure(p1)
  first = dict(nnx.to_flat_state(start))
  for (path, a), (_, b) in zip(nnx.to_flat_state(p0), nnx.to_flat_state(p1)):
    if path[-2:] == ("key", "bias"):
      # A key bias shifts a query's scores by one constant, which softmax ignores: its
      # gradient is exactly 0, what a step computes is rounding, and AdamW scales that
      # to steps of up to the learning rate either way. Both stay within 3 of them.
      for w in (a, b):
        assert np.max(np.abs(np.asarray(w[...]) - first[path][...])) <= 3 * 3e-3 * 1.01, path
    else:
      assert rel_err(b[...], a[...]) < STEP_TOL, path
    assert b[...].addressable_shards[0].data.size * 8 == b[...].size, path  # split 8 ways
  moments = [x for x in jax.tree.leaves(trainers[1].opt_state) if x.ndim > 0]
  assert moments and all(x.addressable_shards[0].data.size * 8 == x.size for x in moments)


def test_fsdp_bytes_per_device_are_the_total_over_devices():
  """From the arrays' shardings and the compiler: each device holds 1/8 of the weights
  and of the AdamW moments (float32), and the compiled step's arguments are those
  bytes plus the batch."""
  mesh = make_mesh((8,), ("seq",))
  model = _model(QWEN, mesh, True)
  total = sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  trainer = train_step.Trainer(model, train_step.make_tx(1e-3, 1, 10, 0.0, 1.0), chunk=16)
  batch = train_step.place_batch(model, *_batch())
  memory = trainer.memory(*batch)
  assert memory["param_bytes"] == total // 8
  scalars = sum(x.nbytes for x in jax.tree.leaves(trainer.opt_state) if x.ndim == 0)  # step counts
  assert memory["optimizer_bytes"] == 2 * total // 8 + scalars  # mu and nu, float32
  arguments = trainer.compiled(*batch).memory_analysis().argument_size_in_bytes
  batch_bytes = sum(a.addressable_shards[0].data.nbytes for a in batch)
  assert arguments == memory["param_bytes"] + memory["optimizer_bytes"] + batch_bytes


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_every_step_changes_the_weights_the_first_included(warmup):
  """The schedule's first rate is not 0 (optax's warmup from 0 gave the first update a
  rate of 0, and a one-step run saved its base unchanged): each of 4 steps moves every
  weight, the last at a tenth of the peak."""
  model = _model(QWEN, None, False)
  trainer = train_step.Trainer(model, train_step.make_tx(1e-2, warmup, 4, 0.0, 1e9), chunk=16)
  batch = train_step.place_batch(model, *_batch())
  schedule = train_step.make_schedule(1e-2, warmup, 4)
  rates = [float(schedule(k)) for k in range(4)]
  assert rates[0] > 0 and rates[-1] == pytest.approx(1e-3) and max(rates) == pytest.approx(1e-2)
  before = [np.asarray(x) for x in jax.tree.leaves(trainer.params)]
  for _ in range(4):
    trainer.step(*batch)
    after = [np.asarray(x) for x in jax.tree.leaves(trainer.params)]
    assert all(np.any(a != b) for a, b in zip(after, before))
    before = after


def test_fsdp_step_gathers_weights_and_reduces_gradients():
  """The compiled FSDP step all-gathers the blocks' weights and reduces their gradients
  (on CPU XLA lowers that reduction as an all-reduce of the gradients, which is then
  sliced to the shards; the reduce-scatter a GPU runs is checked in the compile for 8 x
  H100, tests/test_aot.py), but never gathers the vocabulary table (its lookup and the
  loss are rings); the replicated model's step gathers no weight."""
  mesh = make_mesh((8,), ("seq",))
  batch = _batch()

  def ops(fsdp):
    model = _model(SMALL, mesh, fsdp)
    trainer = train_step.Trainer(model, train_step.make_tx(1e-3, 1, 10, 0.0, 1.0), chunk=16)
    return hlo.collectives(trainer.compiled(*train_step.place_batch(model, *batch)))

  sharded, replicated = ops(True), ops(False)
  kinds = [c.op for c in sharded]
  # Each of the 2 layers' 9 weights is gathered (XLA may combine some).
  assert kinds.count("all-gather") >= 8
  # Gradients, not only the loss's scalar sums: a reduction at least one MLP weight's size.
  reductions = [c.bytes for c in sharded if c.op in ("all-reduce", "reduce-scatter")]
  assert max(reductions) >= SMALL.dim * SMALL.mlp_hidden * 4, reductions
  table = SMALL.vocab_size * SMALL.dim * 4
  assert max(c.bytes for c in sharded if c.op == "all-gather") < table
  # (The lookup's backward gathers every device's gradient rows, [B, T, D]: no weight.)
  weights = [c for c in replicated if c.op == "all-gather" and "embedding_rows" not in c.source]
  assert not [c for c in weights if c.bytes >= SMALL.dim * SMALL.mlp_hidden * 4], weights


def test_fsdp_generates_the_replicated_tokens_without_gathering_weights():
  """Generation from the FSDP model: the replicated model's tokens, and a decode step
  that moves activations to the weights' shards, never a weight (gathering every
  weight per token would move the whole model for each one)."""
  mesh = make_mesh((8,), ("seq",))
  prompt = _batch(batch=1, length=24)[0]
  replicated, split = (_model(SMALL, mesh, fsdp) for fsdp in (False, True))
  expected = models.generate(replicated, prompt, max_new_tokens=5).tokens
  np.testing.assert_array_equal(models.generate(split, prompt, max_new_tokens=5).tokens, expected)

  split.init_cache(1, 32)
  graphdef, state = nnx.split(split)
  step = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).decode(tokens))
  found = hlo.collectives(step.lower(state, jnp.zeros((1, 1), jnp.int32)).compile())
  smallest_weight = SMALL.dim * SMALL.head_dim * SMALL.num_kv_heads * 4 // 8 * 8  # a k projection
  assert found and not [c for c in found if c.op == "all-gather" and c.bytes >= smallest_weight]


def test_fsdp_prefill_gathers_one_layer_at_a_time():
  """The FSDP prefill gathers each layer's weights when that layer runs: its compiled
  temporaries exceed the replicated model's by less than two layers' weights (left to
  itself the compiler gathered all six layers' at the start and held them: 8x the
  replicated temporaries for Gemma 3 270M at 4K tokens)."""
  config = dataclasses.replace(SMALL, num_layers=6, mlp_hidden=512)
  mesh = make_mesh((8,), ("seq",))
  temp = {}
  for fsdp in (False, True):
    model = _model(config, mesh, fsdp)
    model.init_cache(1, 256)
    graphdef, weights, cache = nnx.split(model, nnx.Param, nnx.Cache)
    prefill = jax.jit(lambda w, c, t, g=graphdef: nnx.merge(g, w, c).prefill(t))
    compiled = prefill.lower(weights, cache, jnp.zeros((1, 256), jnp.int32)).compile()
    temp[fsdp] = compiled.memory_analysis().temp_size_in_bytes
  layer = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model.blocks[0], nnx.Param)))
  assert temp[True] - temp[False] < 2 * layer, (temp, layer)


@pytest.mark.parametrize("fsdp", [False, True])
def test_vocabulary_rings_equal_the_gathered_table(fsdp):
  """The model's training loss with the table split along the vocabulary (the lookup
  and the loss as rings over 8 devices; with FSDP over both axes of a (2, 4) mesh)
  equals optax's full-logits loss of the one-device model with the same weights, value
  and gradients."""
  shape, names, batch_axis = MESHES[1] if fsdp else MESHES[0]
  ring = _model(QWEN, make_mesh(shape, names), fsdp, None)
  dense = models.build(QWEN, attention="dense", rngs=nnx.Rngs(3))
  tokens, targets, weights = _batch()
  assert ring.vocab_axes() == (names if fsdp else ("seq",))

  def full(model):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets)
    return jnp.sum(ce * weights) / jnp.sum(weights)

  batch = train_step.place_batch(ring, tokens, targets, weights)
  value, grads = nnx.jit(nnx.value_and_grad(lambda m: train_step.loss(m, *batch, chunk=16)))(ring)
  expected, expected_grads = nnx.jit(nnx.value_and_grad(full))(dense)
  assert abs(float(value) - float(expected)) < 1e-6 * float(expected)
  for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected_grads)):
    assert rel_err(a[...], b[...]) < 1e-5, path


@pytest.mark.parametrize("moving", ["table", "rows"])
@pytest.mark.parametrize(
  "shape, names, table_axes, token_spec",
  [
    ((8,), ("seq",), ("seq",), (None, "seq")),
    ((2, 4), ("data", "seq"), ("data", "seq"), ("data", "seq")),
    ((2, 4), ("data", "seq"), ("data", "seq"), (None, "seq")),  # the tokens on 2 devices each
  ],
)
def test_embedding_ring_moving_the_table_or_the_rows(moving, shape, names, table_axes, token_spec):
  """The embedding lookup over a table split along the vocabulary, with the shards or
  the tokens' rows traveling the ring: the rows equal NumPy's take from the whole
  table, and the table's gradient NumPy's scatter-add of the cotangent (float64)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring.models.architectures import vocabulary as vocab

  mesh = make_mesh(shape, names)
  rng = np.random.default_rng(7)
  table = rng.standard_normal((64, 8)).astype(np.float32)
  tokens = rng.integers(0, 64, (2, 16)).astype(np.int32)
  cot = rng.standard_normal((2, 16, 8)).astype(np.float32)
  token_axes = tuple(a for a in token_spec if a is not None)
  lookup = jax.shard_map(
    lambda w, t: vocab.embed(w, t, table_axes, token_axes, moving=moving),
    mesh=mesh,
    in_specs=(P(table_axes, None), P(*token_spec)),
    out_specs=P(*token_spec, None),
  )
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  placed = put(tokens, *token_spec)
  # One jitted program (op-by-op dispatch of the ring's forward and backward cost more).
  rows, (grad,) = forward_and_vjp(lambda w: lookup(w, placed))(
    (put(table, table_axes, None),), put(cot, *token_spec, None)
  )
  expected_grad = np.zeros((64, 8))
  np.add.at(expected_grad, tokens.reshape(-1), cot.reshape(-1, 8).astype(np.float64))
  np.testing.assert_array_equal(np.asarray(rows), table[tokens])
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="moving='both'"):
    vocab.embed(table, tokens, table_axes, token_axes, moving="both")


@pytest.mark.parametrize("moving", ["table", "rows"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(
  "shape, names, table_axes, token_spec",
  [((8,), ("seq",), ("seq",), (None, "seq")), ((2, 4), ("data", "seq"), ("data", "seq"), (None, "seq"))],
)
def test_loss_ring_moving_the_table_or_the_rows(moving, transposed, shape, names, table_axes, token_spec):
  """The head's cross-entropy over a table split along the vocabulary, with the shards
  (and their gradients) or the tokens' hidden states (and theirs) traveling the ring:
  per-token values, dh and the table's gradient against float64 NumPy."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring.models.architectures import vocabulary as vocab

  mesh = make_mesh(shape, names)
  rng = np.random.default_rng(8)
  table = rng.standard_normal((64, 8)).astype(np.float32)
  h = rng.standard_normal((2, 16, 8)).astype(np.float32)
  targets = rng.integers(0, 64, (2, 16)).astype(np.int32)
  cot = rng.standard_normal((2, 16)).astype(np.float32)
  token_axes = tuple(a for a in token_spec if a is not None)
  table_spec = P(None, table_axes) if transposed else P(table_axes, None)
  loss = jax.shard_map(
    lambda h, w, t: vocab.cross_entropy(h, w, t, table_axes, 1, token_axes, transposed, moving=moving),
    mesh=mesh,
    in_specs=(P(*token_spec, None), table_spec, P(*token_spec)),
    out_specs=P(*token_spec),
  )
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  stored = table.T if transposed else table
  args = (put(h, P(*token_spec, None)), put(stored, table_spec))
  placed = put(targets, P(*token_spec))
  # One jitted program (op-by-op dispatch of the ring's forward and backward cost more).
  ce, (dh, dtable) = forward_and_vjp(lambda h, w: loss(h, w, placed))(args, put(cot, P(*token_spec)))
  logits = h.astype(np.float64) @ table.astype(np.float64).T
  top = logits.max(-1, keepdims=True)
  p = np.exp(logits - top)
  p /= p.sum(-1, keepdims=True)
  expected = (
    np.log(np.exp(logits - top).sum(-1))
    + top[..., 0]
    - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  )
  dlogits = cot[..., None] * (p - np.eye(64)[targets])
  np.testing.assert_allclose(np.asarray(ce), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dh), dlogits @ table, rtol=1e-5, atol=1e-5)
  expected_table = np.einsum("btv,btd->vd", dlogits, h)
  np.testing.assert_allclose(
    np.asarray(dtable), expected_table.T if transposed else expected_table, rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("moving", ["table", "rows"])
@pytest.mark.parametrize("transposed", [False, True])
def test_loss_ring_adds_the_table_gradient_in_row_blocks(monkeypatch, moving, transposed):
  """The shard's gradient taking each chunk's share in blocks of rows (4 of a device's
  8 rows at a time, in place): the same values and gradients as above, against float64."""
  from jax_ring.models.architectures import vocabulary as vocab

  monkeypatch.setattr(vocab, "ROW_BLOCK", 4)
  monkeypatch.setattr(vocab, "MIN_ROW_BLOCK", 1)
  assert vocab._row_block(8) == 4
  jax.clear_caches()  # read when traced
  test_loss_ring_moving_the_table_or_the_rows(moving, transposed, (8,), ("seq",), ("seq",), (None, "seq"))


def test_loss_ring_holds_one_table_gradient():
  """Compiled on 8 devices with a 65,536 x 256 table (a device's shard: 8 MiB) and the
  hidden states traveling (`moving="rows"`, as a device with fewer tokens than a shard
  has rows runs it): the backward's temporaries hold the shard's gradient and a block
  of it, not a second array of the shard's size for each chunk's share."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring.models.architectures import vocabulary as vocab

  jax.clear_caches()
  mesh = make_mesh((8,), ("seq",))
  loss = jax.shard_map(
    lambda h, w, t: vocab.cross_entropy(h, w, t, ("seq",), 64, ("seq",), moving="rows").sum(),
    mesh=mesh,
    in_specs=(P(None, "seq", None), P("seq", None), P(None, "seq")),
    out_specs=P(),
    check_vma=False,
  )
  h = jax.ShapeDtypeStruct((1, 1024, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "seq", None)))
  table = jax.ShapeDtypeStruct((65536, 256), jnp.float32, sharding=NamedSharding(mesh, P("seq", None)))
  t = jax.ShapeDtypeStruct((1, 1024), jnp.int32, sharding=NamedSharding(mesh, P(None, "seq")))
  compiled = jax.jit(jax.grad(loss, (0, 1))).lower(h, table, t).compile()
  shard = 65536 // 8 * 256 * 4
  # The gradient is the output here: whole shares took 1.56 shards of temporaries, in
  # blocks 0.94 (logits and the like).
  assert compiled.memory_analysis().temp_size_in_bytes < 1.25 * shard


def test_clip_by_global_norm_equals_optax():
  """The step's clipping (one multiplication by min(1, max / norm)) against optax's
  `clip_by_global_norm`, above and below the threshold."""
  rng = np.random.default_rng(3)
  grads = {
    "a": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
    "b": jnp.asarray(rng.standard_normal(5)),
  }
  norm = float(optax.tree.norm(grads))
  for max_norm in (0.25 * norm, 4.0 * norm):
    ours = train_step.clip_by_global_norm(max_norm)
    theirs = optax.clip_by_global_norm(max_norm)
    got, _ = ours.update(grads, ours.init(grads))
    expected, _ = theirs.update(grads, theirs.init(grads))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    assert abs(float(optax.tree.norm(got)) - min(norm, max_norm)) < 1e-5 * norm


def test_free_host_memory_goes_back_after_a_compile():
  """glibc's malloc_trim is reached (Linux CI): the trainer calls it after each compile."""
  from jax_ring.models import runtime

  assert runtime.release_free_memory()


def test_training_loss_in_the_ring_order_equals_natural_order():
  """At 512 tokens a device (the balanced causal layout) the loss runs every layer in
  the ring's token order (tokens, targets and weights permuted once; no relayout per
  layer): value and gradients equal the one-device model's full-logits loss."""
  mesh = make_mesh((2,), ("seq",))
  config = dataclasses.replace(QWEN, context_length=1024)
  ring = _model(config, mesh, True)
  dense = models.build(config, attention="dense", rngs=nnx.Rngs(3))
  tokens, targets, weights = _batch(batch=1, length=1024)
  assert ring.ring_permutation(1024) is not None and ring.ring_permutation(64) is None

  def full(model):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets)
    return jnp.sum(ce * weights) / jnp.sum(weights)

  value, grads = nnx.jit(
    nnx.value_and_grad(lambda m: train_step.loss(m, tokens, targets, weights, chunk=128))
  )(ring)
  expected, expected_grads = nnx.jit(nnx.value_and_grad(full))(dense)
  assert abs(float(value) - float(expected)) < 1e-6 * float(expected)
  for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected_grads)):
    assert rel_err(a[...], b[...]) < 1e-5, path


def _numpy_ce(h, table, targets, weights):
  logits = np.asarray(h, np.float64) @ np.asarray(table, np.float64).T
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return float(((lse - picked) * weights).sum() / max(weights.sum(), 1))


@pytest.mark.parametrize("chunk", [3, 4, 7, 64])
def test_chunked_cross_entropy_equals_float64_and_the_full_loss(chunk):
  """On 8 devices, chunks that divide a device's 8 tokens (4: two chunks), that do not
  (3 and 7: the last chunk padded) and one larger than them (64: one chunk): the value
  against a float64 NumPy cross-entropy, and the gradients against optax's full-logits
  loss."""
  mesh = make_mesh((8,), ("seq",))
  rng = np.random.default_rng(1)
  h = rng.standard_normal((2, 64, 32)).astype(np.float32)
  table = rng.standard_normal((300, 32)).astype(np.float32) * 0.3
  _, targets, weights = _batch()
  targets = targets % 300
  chunked = lambda h, t: train_step.chunked_cross_entropy(
    h, t, targets, weights, chunk=chunk, mesh=mesh, seq_axis="seq"
  )
  value = float(jax.jit(chunked)(h, table))
  assert abs(value - _numpy_ce(h, table, targets, weights)) < 1e-6 * abs(value)
  # predictions=True: the same value, and every position's argmax from the same chunks.
  both = jax.jit(
    lambda h, t: train_step.chunked_cross_entropy(
      h, t, targets, weights, chunk=chunk, mesh=mesh, seq_axis="seq", predictions=True
    )
  )(h, table)
  assert float(both[0]) == value
  logits64 = h.astype(np.float64) @ table.astype(np.float64).T
  np.testing.assert_array_equal(np.asarray(both[1]), logits64.argmax(-1))

  def full(h, t):
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ t.T, targets)
    return jnp.sum(ce * weights) / jnp.sum(weights)

  for a, b in zip(jax.jit(jax.grad(chunked, (0, 1)))(h, table), jax.jit(jax.grad(full, (0, 1)))(h, table)):
    assert rel_err(a, b) < 1e-5


def test_chunked_cross_entropy_holds_no_full_logits():
  """Compiled on 8 devices at 4,096 tokens and a 32,768 vocabulary: the full loss's
  temporaries hold [T / 8, V] float32 logits (64 MiB a device); the chunked one's, with
  chunks of 32 tokens (4 MiB of logits), less than half that, backward included (the
  table's gradient, 8 MiB, among them)."""
  mesh = make_mesh((8,), ("seq",))
  h = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32)
  table = jax.ShapeDtypeStruct((32768, 64), jnp.float32)
  t = jnp.zeros((1, 4096), jnp.int32)
  w = jnp.ones((1, 4096), jnp.float32)
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(auto, jax.sharding.PartitionSpec(None, "seq"))
  t, w = jax.device_put(t, rows), jax.device_put(w, rows)
  chunked = lambda h, table: train_step.chunked_cross_entropy(
    h, table, t, w, chunk=32, mesh=mesh, seq_axis="seq"
  )

  def full(h, table):
    h = jax.lax.with_sharding_constraint(
      h, jax.sharding.NamedSharding(auto, jax.sharding.PartitionSpec(None, "seq"))
    )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ table.T, t))

  temp = lambda f: jax.jit(jax.grad(f, (0, 1))).lower(h, table).compile().memory_analysis().temp_size_in_bytes
  logits = 4096 // 8 * 32768 * 4
  assert temp(full) >= logits
  assert temp(chunked) < logits / 2


@pytest.mark.slow
def test_feed_forward_in_chunks_equals_it_whole(monkeypatch):
  """A block's feed-forward run over each device's tokens in chunks (`FF_TOKENS` 4: 4
  chunks of 4 tokens a device) gives the AdamW step the whole one gives (FSDP, remat
  "full", the (2, 4) mesh with a batch axis) and Gemma's block the same logits over 8
  devices; a forward holds fewer temporaries in chunks where the MLP is the largest
  activation."""

  def chunks(most):
    monkeypatch.setattr(decoder, "FF_TOKENS", most)
    jax.clear_caches()  # read when traced

  def step(mesh, batch_axis):
    model = _model(SMALL, mesh, True, batch_axis, remat="full")
    trainer = train_step.Trainer(model, train_step.make_tx(3e-3, 1, 10, 0.01, 1.0), chunk=16)
    batch = train_step.place_batch(model, *_batch())
    loops = trainer.compiled(*batch).as_text().count(" while(")
    loss, stats = trainer.step(*batch)
    return (float(loss), float(stats["grad_norm"]), jax.tree.map(np.asarray, trainer.weights())), loops

  for shape, names, batch_axis in MESHES[1:]:
    mesh = make_mesh(shape, names)
    chunks(16384)
    whole, loops = step(mesh, batch_axis)
    chunks(4)
    chunked, more_loops = step(mesh, batch_axis)
    assert more_loops > loops  # the chunks' loops, forward and backward
    assert abs(chunked[0] - whole[0]) <= 1e-6 * abs(whole[0])
    assert abs(chunked[1] - whole[1]) <= 1e-6 * abs(whole[1])
    assert jax.tree.structure(whole[2]) == jax.tree.structure(chunked[2])
    for a, b in zip(jax.tree.leaves(whole[2]), jax.tree.leaves(chunked[2]), strict=True):
      assert rel_err(b, a) < 1e-6
  mesh = make_mesh((8,), ("seq",))
  gemma = models.GemmaConfig(
    vocab_size=256, dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_hidden=128,
    window=16, global_every=2, context_length=512,
  )  # fmt: skip
  model = _model(gemma, mesh, True)
  tokens = jnp.asarray(_batch(length=64)[0])
  chunks(16384)
  whole = np.asarray(jax.jit(lambda t: model(t))(tokens))
  chunks(4)
  assert rel_err(np.asarray(jax.jit(lambda t: model(t))(tokens)), whole) < 1e-6
  # 256 tokens a device through a [., 1024] MLP, one layer's forward: 4 chunks hold less.
  wide = _model(dataclasses.replace(SMALL, mlp_hidden=1024, context_length=2048, num_layers=1), mesh, True)
  tokens = jnp.zeros((1, 2048), jnp.int32)
  temp = lambda: jax.jit(lambda t: wide(t)).lower(tokens).compile().memory_analysis().temp_size_in_bytes
  chunks(16384)
  whole_temp = temp()
  chunks(64)
  chunked_temp = temp()
  assert chunked_temp < 0.85 * whole_temp, (chunked_temp, whole_temp)


def test_offload_remat_equals_full_and_keeps_the_layer_inputs_in_host_memory():
  """remat="offload": the same loss and gradients as "full" (FSDP over 4 devices; to
  float32's rounding), and the backward pass's stack of layer inputs is a host-memory
  array in the program."""
  mesh = make_mesh((4,), ("seq",))
  tokens, targets, weights = (jnp.asarray(a) for a in _batch())
  results = {}
  for remat in ("full", "offload"):
    model = _model(SMALL, mesh, True, None, remat=remat)
    graphdef, state = nnx.split(model)
    loss = lambda s, g=graphdef: train_step.loss(nnx.merge(g, s), tokens, targets, weights, chunk=16)
    results[remat] = jax.jit(jax.value_and_grad(loss))(state)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state))
    # [layers, batch, ...]: every layer's input, kept on the host for the backward pass
    stacks = re.findall(rf"f32<host>\[{SMALL.num_layers},{tokens.shape[0]},\d+", jaxpr)
    assert bool(stacks) == (remat == "offload"), stacks
  (v0, g0), (v1, g1) = results["full"], results["offload"]
  assert float(v0) == float(v1)
  # "offload" takes each layer's gradient against its gathered weights, then back through
  # the gather (`decoder._prefetched_offload_scan`): the same sums in another order.
  for (path, a), (_, b) in zip(nnx.to_flat_state(g0), nnx.to_flat_state(g1)):
    assert rel_err(b[...], a[...]) < 2e-6, path


def test_offload_keeps_the_input_of_a_block_outside_the_scan_in_host_memory():
  """A block that runs on its own (one layer: no scan; so do the layers past a scan's
  last whole period) keeps its input on the host under "offload" too."""
  mesh = make_mesh((2,), ("seq",))
  tokens, targets, weights = (jnp.asarray(a) for a in _batch())
  one = dataclasses.replace(SMALL, num_layers=1)
  for remat in ("full", "offload"):
    model = _model(one, mesh, True, None, remat=remat)
    graphdef, state = nnx.split(model)
    loss = lambda s, g=graphdef: train_step.loss(nnx.merge(g, s), tokens, targets, weights, chunk=16)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state))
    assert ("f32<host>" in jaxpr) == (remat == "offload"), remat


def test_remat_policies_keep_what_they_name():
  """The two policies' compiled steps give the same loss, gradient norm and updated
  weights; under "full" the backward pass runs the ring's forward again (a forward ring
  loop in the rematerialized computation), under "attention" it does not (the ring's
  output and log-sum-exp are kept)."""
  mesh = make_mesh((4,), ("seq",))
  batch = train_step.place_batch(_model(SMALL, mesh, False), *_batch())

  def run(policy):
    trainer = train_step.Trainer(
      _model(SMALL, mesh, False, remat=policy), train_step.make_tx(1e-3, 1, 10, 0.0, 1.0)
    )
    compiled = trainer.compiled(*batch)
    forward = [c.source for c in hlo.collectives(compiled) if c.where == "forward ring step"]
    params, _, loss, norm = compiled(trainer.params, trainer.rest, trainer.opt_state, *batch)
    return (params, loss, norm), len(forward), sum("rematted_computation" in s for s in forward)

  (full, loops_full, again_full), (att, loops_att, again_att) = run("full"), run("attention")
  assert loops_full > 0 and again_full > 0
  assert loops_att > 0 and again_att == 0
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(att)):
    assert rel_err(b, a) < 1e-6
  with pytest.raises(ValueError, match="remat='some'"):
    _model(SMALL, mesh, False, remat="some")


def test_finetune_script_reports_checkpoints_and_resumes(tmp_path):
  """scripts/finetune.py on a small Llama folder and a text: report.json's steps and
  memory, a checkpoint folder `models.load` reads, the loss falling on a repeated text,
  and a second run with more steps resuming from the saved state."""
  import finetune as script  # scripts/finetune.py
  import tokenizers  # installed by the test command (the [models] extra)

  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  model = models.build(SMALL, attention="dense")
  models.save(model, tmp_path / "model", tokenizer=HFTokenizer(tok, bos_id=1, eos_id=2, pad_id=0))
  text = tmp_path / "text.txt"
  text.write_text(" ".join(f"w{(i * 7) % 50 + 3}" for i in range(600)))
  out = tmp_path / "run"
  common = [
    str(tmp_path / "model"),
    "--text",
    str(text),
    "--length",
    "64",
    "--devices",
    "4",
    "--out",
    str(out),
  ]
  script.main(common + ["--steps", "6", "--lr", "3e-3", "--fsdp"])
  report = json.loads((out / "report.json").read_text())
  losses = [s["loss"] for s in report["steps"]]
  assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
  assert set(report["memory"]) == {"param_bytes", "optimizer_bytes", "temp_bytes"}
  assert report["memory"]["optimizer_bytes"] > 2 * report["memory"]["param_bytes"]
  tuned, _ = models.load(out / "checkpoint", attention="dense")
  assert rel_err(tuned.embed.embedding[...], model.embed.embedding[...]) > 1e-4  # trained
  # The first resumed step's loss is the saved weights' loss on step 6's batch (its
  # update comes after): a run that did not restore would start from the base model.
  batch = finetune.text_batch(
    np.asarray(HFTokenizer.from_folder(tmp_path / "model").encode(text.read_text()), np.int32), 64, 6
  )
  evaluate = lambda m: float(train_step.loss(m, *(jnp.asarray(a) for a in batch), chunk=64))
  expected, untrained = evaluate(tuned), evaluate(model)
  script.main(common + ["--steps", "8", "--lr", "3e-3", "--fsdp"])
  again = json.loads((out / "report.json").read_text())["steps"]
  assert len(again) == 8 and [s["loss"] for s in again[:6]] == losses
  assert abs(again[6]["loss"] - expected) < 1e-5 * expected and abs(untrained - expected) > 1e-3 * expected
  # Another model of the same shapes, into the same folder: refused in one line, naming both.
  other = models.build(SMALL, attention="dense", rngs=nnx.Rngs(9))
  models.save(other, tmp_path / "other", tokenizer=HFTokenizer(tok, bos_id=1, eos_id=2, pad_id=0))
  with pytest.raises(SystemExit, match=r"was fine-tuned from .*model, whose weights differ from .*other"):
    script.main([str(tmp_path / "other"), *common[1:], "--steps", "9"])
  # Other shapes: refused the same way, before orbax sees them.
  wide = models.build(dataclasses.replace(SMALL, mlp_hidden=96), attention="dense")
  models.save(wide, tmp_path / "wide", tokenizer=HFTokenizer(tok, bos_id=1, eos_id=2, pad_id=0))
  with pytest.raises(SystemExit, match="whose config and weights differ") as refused:
    script.main([str(tmp_path / "wide"), *common[1:], "--steps", "9"])
  assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
  "options, says",
  [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--devices", "0"], "--devices 0: must be at least 1"),
    (["--length", "100000"], "length=100000 exceeds the model's context length 512"),
    (["--length", "300", "--text", None], "the text has 200 tokens; length=300"),
    (["--text", "missing.txt"], "--text missing.txt: no such file"),
    (["--data", "missing.jsonl"], "--data missing.jsonl: no such file or folder"),
    (["--lora-rank", "4", "--lora-targets", "q,qkv"], "--lora-targets: targets=('q', 'qkv')"),
    (["--lora-rank", "0"], "--lora-rank: rank=0 must be a positive int"),
    (["--lora-rank", "4", "--lora-alpha", "-1"], "--lora-alpha: alpha=-1.0 must be a positive number"),
  ],
)
def test_finetune_script_refuses_bad_settings_before_writing(tmp_path, options, says):
  """A clear error naming the setting and nothing written (no state/, no report)."""
  import finetune as script
  import tokenizers

  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  models.save(
    models.build(SMALL, attention="dense"), tmp_path / "m", tokenizer=HFTokenizer(tok, bos_id=1, eos_id=2)
  )
  text = tmp_path / "t.txt"
  text.write_text(" ".join(f"w{i % 50}" for i in range(200)))
  options = [str(text) if o is None else o for o in options]
  with pytest.raises(SystemExit, match=re.escape(says)):
    script.main([str(tmp_path / "m"), "--devices", "2", "--out", str(tmp_path / "run"), *options])
  assert not (tmp_path / "run").exists()


def test_finetune_script_refuses_a_model_path_that_is_not_there(tmp_path):
  """In one line, before JAX starts a device or anything is read."""
  import finetune as script

  with pytest.raises(SystemExit, match="nowhere: no such file or folder") as refused:
    script.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")])
  assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


def test_fsdp_on_a_device_count_that_splits_nothing_says_so(capsys):
  """--devices 3 leaves weights whole under FSDP (no width divides by 3): the script
  says how much, per device, and what to pass instead."""
  mesh = make_mesh((3,), ("seq",))
  model = _model(SMALL, mesh, True)
  whole = train_step.unsplit_bytes(model)
  layer = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.blocks[0], nnx.Param)))
  assert whole >= layer  # every block's weights
  assert train_step.unsplit_bytes(_model(SMALL, make_mesh((4,), ("seq",)), True)) == 0


def test_document_batch_scores_exactly_the_answer():
  """`scripts/finetune.py`'s default data: each row a document, its question and the
  answer; the loss weights mark exactly the positions whose next token is the answer's
  (position i predicts token i + 1), and those targets are the answer's tokens, which
  are one of the document's facts."""
  from test_checkpoints import LLAMA3_PATTERN, train_bpe

  tok = models.HFTokenizer(train_bpe(LLAMA3_PATTERN, False), bos_id=0, eos_id=1, add_bos=True)
  for step in range(3):
    ids, targets, weights = finetune.document_batch(tok, 400, step, batch=2)
    assert ids.shape == targets.shape == weights.shape == (2, 400)
    np.testing.assert_array_equal(targets[:, :-1], ids[:, 1:])
    for row in range(2):
      scored = np.flatnonzero(weights[row])
      assert scored.size and np.all(np.diff(scored) == 1)  # one run: the answer
      answer = tok.decode(targets[row, scored])
      assert answer.startswith(" ") and answer.endswith(".") and len(answer) > 2, answer
      # The answer ends the row's text: the next token (if any) is padding.
      end = scored[-1] + 2
      assert end == 400 or np.all(ids[row, end:] == 0)
      assert answer[1:-1] in tok.decode(ids[row, : scored[0] + 1])  # a fact the document holds


# Gemma 3's blocks with a period of 4 (three windowed, one global), two periods.
PERIODIC = models.GemmaConfig(
  vocab_size=256,
  dim=64,
  num_layers=8,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  mlp_hidden=128,
  window=8,
  global_every=4,
  context_length=512,
)


@pytest.mark.slow  # 45 s: the scanned and the unrolled model's gradients, compiled
def test_blocks_that_repeat_with_a_period_train_as_a_scan():
  """Gemma 3's blocks repeat with a period (windowed ones, then a global one): with FSDP
  and remat its training call runs them as a scan over whole periods, and a period's
  alike windowed blocks as a scan of their own inside it (the backward then holds one
  layer's gathered weights and gradients at a time), and its loss and gradients equal
  the unrolled model's (no FSDP, no remat) on 4 devices."""
  config = PERIODIC
  mesh = make_mesh((4,), ("seq",))
  scanned = models.build(config, mesh=mesh, fsdp=True, remat="attention", rngs=nnx.Rngs(3))
  unrolled = models.build(config, mesh=mesh, rngs=nnx.Rngs(3))
  graphdefs = [nnx.split(b, nnx.Param, ...)[0] for b in scanned.blocks]
  assert decoder._period(graphdefs) == 4
  batch = train_step.place_batch(scanned, *_batch(batch=1, length=64))
  jaxpr = str(jax.make_jaxpr(lambda m: train_step.loss(m, *batch, chunk=16))(scanned))
  assert "length=2" in jaxpr  # the scan over the two periods
  # ... and each period's three windowed blocks as a scan over their weights stacked
  # [periods, 3, ...] (an MLP kernel: [2, 3, 64, 128]).
  assert "f32[2,3,64,128]" in jaxpr
  # jitted: eager dispatch of eight layers' ring costs several times their compile.
  value_and_grad = nnx.jit(nnx.value_and_grad(lambda m: train_step.loss(m, *batch, chunk=16)))
  value, grads = value_and_grad(scanned)
  expected, expected_grads = value_and_grad(unrolled)
  assert abs(float(value) - float(expected)) < 1e-6 * abs(float(expected))
  for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected_grads)):
    assert rel_err(a[...], b[...]) < 1e-5, path


def test_trainer_keeps_the_scanned_blocks_stacked_and_steps_as_the_per_block_layout():
  """The trainer keeps the scanned blocks' weights stacked ([periods, run, ...] under
  "scanned_blocks"), and the moments with them. Its step gives the loss, gradient norm
  and new weights of the step given one array per block (which stacks them in the
  call), on 4 devices with FSDP, and the compiled step's temporaries are smaller (the
  copy the call no longer makes, and XLA's memory-minimizing schedule on CPUs)."""
  config = PERIODIC
  mesh = make_mesh((4,), ("seq",))
  tx = train_step.make_tx(3e-3, 1, 10, 0.01, 1.0)
  model = models.build(config, mesh=mesh, fsdp=True, remat="attention", rngs=nnx.Rngs(3))
  batch = train_step.place_batch(model, *_batch(batch=1, length=64))
  assert model.scan_plan() == [[[0, 1, 2], [4, 5, 6]], [[3], [7]]]
  # The per-block layout: the step with no plan on the model's own state.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = jax.tree.map(jnp.copy, (params, rest))
  opt = jax.tree.map(train_step._on_mesh(model), tx.init(params))
  per_block = jax.jit(functools.partial(train_step._step, graphdef, tx, train_step.cross_entropy, 16, None))
  per_block = per_block.lower(params, rest, opt, *batch).compile()
  trainer = train_step.Trainer(model, tx, chunk=16)
  kernel = trainer.params["scanned_blocks"][0]["mlp"]["up"]["kernel"][...]
  assert kernel.shape == (2, 3, 64, 128) and "blocks" not in trainer.params  # all 8 blocks scanned
  assert kernel.addressable_shards[0].data.size * 4 == kernel.size  # still split 4 ways
  stacked_bytes = sum(
    train_step.per_device_bytes(trainer.params["scanned_blocks"][r]) for r in trainer.params["scanned_blocks"]
  )
  before = per_block.memory_analysis().temp_size_in_bytes
  after = trainer.compiled(*batch).memory_analysis().temp_size_in_bytes
  # How much of the stacked copy the per-block step's peak holds depends on XLA's
  # schedule: here a third of the weights' bytes (Gemma 3 270M on 8 devices: all 48 MiB).
  assert after <= before - stacked_bytes / 4, (before, after, stacked_bytes)
  # On CPUs the trainer compiles with XLA's memory-minimizing schedule
  # (`CPU_COMPILER_OPTIONS`): the same program in the default order holds more.
  default = trainer._step.lower(trainer.params, trainer.rest, trainer.opt_state, *batch).compile()
  default = default.memory_analysis().temp_size_in_bytes
  assert after < 0.95 * default, (after, default)
  new_params, _, loss, stats = per_block(params, rest, opt, *batch)
  value, got = trainer.step(*batch)
  assert abs(float(value) - float(loss)) < 1e-6 * abs(float(loss))
  assert abs(float(got["grad_norm"]) - float(stats["grad_norm"])) < 1e-5 * float(stats["grad_norm"])
  for (path, a), (_, b) in zip(nnx.to_flat_state(trainer.weights()), nnx.to_flat_state(new_params)):
    assert rel_err(a[...], b[...]) < 1e-5, path


def test_offload_options_raise_the_gpu_schedulers_limit_by_the_host_bytes():
  """The device plus 8 x the layer inputs in host memory, as a factor of the device,
  and 8 collectives in flight at once; nothing off GPUs or without host bytes.
  Llama-3.1-8B at 4M tokens on 8 x H100: 128 GiB of layer inputs a device (32 layers x
  524,288 tokens x 4,096 x 2 bytes)."""
  config = models.config("llama-3.1-8b")
  host = train_step.offloaded_bytes(config, 4194304 // 8, "bfloat16")
  assert host == 128 * 2**30
  h100 = 84929347584
  options = train_step.offload_compiler_options("cuda", host_bytes=host, device_bytes=h100)
  assert options == {
    "xla_gpu_memory_limit_slop_factor": 1395,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
  }
  assert train_step.offload_compiler_options("cpu", host_bytes=host, device_bytes=h100) == {}
  assert train_step.offload_compiler_options("gpu", host_bytes=0, device_bytes=h100) == {}


def test_compiled_steps_moments_are_split_as_their_weights():
  """`compile_train_step` places AdamW's moments as the weights they follow: a stacked
  stack of experts [layers, 1, E, D, F] split along its experts, as the weights are
  (placed by their own shapes, 48 layers split 8 ways would have won), the step count
  replicated."""
  mesh = make_mesh((8,), ("seq",))
  experts = NamedSharding(mesh, P(None, None, "seq", None, None))
  params = {"scanned_blocks": {0: {"mlp": {"gate": jax.ShapeDtypeStruct((48, 1, 16, 8, 4), jnp.float32)}}}}
  placed = {
    "scanned_blocks": {
      0: {"mlp": {"gate": jax.ShapeDtypeStruct((48, 1, 16, 8, 4), jnp.float32, sharding=experts)}}
    }
  }
  state = jax.eval_shape(optax.adam(1e-3).init, params)
  found = train_step._placed_as(state, placed, mesh)
  leaves = jax.tree.leaves(found)
  moments = [x for x in leaves if x.ndim]
  assert len(moments) == 2 and all(x.sharding == experts for x in moments)
  assert all(x.sharding.spec == P() for x in leaves if not x.ndim)


def test_a_restore_lets_the_trainers_arrays_go_and_gives_back_the_saved_state(tmp_path):
  """`state.Checkpoints.restore` replaces the trainer's weights and moments with the
  saved ones after deleting its own (restored beside them, a resumed run held both),
  and the restored weights are the saved ones, on 4 devices with FSDP."""
  from jax_ring.models.train.state import Checkpoints

  mesh = make_mesh((4,), ("seq",))
  model = models.build(PERIODIC, mesh=mesh, fsdp=True, remat="full", rngs=nnx.Rngs(3))
  trainer = train_step.Trainer(model, train_step.make_tx(1e-3, 1, 10, 0.0, 1.0), chunk=16)
  trainer.step(*train_step.place_batch(model, *_batch(batch=1, length=64)))
  saved = jax.tree.map(np.asarray, trainer.weights())
  state = Checkpoints(tmp_path, every=1)
  state.save(1, trainer, force=True)
  state.manager.wait_until_finished()
  fresh = train_step.Trainer(
    models.build(PERIODIC, mesh=mesh, fsdp=True, remat="full", rngs=nnx.Rngs(4)),
    train_step.make_tx(1e-3, 1, 10, 0.0, 1.0),
    chunk=16,
  )
  before = jax.tree.leaves((fresh.params, fresh.opt_state))
  state.restore(1, fresh)
  state.close()
  assert all(a.is_deleted() for a in before)
  for (path, a), (_, b) in zip(nnx.to_flat_state(fresh.weights()), nnx.to_flat_state(saved)):
    np.testing.assert_array_equal(np.asarray(a[...]), b[...], err_msg=str(path))


def test_check_run_refuses_each_bad_setting_by_name():
  """`finetune.check_run` itself (not only the script): no steps, no batch, a length past
  the context; a length of exactly the context runs."""
  model = models.build(SMALL, attention="dense")
  ids = np.arange(SMALL.context_length + 2) % SMALL.vocab_size
  check = lambda **kw: finetune.check_run(model, None, finetune.FinetuneConfig(**kw), ids)
  for kw, says in (
    (dict(steps=0, length=8), "steps=0"),
    (dict(steps=-1, length=8), "steps=-1"),
    (dict(batch=0, length=8), "batch=0"),
    (dict(length=SMALL.context_length + 1), f"length={SMALL.context_length + 1} exceeds"),
  ):
    with pytest.raises(ValueError, match=re.escape(says)):
      check(**kw)
  check(length=SMALL.context_length)
  # A text needs length + 2 tokens (a window of length + 1 at two offsets at least).
  window = lambda n: finetune.check_run(model, None, finetune.FinetuneConfig(length=16), np.arange(n) % 7)
  with pytest.raises(ValueError, match="the text has 17 tokens; length=16 needs at least 18"):
    window(17)
  window(18)


def test_ids_outside_the_vocabulary_are_named_and_the_last_id_is_in():
  from jax_ring.models.data import pipeline

  model = models.build(SMALL, attention="dense")
  loader = lambda top: type("L", (), {"examples": pipeline.Examples(
    [np.asarray([1, top], np.int32)], [np.ones(2, np.float32)], ["f.jsonl:3"], "text", []
  )})()  # fmt: skip
  config = finetune.FinetuneConfig(length=8)
  finetune.check_run(model, None, config, data=loader(SMALL.vocab_size - 1))
  with pytest.raises(ValueError, match=f"f.jsonl:3: token id {SMALL.vocab_size} is outside"):
    finetune.check_run(model, None, config, data=loader(SMALL.vocab_size))


def test_the_supervised_records_count_weighted_targets_and_evaluate_per_token():
  """loss_tokens counts the targets with a weight (not the targets that are not 0); an
  evaluation's loss is the mean over every weighted token, so a batch of 3 tokens at
  loss 1 and one of 1 token at loss 5 give 2, not the batches' mean 3."""
  from jax_ring.models.train import objective

  sft = objective.Supervised()
  arrays = dict(targets=np.asarray([[3, 0, 5, 7]]), weights=np.asarray([[0.0, 1.0, 1.0, 0.0]]))
  assert sft.record(arrays, 1.5, {})["loss_tokens"] == 2
  batches = [(dict(weights=np.ones((1, 3))), 1.0, {}), (dict(weights=np.asarray([[1.0, 0.0]])), 5.0, {})]
  assert sft.evaluate(batches) == dict(eval_loss=2.0)


def test_the_datas_place_must_be_the_saved_steps(tmp_path):
  """data_state.json holds the loader's place at the step it was saved with; a state at
  another step (a kill between the two writes) is refused, not resumed on the wrong rows."""
  finetune._write_data_state(str(tmp_path), 3, {"next": 7})
  assert finetune._data_state(str(tmp_path), 3, None) == {"next": 7}
  with pytest.raises(ValueError, match="is at step 4 but .* does not hold the data's place there"):
    finetune._data_state(str(tmp_path), 4, None)


def test_base_record_without_a_path_fingerprints_the_weights_not_only_their_shapes():
  """Two models of the same config and shapes but other weights differ in the record;
  the same weights give the same record."""
  a = models.build(SMALL, attention="dense", rngs=nnx.Rngs(1))
  b = models.build(SMALL, attention="dense", rngs=nnx.Rngs(2))
  again = models.build(SMALL, attention="dense", rngs=nnx.Rngs(1))
  record = lambda m: finetune.base_record(m, None)
  assert record(a)["config"] == record(b)["config"]
  assert record(a)["weights"] != record(b)["weights"]
  assert record(a) == record(again)


def test_an_option_this_xla_lacks_is_left_out_with_a_warning():
  """`train.step.compile_with`: an XLA option this jaxlib or libtpu does not have
  (option names move between versions) is left out with a warning naming it, and the
  rest still apply; any other compile error is raised."""
  lowered = jax.jit(lambda x: x * 2.0 + 1.0).lower(jnp.ones(4))
  options = dict(train_step.CPU_COMPILER_OPTIONS, xla_no_such_option_here=True)
  with pytest.warns(UserWarning, match="no compile option 'xla_no_such_option_here'"):
    compiled = train_step.compile_with(lowered, options)
  np.testing.assert_array_equal(np.asarray(compiled(jnp.ones(4))), np.full(4, 3.0))
  assert "xla_no_such_option_here" in options  # the caller's dict is left as it was
  with pytest.raises(jax.errors.JaxRuntimeError):
    train_step.compile_with(lowered, {"xla_cpu_scheduler_type": "NO_SUCH_SCHEDULER"})


# One FSDP step of a 2-block Llama (remat "attention", the CPU's memory-minimizing
# schedule) on a row of 16,384 tokens on 8 devices, at XLA's default flags (the failure
# below needed them), with a bound that skips no pass; prints the losses of two steps.
_BOUND_STEP = """
import dataclasses, os
from jax_ring.models.runtime import simulate_devices
simulate_devices(8)
import jax, numpy as np
from jax_ring import models
from jax_ring import nn as ring_nn
from jax_ring.models.train import step as train_step
t = 16384
mesh = jax.make_mesh((8,), ("seq",), devices=jax.devices()[:8])
config = dataclasses.replace(
  models.config("llama-3.2-1b"), num_layers=2, dim=256, num_heads=4, num_kv_heads=1, head_dim=64,
  mlp_hidden=512, vocab_size=512,
)
model = models.build(config, mesh=mesh, remat="attention", fsdp=True)
ring_nn.set_document_bound(model, (lambda b: b if b == "auto" else int(b))(os.environ["BOUND"]))
trainer = train_step.Trainer(model, train_step.make_tx(1e-4, 1, 10, 0.0, 1.0))
seg, pos, at = np.zeros(t, np.int32), np.zeros(t, np.int32), 0
for i, n in enumerate([8192] + [1000] * 8):
  seg[at : at + n], pos[at : at + n], at = i + 1, np.arange(n), at + n
ids = np.random.default_rng(0).integers(0, 512, (1, t + 1)).astype(np.int32)
weights = np.ones((1, t), np.float32)
batch = train_step.place_batch(trainer.model(), ids[:, :-1], ids[:, 1:], weights, seg[None], pos[None])
for _ in range(2):
  print(float(trainer.step(*batch[:3], segment_ids=batch[3], positions=batch[4])[0]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["8192", "auto"])
def test_fsdp_step_with_a_bound_that_skips_no_pass_runs_on_8_cpu_devices(bound):
  """With `document_bound` 8,192 on rows of 16,384 over 8 devices, the bound skips no
  pass; the step once stopped in XLA:CPU's rendezvous of a ring permute ("Unexpected
  number of participants", or a hang) where the bound's check was compiled in. Now it
  takes two steps, in a process of its own (an XLA:CPU check failure aborts it), killed
  (SIGKILL) past its limit. That such a bound changes nothing else is
  test_documents.py's `test_a_bound_that_skips_no_pass_is_the_unbounded_call`. "auto"
  (its gather of the ids and its switch compiled into the same step) takes them too."""
  import subprocess
  import sys

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["BOUND"] = bound
  command = [sys.executable, "-c", _BOUND_STEP]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  losses = [float(x) for x in done.stdout.split()]
  assert len(losses) == 2 and math.isfinite(losses[0]) and losses[1] < losses[0], losses
