"""The packed train step (grpo.max_tokens_per_device): the packer's plan and blocks, and
packed == padded for the whole update (loss, gradient, every metric) in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train import debug_config

from ba_jax import build, packing, run_config, train, updater

R = 16  # response slots of the test batches
TP = 16  # prompt bucket


def _batch(cfg, kind: str, seed: int = 0):
    """One step's rows: `mixed` random prompt and response lengths, with one empty response
    (a row whose response scores nothing); `full` every prompt and response full-length."""
    P, G, V = cfg.rollout.prompts_per_step, cfg.rollout.num_samples, cfg.model.vocab_size
    B = P * G
    rng = np.random.default_rng(seed)
    if kind == "full":
        p_B, r_B = np.full(B, TP), np.full(B, R)
    else:
        p_B, r_B = rng.integers(1, TP + 1, size=B), rng.integers(1, R + 1, size=B)
        r_B[3] = 0
    return dict(
        prompt_tokens_BT=rng.integers(0, V, size=(B, TP)).astype(np.int32),
        prompt_mask_BT=(np.arange(TP)[None] >= TP - p_B[:, None]).astype(np.int32),
        tokens_BR=rng.integers(0, V, size=(B, R)).astype(np.int32),
        mask_BR=(np.arange(R)[None] < r_B[:, None]).astype(np.float32),
        adv_B=(rng.standard_normal(B) + 0.3).astype(np.float32),
        group_id_B=np.repeat(np.arange(P), G).astype(np.int32))


def _config(n_devices: int, **over):
    mesh = {"mesh.data": 1} if n_devices == 1 else {"mesh.data": 4, "mesh.fsdp": 2}
    return debug_config(**{"rollout.max_new_tokens": R, "data.max_prompt_tokens": TP,
                           "grpo.logp_check_every": 0, **mesh, **over})


def _keep_gradient():
    """An optax stage whose state is the last gradient it saw (passed on unchanged)."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, state, params=None: (g, g))


def _run(cfg, n_devices: int, budget: int, batch: dict, lr: float):
    """(metrics, [last gradient, new parameters], updater) of one `updater.update` with
    plain SGD."""
    mesh = build.make_mesh(cfg, jax.devices()[:n_devices])
    graphdef, params = build.init_policy(cfg, mesh)
    sgd = optax.chain(_keep_gradient(), optax.sgd(lr))
    state = train.init_state(params, sgd, mesh)
    g = cfg.grpo
    upd = updater.make_updater(
        build.loss_settings(cfg), graphdef, sgd, state, mesh,
        prompts_per_step=cfg.rollout.prompts_per_step, sample_shards=cfg.rollout.sample_shards,
        num_samples=cfg.rollout.num_samples, num_minibatches=g.num_minibatches,
        num_updates=g.num_updates, recompute_old_logp=build.old_logp_recompute(cfg),
        compute_dtype=np.float32, max_tokens_per_device=budget,
        attn_cost=packing.attention_cost(1, 4, 8, 10_000))
    state, metrics = updater.update(upd, state, batch)
    upd.state_for_test = state
    grads, params = jax.device_get((state["opt_state"][0], state["params"]))
    return metrics, (jax.tree.leaves(grads), jax.tree.leaves(params)), upd


def _old_logp(cfg, batch, seed=1):
    """The policy's own log-probs plus noise: ratios near, not at, 1 (clipping active)."""
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    old = np.asarray(train.make_reference_fn(1, graphdef, params, mesh)(params, batch))
    noise = np.random.default_rng(seed).standard_normal(old.shape).astype(np.float32)
    return old + 0.3 * noise


PACK_KEYS = ("train_token_fraction", "train_microbatches", "pack_imbalance")


def _assert_same(padded, packed):
    (m0, d0, _), (m1, d1, _) = padded, packed
    assert set(m0) == set(m1)
    assert m0["nonfinite_updates"] == m1["nonfinite_updates"] == 0.0
    scale = max(abs(m0["loss"]), abs(m0["grad_norm"]), 1e-3)
    for k in sorted(set(m0) - set(PACK_KEYS)):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7 * scale, err_msg=k)
    assert float(m0["grad_norm"]) > 1e-3  # a real gradient
    for a, b in zip(d0[0], d1[0]):  # the last update's gradient
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    for a, b in zip(d0[1], d1[1]):  # the parameters after every update
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def _compare(n_devices, budget, kind="mixed", lr=1.0, **over):
    cfg = _config(n_devices, **over)
    batch = _batch(cfg, kind)
    batch["old_logp_BR"] = _old_logp(_config(1, **over), batch)
    padded = _run(cfg, n_devices, 0, batch, lr)
    packed = _run(cfg, n_devices, budget, batch, lr)
    _assert_same(padded, packed)
    return padded, packed


@pytest.mark.parametrize("rule", [*__import__("ba_jax.aggregation").aggregation.RULES,
                                  "custom_rules:per_sequence"])
def test_packed_equals_padded_every_rule(rule):
    """Each rule's weights come from the padded mini-batch and travel with their tokens:
    several blocks (a budget of 48 over 16 rows of up to 31 tokens), one empty response."""
    _, (m, _, _) = _compare(1, 48, **{"grpo.aggregation": rule})
    assert m["train_microbatches"] > 1


@pytest.mark.parametrize("kl, devices", [("k1", 1), ("k2", 1), ("k3", 8)])
def test_packed_equals_padded_kl_dual_clip_minibatches_updates(kl, devices):
    """The KL reference's forward packed, dual clip, 2 mini-batches x 2 updates, on 1 device
    and on 8 (data 4 x fsdp 2): the second update sees a moved policy, so KL and ratios are
    real."""
    (m0, _, _), _ = _compare(devices, 40, lr=0.3, **{
        "grpo.kl_kind": kl, "grpo.kl_beta": 0.5, "grpo.dual_clip": 2.0,
        "grpo.num_minibatches": 2, "grpo.num_updates": 2})
    assert abs(m0["kl"]) > 1e-6 and m0["clipfrac_dual"] > 0  # k1 may be negative


def test_packed_equals_padded_recompute_with_correction():
    """pi_old recomputed by the packed forward, the engine's log-probs kept for the
    sequence-level correction and the mismatch metrics (rollout_*), on 1 device."""
    (m0, _, _), _ = _compare(1, 64, **{"grpo.old_logp": "recompute",
                                       "grpo.rollout_is": "sequence",
                                       "grpo.rollout_rs": "token"})
    assert m0["rollout_logp_diff_mean"] > 0.1


def test_full_length_rows_and_one_sequence_per_block():
    """Every row full-length with a budget of exactly one sequence: one sequence per block,
    packing is padding (token fraction 1 against the padded rows' own)."""
    _, (m, _, upd) = _compare(1, TP + R - 1, kind="full")
    assert m["train_microbatches"] == 16 and m["train_token_fraction"] == 1.0


def test_one_compile_over_steps_with_different_block_counts():
    """Steps whose mini-batches need different numbers of blocks run the same compiled
    functions: the block shape is fixed, the count is the host loop's."""
    cfg = _config(1)
    counts = []
    for seed in range(4):
        b = _batch(cfg, "mixed" if seed % 2 else "full", seed)
        b["old_logp_BR"] = np.zeros((16, R), np.float32)
        if seed == 0:
            m, _, upd = _run(cfg, 1, 48, b, 0.1)
            state = upd.state_for_test
        else:
            state, m = updater.update(upd, state, b)
        counts.append(m["train_microbatches"])
    assert len(set(counts)) > 1, counts
    pk = upd.packed
    for fn in (pk.inputs_fn, pk.fields_fn, pk.zeros_fn, pk.acc_fn, pk.apply_fn, upd.weigh_fn):
        assert fn._cache_size() == 1, fn


def test_plan_places_every_sequence_once_within_budget_and_balanced():
    rng = np.random.default_rng(0)
    L = np.minimum(rng.lognormal(5.5, 1.0, size=300).astype(int) + 1, 2048)
    L[:5] = 0  # left out
    for strategy in packing.STRATEGIES:
        pl = packing.plan(L, 4, 2048, attn_cost=1e-4, strategy=strategy)
        assert (pl.block_B[:5] == -1).all() and (pl.block_B[5:] >= 0).all()
        assert pl.tokens_KD.sum() == L.sum() and pl.tokens_KD.max() <= 2048
        # no two sequences overlap in a row
        for k in range(pl.num_blocks):
            for d in range(4):
                mine = np.nonzero((pl.block_B == k) & (pl.device_B == d))[0]
                spans = sorted((pl.offset_B[i], pl.offset_B[i] + L[i]) for i in mine)
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert pl.num_blocks <= -(-L.sum() // (4 * 2048)) + 1
    bal = packing.plan(L, 4, 2048, attn_cost=1e-4)
    assert packing.imbalance(bal.load_KD) < 1.05


def test_block_indices_rebuild_each_sequence():
    p_B, r_B = np.array([3, 1, 2, 4]), np.array([2, 0, 5, 1])
    L = packing.packed_lengths(p_B, r_B)
    assert L.tolist() == [4, 0, 6, 4]
    pl = packing.plan(L, 2, 8)
    idx = packing.block_indices(pl, p_B, r_B, 4, 5, row_offset=10)
    tok, resp, row, seg, pos = (idx[k].reshape(-1) for k in ("tok", "resp", "row", "seg",
                                                              "pos"))
    for b in (0, 2, 3):
        at = np.nonzero(row == 10 + b)[0]
        assert len(at) == L[b] and (np.diff(at) == 1).all()
        assert pos[at].tolist() == list(range(L[b])) and len(set(seg[at])) == 1
        # the inputs: the prompt's last p_B tokens, then the response minus its last
        assert tok[at].tolist() == [(10 + b) * 9 + 4 - p_B[b] + t for t in range(L[b])]
        scored = resp[at]
        assert scored[:p_B[b] - 1].tolist() == [-1] * (p_B[b] - 1)
        assert scored[p_B[b] - 1:].tolist() == [(10 + b) * 5 + j for j in range(r_B[b])]
    assert not (row == 11).any() and (seg[row < 0] == 0).all() and (resp[row < 0] == -1).all()


def test_too_long_sequence_and_microbatches_are_startup_errors():
    with pytest.raises(run_config.ConfigError, match=r"max_tokens_per_device=20 .* 31 tokens"):
        run_config.validate(_config(1, **{"grpo.max_tokens_per_device": 20}), 1)
    with pytest.raises(run_config.ConfigError, match="num_microbatches=2"):
        run_config.validate(_config(1, **{"grpo.max_tokens_per_device": 64,
                                          "grpo.num_microbatches": 2}), 1)
    with pytest.raises(ValueError, match="row 1: a sequence of 40 tokens does not fit .*=32"):
        packing.plan(np.array([5, 40]), 1, 32)


def test_agreed_block_count_runs_empty_blocks(monkeypatch):
    """Under several processes the block count is the largest any process needs: here the
    other process is made to need 2 more, so this one runs 2 empty blocks (all padding),
    which change no sum: still the padded step's result."""
    from ba_jax import distributed

    real = distributed.gather_rows

    def other_needs_more(rows):
        if set(rows) == {"n"}:
            return dict(n=np.concatenate([rows["n"], rows["n"] + 2]))
        return real(rows)

    cfg = _config(1)
    batch = _batch(cfg, "mixed")
    batch["old_logp_BR"] = _old_logp(cfg, batch)
    padded = _run(cfg, 1, 0, batch, 1.0)
    alone = _run(cfg, 1, 48, batch, 1.0)[0]["train_microbatches"]
    monkeypatch.setattr(distributed, "gather_rows", other_needs_more)
    packed = _run(cfg, 1, 48, batch, 1.0)
    _assert_same(padded, packed)
    assert packed[0]["train_microbatches"] == alone + 2


@pytest.mark.parametrize("impl, platform, marker", [
    ("splash", "tpu", "tpu_custom_call"),
    # with rows over the mesh jax wraps the cuDNN call in its custom partitioner (expanded
    # by XLA on the GPU); tests/test_segments.py checks the packed layout in the call itself
    ("cudnn", "cuda", "@CustomSPMDPartitioning("),
])
def test_packed_block_gradient_lowers_for_accelerators(impl, platform, marker):
    """The real block program of the packed step (`acc_fn`: one block's gradient into the
    accumulator), bf16 on 8 devices (data 4 x fsdp 2), lowers for TPU with splash's
    SegmentIds and for GPU with cuDNN's packed layout; compiling it happens only on the
    hardware. Stubbed for cuda as in tests/test_segments.py: jax's cuDNN version and
    compute-capability queries (this host has no GPU)."""
    import contextlib
    from unittest import mock

    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    from ba_jax import compat

    stubs = contextlib.ExitStack()
    if platform == "cuda":
        stubs.enter_context(mock.patch.object(cudnn_fa, "check_cudnn_version",
                                              return_value=90800))
        stubs.enter_context(mock.patch.object(cudnn_fa, "check_compute_capability",
                                              return_value=True))
        stubs.enter_context(compat.host_lowers_as_gpu())
    with stubs:  # make_packed traces the model (eval_shape) too
        cfg = _config(8, **{"model.attention": impl, "model.dtype": "bfloat16",
                            "model.head_dim": 128})
        mesh = build.make_mesh(cfg)
        graphdef, params = build.init_policy(cfg, mesh)
        tx = optax.sgd(0.1)
        state = train.init_state(params, tx, mesh)
        upd = updater.make_updater(
            build.loss_settings(cfg), graphdef, tx, state, mesh, prompts_per_step=4,
            sample_shards=1, num_samples=4, num_minibatches=1, num_updates=1,
            recompute_old_logp=False, compute_dtype=jnp.bfloat16, max_tokens_per_device=256)
        pk = upd.packed
        row = lambda dt: jax.ShapeDtypeStruct((8, 256), dt, sharding=upd.row_sharding)  # noqa: E731
        blk = {k: row(jnp.int32) for k in ("tokens", "segment_ids", "positions", "targets")}
        blk.update(scored=row(bool), **{k: row(jnp.float32) for k in ("mask", "old_logp", "w",
                                                                      "adv")})
        acc = jax.eval_shape(pk.zeros_fn, state["params"])
        text = pk.acc_fn.trace(state["params"], acc, blk).lower(
            lowering_platforms=(platform,)).as_text()
    assert marker in text
