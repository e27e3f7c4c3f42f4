"""The suite's own bookkeeping: tests/slow.txt names tests that exist, and the hook
marks them slow."""

import ast
import pathlib

import conftest

ROOT = pathlib.Path(__file__).parent


def test_every_slow_test_listed_exists():
  """A renamed or deleted test left in tests/slow.txt would silently stop being slow
  under its new name: each listed id names a test function of its file."""
  listed = conftest._slow_tests()
  assert listed, "tests/slow.txt lists no test"
  functions = {}
  for nodeid in listed:
    path, _, rest = nodeid.partition("::")
    name = rest.split("[")[0]
    if path not in functions:
      tree = ast.parse((ROOT.parent / path).read_text())
      functions[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert name in functions[path], f"tests/slow.txt: {nodeid} is not a test of {path}"


def test_every_slow_id_names_a_collected_test():
  """A listed id whose parameters no longer exist (a renamed parametrization) would
  mark nothing: each listed id of a file this run collected is a collected test, or
  a test's name without parameters (which marks all of them)."""
  collected = {n for n in conftest.COLLECTED if not n.startswith("tests/test_suite.py")}
  files = {n.partition("::")[0] for n in collected}
  names = {n.split("[")[0] for n in collected}
  missing = sorted(
    n
    for n in conftest._slow_tests()
    if n.partition("::")[0] in files and n not in collected and n not in names
  )
  assert not missing, f"tests/slow.txt lists tests this run did not collect: {missing}"


def test_slow_tests_script_keeps_ids_with_spaces_whole(tmp_path):
  """scripts/slow_tests.py reads a node id to the end of its line: a parameter's id may
  hold spaces (it cut them at the first, and the truncated ids marked nothing); the
  "@group" that `--dist loadgroup` puts after a grouped test's id is not part of it."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("slow_tests", ROOT.parent / "scripts" / "slow_tests.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  durations = tmp_path / "durations.txt"
  durations.write_text(
    "2.00s call     tests/test_x.py::test_a[options0-striped layout]\n"
    "0.50s setup    tests/test_x.py::test_a[options0-striped layout]\n"
    "0.20s call     tests/test_x.py::test_b\n"
    "1.00s setup    tests/test_x.py::test_c[8]@gemma\n"
    "1.25s call     tests/test_x.py::test_c[8]@gemma\n"
  )
  out = tmp_path / "slow.txt"
  script.main([str(durations), "--out", str(out)])
  listed = [line for line in out.read_text().splitlines() if not line.startswith("#")]
  assert listed == [
    "tests/test_x.py::test_a[options0-striped layout]  2.5",
    "tests/test_x.py::test_c[8]  2.2",
  ], listed


class _Item:
  def __init__(self, nodeid):
    self.nodeid, self.marks = nodeid, []

  def add_marker(self, mark):
    self.marks.append(mark.name)


def test_the_hook_marks_the_listed_tests_slow_and_no_other():
  listed = sorted(conftest._slow_tests())[:3]
  # A listed name without parameters marks each of its parametrizations.
  bare = next(n for n in sorted(conftest._slow_tests()) if "[" not in n)
  items = [_Item(n) for n in [*listed, f"{bare}[2]"]] + [_Item("tests/test_suite.py::test_not_listed")]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.marks for i in items] == [["slow"]] * (len(listed) + 1) + [[]]
