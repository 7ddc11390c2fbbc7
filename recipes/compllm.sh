#!/usr/bin/env bash
# CompLLM (§4): a C = 2 segment compressor distilled from the LLM's own answers (Eq. 1-3), answering held-out
# questions from concept embeddings next to the full context and no context; segments are compressed
# independently, so a context shared by several questions is compressed once and its cached CEs give the same
# answers; time to first token and KV-cache size against the full context.
#
#   bash recipes/compllm.sh             # SmolLM2-135M-Instruct on 2 CPU cores: up to 600 steps (~12 s each) per seed,
#                                       # a second seed only if the first one's CEs beat no context; resumes
#   SMOKE=1 bash recipes/compllm.sh     # tiny model, 2 steps (CI)
#   SCALE=paper bash recipes/compllm.sh # CompLLM §4.1 on a GPU: Qwen3-4B, NarrativeQA + RACE
PAPER=compllm
source "$(dirname "$0")/common.sh"

# two questions per long context, compressed once (reused) or anew: the answers must be identical
reuse_check() {
  $PY - "$1" <<'PY'
import json, sys
d = sys.argv[1]
reuse, fresh = (json.load(open(f"{d}/eval_{k}.json")) for k in ("reuse", "fresh"))
same = all(a["compressed"]["text"] == b["compressed"]["text"] for a, b in zip(reuse["examples"], fresh["examples"]))
print(f"cached CEs give the same answers as compressing anew: {same} ({len(reuse['examples'])} questions, "
      f"{reuse['concat']} per context)")
json.dump({"identical_answers": same, "questions": len(reuse["examples"])}, open(f"{d}/eval_reuse_check.json", "w"))
PY
}

if [ "$SCALE" = paper ]; then
  # CompLLM §4.1: LoRA r 32, Adam lr 1e-4, batch 4, C = 2, S = 20, teacher answers of up to 512 tokens
  MODEL=${MODEL:-Qwen/Qwen3-4B}
  DATA=hf://datasets/deepmind/narrativeqa/data/train-00000-of-00024.parquet
  HELD=hf://datasets/rajpurkar/squad/plain_text/validation-00000-of-00001.parquet
  train_arm compllm --method compllm --data $DATA --steps 20000
  QA=(--data $HELD --n 1000)
  LENGTHS=1024,2048,4096,8192,16384,32768
  eval_arm compllm qa "${QA[@]}"
  # two questions per long context: compressed once (reused) or anew; the answers must be identical
  eval_arm compllm qa:reuse "${QA[@]}" --concat 2
  eval_arm compllm qa:fresh "${QA[@]}" --concat 2 --no-reuse
  speed_arm compllm --lengths $LENGTHS
  reuse_check "$OUT/compllm"
  $PY recipes/summarize.py --out "$OUT" --arms compllm --curves distill \
    --title "CompLLM: C = 2 concept embeddings vs full and no context (held-out questions)" \
    --metric "F1 CEs=qa:scores.compressed.squad_f1" --metric "F1 full=qa:scores.full.squad_f1" \
    --metric "F1 none=qa:scores.none.squad_f1" --metric "answer own/other=qa:loss.own_other_ratio" \
    --metric "cached CEs: same answers=reuse_check:identical_answers" \
    --metric "TTFT speedup (longest)=speed:rows.-1.speedup_offline" --note "model $MODEL_NAME"
else
  # ours: the fill-in-the-blank training questions, the LLM's own answers of up to 48 tokens, batch 4, lr 1e-4.
  # Distilled in stages of STAGE steps, each scored on the held-out questions, until the CEs answer clearly better
  # than no context (the answer found in GAP more of the generations than with none: SmolLM2's answers run long, so
  # F1 stays low even with the full context, 0.077 against 0.019 with none, and an F1 gap could never get there)
  # or MAX_STEPS; SEEDS seeds. The seeds share one cache of the frozen LLM's answers (they are the same teacher's)
  STAGE=${STAGE:-100}
  MAX_STEPS=${MAX_STEPS:-600}
  GAP=${GAP:-0.1}
  SEEDS=${SEEDS:-0 1}
  # SMOKE keeps both seeds: its CEs carry nothing, so the second seed is skipped, as below
  [ "$SMOKE" = 1 ] && STAGE=2 MAX_STEPS=2
  SEED0=$(echo $SEEDS | cut -d' ' -f1)
  QA=("${HELD_QA[@]}" --max-new-tokens 32)
  LENGTHS=${LENGTHS:-256,512,1024,2048,4096}
  beats() {   # beats GAP-VALUE: the CEs find the answer GAP more often than no context
    $PY -c "import sys; sys.exit(0 if $1 >= $GAP else 1)"
  }
  gap() {   # gap ARM: how much more often the CEs' answer holds the reference than no context's (kept in eval_gap.json)
    $PY - "$OUT/$1" <<'PY'
import json, sys
s = json.load(open(f"{sys.argv[1]}/eval_qa.json"))["scores"]
gap = s["compressed"]["substring_acc"] - s["none"]["substring_acc"]
json.dump({"ce_minus_none": gap, "metric": "substring_acc"}, open(f"{sys.argv[1]}/eval_gap.json", "w"))
print(gap)
PY
  }
  for seed in $SEEDS; do
    steps=$STAGE
    while :; do
      train_arm compllm_s$seed --method compllm --objective distill "${TRAIN_QA[@]}" --max-len 256 --batch-size 4 \
        --lr 1e-4 \
        --answer-tokens ${ANSWER_TOKENS:-48} --steps $steps --save-every $STAGE --seed $seed --cache-dir "$OUT/cache" \
        "${HELD_EVAL_QA[@]}"
      eval_arm compllm_s$seed qa "${QA[@]}"
      g=$(gap compllm_s$seed)
      echo "== compllm_s$seed at $steps steps: answer found, CEs minus no context = $g"
      { beats $g || [ $steps -ge $MAX_STEPS ]; } && break
      steps=$((steps + STAGE))
    done
    # more seeds only where the CEs carry their context: seeds of CEs that carry nothing decide nothing (as pic.sh)
    if [ $seed = $SEED0 ] && ! beats $g; then
      echo "== compllm_s$seed: the CEs do not beat no context by $GAP within $steps steps (gap $g): one seed"
      SEEDS=$seed; break
    fi
  done
  ARMS=$(for seed in $SEEDS; do echo compllm_s$seed; done)
  ONE=compllm_s$SEED0
  # the mechanics, on the first seed: cached CEs answer as freshly compressed ones, and speed / KV size
  eval_arm $ONE qa:reuse "${QA[@]}" --concat 2
  eval_arm $ONE qa:fresh "${QA[@]}" --concat 2 --no-reuse
  speed_arm $ONE --lengths $LENGTHS
  reuse_check "$OUT/$ONE"
  $PY recipes/summarize.py --out "$OUT" --arms $ARMS --curves distill \
    --title "CompLLM: C = 2 concept embeddings vs full and no context (held-out questions), every run" \
    --metric "steps=log:step" --metric "F1 CEs=qa:scores.compressed.squad_f1" --metric "F1 full=qa:scores.full.squad_f1" \
    --metric "F1 none=qa:scores.none.squad_f1" --metric "Acc CEs=qa:scores.compressed.substring_acc" \
    --metric "Acc full=qa:scores.full.substring_acc" --metric "Acc none=qa:scores.none.substring_acc" \
    --metric "answer own/other=qa:loss.own_other_ratio" --metric "answer loss CEs=qa:loss.own" \
    --metric "other CEs=qa:loss.other" --metric "none=qa:loss.none" --metric "full=qa:loss.full" \
    --metric "cached CEs: same answers=reuse_check:identical_answers" \
    --metric "TTFT speedup (longest)=speed:rows.-1.speedup_offline" --note "model $MODEL_NAME"
  for B in none full; do
    # CompLLM Fig. 5: the CEs answer "comparable or slightly lower" than the full context at short contexts
    $PY recipes/verdict.py --out "$OUT" --claim "CompLLM: the CEs answer $([ $B = none ] && echo "better than no context" || echo "as well as the full context")" \
      --arm CEs $ARMS --arm $B $ARMS --expect CEs $B --context CEs compressed --context $B $B \
      --carry gap:ce_minus_none --carry-min $GAP --carry-name "answer found, CEs minus no context" \
      --metric "F1=qa:scores.{context}.squad_f1:higher" --metric "Acc=qa:scores.{context}.substring_acc:higher"
  done
  # the mechanical claims (CompLLM §4): true of the code path whatever the CEs hold, so no carry condition, but the
  # rule's 2 runs per arm still hold; they are measured on the first seed's run only, and the table says so
  $PY recipes/verdict.py --out "$OUT" --kind mechanical \
    --claim "CompLLM: from cached CEs the first token comes sooner and the KV cache is smaller than from the full context" \
    --arm "cached CEs" $ONE --arm full $ONE --expect "cached CEs" full --context "cached CEs" compressed --context full full \
    --metric "TTFT at the longest context (s)=speed:rows.-1.ttft_{context}_s:lower" \
    --metric "KV cache at the longest context (bytes)=speed:rows.-1.kv_bytes_{context}:lower"
fi
finish
