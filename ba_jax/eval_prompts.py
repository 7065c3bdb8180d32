"""What a model is asked at evaluation: the prompt text of a benchmark problem and its tokens.

Lives here: `MATH_SUFFIX` and `CODE_INSTRUCTION` (the text after a math question / before a
code problem's program), `prompt_text` (a problem -> its user message), `render_prompts`
(user messages -> token ids through the chat or plain template) and `eos_ids_of` (the ids
that end a response). docs/evaluation.md quotes the prompts.

Not here: the templates themselves and EOS ids (`data.py`, shared with the trainer), sampling
and scoring (`evaluate.py`). `data` is imported inside functions: the math scorer's workers
re-import `ba_jax.evaluate`, and with it this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from ba_jax.eval_sets import Problem

MATH_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
CODE_INSTRUCTION = (
    "Write a complete Python 3 program that reads the input from standard input and prints "
    "the answer to standard output. Put the whole program in a single ```python code block."
)


def prompt_text(problem: Problem, kind: str) -> str:
    """The user message of a problem: the Polaris suffix for math, a stdin program for code."""
    if kind == "code":
        return f"{problem.question}\n\n{CODE_INSTRUCTION}"
    return f"{problem.question} {MATH_SUFFIX}"


def render_prompts(texts: Sequence[str], tokenizer, *, template: str,
                   enable_thinking: bool | None = None) -> list[list[int]]:
    """User messages -> token ids through the chat template or the plain one (as data.py)."""
    from ba_jax import data

    if template != "plain" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("template 'chat' but the tokenizer has no chat template; "
                         "use --config.data.template=plain for base models")
    rendered = [data.render_prompt([{"role": "user", "content": t}], tokenizer,
                                   template=template, enable_thinking=enable_thinking)
                for t in texts]
    # A plain prompt gets the tokenizer's usual special tokens (a BOS where expected); a chat
    # template already writes its own.
    special = template == "plain"
    return [list(ids) for ids in tokenizer(rendered, add_special_tokens=special)["input_ids"]]


def eos_ids_of(tokenizer) -> list[int]:
    """The ids that end a response (data.eos_ids, shared with the trainer)."""
    from ba_jax import data

    return data.eos_ids(tokenizer)
