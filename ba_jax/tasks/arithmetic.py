"""The embedded default task: small-integer arithmetic answered on an `Answer:` line.

What lives here: a character-level tokenizer saved in Hugging Face format, a problem
generator writing the processed DAPO-Math shape (`prompt`, `solution` JSONL) so the
trainer reads it through the same loader as real data, and the format-only warm-up
examples. What does not: training (train.py) and scoring (rewards/math.py, whose
`dapo_reward` judges these responses exactly as it judges DAPO-Math-17k).

Why a warm-up: a random policy never writes `Answer: N`, so RL would see no reward at
all. The trainer's warm-up (`tasks/warmup.warm_up`) trains on `Answer: N` targets, the
true N with probability `warmup_correct_frac` (else a random one), and stops once the
policy's probability of the true answer reaches `warmup_target_accuracy`; RL starts from
there.
(Pure format-only warm-ups, correct_frac 0, were tried: RL from chance accuracy collapsed
onto a few popular answers instead of learning the sums.)
"""

from __future__ import annotations

import json
import operator
import os
import string

import numpy as np

PAD, EOS = "<|pad|>", "<|endoftext|>"
# The operators config `arithmetic.ops` may name (a string of them, e.g. "+-").
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# Multi-character pieces first so "Answer" is one token; then every printable char.
_PIECES = ["Answer", "Question"]
_CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]


def vocab() -> dict[str, int]:
    """Token -> id table: specials, multi-character pieces, then single characters."""
    tokens = [PAD, EOS] + _PIECES + _CHARS
    return {t: i for i, t in enumerate(tokens)}


def save_tokenizer(out_dir: str) -> str:
    """Build the character-level tokenizer and save it in Hugging Face format."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pattern = "|".join(_PIECES) + r"|[\s\S]"
    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, clean_up_tokenization_spaces=False
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def _problem(rng: np.random.Generator, max_operand: int, ops: str) -> tuple[str, int]:
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    op = ops[int(rng.integers(len(ops)))]
    value = OPS[op](a, b)
    return f"{a}{op}{b}", value


def answer_range(max_operand: int, ops: str) -> list[int]:
    """Every answer the generator can produce (the warm-up draws from these uniformly)."""
    vals = set()
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            for op in ops:
                vals.add(OPS[op](a, b))
    return sorted(vals)


def write_problems(path: str, *, max_operand: int, ops: str, num_problems: int, seed: int) -> str:
    """Write every distinct problem (or `num_problems` of them) as processed-DAPO JSONL."""
    rng = np.random.default_rng(seed)
    seen: dict[str, int] = {}
    all_pairs = (max_operand + 1) ** 2 * len(ops)
    target = min(num_problems, all_pairs)
    while len(seen) < target:
        text, value = _problem(rng, max_operand, ops)
        seen.setdefault(text, value)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for text, value in seen.items():
            # "Answer:" in the prompt keeps the loader from adding the long DAPO instruction.
            f.write(json.dumps({"prompt": f"{text}=? Answer: N", "solution": str(value)}) + "\n")
    os.replace(tmp, path)  # a reader never sees a half-written file
    return path


def warmup_responses(rng: np.random.Generator, truths: list[str], max_operand: int, ops: str,
                     correct_frac: float = 0.0) -> list[str]:
    """Warm-up targets `Answer: N`: the true N with probability `correct_frac`, else uniform.

    At convergence the policy's probability of the right answer is about
    correct_frac + (1 - correct_frac) / len(answers): the starting accuracy of RL.
    """
    answers = answer_range(max_operand, ops)
    out = []
    for t in truths:
        n = t if rng.random() < correct_frac else answers[int(rng.integers(len(answers)))]
        out.append(f"Answer: {n}")
    return out
