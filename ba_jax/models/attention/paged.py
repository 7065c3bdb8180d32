"""Attention over the rollout engine's paged KV cache: decode and chunked prefill.

Pools are [K, pages, page, H] (the layout of jax's TPU paged-attention kernel); a row's
tokens are the pages of its table read in order. Lives here: `write_pages` (the one scatter
that writes keys into a pool), `paged_decode` (one decode layer's attention and the pool
update it implies: the seam the engine's decode cache calls), `paged_decode_attention`
(the gather path, or a Pallas kernel from `paged_kernels`), `paged_chunk_attention`
(chunked prefill, a gather: any backend). Not here: choosing the implementation
(`dispatch.paged_impl`), page bookkeeping (the engine's `paging`).
"""

import math

import jax.numpy as jnp

from ba_jax.models.attention import paged_kernels
from ba_jax.models.attention.reference import F32, MASK, Array, decode_attention, masked


def write_pages(pool: Array, page_A: Array, offset_A: Array, new_AKH: Array) -> Array:
    """`pool` [K, pages, page, H] with keys (or values) of any batch shape A written at page
    `page_A`, slot `offset_A`, in one scatter; page ids out of range are dropped."""
    new_KAH = jnp.moveaxis(new_AKH, -2, 0).astype(pool.dtype)
    return pool.at[:, page_A, offset_A].set(new_KAH, mode="drop")


def paged_writes_first(impl: str) -> bool:
    """Whether `paged_decode_attention(impl=...)` reads the row's own key from the pool
    (so a decode step writes each layer's key before attending), or takes it as `new_kv`
    (so the step writes all layers' keys in one scatter after the layer scan: one update of
    the pool per step instead of one per layer)."""
    return impl in ("pallas_tpu", "pallas_gpu")


def paged_decode(q_BNH: Array, k_BKH: Array, v_BKH: Array, k_pool: Array, v_pool: Array,
                 table_BX: Array, lengths_B: Array, write_page_B: Array, write_offset_B: Array,
                 *, impl: str, interpret: bool = False):
    """One decode layer over a paged cache: the new token's key/value go to page
    `write_page_B` (out of range: not written) at `write_offset_B`, and it attends to the first
    `lengths_B` tokens of its table (itself the last) -> (o_BNH, pools, pending).

    How the pool is updated is the implementation's: a kernel that reads the new key from the
    pool (`paged_writes_first`) gets it written first and returns the written pools
    (k_pool, v_pool) with pending None; the gather path attends to it beside the pages and
    returns pools None with pending = (k_BKH, v_BKH), for the caller to write every layer's
    keys in one scatter after its layer scan (`write_pages`)."""
    if paged_writes_first(impl):
        k_pool = write_pages(k_pool, write_page_B, write_offset_B, k_BKH)
        v_pool = write_pages(v_pool, write_page_B, write_offset_B, v_BKH)
        o_BNH = paged_decode_attention(q_BNH, k_pool, v_pool, table_BX, lengths_B, impl=impl,
                                       interpret=interpret)
        return o_BNH, (k_pool, v_pool), None
    o_BNH = paged_decode_attention(q_BNH, k_pool, v_pool, table_BX, lengths_B, impl=impl,
                                   new_kv=(k_BKH, v_BKH), interpret=interpret)
    return o_BNH, None, (k_BKH, v_BKH)


def paged_decode_attention(
    q_BNH: Array,
    k_pool: Array,
    v_pool: Array,
    table_BX: Array,
    lengths_B: Array,
    *,
    impl: str = "xla",
    new_kv: tuple[Array, Array] | None = None,
    pages_per_block: int = 8,
    interpret: bool = False,
) -> Array:
    """One query token per row over a paged cache: row b attends to the first
    `lengths_B[b]` (>= 1) tokens of the pages `table_BX[b]` read in order, the row's own
    token the last of them. Pools are [K, pages, page, H], the layout of jax's TPU
    paged-attention kernel; table entries past a row's length are never read by the kernel
    and masked here, but must be valid page ids.

    The row's own key/value are either in the pool already (written before this call) or,
    with `new_kv` = (k_BKH, v_BKH), passed here and not yet written: the pool's slot
    `lengths_B - 1` is then ignored (`paged_writes_first` says which the impl takes).

    impl: "xla", a gather of the X pages and a masked softmax (numerics as `attention`),
    any backend, takes `new_kv`, so that a decode step can write every layer's keys in one
    scatter after its layer scan; "pallas_tpu",
    `jax.experimental.pallas.ops.tpu.paged_attention`, reading only the pages below each
    length (blocks of `pages_per_block` pages), its own token from the pool, under
    shard_map over rows and kv heads where a mesh splits them (Pallas kernels are not
    auto-partitioned); "pallas_gpu", `jax.experimental.pallas.ops.gpu.paged_attention`
    (Triton), the same way (`interpret=True` runs it in the Pallas interpreter)."""
    if impl in ("pallas_tpu", "pallas_gpu"):
        if new_kv is not None:
            raise ValueError(f"the {impl} paged kernel reads the row's own key from the "
                             "pool: write it first (paged_writes_first)")
        return paged_kernels.paged_kernel(impl, q_BNH, k_pool, v_pool, table_BX, lengths_B,
                                          pages_per_block, interpret=interpret)
    if impl != "xla":
        raise ValueError(f"paged decode impl must be one of xla, pallas_tpu, pallas_gpu; got {impl!r}")
    B, N, H = q_BNH.shape
    K, _, ps, _ = k_pool.shape
    X = table_BX.shape[1]

    def rows(pool):  # [K, B, X, page, H] -> [B, X * page, K, H]
        return jnp.moveaxis(pool[:, table_BX].reshape(K, B, X * ps, H), 0, 2)

    if new_kv is not None:  # the cached tokens before it, then the new one (decode_attention)
        valid_BS = jnp.arange(X * ps)[None] < lengths_B[:, None] - 1
        return decode_attention(q_BNH, *new_kv, rows(k_pool), rows(v_pool), valid_BS)
    dt = q_BNH.dtype
    q_BKJH = q_BNH.reshape(B, K, N // K, H)
    s_BKJS = (1.0 / math.sqrt(H)) * jnp.einsum("bkjh,bskh->bkjs", q_BKJH,
                                                rows(k_pool).astype(dt),
                                                preferred_element_type=F32)
    valid_B11S = (jnp.arange(X * ps)[None] < lengths_B[:, None])[:, None, None, :]
    s_BKJS = jnp.where(valid_B11S, s_BKJS, MASK)
    m_BKJ = s_BKJS.max(-1)
    p_BKJS = jnp.where(valid_B11S, jnp.exp(s_BKJS - m_BKJ[..., None]), 0.0)
    acc_BKJH = jnp.einsum("bkjs,bskh->bkjh", p_BKJS.astype(dt), rows(v_pool).astype(dt),
                          preferred_element_type=F32)
    return (acc_BKJH / p_BKJS.sum(-1)[..., None]).reshape(B, N, H).astype(dt)


def paged_chunk_attention(
    q_BCNH: Array,
    k_BCKH: Array,
    v_BCKH: Array,
    k_pool: Array,
    v_pool: Array,
    table_BQ: Array,
    start_B: Array,
    valid_BC: Array,
) -> Array:
    """A chunk of C query tokens per row (chunked prefill): row b's chunk holds its tokens
    start_B[b], start_B[b] + 1, ... (those with valid_BC), whose keys/values k_BCKH / v_BCKH
    are passed here (not yet in the pool), after its first start_B[b] tokens, cached in the
    pages table_BQ[b] read in order. Query i attends to those cached tokens and to the
    chunk's valid tokens up to itself (causal); invalid queries output 0. Numerics as
    `attention`'s xla (the reference). A gather of the table's Q pages and a masked
    softmax: any backend. Pools and table as `paged_decode_attention`'s."""
    B, C, _, H = q_BCNH.shape
    K, _, ps, _ = k_pool.shape
    Q = table_BQ.shape[1]
    dt = q_BCNH.dtype

    def keys(pool, new_BCKH):  # [B, Q * page + C, K, H]: the cached prefix, then the chunk
        cached = jnp.moveaxis(pool[:, table_BQ].reshape(K, B, Q * ps, H), 0, 2)
        return jnp.concatenate([cached.astype(dt), new_BCKH.astype(dt)], axis=1)

    valid_BC = valid_BC.astype(bool)
    cached_BS = jnp.arange(Q * ps)[None] < start_B[:, None]
    causal_CC = jnp.tril(jnp.ones((C, C), bool))
    mask_BCS = jnp.concatenate(
        [jnp.broadcast_to(cached_BS[:, None], (B, C, Q * ps)),
         causal_CC[None] & valid_BC[:, None, :]], axis=2) & valid_BC[:, :, None]
    return masked(q_BCNH, keys(k_pool, k_BCKH), keys(v_pool, v_BCKH), mask_BCS)
