"""The packed train step against the padded one: time, real-token fraction, compiled bytes,
and the FLOP accounting at the paper's shapes.

Part 1 (run here): the update of one RL step (`updater.update`: one mini-batch, weights on
the whole batch, the optimizer step) on the reference model (spec/performance.md: Qwen3
shape, width 512, 8 layers, 8 query / 4 kv heads of 64, vocabulary 8,192, float32; full
remat as in the paper config), over
a batch with DAPO-like heavy-tailed lengths scaled to this machine: responses of a
2,048-token budget drawn from a lognormal of mean 0.33 x 2,048 with 2% reaching the budget
(truncated), prompts of 26-64 tokens in a 64-token bucket. Padded rows (prompt bucket +
2,048 response slots) against packed blocks of `--budget` tokens, both sides in this one
process, alternating, on the same batch and parameters: the median of `--repeats` timed
updates after one compiling call; `train_token_fraction` (real tokens / token slots
computed); the compiled temp bytes of the padded step and of one packed block's gradient.

Part 2 (counted, nothing compiled): the paper's shapes, Qwen3-1.7B (N from the preset's
abstract parameters), 32 prompts x 16 samples, 8,192-token responses (mean ~2.7k, 2%
truncated), prompts 100-300 tokens in a 256 bucket, 8 row devices. FLOPs of the update
counted from the shapes actually computed: 6N per processed token slot plus causal
attention (3 x the forward's 4 x heads x head_dim per (query, key) pair) at the (query
block, key block) pairs of 512 the chunked kernel runs (`flash.visible_blocks`: padded
rows run every causal block, packed rows only those sharing a segment); useful FLOPs are
the same count over the real tokens of each sequence alone. Both packing strategies.

    python benchmarks/packing.py [--rows 32] [--budget 4096] [--repeats 1]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ba_jax import build, distributed, packing, plan, run_config, train, updater  # noqa: E402
from ba_jax.models.attention import flash  # noqa: E402
from ba_jax.models.attention import segments as seg  # noqa: E402

MODEL = {"model.vocab_size": 8192, "model.hidden_size": 512, "model.intermediate_size": 1536,
         "model.num_layers": 8, "model.num_heads": 8, "model.num_kv_heads": 4,
         "model.head_dim": 64, "model.max_position_embeddings": 4096,
         # the paper config's remat: each layer's backward recomputes it (both sides; without
         # it the padded step holds ~20 GB of activations here)
         "model.remat": "full"}
BLOCK = 512  # the chunked kernel's default query and key block


def heavy_lengths(rng, rows: int, budget: int, mean_frac: float = 0.33,
                  truncated: float = 0.02) -> np.ndarray:
    """Response lengths: lognormal of mean `mean_frac * budget` with `truncated` of the mass
    past the budget (those rows end at the budget), taken at the rows' evenly spaced
    quantiles (a small batch then has the distribution's shape, not one draw's luck), in
    a random row order."""
    z = -statistics.NormalDist().inv_cdf(truncated)  # P(X > budget) = truncated
    # mean = exp(mu + s^2 / 2), ln(budget) = mu + z s  =>  s^2 / 2 - z s - ln(mean_frac) = 0
    s = z - math.sqrt(z * z + 2 * math.log(mean_frac))
    mu = math.log(mean_frac * budget) - s * s / 2
    q = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / rows) for i in range(rows)])
    return rng.permutation(np.clip(np.ceil(np.exp(mu + s * q)), 1, budget).astype(np.int64))


def _batch(cfg, p_B, r_B, Tp: int, R: int, rng) -> dict[str, np.ndarray]:
    B, V = len(p_B), cfg.model.vocab_size
    G = cfg.rollout.num_samples
    return dict(
        prompt_tokens_BT=rng.integers(0, V, size=(B, Tp)).astype(np.int32),
        prompt_mask_BT=(np.arange(Tp)[None] >= Tp - p_B[:, None]).astype(np.int32),
        tokens_BR=rng.integers(0, V, size=(B, R)).astype(np.int32),
        mask_BR=(np.arange(R)[None] < r_B[:, None]).astype(np.float32),
        old_logp_BR=np.full((B, R), -9.0, np.float32),
        adv_B=rng.standard_normal(B).astype(np.float32),
        group_id_B=np.repeat(np.arange(B // G), G).astype(np.int32))


def _updater(cfg, state, graphdef, tx, mesh, budget: int, attn_cost: float):
    g, r = cfg.grpo, cfg.rollout
    return updater.make_updater(
        build.loss_settings(cfg), graphdef, tx, state, mesh,
        prompts_per_step=r.prompts_per_step, sample_shards=r.sample_shards,
        num_samples=r.num_samples, num_minibatches=g.num_minibatches,
        num_updates=g.num_updates, recompute_old_logp=False,
        compute_dtype=run_config.DTYPES[cfg.model.dtype], max_tokens_per_device=budget,
        attn_cost=attn_cost)


def _temp_bytes(upd, state, batch) -> int:
    """Compiled temp bytes of the padded step, or of one packed block's gradient."""
    mb = distributed.put_local_rows(batch, upd.row_sharding)
    if upd.packed is None:
        c = upd.step_fn.lower(state, mb).compile()
    else:
        pk = upd.packed
        idx = updater._pack(upd, batch).idx[0]
        mb.update(upd.weigh_fn(mb))
        blk = dict(pk.inputs_fn(mb, idx), **pk.fields_fn(mb, idx))
        c = pk.acc_fn.lower(state["params"], pk.zeros_fn(state["params"]), blk).compile()
    return int(c.memory_analysis().temp_size_in_bytes)


def measure(args) -> None:
    rows, R, Tp = args.rows, args.response, 64
    cfg = run_config.load_config("configs/default.py", **MODEL, **{
        "rollout.prompts_per_step": rows // 8, "rollout.num_samples": 8,
        "rollout.max_new_tokens": R, "data.max_prompt_tokens": Tp,
        "grpo.logp_check_every": 0, "mesh.data": 1})
    rng = np.random.default_rng(args.seed)
    r_B = heavy_lengths(rng, rows, R)
    p_B = rng.integers(26, Tp + 1, size=rows)
    batch = _batch(cfg, p_B, r_B, Tp, R, rng)
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    mc = cfg.model
    n_params = sum(x.size for x in jax.tree.leaves(params))
    cost = packing.attention_cost(mc.num_layers, mc.num_heads, mc.head_dim, n_params)
    tx, _ = build.make_optimizer(cfg)
    sides = {}
    for name, budget in (("padded", 0), ("packed", args.budget)):
        state = train.init_state(jax.tree.map(lambda x: x.copy(), params), tx, mesh)
        upd = _updater(cfg, state, graphdef, tx, mesh, budget, cost)
        t = time.perf_counter()
        state, m = updater.update(upd, state, batch)  # compiles
        jax.block_until_ready(state)
        sides[name] = dict(upd=upd, state=state, metrics=m, times=[],
                           first=time.perf_counter() - t)
    for _ in range(args.repeats):
        for name, s in sides.items():
            t = time.perf_counter()
            s["state"], s["metrics"] = updater.update(s["upd"], s["state"], batch)
            jax.block_until_ready(s["state"])
            s["times"].append(time.perf_counter() - t)
    print(f"reference model ({n_params / 1e6:.2f}M), {rows} rows, responses mean "
          f"{r_B.mean():.0f} of {R} ({(r_B == R).sum()} at the budget), prompts "
          f"{p_B.min()}-{p_B.max()} in {Tp}, packed budget {args.budget}, "
          f"{args.repeats} timed updates each")
    print("| layout | update s (median) | min | train_token_fraction | micro-batches | "
          "pack_imbalance | compiled temp MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in sides.items():
        m = s["metrics"]
        temp = _temp_bytes(s["upd"], s["state"], batch) / 2**20
        print(f"| {name} | {statistics.median(s['times']):.2f} | {min(s['times']):.2f} | "
              f"{m['train_token_fraction']:.3f} | {m['train_microbatches']:.0f} | "
              f"{m['pack_imbalance']:.3f} | {temp:.0f} |")
    speed = statistics.median(sides["padded"]["times"]) / statistics.median(
        sides["packed"]["times"])
    print(f"packed is {speed:.2f}x faster than padded (median update time, same run)")


def _pairs(ids_T: np.ndarray) -> int:
    """Chunked-kernel (query, key) block pairs of one row, times the block area."""
    pad = -len(ids_T) % BLOCK  # the kernel pads time to whole blocks with padding (id 0)
    ids = jax.numpy.asarray(np.pad(ids_T, (0, pad)))[None]
    return int(np.asarray(flash.visible_blocks(ids, ids, BLOCK, BLOCK)).sum()) * BLOCK * BLOCK


def paper_flops(args) -> None:
    cfg = run_config.load_config("configs/paper.py:model=qwen3-1.7b,data=dapo17k,agg=balanced")
    _, params = plan.abstract_policy(cfg)
    N = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    mc = run_config.model_config(cfg)
    per_pair = 3 * 4 * mc.num_layers * mc.num_heads * mc.head_dim  # fwd + bwd, QK and PV
    D, R, Tp = 8, 8192, 256
    rng = np.random.default_rng(args.seed)
    rows = 512
    r_B = heavy_lengths(rng, rows, R, mean_frac=2700 / R)
    p_B = rng.integers(100, 301, size=rows)
    L = packing.packed_lengths(p_B, r_B)
    useful = 6 * N * L.sum() + per_pair * sum(n * (n + 1) // 2 for n in L)
    T = Tp + R - 1
    full = _pairs(np.ones(T, np.int32))
    padded = 6 * N * rows * T + per_pair * rows * full
    print(f"\nQwen3-1.7B (N = {N / 1e9:.2f}B), {rows} rows, responses mean {r_B.mean():.0f} "
          f"of {R} ({(r_B == R).mean():.1%} truncated), prompts {p_B.min()}-{p_B.max()} "
          f"in {Tp}, {D} row devices, attention blocks of {BLOCK}")
    print("| layout | token slots | real-token fraction | micro-batches | pack_imbalance | "
          "update TFLOPs | useful / computed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| padded ({T} per row) | {rows * T:,} | {L.sum() / (rows * T):.3f} | "
          f"{rows // D // 2} (2 rows/device) | 1.000 | {padded / 1e12:.0f} | "
          f"{useful / padded:.3f} |")
    for budget in args.paper_budgets:
        cost = packing.attention_cost(mc.num_layers, mc.num_heads, mc.head_dim, N)
        for strategy in packing.STRATEGIES:
            pl = packing.plan(L, D, budget, attn_cost=cost, strategy=strategy)
            slots = pl.num_blocks * D * budget
            attn = 0
            for k in range(pl.num_blocks):
                for d in range(D):
                    mine = np.nonzero((pl.block_B == k) & (pl.device_B == d))[0]
                    mine = mine[np.argsort(pl.offset_B[mine])]
                    ids = seg.from_lengths([list(L[mine])], budget)[0]
                    attn += _pairs(ids)
            computed = 6 * N * slots + per_pair * attn
            print(f"| packed {budget}, {strategy} | {slots:,} | {L.sum() / slots:.3f} | "
                  f"{pl.num_blocks} | {packing.imbalance(pl.load_KD):.3f} | "
                  f"{computed / 1e12:.0f} | {useful / computed:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32, help="rows of the step (x8 samples)")
    ap.add_argument("--response", type=int, default=2048, help="response budget R")
    ap.add_argument("--budget", type=int, default=4096, help="packed tokens per device")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paper-budgets", type=lambda s: [int(x) for x in s.split(",")],
                    default=[20480])
    ap.add_argument("--skip-measure", action="store_true", help="only the paper counting")
    args = ap.parse_args()
    if not args.skip_measure:
        measure(args)
    paper_flops(args)


if __name__ == "__main__":
    main()
