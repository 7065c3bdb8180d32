"""Train-inference consistency (correction.py and its use in the trainer): IS weights and
rejection masks against a NumPy reference on ragged batches, the mismatch statistics, exact
equality with the uncorrected step when the engine's log-probs are the trainer's, micro-
batching and 8 devices, the check cadence with the engine's log-probs, and start-up errors."""

import jax
import numpy as np
import optax
import pytest
from test_train import _random_batch, debug_config

from ba_jax import build, correction, run_config, sharding, train, updater
from ba_jax.correction import CorrectionSettings
from ba_jax.metrics import read_metrics

# per-token log ratios from this set: sums of up to 8 of them are multiples of 0.1, never
# within 1e-3 of a bound's log (log 1.5 = 0.405, log 2 = 0.693), so float32 and float64
# agree on every comparison
STEPS = np.array([-1.2, -0.5, -0.1, 0.0, 0.2, 0.6, 1.1])


def ragged(seed=0, B=12, R=8):
    """(old_logp, engine_logp, mask) with lengths 0..R (rows 0 and 5 empty)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, R + 1, size=B)
    lengths[[0, 5]] = 0
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    engine = -rng.uniform(0.1, 4.0, size=(B, R)).astype(np.float32)
    lr = rng.choice(STEPS, size=(B, R))
    old = (engine + lr).astype(np.float32)
    old[mask == 0] = 7.0  # padding holds garbage the correction must ignore
    return old, engine, mask, lr


def reference(lr, mask, s: CorrectionSettings):
    """float64 loops: IS weight per token or the product over the response, truncated; keep
    iff the token's ratio (or the response's product) lies in the bounds."""
    B, R = mask.shape
    w, keep = np.zeros((B, R)), np.zeros((B, R))
    for i in range(B):
        n = int(mask[i].sum())
        seq = np.prod(np.exp(lr[i, :n]))
        for t in range(n):
            ratio = np.exp(lr[i, t])
            w[i, t] = min(ratio if s.rollout_is == "token" else seq, s.is_threshold)
            x = ratio if s.rollout_rs == "token" else seq
            keep[i, t] = float(s.rs_lower <= x <= s.rs_upper)
    return w, keep


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.5, 1e3])  # truncation hit / never hit
def test_weights_and_masks_match_numpy(level, threshold):
    old, engine, mask, lr = ragged()
    s = CorrectionSettings(rollout_is=level, is_threshold=threshold, rollout_rs=level,
                           rs_lower=0.5, rs_upper=2.0)
    want_w, want_keep = reference(lr, mask, s)
    lr_BR = correction.log_ratio(old, engine, mask)
    w = np.asarray(correction.is_weights(lr_BR, mask, s))
    keep = np.asarray(correction.rs_keep(lr_BR, mask, s))
    np.testing.assert_allclose(w, want_w, rtol=1e-5)
    np.testing.assert_array_equal(keep, want_keep)
    assert 0 < want_keep[mask > 0].mean() < 1  # some rejected, some kept
    if threshold < 10:
        assert (want_w[mask > 0] == threshold).any() and (want_w[mask > 0] < threshold).any()
    factor = np.asarray(correction.pg_factor(old, engine, mask, s))
    np.testing.assert_allclose(factor, want_w * want_keep, rtol=1e-5)
    assert not factor[[0, 5]].any()  # empty responses: no weight, no NaN
    assert np.isfinite(factor).all()


def test_statistics_match_numpy_and_sum_over_minibatches():
    old, engine, mask, lr = ragged(seed=1)
    s = CorrectionSettings(rollout_is="sequence", is_threshold=2.0, rollout_rs="token",
                           rs_lower=0.5, rs_upper=2.0)
    stat = jax.jit(correction.statistics, static_argnums=3)
    whole = correction.summarize([jax.device_get(stat(old, engine, mask, s))], s)
    halves = correction.summarize([jax.device_get(stat(old[a:b], engine[a:b], mask[a:b], s))
                                   for a, b in ((0, 7), (7, 12))], s)
    m = mask > 0
    rows = m.any(1)
    seq = np.where(m, lr, 0).sum(1)
    k3 = lambda x: np.exp(x) - 1 - x  # noqa: E731
    w_seq = np.minimum(np.exp(seq[rows]), 2.0)
    want = dict(
        rollout_logp_diff_mean=np.abs(lr[m]).mean(), rollout_logp_diff_max=np.abs(lr[m]).max(),
        rollout_kl_k3=k3(lr[m]).mean(), rollout_kl_k3_token=k3(lr[m]).mean(),
        rollout_kl_k3_seq=k3(seq[rows]).mean(),
        rollout_ratio_outside_2x_frac=(np.abs(lr[m]) > np.log(2)).mean(),
        rollout_is_mean=w_seq.mean(), rollout_is_max=np.exp(seq[rows]).max(),
        rollout_is_clipped_frac=(np.exp(seq[rows]) > 2).mean(),
        rollout_is_ess=w_seq.sum() ** 2 / (len(w_seq) * (w_seq**2).sum()),
        rollout_rs_masked_frac=((np.exp(lr[m]) < 0.5) | (np.exp(lr[m]) > 2)).mean())
    assert set(whole) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(whole[k], v, rtol=2e-5, err_msg=k)
        np.testing.assert_allclose(halves[k], v, rtol=2e-5, err_msg=k)
    assert 0 < want["rollout_is_clipped_frac"] < 1 and 0 < want["rollout_rs_masked_frac"] < 1


CORRECTED = CorrectionSettings(rollout_is="sequence", is_threshold=1.5, rollout_rs="token",
                               rs_lower=0.6, rs_upper=1.8)


def _one_step(cfg, num_devices, batch, corr):
    """One train step, plain SGD (lr 1: the parameter change is the gradient) -> (metrics,
    parameter changes)."""
    mesh = build.make_mesh(cfg, jax.devices()[:num_devices])
    graphdef, params = build.init_policy(cfg, mesh)
    before = jax.tree.leaves(jax.device_get(params))
    sgd = optax.sgd(1.0)
    state = train.init_state(params, sgd, mesh)
    loss = build.loss_settings(cfg)
    loss = type(loss)(**{**loss.__dict__, "correction": corr})
    step = train.make_train_step(loss, graphdef, sgd, state, mesh,
                                 num_groups=cfg.rollout.prompts_per_step)
    if not corr.active:
        batch = {k: v for k, v in batch.items() if k != "engine_logp_BR"}
    state, out = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    after = jax.tree.leaves(jax.device_get(state["params"]))
    return jax.device_get(out), [b - a for b, a in zip(before, after, strict=True)]


@pytest.fixture(scope="module")
def step_batch():
    """A batch of the debug shapes whose old log-probs are the policy's own, perturbed so the
    PPO ratio clips some tokens, and engine log-probs that differ from them."""
    cfg = debug_config(**{"mesh.data": 1})
    batch = _random_batch(cfg, seed=3)
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    own = np.asarray(train.make_reference_fn(1, graphdef, params, mesh)(params, batch))
    rng = np.random.default_rng(0)
    batch["old_logp_BR"] = (own + rng.normal(0, 0.2, own.shape)).astype(np.float32)
    batch["engine_logp_BR"] = (batch["old_logp_BR"]
                               + rng.normal(0, 0.4, own.shape)).astype(np.float32)
    return batch


def test_equal_logprobs_leave_loss_and_gradient_exactly_unchanged(step_batch):
    cfg = debug_config(**{"mesh.data": 1})
    same = dict(step_batch, engine_logp_BR=step_batch["old_logp_BR"].copy())
    m0, g0 = _one_step(cfg, 1, same, CorrectionSettings())
    m1, g1 = _one_step(cfg, 1, same, CORRECTED)
    assert float(m0["grad_norm"]) > 1e-3
    for k in ("loss", "pg_loss", "grad_norm"):
        assert m1[k] == m0[k], k
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(a, b)


def test_corrected_step_is_the_same_on_8_devices_and_microbatches(step_batch):
    one = debug_config(**{"mesh.data": 1})
    eight = debug_config(**{"grpo.num_microbatches": 2, "mesh.data": 4, "mesh.fsdp": 2})
    m0, g0 = _one_step(one, 1, step_batch, CorrectionSettings())
    m1, g1 = _one_step(one, 1, step_batch, CORRECTED)
    m8, g8 = _one_step(eight, 8, step_batch, CORRECTED)
    assert abs(float(m1["loss"]) - float(m0["loss"])) > 1e-4  # the correction acts
    for k in ("loss", "pg_loss", "grad_norm", "weight_sum"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, err_msg=k)
    for a, b in zip(g1, g8, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5 * float(np.abs(a).max()))


def _strip(rows):
    drop = ("step_time_s", "update_time_s", "checkpoint_time_s", "sample_time_s",
            "score_time_s", "sampling_time_share", "tokens_per_s", "weight_sync_time_s")
    return [{k: v for k, v in r.items() if k not in drop and not k.startswith("rollout_")}
            for r in rows]


def test_check_cadence_measures_without_changing_the_run(tmp_path):
    """The paged engine's log-probs as pi_old (`auto`), in bfloat16 (where they differ from
    the trainer's): a check every 2 steps logs the mismatch on steps 1 and 3 only and leaves
    every other metric as a run without checks has them; `recompute` with the correction
    logs it every step."""
    runs = {}
    for every in (0, 2):
        wd = str(tmp_path / f"every{every}")
        train.train_and_evaluate(debug_config(**{"grpo.logp_check_every": every,
                                                 "model.dtype": "bfloat16"}), wd)
        runs[every] = read_metrics(wd)
    assert not any("rollout_logp_diff_mean" in r for r in runs[0])
    assert ["rollout_kl_k3_seq" in r for r in runs[2]] == [True, False, True]
    assert _strip(runs[0]) == _strip(runs[2])
    for r in runs[2][::2]:
        assert 0 < r["rollout_logp_diff_mean"] <= r["rollout_logp_diff_max"] < 1
        assert 0 < r["rollout_kl_k3_token"] < 1e-2 and r["rollout_kl_k3_seq"] > 0
        assert 0 <= r["rollout_ratio_outside_2x_frac"] < 0.1
    wd = str(tmp_path / "recompute")
    train.train_and_evaluate(debug_config(**{
        "num_train_steps": 2, "grpo.old_logp": "recompute", "grpo.rollout_is": "token",
        "grpo.rollout_rs": "sequence", "grpo.logp_check_every": 0}), wd)
    for r in read_metrics(wd):
        assert abs(r["rollout_is_mean"] - 1) < 1e-5 and r["rollout_is_ess"] > 0.999
        assert r["rollout_rs_masked_frac"] == 0.0 and r["rollout_is_clipped_frac"] == 0.0


@pytest.mark.parametrize("override, message", [
    ({"grpo.rollout_is": "token"}, "rollout_is='token' compares the engine's log-probs"),
    ({"grpo.rollout_rs": "sequence", "grpo.old_logp": "engine"}, "set config.grpo.old_logp="),
    ({"grpo.rollout_is": "tokens"}, "rollout_is='tokens'; valid: none, token, sequence"),
    ({"grpo.rollout_is_threshold": 1.0}, "rollout_is_threshold=1.0 must be > 1"),
    ({"grpo.rollout_is_threshold": 0.5}, "rollout_is_threshold=0.5 must be > 1"),
    ({"grpo.rollout_rs_threshold": 2.0, "grpo.rollout_rs_threshold_lower": 3.0},
     "are in the wrong order"),
    ({"grpo.rollout_rs_threshold": 0.8}, "are in the wrong order"),  # lower 1/0.8 > 0.8
    ({"grpo.rollout_rs_threshold": 3.0, "grpo.rollout_rs_threshold_lower": 1.5},
     "must hold the on-policy ratio 1"),
    ({"grpo.old_logp": "trainer"}, "old_logp='trainer'; valid: auto, engine, recompute"),
    ({"grpo.logp_check_every": -1}, "logp_check_every=-1 must be an integer >= 0"),
])
def test_startup_errors(override, message):
    with pytest.raises(run_config.ConfigError, match=message):
        run_config.validate(debug_config(**override), 8)


def test_old_logp_defaults_and_the_vllm_alias():
    src = run_config.old_logp_source
    assert src(debug_config()) == "engine"  # paged, auto
    assert src(debug_config(**{"grpo.old_logp": "recompute"})) == "recompute"
    vllm = {"rollout.engine": "vllm"}
    assert src(debug_config(**vllm)) == "recompute"  # vLLM, auto
    assert src(debug_config(**vllm, **{"rollout.vllm_logprobs": "engine"})) == "engine"
    assert src(debug_config(**{"rollout.vllm_logprobs": "engine"})) == "engine"  # paged: unread
    with pytest.raises(run_config.ConfigError, match="contradicts config.grpo.old_logp"):
        src(debug_config(**vllm, **{"rollout.vllm_logprobs": "engine",
                                    "grpo.old_logp": "recompute"}))
    # the recompute with the correction on passes validation
    run_config.validate(debug_config(**{"grpo.old_logp": "recompute", "grpo.rollout_is": "token",
                                        "grpo.rollout_rs": "token"}), 8)


def test_check_steps_follow_the_checkpointed_update_count():
    """With the engine's pi_old the check runs on RL steps 1, 1 + N, ...: counted from the
    optimizer's update count (restored with the checkpoint, so a resumed run checks the
    steps an uninterrupted one does), M mini-batches x E epochs updates per step."""
    upd = train.Updater(step_fn=None, diag_fn=None, row_sharding=None, num_minibatches=2,
                        groups_per_shard=1, num_samples=2, num_updates=2, check_every=3)
    steps = [updater._checks(upd, {"step": np.int32(4 * k)}) for k in range(7)]
    assert steps == [True, False, False, True, False, False, True]
    upd.check_every = 0
    assert not updater._checks(upd, {"step": np.int32(0)})
    upd.recompute = True
    assert updater._checks(upd, {"step": np.int32(5)})
