"""Benchmark (not a test): each preset's AE training step beside the same step written directly on `transformers`.

    python tests/bench_hf.py [--methods icae 500x aoc] [--model PATH] [--steps 6] [--profile-steps 2]

Default model: a randomly initialised Llama of SmolLM2-135M's shape (d 576, 30 layers, 9 query heads on 3 K/V heads,
MLP 1536, vocabulary 49152, tied embeddings), written as a Hugging Face folder by transformers and read back by
model.load_pretrained, as the tests read their tiny checkpoints; --model reads a real folder instead (e.g.
~/.cache/ctxcomp/smollm2-135m). Both sides load the same folder, fp32, 2 threads.

Each preset is built as train.py builds it for `--objective ae` (the preset's compressor settings for that objective,
e.g. 500x's r 64, α 32 and [BOS]), with 16 memory slots; its step is bench_train.ae_step (compress, then AE's loss on
the frozen decoder), backward, gradient clipping and AdamW (train.make_optimizer: fused, decay on matrices). The
transformers step (HFStep) does the same with transformers' LlamaForCausalLM and nothing of ours: a hand-written LoRA
on the preset's targets, the memory tokens, [AE] and the AOC encoder as plain tensors and modules, each initialised
from our compressor's tensors, so both start from the same numbers and train the same parameters:

    ICAE   encoder = the LLM + LoRA on [BOS x, m_1..m_16]; memory = its final (normed) hidden states at the slots;
           decoder (LoRA off) on [memory, [AE], BOS x EOS]
    500x   as ICAE, memory = every layer's K/V at the slots (transformers' DynamicCache), decoder on [BOS, x EOS]
    AOC    encoder = a copy of the LLM with every MLP an nn.Identity (AOC's code), fully trained, embedding with the
           LLM's own table; memory = its K/V at the slots, decoder on [BOS, x EOS]

The two are first checked to give the same loss at the first step and, after one AdamW step on each side, at the
second (gradients and optimizer included); then timed in alternating rounds (round 0 warms up and is not counted),
medians printed with each round's ours/transformers ratio, and each side profiled: its aten ops, calls and self CPU
time per step.
"""

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compressors as C  # noqa: E402
import data  # noqa: E402
import presets as P  # noqa: E402
import train  # noqa: E402
from bench_generate import SMOLLM2_135M  # noqa: E402
from bench_train import ae_step  # noqa: E402
from hf import byte_tokenizer  # noqa: E402
from model import load_pretrained  # noqa: E402

METHODS = ("icae", "500x", "aoc")


# ---- the model folder and the texts ----

def random_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """A random transformers Llama of `config` (transformers' own init), saved as an HF folder with our byte-level
    tokenizer (ids 0..255 bytes, 256 BOS, 257 EOS, 258 pad): what load_pretrained and from_pretrained both read."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**config, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def texts(tok, batch: int, n: int) -> list:
    """`batch` texts of n tokens each: windows of the built-in texts (data.BUILTIN_TEXTS), as the tokenizer reads
    them."""
    ids = tok.encode(" ".join(data.BUILTIN_TEXTS))
    return [ids[i * n:(i + 1) * n] for i in range(batch)]


def build_ours(method: str, folder: str, mem: int = 16, seed: int = 0):
    """Our compressor of `method` around the folder's LLM, as train.py --objective ae builds it, mem slots per text,
    and its optimizer (train.make_optimizer) and clip: (comp, opt, clip)."""
    decoder, tok = load_pretrained(folder)
    preset = P.PRESETS[method]
    torch.manual_seed(seed)   # the LoRA A init, the memory tokens, [AE]
    comp = C.build(method, decoder, tok, **preset.compressor_for("ae"), mem=mem).set_dtypes(torch.float32)
    recipe = {**vars(preset.recipe), **preset.recipe.per_objective.get("ae", {})}
    opt = train.make_optimizer(comp, recipe["lr"], recipe["betas"], recipe["weight_decay"], None, comp.device)
    return comp, opt, recipe["clip"]


def step_ours(comp, opt, clip: float, ids: list) -> float:
    """One training step of ours, as train.train_step runs loss_ae: forward, backward, clip, AdamW -> the loss."""
    loss, _ = ae_step(comp, ids, None)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(comp.trainable_parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# ---- the same step on transformers ----

class LoRA(nn.Module):
    """A transformers nn.Linear with a LoRA branch, written by hand (Hu et al. 2021): y = W x + (α/r) B dropout(x) A x,
    A (r, in) and B (out, r) given. `on` False: the base linear alone (the frozen decoder). Made in train mode, as
    lora.add_lora's modules are (inside an LLM in eval mode): 500x's dropout 0.05 acts in both."""

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, scale: float, dropout: float):
        super().__init__()
        self.base, self.scale, self.on = base, scale, True
        self.A, self.B = nn.Parameter(A), nn.Parameter(B)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        y = self.base(x)
        # the same order of operations as lora.LoRALinear (x Aᵀ, then Bᵀ, then the scale), so fp32 sums agree
        return y + F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scale if self.on else y


def cache_arg(model) -> str:
    """The keyword a transformers model takes its KV cache by: `cache` in transformers 5, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFStep:
    """`method`'s AE step on transformers' LlamaForCausalLM, its trained tensors copied from our compressor `comp`
    (nothing of ours runs in it: the copies are plain tensors). step(ids) is forward, backward, clip and AdamW with
    our optimizer's settings (its groups: decay on matrices only, as train.make_optimizer)."""

    def __init__(self, comp, folder: str, opt_like, clip: float):
        import transformers
        cfg, self.clip = comp.cfg, clip
        self.bos = cfg.bos                      # ICAE: the context and the target start with [BOS] (EPL's code)
        self.kv = cfg.carrier == "kv"           # 500x, AOC: the memory is the encoder's K/V at the slots
        self.bos_id, self.eos_id = comp.tok.start_id, comp.tok.eos_id
        self.llm = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                     attn_implementation="sdpa").eval()
        self.llm.requires_grad_(False)
        self.cache_arg = cache_arg(self.llm.model)
        copy = lambda t: nn.Parameter(t.detach().clone())
        self.mem = copy(comp.mem_tokens)                                           # (m, d)
        self.ae_embed = copy(comp.ae_embed) if cfg.ae_token == "learned" else None  # (d,), ICAE's [AE]
        self.loras = []
        if cfg.encoder == "lora":   # ICAE, 500x: LoRA on the LLM's own targets; the encoder is the LLM itself
            for ours, theirs in zip(comp.encoder.model.layers, self.llm.model.layers):
                for name in cfg.lora_targets:
                    mine = getattr(ours.self_attn, name)
                    lora = LoRA(getattr(theirs.self_attn, name), mine.lora_A.detach().clone(),
                                mine.lora_B.detach().clone(), mine.scale, cfg.lora_dropout)
                    setattr(theirs.self_attn, name, lora)
                    self.loras.append(lora)
            self.encoder = self.llm.model
            trained = [p for lora in self.loras for p in (lora.A, lora.B)]
        else:   # AOC's code: a copy of the LLM, every MLP replaced by the identity, fully trained, embedding with
            # the frozen LLM's table (so its own embedding is never used: it is dropped)
            self.encoder = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
            self.encoder.embed_tokens = None
            for layer in self.encoder.layers:
                layer.mlp = nn.Identity()
            self.encoder.load_state_dict({k[len("model."):]: v for k, v in comp.encoder.state_dict().items()
                                          if k.startswith("model.") and "embed_tokens" not in k})
            self.encoder.requires_grad_(True)
            trained = list(self.encoder.parameters())
        trained += [self.mem] + ([self.ae_embed] if self.ae_embed is not None else [])
        self.trained = trained
        group = opt_like.param_groups[0]   # lr, betas and decay as ours (train.make_optimizer: fused)
        self.opt = torch.optim.AdamW([dict(params=[p for p in trained if p.dim() >= 2],
                                           weight_decay=group["weight_decay"]),
                                      dict(params=[p for p in trained if p.dim() < 2], weight_decay=0.0)],
                                     lr=group["lr"], betas=group["betas"], fused=True)

    @contextlib.contextmanager
    def lora_off(self):
        """The frozen LLM: every LoRA branch off (PEFT's disable_adapter)."""
        for lora in self.loras:
            lora.on = False
        try:
            yield
        finally:
            for lora in self.loras:
                lora.on = True

    def loss(self, ids: list) -> torch.Tensor:
        """AE's mean cross-entropy of the frozen decoder on x EOS (ICAE: BOS x EOS) given the memory of x; every
        text of the batch has the same length, so nothing is padded and every position is real."""
        embed = self.llm.model.embed_tokens
        B, m = len(ids), self.mem.shape[0]
        context = torch.tensor([[self.bos_id] * self.bos + t for t in ids])                 # (B, n)
        n = context.shape[1]
        # the encoder reads [x, m_1..m_m], positions 0..n+m-1, causal (compressors.Compressor._encode)
        x = torch.cat([embed(context), self.mem.expand(B, -1, -1)], dim=1)                  # (B, n+m, d)
        target = torch.tensor([[self.bos_id] * self.bos + t + [self.eos_id] for t in ids])  # (B, L)
        L = target.shape[1]
        if self.kv:
            # 500x / AOC: every layer's keys (RoPE at n..n+m-1) and values at the slots become the decoder's cache
            out = self.encoder(inputs_embeds=x, use_cache=True)
            enc_cache = getattr(out, self.cache_arg)
            kv = [(k[:, :, n:], v[:, :, n:]) for k, v, *_ in enc_cache]                    # (B, Hkv, m, D) each
            from transformers import DynamicCache
            prefix = {self.cache_arg: DynamicCache(kv)}
            # after the cached slots: [BOS] (the special token, 500x / AOC code), then x EOS, at positions m, m+1, ..
            dec_in = torch.cat([embed(torch.full((B, 1), self.bos_id)), embed(target)], dim=1)   # (B, 1+L, d)
            first = 0           # decoder input i predicts target[i]
        else:
            # ICAE: the encoder's final hidden states (its final norm applied) at the slots are the decoder's first
            # m inputs, then the learned [AE], then BOS x EOS; positions 0..m+L
            memory = self.encoder(inputs_embeds=x).last_hidden_state[:, n:]                # (B, m, d)
            dec_in = torch.cat([memory, self.ae_embed.expand(B, 1, -1), embed(target)], dim=1)   # (B, m+1+L, d)
            prefix, first = {}, m   # [AE] (input m) predicts target[0]
        with self.lora_off():
            h = self.llm.model(inputs_embeds=dec_in, use_cache=False, **prefix).last_hidden_state
        # logits only where a target is predicted, as our chunked loss makes them
        logits = self.llm.lm_head(h[:, first:first + L])                                   # (B, L, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def step(self, ids: list) -> float:
        loss = self.loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trained, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def pair(method: str, folder: str, mem: int = 16):
    """(ours, theirs): two callables ids -> the loss of one training step, from the same weights."""
    comp, opt, clip = build_ours(method, folder, mem)
    hf = HFStep(comp, folder, opt, clip)
    return (lambda ids: step_ours(comp, opt, clip, ids)), hf.step, comp, hf


def losses(ours, theirs, ids: list, steps: int = 2) -> list:
    """[(our loss, transformers' loss)] of `steps` training steps on each side, each step from the same RNG state
    (LoRA's dropout draws its masks in the same order on both: layer by layer, q_proj before v_proj)."""
    out = []
    for step in range(steps):
        pair_ = []
        for run in (ours, theirs):
            torch.manual_seed(step)
            pair_.append(run(ids))
        out.append(tuple(pair_))
    return out


# ---- timing and profiling ----

def timed_rounds(steps: dict, ids: list, rounds: int) -> tuple:
    """(name -> wall seconds per step, name -> CPU seconds per step, all threads) over `rounds` rounds after a warm-up
    round; in each round every step runs once, the order alternating round by round, so that the machine's load
    hits both alike. The CPU time counts what the step computed, not the time it waited for a core that other jobs
    held (it does count OpenMP's spinning)."""
    wall, cpu = {name: [] for name in steps}, {name: [] for name in steps}
    for r in range(rounds + 1):
        for name in (list(steps) if r % 2 else list(steps)[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            steps[name](ids)
            if r:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        print(f"  round {r}{' (warm-up)' if r == 0 else ''} done", file=sys.stderr, flush=True)
    return wall, cpu


def profiled(step, ids: list, n: int) -> dict:
    """aten op -> (calls, self CPU µs, FLOPs) per step, over n steps under torch.profiler (its FLOPs: matrix
    products only)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(n):
            step(ids)
    return {e.key: (e.count / n, e.self_cpu_time_total / n, e.flops / n) for e in prof.key_averages()
            if e.key.startswith("aten::")}


def profile_table(ours: dict, theirs: dict, top: int = 14) -> str:
    """The ops that take the most self CPU time on either side, with calls and ms per step on each."""
    none = (0, 0, 0)
    keys = sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, none)[1], theirs.get(k, none)[1]))
    rows = ["| aten op | ours calls | ours ms | transformers calls | transformers ms |", "|---|---|---|---|---|"]
    for k in keys[:top]:
        (oc, ot, _), (tc, tt, _) = ours.get(k, none), theirs.get(k, none)
        rows.append(f"| {k[len('aten::'):]} | {oc:,.0f} | {ot / 1e3:.1f} | {tc:,.0f} | {tt / 1e3:.1f} |")
    total = lambda d, i: sum(v[i] for v in d.values())
    rows.append(f"| all aten ops | {total(ours, 0):,.0f} | {total(ours, 1) / 1e3:.1f} | {total(theirs, 0):,.0f} | "
                f"{total(theirs, 1) / 1e3:.1f} |")
    rows.append(f"| GFLOP of matrix products | {total(ours, 2) / 1e9:.1f} | | {total(theirs, 2) / 1e9:.1f} | |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--model", help="an HF Llama folder (default: a random one of SmolLM2-135M's shape)")
    p.add_argument("--steps", type=int, default=6, help="timed rounds, one step of each side a round (0: the loss "
                   "check only)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps of each side under the profiler (0: none)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--len", type=int, default=64, help="tokens per text")
    p.add_argument("--mem", type=int, default=16, help="memory slots per text")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    transformers.utils.logging.disable_progress_bar()   # its weight-loading bars, between the tables
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.model and str(Path(a.model).expanduser())
        if folder is None:
            folder = str(random_checkpoint(Path(tmp) / "smollm2-135m-shape", SMOLLM2_135M))
        name = a.model or "random SmolLM2-135M shape"
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {name}, fp32, batch {a.batch}, "
              f"{a.len} tokens into {a.mem} slots; {a.steps} rounds after a warm-up round\n")
        results = []
        for method in a.methods:
            ours, theirs, comp, _ = pair(method, folder, a.mem)
            ids = texts(comp.tok, a.batch, a.len)
            # the same loss at the first step, and at the second (after one AdamW step on each side)
            check = losses(ours, theirs, ids)
            rel = [abs(o - t) / abs(t) for o, t in check]
            print(f"{method}: loss step 1 {check[0][0]:.6f} ours, {check[0][1]:.6f} transformers (rel. {rel[0]:.1e}); "
                  f"step 2 {check[1][0]:.6f} and {check[1][1]:.6f} (rel. {rel[1]:.1e})", flush=True)
            if a.steps:
                wall, cpu = timed_rounds({"ours": ours, "transformers": theirs}, ids, a.steps)
                results.append((method, check, wall))
                for unit, seen in (("ms/step", wall), ("CPU ms/step (all threads)", cpu)):
                    ratios = [t / o for o, t in zip(seen["ours"], seen["transformers"])]
                    print(f"  {unit}: " + ", ".join(f"{k} {1e3 * statistics.median(v):.0f} "
                                                    f"({1e3 * min(v):.0f}-{1e3 * max(v):.0f})"
                                                    for k, v in seen.items()) +
                          f"; transformers/ours {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                          flush=True)
            if a.profile_steps:
                print(f"\n{method}, per step (the mean over {a.profile_steps} profiled steps each; self CPU time):\n")
                print(profile_table(profiled(ours, ids, a.profile_steps), profiled(theirs, ids, a.profile_steps)))
                print(flush=True)
            del ours, theirs, comp
        if results:
            print("| method | loss step 1 ours / transformers | step 2 | ours ms/step | transformers ms/step | "
                  "transformers/ours (median, range over rounds) |\n|---|---|---|---|---|---|")
        for method, check, wall in results:
            o, t = (1e3 * statistics.median(wall[k]) for k in ("ours", "transformers"))
            ratios = [t / o for o, t in zip(wall["ours"], wall["transformers"])]
            print(f"| {method} | {check[0][0]:.6f} / {check[0][1]:.6f} | {check[1][0]:.6f} / {check[1][1]:.6f} | "
                  f"{o:.0f} | {t:.0f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")

if __name__ == "__main__":
    main()
