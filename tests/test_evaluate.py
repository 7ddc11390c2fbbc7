"""evaluate.py's tasks and command line on tiny checkpoints: every task runs and writes JSON, and what it
reports is checked against the definitions — scores against the metric functions applied to the saved
generations, perplexity against its NLL sums, KV bytes against layers · 2 · Hkv · D · bytes per slot, the
interpolation end points against Z0 / Z1 themselves, the heatmap against an independent cosine and the
PNG against its own spec (signature, chunk CRCs, zlib pixels). Bad input ends in one line `error: ...`.

The tiny model is random, so its quality numbers mean nothing; where a test needs generations that
vary (interpolation) the decoder is randomised with a larger std, as conftest.randomize_ does.
"""

import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import compressors as C
import evaluate as E
from conftest import randomize_
from model import TINY_CONFIG, ModelConfig, Transformer, build_tiny

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = Path.home() / ".cache" / "ctxcomp" / "smollm2-135m"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models on a shared CPU: one intra-op thread is ~30x faster than two fighting over two busy cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """method -> checkpoint directory of an untrained tiny compressor (what train.py --out writes)."""
    root = tmp_path_factory.mktemp("ckpt")
    settings = {"aoc": dict(mem=4, chunk_len=64), "icae": dict(mem=4, chunk_len=64, lora_r=4, lora_alpha=8),
                "compllm": dict(lora_r=4, lora_alpha=8), "gmsa": dict(lora_r=4, lora_alpha=8)}
    out = {}
    for method, kw in settings.items():
        torch.manual_seed(0)
        C.build(method, *build_tiny(), **kw).save(str(root / method))
        out[method] = str(root / method)
    return out


def run(argv, capsys=None):
    result = E.main([str(a) for a in argv])
    return result, (capsys.readouterr().out if capsys else "")


def random_comp(method, **kw):
    """A compressor around a tiny decoder with larger random weights, so greedy outputs vary with the memory
    (the std-0.02 tiny model repeats its input token whatever the memory holds)."""
    decoder, tok = build_tiny()
    randomize_(decoder, seed=0, std=0.3)
    torch.manual_seed(0)
    return C.build(method, decoder, tok, **kw).eval()


# ---- ae ----


def test_ae_scores_are_the_metrics_of_the_saved_generations(ckpt, capsys):
    result, out = run(["--ckpt", ckpt["aoc"], "--task", "ae", "--n", 2, "--max-new-tokens", 24], capsys)
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
            hw, rw = E.word_tokens(ex[mode]["text"]), E.word_tokens(comp_tok.decode(ref))
            # AOC's texts: newlines to spaces, stripped
            ht, rt = (t.replace("\n", " ").strip() for t in (ex[mode]["text"], comp_tok.decode(ref)))
            pltrdy = E.rouge_pltrdy(ht, rt)
            expect = {"bleu4_ids": E.bleu4(hyp, ref), "bleu4_words": E.bleu4(hw, rw, smooth=True),
                      "prefix_em": E.prefix_em(hyp, ref), "token_accuracy": E.token_accuracy(hyp, ref),
                      "rouge1": E.rouge_n_f1(hw, rw, 1), "rouge2": E.rouge_n_f1(hw, rw, 2),
                      "rougeL": E.rouge_l_f1(hw, rw), "aoc_em": E.aoc_exact_match(ht, rt),
                      "aoc_rouge1": pltrdy["rouge-1"]["f"], "aoc_rouge2": pltrdy["rouge-2"]["f"],
                      "aoc_rougeL": pltrdy["rouge-l"]["f"]}
            assert ex[mode]["scores"] == expect
            per_example.append(expect)
        for k in per_example[0]:
            assert saved["scores"][mode][k] == pytest.approx(sum(e[k] for e in per_example) / len(per_example))


def test_ae_scores_the_compressed_generation_against_its_own_context(monkeypatch):
    """A compressor that regenerates the first 10 tokens right and then goes wrong: prefix EM is exactly
    10 / |ref| (and so is AOC's character prefix EM: one byte per token), token accuracy and BLEU are
    above zero, and the references are untouched by the patch."""
    comp = random_comp("aoc", mem=4, chunk_len=64)
    text = E.BUILTIN_TEXTS[1]
    ref = comp.tok.encode(text)
    wrong = (ref[10] + 1) % 256
    monkeypatch.setattr(comp, "generate", lambda memory, task, **kw: ref[:10] + [wrong] + ref[11:40])
    result = E.run_ae(comp, [{"text": text}], max_new_tokens=12)
    s = result["scores"]["compressed"]
    assert s["prefix_em"] == 10 / len(ref) == s["aoc_em"] and len(text) == len(ref)
    assert s["token_accuracy"] == 39 / len(ref)
    assert 0 < s["bleu4_ids"] < 1 and 0 < s["rougeL"] < 1 and 0 < s["aoc_rougeL"] < 1
    assert len(result["examples"][0]["full"]["ids"]) <= 12   # the plain-LLM rows still generate


# ---- lm ----


def test_lm_perplexity_is_exp_of_the_summed_nll(ckpt, capsys):
    result, out = run(["--ckpt", ckpt["icae"], "--task", "lm", "--n", 3], capsys)
    assert "perplexity" in out and os.path.isfile(os.path.join(ckpt["icae"], "eval_lm.json"))
    tok = build_tiny()[1]
    for mode in ("compressed", "full", "none"):
        rows = [ex[mode] for ex in result["examples"]]
        nll, n = sum(r["nll"] for r in rows), sum(r["tokens"] for r in rows)
        assert result["scores"][mode]["perplexity"] == pytest.approx(math.exp(nll / n))
        # EPL: the second half, from p = ⌊|X|/2⌋, is scored in full in every row (ICAE puts [LM] before it)
        lens = [len(tok.encode(t)) for t in E.BUILTIN_TEXTS[:3]]
        assert [r["tokens"] for r in rows] == [n - n // 2 for n in lens]
    # the byte-level model's vocabulary is 259: a random model sits near uniform, nowhere near 0 or 10^4
    assert 50 < result["scores"]["none"]["perplexity"] < 2000


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="SmolLM2-135M not cached in ~/.cache/ctxcomp")
def test_full_context_beats_no_context_on_smollm2(tmp_path):
    """The upper reference must use the context: a real LLM predicts a text's second half better after its
    first half than after BOS alone (the compressed row of an untrained compressor is not checked)."""
    from model import load_pretrained
    decoder, tok = load_pretrained(str(SMOLLM2))
    C.build("icae", decoder, tok, model=str(SMOLLM2), mem=4, chunk_len=64, lora_r=2, lora_alpha=4).save(str(tmp_path))
    result = E.main(["--ckpt", str(tmp_path), "--task", "lm", "--n", "3"])
    assert result["scores"]["full"]["perplexity"] < 0.8 * result["scores"]["none"]["perplexity"]


# ---- qa ----


def test_qa_runs_on_the_builtin_set_and_scores_the_first_line(ckpt, capsys):
    result, out = run(["--ckpt", ckpt["icae"], "--task", "qa", "--max-new-tokens", 8], capsys)
    assert len(result["examples"]) == len(E.BUILTIN_QA) and "squad_f1" in out
    for ex in result["examples"]:
        for mode in ("compressed", "full", "none"):
            pred = ex[mode]["prediction"]
            assert pred == (ex[mode]["text"].strip().splitlines() or [""])[0]
            assert ex[mode]["scores"] == E.qa_scores(pred, ex["answer"])


def test_qa_right_answer_scores_one(monkeypatch):
    comp = random_comp("icae", mem=4, chunk_len=64, lora_r=4, lora_alpha=8)
    ex = E.BUILTIN_QA[4]   # answer "away from the Sun"
    answer = comp.tok.encode(" Away from the Sun\nQuestion:")   # right answer, then the LLM rambles on
    monkeypatch.setattr(comp, "generate", lambda memory, task, prompt=None, **kw: answer)
    s = E.run_qa(comp, [ex], max_new_tokens=4)["scores"]["compressed"]
    assert s["squad_em"] == s["squad_f1"] == s["substring_acc"] == 1.0    # normalised: case ignored
    assert s["exact_match"] == 0.0 and 0 < s["token_f1"] < 1               # unnormalised: "Away" != "away"
    assert s["epl_em"] == 0.0 and s["epl_f1"] == pytest.approx(0.75)      # EPL: 3 of 4 words, case-sensitive


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
    assert E.qa_scores("in Paris", ["Paris", "in Paris"])["exact_match"] == 1.0    # max over references
    assert E.qa_scores("in Paris", ["Paris", "in Paris"])["epl_em"] == 0.0         # EPL: answers[0] only


# ---- speed ----


@pytest.mark.parametrize("method", ["aoc", "compllm"])
def test_speed_reports_times_and_the_analytic_kv_bytes(method, tmp_path, capsys):
    out_file = tmp_path / "speed.json"
    lengths = [64, 128, 256, 512]
    result, out = run(["--method", method, "--model", "tiny", "--task", "speed", "--out", out_file,
                       "--lengths", ",".join(map(str, lengths)), "--max-new-tokens", 2], capsys)
    assert json.loads(out_file.read_text())["rows"] == result["rows"]
    assert "TTFT full ms" in out and "C^2" in out
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4   # fp32 K and V
    assert [r["context_tokens"] for r in result["rows"]] == lengths
    for r in result["rows"]:
        T, M = r["context_tokens"], r["memory_slots"]
        # aoc: 4 x 16 memory tokens per chunk of 512 -> min(16, T); compllm: ceil(n/2) per segment -> about T/2
        assert M == (min(16, T) if method == "aoc" else M) and (method == "aoc" or T / 2 <= M < T / 2 + T / 8)
        assert r["kv_bytes_full"] == T * per_slot and r["kv_bytes_compressed"] == M * per_slot
        assert r["kv_bytes_compressed"] < r["kv_bytes_full"] and r["kv_ratio"] == M / T
        assert r["speedup_offline"] == pytest.approx(r["ttft_full_s"] / r["ttft_compressed_s"])
        assert r["speedup_online"] == pytest.approx(r["ttft_full_s"] / (r["compress_s"] + r["ttft_compressed_s"]))
        assert min(r["compress_s"], r["ttft_full_s"], r["decode_full_s_per_token"]) > 0
    assert all(math.isfinite(k) for k in result["exponents"].values())
    assert result["ttft_bound_c2"] == pytest.approx((lengths[-1] / result["rows"][-1]["memory_slots"]) ** 2)


def test_fit_exponent():
    assert E.fit_exponent([512, 1024, 2048], [3.0 * n ** 2 for n in (512, 1024, 2048)]) == pytest.approx(2.0)
    assert E.fit_exponent([512, 1024, 2048], [0.5 * n for n in (512, 1024, 2048)]) == pytest.approx(1.0)


# ---- interpolate ----


def test_interpolate_end_points_regenerate_z0_and_z1():
    comp = random_comp("aoc", mem=4, chunk_len=64)
    r = E.run_interpolate(comp, E.DEFAULT_TEXT0, E.DEFAULT_TEXT1, [0, 0.5, 1], max_new_tokens=16)
    assert r["z0"]["ids"] != r["z1"]["ids"]                      # so the end-point checks have teeth
    assert r["rows"][0]["ids"] == r["z0"]["ids"] and r["rows"][-1]["ids"] == r["z1"]["ids"]
    assert [row["w"] for row in r["rows"]] == [0, 0.5, 1]


def test_interpolate_cli(ckpt, capsys):
    result, out = run(["--ckpt", ckpt["aoc"], "--task", "interpolate", "--max-new-tokens", 8], capsys)
    assert [row["w"] for row in result["rows"]] == [0, 0.25, 0.5, 0.75, 1]
    assert result["text0"] == E.DEFAULT_TEXT0 and "w=0.25" in out
    assert os.path.isfile(os.path.join(ckpt["aoc"], "eval_interpolate.json"))


# ---- heatmap ----


def read_png(path):
    """Parse an 8-bit RGB, non-interlaced PNG by its spec; every chunk's CRC is checked."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, i = [], 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + length]
        (crc,) = struct.unpack(">I", data[i + 8 + length:i + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks.append((kind, body))
        i += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()           # filter type 0: the bytes are the pixels
    return rows[:, 1:].reshape(height, width, 3)


def hot(values):
    """The colour scale, written independently: min-max to [0, 1], then r = 3x, g = 3x - 1, b = 3x - 2."""
    v = np.asarray(values)
    x = (v - v.min()) / (v.max() - v.min())
    return np.round(np.clip(np.stack([3 * x, 3 * x - 1, 3 * x - 2], -1), 0, 1) * 255).astype(np.uint8)


@pytest.mark.parametrize("method", ["icae", "aoc"])
def test_heatmap_png_and_cosine(method, ckpt, tmp_path, capsys):
    text = "The cat sat on the mat. " * 4
    result, out = run(["--ckpt", ckpt[method], "--task", "heatmap", "--text0", text, "--out", tmp_path / "hm.json"],
                      capsys)
    cos = np.array(result["cosine"])
    M, T = cos.shape
    assert (M, T) == (8, 96) and result["memory_slots"] == 8               # 2 chunks of <= 64 tokens x 4 memory
    for name in ("cosine", "attention"):
        pixels = read_png(result[f"{name}_png"])
        cell = result["cell_pixels"]
        assert pixels.shape == (M * cell, T * cell, 3)
        assert (pixels[::cell, ::cell] == hot(result[name])).all()
    assert "|" in out and result["cosine_png"] in out

    # one cell, computed independently of evaluate.py
    comp = C.load(ckpt[method])
    ids = comp.tok.encode(text)
    with torch.no_grad():
        memory = comp.compress([ids])
        if method == "icae":   # embeds carrier: memory vector vs the token's input embedding
            a, b = memory.embeds[0, 5], comp.decoder.model.embed_tokens.weight[ids[70]]
        else:                  # kv carrier: memory's last-layer keys vs the plain decoder's last-layer keys
            k = comp.decoder(torch.tensor([ids]), return_kv=True).kv[-1][0]          # (1, Hkv, T, D)
            a, b = memory.kv[-1][0][0, :, 5].flatten(), k[0, :, 70].flatten()
    assert cos[5, 70] == pytest.approx((a @ b / (a.norm() * b.norm())).item(), abs=1e-5)

    att = np.array(result["attention"])
    # memory of chunk 1 attends only to chunk 1 (tokens 0..63), of chunk 2 only to tokens 64..95
    assert (att[:4, 64:] == 0).all() and (att[4:, :64] == 0).all()
    assert (att[:4, :64] > 0).all() and (att.sum(1) <= 1 + 1e-5).all()


def test_heatmap_attention_shows_the_pic_mask():
    """PIC Eq. (5) rule 3: memory token m_t sees chunk c_t only, so its attention is zero elsewhere."""
    comp = random_comp("pic")                 # ratio 16: a 64-token context gets 4 memory tokens
    ids = comp.tok.encode(("abcdefgh" * 8))
    _, att = E.encoder_attention(comp, ids)
    assert att.shape == (4, 64)
    for t in range(4):
        inside = torch.zeros(64, dtype=torch.bool)
        inside[16 * t:16 * (t + 1)] = True
        assert (att[t, ~inside] == 0).all() and (att[t, inside] > 0).all()
        # the rest of m_t's weight sits on m_1..m_t (rule 2), so 0 < Σ over its chunk <= 1; m_1 has only itself
    assert (att.sum(1) <= 1 + 1e-5).all()


def test_heatmap_group_merging_has_cosine_but_no_attention(ckpt, tmp_path):
    result = E.main(["--ckpt", ckpt["gmsa"], "--task", "heatmap", "--text0", "x" * 40,
                     "--out", str(tmp_path / "g.json")])
    assert np.array(result["cosine"]).shape == (10, 40)     # groups of r = 4 (the evaluation rate)
    assert result["attention"] is None and "no memory tokens" in result["attention_note"]
    assert not (tmp_path / "g_attention.png").exists() and (tmp_path / "g_cosine.png").exists()


# ---- bad input ----


def one_line_error(argv):
    with pytest.raises(SystemExit) as e:
        E.main([str(a) for a in argv])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def test_bad_input_is_a_one_line_error(ckpt, tmp_path):
    assert "does not exist" in one_line_error(["--ckpt", tmp_path / "nope", "--task", "ae"])
    assert "compressor.json is missing" in one_line_error(["--ckpt", tmp_path, "--task", "ae"])
    assert "unknown task 'sing'" in one_line_error(["--ckpt", ckpt["aoc"], "--task", "sing"])
    assert "needs --ckpt" in one_line_error(["--task", "ae", "--method", "aoc"])
    assert "unknown method 'foo'" in one_line_error(["--task", "speed", "--method", "foo", "--lengths", "64"])
    assert "comma-separated" in one_line_error(["--task", "speed", "--method", "aoc", "--lengths", "1k"])
    assert "not 'HuggingFaceTB/SmolLM2-135M'" in one_line_error(
        ["--ckpt", ckpt["aoc"], "--task", "ae", "--model", "HuggingFaceTB/SmolLM2-135M"])
    assert "holds method 'aoc', not 'icae'" in one_line_error(
        ["--ckpt", ckpt["aoc"], "--task", "ae", "--method", "icae"])
    assert "no such file" in one_line_error(["--ckpt", ckpt["aoc"], "--task", "ae", "--data", tmp_path / "x.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "c", "question": "q", "answer": "a"}\n{"question": "no context"}\n')
    assert "record 2 needs the fields context, question, answer" in one_line_error(
        ["--ckpt", ckpt["icae"], "--task", "qa", "--data", bad])
    # CompLLM sizes memory by length: the two default prompts (31 and 34 bytes) give 16 and 17 slots
    assert "same size" in one_line_error(["--ckpt", ckpt["compllm"], "--task", "interpolate"])


def test_checkpoint_of_another_base_model(ckpt, tmp_path):
    """A checkpoint trained on a narrower model but labelled "tiny": the tensor shapes give it away."""
    cfg = ModelConfig.from_hf({**TINY_CONFIG, "hidden_size": 32, "head_dim": 8})
    C.build("icae", Transformer(cfg), build_tiny()[1], mem=4, chunk_len=64, lora_r=4).save(str(tmp_path))
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


@pytest.mark.parametrize("method", C.METHODS)
def test_every_method_runs_every_task(method, tmp_path):
    """Each preset through each task on one short example (tiny budgets); GMSA has no attention map."""
    kw = {"icae": dict(mem=8), "500x": dict(mem=8), "aoc": dict(mem=8), "compllm": {}}.get(method, {})
    comp = random_comp(method, **kw, **({} if method == "compllm" else dict(chunk_len=64)))
    text = E.BUILTIN_TEXTS[0]
    ae = E.run_ae(comp, [{"text": text}], max_new_tokens=4)
    assert ae["examples"][0]["memory_slots"] < len(comp.tok.encode(text))
    assert math.isfinite(E.run_lm(comp, [{"text": text}])["scores"]["compressed"]["perplexity"])
    assert set(E.run_qa(comp, E.BUILTIN_QA[:1], max_new_tokens=4)["scores"]) == {"compressed", "full", "none"}
    heat = E.run_heatmap(comp, text, str(tmp_path / "h"))
    assert (heat["attention"] is None) == (method == "gmsa")
    speed = E.run_speed(comp, [128, 256], max_new_tokens=1, repeats=1)
    assert all(r["kv_bytes_compressed"] < r["kv_bytes_full"] for r in speed["rows"])
    interp = E.run_interpolate(comp, "a" * 64, "b" * 64, [0, 1], max_new_tokens=4)   # equal lengths: equal sizes
    assert len(interp["rows"]) == 2
