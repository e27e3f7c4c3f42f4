"""config.json as transformers writes it (4.x and 5.x): `ConfigReader`, which hands an
architecture's config builder its keys and refuses any it never read that could change
the computation, and the rotary scaling's config forms (`rope_scaling`,
`rope_scaling_json`)."""

from __future__ import annotations

import math

from jax_ring import nn as ring_nn

# Keys of config.json that describe the file or the run, not the computation.
HARMLESS = {
  "_name_or_path",
  "architectures",
  "model_type",
  "torch_dtype",
  "dtype",
  "transformers_version",
  "bos_token_id",
  "eos_token_id",
  "pad_token_id",
  "initializer_range",
  "use_cache",
  "cache_implementation",
  "tie_word_embeddings",
  "max_position_embeddings",
  "vocab_size",
  "output_attentions",
  "output_hidden_states",
  "return_dict",
  "is_encoder_decoder",
  "id2label",
  "label2id",
  "tokenizer_class",
  "unsloth_fixed",
  "final_logit_softcapping",
  "attn_logit_softcapping",
  "ignore_keys_at_rope_validation",  # transformers 5.0's Phi-3: which rope keys its check skips
  "auto_map",  # the repository's own code for trust_remote_code; transformers' class runs without it
}


class ConfigReader:
  """A config.json's keys for an architecture's config builder: `int`, `get`,
  `expect` (a key that must be absent or hold a value), `rope` (rotary base and
  scaling, from transformers 4.x's `rope_theta`/`rope_scaling` or 5.x's
  `rope_parameters`). `check_all_read` refuses any key the builder never read and that
  is not known to leave the computation alone, naming it."""

  def __init__(self, values: dict, where: str, defaults=None):
    self.values, self.where, self.defaults = values, where, dict(defaults or {})
    self.read = set(HARMLESS)

  def get(self, key, default=None):
    self.read.add(key)
    if key in self.values:
      return self.values[key]
    return self.defaults.get(key, default)

  def int(self, key) -> int:
    value = self.get(key)
    if value is None:
      raise ValueError(f"{self.where}: {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{self.where}: {key}={value!r} must be an int")
    return value

  def expect(self, key, value, also=()) -> None:
    for k in (key, *also):
      got = self.get(k, value)
      if got != value:
        raise ValueError(
          f"{self.where}: {k}={got!r} changes the computation and this loader does not apply it "
          f"(expected {value!r})"
        )

  def rope(self, layer_type=None, default_theta=None, **longrope):
    """(rope base, `RopeScaling` or None) of the layers of `layer_type` ("full_attention",
    "sliding_attention"; None: all layers). `longrope`: `rope_scaling`'s context_length
    and original_max_position_embeddings, for a family whose LongRoPE reads them from
    the config's top level (Phi-3)."""
    params = self.get("rope_parameters")
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
      self.read.add(key)
    if isinstance(params, dict):
      if layer_type is not None and layer_type in params:
        params = params[layer_type]
      theta = params.get("rope_theta", default_theta if layer_type == "sliding_attention" else None)
      scaling = params
    else:
      if layer_type == "sliding_attention":
        return float(default_theta), None
      theta, scaling = (
        self.values.get("rope_theta", self.defaults.get("rope_theta")),
        self.values.get("rope_scaling"),
      )
    if theta is None:
      raise ValueError(
        f"{self.where}: no rope_theta (nor rope_parameters) for the {layer_type or 'model'}'s layers"
      )
    return float(theta), rope_scaling(scaling, self.where, **longrope)

  def check_all_read(self) -> None:
    for key, value in self.values.items():
      if key not in self.read:
        raise ValueError(
          f"{self.where}: {key}={value!r} is a key this loader does not apply; it may change the "
          "computation, so the checkpoint is refused"
        )


def decoder_fields(cfg: ConfigReader) -> dict:
  """The config fields every decoder here reads alike from config.json, with
  transformers' defaults where a key may be absent (num_key_value_heads: the heads;
  head_dim: hidden_size / heads; rms_norm_eps: 1e-6). Biases and attention dropout
  are refused."""
  cfg.expect("attention_bias", False)
  cfg.expect("attention_dropout", 0.0)
  heads, dim = cfg.int("num_attention_heads"), cfg.int("hidden_size")
  optional = lambda key, absent: absent if cfg.get(key) is None else cfg.int(key)
  return dict(
    vocab_size=cfg.int("vocab_size"),
    dim=dim,
    num_layers=cfg.int("num_hidden_layers"),
    num_heads=heads,
    num_kv_heads=optional("num_key_value_heads", heads),
    head_dim=optional("head_dim", dim // heads),
    mlp_hidden=cfg.int("intermediate_size"),
    norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    context_length=cfg.int("max_position_embeddings"),
  )


def decoder_keys(config) -> dict:
  """config.json's keys for `decoder_fields` and the global rotary base, as
  transformers writes them."""
  return dict(
    vocab_size=config.vocab_size,
    hidden_size=config.dim,
    intermediate_size=config.mlp_hidden,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    max_position_embeddings=config.context_length,
    rms_norm_eps=config.norm_eps,
    rope_theta=config.rope_base,
    attention_bias=False,
    attention_dropout=0.0,
  )


def rope_scaling(values, where: str, *, context_length=None, original_max_position_embeddings=None):
  """A `jax_ring.nn.RopeScaling` from a rope_scaling / rope_parameters dict (None: none).

  "longrope" (and "su", its earlier name) as transformers reads it: the short and long
  factors, original_max_position_embeddings (in the dict, else the config's top-level
  value given here), and the attention factor: the dict's `attention_factor`, else
  sqrt(1 + ln s / ln original) with s the dict's `factor`, else context_length /
  original (1 where s <= 1)."""
  if values is None:
    return None
  kind = values.get("rope_type", values.get("type", "default"))
  if kind in ("longrope", "su") and original_max_position_embeddings is not None:
    original = int(values.get("original_max_position_embeddings") or original_max_position_embeddings)
    short, long = values.get("short_factor"), values.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list):
      raise ValueError(f"{where}: LongRoPE needs short_factor and long_factor lists; got {short!r}, {long!r}")
    scale = values.get("factor") or context_length / original
    gain = values.get("attention_factor")
    if gain is None:
      gain = longrope_attention_factor(scale, original)
    return ring_nn.RopeScaling(
      "longrope",
      factors=tuple(float(f) for f in short),
      long_factors=tuple(float(f) for f in long),
      original_max_position_embeddings=original,
      attention_factor=float(gain),
    )
  match kind:
    case "default":
      return None
    case "linear":
      return ring_nn.RopeScaling("linear", factor=float(values["factor"]))
    case "llama3":
      return ring_nn.RopeScaling(
        "llama3",
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_max_position_embeddings"]),
      )
  raise ValueError(
    f"{where}: rope scaling rope_type={kind!r} is not supported (supported: 'default', 'linear', 'llama3')"
  )


def longrope_attention_factor(scale: float, original: int) -> float:
  """LongRoPE's default attention factor for a context `scale` times the original
  length: sqrt(1 + ln scale / ln original), 1 where scale <= 1 (transformers' and
  llama.cpp's rule)."""
  return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def rope_scaling_json(scaling) -> dict | None:
  """The config.json form of a RopeScaling (transformers 4.x's `rope_scaling`)."""
  match None if scaling is None else scaling.kind:
    case None:
      return None
    case "linear":
      return {"rope_type": "linear", "factor": scaling.factor}
    case "llama3":
      return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
      }
  raise ValueError(f"rope_scaling={scaling!r} has no config.json form (a GGUF file's per-frequency factors)")
