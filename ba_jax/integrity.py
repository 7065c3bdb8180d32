"""Whether a train state is whole: finite values, and the same bits as when it was saved.

What lives here: `all_finite` (one traced boolean over a pytree's floating leaves: the train
step's guard on its new state) and `summary` (per array: finite or not, and a checksum of
its bits), which checkpoint.py stores beside every save and compares on every restore.
What does not: what to do about a bad state (checkpoint.py refuses it, train.py keeps the
old one).

The checksum is a position-weighted sum of the array's bits as unsigned 32-bit words,
wrapping modulo 2**32, computed on the devices where the array lives: integer addition is
exact and associative, so the value is the same for any sharding, device count or reduction
order, and a flipped byte changes it (unless 2**32 other changes cancel it). It is a check
against damage, not a cryptographic hash.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B1  # odd: i -> i * _GOLDEN + 1 permutes the 32-bit words' positions


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)


def all_finite(tree: Any) -> jax.Array:
    """True when every floating leaf of `tree` holds only finite values (traceable)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _floating(x)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _bits(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words, in `x`'s own shape (16- and 8-bit types widened;
    64-bit types split into a trailing axis of 2), so the sharding carries over."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    word = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """sum_i bits[i] * (i * _GOLDEN + 1) mod 2**32 over the row-major word index i, built
    from per-axis iotas (no reshape, which would gather a sharded array)."""
    bits = _bits(x)
    index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    for axis in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(
            stride)
        stride = stride * bits.shape[axis] % (1 << 32)
    return jnp.sum(bits * (index * jnp.uint32(_GOLDEN) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _summarize(leaves: list) -> tuple[list, list]:
    finite = [jnp.all(jnp.isfinite(x)) if _floating(x) else jnp.array(True) for x in leaves]
    return finite, [_checksum(x) for x in leaves]


def paths(tree: Any) -> list[str]:
    """Dotted paths of `tree`'s leaves (nnx's `.value` level dropped), in leaf order."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        out.append(".".join(k for k in keys if k != "value"))
    return out


def summary(tree: Any) -> dict[str, tuple[bool, int]]:
    """Dotted path -> (finite, checksum) for every array leaf of `tree` (one jitted pass on
    the arrays' own devices; only the scalars come to the host)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    names = [p for p, x in zip(paths(tree), jax.tree.leaves(tree)) if hasattr(x, "dtype")]
    finite, sums = jax.device_get(_summarize(leaves))
    return {n: (bool(f), int(np.uint32(s))) for n, f, s in zip(names, finite, sums)}


def nonfinite(s: dict[str, tuple[bool, int]]) -> list[str]:
    """The paths of `summary` `s` whose arrays hold a NaN or an infinity."""
    return [p for p, (finite, _) in s.items() if not finite]


def differing(s: dict[str, tuple[bool, int]], saved: dict[str, int]) -> list[str]:
    """The paths whose checksum differs from `saved` (path -> checksum, as stored)."""
    return [p for p, (_, c) in s.items() if p in saved and int(saved[p]) != c]
