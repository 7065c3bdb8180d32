"""The kernel seam's `chunked` attention against the `xla` reference, forward + backward.

Workload: one row of the reference model's attention shape (8 query heads, 4 kv heads, head
dim 64), causal, a left-padded prompt of T/8 pads, at T = 512, 2,048 and 8,192, in float32 and
bfloat16. For each: the compiled temporary bytes of the jitted value-and-grad (read from
`compiled.memory_analysis()`, so independent of the machine's load) and the median wall time of
a few calls, both implementations alternating in this process. The ratio columns are xla / chunked.

    python benchmarks/attention.py [--lengths 512,2048,8192] [--dtypes float32,bfloat16]
        [--calls 3] [--max-xla-gib 8]

`--max-xla-gib`: the xla reference is compiled at every length, but only run when its
temporaries fit in that many GiB (its T^2 scores would otherwise swap this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ba_jax.models import attention  # noqa: E402

N, K, H = 8, 4, 64


def _inputs(T: int, dtype):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, T, N, H), dtype)
    k, v = (jax.random.normal(r, (1, T, K, H), dtype) for r in ks[1:3])
    do = jax.random.normal(ks[3], (1, T, N, H), dtype)
    valid = jnp.arange(T)[None] >= T // 8
    return q, k, v, valid, do


def _step(impl: str):
    def loss(q, k, v, valid, do):
        o = attention.attention(q, k, v, valid, impl=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--max-xla-gib", type=float, default=8.0)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; one row, N={N} K={K} H={H}, "
          f"causal, T/8 left pads; forward + backward; load average {os.getloadavg()}")
    rows = []
    for dname in args.dtypes.split(","):
        dtype = jnp.dtype(dname)
        for T in map(int, args.lengths.split(",")):
            xs = _inputs(T, dtype)
            compiled = {impl: _step(impl).lower(*xs).compile() for impl in ("xla", "chunked")}
            temp = {i: c.memory_analysis().temp_size_in_bytes for i, c in compiled.items()}
            run = {"chunked": True, "xla": temp["xla"] <= args.max_xla_gib * 2**30}
            times: dict[str, list[float]] = {i: [] for i in compiled}
            for c in range(args.calls + 1):
                for impl in (("xla", "chunked") if c % 2 else ("chunked", "xla")):
                    if not run[impl]:
                        continue
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled[impl](*xs))
                    if c:  # call 0 warms up
                        times[impl].append(time.perf_counter() - t0)
            med = {i: statistics.median(t) if t else float("nan") for i, t in times.items()}
            rows.append((dname, T, temp["xla"], temp["chunked"], med["xla"], med["chunked"]))
            print(f"{dname} T={T}: temp xla {temp['xla'] / 2**20:,.1f} MiB, chunked "
                  f"{temp['chunked'] / 2**20:,.1f} MiB; time xla {med['xla'] * 1e3:,.0f} ms, "
                  f"chunked {med['chunked'] * 1e3:,.0f} ms", flush=True)
    print("\n| dtype | T | xla temp MiB | chunked temp MiB | temp ratio | xla ms | chunked ms "
          "| time ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for d, T, tx, tc, mx, mc in rows:
        print(f"| {d} | {T} | {tx / 2**20:,.1f} | {tc / 2**20:,.1f} | {tx / tc:.1f}x "
              f"| {mx * 1e3:,.0f} | {mc * 1e3:,.0f} | {mx / mc:.2f}x |")


if __name__ == "__main__":
    main()
