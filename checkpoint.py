"""
A compressor's files, and the checkpoints of a training run, written so that a run killed at any moment can continue
exactly:

    DIR/compressor.safetensors, DIR/compressor.json     a compressor: its trained tensors and its config (save, load)
    OUT/ckpt-000200/{compressor.json, compressor.safetensors, train_state.pt}   one unit, renamed into place
    OUT/ckpt-000200/{compressor.json, sharded/, train_state.pt}                 the same unit of an --fsdp run
    OUT/compressor.json, OUT/compressor.safetensors     hard links to the newest unit: checkpoint.load(OUT)
    OUT/args.json, OUT/log.jsonl, OUT/cache/

train_state.pt holds the optimizer, the step, the args and every RNG state a run draws from (one per process); the
schedule is a function of the step and the data of (seed, step), so nothing else is needed. The log is runlog.py's.

A run of one process (DDP's included) writes the one-process format: compressor.safetensors and the optimizer in
train_state.pt. An --fsdp run (of any size, one process included) writes sharded/ instead, a
torch.distributed.checkpoint (DCP) folder: each rank writes its own shard of the trained tensors and of AdamW's state
(sharded_state), and a load reads into each tensor in place whatever part of it this rank holds, so a checkpoint saved
on N processes loads on M, one process without a process group included (load_trained_from, load_sharded). Saving or
loading, no process holds more than its shard and the tensor DCP is copying; a compressor.safetensors loads into an
FSDP run's shards one tensor at a time too (load_trained, copy_into). `python checkpoint.py --to-single RUN`
turns a run's newest sharded checkpoint into the one-process format (one host then holds everything, as its file
does).
"""

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, fields
from glob import glob

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, \
    set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

import compressors
from model import load_pretrained
from presets import CompressorConfig, validate


# ---- the compressor's files: compressor.safetensors (its trained tensors) and compressor.json (its config) ----


def saved_tensors(comp: compressors.Compressor, saved_under: CompressorConfig | None = None) -> dict:
    """The compressor's own tensors a checkpoint saved under `saved_under` (default: its config) holds, by name."""
    return {n: p for n, p in comp.named_parameters() if compressors.is_saved(saved_under or comp.cfg, n)}


def trained_state(comp: compressors.Compressor) -> dict:
    """The tensors a checkpoint holds (saved), by name, detached and contiguous."""
    return {n: p.detach().contiguous() for n, p in saved_tensors(comp).items()}


def save(comp: compressors.Compressor, out_dir: str, extra: dict | None = None, tensors: bool = True):
    """Write compressor.safetensors (exactly the trained tensors) and compressor.json (the config),
    each atomically (temp file + rename), so an interrupted save never leaves a broken checkpoint.
    tensors=False: compressor.json alone (a sharded checkpoint holds the tensors in its sharded/ folder)."""
    os.makedirs(out_dir, exist_ok=True)
    saved = saved_tensors(comp)
    if tensors:
        tmp = os.path.join(out_dir, "compressor.safetensors.tmp")
        save_file({n: p.detach().contiguous().cpu() for n, p in saved.items()}, tmp)
        os.replace(tmp, os.path.join(out_dir, "compressor.safetensors"))
    # the size of what was trained, special-token vectors aside, kept with the config (a record without weights);
    # numel of a sharded tensor is its whole size
    trained = sum(p.numel() for n, p in saved.items() if n not in compressors.SPECIALS)
    meta = {"config": asdict(comp.cfg), "trained_parameters": trained, **(extra or {})}
    tmp = os.path.join(out_dir, "compressor.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "compressor.json"))


def check_fits(own: dict, shapes: dict):
    """A ValueError listing what a checkpoint's tensors (`shapes`: name -> shape) lack, add or shape otherwise than
    the compressor's own (`own`: name -> tensor); nothing when they match."""
    missing = sorted(set(own) - set(shapes))
    unexpected = sorted(set(shapes) - set(own))
    wrong = sorted(n for n in set(own) & set(shapes) if tuple(own[n].shape) != tuple(shapes[n]))
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint does not match the compressor: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}")


def load_trained(comp: compressors.Compressor, state, saved_under: CompressorConfig | None = None):
    """Load exactly the tensors `save` wrote; list whatever is missing, unexpected or misshapen. state: name -> tensor,
    or a compressor.safetensors open (safe_open), read one tensor at a time: each is copied into its parameter (under
    FSDP into this rank's shard of it: copy_into) and dropped before the next is read. saved_under: the config they
    were saved under, when it is not the compressor's (GMSA's KEFT starts from a stage-1 run, which holds no decoder
    q/k/v: those are the base model's)."""
    own, on_disk = saved_tensors(comp, saved_under), not isinstance(state, dict)
    # our name -> the saved one. Accepts encoder.lm_head.* (a head this PCC/PIC encoder lacks: dropped), and GMSA's LSA
    # blocks named `lsa.*` as well as `bridge.lsa.*` (the bridge module's names)
    names = {("bridge." + n if n.startswith("lsa.") else n): n for n in state.keys()
             if comp.encoder.lm_head is not None or not n.startswith("encoder.lm_head.")}
    check_fits(own, {n: state.get_slice(k).get_shape() if on_disk else state[k].shape for n, k in names.items()})
    for n, p in own.items():
        copy_into(p, state.get_tensor(names[n]) if on_disk else state[names[n]])


def copy_into(tensor: torch.Tensor, whole: torch.Tensor):
    """`whole`'s values into `tensor`; where `tensor` is this rank's shard of a sharded parameter (a DTensor: FSDP),
    into the part it holds: cut here with no communication (distribute_tensor, src_data_rank=None) and copied into the
    shard's own storage. The caller drops `whole` after (one whole tensor at a time)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            part = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(part.to_local())
        else:
            tensor.copy_(whole)


def read_checkpoint_config(ckpt_dir: str) -> dict:
    """compressor.json of a checkpoint directory, with a one-line error when it is not one."""
    path = os.path.join(ckpt_dir, "compressor.json")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory '{ckpt_dir}' does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{ckpt_dir}' is not a checkpoint: compressor.json is missing "
                                "(point --ckpt at a train.py --out directory)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"'{path}' is corrupt ({e.msg}): restore it or retrain") from None
    if not isinstance(meta, dict):   # (a JSON list or number: every caller reads keys)
        raise ValueError(f"'{path}' is corrupt (a JSON {type(meta).__name__}, not an object): restore it or retrain")
    return meta


def saved_config(ckpt_dir: str) -> CompressorConfig:
    """The settings a checkpoint was trained with (its compressor.json); a setting the file does not name takes its
    default, as load() and train.py --init both build it."""
    saved = read_checkpoint_config(ckpt_dir).get("config")
    if not isinstance(saved, dict) or not {"method", "model"} <= saved.keys():
        raise ValueError(f"'{ckpt_dir}/compressor.json' has no compressor config (\"config\" with its method and "
                         "model): restore it or retrain")
    unknown = sorted(set(saved) - {f.name for f in fields(CompressorConfig)})
    if unknown:
        raise ValueError(f"'{ckpt_dir}/compressor.json' has settings this code does not know ({', '.join(unknown)}): "
                         "evaluate it with the code that trained it, or retrain")
    return CompressorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def load(ckpt_dir: str, dtype=torch.float32, device="cpu", trained=True) -> compressors.Compressor:
    """Rebuild a compressor from a checkpoint to evaluate it: base model(s) from the config in `dtype`, trained tensors
    on top. trained=False: the same compressor as first built, untrained (seeding torch as the run did reproduces its
    init). A run that resumes builds its own, in its training dtypes (train.build_compressor)."""
    cfg = saved_config(ckpt_dir)
    validate(cfg)
    decoder, tok = load_pretrained(cfg.model, dtype=dtype, device=device)
    encoder, enc_tok = None, None
    if cfg.encoder == "separate" and cfg.compressor_model:
        encoder, enc_tok = load_pretrained(cfg.compressor_model, dtype=dtype, device=device)
    comp = compressors.Compressor(cfg, decoder, tok, encoder, enc_tok)
    if trained:
        load_trained_from(comp, ckpt_dir)
    return comp


def load_trained_from(comp: compressors.Compressor, ckpt_dir: str, saved_under: CompressorConfig | None = None):
    """The trained tensors of a checkpoint directory, or of a run directory's newest checkpoint, into `comp`: its
    compressor.safetensors (load_trained), or its sharded/ folder (DCP, read into each tensor in place)."""
    folder = sharded_folder(ckpt_dir)
    if folder:
        own = saved_tensors(comp, saved_under)
        try:
            check_fits(own, saved_shapes(folder, "model"))
            dcp.load({"model": {n: p.detach() for n, p in own.items()}}, checkpoint_id=folder)
        except (OSError, dcp.CheckpointException) as e:
            raise ValueError(f"'{folder}' cannot be read ({first_line(e)}): restore it or retrain") from None
        return
    try:   # (the file's header: its tensors are read one at a time, load_trained)
        state = safe_open(os.path.join(ckpt_dir, "compressor.safetensors"), framework="pt", device=str(comp.device))
    except Exception as e:
        raise ValueError(f"'{ckpt_dir}/compressor.safetensors' cannot be read ({e}): restore it or retrain") from None
    with state:
        load_trained(comp, state, saved_under)


def first_line(e: Exception) -> str:
    """An exception's message cut to its first line (DCP's CheckpointException lists every rank's traceback)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---- sharded checkpoints: torch.distributed.checkpoint ----

SHARDED = "sharded"   # the DCP folder of an --fsdp run's checkpoint: .metadata and one __R_0.distcp file per rank
# bytes FileSystemWriter copies from the device to the host ahead of writing (its per_thread_copy_ahead default), on a
# GPU run; plan.py counts them
COPY_AHEAD = 10_000_000


def sharded_folder(path: str) -> str | None:
    """The DCP folder of a checkpoint directory, or of a run directory's newest checkpoint; None where that holds
    compressor.safetensors (the one-process format)."""
    if os.path.isfile(os.path.join(path, "compressor.safetensors")):
        return None
    for ckpt in (path, latest_checkpoint(path, required=False)):
        if ckpt and os.path.isfile(os.path.join(ckpt, SHARDED, ".metadata")):
            return os.path.join(ckpt, SHARDED)
    return None


def saved_shapes(folder: str, part: str) -> dict:
    """name -> shape of every tensor a DCP folder holds under `part` ("model": the trained tensors), from its
    .metadata alone."""
    metadata = dcp.FileSystemReader(folder).read_metadata()
    return {k.removeprefix(part + "."): m.size for k, m in metadata.state_dict_metadata.items()
            if k.startswith(part + ".") and hasattr(m, "size")}


def sharded_state(comp: compressors.Compressor, opt: torch.optim.Optimizer) -> dict:
    """What a sharded checkpoint holds, as DCP saves it and loads into it in place: "model", the trained tensors by
    trained_state's names (this rank's DTensor shards under FSDP, whole tensors in one process), and "optim",
    AdamW's state keyed by parameter name (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict: the
    moments as shards of their parameters, resharded on load). An optimizer without state gets zero moments first
    (get_optimizer_state_dict steps it once at lr 0), for a load to write into."""
    model = {n: p.detach() for n, p in saved_tensors(comp).items()}
    return {"model": model, "optim": get_optimizer_state_dict(comp, opt)}


def load_sharded(comp: compressors.Compressor, opt: torch.optim.Optimizer, folder: str):
    """A sharded checkpoint (DCP folder) into the trained tensors and AdamW's state, each rank reading its own
    slices of what any number of ranks saved (a collective under a process group; one process reads every slice)."""
    check_fits(saved_tensors(comp), saved_shapes(folder, "model"))
    state = sharded_state(comp, opt)
    # a parameter that never had a gradient (AOC's encoder blocks past the layer its memory is read from) has no
    # AdamW state in the checkpoint: it gets none here either, as in the run that saved it
    saved = saved_shapes(folder, "optim.state")
    state["optim"]["state"] = {name: per_param for name, per_param in state["optim"]["state"].items()
                               if all(f"{name}.{k}" in saved for k in per_param)}
    try:
        dcp.load(state, checkpoint_id=folder)
    except dcp.CheckpointException as e:
        raise ValueError(f"'{folder}' cannot be read ({first_line(e)})") from None
    # torch.distributed.checkpoint.state_dict: parameter names back to this optimizer's own parameters; strict=False
    # lets the parameters without a saved state (above) stay without one
    set_optimizer_state_dict(comp, opt, state["optim"], options=StateDictOptions(strict=False))


def whole_state(folder: str) -> dict:
    """A DCP folder as one dict of whole tensors ({"model": ..., "optim": ...}) in this process's memory, through
    torch.distributed.checkpoint.format_utils.dcp_to_torch_save (a torch.save file, read back mapped)."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as tmp:
        path = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(folder, path)
        return torch.load(path, map_location="cpu", weights_only=True)


def one_process_optimizer(optim: dict) -> dict:
    """An optimizer state keyed by parameter name (get_optimizer_state_dict's) in torch.optim's own layout: the
    parameters numbered in the order of the groups' lists, as Optimizer.state_dict numbers them."""
    index, groups = {}, []
    for group in optim["param_groups"]:
        groups.append({**group, "params": [index.setdefault(name, len(index)) for name in group["params"]]})
    return {"state": {index[name]: per_param for name, per_param in optim["state"].items()}, "param_groups": groups}


def to_single(run_dir: str) -> str:
    """`python checkpoint.py --to-single RUN`: the run's newest checkpoint, if sharded, in the one-process format
    (compressor.safetensors, the optimizer in train_state.pt, the top-level links), each file written atomically and
    the DCP folder removed last, so a stop at any moment leaves a checkpoint that loads. Returns the checkpoint."""
    ckpt = latest_checkpoint(run_dir)
    folder = os.path.join(ckpt, SHARDED)
    if not os.path.isdir(folder):
        raise ValueError(f"{ckpt} is in the one-process format already (compressor.safetensors): nothing to convert")
    whole = whole_state(folder)
    tmp = os.path.join(ckpt, "compressor.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in whole["model"].items()}, tmp)
    os.replace(tmp, os.path.join(ckpt, "compressor.safetensors"))
    state = read_train_state(run_dir)
    state.update(optimizer=one_process_optimizer(whole["optim"]), sharded=False)
    torch.save(state, os.path.join(ckpt, "train_state.pt.tmp"))
    os.replace(os.path.join(ckpt, "train_state.pt.tmp"), os.path.join(ckpt, "train_state.pt"))
    shutil.rmtree(folder)
    link_newest(run_dir, ckpt, sharded=False)
    return ckpt


# ---- a training run's checkpoints and RNG states ----


def save_checkpoint(out, step, comp, opt, record: dict, rng, data_key, keep_every=None, sharded=False, master=True):
    """Write everything a run needs to continue into a temporary directory, then rename it into place: a run
    killed at any moment leaves the previous checkpoint or the new one, never half of one. Then point the
    top-level compressor files at it and drop older checkpoints. (Atomic against a killed process; without
    fsync, not against a power cut.) record: what the run resolved (cli.Settings.record: the flags, the recipe's
    values, the config's fields), written as args.json and with the train state; cli.py reads it back on --resume.
    sharded (--fsdp): a collective, every rank calls it and writes its shard into the unit's sharded/ folder
    (sharded_state); master: rank 0, which writes the rest and renames the unit into place; no rank returns before
    the rename (the barrier at the end)."""
    tmp, final = os.path.join(out, f".tmp-ckpt-{step:06d}"), os.path.join(out, f"ckpt-{step:06d}")
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
    if sharded:
        dist.barrier()   # the old temporary folder is gone before any rank writes into its place
        # torch.distributed.checkpoint.save: every rank writes its own file; its last collective has rank 0 write
        # .metadata once every rank's file is written
        # (FileSystemWriter's copy-ahead overlaps device-to-host copies on a CUDA stream; a CPU run has none to
        # overlap and would touch CUDA wherever the machine has it: per_thread_copy_ahead=0, the serial loader)
        writer = dcp.FileSystemWriter(os.path.join(tmp, SHARDED),
                                      per_thread_copy_ahead=0 if comp.device.type == "cpu" else COPY_AHEAD)
        dcp.save(sharded_state(comp, opt), storage_writer=writer)
    if master:
        extra = {"step": step, "train_args": record}
        save(comp, tmp, extra, tensors=not sharded)   # a sharded unit's tensors are in its sharded/ folder
        torch.save(dict(step=step, optimizer=None if sharded else opt.state_dict(), sharded=sharded, rng=rng,
                        args=record, data=data_key, config=asdict(comp.cfg)), os.path.join(tmp, "train_state.pt"))
        # the schedule is a function of the step and the data of (seed, step): step + RNG states are their state
        if os.path.exists(final):
            shutil.rmtree(tmp)   # this very step was saved already (same state)
        else:
            os.rename(tmp, final)   # the commit: atomic on one file system
        link_newest(out, final, sharded)
        with open(os.path.join(out, "args.json.tmp"), "w") as f:
            json.dump(record, f, indent=2)
        os.replace(os.path.join(out, "args.json.tmp"), os.path.join(out, "args.json"))
        for old in glob(os.path.join(out, ".tmp-ckpt-*")):
            shutil.rmtree(old, ignore_errors=True)
        for old in glob(os.path.join(out, "ckpt-*")):
            kept = keep_every and int(old.rpartition("-")[2]) % keep_every == 0   # --keep-every (PIC §4.3.2)
            if old != final and not kept:
                shutil.rmtree(old, ignore_errors=True)
    if sharded:
        dist.barrier()   # every rank waits here for rank 0's writes, not in the next step's collectives


def link_newest(out, final, sharded):
    """OUT's compressor files: hard links to the newest unit's; a sharded unit has no compressor.safetensors, and an
    older one's link goes (checkpoint.load(OUT) then reads the newest unit's sharded/ folder: sharded_folder)."""
    names = ("compressor.json",) if sharded else ("compressor.safetensors", "compressor.json")
    if sharded and os.path.lexists(os.path.join(out, "compressor.safetensors")):
        os.remove(os.path.join(out, "compressor.safetensors"))
    for name in names:
        if os.path.exists(os.path.join(out, name)) and os.path.samefile(os.path.join(final, name),
                                                                         os.path.join(out, name)):
            continue   # linked already (a rename onto another link to the same file would do nothing)
        link = os.path.join(out, name + ".tmp")
        if os.path.lexists(link):
            os.remove(link)
        try:
            os.link(os.path.join(final, name), link)   # no second copy of the weights on disk
        except OSError:
            shutil.copy2(os.path.join(final, name), link)   # file systems without hard links
        os.replace(link, os.path.join(out, name))


def latest_checkpoint(run_dir, required=True):
    """The newest complete ckpt-NNNNNN directory of a run directory (complete: its train_state.pt exists)."""
    found = sorted(d for d in glob(os.path.join(run_dir, "ckpt-*"))
                   if os.path.isfile(os.path.join(d, "train_state.pt")))
    if not found and required:
        what = "does not exist" if not os.path.isdir(run_dir) else "holds no checkpoint (no ckpt-*/train_state.pt)"
        raise FileNotFoundError(f"cannot resume: {run_dir} {what}")
    return found[-1] if found else None


def read_train_state(run_dir):
    """train_state.pt of the newest checkpoint in run_dir, with a one-line error when it cannot be read. Mapped, not
    read (mmap=True): every process of a run resumed under FSDP reads the same one-process file and keeps only its
    shards of the moments (parallel.shard_optimizer_state), the file's pages shared between them."""
    path = os.path.join(latest_checkpoint(run_dir), "train_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:   # truncated, overwritten, not a torch file: all one line
        raise ValueError(f"cannot resume: {path} is corrupt ({type(e).__name__}); restore it or start a new run") \
            from None
    if not isinstance(state, dict) or not {"step", "optimizer", "rng", "args"} <= state.keys():
        raise ValueError(f"cannot resume: {path} is not a train.py checkpoint")
    return state


def gather_rng_states(world, device):
    """One RNG state per rank, gathered so that rank 0 can save them all (entry r is rank r's): torch's on the host
    (the init and dropout), and on CUDA this rank's own device's generator, never another GPU's (a machine's other GPUs
    are not this rank's, and a smaller machine would lack them)."""
    state = dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    if world == 1:
        return [state]
    states = [None] * world
    dist.all_gather_object(states, state)
    return states


def set_rng_state(state, device):
    """gather_rng_states's generators back, on this rank's device. Also accepts a checkpoint whose "cuda" is a list of
    every visible GPU's generator (get_rng_state_all): this device's entry, where it has one. (A checkpoint that also
    holds numpy's and random's: nothing draws from them, so they are left alone.)"""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):
        index = device.index or 0
        cuda = cuda[index] if device.type == "cuda" and index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def is_out_of_memory(e) -> bool:
    """A CUDA OOM, or a CPU allocation failure (PyTorch raises RuntimeError "can't allocate memory"): the run stops
    with one line, and its last good checkpoint stays."""
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        m in str(e) for m in ("out of memory", "can't allocate memory"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A training run's newest checkpoint in the one-process format.")
    parser.add_argument("--to-single", metavar="RUN", required=True,
                        help="a train.py --out folder whose newest checkpoint an --fsdp run wrote (sharded/, DCP): "
                             "rewritten as compressor.safetensors + train_state.pt, read by evaluate.py and --init")
    try:
        print(f"{to_single(parser.parse_args().to_single)}: compressor.safetensors and train_state.pt written")
    except (ValueError, OSError) as e:
        parser.error(str(e))
