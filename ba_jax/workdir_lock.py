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

A `gs://` workdir has no flock; its lock is the object WORKDIR/run.lock, a lease
(`GcsLease`): created with the precondition if-generation-match=0 (of two runs creating it
at once, exactly one succeeds), refreshed by its holder every `LEASE_REFRESH_S` with
if-generation-match=<its generation> (so a holder notices when it was taken over), deleted
on release. A lease not refreshed for `LEASE_STALE_S` (by the bucket's clock: the object's
update time) belongs to a dead run and is taken over, again with a generation precondition,
so two runs racing for a stale lease cannot both win. What it guarantees: no two live runs
whose holder refreshes within `LEASE_STALE_S` hold the workdir together; a killed run's
lease blocks a rerun for up to `LEASE_STALE_S`. Other URL schemes are not locked (a warning
says so).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator

import jax

from ba_jax import paths, run_config

LOCK_NAME = "run.lock"
LEASE_REFRESH_S = 30.0
LEASE_STALE_S = 120.0
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


def _record() -> str:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"pid {os.getpid()} host {socket.gethostname()} started {started}\n"


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
    os.ftruncate(fd, 0)
    os.pwrite(fd, _record().encode(), 0)
    return fd


class GcsLease:
    """The lock of a `gs://` workdir: the object WORKDIR/run.lock as a refreshed lease (see
    the module's docstring). `acquire` raises WorkdirInUse naming the holder; `release`
    stops the refresh and deletes the object if it is still this run's."""

    def __init__(self, workdir: str):
        from google.cloud import storage

        bucket, _, prefix = workdir.split("://", 1)[1].partition("/")
        self.workdir, self.url = workdir, paths.join(workdir, LOCK_NAME)
        self._blob_name = "/".join(p for p in (prefix.strip("/"), LOCK_NAME) if p)
        self._bucket = storage.Client().bucket(bucket)
        self._generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = ""  # why the lease was lost while held (taken over as stale), if it was

    def acquire(self) -> None:
        from google.api_core import exceptions

        text = _record()
        blob = self._bucket.blob(self._blob_name)
        try:
            blob.upload_from_string(text, if_generation_match=0)
        except exceptions.PreconditionFailed:
            held = self._bucket.get_blob(self._blob_name)
            if held is None:  # released between the two calls: try once more
                blob.upload_from_string(text, if_generation_match=0)
            else:
                age = (datetime.datetime.now(datetime.timezone.utc) - held.updated
                       ).total_seconds()
                if age < LEASE_STALE_S:
                    raise self._in_use(held, age) from None
                blob = self._bucket.blob(self._blob_name)
                try:  # a dead run's lease: take it over unless another run just did
                    blob.upload_from_string(text, if_generation_match=held.generation)
                except exceptions.PreconditionFailed:
                    raise self._in_use(self._bucket.get_blob(self._blob_name), 0.0) from None
                logging.warning("took over the lease %s of a run not heard from for %.0f s",
                                self.url, age)
        self._generation = blob.generation
        self._thread = threading.Thread(target=self._refresh, args=(text,), daemon=True,
                                        name="ba_jax_lease")
        self._thread.start()

    def _in_use(self, held, age: float) -> WorkdirInUse:
        text = held.download_as_text() if held is not None else ""
        m = _HOLDER_RE.match(text)
        holder = (f"pid {m[1]} on host {m[2]}" + (f", started {m[3]}" if m[3] else "")
                  if m else "holder not recorded")
        return WorkdirInUse(
            f"--workdir={self.workdir!r} is in use by another run ({holder}; lease {self.url} "
            f"refreshed {age:.0f} s ago, taken over after {LEASE_STALE_S:.0f} s without a "
            "refresh): wait for it to end or stop it, or use another --workdir")

    def _refresh(self, text: str) -> None:
        from google.api_core import exceptions

        while not self._stop.wait(LEASE_REFRESH_S):
            blob = self._bucket.blob(self._blob_name)
            try:
                blob.upload_from_string(text, if_generation_match=self._generation)
                self._generation = blob.generation
            except exceptions.PreconditionFailed:
                self.lost = f"the lease {self.url} was taken over by another run"
                logging.error("%s: this run no longer holds --workdir=%r", self.lost,
                              self.workdir)
                return
            except Exception as e:  # noqa: BLE001 - a transient error: try again next time
                logging.warning("refreshing the lease %s failed: %s", self.url, e)

    def release(self) -> None:
        from google.api_core import exceptions

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost or self._generation is None:
            return
        try:  # only this run's generation: a lease taken over since stays
            self._bucket.blob(self._blob_name).delete(if_generation_match=self._generation)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            pass


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Hold the workdir lock (process 0 only) for the body; released when it returns or
    raises, and by the kernel if the process dies."""
    fd, lease = None, None
    if jax.process_index() == 0 and paths.is_remote(workdir):
        if workdir.startswith("gs://"):
            lease = GcsLease(workdir)
            lease.acquire()
        else:
            logging.warning("cannot lock --workdir=%r (only local and gs:// workdirs are "
                            "locked): a second run in it would not be refused", workdir)
    elif jax.process_index() == 0:
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
        if lease is not None:
            lease.release()
