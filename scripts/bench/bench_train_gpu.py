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

`--json PATH` writes {"rows": [{"impl", "tokens", "step_s", "tokens_per_s", "mfu",
"peak_bytes", ...}], "device", "versions", "matmul_flops"}; `--tiny` shrinks the model to
2 small layers and a vocabulary of 512, for a run on a CPU (peak memory is then null).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
  try:
    args.lengths = [int(x) for x in args.lengths.split(",")]
  except ValueError:
    p.error(f"--lengths={args.lengths!r} must be integers separated by commas")
  if any(t < 2 for t in args.lengths):
    p.error(f"--lengths={args.lengths}: each must be at least 2 tokens")
  if args.steps < 1:
    p.error(f"--steps={args.steps} must be at least 1")
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


def flops_per_step(cfg, tokens: int) -> float:
  """6 x matmul parameters x T + 6 x T^2 x N x H x layers. Matmul parameters: every
  projection and the head (the embedding lookup is no matmul; a tied head is)."""
  d, v, f = cfg.dim, cfg.vocab_size, cfg.mlp_hidden
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  per_layer = d * h * (2 * n + 2 * k) + 3 * d * f
  matmul = cfg.num_layers * per_layer + v * d
  return 6 * matmul * tokens + 6 * tokens * tokens * n * h * cfg.num_layers


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

  from jax_ring import models
  from jax_ring.models.train import step as train_step

  cfg = model_config(args.model, args.tiny)
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  model = models.build(cfg, mesh=mesh, remat=remat, dtype="bfloat16", attention_kernel=args.kernel)
  trainer = train_step.Trainer(model, train_step.make_tx(1e-5, 1, 100, 0.0, 1.0))
  del model
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, tokens + 1)).astype(np.int32)
  batch = train_step.place_batch(trainer.model(), ids[:, :-1], ids[:, 1:], np.ones((1, tokens), np.float32))
  start = time.perf_counter()
  loss = float(trainer.step(*batch)[0])
  first = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = float(trainer.step(*batch)[0])
    times.append(time.perf_counter() - start)
  stats = jax.devices()[0].memory_stats() or {}
  return dict(
    impl="jax_ring",
    remat=remat,
    kernel=args.kernel,
    loss=round(loss, 4),
    first_step_s=round(first, 2),
    step_s=_median(times),
    peak_bytes=stats.get("peak_bytes_in_use"),
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
  config._attn_implementation = "sdpa"
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.manual_seed(0)
  model = cls(config).to(device)
  model.gradient_checkpointing_enable()
  model.config.use_cache = False
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
  ids = torch.randint(0, cfg.vocab_size, (1, tokens + 1), device=device)

  def step():
    with torch.autocast(device, dtype=torch.bfloat16):
      out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
      torch.cuda.synchronize()
    return float(out.loss.detach())

  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  start = time.perf_counter()
  loss = step()
  first = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step()
    times.append(time.perf_counter() - start)
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return dict(
    impl="torch+transformers",
    versions=f"torch {torch.__version__}, transformers {transformers.__version__}",
    loss=round(loss, 4),
    first_step_s=round(first, 2),
    step_s=_median(times),
    peak_bytes=peak,
  )


def worker(args) -> None:
  """One row, printed as the last line of JSON."""
  what, *rest = args.worker.split(":")
  row = jax_row(args, rest[0], int(rest[1])) if what == "jax" else torch_row(args, int(rest[0]))
  print(json.dumps(row), flush=True)


def torch_available() -> str | None:
  """Why the PyTorch peer cannot run here, or None."""
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError as e:
    return f"PyTorch + transformers not importable here ({e})"
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
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
  )
  try:
    out, err = proc.communicate(timeout=args.timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return dict(error=f"timed out after {args.timeout:.0f} s")
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
  peer_problem = torch_available() if args.torch else None
  rows = []
  report = dict(
    model=args.model, device=device.device_kind, versions=versions, matmul_flops=matmul, rows=rows
  )

  def record(row):
    """Adds the derived figures, prints the row and rewrites --json: a run cut short
    keeps every row it finished."""
    if "step_s" in row:
      row["tokens_per_s"] = row["tokens"] / row["step_s"]
      row["mfu"] = flops_per_step(cfg, row["tokens"]) / row["step_s"] / matmul
    for key in ("step_s", "tokens_per_s", "mfu", "peak_bytes"):
      row.setdefault(key, None)
    print(json.dumps(row), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)

  for tokens in args.lengths:
    found = []
    for remat in remats:
      row = dict(impl="jax_ring", remat=remat, tokens=tokens) | run_row(args, f"jax:{remat}:{tokens}")
      found.append(row)
      rows.append(row)
      record(row)
    ok = [r for r in found if "error" not in r]
    if args.remat == "auto" and ok:
      min(ok, key=lambda r: r["step_s"])["best"] = True
    if args.torch:
      peer = dict(impl="torch+transformers", tokens=tokens)
      peer |= dict(error=peer_problem) if peer_problem else run_row(args, f"torch:{tokens}")
      rows.append(peer)
      record(peer)
  _print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


def _print_table(rows) -> None:
  print(f"{'impl':<20} {'remat':<10} {'tokens':>8} {'step s':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
  for r in rows:
    if r.get("step_s") is None:
      print(f"{r['impl']:<20} {r.get('remat', ''):<10} {r['tokens']:>8}  {r.get('error', '')[:80]}")
      continue
    peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    best = " *" if r.get("best") else ""
    head = f"{r['impl']:<20} {r.get('remat', ''):<10} {r['tokens']:>8}"
    print(f"{head} {r['step_s']:>9.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.3f} {peak:>9}{best}")


if __name__ == "__main__":
  main()
