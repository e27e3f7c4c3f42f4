"""Fine-tunes a pretrained model (a GGUF file or a Hugging Face folder of any of the nine
families models.load reads: Llama 3, Mistral, Qwen 2.5, Qwen 3, Qwen3-MoE, OLMo 2,
Phi-3, Gemma 3, Mixtral) over the ring: every layer's attention over the devices, AdamW with warmup,
cosine decay and clipping, the loss chunked so the [T, vocab] logits never exist, the
weights and optimizer state split over the devices with --fsdp (models.train.finetune).

Data: your own (--data: a .jsonl, .json, .parquet or .txt file, a folder of them, or a
folder datasets' save_to_disk wrote), packed into rows of --length tokens; else the
main job's long documents (filler with five facts, then a question; the loss on the
answer's tokens), or windows of a text file (--text; the loss on every token). The
format comes from the columns: "text" (the loss on every token), "prompt" and
"completion" (the loss on the completion), "messages" (a chat in the model's own
template; the loss on the assistant's turns).

    python scripts/finetune.py PATH [--data FILE_OR_DIR [--format text|completion|chat]
        [--columns NAME=COLUMN,...] [--chat-template FILE] [--long split|truncate|drop]
        [--skip-bad] [--eval-data E | --eval-fraction F] [--eval-every K]]
        [--length T] [--steps N] [--devices D] [--fsdp | --no-fsdp] [--lr LR] [--out DIR]
        [--remat full|attention|offload|none] [--dtype float32|bfloat16] [--capacity-factor C]
        [--no-progress] [--objective sft|dpo [--loss-type T --beta B --reference REF ...]]
        [--objective grpo --reward MODULE:FUNCTION --num-generations G --max-completion-length N ...]
        [--lora-rank R [--lora-alpha A] [--lora-targets q,k,v,o,gate,up,down] [--merge]]

Preference tuning (--objective dpo): pairs with "prompt", "chosen" and "rejected"
columns (strings or messages; "chosen" and "rejected" alone: the prompt is their common
start), tokenized as TRL's DPOTrainer does, each pair's two sequences whole in one row;
TRL's DPO loss (--loss-type, --beta, --label-smoothing) against the reference: the
initial weights (with --lora-rank the base, adapters off), or --reference PATH, its
log-probabilities computed at each step or once before training
(--precompute-reference); metrics.jsonl then holds TRL's "rewards/..." and "logps/...".

Reinforcement learning from rewards (--objective grpo): records with a "prompt" column
(a string or messages; the other columns go to the reward functions), each continued
--num-generations times by the generation engine over the ring (--temperature, --top-p,
--top-k, up to --max-completion-length tokens), scored by --reward module:function (or
file.py:function; repeatable, --reward-weights), TRL's GRPO loss (--loss-type, --beta,
--epsilon, --epsilon-high, --scale-rewards, --num-iterations) on the completions packed
with their prompts; DIR/rollouts.jsonl holds every completion, its rewards and advantage.

Writes DIR/metrics.jsonl and TensorBoard event files in DIR/tb/ as each step ends
(loss, gradient norm, learning rate, tokens, padding, tokens/s; the evaluation loss),
DIR/report.json ("steps": every step's record; "memory": per device param_bytes,
optimizer_bytes and the step's compiled temp_bytes; "data": rows and padding),
DIR/state/ (orbax: weights, optimizer state and step, and the data's place; run again
with the same arguments, or more --steps, to go on from there with the same losses) and
DIR/checkpoint/ (models.save's layout: models.load and transformers read it). With
--lora-rank only low-rank adapters train (the base frozen): DIR/adapter/ in PEFT's
layout, and DIR/checkpoint/ merged with --merge. Several
processes: scripts/launch.py, or --coordinator --num-processes --process-id (--devices
is then each process's); each tokenizes its share of --data. SIGTERM or SIGINT saves
the state and exits 0 (a second SIGINT stops at once). A bad data record exits 1 naming
its file and line before anything is written (--skip-bad leaves such records out and
counts them).
"""

from __future__ import annotations

import os
import signal
import sys

# SIGTERM and SIGINT from the first moment: the run stops where it can without losing
# anything (models.train.finetune's `stop`), set-up and export included.
# A second SIGINT (Ctrl-C again) stops at once, as a SIGKILL would: the state saved
# last stays (it is written whole or not at all), and the run resumes from it. Not by
# KeyboardInterrupt, which a signal arriving in a garbage-collection callback loses.
STOP: dict = {}


def _on_signal(number, frame):
  if number == signal.SIGINT and "signal" in STOP:
    print("finetune.py: SIGINT again: stopped at once", file=sys.stderr, flush=True)
    os._exit(130)
  STOP.setdefault("signal", number)


if __name__ == "__main__":
  for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, _on_signal)

import argparse  # noqa: E402 - after the handlers: importing JAX takes seconds
import resource  # noqa: E402

from jax_ring.models import cli, runtime  # noqa: E402


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("path", help="a GGUF file or a Hugging Face folder")
  p.add_argument(
    "--length", type=int, default=None, help="tokens per sequence (default 1024; grpo: a group's documents)"
  )
  p.add_argument(
    "--steps", type=int, default=4, help="optimizer steps in all (a resumed run goes on to this)"
  )
  p.add_argument("--batch", type=int, default=1, help="sequences per step")
  p.add_argument(
    "--fsdp", action=argparse.BooleanOptionalAction, default=True, help="split weights and AdamW"
  )
  p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
  p.add_argument("--warmup", type=int, default=1, help="warmup steps")
  p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
  p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
  p.add_argument("--chunk", type=int, default=512, help="tokens per chunk of the loss")
  p.add_argument(
    "--remat",
    default="attention",
    choices=("none", "full", "attention", "offload"),
    help="what a layer keeps (offload: its input, in host memory)",
  )
  p.add_argument("--dtype", default=None, help="compute and weight dtype (default float32)")
  p.add_argument(
    "--capacity-factor",
    type=float,
    default=None,
    help="a mixture of experts: each expert takes at most this x its even share of a device's tokens "
    "(dropped pairs are counted in report.json); default: none dropped",
  )
  p.add_argument("--text", default=None, help="train on windows of this text file instead of the documents")
  p.add_argument("--data", default=None, help="your data: a .jsonl/.json/.parquet/.txt file or a folder")
  p.add_argument(
    "--format",
    default=None,
    choices=("text", "completion", "chat", "preference", "implicit_preference"),
    help="default: from the columns",
  )
  p.add_argument(
    "--objective",
    default="sft",
    choices=("sft", "dpo", "grpo"),
    help="sft: the next token on the weighted tokens; dpo: preference pairs (TRL's DPO); grpo: "
    "completions sampled for prompts and scored by --reward functions (TRL's GRPO)",
  )
  p.add_argument(
    "--loss-type",
    default=None,
    choices=("sigmoid", "ipo", "hinge", "grpo", "bnpo", "dr_grpo", "dapo"),
    help="TRL's loss type: dpo sigmoid, ipo or hinge; grpo dapo, grpo, bnpo or dr_grpo "
    "(default: sigmoid for dpo, dapo for grpo)",
  )
  p.add_argument(
    "--beta",
    type=float,
    default=None,
    help="the weight of the deviation from the reference (dpo: 0.1; grpo: the KL's, 0: no reference)",
  )
  p.add_argument(
    "--reward",
    action="append",
    default=[],
    help="grpo: a reward function, module:function or file.py:function (repeatable)",
  )
  p.add_argument("--reward-weights", default=None, help="grpo: the functions' weights, comma-separated")
  p.add_argument("--num-generations", type=int, default=8, help="grpo: completions a prompt (G)")
  p.add_argument("--max-completion-length", type=int, default=256, help="grpo: tokens a completion at most")
  p.add_argument("--temperature", type=float, default=1.0, help="grpo: the sampling temperature")
  p.add_argument("--top-p", type=float, default=None, help="grpo: sample from the top-p mass")
  p.add_argument("--top-k", type=int, default=None, help="grpo: sample from the k likeliest tokens")
  p.add_argument("--epsilon", type=float, default=0.2, help="grpo: the ratio's clip below 1")
  p.add_argument(
    "--epsilon-high", type=float, default=None, help="grpo: its clip above 1 (default --epsilon)"
  )
  p.add_argument(
    "--scale-rewards", default="group", choices=("group", "batch", "none"), help="grpo: advantages' scale"
  )
  p.add_argument("--num-iterations", type=int, default=1, help="grpo: steps on each rollout (TRL's mu)")
  p.add_argument(
    "--label-smoothing", type=float, default=0.0, help="dpo sigmoid: the chance a preference is flipped"
  )
  p.add_argument("--reference", default=None, help="dpo: the reference model (default: the initial weights)")
  p.add_argument(
    "--reference-dtype", default=None, help="dpo without adapters: the frozen copy's dtype (bfloat16)"
  )
  p.add_argument(
    "--precompute-reference",
    action="store_true",
    help="dpo: the reference's log-probabilities computed once before training (cached)",
  )
  p.add_argument(
    "--truncation-mode",
    default="keep_end",
    choices=("keep_end", "keep_start"),
    help="dpo: a pair longer than --length keeps each sequence's end or start",
  )
  p.add_argument(
    "--columns",
    default=None,
    help="the data's names for the format's columns: prompt=question,completion=answer",
  )
  p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
  p.add_argument(
    "--long",
    default=None,
    choices=("split", "truncate", "drop"),
    help="examples longer than --length (default: split; dpo's pairs: truncate)",
  )
  p.add_argument(
    "--skip-bad", action="store_true", help="leave bad records out (counted) instead of stopping"
  )
  p.add_argument("--eval-data", default=None, help="held-out data for the evaluation loss")
  p.add_argument("--eval-fraction", type=float, default=0.0, help="hold out this fraction of --data instead")
  p.add_argument("--eval-every", type=int, default=0, help="evaluation loss every K steps (0: at the end)")
  p.add_argument("--lora-rank", type=int, default=None, help="train low-rank adapters of this rank alone")
  p.add_argument("--lora-alpha", type=float, default=None, help="the adapters' alpha (default: 2 x rank)")
  p.add_argument(
    "--lora-targets", default="q,k,v,o,gate,up,down", help="projections to adapt: q, k, v, o, gate, up, down"
  )
  p.add_argument("--merge", action="store_true", help="with --lora-rank: also write the merged model")
  p.add_argument(
    "--no-progress", action="store_true", help="no progress bar (metrics.jsonl still gets every step)"
  )
  p.add_argument("--cache-dir", default=None, help="tokenized data cache (default: ~/.cache/jax_ring/data)")
  p.add_argument(
    "--every-pass",
    action="store_true",
    help="every ring pass, not only those the rows' longest document needs (the same losses)",
  )
  p.add_argument(
    "--bound-per-batch",
    action="store_true",
    help="the passes each batch's own longest document needs, read from its ids while running "
    "(document_bound='auto'; the same losses)",
  )
  p.add_argument(
    "--row-layout",
    default="natural",
    choices=("natural", "documents"),
    help="'documents': each packed row reordered so that the zig-zag ring's busiest device runs fewer "
    "score tiles (jax_ring.layouts.zigzag_documents; the same losses; not for preference pairs)",
  )
  p.add_argument(
    "--save-every", type=int, default=0, help="orbax state every this many steps (0: at the end)"
  )
  p.add_argument("--seed", type=int, default=0, help="seed of the data")
  p.add_argument("--out", default="results/finetune", help="folder for report.json, state/ and checkpoint/")
  runtime.add_flags(p)  # --devices (a process's), and the flags of several processes
  return p.parse_args(argv)


def load_data(args, tokenizer):
  """(training loader, evaluation loader or None) of --data and --eval-data (or
  --eval-fraction of --data): checked and tokenized (cached) before anything is
  written; a bad record exits naming its file and line."""
  from jax_ring.models.data import pipeline, sources
  from jax_ring.models.formats.gguf import cache_root

  columns = None
  if args.columns:
    try:
      columns = dict(pair.split("=", 1) for pair in args.columns.split(","))
    except ValueError:
      raise SystemExit(
        f"finetune.py: --columns {args.columns!r}: expected NAME=COLUMN pairs, comma-separated"
      ) from None
  template = None
  if args.chat_template is not None:
    from jax_ring.models.data.chat import chat_template

    template = chat_template(args.chat_template)
    tokenizer.chat_template = (
      template  # the checkpoint's tokenizer_config.json carries the template trained with
    )
  if not 0.0 <= args.eval_fraction < 1.0 or (args.eval_fraction and args.eval_data):
    raise SystemExit(
      f"finetune.py: --eval-fraction {args.eval_fraction}: a fraction in [0, 1), and not with --eval-data"
    )
  import jax

  cache = args.cache_dir or cache_root() / "data"
  processes = None
  if jax.process_count() > 1:  # each process tokenizes its share of the records
    from jax.experimental import multihost_utils

    barrier = lambda: multihost_utils.sync_global_devices("finetune.py: tokenized shares")
    processes = (jax.process_index(), jax.process_count(), barrier)
  if args.objective == "grpo":
    return load_prompts(args, tokenizer, columns, template)
  read = lambda path: pipeline.load_examples(
    path,
    tokenizer,
    format=args.format,
    columns=columns,
    skip_bad=args.skip_bad,
    chat_template=template,
    cache_dir=cache,
    processes=processes,
  )
  try:
    examples = read(args.data)
    held = read(args.eval_data) if args.eval_data else None
    if args.eval_fraction:
      examples, held = pipeline.split_off(examples, args.eval_fraction, seed=args.seed)
    pairs = examples.format in sources.PREFERENCE
    if pairs != (args.objective == "dpo"):
      raise ValueError(
        f"{args.data}: {examples.format} records"
        + (
          " need --objective dpo"
          if pairs
          else f" are not preference pairs, which --objective {args.objective} needs"
        )
      )
    pad = tokenizer.pad_id or 0
    settings = dict(long=args.long, pad_id=pad, truncation=args.truncation_mode)
    if args.row_layout != "natural":
      settings.update(row_layout=args.row_layout, shards=args.ring)
    loader = pipeline.Loader(examples, args.length, args.batch, seed=args.seed, **settings)
    evaluator = None
    if held is not None:
      evaluator = pipeline.Loader(held, args.length, args.batch, shuffle=False, **settings)
  except (ValueError, sources.BadRecord) as e:
    raise SystemExit(f"finetune.py: {e}") from None
  why = f"--long {args.long}"
  if pairs and args.long == "truncate":
    why = f"--truncation-mode {args.truncation_mode} left a completion nothing to learn"
  print(
    f"finetune.py: {len(examples)} {examples.format} "
    + ("pairs" if pairs else "examples")
    + (" (tokenized earlier: cached)" if examples.cached else "")
    + (
      f" (this process tokenized {examples.tokenized}, its share)"
      if processes is not None and not examples.cached
      else ""
    )
    + f" in {len(loader.rows)} rows of {args.length} tokens, {100 * loader.padding:.1f}% padding"
    + (f"; {len(examples.skipped)} bad records skipped" if examples.skipped else "")
    + (
      f"; {len(loader.dropped)} {'pairs' if pairs else 'examples'} dropped ({why})" if loader.dropped else ""
    )
    + (f"; {loader.idle_rows} rows with nothing to learn left out" if loader.idle_rows else "")
    + (
      ""
      if evaluator is None
      else f"; evaluation: {len(evaluator.examples)} examples in {len(evaluator.rows)} rows"
    )
  )
  return loader, evaluator


def load_prompts(args, tokenizer, columns, template):
  """(grpo's prompts loader, None) of --data: checked and tokenized before anything is
  written; the rows' length from --length or the prompts (`grpo.Prompts`)."""
  from jax_ring.models.data import sources
  from jax_ring.models.train import grpo

  if args.eval_data or args.eval_fraction:
    raise SystemExit(
      "finetune.py: --objective grpo has no evaluation: leave out --eval-data and --eval-fraction"
    )
  try:
    prompts, where, skipped = grpo.read_prompts(
      args.data, tokenizer, columns=columns, chat_template=template, skip_bad=args.skip_bad
    )
    loader = grpo.Prompts(
      prompts, where, skipped, tokenizer, grpo_config(args), batch=args.batch, length=args.length,
      seed=args.seed, context=args.context,
    )  # fmt: skip
  except (ValueError, sources.BadRecord) as e:
    raise SystemExit(f"finetune.py: {e}") from None
  args.length = loader.length
  print(
    f"finetune.py: {len(prompts)} prompts (the longest {loader.longest_prompt} tokens)"
    + (f"; {len(skipped)} bad records skipped" if skipped else "")
    + f"; {args.batch} a step x {args.num_generations} completions of up to {args.max_completion_length} "
    f"tokens, in {loader.rows_per_step} rows of {loader.length} tokens"
  )
  return loader, None


def grpo_config(args):
  from jax_ring.models.train import grpo

  weights = None
  if args.reward_weights is not None:
    try:
      weights = tuple(float(w) for w in args.reward_weights.split(","))
    except ValueError:
      raise SystemExit(
        f"finetune.py: --reward-weights {args.reward_weights!r}: numbers, comma-separated"
      ) from None
  try:
    return grpo.GRPOConfig(
      num_generations=args.num_generations, max_completion_length=args.max_completion_length,
      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, beta=args.beta,
      epsilon=args.epsilon, epsilon_high=args.epsilon_high, loss_type=args.loss_type,
      scale_rewards=args.scale_rewards, num_iterations=args.num_iterations, reward_weights=weights,
    )  # fmt: skip
  except ValueError as e:
    raise SystemExit(f"finetune.py: --{str(e).split('=')[0].replace('_', '-')}: {e}") from None


def load_rewards(specs) -> list:
  """(name, function) of each --reward: module:function (a module importable from here
  or the working folder) or path/to/file.py:function."""
  import importlib
  import importlib.util

  out = []
  for spec in specs:
    module, _, name = spec.rpartition(":")
    if not module or not name:
      raise SystemExit(f"finetune.py: --reward {spec!r}: module:function or file.py:function")
    try:
      if module.endswith(".py"):
        if not os.path.isfile(module):
          raise SystemExit(f"finetune.py: --reward {spec!r}: no such file {module}")
        loaded = importlib.util.spec_from_file_location(os.path.basename(module)[:-3], module)
        mod = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(mod)
      else:
        if os.getcwd() not in sys.path:
          sys.path.append(os.getcwd())
        mod = importlib.import_module(module)
    except SystemExit:
      raise
    except Exception as e:  # noqa: BLE001 - importing the user's module: any error, named
      raise SystemExit(
        f"finetune.py: --reward {spec!r}: importing {module} raised {type(e).__name__}: {e}"
      ) from None
    fn = getattr(mod, name, None)
    if not callable(fn):
      raise SystemExit(f"finetune.py: --reward {spec!r}: {module} has no function {name}")
    out.append((name, fn))
  return out


def make_objective(args, mesh, models, tokenizer=None):
  """The run's objective (`models.train.objective.make`) from the flags."""
  from jax_ring.models.train import dpo, objective

  if args.objective == "sft":
    return objective.make("sft")
  if args.objective == "grpo":
    try:
      return objective.make(
        "grpo", config=grpo_config(args), rewards=load_rewards(args.reward), tokenizer=tokenizer,
        seed=args.seed, reference_dtype=args.reference_dtype,
      )  # fmt: skip
    except (ValueError, TypeError) as e:
      raise SystemExit(f"finetune.py: --reward: {e}") from None
  try:
    config = dpo.DPOConfig(args.loss_type, args.beta, args.label_smoothing)
  except ValueError as e:
    raise SystemExit(f"finetune.py: --loss-type/--beta/--label-smoothing: {e}") from None
  reference, key = "initial", None
  if args.reference is not None:
    from jax_ring.models.train import finetune

    reference, _ = models.load(args.reference, mesh=mesh, fsdp=args.fsdp, dtype=args.reference_dtype)
    key = finetune.base_record(reference, args.reference)
  elif args.reference_dtype is not None and args.lora_rank is not None:
    raise SystemExit("finetune.py: --reference-dtype: with adapters the reference is the base itself")
  return objective.make(
    "dpo",
    config=config,
    reference=reference,
    reference_dtype=args.reference_dtype,
    precompute=args.precompute_reference,
    reference_key=key,
  )


def check_paths(args) -> None:
  """Every path argument, before anything is loaded: each refusal one line."""
  if not os.path.exists(args.path):
    raise SystemExit(
      f"finetune.py: {args.path}: no such file or folder (a GGUF file or a Hugging Face folder)"
    )
  for flag, path, kind in (
    ("--text", args.text, "file"),
    ("--chat-template", args.chat_template, "file"),
    ("--data", args.data, "file or folder"),
    ("--reference", args.reference, "file or folder"),
    ("--eval-data", args.eval_data, "file or folder"),
  ):
    if path is not None and not os.path.exists(path):
      raise SystemExit(f"finetune.py: {flag} {path}: no such {kind}")
    if path is not None and kind == "file" and not os.path.isfile(path):
      raise SystemExit(f"finetune.py: {flag} {path}: a folder, not a file")


def main(argv=None):
  args = parse_args(argv)
  if args.long is None:
    args.long = "truncate" if args.objective == "dpo" else "split"
  if args.objective == "dpo" and args.data is None:
    raise SystemExit("finetune.py: --objective dpo needs --data: preference pairs")
  losses = {"dpo": ("sigmoid", "ipo", "hinge"), "grpo": ("grpo", "bnpo", "dr_grpo", "dapo")}
  if args.loss_type is not None and args.loss_type not in losses.get(args.objective, ()):
    raise SystemExit(
      f"finetune.py: --loss-type {args.loss_type}: --objective {args.objective} takes "
      + (", ".join(losses[args.objective]) if args.objective in losses else "none")
    )
  args.loss_type = args.loss_type or {"dpo": "sigmoid", "grpo": "dapo"}.get(args.objective)
  args.beta = args.beta if args.beta is not None else {"grpo": 0.0}.get(args.objective, 0.1)
  if args.objective == "grpo":
    if args.data is None:
      raise SystemExit("finetune.py: --objective grpo needs --data: prompts")
    if not args.reward:
      raise SystemExit("finetune.py: --objective grpo needs --reward module:function (one or more)")
    if args.reference is not None or args.precompute_reference:
      raise SystemExit(
        "finetune.py: --objective grpo: the reference is the initial weights (--reference and "
        "--precompute-reference are dpo's)"
      )
    load_rewards(args.reward)  # named before the model loads
  elif args.reward:
    raise SystemExit("finetune.py: --reward scores completions of --objective grpo")
  if args.length is None and args.objective != "grpo":
    args.length = 1024
  args.context = None
  for name in ("steps", "devices", "length", "batch"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise SystemExit(f"finetune.py: --{name} {getattr(args, name)}: must be at least 1")
  check_paths(args)
  runtime.limit_malloc()  # before JAX starts its threads (run_demo.sh's settings)
  runtime.setup(args)
  import jax
  from flax import nnx

  from jax_ring import models
  from jax_ring.models.train import finetune
  from jax_ring.models.train import step as train_step

  # One ring over every process's devices (`--devices` a process's; all of them with one).
  devices = jax.devices() if jax.process_count() > 1 else jax.devices()[: args.devices]
  mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices)
  model, tokenizer = models.load(args.path, mesh=mesh, fsdp=args.fsdp, remat=args.remat, dtype=args.dtype)
  if tokenizer is None:
    raise SystemExit(
      f"{args.path}: no tokenizer.json beside the weights; the data needs the model's tokenizer"
    )
  if args.lora_rank is not None:
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    try:
      models.add_lora(model, rank=args.lora_rank, alpha=alpha, targets=tuple(args.lora_targets.split(",")))
    except ValueError as e:
      flag = next((f"--lora-{k}" for k in ("targets", "alpha") if str(e).startswith(k)), "--lora-rank")
      raise SystemExit(f"finetune.py: {flag}: {e}") from None
  elif args.merge:
    raise SystemExit("finetune.py: --merge merges adapters: it needs --lora-rank")
  if args.capacity_factor is not None:
    from jax_ring.models.architectures import moe

    try:
      moe.set_capacity(model, args.capacity_factor)
    except ValueError as e:
      raise SystemExit(f"finetune.py: --capacity-factor: {e}") from None
  text = None
  if args.text is not None:
    with open(args.text, encoding="utf-8") as f:
      text = f.read()
  data = eval_data = None
  args.context = model.config.context_length
  args.ring = len(devices)  # the ring's devices, which a row layout balances
  if args.row_layout == "documents" and devices[0].platform == "gpu":
    raise SystemExit(
      "finetune.py: --row-layout documents: on GPUs the ring runs cuDNN, whose calls take each document "
      "as one run of tokens, which reordered rows split (they would be NaN); leave --row-layout natural"
    )
  if args.data is not None:
    data, eval_data = load_data(args, tokenizer)
  config = finetune.FinetuneConfig(
    length=args.length,
    steps=args.steps,
    batch=args.batch,
    lr=args.lr,
    warmup=args.warmup,
    weight_decay=args.weight_decay,
    clip=args.clip,
    chunk=args.chunk,
    seed=args.seed,
    save_every=args.save_every,
    eval_every=args.eval_every,
    document_bound=False if args.every_pass else "auto" if args.bound_per_batch else True,
  )
  run = dict(
    path=args.path,
    devices=len(devices),
    processes=jax.process_count(),
    fsdp=args.fsdp,
    remat=args.remat,
    dtype=args.dtype,
    capacity_factor=args.capacity_factor,
    data=args.data,
    format=None if data is None else data.examples.format,
    long=args.long,
    row_layout=args.row_layout,
    eval_data=args.eval_data,
    eval_fraction=args.eval_fraction,
    lora=models.lora.adapter_record(model),
  )
  if args.fsdp and len(devices) > 1:
    whole = train_step.unsplit_bytes(model)
    if whole:
      weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
      share = (
        "every weight"
        if whole >= weights
        else f"{whole / 2**20:.0f} MiB of the {weights / 2**20:.0f} MiB of weights"
      )
      print(
        f"finetune.py: warning: --devices {len(devices)} divides no dimension of {share}, which FSDP keeps "
        f"whole on every device ({whole / 2**20:.0f} MiB a device, their AdamW moments too); the "
        "step's temporaries grow too, as the weights gather whole on each device; a device count that "
        "divides the model's widths (2, 4, 8) splits them all"
      )
  objective = make_objective(args, mesh, models, tokenizer)
  run["objective"] = args.objective
  if args.objective == "grpo":
    run.update(
      rewards=args.reward, reward_weights=args.reward_weights, num_generations=args.num_generations,
      max_completion_length=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
      top_k=args.top_k, beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
      loss_type=args.loss_type, scale_rewards=args.scale_rewards, num_iterations=args.num_iterations,
    )  # fmt: skip
  if args.objective == "dpo":
    run.update(
      loss_type=args.loss_type,
      beta=args.beta,
      label_smoothing=args.label_smoothing,
      reference=args.reference,
      reference_dtype=args.reference_dtype,
      precompute_reference=args.precompute_reference,
      truncation_mode=args.truncation_mode,
    )
  from jax_ring.models.formats.gguf import cache_root

  try:
    report = finetune.finetune(
      model,
      tokenizer,
      config,
      args.out,
      text=text,
      data=data,
      eval_data=eval_data,
      base=args.path,
      run=run,
      merge=args.merge,
      progress=not args.no_progress,
      objective=objective,
      cache_dir=args.cache_dir or cache_root() / "data",
      stop=STOP if __name__ == "__main__" else None,
    )
  except (ValueError, FloatingPointError) as e:
    raise SystemExit(f"finetune.py: {e}") from None
  if "interrupted" in report and not report.get("saved", True):
    print(f"finetune.py: {report['interrupted']} during the set-up: stopped before writing anything")
    return report
  if "interrupted" in report:
    done = report["steps"][-1]["step"] + 1 if report["steps"] else 0
    print(
      f"finetune.py: {report['interrupted']}: saved the state at step {done} in {args.out}/state/; "
      "run again to go on"
    )
    return report
  memory = report["memory"]
  steps = report["steps"]
  print(
    f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} over {len(steps)} steps; "
    f"per device: {'adapters' if 'frozen_bytes' in memory else 'weights'} "
    f"{memory['param_bytes'] / 2**20:.1f} MiB, "
    + (f"frozen base {memory['frozen_bytes'] / 2**20:.1f} MiB, " if "frozen_bytes" in memory else "")
    + f"optimizer {memory['optimizer_bytes'] / 2**20:.1f} MiB, "
    f"step temporaries {memory['temp_bytes'] / 2**20:.1f} MiB; "
    + (
      f"dropped (token, expert) pairs {steps[-1]['dropped_tokens']} in the last step; "
      if "dropped_tokens" in steps[-1]
      else ""
    )
    + f"peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
  )
  if args.objective == "grpo":
    rewards = [r["reward"] for r in steps if r.get("iteration") == 0 and r.get("reward") is not None]
    if rewards:
      print(f"mean reward {rewards[0]:.4f} -> {rewards[-1]:.4f} over {len(rewards)} rollouts")
  written = ["report.json", "state/"] + (["rollouts.jsonl"] if args.objective == "grpo" else [])
  written += ["adapter/"] if args.lora_rank is not None else []
  written += ["checkpoint/"] if args.lora_rank is None or args.merge else []
  print(f"wrote {', '.join(f'{args.out}/{w}' for w in written)}")
  return report


if __name__ == "__main__":
  main()
