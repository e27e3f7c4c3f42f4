"""scripts/bench/bench.py --quick runs end to end on tiny sizes and writes its tables and plots."""

import bench
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
