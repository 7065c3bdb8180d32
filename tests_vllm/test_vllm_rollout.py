"""vLLM rollouts (ba_jax.vllm_rollout): the weights it sends are the HF tensors, greedy
rollouts equal the in-house sampler's and transformers', its log-probs equal the trainer's
recomputation in float32 (reported in bf16), a second weight sync lands, sampling is seeded
per row and keeps per-row budgets."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from ba_jax import grpo, sampler
from ba_jax.models import convert_hf
from ba_jax.sharding import make_mesh
from ba_jax.vllm_rollout import VllmEngine, hf_weights, weight_layout
from helpers_vllm import MAX_MODEL_LEN, PROMPTS, generate_kw, tiny_model
from test_sampler import _hf_greedy

# f32 agreement of vLLM's log-probs with the trainer's: both are float32 computations of the
# same function, differing only in kernels (vLLM's oneDNN GEMMs, its attention and RMSNorm)
# and so in summation order. Over this model's two layers and |logits| < ~10 that moves a
# log-prob by a few 1e-6 (measured: max 3.3e-6); 1e-5 is the suite's own trainer-parity
# tolerance (tests/test_sampler.py), while a wrong weight or position moves it by >= 1e-2.
F32_ATOL = 1e-5


def _params(model):
    return nnx.state(model, nnx.Param)


def _old_logp(model, ro) -> np.ndarray:
    """The trainer's old_logp of a rollout: grpo.policy_logprobs on [prompt | response]."""
    graphdef, params = nnx.split(model)
    batch = dict(prompt_tokens_BT=ro.prompt_tokens, prompt_mask_BT=ro.prompt_mask,
                 tokens_BR=ro.tokens)
    logp_BR, _ = jax.jit(grpo.policy_logprobs, static_argnums=0)(graphdef, params, batch)
    return np.asarray(logp_BR)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_hf_weights_are_the_checkpoints_tensors(arch, tmp_path_factory):
    """params -> (HF key, array) gives back the HF checkpoint the model was read from, bit for
    bit in f32 and rounded in bf16, whether the parameters are sharded over 8 devices or not."""
    path, model = tiny_model(arch, tmp_path_factory)
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
    L = model.config.num_layers
    got = dict(hf_weights(_params(model), num_layers=L, dtype=jnp.float32))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    bf16 = dict(hf_weights(_params(model), num_layers=L, dtype=jnp.bfloat16))
    for k in want:
        assert bf16[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(bf16[k], want[k].astype(jnp.bfloat16), err_msg=k)
    sharded = convert_hf.load_hf(path, dtype=jnp.float32,
                                 mesh=make_mesh({"fsdp": 4, "tensor": 2}))
    kernel = sharded.layers.mlp.up_proj.kernel[...]
    assert len(kernel.addressable_shards) == 8 and not kernel.sharding.is_fully_replicated
    for k, a in hf_weights(_params(sharded), num_layers=L, dtype=jnp.bfloat16):
        np.testing.assert_array_equal(a, bf16[k], err_msg=k)
    layout = weight_layout(_params(model), L)
    assert layout == [(k, a.shape) for k, a in hf_weights(_params(model), num_layers=L)]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_greedy_equals_the_sampler_and_transformers(arch, engines, tmp_path_factory):
    path, model = tiny_model(arch, tmp_path_factory)
    eng = engines(arch, model)
    assert eng.sync_weights(_params(model)) > 0
    M = 12
    free = _hf_greedy(path, PROMPTS, M, eos=127, pad=0)
    eos = int(free[1, 4])  # an EOS the model emits: rows stop at different steps
    want = _hf_greedy(path, PROMPTS, M, eos=eos, pad=0)
    kw = dict(num_samples=2, temperature=0.0, eos_ids=[eos], pad_id=0)
    ro = generate_kw(eng, PROMPTS, max_new_tokens=M, key=0, **kw)
    np.testing.assert_array_equal(ro.tokens, np.repeat(want, 2, axis=0))
    ref = sampler.generate(model, PROMPTS, max_new_tokens=M, key=jax.random.key(0), **kw)
    assert set(ro.finish_reason) == {"eos", "length"}
    fields = ("tokens", "mask", "lengths", "group_ids", "finish_reason", "prompt_tokens",
              "prompt_mask")
    for name in fields:
        np.testing.assert_array_equal(getattr(ro, name), getattr(ref, name), err_msg=name)
    assert not ro.sampling_logprobs.any()  # greedy, as the sampler reports it
    # per-prompt budgets, against the in-house engine (the sampler takes one budget)
    budgets = [M, 3, 7, M]
    ro = generate_kw(eng, PROMPTS, max_new_tokens=budgets, key=0, **kw)
    ref = sampler.generate(model, PROMPTS, max_new_tokens=budgets, key=jax.random.key(0), **kw)
    for name in fields:
        np.testing.assert_array_equal(getattr(ro, name), getattr(ref, name), err_msg=name)
    # ignore_eos (the benchmark's forced lengths): every row runs to its budget, through the
    # EOS the rows above stopped at, and the tokens are the EOS-free greedy ones
    ro = generate_kw(eng, PROMPTS, max_new_tokens=budgets, key=0, ignore_eos=True, **kw)
    assert (ro.lengths == np.repeat(budgets, 2)).all() and set(ro.finish_reason) == {"length"}
    for b, n in enumerate(ro.lengths):
        np.testing.assert_array_equal(ro.tokens[b, :n], free[b // 2, :n])


def test_logprobs_equal_the_trainers_in_float32(engines, tmp_path_factory):
    _, model = tiny_model("qwen3", tmp_path_factory)
    eng = engines("qwen3", model)
    eng.sync_weights(_params(model))
    ro = generate_kw(eng, PROMPTS, num_samples=3, max_new_tokens=16, key=jax.random.key(5),
                      temperature=1.0, eos_ids=[2])
    m = ro.mask.astype(bool)
    assert m.sum() > 100
    diff = np.abs(ro.logprobs - _old_logp(model, ro))[m]
    print(f"f32 |vllm logp - trainer logp|: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert diff.max() < F32_ATOL
    # temperature 1 without top-k/top-p: the sampling distribution is the model's
    np.testing.assert_array_equal(ro.sampling_logprobs, ro.logprobs)
    assert not ro.logprobs[~m].any()
    np.testing.assert_array_equal(ro.lengths, m.sum(1))


def test_bf16_engine_logprob_mismatch_is_small(tmp_path_factory):
    """A bf16 engine fed the f32 master weights: |sampler_logp - old_logp| is reported; the
    bound only says the weights arrived (bf16 rounding moves log-probs by ~1e-2; wrong
    weights by ~1)."""
    _, model = tiny_model("qwen3", tmp_path_factory)
    with VllmEngine(model.config, dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                    max_num_seqs=32, enforce_eager=True) as eng:
        eng.sync_weights(_params(model))
        n = sum(a.size for a in jax.tree.leaves(_params(model)))
        tensors = len(weight_layout(_params(model), model.config.num_layers))
        assert 2 * n <= eng.last_sync["bytes"] < 2 * n + 64 * tensors  # 2 bytes a weight
        ro = generate_kw(eng, PROMPTS, num_samples=3, max_new_tokens=16, key=jax.random.key(5),
                          temperature=1.0, eos_ids=[2])
    m = ro.mask.astype(bool)
    diff = np.abs(ro.logprobs - _old_logp(model, ro))[m]
    print(f"bf16 |vllm logp - f32 trainer logp| over {m.sum()} tokens: "
          f"mean {diff.mean():.4f} max {diff.max():.4f}")
    assert diff.mean() < 0.05 and diff.max() < 0.5


def _sync_a_b_a(eng, a, b) -> None:
    """Weights A, then B, then A again: each call's greedy rollouts are the sampler's under
    the weights last synced, though the 150-token prompt's KV block sits in vLLM's prefix
    cache from the call before (computed under the other weights)."""
    kw = dict(num_samples=2, max_new_tokens=10, temperature=0.0, eos_ids=[127], pad_id=0)
    runs = []
    for model in (a, b, a):
        eng.sync_weights(_params(model))
        ro = generate_kw(eng, PROMPTS, key=0, **kw)
        ref = sampler.generate(model, PROMPTS, key=jax.random.key(0), **kw)
        np.testing.assert_array_equal(ro.tokens, ref.tokens)
        np.testing.assert_allclose(ro.logprobs, ref.logprobs, atol=F32_ATOL, rtol=0)
        runs.append(ro)
    assert (runs[0].tokens != runs[1].tokens).any(axis=1).all()  # every row changed
    np.testing.assert_array_equal(runs[2].tokens, runs[0].tokens)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_second_sync_changes_the_rollouts(arch, engines, tmp_path_factory):
    _, a = tiny_model(arch, tmp_path_factory, seed=1)
    _, b = tiny_model(arch, tmp_path_factory, seed=2)
    _sync_a_b_a(engines(arch, a), a, b)


def test_a_second_sync_lands_in_a_compiled_engine(tmp_path_factory):
    """The default engine (torch.compile'd): new weights reach the compiled model too."""
    _, a = tiny_model("qwen3", tmp_path_factory, seed=1)
    _, b = tiny_model("qwen3", tmp_path_factory, seed=2)
    with VllmEngine(a.config, dtype="float32", max_model_len=MAX_MODEL_LEN,
                    max_num_seqs=32) as eng:
        _sync_a_b_a(eng, a, b)


def test_sampling_is_seeded_per_row_and_keeps_budgets(engines, tmp_path_factory):
    _, model = tiny_model("qwen3", tmp_path_factory)
    eng = engines("qwen3", model)
    eng.sync_weights(_params(model))
    budgets = np.array([16, 4, 9, 1, 12, 16, 7, 3])  # one per row: 4 prompts x 2 samples
    kw = dict(num_samples=2, max_new_tokens=budgets, temperature=1.0, eos_ids=[2, 7])
    r1 = generate_kw(eng, PROMPTS, key=jax.random.key(3), **kw)
    r2 = generate_kw(eng, PROMPTS, key=3, **kw)  # an int n is jax.random.key(n)
    r3 = generate_kw(eng, PROMPTS, key=jax.random.key(4), **kw)
    np.testing.assert_array_equal(r1.tokens, r2.tokens)
    np.testing.assert_array_equal(r1.logprobs, r2.logprobs)
    assert (r1.tokens != r3.tokens).any()
    assert r1.tokens.shape == (8, 16) and len({tuple(t) for t in r1.tokens.tolist()}) == 8
    assert (r1.lengths <= budgets).all() and r1.lengths[3] == 1
    for i in range(8):
        n = r1.lengths[i]
        if r1.finish_reason[i] == "length":
            assert n == budgets[i] and not np.isin(r1.tokens[i, :n], [2, 7]).any()
        else:
            assert r1.tokens[i, n - 1] in (2, 7) and not np.isin(r1.tokens[i, :n - 1], [2, 7]).any()
        assert (r1.tokens[i, n:] == 2).all()  # pad_id defaults to the first EOS id
    # temperature and top-k: vLLM returns temperature-1 log-probs only, so the sampling
    # log-probs are NaN on response tokens (and the trainer's old_logp still matches)
    r4 = generate_kw(eng, PROMPTS, key=0, **dict(kw, temperature=0.7), top_k=20)
    m = r4.mask.astype(bool)
    assert np.isnan(r4.sampling_logprobs[m]).all() and not r4.sampling_logprobs[~m].any()
    assert np.abs(r4.logprobs - _old_logp(model, r4))[m].max() < F32_ATOL


def test_bad_requests_are_errors(engines, tmp_path_factory):
    _, model = tiny_model("qwen3", tmp_path_factory)
    eng = engines("qwen3", model)
    pure = nnx.to_pure_dict(_params(model))
    del pure["norm"]
    with pytest.raises(ValueError, match="missing .*model.norm.weight"):
        eng.sync_weights(pure)
    eng.sync_weights(_params(model))
    kw = dict(num_samples=2, key=0, eos_ids=[2])
    with pytest.raises(ValueError, match="max_model_len"):
        generate_kw(eng, PROMPTS, max_new_tokens=MAX_MODEL_LEN, **kw)
    with pytest.raises(ValueError, match="one per prompt"):
        generate_kw(eng, PROMPTS, max_new_tokens=[4, 4, 4], **kw)
    with pytest.raises(ValueError, match="at least one token"):
        generate_kw(eng, [[]], max_new_tokens=4, **kw)
