"""Per-step time split of the embedded default run: sampling, scoring, update, checkpoint.

Runs `configs/default.py` (optionally shortened) in a fresh temporary workdir and
summarises the per-step phase times the trainer logs in metrics.jsonl. Steps before
`--skip` (compilation) are left out of the medians.

    .venv/bin/python benchmarks/trainer.py --steps 120 --skip 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ba_jax.metrics import read_metrics  # noqa: E402

PHASES = ("sample_time_s", "score_time_s", "update_time_s", "checkpoint_time_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=10, help="leading steps left out (compilation)")
    ap.add_argument("--workdir", default=None, help="summarise an existing run instead")
    args = ap.parse_args()
    workdir = args.workdir
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="ba_jax_bench_")
        subprocess.run(
            [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py",
             f"--workdir={workdir}", f"--config.num_train_steps={args.steps}",
             "--config.checkpoint.every_steps=20"],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rows = read_metrics(workdir)[args.skip :]
    if not rows:
        raise SystemExit(f"no steps after --skip={args.skip} in {workdir}")
    total = np.array([r["step_time_s"] for r in rows])
    print(f"{len(rows)} steps from {workdir}; median step {np.median(total) * 1e3:.1f} ms, "
          f"mean {total.mean() * 1e3:.1f} ms")
    print("| phase | median ms | mean ms | share of mean step |")
    print("|---|---:|---:|---:|")
    for key in PHASES:
        v = np.array([r[key] for r in rows])
        print(f"| {key.removesuffix('_time_s')} | {np.median(v) * 1e3:.1f} | {v.mean() * 1e3:.1f} | "
              f"{v.mean() / total.mean():.0%} |")
    other = total - sum(np.array([r[k] for r in rows]) for k in PHASES)
    print(f"| other (host glue, logging) | {np.median(other) * 1e3:.1f} | {other.mean() * 1e3:.1f} | "
          f"{other.mean() / total.mean():.0%} |")


if __name__ == "__main__":
    main()
