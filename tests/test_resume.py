"""A run stops and continues: --stop-after, Ctrl-C and --resume continue exactly as an uninterrupted run, a step that
fails (a non-finite loss, out of memory) stops with one line and keeps the last good checkpoint, checkpoints hold what
a run needs and load across settings added since, and bad input (flags, data, a damaged or mismatched checkpoint)
ends in one line without touching the run directory. In-process on the test device (the CPU unless `--device cuda`).
"""

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
import cli
import data as D
import evaluate as E
import train
from conftest import LORA, eval_rows, log_rows


def snapshot(folder):
    """Every file under `folder` -> (size, mtime, content hash): to prove an error changed nothing."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns,
                                         hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def assert_one_line_error(argv, message, capsys, device):
    """train.main(argv) on the test device exits with an error whose text (argparse's usage and error, or train.py's
    one line) holds `message`, with no traceback."""
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--device", str(device)])
    err = capsys.readouterr().err
    text = err if e.value.code == 2 else str(e.value.code)        # argparse prints; fail() carries the line
    assert e.value.code != 0 and message in text, text
    assert "Traceback" not in err and len(text.strip().splitlines()) <= 2, text   # argparse: usage + error


# ---- stop, resume, interrupt ----


@pytest.mark.parametrize("method,flags", [
    # random text lengths and offsets (the data position) ...
    ("icae", ["--mem", "4", "--chunk-len", "16", *LORA, "--objective", "pretrain", "--crop", "window",
              "--min-len", "16", "--max-len", "64"]),
    # ... and GMSA's ratios, drawn from torch's RNG inside compress() (the RNG state in the checkpoint)
    ("gmsa", [*LORA, "--crop", "window", "--min-len", "16", "--max-len", "64"]),
])
def test_stop_after_then_resume_equals_an_uninterrupted_run(method, flags, tmp_path, run_train):
    base = ["--method", method, "--model", "tiny", "--batch-size", "2", "--lr", "3e-3", "--steps", "8", *flags]
    run_train(base + ["--out", str(tmp_path / "full")])
    run_train(base + ["--out", str(tmp_path / "part"), "--stop-after", "4"])
    assert [r["step"] for r in log_rows(tmp_path / "part")] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "part")) == ["args.json", "cache", "ckpt-000004", "compressor.json",
                                                     "compressor.safetensors", "log.jsonl"]
    run_train(["--resume", str(tmp_path / "part")])
    full, part = log_rows(tmp_path / "full"), log_rows(tmp_path / "part")
    assert [r["step"] for r in part] == list(range(1, 9))
    for a, b in zip(full, part):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)
    assert len({r["loss"] for r in full}) == 8          # the losses did move: the comparison means something
    w_full, w_part = (load_file(str(tmp_path / d / "compressor.safetensors")) for d in ("full", "part"))
    for name in w_full:
        torch.testing.assert_close(w_part[name], w_full[name], rtol=0, atol=1e-6)


def test_resume_reads_a_record_of_flags_without_the_config_fields(tmp_path, run_train):
    """A checkpoint records the run's flags, the recipe's values and the config's fields (cli.Settings.record);
    --resume also takes a record of the flags and the recipe alone (a compressor flag neither typed nor set by the
    recipe None, no compressor_model or decoder_train), and that run continues as an uninterrupted one."""
    base = ["--method", "aoc", "--mem", "4", "--batch-size", "2", "--lr", "3e-3", "--steps", "4", "--eval-every", "0"]
    run_train(base + ["--out", str(tmp_path / "full")])
    part = str(tmp_path / "part")
    run_train(base + ["--out", part, "--stop-after", "2"])
    path = os.path.join(checkpoint.latest_checkpoint(part), "train_state.pt")
    state = torch.load(path, weights_only=True)
    assert {"compressor_model", "decoder_train", "carrier"} <= state["args"].keys() and state["args"]["carrier"] == "kv"
    old = {k: None if k in cli.COMPRESSOR_FLAGS and k != "mem" else v for k, v in state["args"].items()
           if k not in ("compressor_model", "decoder_train")}
    torch.save({**state, "args": old}, path)
    Path(part, "args.json").write_text(json.dumps(old))
    run_train(["--resume", part, "--mem", "4"])   # a typed flag is compared with the older record too
    full, resumed = log_rows(tmp_path / "full"), log_rows(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
    assert json.loads(Path(part, "args.json").read_text())["carrier"] == "kv"   # written again: the config's fields


def test_a_checkpoint_that_travels_in_pieces_resumes_exactly(tmp_path, run_train):
    """recipes/pieces.py: a checkpoint cut into pieces (as a lent GPU returns it, 16 MiB a file), joined
    elsewhere, resumes as if it had never left; a missing or damaged piece stops join with one line, writing nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import pieces
    base = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--lr", "3e-3", "--steps", "6"]
    run_train(base + ["--out", str(tmp_path / "full")])
    run_train(base + ["--out", str(tmp_path / "part"), "--stop-after", "3"])
    ckpt, cut = tmp_path / "part" / "ckpt-000003", tmp_path / "cut"
    before = snapshot(ckpt)
    pieces.main(["split", str(ckpt), str(cut), "--mib", str(20_000 / 2**20)])
    manifest = json.load(open(cut / "manifest.json"))
    assert max(p.stat().st_size for p in cut.glob("*.0*")) <= 20_000   # no piece over --mib
    assert any(m["pieces"] > 1 for m in manifest["files"].values())      # and a file did need several
    shutil.rmtree(ckpt)

    lost = sorted(cut.glob("*.001"))[0]
    lost.rename(tmp_path / "aside")
    with pytest.raises(SystemExit, match=f"1 piece.* not here yet .*{lost.name}"):
        pieces.main(["join", str(cut), str(ckpt)])
    (tmp_path / "aside").rename(lost)
    good = lost.read_bytes()
    lost.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))                  # one bit flipped
    with pytest.raises(SystemExit, match="do not match the manifest's sha256"):
        pieces.main(["join", str(cut), str(ckpt)])
    assert not ckpt.exists() or not list(ckpt.iterdir())                  # nothing written, no temporary left
    lost.write_bytes(good)

    pieces.main(["join", str(cut), str(ckpt)])
    assert snapshot(ckpt).keys() == before.keys() and all(
        snapshot(ckpt)[k][::2] == before[k][::2] for k in before)          # same sizes and bytes
    run_train(["--resume", str(tmp_path / "part")])
    for a, b in zip(log_rows(tmp_path / "full"), log_rows(tmp_path / "part"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6


def test_ctrl_c_saves_a_checkpoint_and_the_run_continues_exactly(tmp_path, monkeypatch, run_train):
    base = ["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--lr", "3e-3", "--steps", "6"]
    run_train(base + ["--out", str(tmp_path / "full")])
    calls, loss_ae = [], train.loss_ae

    def interrupted(comp, batch):   # SIGINT arrives in the middle of step 3
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return loss_ae(comp, batch)
    monkeypatch.setattr(train, "loss_ae", interrupted)
    run_train(base + ["--out", str(tmp_path / "part")])
    assert [r["step"] for r in log_rows(tmp_path / "part")] == [1, 2, 3]
    assert os.path.isdir(tmp_path / "part" / "ckpt-000003")
    monkeypatch.setattr(train, "loss_ae", loss_ae)
    run_train(["--resume", str(tmp_path / "part")])
    for a, b in zip(log_rows(tmp_path / "full"), log_rows(tmp_path / "part"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6


def test_resume_accepts_the_flags_it_was_trained_with(finished_run, tmp_path, run_train):
    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    run_train(["--resume", run, "--method", "aoc", "--mem", "4", "--betas", "0.9", "0.999", "--steps", "3"])
    assert [r["step"] for r in log_rows(run)] == [1, 2, 3]


def test_resume_takes_a_run_flag_typed_with_its_default_value(tmp_path, run_train):
    """A run flag typed on --resume wins, also when its value is the flag's default: --eval-n 32 after a run with
    --eval-n 4, --save-every 1000 after --save-every 1 (a comparison with the default would take them for
    untyped)."""
    out = str(tmp_path / "run")
    run_train(["--method", "aoc", "--mem", "4", "--batch-size", "2", "--steps", "1", "--eval-n", "4",
               "--save-every", "1", "--eval-every", "0", "--out", out])
    parser = cli.build_parser()
    assert (parser.get_default("eval_n"), parser.get_default("save_every")) == (32, 1000)
    s = cli.parse_args(["--resume", out, "--eval-n", "32", "--save-every", "1000"])
    assert (s.eval_n, s.save_every) == (32, 1000)
    s = cli.parse_args(["--resume", out])   # untyped: the run's own
    assert (s.eval_n, s.save_every) == (4, 1)


def test_a_run_with_relative_paths_resumes_from_another_directory(tmp_path, run_train, monkeypatch):
    """Every path-valued flag is saved absolute (cli.PATH_FLAGS): a run started with --data and --eval-data
    relative to its directory resumes from anywhere (a relative --eval-data would be 'no such file' there)."""
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "start" / "held.txt").write_text("\n".join(D.unseen_texts()[:3]) + "\n")
    (tmp_path / "start" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in D.BUILTIN_TEXTS))
    monkeypatch.chdir(tmp_path / "start")
    out = str(tmp_path / "run")
    run_train(["--method", "aoc", "--mem", "4", "--batch-size", "2", "--steps", "2", "--stop-after", "1",
               "--data", "docs.jsonl", "--eval-data", "held.txt", "--eval-every", "1", "--out", out])
    monkeypatch.chdir(tmp_path / "elsewhere")
    run_train(["--resume", out])
    assert [r["step"] for r in eval_rows(out)] == [0, 1, 2] and all(r["eval"]["n"] == 3 for r in eval_rows(out))


def test_resuming_a_finished_run_does_nothing(finished_run, capsys, run_train):
    before = snapshot(finished_run)
    run_train(["--resume", finished_run])
    assert "nothing to do" in capsys.readouterr().out
    assert snapshot(finished_run) == before


# ---- a step that fails: non-finite loss, out of memory ----


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, run_train):
    out = tmp_path / "run"
    calls, loss_ae = [], train.loss_ae

    def exploding(comp, batch):     # step 5 produces a NaN loss
        calls.append(1)
        loss, parts = loss_ae(comp, batch)
        return (loss * float("nan"), parts) if len(calls) == 5 else (loss, parts)
    monkeypatch.setattr(train, "loss_ae", exploding)
    with pytest.raises(SystemExit) as e:
        run_train(["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "8",
                   "--save-every", "2", "--out", str(out)])
    assert "nan" in str(e.value.code) and "\n" not in str(e.value.code)
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000004"]
    assert [r["step"] for r in log_rows(out)] == [1, 2, 3, 4]
    good = out / "ckpt-000004" / "compressor.safetensors"
    assert (out / "compressor.safetensors").read_bytes() == good.read_bytes()
    assert torch.load(out / "ckpt-000004" / "train_state.pt", weights_only=True)["step"] == 4


@pytest.mark.parametrize("error", [
    lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    lambda: torch.empty(2 ** 60, dtype=torch.uint8),      # a real CPU allocation failure
])
def test_out_of_memory_is_one_line_with_the_fix_and_keeps_the_last_checkpoint(error, tmp_path, monkeypatch, capsys,
                                                                              run_train):
    out = tmp_path / "run"
    calls, loss_ae = [], train.loss_ae

    def oom(comp, batch):          # step 3 runs out of memory
        calls.append(1)
        if len(calls) == 3:
            e = error()
            raise e
        return loss_ae(comp, batch)
    monkeypatch.setattr(train, "loss_ae", oom)
    with pytest.raises(SystemExit) as e:
        run_train(["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "6",
                   "--save-every", "2", "--out", str(out)])
    message = str(e.value.code)
    assert "\n" not in message and "out of memory at step 3" in message and "--micro-batch 1" in message
    assert "--grad-ckpt" in message and "contexts 2 x" in message
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000002"]


# ---- checkpoints ----


def test_keep_every_keeps_the_intermediate_checkpoints(tmp_path, run_train):
    """PIC §4.3.2 fine-tunes checkpoints taken during pretraining: --keep-every K keeps every K-th one."""
    out = tmp_path / "run"
    run_train(["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "6",
               "--save-every", "100", "--keep-every", "2", "--out", str(out)])
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000004", "ckpt-000006"]
    assert checkpoint.load(str(out / "ckpt-000002")).cfg.method == "aoc"


def test_checkpoints_save_only_the_generators_a_run_draws_from(finished_run):
    """torch's RNG is the only global one a run draws from (the data has generators of its own): a checkpoint holds
    its state, not numpy's or random's, and a checkpoint that holds those too restores."""
    state = checkpoint.read_train_state(finished_run)
    assert set(state["rng"][0]) == {"torch", "cuda"}
    before = torch.get_rng_state()
    old = {**state["rng"][0], "python": (3, (0,) * 625, None), "numpy": ["MT19937", [0] * 624, 0, 0, 0.0]}
    checkpoint.set_rng_state(old, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state["rng"][0]["torch"])
    torch.set_rng_state(before)


def test_init_from_a_run_saved_before_a_setting_existed(finished_run, tmp_path, capsys, device):
    """A run whose compressor.json has no mem_norm (a setting newer than the run) takes the setting's default
    (as checkpoint.load builds it), so --init starts from it, and --init with --mem-norm is the one-line error of any
    setting the run was not trained with (not a KeyError traceback)."""
    run = str(tmp_path / "old")
    shutil.copytree(finished_run, run)
    meta = json.loads(Path(run, "compressor.json").read_text())
    del meta["config"]["mem_norm"]
    Path(run, "compressor.json").write_text(json.dumps(meta))
    s = cli.parse_args(["--init", run, "--method", "aoc", "--out", str(tmp_path / "new")])
    assert s.config.mem_norm is False and checkpoint.load(run).cfg.mem_norm is False
    assert_one_line_error(["--init", run, "--method", "aoc", "--mem-norm", "--out", str(tmp_path / "new")],
                          "was trained with mem_norm=False: drop --mem-norm", capsys, device)


# ---- bad input: one line, nothing touched ----


@pytest.mark.parametrize("argv,message", [
    (["--method", "nope"], "invalid choice: 'nope'"),
    (["--method", "aoc", "--data", "MISSING"], "does not exist"),
    (["--method", "aoc", "--data", "EMPTY"], "no text in"),
    (["--method", "icae", "--mem", "64", "--chunk-len", "32"], "--mem 64 is larger than the chunk"),
    (["--method", "gmsa", "--layout", "epl"], "--layout epl needs memory tokens"),
    (["--method", "aoc", "--data", "hf://datasets/nobody/nothing/x.txt"], "cannot fetch"),
    (["--method", "aoc", "--objective", "qa", "--data", "DOC"], "needs JSON lines"),
    (["--method", "aoc", "--stage", "keft"], "pass --init DIR"),
    (["--method", "icae", "--init", "RUN"], "is a aoc compressor, not icae"),
    (["--method", "aoc", "--batch-size", "3", "--micro-batch", "2"], "must be a multiple"),
    (["--method", "icae", "--own-other-weight", "1", "--micro-batch", "1"], "a micro-batch of 1 has a text without"),
    (["--method", "icae", "--own-other-weight", "1", "--objective", "pretrain"], "needs W >= 0 and --objective ae"),
    (["--method", "compllm", "--mem-from-text"], "--mem-from-text adds a text's segment means"),
    (["--method", "icae", "--model", "no/such-model-here"], "cannot fetch"),
    (["--method", "aoc", "--mem", "4", "--crop", "head", "--data", "DOC"], "holds 1 document(s) for a batch of 16"),
])
def test_bad_input_is_one_line_and_leaves_out_untouched(argv, message, files, tmp_path, capsys, finished_run, device):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    paths = dict(MISSING=str(tmp_path / "missing.txt"), EMPTY=files["empty"], DOC=files["doc"], RUN=finished_run)
    argv = [paths.get(a, a) for a in argv] + ["--model", "tiny"] * ("--model" not in argv) + ["--out", str(out)]
    before = snapshot(out)
    assert_one_line_error(argv, message, capsys, device)
    assert snapshot(out) == before


def corrupt(path):
    Path(path).write_bytes(b"\x00garbage")


def foreign_tensors(run):   # a compressor of another shape in place of the run's own
    save_file({"mem_tokens": torch.zeros(3, 3)}, os.path.join(run, "ckpt-000002", "compressor.safetensors"))


@pytest.mark.parametrize("damage,extra,message", [
    (None, ["--method", "pic"], "mismatched checkpoint"),
    (None, ["--mem", "8"], "mismatched checkpoint"),
    (lambda run: corrupt(os.path.join(run, "ckpt-000002", "train_state.pt")), [], "is corrupt"),
    (lambda run: corrupt(os.path.join(run, "ckpt-000002", "compressor.json")), [], "is corrupt"),
    (foreign_tensors, [], "does not match the compressor"),
    (lambda run: os.remove(os.path.join(run, "ckpt-000002", "train_state.pt")), [], "holds no checkpoint"),
])
def test_bad_resume_is_one_line_and_leaves_the_run_untouched(damage, extra, message, finished_run, tmp_path, capsys,
                                                             device):
    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    if damage:
        damage(run)
    before = snapshot(run)
    assert_one_line_error(["--resume", run, "--steps", "4", *extra], message, capsys, device)
    assert snapshot(run) == before


@pytest.mark.parametrize("meta", [{"train_args": {}}, [1, 2], {"config": "aoc"}, {"config": {"mem": 4}}])
def test_init_and_evaluate_on_a_compressor_json_without_a_config_are_one_line(meta, finished_run, tmp_path, capsys,
                                                                             device):
    """compressor.json without "config", a JSON list, a config that is no object or lacks method and model: one
    line from train.py --init and from evaluate.py alike (no KeyError, TypeError or AttributeError traceback)."""
    run = tmp_path / "broken"
    shutil.copytree(finished_run, run)
    (run / "compressor.json").write_text(json.dumps(meta))
    assert_one_line_error(["--method", "aoc", "--init", str(run), "--out", str(tmp_path / "x")],
                          "compressor.json", capsys, device)
    with pytest.raises(SystemExit) as e:
        E.main(["--ckpt", str(run), "--task", "ae", "--device", str(device)])
    assert str(e.value).startswith("error: ") and "compressor.json" in str(e.value) and "\n" not in str(e.value)


def test_a_new_run_never_overwrites_a_checkpoint(finished_run, capsys, device):
    before = snapshot(finished_run)
    assert_one_line_error(["--method", "aoc", "--model", "tiny", "--out", finished_run], "already holds a checkpoint",
                          capsys, device)
    assert snapshot(finished_run) == before


def test_resume_on_a_changed_corpus_is_one_line(finished_run, tmp_path, monkeypatch, capsys, device):
    """The corpus's key is saved with each checkpoint and compared on --resume: a run started on the built-in corpus
    does not continue silently once that corpus has changed (here: one more paragraph)."""
    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    monkeypatch.setattr(D, "BUILTIN_TEXTS", [*D.BUILTIN_TEXTS, "One more paragraph, added since."])
    before = snapshot(os.path.join(run, "ckpt-000002"))
    assert_one_line_error(["--resume", run, "--steps", "4"], "was trained on another corpus than the built-in corpus",
                          capsys, device)
    assert snapshot(os.path.join(run, "ckpt-000002")) == before and [r["step"] for r in log_rows(run)] == [1, 2]
