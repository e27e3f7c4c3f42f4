"""Precision policies: which dtype each part of attention runs in, per hardware."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

ENV_VAR = "JAX_RING_POLICY"


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes and matmul precision of one attention computation.

  Attributes:
    compute_dtype: dtype of the matmul inputs (Q, K, V, probabilities).
    param_dtype: dtype in which modules store their parameters.
    output_dtype: dtype of the attention output; None means the query's dtype.
    accum_dtype: dtype of the softmax statistics (running max, sum, log-sum-exp),
      of the output accumulator and of the dK/dV accumulators that travel the ring.
      float32 by default; float64 is allowed for testing. Never lower than float32.
    wire_dtype: dtype of K/V as they cross `ppermute`; None means compute_dtype.
    precision: matmul precision passed to every einsum ("highest", "high",
      "default" or a `jax.lax.Precision`).
    exact_delta: the backward's delta = rowsum(dO * O) is taken from the output in
      accum_dtype, kept for the backward, instead of from the output after its cast
      to the (possibly narrower) output dtype. When the output is narrower (bf16) this
      keeps B x T x N x H accumulation-dtype values instead of output-dtype ones per
      attention call; otherwise it costs nothing. Measured in docs/benchmarks.md.
  """

  compute_dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  output_dtype: Any = None
  accum_dtype: Any = jnp.float32
  wire_dtype: Any = None
  precision: Any = "highest"
  exact_delta: bool = True

  def __post_init__(self):
    if not isinstance(self.exact_delta, bool):
      raise TypeError(f"Policy.exact_delta={self.exact_delta!r} must be a bool")
    for field in ("compute_dtype", "param_dtype", "accum_dtype"):
      value = getattr(self, field)
      if not jnp.issubdtype(jnp.dtype(value), jnp.floating):
        raise TypeError(f"Policy.{field}={value!r} must be a floating dtype")
      object.__setattr__(self, field, jnp.dtype(value))
    for field in ("output_dtype", "wire_dtype"):
      value = getattr(self, field)
      if value is not None:
        if not jnp.issubdtype(jnp.dtype(value), jnp.floating):
          raise TypeError(f"Policy.{field}={value!r} must be a floating dtype or None")
        object.__setattr__(self, field, jnp.dtype(value))
    if jnp.finfo(self.accum_dtype).bits < 32:
      raise ValueError(
        f"Policy.accum_dtype={self.accum_dtype} must be float32 or wider: softmax "
        "statistics merged in half precision drift as the ring grows"
      )
    if isinstance(self.precision, str):
      try:
        lax.Precision(self.precision)
      except ValueError as e:
        raise ValueError(
          f"Policy.precision={self.precision!r} must be one of 'default', 'high', "
          "'highest' or a jax.lax.Precision"
        ) from e

  @property
  def transfer_dtype(self):
    """The dtype K/V have on the wire."""
    return self.wire_dtype if self.wire_dtype is not None else self.compute_dtype

  def out_dtype(self, query_dtype):
    return self.output_dtype if self.output_dtype is not None else jnp.dtype(query_dtype)

  def delta_dtype(self, query_dtype):
    """The dtype of the output the backward takes its delta from (see exact_delta)."""
    return self.accum_dtype if self.exact_delta else self.out_dtype(query_dtype)


PRESETS: dict[str, Policy] = {
  # Exact float32 everywhere: the CPU default and the safe fallback.
  "float32": Policy(),
  # float32 storage, TF32 tensor-core matmuls (Ampere and later).
  "tf32": Policy(precision="high"),
  # bfloat16 matmuls and wire, float32 statistics and accumulators.
  "bfloat16": Policy(compute_dtype=jnp.bfloat16, precision="default"),
  # float16 matmuls with float32 accumulation (Volta, Turing tensor cores).
  "float16": Policy(compute_dtype=jnp.float16, precision="default"),
  # For tests: everything in float64 (needs jax_enable_x64).
  "float64": Policy(compute_dtype=jnp.float64, param_dtype=jnp.float64, accum_dtype=jnp.float64),
}


def get_policy(policy: Policy | str | None, device=None) -> Policy:
  """Resolves a `policy=` argument: a Policy, a preset name, or None (per device)."""
  match policy:
    case Policy():
      return policy
    case str() if policy in PRESETS:
      return PRESETS[policy]
    case str():
      raise ValueError(f"policy={policy!r} is not a preset; expected one of {sorted(PRESETS)}")
    case None:
      return policy_for(device)
    case _:
      raise TypeError(f"policy={policy!r} must be a jax_ring.Policy, a preset name or None")


# NVIDIA device kinds by compute capability major, for devices that name only their
# kind (the abstract device of a mesh being traced inside `shard_map`).
_KIND_CAPABILITY = (
  (("H100", "H200", "H800", "GH200", "B100", "B200", "GB200"), 9),
  (("A100", "A800", "A10", "A30", "A40", "L4", "L40", "RTX A", "RTX 30", "RTX 40"), 8),
  (("V100", "T4", "TITAN V", "RTX 20", "Quadro RTX"), 7),
)


def _capability_of_kind(kind: str) -> str | None:
  for names, major in _KIND_CAPABILITY:
    if any(name in kind for name in names):
      return f"{major}.0"
  return None


def _preset_name_for(device) -> tuple[str, str | None]:
  """The preset name for a device, and a warning when the device is unknown."""
  platform = getattr(device, "platform", None)
  match platform:
    case "cpu":
      return "float32", None
    case "tpu":
      return "bfloat16", None
    case "gpu" | "cuda" | "rocm":
      capability = getattr(device, "compute_capability", None)
      if capability is None:
        capability = _capability_of_kind(getattr(device, "device_kind", ""))
      if capability is None:
        kind = getattr(device, "device_kind", "?")
        return "float32", f"GPU {kind!r} has no compute_capability; using float32"
      try:
        major = int(str(capability).split(".")[0])
      except ValueError:
        return "float32", f"unreadable compute_capability={capability!r}; using float32"
      if major < 7:  # Pascal and older: half precision runs far slower than float32.
        return "float32", None
      if major == 7:  # Volta, Turing: float16 tensor cores, no bfloat16.
        return "float16", None
      return "bfloat16", None  # Ampere, Ada, Hopper, Blackwell.
    case _:
      return "float32", f"unknown platform={platform!r}; using the float32 policy"


def policy_for(device=None) -> Policy:
  """The precision preset for `device` (default: `jax.devices()[0]`), decided now.

  The environment variable JAX_RING_POLICY (a preset name) overrides the table:

  ==========================  ==========  ==========================================
  device                      preset      why
  ==========================  ==========  ==========================================
  CPU                         float32     bf16 matmul is slower than f32 on CPUs
  NVIDIA < sm_70 (Pascal)     float32     half-precision throughput is a fraction
  NVIDIA sm_7x (Volta/Turing) float16     fp16 tensor cores, no bf16
  NVIDIA >= sm_80             bfloat16    bf16 tensor cores, fp32 range
  TPU                         bfloat16    the MXU's native input type
  anything else               float32     with a warning
  ==========================  ==========  ==========================================
  """
  override = os.environ.get(ENV_VAR)
  if override:
    if override not in PRESETS:
      raise ValueError(f"{ENV_VAR}={override!r} is not a preset; expected one of {sorted(PRESETS)}")
    return PRESETS[override]
  if device is None:
    device = jax.devices()[0]
  name, warning = _preset_name_for(device)
  if warning is not None:
    warnings.warn(f"jax_ring.policy_for: {warning}", stacklevel=2)
  return PRESETS[name]
