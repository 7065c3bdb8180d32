"""Tables and figures of the length-bias study from the runs' metrics.jsonl files.

  .venv/bin/python experiments/length_study/analyze.py --root=runs/length_study \\
      --out=experiments/length_study

Reads ROOT/<setting>/<rule>_s<seed>/metrics.jsonl and writes OUT/results.md (the table),
OUT/results.json (every number per run) and OUT/accuracy.png, OUT/diagnostics.png (length gap), OUT/length.png.
Metrics, per run:
  final_acc     mean accuracy over the last 10 steps (one step's 64 samples are noisy)
  auc           mean accuracy over all steps (area under the curve / number of steps)
  max_drop      largest drop of the 5-step moving-average accuracy below its running best
  start_*       the knobs as measured: mean over steps 1-5 of response_length_cv,
                diag_length_gap (Lbar-/Lbar+ over mixed groups), diag_length_cv_pos/neg
Runs with fewer than --steps steps are reported as partial and left out of the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import numpy as np

RULES = ("sequence", "token", "balanced")
SETTINGS = ("small_gap", "large_gap", "large_variation", "short_wrong")
START = 5  # steps that define "the start of training"
FINAL = 10  # steps averaged for the final accuracy
SMOOTH = 5  # moving-average window of the instability measure


def load_run(path: str) -> dict[str, np.ndarray]:
    """Columns of one metrics.jsonl, ordered by step (a resumed step's last record wins)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_step[int(r["step"])] = r
    steps = sorted(by_step)
    keys = set().union(*(by_step[s].keys() for s in steps)) if steps else set()
    return {k: np.array([by_step[s].get(k, np.nan) for s in steps], float) for k in keys}


def max_drop(acc_T: np.ndarray, window: int = SMOOTH) -> float:
    """Largest fall of the moving-average accuracy below its running maximum."""
    if len(acc_T) < window:
        return float("nan")
    smooth_T = np.convolve(acc_T, np.ones(window) / window, mode="valid")
    return float(np.max(np.maximum.accumulate(smooth_T) - smooth_T))


def summarize(cols: dict[str, np.ndarray]) -> dict[str, float]:
    """The study's per-run numbers (see the module docstring)."""
    acc_T = cols["accuracy"]
    out = dict(steps=int(len(acc_T)), final_acc=float(np.mean(acc_T[-FINAL:])),
               auc=float(np.mean(acc_T)), max_drop=max_drop(acc_T),
               start_acc=float(np.mean(acc_T[:START])),
               final_length=float(np.mean(cols["response_length_mean"][-FINAL:])))
    for key in ("response_length_cv", "diag_length_gap", "diag_length_cv_pos",
                "diag_length_cv_neg", "response_length_mean"):
        out[f"start_{key}"] = float(np.nanmean(cols[key][:START]))
    return out


def collect(root: str, steps: int) -> tuple[dict, dict]:
    """(complete, partial): {(setting, rule): {seed: summary}}."""
    complete, partial = {}, {}
    for path in sorted(glob.glob(os.path.join(root, "*", "*_s*", "metrics.jsonl"))):
        setting = os.path.basename(os.path.dirname(os.path.dirname(path)))
        m = re.fullmatch(r"(\w+)_s(\d+)", os.path.basename(os.path.dirname(path)))
        if m is None or m.group(1) not in RULES:
            continue
        cols = load_run(path)
        if "accuracy" not in cols:
            continue
        s = summarize(cols) | dict(curve=cols["accuracy"].tolist(),
                                   gap=cols["diag_length_gap"].tolist(),
                                   length=cols["response_length_mean"].tolist())
        target = complete if s["steps"] >= steps else partial
        target.setdefault((setting, m.group(1)), {})[int(m.group(2))] = s
    return complete, partial


def _ms(values: list[float], fmt: str = ".3f") -> str:
    v = np.array(values, float)
    if len(v) == 1:
        return f"{v[0]:{fmt}}"
    return f"{np.mean(v):{fmt}} ± {np.std(v, ddof=1):{fmt}}"


def table(complete: dict) -> str:
    """Markdown table: one row per (setting, rule), mean ± sample std over seeds."""
    lines = ["| setting | rule | seeds | start CV | start gap L-/L+ | final acc | AUC | max drop |"
             " final length |", "|---|---|---|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        for rule in RULES:
            runs = complete.get((setting, rule))
            if not runs:
                continue
            r = list(runs.values())
            lines.append(
                f"| {setting} | {rule} | {len(r)} | {_ms([x['start_response_length_cv'] for x in r], '.2f')}"
                f" | {_ms([x['start_diag_length_gap'] for x in r], '.2f')}"
                f" | {_ms([x['final_acc'] for x in r])} | {_ms([x['auc'] for x in r])}"
                f" | {_ms([x['max_drop'] for x in r])} | {_ms([x['final_length'] for x in r], '.1f')} |")
    return "\n".join(lines)


def plot(complete: dict, out: str) -> list[str]:
    """Accuracy curves and length diagnostics per setting: seed mean, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in SETTINGS if any((s, r) in complete for r in RULES)]
    if not settings:
        return []
    colors = dict(sequence="tab:blue", token="tab:orange", balanced="tab:green")
    written = []
    for name, key, ylabel in (("accuracy", "curve", "accuracy (64 samples/step)"),
                              ("diagnostics", "gap", "length gap Lbar-/Lbar+ (mixed groups)"),
                              ("length", "length", "mean response length (tokens)")):
        fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.4), squeeze=False)
        for ax, setting in zip(axes[0], settings):
            for rule in RULES:
                runs = complete.get((setting, rule))
                if not runs:
                    continue
                n = min(len(r[key]) for r in runs.values())
                y_ST = np.array([r[key][:n] for r in runs.values()], float)
                if key == "curve":  # 5-step moving average: single steps are very noisy
                    y_ST = np.array([np.convolve(y, np.ones(SMOOTH) / SMOOTH, mode="valid")
                                     for y in y_ST])
                x = np.arange(1, y_ST.shape[1] + 1)
                ax.plot(x, np.nanmean(y_ST, 0), color=colors[rule], label=f"{rule} (n={len(y_ST)})")
                ax.fill_between(x, np.nanmin(y_ST, 0), np.nanmax(y_ST, 0), color=colors[rule],
                                alpha=0.15)
            ax.set_title(setting)
            ax.set_xlabel("RL step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/length_study")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--steps", type=int, default=100, help="steps of a complete run")
    args = ap.parse_args()
    complete, partial = collect(args.root, args.steps)
    os.makedirs(args.out, exist_ok=True)
    md = table(complete)
    if partial:
        md += "\n\nPartial runs (fewer than {} steps, not in the table): {}".format(
            args.steps, ", ".join(f"{s}/{r}_s{seed} ({v['steps']})"
                                  for (s, r), runs in sorted(partial.items())
                                  for seed, v in sorted(runs.items())))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({f"{s}/{r}": {str(k): {kk: vv for kk, vv in v.items()
                                         if kk not in ("curve", "gap", "length")}
                                for k, v in runs.items()}
                   for (s, r), runs in sorted(complete.items())}, f, indent=1)
    print(md)
    for p in plot(complete, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
