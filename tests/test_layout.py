"""The layout of `models/`: the import graph read from every module's imports (no
cycle; formats and architectures below checkpoints, train and eval; only jax_ring's
public API), the architecture registry, and the flat layout's names still importing
with a DeprecationWarning."""

import ast
import importlib
import pathlib
import warnings

import pytest

from jax_ring import models
from jax_ring.models import _moved, architectures

ROOT = pathlib.Path(models.__file__).parent
PACKAGE = "jax_ring.models"


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join([PACKAGE, *parts])


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known) -> set[str]:
  """The package's modules `name` imports anywhere in its file (functions included):
  `from . import x` counts as x where x is a module, else as the package."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{base}.{node.module}" if node.module else base
      else:
        base = node.module
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:  # jax_ring.models.x.Y -> jax_ring.models.x
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph):
  """A cycle of the graph as a list of modules, or None."""
  state = {}

  def visit(node, stack):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt, stack)):
        return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node, [])):
      return found
  return None


def test_the_import_graph_is_read_from_the_modules():
  """The reader sees relative, absolute and in-function imports (a reader that saw
  none would pass the cycle test below)."""
  graph = _graph()
  assert f"{PACKAGE}.architectures.decoder" in graph[f"{PACKAGE}.architectures.gemma"]  # from .decoder import
  assert f"{PACKAGE}.checkpoints" in graph[f"{PACKAGE}.train.step"]  # from .. import checkpoints
  assert f"{PACKAGE}.train.scratch" in graph[f"{PACKAGE}.eval.long_context"]  # inside a function
  assert f"{PACKAGE}.runtime" in graph[f"{PACKAGE}.eval.harness"]  # absolute, inside a function


def test_the_import_graph_has_no_cycle():
  assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_lower_layers_import_no_upper_one():
  """Files and model families know nothing of loading, training or evaluating."""
  upper = (f"{PACKAGE}.checkpoints", f"{PACKAGE}.train", f"{PACKAGE}.eval", f"{PACKAGE}.generate")
  for name, imports in _graph().items():
    if name.startswith((f"{PACKAGE}.formats", f"{PACKAGE}.architectures")):
      bad = sorted(i for i in imports if i.startswith(upper))
      assert not bad, f"{name} imports {bad}"


def test_models_use_only_public_jax_ring():
  """The package docstring's claim: nothing under models/ reaches jax_ring's private modules."""
  for name, path in _modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        parts = node.module.split(".")
        assert not (parts[0] == "jax_ring" and any(p.startswith("_") for p in parts[1:2])), (
          name,
          node.module,
        )
        if node.module == "jax_ring":
          assert not any(a.name.startswith("_") for a in node.names), (name, [a.name for a in node.names])


def test_every_family_module_is_registered_once():
  """A module under architectures/ that defines an `Architecture` is in the registry;
  names and model types are each one family's, and so is a GGUF architecture unless
  every family reading it says which files it takes (`GGUFFormat.accepts`: llama and
  Mixtral)."""
  records = architectures.registry()
  for path in sorted((ROOT / "architectures").glob("*.py")):
    module = importlib.import_module(_module_name(path))
    record = getattr(module, "ARCHITECTURE", None)
    if record is not None:
      assert record in records, f"{module.__name__}.ARCHITECTURE is not in architectures.REGISTRY"
  for field in (lambda r: r.name, lambda r: r.hf.architecture):
    values = [field(r) for r in records if field(r) is not None]
    assert len(set(values)) == len(values), values
  for arch in {r.gguf.arch for r in records if r.gguf is not None}:
    sharing = [r for r in records if r.gguf is not None and r.gguf.arch == arch]
    assert len(sharing) == 1 or all(r.gguf.accepts is not None for r in sharing), [r.name for r in sharing]
  types = [t for r in records for t in r.hf.model_types + r.hf.multimodal]
  assert len(set(types)) == len(types), types
  names = [n for r in records for n in r.configs]
  assert len(set(names)) == len(names), names
  for record in records:
    for name, cfg in record.configs.items():
      assert architectures.of_config(cfg) is record, name
      assert models.config(name) is cfg


def test_every_model_is_the_one_decoder_stack(monkeypatch):
  """Every model class the package exports is a `CausalLM`, and the small models'
  forward, prompt fill and decoding all run through its blocks loop (`run_blocks`):
  no second stack with a forward of its own."""
  import jax
  import numpy as np
  from flax import nnx

  from jax_ring.models.architectures import decoder

  classes = [r.model_class for r in architectures.registry()] + [models.DecoderLM, models.LongNet]
  for cls in classes:
    assert issubclass(cls, decoder.CausalLM), cls
  calls = []
  original = decoder.CausalLM.run_blocks

  def counted(self, *args, **kwargs):
    calls.append(type(self).__name__)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(decoder.CausalLM, "run_blocks", counted)
  tokens = jax.numpy.asarray(np.arange(16).reshape(2, 8) % 32)
  small = [
    models.DecoderLM(models.LMConfig(vocab_size=32, attention="dense", conv=2), rngs=nnx.Rngs(0)),
    models.LongNet(
      models.LongNetConfig(vocab_size=32, segment_lengths=(8,), dilation_rates=(1,), reference=True),
      rngs=nnx.Rngs(0),
    ),
  ]
  for model in small:
    name = type(model).__name__
    model(tokens)
    model.init_cache(2, 12)
    model.prefill(tokens)
    model.decode(tokens[:, :1])
    assert calls.count(name) == 3, (name, calls)


def test_of_config_refuses_a_stranger():
  with pytest.raises(TypeError, match=r"config=.*LMConfig.*expected one of \('GemmaConfig'"):
    architectures.of_config(models.LMConfig(vocab_size=8))


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_the_flat_layout_names_import_with_a_deprecation(old, monkeypatch):
  """`import jax_ring.models.<old>` and `models.<old>` still give the moved names,
  the same objects, with a DeprecationWarning naming where they live now."""
  monkeypatch.delitem(__import__("sys").modules, f"{PACKAGE}.{old}", raising=False)
  with pytest.warns(DeprecationWarning, match=rf"{PACKAGE}\.{old} is deprecated: use {PACKAGE}\."):
    module = importlib.import_module(f"{PACKAGE}.{old}")
  assert getattr(models, old) is module
  first = importlib.import_module(f"{PACKAGE}.{_moved.MOVED[old][0]}")
  public = [n for n in dir(first) if not n.startswith("_") and not isinstance(getattr(first, n), type(ast))]
  assert public
  for attr in public:
    assert getattr(module, attr) is getattr(first, attr), attr
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    _ = module.no_such_name


def test_moved_names_resolve_across_their_modules():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax_ring.models import finetune, hf, training
  from jax_ring.models.formats import config_json, safetensors
  from jax_ring.models.train import finetune as finetune_loop
  from jax_ring.models.train import scratch, state, step

  assert finetune.Trainer is step.Trainer and finetune.finetune is finetune_loop.finetune
  assert training.Checkpoints is state.Checkpoints and training.make_tx is scratch.make_tx
  assert hf.ConfigReader is config_json.ConfigReader and hf.SafetensorsFolder is safetensors.SafetensorsFolder


@pytest.mark.parametrize(
  "old, new",
  [("Reader", "Engine"), ("Program", "Programs"), ("Filled", "Constant"), ("ROOM", None), ("LAST", None)],
)
def test_the_main_jobs_old_names_warn(old, new):
  """The engine moved to `models.generate` and the room's constants were renamed; the
  old names give the same objects with a DeprecationWarning."""
  from jax_ring.models.eval import long_context
  from jax_ring.models.generate import Constant, Engine, Programs

  with pytest.warns(DeprecationWarning, match=rf"long_context\.{old} is deprecated: use "):
    value = getattr(long_context, old)
  if new is not None:
    assert value is {"Engine": Engine, "Programs": Programs, "Constant": Constant}[new]
  else:
    assert value == {"ROOM": long_context.ANSWER_ROOM, "LAST": long_context.LAST4K_TOKENS}[old]


def test_the_old_harness_command_still_runs():
  """`python -m jax_ring.models.harness`, the command the docs gave before the layout,
  runs the harness's command line, saying where it lives now."""
  import subprocess
  import sys

  done = subprocess.run(
    [sys.executable, "-m", "jax_ring.models.harness", "--help"], capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "usage" in done.stdout.lower(), done.stdout[-2000:]
  assert "python -m jax_ring.models.eval.harness" in done.stderr, done.stderr[-2000:]
