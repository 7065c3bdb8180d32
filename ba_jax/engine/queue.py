"""A request queue in front of the engine, for sampling many prompts (evaluation).

Lives here: `RequestQueue` — `add` prompts (requests, each with its own token budget),
`step` runs one engine call on the next queued prompts of one prompt bucket and returns the
requests it finished, `drain` steps until the queue is empty, `sample_all` does all of it
for a list of prompts and returns one Rollout — and `Completion`, one request's samples.
Not here: one call (`call.py`), the jitted loop (`loop.py`).

Shapes: every call has the same `settings.prompts_per_call` prompts (the last call of a
bucket is padded with one-token-budget copies, dropped) and the same width (the sampling
settings' largest budget), so one program compiles per prompt bucket. Inside a call the
engine's slots take the call's samples as others finish (continuous batching).

RNG: sample g of request r draws its token t with key fold_in(fold_in(key, r*G + g), t), so
a request's samples do not depend on which call it landed in, on the other requests, on
`prompts_per_call`, slots, pages or devices (and equal `call.generate`'s for the same rows).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ba_jax.engine import call, shapes
from ba_jax.rollout import (
    EngineSettings,
    Rollout,
    SamplingSettings,
    left_pad,
    prompt_bucket,
    to_rollout,
)

DEFAULT_PROMPTS_PER_CALL = 32


@dataclasses.dataclass
class Completion:
    """The G samples of one request, on the host; R = the queue's width."""

    request_id: int
    prompt: list[int]
    tokens: np.ndarray  # int32 [G, R]: pad id after a sample ends
    logprobs: np.ndarray  # float32 [G, R]: temperature-1 log-probs, 0 where masked
    sampling_logprobs: np.ndarray  # float32 [G, R]: under the sampling distribution
    mask: np.ndarray  # int32 [G, R]
    lengths: np.ndarray  # int32 [G]
    finish_reason: np.ndarray  # object [G]: "eos" or "length"


class RequestQueue:
    """Queue of prompts sampled `sampling.num_samples` times each through `call.run_call`,
    `settings.prompts_per_call` prompts of one bucket per call (0: 32). With `mesh` the rows
    of a call are split over its (data, fsdp) devices; hand it decode weights
    (`call.decode_copy`). Settings that cannot run are a ValueError here, not mid-queue."""

    def __init__(self, model: Any, sampling: SamplingSettings, key: jax.Array,
                 settings: EngineSettings | None = None, *, mesh: Mesh | None = None):
        if not isinstance(sampling.max_new_tokens, int):
            raise ValueError("a queue's sampling settings take one max_new_tokens (the width); "
                             "give each request its budget in `add`")
        settings = settings or EngineSettings()
        self.model, self.key, self.mesh = model, key, mesh
        self.sampling, self.settings = sampling, settings
        self.G, self.R = int(sampling.num_samples), int(sampling.max_new_tokens)
        self.Pc = int(settings.prompts_per_call) or DEFAULT_PROMPTS_PER_CALL
        if self.R < 1:
            raise ValueError(f"max_new_tokens={self.R} must be >= 1")
        self.check(16)  # raises now for a pool too small for the smallest bucket, bad slots
        self.queue: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.requests: dict[int, tuple[list[int], int]] = {}
        self.calls = 0

    def add(self, prompt: Sequence[int], *, max_new_tokens: int | None = None) -> int:
        """Queue one prompt (token ids) -> its request id (0, 1, ... in order of adding).
        `max_new_tokens`: this request's budget, at most the queue's width (the default)."""
        budget = self.R if max_new_tokens is None else int(max_new_tokens)
        if not prompt or not 1 <= budget <= self.R:
            raise ValueError(f"a request needs >= 1 prompt token and 1 <= max_new_tokens <= "
                             f"{self.R}; got {len(prompt)} tokens, budget {budget}")
        self.check(prompt_bucket(len(prompt)))  # before anything of it is queued
        rid = len(self.requests)
        self.requests[rid] = ([int(t) for t in prompt], budget)
        self.queue[prompt_bucket(len(prompt))].append(rid)
        return rid

    def check(self, prompt_len: int) -> None:
        """ValueError unless a call of prompts in the bucket `prompt_len` can run."""
        s = self.settings
        shapes.call_shape(self.Pc, prompt_len, self.G, self.R, num_slots=s.num_slots,
                          page_size=s.page_size, num_pages=s.num_pages,
                          num_devices=shapes.row_devices(self.mesh),
                          prefill_chunk=s.prefill_chunk)

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
        prompt_PT, pmask_PT = left_pad(prompts + [prompts[-1]] * n_pad, bucket,
                                       self.sampling.pad)
        G = self.G
        budget_B = np.repeat(np.array(budgets + [1] * n_pad, np.int32), G)
        sid_B = (np.repeat(np.array(rids + [-1] * n_pad), G) * G
                 + np.tile(np.arange(G), self.Pc)).astype(np.int32)
        out, _ = call.run_call(self.model, prompt_PT, pmask_PT, budget_B, sid_B, self.key,
                               self.sampling, self.settings, mesh=self.mesh, width=self.R)
        self.calls += 1
        done = []
        for i, rid in enumerate(rids):
            rows = slice(i * G, (i + 1) * G)
            mask = np.asarray(out["mask"][rows], np.int32)
            done.append(Completion(
                request_id=rid, prompt=prompts[i], tokens=np.asarray(out["tokens"][rows]),
                logprobs=np.asarray(out["logprobs"][rows]),
                sampling_logprobs=np.asarray(out["sampling_logprobs"][rows]), mask=mask,
                lengths=mask.sum(1).astype(np.int32),
                finish_reason=np.where(out["done"][rows], "eos", "length").astype(object)))
        return done

    def drain(self) -> dict[int, Completion]:
        """Steps until the queue is empty -> every completion of those steps by request id."""
        done: dict[int, Completion] = {}
        while self.pending:
            done.update((c.request_id, c) for c in self.step())
        return done

    def sample_all(self, prompts: Sequence[Sequence[int]]) -> Rollout:
        """Every prompt queued and sampled -> one Rollout in prompt order (prompts padded to
        the largest bucket among them)."""
        first = len(self.requests)
        for p in prompts:
            self.add(p)
        done = self.drain()
        comps = [done[first + i] for i in range(len(prompts))]
        width = max(prompt_bucket(len(p)) for p in prompts)
        prompt_PT, pmask_PT = left_pad(prompts, width, self.sampling.pad)
        out = {n: np.concatenate([getattr(c, n) for c in comps])
               for n in ("tokens", "logprobs", "sampling_logprobs", "mask")}
        out["done"] = np.concatenate([c.finish_reason == "eos" for c in comps])
        return to_rollout(out, prompt_PT, pmask_PT, self.G)
