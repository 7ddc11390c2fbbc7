#!/usr/bin/env bash
# The CUDA checks, prepared on a machine without a GPU. When a GPU is lent, this runs first, before any experiment
# (tests/README.md, "On a GPU"): `bash tests/gpu_check.sh 1` then `bash tests/gpu_check.sh 2`, two calls of at most
# 600 s each, then the numbers go into tests/README.md with the card named. Every command has its own timeout, and a
# call's timeouts add up to less than 600 s, so a hung command costs its own section, not the call.
#
#   call 1 (timeouts 420 s; on an H200 on 2026-11-27 a took 40 s, b 32 s, d one batch 40 s)
#     a  the fused-kernel check: one training step and a generation of every preset around a random Llama-3.2-1B,
#        with SDPA's math path shut (flash, memory-efficient, cuDNN only): a masked GQA call raises
#     b  bench_train's MFU table, every preset, Llama-3.2-1B shape, batch 4, bf16 frozen weights: two attention calls,
#        a mask with enable_gqa (mask-gqa: the math path) and K/V repeated where a mask is given (repeat-kv: model.sdpa)
#     d  AOC's step through train.py under the profiler: kernels per step, GPU busy share (batch 4 and 16)
#   call 2 (timeouts 530 s; measured: c about 60 s a case, e 95 s, f 50 s for 12 of its tests)
#     c  FSDP at world size 1 with a mid-run save (save every 2 of 6 steps), and resumed both ways
#     e  the memory plan against the measured peak (torch.cuda.max_memory_allocated), aoc, icae, pcc
#     f  the CUDA tests: bf16 training, micro-batches, resume, --grad-ckpt, the SDPA spy
#   calls 3 and 4 (timeouts 540 s each; not run on a GPU yet)
#     g  every preset's step at its paper batch (micro-batches of 16), Llama-3.2-1B shape, bf16 frozen weights,
#        eager against --compile (each model compiled whole), and AOC with --cuda-graphs: ms/step, tokens/s, the MFU
#        of the step's own FLOPs, kernels per step; call 3: icae, 500x, aoc; call 4 (section h): pcc, pic, compllm, gmsa
#
# Sections can be picked: bash tests/gpu_check.sh a b. bf16 runs are compared within bf16 tolerances (the tests say
# which); nothing here compares a bf16 number with fp32's 1e-4.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=python3
case "${1:-}" in
  1) SECTIONS="a b d" ;;
  2) SECTIONS="c e f" ;;
  3) SECTIONS="g" ;;
  4) SECTIONS="h" ;;
  "") SECTIONS="a b c d e f g h" ;;
  *) SECTIONS="$*" ;;
esac
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
section() { echo; echo "=== $1 ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
B="$PY tests/bench_train.py --shape llama-3.2-1b --device cuda"

if want a; then
  section "a. every preset's training step and a generation with SDPA's math path shut (Llama-3.2-1B shape)"
  timeout 120 $B --steps 2 --frozen-dtype bf16 --fused-only
fi

if want b; then
  section "b. MFU, every preset, Llama-3.2-1B shape, batch 4, bf16 frozen weights: attention mask-gqa and repeat-kv"
  timeout 150 $B --steps 6 --frozen-dtype bf16 --attention mask-gqa repeat-kv
fi

if want c; then
  section "c. FSDP at world size 1 (nccl): save every 2 of 6 steps, resume FSDP -> one process -> FSDP"
  timeout 300 $PY -m pytest -q tests/test_scale.py --device cuda -k "fsdp" -p no:cacheprovider
fi

if want d || want e; then   # a random Llama-3.2-1B checkpoint folder that train.py loads like a real one
  $PY -c "import sys; sys.path[:0] = ['.', 'tests']; import bench_plan; from model import SHAPES
bench_plan.random_checkpoint('/tmp/llama-3.2-1b', dict(SHAPES['llama-3.2-1b']))"
fi

if want d; then
  section "d. AOC's step under the profiler (train.py, batch 4 and 16, 96-token texts, bf16 frozen weights)"
  for bs in 4 16; do
    timeout 75 $PY tests/bench_train.py --steps 8 --profile --method aoc --model /tmp/llama-3.2-1b \
      --batch-size $bs --crop head --max-len 96
  done
fi

if want e; then
  section "e. the memory plan against the measured peak (torch.cuda.max_memory_allocated), Llama-3.2-1B shape"
  timeout 100 $PY tests/bench_plan.py --device cuda --shape llama-3.2-1b --methods aoc icae pcc --batch-size 4 \
    --max-len 512
fi

if want f; then
  section "f. the CUDA tests: bf16 training, micro-batches, resume, --grad-ckpt, the SDPA spy"
  timeout 50 $PY -m pytest -q tests/test_scale.py --device cuda -k "grad_ckpt or no_sdpa_call" -p no:cacheprovider
  # (-k also matches a module's name: "resume_" and its kin pick the resume tests, not all of test_resume.py)
  timeout 80 $PY -m pytest -q tests/test_train.py tests/test_resume.py tests/test_heldout.py --device cuda \
    -p no:cacheprovider -k "bf16 or micro_batches or resume_ or resumes or after_resume or grad_ckpt"
fi
# g, h: eager against compiled, one preset per command (a hung compile costs its own preset); the first compiled
# steps compile, and the median is over the steps after the first two
G="$B --steps 5 --frozen-dtype bf16 --batch paper --micro-batch 16"
if want g; then
  section "g. eager against --compile at the paper batch (icae, 500x, aoc; aoc with CUDA graphs), Llama-3.2-1B shape"
  for m in icae 500x; do timeout 150 $G --methods $m --modes eager compile; done
  timeout 240 $G --methods aoc --modes eager compile cuda-graphs
fi
if want h; then
  section "h. eager against --compile at the paper batch (pcc, pic, compllm, gmsa), Llama-3.2-1B shape"
  for m in pcc pic compllm gmsa; do timeout 135 $G --methods $m --modes eager compile; done
fi
echo; echo "=== done ($(date +%T))"
