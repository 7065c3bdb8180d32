"""Tests for ba_jax.workdir_lock: a second run is refused naming the holder; a dead
holder's lock is gone; the lock is released on return and on error; process 0 only.

Holders are real processes that say when they hold the lock; the tests wait for that line
or for the process to end, never for a time.
"""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from ba_jax import run_config, workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Holds the lock, says so, then waits until stdin closes (or it is killed).
HOLDER = """
import os, signal, sys
from ba_jax import workdir_lock
workdir_lock.acquire(sys.argv[1])
print("held", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""


def _holder(workdir, then: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir), then], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_second_process_is_refused_with_holder_pid_and_host(tmp_path):
    proc = _holder(tmp_path, "wait")
    try:
        host = re.escape(socket.gethostname())
        with pytest.raises(workdir_lock.WorkdirInUse,
                           match=rf"in use by another run \(pid {proc.pid} on host {host}, "
                                 r"started \S+Z; lock file .*run.lock\)") as info:
            workdir_lock.acquire(str(tmp_path))
        assert isinstance(info.value, run_config.ConfigError)  # main.py prints it as one line
        assert "\n" not in str(info.value)
    finally:
        proc.kill()  # SIGKILL: the kernel drops the lock with the process
        proc.wait()
    fd = workdir_lock.acquire(str(tmp_path))
    try:
        with open(tmp_path / workdir_lock.LOCK_NAME) as f:
            assert f.read().startswith(f"pid {os.getpid()} host {socket.gethostname()} ")
    finally:
        os.close(fd)


def test_lock_of_a_killed_run_does_not_block_a_rerun(tmp_path):
    proc = _holder(tmp_path, "die")  # SIGKILLs itself while holding the lock
    assert proc.wait() == -signal.SIGKILL
    with open(tmp_path / workdir_lock.LOCK_NAME) as f:
        assert f.read().startswith(f"pid {proc.pid} ")  # its record stays; its lock does not
    with workdir_lock.hold(str(tmp_path)):
        pass


def test_released_on_return_and_on_error(tmp_path):
    wd = str(tmp_path)
    with workdir_lock.hold(wd):
        with pytest.raises(workdir_lock.WorkdirInUse, match=r"\(this process\)"):
            workdir_lock.acquire(wd)  # a second open file is refused, even in one process
    with pytest.raises(RuntimeError, match="boom"):
        with workdir_lock.hold(wd):
            raise RuntimeError("boom")
    os.close(workdir_lock.acquire(wd))  # free again after both


def test_only_process_zero_locks(tmp_path, monkeypatch):
    wd = str(tmp_path)
    fd = workdir_lock.acquire(wd)
    try:
        monkeypatch.setattr(workdir_lock.jax, "process_index", lambda: 1)
        with workdir_lock.hold(wd):  # process 1 shares process 0's workdir
            pass
        monkeypatch.setattr(workdir_lock.jax, "process_index", lambda: 0)
        with pytest.raises(workdir_lock.WorkdirInUse):
            with workdir_lock.hold(wd):
                pass
    finally:
        os.close(fd)


def test_unlockable_file_system_warns_and_runs(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(workdir_lock.fcntl, "flock", no_locks)
    with workdir_lock.hold(str(tmp_path)):
        pass
    assert "would not be refused" in caplog.text and "No locks available" in caplog.text
