"""The training script: same losses on 8 devices as on 1, exact resume, the demo task."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import train  # noqa: E402

SMALL = ["--seq-len=64", "--batch=4", "--dim=32", "--layers=1", "--eval-batches=0", "--no-progress", "--out="]


def _losses(*extra):
  args = train.parse_args([*SMALL, *extra])
  return np.array(train.train(args, log=lambda *_: None)["loss"])


def test_eight_devices_give_the_losses_of_one():
  one = _losses("--attention=ring", "--seq=1", "--steps=4")
  eight = _losses("--attention=ring", "--seq=8", "--steps=4")
  two_d = _losses("--attention=ring", "--data=2", "--seq=4", "--steps=4")
  assert np.all(np.isfinite(one)) and len(set(one.tolist())) == 4  # parameters move
  np.testing.assert_allclose(eight, one, rtol=2e-5)
  np.testing.assert_allclose(two_d, one, rtol=2e-5)


def test_resume_continues_exactly(tmp_path):
  common = ["--attention=ring", "--seq=4", "--steps=6", "--ckpt-every=3"]
  full = _losses(*common)
  ckpt = f"--ckpt-dir={tmp_path / 'ckpt'}"
  first = _losses(*common, ckpt, "--stop-after=3")
  rest = _losses(*common, ckpt, "--resume")
  assert len(first) == 3 and len(rest) == 3
  np.testing.assert_array_equal(np.concatenate([first, rest]), full)


def test_task_is_deterministic_and_puts_pairs_in_the_first_shard():
  task = train.Task(seq_len=128, pair_region=16)
  a, answers = task.batch(0, 7, 8)
  b, _ = task.batch(0, 7, 8)
  np.testing.assert_array_equal(a, b)
  pairs = (a >= task.pair_base) & (a < task.query_base)
  assert pairs[:, 16:].sum() == 0 and (pairs.sum(1) == task.num_pairs).all()
  assert ((a[:, -1] >= task.query_base) & (a[:, -1] < task.answer_base)).all()
  assert ((answers >= task.answer_base) & (answers < task.vocab_size)).all()


@pytest.mark.slow
def test_demo_task_ring_beats_shard_local(tmp_path):
  # The demo at reduced size: 128 tokens over 8 devices; the pairs are in shard 0 and
  # the question in shard 7.
  common = ["--seq-len=128", "--batch=16", "--eval-batches=8", "--no-progress", "--eval-every=50"]
  common += ["--steps=500", "--seq=8", "--layers=1"]
  task = train.Task(seq_len=128, pair_region=16)
  ring = train.train(
    train.parse_args([*common, "--attention=ring", "--target-accuracy=0.9", f"--out={tmp_path / 'r'}"]), task
  )
  steps = ring["step"][-1]
  local = train.train(
    train.parse_args([*common, "--attention=local", f"--stop-after={steps}", f"--out={tmp_path / 'l'}"]), task
  )
  ring_acc, local_acc = ring["eval"][-1]["accuracy"], local["eval"][-1]["accuracy"]
  assert ring_acc >= 0.85, ring["eval"]
  assert local_acc <= task.chance + 0.15, local["eval"]
  assert ring_acc - local_acc >= 0.6
