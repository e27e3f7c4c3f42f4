"""Reinforcement learning from rewards (`models.train.grpo`): TRL's advantages and every
loss type against its formulas written here in float64; each token's log-probability
and entropy through the chunked head (whole and over the vocabulary's ring) against
float64; the sampler's log-probabilities against the trainer's on 1, 2, 4 and 8 devices,
and the importance ratio 1 at a rollout's first iteration and not at its second; the
run through scripts/finetune.py with its rollouts.jsonl and TRL's metrics; a reward
function that raises; and a SIGTERM'd run resumed with the uninterrupted run's
rollouts and losses."""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from test_finetune_data import TINY, _child, _finish, _wait_for, tiny_folder, tiny_tokenizer, write_jsonl

from jax_ring import models
from jax_ring.models.train import dpo, grpo
from jax_ring.models.train import step as train_step

# --- TRL's formulas in float64, written out here. ---


def _trl_advantages(per_function, weights, g, scale):
  """TRL 1.x's `_generate_and_score_completions` (sum_then_normalize), by loops."""
  n, f = len(per_function), len(weights)
  rewards = []
  for row in per_function:
    seen = [row[k] * weights[k] for k in range(f) if row[k] is not None]
    rewards.append(sum(seen) if seen else None)

  def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
      return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
      return m, None
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5

  out = []
  for i in range(n):
    group = rewards[(i // g) * g : (i // g + 1) * g]
    m, s = mean_std(group)
    if scale == "batch":
      s = mean_std(rewards)[1]
    if rewards[i] is None or m is None:
      out.append(0.0)
      continue
    a = rewards[i] - m
    if scale != "none":
      a = a / (s + 1e-4) if s is not None else float("nan")
    out.append(0.0 if a != a else a)
  return rewards, out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_in_float64(scale):
  rng = np.random.default_rng(0)
  g, f = 4, 2
  per = rng.normal(size=(12, f)).round(2).tolist()
  per[1][0] = None  # a function that does not score one completion
  per[5] = [None, None]  # no function scores this one: no advantage
  per[8:12] = [[0.5, 1.0]] * 4  # a group whose rewards are all equal
  weights = [1.0, 0.5]
  got = grpo.group_advantages([[np.nan if v is None else v for v in r] for r in per], weights, g, scale)
  rewards, want = _trl_advantages(per, weights, g, scale)
  np.testing.assert_allclose(got["advantages"], want, rtol=1e-12, atol=1e-12)
  assert np.isnan(got["rewards"][5]) and got["advantages"][5] == 0.0
  np.testing.assert_allclose(got["rewards"][[0, 1, 2]], [rewards[0], rewards[1], rewards[2]], rtol=1e-12)
  if scale != "batch":
    assert got["zero_std"].tolist() == [False] * 8 + [True] * 4


def _trl_loss(lp, old, ref, adv, mask, loss_type, beta, eps, eps_high, c_max):
  """TRL 1.x's `GRPOTrainer._compute_loss` on padded [completions, length] arrays."""
  coef = jnp.exp(lp - old)
  clipped = jnp.clip(coef, 1 - eps, 1 + eps_high)
  a = adv[:, None]
  per = -jnp.minimum(coef * a, clipped * a)
  if beta:
    per = per + beta * (jnp.exp(ref - lp) - (ref - lp) - 1)
  if loss_type == "grpo":
    return jnp.mean(jnp.sum(per * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
  if loss_type in ("bnpo", "dapo"):
    return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(per * mask) / (per.shape[0] * c_max)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("beta, eps_high", [(0.0, None), (0.04, 0.28)])
def test_each_loss_and_its_gradient_equal_trls_formula_in_float64(loss_type, beta, eps_high):
  """The completions' tokens scattered over packed rows (out of order, with tokens of no
  completion between them) give TRL's loss on the padded completions, and its gradient."""
  rng = np.random.default_rng(1)
  n, c_max = 5, 7
  lengths = [7, 3, 5, 1, 6]
  lp = rng.normal(-2, 0.3, (n, c_max))
  old = lp + rng.normal(0, 0.3, (n, c_max))  # ratios far enough from 1 to clip
  ref = lp + rng.normal(0, 0.2, (n, c_max))
  adv = rng.normal(size=n)
  mask = np.zeros((n, c_max))
  for i, k in enumerate(lengths):
    mask[i, :k] = 1
  # Packed: two rows of 24 positions, completions in a shuffled order at scattered places.
  rows, t = 2, 24
  where = {}
  free = [(r, s) for r in range(rows) for s in range(t)]
  order = rng.permutation(len(free))
  at = 0
  for i in rng.permutation(n):
    where[int(i)] = [free[j] for j in sorted(order[at : at + lengths[i]])]
    at += lengths[i] + 2
  packed = {k: np.zeros((rows, t)) for k in ("lp", "old", "ref", "adv", "mask")}
  which = np.full((rows, t), -1, np.int32)
  for i, places in where.items():
    for j, (r, s) in enumerate(places):
      packed["lp"][r, s], packed["old"][r, s], packed["ref"][r, s] = lp[i, j], old[i, j], ref[i, j]
      packed["adv"][r, s], packed["mask"][r, s], which[r, s] = adv[i], 1.0, i
  cfg = grpo.GRPOConfig(
    num_generations=5, max_completion_length=c_max, loss_type=loss_type, beta=beta, epsilon_high=eps_high
  )

  def ours(x):
    return grpo.policy_loss(
      x, packed["old"], packed["adv"], packed["mask"], which, cfg, n, packed["ref"] if beta else None
    )[0]

  def theirs(x):
    return _trl_loss(x, old, ref, adv, mask, loss_type, beta, 0.2, eps_high or 0.2, c_max)

  value, stats = grpo.policy_loss(
    jnp.asarray(packed["lp"]), packed["old"], packed["adv"], packed["mask"], which, cfg, n,
    packed["ref"] if beta else None,
  )  # fmt: skip
  assert float(value) == pytest.approx(float(theirs(jnp.asarray(lp))), rel=1e-12)
  assert 0 < float(stats["clip_ratio/region_mean"]) < 1  # some tokens clipped, some not
  grad = np.asarray(jax.grad(ours)(jnp.asarray(packed["lp"])))
  want = np.asarray(jax.grad(theirs)(jnp.asarray(lp)))
  for i, places in where.items():
    for j, (r, s) in enumerate(places):
      assert grad[r, s] == pytest.approx(want[i, j], rel=1e-10, abs=1e-14)
  assert np.all(grad[which < 0] == 0)


def test_bad_settings_are_named():
  for kw, says in [
    (dict(num_generations=1), "num_generations=1"),
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(loss_type="sigmoid"), "loss_type='sigmoid'"),
    (dict(scale_rewards="max"), "scale_rewards='max'"),
    (dict(beta=-1.0), "beta=-1.0"),
    (dict(num_iterations=0), "num_iterations=0"),
  ]:
    with pytest.raises(ValueError, match=says):
      grpo.GRPOConfig(**kw)


# --- Each token's log-probability and entropy. ---


def _float64_model(cfg, mesh, fsdp):
  model = models.build(cfg, mesh=mesh, fsdp=fsdp, rngs=nnx.Rngs(0))
  dense = models.build(cfg, attention="dense", dtype="float64", param_dtype="float64", rngs=nnx.Rngs(0))
  weights = jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), nnx.state(model, nnx.Param))
  nnx.update(dense, weights)
  return model, dense


@pytest.mark.parametrize(
  "devices, vocab, fsdp, length",
  [(1, 288, False, 48), (2, 289, True, 1040), (4, 288, False, 48), (8, 289, False, 48), (8, 288, True, 2112)],
)
def test_token_log_probabilities_and_entropy_equal_float64(devices, vocab, fsdp, length):
  """Over the whole head (a vocabulary the devices do not divide) and over the
  vocabulary's ring (one they do), at a temperature, in the tokens' order whatever the
  ring's (zig-zag where a device holds more than 256 tokens)."""
  import dataclasses

  cfg = dataclasses.replace(TINY, vocab_size=vocab, context_length=4096)
  model, dense = _float64_model(cfg, make_mesh((devices,), ("seq",)), fsdp)
  assert (model.head_table()[1] is not None) == (vocab % devices == 0)  # which path the head takes
  rng = np.random.default_rng(devices)
  tokens = rng.integers(0, vocab, (2, length)).astype(np.int32)
  assert (model.ring_permutation(length) is not None) == (length > 256 * devices)
  targets = np.roll(tokens, -1, axis=1)
  args = train_step.place_batch(model, tokens, targets)
  got, ent = jax.jit(
    lambda m, a, b: train_step.token_logps(m, a, b, chunk=16, temperature=0.7, entropy=True)
  )(model, *args)
  logits = dense(jnp.asarray(tokens)) / 0.7
  lp = jax.nn.log_softmax(logits, axis=-1)
  want = np.take_along_axis(np.asarray(lp), targets[..., None], axis=-1)[..., 0]
  want_ent = -np.sum(np.exp(np.asarray(lp)) * np.asarray(lp), axis=-1)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
  np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-5)


# --- The sampler and the trainer agree. ---


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    ids = np.r_[tiny_tokenizer().bos_id, rng.integers(3, 250, n - 1)].astype(np.int32)
    out.append(grpo.Prompt(ids, f"p{n}", f"p{n}", False, {}))
  return out


def _placer(model):
  def place(arrays):
    rest = sorted(set(arrays) - {"tokens", "targets", "weights"})
    placed = train_step.place_batch(model, *(arrays[k] for k in ("tokens", "targets", "weights", *rest)))
    return placed[:3], dict(zip(rest, placed[3:]))

  return place


def _setup(devices, *, iterations=1, temperature=0.8, beta=0.0, top_k=None, lora=False):
  mesh = make_mesh((devices,), ("seq",))
  model = models.build(TINY, mesh=mesh, fsdp=devices > 1, rngs=nnx.Rngs(0))
  if lora:
    models.add_lora(model, rank=4, alpha=8.0)
  cfg = grpo.GRPOConfig(
    num_generations=3, max_completion_length=10, temperature=temperature, top_k=top_k, beta=beta,
    num_iterations=iterations, loss_type="grpo",
  )  # fmt: skip
  tok = tiny_tokenizer()
  prompts = _prompts([5, 9, 13, 7])
  loader = grpo.Prompts(prompts, [f"p.jsonl:{i + 1}" for i in range(4)], [], tok, cfg, batch=2, seed=3)
  reward = lambda prompts, completions, completion_ids, **kw: [float(len(c) % 4) for c in completion_ids]
  obj = grpo.GRPO(cfg, [("length", reward)], tok, seed=1)
  tx = train_step.make_tx(5e-2, 0, 8, 0.0, 1.0)
  trainer = train_step.Trainer(
    model, tx, chunk=16, objective=obj.loss, trainable=nnx.LoRAParam if lora else nnx.Param
  )
  place = _placer(model)
  obj.setup(trainer, loader, None, place=place)
  return obj, trainer, loader, place


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_the_trainers_log_probabilities_equal_the_samplers(devices):
  obj, trainer, loader, place = _setup(devices, top_k=40)
  arrays = obj.prepare(next(loader)[0])
  mask = arrays["weights"] > 0
  assert mask.sum() >= 12 and set(np.unique(arrays["completion"][mask])) == set(range(6))
  measure = dpo.Reference(
    trainer.graphdef, trainer.params, trainer.rest, trainer.plan, 16, grpo._token_measure
  )
  trained = measure(arrays, 0.8, place)
  assert np.abs(trained - arrays["old"])[mask].max() < 1e-5
  # The tokens are the sampler's: each completion's ids follow its prompt in its document.
  line = obj._buffer["lines"][0]
  assert line["completion_ids"] and line["step"] == 0 and line["prompt_index"] == loader.indices(0)[0]


@pytest.mark.parametrize("devices", [2])
def test_the_ratio_is_one_at_a_rollouts_first_iteration_and_not_at_its_second(devices):
  """num_iterations 2: step 0 samples; its importance ratio is 1 (the old
  log-probabilities are the sampler's, kept, equal to the policy's then); step 1 reuses
  the rollout after the update, where the ratio moved. Old log-probabilities taken after
  the update would give 1 at step 1 too."""
  obj, trainer, loader, place = _setup(devices, iterations=2, beta=0.04, lora=True)
  got = []
  for _ in range(3):
    arrays = obj.prepare(next(loader)[0])
    args, rows = place(arrays)
    value, stats = trainer.step(*args, **rows)
    got.append((obj._iteration, float(stats["log_ratio/max"]), float(stats["kl"])))
  (i0, r0, kl0), (i1, r1, kl1), (i2, r2, _) = got
  assert (i0, i1, i2) == (0, 1, 0)
  assert r0 < 1e-5 and r2 < 1e-5  # each fresh rollout: the policy is the sampler
  assert r1 > 1e-3
  assert kl0 < 1e-6 < kl1  # adapters off: the reference is the policy at first


def test_a_kept_rollout_is_read_back_for_its_next_iteration(tmp_path):
  obj, trainer, loader, place = _setup(1, iterations=2)
  arrays = obj.prepare(next(loader)[0])
  obj.resume(str(tmp_path), 0)
  obj.save(str(tmp_path), 1)  # mid-way: step 1 reuses step 0's rollout
  again, *_ = _setup(1, iterations=2)
  again.resume(str(tmp_path), 1)
  loader.restore({"step": 1})
  got = again.prepare(next(loader)[0])
  assert got.keys() == arrays.keys() and all(np.array_equal(got[k], arrays[k]) for k in arrays)
  assert again._buffer["lines"] == obj._buffer["lines"] and again._iteration == 1
  obj.save(str(tmp_path), 2)  # a rollout's iterations done: nothing kept
  assert not list(tmp_path.glob("grpo_rollout*"))
  with pytest.raises(ValueError, match="reuses the rollouts sampled at step 0"):
    fresh, *_ = _setup(1, iterations=2)
    fresh.resume(str(tmp_path), 1)
    fresh.prepare(next(loader)[0] | {"step": np.int64(1)})


# --- The run. ---


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return tiny_folder(tmp_path_factory)


REWARDS = """
import time

def slowly_short(prompts, completions, **kw):
  time.sleep(1.0)  # a rollout long enough for a signal to land mid-way through the run
  return short(prompts, completions)

def short(prompts, completions, **kw):
  return [1.0 if len(c) < 12 else 0.0 for c in completions]

def matches(prompts, completions, answer=None, **kw):
  return [None if a is None else float(a in (c if isinstance(c, str) else c[0]["content"]))
          for c, a in zip(completions, answer)]

def explode(prompts, completions, **kw):
  for p in prompts:
    if "boom" in str(p):
      raise RuntimeError("no reward for this one")
  return [0.0] * len(prompts)
"""


def _data(tmp_path, n=8, boom=False):
  rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(n)]
  rows += [{"prompt": [{"role": "user", "content": f"say {i}"}]} for i in range(2)]
  if boom:
    rows.append({"prompt": "boom", "answer": "0"})
  (tmp_path / "rewards_here.py").write_text(REWARDS)
  return write_jsonl(tmp_path / "prompts.jsonl", rows)


def _grpo_args(folder, data, out, rewards, *more):
  return [str(folder), "--data", str(data), "--objective", "grpo", "--num-generations", "3",
          "--max-completion-length", "12", "--devices", "2", "--lr", "1e-3", "--batch", "2",
          "--no-progress", "--out", str(out), *[x for r in rewards for x in ("--reward", r)],
          *more]  # fmt: skip


def test_grpo_run_writes_rollouts_and_trls_metrics(folder, tmp_path):
  import finetune as script

  data = _data(tmp_path)
  rewards = [f"{tmp_path}/rewards_here.py:short", f"{tmp_path}/rewards_here.py:matches"]
  out = tmp_path / "run"
  script.main(_grpo_args(folder, data, out, rewards, "--steps", "3", "--beta", "0.04", "--top-p", "0.95"))
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  names = {
    "loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/region_mean",
    "completions/mean_length", "completions/clipped_ratio", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "seconds/sampling", "seconds/training", "rewards/short/mean",
    "rewards/matches/mean", "grad_norm", "lr", "tokens",
  }  # fmt: skip
  assert [r["step"] for r in rows] == [0, 1, 2] and all(names <= set(r) for r in rows)
  assert all(r["sampling/sampling_logp_difference/max"] < 1e-5 for r in rows)
  assert all(0 <= r["completions/mean_length"] <= 12 for r in rows)
  lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
  assert len(lines) == 3 * 2 * 3
  fields = {
    "step",
    "prompt_index",
    "prompt",
    "completion",
    "completion_ids",
    "rewards",
    "reward",
    "advantage",
  }
  assert all(set(x) == fields for x in lines)
  for s in range(3):
    mine = [x for x in lines if x["step"] == s]
    assert np.mean([x["reward"] for x in mine]) == pytest.approx(rows[s]["reward"])
    # Advantages sum to 0 within each group of 3 completions of one prompt.
    for k in range(0, 6, 3):
      assert len({x["prompt_index"] for x in mine[k : k + 3]}) == 1
      assert abs(sum(x["advantage"] for x in mine[k : k + 3])) < 1e-9
  tok = tiny_tokenizer()
  for x in lines:
    assert tok.to_tokenizers().decode(x["completion_ids"], skip_special_tokens=True) == x["completion"]
    assert x["rewards"]["short"] == (1.0 if len(x["completion"]) < 12 else 0.0)
  report = json.loads((out / "report.json").read_text())
  assert report["config"]["num_generations"] == 3 and report["data"]["format"] == "prompt"
  # Going on with other rollouts is another run: refused, naming what differs.
  more = _grpo_args(folder, data, out, rewards, "--steps", "4", "--beta", "0.04", "--num-generations", "2")
  with pytest.raises(SystemExit, match="num_generations 3 -> 2"):
    script.main(more)


def test_a_reward_function_that_raises_stops_the_run_named_with_the_state_saved(folder, tmp_path):
  import finetune as script

  data = _data(tmp_path, n=3, boom=True)
  out = tmp_path / "run"
  args = _grpo_args(
    folder, data, out, [f"{tmp_path}/rewards_here.py:explode"], "--steps", "6", "--batch", "1"
  )
  prompts, where, _ = grpo.read_prompts(data, tiny_tokenizer())
  loader = grpo.Prompts(prompts, where, [], tiny_tokenizer(), grpo.GRPOConfig(num_generations=3), batch=1)
  boom = next(k for k in range(6) if loader.indices(k) == [5])  # the sixth record: "boom"
  with pytest.raises(
    SystemExit, match=r"reward function explode raised RuntimeError: .*prompts.jsonl:6"
  ) as e:
    script.main(args)
  assert "\n" not in str(e.value)
  state = json.loads((out / "data_state.json").read_text())
  assert state["step"] == boom and state["state"] == {"step": boom}
  assert sorted(int(p.name) for p in (out / "state").iterdir() if p.name.isdigit()) == [boom]


def test_grpo_refuses_what_it_cannot_take(folder, tmp_path):
  import finetune as script

  data = _data(tmp_path)
  with pytest.raises(SystemExit, match="needs --reward"):
    script.main([str(folder), "--data", str(data), "--objective", "grpo", "--out", str(tmp_path / "a")])
  with pytest.raises(SystemExit, match="no function nothing"):
    script.main(_grpo_args(folder, data, tmp_path / "a", [f"{tmp_path}/rewards_here.py:nothing"]))
  with pytest.raises(SystemExit, match="--loss-type sigmoid: --objective grpo takes"):
    script.main(
      _grpo_args(
        folder, data, tmp_path / "a", [f"{tmp_path}/rewards_here.py:short"], "--loss-type", "sigmoid"
      )
    )
  with pytest.raises(SystemExit, match="length=64: the longest prompt"):
    script.main(
      _grpo_args(folder, data, tmp_path / "a", [f"{tmp_path}/rewards_here.py:short"], "--length", "64")
    )
  texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}])
  with pytest.raises(SystemExit, match="no 'prompt' column"):
    script.main(_grpo_args(folder, texts, tmp_path / "a", [f"{tmp_path}/rewards_here.py:short"]))
  assert not (tmp_path / "a").exists()


def test_grpo_sigterm_resumes_with_the_uninterrupted_rollouts_and_losses(folder, tmp_path):
  """num_iterations 2 and a signal after step 1 (mid-way through a rollout's
  iterations): the resumed run reuses the kept rollout and samples the next with the same keys."""
  data = _data(tmp_path)
  rewards = [f"{tmp_path}/rewards_here.py:slowly_short"]
  more = ["--steps", "5", "--num-iterations", "2", "--lora-rank", "4", "--beta", "0.04", "--lr", "2e-2"]
  whole, out = tmp_path / "whole", tmp_path / "stopped"
  _finish(_child(_grpo_args(folder, data, whole, rewards, *more), 300), 300)
  expected = [r["loss"] for r in json.loads((whole / "report.json").read_text())["steps"]]
  child = _child(_grpo_args(folder, data, out, rewards, *more), 300)
  try:
    metrics = out / "metrics.jsonl"
    _wait_for(
      lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1, 240, "first step", child
    )
    child.send_signal(signal.SIGTERM)
  finally:
    output = _finish(child, 120)
  assert b"SIGTERM: saved the state at step" in output
  done = len((out / "metrics.jsonl").read_text().splitlines())
  assert done < 5
  _finish(_child(_grpo_args(folder, data, out, rewards, *more), 300), 300)
  got = [r["loss"] for r in json.loads((out / "report.json").read_text())["steps"]]
  assert got == expected and len(got) == 5
  assert (out / "rollouts.jsonl").read_text() == (whole / "rollouts.jsonl").read_text()
