"""Generation from a `DecoderLM` with a sequence-sharded KV cache: one jitted prefill of
the prompts (ring attention, which also fills the caches), then one jitted
`lax.while_loop` of decode steps (each attends the new token to every cached token
with two all-reduces, a max and a sum; no K/V moving), compiled once per shape and setting.

    out = generate(model, prompts, prompt_lengths=lengths, max_new_tokens=32)
    out.tokens   # int32 [B, 32]; after a row's stop token: `pad_token`
    out.lengths  # int32 [B]: tokens generated per row, its stop token included

Legend: B batch, P prompt length, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# What generate needs of a model (its docstring and errors say it).
PROTOCOL = (
  "an nnx.Module with nnx.Param weights and init_cache(batch_size, max_length), "
  "prefill(tokens [B, P], lengths=[B]) -> logits [B, P, V] or [B, V] filling its caches, "
  "and decode(tokens [B, Tq]) -> logits [B, Tq, V] appending to them"
)


class Generated(NamedTuple):
  tokens: jax.Array  # int32 [B, max_new_tokens]
  lengths: jax.Array  # int32 [B]


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits."""

  temperature: float = 0.0  # 0: greedy (argmax)
  top_k: int | None = None  # keep the k most likely tokens
  top_p: float | None = None  # keep the smallest set whose probability reaches p

  def __post_init__(self):
    if (
      not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature))
      or self.temperature < 0
    ):
      raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
    if self.top_k is not None and (
      isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
    ):
      raise ValueError(f"top_k={self.top_k!r} must be a positive int or None")
    if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] or None")


def sample(logits, rng, sampling: Sampling):
  """Next tokens int32 [B] from logits [B, V]."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k is not None:
    k = min(sampling.top_k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p is not None:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep_sorted = before < sampling.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# The weights go in as an argument and only the rest of the state (the caches) comes
# out: returning the weights too would copy them on every call.


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _prefill(graphdef, weights, state, prompts, lengths, rng, *, sampling: Sampling):
  model = nnx.merge(graphdef, weights, state)
  logits = model.prefill(prompts, lengths=lengths)
  b, p = prompts.shape
  if logits.ndim not in (2, 3) or logits.shape[0] != b or (logits.ndim == 3 and logits.shape[1] != p):
    raise ValueError(
      f"{type(model).__name__}.prefill returned shape {tuple(logits.shape)} for prompts {(b, p)}: "
      f"expected logits [B, P, V] or [B, V] ({PROTOCOL})"
    )
  if logits.ndim == 3:  # [B, P, V]: each row's at its last prompt token (a masked sum: any sharding)
    at_last = jnp.arange(logits.shape[1])[None, :, None] == (lengths - 1)[:, None, None]
    logits = jnp.sum(jnp.where(at_last, logits, 0.0), axis=1)
  return sample(logits, rng, sampling), nnx.state(model, nnx.Not(nnx.Param))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "steps", "pad_token"))
def _decode_loop(
  graphdef, weights, state, first, rng, stop, *, sampling: Sampling, steps: int, pad_token: int
):
  b = first.shape[0]
  tokens = jnp.full((b, steps), pad_token, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, stop)
  lengths = jnp.ones((b,), jnp.int32)

  def cond(carry):
    step, _, _, _, done, _, _ = carry
    return (step < steps) & ~jnp.all(done)

  def body(carry):
    step, state, last, tokens, done, lengths, rng = carry
    model = nnx.merge(graphdef, weights, state)
    logits = model.decode(last[:, None])[:, 0]
    rng, key = jax.random.split(rng)
    new = sample(logits, key, sampling)
    new = jnp.where(done, pad_token, new)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, new[:, None], step, axis=1)
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | jnp.isin(new, stop)
    return step + 1, nnx.state(model, nnx.Not(nnx.Param)), new, tokens, done, lengths, rng

  carry = (jnp.ones((), jnp.int32), state, first, tokens, done, lengths, rng)
  _, state, _, tokens, _, lengths, _ = jax.lax.while_loop(cond, body, carry)
  return tokens, lengths, state


def generate(
  model,
  prompts,
  *,
  max_new_tokens: int,
  prompt_lengths=None,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  stop_tokens=(),
  rng=None,
  pad_token: int = 0,
) -> Generated:
  """Continues each prompt by up to `max_new_tokens` tokens.

  Args:
    model: any `nnx.Module` with `nnx.Param` weights and a KV cache:
      `init_cache(batch_size, max_length)`, `prefill(tokens [B, P], lengths=[B])` ->
      logits [B, P, V] (or [B, V]: each row's at its last prompt token) filling the
      caches, and `decode(tokens [B, Tq])` -> logits [B, Tq, V] appending to them.
      Every variable that is not an `nnx.Param` (the caches) is carried through the
      jitted loop and written back to `model`. `models.DecoderLM` (attention "ring"
      or "dense"), `models.LongNet` and `models.Gemma` are three; docs/guides/
      inference.md builds one of your own on `jax_ring.nn.RingAttention`.
    prompts: int [B, P]; row b's prompt is prompts[b, :prompt_lengths[b]].
    max_new_tokens: tokens to generate per row (fewer after a stop token).
    prompt_lengths: int [B] in [1, P] (default: P for every row).
    temperature: 0 for greedy decoding, else the softmax temperature.
    top_k, top_p: keep the k most likely tokens / the smallest set of probability p.
    stop_tokens: token ids that end a row (the stop token is kept in its output).
    rng: a `jax.random` key for sampling (needed when temperature > 0).
    pad_token: what fills a row's output after its stop token.

  The model's caches are (re)made for P + max_new_tokens tokens per row; the prompt
  runs through one jitted prefill, the new tokens through one jitted while loop.

  Returns:
    `Generated(tokens int32 [B, max_new_tokens], lengths int32 [B])`.
  """
  missing = [m for m in ("init_cache", "prefill", "decode") if not callable(getattr(model, m, None))]
  if missing or not isinstance(model, nnx.Module):
    what = "lacks " + ", ".join(missing) if missing else "is no nnx.Module"
    raise TypeError(
      f"model of type {type(model).__name__} {what}: generate needs {PROTOCOL} "
      "(docs/guides/inference.md, 'Your own model')"
    )
  prompts = np.asarray(prompts) if not isinstance(prompts, jax.Array) else prompts
  if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
    raise ValueError(
      f"prompts shape={tuple(prompts.shape)} dtype={prompts.dtype} must be int [batch, length]"
    )
  b, p = prompts.shape
  if callable(getattr(model, "check_tokens", None)):  # ids in the vocabulary, before tracing
    model.check_tokens(prompts, "prompts")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
  if prompt_lengths is None:
    prompt_lengths = np.full((b,), p, np.int32)
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"prompt_lengths shape={lengths.shape} must be int ({b},)")
  if (lengths < 1).any() or (lengths > p).any():
    raise ValueError(f"prompt_lengths={lengths.tolist()} must lie in [1, prompt length {p}]")
  sampling = Sampling(float(temperature), top_k, top_p)
  if sampling.temperature > 0 and rng is None:
    raise ValueError(f"temperature={temperature} samples: pass rng=jax.random.key(...)")
  rng = jax.random.key(0) if rng is None else rng
  stop = jnp.asarray(list(stop_tokens), jnp.int32).reshape(-1)
  model.init_cache(b, p + max_new_tokens)
  graphdef, weights, state = nnx.split(model, nnx.Param, ...)
  rng, first_key = jax.random.split(rng)
  first, state = _prefill(
    graphdef,
    weights,
    state,
    jnp.asarray(prompts, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    first_key,
    sampling=sampling,
  )
  tokens, out_lengths, state = _decode_loop(
    graphdef,
    weights,
    state,
    first,
    rng,
    stop,
    sampling=sampling,
    steps=max_new_tokens,
    pad_token=int(pad_token),
  )
  nnx.update(model, state)
  return Generated(tokens, out_lengths)
