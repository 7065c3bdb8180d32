"""The numbers of an evaluation and their reports: pass@k, majority vote, per-benchmark metrics.

Lives here: `pass_at_k` (the unbiased estimator; public as `ba_jax.evaluate.pass_at_k`),
`majority_index` (maj@k's vote), `benchmark_metrics` (avg@k / pass@k / maj@k of one
benchmark's correctness table), `mean_row` (the mean over benchmarks) and the results.json /
results.md writers (`results_table`, `write_results`).

Not here: sampling, scoring responses and the command (`evaluate.py`), the benchmark files
(`eval_sets.py`). Only numpy and the standard library: the math scorer's workers re-import
`ba_jax.evaluate`, and with it this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------ metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right: 1 - C(n-c, k) / C(n, k)."""
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"pass_at_k: {name} must be an integer, got {v!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a right sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): c factors in (0, 1], no huge binomials.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def majority_index(keys: Sequence[str | None],
                   same: Callable[[str, str], bool] | None = None) -> int | None:
    """First sample of the largest answer cluster (ties: the cluster seen first), or None.

    Samples with equal keys share a cluster; `same(earlier_key, later_key)` may merge more
    (math-verify equivalence). A sample joins the first cluster whose first key matches it.
    Samples without an answer (None) do not vote.
    """
    clusters: list[list[int]] = []
    for i, key in enumerate(keys):
        if key is None:
            continue
        for members in clusters:
            rep = keys[members[0]]
            if rep == key or (same is not None and same(rep, key)):
                members.append(i)
                break
        else:
            clusters.append([i])
    if not clusters:
        return None
    return max(clusters, key=len)[0]  # max keeps the first of equal lengths


def benchmark_metrics(correct_PG: np.ndarray, majority_P: Sequence[int | None] | None) -> dict:
    """avg@k, pass@k (n = k) and maj@k from per-sample correctness and majority picks."""
    correct_PG = np.asarray(correct_PG, bool)
    P, G = correct_PG.shape
    c_P = correct_PG.sum(1)
    out = {
        "avg@k": float(np.mean(c_P / G)),
        "pass@k": float(np.mean([pass_at_k(G, int(c), G) for c in c_P])),
        "maj@k": None,
    }
    if majority_P is not None:
        out["maj@k"] = float(np.mean(
            [i is not None and bool(correct_PG[p, i]) for p, i in enumerate(majority_P)]))
    return out


# ------------------------------------------------------------------------------ reports


def mean_row(entries: dict[str, dict]) -> dict:
    """Unweighted mean over benchmarks (maj@k over those that report it)."""
    out: dict[str, Any] = {"num_benchmarks": len(entries),
                           "num_problems": sum(e["num_problems"] for e in entries.values())}
    for metric in ("avg@k", "pass@k", "maj@k"):
        vals = [e[metric] for e in entries.values() if e[metric] is not None]
        out[metric] = float(np.mean(vals)) if vals else None
    return out


def results_table(results: dict) -> str:
    """Markdown table: benchmark, problems, avg@k, pass@k, maj@k (percent), then the mean."""
    k = results["settings"]["k"]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines = [f"| benchmark | problems | avg@{k} | pass@{k} | maj@{k} |", "|---|---:|---:|---:|---:|"]
    rows = list(results["benchmarks"].items()) + [("mean", results["mean"])]
    for name, e in rows:
        lines.append(f"| {name} | {e['num_problems']} | {pct(e['avg@k'])} | {pct(e['pass@k'])} | "
                     f"{pct(e['maj@k'])} |")
    return "\n".join(lines) + "\n"


def write_results(out_dir: str, results: dict) -> None:
    """results.json and results.md in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    s = results["settings"]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        step = "" if s["step"] is None else f" (step {s['step']})"
        f.write(f"# Evaluation of {s['checkpoint']}{step}\n\n"
                f"k={s['k']}, temperature={s['temperature']}, top_p={s['top_p']}, "
                f"max_new_tokens={s['max_new_tokens']}, seed={s['seed']}; values in percent.\n\n")
        f.write(results_table(results))

