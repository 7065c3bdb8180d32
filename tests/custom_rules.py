"""Aggregation rules named by "custom_rules:<fn>" in tests: one good, the rest each broken
in one way a user's rule could be (tests/test_reliability.py checks each at start-up)."""

import jax.numpy as jnp


def per_sequence(mask_BT, adv_B, group_id_B, num_groups, **options):
    """A valid rule: 1 / (rows * L_i), one factor per row."""
    len_B = mask_BT.sum(axis=1).astype(jnp.float32)
    return 1.0 / (mask_BT.shape[0] * jnp.maximum(len_B, 1.0))


def raises(mask_BT, adv_B, group_id_B, num_groups, **options):
    raise RuntimeError("this rule is broken")


def no_options(mask_BT, adv_B, group_id_B, num_groups):
    return jnp.ones(mask_BT.shape[0])


def wrong_shape(mask_BT, adv_B, group_id_B, num_groups, **options):
    return jnp.ones((num_groups,))


def returns_none(mask_BT, adv_B, group_id_B, num_groups, **options):
    return None


def not_finite(mask_BT, adv_B, group_id_B, num_groups, **options):
    return 1.0 / (adv_B * 0.0)  # 0/0 and 1/0 per row
