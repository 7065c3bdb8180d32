"""The one Hugging Face <-> ba_jax key table; loading, exporting and Orbax conversion.

Lives here: `KEY_TABLE` (ba_jax parameter path -> HF safetensors key and how the array is laid
out), `load_hf` (HF folder -> `Qwen`, tensor by tensor, optionally sharded on a mesh),
`export_hf` (`Qwen` -> folder that transformers loads), `save_checkpoint` / `load_checkpoint`
(Orbax params + model config JSON), `load_tokenizer`, and the command

    python -m ba_jax.models.convert_hf --hf HF_DIR --out CKPT_DIR

Not here: the model itself (`qwen.py`) or the sharding rules (`sharding.py`).

Layouts: HF `nn.Linear` weights are [out, in]; ba_jax kernels are [*in, *out] with heads split
out (q_proj [D, N, H], o_proj [N, H, D]), so every linear is a transpose then a reshape, and
everything else (embeddings, norms, biases) a reshape. Decoder-layer parameters are stacked on
a leading layers axis (q_proj [L, D, N, H]); HF keeps one tensor per layer
(`model.layers.{i}.…`), so loading stacks the L tensors of one parameter and exporting
unstacks them, both through the one table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from ba_jax import sharding as sharding_lib
from ba_jax.models.qwen import ModelConfig, Qwen

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
_IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "generation_config.json")


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


def _abstract(config: ModelConfig, dtype, param_dtype):
    return nnx.split(nnx.eval_shape(
        lambda: Qwen(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)))


def _flat(tree) -> dict[str, object]:
    """Dotted path -> leaf, for an nnx State or a pure dict."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {sharding_lib.path_str(p): leaf for p, leaf in leaves}


def _unflat(flat: dict[str, object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _merge(graphdef, state, flat: dict[str, object]) -> Qwen:
    nnx.replace_by_pure_dict(state, _unflat(flat))
    return nnx.merge(graphdef, state)


def _hf_files(path: str) -> dict[str, str]:
    """HF key -> safetensors file, from the index when the checkpoint is sharded."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: neither model.safetensors nor its index json found")
    with safe_open(single, "np") as f:
        return {k: single for k in f.keys()}


def load_hf(path: str, *, dtype=jnp.float32, mesh=None, param_dtype=None) -> Qwen:
    """HF Qwen2/Qwen3 folder -> `Qwen`; each tensor goes straight to its (sharded) place."""
    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, state = _abstract(config, dtype, param_dtype)
    wanted = _flat(state)
    shardings = {}
    if mesh is not None:
        shardings = _flat(sharding_lib.param_shardings(nnx.to_pure_dict(state), mesh))
    files = _hf_files(path)
    L = config.num_layers
    needed = {k: p for p in wanted for k in hf_keys(p, L)}
    unexpected = [k for k in files if k not in needed and not _IGNORED_HF.fullmatch(k)
                  and not (config.use_tied_embeddings and k == "lm_head.weight")]
    if unexpected:
        raise ValueError(f"{path}: unexpected HF keys {unexpected[:5]} for {config.arch} config")
    missing = [k for k in needed if k not in files]
    if missing:
        ours = needed[missing[0]]
        shape = wanted[ours].shape[1:] if is_stacked(ours) else wanted[ours].shape
        raise KeyError(f"{path}: missing HF key {missing[0]!r} (expected shape "
                       f"{hf_shape(ours, shape)}); {len(missing)} missing in all")
    values: dict[str, jax.Array] = {}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "np")) for f in set(files.values())}
        for ours, abstract in wanted.items():
            shape = abstract.shape[1:] if is_stacked(ours) else abstract.shape
            layers = []
            for key in hf_keys(ours, L):
                array = handles[files[key]].get_tensor(key)
                if tuple(array.shape) != hf_shape(ours, shape):
                    raise ValueError(f"{path}: HF key {key!r} ({ours}) has shape "
                                     f"{tuple(array.shape)}, expected {hf_shape(ours, shape)}")
                layers.append(from_hf(ours, array, shape).astype(param_dtype))
            array = np.stack(layers) if is_stacked(ours) else layers[0]
            values[ours] = jax.device_put(array, shardings.get(ours))
            del array, layers  # host memory holds one (stacked) parameter at a time
    return _merge(graphdef, state, values)


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


def export_hf(model: Qwen, out_dir: str, *, max_shard_bytes: int = 4 << 30) -> None:
    """Writes config.json and safetensors (sharded past `max_shard_bytes`) for transformers."""
    os.makedirs(out_dir, exist_ok=True)
    flat = _flat(nnx.state(model, nnx.Param))
    dtype = next(iter(flat.values())).dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(model.config, dtype), f, indent=2)
    L = model.config.num_layers
    # (HF key, ba_jax path, layer or None), grouped into files of at most max_shard_bytes
    tensors = [(k, p, i if is_stacked(p) else None)
               for p in flat for i, k in enumerate(hf_keys(p, L))]
    shards: list[list[tuple[str, str, int | None]]] = [[]]
    size = 0
    for entry in tensors:
        leaf = flat[entry[1]]
        nbytes = leaf.size * leaf.dtype.itemsize // (L if entry[2] is not None else 1)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for name, entries in zip(names, shards):
        out = {}  # one file's tensors on the host at a time
        for key, p, layer in entries:
            leaf = flat[p] if layer is None else flat[p][layer]
            out[key] = to_hf(p, np.asarray(jax.device_get(leaf)))
        save_file(out, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
    if len(shards) > 1:
        total = sum(leaf.size * leaf.dtype.itemsize for leaf in flat.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_checkpoint(model: Qwen, out_dir: str) -> None:
    """Orbax params (`out_dir/params`) plus `out_dir/model_config.json`."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model_config.json"), "w") as f:
        json.dump(dataclasses.asdict(model.config), f, indent=2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out_dir, "params"), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _read_model_config(fields: dict, ckpt_dir: str) -> ModelConfig:
    """ModelConfig of a `save_checkpoint` folder; folders from before the stacked layers
    (their config has `use_remat`, their parameters one subtree per layer) are refused."""
    if "use_remat" in fields:
        raise ValueError(
            f"{ckpt_dir} was written by an older ba_jax whose decoder layers were one parameter "
            "subtree each; layers are now stacked on one axis (run by a scan), so it cannot be "
            "read: convert the Hugging Face folder again with python -m ba_jax.models.convert_hf")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{ckpt_dir}/model_config.json: unknown fields {unknown}")
    if isinstance(fields.get("eos_token_id"), list):
        fields["eos_token_id"] = tuple(fields["eos_token_id"])
    return ModelConfig(**fields)


def load_checkpoint(ckpt_dir: str, *, dtype=jnp.float32, mesh=None, param_dtype=None) -> Qwen:
    """Reads a `save_checkpoint` folder back into a `Qwen` (cast to `param_dtype`, sharded)."""
    import orbax.checkpoint as ocp

    ckpt_dir = os.path.abspath(ckpt_dir)
    with open(os.path.join(ckpt_dir, "model_config.json")) as f:
        fields = json.load(f)
    config = _read_model_config(fields, ckpt_dir)
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, state = _abstract(config, dtype, param_dtype)
    pure = nnx.to_pure_dict(state)
    if mesh is not None:
        shard = sharding_lib.param_shardings(pure, mesh)
        pure = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            pure, shard)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.join(ckpt_dir, "params"), pure)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def load_tokenizer(path: str):
    """transformers AutoTokenizer from a local folder (never the hub)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) or not any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json")
    ):
        raise FileNotFoundError(f"no tokenizer (tokenizer.json or vocab.json) in {path!r}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def main(argv=None) -> None:
    """CLI: HF folder -> Orbax checkpoint (+ model config JSON and tokenizer files)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="local Hugging Face model folder")
    parser.add_argument("--out", required=True, help="output checkpoint folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    model = load_hf(args.hf, dtype=jnp.dtype(args.dtype))
    save_checkpoint(model, args.out)
    for name in _TOKENIZER_FILES:  # so that the checkpoint folder is self-contained
        if os.path.exists(os.path.join(args.hf, name)):
            shutil.copy(os.path.join(args.hf, name), os.path.join(args.out, name))
    print(f"wrote {args.out} ({model.config.arch}, {model.config.num_layers} layers)")


if __name__ == "__main__":
    main()
