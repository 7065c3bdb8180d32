"""The length-bias study: the counter task (ba_jax/tasks/length_task.py) on CPU.

Usage: arg is a setting name of `length_task.SETTINGS` (small_gap | large_gap |
large_variation | short_wrong), or `debug` (small_gap, a few tiny steps, for tests).
The run needs the setting's problems, the tokenizer and a warm-started checkpoint, which
`experiments/length_study/run.py` writes (and then launches every run); one run by hand:
  python experiments/length_study/run.py prepare --setting=large_gap --seed=0
  python -m ba_jax.main --config=configs/length_study.py:large_gap \\
    --workdir=runs/length_study/large_gap/balanced_s0 --config.seed=0 \\
    --config.grpo.aggregation=balanced \\
    --config.model.init_path=runs/length_study/large_gap/warmup_s0
Expected: accuracy starts near the warm-up's right share (about 0.3) and climbs; the
study's results and their reading are in experiments/length_study/README.md.
"""

import importlib.util
import os

import ml_collections

ROOT = "runs/length_study"  # where run.py writes data, tokenizer and runs


def _default() -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(
        "ba_jax_default_config", os.path.join(os.path.dirname(__file__), "default.py"))
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    return default.get_config()


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    setting = "small_gap" if arg == "debug" else arg
    valid = ("small_gap", "large_gap", "large_variation", "short_wrong")
    if setting not in valid:
        raise ValueError(f"configs/length_study.py: unknown setting {arg!r} "
                         f"(valid: {', '.join(valid)}, debug)")
    c = _default()
    c.task = "dataset"
    c.tokenizer_path = f"{ROOT}/tokenizer"
    c.data.path = f"{ROOT}/{setting}/problems.jsonl"
    c.data.format = "dapo17k"
    c.data.template = "plain"
    c.data.max_prompt_tokens = 32
    c.model.init = "checkpoint"
    c.model.init_path = f"{ROOT}/{setting}/warmup_s0"
    c.num_train_steps = 100
    c.log_every = 10
    # 8 prompts x 8 samples: enough mixed groups per step for the diagnostics, small
    # enough for ~2 minutes per run on one CPU core.
    c.rollout.prompts_per_step = 8
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 64  # longest reference response is 53 tokens
    c.optim.learning_rate = 5e-4
    c.checkpoint.every_steps = 1000  # only the last step is kept
    c.checkpoint.max_to_keep = 1
    if arg == "debug":
        c.num_train_steps = 2
        c.rollout.prompts_per_step = 4
        c.rollout.num_samples = 4
        c.log_every = 1
    return c
