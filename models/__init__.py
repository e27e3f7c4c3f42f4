"""Transformer models over jax_ring's ring attention: the families a user loads from
Hugging Face folders and GGUF files, the small models trained from scratch, their
training step, generation and long-context evaluation.

    architectures/  one module per family (decoder.CausalLM and the blocks it stacks),
                    each ending in an `Architecture` record listed in the registry
    formats/        safetensors, config.json, GGUF, tokenizer.json: files to arrays
    data/           a user's data: files, chat templates, packing, the resumable loader
    checkpoints.py  models.config / build / load / save: formats -> architectures
    generate.py     the generation engine: `generate` (batches) and `Engine` (cached documents)
    lora.py         low-rank adapters: add_lora, save_lora (PEFT's layout), merge_lora
    train/          the training step (every model), fine-tuning, training from scratch
    eval/           the long-context evaluators and lm-evaluation-harness's model

`from jax_ring import models` gives the models and `generate` at once; the modules
with heavier dependencies load on first use (`models.runtime`, `models.train.scratch`,
`models.eval.long_context`, ...). The package is built on jax_ring's public API.
"""

import importlib

from . import _moved
from .architectures.gemma import Gemma, GemmaConfig
from .architectures.llama import Llama, LlamaConfig
from .architectures.longnet import LongNet, LongNetConfig
from .architectures.mistral import Mistral, MistralConfig
from .architectures.mixtral import Mixtral, MixtralConfig
from .architectures.olmo2 import Olmo2, Olmo2Config
from .architectures.phi3 import Phi3, Phi3Config
from .architectures.qwen2 import Qwen2, Qwen2Config
from .architectures.qwen3 import Qwen3, Qwen3Config
from .architectures.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from .architectures.scratch import ATTENTION_KINDS, DecoderLM, LMConfig
from .checkpoints import build, config, load, load_gguf, save, shardings
from .data.chat import chat_template, tokenize_chat
from .data.packing import pack
from .formats.gguf import GGUFFile, Tokenizer
from .formats.tokenizer_json import HFTokenizer
from .generate import Engine, Generated, generate
from .lora import add_lora, merge_lora, save_lora

__all__ = [
  "ATTENTION_KINDS",
  "DecoderLM",
  "Engine",
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
  "Mistral",
  "MistralConfig",
  "Mixtral",
  "MixtralConfig",
  "Olmo2",
  "Olmo2Config",
  "Phi3",
  "Phi3Config",
  "Qwen2",
  "Qwen2Config",
  "Qwen3",
  "Qwen3Config",
  "Qwen3Moe",
  "Qwen3MoeConfig",
  "Tokenizer",
  "add_lora",
  "build",
  "chat_template",
  "config",
  "generate",
  "load",
  "load_gguf",
  "merge_lora",
  "pack",
  "save",
  "save_lora",
  "shardings",
  "tokenize_chat",
]

# Modules reached as attributes (`models.runtime.initialize_distributed()`), imported
# when first named so that `import jax_ring.models` needs no optional extra.
_SUBMODULES = ("architectures", "checkpoints", "cli", "data", "eval", "formats", "lora", "runtime", "train")
_moved.install()


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  if name in _moved.MOVED:
    return _moved.moved(name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
