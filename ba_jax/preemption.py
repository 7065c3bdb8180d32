"""Preemption: SIGTERM and SIGINT stop a run after the step in flight, with a checkpoint.

What lives here: `StopRequest`, which turns the first SIGTERM/SIGINT into a request the
training loop reads between steps (the step in flight finishes, its metrics line is
written, a checkpoint is saved and committed, then the run stops with `Stopped`), and
makes a second signal end the process at once (exit status 128 + signal, as if killed: the
next start resumes from the newest committed checkpoint); `detach_from_terminal`, for the
run's helper processes, so that a Ctrl-C or a scheduler's signal to the whole process
group reaches the trainer alone, which then stops them itself. What does not: the agreement
between processes on the step to stop at (`distributed.any_process`, called by the loop),
or saving (train.py).

Exit status of a stopped run: 143 for SIGTERM, 130 for SIGINT (128 + the signal's number,
what a shell reports for a process killed by it, so schedulers that requeue on 143 do). A
signal that comes after the last step's check stops nothing: the run completes, says so in
one line when the block ends, and exits 0 (after that, the default handlers are back).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


class Stopped(Exception):
    """The run stopped on a signal after a step, its checkpoint committed; `exit_code` is
    128 + the signal's number. The message says where it stopped and how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """While entered (on the main thread): the first SIGTERM/SIGINT sets `signum` and prints
    one line; a second one exits at once. Off the main thread, or outside the block, the
    signals keep their handlers."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()
        # The block ended normally with a signal taken: it came after the last step's check
        # (also while the loop's locals were being freed), so there was nothing to stop.
        # Checked once the handlers are back: no signal can fall between check and restore.
        if exc_type is None and self.signum is not None:
            _say(f"ba_jax: {signal_name(self.signum)} came after the last step: the run is "
                 "complete")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if self.signum is not None:
            _say(f"ba_jax: {name} again: stopping now; the next start resumes from the newest "
                 "committed checkpoint")
            os._exit(128 + signum)
        self.signum = signum
        _say(f"ba_jax: {name}: finishing the step in flight, then saving a checkpoint and "
             f"stopping (another {name} stops at once)")

    @property
    def requested(self) -> bool:
        return self.signum is not None


def _say(line: str) -> None:
    """One line to stderr from a signal handler (unbuffered: no lock a handler could hold)."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass


def detach_from_terminal(*, die_with_parent: bool = False) -> None:
    """For a helper process (called first thing in it): a session of its own, so signals
    sent to the trainer's process group (Ctrl-C, a scheduler's SIGTERM to the group) do not
    reach it; `die_with_parent`: SIGKILL when its parent dies (Linux; the kernel's "parent"
    is the thread that started it, so only for helpers started from a long-lived thread)."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    if die_with_parent and sys.platform.startswith("linux"):
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)
