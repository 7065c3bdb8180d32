"""Reliability: kill-anywhere resume, the non-finite guard, and a catalogue of bad inputs.

Every bad input must end in a clear message before the first step (naming the file, row,
key or option) or in a counted skip; never a traceback halfway through a run.
"""

import json
import os
import random
import sys

import jax
import numpy as np
import pytest

from ba_jax import build, checkpoint, data, experience, train, workdir_lock
from ba_jax.metrics import read_metrics
from ba_jax.run_config import ConfigError
from test_train import REPO, debug_config, params_of

sys.path.insert(0, os.path.join(REPO, "scripts"))
import kill_resume  # noqa: E402


# ----------------------------------------------------------------- non-finite guard


def _poison(monkeypatch, steps: set[int]):
    """Make the update batch of the given RL steps non-finite (old log-probs = NaN)."""
    real = experience.collect
    calls = {"n": 0}

    def collect(*args, **kwargs):
        exp = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] in steps:
            exp.batch["old_logp_BR"] = np.full_like(exp.batch["old_logp_BR"], np.nan)
        return exp

    monkeypatch.setattr(experience, "collect", collect)


def _ckpt_params(wd, step):
    cfg = debug_config(**{"mesh.data": 1})
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    ck = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"))
    state, _ = ck.restore(step, train.init_state(params, tx, mesh))
    ck.close()
    return jax.tree.leaves(jax.device_get(state))


def test_nonfinite_step_leaves_state_unchanged(tmp_path, monkeypatch):
    _poison(monkeypatch, {2})
    wd = str(tmp_path)
    cfg = debug_config(**{"num_train_steps": 3, "checkpoint.every_steps": 1,
                          "checkpoint.max_to_keep": 5})
    train.train_and_evaluate(cfg, wd)
    rows = read_metrics(wd)
    assert [r["nonfinite_updates"] for r in rows] == [0.0, 1.0, 0.0]
    s1, s2, s3 = (_ckpt_params(wd, s) for s in (1, 2, 3))
    for a, b in zip(s1, s2):  # parameters, optimizer state and update count untouched
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(s2, s3))  # and training goes on


def test_consecutive_nonfinite_steps_stop_with_intact_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, {2, 3, 4, 5})
    wd = str(tmp_path)
    cfg = debug_config(**{"num_train_steps": 8, "checkpoint.every_steps": 1,
                          "max_consecutive_nonfinite": 3})
    with pytest.raises(FloatingPointError, match="3 steps in a row"):
        train.train_and_evaluate(cfg, wd)
    step, leaves, meta = params_of(wd)
    assert step == 4 and meta["step"] == 4
    for a, b in zip(leaves, _ckpt_params(wd, 4)[: len(leaves)]):
        assert np.all(np.isfinite(a))
    assert [r["nonfinite_updates"] for r in read_metrics(wd)] == [0.0, 1.0, 1.0, 1.0]


# ----------------------------------------------------------------- bad inputs


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _dataset_cfg(path, **overrides):
    return debug_config(**{"task": "dataset", "data.path": str(path), "data.template": "plain",
                           "data.format": "auto", **overrides})


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from ba_jax.tasks import arithmetic

    return arithmetic.save_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _good_rows(n=8):
    return [{"prompt": f"What is {i}+1? Answer:", "solution": str(i + 1)} for i in range(n)]


def _cfg_case(overrides):
    return lambda tmp, tok: (debug_config(**overrides), str(tmp / "run"))


def _data_case(rows=None, raw=None, name="data.jsonl", tokenizer=None, **overrides):
    def make(tmp, tok):
        tok = tokenizer or tok
        path = tmp / name
        if raw is not None:
            path.write_bytes(raw)
        elif rows is not None:
            _jsonl(path, rows)
        cfg = _dataset_cfg(path, tokenizer_path=tok, **overrides)
        return cfg, str(tmp / "run")
    return make


_HELD_LOCKS: list[int] = []  # the "workdir in use" case's lock stays held to the end


def _workdir_in_use(tmp, tok):
    """A workdir whose lock another run holds (here: another open file of this process)."""
    wd = tmp / "run"
    wd.mkdir()
    _HELD_LOCKS.append(workdir_lock.acquire(str(wd)))
    return debug_config(), str(wd)


BAD = [
    # (case id, builder, exception type, message pattern)
    ("unknown rule", _cfg_case({"grpo.aggregation": "balancd"}), ConfigError, "balanced_batch"),
    ("rule path missing module", _cfg_case({"grpo.aggregation": "no_such_pkg.mod:fn"}),
     ConfigError, "no_such_pkg"),
    ("mesh does not fit devices", _cfg_case({"mesh.data": 3}), ConfigError, "config.mesh"),
    ("two free mesh axes", _cfg_case({"mesh.data": -1, "mesh.fsdp": -1}), ConfigError, "at most one"),
    ("minibatches do not divide prompts", _cfg_case({"grpo.num_minibatches": 3}), ConfigError,
     "num_minibatches"),
    ("microbatches do not divide rows", _cfg_case({"grpo.num_microbatches": 3}), ConfigError,
     "num_microbatches"),
    ("rows not divisible by devices", _cfg_case({"grpo.num_microbatches": 4}), ConfigError,
     "data\\*fsdp"),
    ("unknown advantage", _cfg_case({"grpo.advantage": "ppo"}), ConfigError, "grpo.advantage"),
    ("unknown kl kind", _cfg_case({"grpo.kl_kind": "k4"}), ConfigError, "kl_kind"),
    ("unknown attention kernel", _cfg_case({"model.attention": "flash"}), ConfigError,
     "config.model.attention='flash'; valid: auto, xla, chunked, cudnn, splash"),
    ("unknown remat policy", _cfg_case({"model.remat": "some"}), ConfigError,
     "config.model.remat='some'"),
    ("scan unroll below one", _cfg_case({"model.scan_unroll": 0}), ConfigError,
     "config.model.scan_unroll=0"),
    ("bad dtype", _cfg_case({"model.dtype": "float16"}), ConfigError, "dtype"),
    ("top_p zero", _cfg_case({"rollout.top_p": 0.0}), ConfigError, "top_p"),
    ("negative temperature", _cfg_case({"rollout.temperature": -1.0}), ConfigError, "temperature"),
    ("zero samples", _cfg_case({"rollout.num_samples": 0}), ConfigError, "num_samples"),
    ("unknown init", _cfg_case({"model.init": "pretrained"}), ConfigError, "model.init"),
    ("init folder missing", _cfg_case({"model.init": "hf", "model.init_path": "/nonexistent/qwen"}),
     ConfigError, "/nonexistent/qwen"),
    ("unknown preset", _cfg_case({"model.preset": "Qwen9-1B"}), ConfigError, "Qwen9-1B"),
    ("heads not multiple of kv heads", _cfg_case({"model.num_kv_heads": 3}), ConfigError,
     "num_kv_heads"),
    ("unknown task", _cfg_case({"task": "chess"}), ConfigError, "config.task"),
    ("unknown schedule", _cfg_case({"optim.schedule": "linear"}), ConfigError, "schedule"),
    ("zero learning rate", _cfg_case({"optim.learning_rate": 0.0}), ConfigError, "learning_rate"),
    ("zero checkpoint interval", _cfg_case({"checkpoint.every_steps": 0}), ConfigError,
     "every_steps"),
    ("dataset file missing", _data_case(name="absent.jsonl"), ConfigError, "absent.jsonl"),
    ("dataset file empty", _data_case(raw=b""), ConfigError, "empty"),
    ("dataset missing columns", _data_case(rows=[{"question": "q", "x": 1}] * 4), ConfigError,
     "data.jsonl"),
    ("dataset not JSON", _data_case(raw=b"{not json\n"), ConfigError, "data.jsonl"),
    ("dataset invalid UTF-8", _data_case(raw=b'{"prompt": "\xff\xfe Answer:", "solution": "1"}\n'),
     ConfigError, "data.jsonl"),
    ("dataset wrong suffix", _data_case(rows=_good_rows(), name="data.csv"), ConfigError, "data.csv"),
    ("parquet file corrupt", _data_case(raw=b"PAR1garbage", name="data.parquet"), ConfigError,
     "data.parquet"),
    ("every prompt too long", _data_case(rows=_good_rows(), **{"data.max_prompt_tokens": 2}),
     ConfigError, "too_long"),
    ("unknown data format", _data_case(rows=_good_rows(), **{"data.format": "gsm8k"}),
     ConfigError, "format"),
    ("dataset without tokenizer", lambda tmp, tok: (
        _dataset_cfg(_jsonl(tmp / "d.jsonl", _good_rows())), str(tmp / "run")),
     ConfigError, "tokenizer_path"),
    ("tokenizer folder missing", _data_case(rows=_good_rows(), tokenizer="/nonexistent/tok"),
     ConfigError, "/nonexistent/tok"),
    ("chat template missing", _data_case(rows=_good_rows(), **{"data.template": "chat"}),
     ConfigError, "template"),
    ("workdir under a file", lambda tmp, tok: (debug_config(), str(_jsonl(tmp / "f", [])) + "/run"),
     ConfigError, "workdir"),
    ("workdir in use by another run", _workdir_in_use, ConfigError,
     r"--workdir=.* is in use by another run \(pid \d+ on host \S+, started"),
]


@pytest.mark.parametrize("name,make,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_startup_error(tmp_path, char_tokenizer, name, make, exc, pattern):
    cfg, wd = make(tmp_path, char_tokenizer)
    with pytest.raises(exc, match=pattern):
        train.train_and_evaluate(cfg, wd)
    assert not os.path.exists(os.path.join(wd, "metrics.jsonl"))  # failed before any step


def test_bad_rows_are_skipped_and_counted(tmp_path, char_tokenizer):
    from transformers import AutoTokenizer

    rows = _good_rows(6) + [
        {"prompt": "", "solution": "1"},  # empty prompt
        {"prompt": 7, "solution": "1"},  # mistyped prompt
        {"prompt": "x" * 100_000 + " Answer:", "solution": "1"},  # enormous row
        {"prompt": "What is 0+1? Answer:", "solution": "1"},  # duplicate of row 0
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(char_tokenizer)
    ds = data.load_prompts(data.DataConfig(path=path, template="plain", max_prompt_tokens=64), tok)
    assert len(ds.prompt_ids) == 6
    assert ds.stats["too_long"] == 1 and ds.stats["duplicates_dropped"] == 1
    assert ds.stats["empty_prompt"] + ds.stats["malformed"] == 2
    assert ds.stats["rows_read"] == len(rows)


def test_checkpoint_of_another_model_shape_is_named(tmp_path):
    wd = str(tmp_path)
    train.train_and_evaluate(debug_config(num_train_steps=1), wd)
    with pytest.raises(checkpoint.CheckpointError, match=os.path.join(wd, "checkpoints")):
        train.train_and_evaluate(debug_config(**{"num_train_steps": 2, "model.hidden_size": 48}), wd)


def test_weights_folder_with_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    from helpers_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", arch="qwen3", tie=True)
    weights = load_file(os.path.join(hf, "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    cfg = debug_config(**{"model.init": "hf", "model.init_path": hf})
    with pytest.raises(ConfigError, match="layers.1.mlp.up_proj"):
        train.train_and_evaluate(cfg, str(tmp_path / "run"))


def test_full_disk_at_save_stops_cleanly_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    wd = str(tmp_path)
    real_save = checkpoint.Checkpointer.save

    def save(self, step, state, meta):
        if step == 2:
            raise OSError(28, "No space left on device")
        return real_save(self, step, state, meta)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    cfg = debug_config(**{"num_train_steps": 3, "checkpoint.every_steps": 1})
    with pytest.raises(checkpoint.CheckpointError, match="No space left.*step 1\\) is intact"):
        train.train_and_evaluate(cfg, wd)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real_save)
    train.train_and_evaluate(cfg, wd)  # space is back: resumes from step 1 and finishes
    assert [r["step"] for r in read_metrics(wd)] == [1, 2, 3]


# ----------------------------------------------------------------- kill anywhere


@pytest.mark.slow
def test_kill_anywhere_and_resume_equals_uninterrupted(tmp_path):
    cache = str(tmp_path / "jax_cache")
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    kill_resume.run_to_end(ref, 5, cache)
    log = kill_resume.killed_run(killed, 5, cache, trials=10, max_delay_s=6.0, rng=random.Random(0))
    assert sum("killed" in line for line in log) >= 8, log
    assert any("during a save" in line for line in log), log
    assert kill_resume.compare(ref, killed) == []
