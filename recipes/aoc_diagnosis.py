"""Why AOC's encoder learns so slowly at small scale: what the frozen decoder sees of each encoder's memory
before any training (used by recipes/aoc.sh; a minute on CPU).

    python recipes/aoc_diagnosis.py [--model DIR] [--data runs/corpus/heldout.jsonl] [--n 16] [--texts 8]

For m = n memory tokens over held-out texts cut to n tokens, three encoders at initialisation:

    aoc         the LLM without MLPs (AOC Eq. 3), the preset
    aoc + MLPs  the same fully trained copy with its MLPs kept (--method aoc --mlp swiglu)
    500x        LoRA on the LLM itself (AOC's baseline; LoRA starts at zero, so this is the LLM)

and reports, per decoder layer group: the share of the frozen decoder's attention that goes to the memory slots
when it regenerates the texts (AOC Eq. 4: [memory K/V, BOS, text]); how much the memory keys differ from one
text to another (std over texts / mean |k|); and the AE loss with that memory, and with none.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import compressors as C  # noqa: E402
from model import apply_rope, load_pretrained  # noqa: E402

ENCODERS = {"aoc": ("aoc", {}), "aoc + MLPs": ("aoc", dict(mlp="swiglu")),
            "500x": ("500x", dict(ae_token="bos", mem_init="normal", bos=False, lora_r=8, lora_alpha=16))}


def memory_attention(comp, memory, batch):
    """Share of each decoder layer's attention (mean over queries, heads, texts) that lands on the memory slots,
    recomputed from every layer's own inputs (captured with a forward pre-hook on its self_attn)."""
    calls = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: calls.append((m, *a[:3])))
             for layer in comp.decoder.model.layers]
    with comp.decoding():
        comp.decoder(**batch, compute_logits=False)
    for h in hooks:
        h.remove()
    shares = []
    for i, (attn, x, cos, sin) in enumerate(calls):
        B, T, _ = x.shape
        q = apply_rope(attn.q_proj(x).view(B, T, attn.n_head, attn.head_dim).transpose(1, 2), cos, sin)   # (B, H, T, D)
        k_own = apply_rope(attn.k_proj(x).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2), cos, sin)
        k = torch.cat([memory.kv[i][0], k_own], dim=2).repeat_interleave(attn.n_head // attn.n_kv_head, 1)
        M = memory.kv[i][0].shape[2]
        allowed = torch.ones(T, M + T, dtype=torch.bool)
        allowed[:, M:] = torch.ones(T, T, dtype=torch.bool).tril()            # prefix + causal
        p = ((q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)).masked_fill(~allowed, float("-inf")).softmax(-1)
        shares.append(p[..., :M].sum(-1).mean().item())
    return shares


@torch.no_grad()
def diagnose(name, model, texts, n):
    method, overrides = ENCODERS[name]
    torch.manual_seed(0)
    decoder, tok = load_pretrained(model)
    comp = C.build(method, decoder, tok, mem=n, chunk_len=n, **overrides).eval()
    xs = [tok.encode(t)[:n] for t in texts]
    xs = [x + [tok.pad_id] * (n - len(x)) for x in xs]
    memory = comp.compress(xs)
    follow = [comp.ae_target(x) for x in xs]
    batch = comp.decoder_batch(memory, "ae", follow)
    batch.pop("targets")
    shares = memory_attention(comp, memory, batch)
    spread = [(k.std(0).mean() / k.abs().mean()).item() for k, _ in memory.kv]
    own, count = comp.nll(memory, "ae", follow)
    ids = torch.tensor([[tok.bos_id] + f for f in follow])
    with comp.decoding():
        logits = decoder(ids).logits[:, :-1]                                   # (B, T, V): the LLM from [BOS] alone
    none = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    return dict(encoder=name, attention_on_memory=shares, key_spread=spread, ae_loss=sum(own) / sum(count),
                ae_loss_no_memory=none.item() / ids[:, 1:].numel())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/ctxcomp/smollm2-135m"))
    p.add_argument("--data", default="runs/corpus/heldout.jsonl")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--out", help="JSON file for the numbers")
    a = p.parse_args(argv)
    texts = [json.loads(line)["text"] for line in open(a.data)][:a.texts]
    rows = [diagnose(name, a.model, texts, a.n) for name in ENCODERS]
    L = len(rows[0]["attention_on_memory"])
    groups = [range(g * L // 5, (g + 1) * L // 5) for g in range(5)]
    mean = lambda xs, g: sum(xs[i] for i in g) / len(g)
    head = " / ".join(f"{g.start}-{g.stop - 1}" for g in groups)
    print(f"m = n = {a.n}, {len(texts)} held-out texts, before any training\n")
    print(f"| encoder | decoder attention on the memory (layers {head}) | key spread across texts (same layers) | "
          "AE loss with memory | no memory |")
    print("|---|" + "---|" * 4)
    for r in rows:
        att = " / ".join(f"{mean(r['attention_on_memory'], g):.2f}" for g in groups)
        spr = " / ".join(f"{mean(r['key_spread'], g):.2f}" for g in groups)
        print(f"| {r['encoder']} | {att} | {spr} | {r['ae_loss']:.2f} | {r['ae_loss_no_memory']:.2f} |")
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
