"""The real English corpus the recipes train and score on, built offline from a Debian package.

    python recipes/corpus.py [--out runs/corpus]        # ~10 s; needs apt-get + dpkg-deb (any Debian/Ubuntu)
    python recipes/corpus.py --out runs/corpus_long --min-words 110   # passages for 8x (128 tokens into 16 slots)

Source: the Python 3.11 documentation as Debian ships it (package `python3.11-doc`, from the Debian
archive, no other network), © Python Software Foundation, PSF License version 2 (the package's
copyright file). We read the reStructuredText sources of its prose (`html/_sources/**/*.rst.txt`:
tutorial, how-tos, FAQ, "what's new", library and language reference), keep the paragraphs of plain
prose and drop the markup. No Hugging Face data set can be reached from our machines; this one installs
from the same registry as everything else, and its sentences are ordinary technical English.

What it writes into --out:

    train.jsonl      {"text"} per paragraph, from 90% of the documentation's files
    heldout.jsonl    {"text"} per paragraph, from the other 10% of the files: nothing trains on these
    qa_train.jsonl   {"context", "question", "answer"}: one fill-in-the-blank question per training paragraph,
                     for QA fine-tuning (PIC, GMSA KEFT) and CompLLM's distillation (ours, built here: the
                     answer is a specific word of the paragraph, a name or number a model cannot guess)
    stats.json       counts, and which file went where

--min-words N (ours, for 8x): each text is a passage instead, consecutive prose paragraphs of one file joined until
it has at least N words (a file's short remainder joins its last passage): 8x compresses 128-token texts, and a
paragraph of the documentation is 62 words on average, so only 210 of the 3,255 training paragraphs reach 128
SmolLM2 tokens. The split, the cleaning and the questions are the same.

The held-out QA set the recipes score on is recipes/qa_heldout.jsonl (60 questions written by hand about
held-out paragraphs, each answer copied from its paragraph).

The split is by *file* (a file is held out when sha1 of its path ends in a digit 0 of 10), so a held-out
paragraph never shares a page with a training one. Scores are only ever computed on heldout.jsonl, and the
recipes' learning rates are the papers' (or, for the short LoRA runs of EPL and GMSA, 5e-4, stated in the
recipe), and their CPU-scale steps are what a CPU affords: none was picked by held-out scores.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PACKAGE = "python3.11-doc"
SOURCES = "usr/share/doc/python3.11/html/_sources"
# pages that are mostly tables, API signatures or licences rather than prose
SKIP = re.compile(r"^(c-api|distutils|includes|license|copyright|about|bugs|contents|glossary)")

_ROLE = re.compile(r":[\w:.-]+:`(?:[^`<]*<)?([^`>]+)>?`")      # :func:`os.walk`, :ref:`text <label>` -> the text
_LITERAL = re.compile(r"``([^`]+)``")                           # ``code`` -> code
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_+")                 # `Python <https://...>`_ -> Python
_EMPH = re.compile(r"(\*\*|\*|`)([^*`]+)\1_*")                  # *word*, **word**, `word`_ -> word


def clean(paragraph: str) -> str:
    """reST inline markup -> plain text, one line, single spaces."""
    text = " ".join(paragraph.split())
    # Sphinx shows :meth:`~logging.Filter.filter` as "filter": a leading ~ keeps the last dotted part
    text = _ROLE.sub(lambda m: m[1].rpartition(".")[2] if m[1].startswith("~") else m[1], text)
    for pattern in (_LITERAL, _LINK):
        text = pattern.sub(r"\1", text)
    text = _EMPH.sub(r"\2", text)
    return text.replace("\\", "")


def paragraphs(rst: str):
    """The prose paragraphs of one reST file: blocks of unindented lines, minus headings, directives,
    comments, lists, tables, doctest and the block that follows a '::' (a code example)."""
    blocks, block = [], []
    for line in rst.splitlines() + [""]:
        if line.strip():
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    previous_code = False
    for block in blocks:
        first = block[0]
        is_code_intro = block[-1].rstrip().endswith("::")
        skip = (previous_code and first.startswith(" "))   # the example under "For example::"
        previous_code = is_code_intro or (previous_code and first.startswith(" "))
        if skip or first.startswith((" ", "\t", "..", ">>>", "*", "-", "+", "=", "|", "#", ":")):
            continue
        if re.match(r"^\d+\.|^[A-Za-z]\)", first) or any(re.fullmatch(r"[=\-~^\"'*#+`]{3,}", l.strip()) for l in block):
            continue   # numbered lists, headings (a line of ==== under or over the title)
        text = clean("\n".join(block))
        if text.endswith("::"):
            text = text[:-1]   # "For example::" introduces code; the sentence itself ends in ":"
        words = text.split()
        alpha = sum(w.strip(".,;:()!?\"'").isalpha() for w in words)
        if len(words) >= 40 and alpha >= 0.75 * len(words):   # real sentences, not a list of names
            yield text


_SPECIFIC = re.compile(r"^(?=.*[A-Za-z0-9])[\w.]*([0-9_]|[a-z][A-Z]|\.[a-z])[\w.]*$")   # digits, snake_case, camelCase, a.b


def cloze(paragraph: str, seed: int):
    """One fill-in-the-blank question about a paragraph, or None: a sentence (not the first) with one specific
    word (a number, an identifier) blanked out; the answer is that word, as it appears in the paragraph."""
    sentences = re.split(r"(?<=[.!?])\s+", paragraph)
    found = [(i, w.strip(".,;:()\"'")) for i, sent in enumerate(sentences) for w in sent.split()
             if i > 0 and _SPECIFIC.match(w.strip(".,;:()\"'")) and len(w.strip(".,;:()\"'")) >= 3
             and not re.fullmatch(r"[a-z]\.[a-z]", w.strip(".,;:()\"'"))]   # not "e.g", "i.e"
    if not found:
        return None
    i, word = found[seed % len(found)]
    blanked = sentences[i].replace(word, "___", 1)
    return {"context": paragraph, "question": f'Which word fills the blank in: "{blanked}"', "answer": word}


def passages(texts: list, min_words: int) -> list:
    """Consecutive paragraphs joined (one space) until each passage has at least min_words words; a short remainder
    joins the last passage (a file shorter than min_words is one short passage)."""
    out, words = [], 0
    for text in texts:
        if out and words < min_words:
            out[-1] += " " + text
        else:
            out.append(text)
            words = 0
        words += len(text.split())
    if len(out) > 1 and words < min_words:   # the remainder is out[-1]: it joins the one before
        out[-2:] = [" ".join(out[-2:])]
    return out


def held_out(path: str) -> bool:
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 10 == 0


def fetch_sources(deb: str | None, workdir: str) -> str:
    """Download (unless --deb is given) and unpack the package; returns the _sources folder."""
    if deb is None:
        for tool in ("apt-get", "dpkg-deb"):
            if shutil.which(tool) is None:
                sys.exit(f"corpus.py: error: {tool} not found; on a non-Debian system download {PACKAGE}'s .deb "
                         f"from packages.debian.org and pass --deb FILE")
        subprocess.run(["apt-get", "download", PACKAGE], cwd=workdir, check=True, capture_output=True)
        deb = glob.glob(os.path.join(workdir, f"{PACKAGE}_*.deb"))[0]
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(workdir, "x")], check=True)
    return os.path.join(workdir, "x", SOURCES)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/corpus", help="output folder (default runs/corpus)")
    p.add_argument("--deb", help=f"a downloaded {PACKAGE}_*.deb instead of apt-get download")
    p.add_argument("--min-words", type=int, default=0, help="ours: join consecutive paragraphs of a file into passages "
                   "of at least this many words (110 gives 128-token texts for 8x; default 0: paragraphs)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        root = fetch_sources(a.deb, work)
        files = sorted(os.path.relpath(f, root) for f in glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True))
        split = {"train": [], "heldout": []}
        where = {"train": [], "heldout": []}
        for rel in files:
            if SKIP.match(rel):
                continue
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                found = list(paragraphs(f.read()))
            if a.min_words:
                found = passages(found, a.min_words)
            if found:
                part = "heldout" if held_out(rel) else "train"
                split[part] += found
                where[part].append(rel)
    os.makedirs(a.out, exist_ok=True)
    for part, texts in split.items():
        with open(os.path.join(a.out, f"{part}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    qa = [q for i, t in enumerate(split["train"]) for q in [cloze(t, i)] if q]
    with open(os.path.join(a.out, "qa_train.jsonl"), "w") as f:
        f.writelines(json.dumps(q) + "\n" for q in qa)
    stats = {part: {"paragraphs" if not a.min_words else f"passages of >= {a.min_words} words": len(t), "words": sum(len(x.split()) for x in t), "files": where[part]}
             for part, t in split.items()}
    with open(os.path.join(a.out, "stats.json"), "w") as f:
        json.dump({"package": PACKAGE, "license": "PSF License version 2", **stats}, f, indent=1)
    for part in split:
        print(f"{part}: {len(split[part])} {'passages' if a.min_words else 'paragraphs'}, {stats[part]['words']} words, "
              f"{len(where[part])} files -> {os.path.join(a.out, part + '.jsonl')}")
    print(f"qa_train: {len(qa)} fill-in-the-blank questions -> {os.path.join(a.out, 'qa_train.jsonl')}")


if __name__ == "__main__":
    main()
