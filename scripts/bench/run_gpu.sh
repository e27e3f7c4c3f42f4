#!/usr/bin/env bash
# On one NVIDIA GPU whose python3 already has jax (CUDA), flax and, for the peer,
# torch and transformers: the kernel choice, the kernels checked against float64, the
# training step against PyTorch + transformers, the ring's kernels timed against cuDNN
# one-shot, then the long steps. Each part writes its own file under OUT (default
# results/gpu) as it goes, so a part cut short by its time limit keeps what it finished;
# nothing is installed (the checkout is put on the path, `jax_ring.models` linked to
# models/).
#
#   bash scripts/bench/run_gpu.sh [OUT]
#   PARTS="check packed gemma lora_short" bash scripts/bench/run_gpu.sh [OUT]
#   PARTS="profile lora dpo rollout" bash scripts/bench/run_gpu.sh [OUT]
#
# Packages the machine lacks (the DPO peer's trl, datasets, accelerate; peft) come as
# wheels in WHEELS (default wheels/, which git ignores: carry it), put on the path
# without their dependencies: fill it where a registry answers with
#   pip download --no-deps -d wheels trl datasets accelerate peft dill multiprocess xxhash
#
# PARTS (default: probe check train time_h128 time_h64 train_long) picks the parts; each
# set above fits one command of under 10 minutes on an H200. The default parts took
# about 330 s there (2026-11-27), "check packed gemma lora_short" about 420 s (2026-11-28),
# most of it compiling training steps and building the 8B model. The parts of
# "profile lora dpo rollout" are limited to 550 s in all (not yet run on a GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-results/gpu}"
mkdir -p "$OUT"
[ -e jax_ring/models ] || ln -s ../models jax_ring/models
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
WHEELS="${WHEELS:-wheels}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "${PYTHON:-python3}" -m pip install --quiet --no-index --no-deps --target "$OUT/.wheels" "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$(cd "$OUT" && pwd)/.wheels"
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # each part's peak, not a preallocated 75%
py="${PYTHON:-python3}"
PARTS="${PARTS:-probe check train time_h128 time_h64 train_long}"
part() {  # part SECONDS NAME COMMAND...: runs COMMAND, SIGKILLed past SECONDS
  local limit=$1 name=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  local start=$SECONDS
  timeout -s KILL "$limit" "$@"
  echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/device.txt"

# 0. What "auto" runs here, and whether JAX's private cuDNN API is the one written against.
part 40 probe "$py" -c "
import jax, jax_ring
from jax_ring import _cudnn
d = jax.devices()[0]
print('private cuDNN API problem:', _cudnn.API_PROBLEM)
for h in (64, 128):
  print('auto, head dim', h, '->', jax_ring.choose_kernel('auto', d.platform, h, device_kind=d.device_kind))
" 2>&1 | tee -a "$OUT/device.txt"
# 1. Exactness: cuDNN per ring step against float64, in bfloat16, windows and packed
#    documents included (float32 inputs go to the Triton kernel, whose rows are in
#    docs/benchmarks.md from earlier runs).
part 150 check "$py" scripts/bench/bench_gpu.py --check --check-kernels cudnn --check-policies bfloat16 \
  --out "$OUT/check.md"
# 2. Llama-3.2-1B's AdamW step, jax_ring (cuDNN ring kernel) against PyTorch + transformers.
part 180 train "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 16384,32768 \
  --remat attention --steps 3 --torch --timeout 100 --json "$OUT/train.json"
# 3. The ring's forward+backward against cuDNN one-shot: head dims 128 and 64; cuDNN's
#    default pass (every kv head at these lengths) against passes of 32K tokens x kv heads.
part 55 time_h128 "$py" scripts/bench/bench_gpu.py --time --lengths 16384 --repeats 5 \
  --kernels cudnn,cudnn@32768 --out "$OUT/time_h128.md"
part 55 time_h64 "$py" scripts/bench/bench_gpu.py --time --lengths 32768 --head-dim 64 --repeats 5 \
  --kernels cudnn,cudnn@32768 --out "$OUT/time_h64.md"
# 4. Long steps on one GPU: time and peak memory.
part 150 train_long "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 65536,131072 \
  --remat full --steps 1 --timeout 90 --json "$OUT/train_long.json"
# 5. The training steps users run first (each beside its PyTorch peer): Llama-3.2-1B on
#    rows of documents of mixed lengths, Gemma 3 1B (sliding window 512 and global
#    layers), Llama-3.1-8B with rank-16 adapters on every projection (bf16 frozen base;
#    the peer: peft), and the 8B alone at 64K.
T="$py scripts/bench/bench_train_gpu.py --remat attention --steps 2 --torch"
part 110 packed $T --model llama-3.2-1b --packed --lengths 32768 --timeout 60 --json "$OUT/packed.json"
part 200 gemma $T --model gemma-3-1b --lengths 16384,32768 --timeout 70 --json "$OUT/gemma.json"
part 170 lora_short $T --model llama-3.1-8b --lora 16 --lengths 32768 --timeout 110 --json "$OUT/lora.json"
part 150 lora_short $py scripts/bench/bench_train_gpu.py --remat attention --steps 1 --model llama-3.1-8b --lora 16 \
  --lengths 65536 --timeout 140 --json "$OUT/lora_long.json"
# 6. Rollouts (GRPO's sampling): G = 8 completions of 4,096 tokens from one prompt of
#    Llama-3.2-1B, against transformers' generate on the same GPU.
part 150 rollout "$py" scripts/bench/bench_rollout.py --model llama-3.2-1b --prompt 512 --completions 8 \
  --new-tokens 4096 --repeats 1 --torch --timeout 70 --json "$OUT/rollout.json"
# 7. Preference tuning: one DPO step of Llama-3.2-1B on a pair of 2 x 16,384 tokens (a
#    prompt of 512 shared), the reference's forward in the step, against TRL's DPOTrainer.
part 110 dpo "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --objective dpo --prompt 512 \
  --lengths 32768 --remat attention --steps 2 --torch --timeout 50 --json "$OUT/dpo.json"
# 8. The one-row step of Llama-3.2-1B at 32K with a profile of one more step (each
#    part's device time, the gaps between kernels), beside PyTorch + transformers.
part 100 profile "$py" scripts/bench/bench_train_gpu.py --model llama-3.2-1b --lengths 32768 --remat attention \
  --steps 2 --profile --torch --timeout 45 --json "$OUT/profile.json"
# 9. Adapters at long context: Llama-3.1-8B's rank-16 adapter step at 131,072 tokens
#    (every block recomputed), and PyTorch + peft's at 65,536 and 131,072 (or its error).
part 100 lora "$py" scripts/bench/bench_train_gpu.py --model llama-3.1-8b --lora 16 --lengths 131072 \
  --remat full --steps 1 --timeout 90 --json "$OUT/lora_131k.json"
part 90 lora "$py" scripts/bench/bench_train_gpu.py --model llama-3.1-8b --lora 16 --lengths 65536,131072 \
  --steps 1 --peer-only --timeout 40 --json "$OUT/lora_peft.json"
