#!/usr/bin/env bash
# PIC (Fig. 5, Table 4): PCC's compressor with its ordinary causal mask against the same compressor with PIC's
# block-wise causal mask, pretrained on TR + TC (PIC Eq. 6-8), then fine-tuned on QA the same short way. The claim:
# PIC's TR/TC losses fall faster and its QA scores are higher (16x: 52.01 F1 / 39.80 EM against 48.80 / 36.81,
# Table 4). Decided at the highest compression where PCC's memory carries its text on this CPU: PCC is probed at
# RATIOS in turn (1:1, then 4x, then 16x) while it carries (held-out own/other <= 0.5), and the last that carries
# is the rung. A memory that carries nothing at 1:1 carries nothing compressed, so the probe starts there: it costs
# one run when PCC cannot carry its text at all within STEPS (the rung is then 1:1, and the verdict says so).
#
#   bash recipes/pic.sh                 # SmolLM2-135M compressing for itself on 2 CPU cores: 3-7 runs, 2-6 h; resumes
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
  $PY recipes/summarize.py --out "$OUT" --arms pcc pic --curves ae lm \
    --title "PIC vs PCC at 16x: pretraining (TR = ae, TC = lm)" --metric "TR loss own=ae:loss.own" --note "model $MODEL_NAME"
  $PY recipes/summarize.py --out "$OUT" --append --arms pcc_qa pic_qa --curves qa \
    --title "PIC vs PCC at 16x: QA after pretraining and the same fine-tune" \
    --metric "F1=qa:scores.compressed.squad_f1" --metric "EM=qa:scores.compressed.squad_em"
else
  # ours: SmolLM2 compresses (a trained copy) for itself (frozen); 64-token segments with 64 / r slots, texts of
  # 128-160 tokens (TR on the first half, TC on the rest), lr 1e-4, batch 4, STEPS steps, SEEDS seeds per arm at
  # the rung (one when neither memory carries its text); then QA_STEPS QA steps on the fill-in-the-blank training
  # questions, scored on 60 held-out questions
  STEPS=${STEPS:-300}
  EVERY=${EVERY:-100}
  SEEDS=${SEEDS:-0 1}
  RATIOS=${RATIOS:-1 4 16}
  # SMOKE keeps both seeds and every ratio: the probe stops at 1x and the second seed is not run (nothing carries)
  [ "$SMOKE" = 1 ] && EVERY=1 && N=${N:-8}   # CI: 8 held-out texts per check (48 run the same lines)
  SEED0=$(echo $SEEDS | cut -d' ' -f1)
  pretrain() {   # pretrain ARM METHOD RATIO SEED
    train_arm $1 --method $2 --objective pretrain --crop window --chunk-len 64 --mem $((64 / $3)) --min-len 128 \
      --max-len 160 --batch-size 4 \
      --lr 1e-4 --warmup 30 --steps $STEPS --save-every $EVERY --eval-every $EVERY --eval-n ${N:-48} "${HELD_EVAL[@]}" --seed $4 "${TRAIN_TEXT[@]}"
    eval_arm $1 ae "${HELD_TEXT[@]}" --n ${N:-48} --max-len 160
  }
  own_other() { $PY -c "import json; print(json.load(open('$OUT/$1/eval_ae.json'))['loss']['own_other_ratio'])"; }
  carries() { $PY -c "import sys; sys.exit(0 if $(own_other $1) <= 0.5 else 1)"; }
  RATIO=$(echo $RATIOS | cut -d' ' -f1)
  for r in $RATIOS; do   # the probe: does PCC carry its text at r x?
    pretrain pcc_r${r}_s$SEED0 pcc $r $SEED0
    if ! carries pcc_r${r}_s$SEED0; then
      echo "== PCC at ${r}x: own/other $(own_other pcc_r${r}_s$SEED0) > 0.5, its memory carries nothing: the probe stops"
      break
    fi
    RATIO=$r
    echo "== PCC at ${r}x: own/other $(own_other pcc_r${r}_s$SEED0), it carries its text: one rung up"
  done
  echo "== the rung: ${RATIO}x (PCC's own/other $(own_other pcc_r${RATIO}_s$SEED0))"
  for seed in $SEEDS; do
    for arm in pcc pic; do
      name=${arm}_r${RATIO}_s$seed
      pretrain $name $arm $RATIO $seed
      train_arm ${name}_qa --method $arm --init "$OUT/$name" --objective qa "${TRAIN_QA[@]}" --batch-size 4 \
        --lr 5e-5 --warmup 10 --steps ${QA_STEPS:-100} --save-every 100 --max-len 256 --seed $seed
      eval_arm ${name}_qa qa "${HELD_QA[@]}"
    done
    # more seeds only where a memory carries its text: seeds of two memories that carry nothing decide nothing
    if [ $seed = $SEED0 ] && ! carries pcc_r${RATIO}_s$seed && ! carries pic_r${RATIO}_s$seed; then
      echo "== neither memory carries its text at ${RATIO}x (own/other PCC $(own_other pcc_r${RATIO}_s$seed)," \
        "PIC $(own_other pic_r${RATIO}_s$seed)): one seed"
      SEEDS=$seed; break
    fi
  done
  runs() { for seed in $SEEDS; do echo $1_r${RATIO}_s$seed${2:-}; done; }
  PROBES=$(for r in $RATIOS; do if [ -d "$OUT/pcc_r${r}_s$SEED0" ]; then echo pcc_r${r}_s$SEED0; fi; done)
  $PY recipes/curve.py --out "$OUT" "${HELD_TEXT[@]}" --n ${N:-48} --title "PIC vs PCC" \
    --group "${RATIO}x" $(runs pcc) $(runs pic)
  $PY recipes/summarize.py --out "$OUT" --arms $(echo $PROBES $(runs pcc) $(runs pic) | tr ' ' '\n' | awk '!seen[$0]++') \
    --curves ae lm --title "PIC vs PCC: pretraining (TR = ae, TC = lm), the probes of PCC and the rung ${RATIO}x" \
    --metric "TR loss own=ae:loss.own" --metric "own/other=ae:loss.own_other_ratio" "${TOKENS_PER_SLOT[@]}" \
    --metric "AE BLEU-4 (words)=ae:scores.compressed.bleu4_words" --note "model $MODEL_NAME"
  $PY recipes/summarize.py --out "$OUT" --append --arms $(runs pcc _qa) $(runs pic _qa) --curves qa \
    --title "PIC vs PCC at ${RATIO}x: QA after the same fine-tune (held-out questions)" \
    --metric "F1=qa:scores.compressed.squad_f1" --metric "EM=qa:scores.compressed.squad_em" \
    --metric "full-context F1=qa:scores.full.squad_f1" --metric "no-context F1=qa:scores.none.squad_f1"
  $PY recipes/verdict.py --out "$OUT" --claim "PIC's TR loss falls lower and faster than PCC's (${RATIO}x)" \
    --arm PIC $(runs pic) --arm PCC $(runs pcc) --expect PIC PCC \
    --metric "TR loss own=ae:loss.own:lower" --metric "first step at own/other 0.5=curve:first_at_threshold:lower"
  $PY recipes/verdict.py --out "$OUT" --claim "PIC answers better than PCC after the same QA fine-tune (${RATIO}x)" \
    --arm PIC $(runs pic _qa) --arm PCC $(runs pcc _qa) --expect PIC PCC \
    --carry-runs PIC $(runs pic) --carry-runs PCC $(runs pcc) \
    --metric "F1=qa:scores.compressed.squad_f1:higher" --metric "EM=qa:scores.compressed.squad_em:higher"
fi
finish
