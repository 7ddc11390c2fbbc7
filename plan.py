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
the fp32 trained weights are added (trained numel × 2, cached once per step), and with fp32 frozen weights the bf16
copy of each frozen matrix a matmul saves (autocast does not cache what needs no gradient: one copy per use).
--grad-ckpt counts as it runs (only each block's input), plus one block's activations, which backward recomputes and
holds while it goes through that block.

Over several GPUs (--gpus N, with torchrun --nproc_per_node N): each GPU runs batch / N examples (or --micro-batch).
DDP keeps everything whole on every GPU, plus its gradient buckets (trained numel × 4). --fsdp (parallel.shard)
divides every tensor at rest by N, and while a step runs holds the root unit's weights whole (everything outside the
transformer blocks: embeddings, lm_head, memory tokens, bridge) and two blocks gathered (the running one and the next,
prefetched; in bf16 under MixedPrecisionPolicy), the root's gradients whole until they are reduce-scattered; AdamW's
states follow the shards. Two more numbers, outside the step's total:

    build        = what a GPU holds while the compressor is built ("fits" asks it of the card too): one process, or
                   DDP, builds it whole; --fsdp builds it on the meta device, shards it, and fills each GPU's shards
                   one whole tensor at a time (parallel.materialise), so a GPU holds its shards and the largest
                   tensor whole, in the frozen dtype as it is read or drawn (a linear or MLP bridge is drawn whole;
                   a file stored in another dtype adds that copy while it converts: tests/README.md measures it)
    checkpoint   = host memory a save adds per process: one process copies its trained tensors whole to the host
                   (trained numel × 4, compressor.safetensors); under --fsdp each rank writes its own shards
                   (torch.distributed.checkpoint), one at a time: the largest trained tensor's shard and DCP's
                   copy-ahead buffer (checkpoint.COPY_AHEAD), nothing on the GPU
OVERHEAD covers what the count cannot see: the backward pass's transient gradients of activations, the
cross-entropy's chunk of logits, the allocator. It is calibrated on measured CUDA peaks (tests/README.md, "The memory
plan"). Attention is counted as CUDA's memory-efficient kernel saves it (CudaAttention: q, K/V repeated to the query
heads as model.sdpa hands them over, the output, a log-sum-exp, the mask as a bias), not as the meta device's own
SDPA would (the math path's (B, H, T, S) probabilities, which no GPU run holds).

`python tests/bench_plan.py --papers` prints tests/README.md's table: every preset at its papers' model and batch.
"""

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import compressors
import data
from checkpoint import COPY_AHEAD
from hf import Tokenizer
from model import SHAPES, TINY_CONFIG, ModelConfig, Transformer, build_tiny

GB = 1e9              # every size the plan prints and compares: GB of 10^9 bytes, the card's "80 GB" included
CARD_GB = 80          # one H100 / A100 80GB: what "fits" means (80e9 bytes, under the card's 85.5e9: a margin)
# measured / counted activations on CUDA (torch.cuda.max_memory_allocated, H200, tests/README.md "Issue 45's
# check"): aoc 1.25, icae 1.29 (pcc 0.52: the count is an upper bound there). On the CPU's peak RSS 1.8-2.4
OVERHEAD = 1.3


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
        raise FileNotFoundError(f"--plan reads config.json from a local model folder, and '{name}' is not one: pass "
                                f"the folder, or --shape {{{','.join(SHAPES)}}}")
    import json
    hf = json.load(open(os.path.join(folder, "config.json")))
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok = Tokenizer.from_dir(folder)
    return hf, tok


def build_on_meta(cfg, shape: str | None, frozen: torch.dtype) -> compressors.Compressor:
    """The run's compressor (of `cfg`, as cli.py made it: its models and its stage) on the meta device, in its
    training dtypes (Compressor.set_dtypes), nothing allocated. shape: --shape, a paper model's shape (model.SHAPES)
    for the decoder."""
    hf, tok = model_config(cfg.model, shape)
    with torch.device("meta"):
        decoder = Transformer(ModelConfig.from_hf(hf))
        encoder, enc_tok = None, None
        if cfg.compressor_model:   # --decoder: --model is then the separate compressor LLM (pcc/pic)
            enc_hf, enc_tok = model_config(cfg.compressor_model, None)
            encoder = Transformer(ModelConfig.from_hf(enc_hf))
    return compressors.Compressor(cfg, decoder, tok, encoder, enc_tok).set_dtypes(frozen)


def example_batch(comp, sampling: data.Sampling, answer_tokens: int, micro: int) -> dict:
    """A micro-batch of the run's objective (`sampling`: the run's) at its longest lengths, made of random ids, as
    train.py collates it; distill's teacher answers `answer_tokens` long."""
    n, objective, rng = sampling.max_len, sampling.objective, np.random.default_rng(0)
    ids = lambda k: rng.integers(3, 250, k).tolist()   # below tiny's 259: any vocabulary has these ids
    if objective in ("qa", "distill"):
        parts = comp.qa_parts("x", "?")
        qa = dict(prefix=parts["prefix"], dec_context=ids(n), enc_context=ids(n), prompt=parts["prompt"] + ids(16),
                  answer=ids(32))
        tensors = {"qa": [{k: torch.tensor(v) for k, v in qa.items()}], "tokens": None, "offsets": None}
    else:
        tensors = {"tokens": torch.tensor(ids(n)), "offsets": torch.tensor([0, n]), "qa": []}
    longest = data.Sampling(objective, sampling.crop, n, n, micro, seed=0)
    examples = [data.sample_example(tensors, longest, np.random.default_rng(i), comp, 0) for i in range(micro)]
    batch = data.collate(examples)
    batch.norm = data.step_normalizers(comp, objective, examples)
    if objective == "distill":   # the frozen LLM's own answers, at their longest
        batch.answer = [ids(answer_tokens) for _ in examples]
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


def saved_bytes(comp, make_step, batch, autocast: bool, grad_ckpt: bool, sharded=frozenset()) -> int:
    """Bytes of every distinct tensor autograd saves for backward in one forward of a micro-batch (parameters
    aside), counted on the meta device; under autocast the model computes in bf16 (see the module docstring), and each
    time a matmul saves an fp32 frozen matrix, autocast's bf16 copy of it counts (not for the blocks in `sharded`:
    FSDP's MixedPrecisionPolicy gathers those in bf16).
    make_step: comp -> the run's step module (train.TrainStep with the run's objective: train.py hands it over, being
    the layer above this one); batch: the micro-batch (example_batch); grad_ckpt: --grad-ckpt."""
    copied = {id(p) for p in comp.parameters() if autocast and not p.requires_grad and p.dtype == torch.float32
              and p.dim() == 2 and id(p) not in sharded}   # (1-D norms are not autocast: no copy)
    if autocast:
        comp = comp.to(torch.bfloat16)   # what autocast computes in; Transformer._apply keeps RoPE in fp32
    for model in (comp.encoder, comp.decoder):
        model.grad_ckpt = grad_ckpt
    params = {id(p) for p in comp.parameters()}
    kept = {}

    def pack(t):
        base = t if t._base is None else t._base
        if id(base) in copied:   # a new bf16 copy each use: autocast caches only what needs a gradient
            kept[("copy", len(kept))] = (None, base.numel() * 2)
        elif id(base) not in params and id(t) not in params:
            kept[id(base)] = (base, base.untyped_storage().nbytes())   # the reference keeps the id unique
        return t
    step = make_step(comp)
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
    weights: int          # bytes, per GPU (under --fsdp: the shards, the root unit whole, two blocks gathered)
    grads: int
    optimizer: int
    activations: int      # one micro-batch, OVERHEAD included
    micro: int            # examples per micro-batch and GPU
    gpus: int = 1
    fsdp: bool = False
    build: int = 0        # bytes per GPU while the compressor is built (--fsdp: its shards and one tensor whole)
    save: int = 0         # host bytes a checkpoint's save adds per process

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return max(self.total, self.build) <= CARD_GB * GB


def make_plan(cfg, run, make_step, shape: str | None = None) -> Plan:
    """The memory per GPU of `run` (a cli.Run: its micro-batch, processes, --fsdp, --grad-ckpt and dtypes) training
    the compressor of `cfg`; make_step: comp -> the run's step module (saved_bytes); shape: --shape."""
    autocast, gpus, fsdp, micro = run.bf16, run.world, run.fsdp, run.micro
    comp = build_on_meta(cfg, shape, run.frozen)
    blocks = compressors.blocks(comp)
    sharded = {id(p) for b in blocks for p in b.parameters()} if fsdp else set()
    params, weights, trained, root, root_trained, largest = {}, 0, 0, 0, 0, 0
    for p in comp.parameters():   # distinct tensors: a tied or shared one counts once
        kind = ("trained" if p.requires_grad else "frozen", str(p.dtype).removeprefix("torch."))
        params[kind] = params.get(kind, 0) + p.numel()
        weights += p.numel() * p.element_size()
        trained += p.numel() if p.requires_grad else 0
        largest = max(largest, p.numel() * p.element_size() if p.requires_grad else 0)
        if id(p) not in sharded:
            root += p.numel() * p.element_size()
            root_trained += p.numel() if p.requires_grad else 0
    copies = 2 * (root_trained if fsdp else trained) if autocast else 0   # autocast's cached bf16 copies
    batch = example_batch(comp, run.sampling, run.answer_tokens, micro)
    saved = saved_bytes(comp, make_step, batch, autocast, run.grad_ckpt, sharded) + copies
    if run.grad_ckpt:   # backward recomputes one block at a time and keeps its activations meanwhile: one
        # block's share of what the run without checkpointing saves (the decoder's layer count, an upper bound where
        # a shorter encoder's blocks are larger)
        whole = build_on_meta(cfg, shape, run.frozen)
        saved += saved_bytes(whole, make_step, example_batch(whole, run.sampling, run.answer_tokens, micro), autocast,
                             False, sharded) // comp.decoder.config.num_hidden_layers
    activations = int(OVERHEAD * saved)
    if not fsdp:   # every GPU holds everything; DDP adds its gradient buckets
        return Plan(params, weights, 4 * trained * (2 if gpus > 1 else 1), 8 * trained, activations, micro, gpus,
                    build=weights, save=4 * trained)
    gathered = 2 * max(sum(p.numel() * (2 if autocast else p.element_size()) for p in b.parameters())
                       for b in blocks)   # the running block and the prefetched next one (bf16: MixedPrecisionPolicy)
    # the build: the shards, and the largest tensor whole as it is read or drawn, in the frozen dtype (a linear or MLP
    # bridge is drawn as a whole module)
    bridge = getattr(comp.bridge, "inner", comp.bridge)
    drawn = sum(p.numel() for p in bridge.parameters()) \
        if isinstance(bridge, (compressors.LinearBridge, compressors.MLPBridge)) else 0
    whole = max(drawn, *(p.numel() for p in comp.parameters())) * run.frozen.itemsize
    return Plan(params, -(-weights // gpus) + root + gathered, 4 * (-(-trained // gpus) + root_trained),
                8 * -(-trained // gpus), activations, micro, gpus, fsdp, build=-(-weights // gpus) + whole,
                save=-(-largest // gpus) + COPY_AHEAD)


def describe(plan: Plan, cfg, run, shape: str | None, frozen_dtype: str) -> str:
    """The plan as train.py --plan prints it: of `run` (a cli.Run) training `cfg`'s compressor; shape: --shape;
    frozen_dtype: the flag as typed (auto, fp32 or bf16)."""
    gb = lambda b: f"{b / GB:8.2f} GB"
    where = shape and f"a {shape} shape" or cfg.model
    spread = (f", --fsdp over {plan.gpus} GPU(s)" if plan.fsdp else f", DDP over {plan.gpus} GPUs" if plan.gpus > 1
              else "")
    lines = [f"memory plan: {cfg.method} ({run.sampling.objective}) on {where}, micro-batch {plan.micro} per GPU of "
             f"batch {run.sampling.batch_size}{spread}, |X| up to {run.sampling.max_len}"
             f"{', --grad-ckpt' if run.grad_ckpt else ''}, --frozen-dtype {frozen_dtype} (per GPU, GB = 10^9 bytes, "
             "nothing allocated: plan.py)"]
    for (kind, dtype), n in sorted(params.items() if (params := plan.params) else []):
        lines.append(f"  parameters {kind:7} {dtype:8} {n:>15,}")
    shards = "   (the shards; the root unit whole and two blocks gathered)" if plan.fsdp else ""
    lines += [f"  weights        {gb(plan.weights)}{shards}", f"  gradients      {gb(plan.grads)}",
              f"  AdamW states   {gb(plan.optimizer)}",
              f"  activations    {gb(plan.activations)}   (counted saved tensors x {OVERHEAD}, calibrated on CUDA)",
              f"  total          {gb(plan.total)}   {'fits' if plan.fits else 'does not fit'} on one {CARD_GB} GB card",
              f"  build          {gb(plan.build)}   "
              + ("(built on the meta device, sharded, then filled: the shards and one tensor whole)" if plan.fsdp
                 else "(the whole compressor, built on each GPU)"),
              f"  checkpoint     {gb(plan.save)}   of host memory per process at a save ("
              + ("DCP: its own shards, one at a time)" if plan.fsdp else "the trained tensors, whole)")]
    if not plan.fits:
        lines.append("  (less: --micro-batch, --grad-ckpt, --frozen-dtype bf16; or shard: --fsdp --gpus N, then "
                     "torchrun --nproc_per_node N ... --fsdp)")
    return "\n".join(lines)


def show(cfg, run, make_step, shape: str | None, frozen_dtype: str):
    """train.py --plan: print the plan of `run` (a cli.Run) training `cfg`'s compressor, and exit."""
    print(describe(make_plan(cfg, run, make_step, shape), cfg, run, shape, frozen_dtype))
