"""Code rewards: run an untrusted generated program against stdin/stdout tests in a sandbox.

`check_program` takes a model response (the last fenced code block, else the whole text),
runs it once per test with the test's input on stdin and compares stdout line by line
(stripped, numeric fallback for floats). `check_programs` scores a batch on worker threads;
the work happens in child processes. A crash, timeout or limit hit is a failed result with
a status, never an exception; only malformed arguments raise `ValueError`.

Each run (see docs/sandbox.md): a launcher process (root) starts a new session and, where
the kernel allows, new network, PID and mount namespaces. In the mount namespace the
program gets a minimal root: a fresh tmpfs holding, bound read-only, only its interpreter,
the shared libraries it loads and its standard library, plus a few /dev nodes, a private
/proc and its working directory, a fresh size-limited tmpfs at /tmp/prog; nothing else of
the host (project tree, evaluation data, home directories) exists there. Where the kernel
refuses that root, the fallback is the host's tree with every mount read-only and /tmp and
the other world-writable dirs empty (`Isolation.minimal_root` says which is in force).
The program then runs as a per-slot unprivileged uid (60000 + slot, one slot per
concurrent run machine-wide, held by an flock) with CPU, address-space, process, file-size
and open-file limits, under a wall-clock timeout that kills the PID namespace, and with at
most a few MB of output read. `isolation()` probes once which of these work and logs any
that do not. Math rewards live in `math.py`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import grp
import json
import logging
import math
import os
import pwd
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from ba_jax.rewards import sandbox_root

logger = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "memory", "error")
MAX_OUTPUT_BYTES = 4 << 20  # stdout (and stderr) read per run before the run is killed
MAX_PROCESSES = 32  # RLIMIT_NPROC: processes + threads of the slot uid
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
WORKDIR_TMPFS_MB = 32  # total size of the private working directory (mount namespace only)
# Over-mounted (mount namespace) with an empty read-only tmpfs, like /tmp: the other
# world-writable dirs and where host services keep unix sockets (a read-only mount does not
# stop connecting to those).
HIDDEN_DIRS = ("/var/tmp", "/dev/shm", "/run", "/var/run")
UID_BASE = 60000  # slot i runs as uid = gid = UID_BASE + i
NUM_SLOTS = 64
_STDERR_TAIL_BYTES = 16 << 10
_REL_TOL = _ABS_TOL = 1e-6
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x00020000, 0x10000000, 0x20000000, 0x40000000)
_WORK_ROOT: str | None = None  # parent of the per-program temp dirs; None = tempfile's

# Launcher, run by the trainer's own interpreter as `python -I -S -c`: stdlib only, lean.
# It unshares, then forks pid 1 of the new PID namespace (a reaper whose death kills every
# process in the namespace), which forks the program: limits, drop to the slot uid, exec.
# Results go to a private status pipe that is close-on-exec for the program.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
fd = cfg["status_fd"]
os.set_inheritable(fd, False)
def say(line):
    os.write(fd, (line + "\n").encode())
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s: %s" % (dst, os.strerror(e)))
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
def make_root(new, plan):
    # A fresh tmpfs over the (host) working dir becomes the root; it holds only the plan's
    # read-only binds and symlinks. pivot_root, then detach the old root entirely.
    os.umask(0o022)
    mount("tmpfs", new, "tmpfs", NOSUID | NODEV | NOEXEC, "size=1m,mode=0755")
    for path, kind in plan["binds"]:
        dst = new + path
        os.makedirs(dst if kind == "dir" else os.path.dirname(dst), exist_ok=True)
        if kind != "dir":
            os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o600))
        mount(path, dst, None, BIND)
        mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | (0 if kind == "dev" else NODEV))
    for path, target in plan["links"]:
        os.makedirs(os.path.dirname(new + path), exist_ok=True)
        os.symlink(target, new + path)
    for path in plan["hide"]:
        mount("tmpfs", new + path, "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=4k,mode=0755")
    for path in ("/proc", "/tmp/prog", "/.old"):
        os.makedirs(new + path)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError("pivot_root: no syscall number known for " + os.uname().machine)
    check(libc.syscall(number, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", 2), "detach old root")  # MNT_DETACH
    os.rmdir("/.old")
    mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV | NOEXEC)
def read_only_host(hide):
    with open("/proc/self/mountinfo") as f:
        infos = [line.split() for line in f]
    for info in infos:
        point = info[4].encode().decode("unicode_escape")
        flags = REMOUNT | BIND | RDONLY
        for opt in info[5].split(","):
            flags |= {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC}.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except OSError as e:
            say("warn read-only remount failed: %s" % e)
    # /tmp becomes an empty read-only tmpfs holding only the fresh working dir /tmp/prog.
    mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV | NOEXEC, "size=4k,mode=0755")
    os.mkdir("/tmp/prog")
    mount(None, "/tmp", None, REMOUNT | RDONLY | NOSUID | NODEV | NOEXEC)
    for path in hide:  # other world-writable dirs and host sockets: empty, read-only
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                mount("tmpfs", path, "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC,
                      "size=4k,mode=0755")
            except OSError as e:
                say("warn hiding %s failed: %s" % (path, e))
try:
    if cfg["flags"] and libc.unshare(cfg["flags"]) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "unshare: " + os.strerror(e))
    if cfg["mount"]:
        with open("solution.py", "rb") as f:
            source = f.read()
        mount(None, "/", None, REC | PRIVATE)
        if cfg["root"] is not None:
            make_root(os.getcwd(), cfg["root"])
        else:
            read_only_host(cfg["hide"])
        mount("tmpfs", "/tmp/prog", "tmpfs", NOSUID | NODEV,
              "size=%dm,mode=0700,uid=%d,gid=%d" % (cfg["tmpfs_mb"], cfg["uid"], cfg["gid"]))
        os.chdir("/tmp/prog")
        with open("solution.py", "wb") as f:
            f.write(source)
except BaseException as e:
    say("setup %r" % (e,))
    os._exit(1)
reaper = os.fork()
if reaper == 0:
    try:
        if cfg["mount"] and cfg["flags"] & 0x20000000:
            try:
                mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)
            except OSError as e:
                say("warn private /proc failed: %s" % e)
        child = os.fork()
        if child == 0:
            try:
                for name, value in cfg["limits"].items():
                    resource.setrlimit(getattr(resource, name), tuple(value))
                if cfg["uid"] is not None:
                    for std in (0, 1, 2):  # its own pipes, so /dev/stdin can be opened
                        os.fchown(std, cfg["uid"], cfg["gid"])
                    os.setgroups([])
                    os.setgid(cfg["gid"])
                    os.setuid(cfg["uid"])
                os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
            except BaseException as e:
                say("setup %r" % (e,))
                os._exit(127)
        os.closerange(0, 3)
        while True:
            got, status, usage = os.wait4(-1, 0)
            if got == child:
                break
        cpu = usage.ru_utime + usage.ru_stime
        if os.WIFSIGNALED(status):
            say("signal %d %.3f" % (os.WTERMSIG(status), cpu))
        else:
            say("exit %d %.3f" % (os.waitstatus_to_exitcode(status), cpu))
    except BaseException as e:
        say("setup %r" % (e,))
    os._exit(0)
say("pid %d" % reaper)
os.closerange(0, 3)
os.waitpid(reaper, 0)
"""

# What the program's interpreter runs: no site (so no site-packages and no project code on
# sys.path, which -I already keeps free of the cwd), but `exit`/`quit` as scripts expect.
_BOOT = (
    "import site, sys; site.setquit(); sys.argv = ['solution.py']\n"
    "src = open('solution.py', encoding='utf-8', errors='replace').read()\n"
    "exec(compile(src, 'solution.py', 'exec'), {'__name__': '__main__', "
    "'__file__': 'solution.py', '__builtins__': __builtins__})\n"
)


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """The verdict on one program."""

    passed: bool  # every test passed
    status: str  # one of STATUSES: the first failing test's outcome, or "passed"
    num_passed: int  # tests passed before the first failure (runs stop there)
    num_tests: int
    wall_s: float  # wall time for the whole program, all tests
    detail: str = ""  # first failure: which test, why, and a bounded excerpt


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What the sandbox enforces on this machine (probed once, see `isolation()`)."""

    python: str  # interpreter that runs programs
    drop_user: bool  # programs run as uid UID_BASE + slot, not as the caller
    user_namespace: bool  # a user namespace (the non-root fallback)
    net_namespace: bool  # no network at all, not even loopback
    pid_namespace: bool  # private PIDs; the namespace dies with its reaper
    mount_namespace: bool  # tmpfs working dir, private /proc, read-only file system
    # What the mount namespace shows: a fresh root holding only the interpreter, its shared
    # libraries and standard library (read-only) and the working dir (True), or else the
    # host's own tree with every mount read-only (False; see docs/sandbox.md).
    minimal_root: bool = False
    notes: tuple[str, ...] = ()


@dataclasses.dataclass
class _Run:
    outcome: str  # "exit", "signal", "timeout", "overflow", "setup"
    code: int = 0  # exit code or signal number
    cpu_s: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""  # tail
    warnings: tuple[str, ...] = ()


_CODE_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_INT_RE = re.compile(r"[+-]?\d+")


def extract_code(response: str) -> str:
    """The last fenced block tagged python/py or untagged, else the whole response."""
    blocks = [body for lang, body in _CODE_BLOCK_RE.findall(response)
              if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else response


def _numbers_close(a: str, b: str) -> bool:
    if _INT_RE.fullmatch(a) and _INT_RE.fullmatch(b):
        return int(a) == int(b)  # integers exactly: 10**9 and 10**9 + 1 differ
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def outputs_match(got: str, expected: str) -> bool:
    """Line-by-line equality after stripping, with a numeric fallback token by token."""
    got_lines = [line.strip() for line in got.strip().splitlines()]
    exp_lines = [line.strip() for line in expected.strip().splitlines()]
    if len(got_lines) != len(exp_lines):
        return False
    for g, e in zip(got_lines, exp_lines):
        if g == e:
            continue
        g_tokens, e_tokens = g.split(), e.split()
        if len(g_tokens) != len(e_tokens):
            return False
        if not all(a == b or _numbers_close(a, b) for a, b in zip(g_tokens, e_tokens)):
            return False
    return True


def _validate(tests: object, timeout_s: float, memory_mb: int) -> None:
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"tests must be a non-empty list of dicts, got {tests!r:.200}")
    for i, test in enumerate(tests):
        if (not isinstance(test, dict) or not isinstance(test.get("input"), str)
                or not isinstance(test.get("output"), str)):
            raise ValueError(f"test {i} must be {{'input': str, 'output': str}}: {test!r:.200}")
    if not timeout_s > 0 or not memory_mb > 0:
        raise ValueError(f"timeout_s and memory_mb must be positive: {timeout_s}, {memory_mb}")


# ---------------------------------------------------------------------------- processes


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


def _sweep_uid(uid: int) -> int:
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


class _Slot:
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


def _acquire_slot(slots: Sequence[int]) -> _Slot:
    lock_dir = _lock_dir()
    while True:
        for index in slots:
            fd = os.open(os.path.join(lock_dir, f"{index}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return _Slot(index, fd)
        time.sleep(0.005)


def _kill_run(proc: subprocess.Popen, status: bytes) -> None:
    # Kill the reaper (pid 1 of the namespace) first: the kernel then kills everything in
    # the namespace and the launcher exits normally, so no orphan is left for the host's
    # init (which, in containers, often never reaps).
    reaper = [int(line[4:]) for line in status.decode().splitlines() if line.startswith("pid ")]
    if reaper:
        try:
            os.kill(reaper[0], signal.SIGKILL)  # still the launcher's unreaped child
        except OSError:
            pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


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


def _run_once(iso: Isolation, slot: _Slot | None, workdir: str, stdin: bytes,
              timeout_s: float, memory_mb: int) -> _Run:
    """Run solution.py in `workdir` once under every limit `iso` allows."""
    flags = ((_CLONE_NEWUSER if iso.user_namespace else 0)
             | (_CLONE_NEWNET if iso.net_namespace else 0)
             | (_CLONE_NEWPID if iso.pid_namespace else 0)
             | (_CLONE_NEWNS if iso.mount_namespace else 0))
    cpu_s = max(1, math.ceil(timeout_s))
    status_r, status_w = os.pipe()
    cfg = {
        "status_fd": status_w, "flags": flags, "mount": iso.mount_namespace,
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
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
            pass_fds=(status_w,))
    finally:
        os.close(status_w)
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
    run = _Run("setup", stdout=bytes(out), stderr=bytes(err), warnings=warnings)
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


def _free_slots() -> tuple[int, ...]:
    """Slots whose uid and gid belong to no account on this machine."""
    used_uids = {p.pw_uid for p in pwd.getpwall()}
    used_gids = {g.gr_gid for g in grp.getgrall()}
    return tuple(i for i in range(NUM_SLOTS)
                 if UID_BASE + i not in used_uids and UID_BASE + i not in used_gids)


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
    slot = _acquire_slot(_SLOTS) if iso.drop_user else None
    try:
        with open(os.path.join(workdir, "solution.py"), "w") as f:
            f.write("import sys\nprint('ok', sys.version.split()[0])\n")
        if slot is not None and not iso.mount_namespace:
            os.chown(workdir, slot.uid, slot.gid)
        run = _run_once(iso, slot, workdir, b"", 10.0, 512)
        ok = run.outcome == "exit" and run.code == 0 and run.stdout.startswith(b"ok ")
        version = run.stdout.split()[1].decode() if ok else ""
        detail = "" if ok else f"{run.outcome} {run.code}: {_excerpt(run.stderr[-200:], 200)}"
        return ok, run.warnings, version, detail
    finally:
        if slot is not None:
            _sweep_uid(slot.uid)
            slot.release()
        shutil.rmtree(workdir, ignore_errors=True)


def isolation() -> Isolation:
    """Probe once (thread-safe) the strongest isolation this machine supports, and log it."""
    global _ISOLATION, _SLOTS
    with _ISOLATION_LOCK:
        if _ISOLATION is not None:
            return _ISOLATION
        _SLOTS = _free_slots()
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
        for plan in plans:
            pythons = _python_candidates()
            if plan.get("minimal_root"):  # the real binary: no venv path in the new root
                pythons = list(dict.fromkeys(os.path.realpath(p) for p in pythons))
            for python in pythons:
                iso = Isolation(python=python, **{
                    "drop_user": False, "user_namespace": False, "net_namespace": False,
                    "pid_namespace": False, "mount_namespace": False, **plan})
                if iso.minimal_root and python not in _ROOT_PLANS:
                    try:
                        _ROOT_PLANS[python] = sandbox_root.make_root_plan(python)
                    except RuntimeError as e:
                        rejected.append(f"minimal root for {python}: {e}")
                        continue
                ok, warnings, version, detail = _probe(iso)
                if not ok:
                    mode = "with a minimal root" if iso.minimal_root else "in the sandbox"
                    rejected.append(f"interpreter {python} does not run {mode}: {detail}")
                    continue
                _ISOLATION = dataclasses.replace(
                    iso, notes=(f"python {version}", *warnings, *rejected))
                full = plan is plans[0] and root and not warnings
                (logger.info if full else logger.warning)(
                    "code sandbox isolation%s: %s", "" if full else " (WEAKER)", _ISOLATION)
                return _ISOLATION
        raise RuntimeError("code sandbox: no interpreter runs even without isolation; "
                           f"tried {_python_candidates()}")


# ---------------------------------------------------------------------------- scoring

_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"out of memory")


def _excerpt(data: bytes | str, limit: int = 300) -> str:
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]"


def _verdict(run: _Run, expected: str, timeout_s: float) -> tuple[str, str]:
    """(status, detail) of one test run; status "passed" when it matches.

    The cause decides, not the clock: a program that hit its memory limit (the
    `MemoryError` that RLIMIT_AS raises, or an allocation failure, in its stderr) is
    `memory` however it then ended: exit, signal, CPU limit, or the wall clock running out
    while it was still dying (a slow machine). Only a clean exit is judged on its output.
    """
    if run.outcome == "overflow":
        return "error", f"output over {MAX_OUTPUT_BYTES} bytes"
    if run.outcome == "setup":
        logger.error("code sandbox failed to start a program: %s", _excerpt(run.stderr))
        return "error", "sandbox: " + _excerpt(run.stderr)
    name = ""
    if run.outcome == "signal":
        name = signal.Signals(run.code).name if run.code in signal.valid_signals() else run.code
    if (run.outcome != "exit" or run.code != 0) and any(m in run.stderr for m in _MEMORY_MARKERS):
        how = {"timeout": f"then wall clock over {timeout_s:g}s", "signal": f"killed by {name}"}
        return "memory", f"{how.get(run.outcome, f'exit {run.code}')}: " + _excerpt(
            run.stderr[-300:])
    if run.outcome == "timeout":
        return "timeout", f"wall clock over {timeout_s:g}s"
    if run.outcome == "signal":
        if run.code == signal.SIGXCPU or (run.code == signal.SIGKILL
                                          and run.cpu_s >= math.ceil(timeout_s)):
            return "timeout", f"CPU limit ({name})"
        return "error", f"killed by {name}" + (
            " (file size limit)" if run.code == signal.SIGXFSZ else "")
    if run.code != 0:
        return "error", f"exit {run.code}: {_excerpt(run.stderr[-600:], 600)}"
    got = run.stdout.decode("utf-8", errors="replace")
    if outputs_match(got, expected):
        return "passed", ""
    return "failed", f"expected {_excerpt(expected)!r}, got {_excerpt(got)!r}"


def _remove_tree(path: str) -> None:
    def retry(func, p, _):  # a program may have removed its own write permissions
        os.chmod(os.path.dirname(p), 0o700)
        func(p)
    shutil.rmtree(path, onerror=retry)


def check_program(source: str, tests: Sequence[dict], *, timeout_s: float = 6.0,
                  memory_mb: int = 1024) -> CodeResult:
    """Run the response's program on each test (stdin -> expected stdout); all must pass."""
    _validate(tests, timeout_s, memory_mb)
    start = time.monotonic()
    num_passed = 0
    try:
        iso = isolation()
        slot = _acquire_slot(_SLOTS) if iso.drop_user else None
        try:
            if slot is not None:
                _sweep_uid(slot.uid)  # leftovers of an earlier owner of the slot that crashed
            workdir = tempfile.mkdtemp(prefix="ba_jax_sandbox_", dir=_WORK_ROOT)
            try:
                with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8",
                          errors="replace") as f:
                    f.write(extract_code(source))
                if slot is not None and not iso.mount_namespace:
                    os.chown(workdir, slot.uid, slot.gid)
                for i, test in enumerate(tests):
                    run = _run_once(iso, slot, workdir, test["input"].encode(), timeout_s,
                                    memory_mb)
                    status, detail = _verdict(run, test["output"], timeout_s)
                    if status != "passed":
                        return CodeResult(False, status, num_passed, len(tests),
                                          time.monotonic() - start, f"test {i}: {detail}")
                    num_passed += 1
            finally:
                _remove_tree(workdir)
        finally:
            if slot is not None:
                if _sweep_uid(slot.uid):
                    logger.warning("code sandbox: killed leftover processes of uid %d", slot.uid)
                slot.release()
    except Exception as e:  # a sandbox fault scores 0; it must not stop the trainer
        logger.exception("code sandbox failure")
        return CodeResult(False, "error", num_passed, len(tests), time.monotonic() - start,
                          f"sandbox failure: {e!r}")
    return CodeResult(True, "passed", num_passed, len(tests), time.monotonic() - start)


def check_programs(items: Sequence[tuple[str, Sequence[dict]]], *, timeout_s: float = 6.0,
                   memory_mb: int = 1024, num_workers: int | None = None) -> list[CodeResult]:
    """`check_program` over (source, tests) pairs on up to `num_workers` threads, in order."""
    for _, tests in items:
        _validate(tests, timeout_s, memory_mb)
    if not items:
        return []
    workers = max(1, min(num_workers or os.cpu_count() or 1, len(items), NUM_SLOTS))
    if workers == 1:
        return [check_program(s, t, timeout_s=timeout_s, memory_mb=memory_mb) for s, t in items]
    with concurrent.futures.ThreadPoolExecutor(workers, "code-sandbox") as pool:
        return list(pool.map(
            lambda item: check_program(item[0], item[1], timeout_s=timeout_s,
                                       memory_mb=memory_mb), items))
