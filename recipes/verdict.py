"""Decide a paper's claim from runs with several seeds per arm (used by the recipes after their runs).

    python recipes/verdict.py --out runs/recipes/aoc --claim "AOC regenerates better than its LoRA baseline" \
        --arm AOC aoc_n16_s0 aoc_n16_s1 --arm LoRA lora_n16_s0 lora_n16_s1 --expect AOC LoRA \
        --metric "BLEU=ae:scores.compressed.bleu4_words:higher" --metric "steps to 0.5=curve:first_at_threshold:lower"

--expect A B: the paper says arm A beats arm B. For each metric (NAME=TASK:PATH:higher|lower, read as
recipes/summarize.py reads it), each arm's mean over its seeds, its spread (the range, max - min), and the noise
floor: the 95% interval of A − B (the arms' means) from a paired bootstrap over the examples every run of both arms
scored (BOOTSTRAP resamples, seeded; the same resampled examples for every run), from the per-example rows of
evaluate.py's records (per_example: scores.MODE.KEY, a mean over the examples; loss.own/other/none/full, Σ NLL /
Σ tokens; loss.own_other_ratio, the ratio of the two). Then, the first rule that applies:

    undecided       an arm with fewer than 2 seeds: one run cannot tell a gap from the spread between seeds (the
                    distinct seeds of the arm's runs, from each run's args.json)
    undecided       a run has no record of the metric (no eval file, or no such key in it), or no carry value:
                    a missing score is never read as "does not carry"
    undecided       neither arm carries its text, or some runs of an arm do and some don't (a comparison between
                    memories that carry nothing says nothing either way)
    undecided       no per-example scores to measure the noise (steps to a threshold, timings, a record without
                    its examples): no claim is decided without its noise floor
    undecided       within noise: the interval holds 0 (or points against the gap of the records' means)
    reproduced      every run of both arms carries its text, the interval clears 0 in A's favour, A beats B in the
                    mean by more than the larger of the two spreads, and every run of A beats every run of B (the
                    seeds agree); or every run of A carries its text, no run of B does, and the same holds (said as
                    "only A carries its text": B cannot within the run's budget)
    contradicted    the same with A and B swapped
    not visible     every run carries its text and the gap clears the noise, but not the seed spread (or the seeds
                    disagree)
    undecided       the one arm that carries does not win by more than the spread
The table prints the noise floor beside each verdict ("[-0.0667, 0] over 60": the interval and the examples it rests
on), and a verdict within noise carries it: "undecided (within noise: A − B 95% in [-0.0667, 0])".

A run "carries its text" when its held-out own/other (the AE loss with each text's own memory over the loss with
another text's; --carry, default ae:loss.own_other_ratio) is at or below --carry-max (0.5). A QA arm fine-tuned from
a pretrained run is checked on that run: --carry-runs LABEL RUN [RUN ...]. --carry-name names another carry metric
(CompLLM's: how much more often the CEs' answer holds the reference than no context's).

What it refuses, each with one line, before deciding anything: a run listed twice in an arm or two folders of one
run; a run in both arms where a metric reads the same record for both (one run's two rows of an evaluation are
told apart by --context); an arm (or its --carry-runs) whose runs differ in anything but the seed and where they
were written (args.json without WHERE, seed and init, whose pretrained run is checked as the --carry-runs; and
compressor.json's config; a key that one run's file lacks, a flag added after that run, is not compared); a score
of one checkpoint (an eval file that names its "checkpoint") whose "step", the step of the checkpoint evaluate.py
scored, is not the run's last (the last training row of its log.jsonl). A record without "step", or a run without
log.jsonl, is not refused for that: its score is taken as the run's final one, a decided verdict says "(scored step
unchecked)" and the footnote lists the files.

Two kinds of claim (--kind): "carry" (the default) compares what memories do, so it is decided only as above, where
they carry their text; "mechanical" is about a mechanism that works whatever a memory holds (a cache is reused, the
KV cache is smaller, the first token comes sooner): no carry condition, every other rule still holds, and the
verdict says "(mechanical)". The table is appended to OUT/results.md and OUT/results.json.
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize import lookup, read_metric  # noqa: E402
from runlog import read_log  # noqa: E402  (summarize put the repository root on the path)


MIN_SEEDS = 2   # the rule: no verdict from fewer seeds per arm
BOOTSTRAP = 10_000   # resamples of the paired bootstrap (seed 0): the 2.5% tails rest on 250 of them
# args.json keys that say where a run was written or how it was stopped and resumed, not what it trained: two folders
# whose args.json differ only in these are one run, copied
WHERE = ("out", "resume", "stop_after", "save_every", "keep_every")
# what may differ between the runs of one arm besides WHERE: the seed, and the pretrained run a fine-tune starts from
# (one per seed; its own settings are checked where the arm's --carry-runs name it)
PER_SEED = ("seed", "init")
MISSING = "missing"   # no record of a value, told apart from None (a threshold never reached within the run)


def read_json(path, missing=None):
    """A JSON file's content, or `missing` where there is no such file."""
    if not os.path.isfile(path):
        return missing
    with open(path) as f:
        return json.load(f)


def seeds_of(out, runs):
    """The distinct seeds of one arm's runs, read from each run's args.json (train.py writes it). A run listed twice,
    or two runs with the same seed and settings, is one run counted twice: SystemExit with one line (one run per
    arm, each listed twice, would otherwise be decided as two seeds)."""
    seen = {}
    for run in runs:
        path = os.path.join(out, run, "args.json")
        if not os.path.isfile(path):
            raise SystemExit(f"verdict.py: {path} is missing: a run's seed is read from its args.json")
        where = os.path.realpath(os.path.join(out, run))
        args = {k: v for k, v in read_json(path).items() if k not in WHERE}
        for other, (other_where, other_args) in seen.items():
            if where == other_where:
                raise SystemExit(f"verdict.py: the run {run} is listed twice in one arm: each run counts once")
            if args == other_args:
                raise SystemExit(f"verdict.py: {other} and {run} are one run (their args.json have the same seed "
                                 f"{args.get('seed')} and settings): each run counts once")
        seen[run] = (where, args)
    return sorted({args.get("seed") for _, args in seen.values()})


def settings_of(out, run):
    """What a run trained with: its args.json (less WHERE and PER_SEED) and its compressor.json's config."""
    args = {k: v for k, v in read_json(os.path.join(out, run, "args.json")).items() if k not in WHERE + PER_SEED}
    config = read_json(os.path.join(out, run, "compressor.json"), {}).get("config") or {}
    return {**{k: v for k, v in config.items() if k not in args}, **args}   # one name, one value: args.json's


def same_settings(out, label, runs):
    """SystemExit naming every setting the runs of one arm differ in besides the seed: their gap would be the
    setting's, not the seed spread. A key some runs lack (a flag added after they were trained) is not compared."""
    settings = [settings_of(out, run) for run in runs]
    shared = set.intersection(*(set(s) for s in settings)) if settings else set()
    differ = [key for key in sorted(shared) if any(s[key] != settings[0][key] for s in settings)]
    if differ:
        listed = ", ".join(f"{key} ({', '.join(str(s[key]) for s in settings)})" for key in differ)
        raise SystemExit(f"verdict.py: arm {label}'s runs differ in more than the seed: {listed}: give each "
                         "setting its own arm")


def final_step(out, run):
    """The last training step of a run (its log.jsonl's last training row), None without a log."""
    if not os.path.isfile(os.path.join(out, run, "log.jsonl")):
        return None
    rows = read_log(os.path.join(out, run))[0]
    return rows[-1]["step"] if rows else None


def unchecked_steps(out, runs, tasks):
    """The eval files of `runs` for `tasks` whose scored step cannot be checked (no "step" in the record, or no
    log.jsonl in the run); SystemExit where a record's step is not the run's last: a score of an earlier checkpoint
    (a copy brought along, a run continued after it was scored) is not the run's. Only a score of one checkpoint
    (evaluate.py's record, which names its "checkpoint") is checked: recipes/curve.py's points end at the last check,
    and a recipe's own sums (CompLLM's eval_gap.json) name no checkpoint."""
    unchecked = []
    for run in runs:
        final = final_step(out, run)
        for task in tasks:
            path = os.path.join(out, run, f"eval_{task}.json")
            record = read_json(path)
            if not isinstance(record, dict) or "checkpoint" not in record:
                continue
            step = record.get("step")
            if step is None or final is None:
                unchecked.append(f"{run}/eval_{task}.json")
            elif step != final:
                raise SystemExit(f"verdict.py: {path} scored step {step}, but {run} trained to step {final} (its "
                                 f"log.jsonl): score its last checkpoint (evaluate.py --ckpt {os.path.join(out, run)} "
                                 f"--task {task})")
    return unchecked


def value_of(out, run, spec):
    """read_metric's value, or MISSING where the run has no eval file for it or the file no such key (a key present
    with the value null is None: a threshold never reached within the run)."""
    value = read_metric(out, run, spec)
    task, _, path = spec.partition(":")
    if value is not None or task in ("log", "params"):
        return value
    record = read_json(os.path.join(out, run, f"eval_{task}.json"))
    if record is None:
        return MISSING
    parent, _, key = path.rpartition(".")
    holder = lookup(record, parent) if parent else record
    return None if isinstance(holder, dict) and key in holder else MISSING


def per_example(out, run, spec):
    """Each scored example's share of a metric: {example: its parts}, the metric of a set of examples being
    combine(the parts summed over the set); None where the record holds no per-example value for it. An example is
    its text (ae, lm) or its question on its context (qa), numbered where one repeats."""
    task, _, path = spec.partition(":")
    record = read_json(os.path.join(out, run, f"eval_{task}.json"), {})
    rows = record.get("examples") if isinstance(record, dict) else None
    head, _, key = path.rpartition(".")
    try:
        if head.startswith("scores.") and head.count(".") == 1:   # metrics.mean_scores: a mean over the examples
            parts = [[float(r[head[7:]]["scores"][key]), 1.0] for r in rows]
        elif path in ("loss.own", "loss.other", "loss.none", "loss.full"):   # memory_losses: Σ NLL / Σ tokens
            parts = [list(r["loss"][key]) for r in rows]
        elif path == "loss.own_other_ratio":   # (Σ own / its tokens) / (Σ other / its tokens)
            parts = [list(r["loss"]["own"]) + list(r["loss"]["other"]) for r in rows]
        else:
            return None
    except (KeyError, TypeError):   # no examples, or a row without the value
        return None
    examples, seen = {}, {}
    for row, p in zip(rows, parts):
        name = (row.get("text"), row.get("context"), row.get("question"))
        seen[name] = seen.get(name, 0) + 1
        examples[(*name, seen[name])] = p
    return examples


def combine(sums):
    """A metric from its parts summed over a set of examples (per_example): (..., 2) -> the first over the second;
    (..., 4) -> that ratio over the ratio of the last two (own/other)."""
    value = sums[..., 0] / sums[..., 1]
    return value / (sums[..., 2] / sums[..., 3]) if sums.shape[-1] == 4 else value


def noise_floor(a, b, resamples=BOOTSTRAP, seed=0):
    """The paired bootstrap of A − B (the mean over A's runs minus the mean over B's, each run's metric combined over
    the examples): the examples every run scored are resampled with replacement, the same draws for every run, so
    that what varies from example to example cancels where the arms agree. a, b: per run, per_example's dict.
    Returns (low, high, examples) of the 95% interval, or None without per-example values in every run."""
    if not a or not b or any(r is None for r in a + b):
        return None
    shared = [k for k in a[0] if all(k in r for r in a + b)]
    if not shared:
        return None
    n = len(shared)
    draws = np.random.default_rng(seed).multinomial(n, np.full(n, 1 / n), size=resamples)   # (R, n) counts
    arm = lambda runs: np.mean([combine(draws @ np.array([r[k] for k in shared], dtype=float)) for r in runs], 0)
    low, high = np.percentile(arm(a) - arm(b), [2.5, 97.5])   # (R,) differences -> their 95% interval
    return float(low), float(high), n


def decide(a, b, better, carries, min_seeds=MIN_SEEDS, seeds=None, noise=None):
    """The verdict on one metric (the rules of the module docstring, in order): a and b are the two arms' per-run
    values (A is the paper's winner; MISSING where a run has no record of it, None where it never got there),
    carries whether each arm's memories carry their text: (A, B), each True (every run), False (no run), None (some)
    or MISSING (a run has no carry value); a mechanical claim passes (True, True). seeds: the number of distinct
    seeds in each arm (default: one per value); noise: noise_floor's (low, high, examples) of A − B, or None."""
    n = min(seeds) if seeds else min(len(a), len(b))
    if n < min_seeds:
        return f"undecided ({n} seed(s) in an arm: the rule needs {min_seeds})"
    if MISSING in a or MISSING in b:
        return "undecided (a run has no record of the metric: score it)"
    if MISSING in carries:
        return "undecided (a run has no carry value: score it)"
    if carries not in ((True, True), (True, False), (False, True)):
        return "undecided (a memory carries nothing)"   # memories that carry nothing say nothing either way
    if noise is None or None in a or None in b:
        return "undecided (no per-example scores to measure the noise)"
    sign = 1 if better == "higher" else -1                        # A's advantage is sign * (A − B)
    a, b = [sign * v for v in a], [sign * v for v in b]
    low, high = sorted((sign * noise[0], sign * noise[1]))
    gap = statistics.mean(a) - statistics.mean(b)                  # > 0: A is better
    if not ((low > 0 and gap > 0) or (high < 0 and gap < 0)):   # the interval holds 0, or disagrees with the means
        return f"undecided (within noise: A − B 95% in [{noise[0]:.3g}, {noise[1]:.3g}])"
    spread = max(max(a) - min(a), max(b) - min(b))
    agree = min(a) > max(b) if gap > 0 else max(a) < min(b)      # every seed pair points the same way
    wins = abs(gap) > spread and agree
    if carries == (True, True):
        return ("reproduced" if gap > 0 else "contradicted") if wins else "not visible (inside the seed spread)"
    only = "A" if carries[0] else "B"   # one arm carries its text, the other's memory is a constant prompt
    if wins and (gap > 0) == (only == "A"):
        return ("reproduced" if only == "A" else "contradicted") + f" (only {only} carries its text)"
    return f"undecided (only {only} carries its text, and it does not win by more than the spread)"


def interval(noise):
    """The noise floor as the table prints it: "[-0.05, 0] over 60", the 95% interval and the examples it rests on."""
    return "no per-example scores" if noise is None else f"[{noise[0]:.3g}, {noise[1]:.3g}] over {noise[2]}"


def fmt(values):
    """An arm's values as the table prints them: "0.5 (0.4-0.6)", mean (min-max); each run's where one is None or
    MISSING ("never, missing")."""
    if not values:
        return "-"
    if MISSING in values or None in values:
        return ", ".join("never" if v is None else v if v == MISSING else f"{v:.4g}" for v in values)
    mean = statistics.mean(values)
    return f"{mean:.4g} ({min(values):.4g}-{max(values):.4g})" if len(values) > 1 else f"{mean:.4g}"


def parse_args(argv=None):
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
    if not os.path.isdir(a.out):   # one line, not a traceback
        raise SystemExit(f"verdict.py: --out {a.out} is no folder: pass the recipe's OUT, which holds the runs")
    missing = [label for label in a.expect if label not in [g[0] for g in a.arm]]
    if missing:
        raise SystemExit(f"verdict.py: --expect names {', '.join(missing)}, which no --arm has: name two --arm labels")
    a.metrics = []   # (name, {label: TASK:PATH with its context}, higher|lower)
    for spec in a.metric:
        name, _, rest = spec.partition("=")
        path, _, better = rest.rpartition(":")
        a.metrics.append((name, {g[0]: path.replace("{context}", dict(a.context).get(g[0], "")) for g in a.arm},
                          better))
    return a


def check_arms(a, arms, carry_runs):
    """Every refusal that needs no score (the module docstring); returns each arm's distinct seeds."""
    A, B = a.expect
    seeds = {label: seeds_of(a.out, runs) for label, runs in arms.items()}
    for label, runs in {**arms, **{f"{k} (--carry-runs)": v for k, v in carry_runs.items()}}.items():
        same_settings(a.out, label, runs)
    where = lambda runs: {os.path.realpath(os.path.join(a.out, r)): r for r in runs}
    both = sorted(set(where(arms[A])) & set(where(arms[B])))
    for name, paths, _ in a.metrics:
        if both and paths[A] == paths[B]:
            raise SystemExit(f"verdict.py: the run {where(arms[A])[both[0]]} is in both arms {A} and {B}, and metric "
                             f"{name} reads the same record for each: list each run in one arm (two rows of one "
                             "run's evaluation: --context)")
    return seeds


def carries_of(a, carry_values):
    """Each arm's carry state for decide: True (every run carries), False (none), None (some), MISSING."""
    ok = (lambda v: v >= a.carry_min) if a.carry_min is not None else (lambda v: v <= a.carry_max)
    def carry(values):
        if a.kind == "mechanical":
            return True
        if not values or any(v is None or v == MISSING for v in values):   # unmeasured is not "does not carry"
            return MISSING
        hits = [ok(v) for v in values]
        return True if all(hits) else False if not any(hits) else None
    return {label: carry(values) for label, values in carry_values.items()}


def claim_table(a, arms, seeds, carry_runs):
    """Read every metric, decide it and draw the claim's table: (markdown lines, the results.json entry)."""
    A, B = a.expect
    carry_values = {label: [value_of(a.out, run, a.carry) for run in carry_runs[label]] for label in arms}
    carries = carries_of(a, carry_values)
    carry_files = [] if a.kind == "mechanical" else unchecked_steps(
        a.out, sorted({r for label in (A, B) for r in carry_runs[label]}), [a.carry.partition(":")[0]])
    lines = [f"### {a.claim}", "", f"| metric | {A} | {B} | noise floor: {A} − {B}, 95% (examples) | verdict |",
             "|---|---|---|---|---|"]
    verdicts, noise, unchecked = {}, {}, list(carry_files)
    for name, paths, better in a.metrics:
        values = {label: [value_of(a.out, run, paths[label]) for run in arms[label]] for label in (A, B)}
        rows = {label: [per_example(a.out, run, paths[label]) for run in arms[label]] for label in (A, B)}
        noise[name] = noise_floor(rows[A], rows[B])
        files = carry_files + [f for label in (A, B) for f in unchecked_steps(a.out, arms[label],
                                                                               [paths[label].partition(":")[0]])]
        unchecked += [f for f in dict.fromkeys(files) if f not in unchecked]   # a run in both arms, named once
        verdict = decide(values[A], values[B], better, (carries[A], carries[B]),
                         seeds=(len(seeds[A]), len(seeds[B])), noise=noise[name])
        if not verdict.startswith("undecided"):
            verdict += " (mechanical)" * (a.kind == "mechanical") + " (scored step unchecked)" * bool(files)
        verdicts[name] = verdict
        lines.append(f"| {name} ({better} is better) | {fmt(values[A])} | {fmt(values[B])} | {interval(noise[name])} "
                     f"| **{verdict}** |")
    rule = f">= {a.carry_min}" if a.carry_min is not None else f"<= {a.carry_max}"
    shown = " | ".join(", ".join("-" if v is None else v if v == MISSING else f"{v:.3f}" for v in carry_values[label])
                       for label in (A, B))
    if a.kind == "mechanical":
        lines.append(f"| {a.carry_name} (each run; not a condition: a mechanical claim) | {shown} | - | - |")
    else:
        lines.append(f"| {a.carry_name} (each run; {rule} carries its text) | {shown} | - | "
                     + ("every run carries its text" if carries[A] is True and carries[B] is True else
                        "**not every run carries its text**") + " |")
    fewest = min(len(seeds[A]), len(seeds[B]))
    lines += ["", f"mean over {len(seeds[A])} / {len(seeds[B])} seed(s) per arm, (min-max) across seeds; noise "
              f"floor: the 95% interval of {A} − {B} from a paired bootstrap over the examples every run scored "
              f"({BOOTSTRAP} resamples); the rule: {a.kind} claim, at least {MIN_SEEDS} seeds per arm"
              + ("" if a.kind == "mechanical" else f", every run's {a.carry_name} {rule}")
              + ", the interval clear of 0 and every seed pair the same way"
              + (f" (**{fewest} here: not decided**)" if fewest < MIN_SEEDS else "") + ". "
              + (f"Scored step unchecked (no \"step\" in the record, or no log.jsonl; taken as the run's last): "
                 f"{', '.join(unchecked)}. " if unchecked else "") + a.note]
    entry = dict(title=a.claim, kind=a.kind, verdicts=verdicts, arms=arms, seeds=seeds, expect=[A, B],
                 noise={k: v and dict(low=v[0], high=v[1], examples=v[2]) for k, v in noise.items()},
                 unchecked_steps=unchecked, carry={"metric": a.carry, "name": a.carry_name, "rule": rule,
                                                   "values": carry_values})
    return lines, entry


def main(argv=None):
    """Check the arms, decide every metric, append the table to OUT/results.md and OUT/results.json."""
    a = parse_args(argv)
    arms = {g[0]: g[1:] for g in a.arm}
    carry_runs = {**arms, **{g[0]: g[1:] for g in a.carry_runs}}
    seeds = check_arms(a, arms, {g[0]: g[1:] for g in a.carry_runs})
    lines, entry = claim_table(a, arms, seeds, carry_runs)
    results = os.path.join(a.out, "results.json")
    tables = read_json(results, {"tables": []})["tables"]
    with open(results, "w") as f:
        json.dump({"tables": tables + [entry]}, f, indent=1)
    md = os.path.join(a.out, "results.md")
    text = ""
    if os.path.isfile(md):
        with open(md) as f:
            text = f.read() + "\n"
    with open(md, "w") as f:
        f.write(text + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
