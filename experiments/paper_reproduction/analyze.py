"""Paper-style figures and tables for the aggregation grid: `analyze.py RUNS_ROOT [--out DIR]`.

Reads `RUNS_ROOT/<setting>/<aggregator>/metrics.jsonl` (the layout `launch.sh` writes;
setting is `<model>_<data>`, or `smoke`) and writes, per setting, one PNG with a panel per
quantity the paper explains its results with (reward, accuracy, response length, length
coefficient of variation, the Lbar-/Lbar+ length gap), one line per aggregator; a
`summary.md` of each run's last-steps means; and, where the runs were evaluated
(`WORKDIR/eval/step_N/results.json` from `ba_jax.evaluate`), the six-benchmark mean avg@k
of the newest step next to the paper's Table 1. Plotting only: no training, no scoring.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import numpy as np

from ba_jax.metrics import read_metrics
from ba_jax.plot import smooth

# (metrics.jsonl key, panel title)
PANELS = (
    ("reward_mean", "reward"),
    ("accuracy", "training accuracy"),
    ("response_length_mean", "response length (tokens)"),
    ("response_length_cv", "response length CV"),
    ("diag_length_gap", "length gap  Lbar- / Lbar+  (mixed groups)"),
)
# The diagnostics are 0 by convention when a step had no mixed group: not a measurement.
MIXED_ONLY = {"diag_length_gap"}
AGG_ORDER = ("sequence", "token", "balanced")
AGG_LABEL = {"sequence": "sequence (GRPO)", "token": "token (DAPO)", "balanced": "BA"}
AGG_COLOR = {"sequence": "tab:blue", "token": "tab:orange", "balanced": "tab:green"}
# Paper Table 1: last-step accuracy (six-benchmark average) per setting and aggregator.
PAPER_TABLE1 = {
    "qwen2.5-math-7b_dapo17k": {"sequence": 0.3446, "token": 0.3364, "balanced": 0.3424},
    "qwen2.5-math-7b_polaris": {"sequence": 0.3172, "token": 0.3292, "balanced": 0.3319},
    "qwen3-1.7b_dapo17k": {"sequence": 0.4481, "token": 0.4360, "balanced": 0.4695},
    "qwen3-1.7b_polaris": {"sequence": 0.4614, "token": 0.4349, "balanced": 0.4640},
}


def _agg_key(name: str) -> tuple[int, str]:
    return (AGG_ORDER.index(name) if name in AGG_ORDER else len(AGG_ORDER), name)


def find_runs(root: str) -> dict[str, dict[str, str]]:
    """{setting: {aggregator: workdir}} for every `root/<setting>/<agg>/metrics.jsonl`."""
    runs: dict[str, dict[str, str]] = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "*", "metrics.jsonl"))):
        workdir = os.path.dirname(path)
        setting, agg = os.path.basename(os.path.dirname(workdir)), os.path.basename(workdir)
        runs.setdefault(setting, {})[agg] = workdir
    return {s: dict(sorted(a.items(), key=lambda kv: _agg_key(kv[0]))) for s, a in runs.items()}


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one key; missing or undefined values are NaN."""
    steps_S = np.array([r["step"] for r in rows], float)
    vals_S = np.array([np.nan if r.get(key) is None else r[key] for r in rows], float)
    if key in MIXED_ONLY:
        mixed_S = np.array([r.get("diag_num_mixed_groups") or 0 for r in rows], float)
        vals_S = np.where(mixed_S > 0, vals_S, np.nan)
    return steps_S, vals_S


def last_mean(rows: list[dict], key: str, last: int) -> float:
    """Mean of a key over the last `last` steps that have it (NaN if none)."""
    _, vals_S = series(rows, key)
    vals_S = vals_S[np.isfinite(vals_S)][-last:]
    return float(vals_S.mean()) if len(vals_S) else float("nan")


def eval_score(workdir: str) -> tuple[int, float] | None:
    """(step, six-benchmark mean avg@k) of the newest `WORKDIR/eval/step_N/results.json`."""
    found = []
    for path in glob.glob(os.path.join(workdir, "eval", "step_*", "results.json")):
        m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.dirname(path)))
        if m:
            found.append((int(m.group(1)), path))
    if not found:
        return None
    step, path = max(found)
    with open(path) as f:
        mean = json.load(f)["mean"]["avg@k"]
    return step, float("nan") if mean is None else float(mean)


def plot_setting(setting: str, workdirs: dict[str, str], out_dir: str, *, window: int) -> str:
    """One PNG with a panel per quantity, one line per aggregator; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(13, 7), dpi=110)
    axes = grid.ravel()
    rows = {agg: read_metrics(wd) for agg, wd in workdirs.items()}
    for ax, (key, title) in zip(axes, PANELS):
        drawn = False
        for agg, r in rows.items():
            steps_S, vals_S = series(r, key)
            if np.isfinite(vals_S).any():
                ax.plot(steps_S, smooth(vals_S, window), label=AGG_LABEL.get(agg, agg),
                        color=AGG_COLOR.get(agg))
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no data" + (" (no mixed group)" if key in MIXED_ONLY else ""),
                    ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[-1].axis("off")  # the sixth cell holds the legend
    axes[-1].legend(handles, labels, loc="center", title="aggregation")
    fig.suptitle(setting)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{setting}.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_markdown(runs: dict[str, dict[str, str]], *, last: int) -> str:
    """Per-run means over the last steps, then evaluation against the paper's Table 1."""
    lines = [f"# Aggregation grid: means over the last {last} steps", "",
             "| setting | aggregator | steps | " + " | ".join(k for k, _ in PANELS) + " |",
             "|---|---|---:|" + "---:|" * len(PANELS)]
    for setting, aggs in runs.items():
        for agg, wd in aggs.items():
            rows = read_metrics(wd)
            vals = " | ".join(f"{last_mean(rows, k, last):.4g}" for k, _ in PANELS)
            lines.append(f"| {setting} | {agg} | {len(rows)} | {vals} |")
    aggs_seen = sorted({a for aggs in runs.values() for a in aggs}, key=_agg_key)
    lines += ["", "## Six-benchmark mean avg@k (newest evaluated step) vs paper Table 1", "",
              "| setting | " + " | ".join(f"{a} (paper)" for a in aggs_seen) + " |",
              "|---|" + "---:|" * len(aggs_seen)]
    for setting, aggs in runs.items():
        cells = []
        for agg in aggs_seen:
            got = eval_score(aggs[agg]) if agg in aggs else None
            ours = "-" if got is None else f"{got[1]:.4f} @{got[0]}"
            ref = PAPER_TABLE1.get(setting, {}).get(agg)
            cells.append(f"{ours} ({'-' if ref is None else f'{ref:.4f}'})")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def analyze(root: str, out_dir: str | None = None, *, window: int = 10, last: int = 10) -> list[str]:
    """Write every setting's figure and summary.md under `out_dir`; return the files."""
    runs = find_runs(root)
    if not runs:
        raise SystemExit(f"analyze.py: no RUNS_ROOT/<setting>/<agg>/metrics.jsonl under {root!r}")
    out_dir = out_dir or os.path.join(root, "figures")
    os.makedirs(out_dir, exist_ok=True)
    written = [plot_setting(s, wds, out_dir, window=window) for s, wds in runs.items()]
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write(summary_markdown(runs, last=last))
    return written + [path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="RUNS_ROOT holding <setting>/<aggregator>/metrics.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: ROOT/figures)")
    parser.add_argument("--window", type=int, default=10, help="moving-average window (steps)")
    parser.add_argument("--last", type=int, default=10, help="steps averaged in summary.md")
    args = parser.parse_args(argv)
    for path in analyze(args.root, args.out, window=args.window, last=args.last):
        print(path)


if __name__ == "__main__":
    main()
