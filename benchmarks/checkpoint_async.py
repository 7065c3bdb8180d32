"""Step time with asynchronous vs synchronous checkpoints, a checkpoint every step.

The embedded task on the 29M reference model (the sampler benchmark's shapes: 8 layers,
width 512, MLP 1536, 8 query / 4 kv heads of 64, vocabulary 8192; float32 parameters and
AdamW state, 0.35 GB a checkpoint), 16 prompts x 16 samples, `checkpoint.every_steps=1`.
Each mode runs in a fresh workdir, alternating async / sync for `--rounds` rounds; the
per-step wall time is the step (sampling, scoring, update) plus the time the loop then
blocked on its save (`checkpoint_time_s` of the next line: with async saves the copy to
host memory and any wait for the previous save still being written). Steps before
`--skip` (compilation) are left out.

    .venv/bin/python benchmarks/checkpoint_async.py --steps 12 --skip 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ba_jax.metrics import read_metrics  # noqa: E402

MODEL = {"model.vocab_size": 8192, "model.hidden_size": 512, "model.intermediate_size": 1536,
         "model.num_layers": 8, "model.num_heads": 8, "model.num_kv_heads": 4,
         "model.head_dim": 64, "model.max_position_embeddings": 1024,
         "arithmetic.warmup_steps": 1}


def run(workdir: str, steps: int, async_save: bool) -> list[dict]:
    over = {**MODEL, "num_train_steps": steps, "checkpoint.every_steps": 1,
            "checkpoint.max_to_keep": 2, "checkpoint.async_save": async_save}
    subprocess.run([sys.executable, "-m", "ba_jax.main", "--config=configs/default.py",
                    f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in over.items())],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_metrics(workdir)


def per_step(rows: list[dict], skip: int) -> tuple[np.ndarray, np.ndarray]:
    """(wall seconds of each step including the save after it, the save's blocking time)."""
    step = np.array([r["step_time_s"] for r in rows[skip:-1]])
    save = np.array([r["checkpoint_time_s"] for r in rows[skip + 1:]])
    return step + save, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ba_jax_ckpt_")
    results: dict[bool, list] = {True: [], False: []}
    try:
        for r in range(args.rounds):
            for mode in (True, False):
                wd = os.path.join(root, f"{'async' if mode else 'sync'}{r}")
                results[mode].append(per_step(run(wd, args.steps, mode), args.skip))
                shutil.rmtree(wd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| saves | median step + save | median blocking save | rounds x steps |")
    print("|---|---:|---:|---:|")
    med = {}
    for mode in (False, True):
        walls = np.concatenate([w for w, _ in results[mode]])
        saves = np.concatenate([s for _, s in results[mode]])
        med[mode] = float(np.median(walls))
        print(f"| {'async' if mode else 'sync'} | {med[mode] * 1e3:.0f} ms | "
              f"{np.median(saves) * 1e3:.0f} ms | {args.rounds} x {len(walls) // args.rounds} |")
    print(f"\nasync / sync step time: {med[True] / med[False]:.2f}")


if __name__ == "__main__":
    main()
