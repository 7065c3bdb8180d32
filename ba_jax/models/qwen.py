"""Dense Qwen2/2.5 and Qwen3 decoders in flax.nnx, their published configs, and the KV cache.

Lives here: `ModelConfig` (+ `PRESETS`, `ModelConfig.from_hf_config`), the `Qwen` module (full
forward, prefill and one-token cached decode), `KVCache` and `init_cache`. Not here: the
attention kernels (`attention.py`, the one seam that knows which kernel runs), the Hugging Face
key table (`hf_table.py`) and file IO (`convert_hf.py`), parameter shardings (`sharding.py`),
sampling loops (`sampler.py`).

Call interface:

    model = Qwen(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    logits_BTV = model(tokens_BT, positions_BT=None, attn_mask_BT=None)    # float32 logits

`attn_mask_BT` is 1 for real tokens and 0 for padding; a token attends causally to the real
tokens at or before it, and a padding token's attention output is 0. `positions_BT` defaults to
`arange(T)` without a mask and to the number of real tokens before each token with one (the
same thing for unpadded or right-padded rows, the right thing for left-padded ones).
`model(tokens_BT)` is the Hugging Face call.

Layers: the decoder layers are ONE `DecoderLayer` whose parameters carry a leading `layers`
axis (L), run by `lax.scan` with the remat policy of `config.remat` inside the scanned body, so
a compiled program holds one layer, not L (parameter paths: `layers.self_attn.q_proj.kernel`
of shape [L, D, N, H]).

KV cache (for a sampler): `KVCache(k_LBSKH, v_LBSKH)`, keys after RoPE, in the compute dtype.
`model(..., return_kv=True)` also returns the prompt's cache (prefill); `model.decode_step`
runs one new token per row against the rows' own slots plus, optionally, a prefix cache of P
prompts shared by the B // P contiguous rows of each (the prompt is encoded once per group) and
returns the new token's keys/values, which the caller writes with `KVCache.write`: the cache is
read-only inside the layer scan, and the one write per step is an in-place update of the
loop-carried buffer.

Numerics: parameters are stored in `param_dtype` and cast to `dtype` for compute; all matmuls
accumulate in float32 (`preferred_element_type`), and norm statistics, RoPE angles and the
softmax are float32. `_mm` carries a hand-written backward: plain autodiff of a bf16 x bf16 ->
f32 product differentiates into f32 x bf16 products (upcast, at a fraction of the bf16 rate on
an MXU / tensor core) and rounds the weight gradient to bf16; here the backward products take
bf16 operands with float32 accumulation and the weight gradient stays float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from ba_jax import sharding
from ba_jax.models import attention as attention_lib

# config.remat -> the policy of `jax.checkpoint` around one scanned layer (None: no remat).
# `full` keeps only each layer's input (the paper configs); `dots_with_no_batch_dims_saveable`
# keeps the projections' outputs and recomputes attention and the elementwise work.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


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
    # Run-time choices, not architecture (a checkpoint does not fix them):
    attention: str = "auto"  # kernel seam implementation, see ba_jax.models.attention.IMPLS
    remat: str = "none"  # what the backward recomputes per layer: a name in REMAT_POLICIES
    # Layers per iteration of the layer scan (lax.scan's `unroll`): 1 keeps one layer in the
    # compiled program; >= num_layers unrolls the stack (small models, where an iteration's
    # loop overhead and the fusion it blocks cost as much as a layer's work).
    scan_unroll: int = 1
    # Positions per chunk of the output head when scoring tokens (`Qwen.token_logprobs`):
    # the final norm, projection and log-softmax run chunk by chunk, so at most
    # [rows, logits_chunk, V] logits exist at once; 0: all positions in one piece.
    logits_chunk: int = 1024
    bos_token_id: int | None = None  # kept for export only
    eos_token_id: int | tuple[int, ...] | None = None  # kept for export only

    def __post_init__(self):
        if self.arch not in ("qwen2", "qwen3"):
            raise ValueError(f"arch must be 'qwen2' or 'qwen3', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of {self.num_kv_heads=}")
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(f"model.attention={self.attention!r}; valid: "
                             f"{', '.join(attention_lib.IMPLS)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; valid: {', '.join(REMAT_POLICIES)}")
        if not (isinstance(self.scan_unroll, int) and self.scan_unroll >= 1):
            raise ValueError(f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 1")
        if not (isinstance(self.logits_chunk, int) and self.logits_chunk >= 0):
            raise ValueError(f"model.logits_chunk={self.logits_chunk!r} must be an integer >= 0")

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


def _mm(x: jax.Array, w: jax.Array, w_axes: tuple[int, ...], out_dtype=jnp.float32,
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
        y = _mm(x.astype(self.dtype), self.kernel[...], tuple(range(self.n_in)), out_dtype,
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


# Logical axes of the activations (`sharding.DEFAULT_RULES`): rows over the data-parallel
# axes, heads / MLP width / vocabulary over `tensor`, the hidden dimension whole.
_X_AXES = ("act_batch", "act_length", "act_embed")
_Q_AXES = ("act_batch", "act_length", "act_heads", None)
_KV_AXES = ("act_batch", "act_length", "act_kv_heads", None)
_MLP_AXES = ("act_batch", "act_length", "act_mlp")
_LOGITS_AXES = ("act_batch", "act_length", "act_vocab")


class Attention(nnx.Module):
    """Grouped-query self-attention; query head n uses kv head n // (N // K) as in HF."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        qkv = dict(use_bias=cfg.use_qkv_bias, **kw)
        self.q_proj = Linear((D,), (N, H), axes=("embed", "heads", "head_dim"), **qkv)
        self.k_proj = Linear((D,), (K, H), axes=("embed", "kv_heads", "head_dim"), **qkv)
        self.v_proj = Linear((D,), (K, H), axes=("embed", "kv_heads", "head_dim"), **qkv)
        self.o_proj = Linear((N, H), (D,), axes=("heads", "head_dim", "embed"),
                             use_bias=cfg.use_o_bias, **kw)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None

    def _qkv(self, x_BTD, sin_BTH, cos_BTH):
        """Queries and keys after q/k norm and RoPE, values; all in the compute dtype."""
        q_BTNH, k_BTKH, v_BTKH = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = sharding.constrain(_rope(q_BTNH, sin_BTH, cos_BTH), _Q_AXES)
        k_BTKH = sharding.constrain(_rope(k_BTKH, sin_BTH, cos_BTH), _KV_AXES)
        return q_BTNH, k_BTKH, sharding.constrain(v_BTKH, _KV_AXES)

    def __call__(self, x_BTD, sin_BTH, cos_BTH, valid_BT, impl: str):
        """Full causal self-attention -> (output, (k_BTKH, v_BTKH)) (the keys for a cache)."""
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, sin_BTH, cos_BTH)
        o_BTNH = attention_lib.attention(q_BTNH, k_BTKH, v_BTKH, valid_BT, impl=impl)
        return self.o_proj(sharding.constrain(o_BTNH, _Q_AXES)), (k_BTKH, v_BTKH)

    def decode(self, x_B1D, sin_B1H, cos_B1H, k_BSKH, v_BSKH, valid_BS, prefix):
        """One new token per row over its cache (and a shared prefix) -> (out, (k_BKH, v_BKH))."""
        q_B1NH, k_B1KH, v_B1KH = self._qkv(x_B1D, sin_B1H, cos_B1H)
        o_BNH = attention_lib.decode_attention(q_B1NH[:, 0], k_B1KH[:, 0], v_B1KH[:, 0],
                                               k_BSKH, v_BSKH, valid_BS, prefix=prefix)
        return self.o_proj(o_BNH[:, None]), (k_B1KH[:, 0], v_B1KH[:, 0])


    def decode_paged(self, x_B1D, sin_B1H, cos_B1H, pool, write, table_BX, lengths_B, impl):
        """One new token per row over a paged cache (`PagePool`) -> (out, pool, (k_BKH,
        v_BKH)). With `write` = (page_B, offset_B), its key/value are written there first
        (ids out of range: not written) and attended from the pool; with write None, the
        pool is only read and they are attended as `new_kv`, for the caller to write."""
        q_B1NH, k_B1KH, v_B1KH = self._qkv(x_B1D, sin_B1H, cos_B1H)
        kv = (k_B1KH[:, 0], v_B1KH[:, 0])
        if write is not None:
            pool = pool.write(*write, *kv)
        o_BNH = attention_lib.paged_decode_attention(
            q_B1NH[:, 0], pool.k, pool.v, table_BX, lengths_B, impl=impl,
            new_kv=None if write is not None else kv)
        return self.o_proj(o_BNH[:, None]), pool, kv


    def chunk_paged(self, x_BCD, sin_BCH, cos_BCH, pool, table_BQ, start_B, valid_BC):
        """A chunk of tokens per row after its paged prefix (`attention.paged_chunk_attention`;
        the pool only read) -> (out, (k_BCKH, v_BCKH)), the chunk's keys for the caller to
        write."""
        q_BCNH, k_BCKH, v_BCKH = self._qkv(x_BCD, sin_BCH, cos_BCH)
        o_BCNH = attention_lib.paged_chunk_attention(q_BCNH, k_BCKH, v_BCKH, pool.k, pool.v,
                                                     table_BQ, start_B, valid_BC)
        return self.o_proj(sharding.constrain(o_BCNH, _Q_AXES)), (k_BCKH, v_BCKH)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), the product in float32, rounded once."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        D, F = cfg.hidden_size, cfg.intermediate_size
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear((D,), (F,), axes=("embed", "mlp"), **kw)
        self.up_proj = Linear((D,), (F,), axes=("embed", "mlp"), **kw)
        self.down_proj = Linear((F,), (D,), axes=("mlp", "embed"), **kw)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        g_BTF = self.gate_proj(x_BTD).astype(jnp.float32)
        h_BTF = jax.nn.silu(g_BTF) * self.up_proj(x_BTD).astype(jnp.float32)
        return self.down_proj(sharding.constrain(h_BTF.astype(x_BTD.dtype), _MLP_AXES))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.mlp = MLP(cfg, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **nkw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **nkw)

    def __call__(self, x_BTD, sin_BTH, cos_BTH, valid_BT, impl: str):
        h_BTD, kv = self.self_attn(self.input_layernorm(x_BTD), sin_BTH, cos_BTH, valid_BT, impl)
        x_BTD = sharding.constrain(x_BTD + h_BTD, _X_AXES)
        return sharding.constrain(x_BTD + self.mlp(self.post_attention_layernorm(x_BTD)),
                                  _X_AXES), kv

    def decode_paged(self, x_B1D, sin_B1H, cos_B1H, pool, write, table_BX, lengths_B, impl):
        h_B1D, pool, kv = self.self_attn.decode_paged(self.input_layernorm(x_B1D), sin_B1H,
                                                      cos_B1H, pool, write, table_BX,
                                                      lengths_B, impl)
        x_B1D = x_B1D + h_B1D
        return x_B1D + self.mlp(self.post_attention_layernorm(x_B1D)), pool, kv

    def chunk_paged(self, x_BCD, sin_BCH, cos_BCH, pool, table_BQ, start_B, valid_BC):
        h_BCD, kv = self.self_attn.chunk_paged(self.input_layernorm(x_BCD), sin_BCH, cos_BCH,
                                               pool, table_BQ, start_B, valid_BC)
        x_BCD = sharding.constrain(x_BCD + h_BCD, _X_AXES)
        return sharding.constrain(x_BCD + self.mlp(self.post_attention_layernorm(x_BCD)),
                                  _X_AXES), kv

    def decode(self, x_B1D, sin_B1H, cos_B1H, k_BSKH, v_BSKH, valid_BS, prefix):
        h_B1D, kv = self.self_attn.decode(self.input_layernorm(x_B1D), sin_B1H, cos_B1H, k_BSKH,
                                          v_BSKH, valid_BS, prefix)
        x_B1D = x_B1D + h_B1D
        return x_B1D + self.mlp(self.post_attention_layernorm(x_B1D)), kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys (after RoPE) and values of every layer, in the compute dtype."""

    k_LBSKH: jax.Array  # [L, B, S, K, H]
    v_LBSKH: jax.Array  # [L, B, S, K, H]

    def write(self, k_LBKH: jax.Array, v_LBKH: jax.Array, slot) -> KVCache:
        """The cache with one token per row written at `slot` (in place when the buffer is
        loop-carried or donated)."""
        start = (0, 0, slot, 0, 0)
        put = lambda buf, new: lax.dynamic_update_slice(  # noqa: E731
            buf, new[:, :, None].astype(buf.dtype), start)
        return KVCache(put(self.k_LBSKH, k_LBKH), put(self.v_LBSKH, v_LBKH))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagePool:
    """The rollout engine's pages of keys (after RoPE) and values, every layer in one array
    per side: layer l's page p is page l * NP + p, so a layer's decode hands the whole pool
    to the paged-attention kernel (no per-layer slice copied out) with its table offset by
    l * NP. [K, L * NP, page, H] is the layout of jax's TPU paged-attention kernel."""

    k: jax.Array  # [K, L * NP, page, H]
    v: jax.Array

    @staticmethod
    def zeros(config: ModelConfig, num_pages: int, page_size: int, dtype) -> PagePool:
        shape = (config.num_kv_heads, config.num_layers * num_pages, page_size, config.head_dim)
        return PagePool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, page_S, offset_S, k_SKH, v_SKH) -> PagePool:
        """Keys/values of any batch shape S written at pool page `page_S` (ids out of range
        are dropped: not written), slot `offset_S`, in one scatter per side."""
        def put(buf, new_SKH):
            new_KSH = jnp.moveaxis(new_SKH, -2, 0).astype(buf.dtype)
            return buf.at[:, page_S, offset_S].set(new_KSH, mode="drop")

        return PagePool(put(self.k, k_SKH), put(self.v, v_SKH))

    def write_tokens(self, table_BQ, pos_BC, valid_BC, k_LBCKH, v_LBCKH) -> PagePool:
        """Every layer's keys/values of the tokens at positions `pos_BC` (those with
        valid_BC) of the runs whose pages are `table_BQ` (ids < NP, the pages per layer),
        written at those positions, in one scatter per side."""
        L, ps = k_LBCKH.shape[0], self.k.shape[2]
        NP = self.k.shape[1] // L
        page_BC = jnp.take_along_axis(table_BQ, pos_BC // ps, axis=1, mode="clip")
        page_LBC = jnp.where(valid_BC, jnp.arange(L)[:, None, None] * NP + page_BC, L * NP)
        return self.write(page_LBC, jnp.broadcast_to(pos_BC % ps, page_LBC.shape), k_LBCKH,
                          v_LBCKH)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Zeroed KV cache with `max_len` slots per row."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, dtype, param_dtype) -> DecoderLayer:
    """One DecoderLayer whose parameters have a leading axis of cfg.num_layers layers, each
    initialised from its own split of `rngs`."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    return make(rngs)


class Qwen(nnx.Module):
    """Qwen2/2.5/3 causal LM; parameter paths mirror Hugging Face (without `model.`), with the
    decoder layers stacked on a leading axis (`layers.mlp.up_proj.kernel` [L, D, F])."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        cfg = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs,
                                  param_dtype=param_dtype)
        self.layers = _stacked_layers(cfg, rngs, dtype, param_dtype)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)
        self.lm_head = (None if cfg.use_tied_embeddings else
                        Linear((cfg.hidden_size,), (cfg.vocab_size,), axes=("embed", "vocab"),
                               use_bias=False, **kw))
        self.dtype = dtype

    def _embed(self, tokens_BT):
        # the table is read in its storage dtype (the gradient's scatter-add stays float32)
        x_BTD = jnp.take(self.embed_tokens.embedding[...], tokens_BT, axis=0).astype(self.dtype)
        return sharding.constrain(x_BTD, _X_AXES)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """The output head on final hidden states: norm, then projection -> float32 logits."""
        x_BTD = self.norm(x_BTD)
        if self.lm_head is None:
            logits_BTV = _mm(x_BTD, self.embed_tokens.embedding[...], (1,),
                             w_logical=("vocab", "embed"))
        else:
            logits_BTV = _mm(x_BTD, self.lm_head.kernel[...], (0,), w_logical=self.lm_head.axes)
        return sharding.constrain(logits_BTV, _LOGITS_AXES)

    def _scan_layers(self, body, x, xs, remat: str = "none"):
        """lax.scan of body(layer, x, xs_l) -> (x, ys_l) over the stacked layers, the remat
        policy applied to one layer (the scanned body), so the program holds one layer
        (`config.scan_unroll` layers per iteration)."""
        graphdef, state = nnx.split(self.layers)

        def step(x, xs_l):
            layer_state, rest = xs_l
            return body(nnx.merge(graphdef, layer_state), x, rest)

        policy = REMAT_POLICIES[remat]
        if policy is not None:
            step = jax.checkpoint(step, policy=policy, prevent_cse=False)
        unroll = min(self.config.scan_unroll, self.config.num_layers)
        return lax.scan(step, x, (state, xs), unroll=unroll)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 attn_mask_BT: jax.Array | None = None, *, logits_slice: slice | None = None,
                 return_kv: bool = False):
        """Full causal forward -> float32 logits [B, T, V] (and the KVCache if `return_kv`).

        `logits_slice` (a static slice of the T positions) returns only those positions'
        logits, [B, len(range(T)[logits_slice]), V]: the final norm and the output projection
        then run on those hidden states only (a trainer scoring responses skips the prompt
        positions, a next-token loss the last one, a prefill all but the last).
        """
        x_BTD, kv = self.hidden_states(tokens_BT, positions_BT, attn_mask_BT, return_kv=True)
        if logits_slice is not None:
            x_BTD = x_BTD[:, logits_slice]
        logits_BTV = self.logits(x_BTD)
        return (logits_BTV, kv) if return_kv else logits_BTV

    def hidden_states(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                      attn_mask_BT: jax.Array | None = None, *, return_kv: bool = False):
        """The decoder stack without the head -> (final hidden states x_BTD, before the final
        norm; the KVCache if `return_kv`, else None). `logits(x_BTD)` finishes the forward;
        a scorer that must not form all logits at once runs it on chunks of positions."""
        B, T = tokens_BT.shape
        valid_BT = jnp.ones((B, T), bool) if attn_mask_BT is None else attn_mask_BT.astype(bool)
        if positions_BT is None:
            positions_BT = jnp.maximum(jnp.cumsum(valid_BT, axis=1) - 1, 0)
        sin_BTH, cos_BTH = _rope_tables(positions_BT, self.config.head_dim,
                                        self.config.rope_theta)
        impl = attention_lib.resolve(self.config.attention, dtype=self.dtype, seq_len=T)

        def body(layer, x_BTD, _):
            x_BTD, kv = layer(x_BTD, sin_BTH, cos_BTH, valid_BT, impl)
            return x_BTD, kv if return_kv else None

        x_BTD, kv = self._scan_layers(body, self._embed(tokens_BT), None, self.config.remat)
        return x_BTD, KVCache(*kv) if return_kv else None

    def decode_step(self, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache,
                    valid_BS: jax.Array, prefix: tuple[KVCache, jax.Array] | None = None):
        """One new token per row -> (logits_BV float32, k_LBKH, v_LBKH).

        The token attends to its row's cache slots where `valid_BS`, to itself, and, with
        `prefix` = (prompt KVCache of P rows, valid_PT), to its prompt's slots, shared by the
        B // P contiguous rows of each prompt. The new keys/values are returned for the caller
        to write (`KVCache.write`); the cache is not changed here.
        """
        pk, pv, pvalid_PT = ((None, None, None) if prefix is None else
                             (prefix[0].k_LBSKH, prefix[0].v_LBSKH, prefix[1].astype(bool)))

        def keys(xs_l):
            k_BSKH, v_BSKH, pk_PTKH, pv_PTKH = xs_l
            pre = None if pk_PTKH is None else (pk_PTKH, pv_PTKH, pvalid_PT)
            return k_BSKH, v_BSKH, valid_BS.astype(bool), pre

        return self._decode_scan(tokens_B, positions_B, keys,
                                 (cache.k_LBSKH, cache.v_LBSKH, pk, pv))

    def _decode_scan(self, tokens_B, positions_B, keys, xs):
        """The layer scan of one decode step: `keys(xs_l)` -> (k_BSKH, v_BSKH, valid_BS,
        prefix) the layer attends to -> (logits_BV float32, k_LBKH, v_LBKH)."""
        sin_B1H, cos_B1H = _rope_tables(positions_B[:, None], self.config.head_dim,
                                        self.config.rope_theta)

        def body(layer, x_B1D, xs_l):
            return layer.decode(x_B1D, sin_B1H, cos_B1H, *keys(xs_l))

        x_B1D, (k_LBKH, v_LBKH) = self._scan_layers(body, self._embed(tokens_B[:, None]), xs)
        return self.logits(x_B1D)[:, 0], k_LBKH, v_LBKH

    def prefill_chunk_paged(self, tokens_BC: jax.Array, valid_BC: jax.Array, pool: PagePool,
                            page_table_BQ: jax.Array, start_B: jax.Array):
        """Chunked prefill over a paged cache: row b's chunk holds its tokens start_B[b],
        start_B[b] + 1, ... (those with valid_BC, a prefix of the chunk), after its first
        start_B[b] tokens cached in its pages `page_table_BQ[b]` (ids < NP, the pages per
        layer) read in order -> (final hidden states x_BCD before the norm, for `logits`;
        the pool with the chunk's keys/values written at their positions in those pages).
        Prefilling a sequence chunk by chunk gives the keys and last logits of one full
        forward (`__call__`). The pool is read in the layer scan and written once after it.
        """
        L = self.config.num_layers
        NP = pool.k.shape[1] // L
        C = tokens_BC.shape[1]
        valid_BC = valid_BC.astype(bool)
        pos_BC = start_B[:, None] + jnp.arange(C)[None]
        sin_BCH, cos_BCH = _rope_tables(pos_BC, self.config.head_dim, self.config.rope_theta)
        page_table_BQ = jnp.where(page_table_BQ < NP, page_table_BQ, 0)

        def body(layer, x_BCD, layer_ix):
            return layer.chunk_paged(x_BCD, sin_BCH, cos_BCH, pool,
                                     page_table_BQ + layer_ix * NP, start_B, valid_BC)

        x_BCD, (k_LBCKH, v_LBCKH) = self._scan_layers(body, self._embed(tokens_BC),
                                                      jnp.arange(L))
        return x_BCD, pool.write_tokens(page_table_BQ, pos_BC, valid_BC, k_LBCKH, v_LBCKH)

    def decode_step_paged(self, tokens_B: jax.Array, positions_B: jax.Array, pool: PagePool,
                          page_table_BX: jax.Array, lengths_B: jax.Array,
                          write_page_B: jax.Array, write_offset_B: jax.Array):
        """One new token per decode slot over a paged cache -> (logits_BV float32, the pool
        with the new keys/values written).

        Row b's key/value of each layer go to its page `write_page_B[b]` (a page id < NP,
        the pages per layer; NP: not written) at `write_offset_B[b]`, and the token attends
        to the first `lengths_B[b]` tokens of its pages `page_table_BX[b]` read in order (its
        prompt's full pages, shared with the prompt's other rows, then its own), itself the
        last. `pool` is a `PagePool`; the kernel is `attention.paged_impl`'s. A kernel that
        reads the new key from the pool (`attention.paged_writes_first`) has each layer
        write before it attends, the pool carried through the layer scan; the gather path
        only reads the pool in the scan and writes every layer's keys in one scatter after
        it (one pool update per step, not one per layer).
        """
        L = self.config.num_layers
        NP = pool.k.shape[1] // L
        impl = attention_lib.paged_impl(self.config.attention, dtype=self.dtype,
                                        head_dim=self.config.head_dim,
                                        page_size=pool.k.shape[2])
        sin_B1H, cos_B1H = _rope_tables(positions_B[:, None], self.config.head_dim,
                                        self.config.rope_theta)
        page_table_BX = jnp.where(page_table_BX < NP, page_table_BX, 0)
        # layer l's pages are l * NP + p; rows that do not write get an id past the pool
        write_page_LB = jnp.where(write_page_B < NP, jnp.arange(L)[:, None] * NP + write_page_B,
                                  L * NP)
        write_offset_LB = jnp.broadcast_to(write_offset_B, write_page_LB.shape)
        x_B1D = self._embed(tokens_B[:, None])

        if attention_lib.paged_writes_first(impl):
            def body(layer, carry, xs_l):
                x_B1D, pool = carry
                layer_ix, write = xs_l
                x_B1D, pool, _ = layer.decode_paged(x_B1D, sin_B1H, cos_B1H, pool, write,
                                                    page_table_BX + layer_ix * NP, lengths_B,
                                                    impl)
                return (x_B1D, pool), None

            xs = (jnp.arange(L), (write_page_LB, write_offset_LB))
            (x_B1D, pool), _ = self._scan_layers(body, (x_B1D, pool), xs)
        else:
            def body(layer, x_B1D, layer_ix):
                x_B1D, _, kv = layer.decode_paged(x_B1D, sin_B1H, cos_B1H, pool, None,
                                                  page_table_BX + layer_ix * NP, lengths_B,
                                                  impl)
                return x_B1D, kv

            x_B1D, (k_LBKH, v_LBKH) = self._scan_layers(body, x_B1D, jnp.arange(L))
            pool = pool.write(write_page_LB, write_offset_LB, k_LBKH, v_LBKH)
        return self.logits(x_B1D)[:, 0], pool
