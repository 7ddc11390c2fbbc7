"""Every recipe end to end at SMOKE=1 (the tiny model, the built-in data, 2 steps per arm), so they cannot rot:
each trains its arms, evaluates them and writes results.json, results.md and its figures."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.sh") if p.stem != "common")


def test_every_paper_has_a_recipe():
    assert RECIPES == ["aoc", "compllm", "epl", "gmsa", "pic"]


@pytest.mark.parametrize("paper", RECIPES)
def test_recipe_runs_end_to_end(paper, tmp_path):
    pytest.importorskip("matplotlib")
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", f"recipes/{paper}.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for table in results["tables"]:
        assert table["arms"] and all(v is not None for arm in table["arms"].values() for v in arm.values()), table
        for curve in table["curves"].values():
            assert Path(curve["png"]).is_file()
    assert (tmp_path / "results.md").read_text().startswith("### ") and "wall time" in p.stdout
    if paper == "compllm":   # the reuse check compares two questions per context, compressed once against anew
        reuse, fresh = (json.loads((tmp_path / "compllm" / f"eval_{k}.json").read_text()) for k in ("reuse", "fresh"))
        assert reuse["concat"] == fresh["concat"] == 2 and reuse["reuse"] and not fresh["reuse"]
        assert results["tables"][0]["arms"]["compllm"]["cached CEs: same answers"] is True


def test_held_out_questions_are_answered_in_their_paragraphs():
    """recipes/qa_heldout.jsonl: hand-written questions about held-out paragraphs, each answer copied from its
    context (so the full-context row can answer and the no-context row cannot guess)."""
    rows = [json.loads(line) for line in (REPO / "recipes" / "qa_heldout.jsonl").read_text().splitlines() if line]
    assert len(rows) == 60 and len({r["question"] for r in rows}) == 60
    for r in rows:
        assert r["answer"].strip() and r["answer"] in r["context"], r["question"]
