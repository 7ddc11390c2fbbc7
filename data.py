"""
The data of a training run: the readers (plain text, JSON lines, Parquet, a hub file), the built-in corpus and its
held-out texts, tokenisation with an on-disk cache, sampling a step's examples, collating a micro-batch, and the
teacher's answers of CompLLM's distillation. train.py draws every step's batch from here; evaluate.py reads its built-in examples
and its .jsonl / .parquet records here.

A step's examples depend on nothing but (seed, step, example index) (step_examples): that makes resume exact and a
step the same whatever the micro-batching or the number of processes. Context ids are the compressor's tokenizer's,
everything else the decoder's.
"""

import hashlib
import json
import os
import random
from dataclasses import dataclass
from glob import glob

import numpy as np
import torch
from tqdm import tqdm



@dataclass(frozen=True)
class Sampling:
    """How a step's examples are drawn: train.py's flags of the same names."""
    objective: str                        # pretrain | ae | qa | distill
    crop: str                             # window (a random window of a document) | head (its first max_len tokens)
    min_len: int                          # shortest text |X|
    max_len: int                          # longest text |X|; also cuts QA contexts
    batch_size: int                       # examples per step
    seed: int
    len_curriculum: tuple | None = None   # (N, K): ours, texts grow from N tokens over the first K steps


# ---- reading ----


def read_corpus(path):
    """Documents from --data -> (texts, qa triples, identity string for the cache key).
    texts: list of str; qa: list of (context, question, answer) str triples."""
    if path is None:
        texts, qa = generated_texts(BUILTIN_GENERATED, seed=0) + list(BUILTIN_TEXTS), list(BUILTIN_QA)
        return texts, qa, "builtin:" + hashlib.sha256(json.dumps([texts, qa]).encode()).hexdigest()
    if path.startswith("hf://datasets/"):
        path = hub_file(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"data path '{path}' does not exist")
    files = [path] if os.path.isfile(path) else sorted(
        f for ext in ("txt", "jsonl", "parquet") for f in glob(os.path.join(path, "**", f"*.{ext}"), recursive=True))
    texts, qa = [], []
    for f in files:
        if f.endswith((".jsonl", ".parquet")):   # a line that is no JSON, a malformed record: a ValueError naming it
            for where, rec in records(f):
                kind = record_kind(rec)
                if kind is None:
                    raise ValueError(f'{f} {where}: expected {{"text"}} or {{"context", "question", "answer"}}')
                if kind == "text":
                    texts.append(rec["text"])
                    continue
                try:
                    r = qa_record(rec, f"{f} {where}")
                except Unanswerable:   # its context is a text all the same (ae, pretrain read it)
                    texts.append(rec["context"])
                    continue
                qa.append((r["context"], r["question"], first_answer(r["answer"])))
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())   # a whole file is one document: windows never straddle two files
    texts = [t for t in texts if t.strip()]
    if not texts and not qa:
        raise ValueError(f"no text in '{path}' (empty files, or a folder without .txt / .jsonl / .parquet files)")
    identity = json.dumps([(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files])
    return texts, qa, identity


def records(path):
    """(where, record) for every row of a .jsonl or .parquet file; a bad line is a ValueError naming it."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        for i, rec in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"row {i}", rec
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"line {i}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not JSON ({e.msg})") from None


def record_kind(rec):
    """"text", "qa" or None (not a record train.py reads)."""
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return "text"
    if isinstance(rec, dict) and {"context", "question", "answer"} <= rec.keys():
        return "qa"
    if isinstance(rec, dict) and {"context", "question", "answers"} <= rec.keys():   # SQuAD on the hub
        rec["answer"] = rec["answers"]
        return "qa"
    return None


def qa_record(rec, where):
    """A {"context", "question", "answer"} record (record_kind "qa"), checked and normalised for QA training and
    evaluation alike: context a non-empty str, question a str; answer a str or a number (its text), a list of those
    (accepted answers), SQuAD's {"text": [...]} or a list of {"text": ...} dicts -> a str, or a list of str where the
    record gave a list. Anything else is a ValueError naming `where` (file and line)."""
    context, question, raw = rec.get("context"), rec.get("question"), rec.get("answer")
    if not isinstance(context, str) or not context.strip():
        raise ValueError(f'{where}: "context" must be a non-empty string, got {str(context)[:40]!r}')
    if not isinstance(question, str):
        raise ValueError(f'{where}: "question" must be a string, got {str(question)[:40]!r}')
    items = raw.get("text") if isinstance(raw, dict) else raw   # SQuAD {"text": [...], "answer_start": [...]}
    items = list(items) if isinstance(items, (list, tuple)) else [items]
    answers = []
    for a in items:
        a = a.get("text") if isinstance(a, dict) else a      # [{"text": ..., "answer_start": ...}]
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = str(a)                                       # {"answer": 1932}: the number as written
        if not isinstance(a, str):
            raise ValueError(f'{where}: "answer" must be a string, a number or a list of them, got {str(raw)[:40]!r}')
        answers.append(a)
    if not answers:   # SQuAD 2.0's unanswerable questions: "answers": {"text": [], "answer_start": []}
        raise Unanswerable(f'{where}: "answer" is an empty list (an unanswerable question)')
    return {**rec, "answer": answers if isinstance(raw, (list, tuple, dict)) else answers[0]}


class Unanswerable(ValueError):
    """A QA record with no answer (SQuAD 2.0 has them): no QA example, though its context is still text."""


def first_answer(answer):
    """A str, a list of str, or SQuAD's {"text": [...], "answer_start": [...]}: the first answer, as QA training
    uses answers[0] (EPL code)."""
    if isinstance(answer, dict):
        answer = answer.get("text", [""])
    return str(answer[0] if isinstance(answer, (list, tuple)) and answer else answer)


def hub_file(url):
    """hf://datasets/OWNER/NAME/PATH -> a local copy (downloaded once into the Hugging Face cache)."""
    parts = url[len("hf://datasets/"):].split("/", 2)
    if len(parts) < 3:
        raise ValueError(f"'{url}' is not hf://datasets/OWNER/NAME/PATH")
    from huggingface_hub import hf_hub_download
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return hf_hub_download("/".join(parts[:2]), parts[2], repo_type="dataset", local_files_only=offline)
    except Exception as e:   # offline, no network, no such repo or file: all one line
        raise OSError(f"cannot fetch {url}: {type(e).__name__} (offline or not on the hub; pass a local path "
                      "instead)") from None


def tokenize_corpus(texts, qa, identity, comp, cache_dir, with_qa=True):
    """Tokenise every document once and cache the ids, keyed by the data, the tokenizers and the QA template.
    Texts become one flat tensor of decoder ids plus offsets (document d is tokens[offsets[d]:offsets[d + 1]]);
    QA triples become the template's pieces (Compressor.qa_parts): prefix, the context for the decoder and for
    the compressor, the prompt after it, and the answer. with_qa=False (ae, pretrain: they read texts only): no
    pieces, in a cache file of its own; the key, which a checkpoint keeps, is the data's either way."""
    tok, enc_tok = comp.tok, comp.enc_tok
    vocab = tok.tk.to_str() + ("" if enc_tok is tok else enc_tok.tk.to_str())
    key = hashlib.sha256((identity + vocab + json.dumps(comp.template())).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokens-{key}{'' if with_qa else '-texts'}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True), key
    as_ids = lambda s, t=tok: torch.tensor(t.encode(s), dtype=torch.int32)
    docs = [d for d in map(as_ids, tqdm(texts, desc="tokenizing", disable=len(texts) < 1000)) if len(d) >= 2]
    offsets = torch.tensor([0] + [len(d) for d in docs], dtype=torch.int64).cumsum(0)   # (n_docs + 1,)
    pieces = [{**{k: torch.tensor(v, dtype=torch.int32) for k, v in comp.qa_parts(c, q).items()},
               "answer": as_ids(a)} for c, q, a in (qa if with_qa else [])]
    tensors = {"tokens": torch.cat(docs) if docs else torch.zeros(0, dtype=torch.int32), "offsets": offsets,
               "qa": pieces}
    os.makedirs(cache_dir, exist_ok=True)
    # atomic: a killed run never leaves half a cache behind (one temp file per process: DDP ranks all write)
    torch.save(tensors, f"{path}.{os.getpid()}.tmp")
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    return tensors, key


@dataclass
class Corpus:
    """What a run trains on: the corpus tokenised (tokenize_corpus), and the teacher's answers so far (distill)."""
    tensors: dict       # tokenize_corpus's: "tokens" (every text's ids, flat), "offsets", "qa" (the QA pieces)
    key: str            # its cache key (saved with each checkpoint)
    documents: int      # texts read
    questions: int      # QA examples read
    answers: dict       # distill: the frozen LLM's answers, memoised (saved with each checkpoint)
    answers_path: str


def load_corpus(path, sampling: Sampling, comp, cache_dir: str, answer_tokens: int) -> Corpus:
    """The corpus, checked against the objective, tokenised once and cached. A path, a file or a record that cannot
    serve: OSError or ValueError, its message one line (train.py prints it)."""
    texts, qa, identity = read_corpus(path)
    if sampling.objective in ("qa", "distill") and not qa:
        raise ValueError(f"--objective {sampling.objective} needs JSON lines with \"context\", \"question\", "
                         "\"answer\"")
    if sampling.objective in ("pretrain", "ae"):
        texts += [c for c, _, _ in qa]   # QA contexts are text too (ours)
        if sampling.crop == "head" and len(texts) < sampling.batch_size:
            # a head crop is the first n tokens of a document: with fewer documents than a batch, every step would
            # train on the same few texts (a .txt file is one document)
            raise ValueError(f"--crop head trains on the first {sampling.max_len} tokens of each document, and "
                             f"{path or 'the built-in corpus'} holds {len(texts)} document(s) for a batch of "
                             f"{sampling.batch_size}: give a .jsonl with one document per line, a folder of files, "
                             "or use --crop window")
    if sampling.objective == "distill" and comp.enc_tok is not comp.tok:
        raise ValueError("distill runs the teacher and the student on the same ids: it needs one tokenizer for both "
                         "models")
    tensors, key = tokenize_corpus(texts, qa, identity, comp, cache_dir,
                                   with_qa=sampling.objective in ("qa", "distill"))
    # (documents of < 2 tokens are dropped)
    if sampling.objective in ("pretrain", "ae") and len(tensors["tokens"]) == 0:
        raise ValueError(f"no text of 2 tokens or more in {path}")
    answers_path = os.path.join(cache_dir, f"answers-{key}-{answer_tokens}.pt")
    answers = torch.load(answers_path, weights_only=True) if os.path.exists(answers_path) else {}
    return Corpus(tensors, key, len(texts), len(qa), answers, answers_path)


# ---- sampling a step ----


def sample_example(tensors, sampling: Sampling, rng, comp, step):
    """One training example of step `step`, drawn with `rng`. Context ids are the compressor's, everything else
    the decoder's."""
    ex = draw_qa(tensors, sampling, rng, comp) if sampling.objective in ("qa", "distill") else \
        draw_text(tensors, sampling, rng, comp, step)
    # GMSA §4.1: the compression ratio is sampled per example; drawn with the example, so that it too depends on
    # nothing but the step and the example's index
    ex["ratio"] = [comp.cfg.ratios[rng.integers(len(comp.cfg.ratios))]] if comp.cfg.source == "group_mean" else []
    return ex


def draw_qa(tensors, sampling: Sampling, rng, comp):
    ex = {k: v.tolist() for k, v in tensors["qa"][rng.integers(len(tensors["qa"]))].items()}
    # contexts cut at --max-len (ours): the context's own tokens, the template's text around it kept
    ctx, enc_ctx = (comp.cut_context(ex[k], sampling.max_len, t) for k, t in (("dec_context", comp.tok),
                                                                               ("enc_context", comp.enc_tok)))
    if sampling.objective == "distill":   # the answer is the teacher's own (teacher_answer), not the data set's
        return dict(context=enc_ctx, dec_context=ctx, prefix=ex["prefix"], question=ex["prompt"])
    # [prefix; memory; [LM]; prompt] -> answer: the loss covers answer + EOS only (EPL code)
    return dict(context=enc_ctx, prefix=ex["prefix"], qa=ex["prompt"] + ex["answer"] + [comp.tok.eos_id],
                n_answer=len(ex["answer"]) + 1)


def text_lengths(sampling: Sampling, step):
    """The range [lo, hi + 1) a text's length is drawn from at `step`: --min-len..--max-len, or, under
    --len-curriculum N K (ours), a range that starts at N tokens and grows linearly to it over the first K steps."""
    if not sampling.len_curriculum:
        return sampling.min_len, sampling.max_len + 1
    start, k = sampling.len_curriculum
    f = min(1.0, step / k)
    return round(start + (sampling.min_len - start) * f), round(start + (sampling.max_len - start) * f) + 1


def draw_text(tensors, sampling: Sampling, rng, comp, step):
    eos, offsets = comp.tok.eos_id, tensors["offsets"]
    if sampling.crop == "head":
        # AOC code: each text is the first n tokens of a document (tokenizer truncation), a shorter one right-padded
        # with EOS to n; the padding is compressed and reconstructed like any token (no mask, no -100)
        d = int(rng.integers(len(offsets) - 1))
        n = sampling.max_len
        x = tensors["tokens"][offsets[d]:min(offsets[d] + n, offsets[d + 1])].tolist()
        x = x + [comp.tok.pad_id if comp.tok.pad_id is not None else eos] * (n - len(x))
    else:
        # the document of a random token (so each with probability proportional to its length), then a window
        # of |X| tokens at a random offset inside it: a text never straddles two documents
        d = int(torch.searchsorted(offsets, int(rng.integers(offsets[-1])), right=True)) - 1
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        n = min(int(rng.integers(*text_lengths(sampling, step))), hi - lo)   # a short document gives a short text
        start = lo + int(rng.integers(0, hi - lo - n + 1))
        x = tensors["tokens"][start:start + n].tolist()
    # the compressor reads the text in its own ids: the decoder's when both models read one tokenizer, else the text
    # re-encoded (Compressor.encoder_ids); AE regenerates it in the decoder's ids, after [BOS] where the context starts
    # with one, then EOS (Compressor.ae_target)
    enc = (lambda ids: ids) if comp.enc_tok is comp.tok else (lambda ids: comp.enc_tok.encode(comp.tok.decode(ids)))
    if sampling.objective == "ae":   # ICAE AE / AOC Eq. (4): regenerate all of X, then EOS
        return dict(context=enc(x), ae=comp.target_bos + x + [eos])
    # pretrain (EPL code): compress the first p = ⌊|X|/2⌋ tokens, reconstruct them, continue with the rest + EOS
    p = max(1, n // 2)
    return dict(context=enc(x[:p]), ae=comp.target_bos + x[:p] + [eos], lm=x[p:] + [eos], last=x[p - 1])


def step_examples(tensors, sampling: Sampling, comp, step):
    """Every example of step `step`: example i comes from a generator seeded with (seed, step, i), so a step
    depends on nothing but its number (exact resume) and is made of the same examples whatever the
    micro-batching or the number of processes (each process draws them all and takes its share)."""
    return [sample_example(tensors, sampling, np.random.default_rng([sampling.seed, step, i]), comp, step)
            for i in range(sampling.batch_size)]


@dataclass
class Batch:
    """A micro-batch: one list per field, one entry per example; each objective fills its own fields, the others
    stay None (the losses in train.py read them by name):

        ae        context, ae                    regenerate the text after its memory (ICAE AE, AOC Eq. 4)
        pretrain  context, ae, lm, last          ... and continue it after the memory (EPL §3.1.1, PIC Eq. 6-8)
        qa        context, prefix, qa, n_answer  [prefix; memory; [LM]; prompt] -> answer (EPL, PCC, GMSA KEFT)
        distill   context, prefix, dec_context, question, answer     CompLLM Eq. 1-3, the answer the teacher's
    """
    context: list                   # the ids each example compresses (the compressor's tokenizer)
    tokens: int                     # tokens the step reads: the contexts + every decoder sequence (the log's tok/s)
    ratios: list | None = None      # GMSA §4.1: one compression ratio per example, drawn with it
    ae: list | None = None          # the AE target: the compressed text (and EOS), Compressor.ae_target
    lm: list | None = None          # pretrain: the text's continuation x_p+1.. and EOS
    last: list | None = None        # pretrain: x_p, the last compressed token (PIC Eq. 7's special token)
    qa: list | None = None          # qa: the prompt, then the answer and EOS
    n_answer: list | None = None    # qa: the supervised tokens at the end of each qa row (answer + EOS)
    prefix: list | None = None      # qa, distill: the template's text before the memory
    dec_context: list | None = None  # distill: the context uncompressed, as the teacher reads it
    question: list | None = None    # distill: the template's text after the context
    answer: list | None = None      # distill: the frozen LLM's own answer (add_teacher_answers)
    norm: dict | None = None        # task -> its loss divisor over the whole step (step_normalizers): the step sets it
    inputs: dict | None = None      # on the device, what the forward reads that these lists decide (train.step_inputs)


def collate(examples) -> Batch:
    """The examples of a micro-batch as one Batch; its ratios (GMSA) None unless sampled."""
    fields = {k: [e[k] for e in examples] for k in examples[0]}
    ratios = sum(fields.pop("ratio", []), [])
    # tokens the step reads: compressed context + every decoder sequence (tok/s in the log)
    tokens = sum(len(f) for k in ("context", "ae", "lm", "qa") if k in fields for f in fields[k])
    return Batch(**fields, ratios=ratios or None, tokens=tokens)


def step_normalizers(comp, objective, examples):
    """What each task's loss is divided by: its supervised tokens over the whole step (every micro-batch of every
    process), so that the step's loss is the mean over its tokens however it is split (the gradient-accumulation
    normalisation, as Hugging Face's Trainer fixed it in 2024); distillation is a mean over examples (CompLLM
    Eq. 3), so its normaliser is the step's number of examples, as is AE's own/other term's ("texts", ours)."""
    batch, start = collate(examples), comp.follow_start
    if objective == "distill":
        return {"distill": len(examples)}
    if objective == "qa":
        return {"qa": supervised_tokens(batch.qa, batch.n_answer, batch.prefix, start["qa"])}
    norm = {"ae": supervised_tokens(batch.ae, None, None, start["ae"]), "texts": len(examples)}
    if objective == "pretrain":
        norm["lm"] = supervised_tokens(batch.lm, None, None, start["lm"])
    return norm


def supervised_tokens(follow, n_supervised, prefix, follow_start: int) -> int:
    """How many tokens Compressor.lm_loss supervises in these decoder rows, counted without running anything: the last
    n_supervised[b] of row b's follow tokens (all of them when None), follow token t in slot first + t, each predicted
    by the slot before it where there is one (decoder_batch's target rule, next_token_targets). follow_start: the slot
    of follow[0] in a row with no prefix (Compressor.follow_start); a prefix moves every slot on by its length."""
    total = 0
    for b, ids in enumerate(follow):
        n = len(ids) if n_supervised is None else n_supervised[b]
        first = follow_start + (len(prefix[b]) if prefix else 0)
        total += sum(first + t - 1 >= 0 for t in range(len(ids) - n, len(ids)))
    return total


def teacher_answer(comp, cache, prompt, max_new, autocast):
    """CompLLM §3: the answer the frozen LLM itself gives with the full context (greedy), memoised in `cache`
    (saved to disk with each checkpoint). prompt: the template's [prefix, context, question] ids, as the student
    reads them with the context compressed. Includes the EOS when the LLM stops, so A is never empty."""
    example_key = hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:20]
    if example_key not in cache:
        ids = torch.tensor([prompt], device=comp.device)
        with torch.no_grad(), comp.decoding(), autocast:
            out = comp.decoder.generate(ids, max_new_tokens=max_new, eos_id=comp.tok.eos_ids or None)[0].tolist()
        eos = [i for i, t in enumerate(out) if t in comp.tok.eos_ids]
        cache[example_key] = out[:eos[0] + 1] if eos else out
    return cache[example_key]


def add_teacher_answers(comp, batch: Batch, cache, max_new, autocast):
    """distill: the frozen LLM's own answer to each example of the micro-batch (teacher_answer), and the tokens the
    teacher and the student read (the log's tok/s)."""
    batch.answer = [teacher_answer(comp, cache, p + c + q, max_new, autocast)
                    for p, c, q in zip(batch.prefix, batch.dec_context, batch.question)]
    batch.tokens += sum(len(c) + len(q) + 2 * len(a) for c, q, a in   # teacher + student
                        zip(batch.dec_context, batch.question, batch.answer))


def save_answers(corpus: Corpus):
    """The teacher's answers so far, beside the token cache (atomic), so a resumed run does not generate them again."""
    if corpus.answers:
        torch.save(corpus.answers, corpus.answers_path + ".tmp")
        os.replace(corpus.answers_path + ".tmp", corpus.answers_path)


def batch_shape(batch: Batch) -> str:
    """'contexts 4 x <= 480 tokens, ae 4 x <= 481' : what a micro-batch asks of the GPU."""
    rows = {k: getattr(batch, k) for k in ("context", "ae", "lm", "qa", "answer") if getattr(batch, k) is not None}
    return ", ".join(f"{'contexts' if k == 'context' else k} {len(v)} x <= {max(map(len, v))} tokens"
                     for k, v in rows.items())


# ---- built-in corpus ----
# So that the quickstart runs offline with no --data and shows real compression: thousands of short documents from
# a small seeded grammar (ours), many enough that a run trains on many texts and is scored on others it never saw
# (unseen_texts: the same grammar, another seed, any text also drawn here left out); and a few paragraphs of plain
# English (written for this repository) with questions about them, for QA. evaluate.py reads its built-in examples
# from here too (EVAL_TEXTS, EVAL_QA, unseen_texts): one place for every built-in text.

NAMES = ("Mira", "Tom", "Anna", "Jonas", "Lena", "Omar", "Sara", "Pedro", "Yuki", "Ivan", "Nora", "Felix", "Hana",
         "Leo", "Ada", "Karim", "Ines", "Oskar", "Rosa", "Theo", "Vera", "Emil", "Lucia", "Amir")
JOBS = ("baker", "farmer", "teacher", "painter", "doctor", "sailor", "miller", "weaver", "potter", "builder",
        "gardener", "fisher", "singer", "tailor", "carpenter", "librarian")
TOWNS = ("Millbrook", "Ashford", "Redhill", "Stonebridge", "Elmwood", "Northgate", "Fairhaven", "Oakley",
         "Riverton", "Westmoor", "Lakeside", "Greenfield", "Hollowmere", "Kingsport", "Brightwater", "Dunmore")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
GOODS = (("sold", "loaves of bread"), ("bought", "baskets of apples"), ("painted", "wooden chairs"),
         ("carried", "sacks of flour"), ("found", "old coins"), ("mended", "fishing nets"), ("planted", "young trees"),
         ("baked", "honey cakes"), ("wove", "woollen blankets"), ("built", "garden walls"), ("counted", "grey sheep"),
         ("picked", "ripe pears"), ("wrote", "long letters"), ("lost", "silver spoons"), ("caught", "small trout"),
         ("shaped", "clay pots"))
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "brown", "golden")
REASONS = ("the market opened early", "the rain had finally stopped", "a storm was coming", "the mayor had asked",
           "the old bridge was closed", "it was the first day of spring", "a cousin was visiting",
           "the harvest had been good", "the prices had fallen", "the river was high", "a festival began at noon",
           "the school was closed")
AFTER = ("Later {name} walked home along the {colour} fence.", "The neighbours said it was the best work in {town}.",
         "By evening only {num} were left.", "{Name} was paid {num} coins for the work.",
         "Nobody in {town} had seen so many before.", "Next week {name} will do it again.")


def generated_texts(n: int, seed: int) -> list:
    """n short documents of two or three sentences from the grammar above, drawn with `seed` (ours)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        name, job, town, day = rng.choice(NAMES), rng.choice(JOBS), rng.choice(TOWNS), rng.choice(DAYS)
        verb, goods = rng.choice(GOODS)
        num, colour = rng.randint(2, 99), rng.choice(COLOURS)
        first = rng.choice((f"{name} the {job} {verb} {num} {goods} in {town} on {day}.",
                            f"On {day}, {name} the {job} {verb} {num} {colour} {goods} in {town}.",
                            f"In {town}, {name} {verb} {num} {goods} for the {job}s on {day}."))
        second = f"{rng.choice(('They', name, 'The ' + job))} did it because {rng.choice(REASONS)}."
        third = rng.choice(AFTER + ("",)).format(name=rng.choice(NAMES), Name=rng.choice(NAMES), town=town,
                                                 colour=colour, num=rng.randint(2, 99))
        docs.append(" ".join(s for s in (first, second, third) if s))
    return docs


BUILTIN_GENERATED = 3000   # documents of the built-in training corpus (seed 0); unseen_texts draws seed 1's

BUILTIN_TEXTS = [
    "The river starts as a thin stream high in the hills, where snow melts slowly through the spring. It runs "
    "over stones and under fallen trees, gathering water from a hundred small springs, until by the time it "
    "reaches the first village it is wide enough for a wooden bridge. The villagers built that bridge three "
    "times: the first was carried away by a flood, the second burned in a dry summer, and the third, made of "
    "oak and iron, has stood for more than two hundred years. Below the bridge the river slows down. It bends "
    "through meadows where cattle graze, past a mill that once ground the grain of the whole valley, and into "
    "a lake that the maps call Long Water, although everyone who lives beside it simply calls it the lake.",
    "A good bread needs only four things: flour, water, salt and time. The baker mixes the flour and water "
    "the evening before and leaves the dough to rest, so that the flour can soak up the water and the gluten "
    "can begin to form on its own. In the morning she adds the salt and a little yeast, folds the dough every "
    "half hour for two hours, and then shapes it into round loaves. The loaves rise in cloth-lined baskets "
    "until they are soft and airy. The oven must be very hot. A tray of water on the bottom shelf fills it "
    "with steam, which keeps the crust thin for the first minutes and lets the bread grow. After forty minutes "
    "the loaves are dark brown, and when the baker taps one underneath it sounds hollow, like a small drum.",
    "The library opened in the old railway station after the trains stopped running. The waiting room became "
    "the reading room, the ticket office became the front desk, and the long platform, now covered with glass, "
    "holds shelves of novels arranged by the colour of their covers as well as by author. Children come on "
    "Saturday mornings to hear stories read aloud beside the great clock, which still keeps perfect time "
    "although nobody has needed a timetable here for forty years. The librarian says that the building "
    "remembers its first purpose: people still arrive in a hurry, still sit and wait, and still leave for "
    "places far away, except that now they travel inside the pages of a book instead of on the rails.",
    "Bees find their way home by the sun. A worker bee that discovers a field of flowers returns to the hive "
    "and dances on the comb: she runs in a straight line while shaking her body, turns, circles back, and runs "
    "the line again. The direction of the straight run, measured from the vertical, tells the other bees the "
    "angle between the sun and the flowers, and the length of the run tells them how far they must fly. On a "
    "cloudy day the bees can still read the sun through the pattern of polarised light in the sky. A strong "
    "hive can send out thousands of foragers in a single morning, and in one summer it can gather enough "
    "nectar to make more than fifty kilograms of honey, most of which it eats during the winter.",
    "The first clocks with a pendulum were built in the middle of the seventeenth century. Before them, even "
    "the best clocks in church towers could lose or gain a quarter of an hour in a single day, and people set "
    "them by the sun at noon. A pendulum swings with almost the same period whatever the size of its swing, so "
    "a clock that counts its swings keeps time far better: the new clocks erred by less than a minute a day. "
    "Sailors wanted such a clock most of all, because a ship that knows the exact time at its home port can "
    "work out its longitude from the position of the sun. But a pendulum cannot swing properly on a rolling "
    "deck, and it took another hundred years before a clock was made that kept good time at sea.",
    "Every autumn the town holds a market in the square in front of the town hall. Farmers bring apples, "
    "pears, pumpkins and jars of honey; a cheesemaker from the mountains sells round wheels of hard cheese; "
    "and a man with a small cart roasts chestnuts, whose smell reaches every street nearby. In the afternoon "
    "there is a competition for the largest pumpkin. The winner last year weighed three hundred and twelve "
    "kilograms and had to be lifted onto the scale by a tractor. When the sun goes down, lanterns are hung "
    "between the stalls, a band plays on the steps of the town hall, and people dance until late in the "
    "evening, while the children run between the legs of the grown-ups with sticky hands and paper crowns.",
]

BUILTIN_QA = [
    (BUILTIN_TEXTS[0], "How many times did the villagers build the bridge?", "three times"),
    (BUILTIN_TEXTS[0], "What do the people who live beside Long Water call it?", "the lake"),
    (BUILTIN_TEXTS[1], "How long do the loaves bake?", "forty minutes"),
    (BUILTIN_TEXTS[2], "Where did the library open?", "in the old railway station"),
    (BUILTIN_TEXTS[3], "How do bees find their way home?", "by the sun"),
    (BUILTIN_TEXTS[4], "When were the first pendulum clocks built?", "in the middle of the seventeenth century"),
    (BUILTIN_TEXTS[5], "How much did last year's winning pumpkin weigh?", "three hundred and twelve kilograms"),
]


# evaluate.py's built-in examples, so every task runs offline with no --data; none of them is in the corpus above.
# Short on purpose (the tests run the tasks on CPU, and AE regenerates every text token by token).
EVAL_TEXTS = [
    "The old stone bridge was finished in 1932. It crosses the river at its narrowest point, "
    "and for forty years it was the only way into the town from the north.",
    "Honeybees tell each other where food is by dancing. The angle of the dance shows the "
    "direction of the flowers, and its length shows how far away they are.",
    "Mira planted tomatoes, beans and basil in April. By July the beans had climbed the fence, "
    "but a late frost had killed half of the tomatoes.",
    "The library opens at nine on weekdays and at ten on Saturdays. It is closed on Sundays, "
    "and books can be returned through the slot by the door at any time.",
    "A comet is a ball of ice and dust. When it comes close to the Sun, the ice turns to gas "
    "and forms a bright tail that always points away from the Sun.",
    "The recipe needs two eggs, a cup of flour and a pinch of salt. Mix them, let the dough "
    "rest for an hour, then roll it out thinly and cut it into strips.",
]

EVAL_QA = [
    dict(context=EVAL_TEXTS[0], question="When was the bridge finished?", answer="1932"),
    dict(context=EVAL_TEXTS[1], question="How do honeybees show where food is?",
         answer="by dancing"),
    dict(context=EVAL_TEXTS[2], question="What killed half of the tomatoes?",
         answer="a late frost"),
    dict(context=EVAL_TEXTS[3], question="On which day is the library closed?",
         answer="Sundays"),
    dict(context=EVAL_TEXTS[4], question="Which way does a comet's tail point?",
         answer="away from the Sun"),
]


def unseen_texts(n=32):
    """The built-in texts of evaluate.py's ae and lm tasks (and of a tiny run's held-out check): n documents of the
    grammar above drawn with another seed, none of them in the built-in corpus (so a quickstart run is scored on
    texts it never saw)."""
    seen = set(generated_texts(BUILTIN_GENERATED, seed=0))
    return [t for t in generated_texts(n + 8, seed=1) if t not in seen][:n]
