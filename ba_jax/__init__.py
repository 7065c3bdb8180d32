"""ba_jax: GRPO-style RLVR in JAX with the loss aggregation rule as one config value."""

__version__ = "0.1.0"
