"""Tensor tables: a file's tensor name -> (the model's parameter path, how to read it).

The decoders share their parts' parameter paths (`PARAMS`) and, within a format, most
of the parts' file names (`HF_NAMES`, `GGUF_NAMES`); a family's table is `table(names,
parts, how)` with the names it renames. "{i}" is the layer. How to read a tensor:
"T" transposed (files store (out, in), nnx.Linear [in, out]); "Tq"/"Tk" transposed
after undoing llama.cpp's reordering of each query/key head's rows (its converter
pairs rotary dimensions (2i, 2i+1), Hugging Face's (i, i + H/2)); "+1" a Hugging Face
RMSNorm weight w applied as x * (1 + w) (the module holds 1 + w); "" as stored.
"""

from __future__ import annotations

_BLOCK = "blocks.{i}."
PARAMS = {
  "embed": "embed.embedding",
  "norm": "norm.scale",
  "head": "head.kernel",
  "attn_norm": _BLOCK + "attn_norm.scale",
  "query": _BLOCK + "attn.query.kernel",
  "key": _BLOCK + "attn.key.kernel",
  "value": _BLOCK + "attn.value.kernel",
  "query_bias": _BLOCK + "attn.query.bias",
  "key_bias": _BLOCK + "attn.key.bias",
  "value_bias": _BLOCK + "attn.value.bias",
  "query_norm": _BLOCK + "attn.query_norm.scale",
  "key_norm": _BLOCK + "attn.key_norm.scale",
  "out": _BLOCK + "attn.out.kernel",
  "post_attn_norm": _BLOCK + "post_attn_norm.scale",
  "mlp_norm": _BLOCK + "mlp_norm.scale",
  "gate": _BLOCK + "mlp.gate.kernel",
  "up": _BLOCK + "mlp.up.kernel",
  "down": _BLOCK + "mlp.down.kernel",
  "post_mlp_norm": _BLOCK + "post_mlp_norm.scale",
}

_HF_LAYER = "model.layers.{i}."
# Llama's names in transformers; the other families rename a few.
HF_NAMES = {
  "embed": "model.embed_tokens.weight",
  "norm": "model.norm.weight",
  "head": "lm_head.weight",
  "attn_norm": _HF_LAYER + "input_layernorm.weight",
  "query": _HF_LAYER + "self_attn.q_proj.weight",
  "key": _HF_LAYER + "self_attn.k_proj.weight",
  "value": _HF_LAYER + "self_attn.v_proj.weight",
  "query_bias": _HF_LAYER + "self_attn.q_proj.bias",
  "key_bias": _HF_LAYER + "self_attn.k_proj.bias",
  "value_bias": _HF_LAYER + "self_attn.v_proj.bias",
  "query_norm": _HF_LAYER + "self_attn.q_norm.weight",
  "key_norm": _HF_LAYER + "self_attn.k_norm.weight",
  "out": _HF_LAYER + "self_attn.o_proj.weight",
  "mlp_norm": _HF_LAYER + "post_attention_layernorm.weight",
  "gate": _HF_LAYER + "mlp.gate_proj.weight",
  "up": _HF_LAYER + "mlp.up_proj.weight",
  "down": _HF_LAYER + "mlp.down_proj.weight",
}
# llama.cpp's names (gguf-py's tensor_mapping).
GGUF_NAMES = {
  "embed": "token_embd.weight",
  "norm": "output_norm.weight",
  "head": "output.weight",
  "attn_norm": "blk.{i}.attn_norm.weight",
  "query": "blk.{i}.attn_q.weight",
  "key": "blk.{i}.attn_k.weight",
  "value": "blk.{i}.attn_v.weight",
  "query_bias": "blk.{i}.attn_q.bias",
  "key_bias": "blk.{i}.attn_k.bias",
  "value_bias": "blk.{i}.attn_v.bias",
  "query_norm": "blk.{i}.attn_q_norm.weight",
  "key_norm": "blk.{i}.attn_k_norm.weight",
  "out": "blk.{i}.attn_output.weight",
  "post_attn_norm": "blk.{i}.post_attention_norm.weight",
  "mlp_norm": "blk.{i}.ffn_norm.weight",
  "gate": "blk.{i}.ffn_gate.weight",
  "up": "blk.{i}.ffn_up.weight",
  "down": "blk.{i}.ffn_down.weight",
  "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}
LLAMA_PARTS = (
  "embed",
  "norm",
  "head",
  "attn_norm",
  "query",
  "key",
  "value",
  "out",
  "mlp_norm",
  "gate",
  "up",
  "down",
)
QK_NORMS = ("query_norm", "key_norm")
QKV_BIASES = ("query_bias", "key_bias", "value_bias")


def table(names: dict, parts, how: dict | None = None) -> dict:
  """The table of `parts` under their file `names`: kernels read "T" and the rest as
  stored, unless `how` says otherwise for a part."""
  how = how or {}
  return {names[p]: (PARAMS[p], how.get(p, "T" if PARAMS[p].endswith(".kernel") else "")) for p in parts}
