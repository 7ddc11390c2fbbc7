"""
Every context-compression method in this repository, as a preset over shared parts.

A soft compressor reads a context X with an *encoder* and hands the *decoder* (a frozen LLM) a short
*memory* in its place. The papers differ along a few independent axes; each axis is implemented once
below and a method is just a choice along each of them (a preset, PRESETS):

    axis            options                                                     used by
    ------------    ---------------------------------------------------------   -----------------------
    encoder         lora (on the decoder's own weights) | full (a trained copy)  ICAE/500x/CompLLM | AOC
                    | separate (another model) | first_k (first k layers+LoRA)   PCC/PIC | GMSA
    mlp             swiglu | aoc (AOC Eq. 3: h = LN_post(h) + h) | none          AOC (lora + aoc: LoRA-AOC)
    source          mem_tokens (learned, appended) | eos (EOS embeddings,        ICAE/500x/PCC/PIC/AOC |
                    appended) | group_mean (mean of groups of r hidden states)    CompLLM | GMSA
    mem_init        embed N(μ, σ of the embedding table) | normal N(0, 1) | hf    EPL | ICAE/500x/AOC | PCC
    chunking        fixed (chunks of chunk_len) | sentences (CompLLM segments)   all | CompLLM
    mask            causal over [chunk, memory] | pic (PIC Eq. 5)                all | PIC
    layout          dpl | upl | epl (EPL §3.2, see positions.py)               EPL on ICAE and 500x
    carrier         embeds (final hidden states as input embeddings)            ICAE/PCC/PIC/CompLLM/GMSA
                    | kv (per-layer K/V as a KV-cache prefix)                   500x/AOC
    bridge          none | linear (CompLLM) | mlp (PCC/PIC converter)            |
                    | lsa (GMSA §3.3: decoder blocks, trained)
    tokens after    [AE]/[LM] learned | [BOS] | x_k (PIC Eq. 7) | nothing       ICAE/EPL | AOC | PIC | CompLLM
    template        plain | pcc | epl | chat: the QA prompt around context and question   PCC | EPL | CompLLM
    decoder         frozen | keft: q/k/v projections train (GMSA §3.5)           GMSA stage 2

One interface for every method (train.py and evaluate.py use nothing else):

    comp = build("aoc", decoder, tok, mem=16)
    memory = comp.compress(contexts)                 # list of token-id lists -> Memory
    loss, n = comp.lm_loss(memory, "ae", follow)      # AE / LM / QA cross-entropy on the decoder
    ids = comp.generate(memory, "ae", max_new_tokens=...)   # a batch, one list of ids per sample

Notation, one name per thing: `mem`, the config's memory budget (slots per chunk; CompLLM's `ratio` C and GMSA's
`ratios` r set it per token instead); `slots`, a text's memory slots per chunk (Memory.slots; slots_for(n), an
n-token chunk's), which positions.py and masks.py take as `num_mem` (the public name SPEC.md fixes); `M`, their
tensor dimension ([B, M, d]; a K/V prefix of P rows); an *index*, a position in a decoder row (next_token_targets,
follow_index), apart from a position ID (positions.py); "ae", autoencoding: the objective, the task and GMSA's
first stage (PIC's TR).

Chunks are always separate rows of one batched encoder forward. That *is* the block-diagonal
`masks.segments` mask (no chunk can see another), computed at linear cost instead of on one long
sequence with a dense mask; tests/test_compressors.py checks the two agree.

What a forward reads that Python lists decide (ids, positions, masks, where the memory is read and the loss taken)
is built on the host first (EncoderInputs, DecoderInputs) and moved to the model's device at once (on_device), and
the shapes that steer Python control flow (how many slots a sample has, which positions carry a loss) are kept as
Python numbers, so a forward pass never waits for the GPU (tests/test_devices.py: every tensor on the model's device;
tests/test_step.py: no sync in a training step, and ops that do not grow with the batch).
"""

import hashlib
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, fields, is_dataclass, replace
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import masks
import positions
from positions import TASKS
from lora import LoRALinear, add_lora, draw_lora_A, lora_disabled
from model import RMSNorm, Transformer, chunked_cross_entropy, copy_model
from presets import CHAT_MARKERS, TEMPLATES, CompressorConfig, make_config


# -----------------------------------------------------------------------------
# the memory handed from encoder to decoder


@dataclass
class Memory:
    embeds: torch.Tensor | None     # [B, M, d_dec] carrier "embeds" (after the bridge)
    kv: list | None                 # carrier "kv": per decoder layer (k, v), each [B, Hkv, M, D], RoPE applied
    valid: torch.Tensor             # [B, M] bool; False = padding (samples compress to different sizes)
    chunk_lens: list                # per sample, context tokens in each chunk
    slots: list                     # per sample, memory slots of each chunk

    def lerp(self, other: "Memory", w: float) -> "Memory":
        """AOC Eq. (5): Z = Z0 + w (Z1 - Z0), on every tensor the decoder reads."""
        if self.slots != other.slots:
            raise ValueError("can only interpolate memories of the same shape (same number of memory slots)")
        mix = lambda a, b: torch.lerp(a, b, w)   # exact at w = 0 and w = 1
        return replace(self, embeds=None if self.embeds is None else mix(self.embeds, other.embeds),
                       kv=None if self.kv is None else [(mix(k0, k1), mix(v0, v1))
                                                        for (k0, v0), (k1, v1) in zip(self.kv, other.kv)])

    def neighbours(self) -> "Memory":
        """Ours (train.py --own-other-weight): each sample's memory traded with its neighbour's, samples 0 and 1, 2 and
        3, ..., on every tensor the decoder reads: another text's memory, for the same decoder rows. Pairs, not a roll
        over the batch, so that a micro-batch of any even size holds whole pairs and the step's pairs are the same
        however it is split. The two samples of a pair must have the same slots (their decoder rows are the same)."""
        B = self.valid.shape[0]
        if B % 2 or self.slots[0::2] != self.slots[1::2]:
            raise UnpairedMemory(f"own/other pairs texts 1-2, 3-4, ... of a micro-batch, which needs an even number of "
                             f"texts with the same memory slots in each pair (got {B} texts, slots {self.slots}): use "
                             "an even --micro-batch and texts that compress to the same slots (--min-len = --max-len, "
                             "or one chunk each)")
        swap = lambda t: t.unflatten(0, (B // 2, 2)).flip(1).flatten(0, 1)   # (B, ...) -> (B/2, 2, ...) -> (B, ...)
        trade = lambda xs: [x for a, b in zip(xs[0::2], xs[1::2]) for x in (b, a)]   # the same on a Python list
        return Memory(embeds=None if self.embeds is None else swap(self.embeds),
                      kv=None if self.kv is None else [(swap(k), swap(v)) for k, v in self.kv],
                      valid=swap(self.valid), chunk_lens=trade(self.chunk_lens), slots=trade(self.slots))


class UnpairedMemory(ValueError):
    """Memory.neighbours on a batch whose texts do not pair (train.py's step_guard ends the run on it in one line)."""


class Chunk(NamedTuple):
    """One chunk of one context (chunk_len tokens at most): one row of the encoder batch."""
    sample: int     # which context of the batch
    index: int      # which chunk of that context
    ids: list       # its encoder token ids
    slots: int      # the memory slots it compresses into
    start: int      # where it starts in its context


class DecoderBatch(dict):
    """The decoder's keyword inputs, `decoder(**batch)`: inputs_embeds (B, T, d), position_ids (B, T), attn_mask
    (B, T, P+T) or None, past_kv or None. And, as an attribute, `supervised`: where the loss is taken, one
    (flat index b*T + t, the token it predicts) per supervised prediction, as Python numbers, so that no step ever
    waits for the GPU to say where (Compressor.assemble sets it, from DecoderInputs)."""


# ---- a step's inputs: everything a forward reads that Python lists decide (ids, positions, masks, where the memory is
# read and where the loss is taken), built on the host before the forward and moved to the device at once, so that
# the forward and backward never wait for a copy (a copy from the host's pageable memory stalls the host until the
# GPU's queue drains; tests/test_step.py counts them)

@dataclass
class EncoderInputs:
    """What compressing a batch of contexts reads (Compressor.encoder_inputs): R encoder rows (chunks) of T slots,
    B samples of at most M memory slots."""
    rows: list                      # the Chunks, one encoder row each
    ids: torch.Tensor               # (R, T) token ids: each chunk, its memory slots' ids, padding
    pos: torch.Tensor | None        # (R, T) position ids; None: the default 0 .. T-1 (group_mean)
    attn: torch.Tensor | None       # (R, T, T) bool: each row's encoder mask; None: plain causal, nothing padded
    mem_slot: torch.Tensor | None   # (R, T) 1 + the memory token in a slot, 0: none (None for group_mean)
    group: torch.Tensor | None      # (R, T) group_mean: each token's group, G for padding (else None)
    read_row: torch.Tensor          # (B, M) the encoder row that sample b's memory slot j is read from ...
    read_at: torch.Tensor           # (B, M) ... and its index there (a slot; a group for group_mean)
    valid: torch.Tensor             # (B, M) bool; False = padding (it reads row 0, index 0, then zeroed)
    chunk_lens: list                # per sample, context tokens in each chunk
    slots: list                     # per sample, memory slots of each chunk


@dataclass
class DecoderInputs:
    """What a decoder forward and its loss read (decoder_inputs). Every input slot of the (B, T) rows is a
    row of one table (Compressor.assemble): [zeros (padding), the learned special vectors named in `specials`, the
    memory's B*M vectors (carrier embeds only), the embeddings of `tokens`], so the rows are one index, whatever B."""
    tokens: torch.Tensor            # (N,) every token id the rows read, embedded in one call
    specials: tuple                 # the learned vectors in the table (SPECIALS' names), in order
    index: torch.Tensor             # (B, T) each input slot's row of the table
    pos: torch.Tensor               # (B, T) position ids
    attn_mask: torch.Tensor | None  # (B, T, P+T) bool, or None when nothing is padded
    supervised: list                # where the loss is taken: [(flat index b*T + t, the token it predicts)]
    flat: torch.Tensor              # (N_sup,) those flat indices ...
    target: torch.Tensor            # (N_sup,) ... the tokens they predict ...
    row: torch.Tensor               # (N_sup,) ... and the sample of each


@dataclass
class DistillInputs:
    """What CompLLM's distillation reads (Compressor.distill_inputs): the teacher's plain rows, the student's."""
    context: EncoderInputs          # the contexts, compressed
    student: DecoderInputs          # [prefix, CEs, question, answer]
    teacher_ids: torch.Tensor       # (B, T) [prefix, context, question, answer], right-padded
    teacher_mask: torch.Tensor      # (B, T, T) bool: causal, padded keys hidden
    teacher_lens: list              # per sample, its teacher row's tokens
    answer_lens: list               # per sample, its answer's tokens


def on_device(inputs, device: torch.device):
    """A step's inputs (EncoderInputs, DecoderInputs, DistillInputs) with every tensor moved to `device` without
    making the host wait: on CUDA pinned, then copied non-blocking (the copy runs behind the kernels queued before
    it); on the CPU nothing moves."""
    # a tensor moves, a nested inputs record (DistillInputs' parts) moves field by field, anything else stays
    move = lambda v: (v.pin_memory() if device.type == "cuda" else v).to(device, non_blocking=True) \
        if isinstance(v, torch.Tensor) else on_device(v, device) if is_dataclass(v) else v
    return replace(inputs, **{f.name: move(getattr(inputs, f.name)) for f in fields(inputs)})


def decoder_inputs(comp, memory, task: str, follow: list, n_supervised: list | None = None,
                   last_tokens: list | None = None, prefix: list | None = None,
                   left_pad: bool = False) -> DecoderInputs:
    """What comp's decoder reads for every sample, on the host: [prefix, memory, special token, follow tokens], padded.

    memory: the Memory, or the EncoderInputs it comes from (only its chunk_lens and slots are read).
    follow[b]: decoder token ids after the special token (AE: comp.ae_target(x); LM: the continuation + EOS;
    QA: prompt + answer + EOS). n_supervised[b]: the loss covers the last n of them (default all).
    last_tokens[b]: x_k, the last context token, for the PIC TC special token (Eq. 7). prefix[b]: decoder ids
    before the memory (a chat template's user header). PCC's delimiters add [BOS] first and wrap each chunk's
    memory in <mem> ... </mem>. Right padding for training, left padding (left_pad) for generation, so that
    every row's last token is its last real one.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task '{task}': choose ae, lm or qa")
    cfg, B, kind = comp.cfg, len(follow), special_token(comp.cfg, task)
    M = max(sum(s) for s in memory.slots)   # the longest sample's slots: the memory's padded length
    # the table's rows (DecoderInputs): 0 zeros, 1.. the learned vectors, the memory's B*M (carrier embeds), tokens
    specials = (("ae_embed" if task == "ae" else "lm_embed",) if kind == "learned" else ()) + comp.mem_delimiters
    delimiters = tuple(1 + specials.index(name) for name in comp.mem_delimiters)
    # 500x/AOC: the memory is no input but a KV-cache prefix of P slots
    P, first_token = (0, 1 + len(specials) + B * M) if comp.carrier.in_input else (M, 1 + len(specials))
    tokens, rows, pos, targets = [], [], [], []   # tokens: the ids the table embeds, row after row
    for b, ids in enumerate(follow):
        before = comp.decoder_bos + list(prefix[b] if prefix else [])   # the delimiters' [BOS]; a chat header
        mem_rows = comp.carrier.decoder_rows(memory.slots[b], 1 + len(specials) + b * M, delimiters)
        # [BOS] (500x, AOC) or x_k (PIC Eq. 7) as the special token: a token's row, as the decoder embeds it
        special = [comp.tok.start_id if kind == "bos" else last_tokens[b]] if kind in ("bos", "last") else []
        at = range(first_token + len(tokens), first_token + len(tokens) + len(before) + len(special) + len(ids))
        tokens += before + special + ids   # their rows: `at`, in this order; a learned special is row 1
        rows.append([*at[:len(before)], *mem_rows, *[1] * (kind == "learned"), *at[len(before):]])
        first = comp.follow_index(task, len(before), len(mem_rows))   # the index of follow[0]
        targets.append(next_token_targets(ids, len(ids) if n_supervised is None else n_supervised[b], first))
        # EPL §3.2 / Tables 13-15: DPL numbers the inputs physically (after the k|M| cached slots of the KV
        # carrier); EPL (CPL) keeps the memory at its encoder positions, [AE] at 0 or [LM] at p, the text after
        pos.append(positions.decoder_inputs(cfg.layout, cfg.carrier, task, memory.chunk_lens[b], memory.slots[b],
                                            sum(memory.chunk_lens[b]), len(ids), span=comp.nominal_len,
                                            n_prefix=len(before) - len(comp.decoder_bos),
                                            delimiters=cfg.delimiters, special=kind != "none"))
    T = max(len(r) for r in rows)
    shift = [T - len(r) if left_pad else 0 for r in rows]        # left padding moves row b's inputs by shift[b]
    pad = lambda b, r: [0] * shift[b] + r + [0] * (T - len(r) - shift[b])   # padding: 0 (the zero row, position 0)
    valid = [[j < sum(memory.slots[b]) for j in range(P)] + pad(b, [True] * len(r)) for b, r in enumerate(rows)]
    # nothing padded: the mask is the model's default (prefix + causal), and passing None lets SDPA use its fused
    # causal kernel instead of the dense-mask one
    attn_mask = None if all(all(v) for v in valid) else \
        masks.with_padding(masks.with_prefix(masks.causal(T), P), torch.tensor(valid, dtype=torch.bool))
    supervised = [(b * T + shift[b] + i, token) for b, row in enumerate(targets) for i, token in row]
    long = lambda x: torch.tensor(x, dtype=torch.long)
    index, flat = long([pad(b, r) for b, r in enumerate(rows)]), long([i for i, _ in supervised])   # (B, T), (N,)
    return DecoderInputs(long(tokens), specials, index, long([pad(b, p) for b, p in enumerate(pos)]), attn_mask,
                         supervised, flat, long([t for _, t in supervised]), flat // T)


def memory_layout(rows: list, first) -> tuple:
    """Where each sample's memory is read: its chunks' slots, chunk after chunk, right-padded to the longest sample's
    M slots. rows: the Chunks, in sample order; first(j, row): the index of row j's first memory slot in what is read.
    Returns (read_row (B, M), read_at (B, M), valid (B, M)) on the host, and per sample its chunk lengths and slots."""
    samples = [[(j, row) for j, row in enumerate(rows) if row.sample == b] for b in range(rows[-1].sample + 1)]
    reads = [[(j, first(j, row) + s) for j, row in sample for s in range(row.slots)] for sample in samples]
    M = max(map(len, reads))
    at = torch.tensor([r + [(0, 0)] * (M - len(r)) for r in reads], dtype=torch.long)   # (B, M, 2); padding: (0, 0)
    return (at[..., 0], at[..., 1], torch.tensor([[j < len(r) for j in range(M)] for r in reads]),
            [[len(row.ids) for _, row in sample] for sample in samples], [[row.slots for _, row in sample]
                                                                        for sample in samples])


def group_means(x: torch.Tensor, group: torch.Tensor, G: int) -> torch.Tensor:
    """The exact mean of x (R, T, d) over each row's groups: group (R, T) holds each position's group, 0 .. G - 1, or
    G for a position that belongs to none (dropped). Returns (R, G, d); an empty group's mean is 0. Sums, then a
    division by each group's size, so that a shorter group (the last one) is still its own mean."""
    sums = torch.zeros(x.shape[0], G + 1, x.shape[-1], device=x.device, dtype=torch.float32)
    sums.scatter_add_(1, group[..., None].expand(-1, -1, x.shape[-1]), x.float())
    sizes = torch.zeros(x.shape[0], G + 1, device=x.device).scatter_add_(1, group, torch.ones_like(group,
                                                                                                 dtype=torch.float))
    return (sums / sizes.clamp(min=1)[..., None]).to(x.dtype)[:, :G]


def text_means(x: torch.Tensor, mem_slot: torch.Tensor) -> torch.Tensor:
    """--mem-from-text (ours): at each memory slot of the encoder rows, the mean of its chunk's token embeddings over
    the slot's segment, (R, T, d), 0 elsewhere. x (R, T, d): the rows' input embeddings, each row [chunk (n), memory
    slots (m), padding]; mem_slot (R, T): 1 + the slot's index, 0 for no slot (EncoderInputs). The n tokens are cut
    into m contiguous segments, token t in segment ⌊t·m/n⌋ (sizes ⌊n/m⌋ or ⌈n/m⌉; with n < m some are empty: 0).
    n and m are read off mem_slot on the device, so no row's length is needed on the host."""
    T = x.shape[1]
    is_slot = mem_slot > 0
    n = is_slot.int().argmax(1, keepdim=True)                 # (R, 1) the first memory slot follows the n tokens
    m = mem_slot.amax(1, keepdim=True)                        # (R, 1)
    t = torch.arange(T, device=x.device)[None]                # (1, T)
    segment = torch.where(t < n, t * m // n, T)               # (R, T): each token's segment; T: none (dropped)
    means = group_means(x, segment, T)                        # (R, T, d): segment j's mean at index j
    at = (mem_slot - 1).clamp(min=0)[..., None].expand_as(x)  # slot s reads segment s - 1 (the clamp: s = 0, unused)
    return torch.where(is_slot[..., None], means.gather(1, at), 0)


# The two carriers (EPL §3: ICAE's and 500xCompressor's), one picked when the compressor is built. A memory is a list
# of tensors whose first two dimensions are (sample, memory slot) (Embeds: [h]; KV: [k_0, v_0, k_1, v_1, ...]), so
# reading, caching and padding it is the same for both; the carrier says how the slots are read off the encoder, what
# the padded batch becomes, and how the decoder receives it.

class Embeds:
    """ICAE §3.1: the encoder's final hidden states at the memory slots (its final norm applied), through the bridge,
    become input embeddings of the decoder; PCC code: each chunk's between <mem> and </mem>."""
    needs_kv = False   # the encoder forward need not return its K/V
    in_input = True    # the memory's vectors are decoder inputs (its rows of DecoderInputs' table)

    @staticmethod
    def read_slots(encoder_out, row: torch.Tensor, at: torch.Tensor) -> list:
        """[final hidden states at the memory slots (..., d_enc)]: encoder row `row`, slot `at`, any shape (...)."""
        return [encoder_out.last_hidden[row, at]]                   # (R, T, d_enc) -> (..., d_enc), one index

    @staticmethod
    def memory(comp, padded: list, valid: torch.Tensor) -> dict:
        """[hidden states (B, M, d_enc)] -> the Memory's embeds (B, M, d_dec), through the bridge."""
        return dict(embeds=comp.bridge(padded[0], valid), kv=None)

    @staticmethod
    def decoder_rows(slots: list, first: int, delimiters: tuple) -> list:
        """A sample's memory as decoder input rows, chunk after chunk: their rows of the input table (DecoderInputs),
        its memory vectors at first, first + 1, ...; delimiters: the rows of <mem> and </mem> (PCC code:
        <mem> m_1 .. m_k </mem> per segment), or ()."""
        ends = list(accumulate(slots, initial=first))   # chunk c's memory: rows ends[c] .. ends[c+1]-1
        return sum(([*delimiters[:1], *range(a, b), *delimiters[1:]] for a, b in zip(ends, ends[1:])), [])

    @staticmethod
    def cache(memory: Memory) -> tuple:
        """(past_kv, its slots P): no KV-cache prefix."""
        return None, 0


class KV:
    """500xCompressor / AOC: every encoder layer's K/V at the memory slots becomes a KV-cache prefix of the decoder,
    its keys keeping the encoder's RoPE positions; nothing of the memory is in the decoder's input."""
    needs_kv = True    # the encoder forward returns every layer's K/V
    in_input = False   # the memory is a KV-cache prefix, none of the decoder's inputs

    @staticmethod
    def read_slots(encoder_out, row: torch.Tensor, at: torch.Tensor) -> list:
        """[k_0, v_0, k_1, v_1, ...] at the memory slots, each (..., Hkv, D): encoder row `row`, slot `at`."""
        # per layer (R, Hkv, T, D) -> (..., Hkv, D): one index, the indexed dimensions first (they are apart)
        return [t[row, :, at] for kv in encoder_out.kv for t in kv]

    @staticmethod
    def memory(comp, padded: list, valid: torch.Tensor) -> dict:
        """[k_0, v_0, ...] each (B, M, Hkv, D) -> the Memory's kv: per layer (k, v), each (B, Hkv, M, D)."""
        kv = [t.transpose(1, 2) for t in padded]                     # (B, M, Hkv, D) -> (B, Hkv, M, D)
        return dict(embeds=None, kv=list(zip(kv[0::2], kv[1::2])))

    @staticmethod
    def decoder_rows(slots: list, first: int, delimiters: tuple) -> list:
        """Nothing: the memory is in the cache."""
        return []

    @staticmethod
    def cache(memory: Memory) -> tuple:
        """(past_kv, its slots P): the memory's K/V, P = the longest sample's slots (padding masked)."""
        return memory.kv, memory.valid.shape[1]


CARRIERS = {"embeds": Embeds, "kv": KV}
# the decoder-side special vectors a compressor may learn: the AE and LM task tokens (ICAE code), PCC's <mem> </mem>
SPECIALS = ("ae_embed", "lm_embed", "mem_open", "mem_close")


# -----------------------------------------------------------------------------
# building a compressor's parts (each axis chosen once, here)

# what an encoder or LSA copy takes from the decoder instead of copying (model.copy_model)
SHARED = ("model.embed_tokens", "lm_head")


def embed_scale(model: Transformer) -> float:
    """What the model multiplies its embedding rows by before block 0: sqrt(d) for Gemma 3 (gemma3.ScaledEmbedding),
    else 1. Vectors handed to the decoder as inputs (memory, special tokens) live at the scaled size."""
    return getattr(model.model.embed_tokens, "scale", 1.0)


def draw(mem_init: str, n: int, model: Transformer, table: torch.Tensor | None = None) -> torch.Tensor:
    """n vectors of `model`'s width, drawn as mem_init says, on its device and in its dtype: (std, mean) of
    "embed", EPL code: normal_(mean=embed.mean(), std=embed.std()), scalars of the table's rows; "hf", PCC code:
    resize_token_embeddings' init of new rows, N(0, initializer_range); both at the size the decoder reads its rows
    (embed_scale: x sqrt(d) on Gemma 3). "normal": AOC/500x torch.randn, ICAE nn.Embedding's default N(0, 1).
    table: the model's embedding table whole, where the model holds none yet (a build on the meta device)."""
    w, s = model.model.embed_tokens.weight if table is None else table, embed_scale(model)
    std, mean = ((w.float().std() * s, w.float().mean() * s) if mem_init == "embed" else
                 (0.02 * s, 0.0) if mem_init == "hf" else (1.0, 0.0))
    return (torch.randn(n, w.shape[1], device=w.device) * std + mean).to(w.dtype)


def train_own_weights(model: Transformer, decoder: Transformer):
    """Every weight of a copy trains, except what it shares with the frozen decoder (its embedding)."""
    frozen = {id(p) for p in decoder.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) not in frozen)


def build_encoder(cfg: CompressorConfig, decoder: Transformer, encoder: Transformer | None) -> Transformer:
    lora = dict(targets=cfg.lora_targets, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)
    if cfg.encoder == "lora" and cfg.mlp == "swiglu":
        # ICAE / 500x / CompLLM: the encoder *is* the decoder plus LoRA; decoding runs with the LoRA
        # switched off, so the decoder stays exactly the frozen LLM
        add_lora(decoder, **lora)
        return decoder
    if cfg.encoder in ("lora", "first_k"):
        # GMSA §3.2: the first k layers of the LLM with LoRA; AOC code's LoRA-AOC: every layer, MLP-free, LoRA
        # on it (its norms stay frozen). A copy, embedding with the decoder's own table.
        L = decoder.config.num_hidden_layers
        k = L if cfg.encoder == "lora" else (cfg.enc_layers or max(1, L // 4))
        if not 1 <= k <= L:
            raise ValueError(f"--enc-layers {k} must be in 1..{L}")
        enc = copy_model(decoder, share=SHARED, num_hidden_layers=k, mlp=cfg.mlp)
        add_lora(enc, **lora)   # freezes everything of enc but the LoRA matrices
    elif cfg.encoder == "full":
        # AOC code: a copy of the decoder (minus the MLPs with mlp="aoc"), every weight trained, the prompt
        # embedded with the frozen LLM's own table (`self.llm.get_input_embeddings()`): the copy shares it
        enc = copy_model(decoder, share=SHARED, mlp=cfg.mlp)
        train_own_weights(enc, decoder)
    else:
        # PCC / PIC: a separate compressor LLM, fully fine-tuned (its own vocabulary, embeddings included)
        enc = encoder if encoder is not None else copy_model(decoder)
        if cfg.mlp != enc.config.mlp:
            enc = copy_model(enc, mlp=cfg.mlp)
        enc.requires_grad_(True)
        if enc.lm_head.weight is not enc.model.embed_tokens.weight:
            # PCC code reads the compressor's hidden states (output_hidden_states), never its logits: an untied
            # lm_head would train nothing and cost 525M fp32 parameters at Llama-3-8B, with gradients and AdamW
            # states in the plan. A tied one is the embedding, which the encoder reads
            enc.lm_head = None
    if cfg.carrier == "kv":
        d, e = decoder.config, enc.config
        if (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) != \
                (e.num_hidden_layers, e.num_key_value_heads, e.head_dim):
            raise ValueError("carrier kv needs an encoder with the decoder's layers, KV heads and head_dim "
                             "(not a first_k encoder with fewer layers)")
    return enc


# ---- bridges: the encoder's output space to the decoder's input space (CompressorConfig.bridge), each a module
# whose forward takes the memory vectors h (B, M, d_enc) and which of them are real (valid (B, M), on h's device)

class NoBridge(nn.Module):
    """bridge none: the encoder's output is what the decoder reads (ICAE, 500x, AOC)."""

    def forward(self, h, valid):
        return h


class LinearBridge(nn.Linear):
    """CompLLM §3: "one linear layer" on the CE outputs; identity init (ours) starts from ICAE."""

    def __init__(self, d_enc, d_dec, device=None, dtype=None):
        super().__init__(d_enc, d_dec, device=device, dtype=dtype)
        with torch.no_grad():
            self.weight.copy_(torch.eye(d_dec, d_enc))
            self.bias.zero_()

    def forward(self, h, valid):
        return super().forward(h)


class MLPBridge(nn.Sequential):
    """PCC code's converter: RMSNorm (weight 1, eps 1e-6) -> Linear -> GELU (exact) -> Linear, PyTorch init."""

    def __init__(self, d_enc, d_dec):
        super().__init__(RMSNorm(d_enc, 1e-6), nn.Linear(d_enc, d_dec), nn.GELU(), nn.Linear(d_dec, d_dec))

    def forward(self, h, valid):
        return super().forward(h)


class LSABridge(nn.Module):
    """GMSA §3.3, Eq. (3): j Transformer blocks initialised from the decoder's first j layers, fully trained, an
    independent copy (training them never touches the decoder). The copy borrows the decoder's embedding, final norm
    and lm_head, which it never uses: the decoder's layer 0 reads the LSA's raw residual stream."""

    def __init__(self, decoder: Transformer, j: int):
        super().__init__()
        self.lsa = copy_model(decoder, share=SHARED + ("model.norm",), num_hidden_layers=j)
        train_own_weights(self.lsa, decoder)

    def forward(self, h, valid):   # causal over the summary vectors, positions 0..M-1; the output residual stream
        attn = masks.with_padding(masks.causal(h.shape[1], device=h.device), valid)   # made on the device
        out = self.lsa(inputs_embeds=h, attn_mask=attn, output_hidden_states=True, compute_logits=False)
        return out.hidden_states[-1]


class Rescaled(nn.Module):
    """--mem-norm (ours, a diagnostic): the bridge, then each memory vector scaled to the mean L2 norm of the (frozen)
    token embeddings, as the decoder reads them (embed_scale)."""

    def __init__(self, bridge: nn.Module, decoder: Transformer):
        super().__init__()
        self.inner = bridge
        w = decoder.model.embed_tokens.weight
        # built on the meta device, the table has no values yet: initial_values sets the target from the file's
        self.target = None if w.is_meta else self.target_of(w, decoder)

    @staticmethod
    def target_of(table: torch.Tensor, decoder: Transformer) -> float:
        return table.detach().float().norm(dim=-1).mean().item() * embed_scale(decoder)

    def forward(self, h, valid):
        m = self.inner(h, valid)
        return m * (self.target / m.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(m.dtype)


def build_bridge(cfg: CompressorConfig, decoder: Transformer, d_enc: int, device=None, dtype=None) -> nn.Module:
    """The bridge module cfg.bridge names, between an encoder d_enc wide and `decoder`, on the decoder's device and in
    its dtype, or on `device` in `dtype` (initial_values draws a linear or MLP bridge again)."""
    d_dec, w = decoder.config.hidden_size, decoder.model.embed_tokens.weight
    if cfg.bridge == "none":
        if cfg.carrier == "embeds" and d_enc != d_dec:
            raise ValueError(f"the encoder is {d_enc} wide and the decoder {d_dec}: use --bridge mlp or linear")
        return NoBridge()
    if cfg.bridge == "linear":
        return LinearBridge(d_enc, d_dec, device=device or w.device, dtype=dtype or w.dtype)
    if cfg.bridge == "mlp":   # made on the CPU, then moved (its draws are the CPU generator's)
        return MLPBridge(d_enc, d_dec).to(device or w.device, dtype or w.dtype)
    if d_enc != d_dec:
        raise ValueError(f"LSA blocks are decoder layers ({d_dec} wide) and the encoder is {d_enc} wide")
    return LSABridge(decoder, cfg.lsa_layers)


def special_token(cfg: CompressorConfig, task: str) -> str:
    """Which special token stands after the memory for `task` (the config's ae_token for AE, lm_token for LM and QA):
    "learned" [AE] / [LM] (ICAE, EPL), "bos" ([BOS] as the special token: 500x, AOC), "last" (x_k, PIC Eq. 7) or
    "none". Compressor.special_embedding is its vector."""
    kind = cfg.ae_token if task == "ae" else cfg.lm_token
    # PIC Eq. (7)'s x_k is for completion; a question follows the memory directly
    return "none" if kind == "last" and task == "qa" else kind


def next_token_targets(ids: list, n_supervised: int, first: int) -> list:
    """The one target rule of every decoder input: the input before a supervised token predicts it (next-token
    prediction). ids: the follow tokens, ids[t] at input index first + t; the last n_supervised of them are supervised,
    except one at index 0, which no input precedes. Returns [(index, token)], in index order."""
    return [(first + t - 1, ids[t]) for t in range(len(ids) - n_supervised, len(ids)) if first + t - 1 >= 0]


def sentence_segments(ids: list, S: int, ends_sentence) -> list:
    """CompLLM §4.1: sentences, then long sentences split again so every segment has <= S tokens. The paper uses
    NLTK's Punkt; we cut after any token that ends_sentence(token id) says ends one (no runtime dependency), then
    split a sentence of n > S tokens into ceil(n/S) near-equal parts."""
    segments, start = [], 0
    for i, t in enumerate(ids):
        if ends_sentence(t) or i == len(ids) - 1:
            sentence = ids[start:i + 1]
            parts = math.ceil(len(sentence) / S)
            bounds = [round(j * len(sentence) / parts) for j in range(parts + 1)]
            segments += [sentence[a:b] for a, b in zip(bounds, bounds[1:])]
            start = i + 1
    return segments


def is_saved(cfg: CompressorConfig, name: str) -> bool:
    """Whether a checkpoint holds the tensor `name`: exactly what is not rebuilt from the base model(s), i.e.
    everything of the compressor's own (memory and special tokens, bridge, LSA blocks, a fully trained encoder),
    the LoRA matrices of a LoRA'd encoder (its base weights are the LLM's), and the decoder's q/k/v after KEFT.
    Tensors an encoder or LSA copy shares with the decoder (its embedding) carry decoder.* names, not saved."""
    if name.startswith("decoder."):
        return "lora_" in name or (cfg.decoder_train == "keft" and
                                   any(f"self_attn.{m}." in name for m in ("q_proj", "k_proj", "v_proj")))
    if name.startswith("encoder.") and cfg.encoder in ("lora", "first_k"):
        return "lora_" in name
    return True


# -----------------------------------------------------------------------------
# the compressor


class Compressor(nn.Module):
    """Encoder + memory source + bridge + the decoder-side tokens, around a frozen decoder LLM."""

    def __init__(self, cfg: CompressorConfig, decoder: Transformer, tok, encoder: Transformer | None = None,
                 enc_tok=None):
        super().__init__()
        # cfg as made (presets.make_config validates it, checkpoint.load a saved one): it names the base models this
        # compressor is built on, so that `load` rebuilds on the same ones
        self.cfg = cfg
        self.tok, self.enc_tok = tok, enc_tok or tok
        decoder.requires_grad_(False)   # the decoder is frozen in every method (KEFT unfreezes q/k/v later)
        self.decoder = decoder          # registered first: tensors an encoder shares with it are named decoder.*
        self.encoder = build_encoder(cfg, decoder, encoder)
        # memory source: learned memory tokens, shared by every chunk (ICAE §3.1; AOC Eq. 2 "Y_m"). --mem-from-text
        # (ours): each memory token's encoder input is the learned token PLUS the mean embedding of its segment of the
        # chunk (text_means). Added, not in its place: the learned token still tells slot j from slot k and is what
        # ICAE trains, while the mean makes every text's memory start apart from the first step (the shared tokens
        # alone start every text's memory from the same inputs, and the embedding carrier's memories collapse to one
        # prompt, recipes/README.md's diagnosis). Chosen here, once.
        self.mem_tokens, self.from_text = None, cfg.mem_from_text
        if cfg.source == "mem_tokens":
            n_tokens = cfg.mem if cfg.ratio <= 0 else cfg.chunk_len   # ratio mode: at most one per token
            self.mem_tokens = nn.Parameter(draw(cfg.mem_init, n_tokens, self.encoder))
        # the encoder's padding id (0 for a tokenizer without one: padded slots are masked, any id will do)
        self.enc_pad_id = self.enc_tok.pad_id if self.enc_tok.pad_id is not None else 0
        # the id in each memory slot of the encoder input: CompLLM §3's EOS, else padding that the memory tokens
        # replace (learned memory tokens are embeddings, not vocabulary)
        self.slot_id = self.enc_tok.eos_id if cfg.source == "eos" else self.enc_pad_id
        self.bridge = build_bridge(cfg, decoder, self.encoder.config.hidden_size)   # encoder -> decoder space
        if cfg.mem_norm:   # ours (diagnostic): the memory at the scale of the decoder's own token embeddings
            self.bridge = Rescaled(self.bridge, decoder)
        self.carrier = CARRIERS[cfg.carrier]   # Embeds or KV (above)
        # decoder-side special tokens, drawn like the memory tokens (draw, --mem-init); PCC code keeps them frozen
        for name, wanted in zip(SPECIALS, (cfg.ae_token == "learned", cfg.lm_token == "learned", cfg.delimiters,
                                           cfg.delimiters)):
            if wanted:
                setattr(self, name, nn.Parameter(draw(cfg.mem_init, 1, decoder)[0], requires_grad=cfg.train_specials))
        self.encoder_mask = masks.ENCODER[cfg.mask]   # masks.causal, or masks.pic (PIC Eq. 5)
        # the range UPL spreads a chunk's memory over: EPL code, the nominal chunk length L even for a shorter last
        # chunk; cap_mem (ours, None): the chunk's own length (positions.encoder_positions' `span`)
        self.nominal_len = None if cfg.cap_mem else cfg.chunk_len
        # Three uses of [BOS], told apart (the second, [BOS] as the special token after the memory, is
        # special_embedding's "bos"). The context BOS (`bos`, ICAE / EPL code): every context starts with [BOS], in the
        # encoder's ids, and AE reconstructs [BOS] X [EOS], in the decoder's ...
        self.context_bos, self.target_bos = ([self.enc_tok.start_id], [self.tok.start_id]) if cfg.bos else ([], [])
        # ... and the delimiters' leading BOS (PCC code): every decoder input starts [BOS] <mem> m.. </mem>
        self.decoder_bos = [self.tok.start_id] if cfg.delimiters else []
        self.mem_delimiters = ("mem_open", "mem_close") if cfg.delimiters else ()   # PCC code: <mem> m_1 .. </mem>
        # per task, the index of follow[0] in a decoder row with no prefix (follow_index; an embeds memory counts as
        # its first row, all that matters there: whether any input precedes follow[0]). Fixed here, a plain number,
        # so that a step's examples count the tokens their loss supervises (data.supervised_tokens) without calling
        # back here
        self.follow_start = {t: self.follow_index(t, len(self.decoder_bos), cfg.carrier == "embeds") for t in TASKS}
        self._sentence_end = {}   # token id -> ends a sentence? (CompLLM segmentation cache)
        if cfg.decoder_train == "keft":
            self.set_stage("keft")

    def encoder_ids(self, ids: list) -> list:
        """Decoder token ids -> the encoder's ids for the same text: the same list when both read one
        tokenizer, else decoded and re-encoded (a separate compressor LLM, e.g. PCC/PIC with Qwen2.5
        compressing for Llama 3). data.draw_text converts a training text the same way, from enc_tok and tok."""
        return list(ids) if self.enc_tok is self.tok else self.enc_tok.encode(self.tok.decode(ids))

    @property
    def shares_decoder(self) -> bool:
        return self.encoder is self.decoder

    @property
    def device(self) -> torch.device:
        return self.decoder.model.embed_tokens.weight.device

    def decoding(self):
        """Context for running the decoder: the frozen LLM, so a shared encoder's LoRA is switched off."""
        return lora_disabled(self.decoder) if self.shares_decoder else nullcontext()

    def set_stage(self, stage: str):
        """GMSA §3.5: "ae" trains encoder + LSA; "keft" freezes them and trains decoder W_q, W_k, W_v."""
        if stage == "keft":
            self.requires_grad_(False)
            for name, p in self.decoder.named_parameters():
                # GMSA Eq. (8): full fine-tuning of the q, k, v projections in every decoder layer
                if any(f"self_attn.{m}." in name for m in ("q_proj", "k_proj", "v_proj")) and "lora_" not in name:
                    p.requires_grad_(True)
            if self.cfg.decoder_train != "keft":   # a config of its own: the one it was built from stays as made
                self.cfg = replace(self.cfg, decoder_train="keft")
        elif stage != "ae":
            raise ValueError(f"unknown stage '{stage}': choose ae or keft")

    # ---- the texts the methods build (one place for training and evaluation) ----

    def ae_target(self, ids: list) -> list:
        """What AE reconstructs from the memory of `ids`: [BOS] x [EOS] when the context starts with [BOS] (the
        context BOS; ICAE and EPL code: the target is the compressed input plus EOS), else x [EOS] (500x, AOC, PCC).
        data.draw_text builds a training text's target the same way, from target_bos and the EOS id."""
        return self.target_bos + list(ids) + [self.tok.eos_id]

    def template(self) -> tuple:
        """(before the memory, the context as compressed, the prompt after it), "chat" resolved by marker tokens."""
        name = self.cfg.template
        if name == "chat":
            found = [k for k, marker in CHAT_MARKERS.items() if self.tok.tk.token_to_id(marker) is not None]
            name = found[0] if found else "plain"
        return TEMPLATES[name]

    def qa_parts(self, context: str, question: str) -> dict:
        """Token ids of one QA example, built from the template (CompLLM teacher and student, QA training, QA
        evaluation and its "full" and "none" rows all use this): prefix (decoder, before the memory),
        dec_context / enc_context (the context as the decoder / the encoder tokenise it), prompt (after it).
        Each piece is tokenised on its own and the ids concatenated, as EPL's code does."""
        prefix, ctx, prompt = self.template()

        def pieces(fmt, field, value, tok):   # "### Context:\n{context}" -> ids("### Context:\n") + ids(context)
            before, _, after = fmt.partition(field)
            return sum((tok.encode(s) for s in (before, value, after) if s), [])
        return dict(prefix=self.tok.encode(prefix) if prefix else [],
                    dec_context=pieces(ctx, "{context}", context, self.tok),
                    enc_context=pieces(ctx, "{context}", context, self.enc_tok),
                    prompt=pieces(prompt, "{question}", question, self.tok))

    def cut_context(self, ids: list, max_len: int, tok) -> list:
        """A dec_context / enc_context of qa_parts (tokenised with `tok`) with the context's own ids cut to their
        first max_len (train.py and evaluate.py --max-len); the template's text around it is never cut (ours: a cut
        of the whole piece left EPL's "### Context:\n" and no context at n = 8, on tiny)."""
        before, _, after = self.template()[1].partition("{context}")
        b, a = (len(tok.encode(s)) if s else 0 for s in (before, after))   # qa_parts tokenises each piece alone
        return ids[:b] + ids[b:len(ids) - a][:max_len] + ids[len(ids) - a:]

    # ---- cutting contexts ----

    def chunks(self, ids: list) -> list:
        """Cut one context (encoder token ids) into chunks; returns a list of id lists."""
        if len(ids) == 0:
            raise ValueError("cannot compress an empty context")
        L = self.cfg.chunk_len
        if self.cfg.chunking == "fixed":
            return [ids[s:s + L] for s in range(0, len(ids), L)]
        return sentence_segments(ids, self.cfg.chunk_len, self._ends_sentence)

    def chunk_slots(self, n: int) -> list:
        """[(tokens, slots)] of each chunk of an n-token context (fixed chunking, as compress cuts it; CompLLM's
        sentence segments depend on the text, and ceil(n/C) never gives a segment more slots than tokens)."""
        if self.cfg.chunking != "fixed":
            return []
        return [(len(c), self.slots_for(len(c))) for c in self.chunks(list(range(n)))]

    def _ends_sentence(self, t: int) -> bool:
        if t not in self._sentence_end:   # cut after any token whose text ends with . ! ? or a newline
            self._sentence_end[t] = self.enc_tok.decode([t]).rstrip(" ").endswith((".", "!", "?", "\n"))
        return self._sentence_end[t]

    def slots_for(self, n: int) -> int:
        """Memory slots for a chunk of n tokens: ceil(n / ratio) (CompLLM's ceil(n/C)), or the fixed --mem budget,
        also for a short last chunk (EPL, PCC, AOC code); cap_mem (ours) gives a short chunk at most n slots."""
        if self.cfg.ratio > 0:
            return math.ceil(n / self.cfg.ratio)
        return min(self.cfg.mem, n) if self.cfg.cap_mem else self.cfg.mem

    def _chunk_rows(self, contexts: list, n_slots) -> list:
        """Every chunk of every context, in order, as one encoder row (a Chunk), its slots n_slots(sample, length)."""
        rows = []
        for b, ids in enumerate(contexts):
            start = 0
            for i, chunk in enumerate(self.chunks(list(ids))):
                rows.append(Chunk(b, i, chunk, n_slots(b, len(chunk)), start))
                start += len(chunk)
        return rows

    # ---- compression ----

    def compress(self, contexts: list, ratios: list | None = None, cache: dict | None = None) -> Memory:
        """Compress a batch of contexts (lists of encoder token ids) into one Memory.
        ratios: group_mean only, the compression ratio r (group size) of each context (default: one sampled from
        cfg.ratios per context, GMSA §4.1).
        cache: a dict that keeps each chunk's memory under the hash of what it depends on (its ids, its slots and,
        for EPL/UPL, its position): a chunk seen before is not encoded again (CompLLM §1 "reusability": a context
        shared by several queries is compressed once). For evaluation; gradients do not flow through it."""
        inputs = self.encoder_inputs(contexts, ratios)
        if cache is not None and inputs.group is None:   # a group mean (GMSA) depends on the ratio drawn: not kept
            return self._encode_cached(inputs, cache)
        return self.encode(on_device(inputs, self.device))

    def encoder_inputs(self, contexts: list, ratios: list | None = None) -> EncoderInputs:
        """What compressing `contexts` reads (compress's arguments), on the host: every chunk of every context one
        encoder row."""
        if any(len(c) == 0 for c in contexts):
            raise ValueError("cannot compress an empty context")
        contexts = [self.context_bos + list(c) for c in contexts]
        if self.cfg.source == "group_mean":
            return self._merge_inputs(contexts, ratios)
        return self._row_inputs(self._chunk_rows(contexts, lambda b, n: self.slots_for(n)))

    def _row_inputs(self, rows: list) -> EncoderInputs:
        """The encoder rows, each [chunk (n), memory slots (m), padding]; each row's memory is its m slots."""
        R, T = len(rows), max(len(row.ids) + row.slots for row in rows)
        ids, pos = [[self.enc_pad_id] * T for _ in range(R)], [[0] * T for _ in range(R)]
        mem_slot, row_masks = [[0] * T for _ in range(R)], []    # mem_slot: 1 + the memory token in a slot, 0: none
        for j, (_, i, chunk, m, start) in enumerate(rows):
            n = len(chunk)
            ids[j][:n + m] = chunk + [self.slot_id] * m              # CompLLM §3: ceil(n/C) EOS embeddings
            upl_span = self.nominal_len and max(self.nominal_len, n)  # see nominal_len (None: the chunk's own n)
            ctx_pos, mem_pos = positions.encoder_positions(self.cfg.layout, i, n, m, offset=start, span=upl_span)
            pos[j][:n + m] = ctx_pos.tolist() + mem_pos.tolist()
            mem_slot[j][n:n + m] = range(1, m + 1)                   # 1-based, so that 0 can mean "no memory slot"
            row_masks.append(self.encoder_mask(n, m))                 # over [chunk, memory]
        # no row padded under the plain causal rule: no mask, so SDPA's causal kernel reads each K/V head in place
        # (enable_gqa) instead of a repeat per query head (model.sdpa); equal up to rounding (ours, as DecoderInputs)
        plain = self.encoder_mask is masks.causal and all(len(row.ids) + row.slots == T for row in rows)
        # row j's memory slots follow its n chunk tokens; the mask (R, T, T)
        return EncoderInputs(rows, *map(torch.tensor, (ids, pos)), None if plain else masks.stack_padded(row_masks, T),
                             torch.tensor(mem_slot), None, *memory_layout(rows, lambda j, row: len(row.ids)))

    def encode(self, inputs: EncoderInputs, read: list | None = None) -> Memory:
        """The Memory of EncoderInputs on the device (encoder_inputs, on_device): one encoder forward over every row,
        each memory tensor read (B, M, ...) with one index, whatever the batch, its padding slots zeroed. read: the
        memory tensors, read already (compress's cache)."""
        carrier = self.carrier if inputs.group is None else Embeds   # group_mean: GMSA's group means are embeddings
        if read is None:
            read = self._group_means(inputs) if inputs.group is not None else \
                self.carrier.read_slots(self._encoder_forward(inputs), inputs.read_row, inputs.read_at)
        padded = [torch.where(inputs.valid.view(*inputs.valid.shape, *[1] * (t.dim() - 2)), t, 0) for t in read]
        return Memory(**carrier.memory(self, padded, inputs.valid), valid=inputs.valid, chunk_lens=inputs.chunk_lens,
                      slots=inputs.slots)

    def _encoder_forward(self, inputs: EncoderInputs):
        """One encoder forward over the rows of `inputs` (on the device)."""
        x = self.encoder.model.embed_tokens(inputs.ids)              # (R, T, d_enc)
        if self.mem_tokens is not None:                              # learned memory tokens fill their slots
            # slot s > 0 holds memory token s - 1; the clamp only keeps the index valid where s = 0 (not taken)
            mem = self.mem_tokens[(inputs.mem_slot - 1).clamp(min=0)].to(x.dtype)
            if self.from_text:   # --mem-from-text (ours): plus the mean embedding of the slot's segment of the text
                mem = mem + text_means(x, inputs.mem_slot)
            x = torch.where((inputs.mem_slot > 0)[..., None], mem, x)
        return self.encoder(inputs_embeds=x, position_ids=inputs.pos, attn_mask=inputs.attn,
                            return_kv=self.carrier.needs_kv, compute_logits=False)

    def _encode_cached(self, inputs: EncoderInputs, cache: dict) -> Memory:
        """compress, encoding only the rows whose memory `cache` does not hold yet (see compress). A row's memory is
        kept as a list of tensors, its slots first; every row's, row after row, is then read as one encoder output."""
        rows, dev = inputs.rows, self.device
        keys = [self._cache_key(row) for row in rows]
        todo = [r for r in range(len(rows)) if keys[r] not in cache]
        if todo:   # each new row its own sample, so that sample j's memory is row j's
            new = on_device(self._row_inputs([rows[r]._replace(sample=j) for j, r in enumerate(todo)]), dev)
            read = self.carrier.read_slots(self._encoder_forward(new), new.read_row, new.read_at)   # each (R', M', ...)
            cache.update({keys[r]: [t[j, :rows[r].slots] for t in read] for j, r in enumerate(todo)})
        parts = [cache[key] for key in keys]
        flat = [torch.cat([part[i] for part in parts]) for i in range(len(parts[0]))]   # each (S, ...): every slot
        ends = list(accumulate((row.slots for row in rows), initial=0))   # row j's slots: ends[j] .. ends[j+1]-1
        at = memory_layout(rows, lambda j, row: ends[j])[1].to(dev)      # (B, M) indices into the S slots
        return self.encode(inputs, [t[at] for t in flat])

    def _cache_key(self, row: Chunk) -> str:
        # a chunk's memory depends on its ids and slots, and under UPL/EPL on where it starts in its context
        where = row.start if self.cfg.layout != "dpl" else 0
        return hashlib.sha1(json.dumps([row.ids, row.slots, where]).encode()).hexdigest()

    def _merge_inputs(self, contexts: list, ratios: list | None) -> EncoderInputs:
        """GMSA §3.2's rows: each chunk's tokens, and the group of r consecutive tokens each belongs to."""
        cfg = self.cfg
        if ratios is None:   # GMSA §4.1: the compression ratio is sampled per example
            ratios = [cfg.ratios[i] for i in torch.randint(len(cfg.ratios), (len(contexts),)).tolist()]
        rows = self._chunk_rows(contexts, lambda b, n: math.ceil(n / ratios[b]))   # groups per chunk
        T, G = max(len(row.ids) for row in rows), max(row.slots for row in rows)
        ids = torch.tensor([row.ids + [self.enc_pad_id] * (T - len(row.ids)) for row in rows])
        # GMSA §3.2: consecutive groups of size r; padding goes to a spare group G, dropped
        group = torch.tensor([[t // ratios[row.sample] if t < len(row.ids) else G for t in range(T)] for row in rows])
        lens = torch.tensor([len(row.ids) for row in rows])
        attn = masks.with_padding(masks.causal(T), torch.arange(T)[None] < lens[:, None])
        return EncoderInputs(rows, ids, None, attn, None, group, *memory_layout(rows, lambda j, row: 0))

    def _group_means(self, inputs: EncoderInputs) -> list:
        """GMSA §3.2: encode with the first k layers, mean-pool consecutive groups of r hidden states: [(B, M, d)]."""
        h = self.encoder(inputs.ids, attn_mask=inputs.attn, compute_logits=False).last_hidden   # (R, T, d)
        means = group_means(h, inputs.group, max(row.slots for row in inputs.rows))               # (R, G, d)
        return [means[inputs.read_row, inputs.read_at]]

    # ---- the decoder side ----

    def special_embedding(self, task: str, last_token: int | None = None):
        """The special token after the memory (special_token: which one) as the decoder reads it, (d,), or None:
        a learned [AE] / [LM] (ICAE, EPL), [BOS]'s embedding (500x, AOC), or x_k's, the context's last token
        (PIC Eq. 7)."""
        kind = special_token(self.cfg, task)
        if kind == "none":
            return None
        if kind == "learned":
            return self.ae_embed if task == "ae" else self.lm_embed
        # a token's row as the decoder reads it: through its embedding module (Gemma 3 scales it by sqrt(d))
        token = self.tok.start_id if kind == "bos" else last_token
        return self.decoder.model.embed_tokens(torch.tensor(token, device=self.device))

    def assemble(self, memory: Memory, inputs: DecoderInputs) -> DecoderBatch:
        """The decoder's keyword inputs from DecoderInputs on the device: each input slot a row of the table [zeros,
        the learned vectors, the memory's (carrier embeds), the tokens' embeddings], read with one index."""
        tokens = self.decoder.model.embed_tokens(inputs.tokens)                              # (N, d)
        specials = [getattr(self, name)[None].to(tokens.dtype) for name in inputs.specials]
        memory_rows = [memory.embeds.flatten(0, 1)] if self.carrier.in_input else []        # (B*M, d)
        table = torch.cat([tokens.new_zeros(1, tokens.shape[1]), *specials, *memory_rows, tokens])
        batch = DecoderBatch(inputs_embeds=table[inputs.index], position_ids=inputs.pos,       # (B, T, d)
                             attn_mask=inputs.attn_mask, past_kv=self.carrier.cache(memory)[0])
        batch.supervised = inputs.supervised
        return batch

    def decoder_batch(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
                      last_tokens: list | None = None, prefix: list | None = None,
                      left_pad: bool = False) -> DecoderBatch:
        """Decoder inputs for every sample: [prefix, memory, special token, follow tokens], padded (decoder_inputs
        takes the same arguments). Returns a DecoderBatch: inputs_embeds (B, T, d), position_ids (B, T), attn_mask
        (B, T, P+T) or None when nothing is padded, past_kv or None; and .supervised, where the loss is taken."""
        inputs = decoder_inputs(self, memory, task, follow, n_supervised, last_tokens, prefix, left_pad)
        return self.assemble(memory, on_device(inputs, self.device))

    def _supervised(self, memory: Memory, inputs: DecoderInputs):
        """The decoder's final hidden states at the inputs that predict a supervised token, and those tokens:
        (h (N, d), targets (N,), row of each (N,)). Logits are never made for every position: B*T*vocab would
        dwarf everything else."""
        with self.decoding():   # the frozen LLM: its inputs (embeddings) and its forward
            h = self.decoder(**self.assemble(memory, inputs), compute_logits=False).last_hidden   # (B, T, d)
        return h.reshape(-1, h.shape[-1])[inputs.flat], inputs.target, inputs.row            # (N, d), (N,), (N,)

    def lm_loss(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
                last_tokens: list | None = None, prefix: list | None = None, normalize_by: int | None = None):
        """Cross-entropy of the frozen decoder on the supervised follow tokens, given the memory.
        AE: ICAE's autoencoding / PIC Eq. (6) TR; LM: PIC Eq. (7) TC; QA: answer-only fine-tuning.
        Returns (loss, number of supervised tokens): the mean over these tokens, or their summed NLL divided by
        normalize_by (train.py passes the count of its whole step, so that micro-batches and processes add up to
        the step's mean, whatever their sizes)."""
        inputs = decoder_inputs(self, memory, task, follow, n_supervised, last_tokens, prefix)
        return self.loss(memory, on_device(inputs, self.device), normalize_by)

    def loss(self, memory: Memory, inputs: DecoderInputs, normalize_by: int | None = None):
        """lm_loss from DecoderInputs on the device (a training step builds them before its forward)."""
        h, tgt, _ = self._supervised(memory, inputs)
        # in chunks of positions, each chunk's fp32 logits recomputed in backward instead of kept (model.py)
        return chunked_cross_entropy(h, self.decoder.lm_head, tgt) / (normalize_by or max(len(tgt), 1)), len(tgt)

    def token_nll(self, memory: Memory, inputs: DecoderInputs):
        """Each supervised token's NLL (N,), with gradients, and the sample of each (N,) (train.py's
        --own-other-weight, ours: a text's loss under its own memory and under another's)."""
        h, tgt, row = self._supervised(memory, inputs)
        return chunked_cross_entropy(h, self.decoder.lm_head, tgt, reduction="none"), row

    def follow_index(self, task: str, n_before: int, n_memory: int) -> int:
        """The decoder row layout, one rule for decoder_batch and follow_start: the ids before the memory
        (n_before: PCC's delimiter [BOS], a chat template's prefix), the memory's rows in the input (n_memory, its
        delimiters included; a K/V memory has none there, it is the cache), the special token (special_token), then
        the follow tokens. Returns the index of follow[0] in the row."""
        return n_before + n_memory + (special_token(self.cfg, task) != "none")

    @torch.no_grad()
    def nll(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
            last_tokens: list | None = None, prefix: list | None = None) -> tuple:
        """Per sample: (summed NLL, number of supervised tokens), as Python lists, for evaluation."""
        inputs = on_device(decoder_inputs(self, memory, task, follow, n_supervised, last_tokens, prefix), self.device)
        h, tgt, row = self._supervised(memory, inputs)
        token_nll = F.cross_entropy(self.decoder.lm_head(h).float(), tgt, reduction="none")
        B = len(follow)
        sums = torch.zeros(B, device=h.device).index_add_(0, row, token_nll)
        counts = torch.zeros(B, device=h.device).index_add_(0, row, torch.ones_like(token_nll))
        return sums.tolist(), [int(c) for c in counts.tolist()]

    def distill_loss(self, contexts: list, questions: list, answers: list, prefix: list | None = None,
                     dec_contexts: list | None = None, normalize_by: int | None = None):
        """CompLLM Eq. (1)-(3): the LLM with the CEs (student) imitates the LLM with the full context
        (teacher) in every layer's hidden states at the answer tokens, per example:
            L(c, x) = Σ_ℓ (1/σ_ℓ) · mean_{t∈A, j≤d} SmoothL1_β=1(H̃_ℓ[t, j], H_ℓ[t, j]),   σ_ℓ = Std(H_ℓ[A]),
        σ and the mean over that example's |A|·d values; the loss is the expectation over examples.
        contexts: encoder ids; questions: the prompt after the context (qa_parts' "prompt"); answers: ids;
        prefix / dec_contexts: qa_parts' decoder pieces (default none / the contexts themselves). normalize_by:
        divide the summed example losses by this many examples instead of these (train.py: its whole step's)."""
        inputs = self.distill_inputs(contexts, questions, answers, prefix, dec_contexts)
        return self.distill(on_device(inputs, self.device), normalize_by)

    def distill_inputs(self, contexts: list, questions: list, answers: list, prefix: list | None = None,
                       dec_contexts: list | None = None) -> DistillInputs:
        """What distill_loss reads (its arguments), on the host."""
        B = len(contexts)
        prefix = prefix or [[] for _ in range(B)]
        dec_contexts = dec_contexts or contexts
        # teacher: [prefix, context, question, answer] as plain tokens
        rows = [list(p) + list(c) + list(q) + list(a) for p, c, q, a in zip(prefix, dec_contexts, questions, answers)]
        T = max(map(len, rows))
        valid = torch.tensor([[j < len(r) for j in range(T)] for r in rows])
        # student: [prefix, CEs, question, answer] (no special token: the LLM reads CEs like token embeddings)
        context = self.encoder_inputs(contexts)
        follow = [list(q) + list(a) for q, a in zip(questions, answers)]
        student = decoder_inputs(self, context, "qa", follow, [len(a) for a in answers], prefix=prefix)
        return DistillInputs(context, student, torch.tensor([r + [0] * (T - len(r)) for r in rows]),
                             masks.with_padding(masks.causal(T), valid), [len(r) for r in rows],
                             [len(a) for a in answers])

    def distill(self, inputs: DistillInputs, normalize_by: int | None = None):
        """distill_loss from DistillInputs on the device (a training step builds them before its forward)."""
        dec = self.decoder
        with torch.no_grad(), self.decoding():   # the teacher: no gradient, the unmodified LLM
            teacher = dec(inputs.teacher_ids, attn_mask=inputs.teacher_mask, output_hidden_states=True,
                          compute_logits=False).hidden_states
        memory = self.encode(inputs.context)
        with self.decoding():
            batch = self.assemble(memory, inputs.student)
            student = dec(**batch, output_hidden_states=True, compute_logits=False).hidden_states
        T = batch["inputs_embeds"].shape[1]
        loss = 0.0
        for b, (n, a) in enumerate(zip(inputs.teacher_lens, inputs.answer_lens)):
            at_t = slice(n - a, n)                                 # the answer's own inputs in the teacher ...
            # ... and in the student: the input after each one that predicts an answer token (right-padded rows)
            first = min(i for i, _ in batch.supervised if i // T == b) % T + 1
            at_s = slice(first, first + a)
            example = 0.0
            for layer in range(1, len(teacher)):                   # ℓ = 1..L (0 is the embedding layer)
                h, h_s = teacher[layer][b, at_t].float(), student[layer][b, at_s].float()
                sigma = h.std()                                    # CompLLM Eq. (2): this example's teacher Std
                example = example + F.smooth_l1_loss(h_s, h, beta=1.0) / sigma   # Eq. (1), mean over t∈A, j≤d
            loss = loss + example / (normalize_by or len(inputs.answer_lens))   # Eq. (3): the expectation over examples
        return loss, sum(inputs.answer_lens)

    @torch.no_grad()
    def generate(self, memory: Memory, task: str, prompt: list | None = None, max_new_tokens: int = 64,
                 last_token: list | None = None, prefix: list | None = None) -> list:
        """Greedy decoding for a batch of memories after [prefix, memory, special, prompt]; rows are left-padded,
        so each continues from its own last token. prompt / last_token / prefix: one entry per sample.
        Returns one list of ids per sample, cut before the first EOS."""
        B = memory.valid.shape[0]
        prompts = [list(p) for p in prompt] if prompt is not None else [[] for _ in range(B)]
        batch = self.decoder_batch(memory, task, prompts, [0] * B, last_token, prefix, left_pad=True)
        with self.decoding():
            out = self.decoder.generate(**batch, max_new_tokens=max_new_tokens, eos_id=self.tok.eos_ids or None)
        return [self.tok.cut_at_eos(row) for row in out.tolist()]

    # ---- what is trained, saved and loaded ----

    def trainable_parameters(self) -> list:
        return [p for p in self.parameters() if p.requires_grad]

    def set_dtypes(self, frozen: torch.dtype) -> "Compressor":
        """The training precision: every tensor that trains, or that a checkpoint holds (the compressor's own, even
        when frozen: PCC's delimiters, GMSA's stage-1 tensors under KEFT), in fp32, AdamW's master weights; every
        frozen tensor of the base LLM(s) (`is_saved` is False: rebuilt from the checkpoint) in `frozen`. bf16 there is
        the dtype the EPL and AOC code train their frozen LLM in, and halves its memory (train.py --frozen-dtype).
        A tensor shared by two names (tied embeddings, an encoder embedding with the decoder's table) is one
        Parameter: it takes the dtype of its first name, the decoder's. Called after set_stage (KEFT unfreezes the
        decoder's q/k/v: fp32 from then on) and before checkpoint.load_trained (so trained tensors load unrounded)."""
        for name, p in self.named_parameters():
            want = torch.float32 if p.requires_grad or is_saved(self.cfg, name) else frozen
            if p.dtype != want:
                p.data = p.data.to(want)   # in place of the tensor: every module holding p sees the new dtype
        return self


# -----------------------------------------------------------------------------
# the models and blocks a compressor runs (--compile's units, FSDP's), its initial values tensor by tensor, and
# building one

def models(comp: Compressor) -> list:
    """Every distinct transformer the compressor runs: the encoder, the decoder, GMSA's LSA blocks (a LoRA encoder that
    IS the decoder once). What --compile compiles, one graph each (train.compile_models)."""
    seen = {}
    for model in (comp.encoder, comp.decoder, getattr(comp.bridge, "lsa", None)):
        if model is not None:
            seen.setdefault(id(model), model)
    return list(seen.values())


def blocks(comp: Compressor) -> list:
    """Every distinct transformer block the compressor runs, its models' (models). FSDP's units (parallel.shard), and
    what --plan --fsdp divides."""
    return [block for model in models(comp) for block in model.model.layers]


def initial_values(comp: Compressor, frozen: torch.dtype, device: torch.device, read):
    """Every tensor of a compressor built on the meta device (train.py --fsdp) with the value a build on `device` gives
    it, one tensor at a time: yields (tensor, value), the value whole, in `frozen` (the dtype a build makes everything
    in, before set_dtypes) on `device`; the caller copies it into this rank's shard and drops it before the next.
    read(model, name): tensor `name` of base model `model` (a name or path, as cfg.model) as load_pretrained loads it.

    First what the build draws from torch's generator, in the order it draws it (Compressor.__init__: the encoder's
    LoRA in module order, the memory tokens, the bridge, the learned special tokens), so that from the same generator
    state (train.py seeds it alike on every rank) the values are the build's, bit for bit. draw's statistics (--mem-init
    embed) come from the embedding table read whole, as the build has it: the same numbers, where an all-reduce over
    the table's shards would sum in another order. Then everything a base model's weights give: the frozen LLM(s) and
    the copies that train (AOC's encoder, GMSA's LSA blocks, PCC's compressor LLM), all but the LoRA matrices."""
    cfg, embed = comp.cfg, "model.embed_tokens.weight"
    encoder_model = cfg.compressor_model if cfg.encoder == "separate" and cfg.compressor_model else cfg.model
    for m in comp.encoder.modules():   # add_lora draws each A as it wraps a layer (a LoRA encoder may be the decoder)
        if isinstance(m, LoRALinear):
            yield m.lora_A, draw_lora_A(m.r, m.in_features, device, frozen)
            yield m.lora_B, torch.zeros(m.lora_B.shape, device=device, dtype=frozen)
    if comp.mem_tokens is not None:
        yield comp.mem_tokens, draw(cfg.mem_init, comp.mem_tokens.shape[0], comp.encoder, read(encoder_model, embed))
    bridge = getattr(comp.bridge, "inner", comp.bridge)   # (inside --mem-norm's Rescaled)
    if isinstance(bridge, (LinearBridge, MLPBridge)):   # made again as build_bridge makes it: a few d x d, whole
        yield from zip(bridge.parameters(), build_bridge(cfg, comp.decoder, comp.encoder.config.hidden_size, device,
                                                         frozen).parameters())
    specials = [name for name in SPECIALS if hasattr(comp, name)]
    if specials or isinstance(comp.bridge, Rescaled):   # the decoder's table, held while these few vectors are drawn
        table = read(cfg.model, embed)
        if isinstance(comp.bridge, Rescaled):
            comp.bridge.target = Rescaled.target_of(table, comp.decoder)
        for name in specials:
            yield getattr(comp, name), draw(cfg.mem_init, 1, comp.decoder, table)[0]
        del table
    seen = set()   # a tensor shared by two models (the encoder's embedding is the decoder's) is read once
    for model, name_or_path in ((comp.decoder, cfg.model), (comp.encoder, encoder_model),
                                (getattr(bridge, "lsa", None), cfg.model)):
        for name, p in model.named_parameters() if model is not None else ():
            if "lora_" not in name and id(p) not in seen:
                seen.add(id(p))
                yield p, read(name_or_path, name)


def build(method: str, decoder: Transformer, tok, encoder_model: Transformer | None = None, encoder_tok=None,
          **overrides) -> Compressor:
    """The compressor of a preset around `decoder`, e.g. build("pic", llm, tok, layout="epl").
    encoder_model / encoder_tok: the separate compressor LLM of pcc/pic (default: a copy of the decoder). The config
    names the models load_pretrained gave (their name_or_path), so that `load` rebuilds on the same ones."""
    models = {k: getattr(m, "name_or_path", None) for k, m in (("model", decoder), ("compressor_model", encoder_model))}
    return Compressor(make_config(method, **models, **overrides), decoder, tok, encoder_model, encoder_tok)
