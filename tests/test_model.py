"""model.py against transformers (the reference) on tiny random checkpoints, plus the properties the
compression methods rely on: KV prefixes, free positions, masks, truncation, the AOC block, LoRA, loading."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import masks
from conftest import SMOLLM2, assert_attention_weights_are_sdpas, needs_smollm2
from lora import LoRALinear, add_lora, lora_disabled
from model import (ModelConfig, build_tiny, chunked_cross_entropy, copy_model, load_pretrained, rope_attention_factor,
                   rope_frequencies)

SPECIALS = dict(vocab_size=300, bos_token_id=256, eos_token_id=257, pad_token_id=258)
LLAMA3 = dict(  # untied, llama3 RoPE scaling with a short original context so all three frequency bands occur
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64), **SPECIALS)
QWEN2 = dict(  # q/k/v biases, tied embeddings
    model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True, **SPECIALS)
QWEN3 = dict(  # per-head q/k RMSNorm, head_dim 32 != 64 / 4
    model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False, **SPECIALS)
CONFIGS = {"llama3": LLAMA3, "qwen2": QWEN2, "qwen3": QWEN3}
# Qwen3's 128k setting (factor 4 over 32k), shrunk: an original context of 64, so 200 tokens reach far past it
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
QWEN3_YARN = dict(QWEN3, max_position_embeddings=256, rope_scaling=YARN)


@pytest.fixture(scope="module")
def pairs(hf_checkpoint, device):
    """name -> (folder, hf_model, our_model), both models on `device`; the llama checkpoint is sharded."""
    out = {}
    for name, cfg in CONFIGS.items():
        folder, hf = hf_checkpoint(cfg, max_shard_size="100KB" if name == "llama3" else None)
        ours, _ = load_pretrained(str(folder), device=device)
        out[name] = (folder, hf.to(device), ours)
    return out


def ids_(device, B=2, T=24, seed=0):
    # drawn on the CPU's generator, then moved: the same ids on every device
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def close(a, b, atol=1e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(pairs, name, device):
    folder, hf, ours = pairs[name]
    ids = ids_(device)
    with torch.no_grad():
        close(ours(ids).logits, hf(ids).logits)


# bf16 parity: both models in bf16 on the test device, transformers with its eager attention (the same reference
# as the fp32 tests) and our SDPA. bf16 keeps 8 mantissa bits, so every rounding is off by up to 2^-8 relative, and
# two correct bf16 implementations that round in different places drift apart by a few ulps of the logits: at
# |logit| in [4, 8) one ulp is 2^-5 = 0.031. Measured on the CPU (these three configs, weight and input seeds 0-4,
# max |logit| 4.3-6.3): max |Δlogit| 0.062-0.145 (4.6 ulps at most); the bound is twice the worst. It catches a
# wrong cast or a missing op in the bf16 path, not a subtle precision slip: computing RMSNorm statistics in bf16
# or rounding the RoPE frequencies to bf16 moved the logits by 0.06-0.31 in the same measurement, kernel noise's
# size (test_bf16_forward_and_fp32_rope checks the frequencies' dtype instead). Against transformers' SDPA path
# ours was bit for bit equal on the CPU (same ops in the same order), a property of today's transformers only.
BF16_LOGIT_ATOL = 0.3


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_logits_match_transformers(pairs, name, device):
    import transformers

    folder = pairs[name][0]
    ours, _ = load_pretrained(str(folder), dtype=torch.bfloat16, device=device)
    # from_pretrained, not .to(bfloat16): a cast of the module would round transformers' RoPE frequencies to bf16
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager")
    hf = hf.to(device).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32 and hf.lm_head.weight.dtype == torch.bfloat16
    ids = ids_(device)
    with torch.no_grad():
        got, ref = ours(ids).logits, hf(ids).logits
    assert got.dtype == ref.dtype == torch.bfloat16
    close(got.float(), ref.float(), atol=BF16_LOGIT_ATOL)


def test_checkpoints_exercise_what_they_claim(pairs):
    assert len(list(pairs["llama3"][0].glob("model-*.safetensors"))) > 1                  # sharded
    assert "lm_head.weight" not in load_file(pairs["qwen2"][0] / "model.safetensors")     # tied, absent from file
    q2 = pairs["qwen2"][2]
    assert q2.lm_head.weight is q2.model.embed_tokens.weight
    assert q2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0 and q2.model.layers[0].self_attn.o_proj.bias is None
    assert pairs["qwen3"][2].model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    # the llama3 scaling changes some frequencies, keeps others (so the parity test covers the rescaling)
    cfg = pairs["llama3"][2].config
    scaled, plain = rope_frequencies(cfg), rope_frequencies(replace(cfg, rope_scaling=None))
    assert (scaled == plain).any() and (scaled != plain).any()


def test_yarn_logits_match_transformers(hf_checkpoint, device):
    folder, hf = hf_checkpoint(QWEN3_YARN)
    hf, (ours, _) = hf.to(device), load_pretrained(str(folder), device=device)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    ids = ids_(device, B=1, T=200)
    plain = copy_model(ours, rope_scaling=None)  # same weights, unscaled RoPE
    with torch.no_grad():
        got, ref = ours(ids).logits, hf(ids).logits
        close(got[:, 64:], ref[:, 64:])  # beyond the original context ...
        close(got, ref)                  # ... and everywhere (the attention factor acts at every position)
        # the scaling really matters here: plain RoPE gives other logits
        assert (plain(ids).logits[:, 64:] - ref[:, 64:]).abs().max() > 0.1


@pytest.mark.parametrize("extra", [{}, dict(beta_fast=16, beta_slow=2), dict(truncate=False),
                                   dict(mscale=1.0, mscale_all_dim=0.5), dict(attention_factor=1.3)])
def test_yarn_parameters_equal_transformers(extra):
    """Every YaRN option, against transformers' _compute_yarn_parameters: inv_freq bit for bit, attention factor."""
    import transformers
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    scaling = dict(YARN, **extra)
    inv_freq, attention_factor = _compute_yarn_parameters(
        transformers.AutoConfig.for_model(**dict(QWEN3_YARN, rope_scaling=dict(scaling))))
    ours = ModelConfig.from_hf(dict(QWEN3_YARN, rope_scaling=scaling))
    assert torch.equal(rope_frequencies(ours), inv_freq)
    assert rope_attention_factor(ours) == attention_factor
    # a real YaRN: some frequencies kept, some divided by the factor, and q.k scaled
    plain = rope_frequencies(replace(ours, rope_scaling=None))
    assert (inv_freq == plain).any() and (inv_freq != plain).any() and attention_factor != 1.0


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_hidden_states_match_transformers(pairs, name, device):
    _, hf, ours = pairs[name]
    ids = ids_(device)
    with torch.no_grad():
        o, ref = ours(ids, output_hidden_states=True), hf(ids, output_hidden_states=True).hidden_states
        assert len(o.hidden_states) == len(ref) == ours.config.num_hidden_layers + 1
        for a, b in zip(o.hidden_states[:-1], ref[:-1]):
            close(a, b)
        # HF's last entry is after the final norm; ours is the raw residual stream (last_hidden is normed)
        close(ours.model.norm(o.hidden_states[-1]), ref[-1])
        close(o.last_hidden, ref[-1])


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_custom_position_ids_match_transformers(pairs, name, device):
    _, hf, ours = pairs[name]
    ids = ids_(device, T=8)
    pos = torch.tensor([[0, 1, 2, 7, 7, 30, 12, 300],       # gap, repeat, going back, far out
                        [5, 5, 5, 6, 100, 101, 102, 3]], device=device)
    with torch.no_grad():
        # an explicit all-ones attention_mask stops transformers v5 from reading non-consecutive positions as
        # packed sequences (it would then block attention across the "sequence boundaries")
        ref = hf(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
        close(ours(ids, position_ids=pos).logits, ref)
        # (T,) positions are shared by every row
        ref1 = hf(ids, position_ids=pos[:1].expand(2, -1), attention_mask=torch.ones_like(ids)).logits
        close(ours(ids, position_ids=pos[0]).logits, ref1)


def test_greedy_generation_matches_transformers(pairs, device):
    _, hf, ours = pairs["llama3"]
    ids = ids_(device, T=10)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=258)[:, ids.shape[1]:]
    assert ref.shape == (2, 32)
    assert torch.equal(ours.generate(ids, max_new_tokens=32), ref)


# ---------------------------------------------------------------------------- KV prefix, cache, masks


def test_incremental_decoding_equals_full_forward(pairs, device):
    ours = pairs["qwen3"][2]
    ids = ids_(device, T=12)
    with torch.no_grad():
        full = ours(ids).logits
        out = ours(ids[:, :5], return_kv=True)
        steps = [out.logits]
        for t in range(5, 12):
            out = ours(ids[:, t:t + 1], past_kv=out.kv, return_kv=True)
            steps.append(out.logits)
        close(torch.cat(steps, dim=1), full)
        assert out.kv[0][0].shape == (2, 2, 12, 32)  # (B, Hkv, P+T, D): the prefix is included


@pytest.mark.parametrize("custom_positions", [False, True])
def test_kv_prefix_from_separate_forward(pairs, custom_positions, device):
    folder, _, ours = pairs["llama3"]
    # another module instance of the same shape produces the prefix
    other, _ = load_pretrained(str(folder), device=device)
    ids = ids_(device, T=14)
    pos = torch.tensor([3, 9, 9, 20, 21, 22, 50, 51, 52, 53, 54, 55, 56, 57]) if custom_positions else torch.arange(14)
    pos = pos.to(device)
    with torch.no_grad():
        full = ours(ids, position_ids=pos).logits
        prefix = other(ids[:, :6], position_ids=pos[:6], return_kv=True).kv
        rest = ours(ids[:, 6:], position_ids=pos[6:] if custom_positions else None, past_kv=prefix).logits
        close(rest, full[:, 6:])


def test_explicit_causal_mask_equals_default(pairs, device):
    ours = pairs["qwen2"][2]
    ids = ids_(device, T=10)
    causal = torch.ones(10, 10, dtype=torch.bool, device=device).tril()
    with torch.no_grad():
        ref = ours(ids).logits
        for mask in (causal, causal.expand(2, 10, 10), causal.expand(2, 1, 10, 10)):
            close(ours(ids, attn_mask=mask).logits, ref)
        # with a prefix of P = 4: every new token sees the whole prefix, then causal (T, P+T)
        prefix = ours(ids[:, :4], return_kv=True).kv
        mask = torch.ones(6, 10, dtype=torch.bool, device=device).tril(diagonal=4)
        close(ours(ids[:, 4:], past_kv=prefix, attn_mask=mask).logits, ref[:, 4:])
        # and a mask really is applied: hiding the prefix changes the output
        blind = mask.clone()
        blind[:, :4] = False
        assert not torch.allclose(ours(ids[:, 4:], past_kv=prefix, attn_mask=blind).logits, ref[:, 4:])


@pytest.mark.parametrize("name", CONFIGS)
def test_attention_weights_are_what_sdpa_applies(pairs, name, device):
    """Attention.weights (evaluate.py's heatmap reads them) reproduce each layer's SDPA output, with GQA, Qwen2's
    biases and Qwen3's q/k norms, under the default causal mask and under an explicit one (a PIC-like block mask)."""
    ours = pairs[name][2]
    ids = ids_(device, T=12)
    assert_attention_weights_are_sdpas(ours, ids)
    block = masks.causal(12) & (torch.arange(12)[:, None] // 4 == torch.arange(12)[None] // 4)   # (T, T)
    for w in assert_attention_weights_are_sdpas(ours, ids, attn_mask=block.to(device)):
        assert (w[..., ~block.to(device)] == 0).all()


def test_grad_ckpt_gives_the_same_loss_and_gradients(pairs, device):
    """Activation checkpointing recomputes each block in backward (its forward runs twice) and changes no
    number: loss, every parameter's gradient and the gradient of a K/V prefix (the 500x/AOC carrier, which
    trains the encoder through the decoder) stay equal; without a backward to come, nothing is recomputed."""
    model = copy_model(pairs["qwen3"][2])
    ids, targets = ids_(device, T=10), ids_(device, T=10, seed=1)
    prefix_kv = model(ids_(device, T=4, seed=2), return_kv=True).kv
    prefix = [tuple(t.detach().requires_grad_() for t in kv) for kv in prefix_kv]
    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[0, 2], valid[1, 12:] = False, False  # a hidden prefix slot, right padding: the mask goes through too
    mask = masks.with_padding(masks.with_prefix(masks.causal(10), 4), valid).to(device)
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(1))

    def loss_and_grads(ckpt):
        model.grad_ckpt, calls[:] = ckpt, []
        model.zero_grad()
        for kv in prefix:
            for t in kv:
                t.grad = None
        logits = model(ids, attn_mask=mask, past_kv=prefix).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads |= {f"prefix.{i}.{j}": t.grad.clone() for i, kv in enumerate(prefix) for j, t in enumerate(kv)}
        return loss.detach(), grads, len(calls)

    (loss, grads, n_plain), (loss_c, grads_c, n_ckpt) = loss_and_grads(False), loss_and_grads(True)
    assert n_plain == 1 and n_ckpt == 2  # the block really was recomputed in backward
    close(loss_c, loss, atol=1e-5)
    assert grads.keys() == grads_c.keys() and len(grads) > 20
    for name in grads:
        close(grads_c[name], grads[name], atol=1e-5)
    assert all(grads[f"prefix.{i}.0"].abs().sum() > 0 for i in range(len(prefix)))  # gradients reach the prefix
    calls[:] = []
    with torch.no_grad():
        model(ids, attn_mask=mask, past_kv=prefix)
    assert len(calls) == 1  # no grad: no checkpoint, no recomputation


def test_past_kv_of_the_wrong_depth_is_an_error(pairs, device):
    ours = pairs["llama3"][2]
    prefix = ours(ids_(device, T=4), return_kv=True).kv[:2]     # 2 of its 3 layers
    with pytest.raises(ValueError, match="past_kv has 2 layers but the model has 3"):
        ours(ids_(device, T=3), past_kv=prefix)


def uncached_greedy(model, ids, n, position_ids=None, attn_mask=None, past_kv=None):
    """Greedy decoding with no KV cache, generate's reference: each step one full forward over [prompt, tokens so
    far], the next token the argmax of its last row, which sees what the last prompt token saw plus the tokens
    generated since (so every row's last prompt token must be real: no right padding). ids (B, T); position_ids
    (B, T) or (T,) (default 0..T-1 after the prefix); attn_mask (T, P+T) or (B, T, P+T) (default causal after the
    prefix). -> (B, n)."""
    B, T = ids.shape
    P = 0 if past_kv is None else past_kv[0][0].shape[2]
    pos = (torch.arange(P, P + T, device=ids.device) if position_ids is None else position_ids).expand(B, T)
    mask = masks.with_prefix(masks.causal(T), P).to(ids.device) if attn_mask is None else attn_mask
    mask = mask.expand(B, T, P + T)
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq, position_ids=pos, attn_mask=mask, past_kv=past_kv).logits[:, -1].argmax(-1)   # (B,)
            seq, pos = torch.cat([seq, nxt[:, None]], 1), torch.cat([pos, pos[:, -1:] + 1], 1)
            new_row = torch.cat([mask[:, -1:], torch.ones_like(mask[:, -1:, :1])], 2)  # the last row's keys + itself
            mask = torch.cat([torch.cat([mask, torch.zeros_like(mask[..., :1])], 2), new_row], 1)  # (B, T+1, S+1)
    return seq[:, T:]


def test_generate_with_prefix_positions_and_mask_equals_uncached_greedy(pairs, device):
    """The carrier case: KV prefix from another forward, custom prompt positions and mask; each generated token
    continues at (last prompt position + 1) and sees what the last prompt token saw, plus the generated tokens."""
    ours = pairs["qwen3"][2]
    ctx, prompt = ids_(device, T=6, seed=1), ids_(device, T=5, seed=2)
    ctx_pos = torch.tensor([1, 3, 5, 7, 9, 11], device=device)
    prompt_pos = torch.tensor([0, 20, 21, 22, 23], device=device)
    mask = torch.ones(5, 11, dtype=torch.bool, device=device).tril(diagonal=6)
    mask[:, 2] = False  # the prompt may not see context token 2
    with torch.no_grad():
        prefix = ours(ctx, position_ids=ctx_pos, return_kv=True).kv
        got = ours.generate(prompt, position_ids=prompt_pos, attn_mask=mask, past_kv=prefix, max_new_tokens=6)
    assert torch.equal(got, uncached_greedy(ours, prompt, 6, prompt_pos, mask, prefix))


def test_generate_writes_into_one_preallocated_cache(pairs, device):
    """gpt-fast's cache: each layer's K buffer is allocated once, at its final length, and every step returns a
    view of that same storage one slot longer (a torch.cat cache would be new storage of a new size each step)."""
    ours = pairs["qwen3"][2]
    ids, prefix = ids_(device, T=5), ours(ids_(device, T=3, seed=1), return_kv=True).kv  # P = 3, T = 5
    seen = []  # (storage address, storage bytes, filled length) of layer 0's keys, per forward
    hook = ours.model.layers[1].self_attn.register_forward_hook(
        lambda mod, args, out: seen.append((out[1][0].untyped_storage().data_ptr(),
                                            out[1][0].untyped_storage().nbytes(), out[1][0].shape[2])))
    try:
        ours.generate(ids, past_kv=prefix, max_new_tokens=6)
    finally:
        hook.remove()
    B, Hkv, D = 2, 2, 32
    assert [n for _, _, n in seen] == [3 + 5 + i for i in range(6)]          # prefill, then 5 fed-back tokens
    assert {(ptr, size) for ptr, size, _ in seen} == {(seen[0][0], B * Hkv * (3 + 5 + 6 - 1) * D * 4)}


def pad_rows(rows, side, seed=0):
    """Pad token lists to one length with random tokens (garbage a model would notice): -> ids (B, T), valid (B, T)."""
    g = torch.Generator().manual_seed(seed)
    T = max(map(len, rows))
    ids = torch.randint(0, 256, (len(rows), T), generator=g)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        span = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
        ids[b, span], valid[b, span] = torch.tensor(r), True
    return ids, valid


@pytest.mark.parametrize("case", ["none", "right", "left", "prefix"])
def test_padded_batch_generates_as_one_at_a_time(pairs, case, device):
    """Greedy outputs of a padded batch equal each sample generated alone, token for token, and both equal greedy
    decoding without a cache (uncached_greedy): padded prompt slots (right or left padding) and padded KV-prefix
    slots stay invisible on every decoding step (a one-row mask), and a batch with nothing padded ("none": no mask
    on the decoding steps) sees every slot. Qwen3's GQA, 4 query heads on 2 K/V heads."""
    ours = pairs["qwen3"][2]
    lengths = (7, 7, 7) if case == "none" else (5, 9, 7)
    prompts = [ids_(device, B=1, T=n, seed=10 + n + 20 * b)[0].tolist() for b, n in enumerate(lengths)]
    ids, valid = pad_rows(prompts, "left" if case == "left" else "right")
    B, T = ids.shape
    # positions count real tokens only: 0, 1, ... from each row's first real token (left padding shifts them)
    pos = (valid.cumsum(1) - 1).clamp(min=0)
    kw, alone = {}, [{} for _ in range(B)]
    if case == "prefix":
        # the 500x/AOC carrier: a KV prefix per sample with 6, 3 and 8 real slots, right-padded with garbage K/V
        ctx_lens, P = (6, 3, 8), 8
        kvs = [ours(ids_(device, B=1, T=n, seed=20 + n), return_kv=True).kv for n in ctx_lens]
        g = torch.Generator().manual_seed(1)
        past = []
        for layer in range(ours.config.num_hidden_layers):
            k, v = (torch.randn(B, 2, P, 32, generator=g).to(device) for _ in range(2))  # (B, Hkv, P, D) garbage
            for b, n in enumerate(ctx_lens):
                k[b, :, :n], v[b, :, :n] = kvs[b][layer][0][0], kvs[b][layer][1][0]
            past.append((k, v))
        prefix_valid = torch.arange(P)[None] < torch.tensor(ctx_lens)[:, None]          # (B, P)
        pos = pos + torch.tensor(ctx_lens)[:, None]  # the prompt continues after its context
        mask = masks.with_padding(masks.with_prefix(masks.causal(T), P), torch.cat([prefix_valid, valid], 1))
        kw = dict(past_kv=past)
        alone = [dict(past_kv=kv) for kv in kvs]
    else:
        mask = masks.with_padding(masks.causal(T), valid)
    ids, valid, pos, mask = (t.to(device) for t in (ids, valid, pos, mask))  # built on the host, as the methods do
    with torch.no_grad():
        # nothing padded: no mask at all, as the methods pass it (compressors.decoder_batch, evaluate.PlainLLM)
        got = ours.generate(ids, position_ids=pos, attn_mask=None if case == "none" else mask, max_new_tokens=10, **kw)
        for b, prompt in enumerate(prompts):
            one, one_pos = torch.tensor([prompt], device=device), pos[b, valid[b]]
            ref = uncached_greedy(ours, one, 10, one_pos, past_kv=alone[b].get("past_kv"))
            assert torch.equal(got[b], ref[0]), f"row {b}"
            assert torch.equal(ours.generate(one, position_ids=one_pos, max_new_tokens=10, **alone[b]), ref), f"row {b}"
    assert len({tuple(r) for r in got.tolist()}) == B and len(got.unique()) > 10  # the outputs do vary


def test_one_query_row_attention_equals_repeated_heads(device):
    """model.sdpa at one query row (each K/V head's query heads folded into rows) equals softmax(q kᵀ/√D) v written
    out with every K/V head repeated to its query heads: SmolLM2's GQA, 9 query heads on 3 K/V heads, under a
    padded one-row mask (B, 1, 1, S), a shared one (1, S) and none."""
    import model as M

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D = 2, 9, 3, 7, 16
    q, k, v = (torch.randn(*shape, generator=g).to(device) for shape in ((B, H, 1, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    padded = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padded[0, ..., :3] = False   # row 0: three padded slots
    shared = torch.ones(1, S, dtype=torch.bool)
    shared[:, 4] = False
    for mask in (padded.to(device), shared.to(device), None):
        scores = q @ k.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) / D ** 0.5     # (B, H, 1, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        want = scores.softmax(-1) @ v.repeat_interleave(H // Hkv, dim=1)                  # (B, H, 1, D)
        close(M.sdpa(q, k, v, mask, is_causal=False, scale=None), want, atol=1e-6)


def test_decoding_steps_read_the_kv_cache_in_place(monkeypatch, device):
    """At one query row, SDPA reads each layer's K/V cache buffer itself, never a copy repeated to the query heads
    (GQA: 4 query heads on 2 K/V heads), for a padded batch (a one-row mask) and an unpadded one (no mask). The
    prefill, T > 1 under a mask, still repeats K/V: the counter sees the code's repeat where there is one."""
    import model as M

    ours, _ = build_tiny()
    ours.to(device)
    counts = []   # per forward generate makes: [Tensor.repeat_interleave calls, SDPA calls reading a cache buffer]
    buffers = []  # every KVCache buffer generate allocated
    forward, repeat, attend = ours.forward, torch.Tensor.repeat_interleave, M.F.scaled_dot_product_attention

    def counted_forward(*args, **kwargs):
        counts.append([0, 0])
        return forward(*args, **kwargs)

    def counted_repeat(self, *args, **kwargs):
        counts[-1][0] += 1
        return repeat(self, *args, **kwargs)

    def counted_attention(q, k, v, **kwargs):
        cache = {t.untyped_storage().data_ptr() for c in buffers for t in (c.k, c.v) if t is not None}
        counts[-1][1] += k.untyped_storage().data_ptr() in cache and v.untyped_storage().data_ptr() in cache
        return attend(q, k, v, **kwargs)

    class RecordedCache(M.KVCache):
        def __init__(self, max_len):
            super().__init__(max_len)
            buffers.append(self)

    monkeypatch.setattr(ours, "forward", counted_forward)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", counted_repeat)
    monkeypatch.setattr(M.F, "scaled_dot_product_attention", counted_attention)
    monkeypatch.setattr(M, "KVCache", RecordedCache)
    ids, valid = pad_rows([ids_(device, B=1, T=n, seed=n)[0].tolist() for n in (5, 9)], "left")
    L = ours.config.num_hidden_layers
    for mask in (masks.with_padding(masks.causal(9), valid).to(device), None):
        counts[:], buffers[:] = [], []
        ours.generate(ids.to(device), attn_mask=mask, max_new_tokens=6)
        assert len(counts) == 6   # the prefill, then 5 decoding steps
        assert counts[0] == ([2 * L, 0] if mask is not None else [0, L])   # prefill: repeated under a mask
        assert counts[1:] == [[0, L]] * 5, counts   # every step: no repeat, every layer reads its own buffers


def test_generate_stops_and_pads_with_eos(pairs, device):
    ours = pairs["llama3"][2]
    ids = ids_(device, T=6)
    with torch.no_grad():
        free = ours.generate(ids, max_new_tokens=12)
        eos = int(free[0, 2])  # declare row 0's third token the eos
        pad = next(i for i in range(256, 300) if i not in free)  # a second stop id that never comes up
        got = ours.generate(ids, max_new_tokens=12, eos_id=[pad, eos])  # several stop ids are allowed
        alone = ours.generate(ids[:1], max_new_tokens=12, eos_id=eos)
    first = [next((i for i, t in enumerate(row.tolist()) if t == eos), None) for row in free]
    assert first[0] <= 2 and alone.shape == (1, first[0] + 1)  # the only row is done -> stop right there
    n = 12 if first[1] is None else max(first) + 1                # stop when every row is done
    assert got.shape == (2, n)
    for row, f in enumerate(first):
        kept = n if f is None else f + 1
        assert torch.equal(got[row, :kept], free[row, :kept])
        assert (got[row, kept:] == pad).all()  # a finished row is padded with the first eos id


# ---------------------------------------------------------------------------- AOC blocks


def test_aoc_block_is_identity_mlp(pairs, device):
    folder, _, full = pairs["llama3"]
    aoc, _ = load_pretrained(str(folder), mlp="aoc", device=device)  # a full checkpoint: the MLP tensors are skipped
    assert not any(".mlp." in k for k in aoc.state_dict())
    ids = ids_(device, T=7)
    with torch.no_grad():
        # hand computation of AOC Eq. (3) for layer 0: h = LN_pre(h); h = MHA(h) + h; h = LN_post(h) + h
        layer, h = aoc.model.layers[0], aoc.model.embed_tokens(ids)
        pos = torch.arange(7, device=device)
        freqs = pos[:, None].float() * aoc.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        attn, _ = layer.self_attn(layer.input_layernorm(h), emb.cos(), emb.sin(), None)
        h = h + attn
        x = h.float()
        h = h + layer.post_attention_layernorm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        close(aoc(ids, output_hidden_states=True).hidden_states[1], h, atol=1e-6)
        # the attention weights are the full model's: with the MLP, layer 0 would differ by exactly the MLP output
        f0 = full.model.layers[0]
        assert torch.equal(f0.self_attn.q_proj.weight, layer.self_attn.q_proj.weight)
        assert not torch.allclose(full(ids, output_hidden_states=True).hidden_states[1], h)


def test_mlp_none_has_no_second_sub_block(pairs, device):
    folder = pairs["llama3"][0]
    bare, _ = load_pretrained(str(folder), mlp="none", device=device)
    assert not any(".mlp." in k or "post_attention_layernorm" in k for k in bare.state_dict())
    ids = ids_(device, T=5)
    with torch.no_grad():
        layer, h = bare.model.layers[0], bare.model.embed_tokens(ids)
        emb = torch.cat([torch.arange(5, device=device)[:, None].float() * bare.inv_freq] * 2, -1)
        h = h + layer.self_attn(layer.input_layernorm(h), emb.cos(), emb.sin(), None)[0]  # attention only
        close(bare(ids, output_hidden_states=True).hidden_states[1], h, atol=1e-6)


# ---------------------------------------------------------------------------- chunked cross-entropy


def ce_problem(device, N=1000, d=32, V=2000, seed=0):
    """hidden (N, d) and an lm_head (V x d) that need grad, targets (N,) with some -100 (no loss taken)."""
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(d, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, d, generator=g))
    hidden = torch.randn(N, d, generator=g).to(device).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::7] = -100
    return hidden, lm_head.to(device), targets.to(device)


def plain_cross_entropy(hidden, lm_head, targets):
    return torch.nn.functional.cross_entropy(lm_head(hidden).float(), targets, reduction="sum")


def test_chunked_cross_entropy_equals_plain(device):
    hidden, lm_head, targets = ce_problem(device)
    results = []
    for fn in (plain_cross_entropy, lambda h, w, t: chunked_cross_entropy(h, w, t, chunk=256)):  # 1000 = 3x256 + 232
        hidden.grad = lm_head.weight.grad = None
        loss = fn(hidden, lm_head, targets)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), lm_head.weight.grad.clone()))
    (loss, g_h, g_w), (loss_c, g_h_c, g_w_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)  # a sum of ~850 terms: relative
    close(g_h_c, g_h, atol=1e-5)
    close(g_w_c, g_w, atol=1e-5)


def test_chunked_cross_entropy_per_position_equals_plain(device):
    """reduction "none" (train.py's --own-other-weight reads each token's loss): each position's CE, chunked or kept,
    with the plain call's gradients."""
    hidden, lm_head, targets = ce_problem(device)
    plain = torch.nn.functional.cross_entropy(lm_head(hidden).float(), targets, reduction="none")
    weights = torch.rand(len(targets), device=device)   # a gradient that tells the positions apart
    want = torch.autograd.grad((plain * weights).sum(), hidden)[0]
    for keep_below in (0, 2 ** 26):   # in 256-chunks (1000 = 3x256 + 232), and kept
        got = chunked_cross_entropy(hidden, lm_head, targets, chunk=256, keep_below=keep_below, reduction="none")
        close(got, plain, atol=1e-5)
        close(torch.autograd.grad((got * weights).sum(), hidden)[0], want, atol=1e-5)


def test_chunked_cross_entropy_saves_no_logits(device):
    """What autograd keeps for backward, summed over saved tensors: the plain loss keeps at least the fp32
    logits' worth (N x V x 4 bytes); the chunked one only its inputs, however large the vocabulary."""
    hidden, lm_head, targets = ce_problem(device)
    N, d, V = hidden.shape[0], hidden.shape[1], lm_head.out_features

    def saved_bytes(fn):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(hidden, lm_head, targets)
        return total

    assert saved_bytes(plain_cross_entropy) >= N * V * 4
    chunked = saved_bytes(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk=256, keep_below=0))
    assert chunked <= N * d * 4 + N * 8  # the hidden rows and the int64 targets, nothing V-sized
    assert chunked < N * V * 4 / 10


def test_small_logits_are_kept_not_recomputed(device):
    """Below keep_below bytes of fp32 logits, lm_head runs once a step (forward only), as in the plain call, with
    the plain call's loss and gradients; above it, twice (its backward recomputes each chunk's logits)."""
    hidden, lm_head, targets = ce_problem(device)
    N, V = hidden.shape[0], lm_head.out_features
    for keep_below, calls_expected in ((N * V * 4 + 1, 1), (N * V * 4, 4)):   # 1000 positions in 256-chunks: 4
        calls = []
        handle = lm_head.register_forward_hook(lambda *a: calls.append(1))
        hidden.grad = lm_head.weight.grad = None
        chunked_cross_entropy(hidden, lm_head, targets, chunk=256, keep_below=keep_below).backward()
        handle.remove()
        assert len(calls) == calls_expected * (1 if calls_expected == 1 else 2)
    hidden.grad = lm_head.weight.grad = None
    loss = chunked_cross_entropy(hidden, lm_head, targets)   # the default keeps these 8 MB
    loss.backward()
    g_h, g_w = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad = lm_head.weight.grad = None
    plain = plain_cross_entropy(hidden, lm_head, targets)
    plain.backward()
    assert torch.equal(loss, plain) and torch.equal(g_h, hidden.grad) and torch.equal(g_w, lm_head.weight.grad)


# ---------------------------------------------------------------------------- LoRA


@pytest.fixture
def tiny(device):
    return build_tiny(seed=0)[0].to(device)


def test_lora_zero_init_changes_nothing_and_freezes_the_rest(tiny, device):
    ids = ids_(device)
    with torch.no_grad():
        before = tiny(ids).logits
    q_weight = tiny.model.layers[0].self_attn.q_proj.weight
    names = add_lora(tiny, r=4, alpha=8)
    assert tiny.model.layers[0].self_attn.q_proj.weight is q_weight  # shared, not copied
    assert "model.layers.0.self_attn.q_proj.weight" in tiny.state_dict()  # base keys unchanged
    assert len(names) == 4 * 2 * 2 and all("lora_" in n for n in names)  # 4 layers x {q, v} x {A, B}
    assert sorted(n for n, p in tiny.named_parameters() if p.requires_grad) == sorted(names)
    with torch.no_grad():
        close(tiny(ids).logits, before, atol=0)


def test_lora_disable(tiny, device):
    ids = ids_(device)
    with torch.no_grad():
        base = tiny(ids).logits
        add_lora(tiny, targets=("q_proj", "v_proj", "o_proj"), r=4, alpha=8)
        for n, p in tiny.named_parameters():  # a training-like perturbation of B
            if "lora_B" in n:
                p.normal_(0, 0.05)
        adapted = tiny(ids).logits
        assert not torch.allclose(adapted, base, atol=1e-3)
        with lora_disabled(tiny):
            close(tiny(ids).logits, base, atol=0)
        close(tiny(ids).logits, adapted, atol=0)  # re-enabled on exit


def test_lora_trains_only_lora(tiny, device):
    add_lora(tiny)
    tiny(ids_(device)).logits.logsumexp(-1).mean().backward()
    grads = {n for n, p in tiny.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)


def test_lora_dropout_acts_on_the_lora_branch_only(tiny, device):
    """PEFT's LoRA: y = base(x) + B(A(dropout(x))) * scale; eval mode and p = 0 are deterministic."""
    add_lora(tiny, r=4, alpha=8, dropout=0.3)
    layer = tiny.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.5)  # B = 0 would hide the branch (and its dropout) entirely
    x = torch.randn(3, 5, 64, device=device)
    base = torch.nn.functional.linear(x, layer.weight)
    lora = lambda inp: torch.nn.functional.linear(torch.nn.functional.linear(inp, layer.lora_A), layer.lora_B) * 2
    with torch.no_grad():
        tiny.eval()
        close(layer(x), base + lora(x), atol=1e-6)  # eval: no dropout
        tiny.train()
        torch.manual_seed(0)
        y1 = layer(x)
        torch.manual_seed(0)
        close(y1, base + lora(torch.nn.functional.dropout(x, 0.3, training=True)), atol=1e-6)  # x dropped, base not
        assert not torch.allclose(layer(x), y1)  # a fresh dropout mask each call
        with lora_disabled(tiny):
            close(layer(x), base, atol=0)  # the base path never sees the dropout
    plain = LoRALinear(torch.nn.Linear(64, 32, device=device), r=4).train()  # default p = 0: deterministic in train too
    plain.lora_B.data.normal_()
    assert torch.equal(plain(x), plain(x))


def test_lora_A_init_is_peft_bound(device):
    """kaiming_uniform(a=√5) on A of shape (r, in) bounds A by 1/√in (PEFT); an (in, r) A would reach 1/√r."""
    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(2048, 64, bias=False, device=device), r=8)
    bound = 1 / 2048 ** 0.5
    assert layer.lora_A.shape == (8, 2048)
    assert 0.9 * bound <= layer.lora_A.abs().max() <= bound


# ---------------------------------------------------------------------------- tiny, tokenizer, dtype, config


def test_tiny_is_deterministic_and_works(device):
    (a, tok), (b, _), (c, _) = build_tiny(0), build_tiny(0), build_tiny(1)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    load_pretrained("tiny")
    assert torch.equal(state, torch.get_rng_state())  # the caller's RNG is untouched
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    text = "Hello, wörld! 你好 🙂\n\ttabs"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 256
    assert tok.encode(text, bos=True) == [tok.bos_id] + ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text  # specials skipped
    out = a.to(device)(torch.tensor([ids], device=device))
    assert out.logits.shape == (1, len(ids), a.config.vocab_size) and torch.isfinite(out.logits).all()
    assert tok.vocab_size <= a.config.vocab_size


def test_bf16_forward_and_fp32_rope(pairs, device):
    folder, _, ours = pairs["qwen3"]
    model, _ = load_pretrained(str(folder), dtype=torch.bfloat16, device=device)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    ids = ids_(device)
    with torch.no_grad():
        out = model(ids).logits
        assert out.dtype == torch.bfloat16
        ref = ours(ids).logits
        assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
    model.float().bfloat16()  # a cast of the whole module must not round the RoPE frequencies
    assert model.inv_freq.dtype == torch.float32


def test_config_v4_and_v5_rope_layouts_agree():
    v4 = dict(LLAMA3)
    v5 = {k: v for k, v in LLAMA3.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA3["rope_scaling"]}
    a, b = ModelConfig.from_hf(v4), ModelConfig.from_hf(v5)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling["factor"] == 8.0
    assert ModelConfig.from_hf(a.to_hf()) == a
    # yarn too; both layouts fill in HF's defaults (original context = max_position_embeddings, factor = ratio)
    yarn_v4 = dict(QWEN3_YARN)
    yarn_v5 = {k: v for k, v in QWEN3_YARN.items() if k not in ("rope_theta", "rope_scaling")}
    yarn_v5["rope_parameters"] = {"rope_theta": 1000000.0, **YARN}
    a, b = ModelConfig.from_hf(yarn_v4), ModelConfig.from_hf(yarn_v5)
    assert a == b and a.rope_scaling == YARN and ModelConfig.from_hf(a.to_hf()) == a
    bare = ModelConfig.from_hf(dict(QWEN3_YARN, rope_scaling=dict(rope_type="yarn", factor=None)))
    assert bare.rope_scaling == dict(rope_type="yarn", factor=1.0, original_max_position_embeddings=256)
    q2 = ModelConfig.from_hf(QWEN2)
    assert q2.attention_bias and not q2.qk_norm and q2.head_dim == 16
    assert ModelConfig.from_hf(QWEN3).head_dim == 32 and ModelConfig.from_hf(QWEN3).qk_norm
    aoc = replace(a, mlp="aoc")
    assert ModelConfig.from_hf(aoc.to_hf()) == aoc


# ---------------------------------------------------------------------------- errors


def test_error_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found: .*nope"):
        load_pretrained(str(tmp_path / "nope"))


def test_error_no_weights(tmp_path, pairs):
    shutil.copy(pairs["qwen3"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no safetensors weights in"):
        load_pretrained(str(tmp_path))


def test_error_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(GPT2LMHeadModel\); supported "
                                         r"model_type: llama, qwen2, qwen3, mistral"):
        load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
        ModelConfig.from_hf({**QWEN3, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_error_wrong_shape_missing_unexpected(tmp_path, pairs):
    src = pairs["qwen3"][0]
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(src / f, tmp_path / f)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:32]
    sd["model.layers.0.mlp.gate.weight"] = sd.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_pretrained(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert "missing: model.layers.0.mlp.gate_proj.weight" in msg
    assert "unexpected: model.layers.0.mlp.gate.weight" in msg
    assert "wrong shape: model.layers.1.self_attn.k_proj.weight (32, 64) (model wants (64, 64))" in msg


def test_error_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="hub is unreachable .*pass a local directory"):
        load_pretrained("ctxcomp-tests/surely-not-cached")


# ---------------------------------------------------------------------------- a real pretrained model


PROSE = ("The history of the town goes back to the twelfth century, when a small group of farmers settled near "
         "the river. Over the next two hundred years the village grew into a busy market town. Every week, "
         "merchants came from the surrounding countryside to sell grain, wool and cattle. In the sixteenth "
         "century a stone bridge was built across the river, and the town became an important stop on the road "
         "to the capital.")


@needs_smollm2
def test_smollm2_perplexity_and_parity(device):
    import transformers

    model, tok = load_pretrained(str(SMOLLM2), device=device)
    ids = torch.tensor([tok.encode(PROSE)], device=device)
    with torch.no_grad():
        logits = model(ids).logits
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        assert nll.exp() < 40, f"perplexity {nll.exp():.1f}"
        hf = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).to(device).eval()
        close(logits, hf(ids).logits)
