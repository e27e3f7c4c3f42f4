"""Small transformer models built only on jax_ring's public API."""

from models.longnet import LongNet, LongNetConfig
from models.transformer import ATTENTION_KINDS, DecoderLM, LMConfig

__all__ = ["ATTENTION_KINDS", "DecoderLM", "LMConfig", "LongNet", "LongNetConfig"]
