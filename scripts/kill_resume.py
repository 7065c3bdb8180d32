"""Kill-anywhere resume check: SIGKILL a training run at random moments, resume, compare.

Runs the `debug` default config (checkpoint every step, so kills land in saves too)
once uninterrupted, then again under repeated SIGKILLs: each trial starts
`python -m ba_jax.main` on the same workdir, kills it after a random delay (or, for
every third trial, the moment a checkpoint save is seen in progress), and restarts until
the run completes. The finished run must have identical parameters and identical
metrics (timing fields excepted) for every step, and every checkpoint left must restore.

    .venv/bin/python scripts/kill_resume.py --trials 10 --steps 6
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("step_time_s", "update_time_s", "checkpoint_time_s", "sample_time_s", "score_time_s",
          "sampling_time_share", "tokens_per_s", "weight_sync_time_s")


def command(workdir: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:debug",
            f"--workdir={workdir}", f"--config.num_train_steps={steps}",
            "--config.checkpoint.every_steps=1", "--config.checkpoint.max_to_keep=2"]


def env(cache_dir: str) -> dict:
    # A persistent compilation cache makes each restart cheap; it stores the very same
    # executables, so numerics are unchanged.
    e = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    e.pop("XLA_FLAGS", None)  # one CPU device, as `make train` runs
    return e


def run_to_end(workdir: str, steps: int, cache_dir: str) -> None:
    subprocess.run(command(workdir, steps), cwd=REPO, env=env(cache_dir), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)


def saving(workdir: str) -> bool:
    return bool(glob.glob(os.path.join(workdir, "checkpoints", "*orbax-checkpoint-tmp*")))


def killed_run(workdir: str, steps: int, cache_dir: str, trials: int, max_delay_s: float,
               rng: random.Random) -> list[str]:
    """Kill/restart until the run completes; returns a log line per launch."""
    log = []
    for trial in range(trials):
        proc = subprocess.Popen(command(workdir, steps), cwd=REPO, env=env(cache_dir),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.monotonic()
        during_save = trial % 3 == 2
        delay = rng.uniform(0.5, max_delay_s)
        while proc.poll() is None:
            elapsed = time.monotonic() - t0
            if (during_save and saving(workdir)) or (not during_save and elapsed >= delay) \
                    or elapsed > max_delay_s * 4:
                break
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            what = "during a save" if during_save and saving(workdir) else f"after {elapsed:.2f}s"
            log.append(f"trial {trial}: killed {what}")
        else:
            err = proc.stderr.read().decode()[-2000:]
            if proc.returncode != 0:
                raise RuntimeError(f"trial {trial}: run failed (rc {proc.returncode}):\n{err}")
            log.append(f"trial {trial}: finished before the kill")
        proc.stderr.close()
    run_to_end(workdir, steps, cache_dir)  # resume to completion
    log.append("resumed to completion")
    return log


def debug_config():
    sys.path.insert(0, REPO)
    from ba_jax import run_config

    return run_config.load_config(os.path.join(REPO, "configs", "default.py:debug"))


def compare(ref: str, other: str) -> list[str]:
    """Differences between two finished runs (empty: identical)."""
    import jax
    import numpy as np

    sys.path.insert(0, REPO)
    from ba_jax import build, checkpoint, train
    from ba_jax.metrics import read_metrics

    problems = []
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    a, b = strip(read_metrics(ref)), strip(read_metrics(other))
    if a != b:
        problems.append(f"metrics differ: {len(a)} vs {len(b)} lines")
    leaves = []
    cfg = debug_config()
    for wd in (ref, other):
        mesh = build.make_mesh(cfg, jax.devices()[:1])
        _, p0 = build.init_policy(cfg, mesh)
        params, step = checkpoint.load_params(os.path.join(wd, "checkpoints"), p0)
        leaves.append((step, jax.tree.leaves(jax.device_get(params))))
        ck = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"))
        tx, _ = build.make_optimizer(cfg)
        for s in ck.steps():  # every checkpoint left behind must restore
            ck.restore(s, train.init_state(p0, tx, mesh))
        ck.close()
    leftovers = glob.glob(os.path.join(other, "checkpoints", "*orbax-checkpoint-tmp*"))
    if leftovers:
        problems.append(f"partial saves left behind: {leftovers}")
    if leaves[0][0] != leaves[1][0]:
        problems.append(f"final steps differ: {leaves[0][0]} vs {leaves[1][0]}")
    for x, y in zip(leaves[0][1], leaves[1][1]):
        if not np.array_equal(x, y):
            problems.append("parameters differ")
            break
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max_delay_s", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ba_jax_kill_")
    cache = os.path.join(root, "jax_cache")
    ref, killed = os.path.join(root, "ref"), os.path.join(root, "killed")
    run_to_end(ref, args.steps, cache)
    for line in killed_run(killed, args.steps, cache, args.trials, args.max_delay_s,
                           random.Random(args.seed)):
        print(line)
    problems = compare(ref, killed)
    print("identical to the uninterrupted run" if not problems else "\n".join(problems))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
