"""A request queue in front of the rollout engine, for sampling many prompts (evaluation).

Lives here: `Engine` — `add` prompts (requests, each with its own token budget), `step` runs
one engine call on the next queued prompts of one prompt bucket and returns the requests it
finished, `drain` steps until the queue is empty — and `Completion`, one request's samples.
Not here: the jitted engine and its paged cache (engine.py), the sampling math (sampler.py).

Shapes: every call has the same `prompts_per_call` prompts (the last call of a bucket is
padded with one-token-budget copies, dropped) and the same width `max_new_tokens`, so one
program compiles per prompt bucket. Inside a call the engine's slots take the call's
samples as others finish (continuous batching); a call is one host round trip: its
outputs come back once, when its last sample ends.

RNG: sample g of request r draws its token t with key fold_in(fold_in(key, r*G + g), t), so
a request's samples do not depend on which call it landed in, on the other requests, on
`prompts_per_call`, slots, pages or devices.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ba_jax import engine, sampler


@dataclasses.dataclass
class Completion:
    """The G samples of one request, on the host; R = the engine's `max_new_tokens`."""

    request_id: int
    prompt: list[int]
    tokens: np.ndarray  # int32 [G, R]: pad id after a sample ends
    logprobs: np.ndarray  # float32 [G, R]: temperature-1 log-probs, 0 where masked
    mask: np.ndarray  # int32 [G, R]
    lengths: np.ndarray  # int32 [G]
    finish_reason: np.ndarray  # object [G]: "eos" or "length"


class Engine:
    """Queue of prompts sampled `num_samples` times each through `engine.run_call`.

    `prompts_per_call` prompts of one bucket go into each call (memory: their prompt caches
    and pages; see `engine.call_shape` for `num_slots`, `page_size`, `num_pages`,
    `prefill_chunk`). With `mesh`
    the rows of a call are split over its (data, fsdp) devices; hand it decode weights
    (`engine.decode_copy`). Settings that cannot run are a ValueError here, not mid-queue.
    """

    def __init__(self, model: Any, *, num_samples: int, max_new_tokens: int, key: jax.Array,
                 eos_ids: Sequence[int], pad_id: int | None = None, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, prompts_per_call: int = 32,
                 num_slots: int = 0, page_size: int = 16, num_pages: int = 0,
                 prefill_chunk: int = 512, mesh: Mesh | None = None):
        self.model, self.key, self.mesh = model, key, mesh
        self.G, self.R, self.Pc = int(num_samples), int(max_new_tokens), int(prompts_per_call)
        if self.G < 1 or self.R < 1 or self.Pc < 1:
            raise ValueError(f"num_samples={num_samples}, max_new_tokens={max_new_tokens} and "
                             f"prompts_per_call={prompts_per_call} must be >= 1")
        self.eos, self.pad, self.config, _, _ = sampler.prepare_request(
            [[0]], eos_ids, pad_id, temperature, top_k, top_p)
        self.options = dict(num_slots=num_slots, page_size=page_size, num_pages=num_pages,
                            prefill_chunk=prefill_chunk)
        self.check(16)  # raises now for a pool too small for the smallest bucket, bad slots
        self.queue: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.requests: dict[int, tuple[list[int], int]] = {}
        self.calls = 0

    def add(self, prompt: Sequence[int], *, max_new_tokens: int | None = None) -> int:
        """Queue one prompt (token ids) -> its request id (0, 1, ... in order of adding).
        `max_new_tokens`: this request's budget, at most the engine's (the default)."""
        budget = self.R if max_new_tokens is None else int(max_new_tokens)
        if not prompt or not 1 <= budget <= self.R:
            raise ValueError(f"a request needs >= 1 prompt token and 1 <= max_new_tokens <= "
                             f"{self.R}; got {len(prompt)} tokens, budget {budget}")
        self.check(sampler.prompt_bucket(len(prompt)))  # before anything of it is queued
        rid = len(self.requests)
        self.requests[rid] = ([int(t) for t in prompt], budget)
        self.queue[sampler.prompt_bucket(len(prompt))].append(rid)
        return rid

    def check(self, prompt_len: int) -> None:
        """ValueError unless a call of prompts in the bucket `prompt_len` can run."""
        engine.call_shape(self.Pc, prompt_len, self.G, self.R,
                          num_devices=engine.row_devices(self.mesh), **self.options)

    @property
    def pending(self) -> int:
        """Requests queued and not yet sampled."""
        return sum(len(q) for q in self.queue.values())

    def step(self) -> list[Completion]:
        """One engine call on up to `prompts_per_call` queued requests of the bucket whose
        oldest request is oldest -> their completions (empty when nothing is queued)."""
        live = {b: q for b, q in self.queue.items() if q}
        if not live:
            return []
        bucket = min(live, key=lambda b: live[b][0])
        q = live[bucket]
        rids = [q.popleft() for _ in range(min(self.Pc, len(q)))]
        prompts = [self.requests[r][0] for r in rids]
        budgets = [self.requests[r][1] for r in rids]
        n_pad = self.Pc - len(rids)  # a fixed P: copies of the last prompt, budget 1
        prompt_PT, pmask_PT = sampler.left_pad(prompts + [prompts[-1]] * n_pad, bucket, self.pad)
        G = self.G
        budget_B = np.repeat(np.array(budgets + [1] * n_pad, np.int32), G)
        sid_B = (np.repeat(np.array(rids + [-1] * n_pad), G) * G
                 + np.tile(np.arange(G), self.Pc)).astype(np.int32)
        out, _ = engine.run_call(self.model, prompt_PT, pmask_PT, budget_B, sid_B, self.key,
                                 num_samples=G, config=self.config, eos_E=self.eos,
                                 pad_id=self.pad, mesh=self.mesh, width=self.R,
                                 **self.options)
        self.calls += 1
        done = []
        for i, rid in enumerate(rids):
            rows = slice(i * G, (i + 1) * G)
            mask = np.asarray(out["mask"][rows], np.int32)
            done.append(Completion(
                request_id=rid, prompt=prompts[i], tokens=np.asarray(out["tokens"][rows]),
                logprobs=np.asarray(out["logprobs"][rows]), mask=mask,
                lengths=mask.sum(1).astype(np.int32),
                finish_reason=np.where(out["done"][rows], "eos", "length").astype(object)))
        return done

    def drain(self) -> dict[int, Completion]:
        """Steps until the queue is empty -> every completion of those steps by request id."""
        done: dict[int, Completion] = {}
        while self.pending:
            done.update((c.request_id, c) for c in self.step())
        return done
