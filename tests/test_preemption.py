"""Preemption (issue 37 item 1): SIGTERM and SIGINT stop a run after the step in flight
with a committed checkpoint, a one-line message and exit status 128 + signal; a second
signal stops at once; the resumed run equals an uninterrupted one."""

import os
import random
import signal
import sys

import numpy as np
import pytest

from ba_jax import checkpoint, experience, preemption, train
from ba_jax.metrics import read_metrics
from test_train import REPO, debug_config, params_of

sys.path.insert(0, os.path.join(REPO, "scripts"))
import kill_resume  # noqa: E402

TIMING = kill_resume.TIMING
OVER = {"num_train_steps": 6, "checkpoint.every_steps": 4, "checkpoint.max_to_keep": 3}


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("ref"))
    train.run_training(debug_config(**OVER), wd)
    return wd


def test_stop_request_sets_a_flag_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with preemption.StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def _signal_at(monkeypatch, where: str, step: int, signum=signal.SIGTERM):
    """Send `signum` to this process in the middle of RL step `step`'s sampling, update or
    save (from inside the call, so the moment is exact)."""
    target = {"sample": (experience, "collect"), "update": (train, "update"),
              "save": (checkpoint.Checkpointer, "save")}[where]
    real = getattr(*target)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        if where == "save":
            current = args[1]
        else:
            calls["n"] += 1
            current = calls["n"]
        if current == step:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(*target, wrapped)


@pytest.mark.parametrize("where, signum", [("sample", signal.SIGTERM),
                                           ("update", signal.SIGINT),
                                           ("save", signal.SIGTERM)])
def test_a_signal_mid_step_stops_after_that_step(tmp_path, monkeypatch, uninterrupted, where,
                                                  signum):
    """Step 4's save is a scheduled one (every 4 steps); steps 3 and 5 are not: the stop
    saves them itself. The resumed run redoes nothing and equals the uninterrupted one."""
    wd = str(tmp_path)
    step = 4 if where == "save" else 3
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as m:
        _signal_at(m, where, step, signum)
        with pytest.raises(preemption.Stopped) as info:
            train.run_training(debug_config(**OVER), wd)
    name = signal.Signals(signum).name
    assert str(info.value).startswith(f"stopped by {name} after step {step}: checkpoint step "
                                      f"{step} in {wd}/checkpoints is committed")
    assert info.value.exit_code == 128 + signum
    assert [r["step"] for r in read_metrics(wd)] == list(range(1, step + 1))
    assert params_of(wd)[0] == step  # committed: nothing to redo
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    train.run_training(debug_config(**OVER), wd)
    assert _strip(read_metrics(wd)) == _strip(read_metrics(uninterrupted))
    for a, b in zip(params_of(wd)[1], params_of(uninterrupted)[1]):
        np.testing.assert_array_equal(a, b)


def test_a_signal_after_the_last_steps_check_leaves_the_run_complete(tmp_path, monkeypatch,
                                                                      capfd, uninterrupted):
    """A signal that lands once the loop has passed its last stop check (here while the
    metrics writer closes) has nothing left to stop: the run completes, its last step
    committed, says so in one line, and returns normally (exit status 0)."""
    from ba_jax import metrics as metrics_lib

    wd, steps = str(tmp_path), OVER["num_train_steps"]
    real = metrics_lib.MetricsWriter.close

    def close(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(metrics_lib.MetricsWriter, "close", close)
    assert train.run_training(debug_config(**OVER), wd).startswith(f"finished {steps} steps")
    err = capfd.readouterr().err
    assert err.rstrip().endswith("ba_jax: SIGTERM came after the last step: the run is complete")
    assert params_of(wd)[0] == steps
    assert _strip(read_metrics(wd)) == _strip(read_metrics(uninterrupted))


def test_a_signal_during_start_up_stops_before_the_first_step(tmp_path, monkeypatch):
    from ba_jax import build

    real = build.make_optimizer

    def make_optimizer(cfg):  # during start-up, before the warm-up and step 0's save
        os.kill(os.getpid(), signal.SIGTERM)
        return real(cfg)

    monkeypatch.setattr(build, "make_optimizer", make_optimizer)
    with pytest.raises(preemption.Stopped, match="after step 0: checkpoint step 0"):
        train.run_training(debug_config(**OVER), str(tmp_path))
    assert read_metrics(str(tmp_path)) == []


@pytest.mark.slow
def test_sigterm_and_sigint_at_random_moments_resume_identically(tmp_path):
    """The real process: SIGTERM and SIGINT (Ctrl-C) in turn at random moments of the loop
    (and during a save; twice in one launch), checked by `kill_resume.signalled_run` (exit
    143 or 130, the one stop line and no traceback, a committed checkpoint at the stop step,
    no more than the step in flight done after the signal), then resumed to the end:
    identical to the uninterrupted run."""
    cache = str(tmp_path / "jax_cache")
    ref, wd = str(tmp_path / "ref"), str(tmp_path / "run")
    steps = 24
    kill_resume.run_to_end(ref, steps, cache, every_steps=4)
    log = kill_resume.signalled_run(wd, steps, cache, trials=4, rng=random.Random(0),
                                    signum=(signal.SIGTERM, signal.SIGINT), every_steps=4)
    assert any("SIGTERM in the loop: stopped after step" in line for line in log), log
    assert any("SIGINT in the loop: stopped after step" in line for line in log), log
    assert kill_resume.compare(ref, wd) == []
