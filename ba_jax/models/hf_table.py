"""The one Hugging Face <-> ba_jax key table, and the array layouts and config.json it implies.

Lives here: `KEY_TABLE` (ba_jax parameter path -> HF safetensors key and how the array is laid
out), `IGNORED_HF` (HF keys that carry no parameter), the lookups on it (`is_stacked`,
`hf_key`, `hf_keys`, `hf_shape`), the per-tensor transforms (`from_hf`, `to_hf`) and
`hf_config` (`ModelConfig` -> transformers config.json). Every HF name and layout comes from
here: `convert_hf.py` reads and writes folders with it, `vllm_rollout.py` syncs weights with it.

Not here: any file IO, folders or checkpoints (`convert_hf.py`), the model itself (`qwen.py`).

Layouts: HF `nn.Linear` weights are [out, in]; ba_jax kernels are [*in, *out] with heads split
out (q_proj [D, N, H], o_proj [N, H, D]), so every linear is a transpose then a reshape, and
everything else (embeddings, norms, biases) a reshape. Decoder-layer parameters are stacked on
a leading layers axis (q_proj [L, D, N, H]); HF keeps one tensor per layer
(`model.layers.{i}.…`), so loading stacks the L tensors of one parameter and exporting
unstacks them, both through the one table.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np

from ba_jax.models.qwen import ModelConfig

# ba_jax path (full match) -> (HF key template, kind). kind "linear": HF [out, in] <-> ours
# [*in, *out]; "copy": same elements, reshaped. Templates use the path's regex groups; a
# template with "{layer}" names a parameter stacked over the decoder layers (leading axis L of
# ours), stored by HF as one tensor per layer.
KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    (r"embed_tokens\.embedding", "model.embed_tokens.weight", "copy"),
    (r"layers\.self_attn\.([qkvo])_proj\.kernel",
     "model.layers.{layer}.self_attn.{0}_proj.weight", "linear"),
    (r"layers\.self_attn\.([qkvo])_proj\.bias", "model.layers.{layer}.self_attn.{0}_proj.bias",
     "copy"),
    (r"layers\.self_attn\.([qk])_norm\.scale", "model.layers.{layer}.self_attn.{0}_norm.weight",
     "copy"),
    (r"layers\.mlp\.(gate|up|down)_proj\.kernel", "model.layers.{layer}.mlp.{0}_proj.weight",
     "linear"),
    (r"layers\.(input|post_attention)_layernorm\.scale",
     "model.layers.{layer}.{0}_layernorm.weight", "copy"),
    (r"norm\.scale", "model.norm.weight", "copy"),
    (r"lm_head\.kernel", "lm_head.weight", "linear"),
)
# HF keys that carry no parameters of ours (buffers some old checkpoints saved).
IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq")


def _rule(path: str) -> tuple[str, str]:
    for pattern, template, kind in KEY_TABLE:
        m = re.fullmatch(pattern, path)
        if m:
            return template.format(*m.groups(), layer="{layer}"), kind
    raise KeyError(f"no HF key for ba_jax parameter {path!r}")


def is_stacked(path: str) -> bool:
    """Whether the ba_jax parameter at `path` has a leading layers axis (one HF key per layer)."""
    return "{layer}" in _rule(path)[0]


def hf_key(path: str, layer: int | None = None) -> tuple[str, str]:
    """(HF key, kind) of the ba_jax parameter at dotted `path` (of `layer` if it is stacked)."""
    template, kind = _rule(path)
    if "{layer}" in template:
        if layer is None:
            raise ValueError(f"{path!r} is stacked over layers: name the layer")
        return template.format(layer=layer), kind
    return template, kind


def hf_keys(path: str, num_layers: int) -> list[str]:
    """Every HF key the ba_jax parameter at `path` holds, in layer order."""
    if is_stacked(path):
        return [hf_key(path, i)[0] for i in range(num_layers)]
    return [hf_key(path)[0]]


def _n_in(path: str) -> int:
    """How many leading kernel dims are inputs (o_proj takes [N, H])."""
    return 2 if ".o_proj." in path else 1


def hf_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape HF stores for one tensor of the ba_jax parameter `path` (`shape` without the
    layers axis)."""
    if _rule(path)[1] == "linear":
        n = _n_in(path)
        return (math.prod(shape[n:]), math.prod(shape[:n]))
    if path.startswith("embed_tokens."):
        return tuple(shape)
    return (math.prod(shape),)  # norms and biases are vectors in HF


def from_hf(path: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One HF tensor -> ba_jax layout of `shape` (one layer's shape for a stacked parameter)."""
    if _rule(path)[1] == "linear":
        array = array.T
    return np.ascontiguousarray(array).reshape(shape)


def to_hf(path: str, array: np.ndarray) -> np.ndarray:
    """One layer (or an unstacked parameter) in ba_jax layout -> its HF tensor."""
    shape = hf_shape(path, array.shape)
    if _rule(path)[1] == "linear":
        array = array.reshape(math.prod(array.shape[: _n_in(path)]), -1).T
    return np.ascontiguousarray(array).reshape(shape)


def hf_config(config: ModelConfig, dtype) -> dict:
    """transformers config.json dict for `config` (readable by transformers 4.x and 5.x)."""
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[config.arch]
    if config.arch == "qwen2" and (not config.use_qkv_bias or config.use_o_bias
                                   or config.use_qk_norm):
        raise ValueError("qwen2 requires q/k/v bias, no o_proj bias and no q/k norm")
    if config.arch == "qwen3" and (config.use_qkv_bias != config.use_o_bias
                                   or not config.use_qk_norm):
        raise ValueError("qwen3 has one attention_bias flag for q/k/v/o and always q/k norm")
    eos = config.eos_token_id
    out = {
        "architectures": [arch],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.use_tied_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "torch_dtype": jnp.dtype(dtype).name,  # transformers 4.x name
        "dtype": jnp.dtype(dtype).name,  # transformers 5.x name
    }
    if config.arch == "qwen3":
        out["attention_bias"] = config.use_qkv_bias
    return out
