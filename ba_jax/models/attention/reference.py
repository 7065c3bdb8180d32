"""The reference attention: full float32 scores and a masked softmax, plain autodiff.

Lives here: `masked` (the one masked softmax every gather-based path uses), `xla` (causal
self-attention within segments, the truth every other implementation is tested against),
`same_segment` (the segment mask every kernel applies), `decode_attention`
(one new token per row over cached keys plus its own key, optionally a prompt prefix shared
by its group), and the constants and padding helpers the kernels share. Not here: choosing
an implementation (`dispatch`), the kernels themselves (`flash`, `cudnn`, `splash`, `paged`).
Shape letters as in the README; J = query heads per kv head (N = K * J).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so a fully masked row gives exp(0) = 1 instead of NaN; masked probabilities
# are then zeroed explicitly. Same value as splash attention's default.
MASK = -0.7 * float(np.finfo(np.float32).max)
F32 = jnp.float32
Array = jax.Array


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_time(x: Array, T_new: int, value: bool | float = 0) -> Array:
    """`x` padded with `value` along axis 1 (time) to T_new."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, T_new - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def xla(q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, ids_BT: Array) -> Array:
    """Reference: full scores, plain autodiff (fine in bf16: every cast is explicit).
    ids_BT: segment ids, 0 for padding (`segments.token_ids`; a boolean valid_BT is one
    segment per row)."""
    T = q_BTNH.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    return masked(q_BTNH, k_BTKH, v_BTKH, causal_TS[None] & same_segment(ids_BT, ids_BT))


def same_segment(idq_BT: Array, idk_BS: Array) -> Array:
    """[B, T, S]: query t and key s are real tokens of one segment (ids as `xla`'s)."""
    idq_BT, idk_BS = idq_BT.astype(jnp.int32), idk_BS.astype(jnp.int32)
    return (idq_BT[:, :, None] == idk_BS[:, None, :]) & (idq_BT > 0)[:, :, None]


def masked(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, mask_BTS: Array) -> Array:
    """Query t attends key s where mask_BTS[b, t, s]: full float32 scores and softmax, both
    products in q's dtype with float32 accumulation; a query with no key outputs 0."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    dt = q_BTNH.dtype
    q_BTKJH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKJTS = jnp.einsum("btkjh,bskh->bkjts", q_BTKJH, k_BSKH, preferred_element_type=F32)
    s_BKJTS = s_BKJTS * (1.0 / math.sqrt(H))
    mask_B11TS = mask_BTS[:, None, None]
    s_BKJTS = jnp.where(mask_B11TS, s_BKJTS, MASK)
    # Rows with no visible key (invalid queries) are uniform over MASK: zero them.
    p_BKJTS = jnp.where(mask_B11TS, jax.nn.softmax(s_BKJTS, axis=-1), 0.0)
    o_BTKJH = jnp.einsum(
        "bkjts,bskh->btkjh", p_BKJTS.astype(dt), v_BSKH, preferred_element_type=F32
    )
    return o_BTKJH.reshape(B, T, N, H).astype(dt)



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
    q_BKJH = q_BNH.reshape(B, K, N // K, H)
    k_new_BKH, v_new_BKH = k_new_BKH.astype(dt), v_new_BKH.astype(dt)

    s_BKJS = scale * jnp.einsum(
        "bkjh,bskh->bkjs", q_BKJH, k_BSKH.astype(dt), preferred_element_type=F32
    )
    own_B11S = valid_BS.astype(bool)[:, None, None, :]
    s_BKJS = jnp.where(own_B11S, s_BKJS, MASK)
    s_BKJ = scale * jnp.einsum("bkjh,bkh->bkj", q_BKJH, k_new_BKH, preferred_element_type=F32)
    m_BKJ = jnp.maximum(s_BKJ, s_BKJS.max(-1, initial=MASK))
    if prefix is not None:
        k_PTKH, v_PTKH, valid_PT = prefix
        Pn = k_PTKH.shape[0]
        q_PGKJH = q_BKJH.reshape(Pn, B // Pn, *q_BKJH.shape[1:])
        s_PGKJT = scale * jnp.einsum(
            "pgkjh,ptkh->pgkjt", q_PGKJH, k_PTKH.astype(dt), preferred_element_type=F32
        )
        pre_P111T = valid_PT.astype(bool)[:, None, None, None, :]
        s_PGKJT = jnp.where(pre_P111T, s_PGKJT, MASK)
        m_BKJ = jnp.maximum(m_BKJ, s_PGKJT.max(-1, initial=MASK).reshape(m_BKJ.shape))

    # The new token is always visible, so the sum below is >= exp(0) at the max: no 0/0.
    p_BKJS = jnp.where(own_B11S, jnp.exp(s_BKJS - m_BKJ[..., None]), 0.0)
    p_BKJ = jnp.exp(s_BKJ - m_BKJ)
    l_BKJ = p_BKJS.sum(-1) + p_BKJ
    acc_BKJH = jnp.einsum(
        "bkjs,bskh->bkjh", p_BKJS.astype(dt), v_BSKH.astype(dt), preferred_element_type=F32
    )
    # One bf16 x bf16 product is exact in float32: the same as a dot with f32 accumulation.
    acc_BKJH += p_BKJ.astype(dt).astype(F32)[..., None] * v_new_BKH.astype(F32)[:, :, None]
    if prefix is not None:
        m_PGKJ = m_BKJ.reshape(s_PGKJT.shape[:-1])
        p_PGKJT = jnp.where(pre_P111T, jnp.exp(s_PGKJT - m_PGKJ[..., None]), 0.0)
        l_BKJ += p_PGKJT.sum(-1).reshape(l_BKJ.shape)
        acc_PGKJH = jnp.einsum(
            "pgkjt,ptkh->pgkjh", p_PGKJT.astype(dt), v_PTKH.astype(dt), preferred_element_type=F32
        )
        acc_BKJH += acc_PGKJH.reshape(acc_BKJH.shape)
    return (acc_BKJH / l_BKJ[..., None]).reshape(B, N, H).astype(dt)

