"""Run logging: `WORKDIR/metrics.jsonl`, TensorBoard event files and a progress bar.

What lives here: the writers. What does not: computing metrics (train.py, aggregation.py)
or plotting (plot.py). On resume the JSONL is cut back to the restored step, so a run
that was killed and resumed has exactly one line per step, identical to an
uninterrupted run's.

A URL workdir (`gs://`, paths.py): objects cannot be appended to, so the writer keeps the
file's lines in memory and rewrites the object at `flush` (called before every checkpoint
save, so a step's line is stored before its checkpoint commits, as locally) and every
`flush_every` steps; TensorBoard writes into a local staging folder uploaded at the same
moments.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from ba_jax import paths

METRICS_FILE = "metrics.jsonl"


def _plain(value: Any) -> Any:
    """JSON-friendly scalar: numpy/jax scalars to Python, non-finite floats to None."""
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    v = float(np.asarray(value))
    return v if math.isfinite(v) else None


def read_metrics(workdir: str) -> list[dict]:
    """All step records of a run, in order (an unfinished last line is ignored)."""
    path = paths.join(workdir, METRICS_FILE)
    if not paths.exists(path):
        return []
    rows = []
    for line in paths.read_text(path).splitlines(keepends=True):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill; truncate() drops it on resume
    return rows


def step_record(*, host: dict[str, float], update: dict[str, float], timing: dict[str, float],
                learning_rate: float, sync_s: float, step_s: float, update_s: float,
                checkpoint_s: float) -> dict[str, float]:
    """One step's metrics.jsonl record (less `step`): the host metrics of the rollouts
    (`experience.host_metrics`), the update's (`train.update`: loss, clip fractions, the
    aggregation diagnostics `diag_*`, the old-log-prob mismatch), and the step's timings;
    `checkpoint_s` is the save at the end of the previous step."""
    record = dict(host) | dict(update)
    record.update(learning_rate=float(learning_rate), sampling_rounds=float(timing["rounds"]),
                  reward_timeouts=float(timing["timeouts"]),
                  reward_errors=float(timing["errors"]), sample_time_s=timing["sample_s"],
                  score_time_s=timing["score_s"], step_time_s=step_s, update_time_s=update_s,
                  checkpoint_time_s=checkpoint_s,
                  sampling_time_share=timing["sample_s"] / step_s,
                  tokens_per_s=host["generated_tokens"] / max(timing["sample_s"], 1e-9),
                  weight_sync_time_s=sync_s)
    return record


class MetricsWriter:
    """Append one JSON object per step; mirror scalars to TensorBoard; show progress."""

    def __init__(self, workdir: str, *, total_steps: int, start_step: int = 0,
                 enabled: bool = True, progress: bool = True, flush_every: int = 10):
        self.enabled = enabled
        self.workdir = workdir
        self.path = paths.join(workdir, METRICS_FILE)
        self.flush_every = max(1, flush_every)
        self._tb = None
        self._bar = None
        self._remote = paths.is_remote(workdir)
        if not enabled:
            return
        self.truncate(start_step)
        if self._remote:  # the file's text, rewritten as one object at each flush
            self._text, self._dirty = paths.read_text(self.path), False
        else:
            self._file = open(self.path, "a")
        self._stage = paths.staging(workdir, "tensorboard")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(self._stage, "tensorboard"), flush_secs=30)
        except Exception:  # noqa: BLE001 - TensorBoard is optional output
            self._tb = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train",
                             dynamic_ncols=True, mininterval=1.0)

    def truncate(self, last_step: int) -> None:
        """Keep only records with step <= last_step (the state that was restored)."""
        rows = [r for r in read_metrics(self.workdir) if r.get("step", 0) <= last_step]
        paths.write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def flush(self) -> None:
        """Store every line written so far (locally each write already is): a URL
        workdir's object is rewritten and TensorBoard's staged files uploaded."""
        if not self.enabled or not self._remote:
            return
        if self._dirty:
            paths.write_text(self.path, self._text)
            self._dirty = False
        if self._tb is not None:
            self._tb.flush()
            paths.upload_tree(os.path.join(self._stage, "tensorboard"),
                              paths.join(self.workdir, "tensorboard"))

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)} | {k: _plain(v) for k, v in scalars.items()}
        if self._remote:
            self._text, self._dirty = self._text + json.dumps(record) + "\n", True
            if step % self.flush_every == 0:
                self.flush()
        else:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            if not _tensorboard_alive(self._tb):
                # its writer thread died of a failed write (a full disk): a dead one would
                # block the next add_scalar forever on its bounded queue
                _abandon_tensorboard(self._tb)
                self._tb = None
                raise OSError(f"TensorBoard's event writer in {self.workdir} "
                              "stopped after a failed write (disk full?)")
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            # The last step counts once the run has finished (its checkpoint saved): a save
            # that fails there must not leave a bar at 100% above the error.
            if self._bar.n + 1 < self._bar.total:
                self._bar.update(1)
            self._bar.set_postfix(reward=f"{record.get('reward_mean') or 0:.3f}",
                                  acc=f"{record.get('accuracy') or 0:.3f}", refresh=False)

    def close(self, finished: bool = True) -> None:
        """Close the files; `finished=False` (the run stopped on an error): the bar stays at
        the steps done, marked stopped, and a file that cannot be flushed (a full disk) does
        not hide the run's own error."""
        if not self.enabled:
            return
        if self._bar is not None:
            if finished:
                self._bar.update(self._bar.total - self._bar.n)
            else:
                self._bar.set_description("train stopped", refresh=False)
            self._bar.close()
        try:
            if self._remote:
                self.flush()
            else:
                self._file.close()
        except OSError:
            if finished:
                raise
        if self._tb is not None:
            _close_tensorboard(self._tb, report=finished)
            if self._remote and finished:
                paths.upload_tree(os.path.join(self._stage, "tensorboard"),
                                  paths.join(self.workdir, "tensorboard"))
        paths.remove_staging(self._stage, self.workdir)


def _tensorboard_alive(tb) -> bool:
    """Whether tensorboardX's event-writer thread still runs (it ends on a write error)."""
    worker = getattr(getattr(getattr(tb, "file_writer", None), "event_writer", None),
                     "_worker", None)
    return worker is None or worker.is_alive()


def _close_tensorboard(tb, *, report: bool) -> None:
    """Close a tensorboardX writer; where its files cannot be flushed (a full disk), stop its
    writer threads and mark them closed, so that neither this call nor tensorboardX's exit
    hook prints a traceback per file (TensorBoard is optional output: metrics.jsonl is the
    record)."""
    try:
        tb.close()
    except OSError as e:
        if report:  # a failed run's own error says more
            print(f"TensorBoard files in {tb.logdir} were not flushed: {e}")
        _abandon_tensorboard(tb)


def _abandon_tensorboard(tb) -> None:
    """Stop a tensorboardX writer's threads and mark its files closed without flushing, so
    that neither a later call nor tensorboardX's exit hook writes (or waits on) them."""
    for writer in (tb.all_writers or {}).values():
        events = writer.event_writer
        worker = getattr(events, "_worker", None)
        if worker is not None and worker.is_alive():
            worker.stop()
        events._closed = True  # what tensorboardX checks before flushing again
