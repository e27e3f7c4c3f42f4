"""The generation engine: a model with a sequence-sharded KV cache prefilled (ring
attention, which also fills the caches) and then decoded (each new token attends to
every cached token with two all-reduces, a max and a sum; no K/V moving). Every model
here generates through it, by two front ends over the same merged-model prefill and
decode (`_prefilled`, `_decoded`):

- `generate`: a batch of prompts, one jitted prefill and one jitted `lax.while_loop`
  of sampled decode steps, compiled once per shape and setting.

      out = generate(model, prompts, prompt_lengths=lengths, max_new_tokens=32)
      out.tokens   # int32 [B, 32]; after a row's stop token: `pad_token`
      out.lengths  # int32 [B]: tokens generated per row, its stop token included

- `Engine`: one document prefilled into the cache once and many questions answered
  from that cached state (the main job's readers): programs compiled ahead of time per
  document length and cache capacity, greedy decode steps shared by every length read
  into caches of that capacity.

Legend: B batch, P prompt length, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, NamedTuple

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


class Sampled(NamedTuple):
  """`generate(..., logprobs=True)`: the tokens and lengths, and each new token's
  log-probability float32 [B, max_new_tokens] under the softmax of its logits over the
  temperature (the whole vocabulary, as a trainer scores it; top-k and top-p only choose
  the token); 0 after a row's stop token."""

  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array


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


def token_logprob(logits, token, temperature: float):
  """log softmax(logits / temperature)[token] float32 [B] of logits [B, V] (temperature
  0: the logits as they are)."""
  logits = logits.astype(jnp.float32)
  if temperature:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


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


def _prefilled(graphdef, weights, cache, tokens, lengths=None):
  """(the model's prefill logits [B, P, V] or [B, V], its caches after) for a model
  split into its weights and the rest."""
  model = nnx.merge(graphdef, weights, cache)
  logits = model.prefill(tokens) if lengths is None else model.prefill(tokens, lengths=lengths)
  b, p = tokens.shape
  if logits.ndim not in (2, 3) or logits.shape[0] != b or (logits.ndim == 3 and logits.shape[1] != p):
    raise ValueError(
      f"{type(model).__name__}.prefill returned shape {tuple(logits.shape)} for prompts {(b, p)}: "
      f"expected logits [B, P, V] or [B, V] ({PROTOCOL})"
    )
  return logits, nnx.state(model, nnx.Not(nnx.Param))


def _decoded(graphdef, weights, cache, tokens):
  """(logits [B, Tq, V] of `tokens` appended to the caches, the caches after)."""
  model = nnx.merge(graphdef, weights, cache)
  return model.decode(tokens), nnx.state(model, nnx.Not(nnx.Param))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _prefill(graphdef, weights, state, prompts, lengths, rng, *, sampling: Sampling):
  logits, state = _prefilled(graphdef, weights, state, prompts, lengths)
  if logits.ndim == 3:  # [B, P, V]: each row's at its last prompt token (a masked sum: any sharding)
    at_last = jnp.arange(logits.shape[1])[None, :, None] == (lengths - 1)[:, None, None]
    logits = jnp.sum(jnp.where(at_last, logits, 0.0), axis=1)
  first = sample(logits, rng, sampling)
  return first, token_logprob(logits, first, sampling.temperature), state


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "steps", "pad_token"))
def _decode_loop(
  graphdef, weights, state, first, first_logprob, rng, stop, *, sampling: Sampling, steps: int, pad_token: int
):
  b = first.shape[0]
  tokens = jnp.full((b, steps), pad_token, jnp.int32).at[:, 0].set(first)
  logprobs = jnp.zeros((b, steps), jnp.float32).at[:, 0].set(first_logprob)
  done = jnp.isin(first, stop)
  lengths = jnp.ones((b,), jnp.int32)

  def cond(carry):
    step, _, _, _, _, done, _, _ = carry
    return (step < steps) & ~jnp.all(done)

  def body(carry):
    step, state, last, tokens, logprobs, done, lengths, rng = carry
    logits, state = _decoded(graphdef, weights, state, last[:, None])
    logits = logits[:, 0]
    rng, key = jax.random.split(rng)
    new = sample(logits, key, sampling)
    logprob = jnp.where(done, 0.0, token_logprob(logits, new, sampling.temperature))
    new = jnp.where(done, pad_token, new)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, new[:, None], step, axis=1)
    logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, logprob[:, None], step, axis=1)
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | jnp.isin(new, stop)
    return step + 1, state, new, tokens, logprobs, done, lengths, rng

  carry = (jnp.ones((), jnp.int32), state, first, tokens, logprobs, done, lengths, rng)
  _, state, _, tokens, logprobs, _, lengths, _ = jax.lax.while_loop(cond, body, carry)
  return tokens, lengths, logprobs, state


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
  logprobs: bool = False,
) -> Generated | Sampled:
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
    logprobs: also each new token's log-probability (`Sampled`): what a trainer's
      per-token log-probabilities of the same tokens reproduce (`train.grpo`).

  The model's caches are (re)made for P + max_new_tokens tokens per row; the prompt
  runs through one jitted prefill, the new tokens through one jitted while loop.

  Returns:
    `Generated(tokens int32 [B, max_new_tokens], lengths int32 [B])`; with `logprobs`,
    `Sampled(tokens, lengths, logprobs float32 [B, max_new_tokens])`.
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
  first, first_logprob, state = _prefill(
    graphdef,
    weights,
    state,
    jnp.asarray(prompts, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    first_key,
    sampling=sampling,
  )
  tokens, out_lengths, out_logprobs, state = _decode_loop(
    graphdef,
    weights,
    state,
    first,
    first_logprob,
    rng,
    stop,
    sampling=sampling,
    steps=max_new_tokens,
    pad_token=int(pad_token),
  )
  nnx.update(model, state)
  if logprobs:
    return Sampled(tokens, out_lengths, out_logprobs)
  return Generated(tokens, out_lengths)


@dataclasses.dataclass
class Programs:
  """A reader's compiled programs for one document length and cache capacity: the
  prefill into a fresh cache, and the decode steps by token count (compiled as
  questions need them, shared by every length read into caches of that capacity).
  `cache`: what an empty cache holds, made anew for each prefill (`Engine.empty_cache`),
  so that no program keeps a cache alive between documents (32K tokens' take 1.2 GB for
  Gemma 3 270M)."""

  graphdef: Any
  weights: Any
  cache: Any
  prefill: Any
  steps: dict
  compile_s: float  # the prefill's and the steps it compiled so far
  temp_bytes: int  # the prefill's, per device, from the compiler


@dataclasses.dataclass(frozen=True)
class Constant:
  """An array of `spec` (shape, dtype, sharding) holding `value` everywhere."""

  spec: jax.ShapeDtypeStruct
  value: Any

  def make(self):
    return jnp.full(self.spec.shape, self.value, self.spec.dtype, device=self.spec.sharding)


def _as_constant(x):
  """x as a `Constant` where it holds one value everywhere (an empty cache's arrays do:
  zeros, and -1 for positions), else x itself."""
  first = x.ravel()[0]
  if bool(jnp.all(x == first)):
    return Constant(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), first.item())
  return x


class Cached:
  """A prefilled document's KV cache, which answers all its questions in turn without a
  copy of its 1.1 GB (Gemma 3 270M at 32K tokens). A question's decode steps take the
  arrays in place (donated) and append its tokens after the document; `lend()` keeps
  the counters (each row's length, the prefilled and appended counts: the arrays of
  rank at most 1) and `give_back(state)` puts them back into what the steps returned,
  so the next question appends from the document's end again, into the same slots in
  the same order. What an earlier question left in later slots lies at positions past
  every query of the next one until that query overwrites it first: the causal mask
  (`jax_ring._decode`, on positions) keeps it unseen, and the answers are those of a
  fresh copy (`tests/test_generate.py`)."""

  def __init__(self, state):
    self.state = state
    self._counters = None

  def lend(self):
    """The state for a question's steps (they consume it); the counters kept."""
    if self._counters is not None:
      raise RuntimeError("this document's cache is already answering a question")
    self._counters = [jnp.copy(x) if x.ndim <= 1 else None for x in jax.tree.leaves(self.state)]
    state, self.state = self.state, None
    return state

  def give_back(self, state) -> None:
    """The steps' last state, its counters reset to the document's end."""
    leaves, treedef = jax.tree.flatten(state)
    kept = [x if c is None else c for x, c in zip(leaves, self._counters)]
    self.state, self._counters = treedef.unflatten(kept), None


class Engine:
  """The engine's front end for cached documents: a model that prefills a document
  into its KV cache once and answers questions by greedy decoding from that cached
  state. A compiled prefill per document length and cache capacity, and decode steps
  (a whole question at once, or one token) per capacity, which every length read into
  caches of that capacity shares; the same prefill and decode as `generate`'s."""

  def __init__(self, model):
    self.model = model
    self.programs: dict[tuple, Programs] = {}
    self.steps: dict[int, dict] = {}  # per capacity: the decode steps by token count
    self.compile_s = 0.0  # every program's, dropped ones included
    self.lock = threading.Lock()

    # The weights go in as arguments and only the caches come out: returning the
    # weights too would copy them on every call. The empty cache is donated: the filled
    # one takes its buffers, so a prefill never holds two caches (at 32K tokens, 1.1 GB
    # each for Gemma 3 270M).
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def prefill(graphdef, weights, cache, tokens):
      logits, cache = _prefilled(graphdef, weights, cache, tokens)
      return (logits[0, -1] if logits.ndim == 3 else logits[0]), cache

    # Decoding updates the caches in place (donated); `answer` copies them once first.
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def step(graphdef, weights, cache, tokens):
      logits, cache = _decoded(graphdef, weights, cache, tokens)
      logits = logits[0, -1]
      return logits, jnp.argmax(logits).astype(jnp.int32).reshape(1, 1), cache

    self._prefill, self._step = prefill, step

  def _lowered_prefill(self, length: int, capacity: int):
    """(graphdef, weights, cache, the prefill lowered) with caches for `capacity` tokens."""
    if capacity < length + 1:
      raise ValueError(f"capacity={capacity} must exceed the document's length={length} (room to decode)")
    self.model.init_cache(1, capacity)
    graphdef, weights, cache = nnx.split(self.model, nnx.Param, nnx.Cache)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    lowered = self._prefill.lower(graphdef, weights, cache, tokens)
    self.model.init_cache(1, 1)  # the model's own caches: small again
    return graphdef, weights, cache, lowered

  def compile(self, length: int, capacity: int, questions=()) -> Programs:
    """The programs for a document of `length` tokens read into caches of `capacity`
    tokens (the document, the longest question and the answer): the prefill, and the
    decode steps of one token and of each length in `questions` that no earlier program
    of this capacity compiled (safe to call from another thread)."""
    with self.lock:
      start = time.perf_counter()
      program = self.programs.get((length, capacity))
      if program is None:
        graphdef, weights, cache, lowered = self._lowered_prefill(length, capacity)
        prefill = lowered.compile()
        temp = int(prefill.memory_analysis().temp_size_in_bytes)
        empty = jax.tree.map(_as_constant, cache)
        steps = self.steps.setdefault(capacity, {})
        program = Programs(graphdef, weights, empty, prefill, steps, 0.0, temp)
        self.programs[length, capacity] = program
      spec = lambda x: x.spec if isinstance(x, Constant) else x
      cache = jax.tree.map(spec, program.cache, is_leaf=lambda x: isinstance(x, Constant))
      tokens = lambda n: jax.ShapeDtypeStruct((1, n), jnp.int32)
      for n in sorted({1, *questions} - set(program.steps)):
        program.steps[n] = self._step.lower(program.graphdef, program.weights, cache, tokens(n)).compile()
      spent = time.perf_counter() - start
      program.compile_s += spent
      self.compile_s += spent
      return program

  def prefill_temp(self, length: int, capacity: int) -> int:
    """Per-device temp bytes of the prefill for `length` tokens into caches of
    `capacity` (compiled, not run)."""
    with self.lock:
      start = time.perf_counter()
      lowered = self._lowered_prefill(length, capacity)[3]
      temp = int(lowered.compile().memory_analysis().temp_size_in_bytes)
      self.compile_s += time.perf_counter() - start
      return temp

  def drop(self, length: int) -> None:
    """Forgets the prefills for `length` tokens (compiled programs hold memory; a
    length read once needs its prefill no more). The decode steps stay: other lengths
    share them."""
    with self.lock:
      for key in [k for k in self.programs if k[0] == length]:
        del self.programs[key]

  @staticmethod
  def empty_cache(program: Programs):
    """A new empty cache for the program's prefill."""
    return jax.tree.map(lambda x: x.make() if isinstance(x, Constant) else x, program.cache)

  @staticmethod
  def prefill(program: Programs, tokens: np.ndarray):
    """(logits [V] at the last token, the document's cache (`Cached`), seconds) of
    tokens int [T]."""
    empty = jax.block_until_ready(Engine.empty_cache(program))
    start = time.perf_counter()
    logits, cache = program.prefill(program.weights, empty, jnp.asarray(tokens[None]))
    logits = np.asarray(logits)
    return logits, Cached(cache), time.perf_counter() - start

  @staticmethod
  def answer(program: Programs, cache: Cached, question: list[int], new_tokens: int, done=None):
    """The question (teacher-forced, one call), then greedy tokens from `cache`, at most
    `new_tokens` of them, fewer where `done(ids)` says the tokens so far hold the answer:
    (generated ids, logits [len(ids), V] (the row that gave each id), seconds per decode
    step, or nan where the question's call gave the whole answer). The document's cache
    answers every question of it: the steps write into its arrays in place (donated),
    and its counters go back to the document's end afterwards (`Cached`)."""
    steps, weights = program.steps, program.weights
    state = cache.lend()
    last, nxt, state = steps[len(question)](weights, state, jnp.asarray([question], jnp.int32))
    logits, out = [last], [int(nxt[0, 0])]
    start = time.perf_counter()
    while len(out) < new_tokens and not (done is not None and done(out)):
      last, nxt, state = steps[1](weights, state, nxt)
      logits.append(last)
      out.append(int(nxt[0, 0]))
    per_token = (time.perf_counter() - start) / (len(out) - 1) if len(out) > 1 else float("nan")
    cache.give_back(state)
    return out, np.stack([np.asarray(x) for x in logits]), per_token
