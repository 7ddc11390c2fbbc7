"""FSDP for a compressor that does not fit on one GPU: `torchrun --nproc_per_node N train.py ... --fsdp`.

PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) shards every weight, frozen and trained, over the processes:
each holds 1/N of every tensor, gathers a block's weights just before the block runs and frees them after, and
reduce-scatters the gradients (averaged over the processes, as DDP's all-reduce: train.py's loss scaling is the
same). One FSDP unit per transformer block of every model the compressor runs (the encoder, the decoder, GMSA's
LSA; a LoRA encoder that IS the decoder once), and the training step (train.TrainStep) as the root, which gathers
the rest (embeddings, memory tokens, bridge) for the whole step. Mixed dtypes (bf16 frozen, fp32 trained) in one
unit are fine: FSDP2 gathers each tensor in its own dtype.

Checkpoints are the one-process format: the trained tensors and AdamW's moments are gathered whole before rank 0
writes them (full_state), and scattered back into shards on resume (shard_optimizer_state), so a run saved under
FSDP continues in one process and the other way round.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def shard(comp, step_fn):
    """fully_shard every transformer block of comp's models, then the step (the root unit); returns step_fn.
    First every rank takes rank 0's trained tensors, as DDP does when it wraps: each rank drew its own init (its own
    seed), and FSDP would otherwise keep each rank's shard of a different init. (The frozen base is the same file on
    every rank.)"""
    import compressors as C
    with torch.no_grad():
        for name, p in comp.named_parameters():
            if p.requires_grad or C.saved(comp.cfg, name):
                dist.broadcast(p.data, src=0)
    seen = set()
    for model in (comp.encoder, comp.decoder, getattr(comp, "lsa", None)):
        for block in model.model.layers if model is not None else ():
            if id(block) not in seen:   # a LoRA encoder is the decoder: its blocks are sharded once
                seen.add(id(block))
                fully_shard(block)
    fully_shard(step_fn)
    return step_fn


def full(t):
    """A whole tensor from a shard (a collective: every rank calls it, in the same order), or t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(comp, opt) -> tuple:
    """(trained tensors by name, optimizer state_dict) in the one-process format, on every rank."""
    state = {n: full(t) for n, t in comp.trained_state().items()}
    opt_state = opt.state_dict()
    for per_param in opt_state["state"].values():
        for k, v in per_param.items():
            per_param[k] = full(v)
    return state, opt_state


def shard_optimizer_state(opt, opt_state: dict) -> dict:
    """A one-process optimizer state_dict with each moment cut into this rank's shard of its parameter (every rank
    read the same file: each slices its own part, no communication)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, per_param in opt_state["state"].items():
        p = params[int(i)]
        if isinstance(p, DTensor):
            for k, v in per_param.items():
                if k != "step" and torch.is_tensor(v) and v.shape == p.shape:
                    per_param[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                                     src_data_rank=None)
    return opt_state
