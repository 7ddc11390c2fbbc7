#!/usr/bin/env bash
# GMSA (Fig. 5, Fig. 4): group merging + LSA against the traditional paradigm (learned memory tokens appended,
# "TCP-AE", App. E), with the same first-k-layers LoRA encoder, the same LSA bridge and the same 4x rate, trained
# as autoencoders. The claim: GMSA-AE converges faster and restores text better (BLEU, prefix EM, ROUGE).
#
#   bash recipes/gmsa.sh                # SmolLM2-135M on this CPU, ~30 min
#   SMOKE=1 bash recipes/gmsa.sh        # tiny model, 2 steps per arm (CI)
#   SCALE=paper bash recipes/gmsa.sh    # GMSA §4.1 on a GPU: LLaMA-2-7B-chat, PwC, 10k AE steps
PAPER=gmsa
source "$(dirname "$0")/common.sh"

if [ "$SCALE" = paper ]; then
  # GMSA App. C: first 8 of 32 layers + LoRA, one LSA block, rates {4, 8} sampled per example (here fixed at 4
  # for the comparison), AdamW, linear schedule, batch 4, clip 2.0, 10k steps on PwC (texts <= 512 tokens)
  MODEL=${MODEL:-meta-llama/Llama-2-7b-chat-hf}
  DATA=hf://datasets/sggetao/PwC/data/train-00000-of-00001.parquet
  HELD=hf://datasets/sggetao/PwC/data/test-00000-of-00001.parquet
  train_arm gmsa --method gmsa --ratio 4 --data $DATA
  train_arm tcp --method gmsa --source mem_tokens --ratio 4 --data $DATA
  for arm in gmsa tcp; do eval_arm $arm ae --data $HELD --n 1000 --ratio 4; done
else
  # ours: texts of 64-128 tokens, the first 7 of SmolLM2's 30 layers with LoRA r 16, lr 5e-4, 300 steps
  COMMON=(--method gmsa --ratio 4 --lora-r 16 --lora-alpha 32 --min-len 64 --max-len 128 --batch-size 4
          --lr 5e-4 --warmup 30 --steps ${STEPS:-300} --save-every 100 "${TRAIN_TEXT[@]}")
  train_arm gmsa "${COMMON[@]}"
  train_arm tcp "${COMMON[@]}" --source mem_tokens
  for arm in gmsa tcp; do eval_arm $arm ae "${HELD_TEXT[@]}" --n ${N:-48} --max-len 128 --ratio 4; done
fi
$PY recipes/summarize.py --out "$OUT" --arms gmsa tcp --curves loss \
  --title "GMSA: group merging + LSA against learned memory tokens (same first-k encoder, LSA, 4x)" \
  --metric "BLEU-4 (words)=ae:scores.compressed.bleu4_words" --metric "prefix EM=ae:scores.compressed.prefix_em" \
  --metric "ROUGE-L=ae:scores.compressed.rougeL" --metric "AE loss own=ae:loss.own" \
  --metric "own/other=ae:loss.own_other_ratio" --metric "no memory=ae:loss.none" --note "model $MODEL"
finish
