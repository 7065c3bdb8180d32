"""The one kernel seam for attention: causal self-attention and cached decode attention.

This module is the only place in ba_jax that asks which backend it runs on
(`resolve`); model code names an implementation (config `model.attention`) and calls
`attention` / `decode_attention`. Implementations of `attention`, all with the same
semantics (see `attention`):

  xla      materialises the [B, K, R, T, T] float32 scores; plain autodiff. The truth
           every other implementation is tested against.
  chunked  pure JAX flash attention (online softmax over key blocks, custom VJP that
           recomputes block probabilities from the saved per-row logsumexp). Blocks
           above the causal diagonal are skipped, not masked. Any backend.
  cudnn    jax.nn.dot_product_attention(implementation="cudnn"); bf16/fp16 only.
  splash   Pallas TPU splash attention, under shard_map when a mesh is in context.

Decode over the rollout engine's paged cache (`paged_decode_attention`, implementation from
`paged_impl`): a gather-based pure-JAX one everywhere; on TPU (wherever the prefill runs
splash) jax's Pallas TPU paged-attention kernel, and on a GPU in bf16 (wherever the prefill
runs cuDNN) jax's Pallas GPU (Triton) one: both read only the pages below a row's length.
Chunked prefill over the same pages: `paged_chunk_attention` (gather, any backend).

Not here: RoPE (applied by the caller), the KV cache layout (sampler), projections.
Shape letters as in the README, plus R = query heads per kv head (N = K * R); G is
kept for samples per prompt, as elsewhere.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib
from jax.sharding import PartitionSpec as P

IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")
# 'auto' on CPU: below this length the [T, T] scores are small and xla is the fastest.
CHUNKED_MIN_LEN = 1024
# Finite, so a fully masked row gives exp(0) = 1 instead of NaN; masked probabilities
# are then zeroed explicitly. Same value as splash attention's default.
_MASK = -0.7 * float(np.finfo(np.float32).max)
_F32 = jnp.float32
Array = jax.Array


def resolve(impl: str, *, dtype: jnp.dtype, seq_len: int) -> str:
    """Maps a config value to a concrete implementation name; 'auto' picks per backend."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "tpu":
        return "splash"
    if backend in ("gpu", "cuda"):
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if half else "chunked"
    return "chunked" if seq_len >= CHUNKED_MIN_LEN else "xla"


def attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    valid_BT: jax.Array,
    *,
    impl: str = "xla",
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Causal grouped-query self-attention over one packed sequence per row.

    Query t attends key s iff s <= t and valid_BT[s]; query head n reads kv head
    n // (N // K) (Hugging Face order). Scale 1/sqrt(H); scores and softmax in float32;
    both products in q's dtype with float32 accumulation; output in q's dtype. Queries
    with valid_BT[t] False output exactly 0, with finite gradients, also for fully
    invalid rows. cudnn additionally assumes the valid tokens of each row are one
    contiguous run (left pads, real tokens, optional right pads); xla, chunked and
    splash take any pattern.
    block_q / block_k: tile sizes for chunked (shrunk to T rounded up to 8) and splash
    (multiples of 128 dividing the padded T); ignored by xla and cudnn.
    """
    _, T, N, _ = q_BTNH.shape
    K = k_BTKH.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} must be a multiple of kv heads {K}")
    impl = resolve(impl, dtype=q_BTNH.dtype, seq_len=T)
    k_BTKH = k_BTKH.astype(q_BTNH.dtype)
    v_BTKH = v_BTKH.astype(q_BTNH.dtype)
    valid_BT = valid_BT.astype(bool)
    if impl == "xla":
        return _xla(q_BTNH, k_BTKH, v_BTKH, valid_BT)
    if impl == "chunked":
        return _chunked(q_BTNH, k_BTKH, v_BTKH, valid_BT, block_q, block_k)
    if impl == "cudnn":
        return _cudnn(q_BTNH, k_BTKH, v_BTKH, valid_BT)
    return _splash(q_BTNH, k_BTKH, v_BTKH, valid_BT, block_q, block_k)


def _xla(q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array) -> Array:
    """Reference: full scores, plain autodiff (fine in bf16: every cast is explicit)."""
    T = q_BTNH.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    mask_BTS = causal_TS[None] & valid_BT[:, None, :] & valid_BT[:, :, None]
    return _masked(q_BTNH, k_BTKH, v_BTKH, mask_BTS)


def _masked(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, mask_BTS: Array) -> Array:
    """Query t attends key s where mask_BTS[b, t, s]: full float32 scores and softmax, both
    products in q's dtype with float32 accumulation; a query with no key outputs 0."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    dt = q_BTNH.dtype
    q_BTKRH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKRTS = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=_F32)
    s_BKRTS = s_BKRTS * (1.0 / math.sqrt(H))
    mask_B11TS = mask_BTS[:, None, None]
    s_BKRTS = jnp.where(mask_B11TS, s_BKRTS, _MASK)
    # Rows with no visible key (invalid queries) are uniform over _MASK: zero them.
    p_BKRTS = jnp.where(mask_B11TS, jax.nn.softmax(s_BKRTS, axis=-1), 0.0)
    o_BTKRH = jnp.einsum(
        "bkrts,bskh->btkrh", p_BKRTS.astype(dt), v_BSKH, preferred_element_type=_F32
    )
    return o_BTKRH.reshape(B, T, N, H).astype(dt)


# ---------------------------------------------------------------- chunked (flash)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_time(x: Array, T_new: int, value: bool | float = 0) -> Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, T_new - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _chunked(
    q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array, block_q: int, block_k: int
) -> Array:
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    # Blocks longer than the sequence shrink to it, rounded up to 8 sublanes.
    bq, bk = min(block_q, _round_up(T, 8)), min(block_k, _round_up(T, 8))
    Tq, Tk = _round_up(T, bq), _round_up(T, bk)
    # Padding positions are invalid tokens: masked as keys, zero as queries, sliced off.
    q_BTKRH = _pad_time(q_BTNH, Tq).reshape(B, Tq, K, N // K, H)
    o_BTKRH = _flash(
        q_BTKRH,
        _pad_time(k_BTKH, Tk),
        _pad_time(v_BTKH, Tk),
        _pad_time(valid_BT, Tq, False),
        _pad_time(valid_BT, Tk, False),
        bq,
        bk,
    )
    return o_BTKRH[:, :T].reshape(B, T, N, H)


def _block_scores(
    q_BTKRH: Array, k_BTKH: Array, vq_BT: Array, vk_BT: Array, i: Array, j: Array, bq: int, bk: int
) -> tuple[Array, Array]:
    """Float32 scores and mask of query block i against key block j."""
    H = q_BTKRH.shape[-1]
    s_BKRTS = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BTKH, preferred_element_type=_F32)
    s_BKRTS = s_BKRTS * (1.0 / math.sqrt(H))
    # The causal test is done on every visited block: only diagonal ones are partial.
    t_T = i * bq + jnp.arange(bq)
    s_S = j * bk + jnp.arange(bk)
    mask_BTS = (t_T[:, None] >= s_S[None, :])[None] & vq_BT[:, :, None] & vk_BT[:, None, :]
    mask_B11TS = mask_BTS[:, None, None]
    return jnp.where(mask_B11TS, s_BKRTS, _MASK), mask_B11TS


def _slice_t(x: Array, start: Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _flash_forward(
    q_BTKRH: Array, k_BTKH: Array, v_BTKH: Array, vq_BT: Array, vk_BT: Array, bq: int, bk: int
) -> tuple[Array, Array, Array]:
    """Returns (o_BTKRH, lse_BKRT, blocks visited). The count is for the skipping test."""
    B, Tq, K, R, H = q_BTKRH.shape
    nq, nk = Tq // bq, k_BTKH.shape[1] // bk
    dt = q_BTKRH.dtype

    def q_block(visited, i):
        q_i = _slice_t(q_BTKRH, i * bq, bq)
        vq_i = _slice_t(vq_BT, i * bq, bq)

        def k_block(j, carry):
            m_BKRT, l_BKRT, acc_BKRTH, n = carry
            k_j, v_j, vk_j = (_slice_t(x, j * bk, bk) for x in (k_BTKH, v_BTKH, vk_BT))
            s_BKRTS, mask = _block_scores(q_i, k_j, vq_i, vk_j, i, j, bq, bk)
            m_new = jnp.maximum(m_BKRT, s_BKRTS.max(-1))
            p_BKRTS = jnp.where(mask, jnp.exp(s_BKRTS - m_new[..., None]), 0.0)
            alpha_BKRT = jnp.exp(m_BKRT - m_new)  # rescales what was summed so far
            pv_BKRTH = jnp.einsum(
                "bkrts,bskh->bkrth", p_BKRTS.astype(dt), v_j, preferred_element_type=_F32
            )
            l_BKRT = alpha_BKRT * l_BKRT + p_BKRTS.sum(-1)
            acc_BKRTH = alpha_BKRT[..., None] * acc_BKRTH + pv_BKRTH
            return m_new, l_BKRT, acc_BKRTH, n + 1

        # Key blocks after the diagonal are never visited: a dynamic trip count.
        n_k = jnp.minimum(((i + 1) * bq - 1) // bk + 1, nk)
        zeros_BKRT = jnp.zeros((B, K, R, bq), _F32)
        init = (zeros_BKRT + _MASK, zeros_BKRT, jnp.zeros((B, K, R, bq, H), _F32), visited)
        m_BKRT, l_BKRT, acc_BKRTH, visited = jax.lax.fori_loop(0, n_k, k_block, init)
        seen_BKRT = l_BKRT > 0  # False only for queries with no visible key
        l_safe = jnp.where(seen_BKRT, l_BKRT, 1.0)
        o_BTKRH = jnp.moveaxis(acc_BKRTH / l_safe[..., None], 3, 1).astype(dt)
        lse_BKRT = jnp.where(seen_BKRT, m_BKRT + jnp.log(l_safe), 0.0)
        return visited, (o_BTKRH, lse_BKRT)

    visited, (o_nBTKRH, lse_nBKRT) = jax.lax.scan(q_block, jnp.int32(0), jnp.arange(nq))
    o_BTKRH = jnp.moveaxis(o_nBTKRH, 0, 1).reshape(B, Tq, K, R, H)
    lse_BKRT = jnp.moveaxis(lse_nBKRT, 0, 3).reshape(B, K, R, Tq)
    return o_BTKRH, lse_BKRT, visited


def _flash_backward(
    res: tuple[Array, ...], do_BTKRH: Array, bq: int, bk: int
) -> tuple[Array, Array, Array, Array]:
    """FlashAttention-2 backward: outer loop over key blocks, inner over query blocks
    from the diagonal down. res = (q, k, v, valid_q, valid_k, o, lse) as saved by the
    forward. Returns (dq, dk, dv, blocks visited)."""
    q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, o_BTKRH, lse_BKRT = res
    B, Tq, K, R, H = q_BTKRH.shape
    Tk = k_BTKH.shape[1]
    nq, nk = Tq // bq, Tk // bk
    dt = q_BTKRH.dtype
    scale = 1.0 / math.sqrt(H)
    # D_t = sum_h dO * O = sum_s P * dP: the softmax-Jacobian term, one per query row.
    delta_BKRT = jnp.einsum(
        "btkrh,btkrh->bkrt", do_BTKRH.astype(_F32), o_BTKRH.astype(_F32)
    )

    def k_block(carry, j):
        dq_BTKRH, visited = carry
        k_j, v_j, vk_j = (_slice_t(x, j * bk, bk) for x in (k_BTKH, v_BTKH, vk_BT))

        def q_block(i, carry):
            dq_BTKRH, dk_BSKH, dv_BSKH, n = carry
            q_i = _slice_t(q_BTKRH, i * bq, bq)
            do_i = _slice_t(do_BTKRH, i * bq, bq)
            lse_i = jax.lax.dynamic_slice_in_dim(lse_BKRT, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta_BKRT, i * bq, bq, axis=3)
            s_BKRTS, mask = _block_scores(q_i, k_j, _slice_t(vq_BT, i * bq, bq), vk_j, i, j, bq, bk)
            p_BKRTS = jnp.where(mask, jnp.exp(s_BKRTS - lse_i[..., None]), 0.0)
            dv_BSKH += jnp.einsum(
                "bkrts,btkrh->bskh", p_BKRTS.astype(dt), do_i, preferred_element_type=_F32
            )
            dp_BKRTS = jnp.einsum("btkrh,bskh->bkrts", do_i, v_j, preferred_element_type=_F32)
            ds_BKRTS = (p_BKRTS * (dp_BKRTS - delta_i[..., None])).astype(dt)
            dk_BSKH += scale * jnp.einsum(
                "bkrts,btkrh->bskh", ds_BKRTS, q_i, preferred_element_type=_F32
            )
            dq_i = scale * jnp.einsum(
                "bkrts,bskh->btkrh", ds_BKRTS, k_j, preferred_element_type=_F32
            )
            dq_BTKRH = jax.lax.dynamic_update_slice_in_dim(
                dq_BTKRH, _slice_t(dq_BTKRH, i * bq, bq) + dq_i, i * bq, axis=1
            )
            return dq_BTKRH, dk_BSKH, dv_BSKH, n + 1

        # Query blocks entirely before this key block see none of it: start at the diagonal.
        zeros_BSKH = jnp.zeros((B, bk, K, H), _F32)
        init = (dq_BTKRH, zeros_BSKH, zeros_BSKH, visited)
        dq_BTKRH, dk_BSKH, dv_BSKH, visited = jax.lax.fori_loop((j * bk) // bq, nq, q_block, init)
        return (dq_BTKRH, visited), (dk_BSKH, dv_BSKH)

    init = (jnp.zeros(q_BTKRH.shape, _F32), jnp.int32(0))
    (dq_BTKRH, visited), (dk_nBSKH, dv_nBSKH) = jax.lax.scan(k_block, init, jnp.arange(nk))
    dk_BTKH = jnp.moveaxis(dk_nBSKH, 0, 1).reshape(B, Tk, K, H)
    dv_BTKH = jnp.moveaxis(dv_nBSKH, 0, 1).reshape(B, Tk, K, H)
    return dq_BTKRH.astype(dt), dk_BTKH.astype(dt), dv_BTKH.astype(dt), visited


# The trip counts are dynamic (while loops), which reverse-mode cannot go through; the
# custom VJP also keeps only O(T) residuals (q, k, v, o, logsumexp).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq: int, bk: int) -> Array:
    return _flash_forward(q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk)[0]


def _flash_fwd(q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk):
    o_BTKRH, lse_BKRT, _ = _flash_forward(q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk)
    return o_BTKRH, (q_BTKRH, k_BTKH, v_BTKH, vq_BT, vk_BT, o_BTKRH, lse_BKRT)


def _flash_bwd(bq, bk, res, do_BTKRH):
    dq, dk, dv, _ = _flash_backward(res, do_BTKRH, bq, bk)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------- cudnn


def _cudnn(
    q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array, *, sdpa_impl: str = "cudnn"
) -> Array:
    """cuDNN flash attention. Its padding is right-padding by lengths, so each row is
    rotated left by its number of leading pads (valid tokens first, order kept, so
    causality among them is unchanged), run PADDING_CAUSAL, and rotated back. Assumes
    the valid tokens of a row are one contiguous run: [0..0 1..1] or [0..0 1..1 0..0].
    sdpa_impl='xla' runs the same wrapper with jax's xla SDPA on CPU (tests)."""
    if sdpa_impl == "cudnn" and q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"model.attention='cudnn' needs bfloat16 or float16 activations, got "
            f"{q_BTNH.dtype}; use 'chunked' (or 'auto') for float32"
        )
    T_in = valid_BT.shape[1]
    # cuDNN's training kernels with padding need even lengths (jax checks T % 2 at trace time);
    # pad to a multiple of 64, its tile, with invalid tokens at the end (a trainer row is
    # Tp + R - 1 tokens, odd for even buckets): they are masked by the lengths and sliced off.
    T = _round_up(T_in, 64)
    q_BTNH, k_BTKH, v_BTKH = (_pad_time(x, T) for x in (q_BTNH, k_BTKH, v_BTKH))
    valid_BT = _pad_time(valid_BT, T, False)
    n_valid_B = valid_BT.sum(axis=1, dtype=jnp.int32)
    shift_B1 = jnp.argmax(valid_BT, axis=1).astype(jnp.int32)[:, None]  # leading pads
    t_1T = jnp.arange(T)[None]
    to_rot_BT11 = ((t_1T + shift_B1) % T)[:, :, None, None]
    from_rot_BT11 = ((t_1T - shift_B1) % T)[:, :, None, None]

    def rot(x):
        return jnp.take_along_axis(x, to_rot_BT11, axis=1)

    # A fully invalid row gets length 1 (one pad token attends itself) so the kernel
    # never sees an empty softmax; its outputs are zeroed below, so its gradients are 0.
    len_B = jnp.maximum(n_valid_B, 1)
    o_BTNH = jax.nn.dot_product_attention(
        rot(q_BTNH),
        rot(k_BTKH),
        rot(v_BTKH),
        is_causal=True,
        query_seq_lengths=len_B,
        key_value_seq_lengths=len_B,
        implementation=sdpa_impl,
    )
    o_BTNH = jnp.take_along_axis(o_BTNH, from_rot_BT11, axis=1)
    o_BTNH = jnp.where(valid_BT[:, :, None, None], o_BTNH, 0).astype(q_BTNH.dtype)
    return o_BTNH[:, :T_in]


# ---------------------------------------------------------------- splash (TPU)


def _splash_kernel(
    N: int, T: int, bq: int, bkv: int, interpret: bool
) -> splash_lib.splash_attention_kernel.SplashAttentionKernel:
    mask = splash_lib.MultiHeadMask([splash_lib.CausalMask((T, T)) for _ in range(N)])
    # The *_compute tiles default to the kv tiles.
    sizes = splash_lib.BlockSizes(
        block_q=bq, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq, block_kv_dq=bkv
    )
    # Built per trace, not cached: its mask tables are arrays of the current trace (a
    # cache leaks them out of shard_map). The MHA kernel takes K <= N kv heads and
    # maps query head h to kv head h // (N // K), the Hugging Face order.
    return splash_lib.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _kernel_split(B: int, K: int):
    """How a Pallas kernel (not auto-partitioned) is cut under the mesh in context ->
    (mesh, (row axes spec, kv-head axis)) for a shard_map: rows over the mesh's data/fsdp
    axes and kv heads over tensor, each where it divides and is not already manual;
    (mesh, None) when nothing is split."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return mesh, None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows, n_rows = [], 1
    for axis in ("data", "fsdp"):
        if axis in sizes and axis not in mesh.manual_axes and B % (n_rows * sizes[axis]) == 0:
            rows.append(axis)
            n_rows *= sizes[axis]
    heads = ("tensor" if "tensor" in sizes and "tensor" not in mesh.manual_axes
             and K % sizes["tensor"] == 0 else None)
    if not rows and heads is None:
        return mesh, None
    return mesh, (tuple(rows) or None, heads)


def _splash(
    q_BTNH: Array,
    k_BTKH: Array,
    v_BTKH: Array,
    valid_BT: Array,
    block_q: int,
    block_k: int,
    *,
    interpret: bool = False,
) -> Array:
    """Splash attention; under a mesh, shard_map over rows (data, fsdp) and kv heads
    (tensor) where they divide, since Pallas kernels are not auto-partitioned.
    interpret=True runs the kernel in the Pallas interpreter (CPU tests)."""
    B, T, _, H = q_BTNH.shape
    dt = q_BTNH.dtype
    # Tiles are multiples of 128 lanes and must divide the padded length; padding to the
    # larger tile and shrinking the other to a divisor wastes less than one tile.
    bq, bkv = (min(_round_up(b, 128), _round_up(T, 128)) for b in (block_q, block_k))
    Tp = _round_up(T, max(bq, bkv))
    bq, bkv = math.gcd(bq, Tp), math.gcd(bkv, Tp)

    def local(q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array) -> Array:
        """One device's rows and heads (the whole batch without a mesh)."""
        kernel = _splash_kernel(q_BTNH.shape[2], Tp, bq, bkv, interpret)
        # The kernel has no scale argument: fold it into q (one extra rounding in bf16).
        q_BTNH = (q_BTNH.astype(_F32) / math.sqrt(H)).astype(dt)
        q_BNTH, k_BKTH, v_BKTH = (
            jnp.swapaxes(_pad_time(x, Tp), 1, 2) for x in (q_BTNH, k_BTKH, v_BTKH)
        )
        # Pads are segment 0, real tokens 1: a real query sees exactly the real keys
        # s <= t; a pad query sees at least itself (no empty softmax), zeroed below.
        seg_BT = _pad_time(valid_BT.astype(jnp.int32), Tp)

        def one_row(q_NTH: Array, k_KTH: Array, v_KTH: Array, seg_T: Array) -> Array:
            return kernel(q_NTH, k_KTH, v_KTH, segment_ids=splash_lib.SegmentIds(seg_T, seg_T))

        o_BTNH = jnp.swapaxes(jax.vmap(one_row)(q_BNTH, k_BKTH, v_BKTH, seg_BT), 1, 2)
        return jnp.where(valid_BT[:, :, None, None], o_BTNH[:, :T], 0).astype(dt)

    mesh, split = _kernel_split(B, k_BTKH.shape[2])
    if split is None:
        return local(q_BTNH, k_BTKH, v_BTKH, valid_BT)
    row_spec, heads = split
    x_spec = P(row_spec, None, heads, None)
    specs = (x_spec, x_spec, x_spec, P(row_spec, None))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=False)
    return sharded(q_BTNH, k_BTKH, v_BTKH, valid_BT)


# ---------------------------------------------------------------- decode


def decode_attention(
    q_BNH: jax.Array,
    k_new_BKH: jax.Array,
    v_new_BKH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    valid_BS: jax.Array,
    *,
    prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One new query token per row (cached decoding), in one softmax over: the row's
    cache slots where valid_BS, the new token's own key (always visible; not yet in the
    cache) and, if prefix=(k_PTKH, v_PTKH, valid_PT), prompt p's keys for the G = B // P
    contiguous rows [p*G, (p+1)*G) (read once per prompt, never repeated G times).

    Numerics as `attention`. Pure JAX; a paged/ragged TPU decode kernel would go behind
    this same function, chosen like `attention`'s impl.
    """
    B, N, H = q_BNH.shape
    K = k_new_BKH.shape[1]
    dt = q_BNH.dtype
    scale = 1.0 / math.sqrt(H)
    q_BKRH = q_BNH.reshape(B, K, N // K, H)
    k_new_BKH, v_new_BKH = k_new_BKH.astype(dt), v_new_BKH.astype(dt)

    s_BKRS = scale * jnp.einsum(
        "bkrh,bskh->bkrs", q_BKRH, k_BSKH.astype(dt), preferred_element_type=_F32
    )
    own_B11S = valid_BS.astype(bool)[:, None, None, :]
    s_BKRS = jnp.where(own_B11S, s_BKRS, _MASK)
    s_BKR = scale * jnp.einsum("bkrh,bkh->bkr", q_BKRH, k_new_BKH, preferred_element_type=_F32)
    m_BKR = jnp.maximum(s_BKR, s_BKRS.max(-1, initial=_MASK))
    if prefix is not None:
        k_PTKH, v_PTKH, valid_PT = prefix
        Pn = k_PTKH.shape[0]
        q_PGKRH = q_BKRH.reshape(Pn, B // Pn, *q_BKRH.shape[1:])
        s_PGKRT = scale * jnp.einsum(
            "pgkrh,ptkh->pgkrt", q_PGKRH, k_PTKH.astype(dt), preferred_element_type=_F32
        )
        pre_P111T = valid_PT.astype(bool)[:, None, None, None, :]
        s_PGKRT = jnp.where(pre_P111T, s_PGKRT, _MASK)
        m_BKR = jnp.maximum(m_BKR, s_PGKRT.max(-1, initial=_MASK).reshape(m_BKR.shape))

    # The new token is always visible, so the sum below is >= exp(0) at the max: no 0/0.
    p_BKRS = jnp.where(own_B11S, jnp.exp(s_BKRS - m_BKR[..., None]), 0.0)
    p_BKR = jnp.exp(s_BKR - m_BKR)
    l_BKR = p_BKRS.sum(-1) + p_BKR
    acc_BKRH = jnp.einsum(
        "bkrs,bskh->bkrh", p_BKRS.astype(dt), v_BSKH.astype(dt), preferred_element_type=_F32
    )
    # One bf16 x bf16 product is exact in float32: the same as a dot with f32 accumulation.
    acc_BKRH += p_BKR.astype(dt).astype(_F32)[..., None] * v_new_BKH.astype(_F32)[:, :, None]
    if prefix is not None:
        m_PGKR = m_BKR.reshape(s_PGKRT.shape[:-1])
        p_PGKRT = jnp.where(pre_P111T, jnp.exp(s_PGKRT - m_PGKR[..., None]), 0.0)
        l_BKR += p_PGKRT.sum(-1).reshape(l_BKR.shape)
        acc_PGKRH = jnp.einsum(
            "pgkrt,ptkh->pgkrh", p_PGKRT.astype(dt), v_PTKH.astype(dt), preferred_element_type=_F32
        )
        acc_BKRH += acc_PGKRH.reshape(acc_BKRH.shape)
    return (acc_BKRH / l_BKR[..., None]).reshape(B, N, H).astype(dt)


# ---------------------------------------------------------------- paged decode

PAGED_IMPLS = ("xla", "pallas_tpu", "pallas_gpu")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def paged_impl(impl: str, *, dtype: jnp.dtype, head_dim: int, page_size: int = 16) -> str:
    """The paged decode implementation that goes with a config value (`model.attention`):
    the TPU paged-attention Pallas kernel wherever the prefill runs splash (on TPU, or asked
    for by name) and the head fills whole 128-lane tiles (the kernel's blocks need it: every
    Qwen2.5/Qwen3 model has 128); jax's GPU (Triton) paged-attention Pallas kernel wherever
    the prefill runs cuDNN (on a GPU in bf16/fp16, or asked for by name), when heads and
    pages have power-of-two sizes (Triton's block shapes; head >= 16); else the gather-based
    pure-JAX one (float32 on a GPU included: Triton's dots may round f32 through tf32)."""
    chosen = resolve(impl, dtype=dtype, seq_len=1)
    if chosen == "splash":
        return "pallas_tpu" if head_dim % 128 == 0 else "xla"
    if chosen == "cudnn" and _pow2(head_dim) and head_dim >= 16 and _pow2(page_size):
        return "pallas_gpu"
    return "xla"


def paged_decode_attention(
    q_BNH: Array,
    k_pool: Array,
    v_pool: Array,
    table_BX: Array,
    lengths_B: Array,
    *,
    impl: str = "xla",
    new_kv: tuple[Array, Array] | None = None,
    pages_per_block: int = 8,
) -> Array:
    """One query token per row over a paged cache: row b attends to the first
    `lengths_B[b]` (>= 1) tokens of the pages `table_BX[b]` read in order, the row's own
    token the last of them. Pools are [K, pages, page, H], the layout of jax's TPU
    paged-attention kernel; table entries past a row's length are never read by the kernel
    and masked here, but must be valid page ids.

    The row's own key/value are either in the pool already (written before this call) or,
    with `new_kv` = (k_BKH, v_BKH), passed here and not yet written: the pool's slot
    `lengths_B - 1` is then ignored (`paged_writes_first` says which the impl takes).

    impl: "xla", a gather of the X pages and a masked softmax (numerics as `attention`),
    any backend, takes `new_kv`, so that a decode step can write every layer's keys in one
    scatter after its layer scan; "pallas_tpu",
    `jax.experimental.pallas.ops.tpu.paged_attention`, reading only the pages below each
    length (blocks of `pages_per_block` pages), its own token from the pool, under
    shard_map over rows and kv heads where a mesh splits them (Pallas kernels are not
    auto-partitioned); "pallas_gpu", `jax.experimental.pallas.ops.gpu.paged_attention`
    (Triton), the same way (`gpu_interpret` runs it in the Pallas interpreter)."""
    if impl in ("pallas_tpu", "pallas_gpu"):
        if new_kv is not None:
            raise ValueError(f"the {impl} paged kernel reads the row's own key from the "
                             "pool: write it first (paged_writes_first)")
        return _paged_kernel(impl, q_BNH, k_pool, v_pool, table_BX, lengths_B,
                             pages_per_block)
    if impl != "xla":
        raise ValueError(f"paged decode impl must be one of {PAGED_IMPLS}, got {impl!r}")
    B, N, H = q_BNH.shape
    K, _, ps, _ = k_pool.shape
    X = table_BX.shape[1]

    def rows(pool):  # [K, B, X, page, H] -> [B, X * page, K, H]
        return jnp.moveaxis(pool[:, table_BX].reshape(K, B, X * ps, H), 0, 2)

    if new_kv is not None:  # the cached tokens before it, then the new one (decode_attention)
        valid_BS = jnp.arange(X * ps)[None] < lengths_B[:, None] - 1
        return decode_attention(q_BNH, *new_kv, rows(k_pool), rows(v_pool), valid_BS)
    dt = q_BNH.dtype
    q_BKRH = q_BNH.reshape(B, K, N // K, H)
    s_BKRS = (1.0 / math.sqrt(H)) * jnp.einsum("bkrh,bskh->bkrs", q_BKRH,
                                                rows(k_pool).astype(dt),
                                                preferred_element_type=_F32)
    valid_B11S = (jnp.arange(X * ps)[None] < lengths_B[:, None])[:, None, None, :]
    s_BKRS = jnp.where(valid_B11S, s_BKRS, _MASK)
    m_BKR = s_BKRS.max(-1)
    p_BKRS = jnp.where(valid_B11S, jnp.exp(s_BKRS - m_BKR[..., None]), 0.0)
    acc_BKRH = jnp.einsum("bkrs,bskh->bkrh", p_BKRS.astype(dt), rows(v_pool).astype(dt),
                          preferred_element_type=_F32)
    return (acc_BKRH / p_BKRS.sum(-1)[..., None]).reshape(B, N, H).astype(dt)


def paged_writes_first(impl: str) -> bool:
    """Whether `paged_decode_attention(impl=...)` reads the row's own key from the pool
    (so a decode step writes each layer's key before attending), or takes it as `new_kv`
    (so the step writes all layers' keys in one scatter after the layer scan: one update of
    the pool per step instead of one per layer)."""
    return impl in ("pallas_tpu", "pallas_gpu")


def paged_chunk_attention(
    q_BCNH: Array,
    k_BCKH: Array,
    v_BCKH: Array,
    k_pool: Array,
    v_pool: Array,
    table_BQ: Array,
    start_B: Array,
    valid_BC: Array,
) -> Array:
    """A chunk of C query tokens per row (chunked prefill): row b's chunk holds its tokens
    start_B[b], start_B[b] + 1, ... (those with valid_BC), whose keys/values k_BCKH / v_BCKH
    are passed here (not yet in the pool), after its first start_B[b] tokens, cached in the
    pages table_BQ[b] read in order. Query i attends to those cached tokens and to the
    chunk's valid tokens up to itself (causal); invalid queries output 0. Numerics as
    `attention`'s xla (the reference). A gather of the table's Q pages and a masked
    softmax: any backend. Pools and table as `paged_decode_attention`'s."""
    B, C, _, H = q_BCNH.shape
    K, _, ps, _ = k_pool.shape
    Q = table_BQ.shape[1]
    dt = q_BCNH.dtype

    def keys(pool, new_BCKH):  # [B, Q * page + C, K, H]: the cached prefix, then the chunk
        cached = jnp.moveaxis(pool[:, table_BQ].reshape(K, B, Q * ps, H), 0, 2)
        return jnp.concatenate([cached.astype(dt), new_BCKH.astype(dt)], axis=1)

    valid_BC = valid_BC.astype(bool)
    cached_BS = jnp.arange(Q * ps)[None] < start_B[:, None]
    causal_CC = jnp.tril(jnp.ones((C, C), bool))
    mask_BCS = jnp.concatenate(
        [jnp.broadcast_to(cached_BS[:, None], (B, C, Q * ps)),
         causal_CC[None] & valid_BC[:, None, :]], axis=2) & valid_BC[:, :, None]
    return _masked(q_BCNH, keys(k_pool, k_BCKH), keys(v_pool, v_BCKH), mask_BCS)


_GPU_INTERPRET = [False]


@contextlib.contextmanager
def gpu_interpret():
    """Within it, the pallas_gpu paged kernel runs in the Pallas interpreter (any backend:
    how it is checked without a GPU), as `pltpu.force_tpu_interpret_mode` does for TPU."""
    _GPU_INTERPRET[0] = True
    try:
        yield
    finally:
        _GPU_INTERPRET[0] = False


def _paged_kernel(impl, q_BNH, k_pool, v_pool, table_BX, lengths_B, pages_per_block):
    B, N, H = q_BNH.shape
    K = k_pool.shape[0]
    X = table_BX.shape[1]
    ppb = max(1, min(pages_per_block, X))
    if impl == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention as tpu_kernel

        splits = 1

        def call(q, k_pool, v_pool, table_BX, lengths_B):
            return tpu_kernel.paged_attention(q, k_pool, v_pool, lengths_B, table_BX,
                                              pages_per_compute_block=ppb)
    else:
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

        # Triton takes power-of-two blocks: ppb pages (of a power-of-two size); the table is
        # cut into `splits` partitions run in parallel and merged (split-K)
        ppb = 1 << (ppb.bit_length() - 1)
        splits = max(1, min(16, X // ppb))
        interpret = _GPU_INTERPRET[0]

        def call(q, k_pool, v_pool, table_BX, lengths_B):
            return gpu_kernel.paged_attention(q, k_pool, v_pool, table_BX, lengths_B,
                                              pages_per_compute_block=ppb, k_splits=splits,
                                              interpret=interpret)
    # the kernel's blocks of pages must divide the table: pad it with page 0 (never read,
    # being past every length)
    table_BX = jnp.pad(table_BX, ((0, 0), (0, -X % (ppb * splits))))

    def local(q_BNH, k_pool, v_pool, table_BX, lengths_B):
        # the kernels have no scale argument: fold it into q (one extra rounding in bf16)
        q = (q_BNH.astype(_F32) / math.sqrt(H)).astype(q_BNH.dtype)
        return call(q, k_pool, v_pool, table_BX.astype(jnp.int32), lengths_B.astype(jnp.int32))

    mesh, split = _kernel_split(B, K)
    if split is None:
        return local(q_BNH, k_pool, v_pool, table_BX, lengths_B)
    row_spec, heads = split
    q_spec, pool_spec = P(row_spec, heads, None), P(heads, None, None, None)
    specs = (q_spec, pool_spec, pool_spec, P(row_spec, None), P(row_spec))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec,
                            check_vma=False)
    return sharded(q_BNH, k_pool, v_pool, table_BX, lengths_B)
