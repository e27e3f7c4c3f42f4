"""Checks at the public boundary: clear errors before anything is traced into XLA."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import warnings

import jax.numpy as jnp
import numpy as np
from jax import lax

_NOTICED: set = set()  # the notices already given in this process
# Mesh axes a caller inside jax_ring replicates over on purpose (a Ulysses module's KV
# cache lives on the ring axis alone): no notice for them.
_REPLICATED = contextvars.ContextVar("jax_ring_replicated_axes", default=())


@contextlib.contextmanager
def replicated_over(*axes):
  """Within it, `notice_mesh` says nothing about `axes` (None entries are ignored)."""
  token = _REPLICATED.set(_REPLICATED.get() + tuple(a for a in axes if a is not None))
  try:
    yield
  finally:
    _REPLICATED.reset(token)


def _caller_level() -> int:
  """The stacklevel of the first frame outside jax_ring (and jax_ring.models): the
  user's call."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_globals.get("__name__", "").startswith("jax_ring"):
    frame, level = frame.f_back, level + 1
  return level


log = logging.getLogger("jax_ring")


def notice_once(key, message: str, *, warn: bool = True) -> None:
  """A UserWarning, pointing at the user's call, the first time `key` is seen in this
  process; never again. `warn=False`: an INFO record on the "jax_ring" logger instead
  (what supported input does, documented where the argument is)."""
  if key not in _NOTICED:
    _NOTICED.add(key)
    if warn:
      warnings.warn(message, UserWarning, stacklevel=_caller_level())
    else:
      log.info(message)


def notice_mesh(
  mesh, caller: str, seq_axis, named, length: int | None = None, parts: int | None = None
) -> None:
  """Warns once about axes of size > 1 that no argument names (every device along them
  repeats the same work); logs once (INFO) a length the ring does not divide, which is
  supported input whose output comes back replicated along the ring's axis."""
  for axis in mesh.axis_names:
    if axis not in named and axis not in _REPLICATED.get() and mesh.shape[axis] > 1:
      notice_once(
        ("unused axis", caller, axis, mesh.shape[axis]),
        f"jax_ring.{caller}: mesh axis {axis!r} (size {mesh.shape[axis]}) is not named as seq_axis, "
        "batch_axis, head_axis or ulysses_axis, so every device along it repeats the same work. Name it "
        f"(e.g. batch_axis={axis!r}) or pass a mesh without it.",
      )
  p = parts or mesh.shape[seq_axis]
  if length is not None and length % p:
    notice_once(
      ("replicated output", caller, p),
      f"jax_ring.{caller}: length {length} does not divide by the {p} devices of the sequence, "
      f"so the output comes back replicated along {seq_axis!r} (every device holds all {length} rows); "
      f"a length that is a multiple of {p} keeps it sharded. (Said once per process.)",
      warn=False,
    )


def check_qkv(query, key, value, *, same_length: bool = False):
  """Validates BTNH query and BSKH key/value; returns (B, T, S, N, K, H)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(
        f"{name}.shape={tuple(x.shape)} must have rank 4, [batch, seq, heads, head_dim] (or query, key "
        "and value all rank 3, [seq, heads, head_dim], as jax.nn.dot_product_attention takes them)"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype")
  dtypes = tuple(jnp.dtype(x.dtype) for x in (query, key, value))
  if len(set(dtypes)) > 1:
    raise ValueError(
      f"query.dtype={dtypes[0]}, key.dtype={dtypes[1]}, value.dtype={dtypes[2]} must be one dtype, as in "
      "jax.nn.dot_product_attention: cast them alike (a Policy sets the dtype the ring computes in)"
    )
  b, t, n, h = query.shape
  bk, s, k, hk = key.shape
  if key.shape != value.shape:
    raise ValueError(f"key.shape={tuple(key.shape)} must equal value.shape={tuple(value.shape)}")
  if bk != b:
    raise ValueError(f"key batch={bk} must equal query batch={b}")
  if hk != h:
    raise ValueError(f"key head_dim={hk} must equal query head_dim={h}")
  if k == 0 or n % k:
    raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={k}")
  if same_length and s != t:
    raise ValueError(
      f"key length={s} must equal query length={t}: ring attention is self-attention "
      "over one sharded sequence"
    )
  return b, t, s, n, k, h


def add_batch_axis(query, key, value):
  """(query, key, value, unbatched): rank-3 [T, N, H] / [S, K, H] inputs, as
  jax.nn.dot_product_attention takes them, gain a batch axis of 1."""
  if all(getattr(x, "ndim", None) == 3 for x in (query, key, value)):
    return query[None], key[None], value[None], True
  return query, key, value, False


def check_bool(value, name: str) -> bool:
  """A flag as a Python bool; anything but a bool (a string such as "False", which
  Python would take as true, or an int) is a TypeError."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}={value!r} must be a bool (True or False)")
  return bool(value)


def check_bound_axis(axis, name: str, caller: str) -> None:
  """ValueError unless `axis` is bound by a surrounding `jax.shard_map` (JAX itself
  would raise a NameError deep inside the trace)."""
  try:
    lax.axis_size(axis)
  except NameError:
    raise ValueError(
      f"{caller}: {name}={axis!r} is not an axis of a surrounding jax.shard_map; call it inside "
      f"jax.shard_map over a mesh with that axis (or call ring_attention on global arrays)"
    ) from None


def refuse_dense(mask, bias) -> None:
  """ValueError for a dense mask or bias, naming what ring attention takes instead."""
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      shape = getattr(x, "shape", type(x).__name__)
      raise ValueError(
        f"ring_attention takes no dense {name} (got {name} of shape {shape}): "
        "a [B, N, T, S] matrix is what ring attention never builds. Express the mask with is_causal, "
        "local_window_size=(left, right), segment_ids (packing, padding, block-diagonal) or "
        "query_seq_lengths / key_value_seq_lengths; position-dependent terms go into q and k (RoPE)."
      )


def check_segment_ids(segment_ids, batch: int, length: int, name: str = "segment_ids"):
  if segment_ids is None:
    return
  if not hasattr(segment_ids, "shape"):
    raise TypeError(f"{name} must be an integer array, got {type(segment_ids).__name__}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={segment_ids.dtype} must be an integer dtype")
  if tuple(segment_ids.shape) != (batch, length):
    raise ValueError(f"{name}.shape={tuple(segment_ids.shape)} must be (batch, seq)={(batch, length)}")


def check_document_bound(bound, segment_ids, t: int, s: int) -> int | str | None:
  """`document_bound` as an int >= 1, "auto" (the bound read from the ids at run time),
  or None; it needs the documents it bounds (segment ids) and self-attention (S == T)."""
  if bound is None:
    return None
  if isinstance(bound, str):
    if bound != "auto":
      raise ValueError(
        f"document_bound={bound!r} must be an int (the longest document's tokens), 'auto' or None"
      )
  elif isinstance(bound, bool) or not isinstance(bound, (int, np.integer)):
    raise TypeError(
      f"document_bound={bound!r} must be an int (the longest document's tokens), 'auto' or None"
    )
  elif bound < 1:
    raise ValueError(f"document_bound={bound} must be at least 1 (the longest document's tokens)")
  if segment_ids is None:
    raise ValueError(
      f"document_bound={bound!r} needs segment_ids: the documents it bounds are runs of one id "
      "(without ids the whole row is one document)"
    )
  if s != t:
    raise ValueError(f"document_bound={bound!r} needs self-attention (S == T); got T={t}, S={s}")
  return bound if bound == "auto" else int(bound)


def normalize_window(local_window_size) -> tuple[int, int] | None:
  """int w -> (w, w); (left, right) checked; None stays None."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    window = (int(local_window_size), int(local_window_size))
  elif (
    isinstance(local_window_size, (tuple, list))
    and len(local_window_size) == 2
    and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size)
  ):
    window = (int(local_window_size[0]), int(local_window_size[1]))
  else:
    raise TypeError(f"local_window_size={local_window_size!r} must be an int or a (left, right) pair of ints")
  if window[0] < 0 or window[1] < 0:
    raise ValueError(f"local_window_size={local_window_size!r} must be non-negative")
  return window


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return float(1.0 / np.sqrt(head_dim))
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
    raise TypeError(f"scale={scale!r} must be a Python float or None")
  if not np.isfinite(scale) or scale <= 0:
    raise ValueError(f"scale={scale!r} must be a finite positive number")
  return float(scale)


def check_mesh_axis(mesh, axis, name: str, *, allow_none: bool):
  if axis is None:
    if allow_none:
      return 1
    raise ValueError(f"{name}=None: a mesh axis name is required")
  names = tuple(mesh.axis_names)
  if axis not in names:
    raise ValueError(f"{name}={axis!r} is not an axis of the mesh; mesh axes are {names}")
  return int(mesh.shape[axis])


def check_divides(size: int, parts: int, what: str, axis_arg: str, axis):
  if size % parts:
    raise ValueError(f"{what}={size} must be divisible by the size {parts} of mesh axis {axis_arg}={axis!r}")


def _array(x, name: str, kind: str = "an integer array"):
  """x as an array: jax arrays and tracers pass, array-likes (lists, ints) go through NumPy."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  try:
    return np.asarray(x)
  except Exception as e:
    raise TypeError(f"{name}={x!r} must be {kind}") from e


def _concrete(x):
  """x as a NumPy array when its values are known now (not a tracer), else None."""
  try:
    return np.asarray(x)
  except Exception:  # a tracer (inside jit) or a global array spanning other processes
    return None


def check_seq_lengths(lengths, name: str, batch: int, length: int, unbatched: bool):
  """Per-row valid lengths (jax.nn's query_seq_lengths / key_value_seq_lengths): int
  [B] (or [1] / a scalar for rank-3 inputs), each in [0, length] when concrete.
  Returns an int32 [B] array or None."""
  if lengths is None:
    return None
  lengths = _array(lengths, name)
  shapes = ((batch,), ()) if unbatched else ((batch,),)
  if tuple(lengths.shape) not in shapes:
    raise ValueError(f"{name}.shape={tuple(lengths.shape)} must be (batch,)=({batch},)")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={lengths.dtype} must be an integer dtype")
  values = _concrete(lengths)
  if values is not None and ((values < 0) | (values > length)).any():
    raise ValueError(f"{name}={values.tolist()} must lie in [0, {length}], the length of that sequence")
  return jnp.reshape(jnp.asarray(lengths, jnp.int32), (batch,))


def split_segment_ids(segment_ids, batch: int, t: int, s: int, unbatched: bool):
  """`segment_ids` as (query ids [B, T], key/value ids [B, S]), or (None, None).

  One array serves both sides when T == S; a pair (query ids, kv ids) gives each its
  own. For rank-3 inputs the ids have no batch axis ([T], [S]) and gain one here."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise TypeError(
        f"segment_ids is a sequence of {len(segment_ids)}; expected one int array or a pair "
        "(query_segment_ids, kv_segment_ids)"
      )
    pair = [(segment_ids[0], "segment_ids[0] (query ids)", t), (segment_ids[1], "segment_ids[1] (kv ids)", s)]
  else:
    if s != t:
      raise ValueError(
        f"segment_ids is one array, but key length S={s} != query length T={t}: pass a pair "
        "(query_segment_ids [B, T], kv_segment_ids [B, S])"
      )
    pair = [(segment_ids, "segment_ids", t)]
  out = []
  for ids, name, length in pair:
    if not hasattr(ids, "shape"):
      raise TypeError(f"{name} must be an integer array, got {type(ids).__name__}")
    if unbatched:
      if tuple(ids.shape) != (length,):
        raise ValueError(f"{name}.shape={tuple(ids.shape)} must be (seq,)=({length},) for rank-3 inputs")
      ids = ids[None]
    check_segment_ids(ids, batch, length, name)
    out.append(ids)
  return (out[0], out[0]) if len(out) == 1 else tuple(out)


def apply_lengths(q_ids, kv_ids, q_lengths, kv_lengths, q_positions, kv_positions):
  """(query ids, kv ids) with the per-row lengths folded in (`mask_beyond`), both int32
  or both None: lengths on one side only give the other side ids of 0."""
  q_ids = mask_beyond(q_ids, q_lengths, q_positions)
  kv_ids = mask_beyond(kv_ids, kv_lengths, kv_positions)
  if q_ids is None and kv_ids is None:
    return None, None
  b = (q_ids if q_ids is not None else kv_ids).shape[0]
  fill = lambda ids, positions: jnp.zeros((b, positions.shape[0]), jnp.int32) if ids is None else ids
  return fill(q_ids, q_positions).astype(jnp.int32), fill(kv_ids, kv_positions).astype(jnp.int32)


def mask_beyond(ids, lengths, positions):
  """Segment ids [B, L] (None: all 0) of tokens at global `positions` [L], with every
  token at a position >= lengths[b] set to -1 (padding); ids as given when lengths is
  None."""
  if lengths is None:
    return ids
  base = (
    jnp.zeros((lengths.shape[0], positions.shape[0]), jnp.int32) if ids is None else ids.astype(jnp.int32)
  )
  return jnp.where(positions[None] < lengths[:, None], base, -1)


def check_score_mods(
  logit_soft_cap,
  sinks,
  alibi_slopes,
  dropout_rate,
  dropout_rng,
  score_mod,
  *,
  batch: int,
  heads: int,
  dropout_broadcast: bool = False,
):
  """The score modifiers' arguments checked: (ScoreMods, sinks float32 [N] or None,
  slopes float32 [B, N] or None, dropout seed uint32 [2] or None)."""
  import jax

  from jax_ring._mods import ScoreMods, dropout_seed

  cap = None
  if logit_soft_cap is not None:
    if isinstance(logit_soft_cap, bool) or not isinstance(logit_soft_cap, (int, float, np.number)):
      raise TypeError(
        f"logit_soft_cap={logit_soft_cap!r} must be a positive float (Gemma 2 uses 50.0) or None"
      )
    cap = float(logit_soft_cap)
    if not (np.isfinite(cap) and cap > 0):
      raise ValueError(f"logit_soft_cap={logit_soft_cap!r} must be a positive finite float or None")
  if sinks is not None:
    sinks = _array(sinks, "sinks", "a float array")
    if sinks.shape != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(
        f"sinks shape={tuple(sinks.shape)} dtype={sinks.dtype} must be float [{heads}]: one logit per "
        "query head"
      )
  slopes = None
  if alibi_slopes is not None:
    slopes = _array(alibi_slopes, "alibi_slopes", "a float array")
    if slopes.shape not in ((heads,), (batch, heads)) or not jnp.issubdtype(slopes.dtype, jnp.floating):
      raise ValueError(
        f"alibi_slopes shape={tuple(slopes.shape)} dtype={slopes.dtype} must be float [{heads}] or "
        f"[{batch}, {heads}]: one slope per query head (per batch row)"
      )
    slopes = jnp.broadcast_to(slopes.astype(jnp.float32), (batch, heads))
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.number)):
    raise TypeError(f"dropout_rate={dropout_rate!r} must be a float in [0, 1)")
  rate = float(dropout_rate)
  if not 0 <= rate < 1:
    raise ValueError(f"dropout_rate={dropout_rate!r} must be in [0, 1)")
  seed = None
  if rate > 0:
    if dropout_rng is None:
      raise ValueError(f"dropout_rate={rate} needs dropout_rng, a PRNG key (jax.random.key(0))")
    is_key = jnp.issubdtype(getattr(dropout_rng, "dtype", None), jax.dtypes.prng_key) or (
      getattr(dropout_rng, "dtype", None) == jnp.uint32 and getattr(dropout_rng, "shape", None) == (2,)
    )
    if not is_key:
      raise TypeError(
        f"dropout_rng={dropout_rng!r} must be a PRNG key (jax.random.key or jax.random.PRNGKey)"
      )
    seed = dropout_seed(dropout_rng)
  if score_mod is not None and not callable(score_mod):
    raise TypeError(f"score_mod={score_mod!r} must be a function (s, q_pos, k_pos, head) -> s, or None")
  broadcast = check_bool(dropout_broadcast, "dropout_broadcast")
  mods = ScoreMods(
    soft_cap=cap,
    alibi=slopes is not None,
    score_mod=score_mod,
    dropout=rate,
    dropout_broadcast=broadcast and rate > 0,
  )
  return mods, (None if sinks is None else sinks), slopes, seed
