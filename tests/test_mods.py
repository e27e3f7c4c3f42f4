"""Score modifiers over the ring (soft-cap, ALiBi, sinks, score_mod, dropout): outputs
and gradients against the float64 reference on 1, 2, 3, 4 and 8 devices, in every
layout, with windows, segment ids, GQA and the Ulysses hybrid; dropout's keep
decisions the same on any device count and layout; sinks' gradient; the Pallas
kernel's refusal and "auto"'s fallback."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, padded_segments, qkv, rel_err

import jax_ring
from jax_ring import reference_attention, ring_attention

TOL = 1e-5
SMALL = jax_ring.BlockSizes(block_q=8, block_kv=16, kv_heads=1)  # several tiles and passes per call
N = 4
SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
SINKS = jnp.asarray([0.0, 1.5, -1.0, 3.0])


def _wave(s, q_pos, k_pos, head):
  """A score_mod that depends on everything it is given (a relative-position bias
  per head, nonlinear in s)."""
  return s + 0.3 * jnp.sin(0.2 * (q_pos - k_pos) + head) - 0.05 * s * s


MODIFIERS = {
  "soft_cap": dict(logit_soft_cap=1.5),
  "alibi": dict(alibi_slopes=SLOPES),
  "alibi_per_row": dict(alibi_slopes=jnp.stack([SLOPES, SLOPES[::-1]])),
  "sinks": dict(sinks=SINKS),
  "score_mod": dict(score_mod=_wave),
  "dropout": dict(dropout_rate=0.25, dropout_rng=jax.random.key(7)),
}
ALL = {k: v for case in MODIFIERS.values() for k, v in case.items()} | dict(alibi_slopes=SLOPES)


def _compare(devices, options, length=48, heads=N, kv_heads=2, batch=2, **ring_options):
  mesh = make_mesh((devices,), ("seq",))
  args = qkv(batch, length, heads, kv_heads, 16)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_sizes=SMALL, **ring_options, **options)
  ref_options = {k: v for k, v in ring_options.items() if k not in ("layout",)}
  ref = lambda q, k, v: reference_attention(q, k, v, **ref_options, **options)
  return compare_with_reference(fn, ref, args, TOL)


@pytest.mark.parametrize("devices", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(MODIFIERS))
def test_each_modifier_matches_reference(name, devices):
  _compare(devices, MODIFIERS[name], is_causal=True)


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_all_modifiers_together_match_reference(devices):
  """Every modifier at once, causal with segment ids (tiles skipped, masked and whole)."""
  seg = padded_segments(2, 48)
  _compare(devices, ALL, is_causal=True, segment_ids=seg)


@pytest.mark.parametrize("layout", ["contiguous", "striped", "zigzag"])
def test_layouts_and_windows(layout):
  _compare(4, ALL, is_causal=True, local_window_size=(9, 0), layout=layout, length=64)


def test_bidirectional_window_gqa_mqa():
  _compare(2, ALL, local_window_size=(5, 7), kv_heads=1)


def test_cross_attention_lengths():
  mesh = make_mesh((4,), ("seq",))
  q, _, _ = qkv(2, 40, N, 2, 16)
  _, k, v = qkv(2, 56, N, 2, 16, seed=1)
  lengths = jnp.asarray([40, 31]), jnp.asarray([50, 56])
  common = dict(is_causal=True, query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1], **ALL)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_sizes=SMALL, **common)
  ref = lambda q, k, v: reference_attention(q, k, v, **common)
  compare_with_reference(fn, ref, (q, k, v), TOL)


@pytest.mark.parametrize(
  "axes, names, extra",
  [
    ((2, 2, 2), ("data", "seq", "heads"), dict(batch_axis="data", head_axis="heads")),
    ((2, 4), ("seq", "u"), dict(ulysses_axis="u")),
  ],
  ids=["batch_heads_sharded", "ulysses"],
)
def test_heads_and_batch_sharded_and_ulysses(axes, names, extra):
  """Sharded heads, batch and the Ulysses hybrid: slopes, sinks, score_mod's head and
  dropout's (row, head) are the global ones."""
  seg = padded_segments(2, 64)
  mesh = make_mesh(axes, names)
  args = qkv(2, 64, 8, 4, 16)
  options = ALL | dict(alibi_slopes=jnp.linspace(0.05, 0.6, 8), sinks=jnp.linspace(-1, 2, 8))
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, block_sizes=SMALL, **extra, **options
  )
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=seg, **options)
  compare_with_reference(fn, ref, args, TOL)


def test_sinks_gradient_and_residual():
  """gpt-oss learns its sinks: their gradient equals the reference's; with
  return_residual the lse is the whole denominator's, sink included."""
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(2, 48, N, 2, 16)
  cot = jax.random.normal(jax.random.key(5), q.shape)

  def loss(attend, sinks, q, k, v):
    out, lse = attend(q, k, v, is_causal=True, sinks=sinks, return_residual=True)
    return jnp.sum(out * cot) + jnp.sum(jnp.sin(lse))

  ring = lambda *a, **kw: ring_attention(*a, mesh=mesh, block_sizes=SMALL, **kw)
  got = jax.jit(jax.grad(lambda s, *a: loss(ring, s, *a), argnums=(0, 1, 2, 3)))(SINKS, q, k, v)
  f64 = lambda x: x.astype(jnp.float64)
  want = jax.jit(jax.grad(lambda s, *a: loss(reference_attention, s, *a), argnums=(0, 1, 2, 3)))(
    f64(SINKS), f64(q), f64(k), f64(v)
  )
  assert len(got) == len(want) == 4
  for name, g, w in zip(("sinks", "q", "k", "v"), got, want):
    assert rel_err(g, w) < TOL, name
  # Independent of the code under test: lse = logaddexp(lse without sinks, sink).
  _, lse = ring(q, k, v, is_causal=True, sinks=SINKS, return_residual=True)
  _, plain = reference_attention(f64(q), f64(k), f64(v), is_causal=True, return_residual=True)
  assert rel_err(lse, jnp.logaddexp(plain, f64(SINKS))) < TOL


def _dropped_weights(devices, layout, batch=2, length=48, rate=0.4, key=11):
  """With V the identity (one value per key position, head dim = length), the output
  is the dropped weight matrix itself."""
  mesh = make_mesh((devices,), ("seq",))
  q, k, _ = qkv(batch, length, N, 2, length)
  v = jnp.broadcast_to(jnp.eye(length, dtype=q.dtype)[None, :, None, :], (batch, length, 2, length))
  drop = dict(dropout_rate=rate, dropout_rng=jax.random.key(key))
  out = ring_attention(q, k, v, mesh=mesh, is_causal=True, layout=layout, block_sizes=SMALL, **drop)
  return np.asarray(out), (q, k)


def test_dropout_same_on_every_device_count_and_layout():
  first, _ = _dropped_weights(1, "contiguous")
  for devices, layout in ((2, "striped"), (3, "contiguous"), (4, "zigzag"), (8, "zigzag"), (8, "striped")):
    got, _ = _dropped_weights(devices, layout)
    np.testing.assert_allclose(got, first, atol=2e-6, err_msg=f"{devices} devices, {layout}")


def test_dropout_keeps_one_minus_rate_scaled():
  """Each weight is 0 or the undropped softmax weight / (1 - rate), kept with
  probability 1 - rate; another key keeps others."""
  rate = 0.4
  dropped, (q, k) = _dropped_weights(4, "zigzag", batch=2, length=48, rate=rate)
  identity = jnp.broadcast_to(jnp.eye(48, dtype=q.dtype)[None, :, None, :], (2, 48, 2, 48))
  weights = jax.nn.dot_product_attention(q, k, identity, is_causal=True)
  weights = np.asarray(weights)  # [B, T, N, S]: the softmax weights, no dropout
  visible = np.tril(np.ones((48, 48), bool))[None, :, None, :] & np.ones(weights.shape, bool)
  kept = np.abs(dropped) > 0
  assert not kept[~visible].any()
  np.testing.assert_allclose(dropped[kept], weights[kept] / (1 - rate), rtol=1e-4)
  fraction = kept[visible].mean()
  count = visible.sum()  # 2 * 4 * 1176 weights: the fraction's standard error is about 0.005
  assert abs(fraction - (1 - rate)) < 4 * np.sqrt(rate * (1 - rate) / count), fraction
  other, _ = _dropped_weights(4, "zigzag", batch=2, length=48, rate=rate, key=12)
  assert 0.3 < np.mean(kept[visible] != (np.abs(other) > 0)[visible]) < 0.7


def test_dropout_gradient_recomputes_the_mask():
  _compare(4, MODIFIERS["dropout"], is_causal=True, segment_ids=padded_segments(2, 48))


def test_pallas_refuses_and_auto_falls_back(monkeypatch, caplog):
  """kernel="pallas" with a modifier the kernels lack is a ValueError naming it; "auto"
  where the Pallas kernel would run (the platform reported as a GPU; the program still
  lowers for this CPU) runs the XLA tiles, logged, exactly. Sinks need nothing of the
  kernel: the Pallas kernel runs with them."""
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(1, 64, N, 2, 16)
  with pytest.raises(ValueError, match="do not apply logit_soft_cap, score_mod"):
    ring_attention(q, k, v, mesh=mesh, kernel="pallas", logit_soft_cap=5.0, score_mod=_wave)
  monkeypatch.setattr(jax_ring._attention, "mesh_platform", lambda: "gpu")
  jax.clear_caches()  # read while tracing
  seq = jax.sharding.PartitionSpec(None, "seq")

  def inner(q, k, v):
    return jax_ring.ring_attention_shard(
      q, k, v, axis_name="seq", is_causal=True, layout="contiguous", logit_soft_cap=1.5, sinks=SINKS
    )

  shard = jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq, check_vma=False)
  sharded = jax.jit(lambda *a: shard(*(jax.reshard(x, jax.NamedSharding(mesh, seq)) for x in a)))
  with caplog.at_level(logging.INFO, logger="jax_ring"):
    got = sharded(q, k, v)
  assert any("do not apply logit_soft_cap" in r.getMessage() for r in caplog.records)
  assert "jax_ring_forward" not in str(jax.make_jaxpr(sharded)(q, k, v))
  f64 = lambda x: x.astype(jnp.float64)
  want = reference_attention(f64(q), f64(k), f64(v), is_causal=True, logit_soft_cap=1.5, sinks=SINKS)
  assert rel_err(got, want) < TOL
  monkeypatch.undo()
  got = ring_attention(q, k, v, mesh=mesh, kernel="pallas", sinks=SINKS, is_causal=True)
  assert rel_err(got, reference_attention(f64(q), f64(k), f64(v), sinks=SINKS, is_causal=True)) < TOL


@pytest.mark.parametrize(
  "options, error",
  [
    (dict(logit_soft_cap=0.0), "logit_soft_cap=0.0 must be a positive"),
    (dict(logit_soft_cap="50"), "logit_soft_cap='50' must be a positive float"),
    (dict(sinks=jnp.zeros(3)), r"sinks shape=\(3,\)"),
    (dict(alibi_slopes=jnp.zeros((3, N))), r"alibi_slopes shape=\(3, 4\)"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), "dropout_rate=1.0 must be in"),
    (dict(dropout_rate=0.1), "needs dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=3), "dropout_rng=3 must be a PRNG key"),
    (dict(score_mod=3), "score_mod=3 must be a function"),
  ],
)
def test_bad_modifiers_are_named(options, error):
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(2, 16, N, 2, 16)
  with pytest.raises((ValueError, TypeError), match=error):
    ring_attention(q, k, v, mesh=mesh, **options)


# Models: a Gemma-2-style DecoderLM (logits soft-capped at 50, sliding-window layers
# alternating with global ones) and a gpt-oss-style one (learned sinks, alternating
# windows, attention dropout in training): ring on 8 devices equals dense on 1.
GEMMA2 = dict(logit_soft_cap=50.0, window=5, global_every=2)
GPT_OSS = dict(attention_sinks=True, window=5, global_every=2, attention_dropout=0.2)


def _models(config):
  from flax import nnx

  from jax_ring.models import DecoderLM, LMConfig

  cfg = LMConfig(vocab_size=37, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=64, **config)
  mesh = make_mesh((8,), ("seq",))
  ring = DecoderLM(dataclasses.replace(cfg, attention="ring"), mesh=mesh, rngs=nnx.Rngs(0, dropout=3))
  dense = DecoderLM(dataclasses.replace(cfg, attention="dense"), rngs=nnx.Rngs(0, dropout=3))
  for model in (ring, dense):  # sinks away from their zero start, the same in both
    for i, block in enumerate(model.blocks):
      if block.attn.sinks is not None:
        block.attn.sinks[...] = jnp.linspace(-1.0, 2.0, 4, dtype=jnp.float32) + i
  return ring, dense


@pytest.mark.parametrize("config", [GEMMA2, GPT_OSS], ids=["gemma2", "gpt_oss"])
def test_model_training_step_ring_equals_dense(config):
  from flax import nnx

  ring, dense = _models(config)
  tokens = np.random.default_rng(0).integers(0, 37, (2, 40)).astype(np.int32)

  def loss(model):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

  step = nnx.jit(nnx.value_and_grad(loss))
  (got, grads), (want, want_grads) = step(ring), step(dense)
  assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))
  flat = lambda g: jax.tree.leaves(nnx.state(g, nnx.Param))
  assert jax.tree.structure(nnx.state(grads, nnx.Param)) == jax.tree.structure(
    nnx.state(want_grads, nnx.Param)
  )
  assert len(flat(grads)) > 0
  for g, w in zip(flat(grads), flat(want_grads)):
    assert rel_err(g, w) < 1e-5  # measured at most 1.3e-6 over the configs (float32 against float32)
  if config.get("attention_sinks"):
    sinks = [
      g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "sinks" in jax.tree_util.keystr(path)
    ]
    assert len(sinks) == 2 and all(float(jnp.max(jnp.abs(g))) > 0 for g in sinks)


@pytest.mark.parametrize("config", [GEMMA2, GPT_OSS], ids=["gemma2", "gpt_oss"])
def test_model_cached_decoding_ring_equals_dense(config):
  from flax import nnx

  ring, dense = _models(config)
  ring.eval()
  dense.eval()
  tokens = np.random.default_rng(1).integers(0, 37, (2, 20)).astype(np.int32)
  full = np.asarray(nnx.jit(lambda m, t: m(t))(dense, tokens))
  ring.init_cache(2, 24)
  got = [np.asarray(nnx.jit(lambda m, t: m.prefill(t))(ring, tokens[:, :14]))]
  decode = nnx.jit(lambda m, t: m.decode(t))
  for i in range(14, 20, 2):
    got.append(np.asarray(decode(ring, tokens[:, i : i + 2])))
  np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=2e-5)


def test_flax_multi_head_attention_dropout_and_modifiers():
  """make_attention_fn in nnx.MultiHeadAttention: training with dropout uses the key
  Flax passes (shared over rows and heads, Flax's broadcast_dropout) exactly as the
  reference does with it; eval() drops nothing; the factory's soft-cap and sinks apply."""
  from flax import nnx

  mesh = make_mesh((4,), ("seq",))
  mods = dict(logit_soft_cap=2.0, sinks=SINKS)
  seen = {}

  def reference_fn(query, key, value, *, dropout_rng=None, dropout_rate=0.0, deterministic=True, **_):
    drop = {}
    if dropout_rate > 0 and not deterministic:
      seen["rng"] = dropout_rng
      drop = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng, dropout_broadcast=True)
    return reference_attention(query, key, value, is_causal=True, **mods, **drop)

  def build(attention_fn):
    return nnx.MultiHeadAttention(
      N,
      32,
      qkv_features=64,
      dropout_rate=0.3,
      attention_fn=attention_fn,
      decode=False,
      deterministic=False,
      rngs=nnx.Rngs(0, dropout=5),
    )

  ring = build(jax_ring.nn.make_attention_fn(mesh=mesh, is_causal=True, **mods))
  ref = build(reference_fn)
  x = jax.random.normal(jax.random.key(2), (2, 40, 32))
  got, want = ring(x), ref(x)
  assert "rng" in seen and rel_err(got, want) < TOL
  ring.eval()
  ref.eval()
  no_drop = ring(x)
  assert rel_err(no_drop, ref(x)) < TOL and rel_err(no_drop, got) > 1e-2


@pytest.mark.parametrize(
  "axes, names, extra, heads, per_row",
  [
    ((4,), ("seq",), {}, N, False),
    ((2, 2, 2), ("data", "seq", "heads"), dict(batch_axis="data", head_axis="heads"), 8, True),
    ((2, 4), ("seq", "u"), dict(ulysses_axis="u"), 8, True),
  ],
  ids=["ring", "batch_heads_sharded", "ulysses"],
)
def test_alibi_slopes_gradient(axes, names, extra, heads, per_row):
  """ALiBi slopes are differentiable (a model may learn them): their gradient, per head
  or per (row, head), equals the reference's, with heads sharded and under Ulysses."""
  seg = padded_segments(2, 48)
  mesh = make_mesh(axes, names)
  q, k, v = qkv(2, 48, heads, heads // 2, 16)
  cot = jax.random.normal(jax.random.key(4), q.shape)
  common = dict(is_causal=True, segment_ids=seg, logit_soft_cap=3.0, score_mod=_wave)
  slopes = jnp.linspace(0.05, 0.5, 2 * heads).reshape(2, heads) if per_row else jnp.linspace(0.05, 0.5, heads)
  ring = lambda s: jnp.sum(
    ring_attention(q, k, v, mesh=mesh, block_sizes=SMALL, alibi_slopes=s, **extra, **common) * cot
  )
  f64 = lambda x: x.astype(jnp.float64)
  ref = lambda s: jnp.sum(reference_attention(f64(q), f64(k), f64(v), alibi_slopes=s, **common) * cot)
  assert rel_err(jax.jit(jax.grad(ring))(slopes), jax.jit(jax.grad(ref))(f64(slopes))) < TOL


def test_differentiating_a_score_mod_closure_is_refused():
  """Arrays a score_mod closes over get no gradient: asking for one raises JAX's
  CustomVJPException, never a silent zero."""
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(1, 32, N, 2, 16)
  loss = lambda w: ring_attention(q, k, v, mesh=mesh, score_mod=lambda s, i, j, h: s + w * (i - j)).sum()
  with pytest.raises(Exception, match="with respect to a closed-over value"):
    jax.grad(loss)(0.5)


# --- References written out by hand, sharing no code with jax_ring._mods. ---


def _by_hand(q, k, v, *, cap=None, slopes=None, mod=None, sinks=None):
  """Causal attention in float64 NumPy with each modifier as its paper writes it:
  c * tanh(s / c) (Gemma 2), s - slope * |i - j| (ALiBi), a score_mod on the explicit
  [T, S] score matrix, and a sink's exp(sink) in every row's denominator (gpt-oss)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  group = n // k.shape[2]
  out = np.zeros((b, t, n, h))
  i, j = np.arange(t)[:, None], np.arange(t)[None]
  for bi in range(b):
    for head in range(n):
      s = q[bi, :, head] @ k[bi, :, head // group].T / np.sqrt(h)
      if cap is not None:
        s = cap * np.tanh(s / cap)
      if slopes is not None:
        s = s - float(slopes[head]) * np.abs(i - j)
      if mod is not None:
        s = np.asarray(mod(jnp.asarray(s), jnp.asarray(i), jnp.asarray(j), head), np.float64)
      s = np.where(j <= i, s, -np.inf)
      top = s.max(-1, keepdims=True)
      weights = np.exp(s - top)
      denominator = weights.sum(-1, keepdims=True)
      if sinks is not None:
        denominator = denominator + np.exp(float(sinks[head]) - top)
      out[bi, :, head] = (weights / denominator) @ v[bi, :, head // group]
  return out


HAND = {
  "soft_cap": (dict(logit_soft_cap=1.5), dict(cap=1.5)),
  "alibi": (dict(alibi_slopes=SLOPES), dict(slopes=SLOPES)),
  "score_mod": (dict(score_mod=_wave), dict(mod=_wave)),
  "sinks": (dict(sinks=SINKS), dict(sinks=SINKS)),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_each_modifier_against_a_reference_written_by_hand(name):
  """The ring on 4 devices against `_by_hand`, not against `reference_attention`, which
  applies the modifiers through the same `_mods` code as the ring."""
  ring_options, hand_options = HAND[name]
  q, k, v = qkv(2, 40, N, 2, 16)
  mesh = make_mesh((4,), ("seq",))
  out = ring_attention(q, k, v, mesh=mesh, is_causal=True, block_sizes=SMALL, **ring_options)
  want = _by_hand(q, k, v, **hand_options)
  assert rel_err(out, want) < TOL
  assert rel_err(_by_hand(q, k, v), want) > 1e-3  # the modifier matters at this scale


def test_alibi_slopes_are_the_papers():
  """Press et al. 2022: for 8 heads 1/2, 1/4, ..., 1/256; for a head count that is not a
  power of two, as the authors' code makes them, 12 heads: the 8 heads' slopes, then
  every other slope of 16 heads' sequence (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5)."""
  eight = [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
  np.testing.assert_allclose(jax_ring.alibi_slopes(8), eight, rtol=1e-6)
  twelve = eight + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
  np.testing.assert_allclose(jax_ring.alibi_slopes(12), twelve, rtol=1e-6)


# The parameter a modifier's gradient also reaches, by its ring and by-hand names.
HAND_PARAMETER = {"alibi": ("alibi_slopes", "slopes"), "sinks": ("sinks", "sinks")}


@pytest.mark.parametrize("name", sorted(HAND))
def test_each_modifier_gradient_against_a_finite_difference_by_hand(name):
  """The ring's gradients of sum(w * out) (q, k, v, and the slopes or sinks where the
  modifier has them) along random directions, against a central difference of
  `_by_hand` in float64: no code shared with `jax_ring._mods` or the reference."""
  ring_options, hand_options = HAND[name]
  q, k, v = qkv(1, 24, N, 2, 16)
  w = np.random.default_rng(3).standard_normal(q.shape)
  mesh = make_mesh((4,), ("seq",))
  ring_name, hand_name = HAND_PARAMETER.get(name, (None, None))
  inputs = [np.asarray(x, np.float64) for x in (q, k, v)]
  if ring_name is not None:
    inputs.append(np.asarray(ring_options[ring_name], np.float64))

  def ring_loss(*xs):
    options = dict(ring_options)
    if ring_name is not None:
      options[ring_name] = xs[3]
    out = ring_attention(*xs[:3], mesh=mesh, is_causal=True, block_sizes=SMALL, **options)
    return jnp.sum(w.astype(np.float32) * out)

  def hand_loss(*xs):
    options = dict(hand_options)
    if hand_name is not None:
      options[hand_name] = xs[3]
    return float(np.sum(w * _by_hand(*xs[:3], **options)))

  f32 = [jnp.asarray(x, jnp.float32) for x in inputs]
  grads = [np.asarray(g, np.float64) for g in jax.grad(ring_loss, argnums=tuple(range(len(f32))))(*f32)]
  rng = np.random.default_rng(4)
  eps = 1e-5
  for _ in range(3):
    directions = [rng.standard_normal(x.shape) for x in inputs]
    plus = hand_loss(*(x + eps * d for x, d in zip(inputs, directions, strict=True)))
    minus = hand_loss(*(x - eps * d for x, d in zip(inputs, directions, strict=True)))
    difference = (plus - minus) / (2 * eps)
    analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, directions, strict=True))
    scale = sum(float(np.sum(np.abs(g * d))) for g, d in zip(grads, directions, strict=True))
    assert abs(analytic - difference) < 1e-4 * scale, (analytic, difference, scale)


def test_dropout_gradient_against_a_finite_difference_of_its_forward():
  """Dropout's keep decisions are a function of the key (checked above on every device
  count and layout); its backward must differentiate the forward it ran: the ring's
  gradient along random directions against a central difference of the ring's own
  forward with the same key (float32, so a looser bound)."""
  q, k, v = qkv(1, 24, N, 2, 16)
  w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
  mesh = make_mesh((4,), ("seq",))
  options = MODIFIERS["dropout"]
  loss = jax.jit(
    lambda q, k, v: jnp.sum(
      w * ring_attention(q, k, v, mesh=mesh, is_causal=True, block_sizes=SMALL, **options)
    )
  )
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  rng = np.random.default_rng(5)
  eps = 1e-2
  for _ in range(3):
    directions = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v)]
    plus, minus = (
      float(loss(*(x + sign * eps * d for x, d in zip((q, k, v), directions, strict=True))))
      for sign in (1, -1)
    )
    difference = (plus - minus) / (2 * eps)
    analytic = sum(float(jnp.sum(g * d)) for g, d in zip(grads, directions, strict=True))
    scale = sum(float(jnp.sum(jnp.abs(g * d))) for g, d in zip(grads, directions, strict=True))
    assert abs(analytic - difference) < 2e-3 * scale, (analytic, difference, scale)
