"""The lever table (ours): for each compressor preset, which lever makes its memory carry its text, at 1:1
and at 4x. One cell per (preset, lever, rung): the arm's held-out own/other at its end, the first step at which
it fell to the threshold (0.5) or "never", and the compression it was scored at, tokens per memory slot over the
scored texts, mean (min-max). An arm counts as carrying at 4x only where that measurement is 4x (a mean of
at least 3.9 tokens per slot, no text under 3.5), whatever its rung's label. Used by recipes/ladder.sh after its
lever phase.

    python recipes/levers.py --out recipes/results/ladder [--extra "aoc:long@1x=recipes/results/aoc/aoc_n16_s0" ...]

The arms are read from OUT: a preset's own arm PRESET_RUNG (lever "none") and its lever arms PRESET_LEVER_RUNG
(recipes/ladder.sh names them so), each with its eval_ae.json (the final held-out own/other) and eval_curve.json
(the checks along the run, recipes/curve.py). --extra adds an arm kept elsewhere under a (preset, lever, rung) of
the table, e.g. a longer run of another recipe with the same protocol; its cell says where it came from.
Writes OUT/levers.md, OUT/levers.json and OUT/levers.png (own/other along every arm, one panel per preset; when
matplotlib is installed).
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import presets as P  # noqa: E402
import figures  # noqa: E402
import summarize  # noqa: E402
from records import portable  # noqa: E402
from runlog import read_log  # noqa: E402

PRESETS = P.METHODS
RUNGS = ("1x", "4x")
BASELINE = {"lora": ("500x", "lora")}   # ladder arms that are a preset under a lever: AOC's LoRA baseline is 500x + lora
# the rule (ours): a measured 4x is a mean of at least 3.9 tokens per slot over the scored texts, none under 3.5
MEASURED_4X = dict(mean=3.9, min=3.5)


def read_arm(path, threshold):
    """The arm's checks along the run, its final own/other, last step, and first step at or below the threshold."""
    if os.path.isfile(os.path.join(path, "eval_curve.json")):   # recipes/curve.py's points
        points = [(p["step"], p["ratio"]) for p in json.load(open(os.path.join(path, "eval_curve.json")))["points"]]
    else:   # not summarized yet: the checks the run logged (train.py --eval-every)
        checks = read_log(path)[1] if os.path.isfile(os.path.join(path, "log.jsonl")) else []
        points = [(r["step"], r["eval"]["own_other"]) for r in checks]
    ae = os.path.join(path, "eval_ae.json")
    final = json.load(open(ae))["loss"]["own_other_ratio"] if os.path.isfile(ae) else (points[-1][1] if points
                                                                                       else None)
    first = next((s for s, r in points if r <= threshold), None)
    tps = summarize.read_metric(os.path.dirname(path), os.path.basename(path), "ae:tokens_per_slot")
    return dict(path=portable(path), points=points, own_other=final, first=first, steps=points[-1][0] if points else None,
                tokens_per_slot=tps)


def measured_4x(arm):
    """Was the arm scored at a measured 4x (MEASURED_4X), not only at the rung so labelled?"""
    tps = arm.get("tokens_per_slot")
    return bool(tps) and tps["mean"] >= MEASURED_4X["mean"] and tps["min"] >= MEASURED_4X["min"]


def collect(out, extras, threshold):
    """{(preset, lever, rung): arm} from the folder names in OUT and the --extra arms."""
    arms = {}
    for name in sorted(os.listdir(out)):
        # the lever part keeps each lever's value (recipes/ladder.sh's lever_name: aoc_lr1e-5_1x, gmsa_warmgmsa_1x_4x)
        m = re.fullmatch(r"(?P<preset>[a-z0-9]+)(?:_(?P<lever>[a-z0-9+._-]+))?_(?P<rung>1x|4x)", name)
        if not m or not os.path.isfile(os.path.join(out, name, "args.json")):
            continue
        preset, lever = BASELINE.get(m["preset"], (m["preset"], m["lever"] or "none"))
        if preset in PRESETS:
            arms[(preset, lever, m["rung"])] = read_arm(os.path.join(out, name), threshold)
    for spec in extras:
        key, _, path = spec.partition("=")
        preset, _, rest = key.partition(":")
        lever, _, rung = rest.partition("@")
        if preset not in PRESETS or rung not in RUNGS or not os.path.isdir(path):
            raise SystemExit(f"levers.py: --extra {spec!r}: give PRESET:LEVER@RUNG=FOLDER with a preset of "
                             f"{', '.join(PRESETS)}, a rung of {', '.join(RUNGS)} and an existing folder")
        arms[(preset, lever, rung)] = dict(read_arm(path, threshold), extra=True)
    return arms


def cell(arm, threshold):
    if arm is None:
        return "-"
    if arm["own_other"] is None:
        return "running"
    first = f"step {arm['first']}" if arm["first"] is not None else f"never <= {threshold}"
    where = f", {arm['steps']} steps" + (f" ({os.path.relpath(arm['path'])})" if arm.get("extra") else "")
    text = f"{arm['own_other']:.3f} ({first}{where})"
    text = f"**{text}**" if arm["own_other"] <= threshold else text
    tps = arm.get("tokens_per_slot")
    return text + (f" at {summarize.ratio_text(tps)}" if tps else "")


def table(arms, threshold):
    levers = ["none"] + sorted({lever for _, lever, _ in arms} - {"none"})
    lines = ["| preset | lever | own/other on the 1:1 rung (first step <= %g) at its tokens per slot, mean (min-max) | "
             "on the 4x rung | carries at a measured 4x (mean >= %g tokens per slot, none < %g) under |"
             % (threshold, MEASURED_4X["mean"], MEASURED_4X["min"]), "|---|---|---|---|---|"]
    for preset in PRESETS:
        carried = {lv: a for lv in levers if (a := arms.get((preset, lv, "4x"))) and a["own_other"] is not None
                   and a["own_other"] <= threshold}
        at_4x = [lv for lv, a in carried.items() if measured_4x(a)]
        short = {}   # what carries on the 4x rung at less than a measured 4x, by the ratio it was scored at
        for lv, a in carried.items():
            if lv not in at_4x:
                tps = a.get("tokens_per_slot")
                short.setdefault(summarize.ratio_text(tps) if tps else "an unmeasured ratio", []).append(lv)
        verdict = ", ".join(at_4x) if at_4x else "none" if short else "none of the levers tried"
        verdict += "".join(f"; {', '.join(lvs)} carr{'y' if len(lvs) > 1 else 'ies'} at {ratio}, not a measured 4x"
                           for ratio, lvs in short.items())
        tried = [lv for lv in levers if any((preset, lv, r) in arms for r in RUNGS)]
        for lv in tried:
            lines.append(f"| {preset} | {lv} | {cell(arms.get((preset, lv, '1x')), threshold)} | "
                         f"{cell(arms.get((preset, lv, '4x')), threshold)} | {verdict if lv == tried[0] else ''} |")
    return "\n".join(lines)


def figure(arms, png, threshold):
    plt = figures.pyplot(png)   # None without matplotlib: the table is the result, the figure a view of it
    if plt is None:
        return None
    fig, axes = plt.subplots(2, len(PRESETS), figsize=(3 * len(PRESETS), 6), sharey=True, squeeze=False)
    for col, preset in enumerate(PRESETS):
        for row, rung in enumerate(RUNGS):
            ax = axes[row][col]
            for (p, lever, r), arm in sorted(arms.items()):
                if p == preset and r == rung and arm["points"]:
                    ax.plot(*zip(*arm["points"]), marker=".", label=lever)
            ax.axhline(threshold, color="grey", lw=0.5, ls="--")
            ax.set_title(f"{preset} {rung}", fontsize=9)
            ax.set_ylim(0, 1.1)
            if ax.lines[:-1]:
                ax.legend(fontsize=6)
            if col == 0:
                ax.set_ylabel("held-out own/other")
            if row == 1:
                ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the ladder's folder (recipes/ladder.sh's OUT)")
    p.add_argument("--extra", action="append", default=[], metavar="PRESET:LEVER@RUNG=FOLDER",
                   help="an arm kept elsewhere, shown in the table under this preset, lever and rung")
    p.add_argument("--threshold", type=float, default=0.5)
    a = p.parse_args(argv)
    arms = collect(a.out, a.extra, a.threshold)
    md = table(arms, a.threshold)
    png = figure(arms, os.path.join(a.out, "levers.png"), a.threshold)
    md += "\n\n" + (f"![own/other along every arm]({os.path.basename(png)})" if png else "")
    with open(os.path.join(a.out, "levers.md"), "w") as f:
        f.write(md.rstrip() + "\n")
    with open(os.path.join(a.out, "levers.json"), "w") as f:
        json.dump({f"{p}:{lv}@{r}": arm for (p, lv, r), arm in sorted(arms.items())}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
