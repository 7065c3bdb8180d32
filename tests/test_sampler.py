"""Tests for ba_jax.sampler: HF greedy parity, log-prob recomputation, the sampling
distributions, EOS handling, determinism, the shared prefill and the compile cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import os
import sys

from ba_jax import grpo, rollout, sampler, sampling
from ba_jax.engine import loop as engine_loop
from ba_jax.models import convert_hf, qwen
from ba_jax.sharding import make_mesh
from helpers_hf import make_tiny_hf, needs_torch

# the static sampler is the engine's benchmark baseline (benchmarks/static_sampler.py): its
# correctness is what makes the benchmark's ratios mean something
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import static_sampler  # noqa: E402

PROMPTS = [[5, 17, 3], [9, 4, 22, 61, 7, 80, 12, 33, 41], list(range(30, 50))]  # buckets 16, 32


_MODELS: dict[str, tuple[str, qwen.Qwen]] = {}


def _tiny(arch: str, tmp_path_factory) -> tuple[str, qwen.Qwen]:
    """(HF folder, converted ba_jax model), built once per architecture; qwen2 is untied."""
    if arch not in _MODELS:
        path = make_tiny_hf(tmp_path_factory.mktemp(arch), arch=arch, tie=arch == "qwen3", seed=1)
        _MODELS[arch] = path, convert_hf.load_hf(path, dtype=jnp.float32)
    return _MODELS[arch]


@pytest.fixture(params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture
def tiny3(tmp_path_factory):
    return _tiny("qwen3", tmp_path_factory)


# One setting shared by several tests, so they reuse one compiled rollout.
SAMPLE_KW = dict(num_samples=3, max_new_tokens=10, temperature=0.5, eos_ids=[2, 7])
GREEDY_KW = dict(num_samples=4, max_new_tokens=12, temperature=0.0, pad_id=0)  # 12 rows


def _hf_greedy(path: str, prompts, max_new_tokens: int, eos: int, pad: int) -> np.ndarray:
    """transformers' greedy tokens (the test calling it is skipped without torch)."""
    torch = needs_torch()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    new = out[:, width:].numpy()
    # HF stops once every row is done; the sampler always returns max_new_tokens columns.
    return np.pad(new, ((0, 0), (0, max_new_tokens - new.shape[1])), constant_values=pad)


# `generate` runs the rollout engine; `generate_static` the static batch (its baseline)
GENERATORS = pytest.mark.parametrize("generate", [sampler.generate,
                                                 static_sampler.generate_static],
                                     ids=["engine", "static"])


@GENERATORS
def test_greedy_matches_transformers(tiny, generate):
    path, model = tiny
    M = 12
    # An EOS the random model does emit, so some rows stop early; find it from HF's output.
    free = _hf_greedy(path, PROMPTS, M, eos=127, pad=0)
    eos = int(free[1, 4])
    want = _hf_greedy(path, PROMPTS, M, eos=eos, pad=0)
    ro = generate(model, PROMPTS, key=jax.random.key(0), eos_ids=[eos], **GREEDY_KW)
    np.testing.assert_array_equal(ro.tokens, np.repeat(want, 4, axis=0))
    assert ro.finish_reason[4] == "eos" and ro.lengths[4] <= 5
    np.testing.assert_array_equal(ro.group_ids, np.repeat([0, 1, 2], 4))


@nnx.jit
def _forward(model, tokens_BT, mask_BT):
    return model(tokens_BT, None, mask_BT)


@GENERATORS
def test_logprobs_equal_full_forward_recomputation(tiny, generate):
    _, model = tiny
    ro = generate(model, PROMPTS[:2], key=jax.random.key(3), **SAMPLE_KW)
    m = ro.mask.astype(bool)
    assert m.sum() > 20
    # The trainer's own function: old_logp as the update recomputes it.
    graphdef, params = nnx.split(model)
    batch = dict(prompt_tokens_BT=ro.prompt_tokens, prompt_mask_BT=ro.prompt_mask,
                 tokens_BR=ro.tokens)
    old_logp_BR, _ = jax.jit(grpo.policy_logprobs, static_argnums=0)(graphdef, params, batch)
    np.testing.assert_allclose(ro.logprobs[m], np.asarray(old_logp_BR)[m], atol=1e-5, rtol=0)
    # and under the sampling temperature, from the full forward's logits
    logits_BTV = _forward(model, np.concatenate([ro.prompt_tokens, ro.tokens], 1),
                          np.concatenate([ro.prompt_mask, ro.mask], 1))
    logits_BMV = logits_BTV[:, ro.prompt_tokens.shape[1] - 1:-1]
    for temperature, got in ((1.0, ro.logprobs), (0.5, ro.sampling_logprobs)):
        logp_BMV = np.asarray(jax.nn.log_softmax(logits_BMV / temperature, -1))
        want = np.take_along_axis(logp_BMV, ro.tokens[..., None], -1)[..., 0]
        np.testing.assert_allclose(got[m], want[m], atol=1e-5, rtol=0)
    assert not ro.logprobs[~m].any() and not ro.sampling_logprobs[~m].any()
    np.testing.assert_array_equal(ro.lengths, ro.mask.sum(1))


# ----------------------------------------------------------------------------- distributions


def _expected(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Sampling distribution from the definitions, by sorting (independent of the sampler)."""
    z = logits_V.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    keep[order[: top_k or len(p)]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    sorted_q = q[order]
    before = np.cumsum(sorted_q) - sorted_q  # mass of the more likely tokens
    keep[order[before >= top_p]] = False
    q = np.where(keep, q, 0.0)
    return q / q.sum()


CASES = [  # (vocab, temperature, top_k, top_p)
    (6, 1.0, 0, 1.0),
    (6, 0.5, 0, 1.0),
    (6, 2.0, 3, 1.0),
    (6, 1.0, 0, 0.8),
    (6, 1.5, 5, 0.7),
    (300, 1.0, 0, 1.0),  # several blocks of the two-level draw, with zero padding
    (300, 0.8, 0, 0.9),
]


@pytest.mark.parametrize("V,temperature,top_k,top_p", CASES)
def test_sampling_distribution(V, temperature, top_k, top_p):
    rng = np.random.default_rng(V)
    logits_V = (rng.normal(size=V) * (1.0 if V < 10 else 2.0)).astype(np.float32)
    q = _expected(logits_V, temperature, top_k, top_p)
    n = 60_000
    cfg = sampling.SamplingConfig(temperature, top_k, top_p)
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V), (n, V))
    tok, logp, slogp = jax.jit(sampling.sample_logits, static_argnums=2)(
        logits_BV, jax.random.key(11), cfg)
    tok = np.asarray(tok)
    counts = np.bincount(tok, minlength=V)
    assert counts[q == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    # log-probs: exact per draw, under the model (T=1) and under the sampling distribution.
    np.testing.assert_allclose(np.asarray(slogp), np.log(q[tok]), atol=1e-5)
    ref = logits_V - np.log(np.exp(logits_V.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(logp), ref[tok], atol=1e-5)
    # Chi-square goodness of fit on the kept tokens, rare ones pooled so every bin expects
    # >= 5 draws. Fixed seed: deterministic; over random seeds a correct sampler would fail
    # this with probability 1e-6 (the p-value threshold) per case.
    exp = n * q[q > 0]
    obs = counts[q > 0]
    rare = exp < 5
    if rare.any():
        exp = np.append(exp[~rare], exp[rare].sum())
        obs = np.append(obs[~rare], obs[rare].sum())
    if len(exp) > 1:
        assert stats.chisquare(obs, exp).pvalue > 1e-6


def test_greedy_takes_first_maximum():
    logits_BV = jnp.array([[0.0, 3.0, 3.0, 1.0], [2.0, -1.0, 0.5, 2.0]])
    tok, logp, slogp = jax.jit(sampling.sample_logits, static_argnums=2)(
        logits_BV, jax.random.key(0), sampling.SamplingConfig(0.0))
    np.testing.assert_array_equal(tok, [1, 0])
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits_BV)[jnp.arange(2), tok], atol=1e-6)
    assert not np.asarray(slogp).any()


def test_prompt_buckets():
    assert [rollout.prompt_bucket(n) for n in (1, 16, 17, 100, 512, 513, 1500)] == [
        16, 16, 32, 128, 512, 1024, 1536]
    toks, mask = rollout.left_pad([[7, 8], [9]], 4, 0)
    np.testing.assert_array_equal(toks, [[0, 0, 7, 8], [0, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])


# ----------------------------------------------------------------------------- the loop

CALLS: list[tuple] = []  # (kind, shapes) of every model call, at trace time


class Bigram(nnx.Module):
    """Stand-in model: the next-token logits depend only on the current token."""

    def __init__(self, table_VV: np.ndarray):
        V = table_VV.shape[0]
        self.table = nnx.Param(jnp.asarray(table_VV, jnp.float32))
        self.config = qwen.ModelConfig(
            arch="qwen3", vocab_size=V, hidden_size=8, intermediate_size=8, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=2, rope_theta=1e4, rms_norm_eps=1e-6,
            max_position_embeddings=64, use_tied_embeddings=True, use_qkv_bias=False,
            use_o_bias=False, use_qk_norm=False)
        self.dtype = jnp.float32

    def full(self, valid_BT, *, keep_kv=False):
        return qwen.FullAttention(valid_BT.astype(bool), "xla", keep_kv)

    def forward(self, tokens_BT, positions_BT, cache):
        """The model's one forward path with a one-layer attention whose output is unused:
        the cache mode sees zero queries/keys of its shapes; the "hidden states" are the
        next-token logits (`logits` is the identity)."""
        CALLS.append((type(cache).__name__, tokens_BT.shape,
                      *(c.k_LBSKH.shape[1] for c in (getattr(cache, "cache", None),
                                                      getattr(cache, "prompt", None)) if c)))
        B, T = tokens_BT.shape
        z = jnp.zeros((B, T, 1, 2))
        xs_l = jax.tree.map(lambda a: a[0], cache.layer_xs(1))
        _, state, ys = cache.attend(z, z, z, xs_l, cache.init())
        return self.table[...][tokens_BT], cache.finish(state, jax.tree.map(lambda a: a[None],
                                                                             ys))

    def logits(self, x_BTV):
        return x_BTV


def _chain_model(V: int = 10) -> Bigram:
    # Greedy chains: 1->2->3->4, 5->6->7, 8->9->8->9...
    nxt = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8, 8: 9, 9: 8, 0: 1}
    table = np.full((V, V), -5.0, np.float32)
    for a, b in nxt.items():
        table[a, b] = 5.0
    return Bigram(table)


@GENERATORS
def test_eos_stops_row_and_masks_after_it(generate):
    model = _chain_model()
    ro = generate(model, [[1], [0, 5], [8]], num_samples=1, max_new_tokens=6,
                  key=jax.random.key(0), temperature=0.0, eos_ids=[4, 7], pad_id=0)
    np.testing.assert_array_equal(ro.tokens, [[2, 3, 4, 0, 0, 0], [6, 7, 0, 0, 0, 0],
                                              [9, 8, 9, 8, 9, 8]])
    np.testing.assert_array_equal(ro.mask, [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1] * 6])
    np.testing.assert_array_equal(ro.lengths, [3, 2, 6])
    assert list(ro.finish_reason) == ["eos", "eos", "length"]
    assert (ro.logprobs[ro.mask == 0] == 0).all() and (ro.logprobs[ro.mask == 1] < 0).all()
    np.testing.assert_array_equal(ro.prompt_tokens[1, -2:], [0, 5])
    np.testing.assert_array_equal(ro.prompt_mask[:, -2:], [[0, 1], [1, 1], [0, 1]])


def test_group_shares_one_prefill():
    model = _chain_model()
    CALLS.clear()
    P, G = 3, 4
    ro = static_sampler.generate_static(model, [[1], [5, 6], [8, 9, 8]], num_samples=G,
                                        max_new_tokens=5, key=jax.random.key(1),
                                        temperature=1.0, eos_ids=[4], pad_id=0)
    assert ro.tokens.shape == (P * G, 5)
    # one prefill, of the P prompts only (bucket 16); every decode step runs the P*G rows
    # against their own slots and a prefix cache of P rows (never repeated G times)
    assert [c for c in CALLS if c[0] == "FullAttention"] == [("FullAttention", (P, 16))], CALLS
    decodes = [c for c in CALLS if c[0] == "DenseDecode"]
    assert decodes and all(c == ("DenseDecode", (P * G, 1), P * G, P) for c in decodes), CALLS


@pytest.mark.parametrize("generate,counts", [
    (sampler.generate, engine_loop.TRACE_COUNTS),
    (static_sampler.generate_static, static_sampler.TRACE_COUNTS)], ids=["engine", "static"])
def test_same_key_same_output_and_no_retrace(tiny3, generate, counts):
    _, model = tiny3
    kw = SAMPLE_KW
    a = generate(model, PROMPTS[:2], key=jax.random.key(5), **kw)
    traces = sum(counts.values())
    b = generate(model, PROMPTS[:2], key=jax.random.key(5), **kw)
    c = generate(model, [[1, 2], [3] * 12], key=jax.random.key(6), **kw)  # same bucket
    assert sum(counts.values()) == traces, "a call in the same bucket retraced"
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    d = generate(model, PROMPTS[:2], key=jax.random.key(6), **kw)
    assert (a.tokens != d.tokens).any()
    assert c.tokens.shape == a.tokens.shape
    generate(model, [[1] * 40, [2]], key=jax.random.key(5), **kw)  # bucket 64: compiles
    assert sum(counts.values()) == traces + 1


def test_sharded_rows_equal_unsharded(tiny3):
    path, model = tiny3
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = convert_hf.load_hf(path, dtype=jnp.float32, mesh=mesh)
    kw = dict(key=jax.random.key(2), eos_ids=[2], **GREEDY_KW)  # 12 rows over data x fsdp = 4
    want = static_sampler.generate_static(model, PROMPTS, **kw)
    got = static_sampler.generate_static(sharded, PROMPTS, mesh=mesh, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
