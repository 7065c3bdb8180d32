"""The rollout engine (ba_jax.engine): continuous batching over a paged KV cache gives the
static sampler's greedy output (= transformers), the trainer's log-probs, rollouts that do
not depend on the slot count or page size, and pages that all come back."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax import compat, grpo, sampler
from ba_jax.engine import call, loop, queue, shapes
from ba_jax.rollout import EngineSettings, SamplingSettings
from test_sampler import PROMPTS, _hf_greedy, _tiny

# few slots and small pages, so samples queue for slots and cross page boundaries; prompts
# (3, 9 and 20 tokens) prefilled 5 tokens per loop step, over the pages earlier chunks wrote
SMALL = dict(num_slots=5, page_size=4, prefill_chunk=5)


def _queue(model, *, num_samples, max_new_tokens, key, eos_ids, pad_id=None, temperature=1.0,
           top_k=0, top_p=1.0, prompts_per_call=32, mesh=None, **engine_options):
    """A request queue with the keyword settings of a sampling call."""
    sampling = SamplingSettings(num_samples, max_new_tokens, tuple(eos_ids), temperature, top_k,
                                top_p, pad_id)
    return queue.RequestQueue(model, sampling, key,
                              EngineSettings(prompts_per_call=prompts_per_call, **engine_options),
                              mesh=mesh)


def test_greedy_matches_transformers_with_fewer_slots_than_rows(tmp_path_factory):
    path, model = _tiny("qwen3", tmp_path_factory)
    M = 12
    free = _hf_greedy(path, PROMPTS, M, eos=127, pad=0)
    eos = int(free[1, 4])  # an EOS the random model emits: rows stop at different steps
    want = _hf_greedy(path, PROMPTS, M, eos=eos, pad=0)
    ro, st = sampler.generate(model, PROMPTS, num_samples=4, max_new_tokens=M, temperature=0.0,
                             key=jax.random.key(0), eos_ids=[eos], pad_id=0,
                             return_stats=True, **SMALL)
    np.testing.assert_array_equal(ro.tokens, np.repeat(want, 4, axis=0))
    assert ro.finish_reason[4] == "eos" and ro.lengths[4] <= 5
    np.testing.assert_array_equal(ro.group_ids, np.repeat([0, 1, 2], 4))
    assert st.busy_slot_steps == int((ro.lengths - 1).sum())  # one slot-step per later token
    assert st.peak_pages <= st.num_pages


def test_logprobs_equal_the_trainers_with_per_row_budgets(tmp_path_factory):
    _, model = _tiny("qwen3", tmp_path_factory)
    budgets = np.array([10, 3, 7, 1, 9, 10])  # one per row: 2 prompts x 3 samples
    ro = sampler.generate(model, PROMPTS[:2], num_samples=3, max_new_tokens=budgets,
                         temperature=0.5, key=jax.random.key(3), eos_ids=[2, 7], **SMALL)
    assert ro.tokens.shape == (6, 10)
    assert (ro.lengths <= budgets).all() and ro.lengths[3] == 1
    for i in np.flatnonzero(ro.finish_reason == "length"):
        assert ro.lengths[i] == budgets[i]
    m = ro.mask.astype(bool)
    graphdef, params = nnx.split(model)
    batch = dict(prompt_tokens_BT=ro.prompt_tokens, prompt_mask_BT=ro.prompt_mask,
                 tokens_BR=ro.tokens)
    old_logp_BR, _ = jax.jit(grpo.policy_logprobs, static_argnums=0)(graphdef, params, batch)
    np.testing.assert_allclose(ro.logprobs[m], np.asarray(old_logp_BR)[m], atol=1e-5, rtol=0)
    assert not ro.logprobs[~m].any() and not ro.sampling_logprobs[~m].any()


def test_same_rollouts_whatever_the_slots_and_pages(tmp_path_factory):
    """The key of token t of sample s is fold_in(fold_in(key, s), t): slot count, page size,
    pool size, prefill chunk and admission order do not change what is drawn; every page is
    free after the drain (`engine.generate` raises otherwise)."""
    _, model = _tiny("qwen3", tmp_path_factory)
    kw = dict(num_samples=4, max_new_tokens=[12, 5, 9], temperature=1.0,
              key=jax.random.key(7), eos_ids=[2], return_stats=True)
    # the last pool holds one prompt (bucket 32: at most 11 pages of 3) and one sample (at
    # most 5 pages: its prompt's partial last page copied, then its 11 decoded tokens) at a
    # time: prompts are prefilled inside the loop, one after the other, as pages free up.
    # Prefill: whole buckets (one forward), then chunks of 7 and 4 tokens.
    runs = [sampler.generate(model, PROMPTS, num_slots=s, page_size=p, num_pages=n,
                            prefill_chunk=c, **kw)
            for s, p, n, c in ((12, 16, 0, 0), (2, 3, 0, 7), (3, 3, 16, 4))]
    (a, sa), *rest = runs
    assert len(set(map(tuple, a.tokens.tolist()))) > 3  # the draws differ across rows
    for b, sb in rest:
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.mask, b.mask)
        # the attention width (prompt + W pages x page size) differs, so float sums do: the
        # trainer-parity tolerance
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert sb.steps >= sa.steps  # fewer slots: more steps, each busier
    assert runs[1][1].useful_fraction > runs[0][1].useful_fraction
    tight = runs[2][1]
    assert tight.peak_pages <= tight.num_pages == 16 and tight.steps > runs[1][1].steps


def test_pool_too_small_and_bad_budgets_are_start_up_errors(tmp_path_factory):
    _, model = _tiny("qwen3", tmp_path_factory)
    kw = dict(num_samples=2, key=jax.random.key(0), eos_ids=[2])
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        sampler.generate(model, PROMPTS[:1], max_new_tokens=33, page_size=4, num_pages=7, **kw)
    with pytest.raises(ValueError, match="one per prompt"):
        sampler.generate(model, PROMPTS[:1], max_new_tokens=[4, 4, 4], **kw)
    with pytest.raises(ValueError, match=">= 1"):
        sampler.generate(model, PROMPTS[:1], max_new_tokens=[4, 0], **kw)
    with pytest.raises(ValueError, match="prefill_chunk=-1"):
        sampler.generate(model, PROMPTS[:1], max_new_tokens=4, prefill_chunk=-1, **kw)


@pytest.mark.parametrize("overrides", [{"rollout.num_slots": 8, "rollout.page_size": 4},
                                       {"rollout.engine": "ba_jax"}], ids=["paged", "alias"])
def test_training_with_the_paged_engine(tmp_path, overrides, capsys):
    """The RL loop samples with the paged engine (here fewer slots than rows, small pages,
    rows over the 8-device mesh), also under its old name `ba_jax` (accepted with a
    one-line deprecation note); the run completes and logs."""
    from ba_jax import train
    from ba_jax.metrics import read_metrics
    from test_train import debug_config

    cfg = debug_config(**{"num_train_steps": 2, **overrides})
    train.train_and_evaluate(cfg, str(tmp_path))
    deprecated = "rollout.engine='ba_jax' is deprecated" in capsys.readouterr().out
    assert deprecated == (overrides.get("rollout.engine") == "ba_jax")
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["generated_tokens"] > 0 for r in rows)


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_row_parallel_decode_equals_one_device(tmp_path_factory, axes):
    """With a mesh each row device runs its own engine on its block of rows (uneven: 12 rows
    over 8 or 4 devices, prompts straddling devices); the rollouts are the one-device ones,
    from a decode copy of FSDP/tensor-split weights (whole over rows, split over tensor)."""
    from ba_jax.models import convert_hf
    from ba_jax.sharding import decode_shardings, make_mesh

    path, model = _tiny("qwen3", tmp_path_factory)
    mesh = make_mesh(axes)
    sharded = convert_hf.load_hf(path, dtype=jnp.float32, mesh=mesh)
    graphdef, state = nnx.split(sharded)
    copy = call.decode_copy(state, mesh, jnp.float32)
    want_sh = decode_shardings(state, mesh)
    for leaf, sh in zip(jax.tree.leaves(copy), jax.tree.leaves(want_sh)):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    decoder = nnx.merge(graphdef, copy)
    kw = dict(num_samples=4, max_new_tokens=[12, 5, 9], temperature=1.0, key=jax.random.key(4),
              eos_ids=[2], return_stats=True, num_slots=6, page_size=4)
    want, sw = sampler.generate(model, PROMPTS, **kw)
    got, sg = sampler.generate(decoder, PROMPTS, mesh=mesh, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert sg.num_devices == shapes.row_devices(mesh) > 1
    assert sg.busy_slot_steps == sw.busy_slot_steps == int((want.lengths - 1).sum())


def test_row_layout_covers_every_row_once():
    for P, G, D in ((3, 4, 8), (3, 4, 4), (4, 4, 8), (2, 16, 8), (5, 3, 2), (1, 2, 4)):
        lay = shapes.row_layout(P, G, D)
        b = lay.rows_per_device
        assert D * b >= P * G and b == -(-(P * G) // D)
        index = lay.prompt_index.reshape(D, lay.prompts_per_device)
        prompt_of = index[np.repeat(np.arange(D), b), lay.row_prompt]
        want = np.minimum(np.arange(D * b) // G, P - 1)
        np.testing.assert_array_equal(prompt_of, want)


def test_queue_gives_each_request_the_same_samples_however_it_is_batched(tmp_path_factory):
    """engine.queue.RequestQueue: requests of mixed prompt buckets and budgets, stepped in calls of
    2 or 3 prompts (the last call of a bucket padded), give the samples `engine.generate`
    draws for the same rows in one call: a request's keys are its own."""

    _, model = _tiny("qwen3", tmp_path_factory)
    prompts = PROMPTS + [[3, 4], list(range(60, 80))]  # buckets 16, 16, 32, 16, 32
    budgets = [9, 4, 7, 9, 2]
    kw = dict(num_samples=3, temperature=1.0, key=jax.random.key(11), eos_ids=[2])
    want = sampler.generate(model, prompts, max_new_tokens=budgets, num_slots=4, page_size=4,
                           **kw)
    for per_call in (2, 3):
        q = _queue(model, max_new_tokens=9, prompts_per_call=per_call,
                                num_slots=3, page_size=4, **kw)
        rids = [q.add(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
        assert rids == list(range(5)) and q.pending == 5
        first = q.step()  # the oldest request's bucket (16) first
        assert [c.request_id for c in first] == [0, 1, 3][:per_call]
        done = {c.request_id: c for c in first} | q.drain()
        assert q.pending == 0 and sorted(done) == rids
        assert q.calls == (2 if per_call == 3 else 3)
        for i in rids:
            rows = slice(3 * i, 3 * i + 3)
            np.testing.assert_array_equal(done[i].tokens[:, :9], want.tokens[rows])
            np.testing.assert_array_equal(done[i].mask, want.mask[rows])
            np.testing.assert_allclose(done[i].logprobs, want.logprobs[rows], atol=1e-5, rtol=0)
            assert (done[i].lengths <= budgets[i]).all()
    with pytest.raises(ValueError, match="max_new_tokens <= 9"):
        q.add([1, 2], max_new_tokens=10)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        _queue(model, max_new_tokens=40, page_size=4, num_pages=3, **kw)


def test_tpu_paged_kernel_gives_the_gather_paths_rollouts(tmp_path_factory):
    """model.attention=splash (what `auto` picks on TPU): splash prefill and decode through
    jax's TPU paged-attention kernel, both run by the Pallas TPU interpreter, inside the
    engine's loop. Greedy tokens are the gather path's; log-probs agree to the bf16 rounding
    of the interpreter's matmuls (TPU default precision), on prompts whose partial last
    pages the samples copy (lengths 3 and 9, pages of 4)."""
    import dataclasses

    from jax.experimental.pallas import tpu as pltpu

    from ba_jax.models import convert_hf
    from helpers_hf import make_tiny_hf

    # the kernel takes heads of whole 128-lane tiles (attention.paged_impl)
    path = make_tiny_hf(tmp_path_factory.mktemp("h128"), arch="qwen3", tie=True, seed=1,
                        head_dim=128)
    model = convert_hf.load_hf(path, dtype=jnp.float32)
    kw = dict(num_samples=2, max_new_tokens=[7, 5], temperature=0.0, key=jax.random.key(0),
              eos_ids=[2], num_slots=3, page_size=4)
    want = sampler.generate(model, PROMPTS[:2], **kw)
    graphdef, state = nnx.split(model)
    tpu = nnx.merge(graphdef, state)
    tpu.config = dataclasses.replace(model.config, attention="splash")
    with pltpu.force_tpu_interpret_mode():
        got = sampler.generate(tpu, PROMPTS[:2], **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-2, rtol=0)


def test_gpu_paged_kernel_gives_the_gather_paths_rollouts(tmp_path_factory):
    """model.attention=cudnn (what `auto` picks on a GPU in bf16): decode through jax's
    Triton paged-attention kernel, run by the Pallas interpreter inside the engine's loop,
    prompts prefilled in chunks (the gather path: cuDNN itself has no CPU build). Greedy
    tokens and log-probs are the gather path's."""
    import dataclasses

    from ba_jax.models import attention

    _, model = _tiny("qwen3", tmp_path_factory)
    kw = dict(num_samples=2, max_new_tokens=[7, 5], temperature=0.0, key=jax.random.key(0),
              eos_ids=[2], num_slots=3, page_size=4, prefill_chunk=4)
    want = sampler.generate(model, PROMPTS[:2], **kw)
    graphdef, state = nnx.split(model)
    gpu = nnx.merge(graphdef, state)
    gpu.config = dataclasses.replace(model.config, attention="cudnn", kernel_interpret=True)
    assert attention.paged_impl("cudnn", dtype=gpu.dtype, head_dim=gpu.config.head_dim,
                                page_size=4) == "pallas_gpu"
    got = sampler.generate(gpu, PROMPTS[:2], **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl, platform, kernels, chunk", [
    # splash prefill and the paged-attention decode kernel
    ("splash", "tpu", ("paged_flash_attention_kernel",), 0),
    # chunked prefill (the gather path, any backend) beside the TPU decode kernel
    ("splash", "tpu", ("paged_flash_attention_kernel",), 8),
    # the tensor axis stays XLA's inside the shard_map, so jax wraps the cuDNN call in its
    # custom partitioner (expanded by XLA on the GPU): the lowered text shows the wrapper;
    # decode through the Triton paged-attention kernel
    ("cudnn", "cuda", ("@CustomSPMDPartitioning(", "paged_attention_block_h"), 0),
    ("cudnn", "cuda", ("paged_attention_block_h",), 8)])
def test_row_parallel_engine_lowers_for_accelerators(impl, platform, kernels, chunk):
    """The engine call the trainer makes on 8 devices (bf16 decode copy, rows over the mesh,
    each device's own while loop inside the shard_map) lowers for TPU and GPU with the
    platform's prefill kernel (whole buckets) or chunked prefill; compiling it only happens
    on the hardware. The CPU jaxlib has no CUDA plugin: jax's trace-time cuDNN version query
    is stood in for, and the Triton kernel's target GPU named (`compat.host_lowers_as_gpu`)."""
    from unittest import mock

    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    from ba_jax import build, sampling
    from test_train import debug_config

    # heads of 128 (as every Qwen's), the TPU paged-attention kernel's tile
    cfg = debug_config(**{"model.attention": impl, "model.dtype": "bfloat16", "mesh.data": 8,
                          "model.head_dim": 128})
    mesh = build.make_mesh(cfg)
    graphdef, params = build.init_policy(cfg, mesh)
    copy = call.decode_copy(params, mesh, jnp.bfloat16)
    P, G, R, Tp = 4, 4, 8, 16
    cs = shapes.call_shape(P, Tp, G, R, num_devices=8, prefill_chunk=chunk)
    run = loop.engine_fn(graphdef, cs, sampling.SamplingConfig(), mesh)
    lay = shapes.row_layout(P, G, 8)
    prompts = np.ones((len(lay.prompt_index), Tp), np.int32)
    rows = np.zeros(len(lay.row_prompt), np.int32)
    patch = (mock.patch.object(cudnn_fa, "check_cudnn_version", return_value=90800)
             if impl == "cudnn" else contextlib.nullcontext())
    # the engine shard_maps over this host's mesh, so the Triton kernel's target GPU (which
    # jax >= 0.11 asks for) is named through compat.host_lowers_as_gpu, not an abstract mesh
    target = compat.host_lowers_as_gpu() if platform == "cuda" else contextlib.nullcontext()
    with patch, target:
        text = run.trace(copy, prompts, prompts, lay.row_prompt, rows, rows + R,
                         jax.random.key(0), np.array([2], np.int32), np.int32(0)).lower(
            lowering_platforms=(platform,)).as_text()
    assert all(k in text for k in kernels) and "stablehlo.while" in text
