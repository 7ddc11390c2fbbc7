"""Does each memory carry its own text, step by step? Each arm's held-out own/other (the AE loss with a text's own
memory over the loss with the next text's memory) at every step it was checked, the first step where it falls to a
threshold, and one figure with every arm (used by every recipe); and the training loss curves of several runs with
the step at which each reaches a loss (loss_curves, for recipes/summarize.py), all smoothed one way (smoothed_losses).

The points are the held-out checks the arm logged while it trained (train.py --eval-data/--eval-every: rows
{"step", "eval"} in its log.jsonl; nothing is reloaded or recomputed). An arm trained before train.py checked
itself (older records in recipes/results) has no such rows: then every kept checkpoint is scored.

    python recipes/curve.py --out runs/recipes/ladder --data runs/corpus/heldout.jsonl --n 32 \
        --group "1:1" icae_1x aoc_1x --group "4x" icae_4x aoc_4x [--threshold 0.5] [--title ...]

Without logged checks, each checkpoint is scored once (its ckpt-*/eval_curve.json is kept; teacher-forced losses
only: evaluate.run_ae with generate=False), on the first --n held-out texts cut as the arm was trained
(evaluate.trained_protocol: a window-cropped arm's texts are cut to its --max-len), which is what train.py's check logs. Writes OUT/ARM/eval_curve.json (the points, the first step at or below the threshold, the median
seconds per training step), OUT/curve.json, OUT/curve.md and OUT/curve.png (when matplotlib is installed).
"""

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import figures  # noqa: E402
from records import portable  # noqa: E402
from runlog import read_log  # noqa: E402


def kept(result, run):
    """Does the result file still describe the run's weights? Yes while it is newer than them, and when they are gone:
    a run's record kept without its weights (recipes/results) is read, never recomputed."""
    weights = os.path.join(run, "compressor.safetensors")
    return os.path.isfile(result) and (not os.path.isfile(weights) or os.path.getmtime(result) >= os.path.getmtime(weights))


def score(ckpt, data, n=None):
    """own, other, none and own/other of one checkpoint on the held-out texts of `data` (cached in
    ckpt/eval_curve.json). The one place this module loads a model: torch is imported here, so that reading the checks
    a run logged needs none."""
    path = os.path.join(ckpt, "eval_curve.json")
    if kept(path, ckpt):
        return json.load(open(path))
    import checkpoint
    import evaluate as E
    examples = E.load_examples(data, "ae")   # each arm scores the first n of those at its trained length
    comp = checkpoint.load(ckpt).eval()
    # the texts as the arm was trained on them, as evaluate.py scores them: those of at least its --min-len tokens,
    # the first n of them, cut to its --max-len
    proto = E.trained_protocol(ckpt)
    ae = E.run_ae(comp, E.at_trained_length(comp, examples, proto, n), proto=proto, generate=False)
    L = ae["loss"]
    point = dict(own=L["own"], other=L["other"], none=L["none"], ratio=L["own_other_ratio"],
                 tokens_per_slot=ae["tokens_per_slot"])
    json.dump(point, open(path, "w"))
    return point


def smoothed_losses(run, key="loss", window=20):
    """(step, mean of the logged `key` over the last `window` steps that logged it) for every such step of a run's
    log: the one definition of a run's training loss at a step, which every steps-to-a-loss here reads."""
    rows = [r for r in read_log(run)[0] if key in r]
    return [(r["step"], statistics.mean(x[key] for x in rows[max(0, i + 1 - window):i + 1]))
            for i, r in enumerate(rows)]


def first_step_at(smoothed, loss):
    """The first step whose smoothed loss is at or below `loss`, or None (never)."""
    return next((step for step, value in smoothed if value <= loss), None)


def loss_curves(runs, key="loss", target=None, png=None):
    """The training `key` of several runs (train.py --out folders) smoothed as smoothed_losses does, on one figure
    (EPL Fig. 4, PIC Fig. 5, GMSA Fig. 5: loss against steps), and the first step at which each reaches `target`
    (default: the highest of the runs' lowest smoothed losses, a loss every run reaches). recipes/summarize.py draws
    one per --curves key."""
    curves = {run: smoothed_losses(run, key) for run in runs}
    for run, c in curves.items():
        if not c:
            raise SystemExit(f"curve.py: the log of {run} has no '{key}' values")
    target = target if target is not None else max(min(v for _, v in c) for c in curves.values())
    out = [dict(run=portable(run), last_step=c[-1][0], final=c[-1][1], best=min(v for _, v in c), reached=first_step_at(c, target))
           for run, c in curves.items()]
    plt = figures.pyplot(png) if png else None   # None without matplotlib: the table is the result, the figure a view of it
    if plt:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run, c in curves.items():
            ax.plot([s for s, _ in c], [v for _, v in c], label=os.path.basename(os.path.normpath(run)))
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set(xlabel="step", ylabel=f"{key} (mean of the last 20 steps)", title=f"training {key}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)
    return {"key": key, "target": target, "png": portable(png) if plt else None, "runs": out}


def arm_curve(run, data, n, threshold, loss_at=None):
    """Every kept checkpoint of a run, scored: {points, first step <= threshold (None: never), s/step}; with loss_at,
    also the first step where the training loss (smoothed over 20 steps) is at or below it (EPL §4's "converges
    9.7 times faster": the steps each layout needs to reach the same training loss)."""
    steps, checks = read_log(run)
    points = [dict(step=r["step"], own=r["eval"]["own"], other=r["eval"]["other"], none=r["eval"]["none"],
                   ratio=r["eval"]["own_other"]) for r in checks]
    # the arm's --eval-n is what --n must be (it checked fewer texts where fewer have its trained length)
    asked = json.load(open(os.path.join(run, "args.json"))).get("eval_n") if points else None
    if points and (asked if asked is not None else checks[-1]["eval"]["n"]) != n:
        raise SystemExit(f"curve.py: {run} checked {checks[-1]['eval']['n']} held-out texts while it trained "
                         f"(--eval-n {asked}), not --n {n}: pass the --n (and --data) it was trained with")
    if not points:   # trained before train.py checked itself: score the kept checkpoints
        for ckpt in sorted(glob.glob(os.path.join(run, "ckpt-*"))):
            points.append(dict(step=int(ckpt.rpartition("-")[2]), **score(ckpt, data, n)))
    dts = [r["dt"] for r in steps]
    first = next((p["step"] for p in points if p["ratio"] is not None and p["ratio"] <= threshold), None)
    first_loss = None
    if loss_at is not None:
        first_loss = first_step_at(smoothed_losses(run), loss_at)
    return dict(points=points, first_at_threshold=first, threshold=threshold, loss_at=loss_at,
                first_at_loss=first_loss,
                final_ratio=points[-1]["ratio"] if points else None,
                s_per_step=statistics.median(dts[2:] or dts) if dts else None)   # the first steps warm up


def figure(path, groups, curves, threshold, title):
    """One panel per group, own/other against steps, every arm of the group on it; None without matplotlib."""
    plt = figures.pyplot(path)   # None without matplotlib: the table is the result, the figure a view of it
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False, sharey=True)
    for ax, (label, arms) in zip(axes[0], groups):
        for arm in arms:
            pts = [p for p in curves[arm]["points"] if p["ratio"] is not None]
            ax.plot([p["step"] for p in pts], [p["ratio"] for p in pts], marker="o", markersize=3, label=arm)
        ax.axhline(threshold, color="grey", linestyle=":")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set(xlabel="step", title=f"{title}: {label}" if title else label)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out own / other (1 = carries nothing)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the recipe's output folder, one run per arm in it")
    p.add_argument("--data", help="held-out texts (.jsonl with {\"text\"}; default: evaluate.py's built-in set)")
    p.add_argument("--n", type=int, default=32, help="held-out texts scored (default 32)")
    p.add_argument("--group", nargs="+", action="append", required=True, metavar=("LABEL", "ARM"),
                   help="a panel of the figure: its label, then its arms (folders of --out)")
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--title", default="")
    p.add_argument("--loss-ref", nargs="+", metavar="ARM", help="also find each arm's first step at the final training "
                   "loss of the arms of these in its own panel (each smoothed over its last 20 steps; the highest of "
                   "them, so that every reference run gets there within its own budget)")
    p.add_argument("--score-only", action="store_true", help="score the arms' checkpoints and write each "
                   "OUT/ARM/eval_curve.json, nothing else (a recipe does so as soon as an arm is trained)")
    a = p.parse_args(argv)
    groups = [(g[0], g[1:]) for g in a.group]
    stray = set(a.loss_ref or []) - {arm for _, arms in groups for arm in arms}
    if stray:
        p.error(f"--loss-ref {' '.join(sorted(stray))}: not in any --group; name arms of the panels")
    curves = {}
    for _, arms in groups:
        # each panel (a rung) has its own reference: the final training loss of its --loss-ref arms, the highest of
        # them (ours: a mean over seeds is a loss the worse reference seed never reaches, which would count the
        # reference itself as "never"); EPL §4 counts the steps to one fixed AE loss in the same way
        refs = [arm for arm in a.loss_ref or [] if arm in arms]
        loss_at = max(smoothed_losses(os.path.join(a.out, arm))[-1][1] for arm in refs) if refs else None
        for arm in arms:
            curves[arm] = arm_curve(os.path.join(a.out, arm), a.data, a.n, a.threshold, loss_at)
            json.dump(curves[arm], open(os.path.join(a.out, arm, "eval_curve.json"), "w"), indent=1)
    if a.score_only:
        return
    png = figure(os.path.join(a.out, "curve.png"), groups, curves, a.threshold, a.title)
    json.dump(dict(curves=curves, png=portable(png)), open(os.path.join(a.out, "curve.json"), "w"), indent=1)
    steps = sorted({p["step"] for c in curves.values() for p in c["points"]})
    at_loss = " first step at the reference's training loss (the loss) |" if a.loss_ref else ""
    lines = ["| arm | " + " | ".join(str(s) for s in steps) + f" | first step <= {a.threshold} |" + at_loss,
             "|---|" + "---|" * (len(steps) + 1 + bool(at_loss))]
    for arm, c in curves.items():
        at = {p["step"]: p["ratio"] for p in c["points"]}
        cells = ["" if at.get(s) is None else f"{at[s]:.3f}" for s in steps]
        first = c["first_at_threshold"] or f"not within {c['points'][-1]['step'] if c['points'] else 0}"
        reached = f" {c['first_at_loss'] or 'not reached'} ({c['loss_at']:.4g}) |" if c["loss_at"] is not None else \
            (" |" if at_loss else "")
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {first} |" + reached)
    open(os.path.join(a.out, "curve.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
