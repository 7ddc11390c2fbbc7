"""The READMEs' numbers against their records: every number of a result table in README.md and recipes/README.md is
read again from the record its row links (`recipes/results/...`), and every number of a sentence that links a record
from the records its PROSE entry names (below), and must print the same at the digits shown, so a README cannot drift
from what the runs wrote. Pure file reading (no torch), a few seconds.

How a table names its records: a column `records` holds each run's folder as a link whose text is its seed,
`[s0](results/ladder/lora_4x)` (checked against the run's args.json). A row may compare arms at several compressions:

    records cell   1.00: AOC [s0](...) [s1](...), LoRA [s0](...) [s1](...); 2.00: AOC [s0](...) ...
    numbers cell   1.00: AOC 0.888 / 0.862, LoRA 0.001 / 0.001; 2.00: AOC 0.959 / 0.988 ...

groups split by "; " (each led by its tokens per slot), arms by ", " (each led by its label), one number per run. Every
other column is either checked (SPECS: how to read it from a run's record) or a label (LABELS: claims, names,
verdicts), and a table with no records column is a result table only where NOT_RESULTS says why not, or where a test
below reads it from its records another way (the lever table, the needle grid).

Two checks read the code rather than a record. The tiny demo's table in recipes/README.md states each preset's text
length n, memory slots m and steps: they must be what `python train.py --method M` runs today (a tiny compressor is
built for each row, the one test here that loads torch). And the sentence above README.md's reading guide states AOC's
row of the guide's table in words: its numbers must be that row's (tests/test_style.py holds the table to the code's
measure, tests/reading_guide.py).
"""

import json
import math
import re
import sys
from functools import lru_cache
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import verdict  # noqa: E402  (its noise floor: the paired bootstrap over a record's examples)
READMES = ("README.md", "recipes/README.md")

# tables that hold no result of a run kept in recipes/results, and why (matched on the header's start)
NOT_RESULTS = {
    "| method | follows |": "presets.py's method table (`python presets.py` prints it)",
    "| method | functions it runs": "tests/reading_guide.py's measure of the code a preset runs, not a result",
    "| claim | the paper's number |": "the papers' numbers, our setups and verdicts: our numbers are in the tables "
                                      "with records",
    "| preset | lever |": "the lever table: test_the_lever_table_matches_its_records",
    "| full context: depth": "the needle grid: test_the_needle_grid_matches_its_record",
    "| arm | run | the metric at each step": "plateau.py's tables: "
                                           "test_the_continuations_plateau_tables_are_their_records",
    "| arms | step | difference": "plateau.py's tables: test_the_continuations_plateau_tables_are_their_records",
}
# columns that name, describe or judge rather than measure (a "seed N" in them is checked against args.json; the tiny
# demo's "n (bytes)" and "m" are checked against the code: test_the_tiny_demo_table_states_each_presets_n_m_and_steps)
LABELS = {"claim (paper)", "verdict at this scale (rule: 2 seeds per arm, every run ≤ 0.5, the interval clear of 0)",
          "preset", "carrier", "carries at a measured 4x", "run", "state", "preset at m = n = 16",
          'preset at n = 64, 16 slots ("4x")', "run (memory optimized per text, 8 texts)", "tokens", "n (bytes)", "m",
          "other settings that differ from the preset's", "lever", "starts from"}
RATIO = r"\d+\.\d\d(?: \(\d+\.\d\d-\d+\.\d\d\))?"       # tokens per slot as the tables print it: "3.79 (2.94-4.00)"
LINK = re.compile(r"\[s(\d+)\]\(([^)\s]+)\)")


# ---- reading a run's record ----

@lru_cache(maxsize=None)
def read(path):
    return json.loads(Path(path).read_text())


def record(run, name):
    """OUT/RUN/NAME.json, or None where the run has none."""
    path = Path(run) / f"{name}.json"
    return read(str(path)) if path.is_file() else None


@lru_cache(maxsize=None)
def log_rows(run):
    return [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines() if line.strip()]


def last_step(run):
    """The last training step the run logged (its held-out checks are rows of their own)."""
    return max(r["step"] for r in log_rows(run) if "eval" not in r)


def checks(run):
    """The held-out own/other along the run: recipes/curve.py's points, else the checks train.py logged."""
    curve = record(run, "eval_curve")
    if curve:
        return [(p["step"], p["ratio"]) for p in curve["points"]]
    return [(r["step"], r["eval"]["own_other"]) for r in log_rows(run) if "eval" in r]


def last_check(run):
    """The last held-out check train.py logged (with --eval-bleu: BLEU-4 and ROUGE-L beside own/other)."""
    return [r for r in log_rows(run) if "eval" in r][-1]["eval"]


def first_at_half(run):
    return next((step for step, ratio in checks(run) if ratio <= 0.5), None)


def at_step(run, step):
    return next((ratio for s, ratio in checks(run) if s == step), None)


def ratio_text(tps):
    """recipes/summarize.ratio_text: the mean, and the range where the texts differ."""
    lo, mean, hi = (f"{tps[k]:.2f}" for k in ("min", "mean", "max"))
    return mean if lo == hi else f"{mean} ({lo}-{hi})"


def own_other(run):
    """A run's final held-out own/other (scored: evaluate.py's AE, else QA record): its folder, in recipes/results
    or a whole path."""
    return scored(RESULTS / run)["loss"]["own_other_ratio"]


def carrier_arms(runs, seeds=False):
    """[tokens per slot, 1, steps] the runs share (None where they differ), with seeds=True the seeds (the first
    two runs'), then each run's own/other."""
    seed = [record(RESULTS / r, "args")["seed"] for r in runs[:2]] if seeds else []
    return [shared(runs, lambda r: scored(RESULTS / r)["tokens_per_slot"]["mean"]), 1,
            shared(runs, lambda r: last_step(RESULTS / r)), *seed, *map(own_other, runs)]


def scored(run):
    """The run's final evaluation: eval_ae.json, or eval_qa.json where it has none (CompLLM's answers)."""
    return record(run, "eval_ae") or record(run, "eval_qa")


def qa(run):
    """A pretraining run's QA fine-tune: its sibling folder RUN_qa."""
    return record(f"{run}_qa", "eval_qa")


def speed_row(run, row):
    tokens = int(row["tokens"].replace(",", ""))
    return next(r for r in record(run, "eval_speed")["rows"] if r["context_tokens"] == tokens)


# header -> a function (run folder, the row's cells) -> the values the cell prints, in order
SPECS = {
    "tokens per slot": lambda run, row: [ratio_text(scored(run)["tokens_per_slot"])],
    "held-out own/other": lambda run, row: [own_other(run)],
    "held-out own/other at the end": lambda run, row: [own_other(run)],
    "first step at own/other <= 0.5": lambda run, row: [first_at_half(run)],
    "own / other / no memory (loss per token)": lambda run, row: [scored(run)["loss"][k]
                                                                  for k in ("own", "other", "none")],
    "BLEU-4 (words)": lambda run, row: [scored(run)["scores"]["compressed"]["bleu4_words"]],
    "BLEU-4 (ids)": lambda run, row: [scored(run)["scores"]["compressed"]["bleu4_ids"]],
    "ROUGE-L": lambda run, row: [scored(run)["scores"]["compressed"]["rougeL"]],
    "ROUGE-L (AOC's script)": lambda run, row: [scored(run)["scores"]["compressed"]["aoc_rougeL"]],
    "trained parameters": lambda run, row: [record(run, "compressor")["trained_parameters"] / 1e6],
    "s/step": lambda run, row: [record(run, "eval_curve")["s_per_step"]],
    "wall time, s: both / train / evaluate": lambda run, row: [(w := record(run, "wall_time"))["train_s"]
                                                               + w["evaluate_s"], w["train_s"], w["evaluate_s"]],
    "steps": lambda run, row: [last_step(run)],
    "held-out texts": lambda run, row: [len(scored(run)["examples"])],
    "tokens per slot at the check": lambda run, row: [ratio_text(last_check(run)["tokens_per_slot"])],
    "last check: own/other / BLEU-4 / ROUGE-L": lambda run, row: [(c := last_check(run))["own_other"],
                                                                  c["bleu4_words"], c["rougeL"]],
    "steps × batch": lambda run, row: [last_step(run), record(run, "args")["batch_size"]],
    "steps to DPL's final loss": lambda run, row: [record(run, "eval_curve")["first_at_loss"]],
    "AE loss own / other": lambda run, row: [scored(run)["loss"][k] for k in ("own", "other")],
    "AE loss own": lambda run, row: [scored(run)["loss"]["own"]],
    "TR loss, own memory": lambda run, row: [scored(run)["loss"]["own"]],
    "own/other at 100 / 200 / 300": lambda run, row: [at_step(run, s) for s in (100, 200, 300)],
    "QA F1": lambda run, row: [qa(run)["scores"]["compressed"]["squad_f1"]],
    "answer found": lambda run, row: [100 * qa(run)["scores"]["compressed"]["substring_acc"]],
    "QA after: F1": lambda run, row: [qa(run)["scores"]["compressed"]["squad_f1"]],
    "QA after: EM": lambda run, row: [qa(run)["scores"]["compressed"]["squad_em"]],
    "QA after: tokens per slot": lambda run, row: [ratio_text(qa(run)["tokens_per_slot"])],
    "QA after: answer own/other": lambda run, row: [qa(run)["loss"]["own_other_ratio"]],
    "context tokens per CE": lambda run, row: [ratio_text(scored(run)["tokens_per_slot"])],
    "QA F1: CEs / full context / none": lambda run, row: [scored(run)["scores"][c]["squad_f1"]
                                                          for c in ("compressed", "full", "none")],
    "answer found: CEs / full context / none": lambda run, row: [100 * scored(run)["scores"][c]["substring_acc"]
                                                                 for c in ("compressed", "full", "none")],
    "answer loss: own CEs / another document's CEs / none / full context":
        lambda run, row: [scored(run)["loss"][k] for k in ("own", "other", "none", "full")],
    "answer own/other": lambda run, row: [own_other(run)],
    # tests/bench_speed.py's rows (CompLLM's speed), the row found by its "tokens"
    "CEs": lambda run, row: [speed_row(run, row)["memory_slots"]],
    "compress ms": lambda run, row: [1000 * speed_row(run, row)["compress_s"]],
    "TTFT full ms": lambda run, row: [1000 * speed_row(run, row)["ttft_full_s"]],
    "TTFT from cached CEs ms": lambda run, row: [1000 * speed_row(run, row)["ttft_compressed_s"]],
    "speedup (cached)": lambda run, row: [speed_row(run, row)["speedup_offline"]],
    "speedup (compressing too)": lambda run, row: [speed_row(run, row)["speedup_online"]],
    "KV full / CEs MB": lambda run, row: [speed_row(run, row)[k] / 2 ** 20
                                          for k in ("kv_bytes_full", "kv_bytes_compressed")],
}


def groups_of(values, k=5):
    """recipes/diagnosis.groups_of: means over k consecutive groups of layers."""
    n = len(values)
    return [sum(values[g * n // k:(g + 1) * n // k]) / len(values[g * n // k:(g + 1) * n // k]) for g in range(k)]


def diagnosis_state(run, row):
    d = record(run, "diagnosis")
    if row["state"] == "init":
        return d["init"]
    assert row["state"] == f"step {d['step']}", (run, row["state"], d["step"])
    return d["trained"]


# a diagnosis table (it has a "state" column): recipes/diagnosis.py's measures of the run's diagnosis.json
DIAGNOSIS = {
    "embedding norm memory/text": lambda s: [s["embed_norm_ratio"]],
    "key norm memory/text (layers 0-5 / 6-11 / 12-17 / 18-23 / 24-29)":
        lambda s: groups_of([x["norm"] for x in s["layers"]]),
    "attention on memory (same layers)": lambda s: groups_of([x["attention"] for x in s["layers"]]),
    "key spread across texts": lambda s: [sum(x["spread"] for x in s["layers"]) / len(s["layers"])],
    "AE loss own": lambda s: [s["loss_own"]],
    "own: first token / the rest": lambda s: [s.get("loss_own_first"), s.get("loss_own_rest")],
    "other": lambda s: [s["loss_other"]],
    "none": lambda s: [s["loss_none"]],
    "own/other": lambda s: [s["own_other"]],
}


def capacity_spec(header):
    """The capacity table (recipes/diagnosis.py --capacity): "AE loss at N" and the own/other at the end."""
    if header == "own/other at the end":
        return lambda run: [record(run, "capacity")["own_other"]]
    step = int(re.fullmatch(r"AE loss at (\d+)", header).group(1))
    return lambda run: [next(c["loss"] for c in record(run, "capacity")["curve"] if c["step"] == step)]


# ---- reading the READMEs ----

def tables(text):
    """Every markdown table outside code blocks: (header cells, [row cells], line number)."""
    out, lines, fenced, i = [], text.splitlines(), False, 0
    while i < len(lines):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            start, rows = i, []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            out.append((lines[start], cells(lines[start]), rows, start + 1))
            continue
        i += 1
    return out


def cells(line):
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def groups(cell, what):
    """A cell split as the module docstring says: [(tokens per slot or None, [(label, [items])])]; items are the
    links (seed, path) of a records cell or the printed numbers of a numbers cell."""
    out = []
    for part in cell.split("; "):
        m = re.fullmatch(rf"({RATIO}): (.*)", part)
        tps, rest = (m.group(1), m.group(2)) if m else (None, part)
        arms = []
        for arm in rest.split(", "):
            if what == "links":
                first = LINK.search(arm)
                arms.append((arm[:first.start()].strip() if first else arm, LINK.findall(arm)))
            else:
                m = re.fullmatch(r"(.*?)\s*((?:\**[\d.,%]+\**)(?: / \**[\d.,%]+\**)*)", arm)
                assert m, f"cannot read {arm!r} as a label and numbers"
                arms.append((m.group(1), m.group(2).replace("*", "").split(" / ")))
        out.append((tps, arms))
    return out


def same(printed, value):
    """Does value print as `printed` at its digits? ("0.277", "7.4M", "21.7%", "1,350", "never")"""
    text = printed.replace("*", "").strip()
    if value is None:
        return text in ("never", "-")
    if isinstance(value, str):
        return text == value
    digits = text.rstrip("%M").replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", digits):
        return False
    # within half a unit of its last digit: a value on the half (11.25 MB) may print either way
    return abs(value - float(digits)) <= 0.5 * 10 ** -len(digits.partition(".")[2]) * (1 + 1e-9)


def check_table(readme, header_line, header, rows):
    """Every problem of one table with a records column, as lines."""
    base = (REPO / readme).parent
    problems = []
    col = header.index("records")
    for row in rows:
        named = dict(zip(header, row))
        links = groups(row[col], "links")
        runs = [(tps, label, seed, (base / path).resolve()) for tps, arms in links for label, items in arms
                for seed, path in items]
        where = f"{readme}, {row[0][:60]!r}"
        if not runs:
            problems.append(f"{where}: no record linked")
            continue
        for tps, label, seed, run in runs:
            if not (run / "args.json").is_file():
                problems.append(f"{where}: {run} is not a run's record (no args.json)")
            elif record(run, "args")["seed"] != int(seed):
                problems.append(f"{where}: {run} is seed {record(run, 'args')['seed']}, not s{seed}")
            elif tps is not None and tps != ratio_text(scored(run)["tokens_per_slot"]):
                problems.append(f"{where}: {run} was scored at {ratio_text(scored(run)['tokens_per_slot'])}, not {tps}")
        for name, cell in named.items():
            if name == "records" or cell in ("", "-"):
                continue
            if name in LABELS:
                for n in re.findall(r"\bseed (\d+)", cell):
                    if int(n) not in {record(run, "args")["seed"] for *_, run in runs}:
                        problems.append(f"{where}: says seed {n}; its records are not")
                continue
            if name == "tokens per slot: held-out own/other, each seed":
                printed = groups(cell, "numbers")
                shape = [(t, [(lab, len(v)) for lab, v in arms]) for t, arms in printed]
                want = [(t, [(lab, len(v)) for lab, v in arms]) for t, arms in links]
                if shape != want:
                    problems.append(f"{where}: {cell!r} does not pair with its records {row[col]!r}")
                    continue
                values = [v for _, arms in printed for _, vs in arms for v in vs]
                for text, (_, _, _, run) in zip(values, runs):
                    if not same(text, own_other(run)):
                        problems.append(f"{where}: own/other {text}, its record {run} says "
                                        f"{scored(run)['loss']['own_other_ratio']:.4f}")
                continue
            if "state" in named:
                spec = DIAGNOSIS.get(name)
                read_run = (lambda s: lambda run: s(diagnosis_state(run, named)))(spec) if spec else None
            elif header[0].startswith("run (memory optimized"):
                read_run = capacity_spec(name)
            elif name.isdigit():
                read_run = (lambda step: lambda run: [at_step(run, step)])(int(name))
            else:
                spec = SPECS.get(name)
                read_run = (lambda s: lambda run: s(run, named))(spec) if spec else None
            if read_run is None:
                problems.append(f"{readme}: the column {name!r} of {header_line[:50]!r} is neither in SPECS nor LABELS")
                break
            parts = cell.split("; ")
            arms = [[run for t, lab, s, run in runs if (t, lab) == key] for key in
                    dict.fromkeys((t, lab) for t, lab, _, _ in runs)]
            if len(parts) == 1:
                pairs = [(cell, run) for *_, run in runs]
            elif len(parts) == len(arms):   # one part per arm, in order
                pairs = [(part, run) for part, arm in zip(parts, arms) for run in arm]
            else:
                problems.append(f"{where}: {name} {cell!r} has {len(parts)} parts for {len(arms)} arms")
                continue
            for part, run in pairs:
                values = read_run(run)
                # a tokens per slot is one printed text; numbers are split at " / " (several measures) and " × "
                printed = [part] if all(isinstance(v, str) for v in values) else re.split(r" / | × ", part)
                if len(printed) != len(values) or not all(same(p, v) for p, v in zip(printed, values)):
                    problems.append(f"{where}: {name} {part!r}, its record {run} gives {values}")
    return problems


def readme_tables():
    for readme in READMES:
        for header_line, header, rows, line in tables((REPO / readme).read_text()):
            yield readme, header_line, header, rows, line


def test_every_number_of_a_result_table_is_its_records():
    """Each result table's every checked cell, against the record its row links (the module docstring)."""
    problems, checked = [], 0
    for readme, header_line, header, rows, line in readme_tables():
        if "records" in header:
            problems += check_table(readme, header_line, header, rows)
            checked += 1
        elif not any(header_line.startswith(h) for h in NOT_RESULTS):
            problems.append(f"{readme}:{line}: a table with no records column: {header_line[:80]!r} "
                            "(link each row's records, or say in NOT_RESULTS why it has none)")
    assert checked >= 15 and not problems, "\n".join(problems)   # 2 tables in README.md, 13 in recipes/README.md


def test_a_number_changed_by_one_in_its_last_digit_fails():
    """The check is not vacuous: in the first row of every result table, each number moved by one unit in its last
    digit (a tokens per slot, an own/other, a loss, a step, a percentage, a batch) is caught."""
    def bump(number):
        digits = number.replace(",", "")
        last = int(digits[-1])
        return number[:-1] + str(last + 1 if last < 9 else last - 1)
    cases = 0
    for readme, header_line, header, rows, line in readme_tables():
        if "records" not in header or not rows or check_table(readme, header_line, header, rows):
            continue
        row = rows[0]
        for i, cell in enumerate(row):
            if header[i] == "records" or header[i] in LABELS:
                continue
            for m in re.finditer(r"\d[\d,.]*\d|\d", cell):
                changed = list(row)
                changed[i] = cell[:m.start()] + bump(m.group(0)) + cell[m.end():]
                assert check_table(readme, header_line, header, [changed]), (readme, header[i], changed[i])
                cases += 1
    assert cases > 150


# ---- the two tables read from their records another way ----

def test_the_lever_table_matches_its_records():
    """recipes/README.md's lever table (recipes/levers.py's levers.md): each cell's own/other, first step <= 0.5,
    steps and tokens per slot, read from the arm its levers.json names, the arm's own records."""
    text = (REPO / "recipes" / "README.md").read_text()
    (header_line, header, rows, _), = [t for t in tables(text) if t[0].startswith("| preset | lever |")]
    index = read(str(REPO / "recipes" / "results" / "ladder" / "levers.json"))
    cell_re = re.compile(rf"\**(\d\.\d{{3}}) \((?:step (\d+)|never <= 0\.5), (\d+) steps(?: \([^)]*\))?\)\** "
                         rf"at ({RATIO})")
    problems, checked = [], 0
    for preset, lever, one, four, _ in rows:
        for rung, cell in (("1x", one), ("4x", four)):
            if cell == "-":
                continue
            run = REPO / index[f"{preset}:{lever}@{rung}"]["path"]
            m = cell_re.fullmatch(cell)
            if not m:
                problems.append(f"{preset}:{lever}@{rung}: cannot read {cell!r}")
                continue
            ratio, first, steps, tps = m.groups()
            got = (f"{scored(run)['loss']['own_other_ratio']:.3f}", first_at_half(run), checks(run)[-1][0],
                   ratio_text(scored(run)["tokens_per_slot"]))
            if got != (ratio, first and int(first), int(steps), tps):
                problems.append(f"{preset}:{lever}@{rung}: {cell!r}, its record {run} gives {got}")
            checked += 1
    assert checked > 40 and not problems, "\n".join(problems)


def test_the_needle_grid_matches_its_record():
    """recipes/README.md's needle grid (the full context's passkey accuracy, depth x length) is its record's."""
    text = (REPO / "recipes" / "README.md").read_text()
    (_, header, rows, _), = [t for t in tables(text) if t[0].startswith("| full context: depth")]
    kept = read(str(REPO / "recipes" / "results" / "needle" / "smollm2_500x_1step.json"))
    assert [int(h) for h in header[1:]] == kept["lengths"]
    assert [r[0] for r in rows] == [f"{round(100 * d)}%" for d in kept["depths"]]
    for row, want in zip(rows, kept["grid"]["full"]):
        assert all(same(text, v) for text, v in zip(row[1:], want)), (row, want)


# ---- the READMEs' prose: a number in a sentence that links a record ----
#
# A sentence that links a record (a Markdown link into recipes/results) prints numbers read from records: each has an
# entry in PROSE, the sentence's words around it ({} for each printed number) and what the records give, in order.
# test_every_number_of_a_sentence_that_links_a_record_has_an_entry keeps it that way: a new number in such a sentence
# fails until it has an entry. Not numbers: code spans, link targets, and words that join digits to letters
# (BLEU-4, SmolLM2-135M, seed-1, 4x). Images, tables (above), code blocks and HTML comments are not prose.

RESULTS = REPO / "recipes" / "results"
MAIN, MLP, R128, B16L2 = "push/lora_long_4x", "push/lora_mlp_4x", "push/lora_r128_4x", "push/lora_b16long2_4x"
COLLAPSE = ("ladder_collapse/icae_4x", "ladder_collapse/icae_ownother_4x", "ladder_collapse/icae_memfromtext_4x")
AOC_H200, AOC_H100 = "ladder_h200/aoc_long+batch16_4x", "ladder/aoc_long+batch16_4x"   # AOC at 4x on the GPUs
AOC_CPU, AOC_CPU_WARM = "ladder_cpu_aoc/aoc_fp32_4x", "ladder_cpu_aoc/aoc_fp32_warm54_4x"    # and on the CPU, in fp32
AOC_CPU_OLD = "ladder_cpu_aoc/aoc_oldcode_4x"   # the H100 run's command on its own code, on the CPU
B16L = "push/lora_b16long_4x"
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(?:\d+(?:\.\d+)?e-?\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?!\w)")
RECORD_LINK = re.compile(r"\]\(((?:\.\./)*(?:recipes/)?results/[^)\s]*)\)")
NOT_AN_END = ("e.g", "i.e", "et al", "vs", "Eq", "App", "cf", "Fig")   # a full stop that ends no sentence


def evals(run):
    """{step: the held-out check train.py logged at that step}."""
    return {r["step"]: r["eval"] for r in log_rows(RESULTS / run) if "eval" in r}


def scores(check):
    """A check's own/other / BLEU-4 (words) / ROUGE-L, as the push section prints them."""
    return [check["own_other"], check["bleu4_words"], check["rougeL"]]


def args(run):
    return record(RESULTS / run, "args")


def below_from(run, than):
    """The steps of `run`'s trained checks (step > 0) if its own/other is below `than`'s at every one, else None."""
    a, b = evals(run), evals(than)
    steps = [s for s in sorted(a) if s > 0]
    return steps if all(s in b and a[s]["own_other"] < b[s]["own_other"] for s in steps) else None


def median(values):
    values = sorted(values)
    return (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2


def shared(runs, read):
    """What `read` gives for every one of the runs, the one value they share (None where they differ)."""
    found = {read(run) for run in runs}
    return found.pop() if len(found) == 1 else None


def seeds(*runs):
    """The one seed the runs share (None where they differ)."""
    return shared(runs, lambda run: args(run)["seed"])


def collapse_protocol():
    """The collapse levers' protocol, each value the one all three arms share (None where they differ): text length,
    slots, tokens per slot (where every text has the same), steps, batch, seed, checked texts, check interval, and
    the diagnosis's texts and step."""
    def uniform(run):
        tps = scored(RESULTS / run)["tokens_per_slot"]
        return tps["mean"] if tps["min"] == tps["max"] else None
    return [shared(COLLAPSE, read) for read in (
        lambda r: args(r)["max_len"], lambda r: args(r)["mem"], uniform, lambda r: last_step(RESULTS / r),
        lambda r: args(r)["batch_size"], lambda r: args(r)["seed"], lambda r: len(scored(RESULTS / r)["examples"]),
        lambda r: args(r)["eval_every"], lambda r: record(RESULTS / r, "diagnosis")["texts"],
        lambda r: record(RESULTS / r, "diagnosis")["step"])]


def b16long2():
    """lora_b16long2_4x: its 400 more steps, its lr, BLEU-4's range over the checks it trained (step > 0) and its last,
    and the own loss and own/other at its first check and its last."""
    e = evals(B16L2)
    bleu = [e[s]["bleu4_words"] for s in e if s > 0]
    first, last = e[min(e)], e[max(e)]
    return [last_step(RESULTS / B16L2), args(B16L2)["lr"], min(bleu), max(bleu), last["bleu4_words"],
            first["own"], last["own"], first["own_other"], last["own_other"]]


def r128_against_main(both):
    """r 128 against the main arm: the steps where r 128 is below it (first, last), then the values of `both`."""
    steps = below_from(R128, MAIN)
    return [None, None] if steps is None else [steps[0], steps[-1]] + both(steps)


def main_at_the_levers_end():
    """The step both LoRA levers (MLP targets, r 128) end at, and the main arm's check there."""
    step = last_step(RESULTS / R128)
    return [step, *scores(evals(MAIN)[step])] if last_step(RESULTS / MLP) == step else [None] * 4


def own_vs_other_term(run):
    """--own-other-weight's term along a run (its log's own_vs_other): its median, log 2 (a memory no better than
    its neighbour's), the steps whose gradient norm passed 100, the steps, their largest norm, and the clip."""
    rows = [r for r in log_rows(RESULTS / run) if "own_vs_other" in r]
    norms = [r["grad_norm"] for r in rows]
    return [median([r["own_vs_other"] for r in rows]), 2, math.log(2), 100, sum(n > 100 for n in norms), len(rows),
            max(norms), args(run)["clip"]]


@lru_cache(maxsize=None)
def batch16_rise():
    """The two batch-16 ends on all held-out texts: their count, BLEU-4 and own/other, the paired bootstrap's 95%
    interval of the rise (recipes/verdict.py's noise floor), and how far the last is from 0.5."""
    ends = [scored(RESULTS / run) for run in (B16L, B16L2)]
    bleu = "ae:scores.compressed.bleu4_words"
    low, high, n = verdict.noise_floor(*([verdict.per_example(RESULTS, run, bleu)] for run in (B16L2, B16L)))
    return (n, *(e["scores"]["compressed"]["bleu4_words"] for e in ends),
            *(e["loss"]["own_other_ratio"] for e in ends), 95, low, high,
            0.5 - ends[1]["scores"]["compressed"]["bleu4_words"], 0.5)   # a tuple: cached, the bootstrap runs once


@lru_cache(maxsize=None)
def rerun_gap():
    """The push's chain run again against its record, on all held-out texts: BLEU-4 and own/other of each, and the
    paired bootstrap's 95% interval of rerun - record."""
    runs = ["push_rebuild/lora_b16long2_4x", B16L2]
    ends = [scored(RESULTS / run) for run in runs]
    low, high, n = verdict.noise_floor(*([verdict.per_example(RESULTS, run, "ae:scores.compressed.bleu4_words")]
                                         for run in runs))
    return (*(e["scores"]["compressed"]["bleu4_words"] for e in ends), n,
            *(e["loss"]["own_other_ratio"] for e in ends), 95, low, high)


def continuation():
    """The continuation's steps, batch, lr and warmup, from the decay arm's args.json; None where the control's
    differ (it is matched only where they agree)."""
    keys = ("steps", "batch_size", "lr", "warmup")
    decay, control = (args(f"push/lora_cont_{arm}_4x") for arm in ("decay", "const"))
    return [decay[k] if decay[k] == control[k] else None for k in keys]


def continued():
    """plateau.py's record of the continuation: BLEU-4 at the start and at each arm's last check, that step, each
    end's own/other and tokens per slot, the control minus the decay there, its interval and texts, the rerun's gap."""
    table = json.loads((RESULTS / "push" / "plateau.json").read_text())["tables"][-1]
    decay, const = table["arms"]
    last = max(decay["checks"], key=int)
    ends = [scored(RESULTS / "push" / arm["run"] / f"ckpt-{int(last):06d}") for arm in (decay, const)]
    beside = table["beside"][-1]
    return [decay["checks"]["0"], decay["checks"][last], const["checks"][last], int(last),
            *(e["loss"]["own_other_ratio"] for e in ends), ends[0]["tokens_per_slot"]["mean"], beside["difference"],
            *beside["interval"], beside["examples"], table["rerun"]["gap"]]


# (README, the words around the numbers, one {} each, what the records give: a function of nothing)
PROSE = [
    ("recipes/README.md", "from BLEU-4 {} at the start to {} with the decay and {} at a constant lr at step {} "
                          "(own/other {} and {}, {} tokens per slot), and the constant lr ends {} above the decay, a {}% interval of [{}, {}] over {} "
                          "texts, beyond a rerun's gap ({})",
     lambda: (lambda v: v[:8] + [95] + v[8:])(continued())),
    ("recipes/README.md", "its weights kept), {} steps at batch {} from lr {} with {} warmup steps, [decaying",
     continuation),
    ("recipes/README.md", "ends at BLEU-4 {} against [the record's](results/push/lora_b16long2_4x) {} on the same {} "
                          "texts (own/other {} and {}), a {}% interval of [{}, {}]: float rounding",
     lambda: list(rerun_gap())),
    ("recipes/README.md", "greedy regeneration gets few more of its words back: on all {} held-out texts the two ends "
                          "score BLEU-4 [{}](results/push/lora_b16long_4x) and [{}](results/push/lora_b16long2_4x) "
                          "(own/other {} and {}), a rise whose {}% interval, the paired bootstrap over those texts "
                          "(`recipes/verdict.py`'s noise floor), is [{}, {}]: beyond the texts' noise, slow, and {} "
                          "short of {}",
     lambda: list(batch16_rise())),
    ("recipes/README.md", "The term itself ([its log](results/ladder_collapse/icae_ownother_4x)) has a median of {} "
                          "over the run, where log {}, {}, is a memory no better than its neighbour's, and the "
                          "gradient's norm passed {} in {} of its {} steps (up to {}) before clipping at {}",
     lambda: own_vs_other_term("ladder_collapse/icae_ownother_4x")),
    ("recipes/README.md", "is [the ladder's](results/ladder/icae_4x) run again at a measured {} tokens per slot, "
                          "where the ladder's ran at {} ({}-{}) (`--chunk-len 64` left each text's last token, after "
                          "its [BOS], a chunk of its own): it ends as that one did, own/other "
                          "[{}](results/ladder_collapse/icae_4x) against {}",
     lambda: [scored(RESULTS / "ladder_collapse/icae_4x")["tokens_per_slot"]["mean"],
              *(scored(RESULTS / "ladder/icae_4x")["tokens_per_slot"][k] for k in ("mean", "min", "max")),
              own_other("ladder_collapse/icae_4x"), own_other("ladder/icae_4x")]),
    ("README.md", "([its record](recipes/results/first): {} s of training with its {} checks, {} s to evaluate, on",
     lambda: [(w := record(RESULTS / "first", "wall_time"))["train_s"],
              sum("eval" in r for r in log_rows(RESULTS / "first")), w["evaluate_s"]]),
    # the first real result: its own/other as a loss ratio, compression and BLEU-4 against the plain LLM's
    ("README.md", "Each memory carries its own text (another text's memory: a [{}×](recipes/results/first) higher "
                  "loss) at a measured {} tokens per slot; it gives back the gist, not the text (BLEU-4 {}; the plain "
                  "LLM reading it {})",
     lambda: [(e := scored(RESULTS / "first"))["loss"]["other"] / e["loss"]["own"], e["tokens_per_slot"]["mean"],
              e["scores"]["compressed"]["bleu4_words"], e["scores"]["full"]["bleu4_words"]]),
    ("README.md", "At {}:{} the same settings reach [{}](recipes/results/ladder/lora_1x)",
     lambda: [scored(RESULTS / "ladder/lora_1x")["tokens_per_slot"]["mean"], 1, own_other("ladder/lora_1x")]),
    ("README.md", "BLEU-4 at 4x stops near [{}](recipes/results/push/lora_long_4x) at batch {} and "
                  "rises slowly at batch {}, to [{}](recipes/results/push/lora_cont_const_4x/ckpt-000600) (all {} "
                  "held-out texts, own/other {}), not {}",
     lambda: [evals(MAIN)[max(evals(MAIN))]["bleu4_words"], args(MAIN)["batch_size"],
              args("push/lora_cont_const_4x")["batch_size"],
              (e := scored(RESULTS / "push/lora_cont_const_4x/ckpt-000600"))["scores"]["compressed"]["bleu4_words"],
              len(e["examples"]), e["loss"]["own_other_ratio"], 0.5]),
    ("README.md", "text at {} bytes a slot (another text's memory: a [{}×](recipes/results/tiny/aoc_mem4) "
                  "higher loss)",
     lambda: [scored(RESULTS / "tiny/aoc_mem4")["tokens_per_slot"]["mean"],      # a ratio: the loss other / own
              (loss := scored(RESULTS / "tiny/aoc_mem4")["loss"])["other"] / loss["own"]]),
    ("README.md", "own/other [{}](recipes/results/tiny/aoc)",
     lambda: [own_other("tiny/aoc")]),
    ("recipes/README.md", "A step at batch {} takes {} s here "
                          "(the median of [the main arm's](results/push/lora_long_4x) {} steps)",
     lambda: [args(MAIN)["batch_size"], median([r["dt"] for r in log_rows(RESULTS / MAIN) if "dt" in r]),
              len([r for r in log_rows(RESULTS / MAIN) if "dt" in r])]),
    ("recipes/README.md", "its first {} steps are the seed-1 ladder arm",
     lambda: [last_step(RESULTS / "ladder_s1/lora_4x") if seeds("ladder_s1/lora_4x") == 1 else None]),
    ("recipes/README.md", "([the record](results/push/lora_long_4x), log.jsonl; step {} was scored before",
     lambda: [max(s for s, e in evals(MAIN).items() if "bleu4_words" not in e)]),
    ("recipes/README.md", "at step {} against the [main arm's](results/push/lora_long_4x) {} / {} / {}:",
     main_at_the_levers_end),
    ("recipes/README.md", "[r {} on the MLP too](results/push/lora_mlp_4x), {} / {} / {} (no gain)",
     lambda: [args(MLP)["lora_r"], *scores(evals(MLP)[max(evals(MLP))])]),
    ("recipes/README.md", "[r {} on q, k, v, o](results/push/lora_r128_4x) (alpha {}: the same alpha / r), "
                          "{} / {} / {},",
     lambda: [args(R128)["lora_r"], args(R128)["lora_alpha"], *scores(evals(R128)[max(evals(R128))])]),
    ("recipes/README.md", "its own/other below the main arm's at each of its checks from step {} to {} "
                          "({}, {}, {} against {}, {}, {} at {}, {}, {})",
     lambda: r128_against_main(lambda steps: [evals(R128)[s]["own_other"] for s in steps[:-1]]
                               + [evals(MAIN)[s]["own_other"] for s in steps[:-1]] + steps[:-1])),
    ("recipes/README.md", "[{} more steps](results/push/lora_b16long2_4x), with the lr decaying again from {}, leave "
                          "BLEU-4 between {} and {} from check to check ({} at the end), while the held-out AE loss "
                          "with a text's own memory keeps falling ({} -> {}) and own/other with it ({} -> {})",
     b16long2),                                                                  # a range: BLEU-4's min and max
    ("recipes/README.md", "gradient noise capped batch {}, and capacity caps r {} (from scratch, "
                          "[r {}](results/push/lora_r128_4x)'s own/other is below "
                          "[the main arm's](results/push/lora_long_4x) at each of its checks from step {} to {}, "
                          "and its BLEU-4 {} against {} at step {}:",
     lambda: [args(MAIN)["batch_size"], args(MAIN)["lora_r"], args(R128)["lora_r"]]
     + r128_against_main(lambda steps: [evals(R128)[steps[-1]]["bleu4_words"], evals(MAIN)[steps[-1]]["bleu4_words"],
                                        steps[-1]])),
    ("recipes/README.md", "[{} parameters](results/push/lora_b16long2_4x/compressor.json) at r {}, {} MB in fp32",
     lambda: [(n := record(RESULTS / B16L2, "compressor")["trained_parameters"]),   # a count
              args(B16L2)["lora_r"], 4 * n / 1e6]),                                # fp32: 4 bytes a parameter
    # the carrier paragraph: each arm's held-out own/other at the end of its run
    ("README.md", "**What the carrier decided** (held-out own/other at {}:{}, 135M, {} CPU steps, seeds {} / {}): "
                  "PCC's memory carries on K/V ({} / {}, [s0](recipes/results/ladder/pcc_kv_1x) "
                  "[s1](recipes/results/ladder_s1/pcc_kv_1x)), not on its embeddings with the same other changes "
                  "({} / {}, [s0](recipes/results/ladder/pcc_nobridge_1x) "
                  "[s1](recipes/results/ladder_s1/pcc_nobridge_1x)); "
                  "CompLLM's likewise ({} / {}, [s0](recipes/results/ladder/compllm_kv+ae_1x) "
                  "[s1](recipes/results/ladder_s1/compllm_kv+aebos_1x); {} / {}, "
                  "[s0](recipes/results/ladder/compllm_nobridge+aebos_1x) "
                  "[s1](recipes/results/ladder_s1/compllm_nobridge+aebos_1x))",
     lambda: carrier_arms(["ladder/pcc_kv_1x", "ladder_s1/pcc_kv_1x", "ladder/pcc_nobridge_1x",
                           "ladder_s1/pcc_nobridge_1x", "ladder/compllm_kv+ae_1x", "ladder_s1/compllm_kv+aebos_1x",
                           "ladder/compllm_nobridge+aebos_1x", "ladder_s1/compllm_nobridge+aebos_1x"], seeds=True)),
    ("README.md", "K/V is not enough: AOC's carries nothing there ({}, [s0](recipes/results/ladder/aoc_1x))",
     lambda: [own_other("ladder/aoc_1x")]),
    ("recipes/README.md", "Moved to the K/V carrier, PCC's carries ({} / {}, [s0](results/ladder/pcc_kv_1x) "
                          "[s1](results/ladder_s1/pcc_kv_1x)); with the same changes on its own carrier it does not "
                          "({} / {}, [s0](results/ladder/pcc_nobridge_1x) [s1](results/ladder_s1/pcc_nobridge_1x))",
     lambda: [*map(own_other, ("ladder/pcc_kv_1x", "ladder_s1/pcc_kv_1x", "ladder/pcc_nobridge_1x",
                               "ladder_s1/pcc_nobridge_1x"))]),
    ("recipes/README.md", "So for CompLLM: {} / {} on K/V ([s0](results/ladder/compllm_kv+ae_1x) "
                          "[s1](results/ladder_s1/compllm_kv+aebos_1x)), {} / {} without "
                          "([s0](results/ladder/compllm_nobridge+aebos_1x) "
                          "[s1](results/ladder_s1/compllm_nobridge+aebos_1x))",
     lambda: [*map(own_other, ("ladder/compllm_kv+ae_1x", "ladder_s1/compllm_kv+aebos_1x",
                               "ladder/compllm_nobridge+aebos_1x", "ladder_s1/compllm_nobridge+aebos_1x"))]),
    ("recipes/README.md", "500x, ICAE's preset on the K/V carrier, carries ({}, [s0](results/ladder/icae_kv_1x)), "
                          "and PIC on it too ({}, [s0](results/ladder/pic_kv_1x))",
     lambda: [own_other("ladder/icae_kv_1x"), own_other("ladder/pic_kv_1x")]),
    ("recipes/README.md", "carries nothing ({}, [s0](results/ladder/aoc_1x)); nor is it needed: the one embedding "
                          "memory that carries is GMSA's, not a learned prompt but the text's own hidden states, "
                          "merged (after {} steps without [BOS]: {} / {}, [s0](results/gmsa/gmsa_1x_s0) "
                          "[s1](results/gmsa/gmsa_1x_s1)",
     lambda: [own_other("ladder/aoc_1x"), last_step(RESULTS / "gmsa/gmsa_1x_s0")   # both seeds' steps, or None
              if last_step(RESULTS / "gmsa/gmsa_1x_s0") == last_step(RESULTS / "gmsa/gmsa_1x_s1") else None,
              own_other("gmsa/gmsa_1x_s0"),
              own_other("gmsa/gmsa_1x_s1")]),
    # ICAE's capacity probe at 1:1, 1,000 steps: its loss at four steps, its last, the probe's lr and own/other
    ("recipes/README.md", "[its record](results/ladder/capacity_icae_1000.md)) goes on falling, {} at {}, {} at {}, {} "
                          "at {}, {} at {} ({} at {}: Adam at lr {} overshoots), own/other {} at the end",
     lambda: (lambda p, loss: [v for s in (300, 500, 700, 950) for v in (loss[s], s)]
              + [loss[max(loss)], max(loss), p["lr"], p["own_other"]])(
         (p := json.loads((RESULTS / "ladder/capacity_icae_1000.json").read_text())[0]),
         {c["step"]: c["loss"] for c in p["curve"]})),
    # what the decoder sees of CompLLM's CEs (recipes/diagnosis.py): at init and after training
    ("recipes/README.md", "{} held-out texts of {} tokens, as no held-out paragraph reaches the run's {}; [its record]"
                          "(results/compllm/compllm_s0/diagnosis.json)): the CEs sit at {} times the token embeddings' "
                          "norm at init and {} after {} steps; their key spread across texts rises from {} to {}, and "
                          "the decoder's attention on them in layers {}-{} / {}-{} from {} / {} to {} / {}",
     lambda: (lambda d: [d["texts"], d["n"], args("compllm/compllm_s0")["max_len"], d["init"]["embed_norm_ratio"],
                         d["trained"]["embed_norm_ratio"], d["step"],
                         *(sum(x["spread"] for x in d[s]["layers"]) / len(d[s]["layers"]) for s in ("init", "trained")),
                         *(bound for g in (2, 3) for bound in   # groups_of's third and fourth fifths of the layers
                           (g * len(d["init"]["layers"]) // 5, (g + 1) * len(d["init"]["layers"]) // 5 - 1)),
                         *(groups_of([x["attention"] for x in d[s]["layers"]])[g] for s in ("init", "trained")
                           for g in (2, 3))])(record(RESULTS / "compllm/compllm_s0", "diagnosis"))),
    ("recipes/README.md", "own/other {} on the answers ([its record](results/compllm/compllm_s0/eval_qa.json); {} on "
                          "the AE loss, which this run never trained)",
     lambda: [record(RESULTS / "compllm/compllm_s0", "eval_qa")["loss"]["own_other_ratio"],
              record(RESULTS / "compllm/compllm_s0", "diagnosis")["trained"]["own_other"]]),
    ("recipes/README.md", "On SmolLM2-135M-Instruct, {} samples per cell, seed {} "
                          "([its record](results/needle/smollm2_500x_1step.json)",
     lambda: [(d := read(str(RESULTS / "needle" / "smollm2_500x_1step.json")))["n"], d["seed"]]),
    # AOC at 4x on the CPU: the three arms' lead
    ("recipes/README.md", "nothing else (`tests/test_records.py`); a step at batch {} takes {} s here (the median of "
                          "its {})",
     lambda: [args(AOC_CPU)["batch_size"], median(dts := [r["dt"] for r in log_rows(RESULTS / AOC_CPU) if "dt" in r]),
              len(dts)]),
    ("recipes/README.md", "the one training setting besides the dtype in which the H100's and the H200's records differ "
                          "(tested), with a check every {} steps",
     lambda: [args(AOC_CPU_WARM)["eval_every"]]),
    ("recipes/README.md", "whose held-out check also scores texts shorter than {} tokens ({} tokens per slot when "
                          "`evaluate.py` scored the H100 arm)",
     lambda: [args(AOC_CPU_OLD)["max_len"], scored(RESULTS / AOC_H100)["tokens_per_slot"]["mean"]]),
    ("recipes/README.md", "At equal steps today's code stays at [{}](results/ladder_cpu_aoc/aoc_fp32_warm54_4x) at "
                          "step {} with the H100's warmup too, where [the H100's code on this CPU]"
                          "(results/ladder_cpu_aoc/aoc_oldcode_4x) falls as the H100 did ({} and {} at steps {} and {}; "
                          "the H100's {} and {})",
     lambda: [evals(AOC_CPU_WARM)[200]["own_other"], 200, evals(AOC_CPU_OLD)[90]["own_other"],
              evals(AOC_CPU_OLD)[180]["own_other"], 90, 180, evals(AOC_H100)[90]["own_other"],
              evals(AOC_H100)[180]["own_other"]]),
    # the collapse levers' protocol: what the three arms share (None where they differ)
    ("recipes/README.md", "one protocol: {}-token texts in one chunk with their [BOS] (`--chunk-len 65`), {} slots, so {} "
                          "tokens per slot for every text; {} steps at batch {}, seed {}, {} held-out texts checked "
                          "every {} steps; then `recipes/diagnosis.py` on {} held-out texts at init and at step {} "
                          "([the records](results/ladder_collapse/))",
     collapse_protocol),
    # AOC at 4x on the GPUs: the H200's checks, its end, and the H100's end
    ("recipes/README.md", "On the H200 ([its record](results/ladder_h200/aoc_long+batch16_4x): `long+batch16`, planned "
                          "{} steps, its lr warmed up over the AOC code's {}, stopped by the deadline at {}) AOC's "
                          "held-out check was {} at step {} and {} at step {}, and `evaluate.py` scored the last "
                          "checkpoint (step {}) at **{}** at {}, slower than [the H100 run's]"
                          "(results/ladder/aoc_long+batch16_4x) {} at {} after {} steps ({} warm-up steps",
     lambda: [args(AOC_H200)["steps"], args(AOC_H200)["warmup"], last_step(RESULTS / AOC_H200),
              evals(AOC_H200)[600]["own_other"], 600, evals(AOC_H200)[1400]["own_other"], 1400,
              last_step(RESULTS / AOC_H200), own_other(AOC_H200), scored(RESULTS / AOC_H200)["tokens_per_slot"]["mean"],
              own_other(AOC_H100), scored(RESULTS / AOC_H100)["tokens_per_slot"]["mean"],
              last_step(RESULTS / AOC_H100), args(AOC_H100)["warmup"]]),
    # the 8x rung's LoRA arm: its texts, slots and compression, each logged check and its end
    ("recipes/README.md", "At 8x ({}-token texts into {} slots, {} tokens per slot on {} held-out texts of >= {} "
                          "tokens) the LoRA baseline does not carry within {} steps but falls fast: {} / {} / {} / {} "
                          "/ {} / **{}** at {}-{} ([its record](results/ladder_8x/lora_8x), its logged checks; scored "
                          "at the end, {} at {})",
     lambda: [(e := scored(RESULTS / "ladder_8x/lora_8x"))["protocol"]["n"], args("ladder_8x/lora_8x")["mem"],
              e["tokens_per_slot"]["mean"], len(e["examples"]), e["protocol"]["min"],
              last_step(RESULTS / "ladder_8x/lora_8x"),
              *(c["own_other"] for s, c in sorted(evals("ladder_8x/lora_8x").items()) if s),
              min(s for s in evals("ladder_8x/lora_8x") if s), max(evals("ladder_8x/lora_8x")),
              own_other("ladder_8x/lora_8x"), e["tokens_per_slot"]["mean"]]),
    ("recipes/README.md", "Records: `results/ladder/{{pcc,pic}}_kv_4x` (seed {}), `results/ladder_s1/` (seed {})",
     lambda: [seeds("ladder/pcc_kv_4x", "ladder/pic_kv_4x"), seeds("ladder_s1/pcc_kv_4x", "ladder_s1/pic_kv_4x")]),
]


def prose_sentences(text):
    """(start, end) of every sentence of prose: paragraphs (a bullet starts one) outside code blocks, tables, images,
    headings and HTML comments, cut after a full stop, '?' or '!' (and a closing parenthesis) that ends a sentence."""
    spans, start, end, fenced, pos = [], None, None, False, 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
        breaks = fenced or stripped.startswith("```") or not stripped or stripped.startswith(("|", "#", "<!--", "!["))
        if breaks or stripped.startswith("- "):
            if start is not None:
                spans.append((start, end))
            start = None
        if not breaks:
            start = pos if start is None else start
            end = pos + len(line.rstrip())
        pos += len(line)
    if start is not None:
        spans.append((start, end))
    out = []
    for a, b in spans:
        cut = a
        for m in re.finditer(r"[.!?]\)?(?=\s+\S)", text[a:b]):
            if not text[a:a + m.start()].endswith(NOT_AN_END):
                out.append((cut, a + m.end()))
                cut = a + m.end()
        out.append((cut, b))
    return [(a + len(text[a:b]) - len(text[a:b].lstrip()), b) for a, b in out]


def numbers_in(sentence):
    """The spans of the numbers a sentence prints: its code spans and link targets blanked first."""
    blank = lambda m: " " * len(m.group(0))
    masked = re.sub(r"\]\([^)]*\)", lambda m: "]" + " " * (len(m.group(0)) - 1), re.sub(r"`[^`]*`", blank, sentence))
    return [m.span() for m in NUMBER.finditer(masked)]


def prose_same(printed, value):
    """`same`, and a printed value that is not the value exactly keeps at least two significant digits ("0.3" for
    0.277 fails, "4" for 4.00 passes)."""
    text = printed.replace(",", "")
    if value is None or isinstance(value, bool) or not NUMBER.fullmatch(printed):
        return False
    mantissa, _, exp = text.partition("e")
    places = len(mantissa.partition(".")[2]) - int(exp or 0)
    if abs(value - float(text)) > 0.5 * 10 ** -places * (1 + 1e-9):
        return False
    return float(text) == value or len(mantissa.replace(".", "").lstrip("0")) >= 2


def anchor(template):
    """A PROSE template as a regex: its words literal (any run of white space where it has a space), a number group
    at each {}."""
    words = [r"\s+".join(map(re.escape, w.replace("{{", "{").replace("}}", "}").split(" ")))
             for w in re.split(r"(?<!\{)\{\}(?!\})", template)]
    return re.compile(f"({NUMBER.pattern})".join(words))


def check_prose(readme, path=None):
    """Every problem of `readme`'s prose (read from `path`, a copy, where given): each PROSE entry found in exactly
    one sentence that links a record, each of its numbers its record's, and every number of such a sentence in an
    entry. Returns (problems, {entry index: the file spans of its numbers})."""
    text = Path(path or REPO / readme).read_text()
    linked = [(a, b) for a, b in prose_sentences(text) if RECORD_LINK.search(text[a:b])]
    problems, covered, spans = [], set(), {}
    for i, (name, template, derive) in enumerate(PROSE):
        if name != readme:
            continue
        found = [(a, m) for a, b in linked for m in [anchor(template).search(text[a:b])] if m]
        if len(found) != 1:
            problems.append(f"{readme}: {template[:70]!r} is in {len(found)} sentences that link a record, not 1")
            continue
        a, m = found[0]
        spans[i] = [(a + m.start(g), a + m.end(g)) for g in range(1, len(m.groups()) + 1)]
        covered |= {span for span in spans[i]}
        values = derive()
        printed = list(m.groups())
        if len(values) != len(printed) or not all(prose_same(p, v) for p, v in zip(printed, values)):
            problems.append(f"{readme}: {template[:70]!r} prints {printed}, its records give {values}")
    for a, b in linked:
        loose = [text[a + s:a + e] for s, e in numbers_in(text[a:b]) if (a + s, a + e) not in covered]
        if loose:
            problems.append(f"{readme}: {loose} in {text[a:b][:90]!r}... link a record and have no entry in PROSE")
    return problems, spans


def test_every_number_of_a_sentence_that_links_a_record_is_its_records():
    """Each PROSE entry against its records, at the digits it prints and with two significant digits at least."""
    problems = [p for readme in READMES for p in check_prose(readme)[0]]
    assert not problems, "\n".join(problems)


def test_every_number_of_a_sentence_that_links_a_record_has_an_entry(tmp_path):
    """A number added to a sentence that links a record fails until PROSE has an entry for it."""
    readme = "recipes/README.md"
    text = (REPO / readme).read_text()
    old = "**LoRA targets and rank**, from scratch,"
    assert text.count(old) == 1
    (tmp_path / "README.md").write_text(text.replace(old, "**LoRA targets and rank**, from scratch in 1,600 s,"))
    problems, _ = check_prose(readme, tmp_path / "README.md")
    assert len(problems) == 1 and "['1,600']" in problems[0], problems


def test_a_printed_digit_changed_in_the_prose_fails(tmp_path):
    """The prose check is not vacuous: each number of each PROSE entry, one printed digit changed in a copy of its
    README, is caught; among them a plain value (0.256), a ratio (2.3×), a count (7,382,016 parameters) and a range
    (BLEU-4 between 0.398 and 0.455)."""
    kinds = {"0.256", "2.3", "7,382,016", "0.398", "0.455"}
    cases = 0
    for readme in READMES:
        text = (REPO / readme).read_text()
        for i, number_spans in check_prose(readme)[1].items():
            for a, b in number_spans:
                last = max(j for j in range(a, b) if text[j].isdigit())
                digit = int(text[last])
                changed = text[:last] + str(digit + 1 if digit < 9 else digit - 1) + text[last + 1:]
                (tmp_path / "README.md").write_text(changed)
                problems, _ = check_prose(readme, tmp_path / "README.md")
                assert any(PROSE[i][1][:70] in p and "its records give" in p for p in problems), (readme, text[a:b])
                kinds.discard(text[a:b])
                cases += 1
    assert not kinds and cases > 50, (kinds, cases)


def test_a_coarser_rounding_fails(tmp_path):
    """A printed value needs two significant digits unless it is the record's value exactly: "about 2 s" for a median
    step of 1.84 s fails, though 2 is 1.84 at its one digit."""
    assert prose_same("0.277", 0.2771) and not prose_same("0.3", 0.277) and prose_same("4", 4.0)
    assert prose_same("2e-4", 0.0002) and prose_same("7,382,016", 7382016) and not prose_same("2", 1.84)
    assert prose_same("1.8", 1.84) and not prose_same("0.28", 0.2771 + 0.01)
    text = (REPO / "recipes" / "README.md").read_text()
    assert text.count("takes 1.8 s here") == 1
    (tmp_path / "README.md").write_text(text.replace("takes 1.8 s here", "takes 2 s here"))
    problems, _ = check_prose("recipes/README.md", tmp_path / "README.md")
    assert len(problems) == 1 and "prints ['4', '2', '1,500']" in problems[0], problems


# ---- the code's own numbers: the tiny demo's table, the reading guide's sentence ----

def test_the_tiny_demo_table_states_each_presets_n_m_and_steps(device):
    """recipes/README.md's table of the tiny demo ("n (bytes) | m | steps") says what the code does: each preset's
    demo run compresses an n-byte text into m vectors (GMSA: [BOS] and 8 bytes in groups of 2 are 5, not n/2 = 4);
    a row with flags (`aoc --mem 4`, the quickstart's 4x) is that command."""
    import cli
    import data as D
    import train
    readme = (REPO / "recipes" / "README.md").read_text()
    rows = {m: (int(n), int(k), int(steps.replace(",", ""))) for m, n, k, steps in
            re.findall(r"^\| `(\w+(?: --[\w-]+ \S+)*)` \| (\d+) \| (\d+) \| ([\d,]+) \|", readme, flags=re.M)}
    assert {m.split()[0] for m in rows} == set(cli.TINY) and "aoc --mem 4" in rows
    for command, (n, m, steps) in rows.items():
        method, *flags = command.split()
        s = cli.parse_args(["--method", method, *flags])
        comp = train.build_compressor(s.config, device)
        x = list(D.BUILTIN_TEXTS[0].encode())[:s.max_len]
        ratios = [comp.cfg.ratios[0]] if comp.cfg.source == "group_mean" else None
        assert (s.max_len, sum(comp.compress([comp.encoder_ids(x)], ratios=ratios).slots[0]), s.steps) \
            == (n, m, steps), method


GUIDE = "| method | functions it runs"   # README.md's reading guide: the table tests/reading_guide.py prints


def guide_row(text, method):
    """The numbers of `method`'s row in the reading guide's table of `text`: the functions and files of a one-step run,
    then one train_step's switches between files, its functions and their files."""
    (_, _, rows, _), = [t for t in tables(text) if t[0].startswith(GUIDE)]
    run, step = next(row for row in rows if row[0] == f"`{method}`")[-2:]
    return ([int(n) for n in re.fullmatch(r"(\d+) in (\d+)", run).groups()],
            [int(n) for n in re.fullmatch(r"(\d+) \((\d+) in (\d+)\)", step).groups()])


# (the words around the numbers, one {} each, what the table gives: a function of README.md's text), as in PROSE
GUIDE_PROSE = [
    ("calls: AOC's {} in {} files (", lambda text: guide_row(text, "aoc")[0]),
    ("One `train_step` (`--step aoc`) calls {} of them in {} files and, in first-call order, turns from one file to "
     "another {} times", lambda text: [(step := guide_row(text, "aoc")[1])[1], step[2], step[0]]),
]


def check_guide_prose(path=None):
    """Every problem of README.md's sentences about the reading guide (read from `path`, a copy, where given): each
    GUIDE_PROSE entry found in exactly one sentence, its numbers those of the guide's table. Returns (problems, the
    file spans of the numbers)."""
    text = Path(path or REPO / "README.md").read_text()
    problems, spans = [], []
    for template, derive in GUIDE_PROSE:
        found = [(a, m) for a, b in prose_sentences(text) for m in [anchor(template).search(text[a:b])] if m]
        if len(found) != 1:
            problems.append(f"README.md: {template[:70]!r} is in {len(found)} sentences, not 1")
            continue
        a, m = found[0]
        spans += [(a + m.start(g), a + m.end(g)) for g in range(1, len(m.groups()) + 1)]
        printed, values = list(m.groups()), derive(text)
        if len(values) != len(printed) or not all(prose_same(p, v) for p, v in zip(printed, values)):
            problems.append(f"README.md: {template[:70]!r} prints {printed}, the reading guide's table gives {values}")
    return problems, spans


def test_the_reading_guides_sentence_states_its_tables_numbers(tmp_path):
    """README.md's sentence above the reading guide (AOC's one-step run: its functions and files; one train_step:
    its functions, files and switches between files) prints the numbers of the table's `aoc` row, and a digit
    changed in any of them fails."""
    problems, spans = check_guide_prose()
    assert not problems and len(spans) == 5, problems
    text = (REPO / "README.md").read_text()
    for a, b in spans:
        last = max(j for j in range(a, b) if text[j].isdigit())
        digit = int(text[last])
        (tmp_path / "README.md").write_text(text[:last] + str(digit + 1 if digit < 9 else digit - 1) + text[last + 1:])
        assert any("the reading guide's table gives" in p for p in check_guide_prose(tmp_path / "README.md")[0])


# ---- the push section's curves: its records' checks, as recipes/README.md prints them ----

def marked(tag):
    """recipes/README.md's text between <!-- tag --> and <!-- /tag -->, stripped."""
    text = (REPO / "recipes" / "README.md").read_text()
    return re.search(rf"<!-- {tag} -->\s*\n(.*?)\n\s*<!-- /{tag} -->", text, re.S).group(1).strip()


def test_the_push_curves_are_their_records():
    """The two curves between <!-- push curve --> markers: each step's own/other, BLEU-4, ROUGE-L, from the checks
    the runs logged (the batch-16 curve counts from the main arm's step 1,500: lora_b16_4x, then lora_b16long_4x from
    step 100, then lora_b16long2_4x from step 500)."""
    def line(points):
        return "; ".join(f"{s:,}: " + ", ".join("-" if e.get(k) is None else f"{e[k]:.3f}"
                                                 for k in ("own_other", "bleu4_words", "rougeL")) for s, e in points)
    main = evals("push/lora_long_4x")
    assert marked("push curve") == line((s, main[s]) for s in sorted(main) if s >= 300 and s % 100 == 0)
    b16 = [(s + offset, e) for run, offset in (("push/lora_b16_4x", 0), ("push/lora_b16long_4x", 100),
                                               ("push/lora_b16long2_4x", 500))
           for s, e in sorted(evals(run).items()) if s > 0]
    assert marked("push curve b16") == line(b16)


# ---- the push's continuation: recipes/plateau.py's tables, as the records give them ----

PLATEAU = ["--out", "recipes/results/push", "--metric", "BLEU-4 (words)=ae:scores.compressed.bleu4_words",
           "--start", "../push_rebuild/lora_b16long2_4x", "--arm", "decay", "lora_cont_decay_4x",
           "--arm", "constant", "lora_cont_const_4x",
           "--rerun", "recipes/results/push_rebuild/lora_b16long2_4x", "recipes/results/push/lora_b16long2_4x"]


def test_the_continuations_plateau_tables_are_their_records(tmp_path, monkeypatch):
    """recipes/plateau.py run again on the continuation's records (each kept checkpoint's eval_ae.json, the start's)
    prints the tables recipes/results/push/plateau.md keeps and recipes/README.md shows between <!-- push plateau -->
    markers: a number edited in either, or a record changed under them, fails here."""
    import plateau
    for run in ("push/lora_cont_decay_4x", "push/lora_cont_const_4x", "push/lora_b16long2_4x", "push_rebuild"):
        (tmp_path / "recipes/results" / run).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "recipes/results" / run).symlink_to(RESULTS / run)
    monkeypatch.chdir(tmp_path)
    plateau.main(PLATEAU)
    fresh = (tmp_path / "recipes/results/push/plateau.md").read_text().strip()
    assert (RESULTS / "push" / "plateau.md").read_text().strip() == fresh
    assert (json.loads((RESULTS / "push" / "plateau.json").read_text())
            == json.loads((tmp_path / "recipes/results/push/plateau.json").read_text()))
    assert marked("push plateau") == fresh


# ---- AOC at 4x on the CPU beside the H200: what the two arms changed ----

def differ(run_a, run_b, part, named=False):
    """The keys of compressor.json's `part` (config, train_args) in which two runs' records differ; named=True: only
    where both name a value (an older record leaves a preset's own settings, or an option added since, as null)."""
    a, b = (record(RESULTS / run, "compressor")[part] for run in (run_a, run_b))
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not (named and None in (a.get(k), b.get(k)))}


def test_the_cpu_aoc_arm_changes_only_the_frozen_dtype_against_the_h200s():
    """recipes/README.md says the CPU's AOC arm is the H200's with `--frozen-dtype fp32`: their compressors' configs
    are the same but for the model folder's name (and options added since, where the H200's names none), and their
    training settings differ, where both name one, only in the dtype and where the files are."""
    assert differ(AOC_H200, AOC_CPU, "config", named=True) == {"model"}
    assert differ(AOC_H200, AOC_CPU, "train_args", named=True) == {"frozen_dtype", "data", "eval_data", "model", "out"}
    assert (args(AOC_H200)["frozen_dtype"], args(AOC_CPU)["frozen_dtype"]) == ("auto", "fp32")
    assert record(RESULTS / AOC_H200, "eval_ae")["accelerator"].startswith("NVIDIA")   # auto: bf16 on CUDA


def test_the_h100_and_h200_aoc_arms_differ_in_training_only_in_the_warmup():
    """recipes/README.md says the warmup is the one training setting (besides the dtype, which the H100's record does
    not name) in which the H100's and the H200's AOC 4x arms differ: the planned steps (a constant lr after the
    warmup: the plan changes no step), the checks' and saves' cadence and the paths aside."""
    assert differ(AOC_H100, AOC_H200, "config") == set()
    flags = differ(AOC_H100, AOC_H200, "train_args", named=True)
    assert flags - {"data", "eval_data", "out", "resume", "save_every", "eval_every", "steps"} == {"warmup"}, flags
    assert {args(AOC_H100)["schedule"], args(AOC_H200)["schedule"]} == {"constant"}


def test_the_cpu_warmup_arm_changes_only_the_warmup_against_the_cpu_aoc_arm():
    """recipes/README.md's second CPU arm is the first with the H100's warmup: nothing else differs but the cadence
    of its checks and saves and where its files are."""
    assert differ(AOC_CPU, AOC_CPU_WARM, "config") == set()
    flags = differ(AOC_CPU, AOC_CPU_WARM, "train_args")
    assert flags - {"out", "save_every", "eval_every", "keep_every"} == {"warmup"}, flags
    assert record(RESULTS / AOC_CPU_WARM, "args")["warmup"] == args(AOC_H100)["warmup"]


def test_the_cpu_old_code_arm_is_the_h100_runs_command():
    """The CPU's run of the H100's code is the H100 arm's command: the same compressor and training settings, the
    planned steps (a constant lr after the same 54 warm-up steps), the paths and the resume aside."""
    assert differ(AOC_H100, AOC_CPU_OLD, "config") == {"model"}
    flags = differ(AOC_H100, AOC_CPU_OLD, "train_args")
    assert flags - {"data", "eval_data", "out", "resume", "steps", "model"} == set(), flags
