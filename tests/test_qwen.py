"""Qwen model behaviour: padding, cached decoding against a shared prompt cache, the scanned
layers, the custom matmul backward, remat policies, presets."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import needs_torch
from transformers import Qwen2Config, Qwen3Config

import os
import sys

from ba_jax.engine import paging
from ba_jax.models import attention, layers, qwen
from ba_jax.models.convert_hf import hf_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import static_sampler  # noqa: E402  (the dense-cache decode mode lives with its sampler)

TINY = qwen.ModelConfig("qwen3", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                        rms_norm_eps=1e-6, max_position_embeddings=128,
                        use_tied_embeddings=False, use_qkv_bias=True, use_o_bias=True,
                        use_qk_norm=True)


_fwd = jax.jit(lambda m, *args: m(*args))  # eager dispatch is far slower than one compile


@pytest.fixture(scope="module")
def model():
    return qwen.Qwen(TINY, rngs=nnx.Rngs(0))


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, TINY.vocab_size, shape))


def test_shapes_and_hf_names(model):
    logits = _fwd(model, _tokens((2, 5)))
    assert logits.shape == (2, 5, 97) and logits.dtype == jnp.float32
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for name in ["embed_tokens.embedding", "layers.self_attn.q_proj.kernel",
                 "layers.self_attn.q_norm.scale", "layers.mlp.gate_proj.kernel",
                 "layers.input_layernorm.scale", "layers.post_attention_layernorm.scale",
                 "norm.scale", "lm_head.kernel", "layers.self_attn.o_proj.bias"]:
        assert name in names


@pytest.mark.parametrize("sl", [slice(None, -1), slice(3, None), slice(2, 5)])
def test_logits_slice_equals_slicing_all_logits(model, sl):
    tokens_BT, mask_BT = _tokens((2, 7)), jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    full = _fwd(model, tokens_BT, None, mask_BT)
    part = jax.jit(lambda m, t, a: m(t, None, a, logits_slice=sl))(model, tokens_BT, mask_BT)
    assert part.shape == full[:, sl].shape
    np.testing.assert_allclose(part, full[:, sl], atol=1e-6)


def test_padded_rows_get_their_unpadded_logits(model):
    T = 7
    rows = [np.asarray(_tokens((1, n), seed=i))[0] for i, n in enumerate([7, 3])]
    # rows 0-1 left-padded, rows 2-3 right-padded
    tokens_BT = np.zeros((4, T), np.int32)
    mask_BT = np.zeros((4, T), np.int32)
    for b in range(4):
        row = rows[b % 2]
        sl = slice(T - len(row), T) if b < 2 else slice(0, len(row))
        tokens_BT[b, sl] = row
        mask_BT[b, sl] = 1
    pos_BT = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0)
    explicit = _fwd(model, jnp.asarray(tokens_BT), jnp.asarray(pos_BT), jnp.asarray(mask_BT))
    default_pos = _fwd(model, jnp.asarray(tokens_BT), None, jnp.asarray(mask_BT))
    for b in range(4):
        alone = _fwd(model, jnp.asarray(rows[b % 2][None]))[0]
        np.testing.assert_allclose(np.asarray(explicit[b])[mask_BT[b] == 1], alone, atol=1e-5)
        np.testing.assert_allclose(np.asarray(default_pos[b])[mask_BT[b] == 1], alone,
                                   atol=1e-5)
    assert np.isfinite(np.asarray(explicit)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cached_decoding_equals_full_forward(model, dtype):
    """Prefill of P prompts, then G rows per prompt decoding one token at a time against the
    shared prompt cache and their own slots (the static sampler's cache mode, through the
    model's one forward path), equals the full forward of [prompt | tokens]."""
    P, G, Tp, new, S = 2, 2, 5, 4, 6
    m = model if dtype == jnp.float32 else qwen.Qwen(TINY, rngs=nnx.Rngs(0), dtype=dtype)
    prompt_PT = np.asarray(_tokens((P, Tp), seed=3))
    pmask_PT = np.ones((P, Tp), np.int32)
    pmask_PT[1, :2] = 0  # prompt 1 is a left-padded 3-token prompt
    B = P * G
    cont_BN = np.asarray(_tokens((B, new), seed=4))
    full_BT = np.concatenate([np.repeat(prompt_PT, G, 0), cont_BN], axis=1)
    full_mask_BT = np.concatenate([np.repeat(pmask_PT, G, 0), np.ones((B, new), np.int32)], 1)
    ref_BTV = np.asarray(_fwd(m, jnp.asarray(full_BT), None, jnp.asarray(full_mask_BT)))
    pos_PT = np.maximum(np.cumsum(pmask_PT, axis=1) - 1, 0)
    logits_PTV, kv = jax.jit(lambda m, t, p, a: (lambda x, kv: (m.logits(x), kv))(
        *m.forward(t, p, m.full(a, keep_kv=True))))(
        m, jnp.asarray(prompt_PT), jnp.asarray(pos_PT), jnp.asarray(pmask_PT))
    prompt_cache = static_sampler.KVCache(*kv)
    assert prompt_cache.k_LBSKH.shape == (2, P, Tp, 2, 16)
    assert prompt_cache.k_LBSKH.dtype == dtype

    @jax.jit
    def step(m, tok_B, pos_B, cache, filled_BS, prompt_cache, pmask_PT):
        mode = static_sampler.DenseDecode(cache, filled_BS, prompt_cache, pmask_PT.astype(bool))
        x_B1D, (k_LBKH, v_LBKH) = m.forward(tok_B[:, None], pos_B[:, None], mode)
        return m.logits(x_B1D)[:, 0], k_LBKH, v_LBKH

    cache = static_sampler.init_cache(TINY, B, S, dtype)
    len_B = np.repeat(pmask_PT.sum(1), G)
    out = []
    for t in range(new):
        filled_BS = np.broadcast_to(np.arange(S) < t, (B, S))
        logits_BV, k_LBKH, v_LBKH = step(m, jnp.asarray(cont_BN[:, t]), jnp.asarray(len_B + t),
                                         cache, jnp.asarray(filled_BS), prompt_cache,
                                         jnp.asarray(pmask_PT))
        cache = cache.write(k_LBKH, v_LBKH, t)
        out.append(np.asarray(logits_BV))
    got_BNV = np.stack(out, axis=1)
    atol = 1e-5 if dtype == jnp.float32 else 0.05 * np.abs(ref_BTV).max()
    np.testing.assert_allclose(got_BNV, ref_BTV[:, Tp:], atol=atol)
    # the prefill's logits are the full forward's on the prompt's real positions
    real = pmask_PT == 1
    np.testing.assert_allclose(np.asarray(logits_PTV)[real], ref_BTV[::G, :Tp][real], atol=atol)


def test_chunked_paged_prefill_and_paged_decode_equal_full_forward(model):
    """Two prompts of 11 and 6 tokens prefilled 4 tokens at a time into pages of 3 slots
    (`paging.PagedChunk`: each chunk over the pages its earlier chunks wrote), then two
    tokens decoded per row over those pages (`paging.PagedDecode`, the gather path: it writes
    every layer's keys after its layer scan), all through the model's one forward path,
    equal one full forward: the logits of every position and the keys/values in the pages."""
    n_B, C, ps, new = np.array([11, 6]), 4, 3, 2
    B, T = 2, 11 + new
    tok_BT = np.asarray(_tokens((B, T), seed=5))
    ones_BT = jnp.ones((B, T), bool)
    ref_x, (ref_k, ref_v) = jax.jit(lambda m, t: m.forward(t, qwen.default_positions(ones_BT),
                                                           m.full(ones_BT, keep_kv=True)))(
        model, jnp.asarray(tok_BT))
    ref_BTV = np.asarray(jax.jit(lambda m, x: m.logits(x))(model, ref_x))
    NP = 16
    table_BQ = np.array([[3, 0, 7, 12, 5], [9, 1, 14, 2, 16]])  # 16 = NP: no page
    pool = paging.PagePool.zeros(TINY, NP, ps, jnp.float32)

    @jax.jit
    def chunk(m, tok_BC, valid_BC, pool, table_BQ, start_B):
        mode = paging.chunk_cache(pool, table_BQ, start_B, valid_BC, num_layers=L)
        return m.forward(tok_BC, start_B[:, None] + jnp.arange(tok_BC.shape[1]), mode)

    @jax.jit
    def step(m, tok_B, pos_B, pool, table_BX, lengths_B, page_B, offset_B):
        mode = paging.decode_cache(pool, table_BX, lengths_B, page_B, offset_B, config=m.config,
                                   dtype=m.dtype)
        x_B1D, pool = m.forward(tok_B[:, None], pos_B[:, None], mode)
        return m.logits(x_B1D)[:, 0], pool

    L = TINY.num_layers
    for start in range(0, 11, C):
        valid_BC = start + np.arange(C)[None] < n_B[:, None]
        x_BCD, pool = chunk(model, jnp.asarray(tok_BT[:, start:start + C]), jnp.asarray(valid_BC),
                            pool, jnp.asarray(table_BQ), jnp.full((B,), start, jnp.int32))
        got_BCV = np.asarray(jax.jit(lambda m, x: m.logits(x))(model, x_BCD))
        for b in range(B):
            k = int(valid_BC[b].sum())
            np.testing.assert_allclose(got_BCV[b, :k], ref_BTV[b, start:start + k], atol=1e-5)
    for t in range(new):
        pos_B = n_B + t  # row 1 continues its 6-token prompt with tokens 6, 7 of its row
        logits_BV, pool = step(model, jnp.asarray(tok_BT[np.arange(B), pos_B]),
                               jnp.asarray(pos_B), pool, jnp.asarray(table_BQ),
                               jnp.asarray(pos_B + 1), jnp.asarray(table_BQ[np.arange(B),
                                                                            pos_B // ps]),
                               jnp.asarray(pos_B % ps))
        np.testing.assert_allclose(np.asarray(logits_BV), ref_BTV[np.arange(B), pos_B],
                                   atol=1e-5)
    for b in range(B):
        for j in range(n_B[b] + new):
            p, o = table_BQ[b, j // ps], j % ps
            for side, ref in ((pool.k, ref_k), (pool.v, ref_v)):
                got_LKH = np.asarray(side)[:, np.arange(L) * NP + p, o].swapaxes(0, 1)
                np.testing.assert_allclose(got_LKH, np.asarray(ref)[:, b, j], atol=1e-5)


def _unrolled_logits(m: qwen.Qwen, tokens_BT):
    """The reference the scan must equal: each layer's parameters sliced out of the stack and
    applied one after the other in a Python loop."""
    B, T = tokens_BT.shape
    graphdef, state = nnx.split(m.layers)
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    rope_BTH = layers.rope_tables(pos_BT, m.config.head_dim, m.config.rope_theta)
    x = m._embed(tokens_BT)
    valid_BT = jnp.ones((B, T), bool)

    def attend(q, k, v):
        return attention.attention(q, k, v, valid_BT, impl="xla"), None

    for i in range(m.config.num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        x, _ = layer(x, rope_BTH, attend)
    return m.logits(x)


def test_scanned_layers_equal_unrolled_loop(model):
    tokens = _tokens((2, 7), seed=8)
    scanned = _fwd(model, tokens)
    unrolled = jax.jit(_unrolled_logits)(model, tokens)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-6)
    # scan_unroll=2 runs both layers in one iteration: same logits
    model.config = dataclasses.replace(TINY, scan_unroll=2)
    try:
        np.testing.assert_allclose(jax.jit(lambda m, t: m(t))(model, tokens), unrolled,
                                   atol=1e-6)
    finally:
        model.config = TINY
    # and one layer's parameters are really [L, ...]
    assert model.layers.mlp.up_proj.kernel[...].shape == (2, 48, 80)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape, w_shape, w_axes", [
    ((2, 3, 5), (5, 4, 6), (0,)),     # q_proj-like
    ((2, 3, 4, 6), (4, 6, 5), (0, 1)),  # o_proj-like
    ((2, 3, 5), (7, 5), (1,)),         # tied embedding as output projection
    ((2, 3, 5), (4, 5, 6), (1,)),      # contracted axis in the middle (generic path)
    ((4, 64, 48), (48, 40), (0,)),
    ((4, 64, 48), (96, 48), (1,)),
])
def test_mm_custom_backward_matches_autodiff(x_shape, w_shape, w_axes, dtype):
    # bf16: the custom backward (bf16 x bf16 -> f32 dots) against float32 autodiff of the
    # same bf16-rounded inputs
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    # the weight is a float32 parameter (bf16-representable values) cast inside `_mm`
    x = jax.random.normal(kx, x_shape, dtype)
    w = jax.random.normal(kw, w_shape, dtype).astype(jnp.float32)
    n = len(w_axes)
    ref = lambda x, w: jnp.tensordot(x, w, (list(range(x.ndim - n, x.ndim)), list(w_axes)))
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jax.jit(layers.mm, static_argnums=2)(x, w, w_axes)
    assert y.dtype == jnp.float32
    g = jax.random.normal(kg, y.shape).astype(dtype).astype(jnp.float32)
    np.testing.assert_allclose(y, ref(x32, w32), rtol=1e-5, atol=1e-5)
    got = jax.jit(lambda x, w, g: jax.vjp(lambda x, w: layers.mm(x, w, w_axes), x, w)[1](g))(
        x, w, g)
    want = jax.vjp(ref, x32, w32)[1](g)
    # bf16: dx is rounded to bf16; dw leaves the float32 accumulator unrounded
    tols = (1e-5 if dtype == jnp.float32 else 1e-2, 1e-5)
    for a, b, want_dtype, tol in zip(got, want, (dtype, jnp.float32), tols):
        assert a.shape == b.shape and a.dtype == want_dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=tol,
                                   atol=tol * np.abs(b).max())


@pytest.mark.parametrize("remat", [r for r in qwen.REMAT_POLICIES if r != "none"])
def test_remat_same_gradients(model, remat):
    tokens = _tokens((2, 6), seed=5)
    rematted = qwen.Qwen(dataclasses.replace(TINY, remat=remat), rngs=nnx.Rngs(0))

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])

    g1 = jax.jit(nnx.grad(loss))(model)
    grad = jax.jit(nnx.grad(loss))
    g2 = grad(rematted)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the policy is really in the program: the backward recomputes inside the scanned layer
    assert "remat" in str(jax.make_jaxpr(grad)(rematted))


def test_bad_runtime_options_are_named():
    with pytest.raises(ValueError, match="model.attention='flash'"):
        dataclasses.replace(TINY, attention="flash")
    with pytest.raises(ValueError, match="model.remat='some'"):
        dataclasses.replace(TINY, remat="some")
    with pytest.raises(ValueError, match="model.scan_unroll=0"):
        dataclasses.replace(TINY, scan_unroll=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mlp_gradients_match_plain_formula(dtype):
    """Each MLP kernel's gradient (through `_mm`'s own backward) against silu(x Wg) * (x Wu) Wd
    written out, in float32."""
    mlp = layers.MLP(TINY.hidden_size, TINY.intermediate_size, rngs=nnx.Rngs(3), dtype=dtype, param_dtype=jnp.float32)
    x = jnp.asarray(np.random.RandomState(4).randn(2, 300, TINY.hidden_size), jnp.float32)
    dy = jnp.asarray(np.random.RandomState(5).randn(2, 300, TINY.hidden_size), jnp.float32)

    def loss(m):
        return jnp.sum(m(x.astype(dtype)).astype(jnp.float32) * dy)

    def plain(wg, wu, wd):
        return jnp.sum((jax.nn.silu(x @ wg) * (x @ wu)) @ wd * dy)

    got = jax.jit(nnx.grad(loss))(mlp)
    want = jax.grad(plain, (0, 1, 2))(mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...],
                                      mlp.down_proj.kernel[...])
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    for name, w in zip(("gate_proj", "up_proj", "down_proj"), want):
        g = getattr(got, name).kernel[...]
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=0, atol=tol * float(jnp.abs(w).max()),
                                   err_msg=name)


def test_bf16_forward_close_to_f32(model):
    tokens = _tokens((2, 6), seed=6)
    bf = qwen.Qwen(TINY, rngs=nnx.Rngs(1), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    nnx.update(bf, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    ref = np.asarray(_fwd(model, tokens))
    out = _fwd(bf, tokens)
    assert out.dtype == jnp.float32
    assert bf.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(out, ref, atol=0.05 * np.abs(ref).max())


def test_bf16_gradients_of_tied_model_track_f32():
    # tied output projection: its weight gradient is produced [out, in] directly
    cfg = dataclasses.replace(TINY, use_tied_embeddings=True)
    f32 = qwen.Qwen(cfg, rngs=nnx.Rngs(0))
    bf = qwen.Qwen(cfg, rngs=nnx.Rngs(1), dtype=jnp.bfloat16)
    nnx.update(bf, nnx.state(f32, nnx.Param))
    tokens = _tokens((2, 6), seed=7)

    def loss(m):
        return -jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])

    g32 = jax.jit(nnx.grad(loss))(f32)
    g16 = jax.jit(nnx.grad(loss))(bf)
    for path, a in nnx.to_flat_state(g32):
        b = dict(nnx.to_flat_state(g16))[path]
        assert b[...].dtype == jnp.float32  # gradients in the param dtype
        scale = np.abs(np.asarray(a[...])).max()
        np.testing.assert_allclose(b[...], a[...], atol=0.1 * scale, err_msg=str(path))


# Totals from the model cards (billions of parameters), an independent check of the presets.
PUBLISHED_B = {"Qwen2.5-0.5B": 0.49, "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.61,
               "Qwen2.5-Math-1.5B": 1.54, "Qwen2.5-Math-7B": 7.61, "Qwen3-0.6B": 0.6,
               "Qwen3-1.7B": 1.7, "Qwen3-4B": 4.0, "Qwen3-8B": 8.2}


def _param_count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: qwen.Qwen(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name", list(qwen.PRESETS))
def test_preset_parameter_count_matches_the_model_card(name):
    cfg = qwen.PRESETS[name]
    n_ours = _param_count(cfg)
    assert abs(n_ours / 1e9 - PUBLISHED_B[name]) / PUBLISHED_B[name] < 0.02
    hf = hf_config(cfg, jnp.bfloat16)
    assert qwen.ModelConfig.from_hf_config(hf) == cfg  # config.json round trip


@pytest.mark.parametrize("name", list(qwen.PRESETS))
def test_preset_parameter_count_matches_transformers(name):
    torch = needs_torch()
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    cfg = qwen.PRESETS[name]
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[cfg.arch]
    with torch.device("meta"):
        hf_model = model_cls(config_cls(**hf_config(cfg, jnp.bfloat16)))
    assert _param_count(cfg) == sum(p.numel() for p in hf_model.parameters())
