"""Decide a paper's claim from runs with several seeds per arm (used by the recipes after their runs).

    python recipes/verdict.py --out runs/recipes/aoc --claim "AOC regenerates better than its LoRA baseline" \
        --arm AOC aoc_n16_s0 aoc_n16_s1 --arm LoRA lora_n16_s0 lora_n16_s1 --expect AOC LoRA \
        --metric "BLEU=ae:scores.compressed.bleu4_words:higher" --metric "steps to 0.5=curve:first_at_threshold:lower"

--expect A B: the paper says arm A beats arm B. For each metric (NAME=TASK:PATH:higher|lower, read as
recipes/summarize.py reads it), each arm's mean over its seeds and its spread (the range, max - min), then:

    undecided       first, whatever the values: an arm with fewer than 2 seeds: one run cannot tell a
                    gap from the spread between seeds (the distinct seeds of the arm's runs, from each run's
                    args.json; a run listed twice in an arm, or two folders of one run, stop with one line)

    reproduced      every run of both arms carries its text, and A beats B in the mean by more than the larger of
                    the two spreads; or every run of A carries its text, no run of B does, and A beats B by more
                    than that (said as "only A carries its text": B cannot within the run's budget)
    contradicted    the same with A and B swapped
    not visible     every run carries its text, and the gap is inside the spread
    undecided       neither arm carries its text, or some runs of an arm do and some don't (a comparison between
                    memories that carry nothing says nothing either way), or the one arm that carries does not win
                    by more than the spread, or a run has no value for the metric
A steps-to-threshold metric (lower is better, None = never within the run) is decided when every run of one arm
gets there and no run of the other does, whatever the other metrics say.

A run "carries its text" when its held-out own/other (the AE loss with each text's own memory over the loss with
another text's; --carry, default ae:loss.own_other_ratio) is at or below --carry-max (0.5). A QA arm fine-tuned from
a pretrained run is checked on that run: --carry-runs LABEL RUN [RUN ...]. --carry-name names another carry metric
(CompLLM's: how much more often the CEs' answer holds the reference than no context's).

Two kinds of claim (--kind): "carry" (the default) compares what memories do, so it is decided only as above, where
they carry their text; "mechanical" is about a mechanism that works whatever a memory holds (a cache is reused, the
KV cache is smaller, the first token comes sooner): no carry condition, the 2-seed (2-repeat) rule and the spread
rule still hold, and the verdict says "(mechanical)". The table is appended to OUT/results.md and OUT/results.json.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import read_metric  # noqa: E402


MIN_SEEDS = 2   # the rule: no verdict from fewer seeds per arm
# args.json keys that say where a run was written or how it was stopped and resumed, not what it trained: two folders
# whose args.json differ only in these are one run, copied (ours, issue 46)
WHERE = ("out", "resume", "stop_after", "save_every", "keep_every")


def seeds_of(out, runs):
    """The distinct seeds of one arm's runs, read from each run's args.json (train.py writes it). A run listed twice,
    or two runs with the same seed and settings, is one run counted twice: SystemExit with one line (issue 46: one PIC
    run and one PCC run, each listed twice, gave "contradicted")."""
    seen = {}
    for run in runs:
        path = os.path.join(out, run, "args.json")
        if not os.path.isfile(path):
            raise SystemExit(f"verdict.py: {path} is missing: a run's seed is read from its args.json")
        where = os.path.realpath(os.path.join(out, run))
        args = {k: v for k, v in json.load(open(path)).items() if k not in WHERE}
        for other, (other_where, other_args) in seen.items():
            if where == other_where:
                raise SystemExit(f"verdict.py: the run {run} is listed twice in one arm: each run counts once")
            if args == other_args:
                raise SystemExit(f"verdict.py: {other} and {run} are one run (their args.json have the same seed "
                                 f"{args.get('seed')} and settings): each run counts once")
        seen[run] = (where, args)
    return sorted({args.get("seed") for _, args in seen.values()})


def decide(a, b, better, carries, min_seeds=MIN_SEEDS, seeds=None):
    """The verdict on one metric: a and b are the two arms' per-seed values (A is the paper's winner), carries
    whether each arm's memories carry their text: (A, B), each True (every run), False (no run) or None (some);
    a mechanical claim passes (True, True); seeds the number of distinct seeds in each arm (default: one per value).
    Fewer than min_seeds seeds in an arm: undecided, whatever the values are.
    For a lower-is-better metric (steps to a threshold) None means never within the run: one arm that always gets
    there against one that never does is a verdict, anything else with a None is undecided."""
    n = min(seeds) if seeds else min(len(a), len(b))
    if n < min_seeds:
        return f"undecided ({n} seed(s) in an arm: the rule needs {min_seeds})"
    if better == "lower" and (None in a or None in b) and a and b:
        if None not in a and all(v is None for v in b):
            return "reproduced"
        if None not in b and all(v is None for v in a):
            return "contradicted"
        return "undecided (some runs never get there)"
    if not a or not b or None in a or None in b:
        return "undecided (a run has no value)"
    gap = statistics.mean(a) - statistics.mean(b)
    gap = gap if better == "higher" else -gap                     # > 0: A is better
    spread = max(max(a) - min(a), max(b) - min(b))
    if carries == (True, True):
        if abs(gap) > spread:
            return "reproduced" if gap > 0 else "contradicted"
        return "not visible"
    if carries in ((True, False), (False, True)):   # one arm carries its text, the other's memory is a constant prompt
        only = "A" if carries[0] else "B"
        if abs(gap) > spread and (gap > 0) == (only == "A"):
            return ("reproduced" if only == "A" else "contradicted") + f" (only {only} carries its text)"
        return f"undecided (only {only} carries its text, and it does not win by more than the spread)"
    return "undecided (a memory carries nothing)"   # a comparison between memories that carry nothing says nothing


def fmt(values):
    if not values:
        return "-"
    if None in values:
        return ", ".join("never" if v is None else f"{v:.4g}" for v in values)
    mean = statistics.mean(values)
    return f"{mean:.4g} ({min(values):.4g}-{max(values):.4g})" if len(values) > 1 else f"{mean:.4g}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--claim", required=True)
    p.add_argument("--arm", nargs="+", action="append", required=True, metavar=("LABEL", "RUN"))
    p.add_argument("--expect", nargs=2, required=True, metavar=("A", "B"), help="the paper: A beats B")
    p.add_argument("--metric", action="append", required=True, help="NAME=TASK:PATH:higher|lower")
    p.add_argument("--carry", default="ae:loss.own_other_ratio")
    p.add_argument("--carry-max", type=float, default=0.5)
    p.add_argument("--carry-min", type=float, help="instead of --carry-max: a run carries when its --carry metric is "
                   "at least this (CompLLM: how much better its CEs answer than no context)")
    p.add_argument("--context", nargs=2, action="append", default=[], metavar=("LABEL", "CONTEXT"),
                   help="fill {context} in the metric paths of arm LABEL (two rows of one evaluation: CEs and full)")
    p.add_argument("--carry-runs", nargs="+", action="append", default=[], metavar=("LABEL", "RUN"))
    p.add_argument("--carry-name", default="held-out own/other", help="what --carry measures, for the table and "
                   "results.json (default: held-out own/other)")
    p.add_argument("--kind", choices=("carry", "mechanical"), default="carry", help="carry: decided only where the "
                   "memories carry their text (default); mechanical: a claim about a mechanism (reuse, KV size, "
                   "time to first token), decided whatever the memories hold")
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    if not os.path.isdir(a.out):   # (a traceback before, issue 47)
        raise SystemExit(f"verdict.py: --out {a.out} is no folder: pass the recipe's OUT, which holds the runs")
    arms = {g[0]: g[1:] for g in a.arm}
    seeds = {label: seeds_of(a.out, runs) for label, runs in arms.items()}   # each arm's distinct seeds
    carry_runs = {**arms, **{g[0]: g[1:] for g in a.carry_runs}}
    carry_values = {label: [read_metric(a.out, run, a.carry) for run in carry_runs[label]] for label in arms}
    ok = (lambda v: v >= a.carry_min) if a.carry_min is not None else (lambda v: v <= a.carry_max)
    def carry(values):   # True: every run carries its text, False: none does, None: some do
        hits = [v is not None and ok(v) for v in values]
        return True if hits and all(hits) else False if not any(hits) else None
    carries = {label: True if a.kind == "mechanical" else carry(vs) for label, vs in carry_values.items()}
    contexts = dict(a.context)
    A, B = a.expect
    lines = [f"### {a.claim}", "", f"| metric | {A} | {B} | verdict |", "|---|---|---|---|"]
    verdicts = {}
    for spec in a.metric:
        name, _, rest = spec.partition("=")
        path, _, better = rest.rpartition(":")
        values = {label: [read_metric(a.out, run, path.replace("{context}", contexts.get(label, "")))
                          for run in arms[label]] for label in (A, B)}
        verdicts[name] = decide(values[A], values[B], better, (carries[A], carries[B]),
                                seeds=(len(seeds[A]), len(seeds[B])))
        if a.kind == "mechanical" and not verdicts[name].startswith("undecided"):
            verdicts[name] += " (mechanical)"
        lines.append(f"| {name} ({better} is better) | {fmt(values[A])} | {fmt(values[B])} | **{verdicts[name]}** |")
    rule = f">= {a.carry_min}" if a.carry_min is not None else f"<= {a.carry_max}"
    if a.kind == "mechanical":
        lines.append(f"| {a.carry_name} (each run; not a condition: a mechanical claim) | "
                     + " | ".join(", ".join("-" if v is None else f"{v:.3f}" for v in carry_values[label])
                                  for label in (A, B)) + " | - |")
    else:
        lines.append(f"| {a.carry_name} (each run; {rule} carries its text) | "
                     + " | ".join(", ".join("-" if v is None else f"{v:.3f}" for v in carry_values[label])
                                  for label in (A, B))
                     + " | " + ("every run carries its text" if carries[A] and carries[B] else
                                "**not every run carries its text**") + " |")
    fewest = min(len(seeds[A]), len(seeds[B]))
    lines += ["", f"mean over {len(seeds[A])} / {len(seeds[B])} seed(s) per arm, (min-max) across seeds; the rule: "
              f"{a.kind} claim, at least {MIN_SEEDS} seeds per arm"
              + ("" if a.kind == "mechanical" else f", every run's {a.carry_name} {rule}")
              + (f" (**{fewest} here: not decided**)" if fewest < MIN_SEEDS else "") + ". " + a.note]
    results = os.path.join(a.out, "results.json")
    tables = json.load(open(results))["tables"] if os.path.isfile(results) else []
    tables.append(dict(title=a.claim, kind=a.kind, verdicts=verdicts, arms=arms, seeds=seeds, expect=[A, B],
                       carry={"metric": a.carry, "name": a.carry_name, "rule": rule, "values": carry_values}))
    json.dump({"tables": tables}, open(results, "w"), indent=1)
    md = os.path.join(a.out, "results.md")
    text = open(md).read() + "\n" if os.path.isfile(md) else ""
    open(md, "w").write(text + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
