"""Chunked (flash) attention in pure JAX: any backend, O(T) memory.

Online softmax over key blocks; a custom VJP recomputes block probabilities from the saved
per-row logsumexp (FlashAttention-2 backward). Blocks above the causal diagonal are skipped,
not masked (dynamic trip counts). Not here: choosing it (`dispatch`), the reference
(`reference.xla`) it is tested against.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ba_jax.models.attention.reference import F32, MASK, Array, pad_time, round_up


def chunked(
    q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array, block_q: int, block_k: int
) -> Array:
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    # Blocks longer than the sequence shrink to it, rounded up to 8 sublanes.
    bq, bk = min(block_q, round_up(T, 8)), min(block_k, round_up(T, 8))
    Tq, Tk = round_up(T, bq), round_up(T, bk)
    # Padding positions are invalid tokens: masked as keys, zero as queries, sliced off.
    q_BTKJH = pad_time(q_BTNH, Tq).reshape(B, Tq, K, N // K, H)
    o_BTKJH = _flash(
        q_BTKJH,
        pad_time(k_BTKH, Tk),
        pad_time(v_BTKH, Tk),
        pad_time(valid_BT, Tq, False),
        pad_time(valid_BT, Tk, False),
        bq,
        bk,
    )
    return o_BTKJH[:, :T].reshape(B, T, N, H)


def _block_scores(
    q_BTKJH: Array, k_BTKH: Array, vq_BT: Array, vk_BT: Array, i: Array, j: Array, bq: int, bk: int
) -> tuple[Array, Array]:
    """Float32 scores and mask of query block i against key block j."""
    H = q_BTKJH.shape[-1]
    s_BKJTS = jnp.einsum("btkjh,bskh->bkjts", q_BTKJH, k_BTKH, preferred_element_type=F32)
    s_BKJTS = s_BKJTS * (1.0 / math.sqrt(H))
    # The causal test is done on every visited block: only diagonal ones are partial.
    t_T = i * bq + jnp.arange(bq)
    s_S = j * bk + jnp.arange(bk)
    mask_BTS = (t_T[:, None] >= s_S[None, :])[None] & vq_BT[:, :, None] & vk_BT[:, None, :]
    mask_B11TS = mask_BTS[:, None, None]
    return jnp.where(mask_B11TS, s_BKJTS, MASK), mask_B11TS


def _slice_t(x: Array, start: Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _flash_forward(
    q_BTKJH: Array, k_BTKH: Array, v_BTKH: Array, vq_BT: Array, vk_BT: Array, bq: int, bk: int
) -> tuple[Array, Array, Array]:
    """Returns (o_BTKJH, lse_BKJT, blocks visited). The count is for the skipping test."""
    B, Tq, K, J, H = q_BTKJH.shape
    nq, nk = Tq // bq, k_BTKH.shape[1] // bk
    dt = q_BTKJH.dtype

    def q_block(visited, i):
        q_i = _slice_t(q_BTKJH, i * bq, bq)
        vq_i = _slice_t(vq_BT, i * bq, bq)

        def k_block(j, carry):
            m_BKJT, l_BKJT, acc_BKJTH, n = carry
            k_j, v_j, vk_j = (_slice_t(x, j * bk, bk) for x in (k_BTKH, v_BTKH, vk_BT))
            s_BKJTS, mask = _block_scores(q_i, k_j, vq_i, vk_j, i, j, bq, bk)
            m_new = jnp.maximum(m_BKJT, s_BKJTS.max(-1))
            p_BKJTS = jnp.where(mask, jnp.exp(s_BKJTS - m_new[..., None]), 0.0)
            alpha_BKJT = jnp.exp(m_BKJT - m_new)  # rescales what was summed so far
            pv_BKJTH = jnp.einsum(
                "bkjts,bskh->bkjth", p_BKJTS.astype(dt), v_j, preferred_element_type=F32
            )
            l_BKJT = alpha_BKJT * l_BKJT + p_BKJTS.sum(-1)
            acc_BKJTH = alpha_BKJT[..., None] * acc_BKJTH + pv_BKJTH
            return m_new, l_BKJT, acc_BKJTH, n + 1

        # Key blocks after the diagonal are never visited: a dynamic trip count.
        n_k = jnp.minimum(((i + 1) * bq - 1) // bk + 1, nk)
        zeros_BKJT = jnp.zeros((B, K, J, bq), F32)
        init = (zeros_BKJT + MASK, zeros_BKJT, jnp.zeros((B, K, J, bq, H), F32), visited)
        m_BKJT, l_BKJT, acc_BKJTH, visited = jax.lax.fori_loop(0, n_k, k_block, init)
        seen_BKJT = l_BKJT > 0  # False only for queries with no visible key
        l_safe = jnp.where(seen_BKJT, l_BKJT, 1.0)
        o_BTKJH = jnp.moveaxis(acc_BKJTH / l_safe[..., None], 3, 1).astype(dt)
        lse_BKJT = jnp.where(seen_BKJT, m_BKJT + jnp.log(l_safe), 0.0)
        return visited, (o_BTKJH, lse_BKJT)

    visited, (o_nBTKJH, lse_nBKJT) = jax.lax.scan(q_block, jnp.int32(0), jnp.arange(nq))
    o_BTKJH = jnp.moveaxis(o_nBTKJH, 0, 1).reshape(B, Tq, K, J, H)
    lse_BKJT = jnp.moveaxis(lse_nBKJT, 0, 3).reshape(B, K, J, Tq)
    return o_BTKJH, lse_BKJT, visited


def _flash_backward(
    res: tuple[Array, ...], do_BTKJH: Array, bq: int, bk: int
) -> tuple[Array, Array, Array, Array]:
    """FlashAttention-2 backward: outer loop over key blocks, inner over query blocks
    from the diagonal down. res = (q, k, v, valid_q, valid_k, o, lse) as saved by the
    forward. Returns (dq, dk, dv, blocks visited)."""
    q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, o_BTKJH, lse_BKJT = res
    B, Tq, K, J, H = q_BTKJH.shape
    Tk = k_BTKH.shape[1]
    nq, nk = Tq // bq, Tk // bk
    dt = q_BTKJH.dtype
    scale = 1.0 / math.sqrt(H)
    # D_t = sum_h dO * O = sum_s P * dP: the softmax-Jacobian term, one per query row.
    delta_BKJT = jnp.einsum(
        "btkjh,btkjh->bkjt", do_BTKJH.astype(F32), o_BTKJH.astype(F32)
    )

    def k_block(carry, j):
        dq_BTKJH, visited = carry
        k_j, v_j, vk_j = (_slice_t(x, j * bk, bk) for x in (k_BTKH, v_BTKH, vk_BT))

        def q_block(i, carry):
            dq_BTKJH, dk_BSKH, dv_BSKH, n = carry
            q_i = _slice_t(q_BTKJH, i * bq, bq)
            do_i = _slice_t(do_BTKJH, i * bq, bq)
            lse_i = jax.lax.dynamic_slice_in_dim(lse_BKJT, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta_BKJT, i * bq, bq, axis=3)
            s_BKJTS, mask = _block_scores(q_i, k_j, _slice_t(vq_BT, i * bq, bq), vk_j, i, j, bq, bk)
            p_BKJTS = jnp.where(mask, jnp.exp(s_BKJTS - lse_i[..., None]), 0.0)
            dv_BSKH += jnp.einsum(
                "bkjts,btkjh->bskh", p_BKJTS.astype(dt), do_i, preferred_element_type=F32
            )
            dp_BKJTS = jnp.einsum("btkjh,bskh->bkjts", do_i, v_j, preferred_element_type=F32)
            ds_BKJTS = (p_BKJTS * (dp_BKJTS - delta_i[..., None])).astype(dt)
            dk_BSKH += scale * jnp.einsum(
                "bkjts,btkjh->bskh", ds_BKJTS, q_i, preferred_element_type=F32
            )
            dq_i = scale * jnp.einsum(
                "bkjts,bskh->btkjh", ds_BKJTS, k_j, preferred_element_type=F32
            )
            dq_BTKJH = jax.lax.dynamic_update_slice_in_dim(
                dq_BTKJH, _slice_t(dq_BTKJH, i * bq, bq) + dq_i, i * bq, axis=1
            )
            return dq_BTKJH, dk_BSKH, dv_BSKH, n + 1

        # Query blocks entirely before this key block see none of it: start at the diagonal.
        zeros_BSKH = jnp.zeros((B, bk, K, H), F32)
        init = (dq_BTKJH, zeros_BSKH, zeros_BSKH, visited)
        dq_BTKJH, dk_BSKH, dv_BSKH, visited = jax.lax.fori_loop((j * bk) // bq, nq, q_block, init)
        return (dq_BTKJH, visited), (dk_BSKH, dv_BSKH)

    init = (jnp.zeros(q_BTKJH.shape, F32), jnp.int32(0))
    (dq_BTKJH, visited), (dk_nBSKH, dv_nBSKH) = jax.lax.scan(k_block, init, jnp.arange(nk))
    dk_BTKH = jnp.moveaxis(dk_nBSKH, 0, 1).reshape(B, Tk, K, H)
    dv_BTKH = jnp.moveaxis(dv_nBSKH, 0, 1).reshape(B, Tk, K, H)
    return dq_BTKJH.astype(dt), dk_BTKH.astype(dt), dv_BTKH.astype(dt), visited


# The trip counts are dynamic (while loops), which reverse-mode cannot go through; the
# custom VJP also keeps only O(T) residuals (q, k, v, o, logsumexp).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq: int, bk: int) -> Array:
    return _flash_forward(q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk)[0]


def _flash_fwd(q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk):
    o_BTKJH, lse_BKJT, _ = _flash_forward(q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, bq, bk)
    return o_BTKJH, (q_BTKJH, k_BTKH, v_BTKH, vq_BT, vk_BT, o_BTKJH, lse_BKJT)


def _flash_bwd(bq, bk, res, do_BTKJH):
    dq, dk, dv, _ = _flash_backward(res, do_BTKJH, bq, bk)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

