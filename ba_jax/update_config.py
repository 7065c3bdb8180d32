"""Config checks of how the update gets its inputs: where pi_old comes from
(`old_logp_source`), the rollout correction (`check_consistency`, `rs_lower`), the vLLM
engine that supplies the engine's log-probs (`check_vllm`), and the packed layout every
log-prob pass runs on (`check_packing`). `run_config.validate` calls them; they raise
`ConfigError` naming the option.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from ba_jax import correction
from ba_jax.config_error import require
from ba_jax.models import attention


def check_packing(cfg: Any) -> None:
    """`grpo.max_tokens_per_device`: an integer >= 0; > 0 needs `grpo.num_microbatches`
    1 (the packer makes the micro-batches) and a budget that holds the longest sequence a
    step can produce, `data.max_prompt_tokens + rollout.max_new_tokens - 1` input tokens
    (a sequence is never cut)."""
    g = cfg.grpo
    budget = g.max_tokens_per_device
    require(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0,
            f"config.grpo.max_tokens_per_device={budget!r} must be an integer >= 0 (0: padded "
            "rows, no packing)")
    if budget == 0:
        return
    require(g.num_microbatches == 1,
            f"config.grpo.num_microbatches={g.num_microbatches} with "
            f"config.grpo.max_tokens_per_device={budget}: the packer chooses the micro-batches "
            "(blocks of that many tokens per device); set num_microbatches=1")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    require(longest <= budget,
            f"config.grpo.max_tokens_per_device={budget} is shorter than the longest sequence "
            f"a step can hold, {longest} tokens (config.data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens} + config.rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} - 1): raise the budget or lower those")


def check_vllm(cfg: Any, mc) -> None:
    """`rollout.engine=vllm`: its environment is there, its options are valid, one process
    (`mc`: the model's `qwen.ModelConfig` where the config declares one, else None)."""
    from ba_jax import vllm_rollout

    r = cfg.rollout
    if mc is not None and attention.backend() == "cpu":  # vLLM-CPU (`make vllm`)
        require(mc.head_dim in vllm_rollout.CPU_HEAD_SIZES,
                f"config.rollout.engine=vllm: the model's head size {mc.head_dim} "
                f"(head_dim) is not one vLLM-CPU's attention takes "
                f"({', '.join(map(str, vllm_rollout.CPU_HEAD_SIZES))}); use "
                "rollout.engine=paged, or a model with one of those (configs/default.py:head32 "
                "is the default run with heads of 32)")
    require(isinstance(r.vllm_enforce_eager, bool),
            f"config.rollout.vllm_enforce_eager={r.vllm_enforce_eager!r} must be True or False")
    python = os.path.abspath(r.vllm_python) if r.vllm_python else vllm_rollout.DEFAULT_PYTHON
    require(os.path.isfile(python) and os.access(python, os.X_OK),
            f"config.rollout.engine=vllm: {python} is not an executable Python: run `make vllm`"
            " to build the vLLM environment, or set config.rollout.vllm_python")
    require(jax.process_count() == 1,
            "config.rollout.engine=vllm runs one engine beside one trainer process; with "
            f"{jax.process_count()} processes use rollout.engine=paged")


OLD_LOGP = ("auto", "engine", "recompute")  # config.grpo.old_logp


def old_logp_source(cfg: Any) -> str:
    """'engine' or 'recompute': `grpo.old_logp`, or its old name `rollout.vllm_logprobs`
    (vLLM only) where that is set; `auto` is recompute for vLLM (other kernels, another
    process) and the engine's log-probs for the paged engine (the trainer's model code)."""
    g, r = cfg.grpo, cfg.rollout
    vllm = r.engine == "vllm"
    alias = r.vllm_logprobs if vllm else ""
    require(alias in ("", "recompute", "engine"),
            f"config.rollout.vllm_logprobs={alias!r}; valid: recompute, engine (its new name: "
            "config.grpo.old_logp)")
    require(g.old_logp in OLD_LOGP,
            f"config.grpo.old_logp={g.old_logp!r}; valid: {', '.join(OLD_LOGP)}")
    require(not alias or g.old_logp in ("auto", alias),
            f"config.rollout.vllm_logprobs={alias!r} (the old name of config.grpo.old_logp) "
            f"contradicts config.grpo.old_logp={g.old_logp!r}: set only grpo.old_logp")
    if g.old_logp != "auto":
        return g.old_logp
    return alias or ("recompute" if vllm else "engine")


def rs_lower(cfg: Any) -> float:
    """The rejection's lower bound: `grpo.rollout_rs_threshold_lower`, 0 meaning
    1 / `grpo.rollout_rs_threshold` (verl's default)."""
    g = cfg.grpo
    return float(g.rollout_rs_threshold_lower or 1.0 / g.rollout_rs_threshold)


def check_consistency(cfg: Any) -> None:
    """`grpo.old_logp`, `grpo.logp_check_every` and the rollout correction's options."""
    g, levels = cfg.grpo, ", ".join(correction.LEVELS)
    source = old_logp_source(cfg)
    require(isinstance(g.logp_check_every, int) and g.logp_check_every >= 0,
            f"config.grpo.logp_check_every={g.logp_check_every!r} must be an integer >= 0 "
            "(0: never check the engine's log-probs against the trainer's)")
    for name in ("rollout_is", "rollout_rs"):
        value = getattr(g, name)
        require(value in correction.LEVELS, f"config.grpo.{name}={value!r}; valid: {levels}")
        require(value == "none" or source == "recompute",
                f"config.grpo.{name}={value!r} compares the engine's log-probs with the "
                "trainer's, but with config.grpo.old_logp="
                f"{g.old_logp!r} ({source}) the trainer's are not computed: set "
                "config.grpo.old_logp='recompute'")
    require(g.rollout_is_threshold > 1,
            f"config.grpo.rollout_is_threshold={g.rollout_is_threshold} must be > 1: the "
            "weights are min(ratio, threshold) and the on-policy ratio is 1 (verl: 2.0)")
    upper, lower = g.rollout_rs_threshold, g.rollout_rs_threshold_lower
    require(upper > 0 and lower >= 0,
            f"config.grpo.rollout_rs_threshold={upper} must be > 0 and "
            f"rollout_rs_threshold_lower={lower} >= 0 (0: 1 / rollout_rs_threshold)")
    require(rs_lower(cfg) < upper,
            f"config.grpo.rollout_rs_threshold_lower={lower} and rollout_rs_threshold={upper}"
            " are in the wrong order: the rejection keeps ratios in [lower, upper]")
    require(rs_lower(cfg) < 1 < upper,
            f"config.grpo.rollout_rs bounds [{rs_lower(cfg):g}, {upper:g}] must hold the "
            "on-policy ratio 1 strictly inside (verl: [0.5, 2])")
