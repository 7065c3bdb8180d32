"""Memory planner: exact parameter/optimizer/cache bytes, sharding scaling, fit verdicts, CLI."""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ba_jax import build, plan as plan_lib, run_config
from ba_jax.models import qwen

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = "model=qwen3-1.7b,data=dapo17k,agg=balanced"


def _config(name: str, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(
        f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def _preset_config(preset: str, *, fsdp: int = 1, tensor: int = 1, param_dtype="float32"):
    cfg = _config("default", "debug")
    cfg.model.preset = preset
    cfg.model.param_dtype = param_dtype
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = -1, fsdp, tensor
    return cfg


def _closed_form_count(mc: qwen.ModelConfig) -> int:
    """Parameter count of a Qwen decoder written out from its config (independent of nnx)."""
    D, F, H, N, K = mc.hidden_size, mc.intermediate_size, mc.head_dim, mc.num_heads, mc.num_kv_heads
    attn = D * N * H + 2 * D * K * H + N * H * D
    if mc.use_qkv_bias:
        attn += N * H + 2 * K * H
    if mc.use_qk_norm:
        attn += 2 * H
    layer = attn + 3 * D * F + 2 * D
    return mc.vocab_size * D * (1 if mc.use_tied_embeddings else 2) + mc.num_layers * layer + D


@pytest.mark.parametrize("preset", sorted(qwen.PRESETS))
def test_every_preset_plans_with_exact_parameter_bytes(preset):
    p = plan_lib.plan(_preset_config(preset), 1)
    count = _closed_form_count(qwen.PRESETS[preset])
    assert p["param_count"] == count
    assert p["bytes"]["params"] == count * 4  # float32 storage, one device: nothing split
    # AdamW mu + nu in float32, plus two int32 step counts (Adam's and the LR schedule's)
    assert p["bytes"]["optimizer"] == 2 * count * 4 + 8
    assert p["bytes"]["peak"] >= p["bytes"]["params"] + p["bytes"]["optimizer"]


def test_parameter_bytes_follow_param_dtype():
    p32 = plan_lib.plan(_preset_config("Qwen3-0.6B"), 1)
    p16 = plan_lib.plan(_preset_config("Qwen3-0.6B", param_dtype="bfloat16"), 1)
    assert p16["bytes"]["params"] * 2 == p32["bytes"]["params"]


def test_bytes_scale_down_with_fsdp_and_tensor():
    mc = qwen.PRESETS["Qwen3-1.7B"]
    replicated = 4 * (mc.num_layers * (2 * mc.hidden_size + 2 * mc.head_dim) + mc.hidden_size)
    one = plan_lib.plan(_preset_config("Qwen3-1.7B"), 1)["bytes"]["params"]
    last = one
    for fsdp in (2, 4, 8):
        b = plan_lib.plan(_preset_config("Qwen3-1.7B", fsdp=fsdp), fsdp)["bytes"]
        # every matrix of Qwen3-1.7B has a D=2048 dim split over fsdp; norm scales replicate
        assert b["params"] == (one - replicated) // fsdp + replicated
        assert b["optimizer"] == 2 * b["params"] + 8
        assert b["params"] < last
        last = b["params"]
    t4 = plan_lib.plan(_preset_config("Qwen3-1.7B", tensor=4), 4)["bytes"]["params"]
    assert t4 == (one - replicated) // 4 + replicated  # vocab, heads, mlp all divide by 4


def _tiny_sharded(mesh_shape=(1, 2, 4)):
    cfg = _config("default", "debug")
    cfg.model.num_heads, cfg.model.num_kv_heads = 4, 4  # kv heads divide tensor=4 too
    cfg.model.vocab_size = 128
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
    mesh = build.make_mesh(cfg, jax.devices()[:8])
    return cfg, mesh


def _device0_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_per_device_parameter_bytes_match_real_sharded_arrays():
    cfg, mesh = _tiny_sharded()
    _, params = build.init_policy(cfg, mesh)
    p = plan_lib.plan(cfg, 8)
    assert p["bytes"]["params"] == _device0_bytes(params)
    assert _device0_bytes(params) * 8 > p["global_bytes"]["params"]  # norms replicate


def test_per_device_optimizer_bytes_match_the_trainer_state():
    from ba_jax import train

    cfg, mesh = _tiny_sharded()
    _, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state = train.init_state(params, tx, mesh)
    assert plan_lib.plan(cfg, 8)["bytes"]["optimizer"] == _device0_bytes(state["opt_state"])


def test_kv_cache_bytes_equal_the_sampler_cache():
    cfg = _config("default", "debug")
    cfg.model.dtype = "bfloat16"
    cfg.data.max_prompt_tokens = 40  # bucket 64
    p = plan_lib.plan(cfg, 1)
    mc = run_config.model_config(cfg)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.num_samples
    cache = jax.eval_shape(lambda: qwen.init_cache(mc, rows, 64 + cfg.rollout.max_new_tokens,
                                                   jnp.bfloat16))
    assert p["bytes"]["kv_cache"] == sum(x.size * 2 for x in jax.tree.leaves(cache))
    cfg.mesh.data = 4  # 16 rows over 4 data shards
    assert plan_lib.plan(cfg, 4)["bytes"]["kv_cache"] * 4 == p["bytes"]["kv_cache"]


def test_activation_estimate_formula():
    mc = qwen.PRESETS["Qwen3-0.6B"]
    kw = dict(rows=2, T=256, itemsize=2, tensor=1)
    remat = plan_lib.activation_bytes(mc, use_remat=True, **kw)
    full = plan_lib.activation_bytes(mc, use_remat=False, **kw)
    assert remat["logits"] == full["logits"] == 2 * 2 * 256 * mc.vocab_size * 4
    assert remat["attention_scores_per_layer"] == 2 * 256 * mc.num_heads * 256 * 6
    assert remat["total"] < full["total"]
    # doubling the sequence more than doubles attention scores (quadratic in T)
    long = plan_lib.activation_bytes(mc, use_remat=True, rows=2, T=512, itemsize=2, tensor=1)
    assert long["attention_scores_per_layer"] == 4 * remat["attention_scores_per_layer"]


def test_fit_verdict_flips_between_tiny_and_huge():
    tiny = plan_lib.plan(_config("default", "debug"), 1)
    assert all(tiny["fits"].values())
    paper = _config("paper", PAPER)
    one = plan_lib.plan(paper, 1)
    assert not any(one["fits"].values())  # 512 x 10k-token rows and a 10k-slot cache on one chip
    many = plan_lib.plan(paper, 16)
    assert not many["warnings"]
    peak = many["bytes"]["peak"]
    for name, gib in plan_lib.DEVICES.items():
        assert many["fits"][name] == (peak <= plan_lib.USABLE_FRACTION * gib * plan_lib.GIB)
    assert many["fits"]["h200"] and not many["fits"]["v5e"]


def test_mesh_that_does_not_fit_the_device_count_is_an_error():
    cfg = _config("default", "debug")
    cfg.mesh.fsdp = 2
    with pytest.raises(run_config.ConfigError):
        plan_lib.plan(cfg, 3)
    cfg.mesh.data = 1
    cfg.rollout.prompts_per_step = 3
    cfg.grpo.num_microbatches = 1
    assert not plan_lib.plan(cfg, 2)["warnings"]  # 12 rows split over fsdp=2 ...
    cfg.rollout.num_samples = 1
    assert plan_lib.plan(cfg, 2)["warnings"]  # ... 3 rows over 2 devices is not


def test_cli_runs_on_the_paper_config():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    base = [sys.executable, "-m", "ba_jax.plan", f"--config=configs/paper.py:{PAPER}",
            "--num_devices=16"]
    out = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    for name in plan_lib.DEVICES:
        assert f"  {name} " in out.stdout
    assert "sampler KV cache" in out.stdout and "activations, remat" in out.stdout
    one = subprocess.run(base + ["--device=h100"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert one.returncode == 0, one.stderr
    assert "h100" in one.stdout and "v5e" not in one.stdout
    bad = subprocess.run(base[:-1] + ["--num_devices=3", "--config.mesh.tensor=2"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "config.mesh" in bad.stderr


def test_fit_search_finds_the_smallest_count_that_fits():
    paper = _config("paper", PAPER)
    before = paper.grpo.num_microbatches
    found = plan_lib.fit_search(paper, "h100")
    n, k = found["num_devices"], found["num_microbatches"]
    assert found["plan"]["fits"]["h100"] and found["plan"]["num_devices"] == n
    assert paper.grpo.num_microbatches == before  # the config itself is unchanged
    # nothing smaller fits: half the devices fails at every valid micro-batching
    rows = paper.rollout.prompts_per_step // paper.grpo.num_minibatches * paper.rollout.num_samples
    for kk in range(1, rows + 1):
        if rows % kk or (rows // kk) % (n // 2):
            continue
        trial = paper.copy_and_resolve_references()
        trial.grpo.num_microbatches = kk
        assert not plan_lib.plan(trial, n // 2)["fits"]["h100"]
    # and at n devices, fewer micro-batches than k do not fit
    for kk in range(1, k):
        if rows % kk or (rows // kk) % n:
            continue
        trial = paper.copy_and_resolve_references()
        trial.grpo.num_microbatches = kk
        assert not plan_lib.plan(trial, n)["fits"]["h100"]
    tiny = plan_lib.fit_search(_config("default", "debug"), "v5e")
    assert (tiny["num_devices"], tiny["num_microbatches"]) == (1, 1)


def test_cli_device_alone_says_how_many_devices_fit():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "ba_jax.plan",
                          f"--config=configs/paper.py:{PAPER}", "--device=h100"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    found = plan_lib.fit_search(_config("paper", PAPER), "h100")
    assert (f"fit search for h100: {found['num_devices']} devices with "
            f"--config.grpo.num_microbatches={found['num_microbatches']}") in out.stdout
    assert "does NOT fit" not in out.stdout
