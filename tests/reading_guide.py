"""The README's reading guide: for each method, the functions to read from its preset to the decoder's input, in the
order they run, with the lines of each that the method runs, and the conditions on the config its forward pass meets.

    python tests/reading_guide.py          # the markdown the README shows

Measured, not listed by hand: each preset is built on the tiny model, compresses two texts and builds the decoder
input for AE, under sys.settrace. A line is a line of code the method runs in presets.py, compressors.py,
positions.py or masks.py, a statement over several lines counting all of them. Not counted: the LLM itself
(model.py), comments, docstrings, the branches the method never takes, and input checks (validate, positions' and
masks' _check_*, every `if bad: raise` or `fail(...)` and the loops of nothing else), which say what a method refuses
rather than what it does. The config conditions are the `if`s and conditional expressions whose test reads the
config (cfg.x, self.cfg.x) and that run in the forward pass (compress and decoder_batch): what construction chose
once is not counted again. The training column counts, the same way, the lines of train.py and data.py that one
training step of the preset runs (train.main with the tiny demo's settings, one step, no held-out check: arguments,
data, the step, the checkpoint). The last column is the whole run that step sits in (whole_run): the distinct
functions of the project, and the files they are in, that `python train.py --method METHOD --steps 1 --eval-every 0`
calls, settings, build, data, step and save. The last column follows one training step of that run (step_path:
train.train_step: forward, backward, clip and the optimizer step over the micro-batches the loop drew): the project functions in the order first called,
and how often that order turns from one file to another.

    python tests/reading_guide.py --step METHOD   # that order, function by function
"""

import ast
import contextlib
import functools
import io
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FILES = {str(ROOT / f): f for f in ("presets.py", "compressors.py", "positions.py", "masks.py")}
TRAINING = {str(ROOT / f): f for f in ("train.py", "data.py")}   # the training column's files
CHECKS = {"validate", "_check_int", "_check_choice", "_check_mem"}   # input checks


def is_check(node) -> bool:
    """An input check: `if bad: raise ...`, a call of a _check_* helper, or a loop of nothing but checks."""
    if isinstance(node, ast.If):
        return not node.orelse and all(isinstance(n, ast.Raise) or is_check(n) for n in node.body)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):   # a _check_* helper, or train.py's fail()
        return getattr(node.value.func, "id", "").startswith("_check") or getattr(node.value.func, "id", "") == "fail"
    if isinstance(node, ast.For):
        return not node.orelse and all(is_check(n) for n in node.body)
    return False


def statements(path):
    """line -> (first, last line of the smallest statement starting there, or a compound statement's header),
    and line -> whether it is an if/conditional expression reading the config."""
    tree = ast.parse(Path(path).read_text())
    spans, conds, guards = {}, {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = node.end_lineno
            if isinstance(body, list) and body:   # a compound statement is read as its header: the lines up to the
                # end of its test / iterable / context (comments between the header and its body are not code)
                header = [c.context_expr if isinstance(c, ast.withitem) else c for c in ast.iter_child_nodes(node)
                          if not isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))]
                last = max([node.lineno] + [c.end_lineno for c in header if hasattr(c, "end_lineno")])
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                last = node.lineno   # a def is read as its signature line; its docstring is not code
            spans.setdefault(node.lineno, (node.lineno, max(last, node.lineno)))
        if isinstance(node, ast.stmt) and is_check(node):
            guards.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.If, ast.IfExp)) and any(
                isinstance(n, ast.Attribute) and "cfg" in (getattr(n.value, "id", ""), getattr(n.value, "attr", ""))
                for n in ast.walk(node.test)):
            conds[node.lineno] = True
    spans = {line: span for line, span in spans.items() if line not in guards}
    return spans, conds


def by_path(files):
    """files (path -> name) as a lookup of a code object's file name: a module imported by another path to the same
    file (a/../runlog.py, from a sys.path entry written so) is that file."""
    return functools.lru_cache(maxsize=None)(lambda f: files.get(os.path.normpath(f)))


def line_tracer(files, runs, also=None):
    """A sys.settrace tracer that adds each line run in `files` (path -> name) to runs[(name, function)], and calls
    also(name, line) for it."""
    named = by_path(files)

    def tracer(frame, event, arg):
        name = named(frame.f_code.co_filename)
        if name is None:
            return None
        if event == "line":
            # a comprehension or lambda is read as part of the function that holds it
            runs[(name, frame.f_code.co_qualname.split(".<locals>")[0])].add(frame.f_lineno)
            if also:
                also(name, frame.f_lineno)
        return tracer
    return tracer


def trace(method):
    """(function -> set of lines run, in first-run order), the config-condition lines run in the forward pass."""
    import compressors as C
    from model import build_tiny
    runs, forward, phase = defaultdict(set), set(), {"forward": False}
    tracer = line_tracer(FILES, runs, lambda name, line: phase["forward"] and forward.add((name, line)))
    torch.manual_seed(0)
    decoder, tok = build_tiny()
    texts = [tok.encode("A first short text to compress."), tok.encode("And a second one.")]
    small = {} if method in ("compllm", "gmsa") else dict(mem=4, chunk_len=16)
    sys.settrace(tracer)
    try:
        comp = C.build(method, decoder, tok, **small)
        phase["forward"] = True
        with torch.no_grad():
            comp.decoder_batch(comp.compress([comp.encoder_ids(t) for t in texts]), "ae", [comp.ae_target(t) for t in texts])
    finally:
        sys.settrace(None)
    return runs, forward


def training_lines(method) -> int:
    """The lines of train.py and data.py that one training step of `method` runs, from train.main to the checkpoint
    after it (the tiny demo's settings: its objective, one step, no held-out check), counted as the compressor's."""
    import train
    runs = defaultdict(set)
    tracer = line_tracer(TRAINING, runs)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):   # the run's own log lines are not the guide
        sys.settrace(tracer)
        try:
            train.main(["--method", method, "--steps", "1", "--eval-every", "0", "--device", "cpu", "--out", out])
        finally:
            sys.settrace(None)
    parsed = {f: statements(ROOT / f)[0] for f in TRAINING.values()}
    read = lambda f, lines: {n for line in lines if line in parsed[f] for n in range(parsed[f][line][0],
                                                                                     parsed[f][line][1] + 1)}
    return sum(len(read(f, lines)) for (f, name), lines in runs.items() if name not in CHECKS)


@functools.lru_cache(maxsize=None)
def traced_run(method) -> tuple:
    """The project functions (file, qualified name) that a one-step run of `method` calls, from train.main to its
    checkpoint: `python train.py --method METHOD --steps 1 --eval-every 0` on the tiny demo, traced by call events
    over every top-level module (a comprehension, lambda or generator is part of its function; a nested def counts).
    Returns (every one of them, in the order first called; those called while train.train_step runs, in the order
    first called there). One traced run serves whole_run and step_path."""
    import train
    modules = {str(p): p.name for p in ROOT.glob("*.py")}
    named = by_path(modules)
    seen, step, inside = {}, {}, []   # dicts as ordered sets; the train_step frames now running

    def tracer(frame, event, arg):
        code = frame.f_code
        if event != "call" or named(code.co_filename) is None:
            return None
        if code is train.train_step.__code__:
            inside.append(frame)
        if "<" not in code.co_qualname.rpartition(".")[2]:
            key = (named(code.co_filename), code.co_qualname)
            seen.setdefault(key)
            if inside:
                step.setdefault(key)
        return on_return if code is train.train_step.__code__ else None

    def on_return(frame, event, arg):   # train_step's own frame: its lines, and its return (an exception's too)
        if event == "return":
            inside.remove(frame)
        return on_return
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        sys.settrace(tracer)
        try:
            train.main(["--method", method, "--steps", "1", "--eval-every", "0", "--device", "cpu", "--out", out])
        finally:
            sys.settrace(None)
    return list(seen), list(step)


def whole_run(method) -> tuple:
    """(distinct project functions, files, the functions sorted) that a one-step run of `method` calls (traced_run)."""
    seen = traced_run(method)[0]
    return len(seen), len({f for f, _ in seen}), sorted(seen)


def step_path(method) -> tuple:
    """The project functions that ONE training step of `method` calls (train.train_step of traced_run's run: its
    batch, forward, backward and optimizer step), in the order first called, as (file, function); and how often
    that order crosses from one file to another: the files a reader of the step turns between, in order."""
    path = traced_run(method)[1]
    return path, sum(a[0] != b[0] for a, b in zip(path, path[1:]))


def guide():
    import presets as P
    parsed = {f: statements(ROOT / f) for f in FILES.values()}
    rows, totals = [], {}
    presets = next(n.value for n in ast.parse((ROOT / "presets.py").read_text()).body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PRESETS")
    for method in P.METHODS:
        runs, forward = trace(method)
        entry = next(v for k, v in zip(presets.keys, presets.values) if k.value == method)
        size = entry.end_lineno - entry.lineno + 1         # the preset record itself, then the code it runs
        parts, total = [f"`PRESETS[\"{method}\"]` ({size})"], size
        read = defaultdict(set)   # lines of code run, per function; a line shared by two calls counts once
        for (f, name), lines in runs.items():
            spans = parsed[f][0]
            read[(f, name)] |= {n for line in lines if line in spans for n in range(spans[line][0], spans[line][1] + 1)}
        for (f, name), lines in read.items():
            if name in CHECKS or not lines:
                continue
            parts.append(f"`{name}` ({len(lines)})")
            total += len(lines)
        conds = sum(1 for f, line in forward if parsed[f][1].get(line))
        totals[method] = (total, conds)
        functions, files, _ = whole_run(method)
        path, switches = step_path(method)
        rows.append(f"| `{method}` | {', '.join(parts)} | {total} | {conds} | {training_lines(method)} | "
                    f"{functions} in {files} | {switches} ({len(path)} in {len({f for f, _ in path})}) |")
    return "\n".join(["| method | functions it runs, in order (lines of each it runs) | lines | config conditions "
                      "in its forward pass | training: lines of train.py + data.py one step runs | a one-step run: "
                      "project functions in files | one train_step: switches between files in first-call order "
                      "(functions in files) |", "|---|---|---|---|---|---|---|"] + rows), totals


if __name__ == "__main__":
    if sys.argv[1:2] == ["--step"]:
        path, switches = step_path(sys.argv[2])
        print("\n".join(f"{f:16} {name}" for f, name in path) + f"\n{switches} switches between files")
    else:
        print(guide()[0])
