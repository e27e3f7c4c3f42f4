"""Qwen3-MoE and Mixtral: small random checkpoints written here as transformers writes
them (one tensor per expert), loaded and compared with the float64 NumPy forward of
tests/numpy_models.py (which shares no code with the loader); the router's choices
against NumPy's, ties included; the ring over 1, 2, 4 and 8 devices against dense,
forward and gradients; saving back; bad configs refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from numpy_models import llama_logits, moe_choices
from safetensors.numpy import load_file, save_file

from jax_ring import models
from jax_ring.models.architectures import decoder, moe

F64_TOL, RING_TOL = 1e-6, 1e-5
EXPERTS, TOP_K = 8, 2


def _config(arch):
  common = dict(
    vocab_size=128,
    hidden_size=64,
    num_experts_per_tok=TOP_K,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    hidden_act="silu",
    attention_dropout=0.0,
    output_router_logits=False,
    tie_word_embeddings=False,
    torch_dtype="float32",
    bos_token_id=0,
    eos_token_id=1,
  )
  if arch == "mixtral":
    return common | dict(
      model_type="mixtral",
      architectures=["MixtralForCausalLM"],
      intermediate_size=32,  # each expert's
      num_local_experts=EXPERTS,
      num_hidden_layers=2,
      rms_norm_eps=1e-5,
      sliding_window=None,
      router_aux_loss_coef=0.02,
      router_jitter_noise=0.0,
    )
  return common | dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=EXPERTS,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],  # layer 1 keeps a dense MLP
    num_hidden_layers=3,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=3,
    router_aux_loss_coef=0.001,
  )


def _weights(arch, config, seed=0):
  rng = np.random.default_rng(seed)
  d, n, kv, h = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
  w = lambda *shape, s=0.15: (rng.standard_normal(shape) * s).astype(np.float32)
  out = {"model.embed_tokens.weight": w(config["vocab_size"], d, s=1.0), "model.norm.weight": 1 + w(d)}
  out["lm_head.weight"] = w(config["vocab_size"], d)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out |= {
      p + "input_layernorm.weight": 1 + w(d),
      p + "post_attention_layernorm.weight": 1 + w(d),
      p + "self_attn.q_proj.weight": w(n * h, d),
      p + "self_attn.k_proj.weight": w(kv * h, d),
      p + "self_attn.v_proj.weight": w(kv * h, d),
      p + "self_attn.o_proj.weight": w(d, n * h),
    }
    if arch == "mixtral":  # w1 gate, w3 up, w2 down
      f = config["intermediate_size"]
      out[p + "block_sparse_moe.gate.weight"] = w(EXPERTS, d, s=1.0)
      for j in range(EXPERTS):
        q = p + f"block_sparse_moe.experts.{j}."
        out |= {q + "w1.weight": w(f, d), q + "w3.weight": w(f, d), q + "w2.weight": w(d, f)}
      continue
    out |= {p + "self_attn.q_norm.weight": 1 + w(h), p + "self_attn.k_norm.weight": 1 + w(h)}
    if i in config["mlp_only_layers"]:
      m = config["intermediate_size"]
      out |= {p + "mlp.gate_proj.weight": w(m, d), p + "mlp.up_proj.weight": w(m, d)}
      out[p + "mlp.down_proj.weight"] = w(d, m)
      continue
    f = config["moe_intermediate_size"]
    out[p + "mlp.gate.weight"] = w(EXPERTS, d, s=1.0)
    for j in range(EXPERTS):
      q = p + f"mlp.experts.{j}."
      out |= {q + "gate_proj.weight": w(f, d), q + "up_proj.weight": w(f, d), q + "down_proj.weight": w(d, f)}
  return out


ARCHS = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
  arch = request.param
  folder = tmp_path_factory.mktemp(arch)
  config = _config(arch)
  weights = _weights(arch, config)
  (folder / "config.json").write_text(json.dumps(config))
  save_file(weights, str(folder / "model.safetensors"))
  return folder, config, weights


def _tokens(length, seed=1, batch=2):
  return np.random.default_rng(seed).integers(0, 128, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("length", [40, 64])
def test_loaded_logits_equal_the_numpy_forward(checkpoint, length):
  folder, config, weights = checkpoint
  model, _ = models.load(folder, attention="dense")
  qwen = config["model_type"] == "qwen3_moe"
  assert isinstance(model, models.Qwen3Moe if qwen else models.Mixtral)
  assert model.config.num_experts == EXPERTS and model.config.num_experts_per_tok == TOP_K
  tokens = _tokens(length)
  got = np.asarray(model(jnp.asarray(tokens)))
  for b in range(tokens.shape[0]):
    want = llama_logits(weights, config, tokens[b], qk_norm=qwen)
    assert rel_err(got[b], want) < F64_TOL


def test_router_choices_equal_numpys_ties_to_the_lower_expert():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((50, 16)).astype(np.float32)
  router = rng.standard_normal((EXPERTS, 16)).astype(np.float32)
  router[5] = router[2]  # experts 2 and 5 tie for every token
  router[7] = router[2]
  config = dict(num_experts_per_tok=3, norm_topk_prob=True)
  weights, experts, _ = moe.route(jnp.asarray(x), jnp.asarray(router.T), 3, True)
  want_experts, want_weights = moe_choices(x.astype(np.float64), router.astype(np.float64), config)
  np.testing.assert_array_equal(np.asarray(experts), want_experts)
  np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5)
  tied = np.asarray(experts)[np.isin(np.asarray(experts), [2, 5, 7]).any(-1)]
  for row in tied:  # where they are chosen, 2 before 5 before 7
    picked = [e for e in row if e in (2, 5, 7)]
    assert picked == sorted(picked)


def test_experts_as_grouped_products_equal_every_expert_dense():
  """`run_experts` (ragged_dot over tokens sorted by expert) against each token's
  experts computed one by one, in float64."""
  rng = np.random.default_rng(4)
  n, d, f = 37, 8, 6
  x = rng.standard_normal((n, d))
  gate, up, down = (rng.standard_normal(s) for s in ((EXPERTS, d, f), (EXPERTS, d, f), (EXPERTS, f, d)))
  experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)])
  experts[:10] = [3, 4]  # a crowded expert pair; some experts get no token
  weights = rng.random((n, TOP_K))
  with jax.enable_x64():
    got = np.asarray(moe.run_experts(*(jnp.asarray(a) for a in (x, weights, experts, gate, up, down))))
  silu = lambda z: z / (1 + np.exp(-z))
  want = np.zeros_like(x)
  for t in range(n):
    for e, wt in zip(experts[t], weights[t]):
      want[t] += wt * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _first_pairs_reference(x, weights, experts, gate, up, down, most, groups):
  """(outputs, dropped pairs) in float64, token by token: x's tokens in `groups` equal
  groups in order, each expert of a group taking its first `most` pairs."""
  silu = lambda z: z / (1 + np.exp(-z))
  want, dropped, n = np.zeros_like(x), 0, len(x) // groups
  for g in range(groups):
    taken = np.zeros(EXPERTS, int)
    for t in range(g * n, (g + 1) * n):
      for e, wt in zip(experts[t], weights[t]):
        taken[e] += 1
        if taken[e] > most:
          dropped += 1
          continue
        want[t] += wt * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
  return want, dropped


def test_capacity_keeps_each_experts_first_tokens():
  """`run_experts_with_capacity` against each expert taking the first C tokens that
  chose it, in token order, computed one by one in float64; the dropped pairs
  counted. With C = N (nothing can drop) it equals `run_experts`, gradients too."""
  rng = np.random.default_rng(5)
  n, d, f, most = 37, 8, 6, 4
  x = rng.standard_normal((n, d))
  gate, up, down = (rng.standard_normal(s) for s in ((EXPERTS, d, f), (EXPERTS, d, f), (EXPERTS, f, d)))
  experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)])
  experts[:10] = [3, 4]  # experts 3 and 4 overflow
  weights = rng.random((n, TOP_K))
  want, dropped = _first_pairs_reference(x, weights, experts, gate, up, down, most, groups=1)
  args = lambda: [jnp.asarray(a) for a in (x, weights, experts, gate, up, down)]
  with jax.enable_x64():
    got, count = moe.run_experts_with_capacity(*args(), most)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    assert (
      int(count) == dropped == np.maximum(np.bincount(experts.ravel(), minlength=EXPERTS) - most, 0).sum() > 0
    )
    a = args()
    capped = lambda x, gate, down: jnp.sum(
      jnp.sin(moe.run_experts_with_capacity(x, a[1], a[2], gate, a[4], down, n)[0])
    )
    plain = lambda x, gate, down: jnp.sum(jnp.sin(moe.run_experts(x, a[1], a[2], gate, a[4], down)))
    for g, h in zip(
      jax.grad(capped, (0, 1, 2))(a[0], a[3], a[5]), jax.grad(plain, (0, 1, 2))(a[0], a[3], a[5])
    ):
      np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-12, atol=1e-12)
  assert (
    moe.capacity(37, 2, 8, 1.0) == 10
    and moe.capacity(37, 2, 8, 100.0) == 37
    and moe.capacity(3, 1, 8, 0.1) == 1
  )


def test_slot_pieces_cover_the_slots_in_order():
  """`moe.slot_pieces`: contiguous ranges from 0 to the capacity, sizes within one of
  each other, no more pieces than slots."""
  for capacity in (1, 2, 5, 8, 320):
    for pieces in (1, 2, 3, 4, 9):
      ranges = moe.slot_pieces(capacity, pieces)
      assert len(ranges) == min(pieces, capacity), (capacity, pieces, ranges)
      assert ranges[0][0] == 0 and ranges[-1][1] == capacity
      assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
      sizes = [hi - lo for lo, hi in ranges]
      assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, ranges


@pytest.mark.parametrize("devices", [2, 4])
def test_expert_parallel_pieces_equal_each_group_computed_alone(devices):
  """Expert parallelism in pieces of the slots (`run_experts_with_capacity(...,
  axis=, pieces=)`): each device's group against its tokens computed one by one in
  float64 with all experts and its experts' first C pairs, for 1, 2, 3 pieces and more
  pieces than slots; two all-to-alls a piece; the gradients of every piece count
  equal one piece's."""
  rng = np.random.default_rng(11)
  n, d, f, most = 12, 8, 6, 3  # tokens a device
  x = rng.standard_normal((devices * n, d))
  gate, up, down = (rng.standard_normal(s) for s in ((EXPERTS, d, f), (EXPERTS, d, f), (EXPERTS, f, d)))
  experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(devices * n)])
  experts[:n:2] = [1, 6]  # device 0 overflows experts 1 and 6
  weights = rng.random((devices * n, TOP_K))
  want, dropped = _first_pairs_reference(x, weights, experts, gate, up, down, most, groups=devices)
  mesh = make_mesh((devices,), ("seq",))
  mesh = mesh.update(axis_types=(jax.sharding.AxisType.Auto,))
  split, rows = jax.sharding.PartitionSpec("seq"), jax.sharding.PartitionSpec("seq")
  with jax.enable_x64():
    args = [jnp.asarray(a) for a in (x, weights, experts, gate, up, down)]

    def run(pieces):
      def local(x, w, e, gate, up, down):
        y, count = moe.run_experts_with_capacity(x, w, e, gate, up, down, most, axis="seq", pieces=pieces)
        return y, jax.lax.psum(count, "seq")

      return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, split, split, split),
        out_specs=(rows, jax.sharding.PartitionSpec()),
      )

    grads = []
    for pieces in (1, 2, 3, most + 5):
      y, count = jax.jit(run(pieces))(*args)
      np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)
      assert int(count) == dropped > 0
      program = str(jax.make_jaxpr(run(pieces))(*args))
      assert program.count("all_to_all") == 2 * min(pieces, most), pieces
      loss = lambda x, gate, down, p=pieces: jnp.sum(
        jnp.sin(run(p)(x, args[1], args[2], gate, args[4], down)[0])
      )
      grads.append(jax.jit(jax.grad(loss, (0, 1, 2)))(args[0], args[3], args[5]))
    for other in grads[1:]:
      for g, h in zip(other, grads[0]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_each_device_is_a_group_and_drops_count_over_all(devices):
  """An MoE layer with a capacity over a mesh: each device's tokens are a group of
  their own (its output is the layer's on those tokens alone), and the dropped pairs
  counted are every group's, from NumPy's router choices."""
  mesh = make_mesh((devices,), ("seq",))
  d, t, factor = 16, 64, 0.5
  layer = moe.MoE(
    d,
    8,
    EXPERTS,
    TOP_K,
    normalize=True,
    capacity_factor=factor,
    placement=(mesh, "seq", None),
    rngs=nnx.Rngs(2),
  )
  x = np.random.default_rng(6).standard_normal((2, t, d)).astype(np.float32)
  got = np.asarray(layer(jnp.asarray(x)))
  total = int(layer.dropped[...])
  alone = moe.MoE(d, 8, EXPERTS, TOP_K, normalize=True, capacity_factor=factor, rngs=nnx.Rngs(2))
  router = np.asarray(layer.router.kernel[...], np.float64)
  want, per = 0, t // devices
  for i in range(devices):
    group = x[:, i * per : (i + 1) * per]
    np.testing.assert_allclose(
      got[:, i * per : (i + 1) * per], np.asarray(alone(jnp.asarray(group))), rtol=1e-5, atol=1e-6
    )
    chosen, _ = moe_choices(
      group.reshape(-1, d).astype(np.float64), router.T, dict(num_experts_per_tok=TOP_K)
    )
    most = moe.capacity(2 * per, TOP_K, EXPERTS, factor)
    want += np.maximum(np.bincount(chosen.ravel(), minlength=EXPERTS) - most, 0).sum()
  assert total == want > 0


def test_capacity_logits_equal_the_numpy_forward(checkpoint):
  """A loaded model with a capacity factor (`moe.set_capacity`) on one device: the
  float64 NumPy forward with each expert taking its first C tokens; None again gives
  the dropless logits."""
  folder, config, weights = checkpoint
  model, _ = models.load(folder, attention="dense")
  tokens = _tokens(40, batch=1)  # one row: a group is the call's 40 tokens
  dropless = np.asarray(model(jnp.asarray(tokens)))
  assert moe.set_capacity(model, 0.5) == sum(hasattr(b.mlp, "router") for b in model.blocks)
  got = np.asarray(model(jnp.asarray(tokens)))
  qwen = config["model_type"] == "qwen3_moe"
  want = llama_logits(weights, config | {"capacity_factor": 0.5}, tokens[0], qk_norm=qwen)
  assert rel_err(got[0], want) < F64_TOL
  assert rel_err(dropless[0], want) > 1e-3  # tokens were dropped
  assert int(moe.dropped_tokens(model)) > 0
  # Traced with the model closed over, the call cannot set its count: it still runs.
  np.testing.assert_allclose(
    np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens))), got, rtol=1e-6, atol=1e-6
  )
  moe.set_capacity(model, None)
  np.testing.assert_array_equal(np.asarray(model(jnp.asarray(tokens))), dropless)


def test_training_step_reports_the_forwards_dropped_tokens(checkpoint, monkeypatch):
  """The dropped pairs a training step reports ("dropped_tokens"), with FSDP, remat and
  the feed-forward in chunks on 4 devices, equal the forward's count for the same
  tokens (Mixtral's two alike layers run as a scan, Qwen3-MoE's three one by one); the
  ring and dense agree where nothing is dropped."""
  from jax_ring.models.architectures import decoder
  from jax_ring.models.train import step as train_step

  jax.clear_caches()  # FF_TOKENS is read when a call is traced
  monkeypatch.setattr(decoder, "FF_TOKENS", 8)  # 16 tokens a device: chunks of 8
  folder, _, _ = checkpoint
  mesh = make_mesh((4,), ("seq",))
  model, _ = models.load(folder, mesh=mesh, fsdp=True, remat="full")
  tokens = _tokens(64, seed=12)
  moe.set_capacity(model, EXPERTS / TOP_K)  # C = N: nothing can drop
  dense, _ = models.load(folder, attention="dense")
  assert rel_err(model(jnp.asarray(tokens)), dense(jnp.asarray(tokens))) < RING_TOL
  assert int(moe.dropped_tokens(model)) == 0
  moe.set_capacity(model, 0.6)
  model(jnp.asarray(tokens))
  forward = int(moe.dropped_tokens(model))
  assert forward > 0
  trainer = train_step.Trainer(model, train_step.make_tx(1e-3, 1, 10, 0.0, 1.0), chunk=16)
  batch = train_step.place_batch(model, tokens, np.roll(tokens, -1, 1), np.ones(tokens.shape, np.float32))
  _, stats = trainer.step(*batch)
  assert int(stats["dropped_tokens"]) == forward
  jax.clear_caches()


def _flip_expert_parallelism(model, on: bool):
  for _, module in nnx.iter_graph(model):
    if isinstance(module, moe.MoE):
      module.weights_split = on


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_expert_parallelism_equals_gathered_experts(devices):
  """With a capacity and FSDP, short calls split the experts over the devices and send
  each expert's rows to its device and back (`jax.lax.all_to_all`): loss, every
  gradient and the dropped pairs equal the same model with its experts gathered."""
  mesh = make_mesh((devices,), ("seq",))
  config = models.Qwen3MoeConfig(**SMALL_MOE)
  tokens = jnp.asarray(_tokens(64, seed=devices))
  results = []
  for split in (True, False):
    model = models.build(config, mesh=mesh, fsdp=True, remat="full", rngs=nnx.Rngs(3))
    moe.set_capacity(model, 0.6)
    _flip_expert_parallelism(model, split)  # False: the experts gathered, as without FSDP's split
    assert model.blocks[0].mlp.expert_parallel(2 * 64 // devices) is split
    graphdef, state = nnx.split(model)
    program = str(jax.make_jaxpr(lambda s, t, g=graphdef: nnx.merge(g, s)(t))(state, tokens))
    assert ("all_to_all" in program) is split
    value, grads = nnx.jit(nnx.value_and_grad(_loss))(model, tokens)
    results.append((float(value), dict(nnx.to_flat_state(grads)), int(moe.dropped_tokens(model))))
  (v0, g0, d0), (v1, g1, d1) = results
  assert abs(v0 - v1) <= RING_TOL * abs(v1) and d0 == d1 > 0
  for path, value in g1.items():
    assert rel_err(g0[path][...], value[...]) < RING_TOL, path


def test_expert_parallelism_is_chosen_by_bytes_and_needs_experts_that_divide():
  """Expert parallelism where the tokens' buffers move fewer elements than gathering
  the experts (short calls), FSDP past that; experts that do not divide over the
  devices stay gathered, with a warning that says so."""
  mesh = make_mesh((4,), ("seq",))
  model = models.build(models.Qwen3MoeConfig(**SMALL_MOE), mesh=mesh, fsdp=True, rngs=nnx.Rngs(0))
  moe.set_capacity(model, 0.6)
  layer = model.blocks[0].mlp
  # F = 32: 6 g C < 9 F while g C < 48, with C = ceil(0.15 N) for g groups of N tokens.
  assert layer.expert_parallel(32) and layer.expert_parallel(313) and not layer.expert_parallel(314)
  assert layer.expert_parallel(153, 2) and not layer.expert_parallel(154, 2)
  assert layer.expert_parallel(40, 7) and not layer.expert_parallel(40, 8)
  # The gradients go back in the compute dtype too (the transpose of the gathered
  # copies'), so the float32 weights change nothing under bfloat16 compute.
  before, layer.dtype = layer.dtype, jnp.bfloat16
  assert layer.expert_parallel(313) and not layer.expert_parallel(314)
  layer.dtype = before
  odd = models.build(
    models.Qwen3MoeConfig(**SMALL_MOE | {"num_experts": 6}), mesh=mesh, fsdp=True, rngs=nnx.Rngs(0)
  )
  moe.set_capacity(odd, 0.6)
  with pytest.warns(UserWarning, match=r"num_experts=6 does not divide over the 4 devices"):
    assert not odd.blocks[0].mlp.expert_parallel(32)
  without_fsdp = models.build(models.Qwen3MoeConfig(**SMALL_MOE), mesh=mesh, rngs=nnx.Rngs(0))
  moe.set_capacity(without_fsdp, 0.6)
  assert not without_fsdp.blocks[0].mlp.expert_parallel(32)  # no experts' transfers to save


def test_a_chunked_call_counts_every_chunks_transfers(monkeypatch):
  """A long call's feed-forward chunks each send their rows under expert parallelism,
  while gathered experts are gathered once: the layer splits its experts only where
  all the chunks together move less (`decoder.feed_forward_groups`), and the call
  decides as `split_weights` did. 320 tokens a device (4 x 80) in 8 chunks of 40:
  8 x C(40) = 48, not below 48, so the experts are gathered (one chunk alone would
  split them); 160 tokens a device in 4 such chunks: 24, split."""
  mesh = make_mesh((4,), ("seq",))
  model = models.build(
    models.Qwen3MoeConfig(**SMALL_MOE), mesh=mesh, fsdp=True, remat="full", rngs=nnx.Rngs(0)
  )
  moe.set_capacity(model, 0.6)
  layer = model.blocks[0].mlp
  monkeypatch.setattr(decoder, "FF_TOKENS", 10)  # read when traced
  graphdef, state = nnx.split(model)
  for length, split in ((320, False), (160, True)):
    tokens = jnp.asarray(_tokens(length, batch=4))
    assert layer.expert_parallel(40) and bool(layer.split_weights((4, length, 64))) is split
    program = str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))
    assert ("all_to_all" in program) is split, length


def test_bad_capacity_factors_are_refused(checkpoint):
  folder, _, _ = checkpoint
  model, _ = models.load(folder, attention="dense")
  for bad in (0, -1.0, True, "1.25"):
    with pytest.raises(ValueError, match=rf"capacity_factor={bad!r}"):
      moe.set_capacity(model, bad)
  with pytest.raises(ValueError, match="has no mixture-of-experts layer"):
    dense = models.Qwen3Config(
      **{
        k: v
        for k, v in SMALL_MOE.items()
        if not hasattr(models.Qwen3MoeConfig, k) or hasattr(models.Qwen3Config, k)
      }
    )
    moe.set_capacity(models.build(dense, attention="dense"), 1.0)


def _loss(model, tokens):
  logits = model(tokens)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def _loss_and_logits(model, tokens):
  logits = model(tokens)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits


# The forward and the gradients in one compiled program (eagerly, each of the model's
# ops dispatches alone, which costs more than compiling them).
_grads_and_logits = nnx.jit(nnx.grad(_loss_and_logits, has_aux=True))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_ring_equals_dense_forward_and_gradients(checkpoint, devices):
  folder, _, _ = checkpoint
  dense, _ = models.load(folder, attention="dense")
  ring, _ = models.load(folder, mesh=make_mesh((devices,), ("seq",)))
  tokens = jnp.asarray(_tokens(64, seed=devices))
  (g_ring, logits_ring), (g_dense, logits_dense) = (
    _grads_and_logits(ring, tokens),
    _grads_and_logits(dense, tokens),
  )
  assert rel_err(logits_ring, logits_dense) < RING_TOL
  g_ring, g_dense = nnx.to_flat_state(g_ring), dict(nnx.to_flat_state(g_dense))
  for path, value in g_ring:
    assert rel_err(value[...], g_dense[path][...]) < RING_TOL, path


def test_fsdp_equals_replicated(checkpoint):
  folder, _, _ = checkpoint
  mesh = make_mesh((4,), ("seq",))
  split, _ = models.load(folder, mesh=mesh, fsdp=True)
  whole, _ = models.load(folder, mesh=mesh)
  tokens = jnp.asarray(_tokens(64, seed=9))
  assert rel_err(split(tokens), whole(tokens)) < RING_TOL
  assert split.blocks[0].mlp.gate[...].sharding.spec != whole.blocks[0].mlp.gate[...].sharding.spec


def test_save_writes_one_tensor_per_expert_and_loads_back(checkpoint, tmp_path):
  folder, config, weights = checkpoint
  model, _ = models.load(folder, attention="dense")
  models.save(model, tmp_path / "saved")
  saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
  assert set(saved) == set(weights)
  for name, value in weights.items():
    np.testing.assert_array_equal(saved[name], value, err_msg=name)
  written = json.loads((tmp_path / "saved" / "config.json").read_text())
  keys = ("num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")
  keys = ("num_local_experts", "intermediate_size") if config["model_type"] == "mixtral" else keys
  for key in ("num_experts_per_tok", "model_type", *keys):
    assert written[key] == config[key], key
  reloaded, _ = models.load(tmp_path / "saved", attention="dense")
  tokens = jnp.asarray(_tokens(24))
  np.testing.assert_array_equal(np.asarray(reloaded(tokens)), np.asarray(model(tokens)))


@pytest.mark.parametrize("cls", ["Qwen3MoeConfig", "MixtralConfig"])
def test_more_experts_per_token_than_experts_is_refused(cls):
  with pytest.raises(ValueError, match=r"num_experts_per_tok=9 exceeds num_experts=8"):
    models.build(getattr(models, cls)(num_experts=8, num_experts_per_tok=9), attention="dense")


def test_bad_moe_configs_are_refused(checkpoint, tmp_path):
  folder, config, _ = checkpoint
  kind = config["model_type"]
  bad = {"mixtral": {"router_jitter_noise": 0.1}, "qwen3_moe": {"mlp_only_layers": [7]}}[kind]
  message = {"mixtral": r"router_jitter_noise=0.1", "qwen3_moe": r"mlp_only_layers=\(7,\)"}[kind]
  (tmp_path / "config.json").write_text(json.dumps(config | bad))
  (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
  with pytest.raises(ValueError, match=message):
    models.load(tmp_path, attention="dense")
  one = tmp_path / "missing"
  one.mkdir()
  (one / "config.json").write_text(json.dumps(config))
  weights = load_file(str(folder / "model.safetensors"))
  gone = next(n for n in weights if ".experts.3." in n)
  save_file({n: v for n, v in weights.items() if n != gone}, str(one / "model.safetensors"))
  with pytest.raises(ValueError, match=r"experts\.\{e\}.* is missing"):
    models.load(one, attention="dense")


def test_named_configs_cite_the_released_sizes():
  cfg = models.config("qwen3-30b-a3b")
  assert (cfg.dim, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden) == (
    2048,
    48,
    128,
    8,
    768,
  )
  big = models.config("qwen3-235b-a22b")
  assert (big.dim, big.num_layers, big.num_heads, big.moe_hidden) == (4096, 94, 64, 1536)
  mixtral = models.config("mixtral-8x7b")
  sizes = (mixtral.dim, mixtral.num_layers, mixtral.mlp_hidden, mixtral.num_experts, mixtral.vocab_size)
  assert sizes == (4096, 32, 14336, 8, 32000)


SMALL_MOE = dict(
  vocab_size=128,
  dim=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  mlp_hidden=96,
  context_length=512,
  num_experts=EXPERTS,
  num_experts_per_tok=TOP_K,
  moe_hidden=32,
  mlp_only_layers=(1,),
)


def test_fsdp_training_steps_equal_the_replicated_model():
  """Three AdamW steps of a Qwen3-MoE with every weight (the experts' stacks included)
  split over 8 devices, against the replicated model: the same losses and weights.
  AdamW's first update is about lr x sign(g): where a gradient is float32 noise, the two
  summation orders can give it different signs, a difference of about lr on that
  weight. At lr 3e-3 that was 2.1e-5 of the down projection's norm once the first step
  trained (before, it ran at rate 0); the steps here run at 1e-3, as the other FSDP
  step tests do."""
  from jax_ring.models.train import step as train_step

  mesh = make_mesh((8,), ("seq",))
  config = models.Qwen3MoeConfig(**SMALL_MOE)
  tx = train_step.make_tx(1e-3, 1, 10, 0.01, 1.0)
  trainers = [
    train_step.Trainer(models.build(config, mesh=mesh, fsdp=f, rngs=nnx.Rngs(3)), tx, chunk=16)
    for f in (False, True)
  ]
  rng = np.random.default_rng(0)
  for _ in range(3):
    tokens = rng.integers(0, 128, (2, 64)).astype(np.int32)
    batch = train_step.place_batch(
      trainers[0].model(), tokens, np.roll(tokens, -1, 1), np.ones((2, 64), np.float32)
    )
    (l0, _), (l1, _) = (t.step(*batch) for t in trainers)
    assert abs(float(l0) - float(l1)) <= RING_TOL * abs(float(l0))
  for (path, a), (_, b) in zip(
    nnx.to_flat_state(trainers[0].weights()), nnx.to_flat_state(trainers[1].weights())
  ):
    assert rel_err(b[...], a[...]) < RING_TOL, path
  gate = trainers[1].weights()["blocks"][0]["mlp"]["gate"][...]
  assert gate.addressable_shards[0].data.size * 8 == gate.size  # the experts' stack is split 8 ways


def test_ring_generates_the_dense_tokens():
  config = models.Qwen3MoeConfig(**SMALL_MOE)
  dense = models.build(config, attention="dense", rngs=nnx.Rngs(5))
  ring = models.build(config, mesh=make_mesh((4,), ("seq",)), rngs=nnx.Rngs(5))
  prompts = _tokens(20, seed=11)
  lengths = np.array([20, 13])
  got = models.generate(ring, prompts, max_new_tokens=6, prompt_lengths=lengths)
  want = models.generate(dense, prompts, max_new_tokens=6, prompt_lengths=lengths)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_finetune_script_trains_an_moe_folder(tmp_path):
  """scripts/finetune.py on a small Qwen3-MoE folder and a text: two steps with FSDP over
  4 devices, a report, and a checkpoint that loads as Qwen3-MoE."""
  import finetune as script  # scripts/finetune.py
  import tokenizers

  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  model = models.build(models.Qwen3MoeConfig(**SMALL_MOE), attention="dense")
  models.save(model, tmp_path / "model", tokenizer=HFTokenizer(tok, bos_id=1, eos_id=2, pad_id=0))
  text = tmp_path / "text.txt"
  text.write_text(" ".join(f"w{(i * 7) % 50 + 3}" for i in range(300)))
  out = tmp_path / "run"
  args = [str(tmp_path / "model"), "--text", str(text), "--length", "64", "--devices", "4", "--out", str(out)]
  script.main(args + ["--steps", "2", "--fsdp"])
  report = json.loads((out / "report.json").read_text())
  assert len(report["steps"]) == 2 and all(np.isfinite(s["loss"]) for s in report["steps"])
  tuned, _ = models.load(out / "checkpoint", attention="dense")
  assert isinstance(tuned, models.Qwen3Moe)
  assert rel_err(tuned.blocks[0].mlp.gate[...], model.blocks[0].mlp.gate[...]) > 1e-5  # the experts trained


def _reference_choices(params, x, top_k):
  """Each token's experts: the router's probabilities sorted stably, largest first."""
  p = jax.nn.softmax(x.reshape(-1, x.shape[-1]) @ params[0], axis=-1)
  return jnp.asarray(np.argsort(-np.asarray(p), axis=-1, kind="stable")[:, :top_k])


def _reference_objective(params, x, r, chosen, coef):
  """sum(MoE(x) * r) + coef x transformers' load-balancing loss of one layer, written
  apart from `moe`: each token's experts gathered and run as dense products, the loss
  from one-hot masks of the chosen experts (load_balancing_loss_func)."""
  router, gate, up, down = params
  x2 = x.reshape(-1, x.shape[-1])
  p = jax.nn.softmax(x2 @ router, axis=-1)
  w = jnp.take_along_axis(p, chosen, axis=-1)
  w = w / w.sum(-1, keepdims=True)
  h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x2, gate[chosen])) * jnp.einsum("nd,nkdf->nkf", x2, up[chosen])
  y = jnp.einsum("nk,nkf,nkfd->nd", w, h, down[chosen])
  mask = jax.nn.one_hot(chosen, p.shape[-1])  # [N, K, E]
  aux = p.shape[-1] * jnp.sum(jnp.mean(mask, axis=0) * jnp.mean(p, axis=0)[None])
  return jnp.sum(y.reshape(x.shape) * r) + coef * aux


@pytest.mark.parametrize("devices", [1, 4, 8])
def test_balance_loss_gradients_equal_transformers_formula(devices):
  """The experts' and router's gradients with the load-balancing loss in them (weight
  0.5, large so it shows) equal those of the reference objective, in float64, with the
  tokens split over `devices` (the counts and token total summed over them)."""
  rng = np.random.default_rng(devices)
  b, t, d, f = 2, 32, 8, 6
  with jax.enable_x64():
    mesh = make_mesh((devices,), ("seq",))
    layer = moe.MoE(
      d, f, EXPERTS, TOP_K, normalize=True, balance=0.5, placement=(mesh, "seq", None),
      param_dtype=jnp.float64, rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jnp.asarray(rng.standard_normal((b, t, d)))
    r = jnp.asarray(rng.standard_normal((b, t, d)))
    layer.router.kernel[...] = jnp.asarray(rng.standard_normal((d, EXPERTS)))
    graphdef, state = nnx.split(layer)
    got = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) * r)))(state)
    params = (layer.router.kernel[...], layer.gate[...], layer.up[...], layer.down[...])
    chosen = _reference_choices(params, x, TOP_K)
    reference = jax.jit(jax.grad(_reference_objective))  # one program for both weights
    want = reference(params, x, r, chosen, 0.5)
    without = reference(params, x, r, chosen, 0.0)
    for name, g, w in zip(("router", "gate", "up", "down"), _leaves(got), want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-12, err_msg=name)
    assert rel_err(want[0], without[0]) > 1e-3  # the loss moves the router's gradient


def _leaves(state):
  flat = dict((".".join(map(str, path)), v[...]) for path, v in nnx.to_flat_state(state))
  return flat["router.kernel"], flat["gate"], flat["up"], flat["down"]


def _write_moe_gguf(path, config, w, vocab):
  """A GGUF file as llama.cpp's converter writes a Qwen3-MoE (its qwen3moe names) or a
  Mixtral ("llama" with experts, query and key rows reordered as Llama's): each
  layer's experts stacked in one tensor, a byte-level BPE vocabulary."""
  import gguf  # the [models] extra
  from test_checkpoints import _llama_cpp_permute

  mixtral = config["model_type"] == "mixtral"
  writer = gguf.GGUFWriter(str(path), "llama" if mixtral else "qwen3moe")
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(config["num_attention_heads"])
  writer.add_head_count_kv(config["num_key_value_heads"])
  writer.add_key_length(config["head_dim"])
  writer.add_value_length(config["head_dim"])
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  writer.add_rope_freq_base(config["rope_theta"])
  writer.add_expert_count(config["num_local_experts" if mixtral else "num_experts"])
  writer.add_expert_used_count(config["num_experts_per_tok"])
  if not mixtral:
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
  tokens, merges, types = vocab
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(types)
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  names = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
  }
  if mixtral:
    names["block_sparse_moe.gate"] = "ffn_gate_inp"
    experts = (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps"))
    expert = "block_sparse_moe.experts.{e}.{part}.weight"
  else:
    names |= {
      "self_attn.q_norm": "attn_q_norm",
      "self_attn.k_norm": "attn_k_norm",
      "mlp.gate": "ffn_gate_inp",
    }
    experts = (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps"))
    expert = "mlp.experts.{e}.{part}.weight"
  out = {"token_embd.weight": w["model.embed_tokens.weight"], "output.weight": w["lm_head.weight"]}
  out["output_norm.weight"] = w["model.norm.weight"]
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    for hf, gg in names.items():
      out[f"blk.{i}.{gg}.weight"] = w[p + hf + ".weight"]
    if mixtral:  # convert_hf_to_gguf.py's LlamaModel reorders the query and key rows
      out[f"blk.{i}.attn_q.weight"] = _llama_cpp_permute(
        out[f"blk.{i}.attn_q.weight"], config["num_attention_heads"]
      )
      out[f"blk.{i}.attn_k.weight"] = _llama_cpp_permute(
        out[f"blk.{i}.attn_k.weight"], config["num_key_value_heads"]
      )
    for part, gg in experts:
      out[f"blk.{i}.{gg}.weight"] = np.stack([w[p + expert.format(e=e, part=part)] for e in range(EXPERTS)])
  for name, value in out.items():
    writer.add_tensor(name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_equals_the_numpy_forward_and_the_ring(arch, tmp_path):
  """A qwen3moe GGUF file (every layer sparse, as llama.cpp runs it) loads as Qwen3-MoE,
  and a "llama" one with experts as Mixtral (not Llama), with the NumPy forward's
  logits; the ring over 4 devices equals dense."""
  from test_checkpoints import QWEN2_PATTERN, bpe_tables, train_bpe

  vocab = bpe_tables(train_bpe(QWEN2_PATTERN, nfc=True))
  config = _config(arch) | {"num_hidden_layers": 2, "vocab_size": len(vocab[0])}
  if arch == "qwen3_moe":
    config["mlp_only_layers"] = []
  weights = _weights(arch, config, seed=7)
  _write_moe_gguf(tmp_path / "moe.gguf", config, weights, vocab)
  model, tokenizer = models.load(tmp_path / "moe.gguf", attention="dense", cache_dir=tmp_path / "cache")
  assert type(model) is {"qwen3_moe": models.Qwen3Moe, "mixtral": models.Mixtral}[arch]
  assert tokenizer is not None and model.config.num_experts == EXPERTS
  if arch == "qwen3_moe":
    assert model.config.norm_topk_prob
  tokens = _tokens(40) % config["vocab_size"]
  got = np.asarray(model(jnp.asarray(tokens)))
  for b in range(tokens.shape[0]):
    assert rel_err(got[b], llama_logits(weights, config, tokens[b], qk_norm=arch == "qwen3_moe")) < F64_TOL
  ring, _ = models.load(tmp_path / "moe.gguf", mesh=make_mesh((4,), ("seq",)), cache_dir=tmp_path / "cache")
  assert rel_err(ring(jnp.asarray(tokens)), got) < RING_TOL


@pytest.mark.parametrize("arch, sparse", [("qwen3_moe", 2), ("mixtral", 2)])
def test_each_sparse_layer_weighs_its_balance_loss_by_the_mean_over_layers(arch, sparse, tmp_path):
  """transformers adds router_aux_loss_coef times one load-balancing loss over every
  sparse layer's router; here each layer adds its own, weighted coef / (sparse layers),
  so the total stays at coef's scale however deep the model (Qwen3-MoE's test model:
  3 layers, 1 dense; Mixtral's: 2)."""
  config = _config(arch)
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(_weights(arch, config), str(tmp_path / "model.safetensors"))
  model, _ = models.load(tmp_path, attention="dense")
  layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, moe.MoE)]
  assert len(layers) == sparse
  coef = config["router_aux_loss_coef"]
  assert [layer.balance for layer in layers] == pytest.approx([coef / sparse] * sparse, rel=1e-12)


def test_offload_equals_full_with_counts_and_the_experts_gathered_a_layer_ahead():
  """remat "offload" on a mixture of experts whose blocks are all alike (one scan of its
  own backward pass, each layer's input and gathered weights fetched a layer ahead:
  `decoder._prefetched_offload_scan`): the loss, every gradient and the dropped pairs
  of "full", with FSDP and a capacity over 4 devices."""
  mesh = make_mesh((4,), ("seq",))
  config = models.Qwen3MoeConfig(**SMALL_MOE | {"mlp_only_layers": ()})
  tokens = jnp.asarray(_tokens(64, seed=5))
  results = []
  for remat in ("full", "offload"):
    model = models.build(config, mesh=mesh, fsdp=True, remat=remat, rngs=nnx.Rngs(3))
    assert model.scan_plan() == [[[0], [1], [2]]]
    moe.set_capacity(model, 0.6)
    value, grads = nnx.jit(nnx.value_and_grad(_loss))(model, tokens)
    results.append((float(value), dict(nnx.to_flat_state(grads)), int(moe.dropped_tokens(model))))
  (v0, g0, d0), (v1, g1, d1) = results
  assert abs(v0 - v1) <= 1e-6 * abs(v0) and d0 == d1 > 0, (v0, v1, d0, d1)
  for path, value in g0.items():
    assert rel_err(g1[path][...], value[...]) < 1e-5, path
