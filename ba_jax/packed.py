"""The packed train step's device half: blocks gathered from the padded mini-batch, the
packed forward, and the update accumulated over a variable number of blocks.

A packed mini-batch runs as `num_blocks` micro-batches of one fixed shape, [row devices,
budget] (`packing.py` plans them on the host). Every jitted function here sees only that
shape, so one compile serves every step whatever its block count: the host loops over the
blocks, adding each block's loss, metrics and gradient into a float32 accumulator
(`acc_fn`), then applies the sum once (`apply_fn`: the optimizer and the non-finite guard
of `updater.apply_gradients`). Exact by construction: the aggregation weights, the
rollout correction's factor, the recomputed old and reference log-probs are all computed
or collected on the padded mini-batch (`unpack_fn` scatters a packed forward's log-probs
back to it), then gathered with their tokens (`fields_fn`); every metric is a weighted or
counted sum, so the sum over blocks is the padded step's.

Block keys: tokens, segment_ids, positions, targets (the next token of each position),
scored (the position predicts a response token), and the per-token mask, adv, w, old_logp
and, where used, ref_logp and pg_factor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ba_jax import grpo, packing, sharding
from ba_jax.models.attention import Segments

INDEX_KEYS = ("tok", "resp", "row", "seg", "pos")  # packing.block_indices
TOKEN_FIELDS = ("mask", "old_logp", "w", "ref_logp", "pg_factor")  # gathered per token


def _take(flat, idx):
    """flat[idx] where idx >= 0, else 0."""
    return jnp.where(idx >= 0, flat[jnp.maximum(idx, 0)], jnp.zeros((), flat.dtype))


def block_inputs(mb: dict, idx: dict) -> dict:
    """A block's model inputs gathered from the padded mini-batch `mb` by `idx`."""
    seq = jnp.concatenate([mb["prompt_tokens_BT"], mb["tokens_BR"]], axis=1).reshape(-1)
    return dict(tokens=_take(seq, idx["tok"]), segment_ids=idx["seg"], positions=idx["pos"],
                targets=_take(mb["tokens_BR"].reshape(-1), idx["resp"]),
                scored=idx["resp"] >= 0)


def block_fields(mb: dict, idx: dict) -> dict:
    """A block's per-token loss inputs gathered from the padded mini-batch (after its
    weights): every `*_BR` field of TOKEN_FIELDS present, and adv per token."""
    out = {k: _take(mb[f"{k}_BR"].reshape(-1), idx["resp"])
           for k in TOKEN_FIELDS if f"{k}_BR" in mb}
    out["adv"] = _take(mb["adv_B"], idx["row"])
    return out


def packed_logprobs(graphdef, params, blk: dict, *, with_entropy: bool = False):
    """Log-probs (and entropies) of each position's target under `params` on a packed block
    -> (logp [rows, S] float32, ent or None); 0 at positions that score nothing, so
    nothing there can overflow (a KL term against a gathered 0)."""
    model = nnx.merge(graphdef, params)
    ids = blk["segment_ids"]
    segs = Segments(ids, max_segments=packing.max_segments(ids.shape[1]))
    x = model.hidden_states(blk["tokens"], blk["positions"], ids > 0, segments=segs)
    logp, ent = grpo.head_logprobs(model.logits, x, blk["targets"],
                                   chunk=model.config.logits_chunk, with_entropy=with_entropy)
    keep = blk["scored"]
    logp = jnp.where(keep, logp, 0.0)
    return logp, None if ent is None else jnp.where(keep, ent, 0.0)


def packed_loss(params, blk, *, graphdef, loss: grpo.LossSettings):
    """The GRPO loss of one block (`grpo.grpo_loss` with per-token advantages)."""
    logp, ent = packed_logprobs(graphdef, params, blk, with_entropy=True)
    return grpo.settings_loss(loss, logp, ent, blk["old_logp"], blk["adv"], blk["w"],
                              blk["mask"], ref_logp_BT=blk.get("ref_logp"),
                              pg_factor_BT=blk.get("pg_factor"))


@dataclasses.dataclass
class PackedFns:
    """The jitted pieces of a packed update, each compiled once per run."""

    budget: int
    attn_cost: float  # packing.attention_cost of the model
    inputs_fn: Any  # (mb, idx) -> block inputs
    fields_fn: Any  # (mb, idx) -> block loss fields
    zeros_fn: Any  # params -> a zero accumulator
    acc_fn: Any  # (params, acc, block) -> acc
    apply_fn: Any  # (state, acc) -> (state, metrics)
    logp_fn: Any  # (params, block inputs) -> logp: the policy's forward (old log-probs)
    ref_logp_fn: Any  # the same under the reference's layout (None: no KL)
    unpack_fn: Any  # (out_BR, logp, idx) -> out_BR with the block's log-probs scattered in
    zeros_BR_fn: Any  # mask_BR -> zeros like it


def make_packed(loss: grpo.LossSettings, graphdef, state, mesh, *, budget: int,
                attn_cost: float, apply_gradients, ref_params=None) -> PackedFns:
    """The run's `PackedFns`. `apply_gradients(state, total, grads, aux)` is the update
    half shared with the padded step (the optimizer bound in)."""
    row = sharding.batch_sharding(mesh)
    rep = NamedSharding(mesh, PS())
    params_sh = jax.tree.map(lambda x: x.sharding, state["params"])
    state_sh = jax.tree.map(lambda x: x.sharding, state)

    def in_mesh(fn):  # also a fresh function per run: its own jit cache
        def run(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)
        return run

    rows_S = jax.ShapeDtypeStruct((1, budget), jnp.int32)
    blk_shape = dict(tokens=rows_S, segment_ids=rows_S, positions=rows_S, targets=rows_S,
                     scored=jax.ShapeDtypeStruct((1, budget), bool),
                     **{k: jax.ShapeDtypeStruct((1, budget), jnp.float32)
                        for k in ("mask", "old_logp", "w", "adv")})
    if loss.kl_kind:
        blk_shape["ref_logp"] = blk_shape["w"]
    if loss.correction.active:
        blk_shape["pg_factor"] = blk_shape["w"]
    grad_fn = jax.value_and_grad(functools.partial(packed_loss, graphdef=graphdef, loss=loss),
                                 has_aux=True)
    acc_shape = jax.eval_shape(grad_fn, state["params"], blk_shape)
    acc_sh = ((rep, jax.tree.map(lambda _: rep, acc_shape[0][1])), params_sh)

    def acc(params, acc, blk):  # acc + (loss, metrics, gradient) of one block, in float32
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), acc, grad_fn(params, blk))

    def zeros(params):
        del params
        return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), acc_shape)

    def apply(state, acc):
        (total, aux), grads = acc
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        return apply_gradients(state, total, grads, aux)

    def logp_under(params_like):
        return jax.jit(in_mesh(lambda p, b: packed_logprobs(graphdef, p, b)[0]),
                       in_shardings=(jax.tree.map(lambda x: x.sharding, params_like), row),
                       out_shardings=row)

    def unpack(out_BR, logp, idx):
        n = out_BR.size
        i = jnp.where(idx["resp"] >= 0, idx["resp"], n).reshape(-1)
        return out_BR.reshape(-1).at[i].set(logp.reshape(-1), mode="drop").reshape(out_BR.shape)

    return PackedFns(
        budget=budget, attn_cost=attn_cost,
        inputs_fn=jax.jit(in_mesh(block_inputs), out_shardings=row),
        fields_fn=jax.jit(in_mesh(block_fields), out_shardings=row),
        zeros_fn=jax.jit(zeros, out_shardings=acc_sh),
        acc_fn=jax.jit(in_mesh(acc), in_shardings=(params_sh, acc_sh, row),
                       out_shardings=acc_sh, donate_argnums=(1,)),
        apply_fn=jax.jit(in_mesh(apply), in_shardings=(state_sh, acc_sh),
                         out_shardings=(state_sh, rep), donate_argnums=(0,)),
        logp_fn=logp_under(state["params"]),
        ref_logp_fn=None if ref_params is None else logp_under(ref_params),
        unpack_fn=jax.jit(unpack, out_shardings=row, donate_argnums=(0,)),
        zeros_BR_fn=jax.jit(in_mesh(jnp.zeros_like), out_shardings=row))
