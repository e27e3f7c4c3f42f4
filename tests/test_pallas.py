"""The Pallas block kernels (jax_ring._pallas): in interpret mode on this CPU against
the float64 dense definition (outputs, lse, and the gradients from the global lse and
delta), and lowered for CUDA through jax.export, so a kernel Triton cannot compile
fails here rather than on a GPU. Then the ring, dilated attention and the modules with
`kernel="pallas"` against the float64 references on 1 to 4 devices, the kernel choice,
and the whole jitted ring (forward and backward) exported for CUDA.

The kernel-level tests run the kernels with x64 off (as a GPU user would); the ring
tests with x64 on (the suite's default), which the kernels also support.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, forward_and_vjp, make_mesh, padded_segments, qkv, rel_err
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import _mosaic, choose_kernel, reference_attention, ring_attention
from jax_ring._kernel import MaskSpec
from jax_ring._pallas import Launch, Tuning, backward, check_blocks, forward, tuning_for
from jax_ring._ring import _q_natural  # blocked [nq, B, K, G, bq, ...] -> [B, N, T, ...]

B, N, K, H = 2, 4, 2, 16  # GQA: two query heads per kv head


def _inputs(tq, tk, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, N, tq, H)).astype(np.float32) * 0.5
  k = rng.standard_normal((B, K, tk, H)).astype(np.float32)
  v = rng.standard_normal((B, K, tk, H)).astype(np.float32)
  do = rng.standard_normal((B, N, tq, H)).astype(np.float32)
  return q, k, v, do


CASES = {
  # name: (spec, q positions, k positions, q ids, k ids)
  "full": (MaskSpec(), np.arange(32), np.arange(48), None, None),
  # A later query shard against an earlier key shard with padding at its end and a
  # window: some tiles whole, some hidden (skipped), some masked.
  "causal_window_padding_segments": (
    MaskSpec(is_causal=True, window=(40, 0), has_padding=True),
    np.arange(32) + 48,
    np.concatenate([np.arange(40) + 24, -np.ones(8, int)]),
    np.stack([np.repeat([0, 1], 16), np.concatenate([-np.ones(8, int), np.ones(24, int)])]),
    np.stack([np.repeat([0, 1], 24), np.ones(48, int)]),
  ),
  # Key blocks that start at a query block's last position: one visible key each
  # (a skip test off by one fails here).
  "causal_edge": (MaskSpec(is_causal=True), np.arange(32), np.arange(48) + 15, None, None),
  # Queries before every key: every row sees nothing (output 0, lse -inf, no gradient).
  "causal_nothing_visible": (MaskSpec(is_causal=True), np.arange(32), np.arange(48) + 100, None, None),
  # Two key blocks of the TPU kernel's (128): the window hides the first (keys before
  # 140), padding ends the second.
  "window_padding_long_keys": (
    MaskSpec(is_causal=True, window=(60, 0), has_padding=True),
    np.arange(32) + 200,
    np.where(np.arange(256) < 240, np.arange(256), -1),
    None,
    None,
  ),
}
# A compiled GPU launch's own tiling, interpreted: programs hold 16 rows of the ring's
# 32-row query blocks (forward, dq), dk/dv steps through them 16 at a time, and the
# exponentials run as exp2 of log2(e)-scaled scores (`_pallas.Tuning`).
_HALVES = Tuning(Launch(16, 16, 4, 1), Launch(16, 16, 4, 1), Launch(16, 16, 4, 1), exp2=True)
STYLES = {
  # style: (forward, backward, (block_q, block_k) for key length tk)
  "gpu": (forward, backward, lambda tk: (16, 16)),
  "gpu-launch": (
    functools.partial(forward, tuning=_HALVES),
    functools.partial(backward, tuning=_HALVES),
    lambda tk: (32, 16),
  ),
  "tpu": (_mosaic.forward, _mosaic.backward, lambda tk: (8, 128 if tk % 128 == 0 else tk)),
}


def _dense(spec, qp, kp, qs, ks):
  """Float64 dense attention of pre-scaled q with these masks: (out, lse)."""
  mask = (kp[None, :] >= 0) if spec.has_padding else np.ones((len(qp), len(kp)), bool)
  if spec.is_causal:
    mask = mask & (kp[None, :] <= qp[:, None])
  if spec.window is not None:
    left, right = spec.window
    mask = mask & (kp[None, :] >= qp[:, None] - left) & (kp[None, :] <= qp[:, None] + right)
  mask = np.broadcast_to(mask, (B, len(qp), len(kp)))
  if qs is not None:
    mask = mask & (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] >= 0)
  mask = jnp.asarray(mask)[:, None]

  def attend(q, k, v):
    k, v = jnp.repeat(k, N // K, axis=1), jnp.repeat(v, N // K, axis=1)
    s = jnp.where(mask, jnp.einsum("bnqh,bnkh->bnqk", q, k), -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    seen = jnp.isfinite(lse)
    p = jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None])
    out = jnp.einsum("bnqk,bnkh->bnqh", p, v)
    return jnp.where(seen[..., None], out, 0.0), lse

  return attend


@functools.cache
def _run(name, style="gpu"):
  """Kernel results (x64 off) of one style and the float64 reference for one case."""
  spec, qp, kp, qs, ks = CASES[name]
  fwd, bwd, blocks_for = STYLES[style]
  block_q, block_k = blocks_for(len(kp))
  q, k, v, do = _inputs(len(qp), len(kp))
  ints = [None if x is None else np.asarray(x, np.int32) for x in (qp, kp, qs, ks)]
  attend = _dense(spec, *ints)
  f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, do)]
  (ref_out, ref_lse), vjp = jax.vjp(attend, *f64[:3])
  ref_grads = vjp((f64[3], jnp.zeros_like(ref_lse)))
  with jax.enable_x64(False):
    blocks = dict(spec=spec, block_q=block_q, block_k=block_k, interpret=True)
    out, lse = fwd(q, k, v, *ints, **blocks)
    delta = jnp.sum(jnp.asarray(do) * out, axis=-1)
    grads = bwd(q, k, v, do, lse, delta, *ints, **blocks)
  return (out, lse, grads), (ref_out, ref_lse, ref_grads)


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_dense_float64(name, style):
  (out, lse, _), (ref_out, ref_lse, _) = _run(name, style)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert rel_err(out, ref_out) < 1e-5 or np.abs(ref_out).max() == 0 and np.abs(out).max() == 0
  seen = np.isfinite(ref_lse)
  if seen.any():
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
  if name == "causal_nothing_visible":
    assert not seen.any() and np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("name", list(CASES))
def test_backward_from_global_lse_matches_dense_float64(name, style):
  (_, _, grads), (_, _, ref_grads) = _run(name, style)
  for label, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
    ref = np.asarray(ref)
    assert np.shape(g) == ref.shape, label
    if np.abs(ref).max() == 0:
      assert np.all(np.asarray(g) == 0), label
    else:
      assert rel_err(g, ref) < 1e-5, (label, rel_err(g, ref))


def test_partly_masked_cases_skip_and_mask():
  """The masked cases really have hidden rows and hidden key blocks (not vacuous tests)."""
  _, (_, ref_lse, _) = _run("causal_window_padding_segments")
  seen = np.isfinite(np.asarray(ref_lse))
  assert seen.any() and not seen.all()
  _, (_, _, (_, ref_dk, _)) = _run("window_padding_long_keys")
  ref_dk = np.abs(np.asarray(ref_dk))
  assert (
    ref_dk[:, :, :140].max() == 0
    and ref_dk[:, :, 140:232].min(axis=-1).all()
    and ref_dk[:, :, 232:].max() == 0
  )


@pytest.mark.parametrize("name", ["full", "causal_window_padding_segments"])
def test_kernels_lower_to_triton_for_cuda(name):
  spec, qp, kp, qs, ks = CASES[name]
  q, k, v, do = _inputs(len(qp), len(kp))
  ints = [None if x is None else np.asarray(x, np.int32) for x in (qp, kp, qs, ks)]
  lse = np.zeros((B, N, len(qp)), np.float32)
  blocks = dict(spec=spec, block_q=16, block_k=16)
  triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  with jax.enable_x64(False):
    fwd = jax.export.export(
      jax.jit(lambda *a: forward(*a, **blocks)), platforms=("cuda",), disabled_checks=triton
    )(q, k, v, *ints)
    bwd = jax.export.export(
      jax.jit(lambda *a: backward(*a, **blocks)), platforms=("cuda",), disabled_checks=triton
    )(q, k, v, do, lse, lse, *ints)
  launches = tuning_for(jnp.float32, H)  # compiled, the launches are the GPU defaults
  for exported, used in ((fwd, [launches.forward]), (bwd, [launches.dq, launches.dkv])):
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == len(used)
    assert exported.platforms == ("cuda",)
    # The Triton IR was built and attached, with each kernel's launch.
    assert sorted(map(int, re.findall(r"num_warps = (\d+)", text))) == sorted(x.num_warps for x in used)
    assert sorted(map(int, re.findall(r"num_stages = (\d+)", text))) == sorted(x.num_stages for x in used)


@pytest.mark.parametrize(
  "args, match",
  [
    ((32, 48, 16, 24, 16), "block_q=24: the Pallas kernel needs a power of two"),
    ((32, 48, 16, 16, 8), "block_k=8"),
    ((32, 48, 16, 64, 16), "divides the shard length 32"),
    ((32, 48, 12, 16, 16), "head_dim=12"),
  ],
)
def test_block_checks(args, match):
  with pytest.raises(ValueError, match=match):
    check_blocks(*args)


@pytest.mark.parametrize("style", ["gpu", "tpu"])
def test_kernels_agree_with_the_xla_tiles_on_the_same_blocks(style, monkeypatch):
  """One ring step (a query shard against one K/V shard) through the ring's own entry
  points, `ring_forward_state` and `ring_backward_state`, with the XLA tiles and with
  each Pallas kernel: the same (out, lse) and (dq, dk, dv) from the same blocked inputs,
  so the kernels keep the XLA tiles' contract (pre-scaled q, natural-log lse, dq scaled
  back, the layouts converted both ways)."""
  from jax_ring._ring import RingConfig, prepare, ring_backward_state, ring_forward_state
  from jax_ring._tiles import block_q, block_rows

  monkeypatch.setattr(jax_ring._ring, "INTERPRET_STYLE", style)
  spec, qp, kp, qs, ks = CASES["window_padding_long_keys"]
  qs = np.stack([np.repeat([0, 1], 16), np.repeat([1, -1], 16)])  # ids too: a row of padding
  ks = np.stack([np.repeat([0, 1], 128), np.ones(256, int)])
  q, k, v, do = (jnp.asarray(np.swapaxes(x, 1, 2)) for x in _inputs(len(qp), len(kp)))  # [B, T, heads, H]
  ints = [jnp.asarray(x, jnp.int32) for x in (qp, kp, qs, ks)]
  results = {}
  for kernel, blocks in (("xla", (16, 16)), ("pallas", (16, 16) if style == "gpu" else (16, 128))):
    cfg = RingConfig(None, 1, spec, 0.5, jax_ring.Policy(), *blocks, 0, 0, kernel=kernel)
    x = prepare(cfg, q, k, v, *ints)
    out, lse = ring_forward_state(cfg, x)
    natural_out = jnp.swapaxes(_q_natural(out), 1, 2).reshape(q.shape)
    delta = block_rows(jnp.sum(do * natural_out, axis=-1).reshape(B, -1, K, N // K), cfg.block_q)
    do_b = block_q(do.reshape(B, -1, K, N // K, H), cfg.block_q)
    grads = ring_backward_state(cfg, x, do_b, lse, delta)
    results[kernel] = (
      _q_natural(out),
      _q_natural(lse),
      _q_natural(grads[0]),
      *(_ring_kv(g) for g in grads[1:]),
    )
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["pallas"], results["xla"], strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, name
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
    np.testing.assert_allclose(
      np.where(np.isinf(a), 0, a), np.where(np.isinf(b), 0, b), atol=2e-5, err_msg=name
    )
  assert np.isneginf(np.asarray(results["xla"][1])).any()  # the padding row sees nothing


def _ring_kv(x):
  """Blocked [nk, B, K, bk, H] -> [B, K, S, H]."""
  return jnp.moveaxis(x, 0, 2).reshape(x.shape[1], x.shape[2], -1, x.shape[4])


# The ring with the Pallas kernel -------------------------------------------------------

TOL = 1e-5
# name -> (devices, heads, kv heads, length, options); lengths that pad the kernel's
# blocks (61, 70), every layout, GQA and MQA, masks, segment ids with padding.
RING_CASES = {
  "full_contiguous": (2, 4, 4, 64, {}),
  "causal_zigzag_gqa": (4, 8, 2, 128, {"is_causal": True}),
  "causal_striped_padded": (3, 4, 2, 61, {"is_causal": True, "layout": "striped"}),
  "segments_padding_mqa": (2, 4, 1, 64, {"segment_ids": "padded"}),
  "window_contiguous": (4, 4, 2, 70, {"local_window_size": (9, 4), "layout": "contiguous"}),
  "causal_window_one_device": (1, 4, 2, 64, {"is_causal": True, "local_window_size": 6}),
}


def _ring_case(name):
  devices, heads, kv_heads, length, options = RING_CASES[name]
  options = dict(options)
  if options.get("segment_ids") == "padded":
    options["segment_ids"] = padded_segments(2, length)
  return make_mesh((devices,), ("seq",)), qkv(2, length, heads, kv_heads, 16), options


@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_with_pallas_kernel_matches_reference(name):
  _ring_with_kernel_matches_reference(name)


@pytest.mark.parametrize("name", ["causal_zigzag_gqa", "segments_padding_mqa", "window_contiguous"])
def test_ring_with_tpu_kernel_matches_reference(name, monkeypatch):
  """The same with the TPU (Mosaic) kernels interpreted where the program runs on CPU.
  The style is read while JAX traces, and the GPU-style test above traced these very
  shapes: without clearing JAX's caches the cached trace (Triton kernels) would run.
  Each interpreted call of the Mosaic kernels is counted, forward and backward."""
  traced = {"forward": 0, "backward": 0}

  def counting(name, kernel):
    def run(*args, **options):
      traced[name] += options.get("interpret", False)
      return kernel(*args, **options)

    return run

  for kernel in traced:
    monkeypatch.setattr(jax_ring._mosaic, kernel, counting(kernel, getattr(jax_ring._mosaic, kernel)))
  monkeypatch.setattr(jax_ring._ring, "INTERPRET_STYLE", "tpu")
  jax.clear_caches()
  _ring_with_kernel_matches_reference(name)
  assert traced["forward"] > 0 and traced["backward"] > 0, traced


def _ring_with_kernel_matches_reference(name):
  mesh, args, options = _ring_case(name)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, kernel="pallas", **options)
  ref = functools.partial(reference_attention, **{k: v for k, v in options.items() if k != "layout"})
  compare_with_reference(fn, ref, args, TOL)


def test_ring_with_pallas_kernel_ulysses_hybrid():
  mesh = make_mesh((2, 2), ("seq", "u"))
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, ulysses_axis="u", is_causal=True, kernel="pallas")
  compare_with_reference(
    fn, functools.partial(reference_attention, is_causal=True), qkv(2, 64, 4, 2, 16), TOL
  )


@pytest.mark.parametrize("preset", ["bfloat16", "float16"])
def test_ring_with_pallas_kernel_half_precision(preset):
  """Half-precision matmul inputs through the kernel (float32 statistics): output and
  gradients within 1e-2 of float64, no worse than the XLA tiles with the same policy."""
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 256, 4, 2, 32)
  cot = jax.random.normal(jax.random.PRNGKey(5), args[0].shape, jnp.float32)
  ref_fn = functools.partial(reference_attention, is_causal=True)
  ref = forward_and_vjp(ref_fn)(tuple(x.astype(jnp.float64) for x in args), cot.astype(jnp.float64))
  errors = {}
  for kernel in ("pallas", "xla"):
    fn = functools.partial(ring_attention, mesh=mesh, is_causal=True, policy=preset, kernel=kernel)
    out, vjp = jax.vjp(jax.jit(fn), *args)
    got = (out, vjp(cot))
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    errors[kernel] = [rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)]
  for e_pallas, e_xla in zip(errors["pallas"], errors["xla"], strict=True):
    assert e_pallas < 1e-2 and e_pallas <= 1.5 * e_xla + 1e-4, errors


def test_ring_with_pallas_kernel_lse_and_rows_that_see_nothing():
  """Cross-attention (S != T) with per-row lengths: padding queries get 0, queries
  before every valid key (causal, keys shifted by a window) get 0 and lse -inf; the
  lse is exact and differentiable."""
  mesh = make_mesh((2,), ("seq",))
  q = qkv(2, 48, 4, 2, 16)[0]
  _, k, v = qkv(2, 32, 4, 2, 16, seed=1)
  lengths = dict(query_seq_lengths=jnp.array([48, 30]), key_value_seq_lengths=jnp.array([32, 20]))
  options = dict(local_window_size=(4, 0), is_causal=True, **lengths)

  def fn(q, k, v):
    return ring_attention(q, k, v, mesh=mesh, kernel="pallas", return_residual=True, **options)

  ref = functools.partial(reference_attention, return_residual=True, **options)
  (out, lse), _ = compare_with_reference(fn, ref, (q, k, v), TOL)
  lse = np.asarray(lse)
  assert np.isneginf(lse[1, 30:]).all() and np.isneginf(lse[1, 25:30]).all()  # rows past kv length 20 + 4
  assert np.isfinite(lse[0, :36]).all() and np.isneginf(lse[0, 36:]).all()
  assert np.all(np.asarray(out)[np.isneginf(lse)] == 0)


def test_ring_shard_with_pallas_kernel_inside_shard_map():
  """ring_attention_shard(kernel="pallas") in the caller's shard_map: needs
  check_vma=False on CPU (jax's Pallas interpreter), and says so otherwise."""
  mesh = make_mesh((4,), ("seq",))
  seq = P(None, "seq")
  args = qkv(1, 128, 4, 2, 16)
  on_mesh = lambda f: lambda *a: f(*(jax.reshard(x, jax.NamedSharding(mesh, seq)) for x in a))

  def inner(q, k, v):
    return jax_ring.ring_attention_shard(
      q, k, v, axis_name="seq", is_causal=True, layout="contiguous", kernel="pallas"
    )

  sharded = on_mesh(jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq, check_vma=False))
  compare_with_reference(sharded, functools.partial(reference_attention, is_causal=True), args, TOL)
  checked = jax.jit(on_mesh(jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)))
  with pytest.raises(ValueError, match=r"ring_attention_shard\(kernel='pallas'\) on CPU .* check_vma=False"):
    checked(*args)


@pytest.mark.parametrize("devices", [None, 2])
def test_dilated_with_pallas_kernel_matches_reference(devices):
  mesh = None if devices is None else make_mesh((devices,), ("seq",))
  patterns = dict(segment_lengths=(16, 64), dilation_rates=(1, 2), is_causal=True)
  args = qkv(2, 96, 4, 2, 16, seed=5)
  fn = lambda q, k, v: jax_ring.dilated_attention(q, k, v, mesh=mesh, kernel="pallas", **patterns)
  compare_with_reference(fn, functools.partial(jax_ring.reference_dilated_attention, **patterns), args, TOL)


def test_modules_pass_the_kernel_on():
  """RingAttention and DilatedAttention with attention_kernel="pallas", and Flax's
  MultiHeadAttention with make_attention_fn(kernel="pallas"), equal the same modules
  on the XLA tiles (same parameters)."""
  from flax import nnx

  from jax_ring import nn

  mesh = make_mesh((2,), ("seq",))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 32))
  ring = lambda kernel: nn.RingAttention(
    2, 32, mesh=mesh, is_causal=True, attention_kernel=kernel, rngs=nnx.Rngs(0)
  )
  dilated = lambda kernel: nn.DilatedAttention(
    2,
    32,
    segment_lengths=(16, 64),
    dilation_rates=(1, 2),
    mesh=mesh,
    attention_kernel=kernel,
    rngs=nnx.Rngs(0),
  )
  for make in (ring, dilated):
    assert rel_err(make("pallas")(x), make("xla")(x)) < TOL
  # Flax's own MultiHeadAttention with jax_ring's attention_fn.
  flax_mha = lambda kernel: nnx.MultiHeadAttention(
    num_heads=2,
    in_features=32,
    qkv_features=32,
    decode=False,
    attention_fn=nn.make_attention_fn(mesh=mesh, is_causal=True, kernel=kernel),
    rngs=nnx.Rngs(0),
  )
  assert rel_err(flax_mha("pallas")(x), flax_mha("xla")(x)) < TOL


# The kernel choice -----------------------------------------------------------------

FLOAT32 = jax_ring.Policy()


def test_auto_picks_xla_on_cpu_and_pallas_on_gpu():
  """The Pallas kernel on GPUs where cuDNN is passed over (a ROCm GPU; float32 inputs;
  on NVIDIA GPUs it comes first: tests/test_cudnn.py)."""
  assert choose_kernel("auto", "cpu", 64, FLOAT32).kernel == "xla"
  gpu = choose_kernel("auto", "rocm", 64, jax_ring.PRESETS["bfloat16"])
  assert gpu.kernel == "pallas" and not gpu.interpret
  assert choose_kernel("auto", "gpu", 64, FLOAT32).kernel == "pallas"
  cpu = choose_kernel("pallas", "cpu", 64, FLOAT32)
  assert cpu.kernel == "pallas" and cpu.interpret
  assert choose_kernel("auto", "tpu", 128, FLOAT32).kernel == "pallas"
  assert choose_kernel("xla", "gpu", 64, FLOAT32).kernel == "xla"


@pytest.mark.parametrize("policy", [None, "bfloat16", "float32"])
def test_choose_kernel_takes_none_and_preset_names(policy):
  """As every other `policy=` does (the kernels guide's call: policy None)."""
  assert choose_kernel("auto", "cpu", 64, policy).kernel == "xla"
  assert choose_kernel("auto", "rocm", 64, policy).kernel == "pallas"
  assert choose_kernel("auto", "rocm", 24, policy).kernel == "xla"
  # cuDNN takes bf16 inputs and head dims that are multiples of 8, 24 among them.
  assert choose_kernel("auto", "gpu", 24, policy).kernel == ("xla" if policy == "float32" else "cudnn")
  assert choose_kernel("auto", "cpu", 64).kernel == "xla"
  with pytest.raises(ValueError, match="compute dtype float64"):
    choose_kernel("pallas", "gpu", 64, "float64")
  with pytest.raises(ValueError, match="policy='f32' is not a preset"):
    choose_kernel("auto", "gpu", 64, "f32")


@pytest.mark.parametrize(
  "platform, head_dim, policy, reason",
  [
    ("gpu", 24, "float32", "head_dim=24"),
    ("gpu", 512, "float32", "head_dim=512"),
    ("gpu", 64, "float64", "float64"),
    ("neuron", 64, "float32", "platform 'neuron'"),
  ],
)
def test_auto_falls_back_with_the_reason_and_pallas_refuses(platform, head_dim, policy, reason):
  choice = choose_kernel("auto", platform, head_dim, jax_ring.PRESETS[policy])
  assert choice.kernel == "xla" and reason in choice.reason
  with pytest.raises(ValueError, match=f"kernel='pallas': .*{reason}"):
    choose_kernel("pallas", platform, head_dim, jax_ring.PRESETS[policy])


def test_unknown_kernel_names_the_argument():
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(1, 32, 2, 2, 16)
  names = r"\('auto', 'xla', 'pallas', 'cudnn'\)"
  with pytest.raises(ValueError, match=rf"kernel='triton' must be one of {names}"):
    ring_attention(q, k, v, mesh=mesh, kernel="triton")
  with pytest.raises(ValueError, match="head_dim=8"):
    ring_attention(*qkv(1, 32, 2, 2, 8), mesh=mesh, kernel="pallas")
  with pytest.raises(ValueError, match="block_q=24: the Pallas kernel needs a power of two"):
    ring_attention(q, k, v, mesh=mesh, kernel="pallas", block_sizes=jax_ring.BlockSizes(block_q=24))
  with pytest.raises(ValueError, match="kernel='cuda' must be one of"):
    jax_ring.dilated_attention(q, k, v, segment_lengths=(16,), dilation_rates=(1,), kernel="cuda")


def test_auto_on_an_accelerator_falls_back_where_block_sizes_do_not_suit(monkeypatch, caplog):
  """ "auto" where the Pallas kernel is picked (the mesh's platform reported as a GPU;
  the program still lowers for this CPU, so the kernel runs interpreted): the call's own
  BlockSizes that Triton cannot take send it to the XLA tiles, logged, not to an error;
  "pallas" with the same BlockSizes is a ValueError. Both results are exact."""
  monkeypatch.setattr(jax_ring._attention, "mesh_platform", lambda: "gpu")
  jax.clear_caches()  # read while tracing
  mesh = make_mesh((2,), ("seq",))
  seq = P(None, "seq")
  args = qkv(1, 64, 4, 2, 16)

  def run(kernel, block_sizes=None):
    def inner(q, k, v):
      return jax_ring.ring_attention_shard(
        q, k, v, axis_name="seq", is_causal=True, layout="contiguous", kernel=kernel, block_sizes=block_sizes
      )

    sharded = jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq, check_vma=False)
    return jax.jit(lambda *a: sharded(*(jax.reshard(x, jax.NamedSharding(mesh, seq)) for x in a)))

  ref = reference_attention(*(x.astype(jnp.float64) for x in args), is_causal=True)
  with caplog.at_level("INFO", logger="jax_ring"):
    odd = jax_ring.BlockSizes(block_q=24, block_kv=32)
    out = run("auto", odd)(*args)
  assert any("block_q=24" in r.getMessage() for r in caplog.records)
  assert rel_err(out, ref) < TOL
  traced = lambda fn: str(jax.make_jaxpr(fn)(*args))
  assert "jax_ring_forward" in traced(run("auto"))  # no BlockSizes: the kernel
  assert "jax_ring_forward" not in traced(run("auto", odd))
  with pytest.raises(ValueError, match="kernel='pallas': block_q=24"):
    run("pallas", odd)(*args)


def test_auto_fallback_reason_is_logged(caplog):
  with caplog.at_level("INFO", logger="jax_ring"):
    choice = choose_kernel("auto", "gpu", 24, FLOAT32)
  assert choice.kernel == "xla"
  assert any("head_dim=24" in r.getMessage() and r.levelname == "INFO" for r in caplog.records)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ring_with_pallas_kernel_exports_for_gpu_and_tpu(platform):
  """The jitted forward and backward of the ring with the kernel, lowered for CUDA
  (Triton) and TPU (Mosaic) on this CPU: one custom call each for the forward, dq and
  dk/dv kernels, K/V moved by collective permutes; a block shape or an operation the
  compiler's lowering rejects fails here."""
  mesh = make_mesh((4,), ("seq",))
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = ring_attention(q, k, v, mesh=mesh, is_causal=True, policy="bfloat16", kernel="pallas")
    return jnp.sum(out.astype(jnp.float32))

  call, names = {
    "cuda": ("__gpu$xla.gpu.triton", ("jax_ring_forward", "jax_ring_backward_dq", "jax_ring_backward_dkv")),
    "tpu": (
      "tpu_custom_call",
      ("jax_ring_tpu_forward", "jax_ring_tpu_backward_dq", "jax_ring_tpu_backward_dkv"),
    ),
  }[platform]
  checks = [jax.export.DisabledSafetyCheck.custom_call(call)]
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  exported = jax.export.export(grad, platforms=(platform,), disabled_checks=checks)(q, kv, kv)
  text = exported.mlir_module()
  assert exported.platforms == (platform,) and exported.nr_devices == 4
  assert text.count(f"stablehlo.custom_call @{call}") == 3  # forward, dq, dk/dv
  for name in names:
    assert name in text, name
  assert "collective_permute" in text
  if platform == "cuda":
    assert "num_warps = 4" in text  # the Triton IR was built and attached


@pytest.mark.parametrize("platform, call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_ring_with_pallas_kernel_lowers_under_check_vma(platform, call):
  """Compiled (not interpreted) kernels type their results for shard_map's check_vma:
  the ring with the kernel inside a check_vma=True shard_map lowers for GPU and TPU
  (only CPU's interpreter needs check_vma=False)."""
  from jax_ring._ring import RingConfig, ring

  mesh = make_mesh((4,), ("seq",))
  cfg = RingConfig(
    axis_name="seq",
    ring_size=4,
    mask=MaskSpec(is_causal=True),
    scale=0.125,
    policy=jax_ring.PRESETS["bfloat16"],
    block_q=128,
    block_kv=128,
    steps_back=3,
    steps_fwd=0,
    kernel="pallas",
  )

  def inner(q, k, v):
    pos = (jax.lax.axis_index("seq") * q.shape[1] + jnp.arange(q.shape[1])).astype(jnp.int32)
    return ring(cfg, q, k, v, pos, pos, None, None)[0]

  seq = P(None, "seq")
  sharded = jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)  # check_vma=True
  loss = lambda q, k, v: jnp.sum(sharded(q, k, v).astype(jnp.float32))
  x = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16, sharding=jax.NamedSharding(mesh, seq))
  checks = [jax.export.DisabledSafetyCheck.custom_call(call)]
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  exported = jax.export.export(grad, platforms=(platform,), disabled_checks=checks)(x, x, x)
  assert exported.mlir_module().count(f"stablehlo.custom_call @{call}") == 3
