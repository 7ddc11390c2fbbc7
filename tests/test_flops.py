"""The FLOPs bench_train's MFU divides by (bench_train.step_flops): one training step against a count written out by
hand, matrix product by matrix product, on a 2-layer tiny Llama (d 64, MLP 176, 4 query heads over 2 K/V heads of
16, vocabulary 259, tied lm_head), for the two kinds of frozen base: ICAE (LoRA on the decoder's own weights: the
base matrices frozen, a gradient flowing through them) and AOC (a fully trained encoder copy sharing the frozen
decoder's embedding, the memory a K/V prefix of the frozen decoder). The hand count fails a step_flops that counts
the embedding lookup, gives frozen matrices a weight gradient (the 6 × parameters rule), drops attention, or runs
backward where the loss never leads.

Per token through a matrix W: 2·|W| forward, + 2·|W| where a gradient flows back to its input, + 2·|W| where W
trains. Attention, per layer: q kᵀ and P v, 2·B·H·T·S·D each forward, dense; in backward each again for every
operand that needs a gradient (q, k; P when q or k does, v).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compressors as C  # noqa: E402
from bench_train import ae_step, bench_shape, step_flops  # noqa: E402
from model import SHAPES, TINY_CONFIG, ModelConfig, Transformer, build_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

L, d, I, H, Hkv, D, V = 2, 64, 176, 4, 2, 16, 259   # the model below: TINY_CONFIG with 2 layers
B, n, m = 2, 10, 4                                  # two texts of 10 tokens, 4 memory slots each (one chunk)
ATTN_W = d * H * D + 2 * d * Hkv * D + H * D * d    # q, k, v, o projections
MLP_W = 3 * d * I                                   # gate, up, down
LM_HEAD = d * V


def attention(T, S):
    """One of a layer's two attention products, q kᵀ or P v, forward: 2·B·H·T·S·D."""
    return 2 * B * H * T * S * D


def two_layer_tiny(where):
    """TINY_CONFIG with 2 layers, on `where` (a device, or "meta", where the benchmark counts), and the byte
    tokenizer."""
    torch.manual_seed(0)
    with torch.device(where):
        model = Transformer(ModelConfig.from_hf({**TINY_CONFIG, "num_hidden_layers": 2}))
    return model, build_tiny()[1]


def counted(method, where, **settings):
    comp = C.build(method, *two_layer_tiny(where), **settings)
    texts = [list(range(3 + b, 3 + b + n)) for b in range(B)]
    return step_flops(lambda: ae_step(comp, texts, None)[0])


@pytest.mark.parametrize("where", ["test device", "meta"])
def test_icae_step_counts_lora_at_6x_its_frozen_base_at_4x_and_no_embedding(where, device):
    """ICAE: the encoder is the decoder with LoRA (r 8) on q and v; its rows are [BOS] x (11 tokens) and 4 memory
    slots, T_e = 15. The learned memory tokens train, so a gradient flows back from layer 0 up: every frozen base
    matrix 4·|W| (forward and input gradient), LoRA's A and B 6·|W|. The decoder (LoRA switched off, frozen) reads
    the memory (4 rows), [AE] and [BOS] x [EOS] (12): T_d = 17, every matrix 4·|W| (the memory upstream), and lm_head
    only at the 12 supervised inputs of each row."""
    r = 8
    lora = (d * r + r * H * D) + (d * r + r * Hkv * D)           # q's A and B, v's A and B
    T_e, T_d, N = 1 + n + m, m + 1 + (n + 2), B * (n + 2)
    R_e, R_d = B * T_e, B * T_d                                  # token rows through each model
    encoder_fwd = L * (2 * R_e * (ATTN_W + MLP_W + lora) + 2 * attention(T_e, T_e))
    encoder_bwd = L * (2 * R_e * (ATTN_W + MLP_W)                # frozen base: the input's gradient only
                       + 2 * 2 * R_e * lora                      # LoRA's A and B: input's and weight's gradient
                       + 2 * 2 * attention(T_e, T_e))            # dq, dk, dP, dv
    decoder_fwd = L * (2 * R_d * (ATTN_W + MLP_W) + 2 * attention(T_d, T_d)) + 2 * N * LM_HEAD
    decoder_bwd = L * (2 * R_d * (ATTN_W + MLP_W) + 2 * 2 * attention(T_d, T_d)) + 2 * N * LM_HEAD
    forward, backward = counted("icae", device if where == "test device" else "meta", mem=m, chunk_len=16,
                                lora_r=r)
    assert (forward, backward) == (encoder_fwd + decoder_fwd, encoder_bwd + decoder_bwd)


@pytest.mark.parametrize("where", ["test device", "meta"])
def test_aoc_step_counts_its_trained_copy_at_6x_the_frozen_decoder_at_4x_or_2x_and_no_shared_embedding(where, device):
    """AOC: the encoder is an MLP-free copy, every matrix trained (6·|W|), embedding with the decoder's table (a
    lookup: nothing); its rows are x (10) and 4 memory slots, T_e = 14. The memory is every encoder layer's K/V at
    the slots, so the last layer's k and v get a backward and its q, attention and o_proj none. The decoder reads
    [BOS] x [EOS] (12 rows) after the 4-slot prefix, S = 16: its layer 0 projects frozen embeddings with frozen q, k, v
    (2·|W|: no gradient flows there), its attention needs dk, dP and dv but no dq, and from its o_proj up every matrix
    is 4·|W|; lm_head at the 11 supervised inputs of each row."""
    T_e, T_d, S, N = n + m, 1 + n + 1, m + 1 + n + 1, B * (n + 1)
    R_e, R_d = B * T_e, B * T_d
    QKV_W, O_W = d * H * D + 2 * d * Hkv * D, H * D * d
    encoder_fwd = L * (2 * R_e * ATTN_W + 2 * attention(T_e, T_e))
    encoder_bwd = ((L - 1) * (2 * 2 * R_e * ATTN_W + 2 * 2 * attention(T_e, T_e))   # input's and weight's gradient
                   + 2 * 2 * R_e * (2 * d * Hkv * D))                              # the last layer: k and v only
    decoder_fwd = L * (2 * R_d * (ATTN_W + MLP_W) + 2 * attention(T_d, S)) + 2 * N * LM_HEAD
    decoder_bwd = (3 * attention(T_d, S) + 2 * R_d * (O_W + MLP_W)                 # layer 0: no dq, no q, k, v grads
                   + (L - 1) * (2 * R_d * (QKV_W + O_W + MLP_W) + 2 * 2 * attention(T_d, S))
                   + 2 * N * LM_HEAD)
    forward, backward = counted("aoc", device if where == "test device" else "meta", mem=m)
    assert (forward, backward) == (encoder_fwd + decoder_fwd, encoder_bwd + decoder_bwd)


def test_a_matrix_product_the_count_does_not_know_raises():
    """A step that multiplies matrices another way than F.linear or SDPA stops the count instead of going uncounted."""
    x = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(NotImplementedError, match="matmul"):
        step_flops(lambda: (x @ x.T).sum())


def test_bench_shape_counts_a_micro_batched_step_as_its_whole_batch(monkeypatch):
    """bench_train --micro-batch: a step of 4 texts run as 2 micro-batches of 2 is the same step, so its tokens and
    FLOPs (what MFU divides) are the whole batch's, twice a batch of 2's; a count of one micro-batch only, or of
    every micro-batch at the whole batch's size, fails. AOC at its paper lengths (96 tokens) on a 2-layer tiny Llama."""
    monkeypatch.setitem(SHAPES, "two-layer tiny", {**TINY_CONFIG, "num_hidden_layers": 2})
    run = lambda batch, micro: bench_shape("two-layer tiny", "aoc", "cpu", 1, batch=batch, micro=micro)
    _, tokens, flops, _ = run(4, 2)
    _, whole_tokens, whole_flops, _ = run(4, None)
    _, half_tokens, half_flops, _ = run(2, None)
    assert (tokens, flops) == (whole_tokens, whole_flops) == (2 * half_tokens, 2 * half_flops)
