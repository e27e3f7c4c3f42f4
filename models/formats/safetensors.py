"""safetensors files as Hugging Face folders hold them (one, or shards with their
index), read lazily and written in shards.

The safetensors format is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the raw bytes; the reader memory-maps the
file and gives each tensor as a NumPy view, so a load touches one tensor's bytes at a
time (and with a sharded placement, each device's slice of it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class SafetensorsFile:
  """One safetensors file: `names`, `shape(name)`, `get(name)` (a memory-mapped NumPy
  array). The header is checked against the file's size: a truncated file is a
  ValueError saying so."""

  def __init__(self, path: Path):
    self.path = path
    size = path.stat().st_size
    with path.open("rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise ValueError(f"{str(path)!r} is truncated: {size} bytes, not even a safetensors header length")
      n = int.from_bytes(head, "little")
      if 8 + n > size:
        raise ValueError(f"{str(path)!r} is truncated: its header needs {8 + n} bytes, the file has {size}")
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a safetensors file: its header is not JSON ({e})") from e
    header.pop("__metadata__", None)
    self._entries = {}
    end = 0
    for name, entry in header.items():
      dtype = DTYPES.get(entry.get("dtype"))
      if dtype is None:
        raise ValueError(
          f"tensor {name!r} of {str(path)!r} has dtype {entry.get('dtype')!r}; supported: {tuple(DTYPES)}"
        )
      shape = tuple(entry["shape"])
      begin, stop = entry["data_offsets"]
      if stop - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"tensor {name!r} of {str(path)!r}: {stop - begin} bytes for shape {shape} {dtype}")
      self._entries[name] = (dtype, shape, begin, stop)
      end = max(end, stop)
    if 8 + n + end > size:
      raise ValueError(
        f"{str(path)!r} is truncated: its header describes {8 + n + end} bytes, the file has {size}"
      )
    self._offset = 8 + n
    self._map = None

  @property
  def names(self):
    return self._entries.keys()

  def shape(self, name):
    return self._entries[name][1]

  def get(self, name) -> np.ndarray:
    dtype, shape, begin, stop = self._entries[name]
    if self._map is None:
      self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
    return self._map[self._offset + begin : self._offset + stop].view(dtype).reshape(shape)


class SafetensorsFolder:
  """The weights of a Hugging Face folder: `model.safetensors`, or the shards that
  `model.safetensors.index.json` names (each checked to exist)."""

  def __init__(self, folder: Path):
    self.folder = folder
    index = folder / INDEX
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{str(index)!r} is not a safetensors index (no 'weight_map'): {e}") from e
      files = {}
      for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
          raise ValueError(f"{str(index)!r} names the shard {shard!r}, which {str(folder)!r} lacks")
        files[shard] = SafetensorsFile(folder / shard)
      self._where = {}
      for name, shard in weight_map.items():
        if name not in files[shard].names:
          raise ValueError(f"{str(index)!r} puts tensor {name!r} in {shard!r}, which does not hold it")
        self._where[name] = files[shard]
    elif (folder / SINGLE).is_file():
      single = SafetensorsFile(folder / SINGLE)
      self._where = dict.fromkeys(single.names, single)
    else:
      pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
      if pickled:
        raise ValueError(
          f"{str(folder)!r} holds {pickled[:3]}: pickled torch weights, which this loader never reads "
          f"(loading them runs code from the file). It reads {SINGLE} or {INDEX}: convert the folder "
          "with transformers (`AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)` "
          "writes safetensors)"
        )
      raise ValueError(f"{str(folder)!r} has neither {SINGLE} nor {INDEX}: no weights to load")

  def __contains__(self, name):
    return name in self._where

  def __iter__(self):
    return iter(self._where)

  def __getitem__(self, name) -> np.ndarray:
    return self._where[name].get(name)


def write_safetensors(path: Path, tensors: dict, metadata=None) -> None:
  """`tensors` (name -> NumPy array) as one safetensors file, written tensor by tensor."""
  header, offset = {}, 0
  for name, array in tensors.items():
    nbytes = array.size * array.dtype.itemsize
    header[name] = dict(
      dtype=CODES[np.dtype(array.dtype)], shape=list(array.shape), data_offsets=[offset, offset + nbytes]
    )
    offset += nbytes
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  tmp = path.with_suffix(".tmp")
  with tmp.open("wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for array in tensors.values():
      f.write(np.ascontiguousarray(array).tobytes())
  os.replace(tmp, path)


def write_shards(folder: Path, tensors: dict, max_shard_bytes: int) -> None:
  """Tensors (name -> (bytes, a function giving the NumPy array)) as `model.safetensors`, or as
  shards of at most `max_shard_bytes` with `model.safetensors.index.json` (a tensor
  larger than that has a shard of its own), as transformers' `save_pretrained` does.
  Each shard's arrays are materialized while it is written, one shard at a time."""
  groups, size, sizes = [[]], 0, {}
  for name, (nbytes, _) in tensors.items():
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += nbytes
    sizes[name] = nbytes
  for old in list(folder.glob("model*.safetensors")) + [folder / INDEX]:
    old.unlink(missing_ok=True)
  if len(groups) == 1:
    write_safetensors(folder / SINGLE, {n: tensors[n][1]() for n in groups[0]})
    return
  weight_map = {}
  for k, names in enumerate(groups):
    shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
    write_safetensors(folder / shard, {n: tensors[n][1]() for n in names})
    weight_map.update(dict.fromkeys(names, shard))
  index = dict(metadata=dict(total_size=sum(sizes.values())), weight_map=weight_map)
  (folder / INDEX).write_text(json.dumps(index, indent=2))
