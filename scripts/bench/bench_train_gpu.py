"""One AdamW training step of a named model on one GPU: jax_ring's (`models.build` +
`train.step.Trainer`, every attention layer on the ring's kernel) and, with `--torch`,
PyTorch + Hugging Face transformers' of the same model in the same run.

    python scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 16384,32768 --torch
    python scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 65536,131072 --json out.json

Per row: seconds per step (median of `--steps` after a first, compiling step), tokens/s,
MFU and peak device memory. MFU counts 6 x matmul parameters x tokens + 6 x T^2 x heads
x head_dim x layers (forward and backward, full T^2 even for causal attention, no
recomputation), as the GPU issue's first measurements did, over a bf16 matmul of
8192^3 timed in the same run (by JAX; the peer's rows use the same figure).

Both steps: random weights, batch 1, float32 weights and AdamW moments, bf16 compute,
gradients clipped to norm 1. The peer: `LlamaForCausalLM` (or the model's class) with
SDPA attention, gradient checkpointing and fused AdamW under bf16 autocast, its loss on
the same tokens. Each implementation and length runs in a process of its own (killed
past `--timeout`), so one's memory never counts against another's and an out-of-memory
row does not end the run.

`--remat`: what each block keeps for the backward pass ("full", "attention", "none"),
or "auto" (the default): both "attention" and "full", each reported, the faster that
fits marked `"best": true`. Measured on one H200 (Llama-3.2-1B, cuDNN ring steps):
"attention" took 7% less time than "full" at 16K tokens and 11% less at 32K, for 2.0
and 3.8 GiB more (0.530 s, 29.2 GiB against 0.572 s, 27.2 GiB at 16K).

`--objective dpo`: one DPO step (TRL 1.x's sigmoid loss, beta 0.1) on one pair a row,
its chosen and rejected sequences each half the row's tokens, sharing a prompt of
`--prompt` tokens: jax_ring's `dpo.Preference` objective with the reference's
log-probabilities from a frozen copy of the initial weights (the base, adapters off,
with `--lora`) computed in the step's time; the peer (`--torch`) is TRL's DPOTrainer
(its collator, `training_step` and optimizer) on the same pair, its reference a copy of
the model (or the peft adapter TRL adds), under the same bf16 autocast. MFU then counts
the policy's forward and backward over two documents of T / 2 and the reference's forward.
Each row also gives the first step's loss (DPO's: log 2, the policy being its reference).

`--profile`: one more step of each jax_ring row under `jax.profiler.trace`, its device
time summed by what each operation does, from the compiled step's HLO and its source
names: the attention forward and backward (the ring's scopes; a backward op is traced
under `transpose(...)`), other matmuls (the projections and MLPs), the loss (the head
and its softmax, `step.loss`'s scope), the optimizer (AdamW's update and the gradient
norm), the rest ("other"), and the gaps: the step's span on the device less the union
of its operations' intervals (time with no operation running). Events that name no
operation of the step (a kernel named otherwise) are summed as "unmatched".

`--json PATH` writes {"rows": [{"impl", "tokens", "step_s", "tokens_per_s", "mfu",
"peak_bytes", ...}], "device", "versions", "matmul_flops"}; `--tiny` shrinks the model to
2 small layers and a vocabulary of 512, for a run on a CPU (peak memory is then null).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--model", default="llama-3.2-1b", help="a name of models.config (default: %(default)s)")
  p.add_argument(
    "--lengths", default="16384,32768", help="tokens per step, comma-separated (default: %(default)s)"
  )
  p.add_argument(
    "--remat",
    default="auto",
    choices=["auto", "full", "attention", "none"],
    help="jax_ring's remat (default: %(default)s)",
  )
  p.add_argument(
    "--torch", action="store_true", help="also PyTorch + transformers' step, where importable (default: off)"
  )
  p.add_argument(
    "--peer-only", action="store_true", help="the PyTorch peer's rows alone, --torch implied (default: off)"
  )
  p.add_argument(
    "--packed",
    action="store_true",
    help="rows of documents of mixed lengths, each with its own positions (default: one document a row)",
  )
  p.add_argument(
    "--lora",
    type=int,
    default=0,
    metavar="RANK",
    help="train adapters of this rank on every projection, the base frozen in bfloat16 (default: 0, off)",
  )
  p.add_argument(
    "--objective",
    default="sft",
    choices=["sft", "dpo"],
    help="the step's loss: next-token cross-entropy, or DPO on one pair a row (default: %(default)s)",
  )
  p.add_argument(
    "--prompt", type=int, default=512, help="DPO: the prompt tokens the pair shares (default: %(default)s)"
  )
  p.add_argument(
    "--profile", action="store_true", help="one more step under the profiler, summed by part (default: off)"
  )
  p.add_argument("--steps", type=int, default=3, help="timed steps after the first (default: %(default)s)")
  p.add_argument(
    "--kernel",
    default="auto",
    choices=["auto", "cudnn", "pallas", "xla"],
    help="the ring's kernel in jax_ring's step (default: %(default)s: cuDNN on NVIDIA GPUs)",
  )
  p.add_argument(
    "--tiny", action="store_true", help="2 small layers: a run on a CPU (default: the named model's size)"
  )
  p.add_argument(
    "--timeout", type=float, default=1800, help="seconds per row's process (default: %(default)s)"
  )
  p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON (default: none)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "jax:REMAT:T" or "torch:T"
  args = p.parse_args(argv)
  args.torch = args.torch or args.peer_only
  try:
    args.lengths = [int(x) for x in args.lengths.split(",")]
  except ValueError:
    p.error(f"--lengths={args.lengths!r} must be integers separated by commas")
  if any(t < 2 for t in args.lengths):
    p.error(f"--lengths={args.lengths}: each must be at least 2 tokens")
  if args.lora < 0:
    p.error(f"--lora={args.lora} must be a rank >= 1, or 0 for no adapters")
  if args.steps < 1:
    p.error(f"--steps={args.steps} must be at least 1")
  if args.objective == "dpo" and args.packed:
    p.error("--objective=dpo packs its own pair a row: leave out --packed")
  short = [t for t in args.lengths if t % 2 or t // 2 < args.prompt + 2]
  if args.objective == "dpo" and not args.worker and short:
    p.error(f"--lengths={args.lengths}: with --objective=dpo each must be even and >= 2 x (--prompt + 2)")
  return args


def model_config(name: str, tiny: bool):
  from jax_ring import models

  cfg = models.config(name)
  if tiny:
    tiny = dict(
      num_layers=2, dim=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_hidden=256, vocab_size=512
    )
    cfg = dataclasses.replace(cfg, **tiny)
  return cfg


def flops_per_step(cfg, tokens: int, lora: bool = False, dpo: bool = False) -> float:
  """6 x matmul parameters x T + 6 x T^2 x N x H x layers. Matmul parameters: every
  projection and the head (the embedding lookup is no matmul; a tied head is). With
  adapters, 4 x matmul parameters x T: a frozen weight's gradient is never formed (the
  adapters' own matmuls are left out, under 1% at rank 16). `dpo`: the row is two
  documents of T / 2 (attention 2 x (T / 2)^2 = T^2 / 2), and the reference's forward
  adds 2 x matmul parameters x T + 2 x T^2 / 2 x N x H x layers."""
  d, v, f = cfg.dim, cfg.vocab_size, cfg.mlp_hidden
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  per_layer = d * h * (2 * n + 2 * k) + 3 * d * f
  matmul = cfg.num_layers * per_layer + v * d
  scores = tokens * tokens * n * h * cfg.num_layers / (2 if dpo else 1)
  flops = (4 if lora else 6) * matmul * tokens + 6 * scores
  return flops + 2 * matmul * tokens + 2 * scores if dpo else flops


# The dense bf16 peak of an H100 or H200 SXM in NVIDIA's specification (without
# sparsity), the figure peers publish MFU against.
SPEC_PEAK = 989e12


def documents(tokens: int, vocab: int, seed: int = 0):
  """(ids [1, tokens + 1], segment ids [1, tokens], positions [1, tokens]): documents
  of mixed lengths (log-uniform from 256 to 8192 tokens, the last cut to fit), each
  with its own positions from 0 and no target across its end."""
  import numpy as np

  rng = np.random.default_rng(seed)
  seg = np.zeros(tokens, np.int32)
  pos = np.zeros(tokens, np.int32)
  at, doc = 0, 0
  while at < tokens:
    n = min(tokens - at, int(np.exp(rng.uniform(np.log(256), np.log(8192)))))
    seg[at : at + n] = doc
    pos[at : at + n] = np.arange(n)
    at, doc = at + n, doc + 1
  ids = rng.integers(0, vocab, (1, tokens + 1)).astype(np.int32)
  return ids, seg[None], pos[None]


def pair(tokens: int, vocab: int, prompt: int, seed: int = 0):
  """One preference pair of random tokens, two sequences of tokens / 2 sharing their
  first `prompt`: (sequences [2, tokens / 2], jax_ring's row (tokens, targets, weights,
  segment ids, positions), each [1, tokens]). A sequence's targets are its next tokens,
  weighted on the completion's (`prompt` to the end), as TRL's completion mask."""
  import numpy as np

  half = tokens // 2
  seqs = np.random.default_rng(seed).integers(0, vocab, (2, half)).astype(np.int32)
  seqs[1, :prompt] = seqs[0, :prompt]
  targets = np.concatenate([seqs[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
  weights = np.zeros((2, half), np.float32)
  weights[:, prompt - 1 : half - 1] = 1.0
  seg = np.repeat(np.array([[1], [2]], np.int32), half, axis=1)  # slot k is segment k + 1
  pos = np.tile(np.arange(half, dtype=np.int32), (2, 1))
  row = [a.reshape(1, tokens) for a in (seqs, targets, weights, seg, pos)]
  return seqs, row


def jax_matmul_flops(n: int = 8192, reps: int = 10) -> float:
  import jax
  import jax.numpy as jnp
  import numpy as np

  if jax.devices()[0].platform == "cpu":
    n, reps = 512, 3
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / float(np.median(times))


def _median(times):
  times = sorted(times)
  return times[len(times) // 2]


def jax_row(args, remat: str, tokens: int) -> dict:
  """jax_ring's step at `tokens` with `remat` on one device."""
  import jax
  import numpy as np
  from flax import nnx

  from jax_ring import models
  from jax_ring.models.train import step as train_step

  cfg = model_config(args.model, args.tiny)
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  base_dtype = "bfloat16" if args.lora else "float32"
  model = models.build(
    cfg, mesh=mesh, remat=remat, dtype="bfloat16", param_dtype=base_dtype, attention_kernel=args.kernel
  )
  if args.lora:
    models.add_lora(model, rank=args.lora, alpha=2 * args.lora)
  trainable = nnx.LoRAParam if args.lora else nnx.Param
  tx = train_step.make_tx(1e-5, 1, 100, 0.0, 1.0)
  reference = None
  if args.objective == "dpo":
    from jax_ring.models.train import dpo

    objective = dpo.Preference(dpo.DPOConfig()).loss
    trainer = train_step.Trainer(model, tx, trainable=trainable, objective=objective)
    reference = dpo.Reference.adapters_off(trainer) if args.lora else dpo.Reference.initial(trainer)
  else:
    trainer = train_step.Trainer(model, tx, trainable=trainable)
  del model
  if args.objective == "dpo":
    batch = train_step.place_batch(trainer.model(), *pair(tokens, cfg.vocab_size, args.prompt)[1])
    rows = dict(segment_ids=batch[3], positions=batch[4])
    batch = batch[:3]
  elif args.packed:
    ids, seg, pos = documents(tokens, cfg.vocab_size)
    weights = np.ones((1, tokens), np.float32)
    weights[0, :-1] *= seg[0, 1:] == seg[0, :-1]  # no target across a document's end
    batch = train_step.place_batch(trainer.model(), ids[:, :-1], ids[:, 1:], weights, seg, pos)
    rows = dict(segment_ids=batch[3], positions=batch[4])
    batch = batch[:3]
  else:
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, tokens + 1)).astype(np.int32)
    batch = train_step.place_batch(trainer.model(), ids[:, :-1], ids[:, 1:], np.ones((1, tokens), np.float32))
    rows = {}

  def step():
    """One step: with DPO, the reference's log-probabilities of the pair first."""
    more = {}
    if reference is not None:
      more["reference"] = reference._run(2)(reference.params, reference.rest, *batch, rows)[0]
    return float(trainer.step(*batch, **rows, **more)[0])

  start = time.perf_counter()
  loss = first_loss = step()
  first = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()
    times.append(time.perf_counter() - start)
  stats = jax.devices()[0].memory_stats() or {}
  more = {}
  if args.profile:
    more["profile"] = profile_step(step, trainer.compiled(*batch, **rows).as_text())
  return more | dict(
    impl="jax_ring",
    remat=remat,
    kernel=args.kernel,
    first_loss=round(first_loss, 6),
    loss=round(loss, 4),
    first_step_s=round(first, 2),
    step_s=_median(times),
    peak_bytes=stats.get("peak_bytes_in_use"),
  )


PROFILE_PARTS = ("attention forward", "attention backward", "matmuls", "loss", "optimizer", "other")
_ATTENTION = ("ring_attention", "forward_ring", "backward_ring", "dilated_attention")
_OP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', re.M)


def step_parts(hlo: str) -> dict[str, str]:
  """HLO instruction name -> its part of the step (`PROFILE_PARTS`), from its kind
  (`bench_profile.categorize`: a dot, alone or fused, is a matmul) and its source name."""
  from bench_profile import categorize

  names = dict(_OP.findall(hlo))
  parts = {}
  for inst, kind in categorize(hlo).items():
    name = names.get(inst, "")
    if any(a in name for a in _ATTENTION):
      backward = "backward_ring" in name or "transpose(" in name
      parts[inst] = "attention backward" if backward else "attention forward"
    elif "jax_ring.optimizer" in name:
      parts[inst] = "optimizer"
    elif "jax_ring.loss_head" in name:
      parts[inst] = "loss"
    else:
      parts[inst] = "matmuls" if kind == "matmul" else "other"
  return parts


def profile_step(run, hlo: str) -> dict:
  """One `run()` under the profiler: milliseconds per part (`step_parts`), the span
  from the first operation's start to the last one's end, the gaps (the span less the
  union of the operations' intervals) and what no operation of the step names. On a
  GPU only the device's events count (its kernels, by their `hlo_op`)."""
  import tempfile

  import jax

  parts = step_parts(hlo)
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      run()
    (path,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  named = [e for e in events if e.get("ph") == "M" and e.get("name") == "process_name"]
  devices = {e["pid"] for e in named if "/device:" in e.get("args", {}).get("name", "")}
  busy: dict[str, float] = collections.defaultdict(float)
  spans, unmatched = [], 0.0
  for e in events:
    if e.get("ph") != "X" or (devices and e.get("pid") not in devices):
      continue
    part = parts.get((e.get("args") or {}).get("hlo_op") or e.get("name"))
    start, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
    if part is None:
      unmatched += dur if devices else 0.0  # on a CPU, host events of every kind
      continue
    busy[part] += dur
    spans.append((start, start + dur))
  if not spans:
    raise SystemExit("bench_train_gpu.py --profile: the trace holds no operation of the step")
  spans.sort()
  union, (lo, hi) = 0.0, spans[0]
  for a, b in spans[1:]:
    if a > hi:
      union, lo, hi = union + hi - lo, a, b
    else:
      hi = max(hi, b)
  union += hi - lo
  span = max(b for _, b in spans) - spans[0][0]
  ms = lambda us: round(us / 1e3, 3)
  return dict(
    span_ms=ms(span),
    gaps_ms=ms(span - union),
    parts_ms={p: ms(busy.get(p, 0.0)) for p in PROFILE_PARTS},
    unmatched_ms=ms(unmatched),
  )


def torch_row(args, tokens: int) -> dict:
  """PyTorch + transformers' step of the same model at `tokens` tokens."""
  import torch
  import transformers

  from jax_ring import models

  cfg = model_config(args.model, args.tiny)
  values = models.checkpoints.config_json(cfg)
  cls = getattr(transformers, values["architectures"][0])
  config = transformers.AutoConfig.for_model(**values)
  attention = "sdpa"
  if args.packed and transformers.utils.is_flash_attn_2_available():
    attention = "flash_attention_2"  # packed rows by position_ids: flash-attn's varlen kernel
  config._attn_implementation = attention
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.manual_seed(0)
  if args.lora:  # the base in bfloat16, built on the GPU
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
      model = cls(config)
    torch.set_default_dtype(torch.float32)
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    for p in model.parameters():  # adapters and their moments in float32, as jax_ring's
      if p.requires_grad:
        p.data = p.data.float()
    model.enable_input_require_grads()
  else:
    model = cls(config).to(device)
  model.gradient_checkpointing_enable()
  model.config.use_cache = False
  model.train()
  if args.objective == "dpo":
    step = trl_dpo_step(args, model, tokens, cfg.vocab_size, device)
  else:
    step = _torch_sft_step(args, model, tokens, cfg.vocab_size, device)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  start = time.perf_counter()
  loss = first_loss = step()
  first = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()
    times.append(time.perf_counter() - start)
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  runs = attention
  if args.packed and attention == "sdpa":  # transformers 4.54+ masks packed documents from position_ids
    masks = hasattr(getattr(transformers, "masking_utils", None), "find_packed_sequence_indices")
    runs += ", documents masked by position_ids" if masks else ", documents not masked from each other"
  versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
  if args.lora:
    versions += f", peft {__import__('peft').__version__}"
  if args.objective == "dpo":
    versions += f", trl {__import__('trl').__version__}"
  return dict(
    impl=peer_name(args),
    attention=runs,
    versions=versions,
    first_loss=round(first_loss, 6),
    loss=round(loss, 4),
    first_step_s=round(first, 2),
    step_s=_median(times),
    peak_bytes=peak,
  )


def peer_name(args) -> str:
  return ("trl" if args.objective == "dpo" else "torch") + "+transformers" + ("+peft" if args.lora else "")


def _torch_sft_step(args, model, tokens, vocab, device):
  """The peer's AdamW step on next-token cross-entropy (a function of no arguments)."""
  import torch

  params = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
  extra = {}
  if args.packed:
    ids_np, _, pos = documents(tokens, vocab)
    ids = torch.tensor(ids_np, device=device, dtype=torch.long)
    extra["position_ids"] = torch.tensor(pos, device=device, dtype=torch.long)
  else:
    ids = torch.randint(0, vocab, (1, tokens + 1), device=device)

  def step():
    with torch.autocast(device, dtype=torch.bfloat16):
      out = model(input_ids=ids[:, :-1], labels=ids[:, :-1], **extra)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
      torch.cuda.synchronize()
    return float(out.loss.detach())

  return step


def trl_dpo_step(args, model, tokens, vocab, device):
  """TRL's DPOTrainer's step on `pair`'s sequences (a function of no arguments): its
  collator's batch, its `training_step` (policy and reference forward, sigmoid loss,
  backward) under bf16 autocast, the gradient clipped to norm 1 and its optimizer's
  step. TRL needs a tokenizer and a dataset to be built: a word-level one over the
  model's vocabulary and one pair of words, never used for the timed pair."""
  import copy
  import tempfile

  import datasets
  import tokenizers
  import torch
  import transformers
  import trl

  words = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab)}}
  core = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<eos>"))
  core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")
  seqs, _ = pair(tokens, vocab, args.prompt)
  example = dict(prompt_ids=seqs[0, : args.prompt].tolist())
  example |= dict(chosen_ids=seqs[0, args.prompt :].tolist(), rejected_ids=seqs[1, args.prompt :].tolist())
  with tempfile.TemporaryDirectory() as out:
    config = trl.DPOConfig(
      output_dir=out,
      per_device_train_batch_size=1,
      max_length=None,
      learning_rate=1e-5,
      max_grad_norm=1.0,
      gradient_checkpointing=True,  # as the other peers (TRL turns it off unless asked)
      bf16=False,  # the step's autocast is set here, as for the other peers
      report_to="none",
      use_cpu=device == "cpu",
    )
    data = datasets.Dataset.from_list([dict(prompt="w1", chosen=" w2", rejected=" w3")])
    ref = None if args.lora else copy.deepcopy(model).eval()
    trainer = trl.DPOTrainer(model, ref, args=config, train_dataset=data, processing_class=tok)
  trainer.create_optimizer_and_scheduler(num_training_steps=100)
  trainer.current_gradient_accumulation_steps = 1  # what `Trainer.train` sets before its steps
  inputs = trainer._prepare_inputs(trainer.data_collator([example]))
  policy = trainer.model

  def step():
    with torch.autocast(device, dtype=torch.bfloat16):
      loss = trainer.training_step(policy, inputs)
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
      torch.cuda.synchronize()
    return float(loss)

  return step


def worker(args) -> None:
  """One row, printed as the last line of JSON."""
  what, *rest = args.worker.split(":")
  row = jax_row(args, rest[0], int(rest[1])) if what == "jax" else torch_row(args, int(rest[0]))
  print(json.dumps(row), flush=True)


def torch_available(*more: str) -> str | None:
  """Why the PyTorch peer (with the modules `more` too) cannot run here, or None."""
  import importlib

  names = ("torch", "transformers", *more)
  try:
    for name in names:
      importlib.import_module(name)
  except ImportError as e:
    return f"{' + '.join(names)} not importable here ({e})"
  return None


def run_row(args, spec: str) -> dict:
  """The row of worker `spec`, in a process of its own (SIGKILL past --timeout)."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    spec,
    "--model",
    args.model,
    "--steps",
    str(args.steps),
  ]
  cmd += ["--lengths", "2", "--kernel", args.kernel] + (["--tiny"] if args.tiny else [])
  cmd += (["--packed"] if args.packed else []) + ["--lora", str(args.lora)]
  cmd += ["--objective", args.objective, "--prompt", str(args.prompt)] + (
    ["--profile"] if args.profile else []
  )
  return run_worker(cmd, args.timeout)


def run_worker(cmd, timeout: float) -> dict:
  """The JSON object a worker process prints last, or {"error": why}: the process in a
  session of its own, SIGKILLed (with its children) past `timeout` seconds."""
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
  )
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return dict(error=f"timed out after {timeout:.0f} s")
  lines = [line for line in out.splitlines() if line.startswith("{")]
  if proc.returncode != 0 or not lines:
    tail = (err or out).strip().splitlines()[-3:]
    return dict(error=" | ".join(tail)[-400:] or f"exit code {proc.returncode}")
  return json.loads(lines[-1])


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return {}
  import jax

  if jax.devices()[0].platform != "gpu" and not args.tiny:
    raise SystemExit(
      f"bench_train_gpu.py: no GPU here ({jax.devices()[0].platform}); {args.model}'s step at these lengths "
      "would run on the CPU until memory runs out: pass --tiny for a small model's run here"
    )
  cfg = model_config(args.model, args.tiny)
  device = jax.devices()[0]
  matmul = jax_matmul_flops()
  versions = f"jax {jax.__version__}, jax_ring {__import__('jax_ring').__version__}"
  print(f"{device.device_kind}: bf16 matmul {matmul / 1e12:.1f} TFLOP/s; {versions}", flush=True)
  remats = ["attention", "full"] if args.remat == "auto" else [args.remat]
  needs = ("trl", "datasets") if args.objective == "dpo" else ("peft",) if args.lora else ()
  peer_problem = torch_available(*needs) if args.torch else None
  rows = []
  report = dict(
    model=args.model,
    objective=args.objective,
    packed=args.packed,
    lora=args.lora,
    device=device.device_kind,
    versions=versions,
    matmul_flops=matmul,
    rows=rows,
  )

  def record(row):
    """Adds the derived figures, prints the row and rewrites --json: a run cut short
    keeps every row it finished."""
    if "step_s" in row:
      row["tokens_per_s"] = row["tokens"] / row["step_s"]
      flops = flops_per_step(cfg, row["tokens"], lora=bool(args.lora), dpo=args.objective == "dpo")
      row["mfu"] = flops / row["step_s"] / matmul
      row["mfu_spec"] = flops / row["step_s"] / SPEC_PEAK
    for key in ("step_s", "tokens_per_s", "mfu", "mfu_spec", "peak_bytes"):
      row.setdefault(key, None)
    print(json.dumps(row), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)

  for tokens in args.lengths:
    found = []
    for remat in [] if args.peer_only else remats:
      row = dict(impl="jax_ring", remat=remat, tokens=tokens) | run_row(args, f"jax:{remat}:{tokens}")
      found.append(row)
      rows.append(row)
      record(row)
    ok = [r for r in found if "error" not in r]
    if args.remat == "auto" and ok:
      min(ok, key=lambda r: r["step_s"])["best"] = True
    if args.torch:
      peer = dict(impl=peer_name(args), tokens=tokens)
      peer |= dict(error=peer_problem) if peer_problem else run_row(args, f"torch:{tokens}")
      rows.append(peer)
      record(peer)
  _print_table(rows)
  for r in rows:
    if "profile" in r:
      _print_profile(r)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


def _print_profile(row) -> None:
  """The profile of one row: each part's milliseconds and share of the step's span."""
  prof = row["profile"]
  span = prof["span_ms"] or 1.0
  print(f"profile of jax_ring's step ({row.get('remat')}, {row['tokens']} tokens): span {span:.1f} ms")
  for name, ms in [*prof["parts_ms"].items(), ("gaps", prof["gaps_ms"]), ("unmatched", prof["unmatched_ms"])]:
    print(f"  {name:<20} {ms:>10.1f} ms {ms / span:>7.1%}")


def _print_table(rows) -> None:
  print(f"{'impl':<25} {'remat':<10} {'tokens':>8} {'step s':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
  for r in rows:
    if r.get("step_s") is None:
      print(f"{r['impl']:<25} {r.get('remat', ''):<10} {r['tokens']:>8}  {r.get('error', '')[:80]}")
      continue
    peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    best = " *" if r.get("best") else ""
    head = f"{r['impl']:<25} {r.get('remat', ''):<10} {r['tokens']:>8}"
    print(f"{head} {r['step_s']:>9.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.3f} {peak:>9}{best}")


if __name__ == "__main__":
  main()
