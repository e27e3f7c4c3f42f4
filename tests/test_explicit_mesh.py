"""`jax.make_mesh`'s default mesh (Explicit axes) outside `jax.set_mesh`: every public
path works as a user first calls it, eagerly and under jit, and its results are
ordinary arrays (indexing, sums, `jax.grad`). Under `jax.set_mesh`, or with inputs
already typed by the Explicit mesh, results keep their Explicit types."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh, qkv, rel_err
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
import jax_ring.nn
from jax_ring import models

B, T, N, K, H = 1, 64, 4, 2, 16
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh():
  m = make_mesh((4,), ("seq",))
  assert m.axis_types == (AxisType.Explicit,)
  return m


def _explicit(x) -> bool:
  return bool(jax.typeof(x).sharding.mesh.explicit_axes)


def test_ring_attention_eager_grad_and_indexing(mesh):
  q, k, v = qkv(B, T, N, K, H)
  loss = lambda q, k, v: jnp.sum(jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True) ** 2)
  ref = lambda q, k, v: jnp.sum(jax_ring.reference_attention(q, k, v, is_causal=True) ** 2)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  wide = tuple(x.astype(jnp.float64) for x in (q, k, v))
  for g, r in zip(grads, jax.grad(ref, argnums=(0, 1, 2))(*wide)):
    assert rel_err(g, r) < TOL
  out = jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True)
  assert not _explicit(out)
  np.testing.assert_allclose(out[0, 5], jax_ring.reference_attention(*wide, is_causal=True)[0, 5], atol=1e-6)
  assert float(out[:, 3:9].sum()) == pytest.approx(float(np.asarray(out)[:, 3:9].sum()), rel=1e-6)


def test_dilated_attention_eager_grad(mesh):
  q, k, v = qkv(B, T, N, N, H)
  options = dict(segment_lengths=(16, 64), dilation_rates=(1, 2))
  g = jax.grad(lambda q: jnp.sum(jax_ring.dilated_attention(q, k, v, mesh=mesh, **options)))(q)
  wide = tuple(x.astype(jnp.float64) for x in (q, k, v))
  r = jax.grad(lambda q: jnp.sum(jax_ring.reference_dilated_attention(q, *wide[1:], **options)))(wide[0])
  assert rel_err(g, r) < TOL


def test_under_set_mesh_and_for_explicit_inputs_results_stay_explicit(mesh):
  q, k, v = qkv(B, T, N, K, H)
  with jax.set_mesh(mesh):
    out = jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True)
    assert _explicit(out)
  typed = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
  assert _explicit(jax.jit(lambda *a: jax_ring.ring_attention(*a, mesh=mesh))(*typed))


def test_nnx_training_step_eager_and_jitted(mesh):
  module = jax_ring.nn.RingAttention(N, 32, num_kv_heads=K, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(module, optax.adam(1e-3), wrt=nnx.Param)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, T, 32))
  loss_of = lambda m: jnp.mean(m(x) ** 2)

  @nnx.jit
  def step(m, opt):
    loss, grads = nnx.value_and_grad(loss_of)(m)
    opt.update(m, grads)
    return loss

  first = step(module, optimizer)
  loss, grads = nnx.value_and_grad(loss_of)(module)  # eager
  optimizer.update(module, grads)
  assert float(loss_of(module)) < float(first)


def test_decoder_lm_prefill_decode_and_generate(mesh):
  """The model's training call, prefill (its logits indexed), decode and generate,
  all outside set_mesh, against the same model on one device."""
  config = models.LMConfig(vocab_size=32, dim=32, num_heads=4, num_kv_heads=2, conv=3)
  model = models.DecoderLM(config, mesh=mesh, rngs=nnx.Rngs(0))
  dense = models.DecoderLM(
    models.LMConfig(**{**config.__dict__, "attention": "dense"}), mesh=None, rngs=nnx.Rngs(0)
  )
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 24), 0, 32)
  want = dense(tokens)
  np.testing.assert_allclose(model(tokens)[:, 3], want[:, 3], atol=1e-5)
  model.init_cache(2, 32)
  logits = model.prefill(tokens[:, :20])
  np.testing.assert_allclose(logits[:, 19], want[:, 19], atol=1e-5)
  step = model.decode(tokens[:, 20:21])
  np.testing.assert_allclose(step[:, 0], want[:, 20], atol=1e-5)
  out = models.generate(model, tokens[:, :8], max_new_tokens=3)
  assert out.tokens.shape == (2, 3) and int(out.lengths[0]) == 3


def test_decoder_lm_takes_sequence_sharded_tokens_under_set_mesh(mesh):
  """Tokens typed as split over the sequence (as training feeds them) through a model
  that keeps the ring's order: the gathers into and out of that order say their
  sharding, and the loss and logits equal those from replicated tokens."""
  config = models.LMConfig(vocab_size=32, dim=32, num_layers=1, num_heads=4, num_kv_heads=2)
  model = models.DecoderLM(config, mesh=mesh, rngs=nnx.Rngs(0))
  length = 4 * (jax_ring.layouts.SHORT_CAUSAL_SHARD + 16)  # long enough shards for zigzag
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, length), 0, 32)
  assert model.ring_permutation(length) is not None  # the ring's order differs from natural
  graph, params = nnx.split(model)

  @jax.jit
  def run(params, tokens):
    m = nnx.merge(graph, params)
    logits = m(tokens, logits_order="ring")
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, m.to_ring_order(tokens)).mean()
    return loss, m(tokens)

  with jax.set_mesh(mesh):
    split = jax.device_put(tokens, NamedSharding(mesh, P(None, "seq")))
    whole = jax.device_put(tokens, NamedSharding(mesh, P()))
    (loss_split, logits_split), (loss_whole, logits_whole) = run(params, split), run(params, whole)
  assert jax.typeof(logits_split).sharding.spec[1] == "seq"
  assert abs(float(loss_split) - float(loss_whole)) < 1e-5
  assert rel_err(logits_split, logits_whole) < TOL
