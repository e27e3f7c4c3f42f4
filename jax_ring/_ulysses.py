"""Ulysses inside the ring: the hybrid sequence parallelism of USP (Fang & Zhao 2024,
"A Unified Sequence Parallelism Approach for Long Context Generative AI").

The sequence is sharded over two mesh axes, `seq_axis` major and `ulysses_axis` minor:
the u devices that share a ring position hold consecutive pieces of that position's
ring shard. One all-to-all over `ulysses_axis` (DeepSpeed-Ulysses, Jacobs et al. 2023)
trades the pieces for heads: afterwards each device holds the whole ring shard for
N / u of the query heads, the ring runs over `seq_axis` as usual, and the inverse
all-to-all gives every device its piece of the sequence back with all heads.

GQA: the K/V heads go through the same all-to-all, so each device must receive the kv
heads its query heads use. When u divides K they are split as they are; otherwise each
kv head is repeated r times first, r the smallest divisor of N / K with u | K r, and the
repeated heads cross the wire (see `kv_repeat`). Integer side data (segment ids,
positions) is gathered over the group with the same all-to-all, so a hybrid call moves
data with all-to-alls and the ring's collective-permutes only.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def check_heads(num_heads: int, group: int, axis) -> None:
  """Raises ValueError unless the query heads (per device, after any head_axis split)
  divide evenly over the `group` devices of the Ulysses axis."""
  if num_heads % group:
    raise ValueError(
      f"num_heads={num_heads} (query heads per device before the all-to-all) must be divisible by the "
      f"{group} devices of ulysses_axis={axis!r}: each device takes num_heads / {group} heads"
    )


def kv_repeat(num_heads: int, num_kv_heads: int, group: int) -> int:
  """How many copies of each kv head go into the all-to-all: the smallest r dividing
  N / K with K r divisible by `group` (r = 1 when `group` divides K). Exists whenever
  `group` divides N (r = N / K always qualifies)."""
  ratio = num_heads // num_kv_heads
  return next(r for r in range(1, ratio + 1) if ratio % r == 0 and (num_kv_heads * r) % group == 0)


def to_heads(x, axis_name):
  """[B, L, heads, ...] with the sequence split over the group -> [B, L * u, heads / u, ...]."""
  return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def to_sequence(x, axis_name):
  """The inverse of `to_heads`: [B, L * u, heads / u, ...] -> [B, L, heads, ...]."""
  return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def gather_sequence(x, axis_name, group: int, axis: int = 1):
  """The group's pieces of x concatenated along `axis` in group order (what a tiled
  all-gather gives), done with an all-to-all of `group` copies: the hybrid then uses
  one kind of collective besides the ring's. For small integer arrays (ids, positions)."""
  if group == 1:
    return x
  copies = jnp.broadcast_to(jnp.expand_dims(x, -1), (*x.shape, group))
  return lax.all_to_all(copies, axis_name, split_axis=x.ndim, concat_axis=axis, tiled=True)[..., 0]


def enter(query, key, value, ids, positions, axis_name, group: int):
  """Into the hybrid: queries and keys/values with the sequence split over the group
  -> the group's whole sequence with N / u query heads and the kv heads they use;
  `ids` ([B, L] each) and `positions` ([L] each; None entries stay None) gathered to
  the whole sequence. Returns ((query, key, value), ids, positions)."""
  gather = lambda x, axis: None if x is None else gather_sequence(x, axis_name, group, axis)
  r = kv_repeat(query.shape[2], key.shape[2], group)
  if r > 1:
    key, value = (jnp.repeat(x, r, axis=2) for x in (key, value))
  qkv = tuple(to_heads(x, axis_name) for x in (query, key, value))
  return qkv, tuple(gather(x, 1) for x in ids), tuple(gather(x, 0) for x in positions)
