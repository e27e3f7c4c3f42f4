"""From a user's files to the training step's batches: records (`sources.read`) tokenized
in their format (documents, completions, chats through the model's template), the
tokenization cached on disk keyed by the files' contents and the tokenizer, the
examples packed into rows (`packing.plan`), and grain's loader over the rows: shuffled
by a seed anew each epoch, batched, and resumable exactly from its state (`Loader`).

Legend: B batch, T row length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from . import chat, packing, preference, sources

CACHE_VERSION = 2  # part of the cache key: a change to how records become tokens bumps it


@dataclasses.dataclass(frozen=True)
class Examples:
  """Tokenized examples: ids and loss weights (1 on the tokens to learn) of each, where
  each came from, the format, the bad records skipped, and whether the cache had them."""

  ids: list
  masks: list
  where: list
  format: str
  skipped: list
  cached: bool = False
  tokenized: int = 0  # the records this process tokenized (its share; 0 from the cache)
  docs: list | None = None  # each example's documents' lengths (a preference pair's two); None: one each

  def __len__(self):
    return len(self.ids)

  def pairs(self):
    return list(zip(self.ids, self.masks))


def tokenize_record(tokenizer, record: dict, format: str, template: str | None):
  """(ids int32, mask float32) of one record: a document (the tokenizer's prefix, the
  text, EOS; every token learned), a completion (prefix and prompt, then the
  completion and EOS, which alone are learned) or a chat (`chat.tokenize_chat`: the
  assistant's tokens learned). A preference pair is two documents:
  `preference.tokenize_pair`."""
  eos = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
  match format:
    case "text":
      ids = list(tokenizer.prefix()) + tokenizer.encode(record["text"]) + eos
      mask = [1.0] * len(ids)
    case "completion":
      prompt = list(tokenizer.prefix()) + tokenizer.encode(record["prompt"])
      answer = tokenizer.encode(record["completion"]) + eos
      ids, mask = prompt + answer, [0.0] * len(prompt) + [1.0] * len(answer)
    case "chat":
      ids, mask = chat.tokenize_chat(tokenizer, record["messages"], chat_template=template)
    case _:
      raise ValueError(f"format={format!r}: expected one of {tuple(sources.FORMATS)}")
  return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


def _tokenizer_key(tokenizer) -> str:
  """The vocabulary and what the tokenizer adds beside it: two folders with one
  tokenizer.json but another BOS, EOS or padding token make other tokens."""
  specials = [getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id", "add_bos")]
  text = tokenizer.to_tokenizers().to_str() + json.dumps(specials)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_examples(
  path,
  tokenizer,
  *,
  format: str | None = None,
  columns: dict | None = None,
  skip_bad: bool = False,
  chat_template: str | None = None,
  cache_dir=None,
  processes=None,
) -> Examples:
  """The examples of the data at `path`, tokenized (`tokenize_record`), from the cache
  under `cache_dir` where an earlier call made them from the same files (contents),
  tokenizer, format, columns and template; else read, checked and tokenized, then
  cached. `chat_template`: the template's text (default: the tokenizer's). A bad record
  raises `sources.BadRecord` (or is skipped, `skip_bad`) before anything is written.

  `processes=(index, count, barrier)` (several processes, `jax.distributed`): each
  process reads, checks and tokenizes only its share of the records (every count-th),
  writes it to the cache folder (which every process must see), waits at `barrier()`
  for the others', then reads every share: all end with the same examples, in order."""
  files = [str(path)] if sources.is_saved_dataset(path) else [str(f) for f in sources.data_files(path)]
  template = chat_template if chat_template is not None else chat.chat_template(tokenizer)
  key = json.dumps(
    [
      CACHE_VERSION,
      sources.fingerprint(files),
      _tokenizer_key(tokenizer),
      format,
      columns,
      template,
      skip_bad,
    ]
  )
  index, count, barrier = processes or (0, 1, None)
  if count > 1 and cache_dir is None:
    raise ValueError("several processes tokenize their shares through the cache: pass cache_dir")
  file = None
  if cache_dir is not None:
    file = Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
    if file.is_file():
      return _read_cache(file)
  records = sources.read(path, format=format, columns=columns, skip_bad=skip_bad, share=(index, count))
  conversational = records.format in sources.PREFERENCE and any(
    not isinstance(r["chosen"], str) for r in records.items
  )
  if (records.format == "chat" or conversational) and template is None:
    raise ValueError(
      f"{str(path)!r} holds conversations ('messages') and the model's tokenizer has no chat template: "
      "pass one (--chat-template FILE)"
    )
  ids, masks, docs = [], [], []
  for where, record in zip(records.where, records.items):
    try:
      if records.format in sources.PREFERENCE:
        i, m, d = preference.tokenize_pair(tokenizer, record, template)
      else:
        (i, m), d = tokenize_record(tokenizer, record, records.format, template), None
    except Exception as e:  # noqa: BLE001 - a template that raises names the record
      raise sources.BadRecord(where, f"{type(e).__name__}: {e}") from e
    ids.append(i)
    masks.append(m)
    docs.append(d)
  out = Examples(
    ids,
    masks,
    list(records.where),
    records.format,
    list(records.skipped),
    tokenized=len(ids),
    docs=docs if records.format in sources.PREFERENCE else None,
  )
  if count > 1:
    return _gather_shares(file, out, records.ordinals, index, count, barrier)
  if file is not None:
    _write_cache(file, out)
  return out


def _gather_shares(file: Path, mine: Examples, ordinals, index: int, count: int, barrier) -> Examples:
  """Every process's share (written beside `file`), merged in the records' order;
  process 0 then writes the whole cache file and the shares are removed."""
  part = lambda i: file.with_name(f"{file.stem}.share{i}of{count}.npz")
  _write_cache(part(index), mine, ordinals)
  barrier()
  shares = [_read_cache(part(i), with_ordinals=True) for i in range(count)]
  order = sorted((k, i, j) for i, (_, ks) in enumerate(shares) for j, k in enumerate(ks))
  pick = lambda name: [getattr(shares[i][0], name)[j] for _, i, j in order]
  out = Examples(
    pick("ids"),
    pick("masks"),
    pick("where"),
    mine.format,
    [m for share, _ in shares for m in share.skipped],
    tokenized=mine.tokenized,
    docs=pick("docs") if mine.docs is not None else None,
  )
  if not out.ids:
    raise ValueError(f"no usable records ({len(out.skipped)} bad ones skipped)")
  barrier()  # every process has read the shares
  if index == 0:
    _write_cache(file, out)
    for i in range(count):
      part(i).unlink(missing_ok=True)
  return out


def _write_cache(file: Path, ex: Examples, ordinals=None) -> None:
  file.parent.mkdir(parents=True, exist_ok=True)
  lengths = np.asarray([len(i) for i in ex.ids], np.int64)
  meta = json.dumps(
    dict(where=ex.where, format=ex.format, skipped=ex.skipped, ordinals=ordinals, docs=ex.docs)
  )
  part = file.with_suffix(".part.npz")
  np.savez(
    part,
    ids=np.concatenate(ex.ids) if ex.ids else np.zeros(0, np.int32),
    masks=np.concatenate(ex.masks) if ex.masks else np.zeros(0, np.float32),
    lengths=lengths,
    meta=np.frombuffer(meta.encode(), np.uint8),
  )
  os.replace(part, file)  # whole or not at all, whatever stops the run


def _read_cache(file: Path, with_ordinals: bool = False):
  with np.load(file) as z:
    cuts = np.cumsum(z["lengths"])[:-1]
    ids, masks = np.split(z["ids"], cuts), np.split(z["masks"], cuts)
    meta = json.loads(bytes(z["meta"]).decode())
    if not len(z["lengths"]):
      ids, masks = [], []
  out = Examples(
    list(ids), list(masks), meta["where"], meta["format"], meta["skipped"], cached=True, docs=meta.get("docs")
  )
  return (out, meta["ordinals"]) if with_ordinals else out


def split_off(examples: Examples, fraction: float, *, seed: int = 0) -> tuple[Examples, Examples]:
  """(kept, held out): `fraction` of the examples (at least one), chosen by `seed`, held
  out for evaluation."""
  n = len(examples)
  held = max(1, round(n * fraction))
  if held >= n:
    raise ValueError(f"eval fraction {fraction} of {n} examples leaves none to train on")
  order = np.random.default_rng([seed, 7]).permutation(n)
  pick = lambda idx: dataclasses.replace(
    examples,
    ids=[examples.ids[i] for i in idx],
    masks=[examples.masks[i] for i in idx],
    where=[examples.where[i] for i in idx],
    docs=None if examples.docs is None else [examples.docs[i] for i in idx],
  )
  return pick(sorted(order[held:])), pick(sorted(order[:held]))


def batch_arrays(rows) -> dict:
  """The step's arrays [B, T] from packed rows (dicts of `packing.fill`, stacked):
  tokens, targets (each token's next; 0 past the end), weights (the loss weight of
  predicting that target: the next token's loss_mask), segment ids (padding -1, which
  the ring skips) and positions."""
  tokens = np.asarray(rows["tokens"], np.int32)
  b = tokens.shape[0]
  targets = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
  weights = np.concatenate([rows["loss_mask"][:, 1:], np.zeros((b, 1), np.float32)], axis=1)
  segments = np.where(rows["segment_ids"] == 0, -1, rows["segment_ids"]).astype(np.int32)
  out = dict(
    tokens=tokens,
    targets=targets,
    weights=weights.astype(np.float32),
    segment_ids=segments,
    positions=np.asarray(rows["positions"], np.int32),
  )
  if "order" in rows:  # rows reordered (`Loader(row_layout="documents")`): each token with its target
    from jax_ring import layouts

    order = np.asarray(rows["order"], np.int64)
    out = {k: np.take_along_axis(v, order, axis=1) for k, v in out.items()}
    # Ids renumbered in the order they now appear (1, 2, ...), so that they rise along
    # the row as the kernels' tile test by id ranges needs.
    seen = layouts.first_seen(out["segment_ids"])
    out["segment_ids"] = np.where(seen >= 0, seen + 1, -1).astype(np.int32)
  if "reference" in rows:
    out["reference"] = np.asarray(rows["reference"], np.float32)
  return out


def _ids(row) -> np.ndarray:
  """A filled row's segment ids as the ring reads them: padding -1."""
  return np.where(row["segment_ids"] == 0, -1, row["segment_ids"]).astype(np.int32)


class Loader:
  """Batches of packed rows from `examples`: the rows planned once (best-fit decreasing,
  `packing.plan`), visited by grain in an order shuffled by `seed` anew each epoch, `batch`
  rows a step. `next()` gives (arrays, sources): `batch_arrays`' dict and the examples'
  sources ("file:line") in the batch. `state()` / `restore(state)`: grain's iterator
  state (a small JSON-able dict), so that a resumed run continues at exactly the next row.
  `shuffle=False`: the rows in order, once (evaluation). Rows with no token to learn
  (all their loss weights 0) are left out (`idle_rows` counts them).

  `row_layout="documents"` with `shards` (the ring's devices): each row reordered on the
  host so that the zig-zag ring's busiest device computes fewer score tiles
  (`jax_ring.layouts.zigzag_documents`, made from the row's ids each time the row is
  read: the same order every time). The row's "order" (int32 [T], the natural index of
  each slot) is recorded with its other arrays, and `batch_arrays` applies it to every
  [B, T] array after the targets and weights are made, so each token keeps its target,
  weight and rotary position, and a step's losses are the natural rows' (summed in
  another order); the ids are then renumbered in the order they appear
  (`layouts.first_seen`). Not for preference pairs, whose ids carry their pairing.
  `longest_document` is then the widest span of one document along the reordered rows
  (`layouts.spans`), the bound the ring's passes keep."""

  def __init__(
    self,
    examples: Examples,
    length: int,
    batch: int,
    *,
    long="split",
    seed=0,
    pad_id=0,
    shuffle=True,
    truncation="keep_end",
    row_layout="natural",
    shards=1,
  ):
    import grain

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
      raise ValueError(f"batch={batch!r} must be a positive int (rows a step)")
    if row_layout not in ("natural", "documents"):
      raise ValueError(f"row_layout={row_layout!r}: expected 'natural' or 'documents'")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
      raise ValueError(f"shards={shards!r} must be a positive int (the ring's devices)")
    if row_layout == "documents" and length % (2 * shards):
      raise ValueError(
        f"row_layout='documents': length={length} must be a multiple of 2 * shards = {2 * shards} "
        "(the zig-zag ring's chunks)"
      )
    if row_layout == "documents" and examples.docs is not None:
      raise ValueError(
        "row_layout='documents' reorders and renumbers a row's documents, whose ids a preference row "
        "gives meaning (segment k + 1: pair k // 2, chosen when k is even); leave row_layout 'natural'"
      )
    self.row_layout, self.shards = row_layout, shards
    # What makes the rows besides the data (`finetune.data_record`): absent for natural rows.
    self.settings = {} if row_layout == "natural" else dict(row_layout=row_layout, shards=shards)
    self.examples, self.length, self.pad_id, self.batch = examples, length, int(pad_id or 0), batch
    self.packed = examples.pairs()  # (ids, mask) of each example as the rows take it (pairs cut to fit)
    self.docs = examples.docs
    self.reference = None  # per example, its documents' reference log-probabilities (`set_reference`)
    lengths = [len(i) for i in examples.ids]
    unlearned = []
    if self.docs is not None:  # examples of several documents (pairs): whole in a row, or cut to fit
      if long == "split":
        raise ValueError(
          "long='split': a preference pair is never split over rows; 'truncate' it (its sequences cut "
          "as TRL's truncation_mode cuts them) or 'drop' it"
        )
      if long == "truncate":
        self.packed, self.docs = list(self.packed), list(self.docs)
        for i, (n, d) in enumerate(zip(lengths, self.docs)):
          if n > length:
            ids, mask, d = preference.truncate_pair(*self.packed[i], d, length, truncation)
            self.packed[i], self.docs[i], lengths[i] = (ids, mask), d, len(ids)
            if not preference.learns(mask, d):  # keep_start cut a completion whole
              unlearned.append(i)
              lengths[i] = 0
    rows, self.dropped = packing.plan(lengths, length, long=long)
    self.dropped = sorted(set(self.dropped) | set(unlearned))
    # A row with nothing to learn (a piece of a long prompt, say) would cost a step for
    # no gradient: left out, and counted.
    learns = lambda row: any(self.packed[p.example][1][p.start + 1 : p.stop].any() for p in row)
    self.rows = [row for row in rows if learns(row)]
    # The most documents a row holds (a batch's reference log-probabilities: one a document).
    count = lambda p: 1 if self.docs is None else len(self.docs[p.example])
    self.slots = max((sum(count(p) for p in row) for row in self.rows), default=1)
    self.idle_rows = len(rows) - len(self.rows)
    # The longest document a row holds (a piece of a split example, or one sequence of
    # a pair): the ring's passes are bounded by it (`jax_ring.nn.set_document_bound`).
    sizes = lambda p: (
      [p.stop - p.start] if self.docs is None or self.docs[p.example] is None else self.docs[p.example]
    )
    self.longest_document = max((int(n) for row in self.rows for p in row for n in sizes(p)), default=0)
    if not self.rows:
      raise ValueError(f"no rows: all {len(examples)} examples were dropped (long={long!r}, length={length})")
    if row_layout == "documents":  # each row's order made once here, for the bound
      from jax_ring import layouts

      def span(i):
        row = self._fill(i)
        return layouts.spans(_ids(row)[self._order(row)])

      self.longest_document = max(span(i) for i in range(len(self.rows)))
    ds = grain.MapDataset.range(len(self.rows))
    if shuffle:
      # Epochs enough for any run (grain's endless repeat overflows its length when batched by 1).
      ds = ds.shuffle(seed=seed).repeat(max(1, 2**40 // len(self.rows)))
    self.dataset = ds.map(self._row).batch(batch, drop_remainder=False)
    self._iter = iter(self.dataset)

  def _fill(self, i):
    return packing.fill(self.rows[i], self.packed, self.length, pad_id=self.pad_id, docs=self.docs)

  def _order(self, row) -> np.ndarray:
    from jax_ring import layouts

    return layouts.zigzag_documents(_ids(row), self.shards)

  def _row(self, i):
    row = self._fill(i)
    if self.row_layout == "documents":
      row["order"] = self._order(row)
    row = dict(row, row=np.int64(i))
    if self.reference is not None:  # each document's reference log-probability, in its segment's slot
      values = [v for p in self.rows[i] for v in self.reference[p.example]]
      row["reference"] = np.asarray(values + [0.0] * (self.slots - len(values)), np.float32)
    return row

  def set_reference(self, values) -> None:
    """Each example's documents' reference log-probabilities (a list an example, as
    `docs`), given to each batch as "reference" [B, slots] (slot k: segment k + 1)."""
    self.reference = [list(map(float, v)) for v in values]
    self.rewind()

  def summary(self) -> dict:
    """The rows' statistics for a run's report."""
    return dict(
      examples=len(self.examples),
      rows=len(self.rows),
      padding=round(self.padding, 6),
      dropped_examples=len(self.dropped),
      rows_without_loss=self.idle_rows,
      skipped_records=len(self.examples.skipped),
      format=self.examples.format,
    )

  @property
  def padding(self) -> float:
    """The fraction of all rows' tokens that are padding."""
    used = sum(p.stop - p.start for r in self.rows for p in r)
    return 1.0 - used / (len(self.rows) * self.length)

  def __iter__(self):
    return self

  def __next__(self):
    rows = next(self._iter)
    where = [self.examples.where[p.example] for i in rows["row"] for p in self.rows[int(i)]]
    return batch_arrays(rows), where

  def rewind(self) -> None:
    """Back to the first batch (an evaluation loader, read whole each time)."""
    self._iter = iter(self.dataset)

  def in_order(self):
    """Every row once, in order, `batch` at a time (the same batches whatever the seed):
    (arrays, the rows' indices) each."""
    rows = [self._row(i) for i in range(len(self.rows))]
    for at in range(0, len(rows), self.batch):
      part = rows[at : at + self.batch]
      stacked = {k: np.stack([r[k] for r in part]) for k in part[0]}
      yield batch_arrays(stacked), [int(i) for i in stacked["row"]]

  def state(self) -> dict:
    return self._iter.get_state()

  def restore(self, state: dict) -> None:
    self._iter.set_state(state)
