"""The layering of the top-level modules, stated once (LAYERS) and enforced: a module imports only modules of the
layers before its own, at the top of the file or inside a function alike, so there is no import circle and a reader
can learn the code bottom up. recipes/ and tests/ come after every layer (they may import anything).

    masks, positions, metrics, lora, hf,   the parts with no project imports: masks, position IDs, scores, LoRA,
    figures, runlog                        reading Hugging Face files, the optional figures, a run's log
    gemma3                                 what Gemma 3 changes in the transformer: its config, (1 + w) norm, scaled
                                           embedding, sandwich block, window (below model, which builds Gemma from it)
    model                                  the transformer (Llama, Qwen, Mistral; Gemma 3 from gemma3's parts) and
                                           load_pretrained
    presets                                what each method is: CompressorConfig, PRESETS, recipes, the tiny demo
    compressors                            the machinery the presets drive
    data                                   readers, the built-in corpus, sampling a step
    checkpoint                             a compressor's files (save, load), a run's checkpoints (one-process,
                                           sharded) and resume state
    cli                                    train.py's flags and how their defaults resolve
    evaluate                               the tasks and their scores
    heldout, plan, parallel                the held-out check a run does while training (calls evaluate); the
                                           memory plan (--plan); torchrun, DDP and FSDP2 (--fsdp)
    train                                  the training script

A script's entry, `if __name__ == "__main__":`, counts too: the structure drawn from the imports has no circle at
all (so plan.py's paper table, whose entry would import train.py, which imports plan.py, is tests/bench_plan.py's).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [("masks", "positions", "metrics", "lora", "hf", "figures", "runlog"), ("gemma3",), ("model",), ("presets",),
          ("compressors",), ("data",), ("checkpoint",), ("cli",), ("evaluate",), ("heldout", "plan", "parallel"),
          ("train",)]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def imports(path: Path) -> set:
    """Every top-level project module `path` imports, at module level or inside functions (its script entry aside)."""
    tree = ast.parse(path.read_text())   # every import, a script entry's (`if __name__ == "__main__":`) included
    found = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found |= {n.split(".")[0] for n in names}
    return found & {p.stem for p in ROOT.glob("*.py")}


def test_every_module_has_a_layer():
    modules = {p.stem for p in ROOT.glob("*.py")}
    assert modules == set(RANK), f"place each top-level module in LAYERS: {sorted(modules ^ set(RANK))}"


def test_each_module_imports_only_earlier_layers():
    bad = [f"{m} (layer {RANK[m]}) imports {d} (layer {RANK.get(d)})" for m in RANK if (ROOT / f"{m}.py").exists()
           for d in sorted(imports(ROOT / f"{m}.py")) if d not in RANK or RANK[d] >= RANK[m]]
    assert not bad, "; ".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """imports() finds a lazy import (an import circle can hide inside a function) and a script entry's (an entry
    that imports train)."""
    f = tmp_path / "x.py"
    f.write_text("import masks\n\ndef f():\n    import evaluate as E\n    from train import main\n\n"
                 "if __name__ == '__main__':\n    import cli\n")
    assert imports(f) == {"masks", "evaluate", "train", "cli"}
