"""The rollout engine: continuous batching of a call's samples over a paged KV cache.

Lives here: `generate(...)` (what `sampler.generate` runs: its contract plus per-row budgets,
slots and pages; it returns a `sampler.Rollout`), `run_call` (one call on padded prompts with
given sample ids, what `engine_queue` steps with), the jitted program under them, the row
layout over devices and `decode_copy` (the weights a call decodes with). Not here: the
sampling math (`sampler.sample_logits`), the model's paged decode step
(`qwen.Qwen.decode_step_paged`), the kernel seam, the request queue (`engine_queue`).

How one call runs, all inside one jitted function (one host round trip: the outputs come
back when the call's last sample ends): a `lax.while_loop` over a fixed number of decode
slots and one pool of pages. Each step,
  1. prefill: with no prompt in prefill, the prompt of the first pending sample (in
     admission order: longest budget first, so the tail is short) whose prompt is not ready
     starts, if the unpromised pages hold its pages and that sample's budget (promised to it
     until the prompt is in, so one more sample can always start: no deadlock); then one
     chunk of `prefill_chunk` of its tokens is prefilled: their keys/values go into pages
     that its G samples then read by reference, and after its last chunk their first tokens
     are drawn from its last logits;
  2. admission: every free slot takes the next pending sample of a ready prompt, if the
     pool can promise it the pages of its whole budget (so no admitted sample ever waits
     for a page);
  3. decode: each busy slot writes its last token's key/value into its own page (taken
     from the free stack when a sample starts or crosses a page boundary), attends to its
     prompt's pages and its own, and samples its next token; a sample that emits an EOS id or
     reaches its budget frees its slot and its pages at once, and a prompt whose samples
     have all ended frees its pages.
Outputs are written per sample, [P*G, R_max], rows of one prompt contiguous. Prefill runs
inside the loop, one chunk per step, interleaved with the decode of the busy slots, so a
long prompt never stalls them for more than one chunk's forward. A chunk attends to the
pages the prompt's earlier chunks wrote (`qwen.Qwen.prefill_chunk_paged`, a gather of those
pages: any backend); a bucket no longer than the chunk is one forward with the model's
prefill kernel (splash, cuDNN, ...).
With a mesh, the call's rows are cut into D blocks over the (data, fsdp) devices
(`row_layout`) and each device runs steps 1-3 on its own block, prompts, slots and pool
(`engine_fn`: a shard_map manual over those axes; no collective inside the loop).
RNG: the token at position t of sample s (its row in the call, or the id `run_call` is
given) is drawn with key fold_in(fold_in(key, s), t): the same rollouts whatever the slot
count, page size, admission order, devices or processes. Greedy decoding and the
temperature-1 log-probs are the static sampler's (same model code, same `sample_logits`);
the draws themselves differ from `sampler.generate_static`'s (its key is per step, shared
by the rows).

Cache layout (`qwen.PagePool`, [K, L * NP, page, H]): a prompt's real tokens fill its pages
from the first slot on (the bucket's padding is dropped); its samples share its full pages
and each copies its partial last page (if any) into its own first page, then writes its
decoded tokens after it. So a sample's tokens are one contiguous run of its page table, its
key written before it attends: the layout of jax's TPU paged-attention kernel, which decode
uses on TPU (`attention.paged_impl`); elsewhere a gather of the table's X pages, masked past
the run's length, with the new token's key attended beside them and every layer's keys
written in one scatter after the layer scan (`attention.paged_writes_first`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from ba_jax import grpo, sampler, sharding
from ba_jax.models import qwen


@struct.dataclass
class EngineState:
    """Carry of one engine's loop: S slots, B rows, P prompts, NP pages of `page_size`
    tokens; a sample holds at most W pages, a prompt Wq (its bucket's)."""

    step: jax.Array  # int32 []: loop iterations so far
    sid_S: jax.Array  # int32 [S]: row (of this engine's B) held by the slot, -1 when free
    t_S: jax.Array  # int32 [S]: index of the token the slot samples next
    tok_S: jax.Array  # int32 [S]: the slot's last sampled token (decoded next)
    pages_SW: jax.Array  # int32 [S, W]: the slot's own pages in order; NP where none
    owed_S: jax.Array  # int32 [S]: pages promised to the slot and not yet taken
    free_N: jax.Array  # int32 [NP]: stack of free page ids, free_N[:top] are free
    top: jax.Array  # int32 []
    promised: jax.Array  # int32 []: sum of owed_S
    pages_PQ: jax.Array  # int32 [P, Wq]: the prompt's pages (its real tokens' keys/values
    #                       from the first slot of the first page on); NP where none
    ready_P: jax.Array  # bool [P]: the prompt has been prefilled
    pf_p: jax.Array  # int32 []: the prompt being prefilled, -1 when none
    pf_at: jax.Array  # int32 []: its real tokens prefilled so far
    pf_owed: jax.Array  # int32 []: pages promised for its first pending row meanwhile
    left_P: jax.Array  # int32 [P]: the prompt's rows not yet finished (its pages go at 0)
    taken_B: jax.Array  # bool [B]: the row has had its slot, or needed none
    pool: qwen.PagePool  # [K, L * NP, page, H]
    tokens_BR: jax.Array
    logp_BR: jax.Array
    sampling_logp_BR: jax.Array
    mask_BR: jax.Array  # bool
    done_B: jax.Array  # bool: the sample emitted an EOS id
    busy: jax.Array  # int32 []: slot-steps that produced a token
    peak_pages: jax.Array  # int32 []: most pages held at once
    live_at_peak: jax.Array  # int32 []: tokens (prompts' and decoded) in them at that step


def pages_for(budget: int, page_size: int) -> int:
    """Pages a sample of `budget` tokens may hold: its first page starts with a copy of its
    prompt's partial last page (at most page_size - 1 tokens), then the tokens it decodes
    (every one but its last); a sample of one token decodes none and holds none."""
    budget = int(budget)
    return 0 if budget <= 1 else -(-(page_size - 1 + budget - 1) // page_size)


def prompt_pages(prompt_len: int, page_size: int) -> int:
    """Pages a prompt of the bucket `prompt_len` fills (padding slots included, masked)."""
    return -(-int(prompt_len) // page_size)


def _sample_keys(key, sid, t):
    return jax.vmap(lambda s, u: jax.random.fold_in(jax.random.fold_in(key, s), u))(sid, t)


def _pop(free_N, top, want_X):
    """Pages for the True entries of `want_X`, off the top of the free stack (NP elsewhere)."""
    NP = free_N.shape[0]
    rank_X = jnp.cumsum(want_X) - 1
    page_X = jnp.where(want_X, free_N[jnp.clip(top - 1 - rank_X, 0, NP - 1)], NP)
    return page_X, top - jnp.sum(want_X)


def _push(free_N, top, page_X, give_X):
    """The pages of the True entries of `give_X` back onto the free stack."""
    NP = free_N.shape[0]
    rank_X = jnp.cumsum(give_X) - 1
    free_N = free_N.at[jnp.where(give_X, top + rank_X, NP)].set(page_X, mode="drop")
    return free_N, top + jnp.sum(give_X)


def engine_arrays(model, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, *,
                  max_new_tokens: int, num_slots: int, page_size: int, num_pages: int,
                  rows_per_prompt: int, config: sampler.SamplingConfig, eos_E,
                  pad_id, prefill_chunk: int = 0) -> dict[str, jax.Array]:
    """Traceable body of one engine (one device's share under a mesh) -> dict of [B, R] arrays
    and the loop's counters (`steps`, `busy_slot_steps`, `peak_pages`, ...).

    Row b samples from prompt `row_prompt_B[b]` (nondecreasing; a prompt has at most
    `rows_per_prompt` rows) of the P left-padded prompts, with the keys of sample id
    `sid_B[b]` (its row in the whole call; < 0: a padding row, never sampled) and at most
    `budget_B[b]` tokens. Each loop step first prefills one chunk of `prefill_chunk` tokens
    (0: the whole bucket) of the prompt a pending row needs next (starting it if the pool can
    hold its pages and that row's budget), writing its keys/values into pages its rows share,
    and after its last chunk draws their first tokens; then free slots take pending rows of
    prefilled prompts; then every busy slot decodes one token."""
    (P, Tp), R = prompt_PT.shape, max_new_tokens
    C = min(int(prefill_chunk), Tp) if prefill_chunk else Tp
    B, S, ps, NP, Gw = row_prompt_B.shape[0], num_slots, page_size, num_pages, rows_per_prompt
    W, Wq = max(pages_for(R, ps), 1), prompt_pages(Tp, ps)
    X = -(-(Tp + R - 1) // ps)  # pages a slot's table lists: prompt and decoded tokens
    mc = model.config
    L = mc.num_layers
    pmask_PT = prompt_mask_PT.astype(jnp.int32)
    # a prompt of n tokens fills n // ps pages and n % ps slots of one more; its samples
    # share the full pages and copy the partial one into their first own page, so each
    # sample's tokens are one contiguous run (what paged-attention kernels read)
    len_P = jnp.sum(pmask_PT, 1)
    full_P, tail_P, qpages_P = len_P // ps, len_P % ps, -(-len_P // ps)
    real_B = sid_B >= 0
    # admission order: longest budget first (stable): the long samples start early, the
    # tail is short
    order_B = jnp.argsort(-budget_B, stable=True)
    need_B = jnp.where(budget_B >= 2,
                       (tail_P[row_prompt_B] + budget_B - 1 + ps - 1) // ps, 0)
    st = EngineState(
        step=jnp.int32(0), sid_S=jnp.full((S,), -1, jnp.int32),
        t_S=jnp.zeros((S,), jnp.int32), tok_S=jnp.zeros((S,), jnp.int32),
        pages_SW=jnp.full((S, W), NP, jnp.int32), owed_S=jnp.zeros((S,), jnp.int32),
        free_N=jnp.arange(NP, dtype=jnp.int32)[::-1], top=jnp.int32(NP), promised=jnp.int32(0),
        pages_PQ=jnp.full((P, Wq), NP, jnp.int32), ready_P=jnp.zeros((P,), bool),
        pf_p=jnp.int32(-1), pf_at=jnp.int32(0), pf_owed=jnp.int32(0),
        left_P=jnp.zeros((P,), jnp.int32).at[row_prompt_B].add(real_B.astype(jnp.int32)),
        taken_B=~real_B,
        pool=qwen.PagePool.zeros(mc, NP, ps, model.dtype),
        tokens_BR=jnp.full((B, R), pad_id, jnp.int32), logp_BR=jnp.zeros((B, R), jnp.float32),
        sampling_logp_BR=jnp.zeros((B, R), jnp.float32), mask_BR=jnp.zeros((B, R), bool),
        done_B=jnp.zeros((B,), bool), busy=jnp.int32(0), peak_pages=jnp.int32(0),
        live_at_peak=jnp.int32(0))

    def release_prompts(st: EngineState) -> EngineState:
        """Prompts whose rows have all finished give their pages back."""
        gone_P = st.ready_P & (st.left_P == 0)
        give_PQ = gone_P[:, None] & (st.pages_PQ < NP)
        free_N, top = _push(st.free_N, st.top, st.pages_PQ.reshape(-1), give_PQ.reshape(-1))
        return st.replace(free_N=free_N, top=top,
                          pages_PQ=jnp.where(gone_P[:, None], NP, st.pages_PQ))

    def start_prefill(st: EngineState, p, need) -> EngineState:
        """Prompt p: ceil(n / ps) fresh pages for its n real tokens, and a promise of `need`
        pages (the budget of its first pending row) until its last chunk is in."""
        page_Q, top = _pop(st.free_N, st.top, jnp.arange(Wq) < qpages_P[p])
        return st.replace(top=top, pages_PQ=st.pages_PQ.at[p].set(page_Q), pf_p=p,
                          pf_at=jnp.int32(0), pf_owed=need, promised=st.promised + need)

    def prefill_chunk_step(st: EngineState) -> EngineState:
        """The next C real tokens of the prompt in prefill: their keys/values into its pages,
        from the first slot on (the bucket's left padding dropped); after its last chunk, its
        rows' first tokens from the last token's logits. A whole bucket (C = Tp) is one
        forward with the model's attention kernel (`attention.resolve`: splash, cudnn, ...);
        a chunk attends to the pages earlier chunks wrote (`qwen.prefill_chunk_paged`)."""
        p, at = st.pf_p, st.pf_at
        row_T = lax.dynamic_index_in_dim(prompt_PT, p, 0, keepdims=False)
        if C == Tp:
            mask_1T = lax.dynamic_index_in_dim(pmask_PT, p, 0)
            x_1TD, kv = model.hidden_states(row_T[None], jnp.maximum(jnp.cumsum(mask_1T, 1) - 1,
                                                                    0), mask_1T, return_kv=True)
            # real token j (of n) is at bucket slot Tp - n + j; it goes to position j
            j_T = jnp.arange(Tp)
            src_T = jnp.clip(Tp - len_P[p] + j_T, 0, Tp - 1)
            st = st.replace(pool=st.pool.write_tokens(
                st.pages_PQ[p][None], j_T[None], (j_T < len_P[p])[None],
                kv.k_LBSKH[:, :, src_T], kv.v_LBSKH[:, :, src_T]))
            return finish_prefill(st, x_1TD[:, Tp - 1:])
        j_C = at + jnp.arange(C)
        valid_C = j_C < len_P[p]
        tok_C = row_T[jnp.clip(Tp - len_P[p] + j_C, 0, Tp - 1)]
        x_1CD, pool = model.prefill_chunk_paged(tok_C[None], valid_C[None], st.pool,
                                                st.pages_PQ[p][None], at[None])
        st = st.replace(pool=pool, pf_at=at + C)
        last = jnp.clip(len_P[p] - 1 - at, 0, C - 1)  # the prompt's last token, if here
        return lax.cond(at + C >= len_P[p], finish_prefill, lambda st, x: st, st,
                        lax.dynamic_slice_in_dim(x_1CD, last, 1, axis=1))

    def finish_prefill(st: EngineState, x_11D) -> EngineState:
        p = st.pf_p
        logits_1V = model.logits(x_11D)[:, 0]
        # its rows are contiguous: at most Gw from the first
        idx_G = jnp.searchsorted(row_prompt_B, p) + jnp.arange(Gw)
        cl_G = jnp.clip(idx_G, 0, B - 1)
        in_G = (idx_G < B) & (row_prompt_B[cl_G] == p) & real_B[cl_G]
        tok_G, logp_G, slogp_G = sampler.sample_logits(
            jnp.broadcast_to(logits_1V, (Gw, logits_1V.shape[-1])),
            _sample_keys(key, sid_B[cl_G], jnp.zeros((Gw,), jnp.int32)), config)
        rows_G = jnp.where(in_G, idx_G, B)  # B: dropped
        at0 = lambda buf, v: buf.at[rows_G, 0].set(v.astype(buf.dtype), mode="drop")  # noqa: E731
        eos_G = jnp.any(tok_G[:, None] == eos_E[None, :], -1)
        end_G = in_G & (eos_G | (budget_B[cl_G] <= 1))  # finished with their first token
        st = st.replace(
            ready_P=st.ready_P.at[p].set(True), left_P=st.left_P.at[p].add(-jnp.sum(end_G)),
            pf_p=jnp.int32(-1), pf_owed=jnp.int32(0), promised=st.promised - st.pf_owed,
            taken_B=st.taken_B.at[jnp.where(end_G, idx_G, B)].set(True, mode="drop"),
            tokens_BR=at0(st.tokens_BR, tok_G), logp_BR=at0(st.logp_BR, logp_G),
            sampling_logp_BR=at0(st.sampling_logp_BR, slogp_G),
            mask_BR=at0(st.mask_BR, in_G), done_B=st.done_B.at[rows_G].set(eos_G, mode="drop"))
        return release_prompts(st)

    def cond(st: EngineState):
        return jnp.any(st.sid_S >= 0) | jnp.any(~st.taken_B)

    def body(st: EngineState) -> EngineState:
        # 1. prefill: with none in progress, start the prompt of the first pending row (in
        #    admission order) whose prompt is not ready, if the unpromised pages hold the
        #    prompt and that row's budget (promised to it until the prompt is in, so after any
        #    prefill one more sample can always start: no deadlock); then one chunk of it
        pend_O = ~st.taken_B[order_B]
        prompt_O = row_prompt_B[order_B]
        cold_O = pend_O & ~st.ready_P[prompt_O]
        first = jnp.argmax(cold_O)
        need = need_B[order_B[first]]
        go = (st.pf_p < 0) & jnp.any(cold_O) & (
            st.top - st.promised >= qpages_P[prompt_O[first]] + need)
        st = lax.cond(go, start_prefill, lambda st, p, n: st, st, prompt_O[first], need)
        st = lax.cond(st.pf_p >= 0, prefill_chunk_step, lambda st: st, st)
        # 2. admission: free slots, in slot order, take the next pending rows of ready
        #    prompts whose budgets the unpromised pages cover (a prefix of those rows)
        cand_O = ~st.taken_B[order_B] & st.ready_P[prompt_O]
        free_S = st.sid_S < 0
        take_O = cand_O & (jnp.cumsum(cand_O) <= jnp.sum(free_S))
        take_O &= jnp.cumsum(jnp.where(take_O, need_B[order_B], 0)) <= st.top - st.promised
        row_K = jnp.full((S,), B, jnp.int32).at[
            jnp.where(take_O, jnp.cumsum(take_O) - 1, S)].set(order_B, mode="drop")
        frank_S = jnp.cumsum(free_S) - 1
        new_S = jnp.where(free_S, row_K[jnp.clip(frank_S, 0, S - 1)], B)
        admit_S = new_S < B
        cand_S = jnp.minimum(new_S, B - 1)
        sid_S = jnp.where(admit_S, new_S, st.sid_S)
        t_S = jnp.where(admit_S, 1, st.t_S)
        tok_S = jnp.where(admit_S, st.tokens_BR[cand_S, 0], st.tok_S)
        owed_S = jnp.where(admit_S, need_B[cand_S], st.owed_S)
        promised = st.promised + jnp.sum(jnp.where(admit_S, need_B[cand_S], 0))
        taken_B = st.taken_B.at[new_S].set(True, mode="drop")
        live_S = sid_S >= 0
        # 3. a page for slots whose token (at position v = prompt length + t - 1 of the
        #    sample's run) starts one, or that decode for the first time: their first page
        #    gets a copy of the prompt's partial last page
        p_S = jnp.where(live_S, row_prompt_B[jnp.maximum(sid_S, 0)], 0)
        d_S = t_S - 1
        v_S = len_P[p_S] + d_S
        full_S = full_P[p_S]
        own_S = v_S // ps - full_S  # the slot's page that v falls in
        want_S = live_S & ((v_S % ps == 0) | (d_S == 0))
        page_S, top = _pop(st.free_N, st.top, want_S)
        slot_ix = jnp.arange(S)
        pages_SW = st.pages_SW.at[slot_ix, jnp.where(want_S, own_S, W)].set(page_S,
                                                                               mode="drop")
        promised = promised - jnp.sum(want_S)
        owed_S = owed_S - want_S.astype(jnp.int32)
        copy_S = want_S & (d_S == 0) & (tail_P[p_S] > 0)

        def copy_tails(pool: qwen.PagePool) -> qwen.PagePool:
            base_L1 = jnp.arange(L)[:, None] * NP
            src_LS = base_L1 + st.pages_PQ[p_S, jnp.minimum(full_S, Wq - 1)][None]
            dst_LS = jnp.where(copy_S[None], base_L1 + page_S[None], L * NP)
            cp = lambda buf: buf.at[:, dst_LS].set(buf[:, src_LS], mode="drop")  # noqa: E731
            return qwen.PagePool(cp(pool.k), cp(pool.v))

        pool = lax.cond(jnp.any(copy_S), copy_tails, lambda pool: pool, st.pool)
        # 4. decode the slots' last tokens: each writes its key/value at v, then attends to
        #    its run's first v + 1 tokens (the prompt's full pages, then its own), and
        #    samples its next token
        j_X = jnp.arange(X)
        table_SX = jnp.where(
            j_X[None] < full_S[:, None], st.pages_PQ[p_S][:, jnp.minimum(j_X, Wq - 1)],
            jnp.take_along_axis(pages_SW, jnp.clip(j_X[None] - full_S[:, None], 0, W - 1), 1))
        w_page_S = jnp.where(live_S, jnp.take_along_axis(
            pages_SW, jnp.clip(own_S, 0, W - 1)[:, None], 1)[:, 0], NP)
        logits_SV, pool = model.decode_step_paged(
            jnp.where(live_S, tok_S, pad_id), jnp.where(live_S, v_S, 0), pool, table_SX,
            jnp.where(live_S, v_S + 1, 1), w_page_S, v_S % ps)
        token_S, logp_S, slogp_S = sampler.sample_logits(
            logits_SV, _sample_keys(key, sid_B[jnp.maximum(sid_S, 0)], t_S), config)
        row_S = jnp.where(live_S, sid_S, B)  # B: dropped
        at = lambda buf, v: buf.at[row_S, t_S].set(v.astype(buf.dtype), mode="drop")  # noqa: E731
        eos_S = jnp.any(token_S[:, None] == eos_E[None, :], -1)
        # 5. samples that end here free their slot, their pages and their unused promise;
        #    a prompt whose rows have all ended frees its pages
        end_S = live_S & (eos_S | (t_S + 1 >= budget_B[jnp.maximum(sid_S, 0)]))
        give_SW = end_S[:, None] & (pages_SW < NP)
        free_N, top_after = _push(st.free_N, top, pages_SW.reshape(-1), give_SW.reshape(-1))
        held = NP - top  # pages held this step, before the ends give theirs back
        held_P = st.ready_P & (st.left_P > 0)
        live = (jnp.sum(jnp.where(live_S, d_S + 1, 0))  # tokens in them: decoded and prompts'
                + jnp.sum(jnp.where(held_P, len_P, 0))
                + jnp.where(st.pf_p >= 0, jnp.minimum(st.pf_at, len_P[jnp.maximum(st.pf_p, 0)]),
                            0))
        new_peak = held > st.peak_pages
        st = st.replace(
            step=st.step + 1, sid_S=jnp.where(end_S, -1, sid_S),
            t_S=jnp.where(live_S, t_S + 1, t_S), tok_S=jnp.where(live_S, token_S, tok_S),
            pages_SW=jnp.where(end_S[:, None], NP, pages_SW),
            owed_S=jnp.where(end_S, 0, owed_S), free_N=free_N, top=top_after,
            promised=promised - jnp.sum(jnp.where(end_S, owed_S, 0)),
            left_P=st.left_P.at[jnp.where(end_S, p_S, P)].add(-1, mode="drop"),
            taken_B=taken_B, pool=pool,
            tokens_BR=at(st.tokens_BR, jnp.where(live_S, token_S, pad_id)),
            logp_BR=at(st.logp_BR, logp_S), sampling_logp_BR=at(st.sampling_logp_BR, slogp_S),
            mask_BR=at(st.mask_BR, live_S), done_B=st.done_B.at[row_S].set(eos_S, mode="drop"),
            busy=st.busy + jnp.sum(live_S), peak_pages=jnp.maximum(st.peak_pages, held),
            live_at_peak=jnp.where(new_peak, live, st.live_at_peak))
        return release_prompts(st)

    st = lax.while_loop(cond, body, st)
    return dict(tokens=st.tokens_BR, logprobs=st.logp_BR, sampling_logprobs=st.sampling_logp_BR,
                mask=st.mask_BR, done=st.done_B, steps=st.step, busy_slot_steps=st.busy,
                peak_pages=st.peak_pages, live_at_peak=st.live_at_peak,
                pages_free_at_end=st.top)


_JITTED: dict[tuple, Any] = {}
TRACE_COUNTS: Counter = Counter()  # traces per compile key; a test checks calls do not retrace


def engine_fn(graphdef, cs: CallShape, config, mesh):
    """The jitted engine call of the shape `cs` (`call_shape`): run(state, prompt_PT,
    prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E, pad_id) -> `engine_arrays`'
    dict, counters as [D] arrays (one per row device); one per (model structure, shape,
    settings, mesh).

    With a mesh, every argument but the state, key, EOS ids and pad id is split over the
    mesh's row axes (`sharding.row_axes`): each of the D row devices runs its own engine on
    its P / D prompt block and B / D rows (its own slots S, pages NP, while loop), under a
    `shard_map` manual over those axes only: no collective inside the loop, and `tensor`
    (if the mesh has one) still splits heads and the MLP by XLA's partitioner. Weights are
    taken as given: hand over a decode copy (`decode_copy`) so none is gathered per call."""
    k = (graphdef, cs, config, mesh)
    if k not in _JITTED:
        def local(state, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E,
                  pad_id):
            TRACE_COUNTS[k[1:-1]] += 1  # runs at trace time only
            out = engine_arrays(nnx.merge(graphdef, state), prompt_PT, prompt_mask_PT,
                                row_prompt_B, sid_B, budget_B, key,
                                max_new_tokens=cs.max_new_tokens,
                                num_slots=cs.slots_per_device, page_size=cs.page_size,
                                num_pages=cs.pages_per_device,
                                rows_per_prompt=cs.rows_per_prompt, config=config,
                                eos_E=eos_E, pad_id=pad_id, prefill_chunk=cs.prefill_chunk)
            return {n: v if v.ndim else v[None] for n, v in out.items()}

        axes = () if mesh is None else sharding.row_axes(mesh)
        if not axes or math.prod(mesh.shape[a] for a in axes) == 1:
            run = local
            if mesh is not None:  # the mesh in context: the kernel seam and the constraints
                def run(*args):
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        return local(*args)
        else:
            rows, rep = PartitionSpec(axes), PartitionSpec()
            run = jax.shard_map(local, mesh=mesh, in_specs=(rep,) + (rows,) * 5 + (rep,) * 3,
                                out_specs=rows, axis_names=set(axes), check_vma=False)
        _JITTED[k] = jax.jit(run)
    return _JITTED[k]


def decode_copy(params: Any, mesh: Mesh | None, dtype) -> Any:
    """The weights the engine decodes with, handed over once per call or RL step: matrices in
    the compute `dtype` (`grpo.compute_copy`), laid out for decoding on `mesh`
    (`sharding.decode_shardings`: whole on every row device, split over `tensor`). The cast
    runs on each device's shard before the gather, so a bf16 run moves bf16 bytes; the copy
    is a fresh buffer (the trainer's state is donated to its update). Without a mesh: the
    compute-dtype copy where the parameters are."""
    key = (jnp.dtype(dtype), mesh, jax.tree.structure(params),
           tuple(x.shape for x in jax.tree.leaves(params)))
    if key not in _COPIES:  # one jitted copy per layout: a step never retraces it
        fn = functools.partial(grpo.compute_copy, dtype=dtype)
        _COPIES[key] = jax.jit(fn) if mesh is None else jax.jit(
            fn, out_shardings=sharding.decode_shardings(params, mesh))
    return _COPIES[key](params)


_COPIES: dict[tuple, Any] = {}


def row_devices(mesh: Mesh | None) -> int:
    """How many row devices a call on `mesh` splits its rows over (1 without a mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in sharding.row_axes(mesh))


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where the B = P*G rows of a call go on D row devices: device d holds rows
    [d*b, (d+1)*b) of the call padded to D*b (padding rows: budget 1, dropped), and the
    block of Pd prompts they sample from (a prompt whose rows straddle two devices is
    prefilled on both)."""

    prompt_index: np.ndarray  # int32 [D*Pd]: the call's prompt each device's slot p holds
    row_prompt: np.ndarray  # int32 [D*b]: the row's prompt within its device's block
    rows: int  # B, the call's real rows
    rows_per_device: int  # b
    prompts_per_device: int  # Pd


def row_layout(num_prompts: int, num_samples: int, num_devices: int) -> RowLayout:
    """The `RowLayout` of P prompts x G samples on D row devices."""
    P, G, D = num_prompts, num_samples, num_devices
    b = -(-(P * G) // D)
    prompt_of = np.minimum(np.arange(D * b) // G, P - 1)
    first, last = prompt_of[::b], prompt_of[b - 1::b]
    Pd = int((last - first).max()) + 1
    index = np.minimum(first[:, None] + np.arange(Pd), last[:, None])
    return RowLayout(prompt_index=index.reshape(-1).astype(np.int32),
                     row_prompt=(prompt_of - np.repeat(first, b)).astype(np.int32),
                     rows=P * G, rows_per_device=b, prompts_per_device=Pd)


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
    """Counters of one engine call, summed over its row devices (`steps`: the longest
    device's loop); slots and pages are the call's totals (D times one device's)."""

    steps: int
    num_slots: int
    busy_slot_steps: int  # slot-steps that produced a token
    slot_steps: int  # slot-steps run: each device's loop steps x its slots
    peak_pages: int  # the devices' peaks of pages held at once, summed
    live_at_peak: int  # decoded tokens held in those pages at those steps
    num_pages: int
    page_size: int
    num_devices: int = 1

    @property
    def useful_fraction(self) -> float:
        """Share of the slot-steps run that produced a token."""
        return self.busy_slot_steps / max(self.slot_steps, 1)


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The static shape of one engine call (its compile key, less the model and mesh)."""

    prompts_per_device: int
    prompt_len: int  # Tp, the prompts' bucket
    rows_per_device: int
    max_new_tokens: int  # R, the largest budget: the Rollout's width
    slots_per_device: int
    page_size: int
    pages_per_device: int
    rows_per_prompt: int  # the most rows one prompt has on one device
    prefill_chunk: int  # tokens of a prompt prefilled per loop step (<= the bucket)


def call_shape(num_prompts: int, prompt_len: int, num_samples: int, max_new_tokens: int, *,
               num_slots: int = 0, page_size: int = 16, num_pages: int = 0,
               num_devices: int = 1, prefill_chunk: int = 512) -> CallShape:
    """The shape of a call of P prompts x G samples on D row devices, prompts in the bucket
    `prompt_len`: each device gets ceil(num_slots / D) slots (0: a quarter of its rows) and
    ceil(num_pages / D) pages (0: every slot's largest budget at once, plus one prompt's
    pages per slot, at most its prompts'), prompts prefilled `prefill_chunk` tokens per loop
    step (0 or more than the bucket: the whole bucket). ValueError before anything runs for
    settings that cannot run: slots or page size < 1, a negative chunk, a device pool too
    small for one prompt and one sequence of the largest budget."""
    S, ps = int(num_slots), int(page_size)
    if S < 0 or ps < 1:
        raise ValueError(f"num_slots={num_slots} must be >= 0 and page_size={page_size} >= 1")
    if int(prefill_chunk) < 0:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: whole prompts)")
    lay = row_layout(num_prompts, num_samples, num_devices)
    D, R = num_devices, int(max_new_tokens)
    Sd = -(-S // D) if S else default_slots(lay.rows_per_device)
    largest, Wq = pages_for(R, ps), prompt_pages(prompt_len, ps)
    Pd = lay.prompts_per_device
    NPd = (-(-int(num_pages) // D) if num_pages
           else Sd * largest + min(Sd, Pd) * Wq)
    if NPd < largest + Wq:
        raise ValueError(f"num_pages={num_pages} of {ps} tokens over {D} row device(s) gives "
                         f"each {NPd}: cannot hold one sequence of the largest budget {R} "
                         f"({largest} pages) beside its prompt ({Wq} pages of a "
                         f"{prompt_len}-token bucket)")
    chunk = min(int(prefill_chunk), int(prompt_len)) if prefill_chunk else int(prompt_len)
    return CallShape(Pd, prompt_len, lay.rows_per_device, R, Sd, ps, NPd,
                     min(num_samples, lay.rows_per_device), chunk)


def _stats(out: dict, cs: CallShape, D: int) -> EngineStats:
    NP = cs.pages_per_device * D
    free = int(np.sum(out["pages_free_at_end"]))
    if free != NP:
        raise AssertionError(f"page accounting leaked: {NP - free} of {NP} pages still held "
                             "after the drain")
    steps = np.asarray(out["steps"])
    return EngineStats(steps=int(steps.max()), num_slots=cs.slots_per_device * D,
                       busy_slot_steps=int(np.sum(out["busy_slot_steps"])),
                       slot_steps=int(steps.sum()) * cs.slots_per_device,
                       peak_pages=int(np.sum(out["peak_pages"])),
                       live_at_peak=int(np.sum(out["live_at_peak"])), num_pages=NP,
                       page_size=cs.page_size, num_devices=D)


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
    prefill_chunk: int = 512,
    mesh: Mesh | None = None,
    return_stats: bool = False,
):
    """`sampler.generate`'s contract through the engine -> `sampler.Rollout` (and
    `EngineStats` with `return_stats`). `max_new_tokens`: an int, one budget per prompt or
    one per row; the Rollout's arrays are as wide as the largest. With `mesh`, rows are split
    over its (data, fsdp) axes, each device running its own engine (`engine_fn`);
    `num_slots` and `num_pages` are the call's, split evenly, and prompts are prefilled
    `prefill_chunk` tokens per loop step (`call_shape`). Bad settings are a ValueError before
    anything runs."""
    eos, pad, config, prompt_PT, pmask_PT = sampler.prepare_request(
        prompts, eos_ids, pad_id, temperature, top_k, top_p)
    P, G = len(prompts), int(num_samples)
    budget_B = row_budgets(max_new_tokens, P, G)
    out, st = run_call(model, prompt_PT, pmask_PT, budget_B, np.arange(P * G, dtype=np.int32),
                       key, num_samples=G, config=config, eos_E=eos, pad_id=pad,
                       num_slots=num_slots, page_size=page_size, num_pages=num_pages,
                       prefill_chunk=prefill_chunk, mesh=mesh)
    ro = sampler.to_rollout(out, prompt_PT, pmask_PT, G)
    return (ro, st) if return_stats else ro


def run_call(model, prompt_PT: np.ndarray, prompt_mask_PT: np.ndarray, budget_B: np.ndarray,
             sid_B: np.ndarray, key, *, num_samples: int, config: sampler.SamplingConfig,
             eos_E: np.ndarray, pad_id: int, num_slots: int = 0, page_size: int = 16,
             num_pages: int = 0, prefill_chunk: int = 512, mesh: Mesh | None = None,
             width: int = 0) -> tuple[dict, EngineStats]:
    """One engine call on P left-padded prompts x G samples -> (host arrays of the P*G rows:
    `sampler.ROLLOUT_ARRAYS`, EngineStats). Row b's tokens are drawn with the keys of sample
    id `sid_B[b]`, so a request keeps its draws whatever call it lands in. The rows are
    `width` wide (0: the largest budget; a fixed width compiles once whatever the budgets)."""
    P, G = len(prompt_PT), int(num_samples)
    D = row_devices(mesh)
    cs = call_shape(P, prompt_PT.shape[1], G, max(int(width), int(budget_B.max())),
                    num_slots=num_slots, page_size=page_size, num_pages=num_pages, num_devices=D,
                    prefill_chunk=prefill_chunk)
    lay = row_layout(P, G, D)
    pad_rows = D * lay.rows_per_device - lay.rows
    budget_Bp = np.concatenate([budget_B, np.ones(pad_rows, np.int32)]).astype(np.int32)
    sid_Bp = np.concatenate([sid_B, np.full(pad_rows, -1)]).astype(np.int32)
    graphdef, state = nnx.split(model)
    run = engine_fn(graphdef, cs, config, mesh)
    out = jax.device_get(run(state, prompt_PT[lay.prompt_index],
                             prompt_mask_PT[lay.prompt_index], lay.row_prompt, sid_Bp, budget_Bp,
                             key, eos_E, np.int32(pad_id)))
    return {n: out[n][:lay.rows] for n in sampler.ROLLOUT_ARRAYS}, _stats(out, cs, D)
