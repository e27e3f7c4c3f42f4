"""The checkpoints users have: named configs (`config`), random weights (`build`), GGUF
files and Hugging Face folders (`load`, `load_gguf`), and saving in Hugging Face's
layout (`save`). Each family's config class, model class, config readers and tensor
tables come from its `architectures.Architecture` record.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import architectures
from .architectures import decoder
from .formats import config_json as config_io
from .formats import gguf as gguf_io
from .formats import safetensors as safetensors_io
from .formats import tokenizer_json as tokenizer_io

ATTENTION_KINDS = decoder.ATTENTION_KINDS
MAX_SHARD_BYTES = 5 * 10**9


def config(name: str):
  """The frozen config of a published model (values from its released config.json;
  each architecture module names its sources): "gemma-3-270m", "llama-3.1-8b", ..."""
  named = {k: v for arch in architectures.registry() for k, v in arch.configs.items()}
  if name not in named:
    raise ValueError(f"name={name!r} is not a known model; known: {tuple(named)}")
  return named[name]


def _check_options(attention, fsdp, dtype):
  if attention not in ATTENTION_KINDS:
    raise ValueError(f"attention={attention!r} is not one of {ATTENTION_KINDS}")
  if not isinstance(fsdp, bool):
    raise TypeError(f"fsdp={fsdp!r} must be a bool")
  if fsdp and attention == "dense":
    raise ValueError(
      "fsdp=True splits the weights over a mesh's devices; attention='dense' runs on one device"
    )
  return None if dtype is None else decoder.float_dtype(dtype, "dtype").name


def weight_sharding(key: str, shape, cfg, mesh, seq_axis, fsdp: bool):
  """Where a parameter lives: FSDP's split (`decoder.fsdp_spec`), else the embedding
  and an untied head split along the vocabulary over `seq_axis` and the rest replicated."""
  mesh = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  if fsdp:
    return NamedSharding(mesh, decoder.fsdp_spec(shape, mesh, experts=decoder.is_experts(key, shape)))
  spec = P()
  if cfg.vocab_size % mesh.shape[seq_axis] == 0:
    if key == "embed.embedding":
      spec = P(seq_axis, None)
    elif key == "head.kernel":
      spec = P(None, seq_axis)
  return NamedSharding(mesh, spec)


def shardings(model):
  """The `NamedSharding` of each of a model's parameters, as `load` and `build` place
  them (an `nnx.State`; for compiling with abstract weights)."""
  mesh, seq_axis, _ = model.placement
  state = nnx.state(model, nnx.Param)
  if mesh is None:
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
  flat = []
  for path, v in nnx.to_flat_state(state):
    key = ".".join(map(str, path))
    flat.append((path, v.replace(weight_sharding(key, v.shape, model.config, mesh, seq_axis, model.fsdp))))
  return nnx.from_flat_state(flat)


def _default_mesh(mesh, attention, seq_axis):
  if attention != "dense" and mesh is None:
    return jax.make_mesh((jax.device_count(),), (seq_axis,), axis_types=(jax.sharding.AxisType.Auto,))
  return mesh


def build(
  cfg,
  *,
  mesh=None,
  attention: str = "ring",
  seq_axis="seq",
  batch_axis=None,
  fsdp: bool = False,
  remat: str = "none",
  dtype=None,
  param_dtype="float32",
  attention_kernel: str = "auto",
  rngs=None,
):
  """A model of config `cfg` (`config(name)` or an architecture's config) with random
  weights, placed as `load` places them. Under `nnx.eval_shape` it allocates nothing
  (for compiling ahead of time; `shardings(model)` gives where the weights would be).
  `attention`, `mesh`, `seq_axis`, `batch_axis`, `fsdp`, `remat`, `attention_kernel`:
  as in `load`; `dtype` the compute dtype (None: float32), `param_dtype` the weights'."""
  arch = architectures.of_config(cfg)
  dtype = _check_options(attention, fsdp, dtype)
  param_dtype = decoder.float_dtype(param_dtype, "param_dtype").name
  cfg = dataclasses.replace(
    cfg, attention=attention, dtype=dtype, param_dtype=param_dtype, attention_kernel=attention_kernel
  )
  mesh = _default_mesh(mesh, attention, seq_axis)
  model = arch.model_class(
    cfg,
    mesh=mesh,
    seq_axis=seq_axis,
    batch_axis=batch_axis,
    fsdp=fsdp,
    remat=remat,
    rngs=rngs if rngs is not None else nnx.Rngs(0),
  )
  state = nnx.state(model, nnx.Param)
  if (
    mesh is not None
    and attention != "dense"
    and not isinstance(jax.tree.leaves(state)[0], jax.ShapeDtypeStruct)
  ):
    nnx.update(model, jax.device_put(state, shardings(model)))
  return model


def load(
  path,
  *,
  mesh=None,
  attention: str = "ring",
  seq_axis="seq",
  batch_axis=None,
  fsdp: bool = False,
  remat: str = "none",
  dtype=None,
  cache_dir=None,
  attention_kernel: str = "auto",
  adapter=None,
):
  """A pretrained model and its tokenizer: (model, tokenizer).

  Args:
    path: a GGUF file, or a folder in Hugging Face's layout (config.json; model.safetensors
      or shards with model.safetensors.index.json; tokenizer.json where present, else
      the tokenizer is None). Architectures: gemma3 (text; a multimodal folder's text
      model), llama (rope scaling "llama3" included) and qwen3, from either format.
    mesh: a `jax.sharding.Mesh` with axis `seq_axis` (default for "ring" and "local":
      every device on one axis named `seq_axis`).
    attention: "ring" (every layer over the mesh's `seq_axis`), "dense" (one device;
      the reference) or "local" (each shard of the sequence attends within itself).
    batch_axis: a mesh axis the batch is split over (a ("data", "seq") mesh), or None.
    fsdp: every weight split over all the mesh's devices (`decoder.fsdp_spec`), each
      block's gathered where it runs, gradients reduce-scattered; each device reads
      only its own slice of each tensor.
    remat: what each block keeps for the backward pass: "none", "full" (its input),
      "attention" (its input, attention's output and log-sum-exp) or "offload" (its
      input, in host memory).
    dtype: compute and parameter dtype (None: float32).
    cache_dir: where a GGUF file's dequantized tensors are kept (`gguf.cache_root`).
    attention_kernel: the ring's block kernel, `jax_ring.ring_attention`'s `kernel`
      ("auto": cuDNN on NVIDIA GPUs, Pallas on TPUs, the XLA tiles on CPU).
    adapter: a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors;
      written by `models.save_lora` or by peft) applied to the model (`lora.load_adapter`);
      a key that changes the computation and is not supported is refused by name.

  Every config or metadata key that changes the computation is applied or refused with
  a ValueError naming it. Tensors are read one at a time, memory-mapped, straight to
  their devices. On a mesh without FSDP the embedding (and an untied head) is split
  over `seq_axis` along the vocabulary and the other weights are replicated; "dense"
  keeps them on the first device.
  """
  dtype = _check_options(attention, fsdp, dtype)
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path={path!r} must be a str or os.PathLike naming a GGUF file or a folder")
  path = Path(path)
  overrides = dict(
    attention=attention, dtype=dtype, param_dtype=dtype or "float32", attention_kernel=attention_kernel
  )
  if path.is_dir():
    arch, cfg, source, table, tokenizer = _open_folder(path, overrides)
    fused = arch.hf.fused
  else:
    arch, cfg, source, table, tokenizer = _open_gguf(path, overrides, cache_dir)
    fused = arch.gguf.fused
  if fused is not None:
    source = _Split(source, expand_fused(fused(cfg), cfg.num_layers), where=str(path))
  mesh = _default_mesh(mesh, attention, seq_axis)
  placement = dict(mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis, fsdp=fsdp, remat=remat)
  if adapter is not None:
    from . import lora

    lora.read_adapter(adapter)  # refused before the weights are read
  model = _place(arch, cfg, source, table, placement, where=str(path))
  if adapter is not None:
    lora.load_adapter(model, adapter)
  return model, tokenizer


def load_gguf(path, *, mesh=None, attention: str = "ring", seq_axis="seq", dtype=None, cache_dir=None):
  """`load` for a GGUF file (a folder is refused)."""
  if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
    raise ValueError(f"path={str(path)!r} is a folder; load_gguf reads a GGUF file (models.load reads both)")
  return load(path, mesh=mesh, attention=attention, seq_axis=seq_axis, dtype=dtype, cache_dir=cache_dir)


def _open_gguf(path, overrides, cache_dir):
  file = gguf_io.GGUFFile(path, cache_dir)
  arch = file.architecture
  families = [a for a in architectures.registry() if a.gguf is not None]
  supported = tuple(dict.fromkeys(a.gguf.arch for a in families))
  if arch not in supported:
    raise ValueError(
      f"general.architecture={arch!r} of {str(file.path)!r} is not supported; supported: {supported}"
    )
  file.check_types()
  # One family per file: those of its architecture that accept it (Llama, or Mixtral
  # where a "llama" file has experts).
  accepting = [
    a for a in families if a.gguf.arch == arch and (a.gguf.accepts is None or a.gguf.accepts(file))
  ]
  if len(accepting) != 1:
    raise ValueError(
      f"general.architecture={arch!r} of {str(file.path)!r} is read by {len(accepting)} families "
      f"({[a.name for a in accepting]}); expected exactly one"
    )
  arch_record = accepting[0]
  reader_calls = []
  original = file.arch_reader

  def arch_reader(name):  # keep the reader the config builder used, to check every key was read
    reader_calls.append(original(name))
    return reader_calls[-1]

  file.arch_reader = arch_reader
  cfg = arch_record.gguf.read_config(file, **overrides)
  for reader in reader_calls:
    reader.check_all_read()
  return arch_record, cfg, file.tensors(), arch_record.gguf.tensors, gguf_io.tokenizer(file)


def _open_folder(folder: Path, overrides):
  path = folder / "config.json"
  if not path.is_file():
    raise ValueError(f"path={str(folder)!r} is a folder without config.json: not a Hugging Face model folder")
  try:
    values = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{str(path)!r} is not JSON: {e}") from e
  model_type = values.get("model_type")
  modules = {t: a for a in architectures.registry() for t in a.hf.model_types + a.hf.multimodal}
  if model_type not in modules:
    raise ValueError(
      f"model_type={model_type!r} of {str(path)!r} is not supported; supported: {tuple(modules)}"
    )
  arch = modules[model_type]
  table = arch.hf.tensors
  source = safetensors_io.SafetensorsFolder(folder)
  where = str(path)
  if model_type in arch.hf.multimodal:  # a vision-language folder: its text model
    top = config_io.ConfigReader(values, where)
    top.get("text_config")
    for key in (
      "vision_config",
      "mm_tokens_per_image",
      "boi_token_index",
      "eoi_token_index",
      "image_token_index",
    ):
      top.get(key)
    top.get("initializer_range")
    top.check_all_read()
    values, where = values.get("text_config") or {}, f"{where} (text_config)"
    prefix = next((p for p in arch.hf.text_prefixes if p + "embed_tokens.weight" in source), None)
    if prefix is None:
      raise ValueError(f"{str(folder)!r}: no text model's embed_tokens.weight under {arch.hf.text_prefixes}")
    table = {(prefix + k[len("model.") :]): v for k, v in table.items()}
    source = _Only(source, prefix)
  cfg_reader = config_io.ConfigReader(values, where, arch.hf.defaults)
  cfg = arch.hf.read_config(cfg_reader, **overrides)
  cfg_reader.check_all_read()
  tokenizer = tokenizer_io.HFTokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
  return arch, cfg, source, table, tokenizer


class _Only:
  """The tensors of a source whose names start with `prefix` (a multimodal folder's
  text model); the others (vision tower, projector) are not the text model's."""

  def __init__(self, source, prefix):
    self.source, self.prefix = source, prefix

  def __contains__(self, name):
    return name.startswith(self.prefix) and name in self.source

  def __iter__(self):
    return (k for k in self.source if k.startswith(self.prefix))

  def __getitem__(self, name):
    return self.source[name]


class _Split:
  """A source whose fused tensors (`expand_fused`) read as their parts: each part a
  slice of its fused tensor's rows (a view of the memory-mapped file); a fused tensor
  of the wrong row count is a ValueError naming it."""

  def __init__(self, source, fused: dict, where: str):
    self.source, self.where = source, where
    self.parts = {}  # part -> (fused tensor, first row, rows)
    self.rows = {name: sum(rows for _, rows in parts) for name, parts in fused.items()}
    for name, parts in fused.items():
      start = 0
      for part, rows in parts:
        self.parts[part] = (name, start, rows)
        start += rows

  def __contains__(self, name):
    return name in self.parts and self.parts[name][0] in self.source or name in self.source

  def __iter__(self):
    fused = {f for f, _, _ in self.parts.values()}
    yield from (n for n in self.source if n not in fused)
    yield from (p for p, (f, _, _) in self.parts.items() if f in self.source)

  def __getitem__(self, name):
    if name not in self.parts:
      return self.source[name]
    fused, start, rows = self.parts[name]
    array = self.source[fused]
    if array.shape[0] != self.rows[fused]:
      raise ValueError(
        f"tensor {fused!r} of {self.where!r} has {array.shape[0]} rows; the config's parts need "
        f"{self.rows[fused]}"
      )
    return array[start : start + rows]


def expand_fused(fused: dict, num_layers: int) -> dict:
  """`HFFormat.fused`'s map with its "{i}" names written out."""
  out = {}
  for name, parts in fused.items():
    for i in range(num_layers) if "{i}" in name else [None]:
      out[name.format(i=i)] = tuple((part.format(i=i), rows) for part, rows in parts)
  return out


def expand(table, num_layers: int) -> dict:
  """A tensor table with its "{i}" names written out: file name -> (parameter path,
  how). An expert's "{e}" stays: such a name stands for its tensors stacked over the
  experts (`_Stacked`)."""
  out = {}
  for name, (target, how) in table.items():
    for i in range(num_layers) if "{i}" in name else [None]:
      out[name.replace("{i}", str(i))] = (target.replace("{i}", str(i)), how)
  return out


class _Stacked:
  """A source whose per-expert tensors read as one: a name with "{e}" (`expand`) is
  its tensors for e = 0 .. experts-1 stacked along a new first axis; iterating yields
  that name in place of theirs."""

  def __init__(self, source, names, experts: int):
    self.source, self.experts = source, experts
    self.names = [n for n in names if "{e}" in n]
    self.each = {n.replace("{e}", str(e)): n for n in self.names for e in range(experts)}

  def _parts(self, name):
    return [name.replace("{e}", str(e)) for e in range(self.experts)]

  def __contains__(self, name):
    if "{e}" in name:
      return all(p in self.source for p in self._parts(name))
    return name in self.source

  def __iter__(self):
    yield from (n for n in self.source if n not in self.each)
    yield from (n for n in self.names if n in self)

  def __getitem__(self, name):
    if "{e}" not in name:
      return self.source[name]
    return np.stack([np.asarray(self.source[p]) for p in self._parts(name)])


def _read(array, how: str, cfg):
  """A file's tensor as the module's parameter (a view where it can be one)."""
  match how:
    case "":
      return array
    case "T":
      return array.T
    case "Te":  # experts stacked first, each one's matrix transposed
      return np.swapaxes(array, -1, -2)
    case "+1":
      return np.asarray(array, np.float32) + np.float32(1)
    case "Tq" | "Tk":
      heads = cfg.num_heads if how == "Tq" else cfg.num_kv_heads
      rows = np.asarray(array).reshape(heads, cfg.head_dim // 2, 2, -1).swapaxes(1, 2)
      return rows.reshape(array.shape).T
  raise ValueError(f"Unsupported tensor transform {how!r}")


def _write(array, how: str):
  """The module's parameter as the file's tensor (the inverse of `_read`, for Hugging
  Face's tables)."""
  match how:
    case "":
      return array
    case "T":
      return array.T
    case "Te":
      return np.swapaxes(array, -1, -2)
    case "+1":
      return (np.asarray(array, np.float32) - np.float32(1)).astype(array.dtype)
  raise ValueError(f"Unsupported tensor transform {how!r} for saving")


def _ignored(arch, name, num_layers) -> bool:
  patterns = arch.ignored
  return (
    any(name == p.format(i=i) for p in patterns for i in range(num_layers) if "{i}" in p) or name in patterns
  )


def _place(arch, cfg, source, table, placement, *, where):
  """The model of `cfg` with every parameter read from `source` through `table`."""
  model = nnx.eval_shape(lambda: arch.model_class(cfg, **placement, rngs=nnx.Rngs(0)))
  mesh, seq_axis = placement["mesh"], placement["seq_axis"]
  graphdef, state = nnx.split(model)
  by_target = {}
  for name, (target, how) in expand(table, cfg.num_layers).items():
    by_target[target] = (name, how)
  if any("{e}" in name for name, _ in by_target.values()):
    source = _Stacked(source, [name for name, _ in by_target.values()], cfg.num_experts)
  used = set()
  single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  flat = []
  for path, variable in nnx.to_flat_state(state):
    key = ".".join(str(p) for p in path)
    if key not in by_target:
      raise ValueError(
        f"the {arch.model_class.__name__} model's parameter {key!r} has no tensor in the file's map"
      )
    name, how = by_target[key]
    if name not in source:
      raise ValueError(f"tensor {name!r} (for {key!r}) is missing from {where!r}")
    used.add(name)
    array = _read(source[name], how, cfg)
    if tuple(array.shape) != tuple(variable.shape):
      raise ValueError(
        f"tensor {name!r} of {where!r} has shape {tuple(array.shape)} read as the model's {key!r}; "
        f"the config needs {tuple(variable.shape)}"
      )
    if cfg.attention == "dense":
      sharding = single
    else:  # each device reads its own slice of the (memory-mapped) tensor
      sharding = weight_sharding(key, array.shape, cfg, mesh, seq_axis, placement["fsdp"])
    dtype = variable.dtype
    # A copy of each slice: a CPU device's buffer over the memory-mapped slice itself
    # kept the file mapped, and a step could not donate it.
    value = jax.make_array_from_callback(
      tuple(array.shape), sharding, lambda index, a=array, d=dtype: np.array(a[index], dtype=d)
    )
    flat.append((path, variable.replace(value)))
    del array
  # A tied model's file may still hold a head: transformers ties it and never reads it.
  heads = {n for n, (target, _) in expand(table, cfg.num_layers).items() if target == "head.kernel"}
  extra = [
    n
    for n in source
    if n not in used and not _ignored(arch, n, cfg.num_layers) and not (cfg.tie_embeddings and n in heads)
  ]
  if extra:
    raise ValueError(
      f"{where!r} holds tensors the {arch.model_class.__name__} model has no place for: {extra[:5]}"
      + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    )
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def config_json(cfg) -> dict:
  """The config.json of a model of config `cfg` (its `architectures`, `model_type` and
  hyper-parameters, as transformers writes them), without the file's dtype or tokens."""
  arch = architectures.of_config(cfg)
  return {
    "architectures": [arch.hf.architecture],
    "model_type": arch.hf.model_types[0],
  } | arch.hf.write_config(cfg)


def save(model, folder, *, tokenizer=None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
  """`model` in Hugging Face's layout under `folder`: config.json (with `architectures`
  and `model_type`), model.safetensors or shards of at most `max_shard_bytes` (5 GB)
  with model.safetensors.index.json, and with `tokenizer` its tokenizer.json and
  tokenizer_config.json. `models.load(folder)` reads it back with the same logits.
  Returns the folder."""
  cfg = getattr(model, "config", None)
  arch = architectures.of_config(cfg)
  if not isinstance(folder, (str, os.PathLike)):
    raise TypeError(f"folder={folder!r} must be a str or os.PathLike")
  if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive int")
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  state = {".".join(str(p) for p in path): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  table = {n: v for n, v in expand(arch.hf.tensors, cfg.num_layers).items() if v[0] in state}
  missing = set(state) - {target for target, _ in table.values()}
  if missing:
    raise ValueError(f"parameters {sorted(missing)[:5]} have no Hugging Face name")
  tensors = {}
  for name, (target, how) in table.items():
    value = state[target][...]
    for e in range(value.shape[0]) if "{e}" in name else [None]:  # an expert's tensor each
      part = value if e is None else value[e]
      tensors[name if e is None else name.replace("{e}", str(e))] = (
        part.size * part.dtype.itemsize,
        lambda v=part, h=how: np.ascontiguousarray(_write(np.asarray(jax.device_get(v)), h)),
      )
  if arch.hf.fused is not None:  # parts the file stores as one tensor
    for name, parts in expand_fused(arch.hf.fused(cfg), cfg.num_layers).items():
      pieces = [tensors.pop(part) for part, _ in parts]
      tensors[name] = (
        sum(n for n, _ in pieces),
        lambda pieces=pieces: np.concatenate([get() for _, get in pieces], axis=0),
      )
  safetensors_io.write_shards(folder, tensors, max_shard_bytes)
  values = config_json(cfg)
  values["torch_dtype"] = str(state["embed.embedding"][...].dtype)
  if tokenizer is not None:
    values |= dict(
      bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
    )
  (folder / "config.json").write_text(json.dumps(values, indent=2))
  if tokenizer is not None:
    tokenizer_io.save_tokenizer(tokenizer, folder, context_length=cfg.context_length)
  return folder
