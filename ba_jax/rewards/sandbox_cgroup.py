"""The sandbox's memory ceiling: one memory cgroup per running program, tmpfs included.

Lives here: `probe()`, which finds where this process may create memory cgroups, and
`SlotCgroup`, one slot's cgroup (created under the caller's own cgroup when a program takes
the slot, its limit set before each run, its OOM kills counted, removed when the slot is
released). The launcher (`sandbox_launcher.py`) joins it first thing, through an open
`cgroup.procs` file it is handed, so the launcher, the reaper, the program and everything
they start are in it. Not here: running programs (`sandbox.py`).

Why: RLIMIT_AS bounds each process's address space, not the sum over the up to 32
processes of a program, and never the pages of a tmpfs it writes (its working dir, or one
it mounts). A memory cgroup charges all of these (tmpfs pages to the process that wrote
them) and OOM-kills inside the group when they pass its limit; the program's processes
carry `oom_score_adj=1000`, so they, not the launcher or reaper, are the victims.

Where: inside the caller's own cgroup (so the caller's own limits still cover it), with
cgroup v2 where that cgroup gives its children the memory controller (`+memory` in its
`cgroup.subtree_control`; the kernel allows that only to a cgroup holding no processes, the
"no internal processes" rule, so a trainer usually needs a delegated cgroup: name one in
`BA_JAX_SANDBOX_CGROUP`), else in the cgroup v1 memory hierarchy (a legacy or hybrid machine;
v1 has no such rule). Nothing is changed outside the slot cgroups. None usable (not root, a
read-only /sys/fs/cgroup, v2 without delegation): no ceiling beyond the rlimits, and
`Isolation.notes` says why (docs/sandbox.md).
"""

from __future__ import annotations

import errno
import logging
import os
import time

logger = logging.getLogger(__name__)

PREFIX = "ba_jax_sandbox_"  # the slot cgroups' names: PREFIX + uid
ENV = "BA_JAX_SANDBOX_CGROUP"  # a folder to make them in instead of the caller's own cgroup


def _own_cgroups() -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's memory hierarchy."""
    v2 = v1 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            hier, controllers, path = line.rstrip("\n").split(":", 2)
            if hier == "0" and controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    return v2, v1


def _mounts() -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """(mount point, hierarchy root of the mount) of the cgroup2 and v1 memory mounts."""
    v2 = v1 = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            point = fields[4].encode().decode("unicode_escape")
            if fstype == "cgroup2" and v2 is None:
                v2 = (point, fields[3])
            elif fstype == "cgroup" and "memory" in options and v1 is None:
                v1 = (point, fields[3])
    return v2, v1


def _join(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.join(point, rel.lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def probe() -> tuple[tuple[str, str] | None, str]:
    """((version "v2" | "v1", folder the slot cgroups go in), "") where a memory cgroup can
    be made here (a child is created and removed to be sure), else (None, why not).
    `BA_JAX_SANDBOX_CGROUP` names the folder instead (a delegated cgroup)."""
    chosen = os.environ.get(ENV)
    if chosen:
        version = "v2" if os.path.exists(os.path.join(chosen, "cgroup.controllers")) else "v1"
        try:
            return _checked(version, chosen)
        except OSError as e:
            return None, f"no memory cgroup: {ENV}={chosen}: {e}"
    try:
        own2, own1 = _own_cgroups()
        mount2, mount1 = _mounts()
    except (OSError, ValueError) as e:
        return None, f"no memory cgroup: cannot read this process's cgroups ({e})"
    why = []
    if own2 is not None and mount2 is not None:
        base = _join(mount2, own2)
        try:
            if "memory" not in _read(os.path.join(base, "cgroup.controllers")).split():
                why.append(f"cgroup v2 {base} has no memory controller (bound to the v1 "
                           "hierarchy here, or not delegated to this cgroup)")
            elif "memory" not in _read(os.path.join(base, "cgroup.subtree_control")).split():
                why.append(f"cgroup v2 {base} does not give its children the memory controller "
                           "(cgroup.subtree_control), and while it holds processes (this one) "
                           "the kernel refuses to (no internal processes); set "
                           f"{ENV} to a delegated cgroup folder whose subtree_control has +memory")
            else:
                return _checked("v2", base)
        except OSError as e:
            why.append(f"cgroup v2 {base}: {e}")
    if own1 is not None and mount1 is not None:
        try:
            return _checked("v1", _join(mount1, own1))
        except OSError as e:
            why.append(f"cgroup v1 memory {_join(mount1, own1)}: {e}")
    elif not why:
        why.append("no cgroup v2 or v1 memory hierarchy is mounted")
    return None, "no memory cgroup: " + "; ".join(why)


def _checked(version: str, base: str) -> tuple[tuple[str, str], str]:
    path = os.path.join(base, f"{PREFIX}probe_{os.getpid()}")
    os.mkdir(path)  # OSError: not writable here (not root, read-only)
    try:
        limit = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        _write(os.path.join(path, limit), str(64 << 20))
    finally:
        os.rmdir(path)
    return (version, base), ""


class SlotCgroup:
    """The memory cgroup of one slot (uid): made for one program, removed after it."""

    def __init__(self, version: str, base: str, uid: int):
        self.version, self.path = version, os.path.join(base, f"{PREFIX}{uid}")
        try:
            os.mkdir(self.path)
        except FileExistsError:  # left by an earlier holder of the slot that was killed
            pass

    def set_limit(self, limit_bytes: int) -> None:
        """The ceiling of the memory (and swap: none) of everything in the group."""
        def f(name):
            return os.path.join(self.path, name)

        if self.version == "v2":
            _write(f("memory.max"), str(limit_bytes))
            if os.path.exists(f("memory.swap.max")):
                _write(f("memory.swap.max"), "0")
            return
        memsw = os.path.exists(f("memory.memsw.limit_in_bytes"))
        if memsw:  # memory + swap must stay >= memory at every write
            _write(f("memory.memsw.limit_in_bytes"), "-1")
        _write(f("memory.limit_in_bytes"), str(limit_bytes))
        if memsw:
            _write(f("memory.memsw.limit_in_bytes"), str(limit_bytes))

    def procs_fd(self) -> int:
        """A write-only fd of the group's `cgroup.procs` (the launcher writes its pid)."""
        return os.open(os.path.join(self.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

    def oom_kills(self) -> int:
        """How many processes the kernel has OOM-killed in the group so far."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.path, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """Remove the group once its processes are gone (they leave it as they exit)."""
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
            time.sleep(0.01)
        logger.warning("code sandbox: could not remove the memory cgroup %s", self.path)
