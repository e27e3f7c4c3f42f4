#!/usr/bin/env bash
# On one NVIDIA GPU whose python3 already has jax (CUDA), flax and, for the peer,
# torch and transformers: the kernels checked against float64, then timed against
# cuDNN one-shot, then the training step against PyTorch + transformers. Each part
# writes its own file under OUT (default results/gpu); nothing is installed (the
# checkout is put on the path, `jax_ring.models` linked to models/).
#
#   bash scripts/bench/run_gpu.sh [OUT]
#
# About 10 minutes on an H200 (most of it compiling the training steps).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-results/gpu}"
mkdir -p "$OUT"
[ -e jax_ring/models ] || ln -s ../models jax_ring/models
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # each part's peak, not a preallocated 75%
py="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
"$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)" | tee -a "$OUT/device.txt"

# 1. Exactness: cuDNN per ring step, Triton, the XLA tiles, against float64.
timeout -s KILL 420 "$py" scripts/bench/bench_gpu.py --check --check-kernels cudnn,pallas --out "$OUT/check.md"
echo "check exit $?"
# 2. The ring's forward+backward against cuDNN one-shot, head dims 128 and 64.
timeout -s KILL 420 "$py" scripts/bench/bench_gpu.py --time --lengths 16384,65536 --repeats 5 --out "$OUT/time_h128.md"
timeout -s KILL 300 "$py" scripts/bench/bench_gpu.py --time --lengths 32768 --head-dim 64 --repeats 5 \
  --out "$OUT/time_h64.md"
# 3. Llama-3.2-1B's AdamW step, jax_ring (cuDNN ring kernel) against PyTorch + transformers.
timeout -s KILL 900 "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 16384,32768 --torch \
  --json "$OUT/train.json"
timeout -s KILL 900 "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 65536,131072 \
  --remat full --json "$OUT/train_long.json"
