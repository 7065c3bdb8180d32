"""The RL loop: the train state, its checkpoints, and `run_training`.

What lives here: the train state (`init_state`), saving it (`_save`: with the config and
the data fingerprint a resume checks), `prepare_policy` (what runs before the first RL step
of a fresh run) and `run_training`, the plain Python loop: engine.sync ->
experience.collect -> update -> metrics.step_record -> checkpoint, stopping after the step
in flight on SIGTERM/SIGINT (preemption.py). What does not: the update itself (the jitted
train step, mini-batches, old-log-prob and reference passes: updater.py, whose public names
are re-exported here), checking the config (run_config.py), building the run from it
(build.py), the optimizer (optim.py), the embedded task's supervised warm-up
(tasks/warmup.py), collecting experience (experience.py), resume and state integrity
(resume.py, integrity.py, checkpoint.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ba_jax import (
    build,
    checkpoint,
    data,
    distributed,
    experience,
    optim,
    packing,
    paths,
    preemption,
    resume,
    run_config,
    workdir_lock,
)
from ba_jax import metrics as metrics_lib
from ba_jax.rewards import math as math_rewards
from ba_jax.tasks import warmup
from ba_jax.updater import (  # noqa: F401  (public names scripts import from train)
    Updater,
    make_reference_fn,
    make_train_step,
    make_updater,
    minibatch,
    train_step,
    update,
)


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


def _save(ckpt, step: int, state, iterator, cfg, fingerprint: dict, writer=None) -> float:
    """Checkpoint `step` with what a resume checks (the config, the data's fingerprint) ->
    the seconds it blocked (with async saves: the copy to host memory, and the wait for
    the previous save if it was still being written). `writer`'s lines are stored first
    (a URL workdir keeps them in memory between flushes): a step's line precedes its
    checkpoint."""
    t0 = time.perf_counter()
    if writer is not None:
        writer.flush()
    with _save_errors(ckpt, step):
        ckpt.save(step, state, dict(step=step, data_iterator=iterator.state(),
                                    config=_config_json(cfg), data_fingerprint=fingerprint))
    return time.perf_counter() - t0


@contextlib.contextmanager
def _save_errors(ckpt, step: int):
    """A failed write (disk full, permissions) stops the run with the previous checkpoint
    intact (Orbax writes to a temporary folder and renames it) and says so."""
    try:
        yield
    except checkpoint.NonFiniteState:
        raise
    except (OSError, checkpoint.CheckpointError) as e:  # Orbax's own, or TensorStore's
        step = getattr(e, "step", None) or step  # an asynchronous save fails later
        with contextlib.suppress(checkpoint.CheckpointError, OSError):
            ckpt.wait()  # an earlier save still in flight commits (or fails) first
        prev = [s for s in ckpt.steps() if s < step]
        reason = getattr(e, "reason", None) or checkpoint.summarize(e)
        raise checkpoint.CheckpointError(
            f"saving checkpoint step {step} in {ckpt.directory} failed ({reason}); "
            + (f"the previous checkpoint (step {prev[-1]}) is intact: fix the cause and run "
               "again to resume from it" if prev else "no earlier checkpoint exists"),
            reason) from e


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
    # one run per workdir (released on return, error or death); SIGTERM/SIGINT stop it after
    # the step in flight, with a checkpoint (preemption.Stopped)
    with workdir_lock.hold(workdir), preemption.StopRequest() as stop:
        return _run(cfg, workdir, devices, stop)


train_and_evaluate = run_training  # the name scripts and tests used before


def _stop(stop: preemption.StopRequest, ckpt, step: int, saved: bool, save) -> None:
    """If a stop was asked for on any process (all agree, at the same step): save `step`
    unless `saved`, wait until the save is committed, and raise `preemption.Stopped`."""
    if not distributed.any_process(stop.requested):
        return
    if not saved:
        save()
    with _save_errors(ckpt, step):
        ckpt.wait()
    signum = stop.signum or signal.SIGTERM  # another process got it
    raise preemption.Stopped(
        f"stopped by {preemption.signal_name(signum)} after step {step}: checkpoint step "
        f"{step} in {ckpt.directory} is committed and its metrics written; run the same "
        "command again to resume", signum)


def _run(cfg, workdir: str, devices: list, stop: preemption.StopRequest) -> str:
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
    ckpt = checkpoint.Checkpointer(paths.join(workdir, "checkpoints"),
                                   max_to_keep=cfg.checkpoint.max_to_keep,
                                   async_save=bool(cfg.checkpoint.async_save))
    P = cfg.rollout.prompts_per_step
    iterator = data.PromptIterator(len(prompt_set.prompt_ids), P, cfg.seed)
    fingerprint = resume.data_fingerprint(prompt_set)
    compare = functools.partial(resume.check, config=cfg.to_dict(), data=fingerprint,
                                allow=bool(cfg.resume_changed_config))
    latest = ckpt.latest_step()
    if latest is not None:  # before the arrays are read: a changed experiment is refused now
        compare(ckpt.read_meta(latest) or {}, where=f"checkpoint {latest} in {ckpt.directory}")
    restored = ckpt.restore_latest(state, fallback_to_previous=cfg.checkpoint.fallback_to_previous)
    config_changes = ""
    if restored is not None:
        _, state, meta = restored
        start = int(meta["step"])
        config_changes = compare(meta, where=f"checkpoint {start} in {ckpt.directory}")
        try:
            iterator.restore(meta["data_iterator"], adapt=bool(config_changes))
        except ValueError as e:  # a checkpoint from before data fingerprints were kept
            raise run_config.ConfigError(
                f"checkpoint {start} in {ckpt.directory}: {e}; pass "
                "--config.resume_changed_config=True to continue with this data") from e
        print(f"resumed from {ckpt.directory} at step {start}"
              + (f" with a changed config ({config_changes})" if config_changes else ""))
    else:
        start = 0
        state = prepare_policy(build.warmup_settings(cfg), graphdef, state, prompt_set,
                               tokenizer, mesh, tx)
        _save(ckpt, 0, state, iterator, cfg, fingerprint)
    summary = (f"metrics {paths.join(workdir, 'metrics.jsonl')}, plots "
               f"{paths.join(workdir, 'plots')}, "
               f"checkpoint {ckpt.directory}")
    if start >= cfg.num_train_steps:
        ckpt.close()
        return f"run complete ({start} steps) in {workdir}: {summary}"
    try:  # a signal during start-up (loading, warm-up): stop before the first step
        _stop(stop, ckpt, start, True, None)
    except BaseException:
        ckpt.close(quiet=True)
        raise

    g, r = cfg.grpo, cfg.rollout
    upd = make_updater(build.loss_settings(cfg), graphdef, tx, state, mesh,
                       prompts_per_step=P, sample_shards=r.sample_shards,
                       num_samples=r.num_samples, num_minibatches=g.num_minibatches,
                       num_updates=g.num_updates,
                       recompute_old_logp=build.old_logp_recompute(cfg),
                       compute_dtype=run_config.DTYPES[cfg.model.dtype],
                       max_tokens_per_device=g.max_tokens_per_device,
                       attn_cost=packing.attention_cost(
                           model_cfg.num_layers, model_cfg.num_heads, model_cfg.head_dim,
                           sum(x.size for x in jax.tree.leaves(state["params"]))))
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
            if config_changes:  # the resume's accepted changes, once, on its first step
                record["config_changes"], config_changes = config_changes, ""
            try:
                writer.write(it, record)
            except OSError:
                # a save issued before this line may still be in flight on the same full
                # disk: its failure came first, so it is the one the run reports
                with _save_errors(ckpt, it):
                    ckpt.wait()
                raise
            last_save_s = 0.0
            save = functools.partial(_save, ckpt, it, state, iterator, cfg, fingerprint, writer)
            saved = it % cfg.checkpoint.every_steps == 0 or it == cfg.num_train_steps
            if saved:
                last_save_s = save()
            if nonfinite_run >= cfg.max_consecutive_nonfinite:
                with _save_errors(ckpt, it):
                    ckpt.wait()
                raise FloatingPointError(
                    f"{nonfinite_run} steps in a row had a non-finite loss, gradient or new "
                    f"state (last at step {it}); each left the state unchanged. The last "
                    f"checkpoint (step {ckpt.latest_step()} in {ckpt.directory}) was checked "
                    "finite when saved; lower config.optim.learning_rate or inspect the data.")
            _stop(stop, ckpt, it, saved, save)
        with _save_errors(ckpt, cfg.num_train_steps):
            ckpt.wait()  # the last save committed before the run counts as finished
        finished = True
    finally:
        writer.close(finished=finished)  # a failed run's bar is not left at 100%
        scorer.close()
        ckpt.close(quiet=not finished)
        if engine is not None:
            engine.close()
    return f"finished {cfg.num_train_steps} steps: {summary}"
