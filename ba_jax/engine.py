"""The rollout engine: continuous batching of a call's samples over a paged KV cache.

Lives here: `generate(...)` (the `sampler.generate` contract plus per-row budgets, slots and
pages; it returns the same `sampler.Rollout`) and the jitted program under it. Not here: the
sampling math (`sampler.sample_logits`), the model's paged decode step
(`qwen.Qwen.decode_step_paged`), the kernel seam.

How one call runs, all inside one jitted function (no host round trip until it returns):
  1. The P prompts are prefilled once; their dense caches [P, Tp] are shared by reference
     by their G samples (every slot reads its prompt's row), and every sample's first token
     is drawn from its prompt's last logits.
  2. A fixed number of decode slots runs a `lax.while_loop`. Each step, every free slot
     takes the next pending sample (longest budget first, so the tail is short), if the
     pool can promise it the pages of its whole budget (so no admitted sample ever waits
     for a page); each busy slot decodes its last token, writes its key/value into its
     own page (a page is taken from the free stack when a sample crosses a page boundary),
     and samples its next token; a sample that emits an EOS id or reaches its budget
     frees its slot and its pages at once.
  3. Outputs are written per sample, [P*G, R_max], rows of one prompt contiguous.
RNG: the token at position t of sample (p, g) is drawn with key fold_in(fold_in(key,
p*G + g), t): the same rollouts whatever the slot count, page size or admission order.
Greedy decoding and the temperature-1 log-probs are the static sampler's (same model code,
same `sample_logits`); the draws themselves differ from `sampler.generate`'s (its key is
per step, shared by the rows).

Attention reads the slot's prompt row plus its W = ceil((R_max - 1) / page) page slots,
masked to the ones it holds (a gather-based pure-JAX paged attention; fixed shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax
from jax.sharding import Mesh

from ba_jax import sampler
from ba_jax.models import qwen


@struct.dataclass
class EngineState:
    """Carry of the engine's decode loop; S slots, B = P*G samples, NP pages, W pages/slot."""

    step: jax.Array  # int32 []: loop iterations so far
    next_i: jax.Array  # int32 []: position in the admission order of the next pending sample
    sid_S: jax.Array  # int32 [S]: sample held by the slot, -1 when free
    t_S: jax.Array  # int32 [S]: index of the token the slot samples next
    tok_S: jax.Array  # int32 [S]: the slot's last sampled token (decoded next)
    pages_SW: jax.Array  # int32 [S, W]: the slot's pages in order; NP where none
    owed_S: jax.Array  # int32 [S]: pages promised to the slot and not yet taken
    free_N: jax.Array  # int32 [NP]: stack of free page ids, free_N[:top] are free
    top: jax.Array  # int32 []
    promised: jax.Array  # int32 []: sum of owed_S
    pool: qwen.KVCache  # [L, NP, page, K, H]
    tokens_BR: jax.Array
    logp_BR: jax.Array
    sampling_logp_BR: jax.Array
    mask_BR: jax.Array  # bool
    done_B: jax.Array  # bool: the sample emitted an EOS id
    busy: jax.Array  # int32 []: slot-steps that produced a token
    peak_pages: jax.Array  # int32 []: most pages held at once
    live_at_peak: jax.Array  # int32 []: decoded tokens the slots held at that step


def pages_for(budget: int, page_size: int) -> int:
    """Pages a sample of `budget` tokens writes: every token but its last is decoded."""
    return -(-(max(int(budget), 1) - 1) // page_size)


def _sample_keys(key, sid, t):
    return jax.vmap(lambda s, u: jax.random.fold_in(jax.random.fold_in(key, s), u))(sid, t)


def engine_arrays(model, prompt_PT, prompt_mask_PT, budget_B, key, *, num_samples: int,
                  max_new_tokens: int, num_slots: int, page_size: int, num_pages: int,
                  config: sampler.SamplingConfig, eos_E, pad_id) -> dict[str, jax.Array]:
    """Traceable body of `generate` on left-padded prompts -> dict of [P*G, R] arrays and
    the loop's counters (`steps`, `busy_slot_steps`, `peak_pages`)."""
    (P, Tp), G, R = prompt_PT.shape, num_samples, max_new_tokens
    B, S, ps, NP = P * G, num_slots, page_size, num_pages
    W = max(pages_for(R, ps), 1)
    mc = model.config
    pmask_PT = prompt_mask_PT.astype(jnp.int32)
    positions_PT = jnp.maximum(jnp.cumsum(pmask_PT, 1) - 1, 0)
    logits_P1V, prompt = model(prompt_PT, positions_PT, pmask_PT,
                               logits_slice=slice(Tp - 1, None), return_kv=True)
    len_P = jnp.sum(pmask_PT, 1)
    sid_B = jnp.arange(B, dtype=jnp.int32)
    tok0, logp0, slogp0 = sampler.sample_logits(
        jnp.repeat(logits_P1V[:, 0], G, axis=0), _sample_keys(key, sid_B, jnp.zeros_like(sid_B)),
        config)
    eos0 = jnp.any(tok0[:, None] == eos_E[None, :], -1)
    first = lambda x: jnp.zeros((B, R), x.dtype).at[:, 0].set(x)  # noqa: E731
    # admission order: samples that go on, longest budget first (stable), then the finished
    order_B = jnp.argsort(jnp.where(eos0 | (budget_B <= 1), 1, -budget_B), stable=True)
    n_need = jnp.sum(~eos0 & (budget_B > 1))
    need_B = (jnp.maximum(budget_B, 1) - 1 + ps - 1) // ps
    shape = (mc.num_layers, NP, ps, mc.num_kv_heads, mc.head_dim)
    st = EngineState(
        step=jnp.int32(0), next_i=jnp.int32(0), sid_S=jnp.full((S,), -1, jnp.int32),
        t_S=jnp.zeros((S,), jnp.int32), tok_S=jnp.zeros((S,), jnp.int32),
        pages_SW=jnp.full((S, W), NP, jnp.int32), owed_S=jnp.zeros((S,), jnp.int32),
        free_N=jnp.arange(NP, dtype=jnp.int32)[::-1], top=jnp.int32(NP), promised=jnp.int32(0),
        pool=qwen.KVCache(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype)),
        tokens_BR=jnp.full((B, R), pad_id, jnp.int32).at[:, 0].set(tok0),
        logp_BR=first(logp0), sampling_logp_BR=first(slogp0),
        mask_BR=jnp.zeros((B, R), bool).at[:, 0].set(True), done_B=eos0,
        busy=jnp.int32(0), peak_pages=jnp.int32(0), live_at_peak=jnp.int32(0))

    def cond(st: EngineState):
        return jnp.any(st.sid_S >= 0) | (st.next_i < n_need)

    def body(st: EngineState) -> EngineState:
        # 1. admission: free slots, in slot order, take the next samples whose budgets the
        #    unpromised pages cover (a prefix of the order: the needs' running sum is monotone)
        free_S = st.sid_S < 0
        rank_S = jnp.cumsum(free_S) - 1
        cand_i = st.next_i + rank_S
        cand_S = order_B[jnp.clip(cand_i, 0, B - 1)]
        ok_S = free_S & (cand_i < n_need)
        cum_S = jnp.cumsum(jnp.where(ok_S, need_B[cand_S], 0))
        admit_S = ok_S & (cum_S <= st.top - st.promised)
        n_admit = jnp.sum(admit_S)
        sid_S = jnp.where(admit_S, cand_S, st.sid_S)
        t_S = jnp.where(admit_S, 1, st.t_S)
        tok_S = jnp.where(admit_S, tok0[cand_S], st.tok_S)
        owed_S = jnp.where(admit_S, need_B[cand_S], st.owed_S)
        promised = st.promised + jnp.sum(jnp.where(admit_S, need_B[cand_S], 0))
        live_S = sid_S >= 0
        # 2. a page for slots whose decode position d = t - 1 starts one
        d_S = t_S - 1
        want_S = live_S & (d_S % ps == 0)
        wrank_S = jnp.cumsum(want_S) - 1
        page_S = jnp.where(want_S, st.free_N[jnp.clip(st.top - 1 - wrank_S, 0, NP - 1)], NP)
        n_pop = jnp.sum(want_S)
        slot_ix = jnp.arange(S)
        pages_SW = st.pages_SW.at[slot_ix, jnp.where(want_S, d_S // ps, W)].set(page_S,
                                                                                   mode="drop")
        top, promised = st.top - n_pop, promised - n_pop
        owed_S = owed_S - want_S.astype(jnp.int32)
        # 3. decode the slots' last tokens and sample the next ones
        p_S = jnp.where(live_S, sid_S // G, 0)
        dec_valid_SX = live_S[:, None] & (jnp.arange(W * ps)[None] < d_S[:, None])
        valid_SX = jnp.concatenate([pmask_PT[p_S].astype(bool) & live_S[:, None], dec_valid_SX], 1)
        logits_SV, k_LSKH, v_LSKH = model.decode_step_paged(
            jnp.where(live_S, tok_S, pad_id), jnp.where(live_S, len_P[p_S] + d_S, 0),
            st.pool, jnp.where(pages_SW < NP, pages_SW, 0), prompt, p_S, valid_SX)
        w_page_S = jnp.where(live_S, jnp.take_along_axis(
            pages_SW, jnp.clip(d_S // ps, 0, W - 1)[:, None], 1)[:, 0], NP)
        off_S = jnp.where(live_S, d_S % ps, 0)
        put = lambda buf, new: buf.at[:, w_page_S, off_S].set(  # noqa: E731
            new.astype(buf.dtype), mode="drop")
        pool = qwen.KVCache(put(st.pool.k_LBSKH, k_LSKH), put(st.pool.v_LBSKH, v_LSKH))
        token_S, logp_S, slogp_S = sampler.sample_logits(
            logits_SV, _sample_keys(key, jnp.maximum(sid_S, 0), t_S), config)
        row_S = jnp.where(live_S, sid_S, B)  # B: dropped
        at = lambda buf, v: buf.at[row_S, t_S].set(v.astype(buf.dtype), mode="drop")  # noqa: E731
        eos_S = jnp.any(token_S[:, None] == eos_E[None, :], -1)
        # 4. samples that end here free their slot, their pages and their unused promise
        end_S = live_S & (eos_S | (t_S + 1 >= budget_B[jnp.maximum(sid_S, 0)]))
        give_SW = end_S[:, None] & (pages_SW < NP)
        grank = jnp.cumsum(give_SW.reshape(-1)) - 1
        free_N = st.free_N.at[jnp.where(give_SW.reshape(-1), top + grank, NP)].set(
            pages_SW.reshape(-1), mode="drop")
        held = NP - top  # pages held this step, before the ends give theirs back
        live = jnp.sum(jnp.where(live_S, d_S + 1, 0))  # decoded tokens in them
        new_peak = held > st.peak_pages
        return EngineState(
            step=st.step + 1, next_i=st.next_i + n_admit,
            sid_S=jnp.where(end_S, -1, sid_S), t_S=jnp.where(live_S, t_S + 1, t_S),
            tok_S=jnp.where(live_S, token_S, tok_S),
            pages_SW=jnp.where(end_S[:, None], NP, pages_SW),
            owed_S=jnp.where(end_S, 0, owed_S), free_N=free_N,
            top=top + jnp.sum(give_SW), promised=promised - jnp.sum(jnp.where(end_S, owed_S, 0)),
            pool=pool, tokens_BR=at(st.tokens_BR, jnp.where(live_S, token_S, pad_id)),
            logp_BR=at(st.logp_BR, logp_S), sampling_logp_BR=at(st.sampling_logp_BR, slogp_S),
            mask_BR=at(st.mask_BR, live_S), done_B=st.done_B.at[row_S].set(eos_S, mode="drop"),
            busy=st.busy + jnp.sum(live_S), peak_pages=jnp.maximum(st.peak_pages, held),
            live_at_peak=jnp.where(new_peak, live, st.live_at_peak))

    st = lax.while_loop(cond, body, st)
    return dict(tokens=st.tokens_BR, logprobs=st.logp_BR, sampling_logprobs=st.sampling_logp_BR,
                mask=st.mask_BR, done=st.done_B, steps=st.step, busy_slot_steps=st.busy,
                peak_pages=st.peak_pages, live_at_peak=st.live_at_peak,
                pages_free_at_end=st.top)


_JITTED: dict[tuple, Any] = {}


def engine_fn(graphdef, P, Tp, G, R, S, ps, NP, config, mesh):
    """The jitted engine call: run(state, prompt_PT, prompt_mask_PT, budget_B, key, eos_E,
    pad_id) -> `engine_arrays`' dict; one per (model structure, shapes, settings, mesh)."""
    k = (graphdef, P, Tp, G, R, S, ps, NP, config, mesh)
    if k not in _JITTED:
        def run(state, prompt_PT, prompt_mask_PT, budget_B, key, eos_E, pad_id):
            model = nnx.merge(graphdef, state)
            with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
                  else contextlib.nullcontext()):
                return engine_arrays(model, prompt_PT, prompt_mask_PT, budget_B, key,
                                     num_samples=G, max_new_tokens=R, num_slots=S,
                                     page_size=ps, num_pages=NP, config=config, eos_E=eos_E,
                                     pad_id=pad_id)

        _JITTED[k] = jax.jit(run)
    return _JITTED[k]


def default_slots(rows: int) -> int:
    """Decode slots when none are configured: a quarter of the rows, so each slot serves
    about four samples and the tail (the last long samples) is short relative to the run."""
    return max(1, -(-rows // 4))


def row_budgets(max_new_tokens, num_prompts: int, num_samples: int) -> np.ndarray:
    """Per-row token budgets [P*G] from an int, one per prompt ([P]) or one per row ([P*G])."""
    b = np.asarray(max_new_tokens, np.int64)
    B = num_prompts * num_samples
    if b.ndim == 0:
        b = np.full(B, int(b))
    elif b.shape == (num_prompts,):
        b = np.repeat(b, num_samples)
    elif b.shape != (B,):
        raise ValueError(f"max_new_tokens has shape {b.shape}; expected an int, [{num_prompts}] "
                         f"(one per prompt) or [{B}] (one per row)")
    if (b < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1 everywhere, got min {int(b.min())}")
    return b.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters of one engine call: loop steps, slot-steps that produced a token, pages."""

    steps: int
    num_slots: int
    busy_slot_steps: int
    peak_pages: int
    live_at_peak: int  # decoded tokens held in those pages at that step
    num_pages: int
    page_size: int

    @property
    def useful_fraction(self) -> float:
        """Share of the slot-steps run that produced a token."""
        return self.busy_slot_steps / max(self.steps * self.num_slots, 1)


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
    num_slots: int = 0,
    page_size: int = 16,
    num_pages: int = 0,
    mesh: Mesh | None = None,
    return_stats: bool = False,
):
    """`sampler.generate`'s contract through the engine -> `sampler.Rollout` (and
    `EngineStats` with `return_stats`). `max_new_tokens`: an int, one budget per prompt or
    one per row; the Rollout's arrays are as wide as the largest. `num_slots` (0: a quarter
    of the rows) decode at once; the pool holds `num_pages` pages of `page_size` tokens (0:
    enough for every slot's largest budget at once). A pool too small for the largest
    single budget is a ValueError before anything runs."""
    eos, pad, config, prompt_PT, pmask_PT = sampler.prepare_request(
        prompts, eos_ids, pad_id, temperature, top_k, top_p)
    P, G = len(prompts), int(num_samples)
    budget_B = row_budgets(max_new_tokens, P, G)
    R = int(budget_B.max())
    S = int(num_slots) or default_slots(P * G)
    ps = int(page_size)
    if S < 1 or ps < 1:
        raise ValueError(f"num_slots={num_slots} and page_size={page_size} must be >= 1")
    largest = pages_for(R, ps)
    NP = int(num_pages) or max(S * largest, 1)
    if NP < largest:
        raise ValueError(f"num_pages={NP} of {ps} tokens cannot hold one sequence of the "
                         f"largest budget {R} ({largest} pages)")
    graphdef, state = nnx.split(model)
    run = engine_fn(graphdef, P, prompt_PT.shape[1], G, R, S, ps, NP, config, mesh)
    out = jax.device_get(run(state, prompt_PT, pmask_PT, budget_B, key, eos, np.int32(pad)))
    ro = sampler.to_rollout(out, prompt_PT, pmask_PT, G)
    if not return_stats:
        return ro
    if int(out["pages_free_at_end"]) != NP:
        raise AssertionError(f"page accounting leaked: {NP - int(out['pages_free_at_end'])} of "
                             f"{NP} pages still held after the drain")
    return ro, EngineStats(steps=int(out["steps"]), num_slots=S,
                           busy_slot_steps=int(out["busy_slot_steps"]),
                           peak_pages=int(out["peak_pages"]),
                           live_at_peak=int(out["live_at_peak"]), num_pages=NP, page_size=ps)
