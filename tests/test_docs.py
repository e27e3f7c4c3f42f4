"""The documentation's code runs as written: every Python block of README.md and of
docs/guides/ on 8 simulated CPU devices, each page's blocks in a fresh process."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TIMEOUT = 300  # seconds per block; subprocess.run kills (SIGKILL) past it


# Each page's blocks run in one process, in order, each in a namespace of its own (as
# `python -c` would run it): a page pays for importing JAX once. Its blocks share a worker
# (`--dist loadgroup`), which runs the page once and reports each block in its own test.
_RUNNER = """
import json, linecache, sys, traceback
blocks = json.load(sys.stdin)
for i, code in enumerate(blocks):
  name = f"<block {i}>"
  linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # source lines in tracebacks
  try:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})
    error = None
  except BaseException:
    error = traceback.format_exc()
  sys.stdout.flush(); sys.stderr.flush()
  print("\\n@@block " + json.dumps({"block": i, "error": error}), flush=True)
"""


def _codes(page: Path) -> list[str]:
  return [match.group(1) for match in BLOCK.finditer(page.read_text())]


@functools.cache
def _page(page: Path) -> dict[int, str | None]:
  """{block: its traceback, or None} for every block of `page` that finished; the
  process's stdout and stderr under key "output"."""
  # conftest's XLA_FLAGS: 8 simulated devices, and the tests' faster compiles
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  env["JAX_PLATFORMS"] = "cpu"
  codes = _codes(page)
  try:
    done = subprocess.run(
      [sys.executable, "-c", _RUNNER],
      input=json.dumps(codes),
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=TIMEOUT * len(codes),
    )
    stdout, stderr = done.stdout, f"{done.stderr}\nexit status {done.returncode}"
  except subprocess.TimeoutExpired as e:  # killed (SIGKILL) past its limit
    stdout, stderr = _text(e.stdout), f"{_text(e.stderr)}\nkilled after {e.timeout} s"
  results = {}
  for line in stdout.splitlines():
    if line.startswith("@@block "):
      found = json.loads(line[len("@@block ") :])
      results[found["block"]] = found["error"]
  results["output"] = f"stdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-4000:]}"
  return results


def _text(data) -> str:
  return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def blocks():
  for page in PAGES:
    for i, _ in enumerate(_codes(page)):
      name = str(page.relative_to(ROOT))
      yield pytest.param(page, i, id=f"{name}:{i}", marks=pytest.mark.xdist_group(f"docs {name}"))


@pytest.mark.parametrize(("page", "block"), list(blocks()))
def test_python_block_runs_as_written(page, block):
  results = _page(page)
  assert block in results, f"block {block} did not finish\n{results['output']}"
  assert results[block] is None, f"{results[block]}\n{results['output']}"


def test_api_reference_builds_strict(tmp_path):
  """mkdocs with mkdocstrings renders the API reference from the docstrings in strict
  mode: a reference to a name that no longer exists, or a docstring it cannot read,
  fails the build."""
  mkdocs = Path(sys.executable).with_name("mkdocs")
  done = subprocess.run(
    [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  api = (tmp_path / "site" / "api" / "index.html").read_text()
  for name in ("ring_attention", "ring_mesh", "decode_attention", "make_attention_fn", "collective_bytes"):
    assert 'id="jax_ring.' in api and name in api, name


NAME = re.compile(r"`((?:jax_ring|models)(?:\.[A-Za-z_]\w*)+)")


def test_every_dotted_name_in_the_docs_resolves():
  """Every name the prose writes as `jax_ring.x.y` or `models.x.y` (as after `from
  jax_ring import models`) is reachable as written: a renamed function or a submodule
  that needs its own import fails here, not in a reader's session."""
  code = "\n".join(
    [
      "import sys, jax_ring",
      "from jax_ring import models",
      "missing = []",
      "for name in sys.argv[1:]:",
      "  root, *path = name.split('.')",
      "  obj = {'jax_ring': jax_ring, 'models': models}[root]",
      "  try:",
      "    for part in path: obj = getattr(obj, part)",
      "  except AttributeError as e: missing.append(f'{name}: {e}')",
      "print('\\n'.join(missing)); sys.exit(1 if missing else 0)",
    ]
  )
  names = sorted(
    {m.group(1) for page in [*PAGES, *(ROOT / "docs").glob("*.md")] for m in NAME.finditer(page.read_text())}
  )
  assert "models.runtime.initialize_distributed" in names and len(names) > 20, names
  done = subprocess.run(
    [sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
  )
  assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_every_page_has_examples_or_none_was_lost():
  counts = {page.name: len(BLOCK.findall(page.read_text())) for page in PAGES}
  assert counts["README.md"] >= 1 and sum(counts.values()) >= 8, counts


def test_development_guide_lists_every_script():
  """docs/development.md names every script a user can run, benchmarks included."""
  guide = (ROOT / "docs" / "development.md").read_text()
  scripts = [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts" / "bench").glob("*.py")]
  missing = [p.name for p in scripts if f"`{p.name}`" not in guide and f"{p.name}" not in guide]
  assert not missing, missing


def test_attention_guide_signature_names_every_argument():
  """The attention guide's table gives `ring_attention`'s whole signature, defaults
  included, so no argument is found only by reading the source."""
  import inspect

  import jax_ring

  row = next(
    line
    for line in (ROOT / "docs" / "guides" / "attention.md").read_text().splitlines()
    if line.startswith("| `ring_attention(")
  )
  for name, param in inspect.signature(jax_ring.ring_attention).parameters.items():
    if name in ("query", "key", "value"):
      continue
    written = (
      name if param.default is inspect.Parameter.empty else f"{name}={param.default!r}".replace("'", '"')
    )
    assert written in row, written
