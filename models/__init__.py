"""Small transformer models built only on jax_ring's public API."""

from .generate import Generated, generate
from .longnet import LongNet, LongNetConfig
from .transformer import ATTENTION_KINDS, DecoderLM, LMConfig

__all__ = ["ATTENTION_KINDS", "DecoderLM", "Generated", "LMConfig", "LongNet", "LongNetConfig", "generate"]
