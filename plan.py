"""What a training run needs in memory, before it starts: `python train.py --method pcc --shape llama-3-8b --plan`.

The compressor is built on PyTorch's `meta` device (shapes and dtypes, no storage, no init), from a SHAPES entry
(model.py: the papers' models, no download), a local model folder's config.json, or `tiny`, with the run's
settings and --frozen-dtype. Nothing is allocated. Per GPU:

    weights      = Σ over distinct parameters of numel × its dtype's size   (frozen bf16/fp32, trained fp32)
    gradients    = trained numel × 4                                          (fp32, as the trained weights)
    optimizer    = trained numel × 8                                          (AdamW's two fp32 moments)
    activations  = OVERHEAD × saved                                           (one micro-batch)

`saved` is counted, not guessed: one forward of the run's objective on a micro-batch at the run's longest lengths
(random ids; --crop window texts at --max-len), on the meta device, under torch.autograd.graph.saved_tensors_hooks,
adding up every distinct tensor autograd keeps for the backward pass (parameters left out: they are the weights
above). Under bf16 autocast (CUDA, or --frozen-dtype bf16) the forward runs in bf16, as autocast computes: the
meta device has no autocast, so the counted model is cast to bf16 whole, and the bf16 copies autocast makes of
the fp32 trained weights are added (trained numel × 2). --grad-ckpt counts as it runs (only each block's input),
plus one block's activations, which backward recomputes and holds while it goes through that block.
OVERHEAD covers what the count cannot see: the backward pass's transient gradients of activations, the
cross-entropy's chunk of logits, the allocator. It is calibrated on measured peaks (tests/README.md, "The memory
plan against measured peaks"). Attention is counted as the CPU's SDPA keeps it, the full (B, H, T, S)
probabilities: CUDA's memory-efficient kernel keeps only its output and a log-sum-exp, so on CUDA the count is
an upper bound where sequences are long.

`python plan.py` prints tests/README.md's table: every preset at its papers' model and batch.
"""

import argparse
import contextlib
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import compressors as C

from model import SHAPES, TINY_CONFIG, ModelConfig, Tokenizer, Transformer, build_tiny

GIB = 2 ** 30
CARD_GB = 80          # one H100 / A100 80GB: what "fits" means in the table
OVERHEAD = 2.0        # measured peak / counted activations: 1.8-2.4 on the CPU, peak RSS (tests/README.md, "The memory plan")


def model_config(name: str, shape: str | None) -> tuple[dict, Tokenizer]:
    """The config.json of --shape, of `tiny`, or of a local model folder (only that file is read), and a tokenizer
    (the folder's own when it has one: the ids a QA template takes; else tiny's bytes, whose ids fit any vocabulary)."""
    tok = build_tiny()[1]
    if shape:
        return dict(SHAPES[shape]), tok
    if name == "tiny":
        return dict(TINY_CONFIG), tok
    folder = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        from train import fail
        fail(f"--plan reads config.json from a local model folder, and '{name}' is not one: pass the folder, or "
             f"--shape {{{','.join(SHAPES)}}}")
    import json
    hf = json.load(open(os.path.join(folder, "config.json")))
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok = Tokenizer.from_dir(folder)
    return hf, tok


def build_on_meta(args, frozen: torch.dtype) -> C.Compressor:
    """The run's compressor on the meta device, in its training dtypes (Compressor.set_dtypes), nothing allocated."""
    flags = {f.name: getattr(args, f.name) for f in C.FLAG_FIELDS}
    hf, tok = model_config(args.decoder or args.model, args.shape)
    with torch.device("meta"):
        decoder = Transformer(ModelConfig.from_hf(hf))
        encoder, enc_tok = None, None
        if args.decoder:   # --model is then the separate compressor LLM (pcc/pic)
            enc_hf, enc_tok = model_config(args.model, None)
            encoder = Transformer(ModelConfig.from_hf(enc_hf))
    cfg = C.make_config(args.method, model=args.decoder or args.model,
                        compressor_model=args.model if args.decoder else None, **flags)
    comp = C.Compressor(cfg, decoder, tok, encoder, enc_tok)
    if args.stage == "keft":
        comp.set_stage("keft")
    return comp.set_dtypes(frozen)


def example_batch(comp, args, micro: int) -> dict:
    """A micro-batch of the run's objective at its longest lengths, made of random ids, as train.py collates it."""
    import train as T   # (train imports this module lazily: no import circle)
    n, rng = args.max_len, np.random.default_rng(0)
    ids = lambda k: rng.integers(3, 250, k).tolist()   # below tiny's 259: any vocabulary has these ids
    if args.objective in ("qa", "distill"):
        parts = comp.qa_parts("x", "?")
        qa = dict(prefix=parts["prefix"], dec_context=ids(n), enc_context=ids(n), prompt=parts["prompt"] + ids(16),
                  answer=ids(32))
        data = {"qa": [{k: torch.tensor(v) for k, v in qa.items()}], "tokens": None, "offsets": None}
    else:
        data = {"tokens": torch.tensor(ids(n)), "offsets": torch.tensor([0, n]), "qa": []}
    long = argparse.Namespace(**{**vars(args), "min_len": n, "len_curriculum": None})
    examples = [T.sample_example(data, args.objective, np.random.default_rng(i), long, comp, 0) for i in range(micro)]
    batch = T.collate(examples)
    batch["norm"] = T.step_normalizers(comp, args.objective, examples)
    if args.objective == "distill":   # the frozen LLM's own answers, at their longest
        batch["answer"] = [ids(args.answer_tokens) for _ in examples]
    return batch


class CudaAttention(torch.autograd.Function):
    """SDPA on the meta device, saving for backward what CUDA's kernels save (the memory-efficient kernel, which takes a
    mask): q, k and v (each K/V head repeated for its query heads: that kernel has no GQA), the output, the fp32
    log-sum-exp per query, and the boolean mask as a bias in q's dtype. The meta device's own SDPA is the math
    path, which keeps the (B, H, T, S) probabilities: 100 GB and more at the papers' batches and lengths, which no
    GPU run holds."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        B, H, T, D = q.shape
        out = q.new_empty(B, H, T, v.shape[-1])
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1) if mask is not None else x for x in (k, v))
        saved = [q, k, v, out, q.new_empty(B, H, T, dtype=torch.float32)]
        if mask is not None:
            saved.append(torch.empty(mask.shape, dtype=q.dtype, device=q.device))
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), grad.new_empty(k.shape), grad.new_empty(v.shape), None


SDPA = F.scaled_dot_product_attention


def sdpa(q, k, v, attn_mask=None, **kw):
    """F.scaled_dot_product_attention, counted as on CUDA when on the meta device (CudaAttention)."""
    if q.is_meta:
        return CudaAttention.apply(q, k, v, attn_mask)
    return SDPA(q, k, v, attn_mask=attn_mask, **kw)


def saved_bytes(comp, args, micro: int, autocast: bool) -> int:
    """Bytes of every distinct tensor autograd saves for backward in one forward of a micro-batch (parameters
    aside), counted on the meta device; under autocast the model computes in bf16 (see the module docstring)."""
    import train as T
    if autocast:
        comp = comp.to(torch.bfloat16)   # what autocast computes in; Transformer._apply keeps RoPE in fp32
    for model in (comp.encoder, comp.decoder):
        model.grad_ckpt = args.grad_ckpt
    params = {id(p) for p in comp.parameters()}
    kept = {}

    def pack(t):
        base = t if t._base is None else t._base
        if id(base) not in params and id(t) not in params:
            kept[id(base)] = (base, base.untyped_storage().nbytes())   # the reference keeps the id unique
        return t
    batch = example_batch(comp, args, micro)
    step = T.TrainStep(comp, args.objective, args.lm_weight)
    F.scaled_dot_product_attention = sdpa   # torch.nn.functional, as model.py calls it: put back below
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(batch)
    finally:
        F.scaled_dot_product_attention = SDPA
    return sum(nbytes for _, nbytes in kept.values())


@dataclass
class Plan:
    params: dict          # ("trained" | "frozen", dtype name) -> parameter count
    weights: int          # bytes
    grads: int
    optimizer: int
    activations: int      # one micro-batch, OVERHEAD included
    micro: int            # examples per micro-batch

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def frozen_dtype(args) -> torch.dtype:
    """--frozen-dtype as the run resolves it; auto plans for the run's device, CUDA unless --device says otherwise."""
    cuda = (args.device or "cuda").startswith("cuda")
    return torch.bfloat16 if args.frozen_dtype == "bf16" or (args.frozen_dtype == "auto" and cuda) else torch.float32


def make_plan(args, micro: int | None = None) -> Plan:
    frozen = frozen_dtype(args)
    autocast = frozen == torch.bfloat16 or (args.device or "cuda").startswith("cuda")
    micro = micro or args.micro_batch or args.batch_size
    comp = build_on_meta(args, frozen)
    params, weights, trained = {}, 0, 0
    for p in comp.parameters():   # distinct tensors: a tied or shared one counts once
        kind = ("trained" if p.requires_grad else "frozen", str(p.dtype).removeprefix("torch."))
        params[kind] = params.get(kind, 0) + p.numel()
        weights += p.numel() * p.element_size()
        trained += p.numel() if p.requires_grad else 0
    saved = saved_bytes(comp, args, micro, autocast) + (2 * trained if autocast else 0)
    if args.grad_ckpt:   # backward recomputes one block at a time and keeps its activations meanwhile: one
        # block's share of what the run without checkpointing saves (the decoder's layer count, an upper bound where
        # a shorter encoder's blocks are larger)
        whole = saved_bytes(build_on_meta(args, frozen), argparse.Namespace(**{**vars(args), "grad_ckpt": False}),
                            micro, autocast)
        saved += whole // comp.decoder.config.num_hidden_layers
    return Plan(params, weights, 4 * trained, 8 * trained, int(OVERHEAD * saved), micro)


def describe(args, plan: Plan) -> str:
    gb = lambda b: f"{b / GIB:7.2f} GB"
    where = args.shape and f"a {args.shape} shape" or args.decoder or args.model
    lines = [f"memory plan: {args.method} ({args.objective}) on {where}, micro-batch {plan.micro} of batch "
             f"{args.batch_size}, |X| up to {args.max_len}{', --grad-ckpt' if args.grad_ckpt else ''}, "
             f"--frozen-dtype {args.frozen_dtype} (per GPU, nothing allocated: plan.py)"]
    for (kind, dtype), n in sorted(params.items() if (params := plan.params) else []):
        lines.append(f"  parameters {kind:7} {dtype:8} {n:>15,}")
    lines += [f"  weights        {gb(plan.weights)}", f"  gradients      {gb(plan.grads)}",
              f"  AdamW states   {gb(plan.optimizer)}",
              f"  activations    {gb(plan.activations)}   (counted saved tensors x {OVERHEAD}, calibrated)",
              f"  total          {gb(plan.total)}   {'fits' if plan.total <= CARD_GB * 1e9 else 'does not fit'} "
              f"on one {CARD_GB} GB card"]
    if plan.total > CARD_GB * 1e9:
        lines.append("  (less: --micro-batch, --grad-ckpt, --frozen-dtype bf16; or shard with torchrun ... --fsdp)")
    return "\n".join(lines)


def show(args):
    """train.py --plan: print the plan and exit."""
    print(describe(args, make_plan(args)))


# every preset at its papers' models and batch (tests/README.md's table): (preset, shape, batch, source)
PAPERS = [
    ("icae", "llama-3.2-1b", 16, "EPL's code (App. C)"), ("icae", "llama-2-7b", 16, "ICAE (Llama-2-7B)"),
    ("500x", "llama-3.2-1b", 16, "EPL's code"), ("500x", "llama-3-8b", 16, "500xCompressor (Llama-3-8B)"),
    ("pcc", "llama-3-8b", 256, "PCC code, 8B compressor + 8B decoder"),
    ("pic", "llama-3-8b", 256, "PIC §4.1.2 decoder (compressor as large)"),
    ("compllm", "qwen3-4b", 4, "CompLLM"), ("compllm", "gemma-3-4b", 4, "CompLLM"),
    ("gmsa", "llama-2-7b", 4, "GMSA (LLaMA-2-7B)"), ("aoc", "llama-3.2-1b", 16, "AOC (Llama-3.2-1B)"),
]


def paper_table() -> str:
    """tests/README.md's table. Activations grow linearly with the micro-batch, a + b·m (a: what autocast's bf16
    copies of the trained weights and a recomputed block's fixed part hold): planned at m = 1 and 2, then extended."""
    import train as T
    rows = ["| preset | model | batch | trained params | weights+grads+AdamW GB | activations GB | total GB | "
            "fits 80 GB | with --grad-ckpt GB | fits | largest micro-batch that fits (ckpt) | "
            "GPUs under --fsdp (micro-batch 1, ckpt) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, shape, batch, source in PAPERS:
        args, _ = T.parse_args(["--method", method, "--shape", shape, "--plan", "--batch-size", str(batch)])
        act, fixed = {}, 0
        for ckpt in (False, True):
            p1, p2 = (make_plan(argparse.Namespace(**{**vars(args), "grad_ckpt": ckpt}), micro=m) for m in (1, 2))
            act[ckpt] = (2 * p1.activations - p2.activations, p2.activations - p1.activations)   # (a, b)
            fixed = p1.weights + p1.grads + p1.optimizer
            trained = sum(n for (kind, _), n in p1.params.items() if kind == "trained")
        total = {ckpt: fixed + a + b * batch for ckpt, (a, b) in act.items()}
        card = CARD_GB * 1e9
        a, b = act[True]
        room = int((card - fixed - a) // b) if card > fixed + a else 0
        # FSDP shards weights, gradients and AdamW over the GPUs; each still holds its own micro-batch's activations
        gpus = next((k for k in range(1, 65) if fixed / k + a + b <= card), "> 64")
        rows.append(f"| {method} | {shape} ({source}) | {batch} | {trained / 1e9:.2f}B | {fixed / GIB:.1f} | "
                    f"{(total[False] - fixed) / GIB:.1f} | {total[False] / GIB:.1f} | "
                    f"{'yes' if total[False] <= card else 'no'} | {total[True] / GIB:.1f} | "
                    f"{'yes' if total[True] <= card else 'no'} | {min(room, batch) if room > 0 else 'none'} | {gpus} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(paper_table())
