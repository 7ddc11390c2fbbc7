"""Benchmark (not a test): evaluation throughput, batched (--batch-size) against one example at a time.

    python tests/bench_eval.py --ckpt runs/aoc [--data runs/corpus/heldout.jsonl] [--n 32] [--task ae]
    python tests/bench_eval.py --method aoc --model tiny                      # an untrained preset

Runs the ae (or qa) task of evaluate.py over the same examples at each batch size and prints examples/s; the
outputs are checked to be identical across batch sizes (tests/test_evaluate.py proves it on tiny).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import compressors as C  # noqa: E402
import evaluate as E  # noqa: E402
from model import load_pretrained  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt")
    p.add_argument("--method", default="aoc")
    p.add_argument("--model", default="tiny")
    p.add_argument("--task", choices=("ae", "qa"), default="ae")
    p.add_argument("--data")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    if a.ckpt:
        comp = checkpoint.load(a.ckpt, device=a.device).eval()
    else:
        comp = C.build(a.method, *load_pretrained(a.model, device=a.device)).eval()
    examples = E.load_examples(a.data, a.task, a.n)
    run = E.run_ae if a.task == "ae" else E.run_qa
    print(f"{comp.cfg.method} on {comp.cfg.model}, {a.task}, {len(examples)} examples, {a.max_new_tokens} new tokens, "
          f"{a.device}, {torch.get_num_threads()} threads\n")
    print("| batch size | seconds | examples/s | speedup |")
    print("|---|---|---|---|")
    base, first = None, None
    for bs in map(int, a.batch_sizes.split(",")):
        t0 = time.perf_counter()
        out = run(comp, examples, max_new_tokens=a.max_new_tokens, batch_size=bs)
        dt = time.perf_counter() - t0
        texts = [ex["compressed"]["text"] for ex in out["examples"]]
        first = first or texts
        base = base or dt
        same = "" if texts == first else " (outputs differ!)"
        print(f"| {bs} | {dt:.1f} | {len(examples) / dt:.2f} | {base / dt:.1f}x{same} |", flush=True)


if __name__ == "__main__":
    main()
