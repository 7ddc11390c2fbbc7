"""A run's settings: each value comes from one source and is named with it (a flag, the tiny demo, the paper's recipe,
its code's, or ours: cli.recipe_for), the run's first log lines and --help say which and where the demo or an objective
changes the paper's, and all of it is decided in one place, once (STYLE.md rule 15).

Decided once: cli.py turns the flags into plain values and a frozen config, and nothing below train.main receives the
flags, as an argparse.Namespace or as a dict to pick keys from; each function takes the values it needs. The test of
that runs short tiny AOC runs under sys.setprofile, one with the held-out check and its --resume, and looks at the
arguments of every call of a project function (one defined in a top-level module of the repository): none outside
cli.py and train.main may receive a Namespace, or a dict holding two flag names or more (a log row's "lr" alone is no
copy of the flags), as an argument or as a field of a dataclass it is given (a dict kept in an object is passed all
the same). The one function that writes the record to disk, checkpoint.save_checkpoint, receives it: that is its job.
"""

import argparse
import dataclasses
import inspect
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import checkpoint
import cli
import compressors as C
import evaluate as E
import presets as P
import train
from conftest import LORA, log_rows
from model import build_tiny
from test_resume import assert_one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- where each setting comes from: a flag, the tiny demo, the paper's recipe, its code, ours ----


def test_quickstart_on_the_real_tiny_model_runs_and_logs(tmp_path, run_train, capsys):
    """The README command, shortened: --model tiny's demo settings (cli.TINY) fill the flags; every log field is
    there."""
    out = str(tmp_path / "aoc")
    run_train(["--method", "aoc", "--mem", "4", "--steps", "3", "--out", out])
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"step", "loss", "lr", "grad_norm", "dt", "tokens_per_s", "ae"} <= rows[0].keys()
    args = json.load(open(os.path.join(out, "args.json")))
    # the demo: AE on the first 16 bytes (head crop), AOC's row batch 16, lr 1e-2; AOC's own wd 0 and clip 1.0 (HF
    # Trainer's); 16 bytes in 4 slots
    assert (args["model"], args["objective"], args["lr"], args["weight_decay"], args["clip"], args["batch_size"],
            args["crop"], args["min_len"], args["max_len"]) == ("tiny", "ae", 1e-2, 0.0, 1.0, 16, "head", 16, 16)
    assert checkpoint.load(out).cfg.mem == 4
    assert "aoc: ae objective on 3,013 documents" in capsys.readouterr().out   # AOC's own objective: no note


@pytest.mark.parametrize("method", P.METHODS)
def test_tiny_takes_the_demo_settings_and_a_real_model_the_papers(method, files):
    """--model tiny (the default): every flag left unset comes from TINY_ALL + TINY[method], the paper's recipe
    fills the rest; a flag wins; a real model (a local folder) keeps the paper's recipe."""
    demo = {**cli.TINY_ALL, **cli.TINY[method]}
    s = cli.parse_args(["--method", method])
    assert (s.model, s.objective, s.crop, s.batch_size, s.lr, s.steps) == \
        ("tiny", demo["objective"], demo["crop"], demo["batch_size"], demo["lr"], demo["steps"])
    assert (s.min_len, s.max_len) == demo["lengths"]
    assert s.warmup == min(P.PRESETS[method].recipe.warmup, demo["steps"] // 10)
    for k, v in demo.items():   # anything else a row sets (a compressor setting) lands in the config
        if k in cli.COMPRESSOR_FLAGS:
            assert getattr(s.config, k) == v, k
    s = cli.parse_args(["--method", method, "--lr", "1e-3", "--max-len", "24", "--objective", "pretrain"])
    assert (s.lr, s.max_len, s.objective, s.steps) == (1e-3, 24, "pretrain", demo["steps"])
    paper = P.PRESETS[method].recipe
    s = cli.parse_args(["--method", method, "--model", files["model"]])
    assert (s.objective, s.crop, s.batch_size, s.lr, s.steps) == \
        (paper.objective, paper.crop, paper.batch_size, paper.lr, paper.steps)
    assert (s.min_len, s.max_len) == paper.lengths


def test_recipe_for_names_each_settings_value_and_source():
    """cli.recipe_for answers "what does this run use, and why": a flag, the tiny demo (ours, never called the
    paper's), the paper's recipe, its code's, or ours; derived values say how."""
    for method in P.METHODS:
        tiny = cli.recipe_for(method, "tiny")
        demo = {**cli.TINY_ALL, **cli.TINY[method]}
        for k, v in demo.items():   # every demo value is there, as the demo's
            if k == "lengths":
                assert (tiny["max_len"].value, tiny["max_len"].source) == (v[1], "demo"), method
            else:
                assert tiny[k] == (v, "demo"), (method, k)
        assert all(s.source != "paper" or k not in demo for k, s in tiny.items())
        real = cli.recipe_for(method, "org/model")
        recipe = P.PRESETS[method].recipe
        assert real["lr"].value == cli.recipe_settings(recipe, real["objective"].value)["lr"].value and "demo" not in {
            s.source for s in real.values()}
    aoc = cli.recipe_for("aoc", "org/model")
    assert aoc["lr"] == (2e-4, "paper") and aoc["betas"] == ((0.9, 0.999), "code") and aoc["steps"].source == "ours"
    assert aoc["min_len"] == (96, "--crop head: --max-len") and aoc["warmup"] == (300, "paper")
    short = cli.recipe_for("aoc", "org/model", flags=dict(steps=100, lr=1e-3, objective=None))
    assert short["lr"] == (1e-3, "flag") and short["steps"] == (100, "flag")
    assert short["warmup"] == (10, "ours: 10% of --steps") and short["objective"] == ("ae", "paper")
    assert cli.recipe_for("500x", "org/model", flags=dict(objective="ae"))["ae_token"] == ("bos", "code")
    assert cli.recipe_for("gmsa", "org/model", stage="keft")["objective"] == ("qa", "--stage keft")
    scaled = cli.recipe_for("icae", "org/model", flags=dict(chunk_len=255))
    assert scaled["max_len"] == (1020, "paper, scaled by --chunk-len")


def test_paper_defaults_fill_the_unset_flags_and_flags_win(tmp_path):
    s = cli.parse_args(["--method", "icae", "--model", "meta-llama/Llama-3.2-1B", "--steps", "20000"])
    assert (s.objective, s.lr, s.betas, s.weight_decay, s.schedule, s.warmup, s.batch_size,
            s.clip, s.min_len, s.max_len) == ("pretrain", 1e-4, (0.9, 0.95), 0.1, "constant", 300, 16,
                                              2.0, 510, 2040)   # EPL App. C, Table 8
    s = cli.parse_args(["--method", "icae", "--model", "x/y", "--objective", "qa", "--lr", "3e-5"])
    assert s.lr == 3e-5
    s = cli.parse_args(["--method", "icae", "--model", "x/y", "--objective", "qa"])
    assert s.lr == 5e-5                                        # EPL fine-tuning
    s = cli.parse_args(["--method", "icae", "--model", "x/y", "--chunk-len", "255"])
    assert (s.min_len, s.max_len) == (255, 1020)            # half the chunk: half the lengths
    s = cli.parse_args(["--method", "compllm", "--model", "x/y"])
    assert (s.objective, s.lr, s.weight_decay, s.batch_size) == ("distill", 1e-4, 0.0, 4)


def test_recipes_of_the_papers_code(tmp_path):
    # EPL's 500xCompressor branch (pretrain): learned [AE]/[LM]; the original 500x code (ae): [BOS], N(0, 1) memory
    # tokens, no [BOS] context, LoRA r 64 α 32 dropout 0.05, HF Trainer's AdamW (wd 0, clip 1.0), first 500 tokens
    s = cli.parse_args(["--method", "500x", "--model", "x/y"])
    assert (s.config.ae_token, s.config.lm_token, s.config.bos) == ("learned", "learned", True)   # the preset's
    assert [s.shown[k].source for k in ("ae_token", "lm_token", "bos")] == ["default", "default", "preset"]
    s = cli.parse_args(["--method", "500x", "--model", "x/y", "--objective", "ae"])
    assert (s.config.ae_token, s.config.mem_init, s.config.bos, s.config.lora_r, s.config.lora_alpha,
            s.config.lora_dropout) == ("bos", "normal", False, 64, 32, 0.05)
    assert (s.weight_decay, s.clip, s.crop, s.max_len) == (0.0, 1.0, "head", 500)
    s = cli.parse_args(["--method", "500x", "--model", "x/y", "--objective", "ae", "--ae-token", "learned"])
    assert s.config.ae_token == "learned"                                     # a flag wins over the recipe
    # PCC code (PIC follows it): AdamW (0.9, 0.999), wd 0, cosine, warmup 300, clip 0.5; QA lr 5e-5, warmup 100
    s = cli.parse_args(["--method", "pic", "--model", "x/y"])
    assert (s.betas, s.weight_decay, s.schedule, s.warmup, s.clip) == ((0.9, 0.999), 0.0, "cosine", 300, 0.5)
    s = cli.parse_args(["--method", "pic", "--model", "x/y", "--objective", "qa"])
    assert (s.lr, s.schedule, s.warmup) == (5e-5, "cosine", 100)
    # AOC's LoRA baseline runs from flags: q, k, v, o, dropout 0.05
    cfg = cli.parse_args(["--method", "500x", "--model", "x/y", "--objective", "ae", "--lora-targets",
                          "q_proj", "k_proj", "v_proj", "o_proj", "--lora-r", "64", "--lora-alpha", "32"]).config
    assert cfg.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj") and cfg.lora_dropout == 0.05
    # CompLLM's teacher answers are long (149-273 tokens on average): 512 by default, recorded with the run
    assert cli.parse_args(["--method", "compllm", "--model", "x/y"]).answer_tokens == 512
    # GMSA §4.1: AE texts of at most 512 tokens (PwC), QA contexts up to 3072
    assert cli.parse_args(["--method", "gmsa", "--model", "x/y"]).max_len == 512
    assert cli.parse_args(["--method", "gmsa", "--model", "x/y", "--objective", "qa"]).max_len == 3072


def test_gmsa_recipe_is_table_3_and_appendix_c():
    """GMSA Table 3 and App. C, number by number, as the run resolves them (paper model, no flags): stage 1
    (autoencoder training) and stage 2 (--stage keft, KEFT), each value marked as the paper's, and the optimizer
    train.py builds. The learning rates are not legible in our copy of Table 3 (presets.py marks them ours)."""
    # GMSA App. C: "For the PwC dataset, we train on the full dataset with 10,000 steps for Autoencoder Training and
    # 5,000 steps for Knowledge Extraction Fine-tuning (KEFT). ... Other parameters are listed in Table 3."
    # Table 3: "Optimizer | AdamW", "Batch Size | 4 (Autoencoder Training) / 16 (KEFT)", "Scheduler | Linear",
    # "Gradient Clip Norm | 2.0"
    paper = {"ae": dict(steps=10000, batch_size=4, schedule="linear", clip=2.0),
             "keft": dict(steps=5000, batch_size=16, schedule="linear", clip=2.0)}
    for stage, values in paper.items():
        settings = cli.recipe_for("gmsa", model="meta-llama/Llama-2-7b-chat-hf", stage=stage)
        assert settings["objective"].value == {"ae": "ae", "keft": "qa"}[stage]
        run = cli.parse_args(["--method", "gmsa", "--model", "meta-llama/Llama-2-7b-chat-hf", "--stage", stage])
        for name, value in values.items():
            assert settings[name] == cli.Setting(value, "paper"), (stage, name)
            assert getattr(run, name) == value, (stage, name)
        # Scheduler Linear: from the peak after warmup down to 0 at the last step
        lr = [train.lr_at(s, run.lr, run.warmup, run.steps, run.schedule) for s in (run.warmup, run.steps - 1)]
        assert lr[0] == run.lr and lr[1] == pytest.approx(run.lr / (run.steps - run.warmup))
    comp = C.build("gmsa", *build_tiny(), lora_r=4, lora_alpha=8)
    opt = train.make_optimizer(comp, 1e-4, (0.9, 0.999), 0.01, None, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW                                                # Optimizer: AdamW


def test_each_run_makes_its_compressor_config_once(tmp_path, run_train, monkeypatch):
    """One resolution (cli.parse_args) takes the flags, the preset, the demo and the paper to the compressor's
    config, and the run builds exactly that one: make_config runs once per run, --plan too."""
    calls, make = [], P.make_config
    monkeypatch.setattr(P, "make_config", lambda *a, **kw: calls.append(a) or make(*a, **kw))
    run_train(["--method", "pic", "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "pic")])
    assert len(calls) == 1
    train.main(["--method", "pcc", "--shape", "llama-3.2-1b", "--plan", "--micro-batch", "1"])
    assert len(calls) == 2


def test_mem_on_tiny_compllm_is_a_fixed_budget_as_documented(device):
    """make_config's rule, on tiny too: --mem without --ratio sets the ratio to 0 (a fixed budget). The demo row's
    ratio 1 is a default, not a typed --ratio: --mem 2 gives 2 slots for an 8-byte text, not one per byte."""
    for argv, slots in ((["--mem", "2"], 2), ([], 8)):
        cfg = cli.parse_args(["--method", "compllm", *argv]).config
        comp = train.build_compressor(cfg, device)
        assert sum(comp.compress([list(b"8 bytes!")]).slots[0]) == slots, argv
    cfg = cli.parse_args(["--method", "compllm", "--mem", "2", "--ratio", "4"]).config   # both typed: the ratio
    assert (cfg.mem, cfg.ratio) == (2, 4.0)


def test_head_crop_min_len_is_an_error_and_evaluate_lm_cuts_at_the_checkpoints_n(finished_run, tmp_path, capsys,
                                                                                device):
    """--min-len under --crop head (tiny's default) has no effect (|X| in [8, 8]), so it is a one-line error unless it
    equals --max-len. evaluate.py --task lm takes the checkpoint's n as its --max-len default, as --help says for
    ae, lm and interpolate (not the whole held-out texts: 58 and 81 tokens)."""
    assert_one_line_error(["--method", "aoc", "--min-len", "4", "--max-len", "8", "--out", str(tmp_path / "x")],
                          "--min-len 4 does not apply", capsys, device)
    assert cli.parse_args(["--method", "aoc", "--min-len", "8", "--max-len", "8"]).min_len == 8
    n = json.loads((Path(finished_run) / "args.json").read_text())["max_len"]
    result = E.main(["--ckpt", finished_run, "--task", "lm", "--n", "3", "--device", str(device),
                     "--out", str(tmp_path / "lm.json")])
    assert [ex["context_tokens"] for ex in result["examples"]] == [n // 2] * 3



@pytest.mark.filterwarnings("ignore:CUDA is not available")   # place() on CUDA builds its (idle) autocast
def test_cuda_graphs_is_refused_where_it_cannot_replay(tmp_path, capsys, device):
    """--cuda-graphs (ours) replays --compile's graphs at the shapes they were recorded at, on CUDA: each way it
    cannot is one line, naming what to change: without --compile; with shapes that vary from step to step (a length
    drawn per text, sentence chunks, several GMSA ratios, a QA objective); on a device other than CUDA. The tiny
    demo's AOC (--crop head, one length) on CUDA is accepted."""
    out = ["--out", str(tmp_path / "x"), "--steps", "1"]
    for flags, message in (
            (["--method", "aoc"], "add --compile"),
            (["--method", "aoc", "--compile", "--crop", "window", "--min-len", "8"], "vary with --crop window"),
            (["--method", "aoc", "--compile", "--objective", "qa"], "vary with the qa objective"),
            (["--method", "compllm", "--compile"], "vary with sentence chunks"),
            (["--method", "gmsa", "--compile", "--ratios", "2", "4"], "ratio drawn per text from (2, 4)")):
        assert_one_line_error([*flags, "--cuda-graphs", *out], message, capsys, device)
    s = cli.parse_args(["--method", "aoc", "--compile", "--cuda-graphs", *out])   # AOC's one shape: accepted
    assert cli.place(s, torch.device("cuda"), 0, 1).cuda_graphs
    if device.type != "cuda":
        assert_one_line_error(["--method", "aoc", "--compile", "--cuda-graphs", *out],
                              f"--cuda-graphs records CUDA graphs, and this run is on {device}", capsys, device)


# ---- what the first log lines and --help say ----


def test_the_first_log_line_names_each_setting_and_its_source(tmp_path, run_train, capsys):
    """Every setting that shapes the run, training and compressor, with where its value comes from: AOC's --mem 16
    and its K/V carrier among them."""
    run_train(["--method", "aoc", "--mem", "16", "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "aoc")])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("settings: objective ae (demo), lr 0.01 (demo), betas 0.9,0.999 (code), ")
    for part in ("steps 1 (flag)", "batch_size 16 (demo)", "max_len 16 (demo)", "schedule linear (demo)",
                 "mem 16 (flag)", "carrier kv (preset)", "encoder full (preset)", "mask causal (default)"):
        assert part in first
    args = json.load(open(tmp_path / "aoc" / "args.json"))
    assert all(f"{k} " in first for k in (*cli.SETTINGS, *cli.COMPRESSOR_FLAGS)) and args["lr"] == 1e-2
    # --resume names the checkpoint as the source of each
    run_train(["--resume", str(tmp_path / "aoc"), "--steps", "2", "--eval-every", "0"])
    again = capsys.readouterr().out.splitlines()[0]
    assert f"mem 16 (--resume {tmp_path / 'aoc'})" in again and f"carrier kv (--resume {tmp_path / 'aoc'})" in again


def test_the_log_and_help_say_where_tiny_changes_the_papers_objective(tmp_path, run_train, capsys):
    run_train(["--method", "icae", "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "icae")])
    demo = capsys.readouterr().out.splitlines()[1]   # one line at the start says what the demo changes
    assert demo.startswith("--model tiny is a CPU demo (ours), not the paper's run: it changes objective ae (the "
                           "paper's pretrain), ") and "max_len 8 (the paper's 2040)" in demo \
        and "mem 16 (the paper's 102)" in demo
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    assert "--model tiny (the default): a CPU demo" in text and "objective ae, crop head" in text
    for method, row in cli.TINY.items():
        assert f"\n  {method:8} {row['lengths'][1]:3} {row['steps']:6}" in text


def test_help_and_the_first_log_line_say_where_the_objective_changes_the_architecture(tmp_path, run_train, capsys):
    """500x's --objective ae is the original 500xCompressor code: it also changes compressor settings. --help and the
    run's first log line name them, so the switch is not hidden in a recipe row."""
    run_train(["--method", "500x", "--objective", "ae", "--mem", "4", "--chunk-len", "16", *LORA, "--steps", "1",
               "--eval-every", "0", "--out", str(tmp_path / "x")])
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("500x: "))
    assert first.startswith("500x: ae objective") and "(--objective ae on 500x also sets: ae_token=bos, " \
        "lm_token=bos, mem_init=normal, bos=False, lora_dropout=0.05, template=plain)" in first   # LORA: flags
    run_train(["--method", "500x", "--objective", "pretrain", "--mem", "4", "--chunk-len", "16", *LORA, "--steps",
               "1", "--eval-every", "0", "--out", str(tmp_path / "y")])
    assert "also sets" not in next(line for line in capsys.readouterr().out.splitlines() if line.startswith("500x: "))
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    assert "--objective ae on 500x also sets: ae_token=bos" in text and "changes compressor settings" in " ".join(
        text.split())


def test_a_chunk_with_more_slots_than_tokens_is_warned(tmp_path, run_train, capsys):
    """ICAE's AE context is [BOS] + the text: 64 tokens at --chunk-len 64 become chunks of 64 and 1, each given
    --mem 16 slots (the papers' code), 2 tokens per slot where 4 were asked. The run's first lines say so, with the
    fix; --chunk-len 65 (one chunk) or --cap-mem (the short chunk gets 1 slot) gives no warning, and the warning
    states what compress does (its slots, counted on a 64-token text). Texts shorter than --mem (AOC, no [BOS]) are
    counted and the longest named."""
    flags = ["--method", "icae", "--mem", "16", "--crop", "window", "--min-len", "64", "--max-len", "64", "--steps",
             "1", "--eval-every", "0"]
    outs = {}
    for name, extra in (("cut", ["--chunk-len", "64"]), ("one", ["--chunk-len", "65"]),
                        ("capped", ["--chunk-len", "64", "--cap-mem"]),
                        ("aoc", ["--method", "aoc", "--chunk-len", "64", "--min-len", "8"])):
        run_train(flags + extra + ["--out", str(tmp_path / name)])
        outs[name] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert outs["one"] == outs["capped"] == []
    assert outs["cut"] == ["warning: 1 of the text lengths 64-64 end in a chunk with more memory slots than tokens: "
                           "a 64-token text and its [BOS] is cut into chunks of 64 + 1 tokens with 32 slots, 2.00 "
                           "text tokens per slot where a full chunk gives 4.00; --cap-mem gives a short chunk as many "
                           "slots as tokens, --chunk-len 65 keeps it one chunk"]
    assert outs["aoc"] == ["warning: 8 of the text lengths 8-64 end in a chunk with more memory slots than tokens: a "
                           "15-token text is one chunk of 15 tokens with 16 slots, 0.94 text tokens per slot where a "
                           "full chunk gives 4.00; --cap-mem gives a short chunk as many slots as tokens"]
    comp = checkpoint.load(str(tmp_path / "cut")).eval()
    assert comp.compress([comp.encoder_ids(list(range(64)))]).slots == [[16, 16]]


def test_help_explains_every_flag_and_shows_the_gpu_command(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    assert "meta-llama/Llama-3.2-1B-Instruct" in text and "--steps 20000" in text
    for method in P.METHODS:
        assert f"\n  {method} " in text                              # the per-method defaults table


# ---- decided in one place, once ----

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {str(p) for p in ROOT.glob("*.py")}   # the top-level modules
# the run's flags (the compressor's are its config's fields: a dict of those is a config, not the flags)
FLAGS = {a.dest for a in cli.build_parser()._actions if a.dest != "help"} - set(cli.COMPRESSOR_FLAGS)
WRITER = "checkpoint.save_checkpoint"   # writes the record (args.json, train_state.pt)


def the_flags(value) -> bool:
    """Does `value` carry the run's flags: a Namespace, or a dict with two flag names or more?"""
    return isinstance(value, argparse.Namespace) or (isinstance(value, dict) and len(FLAGS & set(value)) >= 2)


def carries_flags(value) -> bool:
    """`value` carries the flags, itself or in a field (a dataclass's: a dict kept in an object)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return the_flags(value) or any(the_flags(getattr(value, f.name)) for f in dataclasses.fields(value))
    return the_flags(value)


@contextmanager
def calls_given_the_flags():
    """Every call of a project function below train.main, outside cli.py and the record's writer, that receives the
    flags: the list it yields fills while the block runs."""
    seen = []

    def profile(frame, event, arg):
        # normpath: a module imported by another path to its file (a/../runlog.py) is still the project's
        if event != "call" or os.path.normpath(frame.f_code.co_filename) not in PROJECT:
            return
        name = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"
        if name.startswith("cli.") or name in ("train.main", WRITER):
            return
        info = inspect.getargvalues(frame)
        given = [info.locals[a] for a in info.args if a in info.locals]
        given += list(info.locals.get(info.varargs) or ()) + list((info.locals.get(info.keywords) or {}).values())
        if any(carries_flags(v) for v in given):
            seen.append(name)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


@dataclasses.dataclass
class Holder:
    record: dict


def test_the_checker_sees_the_flags_as_an_argument_and_as_a_field():
    flags = {"eval_data": None, "objective": "ae", "max_len": 16}
    with calls_given_the_flags() as seen:
        P.readonly(args=argparse.Namespace(objective="ae"))
        P.readonly(train_args=flags)
        P.readonly(run=Holder(flags))
        P.readonly(lr=1e-3, row={"step": 1, "lr": 1e-3}, run=Holder({}))   # a log row's one flag name: fine
    assert seen == ["presets.readonly"] * 3


def test_nothing_below_main_receives_the_flags(tmp_path, device):
    """A one-step tiny AOC run, and one with a held-out check every step, stopped and resumed: no project function
    below train.main (cli.py aside) receives the flags; the writer gets the record, which holds the config's fields
    and the resolved recipe."""
    common = ["--method", "aoc", "--mem", "4", "--batch-size", "2", "--device", str(device)]
    with calls_given_the_flags() as seen:
        train.main([*common, "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "plain")])
        out = str(tmp_path / "checked")
        train.main([*common, "--steps", "2", "--stop-after", "1", "--eval-every", "1", "--eval-n", "4", "--out", out])
        train.main(["--resume", out, "--device", str(device)])
    assert not seen, f"these receive the flags: {sorted(set(seen))}"
    record = checkpoint.read_train_state(out)["args"]
    assert (record["mem"], record["carrier"], record["objective"], record["eval_every"]) == (4, "kv", "ae", 1)
