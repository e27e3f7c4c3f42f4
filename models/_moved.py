"""The module names of the package's flat layout, kept importable with a
DeprecationWarning that names where their contents live now."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module name -> the modules now holding its names (the first is the main one).
MOVED = {
  "decoder": ("architectures.decoder",),
  "gemma": ("architectures.gemma",),
  "llama": ("architectures.llama",),
  "qwen3": ("architectures.qwen3",),
  "longnet": ("architectures.longnet",),
  "transformer": ("architectures.scratch",),
  "vocab": ("architectures.vocabulary",),
  "hf": ("formats.safetensors", "formats.config_json"),
  "gguf": ("formats.gguf",),
  "tokenizer": ("formats.tokenizer_json",),
  "finetune": ("train.finetune", "train.step"),
  "training": ("train.scratch", "train.state", "train.step"),
  "report": ("train.scratch",),
  "tasks": ("train.tasks",),
  "harness": ("eval.harness",),
  "long_context": ("eval.long_context",),
  "needle": ("eval.long_context",),
}
PACKAGE = __name__.rpartition(".")[0]


class MovedModule(types.ModuleType):
  """An old module name: its attributes are looked up in the modules that hold them now."""

  def __init__(self, name: str, targets: tuple[str, ...]):
    super().__init__(f"{PACKAGE}.{name}")
    self._targets = tuple(f"{PACKAGE}.{t}" for t in targets)

  def __getattr__(self, attr):
    if attr.startswith("__"):
      raise AttributeError(attr)
    for target in self._targets:
      module = importlib.import_module(target)
      if hasattr(module, attr):
        return getattr(module, attr)
    raise AttributeError(
      f"module {self.__name__!r} (now {', '.join(self._targets)}) has no attribute {attr!r}"
    )

  def __dir__(self):
    return sorted({n for t in self._targets for n in dir(importlib.import_module(t))})


def moved(name: str) -> MovedModule:
  """The old module `name`, with a DeprecationWarning naming its new home."""
  full = f"{PACKAGE}.{name}"
  if full not in sys.modules:
    targets = MOVED[name]
    warnings.warn(
      f"{full} is deprecated: use {', '.join(f'{PACKAGE}.{t}' for t in targets)}",
      DeprecationWarning,
      stacklevel=3,
    )
    sys.modules[full] = MovedModule(name, targets)
  return sys.modules[full]


class _Loader(importlib.abc.Loader):
  def create_module(self, spec):
    return moved(spec.name.rpartition(".")[2])

  def exec_module(self, module):
    pass

  def get_code(self, fullname):
    """`python -m <old name>` (runpy asks for the code): runs the module that holds
    its names now as __main__, after a DeprecationWarning naming it."""
    target = f"{PACKAGE}.{MOVED[fullname.rpartition('.')[2]][0]}"
    source = (
      "import runpy, warnings\n"
      f"warnings.warn('python -m {fullname} is deprecated: use python -m {target}', DeprecationWarning)\n"
      f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n"
    )
    return compile(source, fullname, "exec")


class Finder(importlib.abc.MetaPathFinder):
  """Finds `import jax_ring.models.<old name>`."""

  def find_spec(self, fullname, path=None, target=None):
    package, _, name = fullname.rpartition(".")
    if package != PACKAGE or name not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, _Loader())


def install() -> None:
  if not any(isinstance(f, Finder) for f in sys.meta_path):
    sys.meta_path.append(Finder())
