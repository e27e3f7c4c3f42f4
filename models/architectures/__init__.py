"""The model families, one module each, and the registry that `models.config`,
`models.build`, `models.load` and `models.save` look them up in.

A family module builds its blocks on `decoder.CausalLM` and ends with one
`Architecture` record (`record.py`); a new family is that module and one line in
`REGISTRY`.
"""

from __future__ import annotations

from . import gemma, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe
from .record import Architecture

REGISTRY: tuple[Architecture, ...] = (
  gemma.ARCHITECTURE,
  llama.ARCHITECTURE,
  mistral.ARCHITECTURE,
  mixtral.ARCHITECTURE,
  olmo2.ARCHITECTURE,
  phi3.ARCHITECTURE,
  qwen2.ARCHITECTURE,
  qwen3.ARCHITECTURE,
  qwen3_moe.ARCHITECTURE,
)


def registry() -> tuple[Architecture, ...]:
  """Every family, in the order `models.config` lists their names."""
  return REGISTRY


def of_config(cfg) -> Architecture:
  """The family of a config instance (its exact class)."""
  for arch in REGISTRY:
    if type(cfg) is arch.config_class:
      return arch
  known = tuple(a.config_class.__name__ for a in REGISTRY)
  raise TypeError(f"config={cfg!r} is not a config of a known architecture; expected one of {known}")


def __getattr__(name):
  """Submodules reached as attributes (`models.<package>.<module>`), imported when first named."""
  import importlib
  import pkgutil

  if name in {m.name for m in pkgutil.iter_modules(__path__)}:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
