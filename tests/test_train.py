"""Training (models.train.scratch): same losses on 8 devices as on 1, exact resume, the demo task."""

import dataclasses
import json
import re

import demo
import numpy as np
import pytest
from flax import nnx

from jax_ring.models.train.scratch import TrainConfig, build, load_params, make_mesh, train
from jax_ring.models.train.tasks import NAMES, KeyValueTask, NeedleTask, corpus, decode

SMALL = TrainConfig(batch=4, dim=32, layers=1, eval_batches=0, progress=False, out=None)
TASK = KeyValueTask(seq_len=64)


def _losses(**changes):
  config = dataclasses.replace(SMALL, **changes)
  return np.array(train(config, TASK, log=lambda *_: None)["loss"])


def test_eight_devices_give_the_losses_of_one():
  one = _losses(attention="ring", seq=1, steps=4)
  eight = _losses(attention="ring", seq=8, steps=4)
  two_d = _losses(attention="ring", data=2, seq=4, steps=4)
  hybrid = _losses(attention="ring", seq=2, ulysses=4, steps=4)  # 4 heads over "u", kv heads repeated
  assert np.all(np.isfinite(one)) and len(set(one.tolist())) == 4  # parameters move
  np.testing.assert_allclose(eight, one, rtol=2e-5)
  np.testing.assert_allclose(two_d, one, rtol=2e-5)
  np.testing.assert_allclose(hybrid, one, rtol=2e-5)


def test_fsdp_gives_the_replicated_losses_and_splits_the_weights():
  """The DecoderLM path trains with the step that fine-tunes loaded models: with
  `fsdp=True` every weight and AdamW moment is split over all 8 devices of a (2, 4)
  mesh (each holds 1/8 of every array, over both axes), and four steps give the
  replicated run's losses and weights. (The (8,) mesh is the loaded models' test, in
  tests/test_finetune.py, on the same step.)"""
  config = dataclasses.replace(SMALL, attention="ring", data=2, seq=4, steps=4, layers=2)
  runs = [
    train(dataclasses.replace(config, fsdp=fsdp), TASK, log=lambda *_: None, return_model=True)
    for fsdp in (False, True)
  ]
  (replicated, a), (split, b) = runs
  np.testing.assert_allclose(split["loss"], replicated["loss"], rtol=1e-5)
  assert len(set(replicated["loss"])) == 4  # the weights move
  flat_a, flat_b = nnx.to_flat_state(nnx.state(a, nnx.Param)), nnx.to_flat_state(nnx.state(b, nnx.Param))
  assert [k for k, _ in flat_a] == [k for k, _ in flat_b]
  for (key, va), (_, vb) in zip(flat_a, flat_b):
    x, y = va.get_value(), vb.get_value()
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=str(key))
    assert x.addressable_shards[0].data.size == x.size  # replicated
    assert y.addressable_shards[0].data.size * 8 == y.size, key  # an eighth on each device
  with pytest.raises(ValueError, match="fsdp=True"):
    TrainConfig(attention="dense", fsdp=True)


def test_resume_continues_exactly(tmp_path):
  common = dict(attention="ring", seq=4, steps=6, ckpt_every=3)
  full = _losses(**common)
  ckpt = str(tmp_path / "ckpt")
  first = _losses(**common, ckpt_dir=ckpt, stop_after=3)
  rest = _losses(**common, ckpt_dir=ckpt, resume=True)
  assert len(first) == 3 and len(rest) == 3
  np.testing.assert_array_equal(np.concatenate([first, rest]), full)


def test_task_is_deterministic_and_puts_pairs_in_the_first_shard():
  task = KeyValueTask(seq_len=128, pair_region=16)
  a, targets, weights = task.batch(0, 7, 8)
  b, _, _ = task.batch(0, 7, 8)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(task.batch(0, 7, 8, rows=range(3, 5)).tokens, a[3:5])
  pairs = (a >= task.pair_base) & (a < task.query_base)
  assert pairs[:, 16:].sum() == 0 and (pairs.sum(1) == task.num_pairs).all()
  assert ((a[:, -1] >= task.query_base) & (a[:, -1] < task.answer_base)).all()
  assert (weights[:, :-1] == 0).all() and (weights[:, -1] == 1).all()
  answers = targets[:, -1]
  assert ((answers >= task.answer_base) & (answers < task.vocab_size)).all()


def test_needle_task_plants_the_asked_value_at_its_depth_in_real_text():
  task = NeedleTask(seq_len=512, needles=3, digits=4, depth=(0.25, 0.375))
  batch = task.batch(0, 5, 6)
  np.testing.assert_array_equal(batch.tokens, task.batch(0, 5, 6).tokens)
  np.testing.assert_array_equal(task.batch(0, 5, 6, rows=range(2, 4)).targets, batch.targets[2:4])
  text = bytes(corpus()).decode("ascii")
  for tokens, targets, weights in zip(*batch):
    row = decode(np.append(tokens, targets[-1]))
    assert len(row) == 513
    answer = decode(targets[weights == 1])
    assert len(answer) == 4 and answer.isdigit()
    question = row[row.rindex("\n") :]
    name = question.split()[3]
    assert name in NAMES and question == f"\nThe code of {name} is {answer}"
    needle = f" The code of {name} is {answer}. "
    assert row.count(" The code of ") == 3 and needle in row
    planted = [m for m in re.finditer(r" The code of \w+ is \d{4}\. ", row) if m.start() < len(row) - 40]
    assert len(planted) == 3
    before = sum(m.end() - m.start() for m in planted if m.start() < row.index(needle))
    hay_len = 513 - len(question) - sum(m.end() - m.start() for m in planted)
    depth = (row.index(needle) - before) / hay_len
    assert 0.25 <= depth < 0.375 + 16 / hay_len, depth  # the bin, moved at most 16 bytes to a word start
    # The loss weights: the value (1), the question's words (question_weight), text.
    assert np.allclose(weights[-(len(question) - 1) : -4], task.question_weight)
    assert np.allclose(weights[: -(len(question) - 1)], task.text_weight)
    haystack = row.split(" The code of ")[0]
    assert haystack in text  # the haystack is the corpus itself
  with pytest.raises(ValueError, match="NeedleTask.seq_len=64 leaves no haystack"):
    NeedleTask(seq_len=64, needles=2)
  with pytest.raises(ValueError, match="NeedleTask.depth"):
    NeedleTask(depth=(0.5, 0.5))


def test_parameters_save_and_load(tmp_path):
  path = str(tmp_path / "params.npz")
  config = dataclasses.replace(SMALL, attention="ring", seq=4, steps=2, save_params=path)
  _, model = train(config, TASK, log=lambda *_: None, return_model=True)
  fresh, _ = build(dataclasses.replace(config, seed=1), TASK, make_mesh(1, 4))
  load_params(fresh, path, make_mesh(1, 4))
  saved, loaded = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (model, fresh))
  assert [k for k, _ in saved] == [k for k, _ in loaded]  # every parameter, by name
  for (key, a), (_, b) in zip(saved, loaded, strict=True):
    np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), err_msg=str(key))
  wider, _ = build(dataclasses.replace(config, dim=64), TASK, make_mesh(1, 4))
  with pytest.raises(ValueError, match="has shape"):
    load_params(wider, path, make_mesh(1, 4))


@pytest.mark.slow
def test_demo_task_ring_beats_shard_local(tmp_path):
  # The demo at reduced size: 64 tokens over 4 devices (8 take twice the time: the
  # devices' threads share 2 cores); the pairs are in shard 0 and the question in shard 3.
  task = KeyValueTask(seq_len=64, pair_region=8)
  common = TrainConfig(batch=16, eval_batches=8, eval_every=25, steps=500, seq=4, layers=1, progress=False)
  ring, model = train(
    dataclasses.replace(common, attention="ring", target_accuracy=0.9, out=str(tmp_path / "r")),
    task,
    return_model=True,
  )
  steps = ring["step"][-1]
  # Shard-local attention for as many steps, evaluated once at the end.
  local = dataclasses.replace(common, attention="local", stop_after=steps, eval_every=steps)
  local = train(dataclasses.replace(local, out=str(tmp_path / "l")), task)
  ring_acc, local_acc = ring["eval"][-1]["accuracy"], local["eval"][-1]["accuracy"]
  assert ring_acc >= 0.85, ring["eval"]
  assert local_acc <= task.chance + 0.15, local["eval"]
  assert ring_acc - local_acc >= 0.6
  # The demo's last act: the trained model answers fresh questions through generate.
  answers = demo.answer_questions(model, task, seed=0, count=16)
  assert sum(a["answer"] == a["truth"] for a in answers) >= 11, answers


@pytest.mark.slow
def test_needle_demo_quick(tmp_path):
  """The needle demo end to end at its --quick size, from the shipped start: three
  trainings, the depth x length grid, generated answers, the report files."""
  import needle_demo

  needle_demo.main(["--quick", "--no-progress", "--out", str(tmp_path)])
  with open(tmp_path / "report.json") as f:
    report = json.load(f)
  assert report["lengths"] == [128, 256, 512] and report["bins"] == 8
  assert set(report["runs"]) == {"ring", "local", "window"}
  for run in report["runs"].values():
    grid = np.asarray(run["grid"])
    assert grid.shape == (3, 8) and ((grid >= 0) & (grid <= 1)).all()
    assert run["steps"] == 4 and np.isfinite(run["final_loss"])
    for a in run.get("answers", []):
      assert len(a["answer"]) == 4 and len(a["truth"]) == 4 and a["question"].startswith("The code of ")
  assert "answers" in report["runs"]["ring"] and "answers" not in report["runs"]["local"]
  assert (tmp_path / "report.png").stat().st_size > 10_000
  # The shipped start retrieves at twice its training length through the ring, while
  # shard-local attention cannot see needles outside the question's shard (bins 0-5 lie
  # at least one 64-byte shard before it at T=512).
  ring, local = (np.asarray(report["runs"][k]["grid"]) for k in ("ring", "local"))
  assert ring[-1].mean() >= 0.8, ring
  assert local[-1, :6].max() <= 0.5 and local[-1, :6].mean() <= 0.1, local
  answers = report["runs"]["ring"]["answers"]
  assert sum(a["answer"] == a["truth"] for a in answers) >= 1, answers
