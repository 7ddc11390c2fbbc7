"""Collect a recipe's arms into results.json, results.md and a figure (used by every recipe).

    python recipes/summarize.py --out runs/recipes/epl --title "..." --arms dpl upl epl \
        --metric "AE BLEU-4 (ids)=ae:scores.compressed.bleu4_ids" --metric "own/other=ae:loss.own_other_ratio" \
        --curves loss

A metric is NAME=TASK:PATH, read from OUT/ARM/eval_TASK.json (evaluate.py's output) by a dotted path; the
special task `log` reads the last line of the arm's training log and `params` its trained-parameter count;
ae:tokens_per_slot (or .mean, .min, .max) is measured from the scored examples where a record predates the key,
and the whole of it is shown as the mean and, where the texts differ, the range: "3.79 (2.94-4.00)" (ratio_text).
The figure is recipes/curve.py's loss_curves over the arms' training logs (one per --curves key). --append adds a
table to the results already written (a recipe with a pretraining and a fine-tuning comparison).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import curve  # noqa: E402
from metrics import tokens_per_slot  # noqa: E402
from runlog import read_log  # noqa: E402


def lookup(obj, path):
    """obj["a"]["b"][-1] for the path "a.b.-1"; None where anything is missing."""
    for key in path.split("."):
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list) and obj and key.lstrip("-").isdigit():
            obj = obj[int(key)]
        else:
            return None
    return obj


def read_metric(out, arm, spec):
    task, _, path = spec.partition(":")
    run = os.path.join(out, arm)
    if task == "log":
        rows = read_log(run)[0]   # the training rows (not the held-out checks)
        return lookup(rows[-1], path) if rows else None
    if task == "params":   # written by checkpoint.save
        return json.load(open(os.path.join(run, "compressor.json"))).get("trained_parameters")
    path_json = os.path.join(run, f"eval_{task}.json")
    if not os.path.isfile(path_json):
        return None
    result = json.load(open(path_json))
    if task == "ae" and path.startswith("tokens_per_slot") and "tokens_per_slot" not in result and "examples" in result:
        result["tokens_per_slot"] = tokens_per_slot(result["examples"])   # a record scored before it was kept
    return lookup(result, path)


def ratio_text(tps):
    """Tokens per memory slot as the tables show it (ours): the mean over the scored texts, and the range
    where they differ: "3.79 (2.94-4.00)", "1.00"."""
    lo, mean, hi = (f"{tps[k]:.2f}" for k in ("min", "mean", "max"))
    return mean if lo == hi else f"{mean} ({lo}-{hi})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--title", required=True)
    p.add_argument("--arms", nargs="+", required=True)
    p.add_argument("--metric", action="append", default=[], help="NAME=TASK:PATH")
    p.add_argument("--curves", nargs="*", default=["loss"], help="logged keys to plot (loss, ae, lm, ...)")
    p.add_argument("--note", default="", help="a line under the table (the setup)")
    p.add_argument("--append", action="store_true", help="add this table to the existing results")
    a = p.parse_args(argv)
    metrics = [m.split("=", 1) for m in a.metric]
    rows = {arm: {name: read_metric(a.out, arm, spec) for name, spec in metrics} for arm in a.arms}
    curves = {}
    for key in a.curves:
        png = os.path.join(a.out, f"curves_{key}.png")
        curves[key] = curve.loss_curves([os.path.join(a.out, arm) for arm in a.arms], key=key, png=png)
    def fmt(v, name):   # None is a metric not read, except a step to a threshold: there it is "not reached"
        if v is None:
            return "not reached" if name.startswith("first step at") else "-"
        if isinstance(v, dict) and {"mean", "min", "max"} <= v.keys():   # ae:tokens_per_slot
            return ratio_text(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [f"### {a.title}", "", "| arm | " + " | ".join(n for n, _ in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    lines += [f"| {arm} | " + " | ".join(fmt(rows[arm][n], n) for n, _ in metrics) + " |" for arm in a.arms]
    for key, c in curves.items():
        reached = ", ".join(f"{os.path.basename(r['run'])} step {r['reached']}" if r["reached"] else
                            f"{os.path.basename(r['run'])} never" for r in c["runs"])
        figure = f"![{key}]({os.path.basename(c['png'])})" if c["png"] else "(figure skipped: no matplotlib)"
        lines += ["", f"training {key} (mean of 20 steps) reaches {c['target']:.3g}: {reached}. {figure}"]
    if a.note:
        lines += ["", a.note]
    tables, text = [], ""
    if a.append and os.path.isfile(os.path.join(a.out, "results.json")):
        tables = json.load(open(os.path.join(a.out, "results.json")))["tables"]
        text = open(os.path.join(a.out, "results.md")).read() + "\n"
    tables.append({"title": a.title, "arms": rows, "curves": curves, "note": a.note})
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"tables": tables}, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(text + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
