"""The held-out check while a run trains (train.py --eval-data, --eval-every; heldout.py): does the memory carry its
own text? Its logged numbers are evaluate.py's on the same checkpoint and texts, it leaves training bit for bit as it
is, a memory that ignores its text gets the constant-prompt warning once per run, and the texts it scores are those
training would take, with one line where there are none. In-process on the test device.
"""

import json
import os
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import compressors as C
import data as D
import evaluate as E
import heldout
import train
from conftest import LORA, eval_rows, log_rows
from test_resume import assert_one_line_error
from test_train import HELD_OUT, X500, paper_schedule


@pytest.fixture(scope="module")
def held_texts(tmp_path_factory):
    """12 held-out texts in a file of their own (evaluate.py's built-in set, so nothing here trains on them)."""
    path = tmp_path_factory.mktemp("held") / "held.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in D.unseen_texts(12)))
    return str(path)


# ---- its numbers are evaluate.py's ----


@pytest.mark.parametrize("objective", ["ae", "pretrain"])
def test_held_out_check_logs_exactly_what_evaluate_prints(objective, held_texts, tmp_path, run_train, device):
    """The logged own/other is evaluate.py's on the same checkpoint, texts and --n (within 1e-5): at step 0 and
    every --eval-every steps; pretrain also logs the LM loss's own/other (evaluate.py --task lm)."""
    out = str(tmp_path / objective)
    run_train([*X500, "--objective", objective, *HELD_OUT, "--steps", "4", "--eval-data", held_texts,
               "--eval-every", "2", "--eval-n", "10", "--out", out])
    rows = eval_rows(out)
    assert [r["step"] for r in rows] == [0, 2, 4] and all(r["eval"]["n"] == 10 for r in rows)
    assert len({r["eval"]["own"] for r in rows}) == 3            # the memory changed between the checks
    common = ["--ckpt", out, "--data", held_texts, "--n", "10", "--max-len", "16", "--device", str(device),
              "--dtype", "float32", "--out", str(tmp_path / "eval.json")]
    got = E.main(common + ["--task", "ae", "--max-new-tokens", "1"])["loss"]
    last = rows[-1]["eval"]
    for key, ours in (("own", "own"), ("other", "other"), ("none", "none"), ("own_other_ratio", "own_other")):
        assert abs(got[key] - last[ours]) <= 1e-5, (key, got[key], last[ours])
    if objective == "pretrain":   # evaluate.py --task lm on the same texts, cut at the run's --max-len
        lm = E.main(common + ["--task", "lm"])["loss"]
        assert abs(lm["own_other_ratio"] - last["lm"]["own_other"]) <= 1e-5
    else:
        assert "lm" not in last
    assert "bleu4_words" not in last   # regenerating is --eval-bleu's


def test_eval_bleu_logs_what_evaluate_scores_the_regenerations(held_texts, tmp_path, run_train, device, monkeypatch):
    """--eval-bleu: each held-out check regenerates the texts from their memories, and its BLEU-4 (words) and ROUGE-L
    are evaluate.py --task ae's on the same checkpoint. A compressor that regenerates every text exactly scores 1.0
    (its generation replaced by the reference ids), one that regenerates nothing 0: the numbers are the texts'."""
    out = str(tmp_path / "bleu")
    run_train([*X500, "--objective", "ae", *HELD_OUT, "--steps", "2", "--eval-data", held_texts, "--eval-every", "2",
               "--eval-n", "6", "--eval-bleu", "--out", out])
    last = eval_rows(out)[-1]["eval"]
    got = E.main(["--ckpt", out, "--data", held_texts, "--n", "6", "--max-len", "16", "--device", str(device),
                  "--dtype", "float32", "--task", "ae", "--out", str(tmp_path / "eval.json")])["scores"]["compressed"]
    assert (last["bleu4_words"], last["rougeL"]) == pytest.approx((got["bleu4_words"], got["rougeL"]), abs=1e-9)
    comp = checkpoint.load(out, device=device).eval()
    run = json.load(open(os.path.join(out, "args.json")))   # the run's settings, as the check takes them
    ho = heldout.prepare(comp, 1, run["objective"], run["crop"], run["min_len"], run["max_len"], run["warmup"],
                         run["eval_data"], run["eval_n"], run["eval_bleu"], True, out, False, True)
    refs = {}
    real = E.texts_as_trained

    def remember(comp, texts, proto):   # the reference ids of each text, as the check cuts them
        pairs = real(comp, texts, proto)
        refs.update({tuple(x): y for x, y in pairs})
        return pairs
    monkeypatch.setattr(E, "texts_as_trained", remember)
    monkeypatch.setattr(type(comp), "generate", lambda self, memory, task, max_new_tokens: [
        list(refs.values())[i] for i in range(len(memory.slots))])
    perfect = heldout.score(comp, ho, device, nullcontext())
    monkeypatch.setattr(type(comp), "generate", lambda self, memory, task, max_new_tokens: [[]] * len(memory.slots))
    empty = heldout.score(comp, ho, device, nullcontext())
    # 1.0 but for BLEU's smoothing of texts under 4 words (16 bytes: 0.85 here)
    assert perfect["rougeL"] == 1.0 and perfect["bleu4_words"] > 0.8 and empty["bleu4_words"] == empty["rougeL"] == 0.0


def test_held_out_check_of_qa_scores_the_reference_answer(files, tmp_path, run_train, device):
    """qa: the loss of the reference answer after the question's own memory, as evaluate.py --task qa reports it."""
    out = str(tmp_path / "qa")
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(dict(context=c, question=q, answer=a)) + "\n" for c, q, a in D.BUILTIN_QA))
    run_train([*X500, "--objective", "qa", "--model", "tiny", "--data", str(qa), "--max-len", "64", "--steps", "2",
               "--eval-data", str(qa), "--eval-every", "2", "--out", out])
    last = eval_rows(out)[-1]["eval"]
    got = E.main(["--ckpt", out, "--task", "qa", "--data", str(qa), "--max-len", "64", "--max-new-tokens", "1",
                  "--device", str(device), "--dtype", "float32", "--out", str(tmp_path / "eval.json")])["loss"]
    assert last["n"] == len(D.BUILTIN_QA) and abs(got["own_other_ratio"] - last["own_other"]) <= 1e-5


def test_keft_held_out_checks_load_the_base_llm_once(files, tmp_path, run_train, monkeypatch, capsys):
    """After GMSA's --stage keft the references need the base LLM (the decoder's q/k/v train): one copy per run,
    not a load per held-out check (4 checks of a 3-step run at --eval-every 1: 4 loads, on a 7B model 28 GB each);
    an out-of-memory error in the check is one line."""
    stage1, keft = str(tmp_path / "ae"), str(tmp_path / "keft")
    run_train(["--method", "gmsa", "--model", files["model"], "--data", files["doc"], *LORA, "--ratios", "2",
               "--batch-size", "2", "--steps", "1", "--out", stage1])
    loads = []
    load = E.load_pretrained
    monkeypatch.setattr(E, "load_pretrained", lambda *a, **kw: loads.append(a) or load(*a, **kw))
    flags = ["--method", "gmsa", "--stage", "keft", "--init", stage1, "--data", files["qa"], "--batch-size", "2",
             "--steps", "3", "--eval-every", "1", "--eval-data", files["qa"]]
    run_train([*flags, "--out", keft])
    assert [r["step"] for r in eval_rows(keft)] == [0, 1, 2, 3] and len(loads) == 1
    monkeypatch.setattr(E, "load_pretrained", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("CUDA out of memory. Tried to allocate 28.00 GiB")))
    with pytest.raises(SystemExit) as e:
        run_train([*flags, "--out", str(tmp_path / "oom")])
    assert "out of memory in the held-out check at step 0" in str(e.value) and "\n" not in str(e.value)


# ---- it does not touch training ----


def test_held_out_check_does_not_touch_training(held_texts, tmp_path, run_train):
    """Losses and weights are bit-identical with and without the check (LoRA dropout draws from the RNG it could
    have moved), and a run stopped and resumed keeps its earlier checks and logs each step's once."""
    base = [*X500, "--objective", "ae", *HELD_OUT, "--steps", "6", "--eval-data", held_texts, "--eval-n", "6"]
    run_train(base + ["--eval-every", "0", "--out", str(tmp_path / "off")])
    run_train(base + ["--eval-every", "2", "--out", str(tmp_path / "on")])
    run_train(base + ["--eval-every", "2", "--stop-after", "3", "--out", str(tmp_path / "part")])
    run_train(["--resume", str(tmp_path / "part")])
    off, on, part = (log_rows(tmp_path / d) for d in ("off", "on", "part"))
    assert eval_rows(tmp_path / "off") == []
    for a, b, c in zip(off, on, part, strict=True):
        assert a["loss"] == b["loss"] == c["loss"] and a["grad_norm"] == b["grad_norm"] == c["grad_norm"]
    assert len({r["loss"] for r in off}) == 6
    w_off, w_on = (load_file(str(tmp_path / d / "compressor.safetensors")) for d in ("off", "on"))
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)
    # the interrupted run checked at 0 and 2 before its stop, then at 4 and 6: the same numbers as the whole run
    numbers = lambda d: [(r["step"], {k: v for k, v in r["eval"].items() if k != "seconds"}) for r in eval_rows(d)]
    assert numbers(tmp_path / "part") == numbers(tmp_path / "on")
    assert [r["step"] for r in eval_rows(tmp_path / "on")] == [0, 2, 4, 6]


# ---- the constant-prompt warning ----


def test_a_constant_memory_gets_the_prompt_warning(tmp_path, run_train, monkeypatch, capsys):
    """A memory that is the same for every text (every context replaced by one fixed text before compressing)
    scores own/other 1.0 and the run warns once, and prints that own/other never reached 0.5. (A memory that carries
    its text gets no warning: AOC's run in test_every_method_learns_memories_that_carry_their_own_text.)"""
    base = ["--method", "aoc", "--mem", "16", "--model", "tiny", "--max-len", "16", "--warmup", "10",
            *paper_schedule("aoc")]
    compress = C.Compressor.compress
    monkeypatch.setattr(C.Compressor, "compress", lambda self, contexts, **kw: compress(
        self, [[65] * 8] * len(contexts), **kw))   # one memory for every text: that of "AAAAAAAA"
    run_train(base + ["--lr", "3e-3", "--steps", "60", "--eval-every", "10", "--out", str(tmp_path / "constant")])
    text = capsys.readouterr().out
    assert all(r["eval"]["own_other"] == 1.0 for r in eval_rows(tmp_path / "constant"))
    # past the warmup (10 steps) the checks at 20, 30 and 40 are three in a row at 1.0: one warning, at 40
    assert text.count("warning: held-out own/other 1.000 at step 40") == 1 and text.count("warning") == 1
    assert "constant prompt" in text and "never <= 0.5 within 60 steps" in text


def test_the_prompt_warning_is_saved_and_not_repeated_after_resume(tmp_path, run_train, monkeypatch, capsys):
    """The constant-prompt warning is given once per run: saved with its held-out row, so a --resume past it (whose
    checks are still all at 1.0) does not give it again."""
    compress = C.Compressor.compress
    monkeypatch.setattr(C.Compressor, "compress", lambda self, contexts, **kw: compress(
        self, [[65] * 8] * len(contexts), **kw))   # one memory for every text
    out = str(tmp_path / "constant")
    run_train(["--method", "aoc", "--mem", "4", "--batch-size", "2", "--warmup", "1", "--steps", "7",
               "--stop-after", "5", "--eval-every", "1", "--out", out])
    assert capsys.readouterr().out.count("warning: held-out own/other 1.000 at step 4") == 1   # checks 2, 3, 4
    run_train(["--resume", out])
    assert "warning: held-out" not in capsys.readouterr().out
    assert [r["step"] for r in eval_rows(out) if r.get("warned")] == [4]


# ---- which texts it scores ----


def test_pretrain_held_out_check_takes_the_short_texts_training_takes(tmp_path, run_train, capsys):
    """--max-len 3 trains pretrain on 2-3 token texts (p = max(1, n // 2)); its held-out LM check cuts them the same
    way instead of stopping at step 0 ('text too short for the LM task'). Held-out texts shorter than the run's
    --min-len are not scored (evaluate.at_trained_length); when none is long enough, one line says so."""
    out = str(tmp_path / "short")
    run_train(["--method", "icae", "--objective", "pretrain", "--mem", "2", "--batch-size", "2", "--steps", "1",
               "--max-len", "3", "--eval-every", "1", "--eval-n", "4", "--out", out])
    assert [r["step"] for r in eval_rows(out)] == [0, 1] and all("lm" in r["eval"] for r in eval_rows(out))
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(SystemExit) as e:
        run_train(["--method", "icae", "--objective", "pretrain", "--mem", "2", "--batch-size", "2", "--steps", "1",
                   "--eval-data", str(tmp_path / "held.jsonl"), "--out", str(tmp_path / "empty")])
    assert "no held-out text of at least 8 tokens" in str(e.value) and "\n" not in str(e.value)   # tiny's icae: n = 8


def test_a_held_out_set_too_short_for_the_run_says_how_to_fix_the_check(tmp_path, capsys, device):
    """No held-out text reaches the run's --min-len: the check's advice is the check's flags (--eval-data FILE,
    --eval-every 0), not --data or --min-len, which would change the training itself."""
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": t[:12]}) + "\n" for t in D.EVAL_TEXTS[:4]))
    argv = ["--method", "aoc", "--mem", "4", "--crop", "window", "--min-len", "16", "--max-len", "16", "--steps", "1",
            "--eval-data", str(short), "--out", str(tmp_path / "x")]
    assert_one_line_error(argv, "pass --eval-data FILE with longer texts, or --eval-every 0", capsys, device)
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--device", str(device)])
    assert "--min-len N" not in str(e.value.code) and "--data with" not in str(e.value.code)


def test_a_real_model_without_eval_data_says_no_check_runs(files, tmp_path, run_train, capsys):
    run_train(["--method", "aoc", "--mem", "4", "--model", files["model"], "--data", files["doc"], "--crop", "window",
               "--max-len", "16", "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "real")])
    assert "no held-out check runs: pass --eval-data FILE" in capsys.readouterr().out
    assert eval_rows(tmp_path / "real") == []


def test_the_help_and_notes_say_which_held_out_texts_are_scored(capsys):
    """--eval-n and evaluate.py's --n take the first N texts of at least --min-len tokens (ae, lm), and texts shorter
    than a head crop's n are left out, not padded: the help and evaluate.py's notes say so."""
    for main in (train.main, E.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "the first N of at least" in text
    assert "padded as in training" not in E.TASKS_NOTES and "left out, not padded" in " ".join(E.TASKS_NOTES.split())
