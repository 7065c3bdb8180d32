"""Tests for ba_jax.native: the CPU decode-attention kernel against the XLA formulation,
in place cache writes, and the sampler giving the same rollouts with and without it.

The kernel is optional at run time (no C++ compiler -> XLA path), but `make test` builds it,
so these tests fail rather than skip when the build is expected (BA_JAX_REQUIRE_NATIVE=1,
set by nothing but a user who wants to insist; CI builds it through the Makefile)."""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from ba_jax import native, sampler
from ba_jax.models import fused, qwen

pytestmark = pytest.mark.skipif(
    not native.decode_attention_available() and os.environ.get("BA_JAX_REQUIRE_NATIVE") != "1",
    reason="native kernel not built (python -m ba_jax.native build)")


def _xla_reference(q_BNH, k_new, v_new, kc_BKHS, vc_BKSH, mask_BS, index):
    """The same computation as qwen.Attention's cached path, written directly."""
    B, N, H = q_BNH.shape
    K, S = vc_BKSH.shape[1], vc_BKSH.shape[2]
    kc = lax.dynamic_update_slice(kc_BKHS, k_new[:, :, :, None], (0, 0, 0, index))
    vc = lax.dynamic_update_slice(vc_BKSH, v_new[:, :, None], (0, 0, index, 0))
    q = q_BNH.reshape(B, K, N // K, H)
    s = jnp.einsum("BKGH,BKHS->BKGS", q, kc, preferred_element_type=jnp.float32) * H ** -0.5
    ok = (mask_BS.astype(bool) & (jnp.arange(S) <= index))[:, None, None]
    p = jax.nn.softmax(jnp.where(ok, s, qwen._MASKED), -1).astype(kc.dtype)
    o = jnp.einsum("BKGS,BKSH->BKGH", p, vc, preferred_element_type=jnp.float32)
    return o.reshape(B, N, H), kc, vc


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("N, K, H, S, index", [
    (8, 4, 64, 21, 13),    # one partial 16-slot chunk
    (6, 2, 24, 70, 69),    # full chunks + a tail at the end of the cache; 3 heads per group
    (14, 2, 32, 40, 33),   # 7 heads per group (blocks of 4 + 2 + 1)
    (3, 3, 17, 21, 0),     # H not a multiple of 16 (scalar value path); the first slot
])
def test_kernel_matches_xla(dtype, N, K, H, S, index):
    B = 6
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    q, kn, vn = arr(B, N, H), arr(B, K, H), arr(B, K, H)
    kc, vc = arr(B, K, H, S), arr(B, K, S, H)
    mask = rng.random((B, S)) < 0.6
    mask[:, index] = True
    mask[2] = False  # no valid slot at all: both sides average all S slots uniformly
    mask[3, :index] = False  # only the slot being written
    mask[4, index + 1:] = True  # slots after `index` never count, whatever the mask says
    mask = jnp.asarray(mask, jnp.int32)
    want = jax.jit(_xla_reference)(q, kn, vn, kc, vc, mask, index)
    got = jax.jit(native.decode_attention)(q, kn, vn, kc, vc, mask, index)
    for g, w in zip(got[1:], want[1:]):  # the caches: bit-identical writes
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w.astype(jnp.float32))
    atol = 2e-6 if dtype == jnp.float32 else 1e-5  # bf16: p is rounded alike on both sides
    np.testing.assert_allclose(got[0], want[0], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("P, Gs, Tp, S, index", [
    (2, 3, 5, 21, 13),   # prompt segment not a whole 16-slot chunk
    (3, 2, 32, 40, 0),   # whole chunks; only the slot being written of the row's own cache
])
def test_shared_prompt_segment_matches_one_concatenated_cache(dtype, P, Gs, Tp, S, index):
    # rows of one prompt share its keys/values: the same as each row holding a copy of the
    # prompt in front of its own cache (Tp + S slots, written at Tp + index)
    B, N, K, H = P * Gs, 6, 2, 32
    rng = np.random.default_rng(1)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    q, kn, vn = arr(B, N, H), arr(B, K, H), arr(B, K, H)
    kc, vc = arr(B, K, H, S), arr(B, K, S, H)
    kp, vp = arr(P, K, H, Tp), arr(P, K, Tp, H)
    pmask = rng.random((P, Tp)) < 0.7
    pmask[1] = False  # a prompt with no valid slot: its rows attend their own slots only
    mask = rng.random((B, S)) < 0.6
    mask[:, index] = True
    mask[0] = False  # its prompt's slots are all it sees
    if index == 0:
        mask[Gs] = False  # prompt 1 row 0: no slot at all -> uniform over all Tp + S slots
    mask = jnp.asarray(mask, jnp.int32)
    pmask = jnp.asarray(pmask, jnp.int32)
    rep = lambda x: jnp.repeat(x, Gs, axis=0)  # noqa: E731
    want = jax.jit(_xla_reference)(
        q, kn, vn, jnp.concatenate([rep(kp), kc], 3), jnp.concatenate([rep(vp), vc], 2),
        jnp.concatenate([rep(pmask), mask], 1), Tp + index)
    got = jax.jit(native.decode_attention)(q, kn, vn, kc, vc, mask, index, (kp, vp, pmask))
    np.testing.assert_array_equal(np.asarray(got[1], np.float32),
                                  np.asarray(want[1][..., Tp:], np.float32))
    np.testing.assert_array_equal(np.asarray(got[2], np.float32),
                                  np.asarray(want[2][:, :, Tp:], np.float32))
    atol = 2e-6 if dtype == jnp.float32 else 1e-5
    np.testing.assert_allclose(got[0], want[0], atol=atol, rtol=0)


def test_cache_updated_in_place_under_donation():
    B, N, K, S, H = 4, 4, 2, 16, 32
    f = jax.jit(native.decode_attention, donate_argnums=(3, 4))
    kc, vc = jnp.zeros((B, K, H, S)), jnp.zeros((B, K, S, H))
    ptr = kc.unsafe_buffer_pointer()
    ones = jnp.ones((B, K, H))
    for i in range(3):
        _, kc, vc = f(jnp.ones((B, N, H)), ones * (i + 1), ones, kc, vc,
                      jnp.ones((B, S), jnp.int32), i)
    assert kc.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(kc)[:, :, 0, :4], np.broadcast_to([1, 2, 3, 0], (B, K, 4)))
    np.testing.assert_array_equal(np.asarray(vc)[:, :, :4, 0], np.broadcast_to([1, 1, 1, 0], (B, K, 4)))


def test_bad_index_is_an_error():
    with pytest.raises(Exception, match="cache index out of range"):
        z = jnp.zeros((1, 2, 4, 8))  # S = 4, H = 8
        native.decode_attention(jnp.zeros((1, 2, 8)), z[:, :, 0], z[:, :, 0],
                                z.transpose(0, 1, 3, 2), z,
                                jnp.ones((1, 4), jnp.int32), 4).__getitem__(0).block_until_ready()


def test_sampler_same_rollouts_with_and_without_kernel(monkeypatch):
    cfg = qwen.ModelConfig("qwen3", vocab_size=61, hidden_size=32, intermediate_size=48,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=128,
                           use_tied_embeddings=True, use_qkv_bias=False, use_o_bias=False,
                           use_qk_norm=True)
    model = qwen.Qwen(cfg, rngs=nnx.Rngs(3))
    prompts = [[5, 17, 3], [9, 4, 22, 7, 8], [1]]
    kw = dict(num_samples=3, max_new_tokens=12, key=jax.random.key(7), eos_ids=[60])
    assert sampler.use_native_decode(model, None)
    fast = sampler.generate(model, prompts, **kw)
    monkeypatch.setenv("BA_JAX_NO_NATIVE", "1")
    assert not sampler.use_native_decode(model, None)
    slow = sampler.generate(model, prompts, **kw)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_array_equal(fast.mask, slow.mask)
    np.testing.assert_allclose(fast.logprobs, slow.logprobs, atol=2e-6)


# The AMX matrix product needs the processor's AMX-BF16 unit; other machines skip these.
needs_amx = pytest.mark.skipif(not native.matmul_amx_available(),
                               reason="no AMX-BF16 on this processor (or kernel not built)")


@needs_amx
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("M,K,N", [(5, 7, 3), (33, 64, 40), (64, 96, 17), (96, 128, 160),
                                   (48, 70, 33), (130, 70, 33)])
def test_amx_matmul_matches_float64_product(M, K, N, transpose_a, transpose_b):
    """Every padding and packing path (odd sizes, gathers, edge blocks) gives the exact
    products summed in float32; bfloat16 output is that sum rounded once."""
    rng = np.random.default_rng(M * K + N)
    a = jnp.asarray(rng.standard_normal((K, M) if transpose_a else (M, K)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((N, K) if transpose_b else (K, N)), jnp.bfloat16)
    want = np.asarray(a, np.float64).T if transpose_a else np.asarray(a, np.float64)
    want = want @ (np.asarray(b, np.float64).T if transpose_b else np.asarray(b, np.float64))
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    c32 = jax.jit(lambda a, b: native.matmul_amx(a, b, **kw))(a, b)
    c16 = jax.jit(lambda a, b: native.matmul_amx(a, b, out_dtype=jnp.bfloat16, **kw))(a, b)
    assert c32.shape == c16.shape == (M, N) and c32.dtype == jnp.float32
    # float32 summation of K exact products: error within K ulps of the sum of |terms|
    bound = K * 2.0 ** -23 * (np.abs(np.asarray(a, np.float64)).max() *
                              np.abs(np.asarray(b, np.float64)).max() * K)
    np.testing.assert_allclose(np.asarray(c32), want, rtol=0, atol=bound)
    np.testing.assert_array_equal(np.asarray(c16), np.asarray(c32.astype(jnp.bfloat16)))
    # op(b) packed once beforehand: the same tiles, the same sums
    packed = native.pack_amx(b, transpose_b=transpose_b)
    assert (packed.k, packed.n) == (K, N)
    for out_dtype, want_c in ((jnp.float32, c32), (jnp.bfloat16, c16)):
        c = jax.jit(lambda a, p: native.matmul_amx_packed(
            a, p, transpose_a=transpose_a, out_dtype=out_dtype))(a, packed)
        np.testing.assert_array_equal(np.asarray(c), np.asarray(want_c))


@needs_amx
def test_amx_matmul_rejects_bad_operands():
    a = jnp.ones((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="contracted sizes differ"):
        native.matmul_amx(a, jnp.ones((7, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        native.matmul_amx(a.astype(jnp.float32), jnp.ones((8, 3), jnp.bfloat16))
    packed = native.pack_amx(jnp.ones((7, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="contracted sizes differ"):
        native.matmul_amx_packed(a, packed)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        native.pack_amx(jnp.ones((2, 7, 3), jnp.bfloat16))


@needs_amx
@pytest.mark.parametrize("x_shape,w_shape,w_axes", [
    ((4, 128, 48), (48, 3, 16), (0,)),         # Linear [in, out...]
    ((2, 256, 4, 16), (4, 16, 40), (0, 1)),    # o_proj [heads, head_dim, out]
    ((4, 128, 32), (100, 32), (1,)),           # tied embedding [vocab, in]
])
def test_model_projection_on_amx_matches_xla_forward_and_backward(x_shape, w_shape, w_axes):
    """qwen._mm on the kernel (rows >= its threshold) against XLA's dots: value and both
    gradients, with a float32 parameter as in training."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(w_shape) * 0.1, jnp.float32)

    def run(on):
        def loss(x, w):
            with qwen.native_matmul(on):
                y = qwen._mm(x, w, w_axes, jnp.bfloat16).astype(jnp.float32)
            return jnp.sum(y * jnp.cos(y))
        f = jax.jit(jax.value_and_grad(loss, (0, 1)))
        calls = f.lower(x, w).as_text().count("ba_matmul_amx")
        return f(x, w), calls

    ((l1, (dx1, dw1)), calls1), ((l0, (dx0, dw0)), calls0) = run(True), run(False)
    # forward, dx and dw all on the kernel: the backward is traced after the `with` block
    # has closed and must follow the forward's decision
    assert calls1 == 3 and calls0 == 0
    assert dx1.dtype == jnp.bfloat16 and dw1.dtype == jnp.float32
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-3)
    # bf16 outputs may round the other way where the float32 sums differ in the last bits
    np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx0, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(dw0), rtol=2e-2, atol=2e-2 * float(
        jnp.abs(dw0).max()))


def _tiny(family: str, tied: bool) -> qwen.ModelConfig:
    return qwen.ModelConfig(family, vocab_size=97, hidden_size=64, intermediate_size=80,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                            rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=128,
                            use_tied_embeddings=tied, use_qkv_bias=family == "qwen2",
                            use_o_bias=False, use_qk_norm=family == "qwen3")


@needs_amx
@pytest.mark.parametrize("family,tied", [("qwen3", True), ("qwen2", False)])
def test_packed_weights_forward_matches_xla(family, tied):
    """Inside `packed_weights` every projection of a bf16 model (biases, the untied head or
    the tied embedding included) runs on weights packed once; logits match XLA's dots."""
    model = qwen.Qwen(_tiny(family, tied), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (3, 11)), jnp.int32)
    want = jax.jit(lambda t: model(t))(tokens)
    with qwen.native_matmul(True), qwen.packed_weights(model):
        f = jax.jit(lambda t: model(t))
        calls = f.lower(tokens).as_text().count("ba_matmul_amx_packed")
        got = f(tokens)
    assert calls == 2 * 6 + 1  # q, k, v, o, gate+up, down per layer, and the output
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=2e-2 * float(jnp.abs(want).max()))
    # f32 models, and native products switched off, keep XLA's dots
    for m, on in ((qwen.Qwen(_tiny(family, tied), rngs=nnx.Rngs(0)), None), (model, False)):
        with qwen.native_matmul(on), qwen.packed_weights(m):
            assert "ba_matmul_amx" not in jax.jit(lambda t: m(t)).lower(tokens).as_text()


@needs_amx
def test_bf16_sampler_uses_packed_weights_and_agrees_with_xla(monkeypatch):
    """The bf16 sampler packs the weights once per call and decodes on them; against the
    same sampler on XLA's dots (packing switched off) the greedy rollouts agree and the
    first token's log-probs match (bf16 sums in another order may flip a near tie later)."""
    model = qwen.Qwen(_tiny("qwen3", True), rngs=nnx.Rngs(4), dtype=jnp.bfloat16)
    prompts = [[5, 17, 3], [9, 4, 22, 7, 8], [1]]
    kw = dict(num_samples=2, max_new_tokens=10, key=jax.random.key(1), temperature=0.0,
              eos_ids=[96])
    monkeypatch.setattr(sampler, "_JITTED", {})
    traced = {"pack_amx": 0, "matmul_amx_packed": 0}  # calls while tracing the rollout

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            traced[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    for name in traced:
        monkeypatch.setattr(native, name, counting(name, getattr(native, name)))
    packed = sampler.generate(model, prompts, **kw)
    # 13 weights (gate and up as one) packed once; products in the prefill, the last prompt
    # token and the loop
    assert traced == {"pack_amx": 13, "matmul_amx_packed": 3 * 13}
    monkeypatch.setattr(sampler, "_JITTED", {})
    monkeypatch.setattr(qwen, "packed_weights", lambda m, **kw: contextlib.nullcontext())
    plain = sampler.generate(model, prompts, **kw)
    np.testing.assert_allclose(packed.logprobs[:, 0], plain.logprobs[:, 0], atol=2e-2)
    assert (packed.tokens == plain.tokens).mean() >= 0.9


# The training attention kernel needs AVX-512 (F, BW, VL) when the library is compiled.
needs_attention = pytest.mark.skipif(not native.attention_available(),
                                     reason="attention kernel not built with AVX-512")


def _xla_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, sin_BTH, cos_BTH):
    """qwen's XLA attention (RoPE, `_self_attention` with its custom backward) in the
    kernel's layouts."""
    B, T, N, H = q_BTNH.shape
    q_BTNH, k_BSKH = qwen._rope(q_BTNH, sin_BTH, cos_BTH), qwen._rope(k_BSKH, sin_BTH, cos_BTH)
    q_BKGTH = q_BTNH.reshape(B, T, k_BSKH.shape[2], -1, H).transpose(0, 2, 3, 1, 4)
    o_BKGTH = qwen._self_attention(q_BKGTH, k_BSKH.transpose(0, 2, 1, 3),
                                   v_BSKH.transpose(0, 2, 1, 3), mask_BTS)
    return o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


@pytest.fixture(params=["avx512", "amx"])
def attention_path(request):
    """The bf16 attention kernel on its AVX-512 loops or on AMX tiles (attention_amx.cc)."""
    if request.param == "amx" and not native.attention_amx_available():
        pytest.skip("processor without AMX-BF16")
    native.use_amx_attention(request.param == "amx")
    yield request.param
    native.use_amx_attention(True)


@needs_attention
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B,T,N,K,H", [(2, 9, 6, 2, 8), (2, 40, 4, 2, 24), (1, 33, 2, 1, 64),
                                       (1, 70, 4, 4, 128)])
def test_attention_kernel_matches_xla_forward_and_backward(dtype, B, T, N, K, H,
                                                           attention_path):
    """Odd lengths and head dims (padded blocks, several 32-row chunks), GQA, a causal mask
    and a left-padded row whose padding queries see no key (uniform probabilities, no score
    gradient); bf16 on both the AVX-512 and the AMX path (f32 has only the former)."""
    if dtype == jnp.float32 and attention_path == "amx":
        pytest.skip("the AMX path is bf16 only")
    ks = jax.random.split(jax.random.key(B * T + H), 4)
    q, do = (jax.random.normal(r, (B, T, N, H), dtype) for r in (ks[0], ks[3]))
    k, v = (jax.random.normal(r, (B, T, K, H), dtype) for r in (ks[1], ks[2]))
    valid_BT = jnp.arange(T)[None] >= jnp.array([[0], [4]])[:B]
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BT[:, None, :]
    positions = jnp.maximum(jnp.cumsum(valid_BT, axis=1) - 1, 0)
    sin, cos = qwen._rope_tables(positions, H, 1e4)
    want, vjp = jax.vjp(lambda q, k, v: _xla_attention(q, k, v, mask, sin, cos), q, k, v)
    o32 = jax.jit(native.attention)(q, k, v, mask, sin, cos)
    got = jax.jit(native.attention_grad)(q, k, v, mask, sin, cos, o32, do)
    # float32: the same sums in another order; bfloat16: the same roundings, so results
    # agree but for the rare value whose float32 sum rounds the other way
    tol = 2e-6 if dtype == jnp.float32 else 4e-3
    pairs = [(o32.astype(dtype), want), *zip(got, vjp(do))]
    for a, b in pairs:
        a, b = np.asarray(a.astype(dtype), np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


@needs_attention
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_kernel_random_mask_matches_xla(dtype, attention_path):
    """A mask with holes everywhere (live 16-slot blocks next to dead ones, 32-slot chunks
    with one live half, rows with one slot, a row with none among live rows)."""
    if dtype == jnp.float32 and attention_path == "amx":
        pytest.skip("the AMX path is bf16 only")
    B, T, N, K, H = 2, 75, 4, 2, 32
    ks = jax.random.split(jax.random.key(7), 5)
    q, do = (jax.random.normal(r, (B, T, N, H), dtype) for r in (ks[0], ks[3]))
    k, v = (jax.random.normal(r, (B, T, K, H), dtype) for r in (ks[1], ks[2]))
    mask = jax.random.uniform(ks[4], (B, T, T)) < 0.15
    mask = mask.at[:, :, 16:48].set(False)  # dead blocks: the 2nd half of a 32-slot chunk
    #                                         and the 1st half of the next, for all rows
    mask = mask.at[0, 40].set(False).at[1, 5].set(False)        # rows with no slot
    mask = mask.at[0, 41].set(False).at[0, 41, 70].set(True)    # a row with one slot
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    sin, cos = qwen._rope_tables(positions, H, 1e4)
    want, vjp = jax.vjp(lambda q, k, v: _xla_attention(q, k, v, mask, sin, cos), q, k, v)
    o32 = jax.jit(native.attention)(q, k, v, mask, sin, cos)
    got = jax.jit(native.attention_grad)(q, k, v, mask, sin, cos, o32, do)
    tol = 2e-6 if dtype == jnp.float32 else 4e-3
    for a, b in [(o32.astype(dtype), want), *zip(got, vjp(do))]:
        a, b = np.asarray(a.astype(dtype), np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def _assert_elementwise_close(a, b, dtype):
    """A fused kernel's result against XLA's. float32: exp, division and square root differ
    from XLA's in the last bit; bfloat16: the same roundings, so equal but for a float32
    value that rounds the other way."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert np.mean(a != b) < 1e-3
        np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-30)


@needs_attention
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 3000 + 7)])
def test_swiglu_kernel_matches_xla_forward_and_backward(dtype, shape):
    """gu = [g, u] [..., 2F]: rows shorter than a vector and with tails, several work units;
    values where sigmoid saturates."""
    ks = jax.random.split(jax.random.key(shape[-1]), 3)
    g = (jax.random.normal(ks[0], shape) * 8).at[..., :4].set(
        jnp.array([-100.0, -90.0, 90.0, 0.0]))
    gu = jnp.concatenate([g, jax.random.normal(ks[1], shape)], axis=-1).astype(dtype)
    dh = jax.random.normal(ks[2], shape, dtype)
    want, vjp = jax.vjp(lambda gu: fused.swiglu(gu, False), gu)
    got = jax.jit(native.swiglu)(gu)
    got_grad = jax.jit(native.swiglu_grad)(gu, dh)
    assert got.dtype == got_grad.dtype == dtype and got.shape == shape
    for a, b in [(got, want), (got_grad, vjp(dh)[0])]:
        _assert_elementwise_close(a, b, dtype)


@needs_attention
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37), (2, 300, 64), (70, 512)])
def test_rms_norm_kernel_matches_xla_forward_and_backward(dtype, shape):
    """Rows shorter than a vector and with a tail, several work units (the scale gradient
    summed over their partial sums), a zero row (eps only)."""
    ks = jax.random.split(jax.random.key(shape[-1]), 3)
    x = (jax.random.normal(ks[0], shape) * 3).at[0].set(0.0).astype(dtype)
    scale = 1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:])
    dy = jax.random.normal(ks[2], shape, dtype)
    norm = qwen.RMSNorm(shape[-1], eps=1e-6, dtype=dtype, param_dtype=jnp.float32)
    norm.scale[...] = scale

    def xla(x, scale):
        with qwen.native_matmul(False):
            return nnx.merge(nnx.graphdef(norm), nnx.State({"scale": nnx.Param(scale)}))(x)

    want, vjp = jax.vjp(xla, x, scale)
    got = jax.jit(functools.partial(native.rms_norm, eps=1e-6))(x, scale)
    dx, dscale = jax.jit(functools.partial(native.rms_norm_grad, eps=1e-6))(x, scale, dy)
    want_dx, want_dscale = vjp(dy)
    assert got.dtype == dx.dtype == dtype and dscale.dtype == jnp.float32
    np.testing.assert_allclose(dscale, want_dscale, rtol=1e-5, atol=1e-5)
    for a, b in [(got, want), (dx, want_dx)]:
        _assert_elementwise_close(a, b, dtype)


def test_swiglu_rejects_mismatched_operands():
    if not native.attention_available():
        pytest.skip("kernel not built with AVX-512")
    with pytest.raises(ValueError, match=r"\[..., 2F\]"):
        native.swiglu(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"dh bfloat16\(2, 2\)"):
        native.swiglu_grad(jnp.ones((2, 4)), jnp.ones((2, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"dh float32\(2, 4\)"):
        native.swiglu_grad(jnp.ones((2, 4)), jnp.ones((2, 4)))


@needs_attention
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_with_native_attention_matches_xla(dtype):
    """The model's training forward and its parameter gradients, with the kernel (and AMX
    products where available) against XLA only, on a padded batch."""
    model = qwen.Qwen(_tiny("qwen3", True), rngs=nnx.Rngs(2), dtype=dtype)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 13)), jnp.int32)
    valid = jnp.arange(13)[None] >= jnp.array([[0], [3]])

    def run(on):
        def loss(params):
            with qwen.native_matmul(on):
                logits = nnx.merge(graphdef, params)(tokens, attn_mask_BT=valid)
            return jnp.mean(jnp.where(valid[..., None], logits, 0.0) ** 2)
        f = jax.jit(jax.value_and_grad(loss))
        text = f.lower(params).as_text()
        return f(params), tuple(text.count(f"ba_{k}") for k in ("attention", "swiglu",
                                                                   "rms_norm"))

    ((l1, g1), calls1), ((l0, g0), calls0) = run(True), run(False)
    # forward and backward of each layer's attention, SwiGLU and four norms (input,
    # post-attention, q, k), and of the final norm
    assert calls1 == (2 * 2, 2 * 2, 2 * (2 * 4 + 1)) and calls0 == (0, 0, 0)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(float(l1), float(l0), rtol=tol)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=tol * float(jnp.abs(b).max()))
