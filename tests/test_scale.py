"""The papers' models on GPUs, tested on the CPU: frozen base weights in bf16 (train.py --frozen-dtype), the memory
plan (plan.py, train.py --plan), several processes (DDP and FSDP, train.py under torchrun), attention on CUDA's fused
kernels, --compile and --grad-ckpt.

bf16 frozen weights are the EPL and AOC code's dtype. On the CPU they run under bf16 autocast as CUDA does, so
every property of the fp32 path is checked again inside the bf16 mode: the same losses as fp32 within bf16's
rounding, a stopped run continues exactly, micro-batches give the full batch's step, and a checkpoint of either
mode continues in the other.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import checkpoint  # noqa: E402
import runlog  # noqa: E402
import cli  # noqa: E402
import compressors as C  # noqa: E402
import presets as P  # noqa: E402
import data as D  # noqa: E402
import evaluate as E  # noqa: E402
import train  # noqa: E402
from conftest import eval_rows, log_rows  # noqa: E402
from model import TINY_CONFIG  # noqa: E402
from test_train import ACCUMULATION  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = ["--lora-r", "8", "--lora-alpha", "16"]
# one run per kind of trained part: a full encoder copy (aoc), LoRA on the decoder itself (icae, pretrain: two
# losses), a separate fully trained LLM with frozen learned delimiters (pcc), LoRA on the first k layers + LSA blocks
# (gmsa), LoRA + distillation against the frozen LLM's own hidden states (compllm)
KINDS = {
    "aoc": ["--mem", "4"],
    "icae": ["--mem", "4", "--chunk-len", "16", *LORA, "--objective", "pretrain", "--crop", "window",
             "--min-len", "8", "--max-len", "40"],
    "pcc": ["--mem", "4", "--chunk-len", "16"],
    "gmsa": [*LORA, "--ratios", "2"],
    "compllm": [*LORA, "--objective", "distill", "--answer-tokens", "6", "--max-len", "48"],
}


def rows(out):
    return runlog.read_log(out)[0]


def run(argv, out, device="cpu"):
    train.main([*argv, "--out", str(out), "--device", str(device), "--eval-every", "0"])
    return rows(out)


# bf16's unit roundoff u: 8 significand bits (7 stored), round to nearest, so one rounding moves a value by at most
# 2^-8 relative (torch.finfo(torch.bfloat16).eps / 2)
BF16_U = torch.finfo(torch.bfloat16).eps / 2
# The bounds of a bf16 step against the fp32 step at the same weights on the same batch. Under autocast each matmul
# rounds both inputs to bf16 (u each) and accumulates in fp32; the residual stream, the norms and the cross-entropy
# stay fp32, so the blocks' errors add instead of compounding, and a logit moves by about u of its size. A token's
# cross-entropy moves by at most twice its largest logit's error, and the mean over the step's supervised tokens
# averages independent roundings: 2u (7.8e-3) on the loss. A gradient is a product of two rounded factors in each
# matmul of the backward, through the decoder and the encoder in series (tiny: 4 blocks of 4 matmuls each way, 2u
# each, their errors adding in the residual stream): 16u (6.25e-2) on the gradient norm. Measured, tiny, the five
# kinds, steps 1-3, AVX-512 and AVX2 kernels: at most 2.1e-3 (0.54u) on the loss (compllm) and 1.7e-2 (4.3u) on the
# gradient norm (pcc).
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 2 * BF16_U, 16 * BF16_U


@pytest.mark.parametrize("method", KINDS)
def test_bf16_frozen_weights_train_as_fp32_within_bf16_rounding(method, tmp_path):
    """--frozen-dtype bf16 against fp32, each step at the same weights: the bf16 run's loss and gradient norm at
    steps 1-3 within bf16 rounding (BF16_LOSS_RTOL, BF16_GRAD_RTOL) of an fp32 step on the same batch from the same
    state, while the two really differ (a bf16 mode that silently stayed fp32 would match to 1e-7).

    Why not two whole runs side by side: AdamW's first update is about lr * sign(g), so a rounding that flips the
    sign of a near-zero gradient component moves that weight by 2 lr, and from step 2 on the two runs train
    different weights; how far apart they drift depends on the CPU's kernels (AVX-512 or AVX2), not on the bf16
    mode. So step 1 is compared with an fp32 run from the same init, and each later step k with the bf16 run's own
    checkpoint of step k - 1 continued one step in fp32 (--resume may change --frozen-dtype; the data order and
    the trained state continue exactly)."""
    base = ["--method", method, "--model", "tiny", *KINDS[method], "--batch-size", "4", "--lr", "3e-3",
            "--warmup", "0", "--steps", "3", "--seed", "1"]
    fp32_first = run(base + ["--frozen-dtype", "fp32", "--stop-after", "1"], tmp_path / "fp32")[0]
    bf16_dir = tmp_path / "bf16"
    run(base + ["--frozen-dtype", "bf16", "--stop-after", "1"], bf16_dir)
    same_weights = [fp32_first]
    for k in (1, 2):
        shutil.copytree(bf16_dir, tmp_path / f"fp32_from_{k}")     # the bf16 run's state after step k ...
        train.main(["--resume", str(tmp_path / f"fp32_from_{k}"), "--frozen-dtype", "fp32", "--stop-after",
                    str(k + 1), "--device", "cpu"])                  # ... stepped once more in fp32
        same_weights.append(rows(tmp_path / f"fp32_from_{k}")[k])
        train.main(["--resume", str(bf16_dir), "--stop-after", str(k + 1), "--device", "cpu"])
    bf16 = rows(bf16_dir)
    for a, b in zip(same_weights, bf16, strict=True):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= BF16_LOSS_RTOL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= BF16_GRAD_RTOL * a["grad_norm"], (a, b)
    assert any(a["loss"] != b["loss"] for a, b in zip(same_weights, bf16))
    # what a bf16 run keeps in which dtype: frozen base weights bf16, everything trained or saved fp32
    cfg = cli.parse_args(base + ["--frozen-dtype", "bf16", "--out", str(tmp_path / "x")]).config
    comp = train.build_compressor(cfg, torch.device("cpu"), frozen=torch.bfloat16)
    for name, p in comp.named_parameters():
        want = torch.float32 if p.requires_grad or C.is_saved(comp.cfg, name) else torch.bfloat16
        assert p.dtype == want, (name, p.dtype)
    assert comp.decoder.model.embed_tokens.weight.dtype == torch.bfloat16   # the bulk is bf16
    assert comp.decoder.lm_head.weight is comp.decoder.model.embed_tokens.weight   # still tied
    saved = load_file(str(tmp_path / "bf16" / "compressor.safetensors"))
    assert saved and all(t.dtype == torch.float32 for t in saved.values())   # checkpoints are the same either way


@pytest.mark.parametrize("method", ["icae", "gmsa"])
def test_bf16_stop_after_then_resume_equals_an_uninterrupted_run(method, tmp_path):
    base = ["--method", method, "--model", "tiny", *KINDS[method], "--batch-size", "2", "--lr", "3e-3",
            "--steps", "6", "--frozen-dtype", "bf16", "--crop", "window", "--min-len", "16", "--max-len", "48"]
    full = run(base, tmp_path / "full")
    run(base + ["--stop-after", "3"], tmp_path / "part")
    train.main(["--resume", str(tmp_path / "part"), "--device", "cpu"])
    part = rows(tmp_path / "part")
    assert [r["step"] for r in part] == list(range(1, 7))
    for a, b in zip(full, part, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    w_full, w_part = (load_file(str(tmp_path / d / "compressor.safetensors")) for d in ("full", "part"))
    for name in w_full:
        torch.testing.assert_close(w_part[name], w_full[name], rtol=0, atol=0)


@pytest.mark.parametrize("objective", ["pretrain", "distill"])
def test_bf16_micro_batches_give_the_full_batch_step(objective, tmp_path):
    """test_train's micro-batch test in the bf16 mode: every step within the bounds of a bf16 step (BF16_LOSS_RTOL,
    BF16_GRAD_RTOL). A micro-batch rounds the same matmul inputs to bf16 (elementwise, whatever the shape) but runs
    other matmul shapes (another padded length too), which accumulate in fp32 in another order: their outputs differ
    where a bf16 rounding flips by one ulp, well inside one bf16 step's error; AdamW's sign-like steps carry that into
    the weights of steps 2-3 (measured, icae pretrain and compllm distill, AVX-512 and AVX2 kernels: 3e-4 on the loss
    at step 1), where fp32 agrees to 1e-5."""
    method = "icae" if objective == "pretrain" else "compllm"
    base = ["--method", method, "--model", "tiny", *KINDS[method], "--batch-size", "4", "--lr", "3e-3",
            "--warmup", "0", "--steps", "3", "--seed", "1", "--frozen-dtype", "bf16"]
    whole = run(base, tmp_path / "whole")
    for micro in ("2", "1"):
        for a, b in zip(whole, run(base + ["--micro-batch", micro], tmp_path / micro), strict=True):
            for key in ("loss", "grad_norm"):
                bound = BF16_LOSS_RTOL if key == "loss" else BF16_GRAD_RTOL
                assert abs(a[key] - b[key]) <= bound * abs(a[key]), (micro, a["step"], key, a[key], b[key])


def test_a_checkpoint_continues_in_the_other_dtype(tmp_path):
    """--frozen-dtype may change on --resume (a CPU run continues on a GPU): the checkpoint holds fp32 trained
    tensors either way, and the continued run is the other mode's run from that state."""
    base = ["--method", "pcc", "--model", "tiny", *KINDS["pcc"], "--batch-size", "2", "--lr", "3e-3", "--steps", "4"]
    for first, then in (("fp32", "bf16"), ("bf16", "fp32")):
        run(base + ["--frozen-dtype", first, "--stop-after", "2"], tmp_path / first)
        train.main(["--resume", str(tmp_path / first), "--frozen-dtype", then, "--device", "cpu"])
        resumed = rows(tmp_path / first)
        assert [r["step"] for r in resumed] == [1, 2, 3, 4]
        ref = run(base + ["--frozen-dtype", then], tmp_path / f"ref-{then}")
        for a, b in zip(ref[2:], resumed[2:], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 2e-2 * a["loss"]


# ---- the memory plan ----

import plan  # noqa: E402
from model import SHAPES  # noqa: E402


def step_of(s):
    """comp -> the run's step module, as train.main hands it to the plan."""
    return lambda comp: train.TrainStep(comp, s.objective, s.lm_weight)


def plan_of(argv):
    """train.py ARGV --plan's plan (plan.make_plan of the resolved settings and compressor config)."""
    s = cli.parse_args([*argv, "--plan"])
    return plan.make_plan(s.config, cli.planned(s), step_of(s), s.shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", P.METHODS)
def test_plan_of_every_preset_at_every_shape_allocates_nothing(method, shape, monkeypatch, capsys):
    """train.py --plan at a 7-8B shape builds the compressor on the meta device: every parameter is meta (no storage),
    and nothing is allocated on the CPU beyond noise (a real 8B build is 16-32 GB)."""
    import resource
    built = []
    original = plan.build_on_meta
    monkeypatch.setattr(plan, "build_on_meta", lambda *a: built.append(original(*a)) or built[-1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    train.main(["--method", method, "--shape", shape, "--plan", "--micro-batch", "1"])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert built and all(p.is_meta for p in built[0].parameters())
    assert grown < 200 * 2**20, grown
    out = capsys.readouterr().out
    assert "parameters frozen  bfloat16" in out and "AdamW states" in out and "activations" in out


@pytest.mark.parametrize("method", P.METHODS)
def test_plan_counts_the_parameters_of_a_real_build(method, tmp_path):
    """The plan's parameter counts and dtypes are exactly those of the compressor train.py builds (tiny, in both
    dtypes), and its weight, gradient and AdamW bytes follow from them."""
    for dtype in ("fp32", "bf16"):
        argv = ["--method", method, "--frozen-dtype", dtype, "--device", "cpu", "--out", str(tmp_path)]
        got = plan_of(argv)
        comp = train.build_compressor(cli.parse_args(argv).config, torch.device("cpu"),
                                      frozen=torch.bfloat16 if dtype == "bf16" else torch.float32)
        want, trained = {}, 0
        for p in comp.parameters():
            key = ("trained" if p.requires_grad else "frozen", str(p.dtype).removeprefix("torch."))
            want[key] = want.get(key, 0) + p.numel()
            trained += p.numel() if p.requires_grad else 0
        assert got.params == want
        assert got.weights == sum(p.numel() * p.element_size() for p in comp.parameters())
        assert (got.grads, got.optimizer) == (4 * trained, 8 * trained)
        opt = torch.optim.AdamW(comp.trainable_parameters())
        for p in comp.trainable_parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        assert got.optimizer == sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                                    if k != "step")


def test_plan_counts_the_activations_a_real_step_saves(tmp_path):
    """The count on the meta device bounds the same count on a real CPU step from above, within 30% (measured:
    2.79 against 2.30 MB: the meta device's attention keeps the (B, H, T, S) probabilities, the CPU's fused SDPA
    only its output and log-sum-exp), and --grad-ckpt keeps far fewer."""
    argv = ["--method", "aoc", "--device", "cpu", "--out", str(tmp_path), "--frozen-dtype", "fp32"]
    s = cli.parse_args(argv + ["--plan"])
    comp = train.build_compressor(s.config, torch.device("cpu"))
    batch = plan.example_batch(comp, cli.planned(s).sampling, s.answer_tokens, s.batch_size)
    real = plan.saved_bytes(comp, step_of(s), batch, False, False)
    on_meta = plan_of(argv).activations / plan.OVERHEAD
    assert 0 < real <= on_meta <= 1.3 * real, (real, on_meta)
    ckpt = plan_of(argv + ["--grad-ckpt"]).activations
    assert ckpt < 0.5 * plan_of(argv).activations


def test_plan_speaks_one_unit_and_fits_in_it(capsys):
    """GB is 10^9 bytes both when the plan prints a size and when it decides "fits" (GiB labelled GB beside a limit
    of 80e9 bytes would print a plan that does not fit as under 80): a total of 80.1e9 bytes prints as 80.10 GB and
    does not fit, 79.9e9 does."""
    s = cli.parse_args(["--method", "aoc", "--plan"])
    for total, fits in ((80.1e9, False), (79.9e9, True)):
        p = plan.Plan({}, int(total), 0, 0, 0, 1)
        assert p.fits is fits and plan.Plan({}, 0, 0, 0, 0, 1, build=int(total)).fits is fits   # the build too
        text = plan.describe(p, s.config, cli.planned(s), s.shape, s.frozen_dtype)
        assert f"{total / 1e9:8.2f} GB" in text and ("does not fit" not in text) is fits


def test_plan_per_gpu_under_fsdp_and_ddp(tmp_path):
    """--plan --gpus N: DDP keeps every weight on every GPU and adds its gradient buckets; --fsdp divides every
    tensor at rest by N, and while a step runs holds the root unit (what is outside the transformer blocks) whole,
    two blocks gathered (bf16 under MixedPrecisionPolicy) and the root's gradients whole; the micro-batch is
    batch / N. The build and a checkpoint's save are counted apart. Each term is checked against a real build's
    parameters (tiny, pcc: a fully trained encoder)."""
    argv = ["--method", "pcc", "--batch-size", "8", "--out", str(tmp_path)]
    one, ddp, fsdp = (plan_of(argv + extra) for extra in ([], ["--gpus", "4"], ["--gpus", "4", "--fsdp"]))
    comp = train.build_compressor(cli.parse_args(argv + ["--frozen-dtype", "bf16"]).config, torch.device("cpu"),
                                  frozen=torch.bfloat16)
    in_blocks = {id(p) for b in C.blocks(comp) for p in b.parameters()}
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)
    root = size(p for p in comp.parameters() if id(p) not in in_blocks)
    root_trained = sum(p.numel() for p in comp.parameters() if p.requires_grad and id(p) not in in_blocks)
    trained = sum(p.numel() for p in comp.parameters() if p.requires_grad)
    block = max(sum(p.numel() * 2 for p in b.parameters()) for b in C.blocks(comp))
    assert (one.micro, ddp.micro, fsdp.micro) == (8, 2, 2)
    assert (ddp.weights, ddp.grads, ddp.optimizer) == (one.weights, 2 * one.grads, one.optimizer)
    assert fsdp.weights == -(-size(comp.parameters()) // 4) + root + 2 * block
    assert fsdp.grads == 4 * (-(-trained // 4) + root_trained) and fsdp.optimizer == 8 * -(-trained // 4)
    # one process and DDP build the whole compressor; --fsdp builds it on the meta device, and a GPU holds its shards
    # and one tensor whole while it fills them (in the frozen dtype, bf16; PCC's MLP bridge, drawn whole, is smaller
    # than the embedding). A save adds to the host the trained tensors whole (one process) or, sharded (DCP), the
    # largest one's shard and the writer's copy-ahead buffer
    largest = max(p.numel() * 4 for p in comp.parameters() if p.requires_grad)
    assert one.build == ddp.build == size(comp.parameters())
    assert fsdp.build == -(-size(comp.parameters()) // 4) + 2 * max(p.numel() for p in comp.parameters())
    assert one.save == 4 * trained and fsdp.save == -(-largest // 4) + checkpoint.COPY_AHEAD
    assert ddp.activations < one.activations and fsdp.activations < ddp.activations   # autocast copies: root only
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv + ["--gpus", "2"])
    assert "--plan" in str(e.value)


def test_plan_counts_autocasts_copies_of_fp32_frozen_matrices_at_each_use(tmp_path):
    """Under autocast an fp32 frozen matrix is cast to bf16 at each use (no cache: it needs no gradient), and the
    matmul saves the copy: the plan with --frozen-dtype fp32 counts 2 bytes x numel for every such use, which a
    real step's F.linear calls on inputs that need a gradient (counted by a TorchFunctionMode) give independently."""
    from torch.overrides import TorchFunctionMode
    argv = ["--method", "aoc", "--out", str(tmp_path)]
    plans = {d: plan_of(argv + ["--frozen-dtype", d]) for d in ("fp32", "bf16")}
    s = cli.parse_args(argv + ["--frozen-dtype", "fp32", "--device", "cpu"])
    comp = train.build_compressor(s.config, torch.device("cpu"))
    frozen = {id(p): p.numel() for p in comp.parameters() if not p.requires_grad and p.dim() == 2}
    # (the loss's lm_head is one such use: the tiny vocabulary's logits are kept, not recomputed; chunked_cross_entropy)
    uses = []

    class Linears(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            if func is torch.nn.functional.linear and id(a[1]) in frozen and a[0].requires_grad:
                uses.append(frozen[id(a[1])])   # (a matmul whose input needs no gradient saves nothing)
            return func(*a, **(kw or {}))
    with Linears():
        step_of(s)(comp)(plan.example_batch(comp, cli.planned(s).sampling, s.answer_tokens, s.batch_size))
    copies = 2 * sum(uses)
    extra = (plans["fp32"].activations - plans["bf16"].activations) / plan.OVERHEAD
    assert uses and abs(extra - copies) <= 0.01 * copies + 64, (extra, copies)


def test_plan_of_a_model_folder_reads_only_its_config(tmp_path, capsys):
    """--plan --model DIR needs DIR/config.json and nothing else (no weights): the same plan as the SHAPES entry it
    copies; a folder without config.json, or --shape without --plan, is one line."""
    import json
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(SHAPES["llama-3.2-1b"]))
    by_folder = plan_of(["--method", "gmsa", "--model", str(tmp_path / "m")])
    by_shape = plan_of(["--method", "gmsa", "--shape", "llama-3.2-1b"])
    assert by_folder.params == by_shape.params and by_folder.total == by_shape.total
    for argv, message in ((["--model", str(tmp_path), "--plan"], "config.json"),
                          (["--shape", "llama-3-8b"], "--plan")):
        with pytest.raises(SystemExit) as e:
            train.main(["--method", "aoc", *argv])
        assert message in str(e.value) and "\n" not in str(e.value)


# ---- several processes under torchrun: DDP and FSDP ----

from conftest import torchrun as torchrun_  # noqa: E402


def torchrun(flags, tmp_path, device):
    """On the CPU two processes (gloo) on a machine that claims a GPU (conftest.torchrun); with --device cuda one
    process on one GPU (nccl, a group of one)."""
    cpu = device.type == "cpu"
    return torchrun_([*flags, "--device", str(device)], 2 if cpu else 1, tmp_path, fake_gpu=cpu)


def test_two_processes_train_exactly_as_one(tmp_path, device):
    """The multi-GPU path, for real: `torchrun --standalone --nproc_per_node 2` (gloo, on the CPU) logs the loss and
    gradient norm of the single-process run at every step. Each process draws the whole step's examples, takes its
    half, divides its summed NLL by the whole step's token count, and DDP averages the gradients (so each process's
    loss counts twice): icae pretraining on texts of different lengths, where a mean of the processes' own means
    differs from the step's mean."""
    if device.type != "cpu":
        pytest.skip("two processes on one GPU is not a setup: this runs the gloo path on the CPU")
    flags = ["--method", "icae", "--model", "tiny", *ACCUMULATION["pretrain"][2:], "--batch-size", "4", "--lr",
             "3e-3", "--warmup", "0", "--steps", "3", "--seed", "1", "--device", "cpu", "--eval-every", "2"]
    torchrun_([*flags, "--out", str(tmp_path / "ddp")], 2, tmp_path)   # a machine that claims a GPU: gloo all the same
    train.main(flags + ["--out", str(tmp_path / "one")])
    one, ddp = log_rows(tmp_path / "one"), log_rows(tmp_path / "ddp")
    assert [r["step"] for r in ddp] == [1, 2, 3]
    for a, b in zip(one, ddp, strict=True):
        for key in ("loss", "grad_norm", "ae", "lm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (a["step"], key, a[key], b[key])
        assert a["tokens"] == b["tokens"]   # the processes' token counts are summed
    # the held-out check (rank 0 scores the model every rank holds) gives one process's numbers
    checks = eval_rows(tmp_path / "one"), eval_rows(tmp_path / "ddp")
    assert [r["step"] for r in checks[1]] == [0, 2, 3]
    for a, b in zip(*checks, strict=True):
        for key in ("own", "other", "none", "own_other"):
            assert abs(a["eval"][key] - b["eval"][key]) <= 1e-5 * abs(a["eval"][key])
        assert abs(a["eval"]["lm"]["own"] - b["eval"]["lm"]["own"]) <= 1e-5 * a["eval"]["lm"]["own"]


FSDP_RUNS = {   # a trained encoder copy; LoRA on the decoder itself, pretrain's two losses; a separate trained LLM
    "aoc": ["--method", "aoc", *KINDS["aoc"]],
    "icae": ["--method", "icae", *KINDS["icae"]],
    "pcc": ["--method", "pcc", *KINDS["pcc"]],
    "pcc-bf16": ["--method", "pcc", *KINDS["pcc"], "--frozen-dtype", "bf16"],   # FSDP's MixedPrecisionPolicy
}


@pytest.mark.parametrize("case", FSDP_RUNS)
def test_fsdp_saves_mid_run_and_trains_and_resumes_as_one_process(case, tmp_path, device):
    """torchrun --nproc_per_node 2 ... --fsdp (FSDP2 on gloo: every weight sharded over the two processes), saving
    every 2 of 6 steps, logs the single-process run's loss, parts and gradient norm at every step within 1e-4
    relative, with two micro-batches per process: a mid-run save leaves AdamW's live state as it was. A one-process
    checkpoint continues under FSDP where the uninterrupted run went. With --device cuda: world size 1 on one GPU
    (nccl)."""
    flags = ["--model", "tiny", *FSDP_RUNS[case], "--batch-size", "8", "--micro-batch", "2", "--lr", "3e-3",
             "--warmup", "0", "--steps", "6", "--save-every", "2", "--seed", "1", "--eval-every", "0"]
    torchrun(flags + ["--fsdp", "--out", str(tmp_path / "fsdp")], tmp_path, device)
    one = run(flags, tmp_path / "one", device)
    fsdp = rows(tmp_path / "fsdp")
    assert [r["step"] for r in fsdp] == [1, 2, 3, 4, 5, 6]
    # bf16: both runs round every matmul's inputs to bf16 alike, and differ at step 1 only in fp32 summation order
    # (2 x 2 micro-batches reduced, against 4 accumulated: 7e-8 on the grad norm); AdamW's sign-like first steps
    # then move a few weights apart, and each later step is within bf16's rounding of the other run's: the bounds
    # of a bf16 step (BF16_LOSS_RTOL, BF16_GRAD_RTOL; on CUDA FSDP's MixedPrecisionPolicy also rounds the norms'
    # weights). Measured, pcc-bf16, steps 2-6, AVX2 kernels: at most 6.2e-4 on the loss, 1.2e-2 on the grad norm
    bf16 = "bf16" in case or device.type == "cuda"   # CUDA: --frozen-dtype auto is bf16 there
    for a, b in zip(one, fsdp, strict=True):
        for key in ("loss", "grad_norm", *(k for k in ("ae", "lm") if k in a)):
            bound = (BF16_GRAD_RTOL if key == "grad_norm" else BF16_LOSS_RTOL) if bf16 else 1e-4
            assert abs(a[key] - b[key]) <= bound * abs(a[key]), (a["step"], key, a[key], b[key])
    # one process -> FSDP: the one-process checkpoint's moments cut into each rank's shards (FSDP -> any number of
    # processes: test_fsdp_checkpoints_are_sharded_and_resume_on_any_number_of_processes)
    run(flags + ["--stop-after", "2"], tmp_path / "b", device)
    torchrun(["--resume", str(tmp_path / "b"), "--fsdp"], tmp_path, device)
    assert json.load(open(tmp_path / "b" / "args.json"))["fsdp"] is True
    assert (tmp_path / "b" / "ckpt-000006" / checkpoint.SHARDED).is_dir()
    for a, b in zip(one, rows(tmp_path / "b"), strict=True):
        bound = BF16_LOSS_RTOL if bf16 else 1e-4
        assert abs(a["loss"] - b["loss"]) <= bound * a["loss"], (a["step"], a["loss"], b["loss"])


def test_fsdp_in_one_process_trains_as_without_it(tmp_path, device):
    """--fsdp without torchrun (a process group of one: what a single GPU runs) changes nothing but the wrapping and
    the checkpoint's format (sharded, DCP). Converted to the one-process format (checkpoint.py --to-single), it holds
    the plain run's tensors and moments, and evaluate.py scores it as the plain run's."""
    flags = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "3"]
    plain, sharded = run(flags, tmp_path / "plain", device), run(flags + ["--fsdp"], tmp_path / "fsdp", device)
    assert (tmp_path / "fsdp" / "ckpt-000003" / checkpoint.SHARDED).is_dir()
    if device.type == "cpu":   # fp32: the same arithmetic
        assert [r["loss"] for r in plain] == [r["loss"] for r in sharded]
        checkpoint.to_single(str(tmp_path / "fsdp"))
        a, b = (load_file(str(tmp_path / d / "compressor.safetensors")) for d in ("plain", "fsdp"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        opt_a, opt_b = (checkpoint.read_train_state(str(tmp_path / d))["optimizer"] for d in ("plain", "fsdp"))
        assert opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
        assert all(torch.equal(v, opt_b["state"][i][k]) for i, s in opt_a["state"].items() for k, v in s.items())
        scores = [E.main(["--ckpt", str(tmp_path / d), "--task", "ae", "--n", "3", "--max-new-tokens", "4", "--device",
                          "cpu", "--out", str(tmp_path / f"{d}.json")]) for d in ("plain", "fsdp")]
        assert {**scores[0], "checkpoint": None} == {**scores[1], "checkpoint": None}
    else:   # bf16: autocast rounds each matmul's inputs, FSDP's MixedPrecisionPolicy each block's weights
        for a, b in zip(plain, sharded, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-2 * a["loss"], (a["step"], a["loss"], b["loss"])
    assert not torch.distributed.is_initialized()   # the group of one is gone again


# ---- --fsdp builds on the meta device: each rank fills its own slices, one whole tensor at a time ----

# a model folder, read from its safetensors (bf16) tensor by tensor: untied lm_head, another width and vocabulary
FOLDER_CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from bench_plan import random_checkpoint
    return random_checkpoint(str(tmp_path_factory.mktemp("folder") / "model"), FOLDER_CONFIG)


META_CASES = {   # every preset on tiny, and what changes where a build draws or reads (flags, frozen dtype)
    **{method: (["--method", method], torch.float32) for method in P.METHODS},
    "pcc-bf16": (["--method", "pcc"], torch.bfloat16),               # MLP bridge, drawn on the CPU and cast
    "compllm-bf16": (["--method", "compllm", "--objective", "ae"], torch.bfloat16),   # linear bridge, LoRA in bf16
    "icae-mem-norm": (["--method", "icae", "--mem-norm"], torch.float32),   # Rescaled's target, from the table
    "lora-aoc": (["--method", "aoc", "--encoder", "lora"], torch.float32),  # a LoRA'd MLP-free copy
    "gmsa-keft": (["--method", "gmsa"], torch.float32),                     # the decoder's q/k/v train (fp32)
    "icae-folder-bf16": (["--method", "icae", "--model", "FOLDER"], torch.bfloat16),   # the files' tensors
    "pcc-folder": (["--method", "pcc", "--model", "FOLDER", "--decoder", "tiny"], torch.float32),   # two models
}


@pytest.mark.parametrize("case", META_CASES)
def test_fsdp_builds_on_meta_and_fills_every_tensor_as_one_process_builds_it(case, model_folder, tmp_path, device):
    """Under --fsdp the compressor is built on the meta device (no parameter has storage: nothing of it is whole
    anywhere), sharded, then filled (parallel.materialise): the base weights read from their files, the trained init
    drawn again in the order a build draws it. In a process group of one, where a shard is the whole tensor, every
    tensor is then bit for bit the one a plain build from the same seed makes, in its dtype and with its
    requires_grad, and so are the RoPE buffers and --mem-norm's target: the same values a one-process run starts
    from, whatever the preset, the frozen dtype or the model files."""
    import parallel
    from torch.distributed.tensor import DTensor
    flags, frozen = META_CASES[case]
    flags = [model_folder if f == "FOLDER" else f for f in flags]
    s = cli.parse_args([*flags, "--out", str(tmp_path), "--device", str(device)])
    cfg = replace(s.config, decoder_train="keft") if case == "gmsa-keft" else s.config
    weights = "a stage-1 run" if case == "gmsa-keft" else None   # (KEFT's check; nothing is loaded at the build)
    torch.manual_seed(5)   # (on CUDA the draws are the GPU generator's, in both builds)
    plain = train.build_compressor(cfg, device, frozen, weights)
    with parallel.processes(str(device), fsdp=True) as (device, _, world):
        torch.manual_seed(5)
        comp = train.build_compressor(cfg, torch.device("meta"), frozen, weights)
        assert all(p.is_meta for p in comp.parameters()) and all(b.is_meta for b in comp.buffers())
        step = parallel.wrap(comp, train.TrainStep(comp, s.objective, s.lm_weight), True, device, world,
                             bf16=frozen == torch.bfloat16)
        parallel.materialise(step, comp, device, frozen)
        want, got = dict(plain.named_parameters()), dict(comp.named_parameters())
        assert want.keys() == got.keys() and all(isinstance(p, DTensor) for p in got.values())
        for name, p in want.items():
            q = got[name].full_tensor()
            assert torch.equal(p, q) and (p.dtype, p.requires_grad) == (q.dtype, got[name].requires_grad), name
        for (name, a), (_, b) in zip(plain.named_buffers(), comp.named_buffers(), strict=True):
            assert torch.equal(a, b), name
        assert getattr(plain.bridge, "target", None) == getattr(comp.bridge, "target", None)


def test_fsdp_holds_no_compressor_until_sharded_and_one_whole_tensor_at_a_time(model_folder, tmp_path, monkeypatch):
    """What keeps each rank at its shards plus one tensor while an --fsdp run starts: the compressor has no storage
    when it is sharded (parallel.shard sees meta tensors only), and each tensor read whole afterwards, from the base
    model's safetensors or from a one-process compressor.safetensors (here --warm-start's; --init's and a resumed
    one-process checkpoint's are read the same way, checkpoint.load_trained), is cut to the rank's shard and gone
    before the next is read: at every read, no tensor read before is alive. In a process group of one (train.py --fsdp
    without torchrun), whose shard of a tensor is all of it; every rank of a larger group runs the same code."""
    import weakref
    import parallel
    from safetensors import safe_open
    reads = {"base": [], "checkpoint": []}   # a weak reference to every tensor read, by where it was read from

    def tracked(read, where):
        def read_one(name):
            assert all(r() is None for refs in reads.values() for r in refs), f"{name}: a tensor read before is held"
            t = read(name)
            reads[where].append(weakref.ref(t))
            return t
        return read_one

    class File:   # an open compressor.safetensors whose get_tensor is tracked
        def __init__(self, *a, **kw):
            self.f = safe_open(*a, **kw)
            self.keys, self.get_slice, self.get_tensor = self.f.keys, self.f.get_slice, tracked(self.f.get_tensor,
                                                                                               "checkpoint")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)
    shard, weight_reader, sharded = parallel.shard, parallel.weight_reader, []
    monkeypatch.setattr(parallel, "shard", lambda comp, *a: sharded.append(all(p.is_meta for p in comp.parameters()))
                        or shard(comp, *a))
    monkeypatch.setattr(parallel, "weight_reader", lambda *a: tracked(weight_reader(*a), "base"))
    monkeypatch.setattr(checkpoint, "safe_open", File)
    flags = ["--method", "icae", "--model", model_folder, "--mem", "4", "--chunk-len", "16", *LORA, "--batch-size", "2",
             "--steps", "1", "--device", "cpu", "--eval-every", "0"]
    train.main(flags + ["--out", str(tmp_path / "first")])   # one process: built whole, as before
    assert sharded == [] and reads == {"base": [], "checkpoint": []}
    train.main(flags + ["--fsdp", "--warm-start", str(tmp_path / "first"), "--out", str(tmp_path / "sharded")])
    assert sharded == [True]
    base = set(load_file(os.path.join(model_folder, "model.safetensors")))
    trained = set(load_file(str(tmp_path / "first" / "compressor.safetensors")))
    assert len(reads["base"]) >= len(base) and len(reads["checkpoint"]) == len(trained)


# ---- sharded checkpoints (torch.distributed.checkpoint) that reshard ----

# the run: aoc at batch 6, which 1, 2 and 3 processes divide
DCP_RUN = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "6", "--steps", "6", "--save-every", "2",
           "--device", "cpu", "--eval-every", "0"]


def stopped_copy(run_dir, to, step):
    """A copy of a run directory as a run stopped after `step` leaves it: its later checkpoints removed, the top-level
    files linked to the newest one left (the log's later rows stay; a resume trims them)."""
    shutil.copytree(run_dir, to)
    for later in to.glob("ckpt-*"):
        if int(later.name.rpartition("-")[2]) > step:
            shutil.rmtree(later)
    newest = checkpoint.latest_checkpoint(str(to))
    checkpoint.link_newest(str(to), newest, sharded=os.path.isdir(os.path.join(newest, checkpoint.SHARDED)))
    return to


def moments(ckpt):
    """AdamW's state of a checkpoint directory in torch.optim's layout (a sharded one made whole)."""
    if (ckpt / checkpoint.SHARDED).is_dir():
        return checkpoint.one_process_optimizer(checkpoint.whole_state(str(ckpt / checkpoint.SHARDED))["optim"])
    return torch.load(ckpt / "train_state.pt", weights_only=True)["optimizer"]


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    """DCP_RUN under torchrun on 2 processes with --fsdp, uninterrupted (its step-4 checkpoint kept: --keep-every 4);
    that checkpoint resumed on 1 process (with --fsdp and without), 2 and 3; and the run in one process."""
    tmp = tmp_path_factory.mktemp("dcp")
    torchrun_([*DCP_RUN, "--fsdp", "--keep-every", "4", "--out", str(tmp / "two")], 2, tmp)
    train.main([*DCP_RUN, "--out", str(tmp / "one")])
    for name, n, fsdp in (("on1", 1, False), ("on1-fsdp", 1, True), ("on2", 2, True), ("on3", 3, True)):
        argv = ["--resume", str(stopped_copy(tmp / "two", tmp / name, 4)), "--device", "cpu", *(["--fsdp"] * fsdp)]
        torchrun_(argv, n, tmp) if n > 1 else train.main(argv)
    return tmp


def test_fsdp_checkpoints_are_sharded_and_resume_on_any_number_of_processes(dcp_runs):
    """`torchrun --nproc_per_node 2 train.py ... --fsdp` writes DCP checkpoints (one file per rank and .metadata, no
    whole-state file); resumed after step 4 on 2 processes it logs the uninterrupted run's steps bit for bit and ends
    with its AdamW moments bit for bit; resumed on 1 (with --fsdp or without) and 3 processes, each rank reads other
    slices than it saved, and steps 5-6 and the final moments are within 1e-6 relative of the uninterrupted run."""
    two = dcp_runs / "two"
    shards = sorted(p.name for p in (two / "ckpt-000006" / checkpoint.SHARDED).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(two.glob("**/compressor.safetensors"))
    state = torch.load(two / "ckpt-000006" / "train_state.pt", weights_only=True)
    assert state["sharded"] and state["optimizer"] is None and len(state["rng"]) == 2
    full, whole = rows(two), moments(two / "ckpt-000006")
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
    one = rows(dcp_runs / "one")
    for a, b in zip(one, full, strict=True):   # FSDP on 2 processes against one: summation order only
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["step"], a["loss"], b["loss"])
    for name in ("on1", "on1-fsdp", "on2", "on3"):
        resumed, end = rows(dcp_runs / name), dcp_runs / name / "ckpt-000006"
        assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
        assert (end / checkpoint.SHARDED).is_dir() is (name != "on1")   # one process without --fsdp: its own format
        got = moments(end)
        assert got["param_groups"] == whole["param_groups"] and got["state"].keys() == whole["state"].keys()
        for a, b in zip(full[4:], resumed[4:], strict=True):
            for key in ("loss", "grad_norm", "ae"):
                if name == "on2":
                    assert a[key] == b[key], (name, a["step"], key)
                else:
                    assert abs(a[key] - b[key]) <= 1e-6 * abs(a[key]), (name, a["step"], key, a[key], b[key])
        for i, per_param in whole["state"].items():
            for k, want in per_param.items():
                if name == "on2":
                    assert torch.equal(got["state"][i][k], want), (name, i, k)
                else:   # relative to the whole tensor's size: an element near 0 moves by the others' rounding
                    assert (got["state"][i][k] - want).norm() <= 1e-6 * want.norm(), (name, i, k)


def test_a_sharded_checkpoint_converts_to_the_one_process_format(dcp_runs, tmp_path):
    """`python checkpoint.py --to-single RUN` rewrites a run's newest DCP checkpoint as compressor.safetensors +
    train_state.pt: the same tensors and moments, a checkpoint a one-process run continues exactly as from the DCP
    folder, and evaluate.py scores it exactly as it scores the DCP checkpoint read directly. A one-process
    checkpoint is refused in one line."""
    two = stopped_copy(dcp_runs / "two", tmp_path / "two", 4)
    direct = E.main(["--ckpt", str(two), "--task", "ae", "--n", "3", "--max-new-tokens", "4", "--device", "cpu",
                     "--out", str(tmp_path / "direct.json")])
    whole = checkpoint.whole_state(str(two / "ckpt-000004" / checkpoint.SHARDED))
    p = subprocess.run([sys.executable, "checkpoint.py", "--to-single", str(two)], cwd=Path(checkpoint.__file__).parent,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ckpt = two / "ckpt-000004"
    assert sorted(q.name for q in ckpt.iterdir()) == ["compressor.json", "compressor.safetensors", "train_state.pt"]
    assert (two / "compressor.safetensors").samefile(ckpt / "compressor.safetensors")
    saved = load_file(str(ckpt / "compressor.safetensors"))
    assert saved.keys() == whole["model"].keys() and all(torch.equal(saved[k], whole["model"][k]) for k in saved)
    converted = E.main(["--ckpt", str(two), "--task", "ae", "--n", "3", "--max-new-tokens", "4", "--device", "cpu",
                        "--out", str(tmp_path / "converted.json")])
    assert converted == direct and converted["step"] == 4
    train.main(["--resume", str(two), "--device", "cpu"])
    for a, b in zip(rows(dcp_runs / "on1")[4:], rows(two)[4:], strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], a["step"]
    with pytest.raises(ValueError, match="one-process format already"):
        checkpoint.to_single(str(two))


def test_fsdp_with_grad_ckpt_and_dropout_resumes_exactly(tmp_path, capsys):
    """icae with LoRA dropout under --fsdp --grad-ckpt on 2 processes (each block recomputed in backward, its weights
    gathered again and its dropout masks drawn again from the saved generator state): stopped after step 2 and
    resumed on 2 processes, it logs the uninterrupted run's steps 3-4 and ends with its AdamW moments, bit for bit,
    as each rank's generator is restored. Resumed on one process, the generators cannot be (no saved one is that
    process's): one line says so, and the dropout masks, and so the losses, differ."""
    flags = ["--method", "icae", "--model", "tiny", *KINDS["icae"], "--lora-dropout", "0.1", "--grad-ckpt",
             "--batch-size", "4", "--steps", "4", "--save-every", "2", "--keep-every", "2", "--device", "cpu",
             "--eval-every", "0"]
    torchrun_([*flags, "--fsdp", "--out", str(tmp_path / "full")], 2, tmp_path)
    torchrun_(["--resume", str(stopped_copy(tmp_path / "full", tmp_path / "part", 2)), "--fsdp", "--device", "cpu"],
              2, tmp_path)
    full, part = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    for a, b in zip(full, part, strict=True):
        assert all(a[k] == b[k] for k in ("loss", "grad_norm", "ae", "lm")), a["step"]
    want, got = (moments(tmp_path / d / "ckpt-000004") for d in ("full", "part"))
    assert all(torch.equal(v, got["state"][i][k]) for i, s in want["state"].items() for k, v in s.items())
    train.main(["--resume", str(stopped_copy(tmp_path / "full", tmp_path / "one", 2)), "--device", "cpu"])
    assert "saved on 2 process(es), resumed on 1" in capsys.readouterr().out
    assert rows(tmp_path / "one")[2]["loss"] != full[2]["loss"]


def test_an_fsdp_run_that_ends_early_or_fails_closes_its_process_group(tmp_path, device):
    """--fsdp in one process opens a process group of one; a run that ends before training (nothing left to do) or
    stops with an error must close it, or the next in-process train.main([... --fsdp]) fails."""
    flags = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "1", "--fsdp",
             "--eval-every", "0", "--device", str(device)]
    train.main(flags + ["--out", str(tmp_path / "a")])
    assert not torch.distributed.is_initialized()
    train.main(["--resume", str(tmp_path / "a"), "--fsdp", "--device", str(device)])   # at step 1 already: no step
    assert not torch.distributed.is_initialized()
    with pytest.raises(SystemExit):   # refused after the group is open: --data names no file
        train.main(flags + ["--out", str(tmp_path / "c"), "--data", str(tmp_path / "none.jsonl")])
    assert not torch.distributed.is_initialized()
    train.main(flags + ["--out", str(tmp_path / "b")])   # and the next run starts
    assert len(rows(tmp_path / "b")) == 1


def test_torchrun_with_more_processes_than_gpus_is_one_line(monkeypatch, tmp_path):
    """Under torchrun a rank takes the GPU of its LOCAL_RANK: rank 1 on a machine with one GPU would ask for cuda:1
    and fail deep in CUDA. It stops first, with one line that names the fix, before any process group is made:
    parallel.py raises, train.py prints the line."""
    import parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--nproc_per_node 1, or --device cpu"):
        with parallel.processes("cuda", False):
            pass
    with pytest.raises(SystemExit) as e:
        train.main(["--method", "aoc", "--device", "cuda", "--out", str(tmp_path / "x")])
    assert str(e.value).startswith("train.py: error: torchrun started local rank 1") and "\n" not in str(e.value)
    assert "--nproc_per_node 1, or --device cpu" in str(e.value) and not torch.distributed.is_initialized()


def test_device_cuda_k_without_torchrun_is_made_the_current_device(monkeypatch):
    """--device cuda:1 without torchrun: FSDP2 and NCCL take the current CUDA device, so parallel.processes sets it
    (else every such run lands on GPU 0). Checked without a GPU: set_device is recorded, not called."""
    import parallel
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    with parallel.processes("cuda:1", fsdp=False) as (here, rank, world):
        assert (here, rank, world) == (torch.device("cuda", 1), 0, 1)
    assert calls == [torch.device("cuda", 1)]
    with parallel.processes("cpu", fsdp=False):
        pass
    assert len(calls) == 1


@pytest.mark.parametrize("slicing", ["this torch", "a view"])
def test_resumed_adamw_moments_are_shards_with_storage_of_their_own(slicing, monkeypatch):
    """A resume under FSDP cuts each AdamW moment read from the one-process checkpoint into this rank's shard: the
    shard must own its storage, not view the whole moment (which every rank would then keep whole). In a group of
    one the shard is the whole moment, so a view would share the loaded tensor's storage. "a view": distribute_tensor
    as some torch releases of the supported range run it with src_data_rank=None (the local slice, not a copy)."""
    import parallel
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    if slicing == "a view":
        monkeypatch.setattr(parallel, "distribute_tensor", lambda t, mesh, placements, src_data_rank=None:
                            DTensor.from_local(t, mesh, placements, shape=t.shape, stride=t.stride()))
    with parallel.processes("cpu", fsdp=True):
        layer = torch.nn.Linear(8, 4)
        fully_shard(layer)
        opt = torch.optim.AdamW(layer.parameters())
        moments = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(p.shape), "exp_avg_sq": torch.rand(p.shape)}
                   for i, p in enumerate(layer.parameters())}
        loaded = {i: dict(m) for i, m in moments.items()}
        state = parallel.shard_optimizer_state(opt, {"state": loaded, "param_groups": []})
        for i, per_param in state["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                shard = per_param[k].to_local()
                assert torch.equal(shard, moments[i][k])
                assert shard.untyped_storage().data_ptr() != moments[i][k].untyped_storage().data_ptr(), (i, k)
                assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()


def test_each_rank_keeps_its_own_devices_generator_and_a_resized_resume_says_so(tmp_path, monkeypatch, capsys):
    """A checkpoint holds, per rank, torch's host generator and that rank's own CUDA device's (never every visible
    GPU's, which a smaller machine would lack). Resumed on as many processes, each rank gets its own back; on another
    number, no saved generator is this rank's: each keeps what a fresh run of this size draws, and one line says so.
    A checkpoint whose "cuda" lists every GPU's generator restores this device's entry (checked without a GPU:
    torch.cuda.set_rng_state recorded, not called)."""
    from checkpoint import gather_rng_states, set_rng_state
    cpu = torch.device("cpu")
    [state] = gather_rng_states(1, cpu)
    assert torch.equal(state["torch"], torch.get_rng_state()) and state["cuda"] is None
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    set_rng_state(dict(torch=torch.get_rng_state(), cuda=["gpu0", "gpu1"]), torch.device("cuda", 1))
    set_rng_state(dict(torch=torch.get_rng_state(), cuda=["gpu0"]), torch.device("cuda", 1))   # no such entry
    set_rng_state(dict(torch=torch.get_rng_state(), cuda="own"), torch.device("cuda", 0))
    set_rng_state(dict(torch=torch.get_rng_state(), cuda="own"), cpu)
    assert restored == [("gpu1", torch.device("cuda", 1)), ("own", torch.device("cuda", 0))]
    # train.restore: same world -> this rank's state; another world -> untouched, and one line
    s = cli.parse_args(["--method", "aoc", "--model", "tiny", "--mem", "4", "--device", "cpu", "--out", str(tmp_path)])
    run = cli.place(s, cpu, 0, 1)
    comp = train.build_compressor(s.config, cpu)
    opt = train.make_optimizer(comp, s.lr, s.betas, s.weight_decay, s.mem_lr, cpu)
    saved = torch.Generator().manual_seed(123).get_state()
    train.restore(run, comp, opt, None, dict(optimizer=opt.state_dict(), rng=[dict(torch=saved, cuda=None)]))
    assert torch.equal(torch.get_rng_state(), saved) and capsys.readouterr().out == ""
    torch.manual_seed(7)
    fresh = torch.get_rng_state()
    train.restore(run, comp, opt, None, dict(optimizer=opt.state_dict(), rng=[dict(torch=saved, cuda=None)] * 2))
    assert torch.equal(torch.get_rng_state(), fresh)
    assert capsys.readouterr().out == ("saved on 2 process(es), resumed on 1: each process draws from its generator "
                                       "as a fresh run of 1 would (--seed + rank), not where the saved ones stood\n")


# ---- attention stays on CUDA's fused kernels ----


@pytest.mark.parametrize("method", P.METHODS)
def test_no_sdpa_call_gets_a_mask_together_with_enable_gqa(method, tmp_path, run_train, device, monkeypatch):
    """CUDA's flash kernel takes grouped-query heads but no mask, its memory-efficient and cuDNN kernels a mask but
    not enable_gqa: SDPA given both runs the math path, (B, H, T, S) probabilities in memory. The CPU's
    flash kernel takes both, so only a spy sees it: one training step and one evaluation (losses and a generated
    token) of every preset on `tiny` (4 query heads over 2 K/V heads) must make masked calls, and none with GQA."""
    import model as M
    assert TINY_CONFIG["num_key_value_heads"] < TINY_CONFIG["num_attention_heads"]   # the model has GQA
    calls, sdpa = [], M.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is not None, kw.get("enable_gqa", False), q.shape[1], k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(M.F, "scaled_dot_product_attention", spy)
    out = str(tmp_path / method)
    run_train(["--method", method, "--model", "tiny", "--out", out, "--steps", "1", "--eval-every", "0"])
    comp = checkpoint.load(out, device=device).eval()
    E.run_ae(comp, [{"text": t} for t in D.EVAL_TEXTS[:2]], max_new_tokens=2)
    masked = [c for c in calls if c[0]]
    assert masked, f"{method}: no masked attention call was seen"
    assert not [c for c in masked if c[1]], f"{method}: {sum(c[1] for c in masked)} masked calls with enable_gqa"
    assert all(h == hkv for _, _, h, hkv in masked)   # with a mask, each query head gets its K/V head repeated


# ---- --compile (AOC's launch-bound step) and --grad-ckpt ----


def test_compile_gives_aocs_losses(tmp_path):
    """--compile (torch.compile of each model's whole forward, dynamic shapes) on AOC, the launch-bound preset, under
    --fsdp (a process group of one: FSDP2's hooks around every block, where the graphs break): the same losses and
    gradient norms as eager within 1e-4 relative (inductor fuses the elementwise ops and may sum in another order;
    measured: equal to 4 decimals over 4 steps). Its sharded checkpoint of step 2, resumed compiled without --fsdp
    (one graph per model), gives step 3 as the uninterrupted run did within 1e-6. 2.5 minutes on 2 CPU cores with a
    cold inductor cache (compiling), 20 s with a warm one."""
    flags = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "3"]
    eager = run(flags, tmp_path / "eager")
    compiled = run(flags + ["--compile", "--fsdp", "--save-every", "2", "--keep-every", "2"], tmp_path / "compiled")
    for a, b in zip(eager, compiled, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (a["step"], key, a[key], b[key])
    part = stopped_copy(tmp_path / "compiled", tmp_path / "part", 2)
    train.main(["--resume", str(part), "--device", "cpu"])   # --compile comes back from the checkpoint
    a, b = compiled[2], rows(part)[2]
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"] and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a[
        "grad_norm"], (a, b)
    assert json.load(open(part / "args.json"))["compile"] is True


@pytest.mark.parametrize("method", ["icae", "compllm"])
def test_grad_ckpt_gives_the_same_losses_where_the_encoder_is_the_decoder(method, tmp_path, device):
    """--grad-ckpt recomputes each block in backward; where the LoRA encoder IS the decoder (icae, 500x, compllm),
    the decoder's blocks run with LoRA switched off, and the recomputation must too (recomputed with LoRA on, they
    raise a CheckpointError in backward)."""
    flags = ["--method", method, "--model", "tiny", *KINDS[method], "--batch-size", "2", "--steps", "3"]
    plain, ckpt = run(flags, tmp_path / "plain", device), run(flags + ["--grad-ckpt"], tmp_path / "ckpt", device)
    for a, b in zip(plain, ckpt, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]


# ---- tests/gpu_check.sh: ready for a lease ----


def test_gpu_check_parses_names_python3_and_each_call_fits_600_s():
    """The CUDA check is written without a GPU and runs once per lease, so its failures must be found here: bash
    parses it, it calls python3 (the CUDA image has no `python`), and each call's timeouts (a loop's counted per
    pass) add up to under 600 s, a call's limit, with a minute to spare for start-up."""
    script = Path(__file__).parent / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    code = [line.split("#")[0] for line in text.splitlines()]
    assert not [line for line in code if re.search(r"(^|[\s;(=])python(\s|$)", line)], "call python3, not python"
    calls = dict(re.findall(r'^\s*(\d)\) SECTIONS="([a-z ]+)"', text, re.M))
    assert set(calls) == {"1", "2", "3", "4"} and sorted(" ".join(calls.values()).split()) == list("abcdefgh")
    blocks = dict(re.findall(r"^if want ([a-z]); then\n(.*?)^fi$", text, re.M | re.S))
    assert set(blocks) == set("abcdefgh")

    def seconds(block):
        loop = re.search(r"for \w+ in ([^;]+); do(.*?)done", block, re.S)
        inner = sum(map(int, re.findall(r"timeout (\d+)", loop.group(2)))) * len(loop.group(1).split()) if loop else 0
        rest = block.replace(loop.group(0), "") if loop else block
        return inner + sum(map(int, re.findall(r"timeout (\d+)", rest)))
    for call, sections in calls.items():
        total = sum(seconds(blocks[s]) for s in sections.split())
        assert 0 < total <= 540, f"call {call}: its timeouts add up to {total} s"
