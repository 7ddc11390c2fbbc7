"""
Every context-compression method in this repository, as a preset over shared parts.

A soft compressor reads a context X with an *encoder* and hands the *decoder* (a frozen LLM) a short
*memory* in its place. The papers differ along a few independent axes; each axis is implemented once
below and a method is just a choice along each of them (SPEC "methods are presets"):

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

Chunks are always separate rows of one batched encoder forward. That *is* the block-diagonal
`masks.segments` mask (no chunk can see another), computed at linear cost instead of on one long
sequence with a dense mask; tests/test_compressors.py checks the two agree.

Every tensor built here is made on the model's device (`device=`), and the shapes that steer Python
control flow (how many slots a sample has, which positions carry a loss) are kept as Python numbers,
so a forward pass never waits for the GPU to report a value (tests/test_devices.py checks both).
"""

import hashlib
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
from model import RMSNorm, Transformer, add_lora, chunked_cross_entropy, copy_model, load_pretrained, lora_disabled

# -----------------------------------------------------------------------------
# configuration: one dataclass, one field per axis, and the papers' presets


@dataclass
class CompressorConfig:
    method: str = "icae"            # the preset this config started from
    model: str = "tiny"             # the decoder LLM (HF id, local dir or "tiny")
    compressor_model: str = ""      # encoder="separate": the compressor LLM ("" = a copy of the decoder)
    # --- encoder weights ---
    encoder: str = "lora"           # "lora" | "full" | "separate" | "first_k"; lora with mlp != swiglu = LoRA on an
                                    # MLP-free copy (AOC's LoRA-AOC ablation)
    mlp: str = "swiglu"             # encoder blocks: "swiglu" | "aoc" (AOC Eq. 3) | "none" (sub-block removed)
    lora_r: int = 128               # LoRA rank (encoder "lora" and "first_k")
    lora_alpha: int = 256           # LoRA alpha; the update is scaled by alpha / r
    lora_dropout: float = 0.0       # dropout on the LoRA branch (PEFT; ICAE and AOC's LoRA baselines: 0.05)
    lora_targets: tuple = ("q_proj", "v_proj")
    enc_layers: int = 0             # encoder "first_k": layers kept (0 = a quarter of the decoder's, GMSA's 8 of 32)
    # --- memory source ---
    source: str = "mem_tokens"      # "mem_tokens" | "eos" | "group_mean"
    mem: int = 102                  # memory tokens per chunk (fixed budget)
    ratio: float = 0.0              # > 0: memory per chunk = ceil(chunk tokens / ratio) instead of `mem`
    ratios: tuple = (4, 8)          # group_mean: compression rate sampled per example (GMSA §4.1)
    mem_init: str = "embed"         # how memory tokens and learned special tokens are drawn: "embed" N(μ, σ) with the
                                    # scalar mean/std of the token embedding table (EPL code) | "normal" N(0, 1)
                                    # (ICAE, 500x, AOC code) | "hf" N(0, 0.02) (PCC code: new vocabulary rows)
    cap_mem: bool = False           # ours: a chunk of n < mem tokens gets n slots (the papers' code gives it all `mem`)
    # --- cutting the context ---
    chunking: str = "fixed"         # "fixed": chunks of chunk_len | "sentences": CompLLM segments of <= chunk_len
    chunk_len: int = 510            # tokens per chunk (EPL: L = 510)
    bos: bool = False               # the context starts with [BOS], and AE reconstructs [BOS] X [EOS] (ICAE, EPL code)
    # --- encoder attention and positions ---
    mask: str = "causal"            # "causal" (ICAE/500x/PCC/AOC) | "pic" (PIC Eq. 5)
    layout: str = "dpl"             # "dpl" | "upl" | "epl" (positions.py)
    # --- what reaches the decoder ---
    carrier: str = "embeds"         # "embeds" | "kv"
    bridge: str = "none"            # "none" | "linear" | "mlp" | "lsa"
    lsa_layers: int = 1             # bridge "lsa": decoder blocks copied (GMSA: j = 1 suffices)
    delimiters: bool = False        # PCC code: [BOS] first, then each chunk's memory between <mem> and </mem>
    ae_token: str = "learned"       # token after the memory for AE: "learned" [AE] | "bos" | "none"
    lm_token: str = "learned"       # ... for LM/QA: "learned" [LM] | "bos" | "last" (PIC Eq. 7) | "none"
    train_specials: bool = True     # learned [AE]/[LM] (<mem>, </mem>) train; PCC code: random, frozen with the decoder
    template: str = "plain"         # QA prompt around context and question (TEMPLATES; "chat": the model's own)
    decoder_train: str = "none"     # "none" | "keft" (GMSA stage 2: decoder q/k/v train)


# The presets: each is what its paper's code does, at the paper's defaults.
PRESETS = {
    # ICAE as the EPL code runs it: LoRA r=128 α=256 on q,v; 102 memory tokens per 510-token chunk, drawn from
    # N(μ, σ) of the embedding table; the context starts with [BOS]; learned [AE]/[LM]; EPL's QA template.
    "icae": dict(bos=True, template="epl"),
    # 500xCompressor as EPL's 500xCompressor branch runs it: as ICAE, but the decoder gets the memory tokens'
    # per-layer K/V. Learned [AE]/[LM] too: under joint AE+LM pretraining a [BOS] for both would give the decoder
    # the same prefix for "reconstruct" and "continue". (The original 500x, AE only from [BOS]: train.py's
    # `ae` recipe for 500x.)
    "500x": dict(carrier="kv", bos=True, template="epl"),
    # PCC code (PIC §3.4 follows it): a separate, fully fine-tuned compressor LLM, ordinary causal mask, 256-token
    # segments with 16 memory slots each (16x, PIC Table 4), memory tokens as new vocabulary rows N(0, 0.02);
    # decoder input [BOS, <mem> m.. </mem>, ...] with random, frozen <mem>/</mem>/<ae>; RMSNorm -> Linear -> GELU
    # -> Linear converter; TR after <ae> (PIC Eq. 6), TC after x_k (PIC Eq. 7); its QA prompt.
    "pcc": dict(encoder="separate", mem=16, chunk_len=256, bridge="mlp", mem_init="hf", delimiters=True,
                lm_token="last", train_specials=False, template="pcc"),
    # PIC: PCC with the block-wise causal mask and nothing else changed (PIC §4.3 ablation).
    "pic": dict(encoder="separate", mem=16, chunk_len=256, bridge="mlp", mem_init="hf", delimiters=True,
                lm_token="last", train_specials=False, template="pcc", mask="pic"),
    # CompLLM: LoRA r=32 on the LLM; segments of <= S = 20 tokens; ceil(n/C) EOS embeddings per segment with
    # C = 2; one linear layer; the question follows the CEs directly, in the model's chat format (§3, §4.1).
    "compllm": dict(lora_r=32, lora_alpha=64, source="eos", chunking="sentences", chunk_len=20,
                    ratio=2.0, bridge="linear", ae_token="none", lm_token="none", template="chat"),
    # GMSA: first k layers + LoRA; mean of groups of r last hidden states, r in {4, 8} per example;
    # one LSA block initialised from decoder layer 0; reconstruct after [AE] (§3.2-3.4); texts <= 512 tokens.
    "gmsa": dict(encoder="first_k", lora_r=64, lora_alpha=128, source="group_mean", chunk_len=512,
                 bridge="lsa", lm_token="none"),
    # AOC code: the decoder with every MLP replaced by the identity, fully trained, embedding the prompt with the
    # frozen LLM's table; 16 memory tokens drawn from N(0, 1); K/V carrier as 500x; regenerate from [BOS] (§2).
    "aoc": dict(encoder="full", mlp="aoc", mem=16, chunk_len=512, carrier="kv", ae_token="bos", lm_token="bos",
                mem_init="normal"),
}
METHODS = tuple(PRESETS)

# QA prompts: (decoder text before the memory, the context as it is compressed, the decoder prompt after the
# memory and special token). Each piece is tokenised on its own and the ids concatenated, as EPL's code does.
TEMPLATES = {
    "plain": ("", "{context}", "\n\n{question}"),                                # ours: the question, then the answer
    "pcc": ("", "{context}", "Question: {question}\n\nAnswer: "),                # PCC code, evaluate_qa.py
    "epl": ("", "### Context:\n{context}", "\n### Question:\n{question}\n### Answer:\n"),   # EPL code, sft data
    # "chat" resolves to the checkpoint's chat format (CompLLM uses instruction-tuned Qwen3 / Gemma 3), found by
    # its marker tokens; a base model without one reads "plain". No system prompt (Qwen3's default has none).
    "chatml": ("<|im_start|>user\n", "{context}", "\n{question}<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "{context}",
               "\n{question}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": ("<bos><start_of_turn>user\n", "{context}", "\n{question}<end_of_turn>\n<start_of_turn>model\n"),
}
CHAT_MARKERS = {"chatml": "<|im_start|>", "llama3": "<|start_header_id|>", "gemma": "<start_of_turn>"}

_CHOICES = dict(
    encoder=("lora", "full", "separate", "first_k"), mlp=("swiglu", "aoc", "none"),
    source=("mem_tokens", "eos", "group_mean"), mem_init=("embed", "normal", "hf"), chunking=("fixed", "sentences"),
    mask=("causal", "pic"), layout=("dpl", "upl", "epl"), carrier=("embeds", "kv"),
    bridge=("none", "linear", "mlp", "lsa"), ae_token=("learned", "bos", "none"),
    lm_token=("learned", "bos", "last", "none"), template=("plain", "pcc", "epl", "chat", *CHAT_MARKERS),
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
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.carrier == "kv" and cfg.encoder == "first_k":
        raise ValueError("carrier kv needs one K/V per decoder layer; a first_k encoder has fewer layers")
    if cfg.carrier == "kv" and cfg.bridge != "none":
        raise ValueError("carrier kv hands the decoder K/V directly: a bridge cannot apply (use --bridge none)")
    if cfg.carrier == "kv" and cfg.ae_token == "none":
        raise ValueError("carrier kv with --ae-token none leaves nothing after the memory to predict the text's first "
                         "token from: use --ae-token bos or learned")
    if cfg.carrier == "kv" and cfg.delimiters:
        raise ValueError("delimiters surround memory embeddings in the decoder input: they need --carrier embeds")
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
        if self.mem_counts != other.mem_counts:
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
        self.decoder = decoder          # registered first: tensors an encoder shares with it are named decoder.*
        self.encoder = self._build_encoder(decoder, encoder)
        d_enc, d_dec = self.encoder.config.hidden_size, decoder.config.hidden_size
        dev = decoder.model.embed_tokens.weight.device

        # memory source: learned memory tokens, shared by every chunk (ICAE §3.1; AOC Eq. 2 "Y_m")
        if cfg.source == "mem_tokens":
            n_mem = cfg.mem if cfg.ratio <= 0 else cfg.chunk_len   # ratio mode: at most one per token
            self.mem_tokens = nn.Parameter(self._draw(n_mem, self.encoder))

        # bridge from the encoder's output space to the decoder's input space
        if cfg.bridge == "none" and cfg.carrier == "embeds" and d_enc != d_dec:
            raise ValueError(f"the encoder is {d_enc} wide and the decoder {d_dec}: use --bridge mlp or linear")
        dt = decoder.model.embed_tokens.weight.dtype
        if cfg.bridge == "linear":
            # CompLLM §3: "one linear layer" on the CE outputs; identity init (ours) starts from ICAE
            self.bridge = nn.Linear(d_enc, d_dec, device=dev, dtype=dt)
            with torch.no_grad():
                self.bridge.weight.copy_(torch.eye(d_dec, d_enc))
                self.bridge.bias.zero_()
        elif cfg.bridge == "mlp":
            # PCC code's converter: RMSNorm (weight 1, eps 1e-6) -> Linear -> GELU (exact) -> Linear, PyTorch init
            self.bridge = nn.Sequential(RMSNorm(d_enc, 1e-6), nn.Linear(d_enc, d_dec), nn.GELU(),
                                        nn.Linear(d_dec, d_dec)).to(dev, dt)
        elif cfg.bridge == "lsa":
            # GMSA §3.3, Eq. (3): j Transformer blocks initialised from the decoder's first j layers, fully trained,
            # an independent copy (training them never touches the decoder). It borrows the decoder's embedding,
            # final norm and lm_head, which it never uses (the decoder's layer 0 reads the LSA's raw residual
            # stream), instead of carrying copies of its own
            if d_enc != d_dec:
                raise ValueError(f"LSA blocks are decoder layers ({d_dec} wide) and the encoder is {d_enc} wide")
            self.lsa = copy_model(decoder, share=SHARED + ("model.norm",), num_hidden_layers=cfg.lsa_layers)
            self._train_own_weights(self.lsa)

        # decoder-side special tokens, drawn like the memory tokens (EPL code: N(μ, σ) of the embedding table;
        # ICAE: N(0, 1); PCC: N(0, 0.02), frozen with the decoder)
        specials = [("ae_embed", cfg.ae_token == "learned"), ("lm_embed", cfg.lm_token == "learned"),
                    ("mem_open", cfg.delimiters), ("mem_close", cfg.delimiters)]
        for name, wanted in specials:
            if wanted:
                setattr(self, name, nn.Parameter(self._draw(1, decoder)[0], requires_grad=cfg.train_specials))
        self._sentence_end = {}   # token id -> ends a sentence? (CompLLM segmentation cache)
        if cfg.decoder_train == "keft":
            self.set_stage("keft")

    # ---- construction helpers ----

    def _draw(self, n: int, model: Transformer) -> torch.Tensor:
        """n vectors of `model`'s width, drawn as cfg.mem_init says, on its device and in its dtype."""
        w = model.model.embed_tokens.weight
        x = torch.randn(n, w.shape[1], device=w.device)
        if self.cfg.mem_init == "embed":    # EPL code: normal_(mean=embed.mean(), std=embed.std()), scalars
            x = x * w.float().std() + w.float().mean()
        elif self.cfg.mem_init == "hf":     # PCC code: resize_token_embeddings' init, N(0, initializer_range)
            x = x * 0.02
        return x.to(w.dtype)                # "normal": AOC/500x torch.randn, ICAE nn.Embedding default N(0, 1)

    def _train_own_weights(self, model: Transformer):
        """Every weight of a copy trains, except what it shares with the frozen decoder (its embedding)."""
        frozen = {id(p) for p in self.decoder.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) not in frozen)

    def _build_encoder(self, decoder: Transformer, encoder: Transformer | None) -> Transformer:
        cfg = self.cfg
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
            self._train_own_weights(enc)
        else:
            # PCC / PIC: a separate compressor LLM, fully fine-tuned (its own vocabulary, embeddings included)
            enc = encoder if encoder is not None else copy_model(decoder)
            if cfg.mlp != enc.config.mlp:
                enc = copy_model(enc, mlp=cfg.mlp)
            enc.requires_grad_(True)
        if cfg.carrier == "kv":
            d, e = decoder.config, enc.config
            if (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) != \
                    (e.num_hidden_layers, e.num_key_value_heads, e.head_dim):
                raise ValueError("carrier kv needs an encoder with the decoder's layers, KV heads and head_dim "
                                 "(not a first_k encoder with fewer layers)")
        return enc

    def encoder_ids(self, ids: list) -> list:
        """Decoder token ids -> the encoder's ids for the same text: the same list when both read one
        tokenizer, else decoded and re-encoded (a separate compressor LLM, e.g. PCC/PIC with Qwen2.5
        compressing for Llama 3)."""
        return list(ids) if self.enc_tok is self.tok else self.enc_tok.encode(self.tok.decode(ids))

    def _bos_id(self, tok=None) -> int:
        tok = tok or self.tok
        return tok.bos_id if tok.bos_id is not None else tok.eos_id

    @property
    def shares_decoder(self) -> bool:
        return self.encoder is self.decoder

    @property
    def device(self) -> torch.device:
        return self.decoder.model.embed_tokens.weight.device

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

    # ---- the texts the methods build (one place for training and evaluation) ----

    def ae_target(self, ids: list) -> list:
        """What AE reconstructs from the memory of `ids`: [BOS] x [EOS] when the context starts with [BOS]
        (ICAE and EPL code: the target is the compressed input plus EOS), else x [EOS] (500x, AOC, PCC code)."""
        return ([self._bos_id()] if self.cfg.bos else []) + list(ids) + [self.tok.eos_id]

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

        def pieces(fmt, slot, value, tok):   # "### Context:\n{context}" -> ids("### Context:\n") + ids(context)
            before, _, after = fmt.partition(slot)
            return sum((tok.encode(s) for s in (before, value, after) if s), [])
        return dict(prefix=self.tok.encode(prefix) if prefix else [],
                    dec_context=pieces(ctx, "{context}", context, self.tok),
                    enc_context=pieces(ctx, "{context}", context, self.enc_tok),
                    prompt=pieces(prompt, "{question}", question, self.tok))

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
        """Memory slots for a chunk of n tokens: ceil(n / ratio) (CompLLM's ceil(n/C)), or the fixed --mem budget,
        also for a short last chunk (EPL, PCC, AOC code); cap_mem (ours) gives a short chunk at most n slots."""
        if self.cfg.ratio > 0:
            return math.ceil(n / self.cfg.ratio)
        return min(self.cfg.mem, n) if self.cfg.cap_mem else self.cfg.mem

    # ---- compression ----

    def compress(self, contexts: list, rates: list | None = None, cache: dict | None = None) -> Memory:
        """Compress a batch of contexts (lists of encoder token ids) into one Memory.
        rates: group_mean only, one compression rate per context (default: sampled from cfg.ratios).
        cache: a dict that keeps each chunk's memory under the hash of what it depends on (its ids, its slots and,
        for EPL/UPL, its position): a chunk seen before is not encoded again (CompLLM §1 "reusability": a context
        shared by several queries is compressed once). For evaluation; gradients do not flow through it."""
        if any(len(c) == 0 for c in contexts):
            raise ValueError("cannot compress an empty context")
        if self.cfg.bos:   # ICAE / EPL code: context = [BOS] + x (BOS is the first token of chunk 0)
            contexts = [[self._bos_id(self.enc_tok)] + list(c) for c in contexts]
        if self.cfg.source == "group_mean":
            return self._compress_merge(contexts, rates)
        return self._compress_mem(contexts, cache)

    def _compress_mem(self, contexts: list, cache: dict | None) -> Memory:
        cfg, enc, dev = self.cfg, self.encoder, self.device
        rows = self._chunk_rows(contexts, lambda b, n: self.num_mem(n))   # (sample, chunk, ids, slots, start)
        span = None if cfg.cap_mem else cfg.chunk_len   # EPL code: UPL over the nominal chunk even when short
        keys = [self._cache_key(chunk, m, start) for _, _, chunk, m, start in rows] if cache is not None else None
        todo = [r for r in range(len(rows)) if cache is None or keys[r] not in cache]

        # 1. every chunk not cached is one row of the encoder batch: [chunk (n), memory (m), pad]
        out = None
        if todo:
            R, T = len(todo), max(len(rows[r][2]) + rows[r][3] for r in todo)
            pad = self.enc_tok.pad_id if self.enc_tok.pad_id is not None else 0
            ids, pos = [[pad] * T for _ in range(R)], [[0] * T for _ in range(R)]
            slot, row_masks = [[0] * T for _ in range(R)], []
            for j, r in enumerate(todo):
                _, i, chunk, m, start = rows[r]
                n = len(chunk)
                ids[j][:n] = chunk
                if cfg.source == "eos":
                    ids[j][n:n + m] = [self.enc_tok.eos_id] * m     # CompLLM §3: ceil(n/C) EOS embeddings
                ctx_pos, mem_pos = positions.encoder_positions(cfg.layout, i, n, m, offset=start,
                                                               span=span and max(span, n))
                pos[j][:n + m] = ctx_pos.tolist() + mem_pos.tolist()
                slot[j][n:n + m] = range(1, m + 1)                   # 1 + memory slot index; 0 = not a memory slot
                # PIC Eq. (5) or the ordinary causal mask over [chunk, memory]
                row_masks.append(masks.pic(n, m) if cfg.mask == "pic" else masks.full_causal(n, m))
            ids, pos = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
            attn = masks.stack_padded(row_masks, T).to(dev)          # (R, T, T); padding sees only itself
            x = enc.model.embed_tokens(ids)                          # (R, T, d_enc)
            if cfg.source == "mem_tokens":
                slot = torch.tensor(slot, device=dev)
                is_mem = (slot > 0)[..., None]
                x = torch.where(is_mem, self.mem_tokens[(slot - 1).clamp(min=0)].to(x.dtype), x)
            with self.encoding():
                out = enc(inputs_embeds=x, position_ids=pos, attn_mask=attn, return_kv=cfg.carrier == "kv",
                          compute_logits=False)
            # the memory slots of each encoded row: flat indices into (R*T)
            where = {r: [j * T + len(rows[r][2]) + s for s in range(rows[r][3])] for j, r in enumerate(todo)}
            flat = torch.tensor(sum(where.values(), []), device=dev)
            if cfg.carrier == "kv":   # (R, Hkv, T, D) -> (R*T, Hkv, D) -> the slots (S, Hkv, D)
                fresh = [tuple(t.transpose(1, 2).reshape(R * T, t.shape[1], t.shape[3])[flat] for t in kv)
                         for kv in out.kv]
            else:                     # (R, T, d_enc) -> the slots (S, d_enc), final norm applied (ICAE)
                fresh = out.last_hidden.reshape(R * T, -1)[flat]
            enc_pos = pos.reshape(-1)[flat]
            new = self._split_rows(todo, [rows[r][3] for r in todo], fresh, enc_pos)
            if cache is not None:
                cache.update({keys[r]: new[r] for r in todo})
        parts = {r: (cache[keys[r]] if cache is not None and r not in todo else new[r]) for r in range(len(rows))}

        # 2. each sample's slots, chunk after chunk, right-padded to [B, M]
        B = len(contexts)
        chunk_lens, counts = [[] for _ in range(B)], [[] for _ in range(B)]
        for b, _, chunk, m, _ in rows:
            chunk_lens[b].append(len(chunk))
            counts[b].append(m)
        per_sample = [[parts[r] for r in range(len(rows)) if rows[r][0] == b] for b in range(B)]
        M = max(sum(c) for c in counts)
        host_valid = torch.tensor([[j < sum(c) for j in range(M)] for c in counts])
        valid = host_valid.to(dev)
        pad_to = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, M - t.shape[0]))   # pad dim 0 to M
        enc_pos = torch.stack([pad_to(torch.cat([p["pos"] for p in s])) for s in per_sample])
        if cfg.carrier == "kv":
            kv = []
            for layer in range(len(per_sample[0][0]["kv"])):
                k, v = ([pad_to(torch.cat([p["kv"][layer][t] for p in s])) for s in per_sample] for t in (0, 1))
                kv.append((torch.stack(k).transpose(1, 2), torch.stack(v).transpose(1, 2)))   # (B, Hkv, M, D)
            return Memory(None, kv, valid, enc_pos, chunk_lens, counts)
        h = torch.stack([pad_to(torch.cat([p["h"] for p in s])) for s in per_sample])           # (B, M, d_enc)
        return Memory(self._bridge(h, host_valid), None, valid, enc_pos, chunk_lens, counts)

    def _split_rows(self, todo, sizes, fresh, enc_pos) -> dict:
        """The encoded slots (S, ...) cut back into one entry per chunk row: {"h" or "kv", "pos"}."""
        out, start = {}, 0
        for r, m in zip(todo, sizes):
            cut = slice(start, start + m)
            if self.cfg.carrier == "kv":
                out[r] = {"kv": [(k[cut], v[cut]) for k, v in fresh], "pos": enc_pos[cut]}
            else:
                out[r] = {"h": fresh[cut], "pos": enc_pos[cut]}
            start += m
        return out

    def _cache_key(self, chunk: list, m: int, start: int) -> str:
        # a chunk's memory depends on its ids and slots, and under UPL/EPL on where it starts in its context
        where = start if self.cfg.layout != "dpl" else 0
        return hashlib.sha1(json.dumps([chunk, m, where]).encode()).hexdigest()

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

    def _compress_merge(self, contexts: list, rates: list | None) -> Memory:
        """GMSA §3.2: encode with the first k layers, mean-pool consecutive groups of r hidden states."""
        cfg, enc, dev = self.cfg, self.encoder, self.device
        if rates is None:   # GMSA §4.1: the compression rate is sampled per example
            rates = [cfg.ratios[i] for i in torch.randint(len(cfg.ratios), (len(contexts),)).tolist()]
        rows = self._chunk_rows(contexts, lambda b, n: math.ceil(n / rates[b]))   # groups per chunk
        R, T = len(rows), max(len(c) for _, _, c, _, _ in rows)
        G = max(g for _, _, _, g, _ in rows)
        pad = self.enc_tok.pad_id if self.enc_tok.pad_id is not None else 0
        ids = torch.tensor([c + [pad] * (T - len(c)) for _, _, c, _, _ in rows], device=dev)
        # GMSA §3.2: consecutive groups of size r; padding goes to a spare group G, dropped
        group = torch.tensor([[t // rates[b] if t < len(c) else G for t in range(T)] for b, _, c, _, _ in rows],
                             device=dev)
        lens = torch.tensor([len(c) for _, _, c, _, _ in rows])
        attn = masks.with_padding(masks.causal(T), torch.arange(T)[None] < lens[:, None]).to(dev)   # on the host
        with self.encoding():
            h = enc(ids, attn_mask=attn, compute_logits=False).last_hidden   # (R, T, d)
        # exact mean over each group (the last group may be shorter): sum, then divide by its size
        sums = torch.zeros(R, G + 1, h.shape[-1], device=dev, dtype=torch.float32)
        sums.scatter_add_(1, group[..., None].expand(-1, -1, h.shape[-1]), h.float())
        sizes = torch.zeros(R, G + 1, device=dev).scatter_add_(1, group, torch.ones_like(group, dtype=torch.float))
        means = (sums / sizes.clamp(min=1)[..., None]).to(h.dtype)[:, :G]           # (R, G, d)
        B = len(contexts)
        chunk_lens, counts = [[] for _ in range(B)], [[] for _ in range(B)]
        for b, _, chunk, g, _ in rows:
            chunk_lens[b].append(len(chunk))
            counts[b].append(g)
        M = max(sum(c) for c in counts)
        per_sample = [torch.cat([means[r, :rows[r][3]] for r in range(R) if rows[r][0] == b]) for b in range(B)]
        summary = torch.stack([F.pad(s, (0, 0, 0, M - len(s))) for s in per_sample])  # (B, M, d)
        host_valid = torch.tensor([[j < sum(c) for j in range(M)] for c in counts])
        enc_pos = torch.zeros(B, M, dtype=torch.long, device=dev)
        return Memory(self._bridge(summary, host_valid), None, host_valid.to(dev), enc_pos, chunk_lens, counts)

    def _bridge(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Map encoder outputs (B, M, d_enc) into the decoder's input space (B, M, d_dec); valid (B, M) on the host."""
        if self.cfg.bridge in ("linear", "mlp"):
            return self.bridge(h)
        if self.cfg.bridge == "lsa":
            # GMSA Eq. (3): the summary vectors pass through the LSA blocks (causal, positions 0..M-1);
            # their output residual stream (no final norm) is what the decoder's layer 0 reads
            attn = masks.with_padding(masks.causal(h.shape[1]), valid).to(h.device)
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
                      last_tokens: list | None = None, prefix: list | None = None, left_pad: bool = False) -> dict:
        """Decoder inputs for every sample: [prefix, memory, special token, follow tokens], padded.

        follow[b]: decoder token ids after the special token (AE: comp.ae_target(x); LM: the continuation + EOS;
        QA: prompt + answer + EOS). n_supervised[b]: the loss covers the last n of them (default all).
        last_tokens[b]: x_k, the last context token, for the PIC TC special token (Eq. 7). prefix[b]: decoder ids
        before the memory (a chat template's user header). PCC's delimiters add [BOS] first and wrap each chunk's
        memory in <mem> ... </mem>. Right padding for training, left padding (left_pad) for generation, so that
        every row's last token is its last real one.
        Returns inputs_embeds (B, T, d), position_ids (B, T), attn_mask (B, T, P+T) or None when nothing is
        padded, past_kv or None, targets (B, T) with -100 where no loss is taken.
        """
        return self._decoder_inputs(memory, task, follow, n_supervised, last_tokens, prefix, left_pad)[0]

    def _decoder_inputs(self, memory, task, follow, n_supervised=None, last_tokens=None, prefix=None, left_pad=False):
        """decoder_batch, and where its loss is taken as Python lists: (batch, (flat slot b*T + t of every
        supervised prediction, its token)). Kept on the host, so no step ever waits for the GPU to say where."""
        if task not in ("ae", "lm", "qa"):
            raise ValueError(f"unknown task '{task}': choose ae, lm or qa")
        cfg, embed, dev = self.cfg, self.decoder.model.embed_tokens, self.device
        kind = self.special_token(task)
        ids_of = lambda ids: embed(torch.tensor(ids, dtype=torch.long, device=dev))
        rows_x, rows_pos, rows_tgt = [], [], []
        for b, ids in enumerate(follow):
            counts = memory.mem_counts[b]
            x = []
            pre = ([self._bos_id()] if cfg.delimiters else []) + list(prefix[b] if prefix else [])
            if pre:
                x.append(ids_of(pre))
            if cfg.carrier == "embeds":
                starts = [sum(counts[:i]) for i in range(len(counts))]
                for s, m in zip(starts, counts):
                    block = [memory.embeds[b, s:s + m]]
                    if cfg.delimiters:   # PCC code: each segment's memory as <mem> m_1 .. m_k </mem>
                        block = [self.mem_open[None].to(embed.weight.dtype), *block,
                                 self.mem_close[None].to(embed.weight.dtype)]
                    x += block
            if kind != "none":
                vec = {"learned": lambda: (self.ae_embed if task == "ae" else self.lm_embed),
                       "bos": lambda: embed.weight[self._bos_id()],
                       "last": lambda: embed.weight[last_tokens[b]]}[kind]()
                x.append(vec[None].to(embed.weight.dtype))
            x.append(ids_of(ids))
            x = torch.cat(x)
            # EPL §3.2 / Tables 13-15: DPL numbers the inputs physically (after the k|M| cached slots of the KV
            # carrier); EPL (CPL) keeps the memory at its encoder positions, [AE] at 0 or [LM] at p, the text after
            p = positions.decoder_inputs(cfg.layout, cfg.carrier, task, memory.chunk_lens[b], counts,
                                         sum(memory.chunk_lens[b]), len(ids), span=None if cfg.cap_mem else cfg.chunk_len,
                                         n_prefix=len(prefix[b]) if prefix else 0, delimiters=cfg.delimiters,
                                         special=kind != "none")
            # the slot before a supervised token predicts it (next-token prediction)
            tgt = [-100] * len(x)
            first = len(x) - len(ids)                          # slot of follow[0]
            n_sup = len(ids) if n_supervised is None else n_supervised[b]
            for t in range(len(ids) - n_sup, len(ids)):
                if first + t - 1 >= 0:
                    tgt[first + t - 1] = ids[t]
            rows_x.append(x), rows_pos.append(p), rows_tgt.append(tgt)

        lens = [len(x) for x in rows_x]
        T = max(lens)
        pad = lambda row, n, value: ([value] * n + row) if left_pad else (row + [value] * n)
        rows_tgt = [pad(t, T - len(t), -100) for t in rows_tgt]
        supervised = [(b * T + t, tok) for b, row in enumerate(rows_tgt) for t, tok in enumerate(row) if tok != -100]
        x = torch.stack([F.pad(r, (0, 0, T - len(r), 0) if left_pad else (0, 0, 0, T - len(r)))
                         for r in rows_x])                                             # (B, T, d)
        pos = torch.tensor([pad(p, T - len(p), 0) for p in rows_pos], device=dev)      # (B, T)
        tgt = torch.tensor(rows_tgt, device=dev)                                       # (B, T)
        valid = [pad([True] * n, T - n, False) for n in lens]
        past_kv, P = None, 0
        if cfg.carrier == "kv":
            # 500x/AOC: the memory is a KV-cache prefix; its keys keep the encoder's RoPE positions
            past_kv, P = memory.kv, memory.valid.shape[1]
            valid = [[j < sum(memory.mem_counts[b]) for j in range(P)] + v for b, v in enumerate(valid)]
        # nothing padded: the mask is the model's default (prefix + causal), and passing None lets
        # SDPA use its fused causal kernel instead of the dense-mask one
        attn_mask = None
        if not all(all(v) for v in valid):   # built on the host, moved once
            attn_mask = masks.with_padding(masks.with_prefix(masks.causal(T), P), torch.tensor(valid)).to(dev)
        batch = dict(inputs_embeds=x, position_ids=pos, attn_mask=attn_mask, past_kv=past_kv, targets=tgt)
        return batch, supervised

    def _supervised(self, memory, task, follow, n_supervised, last_tokens, prefix):
        """The decoder's final hidden states at the slots that predict a supervised token, and those tokens:
        (h (N, d), targets (N,), row of each (N,)). Logits are never made for every position: B*T*vocab would
        dwarf everything else."""
        batch, supervised = self._decoder_inputs(memory, task, follow, n_supervised, last_tokens, prefix)
        batch.pop("targets")
        with self.decoding():
            h = self.decoder(**batch, compute_logits=False).last_hidden                # (B, T, d)
        T, dev = h.shape[1], h.device
        flat = torch.tensor([i for i, _ in supervised], dtype=torch.long, device=dev)
        tgt = torch.tensor([t for _, t in supervised], dtype=torch.long, device=dev)
        return h.reshape(-1, h.shape[-1])[flat], tgt, flat // T                      # (N, d), (N,), (N,)

    def lm_loss(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
                last_tokens: list | None = None, prefix: list | None = None, normalize_by: int | None = None):
        """Cross-entropy of the frozen decoder on the supervised follow tokens, given the memory.
        AE: ICAE's autoencoding / PIC Eq. (6) TR; LM: PIC Eq. (7) TC; QA: answer-only fine-tuning.
        Returns (loss, number of supervised tokens): the mean over these tokens, or their summed NLL divided by
        normalize_by (train.py passes the count of its whole step, so that micro-batches and processes add up to
        the step's mean, whatever their sizes)."""
        h, tgt, _ = self._supervised(memory, task, follow, n_supervised, last_tokens, prefix)
        # in chunks of positions, each chunk's fp32 logits recomputed in backward instead of kept (model.py)
        return chunked_cross_entropy(h, self.decoder.lm_head, tgt) / (normalize_by or max(len(tgt), 1)), len(tgt)

    def supervised_tokens(self, task: str, follow: list, n_supervised: list | None = None,
                          prefix: list | None = None) -> int:
        """How many tokens lm_loss supervises for these samples, counted without running anything: the last
        n_supervised[b] follow tokens of each, except a first follow token that nothing precedes in the decoder
        input (a K/V memory with no special token and no prefix: no slot predicts it)."""
        alone = self.cfg.carrier == "kv" and not self.cfg.delimiters and self.special_token(task) == "none"
        total = 0
        for b, ids in enumerate(follow):
            n = len(ids) if n_supervised is None else n_supervised[b]
            total += n - int(alone and not (prefix and prefix[b]) and 0 < n == len(ids))
        return total

    @torch.no_grad()
    def nll(self, memory: Memory, task: str, follow: list, n_supervised: list | None = None,
            last_tokens: list | None = None, prefix: list | None = None) -> tuple:
        """Per sample: (summed NLL, number of supervised tokens), as Python lists, for evaluation."""
        h, tgt, row = self._supervised(memory, task, follow, n_supervised, last_tokens, prefix)
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
        dec, dev = self.decoder, self.device
        B = len(contexts)
        prefix = prefix or [[] for _ in range(B)]
        dec_contexts = dec_contexts or contexts
        # teacher: [prefix, context, question, answer] as plain tokens, no gradient, the unmodified LLM
        rows = [list(p) + list(c) + list(q) + list(a) for p, c, q, a in zip(prefix, dec_contexts, questions, answers)]
        T = max(map(len, rows))
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
        valid = torch.tensor([[j < len(r) for j in range(T)] for r in rows])
        with torch.no_grad(), self.decoding():
            teacher = dec(ids, attn_mask=masks.with_padding(masks.causal(T), valid).to(dev),
                          output_hidden_states=True, compute_logits=False).hidden_states
        # student: [prefix, CEs, question, answer] (no special token: the LLM reads CEs like token embeddings)
        memory = self.compress(contexts)
        follow = [list(q) + list(a) for q, a in zip(questions, answers)]
        batch, supervised = self._decoder_inputs(memory, "qa", follow, [len(a) for a in answers], prefix=prefix)
        batch.pop("targets")
        with self.decoding():
            student = dec(**batch, output_hidden_states=True, compute_logits=False).hidden_states
        T = batch["inputs_embeds"].shape[1]
        loss = 0.0
        for b, a in enumerate(answers):
            at_t = slice(len(rows[b]) - len(a), len(rows[b]))      # the answer's own slots in the teacher ...
            # ... and in the student: the slot after each one that predicts an answer token (right-padded rows)
            first = min(i for i, _ in supervised if i // T == b) % T + 1
            at_s = slice(first, first + len(a))
            example = 0.0
            for layer in range(1, len(teacher)):                   # ℓ = 1..L (0 is the embedding layer)
                h, h_s = teacher[layer][b, at_t].float(), student[layer][b, at_s].float()
                sigma = h.std()                                    # CompLLM Eq. (2): this example's teacher Std
                example = example + F.smooth_l1_loss(h_s, h, beta=1.0) / sigma   # Eq. (1), mean over t∈A, j≤d
            loss = loss + example / (normalize_by or B)            # Eq. (3): the expectation over examples
        return loss, sum(len(a) for a in answers)

    @torch.no_grad()
    def generate(self, memory: Memory, task: str, prompt: list | None = None, max_new_tokens: int = 64,
                 last_token: list | None = None, prefix: list | None = None) -> list:
        """Greedy decoding for a batch of memories after [prefix, memory, special, prompt]; rows are left-padded,
        so each continues from its own last token. prompt / last_token / prefix: one entry per sample.
        Returns one list of ids per sample, cut before the first EOS."""
        B = memory.valid.shape[0]
        prompts = [list(p) for p in prompt] if prompt is not None else [[] for _ in range(B)]
        batch = self.decoder_batch(memory, task, prompts, [0] * B, last_token, prefix, left_pad=True)
        batch.pop("targets")
        with self.decoding():
            out = self.decoder.generate(**batch, max_new_tokens=max_new_tokens, eos_id=self.tok.eos_ids or None)
        stop = set(self.tok.eos_ids)
        cut = lambda ids: next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)
        return [cut(row) for row in out.tolist()]

    # ---- what is trained, saved and loaded ----

    def trainable_parameters(self) -> list:
        return [p for p in self.parameters() if p.requires_grad]

    def _saved(self, name: str) -> bool:
        """Exactly what is not rebuilt from the base model(s): everything of the compressor's own (memory and
        special tokens, bridge, LSA blocks, a fully trained encoder), the LoRA matrices of a LoRA'd encoder (its
        base weights are the LLM's), and the decoder's q/k/v after KEFT. Tensors an encoder or LSA copy
        shares with the decoder (its embedding) carry decoder.* names and are not saved."""
        if name.startswith("decoder."):
            return "lora_" in name or (self.cfg.decoder_train == "keft" and
                                       any(f"self_attn.{m}." in name for m in ("q_proj", "k_proj", "v_proj")))
        if name.startswith("encoder.") and self.cfg.encoder in ("lora", "first_k"):
            return "lora_" in name
        return True

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


# what an encoder or LSA copy takes from the decoder instead of copying (model.copy_model)
SHARED = ("model.embed_tokens", "lm_head")


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


def load(ckpt_dir: str, dtype=torch.float32, device="cpu", trained=True) -> Compressor:
    """Rebuild a compressor from a checkpoint: base model(s) from the config, trained tensors on top.
    trained=False: the same compressor as first built, untrained (seeding torch as the run did reproduces its init)."""
    meta = read_checkpoint_config(ckpt_dir)
    cfg = CompressorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()})
    decoder, tok = load_pretrained(cfg.model, dtype=dtype, device=device)
    encoder, enc_tok = None, None
    if cfg.encoder == "separate" and cfg.compressor_model:
        encoder, enc_tok = load_pretrained(cfg.compressor_model, dtype=dtype, device=device)
    comp = Compressor(cfg, decoder, tok, encoder, enc_tok)
    if not trained:
        return comp
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
