"""Benchmark (not a test): training throughput of our Transformer vs transformers' LlamaForCausalLM.

Same random weights, same batch, fp32 on CPU, forward + backward of a next-token loss. Runs alternate between
the two models so that machine noise hits both alike; the median step time of each is reported.

    python tests/bench_model.py [--steps 10] [--batch 4] [--seq 256]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model import load_pretrained  # noqa: E402

CONFIG = dict(  # "tiny-ish": large enough that the matmuls, not Python overhead, dominate both
    model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=False)


def step(model, ids):
    """One forward + backward of the next-token loss; returns seconds."""
    t0 = time.perf_counter()
    logits = model(ids).logits  # (B, T, V) for both models
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()

    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG),
                                                       attn_implementation="sdpa")  # HF's fastest CPU path
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        from hf import byte_tokenizer
        byte_tokenizer().save(str(Path(d) / "tokenizer.json"))
        ours, _ = load_pretrained(d)  # identical weights
    hf.train(), ours.train()
    ids = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq))

    times = {"ours": [], "transformers": []}
    for i in range(args.steps + 2):  # the first two rounds warm up allocators and kernels
        for name, model in (("ours", ours), ("transformers", hf)):
            t = step(model, ids)
            if i >= 2:
                times[name].append(t)
    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"config: d={CONFIG['hidden_size']} L={CONFIG['num_hidden_layers']} H={CONFIG['num_attention_heads']} "
          f"Hkv={CONFIG['num_key_value_heads']} V={CONFIG['vocab_size']}; batch {args.batch} x {args.seq} tokens, "
          f"fp32, {torch.get_num_threads()} threads, forward+backward")
    print(f"{'ours':>14}: {tps['ours']:9.0f} tok/s")
    print(f"{'transformers':>14}: {tps['transformers']:9.0f} tok/s   (transformers {transformers.__version__})")
    print(f"{'ratio':>14}: {tps['ours'] / tps['transformers']:9.2f}x  (ours / transformers)")


if __name__ == "__main__":
    main()
