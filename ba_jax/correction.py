"""Train-inference consistency: the rollout correction and the mismatch statistics.

The engine that samples (the paged engine's decode path, vLLM) and the trainer's forward
compute log-probs of the same tokens with different kernels, dtypes and summation orders.
With `pi_old` the trainer's recomputation and `pi_engine` the sampler's, the per-token log
ratio is `lr[i,t] = log pi_old[i,t] - log pi_engine[i,t]` over response tokens.

What lives here: `CorrectionSettings` (config `grpo.rollout_is*`, `grpo.rollout_rs*`), the
per-token factor the policy-gradient term is multiplied by (`pg_factor`: truncated importance
weights times the rejection mask, no gradient), and the mismatch / correction statistics as
sums (`statistics`, combined over mini-batches on the host by `summarize`). What does not:
where pi_old comes from and when the check runs (train.py), the loss (grpo.py), the config
checks (run_config.py). docs/consistency.md has the formulas and what differs from verl.

Shape letters: B rows, R response slots.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = ("none", "token", "sequence")  # grpo.rollout_is, grpo.rollout_rs
# |log ratio| is clamped to this before exponentiating (exp(20) ~ 4.9e8; verl's bound), so a
# sequence's product of ratios never overflows to inf in float32.
LOG_RATIO_BOUND = 20.0
# the mismatch metric `rollout_ratio_outside_2x_frac`: tokens whose ratio leaves [1/2, 2]
OUTSIDE_LOG = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class CorrectionSettings:
    """The rollout correction (config `grpo.*`), built once by `build.loss_settings`."""

    rollout_is: str = "none"  # none | token | sequence: truncated importance weights
    is_threshold: float = 2.0  # the weight's upper bound (> 1): min(ratio, threshold)
    rollout_rs: str = "none"  # none | token | sequence: rejection outside the bounds
    rs_lower: float = 0.5  # keep iff rs_lower <= ratio <= rs_upper (rs_lower < 1 < rs_upper)
    rs_upper: float = 2.0
    # grpo.logp_check_every: with the engine's log-probs as pi_old, recompute the trainer's
    # every N-th step and log the mismatch only (0: never); recompute measures every step
    check_every: int = 0

    @property
    def active(self) -> bool:
        """Whether the loss needs the engine's log-probs beside the trainer's."""
        return self.rollout_is != "none" or self.rollout_rs != "none"


def log_ratio(old_logp_BR: jax.Array, engine_logp_BR: jax.Array,
              mask_BR: jax.Array) -> jax.Array:
    """log pi_old - log pi_engine on response tokens, exactly 0 elsewhere (float32)."""
    d_BR = old_logp_BR.astype(jnp.float32) - engine_logp_BR.astype(jnp.float32)
    return jnp.where(mask_BR > 0, d_BR, 0.0)


def _level(lr_BR: jax.Array, level: str) -> jax.Array:
    """The log ratio a level works with, per token: the token's own, or its response's sum
    (the log of the product of the response's token ratios) broadcast over the row."""
    if level == "sequence":
        return jnp.broadcast_to(jnp.sum(lr_BR, axis=1, keepdims=True), lr_BR.shape)
    return lr_BR


def _exp(lr):
    return jnp.exp(jnp.clip(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def is_weights(lr_BR: jax.Array, mask_BR: jax.Array, s: CorrectionSettings) -> jax.Array:
    """Truncated importance weights min(pi_old / pi_engine, threshold), per token or per
    response (the product over its tokens, in log space); 0 off the mask; no gradient."""
    w_BR = jnp.minimum(_exp(_level(lr_BR, s.rollout_is)), s.is_threshold)
    return jax.lax.stop_gradient(jnp.where(mask_BR > 0, w_BR, 0.0))


def rs_keep(lr_BR: jax.Array, mask_BR: jax.Array, s: CorrectionSettings) -> jax.Array:
    """1.0 where the token (its ratio) or its whole response (the product of its ratios)
    lies in [rs_lower, rs_upper], compared in log space; 0 elsewhere and off the mask."""
    x_BR = _level(lr_BR, s.rollout_rs)
    keep_BR = (x_BR >= math.log(s.rs_lower)) & (x_BR <= math.log(s.rs_upper)) & (mask_BR > 0)
    return keep_BR.astype(jnp.float32)


def pg_factor(old_logp_BR: jax.Array, engine_logp_BR: jax.Array, mask_BR: jax.Array,
              s: CorrectionSettings) -> jax.Array:
    """The factor the per-token policy-gradient term is multiplied by: the IS weight (1 with
    `rollout_is=none`) times the rejection mask (1 with `rollout_rs=none`), no gradient.
    Equal log-probs give exactly 1 on every response token (threshold > 1 > rs_lower)."""
    lr_BR = log_ratio(old_logp_BR, engine_logp_BR, mask_BR)
    f_BR = (mask_BR > 0).astype(jnp.float32)
    if s.rollout_is != "none":
        f_BR = f_BR * is_weights(lr_BR, mask_BR, s)
    if s.rollout_rs != "none":
        f_BR = f_BR * rs_keep(lr_BR, mask_BR, s)
    return jax.lax.stop_gradient(f_BR)


def _k3(lr):
    """Schulman's k3 = r - 1 - log r with r = exp(lr): >= 0, an unbiased estimate of
    KL(engine || trainer) from tokens the engine sampled."""
    lr = jnp.clip(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return jnp.expm1(lr) - lr


def statistics(old_logp_BR: jax.Array, engine_logp_BR: jax.Array, mask_BR: jax.Array,
               s: CorrectionSettings) -> dict[str, jax.Array]:
    """Sums and maxima of one mini-batch (exact to combine over mini-batches: `summarize`):
    token and response counts, |lr|, token and sequence k3, tokens outside [1/2, 2] and,
    where the correction is on, the IS weights (units: tokens, or non-empty responses) and
    the rejected tokens."""
    m_BR = (mask_BR > 0).astype(jnp.float32)
    lr_BR = log_ratio(old_logp_BR, engine_logp_BR, mask_BR)
    seq_B = jnp.sum(lr_BR, axis=1)
    row_B = (jnp.sum(m_BR, axis=1) > 0).astype(jnp.float32)
    out = dict(tokens=jnp.sum(m_BR), rows=jnp.sum(row_B),
               abs_sum=jnp.sum(jnp.abs(lr_BR)), abs_max=jnp.max(jnp.abs(lr_BR)),
               k3_token_sum=jnp.sum(m_BR * _k3(lr_BR)), k3_seq_sum=jnp.sum(row_B * _k3(seq_B)),
               outside=jnp.sum(m_BR * (jnp.abs(lr_BR) > OUTSIDE_LOG)))
    if s.rollout_is != "none":
        if s.rollout_is == "token":
            x, unit = lr_BR, m_BR
        else:
            x, unit = seq_B, row_B
        w = jnp.minimum(_exp(x), s.is_threshold)
        out.update(is_units=jnp.sum(unit), is_sum=jnp.sum(unit * w),
                   is_sq_sum=jnp.sum(unit * w * w),
                   is_max=jnp.max(jnp.where(unit > 0, _exp(x), 0.0)),
                   is_clipped=jnp.sum(unit * (x > math.log(s.is_threshold))))
    if s.rollout_rs != "none":
        out["rs_masked"] = jnp.sum(m_BR * (1.0 - rs_keep(lr_BR, mask_BR, s)))
    return out


def summarize(parts: list[dict], s: CorrectionSettings) -> dict[str, float]:
    """The step's metrics from the `statistics` of its mini-batches (host values):

    rollout_logp_diff_mean / _max: mean and max of |lr| over response tokens;
    rollout_kl_k3 (also as rollout_kl_k3_token): mean over response tokens of k3(lr);
    rollout_kl_k3_seq: mean over non-empty responses of k3(sum_t lr) (the sequence ratio);
    rollout_ratio_outside_2x_frac: fraction of response tokens with ratio outside [1/2, 2];
    with rollout_is: rollout_is_mean (of the truncated weights, per unit), rollout_is_max
    (before truncation), rollout_is_clipped_frac (units above the threshold), rollout_is_ess
    ((sum w)^2 / (n sum w^2) of the truncated weights, in (0, 1]); with rollout_rs:
    rollout_rs_masked_frac (rejected response tokens / response tokens).
    """
    tot = lambda k: float(sum(np.float64(p[k]) for p in parts))  # noqa: E731
    big = lambda k: float(max(np.float64(p[k]) for p in parts))  # noqa: E731
    n, rows = max(tot("tokens"), 1.0), max(tot("rows"), 1.0)
    out = dict(rollout_logp_diff_mean=tot("abs_sum") / n, rollout_logp_diff_max=big("abs_max"),
               rollout_kl_k3=tot("k3_token_sum") / n,  # the contract name
               rollout_kl_k3_token=tot("k3_token_sum") / n,
               rollout_kl_k3_seq=tot("k3_seq_sum") / rows,
               rollout_ratio_outside_2x_frac=tot("outside") / n)
    if s.rollout_is != "none":
        units, w, w2 = max(tot("is_units"), 1.0), tot("is_sum"), tot("is_sq_sum")
        out.update(rollout_is_mean=w / units, rollout_is_max=big("is_max"),
                   rollout_is_clipped_frac=tot("is_clipped") / units,
                   rollout_is_ess=w * w / (units * w2) if w2 > 0 else 1.0)
    if s.rollout_rs != "none":
        out["rollout_rs_masked_frac"] = tot("rs_masked") / n
    return out
