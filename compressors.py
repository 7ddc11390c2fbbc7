"""
Every context-compression method in this repository, as a preset over shared parts.

A soft compressor reads a context X with an *encoder* and hands the *decoder* (a frozen LLM) a short
*memory* in its place. The papers differ along a few independent axes; each axis is implemented once
below and a method is just a choice along each of them (SPEC "methods are presets"):

    axis            options                                                     used by
    ------------    ---------------------------------------------------------   -----------------------
    encoder         lora (on the decoder's own weights) | full (a trained copy)  ICAE/500x/CompLLM | AOC
                    | separate (another model) | first_k (first k layers+LoRA)   PCC/PIC | GMSA
    mlp             swiglu | aoc (AOC Eq. 3: h = LN_post(h) + h) | none          AOC
    source          mem_tokens (learned, appended) | eos (EOS embeddings,        ICAE/500x/PCC/PIC/AOC |
                    appended) | group_mean (mean of groups of r hidden states)    CompLLM | GMSA
    chunking        fixed (chunks of chunk_len) | sentences (CompLLM segments)   all | CompLLM
    mask            causal over [chunk, memory] | pic (PIC Eq. 5)                all | PIC
    layout          dpl | upl | epl (EPL §3.2, see positions.py)               EPL on ICAE and 500x
    carrier         embeds (final hidden states as input embeddings)            ICAE/PCC/PIC/CompLLM/GMSA
                    | kv (per-layer K/V as a KV-cache prefix)                   500x/AOC
    bridge          none | linear (CompLLM) | mlp (PCC/PIC converter)            |
                    | lsa (GMSA §3.3: decoder blocks, trained)
    tokens after    [AE]/[LM] learned | [BOS] | x_k (PIC Eq. 7) | nothing       ICAE/EPL | 500x/AOC | PIC | CompLLM
    decoder         frozen | keft: q/k/v projections train (GMSA §3.5)           GMSA stage 2

One interface for every method (train.py and evaluate.py use nothing else):

    comp = build("aoc", decoder, tok, mem=16)
    memory = comp.compress(contexts)                 # list of token-id lists -> Memory
    loss, n = comp.lm_loss(memory, "ae", follow)      # AE / LM / QA cross-entropy on the decoder
    ids = comp.generate(memory, "ae", max_new_tokens=...)

Chunks are always separate rows of one batched encoder forward. That *is* the block-diagonal
`masks.segments` mask (no chunk can see another), computed at linear cost instead of on one long
sequence with a dense mask; tests/test_compressors.py checks the two agree.
"""

import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import masks
import positions
from model import Transformer, add_lora, copy_model, load_pretrained, lora_disabled

# -----------------------------------------------------------------------------
# configuration: one dataclass, one field per axis, and the papers' presets


@dataclass
class CompressorConfig:
    method: str = "icae"            # the preset this config started from
    model: str = "tiny"             # the decoder LLM (HF id, local dir or "tiny")
    compressor_model: str = ""      # encoder="separate": the compressor LLM ("" = a copy of the decoder)
    # --- encoder weights ---
    encoder: str = "lora"           # "lora" | "full" | "separate" | "first_k"
    mlp: str = "swiglu"             # encoder blocks: "swiglu" | "aoc" (AOC Eq. 3) | "none" (sub-block removed)
    lora_r: int = 128               # LoRA rank (encoder "lora" and "first_k")
    lora_alpha: int = 256           # LoRA alpha; the update is scaled by alpha / r
    lora_targets: tuple = ("q_proj", "v_proj")
    enc_layers: int = 0             # encoder "first_k": layers kept (0 = a quarter of the decoder's, GMSA's 8 of 32)
    # --- memory source ---
    source: str = "mem_tokens"      # "mem_tokens" | "eos" | "group_mean"
    mem: int = 102                  # memory tokens per chunk (fixed budget)
    ratio: float = 0.0              # > 0: memory per chunk = ceil(chunk tokens / ratio) instead of `mem`
    ratios: tuple = (4, 8)          # group_mean: compression rate sampled per example (GMSA §4.1)
    # --- cutting the context ---
    chunking: str = "fixed"         # "fixed": chunks of chunk_len | "sentences": CompLLM segments of <= chunk_len
    chunk_len: int = 510            # tokens per chunk (EPL: L = 510)
    # --- encoder attention and positions ---
    mask: str = "causal"            # "causal" (ICAE/500x/PCC/AOC) | "pic" (PIC Eq. 5)
    layout: str = "dpl"             # "dpl" | "upl" | "epl" (positions.py)
    # --- what reaches the decoder ---
    carrier: str = "embeds"         # "embeds" | "kv"
    bridge: str = "none"            # "none" | "linear" | "mlp" | "lsa"
    lsa_layers: int = 1             # bridge "lsa": decoder blocks copied (GMSA: j = 1 suffices)
    ae_token: str = "learned"       # token after the memory for AE: "learned" [AE] | "bos" | "none"
    lm_token: str = "learned"       # ... for LM/QA: "learned" [LM] | "bos" | "last" (PIC Eq. 7) | "none"
    decoder_train: str = "none"     # "none" | "keft" (GMSA stage 2: decoder q/k/v train)


# The presets: each is what its paper did, changed as little as a tiny CPU run allows.
PRESETS = {
    # ICAE as the EPL paper runs it: LoRA r=128 α=256 on q,v; 102 memory tokens per 510-token chunk;
    # memory = final hidden states fed as input embeddings; learned [AE]/[LM] tokens.
    "icae": dict(),
    # 500xCompressor: as ICAE, but the decoder gets the memory tokens' per-layer K/V and regenerates
    # from [BOS].
    "500x": dict(carrier="kv", ae_token="bos", lm_token="bos"),
    # PCC: a separate, fully fine-tuned compressor LLM, ordinary causal mask, an MLP converter to the
    # decoder's width; 16x compression (PIC Table 4); TR after <AE> (PIC Eq. 6), TC after x_k (Eq. 7).
    "pcc": dict(encoder="separate", ratio=16.0, chunk_len=512, bridge="mlp", lm_token="last"),
    # PIC: PCC with the block-wise causal mask and nothing else changed (PIC §4.3 ablation).
    "pic": dict(encoder="separate", ratio=16.0, chunk_len=512, bridge="mlp", lm_token="last", mask="pic"),
    # CompLLM: LoRA r=32 on the LLM; segments of <= S = 20 tokens; ceil(n/C) EOS embeddings per
    # segment with C = 2; one linear layer; the question follows the CEs directly (§3, §4.1).
    "compllm": dict(lora_r=32, lora_alpha=64, source="eos", chunking="sentences", chunk_len=20,
                    ratio=2.0, bridge="linear", ae_token="none", lm_token="none"),
    # GMSA: first k layers + LoRA; mean of groups of r last hidden states, r in {4, 8} per example;
    # one LSA block initialised from decoder layer 0; reconstruct after [AE] (§3.2-3.4).
    "gmsa": dict(encoder="first_k", lora_r=64, lora_alpha=128, source="group_mean", chunk_len=4096,
                 bridge="lsa", lm_token="none"),
    # AOC: the decoder with every MLP replaced by the identity, fully trained; 16 memory tokens;
    # K/V carrier as 500x; regenerate from [BOS] (AOC §2, Eq. 3-4).
    "aoc": dict(encoder="full", mlp="aoc", mem=16, chunk_len=512, carrier="kv",
                ae_token="bos", lm_token="bos"),
}
METHODS = tuple(PRESETS)

_CHOICES = dict(
    encoder=("lora", "full", "separate", "first_k"), mlp=("swiglu", "aoc", "none"),
    source=("mem_tokens", "eos", "group_mean"), chunking=("fixed", "sentences"), mask=("causal", "pic"),
    layout=("dpl", "upl", "epl"), carrier=("embeds", "kv"), bridge=("none", "linear", "mlp", "lsa"),
    ae_token=("learned", "bos", "none"), lm_token=("learned", "bos", "last", "none"),
    decoder_train=("none", "keft"),
)


def make_config(method: str, **overrides) -> CompressorConfig:
    """The preset `method` with `overrides` (None values are ignored) applied on top, validated."""
    if method not in PRESETS:
        raise ValueError(f"unknown method '{method}': choose one of {', '.join(METHODS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    known = {f.name for f in fields(CompressorConfig)}
    for k in overrides:
        if k not in known:
            raise ValueError(f"unknown compressor setting '{k}': known settings are {', '.join(sorted(known))}")
    settings = {**PRESETS[method], **overrides}
    # a fixed --mem replaces a preset's compression ratio unless a ratio is asked for too
    if "mem" in overrides and "ratio" not in overrides:
        settings["ratio"] = 0.0
    # group merging: --ratio R fixes the group size (GMSA samples it from `ratios` otherwise)
    if settings.get("source") == "group_mean" and settings.get("ratio", 0) > 0:
        settings["ratios"], settings["ratio"] = (settings["ratio"],), 0.0
    if "ratios" in settings:   # group sizes are whole numbers of tokens
        settings["ratios"] = tuple(int(r) if float(r).is_integer() else r for r in settings["ratios"])
    for k in ("lora_targets", "ratios"):
        if k in settings:
            settings[k] = tuple(settings[k])
    cfg = CompressorConfig(method=method, **settings)
    validate(cfg)
    return cfg


def validate(cfg: CompressorConfig):
    """One-line errors for settings no method can run with."""
    for name, options in _CHOICES.items():
        if getattr(cfg, name) not in options:
            raise ValueError(f"unknown {name} '{getattr(cfg, name)}': choose one of {', '.join(options)}")
    if cfg.source == "group_mean":
        if cfg.layout != "dpl":
            raise ValueError(f"--layout {cfg.layout} needs memory tokens; {cfg.method} merges hidden states "
                             "into groups and has none: drop --layout")
        if cfg.mask != "causal":
            raise ValueError(f"--mask {cfg.mask} needs memory tokens; {cfg.method} has none: drop --mask")
        if not cfg.ratios or any(not isinstance(r, int) or r < 1 for r in cfg.ratios):
            raise ValueError(f"group-merging rates must be whole numbers >= 1, got {cfg.ratios}")
        if cfg.ratio > 0:
            raise ValueError("ratio does not apply to group merging: set ratios (one rate per example)")
    elif cfg.ratio <= 0:
        if cfg.mem < 1:
            raise ValueError(f"--mem must be >= 1, got {cfg.mem}")
        if cfg.mem > cfg.chunk_len:
            raise ValueError(f"--mem {cfg.mem} is larger than the chunk ({cfg.chunk_len} tokens): "
                             f"use --mem <= {cfg.chunk_len} or a longer --chunk-len")
    if cfg.ratio < 0:
        raise ValueError(f"--ratio must be > 0, got {cfg.ratio}")
    if cfg.chunk_len < 1:
        raise ValueError(f"--chunk-len must be >= 1, got {cfg.chunk_len}")
    if cfg.carrier == "kv" and cfg.encoder == "first_k":
        raise ValueError("carrier kv needs one K/V per decoder layer; a first_k encoder has fewer layers")
    if cfg.carrier == "kv" and cfg.bridge != "none":
        raise ValueError("carrier kv hands the decoder K/V directly: a bridge cannot apply (use --bridge none)")
    if cfg.encoder in ("lora", "first_k") and cfg.lora_r < 1:
        raise ValueError(f"encoder {cfg.encoder} needs --lora-r >= 1, got {cfg.lora_r}")


# -----------------------------------------------------------------------------
# the memory handed from encoder to decoder


@dataclass
class Memory:
    embeds: torch.Tensor | None     # [B, M, d_dec] carrier "embeds" (after the bridge)
    kv: list | None                 # carrier "kv": per decoder layer (k, v), each [B, Hkv, M, D], RoPE applied
    valid: torch.Tensor             # [B, M] bool; False = padding (samples compress to different sizes)
    enc_pos: torch.Tensor           # [B, M] the position ids the memory slots had in the encoder
    chunk_lens: list                # per sample, context tokens in each chunk
    mem_counts: list                # per sample, memory slots of each chunk

    def lerp(self, other: "Memory", w: float) -> "Memory":
        """AOC Eq. (5): Z = Z0 + w (Z1 - Z0), on every tensor the decoder reads."""
        if self.valid.shape != other.valid.shape or not torch.equal(self.valid, other.valid):
            raise ValueError("can only interpolate memories of the same shape (same number of memory slots)")
        mix = lambda a, b: torch.lerp(a, b, w)   # exact at w = 0 and w = 1
        return replace(self, embeds=None if self.embeds is None else mix(self.embeds, other.embeds),
                       kv=None if self.kv is None else [(mix(k0, k1), mix(v0, v1))
                                                        for (k0, v0), (k1, v1) in zip(self.kv, other.kv)])

    def num_bytes(self) -> int:
        """Bytes the decoder holds for this memory (for the KV carrier: its cache)."""
        tensors = [self.embeds] if self.embeds is not None else [t for kv in self.kv for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors)


# -----------------------------------------------------------------------------
# the compressor


class Compressor(nn.Module):
    """Encoder + memory source + bridge + the decoder-side tokens, around a frozen decoder LLM."""

    def __init__(self, cfg: CompressorConfig, decoder: Transformer, tok, encoder: Transformer | None = None,
                 enc_tok=None):
        super().__init__()
        validate(cfg)
        # record the base models this compressor was built on, so `load` rebuilds on the same ones
        cfg = replace(cfg, model=getattr(decoder, "name_or_path", cfg.model))
        if encoder is not None:
            cfg = replace(cfg, compressor_model=getattr(encoder, "name_or_path", cfg.compressor_model))
        self.cfg = cfg
        self.tok, self.enc_tok = tok, enc_tok or tok
        decoder.requires_grad_(False)   # the decoder is frozen in every method (KEFT unfreezes q/k/v later)
        self.decoder = decoder
        dev, dt = decoder.model.embed_tokens.weight.device, decoder.model.embed_tokens.weight.dtype
        self.encoder = self._build_encoder(decoder, encoder)
        d_enc, d_dec = self.encoder.config.hidden_size, decoder.config.hidden_size

        # memory source: learned memory tokens, shared by every chunk (ICAE §3.1; AOC Eq. 2 "Y_m")
        if cfg.source == "mem_tokens":
            n_mem = cfg.mem if cfg.ratio <= 0 else cfg.chunk_len   # ratio mode: at most one per token
            std = self.encoder.model.embed_tokens.weight.float().std().item()
            self.mem_tokens = nn.Parameter(torch.randn(n_mem, d_enc, device=dev) .mul_(std).to(dt))

        # bridge from the encoder's output space to the decoder's input space
        if cfg.bridge == "none" and cfg.carrier == "embeds" and d_enc != d_dec:
            raise ValueError(f"the encoder is {d_enc} wide and the decoder {d_dec}: use --bridge mlp or linear")
        if cfg.bridge == "linear":
            # CompLLM §3: "one linear layer" on the CE outputs; identity init (ours) starts from ICAE
            self.bridge = nn.Linear(d_enc, d_dec, device=dev, dtype=dt)
            with torch.no_grad():
                self.bridge.weight.copy_(torch.eye(d_dec, d_enc))
                self.bridge.bias.zero_()
        elif cfg.bridge == "mlp":
            # PCC/PIC converter between compressor and decoder widths: Linear -> GELU -> Linear
            self.bridge = nn.Sequential(nn.Linear(d_enc, d_dec), nn.GELU(), nn.Linear(d_dec, d_dec)).to(dev, dt)
        elif cfg.bridge == "lsa":
            # GMSA §3.3, Eq. (3): j Transformer blocks initialised from the decoder's first j layers,
            # fully trained — an independent copy, so training them never touches the decoder
            if d_enc != d_dec:
                raise ValueError(f"LSA blocks are decoder layers ({d_dec} wide) and the encoder is {d_enc} wide")
            self.lsa = copy_model(decoder, num_hidden_layers=cfg.lsa_layers)
            self.lsa.requires_grad_(True)

        # decoder-side special tokens: learned [AE] / [LM] embeddings (ICAE, EPL, PIC Eq. 6),
        # initialised from the [BOS] embedding so they start as a "begin" signal
        bos = decoder.model.embed_tokens.weight[self._bos_id()].detach().clone()
        if cfg.ae_token == "learned":
            self.ae_embed = nn.Parameter(bos.clone())
        if cfg.lm_token == "learned":
            self.lm_embed = nn.Parameter(bos.clone())
        self._sentence_end = {}   # token id -> ends a sentence? (CompLLM segmentation cache)
        if cfg.decoder_train == "keft":
            self.set_stage("keft")

    # ---- construction helpers ----

    def _build_encoder(self, decoder: Transformer, encoder: Transformer | None) -> Transformer:
        cfg = self.cfg
        if cfg.encoder == "lora":
            # ICAE / 500x / CompLLM: the encoder *is* the decoder plus LoRA; decoding runs with the LoRA
            # switched off, so the decoder stays exactly the frozen LLM
            if cfg.mlp != "swiglu":
                raise ValueError("encoder lora shares the decoder's blocks: --mlp needs encoder full or separate")
            add_lora(decoder, cfg.lora_targets, r=cfg.lora_r, alpha=cfg.lora_alpha)
            return decoder
        if cfg.encoder == "full":
            # AOC: a copy of the decoder (minus the MLPs with mlp="aoc"), every weight trained
            enc = copy_model(decoder, mlp=cfg.mlp)
        elif cfg.encoder == "separate":
            # PCC / PIC: a separate compressor LLM, fully fine-tuned
            enc = encoder if encoder is not None else copy_model(decoder)
            if cfg.mlp != enc.config.mlp:
                enc = copy_model(enc, mlp=cfg.mlp)
        else:
            # GMSA §3.2: the first k layers of the LLM, with LoRA
            k = cfg.enc_layers or max(1, decoder.config.num_hidden_layers // 4)
            if not 1 <= k <= decoder.config.num_hidden_layers:
                raise ValueError(f"--enc-layers {k} must be in 1..{decoder.config.num_hidden_layers}")
            enc = copy_model(decoder, num_hidden_layers=k, mlp=cfg.mlp)
            add_lora(enc, cfg.lora_targets, r=cfg.lora_r, alpha=cfg.lora_alpha)   # freezes enc's base
            return enc
        enc.requires_grad_(True)
        if cfg.carrier == "kv":
            d, e = decoder.config, enc.config
            if (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) != \
                    (e.num_hidden_layers, e.num_key_value_heads, e.head_dim):
                raise ValueError("carrier kv needs an encoder with the decoder's layers, KV heads and head_dim")
        return enc

    def encoder_ids(self, ids: list) -> list:
        """Decoder token ids -> the encoder's ids for the same text: the same list when both read one
        tokenizer, else decoded and re-encoded (a separate compressor LLM, e.g. PCC/PIC with Qwen2.5
        compressing for Llama 3)."""
        return list(ids) if self.enc_tok is self.tok else self.enc_tok.encode(self.tok.decode(ids))

    def _bos_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def shares_decoder(self) -> bool:
        return self.encoder is self.decoder

    def encoding(self):
        """Context for running the encoder (LoRA on)."""
        return nullcontext()

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
            self.cfg.decoder_train = "keft"
        elif stage != "ae":
            raise ValueError(f"unknown stage '{stage}': choose ae or keft")

    # ---- cutting contexts ----

    def chunks(self, ids: list) -> list:
        """Cut one context (encoder token ids) into chunks; returns a list of id lists."""
        if len(ids) == 0:
            raise ValueError("cannot compress an empty context")
        L = self.cfg.chunk_len
        if self.cfg.chunking == "fixed":
            return [ids[s:s + L] for s in range(0, len(ids), L)]
        return self.sentence_segments(ids)

    def sentence_segments(self, ids: list) -> list:
        """CompLLM §4.1: sentences, then long sentences split again so every segment has <= S tokens.
        The paper uses NLTK's Punkt; we cut after any token whose text ends with . ! ? or a newline
        (no runtime dependency), then split a sentence of n > S tokens into ceil(n/S) near-equal parts."""
        S, segments, start = self.cfg.chunk_len, [], 0
        for i, t in enumerate(ids):
            if t not in self._sentence_end:
                text = self.enc_tok.decode([t]).rstrip(" ")
                self._sentence_end[t] = text.endswith((".", "!", "?", "\n"))
            if self._sentence_end[t] or i == len(ids) - 1:
                sentence = ids[start:i + 1]
                parts = math.ceil(len(sentence) / S)
                bounds = [round(j * len(sentence) / parts) for j in range(parts + 1)]
                segments += [sentence[a:b] for a, b in zip(bounds, bounds[1:])]
                start = i + 1
        return segments

    def num_mem(self, n: int) -> int:
        """Memory slots for a chunk of n tokens: ceil(n / ratio) (CompLLM's ceil(n/C), PIC's L/N), or the
        fixed --mem budget, never more than the chunk has tokens (a short last chunk; ours)."""
        return math.ceil(n / self.cfg.ratio) if self.cfg.ratio > 0 else min(self.cfg.mem, n)

    # ---- compression ----

    def compress(self, contexts: list, rates: list | None = None) -> Memory:
        """Compress a batch of contexts (lists of encoder token ids) into one Memory.
        rates: group_mean only, one compression rate per context (default: sampled from cfg.ratios)."""
        if self.cfg.source == "group_mean":
            return self._compress_merge(contexts, rates)
        return self._compress_mem(contexts)

    def _compress_mem(self, contexts: list) -> Memory:
        cfg, enc = self.cfg, self.encoder
        dev = enc.model.embed_tokens.weight.device
        # 1. every chunk of every context is one row of the encoder batch: [chunk (n), memory (m), pad]
        rows = self._chunk_rows(contexts, lambda b, n: self.num_mem(n))
        R, T = len(rows), max(len(c) + m for _, _, c, m, _ in rows)
        pad = self.enc_tok.pad_id if self.enc_tok.pad_id is not None else 0
        ids = torch.full((R, T), pad, dtype=torch.long)
        pos = torch.zeros(R, T, dtype=torch.long)
        is_mem = torch.zeros(R, T, dtype=torch.bool)
        row_masks = []
        for r, (b, i, chunk, m, start) in enumerate(rows):
            n = len(chunk)
            ids[r, :n] = torch.tensor(chunk)
            is_mem[r, n:n + m] = True
            if cfg.source == "eos":
                ids[r, n:n + m] = self.enc_tok.eos_id          # CompLLM §3: ceil(n/C) EOS embeddings
            ctx_pos, mem_pos = positions.encoder_positions(cfg.layout, i, n, m, offset=start)
            pos[r, :n], pos[r, n:n + m] = ctx_pos, mem_pos
            # PIC Eq. (5) or the ordinary causal mask over [chunk, memory]
            row_masks.append(masks.pic(n, m) if cfg.mask == "pic" else masks.full_causal(n, m))
        ids, pos, is_mem = ids.to(dev), pos.to(dev), is_mem.to(dev)
        attn = masks.stack_padded(row_masks, T).to(dev)   # [R, T, T]; padding sees only itself

        x = enc.model.embed_tokens(ids)                                  # (R, T, d_enc)
        if cfg.source == "mem_tokens":
            slot = (is_mem.cumsum(1) - 1).clamp(min=0)                   # memory slot index per position
            x = torch.where(is_mem[..., None], self.mem_tokens[slot].to(x.dtype), x)
        with self.encoding():
            out = enc(inputs_embeds=x, position_ids=pos, attn_mask=attn, return_kv=cfg.carrier == "kv",
                      compute_logits=False)

        # 2. gather the memory slots of each sample, chunk after chunk, into [B, M] (right-padded)
        flat, valid, chunk_lens, counts = self._memory_slots(rows, len(contexts), is_mem)   # flat: into (R*T)
        enc_pos = pos.reshape(-1)[flat]                                   # (B, M)
        if cfg.carrier == "kv":
            kv = []
            for k, v in out.kv:                                           # (R, Hkv, T, D) each
                # (R, Hkv, T, D) -> (R*T, Hkv, D) -> pick (B, M, Hkv, D) -> (B, Hkv, M, D)
                pick = lambda t: t.transpose(1, 2).reshape(R * T, t.shape[1], t.shape[3])[flat].transpose(1, 2)
                kv.append((pick(k), pick(v)))
            embeds = None
        else:
            kv = None
            h = out.last_hidden.reshape(R * T, -1)[flat]                  # (B, M, d_enc), final norm applied
            embeds = self._bridge(h, valid)
        return Memory(embeds, kv, valid, enc_pos, chunk_lens, counts)

    def _chunk_rows(self, contexts: list, n_slots) -> list:
        """Every chunk of every context, in order, as one encoder row:
        (sample, chunk index, chunk ids, memory slots = n_slots(sample, chunk length), chunk start)."""
        rows = []
        for b, ids in enumerate(contexts):
            start = 0
            for i, chunk in enumerate(self.chunks(list(ids))):
                rows.append((b, i, chunk, n_slots(b, len(chunk)), start))
                start += len(chunk)
        return rows

    def _memory_slots(self, rows, B: int, is_mem: torch.Tensor):
        """Per sample, the flat (row * T + column) indices of its memory slots, chunk after chunk, right-padded
        -> flat (B, M), valid (B, M), and the chunk lengths and slot counts a Memory records."""
        chunk_lens, counts = [[] for _ in range(B)], [[] for _ in range(B)]
        for b, _, chunk, m, _ in rows:
            chunk_lens[b].append(len(chunk))
            counts[b].append(m)
        sizes = [sum(c) for c in counts]
        # rows come sample after sample and nonzero() is row-major, so each sample's slots are one run
        slots = is_mem.flatten().nonzero().squeeze(1).split(sizes)
        flat = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)           # (B, M), padding -> 0
        valid = torch.arange(flat.shape[1], device=flat.device)[None] < torch.tensor(sizes, device=flat.device)[:, None]
        return flat, valid, chunk_lens, counts

    def _compress_merge(self, contexts: list, rates: list | None) -> Memory:
        """GMSA §3.2: encode with the first k layers, mean-pool consecutive groups of r hidden states."""
        cfg, enc = self.cfg, self.encoder
        dev = enc.model.embed_tokens.weight.device
        if rates is None:   # GMSA §4.1: the compression rate is sampled per example
            rates = [cfg.ratios[i] for i in torch.randint(len(cfg.ratios), (len(contexts),)).tolist()]
        rows = self._chunk_rows(contexts, lambda b, n: math.ceil(n / rates[b]))   # groups per chunk
        R, T = len(rows), max(len(c) for _, _, c, _, _ in rows)
        pad = self.enc_tok.pad_id if self.enc_tok.pad_id is not None else 0
        ids = torch.full((R, T), pad, dtype=torch.long)
        group = torch.full((R, T), T, dtype=torch.long)      # padding goes to a spare group T, dropped
        for r, (b, _, chunk, _, _) in enumerate(rows):
            n = len(chunk)
            ids[r, :n] = torch.tensor(chunk)
            group[r, :n] = torch.arange(n) // rates[b]       # GMSA §3.2: consecutive groups of size r
        valid_tok = group < T
        attn = masks.with_padding(masks.causal(T), valid_tok)
        with self.encoding():
            h = enc(ids.to(dev), attn_mask=attn.to(dev), compute_logits=False).last_hidden   # (R, T, d)
        # exact mean over each group (the last group may be shorter): sum, then divide by its size
        group = group.to(dev)
        sums = torch.zeros(R, T + 1, h.shape[-1], device=dev, dtype=torch.float32)
        sums.scatter_add_(1, group[..., None].expand(-1, -1, h.shape[-1]), h.float())
        sizes = torch.zeros(R, T + 1, device=dev).scatter_add_(1, group, torch.ones_like(group, dtype=torch.float))
        means = (sums / sizes.clamp(min=1)[..., None]).to(h.dtype)        # (R, T+1, d)
        is_mem = torch.zeros(R, T + 1, dtype=torch.bool, device=dev)
        for r, (_, _, _, g, _) in enumerate(rows):
            is_mem[r, :g] = True
        flat, valid, chunk_lens, counts = self._memory_slots(rows, len(contexts), is_mem)
        summary = means.reshape(R * (T + 1), -1)[flat]                   # (B, M, d)
        enc_pos = torch.zeros_like(flat)
        return Memory(self._bridge(summary, valid), None, valid, enc_pos, chunk_lens, counts)

    def _bridge(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Map encoder outputs (B, M, d_enc) into the decoder's input space (B, M, d_dec)."""
        if self.cfg.bridge in ("linear", "mlp"):
            return self.bridge(h)
        if self.cfg.bridge == "lsa":
            # GMSA Eq. (3): the summary vectors pass through the LSA blocks (causal, positions 0..M-1);
            # their output residual stream (no final norm) is what the decoder's layer 0 reads
            attn = masks.with_padding(masks.causal(h.shape[1]), valid)
            out = self.lsa(inputs_embeds=h, attn_mask=attn, output_hidden_states=True, compute_logits=False)
            return out.hidden_states[-1]
        return h

    # ---- the decoder side ----

    def special_token(self, task: str) -> str:
        kind = self.cfg.ae_token if task == "ae" else self.cfg.lm_token
        if kind == "last" and task == "qa":
            return "none"   # PIC Eq. (7)'s x_k is for completion; a question follows the memory directly
        return kind

    def decoder_batch(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
                      last_tokens: list | None = None) -> dict:
        """Decoder inputs for every sample: [memory, special token, follow tokens], right-padded.

        follow[b]: decoder token ids after the special token (AE: the context + EOS; LM: the continuation;
        QA: question + answer + EOS). n_supervised[b]: the loss covers the last n of them (default all).
        last_tokens[b]: x_k, the last context token, for the PIC TC special token (Eq. 7).
        Returns inputs_embeds (B, T, d), position_ids (B, T), attn_mask (B, T, P+T), past_kv or None,
        targets (B, T) with -100 where no loss is taken.
        """
        if task not in ("ae", "lm", "qa"):
            raise ValueError(f"unknown task '{task}': choose ae, lm or qa")
        cfg, dec = self.cfg, self.decoder
        embed = dec.model.embed_tokens
        dev = embed.weight.device
        kind = self.special_token(task)
        rows_x, rows_pos, rows_tgt = [], [], []
        for b, ids in enumerate(follow):
            M = int(memory.valid[b].sum())
            chunk_lens, counts = memory.chunk_lens[b], memory.mem_counts[b]
            # EPL §3.2 / Tables 12-15: where memory, special token and following tokens sit
            mem_pos, special_pos, follow_pos = positions.decoder_positions(
                cfg.layout, cfg.carrier, task, chunk_lens, counts, sum(chunk_lens), len(ids))
            follow_pos = torch.as_tensor(follow_pos)
            if kind == "none" and cfg.layout == "dpl":
                follow_pos = follow_pos - 1   # no special token: the follow tokens take its slot
            x, p = [], []
            if cfg.carrier == "embeds":
                x.append(memory.embeds[b, :M])
                p.append(torch.as_tensor(mem_pos))
            if kind != "none":
                vec = {"learned": lambda: (self.ae_embed if task == "ae" else self.lm_embed),
                       "bos": lambda: embed.weight[self._bos_id()],
                       "last": lambda: embed.weight[last_tokens[b]]}[kind]()
                x.append(vec[None].to(embed.weight.dtype))
                p.append(torch.tensor([special_pos]))
            x.append(embed(torch.as_tensor(ids, dtype=torch.long, device=dev)))
            p.append(follow_pos)
            x, p = torch.cat(x), torch.cat([t.to(dev) for t in p])
            # the slot before a supervised token predicts it (next-token prediction)
            tgt = torch.full((len(x),), -100, dtype=torch.long, device=dev)
            first = len(x) - len(ids)                          # slot of follow[0]
            n_sup = len(ids) if n_supervised is None else n_supervised[b]
            for t in range(len(ids) - n_sup, len(ids)):
                if first + t - 1 >= 0:
                    tgt[first + t - 1] = ids[t]
            rows_x.append(x), rows_pos.append(p), rows_tgt.append(tgt)

        lens = [len(x) for x in rows_x]
        T = max(lens)
        x = torch.nn.utils.rnn.pad_sequence(rows_x, batch_first=True)                 # (B, T, d)
        pos = torch.nn.utils.rnn.pad_sequence(rows_pos, batch_first=True)             # (B, T)
        tgt = torch.nn.utils.rnn.pad_sequence(rows_tgt, batch_first=True, padding_value=-100)
        valid = torch.arange(T, device=dev)[None] < torch.tensor(lens, device=dev)[:, None]
        mask = masks.causal(T).to(dev)
        past_kv = None
        if cfg.carrier == "kv":
            # 500x/AOC: the memory is a KV-cache prefix; its keys keep the encoder's RoPE positions
            past_kv = memory.kv
            mask = masks.with_prefix(mask, memory.valid.shape[1])
            valid = torch.cat([memory.valid, valid], dim=1)
        # nothing padded: the mask is the model's default (prefix + causal), and passing None lets
        # SDPA use its fused causal kernel instead of the dense-mask one
        attn_mask = None if bool(valid.all()) else masks.with_padding(mask, valid)
        return dict(inputs_embeds=x, position_ids=pos, attn_mask=attn_mask, past_kv=past_kv, targets=tgt)

    def lm_loss(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
                last_tokens: list | None = None):
        """Cross-entropy of the frozen decoder on the supervised follow tokens, given the memory.
        AE: ICAE's autoencoding / PIC Eq. (6) TR; LM: PIC Eq. (7) TC; QA: answer-only fine-tuning.
        Returns (mean loss over supervised tokens, number of supervised tokens)."""
        batch = self.decoder_batch(memory, task, follow, n_supervised, last_tokens)
        tgt = batch.pop("targets")
        with self.decoding():
            out = self.decoder(**batch, compute_logits=False)
        sel = tgt != -100
        # logits only where a loss is taken: B*T*vocab logits would dwarf everything else
        logits = self.decoder.lm_head(out.last_hidden[sel]).float()
        n = int(sel.sum())
        return F.cross_entropy(logits, tgt[sel], reduction="sum") / max(n, 1), n

    def distill_loss(self, contexts: list, questions: list, answers: list):
        """CompLLM Eq. (1)-(3): the LLM with the CEs (student) imitates the LLM with the full context
        (teacher) in every layer's hidden states at the answer tokens:
            L = Σ_ℓ (1/σ_ℓ) · mean_{t∈A, j≤d} SmoothL1_β=1(H̃_ℓ[t, j], H_ℓ[t, j]),   σ_ℓ = Std(H_ℓ[A])."""
        dec, dev = self.decoder, self.decoder.model.embed_tokens.weight.device
        # teacher: [context, question, answer] as plain tokens, no gradient, the unmodified LLM
        rows = [list(c) + list(q) + list(a) for c, q, a in zip(contexts, questions, answers)]
        T = max(map(len, rows))
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
        lens = torch.tensor([len(r) for r in rows], device=dev)
        valid = torch.arange(T, device=dev)[None] < lens[:, None]
        with torch.no_grad(), self.decoding():
            teacher = dec(ids, attn_mask=masks.with_padding(masks.causal(T).to(dev), valid),
                          output_hidden_states=True, compute_logits=False).hidden_states
        a_teacher = torch.zeros_like(valid)
        for b, a in enumerate(answers):
            a_teacher[b, len(rows[b]) - len(a):len(rows[b])] = True
        # student: [CEs, question, answer] (no special token: the LLM reads CEs like token embeddings)
        memory = self.compress(contexts)
        follow = [list(q) + list(a) for q, a in zip(questions, answers)]
        batch = self.decoder_batch(memory, "qa", follow, [len(a) for a in answers])
        predicts = batch.pop("targets") != -100              # the slots that predict an answer token ...
        with self.decoding():
            student = dec(**batch, output_hidden_states=True, compute_logits=False).hidden_states
        a_student = torch.zeros_like(predicts)
        a_student[:, 1:] = predicts[:, :-1]                  # ... are each followed by that token's own slot
        loss = 0.0
        for layer in range(1, len(teacher)):                       # ℓ = 1..L (0 is the embedding layer)
            h, h_s = teacher[layer][a_teacher].float(), student[layer][a_student].float()
            sigma = h.std()                                         # CompLLM Eq. (2): teacher's Std
            loss = loss + F.smooth_l1_loss(h_s, h, beta=1.0) / sigma   # Eq. (1), mean over t∈A, j≤d
        return loss, int(a_teacher.sum())

    @torch.no_grad()
    def generate(self, memory: Memory, task: str, prompt: list | None = None, max_new_tokens: int = 64,
                 last_token: int | None = None) -> list:
        """Greedy decoding for ONE sample (memory of batch size 1) after [memory, special, prompt]."""
        if memory.valid.shape[0] != 1:
            raise ValueError("generate takes a memory of one sample; loop over the batch")
        batch = self.decoder_batch(memory, task, [list(prompt or [])], [0],
                                   None if last_token is None else [last_token])
        batch.pop("targets")
        with self.decoding():
            out = self.decoder.generate(**batch, max_new_tokens=max_new_tokens, eos_id=self.tok.eos_id)
        ids = out[0].tolist()
        return ids[:ids.index(self.tok.eos_id)] if self.tok.eos_id in ids else ids

    # ---- what is trained, saved and loaded ----

    def trainable_parameters(self) -> list:
        return [p for p in self.parameters() if p.requires_grad]

    def _saved(self, name: str) -> bool:
        """Everything not part of the frozen decoder, plus what of the decoder was trained
        (LoRA on a shared encoder; q/k/v after KEFT)."""
        if not name.startswith("decoder."):
            return True
        if "lora_" in name:
            return True
        return self.cfg.decoder_train == "keft" and any(f"self_attn.{m}." in name
                                                        for m in ("q_proj", "k_proj", "v_proj"))

    def trained_state(self) -> dict:
        return {n: p.detach().contiguous() for n, p in self.named_parameters() if self._saved(n)}

    def save(self, out_dir: str, extra: dict | None = None):
        """Write compressor.safetensors (exactly the trained tensors) and compressor.json (the config),
        each atomically (temp file + rename), so an interrupted save never leaves a broken checkpoint."""
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, "compressor.safetensors.tmp")
        save_file({k: v.cpu() for k, v in self.trained_state().items()}, tmp)
        os.replace(tmp, os.path.join(out_dir, "compressor.safetensors"))
        meta = {"config": asdict(self.cfg), **(extra or {})}
        tmp = os.path.join(out_dir, "compressor.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, os.path.join(out_dir, "compressor.json"))

    def load_trained(self, state: dict):
        """Load exactly the tensors `save` wrote; list whatever is missing, unexpected or misshapen."""
        own = {n: p for n, p in self.named_parameters() if self._saved(n)}
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = sorted(n for n in set(own) & set(state) if own[n].shape != state[n].shape)
        if missing or unexpected or shapes:
            raise ValueError(f"checkpoint does not match the compressor: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, wrong shape {shapes[:5]}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state[n])


def read_checkpoint_config(ckpt_dir: str) -> dict:
    """compressor.json of a checkpoint directory, with a one-line error when it is not one."""
    path = os.path.join(ckpt_dir, "compressor.json")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory '{ckpt_dir}' does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{ckpt_dir}' is not a checkpoint: compressor.json is missing "
                                "(point --ckpt at a train.py --out directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"'{path}' is corrupt ({e.msg}): restore it or retrain") from None


def load(ckpt_dir: str, dtype=torch.float32, device="cpu") -> Compressor:
    """Rebuild a compressor from a checkpoint: base model(s) from the config, trained tensors on top."""
    meta = read_checkpoint_config(ckpt_dir)
    cfg = CompressorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()})
    decoder, tok = load_pretrained(cfg.model, dtype=dtype, device=device)
    encoder, enc_tok = None, None
    if cfg.encoder == "separate" and cfg.compressor_model:
        encoder, enc_tok = load_pretrained(cfg.compressor_model, dtype=dtype, device=device)
    comp = Compressor(cfg, decoder, tok, encoder, enc_tok)
    try:
        state = load_file(os.path.join(ckpt_dir, "compressor.safetensors"))
    except Exception as e:
        raise ValueError(f"'{ckpt_dir}/compressor.safetensors' cannot be read ({e}): restore it or retrain") from None
    comp.load_trained(state)
    return comp


def build(method: str, decoder: Transformer, tok, encoder_model: Transformer | None = None, encoder_tok=None,
          **overrides) -> Compressor:
    """The compressor of a preset around `decoder`, e.g. build("pic", llm, tok, layout="epl").
    encoder_model / encoder_tok: the separate compressor LLM of pcc/pic (default: a copy of the decoder)."""
    return Compressor(make_config(method, **overrides), decoder, tok, encoder_model, encoder_tok)
