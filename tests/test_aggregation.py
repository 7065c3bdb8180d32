"""Tests for ba_jax.aggregation: every rule against a plain NumPy transcription of the
spec's formula on ragged batches, the spec's identities 1-5 (loss and gradient through
a tiny softmax policy head), diagnostics, rule resolution. Identity 6 (micro-batches,
devices) is in test_grpo.py next to accumulate_gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax import aggregation as agg
from ba_jax import grpo

NUM_GROUPS = 8
ROWS, T = 24, 10


# ---------------------------------------------------------------- NumPy reference
def ref_weights(rule, mask, adv, gid, num_groups, max_len=None, count_degenerate_groups=True):
    """The spec's table, loop by loop; absent rows (no tokens / id out of range) skipped."""
    lengths = mask.sum(1)
    present = [i for i in range(len(adv)) if lengths[i] > 0 and 0 <= gid[i] < num_groups]
    groups = {}
    for i in present:
        groups.setdefault(int(gid[i]), []).append(i)
    n_rows = len(present)
    active = [g for g, rows in groups.items() if any(adv[j] != 0 for j in rows)]
    n_groups = len(groups) if count_degenerate_groups else len(active)
    pos_all = [j for j in present if adv[j] > 0]
    neg_all = [j for j in present if adv[j] < 0]
    c = np.zeros(len(adv))
    for i in present:
        rows = groups[int(gid[i])]
        same_sign = [j for j in rows if np.sign(adv[j]) == np.sign(adv[i])]
        if rule == "token":
            c[i] = 1.0 / sum(lengths[j] for j in present)
        elif rule == "token_group":
            c[i] = 0.0 if n_groups == 0 else 1.0 / (n_groups * sum(lengths[j] for j in rows))
        elif rule == "sequence":
            c[i] = 1.0 / (n_rows * lengths[i])
        elif rule == "sequence_sum":
            c[i] = 1.0 / n_rows
        elif rule == "constant":
            c[i] = 1.0 / (n_rows * (mask.shape[1] if max_len is None else max_len))
        elif rule == "balanced":
            if adv[i] != 0:
                lbar = np.mean([lengths[j] for j in same_sign])
                c[i] = 1.0 / (n_groups * len(rows) * lbar)
        elif rule == "balanced_batch":
            if adv[i] != 0:
                lbar = np.mean([lengths[j] for j in (pos_all if adv[i] > 0 else neg_all)])
                c[i] = 1.0 / (n_rows * lbar)
        else:
            raise AssertionError(rule)
    return mask * c[:, None]


def ragged_batch(seed, rows=ROWS, t=T, num_groups=NUM_GROUPS, adv_from_present_rows=False):
    """Unequal group sizes, unused ids, shuffled rows, zero-length and padding rows,
    degenerate and single-row groups, binary rewards with GRPO advantages (computed
    over all rows, or over present rows only so that n+ A+ + n- A- = 0 holds)."""
    rng = np.random.default_rng(seed)
    gid = rng.integers(0, num_groups - 2, size=rows)  # the last two ids stay unused
    gid[:2] = 0  # group 0 has >= 2 rows
    gid[-1] = num_groups - 3
    lengths = rng.integers(1, t + 1, size=rows)
    lengths[rng.random(rows) < 0.1] = 0  # zero-length responses
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = (rng.random(rows) < 0.5).astype(np.float32)
    rewards[gid == 1] = 1.0  # a degenerate group
    pad = rng.random(rows) < 0.1  # padding rows: empty mask, any group id
    mask[pad] = 0.0
    adv_gid = np.where(mask.sum(1) > 0, gid, -1) if adv_from_present_rows else gid
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), jnp.asarray(adv_gid), num_groups))
    perm = rng.permutation(rows)
    return mask[perm], adv[perm].astype(np.float32), gid[perm].astype(np.int32)


@pytest.mark.parametrize("count_degenerate_groups", [True, False])
@pytest.mark.parametrize("rule", agg.RULES)
def test_rules_match_numpy_reference(rule, count_degenerate_groups):
    for seed in range(4):
        mask, adv, gid = ragged_batch(seed)
        adv[seed] = 0.0  # a zero advantage inside a mixed group
        opts = dict(count_degenerate_groups=count_degenerate_groups, max_len=16)
        w = agg.token_weights(rule, mask, adv, gid, NUM_GROUPS, **opts)
        assert w.dtype == jnp.float32
        np.testing.assert_allclose(w, ref_weights(rule, mask, adv, gid, NUM_GROUPS, **opts),
                                   rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("rule", agg.RULES)
def test_edge_cases_are_finite(rule):
    mask = np.zeros((6, 5), np.float32)
    mask[0, :3] = mask[1, :2] = mask[2, :4] = mask[3, :1] = 1.0  # rows 4, 5: padding
    cases = {
        "all degenerate": (np.zeros(6), [0, 0, 1, 1, 0, 3]),
        "only positives": (np.array([1.0, 0.5, 2.0, 1.0, -1.0, 1.0]), [0, 0, 1, 2, 0, 3]),
        "single-row groups": (np.array([0.0, 1.0, -1.0, 0.0, 1.0, -1.0]), [0, 1, 2, 3, 4, 5]),
        "ids out of range": (np.array([1.0, -1.0, 1.0, -1.0, 1.0, 1.0]), [0, 0, 1, 1, -1, 9]),
    }
    for name, (adv, gid) in cases.items():
        for count in (True, False):
            adv32, gid32 = np.asarray(adv, np.float32), np.asarray(gid, np.int32)
            w = np.asarray(agg.token_weights(rule, mask, adv32, gid32, 6,
                                             count_degenerate_groups=count))
            assert np.all(np.isfinite(w)), name
            np.testing.assert_allclose(
                w, ref_weights(rule, mask, adv32, gid32, 6, count_degenerate_groups=count),
                rtol=1e-6, atol=1e-9, err_msg=name)
            assert np.all(w[4:] == 0), name  # padding rows are harmless
    empty = agg.token_weights(rule, np.zeros((3, 4)), np.ones(3), np.zeros(3, np.int32), 2)
    np.testing.assert_array_equal(empty, 0.0)


def test_padding_rows_change_nothing():
    mask, adv, gid = ragged_batch(7)
    pad_mask = np.concatenate([mask, np.zeros((4, T), np.float32)])
    pad_adv = np.concatenate([adv, np.array([1.0, -1.0, 0.0, 2.0], np.float32)])
    pad_gid = np.concatenate([gid, np.array([0, 1, 7, 3], np.int32)])
    for rule in agg.RULES:
        w = agg.token_weights(rule, mask, adv, gid, NUM_GROUPS)
        w_pad = agg.token_weights(rule, pad_mask, pad_adv, pad_gid, NUM_GROUPS)
        np.testing.assert_allclose(w_pad[: len(adv)], w, rtol=1e-6, err_msg=rule)


# ------------------------------------------------------ identities, through a policy head
D, V = 4, 6


def policy_batch(mask, adv, seed=0):
    rng = np.random.default_rng(100 + seed)
    rows, t = mask.shape
    return dict(
        x_BTD=jnp.asarray(rng.normal(size=(rows, t, D)), jnp.float32),
        tokens_BT=jnp.asarray(rng.integers(0, V, size=(rows, t)), jnp.int32),
        old_logp_BT=jnp.asarray(-1.8 + 0.3 * rng.normal(size=(rows, t)), jnp.float32),
        mask_BT=jnp.asarray(mask),
        adv_B=jnp.asarray(adv),
    )


def head_params(seed=0):
    return {"w_DV": jnp.asarray(np.random.default_rng(seed).normal(size=(D, V)) * 0.5,
                                jnp.float32)}


@jax.jit
def per_token_loss(params, batch):
    logits_BTV = jnp.einsum("btd,dv->btv", batch["x_BTD"], params["w_DV"])
    logp_BT = grpo.token_logprobs(logits_BTV, batch["tokens_BT"])
    loss_BT, _ = grpo.clipped_surrogate(logp_BT, batch["old_logp_BT"], batch["adv_B"])
    return loss_BT


def loss_and_grad(rule, params, batch, gid, num_groups):
    def f(p):
        return agg.aggregate(rule, per_token_loss(p, batch), batch["mask_BT"], batch["adv_B"],
                             jnp.asarray(gid), num_groups)
    return jax.value_and_grad(f)(params)


def assert_same_loss_and_grad(rules, mask, adv, gid, num_groups):
    params, batch = head_params(), policy_batch(mask, adv)
    base_loss, base_grad = loss_and_grad(rules[0], params, batch, gid, num_groups)
    assert abs(float(base_loss)) > 1e-3 and float(jnp.abs(base_grad["w_DV"]).max()) > 1e-4
    for rule in rules[1:]:
        loss, grad = loss_and_grad(rule, params, batch, gid, num_groups)
        np.testing.assert_allclose(loss, base_loss, rtol=1e-5, err_msg=rule)
        np.testing.assert_allclose(grad["w_DV"], base_grad["w_DV"], rtol=1e-4, atol=1e-7,
                                   err_msg=rule)


def equal_groups(num_groups, size, seed):
    rng = np.random.default_rng(seed)
    gid = np.repeat(np.arange(num_groups), size).astype(np.int32)
    rewards = (rng.random(num_groups * size) < 0.5).astype(np.float32)
    rewards[:size] = 1.0  # one degenerate group
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), jnp.asarray(gid), num_groups))
    return gid, adv, rng.permutation(num_groups * size)


def mask_from(lengths, t=T):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def test_identity_1_equal_lengths():
    gid, adv, perm = equal_groups(4, 4, seed=1)
    mask = mask_from(np.full(16, 7))
    assert_same_loss_and_grad(["token", "token_group", "sequence", "balanced"],
                              mask[perm], adv[perm], gid[perm], 4)


def test_identity_2_equal_subset_means_balanced_is_token_group():
    gid = np.repeat(np.arange(3), 4).astype(np.int32)
    adv = np.array([1, 1, -1, -1, 1, -1, -1, -1, 0, 0, 0, 0], np.float32)
    lengths = [3, 7, 4, 6, 5, 2, 5, 8, 9, 1, 3, 3]  # Lbar+ == Lbar- in every group
    perm = np.random.default_rng(2).permutation(12)
    assert_same_loss_and_grad(["balanced", "token_group"], mask_from(lengths)[perm], adv[perm],
                              gid[perm], 3)
    # And not vacuous: token differs here.
    params, batch = head_params(), policy_batch(mask_from(lengths)[perm], adv[perm])
    l_tok, _ = loss_and_grad("token", params, batch, gid[perm], 3)
    l_bal, _ = loss_and_grad("balanced", params, batch, gid[perm], 3)
    assert abs(float(l_tok) - float(l_bal)) > 1e-4


def test_identity_3_constant_subset_lengths_balanced_is_sequence():
    gid, adv, perm = equal_groups(5, 4, seed=3)
    rng = np.random.default_rng(3)
    len_pos, len_neg = rng.integers(1, T + 1, 5), rng.integers(1, T + 1, 5)
    lengths = np.where(adv > 0, len_pos[gid], np.where(adv < 0, len_neg[gid], 5))
    assert_same_loss_and_grad(["balanced", "sequence"], mask_from(lengths)[perm], adv[perm],
                              gid[perm], 5)


def test_identity_4_signed_mass():
    mask, adv, gid = ragged_batch(11, adv_from_present_rows=True)
    for rule, balanced_sides in [("sequence", True), ("balanced", True), ("token", False)]:
        w_B = np.asarray(agg.token_weights(rule, mask, adv, gid, NUM_GROUPS)).sum(1)
        lengths = mask.sum(1)
        masses = []
        for g in range(NUM_GROUPS):
            rows = (gid == g) & (lengths > 0)
            if (adv[rows] > 0).any() and (adv[rows] < 0).any():
                masses.append(float((w_B[rows] * adv[rows]).sum()))
        assert len(masses) >= 3
        if balanced_sides:
            np.testing.assert_allclose(masses, 0.0, atol=1e-6, err_msg=rule)
        else:
            assert max(abs(m) for m in masses) > 1e-3
        # diagnostics reports the same quantity, averaged over mixed groups
        d = agg.diagnostics(rule, mask, adv, gid, NUM_GROUPS)
        assert float(d["num_mixed_groups"]) == len(masses)
        np.testing.assert_allclose(d["signed_mass"], np.mean(masses), atol=1e-7)


@pytest.mark.parametrize("rule", agg.RULES)
def test_identity_5_permutation_invariance(rule):
    mask, adv, gid = ragged_batch(5)
    loss_BT = np.random.default_rng(5).normal(size=mask.shape).astype(np.float32)
    perm = np.random.default_rng(6).permutation(ROWS)
    base = agg.aggregate(rule, loss_BT, mask, adv, gid, NUM_GROUPS)
    permuted = agg.aggregate(rule, loss_BT[perm], mask[perm], adv[perm], gid[perm], NUM_GROUPS)
    assert abs(float(base)) > 1e-4
    np.testing.assert_allclose(permuted, base, rtol=1e-5)


# ------------------------------------------------------------------------ the rest
def test_aggregate_is_weighted_sum_and_weights_have_no_gradient():
    mask, adv, gid = ragged_batch(3)
    loss_BT = jnp.asarray(np.random.default_rng(0).normal(size=mask.shape), jnp.float32)
    w = agg.token_weights("balanced", mask, adv, gid, NUM_GROUPS)
    np.testing.assert_allclose(agg.aggregate("balanced", loss_BT, mask, adv, gid, NUM_GROUPS),
                               jnp.sum(w * loss_BT), rtol=1e-6)
    g_mask, g_adv = jax.grad(
        lambda m, a: agg.token_weights("balanced", m, a, gid, NUM_GROUPS).sum(), argnums=(0, 1)
    )(jnp.asarray(mask), jnp.asarray(adv))
    assert not np.any(g_mask) and not np.any(g_adv)


def test_unknown_rule_and_bad_path():
    with pytest.raises(ValueError, match="balanced_batch"):
        agg.token_weights("tokn", np.ones((2, 2)), np.ones(2), np.zeros(2, np.int32), 1)
    with pytest.raises(ValueError, match="no_such_pkg.mod:rule"):
        agg.resolve_rule("no_such_pkg.mod:rule")
    with pytest.raises(ValueError, match="numpy.no_such_fn"):
        agg.resolve_rule("numpy.no_such_fn")


@pytest.mark.parametrize("rule", ["token", "balanced"])
def test_resolved_builtin_returns_token_weights(rule):
    mask, adv, gid = ragged_batch(8)
    w = agg.resolve_rule(rule)(jnp.asarray(mask), jnp.asarray(adv), jnp.asarray(gid), NUM_GROUPS)
    assert w.shape == mask.shape
    np.testing.assert_allclose(w, agg.token_weights(rule, mask, adv, gid, NUM_GROUPS), rtol=1e-6)


def half_sequence(mask_BT, adv_B, group_id_B, num_groups, *, scale=0.5, **options):
    """A user rule for the tests: `sequence` scaled by an extra option."""
    return scale * agg.token_weights("sequence", mask_BT, adv_B, group_id_B, num_groups, **options)


@pytest.mark.parametrize("spec", [half_sequence, f"{__name__}:half_sequence",
                                  f"{__name__}.half_sequence"])
def test_user_rule(spec):
    assert agg.resolve_rule(spec) is half_sequence
    mask, adv, gid = ragged_batch(4)
    loss_BT = np.random.default_rng(1).normal(size=mask.shape).astype(np.float32)
    seq = agg.aggregate("sequence", loss_BT, mask, adv, gid, NUM_GROUPS)
    np.testing.assert_allclose(agg.aggregate(spec, loss_BT, mask, adv, gid, NUM_GROUPS),
                               0.5 * seq, rtol=1e-6)
    np.testing.assert_allclose(agg.aggregate(spec, loss_BT, mask, adv, gid, NUM_GROUPS, scale=2.0),
                               2.0 * seq, rtol=1e-6)


def test_no_retrace_for_second_batch():
    traces = []

    @jax.jit
    def step(loss_BT, mask_BT, adv_B, gid_B):
        traces.append(1)
        return agg.aggregate("balanced", loss_BT, mask_BT, adv_B, gid_B, NUM_GROUPS)

    for seed in (0, 1, 2):
        mask, adv, gid = ragged_batch(seed)
        step(np.ones_like(mask), mask, adv, gid)
    assert len(traces) == 1


def ref_diagnostics(rule, mask, adv, gid, num_groups):
    lengths = mask.sum(1)
    w_B = ref_weights(rule, mask, adv, gid, num_groups).sum(1)
    w_tok_B = ref_weights("token", mask, adv, gid, num_groups).sum(1)
    out = {k: [] for k in ["mean_length", "length_cv", "length_cv_pos", "length_cv_neg",
                           "length_gap", "pos_weight_share", "signed_mass", "signed_mass_token"]}
    for g in range(num_groups):
        rows = (gid == g) & (lengths > 0)
        pos, neg = rows & (adv > 0), rows & (adv < 0)
        if not (pos.any() and neg.any()):
            continue
        cv = lambda sel: np.std(lengths[sel]) / np.mean(lengths[sel])  # noqa: E731
        out["mean_length"].append(lengths[rows].mean())
        out["length_cv"].append(cv(rows))
        out["length_cv_pos"].append(cv(pos))
        out["length_cv_neg"].append(cv(neg))
        out["length_gap"].append(lengths[neg].mean() / lengths[pos].mean())
        out["pos_weight_share"].append(w_B[pos].sum() / w_B[rows].sum())
        out["signed_mass"].append((w_B[rows] * adv[rows]).sum())
        out["signed_mass_token"].append((w_tok_B[rows] * adv[rows]).sum())
    return {k: np.mean(v) for k, v in out.items()}, len(out["mean_length"])


@pytest.mark.parametrize("rule", ["balanced", "sequence"])
def test_diagnostics_match_reference(rule):
    mask, adv, gid = ragged_batch(9)
    got = agg.diagnostics(rule, mask, adv, gid, NUM_GROUPS)
    want, n_mixed = ref_diagnostics(rule, mask, adv, gid, NUM_GROUPS)
    assert n_mixed >= 2 and float(got["num_mixed_groups"]) == n_mixed
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert abs(float(got["signed_mass_token_rel"])) <= 1.0


def test_diagnostics_without_mixed_groups_are_zero():
    mask = mask_from([3, 4, 5, 0])
    got = agg.diagnostics("balanced", mask, np.zeros(4, np.float32),
                          np.array([0, 0, 1, 1], np.int32), 2)
    assert set(got) >= {"num_mixed_groups", "length_gap", "pos_weight_share"}
    for k, v in got.items():
        assert float(v) == 0.0, k


def test_ref_weights_agree_with_spec_form():
    """The reference itself against the paper's per-group form of BA, on one group."""
    lengths = np.array([2, 6, 3, 5, 4])
    adv = np.array([1.0, 1.0, -1.0, -1.0, -1.0])
    l_BT = np.random.default_rng(0).normal(size=(5, T))
    mask = mask_from(lengths).astype(np.float64)
    sums = (mask * l_BT).sum(1)
    paper = (2 / 5) * sums[:2].sum() / 8 + (3 / 5) * sums[2:].sum() / 12
    w = ref_weights("balanced", mask, adv, np.zeros(5, int), 1)
    np.testing.assert_allclose((w * l_BT).sum(), paper, rtol=1e-12)
