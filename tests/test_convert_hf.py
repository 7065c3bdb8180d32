"""HF <-> ba_jax conversion: logits parity with transformers both ways, sharded loading, errors."""

import json
import os
import re

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


# ------------------------------------------------- the command's folders (issue 22 item 4)


def _logits(model, tokens_BT):
    return np.asarray(model(jnp.asarray(tokens_BT)))


def _siblings(path):
    """Temporary folders convert leaves beside `path` (none, after any outcome)."""
    parent, name = os.path.split(os.path.abspath(path))
    return [n for n in os.listdir(parent) if n.startswith(f".{name}.")]


def test_convert_into_an_existing_conversion_is_refused_then_replaced(hf_dirs, tokens_BT,
                                                                      tmp_path):
    a, b = hf_dirs["qwen3_tied"], hf_dirs["qwen3_untied"]
    out = str(tmp_path / "ckpt")
    convert_hf.convert(a, out)
    before = open(os.path.join(out, "model_config.json")).read()
    with pytest.raises(FileExistsError, match=r"already holds a conversion: pass --overwrite"):
        convert_hf.convert(b, out)
    assert open(os.path.join(out, "model_config.json")).read() == before  # untouched
    np.testing.assert_allclose(_logits(convert_hf.load_checkpoint(out), tokens_BT),
                               hf_logits(a, tokens_BT), atol=ATOL)  # and still loads
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):  # the library call
        convert_hf.save_checkpoint(convert_hf.load_hf(b), out)
    assert open(os.path.join(out, "model_config.json")).read() == before
    convert_hf.convert(b, out, overwrite=True)
    np.testing.assert_allclose(_logits(convert_hf.load_checkpoint(out), tokens_BT),
                               hf_logits(b, tokens_BT), atol=ATOL)
    assert _siblings(out) == []


@pytest.mark.parametrize("where", ["same folder", "inside", "inside through a symlink",
                                   "holding --hf"])
def test_convert_refuses_an_out_at_or_inside_hf(hf_dirs, tmp_path, where):
    import shutil

    hf = str(tmp_path / "hf")
    shutil.copytree(hf_dirs["qwen2_tied"], hf)
    os.symlink(hf, tmp_path / "link")
    out = {"same folder": hf, "inside": os.path.join(hf, "ckpt"),
           "inside through a symlink": str(tmp_path / "link" / "ckpt"),
           "holding --hf": str(tmp_path)}[where]
    listing = sorted(os.listdir(hf))
    with pytest.raises((ValueError, FileExistsError), match=r"--out .*(--hf|holds)"):
        convert_hf.convert(str(tmp_path / "link") if where == "same folder" else hf, out,
                           overwrite=True)
    assert sorted(os.listdir(hf)) == listing  # nothing written into the source


def test_a_failed_convert_leaves_no_half_folder(tmp_path, hf_dirs, tokens_BT):
    broken = make_tiny_hf(tmp_path / "broken", arch="qwen3", tie=False)
    _rewrite(broken, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    out = str(tmp_path / "new")
    with pytest.raises(KeyError, match="lm_head.weight"):
        convert_hf.convert(broken, out)
    assert not os.path.exists(out) and _siblings(out) == []
    old = str(tmp_path / "old")  # --overwrite: the old conversion stays until the new is whole
    convert_hf.convert(hf_dirs["qwen2_untied"], old)
    with pytest.raises(KeyError):
        convert_hf.convert(broken, old, overwrite=True)
    np.testing.assert_allclose(_logits(convert_hf.load_checkpoint(old), tokens_BT),
                               hf_logits(hf_dirs["qwen2_untied"], tokens_BT), atol=ATOL)
    assert _siblings(old) == []


@pytest.mark.parametrize("case, pattern", [
    ("no --hf folder", r"^convert_hf: --hf '.*/absent' is not a folder$"),
    ("--out inside --hf", r"^convert_hf: --out '.*/hf/ckpt' lies inside --hf \(.*\): the conversion "
                          r"would be written into the source folder; choose an --out outside it$"),
    ("--out exists", r"^convert_hf: --out '.*/done' already holds a conversion: pass --overwrite "),
    ("damaged config.json", r"^convert_hf: .*/bad/config.json is not valid JSON \("),
])
def test_command_errors_are_one_or_two_lines(hf_dirs, tmp_path, case, pattern):
    import shutil
    import subprocess
    import sys

    hf = str(tmp_path / "hf")
    shutil.copytree(hf_dirs["qwen2_tied"], hf)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "model_config.json").write_text("{}")
    shutil.copytree(hf, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text("{not json")
    hf_arg, out = {"no --hf folder": (str(tmp_path / "absent"), str(tmp_path / "o")),
                   "--out inside --hf": (hf, os.path.join(hf, "ckpt")),
                   "--out exists": (hf, str(tmp_path / "done")),
                   "damaged config.json": (str(tmp_path / "bad"), str(tmp_path / "o"))}[case]
    argv = [sys.executable, "-m", "ba_jax.models.convert_hf", "--hf", hf_arg, "--out", out]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and 1 <= len(lines) <= 2, proc.stderr  # before: 12-31 lines
    assert re.search(pattern, lines[0]), lines[0]
    if len(lines) == 2:
        assert lines[1] == "  (--verbose prints the full detail)"
    verbose = subprocess.run(argv + ["--verbose"], capture_output=True, text=True, timeout=300)
    assert "Traceback (most recent call last)" in verbose.stderr


# ------------------------------------------------- export: a folder that loads as it is (item 11)


def test_export_writes_the_tokenizer_and_generation_config(hf_dirs, tmp_path, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    from ba_jax.tasks import arithmetic

    hf = str(tmp_path / "hf")
    import shutil

    shutil.copytree(hf_dirs["qwen3_tied"], hf)
    tok_dir = arithmetic.save_tokenizer(str(tmp_path / "tok"))
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), hf)
    conv = str(tmp_path / "conv")
    convert_hf.convert(hf, conv)
    assert os.path.isfile(os.path.join(conv, "tokenizer.json"))
    # from a convert_hf folder: its tokenizer and the HF folder's generation config
    written = convert_hf.export_hf(convert_hf.load_checkpoint(conv), str(tmp_path / "a"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        written)
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "a"))) == len(
        AutoTokenizer.from_pretrained(tok_dir))
    assert GenerationConfig.from_pretrained(str(tmp_path / "a")).eos_token_id == 2
    assert "no tokenizer" not in capsys.readouterr().out
    # a model whose folder has no tokenizer: one line says so; a generation config is made
    written = convert_hf.export_hf(convert_hf.load_hf(hf_dirs["qwen2_tied"]), str(tmp_path / "b"))
    out = capsys.readouterr().out.splitlines()
    assert "tokenizer.json" not in written and len(out) == 2 and out[1].startswith(
        "export_hf: no tokenizer written")
    assert GenerationConfig.from_pretrained(str(tmp_path / "b")).bos_token_id == 1
    # a tokenizer passed in (a run's own): saved beside the weights
    model = convert_hf.load_hf(hf_dirs["qwen2_tied"])
    written = convert_hf.export_hf(model, str(tmp_path / "c"),
                                   tokenizer=AutoTokenizer.from_pretrained(tok_dir))
    assert "tokenizer.json" in written and "no tokenizer" not in capsys.readouterr().out
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "c"))) == 101
