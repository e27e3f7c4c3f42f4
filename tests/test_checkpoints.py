"""Llama 3, Qwen 3 and Gemma 3 checkpoints the tests write themselves, small and random,
as Hugging Face folders (safetensors' own NumPy writer; config.json as transformers
4.x and 5.x write it; one file and shards with their index) and as GGUF files (the gguf
package's writer, with llama.cpp's tensor names and reorderings written out here):
every loader equals an independent float64 NumPy forward (tests/numpy_models.py), the
ring equals dense (each architecture on two of 1, 2, 4 and 8 devices, every count
running two or more: `conftest.crossed`), saving and loading back is exact, the
tokenizers equal tokenizers built apart from the loader, and bad files and inputs are
ValueErrors that name them."""

import dataclasses
import json
import math
from pathlib import Path

import gguf  # noqa: E402  - installed by the test command (the [models] extra): missing is an error
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import crossed, make_mesh, rel_err
from flax import nnx
from numpy_models import gemma3_logits, inv_frequencies, llama_logits, olmo2_logits, phi3_logits
from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers import models as tok_models  # noqa: E402

from jax_ring import models

# 40 tokens: past the Gemma checkpoint's 8-token window; not a multiple of 8 devices.
LENGTH = 40
# float32 through the small models against float64: measured 1.5e-7 to 3.0e-7 of the
# logits here and for every file of tests/test_config_vintages.py; Qwen 3's qk-norm epsilon
# at 1e-5 instead of its config's 1e-6 moves them by 7.1e-6, which 1e-5 let through.
F64_TOL, RING_TOL = 1e-6, 1e-5

LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
  "The pass key is 48213. Remember it, and don't forget it!",
  "def f(x):\n    return x ** 2  # square\n\n\tif x:  pass",
  "Café naïve façade: ÀÉÎÕÜ ß ø å. 日本語のテキスト 🙂",
  "numbers 0123456789 3.14159 -42 1e-6; the the the then there",
] * 4
TEXTS = CORPUS[:4] + ["unseen words: zebra quokka 7777777", "  spaces   and\ttabs\n\n"]


# --- A byte-level BPE vocabulary (Llama 3 and Qwen's kind), trained here. ---


def train_bpe(pattern, nfc):
  """The test's own tokenizer: a BPE trained on CORPUS with the model's pre-tokenizer."""
  tok = Tokenizer(tok_models.BPE())
  if nfc:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  if not nfc:  # Llama 3's tokenizer.json: BOS before every text (Qwen's adds none)
    tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
  trainer = trainers.BpeTrainer(
    vocab_size=330,
    special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(CORPUS, trainer)
  if nfc:
    return tok
  # Llama 3's BPE takes a pre-token found whole in the vocabulary as it is, before any
  # merge ("ignore_merges": true in its tokenizer.json; llama.cpp's llama-bpe does the
  # same). A word no merge reaches tells it apart: " quokka" (in TEXTS) is one token.
  spec = json.loads(tok.to_str())
  spec["model"]["ignore_merges"] = True
  spec["model"]["vocab"]["\u0120quokka"] = len(spec["model"]["vocab"])
  return Tokenizer.from_str(json.dumps(spec))


def bpe_tables(tok):
  spec = json.loads(tok.to_str())["model"]
  vocab = tok.get_vocab(with_added_tokens=True)
  tokens = [None] * len(vocab)
  for piece, i in vocab.items():
    tokens[i] = piece
  merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
  types = [3 if t.startswith("<|") else 1 for t in tokens]
  return tokens, merges, types


# --- A SentencePiece vocabulary (Gemma's kind), written out. ---

SP_NORMAL = list("\u2581abcdefghijklmnopqrstuvwxyzTP.,:!") + ["\u2581t", "he", "\u2581the", "\u2581a", "in"]
SP_PIECES = (
  ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_NORMAL + ["  ", "   "]
)
SP_TYPES = [3, 3, 3, 2] + [6] * 256 + [1] * len(SP_NORMAL) + [4, 4]
SP_SCORES = (
  [0.0] * 260 + [-float(i) for i in range(len(SP_NORMAL) - 5)] + [5.0, 4.0, 6.0, 3.0, 2.0] + [0.0, 0.0]
)


# --- The checkpoints. ---


def _config(arch, vocab):
  common = dict(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    torch_dtype="float32",
    bos_token_id=0,
    eos_token_id=1,
  )
  if arch == "llama":
    scaling = dict(
      rope_type="llama3",
      factor=4.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=64,
    )
    return common | dict(
      model_type="llama",
      architectures=["LlamaForCausalLM"],
      num_hidden_layers=2,
      rope_theta=10000.0,
      rope_scaling=scaling,
      rms_norm_eps=1e-5,
      hidden_act="silu",
      attention_bias=False,
      mlp_bias=False,
      tie_word_embeddings=False,
    )
  if arch == "mistral":  # Mistral-Nemo's kind: head_dim 16 apart from hidden / heads; a window
    return common | dict(
      model_type="mistral",
      architectures=["MistralForCausalLM"],
      hidden_size=48,
      num_hidden_layers=2,
      rope_theta=1_000_000.0,
      rms_norm_eps=1e-5,
      hidden_act="silu",
      attention_dropout=0.0,
      sliding_window=8,
      tie_word_embeddings=False,
    )
  if arch == "phi3":  # Phi-4-mini's kind: partial rotary, LongRoPE (long factors at 40 tokens), a window
    config = {k: v for k, v in common.items() if k != "head_dim"}  # Phi-3's config has no head_dim
    return config | dict(
      model_type="phi3",
      architectures=["Phi3ForCausalLM"],
      num_hidden_layers=2,
      rope_theta=10000.0,
      partial_rotary_factor=0.5,
      original_max_position_embeddings=16,
      rope_scaling=dict(
        type="longrope", short_factor=[1.0, 1.2, 1.5, 2.5], long_factor=[1.0, 3.0, 7.0, 16.0]
      ),
      rms_norm_eps=1e-5,
      hidden_act="silu",
      attention_bias=False,
      attention_dropout=0.0,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      sliding_window=24,
      tie_word_embeddings=False,
    )
  if arch == "olmo2":
    return common | dict(
      model_type="olmo2",
      architectures=["Olmo2ForCausalLM"],
      num_hidden_layers=2,
      rope_theta=500_000.0,
      rope_scaling=None,
      rms_norm_eps=1e-6,
      hidden_act="silu",
      attention_bias=False,
      attention_dropout=0.0,
      tie_word_embeddings=False,
    )
  if arch == "qwen2":
    return common | dict(
      model_type="qwen2",
      architectures=["Qwen2ForCausalLM"],
      num_hidden_layers=3,
      rope_theta=1_000_000.0,
      rope_scaling=None,
      rms_norm_eps=1e-6,
      hidden_act="silu",
      attention_dropout=0.0,
      use_sliding_window=False,  # as every released Qwen 2.5 config: a window it does not use
      sliding_window=131072,
      max_window_layers=21,
      tie_word_embeddings=False,
    )
  if arch == "qwen3":
    return common | dict(
      model_type="qwen3",
      architectures=["Qwen3ForCausalLM"],
      hidden_size=48,  # head_dim 16 is not hidden_size / heads
      num_hidden_layers=2,
      rope_theta=1_000_000.0,
      rope_scaling=None,
      rms_norm_eps=1e-6,
      hidden_act="silu",
      attention_bias=False,
      use_sliding_window=False,
      sliding_window=None,
      max_window_layers=2,
      tie_word_embeddings=True,
    )
  # What llama.cpp's GGUF can say of Gemma 3: every 6th layer global, windowed layers at
  # base 10,000, logits scaled by head_dim^-1/2 (GEMMA_VARIANT changes all three).
  return common | dict(
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    num_hidden_layers=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    sliding_window=8,
    rope_theta=100000.0,
    rope_local_base_freq=10000.0,
    rope_scaling=dict(rope_type="linear", factor=4.0),
    query_pre_attn_scalar=16,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
  )


def _v5(config):
  """config.json as transformers 5 writes it: rope_parameters (Gemma: per layer type)."""
  config = dict(config)
  theta, scaling = config.pop("rope_theta"), config.pop("rope_scaling", None)
  full = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
  if config["model_type"] == "gemma3_text":
    local = {"rope_type": "default", "rope_theta": config.pop("rope_local_base_freq")}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
  elif config["model_type"] == "phi3":  # 5.x: the partial rotary factor in rope_parameters
    kind = full.pop("type")
    config["rope_parameters"] = full | dict(
      rope_type=kind,
      partial_rotary_factor=config.pop("partial_rotary_factor"),
      original_max_position_embeddings=config["original_max_position_embeddings"],
    )
  else:
    config["rope_parameters"] = full
  return config


def _weights(config, seed):
  rng = np.random.default_rng(seed)
  n, kv = config["num_attention_heads"], config["num_key_value_heads"]
  d, f = config["hidden_size"], config["intermediate_size"]
  h = config.get("head_dim") or d // n
  gemma = config["model_type"] == "gemma3_text"
  mat = lambda *shape: (rng.standard_normal(shape) * 0.3 / math.sqrt(shape[-1])).astype(np.float32)
  norm = lambda size: (rng.standard_normal(size) * 0.1 + (0.0 if gemma else 1.0)).astype(np.float32)
  w = {"model.embed_tokens.weight": (rng.standard_normal((config["vocab_size"], d)) * 0.5).astype(np.float32)}
  w["model.norm.weight"] = norm(d)
  if not config.get("tie_word_embeddings", gemma):
    w["lm_head.weight"] = mat(config["vocab_size"], d)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    olmo = config["model_type"] == "olmo2"
    if not olmo:  # OLMo 2 norms after each sub-layer only
      w[p + "input_layernorm.weight"] = norm(d)
    w[p + "self_attn.q_proj.weight"] = mat(n * h, d)
    w[p + "self_attn.k_proj.weight"] = mat(kv * h, d)
    w[p + "self_attn.v_proj.weight"] = mat(kv * h, d)
    w[p + "self_attn.o_proj.weight"] = mat(d, n * h)
    w[p + "post_attention_layernorm.weight"] = norm(d)
    w[p + "mlp.gate_proj.weight"] = mat(f, d)
    w[p + "mlp.up_proj.weight"] = mat(f, d)
    w[p + "mlp.down_proj.weight"] = mat(d, f)
    if config["model_type"] == "qwen2":
      for name, size in (("q_proj", n * h), ("k_proj", kv * h), ("v_proj", kv * h)):
        w[p + f"self_attn.{name}.bias"] = (rng.standard_normal(size) * 0.3).astype(np.float32)
    if config["model_type"] in ("qwen3", "gemma3_text", "qwen3_moe"):
      w[p + "self_attn.q_norm.weight"] = norm(h)
      w[p + "self_attn.k_norm.weight"] = norm(h)
    if olmo:  # over all heads' width, and a norm after the MLP
      w[p + "self_attn.q_norm.weight"] = norm(n * h)
      w[p + "self_attn.k_norm.weight"] = norm(kv * h)
      w[p + "post_feedforward_layernorm.weight"] = norm(d)
    if gemma:
      w[p + "pre_feedforward_layernorm.weight"] = norm(d)
      w[p + "post_feedforward_layernorm.weight"] = norm(d)
    if config["model_type"] in ("qwen3_moe", "mixtral"):
      _experts(w, p, i, config, mat)
    if config["model_type"] == "phi3":  # one tensor for q, k, v and one for gate, up
      parts = [w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
      w[p + "self_attn.qkv_proj.weight"] = np.concatenate(parts)
      parts = [w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
      w[p + "mlp.gate_up_proj.weight"] = np.concatenate(parts)
  return w


def _experts(w, p, i, config, mat):
  """Layer i's MLP made sparse where the family makes it so: Mixtral's every layer
  (`block_sparse_moe`, w1 gate, w3 up, w2 down), Qwen3-MoE's layers outside
  `mlp_only_layers` at every `decoder_sparse_step`-th (`mlp.gate` and `mlp.experts`)."""
  d = config["hidden_size"]
  experts = config.get("num_experts") or config["num_local_experts"]
  if config["model_type"] == "mixtral":
    f, where, names = config["intermediate_size"], "block_sparse_moe.", ("w1", "w3", "w2")
  else:
    if i in config.get("mlp_only_layers", []) or (i + 1) % config.get("decoder_sparse_step", 1):
      return
    f, where, names = config["moe_intermediate_size"], "mlp.", ("gate_proj", "up_proj", "down_proj")
  for x in ("gate", "up", "down"):
    del w[p + f"mlp.{x}_proj.weight"]
  w[p + where + "gate.weight"] = mat(experts, d) * 3
  gate, up, down = names
  for e in range(experts):
    q = p + where + f"experts.{e}."
    w |= {q + f"{gate}.weight": mat(f, d), q + f"{up}.weight": mat(f, d), q + f"{down}.weight": mat(d, f)}


# llama.cpp's names for Hugging Face's (convert_hf_to_gguf.py's tensor map), per layer.
GGUF_NAMES = {
  "input_layernorm": "attn_norm",
  "self_attn.q_proj": "attn_q",
  "self_attn.k_proj": "attn_k",
  "self_attn.v_proj": "attn_v",
  "self_attn.o_proj": "attn_output",
  "self_attn.q_norm": "attn_q_norm",
  "self_attn.k_norm": "attn_k_norm",
  "mlp.gate_proj": "ffn_gate",
  "mlp.up_proj": "ffn_up",
  "mlp.down_proj": "ffn_down",
}
GEMMA_GGUF_NAMES = GGUF_NAMES | {
  "post_attention_layernorm": "post_attention_norm",
  "pre_feedforward_layernorm": "ffn_norm",
  "post_feedforward_layernorm": "post_ffw_norm",
}
LLAMA_GGUF_NAMES = GGUF_NAMES | {"post_attention_layernorm": "ffn_norm"}
PHI3_GGUF_NAMES = LLAMA_GGUF_NAMES | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
OLMO2_GGUF_NAMES = GGUF_NAMES | {
  "post_attention_layernorm": "post_attention_norm",
  "post_feedforward_layernorm": "post_ffw_norm",
}


def _llama_cpp_permute(w, heads):
  """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head from (i, i + H/2)
  pairs to (2i, 2i + 1) pairs."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(config, w):
  arch = config["model_type"]
  gemma = arch == "gemma3_text"
  names = {"gemma3_text": GEMMA_GGUF_NAMES, "olmo2": OLMO2_GGUF_NAMES, "phi3": PHI3_GGUF_NAMES}.get(
    arch, LLAMA_GGUF_NAMES
  )
  out = {"token_embd.weight": w["model.embed_tokens.weight"]}
  if "lm_head.weight" in w:
    out["output.weight"] = w["lm_head.weight"]
  for name, value in w.items():
    if not name.startswith("model.layers."):
      continue
    _, _, i, rest = name.split(".", 3)
    base, kind = rest.rsplit(".", 1)  # a weight, or (Qwen 2's q, k, v) a bias
    reordered = arch in ("llama", "mistral")
    if reordered and base == "self_attn.q_proj":
      value = _llama_cpp_permute(value, config["num_attention_heads"])
    if reordered and base == "self_attn.k_proj":
      value = _llama_cpp_permute(value, config["num_key_value_heads"])
    if gemma and base.endswith("norm"):
      value = value + 1  # llama.cpp stores Gemma's scales as 1 + w
    out[f"blk.{i}.{names[base]}.{kind}"] = value
  out["output_norm.weight"] = w["model.norm.weight"] + (1 if gemma else 0)
  if arch == "llama":  # Llama 3.1's rule as llama.cpp stores it: a divisor per frequency
    s = config["rope_scaling"]
    plain = inv_frequencies(config["head_dim"], config["rope_theta"], None)
    out["rope_freqs.weight"] = (plain / inv_frequencies(config["head_dim"], config["rope_theta"], s)).astype(
      np.float32
    )
  if arch == "phi3":  # LongRoPE's factors as llama.cpp's converter stores them
    out["rope_factors_long.weight"] = np.asarray(config["rope_scaling"]["long_factor"], np.float32)
    out["rope_factors_short.weight"] = np.asarray(config["rope_scaling"]["short_factor"], np.float32)
  return out


def write_gguf(path, config, w, vocab):
  # llama.cpp converts Mistral as "llama" (its rows reordered; no window).
  arch = {"llama": "llama", "mistral": "llama", "olmo2": "olmo2", "phi3": "phi3", "qwen2": "qwen2"}
  arch = (arch | {"qwen3": "qwen3"}).get(config["model_type"], "gemma3")
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(config["num_attention_heads"])
  writer.add_head_count_kv(config["num_key_value_heads"])
  if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes it (no key_length)
    d, n = config["hidden_size"], config["num_attention_heads"]
    writer.add_rope_dimension_count(int(config["partial_rotary_factor"] * d) // n)
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    ratio = config["max_position_embeddings"] / config["original_max_position_embeddings"]
    writer.add_rope_scaling_attn_factors(
      math.sqrt(1 + math.log(ratio) / math.log(config["original_max_position_embeddings"]))
    )
    writer.add_sliding_window(config["sliding_window"])
  else:
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  writer.add_rope_freq_base(config["rope_theta"])
  if arch == "gemma3":
    writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SP_PIECES)
    writer.add_token_scores(SP_SCORES)
    writer.add_token_types(SP_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
  else:
    tokens, merges, types = vocab
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre({"llama": "llama-bpe", "phi3": "gpt-4o"}.get(arch, "qwen2"))  # Phi-4-mini's
    writer.add_add_bos_token(arch == "llama")  # as llama.cpp's converter writes them
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
  for name, value in _gguf_tensors(config, w).items():
    writer.add_tensor(name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def write_folder(folder, config, w, *, shards=1, tokenizer=None):
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps(config))
  names = sorted(w)
  if shards == 1:
    save_file({n: w[n] for n in names}, str(folder / "model.safetensors"))
  else:
    weight_map = {}
    for k in range(shards):
      shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
      part = names[k::shards]
      save_file({n: w[n] for n in part}, str(folder / shard))
      weight_map |= dict.fromkeys(part, shard)
    (folder / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map})
    )
  if tokenizer is not None:
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
  return folder


ARCHS = ("llama", "qwen3", "gemma3", "qwen2", "mistral", "olmo2", "phi3")
# A Gemma 3 folder with what only config.json can say: a global layer every 2nd, the
# windowed layers' own rotary base, query_pre_attn_scalar apart from head_dim (the 27B's
# kind).
GEMMA_VARIANT = dict(
  num_hidden_layers=4,
  layer_types=["sliding_attention", "full_attention"] * 2,
  rope_local_base_freq=1000.0,
  query_pre_attn_scalar=24,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """arch -> dict(config, weights, tokenizer, paths: hf4 (4.x config, one file), hf5 (5.x
  config, 3 shards), gguf)."""
  out = {}
  for seed, arch in enumerate(ARCHS):
    root = tmp_path_factory.mktemp(arch)
    tok = (
      None
      if arch == "gemma3"
      else train_bpe(
        *((LLAMA3_PATTERN, False) if arch in ("llama", "mistral", "phi3") else (QWEN2_PATTERN, True))
      )
    )
    vocab = None if tok is None else bpe_tables(tok)
    config = _config(arch, len(SP_PIECES) if tok is None else len(vocab[0]))
    w = _weights(config, seed)
    paths = dict(
      hf4=write_folder(root / "hf4", config, w, tokenizer=tok),
      hf5=write_folder(root / "hf5", _v5(config), w, shards=3, tokenizer=tok),
      gguf=root / "model.gguf",
    )
    write_gguf(paths["gguf"], config, w, vocab)
    out[arch] = dict(config=config, weights=w, tokenizer=tok, paths=paths)
  variant = out["gemma3"]["config"] | GEMMA_VARIANT
  w = _weights(variant, 7)
  out["gemma3-variant"] = dict(
    config=variant, weights=w, tokenizer=None, paths=dict(hf4=write_folder(root / "variant", variant, w))
  )
  return out


def _numpy_logits(ckpt, tokens):
  config, w = ckpt["config"], ckpt["weights"]
  match config["model_type"]:
    case "gemma3_text":
      return gemma3_logits(w, config, tokens)
    case "qwen3":
      return llama_logits(w, config, tokens, qk_norm=True)
    case "qwen2":
      return llama_logits(w, config, tokens, qkv_bias=True)
    case "mistral":
      return llama_logits(w, config, tokens, window=config["sliding_window"])
    case "olmo2":
      return olmo2_logits(w, config, tokens)
    case "phi3":
      return phi3_logits(w, config, tokens)
  return llama_logits(w, config, tokens)


def _tokens(vocab, length=LENGTH, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (1, length)).astype(np.int32)


@pytest.mark.parametrize(
  "arch, fmt", [(a, f) for a in ARCHS for f in ("hf4", "hf5", "gguf")] + [("gemma3-variant", "hf4")]
)
def test_loaders_equal_the_float64_numpy_forward(checkpoints, arch, fmt):
  ckpt = checkpoints[arch]
  model, tokenizer = models.load(ckpt["paths"][fmt], attention="dense")
  if arch == "mistral" and fmt == "gguf":  # llama.cpp's "llama": a Llama, without the window
    assert type(model) is models.Llama
    ckpt = dict(ckpt, config=dict(ckpt["config"], sliding_window=None))
  if arch == "phi3" and fmt == "gguf":  # llama.cpp runs Phi-3 without its window
    ckpt = dict(ckpt, config=dict(ckpt["config"], sliding_window=None))
  tokens = _tokens(ckpt["config"]["vocab_size"])
  expected = _numpy_logits(ckpt, tokens[0])
  assert rel_err(model(tokens)[0], expected) < F64_TOL
  assert (tokenizer is None) == (fmt != "gguf" and ckpt["tokenizer"] is None)  # a folder without one: None


_DENSE = {}


# Compiled: eagerly, each of a model's ops dispatches alone, which costs more than compiling them.
_forward = nnx.jit(lambda model, tokens: model(tokens))


@pytest.mark.parametrize("arch, devices", crossed(ARCHS))
def test_ring_equals_dense(checkpoints, arch, devices):
  path = checkpoints[arch]["paths"]["hf5"]
  tokens = _tokens(checkpoints[arch]["config"]["vocab_size"], seed=1)
  if arch not in _DENSE:  # one dense forward per architecture, for every device count
    _DENSE[arch] = np.asarray(_forward(models.load(path, attention="dense")[0], tokens))
  ring, _ = models.load(path, mesh=make_mesh((devices,), ("seq",)), attention="ring")
  assert rel_err(_forward(ring, tokens), _DENSE[arch]) < RING_TOL


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rope_scaling_is_applied(checkpoints, arch, tmp_path):
  """The loader applies the rope scaling: the same weights with `rope_scaling` removed
  from config.json load to other logits (the test's length reaches the frequencies the
  scaling changes), each equal to the float64 forward of its own config."""
  ckpt = checkpoints[arch]
  tokens = _tokens(ckpt["config"]["vocab_size"])
  plain = dict(ckpt, config=dict(ckpt["config"], rope_scaling=None))
  folder = write_folder(tmp_path / "plain", plain["config"], ckpt["weights"])
  unscaled = np.asarray(models.load(folder, attention="dense")[0](tokens)[0])
  scaled = np.asarray(models.load(ckpt["paths"]["hf4"], attention="dense")[0](tokens)[0])
  assert rel_err(unscaled, scaled) > 1e-3
  assert rel_err(unscaled, _numpy_logits(plain, tokens[0])) < F64_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_back_exactly(checkpoints, arch, tmp_path):
  """A model loaded from GGUF saves as a Hugging Face folder (read by safetensors' own
  reader: the original tensors under their names) that loads back with identical logits;
  a small shard limit writes shards and their index."""
  ckpt = checkpoints[arch]
  model, tokenizer = models.load(ckpt["paths"]["gguf"], attention="dense")
  models.save(model, tmp_path / "one", tokenizer=tokenizer)
  saved = load_file(str(tmp_path / "one" / "model.safetensors"))
  assert set(saved) == set(ckpt["weights"])
  for name, value in ckpt["weights"].items():
    np.testing.assert_allclose(saved[name], value, rtol=0, atol=1e-6, err_msg=name)
  config = json.loads((tmp_path / "one" / "config.json").read_text())
  # A Mistral GGUF is llama.cpp's "llama": it saves as the Llama it loads as.
  like = checkpoints["llama"]["config"] if arch == "mistral" else ckpt["config"]
  assert config["model_type"] == like["model_type"]
  assert config["architectures"] == like["architectures"]
  tokens = _tokens(ckpt["config"]["vocab_size"], seed=5)
  before = np.asarray(model(tokens))
  again, tok2 = models.load(tmp_path / "one", attention="dense")
  np.testing.assert_array_equal(np.asarray(again(tokens)), before)
  for text in TEXTS:
    assert tok2.encode(text) == tokenizer.encode(text), text
  assert (tok2.bos_id, tok2.eos_id) == (tokenizer.bos_id, tokenizer.eos_id)
  models.save(again, tmp_path / "shards", max_shard_bytes=20_000)
  index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
  files = set(index["weight_map"].values())
  assert len(files) > 2
  for f in files:  # within the limit (plus the header), or one tensor larger than it alone
    held = [n for n, shard in index["weight_map"].items() if shard == f]
    assert (tmp_path / "shards" / f).stat().st_size < 20_000 + 4096 or len(held) == 1
  third, _ = models.load(tmp_path / "shards", attention="dense")
  np.testing.assert_array_equal(np.asarray(third(tokens)), before)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bpe_tokenizers_equal_the_tokenizer_they_came_from(checkpoints, arch):
  """GGUF's byte-level BPE vocabulary (tokens, merges, pre-tokenizer name) and the
  folder's tokenizer.json tokenize as the test's own trained tokenizer does."""
  ckpt = checkpoints[arch]
  reference = ckpt["tokenizer"]
  for fmt in ("gguf", "hf4"):
    _, tok = models.load(ckpt["paths"][fmt], attention="dense")
    for text in TEXTS:
      ids = tok.encode(text)
      assert ids == reference.encode(text, add_special_tokens=False).ids, (fmt, text)
      assert tok.decode(ids) == (text if arch == "llama" else reference.decode(ids))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.special_ids["<|end_of_text|>"] == 1


def test_sentencepiece_vocabulary_and_its_tokenizer_json(checkpoints, tmp_path):
  """A GGUF SentencePiece vocabulary: user-defined pieces spelled with spaces (Gemma's
  space runs) are whole tokens, and the tokenizer.json `models.save` writes gives the
  same ids."""
  _, tok = models.load(checkpoints["gemma3"]["paths"]["gguf"], attention="dense")
  index = {p: i for i, p in enumerate(SP_PIECES)}
  assert tok.encode("a  b") == [index["a"], index["  "], index["b"]]
  assert tok.encode("   the") == [index["   "], index["t"], index["he"]]
  assert tok.encode(" the") == [index["\u2581the"]]
  hf = models.HFTokenizer.from_folder(_saved_tokenizer(tok, tmp_path))
  for text in TEXTS + ["a  b", "   the", "The Theater: zebra!"]:
    assert hf.encode(text) == tok.encode(text), text
    assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def _saved_tokenizer(tok, folder):
  from jax_ring.models.formats import tokenizer_json as tokenizer_io

  tokenizer_io.save_tokenizer(tok, folder, context_length=256)
  return folder


def test_named_configs_have_the_published_sizes():
  """Parameter counts of the named configs (nothing allocated) against the counts their
  publishers give: Llama 3.1 8B 8,030,261,248 and Llama 3.2 1B 1,235,814,400 (Meta's
  model cards); Qwen3-0.6B 0.44B without embeddings (Qwen's model card); Gemma 3 270M
  170M embedding and 100M transformer parameters (Google's model card)."""
  from flax import nnx

  def sizes(config):
    model = nnx.eval_shape(lambda: models.build(config, attention="dense"))
    return {
      ".".join(map(str, k)): int(np.prod(v.shape)) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }

  def count(name):
    """The parameters outside the blocks by name, and the blocks' together ("blocks"),
    from the model built with one and with two of its blocks (nothing allocated; tracing
    all 28-36 blocks of each config took most of this test's time): the second block
    must have the first's shapes, and the config's blocks are that block's count times
    `num_layers`."""
    config = models.config(name)
    one, two = (sizes(dataclasses.replace(config, num_layers=n)) for n in (1, 2))
    part = lambda d, prefix: {k.removeprefix(prefix): v for k, v in d.items() if k.startswith(prefix)}
    rest = lambda d: {k: v for k, v in d.items() if not k.startswith("blocks.")}
    block = part(one, "blocks.0.")
    assert block and part(two, "blocks.1.") == block and rest(one) == rest(two), name
    return rest(one) | {"blocks": sum(block.values()) * config.num_layers}

  assert sum(count("llama-3.1-8b").values()) == 8_030_261_248
  assert sum(count("llama-3.2-1b").values()) == 1_235_814_400
  qwen = count("qwen3-0.6b")
  assert round((sum(qwen.values()) - qwen["embed.embedding"]) / 1e9, 2) == 0.44
  # Qwen's model cards: Qwen2.5-0.5B 0.49B (0.36B without the embedding), Qwen2.5-7B
  # 7.61B (6.53B without the embedding and the untied head); the 1M model is the 7B's shape.
  for name, total, body in (("qwen2.5-0.5b", 0.49, 0.36), ("qwen2.5-7b", 7.61, 6.53)):
    qwen2 = count(name)
    tables = qwen2["embed.embedding"] + qwen2.get("head.kernel", 0)
    assert (math.floor(sum(qwen2.values()) / 1e7) / 100, round((sum(qwen2.values()) - tables) / 1e9, 2)) == (
      total,
      body,
    ), name
  # Mistral-7B-v0.3: 7,248,023,552 parameters (the safetensors' total on Hugging Face).
  assert sum(count("mistral-7b-v0.3").values()) == 7_248_023_552
  # OLMo-2-1124-7B: 7.3B parameters (Hugging Face's count of its safetensors).
  assert round(sum(count("olmo-2-7b").values()) / 1e9, 1) == 7.3
  # Phi-4-mini-instruct 3,836,021,760 (its safetensors' total on Hugging Face) and
  # Phi-3-mini 3,821,079,552 (KerasHub's Phi-3 presets).
  assert sum(count("phi-4-mini").values()) == 3_836_021_760
  assert sum(count("phi-3-mini-4k").values()) == 3_821_079_552
  # Phi-3-mini-128k: the 4K model's weights; its LongRoPE lists are the current release's
  # ("longrope", not the first release's "su": tests/data/phi3-mini-128k-longrope.json).
  assert sum(count("phi-3-mini-128k").values()) == 3_821_079_552
  released = json.loads((Path(__file__).parent / "data" / "phi3-mini-128k-longrope.json").read_text())
  current = released["phi-3-mini-128k-instruct (current release, rope_scaling type 'longrope')"]
  first = released["phi-3-mini-128k-instruct (first release, rope_scaling type 'su', transformers 4.39.3)"]
  scaling = models.config("phi-3-mini-128k").rope_scaling
  assert (scaling.kind, scaling.original_max_position_embeddings) == ("longrope", 4096)
  assert list(scaling.factors) == current["short_factor"]
  assert list(scaling.long_factors) == current["long_factor"]
  assert list(scaling.long_factors) != first["long_factor"] or list(scaling.factors) != first["short_factor"]
  assert models.config("phi-3-mini-128k").context_length == current["max_position_embeddings"]
  assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
  long = dict(rope_base=1e7, norm_eps=1e-5, context_length=1_010_000)
  assert models.config("qwen2.5-7b-instruct-1m") == dataclasses.replace(models.config("qwen2.5-7b"), **long)
  gemma = count("gemma-3-270m")
  assert (
    round(gemma["embed.embedding"] / 1e6) == 168 and round((sum(gemma.values()) - 167_772_160) / 1e6) == 100
  )
  with pytest.raises(ValueError, match="name='llama-9'"):
    models.config("llama-9")


# --- Bad input. ---


def test_bad_folders_and_files(checkpoints, tmp_path):
  ckpt = checkpoints["llama"]
  config, w = ckpt["config"], ckpt["weights"]
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="without config.json"):
    models.load(tmp_path / "empty")
  bert = write_folder(tmp_path / "bert", config | {"model_type": "bert"}, w)
  with pytest.raises(ValueError, match="model_type='bert'"):
    models.load(bert)
  missing = {k: v for k, v in w.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight'.*is missing"):
    models.load(write_folder(tmp_path / "missing", config, missing), attention="dense")
  bad = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)})
  with pytest.raises(ValueError, match=r"k_proj.weight.*shape \(64, 8\)"):
    models.load(write_folder(tmp_path / "shape", config, bad), attention="dense")
  sharded = write_folder(tmp_path / "shards", config, w, shards=3)
  (sharded / "model-00002-of-00003.safetensors").unlink()
  with pytest.raises(ValueError, match="names the shard 'model-00002-of-00003.safetensors'"):
    models.load(sharded)
  cut = write_folder(tmp_path / "cut", config, w)
  raw = (cut / "model.safetensors").read_bytes()
  (cut / "model.safetensors").write_bytes(raw[: len(raw) - 1000])
  with pytest.raises(ValueError, match="is truncated"):
    models.load(cut)
  cut_gguf = tmp_path / "cut.gguf"
  cut_gguf.write_bytes(ckpt["paths"]["gguf"].read_bytes()[:-1000])
  with pytest.raises(ValueError, match="is truncated"):
    models.load(cut_gguf, cache_dir=tmp_path)
  yarn = config | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    models.load(write_folder(tmp_path / "yarn", yarn, w))
  with pytest.raises(ValueError, match="attention_bias=True"):
    models.load(write_folder(tmp_path / "bias", config | {"attention_bias": True}, w))
  with pytest.raises(ValueError, match="quantization_config"):
    models.load(write_folder(tmp_path / "quant", config | {"quantization_config": {"bits": 4}}, w))
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  (pickled / "config.json").write_text(json.dumps(config))
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02not read")
  with pytest.raises(ValueError, match=r"'pytorch_model.bin'.*pickled torch weights.*save_pretrained"):
    models.load(pickled)
  with pytest.raises(ValueError, match="dtype='int8'"):
    models.load(ckpt["paths"]["hf4"], dtype="int8")
  with pytest.raises(ValueError, match="fsdp=True splits the weights"):
    models.load(ckpt["paths"]["hf4"], attention="dense", fsdp=True)


def _rewrite_gguf(source, path, arch, drop=(), add=None):
  """A copy of the GGUF file `source` at `path` without the metadata keys `drop`, with
  `add(writer)`'s."""
  reader = gguf.GGUFReader(str(source))
  writer = gguf.GGUFWriter(str(path), arch)
  for field in reader.fields.values():
    if field.name.startswith(("GGUF.", "general.architecture")) or field.name in drop:
      continue
    value = field.contents()
    kind = field.types[0]
    sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, kind, sub_type=sub)
  if add is not None:
    add(writer)
  for t in reader.tensors:
    writer.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_unknown_gguf_key_is_refused(checkpoints, tmp_path):
  ckpt = checkpoints["qwen3"]
  path = tmp_path / "softcap.gguf"
  writer_config = ckpt["config"]
  write_gguf(path, writer_config, ckpt["weights"], bpe_tables(ckpt["tokenizer"]))
  more = _rewrite_gguf(
    path, tmp_path / "more.gguf", "qwen3", add=lambda w: w.add_float32("qwen3.attn_logit_softcapping", 30.0)
  )
  with pytest.raises(ValueError, match="qwen3.attn_logit_softcapping=30.0"):
    models.load(more, cache_dir=tmp_path)
  # A Phi-3 file with LongRoPE's factors but not the length they switch at.
  source = checkpoints["phi3"]["paths"]["gguf"]
  cut = _rewrite_gguf(
    source, tmp_path / "phi3.gguf", "phi3", drop=("phi3.rope.scaling.original_context_length",)
  )
  with pytest.raises(ValueError, match="phi3.rope.scaling.original_context_length is missing"):
    models.load(cut, cache_dir=tmp_path)


def test_bad_tokens(checkpoints):
  model, _ = models.load(checkpoints["qwen3"]["paths"]["hf4"], attention="dense")
  vocab = checkpoints["qwen3"]["config"]["vocab_size"]
  with pytest.raises(ValueError, match=rf"the id {vocab + 5} at \(0, 2\).*\[0, {vocab}\)"):
    model(np.array([[1, 2, vocab + 5]], np.int32))
  with pytest.raises(ValueError, match=r"the id -5 at \(0, 0\)"):
    model(np.array([[-5, 2]], np.int32))
  with pytest.raises(ValueError, match=r"shape=\(1, 0\)"):
    model(np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match="shape=\\(3,\\)"):
    model(np.array([1, 2, 3], np.int32))
  listed = np.asarray(model([[3, 4, 5]]))
  np.testing.assert_array_equal(listed, np.asarray(model(jnp.asarray([[3, 4, 5]], jnp.int32))))
  with pytest.raises(ValueError, match=f"the id {vocab}"):
    models.generate(model, [[1, vocab]], max_new_tokens=2)
  out = models.generate(model, [[3, 4, 5]], max_new_tokens=2)
  assert out.tokens.shape == (1, 2)
  assert jax.tree.leaves(out.tokens)


@pytest.mark.parametrize("arch", ["llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3", "gemma3-variant"])
def test_saved_config_json_is_the_config_and_transformers_reads_it(checkpoints, arch, tmp_path):
  """The whole config.json `models.save` writes: loaded back, the config equals the
  model's (every field, not only model_type); transformers' own config class reads it
  (transformers 5 checks each field's declared type: query_pre_attn_scalar is an int)
  with the same hyper-parameters."""
  from transformers import AutoConfig

  ckpt = checkpoints[arch]
  model, tok = models.load(ckpt["paths"]["hf4"], attention="dense")
  models.save(model, tmp_path, tokenizer=tok)
  again, _ = models.load(tmp_path, attention="dense")
  assert again.config == model.config
  written = json.loads((tmp_path / "config.json").read_text())
  theirs = AutoConfig.from_pretrained(tmp_path)
  if tok is not None:  # the tokenizer's special ids, where transformers' generate reads them
    assert (written["bos_token_id"], written["eos_token_id"]) == (tok.bos_id, tok.eos_id) == (0, 1)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
  assert theirs.max_position_embeddings == written["max_position_embeddings"] == 256
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
    assert getattr(theirs, key) == written[key] == ckpt["config"][key], key
  assert theirs.num_key_value_heads == ckpt["config"]["num_key_value_heads"]
  head_dim = ckpt["config"].get("head_dim") or written["hidden_size"] // written["num_attention_heads"]
  assert getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads) == head_dim
  assert theirs.rms_norm_eps == ckpt["config"]["rms_norm_eps"]
  assert theirs.tie_word_embeddings == (arch not in ("llama", "qwen2", "mistral", "olmo2", "phi3"))
  if arch == "phi3":  # LongRoPE, the partial rotary factor and the window as transformers reads them
    rope = theirs.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
    assert rope["long_factor"] == ckpt["config"]["rope_scaling"]["long_factor"]
    assert rope["short_factor"] == ckpt["config"]["rope_scaling"]["short_factor"]
    assert theirs.original_max_position_embeddings == 16 and theirs.sliding_window == 24
  if arch.startswith("gemma3"):
    assert written["query_pre_attn_scalar"] == 24 and isinstance(written["query_pre_attn_scalar"], int)
    assert theirs.query_pre_attn_scalar == 24 and theirs.sliding_window == 8
    assert theirs.layer_types == ckpt["config"]["layer_types"]


@pytest.mark.parametrize(
  "arch, fmt",
  [
    ("llama", "gguf"),
    ("llama", "hf4"),
    ("qwen2", "gguf"),
    ("qwen3", "gguf"),
    ("qwen3", "hf4"),
    ("gemma3", "gguf"),
  ],
)
def test_saved_tokenizer_encodes_for_transformers_as_the_model_was_trained(checkpoints, arch, fmt, tmp_path):
  """transformers' AutoTokenizer on the folder `models.save` writes: a text with its
  special tokens is BOS and the text where the model reads BOS first (Llama 3: its
  tokenizer.json's template, its GGUF's add_bos_token; Gemma: SentencePiece's default),
  the text alone where it does not (Qwen, whose config.json still names a BOS); without
  special tokens, the text's ids."""
  from transformers import AutoTokenizer

  model, tok = models.load(checkpoints[arch]["paths"][fmt], attention="dense")
  qwen = arch.startswith("qwen")
  assert tok.add_bos == (not qwen) and tok.prefix() == ([] if qwen else [tok.bos_id])
  models.save(model, tmp_path, tokenizer=tok)
  theirs = AutoTokenizer.from_pretrained(tmp_path)
  for text in TEXTS:
    assert theirs(text, add_special_tokens=False).input_ids == tok.encode(text), text
    assert theirs(text).input_ids == tok.prefix() + tok.encode(text), text
  _, again = models.load(tmp_path, attention="dense")
  assert again.add_bos == tok.add_bos


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "olmo2", "phi3"])
def test_generates_what_the_dense_forward_predicts(checkpoints, arch):
  """Qwen 2.5's biased projections, Mistral's window (8 keys; the prompt is 12), OLMo
  2's post-norms and q/k norms over all heads, and Phi-3's fused tensors and partial
  rotary (LongRoPE's short factors: 16 tokens in all) through the sequence-sharded KV cache:
  greedy `generate` on a 4-device ring gives, token by token, the argmax of the dense
  model's forward over the prompt and the tokens generated so far."""
  path = checkpoints[arch]["paths"]["hf4"]
  prompt = _tokens(checkpoints[arch]["config"]["vocab_size"], length=12, seed=3)
  ring, _ = models.load(path, mesh=make_mesh((4,), ("seq",)), attention="ring")
  out = np.asarray(models.generate(ring, prompt, max_new_tokens=4).tokens)
  dense, _ = models.load(path, attention="dense")
  seq = prompt
  for _ in range(4):
    nxt = int(np.argmax(np.asarray(dense(seq))[0, -1]))
    seq = np.concatenate([seq, [[nxt]]], axis=1).astype(np.int32)
  assert out.tolist() == seq[:, 12:].tolist()


_DENSE_GRADS = {}


@pytest.mark.parametrize("arch, devices", crossed(["qwen2", "mistral", "olmo2", "phi3", "gemma3"]))
def test_ring_gradients_equal_dense(checkpoints, arch, devices):
  """The gradient of every weight of a loss on the logits (a fixed random projection),
  the ring (each architecture on two of 1, 2, 4 and 8 devices: `crossed`) against
  dense attention: Qwen 2.5's biases,
  Mistral's window (8 keys at 40 tokens), OLMo 2's post-norms and q/k norms over all
  heads, Phi-3's partial rotary under LongRoPE's long factors and its window, Gemma 3's
  windowed and global layers, sandwich norms and tied, scaled embedding."""
  from flax import nnx

  path = checkpoints[arch]["paths"]["hf5"]
  vocab = checkpoints[arch]["config"]["vocab_size"]
  tokens = _tokens(vocab, seed=2)
  probe = np.random.default_rng(4).standard_normal((1, LENGTH, vocab)).astype(np.float32)

  def grads(model):
    loss = lambda m: jnp.sum(m(tokens) * probe)
    flat = nnx.to_flat_state(nnx.jit(lambda m: nnx.grad(loss)(m))(model))
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in flat}

  if arch not in _DENSE_GRADS:
    _DENSE_GRADS[arch] = grads(models.load(path, attention="dense")[0])
  ring = grads(models.load(path, mesh=make_mesh((devices,), ("seq",)), attention="ring")[0])
  dense = _DENSE_GRADS[arch]
  assert set(ring) == set(dense)
  for name, value in dense.items():
    assert rel_err(ring[name], value) < RING_TOL, name


def test_longrope_switches_at_the_original_length(checkpoints, tmp_path):
  """Phi-3's LongRoPE against the float64 forward on both sides of
  original_max_position_embeddings (16): 16 tokens take the short factors, 17 the long
  ones (transformers' rule: the largest position + 1), both times the attention factor
  sqrt(1 + ln 16 / ln 16); a Phi-3 folder without rope_scaling and with a full rotary
  factor loads as plain rotary embeddings (no window in it either)."""
  ckpt = checkpoints["phi3"]
  model, _ = models.load(ckpt["paths"]["hf4"], attention="dense")
  assert model.config.rope_scaling.attention_factor == pytest.approx(math.sqrt(2.0))
  tokens = _tokens(ckpt["config"]["vocab_size"], length=17, seed=6)
  for t in (16, 17):
    assert rel_err(model(tokens[:, :t])[0], _numpy_logits(ckpt, tokens[0, :t])) < F64_TOL, t
  short = dict(
    ckpt["config"], rope_scaling=dict(ckpt["config"]["rope_scaling"], long_factor=[1.0, 1.2, 1.5, 2.5])
  )
  same = models.load(write_folder(tmp_path / "short", short, ckpt["weights"]), attention="dense")[0]
  assert rel_err(same(tokens[:, :16]), model(tokens[:, :16])) < 1e-7
  assert rel_err(same(tokens), model(tokens)) > 1e-3  # 17 tokens: the long factors are in use
  plain = dict(ckpt["config"], rope_scaling=None, partial_rotary_factor=1.0, sliding_window=None)
  loaded = models.load(write_folder(tmp_path / "plain", plain, ckpt["weights"]), attention="dense")[0]
  assert loaded.config.rope_dim is None and loaded.config.sliding_window is None
  assert rel_err(loaded(tokens)[0], phi3_logits(ckpt["weights"], plain, tokens[0])) < F64_TOL


def test_phi3_bad_configs_are_refused(checkpoints, tmp_path):
  ckpt = checkpoints["phi3"]
  config, w = ckpt["config"], ckpt["weights"]
  cases = [
    (dict(partial_rotary_factor=0.45), r"partial_rotary_factor=0.45 rotates 7 of 16"),
    (dict(resid_pdrop=0.1), "resid_pdrop=0.1"),
    (dict(rope_scaling=dict(config["rope_scaling"], long_factor=[1.0])), "long_factors"),
    (
      dict(rope_scaling=dict(config["rope_scaling"], short_factor=[1.0] * 8, long_factor=[2.0] * 8)),
      "8 LongRoPE",
    ),
  ]
  for i, (change, message) in enumerate(cases):
    with pytest.raises(ValueError, match=message):
      models.load(write_folder(tmp_path / str(i), config | change, w), attention="dense")
  name = "model.layers.1.mlp.gate_up_proj.weight"
  cut = dict(w, **{name: w[name][:128]})
  with pytest.raises(ValueError, match=rf"'{name}'.*has 128 rows; the config's parts need 192"):
    models.load(write_folder(tmp_path / "cut", config, cut), attention="dense")


def test_gpt4o_pre_tokenizer_splits_as_o200k(checkpoints):
  """A GGUF vocabulary with Phi-4-mini's pre-tokenizer ("gpt-4o") splits a text into the
  pieces OpenAI's o200k_base pattern gives (written out here from the pattern's rules:
  a word splits before a capital run, an apostrophe suffix stays with its word, digits
  go in threes, "/" leads the word after it, a lone space before a space or a digit
  stands alone); Llama 3's split would keep "HelloWorld" whole and cut "'t" off."""
  _, tok = models.load(checkpoints["phi3"]["paths"]["gguf"], attention="dense")
  pre = tok.to_tokenizers().pre_tokenizer
  pieces = [p for p, _ in pre.pre_tokenize_str("HelloWorld don't  stop 1234567 a/b\n\nOK")]
  expected = ["Hello", "World", " don't", " ", " stop", " ", "123", "456", "7", " a", "/b", "\n\n", "OK"]
  assert pieces == [p.replace(" ", "\u0120").replace("\n", "\u010a") for p in expected]


def test_loaded_weights_are_copies_of_the_gguf_cache(checkpoints):
  """A GGUF load reads the dequantized tensors memory-mapped from the file's cache
  folder and places copies: a device buffer made over the mapping (NumPy's view of it)
  kept the file mapped, resident beside the step's donated outputs, which could not
  take its place (Gemma 3 270M on 8 devices: 1 GiB more at the first step)."""
  import gc

  from flax import nnx

  from jax_ring.models.formats.gguf import GGUFFile

  path = checkpoints["llama"]["paths"]["gguf"]
  folder = str(GGUFFile(path).folder)
  model, _ = models.load(path, mesh=make_mesh((2,), ("seq",)), fsdp=True)
  gc.collect()
  with open("/proc/self/maps") as maps:
    mapped = [line.split()[-1] for line in maps if folder in line]
  assert not mapped, mapped
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
