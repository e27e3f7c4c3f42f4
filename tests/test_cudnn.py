"""The cuDNN step kernel (kernel="cudnn") on this CPU: its calls run their XLA twin
(`jax_ring._cudnn._xla_forward` / `_xla_backward`, what cuDNN computes, written in jnp),
so everything around cuDNN's call is checked here against the float64 reference: each
ring step cut into one call on one rectangle (`_ring._CUDNN_KINDS`), the float32 merges,
the backward from the global output and lse, both backward schemes, GQA, causal in the
contiguous and zigzag layouts and full attention, on 1, 2, 3, 4 and 8 devices. Then the
kernel choice (cuDNN first on NVIDIA GPUs, the reasons it is passed over, a ValueError on
CPU), the fallbacks where a call's masks need positions, and the private API check.
The cuDNN call itself, and its compile for 8 x H100, are checked by tests/test_aot.py
and on a GPU by scripts/bench/bench_gpu.py."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, qkv, rel_err

import jax_ring
from jax_ring import _cudnn, _ring, choose_kernel, layouts, reference_attention, ring_attention

TOL = 1e-5
BF16 = jax_ring.PRESETS["bfloat16"]


@pytest.fixture
def stand_in(monkeypatch):
  """kernel="cudnn" on this CPU, with the XLA twin in cuDNN's place (read while tracing)."""
  monkeypatch.setattr(_cudnn, "CPU_STAND_IN", True)
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.fixture
def late(monkeypatch):
  """The backward scheme GPUs run: each shard's dK/dV one step behind its K/V, the local
  K/V's compute cut in halves (`_ring.OwnHalves`); without it, CPU's (dK/dV travel
  with their K/V)."""
  monkeypatch.setattr(_ring, "LATE_DKV_PLATFORMS", _ring.LATE_DKV_PLATFORMS + ("cpu",))
  jax.clear_caches()


def _cudnn_ran(fn, *args) -> bool:
  """Whether fn's program calls cuDNN (the CUDA branch of its calls)."""
  return "dot_product_attention_fwd" in str(jax.make_jaxpr(fn)(*args))


def _check_ring(devices, is_causal, layout, block_sizes=None):
  mesh = make_mesh((devices,), ("seq",))
  args = qkv(2, 16 * devices, 4, 2, 16, seed=devices)

  def fn(q, k, v):
    return ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      is_causal=is_causal,
      layout=layout,
      kernel="cudnn",
      policy="float32",
      block_sizes=block_sizes,
    )

  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=is_causal)
  compare_with_reference(fn, ref, args, TOL)
  assert _cudnn_ran(fn, *args)


# 3 and 8 devices (slow: 6-8 s each here, compiling) add an odd ring and the longest.
@pytest.mark.parametrize(
  "devices", [1, 2, pytest.param(3, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("is_causal, layout", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")])
def test_cudnn_ring_equals_float64(stand_in, late, devices, is_causal, layout):
  """Outputs and gradients of q, k and v; 4 query heads on 2 kv heads; 16 tokens a device."""
  _check_ring(devices, is_causal, layout)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cudnn_ring_with_dkv_travelling_with_kv(stand_in, layout):
  """CPU's backward scheme (no `OwnHalves`)."""
  _check_ring(4, True, layout)


@pytest.mark.parametrize("is_causal, layout", [(False, "contiguous"), (True, "zigzag")])
def test_cudnn_ring_in_passes_of_one_kv_head(stand_in, late, is_causal, layout):
  """Two passes around the ring, one kv head (and its two query heads) each: the calls'
  statistics and gradients land in the right heads. (By default a cuDNN pass takes up
  to 256K local tokens x kv heads, so these short shards take one.)"""
  _check_ring(4, is_causal, layout, jax_ring.BlockSizes(kv_heads=1))


def test_cudnn_ring_in_bfloat16(stand_in):
  """The bfloat16 policy (cuDNN's inputs): each call's output and gradients rounded to
  bfloat16 as cuDNN writes them, merged and summed in float32."""
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 128, 4, 2, 16, dtype=jnp.bfloat16, seed=3)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, kernel="cudnn", policy=BF16)
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, 2e-2)


def _mask_of_kind(kind, t, s):
  """The [t, s] mask the call of `_CUDNN_KINDS[kind]` lets through."""
  name, rows_q, rows_k, causal = _ring._CUDNN_KINDS[kind]
  mask = np.zeros((t, s), bool)
  if name == "hidden":
    return mask
  rq = slice(0, t) if rows_q == "all" else slice(t // 2, t)
  rk = slice(0, s) if rows_k == "all" else slice(0, s // 2)
  n, m = rq.stop - rq.start, rk.stop - rk.start
  mask[rq, rk] = np.tril(np.ones((n, m), bool)) if causal else True
  return mask


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5, 8])
def test_every_step_is_one_call_that_equals_the_causal_mask(layout, devices):
  """For every pair of shards (query shard r, key shard j) of a causal ring, and for each
  half of the own shard's keys (the late scheme's `OwnHalves`): `_cudnn_kind` finds a
  kind, and its call's rectangle and mask are exactly the causal mask on positions."""
  cfg = _ring.RingConfig(
    axis_name="seq",
    ring_size=devices,
    mask=_ring.MaskSpec(is_causal=True),
    scale=1.0,
    policy=jax_ring.Policy(),
    block_q=8,
    block_kv=8,
    steps_back=devices - 1,
    steps_fwd=0,
    kernel="cudnn",
  )
  t = 8
  pos = [np.asarray(layouts.shard_positions(layout, r, t, devices)) for r in range(devices)]
  pairs = [(pos[r], pos[j]) for r in range(devices) for j in range(devices)]
  pairs += [(pos[r], pos[r][: t // 2]) for r in range(devices)] + [
    (pos[r], pos[r][t // 2 :]) for r in range(devices)
  ]
  kinds = set()
  for q_pos, k_pos in pairs:
    kind = int(_ring._cudnn_kind(cfg, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    assert kind < len(_ring._CUDNN_KINDS), (layout, q_pos, k_pos)
    assert kind in _ring._cudnn_branches(len(q_pos), len(k_pos)), kind
    expected = q_pos[:, None] >= k_pos[None, :]
    np.testing.assert_array_equal(_mask_of_kind(kind, len(q_pos), len(k_pos)), expected)
    kinds.add(_ring._CUDNN_KINDS[kind][0])
  used = {"contiguous": {"whole", "hidden", "causal"}, "zigzag": {"keys_first", "queries_second", "causal"}}
  assert used[layout] | {"causal_second"} <= kinds or devices == 1, kinds


def test_positions_no_kind_covers_give_nan_not_a_wrong_number():
  """Striped positions (which `cudnn_problem` keeps away from cuDNN) match no kind: the
  step's result is NaN."""
  cfg = _ring.RingConfig(
    "seq", 2, _ring.MaskSpec(is_causal=True), 1.0, jax_ring.Policy(), 4, 4, 1, 0, kernel="cudnn"
  )
  q_pos, k_pos = jnp.asarray([0, 2, 4, 6]), jnp.asarray([1, 3, 5, 7])
  assert int(_ring._cudnn_kind(cfg, q_pos, k_pos)) == len(_ring._CUDNN_KINDS)
  q, k, v = (jnp.ones((1, 2, 4, 8)),) * 3
  hidden = lambda q, k, v, o: o
  run = lambda kind, q, k, v, o: o + 1
  out = _ring._cudnn_step(cfg, jnp.int32(len(_ring._CUDNN_KINDS)), run, hidden, q, k, v, jnp.zeros(3))
  assert bool(jnp.all(jnp.isnan(out)))


@pytest.mark.parametrize(
  "options, reason",
  [
    (dict(is_causal=True, layout="striped"), "striped layout"),
    (dict(is_causal=True, local_window_size=(8, 0)), "local_window_size"),
    (dict(is_causal=True, segment_ids=jnp.repeat(jnp.arange(4), 16)[None]), "segment ids"),
    (dict(is_causal=True, logit_soft_cap=5.0), "logit_soft_cap"),
    (dict(is_causal=True, return_residual=True), "the lse is an output"),
    (dict(is_causal=True), "padding"),  # 62 tokens: 4 devices take 64
  ],
)
def test_calls_cudnn_cannot_take_fall_back_with_the_reason(stand_in, options, reason):
  """kernel="cudnn" where the call's masks need positions: the XLA tiles on this CPU
  (the Pallas kernel on a GPU), a warning naming why, and the exact result."""
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(1, 64, 4, 2, 16)
  if options == dict(is_causal=True):
    q, k, v = q[:, :62], k[:, :62], v[:, :62]
  ref_options = {n: o for n, o in options.items() if n not in ("layout", "return_residual")}
  with pytest.warns(UserWarning, match=f"kernel='cudnn' runs the XLA tiles instead: .*{reason}"):
    out = ring_attention(q, k, v, mesh=mesh, kernel="cudnn", policy="float32", **options)
  out = out[0] if options.get("return_residual") else out
  expected = reference_attention(*(x.astype(jnp.float64) for x in (q, k, v)), **ref_options)
  assert rel_err(out, expected) < TOL


def test_sinks_fall_back_but_plain_calls_do_not_warn(stand_in):
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(1, 32, 2, 2, 16)
  with pytest.warns(UserWarning, match="the lse is an output"):
    ring_attention(q, k, v, mesh=mesh, kernel="cudnn", policy="float32", sinks=jnp.zeros(2))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ring_attention(q, k, v, mesh=mesh, kernel="cudnn", policy="float32", is_causal=True)


# --- The choice. ---


def test_auto_picks_cudnn_on_nvidia_gpus_and_says_why_not_elsewhere(caplog):
  h100 = "NVIDIA H100 80GB HBM3"
  choice = choose_kernel("auto", "gpu", 128, BF16, device_kind=h100)
  assert choice.kernel == "cudnn" and choice.auto
  assert choose_kernel("auto", "gpu", 64, BF16).kernel == "cudnn"  # a GPU of unknown kind: CUDA's
  assert choose_kernel("auto", "cuda", 256, BF16, device_kind=h100).kernel == "cudnn"
  with caplog.at_level("INFO", logger="jax_ring"):
    f32 = choose_kernel("auto", "gpu", 128, "float32", device_kind=h100)
    a100 = choose_kernel("auto", "gpu", 256, BF16, device_kind="NVIDIA A100-SXM4-80GB")
    odd = choose_kernel("auto", "gpu", 20, BF16, device_kind=h100)
  assert f32.kernel == "pallas" and a100.kernel == "pallas" and odd.kernel == "xla"
  logged = " ".join(r.getMessage() for r in caplog.records)
  assert "compute dtype float32" in logged and "head_dim=256" in logged and "up to 128" in logged
  assert "head_dim=20" in logged
  for platform, kind in (("rocm", None), ("gpu", "AMD Instinct MI300X"), ("tpu", "TPU v5 lite")):
    assert choose_kernel("auto", platform, 128, BF16, device_kind=kind).kernel == "pallas"
  assert choose_kernel("auto", "cpu", 128).kernel == "xla"


def test_kernel_cudnn_off_nvidia_gpus_is_a_value_error_naming_the_platform():
  with pytest.raises(ValueError, match="kernel='cudnn'.*platform 'cpu'"):
    choose_kernel("cudnn", "cpu", 64)
  with pytest.raises(ValueError, match="kernel='cudnn'.*tpu"):
    choose_kernel("cudnn", "tpu", 128, BF16)
  mesh = make_mesh((2,), ("seq",))
  with pytest.raises(ValueError, match="platform 'cpu'"):
    ring_attention(*qkv(1, 32, 2, 2, 16), mesh=mesh, kernel="cudnn")
  with pytest.raises(ValueError, match=r"kernel='cudnn' must be one of \('auto', 'xla', 'pallas'\)"):
    jax_ring.dilated_attention(
      *qkv(1, 32, 2, 2, 16), segment_lengths=(16,), dilation_rates=(1,), kernel="cudnn"
    )


def test_kernel_cudnn_on_a_gpu_falls_back_with_a_warning():
  with pytest.warns(
    UserWarning, match="kernel='cudnn' runs the Pallas kernel instead: compute dtype float32"
  ):
    choice = choose_kernel("cudnn", "gpu", 128, "float32")
  assert choice.kernel == "pallas" and choice.asked == "cudnn"
  with pytest.warns(UserWarning, match="runs the XLA tiles instead: head_dim=12"):
    assert choose_kernel("cudnn", "gpu", 12, BF16).kernel == "xla"


def test_the_private_api_is_checked_once_and_a_change_is_a_reason(monkeypatch):
  """This jax's private cuDNN primitives are the ones the kernel calls; a signature that
  differs is a reason to pass cuDNN over (with auto: the Pallas kernel)."""
  assert _cudnn.API_PROBLEM is None and _cudnn._API is not None
  fa = _cudnn._API
  monkeypatch.setattr(fa, "_dot_product_attention_bwd_impl", lambda query, key, value: None)
  api, why = _cudnn._private_api()
  assert api is None and "_dot_product_attention_bwd_impl takes ['query', 'key', 'value']" in why
  monkeypatch.setattr(_cudnn, "API_PROBLEM", why)
  choice = choose_kernel("auto", "gpu", 128, BF16)
  assert choice.kernel == "pallas"
  with pytest.warns(UserWarning, match="_dot_product_attention_bwd_impl takes"):
    choose_kernel("cudnn", "gpu", 128, BF16)


def test_the_xla_twin_is_the_attention_cudnn_computes():
  """The twin's forward against the float64 definition on one block (causal at the top
  left for T != S), and its backward from the block's own output and lse against
  jax.vjp of the definition."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 4, 12, 8)).astype(np.float32)
  k, v = (rng.standard_normal((1, 2, 8, 8)).astype(np.float32) for _ in range(2))
  do = rng.standard_normal(q.shape).astype(np.float32)
  as_btnh = lambda x: jnp.swapaxes(jnp.asarray(x, jnp.float64), 1, 2)
  for causal in (False, True):
    out, lse = _cudnn._xla_forward(*map(jnp.asarray, (q, k, v)), causal=causal)
    ref = lambda q, k, v, causal=causal: jnp.swapaxes(
      reference_attention(as_btnh(q), as_btnh(k), as_btnh(v), is_causal=causal, scale=1.0), 1, 2
    )
    expected, vjp = jax.vjp(ref, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    assert rel_err(out, expected) < TOL
    grads = _cudnn._xla_backward(*map(jnp.asarray, (q, k, v)), out, jnp.asarray(do), lse, causal=causal)
    for got, want in zip(grads, vjp(jnp.asarray(do, jnp.float64))):
      assert rel_err(got, want) < TOL
