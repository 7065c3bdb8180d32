"""Packing a mini-batch's sequences into fixed [row devices, budget] blocks (host side).

A packed train step computes on real tokens: every row of the padded mini-batch (a
left-padded prompt bucket plus R response slots) becomes one sequence of its real tokens,
the prompt's and the response's up to its last scored token, and sequences are laid side
by side in rows of `budget` tokens (`grpo.max_tokens_per_device`), one row per row device
per micro-batch. What lives here is numpy only: each row's length (`sequence_lengths`),
the assignment of sequences to (micro-batch, device, offset) (`plan`: balanced
worst-fit-decreasing, or plain first-fit-decreasing for comparison), and the index arrays
a device gather turns into blocks (`block_indices`). The gathers, the packed forward and
the packed update are `packed.py`'s.

Layout of one sequence of prompt length p and r scored response tokens: its p + r - 1
input tokens (the prompt, then the response minus its last token) sit in one contiguous
run of a row with segment id 1, 2, ... along the row and positions restarting at 0; the
response token j is the target of input position p - 1 + j. Padding has segment id 0. A
row whose response scores nothing (an empty response) is left out: none of its tokens has
a weight, so no sum changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STRATEGIES = ("balanced", "ffd")


def max_segments(budget: int) -> int:
    """Static bound on the sequences one packed row may hold: the size of cuDNN's packed
    layout (`attention.Segments.max_segments`); the packer never puts more in a row."""
    return int(min(64, budget))


def attention_cost(num_layers: int, num_heads: int, head_dim: int, param_count: int) -> float:
    """Load units per (query, key) pair of causal attention, in tokens' worth of the
    dense matmuls: a sequence of L tokens costs L + cost * L^2 (forward FLOPs
    2 N L + 2 layers heads head_dim L^2 with the causal half counted)."""
    return float(num_layers * num_heads * head_dim) / float(max(param_count, 1))


def sequence_lengths(prompt_mask_BT: np.ndarray, mask_BR: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths p_B, scored response lengths r_B) of a padded mini-batch: p the
    prompt's real tokens (left-padded: a run at the right end), r one past the last
    response slot with a nonzero mask (0: the row scores nothing). ValueError naming a row
    whose prompt mask is not a right-aligned run or is empty."""
    pm = np.asarray(prompt_mask_BT) > 0
    Tp = pm.shape[1]
    p_B = pm.sum(1).astype(np.int64)
    right = pm[np.arange(len(pm))[:, None], Tp - 1 - np.arange(Tp)[None]]  # reversed rows
    bad = np.nonzero((p_B == 0) | (right.cumprod(1).sum(1) != p_B))[0]
    if len(bad):
        raise ValueError(f"row {bad[0]} of the batch: its prompt mask must be one non-empty "
                         "run of ones at the right end (a left-padded prompt)")
    m = np.asarray(mask_BR) != 0
    R = m.shape[1]
    r_B = np.where(m.any(1), R - np.argmax(m[:, ::-1], axis=1), 0).astype(np.int64)
    return p_B, r_B


def packed_lengths(p_B: np.ndarray, r_B: np.ndarray) -> np.ndarray:
    """Input tokens of each row's packed sequence: p + r - 1, 0 for an empty response."""
    return np.where(r_B > 0, p_B + r_B - 1, 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each row's sequence goes: micro-batch `block_B`, row device `device_B`, first
    token `offset_B` (-1 for rows left out), `num_blocks` micro-batches of `num_devices`
    rows, and the load (tokens + attention cost) of each (block, device)."""

    block_B: np.ndarray
    device_B: np.ndarray
    offset_B: np.ndarray
    num_blocks: int
    num_devices: int
    budget: int
    load_KD: np.ndarray  # float64 [num_blocks, num_devices]
    tokens_KD: np.ndarray  # int64 [num_blocks, num_devices]

    def with_blocks(self, n: int) -> Plan:
        """The same assignment in `n` >= num_blocks micro-batches (the extra ones empty):
        every process of a multi-host run runs the agreed count."""
        extra = n - self.num_blocks
        if extra < 0:
            raise ValueError(f"a plan of {self.num_blocks} blocks cannot shrink to {n}")

        def pad(a):
            return np.concatenate([a, np.zeros((extra, self.num_devices), a.dtype)])

        return dataclasses.replace(self, num_blocks=n, load_KD=pad(self.load_KD),
                                   tokens_KD=pad(self.tokens_KD))


def check_fits(lengths_B: np.ndarray, budget: int) -> None:
    """ValueError naming the first sequence longer than the budget (both numbers)."""
    over = np.nonzero(lengths_B > budget)[0]
    if len(over):
        b = over[0]
        raise ValueError(f"row {b}: a sequence of {int(lengths_B[b])} tokens does not fit "
                         f"config.grpo.max_tokens_per_device={budget}")


def plan(lengths_B: np.ndarray, num_devices: int, budget: int, *, attn_cost: float = 0.0,
         strategy: str = "balanced") -> Plan:
    """Assign sequences of `lengths_B` tokens (0: left out) to the fewest micro-batches of
    `num_devices` rows of `budget` tokens, at most `max_segments(budget)` per row.

    balanced: longest first, each into the least loaded row (tokens + attn_cost * L^2)
    that still has room, over every row of every micro-batch (balanced loads keep the
    devices in step within a micro-batch); where that leaves no room for a sequence, the
    first-fit-decreasing assignment of the same micro-batch count if it fits, else one
    more micro-batch. ffd: longest first into the first row with room (fewest rows; loads
    as they fall), for comparison.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"packing strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    L = np.asarray(lengths_B, np.int64)
    check_fits(L, budget)
    cost = L + attn_cost * L.astype(np.float64) ** 2
    order = np.lexsort((np.arange(len(L)), -cost))  # longest first, ties by row
    order = order[L[order] > 0]
    n = max(-(-int(L.sum()) // (num_devices * budget)), 1)
    tries = ("balanced", "ffd") if strategy == "balanced" else ("ffd",)
    while True:
        for how in tries:
            got = _assign(L, cost, order, n * num_devices, budget, max_segments(budget), how)
            if got is not None:
                break
        if got is not None:
            break
        n += 1
    where, offset, tok, load = got
    block = np.where(where >= 0, where // num_devices, -1)
    device = np.where(where >= 0, where % num_devices, -1)
    return Plan(block_B=block, device_B=device, offset_B=offset, num_blocks=n,
                num_devices=num_devices, budget=budget,
                load_KD=load.reshape(n, num_devices), tokens_KD=tok.reshape(n, num_devices))


def _assign(L, cost, order, bins: int, budget: int, seg_cap: int, how: str):
    """(bin of each row, its offset, tokens and load per bin), or None when a sequence
    finds no bin with room."""
    tok, load = np.zeros(bins, np.int64), np.zeros(bins)
    segs = np.zeros(bins, np.int64)
    where = np.full(len(L), -1, np.int64)
    offset = np.full(len(L), -1, np.int64)
    for i in order:
        room = (tok + L[i] <= budget) & (segs < seg_cap)
        if not room.any():
            return None
        j = (int(np.argmin(np.where(room, load, np.inf))) if how == "balanced"
             else int(np.argmax(room)))
        where[i], offset[i] = j, tok[j]
        tok[j] += L[i]
        load[j] += cost[i]
        segs[j] += 1
    return where, offset, tok, load


def block_indices(pl: Plan, p_B: np.ndarray, r_B: np.ndarray, prompt_len: int,
                  response_len: int, *, row_offset: int = 0) -> dict[str, np.ndarray]:
    """int32 index arrays [num_blocks, num_devices, budget] of the plan's blocks, into the
    padded mini-batch whose first row is global row `row_offset` (this process's rows):

    tok: flat index into the [rows, prompt_len + response_len] `[prompt | response]`
    tokens of each input token; resp: flat index into the [rows, response_len] response
    slots of each position's target (-1: the position scores nothing); row: the global
    row of each position's sequence (-1: padding); seg: segment id (0: padding); pos:
    position within the sequence.
    """
    K, D, S = pl.num_blocks, pl.num_devices, pl.budget
    W = prompt_len + response_len
    out = {k: np.full((K * D * S,), -1, np.int32) for k in ("tok", "resp", "row")}
    seg = np.zeros((K * D * S,), np.int32)
    pos = np.zeros((K * D * S,), np.int32)
    nseg = np.zeros((K * D,), np.int32)
    for b in np.nonzero(pl.block_B >= 0)[0]:
        p, r = int(p_B[b]), int(r_B[b])
        n = p + r - 1
        slot = int(pl.block_B[b]) * D + int(pl.device_B[b])
        start = slot * S + int(pl.offset_B[b])
        t = np.arange(n)
        g = row_offset + b
        out["tok"][start:start + n] = g * W + prompt_len - p + t
        out["resp"][start + p - 1:start + n] = g * response_len + np.arange(r)
        out["row"][start:start + n] = g
        nseg[slot] += 1
        seg[start:start + n] = nseg[slot]
        pos[start:start + n] = t
    out.update(seg=seg, pos=pos)
    return {k: v.reshape(K, D, S) for k, v in out.items()}


def imbalance(load_KD: np.ndarray) -> float:
    """Sum over micro-batches of the most loaded device's load over that of the mean load:
    devices wait for the slowest one in every micro-batch, so this is the packed step's time
    over a perfectly balanced one's (1.0: balanced)."""
    mean = load_KD.mean(axis=1).sum()
    return float(load_KD.max(axis=1).sum() / mean) if mean > 0 else 1.0
