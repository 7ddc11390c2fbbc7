"""A run's files in pieces small enough to travel, and back (ours). A lent GPU returns at most 8 files of
16 MiB each, 64 MiB together, per call, and takes a work tree of at most 64 MiB: the BLEU push's trainable weights
(29.6 MB at LoRA r 64), its full checkpoint (87.6 MB with the optimizer state) and SmolLM2-135M (517 MB) fit
none of these whole. So a folder is cut into pieces with a manifest, and joined where it lands:

    python recipes/pieces.py split RUN/ckpt-000400 PIECES [--mib 15]   # PIECES/manifest.json + NAME.000, NAME.001...
    python recipes/pieces.py join PIECES RUN/ckpt-000400              # every file back, each checked by its sha256

Pieces may arrive over several calls (copy some to $OUT each call; the manifest says which exist); join refuses
until every piece is there and every file's bytes match its sha256, and only then renames the joined files into
place, so a missing or damaged piece leaves no half-joined checkpoint for train.py --resume to read.
"""

import argparse
import hashlib
import json
import os
import sys

MANIFEST = "manifest.json"


def split(src: str, dest: str, mib: float = 15) -> dict:
    """Cut every file directly in `src` into pieces of at most `mib` MiB under `dest`, with a manifest."""
    size = int(mib * 2**20)
    if size < 1:
        sys.exit(f"--mib {mib} gives pieces under one byte; use a positive size such as 15")
    os.makedirs(dest, exist_ok=True)
    files = {}
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue   # a run's cache/ or older ckpt-*/ folders stay behind: split the folder that is wanted
        digest, n = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(size):
                with open(os.path.join(dest, f"{name}.{n:03d}"), "wb") as out:
                    out.write(chunk)
                digest.update(chunk)
                n += 1
        files[name] = {"bytes": os.path.getsize(path), "pieces": n, "sha256": digest.hexdigest()}
    manifest = {"piece_mib": mib, "files": files}
    with open(os.path.join(dest, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def join(pieces: str, dest: str) -> list:
    """Rebuild the files `pieces`/manifest.json names into `dest`; exit with the first missing or damaged file."""
    path = os.path.join(pieces, MANIFEST)
    if not os.path.isfile(path):
        sys.exit(f"{pieces} has no {MANIFEST}: give the folder `recipes/pieces.py split` wrote")
    with open(path) as f:
        files = json.load(f)["files"]
    missing = [f"{name}.{i:03d}" for name, m in files.items() for i in range(m["pieces"])
               if not os.path.isfile(os.path.join(pieces, f"{name}.{i:03d}"))]
    if missing:
        sys.exit(f"{len(missing)} piece(s) not here yet in {pieces} ({', '.join(missing[:4])}): copy them in, then join")
    os.makedirs(dest, exist_ok=True)
    joined = {}
    for name, m in files.items():   # every file joined and checked first, so a damaged piece writes no file
        joined[name], digest = os.path.join(dest, f".{name}.joining"), hashlib.sha256()
        with open(joined[name], "wb") as out:
            for i in range(m["pieces"]):
                with open(os.path.join(pieces, f"{name}.{i:03d}"), "rb") as f:
                    chunk = f.read()
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != m["sha256"] or os.path.getsize(joined[name]) != m["bytes"]:
            for tmp in joined.values():
                os.remove(tmp)
            sys.exit(f"{name}: its pieces in {pieces} do not match the manifest's sha256 (a piece was cut or "
                     f"overwritten): copy them again from the folder that split them")
    for name, tmp in joined.items():
        os.replace(tmp, os.path.join(dest, name))
    return sorted(files)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("split", help="cut a folder's files into pieces with a manifest")
    s.add_argument("src")
    s.add_argument("dest")
    s.add_argument("--mib", type=float, default=15, help="the largest piece, in MiB (default 15: a device returns "
                   "files of at most 16 MiB)")
    j = sub.add_parser("join", help="rebuild the files from their pieces, each checked by its sha256")
    j.add_argument("pieces")
    j.add_argument("dest")
    a = p.parse_args(argv)
    if a.verb == "split":
        m = split(a.src, a.dest, a.mib)
        print(f"{len(m['files'])} file(s) in {sum(f['pieces'] for f in m['files'].values())} piece(s) -> {a.dest}")
    else:
        print(f"joined {', '.join(join(a.pieces, a.dest))} -> {a.dest}")


if __name__ == "__main__":
    main()
