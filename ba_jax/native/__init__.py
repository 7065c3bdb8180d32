"""Optional native CPU kernels (XLA FFI custom calls), with the XLA path as the fallback.

Lives here: building (`python -m ba_jax.native build`, run by `make`), loading and
registering the kernels, and their Python call wrappers. Four groups of kernels:

* `decode_attention`, the one-token cached attention of `Qwen.decode` on CPU, optionally
  with a prompt segment shared by the samples of each prompt (decode_attention.cc says why
  XLA:CPU needs it);
* `attention` / `attention_grad`, the training forward's masked self-attention and its
  gradients (attention.cc), used by `Qwen.__call__` on one CPU device when the library was
  compiled with AVX-512; in bfloat16 their products run on AMX tiles where the processor
  has them (attention_amx.cc);
* `swiglu` / `swiglu_grad` and `rms_norm` / `rms_norm_grad`, the MLP's silu(g) * u (g and
  u the halves of one product) and RMSNorm with their gradients, one pass each
  (elementwise.cc), under the same conditions as `attention`;
* `matmul_amx`, a bfloat16 x bfloat16 -> float32 matrix product on Intel AMX tiles
  (matmul_amx.cc), used by the model's bf16 projections when the processor has AMX, and
  `pack_amx` / `matmul_amx_packed`, the same product with the weight packed once (the
  sampler's decode loop).

Nothing else depends on them: when the shared library is missing (no C++ compiler), the
backend is not the CPU or the processor lacks AMX, callers use the XLA path, which
computes the same thing.

The library is compiled for the machine it is built on (-march=native) into this folder,
next to the source; `make` rebuilds it when the source or jaxlib changes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
SOURCES = (_HERE / "decode_attention.cc", _HERE / "matmul_amx.cc", _HERE / "attention.cc",
           _HERE / "attention_amx.cc", _HERE / "elementwise.cc")
HEADERS = (_HERE / "simd.h", _HERE / "parallel.h", _HERE / "attention.h", _HERE / "amx.h",
           _HERE / "buffers.h")
LIBRARY = _HERE / "_decode_attention.so"
_TARGET = "ba_decode_attention"
_TARGET_SHARED = "ba_decode_attention_shared"
_TARGET_MATMUL = "ba_matmul_amx"
_TARGET_PACK = "ba_pack_amx"
_TARGET_MATMUL_PACKED = "ba_matmul_amx_packed"
_TARGET_ATTENTION = "ba_attention"
_TARGET_ATTENTION_GRAD = "ba_attention_grad"
_TARGET_SWIGLU = "ba_swiglu"
_TARGET_SWIGLU_GRAD = "ba_swiglu_grad"
_TARGET_RMS_NORM = "ba_rms_norm"
_TARGET_RMS_NORM_GRAD = "ba_rms_norm_grad"
_DISABLE_ENV = "BA_JAX_NO_NATIVE"  # set to 1 to force the XLA path (tests compare both)


def build(quiet: bool = False) -> Path:
    """Compiles the kernel library with the system C++ compiler -> its path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(tmp)]
    if not quiet:
        print(" ".join(cmd))
    subprocess.run(cmd, check=True)
    os.replace(tmp, LIBRARY)  # atomic: a concurrent loader sees the old or the new file
    return LIBRARY


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not LIBRARY.exists():
        return None
    if LIBRARY.stat().st_mtime < max(src.stat().st_mtime for src in SOURCES + HEADERS):
        log.warning("%s is older than its source; run `python -m ba_jax.native build`", LIBRARY)
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
        for target, symbol in ((_TARGET, lib.BaDecodeAttention),
                               (_TARGET_SHARED, lib.BaDecodeAttentionShared),
                               (_TARGET_MATMUL, lib.BaMatmulAmx),
                               (_TARGET_PACK, lib.BaPackAmx),
                               (_TARGET_MATMUL_PACKED, lib.BaMatmulAmxPacked),
                               (_TARGET_ATTENTION, lib.BaAttentionForward),
                               (_TARGET_ATTENTION_GRAD, lib.BaAttentionBackward),
                               (_TARGET_SWIGLU, lib.BaSwigluForward),
                               (_TARGET_SWIGLU_GRAD, lib.BaSwigluBackward),
                               (_TARGET_RMS_NORM, lib.BaRmsNormForward),
                               (_TARGET_RMS_NORM_GRAD, lib.BaRmsNormBackward)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    except (OSError, AttributeError, ValueError) as err:
        log.warning("native kernels unavailable (%s); using the XLA path", err)
        return None
    return lib


def _register() -> bool:
    return _library() is not None


@functools.cache
def _amx() -> bool:
    lib = _library()
    return lib is not None and bool(lib.BaAmxAvailable())


@functools.cache
def _attention_built() -> bool:
    lib = _library()
    return lib is not None and bool(lib.BaAttentionAvailable())


def _enabled_on_cpu() -> bool:
    return os.environ.get(_DISABLE_ENV) != "1" and jax.default_backend() == "cpu"


def decode_attention_available() -> bool:
    """True when the kernel is built, loadable, enabled, and JAX runs on the CPU."""
    return _enabled_on_cpu() and _register()


def attention_available() -> bool:
    """True when `attention` / `attention_grad` can run: the library was built with AVX-512
    (F, BW, VL), JAX runs on the CPU and BA_JAX_NO_NATIVE is unset."""
    return _enabled_on_cpu() and _attention_built()


def attention_amx_available() -> bool:
    """True when `attention` / `attention_grad` run their bfloat16 products on AMX tiles
    (attention_amx.cc): the kernel is available and the processor has AMX-BF16."""
    return attention_available() and _amx()


def use_amx_attention(on: bool) -> None:
    """Lets the bfloat16 attention kernel use AMX tiles where available (the default) or
    keeps it on its AVX-512 loops (tests compare the two); applies to calls from then on,
    in compiled functions too."""
    lib = _library()
    if lib is not None:
        lib.BaAttentionUseAmx(int(bool(on)))


def matmul_amx_available() -> bool:
    """True when `matmul_amx` can run: the library is loaded, JAX runs on the CPU, the
    processor has AMX-BF16 and the OS granted its tile state, BA_JAX_NO_NATIVE is unset."""
    return _enabled_on_cpu() and _amx()


def _check_amx(name: str, *arrays) -> None:
    if not matmul_amx_available():
        raise RuntimeError(f"native {name} unavailable (no AMX-BF16, library not built, "
                           "not on the CPU, or BA_JAX_NO_NATIVE=1)")
    if any(x.ndim != 2 or x.dtype != jnp.bfloat16 for x in arrays):
        raise ValueError(f"{name} takes 2-D bfloat16 operands, got "
                         + " and ".join(f"{x.dtype}{x.shape}" for x in arrays))


def _check_out_dtype(name: str, out_dtype) -> None:
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name} returns float32 or bfloat16, not {out_dtype}")


def matmul_amx(a, b, *, transpose_a: bool = False, transpose_b: bool = False,
               out_dtype=jnp.float32) -> jax.Array:
    """op(a) @ op(b) for 2-D bfloat16 operands on AMX tiles -> [M, N] in out_dtype
    (float32, or bfloat16 rounded once from the float32 sum).

    op(a) is a [M, K] (or a.T of a [K, M] when transpose_a), op(b) is b [K, N] (or b.T of a
    [N, K] when transpose_b): the transposes are read by the kernel's packing, never
    materialised by XLA. Products are exact in float32 and summed in float32.
    """
    _check_amx("matmul_amx", a, b)
    m, k = a.shape[::-1] if transpose_a else a.shape
    k_b, n = b.shape[::-1] if transpose_b else b.shape
    if k != k_b:
        raise ValueError(f"matmul_amx: contracted sizes differ ({k} vs {k_b})")
    _check_out_dtype("matmul_amx", out_dtype)
    call = jax.ffi.ffi_call(_TARGET_MATMUL, jax.ShapeDtypeStruct((m, n), out_dtype))
    return call(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedAmx:
    """op(b) of a [K, N] product packed once for `matmul_amx_packed` (`pack_amx`): the
    tile unit's pair-interleaved layout, zero-padded to multiples of 32."""

    data: jax.Array  # bfloat16 [ceil32(N) / 16, ceil32(K) / 32, 512]
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))


def _pad32(x: int) -> int:
    return -(-x // 32) * 32


def pack_amx(b, *, transpose_b: bool = False) -> PackedAmx:
    """Packs op(b) (b [K, N], or b.T of a [N, K] when transpose_b), bfloat16, once, so that
    products with it over many calls (a decode loop) skip the per-call packing."""
    _check_amx("pack_amx", b)
    k, n = b.shape[::-1] if transpose_b else b.shape
    out = jax.ShapeDtypeStruct((_pad32(n) // 16, _pad32(k) // 32, 512), jnp.bfloat16)
    return PackedAmx(jax.ffi.ffi_call(_TARGET_PACK, out)(b, transpose_b=transpose_b), k, n)


def matmul_amx_packed(a, b: PackedAmx, *, transpose_a: bool = False,
                      out_dtype=jnp.float32) -> jax.Array:
    """op(a) @ op(b) as `matmul_amx`, with op(b) packed beforehand by `pack_amx`."""
    _check_amx("matmul_amx_packed", a)
    m, k = a.shape[::-1] if transpose_a else a.shape
    if k != b.k:
        raise ValueError(f"matmul_amx_packed: contracted sizes differ ({k} vs {b.k})")
    _check_out_dtype("matmul_amx_packed", out_dtype)
    call = jax.ffi.ffi_call(_TARGET_MATMUL_PACKED, jax.ShapeDtypeStruct((m, b.n), out_dtype))
    return call(a, b.data, transpose_a=transpose_a)


def _check_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, sin_BTH, cos_BTH) -> None:
    if not attention_available():
        raise RuntimeError("native attention unavailable (library not built with AVX-512, "
                           "not on the CPU, or BA_JAX_NO_NATIVE=1)")
    B, T, N, H = q_BTNH.shape
    if (k_BSKH.shape != v_BSKH.shape or k_BSKH.ndim != 4 or k_BSKH.shape[0] != B
            or k_BSKH.shape[3] != H or N % k_BSKH.shape[2] or mask_BTS.shape
            != (B, T, k_BSKH.shape[1]) or q_BTNH.dtype not in (jnp.float32, jnp.bfloat16)
            or not q_BTNH.dtype == k_BSKH.dtype == v_BSKH.dtype):
        raise ValueError(f"attention: q {q_BTNH.dtype}{q_BTNH.shape}, k {k_BSKH.dtype}"
                         f"{k_BSKH.shape}, v {v_BSKH.dtype}{v_BSKH.shape}, mask {mask_BTS.shape}"
                         " do not fit q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S], f32 or bf16")
    if (sin_BTH.shape != (B, T, H) or cos_BTH.shape != (B, T, H) or k_BSKH.shape[1] != T
            or H % 2):
        raise ValueError(f"attention: sin {sin_BTH.shape} and cos {cos_BTH.shape} must be "
                         f"[B, T, H] = {(B, T, H)} with H even, and keys at the T positions")


def attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH) -> jax.Array:
    """Self-attention of the training forward -> o float32 [B, T, N, H] (attention.cc).

    q and k are rotated first by the rotary tables sin/cos [B, T, H] (HF rotate-half, the
    result rounded to the operands' dtype, as `qwen._rope`), then softmax(q k^T / sqrt(H)) v
    over the slots where mask_BTS is true (query head n uses kv head n // (N // K));
    probabilities rounded to the operands' dtype before the value sum, a row with no true
    slot averages all slots, as `qwen._attend`."""
    _check_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH)
    call = jax.ffi.ffi_call(_TARGET_ATTENTION, jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32))
    return call(q_BTNH, k_BTKH, v_BTKH, mask_BTS.astype(bool), sin_BTH.astype(jnp.float32),
                cos_BTH.astype(jnp.float32))


def attention_grad(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH, o_BTNH, do_BTNH):
    """Gradients (dq, dk, dv, with respect to the un-rotated q and k; float32 sums rounded
    once to the operands' dtype) of `attention` for the output cotangent do (in the
    operands' dtype), given its float32 output o; the probabilities are recomputed."""
    _check_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH)
    like = lambda x: jax.ShapeDtypeStruct(x.shape, q_BTNH.dtype)  # noqa: E731
    call = jax.ffi.ffi_call(_TARGET_ATTENTION_GRAD, (like(q_BTNH), like(k_BTKH), like(v_BTKH)))
    return call(q_BTNH, k_BTKH, v_BTKH, mask_BTS.astype(bool), sin_BTH.astype(jnp.float32),
                cos_BTH.astype(jnp.float32), o_BTNH.astype(jnp.float32),
                do_BTNH.astype(q_BTNH.dtype))


def _check_swiglu(gu, *dh) -> None:
    if not attention_available():
        raise RuntimeError("native swiglu unavailable (library not built with AVX-512, "
                           "not on the CPU, or BA_JAX_NO_NATIVE=1)")
    if (gu.dtype not in (jnp.float32, jnp.bfloat16) or gu.ndim < 1 or gu.shape[-1] % 2
            or any(d.shape != (*gu.shape[:-1], gu.shape[-1] // 2) or d.dtype != gu.dtype
                   for d in dh)):
        raise ValueError(f"swiglu: gu {gu.dtype}{gu.shape} must be f32 or bf16 [..., 2F]"
                         + "".join(f" and dh {d.dtype}{d.shape} [..., F] of its dtype"
                                   for d in dh))


def swiglu(gu) -> jax.Array:
    """silu(g) * u for gu = [g, u] along the last axis ([..., 2F] -> [..., F]), in float32,
    silu(g) and the product each rounded to gu's dtype (elementwise.cc; one pass)."""
    _check_swiglu(gu)
    out = jax.ShapeDtypeStruct((*gu.shape[:-1], gu.shape[-1] // 2), gu.dtype)
    return jax.ffi.ffi_call(_TARGET_SWIGLU, out)(gu)


def swiglu_grad(gu, dh) -> jax.Array:
    """d(swiglu)/d(gu) for the cotangent dh [..., F]: [dg, du] [..., 2F] in gu's dtype;
    sigmoid(g) is recomputed."""
    _check_swiglu(gu, dh)
    return jax.ffi.ffi_call(_TARGET_SWIGLU_GRAD, jax.ShapeDtypeStruct(gu.shape, gu.dtype))(
        gu, dh)


def _check_rms_norm(x, scale, *more) -> None:
    if not attention_available():
        raise RuntimeError("native rms_norm unavailable (library not built with AVX-512, "
                           "not on the CPU, or BA_JAX_NO_NATIVE=1)")
    if (x.dtype not in (jnp.float32, jnp.bfloat16) or x.ndim < 1 or scale.shape != x.shape[-1:]
            or any(m.shape != x.shape or m.dtype != x.dtype for m in more)):
        raise ValueError(f"rms_norm: x {x.dtype}{x.shape} must be f32 or bf16 [..., H] with a "
                         f"scale [H] (got {scale.shape})"
                         + "".join(f" and dy {m.dtype}{m.shape} like x" for m in more))


def rms_norm(x, scale, *, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2, last axis) + eps) * scale, in float32, rounded once to x's dtype
    (elementwise.cc; one pass per row)."""
    _check_rms_norm(x, scale)
    call = jax.ffi.ffi_call(_TARGET_RMS_NORM, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, scale.astype(jnp.float32), eps=np.float32(eps))


def rms_norm_grad(x, scale, dy, *, eps: float) -> tuple[jax.Array, jax.Array]:
    """(dx in x's dtype, dscale float32 [H]) of `rms_norm` for the cotangent dy (x's dtype)."""
    _check_rms_norm(x, scale, dy)
    call = jax.ffi.ffi_call(_TARGET_RMS_NORM_GRAD, (
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(scale.shape, jnp.float32)))
    return call(x, scale.astype(jnp.float32), dy, eps=np.float32(eps))


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
    _library.cache_clear()
    _amx.cache_clear()
    _attention_built.cache_clear()
    ok = _register()
    print(f"built {LIBRARY.name}; registered: {ok}")
    return 0
