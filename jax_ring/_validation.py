"""Checks at the public boundary: clear errors before anything is traced into XLA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check_qkv(query, key, value, *, same_length: bool = False):
  """Validates BTNH query and BSKH key/value; returns (B, T, S, N, K, H)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"{name}.shape={tuple(x.shape)} must have rank 4: [batch, seq, heads, head_dim]")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype")
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


def check_segment_ids(segment_ids, batch: int, length: int, name: str = "segment_ids"):
  if segment_ids is None:
    return
  if not hasattr(segment_ids, "shape"):
    raise TypeError(f"{name} must be an integer array, got {type(segment_ids).__name__}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={segment_ids.dtype} must be an integer dtype")
  if tuple(segment_ids.shape) != (batch, length):
    raise ValueError(f"{name}.shape={tuple(segment_ids.shape)} must be (batch, seq)={(batch, length)}")


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
