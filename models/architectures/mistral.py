"""Mistral (Jiang et al. 2023, "Mistral 7B", arXiv 2310.06825): Llama's pre-norm block
and tensors, with a sliding window over the keys where the config sets one (each query
sees the `sliding_window` keys ending at itself, in every layer). Mistral-7B-v0.3 and
Mistral-Nemo set none; Nemo's heads are 128 wide in a width of 5,120 (32 heads), apart
from hidden / heads. llama.cpp converts these models as its "llama" architecture, so a
Mistral GGUF file loads as `Llama` (without a window, as llama.cpp runs it).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax_ring import nn as ring_nn

from . import llama
from .decoder import CausalLM, PreNormBlock
from .record import HFFormat

__all__ = ["CONFIGS", "Mistral", "MistralConfig"]


@dataclasses.dataclass(frozen=True)
class MistralConfig(llama.LlamaConfig):
  """Mistral's hyper-parameters (Llama's fields and `sliding_window`: the keys a query
  sees, itself included, or None: all before it); the defaults are Mistral-7B-v0.3's."""

  model_type: ClassVar[str] = "mistral"
  vocab_size: int = 32768
  mlp_hidden: int = 14336
  rope_base: float = 1_000_000.0
  rope_scaling: ring_nn.RopeScaling | None = None
  context_length: int = 32768
  sliding_window: int | None = None

  def validate(self, mesh, seq_axis) -> None:
    w = self.sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
      raise ValueError(f"MistralConfig.sliding_window={w!r} must be a positive int or None")
    super().validate(mesh, seq_axis)


class Mistral(CausalLM):
  """Mistral: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs, make_mlp=None):
    """`make_mlp`: another feed-forward (Mixtral's experts)."""
    w = config.sliding_window
    window = None if w is None else (w - 1, 0)
    return PreNormBlock(
      config,
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      rngs=rngs,
      local_window_size=window,
      make_mlp=make_mlp,
    )


_TEKKEN = dict(vocab_size=131072, head_dim=128)
# Released configs: config.json of mistralai/Mistral-7B-v0.3, Mistral-Nemo-Base-2407 and
# Ministral-8B-Instruct-2410 on Hugging Face.
CONFIGS = {
  "mistral-7b-v0.3": MistralConfig(),
  "mistral-nemo-12b": MistralConfig(dim=5120, num_layers=40, context_length=1_024_000, **_TEKKEN),
  "ministral-8b": MistralConfig(
    num_layers=36, mlp_hidden=12288, rope_base=100_000_000.0, sliding_window=32768, **_TEKKEN
  ),
}


def config_from_hf(cfg, cls=MistralConfig, **overrides) -> MistralConfig:
  """Mistral's config.json: Llama's keys and `sliding_window` (null: none). transformers
  5 writes `layer_types`, which must agree with it (every layer "sliding_attention"
  with a window, "full_attention" without). `cls`: the config class (Mixtral's)."""
  window = cfg.get("sliding_window")
  if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
    raise ValueError(f"{cfg.where}: sliding_window={window!r} must be a positive int or null")
  types = cfg.get("layer_types")
  layers = cfg.int("num_hidden_layers")
  kind = "full_attention" if window is None else "sliding_attention"
  if types is not None and (not isinstance(types, list) or types != [kind] * layers):
    raise ValueError(
      f"{cfg.where}: layer_types={types!r} must name {layers} layers, all {kind} (sliding_window="
      f"{window!r}): layers of other kinds are not applied for Mistral, so the checkpoint is refused"
    )
  return llama.config_from_hf(cfg, cls=cls, sliding_window=window, **overrides)


def hf_config(config) -> dict:
  values = llama.hf_config(config) | dict(sliding_window=config.sliding_window)
  values.pop("mlp_bias")  # not a key of Mistral's config
  return values


ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="mistral",
  config_class=MistralConfig,
  model_class=Mistral,
  configs=CONFIGS,
  # transformers' MistralConfig gives a file without `sliding_window` a window of 4,096
  # (save_pretrained leaves out values equal to the class's defaults).
  hf=HFFormat(
    ("mistral",),
    "MistralForCausalLM",
    llama.HF_TENSORS,
    config_from_hf,
    hf_config,
    defaults={"sliding_window": 4096},
  ),
  gguf=None,
)
