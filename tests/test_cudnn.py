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
from conftest import compare_with_reference, cut_segments, make_mesh, qkv, rel_err

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
  with their K/V); and a pass of one step kept a loop (`_ring._steps`)."""
  monkeypatch.setattr(_ring, "LATE_DKV_PLATFORMS", _ring.LATE_DKV_PLATFORMS + ("cpu",))
  monkeypatch.setattr(_ring, "ONE_STEP_LOOP_PLATFORMS", _ring.ONE_STEP_LOOP_PLATFORMS + ("cpu",))
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


def _check_masked(devices, layout, window=None, documents=False, pad=False):
  """Causal ring, kernel="cudnn", against float64: a window (contiguous layout) and/or
  documents of mixed lengths crossing shards (two rows, one shifted by 3 tokens)."""
  mesh = make_mesh((devices,), ("seq",))
  n = 16 * devices
  args = qkv(2, n, 4, 2, 16, seed=devices + (window or 0))
  masks = {"is_causal": True}
  if window is not None:
    masks["local_window_size"] = (window, 0)
  if documents:
    masks["segment_ids"] = cut_segments(n, sorted({1, 2, 7, n // 2 + 1, n - 5}), n - 2 if pad else None)

  def fn(q, k, v):
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # no fallback: every call runs the cuDNN steps
      return ring_attention(q, k, v, mesh=mesh, layout=layout, kernel="cudnn", policy="float32", **masks)

  ref = lambda q, k, v: reference_attention(q, k, v, **masks)
  compare_with_reference(fn, ref, args, TOL)
  assert _cudnn_ran(fn, *args)


slow = pytest.mark.slow


# The steps' masks are checked on 1 to 8 devices above; end to end, each program takes
# 4-20 s to compile here, so these run 1, 2, 4 and 8 devices between them.
@pytest.mark.parametrize(
  "devices, window",
  [(1, 5), (4, 20), (4, 40), pytest.param(2, 20, marks=slow), pytest.param(8, 40, marks=slow)],
)
def test_cudnn_ring_with_a_window_equals_float64(stand_in, late, devices, window):
  """Windows inside a shard, across one step and across two: the diagonal under cuDNN's
  sliding window, whole steps, and the steps the window's edge crosses in XLA."""
  _check_masked(devices, "contiguous", window=window)


@pytest.mark.parametrize(
  "devices, layout",
  [
    (4, "contiguous"),
    (2, "zigzag"),
    pytest.param(1, "contiguous", marks=slow),
    pytest.param(8, "zigzag", marks=slow),
  ],
)
def test_cudnn_ring_with_documents_equals_float64(stand_in, late, devices, layout, monkeypatch):
  """Documents of 1 to 18 tokens crossing shards, a padded tail: packed calls on the
  diagonal (two documents a call here, so it takes several) and the one document an
  earlier shard shares with the queries in the other steps."""
  monkeypatch.setattr(_ring, "MAX_DOCUMENTS", 2)
  _check_masked(devices, layout, documents=True, pad=True)


def test_cudnn_ring_with_documents_and_a_window_equals_float64(stand_in):
  """Both, on 4 devices with CPU's backward scheme."""
  _check_masked(4, "contiguous", window=12, documents=True)


def test_documents_split_over_the_ring_give_nan_not_a_wrong_number(stand_in):
  """The cuDNN steps take each document as one run of its id: ids that come back after
  another document (here 0, 1, 0) make the row's output NaN, and only that row's."""
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(2, 64, 4, 2, 16)
  ids = np.zeros((2, 64), np.int32)
  ids[0, 20:40] = 1  # row 0: document 0 comes back after document 1
  ids[1, 32:] = 1
  out = ring_attention(q, k, v, mesh=mesh, is_causal=True, kernel="cudnn", segment_ids=jnp.asarray(ids))
  assert bool(jnp.all(jnp.isnan(out[0]))) and bool(jnp.all(jnp.isfinite(out[1])))
  expected = reference_attention(q[1:], k[1:], v[1:], is_causal=True, segment_ids=jnp.asarray(ids[1:]))
  assert rel_err(out[1:], expected) < TOL


def test_the_twin_packs_documents_and_windows_as_cudnn_does():
  """`_cudnn._xla_forward` / `_xla_backward` with packed sequences (each query against
  its own sequence's keys, places counted from each sequence's start, rows in no
  sequence 0 and -inf) and with a window, against the float64 definition run on each
  sequence alone; cuDNN's sliding window length counts the query's own key."""
  rng = np.random.default_rng(1)
  b, n, t, h = 2, 2, 24, 8
  q, k, v, do = (jnp.asarray(rng.standard_normal((b, n, t, h)), jnp.float32) for _ in range(4))
  # Row 0: queries [0, 5) against keys [12, 17), queries [5, 17) against keys [0, 12)
  # (the keys of different sequences do not overlap, as in the ring's calls); row 1 one.
  seqs = _cudnn.Sequences(
    jnp.asarray([[5, 12], [20, -1]], jnp.int32),
    jnp.asarray([[5, 12], [20, -1]], jnp.int32),
    jnp.asarray([[0, 5, -1], [2, -1, -1]], jnp.int32),
    jnp.asarray([[12, 0, -1], [3, -1, -1]], jnp.int32),
  )
  as_btnh = lambda x: jnp.swapaxes(jnp.asarray(x, jnp.float64), 1, 2)
  for causal, window in ((False, None), (True, None), (True, 3)):
    out, lse = _cudnn._xla_forward(q, k, v, causal=causal, window=window, seqs=seqs)
    grads = _cudnn._xla_backward(q, k, v, out, do, lse, causal=causal, window=window, seqs=seqs)
    for row, pieces in ((0, [(0, 5, 12, 5), (5, 12, 0, 12)]), (1, [(2, 20, 3, 20)])):
      covered = np.zeros(t, bool)
      dk_expected = np.zeros((n, t, h))
      for qo, ql, ko, kl in pieces:
        covered[qo : qo + ql] = True
        window_arg = None if window is None else (window, 0)

        def ref(q_, k_, v_, causal=causal, window_arg=window_arg):
          o = reference_attention(
            as_btnh(q_), as_btnh(k_), as_btnh(v_), is_causal=causal, scale=1.0, local_window_size=window_arg
          )
          return jnp.swapaxes(o, 1, 2)

        piece = lambda x, o, n_, row=row: x[row : row + 1, :, o : o + n_]
        expected, vjp = jax.vjp(ref, piece(q, qo, ql), piece(k, ko, kl), piece(v, ko, kl))
        assert rel_err(out[row : row + 1, :, qo : qo + ql], expected) < TOL, (causal, window, row)
        dq_e, dk_e, _ = vjp(piece(do, qo, ql).astype(jnp.float64))
        assert rel_err(grads[0][row : row + 1, :, qo : qo + ql], dq_e) < TOL
        dk_expected[:, ko : ko + kl] += np.asarray(dk_e[0])
      assert rel_err(grads[1][row], dk_expected) < TOL, (causal, window, row)
      assert bool(jnp.all(out[row, :, ~covered] == 0)) and bool(jnp.all(jnp.isneginf(lse[row, :, ~covered])))
  if _cudnn._API is not None:
    assert _cudnn._options(True, 7)["sliding_window_length"] == 8


def test_cudnn_ring_in_bfloat16(stand_in):
  """The bfloat16 policy (cuDNN's inputs): each call's output and gradients rounded to
  bfloat16 as cuDNN writes them, merged and summed in float32."""
  mesh = make_mesh((4,), ("seq",))
  args = qkv(1, 128, 4, 2, 16, dtype=jnp.bfloat16, seed=3)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True, kernel="cudnn", policy=BF16)
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True)
  compare_with_reference(fn, ref, args, 2e-2)


def _config(devices, window=None, layout="contiguous", t=8):
  """The RingConfig of a causal cuDNN ring of `devices`, shards of t tokens."""
  back, _ = _ring.schedule(layout, window, True, t, devices, False)
  return _ring.RingConfig(
    axis_name="seq",
    ring_size=devices,
    mask=_ring.MaskSpec(is_causal=True, window=window),
    scale=1.0,
    policy=jax_ring.Policy(),
    block_q=t,
    block_kv=t,
    steps_back=back,
    steps_fwd=0,
    kernel="cudnn",
  )


def _rectangle(kind, t, s):
  rq = slice(0, t) if kind.rows_q == "all" else slice(t // 2, t)
  rk = slice(0, s) if kind.rows_k == "all" else slice(0, s // 2)
  return rq, rk


def _routed_mask(cfg, kinds, index, q_pos, k_pos, q_seg=None, k_seg=None):
  """[B, t, s]: what the call (or XLA edge step) of `kinds[index]` lets through, from
  its rectangle, its cuDNN mask (causal on rows, the window back from the diagonal)
  and the documents it is given (`_cudnn.Sequences`, as cuDNN reads them)."""
  t, s = len(q_pos), len(k_pos)
  b = 1 if q_seg is None else q_seg.shape[0]
  mask = np.zeros((b, t, s), bool)
  kind = kinds[index]
  if kind.name == "hidden":
    return mask
  window = None if cfg.mask.window is None else cfg.mask.window[0]
  if kind.name == "edge":  # runs in XLA from positions and ids: its rectangle must hold every visible pair
    rows, first, seen = _ring._edge_mask(cfg, kind, jnp.asarray(q_pos), jnp.asarray(k_pos), q_seg, k_seg)
    mask[:, :rows, first:] = np.asarray(seen)
    return mask
  rq, rk = _rectangle(kind, t, s)
  n, m = rq.stop - rq.start, rk.stop - rk.start
  if q_seg is None:
    cell = np.tril(np.ones((n, m), bool)) if kind.causal else np.ones((n, m), bool)
    if kind.causal and window is not None:
      cell &= np.subtract.outer(np.arange(n), np.arange(m)) <= window
    mask[:, rq, rk] = cell
    return mask
  if kind.causal:  # the diagonal: every group of documents
    seg = jnp.asarray(q_seg[:, rq])
    for g in range(int(_ring._diagonal_groups(seg))):
      seqs = _ring._diagonal_sequences(seg, g)
      mask[:, rq, rk] |= np.asarray(_cudnn._seen(n, m, True, window, seqs))
    return mask
  seqs, shared = _ring._step_sequences(kind, jnp.asarray(q_seg), jnp.asarray(k_seg))
  if bool(shared):
    mask[:, rq, rk] = np.asarray(_cudnn._seen(n, m, False, None, seqs))
  return mask


def _reference_mask(q_pos, k_pos, window=None, q_seg=None, k_seg=None):
  """[B, t, s]: the causal mask on positions, the window, the documents (numpy)."""
  mask = (q_pos[:, None] >= k_pos[None, :])[None]
  if window is not None:
    mask = mask & (q_pos[:, None] - k_pos[None, :] <= window)[None]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0)
  return mask


def _shard_pairs(layout, devices, t):
  """(q positions, k positions, q shard, k shard or (shard, half)) of every step and of
  each half of the own keys (the late scheme's `OwnHalves`)."""
  pos = [np.asarray(layouts.shard_positions(layout, r, t, devices)) for r in range(devices)]
  pairs = [(pos[r], pos[j], r, (j, None)) for r in range(devices) for j in range(devices)]
  pairs += [(pos[r], pos[r][: t // 2], r, (r, 0)) for r in range(devices)]
  pairs += [(pos[r], pos[r][t // 2 :], r, (r, 1)) for r in range(devices)]
  return pairs


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5, 8])
def test_every_step_is_one_call_that_equals_the_causal_mask(layout, devices):
  """For every pair of shards (query shard r, key shard j) of a causal ring, and for each
  half of the own shard's keys (the late scheme's `OwnHalves`): `_cudnn_kind` finds a
  kind, and its call's rectangle and mask are exactly the causal mask on positions."""
  cfg = _config(devices, layout=layout)
  kinds = _ring._cudnn_kinds(cfg, 8)
  used = set()
  for q_pos, k_pos, _, _ in _shard_pairs(layout, devices, 8):
    index = int(_ring._cudnn_kind(cfg, kinds, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    assert index < len(kinds), (layout, q_pos, k_pos)
    assert index in _ring._cudnn_branches(kinds, len(q_pos), len(k_pos)), index
    np.testing.assert_array_equal(
      _routed_mask(cfg, kinds, index, q_pos, k_pos), _reference_mask(q_pos, k_pos)
    )
    used.add(kinds[index].name)
  expected = {
    "contiguous": {"whole", "hidden", "causal"},
    "zigzag": {"keys_first", "queries_second", "causal"},
  }
  assert expected[layout] | {"causal_second"} <= used or devices == 1, used


# Windows of 1 key back to past the ring: inside a shard, its edge on the next shard's
# first key, across a step (in XLA), beyond two shards, wider than the sequence.
@pytest.mark.parametrize("window", [1, 3, 8, 9, 13, 15, 16, 21, 70])
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
def test_each_step_of_a_window_gets_the_window_the_mask_gives_it(window, devices, caplog):
  """Causal windows in the contiguous layout: each scheduled step (and each half of the
  own keys) is hidden, whole, the diagonal under cuDNN's sliding window, or an edge step
  in XLA (said at INFO, with the offsets), and what it lets through is exactly the
  windowed causal mask."""
  t = 8
  cfg = _config(devices, (window, 0), t=t)
  with caplog.at_level("INFO", logger="jax_ring"):
    kinds = _ring._cudnn_kinds(cfg, t)
  edges = [str(k.edge) for k in kinds if k.edge is not None]
  assert ("run in XLA" in caplog.text) == bool(edges) and all(e in caplog.text for e in edges), caplog.text
  used = set()
  for q_pos, k_pos, r, (j, _) in _shard_pairs("contiguous", devices, t):
    if 0 < r - j <= devices - 1 and r - j > cfg.steps_back:
      continue  # never scheduled: the window ends before
    index = int(_ring._cudnn_kind(cfg, kinds, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    assert index < len(kinds), (q_pos, k_pos)
    routed = _routed_mask(cfg, kinds, index, q_pos, k_pos)
    np.testing.assert_array_equal(routed, _reference_mask(q_pos, k_pos, window), err_msg=f"{r}, {j}")
    used.add(kinds[index].name)
  partial = {
    (r, j) for r in range(devices) for j in range(r) if (r - j) * t - t + 1 <= window < (r - j) * t + t - 1
  }
  assert ("edge" in used) == bool(partial), used


def _documents(devices, t, cuts, pad_from=None):
  ids = np.asarray(cut_segments(devices * t, cuts, pad_from))
  return ids


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("window", [None, 5, 12])
def test_each_step_gets_the_documents_the_mask_gives_it(layout, devices, window, monkeypatch):
  """Documents of mixed lengths (one of 1 token, one longer than a shard, a padded tail)
  over every step of a causal ring: the packed calls' sequences (`_cudnn.Sequences`, two
  documents a call so the diagonal takes several) let through exactly the causal mask
  within each document, with the window where there is one."""
  if window is not None and layout == "zigzag" and devices > 1:
    return  # refused by `cudnn_problem`: the window runs in the contiguous layout
  monkeypatch.setattr(_ring, "MAX_DOCUMENTS", 2)
  t = 8
  cfg = _config(devices, None if window is None else (window, 0), layout, t)
  kinds = _ring._cudnn_kinds(cfg, t)
  n = devices * t
  ids = _documents(devices, t, sorted({1, 2, 5, n // 2 + 1, n - 3} - {0, n}), pad_from=n - 2)
  natural = np.asarray(layouts.shard_positions(layout, 0, n, 1))
  for q_pos, k_pos, r, (j, _) in _shard_pairs(layout, devices, t):
    index = int(_ring._cudnn_kind(cfg, kinds, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    assert index < len(kinds), (q_pos, k_pos)
    q_seg, k_seg = ids[:, natural[q_pos]], ids[:, natural[k_pos]]
    routed = _routed_mask(cfg, kinds, index, q_pos, k_pos, q_seg, k_seg)
    expected = _reference_mask(q_pos, k_pos, window, q_seg, k_seg)
    np.testing.assert_array_equal(routed, expected, err_msg=f"{layout}: queries {r}, keys {j}")


def test_positions_no_kind_covers_give_nan_not_a_wrong_number():
  """Striped positions (which `cudnn_problem` keeps away from cuDNN) match no kind: the
  step's result is NaN."""
  cfg = _config(2, t=4)
  kinds = _ring._cudnn_kinds(cfg, 4)
  q_pos, k_pos = jnp.asarray([0, 2, 4, 6]), jnp.asarray([1, 3, 5, 7])
  assert int(_ring._cudnn_kind(cfg, kinds, q_pos, k_pos)) == len(kinds)
  q, k, v = (jnp.ones((1, 2, 4, 8)),) * 3
  hidden = lambda q, k, v, o: o
  run = lambda kind, q, k, v, o: o + 1
  out = _ring._cudnn_step(kinds, jnp.int32(len(kinds)), run, hidden, q, k, v, jnp.zeros(3))
  assert bool(jnp.all(jnp.isnan(out)))


@pytest.mark.parametrize(
  "options, reason",
  [
    (dict(is_causal=True, layout="striped"), "striped layout"),
    (dict(local_window_size=(8, 8)), "local_window_size without is_causal"),
    (dict(is_causal=True, local_window_size=(8, 0), layout="zigzag"), "local_window_size with the zigzag"),
    (dict(segment_ids=jnp.repeat(jnp.arange(4), 16)[None]), "segment ids without is_causal"),
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


def test_the_twin_keeps_its_statistics_in_float32_from_bfloat16_inputs():
  """cuDNN writes its softmax statistics in float32 whatever the inputs: the twin's lse
  from bfloat16 q, k, v is float32 and within 1e-6 of the float64 lse of the same
  (rounded) inputs, far under bfloat16's rounding (4e-3), which the merges would carry."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 4, 64, 16)), jnp.bfloat16) for _ in range(3))
  for seqs in (
    None,
    _cudnn.Sequences(
      *(jnp.asarray(x, jnp.int32) for x in ([[40, 24]], [[40, 24]], [[0, 40, -1]], [[0, 40, -1]]))
    ),
  ):
    _, lse = _cudnn._xla_forward(q, k, v, causal=True, seqs=seqs)
    assert lse.dtype == jnp.float32
    s = np.einsum("bnth,bnsh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64))
    seen = np.tril(np.ones((64, 64), bool))
    if seqs is not None:
      doc = np.arange(64) >= 40
      seen &= doc[:, None] == doc[None, :]
    s = np.where(seen, s, -np.inf)
    top = s.max(-1, keepdims=True)
    expected = (top + np.log(np.exp(s - top).sum(-1, keepdims=True)))[..., 0]
    assert rel_err(lse, expected) < 1e-6
