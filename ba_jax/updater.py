"""The update half of an RL step: the jitted GRPO train step and what runs around it.

What lives here: `train_step(state, batch)` and `make_train_step` (shardings, donation; a
non-finite loss, gradient or new state leaves the state unchanged), `make_reference_fn`
(response log-probs under frozen parameters: the KL reference, the recomputed old
log-probs), `minibatch`, and `Updater` / `make_updater` / `update` (one RL step's update:
the old-log-prob and reference passes, the train-inference mismatch and correction
(correction.py), every mini-batch, the aggregation diagnostics). What does not: the loop
around it, the train state and checkpoints (train.py), the losses (grpo.py), the rules
(aggregation.py).

Batch layout (rows of one prompt contiguous, B = P*G): `prompt_tokens_BT` left-padded
prompts, `tokens_BR` the R response slots; the policy reads `[prompt | response]` and the
loss sees only response positions. Aggregation weights are computed inside the step on
the whole mini-batch, before it is cut into micro-batches (spec: aggregation.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ba_jax import (
    aggregation,
    correction,
    distributed,
    grpo,
    integrity,
    packed,
    packing,
    sharding,
)


def _loss_fn(params, mb, *, graphdef, loss: grpo.LossSettings):
    logp_BR, ent_BR = grpo.policy_logprobs(graphdef, params, mb, with_entropy=True)
    return grpo.settings_loss(loss, logp_BR, ent_BR, mb["old_logp_BR"], mb["adv_B"],
                              mb["w_BR"], mb["mask_BR"], ref_logp_BT=mb.get("ref_logp_BR"),
                              pg_factor_BT=mb.get("pg_factor_BR"))


def weigh(batch, *, loss: grpo.LossSettings, num_groups: int) -> dict:
    """The per-token inputs a mini-batch's loss needs besides its log-probs, computed on
    the whole mini-batch before it is split: the rule's weights `w_BR` and, with the
    rollout correction, its factor `pg_factor_BR` (row-wise: sequence-level IS/RS)."""
    rule = aggregation.resolve_rule(loss.aggregation)
    out = dict(w_BR=aggregation.token_weights(rule, batch["mask_BR"], batch["adv_B"],
                                              batch["group_id_B"], num_groups,
                                              **loss.rule_options))
    if loss.correction.active:
        out["pg_factor_BR"] = correction.pg_factor(
            batch["old_logp_BR"], batch["engine_logp_BR"], batch["mask_BR"], loss.correction)
    return out


def apply_gradients(state, total, grads, aux, *, tx):
    """The optimizer step from a mini-batch's summed loss, gradient and metrics; a
    non-finite loss, gradient, new parameter or optimizer moment leaves the state unchanged
    (counted in `nonfinite`) -> (state, metrics)."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # the new state itself, not only loss and gradient: a finite gradient can still overflow
    # a parameter or a moment (a huge step, a damaged restore), and that state would be saved
    finite = (jnp.isfinite(total) & jnp.isfinite(grad_norm) & integrity.all_finite(params)
              & integrity.all_finite(opt_state))
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


def train_step(state, batch, *, graphdef, tx, loss: grpo.LossSettings, num_groups: int):
    """One optimizer step on one padded mini-batch (`apply_gradients`)."""
    batch = dict(batch, **weigh(batch, loss=loss, num_groups=num_groups))
    batch.pop("engine_logp_BR", None)
    loss_fn = functools.partial(_loss_fn, graphdef=graphdef, loss=loss)
    total, grads, aux = grpo.accumulate_gradients(loss_fn, state["params"], batch,
                                                  loss.num_microbatches)
    return apply_gradients(state, total, grads, aux, tx=tx)


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
    packed: Any = None  # packed.PackedFns (grpo.max_tokens_per_device > 0), else padded rows
    weigh_fn: Any = None  # the packed path's `weigh` on a padded mini-batch
    row_devices: int = 1  # data * fsdp: rows of a packed block
    microbatches: int = 1  # the padded step's micro-batches per mini-batch


def make_updater(loss: grpo.LossSettings, graphdef, tx, state, mesh, *, prompts_per_step: int,
                 sample_shards: int, num_samples: int, num_minibatches: int, num_updates: int,
                 recompute_old_logp: bool, compute_dtype, max_tokens_per_device: int = 0,
                 attn_cost: float = 0.0) -> Updater:
    """The run's `Updater`: the train step, the reference (the starting policy in the
    compute dtype, sharded like it) when the loss has a KL term, the trainer's forward
    before the update when it gives pi_old (`recompute_old_logp`) or checks the engine's
    every `loss.correction.check_every` steps. `max_tokens_per_device` > 0 packs every pass
    into blocks of that many tokens per row device (`packed.py`; `attn_cost`:
    `packing.attention_cost` of the model, for balancing)."""
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
    upd.row_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    upd.microbatches = loss.num_microbatches
    if max_tokens_per_device > 0:
        upd.packed = packed.make_packed(
            loss, graphdef, state, mesh, budget=int(max_tokens_per_device),
            attn_cost=attn_cost, ref_params=upd.ref_params,
            apply_gradients=functools.partial(apply_gradients, tx=tx))
        upd.weigh_fn = jax.jit(functools.partial(weigh, loss=loss, num_groups=P // M),
                               out_shardings=upd.row_sharding)
        upd.ref_fn = upd.old_fn = None  # the packed forwards replace the padded ones
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


@dataclasses.dataclass
class _Packing:
    """One mini-batch's packed blocks: index arrays on the devices, and the plan's figures."""

    idx: list  # per block: packing.block_indices' arrays, row-sharded
    num_blocks: int
    loads_KD: np.ndarray  # this process's loads
    real_tokens: int  # this process's sequences' input tokens


def _pack(upd: Updater, mb: dict[str, np.ndarray]) -> _Packing:
    """Plan this process's rows of mini-batch `mb` into blocks, the block count agreed by
    every process (the largest; the others run empty blocks)."""
    pk, procs = upd.packed, jax.process_count()
    p_B, r_B = packing.sequence_lengths(mb["prompt_mask_BT"], mb["mask_BR"])
    pl = packing.plan(packing.packed_lengths(p_B, r_B), upd.row_devices // procs, pk.budget,
                      attn_cost=pk.attn_cost)
    pl = pl.with_blocks(int(distributed.gather_rows(
        dict(n=np.array([pl.num_blocks])))["n"].max()))
    idx = packing.block_indices(pl, p_B, r_B, mb["prompt_tokens_BT"].shape[1],
                                mb["tokens_BR"].shape[1],
                                row_offset=jax.process_index() * len(p_B))
    dev = [distributed.put_local_rows({k: v[j] for k, v in idx.items()}, upd.row_sharding)
           for j in range(pl.num_blocks)]
    return _Packing(dev, pl.num_blocks, pl.load_KD, int(pl.tokens_KD.sum()))


def _packed_forward(pk, fn, params, mb: dict, pkg: _Packing):
    """A packed forward over every block of a mini-batch, its log-probs scattered back to
    the padded [B, R] layout (where the correction and its statistics are row-wise)."""
    out = pk.zeros_BR_fn(mb["mask_BR"])
    for idx in pkg.idx:
        out = pk.unpack_fn(out, fn(params, pk.inputs_fn(mb, idx)), idx)
    return out


def _token_metrics(upd: Updater, mbs: list[dict[str, np.ndarray]], packs: list | None
                   ) -> dict[str, float]:
    """train_token_fraction (real tokens over the token slots every pass computed: the
    same layout serves each pass of a mini-batch), train_microbatches (micro-batches of one
    pass over the step), pack_imbalance (packing.imbalance over the row devices)."""
    real = slots = 0
    loads = []
    for j, mb in enumerate(mbs):
        if packs is None:
            p_B, r_B = packing.sequence_lengths(mb["prompt_mask_BT"], mb["mask_BR"])
            real += int(packing.packed_lengths(p_B, r_B).sum())
            slots += mb["tokens_BR"].shape[0] * (
                mb["prompt_tokens_BT"].shape[1] + mb["tokens_BR"].shape[1] - 1)
        else:  # the packer's own count
            real += packs[j].real_tokens
            slots += packs[j].num_blocks * packs[j].loads_KD.shape[1] * upd.packed.budget
            loads.append(packs[j].loads_KD.T)  # [local devices, blocks]
    g = distributed.gather_rows(dict(real=np.array([real]), slots=np.array([slots])))
    out = dict(train_token_fraction=float(g["real"].sum() / max(g["slots"].sum(), 1)))
    if packs is None:
        out.update(train_microbatches=float(upd.num_minibatches * upd.microbatches),
                   pack_imbalance=1.0)
    else:
        full = distributed.gather_rows(dict(l=np.concatenate(loads, axis=1)))["l"]
        out.update(train_microbatches=float(sum(p.num_blocks for p in packs)),
                   pack_imbalance=packing.imbalance(full.T))
    return out


def update(upd: Updater, state, batch: dict[str, np.ndarray]):
    """One RL step's update of `state` on this process's rows of `batch` -> (state, metrics:
    the mean of every mini-batch update's, `nonfinite_updates`, `diag_*` of the whole batch,
    the engine/trainer mismatch `rollout_*` (`correction.summarize`) where the trainer's
    log-probs were computed: every step with `recompute`, else on check steps, and the
    layout's `train_token_fraction`, `train_microbatches`, `pack_imbalance`)."""
    row_sh, M, pk = upd.row_sharding, upd.num_minibatches, upd.packed
    dev = distributed.put_local_rows(
        {k: batch[k] for k in ("mask_BR", "adv_B", "group_id_B")}, row_sh)
    diag = upd.diag_fn(dev["mask_BR"], dev["adv_B"], dev["group_id_B"])
    host_mbs = [minibatch(batch, m, M, upd.groups_per_shard, upd.num_samples)
                for m in range(M)]
    packs = None if pk is None else [_pack(upd, mb) for mb in host_mbs]
    mbs = [distributed.put_local_rows(mb, row_sh) for mb in host_mbs]
    old_fn = upd.old_fn if pk is None else pk.logp_fn
    stats, check = [], _checks(upd, state)
    for j, mb in enumerate(mbs):  # before any update of this step: the policy that sampled
        if check:
            trainer_logp = (old_fn(state["params"], mb) if pk is None else
                            _packed_forward(pk, old_fn, state["params"], mb, packs[j]))
            stats.append(upd.stats_fn(trainer_logp, mb["old_logp_BR"], mb["mask_BR"]))
            if upd.recompute:  # else the check only measures: pi_old stays the engine's
                if upd.corr.active:
                    mb["engine_logp_BR"] = mb["old_logp_BR"]
                mb["old_logp_BR"] = trainer_logp
        if upd.ref_params is not None:
            mb["ref_logp_BR"] = (upd.ref_fn(upd.ref_params, mb) if pk is None else
                                 _packed_forward(pk, pk.ref_logp_fn, upd.ref_params, mb,
                                                 packs[j]))
    if pk is not None:  # weights on the whole mini-batch, then gathered with their tokens
        blocks = []
        for mb, pkg in zip(mbs, packs):
            mb.update(upd.weigh_fn(mb))
            blocks.append([dict(pk.inputs_fn(mb, idx), **pk.fields_fn(mb, idx))
                           for idx in pkg.idx])
    step_metrics = []
    for _ in range(upd.num_updates):
        for j, mb in enumerate(mbs):
            if pk is None:
                state, out = upd.step_fn(state, mb)
            else:
                acc = pk.zeros_fn(state["params"])
                for blk in blocks[j]:
                    acc = pk.acc_fn(state["params"], acc, blk)
                state, out = pk.apply_fn(state, acc)
            step_metrics.append(out)
    step_metrics = jax.device_get(step_metrics)
    metrics = {k: float(np.mean([o[k] for o in step_metrics])) for k in step_metrics[-1]}
    metrics["nonfinite_updates"] = sum(float(o["nonfinite"]) for o in step_metrics)
    metrics.update({f"diag_{k}": v for k, v in jax.device_get(diag).items()})
    if stats:
        metrics.update(correction.summarize(jax.device_get(stats), upd.corr))
    metrics.update(_token_metrics(upd, host_mbs, packs))
    return state, metrics
