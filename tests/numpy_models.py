"""Float64 NumPy forwards of Llama 3, Mistral, Qwen 2.5, Qwen 3, OLMo 2, Phi-3, Gemma 3
and the mixtures of experts Qwen3-MoE and Mixtral, written from Hugging Face
transformers' descriptions of the architectures (modeling_llama.py,
modeling_mistral.py, modeling_qwen2.py, modeling_qwen3.py, modeling_qwen3_moe.py,
modeling_mixtral.py, modeling_olmo2.py, modeling_phi3.py with modeling_rope_utils.py's
LongRoPE, modeling_gemma3.py) over Hugging Face's tensor names and config.json keys. They share
no code with `jax_ring.models`: the tests check the loaders against them.
"""

import math

import numpy as np


def rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_frequencies(head_dim, theta, scaling):
  """transformers' rope init functions: default, "linear" and "llama3"."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
  if kind in (None, "default"):
    return inv
  if kind == "linear":
    return inv / scaling["factor"]
  assert kind == "llama3", kind
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  out = []
  for f in inv:
    wavelen = 2 * math.pi / f
    if wavelen < old / high:
      out.append(f)
    elif wavelen > old / low:
      out.append(f / factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.array(out)


def rope(x, inv):
  """rotate_half rotary embedding of x [T, heads, H] at positions 0..T-1."""
  t, _, h = x.shape
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None]
  cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None]
  sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None]
  rotated = np.concatenate([-x[..., h // 2 :], x[..., : h // 2]], axis=-1)
  return x * cos + rotated * sin


def attention(q, k, v, scale, window=None):
  """Causal GQA attention, q [T, N, H], k/v [T, K, H]; `window`: a query sees the
  `window` keys ending at itself."""
  t, n, _ = q.shape
  groups = n // k.shape[1]
  k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
  s = np.einsum("tnh,snh->nts", q, k) * scale
  i, j = np.arange(t)[:, None], np.arange(t)[None]
  seen = j <= i
  if window is not None:
    seen &= i - j < window
  s = np.where(seen[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nts,snh->tnh", p, v)


def silu(x):
  return x / (1 + np.exp(-x))


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def llama_logits(w, config, tokens, qk_norm=False, qkv_bias=False, window=None):
  """Logits [T, V] of a Llama (or, with `qk_norm`, Qwen 3; with `qkv_bias`, Qwen 2; with
  `window`, Mistral's sliding window) checkpoint's tensors `w` (Hugging Face names) and
  config.json values `config`."""
  g = lambda name: np.asarray(w[name], np.float64)
  n, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
  h = config.get("head_dim") or d // n
  eps = config["rms_norm_eps"]
  inv = inv_frequencies(h, config["rope_theta"], config.get("rope_scaling"))
  x = g("model.embed_tokens.weight")[tokens]
  t = len(tokens)
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    y = rms(x, g(p + "input_layernorm.weight"), eps)
    q, k, v = (
      y @ g(p + f"self_attn.{name}.weight").T + (g(p + f"self_attn.{name}.bias") if qkv_bias else 0.0)
      for name in ("q_proj", "k_proj", "v_proj")
    )
    q, k, v = q.reshape(t, n, h), k.reshape(t, kv, h), v.reshape(t, kv, h)
    if qk_norm:
      q, k = rms(q, g(p + "self_attn.q_norm.weight"), eps), rms(k, g(p + "self_attn.k_norm.weight"), eps)
    o = attention(rope(q, inv), rope(k, inv), v, h**-0.5, window).reshape(t, n * h)
    x = x + o @ g(p + "self_attn.o_proj.weight").T
    y = rms(x, g(p + "post_attention_layernorm.weight"), eps)
    if (p + "mlp.gate.weight") in w:  # Qwen3-MoE's sparse layer
      x = x + moe(y, lambda name, p=p: g(p + "mlp." + name), config)
      continue
    if (p + "block_sparse_moe.gate.weight") in w:  # Mixtral's: w1 gate, w3 up, w2 down, renormalized
      mixtral = config | {"norm_topk_prob": True}
      x = x + moe(y, lambda name, p=p: g(p + "block_sparse_moe." + name), mixtral, ("w1", "w3", "w2"))
      continue
    mlp = silu(y @ g(p + "mlp.gate_proj.weight").T) * (y @ g(p + "mlp.up_proj.weight").T)
    x = x + mlp @ g(p + "mlp.down_proj.weight").T
  x = rms(x, g("model.norm.weight"), eps)
  head = g("model.embed_tokens.weight") if config.get("tie_word_embeddings") else g("lm_head.weight")
  return x @ head.T


def moe_choices(y, router, config):
  """(experts [T, K], weights [T, K]) of Qwen3-MoE's router (modeling_qwen3_moe.py):
  softmax over the experts, the K largest probabilities (ties: the lower expert index
  first), renormalized where `norm_topk_prob`."""
  logits = y @ router.T
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  k = config["num_experts_per_tok"]
  chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  weights = np.take_along_axis(p, chosen, axis=-1)
  if config.get("norm_topk_prob"):
    weights = weights / weights.sum(-1, keepdims=True)
  return chosen, weights


def moe(y, g, config, names=("gate_proj", "up_proj", "down_proj")):
  """A sparse MLP on y [T, D] (Qwen3-MoE's, or Mixtral's with its `names`), token by
  token: each of its K experts' gated MLP, weighted by the router (`g(name)`: the
  layer's MoE tensors). With `config["capacity_factor"]` c (a key of these tests, not
  of config.json), each expert takes the first C = min(T, max(1, ceil(c T K / E))) of
  the tokens that chose it, in token order; the rest of its tokens go without it."""
  chosen, weights = moe_choices(y, g("gate.weight"), config)
  gate, up, down = names
  out = np.zeros_like(y)
  taken = {}
  c = config.get("capacity_factor")
  t_all, k = y.shape[0], config["num_experts_per_tok"]
  experts = config.get("num_experts") or config["num_local_experts"]
  most = t_all if c is None else min(t_all, max(1, math.ceil(c * t_all * k / experts)))
  for t in range(y.shape[0]):
    for e, wt in zip(chosen[t], weights[t]):
      taken[e] = taken.get(e, 0) + 1
      if taken[e] > most:
        continue
      f = lambda name, e=e: g(f"experts.{e}.{name}.weight")
      h = silu(y[t] @ f(gate).T) * (y[t] @ f(up).T)
      out[t] += wt * (h @ f(down).T)
  return out


def olmo2_logits(w, config, tokens):
  """Logits [T, V] of an OLMo 2 checkpoint: norms after attention and after the MLP
  (none before), q and k normed over all heads' width before the rotary embeddings."""
  g = lambda name: np.asarray(w[name], np.float64)
  n, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
  h = config.get("head_dim") or d // n
  eps = config["rms_norm_eps"]
  inv = inv_frequencies(h, config["rope_theta"], config.get("rope_scaling"))
  x = g("model.embed_tokens.weight")[tokens]
  t = len(tokens)
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    q = rms(x @ g(p + "self_attn.q_proj.weight").T, g(p + "self_attn.q_norm.weight"), eps).reshape(t, n, h)
    k = rms(x @ g(p + "self_attn.k_proj.weight").T, g(p + "self_attn.k_norm.weight"), eps).reshape(t, kv, h)
    v = (x @ g(p + "self_attn.v_proj.weight").T).reshape(t, kv, h)
    o = attention(rope(q, inv), rope(k, inv), v, h**-0.5).reshape(t, n * h)
    x = x + rms(o @ g(p + "self_attn.o_proj.weight").T, g(p + "post_attention_layernorm.weight"), eps)
    mlp = silu(x @ g(p + "mlp.gate_proj.weight").T) * (x @ g(p + "mlp.up_proj.weight").T)
    x = x + rms(mlp @ g(p + "mlp.down_proj.weight").T, g(p + "post_feedforward_layernorm.weight"), eps)
  x = rms(x, g("model.norm.weight"), eps)
  head = g("model.embed_tokens.weight") if config.get("tie_word_embeddings") else g("lm_head.weight")
  return x @ head.T


def phi3_logits(w, config, tokens):
  """Logits [T, V] of a Phi-3 checkpoint: fused qkv_proj (q, k, v rows in that order) and
  gate_up_proj (gate rows, then up), rotary embeddings on the first
  int(head_dim * partial_rotary_factor) dimensions of each head, LongRoPE's short
  factors for T <= original_max_position_embeddings and long ones past it with cos and
  sin times the attention factor, and the config's sliding window."""
  g = lambda name: np.asarray(w[name], np.float64)
  n, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
  h, f, eps = d // n, config["intermediate_size"], config["rms_norm_eps"]
  params = config.get("rope_parameters") or {}
  theta = params.get("rope_theta", config.get("rope_theta"))
  scaling = config.get("rope_scaling") or (params if "short_factor" in params else None)
  r = int(h * params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
  t = len(tokens)
  inv = 1.0 / theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
  gain = 1.0
  if scaling is not None:
    original = config["original_max_position_embeddings"]
    factors = scaling["long_factor"] if t > original else scaling["short_factor"]
    inv = inv / np.asarray(factors, np.float64)
    ratio = config["max_position_embeddings"] / original
    gain = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0

  def rotate(x):  # x [T, heads, H]: the first r dimensions rotate, the rest pass
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None] * gain
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None] * gain
    rot, rest = x[..., :r], x[..., r:]
    half = np.concatenate([-rot[..., r // 2 :], rot[..., : r // 2]], axis=-1)
    return np.concatenate([rot * cos + half * sin, rest], axis=-1)

  x = g("model.embed_tokens.weight")[tokens]
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    y = rms(x, g(p + "input_layernorm.weight"), eps)
    qkv = y @ g(p + "self_attn.qkv_proj.weight").T
    q = qkv[:, : n * h].reshape(t, n, h)
    k = qkv[:, n * h : (n + kv) * h].reshape(t, kv, h)
    v = qkv[:, (n + kv) * h :].reshape(t, kv, h)
    o = attention(rotate(q), rotate(k), v, h**-0.5, config.get("sliding_window")).reshape(t, n * h)
    x = x + o @ g(p + "self_attn.o_proj.weight").T
    y = rms(x, g(p + "post_attention_layernorm.weight"), eps)
    gate_up = y @ g(p + "mlp.gate_up_proj.weight").T
    x = x + (gate_up[:, f:] * silu(gate_up[:, :f])) @ g(p + "mlp.down_proj.weight").T
  x = rms(x, g("model.norm.weight"), eps)
  head = g("model.embed_tokens.weight") if config.get("tie_word_embeddings") else g("lm_head.weight")
  return x @ head.T


def gemma3_logits(w, config, tokens):
  """Logits [T, V] of a Gemma 3 text checkpoint (Hugging Face names: RMSNorm scales
  stored as w for x * (1 + w))."""
  g = lambda name: np.asarray(w[name], np.float64)
  norm = lambda x, name: rms(x, 1.0 + g(name), config["rms_norm_eps"])
  n, kv, d, h = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim"))
  inv_full = inv_frequencies(h, config["rope_theta"], config.get("rope_scaling"))
  inv_local = inv_frequencies(h, config["rope_local_base_freq"], None)
  scale = config["query_pre_attn_scalar"] ** -0.5
  x = g("model.embed_tokens.weight")[tokens] * math.sqrt(d)
  t = len(tokens)
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    full = config["layer_types"][layer] == "full_attention"
    y = norm(x, p + "input_layernorm.weight")
    q = (y @ g(p + "self_attn.q_proj.weight").T).reshape(t, n, h)
    k = (y @ g(p + "self_attn.k_proj.weight").T).reshape(t, kv, h)
    v = (y @ g(p + "self_attn.v_proj.weight").T).reshape(t, kv, h)
    q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
    inv = inv_full if full else inv_local
    o = attention(rope(q, inv), rope(k, inv), v, scale, None if full else config["sliding_window"])
    x = x + norm(
      o.reshape(t, n * h) @ g(p + "self_attn.o_proj.weight").T, p + "post_attention_layernorm.weight"
    )
    y = norm(x, p + "pre_feedforward_layernorm.weight")
    mlp = gelu_tanh(y @ g(p + "mlp.gate_proj.weight").T) * (y @ g(p + "mlp.up_proj.weight").T)
    x = x + norm(mlp @ g(p + "mlp.down_proj.weight").T, p + "post_feedforward_layernorm.weight")
  x = norm(x, "model.norm.weight")
  return x @ g("model.embed_tokens.weight").T
