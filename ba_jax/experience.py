"""Host side of one RL iteration: sample groups, score them, shape rewards, advantages.

What lives here: `ExperienceSettings` (built once from the config by `build`), turning
prompts into an update batch of fixed shape (rows of one prompt contiguous, `[P*G, ...]`
arrays) through a `rollout.RolloutEngine` (whichever engine it is), DAPO dynamic sampling,
and the host metrics of an iteration. What does not: the jitted update (train.py), the
engines (engine/, vllm_rollout.py), reward rules (rewards/).

Sampling shards: the P prompts of a step are cut into `rollout.sample_shards` equal
shards, each sampled by its own `generate` call with key `fold_in(round_key, shard)`.
A process samples only its own shards, so a run gives the same batch whatever the
number of processes (the shards, not the processes, define the randomness).

Shapes: P prompts per step, G samples per prompt, B = P*G rows, Tp padded prompt length,
R = max_new_tokens response slots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ba_jax import distributed, grpo
from ba_jax.rewards import math as math_rewards
from ba_jax.rollout import RolloutEngine, SamplingSettings


# The update batch's arrays and dtypes: what `collect` hands the trainer, what the train step
# takes, what the planner compiles it with (`batch_schema`).
BATCH_DTYPES = dict(prompt_tokens_BT=np.int32, prompt_mask_BT=np.int32, tokens_BR=np.int32,
                    mask_BR=np.float32, old_logp_BR=np.float32, adv_B=np.float32,
                    group_id_B=np.int32, ref_logp_BR=np.float32, engine_logp_BR=np.float32)


def batch_schema(rows: int, prompt_len: int, response_len: int, *, with_ref: bool = False,
                 with_engine_logp: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The update batch of `rows` rows: name -> (shape, dtype). `ref_logp_BR` (the frozen
    reference's log-probs) is the trainer's, added when the loss has a KL term;
    `engine_logp_BR` (the engine's log-probs, beside the recomputed `old_logp_BR`) when the
    loss has a rollout correction."""
    B, Tp, R = rows, prompt_len, response_len
    shapes = dict(prompt_tokens_BT=(B, Tp), prompt_mask_BT=(B, Tp), tokens_BR=(B, R),
                  mask_BR=(B, R), old_logp_BR=(B, R), adv_B=(B,), group_id_B=(B,))
    if with_ref:
        shapes["ref_logp_BR"] = (B, R)
    if with_engine_logp:
        shapes["engine_logp_BR"] = (B, R)
    return {k: (s, np.dtype(BATCH_DTYPES[k])) for k, s in shapes.items()}


@dataclasses.dataclass(frozen=True)
class ExperienceSettings:
    """How a step's experience is gathered (config `rollout.*`, `grpo.*` in brackets)."""

    prompts_per_step: int  # P (rollout.prompts_per_step)
    sample_shards: int  # shards of P sampled by separate calls (rollout.sample_shards)
    dynamic_sampling: bool = False  # keep only mixed groups, resample (grpo.dynamic_sampling)
    max_resample_rounds: int = 0  # extra rounds dynamic sampling may draw (grpo.*)
    overlong_buffer: int = 0  # DAPO overlong shaping window, tokens; 0: off (grpo.*)
    overlong_factor: float = 1.0  # its largest penalty (grpo.overlong_factor)
    advantage: str = "grpo"  # grpo.ADVANTAGE_ESTIMATORS (grpo.advantage)


@dataclasses.dataclass
class Experience:
    """This process's part of one update batch (host NumPy arrays) and what it cost."""

    batch: dict[str, np.ndarray]  # prompt_tokens_BT, prompt_mask_BT, tokens_BR, mask_BR, old_logp_BR, adv_B, group_id_B
    first_round: dict[str, np.ndarray]  # per-row reward/correct/length/eos of the first round
    final: dict[str, np.ndarray]  # per-row shaped reward and advantage of the update batch
    timing: dict[str, float]


def _decode(tokenizer, tokens_BR: np.ndarray, lengths_B: np.ndarray, eos_ids: set[int]) -> list[str]:
    texts = []
    for row, n in zip(tokens_BR, lengths_B):
        ids = [int(t) for t in row[: int(n)] if int(t) not in eos_ids]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def _round(engine: RolloutEngine, prompt_ids, truths, *, sampling: SamplingSettings, key,
           tokenizer, scorer, eos_ids, rule):
    """Sample and score one set of prompts; returns per-row arrays and timings."""
    t0 = time.perf_counter()
    ro = engine.generate(prompt_ids, sampling, key)
    tokens_BR = np.asarray(ro.tokens)
    lengths_B = np.asarray(ro.lengths)
    t1 = time.perf_counter()
    texts = _decode(tokenizer, tokens_BR, lengths_B, eos_ids)
    G = sampling.num_samples
    scores = scorer.score(texts, [t for t in truths for _ in range(G)], rule=rule)
    t2 = time.perf_counter()
    rows = dict(
        prompt_tokens_BT=np.asarray(ro.prompt_tokens), prompt_mask_BT=np.asarray(ro.prompt_mask),
        tokens_BR=tokens_BR, mask_BR=np.asarray(ro.mask), old_logp_BR=np.asarray(ro.logprobs),
        lengths_B=lengths_B, reward_B=np.asarray(scores.rewards, np.float32),
        correct_B=np.asarray(scores.correct, bool),
        eos_B=np.asarray([r == "eos" for r in ro.finish_reason], bool),
    )
    return rows, dict(sample_s=t1 - t0, score_s=t2 - t1, timeouts=scores.num_timeouts,
                      errors=scores.num_errors)


def _take_groups(rows: dict[str, np.ndarray], groups: list[int], G: int) -> dict[str, np.ndarray]:
    idx = np.concatenate([np.arange(g * G, (g + 1) * G) for g in groups]) if groups else np.zeros(0, int)
    return {k: v[idx] for k, v in rows.items()}


def _pad_prompts(chunks: list[dict[str, np.ndarray]], width: int) -> None:
    # Rounds may use different prompt buckets: left-pad to one width so rows concatenate.
    for c in chunks:
        extra = width - c["prompt_tokens_BT"].shape[1]
        if extra:
            for k in ("prompt_tokens_BT", "prompt_mask_BT"):
                c[k] = np.pad(c[k], ((0, 0), (extra, 0)))


class _Shard:
    """Groups kept so far for one sampling shard (dynamic sampling keeps mixed ones)."""

    def __init__(self, num_groups: int, G: int, dynamic: bool):
        self.num_groups, self.G, self.dynamic = num_groups, G, dynamic
        self.kept, self.spare, self.n_kept, self.first = [], [], 0, None

    @property
    def full(self) -> bool:
        return self.n_kept == self.num_groups

    def add(self, rows: dict[str, np.ndarray]) -> None:
        if self.first is None:
            self.first = rows
        if not self.dynamic:
            self.kept.append(rows)
            self.n_kept = self.num_groups
            return
        rew_PG = rows["reward_B"].reshape(-1, self.G)
        mixed = [g for g in range(len(rew_PG)) if rew_PG[g].max() > rew_PG[g].min()]
        flat = [g for g in range(len(rew_PG)) if g not in mixed]
        take = mixed[: self.num_groups - self.n_kept]
        self.kept.append(_take_groups(rows, take, self.G))
        self.spare.append(_take_groups(rows, flat, self.G))
        self.n_kept += len(take)

    def rows(self) -> list[dict[str, np.ndarray]]:
        chunks = list(self.kept)
        if self.n_kept < self.num_groups:  # retry budget spent: fill with degenerate groups
            need = (self.num_groups - self.n_kept) * self.G
            pool = {k: np.concatenate([s[k] for s in self.spare]) for k in self.spare[0]}
            chunks.append({k: v[:need] for k, v in pool.items()})
        return chunks


def collect(
    engine: RolloutEngine,
    next_prompts: Callable[[], tuple[list[list[int]], list[str]]],
    *,
    settings: ExperienceSettings,
    sampling: SamplingSettings,
    key: jax.Array,
    tokenizer: Any,
    scorer: math_rewards.MathScorer,
    eos_ids: set[int],
    rule: str = "dapo",
    shards: Sequence[int] = (0,),
) -> Experience:
    """Sample this process's `shards` of the step's P prompts, with dynamic sampling if on.

    `engine`: any `RolloutEngine`, its weights synced. `next_prompts()` returns all P
    prompts of a round (the same on every process).
    """
    P, G, S = settings.prompts_per_step, sampling.num_samples, settings.sample_shards
    Pg = P // S
    rounds = 1 + (settings.max_resample_rounds if settings.dynamic_sampling else 0)
    state = {s: _Shard(Pg, G, settings.dynamic_sampling) for s in shards}
    timing = dict(sample_s=0.0, score_s=0.0, timeouts=0, errors=0, rounds=0)
    for r in range(rounds):
        prompt_ids, truths = next_prompts()
        timing["rounds"] = r + 1
        for s, sh in state.items():
            if sh.full:
                continue
            sl = slice(s * Pg, (s + 1) * Pg)
            rows, t = _round(engine, prompt_ids[sl], truths[sl], sampling=sampling,
                             key=jax.random.fold_in(jax.random.fold_in(key, r), s),
                             tokenizer=tokenizer, scorer=scorer, eos_ids=eos_ids, rule=rule)
            for k in ("sample_s", "score_s"):
                timing[k] += t[k]
            timing["timeouts"] += t["timeouts"]
            timing["errors"] += t["errors"]
            sh.add(rows)
        # Every process draws the same prompts each round, so all must stop together.
        if distributed.all_processes(all(sh.full for sh in state.values())):
            break

    chunks = [c for s in shards for c in state[s].rows()]
    firsts = [state[s].first for s in shards]
    _pad_prompts(chunks, max(c["prompt_tokens_BT"].shape[1] for c in chunks))
    rows = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    reward_B = rows["reward_B"].copy()
    if settings.overlong_buffer > 0:
        reward_B += math_rewards.overlong_penalty(
            rows["lengths_B"], max_len=sampling.width,
            buffer=settings.overlong_buffer, factor=settings.overlong_factor)
    # Global group ids: shard s holds groups s*Pg .. (s+1)*Pg - 1.
    group_id_B = np.concatenate([s * Pg + np.repeat(np.arange(Pg, dtype=np.int32), G) for s in shards])
    local_id_B = np.repeat(np.arange(len(shards) * Pg, dtype=np.int32), G)
    adv_B = np.asarray(grpo.group_advantages(reward_B, local_id_B, len(shards) * Pg,
                                             estimator=settings.advantage))
    batch = dict(prompt_tokens_BT=rows["prompt_tokens_BT"],
                 prompt_mask_BT=rows["prompt_mask_BT"], tokens_BR=rows["tokens_BR"],
                 mask_BR=rows["mask_BR"],
                 old_logp_BR=rows["old_logp_BR"], adv_B=adv_B, group_id_B=group_id_B)
    batch = {k: np.asarray(v, BATCH_DTYPES[k]) for k, v in batch.items()}
    first = {k: np.concatenate([f[k] for f in firsts]) for k in ("reward_B", "correct_B", "lengths_B", "eos_B")}
    return Experience(batch=batch, first_round=first, final=dict(reward_B=reward_B, adv_B=adv_B),
                      timing=timing)


def host_metrics(first: dict[str, np.ndarray], final: dict[str, np.ndarray], G: int) -> dict[str, float]:
    """Step metrics of all rows (gathered over processes): what the policy produced in the
    first round (unbiased by dynamic-sampling filtering), and what the update saw."""
    lengths = first["lengths_B"].astype(np.float64)
    rew_PG = first["reward_B"].reshape(-1, G)
    mean_len = lengths.mean()
    return dict(
        reward_mean=float(first["reward_B"].mean()),
        accuracy=float(first["correct_B"].mean()),
        response_length_mean=float(mean_len),
        response_length_cv=float(lengths.std() / mean_len) if mean_len > 0 else 0.0,
        response_length_max=float(lengths.max()),
        finished_eos_frac=float(first["eos_B"].mean()),
        degenerate_group_frac=float(np.mean(rew_PG.max(1) == rew_PG.min(1))),
        batch_reward_mean=float(final["reward_B"].mean()),
        batch_degenerate_group_frac=float(np.mean(final["adv_B"].reshape(-1, G).std(1) == 0)),
        generated_tokens=float(lengths.sum()),
    )
