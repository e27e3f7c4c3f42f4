"""RULER (Hsieh et al. 2024, arXiv 2404.06654) through EleutherAI's lm-evaluation-harness,
with a model read over the ring and by the main job's baselines:

    bash scripts/run_ruler.sh                      # set-up, then this script
    python scripts/ruler.py --lengths 4096 8192 --limit 5 --model PATH

For each length it builds the tasks' documents once (the harness's RULER tasks, sized
with the model's tokenizer, saved to OUT/tokenizer for them), then has each reader
answer the first `--limit` of them with the `jax_ring` model type
(`jax_ring.models.eval.harness`): "ring" (every token over the ring of `--devices`),
"local" (the prompt's last 1/devices, what shard-local attention's last device
sees) and "last" (BOS and the prompt's last 4,096 tokens). The harness scores the
answers. Writes OUT/report.json (scores per reader, task and length, seconds per
reader and length, every answer) and OUT/report.png (a heatmap per reader).

The tasks that run offline: niah_single_1 (the "repeat" haystack), niah_multikey_2
and niah_multikey_3 (haystacks of needles), ruler_vt, ruler_cwe and ruler_fwe (words
made here); the others read Paul Graham's essays or SQuAD/HotpotQA from the Hugging
Face hub.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: Gemma 3 270M)")
  p.add_argument("--devices", type=int, default=8, help="devices of the ring, simulated on a CPU (default 8)")
  p.add_argument(
    "--lengths",
    type=int,
    nargs="+",
    default=[4096, 8192, 16384, 32768],
    help="RULER's lengths (default 4K-32K)",
  )
  p.add_argument(
    "--tasks",
    nargs="+",
    default=["niah_single_1", "niah_multikey_2"],
    help="offline RULER tasks (default niah_single_1 niah_multikey_2)",
  )
  p.add_argument(
    "--readers",
    nargs="+",
    default=["ring", "local", "last"],
    choices=("ring", "local", "last"),
    help="who answers (default: all three)",
  )
  p.add_argument("--limit", type=int, default=3, help="documents per task and length (default 3)")
  p.add_argument(
    "--max-gen-toks", type=int, default=32, help="cap on generated tokens; RULER asks 30-128 (default 32)"
  )
  p.add_argument(
    "--out", default="results/ruler", help="folder for report.json and report.png (default results/ruler)"
  )
  args = p.parse_args(argv)
  unknown = [t for t in args.tasks if t not in OFFLINE_TASKS]
  if unknown:
    p.error(f"--tasks {unknown}: need downloads; the offline RULER tasks are {list(OFFLINE_TASKS)}")
  if args.limit < 1 or args.max_gen_toks < 1:
    p.error("--limit and --max-gen-toks must be positive")
  return args


def score(results: dict, task: str, length: int) -> float:
  """The harness's RULER score of a task at a length (its metric is named by the length)."""
  return float(results["results"][task][f"{length},none"])


def plot(report: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  readers, tasks, lengths = report["readers"], report["tasks"], report["lengths"]
  size = (3.2 * len(readers), 0.5 * len(tasks) + 1.6)
  fig, axes = plt.subplots(1, len(readers), figsize=size, squeeze=False)
  for ax, reader in zip(axes[0], readers, strict=True):
    grid = [[report["scores"][reader][t][str(n)] for n in lengths] for t in tasks]
    ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
    ax.set_yticks(range(len(tasks)), tasks if ax is axes[0][0] else [""] * len(tasks))
    ax.set_title(reader)
    for i, row in enumerate(grid):
      for j, v in enumerate(row):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
  fig.suptitle(f"RULER (lm-evaluation-harness), {report['limit']} documents per cell")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  args = parse_args(argv)
  from jax_ring.models import runtime

  runtime.simulate_devices(args.devices)
  from lm_eval.evaluator import evaluate

  from jax_ring.models.eval import harness
  from jax_ring.models.formats import tokenizer_json as tokenizer_files

  out = Path(args.out)
  (out / "tokenizer").mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  lms = {
    r: harness.RingLM(path=args.model, devices=args.devices, reader=r, max_gen_toks=args.max_gen_toks)
    for r in args.readers
  }
  any_lm = next(iter(lms.values()))
  tokenizer_files.save_tokenizer(any_lm.tok, out / "tokenizer", context_length=any_lm.context_length)
  report = dict(
    model=any_lm.path,
    devices=args.devices,
    lengths=args.lengths,
    tasks=args.tasks,
    readers=args.readers,
    limit=args.limit,
    max_gen_toks=args.max_gen_toks,
    scores={r: {t: {} for t in args.tasks} for r in args.readers},
    seconds={r: {} for r in args.readers},
    prepare_s={},
    answers=[],
    load_s=round(time.perf_counter() - start, 1),
  )
  print(f"loaded {any_lm.path} for {args.readers} in {report['load_s']} s", flush=True)
  for length in args.lengths:
    t0 = time.perf_counter()
    metadata = {"max_seq_lengths": [length], "tokenizer": str(out / "tokenizer")}
    tasks = harness.ruler_tasks(args.tasks, metadata)
    report["prepare_s"][str(length)] = round(time.perf_counter() - t0, 1)
    for reader, lm in lms.items():
      t0 = time.perf_counter()
      results = evaluate(lm, tasks, limit=args.limit, bootstrap_iters=0, verbosity="WARNING")
      report["seconds"][reader][str(length)] = round(time.perf_counter() - t0, 1)
      for task in args.tasks:
        report["scores"][reader][task][str(length)] = score(results, task, length)
        for s in results["samples"][task]:
          report["answers"].append(
            dict(reader=reader, task=task, length=length, target=s["target"], answer=s["resps"][0][0])
          )
      cells = "  ".join(f"{t} {report['scores'][reader][t][str(length)]:.2f}" for t in args.tasks)
      print(f"{length:6d} {reader:6s} {cells}  ({report['seconds'][reader][str(length)]} s)", flush=True)
  (out / "report.json").write_text(json.dumps(report, indent=1))
  plot(report, out / "report.png")
  print("| reader | task | " + " | ".join(str(n) for n in args.lengths) + " |")
  print("|---|---|" + "---|" * len(args.lengths))
  for r in args.readers:
    for t in args.tasks:
      cells = " | ".join(f"{report['scores'][r][t][str(n)]:.2f}" for n in args.lengths)
      print(f"| {r} | {t} | {cells} |")
  print(f"wrote {out / 'report.json'} and report.png in {time.perf_counter() - start:.0f} s")
  return report


if __name__ == "__main__":
  main()
