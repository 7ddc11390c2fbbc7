"""
The figures evaluate.py and the recipes draw, all optional: matplotlib on its file-only backend (none installed: the
figure is skipped with one line, the numbers it would draw are in the results either way), a PNG heatmap, the
passkey grids, and a text heatmap for the terminal.
"""

import sys

import numpy as np


def pyplot(path):
    """matplotlib.pyplot on its file-only Agg backend, or None when matplotlib is not installed: figures are optional
    (the numbers they draw are in the results either way), so a missing matplotlib skips the figure at `path` with one
    line that says how to get it."""
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
    """A [rows, cols] matrix as a PNG heatmap ("hot" colour map, one cell per entry, a colour bar); returns the path,
    or None when the figure was skipped (no matplotlib)."""
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
    """A text heatmap, one character per cell by min-max scaled intensity; rows and columns beyond max_rows / max_cols
    are averaged into bins so it fits a terminal."""
    v = np.asarray(values, dtype=np.float64)
    for axis, limit in ((0, max_rows), (1, max_cols)):
        if v.shape[axis] > limit:
            bins = np.array_split(np.arange(v.shape[axis]), limit)
            v = np.stack([v.take(b, axis=axis).mean(axis=axis) for b in bins], axis=axis)
    lo, hi = v.min(), v.max()
    x = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    idx = np.minimum((x * len(RAMP)).astype(int), len(RAMP) - 1)
    return "\n".join(f"{i:4d} |" + "".join(RAMP[j] for j in row) + "|" for i, row in enumerate(idx))


def needle_png(path, result, name):
    """The three grids side by side, depth on y and length on x, red (0) to green (1) as the long-context papers draw
    them; returns the path, or None when matplotlib is missing."""
    plt = pyplot(path)
    if plt is None:
        return None
    modes = list(result["grid"])   # compressed, full, none: evaluate.py's modes
    fig, axes = plt.subplots(1, len(modes), figsize=(4 * len(modes), 3.6), sharey=True, layout="constrained")
    for ax, mode in zip(axes, modes):
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
