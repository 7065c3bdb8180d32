"""ba_jax: GRPO-style RLVR in JAX with the loss aggregation rule as one config value."""

__version__ = "0.1.0"

from ba_jax import compat as _compat  # noqa: E402

_compat.quiet_transformers_without_torch()
