"""`Architecture`: what `models` needs to know of a model family, with what each file
format needs (`HFFormat`, `GGUFFormat`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class HFFormat:
  """A family in Hugging Face's layout.

  model_types: config.json's `model_type` values read as this family; the first is
    the one `models.save` writes.
  architecture: config.json's `architectures` entry `models.save` writes.
  tensors: a tensor name -> (the model's parameter path, how to read it); "{i}"
    stands for the layer (`tables.table`).
  read_config(reader, **overrides) -> config: from a `config_json.ConfigReader`,
    which refuses any key left unread that could change the computation.
  write_config(config) -> dict: config.json's hyper-parameters.
  defaults: the values transformers' config class gives the keys a file leaves out,
    where the reader needs them (None: a missing key is an error).
  multimodal: `model_type`s whose `text_config` holds this family's config (a
    vision-language folder), its tensors under one of `text_prefixes`.
  fused: fused(config) -> {a file's tensor: ((part, rows), ...)} for tensors the file
    stores as one and the model holds apart (Phi-3's qkv_proj, gate_up_proj): the
    parts, names in `tensors`, are the file tensor's rows in that order; `models.load`
    splits them and `models.save` joins them. None: none.
  """

  model_types: tuple[str, ...]
  architecture: str
  tensors: Mapping
  read_config: Callable
  write_config: Callable
  defaults: Mapping | None = None
  multimodal: tuple[str, ...] = ()
  text_prefixes: tuple[str, ...] = ()
  fused: Callable | None = None


@dataclasses.dataclass(frozen=True)
class GGUFFormat:
  """A family in llama.cpp's GGUF files: `general.architecture`, the tensor table, the
  config reader (`read_config(gguf_file, **overrides) -> config`) and the fused
  tensors (as `HFFormat.fused`). `accepts(gguf_file) -> bool`: whether the family reads
  a file of that architecture, where llama.cpp writes two families under one name
  (Mixtral is "llama" with experts); None, every file."""

  arch: str
  tensors: Mapping
  read_config: Callable
  fused: Callable | None = None
  accepts: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Architecture:
  """A model family.

  name: its registry name.
  config_class, model_class: the frozen config dataclass and the `CausalLM` subclass
    built from it (`model_class(config, mesh=..., seq_axis=..., rngs=...)`).
  configs: the released models' configs by `models.config` name ("llama-3.1-8b").
  hf, gguf: how each format names its tensors and config; gguf None where llama.cpp
    has no architecture of the family's own (it converts Mistral as "llama", which
    loads as Llama).
  ignored: tensor names a file may hold that the model does not use.
  """

  name: str
  config_class: type
  model_class: type
  configs: Mapping
  hf: HFFormat
  gguf: GGUFFormat | None
  ignored: tuple[str, ...] = ()
