"""How a Pallas kernel (never auto-partitioned by XLA) is cut under the mesh in context.

One rule for splash and the paged-attention kernels: rows over the mesh's data/fsdp axes,
kv heads over tensor, each where it divides and is not already manual.
"""

import jax


def kernel_split(B: int, K: int):
    """How a Pallas kernel (not auto-partitioned) is cut under the mesh in context ->
    (mesh, (row axes spec, kv-head axis)) for a shard_map: rows over the mesh's data/fsdp
    axes and kv heads over tensor, each where it divides and is not already manual;
    (mesh, None) when nothing is split."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return mesh, None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows, n_rows = [], 1
    for axis in ("data", "fsdp"):
        if axis in sizes and axis not in mesh.manual_axes and B % (n_rows * sizes[axis]) == 0:
            rows.append(axis)
            n_rows *= sizes[axis]
    heads = ("tensor" if "tensor" in sizes and "tensor" not in mesh.manual_axes
             and K % sizes["tensor"] == 0 else None)
    if not rows and heads is None:
        return mesh, None
    return mesh, (tuple(rows) or None, heads)

