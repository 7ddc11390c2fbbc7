"""
Train a soft context compressor: one script for every method in compressors.py.

    python train.py --method aoc --mem 16          # CPU, about a minute: --model tiny's demo (below)

The script reads top to bottom: arguments (with each paper's training recipe as the defaults), model and
compressor, data, optimizer and schedule, the loop, checkpoints. The objectives, each named after its paper:

    pretrain   L = α·L_LM + (1 − α)·L_AE on ONE compression of the first p = ⌊|X|/2⌋ tokens of a text X
               (EPL §3.1.1 and App. C; PIC Eq. 6-8 with λ = α = 0.5: TR = AE reconstructs x_1..x_p and EOS,
               TC = LM continues with x_p+1..x_|X| and EOS, as the EPL and PCC code build their targets)
    ae         L_AE alone: regenerate the compressed text (ICAE AE, AOC Eq. 4, GMSA stage 1)
    qa         [memory; [LM]; prompt] -> answer, cross-entropy on the answer and EOS only, the prompt built from
               the preset's template (EPL fine-tuning, PCC/PIC SQuAD, GMSA KEFT)
    distill    CompLLM Eq. (1)-(3): the LLM reading the memory imitates, layer by layer, the LLM reading the
               full context, on answers the frozen LLM generated itself (cached on disk)

Every run can be stopped and continued exactly: a checkpoint (trained tensors, optimizer, RNG states, step,
args) is written as a unit (into a temporary directory, then renamed) every --save-every steps, at the end,
after --stop-after K, and on Ctrl-C / SIGTERM. The batch of step s is drawn from a generator seeded with
(seed, s, sample index), so the data position is just the step number. `compressors.load(--out)` reads the
latest compressor (evaluate.py does). A text is a random window of a document (--crop window) or its first n
tokens (--crop head, AOC's protocol). Out of memory, or a non-finite loss, ends the run with one line and keeps
the last good checkpoint.

The default model, `tiny` (a random 4-layer Llama with a byte tokenizer, trained on a built-in corpus), is a CPU demo
(ours): there every method's defaults are not its paper's recipe but settings that make its memory carry its text
within two minutes (TINY_ALL and TINY: AE on the first n bytes of each document, n = 16 for AOC and 8 for the
others, batch 4, lr 3e-3 decaying linearly to 0, each method's steps and memory size; --help lists them), scored by
`python evaluate.py --ckpt runs/aoc --task ae`. Flags override them; any other model trains with the paper's recipe.

On a GPU with a paper model (bf16 autocast, same flags):

    python train.py --method aoc --mem 16 --model meta-llama/Llama-3.2-1B-Instruct --data corpus/ --steps 20000
    torchrun --nproc_per_node 8 train.py --method icae --layout epl --model meta-llama/Llama-3.2-1B --data pile.jsonl
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from tqdm import tqdm

import compressors as C
from model import SHAPES, load_pretrained

# ---- arguments ----

# --model tiny (a random 4-layer Llama, a byte tokenizer, the built-in corpus) is a CPU demo that compresses (ours):
# `python train.py --method aoc --mem 16` then `python evaluate.py --ckpt runs/aoc --task ae` take under two minutes
# together on 2 CPU cores and print held-out own/other <= 0.5 (the README's Quickstart; each preset's measured number
# and wall time: recipes/README.md). Every method trains AE (what evaluate.py --task ae scores) on the first n bytes of
# each document (a head crop: evaluate.py cuts its held-out texts the same way), batch 4, lr 3e-3 decaying linearly to 0
# (TINY_ALL), with the text length n, steps and memory size m of its row (TINY): m = n (ICAE 2n; GMSA 5: [BOS] and the
# 8 bytes in groups of 2), n = 16 for AOC and 8 for the others (which do not carry 16 bytes within two minutes). These
# fill only the flags not given, in place of the paper's recipe; any other model keeps the paper's.
TINY_ALL = dict(objective="ae", crop="head", batch_size=4, lr=3e-3, schedule="linear")
TINY = {   # ours: measured on this repository's 2-core CPU, recipes/README.md "The tiny demo, each preset"
    "icae": dict(lengths=(8, 8), mem=16, steps=3000),   # (at m = 8: own/other 0.514 at step 3000)
    "500x": dict(lengths=(8, 8), mem=8, steps=3000),
    "pcc": dict(lengths=(8, 8), mem=8, steps=3000),
    "pic": dict(lengths=(8, 8), mem=8, steps=3000),
    "compllm": dict(lengths=(8, 8), ratio=1.0, steps=3000),   # one concept embedding per byte (the paper: C = 2)
    "gmsa": dict(lengths=(8, 8), ratios=(2,), steps=3000),    # groups of 2 (the paper samples 4 or 8)
    "aoc": dict(lengths=(16, 16), steps=2000),
}
# flags that may change when a run is continued with --resume; every other flag must match the checkpoint
RUN_FLAGS = {"resume", "out", "steps", "stop_after", "save_every", "keep_every", "micro_batch", "compile",
             "grad_ckpt", "device", "frozen_dtype", "fsdp", "cache_dir", "eval_data", "eval_every", "eval_n"}
# flags that name a local file or folder (or a hub id): saved absolute, so a run resumes from any directory
PATH_FLAGS = ("model", "decoder", "data", "eval_data", "init", "warm_start")
EXAMPLES = """examples:
  python train.py --method aoc --mem 16                # quickstart: --model tiny, its demo settings (above)
  python train.py --method aoc --mem 16 --model meta-llama/Llama-3.2-1B-Instruct --data corpus/ --steps 20000
  python train.py --method icae --layout epl --mem 102 --model meta-llama/Llama-3.2-1B --data pile.jsonl
  python train.py --method pic --model Qwen/Qwen2.5-0.5B-Instruct --decoder meta-llama/Meta-Llama-3-8B-Instruct
  python train.py --method gmsa --stage keft --init runs/gmsa --data qa.jsonl --out runs/gmsa-keft
  python train.py --resume runs/aoc --stop-after 4000                                  # time-sliced jobs
  torchrun --nproc_per_node 8 train.py --method icae ...                               # one process per GPU"""
# every compressor axis (compressors.CompressorConfig) that a flag can set
COMPRESSOR_FLAGS = tuple(f.name for f in C.FLAG_FIELDS)
RECIPE_FLAGS = ("lr", "betas", "weight_decay", "schedule", "batch_size", "clip", "steps", "lm_weight", "crop")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", usage="python train.py --method METHOD [options]   (--help lists every flag)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__.split("\n\n")[0].strip(),
        epilog=defaults_table() + "\n\n" + EXAMPLES)
    g = p.add_argument_group("what to train")
    g.add_argument("--method", choices=C.METHODS, help="the compressor preset (compressors.PRESETS); "
                   "optional with --resume")
    g.add_argument("--model", default="tiny", help="the LLM: a Hugging Face id, a local folder with config.json "
                   "+ *.safetensors, or 'tiny' (a random 4-layer model, the default: a CPU demo with defaults of its "
                   "own, listed below the per-method table). It decodes, and "
                   "it is the compressor for pcc/pic when --decoder names another LLM")
    g.add_argument("--decoder", help="a different frozen decoder LLM (pcc/pic: PIC §4.1.2 compresses with "
                   "Qwen2.5-0.5B and decodes with Llama-3-8B); default: --model itself")
    g.add_argument("--objective", choices=("pretrain", "ae", "qa", "distill"),
                   help="pretrain: α·LM + (1-α)·AE (EPL §3.1.1, PIC Eq. 8); ae: reconstruction only (AOC Eq. 4, "
                   "GMSA stage 1); qa: answer-only fine-tuning; distill: CompLLM Eq. 1-3. Default per method: "
                   "pretrain for icae/500x/pcc/pic, ae for aoc/gmsa, distill for compllm, qa for --stage keft. "
                   "On some presets it changes compressor settings too (the per-method table below names them: "
                   "--objective ae on 500x is the original 500xCompressor code)")
    g.add_argument("--stage", choices=("ae", "keft"), default="ae",
                   help="GMSA §3.5: 'keft' freezes encoder and LSA and trains the decoder's q/k/v on QA data; "
                   "start it from the stage-1 run with --init (default: ae)")
    g.add_argument("--init", help="start from the compressor of a finished run (its --out): QA fine-tuning "
                   "after pretraining, GMSA KEFT after stage 1. The compressor settings come from that run")
    g.add_argument("--data", help="plain text (.txt, any other extension), JSON lines (.jsonl) or Parquet (.parquet, "
                   "needs pyarrow) with a \"text\" column or \"context\", \"question\", \"answer\" (SQuAD's "
                   "{\"text\": [...]} answers too), a folder of them, or hf://datasets/OWNER/NAME/PATH (one file "
                   "of a hub data set). Default: a small built-in corpus")
    g.add_argument("--out", help="run directory: checkpoints, log.jsonl, token cache (default: runs/METHOD, or "
                   "the --resume directory)")

    g = p.add_argument_group("compressor (default: the method's preset, compressors.PRESETS)")
    for f in C.FLAG_FIELDS:   # one flag per compressor axis, its help and choices from CompressorConfig
        flag, kind, meta = "--" + f.name.replace("_", "-"), type(f.default), f.metadata
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, help=meta["help"])
        elif kind is tuple:
            g.add_argument(flag, type=meta["item"], nargs="+", metavar=meta.get("metavar"), help=meta["help"])
        else:
            g.add_argument(flag, type=kind, choices=meta["choices"], help=meta["help"])

    g = p.add_argument_group("optimization (default: the method's row in the table below)")
    g.add_argument("--steps", type=int, help="optimizer steps of the whole run")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (matrices only; 0 = Adam)")
    g.add_argument("--schedule", choices=("constant", "linear", "cosine"), help="after warmup: constant, or "
                   "linear / cosine decay to 0 at --steps")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default: the paper's, at most 10%% of --steps)")
    g.add_argument("--batch-size", type=int, help="examples per optimizer step, over all GPUs and micro-batches")
    g.add_argument("--micro-batch", type=int, help="examples per forward pass and GPU (default: the whole "
                   "batch); smaller values accumulate gradients")
    g.add_argument("--clip", type=float, help="gradient-norm clipping (0 = off)")
    g.add_argument("--lm-weight", type=float, help="α (EPL) / λ (PIC Eq. 8): weight of the LM loss in "
                   "pretrain; AE gets 1 - α (default 0.5)")

    add_data_and_run_flags(p)
    return p


def add_data_and_run_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("levers: ours, for a memory that carries nothing at this scale "
                             "(recipes/README.md, 'The ladder')")
    g.add_argument("--mem-lr", type=float, help="peak learning rate of the learned memory tokens alone (the same "
                   "schedule; default: --lr)")
    g.add_argument("--len-curriculum", type=int, nargs=2, metavar=("N", "K"), help="texts start at N tokens and "
                   "grow linearly to --min-len..--max-len over the first K steps (a curriculum from short texts)")
    g.add_argument("--warm-start", metavar="RUN", help="start from the trained tensors of another run's compressor "
                   "(its --out; the same tensor names and shapes), keeping this run's settings: e.g. a 4x arm from "
                   "the 1:1 arm that carries its text")

    g = p.add_argument_group("data")
    g.add_argument("--min-len", type=int, help="shortest text |X| in tokens (default: the paper's, scaled "
                   "down with a shorter --chunk-len and for --model tiny); --crop window only (a head crop's texts "
                   "are all --max-len tokens)")
    g.add_argument("--max-len", type=int, help="longest text |X|; also caps QA contexts")
    g.add_argument("--crop", choices=("window", "head"), help="how a text is cut from a document: a window of "
                   "|X| tokens at a random offset, or its first --max-len tokens, a short document padded with EOS "
                   "(AOC code: one model per prompt length). Default per method")
    g.add_argument("--answer-tokens", type=int, default=512, help="distill: longest answer the frozen LLM "
                   "generates as the teacher (CompLLM's answers average 149-273 tokens; default 512)")
    g.add_argument("--cache-dir", help="token and teacher-answer cache (default: OUT/cache)")

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seeds the data order, GMSA's ratios and the init (default 0)")
    g.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps (default 1000)")
    g.add_argument("--resume", help="continue the run in this directory exactly where its checkpoint stopped; "
                   "only " + ", ".join("--" + f.replace("_", "-") for f in sorted(RUN_FLAGS - {"resume"})) +
                   " may change")
    g.add_argument("--stop-after", type=int, help="end cleanly with a checkpoint after step K (time-sliced "
                   "jobs); continue with --resume")
    g.add_argument("--keep-every", type=int, help="also keep the checkpoint of every K-th step (PIC §4.3.2 "
                   "fine-tunes checkpoints taken during pretraining); default: only the newest is kept")
    g.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per transformer block "
                   "(encoder and decoder): less memory, about a third more compute")
    g.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks")
    g.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    g.add_argument("--fsdp", action="store_true", help="shard every weight over the torchrun processes with "
                   "PyTorch's FSDP2 (sharding.py) instead of replicating it (DDP): for a model that does not fit on "
                   "one GPU. Checkpoints are the one-process format")
    g.add_argument("--plan", action="store_true", help="print the run's memory per GPU (parameters by dtype, "
                   "weights, gradients, AdamW, activations; plan.py), built on the meta device, and exit")
    g.add_argument("--shape", choices=tuple(SHAPES), help="with --plan: a paper model's shape (model.SHAPES) in place "
                   "of --model, no download")
    g.add_argument("--frozen-dtype", choices=("auto", "fp32", "bf16"), default="auto", help="the frozen base "
                   "weights' dtype; what trains (and what a checkpoint holds) is always fp32 for AdamW. auto: bf16 on "
                   "CUDA (the EPL and AOC code's dtype: half the memory), fp32 elsewhere. bf16 computes under bf16 "
                   "autocast on any device; fp32 keeps every weight fp32 (CUDA still autocasts)")

    g = p.add_argument_group("held-out check: does the memory carry its own text? (ours)")
    g.add_argument("--eval-data", help="held-out examples to score while training (.jsonl/.parquet/.txt, as "
                   "evaluate.py --data reads them: texts for ae/pretrain, QA triples for qa/distill); default on "
                   "--model tiny: evaluate.py's built-in held-out set; on a real model none (the run says so)")
    g.add_argument("--eval-every", type=int, help="score the held-out examples every N steps, at step 0 and at "
                   "the end (default: at every checkpoint, --save-every; 0 = never)")
    g.add_argument("--eval-n", type=int, default=32, help="held-out examples scored (the first N; default 32)")


def defaults_table() -> str:
    """The per-method defaults as the table --help prints."""
    rows = ["per-method defaults (flags override; compressors.PRESETS gives the sources of each):",
            f"  {'method':8} {'objective':9} {'lr':>7} {'betas':>11} {'wd':>5} {'schedule':9} {'warmup':>6} "
            f"{'batch':>5} {'clip':>4} {'steps':>6}  |X|"]
    for m, r in ((m, p.recipe) for m, p in C.PRESETS.items()):
        rows.append(f"  {m:8} {r.objective:9} {r.lr:7.0e} {str(r.betas):>11} {r.weight_decay:5} "
                    f"{r.schedule:9} {r.warmup:6} {r.batch_size:5} {r.clip:4} {r.steps:6}  "
                    f"{r.lengths[0]}-{r.lengths[1]}" + "".join(f"   {o}: {dict(v)}" for o, v in r.per_objective.items()))
    rows += [f"--objective {o} on {m} also sets: {objective_changes(m, o)}"
             for m, p in C.PRESETS.items() for o in p.objective_settings]
    common = ", ".join(f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                       for k, v in TINY_ALL.items())
    rows += ["", "--model tiny (the default): a CPU demo that compresses (ours; README, Quickstart). In place of the "
             "rows above,", f"every method trains with {common},",
             "on the first n bytes of each document (n also caps QA contexts), and:",
             f"  {'method':8} {'n':>3} {'steps':>6}  other (the rest: its row above)"]
    for m, d in TINY.items():
        rows.append(f"  {m:8} {d['lengths'][1]:3} {d['steps']:6}  " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, tuple) else f'{v:g}'}"
            for k, v in d.items() if k not in ("lengths", "steps")))
    return "\n".join(rows)


def objective_changes(method, objective, cfg=None) -> str:
    """The compressor settings that --objective changes on this preset, as "k=v, ..." ("" for none): e.g. 500x's ae
    is the original 500xCompressor code, with another special token, init, LoRA and template. With the run's
    config `cfg`, only those it took (a flag overrides any of them)."""
    return ", ".join(f"{k}={v}" for k, v in C.PRESETS[method].settings_for(objective).items()
                     if cfg is None or getattr(cfg, k) == v)


def fail(message) -> None:
    """A one-line error, no traceback: bad flags, paths, data or checkpoints end here."""
    raise SystemExit(f"train.py: error: {message}")


def parse_args(argv=None):
    """Flags -> a complete argparse.Namespace (every default resolved), saved with each checkpoint.
    With --resume the checkpoint's own args come back, and only RUN_FLAGS may change."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = typed_flags(argv)
    # local paths become absolute, so --resume and compressors.load(--out) work from any directory
    for k in PATH_FLAGS:
        v = getattr(args, k)
        if v and os.path.exists(v):
            setattr(args, k, os.path.abspath(v))
    if args.resume:
        state = read_train_state(args.resume)
        saved = state["args"]
        for k in sorted(given - RUN_FLAGS):
            if getattr(args, k) != saved.get(k):
                fail(f"mismatched checkpoint: {args.resume} was trained with --{k.replace('_', '-')} {saved.get(k)}, "
                     f"not {getattr(args, k)} (drop the flag to continue that run)")
        # flags added after the checkpoint was written take their defaults (an old run resumes)
        merged = {**{k: parser.get_default(k) for k in vars(args)}, **saved,
                  **{k: getattr(args, k) for k in RUN_FLAGS & given}}
        merged.update(resume=args.resume, stop_after=args.stop_after, out=args.out or args.resume)
        return argparse.Namespace(**merged), state
    if args.method is None:
        parser.error("--method is required (or --resume DIR)")
    if args.shape:   # --plan only: the paper's recipe at that shape (not tiny's demo)
        if not args.plan or args.model != "tiny":
            fail("--shape names a model shape for --plan (tests/bench_train.py --shape times one): drop --model, "
                 "add --plan")
        args.model = args.shape
    return resolve_defaults(args), None


def typed_flags(argv=None) -> set:
    """The flags typed on the command line (dests), whatever their values: argv parsed again with every default
    suppressed, so a flag typed with its default value counts too (--resume DIR --eval-n 32 after --eval-n 4)."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))


def on_tiny(model, decoder=None) -> bool:
    """Does the run train the built-in tiny model (its demo settings, its built-in held-out check)?"""
    return model == "tiny" and decoder is None


def tiny_demo(method, model, decoder=None) -> dict:
    """The demo settings (TINY_ALL + TINY[method]) that replace the paper's recipe on --model tiny, else {}."""
    return {**TINY_ALL, **TINY[method]} if on_tiny(model, decoder) else {}


def resolve_defaults(args):
    """Fill every flag left unset from the method's paper recipe (compressors.PRESETS), scaled for small runs;
    on --model tiny from its demo settings (TINY) instead, where they have a value."""
    init = None
    if args.init:   # the models and compressor settings are the --init run's
        try:   # a setting added after that run was saved has its default there, as compressors.load builds it
            init = asdict(C.saved_config(args.init))
        except (ValueError, OSError) as e:
            fail(e)
        args.model = init["compressor_model"] or init["model"]
        args.decoder = init["model"] if init["compressor_model"] else None
    preset = C.PRESETS[args.method]
    demo = tiny_demo(args.method, args.model, args.decoder)
    if args.objective is None:
        args.objective = "qa" if args.stage == "keft" else demo.get("objective", preset.recipe.objective)
    # the recipe's values for this objective (fine-tuning), and the compressor settings the objective changes too
    # (the original 500x code: objective_changes says which; --help and the first log line name them)
    paper = {**preset.recipe.values(args.objective), **preset.settings_for(args.objective)}
    paper.update(demo)   # --model tiny: the demo's settings in place of the paper's
    # compressor settings the recipe row changes, unless a flag sets them: defaults, not typed flags, so that
    # make_config's mappings see what was typed (--mem 2 on tiny's CompLLM: a fixed budget, not the demo's ratio 1)
    typed = {k: getattr(args, k) for k in COMPRESSOR_FLAGS if getattr(args, k) is not None}
    row = {} if init else {k: paper[k] for k in COMPRESSOR_FLAGS if k in paper and k not in typed}
    try:   # validates the compressor flags before any model is loaded
        cfg = init or asdict(C.make_config(args.method, defaults=row, **typed))
    except ValueError as e:
        fail(e)
    for k in row:   # the values the row's settings resolved to (build_compressor passes them as flags)
        setattr(args, k, list(cfg[k]) if isinstance(cfg[k], tuple) else cfg[k])
    if init:
        if args.method != cfg["method"]:
            fail(f"--init {args.init} is a {cfg['method']} compressor, not {args.method}")
        for k in COMPRESSOR_FLAGS:
            v = getattr(args, k)
            if v is not None and v != (list(cfg[k]) if isinstance(cfg[k], (list, tuple)) else cfg[k]):
                fail(f"--init {args.init} was trained with {k}={cfg[k]}: drop --{k.replace('_', '-')}")
    for k in RECIPE_FLAGS:
        if getattr(args, k) is None:
            v = paper[k]
            setattr(args, k, list(v) if isinstance(v, tuple) else v)   # a list, as argparse gives --betas
    if args.warmup is None:   # a short run still reaches its peak lr (ours: warmup is at most 10% of the run)
        args.warmup = min(paper["warmup"], args.steps // 10)
    # lengths: the paper's, shrunk with the chunk so a context still spans the same number of chunks
    # (EPL: p = |X|/2 is 1 to 2 chunks of 510); the tiny demo's as they are
    scale = 1.0 if demo else min(1.0, cfg["chunk_len"] / C.PRESETS[args.method].settings.get(
        "chunk_len", C.CompressorConfig.chunk_len))
    lo, hi = paper["lengths"]
    args.max_len = args.max_len or max(args.min_len or 2, round(hi * scale))
    if args.crop == "head":   # AOC: every text is the first n = --max-len tokens of its document
        if args.min_len not in (None, args.max_len):   # (never silently ignored)
            fail(f"--crop head trains on the first --max-len ({args.max_len}) tokens of each document, so --min-len "
                 f"{args.min_len} does not apply: drop it, or use --crop window for texts of {args.min_len} to "
                 f"{args.max_len} tokens")
        args.min_len = args.max_len
    else:
        args.min_len = args.min_len or min(args.max_len, max(2, round(lo * scale)))
    if not 2 <= args.min_len <= args.max_len:
        fail(f"need 2 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    if args.len_curriculum:
        start, k = args.len_curriculum
        if args.crop == "head" or args.objective not in ("ae", "pretrain"):
            fail("--len-curriculum grows the windows of --crop window texts (ae or pretrain): drop it, or use "
                 "--crop window")
        if not (1 <= start <= args.min_len and k >= 1):
            fail(f"--len-curriculum N K needs 1 <= N <= --min-len ({args.min_len}) and K >= 1, got {start} {k}")
    if args.warm_start and (args.init or not os.path.isfile(os.path.join(args.warm_start, "compressor.safetensors"))):
        fail(f"--warm-start {args.warm_start}: " + ("--init already starts from a run: use one of them" if args.init
             else "no compressor.safetensors there (pass a train.py --out folder)"))
    args.out = args.out or os.path.join("runs", args.method)
    return args


# ---- model and compressor ----


def under_torchrun() -> bool:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: one process per GPU (DDP)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup_device(args):
    """Returns (device, rank, world): this process's share of a torchrun job, or the one device."""
    if under_torchrun():
        local = int(os.environ["LOCAL_RANK"])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        device = torch.device(f"cuda:{local}") if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device, dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.fsdp:   # FSDP needs a process group, even of one process (the test at world size 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return device, 0, 1


def build_compressor(args, device, ckpt_dir=None, frozen=torch.float32):
    """The compressor of --method (with the flags' overrides), of --init, or of the checkpoint to resume.
    Trained weights are fp32 (AdamW's master weights), frozen base weights `frozen` (--frozen-dtype,
    Compressor.set_dtypes); CUDA runs, and bf16 ones anywhere, compute in bf16 through autocast."""
    if ckpt_dir or args.init:   # its config + its trained tensors
        comp = C.load(ckpt_dir or args.init, dtype=frozen, device=device, for_training=True)
    else:
        # --model compresses and decodes; with --decoder, --model is only the compressor (pcc/pic)
        if args.decoder and (args.encoder or C.PRESETS[args.method].settings.get("encoder")) != "separate":
            fail(f"--decoder needs a separate compressor model (pcc, pic or --encoder separate), "
                 f"not {args.method}'s encoder")
        decoder, tok = load_pretrained(args.decoder or args.model, dtype=frozen, device=device)
        encoder, enc_tok = load_pretrained(args.model, dtype=frozen, device=device) if args.decoder else (None, None)
        # (not C.build: its `encoder` model argument would clash with the --encoder setting)
        cfg = C.make_config(args.method, model=args.decoder or args.model,
                            compressor_model=args.model if args.decoder else None,
                            **{k: getattr(args, k) for k in COMPRESSOR_FLAGS})
        comp = C.Compressor(cfg, decoder, tok, encoder, enc_tok).set_dtypes(frozen)   # before any load_trained
        if args.warm_start:   # ours: another run's trained tensors, this run's settings (load_trained checks them)
            try:
                comp.load_trained(load_file(os.path.join(args.warm_start, "compressor.safetensors"), device=str(device)))
            except ValueError as e:
                raise ValueError(f"--warm-start {args.warm_start}: {e} (it must be the same preset with the same "
                                 f"--mem, LoRA and model)") from None
    if args.stage == "keft" and comp.cfg.decoder_train != "keft":
        if comp.shares_decoder:   # the LoRA encoder IS the decoder: training its q/k/v would move the encoder too
            fail(f"--stage keft trains the decoder's q/k/v, which {comp.cfg.method}'s LoRA encoder shares")
        if not args.init:
            fail("--stage keft starts from a stage-1 (ae) run: pass --init DIR")
        comp.set_stage("keft")    # GMSA §3.5: freeze encoder + LSA, train decoder W_q, W_k, W_v
    return comp.set_dtypes(frozen)   # (after set_stage: what it unfroze trains in fp32)


def compile_blocks(comp):
    """torch.compile every transformer block (the heavy part); the glue around them stays eager.
    dynamic=True: lengths change every step, and a recompile per shape would cost more than it saves."""
    models = {id(m): m for m in (comp.encoder, comp.decoder)}.values()   # a LoRA encoder is the decoder
    for m in models:
        for block in m.model.layers:
            block.compile(dynamic=True)


class TrainStep(nn.Module):
    """The objective as a module's forward(), so DistributedDataParallel can sync what it computes."""

    def __init__(self, comp, objective, lm_weight):
        super().__init__()
        self.comp, self.objective, self.lm_weight = comp, objective, lm_weight

    def forward(self, batch):
        if self.objective == "pretrain":
            return loss_pretrain(self.comp, batch, self.lm_weight)
        return {"ae": loss_ae, "qa": loss_qa, "distill": loss_distill}[self.objective](self.comp, batch)


# ---- data ----


def read_corpus(path):
    """Documents from --data -> (texts, qa triples, identity string for the cache key).
    texts: list of str; qa: list of (context, question, answer) str triples."""
    if path is None:
        texts, qa = generated_texts(BUILTIN_GENERATED, seed=0) + list(BUILTIN_TEXTS), list(BUILTIN_QA)
        return texts, qa, "builtin:" + hashlib.sha256(json.dumps([texts, qa]).encode()).hexdigest()
    if path.startswith("hf://datasets/"):
        path = hub_file(path)
    if not os.path.exists(path):
        fail(f"data path '{path}' does not exist")
    files = [path] if os.path.isfile(path) else sorted(
        f for ext in ("txt", "jsonl", "parquet") for f in glob(os.path.join(path, "**", f"*.{ext}"), recursive=True))
    texts, qa = [], []
    for f in files:
        if f.endswith((".jsonl", ".parquet")):
            try:
                for where, rec in records(f):
                    kind = record_kind(rec)
                    if kind is None:
                        fail(f'{f} {where}: expected {{"text"}} or {{"context", "question", "answer"}}')
                    if kind == "text":
                        texts.append(rec["text"])
                    else:
                        r = qa_record(rec, f"{f} {where}")
                        qa.append((r["context"], r["question"], first_answer(r["answer"])))
            except ValueError as e:   # a line that is no JSON, a malformed QA record: one line naming it
                fail(e)
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())   # a whole file is one document: windows never straddle two files
    texts = [t for t in texts if t.strip()]
    if not texts and not qa:
        fail(f"no text in '{path}' (empty files, or a folder without .txt / .jsonl / .parquet files)")
    identity = json.dumps([(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files])
    return texts, qa, identity


def records(path):
    """(where, record) for every row of a .jsonl or .parquet file; a bad line is a ValueError naming it."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        for i, rec in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"row {i}", rec
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"line {i}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not JSON ({e.msg})") from None


def record_kind(rec):
    """"text", "qa" or None (not a record train.py reads)."""
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return "text"
    if isinstance(rec, dict) and {"context", "question", "answer"} <= rec.keys():
        return "qa"
    if isinstance(rec, dict) and {"context", "question", "answers"} <= rec.keys():   # SQuAD on the hub
        rec["answer"] = rec["answers"]
        return "qa"
    return None


def qa_record(rec, where):
    """A {"context", "question", "answer"} record (record_kind "qa"), checked and normalised for QA training and
    evaluation alike: context a non-empty str, question a str; answer a str or a number (its text), a list of those
    (accepted answers), SQuAD's {"text": [...]} or a list of {"text": ...} dicts -> a str, or a list of str where the
    record gave a list. Anything else is a ValueError naming `where` (file and line)."""
    context, question, raw = rec.get("context"), rec.get("question"), rec.get("answer")
    if not isinstance(context, str) or not context.strip():
        raise ValueError(f'{where}: "context" must be a non-empty string, got {str(context)[:40]!r}')
    if not isinstance(question, str):
        raise ValueError(f'{where}: "question" must be a string, got {str(question)[:40]!r}')
    items = raw.get("text") if isinstance(raw, dict) else raw   # SQuAD {"text": [...], "answer_start": [...]}
    items = list(items) if isinstance(items, (list, tuple)) else [items]
    answers = []
    for a in items:
        a = a.get("text") if isinstance(a, dict) else a      # [{"text": ..., "answer_start": ...}]
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = str(a)                                       # {"answer": 1932}: the number as written
        if not isinstance(a, str):
            raise ValueError(f'{where}: "answer" must be a string, a number or a list of them, got {str(raw)[:40]!r}')
        answers.append(a)
    if not answers:
        raise ValueError(f'{where}: "answer" is an empty list')
    return {**rec, "answer": answers if isinstance(raw, (list, tuple, dict)) else answers[0]}


def first_answer(answer):
    """A str, a list of str, or SQuAD's {"text": [...], "answer_start": [...]}: the first answer, as QA training
    uses answers[0] (EPL code)."""
    if isinstance(answer, dict):
        answer = answer.get("text", [""])
    return str(answer[0] if isinstance(answer, (list, tuple)) and answer else answer)


def hub_file(url):
    """hf://datasets/OWNER/NAME/PATH -> a local copy (downloaded once into the Hugging Face cache)."""
    parts = url[len("hf://datasets/"):].split("/", 2)
    if len(parts) < 3:
        fail(f"'{url}' is not hf://datasets/OWNER/NAME/PATH")
    from huggingface_hub import hf_hub_download
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return hf_hub_download("/".join(parts[:2]), parts[2], repo_type="dataset", local_files_only=offline)
    except Exception as e:   # offline, no network, no such repo or file: all one line
        fail(f"cannot fetch {url}: {type(e).__name__} (offline or not on the hub; pass a local path instead)")


def tokenize_corpus(texts, qa, identity, comp, cache_dir):
    """Tokenise every document once and cache the ids, keyed by the data, the tokenizers and the QA template.
    Texts become one flat tensor of decoder ids plus offsets (document d is tokens[offsets[d]:offsets[d + 1]]);
    QA triples become the template's pieces (Compressor.qa_parts): prefix, the context for the decoder and for
    the compressor, the prompt after it, and the answer."""
    tok, enc_tok = comp.tok, comp.enc_tok
    vocab = tok.tk.to_str() + ("" if enc_tok is tok else enc_tok.tk.to_str())
    key = hashlib.sha256((identity + vocab + json.dumps(comp.template())).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokens-{key}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True), key
    as_ids = lambda s, t=tok: torch.tensor(t.encode(s), dtype=torch.int32)
    docs = [d for d in map(as_ids, tqdm(texts, desc="tokenizing", disable=len(texts) < 1000)) if len(d) >= 2]
    offsets = torch.tensor([0] + [len(d) for d in docs], dtype=torch.int64).cumsum(0)   # (n_docs + 1,)
    pieces = [{**{k: torch.tensor(v, dtype=torch.int32) for k, v in comp.qa_parts(c, q).items()},
               "answer": as_ids(a)} for c, q, a in qa]
    data = {"tokens": torch.cat(docs) if docs else torch.zeros(0, dtype=torch.int32), "offsets": offsets,
            "qa": pieces}
    os.makedirs(cache_dir, exist_ok=True)
    # atomic: a killed run never leaves half a cache behind (one temp file per process: DDP ranks all write)
    torch.save(data, f"{path}.{os.getpid()}.tmp")
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    return data, key


def sample_example(data, objective, rng, args, comp, step):
    """One training example of step `step`, drawn with `rng`. Context ids are the compressor's, everything else
    the decoder's."""
    ex = draw_qa(data, objective, rng, args, comp) if objective in ("qa", "distill") else \
        draw_text(data, objective, rng, args, comp, step)
    # GMSA §4.1: the compression ratio is sampled per example; drawn with the example, so that it too depends on
    # nothing but the step and the example's index
    ex["ratio"] = [comp.cfg.ratios[rng.integers(len(comp.cfg.ratios))]] if comp.cfg.source == "group_mean" else []
    return ex


def draw_qa(data, objective, rng, args, comp):
    ex = {k: v.tolist() for k, v in data["qa"][rng.integers(len(data["qa"]))].items()}
    # contexts cut at --max-len (ours): the context's own tokens, the template's text around it kept
    ctx, enc_ctx = (comp.cut_context(ex[k], args.max_len, t) for k, t in (("dec_context", comp.tok),
                                                                           ("enc_context", comp.enc_tok)))
    if objective == "distill":   # the answer is the teacher's own (teacher_answer), not the data set's
        return dict(context=enc_ctx, dec_context=ctx, prefix=ex["prefix"], question=ex["prompt"])
    # [prefix; memory; [LM]; prompt] -> answer: the loss covers answer + EOS only (EPL code)
    return dict(context=enc_ctx, prefix=ex["prefix"], qa=ex["prompt"] + ex["answer"] + [comp.tok.eos_id],
                n_answer=len(ex["answer"]) + 1)


def text_lengths(args, step):
    """The range [lo, hi + 1) a text's length is drawn from at `step`: --min-len..--max-len, or, under
    --len-curriculum N K (ours), a range that starts at N tokens and grows linearly to it over the first K steps."""
    if not args.len_curriculum:
        return args.min_len, args.max_len + 1
    start, k = args.len_curriculum
    f = min(1.0, step / k)
    return round(start + (args.min_len - start) * f), round(start + (args.max_len - start) * f) + 1


def draw_text(data, objective, rng, args, comp, step):
    eos, offsets = comp.tok.eos_id, data["offsets"]
    if args.crop == "head":
        # AOC code: each text is the first n tokens of a document (tokenizer truncation), a shorter one right-padded
        # with EOS to n; the padding is compressed and reconstructed like any token (no mask, no -100)
        d = int(rng.integers(len(offsets) - 1))
        n = args.max_len
        x = data["tokens"][offsets[d]:min(offsets[d] + n, offsets[d + 1])].tolist()
        x = x + [comp.tok.pad_id if comp.tok.pad_id is not None else eos] * (n - len(x))
    else:
        # the document of a random token (so each with probability proportional to its length), then a window
        # of |X| tokens at a random offset inside it: a text never straddles two documents
        d = int(torch.searchsorted(offsets, int(rng.integers(offsets[-1])), right=True)) - 1
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        n = min(int(rng.integers(*text_lengths(args, step))), hi - lo)   # a short document gives a short text
        start = lo + int(rng.integers(0, hi - lo - n + 1))
        x = data["tokens"][start:start + n].tolist()
    if objective == "ae":   # ICAE AE / AOC Eq. (4): regenerate all of X, then EOS
        return dict(context=comp.encoder_ids(x), ae=comp.ae_target(x))
    # pretrain (EPL code): compress the first p = ⌊|X|/2⌋ tokens, reconstruct them, continue with the rest + EOS
    p = max(1, n // 2)
    return dict(context=comp.encoder_ids(x[:p]), ae=comp.ae_target(x[:p]), lm=x[p:] + [eos], last=x[p - 1])


def step_examples(data, objective, args, comp, step):
    """Every example of step `step`: example i comes from a generator seeded with (seed, step, i), so a step
    depends on nothing but its number (exact resume) and is made of the same examples whatever the
    micro-batching or the number of processes (each process draws them all and takes its share)."""
    return [sample_example(data, objective, np.random.default_rng([args.seed, step, i]), args, comp, step)
            for i in range(args.batch_size)]


def collate(examples):
    """A micro-batch: one list per field; "ratios" (GMSA: one compression ratio per example) is None unless sampled."""
    batch = {k: [e[k] for e in examples] for k in examples[0]}
    if "ratio" in batch:
        ratios = sum(batch.pop("ratio"), [])
        batch["ratios"] = ratios or None
    # tokens the step reads: compressed context + every decoder sequence (tok/s in the log)
    batch["tokens"] = sum(len(f) for k in ("context", "ae", "lm", "qa") if k in batch for f in batch[k])
    return batch


def step_normalizers(comp, objective, examples):
    """What each task's loss is divided by: its supervised tokens over the whole step (every micro-batch of every
    process), so that the step's loss is the mean over its tokens however it is split (the gradient-accumulation
    normalisation, as Hugging Face's Trainer fixed it in 2024); distillation is a mean over examples (CompLLM
    Eq. 3), so its normaliser is the step's number of examples."""
    b = collate(examples)
    if objective == "distill":
        return {"distill": len(examples)}
    if objective == "qa":
        return {"qa": comp.supervised_tokens("qa", b["qa"], b["n_answer"], b["prefix"])}
    norm = {"ae": comp.supervised_tokens("ae", b["ae"])}
    if objective == "pretrain":
        norm["lm"] = comp.supervised_tokens("lm", b["lm"])
    return norm


def teacher_answer(comp, cache, prompt, max_new, autocast):
    """CompLLM §3: the answer the frozen LLM itself gives with the full context (greedy), memoised in `cache`
    (saved to disk with each checkpoint). prompt: the template's [prefix, context, question] ids, as the student
    reads them with the context compressed. Includes the EOS when the LLM stops, so A is never empty."""
    example_key = hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:20]
    if example_key not in cache:
        ids = torch.tensor([prompt], device=comp.device)
        with torch.no_grad(), comp.decoding(), autocast:
            out = comp.decoder.generate(ids, max_new_tokens=max_new, eos_id=comp.tok.eos_ids or None)[0].tolist()
        eos = [i for i, t in enumerate(out) if t in comp.tok.eos_ids]
        cache[example_key] = out[:eos[0] + 1] if eos else out
    return cache[example_key]


# ---- optimizer and schedule ----


def make_optimizer(comp, args, device):
    """AdamW over the trainable tensors. Weight decay on matrices only (nanoGPT): decaying norms, biases or
    the [AE]/[LM] embeddings towards 0 would only fight the model. CompLLM's Adam is weight_decay = 0."""
    params = comp.trainable_parameters()
    # --mem-lr (ours): the memory tokens in a group of their own, at mem_lr / lr times every step's lr
    own = [comp.mem_tokens] if args.mem_lr is not None and comp.mem_tokens is not None else []
    if args.mem_lr is not None and not own:
        fail(f"--mem-lr sets the learning rate of learned memory tokens, and {comp.cfg.method} has none "
             f"(source={comp.cfg.source})")
    rest = [p for p in params if all(p is not q for q in own)]
    groups = [dict(params=[p for p in rest if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)]
    if own:
        groups.append(dict(params=own, weight_decay=args.weight_decay, lr_scale=args.mem_lr / args.lr))
    # fused: one kernel for all tensors. On the CPU the per-tensor loop was a quarter of PCC's step on SmolLM2
    # (sqrt, div, lerp, addcdiv per tensor, tests/bench_train.py --profile); fused gives the same losses to 1e-6
    # (tests/README.md, "Where a CPU training step goes")
    return torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), fused=device.type in ("cuda", "cpu"))


def lr_at(step, args):
    """Learning rate of step `step` (0-based): linear warmup to --lr, then constant (EPL) or a linear (GMSA)
    or cosine decay to 0 at --steps. A function of the step alone, so the step is the scheduler's whole state."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    done = (step - args.warmup) / max(1, args.steps - args.warmup)   # 0 -> 1 over the decay
    return args.lr * ((1 - done) if args.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done)))


# ---- loop ----


# Each loss is this micro-batch's share of the step's loss: its summed NLL over the step's normaliser b["norm"]
# (step_normalizers), so that the shares of every micro-batch and process add up to the step's mean.


def loss_pretrain(comp, b, lm_weight):
    """EPL §3.1.1 / PIC Eq. (6)-(8): ONE compression of x_1..x_p serves both tasks."""
    memory = comp.compress(b["context"], ratios=b.get("ratios"))
    norm = b["norm"]
    l_ae, _ = comp.lm_loss(memory, "ae", b["ae"], normalize_by=norm["ae"])   # AE / TR, PIC Eq. (6): x_1..x_p, EOS
    l_lm, _ = comp.lm_loss(memory, "lm", b["lm"], last_tokens=b["last"],    # LM / TC, PIC Eq. (7): x_p+1..
                           normalize_by=norm["lm"])
    return lm_weight * l_lm + (1 - lm_weight) * l_ae, {"ae": l_ae, "lm": l_lm}   # PIC Eq. (8), λ = α = 0.5


def loss_ae(comp, b):
    """ICAE autoencoding / AOC Eq. (4) / GMSA §3.4 stage 1: regenerate the compressed text from the memory
    (500x/AOC after [BOS], ICAE/GMSA after [AE]: the compressor's ae_token)."""
    l_ae, _ = comp.lm_loss(comp.compress(b["context"], ratios=b.get("ratios")), "ae", b["ae"], normalize_by=b["norm"]["ae"])
    return l_ae, {"ae": l_ae}


def loss_qa(comp, b):
    """QA fine-tuning (EPL §4, GMSA KEFT Eq. 8): [memory; [LM]; question] -> answer, loss on answer + EOS only."""
    l_qa, _ = comp.lm_loss(comp.compress(b["context"], ratios=b.get("ratios")), "qa", b["qa"], n_supervised=b["n_answer"], prefix=b["prefix"],
                           normalize_by=b["norm"]["qa"])
    return l_qa, {"qa": l_qa}


def loss_distill(comp, b):
    """CompLLM Eq. (1)-(3): Σ_ℓ SmoothL1(H̃_ℓ, H_ℓ) / σ_ℓ over the answer tokens, teacher = the LLM with
    the full context, student = the LLM with the concept embeddings."""
    l, _ = comp.distill_loss(b["context"], b["question"], b["answer"], b["prefix"], b["dec_context"],
                             normalize_by=b["norm"]["distill"])
    return l, {"distill": l}


@dataclass
class Run:
    """Where and how a run trains: its processes (one per GPU under torchrun) and how a step's batch is split."""
    device: torch.device
    rank: int           # this process (0 logs and writes)
    world: int          # processes
    micro: int          # examples per forward pass and process
    accum: int          # micro-batches per step and process
    start: int          # steps done (the data position is this number)
    autocast: object    # bf16 autocast on CUDA or with bf16 frozen weights, else nothing
    frozen: torch.dtype = torch.float32   # the frozen base weights' dtype (--frozen-dtype)

    @property
    def master(self) -> bool:
        return self.rank == 0


def set_up(args, resume_state) -> Run:
    """Processes, the batch split, the seeds; refuses a run that would overwrite another."""
    device, rank, world = setup_device(args)
    micro = args.micro_batch or args.batch_size // world
    if micro < 1 or args.batch_size % (micro * world):
        fail(f"--batch-size {args.batch_size} must be a multiple of --micro-batch {micro} x {world} GPU(s)")
    start = resume_state["step"] if resume_state else 0
    if not args.resume and latest_checkpoint(args.out, required=False):
        fail(f"{args.out} already holds a checkpoint: continue it with --resume {args.out}, or pick another --out")
    # torch's RNG draws the init of memory tokens / LoRA / bridges (one stream per process: DDP then copies rank
    # 0's weights to every process) and LoRA dropout; the data, GMSA's rates included, has generators of its own
    # (step_examples), so torch's is the only global generator a run draws from
    torch.manual_seed(args.seed + rank)
    # --frozen-dtype auto: bf16 on CUDA (the EPL and AOC code's dtype), fp32 elsewhere. bf16 weights need autocast
    # on the CPU too (a matmul of fp32 activations with bf16 weights is an error outside it)
    frozen = torch.bfloat16 if args.frozen_dtype == "bf16" or (
        args.frozen_dtype == "auto" and device.type == "cuda") else torch.float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" or \
        frozen == torch.bfloat16 else nullcontext()
    return Run(device, rank, world, micro, args.batch_size // (micro * world), start, autocast, frozen)


def build_step(args, run: Run, ckpt_dir):
    """The compressor (from the checkpoint when resuming) and the objective as a module (DDP-wrapped on > 1 GPU)."""
    try:   # a bad model name, a corrupt checkpoint: one line, not a traceback
        comp = build_compressor(args, run.device, ckpt_dir, run.frozen)
    except (ValueError, OSError) as e:
        fail(e)
    for model in (comp.encoder, comp.decoder):   # activation checkpointing per block (model.py)
        model.grad_ckpt = args.grad_ckpt
    if args.compile:
        compile_blocks(comp)
    step_fn = TrainStep(comp, args.objective, args.lm_weight)
    if args.fsdp:
        if args.objective == "distill":   # the teacher generates outside the step, where the root's weights are shards
            fail("--fsdp does not run distill (its frozen teacher generates outside the training step): use DDP")
        import sharding
        step_fn = sharding.shard(comp, step_fn)
    elif run.world > 1:   # unused parameters: e.g. the [LM] embedding when the objective is ae
        step_fn = nn.parallel.DistributedDataParallel(step_fn, find_unused_parameters=True, device_ids=[
            run.device.index] if run.device.type == "cuda" else None)
    return comp, step_fn


@dataclass
class Data:
    tokens: dict        # tokenize_corpus's tensors
    key: str            # its cache key (saved with each checkpoint)
    documents: int      # texts read
    questions: int      # QA examples read
    answers: dict       # distill: the frozen LLM's answers, memoised (saved with each checkpoint)
    answers_path: str


def load_data(args, comp) -> Data:
    """The corpus, checked against the objective, tokenised once and cached."""
    try:
        texts, qa, identity = read_corpus(args.data)
    except OSError as e:     # unreadable files: one line
        fail(e)
    if args.objective in ("qa", "distill") and not qa:
        fail(f"--objective {args.objective} needs JSON lines with \"context\", \"question\", \"answer\"")
    if args.objective in ("pretrain", "ae"):
        texts += [c for c, _, _ in qa]   # QA contexts are text too (ours)
        if args.crop == "head" and len(texts) < args.batch_size:
            # a head crop is the first n tokens of a document: with fewer documents than a batch, every step would
            # train on the same few texts (a .txt file is one document)
            fail(f"--crop head trains on the first {args.max_len} tokens of each document, and "
                 f"{args.data or 'the built-in corpus'} holds {len(texts)} document(s) for a batch of "
                 f"{args.batch_size}: give a .jsonl with one document per line, a folder of files, or use --crop window")
    if args.objective == "distill" and comp.enc_tok is not comp.tok:
        fail("distill runs the teacher and the student on the same ids: it needs one tokenizer for both models")
    cache_dir = args.cache_dir or os.path.join(args.out, "cache")
    data, key = tokenize_corpus(texts, qa, identity, comp, cache_dir)
    if args.objective in ("pretrain", "ae") and len(data["tokens"]) == 0:   # (documents of < 2 tokens are dropped)
        fail(f"no text of 2 tokens or more in {args.data}")
    answers_path = os.path.join(cache_dir, f"answers-{key}-{args.answer_tokens}.pt")
    answers = torch.load(answers_path, weights_only=True) if os.path.exists(answers_path) else {}
    return Data(data, key, len(texts), len(qa), answers, answers_path)


def restore(opt, resume_state, rank, fsdp=False):
    """A resumed run's optimizer moments and step counts, and every RNG where it stood."""
    try:
        if fsdp:   # the one-process moments, cut into this rank's shards
            import sharding
            resume_state["optimizer"] = sharding.shard_optimizer_state(opt, resume_state["optimizer"])
        opt.load_state_dict(resume_state["optimizer"])
    except (ValueError, KeyError) as e:
        fail(f"mismatched checkpoint: its optimizer state does not fit this compressor ({e})")
    set_rng_state(resume_state["rng"][rank if rank < len(resume_state["rng"]) else 0])


def accumulate(args, run: Run, comp, step_fn, data: Data, step: int):
    """Forward and backward over this process's micro-batches of the step: (loss, per-task parts, tokens read)."""
    total, parts, tokens = 0.0, {}, 0
    examples = step_examples(data.tokens, args.objective, args, comp, step)
    norm = step_normalizers(comp, args.objective, examples)
    for m in range(run.accum):
        first = (m * run.world + run.rank) * run.micro   # this rank's slice of the step's examples
        batch = collate(examples[first:first + run.micro])
        batch["norm"] = norm
        if args.objective == "distill":   # the frozen LLM answers first (once per example, cached)
            batch["answer"] = [teacher_answer(comp, data.answers, p + c + q, args.answer_tokens, run.autocast)
                               for p, c, q in zip(batch["prefix"], batch["dec_context"], batch["question"])]
            batch["tokens"] += sum(len(c) + len(q) + 2 * len(a) for c, q, a in   # teacher + student
                                   zip(batch["dec_context"], batch["question"], batch["answer"]))
        # DDP all-reduces gradients after every backward; only the last micro-batch needs it
        ddp = isinstance(step_fn, nn.parallel.DistributedDataParallel)   # (FSDP syncs every micro-batch)
        sync = step_fn.no_sync() if ddp and m < run.accum - 1 else nullcontext()
        try:
            with sync, run.autocast:
                loss, part = step_fn(batch)
            # each loss is this micro-batch's share of the step's mean (step_normalizers): the gradients of the
            # shares add up to the step's, as if it had been one forward pass. DDP averages the processes'
            # gradients, so each process's share counts `world` times
            (loss * run.world).backward()
        except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            # nothing is saved: the last checkpoint in --out stays the last good state
            fail(f"out of memory at step {step + 1} on {run.device} with a micro-batch of {run.micro} "
                 f"({batch_shape(batch)}): use --micro-batch {max(1, run.micro // 2)}"
                 f"{'' if args.grad_ckpt else ' or --grad-ckpt'}; the last good checkpoint in {args.out} is kept")
        total += loss.item()
        for k, v in part.items():
            parts[k] = parts.get(k, 0.0) + v.item()
        tokens += batch["tokens"]
    return total, parts, tokens


def train_step(args, run: Run, comp, step_fn, opt, params, data: Data, step: int, stop: dict) -> dict:
    """One optimizer step: the step's log row, with "stop" when any process was asked to stop (by now)."""
    t0 = time.time()
    lr = lr_at(step, args)       # set by hand each step: the schedule is a plain function of the step
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)   # --mem-lr's group runs at its own peak
    total, parts, tokens = accumulate(args, run, comp, step_fn, data, step)
    # clip_grad_norm_ returns the norm before clipping; clip 0 = measure only
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip if args.clip > 0 else float("inf"))
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()   # FSDP: a DTensor
    stats = torch.tensor([total, grad_norm, tokens, stop["signal"] is not None, *parts.values()], dtype=torch.float64,
                         device=run.device)
    if run.world > 1:   # the processes' shares add up to the step's loss; every rank then decides alike below
        dist.all_reduce(stats)
        stats[1] /= run.world   # the gradient norm is the same on every rank (DDP synced the gradients)
    total, tokens, stopping = stats[0].item(), int(stats[2].item()), bool(stats[3].item())
    parts = dict(zip(parts, stats[4:].tolist()))
    if not (math.isfinite(total) and math.isfinite(grad_norm)):
        # no optimizer step and no save: the last checkpoint in --out stays the last good state
        fail(f"loss {total} / grad-norm {grad_norm} at step {step + 1}: stopping; "
             f"the last good checkpoint in {args.out} is kept")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.synchronize()     # dt measures the step, not just its kernel launches
    dt = time.time() - t0
    return dict(step=step + 1, loss=total, lr=lr, grad_norm=grad_norm, dt=dt, tokens_per_s=tokens / dt,
                tokens=tokens, **parts, stop=stopping)


def write_log(log, bar, row, steps, own_other=None):
    """The step's row in log.jsonl and on the console."""
    parts = {k: v for k, v in row.items() if k not in ("step", "loss", "lr", "grad_norm", "dt", "tokens_per_s",
                                                       "tokens", "stop")}
    log.write(json.dumps({k: v for k, v in row.items() if k != "stop"}) + "\n")
    log.flush()
    detail = ", ".join(f"{k} {v:.4f}" for k, v in parts.items())
    tqdm.write(f"step {row['step']:>{len(str(steps))}}/{steps} | loss {row['loss']:.4f} ({detail}) | "
               f"lr {row['lr']:.2e} | grad-norm {row['grad_norm']:.3f} | dt {row['dt'] * 1000:.0f}ms | "
               f"tok/s {row['tokens_per_s']:,.0f}")
    held = {} if own_other is None else {"own_other": f"{own_other:.3f}"}   # the latest held-out check
    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}", **held)
    bar.update(1)


def save(args, run: Run, comp, opt, data: Data, done: int):
    """A checkpoint of step `done` (every rank hands rank 0 its RNG state; rank 0 writes)."""
    rng = gather_rng_states(run.world)
    whole = None
    if args.fsdp:   # every rank gathers the shards; rank 0 writes the one-process format
        import sharding
        whole = sharding.full_state(comp, opt)
    if run.master:
        save_checkpoint(args.out, done, comp, opt, args, rng, data.key, args.keep_every, whole)
        if data.answers:
            torch.save(data.answers, data.answers_path + ".tmp")
            os.replace(data.answers_path + ".tmp", data.answers_path)


# ---- held-out check (ours) ----
# A falling training loss proves little: a learned constant prompt gets that too (recipes/README.md, "The ladder"). So
# the run scores held-out examples at step 0, every --eval-every steps and at the end: teacher-forced, the loss of its
# objective with each example's own memory, another example's memory (evaluate.derangement: example i reads the memory
# of example i + 1) and none. own/other near 1 means the memory is a constant prompt; at most 0.5 that it carries its
# own text. The numbers are evaluate.py's (evaluate.run_ae / run_lm / run_qa without generating, texts
# cut as this run cuts its training texts: `evaluate.py --task ae --max-len <the run's --max-len>` on the same
# checkpoint gives the same own/other).

PROMPT_LIKE, PROMPT_EVALS = 0.95, 3   # warn when this many evaluations in a row past the warmup are all >= 0.95


@dataclass
class HeldOut:
    examples: list      # the held-out examples (evaluate.load_examples), the same every time
    task: str           # "ae" (ae, pretrain) or "qa" (qa, distill: the loss of the reference answer)
    every: int          # steps between evaluations
    rows: list          # this run's evaluations so far ({"step", "eval"}), kept across --resume
    warned: bool = False

    @property
    def last(self):
        """The latest held-out own/other (the progress bar shows it), or None."""
        return self.rows[-1]["eval"]["own_other"] if self.rows else None


def held_out(args, run: Run, comp) -> HeldOut | None:
    """The held-out examples of the check, or None (with one line saying why and how to turn it on)."""
    import evaluate as E   # here, not at the top: evaluate imports train (the built-in texts, the record reader)
    every = args.eval_every if args.eval_every is not None else args.save_every
    task = "qa" if args.objective in ("qa", "distill") else "ae"
    if args.fsdp and every > 0:   # rank 0 alone would score a model whose weights are spread over every rank
        if run.master:
            print("no held-out check runs under --fsdp: score a checkpoint with evaluate.py --ckpt")
        return None
    if every <= 0 or (args.eval_data is None and not on_tiny(args.model, args.decoder)):
        if run.master and every > 0:
            print(f"no held-out check runs: pass --eval-data FILE (held-out {'QA triples' if task == 'qa' else 'texts'}) "
                  f"to see every {every} steps whether the memory carries its own text")
        return None
    try:   # the texts at the run's trained length (evaluate.at_trained_length), as evaluate.py scores them
        examples = E.load_examples(args.eval_data, task, None if task == "ae" else args.eval_n)
        if task == "ae":
            examples = E.at_trained_length(comp, examples, E.protocol(comp, train_args=vars(args)), args.eval_n)
    except (OSError, ValueError) as e:
        fail(f"--eval-data: {e}")
    # a resumed run's log (trimmed to its checkpoint) holds its earlier evaluations
    rows = read_log(args.out)[1] if run.start > 0 and os.path.exists(os.path.join(args.out, "log.jsonl")) else []
    return HeldOut(examples, task, every, rows, warned=any(r.get("warned") for r in rows))


@torch.no_grad()
def held_out_losses(args, run: Run, comp, ho: HeldOut) -> dict:
    """own, other, none, own_other and n on the held-out examples; for pretrain the LM loss beside them."""
    import evaluate as E
    modes = {m: m.training for m in comp.modules()}   # restored exactly afterwards: the check must not touch training
    comp.eval()
    # no RNG is drawn in eval mode; forked anyway, so that nothing the check does can move the training's streams
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []), run.autocast:
        if ho.task == "qa":
            L = E.run_qa(comp, ho.examples, max_len=args.max_len, generate=False)["loss"]
        else:
            proto = E.protocol(comp, max_len=args.max_len, train_args=vars(args))
            ae = E.run_ae(comp, ho.examples, proto=proto, generate=False)
            L = {**ae["loss"], "tokens_per_slot": ae["tokens_per_slot"]}
        lm = E.run_lm(comp, ho.examples, max_len=args.max_len)["loss"] if args.objective == "pretrain" else None
    for m, training in modes.items():
        m.train(training)
    point = lambda L: dict(own=L["own"], other=L["other"], none=L["none"], own_other=L["own_other_ratio"])
    ratio = {"tokens_per_slot": L["tokens_per_slot"]} if "tokens_per_slot" in L else {}
    return {**point(L), "n": len(ho.examples), **ratio, **({"lm": point(lm)} if lm else {})}


def check_held_out(args, run: Run, comp, ho: HeldOut, log, bar, step: int):
    """Score the held-out examples at `step`, log the row, and warn once when the memory acts as a constant prompt."""
    import evaluate as E
    t0 = time.time()
    try:   # e.g. an empty held-out text, or no memory left for it: one line, not a traceback
        row = {"step": step, "eval": held_out_losses(args, run, comp, ho)}
    except ValueError as e:
        fail(f"the held-out check at step {step}: {e} (--eval-data {args.eval_data or 'the built-in set'})")
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        fail(f"out of memory in the held-out check at step {step} on {run.device}: use a smaller --eval-n, or "
             f"--eval-every 0 (no check); the last good checkpoint in {args.out} is kept")
    row["eval"]["seconds"] = time.time() - t0   # what the check cost (the training steps' dt leaves it out)
    row["eval"]["accelerator"] = E.accelerator(run.device)   # where it ran (a resumed run may move machines)
    ho.rows.append(row)
    ratio = row["eval"]["own_other"]
    recent = [r["eval"]["own_other"] for r in ho.rows if r["step"] > args.warmup][-PROMPT_EVALS:]
    warn = not ho.warned and len(recent) == PROMPT_EVALS and all(x is not None and x >= PROMPT_LIKE for x in recent)
    if warn:   # saved with the row: a resumed run (held_out reads its log) does not warn again
        ho.warned = row["warned"] = True
    log.write(json.dumps(row) + "\n")
    log.flush()
    if ratio is None:   # a single held-out example has no other
        return
    per_slot = row["eval"].get("tokens_per_slot")
    tqdm.write(f"step {step} | held-out own/other {ratio:.3f} (own {row['eval']['own']:.4f}, other "
               f"{row['eval']['other']:.4f}, no memory {row['eval']['none']:.4f})"
               + (f" at {per_slot['mean']:.2f} tokens per memory slot" if per_slot else ""))
    if warn:
        tqdm.write(f"warning: held-out own/other {ratio:.3f} at step {step} ({PROMPT_EVALS} evaluations in a row >= "
                   f"{PROMPT_LIKE}): the memory acts as a constant prompt, the same for every text; see "
                   f"recipes/README.md, 'The ladder' (what the decoder sees of each memory, recipes/diagnosis.py)")


def first_carrying_step(ho: HeldOut, threshold=0.5) -> str:
    """The closing line: the first step at which held-out own/other was <= threshold, or that it never was."""
    hit = next((r["step"] for r in ho.rows if r["eval"]["own_other"] is not None
                and r["eval"]["own_other"] <= threshold), None)
    last = ho.rows[-1]
    if hit is not None:
        return f"held-out own/other first <= {threshold} at step {hit} ({last['eval']['own_other']:.3f} at step {last['step']})"
    ratio = last["eval"]["own_other"]
    return (f"held-out own/other never <= {threshold} within {last['step']} steps "
            f"({'n/a' if ratio is None else f'{ratio:.3f}'} at step {last['step']}): the memory does not carry its text yet")


def catch_signals(stop: dict) -> dict:
    """Ctrl-C / SIGTERM: finish the step, save, stop (a second Ctrl-C stops at once). Returns the old handlers."""
    def on_signal(signum, frame):
        if stop["signal"] is not None:
            raise KeyboardInterrupt
        stop["signal"] = signal.Signals(signum).name
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def main(argv=None):
    args, resume_state = parse_args(argv)
    if args.plan:   # what the run would need, built on the meta device: nothing is allocated or written
        import plan
        return plan.show(args)
    run = set_up(args, resume_state)
    if run.start >= args.steps:
        print(f"{args.resume} is already at step {run.start} of {args.steps}: nothing to do (raise --steps)")
        return
    comp, step_fn = build_step(args, run, latest_checkpoint(args.resume) if args.resume else None)
    data = load_data(args, comp)
    if resume_state and resume_state.get("data", data.key) != data.key:   # (a checkpoint before the key: no check)
        fail(f"cannot resume: {args.resume} was trained on another corpus than {args.data or 'the built-in corpus'} "
             f"is now (data key {resume_state['data']}, now {data.key}): resume it on the data it was trained on, or "
             "start a new run with another --out")
    params = comp.trainable_parameters()   # what compressors.py leaves trainable for this method and stage
    opt = make_optimizer(comp, args, run.device)
    if resume_state:
        restore(opt, resume_state, run.rank, args.fsdp)

    if run.master:
        os.makedirs(args.out, exist_ok=True)
        trim_log(os.path.join(args.out, "log.jsonl"), run.start)   # a resumed run rewrites the steps after its checkpoint
        log = open(os.path.join(args.out, "log.jsonl"), "a")
        read = f"{data.documents:,} documents" + (f", {data.questions:,} QA examples" if data.questions else "")
        demo, paper = tiny_demo(args.method, args.model, args.decoder), C.PRESETS[args.method].recipe.objective
        note = (f" (--model tiny's demo; the paper's: {paper})" if demo and args.objective == demo["objective"] != paper
                else "")
        changes = objective_changes(args.method, args.objective, comp.cfg)
        if changes and not args.init:   # (with --init, the settings are that run's)
            note += f" (--objective {args.objective} on {args.method} also sets: {changes})"
        print(f"{comp.cfg.method}: {args.objective} objective{note} on {read}, "
              f"{sum(p.numel() for p in params):,} trained parameters, batch {args.batch_size} "
              f"({run.accum} x {run.micro} x {run.world}), |X| in [{args.min_len}, {args.max_len}], lr {args.lr:g}, "
              f"{args.schedule} after {args.warmup} warmup steps, steps {run.start}->{args.steps} on {run.device}")
    ho = held_out(args, run, comp)
    stop = {"signal": None}
    old_handlers = catch_signals(stop)
    end = min(args.steps, args.stop_after or args.steps)      # --stop-after K: this job ends after step K
    bar = tqdm(total=args.steps, initial=run.start, disable=not run.master, desc=comp.cfg.method, dynamic_ncols=True)
    try:
        if ho and run.master and run.start == 0:
            check_held_out(args, run, comp, ho, log, bar, 0)   # at init: what an untrained memory carries
        for step in range(run.start, end):
            row = train_step(args, run, comp, step_fn, opt, params, data, step, stop)
            if run.master:
                write_log(log, bar, row, args.steps, ho and ho.last)
            done = step + 1
            if ho and run.master and (done % ho.every == 0 or done == args.steps):
                check_held_out(args, run, comp, ho, log, bar, done)
            # save on schedule, at the end of this job, or when asked to stop: never after a bad step (train_step)
            if row["stop"] or done == end or done % args.save_every == 0 or (args.keep_every and done % args.keep_every == 0):
                save(args, run, comp, opt, data, done)
            if row["stop"]:
                end = done
                if run.master:
                    print(f"\nstopped by a signal after step {done}; continue with --resume {args.out}")
                break
    finally:
        bar.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if run.master:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if run.master and ho and ho.rows:
        print(first_carrying_step(ho))
    if run.master and end == args.steps:
        print(f"done: {args.steps} steps; the compressor is in {args.out} (compressors.load, evaluate.py --ckpt)")
    elif run.master and end == args.stop_after:
        print(f"stopped after step {end} (--stop-after); continue with --resume {args.out}")


# ---- checkpoint ----
#
#   OUT/ckpt-000200/{compressor.json, compressor.safetensors, train_state.pt}   one unit, renamed into place
#   OUT/compressor.json, OUT/compressor.safetensors     hard links to the newest unit: compressors.load(OUT)
#   OUT/args.json, OUT/log.jsonl, OUT/cache/


def is_out_of_memory(e) -> bool:
    """A CUDA OOM, or a CPU allocation failure (PyTorch raises RuntimeError "can't allocate memory")."""
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        m in str(e) for m in ("out of memory", "can't allocate memory"))


def batch_shape(batch) -> str:
    """'contexts 4 x <= 480 tokens, ae 4 x <= 481' : what a micro-batch asks of the GPU."""
    return ", ".join(f"{'contexts' if k == 'context' else k} {len(batch[k])} x <= {max(map(len, batch[k]))} tokens"
                     for k in ("context", "ae", "lm", "qa", "answer") if k in batch)


def save_checkpoint(out, step, comp, opt, args, rng, data_key, keep_every=None, whole=None):
    """Write everything a run needs to continue into a temporary directory, then rename it into place: a run
    killed at any moment leaves the previous checkpoint or the new one, never half of one. Then point the
    top-level compressor files at it and drop older checkpoints. (Atomic against a killed process; without
    fsync, not against a power cut.)"""
    tmp, final = os.path.join(out, f".tmp-ckpt-{step:06d}"), os.path.join(out, f"ckpt-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    # compressor.json + compressor.safetensors; whole: the trained tensors and AdamW state gathered from FSDP's shards
    comp.save(tmp, extra={"step": step, "train_args": vars(args)}, state=whole and whole[0])
    torch.save(dict(step=step, optimizer=whole[1] if whole else opt.state_dict(), rng=rng, args=vars(args), data=data_key,
                    config=asdict(comp.cfg)), os.path.join(tmp, "train_state.pt"))
    # the schedule is a function of the step and the data of (seed, step): step + RNG states are their state
    if os.path.exists(final):
        shutil.rmtree(tmp)   # this very step was saved already (same state)
    else:
        os.rename(tmp, final)   # the commit: atomic on one file system
    for name in ("compressor.safetensors", "compressor.json"):
        link = os.path.join(out, name + ".tmp")
        if os.path.lexists(link):
            os.remove(link)
        try:
            os.link(os.path.join(final, name), link)   # no second copy of the weights on disk
        except OSError:
            shutil.copy2(os.path.join(final, name), link)   # file systems without hard links
        os.replace(link, os.path.join(out, name))
    with open(os.path.join(out, "args.json.tmp"), "w") as f:
        json.dump(vars(args), f, indent=2)
    os.replace(os.path.join(out, "args.json.tmp"), os.path.join(out, "args.json"))
    for old in glob(os.path.join(out, ".tmp-ckpt-*")):
        shutil.rmtree(old, ignore_errors=True)
    for old in glob(os.path.join(out, "ckpt-*")):
        kept = keep_every and int(old.rpartition("-")[2]) % keep_every == 0   # --keep-every (PIC §4.3.2)
        if old != final and not kept:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir, required=True):
    """The newest complete ckpt-NNNNNN directory of a run directory (complete: its train_state.pt exists)."""
    found = sorted(d for d in glob(os.path.join(run_dir, "ckpt-*"))
                   if os.path.isfile(os.path.join(d, "train_state.pt")))
    if not found and required:
        what = "does not exist" if not os.path.isdir(run_dir) else "holds no checkpoint (no ckpt-*/train_state.pt)"
        fail(f"cannot resume: {run_dir} {what}")
    return found[-1] if found else None


def read_train_state(run_dir):
    """train_state.pt of the newest checkpoint in run_dir, with a one-line error when it cannot be read."""
    path = os.path.join(latest_checkpoint(run_dir), "train_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # truncated, overwritten, not a torch file: all one line
        fail(f"cannot resume: {path} is corrupt ({type(e).__name__}); restore it or start a new run")
    if not isinstance(state, dict) or not {"step", "optimizer", "rng", "args"} <= state.keys():
        fail(f"cannot resume: {path} is not a train.py checkpoint")
    return state


def gather_rng_states(world):
    """One RNG state per rank (rank r resumes with entry r), gathered so that rank 0 can save them all."""
    if world == 1:
        return [rng_state()]
    states = [None] * world
    dist.all_gather_object(states, rng_state())
    return states


def rng_state():
    """Every global RNG a run draws from: torch's (the init and dropout), on the host and on CUDA."""
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    """rng_state's generators back (a checkpoint saved before also holds numpy's and random's: nothing draws from
    them, so they are left alone)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_log(run_dir):
    """A run's log.jsonl -> (training rows, held-out rows {"step", "eval"}), each in step order."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl")) if line.strip()]
    return [r for r in rows if "eval" not in r], [r for r in rows if "eval" in r]


def trim_log(path, step):
    """Keep the log lines of steps <= step (a resumed run logs the later steps again), atomically."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):   # a line cut short by a killed run
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


# ---- built-in corpus ----
# So that the quickstart runs offline with no --data and shows real compression: thousands of short documents from
# a small seeded grammar (ours), many enough that a run trains on many texts and is scored on others it never saw
# (held_out_texts: the same grammar, another seed, any text also drawn here left out); and a few paragraphs of plain
# English (written for this repository) with questions about them, for QA. evaluate.py reads its built-in examples
# from here too (EVAL_TEXTS, EVAL_QA, held_out_texts): one place for every built-in text.

NAMES = ("Mira", "Tom", "Anna", "Jonas", "Lena", "Omar", "Sara", "Pedro", "Yuki", "Ivan", "Nora", "Felix", "Hana",
         "Leo", "Ada", "Karim", "Ines", "Oskar", "Rosa", "Theo", "Vera", "Emil", "Lucia", "Amir")
JOBS = ("baker", "farmer", "teacher", "painter", "doctor", "sailor", "miller", "weaver", "potter", "builder",
        "gardener", "fisher", "singer", "tailor", "carpenter", "librarian")
TOWNS = ("Millbrook", "Ashford", "Redhill", "Stonebridge", "Elmwood", "Northgate", "Fairhaven", "Oakley",
         "Riverton", "Westmoor", "Lakeside", "Greenfield", "Hollowmere", "Kingsport", "Brightwater", "Dunmore")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
GOODS = (("sold", "loaves of bread"), ("bought", "baskets of apples"), ("painted", "wooden chairs"),
         ("carried", "sacks of flour"), ("found", "old coins"), ("mended", "fishing nets"), ("planted", "young trees"),
         ("baked", "honey cakes"), ("wove", "woollen blankets"), ("built", "garden walls"), ("counted", "grey sheep"),
         ("picked", "ripe pears"), ("wrote", "long letters"), ("lost", "silver spoons"), ("caught", "small trout"),
         ("shaped", "clay pots"))
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "brown", "golden")
REASONS = ("the market opened early", "the rain had finally stopped", "a storm was coming", "the mayor had asked",
           "the old bridge was closed", "it was the first day of spring", "a cousin was visiting",
           "the harvest had been good", "the prices had fallen", "the river was high", "a festival began at noon",
           "the school was closed")
AFTER = ("Later {name} walked home along the {colour} fence.", "The neighbours said it was the best work in {town}.",
         "By evening only {num} were left.", "{Name} was paid {num} coins for the work.",
         "Nobody in {town} had seen so many before.", "Next week {name} will do it again.")


def generated_texts(n: int, seed: int) -> list:
    """n short documents of two or three sentences from the grammar above, drawn with `seed` (ours)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        name, job, town, day = rng.choice(NAMES), rng.choice(JOBS), rng.choice(TOWNS), rng.choice(DAYS)
        verb, goods = rng.choice(GOODS)
        num, colour = rng.randint(2, 99), rng.choice(COLOURS)
        first = rng.choice((f"{name} the {job} {verb} {num} {goods} in {town} on {day}.",
                            f"On {day}, {name} the {job} {verb} {num} {colour} {goods} in {town}.",
                            f"In {town}, {name} {verb} {num} {goods} for the {job}s on {day}."))
        second = f"{rng.choice(('They', name, 'The ' + job))} did it because {rng.choice(REASONS)}."
        third = rng.choice(AFTER + ("",)).format(name=rng.choice(NAMES), Name=rng.choice(NAMES), town=town,
                                                 colour=colour, num=rng.randint(2, 99))
        docs.append(" ".join(s for s in (first, second, third) if s))
    return docs


BUILTIN_GENERATED = 3000   # documents of the built-in training corpus (seed 0); held_out_texts draws seed 1's

BUILTIN_TEXTS = [
    "The river starts as a thin stream high in the hills, where snow melts slowly through the spring. It runs "
    "over stones and under fallen trees, gathering water from a hundred small springs, until by the time it "
    "reaches the first village it is wide enough for a wooden bridge. The villagers built that bridge three "
    "times: the first was carried away by a flood, the second burned in a dry summer, and the third, made of "
    "oak and iron, has stood for more than two hundred years. Below the bridge the river slows down. It bends "
    "through meadows where cattle graze, past a mill that once ground the grain of the whole valley, and into "
    "a lake that the maps call Long Water, although everyone who lives beside it simply calls it the lake.",
    "A good bread needs only four things: flour, water, salt and time. The baker mixes the flour and water "
    "the evening before and leaves the dough to rest, so that the flour can soak up the water and the gluten "
    "can begin to form on its own. In the morning she adds the salt and a little yeast, folds the dough every "
    "half hour for two hours, and then shapes it into round loaves. The loaves rise in cloth-lined baskets "
    "until they are soft and airy. The oven must be very hot. A tray of water on the bottom shelf fills it "
    "with steam, which keeps the crust thin for the first minutes and lets the bread grow. After forty minutes "
    "the loaves are dark brown, and when the baker taps one underneath it sounds hollow, like a small drum.",
    "The library opened in the old railway station after the trains stopped running. The waiting room became "
    "the reading room, the ticket office became the front desk, and the long platform, now covered with glass, "
    "holds shelves of novels arranged by the colour of their covers as well as by author. Children come on "
    "Saturday mornings to hear stories read aloud beside the great clock, which still keeps perfect time "
    "although nobody has needed a timetable here for forty years. The librarian says that the building "
    "remembers its first purpose: people still arrive in a hurry, still sit and wait, and still leave for "
    "places far away, except that now they travel inside the pages of a book instead of on the rails.",
    "Bees find their way home by the sun. A worker bee that discovers a field of flowers returns to the hive "
    "and dances on the comb: she runs in a straight line while shaking her body, turns, circles back, and runs "
    "the line again. The direction of the straight run, measured from the vertical, tells the other bees the "
    "angle between the sun and the flowers, and the length of the run tells them how far they must fly. On a "
    "cloudy day the bees can still read the sun through the pattern of polarised light in the sky. A strong "
    "hive can send out thousands of foragers in a single morning, and in one summer it can gather enough "
    "nectar to make more than fifty kilograms of honey, most of which it eats during the winter.",
    "The first clocks with a pendulum were built in the middle of the seventeenth century. Before them, even "
    "the best clocks in church towers could lose or gain a quarter of an hour in a single day, and people set "
    "them by the sun at noon. A pendulum swings with almost the same period whatever the size of its swing, so "
    "a clock that counts its swings keeps time far better: the new clocks erred by less than a minute a day. "
    "Sailors wanted such a clock most of all, because a ship that knows the exact time at its home port can "
    "work out its longitude from the position of the sun. But a pendulum cannot swing properly on a rolling "
    "deck, and it took another hundred years before a clock was made that kept good time at sea.",
    "Every autumn the town holds a market in the square in front of the town hall. Farmers bring apples, "
    "pears, pumpkins and jars of honey; a cheesemaker from the mountains sells round wheels of hard cheese; "
    "and a man with a small cart roasts chestnuts, whose smell reaches every street nearby. In the afternoon "
    "there is a competition for the largest pumpkin. The winner last year weighed three hundred and twelve "
    "kilograms and had to be lifted onto the scale by a tractor. When the sun goes down, lanterns are hung "
    "between the stalls, a band plays on the steps of the town hall, and people dance until late in the "
    "evening, while the children run between the legs of the grown-ups with sticky hands and paper crowns.",
]

BUILTIN_QA = [
    (BUILTIN_TEXTS[0], "How many times did the villagers build the bridge?", "three times"),
    (BUILTIN_TEXTS[0], "What do the people who live beside Long Water call it?", "the lake"),
    (BUILTIN_TEXTS[1], "How long do the loaves bake?", "forty minutes"),
    (BUILTIN_TEXTS[2], "Where did the library open?", "in the old railway station"),
    (BUILTIN_TEXTS[3], "How do bees find their way home?", "by the sun"),
    (BUILTIN_TEXTS[4], "When were the first pendulum clocks built?", "in the middle of the seventeenth century"),
    (BUILTIN_TEXTS[5], "How much did last year's winning pumpkin weigh?", "three hundred and twelve kilograms"),
]


# evaluate.py's built-in examples, so every task runs offline with no --data; none of them is in the corpus above.
# Short on purpose (the tests run the tasks on CPU, and AE regenerates every text token by token).
EVAL_TEXTS = [
    "The old stone bridge was finished in 1932. It crosses the river at its narrowest point, "
    "and for forty years it was the only way into the town from the north.",
    "Honeybees tell each other where food is by dancing. The angle of the dance shows the "
    "direction of the flowers, and its length shows how far away they are.",
    "Mira planted tomatoes, beans and basil in April. By July the beans had climbed the fence, "
    "but a late frost had killed half of the tomatoes.",
    "The library opens at nine on weekdays and at ten on Saturdays. It is closed on Sundays, "
    "and books can be returned through the slot by the door at any time.",
    "A comet is a ball of ice and dust. When it comes close to the Sun, the ice turns to gas "
    "and forms a bright tail that always points away from the Sun.",
    "The recipe needs two eggs, a cup of flour and a pinch of salt. Mix them, let the dough "
    "rest for an hour, then roll it out thinly and cut it into strips.",
]

EVAL_QA = [
    dict(context=EVAL_TEXTS[0], question="When was the bridge finished?", answer="1932"),
    dict(context=EVAL_TEXTS[1], question="How do honeybees show where food is?",
         answer="by dancing"),
    dict(context=EVAL_TEXTS[2], question="What killed half of the tomatoes?",
         answer="a late frost"),
    dict(context=EVAL_TEXTS[3], question="On which day is the library closed?",
         answer="Sundays"),
    dict(context=EVAL_TEXTS[4], question="Which way does a comet's tail point?",
         answer="away from the Sun"),
]


def held_out_texts(n=32):
    """The built-in texts of evaluate.py's ae and lm tasks (and of a tiny run's held-out check): n documents of the
    grammar above drawn with another seed, none of them in the built-in corpus (so a quickstart run is scored on
    texts it never saw)."""
    seen = set(generated_texts(BUILTIN_GENERATED, seed=0))
    return [t for t in generated_texts(n + 8, seed=1) if t not in seen][:n]


if __name__ == "__main__":
    main()
    if under_torchrun():
        # torchrun: after a clean end (the group destroyed, every file written and closed) the process leaves
        # without Python's finalization. gloo's worker threads outlive destroy_process_group and drop their last
        # work's tensors under the GIL; one caught by finalization aborts the rank ("terminate called without an
        # active exception", found in our two-process test's core dump; PyTorch PR 179291 describes it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
