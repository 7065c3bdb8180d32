"""The public sampling call: `generate(model, prompts, ...) -> Rollout` (a contract).

Lives here: `generate`, the keyword-argument form of a sampling request, run by the in-house
paged engine in one call (`engine.call.generate`). Not here: the engine (`engine/`), the
sampling math (`sampling.py`), the Rollout and the settings (`rollout.py`, re-exported here
as the names the contract returns), the rollout interface the trainer holds
(`rollout.RolloutEngine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ba_jax.engine import call
from ba_jax.rollout import EngineSettings, Rollout, SamplingSettings, prompt_bucket

__all__ = ["Rollout", "generate", "prompt_bucket"]


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
    mesh: Mesh | None = None,
    return_stats: bool = False,
    **engine_options: Any,
) -> Rollout:
    """Samples `num_samples` responses per prompt (temperature 0: greedy) -> host Rollout,
    through the rollout engine (continuous batching over a paged cache; `engine_options` are
    `rollout.EngineSettings` fields: `num_slots`, `page_size`, `num_pages`, `prefill_chunk`;
    `return_stats` also returns the call's `EngineStats`).

    `max_new_tokens`: an int, one budget per prompt [P] or one per row [P*G]; the Rollout is
    as wide as the largest. `pad_id` (default: the first EOS id, as Hugging Face does) fills
    prompt padding and the slots after a row's EOS. With `mesh`, rows are split over its
    data/fsdp axes, each row device decoding its own rows (hand it `engine.call.decode_copy`
    weights). The token at position t of row s is drawn with key fold_in(fold_in(key, s), t),
    so a call's rollouts do not depend on the slots, pages or devices that ran it.
    """
    budget = (int(max_new_tokens) if np.ndim(max_new_tokens) == 0
              else tuple(int(b) for b in np.asarray(max_new_tokens).reshape(-1)))
    sampling = SamplingSettings(num_samples=int(num_samples), max_new_tokens=budget,
                                eos_ids=tuple(eos_ids), temperature=temperature, top_k=top_k,
                                top_p=top_p, pad_id=pad_id)
    return call.generate(model, prompts, sampling, key, EngineSettings(**engine_options),
                         mesh=mesh, return_stats=return_stats)
