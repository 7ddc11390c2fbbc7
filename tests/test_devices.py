"""The compressors on a device that is not the CPU, without a GPU.

The bug class: a tensor made without `device=` lands on the CPU and then meets a model tensor on the GPU (GMSA's
LSA mask did: a crash on any GPU that no CPU test could see). PyTorch's `meta` device behaves like CUDA here:
an op that mixes a CPU tensor with a meta tensor raises "Tensor on device cpu is not on the expected device meta",
as CUDA raises "Expected all tensors to be on the same device". So every preset builds around a decoder on the
meta device and runs compress -> loss -> backward: any tensor made on the CPU and not moved raises. Meta tensors
hold no values, so the same run also proves that a training step never reads a value back from the device
(`.item()`, `.nonzero()`, `bool(t)` raise on meta): on a GPU each of those would stall the step.
`pytest tests --device cuda` runs the real thing on a GPU (tests/conftest.py).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compressors as C  # noqa: E402
import presets as P  # noqa: E402
from model import TINY_CONFIG, ModelConfig, Transformer, build_tiny  # noqa: E402

SETTINGS = {"icae": dict(mem=4, chunk_len=16, lora_r=2, lora_alpha=4), "500x": dict(mem=4, chunk_len=16, lora_r=2),
            "pcc": dict(mem=4, chunk_len=16), "pic": dict(mem=4, chunk_len=16), "compllm": dict(lora_r=2),
            "gmsa": dict(lora_r=2, lora_alpha=4), "aoc": dict(mem=4, chunk_len=16)}
VARIANTS = [(m, {}) for m in P.METHODS] + [
    ("icae", dict(layout="epl")), ("500x", dict(layout="upl")), ("aoc", dict(encoder="lora", lora_r=2)),
    ("aoc", dict(mask="pic")), ("gmsa", dict(decoder_train="keft"))]


def on_meta(method, **overrides):
    tok = build_tiny()[1]
    with torch.device("meta"):
        decoder = Transformer(ModelConfig.from_hf(TINY_CONFIG))
    return C.build(method, decoder, tok, **{**SETTINGS[method], **overrides})


@pytest.mark.parametrize("method,overrides", VARIANTS, ids=[f"{m}-{'-'.join(map(str, o.values())) or 'preset'}"
                                                            for m, o in VARIANTS])
def test_training_step_keeps_every_tensor_on_the_models_device(method, overrides):
    comp = on_meta(method, **overrides)
    tok = comp.tok
    texts = [tok.encode("A first context. It has two sentences, one short."), tok.encode("A second one, longer: " * 3)]
    memory = comp.compress(texts, **({"ratios": [2, 4]} if comp.cfg.source == "group_mean" else {}))
    assert memory.valid.device.type == "meta" and (memory.embeds if memory.kv is None else memory.kv[0][0]).is_meta
    qa = [comp.qa_parts("Ctx.", "Why?") for _ in texts]
    if comp.cfg.decoder_train == "keft":
        losses = [comp.lm_loss(memory, "qa", [p["prompt"] + [5, tok.eos_id] for p in qa], [2, 2],
                               prefix=[p["prefix"] for p in qa])[0]]
    else:
        losses = [comp.lm_loss(memory, "ae", [comp.ae_target(t) for t in texts])[0],
                  comp.lm_loss(memory, "lm", [[7, 8, tok.eos_id]] * 2, last_tokens=[t[-1] for t in texts])[0],
                  comp.lm_loss(memory, "qa", [p["prompt"] + [5, tok.eos_id] for p in qa], [2, 2],
                               prefix=[p["prefix"] for p in qa])[0]]
    if method == "compllm":
        losses.append(comp.distill_loss(texts, [p["prompt"] for p in qa], [[5, 6, tok.eos_id]] * 2)[0])
    sum(losses).backward()
    trained = comp.trainable_parameters()
    assert trained and all(p.grad is not None and p.grad.is_meta for p in trained if p.grad is not None)
    assert any(p.grad is not None for p in trained)
