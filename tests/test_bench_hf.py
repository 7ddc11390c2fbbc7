"""tests/bench_hf.py times our training step against the same step written on transformers: here, on a tiny 2-layer
Llama, the two must give the same losses step after step, so that the benchmark keeps timing the same work."""

import pytest
import torch

import bench_hf

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(  # a 2-layer Llama with GQA 4:2 and tied embeddings, the shape of SmolLM2 in small
    model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=512, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(bench_hf.random_checkpoint(tmp_path_factory.mktemp("bench_hf") / "tiny", TINY))


@pytest.mark.parametrize("method", bench_hf.METHODS)
def test_the_transformers_step_trains_as_ours(folder, method):
    """Three AdamW steps of each side from the same tensors: the same loss at every step (fp32, 1e-5 relative), over
    the same number of trained parameters. LoRA's B starts non-zero, so the LoRA branch (and 500x's dropout on it)
    shapes the first loss too."""
    comp, opt, clip = bench_hf.build_ours(method, folder, mem=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in comp.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    hf = bench_hf.HFStep(comp, folder, opt, clip)
    # the same trained tensors, but ICAE's learned [LM], which AE never reads (and AdamW skips: no gradient)
    ours_trained = [p for p in comp.trainable_parameters() if p is not getattr(comp, "lm_embed", None)]
    assert sorted(p.numel() for p in hf.trained) == sorted(p.numel() for p in ours_trained)
    ids = bench_hf.texts(comp.tok, 2, 16)
    pairs = bench_hf.losses(lambda x: bench_hf.step_ours(comp, opt, clip, x), hf.step, ids, steps=3)
    ours, theirs = zip(*pairs)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    assert ours[2] < ours[0]   # it trains: the steps moved the loss
