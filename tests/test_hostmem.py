"""ba_jax.hostmem: glibc keeps and reuses freed memory, so XLA's per-execution temporaries
stop page-faulting on every call. Each case runs in a fresh process: the setting is
process-wide and must precede JAX's threads."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

_PROBE = r"""
import json, resource, sys
from ba_jax import hostmem
applied = {"1": hostmem.keep_freed_memory, "0": lambda: False,
           "env": hostmem.apply_env}[sys.argv[1]]()
import jax, jax.numpy as jnp

@jax.jit
def f(x):  # a 64 MiB temporary per call, reduced to a scalar
    y = jnp.sin(jnp.broadcast_to(x, (4096, 4096)) + jnp.arange(4096.0)[:, None])
    return jnp.sum(y * y)

x = jnp.ones((4096,))
for _ in range(15):  # the kept heap settles after a few calls
    f(x).block_until_ready()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults_per_call": sorted(faults)[4]}))  # median
"""


def _probe(setting: str, **env) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "BA_JAX_KEEP_FREED_MEMORY")}
    env = {**base, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    plain, kept = _probe("0"), _probe("1")
    assert kept["applied"] and not plain["applied"]
    # 64 MiB of fresh 4 KiB pages is ~16,000 faults per call when glibc hands it back; kept,
    # the heap settles after a few calls (the median call then faults nothing)
    assert plain["faults_per_call"] > 8000, plain
    assert kept["faults_per_call"] < plain["faults_per_call"] / 10, (plain, kept)


def test_entry_points_apply_it_only_when_asked():
    assert not _probe("env")["applied"]
    assert _probe("env", BA_JAX_KEEP_FREED_MEMORY="1")["applied"]
