"""Has an arm stopped improving? Its checks (evaluate.py's record of each kept checkpoint, ARM/ckpt-*/eval_TASK.json,
and the run it started from as step 0 where --start names one), a metric at each, and the paired bootstrap 95%
interval of every difference between its last three checks (verdict.py's noise floor: the held-out examples
resampled, the same draws for both checks). Ours: the BLEU push's stopping rule.

    python recipes/plateau.py --out runs/push --metric "BLEU-4 (words)=ae:scores.compressed.bleu4_words" \
        --start lora_b16long2_4x --arm decay lora_cont_decay_4x --arm constant lora_cont_const_4x

The rule, per arm, on its last three checks a < b < c (by step):

    plateau      every interval of b - a, c - b and c - a holds 0: the three agree within the noise
    rising       c - a clears 0 upward
    falling      c - a clears 0 downward
    unsettled    neither: one step clears the noise, the span does not

The noise is how much the choice of held-out texts moves the metric between two checks of the same texts. Greedy
regeneration is deterministic: a checkpoint scored twice gives the same number, so within one run the texts are the
noise. What it refuses, each with one line: an arm with fewer than three checks, a check without per-example rows, and
checks that scored different examples. With more than one arm, each later arm beside the first at every step both
checked (the later minus the first, and its interval): a matched control beside its arm. Two arms are two runs, and
two runs of one command differ by more than the texts' noise (float rounding grows over the steps: the BLEU push's
rebuild, recipes/README.md); --rerun A B gives that gap, measured on a run and its rerun, and a difference between
arms is read as one only beyond both (without --rerun the table says the gap is unmeasured). Appends the tables to
OUT/plateau.md and OUT/plateau.json.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verdict import combine, noise_floor, per_example, read_json  # noqa: E402


def checks(out, run, task, start=None):
    """[(step, path from OUT of the folder holding its eval_TASK.json)] of one arm, by step: each kept checkpoint
    evaluate.py scored (the step its record names), and the start run's record as step 0."""
    found = [(0, start)] if start else []
    for path in glob.glob(os.path.join(out, run, "ckpt-*", f"eval_{task}.json")):
        step = read_json(path).get("step")
        if step is None:
            raise SystemExit(f"plateau.py: {path} names no step: score the checkpoint again with evaluate.py")
        found.append((step, os.path.relpath(os.path.dirname(path), out)))
    return sorted(found)


def values(out, label, found, spec):
    """{step: per_example's dict} of one arm; SystemExit where a check has no per-example rows, or where two checks
    scored different examples (their difference would be the texts', not the training's)."""
    rows = {}
    for step, where in found:
        rows[step] = per_example(out, where, spec)
        if rows[step] is None:
            raise SystemExit(f"plateau.py: {os.path.join(out, where)} has no per-example rows for {spec}: score it "
                             f"with evaluate.py on all held-out texts")
    keys = [set(r) for r in rows.values()]
    if any(k != keys[0] for k in keys):
        raise SystemExit(f"plateau.py: arm {label}'s checks scored different examples: score every checkpoint on the "
                         "same --data and --n")
    return rows


def metric(rows):
    """The metric of one check over all its examples (per_example's parts summed, combined)."""
    return float(combine(np.array(list(rows.values()), dtype=float).sum(0)))


def rule(b_a, c_b, c_a):
    """The rule above, from the 95% intervals (low, high, ...) of b - a, c - b and c - a, the last three checks'."""
    if all(low <= 0 <= high for low, high, *_ in (b_a, c_b, c_a)):
        return "plateau"
    return "rising" if c_a[0] > 0 else "falling" if c_a[1] < 0 else "unsettled"


def arm_table(out, label, run, spec, start):
    """One arm's checks, the intervals of its last three, and its verdict: (its table row, its JSON entry, its
    per-example values by step)."""
    found = checks(out, run, spec.partition(":")[0], start)
    if len(found) < 3:
        raise SystemExit(f"plateau.py: arm {label} has {len(found)} checks ({os.path.join(out, run)}/ckpt-*/eval_*.json"
                         f"{' and --start' if start else ''}): three are needed, score its kept checkpoints")
    rows = values(out, label, found, spec)
    a, b, c = sorted(rows)[-3:]
    noise = {(x, y): noise_floor([rows[y]], [rows[x]]) for x, y in ((a, b), (b, c), (a, c))}
    verdict = rule(*noise.values())
    means = {s: metric(rows[s]) for s in sorted(rows)}
    lines = [f"| {label} | {run} | " + ", ".join(f"{s}: {m:.4f}" for s, m in means.items()) + " | "
             + "; ".join(f"{y} - {x} in [{lo:+.4f}, {hi:+.4f}]" for (x, y), (lo, hi, _) in noise.items())
             + f" | {verdict} |"]
    entry = dict(label=label, run=run, checks=means, verdict=verdict, examples=len(rows[a]),
                 intervals={f"{y}-{x}": [lo, hi] for (x, y), (lo, hi, _) in noise.items()})
    return lines, entry, rows


def reading(low, high, diff, gap):
    """A difference between two arms, its text interval (low, high), against a rerun's gap (None: not measured)."""
    if low <= 0 <= high:
        return "within the texts' noise"
    if gap is None:
        return "beyond the texts' noise; a rerun's gap unmeasured (--rerun)"
    return f"within a rerun's gap ({gap:.4f})" if abs(diff) <= gap else "beyond the texts' noise and a rerun's gap"


def rerun_gap(paths, spec, examples):
    """|A - B| of two runs of one command (folders holding eval_TASK.json), with its text interval; SystemExit where
    they scored other examples than the arms."""
    rows = [per_example("", path, spec) for path in paths]
    if any(r is None or set(r) != examples for r in rows):
        raise SystemExit(f"plateau.py: --rerun {' '.join(paths)}: each needs per-example rows for {spec} on the "
                         "arms' examples: score both with evaluate.py on the same --data")
    low, high, _ = noise_floor([rows[0]], [rows[1]])
    return abs(metric(rows[0]) - metric(rows[1])), (low, high)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder that holds the arms")
    p.add_argument("--metric", required=True, help="NAME=TASK:PATH, as verdict.py reads it "
                   "(BLEU-4 (words)=ae:scores.compressed.bleu4_words)")
    p.add_argument("--arm", nargs=2, action="append", required=True, metavar=("LABEL", "RUN"))
    p.add_argument("--start", help="the run every arm started from: its record is each arm's step 0")
    p.add_argument("--rerun", nargs=2, metavar=("A", "B"), help="two runs of one command (a rerun beside its record), "
                   "folders holding eval_TASK.json: their gap is the training's own noise, which the texts' is not")
    a = p.parse_args(argv)
    if not os.path.isdir(a.out):   # one line, not a traceback
        raise SystemExit(f"plateau.py: --out {a.out} is no folder: pass the folder that holds the arms")
    name, _, spec = a.metric.partition("=")
    if not name or spec.count(":") != 1:
        raise SystemExit(f"plateau.py: --metric {a.metric!r} is not NAME=TASK:PATH: e.g. "
                         "'BLEU-4 (words)=ae:scores.compressed.bleu4_words'")
    lines = [f"### {name}: the last three checks of each arm", "",
             "| arm | run | the metric at each step | 95% intervals (paired bootstrap over the examples) | verdict |",
             "|---|---|---|---|---|"]
    entries, arms = [], []
    for label, run in a.arm:
        arm_lines, entry, rows = arm_table(a.out, label, run, spec, a.start)
        lines += arm_lines
        entries.append(entry)
        arms.append((label, rows))
    (first, base), read = arms[0], []
    gap, gap_interval = rerun_gap(a.rerun, spec, set(next(iter(base.values())))) if a.rerun else (None, None)
    if a.rerun:
        lines += ["", f"a rerun's gap: |{a.rerun[0]} - {a.rerun[1]}| = {gap:.4f}, 95% interval of the difference "
                  f"[{gap_interval[0]:+.4f}, {gap_interval[1]:+.4f}] (the texts')"]
    for (label, rows), entry in zip(arms[1:], entries[1:]):   # the control beside the arm, at every step both checked
        for step in sorted(set(rows) & set(base)):
            low, high, n = noise_floor([rows[step]], [base[step]])
            diff = entry["checks"][step] - entries[0]["checks"][step]
            read.append(dict(arms=f"{label} - {first}", step=step, difference=diff, interval=[low, high],
                             examples=n, reading=reading(low, high, diff, gap)))
    if read:
        lines += ["", "| arms | step | difference | 95% interval (the texts') | reading |", "|---|---|---|---|---|",
                  *(f"| {r['arms']} | {r['step']} | {r['difference']:+.4f} | [{r['interval'][0]:+.4f}, "
                    f"{r['interval'][1]:+.4f}] over {r['examples']} | {r['reading']} |" for r in read)]
    record = read_json(os.path.join(a.out, "plateau.json"), {"tables": []})
    with open(os.path.join(a.out, "plateau.json"), "w") as f:
        json.dump({"tables": record["tables"] + [dict(metric=name, spec=spec, start=a.start, arms=entries,
                                                      rerun=a.rerun and dict(runs=a.rerun, gap=gap), beside=read)]},
                  f, indent=1)
    md = os.path.join(a.out, "plateau.md")
    with open(md, "a") as f:
        f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
