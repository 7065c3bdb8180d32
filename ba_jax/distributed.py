"""Multi-controller set-up: every host runs the same program; jax.distributed joins them.

What lives here: starting `jax.distributed` from the environment, and the few
cross-process helpers the RL loop needs (gathering host-side rows, the process-local mesh
and weights each host samples with on all of its devices, global arrays from local rows).
What does not: the mesh (sharding.py) or the loop (train.py).

Environment (one process per host, all started with the same command):
* `BA_JAX_COORDINATOR=host:port`, `BA_JAX_NUM_PROCESSES=N`, `BA_JAX_PROCESS_ID=i`:
  explicit set-up (GPU hosts, the localhost test);
* `BA_JAX_DISTRIBUTED=auto`: `jax.distributed.initialize()` detects the cluster itself
  (TPU VMs of a pod slice, SLURM);
* neither: a single process (the default).
On CPU, cross-process collectives use gloo.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

_started = False


def maybe_initialize() -> None:
    """Join the other processes of this run if the environment names them (idempotent)."""
    global _started
    if _started:
        return
    coordinator = os.environ.get("BA_JAX_COORDINATOR")
    if coordinator:
        if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["BA_JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["BA_JAX_PROCESS_ID"]),
        )
    elif os.environ.get("BA_JAX_DISTRIBUTED") == "auto":
        jax.distributed.initialize()
    _started = True


def is_primary() -> bool:
    """Process 0 writes logs, plots and progress; every process writes its checkpoint part."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def all_processes(flag: bool) -> bool:
    """True when `flag` is true on every process (keeps data-dependent loops in step)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.array([flag]))))


def any_process(flag: bool) -> bool:
    """True when `flag` is true on some process (all processes call it at the same point)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def gather_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate per-process host rows in process order (identity with one process)."""
    if jax.process_count() == 1:
        return rows
    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in rows.items()}


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of `mesh`, as a mesh of the same axes where each keeps its
    `tensor` coordinate: rows go over (data, fsdp) of the process's own devices. ValueError
    if a tensor group spans processes (the sampler then has no whole weights on a host)."""
    me = jax.process_index()
    mine = [(idx, d) for idx, d in np.ndenumerate(mesh.devices) if d.process_index == me]
    t = mesh.shape.get("tensor", 1)
    tensor_at = mesh.axis_names.index("tensor") if "tensor" in mesh.axis_names else None
    if len(mine) % t or any(tensor_at is not None and idx[tensor_at] != i % t
                            for i, (idx, _) in enumerate(mine)):
        raise ValueError(f"the mesh's tensor axis ({t}) spans processes: each process must hold "
                         "whole tensor groups to sample on its own devices")
    sizes = [len(mine) // t if a == "data" else t if a == "tensor" else 1
             for a in mesh.axis_names]
    return Mesh(np.array([d for _, d in mine]).reshape(sizes), mesh.axis_names)


def to_local(tree, mesh: Mesh):
    """Arrays of `tree`, whole over the row axes of their global mesh (`engine.call.decode_copy`),
    as arrays on this process's `mesh` (`local_mesh`) with the same spec: each local device
    keeps the shard it already holds, nothing moves. With one process: `tree` itself."""
    if jax.process_count() == 1:
        return tree

    def one(x):
        shards = {s.device: s.data for s in x.addressable_shards}
        sh = NamedSharding(mesh, x.sharding.spec)
        return jax.make_array_from_single_device_arrays(
            x.shape, sh, [shards[d] for d in mesh.devices.flat])

    return jax.tree.map(one, tree)


def put_local_rows(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays whose rows are this process's rows (in process order)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def put_global(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays from host data that every process holds in full."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in batch.items()}
