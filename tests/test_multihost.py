"""Two processes x 4 CPU devices (gloo) train like one process with 8 devices.

The two-process run packs its update (grpo.max_tokens_per_device), the one-process run
does not: equal results also show packing exact across processes.

Each process runs `python -m ba_jax.main` with the BA_JAX_COORDINATOR environment, samples
its own sampling shards on its own devices, and joins the global update; checkpoints are
written by both. A SIGTERM to one process stops both after the same step; the restart from
that checkpoint (a round trip through it) must end with the parameters and metrics of an
uninterrupted single-process run on 8 devices.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ba_jax import train
from ba_jax.metrics import read_metrics
from test_train import REPO, debug_config, params_of

OVERRIDES = {"rollout.sample_shards": 2, "checkpoint.every_steps": 1,
             "grpo.dynamic_sampling": True, "grpo.max_resample_rounds": 1}
TIMING = ("step_time_s", "update_time_s", "checkpoint_time_s", "sample_time_s", "score_time_s",
          "sampling_time_share", "tokens_per_s", "weight_sync_time_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir: str, steps: int, extra: dict | None = None) -> list[subprocess.Popen]:
    port = _free_port()
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **(extra or {})}.items()]
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   BA_JAX_COORDINATOR=f"127.0.0.1:{port}", BA_JAX_NUM_PROCESSES="2",
                   BA_JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:debug",
             f"--workdir={workdir}", f"--config.num_train_steps={steps}", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out.decode(errors="replace"))
    return outs


def _two_processes(workdir: str, steps: int, extra: dict | None = None) -> None:
    procs = _launch(workdir, steps, extra)
    for p, out in zip(procs, _wait(procs)):
        assert p.returncode == 0, out[-4000:]


# the multi-process run packs its update (the debug rows: 64 + 8 - 1 tokens at most); the
# single-process one is padded, so the test also checks packed == padded across processes
PACKED = {"grpo.max_tokens_per_device": 80}
LAYOUT = ("train_token_fraction", "train_microbatches", "pack_imbalance")


@pytest.mark.slow
def test_two_processes_stop_together_and_equal_one_process_with_eight_devices(tmp_path):
    """Two processes x 4 devices, each packing its own rows into blocks on its own devices
    (the block count agreed by both). SIGTERM to process 1 alone once step 1 is written:
    both stop after the same step (they agree through an all-gather after every step), both
    exit 143 with the same stop line, that step's checkpoint (written by both) is
    committed. Both then resume from it to the end, which must equal one padded process
    with 8 devices: parameters and every metric but the layout's and the timings."""
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    steps = 8  # far more than the step in flight when the signal is taken
    procs = _launch(multi, steps, PACKED)
    try:
        deadline = time.monotonic() + 600
        while len(read_metrics(multi)) < 1:  # past start-up: in the loop
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    outs = _wait(procs)
    stops = [re.findall(r"ba_jax: stopped by SIGTERM after step (\d+): checkpoint", out)
             for out in outs]
    assert [p.returncode for p in procs] == [143, 143], [o[-3000:] for o in outs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    done = int(stops[0][0])
    assert done < steps and [r["step"] for r in read_metrics(multi)] == list(range(1, done + 1))
    assert params_of(multi)[0] == done
    _two_processes(multi, steps, PACKED)  # both resume from the committed step
    train.train_and_evaluate(debug_config(num_train_steps=steps, **OVERRIDES), single)
    s_multi, p_multi, m_multi = params_of(multi)
    s_single, p_single, m_single = params_of(single)
    assert s_multi == s_single == steps
    assert m_multi["data_iterator"] == m_single["data_iterator"]
    for a, b in zip(p_multi, p_single):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING + LAYOUT}  # noqa: E731
                          for r in rows]
    rm, rs = strip(read_metrics(multi)), strip(read_metrics(single))
    assert [r["step"] for r in rm] == list(range(1, steps + 1))
    assert all(r["train_microbatches"] >= 1 for r in read_metrics(multi))
    for a, b in zip(rm, rs):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)
