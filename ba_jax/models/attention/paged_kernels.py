"""jax's Pallas paged-attention kernels behind the paged seam: TPU (Mosaic) and GPU (Triton).

Both read only the pages below each row's length; both are cut under a mesh by
`partition.kernel_split` (Pallas kernels are not auto-partitioned). Not here: choosing one
(`dispatch.paged_impl`), the gather path (`paged`).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ba_jax import compat
from ba_jax.models.attention.partition import kernel_split
from ba_jax.models.attention.reference import F32


def paged_kernel(impl, q_BNH, k_pool, v_pool, table_BX, lengths_B, pages_per_block, *,
                 interpret: bool = False):
    """jax's Pallas paged-attention kernel `impl` ("pallas_tpu" or "pallas_gpu") over the
    pool; semantics of `paged.paged_decode_attention` with the row's own key in the pool.
    `interpret` runs the GPU kernel in the Pallas interpreter (the TPU one takes jax's
    `pltpu.force_tpu_interpret_mode`)."""
    B, N, H = q_BNH.shape
    K = k_pool.shape[0]
    X = table_BX.shape[1]
    ppb = max(1, min(pages_per_block, X))
    if impl == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention as tpu_kernel

        splits = 1

        def call(q, k_pool, v_pool, table_BX, lengths_B):
            return tpu_kernel.paged_attention(q, k_pool, v_pool, lengths_B, table_BX,
                                              pages_per_compute_block=ppb)
    else:
        gpu_paged_attention = compat.gpu_paged_kernel()
        if gpu_paged_attention is None:
            raise ValueError("this jax ships no Pallas GPU paged-attention kernel: use the "
                             "gather path (attention.paged_impl picks it)")

        # Triton takes power-of-two blocks: ppb pages (of a power-of-two size); the table is
        # cut into `splits` partitions run in parallel and merged (split-K)
        ppb = 1 << (ppb.bit_length() - 1)
        splits = max(1, min(16, X // ppb))

        def call(q, k_pool, v_pool, table_BX, lengths_B):
            return gpu_paged_attention(q, k_pool, v_pool, table_BX, lengths_B,
                                              pages_per_compute_block=ppb, k_splits=splits,
                                              interpret=interpret)
    # the kernel's blocks of pages must divide the table: pad it with page 0 (never read,
    # being past every length)
    table_BX = jnp.pad(table_BX, ((0, 0), (0, -X % (ppb * splits))))

    def local(q_BNH, k_pool, v_pool, table_BX, lengths_B):
        # the kernels have no scale argument: fold it into q (one extra rounding in bf16)
        q = (q_BNH.astype(F32) / math.sqrt(H)).astype(q_BNH.dtype)
        return call(q, k_pool, v_pool, table_BX.astype(jnp.int32), lengths_B.astype(jnp.int32))

    mesh, split = kernel_split(B, K)
    if split is None:
        return local(q_BNH, k_pool, v_pool, table_BX, lengths_B)
    row_spec, heads = split
    q_spec, pool_spec = P(row_spec, heads, None), P(heads, None, None, None)
    specs = (q_spec, pool_spec, pool_spec, P(row_spec, None), P(row_spec))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec,
                            check_vma=False)
    return sharded(q_BNH, k_pool, v_pool, table_BX, lengths_B)