"""Supervised warm-up before RL: teach a random policy the answer format of its task.

What lives here: `sft_batch` (prompts and target responses -> a padded batch),
`make_sft_step` (one jitted supervised step on the response tokens) and `warm_up`, the
embedded arithmetic task's warm-up loop that stops at a target accuracy. The length study
(experiments/length_study/run.py) runs its own loop on the same batch and step. What does
not: the targets themselves (`arithmetic.warmup_responses`, `length_task.warmup_responses`)
or RL (train.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ba_jax import data, distributed, grpo, optim, sharding
from ba_jax.tasks import arithmetic


def make_sft_step(graphdef, tx: optax.GradientTransformation):
    """jit(step)(params, opt_state, batch) -> (params, opt_state, loss, p_target).

    One supervised step on the response tokens of a `sft_batch`. `p_target` is the
    policy's probability of producing the whole target response, averaged over rows with
    `target_B = 1` (when targets are true answers: the expected sampling accuracy).
    """

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def loss_fn(p):
            logp_BR, _ = grpo.policy_logprobs(graphdef, p, batch)
            seq_logp_B = jnp.sum(batch["mask_BR"] * logp_BR, axis=1)
            loss = -jnp.sum(batch["mask_BR"] * logp_BR) / jnp.maximum(batch["mask_BR"].sum(), 1)
            return loss, seq_logp_B

        (loss, seq_logp_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        t_B = batch["target_B"]
        p_target = jnp.sum(t_B * jnp.exp(seq_logp_B)) / jnp.maximum(t_B.sum(), 1)
        return optax.apply_updates(params, updates), opt_state, loss, p_target

    return step


def sft_batch(prompts: list[list[int]], texts: list[str], tokenizer, *, prompt_len: int,
              response_len: int, target_B: np.ndarray) -> dict[str, np.ndarray]:
    """Left-padded prompts and right-padded responses (`text` + EOS) for `make_sft_step`."""
    n = len(prompts)
    b = dict(prompt_tokens_BT=np.zeros((n, prompt_len), np.int32),
             prompt_mask_BT=np.zeros((n, prompt_len), np.int32),
             tokens_BR=np.zeros((n, response_len), np.int32),
             mask_BR=np.zeros((n, response_len), np.float32),
             target_B=np.asarray(target_B, np.float32))
    for i, (p, t) in enumerate(zip(prompts, texts)):
        b["prompt_tokens_BT"][i, prompt_len - len(p):] = p
        b["prompt_mask_BT"][i, prompt_len - len(p):] = 1
        r = (tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        r = r[:response_len]
        b["tokens_BR"][i, : len(r)] = r
        b["mask_BR"][i, : len(r)] = 1
    return b


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
    """The embedded task's supervised warm-up (config `arithmetic.warmup_*`, built by
    `build.warmup_settings`)."""

    steps: int  # at most this many supervised steps; 0: no warm-up
    batch_size: int
    learning_rate: float
    correct_frac: float  # share of targets with the true answer
    target_accuracy: float  # stop once p(true answer) reaches it
    response_len: int  # the RL responses' length (rollout.max_new_tokens)
    max_operand: int  # the task's operand range (arithmetic.max_operand)
    ops: str  # the task's operators (arithmetic.ops)
    seed: int = 0


def warm_up(graphdef, params, prompt_set: data.PromptDataset, tokenizer,
            mesh: jax.sharding.Mesh, settings: WarmupSettings):
    """Short supervised warm-up of the embedded arithmetic task, stopped at a target accuracy.

    Targets are `Answer: N` with the true N (probability `correct_frac`) or a random one.
    Training stops as soon as the policy's probability of producing the true response,
    averaged over the batch (= its expected sampling accuracy), reaches `target_accuracy`,
    so RL starts from a weak policy whatever the model size. Returns (params, summary).
    """
    w = settings
    rng = np.random.default_rng([w.seed, 7])
    Tp = max(len(p) for p in prompt_set.prompt_ids)
    tx = optax.adam(w.learning_rate)
    opt_state = optim.init_opt_state(tx, params, mesh)
    step = make_sft_step(graphdef, tx)
    row_sh = sharding.batch_sharding(mesh)
    loss = p_true = float("nan")
    k = 0
    for k in range(1, w.steps + 1):
        idx = rng.integers(len(prompt_set.prompt_ids), size=w.batch_size)
        truths = [prompt_set.ground_truths[j] for j in idx]
        texts = arithmetic.warmup_responses(rng, truths, w.max_operand, w.ops, w.correct_frac)
        b = sft_batch([prompt_set.prompt_ids[j] for j in idx], texts, tokenizer, prompt_len=Tp,
                      response_len=w.response_len,
                      target_B=np.array([t == f"Answer: {g}" for t, g in zip(texts, truths)]))
        params, opt_state, loss, p_true = step(params, opt_state, distributed.put_global(b, row_sh))
        if float(p_true) >= w.target_accuracy:
            break
    return params, dict(steps=k, loss=float(loss), p_true=float(p_true))
