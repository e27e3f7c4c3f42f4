"""Precision policies: detection per device, accuracy in half precision, dtypes."""

import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import forward_and_vjp, make_mesh, qkv, rel_err

import jax_ring
from jax_ring import PRESETS, Policy, policy_for, reference_attention, ring_attention


def fake(platform, kind="fake", capability=None):
  d = types.SimpleNamespace(platform=platform, device_kind=kind)
  if capability is not None:
    d.compute_capability = capability
  return d


@pytest.mark.parametrize(
  "device, preset",
  [
    (fake("cpu", "cpu"), "float32"),
    (fake("gpu", "Tesla P100-PCIE-16GB", "6.0"), "float32"),
    (fake("gpu", "NVIDIA GeForce GTX 1080", "6.1"), "float32"),
    (fake("gpu", "Tesla V100-SXM2-16GB", "7.0"), "float16"),
    (fake("gpu", "Tesla T4", "7.5"), "float16"),
    (fake("gpu", "NVIDIA A100-SXM4-40GB", "8.0"), "bfloat16"),
    (fake("gpu", "NVIDIA GeForce RTX 4090", "8.9"), "bfloat16"),
    (fake("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "bfloat16"),
    (fake("gpu", "NVIDIA B200", "10.0"), "bfloat16"),
    (fake("tpu", "TPU v4"), "bfloat16"),
  ],
)
def test_detection_table(device, preset, monkeypatch):
  monkeypatch.delenv("JAX_RING_POLICY", raising=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert policy_for(device) == PRESETS[preset]


@pytest.mark.parametrize("device", [fake("metal", "Apple M2"), fake("gpu", "mystery GPU")])
def test_unknown_device_falls_back_to_float32_with_warning(device, monkeypatch):
  monkeypatch.delenv("JAX_RING_POLICY", raising=False)
  with pytest.warns(UserWarning, match="float32"):
    assert policy_for(device) == PRESETS["float32"]


def test_environment_variable_overrides(monkeypatch):
  monkeypatch.setenv("JAX_RING_POLICY", "bfloat16")
  assert policy_for(fake("cpu")) == PRESETS["bfloat16"]
  monkeypatch.setenv("JAX_RING_POLICY", "nonsense")
  with pytest.raises(ValueError, match="JAX_RING_POLICY='nonsense' is not a preset"):
    policy_for(fake("cpu"))


def test_default_is_decided_per_call_on_this_cpu(monkeypatch):
  monkeypatch.delenv("JAX_RING_POLICY", raising=False)
  assert policy_for() == PRESETS["float32"]


def test_policy_rejects_half_precision_statistics():
  with pytest.raises(ValueError, match="accum_dtype=bfloat16 must be float32 or wider"):
    Policy(accum_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="compute_dtype"):
    Policy(compute_dtype=jnp.int8)


def _errors(policy, devices, dtype=jnp.float32, **options):
  mesh = make_mesh((devices,), ("seq",))
  q, k, v = qkv(1, 256, 4, 2, 32, dtype=dtype)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, policy=policy, block_sizes=jax_ring.BlockSizes(32, 32, kv_heads=1), **options
  )
  shape = jax.eval_shape(fn, q, k, v)
  cot = jax.random.normal(jax.random.PRNGKey(5), shape.shape, jnp.float32).astype(shape.dtype)
  out, grads = forward_and_vjp(fn)((q, k, v), cot)  # one jitted program each
  ref_fn = lambda q, k, v: reference_attention(q, k, v, **options)
  wide = tuple(x.astype(jnp.float64) for x in (q, k, v))
  ref, ref_grads = forward_and_vjp(ref_fn)(wide, cot.astype(jnp.float64))
  for g, x in zip(grads, (q, k, v)):
    assert g.dtype == x.dtype
  return out, [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]


@pytest.mark.parametrize("preset", ["bfloat16", "float16"])
def test_half_precision_accuracy_and_ring_growth(preset):
  _, one = _errors(preset, 1, is_causal=True)
  _, eight = _errors(preset, 8, is_causal=True)
  for e1, e8 in zip(one, eight):
    assert e1 < 1e-2 and e8 < 1e-2, (one, eight)
    assert e8 <= 1.5 * e1 + 1e-4, (one, eight)


def test_output_dtype_follows_policy():
  out, _ = _errors(Policy(compute_dtype=jnp.bfloat16, output_dtype=jnp.bfloat16), 2)
  assert out.dtype == jnp.bfloat16
  out, _ = _errors("bfloat16", 2)  # output_dtype None: the query's dtype
  assert out.dtype == jnp.float32


def test_float16_inputs_with_logits_beyond_float16_range():
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(1, 64, 2, 2, 16)
  q, k = 300 * q, 300 * k  # logits ~ 1e5 > float16 max 65504
  q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
  logits = jnp.einsum("btnh,bsnh->bnts", q16.astype(jnp.float32), k16.astype(jnp.float32)) / 4
  assert float(jnp.max(jnp.abs(logits))) > 65504
  out = ring_attention(q16, k16, v16, mesh=mesh, policy="float16", is_causal=True)
  ref = reference_attention(*(x.astype(jnp.float64) for x in (q16, k16, v16)), is_causal=True)
  assert out.dtype == jnp.float16
  assert bool(jnp.all(jnp.isfinite(out)))
  assert rel_err(out, ref) < 1e-2
