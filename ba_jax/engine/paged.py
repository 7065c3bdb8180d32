"""The in-house paged rollout engine as the `RolloutEngine` the trainer and evaluation hold.

Lives here: `PagedEngine` (`sync` hands over a compute-dtype decode copy of the weights,
`generate` samples, `close`). Not here: one call's host side (`call.py`), the jitted loop
(`loop.py`), the pool and cache modes (`paging.py`), shapes (`shapes.py`), the request
queue (`queue.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from ba_jax import distributed
from ba_jax.engine import call, queue, shapes
from ba_jax.rollout import EngineSettings, Rollout, SamplingSettings


class PagedEngine:
    """The in-house engine as a `rollout.RolloutEngine`.

    `sync(params)` makes the decode copy (`call.decode_copy`, on the training `mesh`) and hands it
    to the devices that sample (`sample_mesh`: the mesh itself, or under multi-host this
    process's devices, `distributed.local_mesh`); `generate` samples from it: in one call,
    or, with `settings.prompts_per_call`, in calls of that many prompts of one bucket (the
    request queue, `queue.RequestQueue`: one compile per bucket for many prompts). A sample's
    draws depend only on its row and `key`, whichever way it ran."""

    def __init__(self, graphdef: Any, settings: EngineSettings, *, dtype,
                 mesh: Mesh | None = None, sample_mesh: Mesh | None = None):
        self.graphdef, self.settings, self.dtype = graphdef, settings, dtype
        self.mesh = mesh
        self.sample_mesh = mesh if sample_mesh is None else sample_mesh
        self.model: Any = None
        self.last_stats: shapes.EngineStats | None = None

    def sync(self, params: Any) -> float:
        t0 = time.perf_counter()
        copy = jax.block_until_ready(call.decode_copy(params, self.mesh, self.dtype))
        self.model = nnx.merge(self.graphdef, distributed.to_local(copy, self.sample_mesh))
        return time.perf_counter() - t0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 key: jax.Array) -> Rollout:
        if self.model is None:
            raise RuntimeError("PagedEngine.generate before sync: hand it the weights first")
        ppc = self.settings.prompts_per_call
        if ppc and len(prompts) > ppc:
            return queue.RequestQueue(self.model, sampling, key, self.settings,
                                      mesh=self.sample_mesh).sample_all(prompts)
        ro, self.last_stats = call.generate(self.model, prompts, sampling, key, self.settings,
                                       mesh=self.sample_mesh, return_stats=True)
        return ro

    def release(self) -> None:
        """Drop the decode copy until the next `sync` (the update needs the memory)."""
        self.model = None

    def close(self) -> None:
        self.model = None
