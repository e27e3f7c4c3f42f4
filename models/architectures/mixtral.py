"""Mixtral (Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088): Mistral's
block with a mixture of experts in place of every MLP (`moe.MoE`: softmax router, the
top 2 of 8 experts, their probabilities renormalized to sum to one).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from . import llama, mistral, moe, tables
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Mixtral", "MixtralConfig"]


@dataclasses.dataclass(frozen=True)
class MixtralConfig(mistral.MistralConfig):
  """Mixtral's hyper-parameters (Mistral's fields and the experts': `mlp_hidden` is each
  expert's hidden width); the defaults are Mixtral-8x7B-v0.1's."""

  model_type: ClassVar[str] = "mixtral"
  vocab_size: int = 32000
  num_experts: int = 8
  num_experts_per_tok: int = 2
  router_aux_loss_coef: float = 0.02

  def validate(self, mesh, seq_axis) -> None:
    for name in ("num_experts", "num_experts_per_tok"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MixtralConfig.{name}={value!r} must be a positive int")
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(
        f"MixtralConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
        f"num_experts={self.num_experts}: a token cannot go to more experts than there are"
      )
    super().validate(mesh, seq_axis)


class Mixtral(mistral.Mistral):
  """Mixtral: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    place = dict(mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis)
    experts = moe.make_mlp(
      config, config.mlp_hidden, normalize=True, sparse_layers=config.num_layers, **place
    )
    return super().make_block(config, layer, **place, rngs=rngs, make_mlp=experts)


# Released config: config.json of mistralai/Mixtral-8x7B-v0.1 on Hugging Face.
CONFIGS = {"mixtral-8x7b": MixtralConfig(norm_eps=1e-5)}

_MOE = "model.layers.{i}.block_sparse_moe."
# Mistral's attention and norms; each layer's router ("gate", [E, D]) and its experts' w1
# (gate), w3 (up) and w2 (down), one file tensor per expert, stacked on loading.
HF_TENSORS = tables.table(
  tables.HF_NAMES, [p for p in tables.LLAMA_PARTS if p not in ("gate", "up", "down")]
) | {
  _MOE + "gate.weight": ("blocks.{i}.mlp.router.kernel", "T"),
  _MOE + "experts.{e}.w1.weight": ("blocks.{i}.mlp.gate", "Te"),
  _MOE + "experts.{e}.w3.weight": ("blocks.{i}.mlp.up", "Te"),
  _MOE + "experts.{e}.w2.weight": ("blocks.{i}.mlp.down", "Te"),
}


# llama.cpp converts Mixtral as "llama" (query and key rows reordered as Llama's) with
# each layer's router ("ffn_gate_inp", [E, D]) and its experts stacked in one tensor
# each ([E, F, D]; down [E, D, F]).
GGUF_TENSORS = tables.table(
  tables.GGUF_NAMES,
  [p for p in tables.LLAMA_PARTS if p not in ("gate", "up", "down")],
  {"query": "Tq", "key": "Tk"},
) | {
  "blk.{i}.ffn_gate_inp.weight": ("blocks.{i}.mlp.router.kernel", "T"),
  "blk.{i}.ffn_gate_exps.weight": ("blocks.{i}.mlp.gate", "Te"),
  "blk.{i}.ffn_up_exps.weight": ("blocks.{i}.mlp.up", "Te"),
  "blk.{i}.ffn_down_exps.weight": ("blocks.{i}.mlp.down", "Te"),
}


def _gguf_experts(f) -> dict:
  """A "llama" file's experts, as llama.cpp runs them: every layer sparse, each expert
  as wide as `feed_forward_length`, the top-k probabilities renormalized
  (`build_moe_ffn(..., norm_w=true)`), and no window (as it runs Mistral)."""
  f.expect("expert_feed_forward_length", f.int("feed_forward_length"))
  return dict(
    num_experts=f.int("expert_count"),
    num_experts_per_tok=f.int("expert_used_count"),
    sliding_window=None,
  )


def config_from_gguf(gguf_file, **overrides) -> MixtralConfig:
  return llama.config_from_gguf(gguf_file, cls=MixtralConfig, experts=_gguf_experts, **overrides)


def config_from_hf(cfg, **overrides) -> MixtralConfig:
  """Mixtral's config.json: Mistral's keys and the experts'. `router_jitter_noise`
  (noise on the router's logits in training) must be 0; `output_router_logits` and
  `router_aux_loss_coef` concern training's loss only."""
  cfg.expect("router_jitter_noise", 0.0)
  cfg.get("output_router_logits")
  return mistral.config_from_hf(
    cfg,
    cls=MixtralConfig,
    num_experts=cfg.int("num_local_experts"),
    num_experts_per_tok=cfg.int("num_experts_per_tok"),
    router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    **overrides,
  )


def hf_config(config) -> dict:
  return mistral.hf_config(config) | dict(
    num_local_experts=config.num_experts,
    num_experts_per_tok=config.num_experts_per_tok,
    router_aux_loss_coef=config.router_aux_loss_coef,
    router_jitter_noise=0.0,
    output_router_logits=False,
  )


ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="mixtral",
  config_class=MixtralConfig,
  model_class=Mixtral,
  configs=CONFIGS,
  hf=HFFormat(("mixtral",), "MixtralForCausalLM", HF_TENSORS, config_from_hf, hf_config),
  gguf=GGUFFormat("llama", GGUF_TENSORS, config_from_gguf, accepts=llama.has_experts),
)
