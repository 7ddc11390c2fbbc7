#!/usr/bin/env bash
# AOC (Tables 1-3): the attention-only compressor (the LLM without its MLPs, fully trained) against the LoRA encoder
# of AOC's own baseline (500xCompressor as AOC's code runs it: r 64, α 32, dropout 0.05 on q, k, v, o), with m = 4
# and 16 memory tokens, each text the first n tokens of a document. The claim: AOC regenerates better (BLEU, EM,
# ROUGE-L) with about a third of the encoder parameters. Plus the sanity check m = n (no compression), whose
# held-out own/other is followed against the steps.
#
#   bash recipes/aoc.sh                 # SmolLM2-135M on this CPU, ~2 h (arms one after the other)
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
  train_arm aoc_n16 --method aoc --mem 16 --max-len 16 --batch-size 4 --steps ${SANITY_STEPS:-2000} \
    --save-every 250 --keep-every 250 "${TRAIN_TEXT[@]}"
  for ckpt in "$OUT"/aoc_n16/ckpt-*; do
    [ -f "$ckpt/eval_ae.json" ] || $PY evaluate.py --ckpt "$ckpt" --task ae "${HELD_TEXT[@]}" --n ${N:-48} \
      --max-new-tokens 16 --out "$ckpt/eval_ae.json" > /dev/null
  done
  cp "$(ls -d "$OUT"/aoc_n16/ckpt-* | tail -1)/eval_ae.json" "$OUT/aoc_n16/eval_ae.json"
  ARMS="$ARMS aoc_n16"
  $PY - "$OUT/aoc_n16" <<'PY'
import glob, json, os, sys
sys.path.insert(0, ".")
import evaluate as E
run = sys.argv[1]
rows = []
for ckpt in sorted(glob.glob(f"{run}/ckpt-*")):
    L = json.load(open(f"{ckpt}/eval_ae.json"))["loss"]
    rows.append((int(ckpt.rpartition("-")[2]), L["own"], L["other"], L["own_other_ratio"]))
json.dump([dict(step=s, own=o, other=t, ratio=r) for s, o, t, r in rows], open(f"{run}/ratio_curve.json", "w"))
print("| step | held-out AE loss, own memory | another text's memory | own/other |\n|---|---|---|---|")
for s, o, t, r in rows:
    print(f"| {s} | {o:.3f} | {t:.3f} | {r:.3f} |")
plt = E.pyplot()
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r[0] for r in rows], [r[3] for r in rows], marker="o")
ax.axhline(0.9, color="grey", linestyle=":")
ax.set(xlabel="step", ylabel="held-out own / other", title="AOC, m = n = 16 on SmolLM2-135M")
fig.tight_layout(); fig.savefig(f"{os.path.dirname(run)}/ratio_curve.png", dpi=100)
PY
fi
$PY recipes/summarize.py --out "$OUT" --arms $ARMS --curves loss \
  --title "AOC vs its LoRA baseline (regeneration of held-out texts, each cut to its first n tokens)" \
  --metric "BLEU (words, method1)=ae:scores.compressed.bleu4_words" --metric "AOC EM=ae:scores.compressed.aoc_em" \
  --metric "ROUGE-L (rouge 1.0.1)=ae:scores.compressed.aoc_rougeL" --metric "own/other=ae:loss.own_other_ratio" \
  --metric "AE loss own=ae:loss.own" --metric "no memory=ae:loss.none" \
  --metric "trained encoder parameters=params:" --note "model $MODEL"
finish
