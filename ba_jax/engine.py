"""The rollout engine: continuous batching of a call's samples over a paged KV cache.

Lives here: `generate(...)` (what `sampler.generate` runs: its contract plus per-row budgets,
slots and pages; it returns a `sampler.Rollout`), `run_call` (one call on padded prompts with
given sample ids, what `engine_queue` steps with), the jitted program under them, the row
layout over devices and `decode_copy` (the weights a call decodes with). Not here: the
sampling math (`sampler.sample_logits`), the model's paged decode step
(`qwen.Qwen.decode_step_paged`), the kernel seam, the request queue (`engine_queue`).

How one call runs, all inside one jitted function (one host round trip: the outputs come
back when the call's last sample ends):
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
With a mesh, the call's rows are cut into D blocks over the (data, fsdp) devices
(`row_layout`) and each device runs steps 1-3 on its own block, prompts, slots and pool
(`engine_fn`: a shard_map manual over those axes; no collective inside the loop).
RNG: the token at position t of sample s (its row in the call, or the id `run_call` is
given) is drawn with key fold_in(fold_in(key, s), t): the same rollouts whatever the slot
count, page size, admission order, devices or processes. Greedy decoding and the
temperature-1 log-probs are the static sampler's (same model code, same `sample_logits`);
the draws themselves differ from `sampler.generate_static`'s (its key is per step, shared
by the rows).

Attention reads the slot's prompt row plus its W = ceil((R_max - 1) / page) page slots,
masked to the ones it holds (a gather-based pure-JAX paged attention; fixed shapes).
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
    """Carry of the engine's decode loop; S slots, B = P*G samples, NP pages, W pages/slot."""

    step: jax.Array  # int32 []: loop iterations so far
    next_i: jax.Array  # int32 []: position in the admission order of the next pending sample
    sid_S: jax.Array  # int32 [S]: row (of this engine's B) held by the slot, -1 when free
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


def engine_arrays(model, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, *,
                  max_new_tokens: int, num_slots: int, page_size: int, num_pages: int,
                  config: sampler.SamplingConfig, eos_E, pad_id) -> dict[str, jax.Array]:
    """Traceable body of one engine (one device's share under a mesh) -> dict of [B, R] arrays
    and the loop's counters (`steps`, `busy_slot_steps`, `peak_pages`, ...).

    Row b samples from prompt `row_prompt_B[b]` of the P left-padded prompts, with the keys
    of sample id `sid_B[b]` (its row in the whole call) and at most `budget_B[b]` tokens."""
    (P, Tp), R = prompt_PT.shape, max_new_tokens
    B, S, ps, NP = row_prompt_B.shape[0], num_slots, page_size, num_pages
    W = max(pages_for(R, ps), 1)
    mc = model.config
    pmask_PT = prompt_mask_PT.astype(jnp.int32)
    positions_PT = jnp.maximum(jnp.cumsum(pmask_PT, 1) - 1, 0)
    logits_P1V, prompt = model(prompt_PT, positions_PT, pmask_PT,
                               logits_slice=slice(Tp - 1, None), return_kv=True)
    len_P = jnp.sum(pmask_PT, 1)
    tok0, logp0, slogp0 = sampler.sample_logits(
        logits_P1V[row_prompt_B, 0], _sample_keys(key, sid_B, jnp.zeros_like(sid_B)), config)
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
        p_S = jnp.where(live_S, row_prompt_B[jnp.maximum(sid_S, 0)], 0)
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
            logits_SV, _sample_keys(key, sid_B[jnp.maximum(sid_S, 0)], t_S), config)
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
TRACE_COUNTS: Counter = Counter()  # traces per compile key; a test checks calls do not retrace


def engine_fn(graphdef, P, Tp, B, R, S, ps, NP, config, mesh):
    """The jitted engine call: run(state, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B,
    budget_B, key, eos_E, pad_id) -> `engine_arrays`' dict, counters as [D] arrays (one per
    row device); one per (model structure, shapes, settings, mesh).

    With a mesh, every argument but the state, key, EOS ids and pad id is split over the
    mesh's row axes (`sharding.row_axes`): each of the D row devices runs its own engine on
    its P / D prompt block and B / D rows (its own slots S, pages NP, while loop), under a
    `shard_map` manual over those axes only: no collective inside the loop, and `tensor`
    (if the mesh has one) still splits heads and the MLP by XLA's partitioner. Weights are
    taken as given: hand over a decode copy (`decode_copy`) so none is gathered per call."""
    k = (graphdef, P, Tp, B, R, S, ps, NP, config, mesh)
    if k not in _JITTED:
        def local(state, prompt_PT, prompt_mask_PT, row_prompt_B, sid_B, budget_B, key, eos_E,
                  pad_id):
            TRACE_COUNTS[k[1:-1]] += 1  # runs at trace time only
            out = engine_arrays(nnx.merge(graphdef, state), prompt_PT, prompt_mask_PT,
                                row_prompt_B, sid_B, budget_B, key, max_new_tokens=R,
                                num_slots=S, page_size=ps, num_pages=NP, config=config,
                                eos_E=eos_E, pad_id=pad_id)
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
    fn = functools.partial(grpo.compute_copy, dtype=dtype)
    if mesh is None:
        return jax.jit(fn)(params)
    return jax.jit(fn, out_shardings=sharding.decode_shardings(params, mesh))(params)


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


def call_shape(num_prompts: int, prompt_len: int, num_samples: int, max_new_tokens: int, *,
               num_slots: int = 0, page_size: int = 16, num_pages: int = 0,
               num_devices: int = 1) -> CallShape:
    """The shape of a call of P prompts x G samples on D row devices: each device gets
    ceil(num_slots / D) slots (0: a quarter of its rows) and ceil(num_pages / D) pages (0:
    every slot's largest budget at once). ValueError before anything runs for settings
    that cannot run: slots or page size < 1, a device pool too small for one sequence of
    the largest budget."""
    S, ps = int(num_slots), int(page_size)
    if S < 0 or ps < 1:
        raise ValueError(f"num_slots={num_slots} must be >= 0 and page_size={page_size} >= 1")
    lay = row_layout(num_prompts, num_samples, num_devices)
    D, R = num_devices, int(max_new_tokens)
    Sd = -(-S // D) if S else default_slots(lay.rows_per_device)
    largest = pages_for(R, ps)
    NPd = -(-int(num_pages) // D) if num_pages else max(Sd * largest, 1)
    if NPd < largest:
        raise ValueError(f"num_pages={num_pages} of {ps} tokens over {D} row device(s) gives "
                         f"each {NPd}: cannot hold one sequence of the largest budget {R} "
                         f"({largest} pages)")
    return CallShape(lay.prompts_per_device, prompt_len, lay.rows_per_device, R, Sd, ps, NPd)


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
    mesh: Mesh | None = None,
    return_stats: bool = False,
):
    """`sampler.generate`'s contract through the engine -> `sampler.Rollout` (and
    `EngineStats` with `return_stats`). `max_new_tokens`: an int, one budget per prompt or
    one per row; the Rollout's arrays are as wide as the largest. With `mesh`, rows are split
    over its (data, fsdp) axes, each device running its own engine (`engine_fn`);
    `num_slots` and `num_pages` are the call's, split evenly (`call_shape`). Bad settings are
    a ValueError before anything runs."""
    eos, pad, config, prompt_PT, pmask_PT = sampler.prepare_request(
        prompts, eos_ids, pad_id, temperature, top_k, top_p)
    P, G = len(prompts), int(num_samples)
    budget_B = row_budgets(max_new_tokens, P, G)
    out, st = run_call(model, prompt_PT, pmask_PT, budget_B, np.arange(P * G, dtype=np.int32),
                       key, num_samples=G, config=config, eos_E=eos, pad_id=pad,
                       num_slots=num_slots, page_size=page_size, num_pages=num_pages, mesh=mesh)
    ro = sampler.to_rollout(out, prompt_PT, pmask_PT, G)
    return (ro, st) if return_stats else ro


def run_call(model, prompt_PT: np.ndarray, prompt_mask_PT: np.ndarray, budget_B: np.ndarray,
             sid_B: np.ndarray, key, *, num_samples: int, config: sampler.SamplingConfig,
             eos_E: np.ndarray, pad_id: int, num_slots: int = 0, page_size: int = 16,
             num_pages: int = 0, mesh: Mesh | None = None,
             width: int = 0) -> tuple[dict, EngineStats]:
    """One engine call on P left-padded prompts x G samples -> (host arrays of the P*G rows:
    `sampler.ROLLOUT_ARRAYS`, EngineStats). Row b's tokens are drawn with the keys of sample
    id `sid_B[b]`, so a request keeps its draws whatever call it lands in. The rows are
    `width` wide (0: the largest budget; a fixed width compiles once whatever the budgets)."""
    P, G = len(prompt_PT), int(num_samples)
    D = row_devices(mesh)
    cs = call_shape(P, prompt_PT.shape[1], G, max(int(width), int(budget_B.max())),
                    num_slots=num_slots, page_size=page_size, num_pages=num_pages, num_devices=D)
    lay = row_layout(P, G, D)
    pad_rows = D * lay.rows_per_device - lay.rows
    budget_Bp = np.concatenate([budget_B, np.ones(pad_rows, np.int32)]).astype(np.int32)
    sid_Bp = np.concatenate([sid_B, np.full(pad_rows, -1)]).astype(np.int32)
    graphdef, state = nnx.split(model)
    run = engine_fn(graphdef, cs.prompts_per_device, cs.prompt_len, cs.rows_per_device,
                    cs.max_new_tokens, cs.slots_per_device, cs.page_size, cs.pages_per_device,
                    config, mesh)
    out = jax.device_get(run(state, prompt_PT[lay.prompt_index],
                             prompt_mask_PT[lay.prompt_index], lay.row_prompt, sid_Bp, budget_Bp,
                             key, eos_E, np.int32(pad_id)))
    return {n: out[n][:lay.rows] for n in sampler.ROLLOUT_ARRAYS}, _stats(out, cs, D)
