# Shared by the recipes (sourced, not run): where the model and data are, how an arm is trained, resumed and
# evaluated. Each recipe sets PAPER, then calls `train_arm` and `eval_arm`, then recipes/summarize.py.
#
#   MODEL=...      the LLM: a hub id or a local Hugging Face folder (default: the hub id
#                  HuggingFaceTB/SmolLM2-135M-Instruct, a 270 MB download the first time)
#   CORPUS=...     a folder with train.jsonl, heldout.jsonl and qa_train.jsonl (default runs/corpus, built by
#                  recipes/corpus.py on a Debian or Ubuntu machine); or TRAIN=, HELD=, TRAIN_QA=: any .jsonl files
#   SMOKE=1        the tiny random model, the built-in data, 2 steps per arm: seconds, for CI
#   SCALE=paper    the paper's own setup (its model, hub data, its recipe) on a GPU: the commands are written
#                  out in each recipe
#   OUT=...        where the runs, results.json, results.md and the figure go (default runs/recipes/PAPER)
# An arm that already has a checkpoint is continued with --resume, so a recipe stopped halfway (Ctrl-C, a
# time limit) picks up where it stopped when it is run again. An arm whose folder holds a finished run's record
# without its weights (logs, scores, configs: what recipes/results keeps in git) is not trained again, and every
# score the recipe needs from it is read from the record, so a recipe can span machines.

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
OUT=${OUT:-runs/recipes/$PAPER}
SMOKE=${SMOKE:-0}
SCALE=${SCALE:-cpu}
START=$SECONDS
mkdir -p "$OUT"

if [ "$SMOKE" = 1 ]; then
  MODEL=tiny
else
  MODEL=${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
fi
# how the records name the model: a hub id as given, a local folder by its own name (no machine-local path)
if [ -d "$MODEL" ]; then MODEL_NAME="a local folder, $(basename "$MODEL")"; else MODEL_NAME=$MODEL; fi

# the real English corpus (recipes/corpus.py): trains on train.jsonl, scores on heldout.jsonl only
CORPUS=${CORPUS:-runs/corpus}
if [ "$SMOKE" != 1 ] && [ "$SCALE" != paper ] && [ -z "${HELD:-}" ] && [ ! -f "$CORPUS/heldout.jsonl" ]; then
  $PY recipes/corpus.py --out "$CORPUS"
fi
if [ "$SMOKE" = 1 ]; then   # the built-in texts (train.py and evaluate.py hold different ones)
  TRAIN_TEXT=() ; TRAIN_QA=() ; HELD_TEXT=() ; HELD_QA=() ; HELD_EVAL=() ; HELD_EVAL_QA=()
else
  TRAIN_TEXT=(--data "${TRAIN:-$CORPUS/train.jsonl}") ; TRAIN_QA=(--data "${TRAIN_QA:-$CORPUS/qa_train.jsonl}")
  HELD_TEXT=(--data "${HELD:-$CORPUS/heldout.jsonl}") ; HELD_QA=(--data recipes/qa_heldout.jsonl)
  # the same held-out sets for train.py's check while an arm trains (--eval-data; on tiny its built-in set)
  HELD_EVAL=(--eval-data "${HELD:-$CORPUS/heldout.jsonl}") ; HELD_EVAL_QA=(--eval-data recipes/qa_heldout.jsonl)
fi

# the column every summary shows beside own/other (ours): the compression each memory was scored at, tokens
# per memory slot over the scored texts, mean (min-max), from eval_ae.json (recipes/summarize.py)
TOKENS_PER_SLOT=(--metric "tokens/slot, mean (min-max)=ae:tokens_per_slot")

# train_arm NAME TRAIN.PY-FLAGS...: train (or continue) the arm in $OUT/NAME
train_arm() {
  local name=$1; shift
  local dir="$OUT/$name"
  [ "$SMOKE" = 1 ] && set -- "$@" --steps 2 --save-every 1
  local steps done
  steps=$(printf '%s\n' "$@" | grep -A1 -x -- --steps | tail -1)
  if ls "$dir"/ckpt-*/train_state.pt >/dev/null 2>&1; then
    done=$(ls -d "$dir"/ckpt-*/ | sort | tail -1)   # the newest checkpoint's step: ckpt-NNNNNN/
    done=${done%/}; done=$((10#${done##*-}))
    if [ -n "$steps" ] && [ "$done" -ge "$steps" ]; then   # done already (an arm a recipe names twice: pic's probe)
      echo "== $name: trained to step $done"
    else
      echo "== $name: continuing $dir"
      $PY train.py --resume "$dir" ${steps:+--steps "$steps"}
    fi
  elif [ -f "$dir/log.jsonl" ]; then   # a kept record (recipes/results): the log and scores, not the weights
    done=$($PY -c 'import json, sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["step"])' "$dir/log.jsonl")
    if [ "$done" -lt "${steps:-0}" ]; then
      echo "$dir holds the record of a run stopped at step $done of $steps, without its weights: remove the folder to train it again" >&2
      exit 1
    fi
    echo "== $name: trained to step $done (its record is kept; the weights are not)"
  else
    echo "== $name: python train.py $* --model $MODEL --out $dir"
    $PY train.py "$@" --model "$MODEL" --out "$dir"
  fi
}

# scored NAME LABEL SCRIPT FLAGS...: run SCRIPT --ckpt $OUT/NAME FLAGS into $OUT/NAME/eval_LABEL.json, its markdown into
# eval_LABEL.md. A score newer than the arm's checkpoint is kept, unless REEVAL=1
scored() {
  local name=$1 label=$2 script=$3; shift 3
  if [ "${REEVAL:-0}" != 1 ] && [ "$OUT/$name/eval_$label.json" -nt "$OUT/$name/compressor.safetensors" ]; then
    echo "== $name: $label already scored"; return
  fi
  echo "== $name: python $script --ckpt $OUT/$name $*"
  $PY "$script" --ckpt "$OUT/$name" "$@" --out "$OUT/$name/eval_$label.json" > "$OUT/$name/eval_$label.md"
}

# eval_arm NAME TASK[:LABEL] EVALUATE.PY-FLAGS...: score the arm; its JSON lands in $OUT/NAME/eval_LABEL.json
# (LABEL defaults to TASK; give one to score the same task twice with different flags)
eval_arm() {
  local name=$1 task=${2%%:*} label=${2#*:}; shift 2
  [ "$SMOKE" = 1 ] && set -- "$@" --n 2 --max-new-tokens 4
  scored "$name" "$label" evaluate.py --task "$task" "$@"
}

# speed_arm NAME BENCH_SPEED.PY-FLAGS...: time to first token and KV-cache size of the arm against the full context
# (tests/bench_speed.py, CompLLM's claims), into $OUT/NAME/eval_speed.json as an evaluation
speed_arm() {
  local name=$1; shift
  [ "$SMOKE" = 1 ] && set -- "$@" --max-new-tokens 4
  scored "$name" speed tests/bench_speed.py "$@"
}

# diagnose_arm NAME HELD-FLAGS...: what the decoder sees of a trained arm's memory (recipes/diagnosis.py), measured
# now, while its weights are here, and kept in its folder for the recipe's diagnosis table
diagnose_arm() {
  local name=$1; shift
  $PY recipes/diagnosis.py --runs "$OUT/$name" "$@" > /dev/null
}

finish() {
  echo "wall time: $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s"
}
