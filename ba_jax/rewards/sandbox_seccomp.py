"""The sandboxed program's seccomp filter: no new namespaces, no mounts.

Lives here: `filter_program(machine)`, the classic-BPF program (bytes of `struct
sock_filter`) that the launcher (`sandbox_launcher.py`) installs in the program's process
right before it execs the interpreter, and `SYSCALLS`, the syscall numbers it names per
architecture. Not here: installing it (the launcher: `prctl(PR_SET_NO_NEW_PRIVS)`, then
`prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`), choosing when (`sandbox.py`).

Why: a program that may create a user namespace becomes root inside it and can mount its own
tmpfs, whose pages no RLIMIT_AS counts, or build its own mount tree. The filter makes these
fail with EPERM: `unshare` and `setns` (any flags), `clone` with any namespace flag
(CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET in its first argument),
`mount`, `umount2`, `pivot_root` and the new mount API (`open_tree`, `move_mount`, `fsopen`,
`fsconfig`, `fsmount`, `fspick`, `mount_setattr`). `clone3` passes its flags in a struct a
classic BPF filter cannot read, so it fails with ENOSYS: the C library then falls back to
`clone` (glibc >= 2.34 for threads and posix_spawn), where the flags are checked. Every other
syscall is allowed: this is a hole-closer, not an allow-list (kernel exploits are out of
scope, docs/sandbox.md).

Architectures: x86_64 and aarch64 (their numbers below; checked against the kernel headers
by tests/test_sandbox_seccomp.py where those are installed). The filter first checks the
calling convention's `AUDIT_ARCH_*` and fails every syscall of another one with EPERM (an
x86_64 process can still enter the i386 table by `int 0x80`, an aarch64 one the arm32 table
in compat mode), and on x86_64 every x32 syscall (numbers with bit 30 set, the same
AUDIT_ARCH). On any other machine `filter_program` returns None: `sandbox.isolation()` then
runs programs without the filter and says so (`Isolation.seccomp=False`, logged WEAKER).
"""

from __future__ import annotations

import struct

# struct sock_filter opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000  # | errno
EPERM, ENOSYS = 1, 38
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits (little-endian machines)
X32_SYSCALL_BIT = 0x40000000

# clone() flags that create namespaces (CLONE_NEWTIME has no clone() bit: the low byte is the
# exit signal there; unshare and clone3 are refused whatever their flags).
NAMESPACE_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                   | 0x20000000 | 0x40000000)
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount",
          "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")

# machine (os.uname().machine) -> (AUDIT_ARCH_*, {syscall: number})
SYSCALLS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, dict(
        clone=56, clone3=435, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        mount_setattr=442)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        mount_setattr=442)),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str) -> bytes | None:
    """The filter for `machine` (as `os.uname().machine` names it) as the bytes of its
    `struct sock_filter` array, or None for an architecture whose numbers are not known."""
    if machine not in SYSCALLS:
        return None
    audit_arch, nr = SYSCALLS[machine]
    deny = _insn(_RET, RET_ERRNO | EPERM)
    head = [_insn(_LD_W_ABS, _ARCH),
            _insn(_JEQ, audit_arch, 1, 0), deny,  # another calling convention: nothing runs
            _insn(_LD_W_ABS, _NR)]
    if machine == "x86_64":  # x32 numbers share AUDIT_ARCH_X86_64
        head += [_insn(_JGE, X32_SYSCALL_BIT, 0, 1), deny]
    # [one compare per denied syscall][tail]; each compare jumps to the tail's last (EPERM)
    tail = [
        _insn(_JEQ, nr["clone"], 3, 0),  # clone: to the flag check
        _insn(_JEQ, nr["clone3"], 0, 1),
        _insn(_RET, RET_ERRNO | ENOSYS),  # clone3: the C library falls back to clone
        _insn(_RET, RET_ALLOW),  # everything else
        _insn(_LD_W_ABS, _ARG0_LOW),  # clone's flags
        _insn(_JSET, NAMESPACE_FLAGS, 1, 0),
        _insn(_RET, RET_ALLOW),
        deny,
    ]
    denied = [nr[name] for name in DENIED]
    body = [_insn(_JEQ, number, (len(denied) - 1 - i) + len(tail) - 1, 0)
            for i, number in enumerate(denied)]
    return b"".join(head + body + tail)
