"""Benchmark (not a test): peak memory and step time of one training configuration, with and without the memory
savers: activation checkpointing per block (--grad-ckpt) and the chunked cross-entropy (model.chunked_cross_entropy,
always on in train.py; "off" here swaps in the plain one-shot loss for comparison).

    python tests/bench_memory.py --model HuggingFaceTB/SmolLM2-135M-Instruct     # AOC at n = 480, batch 16
    python tests/bench_memory.py --model tiny --steps 3 -- --method icae          # any train.py flags after --

Each variant runs in its own process (peak RSS, or peak CUDA memory on a GPU, is per process) for a few steps of
train.py and reports the peak and the median step time. Default: AOC with 4 memory tokens, batch 16, texts of
480 tokens (AOC's longest prompt length), the configuration that peaked at 17 GB before.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
import compressors, train, torch.nn.functional as F
if sys.argv[2] == "plain-ce":   # the one-shot loss: fp32 logits of every supervised position at once
    compressors.chunked_cross_entropy = lambda h, head, t: F.cross_entropy(head(h).float(), t, reduction="sum")
train.main(json.loads(sys.argv[3]))
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("PEAK", peak)
"""


def run(variant, argv):
    with tempfile.TemporaryDirectory() as out:
        args = argv + ["--out", out] + (["--grad-ckpt"] if "ckpt" in variant else [])
        p = subprocess.run([sys.executable, "-c", CHILD, REPO, "plain-ce" if "plain" in variant else "chunked",
                            json.dumps(args)], capture_output=True, text=True, cwd=REPO)
        if p.returncode != 0:
            return variant, None, None, p.stderr.strip().splitlines()[-1]
        peak = int(next(line.split()[1] for line in p.stdout.splitlines() if line.startswith("PEAK")))
        rows = [r for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "eval" not in r]
        dt = statistics.median(r["dt"] for r in rows[1:] or rows)
        return variant, peak, dt, ""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("rest", nargs="*", help="train.py flags (after --) replacing the default AOC configuration")
    a = p.parse_args()
    argv = a.rest or ["--method", "aoc", "--mem", "4", "--batch-size", "16", "--crop", "head", "--max-len", "480"]
    argv = argv + ["--model", a.model, "--steps", str(a.steps), "--warmup", "0", "--save-every", "100000"]
    print(f"python train.py {' '.join(argv)}\n")
    print("| variant | peak memory GB | median step s |")
    print("|---|---|---|")
    for variant in ("plain CE", "chunked CE", "chunked CE + grad-ckpt"):
        name, peak, dt, err = run(variant, argv)
        print(f"| {name} | {peak / 2**30:.2f} | {dt:.2f} |" if peak else f"| {name} | failed: {err} | |", flush=True)


if __name__ == "__main__":
    main()
