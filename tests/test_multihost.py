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
import socket
import subprocess
import sys

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


# Runs ba_jax.main with a SIGTERM to this process from inside step 2's sampling (the
# moment is exact, not a race with a watching test); a real signal, taken by the real handler.
_SIGTERM_IN_STEP_2 = """
import os, runpy, signal, sys
from ba_jax import experience
real, calls = experience.collect, []
def collect(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
experience.collect = collect
sys.argv = ["ba_jax.main"] + sys.argv[1:]
runpy.run_module("ba_jax.main", run_name="__main__")
"""


def _launch(workdir: str, steps: int, extra: dict | None = None,
            head_of_1: tuple[str, ...] = ("-m", "ba_jax.main")) -> list[subprocess.Popen]:
    """Two processes of one run; `head_of_1`: how process 1 starts ba_jax.main."""
    port = _free_port()
    args = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **(extra or {})}.items()]
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   BA_JAX_COORDINATOR=f"127.0.0.1:{port}", BA_JAX_NUM_PROCESSES="2",
                   BA_JAX_PROCESS_ID=str(pid))
        head = head_of_1 if pid == 1 else ("-m", "ba_jax.main")
        procs.append(subprocess.Popen(
            [sys.executable, *head, "--config=configs/default.py:debug",
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
    (the block count agreed by both). SIGTERM to process 1 alone, during step 2: both stop
    after step 2 (they agree through an all-gather after every step), both exit 143 with the
    same stop line, that step's checkpoint (written by both) is committed. Both then resume
    from it to the end, which must equal one padded process with 8 devices: parameters and
    every metric but the layout's and the timings."""
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    steps = 4
    procs = _launch(multi, steps, PACKED, head_of_1=("-c", _SIGTERM_IN_STEP_2))
    outs = _wait(procs)
    stops = [re.findall(r"ba_jax: stopped by SIGTERM after step (\d+): checkpoint", out)
             for out in outs]
    assert [p.returncode for p in procs] == [143, 143], [o[-3000:] for o in outs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    done = int(stops[0][0])
    assert done == 2 and [r["step"] for r in read_metrics(multi)] == [1, 2]
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
