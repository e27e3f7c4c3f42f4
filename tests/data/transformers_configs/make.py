"""Writes the config.json that an installed transformers version's `save_pretrained`
writes for the tests' small Llama 3, Mistral, Qwen 2.5, Qwen 3, OLMo 2, Phi-3 and Gemma 3
configs, and Mixtral's and Qwen3-MoE's (tests/test_config_vintages.py), into a folder
named after the version:

    python -m venv /tmp/tf && /tmp/tf/bin/pip install transformers==4.55.4
    /tmp/tf/bin/python tests/data/transformers_configs/make.py tests/data/transformers_configs
    python tests/data/transformers_configs/make.py tests/data/transformers_configs --releases

No torch is needed: only the configuration classes are used. The files in this folder
were written so by transformers 4.45.2, 4.50.3, 4.51.3, 4.53.3, 4.55.4, 4.56.2, 4.57.6,
5.0.0 and 5.24.0 (OLMo 2 from 4.47, Gemma 3 from 4.50, Qwen 3 and Qwen3-MoE from 4.51;
Qwen 2.5's, Mistral's, Phi-3's and Mixtral's in every one; 4.45.2's Phi-3 has no partial
rotary factor).
`releases/` holds the published checkpoints' own config.json files, shrunk to a few
small layers by `shrink` below.
"""

import json
import os
import sys
import tempfile

import transformers

V5 = int(transformers.__version__.split(".")[0]) >= 5
COMMON = dict(
  vocab_size=96,
  hidden_size=64,
  intermediate_size=96,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=256,
  bos_token_id=0,
  eos_token_id=1,
)
LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3["original_max_position_embeddings"] = 64


def _version() -> tuple[int, int]:
  major, minor = transformers.__version__.split(".")[:2]
  return int(major), int(minor)


def dtype(name: str) -> dict:
  return {"dtype": name} if _version() >= (4, 56) else {"torch_dtype": name}


def rope(theta, scaling) -> dict:
  if V5:
    return dict(rope_parameters=dict(scaling or {"rope_type": "default"}, rope_theta=theta))
  return dict(rope_theta=theta, rope_scaling=scaling)


def gemma_rope(full, local, scaling) -> dict:
  if V5:
    return dict(
      rope_parameters={
        "full_attention": dict(scaling or {"rope_type": "default"}, rope_theta=full),
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
      }
    )
  return dict(rope_theta=full, rope_local_base_freq=local, rope_scaling=scaling)


def save(config, folder: str, name: str) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    config.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
      text = f.read()
  with open(os.path.join(folder, f"{name}.json"), "w") as f:
    f.write(text)


# The published checkpoints' config.json files, as on the Hugging Face Hub (values
# cross-checked against copies of them in public code), each with the transformers
# version that wrote it: meta-llama/Llama-3.1-8B (4.43.0.dev0), meta-llama/Llama-3.2-1B
# (4.45.0.dev0), Qwen/Qwen3-0.6B (4.51.0), google/gemma-3-1b-pt (4.50.0.dev0),
# google/gemma-3-270m (4.55.0.dev0), Qwen/Qwen2.5-0.5B (4.40.1),
# Qwen/Qwen2.5-7B-Instruct-1M (4.47.1), mistralai/Mistral-7B-v0.3 (4.42.0.dev0),
# mistralai/Mistral-Nemo-Base-2407 (4.43.0.dev0), allenai/OLMo-2-1124-7B (as copies of it
# list its keys), microsoft/Phi-4-mini-instruct (4.45.0) and
# microsoft/Phi-3-mini-4k-instruct (4.40.2).
_LLAMA3_1 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA = dict(
  architectures=["LlamaForCausalLM"],
  attention_bias=False,
  attention_dropout=0.0,
  bos_token_id=128000,
  eos_token_id=128001,
  hidden_act="silu",
  initializer_range=0.02,
  max_position_embeddings=131072,
  mlp_bias=False,
  model_type="llama",
  pretraining_tp=1,
  rms_norm_eps=1e-05,
  rope_theta=500000.0,
  torch_dtype="bfloat16",
  use_cache=True,
  vocab_size=128256,
)
_GEMMA = dict(
  architectures=["Gemma3ForCausalLM"],
  attention_bias=False,
  attention_dropout=0.0,
  attn_logit_softcapping=None,
  bos_token_id=2,
  eos_token_id=1,
  final_logit_softcapping=None,
  head_dim=256,
  hidden_activation="gelu_pytorch_tanh",
  initializer_range=0.02,
  max_position_embeddings=32768,
  model_type="gemma3_text",
  num_attention_heads=4,
  num_key_value_heads=1,
  pad_token_id=0,
  query_pre_attn_scalar=256,
  rms_norm_eps=1e-06,
  rope_scaling=None,
  sliding_window=512,
  torch_dtype="bfloat16",
  use_cache=True,
  vocab_size=262144,
)
_PHI4_LONG = [
  1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
  2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
  5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
  14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
  32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
  47.77,
]  # fmt: skip
_PHI3 = dict(
  architectures=["Phi3ForCausalLM"],
  attention_dropout=0.0,
  embd_pdrop=0.0,
  hidden_act="silu",
  hidden_size=3072,
  initializer_range=0.02,
  intermediate_size=8192,
  model_type="phi3",
  num_hidden_layers=32,
  original_max_position_embeddings=4096,
  resid_pdrop=0.0,
  rms_norm_eps=1e-05,
  rope_theta=10000.0,
  torch_dtype="bfloat16",
  use_cache=True,
)
RELEASES = {
  "llama-3.1-8b": _LLAMA
  | dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_hidden_layers=32,
    num_key_value_heads=8,
    rope_scaling=dict(_LLAMA3_1, rope_type="llama3"),
    tie_word_embeddings=False,
    transformers_version="4.43.0.dev0",
  ),
  "llama-3.2-1b": _LLAMA
  | dict(
    head_dim=64,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_hidden_layers=16,
    num_key_value_heads=8,
    rope_scaling=dict(_LLAMA3_1, factor=32.0, rope_type="llama3"),
    tie_word_embeddings=True,
    transformers_version="4.45.0.dev0",
  ),
  "mistral-7b-v0.3": dict(
    architectures=["MistralForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=14336,
    max_position_embeddings=32768,
    model_type="mistral",
    num_attention_heads=32,
    num_hidden_layers=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-05,
    rope_theta=1000000.0,
    sliding_window=None,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.42.0.dev0",
    use_cache=True,
    vocab_size=32768,
  ),
  "mistral-nemo-12b": dict(
    architectures=["MistralForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    head_dim=128,
    hidden_act="silu",
    hidden_size=5120,
    initializer_range=0.02,
    intermediate_size=14336,
    max_position_embeddings=1024000,
    model_type="mistral",
    num_attention_heads=32,
    num_hidden_layers=40,
    num_key_value_heads=8,
    rms_norm_eps=1e-05,
    rope_theta=1000000.0,
    sliding_window=None,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.43.0.dev0",
    use_cache=True,
    vocab_size=131072,
  ),
  "qwen2.5-0.5b": dict(
    architectures=["Qwen2ForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151643,
    hidden_act="silu",
    hidden_size=896,
    initializer_range=0.02,
    intermediate_size=4864,
    max_position_embeddings=32768,
    max_window_layers=24,
    model_type="qwen2",
    num_attention_heads=14,
    num_hidden_layers=24,
    num_key_value_heads=2,
    rms_norm_eps=1e-06,
    rope_theta=1000000.0,
    sliding_window=32768,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.40.1",
    use_cache=True,
    use_mrope=False,
    use_sliding_window=False,
    vocab_size=151936,
  ),
  "qwen2.5-7b-instruct-1m": dict(
    architectures=["Qwen2ForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    hidden_act="silu",
    hidden_size=3584,
    initializer_range=0.02,
    intermediate_size=18944,
    max_position_embeddings=1010000,
    max_window_layers=28,
    model_type="qwen2",
    num_attention_heads=28,
    num_hidden_layers=28,
    num_key_value_heads=4,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    rope_theta=10000000.0,
    sliding_window=32768,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.47.1",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=152064,
  ),
  "qwen3-0.6b": dict(
    architectures=["Qwen3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    hidden_size=1024,
    initializer_range=0.02,
    intermediate_size=3072,
    max_position_embeddings=40960,
    max_window_layers=28,
    model_type="qwen3",
    num_attention_heads=16,
    num_hidden_layers=28,
    num_key_value_heads=8,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=None,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    transformers_version="4.51.0",
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
  ),
  "olmo-2-7b": dict(
    architectures=["Olmo2ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    eos_token_id=100257,
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=11008,
    max_position_embeddings=4096,
    model_type="olmo2",
    num_attention_heads=32,
    num_hidden_layers=32,
    num_key_value_heads=32,
    pad_token_id=100277,
    rms_norm_eps=1e-06,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    use_cache=True,
    vocab_size=100352,
  ),
  "phi-4-mini": _PHI3
  | dict(
    attention_bias=False,
    auto_map={
      "AutoConfig": "configuration_phi3.Phi3Config",
      "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
      "AutoTokenizer": "Xenova/gpt-4o",
    },
    bos_token_id=199999,
    eos_token_id=200020,
    full_attn_mod=1,
    interpolate_factor=1,
    lm_head_bias=False,
    max_position_embeddings=131072,
    mlp_bias=False,
    num_attention_heads=24,
    num_key_value_heads=8,
    pad_token_id=199999,
    partial_rotary_factor=0.75,
    rope_scaling=dict(long_factor=_PHI4_LONG, short_factor=[1.0] * 48, type="longrope"),
    sliding_window=262144,
    tie_word_embeddings=True,
    transformers_version="4.45.0",
    vocab_size=200064,
  ),
  "phi-3-mini-4k": _PHI3
  | dict(
    auto_map={
      "AutoConfig": "configuration_phi3.Phi3Config",
      "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
    },
    bos_token_id=1,
    eos_token_id=32000,
    max_position_embeddings=4096,
    num_attention_heads=32,
    num_key_value_heads=32,
    pad_token_id=32000,
    rope_scaling=None,
    sliding_window=2047,
    tie_word_embeddings=False,
    transformers_version="4.40.2",
    vocab_size=32064,
  ),
  "gemma-3-1b": _GEMMA
  | dict(
    cache_implementation="hybrid",
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    rope_local_base_freq=10000,
    rope_theta=1000000,
    sliding_window_pattern=6,
    transformers_version="4.50.0.dev0",
  ),
  "gemma-3-270m": _GEMMA
  | dict(
    _sliding_window_pattern=6,
    hidden_size=640,
    intermediate_size=2048,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    num_hidden_layers=18,
    rope_local_base_freq=10000.0,
    rope_theta=1000000.0,
    transformers_version="4.55.0.dev0",
    use_bidirectional_attention=False,
  ),
}


def shrink(config: dict) -> dict:
  """A release's config with small layers: 96 tokens, width 64 (48 with Qwen's explicit
  head_dim), 4 query and 2 kv heads of 16, 2 layers (Gemma: 6, its first global layer
  included, and a window of 8). Every other key, and the shrunk keys' types, as released."""
  out = dict(config)
  gemma = config["model_type"] == "gemma3_text"
  out |= dict(vocab_size=96, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
  narrow = config["model_type"] == "qwen3" or (config["model_type"] == "mistral" and "head_dim" in config)
  out["hidden_size"] = 48 if narrow else 64
  out["num_hidden_layers"] = 6 if gemma else 2
  if "head_dim" in config:
    out["head_dim"] = 16
  if "layer_types" in config:
    out["layer_types"] = config["layer_types"][:6]
  if "max_window_layers" in config:
    out["max_window_layers"] = 2
  if gemma:
    out["sliding_window"] = 8
    out["query_pre_attn_scalar"] = 16
  scaling = config.get("rope_scaling") or {}
  if "long_factor" in scaling:  # Phi-4-mini: 6 of its 48 LongRoPE frequencies (12 of 16 dimensions rotate)
    out["rope_scaling"] = dict(
      scaling, long_factor=scaling["long_factor"][::8], short_factor=scaling["short_factor"][::8]
    )
  return out


def write_releases(root: str) -> None:
  folder = os.path.join(root, "releases")
  os.makedirs(folder, exist_ok=True)
  for name, config in RELEASES.items():
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
      json.dump(shrink(config), f, indent=2, sort_keys=True)


def main(root: str) -> None:
  folder = os.path.join(root, transformers.__version__)
  os.makedirs(folder, exist_ok=True)
  options = dict(num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
  llama = transformers.LlamaConfig(**COMMON, **options, **rope(10000.0, LLAMA3), **dtype("float32"))
  save(llama, folder, "llama")
  qwen2 = transformers.Qwen2Config(
    **COMMON,
    num_hidden_layers=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_window_layers=2,
    **rope(1_000_000.0, None),
    **dtype("bfloat16"),
  )
  save(qwen2, folder, "qwen2")
  mistral = transformers.MistralConfig(
    **(COMMON | dict(hidden_size=48)),
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    sliding_window=8,
    tie_word_embeddings=False,
    **(rope(1_000_000.0, None) if V5 else dict(rope_theta=1_000_000.0)),  # 4.x's Mistral: no rope_scaling
    **dtype("bfloat16"),
  )
  save(mistral, folder, "mistral")
  partial = "partial_rotary_factor" in transformers.Phi3Config().to_dict() or V5
  half = 4 if partial else 8  # rotary frequencies: 8 of 16 dimensions rotate, or all 16
  phi3 = transformers.Phi3Config(
    **{k: v for k, v in COMMON.items() if k != "head_dim"},  # Phi-3's config has no head_dim
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    original_max_position_embeddings=16,
    sliding_window=20,
    rope_theta=10000.0,
    rope_scaling={
      "type": "longrope",
      "short_factor": [1.0, 1.25] * (half // 2),
      "long_factor": [2.0, 5.0] * (half // 2),
    },
    pad_token_id=None,
    **(dict(partial_rotary_factor=0.5) if partial else {}),
    **dtype("bfloat16"),
  )
  save(phi3, folder, "phi3")
  if hasattr(transformers, "Olmo2Config"):
    olmo2 = transformers.Olmo2Config(
      **{k: v for k, v in COMMON.items() if k != "head_dim"},  # OLMo 2's config has no head_dim
      num_hidden_layers=2,
      rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      **rope(500_000.0, None),
      **dtype("float32"),
    )
    save(olmo2, folder, "olmo2")
  if hasattr(transformers, "Qwen3Config"):
    qwen = transformers.Qwen3Config(
      **(COMMON | dict(hidden_size=48)),
      num_hidden_layers=2,
      rms_norm_eps=1e-5,  # not the 1e-6 default: the q/k norms must read it
      tie_word_embeddings=True,
      max_window_layers=2,
      **rope(1_000_000.0, None),
      **dtype("bfloat16"),
    )
    save(qwen, folder, "qwen3")
  if hasattr(transformers, "Gemma3TextConfig"):
    layers = _version() >= (4, 53)  # layer_types from 4.53, the period before
    gemma = transformers.Gemma3TextConfig(
      **COMMON,
      num_hidden_layers=6,
      sliding_window=8,
      query_pre_attn_scalar=16,
      rms_norm_eps=1e-6,
      **gemma_rope(100000.0, 10000.0, {"rope_type": "linear", "factor": 4.0}),
      **dtype("bfloat16"),
    )
    save(gemma, folder, "gemma3")
    pattern = dict(sliding_window_pattern=2)
    if layers:
      pattern = dict(layer_types=["sliding_attention", "full_attention"] * 2)
    variant = transformers.Gemma3TextConfig(
      **COMMON,
      num_hidden_layers=4,
      sliding_window=8,
      query_pre_attn_scalar=24,
      rms_norm_eps=1e-6,
      **pattern,
      **gemma_rope(1_000_000.0, 1000.0, None),
      **dtype("float32"),
    )
    save(variant, folder, "gemma3-variant")
  experts = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)
  mixtral = transformers.MixtralConfig(
    **COMMON,
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    num_local_experts=4,
    tie_word_embeddings=False,
    **(rope(1_000_000.0, None) if V5 else dict(rope_theta=1_000_000.0)),
    **experts,
    **dtype("bfloat16"),
  )
  save(mixtral, folder, "mixtral")
  if hasattr(transformers, "Qwen3MoeConfig"):
    qwen_moe = transformers.Qwen3MoeConfig(
      **(COMMON | dict(hidden_size=48)),
      num_hidden_layers=3,
      rms_norm_eps=1e-5,  # not Qwen 3's 1e-6 default: the q/k norms must read it
      tie_word_embeddings=False,
      max_window_layers=3,
      num_experts=4,
      moe_intermediate_size=32,
      norm_topk_prob=False,
      decoder_sparse_step=1,
      mlp_only_layers=[1],
      **rope(1_000_000.0, None),
      **experts,
      **dtype("bfloat16"),
    )
    save(qwen_moe, folder, "qwen3_moe")
  print(transformers.__version__, sorted(os.listdir(folder)))


if __name__ == "__main__":
  write_releases(sys.argv[1]) if sys.argv[2:] == ["--releases"] else main(sys.argv[1])
