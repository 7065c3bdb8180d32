"""Run the two sides of a benchmark in separate processes, taking turns, in one run.

Why: in one process PyTorch's OpenMP threads keep spinning after each of its ops and take
cores from XLA's threads (measured: ba_jax's decode 2,244 tokens/s alone versus 1,843 when
interleaved with the peer in the same process). Each side now lives in its own worker
process that sets itself up once (model, compilation, warm-up), then times one call per
request; the driver alternates requests so drifting machine load hits both sides alike,
and only one side computes at any moment.

Worker side:  serve(setup) where setup() -> (run_once, info); run_once() -> seconds.
Driver side:  alternate(ours_argv, peer_argv, runs) -> (ours times, peer times, infos),
              built on Worker([script, "--worker", ...]).run().
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable


def serve(setup: Callable[[], tuple[Callable[[], float], dict]]) -> None:
    """Worker loop: set up, report `info`, then one timed call per "run" line on stdin."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    run_once, info = setup()
    print("READY " + json.dumps(info), file=out, flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(f"TIME {run_once()!r}", file=out, flush=True)


class Worker:
    """A benchmark side in its own Python process (see `serve`)."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self._expect("READY"))

    def _expect(self, tag: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(tag + " "):
            self.proc.kill()
            raise RuntimeError(f"worker {self.proc.args} failed (said {line!r}); see its stderr")
        return line[len(tag) + 1:]

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect("TIME"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def alternate(ours_argv: list[str], peer_argv: list[str], runs: int):
    """Starts both workers, times `runs` calls of each in turn -> (t_ours, t_peer, info_ours,
    info_peer)."""
    ours, peer = Worker(ours_argv), Worker(peer_argv)
    t_ours, t_peer = [], []
    try:
        for _ in range(runs):
            t_ours.append(ours.run())
            t_peer.append(peer.run())
    finally:
        ours.close()
        peer.close()
    return t_ours, t_peer, ours.info, peer.info
