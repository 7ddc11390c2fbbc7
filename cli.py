"""
train.py's command line: every flag with its help, and how a run's settings are resolved from them.

    args, resume_state, settings = cli.parse_args(argv)

A flag left unset takes its default from presets.recipe_for (the one place that says what each training setting is
and where it comes from: a flag, the tiny demo, the paper's recipe, its code's, or ours); `settings` is that answer,
which the run prints as its first log line. The compressor flags are CompressorConfig's fields (presets.FLAG_FIELDS),
their help and choices written there once. With --resume the checkpoint's own args come back, and only RUN_FLAGS may
change. The resolved args are saved with every checkpoint (args.json, train_state.pt).
"""

import argparse
import os
from dataclasses import asdict

import presets
from checkpoint import latest_checkpoint, read_train_state, saved_config
from model import SHAPES
from presets import fail

# flags that may change when a run is continued with --resume; every other flag must match the checkpoint
RUN_FLAGS = {"resume", "out", "steps", "stop_after", "save_every", "keep_every", "micro_batch", "compile",
             "grad_ckpt", "device", "frozen_dtype", "fsdp", "cache_dir", "eval_data", "eval_every", "eval_n",
             "eval_bleu"}
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
COMPRESSOR_FLAGS = tuple(f.name for f in presets.FLAG_FIELDS)


class Parser(argparse.ArgumentParser):
    """train.py's parser: its epilog, every method's defaults (presets.defaults_table), is made when --help prints
    it, not for every run."""

    def format_help(self):
        self.epilog = presets.defaults_table() + "\n\n" + EXAMPLES
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="train.py", usage="python train.py --method METHOD [options]   (--help lists every flag)",
               formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__.split("\n\n")[0].strip())
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
    for f in presets.FLAG_FIELDS:   # one flag per compressor axis, its help and choices from CompressorConfig
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

    add_training_flags(p)
    return p


def add_training_flags(p: argparse.ArgumentParser):
    """How it trains: the levers (ours), the data, the run, the held-out check."""
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
    g.add_argument("--device", help="cuda or cpu (default: cuda when available); under torchrun it sets the "
                   "backend too (cpu: gloo, cuda: nccl, one GPU per process)")
    g.add_argument("--fsdp", action="store_true", help="shard every weight over the torchrun processes with "
                   "PyTorch's FSDP2 (parallel.py) instead of replicating it (DDP): for a model that does not fit on "
                   "one GPU. Checkpoints are the one-process format; --resume takes it or leaves it")
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


def parse_args(argv=None):
    """Flags -> (args: a complete argparse.Namespace, every default resolved, as each checkpoint saves it; the
    checkpoint's train state with --resume, else None; every setting that shapes the run with its value and source,
    training and compressor (the first log line); the compressor's config, made once (with --init or --resume: that
    run's))."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # the flags typed on the command line (dests), whatever their values: argv parsed again with every default
    # suppressed, so a flag typed with its default value counts too (--resume DIR --eval-n 32 after --eval-n 4)
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(probe.parse_args(argv)))
    # local paths become absolute, so --resume and checkpoint.load(--out) work from any directory
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
        merged.update(resume=args.resume, stop_after=args.stop_after, out=args.out or args.resume,
                      **{k: getattr(args, k) for k in PROCESS_FLAGS})
        args = argparse.Namespace(**merged)
        try:
            cfg = saved_config(latest_checkpoint(args.resume))
        except (ValueError, OSError) as e:
            fail(f"cannot resume: {e}")
        source = f"--resume {args.resume}"
        settings = {k: presets.Setting(merged[k], source) for k in SETTINGS if k in merged}
        return args, state, settings | presets.compressor_settings(args.method, cfg, {}, {}, source), cfg
    if args.method is None:
        parser.error("--method is required (or --resume DIR)")
    if args.gpus is not None and (not args.plan or args.gpus < 1):
        fail(f"--gpus {args.gpus} sizes a --plan (a real run takes its GPUs from torchrun --nproc_per_node): "
             "add --plan, with --gpus 1 or more")
    if args.shape:   # --plan only: the paper's recipe at that shape (not tiny's demo)
        if not args.plan or args.model != "tiny":
            fail("--shape names a model shape for --plan (tests/bench_train.py --shape times one): drop --model, "
                 "add --plan")
        args.model = args.shape
    args, settings, cfg = resolve_defaults(args)
    return args, None, settings, cfg


# the training settings a run's first log line names (presets.recipe_for returns them, and the compressor settings
# the objective or the demo change)
SETTINGS = ("objective", "lr", "betas", "weight_decay", "schedule", "warmup", "batch_size", "clip", "steps",
            "lm_weight", "crop", "min_len", "max_len")


def resolve_defaults(args):
    """Fill every flag left unset from presets.recipe_for (the tiny demo on --model tiny, else the paper's recipe),
    check what the flags ask for; returns (args, recipe_for's settings)."""
    init, init_cfg = None, None
    if args.init:   # the models and compressor settings are the --init run's
        try:   # a setting added after that run was saved has its default there, as checkpoint.load builds it
            init_cfg = saved_config(args.init)
        except (ValueError, OSError) as e:
            fail(e)
        init = asdict(init_cfg)
        args.model = init["compressor_model"] or init["model"]
        args.decoder = init["model"] if init["compressor_model"] else None
    settings = presets.recipe_for(args.method, args.model, args.decoder, args.stage, flags=vars(args), init=init)
    max_len = settings["max_len"].value
    if settings["crop"].value == "head" and args.min_len not in (None, max_len):   # (never silently ignored)
        fail(f"--crop head trains on the first --max-len ({max_len}) tokens of each document, so --min-len "
             f"{args.min_len} does not apply: drop it, or use --crop window for texts of {args.min_len} to "
             f"{max_len} tokens")
    # the compressor settings the recipe row or the demo changes are make_config's defaults, not typed flags, so that
    # its mappings see what was typed (--mem 2 on tiny's CompLLM: a fixed budget, not the demo's ratio 1)
    typed = {k: getattr(args, k) for k in COMPRESSOR_FLAGS if getattr(args, k) is not None}
    row = {k: s.value for k, s in settings.items() if k in COMPRESSOR_FLAGS and k not in typed}
    for k, s in settings.items():   # (a flag's own value, or the default that replaces an unset flag)
        if k not in row:
            setattr(args, k, list(s.value) if isinstance(s.value, tuple) else s.value)   # a list, as argparse gives
    try:   # the compressor's config, made once here (the run builds exactly this), before any model is loaded
        cfg = init_cfg or presets.make_config(args.method, defaults=row, model=args.decoder or args.model,
                                        compressor_model=args.model if args.decoder else None, **typed)
    except ValueError as e:
        fail(e)
    for k in row:   # the values the row's settings resolved to, as args.json records them
        v = getattr(cfg, k)
        setattr(args, k, list(v) if isinstance(v, tuple) else v)
    if init:
        if args.method != cfg.method:
            fail(f"--init {args.init} is a {cfg.method} compressor, not {args.method}")
        for k in COMPRESSOR_FLAGS:
            v, trained = getattr(args, k), getattr(cfg, k)
            if v is not None and v != (list(trained) if isinstance(trained, (list, tuple)) else trained):
                fail(f"--init {args.init} was trained with {k}={trained}: drop --{k.replace('_', '-')}")
    if args.decoder and cfg.encoder != "separate":   # --model compresses, --decoder decodes: two models
        fail(f"--decoder needs a separate compressor model (pcc, pic or --encoder separate), not {args.method}'s "
             f"{cfg.encoder} encoder")
    settings |= presets.compressor_settings(args.method, cfg, typed, settings, init and f"--init {args.init}")
    if not 2 <= args.min_len <= args.max_len:
        fail(f"need 2 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    if args.len_curriculum:   # (ours) it grows the windows of --crop window texts
        start, k = args.len_curriculum
        if args.crop == "head" or args.objective not in ("ae", "pretrain"):
            fail("--len-curriculum grows the windows of --crop window texts (ae or pretrain): drop it, or use "
                 "--crop window")
        if not (1 <= start <= args.min_len and k >= 1):
            fail(f"--len-curriculum N K needs 1 <= N <= --min-len ({args.min_len}) and K >= 1, got {start} {k}")
    args.out = args.out or os.path.join("runs", args.method)
    return args, settings, cfg
