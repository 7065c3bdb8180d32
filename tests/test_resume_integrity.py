"""Resume integrity (issue 37 item 3): a checkpoint records its config and a fingerprint of
its data; resuming it with another experiment is a one-line start-up error naming the keys,
unless `resume_changed_config=True`, which continues and records the change."""

import os
import subprocess
import sys

import jax
import pytest

from ba_jax import checkpoint, resume, train
from ba_jax.metrics import read_metrics
from ba_jax.run_config import ConfigError
from test_reliability import _dataset_cfg, _good_rows, _jsonl, char_tokenizer  # noqa: F401
from test_train import REPO, debug_config


def test_changes_names_experiment_keys_only():
    old = {"seed": 0, "log_every": 10, "num_train_steps": 10, "grpo": {"aggregation": "balanced"},
           "optim": {"learning_rate": 1e-3, "schedule": "cosine", "warmup_steps": 5},
           "checkpoint": {"every_steps": 5}, "mesh": {"data": -1}, "removed": 1}
    new = {"seed": 0, "log_every": 1, "num_train_steps": 10, "grpo": {"aggregation": "token"},
           "optim": {"learning_rate": 1e-3, "schedule": "cosine", "warmup_steps": 5},
           "checkpoint": {"every_steps": 1}, "mesh": {"data": 4}, "added": 2}
    data = {"rows": 8, "prompts_sha256": "a"}
    assert resume.changes(old, new, data, data) == [("grpo.aggregation", "balanced", "token")]
    assert resume.changes(old, old, data, dict(data, rows=9)) == [("data.rows", 8, 9)]
    assert resume.changes(old, old, None, dict(data, rows=9)) == []  # an older checkpoint
    # the run's length: free while every update so far had the learning rate it has under
    # the new length (the cosine warm-up), an experiment key after that
    longer = dict(old, num_train_steps=20)
    assert resume.changes(old, longer, data, data, updates_done=5) == []
    assert resume.changes(old, longer, data, data, updates_done=6) == [
        ("num_train_steps", 10, 20)]
    constant = {**old, "optim": dict(old["optim"], schedule="constant")}
    assert resume.changes(constant, dict(constant, num_train_steps=20), data, data,
                          updates_done=100) == []


def test_another_experiment_is_refused_in_one_line(tmp_path):
    """The issue's case: a `balanced` run at lr 1.5e-3 resumed with `token` and lr 0.5."""
    wd = str(tmp_path)
    train.run_training(debug_config(num_train_steps=2), wd)
    proc = subprocess.run(
        [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:debug",
         f"--workdir={wd}", "--config.num_train_steps=3", "--config.grpo.aggregation=token",
         "--config.optim.learning_rate=0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ba_jax:")]
    assert len(lines) == 1, proc.stderr
    assert "grpo.aggregation: 'balanced' -> 'token'" in lines[0]
    assert "optim.learning_rate: 0.0015 -> 0.5" in lines[0]
    assert "resume_changed_config=True" in lines[0]
    assert [r["step"] for r in read_metrics(wd)] == [1, 2]  # nothing was appended


def test_changed_seed_or_rows_are_start_up_errors(tmp_path):
    wd = str(tmp_path)
    train.run_training(debug_config(num_train_steps=1), wd)
    with pytest.raises(ConfigError, match=r"seed: 0 -> 3"):
        train.run_training(debug_config(num_train_steps=2, seed=3), wd)
    with pytest.raises(ConfigError, match=r"arithmetic.num_problems: 100 -> 50.*data.rows"):
        train.run_training(debug_config(**{"num_train_steps": 2,
                                           "arithmetic.num_problems": 50}), wd)
    assert [r["step"] for r in read_metrics(wd)] == [1]


def test_edited_data_with_the_same_rows_is_refused(tmp_path, char_tokenizer):  # noqa: F811
    path = tmp_path / "d.jsonl"
    rows = _good_rows()
    _jsonl(path, rows)
    wd = str(tmp_path / "run")
    over = dict(tokenizer_path=char_tokenizer)
    train.run_training(_dataset_cfg(path, num_train_steps=1, **over), wd)
    rows[3]["solution"] = "99"  # a wrong answer, the same row count
    _jsonl(path, rows)
    with pytest.raises(ConfigError, match=r"data.file_sha256: .*; data.prompts_sha256"):
        train.run_training(_dataset_cfg(path, num_train_steps=2, **over), wd)
    # the same data at another path resumes: data is compared by content
    moved = tmp_path / "moved.jsonl"
    _jsonl(path, _good_rows())
    os.rename(path, moved)
    train.run_training(_dataset_cfg(moved, num_train_steps=2, **over), wd)
    assert [r["step"] for r in read_metrics(wd)] == [1, 2]


def test_free_keys_resume_and_forced_changes_are_recorded(tmp_path):
    wd = str(tmp_path)
    train.run_training(debug_config(num_train_steps=1), wd)
    free = {"log_every": 5, "checkpoint.every_steps": 7, "checkpoint.max_to_keep": 4,
            "rollout.num_slots": 4, "reward.num_workers": 1, "mesh.data": 2}
    train.run_training(debug_config(num_train_steps=2, **free), wd, devices=jax.devices()[:2])
    assert "config_changes" not in read_metrics(wd)[-1]
    changed = {"grpo.aggregation": "token", "optim.learning_rate": 0.5}
    with pytest.raises(ConfigError, match="grpo.aggregation"):
        train.run_training(debug_config(num_train_steps=3, **changed), wd)
    train.run_training(debug_config(num_train_steps=3, resume_changed_config=True, **changed),
                       wd)
    rows = read_metrics(wd)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["config_changes"] == ("grpo.aggregation: 'balanced' -> 'token'; "
                                         "optim.learning_rate: 0.0015 -> 0.5")
    # the checkpoints written since hold the new config: the next resume compares with it
    train.run_training(debug_config(num_train_steps=4, **changed), wd)
    assert "config_changes" not in read_metrics(wd)[-1]


def test_another_model_shape_is_named_before_any_array_is_read(tmp_path):
    wd = str(tmp_path)
    train.run_training(debug_config(num_train_steps=1), wd)
    with pytest.raises(ConfigError, match=r"model.hidden_size: 32 -> 48"):
        train.run_training(debug_config(**{"num_train_steps": 2, "model.hidden_size": 48}), wd)
    # forced: the arrays cannot take the new shape, and the restore says which
    with pytest.raises(checkpoint.CheckpointError, match=r"embed_tokens.embedding has shape"):
        train.run_training(debug_config(**{"num_train_steps": 2, "model.hidden_size": 48,
                                           "resume_changed_config": True}), wd)
