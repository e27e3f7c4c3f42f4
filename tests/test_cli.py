"""Every script's command line: --help gives every option one help line with its
default, once."""

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
  p.stem for p in [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts" / "bench").glob("*.py")]
)
SCRIPTS = [name for name in SCRIPTS if not name.startswith("_")]


def _help(name: str) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
    importlib.import_module(name).parse_args(["--help"])
  return out.getvalue()


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_help_and_one_default(name):
  options = _help(name).split("\noptions:\n", 1)[1]
  entries = re.split(r"\n(?=  -)", options.strip("\n"))
  assert len(entries) > 1, options
  for entry in entries:
    if entry.lstrip().startswith("-h, --help"):
      continue
    flag = entry.split()[0]
    described = re.sub(r"\(default[^)]*\)", "", entry).split()[1:]
    assert any(w.islower() for w in described), f"{name} {flag}: no help text:\n{entry}"
    assert entry.count("(default") == 1, f"{name} {flag}: its default is not said once:\n{entry}"


def test_scripts_are_all_covered():
  expected = {"demo", "launch", "needle_demo", "long_context", "train", "aot", "bench", "bench_gemma"}
  assert expected | {"bench_memory", "bench_tile"} <= set(SCRIPTS)


def test_no_script_docstring_joins_its_example_lines():
  """A backslash at a line's end inside a plain docstring joins the next line to it,
  so `--help` printed the example command as one long line; the scripts whose example
  commands continue over lines keep their docstrings raw."""
  import ast
  from pathlib import Path

  root = Path(__file__).resolve().parents[1]
  for path in [*root.glob("scripts/*.py"), *root.glob("scripts/bench/*.py")]:
    tree = ast.parse(path.read_text())
    first = tree.body[0] if tree.body else None
    if first is not None and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
      source = ast.get_source_segment(path.read_text(), first)
      assert not ("\\\n" in source and not source.startswith('r"""')), (
        f"{path}: a non-raw docstring with \\ line ends"
      )
