"""Mesh construction, the parameter-path table, logical -> mesh rules and batch sharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ba_jax import sharding
from ba_jax.models import layers, qwen

TINY = qwen.ModelConfig("qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4,
                        rms_norm_eps=1e-6, max_position_embeddings=64, use_tied_embeddings=False,
                        use_qkv_bias=True, use_o_bias=True, use_qk_norm=True)
VARIANTS = {  # between them every kind of parameter either architecture has
    "qwen3_all_flags": TINY,
    "qwen3_preset": qwen.PRESETS["Qwen3-0.6B"],
    "qwen2_tied": qwen.PRESETS["Qwen2.5-0.5B"],
    "qwen2_untied": qwen.PRESETS["Qwen2.5-7B"],
}


def _abstract_params(config):
    return nnx.state(nnx.eval_shape(lambda: qwen.Qwen(config, rngs=nnx.Rngs(0))), nnx.Param)


def _flat(state):
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {sharding.path_str(p): leaf for p, leaf in leaves}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_parameter_matches_exactly_one_rule(name):
    params = _flat(_abstract_params(VARIANTS[name]))
    assert params
    for path, leaf in params.items():
        hits = [axes for pattern, axes in sharding.PARAM_AXES if re.fullmatch(pattern, path)]
        assert len(hits) == 1, path
        assert len(hits[0]) == leaf.ndim, path
        assert set(hits[0]) <= set(sharding.DEFAULT_RULES), path


def test_every_kernel_pins_its_table_axes():
    """A Linear's `axes` (the sharding its compute-dtype copy is pinned to) are its
    PARAM_AXES entry, minus the stacked `layers` axis for decoder layers."""
    model = nnx.eval_shape(lambda: qwen.Qwen(TINY, rngs=nnx.Rngs(0)))
    seen = 0
    for path, node in nnx.iter_graph(model):
        if isinstance(node, layers.Linear):
            dotted = ".".join(map(str, path)) + ".kernel"
            want = sharding.logical_axes(dotted)
            assert node.axes == (want[1:] if dotted.startswith("layers.") else want), dotted
            seen += 1
    assert seen == 8  # q, k, v, o, gate, up, down, lm_head


def test_constrain_maps_activation_axes_and_is_a_no_op_without_a_mesh():
    x = jnp.zeros((16, 4, 6))
    assert sharding.constrain(x, ("act_batch", "act_length", "act_vocab")) is x
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    assert sharding.logical_spec(("act_batch", "act_length", "act_vocab"), x.shape,
                                 mesh) == P(("data", "fsdp"), None, "tensor")
    # 5 heads do not divide over tensor=2: replicated, as for parameters
    assert sharding.logical_spec(("act_batch", "act_heads"), (16, 5), mesh) == P(
        ("data", "fsdp"), None)

    def f(x):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return sharding.constrain(x * 2, ("act_batch", "act_length", "act_vocab"))

    y = jax.jit(f)(jax.device_put(x, jax.sharding.NamedSharding(mesh, P())))
    want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    assert y.sharding.is_equivalent_to(want, 3)


def test_logical_axes_rejects_unknown_path():
    with pytest.raises(ValueError, match="matches 0 PARAM_AXES rules"):
        sharding.logical_axes("layers.self_attn.rotary.kernel")


def test_make_mesh_shapes():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == sharding.MESH_AXES and dict(mesh.shape) == {
        "data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.make_mesh({"tensor": 2}).shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    assert dict(sharding.make_mesh((1, -1, 2)).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError, match="uses 16 devices but 8 are present"):
        sharding.make_mesh({"data": 16})
    # the one resolver: config meshes must use every device, -1 takes what is left
    assert sharding.resolve_mesh_shape({"data": -1, "tensor": 2}, 8, exact=True) == {
        "data": 4, "fsdp": 1, "tensor": 2}
    for shape, message in [({"data": 2}, "uses 2 devices but 8"),
                           ({"data": -1, "fsdp": -1}, "at most one axis"),
                           ({"data": -1, "fsdp": 3}, "does not fit 8 devices")]:
        with pytest.raises(ValueError, match=message):
            sharding.resolve_mesh_shape(shape, 8, exact=True)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.make_mesh({"model": 2})


def test_param_specs_and_indivisible_dims_stay_replicated():
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
    # Qwen2.5-0.5B: 14 query heads and 2 kv heads do not divide by tensor=4
    specs = _flat(sharding.param_shardings(_abstract_params(qwen.PRESETS["Qwen2.5-0.5B"]), mesh))
    assert specs["embed_tokens.embedding"].spec == P("tensor", "fsdp")
    # the leading layers axis is never split
    assert specs["layers.self_attn.q_proj.kernel"].spec == P(None, "fsdp", None, None)
    assert specs["layers.self_attn.k_proj.bias"].spec == P(None, None, None)
    assert specs["layers.mlp.gate_proj.kernel"].spec == P(None, "fsdp", "tensor")
    assert specs["layers.mlp.down_proj.kernel"].spec == P(None, "tensor", "fsdp")
    assert specs["norm.scale"].spec == P(None)
    specs = _flat(sharding.param_shardings(_abstract_params(qwen.PRESETS["Qwen3-8B"]), mesh))
    assert specs["layers.self_attn.o_proj.kernel"].spec == P(None, "tensor", None, "fsdp")
    assert specs["lm_head.kernel"].spec == P("fsdp", "tensor")
    # custom rules: embed over both fsdp and data, vocab replicated
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = dict(sharding.DEFAULT_RULES, embed=("fsdp", "data"), vocab=None)
    spec = sharding.spec_for("embed_tokens.embedding", (151936, 4096), mesh, rules)
    assert spec == P(None, ("fsdp", "data"))


def test_sharded_params_give_the_unsharded_forward():
    model = qwen.Qwen(TINY, rngs=nnx.Rngs(0))
    tokens_BT = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 6)))
    fwd = jax.jit(lambda m, t: m(t))
    ref = fwd(model, tokens_BT)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, sharding.param_shardings(state, mesh)))
    q = model.layers.self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    tokens_BT = sharding.shard_batch(tokens_BT, mesh)
    assert tokens_BT.sharding.spec == P(("data", "fsdp"))
    assert len(tokens_BT.addressable_shards) == 8
    assert tokens_BT.addressable_shards[0].data.shape == (1, 6)
    np.testing.assert_allclose(fwd(model, tokens_BT), ref, atol=1e-5)


def test_batch_sharding_fits_every_rank():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
    batch = sharding.shard_batch({"adv_B": np.ones(8, np.float32),
                                  "mask_BR": np.ones((8, 3), np.float32),
                                  "x_BRD": np.ones((8, 3, 2), np.float32)}, mesh)
    assert batch["adv_B"].addressable_shards[0].data.shape == (1,)
    assert batch["mask_BR"].addressable_shards[0].data.shape == (1, 3)
    assert batch["x_BRD"].addressable_shards[0].data.shape == (1, 3, 2)
    # rows over (data, fsdp), the rest replicated: what the explicit per-rank spec says
    assert batch["x_BRD"].sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None, None)), 3)

