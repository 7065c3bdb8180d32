"""The building blocks of the Qwen decoder: projections, norms, RoPE, the SwiGLU MLP.

Lives here: `mm` (a contraction with float32 accumulation and a hand-written backward),
`Linear`, `Embed`, `RMSNorm`, `MLP`, RoPE (`rope`, `rope_tables`) and the logical axes of
the activations. Not here: attention and the decoder stack (`qwen.py`), the attention kernels
(`attention/`).

Numerics: parameters are stored in `param_dtype` and cast to `dtype` for compute; all matmuls
accumulate in float32 (`preferred_element_type`), and norm statistics, RoPE angles and the
softmax are float32. `mm` carries a hand-written backward: plain autodiff of a bf16 x bf16 ->
f32 product differentiates into f32 x bf16 products (upcast, at a fraction of the bf16 rate on
an MXU / tensor core) and rounds the weight gradient to bf16; here the backward products take
bf16 operands with float32 accumulation and the weight gradient stays float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from ba_jax import sharding

# Logical axes of the activations (`sharding.DEFAULT_RULES`): rows over the data-parallel
# axes, heads / MLP width / vocabulary over `tensor`, the hidden dimension whole.
X_AXES = ("act_batch", "act_length", "act_embed")
Q_AXES = ("act_batch", "act_length", "act_heads", None)
KV_AXES = ("act_batch", "act_length", "act_kv_heads", None)
MLP_AXES = ("act_batch", "act_length", "act_mlp")
LOGITS_AXES = ("act_batch", "act_length", "act_vocab")




def mm(x: jax.Array, w: jax.Array, w_axes: tuple[int, ...], out_dtype=jnp.float32,
        w_logical: tuple[str, ...] | None = None) -> jax.Array:
    """Contracts x's trailing len(w_axes) dims with w's `w_axes` (increasing); the float32 sum,
    rounded once to out_dtype. w (the parameter, in its own dtype) is cast to x's compute dtype
    inside, so that its gradient leaves the float32 accumulator in the parameter's dtype.

    `w_logical` (w's logical axes, as `sharding.PARAM_AXES` names them): on a mesh the cast
    copy is pinned to w's own sharding, so the cast runs on each device's shard and the
    layer gathers weights in the compute dtype (half the bytes of float32 in bf16), and the
    weight gradient is pinned back to it (reduce-scattered, not all-reduced)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = (None if w_logical is None or mesh.empty
            else sharding.logical_spec(w_logical, w.shape, mesh))
    return _mm_vjp(x, w, w_axes, out_dtype, spec)


def _cast_pinned(w, dtype, spec):
    w_c = w.astype(dtype)
    return w_c if spec is None else lax.with_sharding_constraint(w_c, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mm_vjp(x, w, w_axes, out_dtype, spec):
    n = len(w_axes)
    dims = ((tuple(range(x.ndim - n, x.ndim)), w_axes), ((), ()))
    y = lax.dot_general(x, _cast_pinned(w, x.dtype, spec), dims,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def _mm_fwd(x, w, w_axes, out_dtype, spec):
    return _mm_vjp(x, w, w_axes, out_dtype, spec), (x, w)


def _mm_bwd(w_axes, out_dtype, spec, res, g):
    x, w = res
    g = g.astype(x.dtype)  # bf16 cotangent: the backward products stay bf16 x bf16 -> f32
    w_c = _cast_pinned(w, x.dtype, spec)
    n_free = x.ndim - len(w_axes)
    lead = tuple(range(n_free))
    w_free = tuple(a for a in range(w.ndim) if a not in w_axes)
    g_wdims = tuple(range(n_free, g.ndim))
    dx = lax.dot_general(g, w_c, ((g_wdims, w_free), ((), ())), preferred_element_type=jnp.float32)
    if w_free + w_axes == tuple(range(w.ndim)):  # w = [out..., in...] (the tied embedding)
        dw = lax.dot_general(g, x, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
    else:  # [in (w_axes order)..., out...] -> w's axis order
        dw = lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
        dw = jnp.transpose(dw, np.argsort(w_axes + w_free))
    if spec is not None:
        dw = lax.with_sharding_constraint(dw, spec)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_mm_vjp.defvjp(_mm_fwd, _mm_bwd)


class Linear(nnx.Module):
    """x[..., *in_shape] -> y[..., *out_shape]; kernel [*in_shape, *out_shape] with logical
    axes `axes` (its `sharding.PARAM_AXES` entry without the stacked `layers` axis; a test
    checks that the two agree for every kernel)."""

    def __init__(self, in_shape, out_shape, *, axes, use_bias, rngs, dtype, param_dtype):
        init = nnx.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (*in_shape, *out_shape), param_dtype))
        self.bias = nnx.Param(jnp.zeros(out_shape, param_dtype)) if use_bias else None
        self.n_in = len(in_shape)
        self.axes = tuple(axes)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        out_dtype = self.dtype if self.bias is None else jnp.float32
        y = mm(x.astype(self.dtype), self.kernel[...], tuple(range(self.n_in)), out_dtype,
                self.axes)
        if self.bias is None:
            return y
        return (y + self.bias[...].astype(jnp.float32)).astype(self.dtype)


class Embed(nnx.Module):
    """Token embedding table [V, D] (also the output projection when tied)."""

    def __init__(self, vocab: int, dim: int, *, rngs, param_dtype):
        init = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, dim), param_dtype))


class RMSNorm(nnx.Module):
    """Normalises the last axis with float32 statistics (HF Qwen2RMSNorm/Qwen3RMSNorm)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Scaled in float32 and rounded once, as Hugging Face does; the scale's gradient is a
        # float32 sum over tokens.
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope(x_BTNH: jax.Array, sin_BTH: jax.Array, cos_BTH: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout: the two halves of the head dim form the pairs)."""
    x32_BTNH = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(x32_BTNH, 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    out = x32_BTNH * cos_BTH[:, :, None, :] + rot * sin_BTH[:, :, None, :]
    return out.astype(x_BTNH.dtype)


def rope_tables(positions_BT: jax.Array, head_dim: int, theta: float):
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angle = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    angle = jnp.concatenate([angle, angle], axis=-1)
    return jnp.sin(angle), jnp.cos(angle)



class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), the product in float32, rounded once."""

    def __init__(self, D: int, F: int, *, rngs, dtype, param_dtype):
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear((D,), (F,), axes=("embed", "mlp"), **kw)
        self.up_proj = Linear((D,), (F,), axes=("embed", "mlp"), **kw)
        self.down_proj = Linear((F,), (D,), axes=("mlp", "embed"), **kw)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        g_BTF = self.gate_proj(x_BTD).astype(jnp.float32)
        h_BTF = jax.nn.silu(g_BTF) * self.up_proj(x_BTD).astype(jnp.float32)
        return self.down_proj(sharding.constrain(h_BTF.astype(x_BTD.dtype), MLP_AXES))
