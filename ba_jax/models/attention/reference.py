"""The reference attention: full float32 scores and a masked softmax, plain autodiff.

Lives here: `masked` (the one masked softmax every gather-based path uses), `xla` (causal
self-attention, the truth every other implementation is tested against), `decode_attention`
(one new token per row over cached keys plus its own key, optionally a prompt prefix shared
by its group), and the constants and padding helpers the kernels share. Not here: choosing
an implementation (`dispatch`), the kernels themselves (`flash`, `cudnn`, `splash`, `paged`).
Shape letters as in the README; R = query heads per kv head (N = K * R).
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


def xla(q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array) -> Array:
    """Reference: full scores, plain autodiff (fine in bf16: every cast is explicit)."""
    T = q_BTNH.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    mask_BTS = causal_TS[None] & valid_BT[:, None, :] & valid_BT[:, :, None]
    return masked(q_BTNH, k_BTKH, v_BTKH, mask_BTS)


def masked(q_BTNH: Array, k_BSKH: Array, v_BSKH: Array, mask_BTS: Array) -> Array:
    """Query t attends key s where mask_BTS[b, t, s]: full float32 scores and softmax, both
    products in q's dtype with float32 accumulation; a query with no key outputs 0."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    dt = q_BTNH.dtype
    q_BTKRH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKRTS = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=F32)
    s_BKRTS = s_BKRTS * (1.0 / math.sqrt(H))
    mask_B11TS = mask_BTS[:, None, None]
    s_BKRTS = jnp.where(mask_B11TS, s_BKRTS, MASK)
    # Rows with no visible key (invalid queries) are uniform over MASK: zero them.
    p_BKRTS = jnp.where(mask_B11TS, jax.nn.softmax(s_BKRTS, axis=-1), 0.0)
    o_BTKRH = jnp.einsum(
        "bkrts,bskh->btkrh", p_BKRTS.astype(dt), v_BSKH, preferred_element_type=F32
    )
    return o_BTKRH.reshape(B, T, N, H).astype(dt)



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
        "bkrh,bskh->bkrs", q_BKRH, k_BSKH.astype(dt), preferred_element_type=F32
    )
    own_B11S = valid_BS.astype(bool)[:, None, None, :]
    s_BKRS = jnp.where(own_B11S, s_BKRS, MASK)
    s_BKR = scale * jnp.einsum("bkrh,bkh->bkr", q_BKRH, k_new_BKH, preferred_element_type=F32)
    m_BKR = jnp.maximum(s_BKR, s_BKRS.max(-1, initial=MASK))
    if prefix is not None:
        k_PTKH, v_PTKH, valid_PT = prefix
        Pn = k_PTKH.shape[0]
        q_PGKRH = q_BKRH.reshape(Pn, B // Pn, *q_BKRH.shape[1:])
        s_PGKRT = scale * jnp.einsum(
            "pgkrh,ptkh->pgkrt", q_PGKRH, k_PTKH.astype(dt), preferred_element_type=F32
        )
        pre_P111T = valid_PT.astype(bool)[:, None, None, None, :]
        s_PGKRT = jnp.where(pre_P111T, s_PGKRT, MASK)
        m_BKR = jnp.maximum(m_BKR, s_PGKRT.max(-1, initial=MASK).reshape(m_BKR.shape))

    # The new token is always visible, so the sum below is >= exp(0) at the max: no 0/0.
    p_BKRS = jnp.where(own_B11S, jnp.exp(s_BKRS - m_BKR[..., None]), 0.0)
    p_BKR = jnp.exp(s_BKR - m_BKR)
    l_BKR = p_BKRS.sum(-1) + p_BKR
    acc_BKRH = jnp.einsum(
        "bkrs,bskh->bkrh", p_BKRS.astype(dt), v_BSKH.astype(dt), preferred_element_type=F32
    )
    # One bf16 x bf16 product is exact in float32: the same as a dot with f32 accumulation.
    acc_BKRH += p_BKR.astype(dt).astype(F32)[..., None] * v_new_BKH.astype(F32)[:, :, None]
    if prefix is not None:
        m_PGKR = m_BKR.reshape(s_PGKRT.shape[:-1])
        p_PGKRT = jnp.where(pre_P111T, jnp.exp(s_PGKRT - m_PGKR[..., None]), 0.0)
        l_BKR += p_PGKRT.sum(-1).reshape(l_BKR.shape)
        acc_PGKRH = jnp.einsum(
            "pgkrt,ptkh->pgkrh", p_PGKRT.astype(dt), v_PTKH.astype(dt), preferred_element_type=F32
        )
        acc_BKRH += acc_PGKRH.reshape(acc_BKRH.shape)
    return (acc_BKRH / l_BKR[..., None]).reshape(B, N, H).astype(dt)

