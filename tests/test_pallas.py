"""The Pallas block kernels (jax_ring._pallas): in interpret mode on this CPU against
the float64 dense definition (outputs, lse, and the gradients from the global lse and
delta), and lowered for CUDA through jax.export, so a kernel Triton cannot compile
fails here rather than on a GPU.

The kernels run with x64 off (Pallas kernels mix int32 and int64 indices under x64);
the references run in float64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from jax_ring._kernel import MaskSpec
from jax_ring._pallas import backward, check_blocks, forward

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
def _run(name):
  """Kernel results (x64 off) and the float64 reference for one case."""
  spec, qp, kp, qs, ks = CASES[name]
  q, k, v, do = _inputs(len(qp), len(kp))
  ints = [None if x is None else np.asarray(x, np.int32) for x in (qp, kp, qs, ks)]
  attend = _dense(spec, *ints)
  f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, do)]
  (ref_out, ref_lse), vjp = jax.vjp(attend, *f64[:3])
  ref_grads = vjp((f64[3], jnp.zeros_like(ref_lse)))
  with jax.enable_x64(False):
    blocks = dict(spec=spec, block_q=16, block_k=16, interpret=True)
    out, lse = forward(q, k, v, *ints, **blocks)
    delta = jnp.sum(jnp.asarray(do) * out, axis=-1)
    grads = backward(q, k, v, do, lse, delta, *ints, **blocks)
  return (out, lse, grads), (ref_out, ref_lse, ref_grads)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_dense_float64(name):
  (out, lse, _), (ref_out, ref_lse, _) = _run(name)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert rel_err(out, ref_out) < 1e-5 or np.abs(ref_out).max() == 0 and np.abs(out).max() == 0
  seen = np.isfinite(ref_lse)
  if seen.any():
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
  if name == "causal_nothing_visible":
    assert not seen.any() and np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_from_global_lse_matches_dense_float64(name):
  (_, _, grads), (_, _, ref_grads) = _run(name)
  for label, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
    ref = np.asarray(ref)
    if np.abs(ref).max() == 0:
      assert np.all(np.asarray(g) == 0), label
    else:
      assert rel_err(g, ref) < 1e-5, (label, rel_err(g, ref))


def test_partly_masked_case_skips_and_masks():
  """The masked case really has hidden, masked and visible rows (not a vacuous test)."""
  _, (_, ref_lse, _) = _run("causal_window_padding_segments")
  seen = np.isfinite(np.asarray(ref_lse))
  assert seen.any() and not seen.all()


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
  for exported, count in ((fwd, 1), (bwd, 2)):
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == count
    assert exported.platforms == ("cuda",)
    assert text.count("num_warps = 4") == count  # the Triton IR was built and attached


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
