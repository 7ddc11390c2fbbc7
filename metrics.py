"""The metrics the five papers report, written from scratch (stdlib only, no torch) and tested against the
reference packages the papers used (nltk's sentence_bleu, Google's rouge-score, the `rouge` 1.0.1 package of
pltrdy, the official SQuAD v1.1 script) in tests/test_metrics.py. evaluate.py scores every generation with
ae_scores and qa_scores (the needle task with passkey_score). Every score is a float in [0, 1] except perplexity.

    reconstruction (AE)   bleu4, bleu_n_precision, rouge_n_f1, rouge_l_f1 (rouge-score),
                          rouge_pltrdy (rouge 1.0.1), prefix_em, aoc_exact_match, token_accuracy
    completion (LM)       perplexity = exp(Σ NLL / N)
    question answering    squad_em, squad_f1 (normalised) · exact_match, token_f1 (unnormalised)
                          · substring_acc (GMSA "Acc") · epl_qa_f1, epl_qa_em (EPL)
    passkey retrieval     passkey_score (Mohtashami & Jaggi 2023)
    compression           tokens_per_slot (ours: the text's tokens over its memory's slots, as scored)

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

import math
import re
import string
from collections import Counter


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


def tokens_per_slot(rows):
    """The compression each memory was scored at: the text's tokens over its memory's slots, mean, min and max over
    the scored texts (ours: a "4x" label is checked against this, not against the flags)."""
    r = [len(row["reference_ids"]) / row["memory_slots"] for row in rows]
    return {"mean": sum(r) / len(r), "min": min(r), "max": max(r)}


# -----------------------------------------------------------------------------
# ---- every score of the papers for one generation ----


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


def passkey_score(generation, passkey):
    """Passkey retrieval (Mohtashami & Jaggi 2023), exact match of the number: 1.0 when the passkey is one of the
    numbers in the generation, 0.0 when it is not (another number, no number, or the passkey inside a longer
    number)."""
    return {"passkey": float(passkey in re.findall(r"\d+", generation))}
