"""Low-rank adapters (LoRA; Hu et al. 2021, arXiv 2106.09685) on a model's projections,
in and out in PEFT's format.

A targeted `nnx.Linear` becomes a `LoRALinear`: the same module with the same kernel (and
bias) at the same path, plus `lora_a` [in, r] and `lora_b` [r, out] as `nnx.LoRAParam`s
(Flax's own parameter type for adapters, a `Param`, so FSDP splits and gathers them with
the rest), and y = base(x) + (alpha / r) (x A) B, as PEFT computes it. B starts at 0, so
new adapters leave the model's logits exactly as they were. `train.step.Trainer(...,
trainable=nnx.LoRAParam)` takes gradients and AdamW state for the adapters only.

Flax NNX's `nnx.LoRA` and `nnx.LoRALinear` have no scale and keep the adapters in a
submodule of a new layer, and qwix rewrites a model's calls; a subclass of the Linear
the model already holds keeps every parameter path (so loading, saving, FSDP and the
blocks' scan see the same names) and adds only the two adapter matrices.

PEFT's layout: `adapter_config.json` ("peft_type": "LORA", "r", "lora_alpha",
"target_modules", ...) and `adapter_model.safetensors` with
`base_model.model.<the Hugging Face module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r], the module names those of the family's tensor table.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The project's target names -> a block's module path, with Hugging Face's names.
TARGETS = {
  "q": ("attn", "query"),
  "k": ("attn", "key"),
  "v": ("attn", "value"),
  "o": ("attn", "out"),
  "gate": ("mlp", "gate"),
  "up": ("mlp", "up"),
  "down": ("mlp", "down"),
}
HF_TARGETS = {
  "q_proj": "q",
  "k_proj": "k",
  "v_proj": "v",
  "o_proj": "o",
  "gate_proj": "gate",
  "up_proj": "up",
  "down_proj": "down",
}
ALL = tuple(TARGETS)
PREFIX = "base_model.model."


class LoRALinear(nnx.Linear):
  """An `nnx.Linear` with a low-rank update: y = x W (+ b) + scale (x A) B, the update
  computed in the layer's compute dtype (A and B are stored as they were made, float32
  by default). Made from a Linear by `adapt`, never by its own constructor."""

  lora_a: nnx.LoRAParam
  lora_b: nnx.LoRAParam

  def __call__(self, inputs):
    y = super().__call__(inputs)
    dt = self.dtype or inputs.dtype
    x = inputs.astype(dt)
    a, b = self.lora_a[...].astype(dt), self.lora_b[...].astype(dt)
    update = jnp.einsum("...r,ro->...o", jnp.einsum("...i,ir->...r", x, a), b)
    return y + (update * jnp.asarray(self.lora_scale, dt)).astype(y.dtype)


def adapt(linear: nnx.Linear, rank: int, scale: float, key, *, place=None) -> LoRALinear:
  """`linear` as a LoRALinear (the same kernel and bias Variables) with A drawn as PEFT
  draws it (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and B = 0,
  float32; `place(array)` puts each where it lives (FSDP's split, or replicated)."""
  new = LoRALinear.__new__(LoRALinear)
  new.__dict__.update(linear.__dict__)
  n_in, n_out = linear.in_features, linear.out_features
  bound = 1.0 / math.sqrt(n_in)
  a = jax.random.uniform(key, (n_in, rank), jnp.float32, -bound, bound)
  b = jnp.zeros((rank, n_out), jnp.float32)
  place = place or (lambda x: x)
  new.lora_a = nnx.LoRAParam(place(a))
  new.lora_b = nnx.LoRAParam(place(b))
  new.lora_scale = float(scale)
  return new


def _placer(model):
  """Where a new adapter matrix lives: split as FSDP splits weights, else replicated on
  the model's mesh (or left where it is without one)."""
  from .architectures.decoder import fsdp_spec

  mesh = model.placement[0]
  if mesh is None:
    return None
  auto = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  if getattr(model, "fsdp", False):
    return lambda x: jax.device_put(x, NamedSharding(auto, fsdp_spec(x.shape, auto)))
  return lambda x: jax.device_put(x, NamedSharding(auto, P()))


def add_lora(
  model, *, rank: int, alpha: float, targets=ALL, dropout: float = 0.0, rslora: bool = False, seed=0
):
  """Adds low-rank adapters of `rank` to `targets` of every block ("q", "k", "v", "o":
  the attention's projections, Hugging Face's q_proj, k_proj, v_proj, o_proj; "gate",
  "up", "down": the gated MLP's gate_proj, up_proj, down_proj), scaled by alpha / rank
  (alpha / sqrt(rank) with `rslora`). B = 0: the logits are the model's until trained.
  Returns the model (changed in place). ValueError naming what cannot be adapted: a
  mixture of experts' expert MLPs, a family that fuses the targets in its files
  (Phi-3's qkv_proj and gate_up_proj), adapters already in place, dropout (not
  supported: 0.0 only)."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"rank={rank!r} must be a positive int")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ValueError(f"alpha={alpha!r} must be a positive number")
  if dropout != 0.0:
    raise ValueError(f"dropout={dropout!r}: adapter dropout is not supported here; 0.0 only")
  targets = tuple(targets)
  unknown = [t for t in targets if t not in TARGETS]
  if unknown or not targets:
    raise ValueError(f"targets={targets!r}: each one of {ALL}")
  if lora_settings(model) is not None:
    raise ValueError("the model already has adapters (merge_lora them first, or build it anew)")
  _check_family(model, targets)
  scale = alpha / math.sqrt(rank) if rslora else alpha / rank
  place = _placer(model)
  keys = jax.random.split(jax.random.key(seed), len(model.blocks) * len(targets))
  at = 0
  for i, block in enumerate(model.blocks):
    for t in targets:
      parent_name, name = TARGETS[t]
      parent = getattr(block, parent_name, None)
      linear = getattr(parent, name, None)
      if not isinstance(linear, nnx.Linear):
        kind = type(linear).__name__ if linear is not None else "missing module"
        raise ValueError(
          f"targets: {t!r} of block {i}: {type(parent).__name__}.{name} is a {kind}, not a projection "
          "adapters go on (a mixture of experts' MLP: adapt its attention, targets q, k, v, o)"
        )
      setattr(parent, name, adapt(linear, rank, scale, keys[at], place=place))
      at += 1
  # Hashable (the model's graph definition keys compiled programs): the settings as pairs.
  model.lora = nnx.static(
    (("rank", rank), ("alpha", float(alpha)), ("targets", targets), ("rslora", bool(rslora)))
  )
  return model


def _check_family(model, targets):
  from .architectures import of_config

  arch = of_config(model.config)
  fused = arch.hf.fused(model.config) if arch.hf.fused is not None else {}
  parts = {p for pieces in fused.values() for p, _ in pieces}
  for t in targets:
    if any(_hf_module(arch, t, 0) + ".weight" == p.replace("{i}", "0") for p in parts):
      raise ValueError(
        f"targets: {t!r} of {arch.name}: its files store this projection fused with others (as one "
        "Hugging Face module), which adapters of their own cannot stand for; adapt the others"
      )


def lora_settings(model) -> dict | None:
  """The model's adapter settings (rank, alpha, targets, rslora), or None without adapters."""
  found = getattr(model, "lora", None)
  return dict(found) if found is not None else None


def _hf_module(arch, target: str, layer: int) -> str:
  """The Hugging Face module of `target` in block `layer`: from the family's tensor
  table, the file name of the target's kernel without ".weight"."""
  parent, name = TARGETS[target]
  want = f"blocks.{{i}}.{parent}.{name}.kernel"
  for file_name, (path, how) in arch.hf.tensors.items():
    if path == want and file_name.endswith(".weight"):
      if how != "T":
        raise ValueError(f"{arch.name}'s {file_name} is read with {how!r}: no adapter mapping for it")
      return file_name[: -len(".weight")].replace("{i}", str(layer))
  raise ValueError(f"targets: {target!r}: {arch.name} has no Hugging Face module for it")


def _adapted(model):
  """(layer, target, LoRALinear) of every adapter."""
  for i, block in enumerate(model.blocks):
    for t, (parent, name) in TARGETS.items():
      module = getattr(getattr(block, parent, None), name, None)
      if isinstance(module, LoRALinear):
        yield i, t, module


def save_lora(model, folder) -> Path:
  """The model's adapters in PEFT's layout under `folder`: adapter_config.json and
  adapter_model.safetensors (A as [r, in], B as [out, r], float32). Returns the folder."""
  from safetensors.numpy import save_file

  from .architectures import of_config

  settings = lora_settings(model)
  if settings is None:
    raise ValueError("the model has no adapters (models.add_lora)")
  arch = of_config(model.config)
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {}
  host = lambda v: np.ascontiguousarray(np.asarray(jax.device_get(v[...]), np.float32).T)
  for i, t, module in _adapted(model):
    name = PREFIX + _hf_module(arch, t, i)
    tensors[f"{name}.lora_A.weight"] = host(module.lora_a)
    tensors[f"{name}.lora_B.weight"] = host(module.lora_b)
  weights = folder / "adapter_model.safetensors"
  save_file(tensors, str(weights), metadata={"format": "pt"})
  # safetensors writes through a private temporary file (mode 0600): as every other file here.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(weights, 0o666 & ~umask)
  hf_names = {v: k for k, v in HF_TARGETS.items()}
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": settings["rank"],
    "lora_alpha": settings["alpha"],
    "target_modules": sorted(hf_names[t] for t in settings["targets"]),
    "lora_dropout": 0.0,
    "bias": "none",
    "use_rslora": settings["rslora"],
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,
    "base_model_name_or_path": None,
  }
  (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
  return folder


# Keys of adapter_config.json that change the computation, and the values supported.
_REFUSED = {
  "use_dora": (False, None),
  "modules_to_save": (None, [], ()),
  "layers_to_transform": (None, [], ()),
  "layers_pattern": (None, [], ()),
  "rank_pattern": (None, {}),
  "alpha_pattern": (None, {}),
  "fan_in_fan_out": (False, None),
  "bias": ("none", None),
  "use_qalora": (False, None),
  "target_parameters": (None, [], ()),
  "lora_bias": (False, None),
  "exclude_modules": (None, [], ()),
}


def read_adapter(folder) -> tuple[dict, dict]:
  """(settings for `add_lora`, tensors by name) of a PEFT LoRA adapter folder; ValueError
  naming any key it holds that changes the computation and is not supported."""
  from safetensors.numpy import load_file

  folder = Path(folder)
  path = folder / "adapter_config.json"
  if not path.is_file():
    raise ValueError(f"adapter={str(folder)!r}: no adapter_config.json (a PEFT adapter folder)")
  config = json.loads(path.read_text())
  if config.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only 'LORA' adapters are supported")
  for key, allowed in _REFUSED.items():
    if key in config and config[key] not in allowed:
      raise ValueError(f"{path}: {key}={config[key]!r} changes the computation and is not supported")
  targets = config.get("target_modules")
  if isinstance(targets, str):
    raise ValueError(f"{path}: target_modules={targets!r} (a pattern) is not supported; list the modules")
  ours = []
  for t in targets or ():
    if t not in HF_TARGETS:
      raise ValueError(f"{path}: target_modules holds {t!r}; supported: {sorted(HF_TARGETS)}")
    ours.append(HF_TARGETS[t])
  # lora_dropout acts in training only: an adapter's forward is the same with any.
  weights = folder / "adapter_model.safetensors"
  if not weights.is_file():
    raise ValueError(f"adapter={str(folder)!r}: no adapter_model.safetensors")
  settings = dict(
    rank=int(config["r"]),
    alpha=float(config["lora_alpha"]),
    targets=tuple(t for t in ALL if t in ours),
    rslora=bool(config.get("use_rslora", False)),
  )
  return settings, load_file(str(weights))


def load_adapter(model, folder):
  """Adds the PEFT adapter at `folder` to `model` (`read_adapter`, `add_lora`) and sets
  its A and B; ValueError naming a tensor that is missing, unexpected or of the wrong
  shape. Returns the model."""
  settings, tensors = read_adapter(folder)
  add_lora(model, **settings)
  from .architectures import of_config

  arch = of_config(model.config)
  place = _placer(model) or (lambda x: x)
  seen = set()
  for i, t, module in _adapted(model):
    name = PREFIX + _hf_module(arch, t, i)
    for part, var in (("lora_A", module.lora_a), ("lora_B", module.lora_b)):
      key = f"{name}.{part}.weight"
      if key not in tensors:
        raise ValueError(f"adapter={str(folder)!r}: no tensor {key!r}")
      value = np.asarray(tensors[key], np.float32).T
      if value.shape != var[...].shape:
        raise ValueError(
          f"adapter={str(folder)!r}: {key} has shape {value.T.shape}, expected {var[...].T.shape}"
        )
      var[...] = place(jnp.asarray(value))
      seen.add(key)
  extra = sorted(set(tensors) - seen)
  if extra:
    raise ValueError(f"adapter={str(folder)!r}: tensors {extra[:3]} match no adapter of this model")
  return model


def merge_lora(model):
  """Folds every adapter into its kernel (W + scale A B, in the kernel's dtype) and
  turns the layers back into plain `nnx.Linear`s: `models.save` then writes the merged
  weights. Returns the model (changed in place)."""
  if lora_settings(model) is None:
    raise ValueError("the model has no adapters to merge (models.add_lora)")
  for block in model.blocks:
    for parent_name, name in TARGETS.values():
      parent = getattr(block, parent_name, None)
      module = getattr(parent, name, None)
      if not isinstance(module, LoRALinear):
        continue
      kernel = module.kernel[...]
      delta = (
        module.lora_a[...].astype(jnp.float32) @ module.lora_b[...].astype(jnp.float32)
      ) * module.lora_scale
      merged = jax.jit(
        lambda k, d: (k.astype(jnp.float32) + d).astype(k.dtype), out_shardings=kernel.sharding
      )
      module.kernel[...] = merged(kernel, delta)
      plain = nnx.Linear.__new__(nnx.Linear)
      plain.__dict__.update(
        {k: v for k, v in module.__dict__.items() if k not in ("lora_a", "lora_b", "lora_scale")}
      )
      setattr(parent, name, plain)
  model.lora = nnx.static(None)
  return model


def adapter_record(model) -> dict | None:
  """What a resumed run compares: the adapters' settings (None without adapters)."""
  settings = lora_settings(model)
  if settings is None:
    return None
  return dict(settings, targets=list(settings["targets"]))
