"""Cost of each aggregation rule inside a jitted loss + gradient step, as a ratio to `token`.

The step computes the rule's weights from the whole batch (inside jit), then the
clipped-surrogate loss and its gradient through a small linear softmax policy head.
Rules are timed round-robin in one process so machine noise hits all of them alike;
medians over repeats. Results go in docs/benchmarks.md, section "Aggregation".

    python benchmarks/aggregation.py [--rows 512] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax import aggregation as agg
from ba_jax import grpo


def make_inputs(rows: int, tokens: int, width: int, vocab: int, group_size: int, seed: int = 0):
    """A realistic-looking batch: ragged lengths, binary rewards, shuffled rows."""
    rng = np.random.default_rng(seed)
    num_groups = rows // group_size
    gid_B = rng.permutation(np.repeat(np.arange(num_groups), group_size)).astype(np.int32)
    rewards_B = (rng.random(rows) < 0.4).astype(np.float32)
    adv_B = grpo.group_advantages(jnp.asarray(rewards_B), jnp.asarray(gid_B), num_groups)
    len_B = rng.integers(tokens // 8, tokens + 1, size=rows)
    batch = dict(
        x_BTD=jnp.asarray(rng.normal(size=(rows, tokens, width)), jnp.float32),
        tokens_BT=jnp.asarray(rng.integers(0, vocab, size=(rows, tokens)), jnp.int32),
        old_logp_BT=jnp.asarray(-np.log(vocab) + 0.1 * rng.normal(size=(rows, tokens)),
                                jnp.float32),
        mask_BT=jnp.asarray(np.arange(tokens)[None] < len_B[:, None], jnp.float32),
        adv_B=adv_B,
        group_id_B=jnp.asarray(gid_B),
    )
    params = {"w_DV": jnp.asarray(rng.normal(size=(width, vocab)) * 0.1, jnp.float32)}
    return params, batch, num_groups


def step(rule, num_groups: int, params, batch):
    """Weights from the whole batch, then loss and gradient through the policy head."""
    w_BT = agg.token_weights(rule, batch["mask_BT"], batch["adv_B"], batch["group_id_B"],
                             num_groups, max_len=batch["mask_BT"].shape[1])

    def loss_fn(p):
        logits_BTV = jnp.einsum("btd,dv->btv", batch["x_BTD"], p["w_DV"])
        logp_BT = grpo.token_logprobs(logits_BTV, batch["tokens_BT"])
        loss, _ = grpo.grpo_loss(logp_BT, batch["old_logp_BT"], batch["adv_B"], w_BT,
                                 batch["mask_BT"], eps_low=0.2, eps_high=0.28)
        return loss

    return jax.value_and_grad(loss_fn)(params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    params, batch, num_groups = make_inputs(args.rows, args.tokens, args.width, args.vocab,
                                            args.group_size)
    steps = {r: jax.jit(functools.partial(step, r, num_groups)) for r in agg.RULES}
    weights_only = {
        r: jax.jit(functools.partial(agg.token_weights, r, num_groups=num_groups))
        for r in agg.RULES
    }
    weight_args = (batch["mask_BT"], batch["adv_B"], batch["group_id_B"])
    for r in agg.RULES:  # compile and warm up
        jax.block_until_ready(steps[r](params, batch))
        jax.block_until_ready(weights_only[r](*weight_args))

    def timed(fn, *fn_args) -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        return time.perf_counter() - start

    # ABBA pairs against `token` (token, rule, rule, token) in a shuffled rule order per
    # round: the machine is shared, so drift in its load and any first/second position
    # effect cancel in the ratio. `token` against itself is the control row.
    rng = np.random.default_rng(1)
    ratios: dict[str, list[float]] = {r: [] for r in agg.RULES}
    step_s: dict[str, list[float]] = {r: [] for r in agg.RULES}
    weight_s: dict[str, list[float]] = {r: [] for r in agg.RULES}
    for _ in range(args.repeats):
        for r in rng.permutation(agg.RULES):
            base = timed(steps["token"], params, batch)
            t = timed(steps[r], params, batch) + timed(steps[r], params, batch)
            base += timed(steps["token"], params, batch)
            ratios[r].append(t / base)
            step_s[r].append(t / 2)
            weight_s[r].append(timed(weights_only[r], *weight_args))

    print(f"{args.rows} rows x {args.tokens} tokens, D={args.width}, V={args.vocab}, "
          f"G={args.group_size}, {args.repeats} repeats, {jax.devices()[0].platform}")
    print("| rule | step ms (median) | weights alone ms (median) "
          "| step time / `token` (median of ABBA ratios) |")
    print("|---|---|---|---|")
    for r in agg.RULES:
        print(f"| `{r}` | {1e3 * statistics.median(step_s[r]):.0f} "
              f"| {1e3 * statistics.median(weight_s[r]):.1f} "
              f"| {statistics.median(ratios[r]):.3f} |")


if __name__ == "__main__":
    main()
