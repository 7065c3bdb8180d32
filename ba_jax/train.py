"""The GRPO train step (pure, jitted once) and the RL loop around it.

What lives here: `train_step(state, batch)` and `make_train_step` (shardings, donation),
the train state, `Updater` / `update` (one RL step's update: the old-log-prob and reference
passes, every mini-batch, the aggregation diagnostics), `prepare_policy` (what runs before
the first RL step of a fresh run) and `run_training`, the plain Python loop:
engine.sync -> experience.collect -> update -> metrics.step_record -> checkpoint. What does not: checking the config
(run_config.py), building the run from it (build.py), the optimizer (optim.py), the
embedded task's supervised warm-up (tasks/warmup.py), collecting experience
(experience.py), the aggregation rules (aggregation.py), the policy's log-probs and the
losses (grpo.py).

Batch layout (rows of one prompt contiguous, B = P*G): `prompt_tokens_BT` left-padded
prompts, `tokens_BR` the R response slots; the policy reads `[prompt | response]` and the
loss sees only response positions. Aggregation weights are computed inside the step on
the whole mini-batch, before it is cut into micro-batches (spec: aggregation.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ba_jax import (
    aggregation,
    build,
    checkpoint,
    correction,
    data,
    distributed,
    experience,
    grpo,
    optim,
    run_config,
    sharding,
    workdir_lock,
)
from ba_jax import metrics as metrics_lib
from ba_jax.rewards import math as math_rewards
from ba_jax.tasks import warmup


def _loss_fn(params, mb, *, graphdef, loss: grpo.LossSettings):
    logp_BR, ent_BR = grpo.policy_logprobs(graphdef, params, mb, with_entropy=True)
    total, m = grpo.grpo_loss(
        logp_BR, mb["old_logp_BR"], mb["adv_B"], mb["w_BR"], mb["mask_BR"],
        eps_low=loss.eps_low, eps_high=loss.eps_high, dual_clip=loss.dual_clip,
        ref_logp_BT=mb.get("ref_logp_BR") if loss.kl_kind else None,
        kl_kind=loss.kl_kind, kl_beta=loss.kl_beta, pg_factor_BT=mb.get("pg_factor_BR"))
    m["entropy"] = jnp.sum(mb["mask_BR"] * ent_BR)
    return total, m


def train_step(state, batch, *, graphdef, tx, loss: grpo.LossSettings, num_groups: int):
    """One optimizer step on one mini-batch; a non-finite loss/grad leaves state unchanged."""
    rule = aggregation.resolve_rule(loss.aggregation)
    w_BR = aggregation.token_weights(rule, batch["mask_BR"], batch["adv_B"], batch["group_id_B"],
                                     num_groups, **loss.rule_options)
    batch = dict(batch, w_BR=w_BR)
    if loss.correction.active:  # the rollout correction: row-wise, on the whole mini-batch
        batch["pg_factor_BR"] = correction.pg_factor(
            batch["old_logp_BR"], batch.pop("engine_logp_BR"), batch["mask_BR"], loss.correction)
    loss_fn = functools.partial(_loss_fn, graphdef=graphdef, loss=loss)
    total, grads, aux = grpo.accumulate_gradients(loss_fn, state["params"], batch,
                                                  loss.num_microbatches)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    new_state = dict(
        params=jax.tree.map(keep, params, state["params"]),
        opt_state=jax.tree.map(keep, opt_state, state["opt_state"]),
        step=state["step"] + finite.astype(jnp.int32),
    )
    n = jnp.maximum(aux["num_tokens"], 1.0)
    out = dict(loss=total, pg_loss=aux["pg_loss"], grad_norm=grad_norm,
               clipfrac_low=aux["clip_low"] / n, clipfrac_high=aux["clip_high"] / n,
               clipfrac_dual=aux["clip_dual"] / n, ratio_mean=aux["ratio"] / n,
               entropy=aux["entropy"] / n, weight_sum=aux["weight_sum"],
               nonfinite=1.0 - finite.astype(jnp.float32))
    if "kl" in aux:
        out["kl"] = aux["kl"]
    return new_state, out


def make_train_step(loss: grpo.LossSettings, graphdef, tx: optax.GradientTransformation,
                    state, mesh, num_groups: int):
    """jit(train_step) with the state's shardings, rows over (data, fsdp), state donated.

    `tx` is the optimizer `state["opt_state"]` was made by (`build.make_optimizer`).
    """
    fn = functools.partial(train_step, graphdef=graphdef, tx=tx, loss=loss,
                           num_groups=num_groups)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    row_sh = sharding.batch_sharding(mesh)

    def step(state, batch):
        # the mesh in context at trace time: the kernel seam shard_maps kernels XLA cannot
        # partition (splash attention) over it
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(state, batch)

    return jax.jit(step, in_shardings=(state_sh, row_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, PS())), donate_argnums=(0,))


def make_reference_fn(num_microbatches: int, graphdef, ref_params, mesh):
    """jit of response log-probs on a mini-batch under parameters laid out like `ref_params`
    (the frozen KL reference, or the policy itself for old_logp), micro-batched as the train
    step is (`grpo.reference_logprobs`), rows over (data, fsdp)."""
    row_sh = sharding.batch_sharding(mesh)
    fn = functools.partial(grpo.reference_logprobs, graphdef,
                           num_microbatches=num_microbatches)

    def ref(params, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(params, batch)

    return jax.jit(ref, in_shardings=(jax.tree.map(lambda x: x.sharding, ref_params), row_sh),
                   out_shardings=row_sh)


def replicate_unsharded(tree, mesh):
    """Give every leaf without a mesh sharding (optimizer counts, step) a replicated one.

    Otherwise the first call of a jitted step sees uncommitted scalars and the second
    call sees mesh-sharded outputs: two compilations of the same step.
    """
    rep = NamedSharding(mesh, PS())
    return jax.tree.map(
        lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
        else jax.device_put(x, rep), tree)


def init_state(params, tx, mesh) -> dict:
    """Fresh train state: parameters, optimizer state and update count, all mesh-placed."""
    state = dict(params=params, opt_state=optim.init_opt_state(tx, params, mesh),
                 step=jnp.zeros((), jnp.int32))
    return replicate_unsharded(state, mesh)


def _eos_ids(tokenizer) -> set[int]:
    try:
        return set(data.eos_ids(tokenizer))
    except ValueError as e:
        raise run_config.ConfigError(str(e)) from e


def _config_json(cfg) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def _save(ckpt, step: int, state, iterator, cfg) -> float:
    """Checkpoint `step`; a failed write (disk full, permissions) stops the run with the
    previous checkpoint intact (Orbax writes to a temporary folder and renames it)."""
    t0 = time.perf_counter()
    try:
        ckpt.save(step, state, dict(step=step, data_iterator=iterator.state(),
                                    config=_config_json(cfg)))
    except (OSError, checkpoint.CheckpointError) as e:  # Orbax's own, or TensorStore's
        prev = [s for s in ckpt.steps() if s < step]
        reason = getattr(e, "reason", None) or checkpoint.summarize(e)
        raise checkpoint.CheckpointError(
            f"saving checkpoint step {step} in {ckpt.directory} failed ({reason}); "
            + (f"the previous checkpoint (step {prev[-1]}) is intact: fix the cause and run "
               "again to resume from it" if prev else "no earlier checkpoint exists"),
            reason) from e
    return time.perf_counter() - t0


def minibatch(batch: dict[str, np.ndarray], m: int, M: int, Pg: int, G: int) -> dict[str, np.ndarray]:
    """Mini-batch m of M from this process's rows: the m-th M-th of every sampling shard.

    Rows hold whole shards of Pg groups; group ids become ids within the mini-batch, so a
    mini-batch is the same set of groups whether its shards live on one process or many.
    """
    n = len(batch["adv_B"]) // (Pg * G)  # local shards
    per = Pg // M  # groups of one shard in one mini-batch
    idx = np.concatenate([np.arange((s * Pg + m * per) * G, (s * Pg + (m + 1) * per) * G)
                          for s in range(n)])
    mb = {k: v[idx] for k, v in batch.items()}
    gid = mb["group_id_B"]
    shard = gid // Pg
    mb["group_id_B"] = (shard * per + (gid - shard * Pg - m * per)).astype(np.int32)
    return mb


@dataclasses.dataclass
class Updater:
    """The jitted pieces of one RL step's update, built once per run (`make_updater`)."""

    step_fn: Any  # make_train_step's
    diag_fn: Any  # aggregation diagnostics of the whole step's batch
    row_sharding: Any
    num_minibatches: int  # M
    groups_per_shard: int  # Pg: prompts of one sampling shard
    num_samples: int  # G
    num_updates: int  # passes over the mini-batches
    recompute: bool = False  # pi_old is the trainer's recomputation (else the engine's)
    check_every: int = 0  # with the engine's pi_old: recompute and measure every N-th step
    corr: correction.CorrectionSettings = correction.CorrectionSettings()
    old_fn: Any = None  # the trainer's log-probs before the update (recompute or check)
    stats_fn: Any = None  # the mismatch between the engine's log-probs and the trainer's
    ref_params: Any = None  # the frozen KL reference (None: no KL term)
    ref_fn: Any = None


def make_updater(loss: grpo.LossSettings, graphdef, tx, state, mesh, *, prompts_per_step: int,
                 sample_shards: int, num_samples: int, num_minibatches: int, num_updates: int,
                 recompute_old_logp: bool, compute_dtype) -> Updater:
    """The run's `Updater`: the train step, the reference (the starting policy in the
    compute dtype, sharded like it) when the loss has a KL term, the trainer's forward
    before the update when it gives pi_old (`recompute_old_logp`) or checks the engine's
    every `loss.correction.check_every` steps."""
    M, P = num_minibatches, prompts_per_step
    rep = NamedSharding(mesh, PS())
    upd = Updater(
        step_fn=make_train_step(loss, graphdef, tx, state, mesh, num_groups=P // M),
        diag_fn=jax.jit(functools.partial(
            aggregation.diagnostics, aggregation.resolve_rule(loss.aggregation), num_groups=P,
            **loss.rule_options), out_shardings=rep),
        row_sharding=sharding.batch_sharding(mesh), num_minibatches=M,
        groups_per_shard=P // sample_shards, num_samples=num_samples, num_updates=num_updates)
    if loss.kl_kind is not None:  # validate: kl_beta > 0 with it, and only with it
        upd.ref_params = jax.jit(functools.partial(grpo.compute_copy, dtype=compute_dtype))(
            state["params"])
        upd.ref_fn = make_reference_fn(loss.num_microbatches, graphdef, upd.ref_params, mesh)
    upd.recompute, upd.corr = bool(recompute_old_logp), loss.correction
    upd.check_every = loss.correction.check_every
    if upd.recompute or upd.check_every > 0:
        upd.old_fn = make_reference_fn(loss.num_microbatches, graphdef, state["params"], mesh)
        upd.stats_fn = jax.jit(functools.partial(correction.statistics, s=loss.correction),
                               out_shardings=rep)
    return upd


def _checks(upd: Updater, state) -> bool:
    """Whether this update recomputes and measures the engine's log-probs: every update
    that recomputes pi_old, else every `check_every`-th RL step. Steps are counted by the
    optimizer's update count (in the checkpoint, so a resumed run checks the same steps):
    steps 1, 1 + N, 1 + 2N, ... of a run whose updates were all finite."""
    if upd.recompute:
        return True
    if upd.check_every <= 0:
        return False
    rl_step = int(jax.device_get(state["step"])) // (upd.num_minibatches * upd.num_updates)
    return rl_step % upd.check_every == 0


def update(upd: Updater, state, batch: dict[str, np.ndarray]):
    """One RL step's update of `state` on this process's rows of `batch` -> (state, metrics:
    the mean of every mini-batch update's, `nonfinite_updates`, `diag_*` of the whole batch,
    and the engine/trainer mismatch `rollout_*` (`correction.summarize`) where the trainer's
    log-probs were computed: every step with `recompute`, else on check steps)."""
    row_sh, M = upd.row_sharding, upd.num_minibatches
    dev = distributed.put_local_rows(
        {k: batch[k] for k in ("mask_BR", "adv_B", "group_id_B")}, row_sh)
    diag = upd.diag_fn(dev["mask_BR"], dev["adv_B"], dev["group_id_B"])
    mbs = [distributed.put_local_rows(
        minibatch(batch, m, M, upd.groups_per_shard, upd.num_samples), row_sh)
        for m in range(M)]
    stats, check = [], _checks(upd, state)
    for mb in mbs:  # before any update of this step: the policy that sampled
        if check:
            trainer_logp = upd.old_fn(state["params"], mb)
            stats.append(upd.stats_fn(trainer_logp, mb["old_logp_BR"], mb["mask_BR"]))
            if upd.recompute:  # else the check only measures: pi_old stays the engine's
                if upd.corr.active:
                    mb["engine_logp_BR"] = mb["old_logp_BR"]
                mb["old_logp_BR"] = trainer_logp
        if upd.ref_fn is not None:
            mb["ref_logp_BR"] = upd.ref_fn(upd.ref_params, mb)
    step_metrics = []
    for _ in range(upd.num_updates):
        for mb in mbs:
            state, out = upd.step_fn(state, mb)
            step_metrics.append(out)
    step_metrics = jax.device_get(step_metrics)
    metrics = {k: float(np.mean([o[k] for o in step_metrics])) for k in step_metrics[-1]}
    metrics["nonfinite_updates"] = sum(float(o["nonfinite"]) for o in step_metrics)
    metrics.update({f"diag_{k}": v for k, v in jax.device_get(diag).items()})
    if stats:
        metrics.update(correction.summarize(jax.device_get(stats), upd.corr))
    return state, metrics


def prepare_policy(w: warmup.WarmupSettings | None, graphdef, state, prompt_set, tokenizer,
                   mesh, tx) -> dict:
    """What runs once before the first RL step of a fresh run: the embedded task's
    supervised format warm-up (`tasks.warmup`, `build.warmup_settings`), which gives a fresh
    train state; without one (other tasks), RL starts from the initial policy as it is."""
    if w is None:
        return state
    params, out = warmup.warm_up(graphdef, state["params"], prompt_set, tokenizer, mesh, w)
    print(f"warm-up: {out['steps']} supervised steps, loss {out['loss']:.3f}, "
          f"p(true answer) {out['p_true']:.3f}; RL starts now")
    return init_state(params, tx, mesh)


def run_training(cfg, workdir: str, *, devices: list | None = None) -> str:
    """Run (or resume) the RL loop of `cfg` in `workdir` on `devices` (default all) -> a
    one-line summary. Plots are the entry point's (`main`, `ba_jax.plot`)."""
    devices = jax.devices() if devices is None else devices
    run_config.validate(cfg, len(devices))
    run_config.check_workdir(workdir)
    with workdir_lock.hold(workdir):  # one run per workdir; released on return, error or death
        return _run(cfg, workdir, devices)


train_and_evaluate = run_training  # the name scripts and tests used before


def _run(cfg, workdir: str, devices: list) -> str:
    """The body of `run_training`, run while holding the workdir lock."""
    mesh = build.make_mesh(cfg, devices)
    tokenizer = build.load_tokenizer(cfg, workdir)
    prompt_set = build.load_prompt_set(cfg, tokenizer, workdir)
    print("prompts: " + ", ".join(f"{k} {v}" for k, v in prompt_set.stats.items()))
    eos_ids = _eos_ids(tokenizer)
    graphdef, params = build.init_policy(cfg, mesh)
    model_cfg = nnx.merge(graphdef, params).config
    build.check_tokenizer_fits(cfg, tokenizer, model_cfg.vocab_size, eos_ids)
    run_config.check_positions(cfg, model_cfg)
    tx, schedule = build.make_optimizer(cfg)
    state = init_state(params, tx, mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                   max_to_keep=cfg.checkpoint.max_to_keep)
    P = cfg.rollout.prompts_per_step
    iterator = data.PromptIterator(len(prompt_set.prompt_ids), P, cfg.seed)
    restored = ckpt.restore_latest(state, fallback_to_previous=cfg.checkpoint.fallback_to_previous)
    if restored is not None:
        _, state, meta = restored
        iterator.restore(meta["data_iterator"])
        start = int(meta["step"])
        print(f"resumed from {ckpt.directory} at step {start}")
    else:
        start = 0
        state = prepare_policy(build.warmup_settings(cfg), graphdef, state, prompt_set,
                               tokenizer, mesh, tx)
        _save(ckpt, 0, state, iterator, cfg)
    summary = (f"metrics {workdir}/metrics.jsonl, plots {os.path.join(workdir, 'plots')}, "
               f"checkpoint {ckpt.directory}")
    if start >= cfg.num_train_steps:
        ckpt.close()
        return f"run complete ({start} steps) in {workdir}: {summary}"

    g, r = cfg.grpo, cfg.rollout
    upd = make_updater(build.loss_settings(cfg), graphdef, tx, state, mesh,
                       prompts_per_step=P, sample_shards=r.sample_shards,
                       num_samples=r.num_samples, num_minibatches=g.num_minibatches,
                       num_updates=g.num_updates,
                       recompute_old_logp=build.old_logp_recompute(cfg),
                       compute_dtype=run_config.DTYPES[cfg.model.dtype])
    sampling = build.sampling_settings(cfg, eos_ids, tokenizer.pad_token_id)
    exp_settings = build.experience_settings(cfg)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=cfg.num_train_steps, start_step=start,
                                       flush_every=cfg.log_every, enabled=distributed.is_primary())
    # The DAPO rule is a regex over 300 characters: scoring it in-process is safe and
    # avoids a pool round trip per step; `boxed` (math-verify) always goes to the pool.
    scorer = math_rewards.MathScorer(timeout_s=cfg.reward.timeout_s,
                                     num_workers=cfg.reward.num_workers or None,
                                     inline_below=1 << 30 if cfg.reward.inline_dapo else 32)
    per_proc = r.sample_shards // jax.process_count()
    shards = list(range(jax.process_index() * per_proc, (jax.process_index() + 1) * per_proc))

    def next_prompts():
        idx = iterator.next_batch()
        return [prompt_set.prompt_ids[i] for i in idx], [prompt_set.ground_truths[i] for i in idx]

    nonfinite_run, last_save_s, finished, engine = 0, 0.0, False, None
    try:
        # started here, so `finally` always stops it (vLLM: an engine process)
        engine = build.make_rollout_engine(cfg, graphdef, mesh, model_cfg)
        for it in range(start + 1, cfg.num_train_steps + 1):
            t0 = time.perf_counter()
            # the engine's weights, handed over once per step (the paged engine: a compute-
            # dtype copy whole on every row device; vLLM: synced into its process), and
            # released before the update, which needs the memory
            sync_s = engine.sync(state["params"])
            exp = experience.collect(
                engine, next_prompts, settings=exp_settings, sampling=sampling,
                key=jax.random.fold_in(jax.random.key(cfg.seed), it), tokenizer=tokenizer,
                scorer=scorer, eos_ids=eos_ids, rule=prompt_set.reward_rule, shards=shards)
            engine.release()
            t1 = time.perf_counter()
            state, upd_metrics = update(upd, state, exp.batch)
            t2 = time.perf_counter()
            nonfinite_run = nonfinite_run + 1 if upd_metrics["nonfinite_updates"] else 0
            host = experience.host_metrics(distributed.gather_rows(exp.first_round),
                                           distributed.gather_rows(exp.final), r.num_samples)
            record = metrics_lib.step_record(
                host=host, update=upd_metrics, timing=exp.timing,
                learning_rate=schedule(max(int(state["step"]) - 1, 0)), sync_s=sync_s,
                step_s=t2 - t0, update_s=t2 - t1, checkpoint_s=last_save_s)
            # The line is written before the checkpoint: a kill in between resumes from the
            # previous checkpoint and rewrites this step, so no step is ever missing.
            writer.write(it, record)
            last_save_s = 0.0
            if it % cfg.checkpoint.every_steps == 0 or it == cfg.num_train_steps:
                last_save_s = _save(ckpt, it, state, iterator, cfg)
            if nonfinite_run >= cfg.max_consecutive_nonfinite:
                raise FloatingPointError(
                    f"{nonfinite_run} steps in a row had a non-finite loss or gradient (last at "
                    f"step {it}); parameters were left unchanged by each of them. The last "
                    f"checkpoint in {ckpt.directory} is intact; lower "
                    "config.optim.learning_rate or inspect the data.")
        finished = True
    finally:
        writer.close(finished=finished)  # a failed run's bar is not left at 100%
        scorer.close()
        ckpt.close()
        if engine is not None:
            engine.close()
    return f"finished {cfg.num_train_steps} steps: {summary}"
