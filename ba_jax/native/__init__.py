"""Optional native CPU kernels (XLA FFI custom calls), with the XLA path as the fallback.

Lives here: building (`python -m ba_jax.native build`, run by `make`), loading and
registering the kernels, and their Python call wrappers. Today one kernel:
`decode_attention`, the one-token cached attention of `Qwen.decode` on CPU, optionally
with a prompt segment shared by the samples of each prompt (see
decode_attention.cc for why XLA:CPU needs it). Nothing else depends on it: when the shared
library is missing (no C++ compiler) or the backend is not the CPU, callers use the XLA
path, which computes the same thing.

The library is compiled for the machine it is built on (-march=native) into this folder,
next to the source; `make` rebuilds it when the source or jaxlib changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "decode_attention.cc"
LIBRARY = _HERE / "_decode_attention.so"
_TARGET = "ba_decode_attention"
_TARGET_SHARED = "ba_decode_attention_shared"
_DISABLE_ENV = "BA_JAX_NO_NATIVE"  # set to 1 to force the XLA path (tests compare both)


def build(quiet: bool = False) -> Path:
    """Compiles the kernel library with the system C++ compiler -> its path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    if not quiet:
        print(" ".join(cmd))
    subprocess.run(cmd, check=True)
    os.replace(tmp, LIBRARY)  # atomic: a concurrent loader sees the old or the new file
    return LIBRARY


@functools.cache
def _register() -> bool:
    if not LIBRARY.exists():
        return False
    if LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime:
        log.warning("%s is older than its source; run `python -m ba_jax.native build`", LIBRARY)
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.BaDecodeAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_TARGET_SHARED,
                                    jax.ffi.pycapsule(lib.BaDecodeAttentionShared),
                                    platform="cpu")
    except (OSError, AttributeError, ValueError) as err:
        log.warning("native kernels unavailable (%s); using the XLA path", err)
        return False
    return True


def decode_attention_available() -> bool:
    """True when the kernel is built, loadable, enabled, and JAX runs on the CPU."""
    if os.environ.get(_DISABLE_ENV) == "1" or jax.default_backend() != "cpu":
        return False
    return _register()


def decode_attention(q_BNH, k_new_BKH, v_new_BKH, k_cache_BKHS, v_cache_BKSH, mask_BS, index,
                     prompt=None):
    """Writes k/v_new at slot `index`, attends q over the valid slots -> (o_BNH f32, k, v).

    Keys are cached transposed ([B, K, H, S]), values not ([B, K, S, H]), as in `qwen`.
    mask_BS marks real slots (the one written included); slot s is attended iff
    mask_BS[b, s] and s <= index. The caches come back updated (in place under donation).

    `prompt` = (k_PKHT, v_PKTH, mask_PT): a segment shared by the B // P contiguous rows of
    each prompt (row b uses prompt b // (B // P)), attended before the row's own slots, in
    one softmax with them: the same as a cache of T + S slots holding the prompt first.
    """
    if not _register():
        raise RuntimeError(f"native decode_attention unavailable: build {LIBRARY.name} with "
                           "`python -m ba_jax.native build` (or unset BA_JAX_NO_NATIVE)")
    out = (jax.ShapeDtypeStruct(q_BNH.shape, jnp.float32),
           jax.ShapeDtypeStruct(k_cache_BKHS.shape, k_cache_BKHS.dtype),
           jax.ShapeDtypeStruct(v_cache_BKSH.shape, v_cache_BKSH.dtype))
    dtype = k_cache_BKHS.dtype
    args = (q_BNH.astype(dtype), k_new_BKH.astype(dtype), v_new_BKH.astype(dtype),
            k_cache_BKHS, v_cache_BKSH, mask_BS.astype(jnp.int32), jnp.asarray(index, jnp.int32))
    if prompt is None:
        return jax.ffi.ffi_call(_TARGET, out, input_output_aliases={3: 1, 4: 2})(*args)
    k_PKHT, v_PKTH, mask_PT = prompt
    if q_BNH.shape[0] % k_PKHT.shape[0]:
        raise ValueError(f"{q_BNH.shape[0]} rows do not split into {k_PKHT.shape[0]} prompts")
    call = jax.ffi.ffi_call(_TARGET_SHARED, out, input_output_aliases={3: 1, 4: 2})
    return call(*args, k_PKHT.astype(dtype), v_PKTH.astype(dtype), mask_PT.astype(jnp.int32))


def main(argv: list[str]) -> int:
    if argv[1:2] != ["build"]:
        print("usage: python -m ba_jax.native build", file=sys.stderr)
        return 2
    try:
        build()
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"native kernels not built ({err}); ba_jax will use the XLA path",
              file=sys.stderr)
        return 0
    _register.cache_clear()
    ok = _register()
    print(f"built {LIBRARY.name}; registered: {ok}")
    return 0
