#!/usr/bin/env bash
# The ladder: every preset under one protocol, which no paper ran. Each learns to regenerate held-out texts (the AE
# objective) from the same corpus, at the same text length, batch and number of steps, first at 1:1 (16-token texts,
# 16 memory slots: no compression, the sanity check every compressor must pass) and then at 4x (64-token texts, 16
# slots, or the preset's own way to 4x: CompLLM --ratio 4, GMSA --ratios 4). Every other setting is the preset's
# own (learning rate, schedule, LoRA, carrier, special tokens). Along the way each arm's held-out own/other is
# scored (recipes/curve.py): 1.0 means its memory is a learned constant prompt, <= 0.5 that it carries its text.
# Then the final BLEU and ROUGE-L, the parameters trained, the seconds per step, and what the decoder sees of each
# 1:1 arm's memory at init and after training (recipes/diagnosis.py).
#
#   bash recipes/ladder.sh              # SmolLM2-135M on 2 CPU cores, 17 arms x STEPS=300: 1:1 about 2 h, 4x about 2.2 h; resumes
#   SMOKE=1 bash recipes/ladder.sh      # tiny model, 2 steps per arm (CI)
#   RUNGS=1x bash recipes/ladder.sh     # one rung only; ARMS="icae aoc" for some presets only
#   OUT=runs/recipes/ladder_8x RUNGS=8x ARMS="lora 500x" bash recipes/ladder.sh   # 8x (ours): 128-token texts, 16 slots
#   SEED=1 OUT=runs/recipes/ladder_s1 bash recipes/ladder.sh   # another seed (data order and init)
#   LEVERS="icae:epl aoc:long@1x 500x:warm=500x_1x@4x" bash recipes/ladder.sh   # the lever phase (ours, below)
#   JOBS=14 ARMS=" " LONG_STEPS=2000 LEVERS="icae:long+batch16 ..." bash recipes/ladder.sh   # lever arms side by side (a GPU)
#
# The lever phase (ours): for a preset whose memory carries nothing, the same protocol with one lever on top
# of the preset's own flags, as an arm PRESET_LEVER_RUNG in the rung's panel. Levers (lever_flags): epl (EPL's
# positions), lora (the LoRA baseline's r 64 on q,k,v,o at lr 2e-4), long (LONG_STEPS, default 1500), batch16,
# curriculum (texts from 4 tokens up over the first third of the run), memlr (the memory tokens at MEM_LR, 1e-3),
# pretrain (AE + LM on texts of twice the rung's length: the rung's length is what is compressed), warm=ARM (start
# from ARM's trained tensors, e.g. the 4x arm from the 1:1 arm that carries), kv (the memory written into every layer's
# K/V, 500x's carrier, no bridge or delimiters: a labelled combination, not the paper's method), nobridge (kv's other
# changes, no bridge or delimiters, on the preset's own carrier: the arm that isolates the carrier), ratio=C (CompLLM's
# ratio: ceil(n/C) slots per sentence segment make C = 4 a measured 3.5x, C = 5 a measured 4.3x), ae=TOKEN (the token
# after the memory that predicts the text's first token: CompLLM has none, which the K/V carrier cannot take, so
# compllm:kv+ae=bos+ratio=5), lr=X (the preset's learning rate replaced by X), ownother[=W] (--own-other-weight W, default
# 1: a loss that a text's own memory beat its neighbour's) and memfromtext (--mem-from-text: memory slots that start
# from the text's segment means), the two against the embedding carrier's collapse. Levers joined by + stack, in order
# (long+batch16: the paper batch for LONG_STEPS). JOBS=N (ours) trains up to N lever arms at once, each one's output in
# OUT/NAME.out: on one GPU a small model leaves the device mostly idle, so arms side by side cost little more than one.
PAPER=ladder
source "$(dirname "$0")/common.sh"
[ "$SCALE" = paper ] && { echo "the ladder is ours (no paper ran it): it has no SCALE=paper setup"; exit 2; }

STEPS=${STEPS:-300}
EVERY=${EVERY:-50}
[ "$SMOKE" = 1 ] && EVERY=1 && RUNGS=${RUNGS:-1x}   # CI: the 1:1 rung (the 4x rung runs the same code)
# CI: one preset per carrier (every arm runs the same lines; the presets themselves are tested in tests/)
[ "$SMOKE" = 1 ] && ARMS=${ARMS-"icae aoc"}
ARMS=${ARMS-"icae 500x lora pcc pic compllm gmsa aoc"}   # set but empty: none
DIAG_ARMS=${DIAG_ARMS-icae_norm}   # ours, diagnostic arms at 1:1 (after the presets): ICAE with its memory rescaled
[ "$SMOKE" = 1 ] && DIAG_ARMS=""
# one arm of a rung: its preset and how it reaches the rung's compression, given n text tokens and ratio r
arm_flags() {
  local arm=$1 n=$2 r=$3
  case $arm in
    icae)    echo --method icae --mem 16 --chunk-len $((n + 1)) ;;   # ICAE's context is [BOS] x: one chunk
    icae_norm) echo --method icae --mem 16 --chunk-len $((n + 1)) --mem-norm ;;   # to the token embeddings' norm
    500x)    echo --method 500x --mem 16 --chunk-len $n ;;           # --objective ae: the original 500x recipe
    lora)    echo --method 500x --mem 16 --chunk-len $n --lora-r 64 --lora-alpha 32 --lora-dropout 0.05 \
               --lora-targets q_proj k_proj v_proj o_proj --lr 2e-4 ;;   # AOC's LoRA baseline (AOC code)
    pcc|pic) echo --method $arm --mem 16 --chunk-len $n ;;
    compllm) echo --method compllm --ratio $r ;;
    gmsa)    echo --method gmsa --ratios $r ;;
    aoc)     echo --method aoc --mem 16 --chunk-len $n ;;
  esac
}

# a lever's flags, given the rung's text length n (they come after the arm's own: the last of a flag wins)
lever_flag() {
  local lever=${1%%=*} value=${1#*=} n=$2
  case $lever in
    epl)        echo --layout epl ;;
    lora)       echo --lora-r 64 --lora-alpha 32 --lora-dropout 0.05 --lora-targets q_proj k_proj v_proj o_proj --lr 2e-4 ;;
    long)       echo --steps ${LONG_STEPS:-1500} ;;
    batch16)    echo --batch-size 16 ;;
    curriculum) echo --len-curriculum 4 $(( (${RUN_STEPS:-$STEPS} + 2) / 3 )) ;;
    memlr)      echo --mem-lr ${MEM_LR:-1e-3} ;;
    pretrain)   echo --objective pretrain --min-len $((2 * n)) --max-len $((2 * n)) ;;
    warm)       echo --warm-start "$OUT/$value" ;;
    nobos)      echo --no-bos ;;   # GMSA as the ladder first ran it, before its preset started the encoder with [BOS]
    kv)         echo --carrier kv --bridge none --no-delimiters ;;   # ours: the memory written into the decoder's K/V
    nobridge)   echo --bridge none --no-delimiters ;;   # ours: kv's other changes, the carrier kept (its control)
    ratio)      echo --ratio "$value" ;;   # CompLLM's C: on its sentence segments (S = 20) C = 4 is a measured 3.5x
    ae)         echo --ae-token "$value" ;;   # ae=bos: CompLLM on the K/V carrier needs a token after its memory
    lr)         echo --lr "$value" ;;         # lr=5e-4: the preset's learning rate, replaced
    # ours, against the embedding carrier's collapse: a text's own memory must beat its neighbour's (a loss term of
    # weight W, 1 for plain ownother), and memory slots that start from the text's segment means
    ownother)   echo --own-other-weight "$([ "$value" = "$1" ] && echo 1 || echo "$value")" ;;
    memfromtext) echo --mem-from-text ;;
    *)          echo "unknown lever $1 (epl lora long batch16 curriculum memlr pretrain warm=ARM nobos kv nobridge ratio=C ae=TOKEN lr=X ownother[=W] memfromtext)" >&2; exit 2 ;;
  esac
}
lever_flags() {   # one lever, or several joined by +: each one's flags in turn (curriculum spans long's steps)
  local one RUN_STEPS=$STEPS
  [[ +$1+ == *+long+* ]] && RUN_STEPS=${LONG_STEPS:-1500}
  for one in ${1//+/ }; do lever_flag "$one" "$2" || return 2; done
}
lever_name() {   # an arm's lever part: each lever with its value, "=" dropped and "/" as "-" (kv+ae=bos+ratio=5 ->
                 # kv+aebos+ratio5, lr=1e-5 -> lr1e-5), so arms that differ only in a value train in their own folders
  local one out=""
  for one in ${1//+/ }; do one=${one/=/}; out+=${out:++}${one//\//-}; done
  echo "$out"
}
# folders whose names leave out their levers' values, accepted as NEW=OLD (each old name holds the one value its
# args.json says): used where OUT holds the old folder and not the new one
KEPT_NAMES="compllm_kv+aebos_1x=compllm_kv+ae_1x gmsa_warmgmsa_1x_4x=gmsa_warm_4x
  compllm_kv+aebos+ratio5+long+batch16_4x=compllm_kv+ae+ratio+long+batch16_4x
  compllm_kv+aebos+ratio5+lr5e-4+long_4x=compllm_kv+ae+ratio+lr+long_4x"
arm_name() {   # the folder of lever arm NAME in OUT: NAME, or the kept folder it was trained in
  local kept
  for kept in $KEPT_NAMES; do
    if [ "${kept%%=*}" = "$1" ] && [ -d "$OUT/${kept#*=}" ] && [ ! -d "$OUT/$1" ]; then echo "${kept#*=}"; return; fi
  done
  echo "$1"
}
# lever_arm NAME LEN TRAIN.PY-FLAGS...: train the lever arm, then score it on held-out texts of LEN tokens
lever_arm() {
  local name=$1 len=$2; shift 2
  train_arm "$name" "$@"
  eval_arm "$name" ae "${HELD_TEXT[@]}" --n ${N:-32} --max-len "$len"
}
[ "$SMOKE" = 1 ] && LEVERS=${LEVERS:-"icae:epl aoc:memlr+curriculum 500x:pretrain"} && JOBS=${JOBS:-2}   # CI: + and JOBS too

GROUPS_ARGS=() PIDS=()
for rung in ${RUNGS:-1x 4x}; do
  case $rung in 1x) n=16 r=1 ;; 4x) n=64 r=4 ;; 8x) n=128 r=8 ;; *) echo "unknown rung $rung (1x, 4x or 8x)"; exit 2 ;; esac
  names=()
  for arm in $ARMS $([ $rung = 1x ] && echo $DIAG_ARMS); do
    # shellcheck disable=SC2046
    train_arm ${arm}_$rung $(arm_flags $arm $n $r) --objective ae --crop window --min-len $n --max-len $n \
      --batch-size 4 --steps $STEPS --save-every ${SAVE_EVERY:-$EVERY} --eval-every $EVERY --eval-n ${N:-32} "${HELD_EVAL[@]}" \
      --seed ${SEED:-0} "${TRAIN_TEXT[@]}"
    eval_arm ${arm}_$rung ae "${HELD_TEXT[@]}" --n ${N:-32} --max-len $n
    # the run logged its held-out own/other every $EVERY steps (train.py --eval-every); at 1:1, what the decoder sees
    # of the memory is measured now, while the weights are here, and kept in the arm's folder, so the summary below
    # needs no weights (an arm trained on another machine, recipes/results)
    if [ $rung = 1x ]; then diagnose_arm ${arm}_1x "${HELD_TEXT[@]}" --texts ${DIAG_TEXTS:-8}; fi
    names+=(${arm}_$rung)
  done
  for pair in ${LEVERS:-}; do   # the lever phase: PRESET:LEVER, or PRESET:LEVER@RUNG for one rung only
    [[ $pair == *@* && ${pair##*@} != "$rung" ]] && continue
    pair=${pair%@*}
    preset=${pair%%:*} lever=${pair#*:}
    name=$(arm_name ${preset}_$(lever_name $lever)_$rung)
    [[ " ${names[*]} " == *" $name "* ]] && { echo "LEVERS names the arm $name twice" >&2; exit 2; }
    flags=$(lever_flags $lever $n) || exit 2
    len=$n; [[ +$lever+ == *+pretrain+* ]] && len=$((2 * n))   # the text whose first half is compressed
    # shellcheck disable=SC2046,SC2086
    set -- $name $len $(arm_flags $preset $n $r) --objective ae --crop window --min-len $n --max-len $n \
      --batch-size 4 --steps $STEPS --save-every ${SAVE_EVERY:-$EVERY} --eval-every $EVERY --eval-n ${N:-32} \
      "${HELD_EVAL[@]}" --seed ${SEED:-0} "${TRAIN_TEXT[@]}" $flags
    if [ "${JOBS:-1}" -gt 1 ]; then   # side by side: wait for a free place, then start it in the background
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
      lever_arm "$@" > "$OUT/$name.out" 2>&1 &
      PIDS+=($!)
    else
      lever_arm "$@"
    fi
    names+=($name)
    LEVER_ARMS="${LEVER_ARMS:-} $name"
  done
  [ ${#names[@]} -gt 0 ] && GROUPS_ARGS+=(--group "$rung ($n tokens)" "${names[@]}")
done
for pid in "${PIDS[@]}"; do   # the arms trained side by side (JOBS): any that failed stops the recipe here
  wait "$pid" || { echo "a lever arm failed: see its output in $OUT/NAME.out" >&2; exit 1; }
done
$PY recipes/curve.py --out "$OUT" "${HELD_TEXT[@]}" --n ${N:-32} "${GROUPS_ARGS[@]}" --title "held-out own/other"
if [[ " ${RUNGS:-1x 4x} " == *" 1x "* && -n "${ARMS// }" ]]; then   # ARMS="": the lever arms alone
  $PY recipes/diagnosis.py --runs $(for arm in $ARMS $DIAG_ARMS; do echo "$OUT/${arm}_1x"; done) "${HELD_TEXT[@]}" \
    --texts ${DIAG_TEXTS:-8} --out "$OUT/diagnosis"
fi
ALL="$(for rung in ${RUNGS:-1x 4x}; do for arm in $ARMS $([ $rung = 1x ] && echo $DIAG_ARMS); do echo ${arm}_$rung; done; done) ${LEVER_ARMS:-}"
$PY recipes/summarize.py --out "$OUT" --arms $ALL --curves \
  --title "The ladder: every preset, one protocol (AE on held-out texts, batch 4, $STEPS steps${LEVER_ARMS:+; a lever arm: the steps and batch its levers set})" \
  --metric "first step at own/other 0.5=curve:first_at_threshold" --metric "own/other=ae:loss.own_other_ratio" "${TOKENS_PER_SLOT[@]}" \
  --metric "BLEU-4 (words)=ae:scores.compressed.bleu4_words" --metric "ROUGE-L=ae:scores.compressed.rougeL" \
  --metric "AE loss own=ae:loss.own" --metric "no memory=ae:loss.none" --metric "trained parameters=params:" \
  --metric "s/step=curve:s_per_step" --note "model $MODEL_NAME; the figure: curve.png; the diagnosis: diagnosis.md"
# the lever table (recipes/levers.py): every preset x lever x rung; LEVER_EXTRA="PRESET:LEVER@RUNG=FOLDER ..." adds arms
# kept by another recipe under the same protocol (e.g. aoc.sh's 1,500-step AOC at 16 tokens as aoc:long@1x)
# shellcheck disable=SC2046
$PY recipes/levers.py --out "$OUT" $(for e in ${LEVER_EXTRA:-}; do echo --extra "$e"; done)
finish
