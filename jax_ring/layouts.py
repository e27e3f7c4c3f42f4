"""Token layouts over a ring of p devices, and the permutations between them.

A layout says which global positions each device holds. Ring attention computes its
masks from these positions, so every layout gives the same result; layouts differ only
in how evenly causal work is spread over the devices.

- "contiguous": device i holds [i*c, (i+1)*c), c = T/p.
- "striped": device i holds positions t with t mod p == i (T divisible by p*p internally).
- "zigzag": the sequence is cut into 2p chunks; device i holds chunks i and 2p-1-i.
- "auto": zigzag for causal attention, contiguous otherwise; contiguous also for causal
  attention over short shards (at most SHORT_CAUSAL_SHARD tokens a device) where the
  caller gives the shard length (`ring_attention`, `work_report`).

A model that keeps its activations in one layout through every layer calls
`permutation` once at the input (and `inverse_permutation` at the output), passes the
permuted positions to its rotary embeddings, and calls `ring_attention(...,
token_order="layout")`, which then moves nothing but the ring's K/V
(`models.DecoderLM` with `LMConfig.ring_order`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("contiguous", "striped", "zigzag")

# Under "auto", causal shards of at most this many tokens stay contiguous. Zigzag's
# balance saves at most half a shard's tiles per ring step, while its relayout costs
# two ppermutes of half a shard each way and its tiles are half as long; at 128 and
# 256 tokens a device the relayout and the smaller tiles cost more than the balance
# saves (docs/benchmarks.md, "Short causal shards stay contiguous": causal forward+
# backward on 8 devices, contiguous 0.106 vs zigzag 0.143 s at T=1024, 0.267 vs 0.312 s
# at T=2048, level at T=4096).
SHORT_CAUSAL_SHARD = 256


def resolve(layout: str, is_causal: bool, shard_len: int | None = None) -> str:
  """Maps "auto" to the concrete layout (see the module doc); checks the name.
  `shard_len` (tokens a device) lets "auto" keep short causal shards contiguous."""
  match layout:
    case "auto":
      short = shard_len is not None and shard_len <= SHORT_CAUSAL_SHARD
      return "zigzag" if is_causal and not short else "contiguous"
    case "contiguous" | "striped" | "zigzag":
      return layout
    case _:
      raise ValueError(f"Unsupported layout={layout!r}; expected 'auto' or one of {LAYOUTS}")


def multiple(layout: str, num_shards: int, pieces: int = 1) -> int:
  """The total length must be a multiple of this for the layout; `pieces`: each ring
  shard is further split over that many devices (the Ulysses axis), each an equal part."""
  match resolve(layout, False):
    case "contiguous":
      base = num_shards
    case "zigzag":
      base = 2 * num_shards
    case "striped":
      base = num_shards * num_shards
  return math.lcm(base, num_shards * pieces)


def padded_length(layout: str, length: int, num_shards: int) -> int:
  m = multiple(layout, num_shards)
  return -(-length // m) * m


def positions(layout: str, num_shards: int, shard_len: int) -> np.ndarray:
  """Global positions held by each device: int array [num_shards, shard_len] (NumPy,
  so usable under a trace)."""
  return _positions(np, layout, np.arange(num_shards, dtype=np.int32)[:, None], shard_len, num_shards)


def shard_positions(layout: str, index, shard_len: int, num_shards: int):
  """Global positions of the tokens on device `index` (a Python int or a traced scalar)."""
  return _positions(jnp, layout, jnp.asarray(index, dtype=jnp.int32), shard_len, num_shards)


def _positions(xp, layout: str, index, shard_len: int, num_shards: int):
  """The layout's positions of device(s) `index` (broadcast against the offsets), in
  NumPy or jax.numpy (`xp`)."""
  offsets = xp.arange(shard_len, dtype=xp.int32)
  match resolve(layout, False):
    case "contiguous":
      return index * shard_len + offsets
    case "striped":
      return offsets * num_shards + index
    case "zigzag":
      if shard_len % 2:
        raise ValueError(f"zigzag layout needs an even shard length, got shard_len={shard_len}")
      half = shard_len // 2
      first = index * half + offsets[:half]
      second = (2 * num_shards - 1 - index) * half + offsets[:half]
      return xp.concatenate([first, second], axis=-1)


def permutation(layout: str, length: int, num_shards: int) -> np.ndarray:
  """perm such that x[:, perm] is x in the layout (device i holds rows i*c:(i+1)*c)."""
  if length % multiple(layout, num_shards):
    raise ValueError(
      f"length={length} must be a multiple of {multiple(layout, num_shards)} for "
      f"layout={layout!r} over {num_shards} devices; see padded_length"
    )
  return positions(layout, num_shards, length // num_shards).reshape(-1)


def inverse_permutation(layout: str, length: int, num_shards: int) -> np.ndarray:
  """inv such that y[:, inv] undoes y = x[:, perm]."""
  return np.argsort(permutation(layout, length, num_shards))


def to_layout(x, layout: str, num_shards: int, axis: int = 1):
  """Reorders the sequence axis of a global array from natural order into the layout."""
  return jnp.take(x, permutation(layout, x.shape[axis], num_shards), axis=axis)


def from_layout(x, layout: str, num_shards: int, axis: int = 1):
  """Inverse of `to_layout`."""
  return jnp.take(x, inverse_permutation(layout, x.shape[axis], num_shards), axis=axis)


def _zigzag_perms(num_shards: int):
  """Where the two halves of each contiguous shard go in the zigzag layout.

  Device i holds natural chunks 2i and 2i+1 (of 2p); chunk m belongs on device m
  (first half) if m < p, else on device 2p-1-m (second half). Each half is a
  permutation of the devices, so two ppermutes move everything.
  """
  p = num_shards
  dest = lambda m: m if m < p else 2 * p - 1 - m
  first = [(i, dest(2 * i)) for i in range(p)]
  second = [(i, dest(2 * i + 1)) for i in range(p)]
  return first, second


def relayout_shard(x, layout: str, axis_name, num_shards: int, *, inverse: bool = False, axis: int = 1):
  """Inside shard_map: moves a contiguous shard into `layout` (or back, with inverse).

  zigzag costs two ppermutes of half a shard each; striped one all_to_all. Memory
  stays O(shard). Never an all-gather.
  """
  p = num_shards
  layout = resolve(layout, False)
  if layout == "contiguous" or p == 1:
    return x
  x = jnp.moveaxis(x, axis, 1)
  b, n = x.shape[:2]
  rest = x.shape[2:]
  index = lax.axis_index(axis_name)
  if layout == "zigzag":
    first, second = _zigzag_perms(p)
    half = n // 2
    even = index % 2 == 0
    if not inverse:
      r0 = lax.ppermute(x[:, :half], axis_name, first)
      r1 = lax.ppermute(x[:, half:], axis_name, second)
      # Device j gets chunk j (slot 0) through `first` when j is even, else `second`.
      slot0 = jnp.where(even, r0, r1)
      slot1 = jnp.where(even, r1, r0)
      y = jnp.concatenate([slot0, slot1], axis=1)
    else:
      slot0, slot1 = x[:, :half], x[:, half:]
      back0 = jnp.where(even, slot0, slot1)  # what arrived through `first`
      back1 = jnp.where(even, slot1, slot0)
      inv = lambda perm: [(d, s) for s, d in perm]
      h0 = lax.ppermute(back0, axis_name, inv(first))
      h1 = lax.ppermute(back1, axis_name, inv(second))
      y = jnp.concatenate([h0, h1], axis=1)
  else:  # striped
    if n % p:
      raise ValueError(f"striped layout needs shard length {n} divisible by {p} devices")
    if not inverse:
      # Column d of [n/p, p] holds the tokens device d owns; the source index lands
      # in front, which is their order on the receiving device.
      y = x.reshape(b, n // p, p, *rest)
      y = lax.all_to_all(y, axis_name, split_axis=2, concat_axis=1, tiled=True)
      y = y.reshape(b, n, *rest)
    else:
      # Rows [i*n/p, (i+1)*n/p) came from device i: send them back, and interleave
      # what comes back so that row r of device d's column lands at r*p + d.
      y = x.reshape(b, n, 1, *rest)
      y = lax.all_to_all(y, axis_name, split_axis=1, concat_axis=2, tiled=True)
      y = y.reshape(b, n, *rest)
  return jnp.moveaxis(y, 1, axis)
