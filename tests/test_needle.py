"""evaluate.py --task needle (passkey retrieval, Mohtashami & Jaggi 2023) on a tiny checkpoint trained for one step:
the grid has one cell per depth and length, each needle sits where the JSON says (checked against the context's
own tokens, not against the code that placed it) and near the requested depth, the score is the passkey's exact
match, and the same seed rebuilds the same haystacks and passkeys.

The tiny model is random: its grids are all zeros. Where a test needs a model that finds the needle, the plain
LLM's generate is replaced by a reader that copies the number after "The pass key is" out of its prompt.
"""

import json
import re

import pytest

import checkpoint
import evaluate as E
import data as D
import train


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models run on one thread


@pytest.fixture(scope="module")
def run(tmp_path_factory, device):
    """A 500x compressor on `tiny` after one AE step of train.py (what `evaluate.py --ckpt` reads)."""
    out = str(tmp_path_factory.mktemp("needle") / "run")
    train.main(["--method", "500x", "--objective", "ae", "--model", "tiny", "--mem", "4", "--chunk-len", "64",
                "--batch-size", "2", "--steps", "1", "--out", out, "--device", str(device)])
    return out


def evaluate(argv, device):
    return E.main([str(a) for a in [*argv, "--device", device, "--dtype", "float32"]])


def reader(self, prompts, n):
    """A plain LLM that reads perfectly: the number of the needle in its prompt, or "00000" when there is none."""
    found = [re.search(r"The pass key is (\d+)\.", self.tok.decode(p)) for p in prompts]
    return [self.tok.encode(f" The pass key is {m.group(1) if m else '00000'}.") for m in found]


def test_cli_grid_and_where_each_needle_landed(run, tmp_path, capsys, device):
    lengths, n = [256, 512], 2
    result = evaluate(["--ckpt", run, "--task", "needle", "--lengths", ",".join(map(str, lengths)), "--n", n,
                       "--out", tmp_path / "new" / "needle.json"], device)   # a folder --out makes, PNG included
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "new" / "needle.json").read_text())["grid"] == result["grid"]
    # the grid: one row per depth, one column per length, for each of the three rows, in the JSON and on stdout
    assert result["depths"] == [0.0, 0.25, 0.5, 0.75, 1.0] and result["lengths"] == lengths
    for mode in ("compressed", "full", "none"):
        grid = result["grid"][mode]
        assert len(grid) == 5 and all(len(row) == len(lengths) for row in grid)
        assert all(0 <= v <= 1 for row in grid for v in row)
        assert f"{mode}: fraction of the {n} samples" in out
    assert out.count("| depth \\ length | 256 | 512 |") == 3 and out.count("| 100% |") == 3
    assert (tmp_path / "new" / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # n samples per cell, each with its own passkey, and no teacher-forced losses (they need a shared answer)
    examples = result["examples"]
    cells = [(ex["depth"], ex["length"]) for ex in examples]
    assert len(examples) == 5 * len(lengths) * n and all(cells.count(c) == n for c in set(cells))
    assert "loss" not in result and all("loss" not in ex for ex in examples)
    tok = checkpoint.load(run).tok
    longest = max(len(tok.encode(" " + s)) for t in D.unseen_texts() for s in re.split(r"(?<=[.!?]) ", t))
    for ex in examples:
        context, needle = ex["context"], E.NEEDLE.format(key=ex["answer"])
        assert re.fullmatch(r"\d{5}", ex["answer"]) and context.count(needle) == 1
        ids = tok.encode(context)
        assert ex["context_tokens"] == len(ids) and ex["length"] - longest <= len(ids) <= ex["length"]   # filled
        # needle_at is a token index of the context: the tokens before it are the text before the needle, and
        # its depth is the share of the haystack's tokens that come before it
        before, after = context.split(needle)
        assert tok.decode(ids[:ex["needle_at"]]) == before.rstrip(" ")
        n_after = len(tok.encode(after))
        assert ex["landed_depth"] == pytest.approx(ex["needle_at"] / (ex["needle_at"] + n_after))
        # at the sentence boundary nearest the requested depth: at most half a sentence away (and a token, the
        # space a sentence counts before it, which the first one has not)
        hay = ex["needle_at"] + n_after
        assert abs(ex["landed_depth"] - ex["depth"]) <= (longest / 2 + 1) / hay
        if ex["depth"] == 0:
            assert ex["needle_at"] == 0 and context.startswith(needle)
        if ex["depth"] == 1:
            assert ex["landed_depth"] == 1.0 and context.endswith(needle)
    for L in lengths:   # deeper asked, deeper landed
        mean = [sum(e["landed_depth"] for e in examples if e["depth"] == d and e["length"] == L) / n
                for d in result["depths"]]
        assert mean == sorted(mean) and (mean[0], mean[-1]) == (0.0, 1.0)
    # the CLI's haystacks and passkeys are those of --seed 0 (its default)
    again = E.needle_examples(tok, D.unseen_texts(), lengths, n, seed=0)
    assert [(s["context"], s["answer"]) for s in again] == [(ex["context"], ex["answer"]) for ex in examples]


def test_passkey_score():
    assert E.passkey_score(" The pass key is 71432.", "71432") == {"passkey": 1.0}
    assert E.passkey_score("71432", "71432")["passkey"] == 1.0
    assert E.passkey_score("It is 12345, not 71432.", "71432")["passkey"] == 1.0   # contains the passkey
    assert E.passkey_score(" The pass key is 12345.", "71432")["passkey"] == 0.0   # another number
    assert E.passkey_score("The pass key is 714321.", "71432")["passkey"] == 0.0   # a longer number
    assert E.passkey_score("7143", "71432")["passkey"] == 0.0
    assert E.passkey_score("I do not remember.", "71432")["passkey"] == 0.0


def test_grid_counts_the_reader_that_finds_the_needle(run, monkeypatch, device):
    """A plain LLM that reads the needle scores 1 in every cell of the full row and 0 in the none row (whose prompt
    has no needle); a compressed row that always says one wrong number scores 0."""
    comp = checkpoint.load(run, device=device).eval()
    monkeypatch.setattr(E.PlainLLM, "generate", reader)
    monkeypatch.setattr(comp, "generate", lambda memory, task, **kw: [comp.tok.encode(" 00000")] * len(memory.valid))
    result = E.run_needle(comp, [{"text": t} for t in D.unseen_texts()], [256], n=2, batch_size=4)
    assert result["grid"]["full"] == [[1.0]] * 5
    assert result["grid"]["none"] == result["grid"]["compressed"] == [[0.0]] * 5
    assert all(ex["full"]["text"] == f" The pass key is {ex['answer']}." for ex in result["examples"])


def test_same_seed_same_haystacks_and_passkeys(run):
    tok, texts = checkpoint.load(run).tok, D.unseen_texts()
    a, b = (E.needle_examples(tok, texts, [256, 384], 2, seed=0) for _ in range(2))
    c = E.needle_examples(tok, texts, [256, 384], 2, seed=1)
    assert a == b
    keys = lambda samples: [s["answer"] for s in samples]
    assert keys(a) != keys(c) and len(set(keys(a))) > 1   # another seed, other passkeys; a fresh one per sample
    assert [s["context"].replace(s["answer"], "") for s in a] != [s["context"].replace(s["answer"], "") for s in c]


def test_default_lengths_fit_the_models_positions(run, monkeypatch, device):
    comp = checkpoint.load(run, device=device).eval()
    monkeypatch.setattr(comp.decoder.config, "max_position_embeddings", 600)
    monkeypatch.setattr(E.PlainLLM, "generate", reader)
    monkeypatch.setattr(comp, "generate", lambda memory, task, **kw: [[]] * len(memory.valid))
    texts = [{"text": t} for t in D.unseen_texts()]
    assert E.run_needle(comp, texts, n=1)["lengths"] == [256, 512]   # 1024 and up need more than 600 positions
    with pytest.raises(ValueError, match="beyond the model's 600 positions"):
        E.run_needle(comp, texts, [256, 1024], n=1)


def test_bad_input_is_a_one_line_error(run, tmp_path, device):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            evaluate(["--ckpt", run, "--task", "needle", "--n", 1, *argv], device)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg, msg
        return msg
    needle = len(E.NEEDLE.format(key=12345)) + 1   # bytes = tokens of tiny's tokenizer, with its leading space
    assert f"shorter than the needle ({needle} tokens)" in error("--lengths", needle - 1)
    assert "too few for a sentence" in error("--lengths", needle + 2)
    assert "beyond the model's 8192 positions" in error("--lengths", "256,8192")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": " "}\n')
    assert "no texts to build haystacks from" in error("--lengths", 256, "--data", blank)
