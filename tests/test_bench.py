"""scripts/bench/bench.py --quick runs end to end on tiny sizes and writes its tables and plots."""

from pathlib import Path

import bench
import numpy as np
import pytest
from _harness import write_section


def test_quick_benchmark_writes_its_tables(tmp_path):
  out = tmp_path / "bench.md"
  out.write_text("# Benchmarks\n\nkept text\n")
  argv = ["--quick", "--lengths=256", "--devices=2", "--heads=2", "--head-dim=16", "--repeats=1"]
  argv += [
    "--budget-mib=2",
    "--max-length-devices=2",
    "--dense-max-length=256",
    "--ra-chunk=128",
    "--matmul-size=512",
  ]
  argv += [f"--out={out}", f"--plot-dir={tmp_path}"]
  bench.main(argv)
  lines = out.read_text().splitlines()[4:-1]  # the section's body
  write_section(str(out), "quick", "second run")  # replaces the section, keeps the rest
  assert out.read_text().endswith(
    "kept text\n<!-- bench.py quick -->\nsecond run\n<!-- /bench.py quick -->\n"
  )
  write_section(str(out), "quick", "\n".join(lines))
  text = out.read_text()
  assert text.startswith("# Benchmarks\n\nkept text\n")
  assert text.count("<!-- bench.py quick -->") == 1 and text.count("<!-- /bench.py quick -->") == 1
  assert "GFLOP/s" in text and "| impl | devices | T |" in text
  rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
  for impl in ("jax_ring", "ringattention", "dense"):
    assert impl in rows, f"no {impl} row in\n{text}"
  assert "| devices | jax_ring | ringattention |" in text
  for mask in ("full", "causal"):
    assert (tmp_path / f"bench_{mask}.png").stat().st_size > 0


def test_tile_benchmark_writes_a_row_per_product(tmp_path):
  import bench_tile

  out = tmp_path / "bench.md"
  argv = [
    "--devices=2",
    "--heads=1",
    "--block=16",
    "--head-dim=8",
    "--tiles=2",
    "--repeats=1",
    "--matmul-size=512",
  ]
  argv.append(f"--out={out}")
  bench_tile.main(argv)
  text = out.read_text()
  assert text.count("<!-- bench.py tile -->") == 1
  rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ")][1:]  # no header
  rates = {name.strip(): float(rate) for name, rate in rows}
  names = [f"{name} (`{spec}`)" for name, (spec, _, _) in bench_tile.PRODUCTS.items()]
  assert sorted(rates) == sorted([*names, "512^3 matmul, one device"])
  assert all(rate > 0 for rate in rates.values()), rates


def test_masks_benchmark_times_each_mask_against_full(tmp_path, monkeypatch):
  import bench_masks

  # The programs compile and run as measured; their times are replaced by fixed ones,
  # so that each ratio column can be checked: the row's time over the full mask's.
  times = iter([(2.0, 4.0), (1.0, 3.0), (0.5, 1.0)])
  measured = bench_masks.measure
  monkeypatch.setattr(
    bench_masks,
    "measure",
    lambda *a, **k: measured(*a, **k)._replace(**dict(zip(("fwd", "fwd_bwd"), next(times), strict=True))),
  )
  out = tmp_path / "bench.md"
  argv = ["--devices=2", "--lengths=64", "--layouts", "zigzag", "--window=8", "--heads=1", "--head-dim=8"]
  bench_masks.main([*argv, "--repeats=1", f"--out={out}"])
  rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 64 |")]
  assert [(r[1].strip(), r[2].strip()) for r in rows] == [
    ("full", "contiguous"),
    ("causal", "zigzag"),
    ("window 8", "contiguous"),
  ]
  assert [(r[5].strip(), r[6].strip()) for r in rows] == [
    ("1.00", "1.00"),
    ("0.50", "0.75"),
    ("0.25", "0.25"),
  ]
  assert "Causal work, layout=zigzag, T=64, p=2" in out.read_text()


def test_memory_benchmark_writes_a_row_per_size(tmp_path):
  import bench_memory

  out = tmp_path / "bench.md"
  bench_memory.main(["--lengths=256,384", "--devices=2", "--impls=jax_ring", f"--out={out}"])
  rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 2 |")]
  assert [r[1].strip() for r in rows] == ["256", "384"]
  mib = [float(r[2]) for r in rows]
  assert 0 < mib[0] < mib[1], mib  # memory grows with the length


def test_short_shard_benchmark_writes_both_masks(tmp_path):
  import bench_short

  out = tmp_path / "bench.md"
  argv = ["--lengths=256", "--devices=2", "--rounds=2", "--per-round=1", "--impls=jax_ring"]
  argv += ["--layouts=zigzag", "--pass-tokens=128"]
  bench_short.main([*argv, f"--out={out}"])
  text = out.read_text()
  assert text.count("| T | mask | jax_ring | jax_ring zigzag | jax_ring pass_tokens=128 |") == 2
  rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 256 |")]
  assert [r[1].strip() for r in rows] == ["full", "causal"] * 2  # times, then memory
  assert all(float(cell.split()[0]) > 0 for r in rows for cell in r[2:]), rows
  # One kv head per pass (128 tokens a device) holds less than the CPU default's 4 heads.
  assert all(float(r[4]) < float(r[2]) for r in rows[2:]), rows[2:]


def test_documents_benchmark_shares_each_row_against_its_ideal(tmp_path):
  import bench_documents

  out = tmp_path / "bench.md"
  bench_documents.main(["--length=2048", "--devices=4", "--rounds=1", "--rows=1k,mixed", f"--out={out}"])
  cells = [
    line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith(("| 1k", "| mixed"))
  ]
  rows = [r for r in cells if len(r) == 19]  # the times; then each device's scores, and tiles
  balance = {r[0].strip(): (float(r[1]), float(r[2])) for r in cells if len(r) == 3}
  number = lambda cell: int(cell.replace(",", ""))
  tiles = {r[0].strip(): (number(r[2]), number(r[6])) for r in cells if len(r) == 10}
  assert [r[0].strip() for r in rows] == ["1k", "mixed"] and set(balance) == set(tiles) == {"1k", "mixed"}
  assert all(0 < moved <= plain for plain, moved in tiles.values()), tiles  # reordered: never busier
  assert balance["mixed"][0] >= 1.4 and balance["mixed"][1] <= 1.05  # zig-zag's busiest, the layout's
  # Two documents of 1,024 in 2,048 tokens: their causal work is half one document's.
  assert rows[0][1:4] == [" 2 ", " 1,024 ", " 0.500 "]
  lengths = bench_documents.row_lengths("mixed", 2048)
  assert sorted(lengths) == [16, 16, 16, 16, 64, 128, 256, 512, 1024]
  assert float(rows[1][3]) == round(sum(n * n for n in lengths) / 2048**2, 3)
  assert all(float(r[k]) > 0 for r in rows for k in (4, 5, 7, 8, 10, 11, 13, 14, 16, 17)), rows
  assert "the rows' layout: auto." in out.read_text()


def test_busiest_device_benchmark_runs_each_devices_passes_as_the_ring_does(tmp_path):
  """bench_busiest_device.py's passes, each run alone on one device with the ring's own
  configuration (`RingConfig` of the call, tiles of 16 for several per pass) and merged
  by their log-sum-exps, give each device's rows of float64 attention over the packed
  row (4 devices, zig-zag, bound the longest document: one chunk each way); and the
  benchmark writes its table at a tiny size."""
  import bench_busiest_device as busiest
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ring import BlockSizes, layouts

  p, t = 4, 256
  lengths = [30, 12, 31, 5, 20, 26, 9, 31, 17, 3, 22, 18, 32]
  seg = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
  seg = np.concatenate([seg, np.full(t - len(seg), len(lengths), np.int32)])
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, t, 4, 16)).astype(np.float32)
  k, v = (rng.standard_normal((1, t, 2, 16)).astype(np.float32) for _ in range(2))
  mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
  tiles = BlockSizes(block_q=16, block_kv=16)
  cfg = busiest.ring_config(mesh, put(q), put(k), put(v), put(seg[None]), 32, tiles)
  assert (cfg.steps_back, cfg.steps_fwd, cfg.block_q, cfg.block_kv) == (1, 1, 16, 16), cfg
  # float64 reference: causal within each document, 2 query heads a kv head
  kk, vv = (np.repeat(x.astype(np.float64), 2, axis=2) for x in (k, v))
  scores = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), kk) / 4.0
  i = np.arange(t)
  seen = (i[:, None] >= i[None, :]) & (seg[:, None] == seg[None, :])
  weights = np.exp(np.where(seen, scores, -np.inf) - np.where(seen, scores, -np.inf).max(-1, keepdims=True))
  expected = np.einsum("bnqk,bknh->bqnh", weights / weights.sum(-1, keepdims=True), vv)
  order = layouts.permutation("zigzag", t, p)
  for d in range(p):
    found = busiest.device_outputs(cfg, p, q, k, v, seg, d)
    rows = order[d * t // p : (d + 1) * t // p]
    np.testing.assert_allclose(found[0], expected[0, rows], atol=2e-5, err_msg=f"device {d}")
  out = tmp_path / "bench.md"
  found = busiest.main(["--length=2048", "--devices=4", "--rounds=1", "--rows=1k,mixed", f"--out={out}"])
  text = out.read_text()
  assert "<!-- bench.py busiest device -->" in text and text.count("\n| 1k |") == 1
  assert all(s.max() > 0 and s.max() >= s.mean() for s, _, _ in found["mixed"]), found
  assert all(0 < skipped.max() < s.max() for s, _, skipped in found["mixed"]), found


def test_document_batches_benchmark_runs_each_row_with_its_own_passes(tmp_path):
  """Rows whose documents differ, one program a way: zig-zag chunks of 256 tokens on 4
  devices, so "auto" runs one pass each way on a row whose documents reach at most 256
  tokens back and every pass on the others (the row of one 2,048-token document
  included); the data's bound is that document, every pass."""
  import bench_document_batches

  out = tmp_path / "bench.md"
  argv = ["--length=2048", "--devices=4", "--rows=3", "--rounds=1", "--long-length=2048", "--median=24"]
  result = bench_document_batches.main([*argv, f"--out={out}"])
  rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line[:3] in ("| 0", "| 1", "| 2")]
  assert len(rows) == 3 and result["longest"] == 2048 and result["rows"][0] == [2048]
  passes = [cells[4].strip() for cells in rows]
  assert passes == ["1 and 1" if max(n) - 1 <= 256 else "every" for n in result["rows"]]
  assert passes == ["every", "1 and 1", "every"]
  for cells, lengths in zip(rows, result["rows"]):
    assert sum(lengths) == 2048 and int(cells[1]) == len(lengths)
    assert float(cells[3]) == round(sum(n * n for n in lengths) / 2048**2, 3)
    assert all(float(cells[k].strip().rstrip("x")) > 0 for k in (5, 6, 7, 8)), cells


def test_dilated_benchmark_rates_against_the_ring(tmp_path):
  import bench_dilated

  out = tmp_path / "bench.md"
  sizes = ["--lengths", "4096", "--ring-length=512", "--heads=2", "--head-dim=16"]
  bench_dilated.main(["--devices=2", *sizes, "--segments", "256", "512", "--rates", "1", "2", f"--out={out}"])
  rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ring |")]
  rows += [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| dilated |")]
  assert [(r[0].strip(), r[1].strip()) for r in rows] == [("ring", "512"), ("dilated", "4,096")], rows
  # "of ring": the row's GFLOP/s over the ring's, from the printed rates (1 decimal).
  ring_rate, rate = float(rows[0][5]), float(rows[1][5])
  assert abs(float(rows[1][6]) - rate / ring_rate) <= 0.006 + (rate / ring_rate) * (
    0.05 / rate + 0.05 / ring_rate
  )
  gflops, temp, args, ratio, rss = (float(rows[1][i]) for i in (5, 7, 8, 9, 10))
  assert gflops > 0 and rss > 0
  assert ratio == pytest.approx(temp / args, rel=0.1)  # of the rounded MiB
  assert bench_dilated.useful_flops(4096, 2, 16, (256, 512), (1, 2)) == 3.5 * 4 * 4096 * (256 + 128) * 2 * 16


def test_train_gpu_benchmark_counts_the_flops_of_the_step():
  """MFU's numerator: 6 x matmul parameters x T + 6 x T^2 x N x H x layers. Llama-3.2-1B
  has 1,235,814,400 parameters (Meta's model card), of which its 33 RMSNorm scales
  (67,584) are no matmul and its tied embedding is the head's."""
  import bench_train_gpu

  from jax_ring import models

  matmul = 1_235_814_400 - 67_584
  t = 16384
  expected = 6 * matmul * t + 6 * t * t * 32 * 64 * 16
  assert bench_train_gpu.flops_per_step(models.config("llama-3.2-1b"), t) == expected


def test_train_gpu_benchmark_peer_only_runs_no_jax_row():
  """`--peer-only` (run_gpu.sh's peft rows at lengths where jax_ring's run elsewhere):
  the peer's rows alone, --torch implied."""
  import bench_train_gpu

  report = bench_train_gpu.main(["--tiny", "--peer-only", "--lengths=16", "--lora=4", "--steps=1"])
  assert [(r["impl"], r["tokens"]) for r in report["rows"]] == [("torch+transformers+peft", 16)]


def test_train_gpu_benchmarks_dpo_pair_is_two_sequences_sharing_the_prompt():
  """`--objective dpo`'s row: chosen then rejected, each T / 2 tokens, segments 1 and 2,
  positions from 0 in each, the same first `prompt` tokens, targets weighted on the
  completions alone (T / 2 - prompt each, as TRL's completion mask counts them); its
  flops: the policy's over two documents and the reference's forward."""
  import bench_train_gpu

  from jax_ring import models

  seqs, (tokens, targets, weights, seg, pos) = bench_train_gpu.pair(64, 100, 8)
  assert seqs.shape == (2, 32) and tokens.shape == targets.shape == weights.shape == seg.shape == (1, 64)
  np.testing.assert_array_equal(tokens[0], seqs.reshape(-1))
  assert (seqs[0, :8] == seqs[1, :8]).all() and (seqs[0, 8:] != seqs[1, 8:]).any()
  np.testing.assert_array_equal(targets[0, :31], seqs[0, 1:])
  np.testing.assert_array_equal(targets[0, 32:63], seqs[1, 1:])
  assert seg[0].tolist() == [1] * 32 + [2] * 32 and pos[0].tolist() == list(range(32)) * 2
  assert weights[0].tolist() == ([0.0] * 7 + [1.0] * 24 + [0.0]) * 2
  cfg = models.config("llama-3.2-1b")
  t, matmul = 16384, 1_235_814_400 - 67_584
  scores = t * t * 32 * 64 * 16 / 2
  assert bench_train_gpu.flops_per_step(cfg, t, dpo=True) == 8 * matmul * t + 8 * scores


@pytest.mark.slow  # 10-20 s: a process that compiles a DPO step and the reference's forward
def test_train_gpu_benchmark_runs_a_dpo_step_with_its_reference(tmp_path):
  """The DPO part on this CPU at the tiny size: the first step's loss is log 2 (the
  policy is its reference before any step: the reference's log-probabilities reach the
  step), the next one is lower (it trains), and TRL's row says why it cannot run where
  trl is not installed (its own first loss is log 2 where it is)."""
  import json
  import math
  import subprocess
  import sys

  out = tmp_path / "dpo.json"
  cmd = [sys.executable, "scripts/bench/bench_train_gpu.py", "--tiny", "--objective=dpo", "--prompt=8"]
  cmd += ["--lengths=64", "--steps=1", "--remat=attention", "--torch", "--timeout=300", f"--json={out}"]
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["objective"] == "dpo"
  ours, peer = report["rows"]
  assert ours["impl"] == "jax_ring" and peer["impl"] == "trl+transformers"
  assert ours["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
  assert ours["loss"] < ours["first_loss"] and ours["tokens"] == 64 and ours["mfu"] > 0
  if "error" in peer:
    assert "not importable" in peer["error"] and peer["step_s"] is None
  else:
    assert peer["first_loss"] == pytest.approx(math.log(2), abs=1e-6) and peer["step_s"] > 0


@pytest.mark.slow  # 15-25 s: two processes that each compile a training step
def test_train_gpu_benchmark_writes_its_rows(tmp_path):
  """The GPU training benchmark on this CPU at its tiny size: a process per row (jax_ring
  with each remat of "auto", the fastest marked), the PyTorch peer's row saying why it
  cannot run where torch is not installed, and the JSON the docs' table is made from."""
  import json
  import subprocess
  import sys

  import bench_train_gpu

  out = tmp_path / "rows.json"
  cmd = [sys.executable, "scripts/bench/bench_train_gpu.py", "--tiny", "--lengths=32", "--steps=1", "--torch"]
  cmd += ["--timeout=300", "--profile"]  # each row's process, SIGKILLed past it
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run([*cmd, f"--json={out}"], capture_output=True, text=True, timeout=600, cwd=root)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(out.read_text())
  rows = report["rows"]
  assert [(r["impl"], r.get("remat")) for r in rows] == [
    ("jax_ring", "attention"),
    ("jax_ring", "full"),
    ("torch+transformers", None),
  ]
  for row in rows[:2]:
    assert set(row) >= {"impl", "tokens", "step_s", "tokens_per_s", "mfu", "peak_bytes"}
    assert row["tokens"] == 32 and row["step_s"] > 0 and row["mfu"] > 0
    assert row["tokens_per_s"] == 32 / row["step_s"]
    # --profile: every part of the step found in the trace by its source names, the
    # parts' busy time at least the span's busy time (the union of the operations).
    prof = row["profile"]
    assert list(prof["parts_ms"]) == list(bench_train_gpu.PROFILE_PARTS)
    assert all(ms > 0 for ms in prof["parts_ms"].values()), prof
    assert 0 <= prof["gaps_ms"] < prof["span_ms"] and prof["unmatched_ms"] == 0
    # Each of the len(parts) + 2 numbers is rounded to the microsecond (half of 1e-3 ms each).
    slack = 0.5e-3 * (len(prof["parts_ms"]) + 2)
    assert sum(prof["parts_ms"].values()) >= prof["span_ms"] - prof["gaps_ms"] - slack
  assert sum(bool(r.get("best")) for r in rows) == 1
  try:
    import torch  # noqa: F401

    assert rows[2]["step_s"] > 0
  except ImportError:
    assert "not importable" in rows[2]["error"] and rows[2]["step_s"] is None


@pytest.mark.slow  # 30-45 s: three finetune.py processes
def test_finetune_documents_benchmark_runs_bounded_and_every_pass(tmp_path):
  """bench_finetune_documents.py at a tiny size: finetune.py bounded by the longest
  document packed (1,024 tokens: 1,022 bytes with BOS and EOS), by each batch's own
  (`--bound-per-batch`) and with every pass, the same losses, the table in its section."""
  import bench_finetune_documents

  out = tmp_path / "bench.md"
  args = ["--length=2048", "--devices=4", "--mix=1k", "--steps=2", "--layers=1", f"--out={out}"]
  found = bench_finetune_documents.main(args)
  assert found["bound"] == 1024 and found["every_bound"] is None and found["loss_diff"] < 1e-5
  assert set(found["step_s"]) == {"bounded", "per batch", "every pass"} and min(found["step_s"].values()) > 0
  text = out.read_text()
  assert "<!-- bench.py finetune documents -->" in text and "| every pass |" in text


def test_rollout_benchmark_writes_its_rows(tmp_path):
  """The GPU rollout benchmark on this CPU at its tiny size: jax_ring's row in a process
  of its own, every completion its full length (G x N new tokens), and the PyTorch
  peer's row saying why it cannot run where torch is not installed."""
  import json
  import subprocess
  import sys

  out = tmp_path / "rollout.json"
  cmd = [sys.executable, "scripts/bench/bench_rollout.py", "--tiny", "--prompt=8", "--completions=3"]
  cmd += ["--new-tokens=5", "--repeats=1", "--torch", "--timeout=300", f"--json={out}"]
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["impl"] for r in rows] == ["jax_ring", "torch+transformers"]
  assert rows[0]["new_tokens"] == 15 and rows[0]["rollout_s"] > 0 and "error" not in rows[0], rows[0]
  assert rows[0]["tokens_per_s"] == round(15 / rows[0]["rollout_s"], 1)
  try:
    import torch  # noqa: F401

    assert rows[1]["new_tokens"] == 15 and rows[1]["rollout_s"] > 0
  except ImportError:
    assert "not importable" in rows[1]["error"] and rows[1]["rollout_s"] is None
  bad = subprocess.run([*cmd[:2], "--new-tokens=0"], capture_output=True, text=True, timeout=60, cwd=root)
  assert bad.returncode == 2 and "--new-tokens 0: must be at least 1" in bad.stderr


def test_gpu_benchmark_reads_a_kernel_with_its_pass_size():
  """`bench_gpu.py --kernels cudnn,cudnn@32768`: the kernel alone keeps its default
  passes; NAME@TOKENS sets `BlockSizes.pass_tokens`."""
  import bench_gpu

  import jax_ring

  assert bench_gpu._kernel_options("cudnn") == dict(kernel="cudnn", block_sizes=None)
  assert bench_gpu._kernel_options("pallas@32768") == dict(
    kernel="pallas", block_sizes=jax_ring.BlockSizes(pass_tokens=32768)
  )


def test_data_benchmark_rates_the_pipeline_against_a_runs_steps(tmp_path):
  """scripts/bench/bench_data.py on a small folder's tokenizer: every stage's tokens/s,
  the ratio to a metrics.jsonl's median step, and the padded rows' times."""
  import json

  import bench_data
  from test_finetune_data import TEMPLATES, TINY, byte_tokenizer

  from jax_ring import models
  from jax_ring.models.formats.tokenizer_json import HFTokenizer

  tok = byte_tokenizer()
  wrapped = HFTokenizer(tok, bos_id=0, eos_id=1)
  models.save(models.build(TINY, attention="dense"), tmp_path / "m", tokenizer=wrapped)
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text(
    "".join(
      json.dumps({"step": i, "loss": 1.0, "tokens_per_s": r}) + "\n" for i, r in enumerate([1, 4, 2, 3])
    )
  )
  result = bench_data.main(
    [
      "--model",
      str(tmp_path / "m"),
      "--chat-template",
      str(TEMPLATES / "llama3_2.jinja"),
      "--examples",
      "30",
      "--length",
      "1024",
      "--metrics",
      str(metrics),
      "--padding",
      "--devices",
      "2",
      "--padding-length",
      "256",
      "--repeats",
      "1",
      "--json",
      str(tmp_path / "out.json"),
    ]
  )
  assert result["step_tokens_per_s"] == 3  # the median of the steps after the first
  p = result["pipeline"]
  assert p["examples"] == 30 and p["rows"] >= 1 and 0 <= p["padding"] < 1
  assert min(p["tokenize_tokens_per_s"], p["cache_tokens_per_s"], p["loader_tokens_per_s"]) > 0
  assert result["loader_over_step"] == round(p["loader_tokens_per_s"] / 3, 1)
  assert set(result["padding_seconds"]) == {
    "documents, no padding",
    "half padding, marked (-1)",
    "half padding, unmarked",
  }
  assert json.loads((tmp_path / "out.json").read_text()) == result


def test_gpu_benchmarks_without_a_gpu_or_a_task_say_what_to_pass():
  """bench_train_gpu.py on a CPU without --tiny refuses in one line naming --tiny (it
  would run the full model's step on the CPU until the kernel kills it);
  bench_gpu.py with neither --check nor --time says to pass one."""
  import bench_gpu
  import bench_train_gpu

  with pytest.raises(SystemExit, match="no GPU here.*pass --tiny") as refused:
    bench_train_gpu.main(["--lengths=16384"])
  assert "\n" not in str(refused.value)
  with pytest.raises(SystemExit, match="pass --check .*--time"):
    bench_gpu.main([])
