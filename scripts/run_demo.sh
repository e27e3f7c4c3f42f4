#!/usr/bin/env bash
# The main job (the demo): set-up, then scripts/needle_demo.py with any arguments given
# (needle in a haystack over real text; the synthetic key-value demo is scripts/demo.py).
JAX_RING_EXTRA=train source "$(dirname "$0")/_env.sh"
python scripts/needle_demo.py "$@"
