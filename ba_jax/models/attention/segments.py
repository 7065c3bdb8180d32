"""Packed rows: several sequences side by side in one row, told apart by segment ids.

A `Segments` value goes with a [B, T] batch whose rows each hold one or more sequences
(a packed train step's [rows, budget] blocks). `ids_BT[b, t]` is the segment of token t:
any positive integer is a segment, 0 or less is padding. Query t attends key s iff
s <= t and ids[t] == ids[s] > 0: causal within a segment, nothing across segments, and a
padding token attends to nothing (its output is 0). Every kernel of the seam takes any
layout; the ones that exploit it need a packer's layout, each segment one contiguous run
with ids increasing along the row (pads anywhere else): `chunked` then visits only the
(query block, key block) pairs that share a segment, and `cudnn` hands cuDNN one ragged
sequence per run.

Lives here: `Segments`, `token_ids` (the one normalisation every kernel receives),
`positions` (each token's index within its segment, for RoPE) and `from_lengths` (ids of
rows packed from lists of lengths). Not here: the packing itself (which sequences share a
row), the kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """The segment layout of a packed batch."""

    # [B, T] integer: > 0 the token's segment, <= 0 padding.
    ids_BT: jax.Array
    # Static bound on the contiguous runs of one row (segments per row): the size of
    # cuDNN's packed layout (its softmax statistics are [B * max_segments, N, T]);
    # 0: T, always enough. A row with more runs makes cudnn return NaN, never a wrong
    # number. Ignored by the other kernels.
    max_segments: int = dataclasses.field(default=0, metadata=dict(static=True))


def token_ids(valid_BT: jax.Array, segments: Segments | None) -> jax.Array:
    """int32 [B, T] segment ids with every padding token 0: a token is real iff valid_BT
    and (with segments) its id is positive. Without segments each row is one segment
    (id 1), so one mask rule serves both."""
    valid_BT = valid_BT.astype(bool)
    if segments is None:
        return valid_BT.astype(jnp.int32)
    ids_BT = segments.ids_BT.astype(jnp.int32)
    if ids_BT.shape != valid_BT.shape:
        raise ValueError(f"segment ids {ids_BT.shape} must have the shape of the rows "
                         f"{valid_BT.shape}")
    return jnp.where(valid_BT & (ids_BT > 0), ids_BT, 0)


def positions(ids_BT: jax.Array) -> jax.Array:
    """Each token's index within its contiguous run of equal ids (RoPE positions of a
    packed row: every sequence starts at 0); padding tokens get 0."""
    T = ids_BT.shape[1]
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids_BT.shape)
    prev_BT = jnp.pad(ids_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start_BT = jax.lax.cummax(jnp.where(ids_BT != prev_BT, t_BT, 0), axis=1)
    return jnp.where(ids_BT > 0, t_BT - start_BT, 0)


def from_lengths(lengths: list[list[int]], T: int, left_pad: list[int] | None = None
                 ) -> np.ndarray:
    """int32 [len(lengths), T] ids of rows packed from per-row lists of sequence lengths:
    row b is `left_pad[b]` pads, then segments 1, 2, ... of those lengths, then pads."""
    ids = np.zeros((len(lengths), T), np.int32)
    for b, row in enumerate(lengths):
        t = 0 if left_pad is None else left_pad[b]
        for i, n in enumerate(row):
            ids[b, t:t + n] = i + 1
            t += n
        if t > T:
            raise ValueError(f"row {b}: {t} tokens in a row of {T}")
    return ids
