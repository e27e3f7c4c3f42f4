"""The Ulysses hybrid (`ulysses_axis`): all-to-all over one mesh axis, the ring over the
other. Every layout and mask against float64 on the meshes (u, seq) the issue names,
the shard_map entry point, the modules, the collectives in the compiled program and
the bytes they move."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, cut_segments, make_mesh, qkv, rel_err
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import layouts, reference_attention, ring_attention, ring_attention_shard
from jax_ring.hlo import collective_bytes

TOL = 1e-5
SMALL_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=16, kv_heads=1)
# N = 8 query heads over u = 8 devices at most; K = 2 kv heads: split when u = 2,
# repeated (r = u / 2) when u = 4 or 8. T and S differ and divide no mesh.
B, T, S, N, K, H = 2, 37, 53, 8, 2, 8
MESHES = [(2, 4), (4, 2), (8, 1), (1, 8), (2, 2)]


PAIR_IDS = (cut_segments(T, [9, 20]), cut_segments(S, [12, 30], pad_from=45))
CASES = {
  "contiguous": {
    "local_window_size": (5, 3),
    "segment_ids": PAIR_IDS,
    "key_value_seq_lengths": jnp.array([S, 11], jnp.int32),
  },
  "zigzag": {"is_causal": True, "segment_ids": PAIR_IDS, "query_seq_lengths": jnp.array([30, 0], jnp.int32)},
  "striped": {"is_causal": True, "local_window_size": 6},
}
REFERENCES = {
  name: functools.partial(reference_attention, return_residual=True, **options)
  for name, options in CASES.items()
}


def _mesh(shape):
  return make_mesh(shape, ("u", "seq"))


@pytest.mark.parametrize("layout", sorted(CASES))
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"u{s[0]}xseq{s[1]}")
def test_hybrid_matches_reference(shape, layout):
  """Cross-attention with GQA, ids, lengths, windows and padding: output, lse and
  gradients against float64 on every (ulysses, seq) mesh."""
  mesh = _mesh(shape)
  q, _, _ = qkv(B, T, N, K, H)
  _, k, v = qkv(B, S, N, K, H, seed=1)
  fn = lambda q, k, v: ring_attention(
    q,
    k,
    v,
    mesh=mesh,
    ulysses_axis="u",
    layout=layout,
    block_sizes=SMALL_BLOCKS,
    return_residual=True,
    **CASES[layout],
  )
  (out, lse), _ = compare_with_reference(fn, REFERENCES[layout], (q, k, v), TOL)
  chex.assert_shape([out, lse], [(B, T, N, H), (B, T, N)])


def test_hybrid_with_head_axis_and_bf16_policy():
  """Heads sharded over a head axis too (4 per shard, 2 per device after the
  all-to-all), in the bf16 policy: within bf16 rounding of the float64 reference."""
  mesh = make_mesh((2, 2, 2), ("heads", "u", "seq"))
  q, k, v = qkv(B, 64, N, 4, H)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, ulysses_axis="u", head_axis="heads", is_causal=True, policy="bfloat16"
  )
  got = fn(q, k, v)
  want = reference_attention(*(x.astype(jnp.float64) for x in (q, k, v)), is_causal=True)
  assert got.dtype == jnp.float32 and rel_err(got, want) < 1e-2  # the bf16 bound the README claims


def test_shard_entry_point_in_a_users_shard_map():
  """ring_attention_shard(ulysses_axis=) on pieces the caller laid out: each ring
  shard in zigzag order, split into consecutive pieces over u; ids and explicit
  positions are pieces too. Output pieces come back in the same order."""
  u, p = 2, 4
  mesh = _mesh((u, p))
  t = 64
  q, k, v = qkv(B, t, N, K, H)
  ids = cut_segments(t, [20, 41])
  order = np.asarray(layouts.positions("zigzag", p, t // p)).reshape(-1)  # device-major
  spec = P(None, ("seq", "u"))
  put = lambda x, *rest: jax.device_put(x[:, order], NamedSharding(mesh, P(None, ("seq", "u"), *rest)))

  def body(q, k, v, ids, pos):
    return ring_attention_shard(
      q,
      k,
      v,
      axis_name="seq",
      ulysses_axis="u",
      is_causal=True,
      segment_ids=ids,
      layout="zigzag",
      positions=pos,
      return_residual=True,
    )

  run = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(None, ("seq", "u"), None, None),) * 3 + (spec, P(("seq", "u"))),
      out_specs=(P(None, ("seq", "u"), None, None), spec),
    )
  )
  pos = jax.device_put(jnp.asarray(order, jnp.int32), NamedSharding(mesh, P(("seq", "u"))))
  out, lse = run(put(q, None, None), put(k, None, None), put(v, None, None), put(ids), pos)
  back = np.argsort(order)
  want, want_lse = reference_attention(
    *(x.astype(jnp.float64) for x in (q, k, v)), is_causal=True, segment_ids=ids, return_residual=True
  )
  assert rel_err(np.asarray(out)[:, back], want) < TOL
  assert rel_err(np.asarray(lse)[:, back], want_lse) < TOL


def _fwd(mesh, causal, t=256, heads=N, kv_heads=K, layout="auto"):
  q = jax.ShapeDtypeStruct((1, t, heads, H), jnp.float32)
  k = jax.ShapeDtypeStruct((1, t, kv_heads, H), jnp.float32)
  f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, ulysses_axis="u", is_causal=causal, layout=layout)
  return f, (q, k, k)


def _expected_forward_bytes(u, p, t, causal, heads=N, kv_heads=K, zigzag=True):
  """The README's formula, per device, float32 (4 bytes), B = 1: a = T H / (p u)
  values per head; K' = K r kv heads after `kv_repeat`."""
  ratio = heads // kv_heads
  kr = kv_heads * next(r for r in range(1, ratio + 1) if ratio % r == 0 and kv_heads * r % u == 0)
  a = t * H / (p * u)
  moved = {}
  if u > 1:
    moved["all-to-all"] = 4 * a * (2 * heads + 2 * kr)  # q, k, v in; the output back
  if p > 1:
    ring = (p - 1) * 4 * 2 * a * kr  # K and V, p - 1 steps
    if causal:  # positions travel with K/V
      ring += (p - 1) * 4 * t / p
    if causal and zigzag:  # q, k, v and the output relaid out
      ring += 4 * a * (2 * heads + 2 * kr)
    moved["collective-permute"] = ring
  return moved


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"u{s[0]}xseq{s[1]}")
def test_hlo_moves_what_the_formula_says(shape):
  """Forward: only all-to-all and collective-permute, with the bytes of the README's
  formula; forward+backward: still no other collective (no all-gather). Shards of 256
  tokens or less: "auto" keeps causal attention contiguous, so no relayout."""
  u, p = shape
  mesh = _mesh(shape)
  for causal, layout in ((False, "auto"), (True, "auto"), (True, "zigzag")):
    f, args = _fwd(mesh, causal, layout=layout)
    moved = collective_bytes(jax.jit(f).lower(*args).compile())
    want = _expected_forward_bytes(u, p, 256, causal, zigzag=layout == "zigzag")
    assert moved == pytest.approx(want), (causal, layout, moved)
  loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  both = collective_bytes(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile())
  assert set(both) <= {"all-to-all", "collective-permute"}, both
  if u > 1:  # the backward's all-to-alls mirror the forward's: dO in; dQ, dK, dV out
    assert both["all-to-all"] == pytest.approx(2 * _expected_forward_bytes(u, p, 256, True)["all-to-all"])


def test_per_device_traffic_falls_with_ulysses():
  """Same 8 devices, T and heads: the hybrid (2, 4) and pure Ulysses (8, 1) move fewer
  bytes per device than the pure ring (1, 8) with these MHA-sized K/V."""
  total = {}
  for shape in [(1, 8), (2, 4), (8, 1)]:
    f, args = _fwd(_mesh(shape), False, t=1024, heads=8, kv_heads=8)
    total[shape] = sum(collective_bytes(jax.jit(f).lower(*args).compile()).values())
  assert total[(8, 1)] < total[(2, 4)] < total[(1, 8)], total


def test_module_and_model_match_the_ring(monkeypatch):
  """RingAttention(ulysses_axis=) and DecoderLM(LMConfig(ulysses_axis=)) give the
  plain ring's outputs and gradients from the same parameters; generation works, and
  its cache, replicated over the Ulysses axis by design, draws no notice about it."""
  import warnings

  from jax_ring import _validation
  from jax_ring.models import DecoderLM, LMConfig, generate

  monkeypatch.setattr(_validation, "_NOTICED", set())
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh((2, 4), ("u", "seq"), axis_types=auto, devices=jax.devices()[:8])
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 32))
  make = lambda axis: jax_ring.nn.RingAttention(
    4, 32, num_kv_heads=2, mesh=mesh, is_causal=True, ulysses_axis=axis, rngs=nnx.Rngs(0)
  )
  hybrid, ring = make("u"), make(None)
  assert rel_err(hybrid(x), ring(x)) < TOL

  config = LMConfig(
    vocab_size=32, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_hidden=32, ulysses_axis="u"
  )
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, 32)
  models = {
    axis: DecoderLM(dataclasses.replace(config, ulysses_axis=axis), mesh=mesh, rngs=nnx.Rngs(0))
    for axis in ("u", None)
  }
  loss = lambda model: jnp.mean(model(tokens) ** 2)
  grads = {axis: nnx.jit(nnx.grad(loss))(model) for axis, model in models.items()}
  assert jax.tree.structure(grads["u"]) == jax.tree.structure(grads[None])
  for a, b in zip(jax.tree.leaves(grads["u"]), jax.tree.leaves(grads[None])):
    assert rel_err(a, b) < 1e-5  # measured at most 1.3e-7 (float32 against float32)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*mesh axis 'u'")
    outs = {"u": generate(models["u"], tokens[:, :8], max_new_tokens=2).tokens}
  with pytest.warns(UserWarning, match="jax_ring.KV cache: mesh axis 'u'"):  # the plain ring's model
    outs[None] = generate(models[None], tokens[:, :8], max_new_tokens=2).tokens
  np.testing.assert_array_equal(outs["u"], outs[None])


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"ulysses_axis": "u", "shape": (8, 3, 8)}, "num_heads=3 .* by the 2 devices of ulysses_axis='u'"),
    ({"ulysses_axis": "x"}, "ulysses_axis='x' is not an axis of the mesh"),
    ({"ulysses_axis": "seq"}, "must name different mesh axes"),
  ],
)
def test_errors(kwargs, message):
  mesh = _mesh((2, 4))
  t, n, h = kwargs.pop("shape", (8, 8, 8))
  q = jnp.zeros((1, t, n, h))
  with pytest.raises(ValueError, match=message):
    ring_attention(q, q, q, mesh=mesh, **kwargs)


def test_model_config_errors():
  from jax_ring.models import DecoderLM, LMConfig

  mesh = _mesh((4, 2))
  bad = {
    "num_heads=6 must be divisible by the 4 devices": dict(num_heads=6, num_kv_heads=2, dim=48),
    "needs attention 'ring' or 'local'": dict(attention="dilated"),
    "must be an axis of the mesh": dict(ulysses_axis="seq"),
  }
  for message, changes in bad.items():
    config = LMConfig(vocab_size=8, **{"dim": 32, "ulysses_axis": "u", **changes})
    with pytest.raises(ValueError, match=message):
      DecoderLM(config, mesh=mesh, rngs=nnx.Rngs(0))
