"""config.json as every transformers version from 4.45 to 5.x writes it, for each
architecture `models.load` reads, and the published checkpoints' own files: each loads,
and its logits equal the float64 NumPy forward (tests/numpy_models.py) run on the
config as transformers reads it (`as_transformers_reads`, written here from
transformers' configuration classes, apart from the loader). The files are in
tests/data/transformers_configs/ (see its make.py: written by each version's own
`save_pretrained`; the releases' files shrunk to small layers). What a version adds:
`layer_types` (4.53), `_sliding_window_pattern` (4.54), `dtype` (4.56),
`use_bidirectional_attention` (4.57), `rope_parameters` (5.0). Keys that would change
the computation and are not applied are refused, naming them."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import rel_err
from numpy_models import gemma3_logits, llama_logits, olmo2_logits, phi3_logits
from test_checkpoints import F64_TOL, _weights, write_folder

from jax_ring import models

ROOT = Path(__file__).parent / "data" / "transformers_configs"
FILES = sorted(p for p in ROOT.glob("*/*.json"))
VERSIONS = sorted({p.parent.name for p in FILES if p.parent.name != "releases"})

# transformers' defaults for the keys a file may leave out (its configuration classes).
DEFAULTS = {
  "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
  "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=4096),
  "olmo2": dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
  "phi3": dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None),
  "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
  "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, head_dim=128),
  "qwen3_moe": dict(
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
  ),
  "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None),
  "gemma3_text": dict(
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    tie_word_embeddings=True,
    sliding_window=4096,
  ),
}


def as_transformers_reads(config: dict) -> dict:
  """The keys numpy_models reads, with the values transformers' config classes give
  them: rope_parameters (5.x; Gemma: per layer type) or rope_theta / rope_scaling /
  rope_local_base_freq (4.x); Gemma's layer_types, or else every
  `sliding_window_pattern`-th layer global (6 when absent; `_sliding_window_pattern` is
  an attribute transformers writes and never reads back)."""
  kind = config["model_type"]
  out = DEFAULTS[kind] | config
  out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
  params = config.get("rope_parameters")
  default = lambda p: None if p.get("rope_type", "default") == "default" else p
  if kind == "gemma3_text":
    if params is not None:
      full, local = params["full_attention"], params["sliding_attention"]
      out["rope_theta"], out["rope_scaling"] = full["rope_theta"], default(full)
      out["rope_local_base_freq"] = local["rope_theta"]
    if "layer_types" not in config:
      period = config.get("sliding_window_pattern", 6)
      layers = range(out["num_hidden_layers"])
      out["layer_types"] = ["sliding_attention" if (i + 1) % period else "full_attention" for i in layers]
  elif params is not None:
    out["rope_theta"], out["rope_scaling"] = params["rope_theta"], default(params)
  if kind == "qwen3_moe":  # 5.24 writes num_local_experts; its config class reads either
    out["num_experts"] = out.get("num_experts") or out["num_local_experts"]
  return out


def _case(path: Path) -> tuple[dict, dict]:
  config = json.loads(path.read_text())
  reads = as_transformers_reads(config)
  return config, reads


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """file -> (folder with the file as config.json and random weights, the weights,
  the config as transformers reads it)."""
  out = {}
  for i, path in enumerate(FILES):
    config, reads = _case(path)
    w = _weights(reads, seed=i)
    folder = write_folder(tmp_path_factory.mktemp(path.stem) / "model", config, w)
    out[path] = (folder, w, reads)
  return out


def _numpy_logits(w, reads, tokens):
  match reads["model_type"]:
    case "gemma3_text":
      return gemma3_logits(w, reads, tokens)
    case "qwen3" | "qwen3_moe":
      return llama_logits(w, reads, tokens, qk_norm=True)
    case "qwen2":
      return llama_logits(w, reads, tokens, qkv_bias=True)
    case "mistral":
      return llama_logits(w, reads, tokens, window=reads["sliding_window"])
    case "olmo2":
      return olmo2_logits(w, reads, tokens)
    case "phi3":
      return phi3_logits(w, reads, tokens)
  return llama_logits(w, reads, tokens)


def test_every_version_and_architecture_is_here():
  """4.45 to 5.x (the versions whose config.json differ), each architecture from the
  version that added it (OLMo 2: 4.47, Gemma 3: 4.50, Qwen 3 and Qwen3-MoE: 4.51;
  Mistral, Mixtral, Phi-3 and Qwen 2.5 in every one), and the releases' files."""
  assert VERSIONS == ["4.45.2", "4.50.3", "4.51.3", "4.53.3", "4.55.4", "4.56.2", "4.57.6", "5.0.0", "5.24.0"]
  names = {v: sorted(p.stem for p in FILES if p.parent.name == v) for v in VERSIONS}
  every = ["gemma3", "gemma3-variant", "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen3"]
  every.append("qwen3_moe")
  assert names["4.45.2"] == ["llama", "mistral", "mixtral", "phi3", "qwen2"]
  assert names["4.50.3"] == [n for n in every if not n.startswith("qwen3")]
  assert all(names[v] == every for v in VERSIONS[2:])
  releases = sorted(p.stem for p in FILES if p.parent.name == "releases")
  assert releases == [
    *("gemma-3-1b", "gemma-3-270m", "llama-3.1-8b", "llama-3.2-1b", "mistral-7b-v0.3", "mistral-nemo-12b"),
    *("olmo-2-7b", "phi-3-mini-4k", "phi-4-mini", "qwen2.5-0.5b", "qwen2.5-7b-instruct-1m", "qwen3-0.6b"),
  ]
  keys = lambda v, name: set(json.loads((ROOT / v / f"{name}.json").read_text()))
  assert "layer_types" in keys("4.53.3", "qwen3") and "layer_types" not in keys("4.51.3", "qwen3")
  assert "_sliding_window_pattern" in keys("4.55.4", "gemma3")
  assert "dtype" in keys("4.56.2", "llama") and "torch_dtype" in keys("4.55.4", "llama")
  assert "use_bidirectional_attention" in keys("4.57.6", "gemma3")
  assert "rope_parameters" in keys("5.0.0", "llama") and "rope_theta" not in keys("5.24.0", "gemma3")
  # 5.24's Qwen3-MoE writes the count of experts under Mixtral's name.
  assert "num_experts" in keys("5.0.0", "qwen3_moe") and "num_local_experts" in keys("5.24.0", "qwen3_moe")


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_written_config_loads_with_the_logits_transformers_would_give(written, path):
  folder, w, reads = written[path]
  model, _ = models.load(folder, attention="dense")
  tokens = np.random.default_rng(0).integers(0, reads["vocab_size"], (1, 24)).astype(np.int32)
  assert rel_err(model(tokens)[0], _numpy_logits(w, reads, tokens[0])) < F64_TOL
  cfg = model.config
  assert (cfg.num_layers, cfg.head_dim, cfg.norm_eps) == (
    reads["num_hidden_layers"],
    reads["head_dim"],
    reads["rms_norm_eps"],
  )
  if reads["model_type"] == "gemma3_text":
    expected = [t == "full_attention" for t in reads["layer_types"]]
    assert [cfg.is_global(i) for i in range(cfg.num_layers)] == expected


# --- Keys that change the computation and are not applied: refused, named. ---

YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
LLAMA3 = dict(
  rope_type="llama3",
  factor=4.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=8,
)
BAD = [
  ("5.24.0/gemma3.json", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
  ("4.57.6/qwen3.json", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True"),
  ("4.53.3/qwen3.json", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
  ("4.55.4/gemma3.json", {"layer_types": ["sliding_attention"] * 6}, "layer_types="),
  ("4.55.4/gemma3.json", {"sliding_window_pattern": 2}, "sliding_window_pattern=2"),
  ("4.55.4/gemma3.json", {"layer_types": ["full_attention", "sliding_attention"] * 3}, "layer_types="),
  ("5.24.0/llama.json", {"rope_parameters": YARN}, "'yarn'"),
  ("4.45.2/llama.json", {"attention_bias": True}, "attention_bias=True"),
  ("4.56.2/llama.json", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
  ("4.57.6/qwen2.json", {"use_sliding_window": True}, "use_sliding_window=True"),
  ("releases/qwen2.5-0.5b.json", {"use_mrope": True}, "use_mrope=True"),
  ("5.24.0/mistral.json", {"layer_types": ["full_attention"] * 2}, "layer_types="),
  ("4.57.6/olmo2.json", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
  ("releases/phi-4-mini.json", {"full_attn_mod": 2}, "full_attn_mod=2"),
  ("5.24.0/phi3.json", {"embd_pdrop": 0.1}, "embd_pdrop=0.1"),
  # transformers' Phi-3 takes LongRoPE alone: the refusal names it, whatever else is asked.
  (
    "4.45.2/phi3.json",
    {"rope_scaling": {"type": "yarn", "factor": 2.0}},
    "'yarn' is not one Phi-3 takes (supported: 'default', 'longrope'",
  ),
  (
    "4.57.6/phi3.json",
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "'linear' is not one Phi-3 takes",
  ),
  ("5.24.0/phi3.json", {"rope_parameters": dict(LLAMA3, rope_theta=1e4)}, "'llama3' is not one Phi-3 takes"),
  ("5.24.0/qwen3_moe.json", {"num_experts": 8}, "num_experts and num_local_experts differ"),
]


@pytest.mark.parametrize("name, change, named", BAD, ids=[b[2] for b in BAD])
def test_keys_that_are_not_applied_are_refused_by_name(written, name, change, named, tmp_path):
  path = ROOT / name
  folder, w, _ = written[path]
  config = json.loads(path.read_text()) | change
  with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
    models.load(write_folder(tmp_path / "bad", config, w), attention="dense")


def test_qwen2_dual_chunk_attention_is_said_and_exact_attention_runs(written, tmp_path):
  """vLLM's dual_chunk_attention_config (extrapolation past a Qwen 2.5-1M model's
  training length), which transformers does not read: a warning names it, and the
  logits are those of exact attention, as without it."""
  path = ROOT / "releases" / "qwen2.5-7b-instruct-1m.json"
  folder, w, reads = written[path]
  dca = {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144}
  config = json.loads(path.read_text()) | {"dual_chunk_attention_config": dca}
  with pytest.warns(UserWarning, match="dual_chunk_attention_config"):
    model, _ = models.load(write_folder(tmp_path / "dca", config, w), attention="dense")
  tokens = np.random.default_rng(0).integers(0, reads["vocab_size"], (1, 24)).astype(np.int32)
  assert rel_err(model(tokens)[0], _numpy_logits(w, reads, tokens[0])) < F64_TOL


def test_mistral_without_sliding_window_has_transformers_default_window(written, tmp_path):
  """A Mistral config.json that leaves `sliding_window` out (save_pretrained drops a value
  equal to the class's default) gets transformers' 4,096; null is no window."""
  path = ROOT / "4.57.6" / "mistral.json"
  folder, w, _ = written[path]
  config = json.loads(path.read_text())
  del config["sliding_window"]
  model, _ = models.load(write_folder(tmp_path / "absent", config, w), attention="dense")
  assert model.config.sliding_window == 4096
  model, _ = models.load(
    write_folder(tmp_path / "null", config | {"sliding_window": None}, w), attention="dense"
  )
  assert model.config.sliding_window is None


def test_dtype_and_torch_dtype_and_a_null_pad_token_are_harmless(written, tmp_path):
  path = ROOT / "4.56.2" / "llama.json"
  folder, w, _ = written[path]
  config = json.loads(path.read_text()) | {"torch_dtype": "bfloat16", "pad_token_id": None}
  model, _ = models.load(write_folder(tmp_path / "both", config, w), attention="dense")
  assert model.config.vocab_size == 96
