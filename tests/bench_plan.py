"""Benchmark (not a test): the memory plan (plan.py, train.py --plan) against the measured peak of the same run.

    python tests/bench_plan.py                                  # CPU: a random 4-layer model, fp32
    python tests/bench_plan.py --device cuda --shape llama-3.2-1b --methods aoc icae pcc    # on a GPU
    python tests/bench_plan.py --papers      # tests/README.md's table: every preset at its papers' model, planned

Each run is train.py for 2 steps in its own process. Measured: the peak during the steps minus the memory held
before the first one (the weights; the corpus), i.e. gradients + AdamW states + activations; on the CPU the peak
RSS (ru_maxrss, over a baseline taken just before step 1), on CUDA torch.cuda.max_memory_allocated. Planned: the
plan's gradients + AdamW + activations. "act ratio" = (measured - gradients - AdamW) / the counted saved tensors:
what plan.OVERHEAD is set from.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
import train
argv, cuda = json.loads(sys.argv[2]), torch.cuda.is_available() and "cpu" not in sys.argv[2]
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base, step = {}, train.train_step
def first(*a, **kw):   # the memory held just before step 1: weights, corpus, interpreter
    if not base:
        if cuda:
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base["bytes"] = torch.cuda.memory_allocated() if cuda else rss()
    return step(*a, **kw)
train.train_step = first
train.main(argv)
peak = torch.cuda.max_memory_allocated() if cuda else rss()
print("DELTA", peak - base["bytes"])
"""


def measure(argv):
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run([sys.executable, "-c", CHILD, REPO, json.dumps(argv + ["--out", out])], cwd=REPO,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        return int(next(line.split()[1] for line in p.stdout.splitlines() if line.startswith("DELTA")))


def random_checkpoint(folder, config):
    """A model folder (config.json, model.safetensors in bf16, the byte tokenizer) of random weights: train.py loads it
    like a real checkpoint, with no download and no transformers."""
    import torch
    from safetensors.torch import save_file
    from model import ModelConfig, Transformer, byte_tokenizer
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(config)).to(torch.bfloat16)
    state = {k: v for k, v in model.state_dict().items() if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}, f)
    byte_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    return folder


# every preset at its papers' models and batch (tests/README.md's table): (preset, shape, batch, source)
PAPERS = [
    ("icae", "llama-3.2-1b", 16, "EPL's code (App. C)"), ("icae", "llama-2-7b", 16, "ICAE (Llama-2-7B)"),
    ("500x", "llama-3.2-1b", 16, "EPL's code"), ("500x", "llama-3-8b", 16, "500xCompressor (Llama-3-8B)"),
    ("pcc", "llama-3-8b", 256, "PCC code, 8B compressor + 8B decoder"),
    ("pic", "llama-3-8b", 256, "PIC §4.1.2 decoder (compressor as large)"),
    ("compllm", "qwen3-4b", 4, "CompLLM"), ("compllm", "gemma-3-4b", 4, "CompLLM"),
    ("gmsa", "llama-2-7b", 4, "GMSA (LLaMA-2-7B)"), ("aoc", "llama-3.2-1b", 16, "AOC (Llama-3.2-1B)"),
]
PAPER_HEADER = ("| preset | model | batch | trained params | weights+grads+AdamW GB | activations GB | total GB | fits "
                "80 GB | with --grad-ckpt GB | fits | largest micro-batch that fits (ckpt) | GPUs under --fsdp "
                "(micro-batch 1, ckpt) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def paper_row(method, shape, batch, source, frozen="auto") -> str:
    """One row of the table, every number a direct plan (train.py --plan): the batch as one micro-batch, without and
    with --grad-ckpt; the largest micro-batch that fits with --grad-ckpt (a bisection over direct plans); the fewest
    GPUs (1, 2, 4, ... 64) over which --fsdp fits micro-batch 1 with --grad-ckpt."""
    sys.path.insert(0, REPO)
    import cli
    import plan
    import train
    argv = ["--method", method, "--shape", shape, "--plan", "--batch-size", str(batch), "--frozen-dtype", frozen]
    def at(*extra):
        s = cli.parse_args(argv + list(extra))
        return plan.make_plan(s.config, cli.planned(s), lambda comp: train.TrainStep(comp, s.objective, s.lm_weight),
                              s.shape)
    whole, ckpt = at(), at("--grad-ckpt")
    fixed = whole.weights + whole.grads + whole.optimizer
    trained = sum(n for (kind, _), n in whole.params.items() if kind == "trained")
    lo, hi = 0, batch   # the largest micro-batch m <= batch whose plan fits
    while lo < hi:
        m = (lo + hi + 1) // 2
        lo, hi = (m, hi) if at("--grad-ckpt", "--micro-batch", str(m)).fits else (lo, m - 1)
    gpus = next((str(n) for n in (1, 2, 4, 8, 16, 32, 64)
                 if at("--grad-ckpt", "--fsdp", "--gpus", str(n), "--micro-batch", "1").fits), "> 64")
    gb = lambda b: f"{b / plan.GB:.1f}"
    return (f"| {method} | {shape} ({source}) | {batch} | {trained / 1e9:.2f}B | {gb(fixed)} | {gb(whole.activations)} | "
            f"{gb(whole.total)} | {'yes' if whole.fits else 'no'} | {gb(ckpt.total)} | {'yes' if ckpt.fits else 'no'} | "
            f"{lo or 'none'} | {gpus} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--papers", action="store_true", help="instead: tests/README.md's table, every preset at its "
                   "papers' model and batch, from direct plans (no GPU, nothing allocated)")
    p.add_argument("--methods", nargs="+", default=["aoc", "icae", "pcc", "gmsa"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", help="a model.SHAPES entry (random weights; CUDA) instead of the small random model")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--grad-ckpt", action="store_true")
    a = p.parse_args()
    if a.papers:
        print(PAPER_HEADER)
        for row in PAPERS:
            print(paper_row(*row), flush=True)
        return
    sys.path.insert(0, REPO)
    import cli
    import plan
    import train
    with tempfile.TemporaryDirectory() as tmp:
        if a.shape:
            from model import SHAPES
            config = dict(SHAPES[a.shape])
        else:   # small enough to step in seconds on 2 cores, big enough that activations dwarf the RSS noise
            config = dict(model_type="llama", vocab_size=8000, hidden_size=256, intermediate_size=704,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
                          pad_token_id=258)
        folder = random_checkpoint(os.path.join(tmp, "model"), config)
        doc = os.path.join(tmp, "doc.jsonl")
        with open(doc, "w") as f:   # byte-level ids: a text of max_len characters is max_len tokens
            for i in range(64):
                f.write(json.dumps({"text": (f"document {i} " + "some words to compress " * 200)}) + "\n")
        print("| method | device | batch x \\|X\\| | grad-ckpt | planned GiB | measured GiB | ratio | act ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for method in a.methods:
            argv = ["--method", method, "--model", folder, "--data", doc, "--steps", "2", "--warmup", "0",
                    "--batch-size", str(a.batch_size), "--crop", "window", "--min-len", str(a.max_len), "--max-len",
                    str(a.max_len), "--objective", "ae" if method in ("aoc", "gmsa") else "pretrain",
                    "--device", a.device, "--eval-every", "0", "--save-every", "1000"] + \
                (["--grad-ckpt"] if a.grad_ckpt else [])
            s = cli.parse_args(argv + ["--plan", "--out", tmp])
            pl = plan.make_plan(s.config, cli.planned(s), lambda comp: train.TrainStep(comp, s.objective,
                                                                                       s.lm_weight))
            counted = pl.activations / plan.OVERHEAD
            got = measure(argv)
            planned = pl.grads + pl.optimizer + pl.activations
            print(f"| {method} | {a.device} | {a.batch_size} x {a.max_len} | {a.grad_ckpt} | {planned / 2**30:.3f} | "
                  f"{got / 2**30:.3f} | {got / planned:.2f} | {(got - pl.grads - pl.optimizer) / counted:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
