#!/usr/bin/env bash
# The test command: set-up, lint/format check, then the whole suite on 8 simulated CPU devices.
JAX_RING_DEV=1 source "$(dirname "$0")/_env.sh"
ruff check .
ruff format --check .
python -m pytest -n 2 -q "$@"
