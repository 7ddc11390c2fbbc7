"""
A compressor's files, and the checkpoints of a training run, written so that a run killed at any moment can continue
exactly:

    DIR/compressor.safetensors, DIR/compressor.json     a compressor: its trained tensors and its config (save, load)
    OUT/ckpt-000200/{compressor.json, compressor.safetensors, train_state.pt}   one unit, renamed into place
    OUT/compressor.json, OUT/compressor.safetensors     hard links to the newest unit: checkpoint.load(OUT)
    OUT/args.json, OUT/log.jsonl, OUT/cache/

train_state.pt holds the optimizer, the step, the args and every RNG state a run draws from (one per process); the
schedule is a function of the step and the data of (seed, step), so nothing else is needed. The log is runlog.py's.
"""

import json
import os
import shutil
from dataclasses import asdict, fields
from glob import glob

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import compressors
from model import load_pretrained
from presets import CompressorConfig, validate


# ---- the compressor's files: compressor.safetensors (its trained tensors) and compressor.json (its config) ----


def trained_state(comp: compressors.Compressor) -> dict:
    """The tensors a checkpoint holds (saved), by name."""
    return {n: p.detach().contiguous() for n, p in comp.named_parameters() if compressors.is_saved(comp.cfg, n)}


def save(comp: compressors.Compressor, out_dir: str, extra: dict | None = None, state: dict | None = None):
    """Write compressor.safetensors (exactly the trained tensors) and compressor.json (the config),
    each atomically (temp file + rename), so an interrupted save never leaves a broken checkpoint.
    state: the trained tensors, when they were gathered already (train.py --fsdp: parallel.gathered_state)."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "compressor.safetensors.tmp")
    state = state or trained_state(comp)
    save_file({k: v.cpu() for k, v in state.items()}, tmp)
    os.replace(tmp, os.path.join(out_dir, "compressor.safetensors"))
    # the size of what was trained, special-token vectors aside, kept with the config (a record without weights)
    trained = sum(v.numel() for k, v in state.items() if k not in compressors.SPECIALS)
    meta = {"config": asdict(comp.cfg), "trained_parameters": trained, **(extra or {})}
    tmp = os.path.join(out_dir, "compressor.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "compressor.json"))


def load_trained(comp: compressors.Compressor, state: dict, saved_under: CompressorConfig | None = None):
    """Load exactly the tensors `save` wrote; list whatever is missing, unexpected or misshapen. saved_under: the config
    they were saved under, when it is not the compressor's (GMSA's KEFT starts from a stage-1 run, which holds no
    decoder q/k/v: those are the base model's)."""
    own = {n: p for n, p in comp.named_parameters() if compressors.is_saved(saved_under or comp.cfg, n)}
    if comp.encoder.lm_head is None:   # accepts encoder.lm_head.* (a head this PCC/PIC encoder lacks): dropped
        state = {n: t for n, t in state.items() if not n.startswith("encoder.lm_head.")}
    # accepts GMSA's LSA blocks named `lsa.*` as well as `bridge.lsa.*` (the bridge module's names)
    state = {("bridge." + n if n.startswith("lsa.") else n): t for n, t in state.items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(n for n in set(own) & set(state) if own[n].shape != state[n].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint does not match the compressor: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {shapes[:5]}")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(state[n])


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
    """The trained tensors of a checkpoint directory (its compressor.safetensors) into `comp` (load_trained)."""
    try:
        state = load_file(os.path.join(ckpt_dir, "compressor.safetensors"), device=str(comp.device))
    except Exception as e:
        raise ValueError(f"'{ckpt_dir}/compressor.safetensors' cannot be read ({e}): restore it or retrain") from None
    load_trained(comp, state, saved_under)


# ---- a training run's checkpoints and RNG states ----


def save_checkpoint(out, step, comp, opt, record: dict, rng, data_key, keep_every=None, whole=None):
    """Write everything a run needs to continue into a temporary directory, then rename it into place: a run
    killed at any moment leaves the previous checkpoint or the new one, never half of one. Then point the
    top-level compressor files at it and drop older checkpoints. (Atomic against a killed process; without
    fsync, not against a power cut.) record: what the run resolved (cli.Settings.record: the flags, the recipe's
    values, the config's fields), written as args.json and with the train state; cli.py reads it back on --resume."""
    tmp, final = os.path.join(out, f".tmp-ckpt-{step:06d}"), os.path.join(out, f"ckpt-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    # compressor.json + compressor.safetensors; whole: the trained tensors and AdamW state gathered from FSDP's shards
    save(comp, tmp, extra={"step": step, "train_args": record}, state=whole and whole[0])
    torch.save(dict(step=step, optimizer=whole[1] if whole else opt.state_dict(), rng=rng, args=record,
                    data=data_key, config=asdict(comp.cfg)), os.path.join(tmp, "train_state.pt"))
    # the schedule is a function of the step and the data of (seed, step): step + RNG states are their state
    if os.path.exists(final):
        shutil.rmtree(tmp)   # this very step was saved already (same state)
    else:
        os.rename(tmp, final)   # the commit: atomic on one file system
    for name in ("compressor.safetensors", "compressor.json"):
        link = os.path.join(out, name + ".tmp")
        if os.path.lexists(link):
            os.remove(link)
        try:
            os.link(os.path.join(final, name), link)   # no second copy of the weights on disk
        except OSError:
            shutil.copy2(os.path.join(final, name), link)   # file systems without hard links
        os.replace(link, os.path.join(out, name))
    with open(os.path.join(out, "args.json.tmp"), "w") as f:
        json.dump(record, f, indent=2)
    os.replace(os.path.join(out, "args.json.tmp"), os.path.join(out, "args.json"))
    for old in glob(os.path.join(out, ".tmp-ckpt-*")):
        shutil.rmtree(old, ignore_errors=True)
    for old in glob(os.path.join(out, "ckpt-*")):
        kept = keep_every and int(old.rpartition("-")[2]) % keep_every == 0   # --keep-every (PIC §4.3.2)
        if old != final and not kept:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir, required=True):
    """The newest complete ckpt-NNNNNN directory of a run directory (complete: its train_state.pt exists)."""
    found = sorted(d for d in glob(os.path.join(run_dir, "ckpt-*"))
                   if os.path.isfile(os.path.join(d, "train_state.pt")))
    if not found and required:
        what = "does not exist" if not os.path.isdir(run_dir) else "holds no checkpoint (no ckpt-*/train_state.pt)"
        raise FileNotFoundError(f"cannot resume: {run_dir} {what}")
    return found[-1] if found else None


def read_train_state(run_dir):
    """train_state.pt of the newest checkpoint in run_dir, with a one-line error when it cannot be read."""
    path = os.path.join(latest_checkpoint(run_dir), "train_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
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

