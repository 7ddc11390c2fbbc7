"""A training run's log, OUT/log.jsonl: one JSON line per training step (write_log, which also prints the step's
console line) and one per held-out check ({"step", "eval"}, heldout.py). read_log reads it back; trim_log cuts it
to a checkpoint's step when a run resumes. No torch: the recipes' summaries (recipes/summarize.py, curve.py,
verdict.py) read a run's records without it.
"""

import json
import os

from tqdm import tqdm


def read_log(run_dir):
    """A run's log.jsonl -> (training rows, held-out rows {"step", "eval"}), each in step order."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "log.jsonl")) if line.strip()]
    return [r for r in rows if "eval" not in r], [r for r in rows if "eval" in r]


def trim_log(path, step):
    """Keep the log lines of steps <= step (a resumed run logs the later steps again), atomically."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):   # a line cut short by a killed run
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def write_log(log, bar, row, steps, own_other=None):
    """The step's row in log.jsonl and on the console."""
    parts = {k: v for k, v in row.items() if k not in ("step", "loss", "lr", "grad_norm", "dt", "tokens_per_s",
                                                       "tokens", "stop")}
    log.write(json.dumps({k: v for k, v in row.items() if k != "stop"}) + "\n")
    log.flush()
    detail = ", ".join(f"{k} {v:.4f}" for k, v in parts.items())
    tqdm.write(f"step {row['step']:>{len(str(steps))}}/{steps} | loss {row['loss']:.4f} ({detail}) | "
               f"lr {row['lr']:.2e} | grad-norm {row['grad_norm']:.3f} | dt {row['dt'] * 1000:.0f}ms | "
               f"tok/s {row['tokens_per_s']:,.0f}")
    held = {} if own_other is None else {"own_other": f"{own_other:.3f}"}   # the latest held-out check
    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}", **held)
    bar.update(1)
