#!/usr/bin/env bash
# RULER through lm-evaluation-harness (set-up: the [eval], [gemma] and [train] extras),
# then scripts/ruler.py with any arguments given: the ring and the main job's baselines
# at 4K-32K tokens over 8 simulated devices.
JAX_RING_EXTRA=eval,gemma,train source "$(dirname "$0")/_env.sh"
python scripts/ruler.py "$@"
