"""HF <-> ba_jax conversion: logits parity with transformers both ways, sharded loading, errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, make_tiny_hf
from safetensors.numpy import load_file, save_file

from ba_jax import sharding
from ba_jax.models import convert_hf

ATOL = 1e-4
# (arch, tied, extra config): GQA ratio 2 and 4, head_dim 32 != hidden/heads = 16 for qwen3
CASES = {
    "qwen3_tied": ("qwen3", True, dict(head_dim=32)),
    "qwen3_untied": ("qwen3", False, dict(head_dim=32, num_key_value_heads=1)),
    "qwen2_tied": ("qwen2", True, dict(num_key_value_heads=1)),
    "qwen2_untied": ("qwen2", False, {}),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_tiny_hf(root / name, arch=a, tie=t, seed=i, **kw)
            for i, (name, (a, t, kw)) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def tokens_BT():
    return np.random.RandomState(0).randint(0, 128, size=(2, 9))


@pytest.mark.parametrize("name", list(CASES))
def test_load_hf_logits_match_transformers(hf_dirs, tokens_BT, name):
    model = convert_hf.load_hf(hf_dirs[name])
    logits_BTV = model(jnp.asarray(tokens_BT))
    assert logits_BTV.dtype == jnp.float32 and logits_BTV.shape == (2, 9, 128)
    np.testing.assert_allclose(logits_BTV, hf_logits(hf_dirs[name], tokens_BT), atol=ATOL)


def test_left_padded_batch_matches_transformers(hf_dirs, tokens_BT):
    path = hf_dirs["qwen2_untied"]
    mask_BT = np.ones_like(tokens_BT)
    mask_BT[0, :3] = 0
    pos_BT = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0)
    ref = hf_logits(path, tokens_BT, attention_mask_BT=mask_BT, position_ids_BT=pos_BT)
    out = convert_hf.load_hf(path)(jnp.asarray(tokens_BT), jnp.asarray(pos_BT),
                                   jnp.asarray(mask_BT))
    np.testing.assert_allclose(np.asarray(out)[mask_BT == 1], ref[mask_BT == 1], atol=ATOL)


@pytest.mark.parametrize("name", ["qwen3_untied", "qwen2_tied"])
def test_export_then_transformers_loads_same_logits(hf_dirs, tokens_BT, tmp_path, name):
    model = convert_hf.load_hf(hf_dirs[name])
    # perturb so the export cannot pass by echoing the source files
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(lambda x: x * 1.1, state)
    nnx.update(model, state)
    convert_hf.export_hf(model, tmp_path / "out")
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["model_type"] == CASES[name][0]
    assert config["architectures"] == [{"qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[CASES[name][0]]]
    ref = hf_logits(str(tmp_path / "out"), tokens_BT)
    np.testing.assert_allclose(model(jnp.asarray(tokens_BT)), ref, atol=ATOL)


def test_sharded_export_and_index_loading(hf_dirs, tokens_BT, tmp_path):
    model = convert_hf.load_hf(hf_dirs["qwen3_tied"])
    convert_hf.export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    files = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    np.testing.assert_allclose(hf_logits(str(tmp_path / "out"), tokens_BT),
                               model(jnp.asarray(tokens_BT)), atol=ATOL)


def test_load_hf_index_written_by_transformers(tmp_path, tokens_BT):
    path = make_tiny_hf(tmp_path / "m", arch="qwen2", tie=False, max_shard_size="50KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    np.testing.assert_allclose(convert_hf.load_hf(path)(jnp.asarray(tokens_BT)),
                               hf_logits(path, tokens_BT), atol=ATOL)


def test_load_hf_on_mesh_equals_unsharded(hf_dirs, tokens_BT):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    path = hf_dirs["qwen3_untied"]
    sharded = convert_hf.load_hf(path, mesh=mesh)
    q = sharded.layers.self_attn.q_proj.kernel[...]  # [L, D, N, H], layers never split
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.sharding.device_set) == 8
    logits = jax.jit(lambda m, t: m(t))(sharded, jnp.asarray(tokens_BT))
    np.testing.assert_allclose(logits, convert_hf.load_hf(path)(jnp.asarray(tokens_BT)),
                               atol=ATOL)


def test_orbax_cli_roundtrip(hf_dirs, tokens_BT, tmp_path):
    path = hf_dirs["qwen2_tied"]
    convert_hf.main(["--hf", path, "--out", str(tmp_path / "ckpt")])
    ref = convert_hf.load_hf(path)(jnp.asarray(tokens_BT))
    model = convert_hf.load_checkpoint(str(tmp_path / "ckpt"))
    np.testing.assert_allclose(model(jnp.asarray(tokens_BT)), ref, atol=1e-6)
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    bf16 = convert_hf.load_checkpoint(str(tmp_path / "ckpt"), dtype=jnp.bfloat16, mesh=mesh)
    emb = bf16.embed_tokens.embedding[...]
    assert emb.dtype == jnp.bfloat16 and len(emb.sharding.device_set) == 8
    # bf16 weights and activations: agreement at bf16 resolution only
    np.testing.assert_allclose(bf16(jnp.asarray(tokens_BT)), ref, atol=0.15 * np.abs(ref).max())


def _rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    save_file(fn(load_file(f)), f, metadata={"format": "pt"})


def test_error_missing_key(hf_dirs, tmp_path):
    path = make_tiny_hf(tmp_path / "m", arch="qwen3", tie=False)
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(KeyError, match=r"lm_head\.weight.*\(128, 64\)"):
        convert_hf.load_hf(path)


def test_error_unexpected_key(tmp_path):
    path = make_tiny_hf(tmp_path / "m", arch="qwen3", tie=True)
    _rewrite(path, lambda t: {**t, "model.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.extra\.weight"):
        convert_hf.load_hf(path)


def test_error_wrong_shape(tmp_path):
    path = make_tiny_hf(tmp_path / "m", arch="qwen2", tie=True)
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] = 80
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    message = r"down_proj\.weight.*shape \(64, 96\), expected \(64, 80\)"
    with pytest.raises(ValueError, match=message):
        convert_hf.load_hf(path)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama", architectures=["LlamaForCausalLM"]), "unsupported architecture"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "unsupported rope scaling type 'yarn'"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "dynamic"}),
     "unsupported rope scaling type 'dynamic'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_error_unsupported_config(hf_dirs, change, message):
    config = json.load(open(os.path.join(hf_dirs["qwen3_tied"], "config.json")))
    config.update(change)
    with pytest.raises(ValueError, match=message):
        convert_hf.ModelConfig.from_hf_config(config)


def test_load_tokenizer_missing_folder_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        convert_hf.load_tokenizer(str(tmp_path))
