"""Tests for ba_jax.rewards.sandbox_seccomp: the program's filter, instruction by instruction.

The filter is run here by a small classic-BPF interpreter on made-up `seccomp_data` for
every architecture it knows (so the aarch64 one is checked on an x86_64 machine too), and
its syscall numbers are checked against the kernel headers where they are installed. That
the kernel enforces it on a real program is tested by running programs
(tests/test_rewards_code.py::test_the_filter_refuses_namespaces_and_mounts).
"""

import os
import re
import struct

import pytest

from ba_jax.rewards import sandbox_seccomp as sc

ALLOW, EPERM, ENOSYS = sc.RET_ALLOW, sc.RET_ERRNO | sc.EPERM, sc.RET_ERRNO | sc.ENOSYS
SIGCHLD = 17
CLONE_VM, CLONE_THREAD, CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET = (
    0x100, 0x10000, 0x10000000, 0x20000, 0x40000000)


def _run_filter(code: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """What the filter returns for one syscall (the opcodes sandbox_seccomp emits)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack("=HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = insns[pc]
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif op == 0x06:  # ret k
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", sorted(sc.SYSCALLS))
def test_filter_refuses_namespaces_and_mounts_and_allows_the_rest(machine):
    arch, nr = sc.SYSCALLS[machine]
    code = sc.filter_program(machine)
    assert len(code) % 8 == 0

    def ret(name_or_nr, args=(0,) * 6, arch=arch):
        number = nr[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
        return _run_filter(code, number, arch, args)

    for name in ("unshare", "setns", "mount", "umount2", "pivot_root", "open_tree",
                 "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr"):
        assert ret(name) == EPERM, name
    assert ret("clone3") == ENOSYS  # glibc falls back to clone, where flags are visible
    assert ret("clone", (SIGCHLD, 0, 0, 0, 0, 0)) == ALLOW  # fork
    assert ret("clone", (CLONE_VM | CLONE_THREAD | 0x3D0F00, 0, 0, 0, 0, 0)) == ALLOW  # thread
    for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET):
        assert ret("clone", (flag | SIGCHLD, 0, 0, 0, 0, 0)) == EPERM, hex(flag)
    for other in (0, 1, 2, 59, 63, 221, 500):  # read, write, execve, ... whatever they are here
        if other not in nr.values():
            assert ret(other) == ALLOW, other
    # another calling convention (i386 from x86_64, arm32 compat from aarch64): nothing runs
    assert ret(0, arch=0x40000003) == EPERM and ret(0, arch=0x40000028) == EPERM
    if machine == "x86_64":  # x32 numbers share the arch: refused, unshare among them
        assert ret(sc.X32_SYSCALL_BIT | nr["unshare"]) == EPERM
        assert ret(sc.X32_SYSCALL_BIT | 0) == EPERM


def test_unknown_architecture_gets_no_filter():
    assert sc.filter_program("s390x") is None and sc.filter_program("riscv64") is None


@pytest.mark.parametrize("machine,header", [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ("x86_64", "/usr/include/asm/unistd_64.h"),
    ("aarch64", "/usr/include/asm-generic/unistd.h"),  # aarch64 uses the generic table
])
def test_numbers_match_the_kernel_headers(machine, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed here")
    text = open(header).read()
    found = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b", text)}
    for name, number in sc.SYSCALLS[machine][1].items():
        assert found.get(name) == number, (name, found.get(name), number)
