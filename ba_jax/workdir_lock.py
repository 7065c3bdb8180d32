"""One run per workdir: an exclusive `flock` on WORKDIR/run.lock for the run's lifetime.

Lives here: `hold(workdir)`, the context `train.run_training` runs under, with
`acquire` and `WorkdirInUse` beneath it. Not here: checking that the folder is writable
(`run_config.check_workdir`), checkpoints (`checkpoint.py`).

Two runs in one workdir overwrite each other's checkpoints and metrics, so the second is
refused at start-up with the holder's pid and host. The lock is `fcntl.flock` on an open
file: the kernel drops it when the holder closes the file or dies in any way (SIGKILL
included), so a killed run never leaves a stale lock behind and the file is never deleted
(deleting a lock file races with a process that is about to lock it). The descriptor is
close-on-exec, so spawned workers (reward pools, the code sandbox) do not inherit it.
The holder writes `pid <pid> host <host> started <UTC time>` into the file for the refusal
message. With several processes only process 0 locks: they share the workdir by design.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import re
import socket
from collections.abc import Iterator

import jax

from ba_jax import run_config

LOCK_NAME = "run.lock"
_HOLDER_RE = re.compile(r"pid (\d+) host (\S+)(?: started (\S+))?")


class WorkdirInUse(run_config.ConfigError):
    """Another live run (or another call in this process) holds the workdir's lock."""


def _holder(fd: int) -> str:
    """Who holds the lock, from what the holder wrote into the file."""
    m = _HOLDER_RE.match(os.pread(fd, 512, 0).decode("utf-8", errors="replace"))
    if m is None:  # the holder has locked but not yet written
        return "holder not yet recorded"
    pid, host, started = m.groups()
    mine = int(pid) == os.getpid() and host == socket.gethostname()
    return (f"pid {pid} on host {host}" + (f", started {started}" if started else "")
            + (" (this process)" if mine else ""))


def acquire(workdir: str) -> int:
    """Lock `workdir` for this process and record who holds it; returns the descriptor
    to `os.close` to release. Raises `WorkdirInUse` naming the holder's pid and host."""
    path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise run_config.ConfigError(f"--workdir={workdir!r}: cannot create the lock file {path}: "
                                f"{e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise WorkdirInUse(
            f"--workdir={workdir!r} is in use by another run ({holder}; lock file {path}): "
            "wait for it to end or stop it, or use another --workdir") from None
    except BaseException:
        os.close(fd)
        raise
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} started {started}\n".encode(),
              0)
    return fd


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Hold the workdir lock (process 0 only) for the body; released when it returns or
    raises, and by the kernel if the process dies."""
    fd = None
    if jax.process_index() == 0:
        try:
            fd = acquire(workdir)
        except OSError as e:  # flock unsupported here (some network or FUSE file systems)
            logging.warning("cannot lock --workdir=%r (%s): a second run in it would not be "
                            "refused", workdir, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
