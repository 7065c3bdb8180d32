"""Chunked (flash) attention in pure JAX: any backend, O(T) memory.

Online softmax over key blocks; a custom VJP recomputes block probabilities from the saved
per-row logsumexp (FlashAttention-2 backward). A (query block, key block) pair is visited
only if it is on or below the causal diagonal and the two blocks' segment ranges (min and
max id over their real tokens, `segments`) overlap; the others are skipped, not masked
(dynamic trip counts over the hull of the visible blocks). So all-padding blocks cost
nothing, and a packed row (segments in increasing runs) costs ~sum_i L_i^2 / 2, not T^2 / 2:
its visible blocks hug the diagonal. With `per_row` each row gets its own trip counts
(the loops are vmapped: a batch iterates as often as its busiest row); without, one set of
trip counts covers every row (the union of their visible blocks). Not here: choosing it
(`dispatch`), the reference (`reference.xla`) it is tested against.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax.models.attention.reference import (
    F32,
    MASK,
    Array,
    pad_time,
    round_up,
    same_segment,
)

_NO_ID = np.iinfo(np.int32).max  # the min-id of a block without real tokens


def chunked(
    q_BTNH: Array,
    k_BTKH: Array,
    v_BTKH: Array,
    ids_BT: Array,
    block_q: int,
    block_k: int,
    *,
    per_row: bool = False,
) -> Array:
    """ids_BT: segment ids, 0 for padding (`segments.token_ids`). per_row: trip counts per
    row (packed rows, whose segments differ from row to row) instead of per batch."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    # Blocks longer than the sequence shrink to it, rounded up to 8 sublanes.
    bq, bk = min(block_q, round_up(T, 8)), min(block_k, round_up(T, 8))
    Tq, Tk = round_up(T, bq), round_up(T, bk)
    # Padding positions are invalid tokens: masked as keys, zero as queries, sliced off.
    args = (
        pad_time(q_BTNH, Tq).reshape(B, Tq, K, N // K, H),
        pad_time(k_BTKH, Tk),
        pad_time(v_BTKH, Tk),
        pad_time(ids_BT, Tq, 0),
        pad_time(ids_BT, Tk, 0),
    )
    if per_row:
        def row(*xs):
            return _flash(*(x[None] for x in xs), bq, bk)[0]

        o_BTKJH = jax.vmap(row)(*args)
    else:
        o_BTKJH = _flash(*args, bq, bk)
    return o_BTKJH[:, :T].reshape(B, T, N, H)


def _block_range(ids_BT: Array, b: int) -> tuple[Array, Array]:
    """Per block of b positions, the min and max id of its real tokens over every row
    (_NO_ID and 0 for a block without any: it overlaps nothing)."""
    ids_BnB = ids_BT.reshape(ids_BT.shape[0], -1, b)
    real = ids_BnB > 0
    return (jnp.where(real, ids_BnB, _NO_ID).min(axis=(0, 2)),
            jnp.where(real, ids_BnB, 0).max(axis=(0, 2)))


def visible_blocks(idq_BT: Array, idk_BT: Array, bq: int, bk: int) -> Array:
    """[nq, nk] bool: query block i may attend key block j (causally reachable, and their
    segment ranges overlap). Exactly the pairs holding an attending (t, s) when every
    segment is one run with ids increasing along the row."""
    q_lo, q_hi = _block_range(idq_BT, bq)
    k_lo, k_hi = _block_range(idk_BT, bk)
    i_Q1 = jnp.arange(q_lo.shape[0])[:, None]
    j_1K = jnp.arange(k_lo.shape[0])[None]
    causal_QK = j_1K * bk <= (i_Q1 + 1) * bq - 1
    return causal_QK & (k_lo[None] <= q_hi[:, None]) & (q_lo[:, None] <= k_hi[None])


def _hull(ok_XY: Array) -> tuple[Array, Array]:
    """Per row x, [start, stop) spanning its True entries; (0, 0) where there are none."""
    any_X = ok_XY.any(axis=1)
    start_X = jnp.argmax(ok_XY, axis=1)
    stop_X = ok_XY.shape[1] - jnp.argmax(ok_XY[:, ::-1], axis=1)
    return jnp.where(any_X, start_X, 0), jnp.where(any_X, stop_X, 0)


def _block_scores(
    q_BTKJH: Array, k_BTKH: Array, idq_BT: Array, idk_BT: Array, i: Array, j: Array, bq: int,
    bk: int
) -> tuple[Array, Array]:
    """Float32 scores and mask of query block i against key block j."""
    H = q_BTKJH.shape[-1]
    s_BKJTS = jnp.einsum("btkjh,bskh->bkjts", q_BTKJH, k_BTKH, preferred_element_type=F32)
    s_BKJTS = s_BKJTS * (1.0 / math.sqrt(H))
    # The causal test is done on every visited block: only diagonal ones are partial.
    t_T = i * bq + jnp.arange(bq)
    s_S = j * bk + jnp.arange(bk)
    mask_BTS = (t_T[:, None] >= s_S[None, :])[None] & same_segment(idq_BT, idk_BT)
    mask_B11TS = mask_BTS[:, None, None]
    return jnp.where(mask_B11TS, s_BKJTS, MASK), mask_B11TS


def _slice_t(x: Array, start: Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _flash_forward(
    q_BTKJH: Array, k_BTKH: Array, v_BTKH: Array, vq_BT: Array, vk_BT: Array, bq: int, bk: int
) -> tuple[Array, Array, Array]:
    """Returns (o_BTKJH, lse_BKJT, blocks visited). The count is for the skipping test.
    vq_BT / vk_BT: segment ids (0: padding; booleans are one segment)."""
    B, Tq, K, J, H = q_BTKJH.shape
    dt = q_BTKJH.dtype
    vq_BT, vk_BT = vq_BT.astype(jnp.int32), vk_BT.astype(jnp.int32)
    start_Q, stop_Q = _hull(visible_blocks(vq_BT, vk_BT, bq, bk))

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

        # Key blocks after the diagonal or in no segment of this block are never visited.
        zeros_BKJT = jnp.zeros((B, K, J, bq), F32)
        init = (zeros_BKJT + MASK, zeros_BKJT, jnp.zeros((B, K, J, bq, H), F32), visited)
        m_BKJT, l_BKJT, acc_BKJTH, visited = jax.lax.fori_loop(
            start_Q[i], stop_Q[i], k_block, init)
        seen_BKJT = l_BKJT > 0  # False only for queries with no visible key
        l_safe = jnp.where(seen_BKJT, l_BKJT, 1.0)
        o_BTKJH = jnp.moveaxis(acc_BKJTH / l_safe[..., None], 3, 1).astype(dt)
        lse_BKJT = jnp.where(seen_BKJT, m_BKJT + jnp.log(l_safe), 0.0)
        return visited, (o_BTKJH, lse_BKJT)

    visited, (o_nBTKJH, lse_nBKJT) = jax.lax.scan(q_block, jnp.int32(0), jnp.arange(Tq // bq))
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
    nk = Tk // bk
    vq_BT, vk_BT = vq_BT.astype(jnp.int32), vk_BT.astype(jnp.int32)
    start_K, stop_K = _hull(visible_blocks(vq_BT, vk_BT, bq, bk).T)
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

        # Query blocks before the diagonal or in no segment of this block see none of it.
        zeros_BSKH = jnp.zeros((B, bk, K, H), F32)
        init = (dq_BTKJH, zeros_BSKH, zeros_BSKH, visited)
        dq_BTKJH, dk_BSKH, dv_BSKH, visited = jax.lax.fori_loop(
            start_K[j], stop_K[j], q_block, init)
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

