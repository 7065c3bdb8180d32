"""The sandbox launcher: the process between the trainer and one untrusted program run.

Lives here: the script that `sandbox.py` starts for every run, in a fresh interpreter of
the trainer's own Python as `python -I -S -c <BOOTSTRAP> <fd>`: the bootstrap (in
`sandbox.py`) reads this file's text and the run's config (JSON) from a pipe, so neither
shows in any process's command line (a program can read /proc/1/cmdline), and runs it with
the config in the global `sandbox_config`. It makes itself die with its caller
(PR_SET_PDEATHSIG), joins the run's memory cgroup (`sandbox_cgroup.py`) through the open
`cgroup.procs` it is handed, unshares, builds the program's file system view (the minimal
root of `sandbox_root.py`, or the read-only host fallback), then forks pid 1 of the new PID
namespace (a reaper whose death kills every process in the namespace; it dies with the
launcher and, past the run's wall clock plus a grace, by its own alarm), which forks the
program: limits, oom_score_adj 1000, drop to the slot uid, a parent-death signal, no new
privileges, the seccomp filter of `sandbox_seccomp.py`, exec. Results go to a private
status pipe that is close-on-exec for the program.
Not here: choosing the isolation, the config and the limits, the wall clock and reading
output (`sandbox.py`); what the minimal root holds (`sandbox_root.py`); the filter's
instructions (`sandbox_seccomp.py`); making the cgroup (`sandbox_cgroup.py`).

It runs with the trainer's privileges (root where programs get a slot uid), before the
untrusted program and in the process tree it ends up in: standard library only, lean; it
must never import ba_jax or anything heavy.
"""

import ctypes
import json
import os
import resource
import signal

RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
status_fd = -1  # the status pipe, set by main()


def say(line):
    os.write(status_fd, (line + "\n").encode())


def mount(src, dst, fstype, flags, data=None):
    def enc(s):
        return s.encode() if s is not None else None
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s: %s" % (dst, os.strerror(e)))


def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def die_with_parent(parent):
    """SIGKILL when the thread that forked this process ends; `parent`: its pid, as seen
    here (None where it is outside this PID namespace), checked against a death just
    before the prctl."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter(code):
    # no_new_privs: required to install a filter without CAP_SYS_ADMIN, and no set-uid gain
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "seccomp: prctl(PR_SET_NO_NEW_PRIVS)")
    buf = ctypes.create_string_buffer(code, len(code))
    prog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0),
          "seccomp: prctl(PR_SET_SECCOMP)")


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


def main(cfg):
    global status_fd
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    try:
        die_with_parent(cfg["parent"])
        if cfg["cgroup_fd"] is not None:  # everything forked from here on is in the group
            os.write(cfg["cgroup_fd"], str(os.getpid()).encode())
            os.close(cfg["cgroup_fd"])
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
            # In a new PID namespace the launcher is outside it: getppid() says 0. A launcher
            # killed before the prctl is covered by the alarm: past the run's wall clock and
            # a grace the reaper kills its group and itself (and so the namespace).
            die_with_parent(None if cfg["flags"] & 0x20000000 else os.getppid())
            signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
            signal.alarm(cfg["wall_s"])
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
                    try:  # under a cgroup's OOM, the program's processes go first
                        with open("/proc/self/oom_score_adj", "w") as f:
                            f.write("1000")
                    except OSError as e:
                        say("warn oom_score_adj: %s" % e)
                    if cfg["uid"] is not None:
                        for std in (0, 1, 2):  # its own pipes, so /dev/stdin can be opened
                            os.fchown(std, cfg["uid"], cfg["gid"])
                        os.setgroups([])
                        os.setgid(cfg["gid"])
                        os.setuid(cfg["uid"])
                    die_with_parent(None)  # after setuid, which clears it
                    if cfg["seccomp"]:
                        install_filter(bytes.fromhex(cfg["seccomp"]))
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


if __name__ == "__main__":  # run by sandbox.py's bootstrap, which sets `sandbox_config`
    main(json.loads(globals().pop("sandbox_config")))
