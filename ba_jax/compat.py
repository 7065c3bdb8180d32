"""What ba_jax needs to know about the jax release it runs on, in one place.

Supported: jax/jaxlib 0.10.2 through 0.12 (pyproject.toml; both ends locked and tested:
requirements.lock, requirements-latest.lock). Every other module calls these helpers instead of
asking for a version, and `tests/test_compat.py` runs at both ends.

What moved between those releases, and what ba_jax does about it:

* jax's Pallas GPU paged-attention kernel (`jax.experimental.pallas.ops.gpu.paged_attention`,
  Triton) is deprecated from jax 0.12 (importing it warns, and so does every lowering of a
  Pallas Triton kernel: "The Pallas Triton backend is deprecated ... migrate to the Mosaic GPU
  backend"). No release up to 0.12 ships a Mosaic GPU paged or decode attention kernel in its
  place (`pallas.ops.gpu` has Mosaic GPU kernels for full-sequence attention, matmuls and
  collectives only). So ba_jax keeps the Triton kernel while jax ships it (`gpu_paged_kernel`)
  and decodes through the gather path on a GPU once it does not (`has_gpu_paged_kernel`
  False): the engine's semantics are the same either way, only decode speed differs.
* Lowering a Pallas Triton kernel for `cuda` on a host without a GPU: jax <= 0.10 targets
  compute capability 9.0 by itself; from 0.11 on jax asks for the target GPU as an abstract
  device (`RuntimeError: No supported GPU devices found, please specify an abstract GPU
  device`). `abstract_gpu` supplies one in the form both accept (an `AbstractMesh` carrying an
  `AbstractDevice`, entered with `jax.sharding.use_abstract_mesh`). Code that `shard_map`s over
  a concrete mesh of this host's devices cannot be given an abstract device (inside the
  shard_map the abstract mesh is the concrete mesh's, and jax's custom partitioners, cuDNN's
  among them, need concrete devices to lower at all): for checking such code by lowering,
  `host_lowers_as_gpu` has jax's Triton lowering take this host's device kind for the GPU's
  (jax's private GPU-info registry; a no-op on jax <= 0.10). Tests only.
* cuDNN's packed layout (several sequences per row: `q_offsets` / `kv_offsets` with per-segment
  lengths, Hopper and newer) is reachable only through jax's private
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (the public
  `jax.nn.dot_product_attention` takes one length per row); its keywords are the same from
  0.10.2 to 0.12 (`cudnn_packed_attention` returns it, None where it is gone). jax 0.10.2
  scales the key offsets by the *query* heads (`kv_offsets * N * H`), wrong whenever there
  are fewer kv heads; 0.12 uses the kv heads. `cudnn_packed_gqa_ok` finds out which by
  running jax's offset fix on a tiny GQA case (no version check); where it is wrong, the
  caller repeats the kv heads up to the query heads first.
* transformers 5.x logs "PyTorch was not found. Models won't be available ..." when it is
  imported without torch (the newest end installs none, nor does a TPU VM): ba_jax uses
  transformers for tokenizers and configs only, so `quiet_transformers_without_torch` (called
  when ba_jax is imported) drops that one line, which would otherwise precede every command's
  output and its one-line errors.

This module imports jax inside its functions only: importing ba_jax must not need jax (the
vLLM engine's own environment imports ba_jax.vllm_worker without it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from unittest import mock

# The NVIDIA data-center GPU ba_jax is checked for when none is present (Hopper, compute
# capability 9.0: what jax <= 0.10 assumed for a GPU-less lowering too).
DEFAULT_GPU_KIND = "NVIDIA H100"
_GPU_PAGED_MODULE = "jax.experimental.pallas.ops.gpu.paged_attention"


def has_gpu_paged_kernel() -> bool:
    """Whether this jax ships the Pallas GPU (Triton) paged-attention kernel (found without
    importing it, so without its deprecation warning)."""
    try:
        return importlib.util.find_spec(_GPU_PAGED_MODULE) is not None
    except ImportError:  # a parent package is gone
        return False


def gpu_paged_kernel() -> Callable | None:
    """jax's Pallas GPU (Triton) paged-attention function, or None where this jax no longer
    ships it. Signature (jax 0.10.2-0.12): `paged_attention(q [B, N, H], k_pages [K, pages,
    page, H], v_pages, block_tables [B, X] int32, lengths [B] int32, *,
    pages_per_compute_block, k_splits, interpret, ...) -> [B, N, H]`, no softmax scale."""
    if not has_gpu_paged_kernel():
        return None
    return importlib.import_module(_GPU_PAGED_MODULE).paged_attention


def abstract_gpu_mesh(mesh=None, device_kind: str = DEFAULT_GPU_KIND):
    """An `AbstractMesh` with `mesh`'s axes (none: a mesh of no axes) whose devices are GPUs of
    `device_kind`: the target of a lowering for `cuda` made on a host without one."""
    import jax

    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                         platform="gpu")
    if mesh is None:
        sizes, names, types = (), (), ()
    else:
        sizes, names, types = tuple(mesh.axis_sizes), tuple(mesh.axis_names), mesh.axis_types
    return jax.sharding.AbstractMesh(sizes, names, axis_types=types, abstract_device=device)


@contextlib.contextmanager
def abstract_gpu(mesh=None, device_kind: str = DEFAULT_GPU_KIND) -> Iterator:
    """Within it, `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` lowers Pallas GPU
    kernels for a `device_kind` GPU where none is present (jax >= 0.11 asks for one; older jax
    ignores it). `mesh`: the mesh the traced code splits over (code that reads
    `jax.sharding.get_abstract_mesh()` sees its axes); None: no mesh. Yields the abstract mesh.
    Only for lowering: nothing can run on it."""
    import jax

    abstract = abstract_gpu_mesh(mesh, device_kind)
    with jax.sharding.use_abstract_mesh(abstract):
        yield abstract


@contextlib.contextmanager
def host_lowers_as_gpu(device_kind: str = DEFAULT_GPU_KIND) -> Iterator[None]:
    """Within it, Pallas Triton kernels traced on this host's (CPU) devices, a concrete mesh of
    them included, lower for `cuda` as for a `device_kind` GPU. For lowering checks (tests)
    only: prefer `abstract_gpu` wherever the code takes the mesh from the context."""
    import jax

    try:  # jax >= 0.11: the target comes from the device kind, looked up here
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # jax <= 0.10 targets compute capability 9.0 without a GPU
        yield
        return
    version = gpu_info.gpu_version_from_device_kind(device_kind)
    if version is None:
        raise ValueError(f"jax knows no GPU of kind {device_kind!r}")
    info = gpu_info.get_gpu_info_from_version(version)
    kinds = {d.device_kind for d in jax.devices()}
    with mock.patch.dict(gpu_info.registry, {k: (lambda: info) for k in kinds}):
        yield


_CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"


def cudnn_packed_attention() -> Callable | None:
    """jax's private cuDNN fused attention (`dot_product_attention(query, key, value, *,
    q_seqlen [B, M], kv_seqlen [B, M], q_offsets [B, M + 1], kv_offsets [B, M + 1], scale,
    mask_type)`, BTNH, -1 for unused entries), or None where this jax has no such function
    or no packed-layout arguments."""
    import inspect

    try:
        module = importlib.import_module(_CUDNN_MODULE)
    except ImportError:
        return None
    fn = getattr(module, "dot_product_attention", None)
    if fn is None or not {"q_offsets", "kv_offsets"} <= set(inspect.signature(fn).parameters):
        return None
    return fn


def cudnn_mask_type(name: str):
    """A member of jax's private cuDNN `MaskType` enum ("PADDING_CAUSAL", ...)."""
    return getattr(importlib.import_module(_CUDNN_MODULE).MaskType, name)


@functools.cache
def cudnn_packed_gqa_ok() -> bool:
    """Whether jax's cuDNN packed layout strides the key offsets by the kv heads (else by the
    query heads, wrong for grouped-query attention: jax 0.10.2). Probed on jax's own offset
    fix with 4 query heads, 1 kv head and two segments of 2 tokens."""
    import jax
    import jax.numpy as jnp

    fix = importlib.import_module(_CUDNN_MODULE)._fix_seqlen_offsets
    with jax.ensure_compile_time_eval():  # first asked while tracing: compute it now
        q, k = jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 1, 8))
        lens, offsets = jnp.array([[2, 2]], jnp.int32), jnp.array([[0, 2, -1]], jnp.int32)
        kv_offsets = fix(lens, lens, offsets, offsets, q, k)[3]
        return int(kv_offsets[0, 1]) == 2 * 1 * 8


_NO_TORCH_ADVICE = "PyTorch was not found."


class _NoTorchAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_TORCH_ADVICE)


def quiet_transformers_without_torch() -> None:
    """Drop transformers' "PyTorch was not found ..." line (logged by its "transformers" logger
    when it is imported without torch); nothing else it logs. Call before transformers is
    imported; calling again adds nothing."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())
