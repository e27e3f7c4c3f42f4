"""`document_bound=`: packed rows whose documents are at most n tokens long run only the
ring passes that can bring keys within n - 1 positions. Against the float64 reference
on 1, 2, 3, 4 and 8 devices in the contiguous, zig-zag and striped layouts, causal and
not, with the XLA tiles, the Pallas kernel and cuDNN's CPU stand-in; the passes counted
from a brute force over every position pair and from the compiled program's transfers;
a row that breaks the bound gets NaN (and concrete ids a ValueError) rather than a
wrong number. The per-document layout (`layouts.documents`): a permutation whose
devices' scores are even, its tiles against zig-zag's from `work_report`, and the row
laid out by it, its positions given to `ring_attention_shard`, against float64 on 1,
2, 3, 4 and 8 devices and with the Pallas kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compare_with_reference, make_mesh, qkv, rel_err
from jax.sharding import NamedSharding

import jax_ring
from jax_ring import (
  _cudnn,
  _documents,
  _kernel,
  _pallas,
  _ring,
  hlo,
  layouts,
  reference_attention,
  ring_attention,
)

TOL = 1e-5
SMALL_BLOCKS = jax_ring.BlockSizes(block_q=8, block_kv=16, kv_heads=1)
T = 192  # a multiple of 2p for zig-zag on 1-4 and 8 devices, of p * p for striped on 1, 2, 4, 8


def documents(batch: int, length: int, bound: int, seed: int = 0) -> np.ndarray:
  """Rows of documents of 1 to `bound` tokens, ids 0, 1, ... and a padded tail (-1)."""
  rng = np.random.default_rng(seed)
  rows = np.full((batch, length), -1, np.int32)
  for row in rows:
    at, k = 0, 0
    while at < length - 5:
      n = int(rng.integers(1, bound + 1))
      row[at : at + n] = k
      at, k = at + n, k + 1
    row[length - int(rng.integers(1, 5)) :] = -1
  return rows


def needed_offsets(layout: str, p: int, shard: int, left: int, right: int) -> set[int]:
  """The ring offsets o (device d reading device d - o's keys) at which some device has
  a query and a key within [-right, left] of each other: every position pair tried."""
  pos = layouts.positions(layout, p, shard)
  out = set()
  for o in range(p):
    for d in range(p):
      delta = pos[d][:, None] - pos[(d - o) % p][None, :]
      if np.any((delta <= left) & (delta >= -right)):
        out.add(o)
  return out


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_schedule_makes_the_fewest_passes_that_hold_every_visible_key(layout, p):
  """For bounds from one token to past the ring, causal and not: the passes (back, then
  forward) visit every offset a brute force finds keys at, and no plan with fewer
  passes does; where both ways add up to the ring, it is the ring as before."""
  shard = {"contiguous": 12, "zigzag": 12, "striped": p}[layout]
  for bound in (1, 2, 5, 7, 12, 13, 25, 40, 1000):
    for causal in (True, False):
      left, right = bound - 1, 0 if causal else bound - 1
      back, fwd = _documents.schedule(layout, left, right, shard, p)
      need = needed_offsets(layout, p, shard, left, right)
      visited = set(range(back + 1)) | {p - f for f in range(1, fwd + 1)}
      assert need <= visited, (bound, causal, back, fwd, need)
      fewest = min(
        b + (p - min(o for o in need if o > b) if any(o > b for o in need) else 0) for b in range(p)
      )
      assert back + fwd == min(fewest, p - 1), (bound, causal, back, fwd, fewest)
      if back + fwd == p - 1:
        assert (back, fwd) == (p - 1, 0)


def test_zigzag_documents_within_a_chunk_need_one_pass_each_way():
  """Zig-zag: chunk c's neighbour sits one device back on the sequence's first half and
  one forward on its second; documents within a chunk need 1 + 2 passes of 8."""
  assert _documents.schedule("zigzag", 11, 0, 24, 8) == (1, 1)
  assert _documents.schedule("contiguous", 11, 0, 24, 8) == (1, 0)
  assert _documents.schedule("contiguous", 11, 11, 24, 8) == (1, 1)
  assert _documents.reach(None, None, True) is None
  assert _documents.reach(12, (5, 0), True) is None  # the window is tighter: no change
  assert _documents.reach(12, (20, 0), True) == (11, 0)
  assert _documents.reach(12, (20, 3), False) == (11, 3)


CASES = [
  (1, "zigzag", True),
  (2, "contiguous", True),
  (2, "zigzag", False),
  (3, "zigzag", True),
  (3, "contiguous", False),
  (4, "striped", True),
  (4, "zigzag", True),
  (8, "zigzag", True),
  (8, "contiguous", True),
  (8, "contiguous", False),
  (8, "striped", True),
]


@pytest.mark.parametrize("devices, layout, causal", CASES, ids=[f"{d}-{lay}-{c}" for d, lay, c in CASES])
def test_bounded_ring_equals_float64(devices, layout, causal):
  """Outputs and every gradient against the float64 reference, documents of up to 20
  tokens (bound 20: fewer passes than the ring on 3 devices and more)."""
  mesh = make_mesh((devices,), ("seq",))
  seg = jnp.asarray(documents(2, T, 20, seed=devices))
  args = qkv(2, T, 4, 2, 16, seed=devices)
  options = dict(is_causal=causal, segment_ids=seg)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, layout=layout, block_sizes=SMALL_BLOCKS, document_bound=20, **options
  )
  compare_with_reference(fn, lambda q, k, v: reference_attention(q, k, v, **options), args, TOL)


@pytest.fixture
def stand_in(monkeypatch):
  """kernel="cudnn" on this CPU, with the XLA twin in cuDNN's place (read while tracing),
  and the GPUs' backward scheme (dK/dV one step behind their K/V)."""
  monkeypatch.setattr(_cudnn, "CPU_STAND_IN", True)
  monkeypatch.setattr(_ring, "LATE_DKV_PLATFORMS", _ring.LATE_DKV_PLATFORMS + ("cpu",))
  monkeypatch.setattr(_ring, "ONE_STEP_LOOP_PLATFORMS", _ring.ONE_STEP_LOOP_PLATFORMS + ("cpu",))
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.mark.parametrize("kernel", ["pallas"])
def test_bounded_ring_with_the_kernels_equals_float64(kernel, request):
  """Zig-zag, causal, 4 devices: the Pallas kernel (interpreted) over the passes each
  way. cuDNN's stand-in (with GPUs' backward scheme) runs the same schedule, one pass
  each way, as the first branch of `test_auto_bound_with_the_kernels_equals_float64`."""
  if kernel == "cudnn":
    request.getfixturevalue("stand_in")
  mesh = make_mesh((4,), ("seq",))
  seg = jnp.asarray(documents(2, 128, 12, seed=7))
  args = qkv(2, 128, 4, 2, 16, seed=7)
  if kernel == "cudnn":
    args = tuple(x.astype(jnp.bfloat16) for x in args)
  options = dict(is_causal=True, segment_ids=seg)
  fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, kernel=kernel, document_bound=12, **options)
  tol = 2e-2 if kernel == "cudnn" else TOL
  compare_with_reference(fn, lambda q, k, v: reference_attention(q, k, v, **options), args, tol)


def test_the_compiled_ring_moves_only_the_passes_it_makes():
  """8 devices, zig-zag, inputs in the layout's order (no relayout): with documents
  within a chunk, the forward's collective permutes move 2 K/V shards, not 7."""
  mesh = make_mesh((8,), ("seq",))
  q, k, v = qkv(1, 256, 4, 2, 16)
  seg = jnp.asarray(documents(1, 256, 16))
  to = lambda x: layouts.to_layout(x, "zigzag", 8)
  q, k, v, seg = to(q), to(k), to(v), to(seg)

  def permuted(bound):
    call = lambda q, k, v, seg: ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      is_causal=True,
      layout="zigzag",
      segment_ids=seg,
      token_order="layout",
      document_bound=bound,
    )
    return hlo.collective_bytes(jax.jit(call).lower(q, k, v, seg).compile())["collective-permute"]

  assert permuted(None) * 2 == permuted(16) * 7, (permuted(None), permuted(16))
  assert _documents.schedule("zigzag", 15, 0, 32, 8) == (1, 1)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_a_pass_of_one_transfer_keeps_its_loop_where_transfers_overlap(monkeypatch, devices):
  """With GPUs' scheme (run here on CPU: dK/dV one step behind, and a pass of one step
  kept a loop), a bound of one zig-zag chunk gives one transfer each way, and each such
  pass stays a loop of one step (`_ring._steps`: inlined, XLA's GPU scheduler left its transfer
  bare): the compiled program's forward and backward ring steps are loops (inside the
  loop over its two head groups) whose trip count `hlo.trip_count` reads as 1 through
  the optimization barrier, the bytes they move are counted, and outputs and gradients
  equal float64's."""
  monkeypatch.setattr(_ring, "LATE_DKV_PLATFORMS", _ring.LATE_DKV_PLATFORMS + ("cpu",))
  monkeypatch.setattr(_ring, "ONE_STEP_LOOP_PLATFORMS", _ring.ONE_STEP_LOOP_PLATFORMS + ("cpu",))
  jax.clear_caches()  # the scheme is read while tracing
  mesh = make_mesh((devices,), ("seq",))
  t = 32 * devices  # chunks of 16
  seg = jnp.asarray(documents(2, t, 12, seed=devices))
  args = qkv(2, t, 4, 2, 16, seed=devices)
  assert _documents.schedule("zigzag", 11, 0, 32, devices) == ((1, 1) if devices > 2 else (1, 0))
  options = dict(is_causal=True, segment_ids=seg)
  fn = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, block_sizes=SMALL_BLOCKS, document_bound=12, **options
  )
  compare_with_reference(fn, lambda q, k, v: reference_attention(q, k, v, **options), args, TOL)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
  comps, _ = hlo._computations(text)
  steps = {s.body: s.name for s in hlo.ring_overlap(text) if s.name.endswith("ring step")}
  trips = {
    body: hlo.trip_count(line, comps)
    for lines in comps.values()
    for line in lines
    if (m := hlo._WHILE.search(line)) and (body := m.group(1)) in steps
  }
  assert sorted(steps.values()) == ["backward ring step", "forward ring step"], steps
  assert set(trips.values()) == {1}, trips
  assert hlo.collective_bytes(text)["collective-permute"] > 0
  jax.clear_caches()


def test_a_row_that_breaks_the_bound_is_nan_and_the_others_exact():
  """Under jit the ids are traced: a row with a document longer than the bound gets NaN,
  every other row the reference's numbers; on concrete ids the call raises first,
  naming the row, the id and how far apart its tokens lie."""
  mesh = make_mesh((4,), ("seq",))
  q, k, v = qkv(2, 128, 4, 2, 16)
  seg = documents(2, 128, 10)
  seg[1, 40:80] = 99  # a 40-token document in row 1
  call = lambda q, k, v, seg: ring_attention(
    q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, document_bound=10
  )
  out = jax.jit(call)(q, k, v, jnp.asarray(seg))
  assert bool(jnp.all(jnp.isnan(out[1]))) and bool(jnp.all(jnp.isfinite(out[0])))
  expected = reference_attention(q[:1], k[:1], v[:1], is_causal=True, segment_ids=jnp.asarray(seg[:1]))
  assert rel_err(out[:1], expected) < TOL
  with pytest.raises(ValueError, match=r"row 1 has id 99 at positions 40 and 79, 39 apart"):
    call(q, k, v, jnp.asarray(seg))
  # An id that comes back after another document spans both of its runs.
  seg = documents(2, 128, 10)
  seg[0, 100] = seg[0, 0]
  with pytest.raises(ValueError, match=r"row 0 has id 0 at positions 0 and 100"):
    call(q, k, v, jnp.asarray(seg))


def test_a_bound_that_skips_no_pass_is_the_unbounded_call():
  """A bound whose passes add up to the whole ring (here 8 devices of 64 tokens, zig-zag
  chunks of 32: a bound of 200 needs 7 passes each way) changes nothing: the compiled
  program is the unbounded one, with no gather of the ids to check them (that check,
  compiled into Llama's FSDP step, once broke XLA:CPU's rendezvous of a ring permute),
  and a row with a longer document gets the reference's numbers, not NaN."""
  mesh = make_mesh((8,), ("seq",))
  q, k, v = qkv(2, 512, 4, 2, 16)
  seg = documents(2, 512, 60)
  seg[1, 100:400] = 99  # a 300-token document: longer than the bound
  assert _documents.schedule("zigzag", 199, 0, 64, 8) == (7, 0)

  def program(bound):
    call = lambda q, k, v, seg: ring_attention(
      q, k, v, mesh=mesh, is_causal=True, segment_ids=seg, layout="zigzag", document_bound=bound
    )
    return jax.jit(call), jax.jit(call).lower(q, k, v, jnp.asarray(seg)).compile()

  call, bounded = program(200)
  unbounded = program(None)[1]
  assert "all-gather" not in bounded.as_text()
  assert hlo.collective_bytes(bounded) == hlo.collective_bytes(unbounded)
  out = call(q, k, v, jnp.asarray(seg))
  expected = reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(seg))
  assert rel_err(out, expected) < TOL


def test_the_bound_asks_for_an_int_ids_and_self_attention():
  mesh = make_mesh((2,), ("seq",))
  q, k, v = qkv(1, 32, 2, 2, 8)
  seg = jnp.zeros((1, 32), jnp.int32)
  call = lambda **kw: ring_attention(q, k, v, mesh=mesh, is_causal=True, **kw)
  with pytest.raises(TypeError, match=r"document_bound=True must be an int"):
    call(segment_ids=seg, document_bound=True)
  with pytest.raises(TypeError, match=r"document_bound=8.0 must be an int"):
    call(segment_ids=seg, document_bound=8.0)
  with pytest.raises(ValueError, match=r"document_bound=0 must be at least 1"):
    call(segment_ids=seg, document_bound=0)
  with pytest.raises(ValueError, match=r"document_bound='longest' must be an int .*, 'auto' or None"):
    call(segment_ids=seg, document_bound="longest")
  with pytest.raises(ValueError, match=r"document_bound='auto' needs segment_ids"):
    call(document_bound="auto")
  with pytest.raises(ValueError, match=r"document_bound=8 needs segment_ids"):
    call(document_bound=8)
  k2, v2 = qkv(1, 16, 2, 2, 8)[1:]
  with pytest.raises(ValueError, match=r"needs self-attention \(S == T\); got T=32, S=16"):
    ring_attention(q, k2, v2, mesh=mesh, segment_ids=(seg, seg[:, :16]), document_bound=8)


def test_work_report_counts_each_documents_tiles_and_the_bounds_passes():
  """`work_report` with a row's ids: 16 documents of one 16-token zig-zag chunk each are
  16 diagonal tiles, two a device, all in the local pass; documents of 24 tokens cross
  chunks, and the bound's passes hold every tile the whole ring's do (the counts per
  chunk pair, in natural order, agree)."""
  blocks = jax_ring.BlockSizes(block_q=16, block_kv=16)
  report = lambda ids, bound=None: jax_ring.work_report(
    layout="zigzag",
    num_devices=8,
    seq_len=256,
    is_causal=True,
    block_sizes=blocks,
    segment_ids=ids,
    document_bound=bound,
  )
  aligned = np.repeat(np.arange(16), 16)
  assert report(aligned).tolist() == [[2] * 8] + [[0] * 8] * 7
  assert report(aligned, 16).tolist() == report(aligned).tolist()
  crossing = np.repeat(np.arange(11), 24)[:256]
  chunks = crossing.reshape(16, 16)  # natural order: chunk c is tokens [16c, 16c + 16)
  pairs = sum(bool(set(chunks[i]) & set(chunks[j])) for i in range(16) for j in range(i + 1))
  whole, bounded = report(crossing), report(crossing, 24)
  assert whole.sum() == bounded.sum() == pairs
  back, fwd = _documents.schedule("zigzag", 23, 0, 32, 8)
  assert (back, fwd) == (2, 2) and not bounded[back + fwd + 1 :].any()
  # "auto": the passes the call picks for these ids (one chunk each way, two), or the
  # whole ring where the ids fall.
  assert report(aligned, "auto").tolist() == report(aligned, 16).tolist()
  assert report(crossing, "auto").tolist() == bounded.tolist()
  falling = crossing[::-1].copy()
  assert report(falling, "auto").tolist() == report(falling).tolist()
  with pytest.raises(ValueError, match=r"document_bound=8 needs segment_ids"):
    jax_ring.work_report(layout="zigzag", num_devices=8, seq_len=256, is_causal=True, document_bound=8)


# `document_bound="auto"`: the bound read from the ids while running.


def _pick_expected(ids: np.ndarray, layout: str, p: int, shard: int) -> int:
  """The index of the first of the call's schedules whose passes hold every key a
  query of these rows sees (`needed_offsets` over every position pair at the rows'
  longest reach), or the last (the whole ring) where a row's ids fall."""
  schedules = _documents.runtime_schedules(layout, shard, p)
  reach = 0
  for line in ids:
    valid = line[line >= 0]
    if np.any(valid[1:] < valid[:-1]):
      return len(schedules) - 1
    for value in set(valid.tolist()):
      where = np.flatnonzero(line == value)
      reach = max(reach, int(where[-1] - where[0]))
  needed = needed_offsets(layout, p, shard, reach, 0)
  for i, (_, (back, fwd)) in enumerate(schedules):
    if needed <= set(range(back + 1)) | {p - j for j in range(1, fwd + 1)}:
      return i
  raise AssertionError("the whole ring holds every key")


def test_the_ids_pick_the_fewest_passes_that_hold_their_documents_on_every_device():
  """8 devices, zig-zag chunks of 16: the schedules are one chunk each way, two, and
  the whole ring; every device picks the same one, the first whose passes hold every
  visible key (checked over every position pair): the batch's longest document
  decides, padding inside a document counts in its reach, and falling ids take the
  whole ring."""
  p, shard = 8, 32
  schedules = _documents.runtime_schedules("zigzag", shard, p)
  assert schedules == [(16, (1, 1)), (32, (2, 2)), (None, (7, 0))]
  assert _documents.runtime_schedules("contiguous", shard, p) == [
    (32, (1, 0)),
    (64, (2, 0)),
    (128, (4, 0)),
    (None, (7, 0)),
  ]
  assert _documents.runtime_schedules("striped", shard, p) == []
  assert _documents.runtime_schedules("zigzag", 64, 2) == []
  mesh = make_mesh((p,), ("seq",))
  reaches = [r for r, _ in schedules[:-1]]

  def pick(seg):
    index = jax.lax.axis_index("seq")
    return _documents.runtime_pick(seg, layouts.shard_positions("zigzag", index, shard, p), "seq", reaches)[
      None
    ]

  spec = jax.sharding.PartitionSpec
  picked = jax.jit(jax.shard_map(pick, mesh=mesh, in_specs=spec(None, "seq"), out_specs=spec("seq")))
  row = lambda *lengths: np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [[-1] * 256])[:256]
  short = np.stack([row(*[16] * 16), row(*[17] * 15)]).astype(np.int32)  # reach 16: one chunk
  longer = np.stack([row(*[16] * 16), row(*[10] * 10, 30, *[10] * 10)]).astype(np.int32)  # reach 29
  gap = row(*[16] * 12, 8, 10, 5, 5, 16, 16, 4)  # ids 13 and 15 are one document, 14 padding
  gap = np.stack([np.where(gap == 14, -1, np.where(gap == 15, 13, gap)), short[1]]).astype(
    np.int32
  )  # reach 19
  whole = np.stack([row(*[16] * 4, 50, *[16] * 10), row(*[16] * 16)]).astype(np.int32)  # reach 49
  falling = np.repeat(np.arange(16)[::-1], 16)[None].repeat(2, 0).astype(np.int32)
  cases = {
    "short": (short, 0),
    "longer": (longer, 1),
    "gap": (gap, 1),
    "whole": (whole, 2),
    "falling": (falling, 2),
  }
  for name, (ids, want) in cases.items():
    assert _pick_expected(ids, "zigzag", p, shard) == want, name
    placed = jax.device_put(
      layouts.to_layout(jnp.asarray(ids), "zigzag", p), NamedSharding(mesh, spec(None, "seq"))
    )
    got = np.asarray(picked(placed))
    assert got.tolist() == [want] * p, (name, got)
    assert _documents.picked_schedule(ids, "zigzag", shard, p) == schedules[want][1], name


AUTO_CASES = [
  (1, "zigzag"),
  (2, "contiguous"),
  (3, "contiguous"),
  (4, "striped"),
  (4, "zigzag"),
  (8, "zigzag"),
  (8, "contiguous"),
]


def test_data_parallel_rings_pick_alike_and_stay_exact():
  """A 2 x 4 mesh, the batch split over "data": a ring whose rows hold short documents
  and one whose rows hold a long one pick the same (the larger) schedule, so every
  device runs the same branch; both rows exact against float64."""
  mesh = make_mesh((2, 4), ("data", "seq"))
  short = documents(1, 128, 12, seed=3)
  long = documents(1, 128, 12, seed=4)
  long[0, 10:90] = 500
  ids = np.concatenate([short, long])
  schedules = _documents.runtime_schedules("zigzag", 32, 4)
  reaches = [r for r, _ in schedules[:-1]]
  spec = jax.sharding.PartitionSpec

  def pick(seg):
    index = jax.lax.axis_index("seq")
    return _documents.runtime_pick(seg, layouts.shard_positions("zigzag", index, 32, 4), "seq", reaches)[
      None, None
    ]

  picked = jax.jit(
    jax.shard_map(pick, mesh=mesh, in_specs=spec("data", "seq"), out_specs=spec("data", "seq"))
  )
  placed = jax.device_put(
    layouts.to_layout(jnp.asarray(ids), "zigzag", 4), NamedSharding(mesh, spec("data", "seq"))
  )
  assert np.asarray(picked(placed)).tolist() == [[1] * 4] * 2
  args = qkv(2, 128, 4, 2, 16, seed=3)
  _auto_equals_float64(mesh, "zigzag", [ids], args, TOL, batch_axis="data")


def _auto_equals_float64(mesh, layout, batches, args, tol, **options):
  """One compiled causal call with `document_bound="auto"`, the ids an argument: for
  each batch of ids, its output and every gradient against the float64 reference."""
  cot = jax.random.normal(jax.random.PRNGKey(5), args[0].shape, jnp.float32).astype(args[0].dtype)

  def run(call, args, seg, cot):
    out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, seg), *args)
    return out, vjp(cot)

  ring = lambda q, k, v, seg: ring_attention(
    q, k, v, mesh=mesh, layout=layout, is_causal=True, segment_ids=seg, document_bound="auto", **options
  )
  reference = lambda q, k, v, seg: reference_attention(q, k, v, is_causal=True, segment_ids=seg)
  program = jax.jit(functools.partial(run, ring))
  expected = jax.jit(functools.partial(run, reference))
  args64 = tuple(a.astype(jnp.float64) for a in args)
  for ids in batches:
    seg = jnp.asarray(ids)
    (out, grads), (ref, ref_grads) = program(args, seg, cot), expected(args64, seg, cot.astype(jnp.float64))
    assert rel_err(out, ref) < tol
    for name, g, r in zip("qkv", grads, ref_grads):
      assert rel_err(g, r) < tol, name
  assert program._cache_size() == 1  # one program for every batch: the ids pick while running


@pytest.mark.parametrize("devices, layout", AUTO_CASES, ids=[f"{d}-{lay}" for d, lay in AUTO_CASES])
def test_auto_bound_equals_float64_whichever_passes_the_ids_pick(devices, layout):
  """Causal, one program: a batch of documents of up to 12 tokens (where there are
  schedules to pick from, the fewest passes) and one with a 120-token document (the
  whole ring), outputs and every gradient against float64."""
  mesh = make_mesh((devices,), ("seq",))
  short = documents(2, T, 12, seed=devices)
  long = documents(2, T, 12, seed=devices + 1)
  long[1, 20:140] = 500
  args = qkv(2, T, 4, 2, 16, seed=devices)
  _auto_equals_float64(mesh, layout, [short, long], args, TOL, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("kernel", ["pallas", "cudnn"])
def test_auto_bound_with_the_kernels_equals_float64(kernel, request):
  """Zig-zag on 4 devices (schedules: one chunk each way, or the whole ring): the Pallas
  kernel (interpreted) and cuDNN's stand-in with GPUs' backward scheme, both batches."""
  if kernel == "cudnn":
    request.getfixturevalue("stand_in")
  mesh = make_mesh((4,), ("seq",))
  assert _documents.runtime_schedules("zigzag", 32, 4) == [(16, (1, 1)), (None, (3, 0))]
  short = documents(2, 128, 12, seed=7)
  long = short.copy()
  long[0, 30:100] = 500
  args = qkv(2, 128, 4, 2, 16, seed=7)
  if kernel == "cudnn":
    args = tuple(x.astype(jnp.bfloat16) for x in args)
  tol = 2e-2 if kernel == "cudnn" else TOL
  _auto_equals_float64(mesh, "zigzag", [short, long], args, tol, kernel=kernel)


def test_the_auto_program_holds_each_schedules_passes_as_a_branch():
  """8 devices, zig-zag, inputs in the layout's order: the compiled forward and backward
  each pick one of three branches, whose ring transfers are those of the bounds of one
  and two chunks and of the whole ring (`hlo.branch_collective_bytes` against the
  programs compiled with those bounds); only a gather of the ids is added."""
  mesh = make_mesh((8,), ("seq",))
  q, k, v = qkv(1, 256, 4, 2, 16)
  seg = jnp.asarray(documents(1, 256, 16))
  to = lambda x: layouts.to_layout(x, "zigzag", 8)
  q, k, v, seg = to(q), to(k), to(v), to(seg)

  def compiled(bound):
    call = lambda q, k, v, seg: ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      is_causal=True,
      layout="zigzag",
      segment_ids=seg,
      token_order="layout",
      document_bound=bound,
    )
    return jax.jit(call).lower(q, k, v, seg).compile()

  permuted = lambda bound: hlo.collective_bytes(compiled(bound))["collective-permute"]
  branches = hlo.branch_collective_bytes(compiled("auto"))
  assert len(branches) == 1 and len(branches[0]) == 3, branches
  assert [b["collective-permute"] for b in branches[0]] == [permuted(16), permuted(32), permuted(None)]
  assert permuted(16) * 7 == permuted(None) * 2


# The per-document layout (`layouts.documents`): work balanced per document.


def _natural_work(ids: np.ndarray, order: np.ndarray, p: int) -> np.ndarray:
  """Scores each device's queries compute (a query at offset q of its document: q + 1),
  counted from the ids alone, padding (negative ids) none."""
  offsets = np.zeros(ids.size, np.int64)
  for i, x in enumerate(ids.tolist()):
    if i == 0 or ids[i - 1] != x:
      first = i
    offsets[i] = i - first
  cost = np.where(ids >= 0, offsets + 1, 0)
  return cost[order.reshape(p, -1)].sum(axis=1)


def _mixed_row(scale: int = 1, seed: int = 0) -> np.ndarray:
  """The nine documents of 16,384 down to 4 x 256 tokens (over `scale`), shuffled."""
  lengths = np.array([16384, 8192, 4096, 2048, 1024, 256, 256, 256, 256]) // scale
  np.random.default_rng(seed).shuffle(lengths)
  return np.repeat(np.arange(lengths.size), lengths).astype(np.int32)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_the_documents_layout_is_a_permutation_that_splits_the_work_evenly(p):
  """Every position once, each device's in ascending order; the busiest device's scores
  (counted from the ids) within 5% of the mean on the mixed row and on a random packed
  row with padding (documents of up to 1,000 tokens; with shards about as long as the
  documents the rooms bind, and balance can be 8-15% off); a row of equal short
  documents keeps each whole on one device."""
  rows = [_mixed_row(scale=8), documents(1, 7680, 1000, seed=p)[0], np.full(96, -1, np.int32)]
  for ids in (row[: row.size - row.size % p] for row in rows):
    order = layouts.documents(ids, p, min_piece=16)
    assert sorted(order.tolist()) == list(range(ids.size))
    shards = order.reshape(p, -1)
    assert all(np.all(np.diff(s) > 0) for s in shards)
    work = _natural_work(ids, order, p)
    if work.sum():
      assert work.max() <= 1.05 * work.mean(), (p, work.tolist())
  ids = np.repeat(np.arange(24), 32).astype(np.int32)
  where = ids[layouts.documents(ids, p, min_piece=16).reshape(p, -1)]
  assert sum(len(np.unique(shard)) for shard in where) == 24  # no document on two devices


def test_the_documents_layout_evens_the_tiles_that_zigzag_leaves_uneven():
  """`work_report` on the mixed row (4,096 tokens, 8 devices, tiles of 32): zig-zag's
  busiest device computes 1.4x the mean's tiles, the per-document layout's 1.05x at
  most, and under 80% of zig-zag's busiest: the step's time. The total rises (pieces of
  spread documents share tiles), by under 20%."""
  ids = _mixed_row(scale=8)
  blocks = jax_ring.BlockSizes(block_q=32, block_kv=32)
  options = dict(num_devices=8, seq_len=ids.size, is_causal=True, block_sizes=blocks, segment_ids=ids)
  zigzag = jax_ring.work_report(layout="zigzag", **options).sum(axis=0)
  balanced = jax_ring.work_report(order=layouts.documents(ids, 8, min_piece=16), **options).sum(axis=0)
  assert zigzag.max() > 1.4 * zigzag.mean(), zigzag.tolist()
  assert balanced.max() <= 1.05 * balanced.mean(), balanced.tolist()
  assert balanced.max() < 0.8 * zigzag.max() and balanced.sum() < 1.2 * zigzag.sum()


def _laid_out_ring(mesh, ids, order, **options):
  """ring_attention_shard on the row laid out by `order` (its positions passed), the
  output put back in natural order."""
  from jax.sharding import PartitionSpec as P

  back = np.argsort(order)
  seg = jnp.asarray(ids[order])[None]
  pos = jnp.asarray(order, jnp.int32)

  def inner(q, k, v, seg, pos):
    return jax_ring.ring_attention_shard(
      q, k, v, axis_name="seq", is_causal=True, segment_ids=seg, positions=pos, **options
    )

  sharded = jax.shard_map(
    inner,
    mesh=mesh,
    in_specs=(P(None, "seq"),) * 4 + (P("seq"),),
    out_specs=P(None, "seq"),
    check_vma=False,  # the Pallas kernel's interpreter asks for it
  )
  put = lambda x, *spec: jax.reshard(x, jax.sharding.NamedSharding(mesh, P(*spec)))
  row = lambda x: put(x[:, order], None, "seq")
  return lambda q, k, v: put(
    sharded(row(q), row(k), row(v), put(jnp.broadcast_to(seg, q.shape[:2]), None, "seq"), put(pos, "seq"))
  )[:, back]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_the_documents_layout_equals_float64(p):
  """Outputs and every gradient against the float64 reference in natural order: the row
  laid out per document, its positions given to the ring, the output put back."""
  mesh = make_mesh((p,), ("seq",))
  ids = documents(1, T, 70, seed=p)[0]
  order = layouts.documents(ids, p, min_piece=4)
  args = qkv(2, T, 4, 2, 16, seed=p)
  fn = _laid_out_ring(mesh, ids, order, block_sizes=SMALL_BLOCKS)
  seg = jnp.broadcast_to(jnp.asarray(ids)[None], (2, T))
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=seg)
  compare_with_reference(fn, ref, args, TOL)


def test_the_documents_layout_with_the_pallas_kernel_equals_float64():
  """4 devices, the Pallas kernel (interpreted) on the laid-out row. (cuDNN takes no
  positions given as data: such a call runs the XLA tiles, `_ring.cudnn_problem`.)"""
  mesh = make_mesh((4,), ("seq",))
  ids = documents(1, 128, 50, seed=9)[0]
  order = layouts.documents(ids, 4, min_piece=4)
  args = qkv(1, 128, 4, 2, 16, seed=9)
  fn = _laid_out_ring(mesh, ids, order, kernel="pallas")
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(ids)[None])
  compare_with_reference(fn, ref, args, TOL)


def test_the_documents_layout_and_work_report_name_bad_arguments():
  ids = np.zeros(64, np.int32)
  with pytest.raises(ValueError, match=r"segment_ids of shape \(2, 32\) .* must be one row"):
    layouts.documents(ids.reshape(2, 32), 2)
  with pytest.raises(
    ValueError, match=r"segment_ids of length 64 must be a positive multiple of num_shards=3"
  ):
    layouts.documents(ids, 3)
  with pytest.raises(ValueError, match=r"num_shards=0 must be a positive int"):
    layouts.documents(ids, 0)
  with pytest.raises(ValueError, match=r"min_piece=0 must be a positive int"):
    layouts.documents(ids, 2, min_piece=0)
  with pytest.raises(ValueError, match=r"order of shape \(64,\) must be a permutation of range\(64\)"):
    jax_ring.work_report(order=np.zeros(64, np.int32), num_devices=2, seq_len=64)
  with pytest.raises(ValueError, match=r"layout= \(a name\) or order= \(a permutation\), one of them"):
    jax_ring.work_report(layout="zigzag", order=np.arange(64), num_devices=2, seq_len=64)


# Rows reordered for the zig-zag ring (`layouts.zigzag_documents`): the packer's per-row
# choice, an ordinary row to the ring.


def _in_document_order(ids: np.ndarray, order: np.ndarray) -> bool:
  """Every document's tokens in natural order along the reordered row (by brute force)."""
  moved = ids[order]
  return all(np.all(np.diff(order[moved == x]) > 0) for x in np.unique(moved[moved >= 0]))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_reordered_rows_keep_each_documents_order_and_even_the_zigzag_tiles(p):
  """`work_report`'s tiles (32 x 32) of each device, the reordered row given as an
  ordinary zig-zag row: the busiest device never above the row as it is, and on the
  mixed row (which zig-zag leaves 1.3x the mean or more) within 5% of the mean. Every
  position once, every document's tokens in their natural order along the row; a row
  that zig-zag already evens stays as it is; `spans` is the widest document's extent;
  `first_seen` renumbers ids as they appear."""
  rows = [_mixed_row(scale=8), documents(1, 7680, 1000, seed=p)[0]]
  blocks = jax_ring.BlockSizes(block_q=32, block_kv=32)
  for ids in (row for row in rows if row.size % (2 * p) == 0):
    order = layouts.zigzag_documents(ids, p, min_piece=16, tile=32)
    assert sorted(order.tolist()) == list(range(ids.size))
    assert _in_document_order(ids, order)
    options = dict(layout="zigzag", num_devices=p, seq_len=ids.size, is_causal=True, block_sizes=blocks)
    plain = jax_ring.work_report(segment_ids=ids, **options).sum(axis=0)
    moved = jax_ring.work_report(segment_ids=layouts.first_seen(ids[order]), **options).sum(axis=0)
    assert moved.max() <= plain.max(), (p, plain.tolist(), moved.tolist())
    # The kernels' own rule (by each tile's positions and range of ids), which
    # zigzag_documents and the benchmark's 131K table count with: the same tiles where
    # ids rise along the row.
    assert layouts._tiles_per_device(ids, p, 32).tolist() == plain.tolist()
    assert layouts._tiles_per_device(layouts.first_seen(ids[order]), p, 32).tolist() == moved.tolist()
    if ids is rows[0]:
      assert plain.max() >= 1.3 * plain.mean(), (p, plain.tolist())
      assert moved.max() <= 1.05 * moved.mean(), (p, moved.tolist())
    ends = [np.flatnonzero(ids[order] == x)[[0, -1]] for x in np.unique(ids[ids >= 0])]
    assert layouts.spans(ids[order][None]) == max(b - a + 1 for a, b in ends)
  even = np.repeat(np.arange(24), 32).astype(np.int32)
  assert np.array_equal(layouts.zigzag_documents(even, 4), np.arange(even.size))
  # Ids that do not rise: the second tile's id (1) lies inside the first's range (0 to 2)
  # with no id shared, a tile the kernel runs masked and `work_report` leaves out.
  back = np.repeat(np.array([0, 2, 1], np.int32), [16, 16, 32])
  one = dict(layout="zigzag", num_devices=1, seq_len=64, is_causal=True, block_sizes=blocks)
  assert jax_ring.work_report(segment_ids=back, **one).sum() == 2
  assert layouts._tiles_per_device(back, 1, 32).tolist() == [3]
  assert layouts._tiles_per_device(layouts.first_seen(back), 1, 32).tolist() == [2]
  renumbered = layouts.first_seen(np.array([[7, 7, -1, 3, 9, 3], [-2, 4, 4, 0, 0, 4]]))
  assert renumbered.tolist() == [[0, 0, -1, 1, 2, 1], [-1, 0, 0, 1, 1, 0]]
  assert layouts.spans(even) == 32 and layouts.spans(np.full((2, 8), -1)) == 0


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_kernels_run_the_tiles_that_work_report_counts_on_a_padded_row(p):
  """The tiles the kernels run over every pass of the zig-zag ring (the XLA kernel's
  `_kernel.tile_class`, the Pallas kernels' `_pallas.hidden`, from the blocks' bounds)
  on a row of rising ids that ends in padding: exactly those with a query and a key of
  one document (`work_report`'s count), as `layouts._tiles_per_device` counts them. A
  block's range of ids leaves padding out: with -1 in it, the block that ends the last
  document ran a masked tile with every earlier block. A block with padding in it is
  never run unmasked."""
  ids = documents(1, 7680, 1000, seed=2)[0]
  assert ids[-1] < 0 <= ids[-2]
  tile, n = 32, ids.size
  where = layouts.positions("zigzag", p, n // p).reshape(-1)  # device-major
  spec = _kernel.MaskSpec(is_causal=True)
  pos, seg = jnp.asarray(where.reshape(-1, tile)), jnp.asarray(ids[where].reshape(-1, 1, tile))
  qb, kb = _kernel.block_bounds(pos, seg), _kernel.block_bounds(pos, seg, skip_padding=True)
  classes = np.asarray(jax.vmap(lambda q: jax.vmap(lambda k: _kernel.tile_class(spec, q, k))(kb))(qb))
  q_lo, q_hi, (qs_lo, qs_hi) = _pallas.block_bounds(
    jnp.asarray(where), jnp.asarray(ids[where][None]), tile, False
  )
  k_lo, k_hi, (ks_lo, ks_hi) = _pallas.block_bounds(
    jnp.asarray(where), jnp.asarray(ids[where][None]), tile, True
  )
  col, line = (lambda x: x[..., :, None]), (lambda x: x[..., None, :])
  hidden = _pallas.hidden(
    spec,
    (col(q_lo), col(q_hi), (col(qs_lo[0]), col(qs_hi[0]))),
    (line(k_lo), line(k_hi), (line(ks_lo[0]), line(ks_hi[0]))),
  )
  blocks = jax_ring.BlockSizes(block_q=tile, block_kv=tile)
  options = dict(layout="zigzag", num_devices=p, seq_len=n, is_causal=True, block_sizes=blocks)
  report = jax_ring.work_report(segment_ids=ids, **options).sum(axis=0).tolist()
  per_device = lambda runs: np.asarray(runs).reshape(p, -1).sum(axis=1).tolist()
  assert per_device(classes > 0) == report
  assert per_device(~np.asarray(hidden)) == report
  assert layouts._tiles_per_device(ids, p, tile).tolist() == report
  padded = (ids[where].reshape(-1, tile) < 0).any(axis=1)
  assert padded.any() and not (classes[padded] == 2).any() and not (classes[:, padded] == 2).any()
  assert (classes == 2).any()
  full = _kernel.MaskSpec()  # without causality: a key block of the last document and padding
  classes = np.asarray(jax.vmap(lambda q: jax.vmap(lambda k: _kernel.tile_class(full, q, k))(kb))(qb))
  assert not (classes[padded] == 2).any() and not (classes[:, padded] == 2).any()
  assert (classes[:, padded] == 1).any()


def _skewed_rows(t: int) -> np.ndarray:
  """Two rows of t tokens whose long documents zig-zag spreads unevenly: t/2, t/4, t/8
  and t/8; and t/8, t/2, t/4 and padding."""
  first = np.repeat(np.arange(4), [t // 2, t // 4, t // 8, t // 8])
  second = np.repeat(np.array([0, 1, 2, -1]), [t // 8, t // 2, t // 4, t // 8])
  return np.stack([first, second]).astype(np.int32)


def _reordered_ring(mesh, ids, **options):
  """ring_attention on each row reordered by its own `zigzag_documents` order, bounded
  by the reordered rows' widest span, the output put back in natural order."""
  p = mesh.shape["seq"]
  order = np.stack([layouts.zigzag_documents(row, p, min_piece=4, tile=2) for row in ids])
  if p > 1:  # every row moved: the reordering is what is checked
    assert all(not np.array_equal(o, np.arange(o.size)) for o in order), p
  moved = layouts.first_seen(np.take_along_axis(ids, order, axis=1))
  back = jnp.asarray(np.argsort(order, axis=1))[:, :, None, None]
  take = lambda x, o: jnp.take_along_axis(x, o, axis=1)
  forward = jnp.asarray(order)[:, :, None, None]
  seg = jnp.asarray(moved)
  bound = layouts.spans(moved)
  return lambda q, k, v: take(
    ring_attention(
      take(q, forward),
      take(k, forward),
      take(v, forward),
      mesh=mesh,
      is_causal=True,
      layout="zigzag",
      segment_ids=seg,
      document_bound=bound,
      **options,
    ),
    back,
  )


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_reordered_rows_equal_float64(p):
  """Two rows that zig-zag leaves uneven, each reordered by its own order, through the
  zig-zag ring as ordinary rows, bounded by their spans: outputs and every gradient
  against the float64 reference of the natural rows."""
  mesh = make_mesh((p,), ("seq",))
  ids = _skewed_rows(T)
  args = qkv(2, T, 4, 2, 16, seed=p)
  fn = _reordered_ring(mesh, ids, block_sizes=SMALL_BLOCKS)
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(ids))
  compare_with_reference(fn, ref, args, TOL)


def test_reordered_rows_with_the_pallas_kernel_equal_float64():
  """4 devices, the Pallas kernel (interpreted) on reordered rows."""
  mesh = make_mesh((4,), ("seq",))
  ids = _skewed_rows(128)
  args = qkv(2, 128, 4, 2, 16, seed=9)
  fn = _reordered_ring(mesh, ids, kernel="pallas")
  ref = lambda q, k, v: reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(ids))
  compare_with_reference(fn, ref, args, TOL)


def test_zigzag_documents_names_bad_arguments():
  ids = np.zeros(64, np.int32)
  with pytest.raises(ValueError, match=r"segment_ids of shape \(2, 32\) .* must be one row"):
    layouts.zigzag_documents(ids.reshape(2, 32), 2)
  with pytest.raises(ValueError, match=r"length 64 must be a positive multiple of 2 \* num_shards = 24"):
    layouts.zigzag_documents(ids, 12)
  with pytest.raises(ValueError, match=r"num_shards=0 must be a positive int"):
    layouts.zigzag_documents(ids, 0)
  with pytest.raises(ValueError, match=r"min_piece=0 must be a positive int"):
    layouts.zigzag_documents(ids, 2, min_piece=0)
