"""A training step's forward and backward as a GPU runs them: no host sync, and glue that does not grow with the batch.

On CUDA the host stalls until the GPU's queue drains wherever a step reads a value back (`.item()`, `bool(t)`,
`nonzero`, `masked_select`: aten's _local_scalar_dense and kin) or copies a tensor built from Python lists to the
GPU from pageable memory (`torch.tensor(ids, device=...)`, `mask.to(device)`). train.step_inputs builds all of those
before the step (compressors.EncoderInputs, DecoderInputs, DistillInputs); the forward and backward may not make one.
Both are counted here without a GPU: the decoder is built on the `meta` device, so a tensor made on the host is told
apart from the model's (a CPU tensor reaching an op is one the host built there), and meta ops cost nothing.

The ops outside the transformer blocks (reading the memory off the encoder, padding it, building the decoder's rows,
taking the loss) are one op per tensor whatever the batch: the aten ops of a step are the same in number at batch 4
and batch 16 (the blocks' own are too, which makes the count of all of them the check).

Under --compile (train.compile_models) each model's forward is one graph: no graph break in any preset's encoder or
decoder forward (torch._dynamo.explain), no recompile once the first step has compiled, and the same losses as eager.
"""

import os
import sys
from collections import Counter

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compressors as C  # noqa: E402
import data as D  # noqa: E402
import presets as P  # noqa: E402
import train  # noqa: E402
from model import TINY_CONFIG, ModelConfig, Transformer, build_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten
# reading a device value to the host: each waits for every kernel queued before it
READS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.equal}
SETTINGS = {"icae": dict(mem=4, chunk_len=16, lora_r=2), "500x": dict(mem=4, chunk_len=16, lora_r=2),
            "pcc": dict(mem=4, chunk_len=16), "pic": dict(mem=4, chunk_len=16), "compllm": dict(lora_r=2),
            "gmsa": dict(lora_r=2), "aoc": dict(mem=4, chunk_len=16)}
WORDS = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April! Were clocks striking?".split()


class StepOps(TorchDispatchMode):
    """Counts the aten ops run under it: every op (`ops`), and those that stall the host on CUDA (`syncs`): a read of
    a device value (READS), a tensor made from Python data (lift_fresh: torch.tensor), and any op that takes a tensor
    of the host (with the model on meta: a copy to the device, or host work inside the step)."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        if func.overloadpacket in READS:
            self.syncs["read " + func.overloadpacket.__name__] += 1
        elif func.overloadpacket is aten.lift_fresh:
            self.syncs["from Python data"] += 1
        elif any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
                 for t in tree_leaves((args, kwargs))):
            self.syncs[f"host tensor into {func.overloadpacket.__name__}"] += 1
        return func(*args, **kwargs)


def build(method, device, layers=TINY_CONFIG["num_hidden_layers"]):
    tok = build_tiny()[1]
    with torch.device(device):
        decoder = Transformer(ModelConfig.from_hf({**TINY_CONFIG, "num_hidden_layers": layers}))
    return C.build(method, decoder, tok, **SETTINGS[method])


def batch_of(comp, objective, n, lengths=None):
    """A micro-batch of n contexts of 2 to 17 words (one or more chunks, so rows are padded) for `objective`; or, with
    `lengths`, of that many contexts of these numbers of bytes."""
    tok = comp.tok
    text = tok.encode(" ".join(WORDS))
    texts = [text[i:i + k] for i, k in enumerate(lengths)] if lengths else \
        [tok.encode(" ".join(WORDS[i % 5:i % 5 + 2 + (7 * i) % 16])) for i in range(n)]
    n = len(texts)
    qa = [comp.qa_parts("Ctx.", "Why?") for _ in texts]
    fields = dict(ae=dict(ae=[comp.ae_target(t) for t in texts]),
                  pretrain=dict(ae=[comp.ae_target(t) for t in texts], lm=[[7, 8, tok.eos_id]] * n,
                                last=[t[-1] for t in texts]),
                  qa=dict(qa=[p["prompt"] + [5, tok.eos_id] for p in qa], n_answer=[2] * n,
                          prefix=[p["prefix"] for p in qa]),
                  distill=dict(question=[p["prompt"] for p in qa], answer=[[5, 6, tok.eos_id]] * n,
                               prefix=[p["prefix"] for p in qa], dec_context=texts))[objective]
    ratios = [comp.cfg.ratios[i % len(comp.cfg.ratios)] for i in range(n)] if comp.cfg.source == "group_mean" else None
    return D.Batch(context=texts, tokens=0, ratios=ratios, norm=dict(ae=500, lm=50, qa=50, distill=n, texts=n),
                   **fields)


def step_ops(comp, objective, n, own_other_weight=0.0) -> StepOps:
    """One step's forward and backward over a micro-batch of n, its inputs built first (as train.micro_batches does),
    counted. (The AE objective's ops are pretraining's AE half.)"""
    batch = batch_of(comp, objective, n)
    batch.inputs = train.step_inputs(comp, objective, batch, comp.device)
    step = train.TrainStep(comp, objective, 0.5, own_other_weight)
    with StepOps() as seen:
        loss, _ = step(batch)
        loss.backward()
    comp.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("method", P.METHODS)
def test_a_training_step_never_waits_for_the_device(method):
    comp = build(method, "meta")
    for objective in ("pretrain", "distill"):   # QA's step runs pretraining's ops (one decoder pass, not two)
        assert step_ops(comp, objective, 2).syncs == Counter(), (method, objective)


@pytest.mark.parametrize("method", P.METHODS)
def test_the_ops_of_a_step_do_not_grow_with_the_batch(method):
    """Every preset pretraining, which compresses once and takes two decoder losses (AE and LM; a QA step runs the
    same ops once), on the CPU. (CompLLM's distillation is left out: it takes each example's σ in a loop of its own,
    CompLLM Eq. 2.)"""
    comp = build(method, "cpu")
    at_4, at_16 = step_ops(comp, "pretrain", 4).ops, step_ops(comp, "pretrain", 16).ops
    assert at_4 == at_16, (method, at_16 - at_4, at_4 - at_16)


def test_the_levers_against_the_collapse_never_wait_and_do_not_grow_with_the_batch():
    """Ours, ICAE's AE step with both levers on: --mem-from-text (each slot's segment mean, read off the encoder rows
    on the device) and --own-other-weight (a second decoder pass with the neighbours' memories, traded by a flip of
    the batch dimension): no host sync, and the same ops at batch 4 and 16 (one chunk per text, so that neighbours
    have the same slots)."""
    levers = dict(mem=4, chunk_len=200, lora_r=2, mem_from_text=True)
    tok = build_tiny()[1]
    with torch.device("meta"):
        decoder = Transformer(ModelConfig.from_hf(TINY_CONFIG))
    assert step_ops(C.build("icae", decoder, tok, **levers), "ae", 4, 0.5).syncs == Counter()
    comp = C.build("icae", *build_tiny(), **levers)
    at_4, at_16 = step_ops(comp, "ae", 4, 0.5).ops, step_ops(comp, "ae", 16, 0.5).ops
    assert at_4 == at_16, (at_16 - at_4, at_4 - at_16)


# ---- --compile: one graph per model, compiled at the first step ----


def step(comp, objective, batch):
    """One step's forward and backward (train.TrainStep) over `batch`, its inputs built first; returns the loss."""
    batch.inputs = train.step_inputs(comp, objective, batch, comp.device)
    loss, _ = train.TrainStep(comp, objective, 0.5)(batch)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("method", P.METHODS)
def test_every_model_forward_of_a_step_is_one_graph(method):
    """--compile compiles each model's whole forward with dynamic shapes (train.compile_models), so no forward may
    break its graph: torch._dynamo.explain, with every dimension symbolic as there, finds one graph and no break in
    every forward of a training step, the encoder's and the decoder's (and GMSA's LSA), on the tiny GQA model (4 query
    heads over 2 K/V heads), each explained as it is called: with the step's arguments, its LoRA switched as then
    (ICAE's encoder IS its decoder), under the step's gradient mode. A pretraining step of a 3- and a 4-byte text, so
    that the decoder runs once with a mask (AE: rows of two lengths) and once without (LM: rows of one length); and
    CompLLM's own objective, distillation (its teacher without gradients, its student with every layer's hidden
    states). Each way a model runs is explained once, on 1 block (a break does not depend on the depth)."""
    comp = build(method, "cpu", layers=1)
    explained, seen = [], set()

    def explain(model, args, kwargs):   # a forward pre-hook: dynamo traces the forward about to run
        lora = tuple(m.lora_enabled for m in model.modules() if hasattr(m, "lora_enabled"))
        way = (id(model), lora, torch.is_grad_enabled(), kwargs.get("attn_mask") is None,
               kwargs.get("output_hidden_states", False))
        if way not in seen:
            seen.add(way)
            with torch._dynamo.config.patch(assume_static_by_default=False):   # dynamic=True's shapes
                explained.append(torch._dynamo.explain(model.forward)(*args, **kwargs))
    hooks = [model.register_forward_pre_hook(explain, with_kwargs=True) for model in C.models(comp)]
    try:
        for objective in ("pretrain", "distill") if method == "compllm" else ("pretrain",):
            step(comp, objective, batch_of(comp, objective, 2, [3, 4]))
    finally:
        for hook in hooks:
            hook.remove()
    assert {way[3] for way in seen} == {True, False}, seen   # a forward without a mask and one with
    assert [(e.graph_count, e.graph_break_count) for e in explained] == [(1, 0)] * len(explained), \
        [str(reason) for e in explained for reason in e.break_reasons]


def test_a_compiled_step_recompiles_nothing_after_its_first():
    """train.compile_models' graphs take any length (dynamic shapes): 5 steps of one shape compile at the first step
    and never again; then 5 steps whose lengths all differ (rows of several chunks, padded) compile at most one graph
    more per model, at the first of them (its first padded decoder rows: a mask where there was none), and none after
    it; no graph breaks. Counted with a backend that counts what dynamo hands it, on AOC (2 blocks)."""
    comp = build("aoc", "cpu", layers=2)
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()   # (reset() keeps the graph breaks seen before)
    train.compile_models(comp, backend=counter)
    graphs = []
    for s in range(10):
        lengths = [12] * 4 if s < 5 else [3 + (7 * s + 11 * i) % 37 for i in range(4)]   # of one shape, then not
        step(comp, "pretrain", batch_of(comp, "pretrain", 4, lengths))
        comp.zero_grad(set_to_none=True)
        graphs.append(counter.frame_count)
    models = len(C.models(comp))
    assert graphs[0] == models and graphs[1:5] == [graphs[0]] * 4, graphs   # one shape: compiled once
    assert graphs[5] <= graphs[0] + models and graphs[6:] == [graphs[5]] * 4, graphs   # lengths that vary
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compiled_losses_are_eagers():
    """The compiled step is the eager one: ICAE, whose LoRA encoder IS the decoder (run with LoRA off, a graph of its
    own), with --grad-ckpt (each block recomputed in backward, inside the graph), over 3 AdamW steps of varying
    lengths: the same losses and gradient norms within 1e-6 relative, from two graphs (LoRA on, LoRA off). The graphs
    run on the eager backend (dynamo's capture, which a graph of the wrong LoRA state or a stale guard would break);
    inductor's kernels, which fuse and may sum in another order, are checked within 1e-4 on AOC by
    tests/test_scale.py."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        comp = build("icae", "cpu", layers=2)
        for model in C.models(comp):
            model.grad_ckpt = True
        counter = CompileCounterWithBackend("eager")
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            train.compile_models(comp, backend=counter)
        opt = torch.optim.AdamW(comp.trainable_parameters(), lr=1e-2)
        rows = []
        for s in range(3):
            loss = step(comp, "pretrain", batch_of(comp, "pretrain", 3, [5 + 9 * s, 20, 9 + 3 * s]))
            norm = torch.nn.utils.clip_grad_norm_(comp.trainable_parameters(), float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append((loss.item(), norm.item()))
        runs.append(rows)
    assert counter.frame_count == 2   # the model with LoRA on (the encoder) and off (the decoder), at any length
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for (loss, norm), (c_loss, c_norm) in zip(*runs, strict=True):
        assert abs(c_loss - loss) <= 1e-6 * abs(loss) and abs(c_norm - norm) <= 1e-6 * norm, runs
