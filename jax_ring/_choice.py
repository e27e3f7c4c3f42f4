"""Which block kernel a ring attention call runs (`choose_kernel`), and why.

Kernels: "xla" (the XLA tiles, `_kernel`), "pallas" (Triton on GPUs, Mosaic on TPUs:
`_pallas`, `_mosaic`) and "cudnn" (cuDNN's fused attention in each ring step on NVIDIA
GPUs: `_cudnn`). "auto" takes the first that supports the call: cuDNN, then Pallas, then
the XLA tiles, saying why it passed over each (INFO on the "jax_ring" logger). What a
kernel cannot take that only the call shows (masks, padding, modifiers) is checked
where the call is traced, and falls back the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from jax_ring import _cudnn, _pallas
from jax_ring._policy import get_policy

KERNELS = ("auto", "xla", "pallas", "cudnn")

_log = logging.getLogger("jax_ring")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """Which block kernel a ring attention call runs, and why.

  Attributes:
    kernel: "xla" (the XLA tiles of `_kernel`), "pallas" (the Pallas kernels) or
      "cudnn" (cuDNN's fused attention per ring step).
    reason: one sentence: why this kernel, and where "auto" (or "cudnn" on a GPU) fell
      back, what the kernel passed over does not support.
    interpret: the Pallas kernel runs in interpret mode (a CPU mesh).
    auto: chosen by "auto": a call the kernel cannot take falls back.
    asked: the kernel the call asked for ("auto", "xla", "pallas", "cudnn").
  """

  kernel: str
  reason: str
  interpret: bool = False
  auto: bool = False
  asked: str = "auto"


def log_fallback(why: str, kernel: str = "the XLA tiles") -> None:
  _log.info("jax_ring: kernel='auto' runs %s: %s", kernel, why)


def warn_fallback(why: str, kernel: str) -> None:
  """kernel='cudnn' asked for where cuDNN cannot take the call: said as a warning."""
  warnings.warn(f"jax_ring: kernel='cudnn' runs {kernel} instead: {why}", stacklevel=3)


def choose_kernel(
  kernel: str,
  platform: str,
  head_dim: int,
  policy=None,
  *,
  device_kind: str | None = None,
  kernels: tuple[str, ...] = KERNELS,
) -> KernelChoice:
  """The kernel a call runs: `kernel` is "auto", "xla", "pallas" or "cudnn"; `policy` a
  Policy, a preset name, or None (the preset of a device of `platform`: float32 on CPU,
  bfloat16 on GPU and TPU); `device_kind` the devices' kind where known
  ("NVIDIA H100 80GB HBM3"; a "gpu" of unknown kind counts as NVIDIA).

  "auto" picks the XLA tiles on CPU (the Pallas kernel runs there only interpreted);
  on an NVIDIA GPU cuDNN's fused attention where `_cudnn.unsupported` finds nothing,
  else the Pallas kernel (Triton, Mosaic on TPU) where `_pallas.unsupported` finds
  nothing, else the XLA tiles, logging each reason at INFO on the "jax_ring" logger
  (and, later, where the call's masks or `BlockSizes` do not suit the kernel). "pallas"
  raises a ValueError naming what is unsupported; on CPU it runs in interpret mode.
  "cudnn" raises a ValueError off NVIDIA GPUs (naming the platform); on one, where cuDNN
  cannot take the call it falls back as "auto" does, with a warning that says why.
  `kernels`: the names the caller takes (dilated attention: no "cudnn")."""
  if not isinstance(kernel, str) or kernel not in kernels:
    raise ValueError(f"kernel={kernel!r} must be one of {kernels}")
  if kernel == "xla":
    return KernelChoice("xla", "kernel='xla' was asked for", asked="xla")
  if policy is None:
    policy = "float32" if platform == "cpu" else "bfloat16"
  policy = get_policy(policy)
  why = _pallas.unsupported(platform, head_dim, policy)
  if kernel == "pallas":
    if why is not None:
      raise ValueError(f"kernel='pallas': {why}")
    interpret = platform == "cpu"
    reason = "kernel='pallas' was asked for" + (" (interpret mode on CPU)" if interpret else "")
    return KernelChoice("pallas", reason, interpret, asked="pallas")
  if kernel == "cudnn":
    return _choose_cudnn(platform, head_dim, policy, device_kind, why)
  if platform == "cpu":
    return KernelChoice("xla", "auto on CPU: the XLA tiles (the Pallas kernel would run interpreted)")
  if "cudnn" in kernels:
    cudnn_why = _cudnn.unsupported(platform, head_dim, policy, device_kind)
    if cudnn_why is None:
      return KernelChoice(
        "cudnn", f"auto on {platform}: cuDNN's fused attention supports this call", auto=True
      )
    if _cudnn.is_nvidia(platform, device_kind):
      log_fallback(cudnn_why, "the Pallas kernel" if why is None else "the XLA tiles")
  if why is not None:
    log_fallback(why)
    return KernelChoice("xla", f"auto: {why}")
  return KernelChoice("pallas", f"auto on {platform}: the Pallas kernel supports this call", auto=True)


def _choose_cudnn(platform, head_dim, policy, device_kind, pallas_why) -> KernelChoice:
  """kernel='cudnn': refused off NVIDIA GPUs; where cuDNN cannot take the call, the
  Pallas kernel or the XLA tiles, with a warning."""
  if platform == "cpu" and not _cudnn.CPU_STAND_IN:
    raise ValueError(
      "kernel='cudnn' runs cuDNN's fused attention on NVIDIA GPUs; the mesh's devices are on platform "
      f"'{platform}' (use kernel='auto' or 'xla')"
    )
  why = _cudnn.unsupported(platform, head_dim, policy, device_kind)
  if why is None:
    reason = "kernel='cudnn' was asked for" + (" (its XLA twin on CPU)" if platform == "cpu" else "")
    return KernelChoice("cudnn", reason, asked="cudnn")
  if not _cudnn.is_nvidia(platform, device_kind) and platform != "cpu":
    raise ValueError(f"kernel='cudnn': {why} (use kernel='auto', 'pallas' or 'xla')")
  if platform == "cpu":  # the stand-in: the Pallas kernel would run interpreted
    pallas_why = "on CPU the Pallas kernel runs only interpreted"
  instead = "the XLA tiles" if pallas_why is not None else "the Pallas kernel"
  warn_fallback(why, instead)
  if pallas_why is not None:
    return KernelChoice("xla", f"kernel='cudnn': {why}; {pallas_why}", asked="cudnn")
  return KernelChoice("pallas", f"kernel='cudnn': {why}", auto=True, asked="cudnn")
