"""The static sampler: the rollout engine's baseline, kept for the benchmarks only.

Every row of a call stays in one batched decode loop until the last one ends; one budget for
all rows. Prefill runs on the P prompts only; the G rows of a prompt share its cache, read
once per prompt in each decode step's softmax, beside the rows' own [L, P*G, R, K, H] slots.
It is not a product path (the trainer and evaluation sample through `ba_jax.engine`); it runs
the model's one forward path with a cache mode of its own (`DenseDecode`, below), so the
model carries no second decode path for it. Used by `benchmarks/sampler.py` (engine vs
static) and checked against the engine by `tests/test_static_sampler.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ba_jax import sampling as sampling_lib
from ba_jax.models import attention
from ba_jax.models.qwen import ModelConfig
from ba_jax.rollout import Rollout, SamplingSettings, prompt_arrays, to_rollout
from ba_jax.sharding import BATCH_AXES


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys (after RoPE) and values of every layer, in the compute dtype."""

    k_LBSKH: jax.Array  # [L, B, S, K, H]
    v_LBSKH: jax.Array  # [L, B, S, K, H]

    def write(self, k_LBKH: jax.Array, v_LBKH: jax.Array, slot) -> KVCache:
        """The cache with one token per row written at `slot` (in place when the buffer is
        loop-carried)."""
        start = (0, 0, slot, 0, 0)

        def put(buf, new):
            return lax.dynamic_update_slice(buf, new[:, :, None].astype(buf.dtype), start)

        return KVCache(put(self.k_LBSKH, k_LBKH), put(self.v_LBSKH, v_LBKH))


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Zeroed KV cache with `max_len` slots per row."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


@dataclasses.dataclass(frozen=True)
class DenseDecode:
    """Cache mode of one decode step (a [B, 1] token per row) over dense caches: the token
    attends to its row's own slots where `valid_BS`, to itself, and to its prompt's slots
    (`prompt` of P rows, `prompt_valid_PT`), shared by the B // P contiguous rows of each.
    The caches are read only; `finish` returns the new keys/values (k_LBKH, v_LBKH) for the
    caller to write (`KVCache.write`: one update of the loop-carried buffer per step)."""

    cache: KVCache
    valid_BS: jax.Array
    prompt: KVCache
    prompt_valid_PT: jax.Array
    remat = False

    def layer_xs(self, num_layers: int):
        return (self.cache.k_LBSKH, self.cache.v_LBSKH, self.prompt.k_LBSKH,
                self.prompt.v_LBSKH)

    def init(self):
        return None

    def attend(self, q_B1NH, k_B1KH, v_B1KH, xs_l, state):
        k_BSKH, v_BSKH, pk_PTKH, pv_PTKH = xs_l
        o_BNH = attention.decode_attention(
            q_B1NH[:, 0], k_B1KH[:, 0], v_B1KH[:, 0], k_BSKH, v_BSKH, self.valid_BS,
            prefix=(pk_PTKH, pv_PTKH, self.prompt_valid_PT))
        return o_BNH[:, None], None, (k_B1KH[:, 0], v_B1KH[:, 0])

    def finish(self, state, ys):
        return ys


TRACE_COUNTS: Counter = Counter()  # traces per bucket key; a test checks calls do not retrace


@struct.dataclass
class SamplingState:
    """Carry of the decode `lax.while_loop`; B = P*G rows, R = max_new_tokens."""

    step: jax.Array  # int32 []: tokens 0..step-1 are written; `step` is sampled next
    tokens_BR: jax.Array  # int32 [B, R]: sampled tokens, pad_id once a row has finished
    logp_BR: jax.Array  # float32 [B, R]: log_softmax(logits)[token] at temperature 1 (0 if masked)
    sampling_logp_BR: jax.Array  # float32 [B, R]: log-prob under the sampling distribution
    mask_BR: jax.Array  # bool [B, R]: token was generated before the row finished (EOS included)
    done_B: jax.Array  # bool [B]: row has emitted an EOS id
    cache: Any  # the rows' own KVCache, [L, B, R, K, H]: slot t holds token t


def _write(st: SamplingState, token_B, logp_B, slogp_B, eos_E, pad_id) -> SamplingState:
    """Records the token sampled at `st.step` (pad for finished rows) and advances."""
    live_B = ~st.done_B

    def put(x_BR, v_B):
        return lax.dynamic_update_slice(x_BR, v_B[:, None].astype(x_BR.dtype), (0, st.step))

    is_eos_B = jnp.any(token_B[:, None] == eos_E[None, :], -1)
    return st.replace(
        step=st.step + 1,
        tokens_BR=put(st.tokens_BR, jnp.where(live_B, token_B, pad_id)),
        logp_BR=put(st.logp_BR, jnp.where(live_B, logp_B, 0.0)),
        sampling_logp_BR=put(st.sampling_logp_BR, jnp.where(live_B, slogp_B, 0.0)),
        mask_BR=put(st.mask_BR, live_B),
        done_B=st.done_B | (live_B & is_eos_B),
    )


def _rows_constraint(x: jax.Array, axis: int, mesh: Mesh | None) -> jax.Array:
    """Splits `axis` (rows) over the mesh's data axes when it divides evenly."""
    if mesh is None:
        return x
    names = tuple(a for a in BATCH_AXES if a in mesh.shape)
    if not names or x.shape[axis] % math.prod(mesh.shape[a] for a in names):
        return x
    spec = [None] * x.ndim
    spec[axis] = names
    return lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def rollout_arrays(
    model: Any,
    prompt_PT: jax.Array,
    prompt_mask_PT: jax.Array,
    key: jax.Array,
    *,
    num_samples: int,
    max_new_tokens: int,
    config: sampling_lib.SamplingConfig,
    eos_E: jax.Array,
    pad_id: jax.Array | int,
    mesh: Mesh | None = None,
) -> dict[str, jax.Array]:
    """Traceable body of `generate` on left-padded prompts -> dict of [P*G, R] arrays.

    `eos_E` (int32 [E]) and `pad_id` may be traced, so changing them does not recompile.
    """
    (P, Tp), G, R = prompt_PT.shape, num_samples, max_new_tokens
    B = P * G
    pmask_PT = prompt_mask_PT.astype(jnp.int32)
    positions_PT = jnp.maximum(jnp.cumsum(pmask_PT, 1) - 1, 0)
    # Prefill the P prompts once; only the last position's logits are formed.
    x_PTD, kv = model.forward(prompt_PT, positions_PT, model.full(pmask_PT, keep_kv=True))
    logits_P1V, prompt_cache = model.logits(x_PTD[:, Tp - 1:]), KVCache(*kv)
    prompt_cache = jax.tree.map(lambda c: _rows_constraint(c, 1, mesh), prompt_cache)
    cache = jax.tree.map(lambda c: _rows_constraint(c, 1, mesh),
                         init_cache(model.config, B, R, model.dtype))
    len_B = jnp.repeat(jnp.sum(pmask_PT, 1), G)
    logits_BV = _rows_constraint(jnp.repeat(logits_P1V[:, 0], G, axis=0), 0, mesh)
    rows = lambda x: _rows_constraint(x, 0, mesh)
    st = SamplingState(
        step=jnp.int32(0),
        tokens_BR=rows(jnp.full((B, R), pad_id, jnp.int32)),
        logp_BR=rows(jnp.zeros((B, R), jnp.float32)),
        sampling_logp_BR=rows(jnp.zeros((B, R), jnp.float32)),
        mask_BR=rows(jnp.zeros((B, R), bool)),
        done_B=rows(jnp.zeros((B,), bool)),
        cache=cache,
    )
    first = sampling_lib.sample_logits(logits_BV, jax.random.fold_in(key, 0), config)
    st = _write(st, *first, eos_E, pad_id)

    def cond(st: SamplingState) -> jax.Array:
        return (st.step < R) & ~jnp.all(st.done_B)

    def body(st: SamplingState) -> SamplingState:
        t = st.step  # decode token t-1 (its own slot t-1), then sample token t
        token_B = lax.dynamic_index_in_dim(st.tokens_BR, t - 1, axis=1, keepdims=False)
        # slots 0..t-2 hold the earlier tokens; token t-1 attends to itself inside the step
        filled_BR = jnp.broadcast_to(jnp.arange(R)[None] < t - 1, (B, R))
        x_B1D, (k_LBKH, v_LBKH) = model.forward(
            token_B[:, None], (len_B + t - 1)[:, None],
            DenseDecode(st.cache, filled_BR, prompt_cache, pmask_PT.astype(bool)))
        logits_BV = model.logits(x_B1D)[:, 0]
        sample = sampling_lib.sample_logits(logits_BV, jax.random.fold_in(key, t), config)
        return _write(st.replace(cache=st.cache.write(k_LBKH, v_LBKH, t - 1)), *sample, eos_E,
                      pad_id)

    st = lax.while_loop(cond, body, st)
    return dict(tokens=st.tokens_BR, logprobs=st.logp_BR, sampling_logprobs=st.sampling_logp_BR,
                mask=st.mask_BR, done=st.done_B)


@functools.cache
def rollout_fn(graphdef, P, Tp, G, R, config, mesh) -> Callable:
    """The jitted rollout `generate` calls: run(state, prompt_PT, prompt_mask_PT, key, eos_E,
    pad_id) -> dict of [P*G, R] arrays; one per (model structure, bucket, settings, mesh),
    built once and reused."""
    def run(state, prompt_PT, prompt_mask_PT, key, eos_E, pad_id):
        TRACE_COUNTS[(P, Tp, G, R)] += 1  # runs at trace time only
        model = nnx.merge(graphdef, state)
        # the mesh in context at trace time, for the kernel seam's shard_map
        with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
              else contextlib.nullcontext()):
            return rollout_arrays(model, prompt_PT, prompt_mask_PT, key, num_samples=G,
                                  max_new_tokens=R, config=config, eos_E=eos_E,
                                  pad_id=pad_id, mesh=mesh)

    return jax.jit(run)


def generate_static(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_ids: Sequence[int],
    pad_id: int | None = None,
    mesh: Mesh | None = None,
) -> Rollout:
    """The static sampler (the engine's baseline): every row stays in
    one batched decode loop until the last one ends; one budget for all rows. Same Rollout as
    `generate`; its draws differ (one key per step, shared by the rows).

    `pad_id` (default: the first EOS id, as Hugging Face does) fills prompt padding and
    the slots after a row's EOS. With `mesh`, rows are split over its data/fsdp axes.
    """
    sampling = SamplingSettings(int(num_samples), int(max_new_tokens), tuple(eos_ids),
                                temperature, top_k, top_p, pad_id)
    eos, pad, config = np.asarray(sampling.eos_ids, np.int32), sampling.pad, sampling.draw
    prompt_PT, pmask_PT = prompt_arrays(prompts, pad)
    P, G, R = len(prompts), int(num_samples), int(max_new_tokens)
    graphdef, state = nnx.split(model)
    run = rollout_fn(graphdef, P, prompt_PT.shape[1], G, R, config, mesh)
    out = run(state, prompt_PT, pmask_PT, key, eos, np.int32(pad))
    return to_rollout(jax.device_get(out), prompt_PT, pmask_PT, G)
