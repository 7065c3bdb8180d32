"""The minimal root of a sandboxed program: which host files its interpreter needs.

Lives here: `make_root_plan(python)`, which runs a census of the interpreter once on the
host and returns what the launcher (`sandbox_launcher.py`) builds in the program's mount
namespace: a fresh tmpfs root holding, bound read-only, only the interpreter binary, the
dynamic loader and the shared libraries it and its standard library's C modules load, the
standard library folders (their site-packages covered by an empty tmpfs), `/etc/ld.so.cache`,
a few /dev nodes, and the symlinks on the way to those paths (`/lib64 -> usr/lib64`).
Nothing else of the host, the project tree and evaluation data included, exists there. Not
here: building that root (`sandbox_launcher.py`) and running programs (`sandbox.py`); see
docs/sandbox.md.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess

# The minimal root's /dev: these nodes bound from the host, and the usual fd links.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
             ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"))

# Run once per interpreter, on the host, to learn what the minimal root must hold: it imports
# every extension module of the standard library (so their shared libraries load; not the
# GUI one, whose Tk and X11 libraries a program without a display cannot use) and lists
# the files mapped; under LD_DEBUG=libs the dynamic loader also names each path it opened.
_CENSUS = r"""
import importlib.machinery, json, os, sys
paths = [p for p in sys.path if os.path.exists(p)]  # -I -S: the standard library only
for d in filter(os.path.isdir, paths):
    for name in sorted(os.listdir(d)):
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if name.endswith(suffix) and not name.startswith("_tkinter"):
                try:
                    __import__(name[:-len(suffix)])
                except BaseException:
                    pass
                break
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            maps.add(fields[5].rstrip("\n"))
sys.stdout.write("\n" + json.dumps({"paths": paths, "maps": sorted(maps)}) + "\n")
"""
_LOADER_PATH_RE = re.compile(rb"(?:calling init: |trying file=)(/\S+)")


def _host_chain(path: str, links: dict[str, str], depth: int = 0) -> str:
    """The real path of `path` on the host, recording each symlink met on the way into
    `links` (link path -> target as written), so the minimal root can repeat them."""
    if depth > 40:
        raise RuntimeError(f"too many symlinks resolving {path}")
    parts = [p for p in os.path.normpath(path).split("/") if p]
    real = "/"
    for i, part in enumerate(parts):
        here = os.path.join(real, part)
        if os.path.islink(here):
            links[here] = target = os.readlink(here)
            # `real` holds no symlink, so normpath's ".." handling is exact.
            return _host_chain(os.path.join(real, target, *parts[i + 1:]), links, depth + 1)
        real = here
    return real


def _under(path: str, dirs) -> bool:
    return any(path.startswith(d.rstrip("/") + "/") for d in dirs)


def make_root_plan(python: str) -> dict:
    """What the minimal root holds for `python`, as JSON for the launcher: `binds` ([host
    path, "dir" | "file" | "dev"], bound read-only at the same path), `links` ([path,
    target]) and `hide` (dirs covered by an empty tmpfs). RuntimeError if the census fails."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "LD_DEBUG": "libs"}
    try:
        proc = subprocess.run([python, "-I", "-S", "-c", _CENSUS], stdin=subprocess.DEVNULL,
                              capture_output=True, cwd="/", env=env, timeout=120)
        census = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RuntimeError(f"library census of {python} failed: {e!r}") from e
    links: dict[str, str] = {}
    dirs, files = set(), set()
    for path in census["paths"]:  # the stdlib folders (or zip): whole, but nothing broader
        real = _host_chain(path, links)
        if os.path.isfile(real):
            files.add(real)
        elif os.path.isfile(os.path.join(real, "os.py")) or real.endswith("/lib-dynload"):
            dirs.add(real)
    opened = [p.decode(errors="replace") for p in _LOADER_PATH_RE.findall(proc.stderr)]
    for path in [python, "/etc/ld.so.cache", *opened, *census["maps"]]:
        if path.startswith(("/dev/", "/proc/", "/sys/")) or not os.path.isfile(path):
            continue  # e.g. a loader search path that was tried and missed
        files.add(_host_chain(path, links))
    dirs = {d for d in dirs if not _under(d, dirs)}
    binds = [[d, "dir"] for d in sorted(dirs)]
    binds += [[f, "file"] for f in sorted(files) if not _under(f, dirs)]
    binds += [[d, "dev"] for d in DEVICES
              if os.path.exists(d) and stat.S_ISCHR(os.stat(d).st_mode)]
    hide = [os.path.join(d, sub) for d in sorted(dirs) for sub in ("site-packages", "dist-packages")
            if os.path.isdir(os.path.join(d, sub)) and not os.path.islink(os.path.join(d, sub))]
    links_kept = [[k, v] for k, v in sorted(links.items()) if not _under(k, dirs)]
    return {"binds": binds, "links": links_kept + [list(x) for x in DEV_LINKS], "hide": hide}
