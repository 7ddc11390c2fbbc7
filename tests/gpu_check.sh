#!/usr/bin/env bash
# Issue 40's CUDA checks, prepared on a machine without a GPU: run them in one call when one is lent, then put the
# numbers in tests/README.md with the card named. About 10 minutes on one H100 for everything; sections can be
# picked (bash tests/gpu_check.sh 1 2 3), in two calls if a call is limited to 10 minutes (1-4, then 5-6).
#
#   1  bench_train: every preset around a random Llama-3.2-1B, batch 4, frozen weights fp32 against bf16 (~2 min)
#   2  AOC's step: the paper's batch 16 as one micro-batch, and --compile (~2.5 min)
#   3  AOC's profile through train.py: CUDA kernels per step, GPU busy share (~1 min)
#   4  the memory plan against the measured peak for aoc, icae, pcc (~1.5 min)
#   5  pcc before (47ac57e, the 131 ms) and after the decoder refactor, on this card (~1 min); needs the old tree:
#        mkdir -p runs/before-47ac57e && git archive 47ac57e | tar -x -C runs/before-47ac57e
#      on the machine that starts the run, and `runs/before-47ac57e` in the run's carry (runs/ is git-ignored)
#   6  the CUDA tests that changed: FSDP at world size 1, --grad-ckpt with LoRA, bf16 frozen weights in test_train
#      (train.py's CUDA default now) (~4 min)
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SECTIONS=${*:-1 2 3 4 5 6}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
section() { echo; echo "=== $1 ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
B="python tests/bench_train.py --shape llama-3.2-1b --device cuda"

if want 1; then
  section "1. bench_train, every preset, Llama-3.2-1B shape, batch 4: frozen fp32 vs bf16"
  timeout 300 $B --steps 8 --frozen-dtype fp32 bf16
fi

if want 2; then
  section "2. AOC: batch 16 (the paper's, train.py's default micro-batch), and --compile at batch 4"
  timeout 90 $B --steps 8 --methods aoc --frozen-dtype fp32 bf16 --batch 16
  timeout 200 $B --steps 12 --methods aoc --frozen-dtype bf16 --compile
fi

if want 3 || want 4; then   # a random Llama-3.2-1B checkpoint folder that train.py loads like a real one
  python -c "import sys; sys.path[:0] = ['.', 'tests']; import bench_plan; from model import SHAPES
bench_plan.random_checkpoint('/tmp/llama-3.2-1b', dict(SHAPES['llama-3.2-1b']))"
fi

if want 3; then
  section "3. AOC's step under the profiler (train.py, batch 4 and 16, 96-token texts, bf16 frozen weights)"
  for bs in 4 16; do
    timeout 120 python tests/bench_train.py --steps 8 --profile --method aoc --model /tmp/llama-3.2-1b \
      --batch-size $bs --crop head --max-len 96
  done
fi

if want 4; then
  section "4. the memory plan against the measured peak (torch.cuda.max_memory_allocated), Llama-3.2-1B shape"
  timeout 200 python tests/bench_plan.py --device cuda --shape llama-3.2-1b --methods aoc icae pcc --batch-size 4 \
    --max-len 512
  timeout 120 python tests/bench_plan.py --device cuda --shape llama-3.2-1b --methods icae pcc --batch-size 4 \
    --max-len 512 --grad-ckpt
fi

if want 5; then
  section "5. pcc and icae, 12 steps, fp32 weights: before the decoder refactor (47ac57e) and now, this card"
  if [ -d runs/before-47ac57e ]; then
    (cd runs/before-47ac57e && timeout 120 python tests/bench_train.py --shape llama-3.2-1b --device cuda --steps 12 \
      --methods pcc icae)
  else
    echo "runs/before-47ac57e missing: see the header"
  fi
  timeout 120 $B --steps 12 --methods pcc icae --frozen-dtype fp32
fi

if want 6; then
  section "6. the CUDA tests that changed"
  timeout 150 python -m pytest -q -x tests/test_scale.py --device cuda -k "fsdp or grad_ckpt" -p no:cacheprovider
  timeout 240 python -m pytest -q tests/test_train.py --device cuda -p no:cacheprovider \
    -k "bf16 or micro_batches or resume or keft or grad_ckpt or learns"
fi
echo; echo "=== done ($(date +%T))"
