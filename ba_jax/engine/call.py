"""One engine call from the host: the decode copy of the weights, padded prompts in, Rollout out.

Lives here: `decode_copy` (the weights a call decodes with), `run_call` (one engine call on
padded prompts with given sample ids: what the request queue steps with) and `generate` (one
sampling request in one call: what `sampler.generate` runs). Not here: the jitted loop
(`loop.py`), the engine object the trainer holds (`paged.py`), the queue (`queue.py`).

With a mesh, a call's rows are cut into D blocks over the (data, fsdp) devices
(`shapes.row_layout`) and each device runs its own engine on its own block, prompts, slots
and pool (`loop.engine_fn`: a shard_map manual over those axes; no collective in the loop).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ba_jax import grpo, sharding
from ba_jax.engine import loop, shapes
from ba_jax.rollout import (
    ROLLOUT_ARRAYS,
    EngineSettings,
    SamplingSettings,
    prompt_arrays,
    to_rollout,
)


@functools.cache
def _copy_fn(dtype, mesh: Mesh | None, treedef, leaf_shapes: tuple) -> Any:
    """The jitted decode copy of one parameter layout (a step never retraces it)."""
    fn = functools.partial(grpo.compute_copy, dtype=dtype)
    if mesh is None:
        return jax.jit(fn)
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, np.float32)
                                            for s in leaf_shapes])
    return jax.jit(fn, out_shardings=sharding.decode_shardings(abstract, mesh))


def decode_copy(params: Any, mesh: Mesh | None, dtype) -> Any:
    """The weights the engine decodes with, handed over once per call or RL step: matrices in
    the compute `dtype` (`grpo.compute_copy`), laid out for decoding on `mesh`
    (`sharding.decode_shardings`: whole on every row device, split over `tensor`). The cast
    runs on each device's shard before the gather, so a bf16 run moves bf16 bytes; the copy
    is a fresh buffer (the trainer's state is donated to its update). Without a mesh: the
    compute-dtype copy where the parameters are."""
    leaves, treedef = jax.tree.flatten(params)
    fn = _copy_fn(np.dtype(dtype), mesh, treedef, tuple(x.shape for x in leaves))
    return fn(params)


def run_call(model, prompt_PT: np.ndarray, prompt_mask_PT: np.ndarray, budget_B: np.ndarray,
             sid_B: np.ndarray, key, sampling: SamplingSettings, settings: EngineSettings, *,
             mesh: Mesh | None = None, width: int = 0) -> tuple[dict, shapes.EngineStats]:
    """One engine call on P left-padded prompts x G samples -> (host arrays of the P*G rows:
    `rollout.ROLLOUT_ARRAYS`, EngineStats). Row b's tokens are drawn with the keys of sample
    id `sid_B[b]`, so a request keeps its draws whatever call it lands in. The rows are
    `width` wide (0: the largest budget; a fixed width compiles once whatever the budgets)."""
    P, G = len(prompt_PT), int(sampling.num_samples)
    D = shapes.row_devices(mesh)
    cs = shapes.call_shape(P, prompt_PT.shape[1], G, max(int(width), int(budget_B.max())),
                           num_slots=settings.num_slots, page_size=settings.page_size,
                           num_pages=settings.num_pages, num_devices=D,
                           prefill_chunk=settings.prefill_chunk)
    lay = shapes.row_layout(P, G, D)
    pad_rows = D * lay.rows_per_device - lay.rows
    budget_Bp = np.concatenate([budget_B, np.ones(pad_rows, np.int32)]).astype(np.int32)
    sid_Bp = np.concatenate([sid_B, np.full(pad_rows, -1)]).astype(np.int32)
    graphdef, state = nnx.split(model)
    run = loop.engine_fn(graphdef, cs, sampling.draw, mesh)
    out = jax.device_get(run(state, prompt_PT[lay.prompt_index],
                             prompt_mask_PT[lay.prompt_index], lay.row_prompt, sid_Bp, budget_Bp,
                             key, np.asarray(sampling.eos_ids, np.int32),
                             np.int32(sampling.pad)))
    return {n: out[n][:lay.rows] for n in ROLLOUT_ARRAYS}, shapes.stats_of(out, cs, D)


def generate(model: Any, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
             key: jax.Array, settings: EngineSettings | None = None, *,
             mesh: Mesh | None = None, return_stats: bool = False):
    """G samples per prompt through the engine -> Rollout (and `EngineStats` with
    `return_stats`), in one call (`settings.prompts_per_call` is the queue's: `PagedEngine`).
    The Rollout's arrays are as wide as the largest budget. With `mesh`, rows are split over
    its (data, fsdp) axes, each device running its own engine; slots and pages are the call's,
    split evenly. Bad settings are a ValueError before anything runs."""
    settings = settings or EngineSettings()
    prompt_PT, pmask_PT = prompt_arrays(prompts, sampling.pad)
    P, G = len(prompts), int(sampling.num_samples)
    budget_B = sampling.row_budgets(P)
    out, st = run_call(model, prompt_PT, pmask_PT, budget_B, np.arange(P * G, dtype=np.int32),
                       key, sampling, settings, mesh=mesh)
    ro = to_rollout(out, prompt_PT, pmask_PT, G)
    return (ro, st) if return_stats else ro
