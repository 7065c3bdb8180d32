"""ba_jax.compat, the one module that knows which jax release it runs on. Run at both ends of
the supported range (`make test`: jax 0.10.2; `make test-latest`: the newest jax): every
assertion here holds on each, whatever the release does underneath."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax import compat

BF16 = jnp.bfloat16


def _paged_args(B=4, N=4, K=2, H=16, pages=12, ps=4, X=3, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(K, pages, ps, H)), dtype) for _ in range(2))
    table = jnp.asarray(rng.permutation(pages)[: B * X].reshape(B, X), jnp.int32)
    lengths = jnp.asarray([1, 5, 12, 7][:B], jnp.int32)
    return q, k, v, table, lengths


def _paged_reference(q, k, v, table, lengths):
    """Row b, head n: softmax(q k^T) v over the first lengths[b] tokens of its pages, float64,
    no scale (the kernel takes none)."""
    q, k, v, table, lengths = (np.asarray(x, np.float64) for x in (q, k, v, table, lengths))
    B, N, H = q.shape
    K, _, ps, _ = k.shape
    out = np.zeros((B, N, H))
    for b in range(B):
        pages = table[b].astype(int)
        n_tok = int(lengths[b])
        for n in range(N):
            kh = k[n // (N // K), pages].reshape(-1, H)[:n_tok]
            vh = v[n // (N // K), pages].reshape(-1, H)[:n_tok]
            s = kh @ q[b, n]
            p = np.exp(s - s.max())
            out[b, n] = p @ vh / p.sum()
    return out


def test_the_gpu_paged_kernel_is_there_with_the_signature_ba_jax_calls():
    """Every supported jax ships it (deprecated from 0.11, still present in 0.12)."""
    assert compat.has_gpu_paged_kernel()
    kernel = compat.gpu_paged_kernel()
    params = inspect.signature(kernel).parameters
    assert list(params)[:5] == ["q", "k_pages", "v_pages", "block_tables", "lengths"]
    assert {"pages_per_compute_block", "k_splits", "interpret"} <= set(params)


def test_the_gpu_paged_kernel_runs_in_the_interpreter():
    q, k, v, table, lengths = _paged_args()
    got = compat.gpu_paged_kernel()(q, k, v, table, lengths, pages_per_compute_block=1,
                                    k_splits=1, interpret=True)
    np.testing.assert_allclose(np.asarray(got), _paged_reference(q, k, v, table, lengths),
                               atol=2e-5, rtol=0)


def test_without_the_gpu_paged_kernel_there_is_none(monkeypatch):
    """What a jax that has removed the Triton kernel looks like to ba_jax."""
    monkeypatch.setattr(compat, "_GPU_PAGED_MODULE",
                        "jax.experimental.pallas.ops.gpu.no_such_kernel")
    assert not compat.has_gpu_paged_kernel()
    assert compat.gpu_paged_kernel() is None
    monkeypatch.setattr(compat, "_GPU_PAGED_MODULE", "jax.no_such_package.paged_attention")
    assert not compat.has_gpu_paged_kernel()


def _mesh():
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("use_mesh", [False, True])
def test_abstract_gpu_is_the_mesh_in_context_and_goes_away(use_mesh):
    mesh = _mesh() if use_mesh else None
    before = jax.sharding.get_abstract_mesh()
    with compat.abstract_gpu(mesh, device_kind="NVIDIA A100") as abstract:
        inside = jax.sharding.get_abstract_mesh()
    assert inside == abstract and inside.abstract_device.device_kind == "NVIDIA A100"
    assert inside.abstract_device.platform == "gpu"
    if use_mesh:
        assert inside.axis_names == mesh.axis_names and inside.axis_sizes == mesh.axis_sizes
    else:
        assert inside.empty
    assert jax.sharding.get_abstract_mesh() == before


def _triton_text(q, k, v, table, lengths):
    kernel = compat.gpu_paged_kernel()

    def f(q, k, v, table, lengths):
        return kernel(q, k, v, table, lengths, pages_per_compute_block=1, k_splits=1)

    return jax.jit(f).trace(q, k, v, table, lengths).lower(
        lowering_platforms=("cuda",)).as_text()


def _abstract_args():
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype if x.dtype == jnp.int32 else BF16)
                 for x in _paged_args(H=64))


def test_a_triton_kernel_lowers_for_cuda_under_abstract_gpu():
    with compat.abstract_gpu():
        text = _triton_text(*_abstract_args())
    assert "triton" in text and "paged_attention" in text


def test_a_triton_kernel_in_a_shard_map_over_this_hosts_mesh_lowers_under_host_lowers_as_gpu():
    """The case abstract_gpu cannot serve: a shard_map over a concrete mesh of CPU devices."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
    spec = jax.sharding.PartitionSpec("data")
    kernel = compat.gpu_paged_kernel()

    def local(q, k, v, table, lengths):
        return kernel(q, k, v, table, lengths, pages_per_compute_block=1, k_splits=1)

    rep = jax.sharding.PartitionSpec()
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, rep, rep, spec, spec), out_specs=spec,
                      check_vma=False)
    with compat.host_lowers_as_gpu():
        text = jax.jit(f).trace(*_abstract_args()).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "sdy.manual_computation" in text


def test_transformers_no_torch_line_is_dropped_and_nothing_else():
    import logging

    compat.quiet_transformers_without_torch()
    compat.quiet_transformers_without_torch()  # idempotent
    logger = logging.getLogger("transformers")
    assert sum(isinstance(f, compat._NoTorchAdvice) for f in logger.filters) == 1

    def kept(msg):
        return logger.filter(logging.LogRecord("transformers", logging.WARNING, __file__, 1,
                                               msg, None, None))

    assert not kept("PyTorch was not found. Models won't be available and only tokenizers, "
                    "configuration and file/data utilities can be used.")
    assert kept("some other advice")


def test_importing_ba_jax_needs_no_jax():
    """The vLLM engine's environment imports ba_jax (vllm_worker) without jax."""
    import subprocess
    import sys

    code = "import sys, ba_jax, ba_jax.compat; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
