"""Benchmark (not a test): training throughput of train.py for every method, as a markdown table.

Each method runs its default objective and recipe on `tiny` (as the quickstart does: the paper's lengths and
batch scaled for the tiny model) for a few steps; the median over the steps after the first two is reported.
tok/s counts every token a step reads: the compressed contexts plus every decoder sequence (train.py's log).
Runs on CPU, and on CUDA too when a GPU is present.

    python tests/bench_train.py [--steps 12] [--methods aoc icae ...] [--model tiny]
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compressors as C  # noqa: E402
import train  # noqa: E402


def bench(method, device, steps, model):
    """One short run in a temporary directory -> (args, median seconds per step, median tokens per step)."""
    with tempfile.TemporaryDirectory() as out:
        argv = ["--method", method, "--model", model, "--steps", str(steps), "--out", out, "--device", device,
                "--save-every", str(10 * steps)]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train.main(argv)
        rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))][2:]   # skip warm-up steps
        args = json.load(open(os.path.join(out, "args.json")))
    return args, statistics.median(r["dt"] for r in rows), statistics.median(r["tokens"] for r in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--methods", nargs="+", default=list(C.METHODS), choices=C.METHODS)
    p.add_argument("--model", default="tiny")
    a = p.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    print("\n| method | objective | device | batch | \\|X\\| | ms/step | tokens/step | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for method in a.methods:
        for device in devices:
            args, dt, tokens = bench(method, device, a.steps, a.model)
            print(f"| {method} | {args['objective']} | {device} | {args['batch_size']} | "
                  f"{args['min_len']}-{args['max_len']} | {dt * 1000:.0f} | {tokens:.0f} | {tokens / dt:,.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
