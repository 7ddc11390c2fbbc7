#!/usr/bin/env bash
# AOC (Tables 1-3): the attention-only compressor (the LLM without its MLPs, fully trained) against the LoRA encoder
# of AOC's own baseline (500xCompressor as AOC's code runs it: r 64, α 32, dropout 0.05 on q, k, v, o), each text
# the first n tokens of a document. The claim: AOC regenerates better (BLEU, EM, ROUGE-L) with about a third of the
# encoder parameters. Decided (2 seeds per arm) at m = n = 16, where the baseline must carry its text, and at 2x.
#
#   bash recipes/aoc.sh                 # SmolLM2-135M on 2 CPU cores: 8 runs x 1,500 steps, about 3.5 h; resumes
#   SMOKE=1 bash recipes/aoc.sh         # tiny model, 2 steps per arm (CI)
#   SCALE=paper bash recipes/aoc.sh     # AOC §2-3 on a GPU: Llama-3.2-1B-Instruct, arXiv abstracts, n = 96
PAPER=aoc
source "$(dirname "$0")/common.sh"
BASELINE=(--method 500x --objective ae --lora-r 64 --lora-alpha 32 --lora-dropout 0.05
          --lora-targets q_proj k_proj v_proj o_proj)

if [ "$SCALE" = paper ]; then
  # AOC §2 and code: Llama-3.2-1B-Instruct, bf16, lr 2e-4 after 300 warmup steps, constant, batch 16, 300k
  # arXiv abstracts (18,750 steps), n in {96, ..., 480}, m in {1, 4, 16}; here n = 96, m = 4 and 16
  MODEL=${MODEL:-meta-llama/Llama-3.2-1B-Instruct}
  DATA=hf://datasets/gfissore/arxiv-abstracts-2021/arxiv-abstracts.jsonl.gz
  for m in 4 16; do
    train_arm aoc_m$m --method aoc --mem $m --max-len 96 --data $DATA
    train_arm lora_m$m "${BASELINE[@]}" --mem $m --chunk-len 96 --max-len 96 --lr 2e-4 --data $DATA
  done
  ARMS="aoc_m4 lora_m4 aoc_m16 lora_m16"
  for arm in $ARMS; do eval_arm $arm ae --data $DATA --n 3000; done
  $PY recipes/summarize.py --out "$OUT" --arms $ARMS --curves loss \
    --title "AOC vs its LoRA baseline (regeneration of held-out texts, each cut to its first n tokens)" \
    --metric "BLEU (words, method1)=ae:scores.compressed.bleu4_words" --metric "AOC EM=ae:scores.compressed.aoc_em" \
    --metric "ROUGE-L (rouge 1.0.1)=ae:scores.compressed.aoc_rougeL" --metric "own/other=ae:loss.own_other_ratio" \
    "${TOKENS_PER_SLOT[@]}" --metric "trained encoder parameters=params:" --note "model $MODEL_NAME"
else
  # ours: decided where the baseline carries its text, at m = n = 16 (1:1, the sanity check) and at 2x (n = 32,
  # m = 16), each text the first n tokens of a paragraph (AOC's head crop); batch 4, the paper's lr 2e-4 for both
  # (300 warmup steps cut to 10% of the run), STEPS steps, SEEDS seeds (data order and init); every kept
  # checkpoint scored on the held-out texts (recipes/curve.py). Plus one diagnostic arm: the same fully trained
  # copy with its MLPs kept, and what the decoder sees of each encoder's memory (recipes/diagnosis.py)
  STEPS=${STEPS:-1500}
  EVERY=${EVERY:-250}
  [ "$SMOKE" = 1 ] && EVERY=1
  SEEDS=${SEEDS:-0 1}
  [ "$SMOKE" = 1 ] && SEEDS=0   # CI: one seed (the second runs the same code)
  LENGTHS=${LENGTHS:-16 32}
  [ "$SMOKE" = 1 ] && LENGTHS=16   # CI: 1:1 only (2x runs the same lines)
  ARMS=""
  SEED0=$(echo $SEEDS | cut -d' ' -f1)
  for seed in $SEEDS; do
    for n in $LENGTHS; do
      COMMON=(--mem 16 --max-len $n --batch-size 4 --steps $STEPS --save-every $EVERY --eval-every $EVERY --eval-n ${N:-48} "${HELD_EVAL[@]}" --seed $seed
              "${TRAIN_TEXT[@]}")
      train_arm aoc_n${n}_s$seed --method aoc "${COMMON[@]}"
      train_arm lora_n${n}_s$seed "${BASELINE[@]}" --chunk-len $n --lr 2e-4 "${COMMON[@]}"
      for arm in aoc_n${n}_s$seed lora_n${n}_s$seed; do
        eval_arm $arm ae "${HELD_TEXT[@]}" --n ${N:-48}
        if [ $n = 16 ] && [ $seed = $SEED0 ]; then diagnose_arm $arm "${HELD_TEXT[@]}"; fi
      done
      ARMS="$ARMS aoc_n${n}_s$seed lora_n${n}_s$seed"
    done
  done
  train_arm aocmlp_n16 --method aoc --mlp swiglu --mem 16 --max-len 16 --batch-size 4 --steps ${CHECK_STEPS:-300} \
    --save-every 50 --eval-every 50 --eval-n ${N:-48} "${HELD_EVAL[@]}" "${TRAIN_TEXT[@]}"
  eval_arm aocmlp_n16 ae "${HELD_TEXT[@]}" --n ${N:-48}
  diagnose_arm aocmlp_n16 "${HELD_TEXT[@]}"
  by_n() { for seed in $SEEDS; do echo "aoc_n$1_s$seed lora_n$1_s$seed"; done; }
  groups=(--group "m = n = 16" $(by_n 16) aocmlp_n16)
  [[ " $LENGTHS " = *" 32 "* ]] && groups+=(--group "2x: n = 32, m = 16" $(by_n 32))
  $PY recipes/curve.py --out "$OUT" "${HELD_TEXT[@]}" --n ${N:-48} --title "AOC vs LoRA" "${groups[@]}"
  $PY recipes/diagnosis.py --runs "$OUT/aoc_n16_s$SEED0" "$OUT/aocmlp_n16" "$OUT/lora_n16_s$SEED0" \
    "${HELD_TEXT[@]}" --out "$OUT/diagnosis"
  $PY recipes/summarize.py --out "$OUT" --arms $ARMS aocmlp_n16 --curves loss \
    --title "AOC vs its LoRA baseline: every run (held-out texts, each cut to its first n tokens)" \
    --metric "BLEU (words, method1)=ae:scores.compressed.bleu4_words" --metric "AOC EM=ae:scores.compressed.aoc_em" \
    --metric "ROUGE-L (rouge 1.0.1)=ae:scores.compressed.aoc_rougeL" --metric "own/other=ae:loss.own_other_ratio" \
    "${TOKENS_PER_SLOT[@]}" --metric "first step at own/other 0.5=curve:first_at_threshold" \
    --metric "trained encoder parameters=params:" --note "model $MODEL_NAME; own/other along the runs: curve.md, curve.png"
  for n in $LENGTHS; do
    runs() { for seed in $SEEDS; do echo "$1_n${n}_s$seed"; done; }
    $PY recipes/verdict.py --out "$OUT" --claim "AOC vs its LoRA baseline at n = $n, m = 16" \
      --arm AOC $(runs aoc) --arm LoRA $(runs lora) --expect AOC LoRA \
      --metric "BLEU (words)=ae:scores.compressed.bleu4_words:higher" --metric "AOC EM=ae:scores.compressed.aoc_em:higher" \
      --metric "ROUGE-L=ae:scores.compressed.aoc_rougeL:higher" \
      --metric "first step at own/other 0.5=curve:first_at_threshold:lower"
  done
fi
finish
