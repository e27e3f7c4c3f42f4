"""cuDNN's fused attention as a ring step's kernel (NVIDIA GPUs), and its XLA twin.

One call of a query block against one key/value block, in the Pallas kernels' layout
(BNTH): q [B, N, T, H] pre-scaled (N = K * G; query head n reads kv head n // G), k, v
[B, K, S, H], all in the compute dtype. cuDNN takes no positions, so a call's mask is
one of two: every query sees every key, or `causal`: query row i sees key rows j <= i
(cuDNN's CAUSAL mask, aligned at the top left), with a `window` of w keys back from
there (cuDNN's sliding window, length w + 1); and `seqs` packs documents (`Sequences`:
cuDNN's "THD" layout, each document a sequence of its own, its rows' places counted
from the sequence's start). The ring (`_ring`) makes each step one such call on the
rectangle of its queries and keys that the positions let through.

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
from typing import NamedTuple

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


class Sequences(NamedTuple):
  """Documents packed in one call's rows (cuDNN's packed "THD" layout): sequence m of
  batch row b is query rows [q_off[b, m], q_off[b, m] + q_len[b, m]) against key rows
  [kv_off[b, m], kv_off[b, m] + kv_len[b, m]), and nothing else; under `causal` and
  `window` a query's place in its sequence is compared with a key's place in its own.
  q_len, kv_len [B, M] int32; q_off, kv_off [B, M + 1] int32; unused entries -1. Rows
  in no sequence get output 0 and lse -inf, and no gradient."""

  q_len: jax.Array
  kv_len: jax.Array
  q_off: jax.Array
  kv_off: jax.Array


def forward(q, k, v, *, causal: bool, window: int | None = None, seqs: Sequences | None = None):
  """(out [B, N, T, H] float32, lse [B, N, T] float32) of pre-scaled q against k, v:
  every key seen or, with `causal`, query row i seeing key rows j <= i; `window` w
  (with `causal`) hides keys j < i - w; `seqs` packs documents (`Sequences`)."""
  call = functools.partial(_call, "forward", causal=causal, window=window)
  extra = () if seqs is None else tuple(seqs)
  return lax.platform_dependent(q, k, v, *extra, cuda=call(cuda=True), default=call(cuda=False))


def backward(
  q, k, v, out, do, lse, *, causal: bool, window: int | None = None, seqs: Sequences | None = None
):
  """(dq [B, N, T, H], dk, dv [B, K, S, H]) float32: this block's share of the
  gradients, from the global `out` [B, N, T, H], `lse` [B, N, T] and dO."""
  call = functools.partial(_call, "backward", causal=causal, window=window)
  extra = () if seqs is None else tuple(seqs)
  args = (q, k, v, out, do, lse, *extra)
  return lax.platform_dependent(*args, cuda=call(cuda=True), default=call(cuda=False))


def _call(which: str, *, causal: bool, window, cuda: bool):
  """The function `forward`/`backward` run on CUDA (`cuda`) or elsewhere (the twin)."""
  if which == "forward":

    def run(q, k, v, *seqs):
      seqs = Sequences(*seqs) if seqs else None
      if cuda and _API is not None:
        return _cudnn_forward(q, k, v, causal=causal, window=window, seqs=seqs)
      return _xla_forward(q, k, v, causal=causal, window=window, seqs=seqs)

  else:

    def run(q, k, v, out, do, lse, *seqs):
      seqs = Sequences(*seqs) if seqs else None
      if cuda and _API is not None:
        return _cudnn_backward(q, k, v, out, do, lse, causal=causal, window=window, seqs=seqs)
      return _xla_backward(q, k, v, out, do, lse, causal=causal, window=window, seqs=seqs)

  return run


def _mask(causal: bool, packed: bool):
  kinds = _API.MaskType
  if packed:
    return kinds.PADDING_CAUSAL if causal else kinds.PADDING
  return kinds.CAUSAL if causal else kinds.NO_MASK


def _options(causal: bool, window, packed: bool = False) -> dict:
  """The primitives' parameters: softmax scale 1 (q comes scaled), no dropout, BNTH
  (BTNH for packed documents: cuDNN's offsets count whole tokens); cuDNN's window
  length counts the query's own key, so a window of w keys back is w + 1."""
  layout = _API.AttentionLayout.BTNH if packed else _API.AttentionLayout.BNTH
  return dict(
    scale=1.0,
    seed=0,
    dropout_rate=0.0,
    variadic_args=(False, False),  # (has bias, has dbias)
    mask_type=_mask(causal, packed),
    layout=layout.value,
    sliding_window_length=None if window is None else window + 1,
  )


def _empty(x, n: int):
  """The empty arrays that stand for the primitives' absent operands, as
  `dot_product_attention` passes them."""
  return (jnp.zeros((0,), x.dtype),) * n


def _btnh(x):
  """[B, N, T, H] <-> [B, T, N, H]."""
  return jnp.swapaxes(x, 1, 2)


def _operands(q, seqs: Sequences | None):
  """bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v."""
  if seqs is None:
    return _empty(q, 7)
  return (*_empty(q, 1), *seqs, *_empty(q, 2))


def _cudnn_forward(q, k, v, *, causal: bool, window, seqs: Sequences | None):
  packed = seqs is not None
  ins = (_btnh(q), _btnh(k), _btnh(v)) if packed else (q, k, v)
  out, stats = _API._dot_product_attention_fwd_p_wrapper.bind(
    *ins, *_operands(q, seqs), is_training=True, **_options(causal, window, packed)
  )
  if not packed:
    return out.astype(jnp.float32), stats
  rows = row_sequences(seqs.q_len, seqs.q_off, q.shape[2])
  return _only_covered(_btnh(out).astype(jnp.float32), lse_of_stats(stats, rows), rows)


def _cudnn_backward(q, k, v, out, do, lse, *, causal: bool, window, seqs: Sequences | None):
  packed = seqs is not None
  if packed:
    stats = stats_of_lse(lse, seqs.q_len, seqs.q_off)
    q, k, v, out, do = map(_btnh, (q, k, v, out, do))
  else:
    stats = lse
  dq, dk, dv = _API._dot_product_attention_bwd_p_wrapper.bind(
    q,
    k,
    v,
    *_operands(q, seqs),
    stats,
    out.astype(q.dtype),
    do.astype(q.dtype),
    **_options(causal, window, packed),
  )
  grads = [g.astype(jnp.float32) for g in (dq, dk, dv)]
  if not packed:
    return tuple(grads)
  dq, dk, dv = map(_btnh, grads)
  q_rows = row_sequences(seqs.q_len, seqs.q_off, dq.shape[2])[0] >= 0
  k_rows = row_sequences(seqs.kv_len, seqs.kv_off, dk.shape[2])[0] >= 0
  zero = lambda g, rows: jnp.where(rows[:, None, :, None], g, 0.0)
  return zero(dq, q_rows), zero(dk, k_rows), zero(dv, k_rows)


# --- Packed documents: where each row sits, and cuDNN's statistics. ---
#
# cuDNN numbers a call's sequences across its batch rows in order (JAX's
# `_fix_seqlen_offsets` shifts the used entries of [B, M] to the front), and writes its
# softmax statistics per sequence: [B * M, N, T], entry (g, n, i) for the i-th query of
# sequence g.


def sequence_numbers(q_len):
  """[B, M] -> cuDNN's number of each used sequence (entries with q_len >= 0), -1 else."""
  used = q_len >= 0
  g = jnp.cumsum(used.reshape(-1)).reshape(used.shape) - 1
  return jnp.where(used, g, -1)


def row_sequences(q_len, q_off, t: int):
  """(sequence number g [B, T], place in it [B, T]) of each of t rows; -1 and 0 for
  rows in no sequence."""
  numbers = sequence_numbers(q_len)
  off = q_off[:, : q_len.shape[1]]
  rows = jnp.arange(t, dtype=jnp.int32)
  inside = (q_len[..., None] > 0) & (rows >= off[..., None]) & (rows < (off + q_len)[..., None])  # [B, M, T]
  m = jnp.argmax(inside, axis=1)
  covered = jnp.any(inside, axis=1)
  g = jnp.where(covered, jnp.take_along_axis(numbers, m, axis=1), -1)
  place = jnp.where(covered, rows - jnp.take_along_axis(off, m, axis=1), 0)
  return g, place


def lse_of_stats(stats, rows):
  """cuDNN's statistics [G, N, T] -> lse [B, N, T] of the rows (`row_sequences`)."""
  g, place = rows
  picked = stats[jnp.maximum(g, 0), :, place]  # [B, T, N]
  return jnp.moveaxis(picked, -1, 1)


def stats_of_lse(lse, q_len, q_off):
  """lse [B, N, T] -> cuDNN's statistics [B * M, N, T] (0 past a sequence's end)."""
  b, n, t = lse.shape
  m = q_len.shape[1]
  numbers = sequence_numbers(q_len).reshape(-1)
  # Entry g of the statistics is the used entry numbered g, if any (comparisons, not a
  # scatter: XLA:CPU makes a scatter a loop).
  entry = numbers[None, :] == jnp.arange(b * m, dtype=numbers.dtype)[:, None]  # [G, B * M]
  take = lambda x: jnp.sum(jnp.where(entry, x.reshape(-1)[None, :].astype(jnp.int32), 0), axis=1)
  batch = take(jnp.repeat(jnp.arange(b, dtype=jnp.int32), m))
  start = take(q_off[:, :m])
  length = take(q_len)
  places = jnp.arange(t, dtype=jnp.int32)
  rows = jnp.clip(start[:, None] + places, 0, t - 1)  # [G, T]
  picked = lse[batch[:, None], :, rows]  # [G, T, N]
  return jnp.where((places < length[:, None])[..., None], picked, 0.0).transpose(0, 2, 1)


def _only_covered(out, lse, rows):
  covered = rows[0] >= 0
  return jnp.where(covered[:, None, :, None], out, 0.0), jnp.where(covered[:, None], lse, -jnp.inf)


# --- The twin. ---


def _seen(t: int, s: int, causal: bool, window, seqs: Sequences | None):
  """The mask [B or 1, T, S] of what a call lets through (None: everything)."""
  if seqs is None:
    if not causal and window is None:
      return None
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None]
    seen = (j <= i) if causal else jnp.ones((t, s), bool)
    if window is not None:
      seen &= i - j <= window
    return seen[None]
  qg, qi = row_sequences(seqs.q_len, seqs.q_off, t)
  kg, kj = row_sequences(seqs.kv_len, seqs.kv_off, s)
  seen = (qg[:, :, None] >= 0) & (qg[:, :, None] == kg[:, None, :])
  if causal:
    seen &= kj[:, None, :] <= qi[:, :, None]
  if window is not None:
    seen &= qi[:, :, None] - kj[:, None, :] <= window
  return seen


def _scores(q, k):
  """Scores float32 [B, K, G, T, S]."""
  b, n, t, h = q.shape
  kh = k.shape[1]
  return jnp.einsum(
    "bkgth,bksh->bkgts", q.reshape(b, kh, n // kh, t, h), k, preferred_element_type=jnp.float32
  )


def dense_forward(q, k, v, seen):
  """(out [B, N, T, H], lse [B, N, T]) float32 of pre-scaled q against k, v where `seen`
  [B or 1, T, S] (None: everywhere) lets a query see a key; rows that see nothing: 0,
  -inf. The twin's forward, and the ring's step where cuDNN's masks cannot say which
  keys a query sees (`_ring`: a window's edge across a step)."""
  b, n, t, h = q.shape
  s_ = _scores(q, k)
  if seen is not None:
    s_ = jnp.where(seen[:, None, None], s_, -jnp.inf)
  top = jnp.max(s_, axis=-1, keepdims=True)
  safe = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.exp(s_ - safe)
  total = jnp.sum(p, axis=-1, keepdims=True)
  some = total > 0
  out = jnp.einsum("bkgts,bksh->bkgth", p / jnp.where(some, total, 1.0), v.astype(jnp.float32))
  lse = jnp.where(some, safe + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf)[..., 0]
  return out.reshape(b, n, t, h), lse.reshape(b, n, t)


def dense_backward(q, k, v, out, do, lse, seen):
  """(dq, dk, dv) float32 of `dense_forward`'s keys, from the global `out`, `lse` and dO
  (dq lacks the softmax scale, as cuDNN's)."""
  b, n, t, h = q.shape
  kh = k.shape[1]
  grouped = lambda x: x.astype(jnp.float32).reshape(b, kh, n // kh, t, -1)
  s_ = _scores(q, k)
  finite = jnp.isfinite(lse)
  p = jnp.exp(s_ - grouped(jnp.where(finite, lse, 0.0)[..., None]))
  keep = finite.reshape(b, kh, n // kh, t, 1)
  if seen is not None:
    keep = keep & seen[:, None, None]
  p = jnp.where(keep, p, 0.0)
  do32 = grouped(do)
  delta = jnp.sum(do32 * grouped(out), axis=-1, keepdims=True)
  dv = jnp.einsum("bkgts,bkgth->bksh", p, do32)
  ds = p * (jnp.einsum("bkgth,bksh->bkgts", do32, v.astype(jnp.float32)) - delta)
  dq = jnp.einsum("bkgts,bksh->bkgth", ds, k.astype(jnp.float32)).reshape(b, n, t, h)
  dk = jnp.einsum("bkgts,bkgth->bksh", ds, grouped(q))
  return dq, dk, dv


def _xla_forward(q, k, v, *, causal: bool, window=None, seqs: Sequences | None = None):
  """What cuDNN's forward computes, in jnp: the output rounded to the input dtype as
  cuDNN writes it, the statistics in float32. Packed documents (`seqs`) go through
  cuDNN's statistics layout (`stats_of_lse`, `lse_of_stats`), as the call's do."""
  t = q.shape[2]
  out, lse = dense_forward(q, k, v, _seen(t, k.shape[2], causal, window, seqs))
  out = out.astype(q.dtype).astype(jnp.float32)
  if seqs is None:
    return out, lse
  rows = row_sequences(seqs.q_len, seqs.q_off, t)
  stats = stats_of_lse(lse, seqs.q_len, seqs.q_off)
  return _only_covered(out, lse_of_stats(stats, rows), rows)


def _xla_backward(q, k, v, out, do, lse, *, causal: bool, window=None, seqs: Sequences | None = None):
  """What cuDNN's backward computes given the statistics and output, in jnp (the
  gradients rounded to the input dtype, as cuDNN writes them)."""
  t = q.shape[2]
  if seqs is not None:  # the statistics as the packed call takes them
    lse = lse_of_stats(stats_of_lse(lse, seqs.q_len, seqs.q_off), row_sequences(seqs.q_len, seqs.q_off, t))
  grads = dense_backward(q, k, v, out, do, lse, _seen(t, k.shape[2], causal, window, seqs))
  return tuple(g.astype(q.dtype).astype(jnp.float32) for g in grads)
