"""Hugging Face folders <-> ba_jax models: loading, exporting and Orbax conversion.

Lives here: `load_hf` (HF folder -> `Qwen`, tensor by tensor, optionally sharded on a mesh),
`export_hf` (`Qwen` -> folder that transformers and vLLM load: weights, config, generation
config, tokenizer), `save_checkpoint` / `load_checkpoint` (Orbax params + model config JSON),
`load_tokenizer`, `convert` and the command

    python -m ba_jax.models.convert_hf --hf HF_DIR --out CKPT_DIR [--overwrite] [--verbose]

which writes into a temporary folder beside CKPT_DIR and renames it into place once complete
(a failed or killed conversion leaves no half folder at CKPT_DIR), refuses a CKPT_DIR that is
HF_DIR, lies inside it or already holds files (unless --overwrite), and reports an error as
one line (`cli.fail`; --verbose: the traceback).

Not here: the HF key table, the array layouts and config.json (`hf_table.py`: every HF name
and layout comes from there), the model itself (`qwen.py`) or the sharding rules
(`sharding.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ba_jax import sharding as sharding_lib
from ba_jax.models.hf_table import IGNORED_HF, from_hf, hf_config, hf_keys, hf_shape, is_stacked
from ba_jax.models.hf_table import to_hf
from ba_jax.models.qwen import ModelConfig, Qwen

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json")
_GENERATION_CONFIG = "generation_config.json"
# model -> the folder it was read from (load_hf, load_checkpoint), where export_hf finds the
# tokenizer and generation config the weights came with
_SOURCE_DIRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: neither model.safetensors nor its index json found")
    with _safe_open(single) as f:
        return {k: single for k in f.keys()}


def _read_json(path: str) -> dict:
    """A JSON file of an HF folder; a damaged one is a ValueError naming it."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def _safe_open(path: str):
    """safetensors' reader for `path`; a damaged file is a ValueError naming it."""
    try:
        return safe_open(path, "np")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from e


def load_hf(path: str, *, dtype=jnp.float32, mesh=None, param_dtype=None) -> Qwen:
    """HF Qwen2/Qwen3 folder -> `Qwen`; each tensor goes straight to its (sharded) place."""
    config = ModelConfig.from_hf_config(_read_json(os.path.join(path, "config.json")))
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, state = _abstract(config, dtype, param_dtype)
    wanted = _flat(state)
    shardings = {}
    if mesh is not None:
        shardings = _flat(sharding_lib.param_shardings(nnx.to_pure_dict(state), mesh))
    files = _hf_files(path)
    L = config.num_layers
    needed = {k: p for p in wanted for k in hf_keys(p, L)}
    unexpected = [k for k in files if k not in needed and not IGNORED_HF.fullmatch(k)
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
        handles = {f: stack.enter_context(_safe_open(f)) for f in set(files.values())}
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
    model = _merge(graphdef, state, values)
    _SOURCE_DIRS[model] = os.path.abspath(path)
    return model


def export_hf(model: Qwen, out_dir: str, *, tokenizer=None,
              max_shard_bytes: int = 4 << 30) -> list[str]:
    """Writes config.json, safetensors (sharded past `max_shard_bytes`), generation_config.json
    and the tokenizer files: a folder transformers and vLLM load as it is.

    `tokenizer`: a transformers tokenizer (a run's: `build.load_tokenizer`, or what
    `evaluate.load_model` returns) or a folder holding tokenizer files; None: the files of the
    folder `model` was read from (`load_hf`, or `load_checkpoint` of a convert_hf output, which
    holds the HF folder's). generation_config.json is the one found there, else one made from
    the model's and tokenizer's BOS/EOS/pad ids. Prints what it wrote, and in one line when no
    tokenizer was available; returns the names of the files written.
    """
    os.makedirs(out_dir, exist_ok=True)
    flat = _flat(nnx.state(model, nnx.Param))
    dtype = next(iter(flat.values())).dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(model.config, dtype), f, indent=2)
    written = ["config.json"]
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
    written += names
    if len(shards) > 1:
        total = sum(leaf.size * leaf.dtype.itemsize for leaf in flat.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append("model.safetensors.index.json")
    written += _export_tokenizer(model, out_dir, tokenizer)
    print(f"export_hf: wrote {out_dir}: {', '.join(written)}")
    if not any(n in written for n in ("tokenizer.json", "vocab.json")):
        print("export_hf: no tokenizer written (none given, and the weights' folder has none): "
              "pass tokenizer= (a tokenizer or its folder) or copy its files into "
              f"{out_dir} before loading it with transformers / vLLM")
    return written


def _export_tokenizer(model: Qwen, out_dir: str, tokenizer) -> list[str]:
    """The tokenizer files and generation_config.json of `export_hf` (see there)."""
    source = _SOURCE_DIRS.get(model)
    given_object = tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike))
    folder = None if given_object else os.fspath(tokenizer) if tokenizer is not None else source
    written = []
    if given_object:
        saved = tokenizer.save_pretrained(out_dir)
        written += sorted({os.path.basename(f) for f in saved if os.path.isfile(f)})
    elif folder is not None:
        if tokenizer is not None and not any(
                os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "vocab.json")):
            raise FileNotFoundError(f"export_hf: tokenizer={folder!r} holds no tokenizer.json "
                                    "or vocab.json")
        for name in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copy(os.path.join(folder, name), os.path.join(out_dir, name))
                written.append(name)
    found = next((os.path.join(d, _GENERATION_CONFIG) for d in (folder, source)
                  if d is not None and os.path.isfile(os.path.join(d, _GENERATION_CONFIG))), None)
    if found is not None:
        shutil.copy(found, os.path.join(out_dir, _GENERATION_CONFIG))
    else:  # what transformers derives from a model config, with the tokenizer's ids
        c = model.config
        eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
        ids = {"bos_token_id": c.bos_token_id,
               "eos_token_id": eos if eos is not None else getattr(tokenizer, "eos_token_id", None),
               "pad_token_id": getattr(tokenizer, "pad_token_id", None)}
        with open(os.path.join(out_dir, _GENERATION_CONFIG), "w") as f:
            json.dump({**{k: v for k, v in ids.items() if v is not None},
                       "_from_model_config": True}, f, indent=2)
    return written + [_GENERATION_CONFIG]


def save_checkpoint(model: Qwen, out_dir: str) -> None:
    """Orbax params (`out_dir/params`) plus `out_dir/model_config.json`."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "params")):  # checked before anything is written
        raise FileExistsError(f"{out_dir} already holds a checkpoint (params/): write to "
                              "another folder, or remove it first")
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
    model = nnx.merge(graphdef, state)
    _SOURCE_DIRS[model] = ckpt_dir
    return model


def load_tokenizer(path: str):
    """transformers AutoTokenizer from a local folder (never the hub)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) or not any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json")
    ):
        raise FileNotFoundError(f"no tokenizer (tokenizer.json or vocab.json) in {path!r}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _check_folders(hf: str, out: str, hf_arg: str, out_arg: str, overwrite: bool) -> None:
    """Refuse what would damage a folder: --out equal to, inside or holding --hf (paths
    resolved, symlinks included), and an existing non-empty --out without --overwrite."""
    if not os.path.isdir(hf):
        raise FileNotFoundError(f"--hf {hf_arg!r} is not a folder")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise FileNotFoundError(f"--hf {hf_arg!r} holds no config.json: point it at a Hugging "
                                "Face model folder (config.json and *.safetensors)")
    if out == hf or out.startswith(hf + os.sep):
        where = "is the --hf folder" if out == hf else f"lies inside --hf ({hf})"
        raise ValueError(f"--out {out_arg!r} {where}: the conversion would be written into the "
                         "source folder; choose an --out outside it")
    if hf.startswith(out + os.sep):
        raise ValueError(f"--out {out_arg!r} holds --hf ({hf}): choose an --out outside it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out_arg!r} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        what = ("a conversion" if os.path.isfile(os.path.join(out, "model_config.json"))
                else "files")
        raise FileExistsError(f"--out {out_arg!r} already holds {what}: pass --overwrite to "
                              "replace it (the old folder is replaced only once the new "
                              "conversion is complete), or choose another --out")


def convert(hf_dir: str, out_dir: str, *, dtype: str = "float32", overwrite: bool = False) -> str:
    """HF folder -> a convert_hf output (Orbax params, model_config.json, the HF folder's
    tokenizer files and generation config); the line the command prints.

    Written into a temporary folder beside `out_dir`, renamed to `out_dir` once complete;
    on an error the temporary folder is removed (a killed conversion leaves it, named
    `.<out>.convert-*`, and never a half `out_dir`). With `overwrite`, an existing `out_dir`
    is moved aside only after the new one is complete, then deleted.
    """
    hf, out = os.path.realpath(hf_dir), os.path.realpath(out_dir)
    _check_folders(hf, out, hf_dir, out_dir, overwrite)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.convert-", dir=parent)
    try:
        model = load_hf(hf, dtype=jnp.dtype(dtype))
        save_checkpoint(model, tmp)
        copied = []
        for name in _TOKENIZER_FILES + (_GENERATION_CONFIG,):  # a self-contained folder
            if os.path.isfile(os.path.join(hf, name)):
                shutil.copy(os.path.join(hf, name), os.path.join(tmp, name))
                copied.append(name)
        aside = None
        if os.path.isdir(out) and os.listdir(out):  # --overwrite: the old one goes only now
            aside = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rename(out, os.path.join(aside, "old"))
        os.rename(tmp, out)  # onto an empty folder, or where the old one was
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    tok = ("tokenizer files: " + ", ".join(n for n in copied if n != _GENERATION_CONFIG)
           if any(n in copied for n in ("tokenizer.json", "vocab.json"))
           else "no tokenizer in --hf (set config.tokenizer_path when training from it)")
    return (f"wrote {out_dir} ({model.config.arch}, {model.config.num_layers} layers; {tok}"
            f"{'; replaced the previous conversion' if aside else ''})")


def main(argv=None) -> None:
    """CLI: HF folder -> Orbax checkpoint (+ model config JSON and tokenizer files)."""
    from ba_jax import cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="local Hugging Face model folder")
    parser.add_argument("--out", required=True, help="output checkpoint folder (new or empty)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only once the new conversion is complete)")
    parser.add_argument("--verbose", action="store_true", help=cli.VERBOSE_HELP)
    args = parser.parse_args(argv)
    try:
        print(convert(args.hf, args.out, dtype=args.dtype, overwrite=args.overwrite))
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        cli.fail("convert_hf", e, verbose=args.verbose)


if __name__ == "__main__":
    main()
