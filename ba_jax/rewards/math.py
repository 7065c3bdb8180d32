"""Math rewards: answer extraction, the DAPO and boxed rules, batch scoring in a process pool.

Two rules (see the data spec):

* `dapo_reward`: the DAPO-Math-17k rule. The last `Answer: ...` line in the last 300
  characters of a response, Minerva-style string normalisation of both sides, exact match.
  +1 right, -1 wrong or no answer. Pure regex: it cannot hang.
* `boxed_reward`: Polaris and the math benchmarks. The last `\\boxed{...}` after any
  `</think>`, equivalence decided by `math_verify` (gold first). 1 right, 0 wrong.

`MathScorer` / `score_batch` run a batch of either rule in worker processes (spawned, never
forked: the trainer is a multithreaded JAX process) with a wall-clock limit per item, so a
pathological sympy simplification costs one wrong reward instead of a stuck trainer.
`overlong_penalty` is DAPO's length shaping. Code execution rewards live in `code.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ba_jax import preemption

RULES = ("dapo", "boxed")
# The value a rule gives a wrong (or unanswered, timed-out, crashed) response.
WRONG_VALUE = {"dapo": -1.0, "boxed": 0.0}

# DAPO looks only at the tail of a response: an "Answer:" the model wrote mid-reasoning
# does not count unless it is near the end.
DAPO_WINDOW_CHARS = 300
_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# math_verify's own per-call limit (whole seconds: it uses signal.alarm), for direct calls
# on a main thread. Pool workers turn it off: their wall-clock limit is the only one, so
# every slow item is counted as a timeout rather than silently scored wrong.
_MATH_VERIFY_TIMEOUT_S = 5
_in_pool_worker = False

# --- Minerva normalisation (Lewkowycz et al. 2022, appendix D), which DAPO's reward uses.
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_UNWRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|overline)\{(.*?)\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _brace_group(s: str, start: int) -> int | None:
    """Index one past the `}` matching the `{` at s[start], or None if unbalanced."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _latex_arg(s: str, i: int) -> tuple[str, int] | None:
    """One TeX macro argument at s[i:] (a brace group or a single token) and the end index."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _brace_group(s, i)
        return None if end is None else (s[i + 1 : end - 1], end)
    if s[i] == "\\":  # a control word such as \pi is one token
        m = re.match(r"\\[A-Za-z]+|\\.?", s[i:], re.DOTALL)
        return m.group(0), i + len(m.group(0))
    return s[i], i + 1


_SHORTHAND_RE = re.compile(r"\\(frac|sqrt)(?![A-Za-z])")


def _fix_shorthand(s: str) -> str:
    """Expand shorthand: `\\frac12`, `\\frac{1}2` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`."""
    out, i = [], 0
    while m := _SHORTHAND_RE.search(s, i):
        out.append(s[i : m.start()])
        name, j = m.group(1), m.end()
        parts = ["\\" + name]
        if name == "sqrt" and s.startswith("[", j):  # \sqrt[3]{x}: keep the root index
            close = s.find("]", j)
            if close > 0:
                parts.append(s[j : close + 1])
                j = close + 1
        for _ in range(2 if name == "frac" else 1):
            arg = _latex_arg(s, j)
            if arg is None:
                break
            parts.append("{" + _fix_shorthand(arg[0]) + "}")
            j = arg[1]
        out.append("".join(parts))
        i = j
    out.append(s[i:])
    return "".join(out)


def _unwrap_command(s: str, command: str) -> str:
    """Replace every `\\command{x}` by x (brace-matched, innermost content kept)."""
    while True:
        k = s.find(command + "{")
        if k < 0:
            return s
        end = _brace_group(s, k + len(command))
        if end is None:
            return s
        s = s[:k] + s[k + len(command) + 1 : end - 1] + s[end:]


def normalize_answer(s: str) -> str:
    """Minerva-style normalisation of a final answer string, for exact comparison."""
    s = s.split("=")[-1]
    # \left/\right carry no value and would be mangled by the unit list below ("ft").
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    # Keep only the first $...$ span, as Minerva does: prose around the maths is dropped.
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    s = _UNWRAP_RE.sub(r"\1", s)
    s = _unwrap_command(s, "\\boxed")
    s = _unwrap_command(s, "\\fbox")
    s = _fix_shorthand(s)
    s = s.replace("$", "").strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s.rstrip(".").strip()


def extract_answer_line(response: str, window: int | None = DAPO_WINDOW_CHARS) -> str | None:
    """The text after the last `Answer:` in the last `window` characters, or None."""
    tail = response if window is None else response[-window:]
    matches = _ANSWER_RE.findall(tail)
    return matches[-1].strip() if matches else None


def dapo_reward(response: str, ground_truth: str) -> float:
    """DAPO-Math rule: +1 if the normalised `Answer:` line equals the ground truth, else -1."""
    answer = extract_answer_line(response)
    if answer is None:
        return -1.0
    return 1.0 if normalize_answer(answer) == normalize_answer(str(ground_truth)) else -1.0


def extract_boxed(response: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed x`, or None."""
    k = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if k < 0:
        return None
    i = k + (len("\\boxed") if response.startswith("\\boxed", k) else len("\\fbox"))
    if i < len(response) and response[i] == "{":
        end = _brace_group(response, i)
        return None if end is None else response[i + 1 : end - 1].strip()
    if i < len(response) and response[i] == " ":  # "\boxed 5$": up to the math delimiter
        return re.split(r"[$\n]", response[i:])[0].strip() or None
    return None


def _final_part(response: str) -> str | None:
    """The response after its reasoning: text after the last `</think>`; None if unclosed."""
    k = response.rfind("</think>")
    if k >= 0:
        return response[k + len("</think>") :]
    return None if "<think>" in response else response


def boxed_reward(response: str, ground_truth: str) -> float:
    """Boxed rule: 1 if the last boxed answer is math-verify-equivalent to the gold, else 0."""
    from math_verify import parse, verify  # sympy is heavy: import on first use

    final = _final_part(response)
    boxed = None if final is None else extract_boxed(final)
    gold_text = str(ground_truth).strip()
    if not boxed or not gold_text:
        return 0.0
    # math_verify times out with signal.alarm, which raises off the main thread: there (and
    # in pool workers) we disable it and rely on the caller to bound the time.
    on_main_thread = threading.current_thread() is threading.main_thread()
    limit = _MATH_VERIFY_TIMEOUT_S if on_main_thread and not _in_pool_worker else None
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"  # math_verify extracts latex only when delimited
    gold = parse(gold_text, parsing_timeout=limit)
    pred = parse("\\boxed{" + boxed + "}", parsing_timeout=limit)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


_RULE_FNS: dict[str, Callable[[str, str], float]] = {"dapo": dapo_reward, "boxed": boxed_reward}


def overlong_penalty(
    lengths_B: np.ndarray, *, max_len: int, buffer: int, factor: float
) -> np.ndarray:
    """DAPO overlong shaping: 0 down to -factor, linearly over the last `buffer` tokens."""
    if buffer <= 0:
        raise ValueError(f"overlong buffer must be positive, got {buffer}")
    lengths_B = np.asarray(lengths_B, dtype=np.float64)
    start = max_len - buffer
    penalty_B = np.minimum(-(lengths_B - start) / buffer * factor, 0.0)
    return np.where(lengths_B > start, penalty_B, 0.0).astype(np.float32)


# ---------------------------------------------------------------------------- batch scoring


@dataclasses.dataclass
class ScoreResult:
    """Rewards of one batch."""

    rewards: np.ndarray  # float32 [B]: the rule's value; wrong value on timeout or error
    correct: np.ndarray  # bool [B]: judged right (never true for a timeout or error)
    num_timeouts: int  # items killed at the wall-clock limit
    num_errors: int  # items whose rule raised or whose worker died


_READY = "ready"
_STARTUP_TIMEOUT_S = 120.0


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """Worker process: score (index, rule, response, ground_truth) messages until None."""
    global _in_pool_worker
    _in_pool_worker = True
    # A session of its own: Ctrl-C and a scheduler's SIGTERM to the trainer's process group
    # are the trainer's to handle (it finishes the step in flight, which needs this worker);
    # the trainer stops its workers itself, and a worker whose trainer died reads EOF.
    preemption.detach_from_terminal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices
    import math_verify  # noqa: F401  warm up so the first item's clock excludes the import

    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, rule, response, ground_truth = msg
        try:
            fn = _RULE_FNS[rule] if isinstance(rule, str) else rule
            conn.send((index, True, float(fn(response, ground_truth))))
        except Exception as e:  # noqa: BLE001  a rule crash scores wrong, never kills the pool
            conn.send((index, False, repr(e)))


class _Worker:
    """One scorer process, its pipe, and the item it is working on."""

    def __init__(self, ctx: multiprocessing.context.BaseContext):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn,), daemon=True, name="ba_jax-math-scorer"
        )
        self.process.start()
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class MathScorer:
    """A reusable pool of scorer processes with a wall-clock limit per item.

    Workers start on the first batch that needs them and stay up until `close()`. A worker
    past its item's deadline is killed and replaced (a hung sympy call cannot be
    interrupted otherwise); the item scores wrong and is counted. Workers are spawned, so
    the parent's `__main__` module is re-imported in each: keep entry points import-safe.
    Small `dapo` batches (fewer than `inline_below` items) are scored in this process: the
    rule is pure regex and cannot hang, and a pool round trip would cost more than it saves.
    Not thread-safe: use one scorer per thread.
    """

    def __init__(
        self, *, timeout_s: float = 5.0, num_workers: int | None = None, inline_below: int = 32
    ):
        self.timeout_s = timeout_s
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        self.inline_below = inline_below
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def __enter__(self) -> MathScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5.0)
            w.conn.close()
        self._workers = []

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        *,
        rule: str | Callable[[str, str], float] = "dapo",
        timeout_s: float | None = None,
        wrong_value: float | None = None,
    ) -> ScoreResult:
        """Score a batch; `rule` is a name in RULES or a picklable module-level function."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if isinstance(rule, str):
            if rule not in RULES:
                raise ValueError(f"unknown reward rule {rule!r}; expected one of {RULES}")
            wrong = WRONG_VALUE[rule] if wrong_value is None else wrong_value
        else:
            wrong = 0.0 if wrong_value is None else wrong_value
        n = len(responses)
        rewards_B = np.full(n, wrong, dtype=np.float32)
        judged_B = np.zeros(n, dtype=bool)
        if rule == "dapo" and n < self.inline_below:
            num_timeouts, num_errors = 0, 0
            for i in range(n):
                try:
                    rewards_B[i] = dapo_reward(responses[i], ground_truths[i])
                    judged_B[i] = True
                except Exception:  # noqa: BLE001  same contract as the pool: count, never raise
                    num_errors += 1
        else:
            limit = self.timeout_s if timeout_s is None else timeout_s
            try:
                num_timeouts, num_errors = self._run_pool(
                    responses, ground_truths, rule, limit, rewards_B, judged_B
                )
            except BaseException:
                # Results still in flight would be misread by the next call: start afresh.
                for w in self._workers:
                    w.kill()
                self._workers = []
                raise
        correct_B = judged_B & (rewards_B > wrong)
        return ScoreResult(rewards_B, correct_B, num_timeouts, num_errors)

    def _replace(self, k: int) -> None:
        self._workers[k].kill()
        self._workers[k] = _Worker(self._ctx)

    def _run_pool(self, responses, ground_truths, rule, limit, rewards_B, judged_B):
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx))
        pending = collections.deque(range(len(responses)))
        remaining, num_timeouts, num_errors = len(responses), 0, 0
        while remaining:
            for k, w in enumerate(self._workers):
                if not (pending and w.ready and w.item is None):
                    continue
                if not w.process.is_alive():  # died while idle: not the next item's fault
                    self._replace(k)
                    continue
                i = pending.popleft()
                try:
                    w.conn.send((i, rule, responses[i], ground_truths[i]))
                except OSError:  # died while idle: not the item's fault, retry it elsewhere
                    pending.appendleft(i)
                    self._replace(k)
                    continue
                w.item, w.deadline = i, time.monotonic() + limit
            waiting = [w for w in self._workers if w.item is not None or not w.ready]
            deadline = min(
                w.deadline if w.ready else w.started_at + _STARTUP_TIMEOUT_S for w in waiting
            )
            multiprocessing.connection.wait(
                [w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic())
            )
            for k, w in enumerate(self._workers):
                if not (w.item is not None or not w.ready) or not w.conn.poll():
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, OOM kill, os._exit)
                    if not w.ready:
                        raise RuntimeError("a math scorer worker died while starting") from None
                    num_errors += 1
                    remaining -= 1
                    self._replace(k)
                    continue
                if msg == _READY:
                    w.ready = True
                    continue
                index, ok, value = msg
                if ok:
                    rewards_B[index], judged_B[index] = value, True
                else:
                    num_errors += 1
                w.item = None
                remaining -= 1
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.item is not None and now >= w.deadline:
                    num_timeouts += 1
                    remaining -= 1
                    self._replace(k)  # the only way to stop a hung sympy call
                elif not w.ready and now >= w.started_at + _STARTUP_TIMEOUT_S:
                    raise RuntimeError(
                        f"a math scorer worker did not start in {_STARTUP_TIMEOUT_S} s"
                    )
        return num_timeouts, num_errors


_DEFAULT_SCORERS: dict[int | None, MathScorer] = {}


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    rule: str = "dapo",
    timeout_s: float = 5.0,
    num_workers: int | None = None,
) -> ScoreResult:
    """Score a batch with a process-wide `MathScorer` (one per `num_workers`, kept warm)."""
    if num_workers not in _DEFAULT_SCORERS:
        _DEFAULT_SCORERS[num_workers] = MathScorer(num_workers=num_workers)
    return _DEFAULT_SCORERS[num_workers].score(
        responses, ground_truths, rule=rule, timeout_s=timeout_s
    )
