"""Evaluation sets: local benchmark files -> problems (the paper's five math sets and
LiveCodeBench).

Lives here: `BENCHMARKS` (names and kinds), `find_benchmark_file` (where a benchmark's file
sits in a folder), `load_benchmark` (one local JSONL / parquet file -> `Benchmark`), and the
LiveCodeBench test-case parsing. Not here: prompt templates, sampling, scoring and metrics
(`evaluate.py`), answer checking (`rewards/`).

Files are read through Hugging Face `datasets` with `HF_DATASETS_OFFLINE=1`: nothing is
fetched, and its progress bars stay off (`data.load_local_dataset`). Column names match
case-insensitively, so the capitalised mirrors of the AIME sets (`Problem`, `Answer`) read
too. Every row not kept is counted in `Benchmark.stats` under one reason (`data.Skip`, as
for training data), so `rows_read == kept + sum(skip counts)`. The expected columns per
benchmark are documented in docs/evaluation.md.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pickle
import zlib
from typing import Any

from ba_jax.data import Skip, load_local_dataset

# name -> kind. The order is fixed: it also numbers each benchmark's PRNG stream.
BENCHMARKS: dict[str, str] = {
    "math500": "math",
    "aime24": "math",
    "aime25": "math",
    "olympiad": "math",
    "minerva": "math",
    "livecodebench": "code",
}
EXTENSIONS = (".jsonl", ".parquet", ".json")

_QUESTION_COLUMNS = ("problem", "question")
_ANSWER_COLUMNS = ("answer", "final_answer")
_ID_COLUMNS = ("unique_id", "id", "idx", "question_id")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One benchmark problem, before templating."""

    id: str  # the row's id column if it has one, else its row index
    question: str  # problem statement as published
    answer: str | None = None  # gold final answer (math); None for code
    tests: tuple[dict[str, str], ...] = ()  # stdin tests (code): {"input": str, "output": str}


@dataclasses.dataclass
class Benchmark:
    """The problems of one benchmark file, in file order."""

    name: str  # a key of BENCHMARKS
    kind: str  # "math" or "code"
    path: str
    problems: list[Problem]
    # rows_read, kept, and skip reasons: no_question, no_answer, malformed, no_stdin_tests;
    # code also counts functional_tests_skipped (tests, not rows).
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.problems)


def find_benchmark_file(bench_dir: str, name: str) -> str:
    """`bench_dir/<name>.jsonl`, `.parquet` or `.json`; exactly one must exist."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}")
    found = [os.path.join(bench_dir, name + ext) for ext in EXTENSIONS
             if os.path.isfile(os.path.join(bench_dir, name + ext))]
    if not found:
        raise FileNotFoundError(
            f"benchmark {name!r}: none of {', '.join(name + e for e in EXTENSIONS)} in {bench_dir!r}"
        )
    if len(found) > 1:
        raise ValueError(f"benchmark {name!r}: several files in {bench_dir!r}: {found}; keep one")
    return found[0]


def _read_table(path: str):
    if os.path.getsize(path) == 0:
        raise ValueError(f"benchmark file is empty: {path}")
    builder = "parquet" if path.endswith(".parquet") else "json"
    try:
        return load_local_dataset(builder, path)
    except Exception as e:  # noqa: BLE001  datasets raises many types; name the file
        raise ValueError(f"could not read benchmark file {path}: {e}") from e


def _column(columns: list[str], candidates: tuple[str, ...]) -> str | None:
    """The first candidate present in `columns`, compared case-insensitively."""
    lower = {c.lower(): c for c in columns}
    return next((lower[c] for c in candidates if c in lower), None)


def _text(value: Any, reason: str) -> str:
    """A non-empty string; numbers are written out (AIME answers are often integers)."""
    if isinstance(value, bool) or value is None:
        raise Skip(reason)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, (str, int, float)):
        raise Skip("malformed")
    text = str(value).strip()
    if not text:
        raise Skip(reason)
    return text


def _gold(value: Any) -> str:
    """A gold answer; a list (OlympiadBench `final_answer`) becomes one comma-joined answer."""
    if isinstance(value, (list, tuple)):
        # Each item is usually "$...$": strip the delimiters so "1, 2" parses as one tuple.
        items = [_text(v, "no_answer").strip("$ ").strip() for v in value]
        items = [i for i in items if i]
        if not items:
            raise Skip("no_answer")
        return ", ".join(items)
    return _text(value, "no_answer")


def _math_row(row: dict[str, Any], cols: dict[str, str | None]) -> tuple[str, str]:
    from ba_jax.rewards.math import extract_boxed

    question = _text(row[cols["question"]], "no_question")
    if cols["answer"] is not None and row[cols["answer"]] not in (None, "", []):
        return question, _gold(row[cols["answer"]])
    if cols["solution"] is not None:  # Minerva-Math: the answer is boxed in the solution
        solution = row[cols["solution"]]
        if isinstance(solution, (list, tuple)):
            solution = "\n".join(str(s) for s in solution)
        boxed = extract_boxed(solution) if isinstance(solution, str) else None
        if boxed:
            return question, boxed
    raise Skip("no_answer")


class _StringsOnly(pickle.Unpickler):
    """An unpickler that builds plain values only: it refuses every class or function."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def parse_test_cases(value: Any) -> list[dict[str, Any]]:
    """LiveCodeBench tests -> list of dicts, from a JSON string, a list, or the compressed form.

    `code_generation_lite` ships `private_test_cases` as base64(zlib(pickle(json string))); the
    pickle is read with an unpickler that refuses every global, so it cannot run code.
    Raises ValueError on anything else.
    """
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        cases = list(value)
    elif isinstance(value, str):
        try:
            cases = json.loads(value)
        except json.JSONDecodeError:
            try:
                raw = zlib.decompress(base64.b64decode(value.encode("ascii"), validate=True))
                inner = _StringsOnly(io.BytesIO(raw)).load()
                cases = json.loads(inner) if isinstance(inner, (str, bytes)) else inner
            except Exception as e:  # noqa: BLE001  any decoding failure means a broken row
                raise ValueError(f"test cases are neither JSON nor LiveCodeBench's "
                                 f"compressed form: {e!r}") from e
    else:
        raise ValueError(f"test cases must be a JSON string or a list, got {type(value)}")
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
        raise ValueError(f"test cases must be a list of dicts: {str(cases)[:200]}")
    return cases


def _code_row(row: dict[str, Any], cols: dict[str, str | None], stats: dict[str, int]):
    question = _text(row[cols["question"]], "no_question")
    try:
        cases = parse_test_cases(row[cols["public"]])
        if cols["private"] is not None:
            cases += parse_test_cases(row[cols["private"]])
    except ValueError as e:
        raise Skip("malformed") from e
    tests, functional = [], 0
    for case in cases:
        kind = case.get("testtype", "stdin")
        if kind == "functional":  # LeetCode-style: calls a method, not a stdin program
            functional += 1
            continue
        if kind != "stdin" or not isinstance(case.get("input"), str) \
                or not isinstance(case.get("output"), str):
            raise Skip("malformed")
        tests.append({"input": case["input"], "output": case["output"]})
    stats["functional_tests_skipped"] += functional
    if not tests:
        raise Skip("no_stdin_tests")
    return question, tuple(tests)


def load_benchmark(name: str, path: str, *, limit: int = 0) -> Benchmark:
    """Read one benchmark file; `limit` > 0 keeps the first `limit` usable problems."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark file not found: {path}")
    path = os.path.abspath(path)
    kind = BENCHMARKS[name]
    table = _read_table(path)
    columns = list(table.column_names)
    stats = dict.fromkeys(("rows_read", "kept", "no_question", "no_answer", "malformed",
                           "no_stdin_tests"), 0)
    if kind == "code":
        stats["functional_tests_skipped"] = 0
        cols = {"question": _column(columns, ("question_content",)),
                "public": _column(columns, ("public_test_cases",)),
                "private": _column(columns, ("private_test_cases",))}
        required = {"question": "question_content", "public": "public_test_cases"}
    else:
        cols = {"question": _column(columns, _QUESTION_COLUMNS),
                "answer": _column(columns, _ANSWER_COLUMNS),
                "solution": _column(columns, ("solution",))}
        required = {"question": "problem' or 'question"}
        if cols["answer"] is None and cols["solution"] is None:
            required["answer"] = "answer', 'final_answer' or 'solution"
    for key, label in required.items():
        if cols[key] is None:
            raise ValueError(f"{path}: benchmark {name!r} needs column '{label}' (columns: {columns})")
    id_col = _column(columns, _ID_COLUMNS)

    problems: list[Problem] = []
    for index, row in enumerate(table):
        if limit and len(problems) >= limit:
            break
        stats["rows_read"] += 1
        try:
            if kind == "code":
                question, tests = _code_row(row, cols, stats)
                answer = None
            else:
                (question, answer), tests = _math_row(row, cols), ()
        except Skip as skip:
            stats[skip.reason] += 1
            continue
        pid = row[id_col] if id_col is not None and row[id_col] is not None else index
        problems.append(Problem(str(pid), question, answer, tests))
    stats["kept"] = len(problems)
    if not problems:
        raise ValueError(f"{path}: benchmark {name!r} has no usable problems ({stats})")
    return Benchmark(name, kind, path, problems, stats)
