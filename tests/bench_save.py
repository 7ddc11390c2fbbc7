"""Benchmark (not a test): what building an FSDP run's compressor, saving its checkpoint and loading it back
(torch.distributed.checkpoint: checkpoint.save_checkpoint, checkpoint.load_sharded) adds to each rank's memory, on the
CPU (gloo).

    python tests/bench_save.py [--procs 2 3] [--layers 8] [--hidden 512] [--vocab 32000]

N processes (torchrun) train PCC around a random Llama (its compressor LLM fully trained, so the trained tensors and
AdamW's moments are the bulk of the state) under --fsdp for 2 steps and save; then N processes resume that checkpoint
for a third step. Every rank measures its peak RSS over the RSS just before (Linux: /proc/self/clear_refs resets the
peak) around
  BUILD     the compressor's build, sharding and filling (train.build_compressor to the end of
            parallel.materialise, or of parallel.wrap where the code has no materialise: a whole build sharded after)
  SAVE      checkpoint.save_checkpoint
  LOAD      checkpoint.load_sharded (the resumed run's trained tensors and AdamW moments, DCP)
and prints it beside:
  shard     this rank's part of the state in question (at BUILD every parameter, frozen and trained; at SAVE and LOAD
            the trained tensors and both AdamW moments: what it holds at rest)
  largest   the largest single tensor among them, whole
  full      all of it (what one host would hold: a whole build, or one file of the state)
Each rank reads and writes only its own slices, one tensor at a time, so a rank should add at most its shard plus the
largest tensor, far under `full`.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss(field):
    """VmRSS or VmHWM of this process, bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def worker():
    sys.path.insert(0, REPO)
    import torch
    from torch.distributed.tensor import DTensor
    import checkpoint
    import parallel
    import train
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    rank = lambda: torch.distributed.get_rank()
    since = {}

    def start():   # the peak RSS starts again from the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        since["rss"] = rss("VmRSS")

    def report(what, tensors):
        added = rss("VmHWM") - since["rss"]
        print(what + " " + json.dumps(dict(rank=rank(), added=added,
                                           shard=sum(local(t).numel() * t.element_size() for t in tensors),
                                           largest=max(t.numel() * t.element_size() for t in tensors),
                                           full=sum(t.numel() * t.element_size() for t in tensors))), flush=True)

    def state(comp, opt):   # the trained tensors and AdamW's moments
        return list(checkpoint.trained_state(comp).values()) + [v for s in opt.state.values() for k, v in s.items()
                                                               if k != "step" and torch.is_tensor(v)]

    build, wrap, materialise = train.build_compressor, parallel.wrap, getattr(parallel, "materialise", None)
    save, load = train.save_checkpoint, checkpoint.load_sharded

    def building(*a, **kw):
        start()
        return build(*a, **kw)

    def wrapped(comp, *a, **kw):
        out = wrap(comp, *a, **kw)
        if materialise is None:   # sharded after a whole build: the build ends here
            report("BUILD", list(comp.parameters()))
        return out

    def materialised(step, comp, *a, **kw):
        materialise(step, comp, *a, **kw)
        report("BUILD", list(comp.parameters()))

    def saving(out, step, comp, opt, **kw):
        tensors = state(comp, opt)
        start()
        save(out, step, comp, opt, **kw)
        report("SAVE", tensors)

    def loading(comp, opt, folder):
        start()
        load(comp, opt, folder)
        report("LOAD", state(comp, opt))
    train.build_compressor, parallel.wrap, parallel.materialise = building, wrapped, materialised
    train.save_checkpoint, checkpoint.load_sharded = saving, loading
    train.main(sys.argv[sys.argv.index("--") + 1:])


def torchrun(n, flags):
    """The worker on n processes; its BUILD, SAVE and LOAD lines, by kind, each sorted by rank."""
    # every allocation over 64 KiB its own mmap, unmapped when freed (glibc; an explicit threshold also stops glibc
    # raising it on its own): the RSS then follows the live tensors, and freed memory is not reused unseen
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                          __file__, "--worker", "--", *flags], cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    # (found anywhere in the output: the ranks' lines and rank 0's progress bar interleave)
    lines = re.findall(r"(BUILD|SAVE|LOAD) (\{[^}]*\})", out.stdout)
    return {kind: sorted((json.loads(row) for k, row in lines if k == kind), key=lambda r: r["rank"])
            for kind in ("BUILD", "SAVE", "LOAD")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 3])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    from bench_plan import random_checkpoint
    mib = lambda b: f"{b / 2**20:,.1f}"
    print(f"pcc, random Llama d={a.hidden}, {a.layers} layers, vocabulary {a.vocab:,}, fp32, gloo, --fsdp\n")
    tables = {"BUILD": "the build", "SAVE": "the save", "LOAD": "the load"}
    rows = {kind: [] for kind in tables}
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden,
                      intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=a.hidden // 8, rms_norm_eps=1e-5, tie_word_embeddings=True)
        folder = random_checkpoint(os.path.join(tmp, "model"), config)
        doc = os.path.join(tmp, "doc.jsonl")
        with open(doc, "w") as f:
            for i in range(16):
                f.write(json.dumps({"text": f"document {i} " + "some words to compress " * 20}) + "\n")
        for n in a.procs:
            out = os.path.join(tmp, f"run{n}")
            flags = ["--method", "pcc", "--model", folder, "--data", doc, "--steps", "2", "--batch-size", str(2 * n),
                     "--mem", "4", "--chunk-len", "32", "--crop", "window", "--min-len", "32", "--max-len", "32",
                     "--device", "cpu", "--frozen-dtype", "fp32", "--fsdp", "--eval-every", "0", "--out", out]
            first = torchrun(n, flags)
            resumed = torchrun(n, ["--resume", out, "--steps", "3", "--device", "cpu", "--fsdp"])
            rows["BUILD"] += [(n, r) for r in first["BUILD"]]
            rows["SAVE"] += [(n, r) for r in first["SAVE"]]
            rows["LOAD"] += [(n, r) for r in resumed["LOAD"]]
    for kind, what in tables.items():
        print(f"\n{kind}: what {what} adds to each rank's peak RSS (MiB)\n")
        print(f"| processes | rank | added by {what} | this rank's shard | largest tensor | shard + largest | "
              "full |\n|---|---|---|---|---|---|---|")
        for n, r in rows[kind]:
            print(f"| {n} | {r['rank']} | {mib(r['added'])} | {mib(r['shard'])} | {mib(r['largest'])} | "
                  f"{mib(r['shard'] + r['largest'])} | {mib(r['full'])} |", flush=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
