"""The README's "Fork it" example, run as written: it adds a new encoder mask (`mem_bidir`) and a preset that
uses it (`aoc_bidir`); this trains that preset 2 steps on `tiny` and checks that the encoder's attention got the
new mask. The code is read from README.md (the fenced block between the fork-it markers), so the section stays
true; everything the block changes in the modules is put back after the test."""

import re
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cli  # noqa: E402
import presets as P  # noqa: E402
import masks  # noqa: E402
import checkpoint  # noqa: E402
import runlog  # noqa: E402
import train  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.usefixtures("one_thread")


def fork_it_block() -> str:
    """The ```python block between <!-- fork-it ... --> and <!-- /fork-it --> under README's "Fork it" heading."""
    text = README.read_text()
    section = text[text.index("## Fork it"):]
    found = re.search(r"<!-- fork-it[^>]*-->\s*```python\n(.*?)```\s*<!-- /fork-it -->", section, re.S)
    assert found, "README's Fork it section lost its marked python block"
    return found.group(1)


def test_the_readme_fork_it_example_trains_with_its_new_mask(tmp_path, monkeypatch, device):
    # what the block changes, put back after the test (setattr/setitem record the old value, or its absence)
    monkeypatch.setattr(P, "PRESETS", dict(P.PRESETS))
    monkeypatch.setattr(P, "METHODS", P.METHODS)
    monkeypatch.setattr(P, "CHOICES", dict(P.CHOICES))
    monkeypatch.setattr(cli, "TINY", dict(cli.TINY))
    monkeypatch.setattr(masks, "ENCODER", dict(masks.ENCODER))
    code = fork_it_block()
    assert len(code.splitlines()) <= 25, "keep the README example short"
    exec(compile(code, str(README) + ":Fork it", "exec"), {})
    assert "aoc_bidir" in P.METHODS and P.PRESETS["aoc_bidir"].compressor["mask"] == "mem_bidir"

    # spies: every mask the new function returns, and every mask that reaches attention
    made, seen, new_mask, sdpa = [], [], masks.ENCODER["mem_bidir"], F.scaled_dot_product_attention

    def spy_mask(context_len, num_mem):
        made.append(new_mask(context_len, num_mem))
        return made[-1]

    def spy_sdpa(*args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            seen.append(attn_mask.detach().cpu())
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setitem(masks.ENCODER, "mem_bidir", spy_mask)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    out = tmp_path / "aoc_bidir"
    train.main(["--method", "aoc_bidir", "--model", "tiny", "--steps", "2", "--eval-n", "4", "--out", str(out),
                "--device", str(device)])

    assert [r["step"] for r in runlog.read_log(str(out))[0]] == [1, 2]
    assert checkpoint.load(str(out)).cfg.mask == "mem_bidir"          # the checkpoint remembers the new value
    assert made, "the encoder never called the new mask"
    L = 16   # the tiny demo's AOC texts: 16 bytes, 16 memory slots
    mask = made[0]
    assert mask.shape == (L + 16, L + 16) and not mask.equal(masks.causal(L, 16))   # it is a new mask
    # it reached attention: a batched (R, 1, T, T) encoder mask whose first row holds it top-left
    assert any(m.dim() == 4 and m.shape[-2:] == mask.shape and m[0, 0].equal(mask) for m in seen)
