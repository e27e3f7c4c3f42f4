"""Transformer models built on jax_ring's public API.

`from jax_ring import models` gives the models and `generate` at once; the modules
with heavier dependencies load on first use: `models.runtime` (process set-up),
`models.training` (optax, orbax: the `[train]` extra), `models.long_context` (the
main job) and the rest of the package's modules.
"""

import importlib

from .checkpoints import build, config, load, load_gguf, save, shardings
from .gemma import Gemma, GemmaConfig
from .generate import Generated, generate
from .gguf import GGUFFile, Tokenizer
from .llama import Llama, LlamaConfig
from .longnet import LongNet, LongNetConfig
from .qwen3 import Qwen3, Qwen3Config
from .tokenizer import HFTokenizer
from .transformer import ATTENTION_KINDS, DecoderLM, LMConfig

__all__ = [
  "ATTENTION_KINDS",
  "DecoderLM",
  "GGUFFile",
  "Gemma",
  "GemmaConfig",
  "Generated",
  "HFTokenizer",
  "LMConfig",
  "Llama",
  "LlamaConfig",
  "LongNet",
  "LongNetConfig",
  "Qwen3",
  "Qwen3Config",
  "Tokenizer",
  "build",
  "config",
  "generate",
  "load",
  "load_gguf",
  "save",
  "shardings",
]

# Submodules reached as attributes (`models.runtime.initialize_distributed()`), imported
# when first named so that `import jax_ring.models` needs no optional extra.
_SUBMODULES = (
  "checkpoints",
  "cli",
  "decoder",
  "finetune",
  "harness",
  "hf",
  "long_context",
  "needle",
  "report",
  "runtime",
  "tasks",
  "tokenizer",
  "training",
  "vocab",
)


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
