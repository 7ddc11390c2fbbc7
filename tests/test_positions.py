"""positions.py against the EPL paper, number by number (Algorithm 1, Tables 1–3 and 12–15).

Worked example of the paper: k=2 chunks, L=510, |M|=102, r=5, |X|=2040, p=1020, |Q|=50, |A|=5.
Every expected number is written out literally from the tables: a run such as "3, 8, …, 508" is
span(3, 508, 5), its first value, last value and step read off the table.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import positions`
import compressors as C  # noqa: E402
import positions  # noqa: E402
from model import build_tiny  # noqa: E402
from positions import decoder_positions, encoder_positions, upl  # noqa: E402

K, L, M, P, X, Q, A = 2, 510, 102, 1020, 2040, 50, 5  # the paper's worked example


def span(first, last, step=1):
    # first, first+step, …, last (inclusive), as the tables write a run
    assert (last - first) % step == 0
    return list(range(first, last + 1, step))


# ---- EPL Table 12 (= Table 1): the encoder ----

@pytest.mark.parametrize("chunk", [0, 1])
def test_table12_encoder_dpl(chunk):
    ctx, mem = encoder_positions("dpl", chunk, L, M)
    assert ctx.tolist() == span(0, 509)  # x_0 … x_509 at 0 … 509, every chunk
    assert mem.tolist() == span(510, 611)  # m_0 … m_101 at 510 … 611, every chunk
    assert ctx.dtype == mem.dtype == torch.long


@pytest.mark.parametrize("layout", ["epl", "upl"])  # "+UPL" = the EPL encoder (Table 6 caption, §3.2.1)
def test_table12_encoder_epl(layout):
    ctx, mem = encoder_positions(layout, 0, L, M)
    assert ctx.tolist() == span(1, 510)  # S(1): x_0 … x_509 at 1 … 510
    assert mem.tolist() == span(3, 508, 5)  # 3, 8, …, 508
    ctx, mem = encoder_positions(layout, 1, L, M)
    assert ctx.tolist() == span(511, 1020)  # S(2): x_510 … x_1019 at 511 … 1020
    assert mem.tolist() == span(513, 1018, 5)  # 513, 518, …, 1018


# ---- EPL Tables 13 (= Table 2), 14 (= Table 3), 15: the decoder ----

DPL_ICAE_MEM = span(0, 203)  # Table 2: 0 … 101 | 102 … 203
DPL_500X_MEM = span(510, 611) + span(510, 611)  # Table 2: 510 … 611 | 510 … 611
EPL_MEM = span(3, 508, 5) + span(513, 1018, 5)  # Table 2: 3 … 508 | 513 … 1018


@pytest.mark.parametrize("layout, carrier, mem, special, follow", [
    ("dpl", "embeds", DPL_ICAE_MEM, 204, span(205, 1224)),  # DPL(ICAE): [AE] 204, x_0 … x_1019 at 205 … 1224
    ("dpl", "kv", DPL_500X_MEM, 204, span(205, 1224)),  # DPL(500x)
    ("epl", "embeds", EPL_MEM, 0, span(1, 1020)),  # EPL: [AE] 0, x_0 … x_1019 at 1 … 1020
    ("epl", "kv", EPL_MEM, 0, span(1, 1020)),
])
def test_table13_decoder_ae(layout, carrier, mem, special, follow):
    m, s, f = decoder_positions(layout, carrier, "ae", [L, L], M, P, P)
    assert (m.tolist(), s, f.tolist()) == (mem, special, follow)
    assert m.dtype == f.dtype == torch.long and isinstance(s, int)


def test_table2_chunk_boundaries():
    # Table 2 shows the memory columns m̃_101(1) | m̃_0(2) explicitly
    m, _, _ = decoder_positions("dpl", "embeds", "ae", [L, L], M, P, P)
    assert (m[101].item(), m[102].item()) == (101, 102)
    m, _, _ = decoder_positions("dpl", "kv", "ae", [L, L], M, P, P)
    assert (m[0].item(), m[101].item(), m[102].item(), m[203].item()) == (510, 611, 510, 611)
    m, _, _ = decoder_positions("epl", "kv", "ae", [L, L], M, P, P)
    assert (m[0].item(), m[101].item(), m[102].item(), m[203].item()) == (3, 508, 513, 1018)


@pytest.mark.parametrize("layout, carrier, mem, special, follow", [
    ("dpl", "embeds", DPL_ICAE_MEM, 204, span(205, 1224)),  # [LM] 204, x_1020 … x_2039 at 205 … 1224
    ("dpl", "kv", DPL_500X_MEM, 204, span(205, 1224)),
    ("epl", "embeds", EPL_MEM, 1020, span(1021, 2040)),  # [LM] 1020, x_1020 … x_2039 at 1021 … 2040
    ("epl", "kv", EPL_MEM, 1020, span(1021, 2040)),
])
def test_table14_decoder_lm(layout, carrier, mem, special, follow):
    m, s, f = decoder_positions(layout, carrier, "lm", [L, L], M, P, X - P)
    assert (m.tolist(), s, f.tolist()) == (mem, special, follow)


@pytest.mark.parametrize("layout, carrier, mem, special, q, a", [
    ("dpl", "embeds", DPL_ICAE_MEM, 204, span(205, 254), span(255, 259)),  # [LM] 204, Q 205 … 254, A 255 … 259
    ("dpl", "kv", DPL_500X_MEM, 204, span(205, 254), span(255, 259)),
    ("epl", "embeds", EPL_MEM, 1020, span(1021, 1070), span(1071, 1075)),  # [LM] 1020, Q 1021 … 1070, A 1071 … 1075
    ("epl", "kv", EPL_MEM, 1020, span(1021, 1070), span(1071, 1075)),
])
def test_table15_decoder_qa(layout, carrier, mem, special, q, a):
    m, s, f = decoder_positions(layout, carrier, "qa", [L, L], M, P, Q + A)
    assert (m.tolist(), s, f[:Q].tolist(), f[Q:].tolist()) == (mem, special, q, a)


@pytest.mark.parametrize("task, n_follow", [("ae", P), ("lm", X - P), ("qa", Q + A)])
def test_upl_ablation_decoder(task, n_follow):
    # "+UPL" (Table 6): UPL encoder, DPL decoder. ICAE feeds fresh embeddings (0 … 203); 500x's cached
    # keys keep the UPL positions they were encoded at (3 … 508, 513 … 1018); [AE]/[LM] at k|M| = 204
    m, s, f = decoder_positions("upl", "embeds", task, [L, L], M, P, n_follow)
    assert (m.tolist(), s, f[0].item(), f[-1].item()) == (DPL_ICAE_MEM, 204, 205, 204 + n_follow)
    m, s, f = decoder_positions("upl", "kv", task, [L, L], M, P, n_follow)
    assert (m.tolist(), s, f[0].item(), f[-1].item()) == (EPL_MEM, 204, 205, 204 + n_follow)


# ---- the same tables through the compressor: the position ids decoder_batch hands the decoder ----

@pytest.mark.parametrize("method", ["icae", "500x"])
@pytest.mark.parametrize("layout", ["dpl", "upl", "epl"])
@pytest.mark.parametrize("task", ["ae", "lm"])
def test_tables_12_to_14_through_decoder_batch(method, layout, task):
    # the worked example on the tiny model: x_0 … x_1019 compressed in two chunks of 510 into 102 slots each;
    # AE regenerates them, LM continues with x_1020 … x_2039 (no [BOS] in the context, as in the tables)
    torch.manual_seed(0)
    dec, tok = build_tiny()
    comp = C.build(method, dec, tok, layout=layout, mem=M, chunk_len=L, bos=False)
    context = [7 + i % 200 for i in range(P)]
    follow = context if task == "ae" else [7 + (i * 3) % 200 for i in range(X - P)]
    encoded, forward = [], comp.encoder.forward   # the first forward is the encoder's (LoRA: the decoder module)
    comp.encoder.forward = lambda *a, **kw: encoded.append(kw["position_ids"]) or forward(*a, **kw)
    with torch.no_grad():
        memory = comp.compress([context])
        batch = comp.decoder_batch(memory, task, [follow])
    # Table 12: where the encoder put the memory (DPL: 510 … 611 in every chunk; EPL and UPL: 3 … 508 | 513 … 1018)
    assert encoded[0][:, L:L + M].flatten().tolist() == (DPL_500X_MEM if layout == "dpl" else EPL_MEM)
    if layout == "epl":   # Tables 13, 14 EPL rows: memory as encoded, [AE] 0 / [LM] 1020, the text after it
        mem, special, text = EPL_MEM, 0 if task == "ae" else 1020, span(1, 1020) if task == "ae" else span(1021, 2040)
    else:                 # DPL rows and Table 6's "+UPL": fresh ICAE embeddings at 0 … 203, [AE]/[LM] 204, text after
        mem, special, text = DPL_ICAE_MEM, 204, span(205, 1224)
    if method == "500x":  # the K/V carrier: the memory is no input, its keys keep their encoder positions (above)
        mem = []
    assert batch["position_ids"][0].tolist() == mem + [special] + text


# ---- EPL Algorithm 1 ----

def test_upl_rounds_half_to_even():
    # L=12, |M|=3: r=4, b = 1 + (4−1)/2 = 2.5 -> memory at 2.5, 6.5, 10.5 -> torch.round: 2, 6, 10
    # (half away from zero would give 3, 7, 11); chunk 2 starts at 13: 14.5, 18.5, 22.5 -> 14, 18, 22
    assert encoder_positions("epl", 0, 12, 3)[1].tolist() == [2, 6, 10]
    assert encoder_positions("epl", 1, 12, 3)[1].tolist() == [14, 18, 22]


def test_upl_in_float64():
    # |M|=9 over 0 … 11: r=4/3, values 1/6 + j·4/3 with ties 1.5, 5.5, 9.5; float32 linspace
    # computes 1.4999999 and rounds it to 1
    assert upl(9, 0, 11).tolist() == [0, 2, 3, 4, 6, 7, 8, 10, 11]


def test_upl_is_optimal_and_inside_its_chunk():
    # §3.2.1: the largest distance from a context position to its nearest memory position is ⌊⌈r⌉/2⌋
    for first in (0, 1, 513):
        for n in range(1, 81):
            v = torch.arange(first, first + n)
            for m in range(1, n + 1):
                u = upl(m, first, first + n - 1)
                assert len(u) == m and u.min() >= first and u.max() <= first + n - 1, (n, m, first)
                worst = (v[:, None] - u[None, :]).abs().min(dim=1).values.max().item()
                ceil_r = -(-n // m)  # ⌈n/m⌉ in integers
                assert worst == ceil_r // 2, (n, m, first)


def test_upl_dpl_distance_contrast():
    # Figure 1: DPL puts every memory position after the context, so x_0 is L positions away
    ctx, mem = encoder_positions("dpl", 0, L, M)
    assert (mem[None, :] - ctx[:, None]).abs().min(dim=1).values.max().item() == 510
    ctx, mem = encoder_positions("epl", 0, L, M)
    assert (mem[None, :] - ctx[:, None]).abs().min(dim=1).values.max().item() == 2  # ⌊⌈5⌉/2⌋


# ---- a shorter last chunk (our generalisation) ----

def test_shorter_last_chunk():
    # chunks of 510 and 300 tokens, 102 and 60 memory tokens (r=5 in both)
    ctx, mem = encoder_positions("epl", 1, 300, 60, offset=510)
    assert ctx.tolist() == span(511, 810)  # starts right after chunk 1's 1 … 510
    assert mem.tolist() == span(513, 808, 5)  # b = 511 + (5−1)/2 = 513, last 513 + 59·5 = 808
    ctx, mem = encoder_positions("dpl", 1, 300, 60)
    assert ctx.tolist() == span(0, 299) and mem.tolist() == span(300, 359)  # memory right after its context

    lens, mems = [510, 300], [102, 60]
    m, s, f = decoder_positions("dpl", "kv", "ae", lens, mems, 810, 810)
    assert (m.tolist(), s, f[0].item(), f[-1].item()) == (span(510, 611) + span(300, 359), 162, 163, 972)
    m, s, f = decoder_positions("dpl", "embeds", "lm", lens, mems, 810, 7)
    assert (m.tolist(), s, f.tolist()) == (span(0, 161), 162, span(163, 169))
    m, s, f = decoder_positions("epl", "kv", "ae", lens, mems, 810, 810)
    assert (m.tolist(), s, f.tolist()) == (span(3, 508, 5) + span(513, 808, 5), 0, span(1, 810))
    m, s, f = decoder_positions("epl", "embeds", "qa", lens, mems, 810, 3)
    assert (s, f.tolist()) == (810, [811, 812, 813])
    # one |M| for both chunks: 102 over 300 tokens still stays inside 511 … 810
    m, _, _ = decoder_positions("epl", "embeds", "ae", lens, 102, 810, 0)
    assert len(m) == 204 and m[102:].min() >= 511 and m[102:].max() <= 810


# ---- `python positions.py` ----

def test_prints_worked_example(capsys):
    positions.main()
    text = capsys.readouterr().out
    for table in ("Table 12", "Table 13", "Table 14", "Table 15"):
        assert table in text
    assert "1018" in text and "[AE]" in text and "1075" in text


# ---- a short last chunk, as EPL's code handles it ----

def test_short_last_chunk_keeps_every_memory_token_at_nominal_upl_positions():
    # EPL code: every chunk gets |M| = 102; UPL over the nominal start+1 .. start+L even for a short chunk
    ctx, mem = encoder_positions("epl", 1, 7, 102, offset=510, span=510)
    assert ctx.tolist() == list(range(511, 518))
    assert mem.tolist() == list(range(513, 1019, 5))           # as a full second chunk (Table 12)
    # DPL: positions restart per chunk; the memory follows the chunk's real tokens
    ctx, mem = encoder_positions("dpl", 1, 7, 102)
    assert ctx.tolist() == list(range(7)) and mem.tolist() == list(range(7, 109))
    mem, special, follow = decoder_positions("epl", "kv", "ae", [510, 7], 102, 517, 3, span=510)
    assert mem.tolist() == list(range(3, 509, 5)) + list(range(513, 1019, 5)) and special == 0
    # ours (span=None): UPL over the chunk's own 7 tokens, with at most 7 slots
    _, mem = encoder_positions("epl", 1, 7, 2, offset=510)
    assert mem.tolist() == [512, 516]


# ---- malformed arguments ----

@pytest.mark.parametrize("call, name", [
    (lambda: upl(0, 1, 10), "num_mem"),
    (lambda: upl(11, 1, 10), "num_mem"),
    (lambda: upl(2, 10, 9), "last"),
    (lambda: upl(2, -1, 9), "first"),
    (lambda: encoder_positions("xyz", 0, 10, 2), "layout"),
    (lambda: encoder_positions("epl", -1, 10, 2), "chunk_index"),
    (lambda: encoder_positions("epl", 0, -10, 2), "chunk_len"),
    (lambda: encoder_positions("epl", 0, 10, 0), "num_mem"),
    (lambda: encoder_positions("epl", 0, 10, 11), "num_mem"),
    (lambda: encoder_positions("epl", 0, 4, 5, span=4), "num_mem"),
    (lambda: encoder_positions("epl", 0, 10, 2, span=9), "span"),
    (lambda: encoder_positions("epl", 1, 10, 2, offset=-3), "offset"),
    (lambda: decoder_positions("xyz", "kv", "ae", [10], 2, 10, 10), "layout"),
    (lambda: decoder_positions("epl", "hidden", "ae", [10], 2, 10, 10), "carrier"),
    (lambda: decoder_positions("epl", "kv", "summarise", [10], 2, 10, 10), "task"),
    (lambda: decoder_positions("epl", "kv", "ae", [10, -5], 2, 10, 10), "chunk_lens"),
    (lambda: decoder_positions("epl", "kv", "ae", [], 2, 10, 10), "chunk_lens"),
    (lambda: decoder_positions("epl", "kv", "ae", [10], 0, 10, 10), "num_mem"),
    (lambda: decoder_positions("epl", "kv", "ae", [10, 4], [2], 14, 14), "num_mem"),
    (lambda: decoder_positions("epl", "kv", "ae", [10], 2, -1, 10), "context_len"),
    (lambda: decoder_positions("epl", "kv", "ae", [10], 2, 10, -1), "n_follow"),
])
def test_malformed_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
