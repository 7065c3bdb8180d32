"""Train-inference mismatch of the in-house (paged) rollout engine, and what recomputing
pi_old costs.

Default mode, on this machine's first device: the embedded default's policy
(`configs/default.py`, after its supervised warm-up) samples `--calls` steps of 16 prompts x
16 samples through `engine.paged.PagedEngine` as the trainer does (decode copy of the weights
in the compute dtype), and the trainer's forward (`train.make_reference_fn`, what
`grpo.old_logp=recompute` runs) scores the same tokens; printed per variant: the mismatch
metrics the trainer logs (`correction.summarize`, with token-level IS and rejection at the
defaults 2 and [1/2, 2]). Variants: float32 and bfloat16 with the default kernels; `splash`
(prefill and the trainer's forward through Pallas splash attention in the Pallas
interpreter; decode takes the gather path: jax's TPU paged kernel needs 128-wide heads and
this model's are 16); `cudnn` in bf16 (decode through jax's Triton paged-attention kernel in
the Pallas interpreter, prompts prefilled in chunks, the trainer's side the XLA forward):
on a CPU it stops at jax's "cuDNN is not detected" (the engine's forward still reaches
the cuDNN call, which has no CPU build), so it is not in the default list. Then, for f32 and bf16, the median time of one sampling
call, one recompute pass and one train step on that batch, and the recompute's share of
their sum.

`--paper`: the recompute pass against the train step at the paper's shapes
(`configs/paper.py` Qwen3-1.7B, prompt bucket 2,048 + 8,192 response tokens, bf16 compute,
remat full), AOT-compiled on 8 fake CPU devices from abstract inputs: the FLOPs XLA's cost
analysis counts for each (layers unrolled, one micro-batch, XLA attention, an unchunked head,
so no loop hides a trip count; one row per device: the ratio does not depend on rows).

    python benchmarks/logp_mismatch.py [--calls 4] [--variants f32,bf16,splash]
    python benchmarks/logp_mismatch.py --paper
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics as stats
import sys
import tempfile
import time

if "--paper" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ba_jax import build, correction, run_config, train  # noqa: E402
from ba_jax.engine import paged  # noqa: E402
from ba_jax.rollout import EngineSettings, SamplingSettings  # noqa: E402

SETTINGS = correction.CorrectionSettings(rollout_is="token", is_threshold=2.0,
                                         rollout_rs="token", rs_lower=0.5, rs_upper=2.0)


def warmed_policy(cfg, workdir):
    """(graphdef, params, prompt ids, eos ids, mesh) of the embedded run after its warm-up."""
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    tok = build.load_tokenizer(cfg, workdir)
    prompts = build.load_prompt_set(cfg, tok, workdir)
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state = train.prepare_policy(build.warmup_settings(cfg), graphdef,
                                 train.init_state(params, tx, mesh), prompts, tok, mesh, tx)
    eos = sorted(train._eos_ids(tok))
    return graphdef, state["params"], prompts.prompt_ids, eos, tok.pad_token_id, mesh


def variant_graphdef(cfg, params, mesh, *, dtype: str, attention: str = "auto"):
    """The policy's graphdef in compute `dtype` with `attention` (Pallas kernels interpreted)."""
    c = run_config.load_config(os.path.join(REPO, "configs", "default.py"),
                               **{"model.dtype": dtype})
    graphdef, _ = build.init_policy(c, mesh)
    model = nnx.merge(graphdef, params)
    model.config = dataclasses.replace(model.config, attention=attention,
                                       kernel_interpret=attention in ("splash", "cudnn"))
    return nnx.split(model)[0]


def measure(cfg, name, graphdef, trainer_graphdef, params, prompt_ids, eos, pad, mesh, calls,
            *, prefill_chunk=512, timing=False):
    dtype = {"f32": "float32", "splash": "float32"}.get(name, "bfloat16")
    r = cfg.rollout
    sampling = SamplingSettings(num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                                      eos_ids=tuple(eos), temperature=1.0, top_k=0, top_p=1.0,
                                      pad_id=pad)
    engine = paged.PagedEngine(graphdef, EngineSettings(page_size=16,
                                                        prefill_chunk=prefill_chunk),
                               dtype=run_config.DTYPES[dtype], mesh=mesh, sample_mesh=mesh)
    old_fn = train.make_reference_fn(1, trainer_graphdef, params, mesh)
    stat_fn = jax.jit(correction.statistics, static_argnums=3)
    parts, times = [], dict(sample=[], recompute=[], step=[])
    P = r.prompts_per_step
    engine.sync(params)
    for c in range(calls):
        ids = [prompt_ids[(c * P + i) % len(prompt_ids)] for i in range(P)]
        t0 = time.perf_counter()
        ro = engine.generate(ids, sampling, jax.random.key(c))
        t1 = time.perf_counter()
        batch = dict(prompt_tokens_BT=np.asarray(ro.prompt_tokens),
                     prompt_mask_BT=np.asarray(ro.prompt_mask), tokens_BR=np.asarray(ro.tokens),
                     mask_BR=np.asarray(ro.mask, np.float32))
        t2 = time.perf_counter()
        trainer = jax.block_until_ready(old_fn(params, batch))
        t3 = time.perf_counter()
        parts.append(jax.device_get(stat_fn(trainer, np.asarray(ro.logprobs), batch["mask_BR"],
                                            SETTINGS)))
        times["sample"].append(t1 - t0)
        times["recompute"].append(t3 - t2)
    out = correction.summarize(parts, SETTINGS)
    if timing:
        times["step"] = time_train_step(cfg, dtype, batch, np.asarray(ro.logprobs), mesh)
        med = {k: stats.median(v[1:]) for k, v in times.items()}  # the first call compiles
        out["time_ms"] = {k: round(v * 1e3, 1) for k, v in med.items()}
        out["recompute_share"] = med["recompute"] / sum(med.values())
    engine.close()
    return out


def time_train_step(cfg, dtype, batch, logp, mesh, repeats=5):
    """Seconds of one jitted train step (the default config in `dtype`) on `batch`."""
    c = run_config.load_config(os.path.join(REPO, "configs", "default.py"),
                               **{"model.dtype": dtype})
    graphdef, params = build.init_policy(c, mesh)
    tx, _ = build.make_optimizer(c)
    state = train.init_state(params, tx, mesh)
    step = train.make_train_step(build.loss_settings(c), graphdef, tx, state, mesh,
                                 num_groups=c.rollout.prompts_per_step)
    B = batch["tokens_BR"].shape[0]
    mb = dict(batch, old_logp_BR=logp, adv_B=np.random.default_rng(0).standard_normal(
        B).astype(np.float32), group_id_B=np.repeat(np.arange(B // c.rollout.num_samples),
                                                     c.rollout.num_samples).astype(np.int32))
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        state, m = step(state, mb)
        jax.block_until_ready(m)
        out.append(time.perf_counter() - t0)
    return out


def paper_flops() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory import paper_config

    from ba_jax import plan

    cfg = paper_config("qwen3-1.7b", rows_per_device=1)
    cfg.grpo.num_microbatches = 1
    cfg.rollout.prompts_per_step = 1
    cfg.rollout.num_samples = 8  # 8 rows: one per device
    cfg.model.scan_unroll = 28
    cfg.model.attention = "xla"
    cfg.model.logits_chunk = 0
    mesh = build.make_mesh(cfg, jax.devices()[:8])
    graphdef, tx, state, batch = plan.abstract_train_inputs(cfg, mesh)
    flops = {}
    t0 = time.perf_counter()
    step = train.make_train_step(build.loss_settings(cfg), graphdef, tx, state, mesh,
                                 num_groups=1)
    flops["train step"] = _flops(step.trace(state, batch).lower().compile())
    old = train.make_reference_fn(1, graphdef, state["params"], mesh)
    flops["recompute"] = _flops(old.trace(state["params"], batch).lower().compile())
    print(f"compiled in {time.perf_counter() - t0:.0f} s; per device: "
          + ", ".join(f"{k} {v / 1e12:.2f} TFLOP" for k, v in flops.items()))
    ratio = flops["recompute"] / flops["train step"]
    print(f"recompute / train step = {ratio:.3f}; recompute / (recompute + train step) = "
          f"{ratio / (1 + ratio):.3f}")


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--variants", default="f32,bf16,splash")
    ap.add_argument("--paper", action="store_true")
    args = ap.parse_args()
    if args.paper:
        paper_flops()
        return
    cfg = run_config.load_config(os.path.join(REPO, "configs", "default.py"))
    with tempfile.TemporaryDirectory() as wd:
        _, params, prompt_ids, eos, pad, mesh = warmed_policy(cfg, wd)
    for name in args.variants.split(","):
        dtype = "float32" if name in ("f32", "splash") else "bfloat16"
        attention = {"splash": "splash", "cudnn": "cudnn"}.get(name, "auto")
        gd = variant_graphdef(cfg, params, mesh, dtype=dtype, attention=attention)
        # cuDNN has no CPU build: the trainer's side of that variant is the XLA forward
        trainer_gd = gd if name != "cudnn" else variant_graphdef(cfg, params, mesh,
                                                                 dtype=dtype)
        kw = dict(timing=name in ("f32", "bf16"))
        if name == "cudnn":
            kw["prefill_chunk"] = 16  # chunks through the gather path, not the prefill kernel
        t0 = time.perf_counter()
        out = measure(cfg, name, gd, trainer_gd, params, prompt_ids, eos, pad, mesh,
                      args.calls, **kw)
        print(f"{name} ({time.perf_counter() - t0:.0f} s): "
              + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
