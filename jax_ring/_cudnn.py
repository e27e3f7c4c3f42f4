"""cuDNN's fused attention as a ring step's kernel (NVIDIA GPUs), and its XLA twin.

One call of a query block against one key/value block, in the Pallas kernels' layout
(BNTH): q [B, N, T, H] pre-scaled (N = K * G; query head n reads kv head n // G), k, v
[B, K, S, H], all in the compute dtype. cuDNN takes no positions, so a call's mask is
one of two: every query sees every key, or `causal`: query row i sees key rows j <= i
(cuDNN's CAUSAL mask, aligned at the top left). The ring (`_ring`) makes each step one
such call on the rectangle of its queries and keys that the positions let through.

- `forward(q, k, v, causal=)` -> (out, lse): out [B, N, T, H] float32 (cuDNN writes
  it in the input dtype), lse [B, N, T] float32, the natural-log sum of exponentials of
  each row's scores (cuDNN's softmax statistics).
- `backward(q, k, v, out, do, lse, causal=)` -> (dq, dk, dv) float32, from the
  *global* output and lse (P = exp(S - lse), delta = rowsum(dO * O)): the share of this
  block's keys in the gradients of attention over every key (dq lacks the softmax scale).

Both reach cuDNN through JAX's private primitives (`jax._src.cudnn.
fused_attention_stablehlo`): its public `jax.nn.dot_product_attention` casts the
statistics to the output dtype (merging steps through bfloat16 lse errs 1e-2) and has
no backward that takes given statistics. TransformerEngine's JAX ring attention does the
same through its own cuDNN bindings. The primitives are checked once, at import
(`API_PROBLEM`); the kernel choice (`_choice`) falls back to the Triton kernel, with
the reason, where they differ from what this module was written against.

Where the program is lowered for anything but CUDA (a CPU mesh, in the tests), the
calls run their XLA twin (`_xla_forward`, `_xla_backward`): the same interface and
semantics written with jnp, so everything around the call (the pieces, the merges,
the backward with global statistics) is tested on CPU against float64; only the
cuDNN call itself needs a GPU. `CPU_STAND_IN` lets a CPU mesh choose this kernel.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

# Lets kernel="cudnn" run on a CPU mesh with the XLA twin in place of cuDNN (the tests
# set it, then `jax.clear_caches()`: it is read while tracing). Off, a CPU mesh refuses it.
CPU_STAND_IN = False
# cuDNN's flash attention: head dims that are multiples of 8, up to 256 on Hopper and
# later (compute capability 9.0) and 128 before; bf16 and fp16 inputs
# (`fused_attention_stablehlo.check_is_flash_attention`, `check_layout`).
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = {9: 256, 8: 128}
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# The private API as written against (jax 0.10.2 to 0.11.x).
_FWD_PARAMS = [
  *("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"),
  *("page_table_k", "page_table_v", "scale", "seed", "dropout_rate", "variadic_args", "mask_type"),
  *("layout", "sliding_window_length", "is_training"),
]
_BWD_PARAMS = [
  *("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"),
  *("page_table_k", "page_table_v", "activation", "fwd_output", "grad_output", "scale", "seed"),
  *("dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length"),
]


def _private_api():
  """(JAX's fused-attention module, None) where its private primitives are the ones this
  module calls, else (None, why not)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
  except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
    return None, f"jax {jax.__version__} has no jax._src.cudnn.fused_attention_stablehlo ({e})"
  needed = (
    "_dot_product_attention_fwd_p_wrapper",
    "_dot_product_attention_bwd_p_wrapper",
    "_dot_product_attention_fwd_impl",
    "_dot_product_attention_bwd_impl",
    "MaskType",
    "AttentionLayout",
  )
  missing = [name for name in needed if not hasattr(fa, name)]
  if missing:
    return None, f"jax {jax.__version__}'s cuDNN attention module lacks {missing}"
  for name, expected in (
    ("_dot_product_attention_fwd_impl", _FWD_PARAMS),
    ("_dot_product_attention_bwd_impl", _BWD_PARAMS),
  ):
    got = list(inspect.signature(getattr(fa, name)).parameters)
    if got != expected:
      return None, f"jax {jax.__version__}'s {name} takes {got}, not the {expected} this ring calls"
  if not all(hasattr(fa.MaskType, m) for m in ("NO_MASK", "CAUSAL")) or not hasattr(
    fa.AttentionLayout, "BNTH"
  ):
    return None, f"jax {jax.__version__}'s cuDNN MaskType / AttentionLayout lack NO_MASK, CAUSAL or BNTH"
  return fa, None


_API, API_PROBLEM = _private_api()


def is_nvidia(platform: str, device_kind: str | None) -> bool:
  """Whether a device of `platform` ("gpu", "cuda", "rocm", ...) and kind is an NVIDIA
  GPU; a "gpu" of unknown kind counts as one (the CUDA plugin's device)."""
  if platform == "cuda":
    return True
  if platform != "gpu":
    return False
  return device_kind is None or "NVIDIA" in device_kind.upper() or "TESLA" in device_kind.upper()


def max_head_dim(device_kind: str | None) -> int:
  """The largest head dim cuDNN's flash attention takes on a GPU of this kind: 256 on
  Hopper and later (and on a GPU of unknown kind), 128 before."""
  from jax_ring._policy import _capability_of_kind

  capability = None if device_kind is None else _capability_of_kind(device_kind)
  major = 9 if capability is None else int(capability.split(".")[0])
  return MAX_HEAD_DIM[9] if major >= 9 else MAX_HEAD_DIM[8]


def unsupported(platform: str, head_dim: int, policy, device_kind: str | None = None) -> str | None:
  """Why cuDNN cannot be a ring step's kernel for calls of this shape and policy, or
  None. What depends on the call's masks is `_ring`'s (`step_problem`)."""
  stand_in = platform == "cpu" and CPU_STAND_IN
  if not stand_in and not is_nvidia(platform, device_kind):
    where = platform if device_kind is None else f"{platform} ({device_kind})"
    return f"cuDNN's fused attention runs on NVIDIA GPUs; the mesh's devices are {where}"
  if API_PROBLEM is not None:
    return API_PROBLEM
  most = max_head_dim(device_kind)
  if head_dim % HEAD_DIM_MULTIPLE or head_dim > most:
    return (
      f"head_dim={head_dim}: cuDNN's fused attention needs a multiple of {HEAD_DIM_MULTIPLE} up to {most}"
    )
  if not stand_in and policy.compute_dtype not in DTYPES:
    return f"compute dtype {policy.compute_dtype}: cuDNN's fused attention takes bfloat16 or float16 inputs"
  if policy.accum_dtype != jnp.float32:
    return f"accumulation dtype {policy.accum_dtype}: the cuDNN ring merges in float32"
  return None


# --- The calls. ---


def forward(q, k, v, *, causal: bool):
  """(out [B, N, T, H] float32, lse [B, N, T] float32) of pre-scaled q against k, v:
  every key seen or, with `causal`, query row i seeing key rows j <= i."""
  return lax.platform_dependent(q, k, v, cuda=_CALLS["forward"](causal), default=_XLA["forward"](causal))


def backward(q, k, v, out, do, lse, *, causal: bool):
  """(dq [B, N, T, H], dk, dv [B, K, S, H]) float32: this block's share of the
  gradients, from the global `out` [B, N, T, H], `lse` [B, N, T] and dO."""
  args = (q, k, v, out, do, lse)
  return lax.platform_dependent(*args, cuda=_CALLS["backward"](causal), default=_XLA["backward"](causal))


def _mask(causal: bool):
  return _API.MaskType.CAUSAL if causal else _API.MaskType.NO_MASK


def _options(causal: bool) -> dict:
  """The primitives' parameters: softmax scale 1 (q comes scaled), no dropout, BNTH."""
  return dict(
    scale=1.0,
    seed=0,
    dropout_rate=0.0,
    variadic_args=(False, False),  # (has bias, has dbias)
    mask_type=_mask(causal),
    layout=_API.AttentionLayout.BNTH.value,
    sliding_window_length=None,
  )


def _unused(x):
  """The empty arrays that stand for the primitives' absent operands (bias, sequence
  lengths and offsets, page tables), as `dot_product_attention` passes them."""
  return (jnp.zeros((0,), x.dtype),) * 7


def _cudnn_forward(q, k, v, *, causal: bool):
  out, stats = _API._dot_product_attention_fwd_p_wrapper.bind(
    q, k, v, *_unused(q), is_training=True, **_options(causal)
  )
  return out.astype(jnp.float32), stats


def _cudnn_backward(q, k, v, out, do, lse, *, causal: bool):
  dq, dk, dv = _API._dot_product_attention_bwd_p_wrapper.bind(
    q, k, v, *_unused(q), lse, out.astype(q.dtype), do.astype(q.dtype), **_options(causal)
  )
  return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _scores(q, k, causal: bool):
  """Scores float32 [B, K, G, T, S] and the mask (None: whole)."""
  b, n, t, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  s_ = jnp.einsum("bkgth,bksh->bkgts", q.reshape(b, kh, n // kh, t, h), k, preferred_element_type=jnp.float32)
  seen = jnp.arange(t)[:, None] >= jnp.arange(s)[None] if causal else None
  return s_, seen


def _xla_forward(q, k, v, *, causal: bool):
  """What cuDNN's forward computes, in jnp: the output rounded to the input dtype as
  cuDNN writes it, the statistics in float32."""
  b, n, t, h = q.shape
  s, seen = _scores(q, k, causal)
  if seen is not None:
    s = jnp.where(seen, s, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)  # every row sees a key: finite
  p = jnp.exp(s - top)
  total = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bkgts,bksh->bkgth", p / total, v.astype(jnp.float32))
  lse = (top + jnp.log(total))[..., 0]
  return out.astype(q.dtype).astype(jnp.float32).reshape(b, n, t, h), lse.reshape(b, n, t)


def _xla_backward(q, k, v, out, do, lse, *, causal: bool):
  """What cuDNN's backward computes given the statistics and output, in jnp (the
  gradients rounded to the input dtype, as cuDNN writes them)."""
  b, n, t, h = q.shape
  kh = k.shape[1]
  grouped = lambda x: x.astype(jnp.float32).reshape(b, kh, n // kh, t, -1)
  s, seen = _scores(q, k, causal)
  p = jnp.exp(s - grouped(lse[..., None]))
  if seen is not None:
    p = jnp.where(seen, p, 0.0)
  do32 = grouped(do)
  delta = jnp.sum(do32 * grouped(out), axis=-1, keepdims=True)
  dv = jnp.einsum("bkgts,bkgth->bksh", p, do32)
  ds = p * (jnp.einsum("bkgth,bksh->bkgts", do32, v.astype(jnp.float32)) - delta)
  dq = jnp.einsum("bkgts,bksh->bkgth", ds, k.astype(jnp.float32)).reshape(b, n, t, h)
  dk = jnp.einsum("bkgts,bkgth->bksh", ds, grouped(q))
  as_input = lambda x: x.astype(q.dtype).astype(jnp.float32)
  return as_input(dq), as_input(dk), as_input(dv)


def _bound(fn):
  return lambda causal: functools.partial(fn, causal=causal)


_XLA = {"forward": _bound(_xla_forward), "backward": _bound(_xla_backward)}
# Where the private API is missing, the CUDA branch is never chosen (`unsupported`);
# lowering a stand-in program for CUDA would then run the twin.
_CALLS = _XLA if _API is None else {"forward": _bound(_cudnn_forward), "backward": _bound(_cudnn_backward)}
