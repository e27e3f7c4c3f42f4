"""Compile ring attention (or a whole `models.DecoderLM` training step) for a GPU or
TPU target that is not here, and print what the compiled program shows: per-device
memory, bytes per collective, each ring-step loop's overlap of transfer and compute,
and the Pallas kernels' launch grids. Nothing runs: this checks a cluster
configuration before you have the cluster.

    python scripts/aot.py --target h100x8 --seq-len 65536
    python scripts/aot.py --target v5e:8x8 --seq-len 1048576 --kernel xla
    python scripts/aot.py --target h100x8 --max-length --budget-gib 70
    python scripts/aot.py --target v5e:8x8 --model --layers 2 --max-length
    python scripts/aot.py --target h100x8 --model llama-3.1-8b --train --seq-len 524288
    python scripts/aot.py --target h100x8 --seq-len 1048576 --document-bound 32768

Needs the [aot] extra, best in an environment of its own (`python -m venv .venv-aot &&
.venv-aot/bin/pip install -e ".[aot]"`: the CUDA plugin with ptxas and jax[tpu], pinned
to the jax version tested; README, "Install into your own project"). Without it the
script says so and exits with status 2. `JAX_PLATFORMS=cpu` is set here.
Targets: h100x8, h100x1, a100x8, v5e:2x4, v5e:8x8, v5e:16x16, v5p:2x2x2, v5p:4x4x4, v6e:2x4.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import threading

# Before jax is imported: JAX stays on the CPU (the CUDA plugin would otherwise try to
# start a GPU, fail and not register), and libtpu does not look for a TPU VM's metadata.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compiles at once (the tests)


def step_heading(name: str, layers: int | None, remat: str) -> str:
  """What a named model's compiled step is: "qwen3-30b-a3b AdamW step (1 of 48 layers,
  FSDP, remat full)"."""
  from jax_ring import models

  every = models.config(name).num_layers
  count = f"{layers} of {every} layers" if layers and layers != every else f"{every} layers"
  return f"{name} AdamW step ({count}, FSDP, remat {remat})"


def print_each_line_once() -> None:
  """Routes this process's stderr (file descriptor 2, which the CUDA plugin and libtpu
  write to from C++) through a filter that passes each line once: the plugin logs
  "Could not find cuda drivers" for every client it starts, four times a run. Lines
  that differ only in their log prefix (time, thread) count as the same. Everything
  written before exit, a traceback included, is passed on before the process ends."""
  real = os.dup(2)
  read, write = os.pipe()
  os.dup2(write, 2)
  os.close(write)
  prefix = re.compile(rb"^[IWEF]\d{4} [\d:.]+\s+\d+ ")

  def pump():
    seen = set()
    with os.fdopen(read, "rb") as src, os.fdopen(real, "wb", buffering=0) as dst:
      for line in src:
        key = prefix.sub(b"", line)
        if key not in seen:
          seen.add(key)
          dst.write(line)

  thread = threading.Thread(target=pump, daemon=True)
  thread.start()

  def drain():
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # closes the pipe's last writer
    thread.join(timeout=10)

  atexit.register(drain)


if __name__ == "__main__":
  print_each_line_once()

from launch import HelpFormatter  # noqa: E402  (the launcher's: no jax imported before the env is set)

from jax_ring import aot, choose_kernel, policy_for  # noqa: E402


def _bound(text: str):
  """--document-bound: an int, or "auto"."""
  return text if text == "auto" else int(text)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
  p.add_argument(
    "--target", default="h100x8", choices=sorted(aot.TARGETS), help="the hardware to compile for"
  )
  p.add_argument("--seq-len", type=int, default=65536, help="tokens of the sequence (all devices)")
  p.add_argument("--batch", type=int, default=1, help="batch size")
  p.add_argument("--heads", type=int, default=32, help="query heads N (Llama-3-8B: 32)")
  p.add_argument("--kv-heads", type=int, default=8, help="kv heads K (Llama-3-8B: 8)")
  p.add_argument("--head-dim", type=int, default=128, help="head dim H")
  p.add_argument("--dtype", default="bfloat16", help="input dtype")
  p.add_argument(
    "--kernel", default="auto", choices=["auto", "xla", "pallas", "cudnn"], help="the block kernel"
  )
  p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
  p.add_argument("--forward-only", action="store_true", help="compile the forward pass alone")
  p.add_argument(
    "--document-bound",
    type=_bound,
    default=None,
    help="packed rows whose documents are at most N tokens: segment ids in, "
    "ring_attention(document_bound=N); 'auto': the bound read from the ids while running, "
    "each branch's transfers reported",
  )
  p.add_argument("--make-mesh", action="store_true", help="jax.make_mesh's device order, not ring_mesh's")
  p.add_argument(
    "--model",
    nargs="?",
    const=True,
    default=False,
    help="a DecoderLM's loss and gradients; with NAME (models.config) and --train, that model's AdamW step",
  )
  p.add_argument(
    "--train", action="store_true", help="--model NAME: one whole AdamW step (FSDP, remat, chunked loss)"
  )
  p.add_argument(
    "--remat",
    default="full",
    choices=("none", "full", "attention", "offload"),
    help="--train: what a layer keeps (offload: its input, in host memory)",
  )
  p.add_argument("--param-dtype", default="float32", help="--train: weights and AdamW moments")
  p.add_argument(
    "--capacity-factor",
    type=float,
    default=None,
    help="--train, a mixture of experts: each expert's capacity (moe.set_capacity); default none dropped",
  )
  p.add_argument("--chunk", type=int, default=1024, help="--train: tokens per chunk of the loss")
  p.add_argument(
    "--lora-rank",
    type=int,
    default=None,
    help="--train: low-rank adapters of this rank train alone (the base frozen in --param-dtype)",
  )
  p.add_argument(
    "--lora-alpha", type=float, default=None, help="--train: the adapters' alpha (default: 2 x rank)"
  )
  p.add_argument(
    "--objective",
    default="sft",
    choices=("sft", "dpo", "grpo"),
    help="--train: the step's objective (dpo: a row is one pair of two --seq-len / 2 token sequences; "
    "grpo: a row is one completion of --seq-len tokens, --batch of them)",
  )
  p.add_argument(
    "--layers",
    type=int,
    default=None,
    help="--model: transformer blocks (the DecoderLM: default 2; --model NAME --train: default all of its)",
  )
  p.add_argument(
    "--natural-order",
    action="store_true",
    help="--model: every layer relays its tokens (LMConfig.ring_order=False), not the ring's order kept",
  )
  p.add_argument("--mlp-hidden", type=int, default=14336, help="--model: SwiGLU width (Llama-3-8B: 14336)")
  p.add_argument("--vocab", type=int, default=128256, help="--model: vocabulary (Llama-3: 128256)")
  p.add_argument("--max-length", action="store_true", help="bisect for the longest sequence that fits")
  p.add_argument("--budget-gib", type=float, default=None, help="per-device memory (default: the target's)")
  p.add_argument(
    "--granularity", type=int, default=None, help="bisect to this many tokens (default: 2 x devices x 1024)"
  )
  p.add_argument("--upper", type=int, default=1 << 24, help="--max-length: the longest length tried")
  p.add_argument(
    "--hidden",
    action="store_true",
    help="--max-length: a length counts only if every attention ring transfer and every host copy "
    "has compute under it, the copies back started a layer ahead (remat offload)",
  )
  p.add_argument(
    "--host-budget-gib",
    type=float,
    default=None,
    help="--max-length: host memory a device may hold (remat offload's layer inputs)",
  )
  p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
  return p.parse_args(argv)


def compile_model(mesh, args, seq_len: int):
  """The compiled loss-and-gradients of a DecoderLM of the arguments' width."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import models

  config = models.LMConfig(
    vocab_size=args.vocab,
    dim=args.heads * args.head_dim,
    num_layers=args.layers or 2,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    mlp_hidden=args.mlp_hidden,
    dtype=args.dtype,
    param_dtype=args.dtype,
    attention_kernel=args.kernel,
    ring_order=False if args.natural_order else None,
  )
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: models.DecoderLM(config, mesh=mesh, rngs=nnx.Rngs(0)))
    graph, params = nnx.split(abstract)

    def loss(params, inputs, targets):
      model = nnx.merge(graph, params)
      logits = model(inputs, logits_order="ring")  # the targets follow the layers' order
      return optax.softmax_cross_entropy_with_integer_labels(logits, model.to_ring_order(targets)).mean()

    # Inputs and targets each [B, T], sharded over the sequence as models.train.scratch feeds
    # them. One replicated array of T + 1 tokens, sliced into both, left the embeddings
    # whole, and XLA all-gathered the first layer's dq, dk and dv over the sequence for
    # the rotary embedding's backward (1 GiB per device at 64K tokens on 8 x H100).
    spec = NamedSharding(mesh, P(None, "seq"))
    tokens = jax.ShapeDtypeStruct((args.batch, seq_len), jnp.int32, sharding=spec)
    return jax.jit(jax.grad(loss)).lower(params, tokens, tokens).compile()


def objective_of(name: str) -> dict:
  """`compile_train_step`'s objective and its further inputs for --objective NAME."""
  if name == "dpo":
    from jax_ring.models.train import dpo

    return dict(objective=dpo.Preference().loss, objective_rows=dpo.compiled_rows)
  if name == "grpo":
    from jax_ring.models.train import grpo

    # One completion a row (`batch` of them); the reference's log-probabilities come in
    # per token (beta 0.04), computed by a pass of their own before the step.
    made = {}

    def rows(batch, seq_len, rows, whole):
      made["objective"] = grpo.GRPO.compiled(batch)
      return made["objective"].rows(batch, seq_len, rows, whole)

    def loss(model, tokens, targets, weights, **kw):
      return made["objective"].loss(model, tokens, targets, weights, **kw)

    return dict(objective=loss, objective_rows=rows)
  return {}


def compile_for(mesh, args, seq_len: int):
  if isinstance(args.model, str):
    from jax_ring.models.train import step as train_step

    return train_step.compile_train_step(
      args.model,
      mesh,
      seq_len=seq_len,
      batch=args.batch,
      remat=args.remat,
      dtype=args.dtype,
      param_dtype=args.param_dtype,
      chunk=args.chunk,
      layers=args.layers,
      capacity_factor=args.capacity_factor,
      lora_rank=args.lora_rank,
      lora_alpha=args.lora_alpha,
      device_bytes=aot.target(args.target).memory_bytes,
      **objective_of(args.objective),
    )
  if args.model:
    return compile_model(mesh, args, seq_len)
  return aot.compile_attention(
    mesh,
    backward=not args.forward_only,
    kernel=args.kernel,
    is_causal=not args.no_causal,
    document_bound=args.document_bound,
    seq_len=seq_len,
    heads=args.heads,
    kv_heads=args.kv_heads,
    head_dim=args.head_dim,
    batch=args.batch,
    dtype=args.dtype,
  )


def main(argv=None):
  args = parse_args(argv)
  if isinstance(args.model, str) and not args.train:
    print("aot.py: --model NAME compiles a training step: add --train", file=sys.stderr)
    return 2
  if args.document_bound is not None and args.model:
    print("aot.py: --document-bound compiles ring attention alone: drop --model", file=sys.stderr)
    return 2
  if args.document_bound not in (None, "auto") and args.document_bound < 1:
    print(f"aot.py: --document-bound {args.document_bound}: must be at least 1", file=sys.stderr)
    return 2
  target = aot.target(args.target)
  try:
    mesh = aot.target_mesh(args.target, linked=not args.make_mesh)
  except RuntimeError as e:  # no compiler for the target: say what to install, no traceback
    print(f"aot.py: {e}", file=sys.stderr)
    return 2
  result = {"target": args.target, "kernel": args.kernel, "model": args.model}
  if args.document_bound is not None:
    result["document_bound"] = args.document_bound
  device = mesh.devices.flat[0]
  choice = choose_kernel(
    args.kernel, device.platform, args.head_dim, policy_for(device), device_kind=device.device_kind
  )
  result["kernel_resolved"], result["kernel_reason"] = choice.kernel, choice.reason
  kept = {}  # --max-length: the longest program that fit, by its length, for the report below
  if args.max_length:
    budget = (args.budget_gib * 2**30) if args.budget_gib else target.memory_bytes
    step = args.granularity or 2 * target.devices * 1024

    tried = {}  # what each length tried gave

    def fits(length: int) -> bool:
      try:
        compiled = compile_for(mesh, args, length)
      except Exception as e:  # a compiler that refuses a size (out of memory) says so
        if "memory" in str(e).lower() or "RESOURCE_EXHAUSTED" in str(e):
          tried[length] = "refused by the compiler"
          return False
        raise
      memory = compiled.memory_analysis()
      used = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
      if isinstance(args.model, str):  # donated weights and optimizer state: outputs reuse them
        used -= memory.alias_size_in_bytes
      host = int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)
      tried[length] = dict(used_gib=used / 2**30, host_gib=host / 2**30)
      if args.host_budget_gib is not None and host > args.host_budget_gib * 2**30:
        return False
      if args.hidden:
        tried[length]["hidden"] = aot.transfers_hidden(aot.report(compiled))
        if not tried[length]["hidden"]:
          return False
      if used > budget:
        return False
      kept.clear()
      kept[length] = compiled
      return True

    result["budget_gib"] = budget / 2**30
    result["max_length"] = aot.max_length(fits, step, args.upper, step)
    result["tried"] = {str(k): v for k, v in sorted(tried.items())}
    args.seq_len = result["max_length"] or step
  compiled = kept.get(args.seq_len) or compile_for(mesh, args, args.seq_len)
  result["seq_len"] = args.seq_len
  result |= aot.report(compiled)
  if args.document_bound == "auto":  # one branch per schedule the ids may pick, forward and backward
    from jax_ring import hlo

    result["branch_collective_bytes"] = hlo.branch_collective_bytes(compiled)
  result["attention_hidden"] = aot.attention_hidden(result)
  result["transfers_hidden"] = aot.transfers_hidden(result)
  if isinstance(args.model, str):
    from jax_ring.models.train import step as train_step

    budget = (args.budget_gib * 2**30) if args.budget_gib else target.memory_bytes
    result["memory"] = train_step.step_memory(compiled, int(budget))
    result["fits"] = result["memory"]["fits"]
    from jax_ring import models

    cfg = models.config(args.model)
    if hasattr(cfg, "num_experts") and args.capacity_factor is None:
      # The experts take exactly the tokens routed to them (`moe.run_experts`): no
      # capacity, so none is dropped.
      result["dropped_tokens"] = 0
    elif hasattr(cfg, "num_experts"):
      # Each expert's buffer in a group (a device's tokens, one feed-forward chunk of
      # them); the pairs dropped depend on the routing, counted by each step.
      from jax_ring.models.architectures import decoder, moe

      group = args.batch * decoder.chunk_tokens(args.seq_len // target.devices)
      result["capacity"] = dict(
        factor=args.capacity_factor,
        group_tokens=group,
        per_expert=moe.capacity(group, cfg.num_experts_per_tok, cfg.num_experts, args.capacity_factor),
      )
  if not args.model:
    shape = dict(
      heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, is_causal=not args.no_causal
    )
    result["balance"] = aot.step_balance(result, target, seq_len=args.seq_len, batch=args.batch, **shape)
    result["break_even_tokens"] = aot.break_even_tokens(target, **shape)
    result["link_source"] = aot.target(args.target).link_source
    result["flops_per_device"] = (
      aot.attention_flops(
        seq_len=args.seq_len,
        heads=args.heads,
        head_dim=args.head_dim,
        batch=args.batch,
        is_causal=not args.no_causal,
        backward=not args.forward_only,
      )
      / target.devices
    )
  if args.json:
    print(json.dumps(result))
    return
  what = "DecoderLM step" if args.model else "ring attention"
  if isinstance(args.model, str):
    what = step_heading(args.model, args.layers, args.remat)
  print(f"{args.target}: {what}, T={args.seq_len}, kernel={args.kernel}: {result['kernel_resolved']}")
  print(f"  ({result['kernel_reason']})")
  if "max_length" in result:
    print(f"  longest sequence within {result['budget_gib']:.1f} GiB per device: {result['max_length']}")
  print(f"  memory per device: temp {result['temp_mib']:.1f} MiB, arguments {result['argument_mib']:.1f} MiB")
  if "memory" in result:
    m = {k: v / 2**30 for k, v in result["memory"].items() if k.endswith("bytes")}
    print(
      f"  peak {m['peak_bytes']:.2f} GiB of {target.memory_bytes / 2**30:.0f} GiB "
      f"(arguments {m['argument_bytes']:.2f}, "
      f"outputs {m['output_bytes']:.2f}, aliased {m['alias_bytes']:.2f}, temp {m['temp_bytes']:.2f}): "
      f"{'fits' if result['fits'] else 'does NOT fit'}"
    )
    if m.get("host_temp_bytes"):
      print(f"  host memory per device (offloaded layer inputs): {m['host_temp_bytes']:.2f} GiB")
      # XLA's rematerialization pass runs before host offloading and counts the offloaded
      # stack as device memory: its "Can't reduce memory use below" warning above is about
      # peak + host, not the compiled program (docs/guides/training.md, "Layer inputs").
      print(
        '  (where XLA warned "Can\'t reduce memory use below ...", its figure counts these host '
        "bytes as device memory; the peak above is the compiled program's)"
      )
  for op, n in sorted(result["collective_bytes"].items()):
    print(f"  {op}: {n / 2**20:.1f} MiB per device")
  for op, (count, n) in sorted(result["outside_loops"].items()):
    print(f"  outside the loops: {count} x {op}, {n / 2**20:.1f} MiB per device")
  for step in result["ring_steps"]:
    state = "overlapped" if step["overlapped"] else "NOT overlapped"
    if not step["overlapped"] and step["starts"] and not step["exposed"]:
      state = "every transfer hidden"  # some compute runs with no transfer in flight
    print(
      f"  {step['name'] or 'ring loop'} ({step['body']}): {step['starts']} async / {step['synchronous']} "
      f"sync permutes; {step['hidden']} of {step['compute']} compute ops under a transfer; per step "
      f"{step['hidden_bytes'] / 2**20:.1f} MiB sent under compute, {step['exposed_bytes'] / 2**20:.1f} MiB "
      f"exposed: {state}"
    )
  for row in result.get("balance", []):
    if row["compute_us"] is not None:
      print(
        f"  {row['name']}: transfer {row['transfer_us']:.0f} us vs compute {row['compute_us']:.0f} us at "
        f"peak per step: {row['bound']}-bound"
      )
  if "break_even_tokens" in result:
    even = result["break_even_tokens"]
    local = args.seq_len // target.devices
    print(
      f"  transfers outlast compute below {even['forward']:.0f} (forward) and {even['backward']:.0f} "
      f"(backward) tokens per device at peak; this run has {local}"
    )
    print(f"  ({result['link_source']})")
  if args.model:  # every collective of the step, by where it runs and what it comes from
    groups: dict = {}
    for c in result["collectives"]:
      scope = [p for p in c["source"].split("/") if p and not p.startswith("jit(")]
      key = (c["op"], c["where"] or "outside the loops", "/".join(scope[:2]), c["exposed"])
      entry = groups.setdefault(key, [0, 0])
      entry[0] += 1
      entry[1] += c["bytes"]
    print("  collectives (count x, MiB each run summed; where; from):")
    for (op, where, source, exposed), (n, size) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
      state = "EXPOSED" if exposed else "under compute"
      print(f"    {op}: {n} x, {size / 2**20:.1f} MiB; {where}; {source or '?'}; {state}")
  for name, programs in sorted(result["launch_grids"].items()):
    print(f"  {name}: {programs} programs per launch")
  for name, grid in sorted(result["tpu_grids"].items()):
    axes = " x ".join(
      f"{n}{'' if par else ' (sequential)'}" for n, par in zip(grid["bounds"], grid["parallel"])
    )
    print(f"  {name}: grid {axes}")
  if "flops_per_device" in result:
    print(f"  attention FLOPs per device (formula): {result['flops_per_device']:.3e}")


if __name__ == "__main__":
  sys.exit(main())
