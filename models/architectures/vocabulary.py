"""The vocabulary's two ends with the table split over devices along the vocabulary and
never gathered: the embedding lookup (`embed`) and the output head's cross-entropy
(`cross_entropy`), each a ring over the devices that hold the table's shards, as ring
attention is over the sequence. Each device keeps its own tokens and the table's
shards rotate past them; in the backward pass each shard's gradient travels with the
shard and arrives home holding every device's contribution. Where a device has fewer
tokens than a shard has rows, the lookup turns this around (`embed(moving="rows")`):
the tokens travel and the shards stay. A device needs one shard of the
table and of its gradient at a time and [B, chunk, V / n] logits, where gathering the
table would put [V, D] and its float32 gradient on every device (Gemma 3's
262,144 x 640: 2.7 GiB of temporaries a device for the two ends, compiled).

Both run inside `jax.shard_map` over `axes`, the mesh axes the table's first dimension
is split over: `table` is the device's shard [V / n, D], shard i holding rows
[i V / n, (i + 1) V / n); tokens and hidden states are the device's own, split over
`token_axes`. The table's gradient is summed over the token axes it is not split over;
results are the same on the devices of the table axes the tokens are not split over.

Legend: B batch, T the device's tokens, D width, V vocabulary, n devices of `axes`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring import mesh_platform, sent_together


def _ring(axes):
  n = lax.axis_size(axes)
  me = lax.axis_index(axes)
  perm = [(i, (i + 1) % n) for i in range(n)]
  return n, me, lambda x: lax.ppermute(x, axes, perm)


def _owner(me, step, n):
  """The shard a device holds after `step` moves to the next device."""
  return (me - step) % n


def _same_over(x, table_axes, token_axes):
  """A result every device of the table's other axes computed alike, typed as such."""
  extra = tuple(a for a in table_axes if a not in token_axes)
  return lax.pmax(x, extra) if extra else x


def _summed_over(grad, table_axes, token_axes):
  """The table's gradient summed over the token axes it is not split over."""
  extra = tuple(a for a in token_axes if a not in table_axes)
  return lax.psum(grad, extra) if extra else grad


def _copies(table_axes, token_axes):
  """How many devices of the ring hold the same tokens (the table axes the tokens are
  not split over): each adds the same contribution to a shard's gradient."""
  extra = tuple(a for a in table_axes if a not in token_axes)
  return lax.axis_size(extra) if extra else 1


def _varying(x, *like):
  """`x` typed as varying over every mesh axis `like`'s arrays vary over (a scan carry
  must keep its type): zeros of theirs added."""
  return x + sum(jnp.zeros_like(a, shape=(), dtype=x.dtype) for a in like)


# --- The embedding lookup. ---


def embed(table, tokens, axes, token_axes=(), moving: str | None = None):
  """Rows of the split table for the device's tokens int [B, T] -> [B, T, D].

  `moving`: what travels the ring. "table": the table's shards rotate past each
  device's tokens (V / n x D a step). "rows": each device's tokens and their partial
  embeddings [B, T, D] rotate past the shards instead, collecting a shard's rows at
  each device, and come home whole. None picks the smaller: the rows while a device
  has fewer tokens than a shard has rows (reading a document: Gemma 3's shard of
  32,768 rows on 8 devices is 80 MiB, 512 tokens' rows 1.25 MiB), the table beyond.
  The two are equal bit for bit: every token gets its one row plus zeros."""
  if moving is None:
    moving = "rows" if tokens.size < table.shape[0] else "table"
  if moving not in ("table", "rows"):
    raise ValueError(f"moving={moving!r}: 'table', 'rows' or None")
  lookup = _embed_table if moving == "table" else _embed_rows
  return lookup(table, tokens, axes, tuple(token_axes))


def _found(table, tokens, owner):
  """Rows of the table shard of device `owner` for the tokens it holds, 0 for others."""
  rows = table.shape[0]
  local = tokens - owner * rows
  inside = (local >= 0) & (local < rows)
  return jnp.where(inside[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)


def _scatter(grad, tokens, g, owner):
  """grad [V / n, D] with the rows of g [..., D] added at the tokens shard `owner` holds."""
  rows = grad.shape[0]
  local = (tokens - owner * rows).reshape(-1)
  index = jnp.where((local >= 0) & (local < rows), local, rows)  # rows: dropped
  return grad.at[index].add(g.reshape(-1, g.shape[-1]), mode="drop")


def _no_rows(table, tokens):
  """Zero rows [B, T, D] for the tokens, typed like both inputs (a scan carry)."""
  return _varying(jnp.zeros((*tokens.shape, table.shape[1]), table.dtype), table, tokens)


def _no_grad(table, *like):
  """A zero float32 gradient of the table shard, typed like every input (a scan carry)."""
  return _varying(jnp.zeros(table.shape, jnp.float32), table, *like)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _embed_table(table, tokens, axes, token_axes=()):
  return _embed_table_fwd(table, tokens, axes, token_axes)[0]


def _embed_table_fwd(table, tokens, axes, token_axes=()):
  n, me, send = _ring(axes)

  def step(carry, s):
    shard, x = carry
    return (send(shard), x + _found(shard, tokens, _owner(me, s, n)).astype(x.dtype)), None

  x = _no_rows(table, tokens)
  (_, x), _ = lax.scan(step, (table, x), jnp.arange(n))
  return _same_over(x, axes, token_axes), (table, tokens)


def _embed_table_bwd(axes, token_axes, res, g):
  table, tokens = res
  n, me, send = _ring(axes)
  g = g.astype(jnp.float32) / _copies(axes, token_axes)

  def step(grad, s):
    return send(_scatter(grad, tokens, g, _owner(me, s, n))), None

  grad = _no_grad(table, tokens, g)
  grad, _ = lax.scan(step, grad, jnp.arange(n))
  return _summed_over(grad, axes, token_axes).astype(table.dtype), None


_embed_table.defvjp(_embed_table_fwd, _embed_table_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _embed_rows(table, tokens, axes, token_axes=()):
  return _embed_rows_fwd(table, tokens, axes, token_axes)[0]


def _embed_rows_fwd(table, tokens, axes, token_axes=()):
  n, me, send = _ring(axes)

  def step(carry, _):
    t, x = carry  # another device's tokens and their rows so far
    return send((t, x + _found(table, t, me).astype(x.dtype))), None

  x = _no_rows(table, tokens)
  (_, x), _ = lax.scan(step, (_varying(tokens, table), x), None, length=n)  # n moves: home again
  return _same_over(x, axes, token_axes), (table, tokens)


def _embed_rows_bwd(axes, token_axes, res, g):
  """Every device's tokens and gradient rows gathered (T x D each, small beside a
  shard: the reason this way was picked), then one scatter-add into this device's
  shard. Made from zeros at the end, the scatter is what XLA adds in place into the
  head's gradient of a tied table (add(x, scatter(0, ...)) -> scatter(x, ...)): no second
  shard-sized gradient (Gemma 3's: 80 MiB a device on 8)."""
  table, tokens = res
  n, me, _ = _ring(axes)
  g = g.astype(jnp.float32) / _copies(axes, token_axes)
  with jax.named_scope("embedding_rows"):  # (tests tell these from weight gathers by the name)
    seen = lax.all_gather(_varying(tokens, table), axes, tiled=True)
    rows = lax.all_gather(_varying(g, table), axes, tiled=True)
  grad = _scatter(jnp.zeros(table.shape, jnp.float32), seen, rows, me)
  return _summed_over(_varying(grad, table, tokens, g), axes, token_axes).astype(table.dtype), None


_embed_rows.defvjp(_embed_rows_fwd, _embed_rows_bwd)


# --- The head's cross-entropy. ---

# The shard's gradient takes each chunk's share [rows, D] in blocks of at most this many
# rows, added where the gradient lies: whole, the share was a second array of the
# shard's size beside the gradient (Gemma 3 270M on 8 devices: 80 MiB a device).
# Blocks thinner than MIN_ROW_BLOCK are not worth a loop: the share is added whole.
ROW_BLOCK, MIN_ROW_BLOCK = 4096, 256


def _row_block(rows: int) -> int:
  """The largest divisor of `rows` up to ROW_BLOCK, or `rows` where that is under
  MIN_ROW_BLOCK."""
  block = max(d for d in range(1, min(rows, ROW_BLOCK) + 1) if rows % d == 0)
  return block if block >= MIN_ROW_BLOCK else rows


def _add_shares(grad, dd, dlogits, hh, whole, spec, scale):
  """One chunk's shares: dd + the hidden states' (dlogits [B, c, rows] against the
  shard `whole`) and grad + scale x the shard's gradient (dlogits against hh [B, c,
  D]), the latter in row blocks updated in place where a chunk's B c tokens are at
  most D / 2. XLA copies dlogits into the blocks' loop ([B c, rows] where the whole
  share is [rows, D]): with more tokens the copy costs more than the blocks save
  (Gemma 3 270M on one device: 512 tokens, 640 wide, 512 MiB copied)."""
  axis = spec.index("v")
  rows = grad.shape[axis]
  hh = hh.astype(jnp.float32)
  dd = dd + jnp.einsum(f"bcv,{spec}->bcd", dlogits, whole)
  tokens = dlogits.shape[0] * dlogits.shape[1]
  block = _row_block(rows) if 2 * tokens <= hh.shape[-1] else rows
  if block == rows:
    return grad + scale * jnp.einsum(f"bcv,bcd->{spec}", dlogits, hh), dd

  def one(j, grad):
    start = j * block
    part = lax.dynamic_slice_in_dim(dlogits, start, block, axis=2)
    add = scale * jnp.einsum(f"bcv,bcd->{spec}", part, hh)
    old = lax.dynamic_slice_in_dim(grad, start, block, axis)
    return lax.dynamic_update_slice_in_dim(grad, old + add, start, axis)

  return lax.fori_loop(0, rows // block, one, grad), dd


def _chunks(x, chunk):
  """[B, T, ...] -> [T / chunk, B, chunk, ...] (T a multiple of chunk)."""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)


def _unchunk(x):
  k, b, c = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, k * c, *x.shape[3:])


def cross_entropy(h, table, targets, axes, chunk, token_axes=(), transposed=False, moving: str | None = None):
  """Per-token cross-entropy float32 [B, T] of the logits h [B, T, D] @ (the whole
  table).T against int targets [B, T]; T a multiple of `chunk`. `transposed`: the
  table's shard is [D, V / n] (an untied head's kernel), used as it lies.

  `moving`: what travels the ring. "table": the table's shards (V / n x D a step), and
  in the backward each shard's float32 gradient one step behind it. "rows": each
  device's hidden states with their running softmax statistics (B T x D a step), and in
  the backward with their gradient; every shard and its gradient stay home. None picks
  the rows on a CPU mesh where a device has fewer tokens than a shard has rows (Gemma 3's
  262,144-row table on 8 simulated devices at 128 tokens a device: 1 MiB of rows a step,
  where the table's shard and its gradient were 80 MiB each, and five of them alive at
  once), else the table: on GPUs and TPUs each shard's transfer runs under the step's
  GEMM (compiled for 8 x H100: tests/test_aot.py), where the rows, which the step
  updates, would wait for it."""
  if moving is None:
    fewer = targets.size < table.shape[1 if transposed else 0]
    moving = "rows" if fewer and mesh_platform() == "cpu" else "table"
  if moving not in ("table", "rows"):
    raise ValueError(f"moving={moving!r}: 'table', 'rows' or None")
  ring = _ce_table if moving == "table" else _ce_rows
  return ring(h, table, targets, axes, chunk, tuple(token_axes), transposed)


def entropy(h, table, axes, chunk, token_axes=(), transposed=False):
  """Each position's entropy of the softmax over the whole vocabulary float32 [B, T]
  (the logits h [B, T, D] @ table.T, T a multiple of `chunk`), the table's shards
  passing each device in a ring (`cross_entropy`'s "table"): online over the shards,
  log l + m - s / l with m the running maximum, l the sum of exp(logit - m) and s that
  of exp(logit - m) logit. A statistic: no gradient is defined through it."""
  n, _, send = _ring(axes)
  spec = _spec(transposed)
  hc = _chunks(h, chunk)

  def step(carry, _):
    shard, m, l, s = carry

    def per_chunk(_, xs):
      hh, mm, ll, ss = xs
      logits = jnp.einsum(f"bcd,{spec}->bcv", hh, shard.astype(hh.dtype), preferred_element_type=jnp.float32)
      new = jnp.maximum(mm, logits.max(-1))
      scale = jnp.exp(mm - new)
      e = jnp.exp(logits - new[..., None])
      return None, (new, ll * scale + e.sum(-1), ss * scale + (e * logits).sum(-1))

    _, (m, l, s) = lax.scan(per_chunk, None, (hc, m, l, s))
    return (send(shard), m, l, s), None

  stats = _varying(jnp.zeros(hc.shape[:3], jnp.float32), h, table)
  (_, m, l, s), _ = lax.scan(step, (table, stats - jnp.inf, stats, stats), jnp.arange(n))
  return _same_over(_unchunk(m + jnp.log(l) - s / l), axes, token_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ce_table(h, table, targets, axes, chunk, token_axes=(), transposed=False):
  return _ce_fwd(h, table, targets, axes, chunk, token_axes, transposed)[0]


def _spec(transposed):
  return "dv" if transposed else "vd"


def _ce_fwd(h, table, targets, axes, chunk, token_axes=(), transposed=False):
  n, me, send = _ring(axes)
  rows = table.shape[1 if transposed else 0]
  spec = _spec(transposed)
  hc, tc = _chunks(h, chunk), _chunks(targets, chunk)

  def step(carry, s):
    shard, m, l, picked = carry
    offset = _owner(me, s, n) * rows

    def per_chunk(_, xs):
      hh, tt, mm, ll, pp = xs
      logits = jnp.einsum(f"bcd,{spec}->bcv", hh, shard.astype(hh.dtype), preferred_element_type=jnp.float32)
      new = jnp.maximum(mm, logits.max(-1))
      ll = ll * jnp.exp(mm - new) + jnp.exp(logits - new[..., None]).sum(-1)
      local = tt - offset
      inside = (local >= 0) & (local < rows)
      at = jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
      return None, (new, ll, pp + jnp.where(inside, at, 0.0))

    _, (m, l, picked) = lax.scan(per_chunk, None, (hc, tc, m, l, picked))
    return (send(shard), m, l, picked), None

  stats = _varying(jnp.zeros(tc.shape, jnp.float32), h, table, targets)
  start = (table, stats - jnp.inf, stats, stats)
  (_, m, l, picked), _ = lax.scan(step, start, jnp.arange(n))
  lse = m + jnp.log(l)
  return _same_over(_unchunk(lse - picked), axes, token_axes), (h, table, targets, lse)


def _ce_bwd(axes, chunk, token_axes, transposed, res, g):
  h, table, targets, lse = res
  n, me, send = _ring(axes)
  rows = table.shape[1 if transposed else 0]
  spec = _spec(transposed)
  hc, tc, gc = _chunks(h, chunk), _chunks(targets, chunk), _chunks(g.astype(jnp.float32), chunk)
  share = 1.0 / _copies(axes, token_axes)  # of a shard's gradient, from each copy of the tokens

  def contribution(shard, s, dh):
    """This device's share of the gradient of the shard it holds at step s, and dh."""
    offset = _owner(me, s, n) * rows
    whole = shard.astype(jnp.float32)

    def per_chunk(grad, xs):
      hh, tt, ll, gg, dd = xs
      logits = jnp.einsum(f"bcd,{spec}->bcv", hh, shard.astype(hh.dtype), preferred_element_type=jnp.float32)
      onehot = jnp.arange(rows) == (tt - offset)[..., None]  # no column where the target is elsewhere
      dlogits = gg[..., None] * (jnp.exp(logits - ll[..., None]) - onehot)
      grad, dd = _add_shares(grad, dd, dlogits, hh, whole, spec, share)
      return grad, dd

    return lax.scan(per_chunk, _no_grad(table, h, targets, g), (hc, tc, lse, gc, dh))

  # A shard's gradient travels one step behind the shard: at step s a device sends on
  # the gradient of the shard it held at step s - 1 (with its share added) while it
  # computes its share for the shard it holds now, so no transfer waits for the step's
  # compute. Both go to the next device: on GPU bundled into one transfer (XLA keeps one
  # collective in flight there and runs a second synchronously), on TPU apart
  # (`_ring.sent_together`, as the attention's ring sends). After the last step each
  # gradient is one device short of home.

  def step(carry, s):
    shard, pending, dh = carry
    shard_next, arrived = sent_together((shard, pending), send)
    mine, dh = contribution(shard, s, dh)
    return (shard_next, arrived + mine, dh), None

  dh = _varying(jnp.zeros(hc.shape, jnp.float32), h, table, targets, g)
  first, dh = contribution(table, 0, dh)
  (_, pending, dh), _ = lax.scan(step, (send(table), first, dh), jnp.arange(1, n))
  grad = send(pending)
  dh = _same_over(_unchunk(dh), axes, token_axes)
  return dh.astype(h.dtype), _summed_over(grad, axes, token_axes).astype(table.dtype), None


_ce_table.defvjp(_ce_fwd, _ce_bwd)


def _shard_logits(hh, shard, spec):
  return jnp.einsum(f"bcd,{spec}->bcv", hh, shard.astype(hh.dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ce_rows(h, table, targets, axes, chunk, token_axes=(), transposed=False):
  return _ce_rows_fwd(h, table, targets, axes, chunk, token_axes, transposed)[0]


def _ce_rows_fwd(h, table, targets, axes, chunk, token_axes=(), transposed=False):
  """Each device's hidden states and targets visit every device with their running
  (max, sum, target logit), which the shard there updates; n moves bring them home."""
  n, me, send = _ring(axes)
  rows = table.shape[1 if transposed else 0]
  spec = _spec(transposed)
  offset = me * rows

  def update(hc, tc, m, l, picked):
    def per_chunk(_, xs):
      hh, tt, mm, ll, pp = xs
      logits = _shard_logits(hh, table, spec)
      new = jnp.maximum(mm, logits.max(-1))
      ll = ll * jnp.exp(mm - new) + jnp.exp(logits - new[..., None]).sum(-1)
      local = tt - offset
      inside = (local >= 0) & (local < rows)
      at = jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
      return None, (new, ll, pp + jnp.where(inside, at, 0.0))

    return lax.scan(per_chunk, None, (hc, tc, m, l, picked))[1]

  def step(carry, _):
    hc, tc, m, l, picked = carry  # another device's tokens, with what the shards so far gave
    return send((hc, tc, *update(hc, tc, m, l, picked))), None

  hc, tc = _chunks(h, chunk), _chunks(targets, chunk)
  stats = _varying(jnp.zeros(tc.shape, jnp.float32), h, table, targets)
  start = (_varying(hc, table, targets), _varying(tc, h, table), stats - jnp.inf, stats, stats)
  (_, _, m, l, picked), _ = lax.scan(step, start, None, length=n)
  lse = m + jnp.log(l)
  return _same_over(_unchunk(lse - picked), axes, token_axes), (h, table, targets, lse)


def _ce_rows_bwd(axes, chunk, token_axes, transposed, res, g):
  """The visitors travel again with their lse, cotangent and the dh the shards so far
  gave; each device adds its shard's share to their dh and their share to its own
  shard's gradient, which never moves."""
  h, table, targets, lse = res
  n, me, send = _ring(axes)
  rows = table.shape[1 if transposed else 0]
  spec = _spec(transposed)
  offset = me * rows
  share = 1.0 / _copies(axes, token_axes)
  whole = table.astype(jnp.float32)

  def visit(grad, hc, tc, lc, gc, dh):
    def per_chunk(grad, xs):
      hh, tt, ll, gg, dd = xs
      logits = _shard_logits(hh, table, spec)
      onehot = jnp.arange(rows) == (tt - offset)[..., None]
      dlogits = gg[..., None] * (jnp.exp(logits - ll[..., None]) - onehot)
      grad, dd = _add_shares(grad, dd, dlogits, hh, whole, spec, share)
      return grad, dd

    return lax.scan(per_chunk, grad, (hc, tc, lc, gc, dh))

  def step(carry, _):
    (hc, tc, lc, gc, dh), grad = carry
    grad, dh = visit(grad, hc, tc, lc, gc, dh)
    return (send((hc, tc, lc, gc, dh)), grad), None

  hc, tc = _chunks(h, chunk), _chunks(targets, chunk)
  lc, gc = lse, _chunks(g.astype(jnp.float32), chunk)  # lse is kept in chunks
  dh = _varying(jnp.zeros(hc.shape, jnp.float32), h, table, targets, g)
  like = (h, table, targets, g)
  visitors = tuple(_varying(x, *like) for x in (hc, tc, lc, gc)) + (dh,)
  (visitors, grad), _ = lax.scan(step, (visitors, _no_grad(table, *like)), None, length=n)
  dh = _same_over(_unchunk(visitors[-1]), axes, token_axes)
  return dh.astype(h.dtype), _summed_over(grad, axes, token_axes).astype(table.dtype), None


_ce_rows.defvjp(_ce_rows_fwd, _ce_rows_bwd)
