"""Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report", arXiv 2505.09388): Qwen 3's
block (RMSNorm on each query and key head, no biases) with a mixture of experts in
place of the MLP (`moe.MoE`: softmax router, top-k experts, the top-k probabilities
renormalized where `norm_topk_prob`). A layer is sparse where it is not among
`mlp_only_layers` and (layer + 1) is a multiple of `decoder_sparse_step`, as in
transformers' Qwen3MoeDecoderLayer; the others keep a dense MLP of `mlp_hidden`.

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from . import decoder, llama, moe, qwen3, tables
from .decoder import CausalLM, PreNormBlock
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Qwen3Moe", "Qwen3MoeConfig"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(qwen3.Qwen3Config):
  """Qwen3-MoE's hyper-parameters (Qwen 3's fields and the experts'); the defaults are
  Qwen3-30B-A3B's."""

  model_type: ClassVar[str] = "qwen3_moe"
  dim: int = 2048
  num_layers: int = 48
  num_heads: int = 32
  num_kv_heads: int = 4
  mlp_hidden: int = 6144  # the dense layers' MLP (`mlp_only_layers`)
  num_experts: int = 128
  num_experts_per_tok: int = 8
  moe_hidden: int = 768  # each expert's hidden width (`moe_intermediate_size`)
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.001

  def validate(self, mesh, seq_axis) -> None:
    decoder.check_config(
      self,
      mesh,
      seq_axis,
      extra_ints=("num_experts", "num_experts_per_tok", "moe_hidden", "decoder_sparse_step"),
    )
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(
        f"Qwen3MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
        f"num_experts={self.num_experts}: a token cannot go to more experts than there are"
      )
    bad = [
      i
      for i in self.mlp_only_layers
      if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers
    ]
    if not isinstance(self.mlp_only_layers, tuple) or bad:
      raise ValueError(
        f"Qwen3MoeConfig.mlp_only_layers={self.mlp_only_layers!r} must be a tuple of layer indices in "
        f"[0, {self.num_layers})"
      )

  def sparse(self, layer: int) -> bool:
    """Whether `layer` has experts (transformers' rule)."""
    return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class Qwen3Moe(CausalLM):
  """Qwen3-MoE: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    place = dict(mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis)
    sparse = sum(map(config.sparse, range(config.num_layers)))
    experts = (
      moe.make_mlp(config, config.moe_hidden, normalize=config.norm_topk_prob, sparse_layers=sparse, **place)
      if config.sparse(layer)
      else None
    )
    return PreNormBlock(config, **place, rngs=rngs, make_mlp=experts, qk_norm_epsilon=config.norm_eps)


# Released configs: config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on Hugging Face.
CONFIGS = {
  "qwen3-30b-a3b": Qwen3MoeConfig(),
  "qwen3-235b-a22b": Qwen3MoeConfig(
    dim=4096, num_layers=94, num_heads=64, num_kv_heads=4, mlp_hidden=12288, moe_hidden=1536
  ),
}

_HF_LAYER = "model.layers.{i}."
_ATTENTION_PARTS = tuple(p for p in tables.LLAMA_PARTS if p not in ("gate", "up", "down"))
# The dense layers' MLP as Qwen 3's; a sparse layer's router ("mlp.gate", [E, D]) and its
# experts, one file tensor per expert ("{e}"), stacked over the experts on loading ("Te":
# each expert's matrix transposed).
HF_TENSORS = tables.table(tables.HF_NAMES, tables.LLAMA_PARTS + tables.QK_NORMS) | {
  _HF_LAYER + "mlp.gate.weight": ("blocks.{i}.mlp.router.kernel", "T"),
  _HF_LAYER + "mlp.experts.{e}.gate_proj.weight": ("blocks.{i}.mlp.gate", "Te"),
  _HF_LAYER + "mlp.experts.{e}.up_proj.weight": ("blocks.{i}.mlp.up", "Te"),
  _HF_LAYER + "mlp.experts.{e}.down_proj.weight": ("blocks.{i}.mlp.down", "Te"),
}


def _expert_count(cfg) -> int:
  """The number of experts: `num_experts` as transformers 4.x writes it, or
  `num_local_experts` as 5.x's `save_pretrained` does (5.24); both must agree."""
  given = {name: cfg.int(name) for name in ("num_experts", "num_local_experts") if cfg.get(name) is not None}
  if not given:
    raise ValueError(f"{cfg.where}: 'num_experts' (or 'num_local_experts') is missing: the number of experts")
  if len(set(given.values())) > 1:
    raise ValueError(f"{cfg.where}: num_experts and num_local_experts differ ({given}): give one count")
  return next(iter(given.values()))


def config_from_hf(cfg, **overrides) -> Qwen3MoeConfig:
  """Qwen3-MoE's config.json: Qwen 3's keys and the experts'. `output_router_logits`
  and `router_aux_loss_coef` concern training's loss only; they are read."""
  llama.full_attention_only(cfg, "Qwen3-MoE")
  cfg.get("output_router_logits")
  only = cfg.get("mlp_only_layers", []) or []
  if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
    raise ValueError(f"{cfg.where}: mlp_only_layers={only!r} must be a list of layer indices")
  return llama.config_from_hf(
    cfg,
    cls=Qwen3MoeConfig,
    num_experts=_expert_count(cfg),
    num_experts_per_tok=cfg.int("num_experts_per_tok"),
    moe_hidden=cfg.int("moe_intermediate_size"),
    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    decoder_sparse_step=cfg.int("decoder_sparse_step"),
    mlp_only_layers=tuple(only),
    router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    **overrides,
  )


# llama.cpp's qwen3moe: Qwen 3's attention, and in every layer the router
# ("ffn_gate_inp", [E, D]) and the experts stacked in one tensor each ([E, F, D]; down
# [E, D, F]).
GGUF_TENSORS = tables.table(tables.GGUF_NAMES, _ATTENTION_PARTS + tables.QK_NORMS) | {
  "blk.{i}.ffn_gate_inp.weight": ("blocks.{i}.mlp.router.kernel", "T"),
  "blk.{i}.ffn_gate_exps.weight": ("blocks.{i}.mlp.gate", "Te"),
  "blk.{i}.ffn_up_exps.weight": ("blocks.{i}.mlp.up", "Te"),
  "blk.{i}.ffn_down_exps.weight": ("blocks.{i}.mlp.down", "Te"),
}


def _gguf_experts(f) -> dict:
  """llama.cpp's qwen3moe runs experts in every layer and always renormalizes the top-k
  probabilities (`build_moe_ffn(..., norm_w=true)`)."""
  return dict(
    num_experts=f.int("expert_count"),
    num_experts_per_tok=f.int("expert_used_count"),
    moe_hidden=f.int("expert_feed_forward_length"),
    norm_topk_prob=True,
  )


def config_from_gguf(gguf_file, **overrides) -> Qwen3MoeConfig:
  return llama.config_from_gguf(
    gguf_file, arch="qwen3moe", cls=Qwen3MoeConfig, experts=_gguf_experts, **overrides
  )


def hf_config(config) -> dict:
  return qwen3.hf_config(config) | dict(
    num_experts=config.num_experts,
    num_experts_per_tok=config.num_experts_per_tok,
    moe_intermediate_size=config.moe_hidden,
    norm_topk_prob=config.norm_topk_prob,
    decoder_sparse_step=config.decoder_sparse_step,
    mlp_only_layers=list(config.mlp_only_layers),
    router_aux_loss_coef=config.router_aux_loss_coef,
    output_router_logits=False,
  )


# transformers' Qwen3MoeConfig defaults for the keys a file may leave out.
HF_DEFAULTS = {"decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": []}

ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="qwen3_moe",
  config_class=Qwen3MoeConfig,
  model_class=Qwen3Moe,
  configs=CONFIGS,
  hf=HFFormat(
    ("qwen3_moe",), "Qwen3MoeForCausalLM", HF_TENSORS, config_from_hf, hf_config, defaults=HF_DEFAULTS
  ),
  gguf=GGUFFormat("qwen3moe", GGUF_TENSORS, config_from_gguf),
)
