"""Flax NNX modules over jax_ring's attention functions.

- `RingAttention`: multi-head self-attention (q/k/v/out projections, GQA, optional
  rotary embeddings from global positions) whose core is ring attention over a mesh,
  dense attention on one device, or shard-local attention (each shard attends only
  within itself: the baseline that shows what the ring buys).
- `DilatedAttention`: the same projections around LongNet dilated attention, with
  LongNet's sub-layer norm before the output projection.
- `make_attention_fn`: a drop-in `attention_fn` for `flax.nnx.MultiHeadAttention`.

Legend: B batch, T sequence length, D model features, N query heads, K kv heads,
H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ring import _validation, layouts
from jax_ring._attention import ring_attention
from jax_ring._decode import (
  KVCache,
  decode_attention,
  init_cache,
  prefill_attention,
  prompt_rows,
  update_cache,
)
from jax_ring._dilated import check_patterns, dilated_attention
from jax_ring._mods import alibi_slopes
from jax_ring._policy import Policy
from jax_ring._reference import reference_attention, reference_dilated_attention
from jax_ring._tiles import BlockSizes

RING_KINDS = ("ring", "dense", "local")
DILATED_KINDS = ("dilated", "dense")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How a model stretches its rotary frequencies past the length it was first trained
  at: each frequency base^(-2i / H) is divided by a factor of its own.

  kind "linear": every frequency by `factor` (position interpolation, Chen et al. 2023,
  arXiv 2306.15595; Gemma 3 4B+ on its global layers, factor 8). kind "llama3": Llama
  3.1's rule (Meta's reference code, `apply_scaling`): wavelengths shorter than
  original_max_position_embeddings / high_freq_factor keep their frequency, those
  longer than original_max_position_embeddings / low_freq_factor are divided by
  `factor`, and the ones between are interpolated smoothly. kind "factors": the
  divisors themselves, one per frequency (what llama.cpp stores in a GGUF file as the
  `rope_freqs.weight` tensor). kind "longrope": LongRoPE (Ding et al. 2024, arXiv
  2402.13753) as Phi-3 and Phi-4-mini run it: `factors` (the short ones) for a
  sequence of at most original_max_position_embeddings tokens, `long_factors` for a
  longer one, chosen per call by the largest position + 1 as transformers chooses
  them; the rotated dimensions are also multiplied by `attention_factor` (on q and
  k, so the logits by its square)."""

  kind: str
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  factors: tuple[float, ...] = ()
  long_factors: tuple[float, ...] = ()
  attention_factor: float = 1.0

  def __post_init__(self):
    kinds = ("linear", "llama3", "factors", "longrope")
    if self.kind not in kinds:
      raise ValueError(f"RopeScaling.kind={self.kind!r} is not one of {kinds}")
    if self.kind in ("factors", "longrope"):
      if not self.factors or not all(f > 0 for f in self.factors):
        raise ValueError(f"RopeScaling.factors={self.factors!r} must be positive numbers, one per frequency")
    elif not self.factor > 0:
      raise ValueError(f"RopeScaling.factor={self.factor!r} must be positive")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
        f"RopeScaling high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
        f"{self.low_freq_factor} > 0"
      )

    if self.kind == "longrope":
      if len(self.long_factors) != len(self.factors) or not all(f > 0 for f in self.long_factors):
        raise ValueError(
          f"RopeScaling.long_factors={self.long_factors!r} must be {len(self.factors)} positive numbers, "
          "as many as the short factors"
        )
      if self.original_max_position_embeddings < 1:
        raise ValueError(
          f"RopeScaling.original_max_position_embeddings={self.original_max_position_embeddings!r} must be "
          "a positive int"
        )
    elif self.long_factors:
      raise ValueError(f"RopeScaling.long_factors are LongRoPE's; kind={self.kind!r} takes none")
    if not self.attention_factor > 0:
      raise ValueError(f"RopeScaling.attention_factor={self.attention_factor!r} must be positive")

  def divisors(self, inv_freq, length=None):
    """The factor each of `inv_freq`'s frequencies is divided by. `length`: the
    sequence's length (largest position + 1, an int or a traced scalar), which picks
    LongRoPE's factors (None: the short ones); the other kinds ignore it."""
    match self.kind:
      case "linear":
        return jnp.full_like(inv_freq, self.factor)
      case "factors":
        if len(self.factors) != inv_freq.shape[0]:
          raise ValueError(
            f"RopeScaling has {len(self.factors)} factors for {inv_freq.shape[0]} rotary frequencies"
          )
        return jnp.asarray(self.factors, jnp.float32)
      case "longrope":
        if len(self.factors) != inv_freq.shape[0]:
          raise ValueError(
            f"RopeScaling has {len(self.factors)} LongRoPE factors for {inv_freq.shape[0]} rotary frequencies"
          )
        short = jnp.asarray(self.factors, jnp.float32)
        if length is None:
          return short
        long = jnp.asarray(self.long_factors, jnp.float32)
        return jnp.where(jnp.asarray(length) > self.original_max_position_embeddings, long, short)
      case "llama3":
        old = self.original_max_position_embeddings
        wavelength = 2 * jnp.pi / inv_freq
        smooth = (old / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        between = 1.0 / ((1 - smooth) / self.factor + smooth)
        return jnp.where(
          wavelength < old / self.high_freq_factor,
          1.0,
          jnp.where(wavelength > old / self.low_freq_factor, self.factor, between),
        )
    raise ValueError(f"Unsupported RopeScaling.kind={self.kind!r}")


def rope_frequencies(
  head_dim: int,
  base: float = 10000.0,
  max_wavelength: float | None = None,
  scaling: RopeScaling | None = None,
  length=None,
):
  """The head_dim / 2 rotary frequencies base^(-2i / head_dim). With `max_wavelength`,
  every frequency whose wavelength 2 pi / f exceeds it is set to 0: those dimension
  pairs carry no position at all (p-RoPE, Barbero et al. 2024, arXiv 2410.06205), so a
  model trained on sequences longer than `max_wavelength` has seen every angle its
  rotations can make, at any distance. `scaling`: a `RopeScaling` (Llama 3.1's rule,
  linear interpolation, LongRoPE), applied first; `length`: the sequence length
  LongRoPE picks its factors by (`RopeScaling.divisors`)."""
  inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim // 2, dtype=jnp.float32) / (head_dim // 2)))
  if scaling is not None:
    inv_freq = inv_freq / scaling.divisors(inv_freq, length)
  if max_wavelength is not None:
    inv_freq = jnp.where(2 * jnp.pi / inv_freq > max_wavelength, 0.0, inv_freq)
  return inv_freq


def apply_rope(
  x,
  positions,
  base: float = 10000.0,
  max_wavelength: float | None = None,
  scaling: RopeScaling | None = None,
  rotary_dim: int | None = None,
):
  """Rotary position embedding (Su et al. 2021, RoFormer) of x [B, T, N, H] at
  global positions [T] or [B, T]; pairs dimension i with i + R/2 among the first R =
  `rotary_dim` (default H) and leaves the other H - R as they are (Phi-3's and
  GPT-NeoX's partial rotary). `max_wavelength`, `scaling`: see `rope_frequencies`;
  LongRoPE's factors are picked by the largest position + 1, and its attention
  factor multiplies the rotated dimensions."""
  h = x.shape[-1]
  r = h if rotary_dim is None else rotary_dim
  if isinstance(r, bool) or not isinstance(r, int) or r % 2 or not 0 < r <= h:
    raise ValueError(f"rotary_dim={rotary_dim!r} must be a positive even int of at most head_dim={h}")
  positions = jnp.asarray(positions)
  length = jnp.max(positions) + 1 if scaling is not None and scaling.kind == "longrope" else None
  inv_freq = rope_frequencies(r, base, max_wavelength, scaling, length)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, R/2]
  if angles.ndim == 2:
    angles = angles[None]
  gain = 1.0 if scaling is None else scaling.attention_factor
  sin, cos = jnp.sin(angles)[:, :, None] * gain, jnp.cos(angles)[:, :, None] * gain
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32[..., :r], 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., r:]], axis=-1).astype(x.dtype)


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive int")
  return value


def _check_kind(kind: str, allowed: Sequence[str], mesh, seq_axis) -> None:
  if kind not in allowed:
    raise ValueError(f"kind={kind!r} is not a known attention kind; expected one of {tuple(allowed)}")
  if kind in ("ring", "local") and not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"kind={kind!r} needs mesh= a jax.sharding.Mesh; got mesh={mesh!r}")
  if isinstance(mesh, jax.sharding.Mesh):
    _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
  elif mesh is not None:
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh or None")


def _frozen(**options) -> tuple:
  """Static options as a hashable tuple of (name, value) pairs (`dict()` reads them
  back), so the module's graph definition can key a jit cache."""
  return tuple(options.items())


def _kernel_init(init, sharding):
  if sharding is None:
    return init
  return nnx.with_partitioning(init, tuple(sharding), eager_sharding=False)


class _Projected(nnx.Module):
  """q/k/v/out projections shared by the attention modules."""

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    *,
    num_kv_heads: int | None,
    head_dim: int | None,
    out_features: int | None,
    use_bias: bool,
    rope_base: float | None,
    rope_max_wavelength: float | None,
    dtype,
    param_dtype,
    kernel_init,
    qkv_sharding,
    out_sharding,
    rngs: nnx.Rngs,
    qk_norm_epsilon: float | None = None,
    rope_scaling: RopeScaling | None = None,
    qkv_bias: bool | None = None,
    qk_norm_over_heads: bool = False,
    rope_dim: int | None = None,
  ):
    self.num_heads = _positive_int("num_heads", num_heads)
    self.in_features = _positive_int("in_features", in_features)
    self.num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if head_dim is None:
      if in_features % num_heads:
        raise ValueError(
          f"in_features={in_features} must be divisible by num_heads={num_heads} (or pass head_dim=)"
        )
      head_dim = in_features // num_heads
    self.head_dim = _positive_int("head_dim", head_dim)
    if rope_base is not None and head_dim % 2:
      raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings (rope_base={rope_base})")
    if rope_max_wavelength is not None and (
      isinstance(rope_max_wavelength, bool)
      or not isinstance(rope_max_wavelength, (int, float))
      or not rope_max_wavelength > 0
    ):
      raise ValueError(f"rope_max_wavelength={rope_max_wavelength!r} must be a positive number or None")
    if rope_scaling is not None and not isinstance(rope_scaling, RopeScaling):
      raise TypeError(f"rope_scaling={rope_scaling!r} must be a jax_ring.nn.RopeScaling or None")
    if rope_dim is not None and (
      isinstance(rope_dim, bool)
      or not isinstance(rope_dim, int)
      or rope_dim % 2
      or not 0 < rope_dim <= head_dim
    ):
      raise ValueError(
        f"rope_dim={rope_dim!r} must be None or a positive even int of at most head_dim={head_dim}"
      )
    self.rope_base = rope_base
    self.rope_max_wavelength = rope_max_wavelength
    self.rope_scaling = nnx.static(rope_scaling)
    self.rope_dim = rope_dim
    out_features = in_features if out_features is None else _positive_int("out_features", out_features)
    init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init
    common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if qkv_bias is not None and not isinstance(qkv_bias, bool):
      raise TypeError(f"qkv_bias={qkv_bias!r} must be a bool or None (None: as use_bias)")
    qkv_init = _kernel_init(init, qkv_sharding)
    qkv = dict(common, use_bias=use_bias if qkv_bias is None else qkv_bias, kernel_init=qkv_init)
    self.query = nnx.Linear(in_features, num_heads * head_dim, **qkv)
    self.key = nnx.Linear(in_features, self.num_kv_heads * head_dim, **qkv)
    self.value = nnx.Linear(in_features, self.num_kv_heads * head_dim, **qkv)
    self.out = nnx.Linear(
      num_heads * head_dim, out_features, kernel_init=_kernel_init(init, out_sharding), **common
    )
    eps = qk_norm_epsilon
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
      raise ValueError(f"qk_norm_epsilon={qk_norm_epsilon!r} must be a positive number or None")
    if not isinstance(qk_norm_over_heads, bool):
      raise TypeError(f"qk_norm_over_heads={qk_norm_over_heads!r} must be a bool")
    self.qk_norm_over_heads = qk_norm_over_heads
    norm = lambda heads: nnx.RMSNorm(
      heads * head_dim if qk_norm_over_heads else head_dim,
      epsilon=qk_norm_epsilon,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.query_norm = nnx.data(None) if qk_norm_epsilon is None else norm(num_heads)
    self.key_norm = nnx.data(None) if qk_norm_epsilon is None else norm(self.num_kv_heads)

  def project(self, x, positions):
    if x.ndim != 3 or x.shape[-1] != self.in_features:
      raise ValueError(f"x.shape={tuple(x.shape)} must be [batch, seq, {self.in_features}]")
    b, t, _ = x.shape
    q, k = self.query(x), self.key(x)
    if self.query_norm is not None and self.qk_norm_over_heads:
      q, k = self.query_norm(q), self.key_norm(k)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.value(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.query_norm is not None and not self.qk_norm_over_heads:
      q, k = self.query_norm(q), self.key_norm(k)
    if self.rope_base is not None:
      pos = jnp.arange(t) if positions is None else positions
      rope = lambda x: apply_rope(
        x, pos, self.rope_base, self.rope_max_wavelength, self.rope_scaling, rotary_dim=self.rope_dim
      )
      q, k = rope(q), rope(k)
    return q, k, v


def _replace_value(variable: nnx.Variable, value) -> None:
  """`variable[...] = value` for a traced value of the variable's shape and dtype, without
  flax's check of the two arrays' shardings: on a tracer, reading `.sharding` builds an
  error message with the trace's provenance, about 9 ms each (a Gemma 3 ring prefill's 108
  cache writes took about 2 s of its 3.9 s trace). Anything else goes through `[...] =`."""
  old = variable.get_value()
  if isinstance(value, jax.core.Tracer) and value.shape == old.shape and value.dtype == old.dtype:
    variable.set_value(value)
  else:
    variable[...] = value


class _Cached:
  """Decoding for the attention modules: a sequence-sharded KV cache (`jax_ring.KVCache`)
  in nnx.Cache variables named as in flax.nnx.MultiHeadAttention (cached_key,
  cached_value, cache_index). A subclass gives `_cache_axes`, `_decode_options`,
  `prefill` and `_output` (attention output [B, T, N, H] -> module output)."""

  def init_cache(self, batch_size: int, max_length: int, *, dtype=None):
    """An empty cache for `max_length` tokens per row (prompt and generated), sharded
    along the sequence like the attention. `dtype` defaults to the module's `dtype`
    (else float32), which the projected keys must have."""
    dtype = jnp.dtype(dtype or self.query.dtype or jnp.float32)
    with _validation.replicated_over(self._replicated_axis()):
      cache = init_cache(
        batch_size, max_length, self.num_kv_heads, self.head_dim, dtype=dtype, **self._cache_axes()
      )
    self.cached_key = nnx.Cache(cache.k)
    self.cached_value = nnx.Cache(cache.v)
    self.cache_index = nnx.Cache(cache.lengths)  # [B]: each row's next position
    self.cached_positions = nnx.Cache(cache.positions)
    self.cached_segment_ids = nnx.Cache(cache.segment_ids)
    self.cache_fill = nnx.Cache(jnp.stack([cache.prefilled, cache.appended]))

  @property
  def cache(self) -> KVCache:
    """The module's cache as a `jax_ring.KVCache`."""
    if getattr(self, "cached_key", None) is None:
      raise ValueError("no KV cache: call init_cache(batch_size, max_length) before prefill or decode")
    fill = self.cache_fill[...]
    return KVCache(
      self.cached_key[...],
      self.cached_value[...],
      self.cached_positions[...],
      self.cached_segment_ids[...],
      self.cache_index[...],
      fill[0],
      fill[1],
    )

  def _store(self, cache: KVCache) -> None:
    _replace_value(self.cached_key, cache.k)
    _replace_value(self.cached_value, cache.v)
    _replace_value(self.cached_positions, cache.positions)
    _replace_value(self.cached_segment_ids, cache.segment_ids)
    _replace_value(self.cache_index, cache.lengths)
    _replace_value(self.cache_fill, jnp.stack([cache.prefilled, cache.appended]))

  def decode(self, x, *, segment_ids=None):
    """Appends x [B, Tq, D] (each row's next Tq tokens) to the cache and attends them
    to every cached token of their row: [B, Tq, out_features]."""
    cache = self.cache
    tq = x.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(tq)[None]
    q, k, v = self.project(x, positions)
    axes = self._cache_axes()
    with _validation.replicated_over(self._replicated_axis()):
      cache = update_cache(
        cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), segment_ids=segment_ids, **axes
      )
      out = decode_attention(q, cache, segment_ids=segment_ids, **self._decode_options())
    self._store(cache)
    return self._output(out)

  def _replicated_axis(self):
    """A mesh axis the cache is replicated over by design (a Ulysses module's)."""
    return dict(getattr(self, "options", ())).get("ulysses_axis")


class RingAttention(_Cached, _Projected):
  """Multi-head self-attention whose core is ring attention over `seq_axis` of `mesh`.

  Args:
    num_heads, in_features: N and D.
    kind: "ring" (needs mesh), "dense" (jax_ring.reference_attention on one device,
      the numerical definition), or "local" (needs mesh: each shard of the sequence
      attends only within itself; a baseline, not exact attention).
    num_kv_heads: K for GQA/MQA (default N). head_dim: H (default D // N).
    out_features: default D.
    mesh, seq_axis, batch_axis, head_axis, ulysses_axis: as in `jax_ring.ring_attention`.
      With `ulysses_axis`, training calls run the Ulysses hybrid; prefill and decode
      run the ring over `seq_axis` alone, with the KV cache replicated over it.
    is_causal, local_window_size, layout, policy, block_sizes: as in
      `jax_ring.ring_attention`.
    attention_kernel: `jax_ring.ring_attention`'s `kernel` ("auto", "xla", "pallas"
      or "cudnn") for training and prompt calls (named apart from Flax's `kernel`, the
      projection weights).
    logit_soft_cap: c: logits become c * tanh(s / c) (Gemma 2: 50.0).
    sinks: True: a learned attention sink per query head (an `nnx.Param` [N], zeros at
      first; gpt-oss); an array [N]: fixed sink logits; False: none.
    alibi: True: ALiBi with the paper's slopes (`jax_ring.alibi_slopes`); an array
      [N]: these slopes; False: none.
    score_mod: a function (s, q_pos, k_pos, head) -> s, as in `jax_ring.ring_attention`.
    attention_dropout_rate: dropout on the attention weights in training (after
      `module.train()`; none after `module.eval()`), keys from `rngs`' "dropout"
      stream, as `nnx.Dropout` draws them.
    rope_base: rotary embeddings with this base on q and k at global positions
      (None: none). rope_max_wavelength: frequencies of longer wavelength are dropped
      (`rope_frequencies`), for models run past the length they were trained at.
      rope_scaling: a `RopeScaling` of the frequencies (Llama 3.1's, linear, LongRoPE),
      or None. rope_dim: the leading dimensions of each head that rotate (Phi-3's
      partial rotary; None: all of them).
    qk_norm_epsilon: an RMSNorm over the head dimension (with this epsilon) on each
      query and key head after the projections, before the rotary embeddings (Gemma 3,
      Qwen 3); None: none.
    qk_norm_over_heads: that RMSNorm spans every head's width at once, [N*H] on the
      queries and [K*H] on the keys (OLMo 2's), instead of each head's [H].
    use_bias, dtype, param_dtype, kernel_init: as in `flax.nnx.Linear`.
    qkv_bias: biases on the query, key and value projections alone (Qwen 2's; the
      output projection's follows `use_bias`); None: as `use_bias`.
    qkv_sharding, out_sharding: optional partition names for the [D, N*H] and [N*H, D]
      kernels (e.g. (None, "model") and ("model", None)), stored as metadata only.
    rngs: `flax.nnx.Rngs`.

  Call: x [B, T, D], segment_ids int [B, T] or None, positions [T] or [B, T] (for RoPE,
  default arange(T)) -> [B, T, out_features]. With `token_order="layout"` (kind "ring"),
  x, segment_ids, positions and the result are in the order of the layout the ring
  runs in (`token_layout(T)`; positions default to that order's global positions):
  no relayout in the call (`jax_ring.ring_attention`'s `token_order`).
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    *,
    kind: str = "ring",
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    out_features: int | None = None,
    mesh=None,
    seq_axis="seq",
    batch_axis=None,
    head_axis=None,
    ulysses_axis=None,
    is_causal: bool = False,
    local_window_size=None,
    layout: str = "auto",
    policy: Policy | str | None = None,
    block_sizes: BlockSizes | None = None,
    attention_kernel: str = "auto",
    logit_soft_cap: float | None = None,
    sinks=False,
    alibi=False,
    score_mod=None,
    attention_dropout_rate: float = 0.0,
    rope_base: float | None = None,
    rope_max_wavelength: float | None = None,
    rope_scaling: RopeScaling | None = None,
    qk_norm_epsilon: float | None = None,
    qk_norm_over_heads: bool = False,
    rope_dim: int | None = None,
    use_bias: bool = False,
    qkv_bias: bool | None = None,
    dtype=None,
    param_dtype=jnp.float32,
    kernel_init=None,
    qkv_sharding=None,
    out_sharding=None,
    rngs: nnx.Rngs,
  ):
    _check_kind(kind, RING_KINDS, mesh, seq_axis)
    super().__init__(
      num_heads,
      in_features,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      out_features=out_features,
      use_bias=use_bias,
      rope_base=rope_base,
      rope_max_wavelength=rope_max_wavelength,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      qkv_sharding=qkv_sharding,
      out_sharding=out_sharding,
      rngs=rngs,
      qk_norm_epsilon=qk_norm_epsilon,
      rope_scaling=rope_scaling,
      qkv_bias=qkv_bias,
      qk_norm_over_heads=qk_norm_over_heads,
      rope_dim=rope_dim,
    )
    self.kind = kind
    self.options = nnx.static(
      _frozen(
        mesh=mesh,
        seq_axis=seq_axis,
        batch_axis=batch_axis,
        head_axis=head_axis,
        ulysses_axis=ulysses_axis,
        is_causal=_validation.check_bool(is_causal, "is_causal"),
        local_window_size=_validation.normalize_window(local_window_size),
        layout=layout,
        policy=policy,
        block_sizes=block_sizes,
        kernel=attention_kernel,
      )
    )
    self.score_options = nnx.static(_frozen(logit_soft_cap=logit_soft_cap, score_mod=score_mod))
    self.sinks = _per_head("sinks", sinks, num_heads, lambda: nnx.Param(jnp.zeros((num_heads,), param_dtype)))
    self.alibi_slopes = _per_head("alibi", alibi, num_heads, lambda: nnx.Variable(alibi_slopes(num_heads)))
    if isinstance(attention_dropout_rate, bool) or not 0 <= attention_dropout_rate < 1:
      raise ValueError(f"attention_dropout_rate={attention_dropout_rate!r} must be a float in [0, 1)")
    self.attention_dropout_rate = float(attention_dropout_rate)
    self.deterministic = False  # nnx's train() / eval() set it, as on nnx.Dropout
    self.rngs = rngs["dropout"].fork() if self.attention_dropout_rate > 0 else nnx.data(None)

  def _modifiers(self) -> dict:
    """The score modifiers' arguments of every call (decoding too)."""
    value = lambda v: None if v is None else v[...]
    return dict(self.score_options) | dict(sinks=value(self.sinks), alibi_slopes=value(self.alibi_slopes))

  def attend(self, q, k, v, segment_ids, token_order: str = "natural"):
    o = dict(self.options)
    mods = self._modifiers()
    if self.attention_dropout_rate > 0 and not self.deterministic:
      mods |= dict(dropout_rate=self.attention_dropout_rate, dropout_rng=self.rngs())
    if self.kind == "dense":
      return reference_attention(
        q,
        k,
        v,
        is_causal=o["is_causal"],
        segment_ids=segment_ids,
        local_window_size=o["local_window_size"],
        **mods,
      )
    if self.kind == "local":
      segment_ids = shard_segments(q.shape[0], q.shape[1], o["mesh"].shape[o["seq_axis"]], segment_ids)
      o["layout"] = "contiguous"
    window, t = o["local_window_size"], q.shape[1]
    if window is not None and window[0] >= t - 1 and (o["is_causal"] or window[1] >= t - 1):
      o["local_window_size"] = None  # a window wider than the sequence excludes no key (cuDNN stays open)
    if token_order != "natural":
      o["token_order"] = token_order
    bound = getattr(self, "document_bound", None)
    if bound is not None and self.kind == "ring" and segment_ids is not None:
      o["document_bound"] = bound
    return ring_attention(q, k, v, segment_ids=segment_ids, **o, **mods)

  def token_layout(self, length: int) -> str:
    """The layout a call on `length` tokens runs the ring in: the order the tokens of
    `token_order="layout"` calls come in (`jax_ring.layouts.to_layout(x, this, p)`)."""
    o = dict(self.options)
    if self.kind != "ring":
      raise ValueError(f"token_order='layout' needs kind='ring', not {self.kind!r}")
    shards = o["mesh"].shape[o["seq_axis"]]
    return layouts.resolve(o["layout"], o["is_causal"], shard_len=-(-length // shards))

  def __call__(self, x, *, segment_ids=None, positions=None, token_order: str = "natural"):
    if token_order == "layout":
      layout = self.token_layout(x.shape[1])
      if positions is None:
        o = dict(self.options)
        positions = layouts.permutation(layout, x.shape[1], o["mesh"].shape[o["seq_axis"]])
    q, k, v = self.project(x, positions)
    out = self.attend(q, k, v, segment_ids, token_order)
    return self._output(out)

  # Decoding (`_Cached`): init_cache, prefill, decode.

  def _cache_axes(self) -> dict:
    o = dict(self.options)
    if self.kind == "local":
      raise ValueError("kind='local' has no decode mode: shard-local attention is a training baseline")
    if self.kind == "dense":  # the reference on one device: a one-device "ring"
      return dict(mesh=_one_device_mesh(), seq_axis="seq", batch_axis=None, head_axis=None)
    return {name: o[name] for name in ("mesh", "seq_axis", "batch_axis", "head_axis")}

  def _decode_options(self) -> dict:
    o = dict(self.options)
    return dict(
      local_window_size=o["local_window_size"], policy=o["policy"], **self._cache_axes(), **self._modifiers()
    )

  def prefill(self, x, *, lengths=None, segment_ids=None):
    """Causal attention over a prompt x [B, T, D] that fills the cache from scratch:
    [B, T, out_features]. Row b's prompt is its first `lengths[b]` tokens (default T);
    rotary embeddings at positions 0..T-1."""
    cache = self.cache
    q, k, v = self.project(x, None)
    o = dict(self.options)
    with _validation.replicated_over(o["ulysses_axis"]):
      out, cache = prefill_attention(
        q,
        k.astype(cache.k.dtype),
        v.astype(cache.v.dtype),
        cache,
        lengths=lengths,
        segment_ids=segment_ids,
        layout=o["layout"] if self.kind == "ring" else "contiguous",
        block_sizes=o["block_sizes"],
        **self._decode_options(),
      )
    self._store(cache)
    return self._output(out)

  def _output(self, out):
    return self.out(out.reshape(*out.shape[:2], -1))


def _per_head(name: str, value, num_heads: int, default):
  """A module's per-head array: `default()` for True, a fixed `nnx.Variable` for an
  array [N], None for False / None."""
  if value is None or value is False:
    return nnx.data(None)
  if value is True:
    return default()
  array = jnp.asarray(value)
  if array.shape != (num_heads,) or not jnp.issubdtype(array.dtype, jnp.floating):
    raise ValueError(
      f"{name} shape={tuple(array.shape)} dtype={array.dtype} must be float [{num_heads}], True or False"
    )
  return nnx.Variable(array)


@functools.cache
def _one_device_mesh():
  """A mesh of the first device, for the dense kind's cache."""
  return jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])


def set_document_bound(model, bound: int | str | None) -> int:
  """Gives every ring-kind `RingAttention` of `model` the longest document its packed
  rows hold, `bound` tokens (`ring_attention`'s `document_bound`: the ring makes only
  the passes that can bring keys of a query's own document; a row breaking it gets
  NaN), or "auto" (the bound read from each batch's ids while running). Calls without
  segment ids run every pass; padding must have a negative id (as the training step's
  rows give it), or it counts as a document. None: no bound. Read
  when a call is traced: set it before building a `Trainer` or jitting a call. Returns
  the number of layers set."""
  bound = _validation.check_document_bound(bound, True, 1, 1)
  layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, RingAttention) and m.kind == "ring"]
  for layer in layers:
    layer.document_bound = nnx.static(bound)
  return len(layers)


def shard_segments(batch: int, length: int, shards: int, segment_ids=None):
  """Segment ids that confine attention to contiguous shards of ceil(T / shards)
  tokens (combined with existing ids): what shard-local attention sees."""
  shard = -(-length // shards)
  block = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // shard, (batch, length))
  if segment_ids is None:
    return block
  seg = segment_ids.astype(jnp.int32)
  return jnp.where(seg >= 0, seg * shards + block, -1)


class DilatedAttention(_Cached, _Projected):
  """Multi-head self-attention over LongNet dilated attention.

  Args (beyond those of `RingAttention`):
    segment_lengths, dilation_rates: the LongNet patterns (equally long, positive).
    kind: "dilated" (jax_ring.dilated_attention; distributed when `mesh` is given) or
      "dense" (jax_ring.reference_dilated_attention, the definition).
    sub_layer_norm: LongNet's (and Magneto's) LayerNorm on the attention output before
      the output projection (default True).
    attention_kernel: `jax_ring.dilated_attention`'s `kernel`.

  Decoding (is_causal=True): `init_cache`, `prefill`, `decode` as on `RingAttention`;
  each new token attends to the cached keys its patterns select.
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    *,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    kind: str = "dilated",
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    out_features: int | None = None,
    mesh=None,
    seq_axis="seq",
    batch_axis=None,
    is_causal: bool = False,
    policy: Policy | str | None = None,
    block_sizes: BlockSizes | None = None,
    attention_kernel: str = "auto",
    rope_base: float | None = None,
    rope_max_wavelength: float | None = None,
    sub_layer_norm: bool = True,
    use_bias: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
    kernel_init=None,
    qkv_sharding=None,
    out_sharding=None,
    rngs: nnx.Rngs,
  ):
    _check_kind(kind, DILATED_KINDS, mesh, seq_axis)
    lengths, rates = check_patterns(segment_lengths, dilation_rates)
    super().__init__(
      num_heads,
      in_features,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      out_features=out_features,
      use_bias=use_bias,
      rope_base=rope_base,
      rope_max_wavelength=rope_max_wavelength,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      qkv_sharding=qkv_sharding,
      out_sharding=out_sharding,
      rngs=rngs,
    )
    self.kind = kind
    self.sub_norm = (
      nnx.LayerNorm(num_heads * self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      if sub_layer_norm
      else None
    )
    self.options = nnx.static(
      _frozen(
        segment_lengths=lengths,
        dilation_rates=rates,
        mesh=mesh,
        seq_axis=seq_axis,
        batch_axis=batch_axis,
        is_causal=_validation.check_bool(is_causal, "is_causal"),
        policy=policy,
        block_sizes=block_sizes,
        kernel=attention_kernel,
      )
    )

  def attend(self, q, k, v, segment_ids):
    o = dict(self.options)
    if self.kind == "dense":
      keep = ("segment_lengths", "dilation_rates", "is_causal")
      return reference_dilated_attention(q, k, v, segment_ids=segment_ids, **{n: o[n] for n in keep})
    return dilated_attention(q, k, v, segment_ids=segment_ids, **o)

  def __call__(self, x, *, segment_ids=None, positions=None):
    q, k, v = self.project(x, positions)
    return self._output(self.attend(q, k, v, segment_ids))

  def _output(self, out):
    out = out.reshape(*out.shape[:2], -1)
    if self.sub_norm is not None:
      out = self.sub_norm(out)
    return self.out(out)

  # Decoding (`_Cached`): the cache as RingAttention's; each new token attends to the
  # cached keys its patterns select (`decode_attention(segment_lengths=...,
  # dilation_rates=...)`), merged over patterns and devices by two all-reduces (a max, then a sum).

  def _cache_axes(self) -> dict:
    o = dict(self.options)
    if not o["is_causal"]:
      raise ValueError("DilatedAttention(is_causal=False) has no decode mode: decoding is causal")
    if self.kind == "dense" or o["mesh"] is None:
      return dict(mesh=_one_device_mesh(), seq_axis="seq", batch_axis=None, head_axis=None)
    return dict(mesh=o["mesh"], seq_axis=o["seq_axis"], batch_axis=o["batch_axis"], head_axis=None)

  def _decode_options(self) -> dict:
    o = dict(self.options)
    keep = ("segment_lengths", "dilation_rates", "policy")
    return dict(**{n: o[n] for n in keep}, **self._cache_axes())

  def prefill(self, x, *, lengths=None, segment_ids=None):
    """Causal dilated attention over a prompt x [B, T, D] that fills the cache from
    scratch: [B, T, out_features]. Row b's prompt is its first `lengths[b]` tokens
    (default T); the prompt's keys and values are appended round-robin, as decoding
    appends (the rest of a row is cached as padding that no query sees)."""
    cache = self.cache
    b, t = x.shape[:2]
    axes = self._cache_axes()
    q, k, v = self.project(x, None)
    lengths, seg = prompt_rows(lengths, segment_ids, b, t)
    out = self.attend(q, k, v, seg)
    zero = jnp.zeros((), jnp.int32)
    empty = cache._replace(
      positions=jnp.full_like(cache.positions, -1),
      lengths=jnp.zeros_like(cache.lengths),
      prefilled=zero,
      appended=zero,
    )
    cache = update_cache(empty, k.astype(cache.k.dtype), v.astype(cache.v.dtype), segment_ids=seg, **axes)
    cache = cache._replace(lengths=lengths)  # generation continues at each row's own length
    self._store(cache)
    return self._output(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
  """Packed rows for an `attention_fn` from `make_attention_fn`: build it with
  `segment_mask` and pass it where Flax takes a mask. Flax hands `mask=` to the
  attention function untouched on full-sequence calls, so the ring gets the segment ids
  instead of a dense [T, T] matrix. A pytree: it may cross `jax.jit` / `nnx.jit`."""

  segment_ids: jax.Array  # int [*batch, T]: equal ids see each other; negative: padding


def segment_mask(segment_ids) -> SegmentMask:
  """`mask=` for packed sequences through `flax.nnx.MultiHeadAttention(attention_fn=
  make_attention_fn(...))`: query i sees key j only when segment_ids[..., i] ==
  segment_ids[..., j] (and a negative id is padding: such a query sees nothing, such a
  key is seen by no one), combined with the causal mask and window the attention_fn
  applies. The dense equivalent is `nnx.make_attention_mask(ids, ids, jnp.equal)`,
  which the ring cannot take.

      mha = nnx.MultiHeadAttention(..., attention_fn=make_attention_fn(mesh=mesh, is_causal=True))
      y = mha(x, mask=segment_mask(ids))   # ids: int [B, T]
  """
  if isinstance(segment_ids, SegmentMask):
    return segment_ids
  ids = segment_ids if isinstance(segment_ids, jax.Array) else jnp.asarray(segment_ids)
  if ids.ndim < 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
      f"segment_ids of shape {tuple(ids.shape)} and dtype {ids.dtype} must be an int array [*batch, T]"
    )
  return SegmentMask(ids)


def make_attention_fn(
  *,
  mesh,
  seq_axis="seq",
  is_causal: bool = False,
  batch_axis=None,
  head_axis=None,
  ulysses_axis=None,
  local_window_size=None,
  layout: str = "auto",
  policy: Policy | str | None = None,
  block_sizes: BlockSizes | None = None,
  kernel: str = "auto",
  logit_soft_cap: float | None = None,
  sinks=None,
  alibi_slopes=None,
  score_mod=None,
) -> Callable[..., Any]:
  """An `attention_fn` for `flax.nnx.MultiHeadAttention` that runs ring attention.

  The result takes (query, key, value, bias=None, mask=None, **kwargs) as Flax calls
  it; `is_causal` is on if either the factory or the call asks for it. Dropout follows
  Flax's convention: with `dropout_rate > 0` and `deterministic=False` it drops with
  the `dropout_rng` Flax passes (one decision per (query, key) shared by every row and
  head when `broadcast_dropout`, Flax's default), exactly as `jax_ring.ring_attention`
  does. Packed rows: pass `mask=segment_mask(segment_ids)` to the Flax module's call
  (per call, under jit too). A dense `mask` or `bias`, or `sow_weights`, cannot be
  honoured without the [T, T] matrix ring attention never builds: they raise
  ValueError. Express masks with `is_causal` (here or on the module's call),
  `local_window_size` here and `segment_mask` for segments. `logit_soft_cap`,
  `sinks`, `alibi_slopes`, `score_mod`: as in `jax_ring.ring_attention`, on every call
  (decoding included).

  Under `nnx.MultiHeadAttention(decode=True)` Flax passes one query against its whole
  cache (key, value [B, S, K, H]) with the mask of the filled prefix ([B, 1, 1, S]):
  that call runs as `jax_ring.decode_attention` (each device attends to its part of
  the keys, then two all-reduces, a max and a sum, merge), with the prefix mask as the keys' validity.
  `ulysses_axis` (the Ulysses hybrid, as in `jax_ring.ring_attention`) and `kernel`
  apply to the full-sequence calls; decoding runs over `seq_axis` alone.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  _validation.check_mesh_axis(mesh, seq_axis, "seq_axis", allow_none=False)
  window = _validation.normalize_window(local_window_size)
  factory_causal = _validation.check_bool(is_causal, "is_causal")
  modifiers = dict(logit_soft_cap=logit_soft_cap, sinks=sinks, alibi_slopes=alibi_slopes, score_mod=score_mod)

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype=None,
    module=None,
    is_causal: bool = False,
    dropout_rng=None,
    broadcast_dropout: bool = True,
    **kwargs,
  ):
    is_causal = _validation.check_bool(is_causal, "is_causal")
    deterministic = _validation.check_bool(deterministic, "deterministic")
    if bias is not None:
      raise ValueError(
        f"bias of shape {tuple(bias.shape)} was passed: ring attention takes no dense bias "
        "(it never builds the [T, T] logits)"
      )
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    # Flax gives any number of batch axes (none: rank 3); the ring takes one.
    batch = query.shape[:-3]
    flat = lambda x: x.reshape(-1, *x.shape[-3:]) if x.ndim != 4 else x
    restore = lambda out: out.reshape(*batch, *out.shape[-3:]) if query.ndim != 4 else out
    segment_ids = None
    if isinstance(mask, SegmentMask):
      segment_ids, mask = mask.segment_ids, None
      if segment_ids.shape != query.shape[:-2]:
        raise ValueError(
          f"segment_mask of shape {tuple(segment_ids.shape)} does not fit the query's "
          f"[*batch, T] = {tuple(query.shape[:-2])} (decoding calls take no segment_mask)"
        )
      segment_ids = segment_ids.reshape(-1, segment_ids.shape[-1])
    if mask is not None and _is_key_mask(query, mask):
      # One query against its cache (Flax's decode step: mask [*batch, 1, 1, S]).
      visible = jnp.broadcast_to(mask, (*batch, *mask.shape[-3:]))[..., 0, 0, :].reshape(-1, key.shape[-3])
      out = _attend_cached_prefix(
        flat(query), flat(key), flat(value), visible, mesh, seq_axis, batch_axis, policy, window, modifiers
      )
      return restore(out)
    if mask is not None:
      raise ValueError(
        f"mask of shape {tuple(mask.shape)} was passed: ring attention takes no dense mask. "
        "Causal: make_attention_fn(mesh=..., is_causal=True) or the module's call with "
        "is_causal=True; a window: make_attention_fn(local_window_size=...); packed rows: "
        "mask=jax_ring.nn.segment_mask(segment_ids) on the module's call"
      )
    dropout = {}
    if dropout_rate > 0.0 and not deterministic:
      if dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng")
      dropout = dict(
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        dropout_broadcast=_validation.check_bool(broadcast_dropout, "broadcast_dropout"),
      )
    if module is not None:
      raise ValueError("sow_weights=True: ring attention never materializes the attention weights")
    out = ring_attention(
      flat(query),
      flat(key),
      flat(value),
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      head_axis=head_axis,
      ulysses_axis=ulysses_axis,
      is_causal=factory_causal or is_causal,
      segment_ids=segment_ids,
      local_window_size=window,
      layout=layout,
      policy=policy,
      block_sizes=block_sizes,
      kernel=kernel,
      **modifiers,
      **dropout,
    )
    return restore(out)

  return attention_fn


def _is_key_mask(query, mask) -> bool:
  """Whether a Flax mask is one query's mask of the keys ([*batch, 1, 1, S] against a
  query [*batch, 1, N, H]), as `nnx.MultiHeadAttention(decode=True)` passes with its
  cache; such a call runs as decoding."""
  return query.shape[-3] == 1 and mask.ndim == query.ndim and mask.shape[-3:-1] == (1, 1)


def _attend_cached_prefix(query, key, value, visible, mesh, seq_axis, batch_axis, policy, window, modifiers):
  """query [B, 1, N, H] against key, value [B, S, K, H] where `visible` [B, S] (Flax's
  decode cache and prefix mask): decode_attention over a cache of those slots."""
  b, s = key.shape[:2]
  p = mesh.shape[seq_axis]
  extra = -(-s // p) * p - s
  pad = lambda x, value=0: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
  visible = jnp.broadcast_to(visible, (b, s))
  positions = pad(jnp.where(visible, jnp.arange(s, dtype=jnp.int32)[None], -1), -1)
  cache = KVCache(
    pad(key),
    pad(value),
    positions,
    jnp.zeros_like(positions),
    jnp.max(positions, axis=1) + 1,  # the query sits at the last visible key's position
    jnp.asarray((s + extra) // p, jnp.int32),  # every slot counts as filled
    jnp.zeros((), jnp.int32),
  )
  return decode_attention(
    query,
    cache,
    mesh=mesh,
    seq_axis=seq_axis,
    batch_axis=batch_axis,
    local_window_size=window,
    policy=policy,
    **modifiers,
  )


__all__ = [
  "DilatedAttention",
  "RingAttention",
  "RopeScaling",
  "SegmentMask",
  "apply_rope",
  "make_attention_fn",
  "rope_frequencies",
  "segment_mask",
  "set_document_bound",
  "shard_segments",
]
