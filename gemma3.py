"""Gemma 3's text model: what it changes in model.py's transformer (Gemma 3 technical report §2; HF modeling_gemma3),
switched on by model_type "gemma3_text" (gemma-3-1b) or "gemma3" (the text tower of the multimodal
gemma-3-4b/12b/27b; the vision tower is not loaded):

    h_0 = embed(x) * sqrt(d)                         the scale rounded to the embedding dtype, as HF
    h   = h + RMSNorm(Attn(RMSNorm(h)))              norms before *and* after each sub-block ("sandwich")
    h   = h + RMSNorm(GeGLU(RMSNorm(h)))             GeGLU(x) = down(gelu_tanh(gate(x)) * up(x))
    RMSNorm(x) = (1 + w) * x / sqrt(mean(x^2) + eps) all in fp32, cast back last
    Attn: q, k RMS-normed per head; scores q·k / sqrt(query_pre_attn_scalar); 5 local layers per global one:
          a local layer sees the last `sliding_window` slots only, with RoPE base rope_local_base_freq (10k);
          a global one sees everything, RoPE base rope_theta (1M, linearly scaled x8 on the 4B and larger)

Here: reading a Gemma 3 config.json, the (1 + w) RMSNorm, the scaled embedding, the sandwich block and the local
layers' window. The attention (with its q/k norms and query_pre_attn_scalar), the GeGLU MLP, both RoPEs and the
forward pass are model.py's, which builds its blocks from these parts when ModelConfig.gemma is set. This file sits
one layer below model.py and imports only masks, because model.load_pretrained must recognise a Gemma 3 checkpoint:
model.py imports this file and hands GemmaBlock model.py's attention and MLP.

tests/test_gemma3.py checks it against transformers' Gemma3ForCausalLM on random checkpoints, past the window and
with a KV prefix: max |Δlogit| 1.3e-5 in fp32, 2.2e-5 for a multimodal checkpoint's text tower against
Gemma3ForConditionalGeneration (greedy generations token for token equal).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import masks

MODEL_TYPES = ("gemma3_text", "gemma3")   # the text model; the multimodal checkpoint around it
# HF Gemma3TextConfig's defaults (tests/test_gemma3.py checks them against the installed transformers): the hub's
# gemma-3-4b-it config.json names only a few keys of its text_config (hidden_size, intermediate_size,
# num_hidden_layers, rope_scaling, sliding_window) and leaves every other one to these
GEMMA3_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0)


# ---------------------------------------------------------------------------- config


def text_config(hf: dict) -> dict:
    """A Gemma 3 config.json as the flat text-model dict ModelConfig.from_hf reads: a multimodal checkpoint's
    text_config lifted up, HF Gemma3TextConfig's defaults filled in, the Gemma variants not implemented refused, and
    Gemma's activation and per-layer-type RoPE put under the names from_hf reads for every family (hidden_act;
    rope_parameters of the global layers, rope_local_base_freq of the local ones)."""
    if hf["model_type"] == "gemma3":
        # HF Gemma3Config: a multimodal checkpoint nests its text model's config under text_config; the special
        # ids may sit at the top level (gemma-3-4b-it: eos_token_id [1, 106]), text_config's win when both exist
        specials = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        hf = {**specials, **hf["text_config"], "model_type": "gemma3_text"}
    hf = {**GEMMA3_DEFAULTS, **hf}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2 had them, Gemma 3 sets None
        if hf.get(key) is not None:
            raise ValueError(f"unsupported {key}={hf[key]}: Gemma 3 checkpoints set it to null, and logit "
                             f"soft-capping is not implemented")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=true: only causal (decoder) Gemma 3 is implemented")
    hf["hidden_act"] = hf["hidden_activation"]  # Gemma names its activation hidden_activation (HF Gemma3TextConfig)
    rope = hf.get("rope_parameters")
    if rope is not None and "full_attention" in rope:
        # transformers v5 Gemma 3: one RoPE per layer type; HF's Gemma3TextConfig puts rope_scaling on the
        # global layers only, so a rescaled local RoPE is no Gemma 3 checkpoint
        local = rope["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported RoPE scaling on the sliding layers: {local}")
        hf["rope_parameters"], hf["rope_local_base_freq"] = rope["full_attention"], local["rope_theta"]
    return hf  # the v4 layout has rope_theta + rope_scaling (global) and rope_local_base_freq already


def config_fields(hf: dict) -> dict:
    """ModelConfig's Gemma-only fields, from text_config's dict."""
    # HF Gemma3TextConfig: without an explicit layer_types, layer i is global when (i + 1) is a multiple of
    # sliding_window_pattern (6: five local layers, then one global: Gemma 3 report §2, "5:1 interleaving")
    pattern = hf["sliding_window_pattern"]
    layer_types = tuple(hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else
                                                  "sliding_attention" for i in range(hf["num_hidden_layers"])])
    return dict(layer_types=layer_types, sliding_window=hf["sliding_window"],
                rope_local_theta=float(hf["rope_local_base_freq"]),
                query_pre_attn_scalar=hf["query_pre_attn_scalar"])


def hf_fields(config) -> dict:
    """The config.json keys of a model.ModelConfig's Gemma-only fields, by HF Gemma3TextConfig's names."""
    return dict(hidden_activation=config.hidden_act, layer_types=list(config.layer_types),
                sliding_window=config.sliding_window, rope_local_base_freq=config.rope_local_theta,
                query_pre_attn_scalar=config.query_pre_attn_scalar)


def weights_prefix(hf: dict) -> str:
    """The prefix of the text model's tensor names in a checkpoint, given its config.json."""
    # a multimodal Gemma 3 (model_type "gemma3": gemma-3-4b-it) names its text tower language_model.model.* and
    # language_model.lm_head.*, on the hub and as transformers (v4 and v5 alike) saves Gemma3ForConditionalGeneration;
    # without the prefix those are our names
    return "language_model." if hf.get("model_type") == "gemma3" else ""


def check_layer_types(config):
    """A model.ModelConfig's layer_types names each layer local or global, and local layers have a window."""
    types = config.layer_types
    if len(types) != config.num_hidden_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the "
                         f"{config.num_hidden_layers} layers, got {types}")
    if "sliding_attention" in types and not config.sliding_window:
        raise ValueError("sliding_attention layers need a sliding_window (config.json has none)")


# ---------------------------------------------------------------------------- layers


class GemmaRMSNorm(nn.Module):
    """HF modeling_gemma3 Gemma3RMSNorm: x / rms(x) * (1 + w). The weight is stored as an offset from 1 (so it starts
    at 0), and unlike Llama's RMSNorm the multiply happens in fp32 too, before the one cast back (HF PR #29402)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """HF modeling_gemma3 Gemma3TextScaledWordEmbedding: the embedding times sqrt(d). The scale is rounded to the
    weight's dtype first, as HF does: in bf16 sqrt(2560) = 50.596 becomes 50.5. It lives in the module, so every
    caller of embed_tokens(ids) (the compressors too) gets scaled rows; inputs_embeds handed to forward() are used
    as they are, as in HF."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim ** 0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.weight.new_tensor(self.scale)  # a 0-dim tensor in the weight's dtype


class GemmaBlock(nn.Module):
    """Gemma 3 "sandwich" (report §2: "post-norm and pre-norm with RMSNorm"; HF Gemma3DecoderLayer), four norms:
        h = h + LN_post_attn(Attn(LN_in(h)));  h = h + LN_post_ff(MLP(LN_pre_ff(h)))
    Gemma's post_attention_layernorm is the norm on the attention output (Llama's of the same name comes before the
    MLP). attn, mlp: model.py's Attention and MLP (mlp None unless config.mlp is "swiglu"); config.mlp and sliding
    as in model.Block."""

    def __init__(self, config, attn: nn.Module, mlp: nn.Module | None, sliding: bool = False):
        super().__init__()
        self.mlp_kind, self.sliding = config.mlp, sliding
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)       # part of the attention sub-block
        if config.mlp != "none":
            self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        if config.mlp == "swiglu":
            self.mlp = mlp

    def forward(self, x, cos, sin, mask, past=None, cache=None):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, cache)
        x = x + self.post_attention_layernorm(a)
        if self.mlp_kind == "swiglu":
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        elif self.mlp_kind == "aoc":  # AOC Eq. (3), as HF's Gemma3DecoderLayer with mlp = nn.Identity() computes
            x = x + self.post_feedforward_layernorm(self.pre_feedforward_layernorm(x))
        return x, kv


def window_mask(mask, P: int, T: int, window: int, device):
    """A local layer's mask: the window ANDed onto whatever the layer's mask says (mask None = causal over the T new
    tokens after a P-slot prefix). The window counts key *slots* back from each query's slot over the whole sequence,
    a KV prefix's P slots (memory from a compressor) included, exactly as HF's masking_utils counts cache positions:
    so a KV-prefix or an embedding-prefix forward sees what HF's Gemma 3 sees for the same vectors placed before the
    tokens in one pass (memory further than W slots back is out of a local layer's reach; the global layers see it
    all). Slots, not position_ids: EPL's moved positions do not move the window, as in HF."""
    if P + T <= window:  # the band hides nothing: keep the fast causal kernel
        return mask
    base = mask if mask is not None else masks.with_prefix(masks.causal(T, device=device), P)
    return masks.with_window(base, window)   # never an all-False row
