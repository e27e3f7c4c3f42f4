"""Reading GGUF files (llama.cpp's format): metadata, tensors dequantized to float32
NumPy arrays one at a time (cached on disk, keyed by the file's hash), and the tokenizer
they carry.

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes its block
formats; `sentencepiece` runs a SentencePiece vocabulary rebuilt from the file's, and
Hugging Face's `tokenizers` a byte-level BPE one. They come with the `[models]` extra.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from jax_ring import nn as ring_nn

from . import tokenizer_json as tokenizers_io

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
      'reading GGUF files needs the gguf package: pip install -e ".[models]" in the checkout'
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
        raise ValueError(
          f"path={str(self.path)!r} is truncated or malformed: the GGUF reader could not parse it "
          f"({type(e).__name__}: {e})"
        ) from e
      size = self.path.stat().st_size
      for t in self._reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
          raise ValueError(
            f"path={str(self.path)!r} is truncated: tensor {t.name!r} ends at byte {end}, the file has {size}"
          )
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

  @property
  def vocab_size(self) -> int:
    return len(self.field("tokenizer.ggml.tokens", []))

  def arch_reader(self, arch: str) -> ArchReader:
    """The `{arch}.` metadata keys, read by a config builder that must use or refuse each."""
    return ArchReader(self, arch)

  def tensor(self, name: str) -> np.ndarray:
    """One tensor as float32, shaped as NumPy reads GGUF (a [640, 1024] GGUF tensor is a
    (1024, 640) array: output features by input features). Dequantized on first use and
    kept in the file's cache folder, then read from there memory-mapped: a load holds
    one dequantized tensor at a time in host memory."""
    if name not in self.tensor_types:
      raise KeyError(name)
    cached = self.folder / f"{list(self.tensor_types).index(name)}.npy"
    if cached.is_file():
      return np.load(cached, mmap_mode="r")
    gguf = _import_gguf()
    t = self._tensor_info()[name]
    array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      tmp = cached.with_name(cached.stem + ".tmp.npy")
      np.save(tmp, array)
      tmp.replace(cached)
    except OSError:  # a read-only home: run without the cache
      return array
    del array
    return np.load(cached, mmap_mode="r")

  def _tensor_info(self):
    if not hasattr(self, "_info"):
      self._info = {t.name: t for t in self.reader.tensors}
    return self._info

  def tensors(self) -> dict[str, np.ndarray]:
    """Every tensor (`tensor`), read lazily: name -> float32 array."""
    self.check_types()
    return LazyTensors(self)


class LazyTensors(dict):
  """name -> tensor of a GGUF file, each dequantized (or read from the cache) when
  first looked up."""

  def __init__(self, file: GGUFFile):
    super().__init__()
    self._file = file

  def __contains__(self, name):
    return name in self._file.tensor_types

  def __missing__(self, name):
    return self._file.tensor(name)

  def __iter__(self):
    return iter(self._file.tensor_types)

  def __len__(self):
    return len(self._file.tensor_types)

  def keys(self):
    return self._file.tensor_types.keys()


class ArchReader:
  """An architecture's metadata keys (`{arch}.key`) for a config builder: `int`, `get`,
  `expect` (a key that must be absent or hold one value) and `rope_scaling`; `check_all_read`
  refuses any `{arch}.` key the builder never read, naming it, so that no key that changes
  the computation is ignored."""

  # Keys that describe the file, not the computation.
  HARMLESS = ("context_length", "vocab_size")

  def __init__(self, file: GGUFFile, arch: str):
    self.file, self.arch, self.read = file, arch, set(self.HARMLESS)

  def _key(self, key):
    self.read.add(key)
    return f"{self.arch}.{key}"

  def get(self, key, default=None):
    return self.file.field(self._key(key), default)

  def int(self, key) -> int:
    value = self.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
      raise ValueError(f"{self.arch}.{key}={value!r} of {str(self.file.path)!r}: expected an int")
    return int(value)

  def expect(self, key, value) -> None:
    got = self.get(key, value)
    if got != value:
      raise ValueError(
        f"{self.arch}.{key}={got!r} of {str(self.file.path)!r} changes the computation and this loader "
        f"does not apply it (expected {value!r})"
      )

  def rope_scaling(self):
    """A `RopeScaling` from `rope.scaling.type`/`factor` (llama.cpp writes "linear"; Llama
    3.1's rule comes as the `rope_freqs.weight` tensor, which the loader reads)."""
    kind = self.get("rope.scaling.type", "none")
    factor = self.get("rope.scaling.factor", 1.0)
    self._key("rope.scaling.original_context_length")
    if kind in ("none", None) or (kind == "linear" and factor == 1.0):
      return None
    if kind == "linear":
      return ring_nn.RopeScaling("linear", factor=float(factor))
    raise ValueError(
      f"{self.arch}.rope.scaling.type={kind!r} of {str(self.file.path)!r} is not supported (linear only)"
    )

  def check_all_read(self) -> None:
    prefix = f"{self.arch}."
    for key, value in self.file.metadata.items():
      if key.startswith(prefix) and key[len(prefix) :] not in self.read:
        raise ValueError(
          f"{key}={value!r} of {str(self.file.path)!r} is a key this loader does not apply; it may change "
          "the computation, so the file is refused"
        )


class Tokenizer:
  """The file's own vocabulary as a SentencePiece BPE model (identity normalization,
  spaces as "▁", byte fallback, no space prefix), as llama.cpp's "llama" tokenizer
  (`tokenizer.ggml.model`) runs it.

  encode(text) -> list[int] (no BOS); decode(ids) -> str; bos_id, eos_id, pad_id;
  add_bos (the model reads BOS first) and prefix() ([bos_id] or []); pieces: the
  vocabulary's strings."""

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
      raise ImportError(
        'the GGUF tokenizer needs sentencepiece: pip install -e ".[models]" in the checkout'
      ) from e
    self.pieces = list(gguf_file.field("tokenizer.ggml.tokens"))
    scores = gguf_file.field("tokenizer.ggml.scores")
    types = gguf_file.field("tokenizer.ggml.token_type")
    self.bos_id = int(gguf_file.field("tokenizer.ggml.bos_token_id", 1))
    self.eos_id = int(gguf_file.field("tokenizer.ggml.eos_token_id", 2))
    self.pad_id = int(gguf_file.field("tokenizer.ggml.padding_token_id", 0))
    # llama.cpp's default for a SentencePiece vocabulary: BOS before every text.
    self.add_bos = bool(gguf_file.field("tokenizer.ggml.add_bos_token", True))
    self.chat_template = gguf_file.field("tokenizer.chat_template")  # None where the file has none
    unk_id = int(gguf_file.field("tokenizer.ggml.unknown_token_id", 0))
    proto = sp_pb2.ModelProto()
    self.scores, self.types, self.unk_id = list(scores), list(types), unk_id
    self.add_space_prefix = bool(gguf_file.field("tokenizer.ggml.add_space_prefix", False))
    for piece, score, kind in zip(self.pieces, scores, types):
      p = proto.pieces.add()
      # A user-defined piece is matched in the text after its spaces became "▁": Gemma's
      # GGUF spells its space runs (id 138: two spaces) with real spaces, which would
      # never match; llama.cpp and transformers give them as whole tokens.
      p.piece = piece.replace(" ", "\u2581") if kind == tokenizers_io.USER_DEFINED else piece
      p.score, p.type = float(score), int(kind)
    spec = proto.trainer_spec
    spec.model_type = sp_pb2.TrainerSpec.BPE
    spec.vocab_size = len(self.pieces)
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk_id, self.bos_id, self.eos_id, self.pad_id
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = self.add_space_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

  @property
  def vocab_size(self) -> int:
    return len(self.pieces)

  def prefix(self) -> list[int]:
    """[bos_id] where the model reads BOS before a text (`add_bos`), else []."""
    return [self.bos_id] if self.add_bos else []

  def encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"text of type {type(text).__name__} must be a str")
    return list(self._sp.encode(text))

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

  @property
  def special_ids(self) -> dict[str, int]:
    """Control tokens (<bos>, <start_of_turn>, ...) by their text."""
    return {p: i for i, (p, t) in enumerate(zip(self.pieces, self.types)) if t == tokenizers_io.CONTROL}

  def to_tokenizers(self):
    """This vocabulary as a `tokenizers.Tokenizer` (`tokenizer.sentencepiece_to_tokenizers`)."""
    if getattr(self, "_hf", None) is None:
      self._hf = tokenizers_io.sentencepiece_to_tokenizers(
        self.pieces, self.scores, self.types, unk_id=self.unk_id, add_space_prefix=self.add_space_prefix
      )
    return self._hf


def tokenizer(gguf_file: GGUFFile):
  """The tokenizer a GGUF file carries: SentencePiece ("llama") or byte-level BPE ("gpt2")."""
  match gguf_file.field("tokenizer.ggml.model"):
    case "llama":
      return Tokenizer(gguf_file)
    case "gpt2":
      return tokenizers_io.HFTokenizer.from_gguf(gguf_file)
    case model:
      raise ValueError(
        f"tokenizer.ggml.model={model!r} of {str(gguf_file.path)!r} is not supported; supported: "
        "'llama' (SentencePiece), 'gpt2' (byte-level BPE)"
      )
