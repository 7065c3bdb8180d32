"""The planner's packed train step (`grpo.max_tokens_per_device` > 0): its shapes, its
exact bytes and its compile.

Lives here: `packed_shapes` (one row of `budget` tokens per row device: what the activation
terms of `plan_model` are computed from), `held_bytes` (the update's data the host keeps on
the device while the blocks run: every padded mini-batch with its weights, every block and
its gather indices), `apply_temp_bytes` (the optimizer step's scratch, fitted), and
`compiled_train` (the real `packed.make_packed` `acc_fn` and `apply_fn` AOT-compiled from
abstract inputs). Not here: adding up a plan (`plan.plan`), the padded step's compile
(`plan.compiled_memory`).

What is live at once in a packed update (updater.update): while a block's gradient is
accumulated (`acc_fn`) the parameters, the float32 accumulator (donated and written in
place), the block, the forward's activations and the block's gradient, and beside them,
not arguments of `acc_fn`, the optimizer state and the held data; while the sum is applied
(`apply_fn`) the state (donated), the accumulator, the optimizer's scratch and the held
data. The train figure is the larger of the two.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

from ba_jax import experience, packed

# Bytes per element of the block fields (`packed.py`): tokens, segment ids, positions,
# targets int32, scored bool, mask, old_logp, w, adv float32; ref_logp (KL) and pg_factor
# (rollout correction) float32 where used. The gather indices: packed.INDEX_KEYS, int32.
BLOCK_BYTES = 4 * 4 + 1 + 4 * 4
INDEX_BYTES = 4 * len(packed.INDEX_KEYS)
# The optimizer step's scratch (`apply_fn`: the gradient cast to the parameter dtype, its
# norm, AdamW's updates and new moments before the non-finite guard picks them) per byte of
# the float32 accumulator on the device: XLA:CPU's compiled figure for Qwen3-1.7B on 8
# devices (AdamW, f32 parameters; `python -m ba_jax.plan --compile`, docs/benchmarks.md).
APPLY_TEMP_PER_F32_PARAM = 3.5


def budget(cfg: Any) -> int:
    """`grpo.max_tokens_per_device` (0: padded rows)."""
    return int(cfg.grpo.get("max_tokens_per_device", 0) or 0)


def blocks_per_minibatch(cfg: Any, rows: int, row_devices: int) -> int:
    """Blocks of one mini-batch of `rows` rows when every sequence is as long as a step can
    make it (data.max_prompt_tokens + R - 1 tokens): the longest step's count (the packer
    balances whole sequences, `floor(budget / longest)` of them per row)."""
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    per_row = max(budget(cfg) // longest, 1)
    return -(-rows // (row_devices * per_row))


def packed_shapes(cfg: Any) -> dict:
    """The activation terms' shapes of the packed step: one row of `budget` positions per
    device per micro-batch, the head run over all of them in chunks of model.logits_chunk."""
    S = budget(cfg)
    return dict(microbatch_rows_per_device=1, seq_len=S,
                head_chunk=min(cfg.model.logits_chunk or S, S))


def _fields(loss) -> int:
    """Block bytes per token of a run's loss settings."""
    return BLOCK_BYTES + 4 * bool(loss.kl_kind) + 4 * bool(loss.correction.active)


def held_bytes(cfg: Any, rows: int, row_devices: int) -> dict[str, int]:
    """Per device, the data `updater.update` keeps on the device through a packed update:
    `minibatches` (every mini-batch's padded arrays, `experience.batch_schema`, with its
    weights `w_BR` and, where used, the correction's `pg_factor_BR`), `blocks` (every
    mini-batch's blocks at the longest step's count, and their gather indices), `block`
    (one block, `acc_fn`'s argument)."""
    from ba_jax import build
    from ba_jax.rollout import prompt_bucket

    loss = build.loss_settings(cfg)
    M, R = cfg.grpo.num_minibatches, cfg.rollout.max_new_tokens
    schema = experience.batch_schema(rows, prompt_bucket(cfg.data.max_prompt_tokens), R,
                                     with_ref=bool(loss.kl_kind),
                                     with_engine_logp=loss.correction.active)
    mb = sum(math.prod(s) * d.itemsize for s, d in schema.values())
    mb += rows * R * 4 * (1 + loss.correction.active)  # w_BR, pg_factor_BR
    per_row = -(-rows // row_devices)
    block = budget(cfg) * _fields(loss)
    n = blocks_per_minibatch(cfg, rows, row_devices)
    return dict(minibatches=M * mb * per_row // rows,
                blocks=M * n * (block + budget(cfg) * INDEX_BYTES), block=block)


def apply_temp_bytes(accum_bytes: int) -> int:
    """Estimated scratch of `apply_fn` from the float32 accumulator's per-device bytes."""
    return int(APPLY_TEMP_PER_F32_PARAM * accum_bytes)


def compiled_train(cfg: Any, mesh, graphdef, tx, state, rows: int, memory) -> dict:
    """Per-device bytes of the packed update of `cfg` on `mesh`, compiled from the abstract
    `state` (`plan.abstract_train_inputs`): `acc_fn` on an abstract block [row devices,
    budget] rowed over (data, fsdp), and `apply_fn`. Keys: `acc_peak_bytes`,
    `apply_peak_bytes` (each program's argument + output - alias + temp, `memory`),
    `held_bytes` (the held data, `held_bytes`: exact array sizes, not compiled),
    `resident_bytes` (live beside `acc_fn` but none of its arguments: the optimizer state's
    per-device bytes and the held data but the block it reads); and the contract's
    `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes` of the program that sets
    the peak, with `peak_bytes` = max(acc peak + resident, apply peak + held)."""
    from ba_jax import build, sharding, updater

    row = sharding.batch_sharding(mesh)
    loss = build.loss_settings(cfg)
    S = budget(cfg)
    fns = packed.make_packed(loss, graphdef, state, mesh, budget=S, attn_cost=0.0,
                             apply_gradients=functools.partial(updater.apply_gradients, tx=tx))
    D = mesh.shape["data"] * mesh.shape["fsdp"]
    i32, f32 = jax.ShapeDtypeStruct((D, S), np.int32, sharding=row), jax.ShapeDtypeStruct(
        (D, S), np.float32, sharding=row)
    blk = dict(tokens=i32, segment_ids=i32, positions=i32, targets=i32,
               scored=jax.ShapeDtypeStruct((D, S), np.bool_, sharding=row),
               mask=f32, old_logp=f32, w=f32, adv=f32)
    if loss.kl_kind:
        blk["ref_logp"] = f32
    if loss.correction.active:
        blk["pg_factor"] = f32
    acc = jax.eval_shape(fns.zeros_fn, state["params"])
    acc_m = memory(fns.acc_fn.trace(state["params"], acc, blk).lower().compile())
    apply_m = memory(fns.apply_fn.trace(state, acc).lower().compile())
    opt = sum(_device_bytes(x) for x in jax.tree.leaves(state["opt_state"]))
    h = held_bytes(cfg, rows, D)
    held = h["minibatches"] + h["blocks"]
    resident = opt + held - h["block"]  # acc_fn's block is its argument
    acc_peak, apply_peak = acc_m["peak_bytes"] + resident, apply_m["peak_bytes"] + held
    out = dict(acc_m if acc_peak >= apply_peak else apply_m)
    out.update(peak_bytes=max(acc_peak, apply_peak), acc_peak_bytes=acc_m["peak_bytes"],
               apply_peak_bytes=apply_m["peak_bytes"], resident_bytes=resident,
               held_bytes=held)
    return out


def _device_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array with a sharding."""
    shape = x.sharding.shard_shape(x.shape)
    return math.prod(shape) * np.dtype(x.dtype).itemsize
