"""Preference tuning (`models.train.dpo`, `models.data.preference`): TRL's preference
formats tokenized as its DPOTrainer tokenizes them, pairs packed whole (each sequence a
document), each packed sequence's log-probability against the sequence run alone on one
device in float64 (Llama, Qwen 3, Gemma 3 with windows, Qwen3-MoE; each on two of 1, 2,
4 and 8 devices, `conftest.crossed`; FSDP on and off), every loss type's loss and
gradients against TRL's formulas written here in float64, the reference with the
adapters off against the base, the precomputed reference against the one computed at
each step, and a SIGTERM'd run resumed with the uninterrupted run's losses."""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import crossed, make_mesh, rel_err
from flax import nnx
from test_finetune_data import _child, _finish, _wait_for, tiny_folder, tiny_tokenizer, write_jsonl
from test_packing import _flat, _tiny

from jax_ring import models
from jax_ring.models.data import pipeline, preference, sources
from jax_ring.models.train import dpo
from jax_ring.models.train import step as train_step

# --- Records and their tokens. ---


def _text(tok, ids):
  return tok.to_tokenizers().decode([int(i) for i in ids], skip_special_tokens=False)


def _load(tmp_path, records, **kw):
  return pipeline.load_examples(write_jsonl(tmp_path / "p.jsonl", records), tiny_tokenizer(), **kw)


def test_standard_pairs_tokenize_prompt_and_completion_whole_with_eos(tmp_path):
  tok = tiny_tokenizer()
  ex = _load(tmp_path, [{"prompt": "Sky?", "chosen": " Blue.", "rejected": " Green<|end_of_text|>"}])
  assert ex.format == "preference" and len(ex) == 1
  ids, mask = ex.ids[0], ex.masks[0]
  (a, b) = ex.docs[0]
  assert _text(tok, ids[:a]) == "<|begin_of_text|>Sky? Blue.<|end_of_text|>"
  assert _text(tok, ids[a:]) == "<|begin_of_text|>Sky? Green<|end_of_text|>"  # EOS not doubled
  assert a + b == len(ids)
  # The completion: from where the sequence leaves the prompt's tokens (BOS and "Sky?").
  assert _text(tok, ids[:a][mask[:a] > 0]) == " Blue.<|end_of_text|>"
  assert _text(tok, ids[a:][mask[a:] > 0]) == " Green<|end_of_text|>"


def test_conversational_and_implicit_prompts(tmp_path):
  tok = tiny_tokenizer()
  user = [{"role": "user", "content": "Sky?"}]
  said = lambda text: [{"role": "assistant", "content": text}]
  ex = _load(tmp_path, [{"prompt": user, "chosen": said("Blue."), "rejected": said("Red.")}])
  (a, _) = ex.docs[0]
  ids, mask = ex.ids[0], ex.masks[0]
  whole = _text(tok, ids[:a])
  assert whole.endswith("assistant<|end_header_id|>\n\nBlue.<|eot_id|>") and "<|end_of_text|>" not in whole
  assert _text(tok, ids[:a][mask[:a] > 0]) == "Blue.<|eot_id|>"  # no EOS added to a conversation
  assert _text(tok, ids[a:][mask[a:] > 0]) == "Red.<|eot_id|>"
  # Implicit prompts: TRL's extract_prompt (the space before the difference goes to the completions).
  ex = _load(tmp_path, [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
  assert ex.format == "implicit_preference"
  (a, _) = ex.docs[0]
  assert _text(tok, ex.ids[0][:a][ex.masks[0][:a] > 0]) == " blue.<|end_of_text|>"
  chats = [{"chosen": user + said("Blue."), "rejected": user + said("Red.")}]
  ex = _load(tmp_path, chats)
  (a, _) = ex.docs[0]
  assert _text(tok, ex.ids[0][:a][ex.masks[0][:a] > 0]) == "Blue.<|eot_id|>"
  assert sources.extract_prompt("x", {"chosen": "ab c", "rejected": "ab d"}) == {
    "prompt": "ab",
    "chosen": " c",
    "rejected": " d",
  }


@pytest.mark.parametrize(
  "record, says",
  [
    ({"prompt": "a", "chosen": "b"}, "no 'rejected' column"),
    ({"prompt": "a", "chosen": " ", "rejected": "c"}, "'chosen' is empty"),
    (
      {
        "prompt": [{"role": "user", "content": "a"}],
        "chosen": [{"role": "user", "content": "b"}],
        "rejected": [{"role": "assistant", "content": "c"}],
      },
      "'chosen' must be the assistant's messages only",
    ),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}, "not a mix"),
  ],
)
def test_bad_pairs_are_named_by_file_and_line_or_skipped(tmp_path, record, says):
  good = {"prompt": "a", "chosen": " b", "rejected": " c"}
  path = write_jsonl(tmp_path / "p.jsonl", [good, record])
  with pytest.raises(sources.BadRecord, match=f"{path}:2: .*{says}"):
    pipeline.load_examples(path, tiny_tokenizer(), format="preference")
  ex = pipeline.load_examples(path, tiny_tokenizer(), format="preference", skip_bad=True)
  assert len(ex) == 1 and len(ex.skipped) == 1


def test_pairs_pack_whole_each_sequence_its_own_document():
  rng = np.random.default_rng(0)
  docs = [[9, 7], [12, 4], [20, 25], [3, 5]]
  ids = [rng.integers(5, 90, sum(d)).astype(np.int32) for d in docs]
  masks = []
  for d in docs:
    m = np.ones(sum(d), np.float32)
    m[:2], m[d[0] : d[0] + 2] = 0, 0  # two prompt tokens each
    masks.append(m)
  ex = pipeline.Examples(ids, masks, [f"f:{i}" for i in range(4)], "preference", [], docs=docs)
  loader = pipeline.Loader(ex, 40, 1, long="drop", shuffle=False)
  assert loader.dropped == [2]  # 45 tokens: dropped whole, never split
  seen = {}
  for arrays, rows in loader.in_order():
    seg, pos = arrays["segment_ids"][0], arrays["positions"][0]
    (i,) = rows
    k = 0
    for p in loader.rows[i]:
      for j, n in enumerate(docs[p.example]):
        k += 1
        at = np.flatnonzero(seg == k)
        assert len(at) == n and list(pos[at]) == list(range(n))  # positions from 0
        start = sum(docs[p.example][:j])
        np.testing.assert_array_equal(arrays["tokens"][0, at], ids[p.example][start : start + n])
        seen[(p.example, j)] = i
  assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1), (3, 0), (3, 1)]
  assert all(seen[(e, 0)] == seen[(e, 1)] for e in (0, 1, 3))  # a pair's two in one row
  assert loader.slots == 6 and len(loader.rows) == 1  # 16 + 16 + 8 tokens: one row
  # keep_end: each sequence cut to its share of the row from its start; keep_start: from its end.
  cut = pipeline.Loader(ex, 40, 1, long="truncate", shuffle=False, truncation="keep_end")
  assert cut.docs[2] == [20, 20] and cut.dropped == []
  np.testing.assert_array_equal(cut.packed[2][0][:20], ids[2][:20])
  np.testing.assert_array_equal(cut.packed[2][0][20:], ids[2][25:])
  cut = pipeline.Loader(ex, 40, 1, long="truncate", shuffle=False, truncation="keep_start")
  np.testing.assert_array_equal(cut.packed[2][0][20:], ids[2][20:40])
  assert preference.fit_pair([30, 5], 20) == (15, 5) and preference.fit_pair([5, 30], 21) == (5, 16)
  with pytest.raises(ValueError, match="never split"):
    pipeline.Loader(ex, 40, 1, long="split")


# --- Sequences' log-probabilities and the losses against float64. ---

LENGTH = 72


def _pairs(seed=0, vocab=97):
  """Pairs (prompt, chosen, rejected) of random tokens packed whole into rows of LENGTH:
  the examples (ids, mask, docs) and the loader's one batch."""
  rng = np.random.default_rng(seed)
  ids, masks, docs = [], [], []
  for p, c, r in [(5, 6, 9), (3, 8, 4), (7, 5, 6)]:
    prompt = rng.integers(0, vocab, p)
    seqs = [np.concatenate([prompt, rng.integers(0, vocab, n)]) for n in (c, r)]
    ids.append(np.concatenate(seqs).astype(np.int32))
    masks.append(np.concatenate([np.r_[np.zeros(p), np.ones(n)] for n in (c, r)]).astype(np.float32))
    docs.append([p + c, p + r])
  ex = pipeline.Examples(ids, masks, ["x"] * 3, "preference", [], docs=docs)
  loader = pipeline.Loader(ex, LENGTH, 1, long="drop", shuffle=False)
  ((arrays, rows),) = list(loader.in_order())
  return ex, loader, arrays


_F64 = {}


def _alone_logps(family, ex):
  """Each sequence's completion log-probability, every sequence alone (its own row),
  dense attention on one device, float64 weights and compute; and a function of the
  float64 model for gradients."""
  cfg = _tiny(family)
  model = models.build(cfg, attention="dense", dtype="float64", param_dtype="float64", rngs=nnx.Rngs(0))
  weights32 = nnx.state(models.build(cfg, attention="dense", rngs=nnx.Rngs(0)), nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.float64), weights32))
  seqs = []
  for ids, mask, d in zip(ex.ids, ex.masks, ex.docs):
    seqs += [(ids[: d[0]], mask[: d[0]]), (ids[d[0] :], mask[d[0] :])]
  longest = max(len(s) for s, _ in seqs)
  tokens = np.zeros((len(seqs), longest), np.int32)
  mask = np.zeros((len(seqs), longest), np.float64)
  for row, (x, w) in enumerate(seqs):
    tokens[row, : len(x)], mask[row, : len(w)] = x, w

  def logps(m):
    logits = m(jnp.asarray(tokens[:, :-1])).astype(jnp.float64)
    lp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(lp, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
    return jnp.sum(picked * mask[:, 1:], axis=1)  # chosen, rejected, chosen, ...

  return model, logps, mask[:, 1:].sum(axis=1)


def _trl_loss(pi, ref, counts, loss_type, beta, smoothing=0.0):
  """TRL 1.x's DPOTrainer._compute_loss in float64 (sigmoid with TRL 0.x's label
  smoothing), the mean over pairs; pi, ref, counts alternate chosen, rejected."""
  c, r = pi[0::2] - ref[0::2], pi[1::2] - ref[1::2]
  d = c - r
  logsig = lambda x: -jnp.logaddexp(0.0, -x)
  if loss_type == "sigmoid":
    per = -logsig(beta * d) * (1 - smoothing) - logsig(-beta * d) * smoothing
  elif loss_type == "hinge":
    per = jnp.maximum(0.0, 1 - beta * d)
  else:
    per = (c / counts[0::2] - r / counts[1::2] - 1 / (2 * beta)) ** 2
  return jnp.mean(per)


@pytest.mark.parametrize("family, devices", crossed(["llama", "qwen3", "gemma3", "qwen3_moe"]))
def test_packed_sequences_log_probabilities_equal_each_alone_in_float64(family, devices):
  ex, loader, arrays = _pairs(seed=1)
  if family not in _F64:
    model64, logps, _ = _alone_logps(family, ex)
    _F64[family] = np.asarray(nnx.jit(logps)(model64))
  expected = _F64[family]
  mesh = make_mesh((devices,), ("seq",))
  model = models.build(_tiny(family), mesh=mesh, fsdp=devices in (2, 8), rngs=nnx.Rngs(0))
  names = ("tokens", "targets", "weights", "segment_ids", "positions")
  batch = train_step.place_batch(model, *(arrays[n] for n in names))
  run = lambda m, t, y, w, s, p: dpo.sequence_logps(m, t, y, w, slots=6, chunk=16, segment_ids=s, positions=p)
  got, counts = nnx.jit(run)(model, *batch)
  # Slot k of the row is segment k + 1; the plan put the pairs in some order.
  order = [(p.example, j) for p in loader.rows[0] for j in range(2)]
  got = np.asarray(got)[0]
  for k, (e, j) in enumerate(order):
    assert abs(got[k] - expected[2 * e + j]) <= 2e-5 * abs(expected[2 * e + j]), (k, e, j)
  want = []
  for e, j in order:
    a = ex.docs[e][0]
    doc = ex.masks[e][:a] if j == 0 else ex.masks[e][a:]
    want.append(float(doc[1:].sum()))
  assert list(np.asarray(counts)[0]) == want


CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("hinge", 0.3, 0.0), ("ipo", 0.2, 0.0)]


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("loss_type, beta, smoothing", CASES)
def test_each_loss_and_every_gradient_equal_trls_formula_in_float64(loss_type, beta, smoothing, devices):
  """The reference log-probabilities differ from the policy's (each sequence's shifted
  by a different amount), so the rewards, the margins and every loss term are not at
  their initial values."""
  ex, loader, arrays = _pairs(seed=2)
  model64, logps, counts = _alone_logps("llama", ex)
  shift = np.asarray([3.0, -2.0, -1.5, 2.5, 0.5, -0.7])
  ref = np.asarray(nnx.jit(logps)(model64)) + shift

  def trl(m):
    return _trl_loss(logps(m), jnp.asarray(ref), jnp.asarray(counts), loss_type, beta, smoothing)

  expected, grads = nnx.jit(nnx.value_and_grad(trl))(model64)
  grads = _flat(grads)
  mesh = make_mesh((devices,), ("seq",))
  model = models.build(_tiny("llama"), mesh=mesh, fsdp=devices > 1, rngs=nnx.Rngs(0))
  order = [(p.example, j) for p in loader.rows[0] for j in range(2)]
  # Two slots more than the row's documents (a batch's other rows may hold more pairs): an
  # empty pair, which no mean counts.
  reference = np.asarray([[ref[2 * e + j] for e, j in order] + [-5.0, 3.0]], np.float32)
  names = ("tokens", "targets", "weights", "segment_ids", "positions")
  batch = train_step.place_batch(model, *(arrays[n] for n in names))
  objective = dpo.Preference(dpo.DPOConfig(loss_type, beta, smoothing))

  def value(m, t, y, w, s, p):
    return objective.loss(m, t, y, w, chunk=16, segment_ids=s, positions=p, reference=jnp.asarray(reference))

  (loss, stats), g = nnx.jit(nnx.value_and_grad(value, has_aux=True))(model, *batch)
  assert abs(float(loss) - float(expected)) <= 1e-5 * max(abs(float(expected)), 1e-3)
  assert int(stats["pairs"]) == 3
  g = _flat(g)
  assert set(g) == set(grads)
  for name, want in grads.items():
    assert rel_err(g[name], want) < 5e-5, name
  # The metrics: TRL's, means over the pairs.
  pi = np.asarray(nnx.jit(logps)(model64))
  rc, rr = beta * (pi[0::2] - ref[0::2]), beta * (pi[1::2] - ref[1::2])
  np.testing.assert_allclose(float(stats["rewards/chosen"]), rc.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(stats["rewards/rejected"]), rr.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(stats["rewards/margins"]), (rc - rr).mean(), rtol=1e-4, atol=1e-6)
  assert float(stats["rewards/accuracies"]) == pytest.approx(np.mean(rc > rr))
  np.testing.assert_allclose(float(stats["logps/chosen"]), pi[0::2].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(stats["logps/rejected"]), pi[1::2].mean(), rtol=1e-5)


def test_bad_dpo_settings_are_named():
  with pytest.raises(ValueError, match="loss_type='kto'"):
    dpo.DPOConfig("kto")
  with pytest.raises(ValueError, match="beta=0"):
    dpo.DPOConfig("sigmoid", 0)
  with pytest.raises(ValueError, match="label_smoothing=0.1 applies to loss_type 'sigmoid' alone"):
    dpo.DPOConfig("ipo", 0.1, 0.1)


# --- The reference. ---


def _trainer(model, lora=False):
  from jax_ring.models.train import objective

  if lora:
    models.add_lora(model, rank=4, alpha=8.0)
  tx = train_step.make_tx(1e-2, 1, 4, 0.0, 1.0)
  return train_step.Trainer(
    model,
    tx,
    chunk=16,
    objective=objective.Supervised().loss,
    trainable=nnx.LoRAParam if lora else nnx.Param,
  )


def _placer(model):
  """finetune's `place`: (tokens, targets, weights) and the rows' other arrays, placed."""

  def place(arrays):
    rest = sorted(set(arrays) - {"tokens", "targets", "weights"})
    placed = train_step.place_batch(model, *(arrays[k] for k in ("tokens", "targets", "weights", *rest)))
    return placed[:3], dict(zip(rest, placed[3:]))

  return place


def test_the_reference_with_adapters_off_is_the_base_exactly():
  ex, loader, arrays = _pairs(seed=3)
  mesh = make_mesh((4,), ("seq",))
  base = models.build(_tiny("llama"), mesh=mesh, fsdp=True, rngs=nnx.Rngs(0))
  place = _placer(base)
  plain = dpo.Reference.of_model(base, chunk=16)(arrays, 6, place)
  trainer = _trainer(models.build(_tiny("llama"), mesh=mesh, fsdp=True, rngs=nnx.Rngs(0)), lora=True)
  # Trained adapters (B no longer zero): the policy differs from the base, the reference does not.
  trainer.params = jax.tree.map(lambda x: x + 0.05, trainer.params)
  off = dpo.Reference.adapters_off(trainer)(arrays, 6, place)
  np.testing.assert_array_equal(off, plain)
  policy = dpo.Reference(trainer.graphdef, trainer.params, trainer.rest, trainer.plan, 16)(arrays, 6, place)
  assert np.abs(policy - plain).max() > 1e-3
  # A frozen copy of the initial weights stays when the weights move (the step donates them).
  copy = dpo.Reference.initial(_trainer(base))
  before = copy(arrays, 6, place)
  np.testing.assert_array_equal(before, plain)


# --- The run. ---


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return tiny_folder(tmp_path_factory)


def prefs(n, seed=0):
  """Pairs in both shapes: standard strings and conversations."""
  rng = np.random.default_rng(seed)
  words = ["ring", "shard", "token", "layer", "mesh", "sum", "key", "value"]
  say = lambda k: " ".join(rng.choice(words, k))
  out = []
  for i in range(n):
    if i % 2:
      c, r = (int(k) for k in rng.integers(2, 9, 2))
      out.append({"prompt": say(5), "chosen": " " + say(c), "rejected": " " + say(r)})
    else:
      said = lambda text: [{"role": "assistant", "content": text}]
      out.append(
        {"prompt": [{"role": "user", "content": say(4)}], "chosen": said(say(3)), "rejected": said(say(7))}
      )
  return out


def _dpo_args(folder, data, out, *more):
  return [str(folder), "--data", str(data), "--objective", "dpo", "--length", "128", "--devices", "2",
          "--lr", "1e-3", "--batch", "2", "--no-progress", "--out", str(out), *more]  # fmt: skip


def test_dpo_run_writes_trls_metrics_and_the_precomputed_reference_gives_the_same_losses(folder, tmp_path):
  import finetune as script  # scripts/finetune.py

  data = write_jsonl(tmp_path / "p.jsonl", prefs(24))
  common = ["--steps", "3", "--warmup", "0", "--cache-dir", str(tmp_path / "cache"), "--eval-fraction", "0.2"]
  script.main(_dpo_args(folder, data, tmp_path / "step", *common))
  rows = [json.loads(x) for x in (tmp_path / "step" / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "loss" in r]
  names = {"pairs", "loss", *dpo.METRICS, "tokens", "padding", "seconds", "lr", "grad_norm"}
  assert [r["step"] for r in steps] == [0, 1, 2] and all(names <= set(r) for r in steps)
  assert all(r["pairs"] >= 1 for r in steps)
  assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference at first
  # The reference's program (no gradient) rounds apart from the step's by float32's last bits.
  assert abs(steps[0]["rewards/margins"]) < 1e-5 and abs(steps[-1]["rewards/margins"]) > 1e-3
  (evaluation,) = [r for r in rows if "eval_loss" in r]
  assert evaluation["eval_pairs"] == 5 and {f"eval_{k}" for k in dpo.METRICS} <= set(evaluation)
  script.main(_dpo_args(folder, data, tmp_path / "pre", *common, "--precompute-reference"))
  pre = [json.loads(x) for x in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines()]
  cached = list((tmp_path / "cache").glob("dpo-*.npz"))
  assert len(cached) == 2  # the training rows' and the evaluation rows'
  for a, b in zip(rows, pre):
    for k in ("loss", "eval_loss", *dpo.METRICS):
      if k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7), (a["step"], k)


def test_dpo_with_adapters_and_sigterm_resumes_with_the_uninterrupted_losses(folder, tmp_path):
  data = write_jsonl(tmp_path / "p.jsonl", prefs(40, seed=1))
  steps = ["--steps", "5", "--lora-rank", "4", "--loss-type", "ipo", "--cache-dir", str(tmp_path / "cache")]
  whole, out = tmp_path / "whole", tmp_path / "stopped"
  _finish(_child(_dpo_args(folder, data, whole, *steps), 300), 300)
  expected = [r["loss"] for r in json.loads((whole / "report.json").read_text())["steps"]]
  assert (whole / "adapter" / "adapter_config.json").is_file()
  child = _child(_dpo_args(folder, data, out, *steps), 300, pause=0.5)
  try:
    metrics = out / "metrics.jsonl"
    _wait_for(
      lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "second step", child
    )
    child.send_signal(signal.SIGTERM)
  finally:
    output = _finish(child, 120)
  assert b"SIGTERM: saved the state at step" in output
  _finish(_child(_dpo_args(folder, data, out, *steps), 300), 300)
  got = [r["loss"] for r in json.loads((out / "report.json").read_text())["steps"]]
  assert got == expected and len(got) == 5


def test_dpo_refuses_data_that_is_not_pairs_and_pairs_without_dpo(folder, tmp_path):
  import finetune as script

  pairs = write_jsonl(tmp_path / "p.jsonl", prefs(4))
  with pytest.raises(SystemExit, match="preference records need --objective dpo"):
    script.main([str(folder), "--data", str(pairs), "--out", str(tmp_path / "a"), "--length", "128"])
  texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}] * 3)
  with pytest.raises(SystemExit, match="text records are not preference pairs"):
    script.main(_dpo_args(folder, texts, tmp_path / "b"))
  with pytest.raises(SystemExit, match="never split"):
    script.main(_dpo_args(folder, pairs, tmp_path / "c", "--long", "split"))
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_frozen_copy_outlives_the_steps_and_another_model_serves_as_reference(folder, tmp_path):
  """Without adapters the reference is a copy of the initial weights, which the steps
  (donating the weights they update) leave as they were; --reference PATH (here the
  same weights from their folder) gives the default's losses; a bfloat16 copy moves
  the first step's loss off log 2 by its rounding alone."""
  import finetune as script

  ex, loader, arrays = _pairs(seed=4)
  mesh = make_mesh((2,), ("seq",))
  trainer = _trainer(models.build(_tiny("llama"), mesh=mesh, fsdp=True, rngs=nnx.Rngs(0)))
  place = _placer(trainer.model())
  copy = dpo.Reference.initial(trainer)
  before = copy(arrays, 6, place)
  args, rows = place(
    {k: v for k, v in arrays.items() if k in ("tokens", "targets", "weights", "segment_ids", "positions")}
  )
  for _ in range(2):
    trainer.step(*args, **rows)
  np.testing.assert_array_equal(copy(arrays, 6, place), before)
  moved = dpo.Reference(trainer.graphdef, trainer.params, trainer.rest, trainer.plan, 16)(arrays, 6, place)
  assert np.abs(moved - before).max() > 1e-3

  data = write_jsonl(tmp_path / "p.jsonl", prefs(12, seed=3))
  common = ["--steps", "2", "--warmup", "0", "--cache-dir", str(tmp_path / "cache")]
  losses = {}
  for name, more in (
    ("initial", []),
    ("path", ["--reference", str(folder)]),
    ("bf16", ["--reference-dtype", "bfloat16"]),
  ):
    script.main(_dpo_args(folder, data, tmp_path / name, *common, *more))
    losses[name] = [r["loss"] for r in json.loads((tmp_path / name / "report.json").read_text())["steps"]]
  assert losses["path"] == pytest.approx(losses["initial"], rel=1e-6)
  assert losses["bf16"][0] != pytest.approx(np.log(2), abs=1e-6) and abs(losses["bf16"][0] - np.log(2)) < 0.05
