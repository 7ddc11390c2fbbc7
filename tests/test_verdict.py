"""recipes/verdict.py, the judge of the papers' claims: its rules one by one (decide), and, on fake runs written as
train.py and evaluate.py write them (args.json, log.jsonl, compressor.json, eval_TASK.json with its per-example
rows), each way a verdict could be drawn from what cannot carry one: one run in both arms, an arm whose runs differ
in more than the seed, a score of an earlier checkpoint, a missing score read as "does not carry", and a gap inside
the per-example noise (1-2 right answers of 60). Also that evaluate.py records the step of the checkpoint it scored.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import verdict as V  # noqa: E402
import evaluate as E  # noqa: E402  (verdict's summarize put the repository root on the path)
import metrics as M  # noqa: E402

# 60 held-out questions, as recipes/qa_heldout.jsonl holds; the fake runs answer some of them right
QUESTIONS = [(f"Paragraph {i} says the key is k{i}.", f"What key does paragraph {i} give?", f"k{i}") for i in range(60)]


def qa_record(right=(), own_other=0.25, step=300):
    """eval_qa.json as evaluate.py writes it (its header, summarize, memory_losses) for a run that answers the
    questions numbered in `right` and no other; own_other: its answers' own/other loss ratio; step: the step of the
    checkpoint scored (None: a record without the key)."""
    rows = []
    for i, (context, question, answer) in enumerate(QUESTIONS):
        said = {"compressed": answer if i in right else "no idea", "full": answer, "none": "no idea"}
        rows.append({"context": context, "question": question, "answer": answer, "memory_slots": 4,
                     "loss": {"own": [4.0 * own_other, 2], "other": [4.0, 2], "none": [5.0, 2], "full": [1.0, 2]},
                     **{m: {"text": said[m], "scores": M.qa_scores(said[m], answer)} for m in E.MODES}})
    head = {"task": "qa", "checkpoint": "RUN", "config": {"method": "pic"}, "ratio": None, "device": "cpu",
            "accelerator": "cpu", "dtype": "float32"}
    if step is not None:
        head["step"] = step
    return {**head, **E.summarize(rows, {"max_new_tokens": 8, "concat": 1, "reuse": True, **E.memory_losses(rows)})}


def fake_run(root, name, seed, right=(), own_other=0.25, step=300, final=300, args=None, config=None, curve="no file"):
    """A finished run's folder as train.py leaves it (args.json, log.jsonl to step `final`, compressor.json) with its
    eval_qa.json (qa_record) and eval_curve.json's first step at own/other 0.5 (curve.py's; None: never), if any."""
    run = root / name
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"method": "pic", "objective": "qa", "seed": seed, "steps": final,
                                               "lr": 1e-4, "init": f"/elsewhere/pre_s{seed}", "out": f"/x/{name}",
                                               "resume": None, **(args or {})}))
    rows = [{"step": s, "loss": 1.0, "lr": 1e-4} for s in (final // 2, final)] + [{"step": final, "eval": {}}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "compressor.json").write_text(json.dumps({"config": {"method": "pic", "mem": 16, **(config or {})},
                                                     "trained_parameters": 100, "step": final}))
    (run / "eval_qa.json").write_text(json.dumps(qa_record(right, own_other, step)))
    if curve != "no file":   # None: never got there within the run
        (run / "eval_curve.json").write_text(json.dumps({"points": [], "first_at_threshold": curve}))


QA = ["--metric", "F1=qa:scores.compressed.squad_f1:higher", "--metric", "EM=qa:scores.compressed.squad_em:higher",
      "--carry", "qa:loss.own_other_ratio"]


def verdict(root, a, b, *flags):
    """verdict.py's command line on arms A and B (PIC is the paper's winner): the table it appended to results.json."""
    V.main(["--out", str(root), "--claim", "c", "--arm", "PIC", *a, "--arm", "PCC", *b, "--expect", "PIC", "PCC",
            *(flags or QA)])
    return json.loads((root / "results.json").read_text())["tables"][-1]


# ---- the ways a verdict could be fooled ----


def test_one_run_in_both_arms_is_refused(tmp_path):
    """A run listed in both arms compares the run with itself: refused, unless --context reads two rows of its
    evaluation (CompLLM's CEs against no context)."""
    for name, seed, right in [("a0", 0, range(50)), ("a1", 1, range(50)), ("b1", 1, range(5))]:
        fake_run(tmp_path, name, seed, right)
    with pytest.raises(SystemExit, match=r"^verdict.py: the run a0 is in both arms PIC and PCC, and metric F1 reads "
                                         r"the same record for each: list each run in one arm"):
        verdict(tmp_path, ["a0", "a1"], ["a0", "b1"])
    two_rows = verdict(tmp_path, ["a0", "a1"], ["a0", "a1"], "--context", "PIC", "compressed", "--context", "PCC",
                       "none", "--metric", "F1=qa:scores.{context}.squad_f1:higher",
                       "--carry", "qa:loss.own_other_ratio")
    assert two_rows["verdicts"]["F1"] == "reproduced"   # 50 of 60 from memory against none without context


def test_an_arm_whose_runs_differ_in_more_than_the_seed_is_refused(tmp_path):
    """An arm's spread is the seeds' only where its runs differ in nothing else: other settings (args.json, and the
    compressor's config) are named, each with its values; where a run was written, the seed and the pretrained run it
    started from may differ, and a flag one run's args.json lacks (added after it was trained) is not compared."""
    fake_run(tmp_path, "a0", 0, range(50))
    fake_run(tmp_path, "a1", 1, range(50), final=500, args={"lr": 2e-4, "resume": "/x/a1"}, config={"mem": 8})
    fake_run(tmp_path, "a2", 1, range(50), args={"fsdp": False})
    for name, seed in [("b0", 0), ("b1", 1)]:
        fake_run(tmp_path, name, seed, range(5))
    with pytest.raises(SystemExit, match=r"^verdict.py: arm PIC's runs differ in more than the seed: lr \(0.0001, "
                                         r"0.0002\), mem \(16, 8\), steps \(300, 500\): give each setting its "
                                         r"own arm$"):
        verdict(tmp_path, ["a0", "a1"], ["b0", "b1"])
    assert verdict(tmp_path, ["a0", "a2"], ["b0", "b1"])["verdicts"]["F1"] == "reproduced"


def test_a_score_of_an_earlier_checkpoint_is_refused(tmp_path):
    """An eval file must score the run's last step (log.jsonl's last training row): one that scored step 100 of a run
    trained to 300 is refused. A record without "step" is decided, and the verdict and footnote say so."""
    fake_run(tmp_path, "a0", 0, range(50), step=100)
    fake_run(tmp_path, "a1", 1, range(50), step=None)
    for name, seed in [("b0", 0), ("b1", 1)]:
        fake_run(tmp_path, name, seed, range(5))
    with pytest.raises(SystemExit, match=r"^verdict.py: \S+a0/eval_qa.json scored step 100, but a0 trained to step "
                                         r"300 \(its log.jsonl\): score its last checkpoint"):
        verdict(tmp_path, ["a0", "a1"], ["b0", "b1"])
    fake_run(tmp_path, "a2", 0, range(50), step=None)
    table = verdict(tmp_path, ["a2", "a1"], ["b0", "b1"])
    assert table["verdicts"]["F1"] == "reproduced (scored step unchecked)"
    assert sorted(table["unchecked_steps"]) == ["a1/eval_qa.json", "a2/eval_qa.json"]
    assert "Scored step unchecked (no \"step\" in the record" in (tmp_path / "results.md").read_text()


def test_a_missing_score_is_undecided_never_does_not_carry(tmp_path):
    """A run whose carry score is missing (its pretrained run never scored) is unmeasured, not "does not carry": the
    claim is undecided, not "only PIC carries its text". A run with no curve record is not "never got there"."""
    for name, seed, right in [("a0", 0, range(50)), ("a1", 1, range(50)), ("b0", 0, range(5)), ("b1", 1, range(5))]:
        fake_run(tmp_path, name, seed, right, curve=100 if name[0] == "a" else None if name == "b0" else "no file")
    for name, seed, ratio in [("pa0", 0, 0.2), ("pa1", 1, 0.2), ("pb0", 0, 0.9), ("pb1", 1, None)]:
        fake_run(tmp_path, name, seed, own_other=ratio or 0.9)
        if ratio is None:
            (tmp_path / name / "eval_qa.json").unlink()
    table = verdict(tmp_path, ["a0", "a1"], ["b0", "b1"], *QA, "--carry-runs", "PIC", "pa0", "pa1",
                    "--carry-runs", "PCC", "pb0", "pb1")
    assert table["verdicts"]["F1"] == "undecided (a run has no carry value: score it)"
    assert table["carry"]["values"]["PCC"] == [pytest.approx(0.9), "missing"]
    # a0, a1 get there at step 100, b0 never does, b1 has no curve: b1 is unmeasured, not "never"
    table = verdict(tmp_path, ["a0", "a1"], ["b0", "b1"], "--metric", "first at 0.5=curve:first_at_threshold:lower",
                    "--kind", "mechanical")
    assert table["verdicts"]["first at 0.5"] == "undecided (a run has no record of the metric: score it)"
    assert "| never, missing |" in (tmp_path / "results.md").read_text()


def test_a_gap_inside_the_per_example_noise_is_undecided(tmp_path):
    """PIC answers none of 60 questions on both seeds, PCC 2 and 1 (the same one twice): the seed spread is smaller
    than the gap, but the paired bootstrap over the 60 questions holds 0, so nothing is decided and the table prints
    the interval. 50 against 5 right clears it."""
    for name, seed, right in [("a0", 0, ()), ("a1", 1, ()), ("b0", 0, (3, 7)), ("b1", 1, (3,))]:
        fake_run(tmp_path, name, seed, right)
    table = verdict(tmp_path, ["a0", "a1"], ["b0", "b1"])
    assert table["verdicts"]["EM"].startswith("undecided (within noise: A − B 95% in [-0.0")
    assert table["verdicts"]["EM"].endswith(", 0])") and table["noise"]["EM"]["high"] == 0
    assert table["noise"]["EM"]["examples"] == 60
    assert "| 0 (0-0) | 0.025 (0.01667-0.03333) | [-0.0" in (tmp_path / "results.md").read_text()
    for name, seed, right in [("c0", 0, range(50)), ("c1", 1, range(48))]:
        fake_run(tmp_path, name, seed, right)
    table = verdict(tmp_path, ["c0", "c1"], ["b0", "b1"])
    assert table["verdicts"] == {"F1": "reproduced", "EM": "reproduced"} and table["noise"]["EM"]["low"] > 0.6


# ---- the rules, one by one ----

CLEAR = (0.1, 0.3, 60)   # a noise floor clear of 0 in A's favour (higher is better)


@pytest.mark.parametrize("a, b, better, carries, noise, verdict", [
    ([0.80, 0.82], [0.60, 0.65], "higher", (True, True), CLEAR, "reproduced"),    # gap 0.185 > spread 0.05 and noise
    ([0.60, 0.65], [0.80, 0.82], "higher", (True, True), (-0.3, -0.1, 60), "contradicted"),
    ([0.70, 0.80], [0.65, 0.78], "higher", (True, True), (0.01, 0.06, 60), "not visible"),   # inside the spread 0.13
    ([0.80, 0.82], [0.60, 0.65], "higher", (True, True), (-0.02, 0.3, 60), "undecided (within noise"),
    ([0.80, 0.82], [0.60, 0.65], "higher", (True, True), None, "undecided (no per-example scores"),
    ([2.0, 2.1], [3.0, 3.1], "lower", (True, True), (-1.2, -0.8, 60), "reproduced"),   # a lower loss is better
    ([2.0, 2.1], [3.0, 3.1], "lower", (True, True), (0.8, 1.2, 60), "undecided (within noise"),   # against the means
    ([0.80, 0.82], [0.60, 0.65], "higher", (False, False), CLEAR, "undecided"),   # memories that carry nothing
    ([0.80, 0.82], [0.60, 0.65], "higher", (True, None), CLEAR, "undecided"),     # B carries in one seed only
    ([0.80, 0.82], [0.60, 0.65], "higher", (True, V.MISSING), CLEAR, "undecided (a run has no carry value"),
    ([0.02, 0.03], [0.85, 0.90], "higher", (False, True), (-0.9, -0.8, 60), "contradicted (only B"),
    ([0.85, 0.90], [0.02, 0.03], "higher", (True, False), (0.8, 0.9, 60), "reproduced (only A"),
    ([0.02, 0.03], [0.85, 0.90], "higher", (True, False), (-0.9, -0.8, 60), "undecided (only A"),   # the carrier loses
    ([0.60, 0.70], [0.58, 0.66], "higher", (True, False), (0.01, 0.05, 60), "undecided (only A"),   # inside the spread
    ([0.60, 0.90, 0.91], [0.58, 0.59, 0.8], "higher", (True, True), (0.01, 0.3, 60), "not visible"),   # seeds disagree
    ([100, 200], [None, None], "lower", (True, True), None, "undecided (no per-example"),   # steps: no example noise
    ([0.8, V.MISSING], [0.6, 0.6], "higher", (True, True), CLEAR, "undecided (a run has no record"),
])
def test_verdict_rules(a, b, better, carries, noise, verdict):
    assert V.decide(a, b, better, carries, noise=noise).startswith(verdict)


@pytest.mark.parametrize("a, b", [([0.9], [0.1]), ([0.9, 0.91], [0.1]), ([0.1], [0.9, 0.91]), ([], [])])
def test_verdict_refuses_to_decide_on_fewer_than_two_seeds(a, b):
    """The rule says 2 seeds per arm: one seed is undecided whatever the gap, the noise and whatever carries (EPL at
    r = 4 would be "reproduced" on one seed per arm without the rule)."""
    for carries in ((True, True), (True, False), (False, True)):
        assert V.decide(a, b, "higher", carries, noise=CLEAR).startswith("undecided (")
        assert "the rule needs 2" in V.decide(a, b, "higher", carries, noise=CLEAR)
    if len(a) >= 1 and len(b) >= 1:   # the same values, once the rule allows one seed, are decided
        noise = (-0.9, -0.7, 60) if a[0] < b[0] else (0.7, 0.9, 60)
        assert not V.decide(a, b, "higher", (True, True), min_seeds=1, noise=noise).startswith("undecided")


def test_verdict_kinds_and_the_carry_metric_in_the_record(tmp_path):
    """verdict.py's CLI: a carry claim over arms that carry nothing is undecided, a mechanical claim over the same runs
    is decided and says so; results.json names the carry metric (not "own_other" for a QA gap), and a 1-seed table
    says in its footnote that it decides nothing."""
    for run, (right, gap) in {"a0": (range(50), 0.01), "a1": (range(48), 0.02), "b0": (range(5), 0.0),
                              "b1": (range(6), 0.01)}.items():
        fake_run(tmp_path, run, int(run[1]), right)
        (tmp_path / run / "eval_gap.json").write_text(json.dumps({"ce_minus_none": gap}))
    common = ["--out", str(tmp_path), "--arm", "A", "a0", "a1", "--arm", "B", "b0", "b1", "--expect", "A", "B",
              "--metric", "F1=qa:scores.compressed.squad_f1:higher", "--carry", "gap:ce_minus_none",
              "--carry-min", "0.1",
              "--carry-name", "answer found, CEs minus no context"]
    V.main(common + ["--claim", "carry"])
    V.main(common + ["--claim", "mech", "--kind", "mechanical"])
    V.main(["--out", str(tmp_path), "--arm", "A", "a0", "--arm", "B", "b0", "--expect", "A", "B", "--claim", "one",
            "--metric", "F1=qa:scores.compressed.squad_f1:higher", "--kind", "mechanical"])
    tables = json.loads((tmp_path / "results.json").read_text())["tables"]
    assert tables[0]["verdicts"]["F1"].startswith("undecided (a memory carries nothing)")
    assert tables[1]["verdicts"]["F1"] == "reproduced (mechanical)" and tables[1]["kind"] == "mechanical"
    assert tables[2]["verdicts"]["F1"].startswith("undecided (1 seed(s)")
    assert all("own_other" not in t for t in tables)
    assert tables[0]["carry"] == {"metric": "gap:ce_minus_none", "name": "answer found, CEs minus no context",
                                  "rule": ">= 0.1", "values": {"A": [0.01, 0.02], "B": [0.0, 0.01]}}
    md = (tmp_path / "results.md").read_text()
    assert "| answer found, CEs minus no context (each run; >= 0.1 carries its text) |" in md
    assert "(**1 here: not decided**)" in md


def test_verdict_counts_distinct_seeds_and_refuses_a_duplicated_run(tmp_path):
    """verdict.py counts each arm's distinct seeds from the runs' args.json, not the runs it is given (one PIC run and
    one PCC run, each listed twice, would be two seeds), and a run listed twice in an arm, or two folders of one run
    (the same args.json but where it was written), stop it with one line."""
    runs = {"pic": (0, 0.40), "pic_copy": (0, 0.40), "pic_long": (0, 0.35), "pcc": (0, 0.10), "pcc_s1": (1, 0.12),
            "pic_s1": (1, 0.45)}
    for run, (seed, ratio) in runs.items():
        fake_run(tmp_path, run, seed, range(20), own_other=ratio)
    args = json.loads((tmp_path / "pic_long" / "args.json").read_text())   # seed 0 again, from another pretrained run
    (tmp_path / "pic_long" / "args.json").write_text(json.dumps({**args, "init": "/elsewhere/longer_s0"}))
    loss = ["--metric", "loss=qa:loss.own:lower", "--carry", "qa:loss.own_other_ratio"]
    with pytest.raises(SystemExit, match=r"^verdict.py: the run pic is listed twice in one arm"):
        verdict(tmp_path, ["pic", "pic"], ["pcc", "pcc_s1"], *loss)
    with pytest.raises(SystemExit, match=r"^verdict.py: pic and pic_copy are one run \(their args.json have the same "
                                         r"seed 0 and settings\)"):
        verdict(tmp_path, ["pic", "pic_copy"], ["pcc", "pcc_s1"], *loss)
    with pytest.raises(SystemExit, match=r"args.json is missing"):
        verdict(tmp_path, ["pic", "nowhere"], ["pcc", "pcc_s1"], *loss)
    one = verdict(tmp_path, ["pic", "pic_long"], ["pcc", "pcc_s1"], *loss)   # two runs, one seed: decides nothing
    assert one["seeds"] == {"PIC": [0], "PCC": [0, 1]}
    assert one["verdicts"]["loss"] == "undecided (1 seed(s) in an arm: the rule needs 2)"
    assert "mean over 1 / 2 seed(s) per arm" in (tmp_path / "results.md").read_text().splitlines()[-1]
    two = verdict(tmp_path, ["pic", "pic_s1"], ["pcc", "pcc_s1"], *loss)   # two seeds each: decided (PCC's lower)
    assert two["seeds"] == {"PIC": [0, 1], "PCC": [0, 1]} and two["verdicts"]["loss"] == "contradicted"
    with pytest.raises(SystemExit, match=r"^verdict.py: --expect names PIX, which no --arm has"):
        V.main(["--out", str(tmp_path), "--claim", "c", "--arm", "PIC", "pic", "--arm", "PCC", "pcc", "--expect", "PIX",
                "PCC", "--metric", "loss=ae:loss.own:lower"])
    with pytest.raises(SystemExit, match=r"^verdict.py: --out .*nowhere is no folder"):   # one line, no traceback
        V.main(["--out", str(tmp_path / "nowhere"), "--claim", "c", "--arm", "PIC", "pic", "--arm", "PCC", "pcc",
                "--expect", "PIC", "PCC", "--metric", "loss=ae:loss.own:lower"])


def test_the_noise_floor_is_the_records_metric_resampled(tmp_path):
    """per_example's parts, summed over every example, give back the record's own number (a mean for a score,
    Σ NLL / Σ tokens for a loss, their ratio for own/other); the bootstrap is seeded, and two arms that answer alike
    have the interval [0, 0]."""
    fake_run(tmp_path, "a0", 0, range(7), own_other=0.3)
    record = json.loads((tmp_path / "a0" / "eval_qa.json").read_text())
    for spec, value in [("qa:scores.compressed.squad_em", 7 / 60), ("qa:loss.own", record["loss"]["own"]),
                        ("qa:loss.own_other_ratio", 0.3)]:
        parts = list(V.per_example(str(tmp_path), "a0", spec).values())
        assert V.combine(np.array(parts).sum(0)) == pytest.approx(value)
    assert V.per_example(str(tmp_path), "a0", "qa:max_new_tokens") is None
    same = [V.per_example(str(tmp_path), "a0", "qa:scores.compressed.squad_em")]
    assert V.noise_floor(same, same) == (0.0, 0.0, 60)


# ---- evaluate.py records the step it scored ----


def test_evaluate_records_the_step_of_the_checkpoint_it_scored(tmp_path):
    """evaluate.py writes the training step of the checkpoint it scored (its compressor.json's): a kept earlier
    checkpoint says its own step, and verdict.py refuses it as the run's score; the run's folder says its last."""
    import torch
    import train
    out = tmp_path / "run"
    torch.set_num_threads(1)
    train.main(["--method", "500x", "--objective", "ae", "--model", "tiny", "--mem", "4", "--chunk-len", "16",
                "--crop", "window", "--min-len", "16", "--max-len", "16", "--batch-size", "2", "--steps", "2",
                "--save-every", "1", "--keep-every", "1", "--eval-every", "0", "--out", str(out), "--device", "cpu"])
    score = ["--task", "ae", "--n", "2", "--max-new-tokens", "1", "--device", "cpu", "--out", str(out / "eval_ae.json")]
    assert E.main(["--ckpt", str(out / "ckpt-000001"), *score])["step"] == 1
    with pytest.raises(SystemExit, match=r"eval_ae.json scored step 1, but run trained to step 2"):
        V.unchecked_steps(str(tmp_path), ["run"], ["ae"])
    assert E.main(["--ckpt", str(out), *score])["step"] == 2
    assert json.loads((out / "eval_ae.json").read_text())["step"] == 2
    assert V.unchecked_steps(str(tmp_path), ["run"], ["ae"]) == []
