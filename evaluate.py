"""Evaluation: the metrics the five papers report, then the evaluation tasks.

Metrics (this first section) are written from scratch — stdlib only — and tested against the
reference packages the papers used (nltk's sentence_bleu, Google's rouge-score, the official
SQuAD v1.1 script). Every score is a float in [0, 1] except perplexity.

    reconstruction (AE)   bleu4, bleu_n_precision, rouge_n_f1, rouge_l_f1, prefix_em, token_accuracy
    completion (LM)       perplexity = exp(Σ NLL / N)
    question answering    squad_em, squad_f1 (normalised) · exact_match, token_f1 (unnormalised)
                          · substring_acc (GMSA "Acc") · rouge_n_f1(n=1) (EPL's "F1")

Which paper scores how (SPEC "How each paper scores"):

    EPL          BLEU-4 on token ids, no smoothing          bleu4(ids, ids)
                 QA "F1" is ROUGE-1 F, EM unnormalised       rouge_n_f1(.., 1), exact_match
    500x / AOC   BLEU on nltk word tokens, method1           bleu4(word_tokens(h), word_tokens(r), smooth=True)
                 ROUGE-1/2/L F, prefix EM (AOC Eq. 6)        rouge_n_f1, rouge_l_f1, prefix_em
                 QA: EM stripped, F1 unnormalised            exact_match, token_f1
    PCC / PIC    BLEU-1..4, ROUGE-L on word tokens           see the bleu_n_precision trap
                 QA: SQuAD normalisation, max over refs      squad_em, squad_f1
    GMSA         BLEU, prefix EM, ROUGE (+ BERTScore)        bleu4, prefix_em, rouge_*
                 QA: Acc, EM, F1                             substring_acc, squad_em, squad_f1

Token arguments are sequences of hashables: token ids (ints) or words (str). Conventions for
empty inputs follow the reference packages and are stated in each docstring; in short: BLEU and
ROUGE give 0.0 whenever either side is empty, exact-match-like scores give 1.0 when both sides
are empty, and SQuAD F1 follows the v1.1 script (0.0 when nothing overlaps, even if both empty).
"""

import math
import re
import string
from collections import Counter

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
    here the caller chooses the tokens — token ids for EPL, word_tokens(text) for words.
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
    not the F_lcs with β = P/R of the `rouge` package (pltrdy) that the 500x scripts call — that
    one equals this F1 only when P = R. Either side empty -> 0.0.
    """
    hyp, ref = _tokens(hyp_tokens), _tokens(ref_tokens)
    if not hyp or not ref:
        return 0.0
    lcs = _lcs_length(hyp, ref)
    return _f1(lcs / len(hyp), lcs / len(ref))


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
# ---- tasks ----
# The evaluation tasks come next (added separately): ae (reconstruction), lm (completion
# perplexity), qa, speed, interpolate (AOC Eq. 5) and heatmap, then the command line.
