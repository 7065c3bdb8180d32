"""Sampling: the math, the Rollout, `generate` (-> the rollout engine) and the static sampler.

Lives here: the sampling math (greedy, temperature, top-k, top-p, an inverse-CDF draw), the
`Rollout` handed to the trainer, `generate` (which runs `engine.generate`, the rollout engine:
continuous batching over a paged cache) and `generate_static`, the static sampler
(`rollout.engine=static`, the engine's baseline) with its `SamplingState` carried by
`lax.while_loop`. Not here: the model and its KV cache (`models/qwen.py`), the engine
(`engine.py`), scoring (`rewards/`).

The static sampler, how one call runs (all inside one jitted function, compiled once per
bucket):
How one call runs (all inside one jitted function, compiled once per bucket):
  1. Prompts are left-padded to a bucket length Tp (a power of two >= 16, then multiples
     of 512), so only a few shapes compile; `max_new_tokens` (R) is static too.
  2. Prefill runs on the P prompts only (not P*G): one forward over the prompts returns
     their [L, P, Tp, K, H] keys/values and the last position's logits only.
  3. The G rows of a prompt share its prefill: each decode step attends, in one softmax, to
     the prompt's keys (read once for its G rows, never copied G times) and to the row's own
     [L, P*G, R, K, H] slots (`Qwen.decode_step`, `attention.decode_attention`); the first
     token's logits are the prompt's, repeated G times.
  4. `lax.while_loop` runs one single-token `decode_step` per step until every row has
     emitted an EOS id or R tokens exist; the new keys/values of all layers are written into
     the loop-carried cache with one in-place update. Finished rows keep computing (fixed
     shapes) but their outputs are replaced by `pad_id` and masked.
Decode layout with a mesh: rows (P*G) are split over the mesh's `data` and `fsdp` axes;
parameters keep the sharding they were loaded with (tensor-parallel weights stay split).
An FSDP-sharded model is all-gathered by XLA each step: hand it `engine.decode_copy` weights.

Log-probs: `Rollout.logprobs` is log_softmax(logits) of the sampled token, the model's own
distribution at temperature 1 without top-k/top-p, i.e. what the trainer recomputes as
old_logp from a full forward; `sampling_logprobs` is under the distribution actually
sampled from (temperature, top-k, top-p applied; 0 for greedy).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from ba_jax import grpo
from ba_jax.models import qwen
from ba_jax.sharding import BATCH_AXES

TRACE_COUNTS: Counter = Counter()  # traces per bucket key; a test checks calls do not retrace


# ----------------------------------------------------------------------------- sampling math


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked from the logits (static: part of the compile key)."""

    temperature: float = 1.0  # 0 means greedy (first argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest most-likely set with mass >= top_p; 1 keeps all

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling settings {self}")


def _first_true(hit_BX: jax.Array, fallback_B: jax.Array) -> jax.Array:
    """Index of the first True along the last axis, or `fallback_B` where there is none."""
    X = hit_BX.shape[-1]
    first_B = jnp.min(jnp.where(hit_BX, lax.broadcasted_iota(jnp.int32, hit_BX.shape, 1), X), -1)
    return jnp.where(first_B < X, first_B, fallback_B)


def _argmax_first(x_BX: jax.Array) -> jax.Array:
    """First index of the maximum; a max plus a min-reduce is ~3x faster than argmax on CPU."""
    return _first_true(x_BX == jnp.max(x_BX, -1, keepdims=True), jnp.zeros(x_BX.shape[0], jnp.int32))


def _pick(w_BX: jax.Array, u_B: jax.Array) -> jax.Array:
    """Index i with cum[i-1] <= u < cum[i], cum the running sum of w (w >= 0).

    Each candidate is tested against its own (cum - w, cum] interval, so an index of zero
    weight can never be chosen whatever the cumsum's rounding; if rounding leaves u past
    every interval, the heaviest index is taken.
    """
    cum_BX = jnp.cumsum(w_BX, -1)
    hit_BX = (cum_BX - w_BX <= u_B[:, None]) & (u_B[:, None] < cum_BX)
    return _first_true(hit_BX, _argmax_first(w_BX))


def draw_inverse_cdf(w_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """Index drawn with probability w/sum(w), from one uniform u in [0, 1) per row.

    Two levels (blocks of ~sqrt(V) columns, then within the chosen block) so the cumsums
    stay short; one uniform per row instead of V Gumbel draws (jax.random.categorical cost
    15-22 ms per decode step at the benchmark shape, this ~1 ms).
    """
    B, V = w_BV.shape
    C = 16
    while C * C < V:
        C *= 2
    nb = -(-V // C)
    w_BNC = jnp.pad(w_BV, ((0, 0), (0, nb * C - V))).reshape(B, nb, C)
    mass_BN = jnp.sum(w_BNC, -1)
    target_B = u_B * jnp.sum(mass_BN, -1)
    blk_B = _pick(mass_BN, target_B)
    before_B = jnp.sum(jnp.where(jnp.arange(nb) < blk_B[:, None], mass_BN, 0.0), -1)
    inner_BC = jnp.take_along_axis(w_BNC, blk_B[:, None, None], 1)[:, 0]
    # Clamp so the inner draw stays inside the block even if the two sums round apart.
    rem_B = jnp.clip(target_B - before_B, 0.0, None)
    return blk_B * C + _pick(inner_BC, rem_B)


def _nucleus_threshold(p_BV: jax.Array, top_p: float) -> jax.Array:
    """Largest tau with sum(p[p >= tau]) >= top_p, found exactly by bisecting float bits.

    A sort of V=8192 columns costs ~190 ms per step on XLA:CPU; 30 masked sums cost ~15 ms.
    Positive float32 bit patterns are ordered like their values, and p <= 1 < 2^30 ulps.
    """
    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = lo_B + (hi_B - lo_B) // 2
        tau_B1 = lax.bitcast_convert_type(mid_B, jnp.float32)[:, None]
        ok_B = jnp.sum(jnp.where(p_BV >= tau_B1, p_BV, 0.0), -1) >= top_p
        return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

    B = p_BV.shape[0]
    hi0 = lax.bitcast_convert_type(jnp.max(p_BV, -1), jnp.int32) + 1  # mass above max: 0
    lo_B, _ = lax.fori_loop(0, 31, body, (jnp.zeros(B, jnp.int32), hi0))
    return lax.bitcast_convert_type(lo_B, jnp.float32)


def sample_logits(
    logits_BV: jax.Array, key: jax.Array, config: SamplingConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row -> (token_B, logp_B at temperature 1, logp_B under the sampler).
    `key`: one key for all rows, or a [B] array of keys, one per row."""
    logits_BV = logits_BV.astype(jnp.float32)
    B, V = logits_BV.shape
    if config.temperature == 0:
        token_B = _argmax_first(logits_BV)
        sampling_logp_B = jnp.zeros(B, jnp.float32)
    else:
        z_BV = logits_BV / config.temperature
        if key.ndim:  # one key per row (the rollout engine's key per sample and position)
            u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
        else:
            u_B = jax.random.uniform(key, (B,), jnp.float32)
        if config.top_k:
            # Top-k (then top-p) works on the k sorted candidates only.
            z_BK, idx_BK = lax.top_k(z_BV, min(config.top_k, V))
            w_BK = jnp.exp(z_BK - z_BK[:, :1])
            if config.top_p < 1:
                p_BK = w_BK / jnp.sum(w_BK, -1, keepdims=True)
                before_BK = jnp.cumsum(p_BK, -1) - p_BK
                w_BK = jnp.where(before_BK < config.top_p, w_BK, 0.0)
            j_B = draw_inverse_cdf(w_BK, u_B)
            token_B = jnp.take_along_axis(idx_BK, j_B[:, None], -1)[:, 0]
            w_tok_B = jnp.take_along_axis(w_BK, j_B[:, None], -1)[:, 0]
            total_B = jnp.sum(w_BK, -1)
        else:
            w_BV = jnp.exp(z_BV - jnp.max(z_BV, -1, keepdims=True))
            if config.top_p < 1:
                p_BV = w_BV / jnp.sum(w_BV, -1, keepdims=True)
                tau_B = _nucleus_threshold(p_BV, config.top_p)
                w_BV = jnp.where(p_BV >= tau_B[:, None], w_BV, 0.0)
            token_B = draw_inverse_cdf(w_BV, u_B)
            w_tok_B = jnp.take_along_axis(w_BV, token_B[:, None], -1)[:, 0]
            total_B = jnp.sum(w_BV, -1)
        sampling_logp_B = jnp.log(w_tok_B) - jnp.log(total_B)
    token_B = token_B.astype(jnp.int32)
    # the trainer's scoring code (grpo.head_logprobs) on the one new position
    logp_B = grpo.token_logprobs(logits_BV[:, None], token_B[:, None])[:, 0]
    return token_B, logp_B, sampling_logp_B


# ----------------------------------------------------------------------------- the loop


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
    config: SamplingConfig,
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
    logits_P1V, prompt_cache = model(prompt_PT, positions_PT, pmask_PT,
                                     logits_slice=slice(Tp - 1, None), return_kv=True)
    prompt_cache = jax.tree.map(lambda c: _rows_constraint(c, 1, mesh), prompt_cache)
    cache = jax.tree.map(lambda c: _rows_constraint(c, 1, mesh),
                         qwen.init_cache(model.config, B, R, model.dtype))
    len_B = jnp.repeat(jnp.sum(pmask_PT, 1), G)
    logits_BV = _rows_constraint(jnp.repeat(logits_P1V[:, 0], G, axis=0), 0, mesh)
    rows = lambda x: _rows_constraint(x, 0, mesh)  # noqa: E731
    st = SamplingState(
        step=jnp.int32(0),
        tokens_BR=rows(jnp.full((B, R), pad_id, jnp.int32)),
        logp_BR=rows(jnp.zeros((B, R), jnp.float32)),
        sampling_logp_BR=rows(jnp.zeros((B, R), jnp.float32)),
        mask_BR=rows(jnp.zeros((B, R), bool)),
        done_B=rows(jnp.zeros((B,), bool)),
        cache=cache,
    )
    st = _write(st, *sample_logits(logits_BV, jax.random.fold_in(key, 0), config), eos_E, pad_id)

    def cond(st: SamplingState) -> jax.Array:
        return (st.step < R) & ~jnp.all(st.done_B)

    def body(st: SamplingState) -> SamplingState:
        t = st.step  # decode token t-1 (its own slot t-1), then sample token t
        token_B = lax.dynamic_index_in_dim(st.tokens_BR, t - 1, axis=1, keepdims=False)
        # slots 0..t-2 hold the earlier tokens; token t-1 attends to itself inside the step
        filled_BR = jnp.broadcast_to(jnp.arange(R)[None] < t - 1, (B, R))
        logits_BV, k_LBKH, v_LBKH = model.decode_step(
            token_B, len_B + t - 1, st.cache, filled_BR, prefix=(prompt_cache, pmask_PT))
        sample = sample_logits(logits_BV, jax.random.fold_in(key, t), config)
        return _write(st.replace(cache=st.cache.write(k_LBKH, v_LBKH, t - 1)), *sample, eos_E,
                      pad_id)

    st = lax.while_loop(cond, body, st)
    return dict(tokens=st.tokens_BR, logprobs=st.logp_BR, sampling_logprobs=st.sampling_logp_BR,
                mask=st.mask_BR, done=st.done_B)


# ----------------------------------------------------------------------------- public API


@dataclasses.dataclass
class Rollout:
    """P*G sampled responses on the host; rows of one prompt are contiguous."""

    tokens: np.ndarray  # int32 [P*G, R]: generated ids, pad_id after the EOS
    logprobs: np.ndarray  # float32 [P*G, R]: log_softmax(logits)[token], temperature 1, 0 if masked
    sampling_logprobs: np.ndarray  # float32 [P*G, R]: same, under the sampling distribution
    mask: np.ndarray  # int32 [P*G, R]: 1 on generated tokens up to and including the EOS
    lengths: np.ndarray  # int32 [P*G]: number of generated tokens (mask.sum(1))
    group_ids: np.ndarray  # int32 [P*G]: prompt index of each row
    finish_reason: np.ndarray  # object [P*G]: "eos" or "length"
    prompt_tokens: np.ndarray  # int32 [P*G, Tp]: left-padded prompt block that was decoded from
    prompt_mask: np.ndarray  # int32 [P*G, Tp]: 1 on real prompt tokens


def prompt_bucket(length: int) -> int:
    """Padded prompt length: powers of two from 16 to 512, then multiples of 512."""
    if length <= 512:
        return max(16, 1 << (max(length, 1) - 1).bit_length())
    return -(-length // 512) * 512


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int):
    """Left-pads token lists to `width` -> (tokens_PT int32, mask_PT int32)."""
    tokens_PT = np.full((len(prompts), width), pad_id, np.int32)
    mask_PT = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        if len(p):
            tokens_PT[i, width - len(p):] = p
            mask_PT[i, width - len(p):] = 1
    return tokens_PT, mask_PT


_JITTED: dict[tuple, Callable] = {}


def rollout_fn(graphdef, P, Tp, G, R, config, mesh) -> Callable:
    """The jitted rollout `generate` calls: run(state, prompt_PT, prompt_mask_PT, key, eos_E,
    pad_id) -> dict of [P*G, R] arrays; one per (model structure, bucket, settings, mesh),
    built once and reused (`plan.compiled_memory` compiles it from abstract inputs)."""
    k = (graphdef, P, Tp, G, R, config, mesh)
    if k not in _JITTED:
        def run(state, prompt_PT, prompt_mask_PT, key, eos_E, pad_id):
            TRACE_COUNTS[(P, Tp, G, R)] += 1  # runs at trace time only
            model = nnx.merge(graphdef, state)
            # the mesh in context at trace time, for the kernel seam's shard_map
            with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
                  else contextlib.nullcontext()):
                return rollout_arrays(model, prompt_PT, prompt_mask_PT, key, num_samples=G,
                                      max_new_tokens=R, config=config, eos_E=eos_E,
                                      pad_id=pad_id, mesh=mesh)

        _JITTED[k] = jax.jit(run)
    return _JITTED[k]


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_new_tokens: int | Sequence[int] | np.ndarray,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_ids: Sequence[int],
    pad_id: int | None = None,
    mesh: Mesh | None = None,
    **engine_options: Any,
) -> Rollout:
    """Samples `num_samples` responses per prompt (temperature 0: greedy) -> host Rollout,
    through the rollout engine (`engine.generate`: continuous batching over a paged cache;
    `engine_options` are its `num_slots`, `page_size`, `num_pages`, `prefill_chunk`,
    `return_stats`).

    `max_new_tokens`: an int, one budget per prompt [P] or one per row [P*G]; the Rollout is
    as wide as the largest. `pad_id` (default: the first EOS id, as Hugging Face does) fills
    prompt padding and the slots after a row's EOS. With `mesh`, rows are split over its
    data/fsdp axes, each row device decoding its own rows (hand it `engine.decode_copy`
    weights). The token at position t of row s is drawn with key fold_in(fold_in(key, s), t),
    so a call's rollouts do not depend on the slots, pages or devices that ran it.
    """
    from ba_jax import engine  # the engine builds on this module's sampling math

    return engine.generate(model, prompts, num_samples=num_samples,
                           max_new_tokens=max_new_tokens, key=key, temperature=temperature,
                           top_k=top_k, top_p=top_p, eos_ids=eos_ids, pad_id=pad_id, mesh=mesh,
                           **engine_options)


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
    """The static sampler (`rollout.engine=static`, the engine's baseline): every row stays in
    one batched decode loop until the last one ends; one budget for all rows. Same Rollout as
    `generate`; its draws differ (one key per step, shared by the rows).

    `pad_id` (default: the first EOS id, as Hugging Face does) fills prompt padding and
    the slots after a row's EOS. With `mesh`, rows are split over its data/fsdp axes.
    """
    eos, pad, config, prompt_PT, pmask_PT = prepare_request(
        prompts, eos_ids, pad_id, temperature, top_k, top_p)
    P, G, R = len(prompts), int(num_samples), int(max_new_tokens)
    graphdef, state = nnx.split(model)
    run = rollout_fn(graphdef, P, prompt_PT.shape[1], G, R, config, mesh)
    out = run(state, prompt_PT, pmask_PT, key, eos, np.int32(pad))
    return to_rollout(jax.device_get(out), prompt_PT, pmask_PT, G)


def prepare_request(prompts, eos_ids, pad_id, temperature, top_k, top_p):
    """Checked inputs of a sampling call -> (eos_E int32, pad id, SamplingConfig, left-padded
    prompt_PT, prompt_mask_PT in their bucket); ValueError naming a bad one."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = tuple(int(e) for e in eos_ids)
    if not eos:
        raise ValueError("eos_ids must name at least one token id")
    pad = eos[0] if pad_id is None else int(pad_id)
    config = SamplingConfig(float(temperature), int(top_k), float(top_p))
    prompt_PT, pmask_PT = left_pad(prompts, prompt_bucket(max(len(p) for p in prompts)), pad)
    return np.asarray(eos, np.int32), pad, config, prompt_PT, pmask_PT


ROLLOUT_ARRAYS = ("tokens", "logprobs", "sampling_logprobs", "mask", "done")


def to_rollout(out: dict, prompt_PT: np.ndarray, pmask_PT: np.ndarray, G: int) -> Rollout:
    """The host Rollout of a call's output arrays (tokens, logprobs, sampling_logprobs, mask,
    done), rows of prompt p at [p*G, (p+1)*G)."""
    mask_BR = np.asarray(out["mask"], np.int32)
    return Rollout(
        tokens=np.asarray(out["tokens"], np.int32),
        logprobs=np.asarray(out["logprobs"], np.float32),
        sampling_logprobs=np.asarray(out["sampling_logprobs"], np.float32),
        mask=mask_BR,
        lengths=mask_BR.sum(1).astype(np.int32),
        group_ids=np.repeat(np.arange(len(prompt_PT), dtype=np.int32), G),
        finish_reason=np.where(np.asarray(out["done"]), "eos", "length").astype(object),
        prompt_tokens=np.repeat(prompt_PT, G, axis=0),
        prompt_mask=np.repeat(pmask_PT, G, axis=0),
    )
