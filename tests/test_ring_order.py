"""Inputs already in the ring's token order: `ring_attention(token_order="layout")` and
`DecoderLM` with `LMConfig.ring_order`, which permutes a batch's tokens once and runs
every layer on that order. Same numbers as natural order; no relayout collectives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh, qkv, rel_err
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ring import hlo, layouts, reference_attention, ring_attention
from jax_ring.models import DecoderLM, LMConfig
from jax_ring.models.train.scratch import loss_and_accuracy
from jax_ring.models.train.scratch import make_mesh as train_mesh

# ring_attention with token_order="layout" ------------------------------------------


@pytest.mark.parametrize(
  ("devices", "layout", "length"),
  [(1, "zigzag", 64), (2, "zigzag", 96), (3, "zigzag", 96), (4, "striped", 64), (8, "zigzag", 128)],
)
def test_layout_order_inputs_equal_the_reference(devices, layout, length):
  mesh = make_mesh((devices,), ("seq",))
  q, k, v = qkv(2, length, 4, 2, 16)
  seg = np.repeat(np.arange(3), -(-length // 3))[None, :length].repeat(2, 0)
  to = lambda x: layouts.to_layout(x, layout, devices)
  back = lambda x: layouts.from_layout(x, layout, devices)

  def laid_out(q, k, v):
    out = ring_attention(
      to(q), to(k), to(v), mesh=mesh, is_causal=True, segment_ids=to(seg), layout=layout, token_order="layout"
    )
    return back(out)

  def reference(q, k, v):
    return reference_attention(q, k, v, is_causal=True, segment_ids=seg)

  x64 = [x.astype(jnp.float64) for x in (q, k, v)]
  cot = jax.random.normal(jax.random.PRNGKey(5), q.shape, jnp.float32)
  out, vjp = jax.vjp(laid_out, q, k, v)
  want, vjp_ref = jax.vjp(reference, *x64)
  assert rel_err(out, want) < 1e-5
  for got, exp in zip(vjp(cot), vjp_ref(cot.astype(jnp.float64))):
    assert rel_err(got, exp) < 1e-5


def test_layout_order_with_the_ulysses_hybrid():
  mesh = make_mesh((2, 4), ("u", "seq"))
  q, k, v = qkv(1, 128, 4, 2, 16)
  layout = layouts.resolve("auto", True, shard_len=128 // 4)
  common = dict(mesh=mesh, is_causal=True, ulysses_axis="u", layout="zigzag")
  to = lambda x: layouts.to_layout(x, "zigzag", 4)
  out = ring_attention(to(q), to(k), to(v), token_order="layout", **common)
  want = reference_attention(*(x.astype(jnp.float64) for x in (q, k, v)), is_causal=True)
  assert layout == "contiguous"  # short shards: "auto" would not relay them; zigzag named
  assert rel_err(layouts.from_layout(out, "zigzag", 4), want) < 1e-5


def test_layout_order_is_refused_where_it_cannot_hold():
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(1, 60, 2, 2, 8)
  with pytest.raises(ValueError, match=r"token_order='rings' must be 'natural' or 'layout'"):
    ring_attention(q, k, v, mesh=mesh, token_order="rings")
  with pytest.raises(ValueError, match=r"query length 60 must be a multiple of 8 \(layout='zigzag'"):
    ring_attention(q, k, v, mesh=mesh, is_causal=True, layout="zigzag", token_order="layout")


def test_layout_order_moves_no_tokens_outside_the_ring():
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(1, 64, 2, 2, 8)
  sharding = NamedSharding(mesh.update(axis_types=(AxisType.Auto,)), P(None, "seq"))
  q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
  common = dict(mesh=mesh, is_causal=True, layout="zigzag")
  loss = lambda order: lambda q, k, v: jnp.sum(ring_attention(q, k, v, token_order=order, **common) ** 2)
  compiled = lambda order: jax.jit(jax.grad(loss(order), argnums=(0, 1, 2))).lower(q, k, v).compile()
  relaid = hlo.loop_free_collectives(compiled("natural"))
  kept = hlo.loop_free_collectives(compiled("layout"))
  half_shard = ("collective-permute", 8 * 2 * 8 * 4)  # 8 of a device's 16 tokens, 2 heads x 8
  # natural order: q, k, v in and the output back, two half shards each, forward and
  # backward (the gradients travel back the same way); both keep the ring's own last
  # transfer (dK and dV home), which is outside its loop
  assert relaid.count(half_shard) == 16
  assert half_shard not in kept and all(op in relaid for op in kept)


# DecoderLM with ring_order ---------------------------------------------------------

CONFIG = LMConfig(
  vocab_size=37,
  dim=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  mlp_hidden=64,
  conv=3,
  window=20,
  global_every=2,
)


@pytest.fixture
def short_shards_zigzag(monkeypatch):
  """Causal rings of 32-token shards run zigzag (as they do above 256 tokens a device
  by default), so the tests see the relayout at small sizes."""
  monkeypatch.setattr(layouts, "SHORT_CAUSAL_SHARD", 8)


def _auto_mesh(devices):
  return make_mesh((devices,), ("seq",)).update(axis_types=(AxisType.Auto,))


def _batch(length, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 37, (2, length)).astype(np.int32)
  targets = rng.integers(0, 37, (2, length)).astype(np.int32)
  weights = rng.uniform(0.0, 1.0, (2, length)).astype(np.float32)
  segments = np.zeros((2, length), np.int32)
  segments[0, length // 2 :], segments[1, length // 3 :] = 1, 1
  return tokens, targets, weights, segments


def _step(model, tokens, targets, weights, segments):
  """(loss, gradients, logits in natural order) of a training step whose loss takes
  the logits in the order the layers ran on and puts its targets in that order."""

  def loss(model):
    logits = model(tokens, segment_ids=segments, logits_order="ring")
    labels, scored = model.to_ring_order(targets), model.to_ring_order(weights)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * scored) / jnp.sum(scored), model(tokens, segment_ids=segments)

  (value, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
  flat = nnx.to_flat_state(nnx.state(grads, nnx.Param))
  return value, {key: v.get_value() for key, v in flat}, logits


def _assert_same_step(got, want, tol):
  """The same loss, logits and gradients: every parameter's, by name, within `tol`."""
  assert abs(float(got[0]) - float(want[0])) < tol * abs(float(want[0]))
  assert list(got[1]) == list(want[1])  # the same parameters, in the same order
  for key, g in got[1].items():
    assert rel_err(g, want[1][key]) < tol, key
  assert rel_err(got[2], want[2]) < tol


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_ring_order_model_equals_natural_order_and_dense(devices, short_shards_zigzag):
  length = 32 * devices
  mesh = _auto_mesh(devices)
  ordered = DecoderLM(CONFIG, mesh=mesh, rngs=nnx.Rngs(0))
  natural = DecoderLM(dataclasses.replace(CONFIG, ring_order=False), mesh=mesh, rngs=nnx.Rngs(0))
  dense = DecoderLM(dataclasses.replace(CONFIG, attention="dense", ring_order=False), rngs=nnx.Rngs(0))
  assert ordered.ring_layout(length) == "zigzag" and natural.ring_permutation(length) is None
  perm = ordered.ring_permutation(length)
  assert sorted(perm.tolist()) == list(range(length)) and (devices == 1 or (perm != np.arange(length)).any())
  batch = _batch(length)
  got = _step(ordered, *batch)
  _assert_same_step(got, _step(natural, *batch), 1e-6)
  _assert_same_step(got, _step(dense, *batch), 1e-5)


def test_ring_order_training_step_relays_no_layer(short_shards_zigzag):
  """The compiled step of `models.train.scratch`'s loss: per layer, natural order relays
  q, k, v and the output in and out (forward and backward); ring order relays none."""
  layers, length = 3, 256
  mesh = train_mesh(1, 8)
  batch = jax.device_put(_batch(length)[:3], NamedSharding(mesh, P(None, "seq")))
  config = dataclasses.replace(CONFIG, num_layers=layers, window=None, global_every=0)

  def loop_free(ring_order):
    model = DecoderLM(dataclasses.replace(config, ring_order=ring_order), mesh=mesh, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    loss = lambda model, *batch: loss_and_accuracy(model, *batch)
    step = lambda state, *batch: nnx.value_and_grad(loss, has_aux=True)(nnx.merge(graph, state), *batch)
    return hlo.loop_free_collectives(jax.jit(step).lower(state, *batch).compile())

  natural, ordered = loop_free(False), loop_free(None)
  permutes = lambda found: [n for op, n in found if op in ("collective-permute", "all-to-all")]
  shard_kv = 2 * 32 * 2 * 8 * 4  # bytes of a device's K: 2 rows x 32 tokens x 2 heads x 8
  # Both keep the ring's own transfer after its loop (dK and dV home, a K shard each,
  # one transfer on CPU, where a ring step's arrays of one dtype travel together, per
  # layer); natural order adds two half shards per array (q, k, v, output) and layer,
  # in the forward and in the backward.
  assert permutes(ordered) == [2 * shard_kv] * layers
  assert len(permutes(natural)) >= len(permutes(ordered)) + 16 * layers
  # What else ring order moves outside the ring: the batch into its order (tokens,
  # targets, weights), each short convolution's chunk tails, and the gradients' sums.
  # All of them are small: a [2, 256] batch array is 2 KiB, and the tails of all 16
  # chunks (conv - 1 = 2 rows of width 32 each) 8 KiB, whatever the length.
  batch_bytes, tails_bytes = 2 * 256 * 4, 2 * 16 * 2 * 32 * 4
  assert sorted(n for op, n in ordered if op == "all-gather") == [batch_bytes] * 3 + [tails_bytes] * layers


def test_ring_order_generation_and_refusals(short_shards_zigzag):
  mesh = _auto_mesh(4)
  model = DecoderLM(CONFIG, mesh=mesh, rngs=nnx.Rngs(0))
  tokens = _batch(128)[0]
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(2, 136)
  prompt = nnx.jit(lambda m, t: m.prefill(t))(model, tokens)
  assert rel_err(prompt, full) < 1e-5
  with pytest.raises(ValueError, match=r"LMConfig.ring_order=True runs the layers .* needs attention 'ring'"):
    DecoderLM(dataclasses.replace(CONFIG, attention="local", ring_order=True), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"LMConfig.ring_order=1 must be None \(auto\), True or False"):
    DecoderLM(dataclasses.replace(CONFIG, ring_order=1), mesh=mesh, rngs=nnx.Rngs(0))
  forced = DecoderLM(dataclasses.replace(CONFIG, ring_order=True), mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"ring_order=True: cannot keep the ring's order: length 132"):
    forced.ring_layout(132)
  assert DecoderLM(CONFIG, mesh=mesh, rngs=nnx.Rngs(0)).ring_layout(132) is None  # auto: natural order
  with pytest.raises(ValueError, match=r"logits_order='zigzag' must be 'natural' or 'ring'"):
    model(tokens, logits_order="zigzag")


def test_ring_order_with_the_ulysses_hybrid(short_shards_zigzag):
  """Sequence over ("seq", "u") = 4 x 2: the ring's order over the 4 ring devices."""
  mesh = train_mesh(1, 4, 2)
  config = dataclasses.replace(CONFIG, ulysses_axis="u")
  ordered = DecoderLM(config, mesh=mesh, rngs=nnx.Rngs(0))
  natural = DecoderLM(dataclasses.replace(config, ring_order=False), mesh=mesh, rngs=nnx.Rngs(0))
  assert ordered.ring_layout(128) == "zigzag"
  batch = _batch(128)
  _assert_same_step(_step(ordered, *batch), _step(natural, *batch), 1e-6)
