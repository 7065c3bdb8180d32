"""Sampling throughput of `ba_jax.sampler.generate` against transformers `generate`.

Workload (spec/performance.md): the reference Qwen3 model (vocab 8192, hidden 512, 8 layers,
random init), 16 prompts of 32 tokens x 8 samples x 128 new tokens, every row forced to full
length (no EOS), temperature 1.0, no top-k/top-p. Peer: transformers `generate` with its KV
cache, `torch.set_num_threads(2)`; in bf16 the peer runs under torch.autocast("cpu", bf16)
and ba_jax loads bf16 weights (f32 accumulation, f32 logits/softmax). Runs alternate between
the two so that drifting machine load hits both alike; medians are reported.

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

from ba_jax import sampler  # noqa: E402
from ba_jax.models import convert_hf  # noqa: E402

P, G, TP, M = 16, 8, 32, 128
V = 8192


def reference_model(out_dir: str) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=V, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, tie_word_embeddings=True, max_position_embeddings=1024)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    return model


def time_ours(model, prompts, key) -> float:
    t0 = time.perf_counter()
    ro = sampler.generate(model, prompts, num_samples=G, max_new_tokens=M, key=key,
                          temperature=1.0, eos_ids=[V])  # id V is never sampled: full length
    dt = time.perf_counter() - t0
    assert ro.mask.all(), "a row stopped early"
    return dt


def time_peer(model, prompts, autocast: bool, new_tokens: int = M) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, num_return_sequences=G, eos_token_id=None,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape == (P * G, TP + new_tokens), out.shape
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--precisions", default="f32,bf16")
    ap.add_argument("--peer-threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.peer_threads)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, V, size=(P, TP)).tolist()
    tokens = P * G * M
    print(f"jax {jax.__version__}, torch {torch.__version__} ({args.peer_threads} threads), "
          f"{tokens} generated tokens per call; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        peer = reference_model(tmp)
        for prec in args.precisions.split(","):
            dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[prec]
            ours = convert_hf.load_hf(tmp, dtype=dtype)
            t0 = time.perf_counter()
            time_ours(ours, prompts, jax.random.key(0))
            first = time.perf_counter() - t0
            time_peer(peer, prompts, prec == "bf16", new_tokens=8)  # warm-up
            t_ours, t_peer = [], []
            for r in range(args.runs):
                t_ours.append(time_ours(ours, prompts, jax.random.key(r + 1)))
                t_peer.append(time_peer(peer, prompts, prec == "bf16"))
            ours_s, peer_s = statistics.median(t_ours), statistics.median(t_peer)
            print(f"{prec}: ba_jax {tokens / ours_s:,.0f} tokens/s, transformers "
                  f"{tokens / peer_s:,.0f} tokens/s, ratio {peer_s / ours_s:.2f}x; "
                  f"compile {first - ours_s:.1f} s; runs ours {[round(t, 2) for t in t_ours]} "
                  f"peer {[round(t, 2) for t in t_peer]}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
