"""Command-line flags from config dataclasses: one flag per field, named after it
(`stop_after` -> `--stop-after`), typed by its default, with the field's help text."""

from __future__ import annotations

import argparse
import dataclasses
import typing


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """Every script's --help: the docstring as written, and each option's help line
  followed by its default once (unless the help already says what the default is)."""

  def _get_help_string(self, action):
    if "(default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def parser(description: str) -> argparse.ArgumentParser:
  """An ArgumentParser with `HelpFormatter`, the one every script uses."""
  return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def _scalar_type(annotation):
  """The flag type of an annotation: int, float or str, also inside `X | None`."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  kind = args[0] if len(args) == 1 else annotation
  if kind not in (int, float, str):
    raise TypeError(f"no flag type for annotation {annotation!r}")
  return kind


def add_config_flags(parser: argparse.ArgumentParser, cls, skip=()) -> None:
  """Adds one flag per field of dataclass `cls` (except `skip`). A bool field that
  defaults to True becomes `--no-<name>`; one that defaults to False `--<name>`."""
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    flag = "--" + field.name.replace("_", "-")
    help_text = field.metadata.get("help", "")
    if hints[field.name] is bool:
      if field.default:
        parser.add_argument(
          "--no-" + field.name.replace("_", "-"),
          dest=field.name,
          action="store_false",
          help=f"no {help_text}",
        )
      else:
        parser.add_argument(flag, dest=field.name, action="store_true", help=help_text)
      continue
    kind = _scalar_type(hints[field.name])
    choices = field.metadata.get("choices")
    parser.add_argument(
      flag,
      dest=field.name,
      type=kind,
      default=field.default,
      choices=choices,
      help=help_text,
    )


def config_from_flags(cls, namespace: argparse.Namespace, **overrides):
  """An instance of `cls` from the parsed flags (fields absent from it keep defaults)."""
  names = {f.name for f in dataclasses.fields(cls)}
  values = {k: v for k, v in vars(namespace).items() if k in names}
  return cls(**(values | overrides))
