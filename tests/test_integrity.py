"""Checkpoint and state integrity (issue 37 item 4): a damaged checkpoint is refused on
restore (or skipped with fallback_to_previous), an update whose new state is not finite
leaves the state unchanged, and a non-finite state is never saved."""

import glob
import json
import os
import random
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ba_jax import build, checkpoint, integrity, sharding, train
from ba_jax.metrics import read_metrics
from test_train import _random_batch, debug_config, params_of

TIMING = ("step_time_s", "update_time_s", "checkpoint_time_s", "sample_time_s", "score_time_s",
          "sampling_time_share", "tokens_per_s", "weight_sync_time_s")


def _reference_checksum(x) -> int:
    """NumPy: sum_i word_i * (i * 0x9E3779B1 + 1) mod 2**32 over the row-major 32-bit words
    (16-bit types widened, 64-bit types as two words)."""
    a = np.asarray(x)
    if a.dtype == np.bool_:
        words = a.astype(np.uint64).ravel()
    else:
        view = {8: np.uint32, 4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize]
        words = a.view(view).astype(np.uint64).ravel()
    i = np.arange(words.size, dtype=np.uint64)
    return int(np.sum(words * ((i * 0x9E3779B1 + 1) % 2**32) % 2**32) % 2**32)


def test_checksum_matches_numpy_and_ignores_the_sharding():
    rng = np.random.default_rng(0)
    tree = {"f32": rng.standard_normal((16, 24)).astype(np.float32),
            "bf16": jnp.asarray(rng.standard_normal((8, 6)), jnp.bfloat16),
            "i32": rng.integers(-5, 5, (7,)).astype(np.int32), "scalar": np.int32(3),
            "flag": np.array([True, False, True])}
    one = integrity.summary(jax.tree.map(jnp.asarray, tree))
    for name, x in tree.items():
        assert one[name] == (True, _reference_checksum(x)), name
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    spread = dict(tree, f32=jax.device_put(tree["f32"], NamedSharding(mesh, PS("a", "b"))),
                  bf16=jax.device_put(tree["bf16"], NamedSharding(mesh, PS(None, "b"))))
    assert integrity.summary(spread) == one
    moved = dict(tree, f32=tree["f32"].copy())
    moved["f32"][3, 5] = np.nextafter(moved["f32"][3, 5], np.float32(9))  # one bit
    assert integrity.summary(moved)["f32"][1] != one["f32"][1]
    swapped = dict(tree, f32=tree["f32"][::-1].copy())  # the same words elsewhere
    assert integrity.summary(swapped)["f32"][1] != one["f32"][1]
    bad = dict(tree, f32=np.where(np.arange(24) == 7, np.inf, tree["f32"]).astype(np.float32))
    assert integrity.nonfinite(integrity.summary(bad)) == ["f32"]


def test_an_update_that_overflows_the_state_leaves_it_unchanged():
    """A finite loss and gradient whose update overflows the parameters (a step of 1e39):
    the old guard (loss and gradient norm only) let it through; the new state is checked."""
    cfg = debug_config(**{"mesh.data": 1})
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    batch = _random_batch(cfg)
    batch["old_logp_BR"] = np.asarray(train.make_reference_fn(1, graphdef, params, mesh)(
        params, batch))
    tx = optax.sgd(1e39)  # inf in float32: every parameter with a gradient becomes inf
    state = train.init_state(params, tx, mesh)
    before = jax.device_get(state)
    step = train.make_train_step(build.loss_settings(cfg), graphdef, tx, state, mesh,
                                 num_groups=cfg.rollout.prompts_per_step)
    state, out = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    assert np.isfinite(out["loss"]) and np.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert out["nonfinite"] == 1.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state))):
        np.testing.assert_array_equal(a, b)


def _state_of(cfg):
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    _, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    return train.init_state(params, tx, mesh)


def test_a_nonfinite_state_is_never_saved_nor_restored(tmp_path):
    cfg = debug_config(**{"mesh.data": 1})
    state = _state_of(cfg)
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    ck.save(1, state, {"step": 1})
    leaves, treedef = jax.tree.flatten(state)
    assert "params.norm.scale" in integrity.paths(state)
    nan = jax.tree.unflatten(treedef, [
        jnp.full_like(x, jnp.nan) if name == "params.norm.scale" else x
        for name, x in zip(integrity.paths(state), leaves)])
    with pytest.raises(checkpoint.NonFiniteState, match="step 2.*norm.scale"):
        ck.save(2, nan, {"step": 2})
    assert ck.steps() == [1]
    # one written anyway (by a version without the check): refused on restore
    real = integrity.summary
    try:
        integrity.summary = lambda tree: {p: (True, c) for p, (_, c) in real(tree).items()}
        ck.save(2, nan, {"step": 2})
    finally:
        integrity.summary = real
    with pytest.raises(checkpoint.CheckpointError, match=r"/2 is damaged: non-finite values in "
                                                         r"params.norm.scale"):
        ck.restore(2, state)
    ck.close()


def test_a_checksum_that_differs_is_refused(tmp_path):
    cfg = debug_config(**{"mesh.data": 1})
    state = _state_of(cfg)
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    ck.save(1, state, {"step": 1})
    ck.close()
    meta_file = glob.glob(str(tmp_path / "ck" / "1" / "meta" / "*"))[0]
    meta = json.load(open(meta_file))
    meta["integrity"]["params.embed_tokens.embedding"] ^= 1
    json.dump(meta, open(meta_file, "w"))
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"the bits of params.embed_tokens.embedding differ"):
        ck.restore(1, state)
    ck.close()


def test_well_formed_but_different_arrays_are_refused(tmp_path):
    """Damage that still decodes (the case flipped bytes in an uncompressed chunk give):
    step 1's folder holds another state's arrays under step 1's own side-car."""
    cfg = debug_config(**{"mesh.data": 1})
    state = _state_of(cfg)
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    ck.save(1, state, {"step": 1})
    leaves, treedef = jax.tree.flatten(state)
    other = jax.tree.unflatten(treedef, [
        x * 1.5 if name == "params.layers.mlp.down_proj.kernel" else x
        for name, x in zip(integrity.paths(state), leaves)])
    ck.save(2, other, {"step": 2})
    ck.close()
    shutil.rmtree(tmp_path / "ck" / "1" / "state")
    shutil.copytree(tmp_path / "ck" / "2" / "state", tmp_path / "ck" / "1" / "state")
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(checkpoint.CheckpointError, match=r"/1 is damaged: the bits of "
                                                         r"params.layers.mlp.down_proj.kernel"):
        ck.restore(1, state)
    restored, _ = ck.restore(2, state)  # its own side-car: fine
    ck.close()


FLIP = {"checkpoint.every_steps": 1, "checkpoint.max_to_keep": 3}


@pytest.fixture(scope="module")
def two_and_three_steps(tmp_path_factory):
    """A run stopped after step 2 (copied by each case, then damaged) and the same run
    resumed to step 3 (the reference)."""
    root = tmp_path_factory.mktemp("flip")
    two, three = str(root / "two"), str(root / "three")
    train.run_training(debug_config(**FLIP, num_train_steps=2), two)
    shutil.copytree(two, three)
    train.run_training(debug_config(**FLIP, num_train_steps=3), three)
    return two, three


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_flipped_bytes_in_the_latest_checkpoint_never_reach_a_save(tmp_path, seed,
                                                                    two_and_three_steps):
    """64 flipped bytes in the newest checkpoint's largest data file: the resume refuses it
    by name (TensorStore's decompression or the checksums catch it), and with
    fallback_to_previous resumes from the step before. Orbax's file layout varies from save
    to save (how the asynchronous writes are batched into files), so the bytes may also land
    where a restore never reads: then the state restores bit-identical. Either way the run
    ends with the parameters and metrics of an uninterrupted run, and every checkpoint left
    restores checked."""
    two, ref = two_and_three_steps
    wd = str(tmp_path / "run")
    shutil.copytree(two, wd)
    data_file = max(glob.glob(os.path.join(wd, "checkpoints", "2", "state", "**", "d", "*"),
                              recursive=True), key=os.path.getsize)
    raw = bytearray(open(data_file, "rb").read())
    for i in random.Random(seed).sample(range(len(raw)), 64):
        raw[i] ^= 0xFF
    open(data_file, "wb").write(bytes(raw))
    try:
        train.run_training(debug_config(**FLIP, num_train_steps=3), wd)
        refused = False
    except checkpoint.CheckpointError as e:
        assert re.search(r"checkpoints/2 (is damaged|cannot be restored)", str(e)), e
        refused = True
        train.run_training(debug_config(**FLIP, num_train_steps=3,
                                        **{"checkpoint.fallback_to_previous": True}), wd)
        assert os.listdir(os.path.join(wd, "checkpoints_unreadable")) == ["2"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(read_metrics(wd)) == strip(read_metrics(ref)), refused
    step, leaves, _ = params_of(wd)  # restores checked, as every step left does
    _, ref_leaves, _ = params_of(ref)
    assert step == 3
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_array_equal(a, b)
