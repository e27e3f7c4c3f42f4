"""Phi-3 and Phi-4-mini (Abdin et al. 2024, "Phi-3 Technical Report", arXiv 2404.14219;
Microsoft 2025, "Phi-4-Mini Technical Report", arXiv 2503.01743): Llama's pre-norm
block with the query, key and value projections stored as one `qkv_proj` and the
MLP's gate and up projections as one `gate_up_proj` (split on load, joined on save),
rotary embeddings on the first `rope_dim` dimensions of each head (Phi-4-mini: 96 of
128), LongRoPE for the long-context models (`jax_ring.nn.RopeScaling("longrope")`:
short factors up to original_max_position_embeddings tokens, long ones past it, and
an attention factor), and a sliding window where the config sets one (as transformers
runs it; a window wider than the sequence is no window).

Legend: B batch, T sequence length, D model width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from jax_ring import nn as ring_nn

from ..formats import config_json
from . import llama, mistral, tables
from .decoder import CausalLM, PreNormBlock
from .record import GGUFFormat, HFFormat

__all__ = ["CONFIGS", "Phi3", "Phi3Config"]

# Phi-4-mini's LongRoPE: config.json of microsoft/Phi-4-mini-instruct on Hugging Face.
_PHI4_MINI_LONG = (
  1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
  2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
  5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
  14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
  32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
  47.77,
)  # fmt: skip
_PHI4_MINI_ROPE = ring_nn.RopeScaling(
  "longrope",
  factors=(1.0,) * 48,
  long_factors=_PHI4_MINI_LONG,
  original_max_position_embeddings=4096,
  attention_factor=config_json.longrope_attention_factor(131072 / 4096, 4096),
)


@dataclasses.dataclass(frozen=True)
class Phi3Config(mistral.MistralConfig):
  """Phi-3's hyper-parameters (Mistral's fields and `rope_dim`: the leading dimensions
  of each head that rotate, None: all); the defaults are Phi-4-mini's."""

  model_type: ClassVar[str] = "phi3"
  vocab_size: int = 200064
  dim: int = 3072
  num_layers: int = 32
  num_heads: int = 24
  num_kv_heads: int = 8
  head_dim: int = 128
  mlp_hidden: int = 8192
  rope_base: float = 10000.0
  rope_scaling: ring_nn.RopeScaling | None = _PHI4_MINI_ROPE
  norm_eps: float = 1e-5
  context_length: int = 131072
  tie_embeddings: bool = True
  sliding_window: int | None = 262144
  rope_dim: int | None = 96

  def validate(self, mesh, seq_axis) -> None:
    r = self.rope_dim
    if r is not None and (
      isinstance(r, bool) or not isinstance(r, int) or r % 2 or not 0 < r <= self.head_dim
    ):
      raise ValueError(
        f"Phi3Config.rope_dim={r!r} must be None or a positive even int of at most head_dim={self.head_dim}"
      )
    scaling = self.rope_scaling
    if (
      scaling is not None and scaling.kind == "longrope" and len(scaling.factors) * 2 != (r or self.head_dim)
    ):
      raise ValueError(
        f"Phi3Config.rope_scaling has {len(scaling.factors)} LongRoPE factors; rope_dim={r or self.head_dim} "
        f"rotates {(r or self.head_dim) // 2} frequencies"
      )
    super().validate(mesh, seq_axis)


class Phi3(CausalLM):
  """Phi-3: tokens int [B, T] -> logits float32 [B, T, V] (`decoder.CausalLM`)."""

  def make_block(self, config, layer, *, mesh, seq_axis, batch_axis, rngs):
    w = config.sliding_window
    return PreNormBlock(
      config,
      mesh=mesh,
      seq_axis=seq_axis,
      batch_axis=batch_axis,
      rngs=rngs,
      local_window_size=None if w is None else (w - 1, 0),
      rope_dim=config.rope_dim,
    )


_PHI3_MINI = dict(
  vocab_size=32064,
  num_heads=32,
  num_kv_heads=32,
  head_dim=96,
  rope_scaling=None,
  tie_embeddings=False,
  rope_dim=None,
)
# Phi-3-mini-128k-instruct's LongRoPE lists, its current release ("longrope"; the first,
# "su", differs), as its config.json holds them (copied in public repositories, named in
# tests/data/phi3-mini-128k-longrope.json).
_PHI3_MINI_128K_SHORT = (
  1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003,
  1.3500000000000003, 1.4000000000000004, 1.5500000000000005, 2.000000000000001, 2.000000000000001,
  2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
  2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
  2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
  2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007,
  2.0500000000000007, 2.1000000000000005, 2.1000000000000005, 2.1500000000000004, 2.25,
  2.25, 2.25, 2.25, 2.25, 2.3999999999999995,
  2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982,
  2.799999999999998, 2.8999999999999977, 3.049999999999997,
)  # fmt: skip
_PHI3_MINI_128K_LONG = (
  1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
  1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
  6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
  14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
  38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
  54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
  60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
  63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
  64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
  64.57435607910156, 64.69000244140625, 64.76000213623047,
)  # fmt: skip
# Released configs: config.json of microsoft/Phi-4-mini-instruct,
# microsoft/Phi-3-mini-4k-instruct and microsoft/Phi-3-mini-128k-instruct on Hugging
# Face (the 128K model's window, wider than its context, is no window).
CONFIGS = {
  "phi-4-mini": Phi3Config(),
  "phi-3-mini-4k": Phi3Config(context_length=4096, sliding_window=2047, **_PHI3_MINI),
  "phi-3-mini-128k": Phi3Config(
    context_length=131072,
    sliding_window=None,
    **(
      _PHI3_MINI
      | dict(
        rope_scaling=ring_nn.RopeScaling(
          "longrope",
          factors=_PHI3_MINI_128K_SHORT,
          long_factors=_PHI3_MINI_128K_LONG,
          original_max_position_embeddings=4096,
          attention_factor=config_json.longrope_attention_factor(131072 / 4096, 4096),
        )
      )
    ),
  ),
}

_LAYER = "model.layers.{i}."
# transformers' names: Llama's, with the fused tensors' parts under Llama's own names.
HF_TENSORS = tables.table(tables.HF_NAMES, tables.LLAMA_PARTS)
# llama.cpp's phi3: rotary pairs as Hugging Face's; the gate and up halves of one ffn_up.
_GGUF_NAMES = tables.GGUF_NAMES | {"gate": "blk.{i}.ffn_up.weight:gate", "up": "blk.{i}.ffn_up.weight:up"}
GGUF_TENSORS = tables.table(_GGUF_NAMES, tables.LLAMA_PARTS)
IGNORED = ("rope_factors_long.weight", "rope_factors_short.weight")


def _fused(names, qkv: str, gate_up: str):
  def fused(cfg) -> dict:
    h = cfg.head_dim
    return {
      qkv: (
        (names["query"], cfg.num_heads * h),
        (names["key"], cfg.num_kv_heads * h),
        (names["value"], cfg.num_kv_heads * h),
      ),
      gate_up: ((names["gate"], cfg.mlp_hidden), (names["up"], cfg.mlp_hidden)),
    }

  return fused


HF_FUSED = _fused(tables.HF_NAMES, _LAYER + "self_attn.qkv_proj.weight", _LAYER + "mlp.gate_up_proj.weight")
GGUF_FUSED = _fused(_GGUF_NAMES, "blk.{i}.attn_qkv.weight", "blk.{i}.ffn_up.weight")


def _check_scaling_kind(cfg) -> None:
  """transformers' Phi-3 takes LongRoPE alone ("longrope", or "su", its first name):
  its config check refuses every other rope_type (5.24: "type field must be one of
  ['longrope']")."""
  params = cfg.get("rope_parameters")
  values = params if isinstance(params, dict) else cfg.get("rope_scaling")
  kind = None if values is None else values.get("rope_type", values.get("type", "default"))
  if kind not in (None, "default", "longrope", "su"):
    raise ValueError(
      f"{cfg.where}: rope scaling rope_type={kind!r} is not one Phi-3 takes (supported: 'default', "
      "'longrope' and its first name 'su', as transformers' Phi-3)"
    )


def config_from_hf(cfg, **overrides) -> Phi3Config:
  """Phi-3's config.json: Llama's keys, `original_max_position_embeddings`,
  `partial_rotary_factor` (top level, or in 5.x's rope_parameters), LongRoPE
  (`rope_scaling` type "longrope" or "su"), `sliding_window` (null: none) and
  dropouts that must be 0. transformers' Phi-3 takes head_dim = hidden / heads."""
  cfg.expect("hidden_act", "silu")
  for key in ("resid_pdrop", "embd_pdrop"):
    cfg.expect(key, 0.0)
  for key in ("mlp_bias", "lm_head_bias"):
    cfg.expect(key, False)
  for key in ("full_attn_mod", "interpolate_factor"):  # Phi-4-mini's; transformers reads neither
    cfg.expect(key, 1)
  fields = config_json.decoder_fields(cfg)
  if fields["head_dim"] * fields["num_heads"] != fields["dim"]:
    raise ValueError(
      f"{cfg.where}: head_dim={fields['head_dim']} x num_attention_heads={fields['num_heads']} != "
      f"hidden_size={fields['dim']}: transformers' Phi-3 takes head_dim = hidden_size / heads"
    )
  original = cfg.int("original_max_position_embeddings")
  _check_scaling_kind(cfg)
  theta, scaling = cfg.rope(
    context_length=fields["context_length"], original_max_position_embeddings=original
  )
  params = cfg.get("rope_parameters")
  fraction = (params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
  rope_dim = int(fields["head_dim"] * fraction)
  if rope_dim % 2 or rope_dim < 2:
    raise ValueError(
      f"{cfg.where}: partial_rotary_factor={fraction!r} rotates {rope_dim} of {fields['head_dim']} "
      "dimensions: needs a positive even count"
    )
  window = cfg.get("sliding_window")
  if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
    raise ValueError(f"{cfg.where}: sliding_window={window!r} must be a positive int or null")
  return Phi3Config(
    **fields,
    rope_base=theta,
    rope_scaling=scaling,
    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    sliding_window=window,
    rope_dim=None if rope_dim == fields["head_dim"] else rope_dim,
    **overrides,
  )


def _original(config) -> int:
  s = config.rope_scaling
  return (
    s.original_max_position_embeddings if s is not None and s.kind == "longrope" else config.context_length
  )


def hf_config(config) -> dict:
  values = config_json.decoder_keys(config) | dict(
    hidden_act="silu",
    tie_word_embeddings=config.tie_embeddings,
    original_max_position_embeddings=_original(config),
    partial_rotary_factor=(config.rope_dim or config.head_dim) / config.head_dim,
    sliding_window=config.sliding_window,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    rope_scaling=None,
    # transformers' Phi3Config would give 1, 32000 and 32000 (Phi-3-mini's tokenizer);
    # `models.save` writes the tokenizer's where it has one.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  values.pop("head_dim")  # transformers' Phi-3 takes hidden / heads
  s = config.rope_scaling
  if s is not None:
    if s.kind != "longrope":
      raise ValueError(f"rope_scaling={s!r}: Phi-3's config.json writes LongRoPE only")
    values["rope_scaling"] = {
      "type": "longrope",
      "short_factor": list(s.factors),
      "long_factor": list(s.long_factors),
    }
    scale = config.context_length / s.original_max_position_embeddings
    default = config_json.longrope_attention_factor(scale, s.original_max_position_embeddings)
    if not math.isclose(s.attention_factor, default, rel_tol=1e-12):
      values["rope_scaling"]["attention_factor"] = s.attention_factor
  return values


def config_from_gguf(gguf_file, **overrides) -> Phi3Config:
  """The config of a phi3 GGUF file, as llama.cpp's converter writes it: LongRoPE's
  factors as the `rope_factors_long.weight` and `rope_factors_short.weight` tensors,
  with `rope.scaling.attn_factor` and `rope.scaling.original_context_length`. llama.cpp
  runs Phi-3 without its sliding window (`attention.sliding_window` is read and left),
  and so does the model loaded here."""
  f = gguf_file.arch_reader("phi3")
  dim, heads = f.int("embedding_length"), f.int("attention.head_count")
  head_dim = dim // heads
  rope_dim = int(f.get("rope.dimension_count", head_dim))
  f.get("attention.sliding_window")
  base = float(f.get("rope.freq_base", 10000.0))
  original = f.get("rope.scaling.original_context_length")
  gain = float(f.get("rope.scaling.attn_factor", 1.0))
  scaling = None
  if "rope_factors_long.weight" in gguf_file.tensor_types:
    if original is None:
      raise ValueError(
        f"phi3.rope.scaling.original_context_length is missing from {str(gguf_file.path)!r}: LongRoPE's "
        "factors (rope_factors_long.weight) switch at it"
      )
    factor = lambda name: tuple(float(x) for x in np.asarray(gguf_file.tensor(name), np.float64).reshape(-1))
    scaling = ring_nn.RopeScaling(
      "longrope",
      factors=factor("rope_factors_short.weight"),
      long_factors=factor("rope_factors_long.weight"),
      original_max_position_embeddings=int(original),
      attention_factor=gain,
    )
  elif gain != 1.0:
    raise ValueError(
      f"phi3.rope.scaling.attn_factor={gain} of {str(gguf_file.path)!r} without LongRoPE factors"
    )
  return Phi3Config(
    **llama.gguf_fields(f, gguf_file, head_dim, base, scaling),
    sliding_window=None,
    rope_dim=None if rope_dim == head_dim else rope_dim,
    **overrides,
  )


ARCHITECTURE = dataclasses.replace(
  llama.ARCHITECTURE,
  name="phi3",
  config_class=Phi3Config,
  model_class=Phi3,
  configs=CONFIGS,
  # transformers' Phi3Config: an epsilon of 1e-5 and no window where a file gives none.
  hf=HFFormat(
    ("phi3",),
    "Phi3ForCausalLM",
    HF_TENSORS,
    config_from_hf,
    hf_config,
    defaults={"rms_norm_eps": 1e-5},
    fused=HF_FUSED,
  ),
  gguf=GGUFFormat("phi3", GGUF_TENSORS, config_from_gguf, fused=GGUF_FUSED),
  ignored=llama.IGNORED + IGNORED,
)
