"""Benchmark (not a test): CompLLM's complexity claims (§3), time to first token and KV-cache size of a compressor
against the full context, at each context length.

    python tests/bench_speed.py --ckpt runs/recipes/compllm/compllm_s0 --lengths 256,512,1024,2048,4096
    python tests/bench_speed.py --method compllm --model tiny                # an untrained preset
    python tests/bench_speed.py --method compllm --shape qwen3-4b --lengths 1024,2048,4096,8192,16384,32768

The context is the built-in texts repeated to each length. Loads a checkpoint as evaluate.py does; without --ckpt an
untrained preset (--method) around --model or a random model of a paper model's --shape (no download; times depend
on the shape alone). Writes --out (default CKPT/eval_speed.json, or eval_speed_METHOD.json: evaluate.py's record)
and prints a markdown table; recipes/compllm.sh runs it on its arm (recipes/common.sh's speed_arm).
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compressors as C  # noqa: E402
import presets as P  # noqa: E402
import evaluate as E  # noqa: E402
import data as D  # noqa: E402
from model import SHAPES, build_shape, load_pretrained  # noqa: E402

# CompLLM §3 "complexity": compressing independent segments of S tokens costs O(N·S), linear in the context length
# N; the decoder's prefill costs O(N²) with the full context and O(N²/C²) with the concept embeddings, so the
# time-to-first-token (TTFT) speedup tends to C² for long contexts and the KV cache shrinks by C. We time, at each
# context length:
#
#     compress      encoder forward (+ segmentation, bridge): the cost of making the memory
#     ttft_full     decoder prefill over [BOS, context, question] + the first token's logits
#     ttft_comp     decoder prefill over [memory, special, question] + the first token's logits
#     decode        per-token time of greedy steps with either KV cache
#
# offline speedup = ttft_full / ttft_comp (memory cached, e.g. a document queried many times); online speedup =
# ttft_full / (compress + ttft_comp) (compressed on the fly).

SPEED_QUESTION = " Question: What is this text about? Answer:"
LENGTHS = (512, 1024, 2048, 4096, 8192)   # default --lengths


def timed(fn, device, repeats=3, warmup=1):
    """(median wall time in seconds over `repeats` calls after `warmup` untimed calls, last result)."""
    # CUDA kernels run asynchronously: wait for them before reading the clock
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def prefill(comp, inputs):
    """One decoder forward over the prompt, then the first generated token: the TTFT work."""
    with comp.decoding():
        out = comp.decoder(**inputs, return_kv=True, compute_logits=False)
        first = comp.decoder.lm_head(out.last_hidden[:, -1]).argmax(-1)      # (1,)
    return out.kv, first


def decode(comp, kv, token, next_pos, n):
    """n greedy steps on a KV cache (what Transformer.generate does after its prefill)."""
    with comp.decoding():
        for i in range(n):
            pos = torch.tensor([[next_pos + i]], device=token.device)
            out = comp.decoder(token[:, None], position_ids=pos, past_kv=kv, return_kv=True, compute_logits=False)
            kv, token = out.kv, comp.decoder.lm_head(out.last_hidden[:, -1]).argmax(-1)
    return token


def kv_bytes(kv, start, n):
    """Bytes of cache slots start .. start+n-1 over all layers, K and V: n · layers · 2 · Hkv · D · bytes."""
    return sum(t[:, :, start:start + n].numel() * t.element_size() for k, v in kv for t in (k, v))


def fit_exponent(lengths, times):
    """k in time ≈ a · length^k: the least-squares slope of log time against log length."""
    if len(lengths) < 2:
        return float("nan")
    return float(np.polyfit(np.log(lengths), np.log(times), 1)[0])


@torch.no_grad()
def run_speed(comp, lengths, max_new_tokens=None, repeats=3):
    """Time compression, TTFT and decoding, and measure KV-cache bytes, at each context length."""
    tok = comp.tok
    dev = comp.decoder.model.embed_tokens.weight.device
    question = tok.encode(SPEED_QUESTION)
    n_decode = max_new_tokens or 16
    text = tok.encode(" ".join(D.EVAL_TEXTS) + " ")
    rows, stopped = [], None
    for T in tqdm(lengths, desc="speed", leave=False):
        ctx = (text * (T // len(text) + 1))[:T]          # the built-in texts repeated to T tokens
        try:
            enc = comp.encoder_ids(ctx)
            t_comp, memory = timed(lambda: E.compress(comp, [enc]), dev, repeats)
            # CompLLM §1 "reusability": the same context again, its chunks' memories already cached
            cache = {}
            E.compress(comp, [enc], cache=cache)
            t_cached, _ = timed(lambda: E.compress(comp, [enc], cache=cache), dev, repeats)
            M = sum(memory.slots[0])
            full = dict(input_ids=torch.tensor([[tok.start_id] + ctx + question], device=dev))
            t_full, (kv_full, first_full) = timed(lambda: prefill(comp, full), dev, repeats)
            mem_in = comp.decoder_batch(memory, "qa", [question], [0])   # [memory, special, question], as generate
            # one unpadded sample: no mask, so SDPA takes the fused causal kernel the full-context prefill takes
            assert mem_in["attn_mask"] is None
            t_mem, (kv_mem, first_mem) = timed(lambda: prefill(comp, mem_in), dev, repeats)
            next_full = full["input_ids"].shape[1]
            next_mem = int(mem_in["position_ids"][0, -1]) + 1
            d_full, _ = timed(lambda: decode(comp, kv_full, first_full, next_full, n_decode), dev, repeats)
            d_mem, _ = timed(lambda: decode(comp, kv_mem, first_mem, next_mem, n_decode), dev, repeats)
        except torch.cuda.OutOfMemoryError:   # on CPU the operating system ends the process instead
            stopped = f"out of memory at {T} tokens"
            torch.cuda.empty_cache()
            break
        # the cache that holds the context: its T token slots (after BOS) vs the M memory slots, which
        # come first in both carriers (KV prefix, or the first M input embeddings)
        b_full, b_mem = kv_bytes(kv_full, 1, T), kv_bytes(kv_mem, 0, M)
        rows.append(dict(context_tokens=T, memory_slots=M, compression=T / M,
                         compress_s=t_comp, compress_cached_s=t_cached, ttft_full_s=t_full, ttft_compressed_s=t_mem,
                         ttft_online_s=t_comp + t_mem, speedup_offline=t_full / t_mem,
                         speedup_online=t_full / (t_comp + t_mem),
                         decode_full_s_per_token=d_full / n_decode, decode_compressed_s_per_token=d_mem / n_decode,
                         kv_bytes_full=b_full, kv_bytes_compressed=b_mem, kv_ratio=b_mem / b_full))
    if not rows:
        raise ValueError(f"speed: no context length could run ({stopped})")
    Ls = [r["context_tokens"] for r in rows]
    exponents = {k: fit_exponent(Ls, [r[k] for r in rows]) for k in ("compress_s", "ttft_full_s", "ttft_compressed_s")}
    # the same fit over the two longest lengths only: short contexts are dominated by fixed overheads
    tail = {k: fit_exponent(Ls[-2:], [r[k] for r in rows[-2:]]) for k in exponents}
    last = rows[-1]
    # CompLLM's bound: the prefill is quadratic, so TTFT can shrink by at most (N / M)² = C². The
    # measured N / M sits a little under the nominal C, as every segment rounds its ⌈n / C⌉ slots up.
    bound = last["compression"] ** 2
    nominal = comp.cfg.ratio ** 2 if comp.cfg.ratio > 0 else None
    return {"rows": rows, "decode_tokens": n_decode, "exponents": exponents, "exponents_longest_two": tail,
            "ttft_bound_c2": bound, "ttft_ratio_of_bound": last["speedup_offline"] / bound,
            "nominal_c2": nominal, "stopped": stopped}


def report_speed(result):
    header = ["tokens", "mem", "compress ms", "TTFT full ms", "TTFT comp ms", "speedup off", "speedup on",
              "decode full ms/tok", "decode comp ms/tok", "KV full MB", "KV comp MB", "KV ratio"]
    rows = [[r["context_tokens"], r["memory_slots"], 1e3 * r["compress_s"], 1e3 * r["ttft_full_s"],
             1e3 * r["ttft_compressed_s"], r["speedup_offline"], r["speedup_online"],
             1e3 * r["decode_full_s_per_token"], 1e3 * r["decode_compressed_s_per_token"],
             r["kv_bytes_full"] / 2**20, r["kv_bytes_compressed"] / 2**20, r["kv_ratio"]] for r in result["rows"]]
    e, t = result["exponents"], result["exponents_longest_two"]
    lines = [E.markdown_table(header, rows), "",
             "time ~ length^k: " + ", ".join(f"{k[:-2]} k={e[k]:.2f} (longest two: {t[k]:.2f})" for k in e),
             f"TTFT speedup at {rows[-1][0]} tokens: {result['rows'][-1]['speedup_offline']:.2f} of the "
             f"(N/M)^2 = C^2 = {result['ttft_bound_c2']:.3g} bound ({100 * result['ttft_ratio_of_bound']:.0f}%)"
             + (f"; nominal C^2 = {result['nominal_c2']:g} "
                f"({100 * result['rows'][-1]['speedup_offline'] / result['nominal_c2']:.0f}%)"
                if result["nominal_c2"] else "")]
    if result["stopped"]:
        lines.append(f"stopped: {result['stopped']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = E._Parser(prog="bench_speed.py", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="checkpoint directory written by train.py --out")
    p.add_argument("--method", help=f"without --ckpt: an untrained preset, {', '.join(P.METHODS)}; with it, a check")
    p.add_argument("--model", help="base LLM (HF id, directory or tiny; default tiny); with --ckpt it must match")
    p.add_argument("--shape", choices=tuple(SHAPES), help="without --ckpt: a random model of this paper model's "
                   "shape instead of --model")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="context lengths in tokens, "
                   "comma-separated (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="timed greedy decode steps (default 16)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default cuda if any")
    p.add_argument("--dtype", choices=tuple(E.DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", help="JSON results file (default CKPT/eval_speed.json, or eval_speed_METHOD.json)")
    args = p.parse_args(argv)
    if args.ckpt is None and args.method is None:
        raise SystemExit("error: give --ckpt DIR, or --method M for an untrained preset")
    if args.shape and (args.ckpt is not None or args.model is not None):
        raise SystemExit("error: --shape replaces --model and needs no --ckpt (an untrained --method M only)")
    if args.max_new_tokens < 1:
        raise SystemExit(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no CUDA device is available: use --device cpu")
    args.dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
    return args


def main(argv=None):
    """Run the benchmark; returns the result dict (also written as JSON). Bad input -> SystemExit('error: ...')."""
    args = parse_args(argv)
    torch.manual_seed(0)   # an untrained preset's memory tokens repeat run to run
    out = args.out or (os.path.join(args.ckpt, "eval_speed.json") if args.ckpt else f"eval_speed_{args.method}.json")
    try:
        lengths = E.numbers(args.lengths, int, "lengths")
        if min(lengths) < 1:
            raise ValueError(f"--lengths must be positive, got {lengths}")
        if args.ckpt is not None:
            comp = E.load_compressor(args)   # evaluate.py's checks: --model and --method must match the checkpoint
        else:
            dtype = E.DTYPES[args.dtype]
            decoder, tok = (build_shape(args.shape, args.device, dtype) if args.shape else
                            load_pretrained(args.model or "tiny", dtype=dtype, device=args.device))
            comp = C.build(args.method, decoder, tok).eval()
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        result = run_speed(comp, lengths, args.max_new_tokens)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    # evaluate.py's record (recipes/summarize.py reads speed:rows.-1.speedup_offline); ratio: GMSA's --ratio, not used
    result = {"task": "speed", "checkpoint": args.ckpt, "config": asdict(comp.cfg),
              "ratio": None, "device": args.device, "dtype": args.dtype, **result}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(report_speed(result))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
