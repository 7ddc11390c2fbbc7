"""Position IDs for compressor (encoder) and decoder: DPL, UPL and EPL.

EPL paper ("Position IDs Matter: An Enhanced Position Layout for Efficient Context Compression"),
§3.1 (the default layouts), §3.2 (EPL = UPL + CPL), Algorithm 1, Tables 1–3 and 12–15.
`python positions.py` prints the paper's worked example as its tables.

Notation: the context of p tokens is cut into k chunks S(i) of L tokens (the last one may be
shorter); chunk i gets |M| memory tokens; r = L/|M| is the compression ratio.

UPL, Algorithm 1, for one chunk whose context has position IDs v_1 … v_L:
    r = (v_L − v_1 + 1) / |M|,   o = (r − 1) / 2,   U = round(linspace(v_1 + o, v_L − o, |M|))
in float64 with torch.round (half to even). It is optimal (§3.2.1): the largest distance from a
context position to its nearest memory position is ⌊⌈r⌉/2⌋, the lower bound for any layout.

The three layouts, encoder (Table 12) and decoder (Tables 13–15):

    layout  encoder context      encoder memory     decoder memory               decoder [AE] / [LM], then …
    dpl     0 … L−1              L … L+|M|−1        embeds: 0 … k|M|−1           k|M|, k|M|+1, …
            (every chunk)        (every chunk)      kv: encoder's, L … L+|M|−1   k|M|, k|M|+1, …
    upl     as epl               as epl             embeds: 0 … k|M|−1           k|M|, k|M|+1, …
                                                    kv: encoder's (UPL)          k|M|, k|M|+1, …
    epl     (i−1)L+1 … iL        UPL of that range  encoder's (UPL), any carrier AE: [AE] 0, x_j at j+1
                                                                                 LM/QA: [LM] p, then p+1, …

Why the KV carrier keeps encoder positions (500xCompressor): RoPE is applied to keys before they
are cached, so cached memory keys carry the positions they were encoded at (EPL §3.1.1, footnote 3).
The decoder's next token then sits at k|M|, the cache length — that *is* DPL(500x) in Table 13,
whose memory (510 … 611) lies after the [AE] token (204); CPL (§3.2.2) is what fixes that order.

"upl" is the paper's "+UPL" ablation (Table 6: "+UPL applies only UPL to encoder"): the encoder is
exactly the EPL encoder — §3.2.1 says "Table 1 EPL row shows how the memory token position layout
in UPL differs from DPL", and the authors' ablation code changes only the decoder's position IDs
(their README: "without Position IDs in the second forward pass") — while the decoder stays DPL.
(For the embeds carrier the encoder offset (i−1)L+1 does not matter at all: RoPE attention only
sees position differences inside a chunk.)

A shorter last chunk (the paper's example has k equal chunks of L tokens):
  * its context starts right after the previous chunks' contexts (cumulative starts, (i−1)L when
    every earlier chunk is full); under DPL its memory sits right after its own context,
    len_i … len_i+|M|−1 (EPL code: positions restart per chunk, memory after the real tokens);
  * EPL code: it still gets all |M| memory tokens, and UPL spreads them over the *nominal* range
    start+1 … start+L as if the chunk were full (`span=L`), so some may sit past its last token;
  * ours, as an option (`span=None`, with |M_i| = min(|M|, len_i)): UPL over the chunk's own range.
    |M| may differ per chunk (num_mem as a list) for that.
"""

import unicodedata

import torch

LAYOUTS = ("dpl", "upl", "epl")  # default · "+UPL" ablation (encoder only) · UPL + CPL
CARRIERS = ("embeds", "kv")  # ICAE: final hidden states as input embeddings · 500x: per-layer K/V
TASKS = ("ae", "lm", "qa")  # reconstruct the context · continue it · answer a question


# ---- argument checks: every malformed argument is a ValueError that names the argument ----

def _check_int(name, value, minimum):
    # bool is an int subclass; True as a length is almost certainly a bug, so reject it too
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_mem(num_mem, chunk_len):
    _check_int("num_mem", num_mem, 1)
    if num_mem > chunk_len:
        raise ValueError(f"num_mem must be <= the chunk length ({chunk_len}), got {num_mem}")


# ---- UPL: EPL Algorithm 1 ----

def upl(num_mem, first, last):
    """Uniform Position Layout: |M| memory positions spread over context positions first … last.

    EPL Algorithm 1, computed in float64 and rounded with torch.round (half to even), e.g.
    upl(102, 1, 510) = 3, 8, …, 508 (EPL Table 12, chunk 1).
    """
    _check_int("first", first, 0)
    _check_int("last", last, first)
    _check_mem(num_mem, last - first + 1)
    r = (last - first + 1) / num_mem  # EPL Algorithm 1, line 3: context tokens per memory token
    o = (r - 1) / 2  # line 4: half a group minus half a token, so each u sits mid-group
    # line 5: float64, because float32 linspace lands on the other side of .5 ties (e.g. |M|=9 over 0 … 11)
    u = torch.linspace(first + o, last - o, num_mem, dtype=torch.float64)
    return torch.round(u).long()  # line 6: torch.round rounds half to even (2.5 -> 2, 6.5 -> 6)


# ---- encoder ----

def encoder_positions(layout, chunk_index, chunk_len, num_mem, offset=None, span=None):
    """Position IDs of one chunk [S(i); M(i)] in the compressor (EPL Table 12).

    chunk_index is 0-based. offset = number of context tokens before this chunk; it defaults to
    chunk_index * chunk_len (all earlier chunks as long as this one) and must be given for a
    shorter last chunk. span = the context range UPL spreads the memory over: the chunk's own
    length (None) or the nominal chunk length L of a short last chunk (EPL code). DPL puts the
    memory after the chunk's real tokens, however many there are (EPL code: every chunk gets |M|).
    Returns (ctx_pos [chunk_len], mem_pos [num_mem]).
    """
    _check_choice("layout", layout, LAYOUTS)
    _check_int("chunk_index", chunk_index, 0)
    _check_int("chunk_len", chunk_len, 1)
    if span is not None:
        _check_int("span", span, chunk_len)
    if layout != "dpl":   # UPL needs a context position per memory token (r >= 1)
        _check_mem(num_mem, span or chunk_len)
    _check_int("num_mem", num_mem, 1)
    if layout == "dpl":
        # EPL Table 12, DPL: physical positions, the same for every chunk (chunks are encoded apart)
        ctx = torch.arange(chunk_len)  # 0 … L−1
        mem = torch.arange(chunk_len, chunk_len + num_mem)  # L … L+|M|−1
        return ctx, mem
    # "upl" and "epl" share the encoder (Table 6 caption: "+UPL applies only UPL to encoder")
    start = chunk_index * chunk_len if offset is None else offset
    _check_int("offset", start, 0)
    # EPL Table 12, EPL: chunk i holds x_(i−1)L … x_iL−1 at (i−1)L+1 … iL; position 0 is left for [AE],
    # so that x_j sits at j+1 here and when the decoder reconstructs it (Table 13, CPL)
    ctx = torch.arange(start + 1, start + chunk_len + 1)
    # EPL Algorithm 1 over this chunk's context range (Table 12 writes it ⌊b + j·r⌉, b = (i−1)L + 1 + (r−1)/2);
    # EPL code: over the nominal start+1 … start+L even when the chunk is shorter (span = L)
    mem = upl(num_mem, start + 1, start + (span or chunk_len))
    return ctx, mem


# ---- decoder ----

def decoder_positions(layout, carrier, task, chunk_lens, num_mem, context_len, n_follow, span=None):
    """Position IDs on the decoder side: [memory; [AE] or [LM]; what follows] (EPL Tables 13–15).

    chunk_lens: length of every compressed chunk (the last may be shorter); num_mem: one int for
    all chunks or a list, one per chunk; context_len: p, the compressed context length (normally
    sum(chunk_lens)); n_follow: tokens after the special token — AE: the reconstructed context,
    LM: the completion, QA: question + answer. span: as in encoder_positions (EPL code: the nominal
    chunk length, so a short last chunk's memory keeps its full-chunk UPL positions).
    Returns (mem_pos [Σ|M_i|], special_pos: int, follow_pos [n_follow]).
    """
    _check_choice("layout", layout, LAYOUTS)
    _check_choice("carrier", carrier, CARRIERS)
    _check_choice("task", task, TASKS)
    if isinstance(chunk_lens, int) or len(chunk_lens) == 0:
        raise ValueError(f"chunk_lens must be a non-empty list of ints, got {chunk_lens!r}")
    for n in chunk_lens:
        _check_int("chunk_lens", n, 1)
    mems = [num_mem] * len(chunk_lens) if isinstance(num_mem, int) else list(num_mem)
    if len(mems) != len(chunk_lens):
        raise ValueError(f"num_mem must be an int or one per chunk ({len(chunk_lens)}), got {len(mems)}")
    for n, m in zip(chunk_lens, mems):
        _check_int("num_mem", m, 1)
        if layout != "dpl":
            _check_mem(m, span or n)
    _check_int("context_len", context_len, 0)
    _check_int("n_follow", n_follow, 0)

    # ---- memory ----
    if layout == "epl" or carrier == "kv":
        # EPL: CPL keeps memory where it was encoded (§3.2.2, Tables 13–15 EPL rows: 3 … 508, 513 … 1018).
        # KV carrier: cached keys already carry their encoder positions (Table 13 DPL(500x): 510 … 611
        # for every chunk; under "+UPL" the UPL positions instead).
        starts = [sum(chunk_lens[:i]) for i in range(len(chunk_lens))]  # cumulative chunk offsets
        # span and max(span, n): UPL's range for each chunk, the nominal span (EPL code) or, with none, the chunk's own
        mem_pos = torch.cat([encoder_positions(layout, i, n, m, offset=s, span=span and max(span, n))[1]
                             for i, (n, m, s) in enumerate(zip(chunk_lens, mems, starts))])
    else:
        # embeds carrier, DPL decoder: memory outputs are fresh input embeddings at their physical
        # positions (Table 13 DPL(ICAE): 0 … k|M|−1, chunk after chunk)
        mem_pos = torch.arange(sum(mems))

    # ---- the special token and what follows it ----
    if layout == "epl" and task == "ae":
        special = 0  # EPL Table 13 (CPL): [AE] at 0, so x_j is reconstructed at j+1, as encoded
    elif layout == "epl":
        special = context_len  # EPL Tables 14–15 (CPL): [LM] at p, the completion / Q, A at p+1, …
    else:
        # DPL decoder (also "+UPL"): physical position after the k|M| memory slots, for the KV
        # carrier too, where k|M| is the cache length (Tables 13–15 DPL rows: 204)
        special = len(mem_pos)
    follow_pos = torch.arange(special + 1, special + 1 + n_follow)
    return mem_pos, special, follow_pos


def decoder_inputs(layout, carrier, task, chunk_lens, num_mem, context_len, n_follow, span=None, n_prefix=0,
                   delimiters=False, special=True):
    """Position IDs of every input slot the decoder reads, in order: [prefix; ([BOS]); memory of each chunk
    (between <mem> and </mem> with PCC's delimiters; embedding carrier only); special token (if any); follow].
    The K/V carrier's memory is no input: its keys keep their encoder positions (decoder_positions' mem_pos).

    DPL and "+UPL" decoders number the inputs physically (EPL Tables 13–15 DPL rows), after the cached memory
    slots for the K/V carrier; with no special token the text takes its slot. EPL: decoder_positions (CPL), with
    no special token the text keeps its positions after the special's. n_prefix: decoder tokens before the
    memory (a chat template's header); EPL defines no position for them, so it takes none.

    PCC's delimiters under EPL (ours: PCC's code has no position layout but its own; this follows EPL's principle
    that every slot takes the position of the text it stands for): [BOS] at 0, the start of the sequence; chunk
    i's memory keeps its UPL positions inside the chunk's span s+1 … s+L, and its <mem> and </mem> sit just
    outside that span, at s and s+L+1, where they open and close it; the special token and the text follow as
    for any EPL decoder ([AE] at 0 and x_j at j+1; x_k or nothing, then the text from p+1).
    Returns a list of ints, one per input slot.
    """
    mems = [num_mem] * len(chunk_lens) if isinstance(num_mem, int) else list(num_mem)
    if delimiters and carrier != "embeds":
        raise ValueError("delimiters surround memory embeddings in the decoder input: they need carrier embeds")
    if layout != "epl":   # physical numbering: only the slot counts matter (no decoder_positions needed)
        in_memory = (sum(mems) + 2 * len(mems) * delimiters) if carrier == "embeds" else 0
        start = sum(mems) if carrier == "kv" else 0    # after the cache's k|M| slots (Table 13, DPL(500x))
        n = n_prefix + delimiters + in_memory + special + n_follow
        return list(range(start, start + n))
    if n_prefix:
        raise ValueError("EPL positions are defined for [memory, special token, text]: use a template without a "
                         "prefix (not a chat template) with --layout epl")
    mem_pos, special_pos, follow_pos = decoder_positions(layout, carrier, task, chunk_lens, num_mem, context_len,
                                                         n_follow, span)
    before = []
    if carrier == "embeds" and delimiters:
        before = [0]                                                     # [BOS] (ours, see above)
        starts, at = [sum(chunk_lens[:i]) for i in range(len(chunk_lens))], 0
        for n, m, s in zip(chunk_lens, mems, starts):
            width = max(span, n) if span else n                          # the span UPL spread the memory over
            before += [s] + mem_pos[at:at + m].tolist() + [s + width + 1]   # <mem>, memory, </mem> (ours)
            at += m
    elif carrier == "embeds":
        before = mem_pos.tolist()
    return before + ([special_pos] if special else []) + follow_pos.tolist()


# ---- `python positions.py`: the worked example as the paper's tables ----

def _ends(values, head=2):
    # the paper's elision: first `head` values, "…", last value
    values = [str(v) for v in values]
    return values if len(values) <= head + 1 else values[:head] + ["…", values[-1]]


def _width(text):
    # printed width: the combining tilde of "m̃" takes no column of its own
    return sum(not unicodedata.combining(ch) for ch in text)


def _table(title, header, rows):
    # right-aligned columns, "│" between the groups that header marks with "|"
    print(title)
    cols = [header] + [cells for _, cells in rows]
    width = [max(_width(c[j]) for c in cols) for j in range(len(header))]
    names = [""] + [name for name, _ in rows]
    name_w = max(len(n) for n in names)
    for name, cells in zip(names, cols):
        line = "  ".join("│" if c == "|" else " " * (w - _width(c)) + c for c, w in zip(cells, width))
        print(f"  {name.ljust(name_w)}  {line}")
    print()


def main():
    k, L, M, p, X, Q, A = 2, 510, 102, 1020, 2040, 50, 5  # EPL Tables 1–3, 12–15
    lens = [L] * k
    print(f"EPL worked example: k={k}, L={L}, |M|={M}, r={L // M}, |X|={X}, p={p}, |Q|={Q}, |A|={A}\n")

    # Table 12 (and Table 1): encoder, one table per chunk
    for i in range(k):
        header = _ends([f"x{j}" for j in range(i * L, (i + 1) * L)]) + ["|"] + _ends([f"m{j}" for j in range(M)])
        rows = []
        for name, layout in (("DPL", "dpl"), ("EPL", "epl")):
            ctx, mem = encoder_positions(layout, i, L, M)
            rows.append((name, _ends(ctx.tolist()) + ["|"] + _ends(mem.tolist())))
        _table(f"EPL Table 12 / Table 1 — encoder, chunk S({i + 1})", header, rows)

    # Tables 13–15 (and 2, 3): decoder, one table per task; "+UPL" rows are the Table 6 ablation
    decoders = (("DPL(ICAE)", "dpl", "embeds"), ("DPL(500x)", "dpl", "kv"), ("EPL", "epl", "embeds"),
                ("+UPL(ICAE)", "upl", "embeds"), ("+UPL(500x)", "upl", "kv"))
    mem_head = ["m̃0(1)", "m̃1(1)", "…", f"m̃{M - 1}({k})"]
    tasks = (("ae", "EPL Table 13 / Table 2 — decoder, AE task", "[AE]", [f"x{j}" for j in range(p)], p),
             ("lm", "EPL Table 14 / Table 3 — decoder, LM task", "[LM]", [f"x{j}" for j in range(p, X)], X - p),
             ("qa", "EPL Table 15 — decoder, QA task", "[LM]", None, Q + A))
    for task, title, special_name, follow_names, n_follow in tasks:
        if task == "qa":  # Q and A shown apart, as in Table 15
            header = mem_head + ["|", special_name, "|", "q0", "…", f"q{Q - 1}", "|", "a0", "…", f"a{A - 1}"]
        else:
            header = mem_head + ["|", special_name, "|"] + _ends(follow_names)
        rows = []
        for name, layout, carrier in decoders:
            mem, special, follow = decoder_positions(layout, carrier, task, lens, M, p, n_follow)
            follow = follow.tolist()
            if task == "qa":
                tail = [str(follow[0]), "…", str(follow[Q - 1]), "|", str(follow[Q]), "…", str(follow[-1])]
            else:
                tail = _ends(follow)
            rows.append((name, _ends(mem.tolist()) + ["|", str(special), "|"] + tail))
        _table(title, header, rows)
    print("+UPL rows: the Table 6 ablation (UPL encoder, DPL decoder); the paper does not tabulate them.")


if __name__ == "__main__":
    main()
