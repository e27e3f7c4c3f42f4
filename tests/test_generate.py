"""Generation from models.DecoderLM with sequence-sharded KV caches: cached decoding
equals the full forward pass, greedy `generate` equals rerunning the model, ring on 8
devices equals dense on 1, sampling respects top-k, and Flax's own decode mode runs
on make_attention_fn."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import nnx
from jax.sharding import AxisType

from jax_ring import nn as ring_nn
from jax_ring.models import DecoderLM, LMConfig, LongNet, LongNetConfig, generate

V = 37
CONFIG = LMConfig(vocab_size=V, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=64)
# A short convolution before attention and p-RoPE (2 of the 4 frequencies dropped).
CONV = dataclasses.replace(CONFIG, conv=3, rope_max_wavelength=60.0)
PROMPTS = np.random.default_rng(0).integers(0, V, (3, 9)).astype(np.int32)
LENGTHS = np.array([9, 4, 6], np.int32)


def _mesh(devices):
  return jax.make_mesh((devices,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])


def _model(attention, devices=None, config=CONFIG):
  mesh = None if devices is None else _mesh(devices)
  return DecoderLM(dataclasses.replace(config, attention=attention), mesh=mesh, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens):
  """The dense model's logits over whole sequences (trailing junk is harmless: causal)."""
  return nnx.merge(graphdef, state)(tokens)


_DENSE = _model("dense")
_DENSE_DEF, _DENSE_STATE = nnx.split(_DENSE)


def _rows(prompts, lengths, new):
  """Each row's prompt followed by its new tokens, left-aligned, in a [B, P + n] array."""
  out = np.zeros((prompts.shape[0], prompts.shape[1] + new.shape[1]), np.int32)
  for b, n in enumerate(lengths):
    out[b, :n] = prompts[b, :n]
    out[b, n : n + new.shape[1]] = new[b]
  return out


# LongNet patterns: segments of 4 at rate 1 and of 8 at rate 2.
DILATED = dataclasses.replace(CONFIG, segment_lengths=(4, 8), dilation_rates=(1, 2))


@pytest.mark.parametrize(
  ("config", "kind", "dense_kind"),
  [(CONFIG, "ring", "dense"), (CONV, "ring", "dense"), (DILATED, "dilated", "dilated_dense")],
  ids=["plain", "conv", "dilated"],
)
def test_cached_decode_logits_equal_the_full_forward(config, kind, dense_kind):
  dense_def, dense_state = nnx.split(_model(dense_kind, config=config))
  model = _model(kind, 4, config)
  if config.conv:  # the training forward over a sharded sequence: XLA exchanges the conv's halo
    tokens = np.random.default_rng(2).integers(0, V, (2, 16)).astype(np.int32)
    sharded = jax.device_put(tokens, jax.NamedSharding(_mesh(4), jax.P(None, "seq")))
    np.testing.assert_allclose(
      np.asarray(nnx.jit(lambda m, t: m(t))(model, sharded)),
      np.asarray(_full_logits(dense_def, dense_state, tokens)),
      atol=2e-5,
    )
  model.init_cache(3, 16)
  prefill = nnx.jit(lambda m, t, n: m.prefill(t, lengths=n))
  decode = nnx.jit(lambda m, t: m.decode(t))
  got = [np.asarray(prefill(model, PROMPTS, LENGTHS))]
  new = np.random.default_rng(1).integers(0, V, (3, 5)).astype(np.int32)
  for chunk in (new[:, 0:1], new[:, 1:2], new[:, 2:4], new[:, 4:5]):  # one or two tokens per step
    got.append(np.asarray(decode(model, chunk)))
  full = np.asarray(_full_logits(dense_def, dense_state, _rows(PROMPTS, LENGTHS, new)))
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[0][b, :n], full[b, :n], atol=2e-5)
    decoded = np.concatenate([g[b] for g in got[1:]])
    np.testing.assert_allclose(decoded, full[b, n : n + 5], atol=2e-5)


def _greedy_by_rerunning(prompts, lengths, steps, dense=(_DENSE_DEF, _DENSE_STATE)):
  """Greedy continuation by running the whole dense model again at every step."""
  new = np.zeros((prompts.shape[0], steps), np.int32)
  for i in range(steps):
    logits = np.asarray(_full_logits(*dense, _rows(prompts, lengths, new)))
    new[:, i] = [logits[b, n + i - 1].argmax() for b, n in enumerate(lengths)]
  return new


def test_greedy_generate_equals_rerunning_and_ring_equals_dense():
  steps = 5
  expected = _greedy_by_rerunning(PROMPTS, LENGTHS, steps)
  ring = generate(_model("ring", 8), PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=steps)
  dense = generate(_DENSE, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=steps)
  np.testing.assert_array_equal(np.asarray(ring.tokens), expected)
  np.testing.assert_array_equal(np.asarray(dense.tokens), expected)
  np.testing.assert_array_equal(np.asarray(ring.lengths), [steps] * 3)
  # A stop token ends its row (kept in the output); later slots hold pad_token.
  stop = int(expected[0, 1])
  stopped = generate(_DENSE, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=steps, stop_tokens=(stop,))
  for b in range(3):
    hits = np.flatnonzero(expected[b] == stop)
    n = int(hits[0]) + 1 if hits.size else steps
    assert int(stopped.lengths[b]) == n
    np.testing.assert_array_equal(np.asarray(stopped.tokens[b, :n]), expected[b, :n])
    assert (np.asarray(stopped.tokens[b, n:]) == 0).all()


def test_greedy_generate_on_longnet():
  # LongNet over 8 devices (dilated decoding) against rerunning its dense reference.
  config = LongNetConfig(
    vocab_size=V,
    dim=32,
    num_layers=2,
    num_heads=4,
    ffn_hidden=64,
    segment_lengths=(4, 8),
    dilation_rates=(1, 2),
  )
  reference = nnx.split(LongNet(dataclasses.replace(config, reference=True), rngs=nnx.Rngs(0)))
  expected = _greedy_by_rerunning(PROMPTS, LENGTHS, 4, reference)
  model = LongNet(config, mesh=_mesh(8), rngs=nnx.Rngs(0))
  got = generate(model, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=4)
  np.testing.assert_array_equal(np.asarray(got.tokens), expected)


def test_sampling_top_k():
  model = _model("ring", 2)
  greedy = generate(model, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=4)
  top1 = generate(
    model, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=4, temperature=1.0, top_k=1, rng=jax.random.key(3)
  )
  np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))
  sampled = generate(
    model, PROMPTS, prompt_lengths=LENGTHS, max_new_tokens=4, temperature=2.0, top_k=3, rng=jax.random.key(4)
  )
  tokens = np.asarray(sampled.tokens)
  logits = np.asarray(_full_logits(_DENSE_DEF, _DENSE_STATE, _rows(PROMPTS, LENGTHS, tokens)))
  for b, n in enumerate(LENGTHS):
    for i in range(4):
      top3 = np.argsort(logits[b, n + i - 1])[-3:]
      assert tokens[b, i] in top3, (b, i, tokens[b, i], top3)
  assert not np.array_equal(tokens, np.asarray(greedy.tokens))  # it did sample


def test_flax_multi_head_attention_decode_mode_on_ring():
  mesh = _mesh(4)
  make = lambda fn: nnx.MultiHeadAttention(
    num_heads=4,
    in_features=32,
    num_kv_heads=2,
    decode=True,
    rngs=nnx.Rngs(0),
    **({} if fn is None else {"attention_fn": fn}),
  )
  ring, flax_default = make(ring_nn.make_attention_fn(mesh=mesh, is_causal=True)), make(None)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 32), jnp.float32)
  for m in (ring, flax_default):
    m.init_cache((2, 10, 32))
  step = nnx.jit(lambda m, x: m(x))
  for t in range(6):
    ours, theirs = step(ring, x[:, t : t + 1]), step(flax_default, x[:, t : t + 1])
    assert rel_err(ours, theirs) < 1e-5, t


def test_decoding_needs_a_cache_and_a_decodable_kind():
  with pytest.raises(ValueError, match="call init_cache"):
    _model("ring", 2).decode(jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="attention='local' has no decode mode"):
    _model("local", 2).init_cache(1, 8)
  bidirectional = ring_nn.DilatedAttention(
    4, 32, segment_lengths=(4,), dilation_rates=(1,), kind="dense", rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match="is_causal=False"):
    bidirectional.init_cache(1, 8)
  with pytest.raises(ValueError, match=r"prompt_lengths=\[0, 4, 6\]"):
    generate(_DENSE, PROMPTS, prompt_lengths=np.array([0, 4, 6]), max_new_tokens=2)
  with pytest.raises(ValueError, match="temperature=1.0 samples: pass rng"):
    generate(_DENSE, PROMPTS, max_new_tokens=2, temperature=1.0)
  with pytest.raises(
    TypeError, match=r"object lacks init_cache, prefill, decode: generate needs an nnx.Module"
  ):
    generate(object(), PROMPTS, max_new_tokens=2)

  class Flat(nnx.Module):  # prefill returns [B * P, V]
    def init_cache(self, batch_size, max_length):
      pass

    def prefill(self, tokens, *, lengths):
      return jnp.zeros((tokens.size, 5))

    def decode(self, tokens):
      return jnp.zeros((*tokens.shape, 5))

  with pytest.raises(ValueError, match=r"Flat.prefill returned shape \(27, 5\) for prompts \(3, 9\)"):
    generate(Flat(), PROMPTS, max_new_tokens=2)


def test_reader_shares_decode_steps_across_lengths_and_stops_at_the_answer():
  """The main job's reader (`generate.Engine`, a small Llama): documents of two
  lengths read into caches of one capacity share one set of decode steps; a larger cache
  than the document needs answers the same as a just-large-enough one, and as the full
  forward over the document, question and answer; `done` stops decoding where it says."""
  from jax_ring import models
  from jax_ring.models.eval import long_context
  from jax_ring.models.generate import Engine

  config = models.LlamaConfig(
    vocab_size=64,
    dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_hidden=64,
    context_length=128,
  )
  model = models.build(config, attention="dense", rngs=nnx.Rngs(0))
  reader = Engine(model)
  rng = np.random.default_rng(5)
  doc, question, new = rng.integers(0, 64, 30).astype(np.int32), [7, 8, 9, 10, 11], 4
  wide = reader.compile(len(doc), 64, [len(question)])
  other = reader.compile(40, 64, [len(question)])
  assert other.steps is wide.steps and sorted(wide.steps) == [1, len(question)]
  assert other.prefill is not wide.prefill
  # The prefill fills the empty cache it is given in place (donated): a document's read
  # never holds two caches.
  kv_bytes = sum(x.nbytes for x in jax.tree.leaves(Engine.empty_cache(wide)) if x.ndim == 4)
  assert wide.prefill.memory_analysis().alias_size_in_bytes >= kv_bytes > 0
  snug = reader.compile(len(doc), len(doc) + len(question) + new - 1, [len(question)])
  assert snug.steps is not wide.steps
  answers = {}
  for name, program in (("wide", wide), ("snug", snug)):
    _, cache, _ = reader.prefill(program, doc)
    answers[name] = reader.answer(program, cache, question, new)
  (ids, logits, _), (snug_ids, snug_logits, _) = answers["wide"], answers["snug"]
  assert len(ids) == new and ids == snug_ids
  np.testing.assert_allclose(logits, snug_logits, rtol=1e-5, atol=1e-5)
  # The full forward: the logits at the question's last token and at each generated one
  # but the last (the rows that gave the ids).
  whole = np.concatenate([doc, question, ids[:-1]])[None]
  full = np.asarray(model(jnp.asarray(whole))[0], np.float64)[len(doc) + len(question) - 1 :]
  assert rel_err(logits, full) < 1e-5
  assert ids == [int(i) for i in np.argmax(full, axis=-1)]
  _, cache, _ = reader.prefill(wide, doc)
  short, short_logits, _ = reader.answer(wide, cache, question, new, done=lambda got: len(got) == 2)
  assert short == ids[:2] and short_logits.shape[0] == 2
  # One document's cache answers its questions in turn, in place: after a longer
  # question (whose tokens lie past this one's, unseen) and a shorter one, the answer is
  # that of a fresh prefill.
  longer = [3, 1, 4, 1, 5, 9, 2, 6]
  reader.compile(len(doc), 64, [len(longer)])
  reader.answer(wide, cache, longer, new)
  again, again_logits, _ = reader.answer(wide, cache, question, new)
  assert again == ids
  np.testing.assert_allclose(again_logits, logits, rtol=1e-6, atol=1e-6)
  assert long_context.is_complete("48213", " 48213.") and not long_context.is_complete("48213", " 4821")
  assert long_context.is_complete("Oslo", " the secret") and not long_context.is_complete("Oslo", " Oslo")
