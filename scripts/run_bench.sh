#!/usr/bin/env bash
# The benchmark suite, scripts/bench/bench.py, with the reference package (the [bench] extra).
JAX_RING_EXTRA=bench source "$(dirname "$0")/_env.sh"
python scripts/bench/bench.py "$@"
