"""Loss aggregation rules, each written as per-token weights (spec: aggregation.md).

A rule maps the masks, advantages and group ids of the *whole optimizer batch* to
weights `w_BT = mask_BT * c_B`, and the loss is one weighted sum `sum(w_BT * loss_BT)`.
Weights are computed once per optimizer step, before any micro-batch or device split,
which is what makes gradient accumulation and data parallelism exact. They are never
differentiated through.

Conventions this module owns (the spec leaves them open):
* A row is *present* when its mask has at least one token and its group id lies in
  `[0, num_groups)`. Absent rows (padding, zero-length responses) get weight 0 and do
  not count anywhere: not in N (rows), not in a group's size G_g, not in B (groups).
  So padding rows are harmless whatever group id they carry.
* B counts group ids with at least one present row (not `num_groups`, which is only
  a static upper bound). With `count_degenerate_groups=False`, B counts only groups
  with at least one nonzero advantage. The option changes B only (`token_group`,
  `balanced`); the other rules do not use B.
* `constant` uses C = `max_len`, defaulting to the mask width T.

What does not live here: the per-token loss (grpo.py), micro-batching (grpo.py).
Shape letters: B rows, T tokens, P groups (prompts).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

RULES = (
    "token",
    "token_group",
    "sequence",
    "sequence_sum",
    "constant",
    "balanced",
    "balanced_batch",
)

# A rule: (mask_BT, adv_B, group_id_B, num_groups, **options) -> w_BT (or c_B, one
# factor per row, which token_weights broadcasts over the mask).
Rule = Callable[..., jax.Array]


class _Stats(NamedTuple):
    """Row and group counts shared by every rule (all float32)."""

    len_B: jax.Array  # response length L_i (0 for absent rows)
    present_B: jax.Array  # 1 for present rows
    pos_B: jax.Array  # 1 for present rows with A > 0
    neg_B: jax.Array  # 1 for present rows with A < 0
    gid_B: jax.Array  # group id clipped into range, for gathers
    size_P: jax.Array  # G_g: present rows per group
    npos_P: jax.Array  # n+_g
    nneg_P: jax.Array  # n-_g
    tall_P: jax.Array  # T_g: tokens per group
    tpos_P: jax.Array  # T+_g
    tneg_P: jax.Array  # T-_g
    num_rows: jax.Array  # N
    num_groups_all: jax.Array  # B counting degenerate groups
    num_groups_active: jax.Array  # B without degenerate groups


def safe_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b where b > 0, else 0 (both branches finite, so no NaN in any gradient)."""
    ok = b > 0
    return jnp.where(ok, a / jnp.where(ok, b, 1.0), 0.0)


def _stats(mask_BT: jax.Array, adv_B: jax.Array, group_id_B: jax.Array, num_groups: int) -> _Stats:
    """Masked segment reductions over the whole batch; no loop over rows or groups."""
    mask_BT = jax.lax.stop_gradient(mask_BT).astype(jnp.float32)
    adv_B = jax.lax.stop_gradient(adv_B)
    group_id_B = group_id_B.astype(jnp.int32)
    len_B = mask_BT.sum(axis=1)
    in_range_B = (group_id_B >= 0) & (group_id_B < num_groups)
    present_B = ((len_B > 0) & in_range_B).astype(jnp.float32)
    len_B = len_B * present_B
    pos_B = present_B * (adv_B > 0)
    neg_B = present_B * (adv_B < 0)
    gid_B = jnp.clip(group_id_B, 0, num_groups - 1)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=gid_B, num_segments=num_groups)
    size_P, npos_P, nneg_P = seg(present_B), seg(pos_B), seg(neg_B)
    return _Stats(
        len_B=len_B,
        present_B=present_B,
        pos_B=pos_B,
        neg_B=neg_B,
        gid_B=gid_B,
        size_P=size_P,
        npos_P=npos_P,
        nneg_P=nneg_P,
        tall_P=seg(len_B),
        tpos_P=seg(len_B * pos_B),
        tneg_P=seg(len_B * neg_B),
        num_rows=present_B.sum(),
        num_groups_all=(size_P > 0).sum().astype(jnp.float32),
        num_groups_active=((npos_P + nneg_P) > 0).sum().astype(jnp.float32),
    )


def _builtin(c_fn: Callable[[_Stats, jax.Array, int], jax.Array]) -> Rule:
    """Wrap `c_fn(stats, B, C) -> c_B` as a rule with the public signature, -> w_BT."""

    def rule(
        mask_BT: jax.Array,
        adv_B: jax.Array,
        group_id_B: jax.Array,
        num_groups: int,
        *,
        max_len: int | None = None,
        count_degenerate_groups: bool = True,
    ) -> jax.Array:
        s = _stats(mask_BT, adv_B, group_id_B, num_groups)
        num_b = s.num_groups_all if count_degenerate_groups else s.num_groups_active
        c_B = c_fn(s, num_b, mask_BT.shape[1] if max_len is None else max_len)
        return mask_BT.astype(jnp.float32) * c_B[:, None]

    rule.__name__ = rule.__qualname__ = c_fn.__name__
    return rule


@_builtin
def _token(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    return s.present_B * safe_div(1.0, s.len_B.sum())


@_builtin
def _token_group(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    c_P = safe_div(1.0, num_b * s.tall_P)
    return s.present_B * c_P[s.gid_B]


@_builtin
def _sequence(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    return s.present_B * safe_div(1.0, s.num_rows * s.len_B)


@_builtin
def _sequence_sum(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    return s.present_B * safe_div(1.0, s.num_rows)


@_builtin
def _constant(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    return s.present_B * safe_div(1.0, s.num_rows * max_len)


@_builtin
def _balanced(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    # 1 / (B G_g Lbar+-_g) written as n+-_g / (B G_g T+-_g): one division, no 0/0.
    bg_P = num_b * s.size_P
    cpos_P = safe_div(s.npos_P, bg_P * s.tpos_P)
    cneg_P = safe_div(s.nneg_P, bg_P * s.tneg_P)
    return s.pos_B * cpos_P[s.gid_B] + s.neg_B * cneg_P[s.gid_B]


@_builtin
def _balanced_batch(s: _Stats, num_b: jax.Array, max_len: int) -> jax.Array:
    # 1 / (N Lbar+-) with Lbar+- pooled over the batch's positive / negative rows.
    cpos = safe_div(s.pos_B.sum(), s.num_rows * (s.len_B * s.pos_B).sum())
    cneg = safe_div(s.neg_B.sum(), s.num_rows * (s.len_B * s.neg_B).sum())
    return s.pos_B * cpos + s.neg_B * cneg


_BUILTIN: dict[str, Rule] = {
    "token": _token,
    "token_group": _token_group,
    "sequence": _sequence,
    "sequence_sum": _sequence_sum,
    "constant": _constant,
    "balanced": _balanced,
    "balanced_batch": _balanced_batch,
}
assert tuple(_BUILTIN) == RULES
_BUILTIN_OPTIONS = ("max_len", "count_degenerate_groups")


def resolve_rule(rule: str | Rule) -> Rule:
    """Turn a rule name, a 'pkg.mod:fn' / 'pkg.mod.fn' path, or a function into a function."""
    if callable(rule):
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a name, a dotted path or a function, got {rule!r}")
    if rule in _BUILTIN:
        return _BUILTIN[rule]
    if ":" not in rule and "." not in rule:
        raise ValueError(f"unknown aggregation rule {rule!r}; valid names: {', '.join(RULES)}")
    if ":" in rule:
        module_name, _, attr = rule.partition(":")
    else:
        module_name, _, attr = rule.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"cannot resolve aggregation rule {rule!r} ({err}); valid names: {', '.join(RULES)}"
        ) from err
    if not callable(fn):
        raise ValueError(f"aggregation rule {rule!r} resolves to a non-callable {fn!r}")
    return fn


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _weights(
    fn: Rule,
    mask_BT: jax.Array,
    adv_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    options: tuple[tuple[str, Any], ...],
) -> jax.Array:
    out = fn(mask_BT, adv_B, group_id_B, num_groups, **dict(options))
    mask_BT = mask_BT.astype(jnp.float32)
    # A rule may return c_B or w_BT; the mask is applied either way.
    w_BT = mask_BT * out[:, None] if out.ndim == 1 else mask_BT * out
    return jax.lax.stop_gradient(w_BT.astype(jnp.float32))


def token_weights(
    rule: str | Rule,
    mask_BT: jax.Array,
    adv_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    *,
    max_len: int | None = None,
    count_degenerate_groups: bool = True,
    **rule_options: Any,
) -> jax.Array:
    """Per-token float32 weights w_BT of `rule` for the whole optimizer batch."""
    fn = resolve_rule(rule)
    options = dict(max_len=max_len, count_degenerate_groups=count_degenerate_groups)
    options.update(rule_options)  # extra options reach user rules; must be hashable
    options = tuple(sorted(options.items()))
    return _weights(fn, mask_BT, adv_B, group_id_B, int(num_groups), options)


def aggregate(
    rule: str | Rule,
    loss_BT: jax.Array,
    mask_BT: jax.Array,
    adv_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    **options: Any,
) -> jax.Array:
    """The aggregated scalar loss sum(w_BT * loss_BT) under `rule`."""
    w_BT = token_weights(rule, mask_BT, adv_B, group_id_B, num_groups, **options)
    return jnp.sum(w_BT * loss_BT.astype(jnp.float32))


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _diagnostics(
    fn: Rule,
    mask_BT: jax.Array,
    adv_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    options: tuple[tuple[str, Any], ...],
) -> dict[str, jax.Array]:
    s = _stats(mask_BT, adv_B, group_id_B, num_groups)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=s.gid_B, num_segments=num_groups)
    mixed_P = ((s.npos_P > 0) & (s.nneg_P > 0)).astype(jnp.float32)
    num_mixed = mixed_P.sum()

    def mean_over_mixed(x_P):
        return safe_div((x_P * mixed_P).sum(), num_mixed)

    def cv(rows_B, count_P, total_P):
        # Population std / mean of L over the rows selected by rows_B, per group.
        mean_P = safe_div(total_P, count_P)
        var_P = safe_div(seg(rows_B * (s.len_B - mean_P[s.gid_B]) ** 2), count_P)
        return safe_div(jnp.sqrt(var_P), mean_P), mean_P

    cv_P, mean_len_P = cv(s.present_B, s.size_P, s.tall_P)
    cv_pos_P, mean_pos_P = cv(s.pos_B, s.npos_P, s.tpos_P)
    cv_neg_P, mean_neg_P = cv(s.neg_B, s.nneg_P, s.tneg_P)
    adv_B = jax.lax.stop_gradient(adv_B).astype(jnp.float32)

    def sequence_weight(rule_fn, opts):
        return _weights(rule_fn, mask_BT, adv_B, group_id_B, num_groups, opts).sum(axis=1)

    w_B = sequence_weight(fn, options)
    w_token_B = sequence_weight(_token, tuple(o for o in options if o[0] in _BUILTIN_OPTIONS))
    mass_P = seg(w_B * adv_B * s.present_B)
    mass_token_P = seg(w_token_B * adv_B * s.present_B)
    return {
        "num_mixed_groups": num_mixed,
        "mean_length": mean_over_mixed(mean_len_P),
        "length_cv": mean_over_mixed(cv_P),
        "length_cv_pos": mean_over_mixed(cv_pos_P),
        "length_cv_neg": mean_over_mixed(cv_neg_P),
        "length_gap": mean_over_mixed(safe_div(mean_neg_P, mean_pos_P)),
        "pos_weight_share": mean_over_mixed(safe_div(seg(w_B * s.pos_B), seg(w_B * s.present_B))),
        "signed_mass": mean_over_mixed(mass_P),
        "signed_mass_token": mean_over_mixed(mass_token_P),
        # Scale-free versions: sum W A / sum W |A|, in [-1, 1].
        "signed_mass_rel": mean_over_mixed(
            safe_div(mass_P, seg(w_B * jnp.abs(adv_B) * s.present_B))
        ),
        "signed_mass_token_rel": mean_over_mixed(
            safe_div(mass_token_P, seg(w_token_B * jnp.abs(adv_B) * s.present_B))
        ),
    }


def diagnostics(
    rule: str | Rule,
    mask_BT: jax.Array,
    adv_B: jax.Array,
    group_id_B: jax.Array,
    num_groups: int,
    **options: Any,
) -> dict[str, jax.Array]:
    """Per-step length and balance scalars, averaged over mixed groups (n+ > 0 and n- > 0).

    Keys: num_mixed_groups; mean_length; length_cv (population std / mean of L, all
    rows), length_cv_pos, length_cv_neg (within each sign subset); length_gap
    (Lbar- / Lbar+); pos_weight_share (sum of W_i = sum_t w[i,t] over positive rows /
    over all rows of the group, active rule); signed_mass and signed_mass_token
    (sum_i W_i A_i per group, active rule and `token`), and their _rel versions
    divided by sum_i W_i |A_i|. Every value is 0 when there is no mixed group.
    """
    fn = resolve_rule(rule)
    opts = dict(max_len=None, count_degenerate_groups=True)
    opts.update(options)
    options = tuple(sorted(opts.items()))
    return _diagnostics(fn, mask_BT, adv_B, group_id_B, int(num_groups), options)


def check_rule(rule: str | Rule, **options: Any) -> None:
    """Run `rule` once on a small synthetic batch the way the trainer does (jitted, with
    `options`) and raise ValueError saying what is wrong: it raises, does not take
    `**options`, returns None or an array not shaped (B,) or (B, T), or gives a
    non-finite weight. Six rows in two groups, mixed advantage signs, varied lengths."""
    mask_BT = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], jnp.int32)
    adv_B = jnp.asarray([1.0, -0.5, -0.5, 0.8, -0.8, 0.0], jnp.float32)
    group_id_B = jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)
    batch = "a synthetic batch of 6 rows x 5 tokens in 2 groups"
    try:
        fn = resolve_rule(rule)
        out = jax.eval_shape(lambda m, a, g: fn(m, a, g, 2, **options), mask_BT, adv_B, group_id_B)
    except TypeError as e:
        raise ValueError(f"fails on {batch}: TypeError: {e} (a rule is called as "
                         f"fn(mask_BT, adv_B, group_id_B, num_groups, **options) with options "
                         f"{sorted(options)}; declare **options)") from e
    except Exception as e:  # noqa: BLE001 - whatever a user's rule raises, said at start-up
        raise ValueError(f"fails on {batch}: {type(e).__name__}: {e}") from e
    if out is None:
        raise ValueError(f"returned None on {batch}; it must return w_BT (6, 5) or c_B (6,)")
    shape = getattr(out, "shape", None)
    if shape not in ((6,), (6, 5)):
        got = f"shape {tuple(shape)}" if shape is not None else type(out).__name__
        raise ValueError(f"returned {got} on {batch}; expected w_BT (6, 5) or c_B (6,)")
    w_BT = token_weights(fn, mask_BT, adv_B, group_id_B, 2, **options)
    if not bool(jnp.all(jnp.isfinite(w_BT))):
        raise ValueError(f"gives non-finite weights on {batch}: {jax.device_get(w_BT).tolist()}")
