#!/usr/bin/env bash
# The commands behind recipes/results/push (issue 46, ours): the BLEU push at a measured 4x, as they were run on the
# 2-core CPU (about 2 s a step at batch 4), one after another, in the repository root. Each lever trains into a
# folder of its own (its record: args.json, compressor.json, log.jsonl with a held-out check every 100 steps:
# own/other, BLEU-4 (words), ROUGE-L on 32 held-out texts, each 64 tokens in 16 slots).
#   MODEL=path/to/SmolLM2-135M-Instruct CORPUS=runs/corpus OUT=runs/push bash recipes/results/push/commands.sh
set -euo pipefail
MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}; CORPUS=${CORPUS:-runs/corpus}; OUT=${OUT:-runs/push}
# the arm: 500x on its own K/V carrier with AOC's LoRA settings (recipes/ladder.sh's lora arm at its 4x rung), seed 1
ARM=(--method 500x --model "$MODEL" --data "$CORPUS/train.jsonl" --eval-data "$CORPUS/heldout.jsonl" --mem 16
     --chunk-len 64 --lora-r 64 --lora-alpha 32 --lora-dropout 0.05 --lora-targets q_proj k_proj v_proj o_proj
     --lr 2e-4 --objective ae --crop window --min-len 64 --max-len 64 --batch-size 4 --seed 1 --eval-every 100
     --eval-n 32 --eval-bleu --save-every 100 --keep-every 500)
# longer (the main arm, constant lr 2e-4): the record's first 300 steps are the seed-1 ladder arm
# (SEED=1 RUNGS=4x ARMS=lora bash recipes/ladder.sh), continued with --resume --steps 3000 --eval-bleu and stopped
# at step 1,500 (--stop-after 1500). The same two commands here: --steps 300 first sets the warmup (10% of the run:
# 30 steps), which the resume keeps; one run of --steps 3000 would warm up over 300 and train another arm
python train.py "${ARM[@]}" --steps 300 --out "$OUT/lora_long_4x"
python train.py --resume "$OUT/lora_long_4x" --steps 3000 --stop-after 1500
mkdir -p "$OUT/at1500" && cp "$OUT"/lora_long_4x/{args.json,compressor.json,compressor.safetensors} "$OUT/at1500/"
# lr: a linear decay to 0 over 300 steps, from the main arm's step-1,500 weights
python train.py "${ARM[@]}" --warm-start "$OUT/at1500" --schedule linear --steps 300 --out "$OUT/lora_decay_4x"
# warm start: the 1:1 arm (16 tokens in 16 slots, 300 steps), then 4x from its weights
python train.py "${ARM[@]}" --chunk-len 16 --min-len 16 --max-len 16 --steps 300 --out "$OUT/lora_1x"
python train.py "${ARM[@]}" --warm-start "$OUT/lora_1x" --steps 400 --out "$OUT/lora_warm_4x"
# the paper batch, 16: 100 steps from the step-1,500 weights (the texts of 400 steps at batch 4)
python train.py "${ARM[@]}" --warm-start "$OUT/at1500" --batch-size 16 --steps 100 --eval-every 25 --out "$OUT/lora_b16_4x"
# LoRA targets: r 64 on the MLP too, from scratch
python train.py "${ARM[@]}" --lora-targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj --steps 400 \
  --out "$OUT/lora_mlp_4x"
# length curriculum: texts grow from 16 to 64 tokens over the first 200 steps, from scratch
python train.py "${ARM[@]}" --len-curriculum 16 200 --steps 400 --out "$OUT/lora_curric_4x"
# LoRA rank: r 128 on q, k, v, o (alpha 64: the same alpha / r as the arm's 32 / 64), from scratch
python train.py "${ARM[@]}" --lora-r 128 --lora-alpha 64 --steps 400 --out "$OUT/lora_r128_4x"
# the paper batch + lr together: batch 16 and a linear decay to 0 over 100 steps from the step-1,500 weights
python train.py "${ARM[@]}" --warm-start "$OUT/at1500" --batch-size 16 --schedule linear --steps 100 --eval-every 25 \
  --out "$OUT/lora_b16decay_4x"
# longer at the paper batch: 400 more steps at batch 16 from the paper batch's run, a linear decay to 0
python train.py "${ARM[@]}" --warm-start "$OUT/lora_b16_4x" --batch-size 16 --schedule linear --steps 400 \
  --eval-every 50 --save-every 25 --keep-every 100 --out "$OUT/lora_b16long_4x"
# 400 more the same way from its end: batch 16, the lr warming up again and decaying linearly to 0 from 2e-4
python train.py "${ARM[@]}" --warm-start "$OUT/lora_b16long_4x" --batch-size 16 --schedule linear --steps 400 \
  --eval-every 50 --save-every 25 --keep-every 100 --out "$OUT/lora_b16long2_4x"
# the chain's end continued without a restart (no warmup, from lr 5e-5: a quarter of its peak, ours), 600 steps at
# batch 16, with a matched control (the same start, steps and texts, a constant lr against the decay). The
# start is this file's lora_b16long2_4x as run again on this CPU (recipes/results/push_rebuild/lora_b16long2_4x, whose
# weights were kept); each kept checkpoint (200, 400, 600) scored on all held-out texts, and plateau.py reads them
CONT=(--warm-start "$OUT/lora_b16long2_4x" --batch-size 16 --warmup 0 --lr 5e-5 --steps 600 --save-every 25
      --keep-every 200)
python train.py "${ARM[@]}" "${CONT[@]}" --schedule linear --out "$OUT/lora_cont_decay_4x"
python train.py "${ARM[@]}" "${CONT[@]}" --schedule constant --out "$OUT/lora_cont_const_4x"
python evaluate.py --ckpt "$OUT/lora_b16long2_4x" --task ae --data "$CORPUS/heldout.jsonl" --no-baselines
for arm in decay const; do for s in 200 400 600; do
  python evaluate.py --ckpt "$OUT/lora_cont_${arm}_4x/ckpt-000$s" --task ae --data "$CORPUS/heldout.jsonl" \
    --no-baselines
done; done
python recipes/plateau.py --out "$OUT" --metric "BLEU-4 (words)=ae:scores.compressed.bleu4_words" \
  --start lora_b16long2_4x --arm decay lora_cont_decay_4x --arm constant lora_cont_const_4x
