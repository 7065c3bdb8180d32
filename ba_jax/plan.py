"""Per-device memory of a run, planned and compiled: `python -m ba_jax.plan --config=...
[--num_devices=N] [--device=NAME] [--compile [--json]]`.

Lives here: `plan(cfg, num_devices)`, which sizes parameters, gradients, optimizer state,
activations and the sampler's KV cache for one device of the config's mesh, and the fit
verdict against named accelerators (`DEVICES`); `fit_search` (the fewest devices that fit);
`compiled_memory(cfg, num_devices)`, which AOT-compiles the real jitted train step and
sampler call from abstract inputs and reads the compiler's per-device bytes. Nothing is
allocated: shapes come from `jax.eval_shape` of the real model and optimizer, per-device
bytes from the sharding rules (`sharding.spec_for` on an abstract mesh, so a slice larger
than this machine can be planned).

Packed updates (`grpo.max_tokens_per_device` > 0): `plan_packed.py` gives the shapes, the
held data and the compile of the block and optimizer programs.

Exact: parameters, gradients, gradient accumulator, optimizer state, the batch, the KV
cache. Estimated: activations, as a sum of terms (bytes per element x element count,
`COEF_TERMS`, `activation_estimate`) whose coefficients were fitted to XLA's compiled
figures (`benchmarks/memory.py --calibrate`); docs/scaling.md compares the two.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, TypedDict

import jax
import numpy as np

from ba_jax import experience, optim, plan_packed, sampling
from ba_jax.engine import loop as engine_loop
from ba_jax.engine import paging
from ba_jax.engine import shapes as engine_shapes
from ba_jax.plan_model import (COEF_TERMS, DEVICES, FIXED_COEF, GIB,  # noqa: F401
                               SAMPLE_COEF, TRAIN_COEF, _per_dev, _tp, activation_estimate,
                               exact_temp_bytes, memory_features)  # noqa: I001
from ba_jax.plan_report import format_compiled, format_plan
from ba_jax.rollout import prompt_bucket



class MemoryPlan(TypedDict):
    """What `plan` returns (a dict, as `--json` prints it): the run's shapes and per-device
    bytes of each part, the activation estimate's terms, the fit per named device."""

    num_devices: int
    mesh: dict[str, int]  # data, fsdp, tensor
    model: Any  # the ModelConfig
    param_count: int
    param_dtype: str
    compute_dtype: str
    itemsize: int  # bytes per element of the compute dtype
    rows: int  # a mini-batch's rows
    microbatch_rows_per_device: int  # packed: 1 (one row of the budget)
    seq_len: int  # T: prompt bucket + R - 1; packed: the budget
    max_tokens_per_device: int  # grpo.max_tokens_per_device (0: padded rows)
    blocks_per_minibatch: int  # packed: the longest step's blocks; padded: micro-batches
    prompt_bucket: int
    use_remat: bool
    usable_fraction: float
    warnings: list[str]
    shapes: dict[str, Any]  # what the activation terms are computed from
    global_bytes: dict[str, int]  # params, optimizer over the whole mesh
    bytes: dict[str, int]  # per device: params ... train_peak, sample_call, sample_peak, peak
    terms: dict[str, dict[str, int]]  # the train and sample estimates' terms
    fits: dict[str, bool]  # per name of DEVICES
    slots_that_fit: dict[str, int]  # the largest rollout.num_slots per device name
# Share of HBM a plan may use: the rest is XLA's scratch, fragmentation and the programs.
USABLE_FRACTION = 0.9


def _abstract_mesh(axes: dict[str, int]) -> jax.sharding.AbstractMesh:
    from ba_jax import sharding

    return jax.sharding.AbstractMesh(tuple(axes[a] for a in sharding.MESH_AXES),
                                     sharding.MESH_AXES)


def _param_path(key_path) -> str:
    """Parameter path of a parameter or optimizer leaf (optimizer prefixes dropped)."""
    from ba_jax import sharding

    first = next((i for i, k in enumerate(key_path) if isinstance(k, jax.tree_util.DictKey)),
                 None)
    return "" if first is None else sharding.path_str(key_path[first:])


def _split(path: str, shape: tuple[int, ...], mesh, rules=None) -> int:
    """How many pieces the sharding rules cut a leaf into (1: replicated)."""
    from ba_jax import sharding

    if not path or not shape:
        return 1
    n = 1
    for entry in sharding.spec_for(path, shape, mesh, rules):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        n *= math.prod(mesh.shape[a] for a in names)
    return n


def tree_bytes(tree: Any, mesh, rules=None) -> tuple[int, int]:
    """(global bytes, per-device bytes) of an abstract parameter or optimizer pytree laid
    out by `rules` (default: `sharding.DEFAULT_RULES`)."""
    total = per_device = 0
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        total += size
        per_device += size // _split(_param_path(key_path), tuple(leaf.shape), mesh, rules)
    return total, per_device


def decode_params(params: Any, dtype) -> Any:
    """Abstract `engine.call.decode_copy` of abstract `params`: matrices in the compute dtype."""
    from ba_jax import grpo

    return jax.eval_shape(lambda p: grpo.compute_copy(p, dtype), params)


def abstract_policy(cfg: Any):
    """(graphdef, abstract parameters) of the run's policy: `jax.eval_shape` of the model
    `build.init_policy` makes, the same structure whatever `model.init` (no weights read)."""
    from flax import nnx

    from ba_jax import run_config
    from ba_jax.models import qwen

    mc = run_config.model_config(cfg)
    dtype, pdtype = run_config.DTYPES[cfg.model.dtype], run_config.DTYPES[cfg.model.param_dtype]
    return nnx.split(nnx.eval_shape(
        lambda: qwen.Qwen(mc, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=pdtype)))


def plan(cfg: Any, num_devices: int, *, usable_fraction: float = USABLE_FRACTION) -> MemoryPlan:
    """Per-device bytes of a run of `cfg` on `num_devices` and the fit per named device."""
    from ba_jax import build, run_config

    axes = run_config.mesh_axes(cfg, num_devices)
    mesh = _abstract_mesh(axes)
    mc = run_config.model_config(cfg)
    dtype = run_config.DTYPES[cfg.model.dtype]
    itemsize = np.dtype(dtype).itemsize
    _, params = abstract_policy(cfg)
    tx, _ = build.make_optimizer(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    params_total, params_dev = tree_bytes(params, mesh)
    opt_total, opt_dev = tree_bytes(opt_state, mesh)
    f32_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), params)
    k, S = cfg.grpo.num_microbatches, plan_packed.budget(cfg)
    # f32 sum over micro-batches (packed: always, the host adds every block into it)
    accum_dev = tree_bytes(f32_params, mesh)[1] if k > 1 or S else 0

    dp = axes["data"] * axes["fsdp"]
    rows = train_rows(cfg)
    mb_rows = max(rows // k, 1)
    warnings = []
    if rows % k or mb_rows % dp:
        warnings.append(f"micro-batch rows ({rows} / {k}) do not split evenly over data*fsdp={dp}"
                        " devices: run_config.validate rejects this config on this mesh")
    mb_rows_dev = -(-mb_rows // dp)
    Tp = prompt_bucket(cfg.data.max_prompt_tokens)
    R = cfg.rollout.max_new_tokens
    T = Tp + R - 1  # grpo.sequence_inputs drops the last slot of [prompt | response]
    # one sampler call: a sampling shard's prompts, its G samples each
    sample = sample_shape(cfg, dp)
    remat = "full" if cfg.model.remat != "none" else "none"
    shapes = dict(microbatch_rows_per_device=mb_rows_dev, seq_len=T, prompt_bucket=Tp,
                  new_tokens=R, head_chunk=min(cfg.model.logits_chunk or R, R), remat=remat,
                  attention="xla" if cfg.model.attention == "xla" else "flash", **sample)
    L, K, H = mc.num_layers, mc.num_kv_heads, mc.head_dim
    kv_cache = int(2 * L * _tp(K, axes["tensor"]) * H * sample["kv_tokens"] * itemsize)
    # the sampler's weights: the engine decodes with a compute-dtype copy whole on every row
    # device (engine.call.decode_copy), the static sampler with the same copy
    from ba_jax import sharding

    decode_dev = tree_bytes(decode_params(params, dtype), mesh, sharding.DECODE_RULES)[1]
    # the train step's mini-batch on one device: int32 / float32 ids, masks, log-probs
    batch_dev, block_dev, blocks = _per_dev(rows, dp) * (2 * Tp + 3 * R + 2) * 4, 0, k
    if S:  # packed: one row of S tokens per device; every mini-batch and block stays
        shapes.update(plan_packed.packed_shapes(cfg))
        mb_rows_dev, T = shapes["microbatch_rows_per_device"], shapes["seq_len"]
        held = plan_packed.held_bytes(cfg, rows, dp)
        batch_dev, block_dev = held["minibatches"] + held["blocks"], held["block"]
        blocks = plan_packed.blocks_per_minibatch(cfg, rows, dp)
    p = dict(
        num_devices=num_devices, mesh=axes, model=mc, param_count=param_count,
        param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.dtype, itemsize=itemsize,
        rows=rows, microbatch_rows_per_device=mb_rows_dev, seq_len=T, prompt_bucket=Tp,
        max_tokens_per_device=S, blocks_per_minibatch=blocks,
        use_remat=remat == "full", usable_fraction=usable_fraction, warnings=warnings,
        shapes=shapes, global_bytes=dict(params=params_total, optimizer=opt_total),
        bytes=dict(params=params_dev, grads=params_dev, grad_accumulator=accum_dev,
                   optimizer=opt_dev, batch=batch_dev, block=block_dev, kv_cache=kv_cache,
                   decode_weights=decode_dev),
    )
    act = {m: activation_estimate(dict(p, shapes=dict(shapes, remat=m)), "train")
           for m in ("full", "none")}
    samp = activation_estimate(p, "sample")
    b = p["bytes"]
    resident = params_dev + opt_dev
    train_peak = resident + batch_dev + exact_temp_bytes(p, "train") + act[remat]["total"]
    # packed: the optimizer step is a program of its own (the accumulator, its scratch)
    train_apply = (resident + batch_dev + accum_dev + plan_packed.apply_temp_bytes(accum_dev)
                   if S else 0)
    train_peak = max(train_peak, train_apply)
    sample_call = decode_dev + samp["total"]  # what the sampler's own program holds
    sample_peak = resident + sample_call  # ... beside the train state on the device
    peak = max(train_peak, sample_peak)
    b.update(activations_remat=act["full"]["total"], activations_no_remat=act["none"]["total"],
             attention_scores_per_layer=act["full"].get("attention_scores", 0),
             logits=act[remat]["head_chunk"], sampler_transient=samp["total"] - samp["kv_cache"],
             train_apply=train_apply, train_peak=train_peak, sample_call=sample_call,
             sample_peak=sample_peak, peak=peak)
    p["terms"] = dict(train=act[remat], sample=samp)
    p["fits"] = {name: peak <= usable_fraction * gib * GIB for name, gib in DEVICES.items()}
    p["slots_that_fit"] = slots_that_fit(p, samp)
    return MemoryPlan(**p)


def slots_that_fit(p: dict, samp: dict) -> dict[str, int]:
    """Per named device, the largest engine `rollout.num_slots` (per call, all row devices)
    whose sampling peak fits beside the train state (0 where the train step does not fit),
    with the default pool (every slot's
    full budget and a prompt's pages per slot); empty for the static sampler or a fixed
    pool. The peak grows with the slots: a binary search over slots per device."""
    s = p["shapes"]
    if "slots_per_device" not in s or s.get("fixed_pool"):
        return {}
    rest = p["bytes"]["sample_peak"] - samp["total"]  # train state and sampler weights

    def peak(slots: int) -> int:
        pages = slots * s["slot_pages"] + min(slots, s["sample_prompts_per_device"]) * s[
            "prompt_pages"]
        q = dict(p, shapes=dict(s, kv_tokens=pages * s["page_size"], decode_rows=slots))
        return rest + activation_estimate(q, "sample")["total"]

    dp = p["mesh"]["data"] * p["mesh"]["fsdp"]
    out = {}
    for name, gib in DEVICES.items():
        cap, lo, hi = p["usable_fraction"] * gib * GIB, 0, 1
        if p["bytes"]["train_peak"] > cap:  # the run does not fit whatever the sampler
            out[name] = 0
            continue
        while peak(hi) <= cap:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # peak(lo) fits (or lo = 0), peak(hi) does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= cap else (lo, mid)
        out[name] = lo * dp
    return out


def sample_shape(cfg: Any, row_devices: int) -> dict:
    """One sampler call of `cfg` on one of `row_devices` devices: prompts, cached tokens
    (`kv_tokens`) and decode rows; for the engine also its slots and pages per device."""
    r = cfg.rollout
    Pg, G, R = r.prompts_per_step // max(r.sample_shards, 1), r.num_samples, r.max_new_tokens
    Tp = prompt_bucket(cfg.data.max_prompt_tokens)
    cs = engine_shapes.call_shape(Pg, Tp, G, R, num_slots=r.num_slots, page_size=r.page_size,
                           num_pages=r.kv_pages, num_devices=row_devices,
                           prefill_chunk=r.prefill_chunk)
    return dict(sample_rows_per_device=cs.rows_per_device,
                sample_prompts_per_device=cs.prompts_per_device,
                kv_tokens=cs.pages_per_device * cs.page_size,  # prompts are in the pool
                decode_rows=cs.slots_per_device, slots_per_device=cs.slots_per_device,
                pages_per_device=cs.pages_per_device, fixed_pool=bool(r.kv_pages),
                page_size=cs.page_size, slot_pages=paging.pages_for(R, cs.page_size),
                prefill_tokens=cs.prefill_chunk,  # one chunk of one prompt per loop step
                prompt_pages=paging.prompt_pages(Tp, cs.page_size))


def _sds(x, sh):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def abstract_train_inputs(cfg: Any, mesh):
    """(graphdef, tx, abstract state, abstract mini-batch) of the run's train step on `mesh`:
    `jax.ShapeDtypeStruct`s with the shardings the trainer gives them (parameters by the
    rules table, AdamW moments like their parameters, counts replicated, batch rows over
    (data, fsdp)); nothing is allocated."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ba_jax import build, sharding

    graphdef, params = abstract_policy(cfg)
    params = jax.tree.map(_sds, params, sharding.param_shardings(params, mesh))
    tx, _ = build.make_optimizer(cfg)
    rep = NamedSharding(mesh, PartitionSpec())
    # the optimizer's own layout rule (`optim.opt_state_shardings`, what init_opt_state uses)
    opt = jax.eval_shape(tx.init, params)
    state = dict(params=params,
                 opt_state=jax.tree.map(_sds, opt, optim.opt_state_shardings(tx, params, mesh)),
                 step=jax.ShapeDtypeStruct((), np.int32, sharding=rep))
    # the trainer's batch schema (`experience.batch_schema`)
    schema = experience.batch_schema(train_rows(cfg), prompt_bucket(cfg.data.max_prompt_tokens),
                                     cfg.rollout.max_new_tokens,
                                     with_ref=cfg.grpo.kl_kind != "none",
                                     with_engine_logp=build.loss_settings(cfg).correction.active)
    row = sharding.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(s, d, sharding=row) for k, (s, d) in schema.items()}
    return graphdef, tx, state, batch


def train_rows(cfg: Any) -> int:
    """Rows of one optimizer step's mini-batch: P / num_minibatches prompts x G samples."""
    return cfg.rollout.prompts_per_step // cfg.grpo.num_minibatches * cfg.rollout.num_samples


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = dict(argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
               alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes))
    # live at once: inputs, outputs not written into donated inputs, and the scratch
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"])
    return out


def compiled_memory(cfg: Any, num_devices: int, *, devices: list | None = None) -> dict:
    """Per-device bytes of the real jitted train step and sampler call of `cfg` on
    `num_devices` of this process's devices, compiled ahead of time from abstract inputs
    (nothing allocated), beside the planner's estimate:
    `{"train": {...}, "sample": {...}}`, each with the integer keys `argument_bytes`,
    `output_bytes`, `temp_bytes`, `planned_bytes` (a contract), and `alias_bytes` and
    `peak_bytes` (argument + output - alias + temp: what is live at once). Packed
    (`grpo.max_tokens_per_device` > 0): "train" is `plan_packed.compiled_train`'s, the
    larger of the block program's peak plus the optimizer state and held data beside it
    and the optimizer program's plus the held data. The figures are
    the compiler's for this process's backend; on CPU run with
    `XLA_FLAGS=--xla_force_host_platform_device_count=N` (the `--compile` command sets it).
    `devices`: compile for these instead of the process's default devices."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ba_jax import build, run_config, sharding, train

    devices = jax.devices() if devices is None else list(devices)
    have = len(devices)
    if have < num_devices:
        raise ValueError(
            f"compiled_memory needs {num_devices} devices but this process has {have} "
            f"({devices[0].platform if devices else 'none'}); on CPU start it with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={num_devices} (python -m ba_jax.plan "
            f"--compile sets it)")
    mesh = build.make_mesh(cfg, devices[:num_devices])
    p = plan(cfg, num_devices)
    graphdef, tx, state, batch = abstract_train_inputs(cfg, mesh)
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.num_samples
    M = cfg.grpo.num_minibatches
    if plan_packed.budget(cfg):  # the packed update's two programs, and what sits beside them
        out = dict(train=plan_packed.compiled_train(cfg, mesh, graphdef, tx, state,
                                                    train_rows(cfg), _memory))
    else:
        step = train.make_train_step(build.loss_settings(cfg), graphdef, tx, state, mesh,
                                     num_groups=P // M)
        out = dict(train=_memory(step.trace(state, batch).lower().compile()))
    out["train"]["planned_bytes"] = int(p["bytes"]["train_peak"])
    # The sampler call as the trainer makes it on one process: the decode copy of the
    # policy (engine.call.decode_copy), one call per sampling shard of P / sample_shards prompts.
    Pg = P // cfg.rollout.sample_shards
    Tp, R = prompt_bucket(cfg.data.max_prompt_tokens), cfg.rollout.max_new_tokens
    r = cfg.rollout
    config = sampling.SamplingConfig(float(r.temperature), int(r.top_k), float(r.top_p))
    i32 = np.int32
    copy = decode_params(state["params"], run_config.DTYPES[cfg.model.dtype])
    copy = jax.tree.map(_sds, copy, sharding.decode_shardings(copy, mesh))
    key = jax.eval_shape(lambda: jax.random.key(0))
    tail = (key, jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((), i32))
    D = engine_shapes.row_devices(mesh)
    cs = engine_shapes.call_shape(Pg, Tp, G, R, num_slots=r.num_slots, page_size=r.page_size,
                                  num_pages=r.kv_pages, num_devices=D,
                                  prefill_chunk=r.prefill_chunk)
    run = engine_loop.engine_fn(graphdef, cs, config, mesh)
    rows = NamedSharding(mesh, PartitionSpec(sharding.row_axes(mesh)))
    Pn, Bn = D * cs.prompts_per_device, D * cs.rows_per_device
    args = ((copy,) + tuple(jax.ShapeDtypeStruct(s, i32, sharding=rows)
                            for s in ((Pn, Tp), (Pn, Tp), (Bn,), (Bn,), (Bn,))) + tail)
    out["sample"] = _memory(run.trace(*args).lower().compile())
    out["sample"]["planned_bytes"] = int(p["bytes"]["sample_call"])
    return out


FIT_DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def fit_search(cfg: Any, device: str, *, usable_fraction: float = USABLE_FRACTION) -> dict:
    """The smallest device count (powers of two up to 1024), and with it the fewest
    micro-batches (`grpo.num_microbatches` dividing the rows evenly over the devices; packed
    configs keep their budget and 1), at which the plan of `cfg` fits `device`. Returns `dict(num_devices, num_microbatches,
    plan)`, all None when nothing fits; the config itself is not changed."""
    from ba_jax import run_config

    rows = train_rows(cfg)
    for n in FIT_DEVICE_COUNTS:
        try:
            dp = (lambda a: a["data"] * a["fsdp"])(run_config.mesh_axes(cfg, n))
        except run_config.ConfigError:
            continue  # a mesh fixed in the config that n devices cannot hold
        for k in range(1, 2 if plan_packed.budget(cfg) else rows + 1):  # packed: k = 1
            if rows % k or (rows // k) % dp:
                continue
            trial = cfg.copy_and_resolve_references()
            with trial.unlocked():
                trial.grpo.num_microbatches = k
            p = plan(trial, n, usable_fraction=usable_fraction)
            if p["fits"][device]:
                return dict(num_devices=n, num_microbatches=k, plan=p)
    return dict(num_devices=None, num_microbatches=None, plan=None)


def main(argv) -> None:
    del argv
    import sys

    from absl import flags

    from ba_jax import run_config

    F = flags.FLAGS
    if F.device and F.device not in DEVICES:
        sys.exit(f"ba_jax.plan: --device={F.device!r}; valid: {', '.join(DEVICES)}")
    if (F.compile or F.json) and not F.num_devices:
        sys.exit("ba_jax.plan: --compile / --json need --num_devices=N (the devices to compile for)")
    try:
        if F.compile or F.json:
            out = compiled_memory(F.config, F.num_devices)
            if F.json:
                print(json.dumps(out))
            else:
                print(format_compiled(out, F.num_devices, jax.devices()[0].platform), end="")
            return
        if F.device and not F.num_devices:  # how many of that device would the run need?
            found = fit_search(F.config, F.device)
            if found["plan"] is None:
                sys.exit(f"ba_jax.plan: --device={F.device}: no count up to "
                         f"{FIT_DEVICE_COUNTS[-1]} devices and no micro-batching fits this config")
            print(f"fit search for {F.device}: {found['num_devices']} devices with "
                  f"--config.grpo.num_microbatches={found['num_microbatches']} is the smallest "
                  "that fits (pass --num_devices=N to plan another count)")
            p = found["plan"]
        else:
            p = plan(F.config, F.num_devices or jax.device_count())
    except (run_config.ConfigError, ValueError) as e:
        sys.exit(f"ba_jax.plan: {e}")
    print(format_plan(p, F.device or None), end="")


def _set_fake_device_count(argv: list[str]) -> None:
    """`--compile` / `--json` with `--num_devices=N`: give the CPU backend N devices before
    JAX creates it (XLA reads the flag once), so a laptop compiles for an N-device mesh."""
    if not any(a in ("--compile", "--json") for a in argv):
        return
    n = next((a.split("=", 1)[1] for a in argv if a.startswith("--num_devices=")), None)
    if n is None and "--num_devices" in argv[:-1]:
        n = argv[argv.index("--num_devices") + 1]
    if n and n.isdigit():
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n}")


if __name__ == "__main__":
    import sys

    from absl import app, flags
    from ml_collections import config_flags

    _set_fake_device_count(sys.argv)
    config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
    flags.DEFINE_integer("num_devices", 0, "devices to plan for (0: this machine's, or with "
                         "--device the fewest that fit)")
    flags.DEFINE_string("device", "", f"report only this device: {', '.join(DEVICES)}")
    flags.DEFINE_bool("compile", False, "AOT-compile the real train step and sampler call on "
                      "--num_devices devices (fake CPU devices here) and print the compiler's "
                      "per-device bytes beside the plan's")
    flags.DEFINE_bool("json", False, "with --compile: one JSON object {train: {...}, sample: "
                      "{...}} of integer bytes per device")
    flags.mark_flags_as_required(["config"])
    app.run(main)
