"""Score modifiers: what happens to a logit between q.k and the softmax, and after it.

On a logit, in this order (every one from global positions, so the ring computes the
same numbers as dense attention on one device):

    s = scale * q.k
    s = c * tanh(s / c)                 logit_soft_cap=c (Gemma 2)
    s = s - slope[b, n] * |i - j|       alibi_slopes (ALiBi, Press et al. 2022)
    s = score_mod(s, i, j, n)           a user function, elementwise
    masks (causal, window, segments, lengths): s = -inf where hidden
    p = softmax over the row's keys and, with `sinks`, one virtual key of logit
        sinks[n] and value 0 (gpt-oss's attention sinks)
    p = p * keep / (1 - rate)           dropout_rate, keep a pure function of
                                        (dropout_rng, b, n, i, j)

The first three change values, never which keys a query sees, so a tile the masks
skip stays skipped. Sinks join only the normalization: out * exp(lse - lse'), lse' =
logaddexp(lse, sink), applied to the ring's (out, lse) after it, so the kernels never
see them and gradients (sinks' included) follow by the chain rule. Dropout keeps the
softmax's normalizer undropped (FlashAttention's scheme): the kernels drop from the
P @ V product and from dP, and the backward recomputes the same keep decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ScoreMods:
  """The static part of the modifiers (the arrays they use are `ScoreArgs`)."""

  soft_cap: float | None = None
  alibi: bool = False
  score_mod: Callable | None = None
  dropout: float = 0.0
  # One keep decision per (query, key) pair for every batch row and head (Flax's
  # broadcast_dropout), instead of one per (row, head, query, key).
  dropout_broadcast: bool = False

  @property
  def on_scores(self) -> bool:
    """Whether the logits themselves change (soft-cap, ALiBi, score_mod)."""
    return self.soft_cap is not None or self.alibi or self.score_mod is not None

  @property
  def active(self) -> bool:
    return self.on_scores or self.dropout > 0

  def names(self) -> list[str]:
    """The modifiers in use, by their argument names."""
    found = [("logit_soft_cap", self.soft_cap is not None), ("alibi_slopes", self.alibi)]
    found += [("score_mod", self.score_mod is not None), ("dropout_rate", self.dropout > 0)]
    return [name for name, used in found if used]

  def pallas_problem(self) -> str | None:
    """Why the Pallas kernels cannot run these modifiers (None: they can, i.e. none are
    active; sinks apply after either kernel and are not among them)."""
    if not self.active:
      return None
    return f"the Pallas kernels do not apply {', '.join(self.names())} (the XLA tiles do)"


NO_MODS = ScoreMods()


class ScoreArgs(NamedTuple):
  """The dynamic part, for the heads of one call (or one group of heads)."""

  slopes: jax.Array | None  # float32 [B, N]: ALiBi slope per batch row and query head
  seed: jax.Array | None  # uint32 [2]: dropout's key, as bits
  head0: jax.Array  # int32 []: the global index of the first query head here
  batch0: jax.Array  # int32 []: the global index of the first batch row here


def first_index(axis, size: int):
  """The global index of this device's first element along an array axis split over
  mesh `axis` in pieces of `size` (0 when `axis` is None); inside `shard_map`."""
  return 0 if axis is None else jax.lax.axis_index(axis) * size


def group_args(args: ScoreArgs | None, start, width: int) -> ScoreArgs | None:
  """`args` for the query heads [start, start + width) of the ones it covers."""
  if args is None:
    return None
  slopes = None if args.slopes is None else jax.lax.dynamic_slice_in_dim(args.slopes, start, width, axis=1)
  return args._replace(slopes=slopes, head0=args.head0 + start)


def dropout_seed(rng) -> jax.Array:
  """uint32 [2] from a PRNG key (typed or raw): the seed of the keep decisions."""
  return jax.random.bits(rng, (2,), jnp.uint32)


def _mix(x):
  """A 32-bit integer hash (MurmurHash3's finalizer, Appleby)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def keep(seed, batch, head, q_pos, k_pos, rate: float):
  """bool, broadcast over the int arguments: whether dropout keeps the weight of
  query position q_pos on key position k_pos for (batch row, query head). A pure
  function of its arguments, so any device, layout or tile computes the same."""
  u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  h = _mix(seed[0] ^ _mix(u32(batch) * jnp.uint32(0x9E3779B1) + u32(head)))
  h = _mix(h ^ u32(q_pos) * jnp.uint32(0x27D4EB2F) ^ seed[1])
  h = _mix(h + u32(k_pos) * jnp.uint32(0x165667B1))
  uniform = (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  return uniform >= rate


def modify(mods: ScoreMods, s, q_pos, k_pos, heads, slopes, *, derivative: bool = False):
  """(s', ds'/ds, ds'/da): soft-cap, ALiBi and score_mod applied to scaled logits s,
  all arguments broadcastable to s: q_pos, k_pos global int positions, heads global
  query-head indices, slopes ALiBi's per (batch row, head). With `derivative`, the
  elementwise derivatives of the result with respect to s and to the logit after
  ALiBi, a (score_mod's alone); None where one is 1 or not asked for."""
  d = d_mod = None
  if mods.soft_cap is not None:
    c = jnp.asarray(mods.soft_cap, s.dtype)
    t = jnp.tanh(s / c)
    s = c * t
    d = 1 - t * t
  if mods.alibi:
    s = s - slopes.astype(s.dtype) * jnp.abs(q_pos - k_pos).astype(s.dtype)
  if mods.score_mod is not None:
    f = lambda s: mods.score_mod(s, q_pos, k_pos, heads).astype(s.dtype)
    if derivative:
      s, d_mod = jax.jvp(f, (s,), (jnp.ones_like(s),))
      d = d_mod if d is None else d * d_mod
    else:
      s = f(s)
  return s, d, d_mod


def with_sinks(out, lse, sinks):
  """(out, lse) [B, T, N, H], [B, T, N] over the keys -> with one more key per head of
  logit sinks[n] [N] and value 0 in every row's softmax: out * exp(lse - lse'), lse' =
  logaddexp(lse, sink). A row that saw no key keeps output 0."""
  acc = jnp.promote_types(lse.dtype, jnp.float32)
  lse = lse.astype(acc)
  total = jnp.logaddexp(lse, sinks.astype(acc))
  factor = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - jnp.where(jnp.isneginf(total), 0.0, total)))
  return (out.astype(acc) * factor[..., None]).astype(out.dtype), total


def alibi_slopes(num_heads: int):
  """ALiBi's head slopes (Press et al. 2022, "Train Short, Test Long"): for N a power
  of two the geometric sequence 2^(-8 / N), 2^(-16 / N), ..., 2^(-8); otherwise those of
  the largest power of two P < N, then every other slope of 2P's sequence for the rest
  (the authors' code). float32 [N]."""
  if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
    raise ValueError(f"num_heads={num_heads!r} must be a positive int")

  def geometric(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  p = 1 << (num_heads.bit_length() - 1)
  slopes = geometric(p)
  if p < num_heads:
    slopes += geometric(2 * p)[0::2][: num_heads - p]
  return jnp.asarray(slopes, jnp.float32)
