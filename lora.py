"""
LoRA (Hu et al., 2021) with dropout on the low-rank branch, as PEFT: the encoders of ICAE, 500x, EPL, CompLLM and
GMSA train it on the frozen LLM's own weights.

    y = x Wᵀ + b + (alpha / r) · (dropout(x) Aᵀ) Bᵀ,    A (r, in), B (out, r), B = 0 at the start

`add_lora` wraps the named linear layers in place (the base tensors shared, not copied) and freezes everything else;
`lora_disabled` makes every wrapped layer its base again for a block (the frozen decoder, when the encoder is the
same model).
"""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * (dropout(x) A^T) B^T,  A (r, in), B (out, r), scale = alpha / r (Hu et al., 2021);
    the dropout acts on the LoRA branch only, as in PEFT. A subclass of nn.Linear holding the *same* weight/bias
    tensors, so the base keys stay `...q_proj.weight`."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16, dropout: float = 0.0):
        # built on meta so nn.Linear allocates (and randomly inits) nothing; the base tensors are reused below
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        w = base.weight
        self.lora_A = nn.Parameter(draw_lora_A(r, base.in_features, w.device, w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=w.device, dtype=w.dtype))  # B = 0: exact
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # PEFT: Identity when p = 0
        self.r, self.scale = r, alpha / r
        # lora_disabled() flips it: the module then acts as its base linear (ICAE decoder). An attribute of each module
        # from the start, never a class default it shadows later: a compiled forward (train.py --compile) checks the
        # same attribute before and after the first lora_disabled(), two graphs (on, off) and not a third
        self.lora_enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)  # (..., out): the frozen base, never dropped out
        if self.lora_enabled:
            # through the rank-r bottleneck, never forming B A: (..., in) -> (..., r) -> (..., out)
            y = y + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scale
        return y

    def extra_repr(self):
        return f"{super().extra_repr()}, r={self.r}, scale={self.scale}"


def draw_lora_A(r: int, in_features: int, device, dtype) -> torch.Tensor:
    """A's initial value, (r, in), drawn from torch's generator. PEFT's default (what ICAE uses): A is (r, in), so
    kaiming_uniform with a=√5 bounds it by 1/√in; EPL's hand-written LoRA stores A as (in, r), so its fan_in is r and
    its init is √(in/r) times larger."""
    A = torch.empty(r, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    return A


def _swap_module(model: nn.Module, name: str, new: nn.Module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def add_lora(model: nn.Module, targets=("q_proj", "v_proj"), r: int = 8, alpha: float = 16,
             dropout: float = 0.0) -> list[str]:
    """Wrap every nn.Linear whose name ends in one of `targets` with LoRA (in place, weights shared, not
    copied); freeze everything else in `model`. Returns the names of the LoRA parameters.
    dropout: on the LoRA branch's input in train mode (ICAE's and AOC's LoRA use 0.05)."""
    names = [n for n, m in model.named_modules()
             if n.rpartition(".")[2] in targets and type(m) is nn.Linear]  # type(): skip existing LoRALinear
    if not names:
        raise ValueError(f"add_lora: no nn.Linear named {targets} in the model")
    for n in names:
        _swap_module(model, n, LoRALinear(model.get_submodule(n), r, alpha, dropout))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return [n for n, _ in model.named_parameters() if "lora_" in n]


@contextmanager
def lora_disabled(model: nn.Module):
    """Inside the block every LoRALinear of `model` computes its base linear only (the frozen LLM)."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, b in zip(mods, before):
            m.lora_enabled = b


def lora_as_now(module: nn.Module):
    """`module` as a function that runs with its LoRA switches as they are now: activation checkpointing runs a
    block again in backward, after the lora_disabled() block its forward ran in has ended (ICAE's decoder is its
    LoRA encoder), and a recomputation with LoRA switched back on is another function (a CheckpointError, or
    wrong gradients where the shapes happen to match)."""
    mods = [m for m in module.modules() if isinstance(m, LoRALinear)]
    if not mods:
        return module
    now = [m.lora_enabled for m in mods]

    def run(*args):
        before = [m.lora_enabled for m in mods]
        for m, on in zip(mods, now):
            m.lora_enabled = on
        try:
            return module(*args)
        finally:
            for m, on in zip(mods, before):
                m.lora_enabled = on
    return run
