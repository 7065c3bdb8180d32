"""cuDNN flash attention through `jax.nn.dot_product_attention` (bf16/fp16 only).

Not here: choosing it (`dispatch`); the lowering tests stand in for cuDNN's version query.
"""

import jax
import jax.numpy as jnp

from ba_jax.models.attention.reference import Array, pad_time, round_up


def cudnn(
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
    T = round_up(T_in, 64)
    q_BTNH, k_BTKH, v_BTKH = (pad_time(x, T) for x in (q_BTNH, k_BTKH, v_BTKH))
    valid_BT = pad_time(valid_BT, T, False)
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

