"""evaluate.py's tasks and command line on tiny checkpoints: every task runs and writes JSON, and what it
reports is checked against the definitions — scores against the metric functions applied to the saved
generations, perplexity against its NLL sums, KV bytes against layers · 2 · Hkv · D · bytes per slot, the
interpolation end points against Z0 / Z1 themselves, the heatmap against an independent cosine and the
PNG by its signature and its decoded pixels. Bad input ends in one line `error: ...`.

The tiny model is random, so its quality numbers mean nothing; where a test needs generations that
vary (interpolation) the decoder is randomised with a larger std, as conftest.randomize_ does.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bench_speed
import compressors as C
import presets as P
import evaluate as E
import metrics as M
import train
import checkpoint
import runlog
import data as D
from conftest import SMOLLM2, needs_smollm2, randomize_
from model import TINY_CONFIG, ModelConfig, Transformer, build_tiny

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models run on one thread


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """method -> checkpoint directory of an untrained tiny compressor (what train.py --out writes)."""
    root = tmp_path_factory.mktemp("ckpt")
    settings = {"aoc": dict(mem=4, chunk_len=64), "icae": dict(mem=4, chunk_len=64, lora_r=4, lora_alpha=8),
                "compllm": dict(lora_r=4, lora_alpha=8), "gmsa": dict(lora_r=4, lora_alpha=8)}
    out = {}
    for method, kw in settings.items():
        torch.manual_seed(0)
        checkpoint.save(C.build(method, *build_tiny(), **kw), str(root / method))
        out[method] = str(root / method)
    return out


def run(argv, device, capsys=None, dtype="float32"):
    """evaluate.py's main on the test device, in fp32 unless told (its own default is bf16 on CUDA): the tests
    recompute what it reports (cosines, NLL sums) in fp32. dtype=None keeps evaluate.py's default."""
    argv = [*argv, "--device", device, *(["--dtype", dtype] if dtype else [])]
    result = E.main([str(a) for a in argv])
    return result, (capsys.readouterr().out if capsys else "")


def random_comp(method, device, **kw):
    """A compressor around a tiny decoder with larger random weights, so greedy outputs vary with the memory
    (the std-0.02 tiny model repeats its input token whatever the memory holds), on `device`."""
    decoder, tok = build_tiny()
    randomize_(decoder, seed=0, std=0.3)
    torch.manual_seed(0)
    return C.build(method, decoder.to(device), tok, **kw).eval()


# ---- ae ----


def test_ae_scores_are_the_metrics_of_the_saved_generations(ckpt, capsys, device):
    result, out = run(["--ckpt", ckpt["aoc"], "--task", "ae", "--n", 2, "--max-new-tokens", 24], device, capsys)
    saved = json.loads(Path(ckpt["aoc"], "eval_ae.json").read_text())   # default output next to the checkpoint
    assert saved["scores"] == result["scores"] and len(saved["examples"]) == 2
    for key in ("bleu4_ids", "bleu4_words", "prefix_em", "rouge1", "rouge2", "rougeL", "compressed", "full", "none"):
        assert key in out
    comp_tok = build_tiny()[1]
    for mode in ("compressed", "full", "none"):
        per_example = []
        for ex in saved["examples"]:
            ref = comp_tok.encode(ex["text"])
            assert ex["reference_ids"] == ref
            hyp = ex[mode]["ids"]
            assert comp_tok.decode(hyp) == ex[mode]["text"] and len(hyp) <= 24
            hw, rw = M.word_tokens(ex[mode]["text"]), M.word_tokens(comp_tok.decode(ref))
            # AOC's texts: newlines to spaces, stripped
            ht, rt = (t.replace("\n", " ").strip() for t in (ex[mode]["text"], comp_tok.decode(ref)))
            pltrdy = M.rouge_pltrdy(ht, rt)
            # EPL's evaluator: the generation with the EOS it stopped at, against the AE target [x, EOS]
            eos = comp_tok.eos_id
            epl = M.bleu4(hyp + [eos] if len(hyp) < 24 else hyp, ref + [eos])
            expect = {"bleu4_ids": epl, "bleu4_words": M.bleu4(hw, rw, smooth=True),
                      "prefix_em": M.prefix_em(hyp, ref), "token_accuracy": M.token_accuracy(hyp, ref),
                      "rouge1": M.rouge_n_f1(hw, rw, 1), "rouge2": M.rouge_n_f1(hw, rw, 2),
                      "rougeL": M.rouge_l_f1(hw, rw), "aoc_em": M.aoc_exact_match(ht, rt),
                      "aoc_rouge1": pltrdy["rouge-1"]["f"], "aoc_rouge2": pltrdy["rouge-2"]["f"],
                      "aoc_rougeL": pltrdy["rouge-l"]["f"]}
            assert ex[mode]["scores"] == expect
            per_example.append(expect)
        for k in per_example[0]:
            assert saved["scores"][mode][k] == pytest.approx(sum(e[k] for e in per_example) / len(per_example))


def test_ae_scores_the_compressed_generation_against_its_own_context(monkeypatch, device):
    """A compressor that regenerates the first 10 tokens right and then goes wrong: prefix EM is exactly
    10 / |ref| (and so is AOC's character prefix EM: one byte per token), token accuracy and BLEU are
    above zero, and the references are untouched by the patch."""
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    text = D.EVAL_TEXTS[1]
    ref = comp.tok.encode(text)
    wrong = (ref[10] + 1) % 256
    monkeypatch.setattr(comp, "generate", lambda memory, task, **kw: [ref[:10] + [wrong] + ref[11:40]])
    result = E.run_ae(comp, [{"text": text}], max_new_tokens=12)
    s = result["scores"]["compressed"]
    assert s["prefix_em"] == 10 / len(ref) == s["aoc_em"] and len(text) == len(ref)
    assert s["token_accuracy"] == 39 / len(ref)
    assert 0 < s["bleu4_ids"] < 1 and 0 < s["rougeL"] < 1 and 0 < s["aoc_rougeL"] < 1
    assert len(result["examples"][0]["full"]["ids"]) <= 12   # the plain-LLM rows still generate


# ---- lm ----


def test_lm_perplexity_is_exp_of_the_summed_nll(ckpt, capsys, device):
    result, out = run(["--ckpt", ckpt["icae"], "--task", "lm", "--n", 3], device, capsys)
    assert "perplexity" in out and os.path.isfile(os.path.join(ckpt["icae"], "eval_lm.json"))
    tok = build_tiny()[1]
    for mode in ("compressed", "full", "none"):
        rows = [ex[mode] for ex in result["examples"]]
        nll, n = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
        assert result["scores"][mode]["perplexity"] == pytest.approx(math.exp(nll / n))
        # EPL: the second half, from p = ⌊|X|/2⌋, and its EOS (the LM target of the EPL and PCC code) are scored
        # in full in every row (ICAE puts [LM] before it)
        lens = [len(tok.encode(t)) for t in D.unseen_texts()[:3]]
        assert [r["tokens"] for r in rows] == [n - n // 2 + 1 for n in lens]
    # the byte-level model's vocabulary is 259: a random model sits near uniform, nowhere near 0 or 10^4
    assert 50 < result["scores"]["none"]["perplexity"] < 2000


@needs_smollm2
def test_full_context_beats_no_context_on_smollm2(tmp_path, device):
    """The upper reference must use the context: a real LLM predicts a text's second half better after its
    first half than after BOS alone (the compressed row of an untrained compressor is not checked)."""
    from model import load_pretrained
    decoder, tok = load_pretrained(str(SMOLLM2))
    checkpoint.save(C.build("icae", decoder, tok, model=str(SMOLLM2), mem=4, chunk_len=64, lora_r=2, lora_alpha=4),
                    str(tmp_path))
    result, _ = run(["--ckpt", tmp_path, "--task", "lm", "--n", 3], device)
    assert result["scores"]["full"]["perplexity"] < 0.8 * result["scores"]["none"]["perplexity"]


# ---- qa ----


def test_qa_runs_on_the_builtin_set_and_scores_the_whole_generation(ckpt, capsys, device):
    result, out = run(["--ckpt", ckpt["icae"], "--task", "qa", "--max-new-tokens", 8], device, capsys)
    assert len(result["examples"]) == len(D.EVAL_QA) and "squad_f1" in out and result["max_new_tokens"] == 8
    for ex in result["examples"]:
        for mode in ("compressed", "full", "none"):
            assert ex[mode]["scores"] == M.qa_scores(ex[mode]["text"], ex["answer"])


@pytest.mark.parametrize("method,task", [("aoc", "ae"), ("icae", "qa")])
def test_no_baselines_regenerates_from_the_memory_only_and_the_same(method, task, ckpt, tmp_path, capsys, device):
    """--no-baselines leaves out the plain LLM's rows (full, none) and changes nothing in the memory's row."""
    argv = ["--ckpt", ckpt[method], "--task", task, "--n", 2, "--max-new-tokens", 8]
    whole = run([*argv, "--out", tmp_path / "whole.json"], device, capsys)[0]   # its stdout read and set aside
    lean, out = run([*argv, "--out", tmp_path / "lean.json", "--no-baselines"], device, capsys)
    assert set(whole["scores"]) == {"compressed", "full", "none"} and set(lean["scores"]) == {"compressed"}
    assert lean["scores"]["compressed"] == whole["scores"]["compressed"] and lean["loss"] == whole["loss"]
    for a, b in zip(lean["examples"], whole["examples"], strict=True):
        assert "full" not in a and "none" not in a and a["compressed"] == b["compressed"]
    assert "| compressed |" in out and "| full |" not in out


def test_no_baselines_is_refused_where_nothing_regenerates(ckpt, one_line_error):
    assert "--no-baselines applies to ae and qa" in one_line_error(
        ["--ckpt", ckpt["aoc"], "--task", "lm", "--no-baselines"])


def test_qa_right_answer_scores_one_and_what_follows_it_counts(monkeypatch, device):
    comp = random_comp("icae", device, mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    ex = D.EVAL_QA[4]   # answer "away from the Sun"
    answer = comp.tok.encode(" Away from the Sun")
    monkeypatch.setattr(comp, "generate", lambda memory, task, prompt=None, **kw: [answer])
    s = E.run_qa(comp, [ex], max_new_tokens=4)["scores"]["compressed"]
    assert s["squad_em"] == s["squad_f1"] == s["substring_acc"] == 1.0    # normalised: case ignored
    assert s["exact_match"] == 0.0 and 0 < s["token_f1"] < 1               # unnormalised: "Away" != "away"
    assert s["epl_em"] == 0.0 and s["epl_f1"] == pytest.approx(0.75)      # EPL: 3 of 4 words, case-sensitive
    # the whole generation up to EOS is scored (the papers' scripts cut no first line): rambling on costs EM
    monkeypatch.setattr(comp, "generate", lambda memory, task, prompt=None, **kw:
                        [comp.tok.encode(" away from the Sun\nQuestion: why?")])
    s = E.run_qa(comp, [ex], max_new_tokens=4)["scores"]["compressed"]
    assert s["squad_em"] == 0.0 and s["substring_acc"] == 1.0 and 0 < s["squad_f1"] < 1


def test_qa_rows_share_the_checkpoints_template(monkeypatch, device):
    """One prompt builder for every row: EPL's template in the compressed row and in the plain LLM's rows."""
    comp = random_comp("icae", device, mem=4, chunk_len=64, lora_r=4, lora_alpha=8)   # EPL's QA template
    ex, plain, contexts = D.EVAL_QA[0], [], []
    monkeypatch.setattr(E.PlainLLM, "generate", lambda self, prompts, n: plain.append(prompts) or [[]] * len(prompts))
    compressed = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: contexts.append(ctx) or compressed(ctx, **kw))
    E.run_qa(comp, [ex], max_new_tokens=2)
    dec, bos = comp.tok.decode, comp.tok.bos_id
    assert dec(contexts[0][0]) == "### Context:\n" + ex["context"]                     # what is compressed
    full, none = plain[0][0], plain[1][0]
    assert full[0] == none[0] == bos                                                    # the plain LLM's BOS
    assert dec(full) == "### Context:\n" + ex["context"] + "\n### Question:\n" + ex["question"] + "\n### Answer:\n"
    assert dec(none) == "\n### Question:\n" + ex["question"] + "\n### Answer:\n"         # no context


def test_multiple_choice_regex_and_long_concatenated_contexts(monkeypatch, device):
    """CompLLM: "the answer is (X)" scores multiple choice; §4 joins k contexts, each compressed once."""
    assert M.answer_letter("...so the answer is (B). Or is the answer is (c)?") == "C"
    assert M.qa_scores("Think... the answer is (D)", "D")["mc_accuracy"] == 1.0
    assert "mc_accuracy" not in M.qa_scores("Paris", "Paris")
    comp = random_comp("compllm", device)
    calls = []
    compressed = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: calls.append(kw.get("cache")) or compressed(ctx, **kw))
    result = E.run_qa(comp, D.EVAL_QA[:4], max_new_tokens=2, batch_size=1, concat=2)
    contexts = [ex["context"] for ex in result["examples"]]
    assert contexts[0] == contexts[1] == D.EVAL_QA[0]["context"] + "\n\n" + D.EVAL_QA[1]["context"]
    # each batch compresses its own context and another document's (the own/other loss), all through one cache
    assert len(calls) == 8 and all(c is calls[0] for c in calls) and len(calls[0]) > 0


def test_data_files(tmp_path):
    """--data: .jsonl QA records (a list of answers = several references), QA records as texts, plain text."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"context": "Ada lives in Paris.", "question": "Where?", "answer": ["Paris", "in Paris"]})
                  + "\n\n" + json.dumps({"context": "Bo is 7.", "question": "Age?", "answer": "7"}) + "\n")
    assert E.load_examples(str(qa), "qa", 1) == [{"context": "Ada lives in Paris.", "question": "Where?",
                                                  "answer": ["Paris", "in Paris"]}]
    assert E.load_examples(str(qa), "ae") == [{"text": "Ada lives in Paris."}, {"text": "Bo is 7."}]
    txt = tmp_path / "t.txt"
    txt.write_text("first text\n\nsecond text\n")
    assert E.load_examples(str(txt), "lm") == [{"text": "first text"}, {"text": "second text"}]
    assert M.qa_scores("in Paris", ["Paris", "in Paris"])["exact_match"] == 1.0    # max over references
    assert M.qa_scores("in Paris", ["Paris", "in Paris"])["epl_em"] == 0.0         # EPL: answers[0] only


# ---- speed (tests/bench_speed.py, a benchmark that reuses evaluate.py's loading and compression) ----


@pytest.mark.parametrize("method", ["aoc", "compllm"])
def test_speed_reports_times_and_the_analytic_kv_bytes(method, tmp_path, capsys, device):
    out_file = tmp_path / "speed.json"
    lengths = [64, 128, 256, 512]
    argv = ["--method", method, "--model", "tiny", "--out", out_file, "--lengths", ",".join(map(str, lengths)),
            "--max-new-tokens", 2, "--device", device]
    result = bench_speed.main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert json.loads(out_file.read_text())["rows"] == result["rows"] and result["task"] == "speed"
    assert "TTFT full ms" in out and "C^2" in out
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    # evaluate.py's own dtype for the device (what a GPU user times): fp32 on the CPU, bf16 on CUDA
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * E.DTYPES[result["dtype"]].itemsize
    assert [r["context_tokens"] for r in result["rows"]] == lengths
    for r in result["rows"]:
        T, M = r["context_tokens"], r["memory_slots"]
        # aoc: 16 memory tokens per chunk of 512; compllm: ceil(n/2) per segment -> about T/2
        assert M == (16 if method == "aoc" else M) and (method == "aoc" or T / 2 <= M < T / 2 + T / 8)
        assert r["compress_cached_s"] < r["compress_s"]          # the same context again: every chunk cached
        assert r["kv_bytes_full"] == T * per_slot and r["kv_bytes_compressed"] == M * per_slot
        assert r["kv_bytes_compressed"] < r["kv_bytes_full"] and r["kv_ratio"] == M / T
        assert r["speedup_offline"] == pytest.approx(r["ttft_full_s"] / r["ttft_compressed_s"])
        assert r["speedup_online"] == pytest.approx(r["ttft_full_s"] / (r["compress_s"] + r["ttft_compressed_s"]))
        assert min(r["compress_s"], r["ttft_full_s"], r["decode_full_s_per_token"]) > 0
    assert all(math.isfinite(k) for k in result["exponents"].values())
    assert result["ttft_bound_c2"] == pytest.approx((lengths[-1] / result["rows"][-1]["memory_slots"]) ** 2)


def test_speed_of_a_checkpoint_writes_its_eval_speed_json(ckpt, capsys, device):
    """What recipes/compllm.sh runs on its arm: --ckpt, the record next to the checkpoint as evaluate.py writes it."""
    argv = ["--ckpt", ckpt["compllm"], "--lengths", 64, "--max-new-tokens", 1, "--device", device]
    result = bench_speed.main([str(a) for a in argv])
    assert json.loads(Path(ckpt["compllm"], "eval_speed.json").read_text()) == json.loads(json.dumps(result))
    assert result["checkpoint"] == ckpt["compllm"] and result["config"]["method"] == "compllm"
    assert result["rows"][-1]["speedup_offline"] > 0 and "C^2" in capsys.readouterr().out


def test_fit_exponent():
    assert bench_speed.fit_exponent([512, 1024, 2048], [3.0 * n ** 2 for n in (512, 1024, 2048)]) == pytest.approx(2.0)
    assert bench_speed.fit_exponent([512, 1024, 2048], [0.5 * n for n in (512, 1024, 2048)]) == pytest.approx(1.0)


# ---- interpolate ----


def test_interpolate_end_points_regenerate_z0_and_z1(device):
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    r = E.run_interpolate(comp, E.DEFAULT_TEXT0, E.DEFAULT_TEXT1, [0, 0.5, 1], max_new_tokens=16)
    assert r["z0"]["ids"] != r["z1"]["ids"]                      # so the end-point checks have teeth
    assert r["rows"][0]["ids"] == r["z0"]["ids"] and r["rows"][-1]["ids"] == r["z1"]["ids"]
    assert [row["w"] for row in r["rows"]] == [0, 0.5, 1]


def test_interpolate_cli(ckpt, capsys, device):
    result, out = run(["--ckpt", ckpt["aoc"], "--task", "interpolate", "--max-new-tokens", 8], device, capsys)
    assert [row["w"] for row in result["rows"]] == [0, 0.25, 0.5, 0.53, 0.55, 0.6, 0.75, 1]   # AOC Table 4
    assert result["text0"] == E.DEFAULT_TEXT0 and "w=0.53" in out
    assert os.path.isfile(os.path.join(ckpt["aoc"], "eval_interpolate.json"))


# ---- heatmap ----


def read_png(path):
    """The image matplotlib wrote: a PNG (signature) that decodes to pixels."""
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return pytest.importorskip("matplotlib.pyplot").imread(path)


@pytest.mark.parametrize("method", ["icae", "aoc"])
def test_heatmap_png_and_cosine(method, ckpt, tmp_path, capsys, device):
    text = "The cat sat on the mat. " * 4
    result, out = run(["--ckpt", ckpt[method], "--task", "heatmap", "--text0", text, "--out", tmp_path / "hm.json"],
                      device, capsys)
    cos = np.array(result["cosine"])
    M, T = cos.shape
    assert (M, T) == (8, 96) and result["memory_slots"] == 8               # 2 chunks of <= 64 tokens x 4 memory
    for name in ("cosine", "attention"):
        assert read_png(result[f"{name}_png"]).shape[:2] == (450, 700)    # 7 x 4.5 inches at 100 dpi
    assert "|" in out and result["cosine_png"] in out

    # one cell, computed independently of evaluate.py
    comp = checkpoint.load(ckpt[method], device=device)
    ids = comp.tok.encode(text)
    with torch.no_grad():
        memory = comp.compress([ids])
        if method == "icae":   # embeds carrier: memory vector vs the token's input embedding
            a, b = memory.embeds[0, 5], comp.decoder.model.embed_tokens.weight[ids[70]]
        else:                  # kv carrier: memory's last-layer keys vs the plain decoder's last-layer keys
            k = comp.decoder(torch.tensor([ids], device=device), return_kv=True).kv[-1][0]   # (1, Hkv, T, D)
            a, b = memory.kv[-1][0][0, :, 5].flatten(), k[0, :, 70].flatten()
    assert cos[5, 70] == pytest.approx((a @ b / (a.norm() * b.norm())).item(), abs=1e-5)

    att = np.array(result["attention"])
    # memory of chunk 1 attends only to chunk 1, of chunk 2 only to the rest (ICAE's chunk 1 starts with [BOS],
    # which is no column of the text: it holds text tokens 0..62)
    b = 64 - comp.cfg.bos
    assert (att[:4, b:] == 0).all() and (att[4:, :b] == 0).all()
    assert (att[:4, :b] > 0).all() and (att.sum(1) <= 1 + 1e-5).all()


def test_heatmap_attention_shows_the_pic_mask(device):
    """PIC Eq. (5) rule 3: memory token m_t sees chunk c_t only, so its attention is zero elsewhere."""
    comp = random_comp("pic", device, mem=4, chunk_len=64)   # a 64-token segment with 4 memory tokens: 16x
    ids = comp.tok.encode(("abcdefgh" * 8))
    _, att = E.encoder_attention(comp, ids)
    assert att.shape == (4, 64)
    for t in range(4):
        inside = torch.zeros(64, dtype=torch.bool)
        inside[16 * t:16 * (t + 1)] = True
        assert (att[t, ~inside] == 0).all() and (att[t, inside] > 0).all()
        # the rest of m_t's weight sits on m_1..m_t (rule 2), so 0 < Σ over its chunk <= 1; m_1 has only itself
    assert (att.sum(1) <= 1 + 1e-5).all()


def test_heatmap_group_merging_has_cosine_but_no_attention(ckpt, tmp_path, device):
    result, _ = run(["--ckpt", ckpt["gmsa"], "--task", "heatmap", "--text0", "x" * 40, "--out", tmp_path / "g.json"],
                    device)
    assert np.array(result["cosine"]).shape == (11, 40)     # [BOS] and 40 tokens in groups of r = 4 (GMSA's bos)
    assert result["attention"] is None and "no memory tokens" in result["attention_note"]
    assert not (tmp_path / "g_attention.png").exists() and (tmp_path / "g_cosine.png").exists()


# ---- bad input ----


@pytest.fixture
def one_line_error(device):
    """one_line_error(argv[, main]): evaluate.py's main (or bench_speed's) on the test device must exit with one line
    `error: ...`."""
    def check(argv, main=E.main):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in [*argv, "--device", device]])
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg, msg
        return msg
    return check


def test_bad_input_is_a_one_line_error(ckpt, tmp_path, one_line_error):
    assert "does not exist" in one_line_error(["--ckpt", tmp_path / "nope", "--task", "ae"])
    assert "compressor.json is missing" in one_line_error(["--ckpt", tmp_path, "--task", "ae"])
    assert "unknown task 'sing'" in one_line_error(["--ckpt", ckpt["aoc"], "--task", "sing"])
    assert "needs --ckpt" in one_line_error(["--task", "ae", "--method", "aoc"])
    assert "needs --ckpt" in one_line_error(["--task", "needle", "--method", "aoc", "--model", "tiny"])
    assert "not 'HuggingFaceTB/SmolLM2-135M'" in one_line_error(
        ["--ckpt", ckpt["aoc"], "--task", "ae", "--model", "HuggingFaceTB/SmolLM2-135M"])
    assert "holds method 'aoc', not 'icae'" in one_line_error(
        ["--ckpt", ckpt["aoc"], "--task", "ae", "--method", "icae"])
    assert "no such file" in one_line_error(["--ckpt", ckpt["aoc"], "--task", "ae", "--data", tmp_path / "x.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "c", "question": "q", "answer": "a"}\n{"question": "no context"}\n')
    assert "bad.jsonl line 2: --task qa reads" in one_line_error(
        ["--ckpt", ckpt["icae"], "--task", "qa", "--data", bad])
    # CompLLM sizes memory by length: the two default prompts (31 and 34 bytes) give 16 and 17 slots
    assert "same size" in one_line_error(["--ckpt", ckpt["compllm"], "--task", "interpolate"])


QA = '{"context": "The river is long.", "question": "What is long?", "answer": "the river"}'
MALFORMED_QA = {   # file -> (its lines, the line the error names; None: it is scored)
    "missing_question": ([QA, '{"context": "c", "answer": "a"}'], 2),
    "empty_context": ([QA, QA, '{"context": "", "question": "q", "answer": "a"}'], 3),
    "blank_context": (['{"context": " \\n ", "question": "q", "answer": "a"}'], 1),
    "numeric_context": (['{"context": 12, "question": "q", "answer": "a"}'], 1),
    "null_answer": ([QA, '{"context": "c", "question": "q", "answer": null}'], 2),
    "empty_answers": (['{"context": "c", "question": "q", "answers": []}'], 1),
    "dict_in_answer_list": (['{"context": "c", "question": "q", "answer": [{"start": 0}]}'], 1),
    "not_json": ([QA, "{not json"], 2),          # train.py's reader cases from here on
    "json_list": (["[1, 2]"], 1),
    "a_number": ([QA, QA, "5"], 3),
    "text_record": (['{"text": null}'], 1),
    "text_for_qa": (['{"text": "a text, no question"}'], 1),
    "scored": (["", '{"context": "Year.", "question": "When?", "answer": 1932}', "   ",   # blank lines: skipped
                '{"context": "Two.", "question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}, '
                '{"text": "Bo", "answer_start": 4}]}',
                '{"context": "SQuAD.", "question": "Which?", "answers": {"text": ["x"], "answer_start": [0]}}',
                '{"context": "Float \\xff.", "question": "How much?", "answer": [2.5, "two and a half"]}'], None),
}


def test_malformed_qa_files_are_one_line_naming_file_and_line_or_scored(ckpt, tmp_path, one_line_error, device):
    """evaluate.py --task qa reads QA records with train.py's reader and its checks (data.qa_record): each malformed
    file gives one line naming the file and the line, or is scored as documented (a number answer as its text, a
    list of {"text"} dicts as the list of their texts); never a traceback. An empty file holds no examples."""
    for name, (lines, bad_line) in sorted(MALFORMED_QA.items(), key=lambda kv: kv[1][1] is not None):   # scored 1st
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes("\n".join(lines).encode().replace("\\xff".encode(), b"\xff") + b"\n")
        argv = ["--ckpt", ckpt["aoc"], "--task", "qa", "--data", path, "--max-new-tokens", "1",
                "--out", tmp_path / f"{name}.json"]
        if bad_line is not None:
            assert f"{path} line {bad_line}" in one_line_error(argv), name
            continue
        result, _ = run(argv, device)
        assert [ex["answer"] for ex in result["examples"]] == ["1932", ["Ann", "Bo"], ["x"], ["2.5", "two and a half"]]
        assert all(math.isfinite(ex["compressed"]["scores"]["token_f1"]) for ex in result["examples"])
    (tmp_path / "empty.jsonl").write_text("")
    qa_error = lambda path: one_line_error(["--ckpt", ckpt["aoc"], "--task", "qa", "--data", path])
    assert "holds no examples" in qa_error(tmp_path / "empty.jsonl")
    (tmp_path / "lines.txt").write_text("a plain line of text\n")
    assert "not lines of text" in qa_error(tmp_path / "lines.txt")


def test_speed_bad_input_is_a_one_line_error(ckpt, one_line_error):
    error = lambda argv: one_line_error(argv, bench_speed.main)
    assert "unknown method 'foo'" in error(["--method", "foo", "--lengths", "64"])
    assert "comma-separated" in error(["--method", "aoc", "--lengths", "1k"])
    assert "must be positive" in error(["--method", "aoc", "--lengths", "0"])
    assert "give --ckpt DIR, or --method M" in error(["--lengths", "64"])
    assert "--shape replaces --model" in error(["--method", "aoc", "--shape", "qwen3-4b", "--model", "tiny"])
    assert "holds method 'compllm', not 'aoc'" in error(["--ckpt", ckpt["compllm"], "--method", "aoc"])


def test_checkpoint_of_another_base_model(ckpt, tmp_path, one_line_error):
    """A checkpoint trained on a narrower model but labelled "tiny": the tensor shapes give it away."""
    cfg = ModelConfig.from_hf({**TINY_CONFIG, "hidden_size": 32, "head_dim": 8})
    checkpoint.save(C.build("icae", Transformer(cfg), build_tiny()[1], mem=4, chunk_len=64, lora_r=4), str(tmp_path))
    msg = one_line_error(["--ckpt", tmp_path, "--task", "ae"])
    assert "on its base model 'tiny'" in msg and "wrong shape" in msg
    Path(tmp_path, "compressor.json").write_text("{not json")
    assert "corrupt" in one_line_error(["--ckpt", tmp_path, "--task", "ae"])


def test_command_line_error_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "evaluate.py", "--ckpt", str(tmp_path / "nope"), "--task", "ae"], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"error: checkpoint directory '{tmp_path / 'nope'}' does not exist"]


def test_help_explains_every_task(capsys):
    with pytest.raises(SystemExit) as e:
        E.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for task in E.TASKS:
        assert f"\n  {task} " in out
    # which tasks report own/other (qa too, since it scores the reference answer after another document's memory)
    assert "\nae, lm and qa also report, teacher-forced" in out


@pytest.mark.parametrize("method", P.METHODS)
def test_every_method_runs_every_task(method, tmp_path, device):
    """Each preset through each task on one short example (tiny budgets); GMSA has no attention map."""
    kw = {"icae": dict(mem=8), "500x": dict(mem=8), "aoc": dict(mem=8), "compllm": {}}.get(method, {})
    comp = random_comp(method, device, **kw, **({} if method == "compllm" else dict(chunk_len=64)))
    text = D.EVAL_TEXTS[0]
    ae = E.run_ae(comp, [{"text": text}], max_new_tokens=4)
    assert ae["examples"][0]["memory_slots"] < len(comp.tok.encode(text))
    assert math.isfinite(E.run_lm(comp, [{"text": text}])["scores"]["compressed"]["perplexity"])
    assert set(E.run_qa(comp, D.EVAL_QA[:1], max_new_tokens=4)["scores"]) == {"compressed", "full", "none"}
    heat = E.run_heatmap(comp, text, str(tmp_path / "h"))
    assert (heat["attention"] is None) == (method == "gmsa")
    speed = bench_speed.run_speed(comp, [128, 256], max_new_tokens=1, repeats=1)
    assert all(r["kv_bytes_compressed"] < r["kv_bytes_full"] for r in speed["rows"])
    interp = E.run_interpolate(comp, "a" * 64, "b" * 64, [0, 1], max_new_tokens=4)   # equal lengths: equal sizes
    assert len(interp["rows"]) == 2


# ---- does a memory carry its own text? ----


def test_own_other_is_exactly_one_for_a_memory_that_ignores_its_text(monkeypatch, device):
    """Negative control: a compressor whose memory is the same whatever it reads (a constant prompt) scores the
    same loss with any text's memory, so own / other is exactly 1, in ae and in lm."""
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    fixed = comp.tok.encode("Always this text.")
    compress = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: compress([fixed] * len(ctx), **kw))
    for run_task in (E.run_ae, E.run_lm, E.run_qa):
        kw = dict(max_new_tokens=2) if run_task is not E.run_lm else {}
        examples = D.EVAL_QA[:4] if run_task is E.run_qa else [{"text": t} for t in D.EVAL_TEXTS[:4]]
        L = run_task(comp, examples, batch_size=3, **kw)["loss"]
        assert L["own"] == pytest.approx(L["other"], abs=1e-6) and L["own_other_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_own_other_uses_the_memory_of_the_next_text(monkeypatch, device):
    """The derangement: text i is scored after the memory of text i + 1 (mod n); a memory that is its own text
    (the full context, as a K/V cache) then scores far below another text's."""
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    seen = []
    compress = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: seen.append([list(c) for c in ctx]) or compress(ctx, **kw))
    texts = D.EVAL_TEXTS[:3]
    E.run_ae(comp, [{"text": t} for t in texts], max_new_tokens=1, batch_size=8)
    ids = [comp.tok.encode(t) for t in texts]
    assert seen[0] == ids and seen[1] == ids[1:] + ids[:1]


def test_qa_own_other_scores_the_reference_answer_after_the_next_documents_memory(monkeypatch, device):
    """qa's own/other: the first reference answer's tokens are scored after the question's own memory and after
    the next document's (with concat = 2 the two questions of one long context share a document, so the other
    memory is the next pair's); the full context lets the plain LLM score it, no context too."""
    comp = random_comp("compllm", device)
    seen = []
    compress = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: seen.append([list(c) for c in ctx]) or compress(ctx, **kw))
    qa = D.EVAL_QA[:4]
    result = E.run_qa(comp, qa, max_new_tokens=1, batch_size=4, concat=2)
    pair = lambda a, b: comp.qa_parts(qa[a]["context"] + "\n\n" + qa[b]["context"], "")["enc_context"]
    assert seen[0] == [pair(0, 1)] * 2 + [pair(2, 3)] * 2 and seen[1] == [pair(2, 3)] * 2 + [pair(0, 1)] * 2
    L = result["loss"]
    assert L["tokens"] == sum(len(comp.tok.encode(ex["answer"] if isinstance(ex["answer"], str) else ex["answer"][0]))
                              for ex in qa)
    assert all(math.isfinite(L[k]) for k in ("own", "other", "none", "full"))
    assert E.run_qa(comp, qa[:1], max_new_tokens=1)["loss"]["other"] is None       # one document: no other


def test_qa_other_memory_is_never_the_questions_own_long_context(monkeypatch, device):
    """--concat 3 on 5 examples: groups of 3 and 2 questions share one long context each; every question's "other"
    memory is another group's context (i + 3 mod 5 sends question 2 back to its own group: own = other)."""
    comp = random_comp("compllm", device)
    seen = []
    compress = comp.compress
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: seen.append([list(c) for c in ctx]) or compress(ctx, **kw))
    qa = D.EVAL_QA[:5]
    assert len(qa) == 5
    E.run_qa(comp, qa, max_new_tokens=1, batch_size=8, concat=3, generate=False)
    own, other = seen[0], seen[1]
    assert len(own) == len(other) == 5 and len({tuple(c) for c in own}) == 2   # two long contexts
    assert all(o != m for o, m in zip(own, other))


def test_batched_evaluation_equals_one_at_a_time(device):
    """Texts of different lengths in one batch (the compressor's rows right-padded for the loss, left-padded for
    generation; the plain LLM's likewise): the same generations and losses as one example at a time."""
    comp = random_comp("500x", device, mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    with torch.no_grad():
        for p in comp.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)                    # a trained-looking LoRA and [AE], so the memory matters
    examples = [{"text": t[:n]} for t, n in zip(D.EVAL_TEXTS, (90, 40, 140, 25, 70))]
    one = E.run_ae(comp, examples, max_new_tokens=20, batch_size=1)
    many = E.run_ae(comp, examples, max_new_tokens=20, batch_size=5)
    for a, b in zip(one["examples"], many["examples"]):
        for mode in E.MODES:
            assert a[mode]["ids"] == b[mode]["ids"]
        for key in ("own", "other", "none"):
            assert a["loss"][key][0] == pytest.approx(b["loss"][key][0], rel=1e-5) and \
                a["loss"][key][1] == b["loss"][key][1]
    assert len({tuple(a["compressed"]["ids"]) for a in one["examples"]}) > 1     # generations differ: not vacuous
    one, many = E.run_qa(comp, D.EVAL_QA[:5], max_new_tokens=4, batch_size=1), \
        E.run_qa(comp, D.EVAL_QA[:5], max_new_tokens=4, batch_size=5)
    for a, b in zip(one["examples"], many["examples"]):
        assert all(a[mode]["text"] == b[mode]["text"] for mode in E.MODES)
        for key in ("own", "other", "none", "full"):
            assert a["loss"][key][0] == pytest.approx(b["loss"][key][0], rel=1e-5) and \
                a["loss"][key][1] == b["loss"][key][1]
    one, many = E.run_lm(comp, examples, batch_size=1), E.run_lm(comp, examples, batch_size=5)
    for mode in E.MODES:
        assert one["scores"][mode]["nll"] == pytest.approx(many["scores"][mode]["nll"], rel=1e-5)


# ---- each paper's evaluation protocol ----


def test_head_cropped_checkpoint_is_evaluated_on_its_first_n_tokens(monkeypatch, device):
    """AOC code: the reference is the first n tokens, the input is them padded with EOS to n (as in training),
    generation runs up to n new tokens; interpolation pads a short prompt the same way."""
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    proto = dict(crop="head", n=16, half=False)
    seen, budgets = [], []
    compress, generate = comp.compress, comp.generate
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: seen.append(ctx) or compress(ctx, **kw))
    monkeypatch.setattr(comp, "generate",
                        lambda m, t, **kw: budgets.append(kw["max_new_tokens"]) or generate(m, t, **kw))
    short = "Short one."
    result = E.run_ae(comp, [{"text": D.EVAL_TEXTS[0]}, {"text": short}], proto=proto)
    tok = comp.tok
    assert result["examples"][0]["reference_ids"] == tok.encode(D.EVAL_TEXTS[0])[:16]
    assert result["examples"][1]["reference_ids"] == tok.encode(short)
    assert seen[0][1] == tok.encode(short) + [tok.pad_id] * (16 - len(short)) and budgets == [16]
    r = E.run_interpolate(comp, E.DEFAULT_TEXT0, E.DEFAULT_TEXT1, [0.5], proto=proto)
    assert all(len(c[0]) == 16 for c in seen[-2:]) and r["memory_slots"] == 4


def test_epl_pretrained_checkpoint_reconstructs_the_first_half_scored_on_ids_with_bos_and_eos(monkeypatch, device):
    """EPL code: AE rebuilds what pretraining compressed, [BOS] + x[:⌊|X|/2⌋]; BLEU-4 on ids of the generation with
    its EOS against [BOS] x [EOS]."""
    comp = random_comp("icae", device, mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    text = D.EVAL_TEXTS[0]
    half = comp.tok.encode(text)[:len(comp.tok.encode(text)) // 2]
    target = comp.ae_target(half)
    assert target == [comp.tok.bos_id] + half + [comp.tok.eos_id]
    monkeypatch.setattr(comp, "generate", lambda m, t, **kw: [target[:-1]])   # a perfect reconstruction, then EOS
    result = E.run_ae(comp, [{"text": text}], proto=dict(crop="window", n=None, half=True))
    ex = result["examples"][0]
    assert ex["reference_ids"] == half and ex["compressed"]["scores"]["bleu4_ids"] == pytest.approx(1.0)


@pytest.mark.parametrize("text", [D.EVAL_TEXTS[0], "Short."])
@pytest.mark.parametrize("objective", ["ae", "pretrain"])
def test_head_cropped_evaluation_compresses_what_training_compressed(objective, text, monkeypatch, device):
    """A head crop under pretraining (data.draw_text): the first n tokens padded with EOS to n, of which the
    first ⌊n/2⌋ are compressed. The ae task compresses the same ids, scores against their unpadded tokens and
    regenerates up to as many tokens as it compressed (not all n after pretraining)."""
    comp = random_comp("icae", device, mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    ids = comp.tok.encode(text)
    data = dict(tokens=torch.tensor(ids), offsets=torch.tensor([0, len(ids)]))
    s = D.Sampling(objective, "head", 16, 16, batch_size=1, seed=0)
    trained = D.draw_text(data, s, np.random.default_rng(0), comp, step=0)["context"]
    proto = E.protocol("head", max_len=16, objective=objective)
    seen, budgets = [], []
    compress, generate = comp.compress, comp.generate
    monkeypatch.setattr(comp, "compress", lambda ctx, **kw: seen.append(ctx) or compress(ctx, **kw))
    monkeypatch.setattr(comp, "generate",
                        lambda m, t, **kw: budgets.append(kw["max_new_tokens"]) or generate(m, t, **kw))
    result = E.run_ae(comp, [{"text": text}], proto=proto)
    n = 8 if objective == "pretrain" else 16
    assert seen[0] == [trained] and budgets == [n]
    assert result["examples"][0]["reference_ids"] == ids[:n]


def test_gmsa_ratio_and_baselines_from_the_original_llm_after_keft(tmp_path, device):
    """--ratio R evaluates group merging at R (GMSA's 8x rows); after KEFT the "full"/"none" rows come from the
    base LLM, not from the decoder whose q/k/v KEFT trained."""
    torch.manual_seed(0)
    comp = C.build("gmsa", *build_tiny(), lora_r=4, lora_alpha=8)
    comp.set_stage("keft")
    with torch.no_grad():
        for p in comp.trainable_parameters():
            p.add_(torch.randn_like(p))                   # what KEFT training would do to q/k/v
    checkpoint.save(comp, str(tmp_path))
    result, _ = run(["--ckpt", tmp_path, "--task", "lm", "--ratio", 8, "--n", 2], device)
    text = D.unseen_texts()[0]
    first_half = len(comp.tok.encode(text)) // 2
    assert result["examples"][0]["memory_slots"] == math.ceil(first_half / 8) and result["ratio"] == 8
    base, tok = build_tiny()
    plain = E.PlainLLM(checkpoint.load(str(tmp_path), device=device))
    assert plain.model is not checkpoint.load(str(tmp_path), device=device).decoder
    ids = tok.encode(text)
    want = E.PlainLLM(C.build("gmsa", base.to(device), tok, lora_r=4, lora_alpha=8)).nll([[tok.bos_id]], [ids])
    assert result["examples"][0]["none"]["nll"] != pytest.approx(want[0][0])   # a different text: sanity
    assert plain.nll([[tok.bos_id]], [ids])[0][0] == pytest.approx(want[0][0], rel=1e-6)


# ---- the compression a score was measured at ----


def test_a_bare_evaluation_scores_what_the_runs_own_check_scored(tmp_path, device):
    """`evaluate.py --ckpt RUN --task ae` with no other flag gives the own/other the run logged at its last check: the
    same texts (those of at least the run's --min-len tokens), cut to its --max-len (window crop too: compressing
    whole texts in several chunks is a protocol the run never trained on). Every scored text is then at exactly the
    trained 4 tokens per slot (16 tokens, 4 slots), and the score says so."""
    out = tmp_path / "run"
    data = tmp_path / "held.jsonl"   # two texts shorter than the trained length among longer ones
    texts = ["ab", "short text", *D.unseen_texts(6)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train.main(["--method", "500x", "--objective", "ae", "--model", "tiny", "--mem", "4", "--chunk-len", "16",
                "--crop", "window", "--min-len", "16", "--max-len", "16", "--batch-size", "2", "--steps", "2",
                "--eval-every", "2", "--eval-data", str(data), "--eval-n", "5", "--out", str(out),
                "--device", str(device)])
    logged = runlog.read_log(str(out))[1][-1]["eval"]
    assert logged["n"] == 5 and logged["tokens_per_slot"] == {"mean": 4.0, "min": 4.0, "max": 4.0}
    result, _ = run(["--ckpt", out, "--task", "ae", "--data", data, "--n", "5", "--max-new-tokens", "1"], device)
    assert len(result["examples"]) == 5 and "short text" not in [ex["text"] for ex in result["examples"]]
    assert result["tokens_per_slot"] == {"mean": 4.0, "min": 4.0, "max": 4.0}
    assert result["loss"]["own_other_ratio"] == pytest.approx(logged["own_other"], rel=1e-5)


def test_tokens_per_slot_is_measured_on_the_scored_texts(monkeypatch, device):
    """tokens per slot is each scored text's length over its memory's slots (mean, min, max), not the flags: texts
    shorter than the trained length, scored with --min-len 1, lower it."""
    comp = random_comp("aoc", device, mem=4, chunk_len=64)
    texts = [{"text": "x" * 16}, {"text": "y" * 8}]
    proto = dict(crop="window", n=16, min=None, half=False)
    r = E.run_ae(comp, texts, proto=proto, generate=False)["tokens_per_slot"]
    slots = comp.cfg.mem
    assert r == pytest.approx({"mean": (16 + 8) / 2 / slots, "min": 8 / slots, "max": 16 / slots})
    assert E.at_trained_length(comp, texts, {**proto, "min": 12}) == texts[:1]
    with pytest.raises(ValueError, match="no text of at least 20 tokens"):
        E.at_trained_length(comp, texts, {**proto, "min": 20})
