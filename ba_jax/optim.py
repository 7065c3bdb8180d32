"""The optimizer: AdamW with global-norm clipping, its learning-rate schedule, its state.

What lives here: `make_optimizer` (typed settings -> `(tx, schedule)`) and
`init_opt_state` (the optimizer state created on the mesh, each moment sharded like its
parameter). What does not: reading the settings from the config (`build.make_optimizer`),
the update step itself and the train state around it (train.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

SCHEDULES = ("constant", "cosine")


def make_optimizer(*, learning_rate: float, schedule: str, warmup_steps: int,
                   final_lr_fraction: float, total_updates: int, b1: float, b2: float,
                   weight_decay: float, grad_clip: float,
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW, linear warm-up then constant (DAPO recipe) or cosine LR, global-norm clipping.

    Update k (from 0) uses lr * min(1, (k+1)/warmup) during warm-up (never exactly 0);
    `cosine` then decays to `final_lr_fraction * lr` at update `total_updates`.
    `grad_clip` <= 0 turns clipping off.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; valid: {', '.join(SCHEDULES)}")
    warm = max(1, warmup_steps)
    total = max(warm + 1, total_updates)

    def lr(count):
        ramp = jnp.minimum(1.0, (count + 1) / warm)
        if schedule == "constant":
            return learning_rate * ramp
        frac = jnp.clip((count + 1 - warm) / (total - warm), 0.0, 1.0)
        decay = final_lr_fraction + (1 - final_lr_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        return learning_rate * ramp * decay

    tx = optax.chain(
        optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity(),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
    )
    return tx, lr


def opt_state_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
    """The optimizer state's shardings for `params` (arrays, or `jax.ShapeDtypeStruct`s with
    shardings: the planner's): each moment shares its parameter's sharding (so FSDP shards
    AdamW's mu/nu too), everything else (counts) is replicated. The one rule: the trainer's
    `init_opt_state` and the planner's abstract state both use it."""
    abstract = jax.eval_shape(tx.init, params)
    rep = NamedSharding(mesh, PS())
    return optax.tree_map_params(
        tx, lambda _, p: p.sharding, abstract, params, transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def init_opt_state(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
    """Optimizer state created in place, laid out by `opt_state_shardings`."""
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params)
