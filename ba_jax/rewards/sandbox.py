"""The code sandbox: run one untrusted program, once per input, under every limit we can.

Lives here: probing which isolation this machine allows (`isolation()`), one program's
working dir, uid slot and memory cgroup for all its runs (`session()`), one run under
limits (`Session.run` -> `Run`: starting the launcher, the wall clock, bounded reading of
output, killing and draining what is left). Not here: the launcher script
(`sandbox_launcher.py`), the uid slots and the sweep of their processes
(`sandbox_slots.py`), what the minimal root holds (`sandbox_root.py`), the seccomp filter
(`sandbox_seccomp.py`), the memory cgroups (`sandbox_cgroup.py`), extracting the program
and judging its output (`code.py`).

Each run (see docs/sandbox.md): a launcher process (root), which dies with its caller,
joins the slot's memory cgroup (a ceiling on all the run's memory, tmpfs included), starts
a new session and, where the kernel allows, new network, PID and mount namespaces. In the
mount namespace the program gets a minimal root: a fresh tmpfs holding, bound read-only,
only its interpreter, the shared libraries it loads and its standard library, a few /dev
nodes, a private /proc and its working directory, a size-limited tmpfs at /tmp/prog
(fallback: the host's tree read-only, `Isolation.minimal_root=False`). The program runs as
a per-slot unprivileged uid (60000 + slot, one per concurrent run machine-wide) with CPU,
address-space, process, file-size and open-file limits, a seccomp filter that refuses new
namespaces and mounts, under a wall-clock timeout that kills the PID namespace, with at
most a few MB of output read. `isolation()` probes once which of these work and logs any
that do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from ba_jax.rewards import sandbox_cgroup, sandbox_root, sandbox_seccomp
from ba_jax.rewards.sandbox_slots import Slot, acquire_slot, free_slots, sweep_uid

logger = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 4 << 20  # stdout (and stderr) read per run before the run is killed
MAX_PROCESSES = 32  # RLIMIT_NPROC: processes + threads of the slot uid
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
WORKDIR_TMPFS_MB = 32  # total size of the private working directory (mount namespace only)
LAUNCHER_HEADROOM_MB = 64  # cgroup ceiling: memory_mb + working dir + launcher and reaper
WALL_GRACE_S = 10  # the reaper's own alarm: the run's wall clock plus this (see launcher)
# Over-mounted (mount namespace) with an empty read-only tmpfs, like /tmp: the other world-
# writable dirs and host services' unix sockets (a read-only mount does not stop connecting).
HIDDEN_DIRS = ("/var/tmp", "/dev/shm", "/run", "/var/run")
_STDERR_TAIL_BYTES = 16 << 10
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x00020000, 0x10000000, 0x20000000, 0x40000000)
_WORK_ROOT: str | None = None  # parent of the per-program temp dirs; None = tempfile's

# The launcher (sandbox_launcher.py) is run by the trainer's own interpreter as `python -I
# -S -c <_BOOTSTRAP> <fd>`, which reads the launcher's text and the run's config from the
# pipe `fd`: neither is on a command line (a program can read /proc/1/cmdline, the
# reaper's). The text is read once, at import: nothing of ba_jax is imported to start it,
# and an edit of the tree while a trainer runs cannot change its sandbox's set-up code.
_LAUNCHER = pathlib.Path(__file__).with_name("sandbox_launcher.py").read_bytes()
_BOOTSTRAP = (
    "import sys\n"
    "with open(int(sys.argv[1]), 'rb') as f:\n"
    "    code, _, config = f.read().partition(b'\\0')\n"
    "exec(compile(code, 'sandbox_launcher.py', 'exec'), {'__name__': '__main__', "
    "'__builtins__': __builtins__, 'sandbox_config': config})\n"
)

# What the program's interpreter runs: no site (so no site-packages and no project code on
# sys.path, which -I already keeps free of the cwd), but `exit`/`quit` as scripts expect.
_BOOT = (
    "import site, sys; site.setquit(); sys.argv = ['solution.py']\n"
    "src = open('solution.py', encoding='utf-8', errors='replace').read()\n"
    "exec(compile(src, 'solution.py', 'exec'), {'__name__': '__main__', "
    "'__file__': 'solution.py', '__builtins__': __builtins__})\n"
)


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What the sandbox enforces on this machine (probed once, see `isolation()`)."""

    python: str  # interpreter that runs programs
    drop_user: bool  # programs run as a slot's uid (sandbox_slots), not as the caller
    user_namespace: bool  # a user namespace (the non-root fallback)
    net_namespace: bool  # no network at all, not even loopback
    pid_namespace: bool  # private PIDs; the namespace dies with its reaper
    mount_namespace: bool  # tmpfs working dir, private /proc, read-only file system
    # What the mount namespace shows: a fresh root holding only the interpreter, its shared
    # libraries and standard library (read-only) and the working dir (True), or else the
    # host's own tree with every mount read-only (False; see docs/sandbox.md).
    minimal_root: bool = False
    # The program cannot create namespaces or mount anything (sandbox_seccomp's filter).
    seccomp: bool = False
    # Each program runs in a memory cgroup of memory_mb + its working dir + the launcher's
    # headroom, tmpfs pages included (sandbox_cgroup): "" none, else "v2" or "v1".
    memory_cgroup: str = ""
    notes: tuple[str, ...] = ()


@dataclasses.dataclass
class Run:
    """How one run of the program ended, and what it wrote."""

    outcome: str  # "exit", "signal", "timeout", "overflow", "setup"
    code: int = 0  # exit code or signal number
    cpu_s: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""  # tail
    warnings: tuple[str, ...] = ()
    memory_exceeded: bool = False  # the memory cgroup OOM-killed a process of the run


# ---------------------------------------------------------------------------- one run


def _kill_run(proc: subprocess.Popen, status: bytes) -> None:
    # Kill the reaper (pid 1 of the namespace) first: the kernel then kills everything in
    # the namespace and the launcher exits normally, so no orphan is left for the host's
    # init (which, in containers, often never reaps).
    reaper = [int(line[4:]) for line in status.decode().splitlines() if line.startswith("pid ")]
    if reaper:
        with contextlib.suppress(OSError):
            os.kill(reaper[0], signal.SIGKILL)  # still the launcher's unreaped child
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _drain(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes already in a pipe, without waiting for more."""
    os.set_blocking(fd, False)
    data = bytearray()
    try:
        while len(data) < limit:
            chunk = os.read(fd, min(1 << 16, limit - len(data)))
            if not chunk:
                break
            data += chunk
    except (BlockingIOError, OSError):
        pass
    return bytes(data)


def _start_launcher(cfg: dict, workdir: str, keep_fds: tuple[int, ...]) -> subprocess.Popen:
    """The launcher process, its text and `cfg` handed over through a pipe (not argv)."""
    config_r, config_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(config_r)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
            pass_fds=(config_r, *keep_fds))
    except BaseException:
        os.close(config_w)
        raise
    finally:
        os.close(config_r)
    try:  # more than a pipe holds: the launcher reads while this writes
        with open(config_w, "wb") as f:
            f.write(_LAUNCHER + b"\0" + json.dumps(cfg).encode())
    except BrokenPipeError:  # the launcher died first: no result, a set-up error
        pass
    return proc


def _run_once(iso: Isolation, slot: Slot | None, workdir: str, stdin: bytes,
              timeout_s: float, memory_mb: int,
              cgroup: sandbox_cgroup.SlotCgroup | None = None) -> Run:
    """Run solution.py in `workdir` once under every limit `iso` allows."""
    flags = ((_CLONE_NEWUSER if iso.user_namespace else 0)
             | (_CLONE_NEWNET if iso.net_namespace else 0)
             | (_CLONE_NEWPID if iso.pid_namespace else 0)
             | (_CLONE_NEWNS if iso.mount_namespace else 0))
    cpu_s = max(1, math.ceil(timeout_s))
    cgroup_fd, oom_kills = None, 0
    if cgroup is not None:
        cgroup.set_limit((memory_mb + WORKDIR_TMPFS_MB + LAUNCHER_HEADROOM_MB) << 20)
        oom_kills, cgroup_fd = cgroup.oom_kills(), cgroup.procs_fd()
    status_r, status_w = os.pipe()
    seccomp = sandbox_seccomp.filter_program(os.uname().machine) if iso.seccomp else None
    cfg = {
        "status_fd": status_w, "flags": flags, "mount": iso.mount_namespace,
        "parent": os.getpid(), "cgroup_fd": cgroup_fd, "wall_s": cpu_s + WALL_GRACE_S,
        "seccomp": seccomp.hex() if seccomp else None,
        "uid": slot.uid if iso.drop_user else None, "gid": slot.gid if iso.drop_user else None,
        "tmpfs_mb": WORKDIR_TMPFS_MB, "hide": HIDDEN_DIRS,
        "root": _ROOT_PLANS[iso.python] if iso.minimal_root else None,
        "argv": [iso.python, "-I", "-S", "-c", _BOOT],
        "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "HOME": "/nonexistent"},
        "limits": {
            "RLIMIT_CPU": [cpu_s, cpu_s + 1],
            "RLIMIT_AS": [memory_mb << 20] * 2,
            "RLIMIT_NPROC": [MAX_PROCESSES] * 2,
            "RLIMIT_FSIZE": [MAX_FILE_BYTES] * 2,
            "RLIMIT_NOFILE": [MAX_OPEN_FILES] * 2,
            "RLIMIT_CORE": [0, 0],
        },
    }
    try:
        proc = _start_launcher(cfg, workdir, (status_w,) if cgroup_fd is None
                               else (status_w, cgroup_fd))
    finally:
        os.close(status_w)
        if cgroup_fd is not None:
            os.close(cgroup_fd)
    deadline = time.monotonic() + timeout_s
    out, err, status = bytearray(), bytearray(), bytearray()
    err_total, stdin_pos, reason = 0, 0, None
    sel = selectors.DefaultSelector()
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")
    sel.register(status_r, selectors.EVENT_READ, "status")
    launcher_done = False
    try:
        while sel.get_map() and reason is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # After the launcher is gone, stdout may only be held open by a stray
                # background process (no PID namespace): that is not a timeout.
                reason = None if launcher_done else "timeout"
                break
            for key, _ in sel.select(remaining):
                if key.data == "in":
                    try:
                        stdin_pos += os.write(key.fd, stdin[stdin_pos:stdin_pos + (1 << 16)])
                    except BrokenPipeError:
                        stdin_pos = len(stdin)
                    if stdin_pos >= len(stdin):
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    if key.data == "status":
                        launcher_done = True
                        deadline = min(deadline, time.monotonic() + 0.2)
                elif key.data == "out":
                    out += chunk
                    if len(out) > MAX_OUTPUT_BYTES:
                        reason = "overflow"
                elif key.data == "err":
                    err_total += len(chunk)
                    err = (err + chunk)[-_STDERR_TAIL_BYTES:]
                    if err_total > MAX_OUTPUT_BYTES:
                        reason = "overflow"
                else:
                    status += chunk
        if reason is not None:
            try:  # pick up the reaper's pid if the launcher wrote it meanwhile
                os.set_blocking(status_r, False)
                status += os.read(status_r, 1 << 16)
            except OSError:
                pass
            _kill_run(proc, bytes(status))
        else:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                _kill_run(proc, bytes(status))
        proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers when there is no PID namespace
        except OSError:
            pass
        if reason != "overflow":
            # What the program wrote before it ended (or was killed) but the loop had not read
            # yet, e.g. when this thread was descheduled past the deadline or the grace
            # period: its last words (a MemoryError, its answer) decide the verdict.
            out += _drain(proc.stdout.fileno(), MAX_OUTPUT_BYTES + 1 - len(out))
            err = (err + _drain(proc.stderr.fileno(), _STDERR_TAIL_BYTES))[-_STDERR_TAIL_BYTES:]
            if len(out) > MAX_OUTPUT_BYTES:
                reason = "overflow"
    finally:
        sel.close()
        os.close(status_r)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
    lines = bytes(status).decode(errors="replace").splitlines()
    warnings = tuple(line[5:] for line in lines if line.startswith("warn "))
    run = Run("setup", stdout=bytes(out), stderr=bytes(err), warnings=warnings,
              memory_exceeded=cgroup is not None and cgroup.oom_kills() > oom_kills)
    if reason is not None:
        run.outcome = reason
        return run
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "setup":
            run.outcome, run.stderr = "setup", rest.encode()
            return run
        if kind in ("exit", "signal"):
            code, cpu = rest.split()
            run.outcome, run.code, run.cpu_s = kind, int(code), float(cpu)
    if run.outcome == "setup":
        run.stderr = f"launcher exited {proc.returncode} without a result".encode()
    return run


# ---------------------------------------------------------------------------- isolation

_ISOLATION: Isolation | None = None
_ISOLATION_LOCK = threading.Lock()
_SLOTS: tuple[int, ...] = ()
_CGROUP: tuple[str, str] | None = None  # (version, folder) of the slot cgroups


def _slot_cgroup(iso: Isolation, slot: Slot | None) -> sandbox_cgroup.SlotCgroup | None:
    if not iso.memory_cgroup or slot is None or _CGROUP is None:
        return None
    return sandbox_cgroup.SlotCgroup(*_CGROUP, slot.uid)


def _python_candidates() -> list[str]:
    override = os.environ.get("BA_JAX_SANDBOX_PYTHON")
    if override:
        return [override]
    found = [sys.executable, os.path.realpath(sys.executable),
             getattr(sys, "_base_executable", ""), shutil.which("python3") or "",
             "/usr/bin/python3"]
    return [p for i, p in enumerate(found) if p and os.path.exists(p) and p not in found[:i]]


_ROOT_PLANS: dict[str, dict] = {}  # interpreter -> its minimal root (sandbox_root)


def _probe(iso: Isolation) -> tuple[bool, tuple[str, ...], str, str]:
    """Whether a trivial program runs under `iso`, the launcher's warnings, python version,
    and why not (an excerpt of the error)."""
    workdir = tempfile.mkdtemp(prefix="ba_jax_sandbox_probe_", dir=_WORK_ROOT)
    slot = acquire_slot(_SLOTS) if iso.drop_user else None
    cgroup = None
    try:
        with open(os.path.join(workdir, "solution.py"), "w") as f:
            f.write("import sys\nprint('ok', sys.version.split()[0])\n")
        if slot is not None and not iso.mount_namespace:
            os.chown(workdir, slot.uid, slot.gid)
        cgroup = _slot_cgroup(iso, slot)
        run = _run_once(iso, slot, workdir, b"", 10.0, 512, cgroup)
        ok = run.outcome == "exit" and run.code == 0 and run.stdout.startswith(b"ok ")
        version = run.stdout.split()[1].decode() if ok else ""
        detail = "" if ok else f"{run.outcome} {run.code}: {excerpt(run.stderr[-200:], 200)}"
        return ok, run.warnings, version, detail
    except OSError as e:  # the slot's cgroup could not be made or limited
        return False, (), "", f"setup {e!r}"
    finally:
        if slot is not None:
            sweep_uid(slot.uid)
            if cgroup is not None:
                cgroup.remove()
            slot.release()
        shutil.rmtree(workdir, ignore_errors=True)


def isolation() -> Isolation:
    """Probe once (thread-safe) the strongest isolation this machine supports, and log it."""
    global _ISOLATION, _SLOTS, _CGROUP
    with _ISOLATION_LOCK:
        if _ISOLATION is not None:
            return _ISOLATION
        _SLOTS = free_slots()
        root = os.geteuid() == 0 and bool(_SLOTS)
        plans = ([dict(drop_user=True, net_namespace=True, pid_namespace=True,
                       mount_namespace=True, minimal_root=True),
                  dict(drop_user=True, net_namespace=True, pid_namespace=True,
                       mount_namespace=True),
                  dict(drop_user=True, net_namespace=True, pid_namespace=True),
                  dict(drop_user=True, net_namespace=True), dict(drop_user=True)]
                 if root else
                 [dict(user_namespace=True, net_namespace=True, pid_namespace=True),
                  dict(user_namespace=True, net_namespace=True), {}])
        rejected = []  # why stronger plans or other interpreters were not taken
        machine = os.uname().machine
        seccomp = sandbox_seccomp.filter_program(machine) is not None
        if not seccomp:
            rejected.append(f"no seccomp filter: no syscall numbers known for {machine}")
        _CGROUP, why = sandbox_cgroup.probe() if root else (None, "no memory cgroup: not root")
        if _CGROUP is None:
            rejected.append(why)
        for plan in plans:
            pythons = _python_candidates()
            if plan.get("minimal_root"):  # the real binary: no venv path in the new root
                pythons = list(dict.fromkeys(os.path.realpath(p) for p in pythons))
            for python in pythons:
                iso = Isolation(python=python, **{
                    "drop_user": False, "user_namespace": False, "net_namespace": False,
                    "pid_namespace": False, "mount_namespace": False, **plan,
                    "seccomp": seccomp, "memory_cgroup": _CGROUP[0] if _CGROUP else ""})
                if iso.minimal_root and python not in _ROOT_PLANS:
                    try:
                        _ROOT_PLANS[python] = sandbox_root.make_root_plan(python)
                    except RuntimeError as e:
                        rejected.append(f"minimal root for {python}: {e}")
                        continue
                ok, warnings, version, detail = _probe(iso)
                if not ok and ("seccomp" in detail or "cgroup" in detail):
                    # the kernel refuses a layer (no seccomp, a read-only cgroup): go without
                    rejected.append(f"refused: {detail}")
                    seccomp = seccomp and "seccomp" not in detail
                    _CGROUP = None if "cgroup" in detail else _CGROUP
                    iso = dataclasses.replace(iso, seccomp=seccomp,
                                              memory_cgroup=_CGROUP[0] if _CGROUP else "")
                    ok, warnings, version, detail = _probe(iso)
                if not ok:
                    mode = "with a minimal root" if iso.minimal_root else "in the sandbox"
                    rejected.append(f"interpreter {python} does not run {mode}: {detail}")
                    continue
                _ISOLATION = dataclasses.replace(
                    iso, notes=(f"python {version}", *warnings, *rejected))
                full = (plan is plans[0] and root and not warnings and iso.seccomp
                        and bool(iso.memory_cgroup))
                (logger.info if full else logger.warning)(
                    "code sandbox isolation%s: %s", "" if full else " (WEAKER)", _ISOLATION)
                return _ISOLATION
        raise RuntimeError("code sandbox: no interpreter runs even without isolation; "
                           f"tried {_python_candidates()}")


# ---------------------------------------------------------------------------- one program


def excerpt(data: bytes | str, limit: int = 300) -> str:
    """`data` as text, cut to `limit` characters (saying how long it was)."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]"


def _remove_tree(path: str) -> None:
    def retry(func, p, _):  # a program may have removed its own write permissions
        os.chmod(os.path.dirname(p), 0o700)
        func(p)
    shutil.rmtree(path, onerror=retry)


class Session:
    """One program's place in the sandbox: its slot (uid) and working dir, for all its runs."""

    def __init__(self, iso: Isolation, slot: Slot | None, workdir: str,
                 cgroup: sandbox_cgroup.SlotCgroup | None = None):
        self.iso, self.slot, self.workdir, self.cgroup = iso, slot, workdir, cgroup

    def write_program(self, text: str) -> None:
        """Write the program as `solution.py` in the working dir."""
        with open(os.path.join(self.workdir, "solution.py"), "w", encoding="utf-8",
                  errors="replace") as f:
            f.write(text)
        if self.slot is not None and not self.iso.mount_namespace:
            os.chown(self.workdir, self.slot.uid, self.slot.gid)

    def run(self, stdin: bytes, timeout_s: float, memory_mb: int) -> Run:
        """Run the program once with `stdin`, under every limit the isolation allows."""
        return _run_once(self.iso, self.slot, self.workdir, stdin, timeout_s, memory_mb,
                         self.cgroup)


@contextlib.contextmanager
def session() -> Iterator[Session]:
    """A slot and a fresh working dir for one program (probing the isolation on first use);
    on exit the dir is removed and the slot's leftover processes killed."""
    iso = isolation()
    slot = acquire_slot(_SLOTS) if iso.drop_user else None
    cgroup = None
    try:
        if slot is not None:
            sweep_uid(slot.uid)  # leftovers of an earlier owner of the slot that crashed
        cgroup = _slot_cgroup(iso, slot)
        workdir = tempfile.mkdtemp(prefix="ba_jax_sandbox_", dir=_WORK_ROOT)
        try:
            yield Session(iso, slot, workdir, cgroup)
        finally:
            _remove_tree(workdir)
    finally:
        if slot is not None:
            if sweep_uid(slot.uid):
                logger.warning("code sandbox: killed leftover processes of uid %d", slot.uid)
            if cgroup is not None:
                cgroup.remove()
            slot.release()
