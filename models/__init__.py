"""Small transformer models built only on jax_ring's public API."""

from models.generate import Generated, generate
from models.longnet import LongNet, LongNetConfig
from models.transformer import ATTENTION_KINDS, DecoderLM, LMConfig

__all__ = ["ATTENTION_KINDS", "DecoderLM", "Generated", "LMConfig", "LongNet", "LongNetConfig", "generate"]
