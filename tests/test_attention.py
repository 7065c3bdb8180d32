"""Tests for ba_jax.models.attention: every implementation against the xla reference.

chunked and decode run here for real; cudnn's wrapper (the row rotation) runs on CPU
with jax's xla SDPA in place of the kernel, and splash runs in the Pallas interpreter.
Both GPU/TPU kernels are also lowered (forward and backward) for their platforms.
"""

import contextlib
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from ba_jax import compat
from ba_jax.models import attention as A
from ba_jax.models.attention import cudnn, flash, reference, splash

F32, BF16 = jnp.float32, jnp.bfloat16


def make_inputs(B, T, N, K, H, dtype=F32, seed=0):
    """q, k, v, a random output cotangent, and valid rows: full, left-padded, fully
    invalid, then more left pads (the sampler's layout: pads, then real tokens); row 3
    also ends in 3 pads (a completion shorter than the row)."""
    rng = np.random.default_rng(seed)
    q, ct = (jnp.asarray(rng.normal(size=(B, T, N, H)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), dtype) for _ in range(2))
    n_pad = [0, T // 3, T, 1, T - 1, 5][:B] + [7] * max(0, B - 6)
    valid = np.arange(T)[None, :] >= np.asarray(n_pad)[:, None]
    if B > 3:
        valid[3, -3:] = False
    return q, k, v, ct, jnp.asarray(valid)


def out_and_grads(fn, q, k, v, ct):
    """fn(q, k, v) and the gradients of <fn(q, k, v), ct> w.r.t. q, k, v (one jit)."""

    def both(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(ct.astype(o.dtype)))

    return [np.asarray(x, np.float32) for x in jax.jit(both)(q, k, v)]


def max_rel_err(got, want):
    """Max abs error relative to the reference's largest magnitude (scale-free)."""
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_matches(got, want, tol, names=("o", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want):
        assert np.all(np.isfinite(g)), name
        err = max_rel_err(g, w)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def assert_invalid_zero(o, valid):
    o_invalid = o[~np.asarray(valid)]
    assert o_invalid.size and np.all(o_invalid == 0.0)


def ref_fn(valid):
    return lambda q, k, v: A.attention(q, k, v, valid, impl="xla")


# ---------------------------------------------------------------- resolve


def test_resolve():
    assert A.resolve("auto", dtype=F32, seq_len=A.CHUNKED_MIN_LEN) == "chunked"
    assert A.resolve("auto", dtype=BF16, seq_len=A.CHUNKED_MIN_LEN - 1) == "xla"
    for impl in A.IMPLS[1:]:
        assert A.resolve(impl, dtype=F32, seq_len=8) == impl
    with mock.patch.object(jax, "default_backend", return_value="tpu"):
        assert A.resolve("auto", dtype=F32, seq_len=8) == "splash"
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
        assert A.resolve("auto", dtype=BF16, seq_len=8) == "cudnn"
        assert A.resolve("auto", dtype=F32, seq_len=8) == "chunked"
    with pytest.raises(ValueError, match="model.attention"):
        A.resolve("flash", dtype=F32, seq_len=8)
    q, k, v, _, valid = make_inputs(2, 8, 2, 1, 8)
    with pytest.raises(ValueError, match="model.attention"):
        A.attention(q, k, v, valid, impl="dot_product")


# ---------------------------------------------------------------- chunked


@pytest.mark.parametrize(
    "B,T,N,K,H,block_q,block_k",
    [
        (3, 37, 4, 2, 16, 16, 8),  # odd T, neither block divides T, GQA
        (2, 130, 2, 2, 8, 32, 64),  # N == K, block_q != block_k, 130 = 4*32 + 2
        (6, 64, 4, 1, 8, 16, 16),  # blocks divide T, MQA, six padding patterns
        (3, 37, 4, 2, 16, 512, 512),  # blocks larger than T shrink to one block
    ],
)
def test_chunked_matches_xla_f32(B, T, N, K, H, block_q, block_k):
    q, k, v, ct, valid = make_inputs(B, T, N, K, H)
    want = out_and_grads(ref_fn(valid), q, k, v, ct)
    chunked = lambda q, k, v: A.attention(  # noqa: E731
        q, k, v, valid, impl="chunked", block_q=block_q, block_k=block_k
    )
    got = out_and_grads(chunked, q, k, v, ct)
    assert_matches(got, want, 1e-5)
    assert_invalid_zero(got[0], valid)
    assert_invalid_zero(want[0], valid)


def test_chunked_bf16():
    """bf16 against the float32 truth: chunked must be as accurate as the bf16 xla
    reference (both round q, k, v, the probabilities and the output to bf16; they
    differ in where they round, flash rounds unnormalised probabilities), i.e. within
    2x its error, and both within a few bf16 ulps (2^-8 relative) of the truth."""
    q, k, v, ct, valid = make_inputs(3, 37, 4, 2, 16, dtype=BF16)
    up = [x.astype(F32) for x in (q, k, v, ct)]
    truth = out_and_grads(ref_fn(valid), *up)
    xla_bf16 = out_and_grads(ref_fn(valid), q, k, v, ct)
    chunked = lambda q, k, v: A.attention(  # noqa: E731
        q, k, v, valid, impl="chunked", block_q=16, block_k=8
    )
    got = out_and_grads(chunked, q, k, v, ct)
    for name, g, x, t in zip(("o", "dq", "dk", "dv"), got, xla_bf16, truth):
        e_got, e_xla = max_rel_err(g, t), max_rel_err(x, t)
        assert np.all(np.isfinite(g)), name
        assert e_got <= max(2 * e_xla, 2**-8), f"{name}: {e_got:.2e} vs xla bf16 {e_xla:.2e}"
        assert e_got <= 4 * 2**-8, f"{name}: {e_got:.2e}"
    assert_invalid_zero(got[0], valid)


def test_chunked_long_sequence_memory():
    """T = 2048: same values and gradients as xla, and the compiler's temp memory for
    forward+backward is far below xla's, which holds several [T, T] float32 buffers."""
    B, T, N, K, H = 1, 2048, 2, 1, 8
    q, k, v, ct, valid = make_inputs(B, T, N, K, H)

    def loss(impl):
        def f(q, k, v):
            return jnp.sum(A.attention(q, k, v, valid, impl=impl) * ct)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    temp = {}
    for impl in ("xla", "chunked"):
        compiled = loss(impl).lower(q, k, v).compile()
        temp[impl] = compiled.memory_analysis().temp_size_in_bytes
        out = compiled(q, k, v)
        if impl == "xla":
            want = [np.asarray(x) for x in jax.tree.leaves(out)]
        else:
            assert_matches([np.asarray(x) for x in jax.tree.leaves(out)], want, 1e-5)
    scores_bytes = B * N * T * T * 4
    assert temp["xla"] >= scores_bytes
    assert temp["chunked"] * 8 < temp["xla"], temp
    # A handful of [B, N, 512, 512] float32 block buffers, not O(T^2).
    assert temp["chunked"] <= 8 * B * N * 512 * 512 * 4, temp


@pytest.mark.parametrize("T,bq,bk", [(100, 16, 8), (100, 8, 32), (64, 16, 16)])
def test_chunked_skips_blocks_above_diagonal(T, bq, bk):
    """The forward and backward loops visit exactly the (query block, key block) pairs
    that hold some s <= t, counted in the loop bodies that do the work."""
    B, N, K, H = 1, 2, 1, 8
    q, k, v, ct, valid = make_inputs(B, T, N, K, H)
    Tq, Tk = -(-T // bq) * bq, -(-T // bk) * bk
    nq, nk = Tq // bq, Tk // bk
    expected = sum(j * bk <= (i + 1) * bq - 1 for i in range(nq) for j in range(nk))
    assert expected < nq * nk
    q5 = reference.pad_time(q, Tq).reshape(B, Tq, K, N // K, H)
    k, v, valid_k = (reference.pad_time(x, Tk) for x in (k, v, valid))
    args = (q5, k, v, reference.pad_time(valid, Tq), valid_k)
    o, lse, n_fwd = jax.jit(flash._flash_forward, static_argnums=(5, 6))(*args, bq, bk)
    *_, n_bwd = jax.jit(flash._flash_backward, static_argnums=(2, 3))((*args, o, lse), o, bq, bk)
    assert int(n_fwd) == expected
    assert int(n_bwd) == expected


# ---------------------------------------------------------------- cudnn


@pytest.mark.parametrize("T", [24, 23])
def test_cudnn_wrapper_on_cpu(T):
    """The rotation (valid tokens first, PADDING_CAUSAL by lengths, rotate back) and the
    padding to cuDNN's even lengths (T=23 is a trainer row: 16 + 8 - 1) give the reference
    semantics; jax's xla SDPA stands in for the cuDNN kernel."""
    q, k, v, ct, valid = make_inputs(5, T, 4, 2, 16)
    want = out_and_grads(ref_fn(valid), q, k, v, ct)
    got = out_and_grads(lambda q, k, v: cudnn.cudnn(q, k, v, valid, sdpa_impl="xla"), q, k, v, ct)
    assert_matches(got, want, 1e-5)
    assert_invalid_zero(got[0], valid)


def test_cudnn_rejects_float32():
    q, k, v, _, valid = make_inputs(2, 8, 2, 1, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        A.attention(q, k, v, valid, impl="cudnn")


def _loss(valid, ct, impl):
    def loss(q, k, v):
        o = A.attention(q, k, v, valid, impl=impl)
        return jnp.sum(o.astype(F32) * ct)

    return loss


def test_cudnn_lowers_for_cuda():
    """Forward and backward lower for platform cuda and contain the cuDNN fused
    attention custom calls. This CPU-only jaxlib has no CUDA plugin, so jax's trace-time
    cuDNN version query raises RuntimeError('cuDNN is not detected.'); we assert that,
    then stand in a cuDNN version (9.8) for that query only. Nothing else is patched:
    the lowering rules and custom calls are jax's own for cuda."""
    B, T, N, K, H = 2, 128, 4, 2, 64
    valid = jnp.arange(T)[None] >= jnp.array([0, 50])[:, None]
    ct = jnp.ones((B, T, N, H), F32)
    q = jax.ShapeDtypeStruct((B, T, N, H), BF16)
    kv = jax.ShapeDtypeStruct((B, T, K, H), BF16)
    fwd = lambda q, k, v: A.attention(q, k, v, valid, impl="cudnn")  # noqa: E731
    bwd = jax.grad(_loss(valid, ct, "cudnn"), argnums=(0, 1, 2))

    def lower(f):
        return jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",))

    if cudnn_fa.cuda_versions is None:
        with pytest.raises(RuntimeError, match="cuDNN is not detected"):
            lower(fwd)
    with mock.patch.object(cudnn_fa, "check_cudnn_version", return_value=90800):
        fwd_text, bwd_lowered = lower(fwd).as_text(), lower(bwd)
    bwd_text = bwd_lowered.as_text()
    assert fwd_text.count("@__cudnn$fmhaSoftmax(") == 1
    assert bwd_text.count("@__cudnn$fmhaSoftmax(") == 1
    assert bwd_text.count("@__cudnn$fmhaSoftmaxBackward(") == 1
    assert [a.shape for a in bwd_lowered.out_info] == [q.shape, kv.shape, kv.shape]


# ---------------------------------------------------------------- splash


def splash_interpret(valid, **kw):
    return lambda q, k, v: splash.splash(q, k, v, valid, 128, 128, interpret=True, **kw)


def test_splash_interpret_matches_xla():
    """The real splash kernel, run by the Pallas interpreter on CPU: T = 200 padded to
    256 (two 128 blocks), GQA, left pads and a fully invalid row via segment ids."""
    q, k, v, ct, valid = make_inputs(3, 200, 4, 2, 8)
    want = out_and_grads(ref_fn(valid), q, k, v, ct)
    got = out_and_grads(splash_interpret(valid), q, k, v, ct)
    assert_matches(got, want, 1e-5)
    assert_invalid_zero(got[0], valid)


def _mesh():
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))


def test_splash_interpret_under_mesh():
    """With a data x fsdp x tensor mesh in context the kernel runs under shard_map
    (rows over data and fsdp, kv heads over tensor) and still matches the reference."""
    q, k, v, ct, valid = make_inputs(4, 72, 4, 2, 8)
    want = out_and_grads(ref_fn(valid), q, k, v, ct)
    with jax.set_mesh(_mesh()):
        jaxpr = str(jax.make_jaxpr(splash_interpret(valid))(q, k, v))
        got = out_and_grads(splash_interpret(valid), q, k, v, ct)
    assert "shard_map" in jaxpr and "('data', 'fsdp')" in jaxpr and "tensor" in jaxpr
    assert_matches(got, want, 1e-5)


@pytest.mark.parametrize("use_mesh", [False, True])
def test_splash_lowers_for_tpu(use_mesh):
    """Forward and backward lower for platform tpu to Mosaic custom calls (one forward
    kernel; the backward adds the dq and dkv kernels). Mosaic compiles them on TPU only."""
    B, T, N, K, H = 4, 300, 4, 2, 128
    valid = jnp.arange(T)[None] >= jnp.array([0, 50, 300, 1])[:, None]
    ct = jnp.ones((B, T, N, H), F32)
    q = jax.ShapeDtypeStruct((B, T, N, H), BF16)
    kv = jax.ShapeDtypeStruct((B, T, K, H), BF16)
    fwd = lambda q, k, v: A.attention(q, k, v, valid, impl="splash", block_q=256)  # noqa: E731
    bwd = jax.grad(_loss(valid, ct, "splash"), argnums=(0, 1, 2))
    with jax.set_mesh(_mesh()) if use_mesh else contextlib.nullcontext():
        fwd_text = jax.jit(fwd).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
        bwd_text = jax.jit(bwd).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
    assert fwd_text.count("tpu_custom_call") == 1
    assert bwd_text.count("tpu_custom_call") == 3
    assert ("sdy.manual_computation" in bwd_text) == use_mesh


# ---------------------------------------------------------------- decode


def decode_reference(q, k_new, v_new, k, v, valid, prefix):
    """The same softmax over [repeated prefix | own slots | new token], spelled out."""
    B, N, H = q.shape
    K = k_new.shape[1]
    dt = q.dtype
    keys, vals, masks = [k], [v], [valid]
    if prefix is not None:
        k_pre, v_pre, valid_pre = prefix
        G = B // k_pre.shape[0]
        keys.insert(0, jnp.repeat(k_pre, G, axis=0))
        vals.insert(0, jnp.repeat(v_pre, G, axis=0))
        masks.insert(0, jnp.repeat(valid_pre, G, axis=0))
    keys = jnp.concatenate(keys + [k_new[:, None]], axis=1)
    vals = jnp.concatenate(vals + [v_new[:, None]], axis=1)
    mask = jnp.concatenate(masks + [jnp.ones((B, 1), bool)], 1)
    q_BKRH = q.reshape(B, K, N // K, H)
    s = jnp.einsum("bkrh,bskh->bkrs", q_BKRH, keys, preferred_element_type=F32) / math.sqrt(H)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkrs,bskh->bkrh", p.astype(dt), vals, preferred_element_type=F32)
    return o.reshape(B, N, H).astype(dt).astype(F32)


@pytest.mark.parametrize("with_prefix", [False, True])
def test_decode_attention(with_prefix):
    P, G, S, T, N, K, H = 2, 3, 11, 9, 4, 2, 16
    B = P * G
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), F32)  # noqa: E731
    q, k_new, v_new = normal(B, N, H), normal(B, K, H), normal(B, K, H)
    k, v = normal(B, S, K, H), normal(B, S, K, H)
    valid = jnp.asarray(rng.random((B, S)) < 0.6).at[0].set(False)  # row 0: empty cache
    prefix = None
    if with_prefix:
        valid_pre = jnp.arange(T)[None] >= jnp.array([0, 4])[:, None]  # left-padded prompts
        prefix = (normal(P, T, K, H), normal(P, T, K, H), valid_pre)
    decode, reference = jax.jit(A.decode_attention), jax.jit(decode_reference)
    want = np.asarray(reference(q, k_new, v_new, k, v, valid, prefix))
    got = np.asarray(decode(q, k_new, v_new, k, v, valid, prefix=prefix))
    assert max_rel_err(got, want) <= 1e-5
    # The prefix is contracted per prompt: no [B, T, K, H] copy of it is ever built.
    jaxpr = str(jax.make_jaxpr(A.decode_attention)(q, k_new, v_new, k, v, valid, prefix=prefix))
    assert f"[{B},{T},{K},{H}]" not in jaxpr

    # bf16: as accurate as the spelled-out softmax in bf16, against the f32 truth.
    def cast(tree, src, dst):
        return jax.tree.map(lambda a: a.astype(dst) if a.dtype == src else a, tree)

    args16, prefix16 = cast((q, k_new, v_new, k, v, valid), F32, BF16), cast(prefix, F32, BF16)
    truth = reference(*cast(args16, BF16, F32), cast(prefix16, BF16, F32))
    ref16 = reference(*args16, prefix16)
    got16 = decode(*args16, prefix=prefix16)
    assert got16.dtype == BF16
    truth, ref16, got16 = (np.asarray(x, np.float32) for x in (truth, ref16, got16))
    e_got, e_ref = max_rel_err(got16, truth), max_rel_err(ref16, truth)
    assert e_got <= max(2 * e_ref, 2**-8), (e_got, e_ref)
    assert e_got <= 4 * 2**-8, e_got


# ---------------------------------------------------------------- paged decode


def paged_inputs(dtype, seed=2):
    """A pool of 10 pages of 4 slots, [K=2, 10, 4, H=16]; 4 rows reading 3 pages each, out
    of order and shared (rows 0 and 1 share their first page, as a prompt's samples do);
    lengths 1 (the row's own token only), mid-page, a page boundary and the whole table."""
    rng = np.random.default_rng(seed)
    N, K, H, NP, ps = 4, 2, 16, 10, 4
    q = jnp.asarray(rng.normal(size=(4, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(K, NP, ps, H)), dtype) for _ in range(2))
    table = jnp.array([[7, 2, 0], [7, 5, 9], [3, 1, 8], [6, 4, 0]], jnp.int32)
    lengths = jnp.array([1, 6, 8, 12], jnp.int32)
    return q, k, v, table, lengths


def paged_reference(q, k, v, table, lengths):
    """float64 softmax over each row's first lengths[b] slots of its pages, in order."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, N, H = q.shape
    K = k.shape[0]
    out = np.zeros((B, N, H))
    for b in range(B):
        kb = k[:, table[b]].reshape(K, -1, H)[:, :lengths[b]]
        vb = v[:, table[b]].reshape(K, -1, H)[:, :lengths[b]]
        for n in range(N):
            s = kb[n // (N // K)] @ q[b, n] / math.sqrt(H)
            p = np.exp(s - s.max())
            out[b, n] = p @ vb[n // (N // K)] / p.sum()
    return out


def test_paged_decode_attention_gather_and_tpu_kernel():
    """The gather path matches the float64 reference to float32 rounding. The TPU
    paged-attention kernel, run by the Pallas TPU interpreter, matches it to bf16 rounding:
    the interpreter multiplies float32 matrices with bf16 inputs, as the TPU's default
    precision does (a wrong page, offset or length moves outputs by O(1))."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, table, lengths = paged_inputs(F32)
    want = paged_reference(q, k, v, np.asarray(table), np.asarray(lengths))
    got = np.asarray(jax.jit(A.paged_decode_attention)(q, k, v, table, lengths))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[0], np.repeat(np.asarray(v)[:, 7, 0], 2, 0), atol=1e-6)
    with pltpu.force_tpu_interpret_mode():
        for ppb in (1, 2, 8):  # pages per kernel block; 2 pads the 3-page table
            tpu = np.asarray(A.paged_decode_attention(q, k, v, table, lengths,
                                                      impl="pallas_tpu", pages_per_block=ppb))
            np.testing.assert_allclose(tpu, want, atol=3e-2, rtol=0)
    # bf16 pools: both paths within bf16 rounding of the truth on the rounded inputs
    q16, k16, v16 = (x.astype(BF16) for x in (q, k, v))
    truth = paged_reference(q16, k16, v16, np.asarray(table), np.asarray(lengths))
    got16 = A.paged_decode_attention(q16, k16, v16, table, lengths)
    assert got16.dtype == BF16
    np.testing.assert_allclose(np.asarray(got16, np.float32), truth, atol=3e-2, rtol=0)
    with pltpu.force_tpu_interpret_mode():
        tpu16 = A.paged_decode_attention(q16, k16, v16, table, lengths, impl="pallas_tpu")
    np.testing.assert_allclose(np.asarray(tpu16, np.float32), truth, atol=3e-2, rtol=0)


def test_paged_gpu_kernel_in_the_interpreter():
    """jax's GPU (Triton) paged-attention kernel, run by the Pallas interpreter
    (`interpret=True`), matches the float64 reference: several pages per block, split-K
    partitions (the table padded to whole blocks and partitions), rows of one token and of
    the whole table; in bf16 to bf16 rounding."""
    q, k, v, table, lengths = paged_inputs(F32)
    want = paged_reference(q, k, v, np.asarray(table), np.asarray(lengths))
    for ppb in (1, 2, 8):
        got = np.asarray(A.paged_decode_attention(q, k, v, table, lengths, impl="pallas_gpu",
                                                  pages_per_block=ppb, interpret=True))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    q16, k16, v16 = (x.astype(BF16) for x in (q, k, v))
    got16 = A.paged_decode_attention(q16, k16, v16, table, lengths, impl="pallas_gpu",
                                     interpret=True)
    truth = paged_reference(q16, k16, v16, np.asarray(table), np.asarray(lengths))
    assert got16.dtype == BF16
    np.testing.assert_allclose(np.asarray(got16, np.float32), truth, atol=3e-2, rtol=0)
    with pytest.raises(ValueError, match="write it first"):
        A.paged_decode_attention(q, k, v, table, lengths, impl="pallas_gpu",
                                 new_kv=(k[:, 0, 0].T, v[:, 0, 0].T))


def test_paged_impl_follows_the_prefill_kernel():
    assert A.paged_impl("splash", dtype=BF16, head_dim=128) == "pallas_tpu"
    assert A.paged_impl("splash", dtype=BF16, head_dim=64) == "xla"  # not whole lane tiles
    assert A.paged_impl("xla", dtype=F32, head_dim=128) == "xla"
    assert A.paged_impl("cudnn", dtype=BF16, head_dim=128) == "pallas_gpu"
    assert A.paged_impl("cudnn", dtype=BF16, head_dim=128, page_size=12) == "xla"  # Triton
    assert A.paged_impl("cudnn", dtype=BF16, head_dim=80) == "xla"  # blocks: powers of two
    assert A.paged_impl("auto", dtype=F32, head_dim=128) == "xla"  # on this CPU


def test_paged_impl_falls_back_to_the_gather_path_without_the_triton_kernel(monkeypatch):
    """Where jax no longer ships its Triton paged-attention kernel (deprecated from 0.12),
    decode on a GPU takes the gather path (same results, `compat.has_gpu_paged_kernel`)."""
    assert A.paged_impl("cudnn", dtype=BF16, head_dim=128) == "pallas_gpu"
    monkeypatch.setattr(compat, "has_gpu_paged_kernel", lambda: False)
    assert A.paged_impl("cudnn", dtype=BF16, head_dim=128) == "xla"


@pytest.mark.parametrize("use_mesh", [False, True])
@pytest.mark.parametrize("impl, platform", [("pallas_tpu", "tpu"), ("pallas_gpu", "cuda")])
def test_paged_kernels_lower_for_their_platform(impl, platform, use_mesh):
    """The TPU kernel lowers to one Mosaic call for platform tpu, the Triton one for cuda
    (compiling either needs the hardware); under a data x fsdp x tensor mesh each runs in a
    shard_map (rows over data/fsdp, kv heads over tensor). For cuda the mesh (or no mesh) is
    an abstract one of H100s (`compat.abstract_gpu`): there is no GPU here to target."""
    B, N, K, H, NP, ps, X = 8, 8, 2, 128, 64, 16, 6
    q = jax.ShapeDtypeStruct((B, N, H), BF16)
    pool = jax.ShapeDtypeStruct((K, NP, ps, H), BF16)
    table = jax.ShapeDtypeStruct((B, X), jnp.int32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = jax.jit(lambda *a: A.paged_decode_attention(*a, impl=impl, pages_per_block=4))
    mesh = _mesh() if use_mesh else None
    if platform == "cuda":  # no GPU here: jax >= 0.11 asks for the target as an abstract one
        target = compat.abstract_gpu(mesh)
    else:
        target = jax.set_mesh(mesh) if use_mesh else contextlib.nullcontext()
    with target:
        text = fn.trace(q, pool, pool, table, lengths).lower(
            lowering_platforms=(platform,)).as_text()
    if platform == "tpu":
        assert text.count("tpu_custom_call") == 1 and "paged_flash_attention_kernel" in text
    else:
        assert "triton" in text and "paged_attention" in text
    assert ("sdy.manual_computation" in text) == use_mesh
