"""Everything a run needs, built from the experiment config and checked at start-up.

What lives here: config validation (every problem a user could be told about before the
first step), the mesh, the tokenizer, the prompt set, the policy's initial parameters
(random, Hugging Face folder, or converted Orbax checkpoint) and the optimizer. What does
not: the update itself (train.py) or the host side of an iteration (experience.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ba_jax import aggregation, data, distributed, grpo, sharding
from ba_jax.models import attention, qwen
from ba_jax.tasks import arithmetic

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the option."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


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
    """The run folder must be creatable and writable (checked before any work)."""
    try:
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
    _check(g.advantage in grpo.ADVANTAGE_ESTIMATORS,
           f"config.grpo.advantage={g.advantage!r}; valid: {', '.join(grpo.ADVANTAGE_ESTIMATORS)}")
    _check(g.kl_kind in ("none",) + grpo.KL_KINDS,
           f"config.grpo.kl_kind={g.kl_kind!r}; valid: none, {', '.join(grpo.KL_KINDS)}")
    _check(cfg.model.dtype in DTYPES and cfg.model.param_dtype in DTYPES,
           f"config.model.dtype/param_dtype must be one of {sorted(DTYPES)}")
    _check(cfg.model.attention in attention.IMPLS,
           f"config.model.attention={cfg.model.attention!r}; valid: {', '.join(attention.IMPLS)}")
    _check(cfg.model.remat in qwen.REMAT_POLICIES,
           f"config.model.remat={cfg.model.remat!r}; valid: {', '.join(qwen.REMAT_POLICIES)}")
    _check(cfg.model.init in ("random", "hf", "checkpoint"),
           f"config.model.init={cfg.model.init!r}; valid: random, hf, checkpoint")
    if cfg.model.init != "random":
        _check(os.path.isdir(cfg.model.init_path),
               f"config.model.init_path={cfg.model.init_path!r} is not a folder")
    _check(cfg.task in ("arithmetic", "dataset"), f"config.task={cfg.task!r}; valid: arithmetic, dataset")
    if cfg.task == "dataset":
        _check(os.path.isfile(cfg.data.path), f"config.data.path={cfg.data.path!r}: no such file")
        _check(bool(cfg.tokenizer_path) or cfg.model.init == "hf",
               "config.tokenizer_path is required for task=dataset (or model.init=hf)")
    for name in ("prompts_per_step", "num_samples", "max_new_tokens"):
        _check(getattr(r, name) >= 1, f"config.rollout.{name} must be >= 1")
    for name in ("num_updates", "num_minibatches", "num_microbatches"):
        _check(getattr(g, name) >= 1, f"config.grpo.{name} must be >= 1")
    _check(r.sample_shards >= 1 and r.prompts_per_step % r.sample_shards == 0,
           f"config.rollout.sample_shards={r.sample_shards} must divide "
           f"config.rollout.prompts_per_step={r.prompts_per_step}")
    _check(r.sample_shards % jax.process_count() == 0,
           f"config.rollout.sample_shards={r.sample_shards} must be a multiple of the "
           f"{jax.process_count()} processes (each process samples whole shards)")
    _check((r.prompts_per_step // r.sample_shards) % g.num_minibatches == 0,
           f"config.grpo.num_minibatches={g.num_minibatches} must divide the "
           f"{r.prompts_per_step // r.sample_shards} prompts of a sampling shard "
           "(mini-batches hold whole groups from every shard)")
    rows = r.prompts_per_step // g.num_minibatches * r.num_samples
    _check(rows % g.num_microbatches == 0,
           f"config.grpo.num_microbatches={g.num_microbatches} must divide the {rows} rows of a "
           "mini-batch")
    mesh_shape = mesh_axes(cfg, num_devices)
    dp = mesh_shape["data"] * mesh_shape["fsdp"]
    _check((rows // g.num_microbatches) % dp == 0,
           f"micro-batch rows ({rows // g.num_microbatches}) must be divisible by data*fsdp={dp} "
           "devices")
    _check(cfg.rollout.temperature >= 0, "config.rollout.temperature must be >= 0")
    _check(0 < cfg.rollout.top_p <= 1, "config.rollout.top_p must be in (0, 1]")
    _check(cfg.num_train_steps >= 0, "config.num_train_steps must be >= 0")
    _check(cfg.checkpoint.every_steps >= 1, "config.checkpoint.every_steps must be >= 1")
    _check(cfg.checkpoint.max_to_keep >= 1, "config.checkpoint.max_to_keep must be >= 1")
    _check(cfg.optim.schedule in ("constant", "cosine"),
           f"config.optim.schedule={cfg.optim.schedule!r}; valid: constant, cosine")
    _check(cfg.optim.learning_rate > 0, "config.optim.learning_rate must be > 0")
    _check(cfg.max_consecutive_nonfinite >= 1, "config.max_consecutive_nonfinite must be >= 1")
    if cfg.model.preset:
        _check(cfg.model.preset in qwen.PRESETS,
               f"config.model.preset={cfg.model.preset!r}; valid: {', '.join(sorted(qwen.PRESETS))}")
    elif cfg.model.init == "random":
        try:
            model_config(cfg)
        except ValueError as e:
            raise ConfigError(f"config.model: {e}") from e


def mesh_axes(cfg: Any, num_devices: int) -> dict[str, int]:
    """The config's mesh with one -1 resolved to the remaining devices."""
    try:
        return sharding.resolve_mesh_shape({a: cfg.mesh[a] for a in sharding.MESH_AXES},
                                           num_devices, exact=True)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from e


def make_mesh(cfg: Any, devices: list | None = None) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all)."""
    devices = jax.devices() if devices is None else devices
    return sharding.make_mesh(mesh_axes(cfg, len(devices)), devices=devices)


def runtime_options(cfg: Any) -> dict[str, str]:
    """The ModelConfig fields a run chooses whatever the weights: attention kernel, remat."""
    return dict(attention=cfg.model.attention, remat=cfg.model.remat)


def model_config(cfg: Any) -> qwen.ModelConfig:
    """ModelConfig from a preset name or the explicit fields of config.model."""
    m = cfg.model
    if m.preset:
        _check(m.preset in qwen.PRESETS,
               f"config.model.preset={m.preset!r}; valid: {', '.join(sorted(qwen.PRESETS))}")
        return dataclasses.replace(qwen.PRESETS[m.preset], **runtime_options(cfg))
    return qwen.ModelConfig(
        arch=m.arch, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps, max_position_embeddings=m.max_position_embeddings,
        use_tied_embeddings=m.tie_word_embeddings, use_qkv_bias=m.arch == "qwen2",
        use_o_bias=False, use_qk_norm=m.arch == "qwen3", **runtime_options(cfg),
    )


def load_tokenizer(cfg: Any, workdir: str):
    """The run's tokenizer: the embedded task builds its own into WORKDIR/tokenizer."""
    from transformers import AutoTokenizer

    if cfg.task == "arithmetic" and not cfg.tokenizer_path:
        path = os.path.join(workdir, "tokenizer")
        if distributed.is_primary() and not os.path.exists(os.path.join(path, "tokenizer.json")):
            arithmetic.save_tokenizer(path)
        distributed.barrier("ba_jax_tokenizer")  # the others read what process 0 wrote
    else:
        path = cfg.tokenizer_path or cfg.model.init_path
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the option named
        raise ConfigError(f"tokenizer at {path!r} cannot be loaded: {e}") from e


def load_prompt_set(cfg: Any, tokenizer, workdir: str) -> data.PromptDataset:
    """The prompt set: generated arithmetic problems, or a local dataset file."""
    if cfg.task == "arithmetic":
        a = cfg.arithmetic
        path = os.path.join(workdir, "data", "arithmetic.jsonl")
        if distributed.is_primary():
            arithmetic.write_problems(path, max_operand=a.max_operand, ops=a.ops,
                                      num_problems=a.num_problems, seed=cfg.seed)
        distributed.barrier("ba_jax_problems")
        dcfg = data.DataConfig(path=path, format="dapo17k", template="plain",
                               max_prompt_tokens=cfg.data.max_prompt_tokens)
    else:
        d = cfg.data
        try:
            dcfg = data.DataConfig(path=d.path, format=d.format, template=d.template,
                                   max_prompt_tokens=d.max_prompt_tokens,
                                   prompt_suffix=d.prompt_suffix or None,
                                   enable_thinking=d.enable_thinking)
        except ValueError as e:
            raise ConfigError(f"config.data: {e}") from e
    try:
        ds = data.load_prompts(dcfg, tokenizer)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"config.data ({dcfg.path}): {e}") from e
    _check(len(ds.prompt_ids) >= cfg.rollout.prompts_per_step,
           f"only {len(ds.prompt_ids)} usable prompts in {dcfg.path} (stats {ds.stats}); "
           f"config.rollout.prompts_per_step={cfg.rollout.prompts_per_step}")
    return ds


def init_policy(cfg: Any, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the initial policy, each parameter placed with its sharding."""
    dtype, pdtype = DTYPES[cfg.model.dtype], DTYPES[cfg.model.param_dtype]
    if cfg.model.init in ("hf", "checkpoint"):
        from ba_jax.models import convert_hf

        load = convert_hf.load_hf if cfg.model.init == "hf" else convert_hf.load_checkpoint
        try:
            model = load(cfg.model.init_path, dtype=dtype, param_dtype=pdtype, mesh=mesh)
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            raise ConfigError(
                f"config.model.init_path={cfg.model.init_path!r} (init={cfg.model.init}): "
                f"{type(e).__name__}: {e}") from e
        model.config = dataclasses.replace(model.config, **runtime_options(cfg))
        return nnx.split(model)
    mcfg = model_config(cfg)

    def create():
        return qwen.Qwen(mcfg, rngs=nnx.Rngs(cfg.seed), dtype=dtype, param_dtype=pdtype)

    graphdef, abstract = nnx.split(nnx.eval_shape(create))
    shardings = sharding.param_shardings(abstract, mesh)
    params = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
    return graphdef, params


def make_optimizer(cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW, linear warm-up then constant (DAPO recipe) or cosine LR, global-norm clipping.

    Update k (from 0) uses lr * min(1, (k+1)/warmup) during warm-up (never exactly 0);
    `cosine` then decays to `final_lr_fraction * lr` at the last update.
    """
    o = cfg.optim
    warm = max(1, o.warmup_steps)
    total = max(warm + 1, cfg.num_train_steps * cfg.grpo.num_updates * cfg.grpo.num_minibatches)
    _check(o.schedule in ("constant", "cosine"),
           f"config.optim.schedule={o.schedule!r}; valid: constant, cosine")

    def schedule(count):
        ramp = jnp.minimum(1.0, (count + 1) / warm)
        if o.schedule == "constant":
            return o.learning_rate * ramp
        frac = jnp.clip((count + 1 - warm) / (total - warm), 0.0, 1.0)
        decay = o.final_lr_fraction + (1 - o.final_lr_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        return o.learning_rate * ramp * decay

    tx = optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
    )
    return tx, schedule
