"""Per-device memory of the real train step and sampler at the paper's shapes, compiled.

Every figure is read from `compiled.memory_analysis()` of the real jitted functions
(`ba_jax.plan.compiled_memory`), AOT-compiled from `jax.ShapeDtypeStruct`s on fake CPU
devices: nothing is allocated, so the script runs on a laptop. Beside each: the planner's
estimate (`ba_jax.plan.plan`) and their ratio.

    python benchmarks/memory.py              # the paper cases (about 2 minutes on 2 cores)
    python benchmarks/memory.py --calibrate  # refit the planner's activation coefficients
    python benchmarks/memory.py --dtype float32  # the same cases in float32 compute

Cases (prompt bucket 2,048 + response, bf16 compute, f32 master weights, remat full):
  Qwen3-1.7B, fsdp=8, 2 rows per device per micro-batch, response 8,192 (target <= 16 GiB);
  the same with 1 row; with 4,096 and 16,384 response tokens (the slope in T);
  Qwen2.5-Math-7B, fsdp=16, 1 row per device, response 8,192 (target <= 32 GiB);
  both models with tensor=4 added (32 / 64 devices: the fit has no tensor-split cut);
  and the sampler call of each case as the paper config makes it: one rollout-engine call of
  512 rows with 48 slots over the row devices (the decode copy of the weights, the page pool).

`--calibrate` compiles 4-layer cuts of Qwen3-1.7B at the paper's row length with one
dimension changed at a time and least-squares fits the per-token coefficients that
`ba_jax.plan.TRAIN_COEF` / `SAMPLE_COEF` hold, for bf16 and f32 compute; it prints them
and each cut's fit error. The coefficients are XLA:CPU's: TPU/GPU keep bf16 intermediates
in bf16 and fuse more, so the estimate is an upper bound there (`gpu_step.py` prints a
GPU's measured peak beside it where one is present).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=64")

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ba_jax import plan  # noqa: E402
from ba_jax.models import qwen  # noqa: E402

GIB = 1024**3


def paper_config(model: str, *, response: int = 8192, rows_per_device: int | None = None,
                 num_devices: int = 8, sample_shards: int = 1, dtype: str = "bfloat16"):
    """configs/paper.py for `model`, with the response budget, the micro-batch count that
    gives `rows_per_device` rows per device (None: the config's own) and sampling shards."""
    spec = importlib.util.spec_from_file_location("paper", os.path.join(REPO, "configs", "paper.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config(f"model={model},data=dapo17k,agg=balanced")
    cfg.rollout.max_new_tokens = response
    cfg.model.position_limit = max(cfg.model.position_limit, 2048 + response - 1)
    cfg.model.dtype = dtype
    cfg.grpo.max_tokens_per_device = 0  # these tables are the padded step's (packed: plan.py)
    if rows_per_device:
        rows = plan.train_rows(cfg)
        cfg.grpo.num_microbatches = rows // (rows_per_device * num_devices)
    cfg.rollout.sample_shards = sample_shards
    return cfg


def cut_config(dtype: str, *, layers: int = 4, logits_chunk: int = 256, **dims):
    """A Qwen3-1.7B cut with `layers` layers and `dims` (ModelConfig fields) changed, at the
    paper's row length, 2 rows per device on 8 devices, 8 sampling shards (the sampler
    coefficients were fitted on the static sampler, now a benchmark baseline outside the
    package; a refit runs the engine's call)."""
    cfg = paper_config("qwen3-1.7b", rows_per_device=2, sample_shards=8, dtype=dtype)
    mc = dataclasses.replace(qwen.PRESETS["Qwen3-1.7B"], num_layers=layers, **dims)
    m = cfg.model
    m.preset = ""
    m.logits_chunk = logits_chunk
    m.init = "random"
    m.arch, m.vocab_size, m.hidden_size = mc.arch, mc.vocab_size, mc.hidden_size
    m.intermediate_size, m.num_layers, m.num_heads = mc.intermediate_size, layers, mc.num_heads
    m.num_kv_heads, m.head_dim, m.rope_theta = mc.num_kv_heads, mc.head_dim, mc.rope_theta
    m.tie_word_embeddings, m.max_position_embeddings = mc.use_tied_embeddings, 40960
    return cfg


def calibrate() -> None:
    variants = [dict(), dict(layers=8), dict(intermediate_size=12288), dict(num_heads=32),
                dict(num_kv_heads=16), dict(vocab_size=75968), dict(hidden_size=3072),
                dict(layers=2), dict(intermediate_size=3072), dict(logits_chunk=1024)]
    for dtype in ("bfloat16", "float32"):
        rows = {"train": ([], []), "sample": ([], [])}
        for v in variants:
            cfg = cut_config(dtype, **v)
            p = plan.plan(cfg, 8)
            got = plan.compiled_memory(cfg, 8)
            for kind in rows:
                feats = plan.memory_features(p, kind)
                rows[kind][0].append([feats[k] for k in plan.COEF_TERMS[kind]])
                fixed = sum(plan.FIXED_COEF[k] * v for k, v in feats.items()
                            if k in plan.FIXED_COEF and kind == "sample")
                rows[kind][1].append(got[kind]["temp_bytes"] - plan.exact_temp_bytes(p, kind)
                                     - fixed)
        # the head phase: an unchunked head, whose logits dwarf one layer's working set
        cfg = cut_config(dtype, logits_chunk=0)
        p = plan.plan(cfg, 8)
        feats = plan.memory_features(p, "train")
        got = plan.compiled_memory(cfg, 8)["train"]["temp_bytes"] - plan.exact_temp_bytes(p, "train")
        coef = plan.TRAIN_COEF[2 if dtype == "bfloat16" else 4]
        rest = sum(coef[k] * feats[k] for k in ("saved_inputs", "head_weight"))
        print(f"\n{dtype}:\n  train head_chunk (logits_chunk=0 cut): "
              f"{(got - rest) / feats['head_chunk']:.2f} bytes per logit")
        for kind, (X, y) in rows.items():
            X, y = np.asarray(X, float), np.asarray(y, float)
            coef, *_ = np.linalg.lstsq(X, y, rcond=None)
            fit = X @ coef
            print(f"  {kind}: " + ", ".join(f"{k}={c:.2f}" for k, c in
                                             zip(plan.COEF_TERMS[kind], coef)))
            for v, a, b in zip(variants, y, fit):
                print(f"    {str(v):34s} compiled {a / GIB:7.3f} GiB  fit {b / GIB:7.3f} GiB")


# name, model, (fsdp, tensor), micro-batches, response tokens
CASES = [
    ("Qwen3-1.7B, fsdp=8, 2 rows/device, R=8192", "qwen3-1.7b", (8, 1), 32, 8192),
    ("Qwen3-1.7B, fsdp=8, 1 row/device, R=8192", "qwen3-1.7b", (8, 1), 64, 8192),
    ("Qwen3-1.7B, fsdp=8, 2 rows/device, R=4096", "qwen3-1.7b", (8, 1), 32, 4096),
    ("Qwen3-1.7B, fsdp=8, 2 rows/device, R=16384", "qwen3-1.7b", (8, 1), 32, 16384),
    ("Qwen2.5-Math-7B, fsdp=16, 1 row/device, R=8192", "qwen2.5-math-7b", (16, 1), 32, 8192),
    ("Qwen3-1.7B, fsdp=8 x tensor=4, 2 rows/device, R=8192", "qwen3-1.7b", (8, 4), 32, 8192),
    ("Qwen2.5-Math-7B, fsdp=16 x tensor=4, 1 row/device, R=8192", "qwen2.5-math-7b", (16, 4), 32,
     8192),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibrate", action="store_true", help="refit the planner's coefficients")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype (model.dtype); float32 shows the programs without "
                         "XLA:CPU's float32 copies of bfloat16 weights")
    args = ap.parse_args()
    if args.calibrate:
        calibrate()
        return
    print("| case | train: compiled peak | planned | planned/compiled | sample (engine): "
          "compiled peak | planned | planned/compiled | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    slope = {}
    for name, model, (fsdp, tensor), k, R in CASES:
        cfg = paper_config(model, response=R, dtype=args.dtype)
        cfg.grpo.num_microbatches = k
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, fsdp, tensor
        n = fsdp * tensor
        t0 = time.perf_counter()
        got = plan.compiled_memory(cfg, n)
        dt = time.perf_counter() - t0
        tr, sa = got["train"], got["sample"]
        if model == "qwen3-1.7b" and (fsdp, tensor, k) == (8, 1, 32):
            slope[R] = tr["peak_bytes"]
        print(f"| {name} | {tr['peak_bytes'] / GIB:.2f} GiB | {tr['planned_bytes'] / GIB:.2f} GiB | "
              f"{tr['planned_bytes'] / tr['peak_bytes']:.2f} | {sa['peak_bytes'] / GIB:.2f} GiB | "
              f"{sa['planned_bytes'] / GIB:.2f} GiB | {sa['planned_bytes'] / sa['peak_bytes']:.2f} | "
              f"{dt:.0f} |", flush=True)
    Rs = sorted(slope)
    steps = [(slope[b] - slope[a]) / (b - a) for a, b in zip(Rs, Rs[1:])]
    print("\nQwen3-1.7B train peak growth per response token (2 rows/device): "
          + ", ".join(f"{a}->{b}: {s / 2**20:.3f} MiB" for (a, b), s in
                      zip(zip(Rs, Rs[1:]), steps)))


if __name__ == "__main__":
    main()
