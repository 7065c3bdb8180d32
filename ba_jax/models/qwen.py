"""Dense Qwen2/2.5 and Qwen3 decoders in flax.nnx, their published configs, and the KV cache.

Lives here: `ModelConfig` (+ `PRESETS`, `ModelConfig.from_hf_config`), the `Qwen` module
(full forward and cached decode) and `init_cache`. Not here: the Hugging Face key table and
file IO (`convert_hf.py`), parameter shardings (`sharding.py`), sampling loops (`sampler.py`).

Call interface:

    model = Qwen(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    logits_BTV = model(tokens_BT, positions_BT=None, attn_mask_BT=None)    # float32 logits

`attn_mask_BT` is 1 for real tokens and 0 for padding; a token attends causally to the real
tokens at or before it. `positions_BT` defaults to `arange(T)` without a mask and to the number
of real tokens before each token with one (the same thing for unpadded or right-padded rows,
the right thing for left-padded ones). `model(tokens_BT)` is the Hugging Face call.

KV cache (for a sampler): `cache = init_cache(config, batch, max_len, dtype)` holds, per layer,
`k_BKHS[l]` of shape [B, K, H, S] (keys after RoPE, transposed) and `v_BKSH[l]` of shape
[B, K, S, H]. Then

    logits_BTV, cache = model.decode(tokens_BT, positions_BT, cache, cache_index, attn_mask_BS)

writes the T new tokens' keys and values into slots `cache_index .. cache_index+T-1` (one scalar
for all rows) and lets token t attend to slot s iff `attn_mask_BS[b, s]` and
`s <= cache_index + t`. `attn_mask_BS` marks the slots holding real tokens *including* the T
being written. Prefill is `decode` with the (left-padded) prompt at `cache_index=0`; each step
after is T=1 at the next slot. Batch and kv head lead so the batched dots read the cache in
place (no per-step transpose); keys are stored [H, S] so that a one-token query's scores are
a contraction over the cache's major axis (XLA:CPU runs the [S, H] form ~3x slower, and the
native kernel scores 16 slots per vector instruction); one buffer per layer lets
`dynamic_update_slice` update it in place when the caller's jit donates the cache.

Numerics: parameters are stored in `param_dtype` and cast to `dtype` for compute; all matmuls
accumulate in float32 (`preferred_element_type`), and norm statistics, RoPE angles and the
softmax are float32. `_mm` carries a hand-written backward so that in bfloat16 the gradient
matmuls also run as bf16 x bf16 -> f32 instead of being promoted to float32 by autodiff.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from ba_jax import native as native_kernels
from ba_jax.models import fused

_MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform, not NaN, row


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one dense Qwen2/2.5/3 model (Hugging Face field names in brackets)."""

    arch: str  # "qwen2" or "qwen3" (model_type); decides the exported architecture
    vocab_size: int  # V (vocab_size)
    hidden_size: int  # D (hidden_size)
    intermediate_size: int  # F, SwiGLU hidden width (intermediate_size)
    num_layers: int  # L (num_hidden_layers)
    num_heads: int  # N query heads (num_attention_heads)
    num_kv_heads: int  # K key/value heads, N % K == 0 (num_key_value_heads)
    head_dim: int  # H (head_dim, else hidden_size // num_attention_heads)
    rope_theta: float  # RoPE base (rope_theta / rope_parameters["rope_theta"])
    rms_norm_eps: float  # RMSNorm epsilon (rms_norm_eps)
    max_position_embeddings: int  # longest context the published model was trained for
    use_tied_embeddings: bool  # lm_head shares embed_tokens (tie_word_embeddings)
    use_qkv_bias: bool  # bias on q/k/v projections (Qwen2: always; Qwen3: attention_bias)
    use_o_bias: bool  # bias on o_proj (Qwen3 attention_bias only)
    use_qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    use_remat: bool = False  # rematerialise each decoder layer in the backward pass
    bos_token_id: int | None = None  # kept for export only
    eos_token_id: int | tuple[int, ...] | None = None  # kept for export only

    def __post_init__(self):
        if self.arch not in ("qwen2", "qwen3"):
            raise ValueError(f"arch must be 'qwen2' or 'qwen3', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of {self.num_kv_heads=}")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face Qwen2/Qwen3 config.json dict (transformers 4.x or 5.x layout)."""
        arch = hf.get("model_type")
        archs = hf.get("architectures") or []
        if arch not in ("qwen2", "qwen3") or any(
            a not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") for a in archs
        ):
            raise ValueError(
                f"unsupported architecture: model_type={arch!r}, architectures={archs}; "
                "expected qwen2/Qwen2ForCausalLM or qwen3/Qwen3ForCausalLM"
            )
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (only 'default')")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        for key in ("use_sliding_window", "use_mrope"):
            if hf.get(key):
                raise ValueError(f"unsupported config option {key}=True")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only 'silu')")
        heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            use_tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            use_qkv_bias=True if arch == "qwen2" else bias,
            use_o_bias=False if arch == "qwen2" else bias,
            use_qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )


def _qwen2(v, d, f, layers, n, k, theta, max_pos, tie) -> ModelConfig:
    return ModelConfig("qwen2", v, d, f, layers, n, k, d // n, theta, 1e-6, max_pos, tie,
                       use_qkv_bias=True, use_o_bias=False, use_qk_norm=False,
                       bos_token_id=151643, eos_token_id=151643)


def _qwen3(d, f, layers, n, k, tie) -> ModelConfig:
    return ModelConfig("qwen3", 151936, d, f, layers, n, k, 128, 1e6, 1e-6, 40960, tie,
                       use_qkv_bias=False, use_o_bias=False, use_qk_norm=True,
                       bos_token_id=151643, eos_token_id=151645)


# The published config.json of each base model (Qwen/<name> on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "Qwen2.5-0.5B": _qwen2(151936, 896, 4864, 24, 14, 2, 1e6, 32768, True),
    "Qwen2.5-1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, 1e6, 131072, True),
    "Qwen2.5-7B": _qwen2(152064, 3584, 18944, 28, 28, 4, 1e6, 131072, False),
    "Qwen2.5-Math-1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, 1e4, 4096, True),
    "Qwen2.5-Math-7B": _qwen2(152064, 3584, 18944, 28, 28, 4, 1e4, 4096, False),
    "Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": _qwen3(2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8, False),
}


_NATIVE_MATMUL: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "ba_jax_native_matmul", default=None)


# The kernel packs the weight on every call; below this many rows (a decode step's 128)
# that packing costs more than XLA's dot, measured on this project's reference model.
_AMX_MIN_ROWS = 512


@contextlib.contextmanager
def native_matmul(enabled: bool | None):
    """While tracing inside, the model's native CPU kernels are used iff `enabled` and they
    are available: bf16 projections of at least _AMX_MIN_ROWS rows on the AMX kernel
    (`native.matmul_amx`), the training forward's attention on `native.attention`, and the
    SwiGLU activation and RMSNorms on `native.swiglu` / `native.rms_norm` (all with their
    backward). None (the default outside): only when JAX sees a single device, because a
    custom call is not partitioned by XLA: a run that shards activations over a mesh must
    keep XLA's ops."""
    token = _NATIVE_MATMUL.set(enabled)
    try:
        yield
    finally:
        _NATIVE_MATMUL.reset(token)


def _native_enabled(unsharded: bool = False) -> bool:
    enabled = _NATIVE_MATMUL.get()
    return bool(unsharded or jax.device_count() == 1) if enabled is None else enabled


def _native_matmul_enabled(unsharded: bool = False) -> bool:
    return _native_enabled(unsharded) and native_kernels.matmul_amx_available()


# id(module) -> (module, its weight packed by native.pack_amx), inside `packed_weights`
_PACKED: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "ba_jax_packed_weights", default=None)


@contextlib.contextmanager
def packed_weights(model: "Qwen", *, unsharded: bool = False):
    """Inference only: while tracing inside, `model`'s bf16 projections (and the tied
    output embedding) multiply by weights packed once, here, for the AMX kernel, at any
    number of rows. For loops that reuse the weights every step (the sampler's decode):
    the per-call kernel repacks the weight, which costs more than XLA's dot at a decode
    step's 128 rows. A no-op unless the model computes in bfloat16 and the kernel would be
    used (see `native_matmul`; `unsharded=True`: the caller runs on one device, so the
    kernel is used by default even when JAX sees several). No gradient flows through
    packed products."""
    packed: dict[int, tuple[Any, Any]] = {}
    if model.dtype == jnp.bfloat16 and _native_matmul_enabled(unsharded):
        modules = [m for _, m in nnx.iter_modules(model)]
        # gate and up run as one product (MLP.gate_up): pack that, not the two kernels
        in_gate_up = {id(p) for m in modules if isinstance(m, MLP)
                      for p in (m.gate_proj, m.up_proj)}
        for module in modules:
            if isinstance(module, MLP):
                packed[id(module)] = (module, native_kernels.pack_amx(
                    _compute_weight(module.gate_up_kernels(), jnp.bfloat16)))
            elif isinstance(module, Linear) and id(module) not in in_gate_up:
                w = module.kernel[...]
                k = math.prod(w.shape[:module.n_in])
                packed[id(module)] = (module, native_kernels.pack_amx(
                    w.astype(jnp.bfloat16).reshape(k, -1)))
        if model.lm_head is None:
            e = model.embed_tokens
            packed[id(e)] = (e, native_kernels.pack_amx(
                e.embedding[...].astype(jnp.bfloat16), transpose_b=True))
    token = _PACKED.set(packed or None)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _packed_mm(module, x: jax.Array, n_in: int, out_shape, out_dtype) -> jax.Array | None:
    """x (contracting its trailing n_in dims) times module's packed weight, or None when
    the weight is not packed (outside `packed_weights`)."""
    entry = (_PACKED.get() or {}).get(id(module))
    if entry is None:
        return None
    lead = x.shape[:x.ndim - n_in]
    y = native_kernels.matmul_amx_packed(x.astype(jnp.bfloat16).reshape(math.prod(lead), -1),
                                         entry[1], out_dtype=out_dtype)
    return y.reshape(*lead, *out_shape)


def _amx_layout(x: jax.Array, w: jax.Array, w_axes: tuple[int, ...]) -> str | None:
    """"in_out" (w = [in..., out...]) or "out_in" (w = [out..., in...], the tied embedding)
    when this product runs on the AMX kernel, else None (XLA's dot)."""
    if x.dtype != jnp.bfloat16 or math.prod(x.shape[:x.ndim - len(w_axes)]) < _AMX_MIN_ROWS:
        return None
    if not _native_matmul_enabled():
        return None
    if w_axes == tuple(range(len(w_axes))):
        return "in_out"
    if w_axes == tuple(range(w.ndim - len(w_axes), w.ndim)):
        return "out_in"
    return None


def _amx_operands(x, w, w_axes, layout):
    """x as [rows, in], w (compute dtype) as [in, out] or [out, in], and the out shape."""
    n = len(w_axes)
    in_shape = x.shape[x.ndim - n:]
    out_shape = w.shape[n:] if layout == "in_out" else w.shape[:w.ndim - n]
    k = math.prod(in_shape)
    w2 = w.astype(x.dtype).reshape((k, -1) if layout == "in_out" else (-1, k))
    return x.reshape(-1, k), w2, out_shape


def _mm(x: jax.Array, w: jax.Array | tuple[jax.Array, ...], w_axes: tuple[int, ...],
        out_dtype=jnp.float32) -> jax.Array:
    """Contracts x's trailing len(w_axes) dims with w's `w_axes`; the float32 sum, rounded
    once to out_dtype. A tuple w stands for its kernels side by side along their last axis
    (the MLP's gate and up); its gradient is the tuple of their gradients.

    w (the parameter, in its own dtype) is cast to x's compute dtype inside, so that its
    gradient leaves the float32 accumulator in the parameter's dtype, with no bf16 rounding
    and no convert pair in between. Whether the AMX kernel runs is decided here, when the
    forward is traced, and the backward follows that decision (it may be traced later,
    outside a `native_matmul` block).
    """
    w0 = w[0] if isinstance(w, tuple) else w
    return _mm_vjp(x, w, w_axes, out_dtype, _amx_layout(x, w0, w_axes))


def _compute_weight(w, dtype) -> jax.Array:
    """w cast to the compute dtype; a tuple's kernels are each cast, then concatenated in
    the compute dtype (in bf16 that copies half the bytes of a float32 concatenation followed
    by a cast, which is what casting the concatenated kernels made XLA do every step)."""
    if isinstance(w, tuple):
        if dtype == jnp.bfloat16:
            # As 16-bit integers: XLA:CPU would do a bf16 concatenation in float32 (a
            # round trip through float32 for each kernel, then a float32 copy and a cast).
            bits = [lax.bitcast_convert_type(p.astype(dtype), jnp.uint16) for p in w]
            return lax.bitcast_convert_type(jnp.concatenate(bits, axis=-1), dtype)
        return jnp.concatenate([p.astype(dtype) for p in w], axis=-1)
    return w.astype(dtype)


def _weight_cotangent(dw: jax.Array, w):
    """dw (float32, the compute weight's shape) as w's cotangent: split back for a tuple."""
    if isinstance(w, tuple):
        cuts = np.cumsum([p.shape[-1] for p in w])[:-1].tolist()
        return tuple(d.astype(p.dtype) for d, p in zip(jnp.split(dw, cuts, axis=-1), w))
    return dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mm_vjp(x, w, w_axes, out_dtype, layout):
    n = len(w_axes)
    w_c = _compute_weight(w, x.dtype)
    if layout is not None:
        x2, w2, out_shape = _amx_operands(x, w_c, w_axes, layout)
        y2 = native_kernels.matmul_amx(x2, w2, transpose_b=layout == "out_in",
                                       out_dtype=out_dtype)
        return y2.reshape(*x.shape[:x.ndim - n], *out_shape)
    dims = ((tuple(range(x.ndim - n, x.ndim)), w_axes), ((), ()))
    y = lax.dot_general(x, w_c, dims, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def _mm_fwd(x, w, w_axes, out_dtype, layout):
    return _mm_vjp(x, w, w_axes, out_dtype, layout), (x, w)


def _rowmajor_transpose(a_NK: jax.Array) -> jax.Array:
    """a.T [K, N] as a fresh row-major array that XLA cannot fold back into its consumer.

    XLA:CPU runs a bf16 x bf16 -> f32 dot on its fast library (YNNPACK) path only when the
    left operand contracts its minor dimension. A weight gradient x^T g contracts the token
    dimension, the major one of both operands; written plainly, XLA upcasts that dot to
    float32 and runs it 3-5x slower. The product with an opaque scalar one takes the scalar's
    row-major layout (a bare transpose keeps a column-major one), and the barrier keeps the
    algebraic simplifier from folding the transpose into the dot again.
    """
    one = lax.optimization_barrier(jnp.ones((), a_NK.dtype))
    return lax.optimization_barrier(one * a_NK.T)


def _weight_grad(x, g, w_axes, w_ndim):
    """dL/dw of x . w (contracting x's trailing dims with w's `w_axes`), float32."""
    n_free = x.ndim - len(w_axes)
    lead = tuple(range(n_free))
    w_free = tuple(a for a in range(w_ndim) if a not in w_axes)
    in_shape, out_shape = x.shape[n_free:], g.shape[n_free:]
    if jax.default_backend() == "cpu" and x.dtype == jnp.bfloat16:
        n = math.prod(x.shape[:n_free])
        x_NI = x.reshape(n, -1)
        g_NO = g.reshape(n, -1)
        if w_axes == tuple(range(len(w_axes))):  # w = [in..., out...]
            dw = jnp.dot(_rowmajor_transpose(x_NI), g_NO, preferred_element_type=jnp.float32)
            return dw.reshape(*in_shape, *out_shape)
        if w_free + w_axes == tuple(range(w_ndim)):  # w = [out..., in...] (tied embedding)
            # Transposing the small x and then the [in, out] result is several times faster
            # than transposing g (the [tokens, vocab] logits gradient) on XLA:CPU.
            dw_IO = jnp.dot(_rowmajor_transpose(x_NI), g_NO, preferred_element_type=jnp.float32)
            return lax.optimization_barrier(dw_IO).T.reshape(*out_shape, *in_shape)
    if w_free + w_axes == tuple(range(w_ndim)):
        # w = [out, in]: produce that order directly; the transposed form hits XLA CPU's
        # generic DotThunk, which rejects bf16 x bf16 -> f32
        return lax.dot_general(g, x, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
    dw = lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
    return jnp.transpose(dw, np.argsort(w_axes + w_free))


def _mm_bwd(w_axes, out_dtype, layout, res, g):
    x, w = res
    g = g.astype(x.dtype)  # bf16 cotangent: the backward dots stay bf16 x bf16 -> f32
    w_c = _compute_weight(w, x.dtype)
    if layout is not None:
        x2, w2, _ = _amx_operands(x, w_c, w_axes, layout)
        g2 = g.reshape(x2.shape[0], -1)
        if layout == "in_out":  # dx = g w^T, dw = x^T g
            dx2 = native_kernels.matmul_amx(g2, w2, transpose_b=True, out_dtype=x.dtype)
            dw2 = native_kernels.matmul_amx(x2, g2, transpose_a=True)
        else:  # w = [out, in]: dx = g w, dw = g^T x
            dx2 = native_kernels.matmul_amx(g2, w2, out_dtype=x.dtype)
            dw2 = native_kernels.matmul_amx(g2, x2, transpose_a=True)
        return dx2.reshape(x.shape), _weight_cotangent(dw2.reshape(w_c.shape), w)
    n_free = x.ndim - len(w_axes)
    w_free = tuple(a for a in range(w_c.ndim) if a not in w_axes)
    g_wdims = tuple(range(n_free, g.ndim))
    dx = lax.dot_general(g, w_c, ((g_wdims, w_free), ((), ())), preferred_element_type=jnp.float32)
    dw = _weight_grad(x, g, w_axes, w_c.ndim)
    return dx.astype(x.dtype), _weight_cotangent(dw, w)


_mm_vjp.defvjp(_mm_fwd, _mm_bwd)


class Linear(nnx.Module):
    """x[..., *in_shape] -> y[..., *out_shape]; kernel [*in_shape, *out_shape]."""

    def __init__(self, in_shape, out_shape, *, use_bias, rngs, dtype, param_dtype):
        init = nnx.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (*in_shape, *out_shape), param_dtype))
        self.bias = nnx.Param(jnp.zeros(out_shape, param_dtype)) if use_bias else None
        self.n_in = len(in_shape)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        axes = tuple(range(self.n_in))
        out_dtype = self.dtype if self.bias is None else jnp.float32
        out_shape = self.kernel[...].shape[self.n_in:]
        y = _packed_mm(self, x, self.n_in, out_shape, out_dtype)
        if y is None:
            y = _mm(x.astype(self.dtype), self.kernel[...], axes, out_dtype)
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
        scale32 = self.scale[...].astype(jnp.float32)
        if x.dtype == self.dtype and _use_native_elementwise(x.dtype):
            return fused.rms_norm(x, scale32, self.eps)
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Scaled in float32, rounded once: the scale's gradient is then a float32 sum over
        # tokens (a bf16 one becomes a slow reduce-window on XLA:CPU).
        return (x32 * scale32).astype(self.dtype)


def _rope(x_BTNH: jax.Array, sin_BTH: jax.Array, cos_BTH: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout: the two halves of the head dim form the pairs)."""
    x32_BTNH = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(x32_BTNH, 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    out = x32_BTNH * cos_BTH[:, :, None, :] + rot * sin_BTH[:, :, None, :]
    return out.astype(x_BTNH.dtype)


def _rope_tables(positions_BT: jax.Array, head_dim: int, theta: float):
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angle = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    angle = jnp.concatenate([angle, angle], axis=-1)
    return jnp.sin(angle), jnp.cos(angle)


def _cache_write(buf: jax.Array, new: jax.Array, index, axis: int) -> jax.Array:
    """Writes `new` at slot `index` of `axis` in place (when the caller donates the cache)."""
    start = tuple(index if a == axis else 0 for a in range(buf.ndim))
    if buf.dtype != jnp.bfloat16:
        return lax.dynamic_update_slice(buf, new.astype(buf.dtype), start)
    # XLA CPU runs a bf16 dynamic_update_slice as convert -> f32 update -> convert, rewriting
    # the whole cache every step; on the uint16 bit pattern it is a cheaper slot write.
    bits = lax.bitcast_convert_type(buf, jnp.uint16)
    new = lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
    return lax.bitcast_convert_type(lax.dynamic_update_slice(bits, new, start), jnp.bfloat16)


def _attend(q_BKGTH, k_BKxx, v_BKSH, mask_BTS, k_spec):
    """softmax(q k^T / sqrt(H)) v over the unmasked slots -> (o_BKGTH, p_BKGTS float32,
    o_BKGTH float32).

    Scores, softmax and p are float32; the two dots take the compute dtype with float32
    accumulation, and o is returned in the compute dtype (and as the float32 sum).
    """
    dtype, H = q_BKGTH.dtype, q_BKGTH.shape[-1]
    s_BKGTS = jnp.einsum(k_spec, q_BKGTH, k_BKxx,
                         preferred_element_type=jnp.float32) * (H ** -0.5)
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, _MASKED)
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
    o_BKGTH = jnp.einsum("BKGTS,BKSH->BKGTH", p_BKGTS.astype(dtype), v_BKSH,
                         preferred_element_type=jnp.float32)
    return o_BKGTH.astype(dtype), p_BKGTS, o_BKGTH


@jax.custom_vjp
def _self_attention(q_BKGTH, k_BKSH, v_BKSH, mask_BTS):
    """`_attend` over keys [B, K, S, H], with a backward whose dots stay in the compute dtype.

    Plain autodiff runs the four backward dots on float32 cotangents (in bfloat16, float32
    dots at a fraction of the bf16 x bf16 -> f32 speed); here each takes bf16 operands with
    float32 accumulation, as the forward does, and the softmax gradient is float32.
    """
    return _attend(q_BKGTH, k_BKSH, v_BKSH, mask_BTS, "BKGTH,BKSH->BKGTS")[0]


def _self_attention_fwd(q_BKGTH, k_BKSH, v_BKSH, mask_BTS):
    o_BKGTH, p_BKGTS, o32_BKGTH = _attend(q_BKGTH, k_BKSH, v_BKSH, mask_BTS,
                                          "BKGTH,BKSH->BKGTS")
    return o_BKGTH, (q_BKGTH, k_BKSH, v_BKSH, mask_BTS, p_BKGTS, o32_BKGTH)


def _self_attention_bwd(res, do_BKGTH):
    q_BKGTH, k_BKSH, v_BKSH, mask_BTS, p_BKGTS, o32_BKGTH = res
    dtype, H = q_BKGTH.dtype, q_BKGTH.shape[-1]
    f32 = dict(preferred_element_type=jnp.float32)
    do_BKGTH = do_BKGTH.astype(dtype)
    dv_BKSH = jnp.einsum("BKGTS,BKGTH->BKSH", p_BKGTS.astype(dtype), do_BKGTH, **f32)
    dp_BKGTS = jnp.einsum("BKGTH,BKSH->BKGTS", do_BKGTH, v_BKSH, **f32)
    # sum_s p_s dp_s = do . sum_s p_s v_s = do . o: a reduction over H, not over the slots
    # (FlashAttention's rowsum(dO * O); exact up to rounding, any p)
    D_BKGT1 = jnp.sum(do_BKGTH.astype(jnp.float32) * o32_BKGTH, axis=-1, keepdims=True)
    ds_BKGTS = p_BKGTS * (dp_BKGTS - D_BKGT1)
    # masked scores get no gradient (a fully masked row's uniform p would otherwise pass one)
    ds_BKGTS = jnp.where(mask_BTS[:, None, None], ds_BKGTS * (H ** -0.5), 0.0).astype(dtype)
    dq_BKGTH = jnp.einsum("BKGTS,BKSH->BKGTH", ds_BKGTS, k_BKSH, **f32)
    dk_BKSH = jnp.einsum("BKGTS,BKGTH->BKSH", ds_BKGTS, q_BKGTH, **f32)
    mask_zero = np.zeros(mask_BTS.shape, jax.dtypes.float0)  # boolean input: no cotangent
    return (dq_BKGTH.astype(dtype), dk_BKSH.astype(k_BKSH.dtype),
            dv_BKSH.astype(v_BKSH.dtype), mask_zero)


_self_attention.defvjp(_self_attention_fwd, _self_attention_bwd)


@jax.custom_vjp
def _native_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH):
    """RoPE on q and k, then `_self_attention`, on the native CPU kernel (`native.attention`)
    in the projections' layouts (no [B, K, G, T, H] transposes, no per-head sin/cos, no
    [T, S] array in memory); same numerics."""
    return _native_attention_fwd(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH)[0]


def _native_attention_fwd(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH):
    o32_BTNH = native_kernels.attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH)
    res = (q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH, o32_BTNH)
    return o32_BTNH.astype(q_BTNH.dtype), res


def _native_attention_bwd(res, do_BTNH):
    q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH, cos_BTH, o32_BTNH = res
    dq, dk, dv = native_kernels.attention_grad(q_BTNH, k_BTKH, v_BTKH, mask_BTS, sin_BTH,
                                               cos_BTH, o32_BTNH, do_BTNH)
    mask_zero = np.zeros(mask_BTS.shape, jax.dtypes.float0)
    # the tables are functions of the positions: their gradient is never used
    return (dq.astype(q_BTNH.dtype), dk.astype(k_BTKH.dtype), dv.astype(v_BTKH.dtype),
            mask_zero, jnp.zeros_like(sin_BTH), jnp.zeros_like(cos_BTH))


_native_attention.defvjp(_native_attention_fwd, _native_attention_bwd)


def _use_native_attention(dtype) -> bool:
    """The training forward's attention on the CPU kernel: float32 or bfloat16, the kernel
    built with AVX-512, and native kernels enabled (`native_matmul`: by default only when
    JAX sees one device, since XLA does not partition a custom call)."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        return False
    return _native_enabled() and native_kernels.attention_available()


def _use_native_elementwise(dtype) -> bool:
    """The fused elementwise kernels (`native.swiglu`, `native.rms_norm`): under the
    conditions of `_use_native_attention` (same library, built with AVX-512)."""
    return _use_native_attention(dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention; query head n uses kv head n // (N // K) as in HF."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Linear((D,), (N, H), use_bias=cfg.use_qkv_bias, **kw)
        self.k_proj = Linear((D,), (K, H), use_bias=cfg.use_qkv_bias, **kw)
        self.v_proj = Linear((D,), (K, H), use_bias=cfg.use_qkv_bias, **kw)
        self.o_proj = Linear((N, H), (D,), use_bias=cfg.use_o_bias, **kw)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None
        self.num_kv_heads = K
        self.dtype = dtype

    def __call__(self, x_BTD, sin_BTH, cos_BTH, mask_BTS, kv=None, cache_index=None,
                 native=None):
        """`native` = (slots_BS, prompt or None): one cached token through the CPU kernel."""
        B, T, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD)
        k_BTKH = self.k_proj(x_BTD)
        v_BTKH = self.v_proj(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        if kv is None and native is None and _use_native_attention(self.dtype):
            o_BTNH = _native_attention(q_BTNH, k_BTKH, v_BTKH.astype(self.dtype), mask_BTS,
                                       sin_BTH, cos_BTH)
            return self.o_proj(o_BTNH), kv
        q_BTNH = _rope(q_BTNH, sin_BTH, cos_BTH)
        if native is not None:  # one cached token through the CPU kernel
            slots_BS, prompt = native
            o_BNH, k_BKHS, v_BKSH = native_kernels.decode_attention(
                q_BTNH[:, 0], _rope(k_BTKH, sin_BTH, cos_BTH)[:, 0], v_BTKH[:, 0], kv[0], kv[1],
                slots_BS, cache_index, prompt)
            return self.o_proj(o_BNH[:, None].astype(self.dtype)), (k_BKHS, v_BKSH)
        k_BKTH = _rope(k_BTKH, sin_BTH, cos_BTH).transpose(0, 2, 1, 3)
        v_BKTH = v_BTKH.transpose(0, 2, 1, 3)
        if kv is None:
            k_BKxx, v_BKSH, spec = k_BKTH, v_BKTH, "BKGTH,BKSH->BKGTS"
        else:
            k_BKxx = _cache_write(kv[0], k_BKTH.transpose(0, 1, 3, 2), cache_index, axis=3)
            v_BKSH = _cache_write(kv[1], v_BKTH, cache_index, axis=2)
            kv, spec = (k_BKxx, v_BKSH), "BKGTH,BKHS->BKGTS"
        K, H = self.num_kv_heads, q_BTNH.shape[-1]
        q_BKGTH = q_BTNH.reshape(B, T, K, -1, H).transpose(0, 2, 3, 1, 4)
        k_BKxx, v_BKSH = k_BKxx.astype(self.dtype), v_BKSH.astype(self.dtype)
        if kv is None:
            o_BKGTH = _self_attention(q_BKGTH, k_BKxx, v_BKSH, mask_BTS)
        else:
            o_BKGTH = _attend(q_BKGTH, k_BKxx, v_BKSH, mask_BTS, spec)[0]
        o_BTNH = o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, -1, H)
        return self.o_proj(o_BTNH), kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        D, F = cfg.hidden_size, cfg.intermediate_size
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear((D,), (F,), **kw)
        self.up_proj = Linear((D,), (F,), **kw)
        self.down_proj = Linear((F,), (D,), **kw)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self.down_proj(fused.swiglu(self.gate_up(x_BTD),
                                           _use_native_elementwise(self.gate_proj.dtype)))

    def gate_up_kernels(self) -> tuple[jax.Array, jax.Array]:
        """The gate and up kernels [D, F], in their parameter dtype: what `_mm` and the
        packed products put side by side ([D, 2F])."""
        return self.gate_proj.kernel[...], self.up_proj.kernel[...]

    def gate_up(self, x_BTD: jax.Array) -> jax.Array:
        """[gate(x), up(x)] [B, T, 2F] in the compute dtype, as one product by the
        concatenated kernels: one pass over x forward, one input gradient (no sum of two) and
        one weight-gradient product backward, instead of two of each."""
        dtype = self.gate_proj.dtype
        out_shape = (2 * self.gate_proj.kernel[...].shape[-1],)
        y = _packed_mm(self, x_BTD, 1, out_shape, dtype)
        if y is None:
            y = _mm(x_BTD.astype(dtype), self.gate_up_kernels(), (0,), dtype)
        return y


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.mlp = MLP(cfg, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **nkw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **nkw)

    def __call__(self, x_BTD, sin_BTH, cos_BTH, mask_BTS, kv=None, cache_index=None,
                 native=None):
        h_BTD, kv = self.self_attn(self.input_layernorm(x_BTD), sin_BTH, cos_BTH, mask_BTS,
                                   kv, cache_index, native)
        x_BTD = x_BTD + h_BTD
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD)), kv


def _run_layer(layer: DecoderLayer, x_BTD, sin_BTH, cos_BTH, mask_BTS):
    return layer(x_BTD, sin_BTH, cos_BTH, mask_BTS)[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value buffers for cached decoding."""

    k_BKHS: list[jax.Array]  # one [B, K, H, S] buffer per layer, keys after RoPE
    v_BKSH: list[jax.Array]  # one [B, K, S, H] buffer per layer


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Zeroed KV cache with `max_len` slots per row."""
    K, H, L = config.num_kv_heads, config.head_dim, config.num_layers
    return KVCache(k_BKHS=[jnp.zeros((batch, K, H, max_len), dtype) for _ in range(L)],
                   v_BKSH=[jnp.zeros((batch, K, max_len, H), dtype) for _ in range(L)])


class Qwen(nnx.Module):
    """Qwen2/2.5/3 causal LM; parameter paths mirror Hugging Face (without `model.`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        cfg = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs,
                                  param_dtype=param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, **kw) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)
        self.lm_head = (None if cfg.use_tied_embeddings else
                        Linear((cfg.hidden_size,), (cfg.vocab_size,), use_bias=False, **kw))
        self.dtype = dtype

    def _embed(self, tokens_BT):
        return jnp.take(self.embed_tokens.embedding[...], tokens_BT, axis=0).astype(self.dtype)

    def _logits(self, x_BTD):
        x_BTD = self.norm(x_BTD)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        y = _packed_mm(head, x_BTD, 1, (self.config.vocab_size,), jnp.float32)
        if y is not None:
            return y
        if self.lm_head is None:
            return _mm(x_BTD, self.embed_tokens.embedding[...], (1,))
        return _mm(x_BTD, self.lm_head.kernel[...], (0,))

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 attn_mask_BT: jax.Array | None = None, *,
                 logits_slice: slice | None = None) -> jax.Array:
        """Full causal forward -> float32 logits [B, T, V].

        `logits_slice` (a static slice of the T positions) returns only those positions'
        logits, [B, len(range(T)[logits_slice]), V]: the final norm and the output projection
        then run on those hidden states only, not on all T and sliced after (a trainer scoring
        responses skips the prompt positions, and a next-token loss the last one).
        """
        B, T = tokens_BT.shape
        valid_BT = jnp.ones((B, T), bool) if attn_mask_BT is None else attn_mask_BT.astype(bool)
        if positions_BT is None:
            positions_BT = jnp.maximum(jnp.cumsum(valid_BT, axis=1) - 1, 0)
        sin_BTH, cos_BTH = _rope_tables(positions_BT, self.config.head_dim,
                                        self.config.rope_theta)
        causal_TS = jnp.tril(jnp.ones((T, T), bool))
        mask_BTS = causal_TS[None] & valid_BT[:, None, :]
        run = nnx.remat(_run_layer) if self.config.use_remat else _run_layer
        x_BTD = self._embed(tokens_BT)
        for layer in self.layers:
            x_BTD = run(layer, x_BTD, sin_BTH, cos_BTH, mask_BTS)
        if logits_slice is not None:
            x_BTD = x_BTD[:, logits_slice]
        return self._logits(x_BTD)

    def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache: KVCache,
               cache_index: jax.Array | int, attn_mask_BS: jax.Array, *,
               use_native: bool = False,
               prompt: tuple[KVCache, jax.Array] | None = None) -> tuple[jax.Array, KVCache]:
        """Writes T tokens at `cache_index` and attends over the cache -> (logits_BTV, cache).

        `use_native` (T == 1 only; the caller checks `native.decode_attention_available()`
        and that the arrays are not sharded) runs each layer's attention and cache write
        through the CPU kernel of `ba_jax.native` instead of XLA; same results.
        `prompt` = (prompt_cache, mask_PT) (with `use_native` only): a cache of P prompts
        shared by the B // P contiguous rows of each, attended before `cache`'s own slots,
        as if every row held a copy of its prompt in front of them.
        """
        T = tokens_BT.shape[1]
        if use_native and T != 1:
            raise ValueError(f"use_native decodes one token at a time, got T={T}")
        if prompt is not None and not use_native:
            raise ValueError("a shared prompt cache needs use_native=True")
        pcache, pmask_PT = prompt if prompt is not None else (None, None)
        S = cache.v_BKSH[0].shape[2]
        sin_BTH, cos_BTH = _rope_tables(positions_BT, self.config.head_dim,
                                        self.config.rope_theta)
        query_slot_T = cache_index + jnp.arange(T)
        causal_TS = jnp.arange(S)[None, :] <= query_slot_T[:, None]
        mask_BTS = causal_TS[None] & attn_mask_BS.astype(bool)[:, None, :]
        x_BTD = self._embed(tokens_BT)
        ks, vs = [], []
        for i, (layer, k, v) in enumerate(zip(self.layers, cache.k_BKHS, cache.v_BKSH)):
            shared = (pcache.k_BKHS[i], pcache.v_BKSH[i], pmask_PT) if pcache else None
            native = (attn_mask_BS, shared) if use_native else None
            x_BTD, (k, v) = layer(x_BTD, sin_BTH, cos_BTH, mask_BTS, (k, v), cache_index,
                                  native)
            ks.append(k)
            vs.append(v)
        return self._logits(x_BTD), KVCache(k_BKHS=ks, v_BKSH=vs)
