"""Records that name no machine (ours). A run's JSON (args.json, compressor.json, eval_*.json,
eval_curve.json, diagnosis.json, results.json, ...) names its files by the paths of the machine that ran it:
/home/..., /tmp/..., a model folder in ~/.cache. recipes/results keeps these records for other machines, where such
paths mean nothing, so a record names each path as `portable` gives it:

    a path inside this repository            -> relative to it: /home/me/ctxcomp/runs/corpus/train.jsonl ->
                                                runs/corpus/train.jsonl
    a path in another copy of the repository -> the same, from its runs/ or recipes/ folder on
    any other local file or folder           -> its own name (a model folder in ~/.cache -> smollm2-135m), as
                                                recipes/common.sh's MODEL_NAME names a local model

Only a value that is a whole path changes: a text that mentions /tmp/app.log (the corpus quotes some) stays as it is.
The recipes' own writers (curve.py, diagnosis.py, levers.py) write paths so; train.py's args.json and compressor.json
and evaluate.py's "checkpoint" still hold the paths of the machine, so before a record is committed:

    python recipes/records.py recipes/results/ladder/NEW_ARM ...    # rewrites its JSON files in place

A compressor.json beside its weights is left as it is (checkpoint.load reads the base model's path from it) and
named on stderr: run this again once the weights are gone (git ignores them in recipes/results).
"""

import glob
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = re.compile(r"(/|~/)\S*")   # a whole value that is an absolute path: no spaces, so never a sentence


def portable(value):
    """value as a record keeps it (see the module docstring); anything that is not an absolute path, unchanged."""
    if not isinstance(value, str) or not LOCAL.fullmatch(value):
        return value
    path = os.path.normpath(os.path.expanduser(value))
    rel = os.path.relpath(path, REPO)
    if not rel.startswith(".."):
        return rel
    parts = path.split(os.sep)
    for i, part in enumerate(parts):   # another copy of the repository: runs/... or recipes/... from it on
        if part in ("runs", "recipes"):
            return "/".join(parts[i:])
    return os.path.basename(path)


def local_paths(obj):
    """Every whole value in a JSON tree that is an absolute path (what portable changes)."""
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in local_paths(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in local_paths(v)]
    return [obj] if isinstance(obj, str) and LOCAL.fullmatch(obj) else []


def rewrite(path):
    """Make one JSON file portable in place; returns how many values changed. Each value is replaced as the JSON
    text it is (quotes included), so the file keeps its layout and nothing but whole values can match."""
    text = open(path).read()
    changed = 0
    for old in sorted(set(local_paths(json.loads(text))), key=len, reverse=True):   # longest first: no prefix clash
        old_json, new_json = json.dumps(old), json.dumps(portable(old))
        changed += text.count(old_json)
        text = text.replace(old_json, new_json)
    if changed:
        with open(path, "w") as f:
            f.write(text)
    return changed


def main(argv=None):
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        raise SystemExit("usage: python recipes/records.py FOLDER ... (records whose JSON should name no machine)")
    files = changed = 0
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
            if os.path.basename(path) == "compressor.json" and os.path.isfile(
                    os.path.join(os.path.dirname(path), "compressor.safetensors")):
                print(f"records.py: kept {path}: its weights load the model from the path it names", file=sys.stderr)
                continue
            n = rewrite(path)
            files, changed = files + (n > 0), changed + n
    print(f"records.py: {changed} path(s) made portable in {files} file(s)")


if __name__ == "__main__":
    main()
