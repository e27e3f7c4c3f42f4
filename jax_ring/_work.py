"""How many score blocks each device computes at each ring step: the balance, visible."""

from __future__ import annotations

import numpy as np

from jax_ring import _documents, _validation, layouts
from jax_ring._ring import schedule
from jax_ring._tiles import BlockSizes, local_blocks


def work_report(
  *,
  layout: str | None = None,
  num_devices: int,
  seq_len: int,
  is_causal: bool = False,
  local_window_size=None,
  block_sizes: BlockSizes | None = None,
  segment_ids=None,
  document_bound: int | str | None = None,
  order=None,
) -> np.ndarray:
  """Score blocks computed per ring step and device: int array [steps, num_devices].

  Row s is ring step s: device d then holds the keys of device (d - s) mod p (after
  the steps that look backwards, a windowed contiguous ring looks forwards: rows
  then hold the keys of d + 1, d + 2, ...). A (query block, key block) pair counts
  when some query in it sees some key, which is exactly when `ring_attention` runs
  it; the others are skipped. Steps a windowed contiguous ring never runs are 0. (The
  kernels decide a tile from its range of ids (padding left out): with ids that rise
  along the row, as packed rows and `layouts.first_seen` give them, that is the same
  (tests/test_documents.py checks both, on a padded row); with ids that come
  back after others, a tile whose ranges overlap runs, masked, though no pair meets.)
  `segment_ids` (int [seq_len], one packed row in natural order, negative on padding):
  a pair counts only where a query and a key of one document meet, as the call skips
  the others; `document_bound` (with them): the passes `ring_attention(...,
  document_bound=)` makes, the others 0 ("auto": the passes the call picks for these
  ids while running, causal without a window). Without ids, blocks are counted as the masks
  above leave them. `order` (int [seq_len], a permutation such as
  `layouts.documents` gives): device d holds positions order[d*c:(d+1)*c] instead of
  the layout's, and every pass runs (as `ring_attention_shard(..., positions=)` makes
  them). Blocks are `local_blocks`'s; on short shards the score-tile budget
  (`fit_tile_budget`, which depends on batch and heads) may halve them in the call,
  and causal zigzag shards of at most 1024 tokens on a CPU mesh that shares its cores
  run their steps by quadrants (`_tiles.quadrant_tiles`): the same keys, in other tiles.
  """
  window = _validation.normalize_window(local_window_size)
  is_causal = _validation.check_bool(is_causal, "is_causal")
  if (layout is None) == (order is None):
    raise ValueError(
      f"work_report takes layout= (a name) or order= (a permutation), one of them; got layout={layout!r}"
    )
  if layout is not None:
    layout = layouts.resolve(layout, is_causal, shard_len=-(-seq_len // num_devices))
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  p = num_devices
  if order is not None:
    order = np.asarray(order)
    if order.shape != (seq_len,) or seq_len % p or not np.array_equal(np.sort(order), np.arange(seq_len)):
      raise ValueError(
        f"order of shape {order.shape} must be a permutation of range({seq_len}), seq_len a multiple of "
        f"num_devices={p}"
      )
    if document_bound is not None:
      raise ValueError(f"document_bound={document_bound} with `order`: every pass runs, no bound is used")
    shard = seq_len // p
    pos = order.reshape(p, shard).astype(np.int64)
    local, bq, bk = local_blocks(shard, block_sizes, devices=p, layout=None)
    back, fwd = p - 1, 0
  else:
    padded = layouts.padded_length(layout, seq_len, p)
    shard = padded // p
    pos = layouts.positions(layout, p, shard)
    pos = np.where(pos < seq_len, pos, -1)
    local, bq, bk = local_blocks(shard, block_sizes, devices=p, layout=layout)
    back, fwd = schedule(layout, window, is_causal, shard, p, False)
    bound = _validation.check_document_bound(document_bound, segment_ids, seq_len, seq_len)
    if bound == "auto":  # the schedule the ids pick while running (causal, no window)
      runtime = (
        None
        if not is_causal or window is not None
        else _documents.picked_schedule(np.asarray(segment_ids), layout, shard, p)
      )
      back, fwd = (back, fwd) if runtime is None else runtime
      bound = None
    reach = _documents.reach(bound, window, is_causal)
    if reach is not None:
      back, fwd = _documents.schedule(layout, *reach, shard, p)
  pos = np.pad(pos, ((0, 0), (0, local - shard)), constant_values=-1)
  seg = None
  if segment_ids is not None:
    ids = np.asarray(segment_ids)
    if ids.shape != (seq_len,) or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"segment_ids of shape {ids.shape} and dtype {ids.dtype} must be int [{seq_len}]")
    seg = np.where(pos >= 0, ids[np.clip(pos, 0, seq_len - 1)], -1)
  sources = [(s, lambda d, s=s: (d - s) % p) for s in range(back + 1)]
  sources += [(back + s, lambda d, s=s: (d + s) % p) for s in range(1, fwd + 1)]
  report = np.zeros((p, p), np.int64)
  for step, source in sources:
    for d in range(p):
      qp = pos[d].reshape(-1, bq)
      kp = pos[source(d)].reshape(-1, bk)
      delta = qp[:, None, :, None] - kp[None, :, None, :]
      visible = np.broadcast_to(kp[None, :, None, :] >= 0, delta.shape)
      if seg is not None:
        qs, ks = seg[d].reshape(-1, bq), seg[source(d)].reshape(-1, bk)
        visible = visible & (qs[:, None, :, None] == ks[None, :, None, :]) & (qs[:, None, :, None] >= 0)
      if is_causal:
        visible = visible & (delta >= 0)
      if window is not None:
        visible = visible & (delta <= window[0]) & (-delta <= window[1])
      report[step, d] = int(visible.any(axis=(2, 3)).sum())
  return report
