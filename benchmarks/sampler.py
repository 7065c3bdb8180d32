"""Sampling throughput of `ba_jax.sampler.generate` against transformers `generate`.

Workload (spec/performance.md): the reference Qwen3 model (vocab 8192, hidden 512, 8 layers,
random init), 16 prompts of 32 tokens x 8 samples x 128 new tokens, every row forced to full
length (no EOS), temperature 1.0, no top-k/top-p. Peer: transformers `generate` with its KV
cache, `torch.set_num_threads(2)`; in bf16 the peer runs under torch.autocast("cpu", bf16)
and ba_jax loads bf16 weights (f32 accumulation, f32 logits/softmax). Runs alternate between
the two so that drifting machine load hits both alike; medians are reported. Each side runs
in its own worker process (benchmarks/_workers.py), so PyTorch's spinning OpenMP threads
cannot slow XLA's, and only one side computes at a time.

    python benchmarks/sampler.py [--runs 3] [--precisions f32,bf16]
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
        ro = sampler.generate(model, prompts, num_samples=G, max_new_tokens=M,
                              key=jax.random.key(calls[0]), temperature=1.0,
                              eos_ids=[V])  # id V is never sampled: every row runs full length
        dt = time.perf_counter() - t0
        assert ro.mask.all(), "a row stopped early"
        return dt

    first = run_once()
    steady = run_once()
    return run_once, dict(compile_s=first - steady)


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
    ap.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ours":
        return _workers.serve(lambda: ours_setup(args.model_dir, args.precision))
    if args.worker == "peer":
        return _workers.serve(lambda: peer_setup(args.model_dir, args.precision,
                                                 args.peer_threads))
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


if __name__ == "__main__":
    main()
