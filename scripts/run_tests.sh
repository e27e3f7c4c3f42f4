#!/usr/bin/env bash
# The test command: set-up, lint/format check, then the whole suite on 8 simulated CPU devices.
JAX_RING_DEV=1 source "$(dirname "$0")/_env.sh"
# The compile-only GPU/TPU tests run in a venv of their own with the [aot] extra
# (the CUDA plugin with ptxas, and libtpu: about 2 GB), so neither ever loads in .venv.
# Both venvs take about 3 GB; say so up front when the disk is short of it.
free_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ ! -f .venv-aot/.installed ] && [ "${free_kb:-0}" -lt 3000000 ]; then
  echo "run_tests.sh: $((free_kb / 1024)) MiB free here; .venv-aot needs about 2 GB" >&2
fi
if [ ! -x .venv-aot/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-aot
fi
if [ ! -f .venv-aot/.installed ] || [ pyproject.toml -nt .venv-aot/.installed ]; then
  .venv-aot/bin/python -m pip install --quiet --no-cache-dir --upgrade pip
  .venv-aot/bin/python -m pip install --quiet --no-cache-dir -e ".[aot]"
  touch .venv-aot/.installed
fi
export JAX_RING_AOT_PYTHON="$ROOT/.venv-aot/bin/python"
ruff check .
ruff format --check .
# --dist loadgroup: the real model's tests (group "gemma") share one worker, which loads it once.
python -m pytest -n 2 --dist loadgroup -q "$@"
