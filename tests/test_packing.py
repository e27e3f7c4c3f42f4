"""Packed rows (`models.pack`) over the ring, exactly: the plan (best-fit decreasing, every
example once, long ones split with their positions going on), and a packed row's loss
and every weight's gradient against the sum over its examples, each run alone on one
device through the dense path in float64, for Llama, Qwen 3, Gemma 3 (sliding windows
with segments), Mistral (window) and Qwen3-MoE, each on two of 1, 2, 4 and 8 devices
(`conftest.crossed`: every count runs two families or more), with FSDP."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import crossed, make_mesh, rel_err
from flax import nnx

from jax_ring import models
from jax_ring.models.data import packing
from jax_ring.models.train import step as train_step
from jax_ring.nn import set_document_bound

LENGTH = 48


def _examples(lengths, vocab=97, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    ids = rng.integers(0, vocab, n).astype(np.int32)
    mask = (rng.random(n) < 0.7).astype(np.float32)
    out.append((ids, mask))
  return out


def test_pack_places_every_example_once_best_fit_decreasing():
  lengths = [30, 20, 18, 10, 8, 5, 100, 48, 1]
  examples = _examples(lengths)
  rows, dropped = packing.plan(lengths, LENGTH)
  assert dropped == []
  # The 100-token example: two full rows, then its last 4 tokens open the next row.
  assert [[(p.example, p.start, p.stop) for p in r] for r in rows[:3]] == [
    [(6, 0, 48)],
    [(6, 48, 96)],
    [(6, 96, 100), (0, 0, 30), (4, 0, 8), (5, 0, 5), (8, 0, 1)],
  ]
  # Longest first, each into the fullest row it fits: 48 opens a row; 30 joins the 4
  # (room 14); 20 opens one (room 28); 18 and 10 fill it, not the row with room 14;
  # 8, 5 and 1 go there.
  assert [[p.example for p in r] for r in rows[3:]] == [[7], [1, 2, 3]]
  seen = {}
  for r in rows:
    for p in r:
      seen.setdefault(p.example, []).append((p.start, p.stop))
  assert {i: sum(b - a for a, b in s) for i, s in seen.items()} == dict(enumerate(lengths))
  packed = models.pack(examples, LENGTH)
  assert len(packed) == len(rows)
  row = packed[4]
  assert row["tokens"].dtype == np.int32 and row["loss_mask"].dtype == np.float32
  np.testing.assert_array_equal(row["segment_ids"], [1] * 20 + [2] * 18 + [3] * 10)
  np.testing.assert_array_equal(row["positions"][18:22], [18, 19, 0, 1])
  row = packed[2]
  np.testing.assert_array_equal(row["segment_ids"], [1] * 4 + [2] * 30 + [3] * 8 + [4] * 5 + [5])
  np.testing.assert_array_equal(row["positions"][:5], [96, 97, 98, 99, 0])  # positions go on
  np.testing.assert_array_equal(row["tokens"][4:34], examples[0][0])
  assert row["loss_mask"][0] == 0 and row["loss_mask"][4] == 0 and row["loss_mask"][34] == 0
  np.testing.assert_array_equal(row["loss_mask"][5:34], examples[0][1][1:])
  assert packing.padding_fraction(packed) == 0.0  # this plan fills every row


def test_long_examples_truncated_or_dropped_and_bad_input_refused():
  examples = _examples([60, 10])
  truncated = models.pack(examples, LENGTH, long="truncate")
  assert len(truncated) == 2 and truncated[1]["segment_ids"].sum() == 10
  np.testing.assert_array_equal(truncated[0]["tokens"][:48], examples[0][0][:48])
  dropped = models.pack(examples, LENGTH, long="drop")
  assert len(dropped) == 1 and (dropped[0]["segment_ids"] > 0).sum() == 10
  assert not dropped[0]["segment_ids"][10:].any() and not dropped[0]["loss_mask"][10:].any()
  assert not dropped[0]["positions"][10:].any() and packing.padding_fraction(dropped) == 38 / 48
  with pytest.raises(ValueError, match="long='cut'"):
    models.pack(examples, LENGTH, long="cut")
  with pytest.raises(ValueError, match="length=0"):
    models.pack(examples, 0)
  with pytest.raises(ValueError, match=r"examples\[1\]: loss_mask of shape \(3,\)"):
    models.pack([examples[0], (np.zeros(4, np.int32), np.zeros(3))], LENGTH)
  with pytest.raises(TypeError, match=r"examples\[0\]: ids of shape \(2,\) and dtype float"):
    models.pack([(np.zeros(2), np.zeros(2))], LENGTH)


# --- Exactness of a packed row over the ring. ---


def _tiny(family):
  common = dict(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=48)
  match family:
    case "llama":
      return dataclasses.replace(models.config("llama-3.2-1b"), **common, context_length=256)
    case "qwen3":
      return dataclasses.replace(models.config("qwen3-0.6b"), **common, context_length=256)
    case "gemma3":  # layer 0 local (a window of 6 keys), layer 1 global
      cfg = dataclasses.replace(models.config("gemma-3-270m"), **common, context_length=256)
      return dataclasses.replace(cfg, window=6, global_every=2, query_pre_attn_scalar=8)
    case "mistral":
      return dataclasses.replace(
        models.config("mistral-7b-v0.3"), **common, context_length=256, sliding_window=7
      )
    case "qwen3_moe":  # no load-balancing loss: a statistic of the whole batch, not of each example
      cfg = dataclasses.replace(models.config("qwen3-30b-a3b"), **common, context_length=256)
      return dataclasses.replace(
        cfg, num_experts=4, num_experts_per_tok=2, moe_hidden=16, router_aux_loss_coef=0.0
      )
  raise AssertionError(family)


_REFERENCE = {}


def _flat(tree):
  return {".".join(map(str, k)): np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(tree)}


def _summed(m, ids, mask):
  """Summed masked cross-entropy of rows [B, L] (each row one example, alone)."""
  logits = m(ids[:, :-1]).astype(jnp.float64)
  ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(ce * mask[:, 1:])


# One program per model: the examples run as the rows of one batch, each padded at its
# end to the longest with weight 0 (causal attention: what follows an example's tokens
# changes none of their logits), and eager dispatch of a model's layers costs more than
# compiling them.
_summed_grad = nnx.jit(nnx.value_and_grad(_summed))


def _reference(family, examples):
  """Sum over the examples of each one's summed cross-entropy, and its gradient: each
  alone (its own row of a batch), dense attention on one device, float64 weights and
  compute."""
  if family in _REFERENCE:
    return _REFERENCE[family]
  cfg = _tiny(family)
  model = models.build(cfg, attention="dense", dtype="float64", param_dtype="float64", rngs=nnx.Rngs(0))
  weights32 = nnx.state(models.build(cfg, attention="dense", rngs=nnx.Rngs(0)), nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.float64), weights32))  # the ring's weights, exactly

  longest = max(len(ids) for ids, _ in examples)
  ids = np.zeros((len(examples), longest), np.int32)
  mask = np.zeros((len(examples), longest), np.float64)
  for row, (x, w) in enumerate(examples):
    ids[row, : len(x)], mask[row, : len(w)] = x, w
  value, grads = _summed_grad(model, jnp.asarray(ids), jnp.asarray(mask))
  _REFERENCE[family] = float(value), _flat(grads)
  return _REFERENCE[family]


FAMILIES = ["llama", "qwen3", "gemma3", "mistral", "qwen3_moe"]


@pytest.mark.parametrize("family, devices", crossed(FAMILIES))
def test_packed_row_equals_its_examples_alone_in_float64(family, devices):
  """Examples of 5-30 tokens (one split across two rows' worth of length is not needed
  here: positions going on are the plan's test) packed into one row of 48 whose
  documents cross the shard boundaries; the ring (FSDP on from 2 devices) in float32,
  its passes bounded by the longest document, as fine-tuning runs it (on 4 and 8
  devices 2 and 3 passes back of 3 and 7), or for llama, gemma3 and qwen3_moe read from
  the ids while running (`document_bound="auto"`: on 4 and 8 devices the program picks
  between one chunk each way and the whole ring, or among three)."""
  examples = _examples([17, 12, 9, 5], seed=3)
  (row,) = models.pack(examples, LENGTH)
  total, grads = _reference(family, examples)
  mesh = make_mesh((devices,), ("seq",))
  model = models.build(_tiny(family), mesh=mesh, fsdp=devices > 1, rngs=nnx.Rngs(0))
  bound = "auto" if family in ("llama", "gemma3", "qwen3_moe") else 17
  assert set_document_bound(model, bound) == _tiny(family).num_layers
  tokens = row["tokens"][None]
  targets = np.concatenate([tokens[:, 1:], np.zeros((1, 1), np.int32)], axis=1)
  weights = np.concatenate([row["loss_mask"][None, 1:], np.zeros((1, 1), np.float32)], axis=1)
  segments = np.where(row["segment_ids"] == 0, -1, row["segment_ids"])[None]
  batch = train_step.place_batch(model, tokens, targets, weights, segments, row["positions"][None])
  count = float(weights.sum())

  def value(m, tokens, targets, weights, segment_ids, positions):
    return train_step.loss(
      m, tokens, targets, weights, chunk=16, segment_ids=segment_ids, positions=positions
    )

  loss, g = nnx.jit(nnx.value_and_grad(value))(model, *batch)
  assert abs(float(loss) * count - total) / abs(total) < 1e-6
  g = _flat(g)
  assert set(g) == set(grads)
  for name, expected in grads.items():
    assert rel_err(g[name] * count, expected) < 2e-5, name
