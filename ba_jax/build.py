"""The parts of a run, made from a checked experiment config.

What lives here: the mesh, the tokenizer, the prompt set, the policy's initial parameters
(random, Hugging Face folder, or converted Orbax checkpoint), the optimizer, the typed
settings library code takes (loss, sampling, engine, experience, warm-up), the rollout
engine (`make_rollout_engine`: the one reader of `rollout.engine`) and a model to evaluate
from any checkpoint layout (`load_model`), each read from the config and handed on as
typed values. What does not: reading and checking the
config (run_config.py), the optimizer and schedule themselves (optim.py), the update
(train.py) or the host side of an iteration (experience.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import optax
from flax import nnx

from ba_jax import (
    checkpoint,
    correction,
    data,
    distributed,
    experience,
    grpo,
    optim,
    paths,
    run_config,
    sharding,
)
from ba_jax.models import convert_hf, qwen
from ba_jax.rollout import EngineSettings, RolloutEngine, SamplingSettings, prompt_bucket
from ba_jax.tasks import arithmetic, warmup


def make_mesh(cfg: Any, devices: list | None = None) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all)."""
    devices = jax.devices() if devices is None else devices
    return sharding.make_mesh(run_config.mesh_axes(cfg, len(devices)), devices=devices)


def load_tokenizer(cfg: Any, workdir: str):
    """The run's tokenizer: the embedded task builds its own into WORKDIR/tokenizer (a URL
    workdir: saved into a local staging folder and uploaded; read from a downloaded copy)."""
    stage = None
    if cfg.task == "arithmetic" and not cfg.tokenizer_path:
        path = paths.join(workdir, "tokenizer")
        stage = paths.staging(path, "tokenizer")
        if distributed.is_primary() and not paths.exists(paths.join(path, "tokenizer.json")):
            arithmetic.save_tokenizer(stage)
            paths.upload_tree(stage, path)
        distributed.barrier("ba_jax_tokenizer")  # the others read what process 0 wrote
        paths.download_tree(path, stage)
    else:
        path = cfg.tokenizer_path or cfg.model.init_path
    try:
        return convert_hf.load_tokenizer(stage or path)
    except Exception as e:
        raise run_config.ConfigError(f"tokenizer at {path!r} cannot be loaded: {e}") from e
    finally:
        if stage is not None:
            paths.remove_staging(stage, path)


def check_tokenizer_fits(cfg: Any, tokenizer, vocab_size: int, eos_ids) -> None:
    """Every id the tokenizer can produce (its vocabulary, special, pad and EOS ids) must
    be a row of the model's embedding: an id past `vocab_size` gives NaN logits."""
    special = {"pad": tokenizer.pad_token_id, "EOS": max(eos_ids, default=None),
               "special": max(tokenizer.all_special_ids, default=None)}
    n = len(tokenizer)
    largest = max([n - 1, *tokenizer.get_vocab().values()]
                  + [i for i in special.values() if i is not None])
    if largest < vocab_size:
        return
    over = ", ".join(f"{k} id {i}" for k, i in special.items() if i is not None and i >= vocab_size)
    if cfg.model.init == "random":
        source = (f"config.model.preset={cfg.model.preset!r}" if cfg.model.preset
                  else "config.model.vocab_size")
    else:
        source = f"config.model.init_path={cfg.model.init_path!r} (init={cfg.model.init})"
    name = cfg.tokenizer_path or getattr(tokenizer, "name_or_path", "") or "the run's tokenizer"
    raise run_config.ConfigError(
        f"tokenizer {name!r} has {n} tokens (largest id {largest}"
        f"{'; ' + over if over else ''}) but the model's vocabulary has {vocab_size} ({source}): "
        "ids past it give NaN logits; use the model's own tokenizer (config.tokenizer_path) "
        f"or a model with vocab_size >= {largest + 1}")


def load_prompt_set(cfg: Any, tokenizer, workdir: str) -> data.PromptDataset:
    """The prompt set: generated arithmetic problems, or a local dataset file."""
    if cfg.task == "arithmetic":
        a = cfg.arithmetic
        # a URL workdir: written to a local staging folder (the `datasets` reader reads
        # local files), uploaded as the run's record; the other processes download it
        folder = paths.join(workdir, "data")
        path = os.path.join(paths.staging(folder, "data"), "arithmetic.jsonl")
        if distributed.is_primary():
            arithmetic.write_problems(path, max_operand=a.max_operand, ops=a.ops,
                                      num_problems=a.num_problems, seed=cfg.seed)
            paths.upload_tree(os.path.dirname(path), folder)
        distributed.barrier("ba_jax_problems")
        if not distributed.is_primary():
            paths.download_tree(folder, os.path.dirname(path))
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
            raise run_config.ConfigError(f"config.data: {e}") from e
    try:
        ds = data.load_prompts(dcfg, tokenizer)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise run_config.ConfigError(f"config.data ({dcfg.path}): {e}") from e
    P = cfg.rollout.prompts_per_step
    run_config.require(len(ds.prompt_ids) >= P,
                       f"only {len(ds.prompt_ids)} usable prompts in {dcfg.path} (stats "
                       f"{ds.stats}); config.rollout.prompts_per_step={P}")
    return ds


def init_policy(cfg: Any, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the initial policy, each parameter placed with its sharding."""
    dtype = run_config.DTYPES[cfg.model.dtype]
    pdtype = run_config.DTYPES[cfg.model.param_dtype]
    if cfg.model.init in ("hf", "checkpoint"):
        load = convert_hf.load_hf if cfg.model.init == "hf" else convert_hf.load_checkpoint
        try:
            model = load(cfg.model.init_path, dtype=dtype, param_dtype=pdtype, mesh=mesh)
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            raise run_config.ConfigError(
                f"config.model.init_path={cfg.model.init_path!r} (init={cfg.model.init}): "
                f"{type(e).__name__}: {e}") from e
        model.config = dataclasses.replace(model.config, **run_config.runtime_options(cfg))
        return nnx.split(model)
    mcfg = run_config.model_config(cfg)

    def create():
        return qwen.Qwen(mcfg, rngs=nnx.Rngs(cfg.seed), dtype=dtype, param_dtype=pdtype)

    graphdef, abstract = nnx.split(nnx.eval_shape(create))
    shardings = sharding.param_shardings(abstract, mesh)
    params = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
    return graphdef, params


# ---------------------------------------------------------------- a model to evaluate


def detect_checkpoint(path: str) -> tuple[str, str]:
    """(kind, folder): "hf", "converted" (convert_hf output) or "trainer" (its Orbax folder)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} is not a folder")
    names = set(os.listdir(path))
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "hf", path
    if "model_config.json" in names and "params" in names:
        return "converted", path
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a trainer WORKDIR
        path = os.path.join(path, "checkpoints")
        names = set(os.listdir(path))
    if any(n.isdigit() and os.path.isdir(os.path.join(path, n)) for n in names):
        return "trainer", path
    raise ValueError(
        f"{path!r} holds no checkpoint: expected a Hugging Face folder (config.json + "
        "*.safetensors), a convert_hf output (model_config.json + params/), or a trainer "
        "WORKDIR or WORKDIR/checkpoints (Orbax step folders)")


def load_model(cfg: Any, path: str, *, step: int | None = None,
               mesh=None) -> tuple[Any, Any, dict]:
    """(model, tokenizer, info) of any checkpoint layout; info: kind, path, step, workdir.

    A trainer checkpoint is read with `cfg`'s model (its initial policy gives the shapes)
    on `mesh` (default: the config's mesh over all devices); only its parameters are read.
    """
    kind, folder = detect_checkpoint(path)
    info = {"kind": kind, "path": os.path.abspath(folder), "step": None}
    # compute in the run's dtype, master weights in its parameter dtype (as the trainer)
    dtype = run_config.DTYPES[cfg.model.dtype]
    param_dtype = run_config.DTYPES[cfg.model.param_dtype]
    if kind == "trainer":
        try:
            mesh = make_mesh(cfg) if mesh is None else mesh
            graphdef, target = init_policy(cfg, mesh)
            params, info["step"] = checkpoint.load_params(folder, target, step=step)
        except checkpoint.NoSuchStep:
            raise
        except checkpoint.CheckpointError as e:
            raise checkpoint.CheckpointError(
                f"{str(e).split('. It comes from')[0]}: a trainer checkpoint is read with "
                "--config's model; pass the config the run was trained with (same variant and "
                "overrides)") from e
        model = nnx.merge(graphdef, params)
        info["workdir"] = os.path.dirname(os.path.abspath(folder))
        tokenizer = load_tokenizer(cfg, info["workdir"])  # honours config.tokenizer_path
    else:
        if kind == "hf":
            model = convert_hf.load_hf(folder, dtype=dtype, mesh=mesh, param_dtype=param_dtype)
        else:
            model = convert_hf.load_checkpoint(folder, dtype=dtype, mesh=mesh,
                                               param_dtype=param_dtype)
        try:
            tokenizer = convert_hf.load_tokenizer(cfg.tokenizer_path or folder)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}; set --config.tokenizer_path") from None
    return model, tokenizer, info


def make_optimizer(cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`optim.make_optimizer` with config.optim's settings over the run's number of updates."""
    o = cfg.optim
    run_config.require(o.schedule in optim.SCHEDULES,
                       f"config.optim.schedule={o.schedule!r}; valid: {', '.join(optim.SCHEDULES)}")
    return optim.make_optimizer(
        learning_rate=o.learning_rate, schedule=o.schedule, warmup_steps=o.warmup_steps,
        final_lr_fraction=o.final_lr_fraction,
        total_updates=cfg.num_train_steps * cfg.grpo.num_updates * cfg.grpo.num_minibatches,
        b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip)


# ---------------------------------------------------------------- typed settings, built once


def loss_settings(cfg: Any):
    """The update's objective (`grpo.LossSettings`) from config.grpo."""
    g = cfg.grpo
    return grpo.LossSettings(
        aggregation=g.aggregation, max_len=g.constant_max_len or cfg.rollout.max_new_tokens,
        count_degenerate_groups=bool(g.count_degenerate_groups), eps_low=float(g.eps_low),
        eps_high=float(g.eps_high), dual_clip=float(g.dual_clip) if g.dual_clip else None,
        kl_kind=None if g.kl_kind == "none" else g.kl_kind, kl_beta=float(g.kl_beta),
        num_microbatches=int(g.num_microbatches),
        correction=correction.CorrectionSettings(
            rollout_is=g.rollout_is, is_threshold=float(g.rollout_is_threshold),
            rollout_rs=g.rollout_rs, rs_lower=run_config.rs_lower(cfg),
            rs_upper=float(g.rollout_rs_threshold), check_every=int(g.logp_check_every)))


def sampling_settings(cfg: Any, eos_ids, pad_id: int | None) -> SamplingSettings:
    """One RL step's sampling (config.rollout) with the tokenizer's EOS and pad ids."""
    r = cfg.rollout
    return SamplingSettings(num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                            eos_ids=tuple(sorted(eos_ids)), temperature=r.temperature,
                            top_k=r.top_k, top_p=r.top_p, pad_id=pad_id)


def engine_settings(cfg: Any, *, prompts_per_call: int = 0) -> EngineSettings:
    """The paged engine's settings (config.rollout: num_slots, page_size, kv_pages,
    prefill_chunk); ConfigError naming a bad one."""
    r = cfg.rollout
    try:
        return EngineSettings(num_slots=r.num_slots, page_size=r.page_size,
                              num_pages=r.kv_pages, prefill_chunk=r.prefill_chunk,
                              prompts_per_call=prompts_per_call)
    except ValueError as e:
        raise run_config.ConfigError(f"config.rollout: {e}") from e


def warmup_settings(cfg: Any) -> warmup.WarmupSettings | None:
    """The embedded task's supervised warm-up (config.arithmetic), or None where there is
    none (another task, or `warmup_steps=0`)."""
    a = cfg.arithmetic
    if cfg.task != "arithmetic" or a.warmup_steps <= 0:
        return None
    return warmup.WarmupSettings(
        steps=a.warmup_steps, batch_size=a.warmup_batch_size,
        learning_rate=a.warmup_learning_rate, correct_frac=a.warmup_correct_frac,
        target_accuracy=a.warmup_target_accuracy, response_len=cfg.rollout.max_new_tokens,
        max_operand=a.max_operand, ops=a.ops, seed=cfg.seed)


def experience_settings(cfg: Any) -> experience.ExperienceSettings:
    """How a step's experience is gathered (config.rollout and config.grpo)."""
    r, g = cfg.rollout, cfg.grpo
    return experience.ExperienceSettings(
        prompts_per_step=r.prompts_per_step, sample_shards=r.sample_shards,
        dynamic_sampling=bool(g.dynamic_sampling), max_resample_rounds=g.max_resample_rounds,
        overlong_buffer=g.overlong_buffer, overlong_factor=g.overlong_factor,
        advantage=g.advantage)


# ---------------------------------------------------------------- the rollout engine

ROLLOUT_ALIASES = {"ba_jax": "paged"}  # old value -> its name now


def rollout_engine_kind(cfg: Any) -> str:
    """The one reader of config.rollout.engine (besides `run_config.validate`'s check):
    'paged' or 'vllm'; the old name 'ba_jax' is accepted with a one-line deprecation note."""
    kind = cfg.rollout.engine
    if kind in ROLLOUT_ALIASES:
        print(f"note: config.rollout.engine={kind!r} is deprecated; it is now "
              f"{ROLLOUT_ALIASES[kind]!r} (same engine)")
        kind = ROLLOUT_ALIASES[kind]
    run_config.require(kind in run_config.ROLLOUT_ENGINES,
                       f"config.rollout.engine={cfg.rollout.engine!r}; valid: "
                       f"{', '.join(run_config.ROLLOUT_ENGINES)}")
    return kind


def old_logp_recompute(cfg: Any) -> bool:
    """Whether pi_old is the trainer's recomputation before the update (`grpo.old_logp`,
    resolved by `run_config.old_logp_source`: `auto` is recompute for vLLM, the engine's
    log-probs for the paged engine, whose decode runs the trainer's model code)."""
    return run_config.old_logp_source(cfg) == "recompute"


def make_rollout_engine(cfg: Any, graphdef, mesh, model_cfg: qwen.ModelConfig, *,
                        prompts_per_call: int = 0) -> RolloutEngine:
    """The run's `rollout.RolloutEngine`: the in-house paged engine (decoding on `mesh`'s
    row devices, or this process's under multi-host) or a vLLM engine process (started
    here; a failed start is a ConfigError naming the cause). Close it when done."""
    if rollout_engine_kind(cfg) == "vllm":
        from ba_jax import vllm_rollout

        r = cfg.rollout
        try:
            return vllm_rollout.VllmEngine(
                model_cfg, dtype=cfg.model.dtype, python=r.vllm_python or None, seed=cfg.seed,
                max_model_len=prompt_bucket(cfg.data.max_prompt_tokens) + r.max_new_tokens,
                max_num_seqs=r.prompts_per_step // r.sample_shards * r.num_samples,
                enforce_eager=r.vllm_enforce_eager)
        except (ValueError, vllm_rollout.VllmEngineError) as e:
            raise run_config.ConfigError(f"config.rollout.engine=vllm: {e}") from e
    from ba_jax.engine import paged

    sample_mesh = distributed.local_mesh(mesh) if jax.process_count() > 1 else mesh
    return paged.PagedEngine(graphdef, engine_settings(cfg, prompts_per_call=prompts_per_call),
                             dtype=run_config.DTYPES[cfg.model.dtype], mesh=mesh,
                             sample_mesh=sample_mesh)
