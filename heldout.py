"""
The held-out check of a training run (ours): does the memory carry its own text?

A falling training loss proves little: a learned constant prompt gets that too (recipes/README.md, "The ladder"). So
the run scores held-out examples at step 0, every --eval-every steps and at the end: teacher-forced, the loss of its
objective with each example's own memory, another example's memory (evaluate.derangement: example i reads the memory
of example i + 1) and none. own/other near 1 means the memory is a constant prompt; at most 0.5 that it carries its
own text. The numbers are evaluate.py's (evaluate.run_ae / run_lm / run_qa without generating, texts cut as this run
cuts its training texts: `evaluate.py --task ae --max-len <the run's --max-len>` on the same checkpoint gives the same
own/other).
"""

import json
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import evaluate
from checkpoint import is_out_of_memory
from runlog import read_log

PROMPT_LIKE, PROMPT_EVALS = 0.95, 3   # warn when this many evaluations in a row past the warmup are all >= 0.95


@dataclass
class Check:
    """The held-out check of a run: what it scores, how often, and what it has logged."""
    examples: list      # the held-out examples (evaluate.load_examples), the same every time
    task: str           # "ae" (ae, pretrain) or "qa" (qa, distill: the loss of the reference answer)
    every: int          # steps between evaluations
    rows: list          # this run's evaluations so far ({"step", "eval"}), kept across --resume
    proto: dict         # how the run cuts its texts (evaluate.protocol): the check cuts the held-out ones alike
    pretrain: bool      # the run's objective is pretrain: the LM loss is scored beside AE's
    warmup: int         # the run's warmup steps: the constant-prompt warning reads the evaluations after it
    source: str         # --eval-data, or the built-in set: the one-line errors name it
    out: str            # the run directory (an out-of-memory error says its last checkpoint is kept)
    warned: bool = False
    bleu: bool = False  # --eval-bleu: regenerate each text from its memory, BLEU-4 (words) and ROUGE-L beside own/other

    @property
    def last(self):
        """The latest held-out own/other (the progress bar shows it), or None."""
        return self.rows[-1]["eval"]["own_other"] if self.rows else None


def prepare(comp, every: int, objective: str, crop: str, min_len: int, max_len: int, warmup: int,
            eval_data: str | None, eval_n: int, bleu: bool, builtin: bool, out: str, resumed: bool,
            master: bool) -> Check | None:
    """The held-out examples of the check every `every` (> 0) steps, or None, with one line saying why and how to turn
    it on. The run's objective, crop and lengths say how the texts are cut (as it cuts its training texts); eval_data,
    eval_n, bleu: its --eval-data, --eval-n, --eval-bleu; builtin: the built-in tiny model, whose held-out texts are
    built in; out, resumed: a resumed run's log holds its earlier evaluations. (train.main prepares none with
    --eval-every 0.) Examples that cannot serve: a ValueError whose message says what to pass instead."""
    task = "qa" if objective in ("qa", "distill") else "ae"
    if eval_data is None and not builtin:
        if master:
            what = "QA triples" if task == "qa" else "texts"
            print(f"no held-out check runs: pass --eval-data FILE (held-out {what}) to see every {every} steps "
                  "whether the memory carries its own text")
        return None
    proto = evaluate.protocol(crop, max_len, min_len, objective)
    source = eval_data or "the built-in set"
    try:   # the texts at the run's trained length (evaluate.at_trained_length), as evaluate.py scores them
        examples = evaluate.load_examples(eval_data, task, None if task == "ae" else eval_n)
        if task == "ae":
            examples = evaluate.at_trained_length(comp, examples, proto, eval_n)
    except evaluate.TooShort as e:   # the run's advice, not evaluate.py's (--data, --min-len would change the training)
        raise ValueError(f"--eval-data {eval_data or '(the built-in set)'}: no held-out text of at least "
                         f"{e.min_len} tokens (the run's --min-len) to score: pass --eval-data FILE with longer texts, "
                         "or --eval-every 0 (no check)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--eval-data: {e}") from None
    # a resumed run's log (trimmed to its checkpoint) holds its earlier evaluations
    rows = read_log(out)[1] if resumed and os.path.exists(os.path.join(out, "log.jsonl")) else []
    return Check(examples, task, every, rows, proto, objective == "pretrain", warmup, source, out,
                 warned=any(r.get("warned") for r in rows), bleu=bleu and task == "ae")


@torch.no_grad()
def score(comp, check: Check, device, autocast) -> dict:
    """own, other, none, own_other and n on the held-out examples; for pretrain the LM loss beside them."""
    max_len = check.proto["n"]
    modes = {m: m.training for m in comp.modules()}   # restored exactly afterwards: the check must not touch training
    comp.eval()
    # no RNG is drawn in eval mode; forked anyway, so that nothing the check does can move the training's streams
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
        ratio = {}   # ae: the compression the texts were scored at
        if check.task == "qa":
            L = evaluate.run_qa(comp, check.examples, max_len=max_len, generate=False)["loss"]
        else:
            # --eval-bleu (ours): each text regenerated greedily from its memory too, as evaluate.py --task ae does
            ae = evaluate.run_ae(comp, check.examples, proto=check.proto, generate=check.bleu, modes=("compressed",))
            L, ratio = ae["loss"], {"tokens_per_slot": ae["tokens_per_slot"]}
            if check.bleu:
                scores = ae["scores"]["compressed"]
                ratio.update(bleu4_words=scores["bleu4_words"], rougeL=scores["rougeL"])
        lm = evaluate.run_lm(comp, check.examples, max_len=max_len)["loss"] if check.pretrain else None
    for m, training in modes.items():
        m.train(training)
    point = lambda L: dict(own=L["own"], other=L["other"], none=L["none"], own_other=L["own_other_ratio"])
    return {**point(L), "n": len(check.examples), **ratio, **({"lm": point(lm)} if lm else {})}


def run_check(comp, check: Check, log, step: int, device, autocast):
    """Score the held-out examples at `step`, log the row, and warn once when the memory acts as a constant prompt.
    A check that cannot score (an empty held-out text, no memory left for it, out of memory): a ValueError, one line."""
    t0 = time.time()
    try:
        row = {"step": step, "eval": score(comp, check, device, autocast)}
    except ValueError as e:
        raise ValueError(f"the held-out check at step {step}: {e} (--eval-data {check.source})") from None
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        raise ValueError(f"out of memory in the held-out check at step {step} on {device}: use a smaller --eval-n, or "
                         f"--eval-every 0 (no check); the last good checkpoint in {check.out} is kept") from None
    row["eval"]["seconds"] = time.time() - t0   # what the check cost (the training steps' dt leaves it out)
    row["eval"]["accelerator"] = evaluate.accelerator(device)   # where it ran (a resumed run may move machines)
    check.rows.append(row)
    ratio = row["eval"]["own_other"]
    recent = [r["eval"]["own_other"] for r in check.rows if r["step"] > check.warmup][-PROMPT_EVALS:]
    warn = not check.warned and len(recent) == PROMPT_EVALS and all(x is not None and x >= PROMPT_LIKE for x in recent)
    if warn:   # saved with the row: a resumed run (prepare reads its log) does not warn again
        check.warned = row["warned"] = True
    log.write(json.dumps(row) + "\n")
    log.flush()
    if ratio is None:   # a single held-out example has no other
        return
    per_slot = row["eval"].get("tokens_per_slot")
    tqdm.write(f"step {step} | held-out own/other {ratio:.3f} (own {row['eval']['own']:.4f}, other "
               f"{row['eval']['other']:.4f}, no memory {row['eval']['none']:.4f})"
               + (f" at {per_slot['mean']:.2f} tokens per memory slot" if per_slot else "")
               + (f", regenerated: BLEU-4 {row['eval']['bleu4_words']:.3f}, ROUGE-L {row['eval']['rougeL']:.3f}"
                  if "bleu4_words" in row["eval"] else ""))
    if warn:
        tqdm.write(f"warning: held-out own/other {ratio:.3f} at step {step} ({PROMPT_EVALS} evaluations in a row >= "
                   f"{PROMPT_LIKE}): the memory acts as a constant prompt, the same for every text; see "
                   f"recipes/README.md, 'The ladder' (what the decoder sees of each memory, recipes/diagnosis.py)")


def first_carrying_step(check: Check, threshold=0.5) -> str:
    """The closing line: the first step at which held-out own/other was <= threshold, or that it never was."""
    hit = next((r["step"] for r in check.rows if r["eval"]["own_other"] is not None
                and r["eval"]["own_other"] <= threshold), None)
    last = check.rows[-1]
    if hit is not None:
        return (f"held-out own/other first <= {threshold} at step {hit} ({last['eval']['own_other']:.3f} at step "
                f"{last['step']})")
    ratio = last["eval"]["own_other"]
    return (f"held-out own/other never <= {threshold} within {last['step']} steps "
            f"({'n/a' if ratio is None else f'{ratio:.3f}'} at step {last['step']}): the memory does not carry its "
            "text yet")
