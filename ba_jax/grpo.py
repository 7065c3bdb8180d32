"""GRPO building blocks as pure functions: advantages, token log-probs and entropy,
the policy's log-probs on a `[prompt | response]` batch, the clipped surrogate, KL
estimators, the weighted loss, exact micro-batching.

The loss is always `sum(w_BT * l_BT)` with weights from `ba_jax.aggregation`, computed
on the whole optimizer batch before it is split (spec: aggregation.md), so every
metric here is a plain weighted or counted sum that stays exact when summed over
micro-batches or devices. What does not live here: the aggregation rules
(aggregation.py), the model (models/), the train step (train.py), the optimizer (optim.py).
Shape letters: B rows, T tokens, V vocab, P groups (prompts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ba_jax.aggregation import safe_div
from ba_jax.correction import CorrectionSettings

ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "batch_std")
KL_KINDS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The update's objective (config `grpo.*`), built once by `build.loss_settings`."""

    aggregation: str  # a name in aggregation.RULES or "package.module:function"
    max_len: int  # the `constant` rule's length (grpo.constant_max_len, else max_new_tokens)
    count_degenerate_groups: bool = True  # the balanced rules' group count
    eps_low: float = 0.2  # clip range below 1
    eps_high: float = 0.28  # clip range above 1 (clip-higher)
    dual_clip: float | None = None  # dual-clip bound c for A < 0; None: off
    kl_kind: str | None = None  # k1 | k2 | k3 against the frozen reference; None: no KL
    kl_beta: float = 0.0
    num_microbatches: int = 1  # slices of a mini-batch accumulated in one step
    # the rollout correction (grpo.rollout_is*, grpo.rollout_rs*): a factor on the
    # policy-gradient term from the engine's and the trainer's log-probs (correction.py)
    correction: CorrectionSettings = CorrectionSettings()

    @property
    def rule_options(self) -> dict:
        return dict(count_degenerate_groups=self.count_degenerate_groups, max_len=self.max_len)


def group_advantages(
    rewards_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> jax.Array:
    """Per-row advantages from per-row rewards and group ids (float32).

    grpo: (R - group mean) / (group std + eps), std with Bessel's correction;
    drgrpo: R - group mean; batch_std: (R - group mean) / (batch std of R + eps),
    Bessel-corrected over all rows in range. Groups of one row, groups whose rewards
    are all equal, and rows whose group id is outside [0, num_groups) get exactly 0.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(ADVANTAGE_ESTIMATORS)
        raise ValueError(f"unknown estimator {estimator!r}; valid: {valid}")
    r_B = rewards_B.astype(jnp.float32)
    gid_B = group_id_B.astype(jnp.int32)
    valid_B = (gid_B >= 0) & (gid_B < num_groups)
    gid_B = jnp.clip(gid_B, 0, num_groups - 1)
    r_B = jnp.where(valid_B, r_B, 0.0)
    v_B = valid_B.astype(jnp.float32)
    seg = lambda x_B: jax.ops.segment_sum(x_B, gid_B, num_segments=num_groups)
    n_P = seg(v_B)
    mean_P = safe_div(seg(r_B), n_P)
    centred_B = r_B - mean_P[gid_B]
    # All-equal groups: force exact zeros (a float mean can miss R by one ulp).
    hi_P = jax.ops.segment_max(jnp.where(valid_B, r_B, -jnp.inf), gid_B, num_segments=num_groups)
    lo_P = jax.ops.segment_min(jnp.where(valid_B, r_B, jnp.inf), gid_B, num_segments=num_groups)
    live_B = valid_B & (n_P[gid_B] > 1) & (hi_P[gid_B] > lo_P[gid_B])
    if estimator == "grpo":
        std_P = jnp.sqrt(safe_div(seg(v_B * centred_B**2), n_P - 1))
        adv_B = centred_B / (std_P[gid_B] + eps)
    elif estimator == "drgrpo":
        adv_B = centred_B
    else:
        n = v_B.sum()
        batch_mean = safe_div(r_B.sum(), n)
        batch_std = jnp.sqrt(safe_div((v_B * (r_B - batch_mean) ** 2).sum(), n - 1))
        adv_B = centred_B / (batch_std + eps)
    return jnp.where(live_B, adv_B, 0.0)


@jax.custom_vjp
def _token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    return _token_logprobs_fwd(logits_BTV, tokens_BT)[0]


def _token_logprobs_fwd(logits_BTV, tokens_BT):
    # Upcast inside the fused reduction; no [B,T,V] float32 copy is kept.
    lse_BT = jax.nn.logsumexp(logits_BTV.astype(jnp.float32), axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, tokens_BT[..., None], axis=-1)[..., 0]
    return picked_BT.astype(jnp.float32) - lse_BT, (logits_BTV, tokens_BT, lse_BT)


def _token_logprobs_bwd(res, g_BT):
    # d logp / d logits = onehot(token) - softmax: one fused [B,T,V] expression,
    # written straight in the logits dtype.
    logits_BTV, tokens_BT, lse_BT = res
    p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
    onehot_BTV = tokens_BT[..., None] == jnp.arange(logits_BTV.shape[-1], dtype=tokens_BT.dtype)
    grad_BTV = g_BT[..., None] * (onehot_BTV.astype(jnp.float32) - p_BTV)
    return grad_BTV.astype(logits_BTV.dtype), None


_token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """float32 log pi(tokens) = log_softmax(logits) gathered at tokens."""
    return _token_logprobs(logits_BTV, tokens_BT.astype(jnp.int32))


def token_entropy(logits_BTV: jax.Array) -> jax.Array:
    """float32 entropy of the softmax over V at every position."""
    x_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(x_BTV, axis=-1)
    p_BTV = jnp.exp(x_BTV - lse_BT[..., None])
    return lse_BT - jnp.sum(p_BTV * x_BTV, axis=-1)


def head_logprobs(head_fn: Callable[[jax.Array], jax.Array], x_BRD: jax.Array,
                  tokens_BR: jax.Array, *, chunk: int, with_entropy: bool = False):
    """Log-probs (and entropies) of `tokens_BR` from final hidden states, the head run over
    chunks of `chunk` positions -> (logp_BR float32, ent_BR float32 or None).

    `head_fn(x_BcD) -> logits_BcV` is the model's output head (norm + projection). The
    chunks run in a `lax.scan`, each under `jax.checkpoint`, so neither pass ever holds more
    than one chunk's [B, chunk, V] logits: the forward keeps only the chunk's hidden states,
    the backward recomputes its logits and leaves their cotangent in the head's weight
    gradient (summed over chunks in float32). Positions past the last whole chunk run as one
    shorter chunk; `chunk` 0 or >= R is the unchunked computation. Values and gradients
    equal the unchunked path's (tests: both dtypes, tied and untied heads, ragged chunks).
    """
    B, R, _ = x_BRD.shape
    tokens_BR = tokens_BR.astype(jnp.int32)

    def one(x_BcD, t_Bc):
        logits_BcV = head_fn(x_BcD)
        ent_Bc = token_entropy(jax.lax.stop_gradient(logits_BcV)) if with_entropy else None
        return token_logprobs(logits_BcV, t_Bc), ent_Bc

    if not chunk or chunk >= R:
        return one(x_BRD, tokens_BR)
    one = jax.checkpoint(one)
    n = R // chunk
    split = lambda a: jnp.swapaxes(a[:, :n * chunk].reshape(B, n, chunk, *a.shape[2:]), 0, 1)
    _, (logp_nBc, ent_nBc) = jax.lax.scan(lambda c, xs: (c, one(*xs)), None,
                                          (split(x_BRD), split(tokens_BR)))
    join = lambda a: jnp.swapaxes(a, 0, 1).reshape(B, n * chunk)
    logp_BR, ent_BR = join(logp_nBc), None if ent_nBc is None else join(ent_nBc)
    if n * chunk < R:  # the ragged tail
        logp_Bt, ent_Bt = one(x_BRD[:, n * chunk:], tokens_BR[:, n * chunk:])
        logp_BR = jnp.concatenate([logp_BR, logp_Bt], axis=1)
        ent_BR = None if ent_BR is None else jnp.concatenate([ent_BR, ent_Bt], axis=1)
    return logp_BR, ent_BR


def sequence_inputs(prompt_tokens_BT, prompt_mask_BT, tokens_BR):
    """Model inputs for `[prompt | response]` minus the last slot, and its positions/mask."""
    tokens_BT = jnp.concatenate([prompt_tokens_BT, tokens_BR], axis=1)[:, :-1]
    attn_BT = jnp.concatenate(
        [prompt_mask_BT, jnp.ones_like(tokens_BR)], axis=1)[:, :-1].astype(jnp.int32)
    positions_BT = jnp.maximum(jnp.cumsum(attn_BT, axis=1) - 1, 0)
    return tokens_BT, positions_BT, attn_BT


def policy_logprobs(graphdef, params, batch, *, with_entropy: bool = False):
    """Log-probs (and entropies) of the response tokens under the policy `params`.

    `batch` holds left-padded `prompt_tokens_BT` / `prompt_mask_BT` and the R response
    slots `tokens_BR`; the head runs on response positions only, in chunks of the model's
    `logits_chunk` positions (`head_logprobs`).
    """
    model = nnx.merge(graphdef, params)
    Tp = batch["prompt_tokens_BT"].shape[1]
    tokens_BT, positions_BT, attn_BT = sequence_inputs(
        batch["prompt_tokens_BT"], batch["prompt_mask_BT"], batch["tokens_BR"])
    x_BTD = model.hidden_states(tokens_BT, positions_BT, attn_BT)
    return head_logprobs(model.logits, x_BTD[:, Tp - 1:], batch["tokens_BR"],
                         chunk=model.config.logits_chunk, with_entropy=with_entropy)


def clipped_surrogate(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    adv_B: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token negated clipped surrogate (clip-higher, optional dual clip c for A < 0);
    advantages per row [B] or per token [B, T].

    aux holds float 0/1 indicators per token: `clip_low_BT` (A < 0 and r < 1 - eps_low),
    `clip_high_BT` (A > 0 and r > 1 + eps_high): the clipped term is active and the
    token's gradient is zero; `clip_dual_BT` (A < 0 and the dual bound -c A is active).
    Also `ratio_BT` = r.
    """
    logp_BT = logp_BT.astype(jnp.float32)
    old_logp_BT = jax.lax.stop_gradient(old_logp_BT).astype(jnp.float32)
    a_B1 = jax.lax.stop_gradient(adv_B).astype(jnp.float32)
    a_B1 = a_B1[:, None] if a_B1.ndim == 1 else a_B1  # per row, or per token (packed rows)
    r_BT = jnp.exp(logp_BT - old_logp_BT)
    surr_BT = r_BT * a_B1
    clipped_BT = jnp.clip(r_BT, 1.0 - eps_low, 1.0 + eps_high) * a_B1
    loss_BT = -jnp.minimum(surr_BT, clipped_BT)
    rs_BT = jax.lax.stop_gradient(r_BT)
    aux = {
        "ratio_BT": rs_BT,
        "clip_low_BT": ((a_B1 < 0) & (rs_BT < 1.0 - eps_low)).astype(jnp.float32),
        "clip_high_BT": ((a_B1 > 0) & (rs_BT > 1.0 + eps_high)).astype(jnp.float32),
    }
    if dual_clip is None:
        aux["clip_dual_BT"] = jnp.zeros_like(rs_BT)
    else:
        bound_BT = -dual_clip * a_B1  # positive where A < 0
        dual_BT = (a_B1 < 0) & (loss_BT > bound_BT)
        loss_BT = jnp.where(dual_BT, bound_BT, loss_BT)
        aux["clip_dual_BT"] = jax.lax.stop_gradient(dual_BT).astype(jnp.float32)
    return loss_BT, aux


def kl_estimate(logp_BT: jax.Array, ref_logp_BT: jax.Array, kind: str) -> jax.Array:
    """Schulman's per-token estimators of KL(pi || ref) from tokens sampled from pi.

    With log rho = ref_logp - logp: k1 = -log rho, k2 = (log rho)^2 / 2,
    k3 = rho - 1 - log rho (unbiased and nonnegative).
    """
    log_rho_BT = ref_logp_BT.astype(jnp.float32) - logp_BT.astype(jnp.float32)
    if kind == "k1":
        return -log_rho_BT
    if kind == "k2":
        return 0.5 * log_rho_BT**2
    if kind == "k3":
        return jnp.expm1(log_rho_BT) - log_rho_BT
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")


def grpo_loss(
    logp_BT: jax.Array,
    old_logp_BT: jax.Array,
    adv_B: jax.Array,
    w_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    ref_logp_BT: jax.Array | None = None,
    kl_kind: str | None = None,
    kl_beta: float = 0.0,
    pg_factor_BT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """sum(w * (surrogate + kl_beta * kl)) with precomputed aggregation weights w_BT.

    `pg_factor_BT` (the rollout correction, `correction.pg_factor`) multiplies the per-token
    surrogate only, never the weights or the KL term: the rule still sees the batch as it
    was sampled, so its normalisation (Balanced Aggregation's per-sign means) is unchanged.

    Every metric is a sum over tokens, so summing over micro-batches is exact:
    `pg_loss`, `kl` are w-weighted sums (already normalised by the rule, like the
    loss); `weight_sum` = sum w; `num_tokens` = sum mask; `clip_low`, `clip_high`,
    `clip_dual` and `ratio` are mask-counted sums. Normalise after summing:
    clip fraction = clip_low / num_tokens, mean ratio = ratio / num_tokens.
    """
    w_BT = jax.lax.stop_gradient(w_BT).astype(jnp.float32)
    m_BT = mask_BT.astype(jnp.float32)
    pg_BT, aux = clipped_surrogate(
        logp_BT, old_logp_BT, adv_B, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip
    )
    if pg_factor_BT is not None:
        pg_BT = pg_BT * jax.lax.stop_gradient(pg_factor_BT).astype(jnp.float32)
    pg_loss = jnp.sum(w_BT * pg_BT)
    loss = pg_loss
    metrics = {"pg_loss": pg_loss}
    if kl_kind is not None:
        if ref_logp_BT is None:
            raise ValueError("kl_kind is set but ref_logp_BT is None")
        kl = jnp.sum(w_BT * kl_estimate(logp_BT, jax.lax.stop_gradient(ref_logp_BT), kl_kind))
        loss = loss + kl_beta * kl
        metrics["kl"] = kl
    metrics.update(
        loss=loss,
        weight_sum=jnp.sum(w_BT),
        num_tokens=jnp.sum(m_BT),
        clip_low=jnp.sum(m_BT * aux["clip_low_BT"]),
        clip_high=jnp.sum(m_BT * aux["clip_high_BT"]),
        clip_dual=jnp.sum(m_BT * aux["clip_dual_BT"]),
        ratio=jnp.sum(m_BT * aux["ratio_BT"]),
    )
    return loss, metrics


def settings_loss(loss: LossSettings, logp_BT, ent_BT, old_logp_BT, adv, w_BT, mask_BT, *,
                  ref_logp_BT=None, pg_factor_BT=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`grpo_loss` under the run's `LossSettings`, plus `entropy` (mask-weighted sum of
    `ent_BT`): the one loss of the padded step and the packed one (advantages per row or
    per token)."""
    total, m = grpo_loss(
        logp_BT, old_logp_BT, adv, w_BT, mask_BT, eps_low=loss.eps_low,
        eps_high=loss.eps_high, dual_clip=loss.dual_clip,
        ref_logp_BT=ref_logp_BT if loss.kl_kind else None, kl_kind=loss.kl_kind,
        kl_beta=loss.kl_beta, pg_factor_BT=pg_factor_BT)
    m["entropy"] = jnp.sum(mask_BT * ent_BT)
    return total, m


def _accumulator(x: jax.Array) -> jax.Array:
    # Sum floating leaves in float32 so bf16 grads do not lose precision over k steps.
    dtype = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    return jnp.zeros(x.shape, dtype)


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """`batch` (leaves with leading row dim B) -> leaves [k, B // k, ...]; micro-batch j
    holds rows j, j+k, j+2k, ...: a row-sharded batch keeps every micro-batch spread over
    all devices. `join_microbatches` inverts it."""
    k = int(num_microbatches)
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the row dim: {sorted(sizes)}")
    (rows,) = sizes
    if k < 1 or rows % k:
        raise ValueError(f"num_microbatches={k} must be >= 1 and divide the batch's {rows} rows")
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(rows // k, k, *x.shape[1:]), 0, 1),
                        batch)


def join_microbatches(micro: Any) -> Any:
    """Inverse of `split_microbatches`: leaves [k, B // k, ...] -> [B, ...] in row order."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), micro)


def reference_logprobs(graphdef, ref_params, batch, num_microbatches: int) -> jax.Array:
    """Response log-probs under the frozen reference policy, one micro-batch at a time
    (the policy's split), so the reference forward never holds more rows than a policy
    micro-batch does -> logp_BR float32."""
    micro = split_microbatches(batch, num_microbatches)
    logp_kbR = jax.lax.map(lambda mb: policy_logprobs(graphdef, ref_params, mb)[0], micro)
    return join_microbatches(logp_kbR)


def compute_copy(params: Any, dtype) -> Any:
    """A frozen copy of `params` for forward passes only: every matrix (ndim >= 2: the
    projections and the embedding) in the compute `dtype`, vectors (norm scales, biases)
    kept, so the copy's forward equals the policy's in that dtype. Elementwise, so each
    leaf keeps its sharding; a fresh buffer, so it outlives the donation of `params`."""
    def one(p):
        return p.astype(dtype) if p.ndim >= 2 else jnp.copy(p)

    return jax.tree.map(one, params)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]],
    params: Any,
    batch: Any,
    num_microbatches: int,
) -> tuple[jax.Array, Any, Any]:
    """Sum of loss, grads and aux of `loss_fn` over `num_microbatches` slices of `batch`.

    `batch` is a pytree of arrays with leading row dim B whose aggregation weights were
    computed on the whole batch, so the sum equals the full-batch result exactly.
    Micro-batches as `split_microbatches`.
    """
    k = int(num_microbatches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    micro = split_microbatches(batch, k)
    if k == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, grads, aux
    first = jax.tree.map(lambda x: x[0], micro)
    out_shape = jax.eval_shape(grad_fn, params, first)
    init = jax.tree.map(_accumulator, out_shape)

    def body(carry, mb):
        out = grad_fn(params, mb)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, out), None

    ((loss, aux), grads), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
    return loss, grads, aux
