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


class _Item:
  def __init__(self, nodeid):
    self.nodeid, self.marks = nodeid, []

  def add_marker(self, mark):
    self.marks.append(mark.name)


def test_the_hook_marks_the_listed_tests_slow_and_no_other():
  listed = sorted(conftest._slow_tests())[:3]
  items = [_Item(n) for n in listed] + [_Item("tests/test_suite.py::test_not_listed")]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.marks for i in items] == [["slow"]] * len(listed) + [[]]
