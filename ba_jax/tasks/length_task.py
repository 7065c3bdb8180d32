"""A synthetic verifiable task whose response-length statistics are set by design.

What lives here: the "counter" task family of the length-bias study (problems, reference
right and wrong responses, the warm-up mixture, its settings) and the JSONL writer in the
processed DAPO shape the trainer's `task=dataset` path reads. What does not: the
tokenizer (the character-level one of `tasks/arithmetic.py`), scoring (`dapo_reward` of
`rewards/math.py`), the warm-up loop and the runs (experiments/length_study/).

A problem `a+b:L` asks for the value of a counter that starts at digit `a` and adds `b`
(mod 10) once per step, for `k` steps, where the letter `L` is the k-th letter. The right
response writes every step, indexed by its letter, then the answer:

    prompt   "7+3:e Answer: N"        (start 7, add 3, five steps)
    right    "a0 b3 c6 d9 e2 Answer: 2"              3k + 5 tokens with EOS

Two knobs, both exact by construction:

* variation: `k` is drawn per problem from [k_min, k_max]. Right responses have length
  3k + 5, so the spread of k sets the response-length coefficient of variation.
* gap: how the warm-up teaches the policy to be wrong. `misreport` writes the k steps
  and then a wrong digit (same length as right: gap Lbar-/Lbar+ = 1); `overshoot` keeps
  counting m more steps (m in [m_min, m_max]) and reports that value, which is wrong
  because b is coprime to 10 and m < 10 (wrong responses longer: gap > 1); `undershoot`
  stops after j < k steps (wrong responses shorter: gap < 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import string

import numpy as np

LETTERS = string.ascii_lowercase
STEPS = (1,)  # +1 per step: trivial for a tiny model, and never back to a value within 9 steps
WRONG_MODES = ("misreport", "overshoot", "undershoot")
TOKENS_PER_STEP = 3  # letter, digit, space
TOKENS_FIXED = 5  # "Answer", ":", " ", digit, EOS (character tokenizer, "Answer" one piece)


@dataclasses.dataclass(frozen=True)
class LengthTaskConfig:
    """One setting of the task family."""

    k_min: int  # fewest counter steps a problem asks for
    k_max: int  # most counter steps (<= 26 minus the overshoot)
    wrong_mode: str  # misreport | overshoot | undershoot (see the module docstring)
    m_min: int = 4  # overshoot: fewest extra steps
    m_max: int = 8  # overshoot: most extra steps (< 10, so the answer stays wrong)
    right_frac: float = 0.3  # warm-up share of right responses (RL's starting accuracy)

    def __post_init__(self):
        if self.wrong_mode not in WRONG_MODES:
            raise ValueError(f"wrong_mode must be one of {WRONG_MODES}, got {self.wrong_mode!r}")
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if not 1 <= self.m_min <= self.m_max <= 9:
            raise ValueError(f"need 1 <= m_min <= m_max <= 9, got {self.m_min}, {self.m_max}")
        longest = self.k_max + (self.m_max if self.wrong_mode == "overshoot" else 0)
        if longest > len(LETTERS):
            raise ValueError(f"a response would need {longest} steps; at most {len(LETTERS)}")
        if not 0.0 <= self.right_frac <= 1.0:
            raise ValueError(f"right_frac must be in [0, 1], got {self.right_frac}")

    @property
    def max_response_tokens(self) -> int:
        """Tokens (with EOS) of the longest reference response of this setting."""
        longest = self.k_max + (self.m_max if self.wrong_mode == "overshoot" else 0)
        return response_length(longest)


# The study's settings: same task, one knob moved at a time.
SETTINGS = {
    "small_gap": LengthTaskConfig(k_min=4, k_max=8, wrong_mode="misreport"),
    "large_gap": LengthTaskConfig(k_min=4, k_max=8, wrong_mode="overshoot"),
    "large_variation": LengthTaskConfig(k_min=1, k_max=16, wrong_mode="misreport"),
    "short_wrong": LengthTaskConfig(k_min=4, k_max=8, wrong_mode="undershoot"),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One counter problem."""

    start: int  # a, the counter's first value
    step: int  # b, added (mod 10) per step
    num_steps: int  # k

    @property
    def prompt(self) -> str:
        # "Answer:" in the prompt keeps the loader from wrapping the long DAPO instruction.
        return f"{self.start}+{self.step}:{LETTERS[self.num_steps - 1]} Answer: N"

    @property
    def answer(self) -> int:
        return counter_value(self.start, self.step, self.num_steps)


def counter_value(start: int, step: int, n: int) -> int:
    """The counter after n steps."""
    return (start + step * n) % 10


def response_length(num_steps: int) -> int:
    """Tokens (with EOS) of a response that writes `num_steps` steps and an answer."""
    return TOKENS_PER_STEP * num_steps + TOKENS_FIXED


def chain(start: int, step: int, n: int) -> str:
    """The first n indexed steps of the counter, each followed by a space."""
    return "".join(f"{LETTERS[i]}{counter_value(start, step, i + 1)} " for i in range(n))


def right_response(p: Problem) -> str:
    """The reference right response: every step, then the value."""
    return f"{chain(p.start, p.step, p.num_steps)}Answer: {p.answer}"


def wrong_response(rng: np.random.Generator, p: Problem, cfg: LengthTaskConfig) -> str:
    """A reference wrong response of the setting's wrong mode."""
    if cfg.wrong_mode == "misreport":
        digit = (p.answer + int(rng.integers(1, 10))) % 10
        return f"{chain(p.start, p.step, p.num_steps)}Answer: {digit}"
    if cfg.wrong_mode == "overshoot":
        n = p.num_steps + int(rng.integers(cfg.m_min, cfg.m_max + 1))
    else:  # undershoot: stop after 0..k-1 steps
        n = int(rng.integers(0, p.num_steps))
    return f"{chain(p.start, p.step, n)}Answer: {counter_value(p.start, p.step, n)}"


def all_problems(cfg: LengthTaskConfig) -> list[Problem]:
    """Every distinct problem of a setting, in a fixed order."""
    return [Problem(a, b, k) for k in range(cfg.k_min, cfg.k_max + 1) for b in STEPS
            for a in range(10)]


def write_problems(path: str, cfg: LengthTaskConfig, seed: int) -> list[Problem]:
    """Write every problem of a setting, shuffled by `seed`, as processed-DAPO JSONL."""
    problems = all_problems(cfg)
    order = np.random.default_rng(seed).permutation(len(problems))
    problems = [problems[i] for i in order]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "solution": str(p.answer)}) + "\n")
    return problems


def warmup_responses(rng: np.random.Generator, problems: list[Problem],
                     cfg: LengthTaskConfig) -> tuple[list[str], np.ndarray]:
    """Warm-up targets (right with probability `right_frac`, else wrong) and is-right flags."""
    right_B = rng.random(len(problems)) < cfg.right_frac
    texts = [right_response(p) if r else wrong_response(rng, p, cfg)
             for p, r in zip(problems, right_B)]
    return texts, right_B
