#!/usr/bin/env bash
# The main job (the demo): set-up, then scripts/demo.py with any arguments given.
source "$(dirname "$0")/_env.sh"
python scripts/demo.py "$@"
