"""Every recipe end to end at SMOKE=1 (the tiny model, the built-in data, 2 steps per arm), so they cannot rot:
each trains its arms, evaluates them and writes results.json and results.md (and its figures, with matplotlib)."""

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERDICTS = ("reproduced", "contradicted", "not visible", "undecided")
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.sh") if p.stem != "common")


def test_every_paper_has_a_recipe():
    assert RECIPES == ["aoc", "compllm", "epl", "gmsa", "ladder", "pic"]


def run_recipe(paper, out, hide_matplotlib, expect_ok=True, **extra_env):
    """bash recipes/PAPER.sh at SMOKE=1 into out; hide_matplotlib puts a matplotlib that raises ImportError
    first on PYTHONPATH (figures are optional: every recipe must run without them). With expect_ok=False, the
    finished process, whatever its exit status."""
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra_env}
    if hide_matplotlib:
        hide = out / "hide"
        (hide / "matplotlib").mkdir(parents=True, exist_ok=True)
        (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))
    p = subprocess.run(["bash", f"recipes/{paper}.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    if not expect_ok:
        return p
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (out / "results.md").read_text().startswith("### ") and "wall time" in p.stdout
    return p, json.loads((out / "results.json").read_text())


# One SMOKE run per recipe (each costs tens of Python start-ups): the checks that need a recipe's run share it. gmsa
# runs with matplotlib and draws its figures; the others run without it (figures are optional); the ladder's run is
# then run again over its records without their weights.
DRAWS_FIGURES = "gmsa"
# each SMOKE test's cost, in seconds at load ~8 on the 2-core machine (`pytest -n 2 --durations`; the ladder's includes
# its two runs over its records; the ladder's, pic's and aoc's scaled down by the CPU time their SMOKE runs measured
# after the ladder kept one preset per carrier, pic 8 held-out texts and aoc its 1:1 length): conftest.py starts
# them first, spread over the pytest-xdist workers by these weights, so that no worker is left to end the suite
# alone on several of them
SMOKE_SECONDS = {"ladder": 340, "aoc": 250, "epl": 215, "pic": 150, "compllm": 175, "gmsa": 140}


@pytest.mark.parametrize("paper", RECIPES)
def test_recipe_runs_end_to_end(paper, tmp_path):
    hidden = paper != DRAWS_FIGURES or importlib.util.find_spec("matplotlib") is None
    p, results = run_recipe(paper, tmp_path, hide_matplotlib=hidden)
    for table in results["tables"]:
        if "verdicts" in table:   # recipes/verdict.py's claim tables: one verdict per metric, each a known word
            assert table["verdicts"] and all(v.startswith(VERDICTS) for v in table["verdicts"].values()), table
            continue
        # every metric is read; only "first step at own/other ..." may be None: the arm never got there (curve.py)
        assert table["arms"] and all(v is not None or name.startswith("first step at")
                                     for arm in table["arms"].values() for name, v in arm.items()), table
        assert all((curve["png"] is None) == hidden for curve in table["curves"].values())
        for arm in table["arms"].values():   # own/other stands beside the tokens per slot it was scored at
            assert "own/other" not in arm or arm["tokens/slot, mean (min-max)"]["mean"] > 0, arm
    if hidden:   # each skipped figure is named on stderr with the fix; a table that had a figure says it was skipped
        assert "matplotlib is not installed (pip install matplotlib" in p.stderr
        if any(table.get("curves") for table in results["tables"]):
            assert "(figure skipped: no matplotlib)" in (tmp_path / "results.md").read_text()
        assert not list(tmp_path.rglob("*.png"))
    else:
        curves = [c for table in results["tables"] for c in table.get("curves", {}).values()]
        # a record names its figure portably (recipes/records.py: beside it, in the results folder)
        assert curves and all((tmp_path / Path(c["png"]).name).is_file() for c in curves)
        assert (tmp_path / "curve.png").is_file()        # own/other along the runs (recipes/curve.py)
    if paper == "ladder":   # at SMOKE the lever arms train two at a time (JOBS), one of them under two levers
        args = json.loads((tmp_path / "aoc_memlr+curriculum_1x" / "args.json").read_text())
        assert args["mem_lr"] == 1e-3 and args["len_curriculum"]
        assert (tmp_path / "aoc_memlr+curriculum_1x.out").is_file()
        assert "aoc_memlr+curriculum_1x" in results["tables"][0]["arms"]
        continues_from_a_record_without_weights(tmp_path)
    if paper == "pic":   # at SMOKE PCC carries nothing at 1x, so the probe stops there, and neither memory carries
        assert "PCC at 1x" in p.stdout and not list(tmp_path.glob("*_r4_*")) and not list(tmp_path.glob("*_r16_*"))
        assert "neither memory carries its text at 1x" in p.stdout   # so seed 1 of the default SEEDS is not run
        assert (tmp_path / "pic_r1_s0_qa").is_dir() and not list(tmp_path.glob("*_s1*"))
        assert "pcc_r1_s0" in results["tables"][0]["arms"]
    if paper == "compllm":   # the reuse check compares two questions per context, compressed once against anew
        reuse, fresh = (json.loads((tmp_path / "compllm_s0" / f"eval_{k}.json").read_text())
                        for k in ("reuse", "fresh"))
        assert reuse["concat"] == fresh["concat"] == 2 and reuse["reuse"] and not fresh["reuse"]
        assert results["tables"][0]["arms"]["compllm_s0"]["cached CEs: same answers"] is True
        # at SMOKE the CEs do not beat no context, so seed 1 of the default SEEDS is not run
        assert "the CEs do not beat no context" in p.stdout and not (tmp_path / "compllm_s1").exists()
        assert list(results["tables"][0]["arms"]) == ["compllm_s0"]


def continues_from_a_record_without_weights(out):
    """recipes/results keeps what a run measured, not its weights: a recipe run again over such a record trains
    nothing, reads every score from it and writes the same results; a record of an unfinished run stops it.
    (On the ladder's SMOKE run, in `out`.)"""
    results = (out / "results.md").read_text()
    log = (out / "icae_1x" / "log.jsonl").read_text()
    weights = [*out.rglob("*.safetensors"), *out.rglob("*.pt")]
    assert weights
    for path in weights:
        path.unlink()
    again, _ = run_recipe("ladder", out, hide_matplotlib=True)
    assert "icae_1x: trained to step 2 (its record is kept" in again.stdout and "python train.py" not in again.stdout
    assert (out / "results.md").read_text() == results and (out / "icae_1x" / "log.jsonl").read_text() == log
    rows = log.splitlines()
    kept = [r for r in rows if json.loads(r)["step"] <= 1]   # as if the machine had stopped after step 1
    (out / "icae_1x" / "log.jsonl").write_text("\n".join(kept) + "\n")
    p = run_recipe("ladder", out, hide_matplotlib=True, expect_ok=False)
    assert p.returncode == 1 and "stopped at step 1 of 2, without its weights: remove the folder" in p.stderr


def test_held_out_questions_are_answered_in_their_paragraphs():
    """recipes/qa_heldout.jsonl: hand-written questions about held-out paragraphs, each answer copied from its
    context (so the full-context row can answer and the no-context row cannot guess)."""
    rows = [json.loads(line) for line in (REPO / "recipes" / "qa_heldout.jsonl").read_text().splitlines() if line]
    assert len(rows) == 60 and len({r["question"] for r in rows}) == 60
    for r in rows:
        assert r["answer"].strip() and r["answer"] in r["context"], r["question"]



# ---- the three READMEs: every relative link and image points at a file (and heading) that exists ----
READMES = ("README.md", "recipes/README.md", "tests/README.md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set:
    """Every heading anchor of a markdown file (GitHub numbers repeats: x, x-1, x-2, ...)."""
    seen, out = {}, set()
    for line in re.sub(r"```.*?```", "", md.read_text(), flags=re.S).splitlines():
        if re.match(r"#{1,6} ", line):
            s = slug(line.lstrip("#"))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_corpus_passages_join_a_files_paragraphs_to_the_word_count():
    """corpus.py --min-words (the 8x corpus): consecutive paragraphs joined, in order and whole, until a passage
    has min_words; a short remainder joins the last passage; a file of one short paragraph stays one passage."""
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import corpus
    paras = [" ".join(f"p{i}w{j}" for j in range(n)) for i, n in enumerate((50, 70, 130, 40, 30, 50))]
    out = corpus.passages(paras, 110)
    assert out == [" ".join(paras[:2]), paras[2], " ".join(paras[3:])]   # 120, 130, 120 words
    assert all(len(p.split()) >= 110 for p in out[:-1])
    out = corpus.passages(paras[:5], 110)   # 40 + 30 = 70 left: joins the 130-word one before it
    assert out == [" ".join(paras[:2]), " ".join(paras[2:5])]
    assert corpus.passages(paras[3:4], 110) == [paras[3]] and corpus.passages([], 110) == []


@pytest.mark.parametrize("readme", READMES)
def test_every_relative_link_in_the_readmes_resolves(readme):
    md = REPO / readme
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)      # commands in code blocks are not links
    links = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    assert links, f"{readme} has no links: the pattern broke"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):                                 # http(s), mailto: not ours to check
            continue
        path, _, anchor = link.partition("#")
        target = (md.parent / path).resolve() if path else md
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, f"{readme}: links to nothing: {broken}"


def test_curve_scores_texts_cut_as_the_arm_was_trained(tmp_path):
    """recipes/curve.py's own/other at a checkpoint is the recipe's evaluation of it (`evaluate.py --max-len` the
    arm's length): a window-cropped arm trained on 8-token texts is scored on 8-token texts, not on whole ones."""
    import sys
    import checkpoint
    import evaluate as E
    import train
    sys.path.insert(0, str(REPO / "recipes"))
    import curve
    out = tmp_path / "arm"
    train.main(["--method", "500x", "--objective", "ae", "--model", "tiny", "--mem", "4", "--chunk-len", "8",
                "--crop", "window", "--min-len", "8", "--max-len", "8", "--batch-size", "2", "--steps", "2",
                "--save-every", "2", "--keep-every", "2", "--out", str(out)])
    comp = checkpoint.load(str(out)).eval()
    examples = E.load_examples(None, "ae")[:4]
    assert all(len(comp.tok.encode(ex["text"])) > 8 for ex in examples)   # the cut matters
    point = curve.score(str(out / "ckpt-000002"), None, 4)   # the built-in held-out set, its first 4 texts
    want = E.run_ae(comp, examples, max_new_tokens=1, proto=E.trained_protocol(str(out), max_len=8))["loss"]
    assert (point["own"], point["other"], point["none"]) == pytest.approx((want["own"], want["other"], want["none"]))


def test_curve_finds_the_steps_to_each_panels_own_reference_loss(tmp_path):
    """recipes/curve.py --loss-ref: each arm's first step at the final training loss of the reference arms in its own
    panel (a rung), not at the mean over every panel's references (EPL §4: the steps each layout needs to reach DPL's
    final loss, at each rung); with several reference runs (seeds), the highest of their final losses, which every
    one of them reaches (their mean, the worse seed would never reach)."""
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import curve
    def run(name, losses):   # a run's training log only (no checkpoints: nothing to score)
        (tmp_path / name).mkdir()
        (tmp_path / name / "log.jsonl").write_text(
            "".join(json.dumps(dict(step=i + 1, loss=x, dt=1.0)) + "\n" for i, x in enumerate(losses)))
    run("dpl_1x", [3.0] * 40)                     # the 1:1 panel's references end at 3.0 and 2.6
    run("dpl_1x_s1", [5.0] * 10 + [2.6] * 30)     # at or below 3.0 from step 27 (smoothed over its last 20 steps)
    run("epl_1x", [4.0] * 10 + [2.0] * 30)        # there from step 11
    run("dpl_4x", [1.0] * 40)                     # the 4x panel's reference ends at 1.0
    run("epl_4x", [4.0] * 10 + [1.5] * 30)        # never there (the mean of both references, 2.0, it reaches)
    curve.main(["--out", str(tmp_path), "--score-only", "--group", "1:1", "dpl_1x", "dpl_1x_s1", "epl_1x",
                "--group", "4x", "dpl_4x", "epl_4x", "--loss-ref", "dpl_1x", "dpl_1x_s1", "dpl_4x"])
    got = {arm: json.loads((tmp_path / arm / "eval_curve.json").read_text())
           for arm in ("dpl_1x", "dpl_1x_s1", "epl_1x", "epl_4x")}
    # smoothed over 20 steps: epl_1x's mean falls to 3.0 once 10 of its last 20 steps are 2.0 (step 20)
    assert (got["epl_1x"]["loss_at"], got["epl_1x"]["first_at_loss"]) == (3.0, 20)
    # both references get there (the mean of their finals, 2.8, dpl_1x would never reach)
    assert (got["dpl_1x"]["first_at_loss"], got["dpl_1x_s1"]["first_at_loss"]) == (1, 27)
    assert (got["epl_4x"]["loss_at"], got["epl_4x"]["first_at_loss"]) == (1.0, None)
    with pytest.raises(SystemExit):   # a reference outside every panel is a mistake, not silently ignored
        curve.main(["--out", str(tmp_path), "--score-only", "--group", "1:1", "epl_1x", "--loss-ref", "dpl_9x"])


def test_loss_curves_report_when_each_run_reaches_a_loss(tmp_path):
    """recipes/curve.py's loss_curves (recipes/summarize.py --curves): each run's first step at a training loss, with
    the one smoothing every steps-to-a-loss reads (smoothed_losses: the mean of the last 20 logged steps); evaluate.py
    has no curves of its own."""
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import curve
    import evaluate as E
    for name, losses in (("fast", [5, 3, 2, 1.5, 1.2]), ("slow", [5, 4.5, 4, 3.5, 3])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "log.jsonl").write_text("".join(json.dumps(dict(step=i + 1, loss=x, tokens=100, dt=0.5))
                                                           + "\n" for i, x in enumerate(losses)))
    result = curve.loss_curves([str(tmp_path / "fast"), str(tmp_path / "slow")], target=3.4)
    fast, slow = result["runs"]
    assert fast["reached"] == 3 and slow["reached"] is None     # fast: (5 + 3 + 2) / 3 <= 3.4 at step 3
    assert (fast["final"], slow["best"]) == (pytest.approx(12.7 / 5), pytest.approx(4.0))
    default = curve.loss_curves([str(tmp_path / "fast"), str(tmp_path / "slow")])   # a loss every run reaches
    assert default["target"] == pytest.approx(4.0) and [r["reached"] for r in default["runs"]] == [2, 5]
    assert "curves" not in E.TASKS and not hasattr(E, "run_curves")


def test_diagnosis_splits_the_own_loss_at_the_first_token():
    """recipes/diagnosis.py's own-memory AE loss on the first token is the decoder's loss on that token alone (the
    decoder is causal: the text after it cannot change it), and the rest is the loss on the other tokens and EOS."""
    import sys
    import torch
    import compressors as C
    sys.path.insert(0, str(REPO / "recipes"))
    import diagnosis
    torch.manual_seed(0)
    from model import build_tiny
    comp = C.build("gmsa", *build_tiny(), ratio=1).eval()     # merging at 1:1: one slot per token
    xs = [comp.tok.encode(t)[:8] for t in ("The quick brown fox jumps over the lazy dog.",
                                            "A second text about something else entirely, longer.")]
    d = diagnosis.measure(comp, xs)
    memory = comp.compress([comp.encoder_ids(x) for x in xs])
    lead = len(comp.target_bos)   # GMSA reconstructs [BOS] x [EOS]; the loss starts at x's first token
    sums, counts = comp.nll(memory, "ae", [comp.ae_target(x)[:lead + 1] for x in xs], [1, 1])
    assert counts == [1, 1]
    assert d["loss_own_first"] == pytest.approx(sum(sums) / 2, rel=1e-4)
    n = len(xs[0]) + 1
    assert (d["loss_own_first"] * 2 + d["loss_own_rest"] * 2 * (n - 1)) / (2 * n) == \
        pytest.approx(d["loss_own"], rel=1e-4)


def test_diagnosis_says_when_no_held_out_text_is_long_enough(tmp_path):
    """Too few texts of the measured length stop with one line that names the fix (not an IndexError deep in
    compress([])), and --len measures on shorter texts."""
    import sys
    import checkpoint
    import compressors as C
    sys.path.insert(0, str(REPO / "recipes"))
    import diagnosis
    from model import build_tiny
    checkpoint.save(C.build("500x", *build_tiny(), mem=4, chunk_len=64, lora_r=2, lora_alpha=4), str(tmp_path))
    texts = ["A short one.", "Another short text.", "And a third."]         # 12-19 byte tokens, under the 64 asked
    with pytest.raises(SystemExit, match=r"0 held-out text\(s\) of 64 tokens or more, 2 needed: pass --data"):
        diagnosis.diagnose(str(tmp_path), texts, 8, length=64)
    row = diagnosis.diagnose(str(tmp_path), texts, 8, length=10)
    assert row["n"] == 10 and row["texts"] == 3
    # the kept diagnosis.json answers only for its own length: the default (the run's --max-len, 16 here) measures
    with pytest.raises(SystemExit, match=r"1 held-out text\(s\) of 16 tokens or more"):
        diagnosis.diagnose(str(tmp_path), texts, 8)


def test_curve_reads_the_checks_the_arm_logged_while_it_trained(tmp_path, monkeypatch):
    """recipes/curve.py draws the held-out checks of the arm's log.jsonl (train.py --eval-every) and reloads nothing;
    an --n other than the one the arm was checked on stops with one line."""
    import sys
    import runlog
    import train
    sys.path.insert(0, str(REPO / "recipes"))
    import curve
    out = tmp_path / "arm"
    train.main(["--method", "aoc", "--model", "tiny", "--mem", "4", "--max-len", "8", "--batch-size", "2",
                "--steps", "4", "--eval-every", "2", "--eval-n", "6", "--out", str(out)])
    monkeypatch.setattr(curve, "score", lambda *a: pytest.fail("a logged arm was scored again"))
    c = curve.arm_curve(str(out), None, 6, threshold=0.5)
    logged = runlog.read_log(str(out))[1]
    assert [p["step"] for p in c["points"]] == [0, 2, 4]
    assert [p["ratio"] for p in c["points"]] == [r["eval"]["own_other"] for r in logged]
    with pytest.raises(SystemExit, match="checked 6 held-out texts while it trained \\(--eval-n 6\\), not --n 5"):
        curve.arm_curve(str(out), None, 5, threshold=0.5)


def test_capacity_optimizes_each_texts_own_memory(tmp_path):
    """diagnosis.py --capacity: each text's memory, a free tensor, learns to regenerate its own text through the
    frozen decoder (the loss falls, and the optimized memories are no longer interchangeable: own/other < 1), for
    both carriers; memories left as the encoder made them would keep the loss where it starts."""
    import sys
    import checkpoint
    import compressors as C
    sys.path.insert(0, str(REPO / "recipes"))
    import diagnosis
    from model import build_tiny
    texts = [t for t in __import__("data").unseen_texts(6)]
    for method in ("500x", "icae"):
        run = tmp_path / method
        checkpoint.save(C.build(method, *build_tiny(), mem=16, chunk_len=17, lora_r=2, lora_alpha=4), str(run))
        r = diagnosis.capacity(str(run), texts, 4, 16, steps=60, every=30)
        assert [c["step"] for c in r["curve"]] == [0, 30, 60] and r["texts"] == 4
        assert r["curve"][-1]["loss"] < 0.8 * r["curve"][0]["loss"] and r["own_other"] < 0.9, (method, r)


def test_lever_table_names_the_lever_that_carries_at_a_measured_4x(tmp_path):
    """recipes/levers.py: an arm's cell is its final own/other, the first check at or below 0.5 and the tokens per
    slot it was scored at (from its eval_ae.json's examples); the last column lists exactly the levers whose 4x arm
    ends at or below 0.5 at a measured 4x (mean >= 3.9 tokens per slot, no text under 3.5), and says what
    the others that carry on the 4x rung were scored at (the lora baseline's folder counts as 500x + lora)."""
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import levers

    def arm(name, ratios, final, lengths=None, slots=16):
        d = tmp_path / name
        d.mkdir()
        (d / "args.json").write_text("{}")
        points = [dict(step=50 * (i + 1), own=1.0, other=1.0, none=1.0, ratio=r) for i, r in enumerate(ratios)]
        (d / "eval_curve.json").write_text(json.dumps({"points": points}))
        ae = {"loss": {"own_other_ratio": final}}
        if lengths:   # a record kept before eval_ae.json had "tokens_per_slot": measured from its examples
            ae["examples"] = [dict(reference_ids=[7] * n, memory_slots=slots) for n in lengths]
        (d / "eval_ae.json").write_text(json.dumps(ae))

    arm("500x_4x", [0.9, 0.8], 0.78)                         # no examples: no ratio in its cell
    arm("lora_4x", [0.7, 0.45, 0.3], 0.26, [64, 64, 47])    # carries at 3.65 (2.94-4.00): the ladder's "4x"
    arm("icae_1x", [1.0, 0.99], 0.99, [16, 16])
    arm("icae_epl_1x", [0.9, 0.6, 0.52], 0.51, [16, 16])    # 0.51 > 0.5: does not carry
    arm("icae_epl_4x", [0.9, 0.5], 0.5, [64, 64])           # at the threshold, at 4.00: carries, first at step 100
    arm("pcc_long+batch16_4x", [0.8, 0.4], 0.4, [64] * 9 + [55])   # mean 3.94 but one text at 3.44 (< 3.5)
    arm("pcc_epl_4x", [0.8, 0.3], 0.3, [62, 62])            # none under 3.5 but a mean of 3.88 (< 3.9)
    levers.main(["--out", str(tmp_path)])
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in (tmp_path / "levers.md").read_text().splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows[("500x", "lora")][1] == "**0.260 (step 100, 150 steps)** at 3.65 (2.94-4.00)"
    assert rows[("500x", "none")] == ["-", "0.780 (never <= 0.5, 100 steps)",
                                      "none; lora carries at 3.65 (2.94-4.00), not a measured 4x"]
    assert rows[("icae", "epl")][0] == "0.510 (never <= 0.5, 150 steps) at 1.00"
    assert rows[("icae", "none")] == ["0.990 (never <= 0.5, 100 steps) at 1.00", "-", "epl"]
    assert rows[("icae", "epl")][1] == "**0.500 (step 100, 100 steps)** at 4.00"
    assert rows[("pcc", "epl")] == ["-", "**0.300 (step 100, 100 steps)** at 3.88",
                                    "none; epl carries at 3.88, not a measured 4x; "
                                    "long+batch16 carries at 3.94 (3.44-4.00), not a measured 4x"]
    assert rows[("pcc", "long+batch16")][1] == "**0.400 (step 100, 100 steps)** at 3.94 (3.44-4.00)"
    assert ("pcc", "none") not in rows   # no arm, no row
    kept = json.loads((tmp_path / "levers.json").read_text())
    assert list(k for k in kept if k.startswith("pcc:")) == ["pcc:epl@4x", "pcc:long+batch16@4x"]
    assert kept["500x:lora@4x"]["first"] == 100 and kept["500x:lora@4x"]["tokens_per_slot"]["min"] == 47 / 16


def test_records_name_a_local_model_folder_without_its_path(tmp_path):
    """A recipe run on a local Hugging Face folder names it by its own name in results.md, not by a path that only
    exists on the machine that ran it (common.sh's MODEL_NAME, which every recipe's --note uses)."""
    folder = tmp_path / "machine" / "local" / "smollm2-135m"
    folder.mkdir(parents=True)
    got = subprocess.run(["bash", "-c", 'PAPER=t; source recipes/common.sh; echo "$MODEL_NAME"'], cwd=REPO,
                         env={**os.environ, "MODEL": str(folder), "HELD": "x.jsonl", "OUT": str(tmp_path / "out")},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == "a local folder, smollm2-135m"
    hub = subprocess.run(["bash", "-c", 'PAPER=t; source recipes/common.sh; echo "$MODEL_NAME"'], cwd=REPO,
                         env={**os.environ, "MODEL": "HuggingFaceTB/SmolLM2-135M-Instruct", "HELD": "x.jsonl",
                              "OUT": str(tmp_path / "out")}, capture_output=True, text=True, check=True).stdout.strip()
    assert hub == "HuggingFaceTB/SmolLM2-135M-Instruct"
    scripts = [p for p in (REPO / "recipes").glob("*.sh") if "--note" in p.read_text()]
    assert scripts and not any('--note "model $MODEL"' in p.read_text() or '--note "model $MODEL;' in p.read_text()
                               for p in scripts)


MACHINE_PATH = re.compile(r"(^|[\s'\"(=:])/(root|work|tmp|home|Users|mnt|scratch)/")


def test_no_rendered_record_names_a_machine_local_path(tmp_path):
    """Every rendered record (results.md, eval_*.md, every .md under recipes/results and the READMEs) and every
    results.json note is free of machine-local paths: evaluate.py prints the file it wrote relative to where it
    ran. The check itself must catch one."""
    rendered = [*(REPO / "recipes" / "results").rglob("*.md"), REPO / "README.md", REPO / "recipes" / "README.md"]
    notes = [(p, str(t.get("note", ""))) for p in (REPO / "recipes" / "results").rglob("results.json")
             for t in json.loads(p.read_text()).get("tables", [])]
    found = [f"{p}: {m.group(0)!r}" for p in rendered for m in [MACHINE_PATH.search(p.read_text())] if m]
    found += [f"{p}: note {n!r}" for p, n in notes if MACHINE_PATH.search(n)]
    assert not found, found
    assert MACHINE_PATH.search("wrote /work/main/recipes/results/x/eval_ae.json")   # the pattern does catch one
    import evaluate as E
    out = tmp_path / "eval_ae.json"
    assert E.shown_path(str(out.resolve()), cwd=str(tmp_path)) == "eval_ae.json"


def test_no_json_record_names_a_machine_local_path(tmp_path):
    """A JSON record names no path of the machine that ran it (args.json's data/out/init, a model in ~/.cache,
    eval_ae.json's checkpoint): no value of a JSON record under recipes/results is an absolute path, and none
    names one inside it, except the held-out texts the corpus itself wrote (a record's "examples"). records.py makes
    a record so: relative to the repository, or a local folder by its own name; only whole values change."""
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import records as R
    local = re.compile(MACHINE_PATH.pattern + r"|~/\.cache")

    def found(obj, key=None):
        if key == "examples":   # the scored texts: the Python docs' own words ("... /tmp/myapp.log ...")
            return []
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in found(v, k)]
        if isinstance(obj, list):
            return [p for v in obj for p in found(v, key)]
        return [obj] if isinstance(obj, str) and (R.LOCAL.fullmatch(obj) or local.search(obj)) else []
    bad = {str(p.relative_to(REPO)): f[:2] for p in (REPO / "recipes" / "results").rglob("*.json")
           if (f := found(json.loads(p.read_text())))}
    assert not bad, f"{len(bad)} record(s) name machine-local paths (python recipes/records.py FOLDER): {bad}"
    # the Markdown records too (evaluate.py's "wrote PATH" line, a results table's notes)
    md = [f"{p.relative_to(REPO)}: {line.strip()[:80]}" for p in (REPO / "recipes" / "results").rglob("*.md")
          for line in p.read_text().splitlines() if local.search(line)]
    assert not md, md
    assert found({"a": ["~/.cache/ctxcomp/smollm2"]}) and found({"note": "model /root/x"})   # the check catches one
    assert R.portable(str(REPO / "runs" / "corpus" / "train.jsonl")) == "runs/corpus/train.jsonl"
    assert R.portable("/elsewhere/ctxcomp-copy/runs/recipes/pic/pcc_r1_s0") == "runs/recipes/pic/pcc_r1_s0"
    assert R.portable("/root/.cache/ctxcomp/smollm2-135m") == "smollm2-135m" and R.portable("~/m/") == "m"
    assert R.portable("see /tmp/app.log") == "see /tmp/app.log" and R.portable(0.5) == 0.5
    record = tmp_path / "args.json"   # rewritten in place: the layout kept, only whole path values changed
    text = json.dumps({"data": str(REPO / "runs" / "c.jsonl"), "model": "/tmp/smollm2", "lr": 1e-4,
                       "text": "logs go to /tmp/smollm2 here"}, indent=2)
    record.write_text(text)
    R.main([str(tmp_path)])
    assert record.read_text() == text.replace(json.dumps(str(REPO / "runs" / "c.jsonl")), '"runs/c.jsonl"').replace(
        '"/tmp/smollm2"', '"smollm2"')


def markdown_table(text, header_start):
    """The rows (lists of cells) of the markdown table in text whose header line starts with header_start."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


RATIO = re.compile(r"\b\d+\.\d\d(?!\d)(?: \(\d+\.\d\d-\d+\.\d\d)?")   # tokens per slot: "3.79 (2.94-4.00)", "1.00"


def test_the_readmes_tables_show_the_measured_tokens_per_slot():
    """Every held-out own/other a README's table states stands beside the tokens per memory slot it
    was scored at (a column of them, or each group of the cell led by its own), and its record (tests/test_records.py
    checks the numbers); recipes/README.md's verdict table states the papers' numbers, our setups and verdicts, none of
    ours; its lever table is recipes/levers.py's (each cell with its tokens per slot, and the rule of a measured 4x)."""
    import test_records as T
    for readme in ("README.md", "recipes/README.md"):
        shown = [(line, header) for line, header, _, _ in T.tables((REPO / readme).read_text())
                 if any("held-out own/other" in c for c in header)]
        assert shown, readme
        for line, header in shown:
            assert any(c.startswith("tokens per slot") for c in header), (readme, line[:80])
            assert "records" in header or line.startswith(tuple(T.NOT_RESULTS)), (readme, line[:80])   # the tiny demo
    text = (REPO / "recipes" / "README.md").read_text()
    header = markdown_table(text, "| claim | the paper's number |")[0]
    assert header == ["claim", "the paper's number", "our setup", "verdict"]
    kept = (REPO / "recipes" / "results" / "ladder" / "levers.md").read_text().split("\n\n")[0]
    header, *rows = markdown_table(text, "| preset | lever |")
    assert markdown_table(kept, "| preset | lever |") == [header, *rows]   # the table as the record renders it
    assert "tokens per slot" in header[2] and "measured 4x" in header[4]
    cells = [c for row in rows for c in row[2:4] if c != "-"]
    assert cells and all(re.search(r"\d\.\d{3} \(.*\)\**( at " + RATIO.pattern + ")", c) for c in cells), cells


def ladder_shell(snippet):
    """Run snippet after the ladder's own lever functions and rung table (cut out of recipes/ladder.sh, so the test
    reads the script as it is, not a copy); returns the finished process."""
    text = (REPO / "recipes" / "ladder.sh").read_text()
    funcs = [re.search(rf"^{f}\(\) \{{.*?^\}}", text, re.S | re.M).group(0)
             for f in ("lever_flag", "lever_flags", "lever_name", "arm_name")]
    kept = re.search(r'^KEPT_NAMES=".*?"$', text, re.S | re.M).group(0)
    rungs = re.search(r"^  (case \$rung in .*? esac)$", text, re.M).group(1)
    script = "\n".join([*funcs, kept]) + \
        f"\nrung_of() {{ local rung=$1; {rungs}; echo $n $r; }}\nSTEPS=300\n{snippet}\n"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True)


def test_ladder_levers_stack_and_the_8x_rung():
    """The ladder's levers and rungs: lr=X replaces the preset's learning rate, a stacked arm keeps every lever's name
    with its value, and the 8x rung compresses 128 tokens into the rung's 16 slots."""
    flags, name, r8, r4 = ladder_shell("echo $(lever_flags kv+ae=bos+ratio=5+lr=5e-4+long 64); "
                                       "lever_name kv+ae=bos+ratio=5+lr=5e-4+long; rung_of 8x; rung_of 4x"
                                       ).stdout.split("\n")[:4]
    assert flags == ("--carrier kv --bridge none --no-delimiters --ae-token bos --ratio 5 --lr 5e-4 --steps 1500")
    assert name == "kv+aebos+ratio5+lr5e-4+long"
    assert (r8, r4) == ("128 8", "64 4")
    bad = ladder_shell("rung_of 2x")
    assert bad.returncode == 2 and "unknown rung 2x (1x, 4x or 8x)" in bad.stdout


def test_ladder_levers_against_the_collapse():
    """The levers (ours) against the embedding carrier's collapse: ownother is --own-other-weight 1, ownother=W its
    weight W (in the arm's name), memfromtext --mem-from-text; they stack like the others."""
    got = ladder_shell("echo $(lever_flags ownother 64); echo $(lever_flags ownother=0.5+memfromtext 64); "
                       "lever_name ownother=0.5+memfromtext").stdout.split("\n")[:3]
    assert got == ["--own-other-weight 1", "--own-other-weight 0.5 --mem-from-text", "ownother0.5+memfromtext"]


def test_ladder_arms_that_differ_only_in_a_value_train_in_their_own_folders(tmp_path):
    """`LEVERS="aoc:lr=1e-2 aoc:lr=1e-5"` trains two folders: every valued lever keeps its value in the name (a name
    without it would send the second arm to the first one's run); the folders KEPT_NAMES lists keep their names where
    OUT holds them, each under the one value it was trained with."""
    pairs = [("lr=1e-2", "lr=1e-5"), ("ratio=4", "ratio=5"), ("warm=500x_1x", "warm=lora_1x"), ("ae=bos", "ae=eos"),
             ("kv+ae=bos+ratio=5", "kv+ae=bos+ratio=4")]
    got = ladder_shell("; ".join(f"lever_name {a}; lever_name {b}" for a, b in pairs)).stdout.split()
    assert got == ["lr1e-2", "lr1e-5", "ratio4", "ratio5", "warm500x_1x", "warmlora_1x", "aebos", "aeeos",
                   "kv+aebos+ratio5", "kv+aebos+ratio4"]
    (tmp_path / "compllm_kv+ae+ratio+lr+long_4x").mkdir()   # a kept name: its folder's name lacks the values
    names = ladder_shell(f"OUT={tmp_path}; arm_name compllm_kv+aebos+ratio5+lr5e-4+long_4x; "
                         "arm_name compllm_kv+aebos+ratio5+lr1e-3+long_4x; arm_name aoc_lr1e-5_1x; "
                         "arm_name compllm_kv+aebos+ratio5+long+batch16_4x").stdout.split()
    assert names == ["compllm_kv+ae+ratio+lr+long_4x", "compllm_kv+aebos+ratio5+lr1e-3+long_4x", "aoc_lr1e-5_1x",
                     "compllm_kv+aebos+ratio5+long+batch16_4x"]   # the last: no kept folder in OUT, its valued name
    # the kept names are the arms recipes/results/ladder holds, each with the value its args.json says it had
    ladder = REPO / "recipes" / "results" / "ladder"
    kept = dict(k.split("=") for k in re.search(r'^KEPT_NAMES="(.*?)"$', (REPO / "recipes" / "ladder.sh").read_text(),
                                                 re.S | re.M).group(1).split())
    args = {old: json.loads((ladder / old / "args.json").read_text()) for old in kept.values()}
    assert args["compllm_kv+ae_1x"]["ae_token"] == "bos"
    assert args["compllm_kv+ae+ratio+lr+long_4x"]["lr"] == 5e-4 and args["compllm_kv+ae+ratio+lr+long_4x"]["ratio"] == 5
    assert args["compllm_kv+ae+ratio+long+batch16_4x"]["ratio"] == 5
    assert args["gmsa_warm_4x"]["warm_start"].endswith("ladder/gmsa_1x")
    # recipes/levers.py reads a valued name back as its preset, lever and rung
    import sys
    sys.path.insert(0, str(REPO / "recipes"))
    import levers
    for name in ("aoc_lr1e-5_1x", "aoc_lr1e-2_1x", "gmsa_warmgmsa_1x_4x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "args.json").write_text("{}")
    assert set(levers.collect(str(tmp_path), [], 0.5)) == {
        ("aoc", "lr1e-5", "1x"), ("aoc", "lr1e-2", "1x"), ("gmsa", "warmgmsa_1x", "4x")}


def test_ladder_arms_set_but_empty_run_none():
    """ARMS="" and DIAG_ARMS="" mean no preset arm and no diagnostic arm (the lever arms alone), not the defaults:
    the defaults would train every preset and ICAE's diagnostic arm before the levers asked for."""
    text = (REPO / "recipes" / "ladder.sh").read_text()
    defaults = "\n".join(line for line in text.splitlines() if line.startswith(("ARMS=", "DIAG_ARMS=")))
    shell = lambda env: subprocess.run(["bash", "-c", f'{defaults}\necho "[$ARMS] [$DIAG_ARMS]"'], text=True,
                                       capture_output=True, env={"PATH": os.environ["PATH"], **env}).stdout.strip()
    assert shell({"ARMS": "", "DIAG_ARMS": ""}) == "[] []"
    assert shell({}) == "[icae 500x lora pcc pic compllm gmsa aoc] [icae_norm]"
