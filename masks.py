"""Attention masks for soft context compression.

Every function returns a torch.bool tensor with True = query i (row) may attend key j (column),
which is what `F.scaled_dot_product_attention(attn_mask=...)` expects for a boolean mask.

What is here, and where it comes from:

    causal(n)                     the ordinary decoder mask, i ≥ j.
    causal(L, M)                  the same over [context, memory]: the baseline compressor mask of PCC / ICAE /
                                  500xCompressor / AOC (PIC paper §3.1, Eq. 2, Figure 4(a)).
    pic(L, M)                     PIC's block-wise causal mask (PIC paper §3.3, Eq. 4–5, Figure 4(c)).
    block_bounds(L, N)            how pic() cuts the context into N blocks, one per memory token.
    segments(lens, mems)          block-diagonal mask: each segment and its memory tokens form one
                                  causal block (CompLLM §3; multi-chunk ICAE / EPL §3.1.1).
    with_prefix / with_padding    glue for a KV prefix and for padded batches.
    sliding_window(T, S, W)       Gemma 3's local-attention band: each query sees the last W slots only.
    with_window(mask, W)          a layer's mask with that band ANDed on, keeping with_padding's promise.
    render(mask)                  a ■ / · text grid;  `python masks.py pic 8 2` draws Figure 4(c).

PIC, Eq. (4): the compressor input is Z = [c_1, …, c_N, m_1, …, m_N] = [X, M̃], the context X
(L tokens) cut into N equal blocks c_k, followed by one memory token m_t per block. (The paper calls
the c_k "chunks"; here they are "blocks", because a chunk is the compressor's row of chunk_len tokens
that pic() is applied to, compressors.py.)
PIC, Eq. (5): M_ij = 0 if Visible(i, j) else −∞, with Visible(i, j) = 1 exactly when
    rule 1 (intra-context causal):    z_i, z_j ∈ X       and i ≥ j;
    rule 2 (intra-memory causal):     z_i, z_j ∈ M̃       and i ≥ j;
    rule 3 (memory-to-block):         z_i = m_t, z_j ∈ c_k and t = k.
Nothing else is visible: a context token never sees a memory token, and m_t sees earlier blocks only
through m_1 … m_{t−1} (so h_t = Compressor(c_t, h_<t), Eq. 3, in one parallel pass).

Our generalisation (the paper assumes "L is divisible by N", §3.1; one memory token per block, N = M):
  * uneven lengths: block k (0-based) covers context tokens ⌊k·L/N⌋ … ⌊(k+1)·L/N⌋ − 1, so the
    block sizes differ by at most one and the longer blocks are spread out (see block_bounds).
  * more memory tokens than context tokens (PCC's code gives a short last segment all its slots):
    some blocks are empty, and their memory tokens see only the memory tokens before them.
Both reduce to the paper's mask when N divides L.
"""

import torch


# ---- argument checks: every malformed argument is a ValueError that names the argument ----

def _check_int(name, value, minimum):
    # bool is an int subclass; True as a length is almost certainly a bug, so reject it too
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")




# ---- the masks ----

def causal(n, num_mem=0, device=None):
    """Ordinary causal mask [n+M, n+M]: query i sees keys 0 … i. With num_mem = M, the baseline compressor mask over
    [context, memory] (PCC / ICAE / 500xCompressor / AOC, PIC Figure 4(a)): every memory token m_t sees the whole
    context and m_1 … m_t (PIC Eq. 2: h_t = Compressor(X, m_<t)); the encoder mask setting "causal". device: where
    to build it (a mask from shapes alone is made where it is used, with no copy from the host)."""
    _check_int("n", n, 0)
    _check_int("num_mem", num_mem, 0)
    return torch.ones(n + num_mem, n + num_mem, dtype=torch.bool, device=device).tril()


def block_bounds(context_len, num_blocks):
    """Half-open [start, end) token ranges of the N blocks that pic() cuts the context into.

    Block k (0-based) is ⌊k·L/N⌋ … ⌊(k+1)·L/N⌋ − 1: equal blocks of L/N tokens when N divides L
    (PIC §3.3.1, "X uniformly divided into N chunks", our blocks); otherwise sizes ⌊L/N⌋ or ⌈L/N⌉,
    interleaved.
    Example: block_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]. More blocks than tokens (a short
    last segment that keeps all its memory slots, as PCC's code gives it) leaves some blocks empty:
    block_bounds(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)] (ours).
    """
    _check_int("context_len", context_len, 1)
    _check_int("num_blocks", num_blocks, 1)
    L, N = context_len, num_blocks
    return [(k * L // N, (k + 1) * L // N) for k in range(N)]


def pic(context_len, num_mem):
    """PIC block-wise causal mask [L+M, L+M] on Z = [c_1, …, c_N, m_1, …, m_N] (PIC Eq. 4–5).

    num_mem = M memory tokens, one per block, so N = M blocks (uneven blocks are our generalisation,
    see the module docstring and block_bounds). With more blocks than context tokens some blocks are empty,
    and their memory tokens see only the memory before them (rules 2 and 3; ours).
    """
    _check_int("context_len", context_len, 1)
    _check_int("num_mem", num_mem, 1)
    L, M = context_len, num_mem

    # which block every context token belongs to (0-based), PIC Eq. (4): X = (c_1, …, c_N)
    ctx_block = torch.empty(L, dtype=torch.long)
    for k, (start, end) in enumerate(block_bounds(L, M)):
        ctx_block[start:end] = k
    mem_block = torch.arange(M)   # m_t belongs to c_t

    mask = torch.zeros(L + M, L + M, dtype=torch.bool)  # rule 4: everything else invisible
    mask[:L, :L] = causal(L)  # PIC Eq. (5), rule 1: context sees context causally
    mask[L:, L:] = causal(M)  # PIC Eq. (5), rule 2: memory sees memory causally
    # PIC Eq. (5), rule 3: m_t sees block c_k iff t = k  ->  (M, 1) == (1, L) gives [M, L]
    mask[L:, :L] = mem_block[:, None] == ctx_block[None, :]
    # mask[:L, L:] stays False: no context token ever sees a memory token
    return mask


# The encoder masks over [chunk, memory] that a compressor config's `mask` names; CompressorConfig.mask's choices
# are these keys, so a new mask is a function above and its entry here
ENCODER = {"causal": causal,   # PCC / ICAE, PIC Figure 4(a)
           "pic": pic}         # PIC Eq. (5)


def segments(segment_lens, mems_per_segment):
    """Block-diagonal mask [T, T] on the interleaved sequence [s_1, mem_1, s_2, mem_2, …].

    Each block is one segment followed by its memory tokens, causal inside, and blind to every
    other block: CompLLM §3 (each segment of n tokens gets ⌈n/C⌉ EOS embeddings and is compressed
    independently) and multi-chunk ICAE / EPL §3.1.1 (each chunk S(i) with its own M(i), Eq. 1),
    run as one packed sequence. mems_per_segment is one int for all segments or a list, one per
    segment; a segment may not have more memory tokens than tokens (as num_mem <= context_len).
    """
    if isinstance(segment_lens, int) or len(segment_lens) == 0:
        raise ValueError(f"segment_lens must be a non-empty list of ints, got {segment_lens!r}")
    for n in segment_lens:
        _check_int("segment_lens", n, 1)
    if isinstance(mems_per_segment, int):
        mems_per_segment = [mems_per_segment] * len(segment_lens)
    if len(mems_per_segment) != len(segment_lens):
        raise ValueError(f"mems_per_segment must have one entry per segment ({len(segment_lens)}), "
                         f"got {len(mems_per_segment)}")
    for n, m in zip(segment_lens, mems_per_segment):
        _check_int("mems_per_segment", m, 1)
        if m > n:
            raise ValueError(f"mems_per_segment must be <= its segment length ({n}), got {m}")
    # one causal block per (segment, memory) pair; zeros between blocks = no cross-segment attention
    return torch.block_diag(*[causal(n + m) for n, m in zip(segment_lens, mems_per_segment)])


# ---- glue for caches and batches ----

def with_prefix(mask, prefix_len):
    """Prepend P always-visible key columns: [..., T, S] -> [..., T, P+S].

    Used when memory reaches the decoder as a KV prefix (500xCompressor, AOC): every query may
    attend every cached memory key, and the queries' own mask follows unchanged.
    """
    _check_int("prefix_len", prefix_len, 0)
    prefix = torch.ones(*mask.shape[:-1], prefix_len, dtype=torch.bool, device=mask.device)
    return torch.cat([prefix, mask], dim=-1)


def with_padding(mask, valid):
    """Hide padded keys per example: mask [T, S] or [B, T, S], valid bool [B, S] -> [B, T, S].

    Queries are the last T of the S keys (query i is key S−T+i: for a square mask query i is key i,
    after with_prefix it is key P+i). A query whose keys are all padding (e.g. a pad token under
    left padding) would get an all-False row; SDPA turns that into a softmax over −∞ only, which is
    NaN on several kernels and poisons the backward pass. Such a row is given exactly one key: the
    query itself. Its output is then finite garbage — the loss must ignore padded positions anyway.
    """
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(f"valid must be a bool tensor [B, S], got {valid.dtype} {tuple(valid.shape)}")
    T, S = mask.shape[-2], mask.shape[-1]
    if valid.shape[1] != S:
        raise ValueError(f"valid must have one entry per key ({S}), got {valid.shape[1]}")
    if mask.dim() == 3 and mask.shape[0] != valid.shape[0]:
        raise ValueError(f"valid batch size {valid.shape[0]} does not match mask batch size {mask.shape[0]}")
    if T > S:
        raise ValueError(f"mask must have at least as many keys as queries, got [{T}, {S}]")
    return _no_empty_rows(mask & valid[:, None, :])  # [T, S] & [B, 1, S] -> [B, T, S]: padded keys invisible


def _no_empty_rows(mask):
    """[..., T, S] -> the same mask, where a query row with no visible key at all sees itself (query i is key
    S−T+i), so SDPA never gets an all-False row (with_padding's docstring says why)."""
    T, S = mask.shape[-2], mask.shape[-1]
    own = torch.arange(S, device=mask.device)[None, :] == torch.arange(S - T, S, device=mask.device)[:, None]  # [T, S]
    return mask | (~mask.any(dim=-1, keepdim=True) & own)


def stack_padded(row_masks, size):
    """Batch square masks of different sizes: each [n_b, n_b] mask sits top-left in a [size, size]
    grid and the rest of its row is right padding -> [B, size, size]. A padded position sees only
    itself (as in with_padding), so SDPA never gets an all-False row; nothing real sees padding."""
    out = torch.zeros(len(row_masks), size, size, dtype=torch.bool)
    for b, m in enumerate(row_masks):
        n = m.shape[-1]
        if m.shape != (n, n) or n > size:
            raise ValueError(f"row_masks[{b}] must be square and at most {size} long, got {tuple(m.shape)}")
        out[b, :n, :n] = m
        pad = torch.arange(n, size)
        out[b, pad, pad] = True  # padding attends to itself only
    return out


def sliding_window(num_queries, num_keys, window, device=None):
    """Gemma 3's local attention band [T, S]: key j is within W slots of query i, j > q − W, where the queries are
    the last T of the S key slots (query i is slot q = S−T+i, as in with_padding). The query itself and the W−1
    slots before it pass (HF masking_utils.sliding_window_overlay: kv_idx > q_idx − sliding_window).

    Slots, not position ids: a KV prefix's P slots count like any tokens before the queries, so a prefix forward
    sees exactly what one pass over the same sequence would. Not causal by itself: AND it with the layer's mask.
    """
    _check_int("num_queries", num_queries, 0)
    _check_int("num_keys", num_keys, num_queries)
    _check_int("window", window, 1)
    q = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]   # [T, 1] the queries' slots
    k = torch.arange(num_keys, device=device)[None, :]                            # [1, S]
    return k > q - window


def with_window(mask, window):
    """A Gemma 3 local layer's mask: sliding_window ANDed onto a layer's mask [..., T, S] (queries the last T of the
    S slots). The band can empty a row that with_padding had left non-empty: under right padding a pad query sees
    the real keys, all of which may lie W or more slots back (real lengths 30 and 5, W = 8: 18 such rows). Such a
    row sees itself again, as in with_padding, so the composition keeps its promise of no all-False row (SDPA
    returns NaN there on some kernels, and 0 × NaN in the next layer reaches real tokens). Real queries always
    see themselves, so they are untouched."""
    T, S = mask.shape[-2], mask.shape[-1]
    return _no_empty_rows(mask & sliding_window(T, S, window, mask.device))


# ---- text rendering ----

def render(mask, boundaries=(), labels=None):
    """A mask [T, S] as a text grid: ■ = query (row) may attend key (column), · = masked.

    boundaries: key indices b that start a new block; a line is drawn before column b and before
    the row of the query that is key b (query i is key S−T+i, as in with_padding, so a mask from
    with_prefix keeps its row lines). labels: optional list of T short row names ("c1", "m2").
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [T, S] to render, got shape {tuple(mask.shape)}")
    T, S = mask.shape
    cuts = set(boundaries)
    width = max((len(name) for name in labels), default=0) if labels else 0

    def cells(row):
        # two characters per column, "│ " in front of every column that starts a block
        return "".join(("│ " if j in cuts and j > 0 else "") + ("■ " if row[j] else "· ")
                       for j in range(S)).rstrip()

    # the horizontal line: "──" under every column, "┼─" where a "│ " crosses it (drop the last "─")
    indent = " " * (width + 1) if labels else ""
    rule = indent + "".join(("┼─" if j in cuts and j > 0 else "") + "──" for j in range(S))[:-1]
    lines = []
    for i in range(T):
        if i + (S - T) in cuts and i > 0:
            lines.append(rule)
        name = labels[i].rjust(width) + " " if labels else ""
        lines.append(name + cells(mask[i].tolist()))
    return "\n".join(lines)


def _pic_labels(context_len, num_mem):
    # row names for render(): "c<k>" for a context token of block k, "m<t>" for memory token t
    names = [""] * context_len
    for k, (start, end) in enumerate(block_bounds(context_len, num_mem)):
        names[start:end] = [f"c{k + 1}"] * (end - start)
    return names + [f"m{t + 1}" for t in range(num_mem)]


def main(argv=None):
    """`python masks.py pic 8 2` | `causal 8 2` | `segments 3,2 1` | `causal 6`."""
    import argparse

    parser = argparse.ArgumentParser(description="Print an attention mask as a ■ / · grid.")
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("causal", help="ordinary causal mask, over [context, memory] with a second number")
    p.add_argument("context_len", type=int)
    p.add_argument("num_mem", type=int, nargs="?", default=0)
    p = sub.add_parser("pic", help="PIC's compressor mask over [context, memory]")
    p.add_argument("context_len", type=int)
    p.add_argument("num_mem", type=int)
    p = sub.add_parser("segments", help="block-diagonal mask, e.g. `segments 3,2 1` or `segments 4,3 2,1`")
    p.add_argument("segment_lens", help="comma-separated segment lengths")
    p.add_argument("mems_per_segment", help="one int, or comma-separated, one per segment")
    args = parser.parse_args(argv)

    legend = "■ = row (query) may attend column (key)"
    if args.kind == "causal" and not args.num_mem:
        print(f"causal mask, n={args.context_len}; {legend}")
        print(render(causal(args.context_len)))
    elif args.kind in ("pic", "causal"):
        L, M = args.context_len, args.num_mem
        if args.kind == "pic":
            mask = pic(L, M)
            print(f"PIC block-wise causal mask (PIC Eq. 5, Figure 4(c)), L={L}, N={M} blocks, one memory token "
                  f"per block; {legend}")
        else:
            mask = causal(L, M)
            print(f"causal mask over [context, memory] (PCC / ICAE, PIC Figure 4(a)), L={L}, M={M}; {legend}")
        # lines between blocks, and between the context and the memory
        # (the causal mask has no blocks of its own: PIC's are drawn, for comparison)
        cuts = [start for start, _ in block_bounds(L, M)] + [L]
        print(render(mask, cuts, _pic_labels(L, M)))
    else:
        lens = [int(x) for x in args.segment_lens.split(",")]
        mems = [int(x) for x in args.mems_per_segment.split(",")]
        mems = mems * len(lens) if len(mems) == 1 else mems  # one count for all segments
        mask = segments(lens, mems)
        # rows "s<i>" for segment i's tokens, "m<i>" for its memory tokens; a line before each block
        names, cuts = [], []
        for i, (n, m) in enumerate(zip(lens, mems), start=1):
            cuts.append(len(names))
            names += [f"s{i}"] * n + [f"m{i}"] * m
        print(f"segment block-diagonal mask, segments {lens}, memory tokens {mems}; {legend}")
        print(render(mask, cuts, names))

if __name__ == "__main__":
    main()
