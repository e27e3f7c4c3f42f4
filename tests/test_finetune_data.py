"""Fine-tuning on a user's data: files read and checked (bad records named by file and
line, before anything is written), the tokenization cached, completions and chats
with their loss masks, scripts/finetune.py --data writing metrics.jsonl and TensorBoard
events as it runs, an evaluation loss, SIGTERM to a child process saving the state and
the resumed run giving the uninterrupted run's losses bit for bit, a non-finite loss
stopping the run without overwriting the last good state."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers

from jax_ring import models
from jax_ring.models.data import pipeline, sources
from jax_ring.models.formats.tokenizer_json import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
TINY = models.LlamaConfig(
  vocab_size=288,
  dim=32,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  mlp_hidden=64,
  rope_base=10000.0,
  norm_eps=1e-5,
  context_length=512,
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def byte_tokenizer(specials=SPECIALS):
  """Byte-level BPE with no merges (a token a byte) and `specials` as special tokens."""
  vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  return tok


def tiny_tokenizer():
  """`byte_tokenizer` as the models' tokenizer (BOS first), with Llama 3.2's chat template."""
  tok = byte_tokenizer()
  wrapped = HFTokenizer(
    tok, bos_id=tok.token_to_id(SPECIALS[0]), eos_id=tok.token_to_id(SPECIALS[1]), add_bos=True
  )
  wrapped.chat_template = (TEMPLATES / "llama3_2.jinja").read_text()
  return wrapped


def tiny_folder(tmp_path_factory):
  """A tiny Llama folder whose tokenizer carries Llama 3.2's chat template."""
  path = tmp_path_factory.mktemp("tiny") / "model"
  models.save(models.build(TINY, attention="dense"), path, tokenizer=tiny_tokenizer())
  return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return tiny_folder(tmp_path_factory)


def chats(n, seed=0):
  rng = np.random.default_rng(seed)
  words = ["ring", "shard", "token", "layer", "mesh", "sum", "key", "value"]
  say = lambda k: " ".join(rng.choice(words, k))
  out = []
  for _ in range(n):
    turns = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
    for _ in range(int(rng.integers(1, 3))):
      turns += [
        {"role": "user", "content": say(4)},
        {"role": "assistant", "content": say(int(rng.integers(2, 12)))},
      ]
    out.append({"messages": turns})
  return out


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


# --- Reading and checking. ---


def test_formats_come_from_the_columns_and_every_file_kind_reads(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(3)]
  (tmp_path / "d").mkdir()
  write_jsonl(tmp_path / "d" / "a.jsonl", rows[:2])
  (tmp_path / "d" / "b.json").write_text(json.dumps(rows[2:]))
  pq.write_table(pa.Table.from_pylist([{"text": "a document"}]), tmp_path / "c.parquet")
  got = sources.read(tmp_path / "d", columns={"prompt": "question", "completion": "answer"})
  assert got.format == "completion" and [r["prompt"] for r in got.items] == ["q0", "q1", "q2"]
  assert got.where == [f"{tmp_path}/d/a.jsonl:1", f"{tmp_path}/d/a.jsonl:2", f"{tmp_path}/d/b.json:item 1"]
  assert sources.read(tmp_path / "c.parquet").items == [{"text": "a document"}]
  (tmp_path / "e.txt").write_text("one whole document\n")
  assert sources.read(tmp_path / "e.txt").format == "text"
  assert sources.read(write_jsonl(tmp_path / "f.jsonl", chats(2))).format == "chat"
  with pytest.raises(sources.BadRecord, match="match no format"):
    sources.read(tmp_path / "d")  # question/answer without --columns
  with pytest.raises(ValueError, match="format='chats'"):
    sources.read(tmp_path / "e.txt", format="chats")


def test_a_saved_dataset_folder_reads_with_the_datasets_extra(tmp_path):
  datasets = pytest.importorskip("datasets")  # the [datasets] extra, in the test command's [dev]
  datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}] * 2).save_to_disk(str(tmp_path / "saved"))
  got = sources.read(tmp_path / "saved")
  assert got.format == "completion" and len(got.items) == 2 and got.where[1].endswith("saved:row 2")


@pytest.mark.parametrize(
  "line, says",
  [
    ('{"messages": [{"role": "user", "content": "hi"}', "not JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0] has role 'robot'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string, not int"),
    ('{"text": "a"}', "no 'messages' column for the chat format"),
    ("[1, 2]", "not a list"),
  ],
)
def test_a_bad_record_is_named_by_file_and_line(tmp_path, line, says):
  good = json.dumps(chats(1)[0])
  path = tmp_path / "data.jsonl"
  path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
  with pytest.raises(sources.BadRecord, match=f"^{path}:4: .*{__import__('re').escape(says)}"):
    sources.read(path)
  skipped = sources.read(path, skip_bad=True)
  assert len(skipped.items) == 3 and len(skipped.skipped) == 1 and skipped.skipped[0].startswith(f"{path}:4:")


def test_bytes_that_are_not_utf8_are_named_by_file_and_line_and_records_count_from_1(tmp_path):
  """A JSON Lines line, a .json file or a .txt document with a byte that is not UTF-8
  is a bad record naming its file and line (JSONL's other lines still read); JSON
  Lines' lines, a .json file's items and Parquet's rows all count from 1; a malformed
  line's message says what JSON's parser says once."""
  good = json.dumps({"text": "fine"}).encode()
  (tmp_path / "a.jsonl").write_bytes(good + b"\n" + b'{"text": "caf\xff"}\n' + good + b"\n")
  with pytest.raises(sources.BadRecord, match=rf"^{tmp_path}/a.jsonl:2: not UTF-8: byte 0xff at column 14"):
    sources.read(tmp_path / "a.jsonl")
  kept = sources.read(tmp_path / "a.jsonl", skip_bad=True)
  assert kept.where == [f"{tmp_path}/a.jsonl:1", f"{tmp_path}/a.jsonl:3"] and len(kept.skipped) == 1
  folder = tmp_path / "docs"
  folder.mkdir()
  (folder / "good.txt").write_text("one document\n")
  (folder / "bad.txt").write_bytes(b"first line\nsecond \xfe line\n")
  with pytest.raises(sources.BadRecord, match=rf"^{folder}/bad.txt:2: not UTF-8: byte 0xfe at column 8"):
    sources.read(folder)
  (tmp_path / "b.json").write_bytes(b'[{"text": "x"},\n {"text": "\x80"}]')
  with pytest.raises(sources.BadRecord, match=rf"^{tmp_path}/b.json:2: not UTF-8"):
    sources.read(tmp_path / "b.json")
  (tmp_path / "c.json").write_text(json.dumps([{"text": "x"}, {"text": 5}]))
  with pytest.raises(sources.BadRecord, match=rf"^{tmp_path}/c.json:item 2: 'text' must be a string"):
    sources.read(tmp_path / "c.json")
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": ["x", ""]}), tmp_path / "d.parquet")
  with pytest.raises(sources.BadRecord, match=rf"^{tmp_path}/d.parquet:row 2: 'text' is empty"):
    sources.read(tmp_path / "d.parquet")
  (tmp_path / "e.jsonl").write_text('{"text": "unterminated}')
  with pytest.raises(sources.BadRecord, match="not JSON: Unterminated string starting at \\(column 10\\)$"):
    sources.read(tmp_path / "e.jsonl")


def test_completions_and_chats_learn_only_the_answers(folder, tmp_path):
  tok = HFTokenizer.from_folder(folder)
  assert models.chat_template(folder) == (TEMPLATES / "llama3_2.jinja").read_text() == tok.chat_template
  ids, mask = pipeline.tokenize_record(tok, {"prompt": "2+2=", "completion": "4"}, "completion", None)
  assert tok.decode(ids[mask == 1]) == "4<|end_of_text|>" and ids[0] == tok.bos_id
  conversation = chats(1, seed=4)[0]["messages"]
  ids, mask = pipeline.tokenize_record(tok, {"messages": conversation}, "chat", tok.chat_template)
  learned = tok.decode(ids[mask == 1])
  answers = [m["content"] + "<|eot_id|>" for m in conversation if m["role"] == "assistant"]
  assert learned == "".join(answers)


def test_tokenization_is_cached_by_content(folder, tmp_path):
  tok = HFTokenizer.from_folder(folder)
  data = write_jsonl(tmp_path / "c.jsonl", chats(5))
  first = pipeline.load_examples(data, tok, cache_dir=tmp_path / "cache")
  again = pipeline.load_examples(data, tok, cache_dir=tmp_path / "cache")
  assert not first.cached and again.cached and again.where == first.where
  assert all((a == b).all() for a, b in zip(first.ids, again.ids))
  assert all((a == b).all() for a, b in zip(first.masks, again.masks))
  # One tokenizer.json with another EOS or no BOS makes other tokens: tokenized anew.
  for change in (dict(eos_id=tok.pad_id), dict(add_bos=not tok.add_bos)):
    other = HFTokenizer.from_folder(folder)
    vars(other).update(change)
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    ours = pipeline.load_examples(pairs, tok, cache_dir=tmp_path / "cache").ids[0]
    fresh = pipeline.load_examples(pairs, other, cache_dir=tmp_path / "cache")
    assert not fresh.cached and fresh.ids[0].tolist() != ours.tolist()
  write_jsonl(data, chats(5, seed=1))  # new contents: tokenized anew
  assert not pipeline.load_examples(data, tok, cache_dir=tmp_path / "cache").cached


def test_the_loader_resumes_at_exactly_the_next_row(folder, tmp_path):
  tok = HFTokenizer.from_folder(folder)
  examples = pipeline.load_examples(write_jsonl(tmp_path / "c.jsonl", chats(30)), tok)
  loader = pipeline.Loader(examples, 256, 2, seed=5)
  seen = [next(loader)[0]["tokens"] for _ in range(3)]
  state = json.loads(json.dumps(loader.state()))
  after = [next(loader)[0]["tokens"] for _ in range(len(loader.rows))]  # past the epoch's end too
  again = pipeline.Loader(examples, 256, 2, seed=5)
  again.restore(state)
  assert all((a == b).all() for a, b in zip(after, [next(again)[0]["tokens"] for _ in range(len(after))]))
  assert not all((a == b).all() for a, b in zip(seen, after[:3]))
  # Every example's tokens are in the epoch's rows exactly once.
  fresh = pipeline.Loader(examples, 256, 1, seed=5)
  rows = [next(fresh)[0] for _ in range(len(fresh.rows))]
  assert sum(int((r["segment_ids"] >= 0).sum()) for r in rows) == sum(len(i) for i in examples.ids)


# --- The script: metrics, evaluation, signals, resuming, non-finite losses. ---


def _events(folder):
  """(tag, step, value) of the scalars in the TensorBoard event files under `folder`."""
  from tensorboardX.proto import event_pb2

  out = []
  for file in sorted(Path(folder).glob("events.out.tfevents.*")):
    data = file.read_bytes()
    at = 0
    while at < len(data):
      (n,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
      at += 12 + n + 4
      out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


def _args(folder, data, out, *more):
  return [
    str(folder),
    "--data",
    str(data),
    "--length",
    "256",
    "--devices",
    "2",
    "--lr",
    "1e-3",
    "--out",
    str(out),
    *more,
  ]


def test_finetune_on_chats_writes_metrics_and_events_and_evaluates(folder, tmp_path):
  import finetune as script  # scripts/finetune.py

  data = write_jsonl(tmp_path / "c.jsonl", chats(24))
  out = tmp_path / "run"
  report = script.main(
    _args(folder, data, out, "--steps", "4", "--eval-fraction", "0.25", "--eval-every", "2")
  )
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in steps] == [0, 1, 2, 3] and [r["step"] for r in evals] == [1, 3]
  assert all(r["eval_loss"] > 1.0 for r in evals)  # every held-out row scored, each time (about 6 here)
  for r in steps:
    assert {"loss", "tokens", "padding", "lr", "grad_norm", "tokens_per_s"} <= set(r)
    assert 0 < r["tokens"] <= 256 and 0 <= r["padding"] < 1 and np.isfinite(r["loss"])
    assert r["tokens"] == round(256 * (1 - r["padding"]))  # the tokens not padding
  # One warmup step, which trains: the peak rate from the first step, a tenth of it at the last.
  assert steps[0]["lr"] == pytest.approx(1e-3) and steps[-1]["lr"] == pytest.approx(1e-4)
  assert report["data"]["format"] == "chat" and report["data"]["examples"] == 18
  assert 0 < report["data"]["document_bound"] <= 256  # the longest chat (or piece of one) bounds the passes
  assert [s["loss"] for s in report["steps"]] == [r["loss"] for r in steps]
  events = _events(out / "tb")
  assert sorted(s for t, s, _ in events if t == "loss") == [0, 1, 2, 3]
  assert [(s, round(v, 4)) for t, s, v in events if t == "eval_loss"] == [
    (r["step"], round(r["eval_loss"], 4)) for r in evals
  ]
  assert (out / "checkpoint" / "config.json").is_file()
  # --every-pass: no bound, every ring pass, the same losses.
  every = script.main(
    _args(folder, data, tmp_path / "every", "--steps", "2", "--eval-fraction", "0.25", "--every-pass")
  )
  assert every["data"]["document_bound"] is None and every["config"]["document_bound"] is False
  np.testing.assert_allclose([s["loss"] for s in every["steps"]], [r["loss"] for r in steps[:2]], rtol=1e-6)
  # --bound-per-batch: each batch's passes read from its ids while running, the same losses.
  auto = script.main(
    _args(folder, data, tmp_path / "auto", "--steps", "2", "--eval-fraction", "0.25", "--bound-per-batch")
  )
  assert auto["data"]["document_bound"] == "auto" == auto["config"]["document_bound"]
  np.testing.assert_allclose([s["loss"] for s in auto["steps"]], [r["loss"] for r in steps[:2]], rtol=1e-6)
  # --row-layout documents: each row reordered for the zig-zag ring, bounded by its
  # documents' spans along the reordered rows, the same losses (summed in another order).
  moved = script.main(
    _args(
      folder, data, tmp_path / "moved", "--steps", "2", "--eval-fraction", "0.25", "--row-layout", "documents"
    )
  )
  assert moved["config"]["row_layout"] == "documents"
  assert report["data"]["document_bound"] <= moved["data"]["document_bound"] <= 256
  np.testing.assert_allclose([s["loss"] for s in moved["steps"]], [r["loss"] for r in steps[:2]], rtol=1e-5)


def test_bad_data_exits_naming_the_line_before_writing(folder, tmp_path):
  import finetune as script

  data = tmp_path / "c.jsonl"
  data.write_text(json.dumps(chats(1)[0]) + "\n" + '{"messages": "hi"}\n')
  out = tmp_path / "run"
  with pytest.raises(SystemExit, match=f"finetune.py: {data}:2: 'messages' must be a non-empty list"):
    script.main(_args(folder, data, out, "--steps", "1"))
  assert not out.exists()


def _wait_for(predicate, timeout, what, proc=None):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if predicate():
      return
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f"the child exited ({proc.returncode}) before {what}")
    time.sleep(0.2)
  raise AssertionError(f"no {what} within {timeout} s")


# The child of the signal tests: scripts/finetune.py run as __main__ (its signal handlers
# and all), with each step's metrics record followed by a pause, so that a signal sent
# when the second record appears lands while steps remain, however fast the steps are.
PACED = """
import runpy, sys, time
from jax_ring.models.train import metrics
log, pause = metrics.Metrics.log, float(sys.argv[1])
def paced(self, record):
  log(self, record)
  if "loss" in record:
    time.sleep(pause)
metrics.Metrics.log = paced
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rpartition("/")[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _child(args, timeout, pause=None):
  """scripts/finetune.py ARGS in a child process: (Popen); the caller waits with a timeout.
  `pause`: seconds of sleep after each step's metrics record (the signal tests)."""
  script = str(ROOT / "scripts" / "finetune.py")
  command = [sys.executable, script, *args]
  if pause is not None:
    command = [sys.executable, "-c", PACED, str(pause), script, *args]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(child, timeout):
  try:
    output, _ = child.communicate(timeout=timeout)
  finally:
    if child.poll() is None:
      child.kill()
      child.wait(timeout=30)
  assert child.returncode == 0, output.decode()[-3000:]
  return output


# The SIGTERM and SIGKILL tests' data and options, and the losses of the same command
# never stopped (`whole`): both interrupted runs must end with them bit for bit.
STOPPED = ["--steps", "10", "--batch", "2", "--save-every", "4"]


@pytest.fixture(scope="module")
def whole(folder, tmp_path_factory):
  """(data, losses) of the uninterrupted run, once for the module, in a child process as
  the interrupted runs are."""
  root = tmp_path_factory.mktemp("whole")
  data = write_jsonl(root / "c.jsonl", chats(40, seed=5))
  out = root / "whole"
  _finish(_child(_args(folder, data, out, *STOPPED, "--cache-dir", str(root / "cache")), 300), 300)
  return data, [r["loss"] for r in json.loads((out / "report.json").read_text())["steps"]]


@pytest.mark.xdist_group("stopped")  # one worker: the uninterrupted run once
def test_sigterm_saves_and_the_resumed_run_has_the_same_losses(folder, whole, tmp_path):
  """A real SIGTERM to a child process after its second step: it saves and exits 0; the
  same command again finishes the run; its losses equal an uninterrupted run's (the same
  command, never stopped) bit for bit: the data continue at the next row, the weights
  and moments where they were."""
  import finetune as script

  data, expected = whole
  steps = [*STOPPED, "--cache-dir", str(tmp_path / "cache")]
  out = tmp_path / "stopped"
  child = _child(_args(folder, data, out, *steps), 300, pause=0.5)
  try:
    metrics = out / "metrics.jsonl"
    _wait_for(
      lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "second step", child
    )
    child.send_signal(signal.SIGTERM)
  finally:
    output = _finish(child, 120)
  assert b"SIGTERM: saved the state at step" in output
  done = len(json.loads((out / "report.json").read_text())["steps"])
  assert 2 <= done < 10 and (out / "state" / str(done)).is_dir()
  _finish(_child(_args(folder, data, out, *steps), 300), 300)
  got = [r["loss"] for r in json.loads((out / "report.json").read_text())["steps"]]
  assert got == expected
  assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == list(
    range(10)
  )
  # Fewer steps than are done: refused, the state left as it is.
  states = sorted(os.listdir(out / "state"))
  assert max(int(name) for name in states) == 10
  with pytest.raises(SystemExit, match="holds 10 steps done and --steps asks for 3"):
    script.main(
      _args(folder, data, out, "--steps", "3", "--batch", "2", "--cache-dir", str(tmp_path / "cache"))
    )
  assert sorted(os.listdir(out / "state")) == states


def test_a_resume_onto_other_data_is_refused_naming_what_differs_and_writes_nothing(folder, tmp_path):
  import finetune as script

  data = write_jsonl(tmp_path / "a.jsonl", chats(8))
  out = tmp_path / "run"
  script.main(_args(folder, data, out, "--steps", "1", "--no-progress"))
  before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
  other = write_jsonl(tmp_path / "b.jsonl", chats(8, seed=9))
  with pytest.raises(SystemExit, match=r"fine-tuned on other data \(tokens '[0-9a-f]+' -> '[0-9a-f]+'; path"):
    script.main(_args(folder, other, out, "--steps", "2", "--no-progress"))
  with pytest.raises(SystemExit, match=r"other data \(length 256 -> 128; rows 8 -> 14\)"):
    script.main(_args(folder, data, out, "--steps", "2", "--no-progress", "--length", "128"))
  assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
  moved = tmp_path / "moved.jsonl"
  moved.write_bytes(data.read_bytes())  # the same data elsewhere goes on
  script.main(_args(folder, moved, out, "--steps", "2", "--no-progress"))
  assert len(json.loads((out / "report.json").read_text())["steps"]) == 2


@pytest.mark.xdist_group("stopped")  # one worker: the uninterrupted run once
def test_sigkill_after_an_unsaved_step_resumes_with_every_step_once(folder, whole, tmp_path):
  """SIGKILL (nothing saved at the kill) once steps after the last save were logged
  (--save-every 4; killed after step 5 or so): the same command again takes the steps
  from the saved state and data place on; its losses equal an uninterrupted run's bit
  for bit, and metrics.jsonl and TensorBoard hold each step once (the killed run's
  unsaved steps replaced, none lost)."""
  data, expected = whole
  steps = [*STOPPED, "--cache-dir", str(tmp_path / "cache")]
  out = tmp_path / "killed"
  child = _child(_args(folder, data, out, *steps), 300, pause=0.5)
  metrics = out / "metrics.jsonl"
  logged = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0
  try:
    end = time.monotonic() + 240
    while logged() < 6 and child.poll() is None and time.monotonic() < end:
      time.sleep(0.01)  # a paced child: half a second after each step to kill it in
  finally:
    child.kill()  # SIGKILL
    child.wait(timeout=60)
  saved = max(int(p.name) for p in (out / "state").iterdir() if p.name.isdigit())
  assert saved < logged() < 10  # steps logged past the last save, then killed
  _finish(_child(_args(folder, data, out, *steps), 300), 300)
  records = [json.loads(x) for x in metrics.read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(10))
  assert [r["loss"] for r in records] == expected
  assert [r["loss"] for r in json.loads((out / "report.json").read_text())["steps"]] == expected
  events = sorted((s, v) for t, s, v in _events(out / "tb") if t == "loss")
  assert [s for s, _ in events] == list(range(10))
  assert [v for _, v in events] == pytest.approx(expected, rel=1e-6)  # float32 in the event files


def test_sigterm_during_the_set_up_exits_0_having_written_nothing(folder, tmp_path):
  """A SIGTERM half a second after the start (while Python imports JAX and loads the
  model): exit 0, a line saying so, and no file in --out."""
  data = write_jsonl(tmp_path / "c.jsonl", chats(8))
  out = tmp_path / "run"
  child = _child(_args(folder, data, out, "--steps", "2"), 300)
  time.sleep(0.5)
  child.send_signal(signal.SIGTERM)
  output = _finish(child, 240)
  assert b"SIGTERM during the set-up: stopped before writing anything" in output
  assert not out.exists() or not any(out.iterdir())


def test_a_second_sigint_stops_at_once(folder, tmp_path):
  """Ctrl-C asks for a stop where nothing is lost; Ctrl-C again stops at once (exit
  130), here during the set-up, before anything is written."""
  data = write_jsonl(tmp_path / "c.jsonl", chats(8))
  out = tmp_path / "run"
  child = _child(_args(folder, data, out, "--steps", "2"), 300)
  time.sleep(0.5)
  child.send_signal(signal.SIGINT)
  time.sleep(0.2)
  child.send_signal(signal.SIGINT)
  try:
    output, _ = child.communicate(timeout=120)
  finally:
    if child.poll() is None:
      child.kill()
      child.wait(timeout=30)
  assert child.returncode == 130 and b"SIGINT again: stopped at once" in output
  assert not out.exists() or not any(out.iterdir())


def test_an_exported_folder_appears_whole_or_not_at_all(tmp_path, monkeypatch):
  """The export writes checkpoint/ (and adapter/) under a temporary name and renames it:
  a failure midway (here the tokenizer's files) leaves no checkpoint/, and an older
  complete one is replaced only by a complete one."""
  from jax_ring.models.train import finetune

  finetune._whole(str(tmp_path / "checkpoint"), lambda f: (os.makedirs(f), open(f"{f}/a", "w").close()))
  assert sorted(os.listdir(tmp_path)) == ["checkpoint"] and os.listdir(tmp_path / "checkpoint") == ["a"]

  def broken(folder):
    os.makedirs(folder)
    open(f"{folder}/config.json", "w").close()
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    finetune._whole(str(tmp_path / "checkpoint"), broken)
  assert os.listdir(tmp_path / "checkpoint") == ["a"]  # the complete one stays
  with pytest.raises(OSError, match="disk full"):
    finetune._whole(str(tmp_path / "new"), broken)
  assert not (tmp_path / "new").exists()


def test_a_non_finite_loss_stops_naming_the_batch_and_keeps_the_last_state(folder, tmp_path):
  import finetune as script

  data = write_jsonl(tmp_path / "c.jsonl", chats(8))
  out = tmp_path / "run"
  with pytest.raises(SystemExit, match=rf"step \d: loss nan.*the last state is step \d.*{data.name}:\d"):
    script.main(
      _args(folder, data, out, "--steps", "6", "--save-every", "1", "--lr", "1e30", "--clip", "1e30")
    )
  saved = sorted(int(s) for s in os.listdir(out / "state"))
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert saved == [len(records)]  # the last finite step's state, not the bad one's


def test_two_processes_tokenize_their_shares_and_train_as_one(folder, tmp_path):
  """scripts/launch.py: 2 processes x 2 devices. Each reads, checks and tokenizes half
  the records (through the shared cache), both train on the same rows, and the losses
  equal one process's on 4 devices; the first process writes the checkpoint."""
  import finetune as script

  data = write_jsonl(tmp_path / "c.jsonl", chats(24))
  common = ["--length", "256", "--steps", "3", "--lr", "1e-3", "--cache-dir", str(tmp_path / "cache")]
  launcher = subprocess.Popen(
    [sys.executable, str(ROOT / "scripts" / "launch.py"), "--processes", "2", "--devices-per-process", "2"]
    + ["--timeout", "240", "--", "scripts/finetune.py", str(folder), "--data", str(data), "--devices", "2"]
    + ["--out", str(tmp_path / "two"), *common],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    output, _ = launcher.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    os.killpg(launcher.pid, signal.SIGKILL)
    output, _ = launcher.communicate()
    pytest.fail(f"the launcher still ran after 300 s:\n{output[-3000:]}")
  assert launcher.returncode == 0, output[-3000:]
  for p in (0, 1):
    assert f"[p{p}] finetune.py: 24 chat examples (this process tokenized 12, its share)" in output
  script.main([str(folder), "--data", str(data), "--devices", "4", "--out", str(tmp_path / "one"), *common])
  two = [r["loss"] for r in json.loads((tmp_path / "two" / "report.json").read_text())["steps"]]
  one = [r["loss"] for r in json.loads((tmp_path / "one" / "report.json").read_text())["steps"]]
  assert len(two) == 3 and np.allclose(two, one, rtol=1e-6, atol=0)
  assert json.loads((tmp_path / "two" / "report.json").read_text())["config"]["processes"] == 2
  tuned, _ = models.load(tmp_path / "two" / "checkpoint", attention="dense")
  again, _ = models.load(tmp_path / "one" / "checkpoint", attention="dense")
  np.testing.assert_allclose(tuned.embed.embedding[...], again.embed.embedding[...], rtol=1e-5, atol=1e-6)


def test_rows_with_nothing_to_learn_are_left_out():
  """A 600-token prompt and its 10-token completion split into rows of 256: the two
  rows of prompt alone carry no loss weight and are left out (counted); the third,
  which holds the completion, stays with its positions going on from 512."""
  ids = np.arange(610, dtype=np.int32) % 200
  mask = np.concatenate([np.zeros(600), np.ones(10)]).astype(np.float32)
  examples = pipeline.Examples([ids], [mask], ["data.jsonl:1"], "completion", [])
  loader = pipeline.Loader(examples, 256, 1, seed=0)
  assert loader.idle_rows == 2 and len(loader.rows) == 1
  arrays, where = next(loader)
  assert where == ["data.jsonl:1"] and arrays["positions"][0, 0] == 512
  assert arrays["weights"].sum() == 10


# --- Checks that plausible slips in the data path fail. ---


def _examples(masks, where=None):
  """pipeline.Examples of the given loss masks (ids 5, 6, ... each)."""
  ids = [np.arange(5, 5 + len(m), dtype=np.int32) for m in masks]
  masks = [np.asarray(m, np.float32) for m in masks]
  return pipeline.Examples(ids, masks, where or [f"f:{i + 1}" for i in range(len(masks))], "completion", [])


def test_the_token_cache_is_keyed_by_the_template_and_keeps_the_skipped_count(folder, tmp_path):
  tok = HFTokenizer.from_folder(folder)
  data = write_jsonl(tmp_path / "c.jsonl", chats(3) + [{"messages": []}])
  cache = tmp_path / "cache"
  first = pipeline.load_examples(data, tok, skip_bad=True, cache_dir=cache)
  again = pipeline.load_examples(data, tok, skip_bad=True, cache_dir=cache)
  assert again.cached and len(again.skipped) == len(first.skipped) == 1
  other = (TEMPLATES / "llama3_1.jinja").read_text()
  changed = pipeline.load_examples(data, tok, skip_bad=True, cache_dir=cache, chat_template=other)
  assert not changed.cached and [list(x) for x in changed.ids] != [list(x) for x in first.ids]


def test_texts_end_with_eos_and_a_completion_not_its_prompt_must_hold_something(folder):
  tok = HFTokenizer.from_folder(folder)
  ids, mask = pipeline.tokenize_record(tok, {"text": "abc"}, "text", None)
  assert ids[-1] == tok.eos_id and ids[0] == tok.bos_id and mask.all()
  assert sources.check("f:1", {"prompt": "", "completion": "x"}, "completion") == {
    "prompt": "",
    "completion": "x",
  }
  with pytest.raises(sources.BadRecord, match="'completion' is empty"):
    sources.check("f:1", {"prompt": "x", "completion": " "}, "completion")


def test_the_loader_shuffles_by_its_seed_keeps_a_last_partial_batch_and_names_each_example():
  ex = _examples([[0, 1, 1, 1]] * 9)
  seen = {}
  for seed in (0, 1):
    loader = pipeline.Loader(ex, 4, 3, seed=seed)
    seen[seed] = [w for _ in range(3) for w in next(loader)[1]]
  assert sorted(seen[0]) == sorted(seen[1]) == sorted(ex.where) and seen[0] != seen[1]
  again = pipeline.Loader(ex, 4, 3, seed=1)
  assert [w for _ in range(3) for w in next(again)[1]] == seen[1]
  # Evaluation: 5 rows in batches of 2 are 3 batches, the last of one row.
  ev = pipeline.Loader(_examples([[0, 1, 1, 1]] * 5), 4, 2, shuffle=False)
  assert [len(where) for _, where in ev] == [2, 2, 1]
  # A row of several examples names each, in the row's order, for every row of the batch.
  packed = pipeline.Loader(_examples([[0, 1], [0, 1], [0, 1, 1], [0, 1, 1]]), 5, 2, shuffle=False)
  arrays, where = next(packed)
  names = [packed.examples.where[p.example] for row in packed.rows[:2] for p in row]
  assert where == names and len(where) == 4


def _slots(arrays, row):
  """(token, target, weight, position) of each slot of a batch's row."""
  return list(zip(*(arrays[n][row].tolist() for n in ("tokens", "targets", "weights", "positions"))))


def _documents(arrays, row):
  """Each document's slots in the row's order, the documents sorted."""
  ids = arrays["segment_ids"][row]
  slots = _slots(arrays, row)
  return sorted([s for s, i in zip(slots, ids) if i == d] for d in set(ids.tolist()) if d >= 0)


def test_documents_row_layout_reorders_each_row_keeping_each_documents_tokens_targets_and_weights():
  """`Loader(row_layout="documents", shards=4)`: each row a reordering of the natural
  row's (token, target, weight, id, position) slots, every document's slots in their
  natural order, some rows moved; `longest_document` the widest span of one document
  along the reordered rows (the bound the ring keeps); the setting in `settings` (what a
  resume checks); bad settings named."""
  masks = [[0] * 3 + [1] * (n - 3) for n in (6400, 960, 640, 128, 4800, 2400, 800, 192, 96)]
  ex = _examples(masks)
  natural = pipeline.Loader(ex, 8192, 2, shuffle=False)
  moved = pipeline.Loader(ex, 8192, 2, shuffle=False, row_layout="documents", shards=4)
  reordered = 0
  spans = []
  for (a, _), (b, _) in zip(natural.in_order(), moved.in_order()):
    for row in range(a["tokens"].shape[0]):
      assert sorted(_slots(a, row)) == sorted(_slots(b, row))
      reordered += _slots(a, row) != _slots(b, row)
      assert _documents(a, row) == _documents(b, row)  # each in its natural order
      seg = b["segment_ids"][row]
      firsts = [np.flatnonzero(seg == x)[0] for x in sorted(set(seg[seg >= 0].tolist()))]
      assert firsts == sorted(firsts)  # ids renumbered as they appear: they rise along the row
      spans += [np.ptp(np.flatnonzero(seg == x)) + 1 for x in set(seg[seg >= 0].tolist())]
  assert reordered and moved.longest_document == max(spans) >= natural.longest_document
  assert moved.settings == {"row_layout": "documents", "shards": 4} and natural.settings == {}
  pairs = pipeline.Examples(
    ex.ids[:2], ex.masks[:2], ex.where[:2], "preference", [], docs=[[3000, 3400], [900, 60]]
  )
  with pytest.raises(ValueError, match=r"row_layout='documents' reorders and renumbers .* preference row"):
    pipeline.Loader(pairs, 8192, 2, long="drop", row_layout="documents", shards=4)
  with pytest.raises(ValueError, match=r"row_layout='zigzag': expected 'natural' or 'documents'"):
    pipeline.Loader(ex, 8192, 2, row_layout="zigzag")
  with pytest.raises(ValueError, match=r"shards=0 must be a positive int"):
    pipeline.Loader(ex, 8192, 2, shards=0)
  with pytest.raises(ValueError, match=r"length=8196 must be a multiple of 2 \* shards = 8"):
    pipeline.Loader(ex, 8196, 2, row_layout="documents", shards=4)


def test_split_off_holds_out_one_at_least_and_rows_learn_past_their_first_token():
  kept, held = pipeline.split_off(_examples([[0, 1]] * 3), 0.1)
  assert len(held) == 1 and len(kept) == 2
  # The first token of a row is predicted by nothing: a row whose only weight is there learns nothing.
  loader = pipeline.Loader(_examples([[1, 0, 0], [0, 0, 1]]), 3, 1, shuffle=False)
  assert loader.idle_rows == 1 and len(loader.rows) == 1
