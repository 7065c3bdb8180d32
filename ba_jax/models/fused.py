"""The model's fused elementwise operations, each with its own backward: the MLP's SwiGLU
activation and RMSNorm on the native CPU kernels (`ba_jax.native.swiglu` / `rms_norm`).

Why: written plainly in bf16, XLA:CPU evaluates these op by op with a bf16 rounding after
each, and autodiff keeps float32 intermediates (sigmoid(g), silu(g), the normalised x) as
residuals: several [tokens, width] passes over memory on each side. Here the only residuals
are the inputs, and the backward recomputes what it needs. The model (`qwen`) decides
whether the native kernels run (`native` below); the XLA form of SwiGLU computes the same
numbers and serves every other backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ba_jax import native as native_kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def swiglu(gu: jax.Array, native: bool) -> jax.Array:
    """silu(g) * u for gu = [g, u] along the last axis ([..., 2F] -> [..., F]), computed in
    float32 and rounded like PyTorch's bf16 ops: silu(g) once to gu's dtype, the product once
    more; on the CPU kernel when `native`. The backward writes [dg, du] as one array, the
    cotangent of the gate/up product that made gu."""
    if native:
        return native_kernels.swiglu(gu)
    g, u = jnp.split(gu.astype(jnp.float32), 2, axis=-1)
    s = (g * jax.nn.sigmoid(g)).astype(gu.dtype)
    return (s.astype(jnp.float32) * u).astype(gu.dtype)


def _swiglu_fwd(gu, native):
    return swiglu(gu, native), gu


def _swiglu_bwd(native, gu, dh):
    dh = dh.astype(gu.dtype)
    if native:
        return (native_kernels.swiglu_grad(gu, dh),)
    g, u = jnp.split(gu.astype(jnp.float32), 2, axis=-1)
    dh32 = dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    s = (g * sig).astype(gu.dtype).astype(jnp.float32)
    du = dh32 * s
    ds = (dh32 * u).astype(gu.dtype).astype(jnp.float32)
    dg = ds * sig * (1.0 + g * (1.0 - sig))
    return (jnp.concatenate([dg, du], axis=-1).astype(gu.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale32: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x's last axis times the float32 scale, on the CPU kernel
    (`native.rms_norm`): one pass forward and one backward; the numerics of `qwen.RMSNorm`'s
    XLA path."""
    return native_kernels.rms_norm(x, scale32, eps=eps)


def _rms_norm_fwd(x, scale32, eps):
    return rms_norm(x, scale32, eps), (x, scale32)


def _rms_norm_bwd(eps, res, dy):
    x, scale32 = res
    return native_kernels.rms_norm_grad(x, scale32, dy.astype(x.dtype), eps=eps)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
