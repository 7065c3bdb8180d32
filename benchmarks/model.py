"""Train-step throughput of the ba_jax Qwen model against transformers' PyTorch model.

Workload (spec/performance.md): the reference Qwen3 model (vocab 8192, hidden 512, inter 1536,
8 layers, 8 heads, 4 kv heads, head_dim 64, tied; 29.37M parameters, random init), batch
8 x 256 tokens, forward + backward of the next-token loss plus an AdamW update. Peer:
`Qwen3ForCausalLM` with `torch.optim.AdamW`, `torch.set_num_threads(2)`. Both keep float32
master weights and AdamW state; in bf16 the peer runs its forward under
`torch.autocast("cpu", dtype=torch.bfloat16)` and ba_jax computes with `dtype=bfloat16`
(bf16 x bf16 -> f32 matmuls forward and backward, f32 norms/softmax/logits). Steps of the two
alternate so drifting machine load hits both alike; medians are reported, plus the fraction
of this machine's matmul peak (a 2048^3 jnp matmul measured in the same run) at 6N FLOPs/token.

    python benchmarks/model.py [--steps 5] [--precisions f32,bf16]
    python benchmarks/model.py --cache-write    # KV-cache slot write, plain vs qwen._cache_write
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
import optax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from ba_jax import grpo  # noqa: E402
from ba_jax.models import convert_hf  # noqa: E402

B, T, V = 8, 256, 8192
LR = 1e-4
HF_KW = dict(vocab_size=V, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             tie_word_embeddings=True, max_position_embeddings=1024)


def make_jax_step(hf_dir: str, dtype):
    """(step, params, opt_state) for ba_jax with the peer's initial weights (f32 masters)."""
    model = convert_hf.load_hf(hf_dir, dtype=dtype, param_dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(LR)
    opt_state = opt.init(params)

    def loss_fn(params, tokens_BT):
        # The trainer's own log-prob gather (fused backward, no [B,T,V] scatter).
        logits_BTV = nnx.merge(graphdef, params)(tokens_BT)[:, :-1]
        return -jnp.mean(grpo.token_logprobs(logits_BTV, tokens_BT[:, 1:]))

    def step(params, opt_state, tokens_BT):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    return step, params, opt_state


def matmul_peak() -> dict[str, float]:
    """GFLOP/s of a 2048^3 matmul, f32 and bf16 x bf16 -> f32."""
    n = 2048
    out = {}
    for name, dt in [("f32", jnp.float32), ("bf16", jnp.bfloat16)]:
        a = jnp.ones((n, n), dt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, a).block_until_ready()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(a, a).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = 2 * n**3 / min(times) / 1e9
    return out


def cache_write() -> None:
    """ms per one-slot write into a donated [128, 4, 1024, 64] cache: plain vs `_cache_write`."""
    from jax import lax

    from ba_jax.models.qwen import _cache_write

    def plain(c, u, i):
        return lax.dynamic_update_slice(c, u.astype(c.dtype), (0, 0, i, 0))

    print("| cache dtype | plain dynamic_update_slice ms | qwen._cache_write ms |")
    print("|---|---:|---:|")
    for dt in [jnp.float32, jnp.bfloat16]:
        row = []
        for fn in (plain, _cache_write):
            f = jax.jit(fn, donate_argnums=(0,))
            c, u = jnp.zeros((128, 4, 1024, 64), dt), jnp.ones((128, 4, 1, 64), jnp.float32)
            c = f(c, u, 0).block_until_ready()
            t0 = time.perf_counter()
            for i in range(20):
                c = f(c, u, i)
            c.block_until_ready()
            row.append((time.perf_counter() - t0) / 20 * 1e3)
        print(f"| {jnp.dtype(dt).name} | {row[0]:.2f} | {row[1]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precisions", default="f32,bf16")
    parser.add_argument("--cache-write", action="store_true", help="only the KV-cache write")
    args = parser.parse_args()
    if args.cache_write:
        return cache_write()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen3Config(**HF_KW)
    n_params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    tokens = np.random.RandomState(0).randint(0, V, (B, T))
    peak = matmul_peak()
    print(f"params {n_params / 1e6:.2f}M; matmul peak GFLOP/s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in peak.items()))
    rows = []
    for prec in args.precisions.split(","):
        torch.manual_seed(0)
        hf = Qwen3ForCausalLM(config).train()
        hf.config.architectures = ["Qwen3ForCausalLM"]
        topt = torch.optim.AdamW(hf.parameters(), lr=LR)
        ids = torch.as_tensor(tokens)
        autocast = prec == "bf16"

        def peer_step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = hf(input_ids=ids, labels=ids).loss
            loss.backward()
            topt.step()
            topt.zero_grad(set_to_none=True)
            return loss.item()

        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            step, params, opt_state = make_jax_step(tmp, jnp.bfloat16 if autocast else jnp.float32)
        jtok = jnp.asarray(tokens)
        params, opt_state, loss = step(params, opt_state, jtok)  # compile
        jl0, pl0 = float(loss), peer_step()
        ours, peer = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, jtok)
            loss.block_until_ready()
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            peer_step()
            peer.append(time.perf_counter() - t0)
        tj, tp = B * T / statistics.median(ours), B * T / statistics.median(peer)
        frac = 6 * n_params * tj / 1e9 / peak[prec]
        rows.append((prec, tj, tp, tj / tp, frac))
        print(f"{prec}: first losses ours {jl0:.4f} peer {pl0:.4f}; ba_jax {tj:.0f} tok/s, "
              f"PyTorch {tp:.0f} tok/s, ratio {tj / tp:.2f}x, {100 * frac:.0f}% of {prec} peak")
    print("\n| precision | ba_jax tokens/s | PyTorch tokens/s | ratio | ba_jax % of matmul peak |")
    print("|---|---:|---:|---:|---:|")
    for prec, tj, tp, r, frac in rows:
        print(f"| {prec} | {tj:.0f} | {tp:.0f} | {r:.2f}x | {100 * frac:.0f}% |")


if __name__ == "__main__":
    main()
