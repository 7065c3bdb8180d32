"""Train-step throughput of the ba_jax Qwen model against transformers' PyTorch model.

Workload (spec/performance.md): the reference Qwen3 model (vocab 8192, hidden 512, inter 1536,
8 layers, 8 heads, 4 kv heads, head_dim 64, tied; 29.37M parameters, random init), batch
8 x 256 tokens, forward + backward of the next-token loss plus an AdamW update. Peer:
`Qwen3ForCausalLM` with `torch.optim.AdamW`, `torch.set_num_threads(2)`. Both keep float32
master weights and AdamW state; in bf16 the peer runs its forward under
`torch.autocast("cpu", dtype=torch.bfloat16)` and ba_jax computes with `dtype=bfloat16`
(bf16 x bf16 -> f32 matmuls forward and backward, f32 norms/softmax/logits). Each side runs in
its own worker process (benchmarks/_workers.py) and their steps alternate, so drifting machine
load hits both alike and PyTorch's spinning OpenMP threads cannot slow XLA's; medians are
reported, plus the fraction of this machine's matmul peak (a 2048^3 jnp matmul measured in
the ba_jax worker) at 6N FLOPs/token. The ratio is that of the two medians; beside it, the
median of the per-round ratios (each of our steps against the peer's step right after it),
which a burst of load on this shared machine moves less when it hits a few steps of one side.

    python benchmarks/model.py [--steps 10] [--precisions f32,bf16]

ba_jax runs plain XLA here (no CPU-specific kernels): the figure is what a CPU user gets.
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

import _workers  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
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
        # The trainer's own log-prob gather (fused backward, no [B,T,V] scatter); the last
        # position predicts nothing, so its logits are not computed (as the trainer skips
        # the prompt's).
        logits_BTV = nnx.merge(graphdef, params)(tokens_BT, logits_slice=slice(None, -1))
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


def ours_setup(hf_dir: str, precision: str):
    """Worker: the jitted ba_jax step (compiled here); one timed step per request."""
    step, params, opt_state = make_jax_step(hf_dir, jnp.bfloat16 if precision == "bf16"
                                            else jnp.float32)
    tokens = jnp.asarray(_tokens())
    state = [params, opt_state]

    def run_once() -> float:
        t0 = time.perf_counter()
        state[0], state[1], loss = step(state[0], state[1], tokens)
        loss.block_until_ready()
        return time.perf_counter() - t0

    state[0], state[1], loss = step(state[0], state[1], tokens)  # compile
    return run_once, dict(first_loss=float(loss), peak=matmul_peak()[precision])


def peer_setup(hf_dir: str, precision: str):
    """Worker: transformers' Qwen3ForCausalLM + torch.optim.AdamW, 2 threads."""
    torch.set_num_threads(2)
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir).train()
    topt = torch.optim.AdamW(hf.parameters(), lr=LR)
    ids = torch.as_tensor(_tokens())
    autocast = precision == "bf16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return loss.item()

    def run_once() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    return run_once, dict(first_loss=step())


def _tokens() -> np.ndarray:
    return np.random.RandomState(0).randint(0, V, (B, T))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precisions", default="f32,bf16")
    parser.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        return _workers.serve(lambda: ours_setup(args.model_dir, args.precision))
    if args.worker == "peer":
        return _workers.serve(lambda: peer_setup(args.model_dir, args.precision))
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**HF_KW))
    hf.config.architectures = ["Qwen3ForCausalLM"]
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"params {n_params / 1e6:.2f}M; each side in its own process, alternating; "
          f"load average {os.getloadavg()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)  # both sides start from these weights
        for prec in args.precisions.split(","):
            common = ["--precision", prec, "--model-dir", tmp]
            t_ours, t_peer, ours_info, peer_info = _workers.alternate(
                [__file__, "--worker", "ours", *common],
                [__file__, "--worker", "peer", *common],
                args.steps)
            tj, tp = B * T / statistics.median(t_ours), B * T / statistics.median(t_peer)
            per_round = statistics.median(p / o for o, p in zip(t_ours, t_peer))
            peak = ours_info["peak"]
            frac = 6 * n_params * tj / 1e9 / peak
            rows.append((prec, tj, tp, tj / tp, per_round, frac, peak))
            print(f"{prec}: first losses ours {ours_info['first_loss']:.4f} peer "
                  f"{peer_info['first_loss']:.4f}; ba_jax {tj:.0f} tok/s, PyTorch {tp:.0f} tok/s, "
                  f"ratio {tj / tp:.2f}x (per-round median {per_round:.2f}x), "
                  f"{100 * frac:.0f}% of the {prec} matmul peak "
                  f"({peak:.0f} GFLOP/s); steps ours {[round(t, 2) for t in t_ours]} "
                  f"peer {[round(t, 2) for t in t_peer]}")
    print("\n| precision | ba_jax tokens/s | PyTorch tokens/s | ratio | per-round ratio "
          "| ba_jax % of matmul peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for prec, tj, tp, r, pr, frac, peak in rows:
        print(f"| {prec} | {tj:.0f} | {tp:.0f} | {r:.2f}x | {pr:.2f}x "
              f"| {100 * frac:.0f}% of {peak:.0f} |")


if __name__ == "__main__":
    main()
