"""Training (models.training): same losses on 8 devices as on 1, exact resume, the demo task."""

import dataclasses

import numpy as np
import pytest

from models.tasks import KeyValueTask
from models.training import TrainConfig, train

SMALL = TrainConfig(batch=4, dim=32, layers=1, eval_batches=0, progress=False, out=None)
TASK = KeyValueTask(seq_len=64)


def _losses(**changes):
  config = dataclasses.replace(SMALL, **changes)
  return np.array(train(config, TASK, log=lambda *_: None)["loss"])


def test_eight_devices_give_the_losses_of_one():
  one = _losses(attention="ring", seq=1, steps=4)
  eight = _losses(attention="ring", seq=8, steps=4)
  two_d = _losses(attention="ring", data=2, seq=4, steps=4)
  assert np.all(np.isfinite(one)) and len(set(one.tolist())) == 4  # parameters move
  np.testing.assert_allclose(eight, one, rtol=2e-5)
  np.testing.assert_allclose(two_d, one, rtol=2e-5)


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


@pytest.mark.slow
def test_demo_task_ring_beats_shard_local(tmp_path):
  # The demo at reduced size: 128 tokens over 8 devices; the pairs are in shard 0 and
  # the question in shard 7.
  task = KeyValueTask(seq_len=128, pair_region=16)
  common = TrainConfig(batch=16, eval_batches=8, eval_every=50, steps=500, seq=8, layers=1, progress=False)
  ring = train(
    dataclasses.replace(common, attention="ring", target_accuracy=0.9, out=str(tmp_path / "r")), task
  )
  steps = ring["step"][-1]
  local = train(
    dataclasses.replace(common, attention="local", stop_after=steps, out=str(tmp_path / "l")), task
  )
  ring_acc, local_acc = ring["eval"][-1]["accuracy"], local["eval"][-1]["accuracy"]
  assert ring_acc >= 0.85, ring["eval"]
  assert local_acc <= task.chance + 0.15, local["eval"]
  assert ring_acc - local_acc >= 0.6
