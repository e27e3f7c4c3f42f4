"""Small transformer models built only on jax_ring's public API."""

from .gemma import Gemma, GemmaConfig
from .generate import Generated, generate
from .gguf import GGUFFile, Tokenizer, load_gguf
from .longnet import LongNet, LongNetConfig
from .transformer import ATTENTION_KINDS, DecoderLM, LMConfig

__all__ = [
  "ATTENTION_KINDS",
  "DecoderLM",
  "GGUFFile",
  "Gemma",
  "GemmaConfig",
  "Generated",
  "LMConfig",
  "LongNet",
  "LongNetConfig",
  "Tokenizer",
  "generate",
  "load_gguf",
]
