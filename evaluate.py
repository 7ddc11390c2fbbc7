"""Evaluation: the tasks that score a compressor as the five papers do, and the command line.

    python evaluate.py --ckpt DIR --task {ae,lm,qa,needle,interpolate,heatmap} [--data PATH] [--n N]

Tasks (TASKS, `--help`, describes each), one section each below: ae, lm, qa (each next to the plain LLM with the
full context and with none), interpolate (AOC Eq. 5), heatmap (PIC Figures 3 and 7), needle (passkey retrieval).
CompLLM's speed and KV-cache claims are a benchmark, tests/bench_speed.py; training curves are recipes/curve.py's.
The scores are metrics.py's; the built-in examples are data.py's held-out set, and .jsonl / .parquet records are
read with data.py's reader (train.py's).
"""

import argparse
import json
import math
import os
import platform
import random
import re
import statistics
import weakref
from contextlib import nullcontext
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import data   # the built-in corpus and its held-out set; the one reader of .jsonl / .parquet records
import masks
from figures import heat_png, needle_png, render_text
import presets
from metrics import ae_scores, mean_scores, passkey_score, perplexity, qa_scores, tokens_per_slot
from model import load_pretrained

# -----------------------------------------------------------------------------
# ---- data ----
# Each quality task scores three rows, as the papers report a method between two references (EPL Table 4, PIC Table
# 2, GMSA Table 1):
#
#     compressed   the decoder reads [memory, special token, prompt]         the method
#     full         the plain LLM reads [BOS, context, "\n\n", prompt]        upper reference
#     none         the plain LLM reads [BOS, prompt]                         lower reference
#
# "full" and "none" use the plain LLM (PlainLLM), so they depend on the base model, not on the checkpoint. For LM the
# continuation follows the context directly; QA uses the checkpoint's template (Compressor.qa_parts) in all three.
#
# A lower loss with memory than without proves little: a learned constant prompt gets that too. So ae, lm and qa
# also score, teacher-forced, the same targets after the memory of *another* text (a fixed derangement, text i reads
# the memory of text i+1; qa: of the next document): own / other < 1 means each memory carries its own text.

SEP = "\n\n"   # between the context and what follows it in the "full" row
MODES = ("compressed", "full", "none")


def load_examples(path, task, n=None):
    """The examples of a task: dicts with "text" (ae, lm, heatmap) or "context", "question", "answer" (qa; answer is a
    str or a list of accepted answers). No path: the built-in sets. path: .jsonl or .parquet, one record a row, as
    train.py reads and checks them ({"text"} or {"context", "question", "answer"}, data.qa_record: a number answer is
    its text, SQuAD's answer dicts their texts; a malformed record is one line naming the file and line; a QA record
    serves the text tasks through its context), or any other file as plain text, one text per non-empty line
    (train.py reads a whole .txt file as one document to draw windows from; an evaluation needs fixed examples).
    n: keep the first n."""
    if path is None:
        rows = [dict(r) for r in data.EVAL_QA] if task == "qa" else [{"text": t} for t in data.unseen_texts()]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    elif path.endswith((".jsonl", ".parquet")):   # data.py's reader (train.py's), and its checks of a QA record
        need = '{"context", "question", "answer"}' if task == "qa" else '{"text"} or {"context", ...}'
        rows = []
        for where, rec in data.records(path):
            kind = data.record_kind(rec)   # (SQuAD's "answers" -> "answer")
            if kind == "qa":
                rec = data.qa_record(rec, f"{path} {where}")
            if kind is None or (task == "qa" and kind != "qa"):   # (a QA record serves the text tasks too)
                raise ValueError(f"{path} {where}: --task {task} reads {need} records")
            rows.append(rec if task == "qa" or kind == "text" else {"text": rec["context"]})
    else:
        with open(path, encoding="utf-8") as f:
            rows = [{"text": line.rstrip("\n")} for line in f if line.strip()]
        if task == "qa":
            raise ValueError(f'--data {path}: --task qa reads .jsonl or .parquet records '
                             '{"context", "question", "answer"}, not lines of text')
    if not rows:
        raise ValueError(f"--data {path} holds no examples")
    return rows[:n] if n else rows


def protocol(crop="window", max_len=None, min_len=None, objective=None) -> dict:
    """How a run cut its texts, so that an evaluation cuts them the same way: head crop -> every text is its first n
    tokens, padded with EOS to n, and regenerated up to n tokens (AOC code); pretrain -> AE reconstructs the first
    ⌊|X|/2⌋ tokens (of those n under a head crop), what pretraining compressed (EPL code). max_len: cut every text to
    its first max_len tokens; min_len: score only texts of at least min_len tokens (at_trained_length)."""
    return dict(crop=crop, n=max_len, min=min_len, half=objective == "pretrain")


def trained_protocol(ckpt, max_len=None, min_len=None) -> dict:
    """The protocol of the run that trained `ckpt`, as its record says (train.py saves the run's settings with each
    checkpoint: compressor.json's "train_args"; none for a compressor saved outside a run). max_len: cut at that
    length, else at the run's --max-len (as its own held-out check cuts, whatever the crop); min_len: score texts of
    at least that many tokens, else of at least the run's --min-len (at most the cut)."""
    run = checkpoint.read_checkpoint_config(ckpt).get("train_args") or {}
    n = max_len or run.get("max_len")
    shortest = run.get("min_len") if n else None   # texts shorter than the run's --min-len are not scored
    return protocol(run.get("crop", "window"), n, min_len or (shortest and min(shortest, n)), run.get("objective"))


def at_trained_length(comp, examples, proto, n=None):
    """The texts an ae or lm score reads (ours): those of at least the run's --min-len tokens, then the first
    n. A run trained on texts of 64 tokens into 16 slots is then scored at 4 tokens per slot, not on the shorter
    held-out texts its memory was never asked to hold (cut to the trained length by texts_as_trained)."""
    if proto.get("min"):
        examples = [ex for ex in examples if len(comp.tok.encode(ex["text"])) >= proto["min"]]
        if not examples:
            raise TooShort(proto["min"])
    return examples[:n] if n else examples


class TooShort(ValueError):
    """No text reaches the length a run trained on (at_trained_length): evaluate.py and train.py's check each say
    what to do about it in their own terms."""

    def __init__(self, min_len):
        super().__init__(f"no text of at least {min_len} tokens (the run's --min-len) to score: pass --data with "
                         "longer texts, or --min-len N")
        self.min_len = min_len


def texts_as_trained(comp, texts, proto):
    """(what is compressed, the reference) ids of each text under the checkpoint's protocol, as data.draw_text
    cuts a training text."""
    tok, pad = comp.tok, comp.tok.pad_id if comp.tok.pad_id is not None else comp.tok.eos_id
    out = []
    for text in texts:
        ids = tok.encode(text)[:proto["n"]] if proto["n"] else tok.encode(text)   # at most n tokens, as trained
        # AOC code: a head crop is tokenizer truncation + padding="max_length" with EOS; the reference is unpadded
        x = ids + [pad] * (proto["n"] - len(ids)) if proto["crop"] == "head" else ids
        if proto["half"]:   # EPL code: pretraining compressed x[:p], p = ⌊|X|/2⌋ of that text (head crop: of the n)
            p = max(1, len(x) // 2)
            x, ids = x[:p], ids[:p]
        out.append((x, ids))
    return out


def accelerator(device) -> str:
    """The machine a number was measured on, for the record: the GPU's name (torch.cuda.get_device_name), else "cpu"
    with the processor's name where the platform gives one (ours: "H100" in a README names a record)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def batches(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


# -----------------------------------------------------------------------------
# ---- running the compressor and the plain LLM ----


def compress(comp, contexts, group_size=None, cache=None):
    """comp.compress with a fixed group size for group merging (GMSA's compression ratio r): GMSA samples r per
    example while training (§4.1); an evaluation must be repeatable, so it uses --ratio (group_size), else the first
    of the preset's ratios (4x)."""
    ratios = [group_size or comp.cfg.ratios[0]] * len(contexts) if comp.cfg.source == "group_mean" else None
    return comp.compress(contexts, ratios=ratios, cache=cache)


# after GMSA's KEFT: compressor -> its base LLM, loaded once and kept while the compressor lives (train.py's held-out
# check scores every --eval-every steps: a load per check cost a disk read and a model's memory each time)
BASE_LLMS = weakref.WeakKeyDictionary()


class PlainLLM:
    """The references' LLM: the base model with no memory. Usually the compressor's own decoder with a shared
    encoder's LoRA switched off; after GMSA's KEFT (whose q/k/v are trained) a copy of the base model, in the
    decoder's dtype, loaded once per compressor (BASE_LLMS)."""

    def __init__(self, comp):
        self.tok, self.device = comp.tok, comp.device
        if comp.cfg.decoder_train == "keft":
            if comp not in BASE_LLMS:
                dtype = comp.decoder.model.embed_tokens.weight.dtype
                BASE_LLMS[comp] = load_pretrained(comp.cfg.model, dtype=dtype, device=comp.device)[0].eval()
            self.model, self.decoding = BASE_LLMS[comp], nullcontext
        else:
            self.model, self.decoding = comp.decoder, comp.decoding

    def _padded(self, rows, left):
        """Token rows -> ids (B, T), positions (B, T) of the real tokens, mask (B, T, T) or None."""
        T = max(map(len, rows))
        pad = lambda r, v: [v] * (T - len(r)) + r if left else r + [v] * (T - len(r))
        ids = torch.tensor([pad(list(r), 0) for r in rows], device=self.device)
        pos = torch.tensor([pad(list(range(len(r))), 0) for r in rows], device=self.device)
        valid = torch.tensor([pad([True] * len(r), False) for r in rows])
        mask = None if bool(valid.all()) else masks.with_padding(masks.causal(T), valid).to(self.device)   # on the host
        return ids, pos, mask

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens):
        """Greedy continuations of a batch of prompts (left-padded), each cut before its first EOS."""
        ids, pos, mask = self._padded(prompts, left=True)
        with self.decoding():
            out = self.model.generate(ids, position_ids=pos, attn_mask=mask, max_new_tokens=max_new_tokens,
                                      eos_id=self.tok.eos_ids or None)
        return [self.tok.cut_at_eos(row) for row in out.tolist()]

    @torch.no_grad()
    def nll(self, prefixes, follows):
        """Per row: summed NLL of `follow` after `prefix` (prefix non-empty), and its length."""
        rows = [list(p) + list(f) for p, f in zip(prefixes, follows)]
        ids, pos, mask = self._padded(rows, left=False)
        with self.decoding():
            h = self.model(ids, position_ids=pos, attn_mask=mask, compute_logits=False).last_hidden   # (B, T, d)
        out = []
        for b, (p, f) in enumerate(zip(prefixes, follows)):
            # slot t predicts token t + 1: from the last prefix token to the one before the end
            logits = self.model.lm_head(h[b, len(p) - 1:len(p) + len(f) - 1]).float()   # (len(f), V)
            out.append((F.cross_entropy(logits, ids[b, len(p):len(p) + len(f)], reduction="sum").item(), len(f)))
        return out


def summarize(rows, extra=None, modes=MODES):
    """Per-example rows -> {"scores": {mode: mean scores}, "examples": rows} (+ the set-level numbers)."""
    return {"scores": {m: mean_scores([r[m]["scores"] for r in rows]) for m in modes}, **(extra or {}),
            "examples": rows}


def memory_losses(rows):
    """Set-level teacher-forced losses (Σ NLL / Σ tokens, never a mean of per-example means) with the own memory,
    another text's memory and no memory, and own / other: 1.0 when a memory says nothing about its own text (a learned
    constant prompt), well below 1 when it carries it."""
    total = lambda key: sum(r["loss"][key][0] for r in rows) / max(1, sum(r["loss"][key][1] for r in rows))
    own, none = total("own"), total("none")
    other = total("other") if rows[0]["loss"]["other"] is not None else None
    full = {"full": total("full")} if "full" in rows[0]["loss"] else {}    # qa: the plain LLM with the context
    return {"loss": {"own": own, "other": other, "none": none, **full, "own_other_ratio": other and own / other,
                     "perplexity_own": math.exp(own), "tokens": sum(r["loss"]["own"][1] for r in rows)}}


def derangement(n, k=1):
    """The fixed "other" of the own/other test: text i reads the memory of text i + 1 (mod n). qa --concat k: the
    questions sit in groups of k (the last may be shorter) that share one long context, and question i reads the next
    group's, at the same place in it (or its last): i + k (mod n) only where k divides n, since i + k can land back
    in i's own group when it wraps (n = 5, k = 3: question 2 would read group 0, its own). None when there is no
    other group (n <= k)."""
    groups = -(-n // k)   # ceil(n / k)
    if groups < 2:
        return None
    nxt = lambda i: (i // k + 1) % groups * k                   # the first question of the next group
    return [nxt(i) + min(i % k, n - nxt(i) - 1) for i in range(n)]


def memory_nll(comp, task, enc, follow, group_size=None, cache=None, **nll_args):
    """Compress `enc` (encoder ids per row) and score `follow` after that memory, teacher-forced (comp.nll): (memory,
    per row (summed NLL, tokens)). The own and the other memory of the own/other test both go through it."""
    memory = compress(comp, enc, group_size, cache=cache)
    return memory, list(zip(*comp.nll(memory, task, follow, **nll_args)))


# -----------------------------------------------------------------------------
# ---- ae, lm, qa ----


@torch.no_grad()
def run_ae(comp, examples, max_new_tokens=None, proto=None, batch_size=8, group_size=None, generate=True,
           modes=MODES):
    """Reconstruction: compress each text, regenerate it greedily from its memory (ICAE's AE task, AOC §3, EPL Table
    6), in batches. Default budget: the compressed length for a head-cropped checkpoint (AOC code: n; after
    pretraining ⌊n/2⌋), else the reference length + 8. Also the teacher-forced AE loss on the text and its EOS with
    the own memory, another text's memory and none (EPL Table 9 reports the AE loss and its perplexity).
    generate=False: the losses only ({"protocol", "loss"}, no regeneration), as recipes/curve.py scores every kept
    checkpoint; modes: which regenerations (train.py --eval-bleu's check and evaluate.py --no-baselines: only
    "compressed", from the memory)."""
    tok, plain = comp.tok, PlainLLM(comp)
    proto = proto or protocol()
    pairs = texts_as_trained(comp, [ex["text"] for ex in examples], proto)
    other = derangement(len(pairs))
    rows = []
    for idx in tqdm(batches(list(range(len(pairs))), batch_size), desc="ae", leave=False):
        xs, refs = [pairs[i][0] for i in idx], [pairs[i][1] for i in idx]
        n_new = max_new_tokens or (len(xs[0]) if proto["crop"] == "head" else max(len(r) for r in refs) + 8)
        # targets: the AE target (comp.ae_target); the loss counts the text and its EOS, not a leading [BOS]
        follow, n_text = [comp.ae_target(x) for x in xs], [len(x) + 1 for x in xs]
        own, nll_own = memory_nll(comp, "ae", [comp.encoder_ids(x) for x in xs], follow, group_size,
                                  n_supervised=n_text)
        nll_other = other and memory_nll(comp, "ae", [comp.encoder_ids(pairs[other[i]][0]) for i in idx], follow,
                                         group_size, n_supervised=n_text)[1]
        nll_none = plain.nll([[tok.start_id]] * len(xs), [x + [tok.eos_id] for x in xs])
        regenerate = {"compressed": lambda: comp.generate(own, "ae", max_new_tokens=n_new),
                      "full": lambda: plain.generate([[tok.start_id] + x + tok.encode(SEP) for x in xs], n_new),
                      "none": lambda: plain.generate([[tok.start_id]] * len(xs), n_new)}
        outs = {mode: regenerate[mode]() for mode in modes} if generate else {}
        for j, i in enumerate(idx):
            row = {"text": examples[i]["text"], "reference": tok.decode(refs[j]), "reference_ids": refs[j],
                   "memory_slots": sum(own.slots[j]),
                   "loss": {"own": nll_own[j], "other": other and nll_other[j], "none": nll_none[j]}}
            for mode, gen in outs.items():
                ids = gen[j]
                stopped = ids + [tok.eos_id] if len(ids) < n_new else ids   # EPL keeps the EOS it generated
                row[mode] = {"text": tok.decode(ids), "ids": ids,
                             "scores": ae_scores(ids, refs[j], tok, epl=(stopped, comp.ae_target(refs[j])))}
            rows.append(row)
    losses = {"protocol": proto, **memory_losses(rows), "tokens_per_slot": tokens_per_slot(rows)}
    return summarize(rows, losses, modes) if generate else losses



@torch.no_grad()
def run_lm(comp, examples, batch_size=8, group_size=None, max_len=None):
    """Completion: cut each text at p = ⌊|X|/2⌋ (EPL §4.1; at least 1, as train.py cuts), compress the first half and
    score the second half and EOS (the LM target of the EPL and PCC code) given that memory (PIC Eq. 7, EPL Table 4),
    the memory of another text's first half, the full first half, or nothing. Perplexity is exp(Σ NLL / Σ tokens) over
    the whole set, never a mean of per-example perplexities. max_len: each text cut to its first max_len tokens
    first, as pretraining cut it."""
    tok, plain = comp.tok, PlainLLM(comp)
    cuts = []
    for ex in examples:
        ids = tok.encode(ex["text"])[:max_len]
        if not ids:
            raise ValueError(f"an empty text has nothing to compress for the LM task: {ex['text']!r}")
        p = max(1, len(ids) // 2)   # as data.draw_text cuts a pretraining text: a 1-3 token text too
        cuts.append((ids[:p], ids[p:] + [tok.eos_id]))
    other = derangement(len(cuts))
    rows = []
    for idx in tqdm(batches(list(range(len(cuts))), batch_size), desc="lm", leave=False):
        ctx, cont = [cuts[i][0] for i in idx], [cuts[i][1] for i in idx]
        # the decoder reads each memory with the last token of the text it compressed (the LM token, comp.nll)
        lm_nll = lambda cs: memory_nll(comp, "lm", [comp.encoder_ids(c) for c in cs], cont, group_size,
                                       last_tokens=[c[-1] for c in cs])
        own, nll_own = lm_nll(ctx)
        nll_other = other and lm_nll([cuts[other[i]][0] for i in idx])[1]
        nlls = {"compressed": nll_own, "full": plain.nll([[tok.start_id] + c for c in ctx], cont),
                "none": plain.nll([[tok.start_id]] * len(idx), cont)}
        for j, i in enumerate(idx):
            row = {"text": examples[i]["text"], "context_tokens": len(ctx[j]), "memory_slots": sum(own.slots[j]),
                   "loss": {"own": nll_own[j], "other": other and nll_other[j], "none": nlls["none"][j]}}
            for mode in MODES:
                nll, n = nlls[mode][j]
                row[mode] = {"nll": nll, "tokens": n, "perplexity": perplexity(nll, n)}
            rows.append(row)
    scores = {}
    for mode in MODES:
        nll, n = sum(r[mode]["nll"] for r in rows), sum(r[mode]["tokens"] for r in rows)
        scores[mode] = {"perplexity": perplexity(nll, n), "nll": nll, "tokens": n}
    return {"scores": scores, **memory_losses(rows), "examples": rows}


# the papers' QA generation budgets (new tokens), per preset
QA_BUDGET = {"pcc": 30, "pic": 30,          # PCC evaluate_qa.py
             "compllm": 512,                # CompLLM: answers of 149-273 tokens on average
             "icae": 1024, "500x": 1024}    # EPL's evaluator (generate_num)


def concatenated(examples, k):
    """CompLLM §4 (after LOFT): the contexts of k examples joined into one, each question then asked against that
    longer context (one question per document, so the relevant one sits anywhere)."""
    out = []
    for group in batches(examples, k):
        context = SEP.join(ex["context"] for ex in group)
        out += [{**ex, "context": context, "documents": len(group)} for ex in group]
    return out


@torch.no_grad()
def run_qa(comp, examples, max_new_tokens=None, batch_size=8, group_size=None, concat=1, reuse=True, max_len=None,
           generate=True, score=qa_scores, losses=True, modes=MODES):
    """Answer from memory + question (PIC/PCC SQuAD, EPL, CompLLM, GMSA KEFT), with the checkpoint's template
    (Compressor.qa_parts) in all three rows. The whole generation up to EOS is scored, as the papers' scripts do, by
    score(generation, answer) -> {name: value} (default qa_scores; needle: the passkey). concat > 1: CompLLM's long
    contexts. reuse: a chunk's memory is computed once and kept (CompLLM's reusability); False compresses every time.
    losses (ours: the papers score generations only): also the teacher-forced loss of the reference answer (the
    first, QA training's target, without its EOS) after its own memory, another document's, no context and the full
    context. max_len: contexts cut as QA training cuts them. generate=False: the losses only ({"loss"}), as
    train.py's held-out check scores itself; modes: which rows regenerate (evaluate.py --no-baselines: "compressed")."""
    tok, plain = comp.tok, PlainLLM(comp)
    n_new = max_new_tokens or QA_BUDGET.get(comp.cfg.method, 64)
    examples = concatenated(examples, concat) if concat > 1 else examples
    # a chat template carries its own start; otherwise the plain LLM's prompt starts with BOS
    lead = [] if comp.template()[0] else [tok.start_id]
    parts = [comp.qa_parts(ex["context"], ex["question"]) for ex in examples]
    if max_len:   # data.draw_qa: contexts cut at --max-len (the context's tokens; the template's text kept)
        parts = [{**p, "enc_context": comp.cut_context(p["enc_context"], max_len, comp.enc_tok),
                  "dec_context": comp.cut_context(p["dec_context"], max_len, tok)} for p in parts]
    answers = [tok.encode(data.first_answer(ex["answer"])) for ex in examples]
    # over documents: question i reads the memory of question i + concat's context, the next document's
    other = derangement(len(examples), concat)
    cache, rows = ({} if reuse else None), []
    for idx in tqdm(batches(list(range(len(examples))), batch_size), desc="qa", leave=False):
        ps, ans = [parts[i] for i in idx], [answers[i] for i in idx]
        prefix, prompt = [p["prefix"] for p in ps], [p["prompt"] for p in ps]
        full = [lead + p["prefix"] + p["dec_context"] + p["prompt"] for p in ps]    # the plain LLM's prompts
        none = [lead + p["prefix"] + p["prompt"] for p in ps]
        follow, n_ans = [q + a for q, a in zip(prompt, ans)], [len(a) for a in ans]
        memory = compress(comp, [p["enc_context"] for p in ps], group_size, cache=cache)
        if losses:
            nll_own = list(zip(*comp.nll(memory, "qa", follow, n_ans, prefix=prefix)))
            nll_other = other and memory_nll(comp, "qa", [parts[other[i]]["enc_context"] for i in idx], follow,
                                             group_size, cache, n_supervised=n_ans, prefix=prefix)[1]
            nll_none, nll_full = plain.nll(none, ans), plain.nll(full, ans)
        regenerate = {"compressed": lambda: comp.generate(memory, "qa", prompt=prompt, max_new_tokens=n_new,
                                                          prefix=prefix),
                      "full": lambda: plain.generate(full, n_new), "none": lambda: plain.generate(none, n_new)}
        outs = {mode: regenerate[mode]() for mode in modes} if generate else {}
        for j, i in enumerate(idx):
            ex = examples[i]
            row = {"context": ex["context"], "question": ex["question"], "answer": ex["answer"],
                   "memory_slots": sum(memory.slots[j])}
            if losses:
                row["loss"] = {"own": nll_own[j], "other": other and nll_other[j], "none": nll_none[j],
                               "full": nll_full[j]}
            for mode, gen in outs.items():
                text = tok.decode(gen[j])
                row[mode] = {"text": text, "scores": score(text, ex["answer"])}
            rows.append(row)
    if not generate:
        return memory_losses(rows)
    return summarize(rows, {"max_new_tokens": n_new, "concat": concat, "reuse": reuse,
                            **(memory_losses(rows) if losses else {})}, modes)


def markdown_table(header, rows):
    """The stdout tables of every task's report (floats to 4 significant digits)."""
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def report_text(result):
    """ae, lm, qa: each context's scores, the teacher-forced losses, and (ae) texts next to their regenerations."""
    keys = list(result["scores"]["compressed"])
    table = markdown_table(["context"] + keys, [[m] + [s.get(k, "") for k in keys] for m, s in result["scores"].items()])
    if "loss" not in result:
        return table
    L = result["loss"]
    other = "" if L["other"] is None else (
        f", another text's memory {L['other']:.4f}; own/other {L['own_other_ratio']:.3f} "
        "(1.0 = the memory says nothing about its own text)")
    full = f", the full context {L['full']:.4f}" if "full" in L else ""
    table += (f"\n\nteacher-forced loss per token ({L['tokens']} {'answer ' if full else ''}tokens): own memory "
              f"{L['own']:.4f}, no memory {L['none']:.4f}{full}{other}")
    if "tokens_per_slot" in result:   # the compression the texts were scored at
        r = result["tokens_per_slot"]
        table += (f"\n\ncompression: {r['mean']:.2f} tokens per memory slot over the {len(result['examples'])} "
                  f"texts (min {r['min']:.2f}, max {r['max']:.2f})")
    if result["task"] == "ae":   # a few texts next to what the decoder regenerated from their memory
        shown = [[repr(ex["reference"][:160]), repr(ex["compressed"]["text"][:160])] for ex in result["examples"][:3]]
        table += "\n\n" + markdown_table(["held-out text", "regenerated from its memory"], shown)
    return table


# -----------------------------------------------------------------------------
# ---- interpolate (AOC Eq. 5) ----

DEFAULT_TEXT0 = "We present an awesome new idea."
DEFAULT_TEXT1 = "Large planets may have many moons."
DEFAULT_WEIGHTS = "0,0.25,0.5,0.53,0.55,0.6,0.75,1"   # AOC Table 4 shows w = 0.5, 0.53, 0.55 and 0.6


@torch.no_grad()
def run_interpolate(comp, text0, text1, weights, max_new_tokens=None, proto=None):
    """AOC Eq. (5): regenerate from Z = Z0 + w (Z1 − Z0) for each w, where Z0, Z1 compress text0, text1 (AOC Table 4
    walks from one prompt to the other). Every tensor the decoder reads is mixed (memory embeddings, or every layer's
    K and V); the rest of the memory (chunk lengths, hence the EPL decoder positions) is Z0's. Needs memories of the
    same shape: always true for a fixed --mem budget and texts of at least --mem tokens, but methods that size memory
    by length (CompLLM, PCC/PIC, GMSA) need texts that compress to the same number of slots. A head-cropped checkpoint
    (AOC) compresses each prompt padded with EOS to the trained length n, as AOC's compress() does, so the memory and
    [BOS] sit where training put them."""
    tok = comp.tok
    (x0, ids0), (x1, ids1) = texts_as_trained(comp, [text0, text1], proto or protocol())
    z0, z1 = compress(comp, [comp.encoder_ids(x0)]), compress(comp, [comp.encoder_ids(x1)])
    m0, m1 = sum(z0.slots[0]), sum(z1.slots[0])
    if m0 != m1:
        raise ValueError(f"interpolate needs two memories of the same size: text0 compresses to {m0} slots and "
                         f"text1 to {m1} ({comp.cfg.method} sizes memory by length): pick texts of equal length")
    n_new = max_new_tokens or max(len(ids0), len(ids1)) + 8
    regen = lambda z: comp.generate(z, "ae", max_new_tokens=n_new)[0]
    rows = [{"w": w, "ids": ids, "text": tok.decode(ids)} for w in weights for ids in [regen(z0.lerp(z1, w))]]
    ends = {name: {"ids": ids, "text": tok.decode(ids)} for name, ids in (("z0", regen(z0)), ("z1", regen(z1)))}
    return {"text0": text0, "text1": text1, "memory_slots": m0, "rows": rows, **ends}


def report_interpolate(result):
    rows = [["Z0", result["z0"]["text"]]] + [[f"w={r['w']:g}", r["text"]] for r in result["rows"]] + \
           [["Z1", result["z1"]["text"]]]
    return markdown_table(["memory", "regeneration"], [[a, repr(b)] for a, b in rows])


# -----------------------------------------------------------------------------
# ---- heatmap (PIC Figures 3 and 7, EPL Figure 6) ----


def memory_cosine(comp, memory, ids):
    """Cosine similarity [M, T] between each memory slot and each context token, in the space the decoder reads them.
      embeds carrier: the memory vector (after the bridge) vs the decoder's input embedding of the token (PIC Figure
          3: do the memory vectors look like the tokens they stand for?);
      kv carrier: the memory's last-layer keys vs the keys the frozen decoder computes for the plain context in its
          last layer (heads concatenated): the cache entries the memory replaces. Keys carry RoPE at their own
          positions, so this cosine mixes content with relative position."""
    dev = comp.decoder.model.embed_tokens.weight.device
    ids = torch.tensor([ids], device=dev)
    if comp.cfg.carrier == "embeds":
        mem = memory.embeds[0]                                          # (M, d)
        ctx = comp.decoder.model.embed_tokens(ids)[0]                   # (T, d)
    else:
        with comp.decoding():
            kv = comp.decoder(ids, return_kv=True, compute_logits=False).kv
        mem = memory.kv[-1][0][0].transpose(0, 1).flatten(1)            # (Hkv, M, D) -> (M, Hkv*D)
        ctx = kv[-1][0][0].transpose(0, 1).flatten(1)                   # (Hkv, T, D) -> (T, Hkv*D)
    mem, ctx = F.normalize(mem.float(), dim=-1), F.normalize(ctx.float(), dim=-1)
    return mem @ ctx.T                                                  # (M, T)


def encoder_attention(comp, enc_ids):
    """(memory, attention [M, T]): how much each memory slot attends to each context token in the encoder, averaged
    over all layers and heads (PIC Figure 7; EPL Figure 6). Each layer's weights are recomputed (Attention.weights)
    from its own inputs, captured with a forward pre-hook on its self_attn during a normal comp.compress, under the
    encoder's mask (causal, PIC or segment). A memory row does not sum to 1 over the context: the rest of its weight
    goes to the memory tokens before it (and to itself). Memory of chunk c sees only chunk c, so the matrix is
    block-diagonal over chunks. Group merging (GMSA) has no memory tokens, hence no such attention: returns (memory,
    None)."""
    calls = []
    hook = lambda attn, args: calls.append((attn, *args[:4]))         # (module, x, cos, sin, mask)
    handles = [layer.self_attn.register_forward_pre_hook(hook) for layer in comp.encoder.model.layers]
    try:
        memory = compress(comp, [enc_ids])
    finally:
        for h in handles:
            h.remove()
    if comp.cfg.source == "group_mean":
        return memory, None
    # the probabilities SDPA applied in each layer, averaged over heads, then over layers
    probs = sum(attn.weights(x, cos, sin, mask).mean(1) for attn, x, cos, sin, mask in calls) / len(calls)  # (R, T, T)
    # one encoder row per chunk, laid out [chunk (n), memory (m), padding]: gather memory -> context
    lens, counts = memory.chunk_lens[0], memory.slots[0]
    out = torch.zeros(sum(counts), sum(lens))
    row0 = col0 = 0
    for r, (n, m) in enumerate(zip(lens, counts)):
        out[row0:row0 + m, col0:col0 + n] = probs[r, n:n + m, :n].cpu()
        row0, col0 = row0 + m, col0 + n
    return memory, out[:, 1:] if comp.cfg.bos else out   # the columns of the text itself, not a leading [BOS]


@torch.no_grad()
def run_heatmap(comp, text, png_stem):
    """Cosine map and encoder attention map for one text; PNGs at png_stem + _cosine.png / _attention.png."""
    ids = comp.tok.encode(text)
    enc = comp.encoder_ids(ids)
    memory, attention = encoder_attention(comp, enc)
    cosine = memory_cosine(comp, memory, ids).float().cpu()   # to the host for numpy and the PNGs
    name, axes = comp.cfg.method, ("context token", "memory slot")
    out = {"text": text, "tokens": ids, "encoder_tokens": enc, "memory_slots": cosine.shape[0],
           "cosine": cosine.tolist(), "attention": None, "attention_png": None,
           "cosine_png": heat_png(f"{png_stem}_cosine.png", cosine.numpy(), f"{name}: cosine(memory slot, context "
                                  "token)", *axes)}
    if attention is None:
        out["attention_note"] = f"{name} merges hidden states into groups: no memory tokens attend"
    else:
        attention = attention.float().cpu()
        out["attention"] = attention.tolist()
        out["attention_png"] = heat_png(f"{png_stem}_attention.png", attention.numpy(), f"{name}: encoder "
                                        "attention, memory -> context", *axes)
    return out


def report_heatmap(result):
    parts = [f"cosine(memory slot, context token): {result['cosine_png']}", render_text(result["cosine"])]
    if result["attention"] is not None:
        parts += [f"encoder attention memory -> context: {result['attention_png']}", render_text(result["attention"])]
    else:
        parts.append(f"attention: {result['attention_note']}")
    return "\n".join(parts)


# -----------------------------------------------------------------------------
# ---- needle (passkey retrieval, Mohtashami & Jaggi 2023) ----
# "Landmark Attention" (Mohtashami & Jaggi 2023, arXiv:2305.16300) tests long contexts by passkey retrieval: one
# sentence with a random number is hidden in a long text, and the model is asked for the number. Their haystack
# repeats a filler ("The grass is green. The sky is blue. ..."); ours is held-out text (--data, default the
# built-in held-out texts), its documents in an order drawn from --seed, drawn again whenever they run out. The
# haystack takes whole sentences up to the length, and the needle goes in at the sentence boundary nearest the
# requested depth, so neither the needle nor a sentence is ever cut (a compressor's fixed chunks may still split
# it between two memories: that is part of what is measured). Where it landed is measured, not assumed:
# the needle's tokens are located in the context's token ids. The long-context papers draw the result as a depth
# x length grid (Kamradt's "needle in a haystack" figure); we print one grid per row (compressed, full, none).
# The question goes through run_qa, so the three rows read the preset's QA template (Compressor.qa_parts).

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."   # their prompt's information line
NEEDLE_QUESTION = "What is the pass key?"   # theirs, without the primer "The pass key is": the template asks
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)        # where the needle goes: the fraction of the haystack before it
NEEDLE_LENGTHS = (256, 512, 1024, 2048, 4096)   # default --lengths: those that fit the model's positions
NEEDLE_N = 5                                # default samples per (depth, length) cell
NEEDLE_BUDGET = 16                          # new tokens: "The pass key is 71432." is 10 of SmolLM2's
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")   # a haystack is cut only after . ! or ? and a space


def haystack(tok, documents, length, depth, key, rng):
    """One needle sample: at most `length` tokens of whole sentences from `documents` (lists of sentences, taken in an
    order drawn from rng), the needle of `key` at the sentence boundary nearest `depth`. Returns the context, its
    length in tokens, the token index at which the needle starts, and the depth it landed at."""
    needle = NEEDLE.format(key=key)
    room = length - len(tok.encode(" " + needle))
    if room < 0:
        raise ValueError(f"--lengths {length} is shorter than the needle ({length - room} tokens)")

    def sentences():   # the documents' sentences, the documents in a drawn order, drawn again when they run out
        while True:
            for doc in rng.sample(documents, len(documents)):
                yield from doc
    hay, sizes = [], []   # the haystack's sentences and their tokens (each with the space before it)
    for s in sentences():
        size = len(tok.encode(" " + s))
        if sum(sizes) + size > room:
            if not hay:
                raise ValueError(f"--lengths {length} leaves {room} tokens beside the needle, too few for a sentence "
                                 f"of the haystack ({size} tokens): use a longer length")
            break
        hay.append(s)
        sizes.append(size)
    while True:
        # the boundary before sentence i sits after sum(sizes[:i]) tokens: take the one nearest the depth
        offsets = np.cumsum([0] + sizes)
        i = int(np.argmin(np.abs(offsets - depth * offsets[-1])))
        context = " ".join(hay[:i] + [needle] + hay[i:])
        ids = tok.encode(context)
        if len(ids) <= length:   # the sum of the sizes can be off by a token where a BPE merge differs: check
            break
        hay, sizes = hay[:-1], sizes[:-1]
    part = tok.encode(needle if i == 0 else " " + needle)   # the needle's tokens as they sit in the context
    at = next((t for t in range(len(ids) - len(part) + 1) if ids[t:t + len(part)] == part), -1)   # where it starts
    if at < 0:
        raise ValueError("the needle's tokens are not in the context's: the tokenizer merges them with a neighbour")
    return dict(context=context, context_tokens=len(ids), needle_at=at, landed_depth=at / (len(ids) - len(part)))


def needle_examples(tok, texts, lengths, n, seed):
    """n samples per (length, depth), length by length (so a batch holds contexts of one length), each with its own
    passkey (5 digits) and haystack order, all drawn from one generator seeded by `seed`: deterministic."""
    documents = [d for d in ([s for s in SENTENCE_END.split(t.strip()) if s] for t in texts) if d]
    if not documents:
        raise ValueError("the needle task has no texts to build haystacks from (--data)")
    rng, out = random.Random(seed), []
    for length in lengths:
        for depth in DEPTHS:
            for _ in range(n):
                key = str(rng.randint(10000, 99999))
                out.append(dict(question=NEEDLE_QUESTION, answer=key, length=length, depth=depth,
                                **haystack(tok, documents, length, depth, key, rng)))
    return out


def needle_grid(rows, lengths):
    """mode -> [depth][length] fraction of the samples that gave their passkey."""
    cell = lambda mode, d, L: statistics.mean(r[mode]["scores"]["passkey"] for r in rows
                                              if r["depth"] == d and r["length"] == L)
    return {mode: [[cell(mode, d, L) for L in lengths] for d in DEPTHS] for mode in MODES}


@torch.no_grad()
def run_needle(comp, examples, lengths=None, n=None, seed=0, max_new_tokens=None, batch_size=8, group_size=None,
               png=None):
    """Passkey retrieval at each depth x length, scored in the three rows of run_qa (without its losses, which need a
    reference answer shared by the rows). Lengths count the context's tokens, needle included; the plain LLM's prompt
    adds the template, the question and the answer, and must fit the model's positions."""
    n_new = max_new_tokens or NEEDLE_BUDGET
    parts = comp.qa_parts("", NEEDLE_QUESTION)   # the template around an empty context
    extra = 1 + len(parts["prefix"]) + len(parts["dec_context"]) + len(parts["prompt"]) + n_new   # + BOS, answer
    max_pos = comp.decoder.config.max_position_embeddings
    lengths = lengths or [L for L in NEEDLE_LENGTHS if L + extra <= max_pos] or [max_pos - extra]
    if max(lengths) + extra > max_pos:
        raise ValueError(f"--lengths {max(lengths)} is beyond the model's {max_pos} positions (with the template, "
                         f"question and answer, {extra} tokens): use lengths up to {max_pos - extra}")
    samples = needle_examples(comp.tok, [ex["text"] for ex in examples], lengths, n or NEEDLE_N, seed)
    result = run_qa(comp, samples, n_new, batch_size, group_size, reuse=False, score=passkey_score, losses=False)
    for row, sample in zip(result["examples"], samples):   # run_qa keeps the order: add where each needle landed
        row.update((k, sample[k]) for k in ("length", "depth", "context_tokens", "needle_at", "landed_depth"))
    result.update(seed=seed, n=n or NEEDLE_N, depths=list(DEPTHS), lengths=lengths,
                  grid=needle_grid(result["examples"], lengths))
    result["png"] = needle_png(png, result, comp.cfg.method) if png else None
    return result


def report_needle(result):
    header = ["depth \\ length"] + [str(L) for L in result["lengths"]]
    tables = [f"{mode}: fraction of the {result['n']} samples per cell that gave the passkey\n\n" + markdown_table(
        header, [[f"{d:.0%}"] + row for d, row in zip(result["depths"], result["grid"][mode])]) for mode in MODES]
    return "\n\n".join(tables) + (f"\n\nfigure: {result['png']}" if result["png"] else "")


# -----------------------------------------------------------------------------
# ---- command line ----

TASKS_NOTES = """\
ae, lm, qa and needle also score the plain LLM with the whole context in its prompt ("full": upper bound) and with
none ("none": lower bound). Needle: the key is hidden at the sentence boundary nearest each depth (0-100%) and asked
for with the QA template; it scores when the key is among the numbers generated.

ae, lm and qa also report, teacher-forced, the loss of their target (qa: the reference answer) with each text's own
memory, with another text's (text i reads text i+1's; qa: the next document's) and with none: own/other well below
1 means each memory carries its own text, 1.0 a constant prompt. ae and lm score the texts of at least the run's
--min-len tokens (a head crop's n: shorter ones are left out, not padded), each cut to the trained length; one
pretrained with AE + LM (EPL) reconstructs the first half of each text, what pretraining compressed.

Results go to --out (default: CKPT/eval_TASK.json), a markdown table to stdout. Without --data the built-in sets;
--data: .jsonl or .parquet with {"text"} or {"context", "question", "answer"} records, or one text per line.
Time to first token and KV-cache size (CompLLM): tests/bench_speed.py."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SystemExit(f"error: {message}")   # one line, no usage dump, no traceback


def parse_args(argv=None):
    tasks = "\n".join(f"  {name:<12} {task.help}" for name, task in TASKS.items())
    p = _Parser(prog="evaluate.py", description="Evaluate a context compressor.",
                epilog=f"tasks:\n{tasks}\n\n{TASKS_NOTES}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="checkpoint directory written by train.py --out")
    p.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)} (see below)")
    p.add_argument("--method", help=f"one of {', '.join(presets.METHODS)}: it must match the checkpoint's")
    p.add_argument("--model", help="base LLM (HF id, directory or tiny): it must match the checkpoint's")
    p.add_argument("--data", help="examples (.jsonl, .parquet or .txt); default: the built-in sets")
    p.add_argument("--n", type=int, help=f"use the first N examples (default: all; ae, lm: the first N of at least "
                   f"the run's --min-len tokens, see --min-len); needle: samples per depth and length (default "
                   f"{NEEDLE_N})")
    p.add_argument("--batch-size", type=int, default=8, help="ae, lm, qa, needle: examples per batch (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="generation budget (default: ae n for a head-cropped "
                   "checkpoint, else reference + 8; qa the paper's: PCC 30, CompLLM 512, EPL 1024, else 64; "
                   f"needle {NEEDLE_BUDGET})")
    p.add_argument("--max-len", type=int, help="ae, lm, interpolate: cut texts to their first N tokens (default: "
                   "the checkpoint's --max-len, as its held-out check cuts them); qa: cut each context to its first N "
                   "tokens (default: whole contexts)")
    p.add_argument("--min-len", type=int, help="ae, lm: score only texts of at least N tokens (default: the "
                   "checkpoint's --min-len, so a run is scored at the compression it trained at)")
    p.add_argument("--ratio", type=int, help="group merging (GMSA): the compression ratio r (group size) to evaluate "
                   "at, one of train.py's --ratios (default: the preset's first, 4)")
    p.add_argument("--concat", type=int, default=1, help="qa: join the contexts of K examples into one long "
                   "context and ask each question against it (CompLLM §4); default 1")
    p.add_argument("--no-reuse", action="store_true", help="qa: compress every context anew (default: a chunk's "
                   "memory is kept and reused, CompLLM's reusability)")
    p.add_argument("--no-baselines", action="store_true", help="ae, qa: regenerate from the memory only, not with "
                   "the plain LLM (full, none: they depend on the base model and the texts, not on the checkpoint; "
                   "for scoring many checkpoints of one run)")
    p.add_argument("--lengths", help="needle: context lengths in tokens, comma-separated (default: those of "
                   f"{','.join(map(str, NEEDLE_LENGTHS))} the model's positions allow)")
    p.add_argument("--seed", type=int, default=0, help="needle: seeds the passkeys and the haystacks (default 0)")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS, help=f"interpolate: values of w (default {DEFAULT_WEIGHTS})")
    p.add_argument("--text0", help=f"interpolate: first prompt (default {DEFAULT_TEXT0!r}); heatmap: the text")
    p.add_argument("--text1", help=f"interpolate: second prompt (default {DEFAULT_TEXT1!r})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default cuda if any")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", help="JSON results file (default CKPT/eval_TASK.json)")
    args = p.parse_args(argv)
    if args.task not in TASKS:
        raise SystemExit(f"error: unknown task '{args.task}': choose one of {', '.join(TASKS)}")
    if args.ckpt is None:   # an untrained preset is timed by tests/bench_speed.py, never scored
        raise SystemExit(f"error: --task {args.task} needs --ckpt DIR (an untrained preset's speed: "
                         "tests/bench_speed.py --method M)")
    for name in ("n", "max_new_tokens", "batch_size", "max_len", "min_len", "ratio", "concat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no CUDA device is available: use --device cpu")
    args.dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
    return args


def load_compressor(args):
    """The checkpoint's compressor (args: ckpt, model, method, device, dtype); one-line errors. Also
    tests/bench_speed.py's."""
    dtype = DTYPES[args.dtype]
    cfg = asdict(checkpoint.saved_config(args.ckpt))   # one-line errors for a missing or malformed compressor.json
    if args.model is not None and args.model != cfg["model"]:
        raise ValueError(f"checkpoint '{args.ckpt}' was trained on model '{cfg['model']}', not '{args.model}'")
    if args.method is not None and args.method != cfg["method"]:
        raise ValueError(f"checkpoint '{args.ckpt}' holds method '{cfg['method']}', not '{args.method}'")
    try:
        comp = checkpoint.load(args.ckpt, dtype=dtype, device=args.device)
    except (ValueError, TypeError) as e:   # TypeError: a config field this code does not know
        raise ValueError(f"cannot load checkpoint '{args.ckpt}' on its base model '{cfg['model']}': {e}") from None
    return comp.eval()


class Task(NamedTuple):
    """One evaluation task: what it does (--help), what it reads, how it runs from the command line's arguments,
    how stdout shows it."""
    help: str           # one line of --help: what the task does, reads and writes
    examples: bool      # reads held-out examples (--data, --n)
    run: object         # (args, comp, examples, proto, out) -> result dict
    report: object      # result -> markdown


TASKS = {   # a: the parsed arguments, ex: the examples, out: the results' path without .json
    "ae": Task("regenerate each text from its memory: bleu4_ids, bleu4_words, prefix_em, token_accuracy, rouge1/2/L",
               True, lambda a, comp, ex, proto, out: run_ae(comp, ex, a.max_new_tokens, proto, a.batch_size, a.ratio,
                                                            modes=a.modes),
               report_text),
    "lm": Task("the perplexity of each text's second half (cut at len/2, EPL) given the memory of its first half",
               True, lambda a, comp, ex, proto, out: run_lm(comp, ex, a.batch_size, a.ratio, proto["n"]), report_text),
    "qa": Task("answer from memory + question (5 built-in): squad_f1/em, exact_match, token_f1, substring_acc, rouge1",
               True, lambda a, comp, ex, proto, out: run_qa(comp, ex, a.max_new_tokens, a.batch_size, a.ratio,
                                                            a.concat, not a.no_reuse, a.max_len, modes=a.modes),
               report_text),
    "needle": Task("passkey retrieval: a 5-digit key in --data haystacks, a depth x --lengths grid, its PNG by --out",
                   True, lambda a, comp, ex, proto, out: run_needle(comp, ex, a.lengths, a.n, a.seed, a.max_new_tokens,
                                                                    a.batch_size, a.ratio, png=out + ".png"),
                   report_needle),
    "interpolate": Task("AOC Eq. 5: regenerate from Z0 + w (Z1 - Z0) per --weights w, Z0/Z1 the memories of --text0/1",
                        False, lambda a, comp, ex, proto, out: run_interpolate(
                            comp, a.text0 or DEFAULT_TEXT0, a.text1 or DEFAULT_TEXT1, a.weights, a.max_new_tokens,
                            proto), report_interpolate),
    "heatmap": Task("slot-token cosine, memory -> context attention (not gmsa) of --text0 or the first text; PNGs",
                    True, lambda a, comp, ex, proto, out: run_heatmap(comp, a.text0 or ex[0]["text"], out),
                    report_heatmap),
}


def numbers(text, kind, name):
    """--lengths / --weights: comma-separated numbers."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated numbers, got {text!r}") from None


def shown_path(path, cwd=None):
    """A path as a record prints it: relative to where the command ran when it lies below it (a results.md or
    eval_*.md is read on other machines, where /home/... of this one means nothing), else as given."""
    rel = os.path.relpath(os.path.abspath(path), cwd or os.getcwd())
    return path if rel.startswith("..") else rel


def main(argv=None):
    """Run one task; returns the result dict (also written as JSON). Bad input -> SystemExit('error: ...')."""
    args = parse_args(argv)
    torch.manual_seed(0)   # anything random repeats run to run
    out = args.out or os.path.join(args.ckpt, f"eval_{args.task}.json")
    try:
        args.lengths = args.lengths and numbers(args.lengths, int, "lengths")
        args.weights = numbers(args.weights, float, "weights")
        if args.lengths and min(args.lengths) < 1:
            raise ValueError(f"--lengths must be positive, got {args.lengths}")
        task = TASKS[args.task]
        if args.no_baselines and args.task not in ("ae", "qa"):
            raise ValueError(f"--no-baselines applies to ae and qa (the tasks that regenerate), not {args.task}: "
                             "leave it out")
        args.modes = ("compressed",) if args.no_baselines else MODES
        n = None if args.task == "needle" else args.n   # needle: --n counts samples per cell, not texts
        text_task = args.task in ("ae", "lm")   # scored at the trained length (at_trained_length)
        examples = load_examples(args.data, args.task, None if text_task else n) if task.examples and (
            args.task != "heatmap" or args.text0 is None) else None
        comp = load_compressor(args)
        proto = trained_protocol(args.ckpt, args.max_len, args.min_len)
        if text_task:
            examples = at_trained_length(comp, examples, proto, n)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)   # before the task: figures go next to it
        result = task.run(args, comp, examples, proto, os.path.splitext(out)[0])
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    # the training step of the weights scored, as their checkpoint's compressor.json says (train.py writes it with each
    # checkpoint; None for a compressor saved outside a run): recipes/verdict.py refuses a score of an earlier step
    step = checkpoint.read_checkpoint_config(args.ckpt).get("step")
    result = {"task": args.task, "checkpoint": args.ckpt, "step": step, "config": asdict(comp.cfg), "ratio": args.ratio,
              "device": args.device, "accelerator": accelerator(args.device), "dtype": args.dtype, **result}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(task.report(result))
    print(f"\nwrote {shown_path(out)}")
    return result


if __name__ == "__main__":
    main()
