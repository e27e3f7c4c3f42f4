"""Files to arrays and back: safetensors, config.json, GGUF and tokenizer.json."""


def __getattr__(name):
  """Submodules reached as attributes (`models.<package>.<module>`), imported when first named."""
  import importlib
  import pkgutil

  if name in {m.name for m in pkgutil.iter_modules(__path__)}:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
