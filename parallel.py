"""Training on more than one process: torchrun's process group, DDP or FSDP2 around the training step, and the
checkpoint of a sharded run. train.py calls it wherever a process meets the others (processes, wrap, materialise,
no_gradient_sync around every micro-batch of a step but the last, clip_grad_norm, the step's summed numbers,
shard_optimizer_state); a run of one process on one device passes through each untouched.

    torchrun --nproc_per_node N train.py ...           DDP: every process holds the whole compressor
    torchrun --nproc_per_node N train.py ... --fsdp     FSDP2: every weight sharded over the processes

The device follows --device everywhere: the process group's backend (nccl for CUDA, gloo for the CPU) and FSDP's
mesh, so `--device cpu` under torchrun never touches a GPU, whatever the machine has.

FSDP2 (torch.distributed.fsdp.fully_shard) shards every weight, frozen and trained: each process holds 1/N of every
tensor, gathers a block's weights just before the block runs and frees them after, and reduce-scatters the gradients
(averaged over the processes, as DDP's all-reduce: train.py's loss scaling is the same). One FSDP unit per
transformer block of every model the compressor runs (the encoder, the decoder, GMSA's LSA; a LoRA encoder that IS
the decoder once), and the training step (train.TrainStep) as the root, which gathers the rest (embeddings, memory
tokens, bridge) whole for the whole step. Mixed dtypes (bf16 frozen, fp32 trained) in one unit are fine: FSDP2 gathers
each tensor in its own dtype. Where the run computes in bf16 (autocast), the blocks' MixedPrecisionPolicy gathers
their weights in bf16 and reduces gradients in fp32, as autocast computes in one process (tests/test_scale.py).

No rank holds the whole compressor at any time. train.py builds it on the meta device (shapes and dtypes, no storage),
shard assigns each rank its slices, and materialise fills them: what the base models give (the frozen LLM, and the
copies that train: AOC's encoder, PCC's compressor) read from their safetensors one tensor at a time, each cut to this
rank's shard and dropped before the next, and the rest of the trained init drawn on every rank from one seed, in the
order a one-process build draws it (compressors.initial_values), so every rank holds the slices of the very tensors a
run of one process starts from, and nothing is sent.

An FSDP run's checkpoints are sharded (checkpoint.py: torch.distributed.checkpoint, each rank writes and reads its
own slices, on any number of processes); a one-process checkpoint continues under FSDP, its trained tensors read one
at a time into the shards (checkpoint.load_trained) and its AdamW moments cut into them (shard_optimizer_state).
"""

import os
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
# fully_shard and MixedPrecisionPolicy from torch.distributed.fsdp: torch 2.6; distribute_tensor's src_data_rank: 2.7
# (requirements.txt's floor)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import compressors
from checkpoint import copy_into
from model import weight_reader


def under_torchrun() -> bool:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: one process per GPU."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextmanager
def processes(device: str | None, fsdp: bool):
    """(device, rank, world) of this process, inside its process group: torchrun's, or a group of one for --fsdp
    without torchrun (FSDP needs one). The group follows --device (default: CUDA when there is one) and is destroyed
    on every way out, an error or an early end included. More ranks than GPUs: a ValueError, one line."""
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if kind == "cuda" else "gloo"
    if under_torchrun():
        local = int(os.environ["LOCAL_RANK"])
        if kind == "cuda":
            if local >= torch.cuda.device_count():
                raise ValueError(f"torchrun started local rank {local}, and this machine has "
                                 f"{torch.cuda.device_count()} GPU(s): use --nproc_per_node "
                                 f"{torch.cuda.device_count()}, or --device cpu")
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
        here = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
    else:
        here = torch.device(device or kind)
        if here.type == "cuda" and here.index is not None:
            torch.cuda.set_device(here)   # FSDP2 and NCCL take the current device: --device cuda:1 runs on GPU 1
        if fsdp:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield here, (dist.get_rank() if dist.is_initialized() else 0), (dist.get_world_size() if
                                                                          dist.is_initialized() else 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def leave_rank():
    """A clean end (every file written and closed): the process group destroyed, and under torchrun the rank leaves at
    once, without freeing the trained objects or Python's finalization, either of which can block or abort it (gloo's
    worker threads outlive destroy_process_group, PyTorch PR 179291; a rank once hung in the teardown of the frame
    that held the model, after its last checkpoint). train.py calls it while that frame is alive."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def wrap(comp, step_fn, fsdp: bool, device: torch.device, world: int, bf16: bool) -> nn.Module:
    """The training step as the processes run it: sharded (--fsdp), replicated (DDP, more than one process), or as
    it is (one process)."""
    if fsdp:
        return shard(comp, step_fn, device, bf16)
    if world > 1:   # unused parameters: e.g. the [LM] embedding when the objective is ae
        return nn.parallel.DistributedDataParallel(step_fn, find_unused_parameters=True,
                                                   device_ids=[device.index] if device.type == "cuda" else None)
    return step_fn


def no_gradient_sync(step_module):
    """The context of a micro-batch's forward and backward that only accumulates its gradients: every one of a
    step's but the last, whose backward syncs them all. DDP all-reduces after every backward outside no_sync();
    FSDP2 reduce-scatters after every backward unless told not to (set_requires_gradient_sync), so the earlier
    micro-batches' gradients accumulate unsharded and are reduced once, with the last's."""
    if isinstance(step_module, nn.parallel.DistributedDataParallel):
        return step_module.no_sync()
    if isinstance(step_module, FSDPModule):
        return _without_gradient_sync(step_module)
    return nullcontext()


@contextmanager
def _without_gradient_sync(step_module):
    step_module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        step_module.set_requires_gradient_sync(True)


def clip_grad_norm(params, clip: float) -> torch.Tensor:
    """The gradients' total norm before clipping to `clip` (0: measured only), as a plain tensor on the device:
    under FSDP clip_grad_norm_ returns a DTensor, whose full_tensor() is the norm over every shard."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def summed(values: torch.Tensor, world: int) -> list:
    """A step's numbers (a 1-D tensor), summed over the processes, read to the host in one copy."""
    if world > 1:
        dist.all_reduce(values)
    return values.tolist()


def shard(comp, step_fn, device, bf16):
    """fully_shard every transformer block of comp's models, then the step (the root unit), on a mesh of `device`'s
    kind. train.main built the compressor on the meta device: sharding assigns each rank its slices, and materialise
    then fills them."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 runs: the blocks' weights gathered in bf16, gradients reduced in fp32 (what autocast computes). Inputs are
    # not cast (cast_forward_inputs=False): RoPE's cos/sin stay fp32, as under autocast
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if bf16 else MixedPrecisionPolicy()
    for block in compressors.blocks(comp):   # (a LoRA encoder is the decoder: its blocks are sharded once)
        fully_shard(block, mesh=mesh, mp_policy=mixed)
    fully_shard(step_fn, mesh=mesh)   # the root: embeddings, memory tokens, bridge, gathered whole for the step
    return step_fn


def materialise(step_fn, comp, device, frozen):
    """This rank's slices of a compressor built on the meta device and sharded (shard), filled: storage for this rank's
    shards only (to_empty on the root unit; Transformer._apply re-derives the RoPE buffers, non-persistent, on the
    device), then every tensor's value, one whole tensor at a time (compressors.initial_values: the base weights read
    from their files tensor by tensor, everything else drawn as a one-process build draws it, from the seed every rank
    set alike), cut to this rank's shard (checkpoint.copy_into) and dropped before the next is read or drawn. No rank
    ever holds the whole model, and nothing is sent."""
    step_fn.to_empty(device=device)
    cfg = comp.cfg
    # each base model's weights, read tensor by tensor from its files (--model, and --decoder's separate compressor)
    readers = {name: weight_reader(name, frozen, device) for name in (cfg.model, cfg.compressor_model) if name}
    filled = set()
    for tensor, value in compressors.initial_values(comp, frozen, device, lambda model, name: readers[model](name)):
        copy_into(tensor, value)
        filled.add(id(tensor))
        del value   # before the next one is read or drawn
    unfilled = [name for name, p in comp.named_parameters() if id(p) not in filled]
    if unfilled:   # (a tensor initial_values does not know would keep to_empty's garbage)
        raise RuntimeError(f"compressors.initial_values gives no value for {unfilled[:5]}")


def shard_optimizer_state(opt, opt_state: dict) -> dict:
    """A one-process optimizer state_dict with each moment cut into this rank's shard of its parameter (every rank
    read the same file: each slices its own part, no communication)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, per_param in opt_state["state"].items():
        p = params[int(i)]
        if isinstance(p, DTensor):
            for k, v in per_param.items():
                if k != "step" and torch.is_tensor(v) and v.shape == p.shape:
                    # src_data_rank=None slices locally; in some torch releases the slice is a view into the whole
                    # moment, which would keep every rank holding all of it: each shard gets storage of its own
                    shard = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    per_param[k] = DTensor.from_local(shard.to_local().clone(), p.device_mesh, p.placements,
                                                      shape=p.shape, stride=p.stride())
    return opt_state
