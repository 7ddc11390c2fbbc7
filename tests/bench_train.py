"""Benchmark (not a test): training throughput for every method, as a markdown table.

    python tests/bench_train.py [--steps 12] [--methods aoc icae ...]            # train.py on `tiny`, CPU (and CUDA)
    python tests/bench_train.py --shape llama-3.2-1b --device cuda [--peak-tflops 989]
    python tests/bench_train.py --shape llama-3.2-1b --batch paper --micro-batch 16 --modes eager compile cuda-graphs
    python tests/bench_train.py --steps 8 --profile --method 500x --objective ae --model DIR ...   # where the time goes
    python tests/bench_train.py --profile --method aoc --model DIR --batch-size 4   # on CUDA: kernels vs launches

Default: each method runs its defaults on `tiny` through train.py, as the quickstart does (there: the tiny demo's
settings, cli.TINY: AE on 16-byte texts, batch 4; on another --model, the paper's recipe); the median over
the steps after the first two is reported.
tok/s counts every token a step reads: the compressed contexts plus every decoder sequence (train.py's log).

--shape llama-3.2-1b|qwen3-4b: a randomly initialised model of that paper model's shape (no download), bf16 autocast on
CUDA, each method's compressor at the paper's lengths and batch 4 (--batch paper: its recipe's), timed over AdamW
steps of its default objective (distill as AE for CompLLM: its teacher is a data step), eager or compiled as
train.py --compile runs them (--modes), with the CUDA kernels one step launches. Model FLOPs utilisation = achieved /
peak, the step's FLOPs counted matrix product by matrix product from the step itself (step_flops, on a meta-device
copy: nothing is allocated), peak = --peak-tflops (H100 SXM dense bf16: 989).
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compressors as C  # noqa: E402
import presets as P  # noqa: E402
import runlog  # noqa: E402
import train  # noqa: E402
import model as M  # noqa: E402
from model import SHAPES, build_shape  # noqa: E402

def sdpa_mask_with_gqa(q, k, v, mask, is_causal, scale):
    """The attention call --attention mask-gqa times: a mask together with enable_gqa, which CUDA's fused kernels do not
    take (flash takes no mask, memory-efficient and cuDNN no GQA), so SDPA runs its math path (model.sdpa repeats K/V
    where a mask is given instead)."""
    return M.F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                            enable_gqa=q.shape[1] != k.shape[1])


def fused_only():
    """A context in which SDPA may use flash, memory-efficient or cuDNN attention but not the math path: a call
    that needs the math path raises instead of running slowly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


# ---- model FLOPs: what MFU divides by ----

# matrix products the count below does not know: one of them in a step raises instead of going uncounted
UNCOUNTED = ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum")


class MatmulRecorder(TorchFunctionMode):
    """While active, every matrix product computed, as (forward FLOPs, its output, whether each operand needs a
    gradient), in `products` (step_flops)."""

    def __init__(self):
        super().__init__()
        self.products = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear:   # x (..., K) times weightᵀ (K, M): x.numel() / K rows, 2·K·M FLOPs each
            x, w = args[:2]
            self.products.append((2 * x.numel() * w.shape[0], out, (x.requires_grad, w.requires_grad)))
        elif func is F.scaled_dot_product_attention:   # q (B, H, T, D); k (B, H or Hkv, S, D); v (B, ., S, Dv)
            q, k, v = args[:3]
            B, H, T, D = q.shape
            S, Dv = k.shape[2], v.shape[3]
            self.products += [(2 * B * H * T * S * D, out, (q.requires_grad, k.requires_grad)),   # scores = q kᵀ
                              (2 * B * H * T * S * Dv, out, (q.requires_grad or k.requires_grad,  # y = P v: P needs
                                                             v.requires_grad))]                   # q's or k's grad
        elif getattr(func, "__name__", "") in UNCOUNTED:
            raise NotImplementedError(f"step_flops counts F.linear and SDPA, not {func.__name__}: count it first")
        return out


def backward_nodes(loss: torch.Tensor) -> set:
    """The autograd nodes that loss.backward() runs: every node reachable from the loss's."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(parent for parent, _ in node.next_functions)
    return seen


def step_flops(step) -> tuple:
    """The model FLOPs of one training step, (forward, backward), counted from the step as it runs: `step()` computes
    the loss (it is not back-propagated here) while MatmulRecorder records every matrix product, and the backward's
    share follows from where autograd's graph leads. The count is the same on the meta device (nothing allocated).

    A product of an (N, K) operand and a (K, M) one costs 2·N·K·M forward (a multiply and an add per term), and in
    backward 2·N·K·M more for each operand that needs a gradient (dX = dY Wᵀ, dW = Xᵀ dY), none where backward never
    reaches it (AOC's last encoder layer: the memory is its K/V, so its queries, attention and o_proj get no
    gradient). So per token through a weight matrix W:

        2·|W| forward, always;
        + 2·|W| for the input's gradient, where one flows back through W (upstream of anything trained: the frozen
          decoder's blocks above a memory, the frozen base of a LoRA layer);
        + 2·|W| for W's own gradient, only where W trains (LoRA's A and B, not its base; AOC's encoder copy; PCC's
          encoder; the bridges).

    A trained matrix costs 6·|W| a token, a frozen one a gradient flows through 4·|W|, a frozen one no gradient
    flows through 2·|W| (the usual 6 × parameters counts every matrix as the first). Tokens are the rows as run,
    padding included: a short chunk padded to the batch's longest encoder row counts at that length. The products:
    F.linear (every projection, LoRA's branch, the bridges, lm_head where logits are made: at the supervised
    positions only, chunked_cross_entropy) and SDPA's two per layer, q kᵀ (2·B·H·T·S·D; operands q, k) and P v
    (2·B·H·T·S·Dv; operands P, which needs a gradient when q or k does, and v). Attention is counted dense, every
    query against every key, as the masked kernels run it: the half a causal mask hides is not taken off (flash
    attention's causal kernel skips it, the memory-efficient kernel under a mask does not), and each of the H query
    heads counts under GQA. Not counted: embedding lookups (no arithmetic), norms, RoPE, activations, softmax and
    cross-entropy (a few FLOPs an element, against K an element of a product), and recomputation (--grad-ckpt's, the
    chunked loss's logits in backward): MFU counts the model's arithmetic once, not the hardware's."""
    with MatmulRecorder() as recorder:
        loss = step()
    reached = backward_nodes(loss)
    forward = sum(flops for flops, _, _ in recorder.products)
    backward = sum(flops * sum(needs) for flops, out, needs in recorder.products if out.grad_fn in reached)
    return forward, backward


def ae_step(comp, ids, ratios) -> tuple:
    """The step bench_shape times and counts: the contexts' memory, then AE's loss on the frozen decoder ->
    (loss, memory)."""
    memory = comp.compress(ids, ratios=ratios)
    return comp.lm_loss(memory, "ae", [comp.ae_target(x) for x in ids])[0], memory


def bench(method, device, steps, model):
    """One short run in a temporary directory -> (args, median seconds per step, median tokens per step)."""
    with tempfile.TemporaryDirectory() as out:
        argv = ["--method", method, "--model", model, "--steps", str(steps), "--out", out, "--device", device,
                "--save-every", str(10 * steps)]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train.main(argv)
        rows = runlog.read_log(out)[0][2:]   # skip warm-up steps
        args = json.load(open(os.path.join(out, "args.json")))
    return args, statistics.median(r["dt"] for r in rows), statistics.median(r["tokens"] for r in rows)


# what each aten op is, for the profile's summary (an op's name without its leading underscores starts with one of
# the words; the first kind that matches wins; the rest is "other")
CATEGORIES = (("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
              ("cross-entropy", ("log_softmax", "nll_loss", "cross_entropy")),
              ("attention", ("scaled_dot_product", "flash", "efficient_attention", "softmax")),
              ("optimizer", ("foreach", "adam", "fused_adam", "lerp", "addcdiv", "addcmul")),
              ("elementwise (norms, RoPE, activations)", ("mul", "add", "sub", "div", "rsqrt", "sqrt", "pow", "mean",
                                                         "silu", "gelu", "neg", "linalg_vector_norm", "sum", "where",
                                                         "masked_fill", "exp", "fill")),
              ("views, copies, allocation", ("copy", "to_copy", "to", "clone", "contiguous", "slice", "transpose",
                                             "view", "reshape", "select", "empty", "zeros", "ones", "cat", "stack",
                                             "index", "embedding", "expand", "unsqueeze", "as_strided", "split",
                                             "permute", "t", "narrow", "detach", "resize")))


def profile(argv, steps=6, skip=2, top=12):
    """Where a training step's time goes: train.py with these flags under torch.profiler for `steps` steps (the first
    `skip` left out as warm-up, by taking the profile's share only of the steps after them), as two tables: the
    ops that take the most self CPU time, and the time by kind of op."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, schedule
    cuda = torch.cuda.is_available() and "cpu" not in argv   # train.py's device: CUDA unless --device cpu
    with tempfile.TemporaryDirectory() as out:
        sched = schedule(wait=0, warmup=skip, active=steps - skip, repeat=1)
        step_fn = train.train_step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities, schedule=sched) as prof:
            def stepped(*a, **kw):   # one profiler step per optimizer step
                row = step_fn(*a, **kw)
                prof.step()
                return row
            train.train_step = stepped
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    train.main([*argv, "--steps", str(steps), "--out", out, "--save-every", str(10 * steps),
                                "--eval-every", "0"])
            finally:
                train.train_step = step_fn
            dts = [r["dt"] for r in runlog.read_log(out)[0][skip:]]
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    per_step = statistics.mean(dts)
    print(f"\n{' '.join(argv)}: {per_step * 1000:.0f} ms/step over {len(dts)} steps, "
          f"{torch.get_num_threads()} threads\n")
    print("| op | share of self CPU time | calls per step |\n|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key} | {100 * e.self_cpu_time_total / total:.1f}% | {e.count / len(dts):.0f} |")
    share = {}
    for e in events:
        name = e.key[len("aten::"):].lstrip("_")
        kind = next((k for k, words in CATEGORIES if any(name.startswith(w) for w in words)), "other")
        share[kind] = share.get(kind, 0) + e.self_cpu_time_total
    print("\n| kind | share |\n|---|---|")
    for kind, t in sorted(share.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {100 * t / total:.1f}% |")
    # kernels against overhead: a step is launch-bound when the device computes for a small part of its wall time
    n = len(dts)
    calls = sum(e.count for e in events) / n
    rows = [("wall time per step", f"{per_step * 1000:.1f} ms"), ("aten op calls per step", f"{calls:,.0f}"),
            ("self CPU time in aten ops per step", f"{total / n / 1000:.1f} ms (the rest of the CPU's time: Python, "
                                                   "the dispatcher, the framework)")]
    if cuda:   # kernel events: their count and the time the GPU spent in them
        kernels = cuda_kernels(prof)
        busy = sum(e.time_range.elapsed_us() for e in kernels) / n / 1e3   # ms per step in kernels
        rows += [("CUDA kernels per step", f"{len(kernels) / n:,.0f}"), ("GPU time in kernels per step",
                 f"{busy:.1f} ms ({100 * busy / (per_step * 1000):.0f}% of the step: the rest the GPU waits on "
                 "launches, the CPU and copies)"),
                 ("wall time per kernel launched", f"{per_step * 1e6 / max(1, len(kernels) / n):.1f} us")]
    print("\n| where a step's time goes | |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


def cuda_kernels(prof) -> list:
    """The CUDA kernel events a torch.profiler run recorded (a CUDA graph's replay: the kernels it holds, where the
    profiler sees them)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernels_per_step(step) -> int:
    """The CUDA kernels one call of step() launches (a step on CUDA)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return len(cuda_kernels(prof))


def bench_shape(shape, method, device, steps, batch=4, frozen=torch.float32, mode="eager", fused=False, micro=None):
    """AdamW steps of one preset around a random decoder of a paper model's shape in bf16 autocast:
    (seconds per step, tokens per step, model FLOPs per step: step_flops, on a meta-device copy, kernels per step:
    kernels_per_step). frozen: the frozen base weights' dtype, as train.py --frozen-dtype (trained tensors fp32);
    mode: eager, compile (train.py --compile: each model compiled whole) or cuda-graphs (train.py --compile
    --cuda-graphs: static shapes, reduce-overhead, a capturable AdamW); micro: examples per forward and backward,
    the step's gradients accumulated over batch / micro of them, as train.py --micro-batch; fused: every step, and
    then a generation from one memory (evaluate.py's), inside fused_only(), so a math-path call raises."""
    torch.manual_seed(0)
    decoder, tok = build_shape(shape, device, dtype=frozen)   # ids below the tiny vocabulary: any tokenizer will do
    comp = C.build(method, decoder, tok).set_dtypes(frozen)
    if mode != "eager":
        train.compile_models(comp, cuda_graphs=mode == "cuda-graphs")
    recipe = P.PRESETS[method].recipe
    n = recipe.lengths[1] // (2 if recipe.objective == "pretrain" else 1)
    opt = train.make_optimizer(comp, 1e-5, (0.9, 0.999), 0.0, None, torch.device(device),
                               capturable=mode == "cuda-graphs")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 250, (n,), generator=g).tolist() for _ in range(batch)]
    micro = micro or batch
    chunks = [ids[i:i + micro] for i in range(0, batch, micro)]
    autocast = torch.autocast(device, dtype=torch.bfloat16) if device == "cuda" or frozen == torch.bfloat16 else \
        contextlib.nullcontext()
    ratios = lambda chunk: [4] * len(chunk) if comp.cfg.source == "group_mean" else None

    def step():
        with fused_only() if fused else contextlib.nullcontext():   # (backward too: it runs the kernels' backward)
            for chunk in chunks:
                if mode == "cuda-graphs":   # as train.train_step: a new iteration of the graphs per forward
                    torch.compiler.cudagraph_mark_step_begin()
                with autocast:
                    loss, memory = ae_step(comp, chunk, ratios(chunk))
                (loss * len(chunk) / batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return memory

    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        memory = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    kernels = kernels_per_step(step) if device == "cuda" else float("nan")
    if fused:   # the evaluation side: a memory and a few generated tokens, the math path still shut
        with torch.no_grad(), autocast, fused_only():
            comp.generate(comp.compress(ids[:2], ratios=ratios(ids[:2])), "ae", max_new_tokens=4)
    m = sum(memory.slots[0])
    enc_tokens, dec_tokens = batch * (n + m), batch * (n + 2 + (m if comp.cfg.carrier == "embeds" else 0))
    meta = C.build(method, build_shape(shape, "meta")[0], tok)   # the same step's shapes, nothing allocated
    flops = sum(sum(step_flops(lambda: ae_step(meta, chunk, ratios(chunk))[0])) for chunk in chunks)
    return statistics.median(times[2:] or times), enc_tokens + dec_tokens, flops, kernels


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--methods", nargs="+", default=list(P.METHODS), choices=P.METHODS)
    p.add_argument("--model", default="tiny")
    p.add_argument("--shape", choices=tuple(SHAPES), help="a random model of this shape instead of train.py")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--frozen-dtype", nargs="+", default=["fp32"], choices=("fp32", "bf16"), help="--shape: the "
                   "frozen weights' dtype(s) to time (train.py --frozen-dtype; trained ones stay fp32)")
    p.add_argument("--batch", default="4", help="--shape: examples per step (default 4), or paper: each preset's "
                   "recipe batch")
    p.add_argument("--micro-batch", type=int, help="--shape: examples per forward and backward (train.py "
                   "--micro-batch; default: the whole batch)")
    p.add_argument("--modes", nargs="+", default=["eager"], choices=("eager", "compile", "cuda-graphs"),
                   help="--shape: how each step runs: eager, compile (train.py --compile: each model whole) and/or "
                   "cuda-graphs (train.py --compile --cuda-graphs, CUDA only)")
    p.add_argument("--attention", nargs="+", default=["repeat-kv"], choices=("repeat-kv", "mask-gqa"), help="--shape: "
                   "the attention call(s) to time: repeat-kv (model.sdpa: K/V repeated where a mask is given) and/or "
                   "mask-gqa (a mask with enable_gqa: CUDA's math path)")
    p.add_argument("--fused-only", action="store_true", help="--shape: run every step and a generation with SDPA's "
                   "math path shut (flash, memory-efficient, cuDNN only): a call that needs it raises")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's dense bf16 peak (H100: 989)")
    p.add_argument("--profile", nargs=argparse.REMAINDER, metavar="TRAIN.PY-FLAGS", help="instead: where one "
                   "training step's time goes, train.py with these flags under torch.profiler (give it last)")
    a = p.parse_args()
    if a.profile:
        profile(a.profile, steps=a.steps)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    if a.shape:
        if "cuda-graphs" in a.modes and a.device != "cuda":
            p.error("--modes cuda-graphs: CUDA graphs need --device cuda")
        if a.batch != "paper" and not a.batch.isdigit():
            p.error(f"--batch {a.batch}: a number of examples, or paper")
        print(f"\n{a.shape} shape, bf16 autocast on {a.device}, the paper's lengths, batch {a.batch}"
              f"{f' in micro-batches of {a.micro_batch}' if a.micro_batch else ''}; MFU from the step's own FLOPs "
              "(step_flops)\n")
        print("| method | frozen | attention | mode | batch | ms/step | tokens/step | tok/s | TFLOP/s | MFU | "
              "kernels/step | peak GiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        repeat_kv = M.sdpa
        for method in a.methods:
            batch = P.PRESETS[method].recipe.batch_size if a.batch == "paper" else int(a.batch)
            for name in a.frozen_dtype:
                for attention in a.attention:
                    for mode in a.modes:
                        if a.device == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats()
                        M.sdpa = repeat_kv if attention == "repeat-kv" else sdpa_mask_with_gqa
                        try:
                            dt, tokens, flops, kernels = bench_shape(
                                a.shape, method, a.device, a.steps, batch,
                                torch.bfloat16 if name == "bf16" else torch.float32, mode, a.fused_only,
                                a.micro_batch)
                        finally:
                            M.sdpa = repeat_kv
                        torch._dynamo.reset()   # the next preset compiles its own graphs
                        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else float("nan")
                        print(f"| {method} | {name} | {attention} | {mode} | {batch} | {dt * 1000:.0f} | {tokens} | "
                              f"{tokens / dt:,.0f} | {flops / dt / 1e12:.1f} | "
                              f"{100 * flops / dt / 1e12 / a.peak_tflops:.1f}% | {kernels:,.0f} | {peak:.1f} |",
                              flush=True)
        if a.fused_only:
            print(f"\nevery step and generation above ran with SDPA's math path shut ({', '.join(a.methods)})")
        return
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
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
