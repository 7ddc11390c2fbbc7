"""What the frozen decoder sees of a compressor's memory, for any preset and carrier, at initialisation and after
training: why an arm's memory does or does not carry its text (used by recipes/ladder.sh and recipes/aoc.sh).

    python recipes/diagnosis.py --runs runs/recipes/ladder/icae_1x runs/recipes/ladder/aoc_1x \
        [--data runs/corpus/heldout.jsonl] [--texts 8] [--len N] [--out runs/recipes/ladder/diagnosis]

For each run, its compressor as train.py built it before step 1 (same config and seed, untrained) and as trained
(its newest checkpoint), on held-out texts of exactly the run's --max-len tokens (or --len). The decoder regenerates each text
from its memory (the AE task, as trained) and we measure, per decoder layer:

    norm       memory / text: the mean norm of the memory's keys over the mean norm of the text's keys in the same
               layer; for an embedding carrier also the memory vectors over the text's token embeddings (what
               layer 0 reads). Far above 1: the memory sits outside the range the frozen decoder was trained on
    attention  the share of the decoder's attention (mean over the queries after the memory, heads and texts) that
               lands on the memory slots
    spread     how much the memory's keys differ from one text to another: std over texts / mean |k|. A memory
               that is the same for every text (a learned constant prompt) has spread 0
    losses     the AE loss per token with the own memory, another text's memory, no memory, and own / other;
               the own memory's loss also on the text's first token alone and on the rest (a memory that carries
               all but its first token, as GMSA's at 1:1, shows a high first and a low rest)

Writes OUT.json and OUT.md (one row per run and state, layers in five groups).

    python recipes/diagnosis.py --capacity 300 --runs runs/recipes/ladder/icae_1x ...

--capacity STEPS asks what the carrier *could* hold, whatever the encoder learns (ours): each text's memory, as the
run's compressor makes it at init, becomes a free tensor (the embeddings, or every layer's K/V) optimized alone with Adam
for STEPS steps to regenerate its own text through the frozen decoder, exactly as the AE loss trains (same
positions, special token and template). A carrier that reaches a low loss this way can hold the text, so an encoder
that ends as a constant prompt failed to learn, not to fit; one that cannot tells that no encoder could.
"""

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import compressors as C  # noqa: E402
import evaluate as E  # noqa: E402
from curve import kept  # noqa: E402
from records import portable  # noqa: E402
from model import apply_rope  # noqa: E402


def attention_calls(comp, batch):
    """Run the decoder on one batch; each layer's attention module and the arguments it was called with."""
    calls = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args, kw: calls.append((m, args, kw)),
                                                       with_kwargs=True) for layer in comp.decoder.model.layers]
    try:
        with comp.decoding():
            comp.decoder(**batch, compute_logits=False)
    finally:
        for h in hooks:
            h.remove()
    return calls


def memory_slots(memory, batch):
    """(B, S) bool over the keys of the decoder's attention: which are memory slots. K/V carrier: the valid prefix
    slots. Embedding carrier: the inputs that hold a memory vector (found by value: they are copies of it)."""
    x = batch["inputs_embeds"]
    if memory.kv is not None:
        return torch.cat([memory.valid, torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)], 1)
    return torch.stack([(x[b][:, None] == memory.embeds[b][memory.valid[b]][None]).all(-1).any(-1)
                        for b in range(x.shape[0])])


def keys_and_attention(m, args, kw):
    """Recompute one layer's keys (B, Hkv, S, D) and attention probabilities (B, H, T, S) from its inputs,
    exactly as model.Attention.forward computes them."""
    x, cos, sin, mask = args[:4]
    past = args[4] if len(args) > 4 else kw.get("past")
    B, T, _ = x.shape
    q = m.q_proj(x).view(B, T, m.n_head, m.head_dim)
    k = m.k_proj(x).view(B, T, m.n_kv_head, m.head_dim)
    if m.qk_norm:
        q, k = m.q_norm(q), m.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    if past is not None:
        k = torch.cat([past[0], k], dim=2)
    S = k.shape[2]
    if mask is None:   # the model's default: every prefix slot, then causal
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
    scores = q.float() @ k.float().repeat_interleave(m.n_head // m.n_kv_head, 1).transpose(-1, -2)
    return k.float(), (scores / m.head_dim ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)


@torch.no_grad()
def measure(comp, xs):
    """Per decoder layer: memory/text key norm, attention on the memory, key spread across texts; the memory's
    input-embedding norm ratio (embedding carrier); the AE losses."""
    memory = comp.compress([comp.encoder_ids(x) for x in xs])
    follow = [comp.ae_target(x) for x in xs]
    batch = comp.decoder_batch(memory, "ae", follow)
    x = batch["inputs_embeds"]
    B, T = x.shape[:2]
    is_mem = memory_slots(memory, batch)                                            # (B, S)
    P = is_mem.shape[1] - T
    real = torch.cat([torch.ones(B, P, dtype=torch.bool, device=x.device), x.abs().sum(-1) > 0], 1)  # not padding
    after = torch.arange(P + T, device=x.device)[None] > torch.where(
        is_mem, torch.arange(P + T, device=x.device)[None], -1).max(1, keepdim=True).values
    queries = (real & after)[:, P:]                                                 # (B, T): after the memory
    layers = []
    for m, args, kw in attention_calls(comp, batch):
        k, p = keys_and_attention(m, args, kw)
        k = k.transpose(1, 2)                                                       # (B, S, Hkv, D)
        share = (p * is_mem[:, None, None]).sum(-1).mean(1)[queries].mean().item()   # (B, H, T) -> over queries
        norm = k.norm(dim=-1).mean(-1)                                              # (B, S)
        text = torch.cat([torch.zeros(B, P, dtype=torch.bool, device=x.device), queries], 1)
        mem_keys = [k[b][is_mem[b]] for b in range(B)]
        n = min(len(t) for t in mem_keys)
        km = torch.stack([t[:n] for t in mem_keys])                                 # (B, n, Hkv, D)
        layers.append(dict(attention=share, norm=(norm[is_mem].mean() / norm[text].mean()).item(),
                           spread=(km.std(0).mean() / km.abs().mean()).item()))
    embed_norm = None
    if memory.embeds is not None:
        table = comp.decoder.model.embed_tokens.weight.float() * C.embed_scale(comp.decoder)   # as the decoder reads it
        text_norm = torch.cat([table[torch.tensor(t)].norm(dim=-1) for t in xs]).mean()
        embed_norm = (memory.embeds[memory.valid].float().norm(dim=-1).mean() / text_norm).item()
    n_text = [len(t) + 1 for t in xs]                  # the text and its EOS (as evaluate.py counts the AE loss)
    own = comp.nll(memory, "ae", follow, n_text)
    rest = comp.nll(memory, "ae", follow, [n - 1 for n in n_text])   # the last n - 1: all but the first token
    other = comp.nll(comp.compress([comp.encoder_ids(t) for t in xs[1:] + xs[:1]]), "ae", follow, n_text)
    none = E.PlainLLM(comp).nll([[comp.tok.start_id]] * len(xs), [t + [comp.tok.eos_id] for t in xs])
    loss = lambda r: sum(r[0]) / sum(r[1])
    n_first = sum(own[1]) - sum(rest[1])   # 0 when nothing predicts the first token (K/V memory, no special token)
    first = (sum(own[0]) - sum(rest[0])) / n_first if n_first else None
    return dict(layers=layers, embed_norm_ratio=embed_norm, loss_own=loss(own), loss_other=loss(other),
                loss_none=sum(s for s, _ in none) / sum(c for _, c in none), own_other=loss(own) / loss(other),
                loss_own_first=first, loss_own_rest=loss(rest))


def diagnose(run, texts, count, length=None):
    """Both states of one run, measured once on texts of `length` tokens (default the run's --max-len):
    run/diagnosis.json is kept and read again while it is newer than the run's weights and was measured on as many
    texts of that length, or when the weights are gone (a kept record in recipes/results)."""
    meta = checkpoint.read_checkpoint_config(run)
    n = length or meta.get("train_args", {}).get("max_len", 16)
    path = os.path.join(run, "diagnosis.json")
    row = json.load(open(path)) if kept(path, run) else {}
    if row.get("asked") == count and row.get("n") == n:
        return row
    row = dict(measure_run(run, meta, texts, count, n), asked=count)
    json.dump(row, open(path, "w"), indent=1)
    return row


def measure_run(run, meta, texts, count, n):
    args = meta.get("train_args", {})
    out = {}
    for state in ("init", "trained"):
        torch.manual_seed(args.get("seed", 0))   # train.py seeds torch so before it builds the compressor
        comp = checkpoint.load(run, trained=state == "trained").eval()
        xs = [ids[:n] for ids in (comp.tok.encode(t) for t in texts) if len(ids) >= n][:count]
        if len(xs) < 2:   # own/other needs another text; compress([]) would fail deep inside
            raise SystemExit(f"diagnosis.py: {run}: {len(xs)} held-out text(s) of {n} tokens or more, 2 needed: pass "
                             f"--data with longer texts, or --len with a shorter length")
        out[state] = measure(comp, xs)
    return dict(run=portable(run), method=meta["config"]["method"], carrier=meta["config"]["carrier"],
                step=meta.get("step"), texts=len(xs), n=n, **out)


def capacity(run, texts, count, n, steps, lr=1e-2, every=50):
    """Each held-out text's memory (as the run's compressor makes it at init: its config and seed, no weights
    needed, so a kept record will do) optimized directly for the AE loss, the decoder frozen: the AE loss per token
    after 0, every, 2 every, ... steps (the mean over the texts), and the own/other of the optimized memories at the
    end. Adam at lr, scaled by each tensor's RMS (ICAE's memory sits at 20x the token embeddings' norm, K/V at the
    decoder's own scale)."""
    torch.manual_seed(checkpoint.read_checkpoint_config(run).get("train_args", {}).get("seed", 0))   # the run's init
    comp = checkpoint.load(run, trained=False).eval()
    for p in comp.parameters():
        p.requires_grad_(False)
    xs = [ids[:n] for ids in (comp.tok.encode(t) for t in texts) if len(ids) >= n][:count]
    with torch.no_grad():
        memory = comp.compress([comp.encoder_ids(x) for x in xs])
    leaves = [memory.embeds] if memory.kv is None else [t for kv in memory.kv for t in kv]
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    scales = [t.detach().pow(2).mean().sqrt().item() for t in leaves]
    opt = torch.optim.Adam([{"params": [t], "lr": lr * s} for t, s in zip(leaves, scales)])
    free = lambda: (replace(memory, embeds=leaves[0]) if memory.kv is None else
                    replace(memory, kv=[(leaves[2 * i], leaves[2 * i + 1]) for i in range(len(memory.kv))]))
    targets = [comp.ae_target(x) for x in xs]
    curve = []
    for step in range(steps + 1):
        loss, _ = comp.lm_loss(free(), "ae", targets)
        if step % every == 0 or step == steps:
            curve.append(dict(step=step, loss=loss.item()))
        if step < steps:
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        own = comp.nll(free(), "ae", targets)
        # text i reads the optimized memory of text i + 1 (evaluate.derangement)
        other = comp.nll(replace(free(), **({"embeds": leaves[0].roll(-1, 0)} if memory.kv is None else
                                          {"kv": [(k.roll(-1, 0), v.roll(-1, 0)) for k, v in free().kv]})),
                         "ae", targets)
    ratio = (sum(own[0]) / sum(own[1])) / (sum(other[0]) / sum(other[1]))
    return dict(run=portable(run), texts=len(xs), n=n, steps=steps, lr=lr, curve=curve, own_other=ratio)


def groups_of(values, k=5):
    """Means of `values` over k consecutive groups of layers (fewer groups for a model of fewer layers)."""
    L = len(values)
    k = min(k, L)
    return [sum(values[i] for i in range(g * L // k, (g + 1) * L // k)) / max(1, (g + 1) * L // k - g * L // k)
            for g in range(k)]


def table(rows):
    L = len(rows[0]["init"]["layers"])
    head = " / ".join(f"{g * L // min(5, L)}-{(g + 1) * L // min(5, L) - 1}" for g in range(min(5, L)))
    lines = [f"| run | state | embedding norm memory/text | key norm memory/text (layers {head}) | "
             "attention on memory (same layers) | key spread across texts | AE loss own | own: first token / the rest "
             "| other | none | own/other |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for state in ("init", "trained"):
            d = r[state]
            col = lambda key: " / ".join(f"{v:.2f}" for v in groups_of([layer[key] for layer in d["layers"]]))
            spread = sum(layer["spread"] for layer in d["layers"]) / len(d["layers"])
            emb = "-" if d["embed_norm_ratio"] is None else f"{d['embed_norm_ratio']:.2f}"
            name = os.path.basename(os.path.normpath(r["run"]))
            when = "init" if state == "init" else f"step {r['step']}"
            split = f"{d['loss_own_first']:.3f} / {d['loss_own_rest']:.3f}" if d.get("loss_own_first") is not None else "-"
            lines.append(f"| {name} | {when} | {emb} | {col('norm')} | {col('attention')} | {spread:.3f} | "
                         f"{d['loss_own']:.3f} | {split} | {d['loss_other']:.3f} | {d['loss_none']:.3f} | "
                         f"{d['own_other']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="train.py --out folders")
    p.add_argument("--data", help="held-out texts (.jsonl {\"text\"}; default: evaluate.py's built-in set)")
    p.add_argument("--texts", type=int, default=8, help="held-out texts to measure on (default 8)")
    p.add_argument("--len", type=int, help="measure on texts of this many tokens (default: each run's --max-len)")
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument("--capacity", type=int, metavar="STEPS", help="instead: optimize each text's memory directly for "
                   "STEPS steps (what the carrier could hold; see above) and print the AE loss along the way")
    a = p.parse_args(argv)
    texts = [ex["text"] for ex in E.load_examples(a.data, "ae")]
    if a.capacity:
        rows = []
        for run in a.runs:   # each run's probe is kept in its folder (capacity.json) and read again when asked alike
            n = a.len or checkpoint.read_checkpoint_config(run).get("train_args", {}).get("max_len", 16)
            path = os.path.join(run, "capacity.json")
            row = json.load(open(path)) if os.path.isfile(path) else {}
            if (row.get("texts"), row.get("n"), row.get("steps")) != (a.texts, n, a.capacity):
                row = capacity(run, texts, a.texts, n, a.capacity)
                json.dump(row, open(path, "w"), indent=1)
            rows.append(row)
        steps = [c["step"] for c in rows[0]["curve"]]
        md = "\n".join([f"| run (memory optimized per text, {a.texts} texts) | " + " | ".join(
            f"AE loss at {s}" for s in steps) + " | own/other at the end |", "|---|" + "---|" * (len(steps) + 1)] + [
            f"| {os.path.basename(os.path.normpath(r['run']))} | " + " | ".join(f"{c['loss']:.3f}" for c in r["curve"])
            + f" | {r['own_other']:.3f} |" for r in rows])
        print(md)
        if a.out:
            json.dump(rows, open(a.out + ".json", "w"), indent=1)
            open(a.out + ".md", "w").write(md + "\n")
        return
    rows = [diagnose(run, texts, a.texts, a.len) for run in a.runs]
    md = table(rows)
    print(md)
    if a.out:
        json.dump(rows, open(a.out + ".json", "w"), indent=1)
        open(a.out + ".md", "w").write(md + "\n")


if __name__ == "__main__":
    main()
