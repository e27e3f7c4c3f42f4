"""Evaluation: the long-context evaluator (`long_context`: needles at chosen depths,
accuracy by length and depth; the main job's readers and the needle demo's grid) and
lm-evaluation-harness's model (`harness`)."""


def __getattr__(name):
  """Submodules reached as attributes (`models.<package>.<module>`), imported when first named."""
  import importlib
  import pkgutil

  if name in {m.name for m in pkgutil.iter_modules(__path__)}:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
