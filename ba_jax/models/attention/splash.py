"""Pallas TPU splash attention, under shard_map when a mesh is in context.

Segments (packed rows) are splash's own `SegmentIds`, padding their segment 0. Its mask is
static (causal), so it skips blocks above the diagonal only: blocks that share no segment
are computed and masked (the `chunked` kernel skips those too).
`interpret=True` runs the kernel in the Pallas interpreter (how it is checked on CPU).
Not here: choosing it (`dispatch`), the mesh cut (`partition`).
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib
from jax.sharding import PartitionSpec as P

from ba_jax.models.attention.partition import kernel_split
from ba_jax.models.attention.reference import F32, Array, pad_time, round_up


def _splash_kernel(
    N: int, T: int, bq: int, bkv: int, interpret: bool
) -> splash_lib.splash_attention_kernel.SplashAttentionKernel:
    mask = splash_lib.MultiHeadMask([splash_lib.CausalMask((T, T)) for _ in range(N)])
    # The *_compute tiles default to the kv tiles.
    sizes = splash_lib.BlockSizes(
        block_q=bq, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq, block_kv_dq=bkv
    )
    # Built per trace, not cached: its mask tables are arrays of the current trace (a
    # cache leaks them out of shard_map). The MHA kernel takes K <= N kv heads and
    # maps query head h to kv head h // (N // K), the Hugging Face order.
    return splash_lib.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )



def splash(
    q_BTNH: Array,
    k_BTKH: Array,
    v_BTKH: Array,
    ids_BT: Array,
    block_q: int,
    block_k: int,
    *,
    interpret: bool = False,
) -> Array:
    """Splash attention; under a mesh, shard_map over rows (data, fsdp) and kv heads
    (tensor) where they divide, since Pallas kernels are not auto-partitioned.
    ids_BT: segment ids, 0 for padding (`segments.token_ids`).
    interpret=True runs the kernel in the Pallas interpreter (CPU tests)."""
    B, T, _, H = q_BTNH.shape
    dt = q_BTNH.dtype
    # Tiles are multiples of 128 lanes and must divide the padded length; padding to the
    # larger tile and shrinking the other to a divisor wastes less than one tile.
    bq, bkv = (min(round_up(b, 128), round_up(T, 128)) for b in (block_q, block_k))
    Tp = round_up(T, max(bq, bkv))
    bq, bkv = math.gcd(bq, Tp), math.gcd(bkv, Tp)

    def local(q_BTNH: Array, k_BTKH: Array, v_BTKH: Array, ids_BT: Array) -> Array:
        """One device's rows and heads (the whole batch without a mesh)."""
        kernel = _splash_kernel(q_BTNH.shape[2], Tp, bq, bkv, interpret)
        # The kernel has no scale argument: fold it into q (one extra rounding in bf16).
        q_BTNH = (q_BTNH.astype(F32) / math.sqrt(H)).astype(dt)
        q_BNTH, k_BKTH, v_BKTH = (
            jnp.swapaxes(pad_time(x, Tp), 1, 2) for x in (q_BTNH, k_BTKH, v_BTKH)
        )
        # Pads are segment 0: a real query sees exactly the keys s <= t of its own
        # segment; a pad query sees at least itself (no empty softmax), zeroed below.
        seg_BT = pad_time(ids_BT.astype(jnp.int32), Tp)

        def one_row(q_NTH: Array, k_KTH: Array, v_KTH: Array, seg_T: Array) -> Array:
            return kernel(q_NTH, k_KTH, v_KTH, segment_ids=splash_lib.SegmentIds(seg_T, seg_T))

        o_BTNH = jnp.swapaxes(jax.vmap(one_row)(q_BNTH, k_BKTH, v_BKTH, seg_BT), 1, 2)
        return jnp.where((ids_BT > 0)[:, :, None, None], o_BTNH[:, :T], 0).astype(dt)

    mesh, split = kernel_split(B, k_BTKH.shape[2])
    if split is None:
        return local(q_BTNH, k_BTKH, v_BTKH, ids_BT)
    row_spec, heads = split
    x_spec = P(row_spec, None, heads, None)
    specs = (x_spec, x_spec, x_spec, P(row_spec, None))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=False)
    return sharded(q_BTNH, k_BTKH, v_BTKH, ids_BT)

