"""Packed attention (segment ids) in the `chunked` kernel: cost follows sum L_i^2, not T^2.

Workload: one row of T tokens with the reference model's attention shape (8 query heads, 4
kv heads, head dim 64), forward + backward, float32, blocks of 512 (the seam's default) and
of 128. Compared: one causal sequence filling the row, the same row packed with five
sequences (lengths 35%, 5%, 1 token, 40%, the rest), and the `xla` reference on the packed
row (it materialises T^2 scores whatever the segments). Reported: the (query block, key
block) pairs the chunked loops visit (the kernel's own table, `flash.visible_blocks`; the
tests check that the loops visit exactly those) and the median wall time of a few calls,
the cases alternating in this process.

    python benchmarks/packed_attention.py [--length 4096] [--blocks 512,128] [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ba_jax.models import attention  # noqa: E402
from ba_jax.models.attention import flash  # noqa: E402
from ba_jax.models.attention import segments as seg  # noqa: E402

N, K, H = 8, 4, 64


def five_lengths(T: int) -> list[int]:
    lengths = [int(T * 0.35), int(T * 0.05), 1, int(T * 0.40)]
    return lengths + [T - sum(lengths)]


def _step(impl: str, segments, block: int):
    def loss(q, k, v, do):
        valid = jnp.ones(q.shape[:2], bool)
        o = attention.attention(q, k, v, valid, impl=impl, segments=segments, block_q=block,
                                block_k=block)
        return jnp.sum(o * do)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--blocks", default="512,128")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    T = args.length
    lengths = five_lengths(T)
    ids = jnp.asarray(seg.from_lengths([lengths], T))
    packed = attention.Segments(ids, max_segments=len(lengths))
    ks = jax.random.split(jax.random.key(0), 4)
    xs = (jax.random.normal(ks[0], (1, T, N, H)),
          *(jax.random.normal(r, (1, T, K, H)) for r in ks[1:3]),
          jax.random.normal(ks[3], (1, T, N, H)))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; one row of T={T}, N={N} K={K} "
          f"H={H}, float32, forward + backward; packed lengths {lengths}; "
          f"load average {os.getloadavg()}")
    print(f"sum L_i^2 / T^2 = {sum(L * L for L in lengths) / T**2:.3f}")
    print("\n| case | block | block visits (fwd = bwd) | median ms |")
    print("|---|---:|---:|---:|")
    for block in map(int, args.blocks.split(",")):
        cases = {"chunked, one sequence": ("chunked", None),
                 "chunked, five segments": ("chunked", packed)}
        if block == int(args.blocks.split(",")[0]):
            cases["xla, five segments"] = ("xla", packed)
        compiled = {name: _step(impl, s, block).lower(*xs).compile()
                    for name, (impl, s) in cases.items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for c in range(args.calls + 1):
            for name in (list(cases) if c % 2 else list(cases)[::-1]):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[name](*xs))
                if c:  # call 0 warms up
                    times[name].append(time.perf_counter() - t0)
        for name, (impl, s) in cases.items():
            row_ids = ids if s is not None else jnp.ones_like(ids)
            visits = (int(np.sum(flash.visible_blocks(row_ids, row_ids, block, block)))
                      if impl == "chunked" else "-")
            print(f"| {name} | {block} | {visits} | "
                  f"{statistics.median(times[name]) * 1e3:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
