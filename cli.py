"""
train.py's command line, and everything that turns its flags into a run's settings, decided here once:

    settings = cli.parse_args(argv)                 # a frozen Settings: every value resolved, the compressor's config
    run = cli.place(settings, device, rank, world)  # what one process of it does: the batch split, dtypes, seed

A flag left unset takes its default from recipe_for, the one place that says what each training setting is and where
it comes from: a flag, the tiny demo (TINY, ours), the paper's recipe, its code's, or ours. The compressor flags are
CompressorConfig's fields (presets.FLAG_FIELDS), their help and choices written there once; they make the run's
config once (presets.make_config). Every setting with its source is the run's first log line (first_lines). With
--resume the checkpoint's own settings come back, and only RUN_FLAGS may change. What a checkpoint records
(Settings.record: the flags, the recipe's values, the compressor's config) is saved with every checkpoint (args.json,
train_state.pt) and read back here only.
"""

import argparse
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from typing import Mapping, NamedTuple

import torch

import data
import presets
from checkpoint import latest_checkpoint, read_train_state, saved_config, sharded_folder
from model import SHAPES
from presets import FLAG_FIELDS, CompressorConfig, readonly


def fail(message) -> None:
    """A one-line error, no traceback: bad flags, paths, data or checkpoints end here (train.py's entry; the modules
    below it raise ValueError or OSError with the message)."""
    raise SystemExit(f"train.py: error: {message}")


# -----------------------------------------------------------------------------
# the flags

# flags that may change when a run is continued with --resume; every other flag must match the checkpoint
RUN_FLAGS = {"resume", "out", "steps", "stop_after", "save_every", "keep_every", "micro_batch", "compile",
             "cuda_graphs", "grad_ckpt", "device", "frozen_dtype", "fsdp", "cache_dir", "eval_data", "eval_every",
             "eval_n", "eval_bleu"}
# how this command runs, never taken from the checkpoint: a run saved under FSDP or on a GPU continues in one process
# or on the CPU, and the other way round
PROCESS_FLAGS = ("device", "fsdp")
# flags that name a local file or folder (or a hub id): saved absolute, so a run resumes from any directory
PATH_FLAGS = ("model", "decoder", "data", "eval_data", "init", "warm_start")
EXAMPLES = """examples:
  python train.py --method aoc --mem 4                 # quickstart: --model tiny, its demo settings (above), 4x
  python train.py --method aoc --mem 16 --model meta-llama/Llama-3.2-1B-Instruct --data corpus/ --steps 20000
  python train.py --method icae --layout epl --mem 102 --model meta-llama/Llama-3.2-1B --data pile.jsonl
  python train.py --method pic --model Qwen/Qwen2.5-0.5B-Instruct --decoder meta-llama/Meta-Llama-3-8B-Instruct
  python train.py --method gmsa --stage keft --init runs/gmsa --data qa.jsonl --out runs/gmsa-keft
  python train.py --resume runs/aoc --stop-after 4000                                  # time-sliced jobs
  torchrun --nproc_per_node 8 train.py --method icae ...                               # one process per GPU"""
# every compressor axis (compressors.CompressorConfig) that a flag can set
COMPRESSOR_FLAGS = tuple(f.name for f in FLAG_FIELDS)


class Parser(argparse.ArgumentParser):
    """train.py's parser: its epilog, every method's defaults (defaults_table), is made when --help prints it, not for
    every run."""

    def format_help(self):
        self.epilog = defaults_table() + "\n\n" + EXAMPLES
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="train.py", usage="python train.py --method METHOD [options]   (--help lists every flag)",
               formatter_class=argparse.RawDescriptionHelpFormatter,
               description="train.py's command line: every flag with its help, and how a run's settings are "
                           "resolved from them.")
    g = p.add_argument_group("what to train")
    g.add_argument("--method", choices=presets.METHODS, help="the compressor preset (presets.PRESETS); "
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

    g = p.add_argument_group("compressor (default: the method's preset, presets.PRESETS)")
    for f in FLAG_FIELDS:   # one flag per compressor axis, its help and choices from CompressorConfig
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
    add_data_flags(p)
    add_run_flags(p)
    return p


def add_data_flags(p: argparse.ArgumentParser):
    """How it trains: the levers (ours), the data, the held-out check."""
    g = p.add_argument_group("levers: ours, for a memory that carries nothing at this scale "
                             "(recipes/README.md, 'The ladder')")
    g.add_argument("--mem-lr", type=float, help="peak learning rate of the learned memory tokens alone (the same "
                   "schedule; default: --lr)")
    g.add_argument("--len-curriculum", type=int, nargs=2, metavar=("N", "K"), help="texts start at N tokens and "
                   "grow linearly to --min-len..--max-len over the first K steps (a curriculum from short texts)")
    g.add_argument("--warm-start", metavar="RUN", help="start from the trained tensors of another run's compressor "
                   "(its --out; the same tensor names and shapes), keeping this run's settings: e.g. a 4x arm from "
                   "the 1:1 arm that carries its text")
    g.add_argument("--own-other-weight", type=float, default=0.0, metavar="W", help="ae: add W x the own/other "
                   "term, the mean over texts of softplus(own - other), where own is a text's mean AE loss with its "
                   "own memory and other with its neighbour's in the micro-batch (texts 1-2, 3-4, ... trade memories; "
                   "log 2 when the memory is one prompt for every text): a lever against that collapse. Needs an "
                   "even --micro-batch (default 0: off)")

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
    g = p.add_argument_group("held-out check: does the memory carry its own text? (ours)")
    g.add_argument("--eval-data", help="held-out examples to score while training (.jsonl/.parquet/.txt, as "
                   "evaluate.py --data reads them: texts for ae/pretrain, QA triples for qa/distill); default on "
                   "--model tiny: evaluate.py's built-in held-out set; on a real model none (the run says so)")
    g.add_argument("--eval-every", type=int, help="score the held-out examples every N steps, at step 0 and at "
                   "the end (default: at every checkpoint, --save-every; 0 = never)")
    g.add_argument("--eval-n", type=int, default=32, help="held-out examples scored: the first N (ae, pretrain: the "
                   "first N of at least --min-len tokens, cut to the trained length); default 32")
    g.add_argument("--eval-bleu", action="store_true", help="ae/pretrain: also regenerate each held-out text "
                   "greedily from its memory and log BLEU-4 (words) and ROUGE-L beside own/other (costs a generation "
                   "per check)")


def add_run_flags(p: argparse.ArgumentParser):
    """How the run runs: its checkpoints, devices, processes, and --plan."""
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
    g.add_argument("--compile", action="store_true", help="torch.compile each model's whole forward (the encoder's, "
                   "the decoder's): one graph each, compiled at the first step for any length")
    g.add_argument("--cuda-graphs", action="store_true", help="ours, with --compile on CUDA: record each graph once "
                   "as a CUDA graph and replay it (reduce-overhead mode), with a capturable AdamW; for a run whose "
                   "steps all have one shape (--crop head, fixed chunks, ae or pretrain: AOC's recipe)")
    g.add_argument("--device", help="cuda or cpu (default: cuda when available); under torchrun it sets the "
                   "backend too (cpu: gloo, cuda: nccl, one GPU per process)")
    g.add_argument("--fsdp", action="store_true", help="shard every weight over the torchrun processes with "
                   "PyTorch's FSDP2 (parallel.py) instead of replicating it (DDP): for a model that does not fit on "
                   "one GPU. Checkpoints are sharded (torch.distributed.checkpoint, checkpoint.py), and --resume continues any "
                   "checkpoint on any number of processes, with or without --fsdp")
    g.add_argument("--plan", action="store_true", help="print the run's memory per GPU (parameters by dtype, "
                   "weights, gradients, AdamW, activations; plan.py), built on the meta device, and exit")
    g.add_argument("--gpus", type=int, help="with --plan: the GPUs the run spreads over (torchrun "
                   "--nproc_per_node N; with --fsdp, sharded): memory per GPU, the micro-batch per GPU (default 1)")
    g.add_argument("--shape", choices=tuple(SHAPES), help="with --plan: a paper model's shape (model.SHAPES) in place "
                   "of --model, no download")
    g.add_argument("--frozen-dtype", choices=("auto", "fp32", "bf16"), default="auto", help="the frozen base "
                   "weights' dtype; what trains (and what a checkpoint holds) is always fp32 for AdamW. auto: bf16 on "
                   "CUDA (the EPL and AOC code's dtype: half the memory), fp32 elsewhere. bf16 computes under bf16 "
                   "autocast on any device; fp32 keeps every weight fp32 (CUDA still autocasts)")


# -----------------------------------------------------------------------------
# the tiny demo (ours)

# --model tiny (a random 4-layer Llama, a byte tokenizer, the built-in corpus) is a CPU demo that compresses (ours):
# `python train.py --method aoc --mem 4` then `python evaluate.py --ckpt runs/aoc --task ae` take under two minutes
# together on 2 CPU cores and print held-out own/other <= 0.5 with 16 bytes in 4 memory slots, 4x (the README's
# Quickstart; --mem 16, m = n, is the sanity check; each preset's measured number and wall time: recipes/README.md).
# Every method trains AE (what evaluate.py --task ae scores) on the first n bytes of each document (a head crop:
# evaluate.py cuts its held-out texts the same way), batch 4, lr 3e-3 decaying linearly to 0 (TINY_ALL), with the
# text length n, steps and memory size m of its row (TINY): m = n (ICAE 2n; GMSA 5: [BOS] and the 8 bytes in groups
# of 2), n = 16 for AOC and 8 for the others (which do not carry 16 bytes within two minutes); AOC at batch 16 and lr
# 1e-2, which reach 4x within two minutes (batch 4 at lr 3e-3: 0.514 after 3,000 steps). These fill only the flags
# not given, in place of the paper's recipe; any other model keeps the paper's.
TINY_ALL = dict(objective="ae", crop="head", batch_size=4, lr=3e-3, schedule="linear")
TINY = {   # ours: measured on this repository's 2-core CPU, recipes/README.md "The tiny demo, each preset"
    "icae": dict(lengths=(8, 8), mem=16, steps=3000),   # (at m = 8: own/other 0.514 at step 3000)
    "500x": dict(lengths=(8, 8), mem=8, steps=3000),
    "pcc": dict(lengths=(8, 8), mem=8, steps=3000),
    "pic": dict(lengths=(8, 8), mem=8, steps=3000),
    "compllm": dict(lengths=(8, 8), ratio=1.0, steps=3000),   # one concept embedding per byte (the paper: C = 2)
    "gmsa": dict(lengths=(8, 8), ratios=(2,), steps=3000),    # groups of 2 (the paper samples 4 or 8)
    "aoc": dict(lengths=(16, 16), steps=2000, batch_size=16, lr=1e-2),   # --mem 4 (4x): 0.438 at step 2000
}


def on_tiny(model, decoder=None) -> bool:
    """Does the run train the built-in tiny model (its demo settings, its built-in held-out check)?"""
    return model == "tiny" and decoder is None


# -----------------------------------------------------------------------------
# what each setting is, and where its value comes from

class Setting(NamedTuple):
    value: object
    source: str     # "paper", "code" (its public code), "ours", "demo" (ours: --model tiny), "flag", or how derived


def recipe_settings(recipe: presets.Recipe, objective: str) -> dict:
    """Every value of a recipe under `objective` (what changes for it applied), with where it comes from: "paper", or
    as the recipe's `sources` say, "code" or "ours"."""
    changed = recipe.per_objective.get(objective, {})
    return {f.name: Setting(changed.get(f.name, getattr(recipe, f.name)),
                            recipe.sources.get(f"{objective}.{f.name}" if f.name in changed else f.name, "paper"))
            for f in fields(recipe) if f.name not in ("per_objective", "sources")}


def recipe_for(method: str, model: str = "tiny", decoder: str | None = None, stage: str = "ae",
               flags: Mapping = readonly(), init: Mapping | None = None) -> dict:
    """Every training setting of a run and where its value comes from: a flag typed on the command line (`flags`:
    name -> value, the None ones not given), else on --model tiny the demo (ours), else the preset's recipe (the
    paper's, its code's, or ours where both are silent). Besides the recipe's fields (its `lengths` as min_len and
    max_len) and warmup, the compressor settings the objective or the demo change (500x's ae: the original 500x code;
    the demo's memory sizes), unless the run starts from `init` (the --init run's config: its settings stay)."""
    flags = {k: v for k, v in flags.items() if v is not None}
    preset, demo = presets.PRESETS[method], ({**TINY_ALL, **TINY[method]} if on_tiny(model, decoder) else {})
    recipe = preset.recipe
    objective = (Setting(flags["objective"], "flag") if "objective" in flags else
                 Setting("qa", "--stage keft") if stage == "keft" else
                 Setting(demo["objective"], "demo") if demo else
                 recipe_settings(recipe, "")["objective"])
    out = {"objective": objective}
    out |= {k: s for k, s in recipe_settings(recipe, objective.value).items() if k != "objective"}
    out |= {k: Setting(v, "code") for k, v in preset.compressor_for(objective.value).items()}   # the objective's code
    out |= {k: Setting(v, "demo") for k, v in demo.items() if k != "objective"}
    if init:   # the compressor settings are the --init run's
        out = {k: s for k, s in out.items() if k not in COMPRESSOR_FLAGS}
    out |= {k: Setting(v, "flag") for k, v in flags.items() if k in out or k in ("warmup", "min_len", "max_len")}
    if "warmup" not in flags:   # a short run still reaches its peak lr (ours: warmup is at most 10% of the run)
        w, steps = out["warmup"], out["steps"].value
        out["warmup"] = w if w.value <= steps // 10 else Setting(steps // 10, "ours: 10% of --steps")
    # lengths: the paper's, shrunk with the chunk so that a context still spans the same number of chunks (EPL: p =
    # |X|/2 is 1 to 2 chunks of 510); the tiny demo's as they are
    chunk_len = (init or {}).get("chunk_len") or flags.get("chunk_len") or out.get("chunk_len", Setting(
        preset.compressor.get("chunk_len", CompressorConfig.chunk_len), "")).value
    scale = 1.0 if demo else min(1.0, chunk_len / preset.compressor.get("chunk_len", CompressorConfig.chunk_len))
    (lo, hi), source = out.pop("lengths")
    source += ", scaled by --chunk-len" if scale < 1 else ""
    if "max_len" not in flags:
        out["max_len"] = Setting(max(flags.get("min_len", 2), round(hi * scale)), source)
    if out["crop"].value == "head":   # AOC: every text is the first n = --max-len tokens of its document
        out["min_len"] = Setting(out["max_len"].value, "--crop head: --max-len")
    elif "min_len" not in flags:
        out["min_len"] = Setting(min(out["max_len"].value, max(2, round(lo * scale))), source)
    return out


def compressor_settings(method: str, cfg: CompressorConfig, typed: Mapping, settings: Mapping,
                        given_by: str | None = None) -> dict:
    """Every compressor setting of `cfg` (one per flag) and where its value comes from: a flag (`typed`), the demo or
    the objective's code (recipe_for named those in `settings`), the preset (its paper's code), CompressorConfig's
    default shared by every preset, one of make_config's two mappings (presets.ratio_mapping says which, and why);
    `given_by`: the run it came from (--init, --resume)."""
    preset, out = presets.PRESETS[method].compressor, {}
    for f in FLAG_FIELDS:
        source = (given_by if given_by else "flag" if f.name in typed else settings[f.name].source
                  if f.name in settings else "preset" if f.name in preset else "default")
        out[f.name] = Setting(getattr(cfg, f.name), source)
    if not given_by:   # the values make_config mapped, before the mapping: the preset's, the row's, the typed ones
        row = {k: s.value for k, s in settings.items() if k in COMPRESSOR_FLAGS}
        for k, (_, why) in presets.ratio_mapping({**preset, **row, **typed}, typed).items():
            out[k] = Setting(getattr(cfg, k), why)
    return out


def first_lines(method: str, settings: Mapping) -> list:
    """A run's first log lines: every setting with its source ("settings: objective ae (demo), lr 0.003 (demo), ..."),
    then on --model tiny what the demo (ours) changes of the paper's recipe, each value beside the paper's (no such
    line on any other model, or where the demo changes nothing)."""
    show = lambda v: ",".join(map(str, v)) if isinstance(v, (tuple, list)) else f"{v:g}" if isinstance(v, float) else v
    lines = ["settings: " + ", ".join(f"{k} {show(s.value)} ({s.source})" for k, s in settings.items())]
    paper = presets.PRESETS[method].recipe
    values = {k: s.value for k, s in recipe_settings(paper, paper.objective).items()}
    was = {**values, "min_len": values["lengths"][0], "max_len": values["lengths"][1],
           **{f.name: f.default for f in FLAG_FIELDS}, **presets.PRESETS[method].compressor}
    changed = [f"{k} {show(s.value)} (the paper's {show(was[k])})" for k, s in settings.items()
               if s.source == "demo" and was[k] != s.value]
    if changed:
        lines.append("--model tiny is a CPU demo (ours), not the paper's run: it changes " + ", ".join(changed)
                     + "; any other --model trains the paper's recipe")
    return lines


def objective_changes(method, objective, cfg=None) -> str:
    """The compressor settings that --objective changes on this preset, as "k=v, ..." ("" for none): e.g. 500x's ae
    is the original 500xCompressor code, with another special token, init, LoRA and template. With the run's
    config `cfg`, only those it took (a flag overrides any of them)."""
    return ", ".join(f"{k}={v}" for k, v in presets.PRESETS[method].compressor_for(objective).items()
                     if cfg is None or getattr(cfg, k) == v)


def defaults_table() -> str:
    """The per-method defaults as the table train.py --help prints."""
    rows = ["per-method defaults (flags override; presets.PRESETS gives the sources of each):",
            f"  {'method':8} {'objective':9} {'lr':>7} {'betas':>11} {'wd':>5} {'schedule':9} {'warmup':>6} "
            f"{'batch':>5} {'clip':>4} {'steps':>6}  |X|"]
    for m, r in ((m, p.recipe) for m, p in presets.PRESETS.items()):
        rows.append(f"  {m:8} {r.objective:9} {r.lr:7.0e} {str(r.betas):>11} {r.weight_decay:5} "
                    f"{r.schedule:9} {r.warmup:6} {r.batch_size:5} {r.clip:4} {r.steps:6}  "
                    f"{r.lengths[0]}-{r.lengths[1]}" + "".join(f"   {o}: {dict(v)}" for o, v in r.per_objective.items()))
    rows += [f"--objective {o} on {m} also sets: {objective_changes(m, o)}"
             for m, p in presets.PRESETS.items() for o in p.objective_compressor]
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


# -----------------------------------------------------------------------------
# a run's settings, resolved once

# the training settings a run's first log line names (recipe_for returns them, and the compressor settings the
# objective or the demo change)
SETTINGS = ("objective", "lr", "betas", "weight_decay", "schedule", "warmup", "batch_size", "clip", "steps",
            "lm_weight", "crop", "min_len", "max_len")


@dataclass(frozen=True)
class Settings:
    """A run's settings, decided once (parse_args) from its flags, the recipe and a checkpoint: each flag's value with
    every default filled in, and the compressor's config. train.main reads them; nothing below it does."""
    # what to train
    method: str
    model: str                  # the LLM (with --decoder: the compressor LLM)
    decoder: str | None         # a different frozen decoder LLM (pcc/pic)
    stage: str                  # "ae", or "keft" (GMSA §3.5)
    init: str | None            # the run whose compressor this one starts from
    data: str | None            # None: the built-in corpus
    out: str                    # the run directory
    config: CompressorConfig    # the compressor's, made once (make_config), or the --init / --resume run's
    # the recipe (recipe_for: a flag's, the demo's or the paper's)
    objective: str
    lr: float
    betas: tuple
    weight_decay: float
    schedule: str
    warmup: int
    batch_size: int
    micro_batch: int | None
    clip: float
    steps: int
    lm_weight: float
    crop: str
    min_len: int
    max_len: int
    # levers (ours) and data
    mem_lr: float | None
    len_curriculum: tuple | None
    own_other_weight: float     # 0: off
    warm_start: str | None
    answer_tokens: int
    cache_dir: str              # --cache-dir, default OUT/cache
    # the run
    seed: int
    save_every: int
    resume: str | None
    stop_after: int | None
    keep_every: int | None
    grad_ckpt: bool
    compile: bool
    cuda_graphs: bool           # ours: --compile's graphs replayed as CUDA graphs (static shapes, CUDA only)
    device: str | None
    fsdp: bool
    frozen_dtype: str           # the flag: auto, fp32 or bf16 (place() turns it into a dtype)
    plan: bool
    gpus: int | None
    shape: str | None
    # the held-out check
    eval_data: str | None
    eval_every: int             # --eval-every, default --save-every
    eval_n: int
    eval_bleu: bool
    builtin_check: bool         # --model tiny: with no --eval-data, evaluate.py's built-in held-out set
    # what the run prints and records
    shown: Mapping              # every setting that shapes the run -> Setting(value, source): the first log line
    changes: str                # what --objective changed on this preset, "k=v, ..." ("" with --init: that run's)
    record: Mapping             # each checkpoint's args.json and train_state.pt "args": the flags, recipe and config
    resume_state: Mapping | None   # --resume: the checkpoint's train state (optimizer, RNG states, step, data key)
    weights: str | None         # the trained tensors it starts from: --resume's newest checkpoint, or the --init run
    weights_config: CompressorConfig | None   # the config those tensors were saved under


def parse_args(argv=None) -> Settings:
    """Flags -> the run's Settings: every default resolved (with --resume: the checkpoint's settings, the run flags
    typed now on top), the compressor's config made once (with --init or --resume: that run's), and where each value
    comes from."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # the flags typed on the command line (dests), whatever their values: argv parsed again with every default
    # suppressed, so a flag typed with its default value counts too (--resume DIR --eval-n 32 after --eval-n 4)
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(probe.parse_args(argv)))
    flags = dict(vars(args))
    # local paths become absolute, so --resume and checkpoint.load(--out) work from any directory
    for k in PATH_FLAGS:
        if flags[k] and os.path.exists(flags[k]):
            flags[k] = os.path.abspath(flags[k])
    if flags["resume"]:
        return resumed(parser, flags, given)
    if flags["method"] is None:
        parser.error("--method is required (or --resume DIR)")
    if flags["gpus"] is not None and (not flags["plan"] or flags["gpus"] < 1):
        fail(f"--gpus {flags['gpus']} sizes a --plan (a real run takes its GPUs from torchrun --nproc_per_node): "
             "add --plan, with --gpus 1 or more")
    if flags["shape"]:   # --plan only: the paper's recipe at that shape (not tiny's demo)
        if not flags["plan"] or flags["model"] != "tiny":
            fail("--shape names a model shape for --plan (tests/bench_train.py --shape times one): drop --model, "
                 "add --plan")
        flags["model"] = flags["shape"]
    return resolved(flags)


def resumed(parser, flags: dict, given: set) -> Settings:
    """--resume DIR: the settings the checkpoint saved (its record: the flags and the recipe's values, with the
    config's fields or without them), a flag the record lacks at its default, and the run flags typed now on top; the
    config is the checkpoint's own (its compressor.json)."""
    resume = flags["resume"]
    try:
        state = read_train_state(resume)
    except (ValueError, OSError) as e:
        fail(e)
    saved = state["args"]
    for k in sorted(given - RUN_FLAGS):
        if flags[k] != saved.get(k):
            fail(f"mismatched checkpoint: {resume} was trained with --{k.replace('_', '-')} {saved.get(k)}, "
                 f"not {flags[k]} (drop the flag to continue that run)")
    values = {**{k: parser.get_default(k) for k in flags}, **saved, **{k: flags[k] for k in RUN_FLAGS & given}}
    values.update(resume=resume, stop_after=flags["stop_after"], out=flags["out"] or resume,
                  **{k: flags[k] for k in PROCESS_FLAGS})
    try:
        ckpt = latest_checkpoint(resume)
        cfg = saved_config(ckpt)
    except (ValueError, OSError) as e:
        fail(f"cannot resume: {e}")
    try:
        presets.validate(cfg)
    except ValueError as e:
        fail(e)
    source = f"--resume {resume}"
    shown = {k: Setting(values[k], source) for k in SETTINGS if k in values}
    shown |= compressor_settings(values["method"], cfg, {}, {}, source)
    changes = "" if values["init"] else objective_changes(values["method"], values["objective"], cfg)
    return settings_of(values, cfg, shown, changes, state, ckpt, cfg)


def resolved(flags: dict) -> Settings:
    """A new run: every flag left unset from recipe_for (the tiny demo on --model tiny, else the paper's recipe), the
    compressor's config made once (with --init: that run's), and what the flags ask for checked, before any model is
    loaded."""
    method, init, init_cfg = flags["method"], flags["init"], None
    if init:   # the models and compressor settings are the --init run's
        try:   # a setting added after that run was saved has its default there, as checkpoint.load builds it
            init_cfg = saved_config(init)
            presets.validate(init_cfg)
        except (ValueError, OSError) as e:
            fail(e)
        flags["model"] = init_cfg.compressor_model or init_cfg.model
        flags["decoder"] = init_cfg.model if init_cfg.compressor_model else None
    shown = recipe_for(method, flags["model"], flags["decoder"], flags["stage"], flags=flags,
                       init=init_cfg and asdict(init_cfg))
    min_len, max_len = flags["min_len"], shown["max_len"].value
    if shown["crop"].value == "head" and min_len not in (None, max_len):   # (never silently ignored)
        fail(f"--crop head trains on the first --max-len ({max_len}) tokens of each document, so --min-len "
             f"{min_len} does not apply: drop it, or use --crop window for texts of {min_len} to {max_len} tokens")
    typed = {k: flags[k] for k in COMPRESSOR_FLAGS if flags[k] is not None}
    cfg = config_of(flags, shown, typed, init_cfg)
    shown |= compressor_settings(method, cfg, typed, shown, init and f"--init {init}")
    values = {**flags, **{k: s.value for k, s in shown.items() if k not in COMPRESSOR_FLAGS}}
    min_len, curriculum, warm = values["min_len"], values["len_curriculum"], values["warm_start"]
    if not 2 <= min_len <= max_len:
        fail(f"need 2 <= --min-len <= --max-len, got {min_len} and {max_len}")
    if curriculum:   # (ours) it grows the windows of --crop window texts
        if values["crop"] == "head" or values["objective"] not in ("ae", "pretrain"):
            fail("--len-curriculum grows the windows of --crop window texts (ae or pretrain): drop it, or use "
                 "--crop window")
        if not (1 <= curriculum[0] <= min_len and curriculum[1] >= 1):
            fail(f"--len-curriculum N K needs 1 <= N <= --min-len ({min_len}) and K >= 1, got {curriculum[0]} "
                 f"{curriculum[1]}")
    if values["own_other_weight"] < 0 or (values["own_other_weight"] and values["objective"] != "ae"):
        fail(f"--own-other-weight W adds W x the own/other term to the AE loss: it needs W >= 0 and --objective ae, "
             f"got {values['own_other_weight']:g} and {values['objective']}")
    # --warm-start (ours): another run's trained tensors, this run's settings; --init starts from one already
    if warm and not values["plan"] and (init or not (os.path.isfile(os.path.join(warm, "compressor.safetensors"))
                                                     or sharded_folder(warm))):
        fail(f"--warm-start {warm}: " + ("--init already starts from a run: use one of them" if init
             else "no compressor.safetensors there, nor a sharded checkpoint (pass a train.py --out folder)"))
    values["out"] = values["out"] or os.path.join("runs", method)
    changes = "" if init else objective_changes(method, values["objective"], cfg)
    return settings_of(values, cfg, shown, changes, None, init, init_cfg)


def config_of(flags: dict, shown: dict, typed: dict, init_cfg: CompressorConfig | None) -> CompressorConfig:
    """The compressor's config, made once, before any model is loaded (the run builds exactly this): the --init run's,
    or the preset with the flags typed on top (--stage keft: GMSA §3.5's, whose decoder q/k/v train)."""
    method, keft = flags["method"], "keft" if flags["stage"] == "keft" else None
    if init_cfg:
        if method != init_cfg.method:
            fail(f"--init {flags['init']} is a {init_cfg.method} compressor, not {method}")
        for k, v in typed.items():
            trained = getattr(init_cfg, k)
            if v != (list(trained) if isinstance(trained, (list, tuple)) else trained):
                fail(f"--init {flags['init']} was trained with {k}={trained}: drop --{k.replace('_', '-')}")
        cfg = replace(init_cfg, decoder_train=keft) if keft else init_cfg
    else:
        # the compressor settings the recipe row or the demo changes are make_config's defaults, not typed flags, so
        # that its mappings see what was typed (--mem 2 on tiny's CompLLM: a fixed budget, not the demo's ratio 1)
        row = {k: s.value for k, s in shown.items() if k in COMPRESSOR_FLAGS and k not in typed}
        try:
            cfg = presets.make_config(method, defaults=row, model=flags["decoder"] or flags["model"],
                                      compressor_model=flags["model"] if flags["decoder"] else None,
                                      decoder_train=keft, **typed)
        except ValueError as e:
            fail(e)
    if flags["decoder"] and cfg.encoder != "separate":   # --model compresses, --decoder decodes: two models
        fail(f"--decoder needs a separate compressor model (pcc, pic or --encoder separate), not {method}'s "
             f"{cfg.encoder} encoder")
    return cfg


def check_cuda_graphs(values: dict, cfg: CompressorConfig):
    """--cuda-graphs (ours) replays each graph at the shapes it was recorded at: it needs --compile, and every step of
    one shape, so it fails here, before any model is loaded, where a run's shapes vary from step to step (a length
    drawn per text, CompLLM's sentences, several GMSA ratios, QA's questions and answers). place() refuses it off
    CUDA."""
    varies = ("--crop window (a length drawn per text)" if values["crop"] != "head" else
              f"the {values['objective']} objective (questions and answers of their own lengths)"
              if values["objective"] not in ("ae", "pretrain") else
              "sentence chunks" if cfg.chunking != "fixed" else
              f"a ratio drawn per text from {cfg.ratios}" if cfg.source == "group_mean" and len(cfg.ratios) > 1 else "")
    if not values["compile"]:
        fail("--cuda-graphs replays --compile's graphs: add --compile")
    if varies:
        fail(f"--cuda-graphs needs every step in one shape, and this run's shapes vary with {varies}: drop it, or "
             "train as AOC's recipe does (--crop head, --objective ae or pretrain, fixed chunks)")


# the config's own fields (the flags name the method and the model): a checkpoint's record takes them from the config
CONFIG_ONLY = {f.name for f in fields(CompressorConfig)} - {"method", "model"}
# the Settings fields that are not one flag's value
DERIVED = ("config", "cache_dir", "eval_every", "builtin_check", "shown", "changes", "record", "resume_state",
           "weights", "weights_config")


def settings_of(values: dict, cfg: CompressorConfig, shown: dict, changes: str, state, weights,
                weights_cfg) -> Settings:
    """The frozen Settings of the resolved `values` (one per flag), and what each checkpoint records of them: the
    config's fields and every flag's value (--eval-every and --cache-dir as typed: a resumed run resolves them again,
    after its --save-every and --out)."""
    if values["fsdp"] and values["objective"] == "distill" and not values["plan"]:
        # the teacher generates outside the step, on sharded weights
        fail("--fsdp does not run distill (its frozen teacher generates outside the training step): use DDP")
    if values["cuda_graphs"]:
        check_cuda_graphs(values, cfg)
    as_json = lambda d: {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}   # lists, as argparse's
    record = {**as_json(asdict(cfg)), **as_json({k: v for k, v in values.items() if k not in CONFIG_ONLY})}
    plain = {f.name for f in fields(Settings)} - set(DERIVED)
    return Settings(**{k: tuple(values[k]) if isinstance(values[k], list) else values[k] for k in plain},
                    config=cfg, cache_dir=values["cache_dir"] or os.path.join(values["out"], "cache"),
                    eval_every=values["save_every"] if values["eval_every"] is None else values["eval_every"],
                    builtin_check=on_tiny(values["model"], values["decoder"]), shown=shown, changes=changes,
                    record=record, resume_state=state, weights=weights, weights_config=weights_cfg)


# -----------------------------------------------------------------------------
# what one process of the run does

@dataclass(frozen=True)
class Run:
    """Everything the loop needs, fixed for the run: where it runs (one process per GPU under torchrun), how a step's
    batch is split, the schedule, the dtypes, and where it saves. place() makes it from the settings."""
    device: torch.device
    rank: int               # this process (0 logs and writes)
    world: int              # processes
    micro: int              # examples per forward pass and process
    accum: int              # micro-batches per step and process
    seed: int               # torch's seed in this process: --seed + rank
    start: int              # steps done (the data position is this number)
    end: int                # the last step of this job (--stop-after K, else --steps)
    steps: int              # the run's length (the schedule's)
    lr: float               # peak learning rate, reached after `warmup` steps, then `schedule`
    warmup: int
    schedule: str
    clip: float             # gradient-norm clipping (0 = off)
    sampling: data.Sampling    # how a step's examples are drawn
    answer_tokens: int      # distill: the teacher's longest answer
    frozen: torch.dtype     # the frozen base weights' dtype (--frozen-dtype)
    bf16: bool              # computes under bf16 autocast: on CUDA, or with bf16 frozen weights
    autocast: object        # torch.autocast to bf16 when bf16, else a nullcontext
    out: str                # the run directory (--out)
    save_every: int
    keep_every: int | None
    grad_ckpt: bool         # activation checkpointing (an out-of-memory error suggests it when off)
    cuda_graphs: bool       # --cuda-graphs (ours): a new CUDA-graph iteration is marked before every forward
    fsdp: bool
    eval_every: int         # the held-out check every N steps; 0: none (always under --fsdp)

    @property
    def master(self) -> bool:
        return self.rank == 0


def place(s: Settings, device: torch.device, rank: int, world: int, micro: int | None = None) -> Run:
    """This process's Run: the step's batch split over the processes (torchrun's, or this one) and micro-batches
    (micro: --plan's, else this run's --micro-batch or its share of the batch, checked), the dtypes, the seed."""
    if micro is None:
        micro = s.micro_batch or s.batch_size // world
        if micro < 1 or s.batch_size % (micro * world):
            fail(f"--batch-size {s.batch_size} must be a multiple of --micro-batch {micro} x {world} GPU(s)")
    if s.own_other_weight and micro % 2:   # (ours) Memory.neighbours: texts 1-2, 3-4, ... of a micro-batch
        fail(f"--own-other-weight trades memories between the texts of a micro-batch in pairs (1-2, 3-4, ...), so "
             f"a micro-batch of {micro} has a text without a neighbour: use an even --micro-batch"
             f"{' (or --batch-size)' if not s.micro_batch else ''}")
    if s.cuda_graphs and device.type != "cuda":
        fail(f"--cuda-graphs records CUDA graphs, and this run is on {device}: drop it, or run on a GPU")
    # --frozen-dtype auto: bf16 on CUDA (the EPL and AOC code's dtype), fp32 elsewhere. bf16 weights need autocast on
    # the CPU too (a matmul of fp32 activations with bf16 weights is an error outside it)
    frozen = torch.bfloat16 if s.frozen_dtype == "bf16" or (s.frozen_dtype == "auto" and
                                                            device.type == "cuda") else torch.float32
    bf16 = device.type == "cuda" or frozen == torch.bfloat16
    sampling = data.Sampling(s.objective, s.crop, s.min_len, s.max_len, s.batch_size, s.seed, s.len_curriculum)
    return Run(device=device, rank=rank, world=world, micro=micro, accum=s.batch_size // (micro * world),
               seed=s.seed + rank, start=s.resume_state["step"] if s.resume_state else 0,
               end=min(s.steps, s.stop_after or s.steps), steps=s.steps, lr=s.lr, warmup=s.warmup,
               schedule=s.schedule, clip=s.clip, sampling=sampling, answer_tokens=s.answer_tokens, frozen=frozen,
               bf16=bf16, autocast=torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext(),
               out=s.out, save_every=s.save_every, keep_every=s.keep_every, grad_ckpt=s.grad_ckpt,
               cuda_graphs=s.cuda_graphs, fsdp=s.fsdp,
               eval_every=0 if s.fsdp else s.eval_every)   # rank 0 alone cannot score weights spread over every rank


def planned(s: Settings) -> Run:
    """--plan's Run: on --device (default CUDA: the plan is for GPUs), over --gpus processes, each with --micro-batch
    or its share of the batch (at least 1)."""
    world = s.gpus or 1
    return place(s, torch.device(s.device or "cuda"), 0, world, s.micro_batch or max(1, s.batch_size // world))
