"""Host-side shape planning of an engine call: rows over devices, slots, pages, counters.

Lives here: `RowLayout` / `row_layout` (which rows and prompts each row device holds),
`CallShape` / `call_shape` (the static shape of one call, its compile key; settings that
cannot run are a ValueError here, before anything runs: the one pool rule the trainer's
validation and the planner also call), `EngineStats` (a call's counters). Not here: the
jitted loop (`loop.py`), the pool (`paging.py`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import Mesh

from ba_jax import sharding
from ba_jax.engine.paging import pages_for, prompt_pages


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


class PoolTooSmall(ValueError):
    """A pool that cannot hold one sequence of the largest budget beside its prompt."""


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
        raise PoolTooSmall(f"num_pages={num_pages} of {ps} tokens over {D} row device(s) gives "
                         f"each {NPd}: cannot hold one sequence of the largest budget {R} "
                         f"({largest} pages) beside its prompt ({Wq} pages of a "
                         f"{prompt_len}-token bucket)")
    chunk = min(int(prefill_chunk), int(prompt_len)) if prefill_chunk else int(prompt_len)
    return CallShape(Pd, prompt_len, lay.rows_per_device, R, Sd, ps, NPd,
                     min(num_samples, lay.rows_per_device), chunk)


def stats_of(out: dict, cs: CallShape, D: int) -> EngineStats:
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
