"""cuDNN flash attention (bf16/fp16 only): one sequence per row through
`jax.nn.dot_product_attention` (`cudnn`), several (packed rows) through cuDNN's packed
layout (`packed`).

`packed` hands cuDNN each contiguous run of a segment id as its own ragged sequence (jax's
private `q_offsets` / `kv_offsets` arguments, `compat.cudnn_packed_attention`; Hopper or
newer), so cuDNN computes causal attention within runs only: ~sum_i L_i^2 / 2. Chosen over
a Pallas GPU kernel with segment ids because jax's only one (`pallas.ops.gpu.attention`) is
Triton, deprecated from jax 0.12, and its Mosaic GPU attention (both ends) takes no segment
ids or padding; cuDNN's packed layout is in jax 0.10.2 and 0.12 with the same keywords.
Not here: choosing it (`dispatch`); the lowering tests stand in for cuDNN's version and
compute-capability queries.
"""

import math

import jax
import jax.numpy as jnp

from ba_jax import compat
from ba_jax.models.attention.reference import Array, pad_time, round_up

_HALF = (jnp.bfloat16, jnp.float16)


def cudnn(
    q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, valid_BT: Array, *, sdpa_impl: str = "cudnn"
) -> Array:
    """cuDNN flash attention. Its padding is right-padding by lengths, so each row is
    rotated left by its number of leading pads (valid tokens first, order kept, so
    causality among them is unchanged), run PADDING_CAUSAL, and rotated back. Assumes
    the valid tokens of a row are one contiguous run: [0..0 1..1] or [0..0 1..1 0..0].
    sdpa_impl='xla' runs the same wrapper with jax's xla SDPA on CPU (tests)."""
    if sdpa_impl == "cudnn":
        _check_half(q_BTNH.dtype)
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



def _check_half(dtype) -> None:
    if dtype not in _HALF:
        raise ValueError(
            f"model.attention='cudnn' needs bfloat16 or float16 activations, got "
            f"{dtype}; use 'chunked' (or 'auto') for float32"
        )


def runs(ids_BT: Array, max_runs: int) -> tuple[Array, Array, Array]:
    """The contiguous runs of equal positive ids in each row, in cuDNN's packed layout
    -> (lengths [B, M], starts [B, M + 1], runs per row [B]); unused entries -1 (jax's
    convention), M = max_runs; runs past M are dropped (the caller checks the count)."""
    B, T = ids_BT.shape
    real_BT = ids_BT > 0
    prev_BT = jnp.pad(ids_BT[:, :-1], ((0, 0), (1, 0)))
    start_BT = real_BT & (ids_BT != prev_BT)
    run_BT = jnp.cumsum(start_BT, axis=1) - 1
    n_runs_B = start_BT.sum(axis=1, dtype=jnp.int32)
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    # Padding tokens scatter out of range (dropped).
    run_BT = jnp.where(real_BT, run_BT, max_runs)
    len_BM = jnp.zeros((B, max_runs), jnp.int32).at[b_BT, run_BT].add(1, mode="drop")
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first_BM = jnp.full((B, max_runs), T, jnp.int32).at[b_BT, run_BT].min(t_BT, mode="drop")
    used_BM = len_BM > 0
    len_BM = jnp.where(used_BM, len_BM, -1)
    start_BM = jnp.pad(jnp.where(used_BM, first_BM, -1), ((0, 0), (0, 1)), constant_values=-1)
    return len_BM, start_BM, n_runs_B


def packed(
    q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, ids_BT: Array, max_segments: int, *,
    sdpa=None
) -> Array:
    """cuDNN's packed layout: each contiguous run of a positive id is one sequence (causal
    within it); padding (id 0) outputs 0 with zero gradients. At most `max_segments` runs
    per row (static: cuDNN's statistics are [B * max_segments, N, T]); a row with more
    outputs NaN. `sdpa`: a stand-in for jax's private cuDNN function with its keywords
    (CPU tests); None: the real one."""
    if max_segments < 1:
        raise ValueError("model.attention='cudnn' with segments needs Segments.max_segments "
                         "(a static bound on the segments of one row)")
    fn = sdpa
    if fn is None:
        _check_half(q_BTNH.dtype)
        fn = compat.cudnn_packed_attention()
        if fn is None:
            raise NotImplementedError("this jax has no cuDNN packed-layout attention")
    B, T_in, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    # Even lengths for the training kernels, as `cudnn`; the added tokens are padding.
    T = round_up(T_in, 64)
    ids_BT = pad_time(ids_BT.astype(jnp.int32), T, 0)
    real_BT11 = (ids_BT > 0)[:, :, None, None]
    # Tokens outside every run are never read or written by cuDNN: zero them on the way in
    # (their gradients become exactly 0, whatever cuDNN leaves there) and on the way out.
    q_BTNH, k_BTKH, v_BTKH = (jnp.where(real_BT11, pad_time(x, T), 0)
                              for x in (q_BTNH, k_BTKH, v_BTKH))
    if K != N and sdpa is None and not compat.cudnn_packed_gqa_ok():
        # This jax strides kv offsets by the query heads: give it as many kv heads.
        k_BTKH, v_BTKH = (jnp.repeat(x, N // K, axis=2) for x in (k_BTKH, v_BTKH))
    # M >= 2: jax takes M = 1 for one length per row (offsets ignored, left pads lost).
    len_BM, start_BM, n_runs_B = runs(ids_BT, max(max_segments, 2))
    o_BTNH = fn(q_BTNH, k_BTKH, v_BTKH, q_seqlen=len_BM, kv_seqlen=len_BM,
                q_offsets=start_BM, kv_offsets=start_BM, scale=1.0 / math.sqrt(H),
                mask_type=compat.cudnn_mask_type("PADDING_CAUSAL"))
    o_BTNH = jnp.where(real_BT11, o_BTNH, 0)
    o_BTNH = jnp.where((n_runs_B > max_segments)[:, None, None, None], jnp.nan, o_BTNH)
    return o_BTNH[:, :T_in].astype(q_BTNH.dtype)
