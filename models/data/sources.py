"""A user's data files read into checked records: JSON Lines (one object a line), JSON (a
list of objects), Parquet (one object a row), plain text (a file one document) and
folders of them, or a folder written by Hugging Face datasets' `save_to_disk` (with the
`[datasets]` extra).

The format comes from the columns, as TRL names its dataset formats:

    text        {"text": str}: language modelling, the loss on every token
    completion  {"prompt": str, "completion": str}: the loss on the completion
    chat        {"messages": [{"role", "content"}, ...]}: the loss on the assistant's turns
    preference  {"prompt", "chosen", "rejected"}: strings, or a prompt's messages and
                the chosen and rejected assistant messages (preference tuning)
    implicit_preference  {"chosen", "rejected"}: whole texts or conversations, the
                prompt their common start (TRL's `extract_prompt`)

`columns` renames a file's columns to these (`{"prompt": "question"}`). A bad record is
a `BadRecord` naming the file, its line (row or item) and what is wrong; with
`skip_bad` it is counted and left out instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

FORMATS = {
  "text": ("text",),
  "completion": ("prompt", "completion"),
  "chat": ("messages",),
  "preference": ("prompt", "chosen", "rejected"),
  "implicit_preference": ("chosen", "rejected"),
}
PREFERENCE = ("preference", "implicit_preference")
SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
ROLES = ("system", "user", "assistant", "tool")


class BadRecord(ValueError):
  """A record of a data file that cannot be used: where it is and why, in one line."""

  def __init__(self, where: str, why: str):
    super().__init__(f"{where}: {why}")
    self.where, self.why = where, why


@dataclasses.dataclass(frozen=True)
class Records:
  """Checked records in one format: `items` (dicts with the format's columns), `where`
  (each one's "file:line", "file:row N", "file:item N" or "file"), the files read,
  the bad records skipped (their messages) and each item's place among all records.
  Lines, items and rows count from 1, as an editor numbers a file's lines."""

  format: str
  items: list
  where: list
  files: list
  skipped: list
  ordinals: list = dataclasses.field(default_factory=list)  # each item's place among all records


def data_files(path) -> list[Path]:
  """The data files at `path`: the file itself, or a folder's files with a supported
  suffix (below it too), sorted by path."""
  path = Path(path)
  if path.is_file():
    if path.suffix not in SUFFIXES:
      raise ValueError(f"{str(path)!r}: a data file ends in one of {SUFFIXES}")
    return [path]
  if not path.is_dir():
    raise ValueError(f"{str(path)!r}: no such file or folder")
  files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and not _hidden(p, path))
  if not files:
    raise ValueError(f"{str(path)!r}: a folder with no data files (none ends in one of {SUFFIXES})")
  return files


def _hidden(p: Path, root: Path) -> bool:
  return any(part.startswith(".") for part in p.relative_to(root).parts)


def is_saved_dataset(path) -> bool:
  """A folder `datasets.Dataset.save_to_disk` wrote (its state.json and dataset_info.json)."""
  path = Path(path)
  return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def raw_records(path):
  """(where, value) of every record at `path`, in order; a record that is not an
  object (a line that is not JSON, say) is a BadRecord."""
  for where, value in lazy_records(path):
    yield where, value()


def lazy_records(path):
  """(where, thunk) of every record at `path`, in order: the thunk parses the record
  (a JSON Lines record is parsed only when asked for), returning a BadRecord where it
  cannot."""
  if is_saved_dataset(path):
    try:
      import datasets
    except ImportError as e:
      raise ValueError(
        f"{str(path)!r} was written by datasets' save_to_disk: reading it needs the datasets package "
        '(pip install -e ".[datasets]")'
      ) from e
    table = datasets.load_from_disk(str(path))
    if isinstance(table, datasets.DatasetDict):
      raise ValueError(f"{str(path)!r} holds splits {sorted(table)}: pass one split's folder")
    for i in range(len(table)):
      yield f"{path}:row {i + 1}", lambda i=i: table[i]
    return
  for file in data_files(path):
    match file.suffix:
      case ".jsonl":
        with open(file, "rb") as f:
          for n, raw in enumerate(f, start=1):
            line = _decoded(f"{file}:{n}", raw)
            if isinstance(line, str) and not line.strip():
              continue
            yield f"{file}:{n}", lambda line=line, at=f"{file}:{n}": _json_line(at, line)
      case ".json":
        try:
          items = json.loads(_text_of(file))
        except json.JSONDecodeError as e:
          raise BadRecord(f"{file}:{e.lineno}", f"not JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(items, list):
          raise BadRecord(
            str(file), f"a .json data file holds a list of records, not a {type(items).__name__}"
          )
        for i, item in enumerate(items):
          yield f"{file}:item {i + 1}", lambda item=item: item
      case ".parquet":
        import pyarrow.parquet as pq

        for i, item in enumerate(pq.read_table(file).to_pylist()):
          yield f"{file}:row {i + 1}", lambda item=item: item
      case ".txt":
        yield str(file), lambda file=file: {"text": _text_of(file)}


def _json_line(at, line):
  if isinstance(line, BadRecord):
    return line
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    return BadRecord(at, f"not JSON: {e.msg} (column {e.colno})")


def _decoded(at, raw: bytes):
  """A line's text, or a BadRecord naming the first byte that is not UTF-8 (the
  record's own: the others are still read)."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return BadRecord(at, f"not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}")


def _text_of(file: Path) -> str:
  """A whole file's text; a BadRecord naming the line and column of its first byte
  that is not UTF-8."""
  raw = file.read_bytes()
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    raise BadRecord(f"{file}:{line}", f"not UTF-8: byte 0x{raw[e.start]:02x} at column {column}") from None


def read(
  path, *, format: str | None = None, columns: dict | None = None, skip_bad: bool = False, share=(0, 1)
) -> Records:
  """Every record at `path` (`raw_records`), renamed by `columns` ({format's name: the
  file's}) and checked against `format` (None: the first record's columns decide).
  Raises the first BadRecord, or with `skip_bad` leaves bad records out (`skipped`).
  `share=(i, n)`: only records i, i + n, i + 2n, ... are parsed and checked (one
  process's share of n; a JSON Lines file's other lines are only counted)."""
  index, count = share
  if format is not None and format not in FORMATS:
    raise ValueError(f"format={format!r}: expected one of {tuple(FORMATS)}")
  columns = dict(columns or {})
  for name in columns:
    if name not in {c for names in FORMATS.values() for c in names}:
      raise ValueError(f"columns: {name!r} is not a column of any format ({FORMATS})")
  items, where, skipped = [], [], []
  files = [str(path)] if is_saved_dataset(path) else [str(f) for f in data_files(path)]
  ordinals = []
  for k, (at, parse) in enumerate(lazy_records(path)):
    if k % count != index and not (k == 0 and format is None):
      continue
    try:
      record = parse()
      if isinstance(record, BadRecord):
        raise record
      record = _renamed(at, record, columns)
      if format is None:
        format = _detect(at, record)
      if k % count != index:
        continue  # record 0, read by every process for the format
      items.append(check(at, record, format))
      where.append(at)
      ordinals.append(k)
    except BadRecord as e:
      if not skip_bad:
        raise
      skipped.append(str(e))
  if not items and count == 1:
    raise ValueError(
      f"{str(path)!r}: no usable records" + (f" ({len(skipped)} bad ones skipped)" if skipped else "")
    )
  return Records(format, items, where, files, skipped, ordinals)


def _renamed(at, record, columns):
  if not isinstance(record, dict):
    raise BadRecord(at, f"a record is an object of columns, not a {type(record).__name__}")
  out = dict(record)
  for name, source in columns.items():
    if source in record:
      out[name] = record[source]
  return out


def _detect(at, record) -> str:
  for name in ("preference", "implicit_preference", "chat", "completion", "text"):
    if all(c in record for c in FORMATS[name]):
      return name
  raise BadRecord(
    at,
    f"columns {sorted(record)} match no format: 'text'; 'prompt' and 'completion'; or 'messages' "
    "(--format and --columns name them)",
  )


def check(at, record, format) -> dict:
  """The record's columns of `format`, checked; BadRecord naming what is wrong."""
  missing = [c for c in FORMATS[format] if c not in record]
  if missing:
    raise BadRecord(
      at, f"no {', '.join(map(repr, missing))} column for the {format} format (it has {sorted(record)})"
    )
  if format in PREFERENCE:
    return _check_pair(at, record, format)
  if format == "chat":
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
      raise BadRecord(
        at, f"'messages' must be a non-empty list of {{'role', 'content'}} objects, not {messages!r:.60}"
      )
    _check_messages(at, "messages", messages)
    if not any(m["role"] == "assistant" for m in messages):
      raise BadRecord(at, "no assistant message: nothing to learn")
    return {"messages": messages}
  out = {}
  for c in FORMATS[format]:
    if not isinstance(record[c], str):
      raise BadRecord(at, f"{c!r} must be a string, not {type(record[c]).__name__}")
    out[c] = record[c]
  if not out[FORMATS[format][-1]].strip():
    raise BadRecord(at, f"{FORMATS[format][-1]!r} is empty: nothing to learn")
  return out


def _check_messages(at, column, messages) -> None:
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
      raise BadRecord(at, f"{column}[{i}] must be an object with a 'role' string and a 'content'")
    if m["role"] not in ROLES:
      raise BadRecord(at, f"{column}[{i}] has role {m['role']!r}; expected one of {ROLES}")
    if not isinstance(m["content"], str) and m["content"] is not None:
      raise BadRecord(at, f"{column}[{i}]'s content must be a string, not {type(m['content']).__name__}")


def _check_pair(at, record, format) -> dict:
  """A preference record's columns: all strings (standard) or all lists of messages
  (conversational). With an explicit prompt, the chosen and rejected messages are the
  assistant's alone; with an implicit one (`extract_prompt`), the completions after
  the common start are. Each completion must hold something to learn."""
  columns = FORMATS[format]
  kinds = {c: isinstance(record[c], str) for c in columns}
  for c in columns:
    if not isinstance(record[c], (str, list)):
      raise BadRecord(at, f"{c!r} must be a string or a list of messages, not {type(record[c]).__name__}")
    if isinstance(record[c], list):
      _check_messages(at, c, record[c])
  if len(set(kinds.values())) > 1:
    raise BadRecord(
      at, f"{', '.join(map(repr, columns))} must be all strings or all lists of messages, not a mix"
    )
  out = {c: record[c] for c in columns}
  if format == "implicit_preference":
    out = extract_prompt(at, out)
  conversational = not kinds["chosen"]
  for c in ("chosen", "rejected"):
    value = out[c]
    if conversational:
      roles = [m["role"] for m in value]
      if not value or any(r != "assistant" for r in roles):
        raise BadRecord(at, f"{c!r} must be the assistant's messages only (roles {roles})")
      if not any(isinstance(m["content"], str) and m["content"].strip() for m in value):
        raise BadRecord(at, f"{c!r} is empty: nothing to learn")
    elif not value.strip():
      raise BadRecord(at, f"{c!r} is empty: nothing to learn")
  return out


def extract_prompt(at, record) -> dict:
  """{"prompt", "chosen", "rejected"} from an implicit-prompt record, as TRL's
  `data_utils.extract_prompt` takes it: the prompt is the common start of "chosen" and
  "rejected" (characters of two texts, messages of two conversations), less a space it
  ends in (which goes to the completions)."""
  chosen, rejected = record["chosen"], record["rejected"]
  n = min(len(chosen), len(rejected))
  if n == 0:
    raise BadRecord(at, "'chosen' or 'rejected' is empty: nothing to learn")
  for idx in range(n):  # TRL's loop: with no difference, idx stays at the last index
    if chosen[idx] != rejected[idx]:
      if chosen[idx - 1] == " ":
        idx -= 1
      break
  return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def fingerprint(files) -> str:
  """A hash of the files' names, sizes and contents (the tokenization cache's key)."""
  import hashlib

  h = hashlib.sha256()
  for name in files:
    for file in (
      [Path(name)] if Path(name).is_file() else sorted(p for p in Path(name).rglob("*") if p.is_file())
    ):
      h.update(f"{os.path.basename(file)}:{file.stat().st_size}:".encode())
      with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          h.update(block)
  return h.hexdigest()[:20]
