"""Host memory allocator settings for CPU-heavy runs (trainer, evaluation, benchmarks).

XLA:CPU allocates an executable's temporaries afresh on every execution. glibc serves
large blocks by mmap and gives them back on free (and the per-thread arenas return freed
pages too), so the next step touches new pages: ~250,000 minor page faults per train step
of the reference model (docs/benchmarks.md), i.e. ~1 GB of page zeroing in the kernel per
step. `keep_freed_memory()` tells glibc to serve every allocation from the one main heap,
never by mmap, and never to trim it: freed blocks are reused by the next step, and the
faults disappear (measured: ~250,000 -> 0-80,000 per step, step 15-20% faster).

The trade-off, and why it is opt-in: the process keeps its peak heap for its whole life
(memory is not returned to the OS), and fragmentation raises that peak. On the reference
model's bf16 train step the resident peak went from 2.3 GB to 3.1 GB and stayed there over
40 steps in one run, but reached 5.0 GB after 19 steps in another. A long run that sits
near the machine's memory limit should not use it.

The entry points (`ba_jax.main`, `ba_jax.evaluate`) apply it when BA_JAX_KEEP_FREED_MEMORY=1;
`keep_freed_memory()` applies it directly. Either must run at process start, before JAX
creates its threads. It does nothing on a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

ENV = "BA_JAX_KEEP_FREED_MEMORY"
_applied = False


def apply_env() -> bool:
    """keep_freed_memory() if BA_JAX_KEEP_FREED_MEMORY=1; True when applied."""
    return os.environ.get(ENV) == "1" and keep_freed_memory()


def keep_freed_memory() -> bool:
    """Configures glibc malloc to keep and reuse freed memory; True when it did."""
    global _applied
    if _applied:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = (mallopt(_M_ARENA_MAX, 1) == 1 and mallopt(_M_MMAP_MAX, 0) == 1
          and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1)
    _applied = ok
    return ok
