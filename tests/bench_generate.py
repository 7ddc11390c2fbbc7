"""Benchmark (not a test): greedy generation speed of model.py against model.py at another git revision.

    python tests/bench_generate.py --against fa69924 [--batch 8] [--prompt 64] [--new 128] [--rounds 5]

A random model of SmolLM2-135M's shape (d 576, 30 layers, 9 query heads on 3 K/V heads, vocabulary 49152), fp32,
the same weights in both versions (built from one seed). Each round runs `generate` once per version on a left-padded
batch (prompts of --prompt down to half of it: a one-row mask on every step) and on an unpadded one (all --prompt
long); the versions alternate within each round so that machine load hits both alike, and the medians over rounds are
printed: tokens/s of the whole call (prefill included), ms per decoding step (the median forward after the prefill)
and the median over rounds of each round's before/after step-time ratio.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import masks  # noqa: E402
import model as M  # noqa: E402

SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M's config.json, the shape only
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True)


def model_at(rev: str):
    """model.py as it is at git revision `rev`, imported as its own module (the files it imports are today's)."""
    src = subprocess.run(["git", "show", f"{rev}:model.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    spec = importlib.util.spec_from_loader(f"model_at_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up here
    exec(compile(src.stdout, f"{rev}:model.py", "exec"), module.__dict__)
    return module


def timed_generate(model, ids, mask, new):
    """-> (tokens, seconds of the whole call, seconds of each decoding step's forward)."""
    steps, forward = [], model.forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        steps.append(time.perf_counter() - t0)
        return out
    model.forward = timed   # an instance attribute: generate's self(...) calls it
    try:
        t0 = time.perf_counter()
        out = model.generate(ids, attn_mask=mask, max_new_tokens=new)
        total = time.perf_counter() - t0
    finally:
        del model.forward
    return out, total, steps[1:]   # steps[0] is the prefill


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the git revision whose model.py is 'before'")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    before = model_at(a.against)
    models = {}
    for name, module in (("before", before), ("after", M)):
        torch.manual_seed(0)   # the same init in both: their constructors are the same code
        models[name] = module.Transformer(module.ModelConfig.from_hf(SMOLLM2_135M)).eval()
    B, T = a.batch, a.prompt
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
    lengths = torch.linspace(T, T // 2, B).round().long()                    # left padding: row b keeps its last n
    valid = torch.arange(T)[None] >= T - lengths[:, None]                    # (B, T)
    cases = {"padded": masks.with_padding(masks.causal(T), valid), "unpadded": None}
    seen = {}   # (case, version) -> [(tokens/s, ms per step)]
    for r in range(a.rounds + 1):   # round 0 warms up allocators and kernels
        for case, mask in cases.items():
            for name in (("before", "after") if r % 2 else ("after", "before")):
                out, total, steps = timed_generate(models[name], ids, mask, a.new)
                seen.setdefault((case, "tokens"), {})[name] = out
                if r:
                    seen.setdefault((case, name), []).append((B * a.new / total, 1e3 * statistics.median(steps)))
    print(f"random SmolLM2-135M shape, fp32, {torch.get_num_threads()} threads, batch {B}, prompt {T} "
          f"(padded: {int(lengths.min())}..{T} real), {a.new} new tokens, median of {a.rounds} rounds; "
          f"before = model.py at {a.against}\n")
    print("| batch | before tok/s | after tok/s | before ms/step | after ms/step | step speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        tps, ms = ({v: statistics.median(x[i] for x in seen[(case, v)]) for v in ("before", "after")} for i in (0, 1))
        # the median of each round's own ratio: the two calls of a round ran back to back, under the same load
        ratio = statistics.median(b[1] / f[1] for b, f in zip(seen[(case, "before")], seen[(case, "after")]))
        same = torch.equal(seen[(case, "tokens")]["before"], seen[(case, "tokens")]["after"])
        print(f"| {case} | {tps['before']:.1f} | {tps['after']:.1f} | {ms['before']:.1f} | {ms['after']:.1f} | "
              f"{ratio:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
