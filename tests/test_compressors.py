"""Each method's defining property, on the `tiny` model: what may train, what the decoder receives,
which positions it sees, what must not change. Positions are checked against the EPL paper's numbers
written out literally, never recomputed with positions.py."""

import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import cli  # noqa: E402
import compressors as C  # noqa: E402
import data as D  # noqa: E402
import presets as P  # noqa: E402
import masks  # noqa: E402
from hf import LLAMA_3_2_1B_CONFIG  # noqa: E402
from model import TINY_CONFIG, ModelConfig, Transformer, build_tiny  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April! "
        "Were the clocks striking thirteen? Nobody knew.\nA new line starts here. ") * 2


def tiny(device):
    """build_tiny() on `device`; seeds torch first, so the compressor's own draws repeat too."""
    torch.manual_seed(0)
    model, tok = build_tiny()
    return model.to(device), tok


def capture(module, name="forward"):
    """Wrap module.forward (or generate) and record the keyword arguments of every call."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(kwargs if not args else {**kwargs, "input_ids": args[0]})
        return original(*args, **kwargs)
    setattr(module, name, wrapper)
    return calls


def step(comp, contexts, lr=1e-2):
    """One optimiser step on the AE loss; returns a snapshot of every parameter before the step."""
    before = {n: p.detach().clone() for n, p in comp.named_parameters()}
    opt = torch.optim.SGD(comp.trainable_parameters(), lr=lr)
    memory = comp.compress(contexts)
    loss, _ = comp.lm_loss(memory, "ae", [list(c) + [comp.tok.eos_id] for c in contexts])
    loss.backward()
    opt.step()
    return before


def changed(comp, before):
    return {n for n, p in comp.named_parameters() if not torch.equal(p.detach(), before[n])}


def batch_atol(device):
    """How far one segment's memory may move when the batch around it changes (other rows, other lengths). On the
    CPU: 1e-6 (measured 3.6e-7, 1.5 fp32 ulps at |x| = 3.3). On CUDA the GEMM and attention kernels are picked per
    shape, so the same row summed inside a batch of another size is summed in another order, an ulp or two per op
    over four layers: 1e-5, about 40 ulps at |x| = 3.3, and still far below what a leak between segments moves."""
    return 1e-6 if device.type == "cpu" else 1e-5


def test_an_unpadded_causal_encoder_batch_runs_without_a_mask_and_never_repeats_kv(device):
    """Rows of equal length under the plain causal rule go to the encoder with no mask (SDPA's causal kernel reads
    each K/V head in place); their memory equals the masked forward's. A padded batch, or PIC's rule, keeps its mask."""
    dec, tok = tiny(device)
    comp = C.build("500x", dec, tok, mem=3, chunk_len=32)
    same = [tok.encode("Twelve letters"), tok.encode("Twelve bottles")]
    assert len(same[0]) == len(same[1])
    inputs = C.on_device(comp.encoder_inputs(same), comp.device)
    assert inputs.attn is None
    repeats = []
    original = torch.Tensor.repeat_interleave
    torch.Tensor.repeat_interleave = lambda t, *a, **k: repeats.append(1) or original(t, *a, **k)
    try:
        kv = comp.encode(inputs).kv
    finally:
        torch.Tensor.repeat_interleave = original
    assert repeats == []
    masked = C.on_device(comp.encoder_inputs(same), comp.device)
    masked.attn = masks.stack_padded([masks.causal(len(row.ids), row.slots) for row in masked.rows], masked.ids.shape[1])
    for (k, v), (k_m, v_m) in zip(kv, comp.encode(masked).kv, strict=True):
        torch.testing.assert_close(k, k_m.to(k.device), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, v_m.to(v.device), rtol=1e-5, atol=1e-6)
    assert comp.encoder_inputs([same[0], same[0][:-2]]).attn is not None   # padded
    assert C.build("pic", dec, tok, mem=3, chunk_len=32).encoder_inputs(same).attn is not None


# ---------------------------------------------------------------------------- ICAE


def test_icae_memory_is_final_norm_hidden_states_of_lora_encoder(device):
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, mem=4, chunk_len=16, lora_r=4, lora_alpha=8)
    with torch.no_grad():   # LoRA B starts at zero; make it matter so "LoRA on" is visible
        for n, p in dec.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = tok.encode("Compress this short context.")[:12]
    memory = comp.compress([ids])
    # by hand: [[BOS], context, memory tokens] through the LoRA'd LLM, causal, positions 0..n+m (DPL); the
    # context starts with [BOS] as in the ICAE and EPL code
    x = torch.cat([dec.model.embed_tokens(torch.tensor([tok.bos_id] + ids, device=device)), comp.mem_tokens[:4]])[None]
    out = dec(inputs_embeds=x, output_hidden_states=True)
    raw = out.hidden_states[-1][0, len(ids) + 1:]
    want = dec.model.norm(raw)   # ICAE: the memory is the *final-norm* output
    torch.testing.assert_close(memory.embeds[0], want, rtol=0, atol=1e-5)
    assert (want - raw).abs().max() > 1e-3   # the final norm really is applied
    # ... and the LoRA really is on in the encoder (without it the memory differs)
    from lora import lora_disabled
    with lora_disabled(dec):
        plain = dec.model.norm(dec(inputs_embeds=x, output_hidden_states=True).hidden_states[-1][0, len(ids) + 1:])
    assert (plain - want).abs().max() > 1e-3


def test_icae_decoder_is_the_frozen_llm_without_lora_and_only_lora_mem_specials_train(device):
    dec, tok = tiny(device)
    ref, _ = tiny(device)                             # the untouched LLM, same seed
    comp = C.build("icae", dec, tok, mem=4, chunk_len=16, lora_r=4, lora_alpha=8)
    trainable = {n for n, p in comp.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if "lora_" in n} | {"mem_tokens", "ae_embed", "lm_embed"}
    assert {"mem_tokens", "ae_embed", "lm_embed"} <= trainable and any("lora_A" in n for n in trainable)
    ctx = [tok.encode("Some context to squeeze. And more of it.")]
    before = step(comp, ctx)
    after = changed(comp, before)
    assert after and all("lora_" in n or n in ("mem_tokens", "ae_embed", "lm_embed") for n in after)
    # the decoder pass sees exactly the original LLM: same output as a fresh copy of the weights
    ids = torch.tensor([tok.encode("decoder check")], device=device)
    with comp.decoding():
        got = dec(ids).logits
    torch.testing.assert_close(got, ref(ids).logits, rtol=0, atol=0)
    assert (dec(ids).logits - got).abs().max() > 0   # outside decoding() the LoRA is live


# ---------------------------------------------------------------------------- 500x / AOC


@pytest.mark.parametrize("method", ["500x", "aoc"])
def test_kv_carrier_decoder_sees_only_memory_kv_at_encoder_positions(method, device):
    dec, tok = tiny(device)
    # the original 500xCompressor code: AE only, from [BOS], no [BOS] in the context (train.py's 500x `ae` recipe)
    original = dict(ae_token="bos", bos=False) if method == "500x" else {}
    comp = C.build(method, dec, tok, mem=3, chunk_len=32, **original)
    ids = tok.encode("Only the memory may reach the decoder.")[:20]
    memory = comp.compress([ids])
    calls = capture(dec, "generate")
    comp.generate(memory, "ae", max_new_tokens=3)
    kw = calls[0]
    # the decoder's own input is the single regeneration token [BOS] (500x; AOC Eq. 4), no context token
    assert kw["inputs_embeds"].shape[1] == 1
    torch.testing.assert_close(kw["inputs_embeds"][0, 0], dec.model.embed_tokens.weight[tok.bos_id])
    # ... and the K/V prefix holds exactly the 3 memory slots, for every layer
    assert len(kw["past_kv"]) == dec.config.num_hidden_layers
    assert all(k.shape[2] == 3 and v.shape[2] == 3 for k, v in kw["past_kv"])
    # those keys carry the encoder's positions: DPL puts memory at L..L+M-1 = 20, 21, 22 (EPL Table 13)
    enc = comp.encoder
    x = torch.cat([enc.model.embed_tokens(torch.tensor(ids, device=device)), comp.mem_tokens[:3]])[None]
    out = enc(inputs_embeds=x, position_ids=torch.arange(23, device=device)[None], return_kv=True)
    shifted = enc(inputs_embeds=x, position_ids=torch.arange(23, device=device)[None] + 7, return_kv=True)
    for layer, (k, v) in enumerate(kw["past_kv"]):
        torch.testing.assert_close(k[0], out.kv[layer][0][0, :, 20:23], rtol=0, atol=1e-5)
        torch.testing.assert_close(v[0], out.kv[layer][1][0, :, 20:23], rtol=0, atol=1e-5)
    # (keys do depend on the positions: the same slots computed 7 positions later differ)
    assert (shifted.kv[0][0][0, :, 20:23] - out.kv[0][0][0, :, 20:23]).abs().max() > 1e-3


def test_aoc_encoder_has_no_mlp_and_trains_every_weight(device):
    dec, tok = tiny(device)
    comp = C.build("aoc", dec, tok, mem=4, chunk_len=32)
    names = [n for n, _ in comp.encoder.named_parameters()]
    assert not any(".mlp." in n for n in names)                               # AOC Eq. (3)
    assert any("post_attention_layernorm" in n for n in names)                # LN_post is kept (Eq. 3, blue)
    # AOC code: the prompt is embedded with the frozen LLM's table (self.llm.get_input_embeddings())
    assert comp.encoder.model.embed_tokens is comp.decoder.model.embed_tokens
    assert not comp.encoder.model.embed_tokens.weight.requires_grad
    own = [p for n, p in comp.encoder.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    assert own and all(p.requires_grad for p in own)                         # no LoRA: every block weight trains
    assert not any(p.requires_grad for p in comp.decoder.parameters())       # the decoder is frozen
    # the encoder is a copy, not the decoder: training it leaves the decoder bit-identical
    before = step(comp, [tok.encode("attention only")])
    assert not any(n.startswith("decoder.") for n in changed(comp, before))
    assert any(n.startswith("encoder.") for n in changed(comp, before))
    # ablation: the literal removal drops LN_post too
    lit = C.build("aoc", *tiny(device), mem=4, chunk_len=32, mlp="none")
    assert not any("post_attention_layernorm" in n for n, _ in lit.encoder.named_parameters())


def test_aoc_parameter_count_on_llama_3_2_1b_config():
    # Llama-3.2-1B config.json, built on the meta device (no download, no memory)
    hf = LLAMA_3_2_1B_CONFIG
    count = lambda m: sum(p.numel() for p in m.parameters())   # tied embeddings counted once
    with torch.device("meta"):
        full = count(Transformer(ModelConfig.from_hf(hf)))
        aoc = count(Transformer(ModelConfig.from_hf({**hf, "mlp": "aoc"})))
    fewer = 1 - aoc / full
    print(f"\nLlama-3.2-1B: full {full / 1e6:.1f}M params, AOC encoder {aoc / 1e6:.1f}M, {100 * fewer:.1f}% fewer")
    assert full == 1_235_814_400                         # the published 1.24B
    assert aoc == full - 16 * 3 * 2048 * 8192            # exactly the MLPs removed
    assert 0.62 < fewer < 0.70                           # AOC §1: "roughly 67% less parameters"


# ---------------------------------------------------------------------------- generation


def uncached_greedy(dec, batch, n):
    """Greedy decoding of a left-padded decoder batch with no KV cache, comp.generate's reference: each step one full
    decoder forward over [the batch's inputs, the tokens so far], the next token the argmax of its last row, which
    sees what the last input saw plus the tokens generated since. -> (B, n)."""
    x, pos, mask, past = batch["inputs_embeds"], batch["position_ids"], batch["attn_mask"], batch["past_kv"]
    B, T = x.shape[:2]
    P = 0 if past is None else past[0][0].shape[2]
    if mask is None:   # nothing padded: the decoder's default, causal after the prefix
        mask = masks.with_prefix(masks.causal(T), P).to(x.device).expand(B, T, P + T)
    tokens = []
    for _ in range(n):
        nxt = dec(inputs_embeds=x, position_ids=pos, attn_mask=mask, past_kv=past).logits[:, -1].argmax(-1)  # (B,)
        tokens.append(nxt)
        x = torch.cat([x, dec.model.embed_tokens(nxt)[:, None]], 1)                     # (B, T+1, d)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)                                      # (B, T+1)
        new_row = torch.cat([mask[:, -1:], torch.ones_like(mask[:, -1:, :1])], 2)       # the last row's keys + itself
        mask = torch.cat([torch.cat([mask, torch.zeros_like(mask[..., :1])], 2), new_row], 1)  # (B, T+1, S+1)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("method", ["icae", "500x"])
def test_generate_equals_uncached_greedy_decoding(method, device):
    """comp.generate (the decoder's KV cache, one query row per step) gives the tokens of greedy decoding without a
    cache, for memories of one length (nothing padded: no mask on the decoding steps) and of different lengths
    (ICAE: left-padded embedding rows; 500x: padded K/V slots); the tiny decoder's GQA is 4 query heads on 2 K/V."""
    dec, tok = tiny(device)
    comp = C.build(method, dec, tok, mem=4, chunk_len=16)
    same = [tok.encode(TEXT[i:i + 30])[:30] for i in (0, 40, 80)]      # one chunk each: 4 slots
    mixed = [tok.encode(TEXT[i:i + n]) for i, n in ((0, 10), (40, 45), (90, 28))]  # 1, 3 and 2 chunks
    for contexts in (same, mixed):
        with torch.no_grad():
            memory = comp.compress(contexts)
            got = comp.generate(memory, "ae", max_new_tokens=12)
            batch = comp.decoder_batch(memory, "ae", [[] for _ in contexts], [0] * len(contexts), left_pad=True)
            with comp.decoding():
                ref = uncached_greedy(dec, batch, 12)
        assert (batch["attn_mask"] is None) == (contexts is same)   # the padded case really is padded
        assert got == [tok.cut_at_eos(row) for row in ref.tolist()]
        assert len({tuple(row) for row in got}) == len(contexts)      # the memories do steer the decoder


# ---------------------------------------------------------------------------- PCC / PIC


def small_compressor(dec):
    """A separate compressor LLM of another size (narrower, fewer layers), same vocabulary, on dec's device."""
    cfg = replace(dec.config, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    torch.manual_seed(1)
    return Transformer(cfg).to(dec.lm_head.weight.device)


@pytest.mark.parametrize("method", ["pcc", "pic"])
def test_pcc_pic_encoder_has_no_unused_lm_head_and_old_checkpoints_still_load(method, device, tmp_path):
    """PCC/PIC's compressor LLM is read for its hidden states, never its logits. With untied embeddings (Llama-2/3,
    the papers' 8B) an lm_head would train nothing and be saved, 525M parameters at 8B: the encoder has none, the loss
    is the one the encoder with it gives, and a checkpoint that holds one loads (the tensor left out)."""
    torch.manual_seed(0)
    untied = Transformer(ModelConfig.from_hf({**TINY_CONFIG, "tie_word_embeddings": False})).to(device)
    tok = build_tiny()[1]
    comp = C.build(method, untied, tok, mem=4, chunk_len=16)
    names = [n for n, _ in comp.named_parameters()]
    assert not [n for n in names if n.startswith("encoder.lm_head")] and comp.encoder.lm_head is None
    V, d = TINY_CONFIG["vocab_size"], TINY_CONFIG["hidden_size"]
    with_head = Transformer(ModelConfig.from_hf({**TINY_CONFIG, "tie_word_embeddings": False}))
    assert sum(p.numel() for p in comp.encoder.parameters()) == sum(p.numel() for p in with_head.parameters()) - V * d
    ctx = [list(TEXT.encode())[:16], list(TEXT.encode())[20:36]]
    loss, _ = comp.lm_loss(comp.compress(ctx), "ae", [c + [tok.eos_id] for c in ctx])
    comp.encoder.lm_head = nn.Linear(d, V, bias=False).to(device)   # the head back: the same loss, to the bit
    again, _ = comp.lm_loss(comp.compress(ctx), "ae", [c + [tok.eos_id] for c in ctx])
    assert torch.equal(loss, again)
    old = {**checkpoint.trained_state(comp), "encoder.lm_head.weight": comp.encoder.lm_head.weight.detach().clone()}
    comp.encoder.lm_head = None
    checkpoint.load_trained(comp, old)   # a checkpoint that holds the head: loads


def test_pcc_pic_separate_compressor_with_converter(device):
    dec, tok = tiny(device)
    enc = small_compressor(dec)
    pcc = C.build("pcc", dec, tok, encoder_model=enc, ratio=4.0, chunk_len=64)
    assert pcc.encoder is enc and pcc.encoder.config.hidden_size != dec.config.hidden_size
    memory = pcc.compress([tok.encode("Sixteen tokens of text to pack in.")[:16]])
    assert memory.embeds.shape == (1, 4, dec.config.hidden_size)   # 16 tokens / ratio 4, at decoder width
    assert all(p.requires_grad for p in enc.parameters())           # PCC/PIC: full fine-tuning


def test_pic_memory_token_sees_only_its_chunk_and_earlier_memory(device):
    dec, tok = tiny(device)
    enc = small_compressor(dec)
    ids = tok.encode("abcdefghijklmnopqrstuvwx")[:24]                 # 3 chunks of 8, one memory each
    later = ids[:8] + tok.encode("ZZZZZZZZZZZZZZZZ")[:16]             # chunks 2 and 3 replaced
    earlier = tok.encode("QQQQQQQQ")[:8] + ids[8:]                    # chunk 1 replaced
    for mask in ("pic", "causal"):
        comp = C.build("pcc", dec, tok, encoder_model=enc, ratio=8.0, chunk_len=64, mask=mask)
        with torch.no_grad():
            m, m_later, m_earlier = (comp.compress([x]).embeds[0] for x in (ids, later, earlier))
        first_unchanged = torch.equal(m[0], m_later[0])
        if mask == "pic":   # PIC Eq. (5): m_1 sees chunk 1 only; m_2 sees chunk 2 and m_1
            assert first_unchanged
            assert not torch.equal(m[1], m_later[1])
            assert not torch.equal(m[1], m_earlier[1])   # through m_1, chunk 1 still reaches m_2
        else:               # the full causal baseline lets m_1 read every chunk
            assert not first_unchanged


# ---------------------------------------------------------------------------- EPL


@pytest.mark.parametrize("carrier", ["embeds", "kv"])
def test_epl_positions_fed_to_encoder_and_decoder_match_the_paper(carrier, device):
    # EPL worked example: k = 2 chunks of L = 510, |M| = 102 (r = 5), p = 1020
    dec, tok = tiny(device)
    method = "icae" if carrier == "embeds" else "500x"
    comp = C.build(method, dec, tok, mem=102, chunk_len=510, layout="epl", lora_r=2, lora_alpha=4, bos=False)
    torch.manual_seed(0)
    ctx = torch.randint(0, 250, (1020,)).tolist()
    enc_calls = capture(dec)   # the LoRA encoder is the decoder module: first call = encoder
    with torch.no_grad():
        memory = comp.compress([ctx])
        comp.lm_loss(memory, "ae", [ctx])
        comp.lm_loss(memory, "lm", [ctx[:50]])
    enc_pos, ae_pos, lm_pos = (c["position_ids"] for c in enc_calls)
    # EPL Table 12 (EPL encoder): chunk 1 context 1..510, memory 3, 8, ..., 508; chunk 2 511..1020, 513..1018
    assert enc_pos[0, :510].tolist() == list(range(1, 511))
    assert enc_pos[0, 510:612].tolist() == list(range(3, 509, 5))
    assert enc_pos[1, :510].tolist() == list(range(511, 1021))
    assert enc_pos[1, 510:612].tolist() == list(range(513, 1019, 5))
    mem = list(range(3, 509, 5)) + list(range(513, 1019, 5))
    # EPL Table 13 (AE, EPL): memory keeps 3..508, 513..1018; [AE] at 0; x_0..x_1019 at 1..1020
    # EPL Table 14 (LM, EPL): [LM] at p = 1020; the continuation from 1021
    if carrier == "embeds":
        assert ae_pos[0, :204].tolist() == mem and lm_pos[0, :204].tolist() == mem
        ae_pos, lm_pos = ae_pos[:, 204:], lm_pos[:, 204:]
    else:   # the K/V prefix carries the memory; the decoder's own inputs start at [AE]/[LM]
        assert ae_pos.shape[1] == 1 + 1020
    assert ae_pos[0].tolist() == [0] + list(range(1, 1021))
    assert lm_pos[0].tolist() == [1020] + list(range(1021, 1071))


def test_dpl_icae_decoder_positions_match_the_paper(device):
    # EPL Table 13, DPL(ICAE): memory 0..203, [AE] 204, x_0..x_1019 at 205..1224
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, mem=102, chunk_len=510, lora_r=2, lora_alpha=4, bos=False)
    ctx = torch.randint(0, 250, (1020,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = capture(dec)
    with torch.no_grad():
        comp.lm_loss(comp.compress([ctx]), "ae", [ctx])
    enc_pos, dec_pos = calls[0]["position_ids"], calls[1]["position_ids"]
    assert enc_pos[0].tolist() == list(range(0, 612)) == enc_pos[1].tolist()   # Table 12, DPL
    assert dec_pos[0].tolist() == list(range(0, 204)) + [204] + list(range(205, 1225))


def test_new_combination_pic_mask_with_epl_positions_on_aoc_encoder(device):
    dec, tok = tiny(device)
    comp = C.build("aoc", dec, tok, mem=4, chunk_len=32, mask="pic", layout="epl")
    ids = tok.encode("a combination no original codebase can run")[:32]
    calls = capture(comp.encoder)
    memory = comp.compress([ids])
    loss, n = comp.lm_loss(memory, "ae", [ids + [tok.eos_id]])
    loss.backward()
    assert math.isfinite(loss.item()) and n == 33
    assert calls[0]["position_ids"][0, 32:36].tolist() == [4, 12, 20, 28]   # UPL over 1..32, r = 8: round(4.5 + 8j)


def test_dpl_decoder_inputs_compute_no_positions_they_throw_away(monkeypatch):
    import positions
    monkeypatch.setattr(positions, "decoder_positions", lambda *a, **k: pytest.fail("DPL needs no decoder_positions"))
    assert positions.decoder_inputs("dpl", "kv", "ae", [10, 10], 4, 20, 3) == list(range(8, 12))
    assert positions.decoder_inputs("upl", "embeds", "lm", [10], 4, 10, 2) == list(range(0, 7))


# ---------------------------------------------------------------------------- CompLLM


def test_compllm_segments_ce_counts_and_reusability(device):
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    ids = tok.encode(TEXT)
    segs = comp.chunks(ids)
    assert sum(segs, []) == ids                                  # nothing lost or reordered
    assert all(1 <= len(s) <= 20 for s in segs)                  # CompLLM §4.1: S = 20
    assert len(segs) > len(ids) / 20                             # sentences really cut early
    memory = comp.compress([ids])
    n_ce = sum(math.ceil(len(s) / 2) for s in segs)              # Σ ⌈n_i / C⌉, C = 2
    assert memory.valid.sum().item() == n_ce == sum(memory.slots[0])
    with torch.no_grad():   # a non-trivial LoRA, so the check is not vacuous
        for n, p in dec.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
        full = comp.compress([ids]).embeds[0]
        # segment 3's CEs, compressed alone vs inside the whole context (and inside a batch)
        start = sum(math.ceil(len(s) / 2) for s in segs[:3])
        n3 = math.ceil(len(segs[3]) / 2)
        alone = comp.compress([segs[3]]).embeds[0]
        batched = comp.compress([tok.encode("Other context."), ids]).embeds[1]
    assert (full[start:start + n3] - alone).abs().max() <= batch_atol(device)
    assert (batched[start:start + n3] - alone).abs().max() <= batch_atol(device)


def test_compllm_rows_equal_one_packed_sequence_with_the_segments_mask(device):
    # compressing segments as separate rows == one sequence [seg1, eos.., seg2, eos.., ...] with the
    # block-diagonal masks.segments mask and per-segment positions
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    segs = comp.chunks(tok.encode("One two. Three four five! Six?"))
    mems = [math.ceil(len(s) / 2) for s in segs]
    with torch.no_grad():
        rows = comp.compress([sum(segs, [])]).embeds[0]
        ids = sum(([*s] + [tok.eos_id] * m for s, m in zip(segs, mems)), [])
        pos = torch.cat([torch.arange(len(s) + m) for s, m in zip(segs, mems)]).to(device)
        mask = masks.segments([len(s) for s in segs], mems).to(device)
        out = dec(torch.tensor([ids], device=device), position_ids=pos[None], attn_mask=mask)
        h = comp.bridge(out.last_hidden[0], None)
    is_ce = torch.tensor(sum(([False] * len(s) + [True] * m for s, m in zip(segs, mems)), []), device=device)
    torch.testing.assert_close(rows, h[is_ce], rtol=0, atol=1e-5)


def test_compllm_training_step_leaves_llm_weights_bit_identical(device):
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    before = {n: p.detach().clone() for n, p in dec.named_parameters() if "lora_" not in n}
    ctx, q, a = tok.encode(TEXT[:80]), tok.encode(" Q: who?"), tok.encode(" the fox")
    loss, n = comp.distill_loss([ctx], [q], [a])
    assert n == len(a) and loss.item() > 0
    loss.backward()
    torch.optim.SGD(comp.trainable_parameters(), lr=0.1).step()
    assert all(torch.equal(p, before[n]) for n, p in dec.named_parameters() if "lora_" not in n)
    assert any("lora_" in n and p.grad is not None and p.grad.abs().sum() > 0 for n, p in dec.named_parameters())


def test_compllm_distillation_loss_matches_the_equation(device):
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    ctx, q, a = tok.encode("Cats sleep. Dogs bark."), tok.encode(" Who barks?"), tok.encode(" Dogs")
    with torch.no_grad():
        loss, _ = comp.distill_loss([ctx], [q], [a])
        teacher = dec(torch.tensor([ctx + q + a], device=device), output_hidden_states=True).hidden_states
        ces = comp.compress([ctx]).embeds[0]
        x = torch.cat([ces, dec.model.embed_tokens(torch.tensor(q + a, device=device))])[None]
        student = dec(inputs_embeds=x, output_hidden_states=True).hidden_states
    want = 0.0
    for layer in range(1, dec.config.num_hidden_layers + 1):     # CompLLM Eq. (1)-(3), by hand
        h, hs = teacher[layer][0, -len(a):], student[layer][0, -len(a):]
        d = (hs - h).abs()
        smooth = torch.where(d < 1, 0.5 * d ** 2, d - 0.5).mean()
        want += smooth / h.std()
    torch.testing.assert_close(loss, torch.as_tensor(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- GMSA


def test_gmsa_group_merging_is_an_exact_mean_with_a_short_last_group(device):
    dec, tok = tiny(device)
    comp = C.build("gmsa", dec, tok, bridge="none")        # look at the merged vectors themselves
    assert comp.encoder.config.num_hidden_layers == dec.config.num_hidden_layers // 4 == len(comp.encoder.model.layers)
    ids = tok.encode("eleven toks")[:10]
    read = [tok.start_id] + ids   # the preset's encoder reads <s> x, as LLaMA-2's tokenizer gives it (bos=True)
    with torch.no_grad():
        memory = comp.compress([ids], ratios=[4])
        h = comp.encoder(torch.tensor([read], device=device)).last_hidden[0]
    groups = [h[0:4].mean(0), h[4:8].mean(0), h[8:11].mean(0)]   # [BOS] joins the first group; the last has 3 tokens
    assert memory.embeds.shape[1] == 3
    for got, want in zip(memory.embeds[0], groups):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_gmsa_lsa_starts_as_decoder_layer_zero_and_is_independent(device):
    dec, tok = tiny(device)
    comp = C.build("gmsa", dec, tok)
    lsa, first = comp.bridge.lsa.model.layers[0].state_dict(), dec.model.layers[0].state_dict()
    assert len(comp.bridge.lsa.model.layers) == 1 and lsa.keys() == first.keys()
    for k in lsa:
        assert torch.equal(lsa[k], first[k]) and lsa[k].data_ptr() != first[k].data_ptr()
    assert all(p.requires_grad for p in comp.bridge.lsa.model.layers.parameters())   # GMSA §3.3: fully trained
    # ... and it borrows the decoder's embedding and lm_head (frozen, never used) instead of carrying its own
    assert comp.bridge.lsa.model.embed_tokens is dec.model.embed_tokens and comp.bridge.lsa.lm_head is dec.lm_head
    assert comp.bridge.lsa.model.norm is dec.model.norm and not dec.model.norm.weight.requires_grad   # unused as well
    before = step(comp, [tok.encode("group merging and alignment")])
    assert any(n.startswith("bridge.lsa.") for n in changed(comp, before))
    assert not any(n.startswith("decoder.") for n in changed(comp, before))


def test_gmsa_keft_trains_only_decoder_qkv(device):
    dec, tok = tiny(device)
    comp = C.build("gmsa", dec, tok)
    comp.set_stage("keft")
    ctx, q, a = tok.encode("Paris is in France."), tok.encode(" Where is Paris?"), tok.encode(" France")
    before = {n: p.detach().clone() for n, p in comp.named_parameters()}
    memory = comp.compress([ctx], ratios=[4])
    loss, _ = comp.lm_loss(memory, "qa", [q + a + [tok.eos_id]], [len(a) + 1])
    loss.backward()
    torch.optim.SGD(comp.trainable_parameters(), lr=0.1).step()
    moved = changed(comp, before)
    qkv = lambda n: n.startswith("decoder.") and any(f"self_attn.{m}.weight" in n
                                                     for m in ("q_proj", "k_proj", "v_proj"))
    assert moved and all(qkv(n) for n in moved)                      # GMSA Eq. (8)
    assert len(moved) == 3 * dec.config.num_hidden_layers            # every layer's q, k and v


# ---------------------------------------------------------------------------- save / load, errors


def test_save_load_roundtrip_gives_the_same_memory(tmp_path, device):
    dec, tok = tiny(device)
    comp = C.build("gmsa", dec, tok)
    step(comp, [tok.encode("save me")])
    comp.set_stage("keft")
    checkpoint.save(comp, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["compressor.json", "compressor.safetensors"]
    back = checkpoint.load(str(tmp_path), device=device)
    ids = [tok.encode("the same memory after loading")]
    with torch.no_grad():
        torch.testing.assert_close(back.compress(ids, ratios=[4]).embeds, comp.compress(ids, ratios=[4]).embeds)
        x = torch.tensor(ids, device=device)
        torch.testing.assert_close(back.decoder(x).logits, comp.decoder(x).logits)   # KEFT q/k/v saved too
    wrong = C.build("gmsa", *tiny(device), enc_layers=2)
    with pytest.raises(ValueError, match="checkpoint does not match"):
        checkpoint.load_trained(wrong, checkpoint.trained_state(comp))


def test_a_saved_config_fills_new_settings_and_names_unknown_ones(tmp_path):
    """checkpoint.saved_config (load and train.py --init): a setting missing from an older compressor.json takes its
    default, a list comes back a tuple, and a setting this code does not know is a one-line error naming it."""
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(P.make_config("gmsa", ratios=(2,))).items()}
    del saved["mem_norm"]
    (tmp_path / "compressor.json").write_text(json.dumps({"config": saved}))
    cfg = checkpoint.saved_config(str(tmp_path))
    assert cfg.mem_norm == P.CompressorConfig.mem_norm and cfg.ratios == (2,) and cfg.method == "gmsa"
    (tmp_path / "compressor.json").write_text(json.dumps({"config": {**saved, "gone_setting": 1}}))
    with pytest.raises(ValueError, match=r"does not know \(gone_setting\)") as e:
        checkpoint.saved_config(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method,overrides,message", [
    ("nope", {}, "unknown method 'nope'"),
    ("gmsa", {"layout": "epl"}, "gmsa merges hidden states"),
    ("aoc", {"mem": 0}, "--mem must be >= 1"),
    ("icae", {"mem": 600}, "--mem 600 is larger than the chunk"),
    ("icae", {"layout": "xyz"}, "unknown layout 'xyz'"),
    ("gmsa", {"carrier": "kv", "bridge": "none"}, "carrier kv needs one K/V per decoder layer"),
    ("gmsa", {"ratios": (2.5,)}, "whole numbers"),
    ("500x", {"ae_token": "none"}, "nothing after the memory"),
])
def test_bad_settings_are_one_line_errors(method, overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        P.make_config(method, **overrides)
    assert "\n" not in str(e.value)


def test_empty_context_is_an_error(device):
    comp = C.build("icae", *tiny(device), mem=2, chunk_len=8, lora_r=2, lora_alpha=4)
    with pytest.raises(ValueError, match="empty context"):
        comp.compress([[]])


def test_gmsa_ratio_fixes_the_group_size(device):
    cfg = P.make_config("gmsa", ratio=2.0)
    assert cfg.ratios == (2,) and cfg.ratio == 0.0
    comp = C.Compressor(cfg, *tiny(device))
    memory = comp.compress([list(range(9))])
    assert memory.slots == [[5]]          # [BOS] and 9 tokens in groups of 2, every time


# ---------------------------------------------------------------------------- faithful to the papers' code


def test_500x_pretraining_reads_a_different_token_for_ae_and_lm(device):
    """EPL's 500xCompressor branch feeds learned [AE] / [LM] after the K/V memory: with [BOS] for both, "reconstruct"
    and "continue" would give the decoder the identical input."""
    dec, tok = tiny(device)
    comp = C.build("500x", dec, tok, mem=4, chunk_len=32, lora_r=2, lora_alpha=4)
    memory = comp.compress([tok.encode("Two tasks, one memory.")])
    ae = comp.decoder_batch(memory, "ae", [[tok.eos_id]])["inputs_embeds"][0, 0]
    lm = comp.decoder_batch(memory, "lm", [[tok.eos_id]])["inputs_embeds"][0, 0]
    assert (ae - lm).abs().max() > 1e-3
    torch.testing.assert_close(ae, comp.ae_embed.detach()) and torch.testing.assert_close(lm, comp.lm_embed.detach())


def llama_3_2_1b_compressor(method, **kw):
    """A compressor around the Llama-3.2-1B config, built on the meta device (no memory, no download)."""
    with torch.device("meta"):
        dec = Transformer(ModelConfig.from_hf(LLAMA_3_2_1B_CONFIG))
    return C.build(method, dec, build_tiny()[1], **kw)


def test_aoc_trains_attention_norms_and_memory_tokens_only_on_llama_3_2_1b():
    comp = llama_3_2_1b_compressor("aoc", mem=16)
    d, L, kv = 2048, 16, 8 * 64
    attention = L * (d * d + d * kv + d * kv + d * d)         # q, k, v, o
    norms = L * 2 * d + d                                       # input / post-attention norms, final norm
    trained = sum(p.numel() for p in comp.trainable_parameters())
    print(f"\nAOC on Llama-3.2-1B trains {trained / 1e6:.1f}M: attention {attention / 1e6:.1f}M, norms, "
          "16 memory tokens")
    assert trained == attention + norms + 16 * d               # no embedding table (262.7M) and no lm_head


def test_memory_tokens_are_drawn_as_each_papers_code_draws_them(device):
    dec, tok = tiny(device)
    emb = dec.model.embed_tokens.weight.detach()
    torch.manual_seed(0)
    aoc = C.build("aoc", dec, tok, mem=256, chunk_len=512)       # AOC / 500x code: torch.randn, N(0, 1)
    assert abs(aoc.mem_tokens.std().item() - 1.0) < 0.05
    icae = C.build("icae", *tiny(device), mem=256, chunk_len=512, lora_r=2, lora_alpha=4)  # EPL: N(mean, std) of table
    assert abs(icae.mem_tokens.std().item() - emb.std().item()) < 0.1 * emb.std().item()
    assert abs(icae.ae_embed.std().item() - emb.std().item()) < 0.3 * emb.std().item()
    pcc = C.build("pcc", *tiny(device), mem=16)                   # PCC: new vocabulary rows, N(0, 0.02)
    assert abs(pcc.mem_tokens.std().item() - 0.02) < 0.004
    assert abs(pcc.mem_open.std().item() - 0.02) < 0.01 and not pcc.mem_open.requires_grad   # frozen (PCC code)


def test_lora_aoc_is_lora_on_an_mlp_free_copy_with_the_kv_carrier(device):
    """AOC Tables 1-3, LoRA-AOC: a copy of the LLM without MLPs, LoRA on q, k, v, o, its norms frozen."""
    dec, tok = tiny(device)
    comp = C.build("aoc", dec, tok, mem=4, chunk_len=32, encoder="lora", lora_r=4, lora_alpha=2, lora_dropout=0.05,
                   lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert comp.encoder is not comp.decoder and not any(".mlp." in n for n, _ in comp.encoder.named_parameters())
    trained = {n for n, p in comp.named_parameters() if p.requires_grad}
    assert trained == {n for n in trained if "lora_" in n} | {"mem_tokens"}
    assert {n.split(".")[-2] for n in trained if "lora_A" in n} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    before = step(comp, [tok.encode("lora on an attention-only copy")])
    assert all(n.startswith("encoder.") and "lora_" in n or n == "mem_tokens" for n in changed(comp, before))
    assert set(checkpoint.trained_state(comp)) == trained                  # the copy's base weights are the decoder's


def test_epl_chunks_as_the_code_cuts_them_bos_first_full_memory_nominal_upl(device):
    """EPL code: context = [BOS] + x; chunks of 510, every one with all 102 memory tokens, UPL over the nominal
    510 even for a short last chunk. Ours (cap_mem): a short chunk gets at most its length, UPL over its own."""
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, layout="epl", lora_r=2, lora_alpha=4)
    x = torch.randint(0, 250, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = capture(dec)
    with torch.no_grad():
        memory = comp.compress([x])
    enc_ids, enc_pos = calls[0]["inputs_embeds"], calls[0]["position_ids"]
    assert memory.chunk_lens == [[510, 3]] and memory.slots == [[102, 102]]   # BOS + 509, then 3 tokens
    torch.testing.assert_close(enc_ids[0, 0], dec.model.embed_tokens.weight[tok.bos_id])
    assert enc_pos[1, :3].tolist() == [511, 512, 513]
    assert enc_pos[1, 3:105].tolist() == list(range(513, 1019, 5))                # as a full chunk 2 (Table 12)
    assert comp.ae_target(x[:3]) == [tok.bos_id] + x[:3] + [tok.eos_id]           # AE rebuilds [BOS] x [EOS]
    ours = C.build("icae", *tiny(device), layout="epl", lora_r=2, lora_alpha=4, cap_mem=True)
    assert ours.compress([x]).slots == [[102, 3]]


def test_saved_tensors_are_exactly_what_trains(tmp_path, device):
    """GMSA: the first-k encoder's base weights are the LLM's and the LSA borrows its embedding: only LoRA, the LSA
    blocks and [AE] are written (a 7B checkpoint is megabytes); after KEFT the decoder's q/k/v too."""
    dec, tok = tiny(device)
    comp = C.build("gmsa", dec, tok)
    trained = {n for n, p in comp.named_parameters() if p.requires_grad}
    assert set(checkpoint.trained_state(comp)) == trained
    assert not any(n.startswith("encoder.") and "lora_" not in n for n in checkpoint.trained_state(comp))
    assert not any("embed_tokens" in n or "lm_head" in n for n in checkpoint.trained_state(comp))
    comp.set_stage("keft")
    qkv = {n for n, p in comp.named_parameters() if p.requires_grad}
    assert set(checkpoint.trained_state(comp)) == trained | qkv


def test_pcc_decoder_input_is_bos_then_delimited_memory_per_segment(device):
    """PCC code: [BOS, <mem>, m_1..m_16, </mem>] per 256-token segment, all 16 slots even for a short segment;
    the converter is RMSNorm -> Linear -> GELU -> Linear."""
    dec, tok = tiny(device)
    comp = C.build("pcc", dec, tok, encoder_model=small_compressor(dec))
    x = torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    memory = comp.compress([x])
    assert memory.slots == [[16, 16]]                       # a 44-token second segment keeps its 16
    emb = comp.decoder_batch(memory, "ae", [comp.ae_target(x[:5])])["inputs_embeds"][0]
    W = dec.model.embed_tokens.weight
    rows = [W[tok.bos_id], comp.mem_open, *memory.embeds[0, :16], comp.mem_close,
            comp.mem_open, *memory.embeds[0, 16:], comp.mem_close, comp.ae_embed]
    torch.testing.assert_close(emb[:len(rows)], torch.stack(rows), rtol=0, atol=0)
    assert [type(m).__name__ for m in comp.bridge] == ["RMSNorm", "Linear", "GELU", "Linear"]


@pytest.mark.parametrize("method", ["pcc", "pic"])
def test_pcc_and_pic_under_epl_positions(method, device):
    """PCC's decoder input under EPL (ours): [BOS] at 0; each chunk's memory at its UPL positions inside the chunk's
    span s+1 .. s+L, its <mem> and </mem> just outside it, at s and s+L+1; then the EPL special token and text.
    Two chunks of L = 4 with 2 slots each, worked by hand: UPL(2 over 1..4) = round(1.5, 3.5) = 2, 4 (half to even)
    and UPL(2 over 5..8) = round(5.5, 7.5) = 6, 8."""
    dec, tok = tiny(device)
    comp = C.build(method, dec, tok, mem=2, chunk_len=4, layout="epl")
    x = tok.encode("abcdefgh")                                   # 8 tokens: two chunks of 4
    calls = capture(comp.encoder)
    memory = comp.compress([x])
    assert calls[0]["position_ids"][:, 4:6].flatten().tolist() == [2, 4, 6, 8]   # each row: 4 tokens, 2 slots
    memory_block = [0, 0, 2, 4, 5, 4, 6, 8, 9]                   # BOS, <mem> m m </mem>, <mem> m m </mem>
    ae = comp.decoder_batch(memory, "ae", [comp.ae_target(x)])  # x + EOS after [AE] at 0: x_j at j + 1
    assert ae["position_ids"][0].tolist() == memory_block + [0] + list(range(1, 10))
    lm = comp.decoder_batch(memory, "lm", [tok.encode("ij")], last_tokens=[x[-1]])   # PIC Eq. (7): x_k at p = 8
    assert lm["position_ids"][0].tolist() == memory_block + [8, 9, 10]
    qa = comp.decoder_batch(memory, "qa", [tok.encode("Q?A")])  # no special token: the text from p + 1
    assert qa["position_ids"][0].tolist() == memory_block + [9, 10, 11]
    loss, n = comp.lm_loss(memory, "ae", [comp.ae_target(x)])
    loss.backward()
    assert math.isfinite(loss.item()) and n == 9


def test_distillation_loss_is_a_mean_of_per_example_losses(device):
    """CompLLM Eq. (1)-(2): σ and the mean over t∈A, j≤d are each example's own; a batch is their expectation."""
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    ctx = [tok.encode("Cats sleep. Dogs bark."), tok.encode("The sun is hot. Snow is cold. Rain is wet.")]
    q = [tok.encode(" Who barks?"), tok.encode(" What is wet?")]
    a = [tok.encode(" Dogs"), tok.encode(" The rain, of course, is the wet one.")]   # lengths 5 and 36
    with torch.no_grad():
        both, _ = comp.distill_loss(ctx, q, a)
        alone = [comp.distill_loss([c], [qq], [aa])[0] for c, qq, aa in zip(ctx, q, a)]
    torch.testing.assert_close(both, (alone[0] + alone[1]) / 2, rtol=1e-5, atol=1e-6)


def test_qa_templates_build_the_papers_prompts(device):
    dec, tok = tiny(device)
    parts = C.build("icae", dec, tok, lora_r=2, lora_alpha=4).qa_parts("Paris is big.", "Is it?")   # EPL code
    assert tok.decode(parts["enc_context"]) == "### Context:\nParis is big."
    assert tok.decode(parts["prompt"]) == "\n### Question:\nIs it?\n### Answer:\n" and parts["prefix"] == []
    parts = C.build("pic", *tiny(device)).qa_parts("Paris is big.", "Is it?")                        # PCC code
    assert tok.decode(parts["prompt"]) == "Question: Is it?\n\nAnswer: "
    assert tok.decode(parts["dec_context"]) == "Paris is big."


def test_cached_chunks_give_the_same_memory_without_encoding_again(device):
    """CompLLM §1 "reusability": a segment's CEs depend on nothing else, so a cache keyed by its ids serves any
    context that contains it; only new segments reach the encoder."""
    dec, tok = tiny(device)
    comp = C.build("compllm", dec, tok)
    a, b = tok.encode("First document. It has two sentences."), tok.encode("Second one. Also two.")
    cache, calls = {}, capture(dec)
    with torch.no_grad():
        fresh = comp.compress([a + b]).embeds
        comp.compress([a], cache=cache)
        n_before = len(calls)
        both = comp.compress([a + b], cache=cache).embeds
        rows_encoded = calls[n_before]["inputs_embeds"].shape[0]
    torch.testing.assert_close(both, fresh, rtol=0, atol=batch_atol(device))
    assert rows_encoded == len(comp.chunks(b))        # a's segments came from the cache


# ---------------------------------------------------------------------------- bf16 autocast


@pytest.mark.parametrize("method", ["aoc", "icae"])
def test_lm_loss_under_bf16_autocast_is_finite_and_close_to_fp32(method, device):
    """train.py runs every step under bf16 autocast on CUDA; here the same on the test device (the CPU too): the
    matmuls really run in bf16, the losses stay finite, fp32 (the cross-entropy is taken in fp32) and near fp32's.
    The bound: bf16 keeps 8 mantissa bits, so each logit is off by a few 2^-8-relative roundings, and a mean
    cross-entropy over the 30-80 supervised tokens averages most of that away. Measured on the CPU (aoc and icae,
    tiny seeds 0-4, ae and lm losses near 5.4-6.3): relative error 4e-6 to 1.1e-3; the bound is 5e-3."""
    dec, tok = tiny(device)
    kw = dict(mem=4, chunk_len=32) if method == "aoc" else dict(mem=4, chunk_len=32, lora_r=4, lora_alpha=8)
    comp = C.build(method, dec, tok, **kw)
    contexts = [tok.encode(TEXT[:60]), tok.encode(TEXT[70:150])]
    dtypes = set()   # what the decoder's matmuls return
    dec.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    losses = {}
    for name, autocast in (("fp32", nullcontext()), ("bf16", torch.autocast(device.type, dtype=torch.bfloat16))):
        comp.zero_grad()
        with autocast:
            memory = comp.compress(contexts)
            ae, _ = comp.lm_loss(memory, "ae", [comp.ae_target(c) for c in contexts])
            lm, _ = comp.lm_loss(memory, "lm", [tok.encode(" and then"), tok.encode(" the end")],
                                 last_tokens=[c[-1] for c in contexts])
        (ae + lm).backward()
        losses[name] = (ae.detach(), lm.detach())
    assert dtypes == {torch.float32, torch.bfloat16}        # autocast really changed the compute dtype
    grads = [p.grad for p in comp.trainable_parameters() if p.grad is not None]   # (the bf16 backward's)
    assert grads and all(torch.isfinite(g).all() for g in grads)
    for l32, l16 in zip(losses["fp32"], losses["bf16"]):
        assert l16.dtype == torch.float32 and torch.isfinite(l16)
        torch.testing.assert_close(l16, l32, rtol=5e-3, atol=0)


# ---------------------------------------------------------------------------- the step's count of supervised tokens


@pytest.mark.parametrize("method, overrides", [(m, {}) for m in P.METHODS] +
                         [("500x", dict(lm_token="none"))])   # a K/V memory with nothing after it (LM)
def test_supervised_tokens_counts_what_lm_loss_supervises(method, overrides, device):
    """train.py divides each micro-batch's summed NLL by the whole step's supervised tokens, counted in advance
    with data.supervised_tokens from the compressor's follow_start: it must be the count lm_loss reports, for every
    preset and task (a first follow token that nothing precedes is not supervised: the K/V carrier with no special
    token)."""
    model, tok = tiny(device)
    comp = C.build(method, model, tok, **overrides)
    contexts = [tok.encode(TEXT[:40]), tok.encode(TEXT[50:73])]
    memory = comp.compress(contexts, ratios=[4, 4] if comp.cfg.source == "group_mean" else None)
    follow = [tok.encode(" and so on."), tok.encode(" more")]
    for task, n_sup, prefix in (("ae", None, None), ("lm", None, None), ("qa", [3, 2], None),
                                ("qa", None, [tok.encode("Q:"), []])):
        last = [c[-1] for c in contexts]
        _, count = comp.lm_loss(memory, task, follow, n_sup, last_tokens=last, prefix=prefix)
        assert D.supervised_tokens(follow, n_sup, prefix, comp.follow_start[task]) == count, (task, n_sup, prefix)
    if overrides:   # the case the rule is for: the first token of a K/V memory's follow is not predicted
        assert D.supervised_tokens(follow, None, None, comp.follow_start["lm"]) == sum(map(len, follow)) - 2


def test_supervised_tokens_counts_by_decoder_batchs_own_target_rule(device, monkeypatch):
    """The step's count of supervised tokens (data.supervised_tokens) reads where follow[0] sits from the compressor's
    follow_start, which the compressor fixes with decoder_batch's own layout rule (follow_index), and counts by its
    target rule (next_token_targets): the counts agree, slot 0 (nothing before follow[0]) included."""
    calls = []
    layout = C.Compressor.follow_index
    monkeypatch.setattr(C.Compressor, "follow_index", lambda *a, **k: calls.append(a) or layout(*a, **k))
    for method, kw in (("aoc", dict(lm_token="none")), ("500x", {}), ("icae", {}), ("pcc", {})):   # aoc lm: slot 0
        dec, tok = tiny(device)   # a fresh decoder: a LoRA encoder changes it
        calls.clear()
        comp = C.build(method, dec, tok, mem=4, chunk_len=16, **kw)
        assert len(calls) == 3, "follow_start must be follow_index's, once per task"
        memory = comp.compress([tok.encode("abcdefgh"), tok.encode("xyz")])
        for task in ("ae", "lm", "qa"):
            follow, n = [tok.encode("hello"), tok.encode("hi")], [5, 1]
            counted = D.supervised_tokens(follow, n, None, comp.follow_start[task])
            batch = comp.decoder_batch(memory, task, follow, n, last_tokens=[3, 4])
            assert counted == len(batch.supervised), (method, task)


# ---------------------------------------------------------------------------- presets: frozen, typed records


def test_no_preset_shares_a_mutable_recipe_or_settings_object():
    """Every record is frozen and every mapping in it read-only, so no preset can change another's: icae and 500x
    read the same EPL values, and neither can change them under the other."""
    def mutable(x, path):
        if isinstance(x, (dict, list, set)):
            yield path
        for k, v in (x.items() if isinstance(x, Mapping) else enumerate(x) if isinstance(x, tuple) else ()):
            yield from mutable(v, f"{path}[{k!r}]")
    for name, p in P.PRESETS.items():
        recipe = tuple(getattr(p.recipe, f.name) for f in dataclasses.fields(p.recipe))
        found = list(mutable(tuple(p), name)) + list(mutable(recipe, name + ".recipe"))
        assert not found, found
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.recipe.lr = 1.0
        with pytest.raises(TypeError):
            p.compressor["mem"] = 1
    # icae and 500x read the same EPL values, from frozen records
    qa_lr = {m: cli.recipe_settings(P.PRESETS[m].recipe, "qa")["lr"].value for m in ("icae", "500x")}
    assert qa_lr == {"icae": 5e-5, "500x": 5e-5}


def test_a_recipe_is_a_typed_record_whose_fields_carry_their_help():
    assert dataclasses.is_dataclass(P.Recipe)
    assert all(f.metadata.get("help") for f in dataclasses.fields(P.Recipe))
    assert all(isinstance(p.recipe, P.Recipe) for p in P.PRESETS.values())
    # the compressor settings an objective changes live apart from the recipe's values (500x's original AE setup)
    assert P.PRESETS["500x"].compressor_for("ae")["ae_token"] == "bos" and not P.PRESETS["500x"].compressor_for("qa")
    assert not set(cli.recipe_settings(P.PRESETS["500x"].recipe, "ae")) & {
        f.name for f in dataclasses.fields(P.CompressorConfig)}


# ---------------------------------------------------------------------------- bridges, carriers and masks: named parts


@pytest.mark.parametrize("method", P.METHODS)
def test_every_bridge_is_a_module_named_for_what_it_does(method, device):
    """The bridge is a module of its own class (not a closure over registry entries), the carrier and the encoder mask
    are the named parts the config picks, and a GMSA checkpoint that names its LSA blocks `lsa.*` (not
    `bridge.lsa.*`) loads."""
    dec, tok = tiny(device)
    comp = C.build(method, dec, tok, **({} if method in ("compllm", "gmsa") else dict(mem=4, chunk_len=16)))
    want = {"none": C.NoBridge, "linear": C.LinearBridge, "mlp": C.MLPBridge, "lsa": C.LSABridge}[comp.cfg.bridge]
    assert type(comp.bridge) is want and comp.carrier is C.CARRIERS[comp.cfg.carrier]
    assert comp.encoder_mask is masks.ENCODER[comp.cfg.mask] and comp.encoder_mask.__name__ == comp.cfg.mask
    if method == "gmsa":
        state = checkpoint.trained_state(comp)
        old = {(n[len("bridge."):] if n.startswith("bridge.lsa.") else n): t for n, t in state.items()}
        assert any(n.startswith("lsa.") for n in old)
        checkpoint.load_trained(comp, old)


# ---------------------------------------------------------------------------- ours: --mem-norm


def test_mem_norm_puts_the_memory_at_the_token_embeddings_scale(device):
    # ours (a diagnostic arm, never a preset's default): ICAE's memory is final-norm hidden states, far larger than
    # the token embeddings the frozen decoder reads; --mem-norm rescales each memory vector to their mean norm
    dec, tok = tiny(device)
    target = dec.model.embed_tokens.weight.norm(dim=-1).mean()
    plain = C.build("icae", dec, tok, mem=4, chunk_len=16).compress([tok.encode("Some text to compress.")])
    assert not torch.allclose(plain.embeds.norm(dim=-1), target.expand(1, 8), rtol=0.05)
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, mem=4, chunk_len=16, mem_norm=True)
    memory = comp.compress([tok.encode("Some text to compress.")])
    torch.testing.assert_close(memory.embeds.norm(dim=-1), target.expand(1, 8), rtol=1e-4, atol=1e-4)
    comp.lm_loss(memory, "ae", [comp.ae_target(tok.encode("Some text to compress."))])[0].backward()
    assert comp.mem_tokens.grad.abs().sum() > 0                      # the direction still trains
    assert all(not P.make_config(m).mem_norm for m in P.METHODS)     # no preset uses it
    with pytest.raises(ValueError, match="--mem-norm"):
        P.make_config("aoc", mem_norm=True)


# ---------------------------------------------------------------------------- ours: --mem-from-text


def test_mem_from_text_starts_slot_j_from_the_mean_of_segment_j(device):
    # ours (a lever against the embedding carrier's collapse, never a preset's default): memory slot j's encoder input
    # is learned memory token j plus the mean embedding of the j-th of m contiguous segments of its chunk. Two texts,
    # padded rows: [BOS] + 16 tokens (one chunk of 17: segments of 5, 4, 4, 4 tokens) and [BOS] + 20 tokens (chunks of
    # 17 and 4: the second's segments one token each)
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, mem=4, chunk_len=17, mem_from_text=True)
    texts = [tok.encode("Sixteen tokens!!"), tok.encode("twenty tokens of it..")[:20]]
    calls = capture(comp.encoder)

    def slot_inputs(texts):   # each encoder row's 4 memory slots, as the encoder reads them: (rows, 4, d)
        comp.compress(texts)
        x, mem_slot = calls[-1]["inputs_embeds"], comp.encoder_inputs(texts).mem_slot.to(device)
        return x[mem_slot > 0].view(x.shape[0], 4, -1)

    got = slot_inputs(texts)
    ctx = [[tok.start_id] + texts[0], [tok.start_id] + texts[1]]
    emb = lambda ids: comp.encoder.model.embed_tokens(torch.tensor(ids, device=device))
    segments = {0: (ctx[0], [(0, 5), (5, 9), (9, 13), (13, 17)]), 2: (ctx[1][17:], [(0, 1), (1, 2), (2, 3), (3, 4)])}
    for row, (ids, bounds) in segments.items():
        for j, (a, b) in enumerate(bounds):
            torch.testing.assert_close(got[row, j], comp.mem_tokens[j] + emb(ids[a:b]).mean(0))
    # a token changed in segment 1 of the first text (its token 6, at index 6 after [BOS]) changes slot 1's input only
    changed = slot_inputs([texts[0][:5] + [texts[0][5] ^ 1] + texts[0][6:], texts[1]])
    assert [torch.equal(changed[0, j], got[0, j]) for j in range(4)] == [True, False, True, True]
    assert torch.equal(changed[1:], got[1:])
    # a chunk shorter than its slots ([BOS] a b, 3 tokens, 4 slots): the last segment is empty, its slot the token
    short = slot_inputs([tok.encode("ab")])
    torch.testing.assert_close(short[0, 3], comp.mem_tokens[3])
    torch.testing.assert_close(short[0, 1], comp.mem_tokens[1] + emb(tok.encode("a"))[0])
    # off (every preset): every slot's input is its learned memory token, whatever the text
    dec, tok = tiny(device)
    comp = C.build("icae", dec, tok, mem=4, chunk_len=17)
    calls = capture(comp.encoder)
    assert torch.equal(slot_inputs(texts), comp.mem_tokens.detach().expand(3, 4, -1))
    assert all(not P.make_config(m).mem_from_text for m in P.METHODS)
    with pytest.raises(ValueError, match="--mem-from-text adds a text's segment means to learned memory tokens"):
        P.make_config("compllm", mem_from_text=True)
