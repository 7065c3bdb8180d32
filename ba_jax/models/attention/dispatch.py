"""Which attention implementation runs, and the one call that runs it.

This is the only place in ba_jax that asks which backend it runs on: model code names an
implementation (config `model.attention`) and calls `attention`; the rollout engine's paged
decode asks `paged_impl`. Implementations of `attention`, all with the same semantics, with
or without `segments` (packed rows, `segments.Segments`):

  xla      materialises the [B, K, J, T, T] float32 scores; plain autodiff. The truth
           every other implementation is tested against (`reference`). Segments: a mask.
  chunked  pure JAX flash attention (`flash`): online softmax over key blocks, blocks above
           the causal diagonal skipped. Any backend. Segments: blocks sharing no segment
           skipped too, with trip counts per row.
  cudnn    jax.nn.dot_product_attention(implementation="cudnn") (`cudnn`); bf16/fp16 only.
           Segments: cuDNN's packed layout, one ragged sequence per run (Hopper and newer).
  splash   Pallas TPU splash attention (`splash`), under shard_map when a mesh is in context.
           Segments: splash's SegmentIds (masked in its blocks, not skipped).
"""

import jax
import jax.numpy as jnp

from ba_jax import compat
from ba_jax.models.attention import cudnn as cudnn_lib
from ba_jax.models.attention import flash, reference, splash
from ba_jax.models.attention.segments import Segments, token_ids

IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")
# 'auto' on CPU: below this length the [T, T] scores are small and xla is the fastest.
CHUNKED_MIN_LEN = 1024
PAGED_IMPLS = ("xla", "pallas_tpu", "pallas_gpu")


def backend() -> str:
    """The platform this process computes on ("cpu", "gpu"/"cuda", "tpu"): the one place in
    ba_jax that asks (start-up checks that depend on it call this)."""
    return jax.default_backend()


def resolve(impl: str, *, dtype: jnp.dtype, seq_len: int) -> str:
    """Maps a config value to a concrete implementation name; 'auto' picks per backend."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = backend()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda"):
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if half else "chunked"
    return "chunked" if seq_len >= CHUNKED_MIN_LEN else "xla"


def attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    valid_BT: jax.Array,
    *,
    impl: str = "xla",
    segments: Segments | None = None,
    block_q: int = 512,
    block_k: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """Causal grouped-query self-attention over one sequence per row, or over several
    (packed rows: `segments`).

    Query t attends key s iff s <= t, valid_BT[t] and valid_BT[s] and, with segments,
    ids[t] == ids[s] > 0 (ids <= 0 are padding, like valid_BT False); query head n reads kv head
    n // (N // K) (Hugging Face order). Scale 1/sqrt(H); scores and softmax in float32;
    both products in q's dtype with float32 accumulation; output in q's dtype. Queries
    with valid_BT[t] False output exactly 0, with finite gradients, also for fully
    invalid rows. cudnn additionally assumes the valid tokens of each row are one
    contiguous run (left pads, real tokens, optional right pads); xla, chunked and
    splash take any pattern. With segments, cudnn takes each contiguous run of an id as one
    sequence (a packer's layout) and needs `segments.max_segments`; the others take any.
    block_q / block_k: tile sizes for chunked (shrunk to T rounded up to 8) and splash
    (multiples of 128 dividing the padded T); ignored by xla and cudnn.
    interpret: run a Pallas kernel (splash) in the Pallas interpreter (checking it on CPU).
    """
    _, T, N, _ = q_BTNH.shape
    K = k_BTKH.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} must be a multiple of kv heads {K}")
    impl = resolve(impl, dtype=q_BTNH.dtype, seq_len=T)
    k_BTKH = k_BTKH.astype(q_BTNH.dtype)
    v_BTKH = v_BTKH.astype(q_BTNH.dtype)
    ids_BT = token_ids(valid_BT, segments)  # one segment per row without segments
    if impl == "xla":
        return reference.xla(q_BTNH, k_BTKH, v_BTKH, ids_BT)
    if impl == "chunked":
        return flash.chunked(q_BTNH, k_BTKH, v_BTKH, ids_BT, block_q, block_k,
                             per_row=segments is not None)
    if impl == "cudnn":
        if segments is not None:
            return cudnn_lib.packed(q_BTNH, k_BTKH, v_BTKH, ids_BT, segments.max_segments)
        return cudnn_lib.cudnn(q_BTNH, k_BTKH, v_BTKH, valid_BT.astype(bool))
    return splash.splash(q_BTNH, k_BTKH, v_BTKH, ids_BT, block_q, block_k,
                         interpret=interpret)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def paged_impl(impl: str, *, dtype: jnp.dtype, head_dim: int, page_size: int = 16) -> str:
    """The paged decode implementation that goes with a config value (`model.attention`):
    the TPU paged-attention Pallas kernel wherever the prefill runs splash (on TPU, or asked
    for by name) and the head fills whole 128-lane tiles (the kernel's blocks need it: every
    Qwen2.5/Qwen3 model has 128); jax's GPU (Triton) paged-attention Pallas kernel wherever
    the prefill runs cuDNN (on a GPU in bf16/fp16, or asked for by name), when heads and
    pages have power-of-two sizes (Triton's block shapes; head >= 16); else the gather-based
    pure-JAX one (float32 on a GPU included: Triton's dots may round f32 through tf32; and
    wherever this jax no longer ships the Triton kernel, `compat.has_gpu_paged_kernel`)."""
    chosen = resolve(impl, dtype=dtype, seq_len=1)
    if chosen == "splash":
        return "pallas_tpu" if head_dim % 128 == 0 else "xla"
    if (chosen == "cudnn" and compat.has_gpu_paged_kernel() and _pow2(head_dim)
            and head_dim >= 16 and _pow2(page_size)):
        return "pallas_gpu"
    return "xla"

