"""The sandbox's uid slots: which unprivileged uid a run gets, and killing what a uid left.

Lives here: the slots (uid = gid = UID_BASE + slot, one per concurrent run machine-wide,
held by an flock in a private lock dir, released by the kernel if the holder dies), which
slots are free of accounts on this machine, and the sweep that kills every live process of
a slot's uid. Not here: running programs and probing the isolation (`sandbox.py`).
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import pwd
import signal
import tempfile
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

UID_BASE = 60000  # slot i runs as uid = gid = UID_BASE + i
NUM_SLOTS = 64


def free_slots() -> tuple[int, ...]:
    """Slots whose uid and gid belong to no account on this machine."""
    used_uids = {p.pw_uid for p in pwd.getpwall()}
    used_gids = {g.gr_gid for g in grp.getgrall()}
    return tuple(i for i in range(NUM_SLOTS)
                 if UID_BASE + i not in used_uids and UID_BASE + i not in used_gids)


class Slot:
    """One machine-wide sandbox slot (uid), held through an flock while a program runs."""

    def __init__(self, index: int, lock_fd: int):
        self.index, self.lock_fd = index, lock_fd
        self.uid = self.gid = UID_BASE + index

    def release(self) -> None:
        os.close(self.lock_fd)


def _lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"ba_jax_sandbox_slots_{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)  # a predictable name in /tmp: refuse one someone else planted
    if not os.path.isdir(path) or os.path.islink(path) or info.st_uid != os.getuid() or (
            info.st_mode & 0o077):
        raise RuntimeError(f"code sandbox: {path} is not a private directory of this user")
    return path


def acquire_slot(slots: Sequence[int]) -> Slot:
    """Hold the first of `slots` no other run holds, waiting while all are taken."""
    lock_dir = _lock_dir()
    while True:
        for index in slots:
            fd = os.open(os.path.join(lock_dir, f"{index}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return Slot(index, fd)
        time.sleep(0.005)


def _live_pids_of_uid(uid: int) -> list[int]:
    # The real uid from /proc/N/status, not the owner of /proc/N (a non-dumpable process
    # shows as root there); zombies are already dead and cannot be killed.
    needle = f"\nUid:\t{uid}\t".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            status = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        if needle in status and b"\nState:\tZ" not in status:
            pids.append(int(name))
    return pids


def sweep_uid(uid: int) -> int:
    """Kill every live process of a slot uid; returns how many were found."""
    found = 0
    for _ in range(200):
        pids = _live_pids_of_uid(uid)
        if not pids:
            return found
        found += len(pids)
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)  # race-free against pid reuse
            except OSError:
                continue
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.01)
    logger.error("sandbox: processes of uid %d survive SIGKILL", uid)
    return found
