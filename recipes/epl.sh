#!/usr/bin/env bash
# EPL (Fig. 4, Table 6): the same ICAE trained under the default position layout (DPL), with UPL on the encoder
# only (+UPL) and with EPL (UPL + CPL), on texts of at least two chunks at r = 5 (|M| = L/5). The claim: EPL
# reaches a low AE loss far sooner and reconstructs much better (ICAE AE BLEU 31.80 -> 95.98, Table 6).
#
#   bash recipes/epl.sh                 # SmolLM2-135M on 2 CPU cores, ~1.3 h (about 4 s a step; STEPS=100 N=16: ~30 min)
#   SMOKE=1 bash recipes/epl.sh         # tiny model, 2 steps per arm (CI)
#   SCALE=paper bash recipes/epl.sh     # EPL App. C on a GPU: Llama-3.2-1B, SlimPajama-6B, 20k steps each
PAPER=epl
source "$(dirname "$0")/common.sh"

if [ "$SCALE" = paper ]; then
  # EPL App. C, Table 8: LoRA r 128 on q,v, 102 memory tokens per 510-token chunk, |X| in [510, 2040], AE + LM,
  # lr 1e-4 constant after 300 warmup steps, batch 16, clip 2.0, 20k steps; scored on held-out SlimPajama
  MODEL=${MODEL:-meta-llama/Llama-3.2-1B}
  DATA=hf://datasets/DKYoon/SlimPajama-6B/data/train-00000-of-00048.parquet
  HELD=hf://datasets/DKYoon/SlimPajama-6B/data/validation-00000-of-00001.parquet
  for layout in dpl upl epl; do
    train_arm $layout --method icae --layout $layout --data $DATA
    eval_arm $layout ae --data $HELD --n 1000
  done
else
  # ours, one CPU hour: chunks of L = 40 with |M| = 8 (r = 5), texts of 160-200 tokens (the first half, with
  # [BOS], is 2-3 chunks), batch 4, LoRA r 16, lr 5e-4; every arm the same seed and data order
  COMMON=(--method icae --chunk-len 40 --mem 8 --lora-r 16 --lora-alpha 32 --min-len 160 --max-len 200
          --batch-size 4 --lr 5e-4 --warmup 30 --steps ${STEPS:-300} --save-every 100 "${TRAIN_TEXT[@]}")
  for layout in dpl upl epl; do
    train_arm $layout "${COMMON[@]}" --layout $layout
    eval_arm $layout ae "${HELD_TEXT[@]}" --n ${N:-48} --max-len 200
  done
fi
$PY recipes/summarize.py --out "$OUT" --arms dpl upl epl --curves loss ae lm \
  --title "EPL: ICAE under DPL, +UPL and EPL (AE on the first half, r = 5, >= 2 chunks)" \
  --metric "AE BLEU-4 on ids=ae:scores.compressed.bleu4_ids" --metric "prefix EM=ae:scores.compressed.prefix_em" \
  --metric "AE loss own=ae:loss.own" --metric "AE loss other=ae:loss.other" \
  --metric "own/other=ae:loss.own_other_ratio" --metric "no memory=ae:loss.none" \
  --note "model $MODEL, held-out $(basename "${HELD_TEXT[1]:-built-in}")"
finish
