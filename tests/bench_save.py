"""Benchmark (not a test): what an FSDP checkpoint (torch.distributed.checkpoint, checkpoint.save_checkpoint) adds to
each rank's memory, on the CPU (gloo).

    python tests/bench_save.py [--procs 2 3] [--layers 8] [--hidden 512] [--vocab 32000]

N processes (torchrun) train PCC around a random Llama (its compressor LLM fully trained, so the trained tensors and
AdamW's moments are the bulk of the state) under --fsdp for 2 steps and save. Around each save, every rank measures
its peak RSS over the RSS just before (Linux: /proc/self/clear_refs resets the peak), and prints it beside:
  shard     this rank's part of the trained tensors and both AdamW moments (what it holds at rest)
  largest   the largest single tensor among them, whole
  full      the whole trained state and moments (what one host would hold to write one file)
Each rank writes its own shard (DCP's FileSystemWriter, one tensor at a time), so every rank, rank 0 included, should
add at most `largest` (a shard copied where its storage is padded), far under `shard + largest`.
"""

import argparse
import json
import os
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
    import train
    save = train.save_checkpoint

    def measured(out, step, comp, opt, **kw):
        trained = list(checkpoint.trained_state(comp).values()) + [v for s in opt.state.values()
                                                                  for k, v in s.items()
                                                                  if k != "step" and torch.is_tensor(v)]
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        shard = sum(local(t).numel() * t.element_size() for t in trained)
        full = sum(t.numel() * t.element_size() for t in trained)
        largest = max(t.numel() * t.element_size() for t in trained)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # the peak RSS starts again from the current RSS
        before = rss("VmRSS")
        save(out, step, comp, opt, **kw)
        added = rss("VmHWM") - before
        print("SAVE " + json.dumps(dict(rank=torch.distributed.get_rank(), added=added, shard=shard, largest=largest,
                                        full=full)), flush=True)
    train.save_checkpoint = measured
    train.main(sys.argv[sys.argv.index("--") + 1:])


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
    print(f"pcc, random Llama d={a.hidden}, {a.layers} layers, vocabulary {a.vocab:,}, fp32, gloo, "
          "checkpoint.save_checkpoint (DCP)\n")
    print("| processes | rank | added by the save MiB | shard MiB | largest tensor MiB | shard + largest MiB | "
          "full state MiB |")
    print("|---|---|---|---|---|---|---|")
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
            flags = ["--method", "pcc", "--model", folder, "--data", doc, "--steps", "2", "--batch-size", str(2 * n),
                     "--mem", "4", "--chunk-len", "32", "--crop", "window", "--min-len", "32", "--max-len", "32",
                     "--device", "cpu", "--frozen-dtype", "fp32", "--fsdp", "--eval-every", "0",
                     "--out", os.path.join(tmp, f"run{n}")]
            # every allocation over 64 KiB its own mmap, unmapped when freed (glibc; an explicit threshold also stops
            # glibc raising it on its own): the RSS then follows the live tensors, and freed memory is not reused unseen
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  str(n), __file__, "--worker", "--", *flags], cwd=REPO, env=env, capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            rows = sorted((json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("SAVE ")),
                          key=lambda r: r["rank"])
            for r in rows:
                print(f"| {n} | {r['rank']} | {mib(r['added'])} | {mib(r['shard'])} | {mib(r['largest'])} | "
                      f"{mib(r['shard'] + r['largest'])} | {mib(r['full'])} |", flush=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
