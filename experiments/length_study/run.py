"""The length-bias study in one command: data, warm-up, 3 rules x settings x seeds, analysis.

  .venv/bin/python experiments/length_study/run.py all        # everything (about an hour)
  .venv/bin/python experiments/length_study/run.py prepare --setting=large_gap --seed=0

`prepare` writes the setting's problems (JSONL, processed DAPO shape), the character
tokenizer, and a warm-started policy checkpoint; `all` prepares one warm-up per setting
(shared by its seeds; `--warmup_per_seed` for one per seed), then runs every (setting,
seed, rule) with `python -m ba_jax.main` two at a time, skips runs whose metrics are
complete, and finally calls analyze.py. The warm-up loop lives here, on the supervised
step of ba_jax/tasks/warmup.py (whose own loop, `warm_up`, is the arithmetic task's): every
rule of a setting starts from the same checkpoint, so runs differ only in the rule and the
RL seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from ba_jax.tasks import length_task  # noqa: E402

SETTINGS = ("small_gap", "large_gap", "large_variation")
RULES = ("sequence", "token", "balanced")
SEEDS = (0, 1, 2)
CONFIG = "configs/length_study.py"


def load_config(setting: str):
    """The study config of one setting (configs/length_study.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("length_study_config", os.path.join(REPO, CONFIG))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(setting)


def warm_start(setting: str, seed: int, root: str, *, steps: int, batch_size: int,
               learning_rate: float) -> dict:
    """Supervised warm-up on the setting's right/wrong mixture; saves a convert_hf checkpoint."""
    import jax
    import optax
    from flax import nnx

    from ba_jax import build
    from ba_jax.models import convert_hf
    from ba_jax.tasks import arithmetic, warmup

    task = length_task.SETTINGS[setting]
    cfg = load_config(setting)
    tok_dir = os.path.join(root, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        arithmetic.save_tokenizer(tok_dir)
    data_path = os.path.join(root, setting, "problems.jsonl")
    problems = length_task.write_problems(data_path, task, seed=0)
    with cfg.unlocked():
        cfg.tokenizer_path, cfg.data.path = tok_dir, data_path
        cfg.model.init, cfg.seed = "random", seed
    tokenizer = build.load_tokenizer(cfg, root)
    prompt_set = build.load_prompt_set(cfg, tokenizer, root)
    assert prompt_set.ground_truths == [str(p.answer) for p in problems], "loader reordered rows"
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    tx = optax.adam(optax.cosine_decay_schedule(learning_rate, steps, alpha=0.1))
    opt_state = tx.init(params)
    Tp = max(len(p) for p in prompt_set.prompt_ids)
    # The embedded task's supervised step; p_target is the probability of the exact right
    # response on rows whose target is it.
    step = warmup.make_sft_step(graphdef, tx)
    rng = np.random.default_rng([seed, 11])
    t0, log = time.time(), []
    for it in range(1, steps + 1):
        idx = rng.integers(len(problems), size=batch_size)
        texts, right_B = length_task.warmup_responses(rng, [problems[i] for i in idx], task)
        b = warmup.sft_batch([prompt_set.prompt_ids[j] for j in idx], texts, tokenizer,
                             prompt_len=Tp, response_len=cfg.rollout.max_new_tokens,
                             target_B=right_B)
        params, opt_state, loss, p_right = step(params, opt_state, b)
        if it % 100 == 0 or it == steps:
            log.append(dict(step=it, loss=float(loss), p_right=float(p_right)))
            print(f"[{setting} s{seed}] warm-up {it}/{steps}: loss {float(loss):.4f} "
                  f"p(right | right target) {float(p_right):.3f} ({time.time() - t0:.0f}s)", flush=True)
    out = os.path.join(root, setting, f"warmup_s{seed}")
    shutil.rmtree(out, ignore_errors=True)  # Orbax refuses to overwrite
    convert_hf.save_checkpoint(nnx.merge(graphdef, params), out)
    with open(os.path.join(out, "warmup_log.json"), "w") as f:
        json.dump(log, f)
    return log[-1]


def run_dir(root: str, setting: str, rule: str, seed: int) -> str:
    return os.path.join(root, setting, f"{rule}_s{seed}")


def is_complete(workdir: str, steps: int) -> bool:
    """True when metrics.jsonl holds the run's last step."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return any(json.loads(line).get("step") == steps for line in f if line.strip())


def train_command(root: str, setting: str, rule: str, seed: int, extra: list[str],
                  warmup_seed: int) -> list[str]:
    return [sys.executable, "-m", "ba_jax.main", f"--config={CONFIG}:{setting}",
            f"--workdir={run_dir(root, setting, rule, seed)}", f"--config.seed={seed}",
            f"--config.grpo.aggregation={rule}",
            f"--config.tokenizer_path={os.path.join(root, 'tokenizer')}",
            f"--config.data.path={os.path.join(root, setting, 'problems.jsonl')}",
            f"--config.model.init_path={os.path.join(root, setting, f'warmup_s{warmup_seed}')}", *extra]


def run_pool(jobs: list[tuple[list[str], str]], parallel: int, env: dict) -> list[str]:
    """Run (command, log file) jobs `parallel` at a time; the logs of failed jobs."""
    failed, running = [], []
    jobs = list(jobs)
    while jobs or running:
        while jobs and len(running) < parallel:
            cmd, log_path = jobs.pop(0)
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            with open(log_path, "w") as log:
                p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((p, log_path, time.time()))
            print(f"started {log_path}", flush=True)
        time.sleep(1)
        for item in list(running):
            p, log_path, t = item
            if p.poll() is not None:
                running.remove(item)
                print(f"done {log_path} rc={p.returncode} in {time.time() - t:.0f}s", flush=True)
                if p.returncode:
                    failed.append(log_path)
    return failed


def run_all(args) -> None:
    # One XLA thread per process: two runs side by side on two cores do not fight.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    settings = args.settings.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    rules = args.rules.split(",")
    prep = [([sys.executable, os.path.abspath(__file__), "prepare", f"--setting={s}",
              f"--seed={seed}", f"--root={args.root}", f"--warmup_steps={args.warmup_steps}"],
             os.path.join(args.root, s, f"warmup_s{seed}.log"))
            for seed in (seeds if args.warmup_per_seed else seeds[:1]) for s in settings
            if not os.path.exists(os.path.join(args.root, s, f"warmup_s{seed}", "warmup_log.json"))]
    failed = run_pool(prep, args.parallel, env)
    if failed:
        sys.exit(f"warm-up failed, see {failed}")
    steps = args.steps or load_config(settings[0]).num_train_steps
    extra = [f"--config.num_train_steps={args.steps}"] if args.steps else []
    # Seed-major order, so that a partial study has every (setting, rule) cell for seed 0.
    jobs = [(train_command(args.root, s, r, seed, extra,
                           seed if args.warmup_per_seed else seeds[0]),
             os.path.join(run_dir(args.root, s, r, seed), "train.log"))
            for seed in seeds for s in settings for r in rules
            if not is_complete(run_dir(args.root, s, r, seed), steps)]
    failed = run_pool(jobs, args.parallel, env)
    if failed:
        print(f"failed runs (left out of the analysis): {failed}", flush=True)
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "analyze.py"),
                    f"--root={args.root}", f"--out={args.out}", f"--steps={steps}"], check=True, cwd=REPO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("prepare", "all"))
    ap.add_argument("--root", default=os.path.join(REPO, "runs", "length_study"))
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--setting", default="small_gap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--steps", type=int, default=0, help="override num_train_steps (0: config's)")
    ap.add_argument("--warmup_steps", type=int, default=400)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--warmup_per_seed", action="store_true",
                    help="one warm-up per (setting, seed); default: one per setting, shared by "
                         "its seeds, which then differ in RL sampling only")
    args = ap.parse_args()
    if args.command == "prepare":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(warm_start(args.setting, args.seed, args.root, steps=args.warmup_steps,
                         batch_size=64, learning_rate=3e-3))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
