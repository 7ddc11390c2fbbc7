#!/usr/bin/env bash
# PIC (Fig. 5, Table 4): PCC's compressor with its ordinary causal mask against the same compressor with PIC's
# block-wise causal mask, at 16x, pretrained on TR + TC (PIC Eq. 6-8), then fine-tuned on QA the same short way.
# The claim: PIC's TR/TC losses fall faster and its QA scores are higher (16x: 52.01 F1 / 39.80 EM against
# 48.80 / 36.81, Table 4).
#
#   bash recipes/pic.sh                 # SmolLM2-135M compressing for itself on 2 CPU cores, 78 min
#   SMOKE=1 bash recipes/pic.sh         # tiny model, 2 steps per arm (CI)
#   SCALE=paper bash recipes/pic.sh     # PIC §4.1 on a GPU: Qwen2.5-0.5B-Instruct -> Llama-3-8B-Instruct
PAPER=pic
source "$(dirname "$0")/common.sh"

if [ "$SCALE" = paper ]; then
  # PIC §4.1.2 / PCC code: compressor Qwen2.5-0.5B-Instruct (full fine-tune, lr 1e-4), decoder Llama-3-8B-Instruct
  # (frozen), 256-token segments with 16 slots, FineWeb pretraining, SQuAD fine-tuning; --keep-every keeps the
  # pretraining checkpoints PIC §4.3.2 fine-tunes for its data-efficiency curve
  MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
  DECODER=${DECODER:-meta-llama/Meta-Llama-3-8B-Instruct}
  DATA=hf://datasets/HuggingFaceFW/fineweb/sample/10BT/000_00000.parquet
  SQUAD=hf://datasets/rajpurkar/squad/plain_text/train-00000-of-00001.parquet
  SQUAD_TEST=hf://datasets/rajpurkar/squad/plain_text/validation-00000-of-00001.parquet
  for arm in pcc pic; do
    train_arm $arm --method $arm --decoder $DECODER --data $DATA --keep-every 5000
    train_arm ${arm}_qa --method $arm --init "$OUT/$arm" --objective qa --data $SQUAD
    eval_arm ${arm}_qa qa --data $SQUAD_TEST
  done
else
  # ours (78 min on 2 CPU cores): SmolLM2 compresses (a trained copy) for itself (frozen); 64-token segments with 4 slots
  # (16x), texts of 128-160 tokens (TR on the first half, TC on the rest), lr 1e-4, 300 steps; then 100 QA steps
  # on the fill-in-the-blank training questions; scored on the 60 held-out questions
  COMMON=(--chunk-len 64 --mem 4 --min-len 128 --max-len 160 --batch-size 4 --lr 1e-4 --warmup 30
          --steps ${STEPS:-300} --save-every 100 "${TRAIN_TEXT[@]}")
  for arm in pcc pic; do
    train_arm $arm --method $arm "${COMMON[@]}"
    eval_arm $arm ae "${HELD_TEXT[@]}" --n ${N:-48} --max-len 160
    train_arm ${arm}_qa --method $arm --init "$OUT/$arm" --objective qa "${TRAIN_QA[@]}" --batch-size 4 \
      --lr 5e-5 --warmup 10 --steps ${QA_STEPS:-100} --save-every 100 --max-len 256
    eval_arm ${arm}_qa qa "${HELD_QA[@]}"
  done
fi
$PY recipes/summarize.py --out "$OUT" --arms pcc pic --curves ae lm \
  --title "PIC vs PCC at 16x: pretraining (TR = ae, TC = lm)" \
  --metric "TR loss own=ae:loss.own" --metric "own/other=ae:loss.own_other_ratio" \
  --metric "AE BLEU-4 (words)=ae:scores.compressed.bleu4_words" --note "model $MODEL"
$PY recipes/summarize.py --out "$OUT" --append --arms pcc_qa pic_qa --curves qa \
  --title "PIC vs PCC at 16x: QA after the same fine-tune (held-out questions)" \
  --metric "F1=qa:scores.compressed.squad_f1" --metric "EM=qa:scores.compressed.squad_em" \
  --metric "full-context F1=qa:scores.full.squad_f1" --metric "no-context F1=qa:scores.none.squad_f1"
finish
