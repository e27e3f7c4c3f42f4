"""Low-rank adapters (`models.add_lora`): new adapters leave the logits exactly; the ring
equals dense with adapters, forward and every adapter's gradient, on 1, 2, 4 and 8
devices with FSDP on and off; only the adapters get gradients (the base kernels'
gradient products never appear in the step's jaxpr); merged equals unmerged; PEFT's
layout out and back in (`save_lora`, `load(..., adapter=)`), with what changes the
computation refused by name; finetune.py --lora-rank."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_ring import models
from jax_ring.models import lora
from jax_ring.models.train import step as train_step

# Widths that no activation shares, so that a base kernel's gradient product is seen by shape.
CFG = dataclasses.replace(
  models.config("llama-3.2-1b"),
  vocab_size=97,
  dim=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_hidden=80,
  context_length=256,
)
KERNELS = {(48, 32), (32, 48), (48, 80), (80, 48)}  # query (key and value together), out, gate and up, down
TOKENS = np.random.default_rng(0).integers(0, 97, (1, 64)).astype(np.int32)


def _with_b(model, seed=1):
  """Random B for every adapter (a trained adapter), the same for any placement."""
  rng = np.random.default_rng(seed)
  for _, _, module in lora._adapted(model):
    b = module.lora_b[...]
    module.lora_b[...] = jax.device_put(jnp.asarray(rng.standard_normal(b.shape) * 0.1, b.dtype), b.sharding)
  return model


def test_new_adapters_leave_the_logits_exactly():
  mesh = make_mesh((4,), ("seq",))
  model = models.build(CFG, mesh=mesh, fsdp=True)
  before = np.asarray(model(TOKENS))
  models.add_lora(model, rank=4, alpha=8)
  assert np.array_equal(np.asarray(model(TOKENS)), before)
  assert lora.lora_settings(model) == dict(rank=4, alpha=8.0, targets=lora.ALL, rslora=False)
  a = model.blocks[0].attn.query.lora_a[...]
  assert (
    a.shape == (48, 4)
    and a.dtype == jnp.float32
    and a.sharding.spec == jax.sharding.PartitionSpec("seq", None)
  )


def _adapter_grads(model):
  def loss(m):
    return jnp.sum(
      m(TOKENS) * jnp.asarray(np.random.default_rng(3).standard_normal((1, 64, 97)), jnp.float32)
    )

  grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
  return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}


_DENSE = {}


# Every device count, FSDP off and on (on one device FSDP is off: 1-True was 1-False).
@pytest.mark.parametrize("devices, fsdp", [(1, False), (2, True), (4, False), (8, False), (8, True)])
def test_ring_equals_dense_with_adapters(devices, fsdp):
  if "dense" not in _DENSE:
    dense = _with_b(models.add_lora(models.build(CFG, attention="dense"), rank=3, alpha=6))
    _DENSE["dense"] = (np.asarray(dense(TOKENS)), _adapter_grads(dense))
  logits, grads = _DENSE["dense"]
  mesh = make_mesh((devices,), ("seq",))
  ring = _with_b(models.add_lora(models.build(CFG, mesh=mesh, fsdp=fsdp and devices > 1), rank=3, alpha=6))
  assert rel_err(ring(TOKENS), logits) < 1e-5
  mine = _adapter_grads(ring)
  assert set(mine) == set(grads) and len(grads) == 2 * 7 * CFG.num_layers
  for name, value in grads.items():
    assert rel_err(mine[name], value) < 1e-5, name


def _dot_shapes(jaxpr) -> set:
  """Output shapes of every dot_general in a jaxpr and the jaxprs inside it."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found |= {tuple(v.aval.shape) for v in eqn.outvars}
    for value in eqn.params.values():
      for inner in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(inner, jax.extend.core.ClosedJaxpr):
          found |= _dot_shapes(inner.jaxpr)
        elif isinstance(inner, jax.extend.core.Jaxpr):
          found |= _dot_shapes(inner)
  return found


@pytest.mark.parametrize("fsdp,remat", [(False, "none"), (True, "none"), (True, "offload")])
def test_only_the_adapters_get_gradients(fsdp, remat):
  """The adapter step's jaxpr makes no product of a base kernel's shape (its gradient is
  never computed); the full step's does (the check can fail). AdamW state is the
  adapters' size. So with remat "offload", whose backward pass is written by hand."""
  mesh = make_mesh((2,), ("seq",))
  batch = (TOKENS, np.roll(TOKENS, -1, 1), np.ones(TOKENS.shape, np.float32))

  def shapes(model, trainable):
    trainer = train_step.Trainer(model, optax.adam(1e-3), chunk=16, trainable=trainable)
    placed = train_step.place_batch(model, *batch)
    step = lambda p, o: train_step._step(
      trainer.graphdef, trainer.tx, train_step.cross_entropy, 16, trainer.plan, p, trainer.rest, o, *placed
    )
    return _dot_shapes(jax.make_jaxpr(step)(trainer.params, trainer.opt_state).jaxpr), trainer

  full, _ = shapes(models.build(CFG, mesh=mesh, fsdp=fsdp, remat=remat), nnx.Param)
  assert full >= KERNELS
  model = models.add_lora(models.build(CFG, mesh=mesh, fsdp=fsdp, remat=remat), rank=3, alpha=6)
  adapted, trainer = shapes(model, nnx.LoRAParam)
  assert not KERNELS & adapted
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  assert sum(x.nbytes for x in jax.tree.leaves(trainer.opt_state) if x.ndim) == 2 * adapter_bytes
  memory = trainer.memory(*train_step.place_batch(model, *batch))
  assert memory["param_bytes"] < memory["frozen_bytes"] / 4


def test_merged_equals_unmerged_and_saves_as_plain_weights(tmp_path):
  model = _with_b(models.add_lora(models.build(CFG, attention="dense"), rank=4, alpha=8))
  unmerged = np.asarray(model(TOKENS))
  models.merge_lora(model)
  assert lora.lora_settings(model) is None and not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  assert rel_err(model(TOKENS), unmerged) < 1e-6
  models.save(model, tmp_path / "merged")
  again, _ = models.load(tmp_path / "merged", attention="dense")
  assert rel_err(again(TOKENS), unmerged) < 1e-6


def _folder(tmp_path, cfg=CFG):
  path = tmp_path / "base"
  models.save(models.build(cfg, attention="dense"), path)
  return path


def test_peft_layout_out_and_back_in(tmp_path):
  base = _folder(tmp_path)
  model, _ = models.load(base, attention="dense")
  _with_b(models.add_lora(model, rank=4, alpha=16, targets=("q", "v", "down")))
  expected = np.asarray(model(TOKENS))
  models.save_lora(model, tmp_path / "adapter")
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
  assert (
    config["r"] == 4
    and config["lora_alpha"] == 16
    and config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
  )
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  assert len(tensors) == 2 * 3 * CFG.num_layers
  # Both files with the modes every other output has (the umask's), not safetensors' private 0600.
  modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "adapter").iterdir()}
  assert modes["adapter_model.safetensors"] == modes["adapter_config.json"] != 0o600
  name = "base_model.model.model.layers.1.self_attn.q_proj"
  assert tensors[f"{name}.lora_A.weight"].shape == (4, 48) and tensors[f"{name}.lora_B.weight"].shape == (
    32,
    4,
  )
  np.testing.assert_array_equal(
    tensors[f"{name}.lora_B.weight"], np.asarray(model.blocks[1].attn.query.lora_b[...]).T
  )
  assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 80)
  for devices, fsdp in ((1, False), (4, True)):
    loaded, _ = models.load(
      base, mesh=make_mesh((devices,), ("seq",)), fsdp=fsdp, adapter=tmp_path / "adapter"
    )
    assert rel_err(loaded(TOKENS), expected) < 1e-5


@pytest.mark.parametrize(
  "change, says",
  [
    (dict(use_dora=True), "use_dora=True changes the computation"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=['lm_head']"),
    (dict(layers_to_transform=[0]), "layers_to_transform=[0]"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern="),
    (dict(target_modules="all-linear"), "target_modules='all-linear' (a pattern)"),
    (dict(target_modules=["q_proj", "lm_head"]), "target_modules holds 'lm_head'"),
    (dict(peft_type="IA3"), "peft_type='IA3'"),
  ],
)
def test_adapters_that_change_the_computation_are_refused_by_name(tmp_path, change, says):
  base = _folder(tmp_path)
  model, _ = models.load(base, attention="dense")
  models.save_lora(models.add_lora(model, rank=2, alpha=2, targets=("q",)), tmp_path / "a")
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config | change))
  with pytest.raises(ValueError, match=__import__("re").escape(says)):
    models.load(base, attention="dense", adapter=tmp_path / "a")


def test_rslora_scales_by_the_square_root_and_tensors_are_checked(tmp_path):
  base = _folder(tmp_path)
  model, _ = models.load(base, attention="dense")
  _with_b(models.add_lora(model, rank=4, alpha=8, targets=("o",), rslora=True))
  assert model.blocks[0].attn.out.lora_scale == 4.0  # 8 / sqrt(4)
  models.save_lora(model, tmp_path / "a")
  loaded, _ = models.load(base, attention="dense", adapter=tmp_path / "a")
  assert rel_err(loaded(TOKENS), model(TOKENS)) < 1e-6
  tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
  tensors.pop("base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight")
  save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
  with pytest.raises(
    ValueError, match="no tensor 'base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight'"
  ):
    models.load(base, attention="dense", adapter=tmp_path / "a")


def test_the_scale_is_alpha_over_rank_and_a_is_drawn_as_peft_draws_it(tmp_path):
  """y = x W + (alpha / r) (x A) B with rank != alpha (4 and 16: 4, where r / alpha
  gives 0.25), against NumPy in float64; A uniform within PEFT's 1 / sqrt(in) (not
  1 / in); an adapter_config.json without "use_rslora" read as PEFT reads it (False)."""
  model = models.build(CFG, attention="dense", rngs=nnx.Rngs(0))
  _with_b(models.add_lora(model, rank=4, alpha=16, targets=("o", "down")))
  out = model.blocks[0].attn.out
  assert out.lora_scale == 4.0
  x = np.random.default_rng(2).standard_normal((3, out.in_features)).astype(np.float32)
  w, a, b = (np.asarray(v[...], np.float64) for v in (out.kernel, out.lora_a, out.lora_b))
  np.testing.assert_allclose(
    np.asarray(out(jnp.asarray(x)), np.float64), x @ w + 4.0 * (x @ a) @ b, rtol=1e-5, atol=1e-5
  )
  for module, n_in in ((out, out.in_features), (model.blocks[1].mlp.down, CFG.mlp_hidden)):
    values = np.abs(np.asarray(module.lora_a[...]))
    assert values.max() <= 1 / np.sqrt(n_in) and values.max() > 0.9 / np.sqrt(n_in) > 2 / n_in
  base = _folder(tmp_path)
  trained, _ = models.load(base, attention="dense")
  _with_b(models.add_lora(trained, rank=4, alpha=8, targets=("q",)))
  models.save_lora(trained, tmp_path / "a")
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  del config["use_rslora"]
  (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
  loaded, _ = models.load(base, attention="dense", adapter=tmp_path / "a")
  assert loaded.blocks[0].attn.query.lora_scale == 2.0  # 8 / 4, not 8 / sqrt(4)
  assert rel_err(loaded(TOKENS), trained(TOKENS)) < 1e-6


def test_bad_settings_and_unsupported_targets_are_refused():
  model = models.build(CFG, attention="dense")
  with pytest.raises(ValueError, match="rank=0 must be a positive int"):
    models.add_lora(model, rank=0, alpha=1)
  with pytest.raises(ValueError, match=r"targets=\('qkv',\)"):
    models.add_lora(model, rank=2, alpha=1, targets=("qkv",))
  with pytest.raises(ValueError, match="dropout=0.1"):
    models.add_lora(model, rank=2, alpha=1, dropout=0.1)
  models.add_lora(model, rank=2, alpha=1)
  with pytest.raises(ValueError, match="already has adapters"):
    models.add_lora(model, rank=2, alpha=1)
  small = dict(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=48)
  moe = dataclasses.replace(
    models.config("qwen3-30b-a3b"), **small, num_experts=4, num_experts_per_tok=2, moe_hidden=16
  )
  with pytest.raises(ValueError, match="'gate' of block 0: MoE.gate is a Param.*targets q, k, v, o"):
    models.add_lora(models.build(moe, attention="dense"), rank=2, alpha=1, targets=("q", "gate"))
  models.add_lora(models.build(moe, attention="dense"), rank=2, alpha=1, targets=("q", "k", "v", "o"))
  phi = dataclasses.replace(
    models.config("phi-4-mini"), **small, context_length=256, rope_dim=8, rope_scaling=None
  )
  with pytest.raises(ValueError, match="'q' of phi3: its files store this projection fused"):
    models.add_lora(models.build(phi, attention="dense"), rank=2, alpha=1, targets=("q",))
  models.add_lora(models.build(phi, attention="dense"), rank=2, alpha=1, targets=("o", "down"))


def test_finetune_trains_adapters_alone_and_merges(tmp_path):
  import finetune as script
  from test_finetune_data import byte_tokenizer, chats, write_jsonl

  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  tok = byte_tokenizer()
  cfg = dataclasses.replace(CFG, vocab_size=288)
  template = (
    __import__("pathlib").Path(__file__).parent / "data" / "chat_templates" / "qwen2_5.jinja"
  ).read_text()
  wrapped = HFTokenizer(tok, bos_id=tok.token_to_id("<|end_of_text|>"), eos_id=tok.token_to_id("<|eot_id|>"))
  wrapped.chat_template = template
  models.save(models.build(cfg, attention="dense"), tmp_path / "base", tokenizer=wrapped)
  data = write_jsonl(tmp_path / "c.jsonl", chats(12))
  out = tmp_path / "run"
  common = [
    str(tmp_path / "base"),
    "--data",
    str(data),
    "--length",
    "256",
    "--devices",
    "2",
    "--out",
    str(out),
  ]
  report = script.main(common + ["--steps", "3", "--lr", "1e-2", "--lora-rank", "4", "--merge"])
  assert report["config"]["lora"] == dict(rank=4, alpha=8.0, targets=list(lora.ALL), rslora=False)
  memory = report["memory"]
  assert (
    memory["frozen_bytes"] > 5 * memory["param_bytes"]
    and memory["optimizer_bytes"] < 3 * memory["param_bytes"]
  )
  adapted, _ = models.load(tmp_path / "base", attention="dense", adapter=out / "adapter")
  merged, _ = models.load(out / "checkpoint", attention="dense")
  base, _ = models.load(tmp_path / "base", attention="dense")
  assert rel_err(merged(TOKENS), adapted(TOKENS)) < 1e-5 and rel_err(adapted(TOKENS), base(TOKENS)) > 1e-4
  with pytest.raises(
    SystemExit, match="was fine-tuned with adapters .*'rank': 4.* and this run has .*'rank': 8"
  ):
    script.main(common + ["--steps", "5", "--lora-rank", "8"])
  with pytest.raises(SystemExit, match="--merge merges adapters: it needs --lora-rank"):
    script.main(common + ["--steps", "5", "--merge"])


def test_compiled_adapter_step_holds_the_frozen_base_and_no_base_sized_optimizer_state():
  """`compile_train_step(..., lora_rank=16)` on 8 CPU devices (Llama-3.2-1B's shapes, 2
  blocks): the step's arguments per device are the bfloat16 base's share, the float32
  adapters' with their two AdamW moments, and the batch; the full step's arguments
  carry float32 weights and both moments of every weight."""
  mesh = make_mesh((8,), ("seq",))
  common = dict(seq_len=1024, layers=2, dtype="bfloat16", param_dtype="bfloat16", remat="full")
  compiled = train_step.compile_train_step("llama-3.2-1b", mesh, lora_rank=16, **common)
  cfg = dataclasses.replace(models.config("llama-3.2-1b"), num_layers=2)
  model = nnx.eval_shape(
    lambda: models.add_lora(
      models.build(cfg, mesh=mesh, fsdp=True, param_dtype="bfloat16"), rank=16, alpha=32
    )
  )
  size = lambda tree: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
  adapters = size(nnx.state(model, nnx.LoRAParam))
  base = size(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
  batch = 3 * 1024 * 4
  arguments = compiled.memory_analysis().argument_size_in_bytes
  expected = (base + 3 * adapters + batch) / 8
  assert abs(arguments - expected) < 0.01 * expected, (arguments, expected)
  full = train_step.compile_train_step("llama-3.2-1b", mesh, **(common | dict(param_dtype="float32")))
  assert full.memory_analysis().argument_size_in_bytes > 5 * arguments


def test_generation_with_adapters_in_place_equals_the_merged_model():
  """Prefill and decode through the adapters (the ring's KV cache, FSDP weights used
  where they lie): the same greedy tokens as the merged model."""
  mesh = make_mesh((4,), ("seq",))
  model = _with_b(models.add_lora(models.build(CFG, mesh=mesh, fsdp=True), rank=4, alpha=8), seed=5)
  adapted = models.generate(model, TOKENS[:, :40], max_new_tokens=8).tokens
  merged = models.generate(models.merge_lora(model), TOKENS[:, :40], max_new_tokens=8).tokens
  np.testing.assert_array_equal(np.asarray(adapted), np.asarray(merged))
  base = models.generate(models.build(CFG, mesh=mesh, fsdp=True), TOKENS[:, :40], max_new_tokens=8).tokens
  assert not np.array_equal(np.asarray(adapted), np.asarray(base))  # the adapters changed the output


def test_adapter_gradients_under_offload_equal_full():
  """remat "offload" (its backward pass written by hand, the layer inputs fetched from
  host memory one layer ahead) gives an adapter model the loss and adapter gradients of
  "full", with FSDP over 4 devices."""
  mesh = make_mesh((4,), ("seq",))
  tokens, targets = jnp.asarray(TOKENS), jnp.asarray(np.roll(TOKENS, -1, 1))
  weights = jnp.ones(TOKENS.shape, jnp.float32)
  results = {}
  for remat in ("full", "offload"):
    model = _with_b(models.add_lora(models.build(CFG, mesh=mesh, fsdp=True, remat=remat), rank=3, alpha=6))
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    loss = lambda a, g=graphdef, r=rest: train_step.loss(
      nnx.merge(g, a, r), tokens, targets, weights, chunk=16
    )
    results[remat] = jax.jit(jax.value_and_grad(loss))(adapters)
  (v0, g0), (v1, g1) = results["full"], results["offload"]
  assert float(v0) == float(v1)
  for (path, a), (_, b) in zip(nnx.to_flat_state(g0), nnx.to_flat_state(g1)):
    assert rel_err(b[...], a[...]) < 1e-6, path
