"""`python -m ba_jax.plot WORKDIR [WORKDIR ...]`: PNG curves of runs, overlaid.

Reads each run's `metrics.jsonl` and writes one PNG per quantity (reward, accuracy,
response length, and the aggregation diagnostics when logged) so that runs that differ
only in `grpo.aggregation` can be compared at a glance. Each curve is a trailing moving
average over `--window` steps (default 10; 1 plots the raw per-step values), and every
title says so. A run is labelled by the shortest suffix of its path that no other run's
path ends with (`run_labels`: `a/run` and `b/run` stay two curves, `a/run` and `b/run`);
the same folder given twice is an error. Output goes to `--out` (default: `plots/` inside
the first workdir). Workdirs and `--out` may be `gs://` URLs (paths.py): matplotlib writes
into a local staging folder that is then uploaded.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from ba_jax import paths
from ba_jax.metrics import read_metrics

# (metric key, plot title); a key missing from every run is skipped.
PANELS = (
    ("reward_mean", "reward (mean over responses)"),
    ("accuracy", "accuracy (fraction judged right)"),
    ("response_length_mean", "response length (tokens)"),
    ("response_length_cv", "response length CV"),
    ("diag_length_gap", "mean length gap  Lbar- / Lbar+"),
    ("diag_signed_mass_token", "signed mass sum W A under token aggregation"),
)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average that ignores NaN (missing values)."""
    if window <= 1 or len(y) == 0:
        return y
    out = np.empty_like(y)
    for i in range(len(y)):
        chunk = y[max(0, i - window + 1) : i + 1]
        chunk = chunk[np.isfinite(chunk)]
        out[i] = chunk.mean() if len(chunk) else np.nan
    return out


def caption(title: str, window: int) -> str:
    """A panel's title, saying what its curves are: raw values or a moving average."""
    what = (f"trailing {window}-step moving average" if window > 1 else "per-step values")
    return f"{title}\n{what}"


def run_labels(workdirs: list[str]) -> list[str]:
    """Each run's label: the fewest trailing components of its absolute path that no other
    run's path ends with (the folder name when that is unique). Two labels are never equal
    (equal labels have as many components, and each was chosen to differ there);
    SystemExit when two arguments are the same folder."""
    parts = [paths.absolute(wd).strip(os.sep).split(os.sep) for wd in workdirs]
    labels = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i]
        if mine in others:
            raise SystemExit(f"ba_jax.plot: {workdirs[i]!r} is given twice (as "
                             f"{[workdirs[j] for j, p in enumerate(parts) if p == mine]})")
        k = next(k for k in range(1, len(mine) + 1)
                 if all(p[-k:] != mine[-k:] for p in others))
        labels.append("/".join(mine[-k:]))
    return labels


def plot_runs(workdirs: list[str], out_dir: str, *, window: int = 10) -> list[str]:
    """Write one PNG per panel with every run overlaid; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for wd, label in zip(workdirs, run_labels(workdirs)):
        rows = read_metrics(wd)
        if not rows:
            raise SystemExit(f"ba_jax.plot: {paths.join(wd, 'metrics.jsonl')} is missing or empty")
        runs[label] = rows
    stage = paths.staging(out_dir, "plots")
    os.makedirs(stage, exist_ok=True)
    written = []
    for key, title in PANELS:
        if not any(key in r for rows in runs.values() for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for name, rows in runs.items():
            x = np.array([r["step"] for r in rows])
            y = np.array([np.nan if r.get(key) is None else r.get(key) for r in rows], float)
            ax.plot(x, smooth(y, window), label=name)
        ax.set_title(caption(title, window), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(stage, f"{key}.png"))
        plt.close(fig)
        written.append(paths.join(out_dir, f"{key}.png"))
    try:
        paths.upload_tree(stage, out_dir)
    finally:
        paths.remove_staging(stage, out_dir)
    return written


def plot_finished(workdir: str) -> None:
    """A finished run's curves into WORKDIR/plots (what `python -m ba_jax.main` does after the
    loop); a failure is printed, never raised: plots are a convenience."""
    try:
        plot_runs([workdir], paths.join(workdir, "plots"))
    except Exception as e:  # noqa: BLE001 - never fail a finished run over its plots
        print(f"plotting failed: {e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ba_jax.plot", description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: FIRST/plots)")
    parser.add_argument("--window", type=int, default=10, help="trailing moving-average window in steps (1: raw values)")
    args = parser.parse_args(argv)
    out = args.out or paths.join(args.workdirs[0], "plots")
    for path in plot_runs(args.workdirs, out, window=args.window):
        print(path)


if __name__ == "__main__":
    main()
