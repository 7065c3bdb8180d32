"""Memory planner: exact parameter/optimizer/cache bytes, sharding scaling, fit verdicts, CLI."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ba_jax import build, plan as plan_lib, plan_packed, run_config, update_config
from ba_jax.engine import paging
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


def test_kv_cache_bytes_equal_the_engines_pool():
    """The engine's page pool per device (`paging.PagePool`, [K, L * pages, page_size, H] in the
    compute dtype, prompts' pages included): by default every slot's largest run (a copy of
    its prompt's partial last page, then its decoded tokens) plus one prompt's pages per
    slot (at most the device's prompts); slots and pages per call are split over the row
    devices."""
    cfg = _config("default", "debug")
    cfg.model.dtype = "bfloat16"
    cfg.data.max_prompt_tokens = 40  # bucket 64: 16 pages of 4
    # 8 tokens, 7 decoded after up to 3 copied: 3 pages of 4 per sample
    cfg.rollout.num_slots, cfg.rollout.page_size = 8, 4
    mc = run_config.model_config(cfg)

    def want(pages):
        pool = jax.eval_shape(lambda: paging.PagePool.zeros(mc, pages, 4, jnp.bfloat16))
        return sum(x.size * 2 for x in jax.tree.leaves(pool))

    p = plan_lib.plan(cfg, 1)
    assert p["bytes"]["kv_cache"] == want(8 * 3 + 4 * 16)  # 8 slots x 3, 4 prompts x 16
    assert p["shapes"]["slots_per_device"] == 8 and p["shapes"]["pages_per_device"] == 88
    cfg.mesh.data = 8  # 16 rows of 4 samples over 8 devices: 1 slot, 1 prompt each
    assert plan_lib.plan(cfg, 8)["bytes"]["kv_cache"] == want(3 + 16)
    cfg.rollout.kv_pages = 160  # 20 per device
    assert plan_lib.plan(cfg, 8)["bytes"]["kv_cache"] == want(20)


def test_activation_estimate_terms():
    """The estimate is its terms' sum: saved layer inputs + head weight + the larger of one
    layer's working set and one logits chunk; remat none keeps every layer's working set,
    and xla attention adds [T, T] scores (quadratic in T)."""
    cfg = _preset_config("Qwen3-0.6B", fsdp=8)
    cfg.model.remat, cfg.model.dtype = "full", "bfloat16"
    cfg.model.attention = "chunked"
    p = plan_lib.plan(cfg, 8)
    t = p["terms"]["train"]
    layer = t["layer_embed"] + t["layer_mlp"] + t["layer_q"] + t["layer_kv"]
    assert t["total"] == t["saved_inputs"] + t["head_weight"] + max(layer, t["head_chunk"])
    cfg.model.remat = "none"
    none = plan_lib.plan(cfg, 8)["terms"]["train"]
    L = p["model"].num_layers
    assert none["layer_mlp"] == pytest.approx(L * t["layer_mlp"], rel=1e-6)
    cfg.model.remat, cfg.model.attention = "full", "xla"
    short = plan_lib.plan(cfg, 8)["terms"]["train"]["attention_scores"]
    cfg.rollout.max_new_tokens *= 2
    longer = plan_lib.plan(cfg, 8)
    T0, T1 = p["seq_len"], longer["seq_len"]
    assert longer["terms"]["train"]["attention_scores"] == pytest.approx(short * (T1 / T0) ** 2,
                                                                          rel=1e-6)


def test_fit_verdict_flips_between_tiny_and_huge():
    tiny = plan_lib.plan(_config("default", "debug"), 1)
    assert all(tiny["fits"].values())
    seven = _config("paper", PAPER.replace("qwen3-1.7b", "qwen2.5-math-7b"))
    one = plan_lib.plan(seven, 1)
    assert not any(one["fits"].values())  # 7.6B parameters' AdamW state alone: ~122 GB
    paper = _config("paper", PAPER)
    many = plan_lib.plan(paper, 16)
    assert not many["warnings"]
    peak = many["bytes"]["peak"]
    for name, gib in plan_lib.DEVICES.items():
        assert many["fits"][name] == (peak <= plan_lib.USABLE_FRACTION * gib * plan_lib.GIB)
    assert many["fits"]["h200"]


def test_slots_that_fit_are_the_largest_that_fit():
    """`plan` sizes the engine: with the reported num_slots the sampling peak fits the device,
    with one more slot per row device it does not."""
    for devices in (8, 16):
        p = plan_lib.plan(_config("paper", PAPER), devices)
        dp = p["mesh"]["data"] * p["mesh"]["fsdp"]
        for name in ("v4", "h100"):
            n = p["slots_that_fit"][name]
            assert n > 0 and n % dp == 0
            cap = plan_lib.USABLE_FRACTION * plan_lib.DEVICES[name] * plan_lib.GIB
            for slots, fits in ((n, True), (n + dp, False)):
                cfg = _config("paper", PAPER)
                cfg.rollout.num_slots = slots
                assert (plan_lib.plan(cfg, devices)["bytes"]["sample_peak"] <= cap) == fits


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


CONTRACT_KEYS = {"argument_bytes", "output_bytes", "temp_bytes", "planned_bytes"}


def test_compiled_memory_contract_and_device_check():
    """`compiled_memory` compiles the real train step and sampler call from abstract inputs
    and returns integer per-device bytes under the contract's keys; asking for more devices
    than the process has says how to get them."""
    cfg = _config("default", "debug")
    cfg.mesh.data, cfg.mesh.fsdp = 1, 8
    out = plan_lib.compiled_memory(cfg, 8)
    assert set(out) == {"train", "sample"}
    for m in out.values():
        assert CONTRACT_KEYS <= set(m) and all(isinstance(v, int) for v in m.values())
        assert m["argument_bytes"] > 0 and m["temp_bytes"] > 0 and m["planned_bytes"] > 0
        assert m["peak_bytes"] == (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]
                                   + m["temp_bytes"])
    # the donated state comes back in place: only the scalar metrics are fresh outputs
    assert 0 < out["train"]["output_bytes"] - out["train"]["alias_bytes"] < 4096
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=16"):
        plan_lib.compiled_memory(_config("default", "debug"), 16)


def test_cli_compile_json_sets_its_own_device_count():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-m", "ba_jax.plan", "--config=configs/default.py:debug",
                          "--config.mesh.data=2", "--num_devices=2", "--compile", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert set(got) == {"train", "sample"}
    assert all(CONTRACT_KEYS <= set(m) for m in got.values())


def test_planner_matches_the_compiler_on_a_paper_length_cut():
    """A 2-layer cut of Qwen3-1.7B at the paper's row length (2,048 + 8,192 tokens, 2 rows
    per device, fsdp=8, bf16): the planned train-step peak is within 25% of the compiled
    one (benchmarks/memory.py checks the full-depth cases)."""
    cfg = _config("paper", PAPER)
    mc = qwen.PRESETS["Qwen3-1.7B"]
    m = cfg.model
    m.preset, m.init, m.num_layers = "", "random", 2
    m.arch, m.vocab_size, m.hidden_size = mc.arch, mc.vocab_size, mc.hidden_size
    m.intermediate_size, m.num_heads, m.num_kv_heads = mc.intermediate_size, mc.num_heads, mc.num_kv_heads
    m.head_dim, m.tie_word_embeddings, m.max_position_embeddings = mc.head_dim, True, 40960
    cfg.grpo.max_tokens_per_device = 0  # padded rows (the packed step: tests below)
    cfg.grpo.num_microbatches = plan_lib.train_rows(cfg) // (2 * 8)
    cfg.rollout.sample_shards = 8
    train = plan_lib.compiled_memory(cfg, 8)["train"]
    assert 0.75 <= train["planned_bytes"] / train["peak_bytes"] <= 1.25, train


def test_packed_plan_sizes_one_row_of_the_budget():
    """`grpo.max_tokens_per_device` = S: the activation terms are one row of S tokens per
    device (at S = 2T the layer terms equal the padded plan's 2 rows of T; the head's chunk
    is one row's), the float32 accumulator is always there, the update batch holds every
    block, and the optimizer step is a phase of its own."""
    padded = _config("paper", PAPER)
    padded.grpo.max_tokens_per_device = 0
    padded.grpo.num_microbatches = plan_lib.train_rows(padded) // (2 * 8)
    pp = plan_lib.plan(padded, 8)
    T = pp["seq_len"]
    cfg = _config("paper", PAPER)
    cfg.grpo.max_tokens_per_device = 2 * T
    p = plan_lib.plan(cfg, 8)
    assert (p["max_tokens_per_device"], p["seq_len"], p["microbatch_rows_per_device"]) == (
        2 * T, 2 * T, 1)
    assert pp["max_tokens_per_device"] == 0
    t, tp = p["terms"]["train"], pp["terms"]["train"]
    for k in ("saved_inputs", "layer_embed", "layer_mlp", "layer_q", "layer_kv", "head_weight"):
        assert t[k] == tp[k], k
    assert t["head_chunk"] * 2 == tp["head_chunk"]
    b = p["bytes"]
    assert b["grad_accumulator"] == b["params"]  # f32 parameters: the f32 sum's size
    # 512 rows, every one 10,239 tokens at the longest: 2 per row of 20,478, 8 rows a block
    assert p["blocks_per_minibatch"] == 32
    assert b["batch"] > 32 * b["block"] > 0
    assert b["train_apply"] == (b["params"] + b["optimizer"] + b["batch"]
                                + b["grad_accumulator"]
                                + plan_packed.apply_temp_bytes(b["grad_accumulator"]))
    assert b["train_peak"] == max(b["train_apply"], b["params"] + b["optimizer"] + b["batch"]
                                  + b["grads"] + b["grad_accumulator"] + t["total"])


def _tiny_packed(budget: int, **grpo):
    """A small Qwen3-shaped model (D 512, 2 layers, vocab 8,192) packed into rows of
    `budget` tokens on 8 devices (fsdp), bf16 compute, chunked attention."""
    cfg = _config("paper", PAPER)
    m = cfg.model
    m.preset, m.init, m.num_layers, m.arch = "", "random", 2, "qwen3"
    m.vocab_size, m.hidden_size, m.intermediate_size = 8192, 512, 1536
    m.num_heads, m.num_kv_heads, m.head_dim = 8, 4, 64
    m.tie_word_embeddings, m.max_position_embeddings, m.attention = True, 40960, "chunked"
    cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens = 256, 768
    cfg.rollout.prompts_per_step, cfg.rollout.num_samples = 8, 8
    cfg.rollout.sample_shards, cfg.rollout.num_slots = 8, 8
    cfg.grpo.num_microbatches, cfg.grpo.max_tokens_per_device = 1, budget
    for k, v in grpo.items():
        setattr(cfg.grpo, k, v)
    update_config.check_packing(cfg)
    return cfg


def test_packed_compile_matches_the_planner():
    """`compiled_memory` of a packed config compiles the real `acc_fn` and `apply_fn`: the
    train figure is the larger of the block program's peak plus the optimizer state and
    held data beside it and the optimizer step's plus the held data, within 25% of the
    plan; the contract's keys are those of the program that sets it. With a KL term (the
    block carries the reference's log-probs)."""
    cfg = _tiny_packed(1024, kl_kind="k3", kl_beta=0.01)
    out = plan_lib.compiled_memory(cfg, 8)
    tr = out["train"]
    assert CONTRACT_KEYS <= set(tr) and all(isinstance(v, int) for v in tr.values())
    assert tr["peak_bytes"] == max(tr["acc_peak_bytes"] + tr["resident_bytes"],
                                   tr["apply_peak_bytes"] + tr["held_bytes"])
    assert tr["acc_peak_bytes"] == (tr["argument_bytes"] + tr["output_bytes"]
                                    - tr["alias_bytes"] + tr["temp_bytes"])
    # the accumulator comes back in place: only the block is a fresh argument besides it
    p = plan_lib.plan(cfg, 8)
    assert tr["output_bytes"] - tr["alias_bytes"] < 4096
    assert tr["resident_bytes"] == (p["bytes"]["optimizer"] + p["bytes"]["batch"]
                                    - p["bytes"]["block"])
    assert tr["planned_bytes"] == p["bytes"]["train_peak"]
    assert 0.75 <= tr["planned_bytes"] / tr["peak_bytes"] <= 1.25, tr


def test_packed_plan_with_a_kl_term_and_a_longer_budget():
    """The block carries the reference's log-probs with a KL term; a longer budget grows
    the plan (the compiled side: `test_packed_compile_matches_the_planner`)."""
    planned = plan_lib.plan(_tiny_packed(2048, kl_kind="k3", kl_beta=0.01), 8)["bytes"][
        "train_peak"]
    short = plan_lib.plan(_tiny_packed(1024, kl_kind="k3", kl_beta=0.01), 8)["bytes"]
    assert short["block"] == 1024 * (plan_packed.BLOCK_BYTES + 4)  # ref_logp added
    assert short["train_peak"] < planned
