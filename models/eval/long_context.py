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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The repository's data/ (models/<here>/this file: three folders up).
DATA = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data", "shakespeare"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASKS = ("passkey", "needle")
READERS = ("ring", "local", "last4k", "dense")
LAST = 4096  # the "last4k" reader's context: BOS, the document's last tokens, the room
ROOM = 32  # tokens a document leaves free for the question and the answer


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


@dataclasses.dataclass
class Program:
  """A reader's compiled programs for one document length and cache capacity: the
  prefill into a fresh cache, and the decode steps by token count (compiled as
  questions need them, shared by every length read into caches of that capacity).
  `cache`: what an empty cache holds, made anew for each prefill (`Reader.empty_cache`),
  so that no program keeps a cache alive between documents (32K tokens' take 1.2 GB for
  Gemma 3 270M)."""

  graphdef: Any
  weights: Any
  cache: Any
  prefill: Any
  steps: dict
  compile_s: float  # the prefill's and the steps it compiled so far
  temp_bytes: int  # the prefill's, per device, from the compiler


@dataclasses.dataclass(frozen=True)
class Filled:
  """An array of `spec` (shape, dtype, sharding) holding `value` everywhere."""

  spec: jax.ShapeDtypeStruct
  value: Any

  def make(self):
    return jnp.full(self.spec.shape, self.value, self.spec.dtype, device=self.spec.sharding)


def _as_filled(x):
  """x as a `Filled` where it holds one value everywhere (an empty cache's arrays do:
  zeros, and -1 for positions), else x itself."""
  first = x.ravel()[0]
  if bool(jnp.all(x == first)):
    return Filled(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), first.item())
  return x


class Reader:
  """A model that prefills a document into its KV cache once and answers questions by
  decoding from that cached state: a compiled prefill per document length and cache
  capacity, and decode steps (a whole question at once, or one token) per capacity,
  which every length read into caches of that capacity shares."""

  def __init__(self, model):
    self.model = model
    self.programs: dict[tuple, Program] = {}
    self.steps: dict[int, dict] = {}  # per capacity: the decode steps by token count
    self.compile_s = 0.0  # every program's, dropped ones included
    self.lock = threading.Lock()

    # The weights go in as arguments and only the caches come out: returning the
    # weights too would copy them on every call.
    @functools.partial(jax.jit, static_argnums=0)
    def prefill(graphdef, weights, cache, tokens):
      m = nnx.merge(graphdef, weights, cache)
      return m.prefill(tokens)[0], nnx.state(m, nnx.Cache)

    # Decoding updates the caches in place (donated); `answer` copies them once first.
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def step(graphdef, weights, cache, tokens):
      m = nnx.merge(graphdef, weights, cache)
      logits = m.decode(tokens)[0, -1]
      return logits, jnp.argmax(logits).astype(jnp.int32).reshape(1, 1), nnx.state(m, nnx.Cache)

    self._prefill, self._step = prefill, step

  def _lowered_prefill(self, length: int, capacity: int):
    """(graphdef, weights, cache, the prefill lowered) with caches for `capacity` tokens."""
    if capacity < length + 1:
      raise ValueError(f"capacity={capacity} must exceed the document's length={length} (room to decode)")
    self.model.init_cache(1, capacity)
    graphdef, weights, cache = nnx.split(self.model, nnx.Param, nnx.Cache)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    lowered = self._prefill.lower(graphdef, weights, cache, tokens)
    self.model.init_cache(1, 1)  # the model's own caches: small again
    return graphdef, weights, cache, lowered

  def compile(self, length: int, capacity: int, questions=()) -> Program:
    """The programs for a document of `length` tokens read into caches of `capacity`
    tokens (the document, the longest question and the answer): the prefill, and the
    decode steps of one token and of each length in `questions` that no earlier program
    of this capacity compiled (safe to call from another thread)."""
    with self.lock:
      start = time.perf_counter()
      program = self.programs.get((length, capacity))
      if program is None:
        graphdef, weights, cache, lowered = self._lowered_prefill(length, capacity)
        prefill = lowered.compile()
        temp = int(prefill.memory_analysis().temp_size_in_bytes)
        empty = jax.tree.map(_as_filled, cache)
        steps = self.steps.setdefault(capacity, {})
        program = Program(graphdef, weights, empty, prefill, steps, 0.0, temp)
        self.programs[length, capacity] = program
      spec = lambda x: x.spec if isinstance(x, Filled) else x
      cache = jax.tree.map(spec, program.cache, is_leaf=lambda x: isinstance(x, Filled))
      tokens = lambda n: jax.ShapeDtypeStruct((1, n), jnp.int32)
      for n in sorted({1, *questions} - set(program.steps)):
        program.steps[n] = self._step.lower(program.graphdef, program.weights, cache, tokens(n)).compile()
      spent = time.perf_counter() - start
      program.compile_s += spent
      self.compile_s += spent
      return program

  def prefill_temp(self, length: int, capacity: int) -> int:
    """Per-device temp bytes of the prefill for `length` tokens into caches of
    `capacity` (compiled, not run)."""
    with self.lock:
      start = time.perf_counter()
      lowered = self._lowered_prefill(length, capacity)[3]
      temp = int(lowered.compile().memory_analysis().temp_size_in_bytes)
      self.compile_s += time.perf_counter() - start
      return temp

  def drop(self, length: int) -> None:
    """Forgets the prefills for `length` tokens (compiled programs hold memory; a
    length read once needs its prefill no more). The decode steps stay: other lengths
    share them."""
    with self.lock:
      for key in [k for k in self.programs if k[0] == length]:
        del self.programs[key]

  @staticmethod
  def empty_cache(program: Program):
    """A new empty cache for the program's prefill."""
    return jax.tree.map(lambda x: x.make() if isinstance(x, Filled) else x, program.cache)

  @staticmethod
  def prefill(program: Program, tokens: np.ndarray):
    """(logits [V] at the last token, cached state, seconds) of tokens int [T]."""
    empty = jax.block_until_ready(Reader.empty_cache(program))
    start = time.perf_counter()
    logits, cache = program.prefill(program.weights, empty, jnp.asarray(tokens[None]))
    logits = np.asarray(logits)
    return logits, cache, time.perf_counter() - start

  @staticmethod
  def answer(program: Program, cache, question: list[int], new_tokens: int, done=None):
    """The question (teacher-forced, one call), then greedy tokens from `cache`, at most
    `new_tokens` of them, fewer where `done(ids)` says the tokens so far hold the answer:
    (generated ids, logits [len(ids), V] (the row that gave each id), seconds per decode
    step, or nan where the question's call gave the whole answer)."""
    steps, weights = program.steps, program.weights
    cache = jax.tree.map(jnp.copy, cache)
    last, nxt, cache = steps[len(question)](weights, cache, jnp.asarray([question], jnp.int32))
    logits, out = [last], [int(nxt[0, 0])]
    start = time.perf_counter()
    while len(out) < new_tokens and not (done is not None and done(out)):
      last, nxt, cache = steps[1](weights, cache, nxt)
      logits.append(last)
      out.append(int(nxt[0, 0]))
    per_token = (time.perf_counter() - start) / (len(out) - 1) if len(out) > 1 else float("nan")
    return out, np.stack([np.asarray(x) for x in logits]), per_token


def question_lengths(tokenizer, doc: Document) -> list[int]:
  return sorted({len(tokenizer.encode(q.prompt)) for q in doc.questions})


def room_for(lengths: list[int], new_tokens: int) -> int:
  """Cache room after a document for its longest question and the answer: ROOM (a
  nominal length's document fills its cache to the length) unless they need more."""
  return max(ROOM, lengths[-1] + new_tokens)


def read(
  reader: Reader, tokenizer, doc: Document, tokens: np.ndarray, new_tokens: int, program=None, answered=None
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
    case "last4k":  # BOS, then the document's last LAST - ROOM - 1 tokens
      if len(doc.tokens) <= LAST - ROOM:
        return doc.tokens
      return np.concatenate([doc.tokens[:1], doc.tokens[1 - (LAST - ROOM) :]])
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
) -> dict:
  """Reads every (task, length) document with each reader and returns the report:
  "answers" (reader, task, length, depth, expected, generated, right), "runs" (per
  reader, task and length: tokens prefilled, prefill seconds and tokens/s, decode
  ms/token, compile seconds, per-device compiled temp MiB) and "exact" (per task and
  length where dense ran: the ring's largest |logit difference| from dense's, and
  whether every generated token is the same). A length is a nominal context: its
  documents have `length - ROOM` tokens, the question and answer fill the rest.
  `progress`: a bar over every question of the grid (tqdm: reader, length, depth,
  time left), the log lines printed above it."""
  report = dict(answers=[], runs=[], exact=[], lengths=list(lengths), depths=list(depths), tasks=list(tasks))
  dense_reader = Reader(dense_model)
  readers_of = dict(ring=Reader(ring_model), local=dense_reader, last4k=dense_reader, dense=dense_reader)
  groups = [[d] for d in depths] if one_per_document else [list(depths)]
  documents = {
    (task, length): [make_document(tokenizer, task, length - ROOM, g, seed) for g in groups]
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


def dense_memory(report: dict, dense_model, room: int = ROOM) -> dict:
  """Per-device compiled temp MiB of dense attention's prefill at each length of the
  report: the dense run's where it ran, else compiled (not run), which says what dense
  would need where it does not fit."""
  ran = {r["length"]: r["temp_mib"] for r in report["runs"] if r["reader"] == "dense"}
  reader = Reader(dense_model)
  compiled = lambda t: round(reader.prefill_temp(t - room, t) / 2**20, 1)
  return {int(t): ran[t] if t in ran else compiled(t) for t in report["lengths"]}


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
      ax = axes[i, j]
      grid = np.full((len(lengths), len(depths)), np.nan)
      for a in report["answers"]:
        if a["reader"] == reader and a["task"] == task:
          column = int(np.argmin(np.abs(np.asarray(depths) - a["depth"])))
          grid[lengths.index(a["length"]), column] = a["right"]
      ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
      ax.set_xticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
      ax.set_yticks(range(len(lengths)), [f"{t // 1024}K" if t >= 1024 else str(t) for t in lengths])
      ax.set(title=f"{reader}: {task}", xlabel="needle depth")
      for (y, x), v in np.ndenumerate(grid):
        if not np.isnan(v):
          ax.text(x, y, "right" if v else "wrong", ha="center", va="center", fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
