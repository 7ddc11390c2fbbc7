"""What a refactor must not change, recorded before it and checked after it: the first 3 training losses of every
preset and combination of options on the built-in tiny model and data, and evaluate.py's outputs on (preset, task)
pairs read from those runs' checkpoints.

    python tests/regress.py --write tests/regress.json    # before the change (commit the record)
    python tests/regress.py --check tests/regress.json    # after it: every difference, exit 1 on any

Not part of the suite (a few minutes on a 2-core CPU): a refactor's own check. Numbers are compared exactly, on the
machine and torch build that wrote them (the CPU, one thread); timings and paths are left out. Besides the losses, each
training run records the settings it resolved (its args.json without paths): where a default comes from may move,
what it is may not. Two kinds of runs take their defaults from train.py itself rather than from BASE: `--model tiny`'s
demo defaults (each preset, no flag but --steps), and each preset's paper recipe, pinned (the tiny model saved as a
local folder, so that it is not `tiny` and gets the paper's settings; --batch-size 2 --max-len 24 keep it cheap).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import presets as P  # noqa: E402
import evaluate as E  # noqa: E402
import runlog  # noqa: E402
import train  # noqa: E402
from hf import byte_tokenizer  # noqa: E402
from model import TINY_CONFIG, build_tiny  # noqa: E402

BASE = ["--model", "tiny", "--steps", "3", "--batch-size", "2", "--lr", "1e-3", "--warmup", "1", "--mem", "4",
        "--chunk-len", "16", "--max-len", "24", "--lora-r", "4", "--lora-alpha", "8",
        "--eval-every", "0", "--device", "cpu"]
MEM_TOKENS = ("icae", "500x", "pcc", "pic", "aoc")   # presets with memory tokens: the layouts apply to them
# (name, method, extra flags): every preset under every objective, then each option once on a preset it changes
ARMS = [(f"{m}_{o}", m, ["--objective", o]) for m in P.METHODS for o in ("pretrain", "ae", "qa", "distill")]
ARMS += [(f"{m}_{lay}", m, ["--objective", "pretrain", "--layout", lay]) for m in MEM_TOKENS for lay in ("upl", "epl")]
ARMS += [
    ("icae_pic_mask", "icae", ["--objective", "ae", "--mask", "pic"]),
    ("icae_kv", "icae", ["--objective", "ae", "--carrier", "kv"]),
    ("icae_mem_norm", "icae", ["--objective", "ae", "--mem-norm"]),
    ("icae_cap_mem", "icae", ["--objective", "ae", "--cap-mem", "--mem", "12"]),
    ("icae_ratio", "icae", ["--objective", "ae", "--ratio", "4"]),
    ("icae_sentences", "icae", ["--objective", "ae", "--chunking", "sentences"]),
    ("icae_delimiters", "icae", ["--objective", "pretrain", "--delimiters"]),
    ("icae_ae_bos", "icae", ["--objective", "ae", "--ae-token", "bos"]),
    ("icae_ae_none", "icae", ["--objective", "ae", "--ae-token", "none", "--no-bos"]),
    ("icae_lm_last", "icae", ["--objective", "pretrain", "--lm-token", "last"]),
    ("icae_lm_none", "icae", ["--objective", "pretrain", "--lm-token", "none"]),
    ("icae_init_normal", "icae", ["--objective", "ae", "--mem-init", "normal"]),
    ("icae_init_hf", "icae", ["--objective", "ae", "--mem-init", "hf"]),
    ("icae_targets", "icae", ["--objective", "ae", "--lora-targets", "q_proj", "k_proj", "v_proj", "o_proj",
                              "--lora-dropout", "0.1"]),
    ("icae_full", "icae", ["--objective", "ae", "--encoder", "full"]),
    ("icae_mlp_none", "icae", ["--objective", "ae", "--mlp", "none"]),
    ("icae_bridge_mlp", "icae", ["--objective", "ae", "--bridge", "mlp"]),
    ("icae_bridge_linear", "icae", ["--objective", "ae", "--bridge", "linear"]),
    ("icae_bridge_lsa", "icae", ["--objective", "ae", "--bridge", "lsa"]),
    ("icae_first_k", "icae", ["--objective", "ae", "--encoder", "first_k", "--enc-layers", "1"]),
    ("icae_template_chat", "icae", ["--objective", "qa", "--template", "chat"]),
    ("icae_template_pcc", "icae", ["--objective", "qa", "--template", "pcc"]),
    ("icae_mem_lr", "icae", ["--objective", "ae", "--mem-lr", "1e-2"]),
    ("icae_own_other", "icae", ["--objective", "ae", "--own-other-weight", "0.5"]),
    ("icae_mem_from_text", "icae", ["--objective", "ae", "--mem-from-text"]),
    ("icae_curriculum", "icae", ["--objective", "ae", "--len-curriculum", "8", "2", "--crop", "window",
                                 "--min-len", "8"]),
    ("icae_micro", "icae", ["--objective", "ae", "--micro-batch", "1"]),
    ("icae_window", "icae", ["--objective", "pretrain", "--crop", "window", "--schedule", "cosine", "--min-len", "8"]),
    ("pcc_frozen_specials", "pcc", ["--objective", "pretrain", "--no-train-specials"]),
    ("500x_mlp_aoc", "500x", ["--objective", "ae", "--mlp", "aoc"]),
    ("aoc_mlp_none", "aoc", ["--objective", "ae", "--mlp", "none"]),
    ("aoc_lora", "aoc", ["--objective", "ae", "--encoder", "lora"]),
    ("gmsa_ratios", "gmsa", ["--objective", "ae", "--ratios", "2", "3"]),
    ("compllm_fixed", "compllm", ["--objective", "ae", "--chunking", "fixed"]),
]
ARMS = [(name, method, BASE + flags) for name, method, flags in ARMS]
# defaults from train.py, not BASE: --model tiny's demo, and each preset's paper recipe on a local copy of tiny
# (PAPER_MODEL: not "tiny", so the paper's row applies; batch and length pinned so that 3 steps stay cheap)
DEMO = ["--model", "tiny", "--steps", "3", "--eval-every", "0", "--device", "cpu"]
PAPER = ["--steps", "3", "--batch-size", "2", "--max-len", "24", "--eval-every", "0", "--device", "cpu"]
ARMS += [(f"{m}_tiny_demo", m, DEMO) for m in P.METHODS]
ARMS += [(f"{m}_paper", m, ["--model", "PAPER_MODEL", *PAPER]) for m in P.METHODS]
ARMS += [("icae_paper_chunk", "icae", ["--model", "PAPER_MODEL", *PAPER[:4], "--chunk-len", "255", *PAPER[6:]])]
SETTINGS_DROP = {"out", "model", "decoder", "data", "init", "warm_start", "resume", "cache_dir", "device"}
# evaluate.py on (preset, task): ae and lm from each preset's pretrain run, qa from its qa run; needle, interpolate
# and heatmap on a few
EVALS = [(f"{m}_pretrain", t, []) for m in P.METHODS for t in ("ae", "lm")]
EVALS += [(f"{m}_qa", "qa", []) for m in P.METHODS]
EVALS += [("500x_ae", "needle", ["--lengths", "160", "--n", "1"]), ("aoc_ae", "interpolate", []),
          ("icae_ae", "heatmap", []), ("icae_ae", "ae", ["--ratio", "2"]), ("compllm_qa", "qa", ["--concat", "2", "--no-reuse"])]
DROP = {"seconds", "checkpoint", "device", "accelerator", "s_per_step", "wall_s", "model", "out", "png", "figure"}


def clean(x):
    """The JSON result without timings, paths and anything else that differs run to run."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items() if k not in DROP and "time" not in k and "seconds" not in k
                and not k.endswith("png")}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def tiny_folder(path):
    """The tiny model as a Hugging Face folder: the same weights and tokenizer, under a name that is not "tiny"."""
    model, _ = build_tiny()
    os.makedirs(path, exist_ok=True)
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},   # tied
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
    return path


def record(root):
    out = {"train": {}, "settings": {}, "evaluate": {}}
    paper_model = tiny_folder(os.path.join(root, "tiny_hf"))
    for name, method, flags in ARMS:
        run = os.path.join(root, name)
        torch.manual_seed(0)
        flags = [paper_model if f == "PAPER_MODEL" else f for f in flags]
        train.main(["--method", method, *flags, "--out", run])
        rows, _ = runlog.read_log(run)
        out["train"][name] = [r["loss"] for r in rows]
        with open(os.path.join(run, "args.json")) as f:
            out["settings"][name] = {k: v for k, v in json.load(f).items() if k not in SETTINGS_DROP}
        print(name, out["train"][name], flush=True)
    for name, task, flags in EVALS:
        res = E.main(["--ckpt", os.path.join(root, name), "--task", task, "--n", "3", "--max-new-tokens", "4",
                      "--device", "cpu", *flags, "--out", os.path.join(root, f"eval_{name}_{task}.json")])
        out["evaluate"][f"{name} {task} {' '.join(flags)}".strip()] = json.loads(json.dumps(clean(res)))
    return out


def diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in (diff(a.get(k), b.get(k), f"{path}/{k}")
                                                             if k in a and k in b else [f"{path}/{k}: only one side"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="JSON", help="record today's numbers")
    g.add_argument("--check", metavar="JSON", help="compare today's numbers with a record")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="regress-")
    try:
        got = record(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.write:
        with open(a.write, "w") as f:
            json.dump(got, f, indent=1)
        print(f"wrote {a.write}: {len(got['train'])} training runs, {len(got['evaluate'])} evaluations")
        return
    diffs = diff(json.load(open(a.check)), got)
    print("\n".join(diffs) or f"identical: {len(got['train'])} training runs, {len(got['evaluate'])} evaluations")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
