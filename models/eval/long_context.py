"""Long-context retrieval with a pretrained model: documents of up to 32K tokens with
needles at several depths, read by ring attention over a mesh and by two baselines.

A document holds one needle per depth, each a different kind of fact: the pass key (5
digits) first, then a secret animal, city, fruit, ... (task "passkey": "The pass key is
48213. Remember it. 48213 is the pass key." in repeated filler, as in Mohtashami and
Jaggi 2023, arXiv 2305.16300; task "needle": "The secret city is Oslo." in Shakespeare,
as the needles of RULER, Hsieh et al. 2024, arXiv 2404.06654). The document is
prefilled into the KV cache once; each question ("What is the secret city? The secret
city is") continues that cache by decoding, from the same cached state each time, and
the answer is the first word (or number) the model generates.

Readers:
- "ring": the whole document on every device of the mesh, each holding T / devices
  tokens (`attention="ring"`).
- "local": shard-local attention, each device attending within its own T / devices
  tokens; the question continues the last device's tokens, so the answer depends on
  those alone, and this reader runs the model on them (`local_equals_last_shard`
  checks the identity against `attention="local"`).
- "last4k": the model reading only BOS and the document's last 4,063 tokens, which
  with the question and answer (32 tokens) is what a model with a 4K limit would see.
  At 4K it reads the whole document, as dense does: dense's run there is its run.
- "dense": the same model on one device (`attention="dense"`), the whole document,
  where it runs: the ring's logits and tokens are compared with its. Its prefill and
  decoding run the library's KV-cache attention on a one-device mesh; its forward
  (`model(tokens)`) runs `jax.nn.dot_product_attention`, which the tests hold to a
  float64 NumPy forward.

The needle demo's small models (`train.tasks.NeedleTask`) are evaluated here too
(`accuracy_grid`, `generated_answers`, `plot_report`): the same grid of context length
by needle depth and the same heatmaps (`heatmap`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import time

import jax
import numpy as np
from flax import nnx

from ..generate import Engine, generate

# The repository's data/ (models/<here>/this file: three folders up).
DATA = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "data", "shakespeare"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASKS = ("passkey", "needle")
READERS = ("ring", "local", "last4k", "dense")
LAST4K_TOKENS = 4096  # the "last4k" reader's context: BOS, the document's last tokens, the room
ANSWER_ROOM = 32  # tokens a document leaves free for the question and the answer
# Names this module had before the engine moved to `models.generate`.
_RENAMED = dict(
  Reader="jax_ring.models.generate.Engine",
  Program="jax_ring.models.generate.Programs",
  Filled="jax_ring.models.generate.Constant",
  ROOM="ANSWER_ROOM",
  LAST="LAST4K_TOKENS",
)


@dataclasses.dataclass(frozen=True)
class Question:
  label: str
  answer: str  # digits
  depth: float  # where the needle starts, as a fraction of the document
  prompt: str  # what the model continues


@dataclasses.dataclass(frozen=True)
class Document:
  task: str
  tokens: np.ndarray  # int32 [T], BOS first
  questions: tuple[Question, ...]


def needle_text(task: str, label: str, answer: str) -> tuple[str, str]:
  """(needle sentence, question) of a task."""
  match task:
    case "passkey":
      return (
        f"The {label} is {answer}. Remember it. {answer} is the {label}. ",
        f" What is the {label}? The {label} is",
      )
    case "needle":
      return (f"The {label} is {answer}. ", f"\nWhat is the {label}? The {label} is")
    case _:
      raise ValueError(f"Unsupported task={task!r}; expected one of {TASKS}")


# One needle per depth, each a different kind of answer: needles of one kind ("the
# door code is 48213", "the room number is 60208") all get the last one's answer from
# this model. The pass key comes first; the others draw from their lists.
FACTS = (
  ("pass key", None),
  (
    "secret animal",
    ("giraffe", "octopus", "penguin", "kangaroo", "flamingo", "hedgehog", "walrus", "beaver"),
  ),
  ("secret city", ("Lisbon", "Nairobi", "Oslo", "Kyoto", "Quito", "Dublin", "Cairo", "Lima")),
  ("secret fruit", ("mango", "papaya", "apricot", "pomegranate", "lychee", "kiwi", "plum", "fig")),
  ("secret instrument", ("violin", "trumpet", "harp", "banjo", "cello", "flute", "tuba", "accordion")),
  ("secret metal", ("copper", "cobalt", "nickel", "titanium", "zinc", "tungsten", "platinum", "chromium")),
  ("secret planet", ("Mercury", "Venus", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune", "Pluto")),
  ("secret gemstone", ("ruby", "emerald", "sapphire", "topaz", "opal", "garnet", "amethyst", "jade")),
)


@functools.cache
def _shakespeare() -> str:
  parts = []
  for name in sorted(os.listdir(DATA)):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
      parts.append(f.read())
  return "\n\n".join(parts)


def _haystack(tokenizer, task: str, count: int, rng) -> list[int]:
  """`count` tokens of the task's filler, cut at a sentence end."""
  if task == "passkey":
    unit = tokenizer.encode(FILLER)
    return (unit * (count // len(unit) + 1))[:count]
  text = _shakespeare()
  start = int(rng.integers(0, len(text) // 2))
  start = text.index("\n", start) + 1
  ids = tokenizer.encode(text[start : start + 6 * count])
  if len(ids) < count:
    ids = ids + tokenizer.encode(text[: 6 * count])
  return ids[:count]


def make_document(tokenizer, task: str, length: int, depths, seed: int = 0) -> Document:
  """A document of exactly `length` tokens (BOS first, where the model reads one) with a
  needle at each depth in [0, 1], each with its own label and a random answer (5 digits
  for the pass key, 7 for the magic number), placed at the sentence boundary nearest to
  its depth."""
  depths = sorted(float(d) for d in depths)
  if not depths or not all(0.0 <= d <= 1.0 for d in depths):
    raise ValueError(f"depths={depths} must be numbers in [0, 1]")
  if len(depths) > len(FACTS):
    raise ValueError(f"{len(depths)} depths: at most {len(FACTS)} needles a document")
  rng = np.random.default_rng([seed, length, TASKS.index(task)])
  needles, questions = [], []
  for label, pool in FACTS[: len(depths)]:
    answer = str(int(rng.integers(10_000, 100_000))) if pool is None else str(pool[rng.integers(len(pool))])
    sentence, question = needle_text(task, label, answer)
    needles.append(tokenizer.encode(sentence))
    questions.append((label, answer, question))
  first = tokenizer.prefix()  # BOS, where the model reads one (Qwen reads none)
  room = length - len(first) - sum(len(n) for n in needles)
  if room < 16:
    raise ValueError(f"length={length} leaves no room for a haystack around {len(needles)} needles")
  hay = _haystack(tokenizer, task, room, rng)
  text = tokenizer.pieces.__getitem__ if hasattr(tokenizer, "pieces") else lambda t: tokenizer.decode([t])
  ends = {i + 1 for i, t in enumerate(hay) if text(t).endswith((".", "\n"))}
  ends = np.array(sorted(ends | {0, room}))
  out, cut, placed = first, 0, []
  for needle, depth in zip(needles, depths):
    at = int(ends[np.argmin(np.abs(ends - depth * room))])
    at = max(at, cut)
    out += hay[cut:at]
    placed.append(len(out) / length)
    out += needle
    cut = at
  out += hay[cut:]
  qs = tuple(Question(label, answer, d, q) for (label, answer, q), d in zip(questions, placed))
  return Document(task, np.asarray(out, np.int32), qs)


def _word(expected: str) -> tuple[str, str]:
  """(what an answer's first word is, what ends it): digits for a number, else letters."""
  return (r"\d+", r"\D") if expected.isdigit() else (r"[A-Za-z]+", r"[^A-Za-z]")


def is_complete(expected: str, generated: str) -> bool:
  """Whether `generated` holds its first word (number, for a number) whole: something
  that cannot continue it follows it, so no further token changes `is_right`."""
  return re.search("".join(_word(expected)), generated) is not None


def is_right(expected: str, generated: str) -> bool:
  """The answer is the first word (a number: the first number) the model generates."""
  match = re.search(_word(expected)[0], generated)
  return match is not None and match.group(0).lower() == expected.lower()


def question_lengths(tokenizer, doc: Document) -> list[int]:
  return sorted({len(tokenizer.encode(q.prompt)) for q in doc.questions})


def room_for(lengths: list[int], new_tokens: int) -> int:
  """Cache room after a document for its longest question and the answer: ANSWER_ROOM (a
  nominal length's document fills its cache to the length) unless they need more."""
  return max(ANSWER_ROOM, lengths[-1] + new_tokens)


def read(
  reader: Engine, tokenizer, doc: Document, tokens: np.ndarray, new_tokens: int, program=None, answered=None
) -> dict:
  """Prefill `tokens` (the document, or the part of it this reader sees) once, then
  answer every question of `doc` from that state, each up to `new_tokens` tokens and
  no further than its first word (or number) needs (`is_complete`). "logits": the
  prefill's at its last token [1, V], then per question the row that gave each
  generated token. `program`: the reader's compiled programs for these tokens
  (compiled here, with caches just large enough, if None); `answered(question)` is
  called after each answer (progress)."""
  lengths = question_lengths(tokenizer, doc)
  if program is None:
    program = reader.compile(len(tokens), len(tokens) + room_for(lengths, new_tokens), lengths)
  first, cache, seconds = reader.prefill(program, tokens)
  answers, logits, per_token = [], [first[None]], []
  answering = time.perf_counter()
  for q in doc.questions:
    done = lambda ids, q=q: is_complete(q.answer, tokenizer.decode(ids))
    ids, step_logits, per = reader.answer(program, cache, tokenizer.encode(q.prompt), new_tokens, done)
    text = tokenizer.decode(ids)
    answers.append(
      dict(
        label=q.label,
        expected=q.answer,
        depth=round(q.depth, 3),
        generated=text,
        right=is_right(q.answer, text),
      )
    )
    logits.append(step_logits)
    per_token.append(per)
    if answered is not None:
      answered(q)
  timed = [t for t in per_token if not np.isnan(t)]
  return dict(
    answers=answers,
    logits=logits,
    tokens=len(tokens),
    prefill_s=seconds,
    answer_s=time.perf_counter() - answering,
    decode_ms=1e3 * float(np.median(timed)) if timed else float("nan"),
    compile_s=program.compile_s,
    temp_bytes=program.temp_bytes,
  )


def logit_diff(a: list, b: list) -> float:
  """The largest |a - b| over two readings' logits (`read`), each answer's rows compared
  as far as both generated."""
  return max(float(np.abs(x[: len(y)] - y[: len(x)]).max()) for x, y in zip(a, b))


def reader_tokens(kind: str, doc: Document, devices: int) -> np.ndarray:
  """The tokens a reader prefills: the whole document, its last shard, or its last 4K."""
  match kind:
    case "ring" | "dense":
      return doc.tokens
    case "local":
      shard = -(-len(doc.tokens) // devices)
      return doc.tokens[(devices - 1) * shard :]
    case "last4k":  # BOS, then the document's last LAST4K_TOKENS - ANSWER_ROOM - 1 tokens
      if len(doc.tokens) <= LAST4K_TOKENS - ANSWER_ROOM:
        return doc.tokens
      return np.concatenate([doc.tokens[:1], doc.tokens[1 - (LAST4K_TOKENS - ANSWER_ROOM) :]])
    case _:
      raise ValueError(f"Unsupported reader={kind!r}; expected one of {READERS}")


def run_grid(
  ring_model,
  dense_model,
  tokenizer,
  *,
  devices: int,
  tasks=("passkey",),
  lengths=(4096, 8192, 16384, 32768),
  depths=(0.05, 0.275, 0.5, 0.725, 0.95),
  readers=("ring", "local", "last4k"),
  dense_max: int = 4096,
  one_per_document: bool = False,
  new_tokens: int = 6,
  seed: int = 0,
  log=print,
  progress: bool = False,
  release_dense: bool = False,
) -> dict:
  """Reads every (task, length) document with each reader and returns the report:
  "answers" (reader, task, length, depth, expected, generated, right), "runs" (per
  reader, task and length: tokens prefilled, prefill seconds and tokens/s, decode
  ms/token, compile seconds, per-device compiled temp MiB) and "exact" (per task and
  length where dense ran: the ring's largest |logit difference| from dense's, and
  whether every generated token is the same). A length is a nominal context: its
  documents have `length - ANSWER_ROOM` tokens, the question and answer fill the rest.
  `progress`: a bar over every question of the grid (tqdm: reader, length, depth,
  time left), the log lines printed above it. `release_dense`: once the baselines have
  read the grid's last document, the dense model's weights are deleted
  (`jax.Array.delete`), so that the ring's longest reading runs without them beside it
  (1.1 GB for Gemma 3 270M); the caller's dense model is unusable afterwards."""
  report = dict(answers=[], runs=[], exact=[], lengths=list(lengths), depths=list(depths), tasks=list(tasks))
  dense_reader = Engine(dense_model)
  readers_of = dict(ring=Engine(ring_model), local=dense_reader, last4k=dense_reader, dense=dense_reader)
  groups = [[d] for d in depths] if one_per_document else [list(depths)]
  documents = {
    (task, length): [make_document(tokenizer, task, length - ANSWER_ROOM, g, seed) for g in groups]
    for task in tasks
    for length in lengths
  }
  # The ring reads each document last: its program for a length compiles in a thread
  # while the baselines read that length's documents (compiling its 18 layers takes
  # about as long as a 4K prefill), the first length's included; the ring's own prefill
  # and decoding never share the machine with a compile.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  keys = list(documents)

  def kinds_at(length):
    kinds = list(readers) + (["dense"] if length <= dense_max and "ring" in readers else [])
    return sorted(kinds, key=("local", "last4k", "dense", "ring").index)

  from tqdm import tqdm

  questions = sum(
    len(kinds_at(length)) * sum(len(d.questions) for d in documents[task, length]) for task, length in keys
  )
  bar = tqdm(total=questions, desc="reading", unit="question", disable=not progress, dynamic_ncols=True)
  if progress:
    log = bar.write

  # Caches of one capacity per reader (the ring's model, the dense model's for the
  # local, last-4K and dense readers): the longest document it reads and the room, so
  # that its decode steps compile once for every length.
  every = [d for docs in documents.values() for d in docs]
  room = max(room_for(question_lengths(tokenizer, d), new_tokens) for d in every)
  capacity = {}
  for (_, length), docs in documents.items():
    for kind in kinds_at(length):
      r = readers_of[kind]
      capacity[r] = max(capacity.get(r, 0), len(reader_tokens(kind, docs[0], devices)) + room)

  asked = lambda docs: sorted({n for d in docs for n in question_lengths(tokenizer, d)})

  def compile_ring(i):
    if "ring" not in readers or i >= len(keys):
      return None
    docs = documents[keys[i]]
    q = asked(docs)
    return pool.submit(readers_of["ring"].compile, len(docs[0].tokens), capacity[readers_of["ring"]], q)

  ahead = {keys[0]: compile_ring(0)}
  for task in tasks:
    for length in lengths:
      docs = documents[task, length]
      kinds = kinds_at(length)
      results = {}
      for kind in kinds:
        reader = readers_of[kind]
        bar.set_postfix_str(f"{kind} at {length}: prefill")
        if kind == "ring":
          program = ahead[task, length].result()
          if release_dense and (task, length) == keys[-1]:
            dense_reader.programs.clear()
            for x in jax.tree.leaves(nnx.state(dense_model)):
              x.delete()
        else:  # a length's documents all have its number of tokens (make_document)
          n = len(reader_tokens(kind, docs[0], devices))
          program = reader.compile(n, capacity[reader], asked(docs))

        def answered(q, kind=kind, length=length):
          bar.set_postfix_str(f"{kind} at {length}: depth {q.depth:.2f} answered")
          bar.update()

        # Dense at a length where the last 4K tokens are the whole document: the same
        # model on the same tokens, so last4k's reading is dense's (not run twice).
        shared = kind == "dense" and "last4k" in results
        shared = shared and all(len(reader_tokens("last4k", d, devices)) == len(d.tokens) for d in docs)
        if shared:
          outs = results["last4k"]
          bar.update(sum(len(d.questions) for d in docs))
        else:
          outs = [
            read(reader, tokenizer, d, reader_tokens(kind, d, devices), new_tokens, program, answered)
            for d in docs
          ]
        if kind == "ring":
          i = keys.index((task, length)) + 1
          if i < len(keys):
            ahead[keys[i]] = compile_ring(i)
        results[kind] = outs
        for out in outs:
          for a in out["answers"]:
            report["answers"].append(dict(reader=kind, task=task, length=length, **a))
        prefill = float(sum(o["prefill_s"] for o in outs))
        tokens = int(sum(o["tokens"] for o in outs))
        run = dict(
          reader=kind,
          task=task,
          length=length,
          tokens=tokens,
          prefill_s=round(prefill, 2),
          answer_s=round(float(sum(o["answer_s"] for o in outs)), 2),
          tokens_per_s=round(tokens / prefill, 1),
          decode_ms=round(float(np.median([o["decode_ms"] for o in outs])), 1),
          compile_s=round(float(np.median([o["compile_s"] for o in outs])), 1),
          temp_mib=round(max(o["temp_bytes"] for o in outs) / 2**20, 1),
          right=sum(a["right"] for o in outs for a in o["answers"]),
          asked=sum(len(o["answers"]) for o in outs),
        )
        if shared:
          run["same_run_as"] = "last4k"
        report["runs"].append(run)
        log(
          f"{task:8s} {length:6d} {kind:7s} {run['right']}/{run['asked']} right  prefill {prefill:6.1f} s "
          f"({run['tokens_per_s']:7.1f} tok/s)  decode {run['decode_ms']:6.1f} ms/token  "
          f"temp {run['temp_mib']:7.1f} MiB/device  "
          + ("(last4k's run: the same tokens)  " if shared else "")
          + "  ".join(repr(a["generated"]) for o in outs for a in o["answers"])
        )
      # The programs of this length (the ring's, the dense and local readers'): the
      # last 4K tokens' program serves every longer length and stays.
      for kind in ("ring", "local"):
        readers_of[kind].drop(len(reader_tokens(kind, docs[0], devices)))
      ahead.pop((task, length), None)
      if "dense" in results:
        ring, dense = results["ring"], results["dense"]
        diff = max(logit_diff(r["logits"], d["logits"]) for r, d in zip(ring, dense))
        scale = max(float(np.abs(x).max()) for d in dense for x in d["logits"])
        pairs = [(a, b) for r, d in zip(ring, dense) for a, b in zip(r["answers"], d["answers"])]
        same = all(a["generated"] == b["generated"] for a, b in pairs)
        report["exact"].append(
          dict(task=task, length=length, max_abs_logit_diff=diff, max_abs_logit=scale, same_tokens=same)
        )
        log(
          f"{task:8s} {length:6d} ring vs dense: max |logit diff| {diff:.2e} (logits up to {scale:.1f}); "
          f"same tokens: {same}"
        )
  pool.shutdown()
  bar.close()
  report["time_s"] = time_spent(report, readers_of)
  return report


def time_spent(report: dict, readers_of: dict) -> dict:
  """Where the grid's time went, in seconds: per reader kind, its prefills and its
  answers (each question and the generated tokens); the compiles of the ring's
  programs (in a thread, beside the baselines' reading) and of the baselines' (the
  dense model's programs, shared by the local, last-4K and dense readers)."""
  spent = {}
  for run in report["runs"]:
    kind = spent.setdefault(run["reader"], {"prefill": 0.0, "answer": 0.0})
    if "same_run_as" in run:  # another reader's run, counted there
      continue
    kind["prefill"] += run["prefill_s"]
    kind["answer"] += run["answer_s"]
  compiles = {"ring": readers_of["ring"], "baselines": readers_of["dense"]}
  for name, reader in compiles.items():
    spent[f"{name} compile"] = reader.compile_s
  return {
    k: ({n: round(t, 1) for n, t in v.items()} if isinstance(v, dict) else round(v, 1))
    for k, v in spent.items()
  }


def dense_memory(report: dict, dense_model, room: int = ANSWER_ROOM, known=None) -> dict:
  """Per-device compiled temp MiB of dense attention's prefill at each length of the
  report: the dense run's where it ran, else `known`'s (`compiled_dense_memory`, from
  before the grid), else compiled now (not run), which says what dense would need where
  it does not fit."""
  ran = {r["length"]: r["temp_mib"] for r in report["runs"] if r["reader"] == "dense"}
  ran = {**(known or {}), **ran}
  missing = [t for t in report["lengths"] if t not in ran]
  ran |= compiled_dense_memory(dense_model, missing, room) if missing else {}
  return {int(t): ran[t] for t in report["lengths"]}


def compiled_dense_memory(dense_model, lengths, room: int = ANSWER_ROOM) -> dict:
  """{length: per-device compiled temp MiB of the dense model's prefill} (compiled, not run)."""
  reader = Engine(dense_model)
  return {int(t): round(reader.prefill_temp(t - room, t) / 2**20, 1) for t in lengths}


def heatmap(ax, grid, *, rows, columns, title: str, xlabel: str, cmap: str, cell):
  """grid [len(rows), len(columns)] (context length x needle depth) drawn on `ax`, with
  `cell(value) -> (text, colour)` written in each cell that is not NaN; the image."""
  image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap=cmap, aspect="auto", origin="lower")
  ax.set_xticks(range(len(columns)), columns, fontsize=7)
  ax.set_yticks(range(len(rows)), rows)
  ax.set(title=title, xlabel=xlabel)
  for (y, x), v in np.ndenumerate(grid):
    if not np.isnan(v):
      text, colour = cell(v)
      ax.text(x, y, text, ha="center", va="center", fontsize=6, color=colour)
  return image


def plot(report: dict, path: str) -> None:
  """One heatmap (context length x needle depth: right or wrong) per reader and task."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  readers = [r for r in READERS if any(a["reader"] == r for a in report["answers"])]
  tasks, lengths, depths = report["tasks"], report["lengths"], report["depths"]
  fig, axes = plt.subplots(
    len(tasks), len(readers), figsize=(3.6 * len(readers), 2.8 * len(tasks)), squeeze=False
  )
  for i, task in enumerate(tasks):
    for j, reader in enumerate(readers):
      grid = np.full((len(lengths), len(depths)), np.nan)
      for a in report["answers"]:
        if a["reader"] == reader and a["task"] == task:
          column = int(np.argmin(np.abs(np.asarray(depths) - a["depth"])))
          grid[lengths.index(a["length"]), column] = a["right"]
      heatmap(
        axes[i, j],
        grid,
        rows=[f"{t // 1024}K" if t >= 1024 else str(t) for t in lengths],
        columns=[f"{d:.2f}" for d in depths],
        title=f"{reader}: {task}",
        xlabel="needle depth",
        cmap="RdYlGn",
        cell=lambda v: ("right" if v else "wrong", "k"),
      )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- The small models trained on `train.tasks.NeedleTask` (scripts/needle_demo.py):
# accuracy by needle depth and context length under teacher forcing, the answers they
# generate, and the same heatmaps. ---


def depth_bins(n: int) -> list[tuple[float, float]]:
  """`n` equal bins of needle depth over [0, 1)."""
  edges = np.linspace(0.0, 1.0, n + 1)
  return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:])]


@functools.cache
def _rows_right():
  from ..train.scratch import rows_right

  @nnx.jit
  def answered(model, tokens, targets, weights):
    """bool [B]: the row's answer is the argmax at every answer token."""
    return rows_right(model(tokens), targets, weights)

  return answered


class _Bins:
  """The examples of several depth bins as one batch: rows [j * rows, (j + 1) * rows)
  are row 0..rows-1 of bin j's batch (`probes[j].batch(seed, j, rows)`), so a batch
  of every bin is the bins' batches stacked, and a process builds only its rows."""

  def __init__(self, probes, seed: int, rows: int):
    self.probes, self.seed, self.rows = probes, seed, rows
    self.seq_len = probes[0].seq_len

  def batch(self, seed, step, batch_size, rows=None):
    del seed, step, batch_size  # fixed by the bins
    rows = range(len(self.probes) * self.rows) if rows is None else rows
    parts = []
    for j, probe in enumerate(self.probes):
      mine = [r - j * self.rows for r in rows if j * self.rows <= r < (j + 1) * self.rows]
      if mine:
        parts.append(probe.batch(self.seed, j, self.rows, rows=mine))
    return type(parts[0])(*(np.concatenate(x) for x in zip(*parts)))


def accuracy_grid(model, task, lengths, bins: int, rows: int, seed: int, mesh, spec):
  """Exact-answer accuracy [len(lengths), bins]: for each context length and depth bin,
  the fraction of `rows` fresh examples (seeds disjoint from training's) answered
  right under teacher forcing. One call per length evaluates every bin."""
  from ..train.scratch import place_batch

  grid = np.zeros((len(lengths), bins))
  for i, length in enumerate(lengths):
    probes = [dataclasses.replace(task, seq_len=length, depth=depth) for depth in depth_bins(bins)]
    stacked = _Bins(probes, seed + 20_000 + i, rows)
    batch = place_batch(stacked, 0, 0, bins * rows, mesh, spec)
    right = np.asarray(_rows_right()(model, *batch)).reshape(bins, rows)
    grid[i] = right.mean(axis=1)
  return grid


def generated_answers(model, task, count: int, seed: int):
  """`count` fresh examples answered by `models.generate` (greedy): a list of dicts
  with the needle's depth, the question's name, the truth and the model's answer."""
  from ..train.tasks import decode, row_rng

  prompts, truths, depths = [], [], []
  for r in range(count):
    seq, answer, depth = task.example(row_rng(seed + 30_000, 0, r))
    prompts.append(seq[:answer])
    truths.append(decode(seq[answer:]))
    depths.append(depth)
  out = generate(model, np.stack(prompts), max_new_tokens=task.digits)
  tokens = np.asarray(jax.device_get(out.tokens))
  results = []
  for r in range(count):
    question = decode(prompts[r]).rsplit("\n", 1)[-1]  # the prompt ends with the question
    results.append(
      {
        "depth": round(float(depths[r]), 3),
        "question": question,
        "truth": truths[r],
        "answer": decode(tokens[r]),
      }
    )
  return results


def plot_report(report: dict, path: str) -> None:
  """One heatmap of accuracy (context length x needle depth) per attention kind, and
  the training loss curves, in one PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = report["runs"]
  lengths, bins = report["lengths"], report["bins"]
  fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.6 * (len(runs) + 1), 3.6))
  for n, (ax, run) in enumerate(zip(axes, runs.values())):
    image = heatmap(
      ax,
      np.asarray(run["grid"]),
      rows=[str(t) for t in lengths] if n == 0 else [""] * len(lengths),
      columns=[f"{(j + 0.5) / bins:.2f}" for j in range(bins)],
      title=run["label"],
      xlabel="needle depth (bin centre)",
      cmap="viridis",
      cell=lambda v: (f"{v:.2f}", "w" if v < 0.6 else "k"),
    )
    if n == 0:
      ax.set_ylabel("context length (bytes)")
  fig.colorbar(image, ax=axes[: len(runs)].tolist(), shrink=0.8, label="exact-answer accuracy")
  ax = axes[-1]
  for name, run in runs.items():
    h = run["history"]
    ax.plot(h["step"], h["loss"], label=name)
  ax.set(xlabel="step", ylabel="training loss (weighted bytes)", yscale="log", title="training")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def __getattr__(name):
  if name in _RENAMED:
    import importlib
    import warnings

    new = _RENAMED[name]
    warnings.warn(f"long_context.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
    if new.startswith("jax_ring."):  # the module (the package's `generate` is the function)
      module = importlib.import_module(new.rpartition(".")[0])
      return getattr(module, new.rpartition(".")[2])
    return globals()[new]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
