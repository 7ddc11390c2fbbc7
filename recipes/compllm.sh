#!/usr/bin/env bash
# CompLLM (§4): a C = 2 segment compressor distilled from the LLM's own answers (Eq. 1-3), answering held-out
# questions from concept embeddings next to the full context and no context; segments are compressed
# independently, so a context shared by several questions is compressed once and its cached CEs give the same
# answers; time to first token and KV-cache size against the full context.
#
#   bash recipes/compllm.sh             # SmolLM2-135M-Instruct on 2 CPU cores, ~1.3 h (about 17 s a step; STEPS=80: 40 min)
#   SMOKE=1 bash recipes/compllm.sh     # tiny model, 2 steps (CI)
#   SCALE=paper bash recipes/compllm.sh # CompLLM §4.1 on a GPU: Qwen3-4B, NarrativeQA + RACE
PAPER=compllm
source "$(dirname "$0")/common.sh"

if [ "$SCALE" = paper ]; then
  # CompLLM §4.1: LoRA r 32, Adam lr 1e-4, batch 4, C = 2, S = 20, teacher answers of up to 512 tokens
  MODEL=${MODEL:-Qwen/Qwen3-4B}
  DATA=hf://datasets/deepmind/narrativeqa/data/train-00000-of-00024.parquet
  HELD=hf://datasets/rajpurkar/squad/plain_text/validation-00000-of-00001.parquet
  train_arm compllm --method compllm --data $DATA --steps 20000
  QA=(--data $HELD --n 1000)
  LENGTHS=1024,2048,4096,8192,16384,32768
else
  # ours: the fill-in-the-blank training questions, the LLM's own answers of up to 48 tokens, 200 steps
  train_arm compllm --method compllm "${TRAIN_QA[@]}" --max-len 256 --batch-size 4 --lr 1e-4 \
    --answer-tokens ${ANSWER_TOKENS:-48} --steps ${STEPS:-200} --save-every 100
  QA=("${HELD_QA[@]}" --max-new-tokens 32)
  LENGTHS=${LENGTHS:-256,512,1024,2048,4096}
fi
eval_arm compllm qa "${QA[@]}"
# two questions per long context: compressed once (reused) or anew; the answers must be identical
eval_arm compllm qa:reuse "${QA[@]}" --concat 2
eval_arm compllm qa:fresh "${QA[@]}" --concat 2 --no-reuse
eval_arm compllm speed --lengths $LENGTHS
$PY - "$OUT/compllm" <<'PY'
import json, sys
d = sys.argv[1]
reuse, fresh = (json.load(open(f"{d}/eval_{k}.json")) for k in ("reuse", "fresh"))
same = all(a["compressed"]["text"] == b["compressed"]["text"] for a, b in zip(reuse["examples"], fresh["examples"]))
print(f"cached CEs give the same answers as compressing anew: {same} ({len(reuse['examples'])} questions, "
      f"{reuse['concat']} per context)")
json.dump({"identical_answers": same, "questions": len(reuse["examples"])}, open(f"{d}/eval_reuse_check.json", "w"))
PY
$PY recipes/summarize.py --out "$OUT" --arms compllm --curves distill \
  --title "CompLLM: C = 2 concept embeddings vs full and no context (held-out questions)" \
  --metric "F1 CEs=qa:scores.compressed.squad_f1" --metric "F1 full=qa:scores.full.squad_f1" \
  --metric "F1 none=qa:scores.none.squad_f1" --metric "Acc CEs=qa:scores.compressed.substring_acc" \
  --metric "Acc full=qa:scores.full.substring_acc" --metric "Acc none=qa:scores.none.substring_acc" \
  --metric "cached CEs: same answers=reuse_check:identical_answers" \
  --metric "TTFT speedup (longest)=speed:rows.-1.speedup_offline" --note "model $MODEL"
finish
