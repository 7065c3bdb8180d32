"""The rollout engine's jitted program: continuous batching of a call's samples over pages.

Lives here: `EngineState` (the loop's carry), `engine_arrays` (one engine's traceable body:
one device's share under a mesh) and `engine_fn` (the jitted call of one `CallShape`, cached
per model structure, shape, sampling and mesh). Not here: the pool and the model's paged
cache modes (`paging.py`), shapes and counters (`shapes.py`), the host-side engine that
implements the rollout interface (`paged.py`), the sampling math (`sampling.py`).

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
A bucket no longer than the chunk is prefilled in one forward with the model's prefill
kernel (splash, cuDNN, ...); longer ones chunk by chunk (`paging.PagedChunk`, a gather).
RNG: the token at position t of sample s is drawn with key fold_in(fold_in(key, s), t): the
same rollouts whatever the slot count, page size, admission order, devices or processes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax
from jax.sharding import PartitionSpec

from ba_jax import sampling, sharding
from ba_jax.engine import paging
from ba_jax.engine.paging import PagePool, pages_for, prompt_pages
from ba_jax.engine.shapes import CallShape
from ba_jax.models import qwen

TRACE_COUNTS: Counter = Counter()  # traces per compile key; a test checks calls do not retrace


@struct.dataclass
class Slots:
    """The decode slots (the scheduler's side): Z of them, each holding one sample."""

    sid_Z: jax.Array  # int32 [Z]: row (of this engine's B) held by the slot, -1 when free
    t_Z: jax.Array  # int32 [Z]: index of the token the slot samples next
    tok_Z: jax.Array  # int32 [Z]: the slot's last sampled token (decoded next)
    pages_ZW: jax.Array  # int32 [Z, W]: the slot's own pages in order; NP where none
    owed_Z: jax.Array  # int32 [Z]: pages promised to the slot and not yet taken


@struct.dataclass
class Alloc:
    """The page allocator: a stack of free page ids and the pages promised ahead."""

    free_Y: jax.Array  # int32 [Y = NP]: stack of free page ids, free_Y[:top] are free
    top: jax.Array  # int32 []
    promised: jax.Array  # int32 []: pages promised (slots' owed_Z and the prefill's owed)


@struct.dataclass
class Prompts:
    """Admission: the prompts' pages and readiness, the rows still to start or finish."""

    pages_PQ: jax.Array  # int32 [P, Wq]: the prompt's pages (its real tokens' keys/values
    #                       from the first slot of the first page on); NP where none
    ready_P: jax.Array  # bool [P]: the prompt has been prefilled
    left_P: jax.Array  # int32 [P]: the prompt's rows not yet finished (its pages go at 0)
    taken_B: jax.Array  # bool [B]: the row has had its slot, or needed none


@struct.dataclass
class Prefill:
    """The prefill cursor: the one prompt being prefilled, chunk by chunk."""

    p: jax.Array  # int32 []: the prompt being prefilled, -1 when none
    at: jax.Array  # int32 []: its real tokens prefilled so far
    owed: jax.Array  # int32 []: pages promised for its first pending row meanwhile


@struct.dataclass
class Outputs:
    """What the call returns, per row: [B, R] tokens, log-probs, mask; [B] EOS flags."""

    tokens_BR: jax.Array
    logp_BR: jax.Array
    sampling_logp_BR: jax.Array
    mask_BR: jax.Array  # bool
    done_B: jax.Array  # bool: the sample emitted an EOS id


@struct.dataclass
class Counters:
    """The loop's counters (`EngineStats`)."""

    step: jax.Array  # int32 []: loop iterations so far
    busy: jax.Array  # int32 []: slot-steps that produced a token
    peak_pages: jax.Array  # int32 []: most pages held at once
    live_at_peak: jax.Array  # int32 []: tokens (prompts' and decoded) in them at that step


@struct.dataclass
class EngineState:
    """Carry of one engine's loop: Z slots, B rows, P prompts, NP pages of `page_size`
    tokens (a sample holds at most W pages, a prompt Wq), grouped by concern."""

    slots: Slots
    alloc: Alloc
    prompts: Prompts
    prefill: Prefill
    out: Outputs
    counters: Counters
    pool: PagePool  # [K, L * NP, page, H]


# flat field name (as `_set` takes it) -> (group, field)
_FIELDS = {f: (g, {"pf_p": "p", "pf_at": "at", "pf_owed": "owed"}.get(f, f))
           for g, cls in (("slots", Slots), ("alloc", Alloc), ("prompts", Prompts),
                          ("prefill", Prefill), ("out", Outputs), ("counters", Counters))
           for f in (["pf_p", "pf_at", "pf_owed"] if cls is Prefill
                     else [x.name for x in dataclasses.fields(cls)])}


def _set(st: EngineState, **fields) -> EngineState:
    """`st` with the named fields (flat names, `pf_*` for the prefill cursor's, or `pool`)
    replaced, each in its group."""
    groups: dict[str, dict] = {}
    for name, value in fields.items():
        if name == "pool":
            st = st.replace(pool=value)
            continue
        g, f = _FIELDS[name]
        groups.setdefault(g, {})[f] = value
    return st.replace(**{g: getattr(st, g).replace(**fs) for g, fs in groups.items()})


def _sample_keys(key, sid, t):
    return jax.vmap(lambda s, u: jax.random.fold_in(jax.random.fold_in(key, s), u))(sid, t)


def engine_arrays(model, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E,
                  pad_id, *, cs: CallShape, config: sampling.SamplingConfig
                  ) -> dict[str, jax.Array]:
    """Traceable body of one engine (one device's share under a mesh) -> dict of [B, R] arrays
    and the loop's counters (`steps`, `busy_slot_steps`, `peak_pages`, ...).

    Row b samples from prompt `row_prompt_B[b]` (nondecreasing; a prompt has at most
    `cs.rows_per_prompt` rows) of the P left-padded prompts, with the keys of sample id
    `sid_B[b]` (its row in the whole call; < 0: a padding row, never sampled) and at most
    `budget_B[b]` tokens. Each loop step first prefills one chunk of `cs.prefill_chunk` tokens
    (0: the whole bucket) of the prompt a pending row needs next (starting it if the pool can
    hold its pages and that row's budget), writing its keys/values into pages its rows share,
    and after its last chunk draws their first tokens; then free slots take pending rows of
    prefilled prompts; then every busy slot decodes one token."""
    (P, Tp), R = prompt_PT.shape, cs.max_new_tokens
    C = min(int(cs.prefill_chunk), Tp) if cs.prefill_chunk else Tp
    B, Z, ps = row_prompt_B.shape[0], cs.slots_per_device, cs.page_size
    NP, Gw = cs.pages_per_device, cs.rows_per_prompt
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
        slots=Slots(sid_Z=jnp.full((Z,), -1, jnp.int32), t_Z=jnp.zeros((Z,), jnp.int32),
                    tok_Z=jnp.zeros((Z,), jnp.int32), pages_ZW=jnp.full((Z, W), NP, jnp.int32),
                    owed_Z=jnp.zeros((Z,), jnp.int32)),
        alloc=Alloc(free_Y=jnp.arange(NP, dtype=jnp.int32)[::-1], top=jnp.int32(NP),
                    promised=jnp.int32(0)),
        prompts=Prompts(
            pages_PQ=jnp.full((P, Wq), NP, jnp.int32), ready_P=jnp.zeros((P,), bool),
            left_P=jnp.zeros((P,), jnp.int32).at[row_prompt_B].add(real_B.astype(jnp.int32)),
            taken_B=~real_B),
        prefill=Prefill(p=jnp.int32(-1), at=jnp.int32(0), owed=jnp.int32(0)),
        out=Outputs(tokens_BR=jnp.full((B, R), pad_id, jnp.int32),
                    logp_BR=jnp.zeros((B, R), jnp.float32),
                    sampling_logp_BR=jnp.zeros((B, R), jnp.float32),
                    mask_BR=jnp.zeros((B, R), bool), done_B=jnp.zeros((B,), bool)),
        counters=Counters(step=jnp.int32(0), busy=jnp.int32(0), peak_pages=jnp.int32(0),
                          live_at_peak=jnp.int32(0)),
        pool=PagePool.zeros(mc, NP, ps, model.dtype))

    def release_prompts(st: EngineState) -> EngineState:
        """Prompts whose rows have all finished give their pages back."""
        gone_P = st.prompts.ready_P & (st.prompts.left_P == 0)
        give_PQ = gone_P[:, None] & (st.prompts.pages_PQ < NP)
        free_Y, top = paging.push_pages(st.alloc.free_Y, st.alloc.top,
                                        st.prompts.pages_PQ.reshape(-1), give_PQ.reshape(-1))
        return _set(st, free_Y=free_Y, top=top,
                    pages_PQ=jnp.where(gone_P[:, None], NP, st.prompts.pages_PQ))

    def start_prefill(st: EngineState, p, need) -> EngineState:
        """Prompt p: ceil(n / ps) fresh pages for its n real tokens, and a promise of `need`
        pages (the budget of its first pending row) until its last chunk is in."""
        page_Q, top = paging.pop_pages(st.alloc.free_Y, st.alloc.top,
                                       jnp.arange(Wq) < qpages_P[p])
        return _set(st, top=top, pages_PQ=st.prompts.pages_PQ.at[p].set(page_Q), pf_p=p,
                    pf_at=jnp.int32(0), pf_owed=need, promised=st.alloc.promised + need)

    def prefill_chunk_step(st: EngineState) -> EngineState:
        """The next C real tokens of the prompt in prefill: their keys/values into its pages,
        from the first slot on (the bucket's left padding dropped); after its last chunk, its
        rows' first tokens from the last token's logits. A whole bucket (C = Tp) is one
        forward with the model's attention kernel (`attention.resolve`: splash, cudnn, ...);
        a chunk attends to the pages earlier chunks wrote (`paging.PagedChunk`)."""
        p, at = st.prefill.p, st.prefill.at
        row_T = lax.dynamic_index_in_dim(prompt_PT, p, 0, keepdims=False)
        if C == Tp:
            mask_1T = lax.dynamic_index_in_dim(pmask_PT, p, 0)
            x_1TD, (k_L1TKH, v_L1TKH) = model.forward(
                row_T[None], qwen.default_positions(mask_1T), model.full(mask_1T, keep_kv=True))
            # real token j (of n) is at bucket slot Tp - n + j; it goes to position j
            j_T = jnp.arange(Tp)
            src_T = jnp.clip(Tp - len_P[p] + j_T, 0, Tp - 1)
            st = _set(st, pool=st.pool.write_tokens(
                st.prompts.pages_PQ[p][None], j_T[None], (j_T < len_P[p])[None],
                k_L1TKH[:, :, src_T], v_L1TKH[:, :, src_T]))
            return finish_prefill(st, x_1TD[:, Tp - 1:])
        j_C = at + jnp.arange(C)
        valid_C = j_C < len_P[p]
        tok_C = row_T[jnp.clip(Tp - len_P[p] + j_C, 0, Tp - 1)]
        x_1CD, pool = model.forward(
            tok_C[None], j_C[None], paging.chunk_cache(st.pool, st.prompts.pages_PQ[p][None],
                                                       at[None],
                                                       valid_C[None], num_layers=L))
        st = _set(st, pool=pool, pf_at=at + C)
        last = jnp.clip(len_P[p] - 1 - at, 0, C - 1)  # the prompt's last token, if here
        return lax.cond(at + C >= len_P[p], finish_prefill, lambda st, x: st, st,
                        lax.dynamic_slice_in_dim(x_1CD, last, 1, axis=1))

    def finish_prefill(st: EngineState, x_11D) -> EngineState:
        p = st.prefill.p
        logits_1V = model.logits(x_11D)[:, 0]
        # its rows are contiguous: at most Gw from the first
        idx_G = jnp.searchsorted(row_prompt_B, p) + jnp.arange(Gw)
        cl_G = jnp.clip(idx_G, 0, B - 1)
        in_G = (idx_G < B) & (row_prompt_B[cl_G] == p) & real_B[cl_G]
        tok_G, logp_G, slogp_G = sampling.sample_logits(
            jnp.broadcast_to(logits_1V, (Gw, logits_1V.shape[-1])),
            _sample_keys(key, sid_B[cl_G], jnp.zeros((Gw,), jnp.int32)), config)
        rows_G = jnp.where(in_G, idx_G, B)  # B: dropped
        at0 = lambda buf, v: buf.at[rows_G, 0].set(v.astype(buf.dtype), mode="drop")
        eos_G = jnp.any(tok_G[:, None] == eos_E[None, :], -1)
        end_G = in_G & (eos_G | (budget_B[cl_G] <= 1))  # finished with their first token
        st = _set(
            st, ready_P=st.prompts.ready_P.at[p].set(True),
            left_P=st.prompts.left_P.at[p].add(-jnp.sum(end_G)),
            pf_p=jnp.int32(-1), pf_owed=jnp.int32(0), promised=st.alloc.promised - st.prefill.owed,
            taken_B=st.prompts.taken_B.at[jnp.where(end_G, idx_G, B)].set(True, mode="drop"),
            tokens_BR=at0(st.out.tokens_BR, tok_G), logp_BR=at0(st.out.logp_BR, logp_G),
            sampling_logp_BR=at0(st.out.sampling_logp_BR, slogp_G),
            mask_BR=at0(st.out.mask_BR, in_G),
            done_B=st.out.done_B.at[rows_G].set(eos_G, mode="drop"))
        return release_prompts(st)

    def cond(st: EngineState):
        return jnp.any(st.slots.sid_Z >= 0) | jnp.any(~st.prompts.taken_B)

    def body(st: EngineState) -> EngineState:
        # 1. prefill: with none in progress, start the prompt of the first pending row (in
        #    admission order) whose prompt is not ready, if the unpromised pages hold the
        #    prompt and that row's budget (promised to it until the prompt is in, so after any
        #    prefill one more sample can always start: no deadlock); then one chunk of it
        pend_O = ~st.prompts.taken_B[order_B]
        prompt_O = row_prompt_B[order_B]
        cold_O = pend_O & ~st.prompts.ready_P[prompt_O]
        first = jnp.argmax(cold_O)
        need = need_B[order_B[first]]
        go = (st.prefill.p < 0) & jnp.any(cold_O) & (
            st.alloc.top - st.alloc.promised >= qpages_P[prompt_O[first]] + need)
        st = lax.cond(go, start_prefill, lambda st, p, n: st, st, prompt_O[first], need)
        st = lax.cond(st.prefill.p >= 0, prefill_chunk_step, lambda st: st, st)
        # 2. admission: free slots, in slot order, take the next pending rows of ready
        #    prompts whose budgets the unpromised pages cover (a prefix of those rows)
        cand_O = ~st.prompts.taken_B[order_B] & st.prompts.ready_P[prompt_O]
        free_Z = st.slots.sid_Z < 0
        take_O = cand_O & (jnp.cumsum(cand_O) <= jnp.sum(free_Z))
        unpromised = st.alloc.top - st.alloc.promised
        take_O &= jnp.cumsum(jnp.where(take_O, need_B[order_B], 0)) <= unpromised
        row_Z = jnp.full((Z,), B, jnp.int32).at[
            jnp.where(take_O, jnp.cumsum(take_O) - 1, Z)].set(order_B, mode="drop")
        frank_Z = jnp.cumsum(free_Z) - 1
        new_Z = jnp.where(free_Z, row_Z[jnp.clip(frank_Z, 0, Z - 1)], B)
        admit_Z = new_Z < B
        cand_Z = jnp.minimum(new_Z, B - 1)
        sid_Z = jnp.where(admit_Z, new_Z, st.slots.sid_Z)
        t_Z = jnp.where(admit_Z, 1, st.slots.t_Z)
        tok_Z = jnp.where(admit_Z, st.out.tokens_BR[cand_Z, 0], st.slots.tok_Z)
        owed_Z = jnp.where(admit_Z, need_B[cand_Z], st.slots.owed_Z)
        promised = st.alloc.promised + jnp.sum(jnp.where(admit_Z, need_B[cand_Z], 0))
        taken_B = st.prompts.taken_B.at[new_Z].set(True, mode="drop")
        live_Z = sid_Z >= 0
        # 3. a page for slots whose token (at position v = prompt length + t - 1 of the
        #    sample's run) starts one, or that decode for the first time: their first page
        #    gets a copy of the prompt's partial last page
        p_Z = jnp.where(live_Z, row_prompt_B[jnp.maximum(sid_Z, 0)], 0)
        d_Z = t_Z - 1
        v_Z = len_P[p_Z] + d_Z
        full_Z = full_P[p_Z]
        own_Z = v_Z // ps - full_Z  # the slot's page that v falls in
        want_Z = live_Z & ((v_Z % ps == 0) | (d_Z == 0))
        page_Z, top = paging.pop_pages(st.alloc.free_Y, st.alloc.top, want_Z)
        slot_ix = jnp.arange(Z)
        pages_ZW = st.slots.pages_ZW.at[slot_ix, jnp.where(want_Z, own_Z, W)].set(page_Z,
                                                                               mode="drop")
        promised = promised - jnp.sum(want_Z)
        owed_Z = owed_Z - want_Z.astype(jnp.int32)
        copy_Z = want_Z & (d_Z == 0) & (tail_P[p_Z] > 0)

        def copy_tails(pool: PagePool) -> PagePool:
            base_L1 = jnp.arange(L)[:, None] * NP
            src_LZ = base_L1 + st.prompts.pages_PQ[p_Z, jnp.minimum(full_Z, Wq - 1)][None]
            dst_LZ = jnp.where(copy_Z[None], base_L1 + page_Z[None], L * NP)
            cp = lambda buf: buf.at[:, dst_LZ].set(buf[:, src_LZ], mode="drop")
            return PagePool(cp(pool.k), cp(pool.v))

        pool = lax.cond(jnp.any(copy_Z), copy_tails, lambda pool: pool, st.pool)
        # 4. decode the slots' last tokens: each writes its key/value at v, then attends to
        #    its run's first v + 1 tokens (the prompt's full pages, then its own), and
        #    samples its next token
        j_X = jnp.arange(X)
        table_ZX = jnp.where(
            j_X[None] < full_Z[:, None], st.prompts.pages_PQ[p_Z][:, jnp.minimum(j_X, Wq - 1)],
            jnp.take_along_axis(pages_ZW, jnp.clip(j_X[None] - full_Z[:, None], 0, W - 1), 1))
        w_page_S = jnp.where(live_Z, jnp.take_along_axis(
            pages_ZW, jnp.clip(own_Z, 0, W - 1)[:, None], 1)[:, 0], NP)
        x_Z1D, pool = model.forward(
            jnp.where(live_Z, tok_Z, pad_id)[:, None], jnp.where(live_Z, v_Z, 0)[:, None],
            paging.decode_cache(pool, table_ZX, jnp.where(live_Z, v_Z + 1, 1), w_page_S,
                                v_Z % ps, config=mc, dtype=model.dtype))
        logits_ZV = model.logits(x_Z1D)[:, 0]
        token_Z, logp_Z, slogp_Z = sampling.sample_logits(
            logits_ZV, _sample_keys(key, sid_B[jnp.maximum(sid_Z, 0)], t_Z), config)
        row_Z = jnp.where(live_Z, sid_Z, B)  # B: dropped
        at = lambda buf, v: buf.at[row_Z, t_Z].set(v.astype(buf.dtype), mode="drop")
        eos_Z = jnp.any(token_Z[:, None] == eos_E[None, :], -1)
        # 5. samples that end here free their slot, their pages and their unused promise;
        #    a prompt whose rows have all ended frees its pages
        end_Z = live_Z & (eos_Z | (t_Z + 1 >= budget_B[jnp.maximum(sid_Z, 0)]))
        give_ZW = end_Z[:, None] & (pages_ZW < NP)
        free_Y, top_after = paging.push_pages(st.alloc.free_Y, top, pages_ZW.reshape(-1),
                                              give_ZW.reshape(-1))
        held = NP - top  # pages held this step, before the ends give theirs back
        held_P = st.prompts.ready_P & (st.prompts.left_P > 0)
        live = (jnp.sum(jnp.where(live_Z, d_Z + 1, 0))  # tokens in them: decoded and prompts'
                + jnp.sum(jnp.where(held_P, len_P, 0))
                + jnp.where(st.prefill.p >= 0,
                            jnp.minimum(st.prefill.at, len_P[jnp.maximum(st.prefill.p, 0)]),
                            0))
        new_peak = held > st.counters.peak_pages
        st = _set(
            st, step=st.counters.step + 1, sid_Z=jnp.where(end_Z, -1, sid_Z),
            t_Z=jnp.where(live_Z, t_Z + 1, t_Z), tok_Z=jnp.where(live_Z, token_Z, tok_Z),
            pages_ZW=jnp.where(end_Z[:, None], NP, pages_ZW),
            owed_Z=jnp.where(end_Z, 0, owed_Z), free_Y=free_Y, top=top_after,
            promised=promised - jnp.sum(jnp.where(end_Z, owed_Z, 0)),
            left_P=st.prompts.left_P.at[jnp.where(end_Z, p_Z, P)].add(-1, mode="drop"),
            taken_B=taken_B, pool=pool,
            tokens_BR=at(st.out.tokens_BR, jnp.where(live_Z, token_Z, pad_id)),
            logp_BR=at(st.out.logp_BR, logp_Z),
            sampling_logp_BR=at(st.out.sampling_logp_BR, slogp_Z),
            mask_BR=at(st.out.mask_BR, live_Z),
            done_B=st.out.done_B.at[row_Z].set(eos_Z, mode="drop"),
            busy=st.counters.busy + jnp.sum(live_Z),
            peak_pages=jnp.maximum(st.counters.peak_pages, held),
            live_at_peak=jnp.where(new_peak, live, st.counters.live_at_peak))
        return release_prompts(st)

    st = lax.while_loop(cond, body, st)
    out, n = st.out, st.counters
    return dict(tokens=out.tokens_BR, logprobs=out.logp_BR, sampling_logprobs=out.sampling_logp_BR,
                mask=out.mask_BR, done=out.done_B, steps=n.step, busy_slot_steps=n.busy,
                peak_pages=n.peak_pages, live_at_peak=n.live_at_peak,
                pages_free_at_end=st.alloc.top)


@functools.cache
def engine_fn(graphdef, cs: CallShape, config, mesh):
    """The jitted engine call of the shape `cs` (`call_shape`): run(state, prompt_PT,
    prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E, pad_id) -> `engine_arrays`'
    dict, counters as [D] arrays (one per row device); one per (model structure, shape,
    settings, mesh).

    With a mesh, every argument but the state, key, EOS ids and pad id is split over the
    mesh's row axes (`sharding.row_axes`): each of the D row devices runs its own engine on
    its P / D prompt block and B / D rows (its own slots Z, pages NP, while loop), under a
    `shard_map` manual over those axes only: no collective inside the loop, and `tensor`
    (if the mesh has one) still splits heads and the MLP by XLA's partitioner. Weights are
    taken as given: hand over a decode copy (`decode_copy`) so none is gathered per call."""
    def local(state, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E,
              pad_id):
        TRACE_COUNTS[(cs, config)] += 1  # runs at trace time only
        out = engine_arrays(nnx.merge(graphdef, state), prompt_PT, prompt_mask_PT,
                            row_prompt_B, sid_B, budget_B, key, eos_E, pad_id, cs=cs,
                            config=config)
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
    return jax.jit(run)
