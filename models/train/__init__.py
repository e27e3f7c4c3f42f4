"""Training: the step every model trains with (`step`), fine-tuning a loaded model
(`finetune`), training the small models from scratch (`scratch`) on their tasks
(`tasks`), and the run's state on disk (`state`)."""


def __getattr__(name):
  """Submodules reached as attributes (`models.<package>.<module>`), imported when first named."""
  import importlib
  import pkgutil

  if name in {m.name for m in pkgutil.iter_modules(__path__)}:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
