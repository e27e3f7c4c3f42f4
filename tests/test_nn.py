"""Flax NNX modules and models: equal to their dense paths, bad configs rejected."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from jax.sharding import AxisType

import jax_ring
from jax_ring import nn as ring_nn
from jax_ring.models import DecoderLM, LMConfig, LongNet, LongNetConfig

TOL = 1e-5


def _auto_mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def _x(batch=2, length=40, dim=32, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, dim), jnp.float32)


def _mha(attention_fn=None):
  """nnx.MultiHeadAttention (4 heads over 2 kv heads, D=32), with Flax's own attention
  or `attention_fn`."""
  extra = {} if attention_fn is None else {"attention_fn": attention_fn}
  return nnx.MultiHeadAttention(
    num_heads=4, in_features=32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0), **extra
  )


def _assert_close_trees(ga, gb, tol=TOL):
  """Per-leaf relative error against the leaf's own norm, every leaf, no floor. Except
  the key bias: softmax is invariant to it (it adds q . b to a whole row of scores), so
  its true gradient is 0 and both sides hold float32 rounding, measured at 3e-9 of all
  gradients' norm in both; that leaf must be zero to 1e-7 of it on both sides. The
  other leaves measure at most 6.5e-7 of their own norm (float32 against float32)."""
  assert jax.tree.structure(ga) == jax.tree.structure(gb)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(gb)]
  leaves_a, leaves_b = jax.tree.leaves(ga), jax.tree.leaves(gb)
  assert len(leaves_a) > 0
  norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64).ravel()))
  total = float(np.sqrt(sum(norm(b) ** 2 for b in leaves_b)))
  for path, a, b in zip(paths, leaves_a, leaves_b):
    if "['key']['bias']" in path:
      assert norm(a) < 1e-7 * total and norm(b) < 1e-7 * total, (path, norm(a) / total, norm(b) / total)
      continue
    assert norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) < tol * norm(b), (path, a.shape)


def _grads_and_out(module, x, **kw):
  return _grads_and_out_jit(module, x, kw)


@nnx.jit
def _grads_and_out_jit(module, x, kw):
  """One compiled forward + backward (eager dispatch over sharded arrays was slower)."""

  def loss(m, x):
    out = m(x, **kw)
    return jnp.sum(out * jnp.cos(out)), out

  (_, out), grads = nnx.value_and_grad(loss, has_aux=True, argnums=(0, 1))(module, x)
  return out, grads


def _assert_same(module_a, module_b, x, **kw):
  out_a, (gm_a, gx_a) = _grads_and_out(module_a, x, **kw)
  out_b, (gm_b, gx_b) = _grads_and_out(module_b, x, **kw)
  assert rel_err(out_a, out_b) < TOL
  assert rel_err(gx_a, gx_b) < TOL
  _assert_close_trees(gm_a, gm_b)


def _ring_pair(mesh, batch_axis=None, **kw):
  make = lambda kind, mesh: ring_nn.RingAttention(
    4,
    32,
    num_kv_heads=2,
    kind=kind,
    mesh=mesh,
    batch_axis=batch_axis,
    rope_base=10000.0,
    rngs=nnx.Rngs(0),
    **kw,
  )
  return make("ring", mesh), make("dense", None)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_ring_module_equals_dense(devices):
  ring, dense = _ring_pair(_auto_mesh((devices,), ("seq",)), is_causal=True)
  _assert_same(ring, dense, _x())


def test_ring_module_on_explicit_mesh_under_set_mesh():
  mesh = make_mesh((4,), ("seq",))  # Explicit axes, the default of jax.make_mesh
  ring, dense = _ring_pair(mesh, is_causal=True)
  x = _x()
  with jax.set_mesh(mesh):
    out_ring, (gm_ring, gx_ring) = _grads_and_out(ring, x)
  out_dense, (gm_dense, gx_dense) = _grads_and_out(dense, x)
  assert rel_err(out_ring, out_dense) < TOL
  assert rel_err(gx_ring, gx_dense) < TOL
  _assert_close_trees(gm_ring, gm_dense)


def test_ring_module_on_2d_mesh_with_segments():
  mesh = _auto_mesh((2, 4), ("data", "seq"))
  ring, dense = _ring_pair(mesh, batch_axis="data", local_window_size=(7, 0))
  seg = jnp.asarray(np.repeat([[0, 1], [2, -1]], 20, axis=1), jnp.int32)
  _assert_same(ring, dense, _x(), segment_ids=seg)


@pytest.mark.parametrize("devices", [None, 2, 8])
def test_dilated_module_equals_dense(devices):
  mesh = None if devices is None else _auto_mesh((devices,), ("seq",))
  make = lambda kind, mesh: ring_nn.DilatedAttention(
    4,
    32,
    segment_lengths=(8, 20),
    dilation_rates=(1, 2),
    kind=kind,
    mesh=mesh,
    is_causal=True,
    rope_base=10000.0,
    rngs=nnx.Rngs(1),
  )
  _assert_same(make("dilated", mesh), make("dense", None), _x())


def test_dilated_module_on_2d_mesh():
  mesh = _auto_mesh((2, 4), ("data", "seq"))
  make = lambda kind, mesh: ring_nn.DilatedAttention(
    4,
    32,
    segment_lengths=(16,),
    dilation_rates=(2,),
    kind=kind,
    mesh=mesh,
    batch_axis="data",
    rngs=nnx.Rngs(1),
  )
  _assert_same(make("dilated", mesh), make("dense", None), _x())


def test_local_kind_is_shard_local():
  # A query in the last shard must not see the first: changing token 0 leaves it alone.
  mesh = _auto_mesh((4,), ("seq",))
  local = ring_nn.RingAttention(4, 32, kind="local", mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
  x = _x(1)
  y = x.at[:, 0].add(5.0)
  out_x, out_y = local(x), local(y)
  np.testing.assert_array_equal(out_x[:, 10:], out_y[:, 10:])
  assert not np.allclose(out_x[:, :10], out_y[:, :10])


@pytest.mark.parametrize("devices", [1, 8])
def test_make_attention_fn_matches_flax_default(devices):
  mesh = _auto_mesh((devices,), ("seq",))
  make = _mha
  flax_default = make(None)
  ring = make(ring_nn.make_attention_fn(mesh=mesh, is_causal=True))
  causal_mask = nnx.make_causal_mask(jnp.ones((2, 40)))
  x = _x()

  @nnx.jit  # one program each (eager dispatch cost more than compiling)
  def grads(m, mask):
    f = lambda m, x: jnp.sum(jnp.sin(m(x, mask=mask)))
    return nnx.value_and_grad(f, argnums=(0, 1))(m, x), m(x, mask=mask)

  ((va, (gma, gxa)), out_a), ((vb, (gmb, gxb)), out_b) = grads(ring, None), grads(flax_default, causal_mask)
  # The loss, a float32 sum of 2,560 sines near 66: measured 1.2e-7 (1 device) and
  # 4.6e-7 (8) of it apart.
  assert abs(float(va - vb)) <= TOL * abs(float(vb))
  assert rel_err(out_a, out_b) < TOL
  assert rel_err(gxa, gxb) < TOL
  _assert_close_trees(gma, gmb)


PACKED = np.array([[0] * 13 + [1] * 17 + [2] * 10, [5] * 25 + [7] * 15], np.int32)  # [2, 40]


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_packed_rows_through_flax_mha_match_flax_with_the_dense_mask(devices):
  """Packed sequences through nnx.MultiHeadAttention: mask=segment_mask(ids) on the
  ring's attention_fn gives Flax's own attention under the dense mask
  make_attention_mask(ids, ids, equal) & causal, outputs and gradients (weights and
  inputs), inside nnx.jit with the mask an argument."""
  mesh = _auto_mesh((devices,), ("seq",))
  make = _mha
  flax_default, ring = make(None), make(ring_nn.make_attention_fn(mesh=mesh, is_causal=True))
  ids = jnp.asarray(PACKED)
  dense = nnx.combine_masks(nnx.make_attention_mask(ids, ids, jnp.equal), nnx.make_causal_mask(ids))
  assert not dense[0, 0, 13, :13].any() and dense[0, 0, 13, 13]  # a segment boundary is masked

  @nnx.jit
  def grads(m, mask):
    f = lambda m, x: jnp.sum(jnp.sin(m(x, mask=mask)))
    return nnx.value_and_grad(f, argnums=(0, 1))(m, _x()), m(_x(), mask=mask)

  ((_, (gma, gxa)), out_a), ((_, (gmb, gxb)), out_b) = (
    grads(ring, ring_nn.segment_mask(ids)),
    grads(flax_default, dense),
  )
  assert rel_err(out_a, out_b) < TOL
  assert rel_err(gxa, gxb) < TOL
  _assert_close_trees(gma, gmb)
  # Without the segments the answer differs: the mask was applied, not ignored.
  assert rel_err(ring(_x()), out_b) > 1e-2


def test_segment_mask_padding_sees_nothing_and_bad_masks_are_refused():
  mesh = make_mesh((4,), ("seq",))
  fn = ring_nn.make_attention_fn(mesh=mesh, is_causal=True)
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  q, k, v = (jax.random.normal(key, (2, 40, 4, 8), jnp.float64) for key in keys)
  ids = PACKED.copy()
  ids[1, 33:] = -1  # row 1's tail is padding
  out = fn(q, k, v, mask=ring_nn.segment_mask(ids))
  want = jax_ring.reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(ids))
  assert rel_err(out, want) < TOL
  assert (np.asarray(out)[1, 33:] == 0).all()
  with pytest.raises(ValueError, match=r"segment_mask of shape \(2, 39\) does not fit"):
    fn(q, k, v, mask=ring_nn.segment_mask(ids[:, :39]))
  with pytest.raises(TypeError, match="segment_ids of shape \\(2, 40\\) and dtype float32"):
    ring_nn.segment_mask(np.zeros((2, 40), np.float32))
  with pytest.raises(ValueError, match=r"packed rows: mask=jax_ring.nn.segment_mask"):
    fn(q, k, v, mask=nnx.make_attention_mask(jnp.asarray(ids), jnp.asarray(ids), jnp.equal))


def test_make_attention_fn_rejects_dense_mask():
  mesh = make_mesh((2,), ("seq",))
  mha = nnx.MultiHeadAttention(
    num_heads=4,
    in_features=32,
    decode=False,
    attention_fn=ring_nn.make_attention_fn(mesh=mesh),
    rngs=nnx.Rngs(0),
  )
  with pytest.raises(ValueError, match="mask"):
    mha(_x(), mask=nnx.make_causal_mask(jnp.ones((2, 40))))


def test_parameter_sharding_metadata():
  plain = ring_nn.RingAttention(4, 32, kind="dense", rngs=nnx.Rngs(0))
  assert all(s == P() or all(a is None for a in s) for s in jax.tree.leaves(_specs(plain)))
  sharded = ring_nn.RingAttention(
    4, 32, kind="dense", qkv_sharding=(None, "model"), out_sharding=("model", None), rngs=nnx.Rngs(0)
  )
  specs = _specs(sharded)
  assert specs["query"]["kernel"] == P(None, "model")
  assert specs["out"]["kernel"] == P("model", None)


def _specs(module):
  return nnx.get_partition_spec(nnx.state(module, nnx.Param))


P = jax.sharding.PartitionSpec


@pytest.mark.parametrize(
  ("make", "match"),
  [
    (lambda: ring_nn.RingAttention(6, 32, num_kv_heads=4, kind="dense", rngs=nnx.Rngs(0)), "num_heads=6"),
    (lambda: ring_nn.RingAttention(5, 32, kind="dense", rngs=nnx.Rngs(0)), "in_features=32"),
    (lambda: ring_nn.RingAttention(4, 32, kind="flash", rngs=nnx.Rngs(0)), "kind='flash'"),
    (lambda: ring_nn.RingAttention(4, 32, kind="ring", rngs=nnx.Rngs(0)), "needs mesh"),
    (
      lambda: ring_nn.RingAttention(4, 32, mesh=make_mesh((2,), ("seq",)), seq_axis="sp", rngs=nnx.Rngs(0)),
      "seq_axis='sp'",
    ),
    (
      lambda: ring_nn.DilatedAttention(4, 32, segment_lengths=(8,), dilation_rates=(1, 2), rngs=nnx.Rngs(0)),
      "same length",
    ),
    (lambda: DecoderLM(LMConfig(vocab_size=10, attention="sparse"), rngs=nnx.Rngs(0)), "attention='sparse'"),
    (lambda: DecoderLM(LMConfig(vocab_size=10, num_heads=3), rngs=nnx.Rngs(0)), "num_heads=3"),
    (lambda: DecoderLM(LMConfig(vocab_size=10, conv=-1), rngs=nnx.Rngs(0)), "conv=-1"),
    (
      lambda: ring_nn.RingAttention(
        4, 32, kind="dense", rope_base=1e4, rope_max_wavelength=0, rngs=nnx.Rngs(0)
      ),
      "rope_max_wavelength=0",
    ),
    (lambda: DecoderLM(LMConfig(vocab_size=10, attention="ring"), rngs=nnx.Rngs(0)), "needs a mesh"),
    (
      lambda: DecoderLM(
        LMConfig(vocab_size=10, max_seq_len=4), mesh=make_mesh((8,), ("seq",)), rngs=nnx.Rngs(0)
      ),
      "max_seq_len=4",
    ),
  ],
)
def test_bad_configuration_fails_at_construction(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def _lm_pair(attention, mesh, **config):
  cfg = LMConfig(vocab_size=37, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_hidden=64, **config)
  ring = DecoderLM(dataclasses_replace(cfg, attention=attention), mesh=mesh, rngs=nnx.Rngs(0))
  dense_kind = "dilated_dense" if attention == "dilated" else "dense"
  dense = DecoderLM(dataclasses_replace(cfg, attention=dense_kind), rngs=nnx.Rngs(0))
  return ring, dense


def dataclasses_replace(cfg, **kw):
  import dataclasses

  return dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize(
  ("attention", "extra"),
  [("ring", {}), ("dilated", {}), ("ring", {"conv": 3, "rope_max_wavelength": 20.0})],
  ids=["ring", "dilated", "ring-conv-prope"],
)
def test_decoder_lm_equals_dense(attention, extra):
  mesh = _auto_mesh((4,), ("seq",))
  ring, dense = _lm_pair(attention, mesh, segment_lengths=(8, 32), dilation_rates=(1, 2), **extra)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 36), 0, 37)
  loss = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])))
  la, ga = loss(ring)
  lb, gb = loss(dense)
  assert abs(float(la - lb)) < 1e-5 * abs(float(lb))
  _assert_close_trees(ga, gb)


def test_longnet_equals_its_reference():
  mesh = _auto_mesh((4,), ("seq",))
  cfg = LongNetConfig(
    vocab_size=23,
    dim=32,
    num_layers=1,
    num_heads=4,
    ffn_hidden=64,
    segment_lengths=(8, 16),
    dilation_rates=(1, 2),
  )
  fast = LongNet(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  ref = LongNet(dataclasses_replace(cfg, reference=True), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 48), 0, 23)
  loss = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 3])))
  la, ga = loss(fast)
  lb, gb = loss(ref)
  assert abs(float(la - lb)) < 1e-5 * abs(float(lb))
  _assert_close_trees(ga, gb)


def test_remat_and_scan_over_layers_keep_loss_and_gradients():
  mesh = _auto_mesh((4,), ("seq",))
  cfg = LMConfig(
    vocab_size=37, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=64, attention="ring"
  )
  plain = DecoderLM(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 36), 0, 37)
  loss = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])))
  l_plain, g_plain = loss(plain)
  stack = lambda *leaves: jnp.stack(leaves)
  per_layer = [nnx.state(block, nnx.Param) for block in plain.blocks]
  for remat, scan in ((True, False), (False, True), (True, True)):
    model = DecoderLM(dataclasses_replace(cfg, remat=remat, scan_layers=scan), mesh=mesh, rngs=nnx.Rngs(1))
    if scan:
      nnx.update(model.blocks, jax.tree.map(stack, *per_layer))
    else:
      for block, state in zip(model.blocks, per_layer):
        nnx.update(block, state)
    for name in ("embed", "norm", "head"):
      nnx.update(getattr(model, name), nnx.state(getattr(plain, name), nnx.Param))
    l_model, g_model = loss(model)
    assert abs(float(l_model - l_plain)) < 1e-6 * abs(float(l_plain)), (remat, scan)
    g_blocks = g_model["blocks"]
    expected = jax.tree.map(stack, *[g_plain["blocks"][i] for i in range(2)]) if scan else g_plain["blocks"]
    _assert_close_trees(g_blocks, expected, 1e-5)
    for name in ("embed", "norm", "head"):
      _assert_close_trees(g_model[name], g_plain[name], 1e-5)
  with pytest.raises(ValueError, match="scan_layers=True has no decode mode"):
    DecoderLM(dataclasses_replace(cfg, scan_layers=True), mesh=mesh, rngs=nnx.Rngs(0)).init_cache(1, 8)


def test_p_rope_drops_long_wavelengths_and_stays_relative():
  full = np.asarray(ring_nn.rope_frequencies(16, 10000.0))
  kept = np.asarray(ring_nn.rope_frequencies(16, 10000.0, max_wavelength=100.0))
  long = 2 * np.pi / full > 100.0
  assert 0 < long.sum() < long.size
  np.testing.assert_array_equal(kept[long], 0.0)
  np.testing.assert_array_equal(kept[~long], full[~long])
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 5, 1, 16))
  positions = jnp.array([0, 3, 250, 251, 900])
  q, k = (ring_nn.apply_rope(x[i], positions, 10000.0, 100.0) for i in (0, 1))
  q2, k2 = (ring_nn.apply_rope(x[i], positions + 777, 10000.0, 100.0) for i in (0, 1))
  scores = jnp.einsum("bqnh,bknh->qk", q, k)
  np.testing.assert_allclose(scores, jnp.einsum("bqnh,bknh->qk", q2, k2), atol=1e-4)
  # The dropped pairs (dimension i with i + 8) are not rotated at all.
  pairs = np.concatenate([long, long])
  np.testing.assert_allclose(np.asarray(q)[..., pairs], np.asarray(x[0])[..., pairs], rtol=1e-6)
  assert not np.allclose(np.asarray(q)[..., ~pairs], np.asarray(x[0])[..., ~pairs], rtol=1e-3)


def test_short_conv_is_a_causal_depthwise_convolution():
  from jax_ring.models.architectures.scratch import ShortConv

  conv = ShortConv(4, 3, dtype=None, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  h = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (2, 7, 4)))
  w = np.asarray(conv.kernel[...])
  expected = h.copy()
  for t in range(7):
    for s in range(3):
      if t - s >= 0:
        expected[:, t] += w[s] * h[:, t - s]
  np.testing.assert_allclose(np.asarray(conv(jnp.asarray(h))), expected, rtol=1e-6, atol=1e-6)
  # Prefill of rows of 7 and 2 tokens, then one decoded token: the state carries on.
  conv.init_cache(2, jnp.float32)
  conv.prefill(jnp.asarray(h), jnp.array([7, 2]))
  nxt = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (2, 1, 4)))
  got = np.asarray(conv.decode(jnp.asarray(nxt)))
  for b, n in enumerate((7, 2)):
    row = np.concatenate([h[b, :n], nxt[b]])
    want = row[-1] + sum(w[s] * row[-1 - s] for s in range(3) if n - s >= 0)
    np.testing.assert_allclose(got[b, 0], want, rtol=1e-6, atol=1e-6)


def _decode_pair(fn, shape, **options):
  """Flax's MultiHeadAttention in decode mode with `fn` and with Flax's own attention,
  the same parameters, caches made for `shape`."""
  make = lambda **extra: nnx.MultiHeadAttention(
    num_heads=2, in_features=3, qkv_features=6, decode=True, rngs=nnx.Rngs(0), **options, **extra
  )
  ours, theirs = make(attention_fn=fn), make()
  dtype = options.get("dtype") or jnp.float32
  ours.init_cache(shape, dtype=dtype)
  theirs.init_cache(shape, dtype=dtype)
  return ours, theirs


@pytest.mark.parametrize("shape", [(7, 3), (4, 3), (1, 4, 3), (1, 7, 3), (2, 5, 3), (2, 2, 5, 3)])
def test_make_attention_fn_decodes_every_shape_flax_decodes(shape):
  """No batch axis, one, or two; caches of 4 to 7 slots, three steps each, so a step
  weighs several keys by q.k while the slots not yet written are masked: every step's
  output and cache_index equal Flax's default attention's."""
  fn = ring_nn.make_attention_fn(mesh=make_mesh((2,), ("seq",)))
  ours, theirs = _decode_pair(fn, shape)
  x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
  for i in range(min(3, shape[-2])):
    a, b = ours(x[..., i : i + 1, :]), theirs(x[..., i : i + 1, :])
    assert a.shape == b.shape == (*shape[:-2], 1, 3)
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert int(ours.cache_index[...]) == int(theirs.cache_index[...]) == i + 1


def test_flax_linen_consistency_decode_grid():
  """The decode points of Flax's own TestLinenConsistency grid (tests/nnx/nn/
  attention_test.py: bias, dtype, param_dtype, precision, normalize_qk), unbatched,
  against Flax's default attention. Flax's grid decodes one token into a cache of one
  slot, where the softmax weight is 1 whatever q.k is; here three different tokens go
  into a cache of four slots (at each step the unwritten ones masked). Tolerance: the
  suite's 1e-5 in float32; with float16 computation, 1e-2 of the output's scale, a
  few of float16's ulps (2^-11) through the projections and the softmax."""
  fn = ring_nn.make_attention_fn(mesh=make_mesh((2,), ("seq",)))
  xs = jax.random.normal(jax.random.PRNGKey(4), (4, 3), jnp.float32)
  grid = itertools.product(
    [True, False],
    [jnp.float32, jnp.float16],
    [jnp.float32, jnp.float16],
    [jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST],
    [True, False],
  )
  points = 0
  for use_bias, dtype, param_dtype, precision, normalize_qk in grid:
    options = dict(
      use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, normalize_qk=normalize_qk
    )
    ours, theirs = _decode_pair(fn, xs.shape, out_features=6, **options)
    half = jnp.float16 in (dtype, param_dtype)
    for step in range(3):
      a, b = ours(xs[step : step + 1]), theirs(xs[step : step + 1])
      assert a.dtype == b.dtype, options
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      scale = float(np.abs(b).max())
      assert np.abs(a - b).max() <= (1e-2 if half else 1e-5) * max(scale, 1.0), (options, step)
    points += 1
  assert points == 48


def test_longrope_and_partial_rotary_follow_their_formula():
  """`RopeScaling("longrope")` with `apply_rope(rotary_dim=)` against the formula written
  out in NumPy (transformers' LongRoPE): inv_freq_i = 1 / (f_i base^(2i/R)) with f the
  short factors while the largest position + 1 <= original_max_position_embeddings and
  the long ones past it; cos and sin times the attention factor; pairs (i, i + R/2)
  among the first R dimensions, the others unchanged. Bad factors are refused by name."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, 10, 2, 12)).astype(np.float32)
  scaling = ring_nn.RopeScaling(
    "longrope", factors=(1.0, 1.5, 3.0, 4.0), long_factors=(2.0, 4.0, 8.0, 9.0),
    original_max_position_embeddings=8, attention_factor=1.3,
  )  # fmt: skip

  def expected(xs, positions):
    factors = np.array(scaling.long_factors if positions.max() + 1 > 8 else scaling.factors)
    inv = 1.0 / (factors * 500.0 ** (np.arange(0, 8, 2) / 8))
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[None, :, None] * 1.3, np.sin(ang)[None, :, None] * 1.3
    x1, x2 = xs[..., :4].astype(np.float64), xs[..., 4:8].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xs[..., 8:]], axis=-1)

  for positions in (np.arange(8), np.arange(10), np.arange(3, 11)):  # short, long, long
    xs = x[:, : len(positions)]
    got = ring_nn.apply_rope(xs, positions, 500.0, scaling=scaling, rotary_dim=8)
    assert rel_err(got, expected(xs, positions)) < 1e-6, positions
  short = ring_nn.apply_rope(x[:, :8], np.arange(8), 500.0, scaling=scaling, rotary_dim=8)
  shifted = ring_nn.apply_rope(x[:, :8], np.arange(3, 11), 500.0, scaling=scaling, rotary_dim=8)
  assert rel_err(short, shifted) > 1e-2  # the switch is taken: the long factors differ
  with pytest.raises(ValueError, match="long_factors"):
    ring_nn.RopeScaling("longrope", factors=(1.0, 2.0), long_factors=(1.0,))
  with pytest.raises(ValueError, match="long_factors are LongRoPE's"):
    ring_nn.RopeScaling("linear", factor=2.0, long_factors=(1.0,))
  with pytest.raises(ValueError, match="rotary_dim=7"):
    ring_nn.apply_rope(x, np.arange(10), 500.0, rotary_dim=7)
  with pytest.raises(ValueError, match="rope_dim=14"):
    ring_nn.RingAttention(2, 24, kind="dense", head_dim=12, rope_base=500.0, rope_dim=14, rngs=nnx.Rngs(0))


def test_a_window_wider_than_the_sequence_is_no_window(monkeypatch):
  """A causal window that reaches every earlier key (left >= T - 1) reaches the ring as
  no window at all (so cuDNN's kernel stays open to it), and the result is unchanged; a
  window that excludes keys is passed on."""
  mesh = make_mesh((2,), ("seq",))
  seen = []
  real = ring_nn.ring_attention

  def spy(*args, **kwargs):
    seen.append(kwargs["local_window_size"])
    return real(*args, **kwargs)

  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 16, 32)), jnp.float32)
  out = {}
  for left in (15, 400, 14):
    attn = ring_nn.RingAttention(
      4, 32, mesh=mesh, is_causal=True, local_window_size=(left, 0), rngs=nnx.Rngs(0)
    )
    monkeypatch.setattr(ring_nn, "ring_attention", spy)
    out[left] = np.asarray(attn(x))
  assert seen == [None, None, (14, 0)]
  dense = ring_nn.RingAttention(4, 32, kind="dense", is_causal=True, rngs=nnx.Rngs(0))
  assert rel_err(out[15], dense(x)) < 1e-5 and rel_err(out[400], out[15]) < 1e-7
  assert rel_err(out[14], out[15]) > 1e-4
