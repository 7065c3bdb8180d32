"""Per-device memory plan of a run: `python -m ba_jax.plan --config=... [--num_devices=N]`.

Lives here: `plan(cfg, num_devices)`, which sizes parameters, gradients, optimizer state,
activations and the sampler's KV cache for one device of the config's mesh, and the
fit verdict against named accelerators (`DEVICES`). Nothing is allocated: parameter and
optimizer shapes come from `jax.eval_shape` of the real model and optimizer, and their
per-device bytes from the sharding rules (`sharding.spec_for` on an abstract mesh, so a
slice larger than this machine can be planned). Not here: running anything.

Exact: parameters, gradients, gradient accumulator, optimizer state, KV cache (the
layouts the trainer and sampler use). Estimated (formulas in `activation_bytes` and
`sampler_bytes`): activations, which depend on what XLA fuses and keeps. Attention here
is plain einsum (no flash kernel), so its [T, S] scores are materialised per layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np

GIB = 1024**3
# HBM per chip / GPU, GiB (TPU: per chip as Cloud TPU documents it; GPU: the SKU's size).
DEVICES: dict[str, float] = {
    "v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100-80g": 80, "h100": 80, "h200": 141,
}
# Share of HBM a plan may use: the rest is XLA's scratch, fragmentation and the programs.
USABLE_FRACTION = 0.9


def model_config(cfg: Any):
    """The run's ModelConfig; an `init=hf` run without a preset reads the folder's config.json."""
    from ba_jax import run_config
    from ba_jax.models import qwen

    path = os.path.join(cfg.model.init_path or "", "config.json")
    if not cfg.model.preset and cfg.model.init == "hf" and os.path.isfile(path):
        with open(path) as f:
            hf = qwen.ModelConfig.from_hf_config(json.load(f))
        return dataclasses.replace(hf, **run_config.runtime_options(cfg))
    return run_config.model_config(cfg)


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


def _split(path: str, shape: tuple[int, ...], mesh) -> int:
    """How many pieces the sharding rules cut a leaf into (1: replicated)."""
    from ba_jax import sharding

    if not path or not shape:
        return 1
    n = 1
    for entry in sharding.spec_for(path, shape, mesh):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        n *= math.prod(mesh.shape[a] for a in names)
    return n


def tree_bytes(tree: Any, mesh) -> tuple[int, int]:
    """(global bytes, per-device bytes) of an abstract parameter or optimizer pytree."""
    total = per_device = 0
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        total += size
        per_device += size // _split(_param_path(key_path), tuple(leaf.shape), mesh)
    return total, per_device


def _tp(n: int, tensor: int) -> float:
    """Per-device share of a dimension split over `tensor` when it divides (as spec_for)."""
    return n / tensor if n % tensor == 0 else n


def activation_bytes(mc, *, rows: int, T: int, itemsize: int, tensor: int,
                     use_remat: bool) -> dict[str, int]:
    """Training activations of one micro-batch on one device (estimate).

    Saved per token per layer, in the compute dtype (`itemsize` bytes) unless noted:
      residual stream and the two norm outputs: 4 D;
      q, k, v projections and their normed / rotated copies: 2 (N + 2K) H;
      attention output (o_proj input): N H;  SwiGLU gate, up, silu(gate), product: 4 F;
      attention scores, materialised: N T (4 + itemsize) (f32 softmax + its cast).
    Head, MLP and vocab dims are divided by `tensor` where it divides them.
    Without remat all L layers keep that, plus one layer of backward cotangents.
    With remat only each layer's input (D) is kept, plus one layer recomputed and its
    cotangents. Logits: f32 [rows, T, V] and the log-softmax cotangent of the same size.
    """
    D, F, H = mc.hidden_size, mc.intermediate_size, mc.head_dim
    N, K, L, V = mc.num_heads, mc.num_kv_heads, mc.num_layers, mc.vocab_size
    per_tok = itemsize * (4 * D + 2 * (_tp(N, tensor) + 2 * _tp(K, tensor)) * H
                          + _tp(N, tensor) * H + 4 * _tp(F, tensor))
    scores_per_tok = _tp(N, tensor) * T * (4 + itemsize)
    layer = rows * T * (per_tok + scores_per_tok)
    logits = 2 * rows * T * _tp(V, tensor) * 4
    kept = L * rows * T * itemsize * D + 2 * layer if use_remat else (L + 1) * layer
    return dict(layers=int(kept), attention_scores_per_layer=int(rows * T * scores_per_tok),
                logits=int(logits), total=int(kept + logits))


def sampler_bytes(mc, *, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                  itemsize: int, dp: int) -> dict[str, int]:
    """The sampler's KV cache and prefill peak on one device.

    Cache: per layer k and v of [rows, K, S, H] in the compute dtype, S = prompt bucket +
    new tokens, rows split over data x fsdp when they divide (else replicated, as the
    sampler's row constraint). The P-row prompt cache coexists with its G-fold repeat once.
    Prefill transient: one layer's scores [P, N, Tp, S] in f32 plus their cast.
    """
    L, K, H, N = mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.num_heads
    S = prompt_len + new_tokens

    def per_dev(rows: int) -> int:
        return rows // dp if rows % dp == 0 else rows

    kv = 2 * L * per_dev(prompts * samples) * K * S * H * itemsize
    kv_prompt = 2 * L * per_dev(prompts) * K * S * H * itemsize
    prefill = per_dev(prompts) * N * prompt_len * S * (4 + itemsize)
    decode_logits = 3 * per_dev(prompts * samples) * mc.vocab_size * 4  # logits, probs, sort
    return dict(kv_cache=int(kv), transient=int(kv_prompt + max(prefill, decode_logits)))


def abstract_policy(cfg: Any):
    """(graphdef, abstract parameters) of the run's policy: `jax.eval_shape` of the model
    `build.init_policy` makes, the same structure whatever `model.init` (no weights read)."""
    from flax import nnx

    from ba_jax import run_config
    from ba_jax.models import qwen

    mc = model_config(cfg)
    dtype, pdtype = run_config.DTYPES[cfg.model.dtype], run_config.DTYPES[cfg.model.param_dtype]
    return nnx.split(nnx.eval_shape(
        lambda: qwen.Qwen(mc, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=pdtype)))


def plan(cfg: Any, num_devices: int, *, usable_fraction: float = USABLE_FRACTION) -> dict:
    """Per-device bytes of a run of `cfg` on `num_devices` and the fit per named device."""
    from ba_jax import build, run_config, sampler

    axes = run_config.mesh_axes(cfg, num_devices)
    mesh = _abstract_mesh(axes)
    mc = model_config(cfg)
    dtype = run_config.DTYPES[cfg.model.dtype]
    itemsize = np.dtype(dtype).itemsize
    _, params = abstract_policy(cfg)
    tx, _ = build.make_optimizer(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    param_count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    params_total, params_dev = tree_bytes(params, mesh)
    opt_total, opt_dev = tree_bytes(opt_state, mesh)
    f32_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), params)
    k = cfg.grpo.num_microbatches
    accum_dev = tree_bytes(f32_params, mesh)[1] if k > 1 else 0  # f32 sum over micro-batches

    P, G = cfg.rollout.prompts_per_step, cfg.rollout.num_samples
    dp = axes["data"] * axes["fsdp"]
    rows = P // cfg.grpo.num_minibatches * G
    mb_rows = max(rows // k, 1)
    warnings = []
    if rows % k or mb_rows % dp:
        warnings.append(f"micro-batch rows ({rows} / {k}) do not split evenly over data*fsdp={dp}"
                        " devices: run_config.validate rejects this config on this mesh")
    mb_rows_dev = -(-mb_rows // dp)
    Tp = sampler.prompt_bucket(cfg.data.max_prompt_tokens)
    R = cfg.rollout.max_new_tokens
    T = Tp + R - 1  # grpo.sequence_inputs drops the last slot of [prompt | response]
    act = {remat: activation_bytes(mc, rows=mb_rows_dev, T=T, itemsize=itemsize,
                                   tensor=axes["tensor"], use_remat=remat)
           for remat in (True, False)}
    samp = sampler_bytes(mc, prompts=P, samples=G, prompt_len=Tp, new_tokens=R,
                         itemsize=itemsize, dp=dp)
    use_remat = cfg.model.remat != "none"
    resident = params_dev + opt_dev
    train_peak = resident + params_dev + accum_dev + act[use_remat]["total"]  # + grads
    sample_peak = resident + samp["kv_cache"] + samp["transient"]
    peak = max(train_peak, sample_peak)
    fits = {name: peak <= usable_fraction * gib * GIB for name, gib in DEVICES.items()}
    return dict(
        num_devices=num_devices, mesh=axes, model=mc, param_count=param_count,
        param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.dtype,
        rows=rows, microbatch_rows_per_device=mb_rows_dev, seq_len=T, prompt_bucket=Tp,
        use_remat=use_remat, usable_fraction=usable_fraction, warnings=warnings,
        global_bytes=dict(params=params_total, optimizer=opt_total),
        bytes=dict(params=params_dev, grads=params_dev, grad_accumulator=accum_dev,
                   optimizer=opt_dev, activations_remat=act[True]["total"],
                   activations_no_remat=act[False]["total"],
                   attention_scores_per_layer=act[True]["attention_scores_per_layer"],
                   logits=act[True]["logits"], kv_cache=samp["kv_cache"],
                   sampler_transient=samp["transient"], train_peak=train_peak,
                   sample_peak=sample_peak, peak=peak),
        fits=fits,
    )


FIT_DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def fit_search(cfg: Any, device: str, *, usable_fraction: float = USABLE_FRACTION) -> dict:
    """The smallest device count (powers of two up to 1024), and with it the fewest
    micro-batches (`grpo.num_microbatches` dividing the rows evenly over the devices), at
    which the plan of `cfg` fits `device`. Returns `dict(num_devices, num_microbatches,
    plan)`, all None when nothing fits; the config itself is not changed."""
    from ba_jax import run_config

    rows = cfg.rollout.prompts_per_step // cfg.grpo.num_minibatches * cfg.rollout.num_samples
    for n in FIT_DEVICE_COUNTS:
        try:
            dp = (lambda a: a["data"] * a["fsdp"])(run_config.mesh_axes(cfg, n))
        except run_config.ConfigError:
            continue  # a mesh fixed in the config that n devices cannot hold
        for k in range(1, rows + 1):
            if rows % k or (rows // k) % dp:
                continue
            trial = cfg.copy_and_resolve_references()
            with trial.unlocked():
                trial.grpo.num_microbatches = k
            p = plan(trial, n, usable_fraction=usable_fraction)
            if p["fits"][device]:
                return dict(num_devices=n, num_microbatches=k, plan=p)
    return dict(num_devices=None, num_microbatches=None, plan=None)


def format_plan(p: dict, device: str | None = None) -> str:
    """Human-readable report of `plan(...)`; `device` restricts the verdict to one name."""
    g = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
    b, m = p["bytes"], p["mesh"]
    lines = [
        f"model: {p['param_count']:,} parameters ({p['param_dtype']} storage, "
        f"{p['compute_dtype']} compute), remat {'on' if p['use_remat'] else 'off'}",
        f"mesh: {p['num_devices']} devices = data {m['data']} x fsdp {m['fsdp']} x tensor "
        f"{m['tensor']}",
        f"batch: {p['rows']} rows per optimizer step, {p['microbatch_rows_per_device']} per "
        f"device per micro-batch, sequence {p['seq_len']} (prompt bucket {p['prompt_bucket']})",
        "per device:",
        f"  parameters              {g(b['params'])}",
        f"  gradients               {g(b['grads'])}",
        f"  grad accumulator (f32)  {g(b['grad_accumulator'])}",
        f"  optimizer state         {g(b['optimizer'])}",
        f"  activations, remat      {g(b['activations_remat'])}   (estimate)",
        f"  activations, no remat   {g(b['activations_no_remat'])}   (estimate)",
        f"    of which logits       {g(b['logits'])}",
        f"    scores of one layer   {g(b['attention_scores_per_layer'])}",
        f"  sampler KV cache        {g(b['kv_cache'])}",
        f"  sampler transient       {g(b['sampler_transient'])}   (estimate)",
        f"  peak, train step        {g(b['train_peak'])}",
        f"  peak, sampling          {g(b['sample_peak'])}",
        f"  peak                    {g(b['peak'])}",
    ]
    lines += [f"warning: {w}" for w in p["warnings"]]
    names = [device] if device else list(DEVICES)
    lines.append(f"fit (peak <= {p['usable_fraction']:.0%} of HBM):")
    for name in names:
        cap = DEVICES[name] * GIB
        verdict = "fits" if p["fits"][name] else "does NOT fit"
        lines.append(f"  {name:9s} {DEVICES[name]:5.0f} GiB  {verdict:12s} "
                     f"({b['peak'] / cap:6.1%} of HBM)")
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    import sys

    from absl import flags

    from ba_jax import run_config

    F = flags.FLAGS
    if F.device and F.device not in DEVICES:
        sys.exit(f"ba_jax.plan: --device={F.device!r}; valid: {', '.join(DEVICES)}")
    try:
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
    except run_config.ConfigError as e:
        sys.exit(f"ba_jax.plan: {e}")
    print(format_plan(p, F.device or None), end="")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
    flags.DEFINE_integer("num_devices", 0, "devices to plan for (0: this machine's, or with "
                         "--device the fewest that fit)")
    flags.DEFINE_string("device", "", f"report only this device: {', '.join(DEVICES)}")
    flags.mark_flags_as_required(["config"])
    app.run(main)
