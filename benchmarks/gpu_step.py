"""GRPO train-step and sampler throughput of a Qwen3-1.7B-shaped policy on NVIDIA GPUs, as MFU.

Workload: the Qwen3-1.7B preset (1.72B parameters, random weights), float32 master weights
and AdamW state, bfloat16 compute, layer remat. Train: the real jitted `train.train_step`
(aggregation weights, clipped surrogate, micro-batch accumulation, AdamW) on 4 prompts x 4
samples of 512 prompt + 1536 response tokens, 4 micro-batches. Sampling: `sampler.generate` (the rollout engine, from
`engine.call.decode_copy` weights)
of 8 prompts x 16 samples, 256 prompt tokens, 512 new tokens. Rows are split over every
visible GPU (mesh data=-1). The peer is the hardware: MFU = model FLOP/s / (peak bf16 dense
FLOP/s x GPUs), with
  train  FLOPs/token = 6 P + 12 L N H T   (P parameters incl. the tied lm_head; T sequence;
                                           attention scores are computed in full, not causal-halved)
  decode FLOPs/token = 2 P + 4 L N H S    (S cache slots attended per step)
Remat recomputes the forward, so hardware FLOPs are ~8/6 of the counted ones (not credited).
Peak bf16 dense TFLOP/s by device kind: `PEAK_TFLOPS` (override with --peak_tflops).
Train memory on device 0 is printed three ways: the measured high-water mark
(`memory_stats()["peak_bytes_in_use"]`), the compiler's figure for the same step on this
device (`ba_jax.plan.compiled_memory`, what `plan --compile` prints), and the planner's
estimate (`ba_jax.plan.plan`, fitted to XLA:CPU compiles).

    python benchmarks/gpu_step.py [--steps 3] [--no-remat] [--peak_tflops 989]
        [--attention auto|xla|chunked|cudnn] [--no-seam_check]

Before the step, `--seam_check` (on by default) runs the kernel seam on the device: every
implementation the device offers (cudnn on a GPU, chunked everywhere) against the xla reference,
values and gradients, bf16, GQA, a left-padded row, T = 1,024; it prints the largest
differences relative to the reference's scale (bf16 resolution is ~4e-3); then the engine's
paged decode attention, the Triton kernel against the gather path (`check_paged`).

Stages run in this order, each printed as soon as it ends: versions and devices, the seam
check, the paged decode check, the train step, the sampler, the train-inference mismatch of
that last sampler call (the engine's bf16 log-probs against the trainer's forward over the
same tokens: the metrics `grpo.old_logp=recompute` logs, docs/consistency.md), then the
train step's compiled memory (one more compile). `--out DIR` also writes `DIR/gpu_step.json` and `DIR/gpu_step.md`
after every stage (so a run cut off by its time slot still leaves what it measured);
`benchmarks/device_check.sh` runs this on an air-gapped GPU image (docs/benchmarks.md, GPU).

Without an NVIDIA GPU it prints a message and exits 0. `--force_cpu --preset=""` runs the
code path on CPU with the tiny default model (for checking the script, not for numbers).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # default .75 wastes 20 GB

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA data sheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0,
               "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def peak_tflops(device_kind: str) -> float | None:
    """Peak bf16 TFLOP/s of a device kind string (longest matching name), or None."""
    hits = [k for k in PEAK_TFLOPS if k.lower() in device_kind.lower()]
    return PEAK_TFLOPS[max(hits, key=len)] if hits else None


def _pct(x: float) -> str:
    return "n/a (unknown peak: pass --peak_tflops)" if np.isnan(x) else f"{x:.1%}"


class Results:
    """What the run measured so far, by stage; with an output folder, rewritten (JSON and
    markdown) after every stage, so a run cut off by its time slot still leaves a summary."""

    def __init__(self, out_dir: str | None):
        self.out_dir = out_dir
        self.data: dict = {"complete": False, "stages": {}}
        self.t0 = time.perf_counter()
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)

    def record(self, stage: str, line: str | None = None, **values) -> None:
        if line is not None:
            print(line, flush=True)
            values["line"] = line
        values["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.data["stages"].setdefault(stage, {}).update(values)
        self.write()

    def write(self) -> None:
        if not self.out_dir:
            return
        for name, text in (("gpu_step.json", json.dumps(self.data, indent=1, default=str)),
                           ("gpu_step.md", self.markdown())):
            tmp = os.path.join(self.out_dir, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, os.path.join(self.out_dir, name))

    def markdown(self) -> str:
        rows = ["# benchmarks/gpu_step.py", "",
                "complete" if self.data["complete"] else
                "**incomplete**: the run stopped before its last stage (time slot or error)", "",
                "| stage | seconds from start | result |", "|---|---:|---|"]
        for stage, v in self.data["stages"].items():
            text = v.get("line") or ", ".join(f"{k} {x}" for k, x in v.items()
                                              if k not in ("elapsed_s", "line"))
            rows.append(f"| {stage} | {v['elapsed_s']} | {text.replace('|', '/')} |")
        return "\n".join(rows)


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages the run depends on."""
    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "transformers",
                 "ml_collections", "numpy", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def find_devices(force_cpu: bool) -> list:
    """The NVIDIA GPUs JAX sees (or the CPU with --force_cpu); [] when there is none."""
    import jax

    if force_cpu:
        return jax.devices("cpu")
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return []
    return [d for d in devices if "nvidia" in d.device_kind.lower() or d.platform == "gpu"]


def make_config(args):
    spec = importlib.util.spec_from_file_location("ba_jax_default_config",
                                                  os.path.join(REPO, "configs", "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    cfg.model.preset = args.preset
    cfg.model.dtype, cfg.model.param_dtype = "bfloat16", "float32"
    cfg.model.remat = "full" if args.remat else "none"
    cfg.model.attention = args.attention
    cfg.model.scan_unroll = 1
    cfg.rollout.prompts_per_step, cfg.rollout.num_samples = args.prompts, args.samples
    cfg.rollout.max_new_tokens = args.response_len
    cfg.data.max_prompt_tokens = args.prompt_len
    cfg.grpo.num_microbatches = args.microbatches
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = -1, 1, 1
    return cfg


def synthetic_batch(cfg, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A rollout batch of full-length rows with +-1 advantages (no EOS: all tokens count)."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.num_samples
    B, Tp, R = P * G, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    return dict(
        prompt_tokens_BT=rng.integers(0, vocab, (B, Tp), dtype=np.int32),
        prompt_mask_BT=np.ones((B, Tp), np.int32),
        tokens_BR=rng.integers(0, vocab, (B, R), dtype=np.int32),
        mask_BR=np.ones((B, R), np.float32),
        old_logp_BR=np.full((B, R), -np.log(vocab), np.float32),
        adv_B=rng.choice(np.array([-1.0, 1.0], np.float32), B),
        group_id_B=np.repeat(np.arange(P, dtype=np.int32), G),
    )


def bench_train(cfg, devices, steps: int):
    """(median step seconds, state, graphdef, measured peak bytes or None)."""
    import jax

    from ba_jax import build, run_config, sharding, train

    mesh = build.make_mesh(cfg, devices)
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    state = train.init_state(params, tx, mesh)
    step_fn = train.make_train_step(build.loss_settings(cfg), graphdef, tx, state, mesh,
                                    num_groups=cfg.rollout.prompts_per_step)
    vocab = run_config.model_config(cfg).vocab_size
    batch = sharding.shard_batch(synthetic_batch(cfg, vocab, np.random.default_rng(0)), mesh)
    state, out = step_fn(state, batch)  # compile
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, out = step_fn(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    stats = devices[0].memory_stats() or {}
    return statistics.median(times), state, graphdef, stats.get("peak_bytes_in_use")


def bench_sampler(graphdef, params, args, vocab: int, mesh):
    """(seconds of the second generate call, tokens generated in it, its Rollout)."""
    import jax
    from flax import nnx

    from ba_jax import sampler
    from ba_jax.engine import call

    # the trainer's hand-off: a compute-dtype copy whole on every row device, then the engine
    dtype = nnx.merge(graphdef, params).dtype
    model = nnx.merge(graphdef, call.decode_copy(params, mesh, dtype))
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, vocab - 1, args.sample_prompt_len)) for _ in
               range(args.sample_prompts)]
    kw = dict(num_samples=args.sample_samples, max_new_tokens=args.sample_new_tokens,
              temperature=1.0, eos_ids=[vocab - 1], pad_id=0, mesh=mesh)
    sampler.generate(model, prompts, key=jax.random.key(0), **kw)  # compile
    t0 = time.perf_counter()
    ro = sampler.generate(model, prompts, key=jax.random.key(1), **kw)
    return time.perf_counter() - t0, int(ro.lengths.sum()), ro


def check_mismatch(graphdef, params, ro, mesh, microbatches: int) -> dict[str, float]:
    """The in-house engine's train-inference mismatch on rollout `ro`: the engine's
    log-probs (paged decode kernels, the compute-dtype decode copy) against the trainer's
    forward over the same tokens (what `grpo.old_logp=recompute` runs), as the metrics the
    trainer logs (`correction.summarize`, token-level IS and rejection at 2 and [1/2, 2])."""
    import jax

    from ba_jax import correction, train

    settings = correction.CorrectionSettings(rollout_is="token", is_threshold=2.0,
                                             rollout_rs="token", rs_lower=0.5, rs_upper=2.0)
    batch = dict(prompt_tokens_BT=np.asarray(ro.prompt_tokens, np.int32),
                 prompt_mask_BT=np.asarray(ro.prompt_mask, np.int32),
                 tokens_BR=np.asarray(ro.tokens, np.int32),
                 mask_BR=np.asarray(ro.mask, np.float32))
    trainer = train.make_reference_fn(microbatches, graphdef, params, mesh)(params, batch)
    part = jax.jit(correction.statistics, static_argnums=3)(
        trainer, np.asarray(ro.logprobs, np.float32), batch["mask_BR"], settings)
    return correction.summarize([jax.device_get(part)], settings)


def check_seam(devices, results: Results | None = None) -> None:
    """Each attention implementation of this device against `xla`: values and gradients."""
    results = results or Results(None)
    import jax
    import jax.numpy as jnp

    from ba_jax.models import attention

    B, T, N, K, H = 2, 1024, 16, 8, 128
    ks = jax.random.split(jax.random.key(0), 4)
    dev = devices[0]
    q, do = (jax.device_put(jax.random.normal(r, (B, T, N, H), jnp.bfloat16), dev)
             for r in (ks[0], ks[3]))
    k, v = (jax.device_put(jax.random.normal(r, (B, T, K, H), jnp.bfloat16), dev)
            for r in ks[1:3])
    valid = jax.device_put(jnp.arange(T)[None] >= jnp.array([[0], [300]]), dev)

    def run(impl):
        def f(q, k, v):
            o = attention.attention(q, k, v, valid, impl=impl)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

        (_, o), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x, np.float32) for x in (o, *g)]

    ref = run("xla")
    impls = ["chunked"] + (["cudnn"] if dev.platform == "gpu" else [])
    for impl in impls:
        try:
            got = run(impl)
        except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
            results.record(f"seam {impl}", f"seam {impl}: FAILED {type(e).__name__}: "
                           f"{str(e)[:300]}", ok=False)
            continue
        errs = [float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                for a, b in zip(got, ref)]
        results.record(
            f"seam {impl}",
            f"seam {impl} vs xla (bf16, T={T}, GQA {N}/{K}, left pad): max |diff| / max |ref| "
            f"out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}",
            ok=True, rel_err=dict(zip(("out", "dq", "dk", "dv"), errs)))
    if dev.platform == "gpu":
        check_paged(dev, results=results)
    else:  # the same code path, small, with the kernel in the Pallas interpreter (--force_cpu)
        check_paged(dev, rows=4, table_pages=8, repeats=2, results=results, interpret=True)


def check_paged(dev, rows: int = 64, table_pages: int = 256, repeats: int = 20,
                results: Results | None = None, interpret: bool = False) -> None:
    """The engine's decode attention on this GPU: jax's Triton paged-attention kernel
    (`pallas_gpu`, what the engine picks in bf16 on a GPU) against the gather path (`xla`):
    64 rows over a shared pool, lengths spread from 1 to 4,096 (pages of 16, tables of 256
    pages), bf16, GQA 16/8, head 128: largest difference relative to the output's scale and
    the time per call of each (median of `repeats`, after a compile), as a ratio."""
    import time

    import jax
    import jax.numpy as jnp

    from ba_jax import compat
    from ba_jax.models import attention

    results = results or Results(None)
    if not compat.has_gpu_paged_kernel():
        results.record("paged decode", f"paged decode: jax {jax.__version__} ships no Pallas GPU "
                       "paged-attention kernel; the engine decodes through the gather path",
                       ok=None)
        return
    B, N, K, H, ps, X = rows, 16, 8, 128, 16, table_pages
    NP = B * X
    rng = np.random.default_rng(0)
    q = jax.device_put(jnp.asarray(rng.normal(size=(B, N, H)), jnp.bfloat16), dev)
    k, v = (jax.device_put(jnp.asarray(rng.normal(size=(K, NP, ps, H)), jnp.bfloat16), dev)
            for _ in range(2))
    table = jax.device_put(jnp.asarray(rng.permutation(NP).reshape(B, X), jnp.int32), dev)
    lengths = jax.device_put(jnp.asarray(np.linspace(1, X * ps, B).astype(np.int32)), dev)
    out, secs = {}, {}
    for impl in ("xla", "pallas_gpu"):
        fn = jax.jit(lambda *a, impl=impl: attention.paged_decode_attention(
            *a, impl=impl, interpret=interpret and impl == "pallas_gpu"))
        try:
            out[impl] = np.asarray(fn(q, k, v, table, lengths), np.float32)
        except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
            results.record("paged decode", f"paged decode {impl}: FAILED {type(e).__name__}: "
                           f"{str(e)[:300]}", ok=False)
            return
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(q, k, v, table, lengths).block_until_ready()
            ts.append(time.perf_counter() - t0)
        secs[impl] = float(np.median(ts))
    err = float(np.abs(out["pallas_gpu"] - out["xla"]).max() / np.abs(out["xla"]).max())
    results.record(
        "paged decode",
        f"paged decode pallas_gpu vs xla (bf16, {B} rows, lengths 1-{X * ps}, GQA {N}/{K}): "
        f"max |diff| / max |ref| {err:.1e}; {secs['pallas_gpu'] * 1e3:.2f} ms vs "
        f"{secs['xla'] * 1e3:.2f} ms per call ({secs['xla'] / secs['pallas_gpu']:.2f}x)",
        ok=True, rel_err=err, ms_pallas_gpu=secs["pallas_gpu"] * 1e3, ms_xla=secs["xla"] * 1e3)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="Qwen3-1.7B", help='ModelConfig preset ("": tiny default)')
    p.add_argument("--steps", type=int, default=3, help="timed train steps (after one compile)")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention", default="auto", help="model.attention for the train step")
    p.add_argument("--seam_check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compiled_memory", action=argparse.BooleanOptionalAction, default=True,
                   help="last stage: compile the train step again for its memory figures")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--response_len", type=int, default=1536)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--sample_prompts", type=int, default=8)
    p.add_argument("--sample_samples", type=int, default=16)
    p.add_argument("--sample_prompt_len", type=int, default=256)
    p.add_argument("--sample_new_tokens", type=int, default=512)
    p.add_argument("--peak_tflops", type=float, default=0.0, help="per-GPU bf16 peak override")
    p.add_argument("--force_cpu", action="store_true", help="run on CPU (script check only)")
    p.add_argument("--out", default="", help="folder for gpu_step.json / gpu_step.md, "
                   "rewritten after every stage")
    args = p.parse_args(argv)

    results = Results(args.out or None)
    results.data["argv"] = sys.argv[1:] if argv is None else list(argv)
    results.data["versions"] = versions()
    devices = find_devices(args.force_cpu)
    if not devices:
        results.record("devices", "benchmarks/gpu_step.py: no NVIDIA GPU visible to JAX (a jax "
                       "with its CUDA plugin, e.g. jax[cuda13]: see docs/scaling.md); nothing "
                       "measured.", count=0)
        return
    import jax

    from ba_jax import build, plan, run_config

    kind = devices[0].device_kind
    peak = args.peak_tflops or peak_tflops(kind) or float("nan")
    cfg = make_config(args)
    run_config.validate(cfg, len(devices))
    mc = run_config.model_config(cfg)
    planned = plan.plan(cfg, len(devices))
    n_params = planned["param_count"]
    L, N, H = mc.num_layers, mc.num_heads, mc.head_dim
    v = results.data["versions"]
    results.record(
        "devices",
        f"jax {jax.__version__} (python {v['python']}, flax {v.get('flax')}, optax "
        f"{v.get('optax')}, orbax-checkpoint {v.get('orbax-checkpoint')}); {len(devices)} x "
        f"{kind}; peak {peak:g} bf16 TFLOP/s per device"
        f"{' (--peak_tflops)' if args.peak_tflops else ''}; model {n_params:,} parameters, "
        f"remat {'on' if args.remat else 'off'}, attention {args.attention}",
        count=len(devices), kind=kind, platform=devices[0].platform, peak_tflops=peak,
        params=n_params)
    if args.seam_check:
        check_seam(devices, results)

    T = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    rows = cfg.rollout.prompts_per_step * cfg.rollout.num_samples
    step_s, state, graphdef, peak_bytes = bench_train(cfg, devices, args.steps)
    tok_s = rows * T / step_s
    flops_tok = 6 * n_params + 12 * L * N * H * T
    mfu = tok_s * flops_tok / (peak * 1e12 * len(devices))
    results.record(
        "train", f"train: {rows} rows x {T} tokens, {args.microbatches} micro-batches: "
        f"{step_s * 1e3:.0f} ms/step, {tok_s:,.0f} tokens/s, MFU {_pct(mfu)} "
        f"({flops_tok / 1e9:.2f} GFLOP/token)", ms_per_step=step_s * 1e3, tokens_per_s=tok_s,
        mfu=None if np.isnan(mfu) else mfu, measured_peak_bytes=peak_bytes)

    mesh = build.make_mesh(cfg, devices)
    sec, gen, ro = bench_sampler(graphdef, state["params"], args, mc.vocab_size, mesh)
    from ba_jax import rollout

    S = rollout.prompt_bucket(args.sample_prompt_len) + args.sample_new_tokens
    flops_dec = 2 * n_params + 4 * L * N * H * S
    mfu_dec = gen / sec * flops_dec / (peak * 1e12 * len(devices))
    results.record(
        "sample", f"sample: {args.sample_prompts} prompts x {args.sample_samples} samples, "
        f"{args.sample_new_tokens} new tokens: {gen:,} tokens in {sec:.2f} s, "
        f"{gen / sec:,.0f} tokens/s, MFU {_pct(mfu_dec)} (decode is memory-bound)",
        seconds=sec, tokens=gen, tokens_per_s=gen / sec,
        mfu=None if np.isnan(mfu_dec) else mfu_dec)
    m = check_mismatch(graphdef, state["params"], ro, mesh, args.microbatches)
    results.record(
        "mismatch", f"engine vs trainer log-probs (bf16, that rollout): mean |diff| "
        f"{m['rollout_logp_diff_mean']:.2e}, max {m['rollout_logp_diff_max']:.3f}, k3 per "
        f"token {m['rollout_kl_k3']:.2e}, per sequence {m['rollout_kl_k3_seq']:.2e}, tokens "
        f"outside [1/2, 2] {m['rollout_ratio_outside_2x_frac']:.2e}, token IS max "
        f"{m['rollout_is_max']:.3f}", **m)
    del state, ro

    if args.compiled_memory:
        est = planned["bytes"]["train_peak"] / 2**30
        got = "n/a" if peak_bytes is None else f"{peak_bytes / 2**30:.1f} GiB"
        compiled = plan.compiled_memory(cfg, len(devices), devices=devices)["train"]
        results.record(
            "train memory", f"train memory on device 0: measured peak {got} (the process's "
            f"high-water mark, state included); compiled on this device (plan --compile) "
            f"{compiled['peak_bytes'] / 2**30:.1f} GiB; ba_jax.plan estimate {est:.1f} GiB "
            "(fitted to XLA:CPU)", measured_peak_bytes=peak_bytes,
            compiled_peak_bytes=compiled["peak_bytes"],
            planned_bytes=planned["bytes"]["train_peak"])
    results.data["complete"] = True
    results.write()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
