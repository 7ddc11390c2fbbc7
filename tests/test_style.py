"""Style and reading guards of the code base, apart from the tests of behaviour (STYLE.md rule 17): every paper item
the code cites leads to its test; each preset, a one-step run and one training step read in one sitting, train.py in
the order it runs and the README's Install in two commands; the Compressor class stays under 450 lines; the READMEs'
generated tables are the code's output; one word, one meaning; docstrings say what the code does; every import is
used, and metrics.py imports no torch.

From each paper item to its test: the code names its source next to the line (rule 2: `# PIC Eq. (5), rule 3`,
`EPL Table 13`, `AOC §2`), and tests/README.md opens with a table that leads from each item so cited to the test
that checks it. Here the citations are read again from the top-level *.py files on every run (comments, docstrings
and help strings alike), and the table must hold exactly one row for each, every test a row names must exist, and no
row may name an item the code does not cite. A row whose test cell is "—" (no test checks the item) is reported
too: every item the code cites has a test.

An item is a paper, a kind and a number: `PIC Eq. (5)`, `PIC Eq. 5` and `PIC, Eq. (5)` are one item, "PIC Eq. 5".
The paper's name opens the citation; what follows it, joined by ",", "and" or "/", belongs to the same paper
(`PIC paper §3.1, Eq. 2, Figure 4(a)`: three items), and a range names every number in it (`CompLLM Eq. (1)-(3)`,
`EPL Tables 13–15`). A number cited without its paper's name in front (`Table 6` inside positions.py) is not read.
"""

import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compressors as C
import masks
import plan
import presets as P
from test_compressors import tiny

REPO = Path(__file__).resolve().parents[1]
README = REPO / "tests" / "README.md"
HEADING = "## From each paper item to its test"
NO_TEST = "—"

PAPERS = ("PIC", "EPL", "CompLLM", "GMSA", "AOC", "ICAE", "500xCompressor", "500x", "PCC")   # 500xCompressor: "500x"
KINDS = (  # (how the code writes it, the one name of the kind)
    (r"Eqs?\.|Equations?", "Eq."),
    (r"Fig(?:ure)?s?\.?", "Fig."),
    (r"Tables?", "Table"),
    (r"Algorithms?|Alg\.", "Algorithm"),
    (r"App\.|Appendix", "App."),
    (r"§", "§"),
)
PAPER_RE = re.compile(r"\b(%s)(?:\s+paper)?,?\s+" % "|".join(PAPERS))
KIND_RE = re.compile(r"(?:%s)\s*" % "|".join(f"({pattern})" for pattern, _ in KINDS))
NUM = r"\(?\d+(?:\.\d+)*(?:\(?[a-z]\))?\)?"                    # 5, (5), 3.3.1, 4c, 4(c)
NUM_RE = re.compile(rf"({NUM})(?:\s*[-–]\s*({NUM}))?")          # and a range: 6-8, (1)-(3), 13–15
APPENDIX_RE = re.compile(r"([A-Z](?:\.\d+)*)\b()")              # App. C, App. A.1
JOIN_RE = re.compile(r",\s*|\s+and\s+|\s*/\s*")                 # another number or kind of the same paper follows
SPACE_RE = re.compile(r"\s+")
# a comment or a string literal that goes on on the next line, blanked to spaces of the same length (so that offsets,
# and with them line numbers, stay those of the file): "PIC Table\n# 2" reads as "PIC Table   2"
WRAP_RE = re.compile(r"\n\s*#|[\"']\s*\n\s*f?[\"']")


def _numbers(first: str, last: str | None) -> list:
    """The numbers a citation names: "(5)" -> ["5"], "4(c)" -> ["4c"], "6", "8" -> ["6", "7", "8"],
    "3.2", "3.5" -> ["3.2", "3.3", "3.4", "3.5"]."""
    first = first.replace("(", "").replace(")", "")
    if not last:
        return [first]
    last = last.replace("(", "").replace(")", "")
    head, _, a = first.rpartition(".")
    head_b, _, b = last.rpartition(".")
    if head != head_b or not (a.isdigit() and b.isdigit()):
        return [first, last]
    return [f"{head}.{i}" if head else str(i) for i in range(int(a), int(b) + 1)]


def cited_items(text: str) -> list:
    """[((paper, kind, number), line)] for every paper item `text` cites, in order, repeats kept."""
    flat = WRAP_RE.sub(lambda m: " " * len(m.group()), text)
    found = []
    for paper in PAPER_RE.finditer(flat):
        pos, kind = paper.end(), None
        while True:
            k = KIND_RE.match(flat, pos)
            if k:
                kind, pos = next(name for (_, name), g in zip(KINDS, k.groups()) if g), k.end()
            elif kind is None:
                break
            n = (APPENDIX_RE if kind == "App." else NUM_RE).match(flat, pos)
            if not n:
                break
            line = text.count("\n", 0, paper.start()) + 1
            name = paper.group(1).replace("500xCompressor", "500x")
            found += [((name, kind, number), line) for number in _numbers(n.group(1), n.group(2))]
            pos = n.end()
            join = JOIN_RE.match(flat, pos) or SPACE_RE.match(flat, pos)
            if not join or (join.re is SPACE_RE and not KIND_RE.match(flat, join.end())):
                break   # a space joins a kind only ("App. C Table 3"), never a bare number
            pos = join.end()
    return found


def item_name(item: tuple) -> str:
    """("PIC", "Eq.", "5") -> "PIC Eq. 5"; ("AOC", "§", "2") -> "AOC §2"."""
    paper, kind, number = item
    return f"{paper} §{number}" if kind == "§" else f"{paper} {kind} {number}"


def cited_in_code(root: Path = REPO) -> dict:
    """{item name: ["file.py:line", ...]} over the top-level *.py files (not tests/, not recipes/)."""
    cited = {}
    for path in sorted(root.glob("*.py")):
        for item, line in cited_items(path.read_text()):
            cited.setdefault(item_name(item), []).append(f"{path.name}:{line}")
    return cited


def readme_rows(text: str) -> list:
    """[(item, [test cell entries])] of the table under HEADING: | item | what the code does there (file) | test |."""
    lines = text.splitlines()
    start = lines.index(HEADING)
    rows, in_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            in_table = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]   # "\|X\|" is no border
            if cells[0] in ("item", "") or set(cells[0]) <= set("-: "):
                continue   # the header and its rule
            rows.append((cells[0], [t.strip().strip("`") for t in cells[-1].split(",")]))
        elif in_table:
            break
    return rows


def functions_in(path: Path) -> set:
    """The names of the test functions a test file defines (pytest collects those named test*)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def table_problems(cited: dict, rows: list, has_test) -> list:
    """What is wrong with the table: a cited item without a row or with several, a row for an item the code does not
    cite, a test cell of "—" (no test checks the item), a test cell that names no test (has_test(file, name) -> bool
    says whether tests/<file> defines it)."""
    problems = []
    named = [item for item, _ in rows]
    for item, where in cited.items():
        if item not in named:
            problems.append(f"{item} (cited at {where[0]}) has no row in tests/README.md")
        elif named.count(item) > 1:
            problems.append(f"{item} has {named.count(item)} rows")
    for item, tests in rows:
        if item not in cited:
            problems.append(f"{item}: a row, but the code cites it nowhere")
        if tests == [NO_TEST]:
            problems.append(f"{item}: no test checks it (its test cell is {NO_TEST})")
            continue
        for ref in tests:
            m = re.fullmatch(r"tests/(test_\w+\.py)::(\w+)", ref)
            if not m:
                problems.append(f"{item}: {ref!r} is not tests/test_x.py::test_name")
            elif not has_test(*m.groups()):
                problems.append(f"{item}: {ref} does not exist")
    return problems


def has_test(file: str, name: str) -> bool:
    path = REPO / "tests" / file
    return path.is_file() and name in functions_in(path)


# ---- the tests ----


def test_the_extractor_reads_each_way_of_citing():
    src = '''
    x = 1  # PIC Eq. (9): and PIC Eq. 9 again, PIC, Eq. (4), rule 3; PIC Eq. 7 2 tokens
    """EPL Tables 13–15 and CompLLM Eq. (1)-(3); PIC paper §3.1, Eq. 2, Figure 4(a);
    GMSA §3.2-3.4, App. C Table 3"""
    y = 2  # AOC Table
    # 4 (a comment that goes on), EPL Table 12 / Table 1; CompLLM's App. A.1, Gemma 3 report §2, 500xCompressor §3
    '''
    found = cited_items(src)
    assert found[0] == (("PIC", "Eq.", "9"), 2)
    assert [item_name(item) for item, _ in found] == [
        "PIC Eq. 9", "PIC Eq. 9", "PIC Eq. 4", "PIC Eq. 7",
        "EPL Table 13", "EPL Table 14", "EPL Table 15", "CompLLM Eq. 1", "CompLLM Eq. 2", "CompLLM Eq. 3",
        "PIC §3.1", "PIC Eq. 2", "PIC Fig. 4a", "GMSA §3.2", "GMSA §3.3", "GMSA §3.4", "GMSA App. C",
        "GMSA Table 3", "AOC Table 4", "EPL Table 12", "EPL Table 1", "500x §3"]
    assert dict(found)[("AOC", "Table", "4")] == 5   # the line where the citation starts


def test_a_missing_stale_or_doubled_row_or_a_missing_test_is_reported():
    cited = {"PIC Eq. 5": ["masks.py:99"], "EPL Table 13": ["positions.py:135"], "AOC §2": ["presets.py:272"],
             "AOC Eq. 3": ["model.py:529"]}
    rows = [("PIC Eq. 5", ["tests/test_masks.py::test_pic_rule_by_rule"]),
            ("AOC §2", [NO_TEST]), ("AOC §2", [NO_TEST]),
            ("GMSA Eq. 9", ["tests/test_compressors.py::test_no_such_test"]),
            ("EPL Table 12", ["test_positions.py::test_table12_encoder_epl"]),
            ("AOC Eq. 3", ["tests/test_masks.py::grid"])]
    assert table_problems(cited, rows, has_test) == [
        "EPL Table 13 (cited at positions.py:135) has no row in tests/README.md",
        "AOC §2 has 2 rows",
        "AOC §2: no test checks it (its test cell is —)",
        "AOC §2: no test checks it (its test cell is —)",
        "GMSA Eq. 9: a row, but the code cites it nowhere",
        "GMSA Eq. 9: tests/test_compressors.py::test_no_such_test does not exist",
        "EPL Table 12: a row, but the code cites it nowhere",
        "EPL Table 12: 'test_positions.py::test_table12_encoder_epl' is not tests/test_x.py::test_name",
        "AOC Eq. 3: tests/test_masks.py::grid does not exist",   # a helper, no test
    ]
    aoc_2 = "tests/test_compressors.py::test_memory_tokens_are_drawn_as_each_papers_code_draws_them"
    full = rows[:1] + [("AOC §2", [aoc_2]), ("EPL Table 13", ["tests/test_positions.py::test_table13_decoder_ae"]),
                       ("AOC Eq. 3", ["tests/test_model.py::test_aoc_block_is_identity_mlp"])]
    assert table_problems(cited, full, has_test) == []
    # the rows as readme_rows reads them from the markdown: an escaped | inside a cell, a test cell of several
    md = "\n".join(["# Title", "", HEADING, "", "| item | what the code does there (file) | test |", "|---|---|---|",
                    "| PIC Eq. 5 | the mask (masks.py) | tests/test_masks.py::test_pic_rule_by_rule |",
                    "| AOC §2 | a \\|X\\| cell | — |",
                    "| EPL Table 13 | positions | tests/test_positions.py::test_table13_decoder_ae, "
                    "tests/test_positions.py::test_table2_chunk_boundaries |", "", "## Next", "| a | b | c |"])
    assert readme_rows(md) == [("PIC Eq. 5", ["tests/test_masks.py::test_pic_rule_by_rule"]), ("AOC §2", [NO_TEST]),
                               ("EPL Table 13", ["tests/test_positions.py::test_table13_decoder_ae",
                                                 "tests/test_positions.py::test_table2_chunk_boundaries"])]


def test_tests_readme_opens_with_the_table_from_each_paper_item_to_its_test():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ") and HEADING in lines
    assert [line for line in lines if line.startswith("## ")][0] == HEADING, "the item table must be the first section"
    cited = cited_in_code()
    assert len(cited) >= 30, f"the extractor found only {len(cited)} cited items: its pattern broke"
    problems = table_problems(cited, readme_rows(README.read_text()), has_test)
    assert not problems, "\n".join(problems)


# ---- the suite itself: which tests the second CI step runs on AVX2's kernels ----


def test_the_reduced_precision_marker_follows_the_arithmetic_not_the_prose():
    """conftest marks a test `reduced_precision` (run again under AVX2 by .ci/run) when its code, not its docstring,
    comments or asserts, names a reduced precision, and, where its cases' ids name one, in those cases only."""
    import inspect
    import test_scale
    import test_train
    from conftest import runs_reduced_precision
    fsdp = inspect.getsource(test_scale.test_fsdp_saves_mid_run_and_trains_and_resumes_as_one_process)
    cases = list(test_scale.FSDP_RUNS)
    assert [c for c in cases if runs_reduced_precision(fsdp, c, cases)] == ["pcc-bf16"]
    frozen = inspect.getsource(test_scale.test_bf16_frozen_weights_train_as_fp32_within_bf16_rounding)
    assert all(runs_reduced_precision(frozen, m, ["icae", "pcc"]) for m in ("icae", "pcc"))
    # bf16 named in the docstring only (CUDA's autocast): fp32 on the CPU
    micro = inspect.getsource(test_train.test_micro_batches_give_the_full_batch_step)
    assert "bf16" in micro and not runs_reduced_precision(micro, "ae", ["ae", "qa"])
    prose = 'def test_x():\n    """On CUDA, bf16."""\n    x = 1   # autocast elsewhere\n'
    assert not runs_reduced_precision(prose) and runs_reduced_precision(prose.replace("x = 1", "x = 'bf16'"))
    # a plan on the meta device computes nothing: the "bfloat16" its assert reads in the printed plan does not count
    plan = inspect.getsource(test_scale.test_plan_of_every_preset_at_every_shape_allocates_nothing)
    assert "bfloat16" in plan and not runs_reduced_precision(plan)
    assert runs_reduced_precision(prose.replace("x = 1", "x = 1\n    assert f('bf16')\n    y = 'bf16'"))


# ---- reading paths: a preset, a one-step run and one training step in one sitting ----


def test_every_preset_reads_in_210_lines_and_aoc_with_at_most_4_config_conditions():
    # each preset's path from its record to the decoder's input, measured as the README's reading guide measures it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reading_guide
    table, totals = reading_guide.guide()
    assert all(lines <= 210 for lines, _ in totals.values()), totals
    assert totals["aoc"][1] <= 4, totals["aoc"]
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert table in readme, "README's reading guide is out of date: paste the output of python tests/reading_guide.py"
    # a one-step AOC run reads in one sitting: at most 131 project functions in 12 files (the settings resolved in
    # cli.py's small named steps count among them, and the check of its texts' chunking, train.chunk_warning and
    # Compressor.chunk_slots; the log's two in runlog.py, which the recipes' summaries read without torch); the
    # README's sentence says how many it calls (tests/test_records.py reads it against this table's row)
    aoc = re.search(r"^\| `aoc` .* \| (\d+) in (\d+) \| \d+ \(\d+ in \d+\) \|$", table, re.M)   # the run, one step
    functions, files = map(int, aoc.groups())
    assert functions <= 131 and files <= 12, (functions, files)


def test_one_aoc_training_step_turns_between_files_at_most_6_times():
    """One train_step of AOC (the tiny demo: forward, backward, clip and step over the micro-batches the loop drew),
    read in the order its project functions are first called, turns from one file to another at most 6 times:
    train.py (its inputs were built before the step, micro_batches), compressors.py and model.py for the encoder's
    pass, compressors.py, masks.py (the KV prefix's mask, made on the device) and model.py for the decoder's;
    parallel.py last (the gradient norm and the step's numbers, summed over the processes). The
    README's reading guide says how many: its table's last column (the test above holds the table to the code) and a
    sentence tests/test_records.py reads against it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reading_guide
    path, switches = reading_guide.step_path("aoc")
    files = [f for i, (f, _) in enumerate(path) if i == 0 or path[i - 1][0] != f]
    assert switches <= 6, files
    assert files[:2] == ["train.py", "compressors.py"] and files[-1] == "parallel.py", files


def test_train_py_reads_in_the_order_it_runs_with_main_last():
    """train.py is one run on one page: main() is its last definition, and no other function takes the parsed flags
    (`args`): each takes what it uses, resolved once by cli.parse_args (tests/test_settings.py checks the same rule
    while a run runs)."""
    import ast
    tree = ast.parse((Path(__file__).resolve().parents[1] / "train.py").read_text())
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defs[-1].name == "main"
    takes_args = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name != "main"
                  and "args" in [a.arg for a in f.args.args + f.args.kwonlyargs]]
    assert not takes_args, takes_args


def test_install_in_two_commands_runs_the_readmes_quickstart():
    """README's Install is two commands: .ci/quickstart sets up and runs the Quickstart, .ci/run the tests. The first
    runs exactly the Quickstart's commands (python3 for python), and both keep a CUDA build of torch >= 2.7; the
    Install block names the command .ci/run runs the tests with."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    install = re.search(r"## Install\n\n```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split()[:2] for line in install.splitlines()] == [["bash", ".ci/quickstart"], ["bash", ".ci/run"]]
    quick = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1)
    script = (root / ".ci" / "quickstart").read_text()
    for command in (line.split("#")[0].strip() for line in quick.splitlines()):
        assert command.replace("python ", "python3 ", 1) in script, command
    for name in ("quickstart", "run"):
        text = (root / ".ci" / name).read_text()
        assert subprocess.run(["bash", "-n", str(root / ".ci" / name)]).returncode == 0
        assert "< (2, 7)" in text and "pip install -q torch==2.13.0" in text
    assert "python3 -m pytest -q -n 2 tests" in (root / ".ci" / "run").read_text() and \
        "python -m pytest -q -n 2 tests" in install


# ---- size ----


def test_the_compressor_class_stays_under_450_lines():
    """Compressor stays one class a reader can hold: its file functions (save, load, load_trained, trained_state) live
    in checkpoint.py, blocks() is a module function, the bridges are modules of their own."""
    import ast
    tree = ast.parse(open(C.__file__).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Compressor")
    assert cls.end_lineno - cls.lineno + 1 < 450


# ---- the READMEs' generated tables are the code's output (the reading guide's: above) ----


def test_the_readme_method_table_is_the_presets():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert P.method_table() in readme, "README's method table is out of date: paste the output of python presets.py"


def test_the_paper_table_in_tests_readme_is_the_direct_plan():
    """tests/README.md's table is printed by tests/bench_plan.py --papers, each number a direct plan: its AOC and
    GMSA rows (the cheap ones) are recomputed here and must be the printed rows exactly."""
    import bench_plan
    table = (Path(__file__).parent / "README.md").read_text()
    for row in bench_plan.PAPERS:
        if row[0] in ("aoc", "gmsa"):
            assert bench_plan.paper_row(*row) in table, row


# ---- one word, one meaning ----


def test_memory_has_no_dead_encoder_positions():
    assert "enc_pos" not in {f.name for f in dataclasses.fields(C.Memory)}


def test_the_pad_id_fallback_is_written_once():
    assert inspect.getsource(C).count("pad_id is not None") == 1


def test_one_name_for_the_special_token(device):
    assert not hasattr(C, "special_vector") and not hasattr(C.Compressor, "special_token")
    dec, tok = tiny(device)
    comp = C.build("aoc", dec, tok, mem=4, chunk_len=16)
    assert C.special_token(comp.cfg, "ae") == "bos"     # which one; Compressor.special_embedding: its vector
    torch.testing.assert_close(comp.special_embedding("ae"), dec.model.embed_tokens.weight[tok.bos_id])


def test_the_ratio_settings_are_one_concept_with_documented_mappings():
    help_of = {f.name: f.metadata["help"] for f in P.FLAG_FIELDS}
    assert "compression ratio" in help_of["ratio"] and "--ratios" in help_of["ratio"]   # GMSA: --ratio R = --ratios R
    assert "compression ratios" in help_of["ratios"]
    assert "--ratio" in help_of["mem"]                                                 # --mem drops a preset's ratio
    assert "mappings" in P.make_config.__doc__
    assert P.make_config("compllm", mem=4).ratio == 0.0 and P.make_config("gmsa", ratio=2).ratios == (2,)
    assert "ratios" in inspect.signature(C.Compressor.compress).parameters   # one word: no "rates"


def test_the_three_bos_uses_are_named_apart(device):
    help_of = {f.name: f.metadata["help"] for f in P.FLAG_FIELDS}
    assert "context BOS" in help_of["bos"] and "leading [BOS]" in help_of["delimiters"]
    assert "[BOS] as the special token" in help_of["ae_token"]
    dec, tok = tiny(device)
    comp = C.build("pcc", dec, tok, mem=4, chunk_len=16, bos=True)
    assert comp.context_bos == [tok.bos_id] and comp.decoder_bos == [tok.bos_id]
    assert comp.ae_target([7])[0] == tok.bos_id


def test_carriers_are_two_small_documented_classes():
    for carrier in (C.Embeds, C.KV):
        assert carrier.__doc__
        for name in ("read_slots", "memory", "decoder_rows", "cache"):
            fn = getattr(carrier, name)
            assert fn.__doc__, (carrier, name)
            assert all(len(p) > 1 for p in inspect.signature(fn).parameters if p != "b"), (carrier, name)


def test_pic_blocks_are_not_called_chunks_and_the_docstring_names_pic_as_defined():
    """"chunk" means only the compressor's row of chunk_len tokens; PIC's per-memory-token pieces of the
    context are blocks, and the module docstring documents pic(L, M) as it is defined (not pic(L, M, g))."""
    import inspect
    assert "pic(L, M, g)" not in masks.__doc__ and "pic(L, M)" in masks.__doc__
    assert not hasattr(masks, "chunk_bounds")
    for fn in (masks.pic, masks.block_bounds):
        code = "\n".join(line for line in inspect.getsource(fn).splitlines() if '"' not in line)
        assert "chunk" not in code.lower(), fn.__name__


# ---- docstrings say what the code does ----


def test_the_plans_docstring_describes_the_attention_count_it_uses():
    """plan.py counts attention as CUDA's memory-efficient kernel saves it (CudaAttention, which saved_bytes swaps in
    for SDPA), and its docstring says so, not the CPU's count ("as the CPU's SDPA keeps it")."""
    doc = " ".join(plan.__doc__.split())
    assert "CudaAttention" in doc and "as the CPU's SDPA keeps it" not in doc
    assert plan.sdpa.__doc__ and "CudaAttention" in plan.sdpa.__doc__


# ---- imports ----


def test_metrics_are_pure_python_without_torch():
    """metrics.py is the papers' scoring alone: stdlib only, so importing it loads neither torch nor numpy."""
    code = "import sys, metrics; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr


def test_the_recipes_summaries_read_records_without_torch():
    """recipes/summarize.py, verdict.py and curve.py read a run's log and scores (runlog.py, metrics.py): importing
    them loads no torch, whose import is most of each one's run (a recipe runs them after every arm; curve.py imports
    torch only to score a checkpoint)."""
    code = "import sys; sys.path.insert(0, 'recipes'); import summarize, verdict, curve; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


@pytest.mark.parametrize("path", ["evaluate.py", "metrics.py", "tests/test_evaluate.py", "tests/test_metrics.py"])
def test_no_unused_imports(path):
    """Every name these files import is used: an import nothing uses sends a reader looking for the check that
    needs it."""
    import ast
    tree = ast.parse((REPO / path).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    imported = {(a.asname or a.name).split(".")[0] for node in imports for a in node.names}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert imported <= used, sorted(imported - used)
