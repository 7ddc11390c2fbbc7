#!/usr/bin/env bash
# AOC (Tables 1-3): the attention-only compressor (the LLM without its MLPs, fully trained) against the LoRA encoder
# of AOC's own baseline (500xCompressor as AOC's code runs it: r 64, α 32, dropout 0.05 on q, k, v, o), with m = 4
# and 16 memory tokens, each text the first n tokens of a document. The claim: AOC regenerates better (BLEU, EM,
# ROUGE-L) with about a third of the encoder parameters. Plus the sanity check m = n (no compression), whose
# held-out own/other is followed against the steps.
#
#   bash recipes/aoc.sh                 # SmolLM2-135M on 2 CPU cores, ~2.5 h (STEPS=200 SANITY_STEPS=1500 CHECK_STEPS=300: 80 min)
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
else
  # ours: n = 32 tokens per text (m = 16: 2x, m = 4: 8x), batch 4, the paper's lr 2e-4 (300 warmup steps cut to
  # 10% of the run), STEPS steps per arm; then the m = n = 16 sanity arm for SANITY_STEPS, its checkpoint kept
  # every 250 steps and scored on the held-out texts
  N_TOK=${N_TOK:-32}
  for m in 4 16; do
    train_arm aoc_m$m --method aoc --mem $m --max-len $N_TOK --batch-size 4 --steps ${STEPS:-500} --save-every 250 \
      "${TRAIN_TEXT[@]}"
    train_arm lora_m$m "${BASELINE[@]}" --mem $m --chunk-len $N_TOK --max-len $N_TOK --batch-size 4 --lr 2e-4 \
      --steps ${STEPS:-500} --save-every 250 "${TRAIN_TEXT[@]}"
  done
  ARMS="aoc_m4 lora_m4 aoc_m16 lora_m16"
  for arm in $ARMS; do eval_arm $arm ae "${HELD_TEXT[@]}" --n ${N:-48}; done
  # the sanity check, m = n = 16 (no compression), each arm's checkpoints kept and scored along the way: the
  # preset; the same fully trained copy with its MLPs kept; AOC's LoRA baseline. And what the decoder sees of
  # each encoder's memory before training (recipes/aoc_diagnosis.py)
  train_arm aoc_n16 --method aoc --mem 16 --max-len 16 --batch-size 4 --steps ${SANITY_STEPS:-2000} \
    --save-every 250 --keep-every 250 "${TRAIN_TEXT[@]}"
  train_arm aocmlp_n16 --method aoc --mlp swiglu --mem 16 --max-len 16 --batch-size 4 --steps ${CHECK_STEPS:-400} \
    --save-every 100 --keep-every 100 "${TRAIN_TEXT[@]}"
  train_arm lora_n16 "${BASELINE[@]}" --mem 16 --chunk-len 16 --max-len 16 --batch-size 4 --lr 2e-4 \
    --steps ${CHECK_STEPS:-400} --save-every 100 --keep-every 100 "${TRAIN_TEXT[@]}"
  SANITY="aoc_n16 aocmlp_n16 lora_n16"
  for arm in $SANITY; do
    for ckpt in "$OUT/$arm"/ckpt-*; do
      [ -f "$ckpt/eval_ae.json" ] || $PY evaluate.py --ckpt "$ckpt" --task ae "${HELD_TEXT[@]}" --n ${N:-48} \
        --max-new-tokens 16 --out "$ckpt/eval_ae.json" > /dev/null
    done
    cp "$(ls -d "$OUT/$arm"/ckpt-* | tail -1)/eval_ae.json" "$OUT/$arm/eval_ae.json"
  done
  ARMS="$ARMS $SANITY"
  [ "$SMOKE" = 1 ] || $PY recipes/aoc_diagnosis.py --model "$MODEL" --data "$CORPUS/heldout.jsonl" \
    --out "$OUT/diagnosis.json" | tee "$OUT/diagnosis.md"
  $PY - "$OUT" $SANITY <<'PY'
import glob, json, os, sys
sys.path.insert(0, ".")
import evaluate as E
out, arms = sys.argv[1], sys.argv[2:]
curves, lines = {}, ["| arm | " + " | ".join(["step", "held-out AE loss, own memory", "another text's memory",
                                               "own/other"]) + " |", "|---|---|---|---|---|"]
for arm in arms:
    rows = []
    for ckpt in sorted(glob.glob(f"{out}/{arm}/ckpt-*")):
        L = json.load(open(f"{ckpt}/eval_ae.json"))["loss"]
        rows.append(dict(step=int(ckpt.rpartition("-")[2]), own=L["own"], other=L["other"], ratio=L["own_other_ratio"]))
        lines.append(f"| {arm} | {rows[-1]['step']} | {L['own']:.3f} | {L['other']:.3f} | {L['own_other_ratio']:.3f} |")
    curves[arm] = rows
json.dump(curves, open(f"{out}/ratio_curve.json", "w"), indent=1)
open(f"{out}/ratio_curve.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
plt = E.pyplot()
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for arm, rows in curves.items():
    ax.plot([r["step"] for r in rows], [r["ratio"] for r in rows], marker="o", label=arm)
ax.axhline(0.9, color="grey", linestyle=":")
ax.set(xlabel="step", ylabel="held-out own / other", title="m = n = 16: does each memory carry its own text?")
ax.legend()
fig.tight_layout()
fig.savefig(f"{out}/ratio_curve.png", dpi=100)
PY
fi
$PY recipes/summarize.py --out "$OUT" --arms $ARMS --curves loss \
  --title "AOC vs its LoRA baseline (regeneration of held-out texts, each cut to its first n tokens)" \
  --metric "BLEU (words, method1)=ae:scores.compressed.bleu4_words" --metric "AOC EM=ae:scores.compressed.aoc_em" \
  --metric "ROUGE-L (rouge 1.0.1)=ae:scores.compressed.aoc_rougeL" --metric "own/other=ae:loss.own_other_ratio" \
  --metric "AE loss own=ae:loss.own" --metric "no memory=ae:loss.none" \
  --metric "trained encoder parameters=params:" --note "model $MODEL"
finish
