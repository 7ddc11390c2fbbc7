"""recipes/plateau.py, the stopping rule of a long run: on fake arms whose kept checkpoints carry evaluate.py's ae
records (per-example BLEU on the same held-out texts), a steady rise, a drift inside the texts' noise, a fall, and a
step up then back; what it refuses; and a control beside its arm."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import plateau as P  # noqa: E402

N = 229   # the held-out texts the BLEU push scores
BASE = np.random.default_rng(0).uniform(0.1, 0.8, N)   # each text's BLEU at the start: texts differ a lot
SPEC = "BLEU=ae:scores.compressed.bleu4_words"


def shuffled(values, seed):
    """The same scores given to other texts: the mean is unchanged, every text's own score moves (the texts' noise)."""
    return np.random.default_rng(seed).permutation(values)


def write_record(folder, bleu, texts=N, step=400):
    """evaluate.py's record of one set of weights (FOLDER/eval_ae.json): the per-text BLEU of its first `texts`."""
    folder.mkdir(parents=True)
    rows = [{"text": f"text {i}", "compressed": {"scores": {"bleu4_words": float(b)}}} for i, b in enumerate(bleu[:texts])]
    (folder / "eval_ae.json").write_text(json.dumps({"task": "ae", "step": step, "examples": rows}))


def write_arm(root, run, checks, texts=N):
    """An arm as train.py --keep-every and evaluate.py leave it: ckpt-STEP/eval_ae.json for each {step: per-text BLEU}."""
    for step, bleu in checks.items():
        write_record(root / run / f"ckpt-{step:06d}", bleu, texts, step)


def run(root, *arms):
    P.main(["--out", str(root), "--metric", SPEC, *[x for arm in arms for x in ("--arm", *arm)]])
    return json.loads((root / "plateau.json").read_text())["tables"][-1]


@pytest.mark.parametrize("checks, verdict", [
    # +0.03 on every text at every check: a small rise, far outside the noise of 229 texts
    ({200: BASE, 400: BASE + 0.03, 600: BASE + 0.06}, "rising"),
    # the mean drifts up 0.005 a check, and every text's score moves by about 0.2: a rule without the noise floor
    # would read it as a rise
    ({200: BASE, 400: shuffled(BASE, 1) + 0.005, 600: shuffled(BASE, 2) + 0.01}, "plateau"),
    ({200: BASE, 400: BASE - 0.03, 600: BASE - 0.06}, "falling"),
    # up 0.05 and back: each step clears the noise, the span does not
    ({200: BASE, 400: BASE + 0.05, 600: shuffled(BASE, 3)}, "unsettled"),
    # only the last three checks count: a rise long ago, then flat
    ({0: BASE - 0.2, 200: BASE, 400: shuffled(BASE, 1), 600: shuffled(BASE, 2)}, "plateau"),
])
def test_the_rule_reads_the_last_three_checks_against_the_texts_noise(tmp_path, checks, verdict):
    write_arm(tmp_path, "a", checks)
    arm = run(tmp_path, ("arm", "a"))["arms"][0]
    assert arm["verdict"] == verdict
    assert arm["examples"] == N
    assert [int(s) for s in arm["checks"]] == sorted(checks)
    assert arm["checks"][str(max(checks))] == pytest.approx(float(np.mean(checks[max(checks)])))
    low, high = arm["intervals"][f"{max(checks)}-{sorted(checks)[-3]}"]
    assert low < float(np.mean(checks[max(checks)]) - np.mean(checks[sorted(checks)[-3]])) < high


def test_a_control_is_read_beside_its_arm_at_every_step_both_checked(tmp_path):
    write_arm(tmp_path, "decay", {200: BASE, 400: BASE + 0.04, 600: BASE + 0.05})
    write_arm(tmp_path, "constant", {200: BASE, 400: BASE + 0.01, 600: BASE + 0.01})
    run(tmp_path, ("decay", "decay"), ("constant", "constant"))
    md = (tmp_path / "plateau.md").read_text()
    assert "| constant - decay | 600 | -0.0400 | [-0.0400, -0.0400] over 229 | beyond the texts' noise; a rerun's " \
           "gap unmeasured (--rerun) |" in md   # every text down 0.04
    assert "| constant - decay | 200 | +0.0000 | [+0.0000, +0.0000] over 229 | within the texts' noise |" in md


@pytest.mark.parametrize("rerun_gap, reading", [(0.05, "within a rerun's gap (0.0500)"),
                                                (0.01, "beyond the texts' noise and a rerun's gap")])
def test_a_difference_between_arms_counts_only_beyond_a_reruns_gap(tmp_path, rerun_gap, reading):
    """Two arms are two runs: a difference that clears the texts' noise but not what one command moved between two
    runs of it decides nothing."""
    write_arm(tmp_path, "decay", {200: BASE, 400: BASE + 0.04, 600: BASE + 0.05})
    write_arm(tmp_path, "constant", {200: BASE, 400: BASE + 0.01, 600: BASE + 0.01})
    write_record(tmp_path / "record", BASE)
    write_record(tmp_path / "rerun", shuffled(BASE, 4) + rerun_gap)
    P.main(["--out", str(tmp_path), "--metric", SPEC, "--arm", "decay", "decay", "--arm", "constant", "constant",
            "--rerun", str(tmp_path / "rerun"), str(tmp_path / "record")])
    table = json.loads((tmp_path / "plateau.json").read_text())["tables"][-1]
    assert table["rerun"]["gap"] == pytest.approx(rerun_gap)
    by_step = {row["step"]: row for row in table["beside"]}
    assert by_step[600]["difference"] == pytest.approx(-0.04) and by_step[600]["reading"] == reading
    assert by_step[200]["reading"] == "within the texts' noise"
    assert f"| constant - decay | 600 | -0.0400 | [-0.0400, -0.0400] over 229 | {reading} |" in \
        (tmp_path / "plateau.md").read_text()
    write_record(tmp_path / "fewer", BASE, texts=N - 1)
    with pytest.raises(SystemExit, match=r"^plateau.py: --rerun .*fewer .* on the arms' examples"):
        P.main(["--out", str(tmp_path), "--metric", SPEC, "--arm", "decay", "decay", "--arm", "constant", "constant",
                "--rerun", str(tmp_path / "fewer"), str(tmp_path / "record")])


def test_what_it_refuses(tmp_path):
    with pytest.raises(SystemExit, match=r"^plateau.py: --out .* is no folder"):
        run(tmp_path / "missing", ("a", "a"))
    with pytest.raises(SystemExit, match=r"^plateau.py: --metric 'ae:bleu' is not NAME=TASK:PATH"):
        P.main(["--out", str(tmp_path), "--metric", "ae:bleu", "--arm", "a", "a"])
    write_arm(tmp_path, "two", {200: BASE, 400: BASE})
    with pytest.raises(SystemExit, match=r"^plateau.py: arm two has 2 checks .*: three are needed"):
        run(tmp_path, ("two", "two"))
    write_arm(tmp_path, "texts", {200: BASE, 400: BASE})
    folder = tmp_path / "texts" / "ckpt-000600"
    folder.mkdir()
    rows = [{"text": f"other {i}", "compressed": {"scores": {"bleu4_words": 0.5}}} for i in range(N)]
    (folder / "eval_ae.json").write_text(json.dumps({"task": "ae", "step": 600, "examples": rows}))
    with pytest.raises(SystemExit, match=r"^plateau.py: arm texts's checks scored different examples"):
        run(tmp_path, ("texts", "texts"))
    (folder / "eval_ae.json").write_text(json.dumps({"task": "ae", "step": 600, "scores": {}}))
    with pytest.raises(SystemExit, match=r"has no per-example rows for ae:scores.compressed.bleu4_words"):
        run(tmp_path, ("texts", "texts"))
    (folder / "eval_ae.json").write_text(json.dumps({"task": "ae", "examples": rows}))
    with pytest.raises(SystemExit, match=r"eval_ae.json names no step"):
        run(tmp_path, ("texts", "texts"))
