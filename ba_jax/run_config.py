"""The experiment config: loading a config file, checking it before any work, typed reads.

What lives here: `ConfigError` (a configuration that cannot run; `main.py`, `evaluate.py`
and `plan.py` print it as one line), `load_config` (a `get_config(arg)` file with dotted
overrides), `validate` and `check_workdir` (every problem a user could be told about before
the first step, including settings that would run but never learn: greedy sampling, a
bfloat16 learning rate that rounds away, a dual clip <= 1, an overlong buffer past the
budget, a preset other than the weights' model, a kernel this machine cannot run), and the
typed values the checks are made of and the rest of the run is built from: `DTYPES`,
`mesh_axes`, `runtime_options`, `model_config`, `declared_model`. What does not: making the
run's parts, which touches devices and files (build.py). `validate` is the trainer's: an
evaluation (greedy decoding included) does not go through it.

Why these reads live beside the checks rather than in build.py: `validate` needs them, and
build.py raises `ConfigError`, so the checks sit below the builder and import nothing of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from ba_jax import aggregation, grpo, paths, sharding
from ba_jax.config_error import ConfigError, require  # noqa: F401  (ConfigError: public here)
from ba_jax.engine import shapes
from ba_jax.models import attention, qwen
from ba_jax.rollout import prompt_bucket
from ba_jax.tasks import arithmetic
from ba_jax.update_config import (  # noqa: F401  (public names: build.py, tests)
    OLD_LOGP,
    check_consistency,
    check_packing,
    check_vllm,
    old_logp_source,
    rs_lower,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# model.param_dtype=bfloat16 needs learning_rate >= this (see `check_learning`): 0.02, the
# typical size of a Qwen weight, times 2^-9, half the spacing of bfloat16 numbers near it.
BF16_MIN_LR = 0.02 * 2**-9
# ModelConfig fields that make a model (not the run-time options, not the export-only ids).
ARCH_FIELDS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
               "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
               "max_position_embeddings", "use_tied_embeddings", "use_qkv_bias", "use_o_bias",
               "use_qk_norm")
ROLLOUT_ENGINES = ("paged", "vllm")  # config.rollout.engine (`ba_jax`: the old name of paged)


def load_config(spec: str, **overrides: Any):
    """`get_config(arg)` of a config file named `path[:arg]`, with dotted-key overrides.

    `load_config("configs/default.py:debug", **{"grpo.aggregation": "token"})` gives what
    `--config=configs/default.py:debug --config.grpo.aggregation=token` gives on the
    command line; an unknown key is an error, as with the locked command-line config.
    """
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("ba_jax_config_file", path)
    if module_spec is None or not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    cfg = module.get_config(arg or None)
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"{spec}: unknown config key {key!r}")
        node[leaf] = value
    return cfg


def check_workdir(workdir: str) -> None:
    """The run folder must be creatable and writable (checked before any work); a URL one
    (`gs://`) also its library installed and its bucket there (`paths.check_writable`)."""
    try:
        if paths.is_remote(workdir):
            return paths.check_writable(workdir)
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe_{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--workdir={workdir!r} is not a writable folder: {e}") from e


def validate(cfg: Any, num_devices: int) -> None:
    """Fail before any work for every option a run could only trip over later."""
    g, r = cfg.grpo, cfg.rollout
    try:
        aggregation.resolve_rule(g.aggregation)
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"config.grpo.aggregation: {e}") from e
    if g.aggregation not in aggregation.RULES:  # a user's rule: tried once as the trainer calls it
        try:
            aggregation.check_rule(g.aggregation, count_degenerate_groups=g.count_degenerate_groups,
                                   max_len=g.constant_max_len or r.max_new_tokens)
        except ValueError as e:
            raise ConfigError(f"config.grpo.aggregation={g.aggregation!r} {e}") from e
    require(g.eps_low >= 0 and g.eps_high >= 0,
            f"config.grpo.eps_low={g.eps_low} / eps_high={g.eps_high}: clip ranges must be >= 0")
    require(g.eps_low < 1, f"config.grpo.eps_low={g.eps_low} must be < 1: the ratio's lower "
            "clip bound 1 - eps_low would be <= 0, so it never clips (DAPO: 0.2)")
    require(not g.dual_clip or g.dual_clip > 1,
            f"config.grpo.dual_clip={g.dual_clip} must be > 1 (or 0: off): the dual bound "
            "-c*A lies below the clipped loss only for c > 1; with c <= 1 it zeroes the "
            "gradient of every negative-advantage token (DAPO-style value: 3.0)")
    require(g.max_resample_rounds >= 0,
            f"config.grpo.max_resample_rounds={g.max_resample_rounds} must be >= 0 (extra "
            "dynamic-sampling rounds; 0: none)")
    require(g.overlong_buffer <= r.max_new_tokens,
            f"config.grpo.overlong_buffer={g.overlong_buffer} is larger than "
            f"config.rollout.max_new_tokens={r.max_new_tokens}: the overlong penalty would "
            "shape every response, however short; make the buffer smaller than the budget "
            "(DAPO: 4096 of 20480) or 0 (off)")
    require(g.advantage in grpo.ADVANTAGE_ESTIMATORS,
            f"config.grpo.advantage={g.advantage!r}; valid: {', '.join(grpo.ADVANTAGE_ESTIMATORS)}")
    require(g.kl_kind in ("none",) + grpo.KL_KINDS,
            f"config.grpo.kl_kind={g.kl_kind!r}; valid: none, {', '.join(grpo.KL_KINDS)}")
    require(g.kl_kind == "none" or g.kl_beta > 0,
            f"config.grpo.kl_kind={g.kl_kind!r} needs config.grpo.kl_beta > 0 (got {g.kl_beta}); "
            "set kl_kind='none' for no KL term")
    require(g.kl_kind != "none" or g.kl_beta == 0,
            f"config.grpo.kl_beta={g.kl_beta} has no effect with config.grpo.kl_kind='none': "
            f"choose an estimator ({', '.join(grpo.KL_KINDS)}) or set kl_beta=0")
    require(cfg.model.dtype in DTYPES and cfg.model.param_dtype in DTYPES,
            f"config.model.dtype/param_dtype must be one of {sorted(DTYPES)}")
    require(cfg.model.attention in attention.IMPLS,
            f"config.model.attention={cfg.model.attention!r}; valid: {', '.join(attention.IMPLS)}")
    check_attention(cfg)
    require(cfg.model.remat in qwen.REMAT_POLICIES,
            f"config.model.remat={cfg.model.remat!r}; valid: {', '.join(qwen.REMAT_POLICIES)}")
    require(isinstance(cfg.model.scan_unroll, int) and cfg.model.scan_unroll >= 1,
            f"config.model.scan_unroll={cfg.model.scan_unroll!r} must be an integer >= 1")
    require(isinstance(cfg.model.logits_chunk, int) and cfg.model.logits_chunk >= 0,
            f"config.model.logits_chunk={cfg.model.logits_chunk!r} must be an integer >= 0 "
            "(0: the whole response in one piece)")
    require(cfg.model.init in ("random", "hf", "checkpoint"),
            f"config.model.init={cfg.model.init!r}; valid: random, hf, checkpoint")
    if cfg.model.init != "random":
        require(os.path.isdir(cfg.model.init_path),
                f"config.model.init_path={cfg.model.init_path!r} is not a folder")
    require(cfg.task in ("arithmetic", "dataset"),
            f"config.task={cfg.task!r}; valid: arithmetic, dataset")
    require(cfg.data.max_prompt_tokens >= 1,
            f"config.data.max_prompt_tokens={cfg.data.max_prompt_tokens} must be >= 1")
    if cfg.task == "arithmetic":
        ops = cfg.arithmetic.ops
        require(isinstance(ops, str) and ops and set(ops) <= set(arithmetic.OPS),
                f"config.arithmetic.ops={ops!r}: a string of the operators "
                f"{''.join(arithmetic.OPS)!r} (e.g. '+-')")
        require(cfg.data.template == "plain",
                f"config.data.template={cfg.data.template!r} applies to task=dataset only: the "
                "arithmetic task's prompts are always plain; leave it 'plain'")
    if cfg.task == "dataset":
        require(os.path.isfile(cfg.data.path), f"config.data.path={cfg.data.path!r}: no such file")
        # the tokenizer may sit beside the weights: a Hugging Face folder's, or the one
        # convert_hf copied from it into its output folder
        beside = cfg.model.init == "hf" or (cfg.model.init == "checkpoint" and any(
            os.path.isfile(os.path.join(cfg.model.init_path, f))
            for f in ("tokenizer.json", "vocab.json")))
        where = (f"; config.model.init_path={cfg.model.init_path!r} holds no tokenizer.json"
                 if cfg.model.init == "checkpoint" else "")
        require(bool(cfg.tokenizer_path) or beside,
                "config.tokenizer_path is required for task=dataset unless the weights' folder "
                f"holds the tokenizer (model.init=hf, or a convert_hf folder){where}")
    for name in ("prompts_per_step", "num_samples", "max_new_tokens"):
        require(getattr(r, name) >= 1, f"config.rollout.{name} must be >= 1")
    require(r.num_samples >= 2,
            f"config.rollout.num_samples={r.num_samples}: GRPO needs >= 2 samples per prompt "
            "(advantages are relative to the prompt's group: a group of one has advantage 0, "
            "so every gradient would be zero)")
    for name in ("num_updates", "num_minibatches", "num_microbatches"):
        require(getattr(g, name) >= 1, f"config.grpo.{name} must be >= 1")
    require(r.engine in ROLLOUT_ENGINES + ("ba_jax",),
            f"config.rollout.engine={r.engine!r}; valid: {', '.join(ROLLOUT_ENGINES)}"
            + (" (the static sampler is a benchmark baseline now: benchmarks/static_sampler.py)"
               if r.engine == "static" else ""))
    if r.engine == "vllm":
        check_vllm(cfg, declared_model(cfg))
    check_consistency(cfg)
    check_packing(cfg)
    require(r.num_slots >= 0, f"config.rollout.num_slots={r.num_slots} must be >= 0 "
            "(0: a quarter of each row device's rows)")
    require(r.page_size >= 1, f"config.rollout.page_size={r.page_size} must be >= 1")
    require(r.prefill_chunk >= 0, f"config.rollout.prefill_chunk={r.prefill_chunk} must be "
            ">= 0 (0: whole prompts)")
    if r.engine != "vllm":  # the engine's own rule (`engine.shapes.call_shape`), once
        try:
            shapes.call_shape(max(r.prompts_per_step // max(r.sample_shards, 1), 1),
                              prompt_bucket(cfg.data.max_prompt_tokens), r.num_samples,
                              r.max_new_tokens, num_slots=r.num_slots, page_size=r.page_size,
                              num_pages=r.kv_pages, prefill_chunk=r.prefill_chunk,
                              num_devices=sampling_devices(cfg, num_devices))
        except shapes.PoolTooSmall as e:
            raise ConfigError(
                f"config.rollout.kv_pages={r.kv_pages} cannot hold one sequence of "
                f"config.rollout.max_new_tokens={r.max_new_tokens} tokens beside its prompt "
                f"(config.rollout.page_size={r.page_size}): {e}; give more pages, or 0 for "
                "every slot's full budget") from e
        except ValueError as e:
            raise ConfigError(f"config.rollout: {e}") from e
    require(r.sample_shards >= 1 and r.prompts_per_step % r.sample_shards == 0,
            f"config.rollout.sample_shards={r.sample_shards} must divide "
            f"config.rollout.prompts_per_step={r.prompts_per_step}")
    require(r.sample_shards % jax.process_count() == 0,
            f"config.rollout.sample_shards={r.sample_shards} must be a multiple of the "
            f"{jax.process_count()} processes (each process samples whole shards)")
    require((r.prompts_per_step // r.sample_shards) % g.num_minibatches == 0,
            f"config.grpo.num_minibatches={g.num_minibatches} must divide the "
            f"{r.prompts_per_step // r.sample_shards} prompts of a sampling shard "
            "(mini-batches hold whole groups from every shard)")
    rows = r.prompts_per_step // g.num_minibatches * r.num_samples
    require(rows % g.num_microbatches == 0,
            f"config.grpo.num_microbatches={g.num_microbatches} must divide the {rows} rows of a "
            "mini-batch")
    mesh_shape = mesh_axes(cfg, num_devices)
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    require((rows // g.num_microbatches) % dp == 0,
            f"micro-batch rows ({rows // g.num_microbatches}) must be divisible by data*fsdp={dp} "
            "devices")
    require(cfg.rollout.temperature >= 0, "config.rollout.temperature must be >= 0")
    for name, greedy in (("temperature", r.temperature == 0), ("top_k", r.top_k == 1)):
        require(not greedy, f"config.rollout.{name}={getattr(r, name)} samples greedily: the "
                f"{r.num_samples} samples of a prompt are identical, every group's advantages "
                "are 0 and nothing is learned; use temperature > 0 and top_k 0 or > 1 "
                "(DAPO: temperature 1.0, top_k 0). Greedy decoding is for evaluation "
                "(python -m ba_jax.evaluate)")
    require(0 < cfg.rollout.top_p <= 1, "config.rollout.top_p must be in (0, 1]")
    require(cfg.rollout.top_k >= 0,
            f"config.rollout.top_k={cfg.rollout.top_k} must be >= 0 (0 keeps every token)")
    require(cfg.num_train_steps >= 1,
            f"config.num_train_steps={cfg.num_train_steps} must be >= 1 (nothing would be trained)")
    require(cfg.checkpoint.every_steps >= 1, "config.checkpoint.every_steps must be >= 1")
    require(cfg.checkpoint.max_to_keep >= 1, "config.checkpoint.max_to_keep must be >= 1")
    require(cfg.optim.schedule in ("constant", "cosine"),
            f"config.optim.schedule={cfg.optim.schedule!r}; valid: constant, cosine")
    require(cfg.optim.learning_rate > 0, "config.optim.learning_rate must be > 0")
    check_learning(cfg)
    require(cfg.max_consecutive_nonfinite >= 1, "config.max_consecutive_nonfinite must be >= 1")
    require(isinstance(cfg.model.position_limit, int) and cfg.model.position_limit >= 0,
            f"config.model.position_limit={cfg.model.position_limit!r} must be an integer >= 0 "
            "(0: the model's max_position_embeddings)")
    if cfg.model.preset:
        check_preset_matches_weights(cfg)
        check_positions(cfg, qwen.PRESETS[preset_name(cfg.model.preset)])
    elif cfg.model.init == "random":
        try:
            model_config(cfg)
        except ValueError as e:
            raise ConfigError(f"config.model: {e}") from e


def check_attention(cfg: Any) -> None:
    """`model.attention=cudnn|splash` only where the kernel seam's own `auto` rule would pick
    it (`attention.resolve`: splash on TPU, cuDNN on a GPU in bf16/fp16 compute), so that a
    missing accelerator or float32 compute is told here, not as a trace-time failure after
    data and model load."""
    impl = cfg.model.attention
    if impl not in ("cudnn", "splash"):
        return
    here = attention.resolve("auto", dtype=DTYPES.get(cfg.model.dtype, jnp.float32),
                             seq_len=attention.CHUNKED_MIN_LEN)
    needs = {"cudnn": "an NVIDIA GPU and config.model.dtype=bfloat16",
             "splash": "a TPU"}[impl]
    require(here == impl,
            f"config.model.attention={impl!r} needs {needs}; this run has jax backend "
            f"{attention.backend()!r} and config.model.dtype={cfg.model.dtype!r}: use 'auto' "
            "(which picks what this machine runs) or 'chunked'")


def check_learning(cfg: Any) -> None:
    """AdamW's settings, and a learning rate that can move bfloat16 parameters.

    The rule for `model.param_dtype=bfloat16`: an AdamW step moves a weight by about the
    learning rate (the normalised update |m/sqrt(v)| is about 1; exactly 1 at the first
    step), and a bfloat16 weight w keeps its value under any change below half its spacing,
    |w| * 2^-9 to |w| * 2^-8 (8 significant bits). Qwen's weight matrices hold values of
    about 0.02 (their init std), so `learning_rate < BF16_MIN_LR = 0.02 * 2^-9 ~ 3.9e-5` is
    refused: there, fewer than half of such weights can ever change (at the paper's 1e-6,
    98% never do). Use float32 master weights (param_dtype=float32; compute stays in
    model.dtype), as configs/paper.py does."""
    o = cfg.optim
    for name in ("b1", "b2"):
        value = getattr(o, name)
        require(0 <= value < 1, f"config.optim.{name}={value} must be in [0, 1) (AdamW's "
                "moment decay: 0.9 and 0.999 are usual)")
    require(0 <= o.final_lr_fraction <= 1,
            f"config.optim.final_lr_fraction={o.final_lr_fraction} must be in [0, 1] (the "
            "cosine schedule's end, as a fraction of learning_rate)")
    if cfg.model.param_dtype == "bfloat16":
        require(o.learning_rate >= BF16_MIN_LR,
                f"config.model.param_dtype=bfloat16 with config.optim.learning_rate="
                f"{o.learning_rate:g}: an AdamW step (about the learning rate) is below half "
                f"the bfloat16 spacing of a typical weight (0.02 * 2^-9 = {BF16_MIN_LR:.2g}), "
                "so most weights would never change; use config.model.param_dtype=float32 "
                f"(compute stays in config.model.dtype) or learning_rate >= {BF16_MIN_LR:.2g}")


def declared_model(cfg: Any) -> qwen.ModelConfig | None:
    """The model a run will have, known before loading weights: the weights folder's own
    config (`init=hf`: config.json; `init=checkpoint`: a convert_hf folder's
    model_config.json), else the preset or the explicit fields; None where the folder holds
    no readable config (loading the weights then says what is wrong)."""
    m = cfg.model
    if m.init == "random":
        try:
            return model_config(cfg)
        except (ValueError, ConfigError):
            return None
    name = "config.json" if m.init == "hf" else "model_config.json"
    try:
        with open(os.path.join(m.init_path, name)) as f:
            fields = json.load(f)
        if m.init == "hf":
            return qwen.ModelConfig.from_hf_config(fields)
        return qwen.ModelConfig(**{k: fields[k] for k in ARCH_FIELDS})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_preset_matches_weights(cfg: Any) -> None:
    """`model.preset` with weights from a folder: the folder's own config decides the model
    (the preset would be silently ignored), so a preset that differs from it is an error."""
    if cfg.model.init == "random":
        return
    mine, theirs = declared_model(cfg), qwen.PRESETS[preset_name(cfg.model.preset)]
    if mine is None:
        return
    diff = [f"{k} {getattr(mine, k)} (preset {getattr(theirs, k)})" for k in ARCH_FIELDS
            if getattr(mine, k) != getattr(theirs, k)]
    require(not diff,
            f"config.model.preset={cfg.model.preset!r} but config.model.init_path="
            f"{cfg.model.init_path!r} holds another model ({', '.join(diff[:4])}"
            f"{', ...' if len(diff) > 4 else ''}): its weights and config are what would "
            "train; clear config.model.preset, or point init_path at that model's weights")


def check_positions(cfg: Any, mc: qwen.ModelConfig) -> None:
    """A row's positions (prompt bucket + response - 1) must fit the model's trained context
    `max_position_embeddings`, or the run says explicitly how far past it it may go
    (`config.model.position_limit`, what recipes that raise max_position_embeddings do)."""
    need = prompt_bucket(cfg.data.max_prompt_tokens) + cfg.rollout.max_new_tokens - 1
    limit = cfg.model.position_limit or mc.max_position_embeddings
    require(need <= limit,
            f"rows need {need} positions (config.data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
            f" padded to its bucket + config.rollout.max_new_tokens={cfg.rollout.max_new_tokens}) "
            f"but the model was trained for max_position_embeddings={mc.max_position_embeddings}"
            + (f" and config.model.position_limit={cfg.model.position_limit}"
               if cfg.model.position_limit else "")
            + f": shorten them, or set config.model.position_limit={need} to run past the trained"
            " context (RoPE extends to any position; quality there is the model's)")


def sampling_devices(cfg: Any, num_devices: int) -> int:
    """Row devices of one sampler call: the mesh's data x fsdp, or, with several processes
    (each samples its shards alone), the ones on this process."""
    axes = mesh_axes(cfg, num_devices)
    return axes["data"] * axes["fsdp"] // jax.process_count()


def mesh_axes(cfg: Any, num_devices: int) -> dict[str, int]:
    """The config's mesh with one -1 resolved to the remaining devices."""
    try:
        return sharding.resolve_mesh_shape({a: cfg.mesh[a] for a in sharding.MESH_AXES},
                                           num_devices, exact=True)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from e


def runtime_options(cfg: Any) -> dict[str, Any]:
    """The ModelConfig fields a run chooses whatever the weights: attention kernel, remat,
    layers per scan iteration, positions per chunk of the output head."""
    return dict(attention=cfg.model.attention, remat=cfg.model.remat,
                scan_unroll=cfg.model.scan_unroll, logits_chunk=cfg.model.logits_chunk)


def preset_name(name: str) -> str:
    """The `qwen.PRESETS` key `name` spells in any letter case (`qwen3-1.7b`, as
    configs/paper.py writes model names, is `Qwen3-1.7B`); ConfigError listing them if none."""
    key = {k.lower(): k for k in qwen.PRESETS}.get(name.lower())
    require(key is not None, f"config.model.preset={name!r}; valid (in any letter case): "
            f"{', '.join(sorted(qwen.PRESETS))}")
    return key


def model_config(cfg: Any) -> qwen.ModelConfig:
    """The run's ModelConfig (the one derivation: trainer, planner, evaluation): a preset name
    (any letter case), an `init=hf` folder's config.json without one, or the explicit fields
    of config.model; the run-time options (`runtime_options`) applied."""
    m = cfg.model
    path = os.path.join(m.init_path or "", "config.json")
    if not m.preset and m.init == "hf" and os.path.isfile(path):
        with open(path) as f:
            hf = qwen.ModelConfig.from_hf_config(json.load(f))
        return dataclasses.replace(hf, **runtime_options(cfg))
    if m.preset:
        return dataclasses.replace(qwen.PRESETS[preset_name(m.preset)], **runtime_options(cfg))
    return qwen.ModelConfig(
        arch=m.arch, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps, max_position_embeddings=m.max_position_embeddings,
        use_tied_embeddings=m.tie_word_embeddings, use_qkv_bias=m.arch == "qwen2",
        use_o_bias=False, use_qk_norm=m.arch == "qwen3", **runtime_options(cfg),
    )
