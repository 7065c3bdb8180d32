"""Kill-anywhere resume check: SIGKILL a training run at random moments, resume, compare.

Runs the `debug` default config (checkpoint every step, so kills land in saves too)
once uninterrupted, then again under repeated SIGKILLs: each trial starts
`python -m ba_jax.main` on the same workdir, kills it after a random delay (or, for
every third trial, the moment a checkpoint save is seen in progress), and restarts until
the run completes. The finished run must have identical parameters and identical
metrics (timing fields excepted) for every step, and every checkpoint left must restore.

    .venv/bin/python scripts/kill_resume.py --trials 10 --steps 6
    .venv/bin/python scripts/kill_resume.py --signal TERM --trials 8 --steps 12 --every_steps 4
    .venv/bin/python scripts/kill_resume.py --set grpo.max_tokens_per_device=80   # packed

`--signal TERM` (or INT) checks the preemption path instead: each launch is stopped by the
signal at a random moment in the loop (or during a save; every fourth twice) and must stop
after the step in flight with a committed checkpoint there (`signalled_run`); a signal that
lands after the last step's check must leave the run complete, saying so.
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


# `--set KEY=VALUE` overrides, given to every launch (both runs: the uninterrupted one too)
OVERRIDES: list[str] = []


def command(workdir: str, steps: int, every_steps: int = 1) -> list[str]:
    return [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:debug",
            f"--workdir={workdir}", f"--config.num_train_steps={steps}",
            f"--config.checkpoint.every_steps={every_steps}", "--config.checkpoint.max_to_keep=2",
            *(f"--config.{kv}" for kv in OVERRIDES)]


def env(cache_dir: str) -> dict:
    # A persistent compilation cache makes each restart cheap; it stores the very same
    # executables, so numerics are unchanged.
    e = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    e.pop("XLA_FLAGS", None)  # one CPU device, as `make train` runs
    return e


def run_to_end(workdir: str, steps: int, cache_dir: str, every_steps: int = 1) -> None:
    subprocess.run(command(workdir, steps, every_steps), cwd=REPO, env=env(cache_dir), check=True,
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
            return log  # complete: another launch would only say so
        proc.stderr.close()
    run_to_end(workdir, steps, cache_dir)  # resume to completion
    log.append("resumed to completion")
    return log


def _lines(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except OSError:
        return 0


def _committed_steps(workdir: str) -> list[int]:
    try:
        return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                      if d.isdigit())
    except OSError:
        return []


def signalled_run(workdir: str, steps: int, cache_dir: str, trials: int, rng: random.Random,
                  signum: int | tuple[int, ...] = signal.SIGTERM, every_steps: int = 1,
                  max_delay_s: float = 0.5) -> list[str]:
    """Stop/restart by `signum` (a tuple: launch i gets signum[i % len]) until the run
    completes: each launch gets the signal at a random moment once it is past start-up (a
    metrics line of its own written), every third one the moment a save is seen in
    progress, every fourth one twice (the second stops it at once). After a single signal
    the run must exit with 128 + signal, its last stderr line saying where it stopped, with
    a committed checkpoint at that step and exactly one metrics line per step up to it:
    nothing is redone by the resume. A signal that lands once the last step is in flight or
    done may instead leave the run complete, saying so (exit 0), or, during the plots, kill
    it. Returns a log line per launch; raises AssertionError on a broken promise."""
    log, signums = [], signum if isinstance(signum, tuple) else (signum,)
    for trial in range(trials):
        sig = signums[trial % len(signums)]
        base = _lines(workdir)
        proc = subprocess.Popen(command(workdir, steps, every_steps), cwd=REPO,
                                env=env(cache_dir), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        during_save, twice = trial % 3 == 2, trial % 4 == 3
        # counted in steps, not seconds, so whether a launch is stopped does not depend on the
        # machine's speed: past start-up and `skip` more steps, then a random moment of a step
        skip, delay, t_in = rng.randint(0, 2), rng.uniform(0.0, max_delay_s), None
        while proc.poll() is None:
            if t_in is None and _lines(workdir) > base + skip:
                t_in = time.monotonic()  # in the loop: this launch wrote its steps
            if t_in is not None and ((during_save and saving(workdir))
                                     or (not during_save and time.monotonic() - t_in >= delay)
                                     or time.monotonic() - t_in > 10):
                break
            time.sleep(0.002)
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-2000:]
            proc.stderr.close()
            assert proc.returncode == 0, f"trial {trial}: rc {proc.returncode}:\n{err}"
            log.append(f"trial {trial}: finished before the signal")
            return log
        where = "during a save" if during_save and saving(workdir) else "in the loop"
        proc.send_signal(sig)
        in_flight = _lines(workdir) + 1  # at the latest: the step after the last line seen
        if twice:
            time.sleep(0.05)
            proc.send_signal(sig)
        err = proc.communicate(timeout=300)[1].decode(errors="replace")
        lines = [line for line in err.replace("\r", "\n").split("\n") if line.strip()]
        name = signal.Signals(sig).name
        complete_line = f"ba_jax: {name} came after the last step: the run is complete"
        if in_flight >= steps and _lines(workdir) == steps and _committed_steps(
                workdir)[-1:] == [steps] and (
                proc.returncode == -sig  # during the plots, once training had returned
                or (proc.returncode == 0 and complete_line in lines)):
            log.append(f"trial {trial}: signalled as the run ended (rc {proc.returncode})")
            return log
        assert proc.returncode == 128 + sig, (trial, proc.returncode, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        if twice:
            log.append(f"trial {trial}: {name} twice {where}: stopped at once")
            continue
        done = _lines(workdir)
        stop_line = f"ba_jax: stopped by {name} after step {done}: "
        assert lines[-1].startswith(stop_line), (stop_line, lines[-3:])
        assert _committed_steps(workdir)[-1] == done, (done, _committed_steps(workdir))
        assert done <= in_flight, f"stopped after step {done}, the signal came in {in_flight}"
        log.append(f"trial {trial}: {name} {where}: stopped after step {done} "
                   f"(launch started at {base})")
    run_to_end(workdir, steps, cache_dir, every_steps)
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
    ap.add_argument("--signal", choices=("KILL", "TERM", "INT", "TERM,INT"), default="KILL",
                    help="KILL: kill -9 anywhere; TERM/INT: the preemption path (stop after "
                         "the step in flight, checked: exit status, stop line, checkpoint); "
                         "TERM,INT: the two in turn")
    ap.add_argument("--every_steps", type=int, default=1, help="checkpoint interval")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every launch, e.g. "
                         "grpo.max_tokens_per_device=80 (the packed step)")
    args = ap.parse_args()
    OVERRIDES.extend(args.set)
    root = tempfile.mkdtemp(prefix="ba_jax_kill_")
    cache = os.path.join(root, "jax_cache")
    ref, killed = os.path.join(root, "ref"), os.path.join(root, "killed")
    run_to_end(ref, args.steps, cache, args.every_steps)
    if args.signal == "KILL":
        log = killed_run(killed, args.steps, cache, args.trials, args.max_delay_s,
                         random.Random(args.seed))
    else:
        log = signalled_run(killed, args.steps, cache, args.trials, random.Random(args.seed),
                            tuple(getattr(signal, f"SIG{n}") for n in args.signal.split(",")),
                            args.every_steps,
                            min(args.max_delay_s, 0.5))
    for line in log:
        print(line)
    problems = compare(ref, killed)
    print("identical to the uninterrupted run" if not problems else "\n".join(problems))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
