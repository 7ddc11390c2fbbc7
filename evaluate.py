"""Evaluation: the metrics the five papers report, then the evaluation tasks and the command line.

    python evaluate.py --ckpt DIR --task {ae,lm,qa,speed,interpolate,heatmap} [--data PATH] [--n N]
    python evaluate.py --method compllm --model tiny --task speed --lengths 512,1024,2048,4096,8192

Tasks (`--help` explains each): ae reconstruction, lm completion perplexity, qa, each next to the
plain LLM with the full context and with none; speed (CompLLM's complexity claims: compression
linear, prefill quadratic, TTFT speedup -> C²); interpolate (AOC Eq. 5); heatmap (PIC Figures 3
and 7: memory-token cosine and attention maps, written as PNG by a small zlib PNG encoder).

Metrics (the first section) are written from scratch — stdlib only — and tested against the
reference packages the papers used (nltk's sentence_bleu, Google's rouge-score, the `rouge` 1.0.1
package of pltrdy, the official SQuAD v1.1 script). Every score is a float in [0, 1] except
perplexity.

    reconstruction (AE)   bleu4, bleu_n_precision, rouge_n_f1, rouge_l_f1 (rouge-score),
                          rouge_pltrdy (rouge 1.0.1), prefix_em, aoc_exact_match, token_accuracy
    completion (LM)       perplexity = exp(Σ NLL / N)
    question answering    squad_em, squad_f1 (normalised) · exact_match, token_f1 (unnormalised)
                          · substring_acc (GMSA "Acc") · epl_qa_f1, epl_qa_em (EPL)

Which paper scores how (SPEC "How each paper scores"): what the official script computes, our
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
import re
import statistics
import string
import struct
import time
import zlib
from collections import Counter
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import compressors as C
import masks
from model import apply_rope, load_pretrained

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
#     full         the frozen LLM reads [BOS, context, "\n\n", prompt]       upper reference
#     none         the frozen LLM reads [BOS, prompt]                        lower reference
#
# "full" and "none" use the plain LLM only (a shared encoder's LoRA switched off), so they depend
# on the base model, not on the checkpoint. For LM the continuation follows the context directly.

SEP = "\n\n"   # between the context and what follows it in the "full" row
MODES = ("compressed", "full", "none")

# Built-in data, so every task runs offline with no --data. Short on purpose (the tests run the
# tasks on CPU, and AE regenerates every text token by token) and held out from train.py's
# built-in texts. Questions are plain, as train.py's QA fine-tuning feeds them: [memory, question]
# -> answer, so the answer follows the question directly.
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


def load_examples(path, task, n=None):
    """The examples of a task: dicts with "text" (ae, lm, heatmap) or "context", "question",
    "answer" (qa; answer is a str or a list of accepted answers). No path: the built-in sets.
    path: .jsonl, one JSON object a line, as train.py reads it ({"text"} or
    {"context", "question", "answer"}; a QA record serves the text tasks through its context),
    or any other file as plain text, one text per non-empty line (train.py reads a whole .txt file
    as one document to draw windows from; an evaluation needs fixed examples). n: keep the first n."""
    if path is None:
        rows = [dict(r) for r in BUILTIN_QA] if task == "qa" else [{"text": t} for t in BUILTIN_TEXTS]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    elif path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"--data {path} line {i} is not JSON ({e.msg})") from None
    else:
        with open(path, encoding="utf-8") as f:
            rows = [{"text": line.rstrip("\n")} for line in f if line.strip()]
    need = ("context", "question", "answer") if task == "qa" else ("text",)
    out = []
    for i, r in enumerate(rows, 1):
        if task != "qa" and isinstance(r, dict) and "text" not in r and "context" in r:
            r = {"text": r["context"]}
        if not isinstance(r, dict) or any(k not in r for k in need):
            raise ValueError(f"--data {path} record {i} needs the fields {', '.join(need)} for --task {task}")
        out.append(r)
    if not out:
        raise ValueError(f"--data {path} holds no examples")
    return out[:n] if n else out


# -----------------------------------------------------------------------------
# ---- running the compressor and the plain LLM ----


def compress(comp, contexts):
    """comp.compress with a fixed rate for group merging: GMSA samples r per example while training
    (§4.1); an evaluation must be repeatable, so it uses the first rate of the preset (4x)."""
    rates = [comp.cfg.ratios[0]] * len(contexts) if comp.cfg.source == "group_mean" else None
    return comp.compress(contexts, rates=rates)


def start_ids(tok):
    """What a plain-LLM prompt starts with: BOS, or EOS for tokenizers without one (Qwen uses its
    <|endoftext|> as the document separator). The LM rows need a first slot to predict from."""
    return [tok.bos_id if tok.bos_id is not None else tok.eos_id]


def plain_prompt(tok, context, prompt):
    """The "full" (context given) or "none" (context = []) reference prompt; see ---- data ----."""
    sep = tok.encode(SEP) if context else []
    return start_ids(tok) + list(context) + sep + list(prompt)


def cut_at_eos(ids, eos_id):
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def plain_generate(comp, prompt, max_new_tokens):
    """Greedy decoding of the frozen LLM (no memory) after `prompt`, cut at EOS."""
    dev = comp.decoder.model.embed_tokens.weight.device
    with comp.decoding():
        out = comp.decoder.generate(torch.tensor([prompt], device=dev), max_new_tokens=max_new_tokens,
                                    eos_id=comp.tok.eos_id)
    return cut_at_eos(out[0].tolist(), comp.tok.eos_id)


def plain_nll(comp, prefix, follow):
    """(summed NLL, count) of the frozen LLM on `follow` after `prefix` (prefix non-empty)."""
    dev = comp.decoder.model.embed_tokens.weight.device
    ids = torch.tensor([list(prefix) + list(follow)], device=dev)
    with comp.decoding():
        h = comp.decoder(ids, compute_logits=False).last_hidden[0]              # (T, d)
    # slot t predicts token t + 1: the slots from the last prefix token to the one before the end
    logits = comp.decoder.lm_head(h[len(prefix) - 1:-1]).float()                # (len(follow), V)
    return F.cross_entropy(logits, ids[0, len(prefix):], reduction="sum").item(), len(follow)


def summarize(rows):
    """Per-example rows -> {"scores": {mode: mean scores}, "examples": rows}."""
    return {"scores": {m: mean_scores([r[m]["scores"] for r in rows]) for m in MODES}, "examples": rows}


# -----------------------------------------------------------------------------
# ---- ae, lm, qa ----


def ae_scores(hyp_ids, ref_ids, tok):
    """Every reconstruction score of the papers for one regeneration (see the table at the top)."""
    hyp_text, ref_text = tok.decode(hyp_ids), tok.decode(ref_ids)
    hyp_words, ref_words = word_tokens(hyp_text), word_tokens(ref_text)
    # AOC pretrain_and_eval.py post-processes both decoded texts before scoring: "\n" -> " ", strip
    aoc_hyp, aoc_ref = (text.replace("\n", " ").strip() for text in (hyp_text, ref_text))
    aoc_rouge = rouge_pltrdy(aoc_hyp, aoc_ref)
    return {
        "bleu4_ids": bleu4(hyp_ids, ref_ids),                       # EPL: token ids, no smoothing
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
def run_ae(comp, examples, max_new_tokens=None):
    """Reconstruction: compress each text, regenerate it greedily from its memory (ICAE's AE task,
    AOC §3, EPL Table 6). Default budget: the reference length + 8 tokens."""
    tok, rows = comp.tok, []
    for ex in tqdm(examples, desc="ae", leave=False):
        ref = tok.encode(ex["text"])
        n_new = max_new_tokens or len(ref) + 8
        memory = compress(comp, [comp.encoder_ids(ref)])
        outs = {"compressed": comp.generate(memory, "ae", max_new_tokens=n_new),
                "full": plain_generate(comp, plain_prompt(tok, ref, []), n_new),
                "none": plain_generate(comp, plain_prompt(tok, [], []), n_new)}
        row = {"text": ex["text"], "reference_ids": ref, "memory_slots": int(memory.valid.sum())}
        for mode, ids in outs.items():
            row[mode] = {"text": tok.decode(ids), "ids": ids, "scores": ae_scores(ids, ref, tok)}
        rows.append(row)
    return summarize(rows)


@torch.no_grad()
def run_lm(comp, examples):
    """Completion perplexity: cut each text at p = ⌊|X|/2⌋ (EPL §4.1) and score the second half
    given the memory of the first (PIC Eq. 7, EPL Table 4). Perplexity is exp(Σ NLL / Σ tokens) over
    the whole set, never a mean of per-example perplexities."""
    tok, rows = comp.tok, []
    for ex in tqdm(examples, desc="lm", leave=False):
        ids = tok.encode(ex["text"])
        if len(ids) < 4:
            raise ValueError(f"text too short for the LM task ({len(ids)} tokens): {ex['text']!r}")
        p = len(ids) // 2
        ctx, cont = ids[:p], ids[p:]
        memory = compress(comp, [comp.encoder_ids(ctx)])
        loss, n = comp.lm_loss(memory, "lm", [cont], last_tokens=[ctx[-1]])
        nlls = {"compressed": (loss.item() * n, n),
                "full": plain_nll(comp, start_ids(tok) + ctx, cont),
                "none": plain_nll(comp, start_ids(tok), cont)}
        row = {"text": ex["text"], "context_tokens": p, "memory_slots": int(memory.valid.sum())}
        for mode, (nll, n) in nlls.items():
            row[mode] = {"nll": nll, "tokens": n, "perplexity": perplexity(nll, n) if n else float("nan")}
        rows.append(row)
    scores = {}
    for mode in MODES:
        nll, n = sum(r[mode]["nll"] for r in rows), sum(r[mode]["tokens"] for r in rows)
        scores[mode] = {"perplexity": perplexity(nll, n), "nll": nll, "tokens": n}
    return {"scores": scores, "examples": rows}


def qa_scores(prediction, answers):
    """Every QA score of the papers for one prediction (answers: a str or a list of str).

    EPL scores the whole decoded generation, where text after the answer (even a newline) makes
    EM 0; run_qa passes the first line of the stripped text, so epl_f1/epl_em score that line.
    """
    return {
        "squad_f1": squad_f1(prediction, answers), "squad_em": squad_em(prediction, answers),   # PCC/PIC, GMSA
        "exact_match": exact_match(prediction, answers),                                        # 500x/AOC
        "token_f1": token_f1(prediction, answers),                                              # 500x/AOC
        "substring_acc": substring_acc(prediction, answers),                                    # GMSA "Acc"
        "rouge1": max(rouge_n_f1(word_tokens(prediction), word_tokens(a), 1)                    # rouge-score,
                      for a in _references(answers)),                                           # max over refs
        "epl_f1": epl_qa_f1(prediction, answers), "epl_em": epl_qa_em(prediction, answers),     # EPL, answers[0]
    }


@torch.no_grad()
def run_qa(comp, examples, max_new_tokens=None):
    """Answer from memory + question (PIC/PCC SQuAD, EPL, GMSA). Generation stops at EOS; the
    prediction is the first line of the answer, so a plain LLM that goes on after answering (the
    "full" and "none" rows) is scored on its answer, as SQuAD evaluations of base models do."""
    tok, rows = comp.tok, []
    n_new = max_new_tokens or 32
    for ex in tqdm(examples, desc="qa", leave=False):
        ctx, question = tok.encode(ex["context"]), tok.encode(ex["question"])
        memory = compress(comp, [comp.encoder_ids(ctx)])
        outs = {"compressed": comp.generate(memory, "qa", prompt=question, max_new_tokens=n_new),
                "full": plain_generate(comp, plain_prompt(tok, ctx, question), n_new),
                "none": plain_generate(comp, plain_prompt(tok, [], question), n_new)}
        row = {"context": ex["context"], "question": ex["question"], "answer": ex["answer"],
               "memory_slots": int(memory.valid.sum())}
        for mode, ids in outs.items():
            text = tok.decode(ids)
            prediction = (text.strip().splitlines() or [""])[0]
            row[mode] = {"text": text, "prediction": prediction, "scores": qa_scores(prediction, ex["answer"])}
        rows.append(row)
    return summarize(rows)


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
    batch.pop("targets")
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
            M = int(memory.valid.sum())
            full = dict(input_ids=torch.tensor([start_ids(tok) + ctx + question], device=dev))
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
        b_full, b_mem = kv_bytes(kv_full, len(start_ids(tok)), T), kv_bytes(kv_mem, 0, M)
        rows.append(dict(context_tokens=T, memory_slots=M, compression=T / M,
                         compress_s=t_comp, ttft_full_s=t_full, ttft_compressed_s=t_mem,
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


# -----------------------------------------------------------------------------
# ---- interpolate (AOC Eq. 5) ----

DEFAULT_TEXT0 = "We present an awesome new idea."
DEFAULT_TEXT1 = "Large planets may have many moons."


@torch.no_grad()
def run_interpolate(comp, text0, text1, weights, max_new_tokens=None):
    """AOC Eq. (5): regenerate from Z = Z0 + w (Z1 − Z0) for each w, where Z0, Z1 compress text0,
    text1 (AOC Table 4 walks from one prompt to the other). Every tensor the decoder reads is mixed
    (memory embeddings, or every layer's K and V); the rest of the memory (chunk lengths, hence the
    EPL decoder positions) is Z0's. Needs memories of the same shape: always true for a fixed --mem
    budget and texts of at least --mem tokens, but methods that size memory by length (CompLLM,
    PCC/PIC, GMSA) need texts that compress to the same number of slots."""
    tok = comp.tok
    ids0, ids1 = tok.encode(text0), tok.encode(text1)
    z0, z1 = compress(comp, [comp.encoder_ids(ids0)]), compress(comp, [comp.encoder_ids(ids1)])
    m0, m1 = int(z0.valid.sum()), int(z1.valid.sum())
    if m0 != m1:
        raise ValueError(f"interpolate needs two memories of the same size: text0 compresses to {m0} slots and "
                         f"text1 to {m1} ({comp.cfg.method} sizes memory by length): pick texts of equal length")
    n_new = max_new_tokens or max(len(ids0), len(ids1)) + 8
    regen = lambda z: comp.generate(z, "ae", max_new_tokens=n_new)
    rows = [{"w": w, "ids": ids, "text": tok.decode(ids)} for w in weights for ids in [regen(z0.lerp(z1, w))]]
    ends = {name: {"ids": ids, "text": tok.decode(ids)} for name, ids in (("z0", regen(z0)), ("z1", regen(z1)))}
    return {"text0": text0, "text1": text1, "memory_slots": m0, "rows": rows, **ends}


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
    with comp.encoding():
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
    chunks = comp.chunks(list(enc_ids))
    out = torch.zeros(int(memory.valid.sum()), len(enc_ids))
    row0 = col0 = 0
    for r, chunk in enumerate(chunks):
        n, m = len(chunk), comp.num_mem(len(chunk))
        out[row0:row0 + m, col0:col0 + n] = probs[r, n:n + m, :n].cpu()
        row0, col0 = row0 + m, col0 + n
    return memory, out


def heat_rgb(values):
    """A [rows, cols] array -> uint8 RGB [rows, cols, 3] on a black-red-yellow-white scale ("hot"),
    min-max scaled: x in [0, 1] gives (r, g, b) = clip(3x, 3x - 1, 3x - 2 to [0, 1])."""
    v = np.asarray(values, dtype=np.float64)
    lo, hi = v.min(), v.max()
    x = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    rgb = np.stack([np.clip(3 * x - i, 0, 1) for i in range(3)], axis=-1)
    return np.round(rgb * 255).astype(np.uint8)


def write_png(path, rgb):
    """Minimal PNG writer (no PIL): 8-bit RGB, one IDAT, filter 0 on every scanline.

    PNG = signature, then chunks of [length (4 bytes, big-endian), type, data, CRC-32 of type+data]:
    IHDR (width, height, bit depth 8, colour type 2 = RGB, compression 0, filter 0, interlace 0),
    IDAT (zlib stream of the scanlines, each preceded by its filter-type byte), IEND."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")                                  # the 8-byte signature
        f.write(chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def heat_png(path, values, cell):
    """Each matrix cell as a cell x cell block of pixels."""
    rgb = heat_rgb(values)
    write_png(path, rgb.repeat(cell, axis=0).repeat(cell, axis=1))


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
    cosine = memory_cosine(comp, memory, ids)
    M, T = cosine.shape
    cell = max(1, min(16, 1024 // max(M, T)))       # pixels per cell: small maps are scaled up
    out = {"text": text, "tokens": ids, "encoder_tokens": enc, "memory_slots": M, "cell_pixels": cell,
           "cosine": cosine.tolist(), "cosine_png": f"{png_stem}_cosine.png",
           "attention": None, "attention_png": None}
    heat_png(out["cosine_png"], cosine.numpy(), cell)
    if attention is not None:
        out["attention"], out["attention_png"] = attention.tolist(), f"{png_stem}_attention.png"
        heat_png(out["attention_png"], attention.numpy(), cell)
    else:
        out["attention_note"] = f"{comp.cfg.method} merges hidden states into groups: no memory tokens attend"
    return out


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
               ae, lm and qa also score two references with the plain LLM: "full" (the whole context
               in its prompt: upper bound) and "none" (no context: lower bound).
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

Results go to --out (default: CKPT/eval_TASK.json), a markdown table to stdout.
Built-in data is used when --data is not given (.jsonl with {"text"} or {"context","question",
"answer"} records, or plain text with one text per line)."""

TASKS = ("ae", "lm", "qa", "speed", "interpolate", "heatmap")
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
    p.add_argument("--data", help="examples (.jsonl or .txt); default: the built-in sets")
    p.add_argument("--n", type=int, help="use the first N examples (default: all)")
    p.add_argument("--max-new-tokens", type=int, help="generation budget (default: ae reference + 8, qa 32, "
                                                       "speed 16 timed decode steps)")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192", help="speed: context lengths in tokens")
    p.add_argument("--weights", default="0,0.25,0.5,0.75,1", help="interpolate: values of w")
    p.add_argument("--text0", help=f"interpolate: first prompt (default {DEFAULT_TEXT0!r}); heatmap: the text")
    p.add_argument("--text1", help=f"interpolate: second prompt (default {DEFAULT_TEXT1!r})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", help="JSON results file (default CKPT/eval_TASK.json, or eval_speed_METHOD.json)")
    args = p.parse_args(argv)
    if args.task not in TASKS:
        raise SystemExit(f"error: unknown task '{args.task}': choose one of {', '.join(TASKS)}")
    if args.ckpt is None and (args.method is None or args.task != "speed"):
        raise SystemExit(f"error: --task {args.task} needs --ckpt DIR (only speed runs an untrained compressor, "
                         "with --method M [--model tiny])")
    for name in ("n", "max_new_tokens"):
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
        decoder, tok = load_pretrained(args.model or "tiny", dtype=dtype, device=args.device)
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


def report(task, result):
    """The markdown stdout shows for a task's result."""
    if task in ("ae", "lm", "qa"):
        keys = list(result["scores"]["compressed"])
        return markdown_table(["context"] + keys, [[m] + [s[k] for k in keys] for m, s in result["scores"].items()])
    if task == "speed":
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
    if task == "interpolate":
        rows = [["Z0", result["z0"]["text"]]] + [[f"w={r['w']:g}", r["text"]] for r in result["rows"]] + \
               [["Z1", result["z1"]["text"]]]
        return markdown_table(["memory", "regeneration"], [[a, repr(b)] for a, b in rows])
    parts = [f"cosine(memory slot, context token): {result['cosine_png']}", render_text(result["cosine"])]
    if result["attention"] is not None:
        parts += [f"encoder attention memory -> context: {result['attention_png']}", render_text(result["attention"])]
    else:
        parts.append(f"attention: {result['attention_note']}")
    return "\n".join(parts)


def main(argv=None):
    """Run one task; returns the result dict (also written as JSON). Bad input -> SystemExit('error: ...')."""
    args = parse_args(argv)
    torch.manual_seed(0)   # an untrained preset's memory tokens, and anything else random, repeat run to run
    out = args.out or (os.path.join(args.ckpt, f"eval_{args.task}.json") if args.ckpt
                       else f"eval_{args.task}_{args.method}.json")
    try:
        try:
            lengths = [int(x) for x in args.lengths.split(",")]
            weights = [float(x) for x in args.weights.split(",")]
        except ValueError:
            raise ValueError(f"--lengths and --weights take comma-separated numbers, got "
                             f"{args.lengths!r} and {args.weights!r}") from None
        if min(lengths) < 1:
            raise ValueError(f"--lengths must be positive, got {args.lengths}")
        examples = None
        if args.task in ("ae", "lm", "qa") or (args.task == "heatmap" and args.text0 is None):
            examples = load_examples(args.data, args.task, args.n)
        comp = load_compressor(args)
        if args.task == "ae":
            result = run_ae(comp, examples, args.max_new_tokens)
        elif args.task == "lm":
            result = run_lm(comp, examples)
        elif args.task == "qa":
            result = run_qa(comp, examples, args.max_new_tokens)
        elif args.task == "speed":
            result = run_speed(comp, lengths, args.max_new_tokens)
        elif args.task == "interpolate":
            result = run_interpolate(comp, args.text0 or DEFAULT_TEXT0, args.text1 or DEFAULT_TEXT1, weights,
                                     args.max_new_tokens)
        else:
            result = run_heatmap(comp, args.text0 or examples[0]["text"], os.path.splitext(out)[0])
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    result = {"task": args.task, "checkpoint": args.ckpt, "config": asdict(comp.cfg), "device": args.device,
              "dtype": args.dtype, **result}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(report(args.task, result))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
