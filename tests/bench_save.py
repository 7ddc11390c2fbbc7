"""Benchmark (not a test): what an FSDP checkpoint adds to each rank's memory, on the CPU (gloo).

    python tests/bench_save.py [--layers 8] [--hidden 512] [--vocab 32000]

Two processes (torchrun) train PCC around a random Llama (its compressor LLM fully trained, so the trained tensors and
AdamW's moments are the bulk of the state) under --fsdp for 2 steps and save. Around each save, every rank measures
its peak RSS over the RSS just before (Linux: /proc/self/clear_refs resets the peak), and prints it beside:
  shard     this rank's part of the trained tensors and both AdamW moments (what it holds at rest)
  largest   the largest single tensor among them, whole
  full      the whole trained state and moments (what a rank holds when it gathers everything)
parallel.gathered_state gathers tensor by tensor into rank 0's CPU memory: rank 1 should add at most about `largest`,
rank 0 about `full` (on the CPU the device is the host, and rank 0 keeps the state it writes; on a GPU its device
holds at most `largest` more). "--all-ranks" makes every rank keep the gathered state, to compare.
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


def worker(all_ranks):
    sys.path.insert(0, REPO)
    import torch
    from torch.distributed.tensor import DTensor
    import checkpoint
    import parallel
    import train
    gather = parallel.gathered_state

    def measured(comp, opt, master):
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
        state = gather(comp, opt, master or all_ranks)
        added = rss("VmHWM") - before
        print("SAVE " + json.dumps(dict(rank=torch.distributed.get_rank(), added=added, shard=shard, largest=largest,
                                        full=full)), flush=True)
        return state if master else None
    parallel.gathered_state = measured
    train.main(sys.argv[sys.argv.index("--") + 1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--all-ranks", action="store_true", help="every rank keeps the gathered state")
    a = p.parse_args()
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    from bench_plan import random_checkpoint
    mib = lambda b: f"{b / 2**20:,.1f}"
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
        flags = ["--method", "pcc", "--model", folder, "--data", doc, "--steps", "2", "--batch-size", "2", "--mem", "4",
                 "--chunk-len", "32", "--crop", "window", "--min-len", "32", "--max-len", "32", "--device", "cpu",
                 "--frozen-dtype", "fp32", "--fsdp", "--eval-every", "0", "--out", os.path.join(tmp, "run")]
        # every allocation over 64 KiB its own mmap, unmapped when freed (glibc; an explicit threshold also stops
        # glibc raising it on its own): the RSS then follows the live tensors, and freed memory is not reused unseen
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              __file__, "--worker", *(["--all-ranks"] if a.all_ranks else []), "--", *flags],
                             cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
    rows = sorted((json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("SAVE ")),
                  key=lambda r: r["rank"])
    print(f"pcc, random Llama d={a.hidden}, {a.layers} layers, vocabulary {a.vocab:,}, fp32, 2 processes (gloo), "
          f"{'every rank keeps the gathered state' if a.all_ranks else 'parallel.gathered_state'}\n")
    print("| rank | added by the save MiB | shard MiB | largest tensor MiB | shard + largest MiB | full state MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {mib(r['added'])} | {mib(r['shard'])} | {mib(r['largest'])} | "
              f"{mib(r['shard'] + r['largest'])} | {mib(r['full'])} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker("--all-ranks" in sys.argv[:sys.argv.index("--")])
    else:
        main()
