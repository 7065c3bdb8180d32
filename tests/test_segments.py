"""Packed rows (segment ids) through every kernel of the attention seam, and the model.

The reference (xla with a segment mask) is first checked against attending each sequence
alone; every other kernel is then checked against it, values and gradients: chunked for
real (and its block visits counted), cudnn's packed-layout wrapper with a CPU stand-in for
cuDNN's ragged sequences, splash in the Pallas interpreter; cudnn and splash also lowered
for cuda / tpu. Last, a packed row through the model gives each sequence's logits alone.
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from ba_jax import compat
from ba_jax.models import attention as A
from ba_jax.models import qwen
from ba_jax.models.attention import cudnn, flash, reference, splash
from ba_jax.models.attention import segments as seg

F32, BF16 = jnp.float32, jnp.bfloat16
T = 40
# Row layouts of T tokens, as per-row (left pads, segment lengths): five segments with a
# one-token one; one segment filling the row; left pads; right pads; left and right pads.
LAYOUTS = [(0, [9, 1, 12, 10, 8]), (0, [T]), (6, [20, 14]), (0, [3, 17, 5]), (4, [1, 30])]


def layout_ids(layouts=LAYOUTS, T=T):
    return seg.from_lengths([r for _, r in layouts], T, [p for p, _ in layouts])


def make_inputs(B, T, N, K, H, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    q, ct = (jnp.asarray(rng.normal(size=(B, T, N, H)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), dtype) for _ in range(2))
    return q, k, v, ct


def out_and_grads(fn, q, k, v, ct):
    def both(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(ct.astype(o.dtype)))

    return [np.asarray(x, np.float32) for x in jax.jit(both)(q, k, v)]


def assert_matches(got, want, tol):
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(g)), name
        err = float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def packed_fn(ids, impl, **kw):
    valid = jnp.ones(ids.shape, bool)
    segments = A.Segments(jnp.asarray(ids), max_segments=kw.pop("max_segments", 0))
    return lambda q, k, v: A.attention(q, k, v, valid, impl=impl, segments=segments, **kw)


def test_reference_is_each_sequence_alone():
    """xla with segment ids: each segment's outputs are those of attending it alone (a
    causal row of its own), padding outputs 0; GQA."""
    ids = layout_ids()
    N, K, H = 4, 2, 8
    q, k, v, _ = (np.asarray(x, np.float64) for x in make_inputs(len(LAYOUTS), T, N, K, H))
    got = np.asarray(packed_fn(ids, "xla")(q.astype(np.float32), k.astype(np.float32),
                                            v.astype(np.float32)))
    for b, row in enumerate(ids):
        assert np.all(got[b, row == 0] == 0)
        for s in set(row[row > 0]):
            at = np.flatnonzero(row == s)
            for n in range(N):  # float64 causal attention of the segment alone, head n
                s_TS = q[b, at, n] @ k[b, at, n // (N // K)].T / np.sqrt(H)
                s_TS = np.where(np.tril(np.ones((len(at),) * 2, bool)), s_TS, -np.inf)
                p_TS = np.exp(s_TS - s_TS.max(1, keepdims=True))
                alone = (p_TS / p_TS.sum(1, keepdims=True)) @ v[b, at, n // (N // K)]
                np.testing.assert_allclose(got[b, at, n], alone, rtol=0, atol=1e-5)


def test_segments_none_is_one_segment_per_row():
    """segments=None and ids = valid_BT give the same attention (one mask rule)."""
    valid = seg.from_lengths([[T - 5]], T, [5]) > 0
    q, k, v, _ = make_inputs(1, T, 2, 1, 8)
    for impl in ("xla", "chunked"):
        none = A.attention(q, k, v, valid, impl=impl, block_q=16, block_k=8)
        ones = packed_fn(valid.astype(np.int32), impl, block_q=16, block_k=8)(q, k, v)
        np.testing.assert_array_equal(np.asarray(none), np.asarray(ones))


def test_positions():
    ids = jnp.asarray(seg.from_lengths([[2, 1, 3], [3]], 8, [0, 2]))
    np.testing.assert_array_equal(seg.positions(ids), [[0, 1, 0, 0, 1, 2, 0, 0],
                                                      [0, 0, 0, 1, 2, 0, 0, 0]])


@pytest.mark.parametrize("N,K,bq,bk", [(4, 2, 16, 8), (1, 1, 8, 8), (4, 1, 8, 16)])
def test_chunked_segments_match_xla(N, K, bq, bk):
    """Values and gradients on every layout (rows of different segments: per-row trip
    counts), GQA, MHA and MQA, blocks that do and do not divide T; plus a row whose ids
    are neither contiguous nor increasing (exact, only less skipping)."""
    ids = np.concatenate([layout_ids(), [[2, 2, 0, 1, 1, 2, 3, 1] * (T // 8)]])
    q, k, v, ct = make_inputs(len(ids), T, N, K, 16)
    want = out_and_grads(packed_fn(ids, "xla"), q, k, v, ct)
    got = out_and_grads(packed_fn(ids, "chunked", block_q=bq, block_k=bk), q, k, v, ct)
    assert_matches(got, want, 1e-5)
    assert np.all(got[0][ids == 0] == 0)


def block_truth(ids_T, bq, bk):
    """(query block, key block) pairs holding some query t and key s <= t of one segment,
    from the token-level mask."""
    n = len(ids_T)
    attends = (np.tril(np.ones((n, n), bool)) & (ids_T[:, None] == ids_T[None])
               & (ids_T[:, None] > 0))
    nq, nk = -(-n // bq), -(-n // bk)
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:n, :n] = attends
    return int(padded.reshape(nq, bq, nk, bk).any(axis=(1, 3)).sum())


def count_visits(ids_T, bq, bk):
    """Block visits of the forward and the backward loops for one row (counted where the
    work is done)."""
    n = len(ids_T)
    q, k, v, _ = make_inputs(1, n, 1, 1, 8)
    Tq, Tk = -(-n // bq) * bq, -(-n // bk) * bk
    ids = jnp.asarray(ids_T)[None]
    args = (reference.pad_time(q, Tq)[:, :, :, None], reference.pad_time(k, Tk),
            reference.pad_time(v, Tk), reference.pad_time(ids, Tq, 0),
            reference.pad_time(ids, Tk, 0))
    o, lse, n_fwd = jax.jit(flash._flash_forward, static_argnums=(5, 6))(*args, bq, bk)
    *_, n_bwd = jax.jit(flash._flash_backward, static_argnums=(2, 3))((*args, o, lse), o, bq, bk)
    return int(n_fwd), int(n_bwd)


FIVE = [300, 1, 180, 350, 193]  # 1024 tokens


@pytest.mark.parametrize("pads", [(0, 0), (70, 30)])
def test_chunked_visits_follow_sum_of_squares(pads):
    """One row of five segments (one of a single token) costs the blocks its segments
    need, ~sum_i L_i^2 / 2, not the full row's T^2 / 2: forward and backward visit exactly
    the block pairs that hold an attending (t, s); with left and right pads too (pad blocks
    cost nothing)."""
    left, right = pads
    b, n = 32, 1024 + left + right
    ids = seg.from_lengths([FIVE], n, [left])[0]
    full = count_visits(np.ones(n, np.int32), b, b)
    packed = count_visits(ids, b, b)
    assert packed == (block_truth(ids, b, b),) * 2
    assert full == (block_truth(np.ones(n, np.int32), b, b),) * 2
    # each segment's triangle, plus at most one block row and column where it straddles
    bound = sum((-(-L // b) + 1) * (-(-L // b) + 2) // 2 for L in FIVE)
    assert packed[0] <= bound < full[0] / 2
    if pads == (0, 0):
        assert full[0] == 32 * 33 // 2 and packed[0] == 174


def test_chunked_visits_with_unequal_blocks():
    ids = seg.from_lengths([[37, 50, 3, 60]], 160, [10])[0]
    for bq, bk in ((16, 8), (8, 32)):
        assert count_visits(ids, bq, bk) == (block_truth(ids, bq, bk),) * 2


# ---------------------------------------------------------------- cudnn packed layout


def test_runs():
    ids = jnp.asarray(seg.from_lengths([[2, 1, 3], [5], []], 8, [0, 2, 0]))
    lens, starts, n = cudnn.runs(ids, 4)
    np.testing.assert_array_equal(lens, [[2, 1, 3, -1], [5, -1, -1, -1], [-1] * 4])
    np.testing.assert_array_equal(starts, [[0, 2, 3, -1, -1], [2, -1, -1, -1, -1], [-1] * 5])
    np.testing.assert_array_equal(n, [3, 1, 0])


def ragged_sdpa(query, key, value, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale,
                mask_type):
    """CPU stand-in for cuDNN's packed layout as jax documents it: sequence m of row b is
    tokens [q_offsets[b, m], + q_seqlen[b, m]), causal within it; -1 entries unused;
    tokens in no sequence are left as they come (cuDNN does not write them)."""
    assert mask_type == compat.cudnn_mask_type("PADDING_CAUSAL")
    assert q_offsets.shape[1] == q_seqlen.shape[1] + 1  # values: test_runs
    t = jnp.arange(query.shape[1])
    start_BM1 = q_offsets[:, :-1, None]
    inside_BMT = ((t >= start_BM1) & (t < start_BM1 + q_seqlen[:, :, None])
                  & (q_seqlen[:, :, None] > 0))
    run_BT = jnp.where(inside_BMT.any(1), jnp.argmax(inside_BMT, axis=1) + 1, 0)
    assert abs(scale - query.shape[-1] ** -0.5) < 1e-9
    o = reference.xla(query, key, value, run_BT)
    return jnp.where((run_BT > 0)[:, :, None, None], o, jnp.nan)  # unwritten: garbage


@pytest.mark.parametrize("N,K", [(4, 2), (2, 2)])
def test_cudnn_packed_wrapper_on_cpu(N, K):
    """The packed-layout wrapper (runs -> lengths and offsets, even length, padding zeroed
    in and out) gives xla's values and gradients with the stand-in for cuDNN; a row with
    more runs than max_segments is NaN, never a wrong number."""
    ids = layout_ids()
    q, k, v, ct = make_inputs(len(ids), T, N, K, 16)
    want = out_and_grads(packed_fn(ids, "xla"), q, k, v, ct)

    def wrapped(q, k, v, m=5):
        return cudnn.packed(q, k, v, jnp.asarray(ids), m, sdpa=ragged_sdpa)

    assert_matches(out_and_grads(wrapped, q, k, v, ct), want, 1e-5)
    o = np.asarray(wrapped(q, k, v, m=4))
    assert np.all(np.isnan(o[0])) and np.all(np.isfinite(o[1:]))
    with pytest.raises(ValueError, match="max_segments"):
        A.attention(q.astype(BF16), k.astype(BF16), v.astype(BF16), jnp.ones(ids.shape, bool),
                    impl="cudnn", segments=A.Segments(jnp.asarray(ids)))


def test_cudnn_packed_lowers_for_cuda():
    """Forward and backward lower for cuda to cuDNN's fused attention with the packed
    layout (max_seg_per_batch in its config). Stubbed: only jax's two hardware queries,
    cuDNN's version and whether the GPU is Hopper or newer (this host has neither). Where
    jax strides kv offsets by the query heads (`compat.cudnn_packed_gqa_ok` False), the
    kv heads reach the kernel repeated to N."""
    B, T_, N, K, H, M = 2, 256, 4, 2, 64, 6
    ids = jnp.asarray(seg.from_lengths([[100, 1, 90], [256]], T_))
    segments = A.Segments(ids, max_segments=M)
    valid, ct = jnp.ones((B, T_), bool), jnp.ones((B, T_, N, H), F32)
    q = jax.ShapeDtypeStruct((B, T_, N, H), BF16)
    kv = jax.ShapeDtypeStruct((B, T_, K, H), BF16)

    def fwd(q, k, v):
        return A.attention(q, k, v, valid, impl="cudnn", segments=segments)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(F32) * ct)

    def lower(f):
        return jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()

    with mock.patch.object(cudnn_fa, "check_cudnn_version", return_value=90800), \
            mock.patch.object(cudnn_fa, "check_compute_capability", return_value=True):
        fwd_text = lower(fwd)
        bwd_text = lower(jax.grad(loss, argnums=(0, 1, 2)))
    assert fwd_text.count("@__cudnn$fmhaSoftmax(") == 1
    assert bwd_text.count("@__cudnn$fmhaSoftmaxBackward(") == 1
    call = next(line for line in fwd_text.splitlines() if "@__cudnn$fmhaSoftmax(" in line)
    assert f"max_seg_per_batch\\22: {M}" in call
    # operands: q, k, v, then per-segment lengths [B, M] and starts [B, M + 1], q and kv
    kv_heads = K if compat.cudnn_packed_gqa_ok() else N
    x, x_kv = f"tensor<{B}x{T_}x{N}x{H}xbf16>", f"tensor<{B}x{T_}x{kv_heads}x{H}xbf16>"
    lens, starts = f"tensor<{B}x{M}xi32>", f"tensor<{B}x{M + 1}xi32>"
    assert f": ({x}, {x_kv}, {x_kv}, {lens}, {lens}, {starts}, {starts})" in call


# ---------------------------------------------------------------- splash


def test_splash_segments_interpret_match_xla():
    """Splash's SegmentIds, the real kernel in the Pallas interpreter: values and
    gradients on the layouts (T = 40 padded to one 128 block) and GQA."""
    ids = layout_ids()
    q, k, v, ct = make_inputs(len(ids), T, 4, 2, 8)
    want = out_and_grads(packed_fn(ids, "xla"), q, k, v, ct)
    valid = jnp.ones(ids.shape, bool)
    got = out_and_grads(lambda q, k, v: splash.splash(q, k, v, seg.token_ids(
        valid, A.Segments(jnp.asarray(ids))), 128, 128, interpret=True), q, k, v, ct)
    assert_matches(got, want, 1e-5)


def test_splash_segments_lower_for_tpu():
    B, T_, N, K, H = 2, 256, 4, 2, 128
    ids = jnp.asarray(seg.from_lengths([[100, 1, 90], [256]], T_))
    ct = jnp.ones((B, T_, N, H), F32)
    q = jax.ShapeDtypeStruct((B, T_, N, H), BF16)
    kv = jax.ShapeDtypeStruct((B, T_, K, H), BF16)
    fn = packed_fn(ids, "splash", block_q=128, block_k=128)
    bwd = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32) * ct), argnums=(0, 1, 2))
    fwd_text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
    bwd_text = jax.jit(bwd).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
    assert fwd_text.count("tpu_custom_call") == 1
    assert bwd_text.count("tpu_custom_call") == 3


# ---------------------------------------------------------------- the model

TINY = qwen.ModelConfig("qwen3", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                        rms_norm_eps=1e-6, max_position_embeddings=128,
                        use_tied_embeddings=False, use_qkv_bias=True, use_o_bias=True,
                        use_qk_norm=True)


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash"])
def test_packed_row_logits_are_each_sequence_alone(impl):
    """A row packing three sequences (and padding) gives each token the logits of its
    sequence run alone (float32): per-segment RoPE positions by default, attention within
    segments, through the model's one forward path."""
    cfg = dataclasses.replace(TINY, attention=impl, kernel_interpret=impl == "splash")
    model = qwen.Qwen(cfg, rngs=nnx.Rngs(0))
    lengths, left = [7, 1, 12], 3
    ids = seg.from_lengths([lengths], 26, [left])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, ids.shape), jnp.int32)
    segments = A.Segments(jnp.asarray(ids), max_segments=4)
    packed = jax.jit(lambda m, t: m(t, segments=segments))(model, tokens)
    start = left
    for L in lengths:
        alone = jax.jit(lambda m, t: m(t))(model, tokens[:, start:start + L])
        got, want = np.asarray(packed[0, start:start + L]), np.asarray(alone[0])
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
        start += L
