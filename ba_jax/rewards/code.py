"""Code rewards: run a generated program on stdin/stdout tests and judge its output.

`check_program` takes a model response (the last fenced code block, else the whole text),
runs it once per test with the test's input on stdin and compares stdout line by line
(stripped; two tokens that both denote integers exactly, however written, other numbers
within 1e-6: docs/sandbox.md, "Judging the output"). `check_programs` scores a batch on
worker threads; the work happens in child processes. A crash, timeout or limit hit is a
failed result with a status, never an exception; only malformed arguments raise
`ValueError`.

Lives here: those two entry points, `CodeResult` and `STATUSES`, code extraction
(`extract_code`), output comparison (`outputs_match`) and the verdict on one run. Not here:
running the program in isolation (`sandbox.py`, with `sandbox_launcher.py`,
`sandbox_slots.py`, `sandbox_root.py`, `sandbox_seccomp.py` and `sandbox_cgroup.py`; see
docs/sandbox.md); math rewards (`math.py`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import decimal
import logging
import math
import os
import re
import signal
import time
from collections.abc import Sequence

from ba_jax.rewards import sandbox
from ba_jax.rewards.sandbox import MAX_OUTPUT_BYTES, Run, excerpt
from ba_jax.rewards.sandbox_slots import NUM_SLOTS

# Not used here: the sandbox's public names that callers reached through this module before
# the sandbox had modules of its own (`code.isolation()`), kept importable from here.
from ba_jax.rewards.sandbox import Isolation, isolation  # noqa: F401
from ba_jax.rewards.sandbox_slots import UID_BASE  # noqa: F401

logger = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "memory", "error")
_REL_TOL = _ABS_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """The verdict on one program."""

    passed: bool  # every test passed
    status: str  # one of STATUSES: the first failing test's outcome, or "passed"
    num_passed: int  # tests passed before the first failure (runs stop there)
    num_tests: int
    wall_s: float  # wall time for the whole program, all tests
    detail: str = ""  # first failure: which test, why, and a bounded excerpt


_CODE_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def extract_code(response: str) -> str:
    """The last fenced block tagged python/py or untagged, else the whole response."""
    blocks = [body for lang, body in _CODE_BLOCK_RE.findall(response)
              if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else response


def _integer(token: str) -> decimal.Decimal | None:
    """The exact value of a decimal token that denotes an integer however it is written
    (`12`, `+12`, `12.0`, `1.2e1`), else None (`12.5`, `nan`, words)."""
    if not _NUMBER_RE.fullmatch(token):
        return None
    value = decimal.Decimal(token)
    return value if value == value.to_integral_value() else None


def _numbers_close(a: str, b: str) -> bool:
    """Two tokens that both denote integers are compared exactly (`1000000999.0` is the
    integer 1000000999, not within 1e-6 of 10**9); otherwise, numbers within 1e-6 relative
    or absolute tolerance (true floats: `0.3333333333` matches `0.333333333333333`)."""
    x, y = _integer(a), _integer(b)
    if x is not None and y is not None:
        return x == y
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def outputs_match(got: str, expected: str) -> bool:
    """Line-by-line equality after stripping, with a numeric fallback token by token."""
    got_lines = [line.strip() for line in got.strip().splitlines()]
    exp_lines = [line.strip() for line in expected.strip().splitlines()]
    if len(got_lines) != len(exp_lines):
        return False
    for g, e in zip(got_lines, exp_lines):
        if g == e:
            continue
        g_tokens, e_tokens = g.split(), e.split()
        if len(g_tokens) != len(e_tokens):
            return False
        if not all(a == b or _numbers_close(a, b) for a, b in zip(g_tokens, e_tokens)):
            return False
    return True


def _validate(tests: object, timeout_s: float, memory_mb: int) -> None:
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"tests must be a non-empty list of dicts, got {tests!r:.200}")
    for i, test in enumerate(tests):
        if (not isinstance(test, dict) or not isinstance(test.get("input"), str)
                or not isinstance(test.get("output"), str)):
            raise ValueError(f"test {i} must be {{'input': str, 'output': str}}: {test!r:.200}")
    if not timeout_s > 0 or not memory_mb > 0:
        raise ValueError(f"timeout_s and memory_mb must be positive: {timeout_s}, {memory_mb}")


# ---------------------------------------------------------------------------- scoring

_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"out of memory")


def _verdict(run: Run, expected: str, timeout_s: float) -> tuple[str, str]:
    """(status, detail) of one test run; status "passed" when it matches.

    The cause decides, not the clock: a program that hit its memory limit (the
    `MemoryError` that RLIMIT_AS raises, or an allocation failure, in its stderr, or a
    process of it killed by the memory cgroup's OOM killer) is `memory` however it then
    ended: exit, signal, CPU limit, or the wall clock running out while it was still dying
    (a slow machine). Only a clean exit is judged on its output.
    """
    if run.outcome == "overflow":
        return "error", f"output over {MAX_OUTPUT_BYTES} bytes"
    if run.outcome == "setup":
        logger.error("code sandbox failed to start a program: %s", excerpt(run.stderr))
        return "error", "sandbox: " + excerpt(run.stderr)
    name = ""
    if run.outcome == "signal":
        name = signal.Signals(run.code).name if run.code in signal.valid_signals() else run.code
    if (run.outcome != "exit" or run.code != 0) and (
            run.memory_exceeded or any(m in run.stderr for m in _MEMORY_MARKERS)):
        how = {"timeout": f"then wall clock over {timeout_s:g}s", "signal": f"killed by {name}"}
        cgroup = "over the memory cgroup's limit (OOM kill), " if run.memory_exceeded else ""
        return "memory", f"{cgroup}{how.get(run.outcome, f'exit {run.code}')}: " + excerpt(
            run.stderr[-300:])
    if run.outcome == "timeout":
        return "timeout", f"wall clock over {timeout_s:g}s"
    if run.outcome == "signal":
        if run.code == signal.SIGXCPU or (run.code == signal.SIGKILL
                                          and run.cpu_s >= math.ceil(timeout_s)):
            return "timeout", f"CPU limit ({name})"
        return "error", f"killed by {name}" + (
            " (file size limit)" if run.code == signal.SIGXFSZ else "")
    if run.code != 0:
        return "error", f"exit {run.code}: {excerpt(run.stderr[-600:], 600)}"
    got = run.stdout.decode("utf-8", errors="replace")
    if outputs_match(got, expected):
        return "passed", ""
    return "failed", f"expected {excerpt(expected)!r}, got {excerpt(got)!r}"


def check_program(source: str, tests: Sequence[dict], *, timeout_s: float = 6.0,
                  memory_mb: int = 1024) -> CodeResult:
    """Run the response's program on each test (stdin -> expected stdout); all must pass."""
    _validate(tests, timeout_s, memory_mb)
    start = time.monotonic()
    num_passed = 0
    try:
        with sandbox.session() as box:
            box.write_program(extract_code(source))
            for i, test in enumerate(tests):
                run = box.run(test["input"].encode(), timeout_s, memory_mb)
                status, detail = _verdict(run, test["output"], timeout_s)
                if status != "passed":
                    return CodeResult(False, status, num_passed, len(tests),
                                      time.monotonic() - start, f"test {i}: {detail}")
                num_passed += 1
    except Exception as e:  # a sandbox fault scores 0; it must not stop the trainer
        logger.exception("code sandbox failure")
        return CodeResult(False, "error", num_passed, len(tests), time.monotonic() - start,
                          f"sandbox failure: {e!r}")
    return CodeResult(True, "passed", num_passed, len(tests), time.monotonic() - start)


def check_programs(items: Sequence[tuple[str, Sequence[dict]]], *, timeout_s: float = 6.0,
                   memory_mb: int = 1024, num_workers: int | None = None) -> list[CodeResult]:
    """`check_program` over (source, tests) pairs on up to `num_workers` threads, in order."""
    for _, tests in items:
        _validate(tests, timeout_s, memory_mb)
    if not items:
        return []
    workers = max(1, min(num_workers or os.cpu_count() or 1, len(items), NUM_SLOTS))
    if workers == 1:
        return [check_program(s, t, timeout_s=timeout_s, memory_mb=memory_mb) for s, t in items]
    with concurrent.futures.ThreadPoolExecutor(workers, "code-sandbox") as pool:
        return list(pool.map(
            lambda item: check_program(item[0], item[1], timeout_s=timeout_s,
                                       memory_mb=memory_mb), items))
