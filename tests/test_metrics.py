"""Metrics of metrics.py against the reference implementations the papers used.

BLEU is checked against nltk's sentence_bleu (the 500x/AOC/PCC/EPL scripts call it), ROUGE
against Google's rouge-score and against the `rouge` 1.0.1 package of pltrdy (the 500x/AOC/EPL
scripts call that one), word tokens against nltk's tokenizer; SQuAD normalisation, EM/F1, prefix
EM, AOC's character prefix EM and token accuracy against values worked out by hand from the
official SQuAD v1.1 script's rules and the AOC/GMSA definitions. nltk, rouge-score and rouge are
test-only dependencies.
"""

import importlib.metadata
import math
import random
import warnings
from collections import Counter

import pytest

from metrics import (
    aoc_exact_match,
    bleu4,
    bleu_n_precision,
    brevity_penalty,
    epl_qa_em,
    epl_qa_f1,
    exact_match,
    mean_scores,
    normalize_answer,
    perplexity,
    prefix_em,
    rouge_l_f1,
    rouge_pltrdy,
    rouge_n_f1,
    squad_em,
    squad_f1,
    substring_acc,
    token_accuracy,
    token_f1,
    word_tokens,
)

nltk_bleu = pytest.importorskip("nltk.translate.bleu_score")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

# -----------------------------------------------------------------------------
# test cases: hand-written edge cases + seeded random pairs (ints and words)

WORDS = "the cat sat on mat a dog ran to big red house and it was".split()

HAND_CASES = [
    ([], []),  # both empty
    ([], [1, 2, 3, 4]),  # empty hypothesis
    ([1, 2, 3, 4], []),  # empty reference
    ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]),  # identical
    ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]),  # disjoint
    ([7], [7]),  # 1 token, identical (< 4 tokens)
    ([7, 8], [7, 8]),  # 2 tokens
    ([7, 8, 9], [7, 8, 9]),  # 3 tokens
    ([7, 8, 9], [7, 8, 9, 10, 11, 12]),  # short hypothesis: brevity penalty
    ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),  # brevity penalty, 4-grams match
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6]),  # long hypothesis: BP = 1
    ([5, 5, 5, 5, 5, 5, 5], [5, 1, 2, 5]),  # clipping of a repeated token
    ("the the the the the the the".split(), "the cat is on the mat".split()),  # Papineni's example
    ("the cat the cat the cat".split(), "the cat sat on the mat".split()),  # clipped bigrams
    ([1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 1, 2]),
    ([1, 2, 3, 9, 4, 5, 6], [1, 2, 3, 4, 5, 6]),  # an insertion
    ([4, 3, 2, 1], [1, 2, 3, 4]),  # unigrams only
    ("It is a guide to action which ensures that the military always obeys the commands of the party".split(),
     "It is a guide to action that ensures that the military will forever heed Party commands".split()),
]


def random_cases(n_cases, seed):
    """Seeded pairs: independent random sequences and perturbed copies (so that 3- and 4-grams
    match), over a small vocabulary (so that tokens repeat and clipping matters)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n_cases):
        vocab = WORDS if i % 2 else list(range(8))
        ref = [rng.choice(vocab) for _ in range(rng.randint(0, 25))]
        if rng.random() < 0.3:
            hyp = [rng.choice(vocab) for _ in range(rng.randint(0, 25))]
        else:  # a noisy copy: drops, substitutions, insertions, and sometimes a truncation
            hyp = []
            for tok in ref:
                r = rng.random()
                if r < 0.1:
                    continue
                hyp.append(rng.choice(vocab) if r < 0.2 else tok)
                if rng.random() < 0.05:
                    hyp.append(rng.choice(vocab))
            if rng.random() < 0.3:
                hyp = hyp[: rng.randint(0, len(hyp))]
        cases.append((hyp, ref))
    return cases


ALL_CASES = HAND_CASES + random_cases(400, seed=0)

# -----------------------------------------------------------------------------
# BLEU vs nltk


def nltk_sentence_bleu(hyp, ref, smooth):
    smoothing = nltk_bleu.SmoothingFunction().method1 if smooth else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns on every zero-count order without smoothing
        return nltk_bleu.sentence_bleu([ref], hyp, smoothing_function=smoothing)


@pytest.mark.parametrize("smooth", [False, True])
def test_bleu4_matches_nltk(smooth):
    for hyp, ref in ALL_CASES:
        ours, theirs = bleu4(hyp, ref, smooth=smooth), nltk_sentence_bleu(hyp, ref, smooth)
        assert abs(ours - theirs) < 1e-9, (hyp, ref, ours, theirs)
    # the random cases must exercise the non-trivial branch, or the comparison above says little
    assert sum(bleu4(h, r) > 0.1 for h, r in ALL_CASES) > 50


def test_bleu4_hand_values():
    assert bleu4([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == 1.0
    assert bleu4([], []) == 0.0 and bleu4([], [1, 2]) == 0.0 and bleu4([1, 2], []) == 0.0
    # 3-token perfect copy: no 4-gram exists -> 0 unsmoothed; method1 gives p4 = 0.1/1
    assert bleu4([7, 8, 9], [7, 8, 9]) == 0.0
    assert bleu4([7, 8, 9], [7, 8, 9], smooth=True) == pytest.approx(0.1 ** 0.25, abs=1e-12)
    # 2-token perfect copy: p3 = p4 = 0.1 -> (0.1 * 0.1) ** (1/4)
    assert bleu4([7, 8], [7, 8], smooth=True) == pytest.approx(0.1 ** 0.5, abs=1e-12)
    # 6 of 12 reference tokens, all n-grams correct: BLEU = BP = exp(1 - 12/6)
    assert bleu4(list(range(6)), list(range(12))) == pytest.approx(math.exp(-1), abs=1e-12)


def test_bleu4_zero_order_nltk_behaviour():
    """nltk 3.10 returns a tiny positive number (sys.float_info.min substituted for the zero
    precision) where the exact value is 0; we return 0.0. Older nltk returned 0 exactly."""
    hyp, ref = [1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 5, 6]  # 1-, 2-, 3-grams match, no 4-gram does
    theirs = nltk_sentence_bleu(hyp, ref, smooth=False)
    assert 0.0 <= theirs < 1e-70
    assert bleu4(hyp, ref) == 0.0
    assert bleu4(hyp, ref, smooth=True) > 0.1  # method1 keeps the lower orders' credit


def test_bleu_n_precision_and_pcc_bleu4():
    # Papineni §2.1: "the" x7 against "the cat is on the mat" -> clipped unigram precision 2/7
    assert bleu_n_precision("the the the the the the the".split(), "the cat is on the mat".split(), 1) == 2 / 7
    assert bleu_n_precision([1, 2, 3], [1, 2, 3], 4) == 0.0  # no 4-grams in the hypothesis
    for hyp, ref in ALL_CASES:
        for n in (1, 2, 3, 4):
            expected = float(nltk_bleu.modified_precision([ref], hyp, n))
            assert abs(bleu_n_precision(hyp, ref, n) - expected) < 1e-12, (hyp, ref, n)
        assert brevity_penalty(len(hyp), len(ref)) == nltk_bleu.brevity_penalty(len(ref), len(hyp))
        # PCC's "BLEU-4" = sentence_bleu(weights=(0, 0, 0, 1)) = BP * p4, not bleu4()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pcc = nltk_bleu.sentence_bleu([ref], hyp, weights=(0, 0, 0, 1))
        ours = brevity_penalty(len(hyp), len(ref)) * bleu_n_precision(hyp, ref, 4)
        assert abs(ours - pcc) < 1e-9, (hyp, ref)


def test_token_arguments():
    with pytest.raises(TypeError):
        bleu4("the cat", "the cat")  # a str would be scored character by character
    torch = pytest.importorskip("torch")
    # tensor elements hash by identity; they must be converted, not counted as they are
    assert bleu4(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 3, 4, 5])) == 1.0
    assert prefix_em(torch.tensor([1, 2, 9]), [1, 2, 3]) == pytest.approx(2 / 3)


# -----------------------------------------------------------------------------
# ROUGE vs rouge-score


class SplitTokenizer:
    """rouge-score tokenizer interface: tokens are whatever str.split() gives, so the reference
    sees exactly our token lists (no lowercasing, no punctuation stripping, no stemming)."""

    def tokenize(self, text):
        return text.split()


def test_rouge_matches_rouge_score():
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False, tokenizer=SplitTokenizer())
    for hyp, ref in ALL_CASES:
        hyp_s, ref_s = (" ".join(f"t{t}" if isinstance(t, int) else t for t in seq) for seq in (hyp, ref))
        scores = scorer.score(ref_s, hyp_s)  # score(target, prediction)
        assert abs(rouge_n_f1(hyp, ref, 1) - scores["rouge1"].fmeasure) < 1e-12, (hyp, ref)
        assert abs(rouge_n_f1(hyp, ref, 2) - scores["rouge2"].fmeasure) < 1e-12, (hyp, ref)
        assert abs(rouge_l_f1(hyp, ref) - scores["rougeL"].fmeasure) < 1e-12, (hyp, ref)


def test_rouge_default_tokenizer_on_plain_words():
    # rouge-score's own tokenizer (lowercase [a-z0-9]+) agrees when the text is plain lowercase words
    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=False)
    hyp, ref = "the cat sat on the red mat", "a cat sat on the mat today"
    s = scorer.score(ref, hyp)
    assert rouge_n_f1(word_tokens(hyp), word_tokens(ref), 1) == pytest.approx(s["rouge1"].fmeasure, abs=1e-12)
    assert rouge_l_f1(word_tokens(hyp), word_tokens(ref)) == pytest.approx(s["rougeL"].fmeasure, abs=1e-12)


def test_rouge_hand_values():
    # LCS(abcd, acbd) = 3 -> P = R = 3/4
    assert rouge_l_f1(list("abcd"), list("acbd")) == 0.75
    # clipped unigram overlap: hyp a a a, ref a b -> overlap 1, P = 1/3, R = 1/2, F = 2/5
    assert rouge_n_f1(list("aaa"), list("ab"), 1) == pytest.approx(0.4)
    assert rouge_n_f1([], [], 1) == 0.0 and rouge_l_f1([], []) == 0.0


# -----------------------------------------------------------------------------
# ROUGE vs the `rouge` 1.0.1 package (pltrdy), as the 500x/AOC scripts and EPL's QA evaluator call it

# words with attached punctuation, case variants, repeats, and "." inside words (3.14, e.g.)
PLTRDY_WORDS = "the The the cat cat, sat on mat a dog Dog ran 3.14 e.g. Paris it's (big) red".split()
PLTRDY_SEPS = [" "] * 8 + ["  ", "\n", "\t", ".", ". ", " . ", "...", ". \n"]

PLTRDY_HAND_CASES = [
    ("the cat sat on the mat", "the cat sat on the mat"),
    ("the the the", "the cat"),                        # sets: P = 1/1
    ("a b", "b a. b"),                                # which LCS is picked decides rouge-l
    ("The cat. It sat on the mat.", "The cat sat. It sat on the mat"),
    ("Paris. ", "Paris"),                             # the empty word after the last "."
    ("   ", "  "),                                    # whitespace only: the word "" on each side
    ("   ", "Paris"),
    (" . . ", "Paris. Lyon"),
    ("Paris, France", "Paris"),                       # "Paris," != "Paris"
    ("It costs 3.14 dollars", "It costs 3.15 dollars"),   # "." splits numbers
    ("a", "a b c"),                                   # no bigram on one side -> rouge-2 P = 0
    ("x y z", "a b c"),
]


def random_text_pairs(n_pairs, seed):
    """Seeded (hypothesis, reference) strings: a random reference of words and separators, and a
    hypothesis that is either independent or a copy with words dropped, changed or inserted."""
    rng = random.Random(seed)

    def piece():
        return [rng.choice(PLTRDY_WORDS), rng.choice(PLTRDY_SEPS)]

    pairs = []
    for _ in range(n_pairs):
        ref = [p for _ in range(rng.randint(0, 14)) for p in piece()]
        if rng.random() < 0.3:
            hyp = [p for _ in range(rng.randint(0, 14)) for p in piece()]
        else:
            hyp = []
            for i in range(0, len(ref), 2):
                r = rng.random()
                if r < 0.1:
                    continue
                hyp += piece() if r < 0.25 else ref[i : i + 2]
                if rng.random() < 0.05:
                    hyp += piece()
        pairs.append(("".join(hyp), "".join(ref)))
    return pairs


@pytest.fixture
def pltrdy():
    """The `rouge` 1.0.1 package (pltrdy; not rouge-score). Skips only the tests that need it."""
    rouge = pytest.importorskip("rouge")
    assert importlib.metadata.version("rouge") == "1.0.1"  # the version the papers' scripts pin
    return rouge


def package_scores(pltrdy, hyp, ref):
    """Rouge().get_scores(hyp, ref)[0], or None where the package raises (an empty side)."""
    try:
        return pltrdy.Rouge().get_scores(hyp, ref)[0]
    except ValueError:
        return None


def test_rouge_pltrdy_matches_the_package(pltrdy):
    pairs = PLTRDY_HAND_CASES + random_text_pairs(600, seed=1)
    zeros, positive = 0, Counter()
    for hyp, ref in pairs:
        ours, theirs = rouge_pltrdy(hyp, ref), package_scores(pltrdy, hyp, ref)
        if theirs is None:  # "" or only "."s on a side: the package raises, we score 0
            zeros += 1
            assert all(v == 0.0 for m in ours.values() for v in m.values()), (hyp, ref)
            continue
        assert ours.keys() == theirs.keys(), (hyp, ref)
        for metric in theirs:
            for stat in ("r", "p", "f"):
                assert abs(ours[metric][stat] - theirs[metric][stat]) < 1e-9, (hyp, ref, metric, stat)
            assert ours[metric] == theirs[metric], (hyp, ref, metric)  # in fact, to the last bit
            positive[metric] += ours[metric]["f"] > 0.2
    # the comparison must cover the empty cases and plenty of non-trivial scores of each kind
    assert zeros > 10 and min(positive.values()) > 200, (zeros, positive)


def test_rouge_pltrdy_hand_values(pltrdy):
    s = rouge_pltrdy("the the the", "the cat")  # unique unigrams: {the} vs {the, cat}
    assert (s["rouge-1"]["p"], s["rouge-1"]["r"]) == (1.0, 0.5)
    assert s["rouge-1"]["f"] == 2.0 * (0.5 / (1.5 + 1e-8))  # F = 2PR / (P + R + 1e-8)
    assert rouge_pltrdy("a b", "a b")["rouge-1"]["f"] == pytest.approx(0.999999995, abs=1e-15)  # not 1
    # rouge-l over sentences: LCS("b a", "a b") picks "b", LCS("b", "a b") = "b"; union {b} of the
    # distinct words {a, b} on each side -> P = R = 1/2 (had the first pick been "a", it would be 1)
    s = rouge_pltrdy("b a. b", "a b")
    assert (s["rouge-l"]["p"], s["rouge-l"]["r"]) == (0.5, 0.5)
    s = rouge_pltrdy("b a. a", "a b")
    assert (s["rouge-l"]["p"], s["rouge-l"]["r"]) == (1.0, 1.0)
    # "Paris. " has the words [Paris, ""]: P = 1/2 against "Paris"
    assert rouge_pltrdy("Paris. ", "Paris")["rouge-1"]["p"] == 0.5
    assert rouge_pltrdy("Paris.", "Paris")["rouge-1"]["p"] == 1.0
    # case-sensitive, punctuation other than "." kept on the word
    assert rouge_pltrdy("The cat", "the cat")["rouge-1"]["p"] == 0.5
    assert rouge_pltrdy("cat,", "cat")["rouge-1"]["f"] == 0.0
    # bigrams run across the sentence end: [a, b, c] -> (a b), (b c)
    assert rouge_pltrdy("a b. c", "a b c")["rouge-2"]["p"] == 1.0
    # empty: 0.0 everywhere where the package raises
    for hyp, ref in [("", "a"), ("...", "a"), ("a", ""), ("", "")]:
        assert all(v == 0.0 for m in rouge_pltrdy(hyp, ref).values() for v in m.values())
    with pytest.raises(ValueError, match="Hypothesis is empty"):
        pltrdy.Rouge().get_scores("...", "a")


def test_rouge_pltrdy_has_no_recursion_limit(pltrdy):
    """The package backtracks its LCS recursively: two 1000-word sentences with no word in common
    raise RecursionError there (EPL's evaluator would score such a generation 0.0). Here: the score."""
    hyp, ref = " ".join(f"h{i}" for i in range(1000)), " ".join(f"r{i}" for i in range(1000))
    with pytest.raises(RecursionError):
        pltrdy.Rouge().get_scores(hyp, ref)
    assert rouge_pltrdy(hyp, ref)["rouge-l"] == {"r": 0.0, "p": 0.0, "f": 0.0}


# -----------------------------------------------------------------------------
# SQuAD normalisation, EM and F1 (official v1.1 rules, values worked by hand)


def test_normalize_answer():
    assert normalize_answer("The  Cat, a dog!") == "cat dog"
    assert normalize_answer("An apple a day.") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("the-cat") == "thecat"  # punctuation removed before articles
    assert normalize_answer("  U.S.  ") == "us"
    assert normalize_answer("The") == ""


def test_squad_f1_em():
    # pred [big, cat] vs ref [cat]: 1 shared, P = 1/2, R = 1, F1 = 2 * (1/2 * 1) / (1/2 + 1) = 2/3
    assert squad_f1("the big cat", "a cat") == pytest.approx(2 / 3)
    assert squad_f1("the big cat", ["dog", "a cat", "Big cat!"]) == 1.0  # max over references
    assert squad_f1("cat", "cat") == 1.0  # a str reference is one reference, not characters
    assert squad_em("The Cat.", ["a dog", "a cat"]) == 1.0
    assert squad_em("big cat", "cat") == 0.0
    # both normalise to "": EM 1 ("" == ""), F1 0 (v1.1 has no shared token -> 0)
    assert squad_em("The", "a.") == 1.0 and squad_f1("The", "a.") == 0.0
    assert squad_f1("cat", []) == 0.0 and squad_em("cat", []) == 0.0
    # repeated tokens are counted with multiplicity: pred [cat cat] vs [cat]: P = 1/2, R = 1
    assert squad_f1("cat cat", "cat") == pytest.approx(2 / 3)


def test_unnormalised_qa_metrics():
    assert exact_match(" Paris\n", "Paris") == 1.0
    assert exact_match("paris", "Paris") == 0.0 and exact_match("Paris.", "Paris") == 0.0
    assert exact_match("Lyon", ["Paris", "Lyon"]) == 1.0
    assert exact_match("", "") == 1.0 and exact_match("Paris", []) == 0.0
    # word tokens [Paris, .] vs [Paris]: P = 1/2, R = 1 -> 2/3
    assert token_f1("Paris.", "Paris") == pytest.approx(2 / 3)
    # case matters: [The, cat] vs [the, cat] share only "cat" -> P = R = 1/2
    assert token_f1("The cat", "the cat") == 0.5 and squad_f1("The cat", "the cat") == 1.0
    assert token_f1("a b", ["c", "a b"]) == 1.0 and token_f1("", "") == 0.0


def test_epl_qa_metrics(pltrdy):
    """EPL's "F1" is pltrdy ROUGE-1 F against answers[0] only; its EM is raw equality with answers[0]."""
    rouge = pltrdy.Rouge()
    for gen, answers in [("in Paris", ["Paris"]), ("Paris , France", ["Paris, France", "x"]),
                         ("the the cat", "the cat sat"), ("Paris.", ["Paris"]), ("It is 3.14", ["3.14"])]:
        expected = rouge.get_scores(gen, answers if isinstance(answers, str) else answers[0])[0]["rouge-1"]["f"]
        assert epl_qa_f1(gen, answers) == expected, (gen, answers)
    # in Paris vs Paris: P = 1/2, R = 1 -> 2 * (1/2) / (3/2 + 1e-8)
    assert epl_qa_f1("in Paris", ["Paris"]) == 2.0 * (0.5 / (1.5 + 1e-8))
    assert epl_qa_f1("Lyon", ["Paris", "Lyon"]) == 0.0        # answers[0] only, no max
    assert epl_qa_f1("paris", ["Paris"]) == 0.0               # case-sensitive
    assert epl_qa_f1("", ["Paris"]) == 0.0 and epl_qa_f1("...", ["Paris"]) == 0.0   # the package raises
    assert epl_qa_f1("Paris", []) == 0.0
    assert epl_qa_em("Paris", ["Paris", "Lyon"]) == 1.0 and epl_qa_em("Paris", "Paris") == 1.0
    assert epl_qa_em("Lyon", ["Paris", "Lyon"]) == 0.0        # answers[0] only
    assert epl_qa_em("Paris ", ["Paris"]) == 0.0 and exact_match("Paris ", ["Paris"]) == 1.0   # no strip
    assert epl_qa_em("paris", ["Paris"]) == 0.0 and epl_qa_em("", [""]) == 1.0 and epl_qa_em("x", []) == 0.0


def test_substring_acc():
    assert substring_acc("I think it is the Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert substring_acc("I think it is the Eiffel Tower.", ["Louvre", "The Eiffel tower!"]) == 1.0
    assert substring_acc("I think it is the Eiffel Tower.", "Louvre") == 0.0
    assert substring_acc("concatenate", "cat") == 1.0  # character containment, as in the original
    assert substring_acc("anything", "the") == 1.0  # a reference that normalises to ""


# -----------------------------------------------------------------------------
# prefix EM vs token accuracy (AOC text / GMSA footnote vs AOC Eq. (6) as printed)


def test_prefix_em_vs_token_accuracy():
    hyp, ref = list("ABXD"), list("ABCD")
    assert prefix_em(hyp, ref) == 0.5 and token_accuracy(hyp, ref) == 0.75
    # GMSA footnote 3: 512 tokens, the first 128 right, the 129th wrong -> 128/512 = 0.25
    ref = list(range(512))
    hyp = ref[:128] + [-1] + ref[129:]
    assert prefix_em(hyp, ref) == 0.25 and token_accuracy(hyp, ref) == 511 / 512
    assert prefix_em(list("AB"), list("ABCD")) == 0.5 and token_accuracy(list("AB"), list("ABCD")) == 0.5
    assert prefix_em(list("ABCDEF"), list("ABCD")) == 1.0 and token_accuracy(list("ABCDEF"), list("ABCD")) == 1.0
    assert prefix_em(list("XABCD"), list("ABCD")) == 0.0 and token_accuracy(list("XABCD"), list("ABCD")) == 0.0
    # empty cases
    assert prefix_em([], []) == 1.0 and token_accuracy([], []) == 1.0
    assert prefix_em([1], []) == 0.0 and token_accuracy([1], []) == 0.0
    assert prefix_em([], [1]) == 0.0 and token_accuracy([], [1]) == 0.0


def test_aoc_exact_match():
    """AOC util_funs.compute_exact_match, worked by hand: common character prefix / len(reference)."""
    assert aoc_exact_match("The cat sat.", "The cat sat.") == 1.0
    assert aoc_exact_match("The cat sat. And more", "The cat sat.") == 1.0   # trailing text is free
    assert aoc_exact_match("The cat", "The cat sat.") == 7 / 12              # a strict prefix
    assert aoc_exact_match("The dog sat.", "The cat sat.") == 4 / 12         # "The " then c != d
    assert aoc_exact_match("the cat sat.", "The cat sat.") == 0.0            # case counts
    assert aoc_exact_match("The  cat sat.", "The cat sat.") == 4 / 12        # inner whitespace counts
    assert aoc_exact_match("  The cat\n", "\tThe cat sat. ") == 7 / 12       # both sides are stripped
    # characters, not tokens: one wrong letter late in a word keeps the prefix before it
    assert aoc_exact_match("abcX", "abcd") == 0.75
    # empty after strip (the original raises): both -> 1.0, either one alone -> 0.0
    assert aoc_exact_match("", "") == 1.0 and aoc_exact_match(" \n", "  ") == 1.0
    assert aoc_exact_match("", "abc") == 0.0 and aoc_exact_match("  ", "abc") == 0.0
    assert aoc_exact_match("abc", "") == 0.0


# -----------------------------------------------------------------------------
# word tokens, perplexity, aggregation


def test_word_tokens_match_nltk_on_plain_sentences():
    tokenizer = pytest.importorskip("nltk.tokenize").NLTKWordTokenizer()
    sentences = [
        "The state-of-the-art model costs $3.14 or 1,000 units at 10:30, right?",
        "Large planets may have many moons.",
        "We present an awesome new idea (with 3 parts); it works!",
        "Results: 42% of 7 runs improved, see Table 4.",
    ]
    for s in sentences:  # single sentences: nltk's word_tokenize = this tokenizer after punkt
        assert word_tokens(s) == tokenizer.tokenize(s), s
    assert word_tokens("Hello world. Bye.") == ["Hello", "world", ".", "Bye", "."]
    assert word_tokens("") == []


def test_perplexity():
    assert perplexity(10 * math.log(2.0), 10) == pytest.approx(2.0)
    assert perplexity(0.0, 5) == 1.0
    # a uniform guess over V tokens has NLL log V per token -> perplexity V
    assert perplexity(7 * math.log(50257), 7) == pytest.approx(50257)
    with pytest.raises(ValueError):
        perplexity(1.0, 0)


def test_mean_scores():
    rows = [{"bleu": 0.5, "em": 1.0}, {"bleu": 1.0, "em": 0.0}, {"bleu": 0.0}]
    assert mean_scores(rows) == {"bleu": 0.5, "em": 0.5}
    assert mean_scores([]) == {}
