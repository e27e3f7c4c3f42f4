"""Compiled for 8 x H100 and TPU slices on this CPU (deviceless AOT, `jax_ring.aot`,
`scripts/aot.py`): every ring-step loop, forward and backward, with either kernel, has
all of its compute under an asynchronous transfer; no ring permute is synchronous
(on a 64-chip slice thanks to `ring_mesh`); every Triton launch has a program per SM;
the defaults (kernel, heads per pass, tiles, policy) are the target's, not this host's.

These run in .venv-aot, which the test command sets up with the [aot] extra
(the CUDA plugin with ptxas, and jax[tpu]), each compile in its own process with a hard timeout.
"""

import functools
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from jax_ring.aot import attention_hidden

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("JAX_RING_AOT_PYTHON", str(ROOT / ".venv-aot" / "bin" / "python"))
TIMEOUT = 400  # seconds per compile process; subprocess.run kills it (SIGKILL) past that
# 8K tokens a device at 8 devices (the tile sizes of real runs), heads fewer than
# Llama-3-8B's so each compile takes seconds.
SHAPE = ["--seq-len=65536", "--heads=8", "--kv-heads=2", "--head-dim=128"]


def _process(python: str, args: list[str]) -> subprocess.CompletedProcess:
  """`python args` from the checkout, without the tests' XLA flags, killed past TIMEOUT."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
  return subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _run(args: list[str]) -> str:
  if not Path(PYTHON).exists():
    pytest.fail(f"{PYTHON} is missing: run the tests with `bash scripts/run_tests.sh`, which makes .venv-aot")
  done = _process(PYTHON, args)
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


def aot(*args: str) -> dict:
  return json.loads(_run(["scripts/aot.py", "--json", *args]).strip().splitlines()[-1])


def _all_overlapped(report):
  """Every ring step, forward and backward: its transfers asynchronous (no "is_sync"),
  all its compute under them, and compute under each (nothing exposed). A loop over
  head groups holds each backward pass's edges: its first K/V transfer and the send of
  the last pass's dK/dV home, each under one half of the local K/V's compute
  (`_ring.OwnHalves`). There nothing is exposed either, and all its compute runs under
  a transfer but, with Mosaic, one kernel: the last half's dq kernel, after the dK/dV
  one that covers the send (v5p and v6e)."""
  steps = report["ring_steps"]
  names = {s["name"] for s in steps}
  assert (
    {"forward ring step", "backward ring step"}
    <= names
    <= {"forward ring step", "backward ring step", "backward ring pass edges"}
  ), steps
  auto = "cudnn" if report["target"].startswith("h100") else "pallas"
  assert report["kernel_resolved"] == (report["kernel"] if report["kernel"] != "auto" else auto)
  mosaic = report["target"].startswith("v") and report["kernel_resolved"] == "pallas"
  for step in steps:
    assert step["synchronous"] == 0 and step["exposed"] == 0 and step["exposed_bytes"] == 0, step
    if step["name"].endswith("ring step") or not mosaic:
      assert step["overlapped"], step
    else:
      assert step["hidden_bytes"] > 0 and step["compute"] - step["hidden"] <= 1, step


@pytest.mark.parametrize("kernel", ["xla", "pallas", "cudnn"])
def test_h100x8_overlaps_every_ring_step_and_fills_the_sms(kernel):
  """With "cudnn", cuDNN's fused attention compiles for 8 x H100 here (its custom calls,
  forward and backward, in the program; without cuDNN's library XLA keeps their
  workspace at 0 bytes, so their memory is not in temp_mib) and its ring steps overlap
  as the kernels' do."""
  report = aot("--target=h100x8", f"--kernel={kernel}", *SHAPE)
  _all_overlapped(report)
  calls = report["custom_calls"]
  cudnn = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
  assert (cudnn <= set(calls)) == (kernel == "cudnn"), calls
  if kernel == "pallas":
    grids = report["launch_grids"]
    assert set(grids) == {"jax_ring_forward", "jax_ring_backward_dq", "jax_ring_backward_dkv"}, grids
    # 8 query heads a pass (2 kv heads: 32K tokens a pass on GPU) x 8192 / 128 query
    # blocks in the forward, x 8192 / 64 query or key blocks in the backward (the
    # H100-timed launches of bf16 at H=128), x 4096 / 64 for the dK/dV of a half of
    # the local keys (`_ring.OwnHalves`, the smallest launch): at least one program per
    # SM (132) in every launch.
    expected = {"jax_ring_forward": 512, "jax_ring_backward_dq": 1024, "jax_ring_backward_dkv": 512}
    assert grids == expected, grids
  # K, V (bf16) around the ring forward and backward, dK, dV (float32) backward and
  # home: 7 steps each way of 2 x 8192 x 2 x 128 x 2 bytes, ...; checked as a bound.
  kv_step = 2 * 8192 * 2 * 128 * 2
  assert report["collective_bytes"]["collective-permute"] >= 14 * kv_step, report["collective_bytes"]
  assert report["temp_mib"] < 1024, report["temp_mib"]


# Compiled for 8 x H100 in .venv-aot: the ring's forward+backward with kernel="cudnn"
# under a causal window and documents (one program, to compile once); prints each cuDNN
# custom call's backend settings that carry them (sliding_window_length,
# max_seg_per_batch) and its count.
_MASKED_CUDNN = """
import os, json, re, collections
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_ring import aot, _ring
from jax_ring._attention import ring_attention
mesh = aot.target_mesh("h100x8")
t = 8 * 2048
q, k, v = aot.attention_inputs(mesh, seq_len=t, heads=4, kv_heads=2, head_dim=128)
ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=NamedSharding(mesh, P(None, "seq")))
def step(q, k, v, ids):
  f = lambda q, k, v: ring_attention(
    q, k, v, mesh=mesh, is_causal=True, kernel="cudnn", local_window_size=(512, 0), layout="contiguous",
    segment_ids=ids,
  )
  out, vjp = jax.vjp(f, q, k, v)
  return vjp(out)
with jax.set_mesh(mesh):
  text = jax.jit(step).lower(q, k, v, ids).compile().as_text()
calls = collections.Counter()
for line in text.splitlines():
  target = re.search('custom_call_target="(__cudnn.fmha[A-Za-z]+)"', line)
  if target:
    window = re.search('"sliding_window_length": ([0-9]+)', line).group(1)
    segs = re.search('"max_seg_per_batch": ([0-9]+)', line).group(1)
    calls[f"{target.group(1)} window={window} segs={segs}"] += 1
print(json.dumps(dict(found=dict(calls), max_documents=_ring.MAX_DOCUMENTS)))
"""


def test_h100x8_cudnn_calls_carry_the_window_and_the_documents():
  """The ring with a window of 512 and documents compiles for 8 x H100 to cuDNN calls
  that carry them, forward and backward: on the diagonal a sliding window of 513 (512
  keys back and the query's own) over packed calls of MAX_DOCUMENTS sequences; on a
  step whose keys are all earlier, no window over a packed call of 2 (its one shared
  document); no call without the documents."""
  report = json.loads(_run(["-c", _MASKED_CUDNN]).strip().splitlines()[-1])
  found, most = report["found"], report["max_documents"]
  for call in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"):
    assert f"{call} window=513 segs={most}" in found, found
    assert f"{call} window=0 segs=2" in found, found
  assert not any(k.endswith("segs=1") for k in found), found


def test_document_bound_compiles_the_packed_rows_ring_with_fewer_passes():
  """`aot.py --document-bound 1024` on 8 x H100 at 16,384 tokens (zig-zag chunks of
  1,024: one pass each way, not 7): the ids travel in, and the program's
  collective-permute bytes (the relayouts and passes, forward and backward) fall below
  half the unbounded program's; `--document-bound auto` reports each branch's bytes;
  the bound needs ring attention alone. Each pass of one transfer stays a loop
  (`_ring._steps`), with its compute under its transfer."""
  shape = [
    "--target=h100x8",
    "--kernel=xla",
    "--seq-len=16384",
    "--heads=8",
    "--kv-heads=2",
    "--head-dim=128",
  ]
  every = aot(*shape)["collective_bytes"]["collective-permute"]
  bounded = aot(*shape, "--document-bound=1024")
  assert bounded["document_bound"] == 1024
  assert bounded["collective_bytes"]["collective-permute"] < every / 2, (bounded["collective_bytes"], every)
  # One transfer each way, each pass still a loop with its compute under the transfer.
  steps = sorted(s["name"] for s in bounded["ring_steps"])
  assert steps == ["backward ring step", "forward ring step"] and attention_hidden(bounded), bounded
  assert "all-gather" in bounded["collective_bytes"]  # the check's ids, gathered over the ring
  # "auto": the forward and the backward each a switch over one chunk each way, two, and
  # the whole ring; its costliest branch moves what every pass does, and the ids that
  # travel with the K/V (4 bytes a token beside K's and V's 1,024).
  auto = aot(*shape, "--document-bound=auto")
  branches = [[b["collective-permute"] for b in found] for found in auto["branch_collective_bytes"]]
  assert len(branches) == 2 and all(len(b) == 3 and b == sorted(set(b)) for b in branches), branches
  assert every < auto["collective_bytes"]["collective-permute"] < every * 1.005
  assert sum(b[0] for b in branches) < sum(b[-1] for b in branches) / 2, branches
  done = _process(PYTHON, ["scripts/aot.py", "--model", "--train", "--document-bound=1024"])
  assert done.returncode == 2 and "--document-bound compiles ring attention alone" in done.stderr


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_v5e_2x4_overlaps_every_ring_step(kernel):
  report = aot("--target=v5e:2x4", f"--kernel={kernel}", *SHAPE)
  _all_overlapped(report)
  calls = report["custom_calls"]
  assert ("tpu_custom_call" in calls) == (kernel == "pallas"), calls
  assert report["collective_bytes"]["collective-permute"] > 0  # TPU loops' trip counts are read


def test_v5e_8x8_needs_ring_mesh():
  """64 chips: jax.make_mesh's row-major order gives synchronous ring permutes (read
  in the forward, which compiles in half the time); ring_mesh's cycle through linked
  chips gives asynchronous, overlapped ones, forward and backward."""
  row_major = aot("--target=v5e:8x8", "--kernel=xla", "--make-mesh", "--forward-only", *SHAPE)
  assert any(step["synchronous"] for step in row_major["ring_steps"]), row_major["ring_steps"]
  _all_overlapped(aot("--target=v5e:8x8", "--kernel=xla", *SHAPE))


@pytest.mark.slow
def test_ring_mesh_overlaps_every_ring_step_on_the_256_chip_slice():
  """ring_mesh on v5e:16x16 with the XLA tiles (4K tokens a chip: the 256-chip slice
  compiles slowest): no synchronous ring permute, and every ring step's compute,
  forward and backward, under its transfer. v5p's 64-chip torus and v6e are read with
  the Mosaic kernels, below (the XLA tiles on an 8-chip slice: v5e:2x4, above)."""
  _all_overlapped(aot("--target=v5e:16x16", "--kernel=xla", f"--seq-len={4096 * 256}", *SHAPE[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5p:4x4x4", "v6e:2x4"])
def test_mosaic_kernels_overlap_and_split_over_tensorcores(target):
  """The Pallas (Mosaic) kernels on v5p and v6e: every ring step's compute under its
  transfer (XLA's TPU scheduler starts a transfer as late as its estimate of the
  transfer's time allows; the forward step ends with its kernel, the merge of the
  previous step's result before it, so the kernel lies under the transfer), and
  every kernel's grid, read back from the compiled program, has parallel axes with
  many programs for a megacore chip (v5p: two TensorCores) to split."""
  devices = {"v5p:4x4x4": 64, "v6e:2x4": 8}[target]
  per_chip = {"v5p:4x4x4": 4096, "v6e:2x4": 8192}[target]  # the 64-chip slice compiles slowest
  report = aot(f"--target={target}", "--kernel=pallas", f"--seq-len={per_chip * devices}", *SHAPE[1:])
  _all_overlapped(report)
  grids = report["tpu_grids"]
  assert set(grids) == {"jax_ring_tpu_forward", "jax_ring_tpu_backward_dq", "jax_ring_tpu_backward_dkv"}, (
    grids
  )
  for name, grid in grids.items():
    split = [n for n, parallel in zip(grid["bounds"], grid["parallel"]) if parallel]
    # 4096 or 8192 tokens / 128-row blocks: 32 or 64 blocks on a parallel axis at
    # least, half that for the dK/dV of a half of the local keys (`_ring.OwnHalves`,
    # the smallest grid); the innermost axis (the accumulation) sequential.
    least = per_chip // (256 if name == "jax_ring_tpu_backward_dkv" else 128)
    assert max(split) >= least and grid["parallel"][-1] is False, (name, grid)


DEFAULTS = """
import os, sys, json
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax_ring import aot, BlockSizes, choose_kernel, policy_for
from jax_ring._mesh import traced_device
from jax_ring._tiles import local_blocks, mesh_platform
found = {}
for name in ("h100x8", "v5e:2x4"):
  mesh = aot.target_mesh(name)
  def inner(x, name=name):
    platform = mesh_platform()
    found[name] = dict(
      platform=platform,
      pass_tokens=BlockSizes().tokens_per_pass(),
      blocks=local_blocks(8192, BlockSizes(), devices=8)[1:],
      kernel=choose_kernel(
        "auto", platform, 128, policy_for(traced_device()), device_kind=traced_device().device_kind
      ).kernel,
      policy=str(policy_for(traced_device()).compute_dtype),
    )
    return x
  spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("seq")))
  jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("seq"), out_specs=P("seq"))).lower(spec)
print(json.dumps(found))
"""


def test_defaults_come_from_the_target_not_this_cpu():
  found = json.loads(_run(["-c", DEFAULTS]).strip().splitlines()[-1])
  assert found["h100x8"] == {
    "platform": "gpu",
    "pass_tokens": 32768,
    "blocks": [1024, 512],
    "kernel": "cudnn",
    "policy": "bfloat16",
  }, found
  assert found["v5e:2x4"] == {
    "platform": "tpu",
    "pass_tokens": 4096,
    "blocks": [1024, 512],
    "kernel": "pallas",
    "policy": "bfloat16",
  }, found


def test_max_length_bisects_compiled_memory():
  """--max-length: the longest sequence (a multiple of 128K tokens, up to 512K) whose
  compiled program fits 0.8 GiB per device; the next multiple does not (the forward,
  which compiles in half the time: the bisection is the same). The report is the
  bisection's own program of that length, not a second compile, and lists what each
  length tried used."""
  options = ["--target=h100x8", "--kernel=xla", "--forward-only", *SHAPE[1:], "--budget-gib=0.8"]
  options.append("--granularity=131072")
  report = aot(*options, "--max-length", "--upper=524288")
  longest, tried = report["max_length"], report["tried"]
  assert 131072 <= longest < 524288 and longest % 131072 == 0, report
  used = (report["temp_mib"] + report["argument_mib"] + report["output_mib"]) / 1024
  assert used <= 0.8 and abs(tried[str(longest)]["used_gib"] - used) < 1e-6, report
  assert tried[str(longest + 131072)]["used_gib"] > 0.8, tried
  assert all((v["used_gib"] <= 0.8) == (int(k) <= longest) for k, v in tried.items()), tried


@pytest.mark.slow
def test_training_step_of_a_named_model_on_h100x8():
  """--model qwen3-0.6b --train at 32K tokens on 8 x H100: one whole AdamW step with
  FSDP, remat and the vocabulary rings compiles, reports its memory (the peak is
  arguments + outputs - aliased + temporaries, the donated state aliased) and fits;
  every ring step of the attention (the 28 layers scanned: one body), forward and
  backward, and of the loss has its transfers under compute; the layer inputs kept for
  the backward pass are held once; the weights are all-gathered and no
  collective moves the whole vocabulary table (151,936 x 1,024 float32: 594 MiB)."""
  report = aot("--target=h100x8", "--model=qwen3-0.6b", "--train", "--seq-len=32768")
  m = report["memory"]
  assert m["peak_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
  assert m["alias_bytes"] > 0.9 * m["output_bytes"] and report["fits"] is True
  # Weights and AdamW moments in float32, split 8 ways: 12 bytes a parameter / 8. Qwen3-0.6B:
  # 28 layers of q, k, v, o (1024 x 2048, 1024 x 1024 twice, 2048 x 1024), the MLP (3 x
  # 1024 x 3072) and norms (2 x 1024, 2 x 128), the tied embedding 151,936 x 1,024, a norm.
  layer = 1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
  params = 28 * layer + 151_936 * 1024 + 1024
  assert abs(m["argument_bytes"] - params * 12 / 8) < 2**20
  # The attention's ring steps; the vocabulary's rings are "ring loop"s.
  # The scan over layers holds a layer's backward with the ring pass's edges: there the
  # FSDP gathers and reductions run beside compute no transfer needs.
  attention = [s for s in report["ring_steps"] if s["name"].endswith(("ring step", "ring pass edges"))]
  names = {s["name"] for s in attention}
  assert {"forward ring step", "backward ring step", "backward ring pass edges"} <= names, names
  for step in attention:
    assert step["synchronous"] == 0 and step["exposed"] == 0 and step["exposed_bytes"] == 0, step
    assert step["hidden_bytes"] > 0, step
  vocabulary = [s for s in report["ring_steps"] if s not in attention]
  assert {s["name"] for s in vocabulary} <= {"forward ring loop", "backward ring loop"}
  # The loss's rings (a shard's logits per step: GEMMs) have their transfers under them,
  # the backward's bundled shard and gradient too; the lookup's have no GEMM.
  loss = [s for s in vocabulary if s["compute"] > 0]
  assert {s["name"] for s in loss} == {"forward ring loop", "backward ring loop"}, vocabulary
  for step in loss:
    assert step["synchronous"] == 0 and step["exposed"] == 0 and step["hidden_bytes"] > 0, step
  # The layer inputs kept for the backward pass (28 x 4,096 tokens x 1,024, bfloat16) are
  # held once: no copy outside the layers' loop puts the stack in a second layout.
  stack = 28 * 4096 * 1024 * 2
  assert all(size < stack for _, size in report["large_copies"]), report["large_copies"]
  ops = report["collectives"]
  assert sum(c["op"] == "all-gather" for c in ops) >= 2  # a layer's weights, forward and backward (combined)
  assert max(c["bytes"] for c in ops) < 151_936 * 1024 * 4
  # The weights' gradients go back to their shards by reduce-scatter (a layer's, in
  # bfloat16, at once); the only all-reduces are the loss's scalar sums.
  assert max(c["bytes"] for c in ops if c["op"] == "reduce-scatter") >= 2 * (layer - 2 * 1024 - 2 * 128)
  assert all(c["bytes"] <= 64 for c in ops if c["op"] == "all-reduce"), ops


def test_llama_8b_step_holds_its_weights_and_moments_split_8_ways():
  """--model llama-3.1-8b --train with one block (--layers 1) at 8K tokens on 8 x H100:
  the step's per-device arguments are the float32 weights and both AdamW moments / 8
  (the untied embedding and head, 128,256 x 4,096 each, split too) plus the batch; it
  fits, and the loss's ring has its transfers under its GEMMs."""
  report = aot("--target=h100x8", "--model=llama-3.1-8b", "--train", "--layers=1", "--seq-len=8192")
  m = report["memory"]
  # q and o (4,096 x 4,096), k and v (4,096 x 1,024), the MLP (3 x 4,096 x 14,336), two
  # norms; the embedding and the head (128,256 x 4,096 each) and the final norm.
  layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
  params = layer + 2 * 128_256 * 4096 + 4096
  batch = 8192 // 8 * (4 + 4 + 4)  # tokens, targets, weights: a device's eighth
  assert abs(m["argument_bytes"] - params * 12 / 8 - batch) < 2**16, (m["argument_bytes"], params * 12 / 8)
  assert report["fits"] is True
  loss = [s for s in report["ring_steps"] if s["name"].endswith("ring loop") and s["compute"] > 0]
  assert loss and all(s["exposed"] == 0 and s["synchronous"] == 0 for s in loss), loss


ADAPTER_STEP = ["--target=h100x1", "--model=llama-3.1-8b", "--train", "--layers=1", "--seq-len=8192"]
ADAPTER_STEP += ["--lora-rank=16", "--param-dtype=bfloat16"]


@functools.cache
def _adapter_step() -> dict:
  """Llama-3.1-8B's adapter step of one block at 8K tokens on one H100, compiled once
  for the tests that read it."""
  return aot(*ADAPTER_STEP)


@pytest.mark.xdist_group("llama_adapter")  # one worker: the adapter step compiles once
def test_llama_8b_adapter_step_on_one_h100_holds_the_bf16_base_and_no_base_optimizer_state():
  """--model llama-3.1-8b --train --lora-rank 16 --param-dtype bfloat16 --target h100x1
  with one block at 8K tokens: the arguments are the bfloat16 base (2 bytes a weight,
  whole on the one device), the float32 adapters on all seven projections with both
  AdamW moments (12 bytes an adapter weight), and the batch: no base-sized gradient or
  optimizer state."""
  report = _adapter_step()
  layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
  base = layer + 2 * 128_256 * 4096 + 4096
  # A [in, 16] and B [16, out] of q, k, v, o, gate, up, down.
  adapters = 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096))
  batch = 8192 * (4 + 4 + 4)
  expected = base * 2 + adapters * 12 + batch
  assert abs(report["memory"]["argument_bytes"] - expected) < 2**16, (
    report["memory"]["argument_bytes"],
    expected,
  )
  assert report["fits"] is True


@pytest.mark.xdist_group("llama_adapter")  # one worker: the adapter step compiles once
def test_llama_8b_dpo_adapter_step_takes_a_pair_and_its_reference():
  """--objective dpo: the adapter step of one block at 8K tokens (a pair of two 4K
  sequences) takes, beside the adapter step's arguments, the pair's segment ids and
  positions and the two reference log-probabilities; its loss is the pair's."""
  sft, dpo = _adapter_step(), aot(*ADAPTER_STEP, "--objective=dpo")
  extra = 8192 * (4 + 4) + 2 * 4
  assert dpo["memory"]["argument_bytes"] - sft["memory"]["argument_bytes"] == extra
  assert dpo["memory"]["fits"] is True


@pytest.mark.xdist_group("llama_adapter")  # one worker: the adapter step compiles once
def test_llama_8b_grpo_adapter_step_takes_each_tokens_old_reference_and_advantage():
  """--objective grpo: the adapter step of one block on one completion of 8K tokens
  takes, beside the adapter step's arguments, the row's segment ids and positions and
  per token the old and the reference log-probabilities and the advantage (TRL's
  default loss, dapo, needs no completion numbers: the compiler drops them); it fits."""
  sft, grpo = _adapter_step(), aot(*ADAPTER_STEP, "--objective=grpo")
  extra = 8192 * 4 * 5
  assert grpo["memory"]["argument_bytes"] - sft["memory"]["argument_bytes"] == extra
  assert grpo["memory"]["fits"] is True


def test_moe_step_splits_its_experts_8_ways_and_drops_no_token():
  """--model qwen3-30b-a3b --train with one block at 8K tokens on 8 x H100: the
  arguments are the float32 weights (the 128 experts' stacks and the router included)
  and both AdamW moments / 8 plus the batch, and no token is dropped (no capacity)."""
  report = aot("--target=h100x8", "--model=qwen3-30b-a3b", "--train", "--layers=1", "--seq-len=8192")
  # q (2,048 x 32 x 128), k and v (2,048 x 4 x 128), o; q/k norms, two norms; the router
  # (2,048 x 128) and the experts (3 x 128 x 2,048 x 768); embedding, head, final norm.
  layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 2048 * 128 + 3 * 128 * 2048 * 768
  params = layer + 2 * 151_936 * 2048 + 2048
  batch = 8192 // 8 * (4 + 4 + 4)
  assert abs(report["memory"]["argument_bytes"] - params * 12 / 8 - batch) < 2**16
  assert report["dropped_tokens"] == 0


def test_moe_step_with_capacity_runs_no_product_over_every_expert_and_hides_its_all_to_alls():
  """Qwen3-30B-A3B's offloaded step with --capacity-factor 1.25 (2 of 48 layers, 32K
  tokens) on 8 x H100: each expert's buffer holds ceil(1.25 x 4,096 x 8 / 128) = 320 of
  a device's tokens; the step's temporaries stay below one dense product over every
  expert (the 32,768 pairs x 128 experts x 768 in bfloat16, 6 GiB, which the dropless
  path's `ragged_dot` lowers to on GPUs: 57.7 GiB of temporaries); the experts stay
  split over the devices; and expert parallelism's buffers travel in pieces while the
  experts run on other pieces, so at most an eighth of the all-to-alls' bytes (the
  first piece sent and the last one back, in each pass) run with nothing under them
  (sent whole, every forward one did)."""
  report = aot(
    "--target=h100x8",
    "--model=qwen3-30b-a3b",
    "--train",
    "--layers=2",
    "--seq-len=32768",
    "--remat=offload",
    "--capacity-factor=1.25",
  )
  assert report["capacity"] == {"factor": 1.25, "group_tokens": 4096, "per_expert": 320}
  assert report["memory"]["temp_bytes"] < 32768 * 128 * 768 * 2
  # Expert parallelism at this length: the experts' rows go by all-to-all, and no
  # expert stack (128 x 2,048 x 768, 384 MiB in bfloat16) is ever gathered.
  gathers = [c["bytes"] for c in report["collectives"] if c["op"] == "all-gather"]
  assert gathers and max(gathers) < 128 * 2048 * 768 * 2, gathers
  assert "dropped_tokens" not in report  # counted by each step, not known when compiling
  # The [128, 320, 2,048] buffers travel in 8 pieces of 40 slots (20 MiB in bfloat16),
  # there and back in the forward, its recomputation and the backward: 48 pieces in
  # the layers' loop body, 6 E C D a layer in all.
  moved = [c for c in report["collectives"] if c["op"] == "all-to-all"]
  assert [c["bytes"] for c in moved] == [128 * 40 * 2048 * 2] * 48, moved
  assert report["collective_bytes"]["all-to-all"] == 2 * 6 * 128 * 320 * 2048 * 2
  exposed = sum(c["bytes"] for c in moved if c["exposed"])
  assert exposed <= sum(c["bytes"] for c in moved) / 8, [c["exposed"] for c in moved]


_OFFLOAD_OPTIONS = """
import json, jax
from jax_ring import aot
from jax_ring.models.train import step as train_step
seen = []
compile = jax.stages.Lowered.compile
def spy(self, compiler_options=None, **kwargs):
  seen.append(compiler_options)
  # XLA:GPU's compile with the options (which refuses a name it does not know); without
  # any, nothing is left to check.
  return compile(self, compiler_options=compiler_options, **kwargs) if compiler_options else None
jax.stages.Lowered.compile = spy
mesh, device = aot.target_mesh("h100x8"), aot.target("h100x8").memory_bytes
for remat in ("offload", "full"):
  train_step.compile_train_step("qwen3-0.6b", mesh, seq_len=16384, layers=1, remat=remat, device_bytes=device)
print(json.dumps({"options": seen, "device": device}))
"""


def test_moe_step_runs_its_expert_traffic_under_compute():
  """Qwen3-30B-A3B's offloaded step (2 of 48 layers, 262,144 tokens, capacity 1.25,
  experts gathered) on 8 x H100: in the layer loops each expert stack's all-gather
  (3 x 384 MiB a layer, forward and backward: each gathered a layer ahead) and its
  gradients' reduce-scatter (3 x 384 MiB) has compute under it, and each layer's input
  comes back from host memory a layer ahead."""
  report = aot(
    "--target=h100x8",
    "--model=qwen3-30b-a3b",
    "--train",
    "--layers=2",
    "--seq-len=262144",
    "--remat=offload",
    "--capacity-factor=1.25",
  )
  experts = [
    c
    for c in report["collectives"]
    if c["op"] in ("all-gather", "reduce-scatter") and c["where"] and c["bytes"] >= 256 * 2**20
  ]
  sizes = sorted((c["op"], c["bytes"] // 2**20) for c in experts)
  assert sizes == [("all-gather", 384)] * 6 + [("reduce-scatter", 384)] * 3, sizes
  assert not [c for c in experts if c["exposed"]], experts
  back = [h for h in report["host_transfers"] if h["direction"] == "from host"]
  assert back and all(h["prefetched"] and h["compute"] > 0 for h in back), back


def test_tpu_step_runs_its_all_to_alls_asynchronously_under_the_experts():
  """Qwen3-30B-A3B's step with expert parallelism (one layer, 2,048 tokens on the 8
  chips of a v5p:2x2x2, 256 a chip, 20 slots an expert) compiles with
  `train.step.TPU_COMPILER_OPTIONS`: XLA:TPU then runs the all-to-alls of the 8
  pieces asynchronously with the experts' compute under them (at most an eighth of
  their bytes exposed), where without them it runs every one synchronously (all 48
  exposed, read on this slice; on a v5p:4x4x4 at 16,384 tokens too)."""
  report = aot(
    "--target=v5p:2x2x2",
    "--model=qwen3-30b-a3b",
    "--train",
    "--layers=1",
    "--seq-len=2048",
    "--capacity-factor=1.25",
  )
  assert report["capacity"]["per_expert"] == 20
  moved = [c for c in report["collectives"] if c["op"] == "all-to-all"]
  assert len(moved) == 48, moved
  exposed = sum(c["bytes"] for c in moved if c["exposed"])
  assert exposed <= sum(c["bytes"] for c in moved) / 8, [c["exposed"] for c in moved]


def test_attention_hidden_asks_every_attention_ring_transfer_and_no_other():
  """`aot.attention_hidden` (what `aot.py --max-length --hidden` bisects on): true when
  each attention ring loop is asynchronous with nothing exposed; the vocabulary's ring
  loops do not count; a program without attention ring loops is not "hidden"."""
  from jax_ring import aot as aot_module

  step = lambda name, sync=0, exposed=0: {"name": name, "synchronous": sync, "exposed": exposed}
  lookup = step("forward ring loop", exposed=1)
  good = [step("forward ring step"), step("backward ring step"), step("backward ring pass edges"), lookup]
  assert aot_module.attention_hidden({"ring_steps": good})
  assert not aot_module.attention_hidden({"ring_steps": [*good, step("backward ring step", sync=1)]})
  assert not aot_module.attention_hidden({"ring_steps": [*good, step("backward ring pass edges", exposed=2)]})
  assert not aot_module.attention_hidden({"ring_steps": [lookup]})
  # `aot.transfers_hidden` (what `--hidden` bisects on) asks the host copies too.
  copy = lambda direction, compute=3, prefetched=False: dict(
    direction=direction, compute=compute, prefetched=prefetched
  )
  copies = [copy("to host"), copy("from host", prefetched=True)]
  assert aot_module.transfers_hidden({"ring_steps": good, "host_transfers": copies})
  assert aot_module.transfers_hidden({"ring_steps": good})
  assert not aot_module.transfers_hidden({"ring_steps": [lookup], "host_transfers": copies})
  for bad in (copy("from host"), copy("from host", 0, True), copy("to host", 0)):
    assert not aot_module.transfers_hidden({"ring_steps": good, "host_transfers": [*copies, bad]}), bad


def test_offloaded_step_raises_the_schedulers_memory_limit_by_the_host_bytes():
  """With remat "offload" the step compiles for a GPU with XLA's scheduler limit
  raised by the layer inputs kept in host memory (the scheduler counts them as device
  memory: at 4M tokens Llama-3.1-8B's backward ring steps ran synchronously without
  it) to the device plus 8 x the host bytes, with 8 collectives in flight at once.
  Without offload, XLA's defaults. Qwen3-0.6B with one block at 16K tokens on 8 x
  H100: 2,048 tokens a device x 1,024 x 2 bytes in host memory."""
  found = json.loads(_run(["-c", _OFFLOAD_OPTIONS]).strip().splitlines()[-1])
  device, host = found["device"], 1 * 2048 * 1024 * 2
  factor = math.ceil(100 * (device + 8 * host) / device)
  limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
  assert found["options"] == [{"xla_gpu_memory_limit_slop_factor": factor, limit: 8}, None]


def test_offloaded_layer_inputs_live_in_host_memory():
  """--remat offload: the step keeps each layer's input in host memory, exactly the
  stack of the layers' inputs (2 layers x 2,048 tokens a device x 4,096 in bfloat16),
  and it still fits. The backward pass copies each layer's input back one layer ahead:
  the copy runs under the compute of the layer before it in the backward, and the
  iteration only carries its result to the next, which reads it."""
  report = aot(
    "--target=h100x8", "--model=llama-3.1-8b", "--train", "--layers=2", "--seq-len=16384", "--remat=offload"
  )
  assert report["memory"]["host_temp_bytes"] == 2 * 16384 // 8 * 4096 * 2
  assert report["fits"] is True
  layer = 16384 // 8 * 4096 * 2
  back = [h for h in report["host_transfers"] if h["direction"] == "from host"]
  out = [h for h in report["host_transfers"] if h["direction"] == "to host"]
  assert [h["bytes"] for h in out] == [layer] and out[0]["compute"] > 0, out
  assert [h["bytes"] for h in back] == [layer], back
  assert all(h["prefetched"] and h["compute"] > 0 for h in back), back


SCHEDULED = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %buf = f32[8]{0} custom-call(), custom_call_target="AllocateBuffer"
  %cps = (f32[8]{0}, f32[8]{0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call"
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %late = f32[8]{0} custom-call(%cpd), custom_call_target="tpu_custom_call"
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]) tuple(%i, %late)
}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]) parameter(0)
  ROOT %w = (s32[], f32[8]) while(%a), condition=%cond, body=%body
}
"""


HOST_COPIES = """
%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[1,8]) {
  %p = (s32[], bf16[4,8]{1,0:S(5)}) parameter(0)
  %stack = bf16[4,8]{1,0:S(5)} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  %in = ((bf16[4,8]{1,0:S(5)}, s32[]), bf16[1,8]{1,0}, u32[]) fusion-start(%stack, %i), calls=%ds
  %e = bf16[1,8]{1,0} add(%i, %i)
  %back = bf16[1,8]{1,0} fusion-done(%in)
  %k = bf16[1,8]{1,0} custom-call(%back), custom_call_target="__cublas$gemm"
  %out = ((bf16[4,8]{1,0:S(5)}, bf16[1,8]{1,0}, s32[]), bf16[4,8]{1,0:S(5)}, u32[]) fusion-start(%stack, \
%k, %i), calls=%dus
  %k2 = bf16[1,8]{1,0} custom-call(%k), custom_call_target="__cublas$gemm"
  %gone = bf16[4,8]{1,0:S(5)} fusion-done(%out)
  ROOT %t = (s32[], bf16[1,8]) tuple(%i, %k2)
}

ENTRY %main (a: (s32[], bf16[4,8])) -> (s32[], bf16[1,8]) {
  %a = (s32[], bf16[4,8]) parameter(0)
  ROOT %w = (s32[], bf16[1,8]) while(%a), condition=%cond, body=%body
}
"""


def test_host_transfers_reads_each_copy_and_the_compute_under_it():
  """hlo.host_transfers: in a loop body, the copy back from host memory (a slice of the
  S(5) stack) with only elementwise work before its done has no compute under it; the
  copy out (an update of the stack) has the GEMM issued before its done; sizes are the
  device-side arrays'."""
  from jax_ring.hlo import host_transfers

  found = host_transfers(HOST_COPIES)
  assert [(h.direction, h.bytes, h.compute, h.prefetched) for h in found] == [
    ("from host", 16, 0, False),
    ("to host", 16, 1, False),
  ]
  # Started here and waited for in the next iteration: prefetched.
  ahead = HOST_COPIES.replace("  %back = bf16[1,8]{1,0} fusion-done(%in)\n", "")
  found = [(h.direction, h.prefetched) for h in host_transfers(ahead)]
  assert found == [("to host", False), ("from host", True)]
  # Waited for here, but only carried to the next iteration, which reads it: prefetched.
  carried = HOST_COPIES.replace("custom-call(%back)", "custom-call(%e)")
  carried = carried.replace("tuple(%i, %k2)", "tuple(%i, %k2, %back)")
  found = [(h.direction, h.prefetched) for h in host_transfers(carried)]
  assert found == [("from host", True), ("to host", False)]
  # Read here as well as carried: not.
  both = HOST_COPIES.replace("tuple(%i, %k2)", "tuple(%i, %k2, %back)")
  assert [(h.direction, h.prefetched) for h in host_transfers(both)] == [
    ("from host", False),
    ("to host", False),
  ]


def test_loop_free_copies_reads_copies_and_transposes_outside_loops():
  """hlo.loop_free_copies: a transpose fusion and a copy in the entry are listed with
  their result bytes; a copy inside the loop body and an add fusion are not."""
  from jax_ring.hlo import loop_free_copies

  fused = (
    "%fused_t (q: f32[8,4]) -> f32[4,8] {\n  %q = f32[8,4]{1,0} parameter(0)\n"
    "  ROOT %tr = f32[4,8]{1,0} transpose(%q), dimensions={1,0}\n}\n\n"
    "%fused_add (r: f32[8]) -> f32[8] {\n  %r = f32[8]{0} parameter(0)\n"
    "  ROOT %s = f32[8]{0} add(%r, %r)\n}\n\n"
  )
  entry = (
    "  %m = f32[8,4]{1,0} parameter(1)\n"
    "  %f = f32[4,8]{1,0} fusion(%m), kind=kInput, calls=%fused_t\n"
    "  %c = f32[8,4]{0,1} copy(%m)\n"
    "  %g = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add\n"
  )
  text = fused + SCHEDULED.replace(
    "  ROOT %w = (s32[], f32[8]) while", entry + "  ROOT %w = (s32[], f32[8]) while"
  )
  text = text.replace(
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  %i = s32[] get-tuple-element(%p), index=0\n  %lc = f32[8]{0} copy(%x)",
  )
  assert loop_free_copies(text) == [("transpose", 128), ("copy", 128)]
  assert loop_free_copies(text, min_bytes=129) == []


def test_ring_overlap_reads_the_schedule():
  """Compute is what lies between a transfer's start and done in the scheduled order;
  buffer-only custom calls (XLA's TPU AllocateBuffer) are not compute."""
  from jax_ring.hlo import ring_overlap

  (step,) = ring_overlap(SCHEDULED)
  assert (step.starts, step.synchronous, step.compute, step.hidden) == (1, 0, 2, 1)
  assert not step.overlapped
  (step,) = ring_overlap(
    SCHEDULED.replace("%late = f32[8]{0} custom-call(%cpd)", "%late = f32[8]{0} add(%cpd, %cpd)")
  )
  assert step.overlapped


def test_ring_overlap_reads_synchronous_and_exposed_transfers():
  """Both forms of an exposed transfer, read from XLA's scheduled text: a start whose
  backend config says "is_sync":true (XLA's GPU pipeline runs it on the compute stream),
  and an async pair with no compute between start and done. Bytes are per step."""
  from jax_ring.hlo import ring_overlap

  start = "%cps = (f32[8]{0}, f32[8]{0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}"
  sync = SCHEDULED.replace(start, start + ', backend_config={"collective_backend_config":{"is_sync":true}}')
  (step,) = ring_overlap(sync)
  assert (step.synchronous, step.exposed, step.exposed_bytes, step.hidden_bytes) == (1, 1, 32, 0)
  assert not step.overlapped
  # The kernel moved after the done: nothing under the transfer, and it lies under none.
  kernel = '  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call"\n'
  bare = SCHEDULED.replace(kernel, "").replace(
    "  %cpd = f32[8]{0} collective-permute-done(%cps)\n",
    "  %cpd = f32[8]{0} collective-permute-done(%cps)\n" + kernel,
  )
  (step,) = ring_overlap(bare)
  assert (step.synchronous, step.exposed, step.exposed_bytes, step.hidden, step.compute) == (0, 1, 32, 0, 2)
  # A second transfer, f32[4], with the kernel under it while the first has nothing.
  second = (
    "  %cps2 = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}\n"
    + kernel
    + "  %cpd2 = f32[4]{0} collective-permute-done(%cps2)\n"
  )
  two = bare.replace(kernel, second, 1)
  (step,) = ring_overlap(two)
  assert (step.starts, step.exposed, step.exposed_bytes, step.hidden_bytes) == (2, 1, 32, 16)
  # A plain collective-permute blocks: synchronous, exposed, its result's bytes.
  plain = SCHEDULED.replace(
    start, "%cps = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}"
  )
  plain = plain.replace(
    "  %cpd = f32[8]{0} collective-permute-done(%cps)\n", "  %cpd = f32[8]{0} copy(%cps)\n"
  )
  (step,) = ring_overlap(plain)
  assert (step.starts, step.synchronous, step.exposed_bytes) == (0, 1, 32) and not step.overlapped


def test_a_transfer_across_a_nested_ring_loop_runs_under_its_compute():
  """A loop over ring passes (a head group's edges) whose transfer is in flight across
  a nested ring loop: hidden by that loop's compute, which is not counted as the outer
  loop's own (the nested loop is reported as a body of its own)."""
  from jax_ring.hlo import collectives, ring_overlap

  outer = (
    "%outer (o: (s32[], f32[8])) -> (s32[], f32[8]) {\n"
    "  %o = (s32[], f32[8]) parameter(0)\n"
    "  %y = f32[8]{0} get-tuple-element(%o), index=1\n"
    "  %ops = (f32[8]{0}, f32[8]{0}) collective-permute-start(%y), source_target_pairs={{0,1},{1,0}}\n"
    "  %inner = (s32[], f32[8]) while(%o), condition=%cond, body=%body\n"
    "  %opd = f32[8]{0} collective-permute-done(%ops)\n"
    "  ROOT %r = (s32[], f32[8]) tuple(%opd)\n"
    "}\n"
  )
  text = outer + SCHEDULED.replace("body=%body", "body=%outer")
  steps = {s.body: s for s in ring_overlap(text)}
  assert set(steps) == {"body", "outer"}, steps
  assert (steps["outer"].compute, steps["outer"].exposed, steps["outer"].hidden_bytes) == (0, 0, 32)
  assert steps["body"] == ring_overlap(SCHEDULED)[0]  # the nested ring step as on its own
  assert not [c for c in collectives(text) if c.exposed], collectives(text)
  # Without the nested loop between its start and done, the same transfer is exposed.
  bare = text.replace("  %inner = (s32[], f32[8]) while(%o), condition=%cond, body=%body\n", "")
  assert {s.body: s for s in ring_overlap(bare)}["outer"].exposed == 1


def test_collectives_lists_each_with_its_loop_source_and_exposure():
  """hlo.collectives: every collective with the loop it runs in, its source and whether
  compute hides it; outside the loops an all-gather pair with nothing between is
  exposed, a plain all-reduce is synchronous."""
  from jax_ring.hlo import collective_bytes, collectives

  entry = (
    "  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%a), dimensions={0}, "
    'metadata={op_name="jit(loss)/transpose(jvp(layer_0))/reshape"}\n'
    "  %agd = f32[8]{0} all-gather-done(%ags)\n"
    '  %ar = f32[4]{0} all-reduce(%a), to_apply=%sum, metadata={op_name="jit(loss)/dot_general"}\n'
  )
  text = SCHEDULED.replace("  ROOT %w = (s32[], f32[8]) while", entry + "  ROOT %w = (s32[], f32[8]) while")
  found = {(c.op, c.where, c.bytes, c.exposed) for c in collectives(text)}
  assert found == {
    ("all-gather", "", 32, True),
    ("all-reduce", "", 16, True),
    ("collective-permute", "body", 32, False),  # the kernel runs under it
  }, found
  assert any(c.source.endswith("layer_0))/reshape") for c in collectives(text))

  def swap(start, done):  # the entry's all-gather pair, as another start and done
    pair = ("%ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%a)", "%agd = f32[8]{0} all-gather-done(%ags)")
    return text.replace(pair[0], start).replace(pair[1], done)

  # One all-gather of two arrays, as XLA combines them: ((operands), (results)). Its
  # bytes are both results (2 x 8 x 4), in the list and in the totals alike.
  two = swap(
    "%ags = ((f32[2]{0}, s32[2]{0}), (f32[8]{0}, s32[8]{0})) all-gather-start(%a, %a)",
    "%agd = (f32[8]{0}, s32[8]{0}) all-gather-done(%ags)",
  )
  assert [c.bytes for c in collectives(two) if c.op == "all-gather"] == [64]
  counted = two.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
  assert collective_bytes(counted) == {"all-gather": 64, "all-reduce": 16, "collective-permute": 3 * 32}
  # An async all-to-all's start is ((operands), (results)) too: what it sends, once.
  a2a = swap("%ags = ((f32[8]{0}), f32[8]{0}) all-to-all-start(%a)", "%agd = f32[8]{0} all-to-all-done(%ags)")
  assert [c.bytes for c in collectives(a2a) if c.op == "all-to-all"] == [32]
  # A reduce-scatter counts what every device reduces, its operands (not the 1 / n it
  # keeps), async or synchronous (the operand's shape read from its definition).
  scatter = swap(
    "%ags = ((f32[8]{0}, f32[16]{0}), (f32[2]{0}, f32[4]{0})) reduce-scatter-start(%a, %a)",
    "%agd = (f32[2]{0}, f32[4]{0}) reduce-scatter-done(%ags)",
  )
  assert [c.bytes for c in collectives(scatter) if c.op == "reduce-scatter"] == [96]
  sync = swap("%big = f32[16]{0} broadcast(%a)\n  %ags = f32[4]{0} reduce-scatter(%big), dimensions={0}", "")
  assert [c.bytes for c in collectives(sync) if c.op == "reduce-scatter"] == [64]
  sync = sync.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
  assert collective_bytes(sync)["reduce-scatter"] == 64


TPU_ASYNC = """
%start_body (a: bf16[2,8]) -> bf16[16,8] {
  %a = bf16[2,8]{1,0} parameter(0)
  ROOT %ag = bf16[16,8]{1,0} all-gather(%a), channel_id=7, dimensions={0}, \
metadata={op_name="jit(step)/gather_w"}
}

%step_body (a: bf16[2,8], w: bf16[8,8]) -> (bf16[8,8], bf16[16,8]) {
  %a = bf16[2,8]{1,0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %d = bf16[8,8]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = bf16[16,8]{1,0} all-gather(%a), channel_id=7, dimensions={0}
  ROOT %t = (bf16[8,8]{1,0}, bf16[16,8]{1,0}) tuple(%d, %ag)
}

%done_body (a: bf16[2,8]) -> bf16[16,8] {
  %a = bf16[2,8]{1,0} parameter(0)
  ROOT %ag = bf16[16,8]{1,0} all-gather(%a), channel_id=7, dimensions={0}
}

%body (p: (s32[], bf16[2,8], bf16[8,8])) -> (s32[], bf16[2,8], bf16[8,8]) {
  %p = (s32[], bf16[2,8]{1,0}, bf16[8,8]{1,0}) parameter(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %w = bf16[8,8]{1,0} get-tuple-element(%p), index=2
  %async-collective-start.3 = bf16[16,8]{1,0} fusion(%x), kind=kCustom, calls=%start_body
  %fusion.9 = (bf16[8,8]{1,0}, bf16[16,8]{1,0}) fusion(%x, %w), kind=kCustom, calls=%step_body
  %async-collective-done.3 = bf16[16,8]{1,0} fusion(%x), kind=kCustom, calls=%done_body
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %r = (s32[], bf16[2,8]{1,0}, bf16[8,8]{1,0}) tuple(%i, %x, %w)
}

ENTRY %main (a: (s32[], bf16[2,8], bf16[8,8])) -> (s32[], bf16[2,8], bf16[8,8]) {
  %a = (s32[], bf16[2,8]{1,0}, bf16[8,8]{1,0}) parameter(0)
  ROOT %w = (s32[], bf16[2,8]{1,0}, bf16[8,8]{1,0}) while(%a), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_tpu_async_collective_fusion_is_one_collective_with_its_steps_under_it():
  """XLA:TPU's async collective fusions (`xla_tpu_enable_async_collective_fusion`):
  a collective run from a fusion named async-collective-start to one named
  async-collective-done, its steps fused with compute in between, each fusion calling
  a computation that holds the collective. `collectives` lists it once, with the
  step's GEMM under it; the totals count it once per iteration; with no compute in
  its step, it is exposed."""
  from jax_ring.hlo import collective_bytes, collectives, loop_free_collectives

  found = [(c.op, c.bytes, c.source, c.exposed) for c in collectives(TPU_ASYNC)]
  assert found == [("all-gather", 256, "jit(step)/gather_w", False)], found
  assert collective_bytes(TPU_ASYNC) == {"all-gather": 4 * 256}
  assert loop_free_collectives(TPU_ASYNC) == []
  bare = TPU_ASYNC.replace("%d = bf16[8,8]{1,0} dot(%w, %w)", "%d = bf16[8,8]{1,0} add(%w, %w)")
  assert [c.exposed for c in collectives(bare)] == [True]


def test_ring_loops_are_named_by_what_they_are():
  """A loop is named from its permutes' source names (forward or backward step) and its
  while's call site (the layer): XLA shares one body between layers, whose metadata then
  names only the first layer; `collectives` names the call site's layer too."""
  from jax_ring.hlo import collectives, ring_overlap

  permute = "collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}"
  step = 'metadata={op_name="jit(loss)/transpose(jvp(layer_0))/x/backward_ring_step/ppermute"}'
  text = SCHEDULED.replace(permute, f"{permute}, {step}").replace(
    "body=%body", 'body=%body, metadata={op_name="jit(loss)/transpose(jvp(layer_7))/x/while"}'
  )
  assert [s.name for s in ring_overlap(text)] == ["backward ring step, layer 7"]
  assert [c.source for c in collectives(text)] == [
    "jit(loss)/transpose(jvp(layer_7))/x/backward_ring_step/ppermute"
  ]
  forward = text.replace("backward_ring_step", "forward_ring_step").replace(
    "transpose(jvp(layer_7))", "jvp(layer_2)"
  )
  assert [s.name for s in ring_overlap(forward)] == ["forward ring step, layer 2"]
  edges = text.replace("x/backward_ring_step/ppermute", "backward_ring_pass/ppermute")
  assert [s.name for s in ring_overlap(edges)] == ["backward ring pass edges, layer 7"]
  assert [s.name for s in ring_overlap(SCHEDULED)] == [""]  # no source names: nothing invented
  # The blocks' scan (a while outside the attention, every shard_map and other loops)
  # holding a ring pass's hoisted edges: its collectives run in the layers loop, while
  # its permutes are still the attention's pass edges.
  scan = edges.replace("jit(loss)/transpose(jvp(layer_7))/x/while", "jit(step)/transpose(jvp())/while")
  assert [c.where for c in collectives(scan)] == ["backward layers loop"]
  assert [s.name for s in ring_overlap(scan)] == ["backward ring pass edges"]
  assert [c.where for c in collectives(scan.replace("transpose(jvp())/while", "jvp()/while"))] == [
    "forward layers loop"
  ]
  for inner in ("jit(step)/jvp()/while/body/closed_call/while", "jit(step)/jvp()/shard_map/while"):
    assert [c.where for c in collectives(scan.replace("jit(step)/transpose(jvp())/while", inner))] == [
      "backward ring pass edges"
    ], inner


def test_text_report_names_loops_and_kernel_and_says_each_line_once():
  """What a user reads: the kernel "auto" resolved to, loops by name, and the CUDA
  plugin's per-client notice once (it printed four times)."""
  done = _process(PYTHON, ["scripts/aot.py", "--target=h100x8", *SHAPE])
  assert done.returncode == 0, done.stderr[-3000:]
  assert "kernel=auto: cudnn" in done.stdout, done.stdout
  assert "  forward ring step (" in done.stdout and "  backward ring step (" in done.stdout, done.stdout
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert sum("Could not find cuda drivers" in line for line in lines) <= 1, done.stderr
  assert len(lines) == len(set(lines)), done.stderr


@pytest.mark.parametrize("target, needs", [("h100x8", "CUDA plugin"), ("v5e:2x4", "libtpu")])
def test_without_the_aot_extra_the_script_names_the_fix(target, needs):
  """In the test venv itself (.venv: the [dev] extra, never [aot]) the script ends
  with one line naming the extra and what it brings, not JAX's traceback."""
  import sys

  done = _process(sys.executable, ["scripts/aot.py", f"--target={target}", "--seq-len=4096"])
  assert done.returncode == 2, done.stderr[-3000:]
  assert "[aot] extra" in done.stderr and needs in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_step_of_some_layers_says_how_many_of_how_many():
  """The heading of `--model NAME --train --layers N` names N of the model's layers."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("aot_script", ROOT / "scripts" / "aot.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  assert (
    script.step_heading("llama-3.1-8b", 1, "full")
    == "llama-3.1-8b AdamW step (1 of 32 layers, FSDP, remat full)"
  )
  assert script.step_heading("qwen3-30b-a3b", None, "offload").startswith(
    "qwen3-30b-a3b AdamW step (48 layers,"
  )
