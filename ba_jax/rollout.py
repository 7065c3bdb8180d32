"""The rollout interface: what every engine is given, what it returns, and its protocol.

Lives here: `SamplingSettings` (one call's sampling: G, budgets, temperature, top-k, top-p,
EOS and pad ids), `EngineSettings` (the paged engine's own knobs), the `RolloutEngine`
protocol (`sync`, `generate`, `release`, `close`) that the trainer and evaluation hold, the host
`Rollout` it returns, and the prompt bucketing every engine shares. Not here: the engines
(`engine/paged.py`: the in-house paged engine; `vllm_rollout.py`: vLLM), the sampling math
(`sampling.py`), building an engine from the config (`build.make_rollout_engine`).

A new engine implements `RolloutEngine` (see docs/architecture.md); nothing above it changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from ba_jax import sampling


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How one call samples. Checked on construction (ValueError naming the field)."""

    num_samples: int  # G, samples per prompt; rows of one prompt are contiguous
    max_new_tokens: int | tuple[int, ...]  # R: an int, one budget per prompt, or one per row
    eos_ids: tuple[int, ...]  # a sample ends at the first of these (included in its tokens)
    temperature: float = 1.0  # 0: greedy (first argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest most-likely set with mass >= top_p; 1 keeps all
    pad_id: int | None = None  # fills prompt padding and slots after the end; None: eos_ids[0]

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        budget = self.max_new_tokens
        if not isinstance(budget, int):
            object.__setattr__(self, "max_new_tokens", tuple(int(b) for b in budget))
        if int(self.num_samples) < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")
        if not self.eos_ids:
            raise ValueError("eos_ids must name at least one token id")
        self.draw  # noqa: B018 - checks temperature, top_k, top_p

    @property
    def draw(self) -> sampling.SamplingConfig:
        """The static part of a call: how a token is drawn (part of a compile key)."""
        return sampling.SamplingConfig(float(self.temperature), int(self.top_k),
                                       float(self.top_p))

    @property
    def pad(self) -> int:
        return self.eos_ids[0] if self.pad_id is None else int(self.pad_id)

    @property
    def width(self) -> int:
        """R, the largest budget: the Rollout's width."""
        b = self.max_new_tokens
        return b if isinstance(b, int) else max(b)

    def row_budgets(self, num_prompts: int) -> np.ndarray:
        """Per-row token budgets [P*G] (int32); ValueError for a wrong shape or a budget < 1."""
        G = int(self.num_samples)
        b = np.asarray(self.max_new_tokens, np.int64)
        B = num_prompts * G
        if b.ndim == 0:
            b = np.full(B, int(b))
        elif b.shape == (num_prompts,):
            b = np.repeat(b, G)
        elif b.shape != (B,):
            raise ValueError(f"max_new_tokens has shape {b.shape}; expected an int, "
                             f"[{num_prompts}] (one per prompt) or [{B}] (one per row)")
        if (b < 1).any():
            raise ValueError(f"max_new_tokens must be >= 1 everywhere, got min {int(b.min())}")
        return b.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The paged engine's own settings (config `rollout.*`); see `engine.shapes.call_shape`."""

    num_slots: int = 0  # decode slots of a call; 0: a quarter of each row device's rows
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # pages of a call; 0: every slot's largest budget at once
    prefill_chunk: int = 512  # prompt tokens prefilled per loop step; 0: whole prompts
    prompts_per_call: int = 0  # prompts per engine call (same-bucket queue); 0: all at once

    def __post_init__(self):
        if self.num_slots < 0 or self.page_size < 1 or self.num_pages < 0:
            raise ValueError(f"num_slots={self.num_slots} and num_pages={self.num_pages} must "
                             f"be >= 0 and page_size={self.page_size} >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 0 (0: whole "
                             "prompts)")
        if self.prompts_per_call < 0:
            raise ValueError(f"prompts_per_call={self.prompts_per_call} must be >= 0")


@dataclasses.dataclass
class Rollout:
    """P*G sampled responses on the host; rows of one prompt are contiguous."""

    tokens: np.ndarray  # int32 [P*G, R]: generated ids, pad_id after the EOS
    logprobs: np.ndarray  # float32 [P*G, R]: log_softmax(logits)[token], temperature 1, 0 if masked
    sampling_logprobs: np.ndarray  # float32 [P*G, R]: same, under the sampling distribution
    mask: np.ndarray  # int32 [P*G, R]: 1 on generated tokens up to and including the EOS
    lengths: np.ndarray  # int32 [P*G]: number of generated tokens (mask.sum(1))
    group_ids: np.ndarray  # int32 [P*G]: prompt index of each row
    finish_reason: np.ndarray  # object [P*G]: "eos" or "length"
    prompt_tokens: np.ndarray  # int32 [P*G, Tp]: left-padded prompt block that was decoded from
    prompt_mask: np.ndarray  # int32 [P*G, Tp]: 1 on real prompt tokens


class RolloutEngine(Protocol):
    """What the trainer and evaluation hold: an engine that samples from given weights."""

    def sync(self, params: Any) -> float:
        """Hand the engine the policy's current parameters -> seconds it took."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 key: jax.Array) -> Rollout:
        """G samples per prompt (token ids) from the last synced weights. The token at
        position t of row s is drawn with key fold_in(fold_in(key, s), t) where the engine
        controls its draws (the in-house engine; vLLM seeds per request from `key`)."""

    def release(self) -> None:
        """Done sampling for now: free what sampling alone needs (the paged engine's decode
        copy of the weights), so the update has the memory; the next `sync` restores it."""

    def close(self) -> None:
        """Release the engine's weights, processes and memory for good."""


ROLLOUT_ARRAYS = ("tokens", "logprobs", "sampling_logprobs", "mask", "done")


def prompt_bucket(length: int) -> int:
    """Padded prompt length: powers of two from 16 to 512, then multiples of 512."""
    if length <= 512:
        return max(16, 1 << (max(length, 1) - 1).bit_length())
    return -(-length // 512) * 512


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int):
    """Left-pads token lists to `width` -> (tokens_PT int32, mask_PT int32)."""
    tokens_PT = np.full((len(prompts), width), pad_id, np.int32)
    mask_PT = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        if len(p):
            tokens_PT[i, width - len(p):] = p
            mask_PT[i, width - len(p):] = 1
    return tokens_PT, mask_PT


def prompt_arrays(prompts: Sequence[Sequence[int]], pad_id: int):
    """Checked prompts, left-padded to their bucket -> (prompt_PT, prompt_mask_PT) int32."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    return left_pad(prompts, prompt_bucket(max(len(p) for p in prompts)), pad_id)


def to_rollout(out: dict, prompt_PT: np.ndarray, pmask_PT: np.ndarray, G: int) -> Rollout:
    """The host Rollout of a call's output arrays (tokens, logprobs, sampling_logprobs, mask,
    done), rows of prompt p at [p*G, (p+1)*G)."""
    mask_BR = np.asarray(out["mask"], np.int32)
    return Rollout(
        tokens=np.asarray(out["tokens"], np.int32),
        logprobs=np.asarray(out["logprobs"], np.float32),
        sampling_logprobs=np.asarray(out["sampling_logprobs"], np.float32),
        mask=mask_BR,
        lengths=mask_BR.sum(1).astype(np.int32),
        group_ids=np.repeat(np.arange(len(prompt_PT), dtype=np.int32), G),
        finish_reason=np.where(np.asarray(out["done"]), "eos", "length").astype(object),
        prompt_tokens=np.repeat(prompt_PT, G, axis=0),
        prompt_mask=np.repeat(pmask_PT, G, axis=0),
    )
