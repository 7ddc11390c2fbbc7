"""
What each method is: the compressor's settings (CompressorConfig, one field per axis, with each flag's help and
choices), the papers' presets (PRESETS: each method's settings and training recipe, with the sources both follow), and
make_config, the one way a preset becomes a validated config.

    python presets.py                                # the presets as the README's method table
    presets.make_config("pic", mem=8)                # PCC's settings, PIC's mask, 8 memory slots per chunk

compressors.py holds the machinery these settings drive; cli.py turns the recipes into a run's settings (what the
tiny demo changes, and where each value comes from).
"""

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Mapping, NamedTuple

import masks


# -----------------------------------------------------------------------------
# configuration: one dataclass, one field per axis, and the papers' presets

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


def axis(default, help, choices=None, **meta):
    """A config field that train.py exposes as a flag (--name-with-dashes): its help and choices live here only."""
    return field(default=default, metadata=dict(help=help, choices=choices, **meta))


@dataclass
class CompressorConfig:
    method: str = "icae"            # the preset this config started from
    model: str = "tiny"             # the decoder LLM (HF id, local dir or "tiny")
    compressor_model: str = ""      # encoder="separate": the compressor LLM ("" = a copy of the decoder)
    decoder_train: str = "none"     # "none" | "keft" (GMSA stage 2: decoder q/k/v train; train.py --stage)
    # --- encoder weights ---
    encoder: str = axis("lora", "encoder weights: LoRA on the decoder (ICAE, 500x, CompLLM; with --mlp aoc or none, "
                        "on an MLP-free copy: AOC's LoRA-AOC), a trained copy (AOC), a separate LLM (PCC/PIC) or "
                        "the first k layers with LoRA (GMSA)", ("lora", "full", "separate", "first_k"))
    mlp: str = axis("swiglu", "encoder blocks: with MLP, AOC Eq. 3, or without the sub-block", ("swiglu", "aoc", "none"))
    lora_r: int = axis(128, "LoRA rank (EPL 128, CompLLM 32)")
    lora_alpha: int = axis(256, "LoRA alpha; the update is scaled by alpha / r (EPL 256)")
    lora_dropout: float = axis(0.0, "dropout on the LoRA branch (PEFT; ICAE, AOC's LoRA baselines: 0.05)")
    lora_targets: tuple = axis(("q_proj", "v_proj"), "linear layers that get LoRA (EPL: q_proj v_proj; AOC's "
                               "baselines: q_proj k_proj v_proj o_proj)", item=str, metavar="NAME")
    enc_layers: int = axis(0, "first_k encoder: layers kept (0 = a quarter of the decoder's; GMSA: 8 of 32)")
    # --- memory source ---
    source: str = axis("mem_tokens", "what becomes the memory: learned memory tokens (ICAE, 500x, PCC/PIC, AOC), "
                       "EOS embeddings (CompLLM), group means (GMSA)", ("mem_tokens", "eos", "group_mean"))
    # One concept, the compression ratio r = context tokens per memory vector, set one of three ways: a fixed budget
    # (mem, the ratio follows from chunk_len), a ratio (ratio), or GMSA's group sizes (ratios). make_config maps
    # them onto each other in two documented cases only (see its docstring; the flags' help says the same).
    mem: int = axis(102, "memory tokens per chunk, a fixed budget (EPL: 102 per 510; AOC: 1, 4 or 16); on a preset "
                    "with a --ratio (CompLLM) --mem without --ratio sets the ratio to 0")
    ratio: float = axis(0.0, "compression ratio r > 0: a chunk of n tokens gets ceil(n / r) memory slots instead of "
                        "--mem (CompLLM C = 2); 0: the fixed --mem. On group merging (GMSA) --ratio R means "
                        "--ratios R, one fixed group size")
    ratios: tuple = axis((4, 8), "group merging (GMSA): the compression ratios r (group sizes) one of which is "
                         "sampled per example (GMSA §4.1: 4 8)", item=int, metavar="R")
    mem_init: str = axis("embed", "how memory and learned special tokens are drawn: N(mean, std) of the embedding "
                         "table, scalars (EPL code), N(0, 1) (ICAE, 500x, AOC code) or N(0, 0.02) (PCC code: new "
                         "vocabulary rows)", ("embed", "normal", "hf"))
    cap_mem: bool = axis(False, "ours: a chunk shorter than --mem gets as many slots as tokens (the papers' code "
                         "gives it all --mem)")
    mem_from_text: bool = axis(False, "ours, a lever against the collapse of the memory to one prompt: each memory "
                               "token's encoder input is the learned token plus the mean embedding of its segment of "
                               "the chunk (slot j of m: the j-th of m contiguous segments); the papers start every "
                               "text's memory from the same learned tokens")
    # --- cutting the context ---
    chunking: str = axis("fixed", "chunks of --chunk-len, or CompLLM's sentence segments of at most --chunk-len "
                         "tokens", ("fixed", "sentences"))
    chunk_len: int = axis(510, "context tokens per chunk (EPL: L = 510; CompLLM: segment length S)")
    bos: bool = axis(False, "the context BOS: every context starts with [BOS], and AE reconstructs [BOS] X [EOS] "
                     "(ICAE, EPL code); not the [BOS] of --ae-token bos nor the delimiters' leading [BOS]")
    # --- encoder attention and positions ---
    mask: str = axis("causal", "encoder mask over [chunk, memory]: ordinary causal, or PIC Eq. 5 (masks.ENCODER)",
                     tuple(masks.ENCODER))
    layout: str = axis("dpl", "position layout of memory tokens (EPL §3.2, positions.py); only for methods with "
                       "memory tokens", ("dpl", "upl", "epl"))
    # --- what reaches the decoder ---
    carrier: str = axis("embeds", "final hidden states as input embeddings (ICAE) or per-layer K/V as a cache "
                        "prefix (500x, AOC)", ("embeds", "kv"))
    bridge: str = axis("none", "encoder -> decoder map (CompLLM linear, PCC/PIC MLP converter, GMSA LSA)",
                       ("none", "linear", "mlp", "lsa"))
    mem_norm: bool = axis(False, "ours, a diagnostic (no paper does it): each memory vector rescaled to the mean norm "
                          "of the decoder's token embeddings before the decoder reads it (ICAE's final-norm hidden "
                          "states are ~20x larger on SmolLM2)")
    lsa_layers: int = axis(1, "LSA bridge: decoder blocks copied (GMSA: j = 1 suffices)")
    delimiters: bool = axis(False, "PCC code: the decoder input opens with a leading [BOS], then each chunk's memory "
                            "between <mem> and </mem>")
    # the special token after the memory (special_token, Compressor.special_embedding); the two field names are kept
    # because checkpoints store them
    ae_token: str = axis("learned", "the special token after the memory for AE: a learned [AE] (ICAE, EPL), [BOS] as "
                         "the special token (500x, AOC) or nothing", ("learned", "bos", "none"))
    lm_token: str = axis("learned", "the special token after the memory for LM and QA: a learned [LM] (EPL), [BOS], "
                         "x_k (PIC Eq. 7) or nothing (CompLLM)", ("learned", "bos", "last", "none"))
    train_specials: bool = axis(True, "learned [AE]/[LM] and delimiters train (PCC code keeps them random and "
                                "frozen with the decoder)")
    template: str = axis("plain", "QA prompt around context and question (TEMPLATES; chat: the model's own)",
                         ("plain", "pcc", "epl", "chat", *CHAT_MARKERS))


FLAG_FIELDS = tuple(f for f in fields(CompressorConfig) if "help" in f.metadata)   # train.py's compressor flags
CHOICES = {f.name: f.metadata["choices"] for f in FLAG_FIELDS if f.metadata["choices"]}
CHOICES["decoder_train"] = ("none", "keft")


def recipe_field(help):
    """A Recipe field: train.py's default for the flag of the same name, with its help."""
    return field(metadata=dict(help=help))


@dataclass(frozen=True)
class Recipe:
    """A paper's training recipe: train.py's defaults for the flags of the same names (any flag overrides them).
    Frozen, and its per-objective changes are read-only mappings: no preset can change another's recipe."""
    objective: str = recipe_field("the default --objective: pretrain, ae, qa or distill")
    lr: float = recipe_field("AdamW peak learning rate")
    betas: tuple = recipe_field("AdamW (β1, β2)")
    weight_decay: float = recipe_field("AdamW weight decay")
    schedule: str = recipe_field("learning-rate schedule after warmup: constant, cosine or linear")
    warmup: int = recipe_field("linear warmup steps")
    batch_size: int = recipe_field("examples per optimizer step")
    clip: float = recipe_field("gradient-norm clip")
    steps: int = recipe_field("optimizer steps")
    lengths: tuple = recipe_field("(shortest, longest) text |X| in tokens (pretrain compresses the first half, ae all "
                                  "of it)")
    lm_weight: float = recipe_field("α (EPL) / λ (PIC Eq. 8): pretrain's loss is α·LM + (1-α)·AE")
    crop: str = recipe_field("where a text is cut from its document: window (anywhere) or head (its first tokens)")
    per_objective: Mapping = recipe_field("objective -> the recipe values that change for it (qa: fine-tuning)")
    sources: Mapping = recipe_field("where a value comes from when it is not the paper's: field (or objective.field, "
                                    "for a per_objective value) -> 'code' (the paper's public code) or 'ours'")


def readonly(**kw) -> MappingProxyType:
    """A read-only dict (a preset's values are never shared mutably with another preset)."""
    return MappingProxyType(dict(kw))


NOTHING = readonly()   # an objective that changes no compressor setting


class Preset(NamedTuple):
    """One method: the compressor settings its paper's code uses, its training recipe, and the sources both follow.
    "ours" marks a value the paper and its code do not give."""
    cite: str               # the paper section or code this preset follows
    compressor: Mapping     # CompressorConfig fields that differ from the defaults
    recipe: Recipe          # train.py's defaults
    # objective -> compressor settings that --objective changes too, e.g. the original 500x code's AE-only setup
    # regenerates from [BOS]: train.py's --help and a run's first log line name them
    objective_compressor: Mapping = readonly()

    def compressor_for(self, objective: str) -> Mapping:
        """The compressor fields --objective `objective` sets on top of `compressor` (empty for most)."""
        return self.objective_compressor.get(objective, NOTHING)


def derive(base: Preset, cite: str, compressor=readonly(), objective_compressor=readonly(), recipe=None) -> Preset:
    """A preset that is `base` plus a few changes (new read-only mappings; `base` is never touched)."""
    return Preset(cite, readonly(**{**base.compressor, **compressor}), recipe or base.recipe,
                  readonly(**{**base.objective_compressor, **objective_compressor}))


# EPL App. C, Table 8 and code (ICAE continued pretraining, 1B/3B): AdamW β=(0.9, 0.95), wd 0.1, lr 1e-4 pretrain /
# 5e-5 fine-tune, constant schedule, warmup 300, batch 16, 20k steps, clip 2.0; |X| ∈ [510, 2040], α = 0.5 (the code
# averages the two losses 1:1)
EPL_RECIPE = Recipe(objective="pretrain", lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, schedule="constant",
                    warmup=300, batch_size=16, clip=2.0, steps=20000, lengths=(510, 2040), lm_weight=0.5, crop="window",
                    per_objective=readonly(qa=readonly(lr=5e-5)), sources=readonly(crop="ours"))
# ICAE as the EPL code runs it: LoRA r=128 α=256 on q,v; 102 memory tokens per 510-token chunk, drawn from N(μ, σ) of
# the embedding table; the context starts with [BOS]; learned [AE]/[LM]; EPL's QA template
ICAE = Preset("ICAE as EPL's code runs it (EPL App. C, Table 8)", readonly(bos=True, template="epl"), EPL_RECIPE)
# PCC code (PIC §3.4 follows it): a separate, fully fine-tuned compressor LLM, ordinary causal mask, 256-token segments
# with 16 memory slots each (16x, PIC Table 4), memory tokens as new vocabulary rows N(0, 0.02); decoder input
# [BOS, <mem> m.. </mem>, ...] with random, frozen <mem>/</mem>/<ae>; RMSNorm -> Linear -> GELU -> Linear converter;
# TR after <ae> (PIC Eq. 6), TC after x_k (PIC Eq. 7); its QA prompt. Recipe: AdamW β=(0.9, 0.999), wd 0, lr 1e-4
# (PIC §4.1.2 too), cosine after 300 warmup steps, clip 0.5, batch 256; 256-token texts to compress (|X| = 512:
# p = 256, then its continuation); QA: lr 5e-5, cosine, warmup 100, batch 128; steps: one epoch in the paper (ours: 20k)
PCC = Preset("PCC code (PIC §3.4 follows it)",
             readonly(encoder="separate", mem=16, chunk_len=256, bridge="mlp", mem_init="hf", delimiters=True,
                    lm_token="last", train_specials=False, template="pcc"),
             Recipe(objective="pretrain", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, schedule="cosine", warmup=300,
                    batch_size=256, clip=0.5, steps=20000, lengths=(512, 512), lm_weight=0.5, crop="window",
                    per_objective=readonly(qa=readonly(lr=5e-5, warmup=100, batch_size=128)),
                    sources=readonly(**{k: "code" for k in ("betas", "weight_decay", "schedule", "warmup", "batch_size",
                                                          "clip", "lengths", "crop", "qa.lr", "qa.warmup",
                                                          "qa.batch_size")}, steps="ours")))

PRESETS = {
    "icae": ICAE,
    # 500xCompressor as EPL's 500xCompressor branch runs it: as ICAE, but the decoder gets the memory tokens'
    # per-layer K/V; learned [AE]/[LM] too, since under joint AE+LM pretraining a [BOS] for both would give the decoder
    # one prefix for "reconstruct" and "continue". --objective ae: the original 500xCompressor code
    # (train_500xCompressor.py): AE only from [BOS], memory tokens N(0, 1), no BOS in the context, LoRA r 64, α 32,
    # dropout 0.05 (PEFT's default q, v), lr 1e-4, HF Trainer's AdamW (wd 0, clip 1.0), constant after 300 warmup
    # steps, texts cut to their first 500 tokens
    "500x": derive(ICAE, "EPL's 500xCompressor branch (EPL App. C); --objective ae: the 500xCompressor code",
                   compressor=readonly(carrier="kv"),
                   objective_compressor=readonly(ae=readonly(ae_token="bos", lm_token="bos", mem_init="normal",
                                                             bos=False, lora_r=64, lora_alpha=32, lora_dropout=0.05,
                                                             template="plain")),
                   recipe=replace(EPL_RECIPE, per_objective=readonly(
                       qa=readonly(lr=5e-5),
                       ae=readonly(betas=(0.9, 0.999), weight_decay=0.0, clip=1.0, lengths=(500, 500), crop="head")),
                       sources=readonly(**EPL_RECIPE.sources, **{f"ae.{k}": "code" for k in (
                           "betas", "weight_decay", "clip", "lengths", "crop")}))),
    "pcc": PCC,
    # PIC: PCC with the block-wise causal mask and nothing else changed (PIC §4.3 ablation)
    "pic": derive(PCC, "PIC §3.3, Eq. 4-5, on PCC's code", compressor=readonly(mask="pic")),
    # CompLLM: LoRA r=32 on the LLM; segments of <= S = 20 tokens; ceil(n/C) EOS embeddings per segment with C = 2;
    # one linear layer; the question follows the CEs directly, in the model's chat format (§3, §4.1). Recipe (§4.1):
    # Adam (AdamW, weight decay 0), lr 1e-4, batch 4, "until convergence"; schedule, warmup, clip, steps and the |X|
    # range for --objective pretrain/ae are ours
    "compllm": Preset("CompLLM §3, §4.1 (no public code)",
                      readonly(lora_r=32, lora_alpha=64, source="eos", chunking="sentences", chunk_len=20, ratio=2.0,
                             bridge="linear", ae_token="none", lm_token="none", template="chat"),
                      Recipe(objective="distill", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, schedule="constant",
                             warmup=0, batch_size=4, clip=1.0, steps=20000, lengths=(510, 2040), lm_weight=0.5,
                             crop="window", per_objective=readonly(), sources=readonly(**{k: "ours" for k in (
                                 "schedule", "warmup", "clip", "steps", "lengths", "lm_weight", "crop")}))),
    # GMSA: first k layers + LoRA; mean of groups of r last hidden states, r in {4, 8} per example; one LSA block
    # initialised from decoder layer 0; reconstruct after [AE] (§3.2-3.4); texts <= 512 tokens (PwC, §4.1), QA contexts
    # up to 3072. App. C, Table 3: AdamW, linear schedule, clip 2.0, batch 4 (AE) / 16 (KEFT); 10k AE / 5k KEFT steps.
    # Its learning rates are not legible in our copy of the paper: 1e-4 (AE) / 1e-5 (KEFT) are ours, as are betas,
    # weight decay (PyTorch's AdamW defaults), warmup, and the shortest text.
    # bos=True: GMSA trains LLaMA-2-7B, whose Hugging Face tokenizer adds <s> to every text by default
    # (add_bos_token), so its encoder reads <s> x. Measured at our scale, it does not decide it either way: without
    # [BOS] the memory loses the first token (gmsa.sh 1:1, 1,000 steps: AE loss 10.47 on it, 0.026 on the rest); with
    # it, gmsa.sh's 1:1 flags recover it at 300 steps (3.58 / 0.139, own/other 0.039 vs 0.138), the ladder's 1:1
    # flags do not (12.50 / 3.28, own/other 0.653 vs 0.551): recipes/README.md, the lever phase
    "gmsa": Preset("GMSA §3.2-3.5, App. C Table 3 (no public code)",
                   readonly(encoder="first_k", lora_r=64, lora_alpha=128, source="group_mean", chunk_len=512,
                          bridge="lsa", lm_token="none", bos=True),
                   Recipe(objective="ae", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, schedule="linear", warmup=300,
                          batch_size=4, clip=2.0, steps=10000, lengths=(256, 512), lm_weight=0.5, crop="window",
                          per_objective=readonly(qa=readonly(lr=1e-5, batch_size=16, steps=5000, lengths=(256, 3072))),
                          sources=readonly(**{k: "ours" for k in ("lr", "betas", "weight_decay", "warmup", "lengths",
                                                                "lm_weight", "crop", "qa.lr", "qa.lengths")}))),
    # AOC code: the decoder with every MLP replaced by the identity, fully trained, embedding the prompt with the frozen
    # LLM's table; 16 memory tokens drawn from N(0, 1); K/V carrier as 500x; regenerate from [BOS] (§2). Recipe
    # (pretrain_and_eval.py, HF Trainer defaults): AdamW β=(0.9, 0.999), wd 0, 300 warmup steps to lr 2e-4 (the paper;
    # the code's default is 5e-4), then constant; clip 1.0; batch 16; one model per prompt length n: every text is the
    # first n tokens of a document (head crop), n = 96 in the code; 300k abstracts at batch 16 = 18,750 steps
    "aoc": Preset("AOC §2 and its code (pretrain_and_eval.py)",
                  readonly(encoder="full", mlp="aoc", mem=16, chunk_len=512, carrier="kv", ae_token="bos",
                         lm_token="bos", mem_init="normal"),
                  Recipe(objective="ae", lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0, schedule="constant",
                         warmup=300, batch_size=16, clip=1.0, steps=18750, lengths=(96, 96), lm_weight=0.5,
                         crop="head", per_objective=readonly(), sources=readonly(
                             **{k: "code" for k in ("betas", "weight_decay", "schedule", "clip", "batch_size",
                                                    "lengths", "crop")}, steps="ours", lm_weight="ours"))),
}
METHODS = tuple(PRESETS)


def make_config(method: str, defaults: dict | None = None, **overrides) -> CompressorConfig:
    """The preset `method` with `overrides` (None values are ignored) applied on top, validated. `defaults`: settings
    that replace the preset's own without counting as given (train.py: a recipe row's, the tiny demo's), so the
    mappings below read the overrides only (the demo's CompLLM ratio 1 is not a typed --ratio).
    Two documented mappings between the three settings of the compression ratio (ratio_mapping; their flags' help
    says the same):
      * `mem` given without `ratio`: a fixed budget, so a preset's ratio (CompLLM's C = 2) becomes 0;
      * `ratio` R > 0 on group merging (GMSA): its one compression ratio, i.e. ratios = (R,) and ratio = 0."""
    if method not in PRESETS:
        raise ValueError(f"unknown method '{method}': choose one of {', '.join(METHODS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    known = {f.name for f in fields(CompressorConfig)}
    for k in overrides:
        if k not in known:
            raise ValueError(f"unknown compressor setting '{k}': known settings are {', '.join(sorted(known))}")
    values = {**PRESETS[method].compressor, **(defaults or {}), **overrides}
    values.update((k, v) for k, (v, _) in ratio_mapping(values, overrides).items())
    if "ratios" in values:   # group sizes are whole numbers of tokens
        values["ratios"] = tuple(int(r) if float(r).is_integer() else r for r in values["ratios"])
    for k in ("lora_targets", "ratios"):
        if k in values:
            values[k] = tuple(values[k])
    cfg = CompressorConfig(method=method, **values)
    validate(cfg)
    return cfg


def ratio_mapping(values: Mapping, given: Mapping) -> dict:
    """make_config's two mappings between mem, ratio and ratios, each changed setting with why (the label a run's
    first log line gives it): field -> (value, why). `values`: the settings before the mapping (preset, defaults and
    `given`); `given`: the settings the caller set (train.py: the typed flags)."""
    if "mem" in given and "ratio" not in given and values.get("ratio"):   # 1: a fixed budget, no ratio (so not 2)
        return {"ratio": (0.0, "--mem: a fixed budget")}
    if values.get("source") == "group_mean" and values.get("ratio", 0) > 0:   # 2: ratio R -> ratios (R,)
        return {"ratios": ((values["ratio"],), "--ratio"), "ratio": (0.0, "--ratio: as ratios")}
    return {}


def validate(cfg: CompressorConfig):
    """One-line errors for settings no method can run with."""
    for name, options in CHOICES.items():
        if getattr(cfg, name) not in options:
            raise ValueError(f"unknown {name} '{getattr(cfg, name)}': choose one of {', '.join(options)}")
    if cfg.source == "group_mean":
        if cfg.layout != "dpl":
            raise ValueError(f"--layout {cfg.layout} needs memory tokens; {cfg.method} merges hidden states "
                             "into groups and has none: drop --layout")
        if cfg.mask != "causal":
            raise ValueError(f"--mask {cfg.mask} needs memory tokens; {cfg.method} has none: drop --mask")
        if not cfg.ratios or any(not isinstance(r, int) or r < 1 for r in cfg.ratios):
            raise ValueError(f"group-merging ratios must be whole numbers >= 1, got {cfg.ratios}")
        if cfg.ratio > 0:
            raise ValueError("ratio does not apply to group merging: set ratios (one ratio per example)")
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
    if cfg.mem_from_text and cfg.source != "mem_tokens":
        raise ValueError(f"--mem-from-text adds a text's segment means to learned memory tokens, and {cfg.method} has "
                         f"none (source={cfg.source}): drop --mem-from-text")
    if cfg.carrier == "kv" and cfg.mem_norm:
        raise ValueError("--mem-norm rescales memory embeddings: the kv carrier has none (use --carrier embeds)")
    if cfg.carrier == "kv" and cfg.delimiters:
        raise ValueError("delimiters surround memory embeddings in the decoder input: they need --carrier embeds")
    if cfg.encoder in ("lora", "first_k") and cfg.lora_r < 1:
        raise ValueError(f"encoder {cfg.encoder} needs --lora-r >= 1, got {cfg.lora_r}")


def method_table() -> str:
    """The presets as the README's markdown table (`python presets.py`; a test keeps the README in step)."""
    rows = ["| method | follows | compressor settings (on CompressorConfig's defaults) | objective | lr | batch | steps "
            "| \\|X\\| |", "|---|---|---|---|---|---|---|---|"]
    for name, p in PRESETS.items():
        settings = ", ".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, tuple) else v}"
                             for k, v in p.compressor.items()) or "(the defaults)"
        r = p.recipe
        rows.append(f"| `{name}` | {p.cite} | {settings} | {r.objective} | {r.lr:.0e} | {r.batch_size} | "
                    f"{r.steps:,} | {r.lengths[0]}-{r.lengths[1]} |")
    return "\n".join(rows).replace("e-0", "e-")


if __name__ == "__main__":
    print(method_table())
