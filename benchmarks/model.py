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
    python benchmarks/model.py --cache-write    # KV-cache slot write, plain vs qwen._cache_write
    python benchmarks/model.py --attention      # bf16 attention kernel, AVX-512 loops vs AMX
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
from ba_jax import grpo, hostmem  # noqa: E402
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
        for fn in (plain, lambda c, u, i: _cache_write(c, u, i, axis=2)):
            f = jax.jit(fn, donate_argnums=(0,))
            c, u = jnp.zeros((128, 4, 1024, 64), dt), jnp.ones((128, 4, 1, 64), jnp.float32)
            c = f(c, u, 0).block_until_ready()
            t0 = time.perf_counter()
            for i in range(20):
                c = f(c, u, i)
            c.block_until_ready()
            row.append((time.perf_counter() - t0) / 20 * 1e3)
        print(f"| {jnp.dtype(dt).name} | {row[0]:.2f} | {row[1]:.2f} |")


def attention_paths(rounds: int = 20) -> None:
    """The bf16 training attention kernel (native.attention / attention_grad) at the
    benchmark's shapes, causal mask, on its AVX-512 loops and on AMX tiles, alternating in
    this process; per-call medians in ms (one call covers all 8 rows and heads of a layer)."""
    from ba_jax import native
    from ba_jax.models import qwen
    if not native.attention_amx_available():
        raise SystemExit("the AMX attention path needs the native library and AMX-BF16")
    N, K, H = HF_KW["num_attention_heads"], HF_KW["num_key_value_heads"], HF_KW["head_dim"]
    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(r, (B, T, N, H), jnp.bfloat16) for r in (ks[0], ks[3]))
    k, v = (jax.random.normal(r, (B, T, K, H), jnp.bfloat16) for r in (ks[1], ks[2]))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    sin, cos = qwen._rope_tables(jnp.broadcast_to(jnp.arange(T), (B, T)), H, 1e6)
    fwd, bwd = jax.jit(native.attention), jax.jit(native.attention_grad)
    o = fwd(q, k, v, mask, sin, cos)
    calls = {"forward": lambda: fwd(q, k, v, mask, sin, cos),
             "backward": lambda: bwd(q, k, v, mask, sin, cos, o, do)[0]}
    times = {(path, c): [] for path in ("avx512", "amx") for c in calls}
    for r in range(rounds + 1):
        for path in ("avx512", "amx") if r % 2 else ("amx", "avx512"):
            native.use_amx_attention(path == "amx")
            for c, f in calls.items():
                t0 = time.perf_counter()
                f().block_until_ready()
                if r:  # round 0 compiles and warms up
                    times[path, c].append((time.perf_counter() - t0) * 1e3)
    native.use_amx_attention(True)
    print("| call | AVX-512 loops ms | AMX ms | ratio |")
    print("|---|---:|---:|---:|")
    for c in calls:
        a, m = (statistics.median(times[p, c]) for p in ("avx512", "amx"))
        print(f"| {c} | {a:.2f} | {m:.2f} | {a / m:.2f}x |")


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
    parser.add_argument("--cache-write", action="store_true", help="only the KV-cache write")
    parser.add_argument("--attention", action="store_true",
                        help="only the bf16 attention kernel: AVX-512 loops vs AMX tiles")
    parser.add_argument("--keep-freed", action="store_true",
                        help="ba_jax: keep freed memory (BA_JAX_KEEP_FREED_MEMORY=1)")
    parser.add_argument("--peer-keep-freed", action="store_true",
                        help="the peer too: the same glibc setting in its process")
    parser.add_argument("--worker", choices=["ours", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cache_write:
        return cache_write()
    if args.attention:
        return attention_paths()
    if (args.worker == "ours" and args.keep_freed) or (args.worker == "peer" and
                                                       args.peer_keep_freed):
        hostmem.keep_freed_memory()  # as BA_JAX_KEEP_FREED_MEMORY=1 does (ba_jax/hostmem.py)
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
    ours_flags = ["--keep-freed"] if args.keep_freed else []
    peer_flags = ["--peer-keep-freed"] if args.peer_keep_freed else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)  # both sides start from these weights
        for prec in args.precisions.split(","):
            common = ["--precision", prec, "--model-dir", tmp]
            t_ours, t_peer, ours_info, peer_info = _workers.alternate(
                [__file__, "--worker", "ours", *common, *ours_flags],
                [__file__, "--worker", "peer", *common, *peer_flags],
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
