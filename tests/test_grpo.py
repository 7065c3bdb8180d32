"""Tests for ba_jax.grpo: advantages and KL estimators against hand-computed values,
log-probs / entropy against NumPy, the clipped surrogate case by case, and the spec's
identity 6: micro-batched and row-sharded gradients equal the full-batch gradient."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ba_jax import aggregation as agg
from ba_jax import grpo


# ------------------------------------------------------------------------ advantages
def test_group_advantages_hand_values():
    # groups: 0 = [1, 0, 0, 1], 1 = [1, 1, 1] (degenerate), 2 = [0.5] (single), 3 = [1, 0, 0]
    rewards = np.array([1, 1, 0, 1, 0, 0.5, 1, 0, 1, 0, 1], np.float32)
    gid = np.array([0, 1, 0, 1, 3, 2, 0, 3, 3, 0, 1], np.int32)
    s3 = np.sqrt(1 / 3)  # Bessel std of both mixed groups
    want_grpo = np.array([0.5 / s3, 0, -0.5 / s3, 0, -1 / 3 / s3, 0, 0.5 / s3, -1 / 3 / s3,
                          2 / 3 / s3, -0.5 / s3, 0])
    got = grpo.group_advantages(rewards, gid, 4)
    np.testing.assert_allclose(got, want_grpo, rtol=1e-5)
    want_dr = np.array([0.5, 0, -0.5, 0, -1 / 3, 0, 0.5, -1 / 3, 2 / 3, -0.5, 0])
    np.testing.assert_allclose(grpo.group_advantages(rewards, gid, 4, estimator="drgrpo"),
                               want_dr, rtol=1e-6, atol=1e-7)
    batch_std = np.std(rewards, ddof=1)
    np.testing.assert_allclose(grpo.group_advantages(rewards, gid, 4, estimator="batch_std"),
                               want_dr / (batch_std + 1e-6), rtol=1e-5, atol=1e-7)


def test_group_advantages_degenerate_are_exact_zeros():
    rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.3, 0.3], np.float32)
    gid = np.array([0, 0, 0, 1, 2, -1], np.int32)  # id -1: excluded
    for estimator in grpo.ADVANTAGE_ESTIMATORS:
        adv = np.asarray(grpo.group_advantages(rewards, gid, 3, estimator=estimator))
        assert np.all(adv == 0.0), estimator
    with pytest.raises(ValueError, match="drgrpo"):
        grpo.group_advantages(rewards, gid, 3, estimator="ppo")


# ------------------------------------------------------------------------ KL
def test_kl_estimators_hand_values():
    logp = np.log(np.array([[0.5, 0.2]], np.float32))
    ref = np.log(np.array([[0.25, 0.2]], np.float32))
    log_rho = np.log(0.5)
    want = {"k1": -log_rho, "k2": 0.5 * log_rho**2, "k3": 0.5 - 1 - log_rho}
    for kind, value in want.items():
        np.testing.assert_allclose(grpo.kl_estimate(logp, ref, kind), [[value, 0.0]],
                                   rtol=1e-6, atol=1e-7, err_msg=kind)
    with pytest.raises(ValueError, match="k3"):
        grpo.kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_unbiased_where_expected():
    # Sample from pi, average: k1 and k3 estimate KL(pi || ref) without bias.
    rng = np.random.default_rng(0)
    pi, ref = np.array([0.6, 0.3, 0.1]), np.array([0.3, 0.3, 0.4])
    x = rng.choice(3, size=200_000, p=pi)
    kl = float(np.sum(pi * np.log(pi / ref)))
    for kind in ("k1", "k3"):
        est = grpo.kl_estimate(np.log(pi[x])[None], np.log(ref[x])[None], kind).mean()
        np.testing.assert_allclose(est, kl, rtol=0.02, err_msg=kind)


# ------------------------------------------------------------------------ log-probs
def np_log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_and_entropy(dtype):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 11)) * 4, dtype)
    tokens = rng.integers(0, 11, size=(3, 5))
    ref = np_log_softmax(np.asarray(logits.astype(jnp.float32)))
    logp = grpo.token_logprobs(logits, tokens)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, np.take_along_axis(ref, tokens[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grpo.token_entropy(logits), -(np.exp(ref) * ref).sum(-1),
                               rtol=1e-5, atol=1e-5)
    # The hand-written backward equals autodiff of the plain formula.
    g = rng.normal(size=(3, 5)).astype(np.float32)

    def plain(x):
        lp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
        return jnp.sum(g * jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0])

    grad = jax.grad(lambda x: jnp.sum(g * grpo.token_logprobs(x, tokens)))(logits)
    assert grad.dtype == dtype
    np.testing.assert_allclose(np.asarray(grad, np.float32),
                               np.asarray(jax.grad(plain)(logits), np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-6)


# ------------------------------------------------------------------------ surrogate
def test_clipped_surrogate_cases():
    ratios = np.array([1.5, 0.5, 0.5, 5.0, 1.1, 1.0], np.float32)
    adv = np.array([1.0, 1.0, -1.0, -1.0, -1.0, 2.0], np.float32)
    logp = jnp.asarray(np.log(ratios))[:, None]
    old = jnp.zeros_like(logp)
    loss, aux = grpo.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(loss[:, 0], [-1.28, -0.5, 0.8, 3.0, 1.1, -2.0], rtol=1e-6)
    np.testing.assert_array_equal(aux["clip_high_BT"][:, 0], [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(aux["clip_low_BT"][:, 0], [0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(aux["clip_dual_BT"][:, 0], [0, 0, 0, 1, 0, 0])
    no_dual, _ = grpo.clipped_surrogate(logp, old, adv)
    np.testing.assert_allclose(no_dual[3, 0], 5.0, rtol=1e-6)
    # Clipped tokens carry no gradient; the others carry -A r.
    grad = jax.grad(lambda lp: grpo.clipped_surrogate(lp, old, adv, dual_clip=3.0)[0].sum())(logp)
    np.testing.assert_allclose(grad[:, 0], [0, -0.5, 0, 0, 1.1, -2.0], rtol=1e-6, atol=1e-7)


def test_grpo_loss_is_weighted_sum_with_kl():
    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(size=(4, 6)) * 0.1 - 2, jnp.float32)
    old = logp + jnp.asarray(rng.normal(size=(4, 6)) * 0.3, jnp.float32)
    ref = logp + jnp.asarray(rng.normal(size=(4, 6)) * 0.2, jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    mask = jnp.asarray((rng.random((4, 6)) < 0.7), jnp.float32)
    w = mask * jnp.asarray(rng.random((4, 1)), jnp.float32)
    loss, m = grpo.grpo_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.28,
                             ref_logp_BT=ref, kl_kind="k3", kl_beta=0.1)
    pg, aux = grpo.clipped_surrogate(logp, old, adv)
    kl = grpo.kl_estimate(logp, ref, "k3")
    np.testing.assert_allclose(loss, jnp.sum(w * (pg + 0.1 * kl)), rtol=1e-6)
    np.testing.assert_allclose(m["kl"], jnp.sum(w * kl), rtol=1e-6)
    np.testing.assert_allclose(m["num_tokens"], mask.sum())
    clipped = mask * (aux["clip_low_BT"] + aux["clip_high_BT"])
    assert float(clipped.sum()) > 0
    np.testing.assert_allclose(m["clip_low"] + m["clip_high"], clipped.sum())
    with pytest.raises(ValueError, match="ref_logp_BT"):
        grpo.grpo_loss(logp, old, adv, w, mask, eps_low=0.2, eps_high=0.28, kl_kind="k1")


# ------------------------------------------------ identity 6: micro-batches and devices
ROWS, T, D, V, NUM_GROUPS = 32, 6, 4, 7, 6


def make_batch(rule, seed=0, **options):
    """A shuffled ragged batch with its aggregation weights computed on the whole batch."""
    rng = np.random.default_rng(seed)
    gid = rng.integers(0, NUM_GROUPS, size=ROWS).astype(np.int32)
    rewards = (rng.random(ROWS) < 0.4).astype(np.float32)
    adv = grpo.group_advantages(jnp.asarray(rewards), jnp.asarray(gid), NUM_GROUPS)
    lengths = rng.integers(0, T + 1, size=ROWS)
    mask = jnp.asarray(np.arange(T)[None] < lengths[:, None], jnp.float32)
    x = jnp.asarray(rng.normal(size=(ROWS, T, D)), jnp.float32)
    batch = dict(
        x_BTD=x,
        tokens_BT=jnp.asarray(rng.integers(0, V, size=(ROWS, T)), jnp.int32),
        old_logp_BT=jnp.asarray(-2.0 + 0.4 * rng.normal(size=(ROWS, T)), jnp.float32),
        ref_logp_BT=jnp.asarray(-2.0 + 0.4 * rng.normal(size=(ROWS, T)), jnp.float32),
        adv_B=adv,
        mask_BT=mask,
        w_BT=agg.token_weights(rule, mask, adv, gid, NUM_GROUPS, **options),
    )
    return batch, gid


def init_params(seed=0):
    return {"w_DV": jnp.asarray(np.random.default_rng(seed).normal(size=(D, V)) * 0.5,
                                jnp.float32)}


def head_logp(params, batch):
    logits_BTV = jnp.einsum("btd,dv->btv", batch["x_BTD"], params["w_DV"])
    return grpo.token_logprobs(logits_BTV, batch["tokens_BT"])


def loss_fn(params, batch):
    return grpo.grpo_loss(head_logp(params, batch), batch["old_logp_BT"], batch["adv_B"],
                          batch["w_BT"], batch["mask_BT"], eps_low=0.2, eps_high=0.28,
                          dual_clip=3.0, ref_logp_BT=batch["ref_logp_BT"], kl_kind="k3",
                          kl_beta=0.05)


accumulate = jax.jit(functools.partial(grpo.accumulate_gradients, loss_fn), static_argnums=2)


def full_batch_reference(rule, params, batch, gid):
    """Loss and gradient with weights recomputed inside aggregate, no micro-batching."""
    def f(p):
        lp = head_logp(p, batch)
        pg, _ = grpo.clipped_surrogate(lp, batch["old_logp_BT"], batch["adv_B"], dual_clip=3.0)
        l_BT = pg + 0.05 * grpo.kl_estimate(lp, batch["ref_logp_BT"], "k3")
        return agg.aggregate(rule, l_BT, batch["mask_BT"], batch["adv_B"], gid, NUM_GROUPS)
    return jax.value_and_grad(f)(params)


@pytest.mark.parametrize("rule", ["token", "balanced", "sequence"])
def test_microbatches_give_the_full_batch_gradient(rule):
    params = init_params()
    batch, gid = make_batch(rule, seed=1)
    want_loss, want_grad = full_batch_reference(rule, params, batch, gid)
    assert float(jnp.abs(want_grad["w_DV"]).max()) > 1e-3
    metrics = None
    for k in (1, 2, 4, 8):
        loss, grads, aux = accumulate(params, batch, k)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"k={k}")
        np.testing.assert_allclose(grads["w_DV"], want_grad["w_DV"], rtol=1e-5, atol=1e-7,
                                   err_msg=f"k={k}")
        if metrics is None:
            metrics = aux
        for name in ("num_tokens", "clip_low", "clip_high", "clip_dual", "kl", "weight_sum"):
            np.testing.assert_allclose(aux[name], metrics[name], rtol=1e-5, err_msg=name)


def test_row_sharded_gradient_equals_unsharded():
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    params = init_params()
    batch, _ = make_batch("balanced", seed=2)
    sharded_batch = jax.device_put(batch, rows)
    sharded_params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    for k in (1, 2, 4):
        want = accumulate(params, batch, k)
        got = accumulate(sharded_params, sharded_batch, k)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"k={k}")
        np.testing.assert_allclose(got[1]["w_DV"], want[1]["w_DV"], rtol=1e-5, atol=1e-7,
                                   err_msg=f"k={k}")


def test_weights_computed_on_sharded_rows_match():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    batch, gid = make_batch("balanced", seed=3)
    args = jax.device_put((batch["mask_BT"], batch["adv_B"], jnp.asarray(gid)), rows)
    w = agg.token_weights("balanced", *args, NUM_GROUPS)
    np.testing.assert_allclose(w, batch["w_BT"], rtol=1e-6)


def test_bad_microbatch_count_is_an_error():
    batch, _ = make_batch("token")
    with pytest.raises(ValueError, match="divide"):
        grpo.accumulate_gradients(loss_fn, init_params(), batch, 3)


def test_no_retrace_for_second_batch():
    traces = []

    @jax.jit
    def step(params, batch):
        traces.append(1)
        return grpo.accumulate_gradients(loss_fn, params, batch, 4)

    for seed in (0, 1):
        step(init_params(), make_batch("balanced", seed=seed)[0])
    assert len(traces) == 1


def doubled_token(mask_BT, adv_B, group_id_B, num_groups, **options):
    """A user rule for the tests: twice `token`."""
    return 2.0 * agg.token_weights("token", mask_BT, adv_B, group_id_B, num_groups, **options)


def test_user_rule_through_accumulate_gradients():
    params = init_params()
    batch, gid = make_batch(f"{__name__}:doubled_token", seed=4)
    token_batch, _ = make_batch("token", seed=4)
    _, grads, _ = accumulate(params, batch, 4)
    _, token_grads, _ = accumulate(params, token_batch, 4)
    np.testing.assert_allclose(grads["w_DV"], 2.0 * token_grads["w_DV"], rtol=1e-5, atol=1e-7)
    _, want_grad = full_batch_reference(doubled_token, params, batch, gid)
    np.testing.assert_allclose(grads["w_DV"], want_grad["w_DV"], rtol=1e-5, atol=1e-7)


def test_bfloat16_params_accumulate_in_float32():
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), init_params())
    batch, _ = make_batch("balanced", seed=5)
    _, grads, _ = accumulate(params, batch, 8)
    assert grads["w_DV"].dtype == jnp.bfloat16
    f32_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    _, want, _ = accumulate(f32_params, batch, 1)
    np.testing.assert_allclose(np.asarray(grads["w_DV"], np.float32), want["w_DV"], rtol=8e-3,
                               atol=1e-4)


# ------------------------------------------------------------------- chunked output head
def _tiny_policy(dtype, tie, chunk):
    from flax import nnx

    from ba_jax.models import qwen

    mc = qwen.ModelConfig("qwen3", 97, 32, 64, 2, 4, 2, 8, 1e4, 1e-6, 64, tie, False, False,
                          True, logits_chunk=chunk)
    return nnx.split(qwen.Qwen(mc, rngs=nnx.Rngs(3), dtype=dtype, param_dtype=jnp.float32))


def _scoring_batch(R=11):
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 97, (4, 5)).astype(np.int32)
    pmask = np.ones_like(prompt)
    pmask[1, :2] = 0  # a left-padded prompt
    return dict(prompt_tokens_BT=jnp.asarray(prompt), prompt_mask_BT=jnp.asarray(pmask),
                tokens_BR=jnp.asarray(rng.integers(0, 97, (4, R)).astype(np.int32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_head_equals_unchunked_values_and_gradients(dtype, tie):
    """R = 11 response positions: chunk 4 leaves a ragged tail of 3, chunk 11 divides (one
    chunk), chunk 1 is one position at a time; all against chunk 0 (no chunks)."""
    from flax import nnx

    batch = _scoring_batch()
    g_BR = jnp.asarray(np.random.default_rng(1).normal(size=(4, 11)), jnp.float32)

    def run(chunk):
        graphdef, params = _tiny_policy(dtype, tie, chunk)

        def f(p):
            logp, ent = grpo.policy_logprobs(graphdef, p, batch, with_entropy=True)
            return jnp.sum(g_BR * logp), (logp, ent)

        (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return logp, ent, nnx.to_pure_dict(grads)

    want_logp, want_ent, want_g = run(0)
    tol = dict(rtol=1e-5, atol=1e-5)  # same products, other reduction order
    for chunk in (1, 4, 11):
        logp, ent, grads = run(chunk)
        np.testing.assert_allclose(logp, want_logp, **tol)
        np.testing.assert_allclose(ent, want_ent, **tol)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), grads, want_g)


def test_chunked_head_never_forms_all_logits():
    """The compiled loss of a chunked head holds one chunk's logits: its temp bytes are a
    fraction of the unchunked program's (the [B, R, V] float32 logits and cotangent)."""
    from flax import nnx

    from ba_jax.models import qwen

    mc = qwen.ModelConfig("qwen3", 16384, 32, 64, 1, 4, 2, 8, 1e4, 1e-6, 512, True, False,
                          False, True)
    R = 128
    batch = dict(prompt_tokens_BT=jnp.zeros((4, 8), jnp.int32),
                 prompt_mask_BT=jnp.ones((4, 8), jnp.int32), tokens_BR=jnp.zeros((4, R), jnp.int32))

    def temp(chunk):
        gd, p = nnx.split(qwen.Qwen(dataclasses.replace(mc, logits_chunk=chunk),
                                    rngs=nnx.Rngs(0)))
        loss = lambda p: jnp.sum(grpo.policy_logprobs(gd, p, batch)[0])  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(p).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 4 * R * mc.vocab_size * 4
    assert temp(0) > 2 * logits_bytes  # the unchunked program: logits, cotangent and more
    assert temp(8) < logits_bytes / 2  # a few chunk-sized [4, 8, V] buffers


def test_reference_logprobs_are_microbatched_and_equal_the_policy():
    graphdef, params = _tiny_policy(jnp.float32, True, 4)
    batch = _scoring_batch()
    want = grpo.policy_logprobs(graphdef, params, batch)[0]
    for k in (1, 2, 4):
        got = jax.jit(functools.partial(grpo.reference_logprobs, graphdef,
                                        num_microbatches=k))(params, batch)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    micro = grpo.split_microbatches(batch, 2)
    assert micro["tokens_BR"].shape == (2, 2, 11)
    np.testing.assert_array_equal(micro["tokens_BR"][1, 0], batch["tokens_BR"][1])  # rows j, j+k
    jax.tree.map(np.testing.assert_array_equal, grpo.join_microbatches(micro), batch)


def test_compute_copy_casts_matrices_and_keeps_vectors():
    graphdef, params = _tiny_policy(jnp.bfloat16, False, 0)
    ref = grpo.compute_copy(params, jnp.bfloat16)
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        assert r.dtype == (jnp.bfloat16 if p.ndim >= 2 else p.dtype)
    batch = _scoring_batch()
    # the bf16 policy casts the same matrices for its compute: equal forwards
    np.testing.assert_array_equal(grpo.policy_logprobs(graphdef, ref, batch)[0],
                                  grpo.policy_logprobs(graphdef, params, batch)[0])
