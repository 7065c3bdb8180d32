"""End-to-end trainer tests on the tiny `debug` config: every rule, resume, sharding, config errors."""

import contextlib
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from ba_jax import aggregation, build, checkpoint, run_config, sharding, train
from ba_jax.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def debug_config(**overrides):
    return run_config.load_config(os.path.join(REPO, "configs", "default.py:debug"), **overrides)


def params_of(workdir):
    cfg = debug_config(**{"mesh.data": 1})
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state = train.init_state(params, tx, mesh)
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, meta = ck.restore_latest(state)
    ck.close()
    return step, jax.tree.leaves(jax.device_get(state["params"])), meta


@pytest.mark.parametrize("rule", aggregation.RULES)
def test_every_rule_runs_and_logs(tmp_path, rule):
    cfg = debug_config(**{"grpo.aggregation": rule, "num_train_steps": 1})
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        for key in ("reward_mean", "accuracy", "response_length_mean", "response_length_cv",
                    "grad_norm", "learning_rate", "entropy", "clipfrac_high", "diag_signed_mass_token",
                    "step_time_s", "sampling_time_share", "tokens_per_s", "weight_sync_time_s"):
            assert key in r, key
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
        assert 0.0 <= r["accuracy"] <= 1.0


def test_resume_equals_uninterrupted(tmp_path):
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.train_and_evaluate(debug_config(num_train_steps=4), full)
    train.train_and_evaluate(debug_config(num_train_steps=2), split)
    train.train_and_evaluate(debug_config(num_train_steps=4), split)
    s1, p1, m1 = params_of(full)
    s2, p2, m2 = params_of(split)
    assert s1 == s2 == 4
    assert m1["data_iterator"] == m2["data_iterator"]
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)
    r1, r2 = read_metrics(full), read_metrics(split)
    drop = ("step_time_s", "update_time_s", "checkpoint_time_s", "sample_time_s", "score_time_s",
            "sampling_time_share", "tokens_per_s", "weight_sync_time_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]  # noqa: E731
    assert strip(r1) == strip(r2)


def test_completed_run_is_not_restarted(tmp_path):
    cfg = debug_config(num_train_steps=2)
    train.train_and_evaluate(cfg, str(tmp_path))
    msg = train.train_and_evaluate(cfg, str(tmp_path))
    assert "run complete" in msg
    assert len(read_metrics(str(tmp_path))) == 2


def _random_batch(cfg, seed=0):
    """One step's rows of `cfg`'s shapes: random prompts and responses of random lengths, a
    random non-zero advantage per group member (so the RL gradient is not zero)."""
    P, G, R = cfg.rollout.prompts_per_step, cfg.rollout.num_samples, cfg.rollout.max_new_tokens
    B, Tp, V = P * G, 16, cfg.model.vocab_size
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, size=B)
    return dict(
        prompt_tokens_BT=rng.integers(0, V, size=(B, Tp)).astype(np.int32),
        prompt_mask_BT=(np.arange(Tp)[None] >= rng.integers(0, Tp - 1, size=(B, 1))).astype(
            np.int32),
        tokens_BR=rng.integers(0, V, size=(B, R)).astype(np.int32),
        mask_BR=(np.arange(R)[None] < lengths[:, None]).astype(np.float32),
        adv_B=(rng.standard_normal(B) + 0.5).astype(np.float32),
        group_id_B=np.repeat(np.arange(P), G).astype(np.int32))


def test_sharded_step_equals_single_device():
    """The jitted train step with rows over 8 CPU devices (data=4, fsdp=2) computes the loss,
    gradient norm and gradient of the 1-device step on a batch with a non-zero RL gradient.
    Plain SGD (lr 1) makes the parameter change the gradient itself: Adam's first step is
    about lr * sign(g), which turns float rounding in near-zero gradient entries into full
    steps of either sign and so compares nothing but noise there."""
    over = {"grpo.num_microbatches": 2}
    one = debug_config(**over, **{"mesh.data": 1})
    eight = debug_config(**over, **{"mesh.data": 4, "mesh.fsdp": 2})
    batch = _random_batch(one)
    sgd = optax.sgd(1.0)
    results = []
    for cfg, n in ((one, 1), (eight, 8)):
        mesh = build.make_mesh(cfg, jax.devices()[:n])
        graphdef, params = build.init_policy(cfg, mesh)
        if not results:  # the policy's own log-probs as the old ones: every ratio is 1
            old = train.make_reference_fn(1, graphdef, params, mesh)
            batch["old_logp_BR"] = np.asarray(old(params, batch))
        before = jax.tree.leaves(jax.device_get(params))
        state = train.init_state(params, sgd, mesh)
        step = train.make_train_step(build.loss_settings(cfg), graphdef, sgd, state, mesh,
                                     num_groups=cfg.rollout.prompts_per_step)
        state, out = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
        after = jax.tree.leaves(jax.device_get(state["params"]))
        results.append((jax.device_get(out), [b - a for b, a in zip(before, after)]))
    (m1, g1), (m8, g8) = results
    assert m1["nonfinite"] == m8["nonfinite"] == 0.0
    assert float(m1["grad_norm"]) > 1e-3  # a real gradient, not the zero of degenerate groups
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "weight_sum"):
        np.testing.assert_allclose(m8[key], m1[key], rtol=2e-5, err_msg=key)
    for a, b in zip(g1, g8):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5 * float(np.abs(a).max()))


def test_misspelled_override_is_an_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ba_jax.main", "--config=configs/default.py:debug",
         f"--workdir={tmp_path}", "--config.grpo.agregation=token"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "agregation" in proc.stderr


def test_unknown_rule_is_a_startup_error(tmp_path):
    with pytest.raises(run_config.ConfigError, match="balanced_batch"):
        train.train_and_evaluate(debug_config(**{"grpo.aggregation": "balancd"}), str(tmp_path))
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_kl_dynamic_sampling_minibatches_and_microbatches(tmp_path):
    cfg = debug_config(**{
        "num_train_steps": 2, "grpo.kl_kind": "k3", "grpo.kl_beta": 0.1,
        "grpo.dynamic_sampling": True, "grpo.max_resample_rounds": 2,
        "grpo.num_updates": 2, "grpo.num_minibatches": 2, "grpo.num_microbatches": 2,
        "grpo.overlong_buffer": 4, "grpo.dual_clip": 3.0,
    })
    train.train_and_evaluate(cfg, str(tmp_path), devices=jax.devices()[:2])
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["kl"]) and r["kl"] >= 0.0
        assert 1 <= r["sampling_rounds"] <= 3
    # 2 epochs x 2 mini-batches = 4 optimizer updates per step, none skipped.
    _, _, meta = params_of(str(tmp_path))
    assert meta["step"] == 2


def test_unreadable_latest_checkpoint_is_named_and_fallback_works(tmp_path):
    import shutil

    wd = str(tmp_path)
    train.train_and_evaluate(debug_config(num_train_steps=2), wd)
    ckdir = os.path.join(wd, "checkpoints")
    steps = sorted(int(d) for d in os.listdir(ckdir) if d.isdigit())
    assert steps[-1] == 2 and len(steps) >= 2
    shutil.rmtree(os.path.join(ckdir, "2", "state"))
    with pytest.raises(checkpoint.CheckpointError, match=os.path.join(ckdir, "2")):
        train.train_and_evaluate(debug_config(num_train_steps=3), wd)
    cfg = debug_config(**{"num_train_steps": 3, "checkpoint.fallback_to_previous": True})
    train.train_and_evaluate(cfg, wd)
    assert [r["step"] for r in read_metrics(wd)] == list(range(1, 4))


def test_start_from_converted_hf_weights(tmp_path):
    from ba_jax.models import convert_hf
    from helpers_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", arch="qwen3", tie=True)
    converted = str(tmp_path / "converted")
    convert_hf.save_checkpoint(convert_hf.load_hf(hf), converted)
    expected = jax.tree.leaves(jax.device_get(nnx_params(convert_hf.load_checkpoint(converted))))
    cfg = debug_config(**{"num_train_steps": 1, "model.init": "checkpoint",
                          "model.init_path": converted, "arithmetic.warmup_steps": 0})
    wd = str(tmp_path / "run")
    train.train_and_evaluate(cfg, wd)
    ck = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"))
    mesh = build.make_mesh(cfg)
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state, _ = ck.restore(0, train.init_state(params, tx, mesh))
    ck.close()
    for a, b in zip(expected, jax.tree.leaves(jax.device_get(state["params"]))):
        np.testing.assert_array_equal(a, b)
    assert len(read_metrics(wd)) == 1


def test_params_only_load_equals_the_full_restore(tmp_path):
    cfg = debug_config()
    mesh = build.make_mesh(cfg)
    _, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    ck = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
    ck.save(3, train.init_state(params, tx, mesh), dict(step=3))
    ck.save(5, train.init_state(jax.tree.map(lambda x: x + 1, params), tx, mesh), dict(step=5))
    ck.close()
    _, target = build.init_policy(debug_config(seed=1), mesh)  # other values, same shapes
    for step, offset in ((None, 1), (3, 0)):
        got, got_step = checkpoint.load_params(str(tmp_path / "checkpoints"), target, step=step)
        assert got_step == (5 if step is None else 3)
        for a, b, t in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(target)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b) + offset)
            assert a.sharding == t.sharding
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
        checkpoint.load_params(str(tmp_path / "empty"), target)
    _, wider = build.init_policy(debug_config(**{"model.hidden_size": 48}), mesh)
    with pytest.raises(checkpoint.CheckpointError, match=str(tmp_path / "checkpoints" / "5")):
        checkpoint.load_params(str(tmp_path / "checkpoints"), wider)


def nnx_params(model):
    from flax import nnx

    return nnx.split(model)[1]


def test_plot_command_overlays_runs(tmp_path):
    from ba_jax import plot

    for name, acc in (("a", 0.1), ("b", 0.5)):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(1, 6):
                f.write(json.dumps({"step": step, "reward_mean": acc, "accuracy": acc * step,
                                    "response_length_mean": 10.0 + step}) + "\n")
    out = tmp_path / "plots"
    plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert sorted(os.listdir(out)) == ["accuracy.png", "response_length_mean.png", "reward_mean.png"]


def _abstract_batch(cfg, mesh):
    """ShapeDtypeStructs of one mini-batch with the train step's row sharding."""
    P, G, R = cfg.rollout.prompts_per_step, cfg.rollout.num_samples, cfg.rollout.max_new_tokens
    B, Tp = P * G, 16
    row = sharding.batch_sharding(mesh)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=row)

    return dict(prompt_tokens_BT=sds((B, Tp), jnp.int32), prompt_mask_BT=sds((B, Tp), jnp.int32),
                tokens_BR=sds((B, R), jnp.int32), mask_BR=sds((B, R), jnp.float32),
                old_logp_BR=sds((B, R), jnp.float32), adv_B=sds((B,), jnp.float32),
                group_id_B=sds((B,), jnp.int32))


def _train_step(cfg, num_devices):
    """(state, jitted train step, mesh) of `cfg` on the first `num_devices` devices."""
    mesh = build.make_mesh(cfg, jax.devices()[:num_devices])
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state = train.init_state(params, tx, mesh)
    step = train.make_train_step(build.loss_settings(cfg), graphdef, tx, state, mesh,
                                 num_groups=cfg.rollout.prompts_per_step)
    return state, step, mesh


@pytest.mark.parametrize("impl, platform, devices, forward, backward", [
    ("splash", "tpu", 8, "tpu_custom_call", None),
    ("cudnn", "cuda", 1, "@__cudnn$fmhaSoftmax(", "@__cudnn$fmhaSoftmaxBackward("),
    # on several devices jax wraps the cuDNN calls in their custom partitioner, which XLA's
    # SPMD partitioner expands on the GPU: the lowered text shows the wrapper only
    ("cudnn", "cuda", 8, "@CustomSPMDPartitioning(", "@CustomSPMDPartitioning("),
])
def test_train_step_lowers_for_accelerators(impl, platform, devices, forward, backward):
    """The real jitted train step (bf16, rows over the devices) lowers for the platform whose
    kernel it names, with that kernel in its forward and its backward. The CPU jaxlib has no
    CUDA plugin, so jax's trace-time cuDNN version query is stood in for (as in
    test_attention); compiling (Mosaic, cuDNN) only happens on the hardware."""
    cfg = debug_config(**{"model.attention": impl, "model.dtype": "bfloat16",
                          "mesh.data": devices})
    state, step, mesh = _train_step(cfg, devices)
    patch = (mock.patch.object(cudnn_fa, "check_cudnn_version", return_value=90800)
             if impl == "cudnn" else contextlib.nullcontext())
    with patch:
        text = step.trace(state, _abstract_batch(cfg, mesh)).lower(
            lowering_platforms=(platform,)).as_text()
    if backward is None:  # splash: the forward kernel, then the backward's dq and dkv kernels
        assert text.count(forward) >= 3, text.count(forward)
    elif forward == backward:  # one wrapper per call: the forward's and the backward's
        assert text.count(forward) >= 2, text.count(forward)
    else:
        assert text.count(forward) >= 1 and text.count(backward) >= 1


def _compiled_step(cfg, num_devices):
    state, step, mesh = _train_step(cfg, num_devices)
    return step.trace(state, _abstract_batch(cfg, mesh)).lower().compile()


def test_fsdp_splits_the_rows_not_the_batch():
    """Under fsdp=8 each device holds its own rows' activations: the compiled step's
    per-device temp bytes are about 1/8 of the 1-device step's (activations dominate this
    cut: 32 rows x 143 tokens, 2 layers). Without the activation constraints the partitioner
    gathers the rows onto every device (3.5x more here)."""
    over = {"mesh.data": 1, "rollout.prompts_per_step": 8, "rollout.num_samples": 4,
            "rollout.max_new_tokens": 128, "model.hidden_size": 64,
            "model.intermediate_size": 128, "model.vocab_size": 512}
    one = _compiled_step(debug_config(**over), 1).memory_analysis().temp_size_in_bytes
    eight = _compiled_step(debug_config(**over, **{"mesh.fsdp": 8}), 8)
    assert eight.memory_analysis().temp_size_in_bytes < one / 6
