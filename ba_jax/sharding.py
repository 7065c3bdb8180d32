"""Device mesh, parameter and activation shardings, as data.

Lives here: the mesh axes (`data`, `fsdp`, `tensor`), `make_mesh`, the ordered regex table
from parameter path to logical axes (`PARAM_AXES`), the one logical -> mesh rules table for
parameters and activations (`DEFAULT_RULES`), `param_shardings`, `constrain` (the model's
activation constraints) and the batch-row sharding helpers. Not here: how a trainer or
sampler jits with these shardings.

A parameter path is its nnx state path joined with dots, e.g.
`layers.self_attn.q_proj.kernel` (decoder layers are stacked on a
leading `layers` axis). Every Qwen parameter matches exactly one `PARAM_AXES`
pattern (tests check both architectures). A mesh axis that does not divide a dimension is
dropped for that dimension (e.g. 2 kv heads on tensor=4 stay replicated), so every preset
fits every mesh.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over both; fsdp also splits parameters

# Ordered table: parameter path (full match) -> one logical axis name per dimension.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"embed_tokens\.embedding", ("vocab", "embed")),
    (r"layers\.self_attn\.q_proj\.kernel", ("layers", "embed", "heads", "head_dim")),
    (r"layers\.self_attn\.[kv]_proj\.kernel", ("layers", "embed", "kv_heads", "head_dim")),
    (r"layers\.self_attn\.q_proj\.bias", ("layers", "heads", "head_dim")),
    (r"layers\.self_attn\.[kv]_proj\.bias", ("layers", "kv_heads", "head_dim")),
    (r"layers\.self_attn\.o_proj\.kernel", ("layers", "heads", "head_dim", "embed")),
    (r"layers\.self_attn\.o_proj\.bias", ("layers", "norm")),
    (r"layers\.self_attn\.[qk]_norm\.scale", ("layers", "norm")),
    (r"layers\.mlp\.(gate|up)_proj\.kernel", ("layers", "embed", "mlp")),
    (r"layers\.mlp\.down_proj\.kernel", ("layers", "mlp", "embed")),
    (r"layers\.(input|post_attention)_layernorm\.scale", ("layers", "norm")),
    (r"norm\.scale", ("norm",)),
    (r"lm_head\.kernel", ("embed", "vocab")),
)

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated), for parameters
# and (`act_*`) activations alike. Under FSDP a weight is split on its hidden dimension
# (`embed`) while an activation is split on its rows (`act_batch`) and keeps its hidden
# dimension whole: each layer gathers its weights, never the batch. `tensor` splits heads,
# the MLP width and the vocabulary of both.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the stacked decoder layers' axis: scanned over, never split by default
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "act_batch": BATCH_AXES,
    "act_length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def resolve_mesh_shape(shape: Mapping[str, int] | Sequence[int], num_devices: int, *,
                       exact: bool = False) -> dict[str, int]:
    """Axis sizes of a (`data`, `fsdp`, `tensor`) mesh, with at most one -1 resolved to the
    devices left over; a dict may omit axes (size 1). `exact`: the mesh must use all
    `num_devices` (else at most that many). ValueError naming the problem otherwise."""
    if isinstance(shape, Mapping):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
        sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    else:
        if len(shape) != len(MESH_AXES):
            raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
        sizes = dict(zip(MESH_AXES, map(int, shape)))
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1:
        raise ValueError(f"at most one axis may be -1, got {sizes}")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if fixed < 1 or any(n < -1 or n == 0 for n in sizes.values()) or (
            free and num_devices % fixed):
        raise ValueError(f"{sizes} does not fit {num_devices} devices")
    if free:
        sizes[free[0]] = num_devices // fixed
    n = math.prod(sizes.values())
    if n > num_devices or (exact and n != num_devices):
        raise ValueError(f"{sizes} uses {n} devices but {num_devices} are present")
    return sizes


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices=None) -> Mesh:
    """Mesh over (`data`, `fsdp`, `tensor`) on the first devices it needs (`resolve_mesh_shape`)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = list(resolve_mesh_shape(shape, len(devices)).values())
    return Mesh(np.array(devices[:math.prod(sizes)]).reshape(sizes), MESH_AXES)


def logical_axes(path: str) -> tuple[str, ...]:
    """Logical axes of the parameter at dotted `path`; error unless exactly one rule matches."""
    hits = [axes for pattern, axes in PARAM_AXES if re.fullmatch(pattern, path)]
    if len(hits) != 1:
        raise ValueError(f"parameter {path!r} matches {len(hits)} PARAM_AXES rules, expected 1")
    return hits[0]


def path_str(key_path: Sequence[Any]) -> str:
    """Dotted parameter path from a jax key path (skipping nnx's `.value` attribute)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
    return ".".join(parts)


def spec_for(path: str, shape: Sequence[int], mesh: Mesh, rules=None) -> P:
    """PartitionSpec of one parameter; mesh axes that do not divide a dimension are dropped."""
    axes = logical_axes(path)
    if len(axes) != len(shape):
        raise ValueError(f"parameter {path!r}: logical axes {axes} do not fit shape {tuple(shape)}")
    return logical_spec(axes, shape, mesh, rules)


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh, rules=None) -> P:
    """PartitionSpec of an array whose dimensions have logical `axes` (None: replicated) on
    `mesh` (concrete or abstract); mesh axes that do not divide a dimension are dropped."""
    rules = DEFAULT_RULES if rules is None else rules
    # inside a shard_map the manual axes are already split by hand: never named again
    spec, used = [], set(getattr(mesh, "manual_axes", ()))
    for size, name in zip(shape, axes):
        target = rules.get(name) if name else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        # each mesh axis at most once per array, and only where it divides the dimension
        targets = tuple(a for a in targets if a not in used)
        if targets and size % math.prod(mesh.shape[a] for a in targets) == 0:
            used.update(targets)
            spec.append(targets[0] if len(targets) == 1 else targets)
        else:
            spec.append(None)
    return P(*spec)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the logical `axes` on the mesh in context (`jax.sharding.
    use_abstract_mesh`, as the train step traces), or `x` itself when there is none (a
    sampler or test on one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(n for a, n in mesh.shape.items() if a not in mesh.manual_axes) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))


def param_shardings(model_state, mesh: Mesh, rules=None):
    """NamedSharding pytree with the structure of `model_state` (nnx State or pure dict)."""

    def one(key_path, leaf):
        return NamedSharding(mesh, spec_for(path_str(key_path), leaf.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, model_state)


# The decode layout: weights whole on every row device (no per-token gather of FSDP-split
# hidden dimensions), still split over `tensor`; rows split over (`data`, `fsdp`).
DECODE_RULES = dict(DEFAULT_RULES, embed=None)


def decode_shardings(model_state, mesh: Mesh):
    """NamedSharding pytree of `model_state` for decoding (`DECODE_RULES`)."""
    return param_shardings(model_state, mesh, DECODE_RULES)


def row_axes(mesh) -> tuple[str, ...]:
    """The mesh axes rows are split over (`BATCH_AXES` present in `mesh`, not manual)."""
    return tuple(a for a in BATCH_AXES if a in mesh.shape and a not in mesh.manual_axes)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (the leading axis) over (`data`, `fsdp`), every other dim replicated.

    The one sharding of batch rows: the spec names only the leading axis, so it fits arrays
    of every rank, and a dict of arrays of different ranks (a train batch) is placed, or
    given as a jitted step's `in_shardings`, with this one value.
    """
    return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch, mesh: Mesh):
    """device_put every array of a batch pytree with its rows split over (`data`, `fsdp`)."""
    return jax.device_put(batch, batch_sharding(mesh))
