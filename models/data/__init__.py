"""A user's data for fine-tuning, apart from the training step, which sees only finished
rows (tokens, segment ids, positions, loss weights):

    sources.py   files to examples: JSONL, JSON, Parquet, text and `datasets` folders;
                 the format (text, completion, chat) from the columns; bad rows named
    chat.py      chat templates rendered as transformers renders them, and the
                 assistant tokens they mark (`chat_template`, `tokenize_chat`)
    packing.py   examples into rows of a fixed length, best-fit decreasing (`pack`)
    pipeline.py  tokenization cached on disk, packing, and grain's resumable loader
"""


def __getattr__(name):
  """Submodules reached as attributes, imported when first named."""
  import importlib
  import pkgutil

  if name in {m.name for m in pkgutil.iter_modules(__path__)}:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
