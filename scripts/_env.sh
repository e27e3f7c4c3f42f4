# Sourced by the run_*.sh scripts: creates .venv if missing and installs the package
# (with the [dev] extra when JAX_RING_DEV=1, or the extra named by JAX_RING_EXTRA).
# Needs only Python 3.10+ and pip (as README.md says; CI runs 3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extra=""
[ "${JAX_RING_DEV:-0}" = "1" ] && extra="[dev]"
[ -n "${JAX_RING_EXTRA:-}" ] && extra="[${JAX_RING_EXTRA}]"
stamp=".venv/.installed${extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install --quiet --no-cache-dir -e ".${extra}"
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
