"""The decoder-only transformer every method compresses with and decodes with, written from scratch.

One `Transformer` covers the Hugging Face families the papers use: Llama, Qwen2, Qwen3 and Mistral, and Gemma 3's
text model from the parts in gemma3.py (its sandwich block, (1 + w) norms, scaled embedding and sliding window).
Module names are HF's (`model.layers.3.self_attn.q_proj`, ...), so a checkpoint loads by identity.

    h_0 = embed(x)                                   (or inputs_embeds: ICAE/GMSA soft tokens)
    h   = h + Attn(RMSNorm(h))                       RoPE on q, k (plain, linear, llama3, YaRN); causal or a given mask
    h   = h + SwiGLU(RMSNorm(h))                     SwiGLU(x) = down(silu(gate(x)) * up(x))
    logits = lm_head(RMSNorm(h_L))
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)       computed in fp32, like HF

Three switches serve the compression methods:
- `mlp="aoc"`: AOC Eq. (3), the MLP becomes the identity, so  h = LN_post(h) + h  (LN_post is kept,
  exactly what HF's LlamaDecoderLayer computes with `mlp = nn.Identity()`); `mlp="none"` removes the
  whole second sub-block (the ablation).
- `past_kv` / `return_kv`: the per-layer K/V carrier (500xCompressor, AOC). Cached keys keep the RoPE
  of the positions they were computed at.

Greedy `generate` decodes padded batches on a preallocated KV cache (as gpt-fast), masking padded keys on
every step (no mask when nothing is padded); each step's attention reads the cache in place (`sdpa`, one query
row). For training memory: `model.grad_ckpt = True` (activation checkpointing per block) and
`chunked_cross_entropy` (no (N, V) fp32 logits kept for backward).

Also here: load_pretrained (an HF folder, hub id or "tiny" -> model and tokenizer; the files are read by hf.py; on the
meta device only checked), weight_reader (the same weights one tensor at a time) and a tiny random model for tests.
LoRA lives in lora.py. Positions are explicit inputs everywhere: EPL moves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import gemma3
import masks
from hf import GEMMA_3_4B_CONFIG, LLAMA_2_7B_CONFIG, LLAMA_3_2_1B_CONFIG, LLAMA_3_8B_CONFIG, QWEN3_4B_CONFIG, \
    Tokenizer, byte_tokenizer, load_weights, read_json, resolve, tensor_reader
from lora import lora_as_now

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# the MLP's gate activation, by its HF name: SwiGLU for Llama/Qwen/Mistral, GeGLU with tanh-approximated GELU for
# Gemma (HF ACT2FN["gelu_pytorch_tanh"] is F.gelu(x, approximate="tanh"))
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# ---------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    arch: str                     # HF model_type: "llama" | "qwen2" | "qwen3" | "mistral" | "gemma3_text"
    vocab_size: int               # rows of embed_tokens and lm_head (may exceed the tokenizer's vocabulary)
    hidden_size: int              # d, width of the residual stream
    intermediate_size: int        # width of the gated MLP
    num_hidden_layers: int        # L, number of blocks
    num_attention_heads: int      # H, query heads
    num_key_value_heads: int      # Hkv, key/value heads (GQA: H is a multiple of Hkv)
    head_dim: int                 # D, explicit: Qwen3 has D != d / H, so never derive it when it is given
    rms_norm_eps: float           # eps inside every RMSNorm
    rope_theta: float             # RoPE base (Gemma 3: of the global layers)
    rope_scaling: dict | None     # None, or {"rope_type": "linear", factor} (Gemma 3 4B+: global layers only)
                                  # or {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
                                  #     original_max_position_embeddings}
                                  # or {"rope_type": "yarn", factor, original_max_position_embeddings, and any
                                  #     of attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate}
    max_position_embeddings: int  # context the checkpoint was trained for (informative: positions are not capped)
    tie_word_embeddings: bool     # lm_head.weight is the same Parameter as embed_tokens.weight
    attention_bias: bool          # q/k/v projections carry a bias (Qwen2 always; others when set, o_proj too)
    qk_norm: bool                 # Qwen3, Gemma 3: RMSNorm over D on every query and key head, before RoPE
    bos_token_id: int | None      # from config.json (the tokenizer resolves its own, see Tokenizer)
    eos_token_id: int | None      # first one if config.json lists several
    pad_token_id: int | None      # padding id, if the checkpoint declares one
    hidden_act: str = "silu"      # the MLP's gate activation (ACTIVATIONS): "silu" or Gemma's "gelu_pytorch_tanh"
    # --- Gemma 3 only (None elsewhere; gemma3.config_fields) ---
    layer_types: tuple | None = None         # per layer "sliding_attention" (local) or "full_attention" (global)
    sliding_window: int | None = None        # W: a local layer's query sees only itself and the W-1 slots before it
    rope_local_theta: float | None = None    # RoPE base of the local layers (rope_local_base_freq), never rescaled
    query_pre_attn_scalar: float | None = None  # scores are q·k / sqrt(this) instead of q·k / sqrt(D)
    mlp: str = "swiglu"           # "swiglu": the checkpoint's gated MLP (SwiGLU, or GeGLU for Gemma)
                                  # | "aoc" (AOC Eq. 3: MLP = identity, its norms kept)
                                  # | "none" (the whole second sub-block removed: the ablation)

    @property
    def gemma(self) -> bool:
        """Gemma 3's (1 + w) norms, four norms per block and sqrt(d)-scaled embeddings (gemma3.py)."""
        return self.arch == "gemma3_text"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF config.json (transformers v4 or v5 layout); fills in HF's defaults."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r} ({', '.join(hf.get('architectures') or [])}); "
                             f"supported model_type: {', '.join(SUPPORTED_ARCHS)}")
        gemma = arch in gemma3.MODEL_TYPES
        if gemma:
            hf, arch = gemma3.text_config(hf), "gemma3_text"
        act = hf.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {act!r}: only {', '.join(ACTIVATIONS)} gated MLPs "
                             f"are implemented")
        # Sliding-window attention of Mistral v0.1 and Qwen2 (use_sliding_window) is not implemented: it equals
        # full attention as long as a sequence fits in the window (4096+), which every setup here does.
        theta, scaling = _rope_parameters(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,  # absent = plain multi-head attention
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2's q/k/v biases are hard-wired in HF (no config field); the others read attention_bias.
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            qk_norm=arch in ("qwen3", "gemma3_text"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            hidden_act=act,
            mlp=hf.get("mlp", "swiglu"),  # not an HF field: written by to_hf() for AOC encoders
            **(gemma3.config_fields(hf) if gemma else {}),
        )

    def to_hf(self) -> dict:
        """An HF config.json dict (v4 layout, which transformers v5 reads too)."""
        hf = dict(architectures=[HF_CLASSES[self.arch]], model_type=self.arch,
                  vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                  num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                  num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                  rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                  max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
                  bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        if self.gemma:
            hf.update(gemma3.hf_fields(self))
        else:
            hf["hidden_act"] = self.hidden_act
        if self.arch != "qwen2":  # Qwen2 has no such field (see from_hf)
            hf["attention_bias"] = self.attention_bias
        if self.mlp != "swiglu":
            hf["mlp"] = self.mlp
        return hf


def _rope_parameters(hf: dict) -> tuple:
    """(rope_theta, the rope_scaling dict: None for plain RoPE, else the linear, llama3 or yarn parameters) from either
    config layout: transformers v5 keeps theta and scaling together in rope_parameters; v4 has rope_theta +
    rope_scaling. For Gemma 3 they are its global layers' RoPE (gemma3.text_config). An unsupported RoPE is a clear
    error."""
    rope = hf.get("rope_parameters")
    if rope is not None:
        theta, scaling = rope.get("rope_theta", 10000.0), {k: v for k, v in rope.items() if k != "rope_theta"}
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))  # v4 configs may say "type"
    if rope_type == "default":
        scaling = None
    elif rope_type == "linear":  # Gemma 3 4B/12B/27B's global layers: factor 8 (report §2, positional interpolation)
        scaling = {"rope_type": "linear", "factor": scaling["factor"]}
    elif rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
    elif rope_type == "yarn":
        # HF's defaults (standardize_rope_params, _compute_yarn_parameters): the original context is
        # max_position_embeddings, and a missing factor is the ratio of the two lengths
        max_len = hf.get("max_position_embeddings", 2048)
        old_len = scaling.get("original_max_position_embeddings") or max_len
        optional = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
        scaling = {"rope_type": "yarn", "factor": scaling.get("factor") or max_len / old_len,
                   "original_max_position_embeddings": old_len,
                   **{k: scaling[k] for k in optional if scaling.get(k) is not None}}
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default', 'linear', 'llama3' and 'yarn' RoPE "
                         f"are implemented")
    return theta, scaling


# ---------------------------------------------------------------------------- RoPE


def rope_frequencies(config: ModelConfig, device=None, local: bool = False) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/D), i < D/2, in fp32 (rescaled for linear / llama3 / yarn); same op order as HF,
    bit for bit. local=True: Gemma 3's sliding layers, base rope_local_theta and never rescaled (HF Gemma3TextConfig
    applies rope_scaling to the full_attention layers only)."""
    D = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    pos_freqs = theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)  # theta^(2i/D)
    inv_freq = 1.0 / pos_freqs
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        # positional interpolation (Chen et al. 2023): positions divided by `factor`, which is every frequency
        # divided by it (HF _compute_linear_scaling_rope_parameters: inv_freq /= factor)
        return inv_freq / s["factor"]
    if s["rope_type"] == "yarn":
        return _yarn_frequencies(config, pos_freqs)
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    # Llama 3.1 "llama3" scaling: long wavelengths are slowed down by `factor`, short ones kept, and the
    # band in between is interpolated smoothly.
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(config: ModelConfig, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN (Peng et al. 2023, §3.2 "NTK-by-parts"), as transformers' _compute_yarn_parameters: a frequency
    that turns more than beta_fast times over the original context is kept (extrapolated), one that turns
    fewer than beta_slow times is divided by `factor` (interpolated), and a linear ramp blends the band between."""
    s, theta, D = config.rope_scaling, config.rope_theta, config.head_dim
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1  # `or`: HF reads 0 as unset too

    def correction_dim(turns):  # the (fractional) pair index i whose frequency turns `turns` times in old_len tokens
        return (D * math.log(old_len / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):  # a config may set truncate=False to keep the fractional bounds
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(D // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # (D/2,): 1 = extrapolate (high frequencies, low i), 0 = interpolate (low frequencies)
    # the same expressions as HF (factor * theta^(2i/D), not inv_freq / factor), so the result is bit for bit
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (so q·k by its square): 0.1 ln(factor) + 1 (YaRN §3.4, "√(1/t)"),
    or the given attention_factor, or DeepSeek's mscale / mscale_all_dim ratio; 1 for every other RoPE."""
    s = config.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the 2-D rotation of each pair (x_i, x_{i+D/2}) by angle pos * inv_freq[i], in real arithmetic. HF's layout pairs
    # dimension i with i + D/2 (not 2i with 2i+1 like Meta's complex-number RoPE); checkpoints converted to HF have
    # their q/k rows permuted to match, so we must pair the same way (HF rotate_half)
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------------------- blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics even for bf16 activations (as HF): mean(x^2) in bf16 loses too much precision.
        # The cast back happens *before* the weight multiply, again as HF, so bf16 numerics match.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rms_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The checkpoint family's RMSNorm over `dim`, with its eps."""
    return (gemma3.GemmaRMSNorm if config.gemma else RMSNorm)(dim, config.rms_norm_eps)


class KVCache:
    """One layer's preallocated K/V cache for generate() (as gpt-fast): two (B, Hkv, S_max, D) buffers allocated
    once, then filled slot by slot, so each decoding step writes one slot instead of copying the whole cache
    (torch.cat would copy all S keys of every layer at every step)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.len = 0  # slots 0 .. len-1 are filled
        self.k = self.v = None

    def write(self, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, Hkv, T, D) go to slots len .. len+T-1; returns K, V over every filled slot, (B, Hkv, len+T, D)."""
        T = k.shape[2]
        if self.len + T > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} slots; {self.len} are filled, {T} more do not fit")
        if self.k is None:  # allocated at the first write: the keys' dtype (bf16 under autocast) and device
            B, Hkv, _, D = k.shape
            self.k = k.new_zeros(B, Hkv, self.max_len, D)
            self.v = v.new_zeros(B, Hkv, self.max_len, D)
        self.k[:, :, self.len:self.len + T] = k
        self.v[:, :, self.len:self.len + T] = v
        self.len += T
        return self.k[:, :, :self.len], self.v[:, :, :self.len]  # views: the buffers are never copied


def sdpa(q, k, v, mask, is_causal: bool, scale):
    """softmax(q kᵀ · scale, under mask) v for q (B, H, T, D) and k, v (B, Hkv, S, D), on a fused kernel where one
    exists. CUDA's kernels split the two features: flash attention takes grouped-query heads (enable_gqa) but no mask,
    the memory-efficient kernel takes a mask but not enable_gqa (PyTorch PR 191085 adds it), cuDNN's takes both but only
    in bf16/fp16 and not first on every GPU. SDPA given both falls back to its math path, which materializes the
    (B, H, T, S) probabilities. So with a mask, each K/V head is repeated to its H/Hkv query heads first (as
    transformers' repeat_kv does whenever a mask is given); without one, enable_gqa reads them in place (in fp32 on
    CUDA, which flash does not take, that is the math path, which repeats K/V inside: only tests run fp32 there; the
    CPU's flash kernel takes fp32 with GQA). One query row (a decoding step) takes neither road: see below. All give
    the same numbers (tests/test_model.py)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    if T == 1 and group > 1:
        # One new token per sample: its H query heads are H/Hkv query *rows* for each K/V head (query head h reads
        # K/V head h // group, so consecutive heads fold together). That is plain multi-head attention over Hkv
        # heads, which every kernel takes with or without a mask, on every torch version: the KV cache is read in
        # place, never repeated (a repeat would copy the whole cache, every layer, every step: more memory traffic
        # than the attention itself). A one-row mask (B or 1, 1, 1, S) or (1, S) broadcasts over the group's rows.
        y = F.scaled_dot_product_attention(q.view(B, Hkv, group, D), k, v, attn_mask=mask, scale=scale)
        return y.reshape(B, H, 1, D)  # (B, Hkv, group, D) -> (B, H, 1, D); is_causal is False for one row
    if mask is not None and group > 1:
        # (B, H, S, D): query head h reads K/V head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=group > 1 and mask is None)


class Attention(nn.Module):
    """Grouped-query attention.  Notation: B batch, T new tokens, P cached prefix, S = P + T keys,
    H query heads, Hkv key/value heads, D head_dim.  Each group of H/Hkv query heads reads one K/V head:

        q heads:  q0 q1 | q2 q3 | q4 q5 | q6 q7      (H = 8)
        kv heads:   k0  |   k1  |   k2  |   k3       (Hkv = 4)
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, H * D, bias=bias)
        self.k_proj = nn.Linear(d, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(d, Hkv * D, bias=bias)
        # Qwen2 biases only q/k/v; Llama's attention_bias also covers o_proj (HF does the same).
        self.o_proj = nn.Linear(H * D, d, bias=bias and config.arch != "qwen2")
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = rms_norm(config, D)
            self.k_norm = rms_norm(config, D)
        # softmax(q·k * scale): None is SDPA's default 1/sqrt(D); Gemma scales by query_pre_attn_scalar^-1/2
        # (HF modeling_gemma3: self.scaling = config.query_pre_attn_scalar**-0.5; 27B: 168 with D = 128)
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5

    def qkv(self, x, cos, sin):
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x (B, T, d); q and k RoPE-rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)      # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)   # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)   # (B, T, Hkv, D)
        # Qwen3; Gemma 3 (report §2: QK-norm replaces Gemma 2's soft-capping): each head over D, before RoPE
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        return q, k, v.transpose(1, 2)               # v: (B, Hkv, T, D)

    def forward(self, x, cos, sin, mask, past=None, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        # the prefix keys were rotated at their own positions when they were computed; never re-rotate
        if past is not None:   # a given prefix (the 500x/AOC carrier): concatenated, so gradients reach it
            k = torch.cat([past[0], k], dim=2)  # (B, Hkv, S, D)
            v = torch.cat([past[1], v], dim=2)  # (B, Hkv, S, D)
        elif cache is not None:  # generate(): written into the preallocated buffers, read back with the prefix
            k, v = cache.write(k, v)            # (B, Hkv, S, D) each
        # mask: a boolean (.., T, S) mask, True = may attend; or None = plain causal (the fast kernel), which
        # forward() only passes with no prefix, or for a single new token (it may see every key: no mask at all).
        # Decided by a branch: compiled with dynamic shapes (train.py --compile), T > 1 is a symbolic bool, which SDPA
        # refuses (a graph break), and a branch on it the compiler decides once and guards
        is_causal = True if mask is None and T > 1 else False
        y = sdpa(q, k, v, mask, is_causal=is_causal, scale=self.scale)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H*D)
        return self.o_proj(y), (k, v)   # the cache keeps Hkv heads: sdpa's repeat is never stored

    def weights(self, x, cos, sin, mask):
        """The attention probabilities (B, H, T, T), fp32, that forward's SDPA applies to x with no prefix: softmax
        of q kᵀ · scale under mask (None = plain causal, as in forward). SDPA never materializes them; this is for
        looking at them (evaluate.py's heatmap, PIC Figure 7), not for running the model."""
        q, k, _ = self.qkv(x, cos, sin)
        # GQA: query head h reads K/V head h // (H/Hkv), so repeat each K/V head H/Hkv times
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)     # (B, H, T, D)
        scores = q.float() @ k.float().transpose(-1, -2)                   # (B, H, T, T)
        scores = scores / math.sqrt(self.head_dim) if self.scale is None else scores * self.scale
        if mask is None:
            mask = masks.causal(x.shape[1], device=x.device)
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU (silu) or GeGLU (Gemma)


class Block(nn.Module):
    """Pre-norm (Llama, Qwen, Mistral): h = h + Attn(LN_in(h)); h = h + MLP(LN_post_attn(h)).
    Beware the name: Llama's post_attention_layernorm is the norm *before* the MLP (HF's name, kept for loading).
    mlp: "swiglu" (the checkpoint's), "aoc" (AOC Eq. 3: the MLP is the identity, LN_post stays) or "none" (the
    second sub-block removed). sliding: a Gemma 3 local layer (Transformer.forward hands it the windowed mask).
    Gemma 3's sandwich block is gemma3.GemmaBlock."""

    def __init__(self, config: ModelConfig, sliding: bool = False):
        super().__init__()
        self.mlp_kind, self.sliding = config.mlp, sliding
        self.input_layernorm = rms_norm(config, config.hidden_size)
        self.self_attn = Attention(config)
        if config.mlp != "none":
            self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        if config.mlp == "swiglu":
            self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, past=None, cache=None):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, cache)
        x = x + a
        if self.mlp_kind == "swiglu":
            x = x + self.mlp(self.post_attention_layernorm(x))
        elif self.mlp_kind == "aoc":
            x = x + self.post_attention_layernorm(x)  # AOC Eq. (3): the MLP becomes the identity, LN_post stays
        return x, kv  # mlp == "none": the second sub-block is gone entirely


# ---------------------------------------------------------------------------- transformer


@dataclass
class ModelOutput:
    logits: torch.Tensor | None       # (B, T, V), None when compute_logits=False
    last_hidden: torch.Tensor         # (B, T, d): output of the last layer run, after the final norm model.norm
    hidden_states: list | None        # [embeddings, after layer 1, ..., after layer n], raw residual stream;
                                      # unlike HF, the last entry has NO final norm (HF's last entry is normed)
    kv: list | None                   # per layer run: (k, v), each (B, Hkv, P+T, D), keys RoPE-rotated, prefix included


class Transformer(nn.Module):
    """Weight init (only for models trained from scratch; `load_pretrained` overwrites everything):

    | parameter                    | init                                      |
    |------------------------------|-------------------------------------------|
    | Linear and Embedding weights | normal(0, 0.02), HF's initializer_range   |
    | Linear biases                | 0                                         |
    | RMSNorm weights              | 1 (Gemma: 0, as it multiplies by 1 + w)   |
    | tied lm_head                 | the embedding itself (one Parameter)      |
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.mlp not in ("swiglu", "aoc", "none"):
            raise ValueError(f"mlp must be 'swiglu', 'aoc' or 'none', got {config.mlp!r}")
        types = config.layer_types   # Gemma 3: each layer local (sliding window) or global; None elsewhere
        if types is not None:
            gemma3.check_layer_types(config)
        sliding = [types is not None and types[i] == "sliding_attention" for i in range(config.num_hidden_layers)]
        # Gemma 3: x sqrt(d) embeddings, and its sandwich block around this file's attention and MLP
        embed = (gemma3.ScaledEmbedding if config.gemma else nn.Embedding)(config.vocab_size, config.hidden_size)
        if config.gemma:
            layers = [gemma3.GemmaBlock(config, Attention(config), MLP(config) if config.mlp == "swiglu" else None, s)
                      for s in sliding]
        else:
            layers = [Block(config, s) for s in sliding]
        self.config = config
        # the `model.` level exists only so parameter names equal HF's (model.layers.0...., lm_head.weight)
        self.model = nn.ModuleDict(dict(
            embed_tokens=embed,
            layers=nn.ModuleList(layers),
            norm=rms_norm(config, config.hidden_size),
        ))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter, two names
        # non-persistent: not in the state dict, re-derived from the config (HF checkpoints do not store it)
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)
        if types is not None:  # Gemma 3's local layers turn at their own base (HF sliding_attention_inv_freq)
            self.register_buffer("inv_freq_local", rope_frequencies(config, local=True), persistent=False)
        # activation checkpointing: set True to keep only each block's input for backward and recompute the
        # block there (about one more forward of compute for far less activation memory on long sequences)
        self.grad_ckpt = False
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts every floating buffer; a bf16 inv_freq is off by ~0.4%, which at
        # position 1000 turns into whole radians of RoPE angle. So re-derive it in fp32 after any cast or move.
        super()._apply(fn, recurse)
        self.reset_rope(self.inv_freq.device)
        return self

    def reset_rope(self, device):
        """(Re)derive the fp32 RoPE frequencies on `device`: after a cast or move, or a build on the meta device."""
        self.inv_freq = rope_frequencies(self.config, device)
        if self.config.layer_types is not None:
            self.inv_freq_local = rope_frequencies(self.config, device, local=True)

    def rope(self, pos: torch.Tensor, dtype, local: bool = False) -> tuple:
        """RoPE angles for exactly these positions (B or 1, T), not a table lookup (EPL positions can be anything):
        cos and sin, each (B or 1, 1, T, D), broadcast over heads. local: Gemma 3's sliding layers' frequencies."""
        freqs = pos[..., None].float() * (self.inv_freq_local if local else self.inv_freq)  # (B or 1, T, D/2), fp32
        emb = torch.cat((freqs, freqs), dim=-1)                  # (B or 1, T, D): dims i and i + D/2 share an angle
        # YaRN (Peng et al. 2023), as transformers' _compute_yarn_parameters: cos and sin are scaled by the
        # attention factor, which sharpens the softmax at long range (1.0 for plain, linear and llama3 RoPE, and
        # for Gemma's unscaled local RoPE)
        scale = 1.0 if local else rope_attention_factor(self.config)
        return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]

    def forward(self, input_ids=None, *, inputs_embeds=None, position_ids=None, attn_mask=None, past_kv=None,
                output_hidden_states=False, return_kv=False, compute_logits=True, cache=None) -> ModelOutput:
        """input_ids (B, T) or inputs_embeds (B, T, d), exactly one.
        position_ids: (B, T) or (T,), any integers (gaps, repeats, any order); default P + arange(T).
        attn_mask: bool, True = may attend, (T, S), (B, T, S) or (B, 1, T, S) with S = P + T; key j < P is
            prefix slot j, key P + i is new token i. Default: the whole prefix plus causal over the new tokens.
        past_kv: one (k, v) per layer, each (B, Hkv, P, D), e.g. the `kv` of another forward (the 500x/AOC carrier).
        cache: one KVCache per layer (generate's), instead of past_kv: its P filled slots are the prefix, and the
            new tokens' k/v are written into it."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, d)
        B, T, _ = h.shape
        layers = self.model.layers
        if past_kv is not None and len(past_kv) != len(layers):
            raise ValueError(f"past_kv has {len(past_kv)} layers but the model has {len(layers)}: pass one (k, v) "
                             "per layer")
        if past_kv is not None and cache is not None:
            raise ValueError("pass past_kv or cache, not both (generate writes a past_kv into its cache)")
        P = past_kv[0][0].shape[2] if past_kv is not None else cache[0].len if cache is not None else 0

        if position_ids is None:
            position_ids = torch.arange(P, P + T, device=h.device)
        cos, sin = self.rope(position_ids.reshape(-1, T), h.dtype)   # (B or 1, 1, T, D)

        if attn_mask is not None:
            if attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (T, P + T):
                raise ValueError(f"attn_mask must be a bool tensor ending in (T, P+T) = ({T}, {P + T}), "
                                 f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
            mask = attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask  # (B, 1, T, S) or (T, S)
        elif P > 0 and T > 1:
            # SDPA's is_causal aligns the triangle top-left (query i sees keys 0..i), but new token i sits at
            # key slot P + i: it must see the whole prefix and new tokens 0..i, i.e. keys 0..P+i.
            mask = masks.with_prefix(masks.causal(T, device=h.device), P)  # (T, S), made on the device
        else:
            mask = None  # plain causal (P == 0), or one new token that sees the whole cache
        full_attn = (cos, sin, mask)   # what a global layer attends with; a local one (Block.sliding): Gemma's
        local_attn = self.local_attention(position_ids.reshape(-1, T), mask, P, h) if self.config.layer_types else None

        hidden_states = [h] if output_hidden_states else None
        kv = [] if return_kv else None
        # only when a backward can follow; never while writing a cache, which the recomputation would write twice
        ckpt = self.grad_ckpt and torch.is_grad_enabled() and cache is None
        for i, layer in enumerate(layers):
            past = None if past_kv is None else past_kv[i]
            cos, sin, mask = local_attn if layer.sliding else full_attn
            if ckpt:
                # non-reentrant: gradients still reach a past_kv prefix and inputs that need no grad work
                h, layer_kv = torch.utils.checkpoint.checkpoint(lora_as_now(layer), h, cos, sin, mask, past,
                                                                use_reentrant=False)
            else:
                h, layer_kv = layer(h, cos, sin, mask, past, None if cache is None else cache[i])
            if output_hidden_states:
                hidden_states.append(h)
            if return_kv:
                kv.append(layer_kv)
        h = self.model.norm(h)
        logits = self.lm_head(h) if compute_logits else None
        return ModelOutput(logits=logits, last_hidden=h, hidden_states=hidden_states, kv=kv)

    def local_attention(self, pos: torch.Tensor, mask, P: int, h: torch.Tensor) -> tuple:
        """(cos, sin, mask) of Gemma 3's local layers: their own RoPE, and the window ANDed onto the layer's mask
        (gemma3.window_mask: slots back from each query, a KV prefix's included)."""
        local_mask = gemma3.window_mask(mask, P, h.shape[1], self.config.sliding_window, h.device)
        return (*self.rope(pos, h.dtype, local=True), local_mask)

    @torch.no_grad()
    def generate(self, input_ids=None, *, inputs_embeds=None, position_ids=None, attn_mask=None, past_kv=None,
                 max_new_tokens=32, eos_id=None) -> torch.LongTensor:
        """Greedy decoding -> (B, n), n <= max_new_tokens. The prompt (ids or embeddings, optional KV prefix,
        positions and mask, as forward() takes them) is prefilled in one forward into a preallocated KV cache.

        Padded batches: the last row of attn_mask says, per sample, which of the P + T keys are real; every
        generated token sees exactly those plus the tokens generated before it (itself included). With
        masks.with_padding that row is the real keys under left and right padding alike (a trailing pad query
        sees the real tokens but not itself). Each sample continues from its last real prompt token, the last
        prompt slot that row sees, at (its position + 1, + 2, ...). eos_id: an id or a list of ids (None = never
        stop early); a finished row is padded with the (first) eos id."""
        B, T = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        P = 0 if past_kv is None else past_kv[0][0].shape[2]
        # the last generated token is returned, never fed back: P + T + max_new_tokens - 1 slots suffice
        S_max = P + T + max_new_tokens - 1
        # Gemma 3's local layers get full-length caches too (HF keeps only their last W slots): the window is in
        # the mask forward() builds, so the outputs are the same, for some memory the local layers never read
        cache = [KVCache(S_max) for _ in self.model.layers]
        if past_kv is not None:
            for c, (k, v) in zip(cache, past_kv):
                c.write(k, v)  # the prefix fills slots 0 .. P-1
        out = self(input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, attn_mask=attn_mask,
                   cache=cache, compute_logits=False)
        device = out.last_hidden.device

        # valid[b, j]: row b's new tokens may attend cache slot j; the rest of the row is set as tokens arrive
        valid = torch.zeros(B, S_max, dtype=torch.bool, device=device)
        if attn_mask is None:
            valid[:, :P + T] = True  # forward's default mask: every prefix and prompt key is real
        else:
            valid[:, :P + T] = attn_mask[..., -1, :].reshape(-1, P + T)  # the last query row, (B or 1, P+T)
        # nothing padded: each new token sees every filled slot, forward's default for one token, so no mask is passed
        # and SDPA runs unmasked (CUDA: flash). Checked once: the slots the new tokens fill are real in every row.
        padded = not bool(valid[:, :P + T].all())
        prompt_slots = torch.arange(T, device=device)
        last = torch.where(valid[:, P:P + T], prompt_slots, -1).amax(-1)          # (B,) last real prompt token
        h_last = out.last_hidden[torch.arange(B, device=device), last]          # (B, d): its hidden state
        if position_ids is None:
            pos = P + last                                                        # (B,) the default positions
        else:
            pos = position_ids.reshape(-1, T).expand(B, T).gather(1, last[:, None])[:, 0]  # (B,)

        stop = None if eos_id is None else torch.tensor(eos_id, device=device).view(-1)  # (n_eos,)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens = []
        for step in range(max_new_tokens):
            nxt = self.lm_head(h_last).argmax(-1)  # (B,)
            if stop is not None:
                nxt = torch.where(done, stop[0], nxt)  # finished rows keep emitting eos
                done |= torch.isin(nxt, stop)
            tokens.append(nxt)
            if step == max_new_tokens - 1 or (stop is not None and bool(done.all())):
                break
            slot, pos = P + T + step, pos + 1  # the new token's cache slot, its position per row
            valid[:, slot] = True              # it sees itself and every valid earlier slot, never padding
            mask = valid[:, None, :slot + 1] if padded else None  # (B, 1, S): one query row per sample
            out = self(nxt[:, None], position_ids=pos[:, None], attn_mask=mask, cache=cache, compute_logits=False)
            h_last = out.last_hidden[:, -1]
        return torch.stack(tokens, dim=1)  # (B, n)


# ---------------------------------------------------------------------------- loss


def chunked_cross_entropy(hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor,
                          chunk: int = 1024, keep_below: int = 2 ** 26, reduction: str = "sum") -> torch.Tensor:
    """sum_i CE(lm_head(hidden_i).float(), targets_i) over N positions -> scalar (targets -100 are skipped, as in
    F.cross_entropy), equal to the plain call but never holding fp32 logits for all N positions at once;
    reduction "none": each position's CE, (N,) (train.py's --own-other-weight compares them text by text).

    hidden (N, d), targets (N,). Why: with Qwen's 152k vocabulary, 8k supervised positions have 8k x 152k x 4 B
    = 5 GB of fp32 logits, and autograd keeps as much again (cross_entropy saves its log-softmax). Here each
    chunk of positions is projected, reduced to its summed loss and dropped; torch.utils.checkpoint saves only
    the chunk's inputs and recomputes its logits in backward, so at most one chunk's logits exist at a time.
    keep_below (ours): when all N positions' fp32 logits take fewer bytes than this (64 MiB: SmolLM2's 49k
    vocabulary over 4 texts of 64 tokens), they are kept instead, as the plain call keeps them: at that size the
    recomputation is one more lm_head product in backward (5% of a 135M model's step) to save little memory."""
    def chunk_loss(h, t):  # (n, d), (n,) -> scalar, or (n,) for reduction "none"
        return F.cross_entropy(lm_head(h).float(), t, reduction=reduction)

    if hidden.shape[0] * lm_head.weight.shape[0] * 4 < keep_below:
        return chunk_loss(hidden, targets)
    parts = [torch.utils.checkpoint.checkpoint(chunk_loss, hidden[s:s + chunk], targets[s:s + chunk],
                                               use_reentrant=False) for s in range(0, hidden.shape[0], chunk)]
    # "none": the positions' losses in order; "sum": added chunk after chunk, from an fp32 zero
    return torch.cat(parts) if reduction == "none" else sum(parts, hidden.new_zeros((), dtype=torch.float32))


# ---------------------------------------------------------------------------- loading


TINY_CONFIG = dict(  # a small Llama: 4 layers, d=64, GQA 4:2, byte-level vocabulary
    model_type="llama", vocab_size=259, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, pad_token_id=258)


SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B_CONFIG, "qwen3-4b": QWEN3_4B_CONFIG, "gemma-3-4b": GEMMA_3_4B_CONFIG,
          "llama-2-7b": LLAMA_2_7B_CONFIG, "llama-3-8b": LLAMA_3_8B_CONFIG}


def build_shape(shape: str, device="cpu", dtype=torch.float32) -> tuple[Transformer, "Tokenizer"]:
    """A random model of a paper model's shape (SHAPES) and the tiny byte tokenizer, no download: for
    benchmarks, whose times and memory depend on the shape alone. Initialised on `device` directly."""
    with torch.device(device):
        model = Transformer(ModelConfig.from_hf(SHAPES[shape])).to(dtype)
    model.name_or_path = f"random {shape}"
    return model.eval(), build_tiny()[1]


def copy_model(src: Transformer, share: tuple = (), **changes) -> Transformer:
    """An independent copy of `src` with some config fields changed (fewer layers, MLP-free blocks):
    built on the meta device, given empty storage, then every tensor copied from `src`, so no
    random init is wasted on a multi-GB model. A LoRA'd source gives its base weights (no LoRA).
    share: submodules the copy takes from `src` itself instead of copying, e.g. ("model.embed_tokens",
    "lm_head"): an encoder that embeds with the frozen LLM's own table (AOC code), no second vocabulary."""
    cfg = replace(src.config, **changes)
    if cfg.layer_types is not None and len(cfg.layer_types) > cfg.num_hidden_layers:
        cfg = replace(cfg, layer_types=cfg.layer_types[:cfg.num_hidden_layers])  # the first k layers keep their types
    weight = src.model.embed_tokens.weight
    with torch.device("meta"):
        dst = Transformer(cfg)
    for name in share:
        parent, _, child = name.rpartition(".")
        setattr(dst.get_submodule(parent) if parent else dst, child, src.get_submodule(name))
    shared = {id(p) for p in src.parameters()}
    for module in dst.modules():   # everything not shared gets storage, uninitialised until copied below
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) not in shared:
                module._parameters[key] = nn.Parameter(torch.empty_like(p, device=weight.device, dtype=weight.dtype),
                                                       requires_grad=p.requires_grad)
    dst.reset_rope(weight.device)
    if cfg.tie_word_embeddings and "lm_head" not in share:   # each parameter got its own storage: tie them again
        dst.lm_head.weight = dst.model.embed_tokens.weight
    src_state = src.state_dict()
    with torch.no_grad():
        for name, t in dst.state_dict().items():
            if name not in src_state:
                raise ValueError(f"cannot copy '{name}': the source model has no such tensor")
            if t.data_ptr() != src_state[name].data_ptr() or t.device.type == "meta":
                t.copy_(src_state[name])
    return dst


def build_tiny(seed: int = 0) -> tuple[Transformer, Tokenizer]:
    """A random tiny Llama and a byte tokenizer, no download; same weights for the same seed."""
    with torch.random.fork_rng(devices=[]):  # seed locally: the caller's RNG stream is left untouched
        torch.manual_seed(seed)
        model = Transformer(ModelConfig.from_hf(TINY_CONFIG))
        # std 0.1 rather than HF's 0.02: the decoder is frozen in every method, and with 0.02 its logits stay
        # within about ±1.3, so no memory can pull the loss far below ln(259) and the quickstart would not
        # visibly learn. Matrices only; the RMSNorm weights stay at 1.
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, mean=0.0, std=0.1)
    model.name_or_path = "tiny"
    return model, Tokenizer(byte_tokenizer(), bos_id=256, eos_id=257, pad_id=258)


def load_pretrained(name_or_path: str, dtype=torch.float32, device="cpu",
                    mlp="swiglu") -> tuple[Transformer, Tokenizer]:
    """An HF checkpoint (local folder or hub id) -> (model, tokenizer); "tiny" -> build_tiny().
    mlp="aoc"/"none" builds the AOC encoder from a full checkpoint: its MLP tensors are skipped."""
    if name_or_path == "tiny":
        model, tok = build_tiny()
        if mlp != "swiglu":  # as for a real checkpoint: same weights, minus the dropped sub-block
            model = copy_model(model, mlp=mlp)
        model.name_or_path = "tiny"  # what a checkpoint records to rebuild this base model
        return model.to(dtype=dtype, device=device), tok
    folder = resolve(name_or_path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {folder} (pass a Hugging Face model folder, "
                                f"as written by save_pretrained)")
    hf = read_json(folder / "config.json")
    config = replace(ModelConfig.from_hf(hf), mlp=mlp)
    with torch.device("meta"):  # no memory, no init: every tensor comes from the checkpoint
        model = Transformer(config)
    load_weights(model, folder, dtype, device, prefix=gemma3.weights_prefix(hf))
    if config.tie_word_embeddings:  # assign=True replaced embed_tokens.weight; re-point lm_head at it
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope(device)  # the buffers are still on meta
    model.name_or_path = name_or_path  # what a checkpoint records to rebuild this base model
    return model.eval(), Tokenizer.from_dir(folder)


def weight_reader(name_or_path: str, dtype=torch.float32, device="cpu"):
    """read(name) -> one tensor of a model's weights by its name here (model.layers.0.mlp.up_proj.weight), in `dtype`
    on `device`, the values load_pretrained gives it, read alone (hf.tensor_reader): train.py --fsdp builds on the
    meta device and each rank reads the base weights tensor by tensor into its shards (parallel.materialise).
    "tiny": from build_tiny's weights, built whole (the demo's 0.8 MB)."""
    if name_or_path == "tiny":
        state = build_tiny()[0].state_dict()
        return lambda name: state[name].to(dtype=dtype, device=device)
    folder = resolve(name_or_path)
    return tensor_reader(folder, dtype, device, prefix=gemma3.weights_prefix(read_json(folder / "config.json")))
