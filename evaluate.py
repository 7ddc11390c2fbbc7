"""Evaluation: the metrics the five papers report, then the evaluation tasks and the command line.

    python evaluate.py --ckpt DIR --task {ae,lm,qa,needle,speed,interpolate,heatmap} [--data PATH] [--n N]
    python evaluate.py --method compllm --model tiny --task speed --lengths 512,1024,2048,4096,8192

Tasks (`--help` explains each): ae reconstruction, lm completion perplexity, qa, needle (passkey
retrieval at each depth x length, Mohtashami & Jaggi 2023), each next to the plain LLM with the full
context and with none; speed (CompLLM's complexity claims: compression linear, prefill quadratic,
TTFT speedup -> C²); interpolate (AOC Eq. 5); heatmap (PIC Figures 3 and 7: memory-token cosine and
attention maps, written as PNG with matplotlib); curves (loss curves of several runs on one figure,
and the step, tokens and time each takes to reach a loss).

Metrics (the first section) are written from scratch — stdlib only — and tested against the
reference packages the papers used (nltk's sentence_bleu, Google's rouge-score, the `rouge` 1.0.1
package of pltrdy, the official SQuAD v1.1 script). Every score is a float in [0, 1] except
perplexity.

    reconstruction (AE)   bleu4, bleu_n_precision, rouge_n_f1, rouge_l_f1 (rouge-score),
                          rouge_pltrdy (rouge 1.0.1), prefix_em, aoc_exact_match, token_accuracy
    completion (LM)       perplexity = exp(Σ NLL / N)
    question answering    squad_em, squad_f1 (normalised) · exact_match, token_f1 (unnormalised)
                          · substring_acc (GMSA "Acc") · epl_qa_f1, epl_qa_em (EPL)

Which paper scores how (each paper's scoring code, as cited at each function): what it computes, our
function for it, and [its key] in ae_scores / qa_scores.

    EPL          BLEU-4 on token ids, no smoothing          bleu4(ids, ids)                      [bleu4_ids]
                 QA "F1" = pltrdy ROUGE-1 F vs answers[0]   epl_qa_f1                            [epl_f1]
                 QA EM = raw equality with answers[0]       epl_qa_em                            [epl_em]
    500x / AOC   BLEU on nltk word tokens, method1          bleu4(words, words, smooth=True)     [bleu4_words]
                 ROUGE-1/2/L F of pltrdy rouge 1.0.1        rouge_pltrdy(h, r)[m]["f"]           [aoc_rouge1/2/L]
                 AOC script "exact_match": char. prefix     aoc_exact_match(h, r)                [aoc_em]
                 AOC text / Eq. 6 as printed, on tokens     prefix_em, token_accuracy            [same names]
                 QA: EM stripped, F1 unnormalised           exact_match, token_f1                [same names]
    PCC / PIC    BLEU-1..4, ROUGE-L on word tokens          bleu_n_precision (trap), rouge_l_f1  [rougeL]
                 QA: SQuAD normalisation, max over refs     squad_em, squad_f1                   [same names]
    GMSA         BLEU, prefix EM, ROUGE (+ BERTScore)       bleu4, prefix_em, rouge_*            [bleu4_*, prefix_em, rouge*]
                 QA: Acc, EM, F1                            substring_acc, squad_em, squad_f1    [same names]

Token arguments are sequences of hashables: token ids (ints) or words (str). Conventions for
empty inputs follow the reference packages and are stated in each docstring; in short: BLEU and
ROUGE give 0.0 whenever either side is empty (rouge 1.0.1 raises there; its callers score 0.0 or
crash), exact-match-like scores give 1.0 when both sides are empty, and SQuAD F1 follows the v1.1
script (0.0 when nothing overlaps, even if both empty).
"""

import argparse
import json
import math
import os
import random
import re
import statistics
import string
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import compressors as C
import masks
from model import SHAPES, apply_rope, build_shape, load_pretrained

# -----------------------------------------------------------------------------
# ---- metrics ----


def _tokens(seq):
    """Normalise a token argument to a list of hashables.

    Two footguns are closed here: a str would silently be scored character by character, and a
    torch tensor's elements hash by identity (two tensor(5) are different dict keys), so n-gram
    counts would never match. Tensors and numpy arrays become Python lists via .tolist().
    """
    if isinstance(seq, str):
        raise TypeError("pass a token sequence, not a str (use word_tokens(text) or tok.encode(text))")
    if hasattr(seq, "tolist"):  # torch.Tensor, np.ndarray
        seq = seq.tolist()
    return list(seq)


def _references(references):
    """QA metrics take one reference str or a list of them; a bare str means [str]."""
    return [references] if isinstance(references, str) else list(references)


# Word tokens: runs of word characters, where a hyphen, period, comma or colon *between* word
# characters stays inside the token (state-of-the-art, 3.14, 1,000, 10:30); every other
# non-space character is a token of its own. Case is kept: the 500x and PCC scripts (AOC builds on
# 500x) tokenise with nltk.word_tokenize and do not lowercase.
_WORD_RE = re.compile(r"\w+(?:[-.,:]\w+)*|[^\w\s]")


def word_tokens(text):
    """Split text into the word tokens used for word-level BLEU / ROUGE / token F1.

    A dependency-free stand-in for nltk.word_tokenize, which the 500x and PCC scripts use
    but which needs the punkt model (a download we cannot do offline). On ordinary prose the two
    agree token for token (tested against nltk's NLTKWordTokenizer, the part of word_tokenize
    that needs no data). Known differences, all rare in the texts we score:
      - contractions: "doesn't" -> does n't (nltk) vs doesn ' t (here)
      - double quotes: nltk rewrites " to `` and ''; here " stays "
      - abbreviations: "Mr." / "U.S." stay whole in nltk (punkt), split off the "." here
      - glued punctuation between letters, e.g. "a,b": nltk splits the comma, here it stays.
    """
    return _WORD_RE.findall(text)


def _ngram_counts(tokens, n):
    """Counter of the n-grams (as tuples) in tokens; empty when len(tokens) < n."""
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _clipped_matches(hyp, ref, n):
    """(clipped n-gram matches, hypothesis n-gram count) — BLEU's modified precision, Papineni §2.1.

    Clipping: a hypothesis n-gram is credited at most as often as it occurs in the reference,
    so "the the the the" against "the cat" gets 1 unigram match, not 4.
    """
    hyp_counts, ref_counts = _ngram_counts(hyp, n), _ngram_counts(ref, n)
    matches = sum(min(count, ref_counts[g]) for g, count in hyp_counts.items())
    return matches, sum(hyp_counts.values())


def bleu_n_precision(hyp_tokens, ref_tokens, n):
    """Modified (clipped) n-gram precision p_n alone; 0.0 if the hypothesis has no n-grams.

    Trap (PCC/PIC): their "BLEU-4" is nltk sentence_bleu(..., weights=(0, 0, 0, 1)), i.e.
    brevity_penalty · p_4 — the 4-gram precision alone (times BP), NOT the cumulative BLEU-4 of
    bleu4(). It is much lower than BLEU-4 and must not be compared with the other papers' BLEU.
    Reproduce it as brevity_penalty(len(hyp), len(ref)) * bleu_n_precision(hyp, ref, 4).
    """
    matches, total = _clipped_matches(_tokens(hyp_tokens), _tokens(ref_tokens), n)
    return matches / total if total > 0 else 0.0


def brevity_penalty(hyp_len, ref_len):
    """BLEU's brevity penalty (Papineni §2.2.2): 1 if c > r, else exp(1 - r/c); 0 when c = 0.

    With a single reference, nltk's "closest reference length" is simply len(ref).
    """
    if hyp_len > ref_len:
        return 1.0
    if hyp_len == 0:
        return 0.0
    return math.exp(1 - ref_len / hyp_len)


def bleu4(hyp_tokens, ref_tokens, smooth=False):
    """Sentence BLEU-4 against one reference: BP · exp(Σ_n ¼ log p_n), n = 1..4.

    Equals nltk.translate.bleu_score.sentence_bleu([ref], hyp) (smooth=False, EPL's setting) and
    sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1) (smooth=True,
    500x/AOC's setting) — tested to 1e-9 against nltk 3.10.4. Conventions, all nltk's:
      - no unigram match at all (incl. empty hypothesis, empty reference, both empty) -> 0.0,
        with or without smoothing;
      - smooth=False and some higher order has 0 matches (e.g. fewer than 4 tokens) -> 0.0.
        nltk >= 3.6 warns and substitutes sys.float_info.min for that p_n, returning ~1e-77
        instead of exactly 0; we return the exact 0 the geometric mean gives (|diff| < 1e-70);
      - smooth=True (method1): a zero-match order gets p_n = 0.1 / max(1, #hyp n-grams), so a
        perfect 3-token copy scores (0.1)^(1/4) ≈ 0.56, not 1 — short texts are penalised.
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    counts = [_clipped_matches(hyp, ref, n) for n in (1, 2, 3, 4)]
    # nltk: "no unigram overlap" short-circuits to 0 before any smoothing is applied
    if counts[0][0] == 0:
        return 0.0
    log_p = []
    for matches, total in counts:
        if matches > 0:
            log_p.append(math.log(matches / total))
        elif smooth:
            # SmoothingFunction().method1: epsilon = 0.1 added to the zero numerator; nltk
            # keeps the denominator at >= 1 when the hypothesis is shorter than n
            log_p.append(math.log(0.1 / max(total, 1)))
        else:
            return 0.0  # one zero precision makes the geometric mean zero
    bp = brevity_penalty(len(hyp), len(ref))
    # fsum of the weighted logs, in the same order as nltk, so results agree to the last bits
    return bp * math.exp(math.fsum(0.25 * lp for lp in log_p))


def _f1(precision, recall):
    """Harmonic mean (β = 1 F-measure); 0.0 when both are 0."""
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_n_f1(hyp_tokens, ref_tokens, n):
    """ROUGE-N F1 (Lin 2004) with clipped n-gram counts, as Google's rouge-score computes it.

    overlap = Σ_g min(count_hyp(g), count_ref(g)); P = overlap / #hyp n-grams,
    R = overlap / #ref n-grams (each denominator at least 1); F = 2PR / (P + R).
    Empty hypothesis or reference (or fewer than n tokens on either side) -> 0.0.
    rouge-score tokenises raw strings itself (lowercase, [a-z0-9]+ only, punctuation dropped);
    here the caller chooses the tokens — token ids or word_tokens(text). The `rouge` package
    (pltrdy) that 500x/AOC/EPL call counts each distinct n-gram once instead: rouge_pltrdy().
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    hyp_counts, ref_counts = _ngram_counts(hyp, n), _ngram_counts(ref, n)
    overlap = sum((hyp_counts & ref_counts).values())  # Counter & = per-n-gram minimum
    precision = overlap / max(sum(hyp_counts.values()), 1)
    recall = overlap / max(sum(ref_counts.values()), 1)
    return _f1(precision, recall)


def _lcs_length(a, b):
    """Length of the longest common subsequence, O(len(a)·len(b)) dynamic programme.

    Only the previous row of the DP table is kept: row[j] = LCS(a[:i], b[:j]).
    """
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1]


def rouge_l_f1(hyp_tokens, ref_tokens):
    """ROUGE-L F1: P = LCS / len(hyp), R = LCS / len(ref), F = 2PR / (P + R).

    This is rouge-score's sentence-level "rougeL" (β = 1), as PCC uses it; not "rougeLsum", and
    not the summary-level, distinct-word rouge-l of the `rouge` package (pltrdy) that the 500x/AOC
    scripts call — that one is rouge_pltrdy(). Either side empty -> 0.0.
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    if not hyp or not ref:
        return 0.0
    lcs = _lcs_length(hyp, ref)
    return _f1(lcs / len(hyp), lcs / len(ref))


# ROUGE as the `rouge` package 1.0.1 (pltrdy) computes it: Rouge().get_scores(hyp, ref)[0], which
# the 500x/AOC evaluation scripts (ROUGE-1/2/L) and EPL's QA evaluator ("F1" = ROUGE-1 F) call. It
# differs from rouge_n_f1 / rouge_l_f1 above (rouge-score, Lin 2004) in four ways:
#   - it takes raw strings: sentences are the pieces between "." characters, words are split on
#     whitespace; no lowercasing, no stemming, punctuation other than "." stays on the word ("Paris,");
#   - with its default exclusive=True it counts every n-gram and word ONCE: n-gram sets, not
#     clipped multisets, so "the the the" against "the cat" is P = 1/1, not 1/3;
#   - rouge-l is summary-level: the union, over (reference sentence, hypothesis sentence) pairs, of
#     the words on one LCS of each pair; its size over the distinct words of each side gives R and P;
#   - F = 2PR / (P + R + 1e-8): a perfect match scores 0.999999995, not 1.


def _pltrdy_sentences(text):
    """rouge 1.0.1 Rouge._get_scores: the non-empty pieces of text.split("."), whitespace-squeezed,
    each returned as its words, sentence.split(" ").

    Footgun kept on purpose: a piece made only of whitespace (the " " after "Paris. ") is non-empty
    before squeezing, so it survives as the sentence "" whose one word is the empty string.
    "Paris. " thus has the words ["Paris", ""] and scores P = 1/2 against "Paris".
    """
    sentences = [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]
    return [sentence.split(" ") for sentence in sentences]


def _pltrdy_lcs_words(ref, hyp):
    """The words on one longest common subsequence of a reference and a hypothesis sentence, picked
    as rouge 1.0.1's _recon_lcs picks it: backtrack from the ends, take a match, else drop the last
    reference word only if that keeps a strictly longer LCS, else drop the last hypothesis word.

    The pick matters: rouge-l counts the distinct words of the union of the picks, and two LCSs of
    equal length can hold different words (ref "a b" vs hyp "b a": this picks "b", not "a").
    The package backtracks recursively and raises RecursionError once a path is ~1000 steps long
    (e.g. two sentences of 1000 words with nothing in common); this loop has no such limit.
    """
    # table[i][j] = LCS length of ref[:i] and hyp[:j]; the full table, since the backtrack reads it
    table = [[0] * (len(hyp) + 1) for _ in range(len(ref) + 1)]
    for i, r in enumerate(ref, 1):
        for j, h in enumerate(hyp, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if r == h else max(table[i - 1][j], table[i][j - 1])
    words, i, j = [], len(ref), len(hyp)
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.append(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:  # strict ">": ties step along the hypothesis
            i -= 1
        else:
            j -= 1
    return words


def _pltrdy_prf(overlap, hyp_count, ref_count):
    """rouge 1.0.1 f_r_p_rouge_n: P and R (0.0 over a zero count), F = 2PR / (P + R + 1e-8)."""
    precision = overlap / hyp_count if hyp_count > 0 else 0.0
    recall = overlap / ref_count if ref_count > 0 else 0.0
    return {"r": recall, "p": precision, "f": 2.0 * ((precision * recall) / (precision + recall + 1e-8))}


def rouge_pltrdy(hypothesis, reference):
    """rouge 1.0.1 (pltrdy) Rouge().get_scores(hypothesis, reference)[0], stdlib only.

    Returns the package's dict {"rouge-1": {"r", "p", "f"}, "rouge-2": {...}, "rouge-l": {...}}
    (the 500x/AOC scripts read all three, EPL reads ["rouge-1"]["f"]); equal to the package to the
    last bit, tested on random and hand-picked texts. The rules are in the comment above:
      rouge-n: the sets of word n-grams of each whole text (n-grams run across sentence ends);
               overlap = |H ∩ R|, P = overlap / |H|, R = overlap / |R|, 0.0 when a set is empty
               (fewer than n words);
      rouge-l: U = ∪ over reference sentences r_i and hypothesis sentences c_j of the words on
               one LCS(r_i, c_j); P = |U| / #distinct hypothesis words, R = |U| / #distinct
               reference words.
    Empty input: a text with no sentence ("" or only "."s) makes the package raise ValueError
    ("Hypothesis is empty." / "Reference is empty."); EPL's evaluator catches it and scores 0.0,
    AOC's crashes. Here every score is 0.0. A whitespace-only text is not empty to the package
    (it is one sentence with the word ""), and is scored as the package scores it.
    """
    hyp, ref = _pltrdy_sentences(hypothesis), _pltrdy_sentences(reference)
    if not hyp or not ref:
        return {metric: {"r": 0.0, "p": 0.0, "f": 0.0} for metric in ("rouge-1", "rouge-2", "rouge-l")}
    hyp_words = [w for sentence in hyp for w in sentence]
    ref_words = [w for sentence in ref for w in sentence]
    scores = {}
    for n in (1, 2):
        hyp_grams, ref_grams = set(_ngram_counts(hyp_words, n)), set(_ngram_counts(ref_words, n))
        scores[f"rouge-{n}"] = _pltrdy_prf(len(hyp_grams & ref_grams), len(hyp_grams), len(ref_grams))
    union = set()  # the package grows one union across all reference sentences
    for ref_sentence in ref:
        for hyp_sentence in hyp:
            union.update(_pltrdy_lcs_words(ref_sentence, hyp_sentence))
    scores["rouge-l"] = _pltrdy_prf(len(union), len(set(hyp_words)), len(set(ref_words)))
    return scores


def prefix_em(hyp_tokens, ref_tokens):
    """Proportional prefix exact match: (length of the identical prefix) / len(ref).

    This is the EM the AOC text describes ("the proportion of identical prefix length to total
    target length", after ICAE) and GMSA's footnote 3 (first 128 of 512 tokens right, token 129
    wrong -> 0.25). Note: AOC Eq. (6) AS PRINTED, (1/n) Σ_i 1[X_i = X̂_i], counts matches at every
    position, which is token_accuracy() below, not a prefix measure; the two differ as soon as a
    wrong token is followed by right ones (hyp ABXD vs ref ABCD: prefix 0.5, accuracy 0.75).
    Extra generated tokens after len(ref) are not penalised — cut generation at EOS first.
    Empty reference: 1.0 if the hypothesis is empty too, else 0.0 (scored like exact match).
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    if not ref:
        return float(not hyp)
    prefix = 0
    for h, r in zip(hyp, ref):
        if h != r:
            break
        prefix += 1
    return prefix / len(ref)


def aoc_exact_match(candidate, reference):
    """AOC's "exact_match" (AOC util_funs.compute_exact_match): the character-level prefix EM.

    Both strings are stripped; the score is (length of their common character prefix) /
    len(reference). Not binary: a strict prefix of the reference scores len(candidate) /
    len(reference), and a candidate that starts with the whole reference scores 1.0 (trailing
    text is not penalised). Case, inner whitespace and punctuation all count. This is prefix_em()
    on characters instead of tokens. Empty inputs (after strip), where the original raises
    (unbound loop index / division by zero): both empty -> 1.0; empty candidate -> 0.0; empty
    reference with a non-empty candidate -> 0.0 — prefix_em's conventions.
    """
    return prefix_em(list(candidate.strip()), list(reference.strip()))


def token_accuracy(hyp_tokens, ref_tokens):
    """AOC Eq. (6) as printed: (1/n) Σ_{i=1..n} 1[X_i = X̂_i], n = len(ref).

    Position-wise accuracy; positions past the end of a short hypothesis count as wrong, extra
    hypothesis tokens are ignored. Never below prefix_em: after a substituted token it keeps
    counting, while after an inserted or dropped token the shifted positions mostly mismatch.
    Empty reference: 1.0 if the hypothesis is empty too, else 0.0.
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    if not ref:
        return float(not hyp)
    return sum(h == r for h, r in zip(hyp, ref)) / len(ref)


# SQuAD v1.1 normalisation (the official evaluate-v1.1.py), in its order: lowercase, drop ASCII
# punctuation, drop the articles a/an/the as whole words, squeeze whitespace. Punctuation goes
# first, so "the-cat" becomes "thecat" (kept) while "the cat" becomes "cat".
_PUNCTUATION = set(string.punctuation)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s):
    """Official SQuAD v1.1 answer normalisation: normalize_answer("The  Cat, a dog!") == "cat dog"."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def _bag_f1(pred_tokens, ref_tokens):
    """Bag-of-tokens F1 of the SQuAD script: 0.0 when no token is shared (even if both empty)."""
    shared = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if shared == 0:
        return 0.0
    return _f1(shared / len(pred_tokens), shared / len(ref_tokens))


def squad_em(prediction, references):
    """SQuAD EM: 1.0 if normalize_answer(prediction) equals that of any reference.

    Two strings that both normalise to "" (e.g. "The" and "a.") count as equal -> 1.0.
    An empty list of references -> 0.0.
    """
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(r)) for r in _references(references)), default=0.0)


def squad_f1(prediction, references):
    """SQuAD F1 over normalised whitespace tokens, max over references (PCC/PIC, GMSA).

    Follows v1.1 exactly: no shared token -> 0.0, including when both sides normalise to empty
    (the SQuAD v2.0 script instead returns 1.0 for empty vs empty). No references -> 0.0.
    """
    pred = normalize_answer(prediction).split()
    refs = _references(references)
    return max((_bag_f1(pred, normalize_answer(r).split()) for r in refs), default=0.0)


def exact_match(prediction, references):
    """Unnormalised EM (500x/AOC scripts, EPL): prediction.strip() == reference.strip().

    Case and punctuation matter ("Paris." != "Paris"). Max over references; "" vs "" -> 1.0;
    no references -> 0.0.
    """
    pred = prediction.strip()
    return max((float(pred == r.strip()) for r in _references(references)), default=0.0)


def token_f1(prediction, references):
    """Unnormalised token F1 (500x/AOC scripts): bag F1 over word_tokens, no lowercasing,
    punctuation and articles kept. Max over references; no shared token -> 0.0 (so "" vs "" is 0).

    The 500x script tokenises with nltk.word_tokenize, so "Paris." is ["Paris", "."] and shares
    "Paris" with "Paris"; a plain str.split() would score that pair 0.
    """
    pred = word_tokens(prediction)
    return max((_bag_f1(pred, word_tokens(r)) for r in _references(references)), default=0.0)


def epl_qa_f1(generation, answers):
    """EPL's QA "F1" (EPL sft/instruction_evaluator.py): the ROUGE-1 F of rouge 1.0.1 (pltrdy),
    Rouge().get_scores(generation, answers[0])[0]["rouge-1"]["f"] — not SQuAD F1.

    Only the first answer counts (no max over references); the words are whitespace tokens,
    case-sensitive, distinct (see rouge_pltrdy). The evaluator scores 0.0 on any exception, i.e.
    on an empty generation or answer (rouge_pltrdy already returns 0.0 there); no answers -> 0.0.
    """
    refs = _references(answers)
    return rouge_pltrdy(generation, refs[0])["rouge-1"]["f"] if refs else 0.0


def epl_qa_em(generation, answers):
    """EPL's QA EM (EPL sft/instruction_evaluator.py): 1.0 iff the decoded generation equals
    answers[0] exactly — no strip, no normalisation, first answer only ("Paris " != "Paris",
    unlike exact_match). "" vs "" -> 1.0; no answers -> 0.0.
    """
    refs = _references(answers)
    return float(generation == refs[0]) if refs else 0.0


def substring_acc(prediction, references):
    """GMSA "Acc": 1.0 if any normalised reference occurs as a substring of the normalised
    prediction — the best_subspan_em of the Lost-in-the-Middle / LongLLMLingua QA evaluation
    (the PCC repo's QA utils carry the same function as its "qa_score").

    Character containment, not token containment: "cat" is found inside "concatenate". A
    reference that normalises to "" is found in every prediction -> 1.0 (as in the original).
    """
    pred = normalize_answer(prediction)
    return max((float(normalize_answer(r) in pred) for r in _references(references)), default=0.0)


def perplexity(nll_sum, n_tokens):
    """exp(mean NLL): nll_sum is the summed natural-log cross-entropy over n_tokens predicted
    tokens (EPL Table 4 reports it for LM completion). Sum over the whole evaluation set first and
    divide once; averaging per-example perplexities weights short examples too heavily.
    """
    if n_tokens <= 0:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(float(nll_sum) / n_tokens)


def mean_scores(rows):
    """Average a list of per-example metric dicts key by key: [{"bleu": .5}, {"bleu": 1.}] ->
    {"bleu": .75}. A key missing from some rows is averaged over the rows that have it."""
    sums, counts = {}, Counter()
    for row in rows:
        for key, value in row.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] += 1
    return {key: sums[key] / counts[key] for key in sums}


# -----------------------------------------------------------------------------
# ---- data ----
# Each quality task scores three rows, as the papers report a method between two references
# (EPL Table 4, PIC Table 2, GMSA Table 1):
#
#     compressed   the decoder reads [memory, special token, prompt]         the method
#     full         the plain LLM reads [BOS, context, "\n\n", prompt]        upper reference
#     none         the plain LLM reads [BOS, prompt]                         lower reference
#
# "full" and "none" use the plain LLM: the base model (a shared encoder's LoRA switched off; after GMSA's
# KEFT, a fresh copy of the base model, since KEFT changed the decoder's q/k/v), so they depend on the base
# model, not on the checkpoint. For LM the continuation follows the context directly; QA uses the
# checkpoint's template (Compressor.qa_parts) for all three rows.
#
# A lower loss with memory than without proves little: a learned constant prompt gets that too. So ae and
# lm also score, teacher-forced, the same targets after the memory of *another* text (a fixed derangement,
# text i reads the memory of text i+1): own / other < 1 means each memory carries its own text.

SEP = "\n\n"   # between the context and what follows it in the "full" row
MODES = ("compressed", "full", "none")

# Built-in data, so every task runs offline with no --data. Short on purpose (the tests run the
# tasks on CPU, and AE regenerates every text token by token) and held out from train.py's
# built-in texts.
BUILTIN_TEXTS = [
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

BUILTIN_QA = [
    dict(context=BUILTIN_TEXTS[0], question="When was the bridge finished?", answer="1932"),
    dict(context=BUILTIN_TEXTS[1], question="How do honeybees show where food is?",
         answer="by dancing"),
    dict(context=BUILTIN_TEXTS[2], question="What killed half of the tomatoes?",
         answer="a late frost"),
    dict(context=BUILTIN_TEXTS[3], question="On which day is the library closed?",
         answer="Sundays"),
    dict(context=BUILTIN_TEXTS[4], question="Which way does a comet's tail point?",
         answer="away from the Sun"),
]


def builtin_held_out(n=32):
    """The built-in texts of the ae and lm tasks: n documents of train.py's grammar drawn with another seed, none of
    them in train.py's built-in corpus (so a quickstart run is scored on texts it never saw)."""
    import train
    seen = set(train.generated_texts(train.BUILTIN_GENERATED, seed=0))
    return [t for t in train.generated_texts(n + 8, seed=1) if t not in seen][:n]


def load_examples(path, task, n=None):
    """The examples of a task: dicts with "text" (ae, lm, heatmap) or "context", "question",
    "answer" (qa; answer is a str or a list of accepted answers). No path: the built-in sets.
    path: .jsonl or .parquet, one record a row, as train.py reads them ({"text"} or
    {"context", "question", "answer"}; a QA record serves the text tasks through its context),
    or any other file as plain text, one text per non-empty line (train.py reads a whole .txt file
    as one document to draw windows from; an evaluation needs fixed examples). n: keep the first n."""
    if path is None:
        rows = [dict(r) for r in BUILTIN_QA] if task == "qa" else [{"text": t} for t in builtin_held_out()]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    elif path.endswith((".jsonl", ".parquet")):
        import train   # the one reader of .jsonl / .parquet records (its errors end the run with one line)
        rows = [rec for _, rec in train.records(path)]
        for r in rows:
            train.record_kind(r)   # SQuAD's "answers" -> "answer"
    else:
        with open(path, encoding="utf-8") as f:
            rows = [{"text": line.rstrip("\n")} for line in f if line.strip()]
    need = ("context", "question", "answer") if task == "qa" else ("text",)
    out = []
    for i, r in enumerate(rows, 1):
        if task != "qa" and isinstance(r, dict) and "text" not in r and "context" in r:
            r = {"text": r["context"]}
        if task == "qa" and isinstance(r, dict) and isinstance(r.get("answer"), dict):   # SQuAD {"text": [...]}
            r = {**r, "answer": list(r["answer"].get("text", []))}
        if not isinstance(r, dict) or any(k not in r for k in need):
            raise ValueError(f"--data {path} record {i} needs the fields {', '.join(need)} for --task {task}")
        out.append(r)
    if not out:
        raise ValueError(f"--data {path} holds no examples")
    return out[:n] if n else out


def protocol(comp, ckpt=None, max_len=None, train_args=None):
    """How the checkpoint was trained, so the evaluation cuts texts the same way (train.py's args, saved with
    it, or given as train_args by a run that scores itself): head crop -> every text is its first n tokens,
    padded with EOS to n, and regenerated up to n tokens (AOC code); pretrain -> AE reconstructs the first
    ⌊|X|/2⌋ tokens, what pretraining compressed (EPL code). max_len: cut every text to its first max_len tokens."""
    if train_args is None:
        train_args = (C.read_checkpoint_config(ckpt).get("train_args") or {}) if ckpt else {}
    crop = train_args.get("crop", "window")
    return dict(crop=crop, n=max_len or (train_args.get("max_len") if crop == "head" else None),
                half=train_args.get("objective") == "pretrain")


def texts_as_trained(comp, texts, proto):
    """(what is compressed, the reference) ids of each text under the checkpoint's protocol."""
    tok, pad = comp.tok, comp.tok.pad_id if comp.tok.pad_id is not None else comp.tok.eos_id
    out = []
    for text in texts:
        ids = tok.encode(text)
        if proto["crop"] == "head":   # AOC code: truncation + padding="max_length" with EOS; reference = first n
            ids = ids[:proto["n"]]
            out.append((ids + [pad] * (proto["n"] - len(ids)), ids))
            continue
        ids = ids[:proto["n"]] if proto["n"] else ids   # a text of at most n tokens, as training cut it
        if proto["half"]:             # EPL code: pretraining compressed x[:p], p = ⌊|X|/2⌋ of that text
            ids = ids[:max(1, len(ids) // 2)]
        out.append((ids, ids))
    return out


def batches(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


# -----------------------------------------------------------------------------
# ---- running the compressor and the plain LLM ----


def compress(comp, contexts, ratio=None, cache=None):
    """comp.compress with a fixed compression ratio for group merging: GMSA samples r per example while training
    (§4.1); an evaluation must be repeatable, so it uses --ratio, else the first of the preset's ratios (4x)."""
    ratios = [ratio or comp.cfg.ratios[0]] * len(contexts) if comp.cfg.source == "group_mean" else None
    return comp.compress(contexts, ratios=ratios, cache=cache)


class PlainLLM:
    """The references' LLM: the base model with no memory. Usually the compressor's own decoder with a shared
    encoder's LoRA switched off; after GMSA's KEFT (whose q/k/v are trained) a fresh copy of the base model."""

    def __init__(self, comp, dtype=torch.float32):
        self.tok, self.device = comp.tok, comp.device
        if comp.cfg.decoder_train == "keft":
            self.model, _ = load_pretrained(comp.cfg.model, dtype=dtype, device=comp.device)
            self.decoding = nullcontext
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


def summarize(rows, extra=None):
    """Per-example rows -> {"scores": {mode: mean scores}, "examples": rows} (+ the set-level numbers)."""
    return {"scores": {m: mean_scores([r[m]["scores"] for r in rows]) for m in MODES}, **(extra or {}),
            "examples": rows}


def memory_losses(rows):
    """Set-level teacher-forced losses (Σ NLL / Σ tokens, never a mean of per-example means) with the own
    memory, another text's memory and no memory, and own / other: 1.0 when a memory says nothing about its own
    text (a learned constant prompt), well below 1 when it carries it."""
    total = lambda key: sum(r["loss"][key][0] for r in rows) / max(1, sum(r["loss"][key][1] for r in rows))
    own, none = total("own"), total("none")
    other = total("other") if rows[0]["loss"]["other"] is not None else None
    full = {"full": total("full")} if "full" in rows[0]["loss"] else {}    # qa: the plain LLM with the context
    return {"loss": {"own": own, "other": other, "none": none, **full, "own_other_ratio": other and own / other,
                     "perplexity_own": math.exp(own), "tokens": sum(r["loss"]["own"][1] for r in rows)}}


def derangement(n):
    """The fixed derangement of the own/other test: text i reads the memory of text i + 1 (mod n); None for a
    single text, which has no other."""
    return [(i + 1) % n for i in range(n)] if n > 1 else None


# -----------------------------------------------------------------------------
# ---- ae, lm, qa ----


def ae_scores(hyp_ids, ref_ids, tok, epl=None):
    """Every reconstruction score of the papers for one regeneration (see the table at the top).
    epl: (hypothesis, reference) ids as EPL's evaluator compares them, generation incl. its EOS against
    [BOS] x [EOS] (the AE target); default the plain ids."""
    hyp_text, ref_text = tok.decode(hyp_ids), tok.decode(ref_ids)
    hyp_words, ref_words = word_tokens(hyp_text), word_tokens(ref_text)
    # AOC pretrain_and_eval.py post-processes both decoded texts before scoring: "\n" -> " ", strip
    aoc_hyp, aoc_ref = (text.replace("\n", " ").strip() for text in (hyp_text, ref_text))
    aoc_rouge = rouge_pltrdy(aoc_hyp, aoc_ref)
    epl_hyp, epl_ref = epl or (hyp_ids, ref_ids)
    return {
        "bleu4_ids": bleu4(epl_hyp, epl_ref),                       # EPL: token ids, no smoothing
        "bleu4_words": bleu4(hyp_words, ref_words, smooth=True),    # 500x / AOC: words, method1
        "prefix_em": prefix_em(hyp_ids, ref_ids),                   # AOC text, GMSA footnote 3
        "token_accuracy": token_accuracy(hyp_ids, ref_ids),         # AOC Eq. (6) as printed
        "rouge1": rouge_n_f1(hyp_words, ref_words, 1),              # rouge-score on word tokens
        "rouge2": rouge_n_f1(hyp_words, ref_words, 2),
        "rougeL": rouge_l_f1(hyp_words, ref_words),
        "aoc_em": aoc_exact_match(aoc_hyp, aoc_ref),                # AOC script: character prefix
        "aoc_rouge1": aoc_rouge["rouge-1"]["f"],                    # 500x / AOC scripts: rouge 1.0.1
        "aoc_rouge2": aoc_rouge["rouge-2"]["f"],
        "aoc_rougeL": aoc_rouge["rouge-l"]["f"],
    }


@torch.no_grad()
def run_ae(comp, examples, max_new_tokens=None, proto=None, batch_size=8, ratio=None, generate=True):
    """Reconstruction: compress each text, regenerate it greedily from its memory (ICAE's AE task, AOC §3,
    EPL Table 6), in batches. Default budget: n for a head-cropped checkpoint (AOC code), else the reference
    length + 8. Also the teacher-forced AE loss on the text and its EOS with the own memory, another text's
    memory and none (EPL Table 9 reports the AE loss and its perplexity). generate=False: the losses only
    ({"protocol", "loss"}, no regeneration), as recipes/curve.py scores every kept checkpoint."""
    tok, plain = comp.tok, PlainLLM(comp)
    proto = proto or protocol(comp)
    pairs = texts_as_trained(comp, [ex["text"] for ex in examples], proto)
    other = derangement(len(pairs))
    rows = []
    for idx in tqdm(batches(list(range(len(pairs))), batch_size), desc="ae", leave=False):
        xs, refs = [pairs[i][0] for i in idx], [pairs[i][1] for i in idx]
        n_new = max_new_tokens or (proto["n"] if proto["crop"] == "head" else max(len(r) for r in refs) + 8)
        own = compress(comp, [comp.encoder_ids(x) for x in xs], ratio)
        # targets: the AE target (comp.ae_target); the loss counts the text and its EOS, not a leading [BOS]
        follow, n_text = [comp.ae_target(x) for x in xs], [len(x) + 1 for x in xs]
        nll_own = comp.nll(own, "ae", follow, n_text)
        nll_other = ([None] * len(idx),) * 2
        if other:
            theirs = compress(comp, [comp.encoder_ids(pairs[other[i]][0]) for i in idx], ratio)
            nll_other = comp.nll(theirs, "ae", follow, n_text)
        nll_none = plain.nll([[tok.start_id]] * len(xs), [x + [tok.eos_id] for x in xs])
        outs = {"compressed": comp.generate(own, "ae", max_new_tokens=n_new),
                "full": plain.generate([[tok.start_id] + x + tok.encode(SEP) for x in xs], n_new),
                "none": plain.generate([[tok.start_id]] * len(xs), n_new)} if generate else {}
        for j, i in enumerate(idx):
            row = {"text": examples[i]["text"], "reference": tok.decode(refs[j]), "reference_ids": refs[j],
                   "memory_slots": sum(own.mem_counts[j]),
                   "loss": {"own": (nll_own[0][j], nll_own[1][j]),
                            "other": other and (nll_other[0][j], nll_other[1][j]), "none": nll_none[j]}}
            for mode, gen in outs.items():
                ids = gen[j]
                stopped = ids + [tok.eos_id] if len(ids) < n_new else ids   # EPL keeps the EOS it generated
                row[mode] = {"text": tok.decode(ids), "ids": ids,
                             "scores": ae_scores(ids, refs[j], tok, epl=(stopped, comp.ae_target(refs[j])))}
            rows.append(row)
    losses = {"protocol": proto, **memory_losses(rows)}
    return summarize(rows, losses) if generate else losses


@torch.no_grad()
def run_lm(comp, examples, batch_size=8, ratio=None, max_len=None):
    """Completion: cut each text at p = ⌊|X|/2⌋ (EPL §4.1), compress the first half and score the second half
    and EOS (the LM target of the EPL and PCC code) given that memory (PIC Eq. 7, EPL Table 4), the memory of
    another text's first half, the full first half, or nothing. Perplexity is exp(Σ NLL / Σ tokens) over the
    whole set, never a mean of per-example perplexities. max_len: each text cut to its first max_len tokens
    first, as pretraining cut it."""
    tok, plain = comp.tok, PlainLLM(comp)
    cuts = []
    for ex in examples:
        ids = tok.encode(ex["text"])[:max_len]
        if len(ids) < 4:
            raise ValueError(f"text too short for the LM task ({len(ids)} tokens): {ex['text']!r}")
        cuts.append((ids[:len(ids) // 2], ids[len(ids) // 2:] + [tok.eos_id]))
    other = derangement(len(cuts))
    rows = []
    for idx in tqdm(batches(list(range(len(cuts))), batch_size), desc="lm", leave=False):
        ctx, cont = [cuts[i][0] for i in idx], [cuts[i][1] for i in idx]
        own = compress(comp, [comp.encoder_ids(c) for c in ctx], ratio)
        last = lambda cs: [c[-1] for c in cs]
        nll_own = comp.nll(own, "lm", cont, last_tokens=last(ctx))
        nll_other = ([None] * len(idx),) * 2
        if other:
            theirs_ctx = [cuts[other[i]][0] for i in idx]
            theirs = compress(comp, [comp.encoder_ids(c) for c in theirs_ctx], ratio)
            nll_other = comp.nll(theirs, "lm", cont, last_tokens=last(theirs_ctx))
        nlls = {"compressed": list(zip(*nll_own)), "other": [other and x for x in zip(*nll_other)],
                "full": plain.nll([[tok.start_id] + c for c in ctx], cont),
                "none": plain.nll([[tok.start_id]] * len(idx), cont)}
        for j, i in enumerate(idx):
            row = {"text": examples[i]["text"], "context_tokens": len(ctx[j]), "memory_slots": sum(own.mem_counts[j]),
                   "loss": {"own": nlls["compressed"][j], "other": nlls["other"][j], "none": nlls["none"][j]}}
            for mode in MODES:
                nll, n = nlls[mode][j]
                row[mode] = {"nll": nll, "tokens": n, "perplexity": perplexity(nll, n)}
            rows.append(row)
    scores = {}
    for mode in MODES:
        nll, n = sum(r[mode]["nll"] for r in rows), sum(r[mode]["tokens"] for r in rows)
        scores[mode] = {"perplexity": perplexity(nll, n), "nll": nll, "tokens": n}
    return {"scores": scores, **memory_losses(rows), "examples": rows}


# CompLLM's multiple-choice scoring: the prompt asks the model to end with "the answer is (X)" (App. A.1)
ANSWER_IS = re.compile(r"the answer is \(?([A-Z])\)?", re.IGNORECASE)


def answer_letter(text):
    """The letter X of the last "the answer is (X)" in a generation (CompLLM), or None."""
    found = ANSWER_IS.findall(text)
    return found[-1].upper() if found else None


def qa_scores(prediction, answers):
    """Every QA score of the papers for one prediction, the whole generation up to EOS (answers: a str or a
    list of str). A single-letter answer (multiple choice) is also scored by CompLLM's regex."""
    scores = {
        "squad_f1": squad_f1(prediction, answers), "squad_em": squad_em(prediction, answers),   # PCC/PIC, GMSA
        "exact_match": exact_match(prediction, answers),                                        # 500x/AOC
        "token_f1": token_f1(prediction, answers),                                              # 500x/AOC
        "substring_acc": substring_acc(prediction, answers),                                    # GMSA "Acc"
        "rouge1": max(rouge_n_f1(word_tokens(prediction), word_tokens(a), 1)                    # rouge-score,
                      for a in _references(answers)),                                           # max over refs
        "epl_f1": epl_qa_f1(prediction, answers), "epl_em": epl_qa_em(prediction, answers),     # EPL, answers[0]
    }
    refs = [a.strip() for a in _references(answers)]
    if refs and all(len(a) == 1 and a.isalpha() for a in refs):
        scores["mc_accuracy"] = float(answer_letter(prediction) in {a.upper() for a in refs})   # CompLLM
    return scores


# the papers' QA generation budgets (new tokens), per preset
QA_BUDGET = {"pcc": 30, "pic": 30,          # PCC evaluate_qa.py
             "compllm": 512,                # CompLLM: answers of 149-273 tokens on average
             "icae": 1024, "500x": 1024}    # EPL's evaluator (generate_num)


def concatenated(examples, k):
    """CompLLM §4 (after LOFT): the contexts of k examples joined into one, each question then asked
    against that longer context (one question per document, so the relevant one sits anywhere)."""
    out = []
    for group in batches(examples, k):
        context = SEP.join(ex["context"] for ex in group)
        out += [{**ex, "context": context, "documents": len(group)} for ex in group]
    return out


@torch.no_grad()
def run_qa(comp, examples, max_new_tokens=None, batch_size=8, ratio=None, concat=1, reuse=True, max_len=None,
           generate=True, score=qa_scores, losses=True):
    """Answer from memory + question (PIC/PCC SQuAD, EPL, CompLLM, GMSA KEFT), with the checkpoint's template
    (Compressor.qa_parts) in all three rows. The whole generation up to EOS is scored, as the papers' scripts
    do, by score(generation, answer) -> {name: value} (default qa_scores; the needle task scores the passkey).
    concat > 1: CompLLM's long contexts. reuse: a chunk's memory is computed once and kept (CompLLM's
    reusability), so a context shared by several questions is compressed once; False compresses every time.
    losses: also the teacher-forced loss of the reference answer (the first, QA training's target, without its
    EOS) after the question's own memory, another document's memory, no context and the full context (ours: the
    papers score generations only): own / other well below 1 means each memory carries its own context.
    max_len: contexts cut to their first max_len tokens, as QA training cuts them. generate=False: the losses
    only ({"loss"}), as train.py's held-out check scores itself."""
    tok, plain = comp.tok, PlainLLM(comp)
    n_new = max_new_tokens or QA_BUDGET.get(comp.cfg.method, 64)
    examples = concatenated(examples, concat) if concat > 1 else examples
    # a chat template carries its own start; otherwise the plain LLM's prompt starts with BOS
    lead = [] if comp.template()[0] else [tok.start_id]
    parts = [comp.qa_parts(ex["context"], ex["question"]) for ex in examples]
    if max_len:   # train.py draw_qa: contexts cut at --max-len
        parts = [{**p, "enc_context": p["enc_context"][:max_len], "dec_context": p["dec_context"][:max_len]}
                 for p in parts]
    answers = [tok.encode(_references(ex["answer"])[0]) for ex in examples]
    # the fixed derangement over documents: question i reads the memory of question i + concat's context (the
    # next document; the concat questions of one long context share it); None when there is one document
    n = len(examples)
    other = [(i + concat) % n for i in range(n)] if n > concat else None
    cache, rows = ({} if reuse else None), []
    for idx in tqdm(batches(list(range(n)), batch_size), desc="qa", leave=False):
        ps, ans = [parts[i] for i in idx], [answers[i] for i in idx]
        prefix, prompt = [p["prefix"] for p in ps], [p["prompt"] for p in ps]
        memory = compress(comp, [p["enc_context"] for p in ps], ratio, cache=cache)
        full = [lead + p["prefix"] + p["dec_context"] + p["prompt"] for p in ps]    # the plain LLM's prompts
        none = [lead + p["prefix"] + p["prompt"] for p in ps]
        follow, n_ans = [q + a for q, a in zip(prompt, ans)], [len(a) for a in ans]
        nll = {}
        if losses:
            nll = {"own": list(zip(*comp.nll(memory, "qa", follow, n_ans, prefix=prefix))),
                   "other": [None] * len(idx), "none": plain.nll(none, ans), "full": plain.nll(full, ans)}
            if other:
                theirs = compress(comp, [parts[other[i]]["enc_context"] for i in idx], ratio, cache=cache)
                nll["other"] = list(zip(*comp.nll(theirs, "qa", follow, n_ans, prefix=prefix)))
        outs = {"compressed": comp.generate(memory, "qa", prompt=prompt, max_new_tokens=n_new, prefix=prefix),
                "full": plain.generate(full, n_new), "none": plain.generate(none, n_new)} if generate else {}
        for j, i in enumerate(idx):
            ex = examples[i]
            row = {"context": ex["context"], "question": ex["question"], "answer": ex["answer"],
                   "memory_slots": sum(memory.mem_counts[j])}
            if losses:
                row["loss"] = {k: v[j] for k, v in nll.items()}
            for mode, gen in outs.items():
                text = tok.decode(gen[j])
                row[mode] = {"text": text, "scores": score(text, ex["answer"])}
            rows.append(row)
    if not generate:
        return memory_losses(rows)
    return summarize(rows, {"max_new_tokens": n_new, "concat": concat, "reuse": reuse,
                            **(memory_losses(rows) if losses else {})})


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
    if result["task"] == "ae":   # a few texts next to what the decoder regenerated from their memory
        shown = [[repr(ex["reference"][:160]), repr(ex["compressed"]["text"][:160])] for ex in result["examples"][:3]]
        table += "\n\n" + markdown_table(["held-out text", "regenerated from its memory"], shown)
    return table


# -----------------------------------------------------------------------------
# ---- speed ----
# CompLLM §3 "complexity": compressing independent segments of S tokens costs O(N·S), linear in the
# context length N; the decoder's prefill costs O(N²) with the full context and O(N²/C²) with the
# concept embeddings, so the time-to-first-token (TTFT) speedup tends to C² for long contexts and
# the KV cache shrinks by C. We time, at each context length:
#
#     compress      encoder forward (+ segmentation, bridge): the cost of making the memory
#     ttft_full     decoder prefill over [BOS, context, question] + the first token's logits
#     ttft_comp     decoder prefill over [memory, special, question] + the first token's logits
#     decode        per-token time of greedy steps with either KV cache
#
# offline speedup = ttft_full / ttft_comp (memory cached, e.g. a document queried many times);
# online speedup = ttft_full / (compress + ttft_comp) (compressed on the fly).

SPEED_QUESTION = " Question: What is this text about? Answer:"
SPEED_LENGTHS = (512, 1024, 2048, 4096, 8192)   # default --lengths


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()   # CUDA kernels run asynchronously: wait before reading the clock


def timed(fn, device, repeats=3, warmup=1):
    """(median wall time in seconds over `repeats` calls after `warmup` untimed calls, last result)."""
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def compressed_inputs(comp, memory, prompt):
    """Decoder inputs [memory, special token, prompt] for one sample, as comp.generate builds them."""
    batch = comp.decoder_batch(memory, "qa", [prompt], [0])
    # one unpadded sample: decoder_batch passes no mask, so SDPA takes the same fused causal kernel as
    # the full-context prefill (a dense mask would time a slower kernel)
    assert batch["attn_mask"] is None
    return batch


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
    text = tok.encode(" ".join(BUILTIN_TEXTS) + " ")
    rows, stopped = [], None
    for T in tqdm(lengths, desc="speed", leave=False):
        ctx = (text * (T // len(text) + 1))[:T]          # the built-in texts repeated to T tokens
        try:
            enc = comp.encoder_ids(ctx)
            t_comp, memory = timed(lambda: compress(comp, [enc]), dev, repeats)
            # CompLLM §1 "reusability": the same context again, its chunks' memories already cached
            cache = {}
            compress(comp, [enc], cache=cache)
            t_cached, _ = timed(lambda: compress(comp, [enc], cache=cache), dev, repeats)
            M = sum(memory.mem_counts[0])
            full = dict(input_ids=torch.tensor([[tok.start_id] + ctx + question], device=dev))
            t_full, (kv_full, first_full) = timed(lambda: prefill(comp, full), dev, repeats)
            mem_in = compressed_inputs(comp, memory, question)
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
    lines = [markdown_table(header, rows), "",
             "time ~ length^k: " + ", ".join(f"{k[:-2]} k={e[k]:.2f} (longest two: {t[k]:.2f})" for k in e),
             f"TTFT speedup at {rows[-1][0]} tokens: {result['rows'][-1]['speedup_offline']:.2f} of the "
             f"(N/M)^2 = C^2 = {result['ttft_bound_c2']:.3g} bound ({100 * result['ttft_ratio_of_bound']:.0f}%)"
             + (f"; nominal C^2 = {result['nominal_c2']:g} "
                f"({100 * result['rows'][-1]['speedup_offline'] / result['nominal_c2']:.0f}%)"
                if result["nominal_c2"] else "")]
    if result["stopped"]:
        lines.append(f"stopped: {result['stopped']}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# ---- interpolate (AOC Eq. 5) ----

DEFAULT_TEXT0 = "We present an awesome new idea."
DEFAULT_TEXT1 = "Large planets may have many moons."
DEFAULT_WEIGHTS = "0,0.25,0.5,0.53,0.55,0.6,0.75,1"   # AOC Table 4 shows w = 0.5, 0.53, 0.55 and 0.6


@torch.no_grad()
def run_interpolate(comp, text0, text1, weights, max_new_tokens=None, proto=None):
    """AOC Eq. (5): regenerate from Z = Z0 + w (Z1 − Z0) for each w, where Z0, Z1 compress text0,
    text1 (AOC Table 4 walks from one prompt to the other). Every tensor the decoder reads is mixed
    (memory embeddings, or every layer's K and V); the rest of the memory (chunk lengths, hence the
    EPL decoder positions) is Z0's. Needs memories of the same shape: always true for a fixed --mem
    budget and texts of at least --mem tokens, but methods that size memory by length (CompLLM,
    PCC/PIC, GMSA) need texts that compress to the same number of slots. A head-cropped checkpoint (AOC)
    compresses each prompt padded with EOS to the trained length n, as AOC's compress() does, so the memory
    and [BOS] sit where training put them."""
    tok = comp.tok
    (x0, ids0), (x1, ids1) = texts_as_trained(comp, [text0, text1], proto or protocol(comp))
    z0, z1 = compress(comp, [comp.encoder_ids(x0)]), compress(comp, [comp.encoder_ids(x1)])
    m0, m1 = sum(z0.mem_counts[0]), sum(z1.mem_counts[0])
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
    """Cosine similarity [M, T] between each memory slot and each context token, in the space the
    decoder reads them in.
      embeds carrier: the memory vector (after the bridge) vs the decoder's input embedding of the
          token (PIC Figure 3: do the memory vectors look like the tokens they stand for?);
      kv carrier: the memory's last-layer keys vs the keys the frozen decoder computes for the plain
          context in its last layer (heads concatenated): the cache entries the memory replaces. Keys
          carry RoPE at their own positions, so this cosine mixes content with relative position."""
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
    """(memory, attention [M, T]): how much each memory slot attends to each context token in the
    encoder, averaged over all layers and heads (PIC Figure 7; EPL Figure 6).

    The weights are recomputed from each layer's own inputs, captured with a forward pre-hook on its
    self_attn during a normal comp.compress: softmax(q kᵀ / √D) under the encoder's mask (causal, PIC
    or segment). A memory row does not sum to 1 over the context: the rest of its weight goes to the
    memory tokens before it (and to itself). Memory of chunk c sees only chunk c, so the matrix is
    block-diagonal over chunks. Group merging (GMSA) has no memory tokens, hence no such attention:
    returns (memory, None)."""
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
    probs = 0
    for attn, x, cos, sin, mask in calls:
        R, T, _ = x.shape
        H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
        q = attn.q_proj(x).view(R, T, H, D)                         # (R, T, H, D)
        k = attn.k_proj(x).view(R, T, Hkv, D)                       # (R, T, Hkv, D)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)                 # (R, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)                 # (R, Hkv, T, D)
        # GQA: query head h reads K/V head h // (H/Hkv), so repeat each K/V head H/Hkv times
        k = k.repeat_interleave(H // Hkv, dim=1)                    # (R, H, T, D)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)   # (R, H, T, T)
        if mask is None:
            mask = masks.causal(T).to(x.device)   # the layer ran plain causal (no explicit mask)
        probs = probs + scores.masked_fill(~mask, float("-inf")).softmax(-1).mean(1)  # (R, T, T)
    probs = probs / len(calls)
    # one encoder row per chunk, laid out [chunk (n), memory (m), padding]: gather memory -> context
    lens, counts = memory.chunk_lens[0], memory.mem_counts[0]
    out = torch.zeros(sum(counts), sum(lens))
    row0 = col0 = 0
    for r, (n, m) in enumerate(zip(lens, counts)):
        out[row0:row0 + m, col0:col0 + n] = probs[r, n:n + m, :n].cpu()
        row0, col0 = row0 + m, col0 + n
    return memory, out[:, 1:] if comp.cfg.bos else out   # the columns of the text itself, not a leading [BOS]


def pyplot(path):
    """matplotlib.pyplot on its file-only Agg backend, or None when matplotlib is not installed: figures are
    optional (the numbers they draw are in the results either way), so a missing matplotlib skips the figure at
    `path` with one line that says how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"figure {path} skipped: matplotlib is not installed (pip install matplotlib, then run again)",
              file=sys.stderr)
        return None
    return plt


def heat_png(path, values, title, xlabel, ylabel):
    """A [rows, cols] matrix as a PNG heatmap ("hot" colour map, one cell per entry, a colour bar); returns the
    path, or None when the figure was skipped (no matplotlib)."""
    plt = pyplot(path)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    im = ax.imshow(np.asarray(values, dtype=np.float64), aspect="auto", cmap="hot", interpolation="nearest")
    fig.colorbar(im, ax=ax)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


RAMP = " .:-=+*#%@"   # text heatmap: low to high


def render_text(values, max_cols=96, max_rows=48):
    """A text heatmap, one character per cell by min-max scaled intensity; rows and columns beyond
    max_rows / max_cols are averaged into bins so it fits a terminal."""
    v = np.asarray(values, dtype=np.float64)
    for axis, limit in ((0, max_rows), (1, max_cols)):
        if v.shape[axis] > limit:
            bins = np.array_split(np.arange(v.shape[axis]), limit)
            v = np.stack([v.take(b, axis=axis).mean(axis=axis) for b in bins], axis=axis)
    lo, hi = v.min(), v.max()
    x = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    idx = np.minimum((x * len(RAMP)).astype(int), len(RAMP) - 1)
    return "\n".join(f"{i:4d} |" + "".join(RAMP[j] for j in row) + "|" for i, row in enumerate(idx))


@torch.no_grad()
def run_heatmap(comp, text, png_stem):
    """Cosine map and encoder attention map for one text; PNGs at png_stem + _cosine.png / _attention.png."""
    ids = comp.tok.encode(text)
    enc = comp.encoder_ids(ids)
    memory, attention = encoder_attention(comp, enc)
    cosine = memory_cosine(comp, memory, ids).float().cpu()   # to the host for numpy and the PNGs
    attention = None if attention is None else attention.float().cpu()
    M, T = cosine.shape
    out = {"text": text, "tokens": ids, "encoder_tokens": enc, "memory_slots": M,
           "cosine": cosine.tolist(), "attention": None, "attention_png": None}
    name = comp.cfg.method
    out["cosine_png"] = heat_png(f"{png_stem}_cosine.png", cosine.numpy(), f"{name}: cosine(memory slot, context "
                                 "token)", "context token", "memory slot")
    if attention is not None:
        out["attention"] = attention.tolist()
        out["attention_png"] = heat_png(f"{png_stem}_attention.png", attention.numpy(), f"{name}: encoder "
                                        "attention, memory -> context", "context token", "memory slot")
    else:
        out["attention_note"] = f"{comp.cfg.method} merges hidden states into groups: no memory tokens attend"
    return out


def report_heatmap(result):
    parts = [f"cosine(memory slot, context token): {result['cosine_png']}", render_text(result["cosine"])]
    if result["attention"] is not None:
        parts += [f"encoder attention memory -> context: {result['attention_png']}", render_text(result["attention"])]
    else:
        parts.append(f"attention: {result['attention_note']}")
    return "\n".join(parts)


# -----------------------------------------------------------------------------
# ---- curves (EPL Fig. 4, PIC Fig. 5, GMSA Fig. 5: loss against steps) ----


def ema(values, alpha):
    """Exponential moving average, debiased like Adam's so the first points are not pulled towards 0."""
    out, m = [], 0.0
    for t, v in enumerate(values, 1):
        m = alpha * v + (1 - alpha) * m
        out.append(m / (1 - (1 - alpha) ** t))
    return out


def run_curves(runs, key="loss", target=None, alpha=0.05, png=None):
    """The training logs (log.jsonl) of several runs: each one's loss curve with an EMA on one figure, and the
    step at which each EMA first reaches `target` (default: the highest of the runs' best EMAs, a loss every
    run reaches), with the tokens and wall time it took to get there."""
    curves = []
    for run in runs:
        path = os.path.join(run, "log.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--runs {run}: no log.jsonl (pass train.py --out directories)")
        rows = [json.loads(line) for line in open(path) if line.strip()]
        rows = [r for r in rows if key in r]
        if not rows:
            raise ValueError(f"--runs {run}: its log has no '{key}' values")
        method = (json.load(open(os.path.join(run, "args.json"))) if os.path.isfile(os.path.join(run, "args.json"))
                  else {}).get("method", "?")
        curves.append(dict(run=run, method=method, steps=[r["step"] for r in rows], raw=[r[key] for r in rows],
                           smooth=ema([r[key] for r in rows], alpha), tokens=np.cumsum([r["tokens"] for r in rows]),
                           seconds=np.cumsum([r["dt"] for r in rows])))
    target = target if target is not None else max(min(c["smooth"]) for c in curves)
    out = []
    for c in curves:
        hit = next((i for i, v in enumerate(c["smooth"]) if v <= target), None)
        out.append(dict(run=c["run"], method=c["method"], last_step=c["steps"][-1], final_ema=c["smooth"][-1],
                        best_ema=min(c["smooth"]),
                        reached=None if hit is None else dict(step=c["steps"][hit], tokens=int(c["tokens"][hit]),
                                                              seconds=float(c["seconds"][hit]))))
    plt = pyplot(png) if png else None
    png = png if plt else None   # the figure is skipped without matplotlib; the table stands
    if plt:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in curves:
            name = os.path.basename(os.path.normpath(c["run"]))
            line, = ax.plot(c["steps"], c["smooth"], label=name)
            ax.plot(c["steps"], c["raw"], color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set(xlabel="step", ylabel=f"{key} (EMA {alpha:g})", title=f"training {key}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)
    return {"key": key, "target": target, "ema_alpha": alpha, "png": png, "runs": out}


def report_curves(result):
    rows = [[os.path.basename(os.path.normpath(r["run"])), r["method"], r["last_step"], r["final_ema"],
             r["best_ema"]] + ([r["reached"]["step"], r["reached"]["tokens"], r["reached"]["seconds"]]
                               if r["reached"] else ["-", "-", "-"]) for r in result["runs"]]
    return (markdown_table(["run", "method", "steps", f"final {result['key']} (EMA)", "best (EMA)",
                            f"step to {result['target']:.3g}", "tokens", "seconds"], rows)
            + (f"\n\nfigure: {result['png']}" if result["png"] else ""))


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


def passkey_score(generation, passkey):
    """Exact match of the number: 1.0 when the passkey is one of the numbers in the generation, 0.0 when it is
    not (another number, no number, or the passkey inside a longer number)."""
    return {"passkey": float(passkey in re.findall(r"\d+", generation))}


def find(ids, part):
    """Where the token list `part` first occurs in `ids`, or -1."""
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part), -1)


def haystack(tok, documents, length, depth, key, rng):
    """One needle sample: at most `length` tokens of whole sentences from `documents` (lists of sentences, taken in
    an order drawn from rng), the needle of `key` at the sentence boundary nearest `depth`. Returns the context,
    its length in tokens, the token index at which the needle starts, and the depth it landed at."""
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
    at = find(ids, part)
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
def run_needle(comp, examples, lengths=None, n=None, seed=0, max_new_tokens=None, batch_size=8, ratio=None,
               png=None):
    """Passkey retrieval at each depth x length, scored in the three rows of run_qa (without its losses, which
    need a reference answer shared by the rows). Lengths count the context's tokens, needle included; the plain
    LLM's prompt adds the template, the question and the answer, and must fit the model's positions."""
    n_new = max_new_tokens or NEEDLE_BUDGET
    parts = comp.qa_parts("", NEEDLE_QUESTION)   # the template around an empty context
    extra = 1 + len(parts["prefix"]) + len(parts["dec_context"]) + len(parts["prompt"]) + n_new   # + BOS, answer
    max_pos = comp.decoder.config.max_position_embeddings
    lengths = lengths or [L for L in NEEDLE_LENGTHS if L + extra <= max_pos] or [max_pos - extra]
    if max(lengths) + extra > max_pos:
        raise ValueError(f"--lengths {max(lengths)} is beyond the model's {max_pos} positions (with the template, "
                         f"question and answer, {extra} tokens): use lengths up to {max_pos - extra}")
    samples = needle_examples(comp.tok, [ex["text"] for ex in examples], lengths, n or NEEDLE_N, seed)
    result = run_qa(comp, samples, n_new, batch_size, ratio, reuse=False, score=passkey_score, losses=False)
    for row, sample in zip(result["examples"], samples):   # run_qa keeps the order: add where each needle landed
        row.update((k, sample[k]) for k in ("length", "depth", "context_tokens", "needle_at", "landed_depth"))
    result.update(seed=seed, n=n or NEEDLE_N, depths=list(DEPTHS), lengths=lengths,
                  grid=needle_grid(result["examples"], lengths))
    result["png"] = needle_png(png, result, comp.cfg.method) if png else None
    return result


def needle_png(path, result, name):
    """The three grids side by side, depth on y and length on x, red (0) to green (1) as the long-context papers
    draw them; returns the path, or None when matplotlib is missing."""
    plt = pyplot(path)
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(MODES), figsize=(4 * len(MODES), 3.6), sharey=True, layout="constrained")
    for ax, mode in zip(axes, MODES):
        im = ax.imshow(np.asarray(result["grid"][mode]), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set(title=mode, xlabel="context length (tokens)", xticks=range(len(result["lengths"])),
               xticklabels=result["lengths"], yticks=range(len(result["depths"])),
               yticklabels=[f"{d:.0%}" for d in result["depths"]])
    axes[0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes, label="passkey retrieved (fraction)")
    fig.suptitle(f"{name}: passkey retrieval, {result['n']} samples per cell")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report_needle(result):
    header = ["depth \\ length"] + [str(L) for L in result["lengths"]]
    tables = [f"{mode}: fraction of the {result['n']} samples per cell that gave the passkey\n\n" + markdown_table(
        header, [[f"{d:.0%}"] + row for d, row in zip(result["depths"], result["grid"][mode])]) for mode in MODES]
    return "\n\n".join(tables) + (f"\n\nfigure: {result['png']}" if result["png"] else "")


# -----------------------------------------------------------------------------
# ---- command line ----

TASKS_HELP = """\
tasks:
  ae           reconstruction: compress each text, regenerate it greedily from its memory. Scores:
               bleu4_ids (EPL: token ids, no smoothing), bleu4_words (500x/AOC: words, smoothing
               method1), prefix_em (AOC text, GMSA), token_accuracy (AOC Eq. 6 as printed),
               rouge1/rouge2/rougeL (words).
  lm           completion: cut each text at p = len/2 (EPL) and report the perplexity of the second
               half given the memory of the first.
  qa           question answering from memory + question (built-in: 5 triples). Scores: squad_f1,
               squad_em (PCC/PIC, GMSA), exact_match, token_f1 (500x/AOC), substring_acc (GMSA Acc),
               rouge1 (EPL's F1).
  needle       passkey retrieval (Mohtashami & Jaggi 2023): "The pass key is 71432. Remember it.
               71432 is the pass key." hidden at depths 0/25/50/75/100% of haystacks of held-out
               texts (--data) at each --lengths (context tokens; default 256..4096, those the model's
               positions allow), at the sentence boundary nearest the depth; asked "What is the pass
               key?" with the QA template. Score: the passkey among the numbers generated. A depth x
               length grid per row, --n samples per cell (default 5), --seed draws passkeys and
               haystacks; a PNG next to --out.
               ae, lm, qa and needle also score two references with the plain LLM: "full" (the whole
               context in its prompt: upper bound) and "none" (no context: lower bound).
  speed        at each --lengths context length: compression time, time to first token with and
               without compression (offline: memory cached; online: compression included), decode
               time per token, KV-cache bytes; fits time ~ length^k (CompLLM: compression linear,
               prefill quadratic) and compares the TTFT speedup with its C^2 bound. Runs untrained
               compressors too: --method M --model tiny instead of --ckpt.
  interpolate  AOC Eq. 5: regenerate from Z0 + w (Z1 - Z0) for each --weights w, Z0 and Z1 the
               memories of --text0 and --text1.
  heatmap      for --text0 (default: the first text): cosine similarity of each memory slot with each
               context token, and the encoder's memory -> context attention (mean over layers and
               heads; none for gmsa, which has no memory tokens). PNGs next to --out, text on stdout.
  curves       --runs DIR [DIR ...]: the runs' training loss (--key, e.g. ae or lm) with an EMA on one
               PNG, and the step, tokens and seconds at which each EMA first reaches --target-loss
               (default: a loss every run reaches). Needs matplotlib for the figure.

ae and lm also report, teacher-forced, the loss with each text's own memory, with another text's
memory (text i reads the memory of text i+1) and with none: own/other well below 1 means each memory
carries its own text, 1.0 means it is a constant prompt. A checkpoint trained with a head crop (AOC)
is evaluated on the first n tokens of each text, padded as in training; one pretrained with AE + LM
(EPL) reconstructs the first half of each text, what pretraining compressed.

Results go to --out (default: CKPT/eval_TASK.json), a markdown table to stdout.
Built-in data is used when --data is not given (.jsonl or .parquet with {"text"} or {"context",
"question","answer"} records, or plain text with one text per line)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SystemExit(f"error: {message}")   # one line, no usage dump, no traceback


def parse_args(argv=None):
    p = _Parser(prog="evaluate.py", description="Evaluate a context compressor.", epilog=TASKS_HELP,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="checkpoint directory written by train.py --out")
    p.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)} (see below)")
    p.add_argument("--method", help=f"without --ckpt (speed only): an untrained preset, {', '.join(C.METHODS)}")
    p.add_argument("--model", help="base LLM (HF id, directory or tiny); with --ckpt it must match the checkpoint's")
    p.add_argument("--shape", choices=tuple(SHAPES), help="speed without --ckpt: a random model of this paper "
                   "model's shape instead of --model (no download; times depend on the shape alone)")
    p.add_argument("--data", help="examples (.jsonl, .parquet or .txt); default: the built-in sets")
    p.add_argument("--n", type=int, help=f"use the first N examples (default: all); needle: samples per depth and "
                   f"length (default {NEEDLE_N})")
    p.add_argument("--batch-size", type=int, default=8, help="ae, lm, qa, needle: examples per batch (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="generation budget (default: ae n for a head-cropped "
                   "checkpoint, else reference + 8; qa the paper's: PCC 30, CompLLM 512, EPL 1024, else 64; "
                   f"needle {NEEDLE_BUDGET}; speed 16 timed decode steps)")
    p.add_argument("--max-len", type=int, help="ae, lm, interpolate: cut texts to their first N tokens; qa: cut "
                   "contexts (default: the checkpoint's n when it was trained with --crop head; train.py's held-out "
                   "check cuts at the run's --max-len, as training does)")
    p.add_argument("--ratio", type=int, help="group merging (GMSA): the compression ratio r (group size) to evaluate "
                   "at, one of train.py's --ratios (default: the preset's first, 4)")
    p.add_argument("--concat", type=int, default=1, help="qa: join the contexts of K examples into one long "
                   "context and ask each question against it (CompLLM §4); default 1")
    p.add_argument("--no-reuse", action="store_true", help="qa: compress every context anew (default: a chunk's "
                   "memory is kept and reused, CompLLM's reusability)")
    p.add_argument("--lengths", help="speed, needle: context lengths in tokens, comma-separated (default: speed "
                   f"{','.join(map(str, SPEED_LENGTHS))}; needle those of {','.join(map(str, NEEDLE_LENGTHS))} the "
                   "model's positions allow)")
    p.add_argument("--seed", type=int, default=0, help="needle: seeds the passkeys and the haystacks (default 0)")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS, help=f"interpolate: values of w (default {DEFAULT_WEIGHTS})")
    p.add_argument("--runs", nargs="+", help="curves: run directories (train.py --out)")
    p.add_argument("--key", default="loss", help="curves: the logged value to plot (loss, ae, lm, qa, distill)")
    p.add_argument("--target-loss", type=float, help="curves: the loss to reach (default: one every run reaches)")
    p.add_argument("--text0", help=f"interpolate: first prompt (default {DEFAULT_TEXT0!r}); heatmap: the text")
    p.add_argument("--text1", help=f"interpolate: second prompt (default {DEFAULT_TEXT1!r})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", help="JSON results file (default CKPT/eval_TASK.json, or eval_speed_METHOD.json)")
    args = p.parse_args(argv)
    if args.task not in TASKS:
        raise SystemExit(f"error: unknown task '{args.task}': choose one of {', '.join(TASKS)}")
    if args.task == "curves":
        if not args.runs:
            raise SystemExit("error: --task curves needs --runs DIR [DIR ...]")
        return args
    if args.ckpt is None and (args.method is None or args.task != "speed"):
        raise SystemExit(f"error: --task {args.task} needs --ckpt DIR (only speed runs an untrained compressor, "
                         "with --method M [--model tiny])")
    if args.shape and (args.ckpt is not None or args.model is not None):
        raise SystemExit("error: --shape replaces --model and needs no --ckpt (speed with --method M only)")
    for name in ("n", "max_new_tokens", "batch_size", "max_len", "ratio", "concat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no CUDA device is available: use --device cpu")
    args.dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
    return args


def load_compressor(args):
    """The checkpoint's compressor, or (speed without --ckpt) an untrained preset; one-line errors."""
    dtype = DTYPES[args.dtype]
    if args.ckpt is None:
        decoder, tok = (build_shape(args.shape, args.device, dtype) if args.shape else
                        load_pretrained(args.model or "tiny", dtype=dtype, device=args.device))
        return C.build(args.method, decoder, tok).eval()
    cfg = C.read_checkpoint_config(args.ckpt).get("config")
    if not isinstance(cfg, dict) or "method" not in cfg or "model" not in cfg:
        raise ValueError(f"'{args.ckpt}/compressor.json' has no compressor config: restore it or retrain")
    if args.model is not None and args.model != cfg["model"]:
        raise ValueError(f"checkpoint '{args.ckpt}' was trained on model '{cfg['model']}', not '{args.model}'")
    if args.method is not None and args.method != cfg["method"]:
        raise ValueError(f"checkpoint '{args.ckpt}' holds method '{cfg['method']}', not '{args.method}'")
    try:
        comp = C.load(args.ckpt, dtype=dtype, device=args.device)
    except (ValueError, TypeError) as e:   # TypeError: a config field this code does not know
        raise ValueError(f"cannot load checkpoint '{args.ckpt}' on its base model '{cfg['model']}': {e}") from None
    return comp.eval()


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows])


class Task(NamedTuple):
    """One evaluation task: what it reads, how it runs from the command line's arguments, how stdout shows it."""
    examples: bool      # reads held-out examples (--data, --n)
    run: object         # (args, comp, examples, proto, out) -> result dict; comp is None for a task without a model
    report: object      # result -> markdown
    model: bool = True  # loads the compressor (--ckpt, or an untrained preset)


TASKS = {
    "ae": Task(True, lambda a, comp, ex, proto, out: run_ae(comp, ex, a.max_new_tokens, proto, batch_size=a.batch_size,
                                                            ratio=a.ratio), report_text),
    "lm": Task(True, lambda a, comp, ex, proto, out: run_lm(comp, ex, batch_size=a.batch_size, ratio=a.ratio,
                                                            max_len=a.max_len), report_text),
    "qa": Task(True, lambda a, comp, ex, proto, out: run_qa(comp, ex, a.max_new_tokens, batch_size=a.batch_size,
                                                            ratio=a.ratio, concat=a.concat, reuse=not a.no_reuse,
                                                            max_len=a.max_len), report_text),
    "needle": Task(True, lambda a, comp, ex, proto, out: run_needle(
        comp, ex, a.lengths, a.n, a.seed, a.max_new_tokens, a.batch_size, a.ratio, png=out + ".png"), report_needle),
    "speed": Task(False, lambda a, comp, ex, proto, out: run_speed(comp, a.lengths or SPEED_LENGTHS, a.max_new_tokens),
                  report_speed),
    "interpolate": Task(False, lambda a, comp, ex, proto, out: run_interpolate(
        comp, a.text0 or DEFAULT_TEXT0, a.text1 or DEFAULT_TEXT1, a.weights, a.max_new_tokens, proto), report_interpolate),
    "heatmap": Task(True, lambda a, comp, ex, proto, out: run_heatmap(comp, a.text0 or ex[0]["text"], out),
                    report_heatmap),
    "curves": Task(False, lambda a, comp, ex, proto, out: run_curves(a.runs, a.key, a.target_loss, png=out + ".png"),
                   report_curves, model=False),   # training logs of several runs
}


def numbers(text, kind, name):
    """--lengths / --weights: comma-separated numbers."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated numbers, got {text!r}") from None


def main(argv=None):
    """Run one task; returns the result dict (also written as JSON). Bad input -> SystemExit('error: ...')."""
    args = parse_args(argv)
    torch.manual_seed(0)   # an untrained preset's memory tokens, and anything else random, repeat run to run
    out = args.out or (os.path.join(args.ckpt, f"eval_{args.task}.json") if args.ckpt
                       else f"eval_{args.task}_{args.method or 'runs'}.json")
    comp = None
    try:
        args.lengths = args.lengths and numbers(args.lengths, int, "lengths")
        args.weights = numbers(args.weights, float, "weights")
        if args.lengths and min(args.lengths) < 1:
            raise ValueError(f"--lengths must be positive, got {args.lengths}")
        task = TASKS[args.task]
        n = None if args.task == "needle" else args.n   # needle: --n counts samples per cell, not texts
        examples = load_examples(args.data, args.task, n) if task.examples and (
            args.task != "heatmap" or args.text0 is None) else None
        comp = load_compressor(args) if task.model else None
        proto = protocol(comp, args.ckpt, args.max_len) if comp else None
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)   # before the task: figures go next to it
        result = task.run(args, comp, examples, proto, os.path.splitext(out)[0])
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    result = {"task": args.task, "checkpoint": args.ckpt, "config": comp and asdict(comp.cfg),
              "ratio": args.ratio, "device": args.device, "dtype": args.dtype, **result}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(task.report(result))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
