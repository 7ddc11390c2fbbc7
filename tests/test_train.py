"""train.py learns, end to end, in-process on the test device (the CPU unless `--device cuda`): every method trains
memories that carry their own text, each objective's loss is its paper's equation, the loop's arithmetic (micro-
batches, schedules, --grad-ckpt) gives the full batch's step, a step draws its data as the papers' code does, and
our levers do what they say.

The loss tests use `tiny`'s architecture with weights drawn at std 0.1 instead of build_tiny's 0.02 (the `files`
fixture, conftest.py): the decoder is frozen, and with 0.02 its logits are so small (|logit| < ~1.3) that no memory
can push the loss far below ln(259) = 5.56, whatever the compressor learns. The thresholds are set from measured
runs (in the comments) with a wide margin; an untrained compressor or a training loop that does not step drops by 0%.

The rest of a run is tested beside this file: its settings (tests/test_settings.py), stopping, resuming, checkpoints
and bad input (tests/test_resume.py), the held-out check while it trains (tests/test_heldout.py), bf16 frozen
weights, several processes and CUDA's attention kernels (tests/test_scale.py).
"""

import json
import math
import os
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import cli
import compressors as C
import data as D
import evaluate as E
import presets as P
import train
from conftest import DOC, LORA, eval_rows, log_rows
from model import build_tiny


# ---- every method learns to compress: held-out own/other ----
# A lower loss with memory than without proves little: a learned constant prompt gets that too. So each method
# trains on many texts (16-token windows of the built-in corpus) and is scored on texts it never saw
# (evaluate.py's built-in set): the AE loss with a text's own memory must be below the loss with another text's
# memory. A compressor whose memory ignores its text scores exactly 1.0 (tests/test_evaluate.py). Measured on
# this repository's CPU (300 steps, batch 8, the built-in corpus of 3,000 generated documents): icae 0.980,
# 500x 0.957, pcc 0.956, pic 0.969, compllm 0.961, gmsa 0.947, aoc 0.732 (the random tiny decoder reads memory
# poorly; AOC at m = n, no compression, best; the README quickstart's 4x, 2,000 steps at batch 16, 0.44). AOC's
# run lands in one of two modes by seed and arithmetic: seeds 0-3 gave 0.70 / 0.87 / 0.75 / 0.88 on this CPU (one
# thread) and 0.91 / 0.83 / 0.68 / 0.91 on an H200 in fp32 (0.90 / 0.86 / 0.77 / 0.89 under bf16 autocast), so its
# bound 0.95 holds on either device at any seed and still fails a memory that ignores its text (1.0).
WINDOWS = ["--objective", "ae", "--crop", "window", "--min-len", "16", "--max-len", "16", "--batch-size", "8",
           "--steps", "300", "--warmup", "10", "--save-every", "1000"]
RUNS = {
    "icae": (["--mem", "16", "--chunk-len", "16", "--lora-r", "32", "--lora-alpha", "64", "--lr", "1e-2"], 0.99),
    "500x": (["--mem", "16", "--chunk-len", "16", "--lora-r", "8", "--lora-alpha", "16", "--lr", "1e-2"], 0.975),
    "pcc": (["--mem", "16", "--chunk-len", "16", "--lr", "1e-3"], 0.975),
    "pic": (["--mem", "8", "--chunk-len", "16", "--lr", "1e-3"], 0.985),
    "gmsa": (["--ratios", "2", "--lora-r", "8", "--lora-alpha", "16", "--lr", "1e-2"], 0.97),
    "compllm": (["--ratio", "2", "--lora-r", "8", "--lora-alpha", "16", "--lr", "1e-2"], 0.975),
    "aoc": (["--mem", "16", "--lr", "1e-2"], 0.95),
}


def paper_schedule(method):
    """The method's own lr schedule (the tiny demo decays linearly): these runs were measured with it."""
    return ["--schedule", P.PRESETS[method].recipe.schedule]


@pytest.mark.parametrize("method", P.METHODS)
def test_every_method_learns_memories_that_carry_their_own_text(method, tmp_path, run_train, device, capsys):
    """Held-out own/other below each method's bound (the comment above). AOC's run is also checked on held-out texts
    every 100 steps while it trains: no constant-prompt warning (its memory carries; a memory that ignores its text
    gets one, test_a_constant_memory_gets_the_prompt_warning), and own/other never reached 0.5."""
    flags, max_ratio = RUNS[method]
    out = str(tmp_path / method)
    checks = ["--eval-every", "100"] if method == "aoc" else []
    run_train(["--method", method, "--model", "tiny", "--out", out, *WINDOWS, *flags, *paper_schedule(method), *checks])
    if checks:
        text = capsys.readouterr().out
        assert "warning" not in text and "never <= 0.5 within 300 steps" in text
        checked = eval_rows(out)
        assert [r["step"] for r in checked] == [0, 100, 200, 300] and checked[-1]["eval"]["own_other"] < 0.95
    losses = [r["loss"] for r in log_rows(out)]
    assert len(losses) == 300 and sum(losses[-10:]) / 10 < 0.9 * losses[0]
    comp = checkpoint.load(out, device=device).eval()
    held_out = [{"text": t} for t in D.EVAL_TEXTS]                 # never in the built-in corpus (data.py)
    L = E.run_ae(comp, held_out, max_new_tokens=1, proto=dict(crop="head", n=16, half=False))["loss"]
    assert L["own_other_ratio"] < max_ratio, f"{method}: own {L['own']:.3f} other {L['other']:.3f}"
    assert L["own"] < L["none"]
    # the run directory is a compressor checkpoint (evaluate.py's entry point) holding the trained tensors
    final = load_file(os.path.join(out, "ckpt-000300", "compressor.safetensors"), device=str(device))
    for name, t in checkpoint.trained_state(comp).items():
        torch.testing.assert_close(t, final[name], rtol=0, atol=0)


def test_distillation_learns_on_one_question(files, tmp_path, run_train):
    """CompLLM's objective (Eq. 1-3) on one QA triple: the student's hidden states approach the teacher's."""
    out = str(tmp_path / "compllm")
    run_train(["--method", "compllm", "--model", files["model"], "--data", files["qa"], *LORA, "--lr", "3e-3",
               "--answer-tokens", "8", "--batch-size", "2", "--steps", "60", "--warmup", "0", "--out", out])
    losses = [r["loss"] for r in log_rows(out)]
    assert sum(losses[-3:]) / 3 < 0.2 * losses[0]             # measured 1.79 -> 0.05 (97%)


def test_bf16_autocast_training_on_cuda(tmp_path, run_train, device, monkeypatch):
    """On CUDA train.py keeps fp32 trained weights (AdamW's master copy), bf16 frozen ones (--frozen-dtype auto), and
    runs every step under bf16 autocast: the loss stays finite and falls, held-out memories still carry their own
    text, and the saved tensors are fp32."""
    if device.type != "cuda":
        pytest.skip("train.py autocasts to bf16 on CUDA only; run the suite with --device cuda")
    seen, loss_ae = set(), train.loss_ae

    def recording(comp, batch):   # what autocast state the training step runs in
        seen.add((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
        return loss_ae(comp, batch)
    monkeypatch.setattr(train, "loss_ae", recording)
    flags, max_ratio = RUNS["aoc"]
    out = str(tmp_path / "aoc")
    run_train(["--method", "aoc", "--model", "tiny", "--out", out, *WINDOWS, *flags, *paper_schedule("aoc")])
    assert seen == {(True, torch.bfloat16)}
    losses = [r["loss"] for r in log_rows(out)]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-10:]) / 10 < 0.9 * losses[0]
    comp = checkpoint.load(out, device=device).eval()
    L = E.run_ae(comp, [{"text": t} for t in D.EVAL_TEXTS], max_new_tokens=1,
                 proto=dict(crop="head", n=16, half=False))["loss"]
    assert L["own_other_ratio"] < max_ratio
    saved = load_file(os.path.join(out, "compressor.safetensors"))
    assert saved and all(t.dtype == torch.float32 for t in saved.values())


@pytest.mark.parametrize("method", ["pcc", "pic"])
def test_pcc_and_pic_train_and_evaluate_under_epl_positions(method, tmp_path, run_train, device):
    """The first combination a reader of PIC and EPL tries trains and evaluates: PCC's delimiters under EPL's
    positions are no refusal ('cannot take PCC's delimiters')."""
    out = str(tmp_path / method)
    run_train(["--method", method, "--mem", "4", "--layout", "epl", "--model", "tiny", "--steps", "6", "--chunk-len",
               "16", "--objective", "pretrain", "--crop", "window", "--min-len", "24", "--max-len", "40", "--out", out])
    assert len(log_rows(out)) == 6 and os.path.isfile(os.path.join(out, "ckpt-000006", "compressor.safetensors"))
    result = E.main(["--ckpt", out, "--task", "ae", "--n", "2", "--max-new-tokens", "4", "--device", str(device),
                     "--dtype", "float32"])
    assert checkpoint.load(out).cfg.layout == "epl" and math.isfinite(result["loss"]["own"])


def test_gmsa_keft_trains_only_decoder_qkv_from_the_stage_1_run(files, tmp_path, run_train):
    stage1, keft = str(tmp_path / "ae"), str(tmp_path / "keft")
    run_train(["--method", "gmsa", "--model", files["model"], "--data", files["doc"], *LORA, "--ratios", "2",
               "--batch-size", "2", "--steps", "5", "--out", stage1])
    run_train(["--method", "gmsa", "--stage", "keft", "--init", stage1, "--data", files["qa"], "--batch-size",
               "2", "--steps", "20", "--lr", "1e-3", "--out", keft])
    losses = [r["loss"] for r in log_rows(keft)]
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0]                 # measured 5.75 -> 3.89
    before, after = checkpoint.trained_state(checkpoint.load(stage1)), checkpoint.load(keft)
    assert after.cfg.decoder_train == "keft"
    for name, t in checkpoint.trained_state(after).items():
        if name in before:     # encoder LoRA, LSA, [AE]: frozen in stage 2
            torch.testing.assert_close(t, before[name], rtol=0, atol=0)
        else:
            assert name.startswith("decoder.") and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")


def test_separate_decoder_compresses_with_model_and_decodes_with_decoder(files, tmp_path, run_train):
    """PIC §4.1.2's setup: --model is the compressor, --decoder the frozen LLM; each reads its own tokenizer
    (contexts are re-tokenised for the compressor), and checkpoint.load rebuilds both."""
    out = str(tmp_path / "pic")
    run_train(["--method", "pic", "--model", files["model"], "--decoder", files["other"], "--data", files["doc"],
               "--chunk-len", "24", "--ratio", "4", "--batch-size", "2", "--steps", "3", "--out", out])
    comp = checkpoint.load(out)
    assert (comp.cfg.model, comp.cfg.compressor_model) == (files["other"], files["model"])
    assert comp.enc_tok is not comp.tok
    other = load_file(os.path.join(files["other"], "model.safetensors"))
    torch.testing.assert_close(comp.decoder.model.embed_tokens.weight, other["model.embed_tokens.weight"])
    assert len(log_rows(out)) == 3


# ---- each objective's loss: the papers' equations ----


def test_pretraining_loss_is_lambda_lm_plus_one_minus_lambda_ae(tmp_path, run_train, device):
    """PIC Eq. (8): L = λ·L_TC + (1 − λ)·L_TR, TC the completion (LM) loss of Eq. (7) and TR the reconstruction (AE)
    loss of Eq. (6); the paper's λ = 0.5. At λ = 0.5 a swapped weighting gives the same number, so λ = 0.25 here:
    every logged step's loss is 0.25·lm + 0.75·ae of the parts the same row logs. And the parts are what they say
    (each the compressor's own LM or AE loss of the batch) and weight the gradient: λ = 1 trains through the LM
    loss alone ([AE] gets no gradient), λ = 0 through the AE loss alone ([LM] gets none), λ = 0.25 gives
    0.25·∇lm + 0.75·∇ae."""
    out = tmp_path / "lm-weight"
    run_train(["--model", "tiny", *ACCUMULATION["pretrain"], "--lm-weight", "0.25", "--batch-size", "2", "--lr",
               "3e-3", "--warmup", "0", "--steps", "2", "--out", str(out)])
    for row in log_rows(out):
        assert abs(row["ae"] - row["lm"]) > 1e-3 * row["loss"]   # the two weightings differ on this row
        assert abs(row["loss"] - (0.25 * row["lm"] + 0.75 * row["ae"])) <= 1e-6 * row["loss"], row
    model, tok = build_tiny()
    comp = C.build("icae", model.to(device), tok, mem=4, chunk_len=16, lora_r=8, lora_alpha=16)
    # a step's batch as train_step draws it: x_1..x_p compressed, AE reconstructs them, LM continues with x_p+1.. EOS
    tensors, _ = D.tokenize_corpus([DOC], [], "eq8-test", comp, str(tmp_path), with_qa=False)
    examples = D.step_examples(tensors, D.Sampling("pretrain", "window", 8, 40, batch_size=3, seed=1), comp, 0)
    batch = D.collate(examples)
    batch.norm = D.step_normalizers(comp, "pretrain", examples)
    memory = comp.compress(batch.context)   # the parts, computed here as Eq. (6) and Eq. (7) define them
    ae, _ = comp.lm_loss(memory, "ae", batch.ae, normalize_by=batch.norm["ae"])
    lm, _ = comp.lm_loss(memory, "lm", batch.lm, last_tokens=batch.last, normalize_by=batch.norm["lm"])
    params = comp.trainable_parameters()
    grad = lambda loss: torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    g_ae, g_lm = grad(ae), grad(lm)
    for lam in (0.25, 1.0, 0.0):
        loss, parts = train.loss_pretrain(comp, batch, lam)
        torch.testing.assert_close(parts["ae"], ae, rtol=1e-6, atol=0)
        torch.testing.assert_close(parts["lm"], lm, rtol=1e-6, atol=0)
        torch.testing.assert_close(loss, lam * lm + (1 - lam) * ae, rtol=1e-6, atol=0)
        for p, g, a, b in zip(params, grad(loss), g_ae, g_lm):
            want = sum(w * x for w, x in ((1 - lam, a), (lam, b)) if x is not None)
            if p is comp.ae_embed and lam == 1.0 or p is comp.lm_embed and lam == 0.0:
                assert g is None or not g.any()   # the task left out reads its own token, which learns nothing
            else:
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_qa_loss_is_on_the_answer_and_eos_only(tmp_path, device):
    """EPL §4 fine-tuning, L_QA = −log P(A | [M̃; [LM]; Q]) (EPL Eq. 4): the decoder reads the memory, [LM] and the
    question, and only the answer and the EOS after it are predicted. Through train.py's QA loss on a step drawn as
    training draws it: the tokens the loss supervises are each example's answer + EOS, in order, each predicted from
    the slot before it (the first from the question's last token); the step's normaliser counts exactly those; and
    the loss equals the mean NLL of those tokens under the decoder's full logits, so no question or memory slot
    adds to it."""
    model, tok = build_tiny()
    comp = C.build("icae", model.to(device), tok, mem=4, chunk_len=32, lora_r=8, lora_alpha=16)
    triples = [(c[:64], q, a) for c, q, a in D.BUILTIN_QA]
    tensors, _ = D.tokenize_corpus([], triples, "qa-loss-test", comp, str(tmp_path))
    examples = D.step_examples(tensors, D.Sampling("qa", "window", 2, 64, batch_size=3, seed=0), comp, 0)
    batch = D.collate(examples)
    batch.norm = D.step_normalizers(comp, "qa", examples)
    # which triple each example is, by its question; its answer and question as the template writes them
    parts = [comp.qa_parts(c, q) for c, q, _ in triples]
    which = [next(i for i, p in enumerate(parts) if qa[:len(p["prompt"])] == p["prompt"]) for qa in batch.qa]
    answers = [tok.encode(triples[i][2]) + [tok.eos_id] for i in which]
    assert all(qa == parts[i]["prompt"] + a for qa, i, a in zip(batch.qa, which, answers))
    assert batch.norm["qa"] == sum(map(len, answers))
    seen = []
    assemble = comp.assemble   # the decoder's inputs, from the step's DecoderInputs
    comp.assemble = lambda *a, **k: seen.append(assemble(*a, **k)) or seen[-1]
    loss, _ = train.loss_qa(comp, batch)
    (dec_in,) = seen
    T = dec_in["inputs_embeds"].shape[1]
    memory = comp.compress(batch.context)
    for b, (i, answer) in enumerate(zip(which, answers)):
        rows = [(slot % T, token) for slot, token in dec_in.supervised if slot // T == b]
        assert [token for _, token in rows] == answer, b
        question_end = sum(memory.slots[b]) + 1 + len(parts[i]["prompt"]) - 1   # memory, [LM], question
        assert [slot for slot, _ in rows] == list(range(question_end, question_end + len(answer))), b
    with torch.no_grad(), comp.decoding():
        logp = torch.log_softmax(comp.decoder(**dec_in).logits.float(), -1).flatten(0, 1)   # (B*T, V)
    nll = -sum(logp[slot, token] for slot, token in dec_in.supervised) / sum(map(len, answers))
    torch.testing.assert_close(loss.detach(), nll, rtol=1e-5, atol=0)


def test_distill_caches_the_teachers_own_answers(files, tmp_path, run_train, device):
    out = tmp_path / "compllm"
    run_train(["--method", "compllm", "--model", files["model"], "--data", files["qa"], *LORA, "--batch-size",
               "2", "--steps", "2", "--answer-tokens", "8", "--out", str(out)])
    (cache,) = out.glob("cache/answers-*.pt")
    answers = torch.load(cache, weights_only=True)
    comp = checkpoint.load(str(out), device=device)
    context, question, _ = D.BUILTIN_QA[2]
    ids = torch.tensor([comp.tok.encode(context[:96]) + comp.tok.encode(question)], device=device)
    # the teacher answered under train.py's autocast (bf16 on CUDA): the same kernels give the same greedy tokens
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with torch.no_grad(), comp.decoding(), autocast:     # the frozen LLM: the LoRA encoder switched off
        greedy = comp.decoder.generate(ids, max_new_tokens=8, eos_id=comp.tok.eos_ids)[0].tolist()
    eos = comp.tok.eos_id
    assert list(answers.values()) == [greedy[:greedy.index(eos) + 1] if eos in greedy else greedy]


# ---- the loop's arithmetic ----
# one objective per case, on texts (or answers) of different lengths, so micro-batches hold different numbers of
# supervised tokens: averaging each micro-batch's own mean differs from the step's mean (6.0001 against 6.0277 for
# icae pretrain at --micro-batch 2)
ACCUMULATION = {
    "pretrain": ["--method", "icae", "--objective", "pretrain", "--mem", "4", "--chunk-len", "16", *LORA, "--crop",
                 "window", "--min-len", "8", "--max-len", "40"],
    "ae": ["--method", "aoc", "--mem", "4", "--crop", "window", "--min-len", "6", "--max-len", "32"],
    "qa": ["--method", "500x", "--objective", "qa", "--mem", "4", "--chunk-len", "32", *LORA, "--max-len", "64"],
    "distill": ["--method", "compllm", "--objective", "distill", *LORA, "--answer-tokens", "6", "--max-len", "48"],
}


@pytest.mark.parametrize("objective", ACCUMULATION)
def test_micro_batches_give_the_full_batch_step(objective, tmp_path, run_train, device):
    """A step's loss is the mean over all its supervised tokens (distill: over its examples) however it is split:
    --micro-batch 1 and 2 log the loss and gradient norm of the full batch at every step (and so train the same).

    On CUDA train.py autocasts to bf16, and a micro-batch of 2 runs other GEMM and attention shapes than a batch
    of 4, so the two runs round in other places (8 mantissa bits: up to 2^-8 relative per rounding). How far two
    differently rounded bf16 runs of this step drift apart, measured on the CPU as bf16 autocast against fp32
    (aoc on tiny, 4 x 32 tokens, seeds 0-2): loss 5e-5 to 2.6e-4 relative, grad norm 5e-4 to 6.3e-3. The bounds
    there are 5e-3 (loss) and 3e-2 (grad norm), relative; on the CPU the runs agree to 1e-5."""
    base = ["--model", "tiny", *ACCUMULATION[objective], "--batch-size", "4", "--lr", "3e-3", "--warmup", "0",
            "--steps", "3", "--seed", "1"]
    runs = {}
    for micro in (None, 2, 1):
        out = tmp_path / f"micro{micro}"
        run_train(base + ["--out", str(out)] + (["--micro-batch", str(micro)] if micro else []))
        runs[micro] = log_rows(out)
    rel = 1e-5 if device.type == "cpu" else None
    for micro in (2, 1):
        for a, b in zip(runs[None], runs[micro], strict=True):
            for key in ("loss", "grad_norm"):
                bound = rel if rel else (5e-3 if key == "loss" else 3e-2)
                assert abs(a[key] - b[key]) <= bound * abs(a[key]), (objective, micro, a["step"], key, a[key], b[key])
    # the texts really differ in length, so a mean of per-micro-batch means would not have matched
    assert len({r["tokens"] for r in runs[None]}) > 1 or objective == "distill"


def test_schedules():
    assert [train.lr_at(s, 1.0, 10, 110, "constant") for s in (0, 4, 9, 10, 109)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    assert [round(train.lr_at(s, 1.0, 10, 110, "linear"), 6) for s in (10, 60, 109)] == [1.0, 0.5, 0.01]
    assert [round(train.lr_at(s, 1.0, 10, 110, "cosine"), 6) for s in (10, 60)] == [1.0, 0.5]


def test_grad_ckpt_gives_the_same_losses(tmp_path, run_train):
    base = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "3", "--lr", "3e-3"]
    run_train(base + ["--out", str(tmp_path / "plain")])
    run_train(base + ["--out", str(tmp_path / "ckpt"), "--grad-ckpt"])
    for a, b in zip(log_rows(tmp_path / "plain"), log_rows(tmp_path / "ckpt"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5


# ---- the data a step draws ----


def test_head_crop_takes_the_first_n_tokens_of_a_document_and_pads_with_eos(tmp_path):
    """AOC code: tokenizer(text, truncation=True, padding="max_length", max_length=n); pad = EOS, trained on."""
    comp = C.build("aoc", *build_tiny(), mem=4)
    docs = ["A long document that has more than enough tokens.", "Short one."]
    data, _ = D.tokenize_corpus(docs, [], "head-crop-test", comp, cache_dir=str(tmp_path))
    s = D.Sampling("ae", "head", 16, 16, batch_size=1, seed=0)
    seen = set()
    for i in range(40):
        ex = D.sample_example(data, s, np.random.default_rng(i), comp, step=i)
        seen.add(tuple(ex["context"]))
        assert ex["ae"] == ex["context"] + [comp.tok.eos_id]
    tok = comp.tok
    assert seen == {tuple(tok.encode(docs[0])[:16]), tuple(tok.encode(docs[1]) + [tok.pad_id] * 6)}


def test_gmsa_draws_each_examples_ratio_from_4_and_8_and_compresses_it_by_that_ratio(tmp_path, device):
    """GMSA §4.1: "During training, we randomly sampled compression rates (i.e., 4x compression and 8x compression)
    for each training sample." Over a few steps drawn as train.py draws them: every example carries one ratio, 4 or
    8; both occur, and inside one step's batch too (drawn per example, not once per batch); and the memory train.py's
    AE loss compresses each example into holds ⌈(1 + |X|) / r⌉ vectors ([BOS] x in groups of r) for that example's
    own r. compress without ratios (evaluation) also draws one per context."""
    model, tok = build_tiny()
    comp = C.build("gmsa", model.to(device), tok, lora_r=4, lora_alpha=8)
    assert comp.cfg.ratios == (4, 8)
    tensors, _ = D.tokenize_corpus(D.BUILTIN_TEXTS, [], "gmsa-ratio-test", comp, str(tmp_path), with_qa=False)
    sampling = D.Sampling("ae", "window", 16, 40, batch_size=8, seed=0)
    memories = []
    encode = comp.encode   # the step's memory, from its EncoderInputs
    comp.encode = lambda *a, **k: memories.append(encode(*a, **k)) or memories[-1]
    drawn, mixed = [], 0
    for step in range(4):
        examples = D.step_examples(tensors, sampling, comp, step)
        assert all(len(ex["ratio"]) == 1 and ex["ratio"][0] in (4, 8) for ex in examples)
        batch = D.collate(examples)
        batch.norm = D.step_normalizers(comp, "ae", examples)
        assert batch.ratios == [ex["ratio"][0] for ex in examples]
        with torch.no_grad():
            train.loss_ae(comp, batch)
        counts = memories[-1].slots
        assert counts == [[math.ceil((1 + len(x)) / r)] for x, r in zip(batch.context, batch.ratios)], step
        drawn += batch.ratios
        mixed += len(set(batch.ratios)) == 2
    assert set(drawn) == {4, 8} and mixed >= 2, drawn
    ids = tok.encode(DOC[:31])
    torch.manual_seed(0)
    with torch.no_grad():
        counts = comp.compress([ids] * 16).slots   # (1 + 31) / 4 = 8 vectors, or 32 / 8 = 4
    assert sorted({c for [c] in counts}) == [4, 8], counts


@pytest.mark.parametrize("method", ["icae", "500x"])
def test_qa_max_len_cuts_the_context_not_the_templates_text(method, tmp_path, device):
    """On tiny (n = 8) EPL's template "### Context:\n" (13 bytes) must not eat the context's budget: the compressed
    ids, in training (draw_qa) and in the held-out check / evaluate.py --max-len (run_qa), are the template's text
    around the context's first 8 bytes. Cutting the whole piece would leave "### Cont", no context: own/other exactly
    1."""
    comp = C.build(method, *build_tiny(), mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    assert comp.template()[1] == "### Context:\n{context}"
    context, question, answer = D.BUILTIN_QA[2]
    data, _ = D.tokenize_corpus([], [(context, question, answer)], "qa-cut-test", comp, str(tmp_path))
    qa, distill = (D.Sampling(o, "window", 2, 8, batch_size=1, seed=0) for o in ("qa", "distill"))
    want = comp.enc_tok.encode("### Context:\n" + context[:8])
    assert D.draw_qa(data, qa, np.random.default_rng(0), comp)["context"] == want
    assert D.draw_qa(data, distill, np.random.default_rng(0), comp)["dec_context"] == \
        comp.tok.encode("### Context:\n" + context[:8])
    seen = []
    compress = comp.compress
    comp.compress = lambda ctx, **kw: seen.append([list(c) for c in ctx]) or compress(ctx, **kw)
    E.run_qa(comp, [dict(context=context, question=question, answer=answer)], max_len=8, generate=False)
    assert seen[0] == [want]


def test_parquet_data(tmp_path, run_train):
    """Most hub data sets are Parquet: text rows and SQuAD-style QA rows ({"text": [...]} answers)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["First document here.", "Second document here."]}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"context": ["Paris is in France."], "question": ["Where is Paris?"],
                             "answers": [{"text": ["France", "in France"], "answer_start": [12, 9]}]}),
                   tmp_path / "qa.parquet")
    texts, qa, _ = D.read_corpus(str(tmp_path))
    assert sorted(texts) == ["First document here.", "Second document here."]
    assert qa == [("Paris is in France.", "Where is Paris?", "France")]
    out = str(tmp_path / "run")
    run_train(["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "2",
               "--data", str(tmp_path / "t.parquet"), "--out", out])
    assert len(log_rows(out)) == 2


def test_an_unanswerable_squad_record_is_text_for_ae_and_no_qa_example(tmp_path, run_train):
    """SQuAD 2.0 holds questions with no answer ("answers": {"text": [], "answer_start": []}): such a record does not
    refuse the file (ae reads only the contexts). Its context is a text; it is no QA example."""
    squad = tmp_path / "squad.jsonl"
    rows = [{"context": D.BUILTIN_TEXTS[0], "question": "Which?", "answers": {"text": ["the"], "answer_start": [0]}},
            {"context": D.BUILTIN_TEXTS[1], "question": "Why?", "answers": {"text": [], "answer_start": []}}]
    squad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, qa, _ = D.read_corpus(str(squad))
    assert texts == [D.BUILTIN_TEXTS[1]] and [q for _, q, _ in qa] == ["Which?"]
    for objective in ("ae", "qa"):
        run_train(["--method", "icae", "--mem", "4", "--chunk-len", "16", *LORA, "--objective", objective, "--data",
                   str(squad), "--crop", "window", "--batch-size", "2", "--steps", "1", "--eval-every", "0",
                   "--out", str(tmp_path / objective)])
        assert len(log_rows(tmp_path / objective)) == 1


# ---- levers (ours): for a memory that carries nothing at this scale ----
# a short 500x run on tiny, LoRA dropout on (it draws from the RNG a held-out check must leave alone): the levers' test
# run here and the held-out check's (tests/test_heldout.py)
HELD_OUT = ["--model", "tiny", "--crop", "window", "--min-len", "8", "--max-len", "16", "--batch-size", "4",
            "--lr", "3e-3", "--seed", "2"]
X500 = ["--method", "500x", "--mem", "16", "--chunk-len", "16", *LORA, "--lora-dropout", "0.1"]


def test_mem_lr_trains_the_memory_tokens_at_their_own_rate(tmp_path, run_train, device, capsys):
    """--mem-lr 0 keeps the learned memory tokens where they were drawn while the LoRA trains at --lr; a preset
    without memory tokens refuses the flag with one line."""
    out = str(tmp_path / "run")
    run_train([*X500, "--objective", "ae", *HELD_OUT, "--steps", "2", "--mem-lr", "0", "--eval-every", "0",
               "--out", out])
    torch.manual_seed(2)                                    # the run's --seed: its init
    init = checkpoint.load(out, trained=False, device=device)
    trained = checkpoint.load(out, device=device)
    assert torch.equal(init.mem_tokens, trained.mem_tokens)
    lora = [n for n, _ in trained.named_parameters() if "lora_B" in n]
    assert lora and any(not torch.equal(dict(init.named_parameters())[n], dict(trained.named_parameters())[n])
                        for n in lora)
    with pytest.raises(SystemExit, match="--mem-lr sets the learning rate of learned memory tokens, and gmsa has none"):
        run_train(["--method", "gmsa", "--model", "tiny", *LORA, "--steps", "1", "--mem-lr", "1e-3",
                   "--out", str(tmp_path / "gmsa")])


def test_len_curriculum_grows_the_texts_from_n_tokens(tmp_path):
    """--len-curriculum 4 10 with --min-len 12 --max-len 16: texts of 4 tokens at step 0, 8-10 at step 5, and the
    run's own 12-16 from step 10 on."""
    args = D.Sampling("ae", "window", 12, 16, batch_size=8, seed=0, len_curriculum=(4, 10))
    assert [D.text_lengths(args, s) for s in (0, 5, 10, 50)] == [(4, 5), (8, 11), (12, 17), (12, 17)]
    comp = C.build("aoc", *build_tiny(), mem=4)
    data, _ = D.tokenize_corpus(D.generated_texts(50, 0), [], "curriculum-test", comp, cache_dir=str(tmp_path))
    s = D.Sampling("ae", "window", 12, 16, batch_size=8, seed=0, len_curriculum=(4, 10))
    lengths = lambda step: {len(ex["context"]) for ex in D.step_examples(data, s, comp, step)}
    assert lengths(0) == {4} and lengths(20) <= set(range(12, 17)) and len(lengths(20)) > 1
    with pytest.raises(SystemExit, match="--len-curriculum N K needs 1 <= N <= --min-len"):
        cli.parse_args(["--method", "aoc", "--crop", "window", "--min-len", "8", "--len-curriculum", "9", "10"])


# --own-other-weight: texts of 8 to 40 tokens, each one chunk of 4 slots (--chunk-len 41 holds [BOS] + 40), so
# every pair of neighbours has the same slots and the texts' mean losses weigh their tokens unlike the AE mean does
OWN_OTHER = ["--method", "icae", "--objective", "ae", "--mem", "4", "--chunk-len", "41", *LORA, "--crop", "window",
             "--min-len", "8", "--max-len", "40", "--own-other-weight", "0.3"]


@pytest.mark.parametrize("method", ["icae", "500x"])   # both carriers: input embeddings, K/V
def test_own_other_term_is_the_softplus_of_own_minus_the_neighbours_loss(method, tmp_path, device):
    """--own-other-weight W: loss = AE + W · (1/N) Σ_b softplus(ℓ_b(own) − ℓ_b(other)), ℓ_b a text's mean AE NLL,
    `other` its neighbour's memory (texts 1-2, 3-4 trade). By hand from evaluation's per-text sums (Compressor.nll,
    F.cross_entropy without chunks): own from the texts compressed as they are, other from the texts compressed in
    the traded order; each text's decoder rows are its own. Off in every preset."""
    model, tok = build_tiny()
    comp = C.build(method, model.to(device), tok, mem=4, chunk_len=41, lora_r=8, lora_alpha=16)
    tensors, _ = D.tokenize_corpus([DOC], [], "own-other-test", comp, str(tmp_path), with_qa=False)
    examples = D.step_examples(tensors, D.Sampling("ae", "window", 8, 40, batch_size=4, seed=1), comp, 0)
    batch = D.collate(examples)
    batch.norm = D.step_normalizers(comp, "ae", examples)
    assert len({len(t) for t in batch.ae}) > 1 and batch.norm["texts"] == 4
    loss, parts = train.loss_ae_own_other(comp, batch, 0.3)
    own, n = comp.nll(comp.compress(batch.context), "ae", batch.ae)
    other, _ = comp.nll(comp.compress([batch.context[i] for i in (1, 0, 3, 2)]), "ae", batch.ae)
    softplus = lambda x: math.log1p(math.exp(x))
    term = sum(softplus(o / k - p / k) for o, p, k in zip(own, other, n)) / 4
    assert abs(term - math.log(2)) > 1e-4                                # the memories already differ by text
    assert parts["own_vs_other"].item() == pytest.approx(term, rel=1e-5)
    assert parts["ae"].item() == pytest.approx(sum(own) / batch.norm["ae"], rel=1e-5)
    torch.testing.assert_close(loss, parts["ae"] + 0.3 * parts["own_vs_other"])
    with pytest.raises(ValueError, match="needs an even number of texts"):   # a text without a neighbour
        comp.compress(batch.context[:3]).neighbours()
    assert all(cli.parse_args(["--method", m]).own_other_weight == 0 for m in P.METHODS)


def test_own_other_term_adds_up_over_micro_batches(tmp_path, run_train, device):
    """The step's own/other term, its loss and gradient are the same at --micro-batch 2 as in one batch of 4: each
    text's term over the step's texts, and pairs that a micro-batch holds whole (bounds: the micro-batch test's)."""
    base = ["--model", "tiny", *OWN_OTHER, "--batch-size", "4", "--lr", "3e-3", "--warmup", "0", "--steps", "3",
            "--seed", "1", "--eval-every", "0"]
    run_train(base + ["--out", str(tmp_path / "whole")])
    run_train(base + ["--out", str(tmp_path / "micro"), "--micro-batch", "2"])
    whole, micro = log_rows(tmp_path / "whole"), log_rows(tmp_path / "micro")
    for a, b in zip(whole, micro, strict=True):
        for key in ("loss", "grad_norm", "ae", "own_vs_other"):
            bound = 1e-5 if device.type == "cpu" else (3e-2 if key == "grad_norm" else 5e-3)
            assert abs(a[key] - b[key]) <= bound * abs(a[key]), (a["step"], key, a[key], b[key])
        assert abs(a["loss"] - (a["ae"] + 0.3 * a["own_vs_other"])) <= 1e-6 * a["loss"]
    assert len({r["tokens"] for r in whole}) > 1   # texts of several lengths


def test_a_pair_with_unequal_slots_ends_the_run_in_one_line(tmp_path, run_train):
    """Texts cut into chunks of 8 (a 2- to 5-chunk text gets 4 slots a chunk) rarely pair: the step that draws such
    a pair ends the run with one line naming it (train.step_guard), nothing saved past the last good state."""
    argv = ["--model", "tiny", *OWN_OTHER, "--chunk-len", "8", "--batch-size", "4", "--steps", "2", "--seed", "1",
            "--eval-every", "0", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        run_train(argv)
    assert "step 1: own/other pairs texts 1-2" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "run").glob("ckpt-*"))


def test_warm_start_begins_where_the_other_run_ended(tmp_path, run_train, device, capsys):
    """--warm-start RUN: this run's compressor starts from RUN's trained tensors (here with another --chunk-len, a
    4x arm from a 1:1 arm); a compressor of another shape is one line, not a traceback."""
    first = str(tmp_path / "first")
    run_train([*X500, "--objective", "ae", *HELD_OUT, "--steps", "2", "--eval-every", "0", "--out", first])
    warm = str(tmp_path / "warm")
    run_train(["--method", "500x", "--mem", "16", "--chunk-len", "64", *LORA, "--objective", "ae", "--model", "tiny",
               "--crop", "window", "--min-len", "32", "--max-len", "64", "--batch-size", "4", "--lr", "0",
               "--steps", "1", "--eval-every", "0", "--warm-start", first, "--out", warm])
    a, b = (load_file(os.path.join(d, "compressor.safetensors")) for d in (first, warm))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint.load(warm).cfg.chunk_len == 64
    with pytest.raises(SystemExit, match=r"--warm-start .*first: checkpoint does not match the compressor"):
        run_train(["--method", "500x", "--mem", "8", *LORA, "--model", "tiny", "--steps", "1", "--warm-start", first,
                   "--out", str(tmp_path / "bad")])
