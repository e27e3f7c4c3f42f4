"""Hugging Face folders: config.json (as transformers 4.x and 5.x write it) and
safetensors files (one, or shards with their index), read lazily and written in
shards.

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

from jax_ring import nn as ring_nn

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


# Keys of config.json that describe the file or the run, not the computation.
HARMLESS = {
  "_name_or_path",
  "architectures",
  "model_type",
  "torch_dtype",
  "dtype",
  "transformers_version",
  "bos_token_id",
  "eos_token_id",
  "pad_token_id",
  "initializer_range",
  "use_cache",
  "cache_implementation",
  "tie_word_embeddings",
  "max_position_embeddings",
  "vocab_size",
  "output_attentions",
  "output_hidden_states",
  "return_dict",
  "is_encoder_decoder",
  "id2label",
  "label2id",
  "tokenizer_class",
  "unsloth_fixed",
  "final_logit_softcapping",
  "attn_logit_softcapping",
}


class ConfigReader:
  """A config.json's keys for an architecture's config builder: `int`, `get`,
  `expect` (a key that must be absent or hold a value), `rope` (rotary base and
  scaling, from transformers 4.x's `rope_theta`/`rope_scaling` or 5.x's
  `rope_parameters`). `check_all_read` refuses any key the builder never read and that
  is not known to leave the computation alone, naming it."""

  def __init__(self, values: dict, where: str, defaults=None):
    self.values, self.where, self.defaults = values, where, dict(defaults or {})
    self.read = set(HARMLESS)

  def get(self, key, default=None):
    self.read.add(key)
    if key in self.values:
      return self.values[key]
    return self.defaults.get(key, default)

  def int(self, key) -> int:
    value = self.get(key)
    if value is None:
      raise ValueError(f"{self.where}: {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{self.where}: {key}={value!r} must be an int")
    return value

  def expect(self, key, value, also=()) -> None:
    for k in (key, *also):
      got = self.get(k, value)
      if got != value:
        raise ValueError(
          f"{self.where}: {k}={got!r} changes the computation and this loader does not apply it "
          f"(expected {value!r})"
        )

  def rope(self, layer_type=None, default_theta=None):
    """(rope base, `RopeScaling` or None) of the layers of `layer_type` ("full_attention",
    "sliding_attention"; None: all layers)."""
    params = self.get("rope_parameters")
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
      self.read.add(key)
    if isinstance(params, dict):
      if layer_type is not None and layer_type in params:
        params = params[layer_type]
      theta = params.get("rope_theta", default_theta if layer_type == "sliding_attention" else None)
      scaling = params
    else:
      if layer_type == "sliding_attention":
        return float(default_theta), None
      theta, scaling = (
        self.values.get("rope_theta", self.defaults.get("rope_theta")),
        self.values.get("rope_scaling"),
      )
    if theta is None:
      raise ValueError(
        f"{self.where}: no rope_theta (nor rope_parameters) for the {layer_type or 'model'}'s layers"
      )
    return float(theta), rope_scaling(scaling, self.where)

  def check_all_read(self) -> None:
    for key, value in self.values.items():
      if key not in self.read:
        raise ValueError(
          f"{self.where}: {key}={value!r} is a key this loader does not apply; it may change the "
          "computation, so the checkpoint is refused"
        )


def rope_scaling(values, where: str):
  """A `jax_ring.nn.RopeScaling` from a rope_scaling / rope_parameters dict (None: none)."""
  if values is None:
    return None
  kind = values.get("rope_type", values.get("type", "default"))
  match kind:
    case "default":
      return None
    case "linear":
      return ring_nn.RopeScaling("linear", factor=float(values["factor"]))
    case "llama3":
      return ring_nn.RopeScaling(
        "llama3",
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_max_position_embeddings"]),
      )
  raise ValueError(
    f"{where}: rope scaling rope_type={kind!r} is not supported (supported: 'default', 'linear', 'llama3')"
  )


def rope_scaling_json(scaling) -> dict | None:
  """The config.json form of a RopeScaling (transformers 4.x's `rope_scaling`)."""
  match None if scaling is None else scaling.kind:
    case None:
      return None
    case "linear":
      return {"rope_type": "linear", "factor": scaling.factor}
    case "llama3":
      return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
      }
  raise ValueError(f"rope_scaling={scaling!r} has no config.json form (a GGUF file's per-frequency factors)")
