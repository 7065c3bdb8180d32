"""The one kernel seam for attention: causal self-attention and attention over paged caches.

Model code names an implementation (config `model.attention`) and calls `attention`; the
rollout engine's cache calls `paged_decode` / `paged_chunk_attention` with the implementation
`paged_impl` picks. Only `dispatch` asks which backend it runs on. Modules, by kind:

  reference      full float32 scores, masked softmax (xla), cached decode: the truth
  flash          chunked flash attention in pure JAX (chunked), any backend
  cudnn          cuDNN through jax.nn.dot_product_attention (bf16/fp16)
  splash         Pallas TPU splash attention
  paged          decode and chunked prefill over a paged pool (gather path), pool writes
  paged_kernels  jax's Pallas paged-attention kernels (TPU, GPU)
  partition      how a Pallas kernel is cut under the mesh in context
  segments       packed rows: segment ids, per-segment positions
  dispatch       resolve / paged_impl (which implementation) and `attention` (the call)

Not here: RoPE (the model applies it), the page bookkeeping (the engine), projections.
"""

from ba_jax.models.attention.dispatch import (
                                              CHUNKED_MIN_LEN,
                                              IMPLS,
                                              PAGED_IMPLS,
                                              attention,
                                              backend,
                                              paged_impl,
                                              resolve,
)
from ba_jax.models.attention.paged import (
                                              paged_chunk_attention,
                                              paged_decode,
                                              paged_decode_attention,
                                              paged_writes_first,
                                              write_pages,
)
from ba_jax.models.attention.reference import decode_attention
from ba_jax.models.attention.segments import Segments

__all__ = ["CHUNKED_MIN_LEN", "IMPLS", "PAGED_IMPLS", "attention", "backend", "decode_attention",
           "paged_chunk_attention", "paged_decode", "paged_decode_attention", "paged_impl",
           "paged_writes_first", "resolve", "Segments", "write_pages"]
