"""Throughput of the code sandbox: programs/s, serial vs parallel, against unsandboxed runs.

A batch of simple correct programs (each reads numbers from stdin and prints a result),
each with a few stdin/stdout tests, scored three ways in one process, round-robin over
repeats so machine noise hits all alike; medians reported:

* `bare`: the peer. Plain `subprocess.run([python, "-I", "-S", "-c", src])` per test on one
  thread: no namespaces, no uid drop, no limits (what a naive reward function does).
* `serial`: `check_programs(..., num_workers=1)`.
* `parallel`: `check_programs(..., num_workers=os.cpu_count())`.

Results go in docs/benchmarks.md, section "Code sandbox".

    python benchmarks/code_sandbox.py [--programs 64] [--tests 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from ba_jax.rewards import code

TEMPLATES = (
    "n = int(input())\nprint(n * {k})\n",
    "import sys\nxs = list(map(int, sys.stdin.read().split()))\nprint(sum(xs) + {k})\n",
    "```python\ndef main():\n    a = int(input())\n    print(a * a + {k})\n\nmain()\n```\n",
)
EXPECT = (lambda n, k: n * k, lambda n, k: n + k, lambda n, k: n * n + k)


def make_items(num_programs: int, num_tests: int) -> list[tuple[str, list[dict]]]:
    """Distinct correct programs with their tests."""
    items = []
    for i in range(num_programs):
        t, k = i % len(TEMPLATES), i // len(TEMPLATES) + 1
        tests = [{"input": f"{n}\n", "output": f"{EXPECT[t](n, k)}\n"}
                 for n in range(i, i + num_tests)]
        items.append((TEMPLATES[t].format(k=k), tests))
    return items


def run_bare(items: list[tuple[str, list[dict]]], python: str) -> int:
    """The unsandboxed peer; returns how many programs passed."""
    passed = 0
    for source, tests in items:
        ok = True
        for test in tests:
            proc = subprocess.run([python, "-I", "-S", "-c", code.extract_code(source)],
                                  input=test["input"].encode(), capture_output=True,
                                  timeout=6.0)
            ok = ok and proc.returncode == 0 and code.outputs_match(
                proc.stdout.decode(), test["output"])
        passed += ok
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--tests", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    iso = code.isolation()
    items = make_items(args.programs, args.tests)
    workers = os.cpu_count() or 1
    runners = {
        "bare": lambda: run_bare(items, iso.python),
        "serial": lambda: sum(r.passed for r in code.check_programs(items, num_workers=1)),
        "parallel": lambda: sum(r.passed for r in code.check_programs(
            items, num_workers=workers)),
    }
    times = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            start = time.perf_counter()
            passed = fn()
            times[name].append(time.perf_counter() - start)
            assert passed == len(items), f"{name}: only {passed}/{len(items)} passed"

    print(f"isolation: {iso}")
    print(f"{args.programs} programs x {args.tests} tests, {workers} CPUs, "
          f"median of {args.repeats}")
    bare = statistics.median(times["bare"])
    print(f"{'mode':<10}{'programs/s':>12}{'ms/test run':>14}{'time vs bare':>15}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<10}{args.programs / t:>12.1f}{1e3 * t / (args.programs * args.tests):>14.1f}"
              f"{t / bare:>15.2f}")


if __name__ == "__main__":
    main()
