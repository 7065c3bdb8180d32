"""Host side of one RL iteration: sample groups, score them, shape rewards, advantages.

What lives here: turning prompts into an update batch of fixed shape (rows of one prompt
contiguous, `[P*G, ...]` arrays) plus the host metrics of that iteration, including DAPO
dynamic sampling. What does not: the jitted update (train.py), the sampler itself
(sampler.py), reward rules (rewards/).

Shapes: P prompts per step, G samples per prompt, B = P*G rows, Tp padded prompt length,
R = max_new_tokens response slots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ba_jax import grpo, sampler
from ba_jax.rewards import math as math_rewards


@dataclasses.dataclass
class Experience:
    """One update batch (host NumPy arrays) and what it cost to collect."""

    batch: dict[str, np.ndarray]  # prompt_tokens_BT, prompt_mask_BT, tokens_BR, mask_BR, old_logp_BR, adv_B, group_id_B
    metrics: dict[str, float]


def _decode(tokenizer, tokens_BR: np.ndarray, lengths_B: np.ndarray, eos_ids: set[int]) -> list[str]:
    texts = []
    for row, n in zip(tokens_BR, lengths_B):
        ids = [int(t) for t in row[: int(n)] if int(t) not in eos_ids]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def _round(policy, prompt_ids, truths, *, cfg, key, tokenizer, scorer, eos_ids, rule, mesh):
    """Sample and score one set of prompts; returns per-row arrays and timings."""
    t0 = time.perf_counter()
    ro = sampler.generate(
        policy, prompt_ids, num_samples=cfg.rollout.num_samples,
        max_new_tokens=cfg.rollout.max_new_tokens, key=key,
        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        eos_ids=sorted(eos_ids), pad_id=tokenizer.pad_token_id, mesh=mesh,
    )
    tokens_BR = np.asarray(ro.tokens)
    lengths_B = np.asarray(ro.lengths)
    t1 = time.perf_counter()
    texts = _decode(tokenizer, tokens_BR, lengths_B, eos_ids)
    G = cfg.rollout.num_samples
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


def _pad_prompts(chunks: list[dict[str, np.ndarray]]) -> None:
    # Rounds may use different prompt buckets: left-pad to the widest so rows concatenate.
    width = max(c["prompt_tokens_BT"].shape[1] for c in chunks)
    for c in chunks:
        extra = width - c["prompt_tokens_BT"].shape[1]
        if extra:
            for k in ("prompt_tokens_BT", "prompt_mask_BT"):
                c[k] = np.pad(c[k], ((0, 0), (extra, 0)))


def collect(
    policy: Any,
    next_prompts: Callable[[], tuple[list[list[int]], list[str]]],
    *,
    cfg: Any,
    key: jax.Array,
    tokenizer: Any,
    scorer: "math_rewards.MathScorer",
    eos_ids: set[int],
    rule: str = "dapo",
    mesh: Any = None,
) -> Experience:
    """Sample P groups (refilling degenerate ones when dynamic sampling is on) and score them."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.num_samples
    rounds = 1 + (cfg.grpo.max_resample_rounds if cfg.grpo.dynamic_sampling else 0)
    kept, spare, timing = [], [], dict(sample_s=0.0, score_s=0.0, timeouts=0, errors=0)
    first_round = None
    n_kept = 0
    rounds_run = 0
    for r in range(rounds):
        rounds_run = r + 1
        prompt_ids, truths = next_prompts()
        rows, t = _round(policy, prompt_ids, truths, cfg=cfg, key=jax.random.fold_in(key, r),
                         tokenizer=tokenizer, scorer=scorer, eos_ids=eos_ids, rule=rule, mesh=mesh)
        for k in timing:
            timing[k] += t[k]
        if first_round is None:
            first_round = rows
        if not cfg.grpo.dynamic_sampling:
            kept.append(rows)
            n_kept = P
            break
        rew_PG = rows["reward_B"].reshape(-1, G)
        mixed = [g for g in range(len(rew_PG)) if rew_PG[g].max() > rew_PG[g].min()]
        flat = [g for g in range(len(rew_PG)) if g not in mixed]
        take = mixed[: P - n_kept]
        kept.append(_take_groups(rows, take, G))
        spare.append(_take_groups(rows, flat, G))
        n_kept += len(take)
        if n_kept == P:
            break
    if n_kept < P:  # retry budget spent: fill with degenerate groups (they weigh nothing)
        need = P - n_kept
        pool = {k: np.concatenate([s[k] for s in spare]) for k in spare[0]}
        kept.append({k: v[: need * G] for k, v in pool.items()})
    _pad_prompts(kept)
    rows = {k: np.concatenate([c[k] for c in kept]) for k in kept[0]}

    reward_B = rows["reward_B"].copy()
    if cfg.grpo.overlong_buffer > 0:
        reward_B += math_rewards.overlong_penalty(
            rows["lengths_B"], max_len=cfg.rollout.max_new_tokens,
            buffer=cfg.grpo.overlong_buffer, factor=cfg.grpo.overlong_factor)
    group_id_B = np.repeat(np.arange(P, dtype=np.int32), G)
    adv_B = np.asarray(grpo.group_advantages(reward_B, group_id_B, P, estimator=cfg.grpo.advantage))

    # Metrics describe what the policy produced in the first round (unbiased by filtering).
    fr = first_round
    lengths = fr["lengths_B"].astype(np.float64)
    rew_PG = fr["reward_B"].reshape(-1, G)
    metrics = dict(
        reward_mean=float(fr["reward_B"].mean()),
        accuracy=float(fr["correct_B"].mean()),
        response_length_mean=float(lengths.mean()),
        response_length_cv=float(lengths.std() / lengths.mean()) if lengths.mean() > 0 else 0.0,
        response_length_max=float(lengths.max()),
        finished_eos_frac=float(fr["eos_B"].mean()),
        degenerate_group_frac=float(np.mean(rew_PG.max(1) == rew_PG.min(1))),
        batch_reward_mean=float(reward_B.mean()),
        batch_degenerate_group_frac=float(np.mean(adv_B.reshape(P, G).std(1) == 0)),
        sampling_rounds=float(rounds_run),
        reward_timeouts=float(timing["timeouts"]),
        reward_errors=float(timing["errors"]),
        sample_time_s=timing["sample_s"],
        score_time_s=timing["score_s"],
        generated_tokens=float(fr["lengths_B"].sum()),
    )
    batch = dict(
        prompt_tokens_BT=rows["prompt_tokens_BT"].astype(np.int32),
        prompt_mask_BT=rows["prompt_mask_BT"].astype(np.int32),
        tokens_BR=rows["tokens_BR"].astype(np.int32),
        mask_BR=rows["mask_BR"].astype(np.float32),
        old_logp_BR=rows["old_logp_BR"].astype(np.float32),
        adv_B=adv_B.astype(np.float32),
        group_id_B=group_id_B,
    )
    return Experience(batch=batch, metrics=metrics)
