"""Orbax checkpoints of a training run: parameters, optimizer state, step, RNG, data position.

What lives here: one `Checkpointer` around `orbax.checkpoint.CheckpointManager` that saves
the array state (a pytree) and a JSON side-car (step, data-iterator position, the config,
anything small) atomically as one step folder, keeps `max_to_keep`, and restores the
newest readable step; `load_params`, the policy's parameters alone (what evaluation
needs: the optimizer state is never read). What does not: deciding *when* to save
(train.py) or converting Hugging Face weights (models/convert_hf.py).

Failure policy: an unreadable latest checkpoint is an error that names it, never a silent
fresh start; `fallback_to_previous=True` walks back to the newest step that restores.
Orbax writes each step into a temporary folder and renames it when complete, so a run
killed during a save leaves an unfinished temporary folder that is ignored and removed
on the next start. A failed save or restore is one `CheckpointError` whose message says
the cause in a line (the array whose shape differs, `[Errno 28] No space left on device`).
What Orbax and TensorStore log or print from their threads on the way (a traceback per
array and per pending task: hundreds of lines) is kept in the error's notes instead of
reaching the terminal; `cli.fail` writes them to the run's error.log.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp

from ba_jax import integrity, paths


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored or saved; the message names it and the cause.

    `reason`: the cause alone, in a few words (what the message quotes)."""

    def __init__(self, message: str, reason: str = "", step: int | None = None):
        super().__init__(message)
        self.reason = reason or message
        self.step = step  # a failed save's step (with async saves: maybe an earlier one)


class NoSuchStep(CheckpointError):
    """A step was asked for that the folder does not hold; the message lists those it holds."""


class NonFiniteState(CheckpointError):
    """A state with a NaN or an infinity was about to be saved: it never is."""


INTEGRITY_KEY = "integrity"  # the side-car's path -> checksum of every saved array


def _first(paths: list[str]) -> str:
    return paths[0] + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")


def summarize(e: BaseException) -> str:
    """The cause of a failed write or read in a few words: `[Errno 28] No space left on
    device` for an OS error anywhere in the chain (TensorStore reports it inside a ValueError
    as `os_error_code='28'`), else the first line of the innermost message."""
    chain: list[BaseException] = []
    while e is not None and all(e is not x for x in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, OSError) and x.errno:
            return f"[Errno {x.errno}] {os.strerror(x.errno)}"
        m = re.search(r"os_error_code='?(\d+)", str(x))
        if m:
            return f"[Errno {m[1]}] {os.strerror(int(m[1]))}"
    text = (str(chain[-1]).strip().splitlines() or [""])[0]
    return f"{type(chain[-1]).__name__}: {text[:300]}"


class _Held:
    """Holds what Orbax and TensorStore emit from threads and finalisers while a save or
    restore runs: absl and asyncio log records at `level` or above, and unraisable
    exceptions (coroutines closed after their event loop). If the block raises or sets
    `failed`, they become text in `kept` (the error's detail); otherwise the records are
    handed on as usual (`replay`) and the unraisables to Python's hook."""

    def __init__(self, *, level: int = logging.ERROR, replay: bool = True):
        self.level, self.replay = level, replay
        self.failed = False
        self.kept: list[str] = []
        self._records: list[logging.LogRecord] = []
        self._unraisables: list = []
        self._loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]

    def _hold(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            self._records.append(record)
            return False
        return True

    def __enter__(self) -> _Held:
        for lg in self._loggers:
            lg.addFilter(self._hold)
        self._old_hook, sys.unraisablehook = sys.unraisablehook, self._unraisables.append
        return self

    def settle(self, *, quiet_s: float = 0.2, max_s: float = 3.0) -> None:
        """After a failure: collect the failed operation's orphaned tasks and coroutines now,
        and wait until its threads' late callbacks (TensorStore reads finishing after the
        event loop closed) have stopped reporting for `quiet_s`, at most `max_s`."""
        deadline = time.monotonic() + max_s
        seen = -1
        while seen != len(self._records) + len(self._unraisables) and time.monotonic() < deadline:
            seen = len(self._records) + len(self._unraisables)
            gc.collect()
            time.sleep(quiet_s)
            gc.collect()

    def __exit__(self, exc_type, exc, tb) -> None:
        for lg in self._loggers:
            lg.removeFilter(self._hold)
        sys.unraisablehook = self._old_hook
        failed = self.failed or exc_type is not None
        fmt = logging.Formatter("%(levelname)s %(name)s %(filename)s:%(lineno)d] %(message)s")
        for record in self._records:
            if failed:
                self.kept.append(fmt.format(record))
            elif self.replay:
                logging.getLogger(record.name).handle(record)
        for u in self._unraisables:
            if failed:
                self.kept.append(f"Exception ignored in: {u.object!r}\n" + "".join(
                    traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))
            else:
                self._old_hook(u)


def _shapes(tree: Any) -> dict[str, tuple]:
    """Dotted path (nnx's `.value` level dropped) -> shape, for every array leaf of `tree`."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if hasattr(leaf, "shape"):
            out[".".join(k for k in keys if k != "value")] = tuple(leaf.shape)
    return out


class Checkpointer:
    """Save and restore (state pytree, JSON metadata) pairs under `directory`."""

    def __init__(self, directory: str, *, max_to_keep: int = 2, async_save: bool = False):
        """`async_save`: `save` returns once the arrays are in host memory (Orbax copies
        them before it returns, so the caller may donate or overwrite them) and the write
        and commit go on in a background thread; `wait` blocks until they are done."""
        self.directory = paths.absolute(directory)  # a gs:// URL goes to Orbax as it is
        self.async_save = async_save
        self._pending: tuple[int, _Held] | None = None  # a save not known to be committed
        paths.makedirs(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # partial saves of a killed run are removed
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def steps(self) -> list[int]:
        """All complete checkpoint steps, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write `state` (arrays) and `meta` (JSON-serialisable) as checkpoint `step`, with
        the checksum of every array in the side-car (`integrity`); a failed write is a
        CheckpointError naming the step, with the cause as its `reason`; a state with a
        non-finite value is refused (NonFiniteState) before anything is written."""
        check = integrity.summary(state)
        bad = integrity.nonfinite(check)
        if bad:
            raise NonFiniteState(
                f"refusing to save checkpoint step {step} in {self.directory}: non-finite "
                f"values in {_first(bad)}", "non-finite state")
        meta = dict(meta, **{INTEGRITY_KEY: {p: c for p, (_, c) in check.items()}})
        self.wait()  # the previous save, if still in flight: its failure is its own
        # Held from here until the save is committed (`wait`): what Orbax's background
        # threads log or leave unraised about a failed write becomes the error's notes
        held = _Held().__enter__()
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - an OSError, or TensorStore's ValueError
            self._raise(step, held, e)
        self._pending = (step, held)
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; its failure is a
        CheckpointError naming its step."""
        if self._pending is None:
            return
        (step, held), self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - what the background write raised
            self._raise(step, held, e)
        held.__exit__(None, None, None)

    def _raise(self, step: int, held: _Held, e: Exception):
        """A failed save of `step` as a CheckpointError with the cause as its `reason` and
        what Orbax and TensorStore reported on the way as its notes."""
        held.failed = True
        reason, detail = summarize(e), "".join(traceback.format_exception(e))
        held.settle()  # what the failed write left behind reports now, held
        held.__exit__(None, None, None)
        raise _noted(CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed: {reason}", reason,
            step=step), [detail, *held.kept]) from e

    def read_meta(self, step: int) -> dict | None:
        """Checkpoint `step`'s JSON side-car alone (no array is read); None if unreadable."""
        try:
            with _Held(level=logging.WARNING, replay=False):
                return dict(self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except Exception:  # noqa: BLE001 - the restore that follows names the problem
            return None

    def mismatch(self, step: int, abstract: Any) -> str | None:
        """Why checkpoint `step` does not fit `abstract` (arrays or ShapeDtypeStructs): the
        first array it lacks or holds in another shape, parameters first; None when the
        shapes agree or the step's metadata cannot be read."""
        try:
            with _Held(level=logging.WARNING, replay=False), ocp.PyTreeCheckpointer() as reader:
                tree = reader.metadata(paths.join(self.directory, str(step), "state"))
            stored = _shapes(getattr(getattr(tree, "item_metadata", tree), "tree", tree))
        except Exception:  # noqa: BLE001 - only a more precise message is lost
            return None
        wanted = _shapes(abstract)
        for path in sorted(wanted, key=lambda p: (not p.startswith("params"), p)):
            if path not in stored:
                return f"it holds no {path} (this run's model has one of shape {wanted[path]})"
            if stored[path] != wanted[path]:
                return f"its {path} has shape {stored[path]}, this run's model {wanted[path]}"
        return None

    def _restore(self, step: int, args: ocp.args.Composite, abstract: Any):
        with _Held() as held:
            try:
                return self._manager.restore(step, args=args)
            except Exception as e:  # noqa: BLE001 - re-raised with the folder named
                held.failed = True
                missing = isinstance(e, FileNotFoundError)
                reason, detail = summarize(e), "".join(traceback.format_exception(e))
            held.settle()  # what the failed read left behind reports now, held
        path = paths.join(self.directory, str(step))
        if missing and not paths.isdir(path):
            error = NoSuchStep(f"no checkpoint step {step} in {self.directory}; steps there: "
                               f"{', '.join(map(str, self.steps())) or 'none'}")
        else:
            reason = self.mismatch(step, abstract) or reason
            error = CheckpointError(
                f"checkpoint {path} cannot be restored into this run's state: {reason}. It "
                "comes from another model shape or is damaged: use the config it was written "
                "with, another --workdir, or --config.checkpoint.fallback_to_previous=True to "
                "resume from an older step", reason)
        raise _noted(error, [detail, *held.kept])

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore checkpoint `step` into the shapes/shardings of `abstract_state`, checked:
        every array finite and, where the side-car has checksums, bit for bit what was
        saved (a CheckpointError naming the arrays otherwise)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._restore(step, ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()), abstract)
        meta = dict(out["meta"])
        self._verify(step, out["state"], meta.get(INTEGRITY_KEY))
        return out["state"], meta

    def _verify(self, step: int, state: Any, saved: dict | None) -> None:
        """A CheckpointError when restored `state` holds a non-finite value or differs from
        the checksums `saved` with it (None: a checkpoint written before they were kept)."""
        check = integrity.summary(state)
        changed = integrity.differing(check, saved or {})
        bad = integrity.nonfinite(check)
        if not changed and not bad:
            return
        path = paths.join(self.directory, str(step))
        reason = (f"the bits of {_first(changed)} differ from what was saved (checksums)"
                  if changed else f"non-finite values in {_first(bad)}")
        raise CheckpointError(
            f"checkpoint {path} is damaged: {reason}. Use "
            "--config.checkpoint.fallback_to_previous=True to resume from an older step",
            reason)

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only `state["params"]` of checkpoint `step`, in the shapes/shardings of
        `abstract_params`; the optimizer state and the side-car are not read.

        An Orbax partial restore: the target names the `params` subtree alone, and
        `partial_restore=True` leaves every other saved array on disk.
        """
        abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)}
        out = self._restore(step, ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True), meta=ocp.args.JsonRestore()), abstract)
        self._verify(step, {"params": out["state"]["params"]},
                     dict(out["meta"]).get(INTEGRITY_KEY))
        return out["state"]["params"]

    def restore_latest(
        self, abstract_state: Any, *, fallback_to_previous: bool = False
    ) -> tuple[int, Any, dict] | None:
        """Newest restorable (step, state, meta), or None when there is no checkpoint."""
        steps = self.steps()
        if not steps:
            return None
        errors, bad = [], []
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, abstract_state)
                if errors:
                    logging.warning("resumed from step %d; skipped: %s", step,
                                    "; ".join(str(e) for e in errors))
                    self._set_aside(bad)
                return step, state, meta
            except CheckpointError as e:
                if not fallback_to_previous:
                    raise
                errors.append(e)
                bad.append(step)
        raise _noted(CheckpointError(
            f"none of the checkpoints in {self.directory} (steps "
            f"{', '.join(map(str, bad))}) can be restored into this run's state (step {bad[0]}: "
            f"{errors[0].reason}); they come from another model shape or are damaged: use the "
            "config they were written with, or another --workdir (nothing was moved)"),
            [note for e in errors for note in [str(e), *getattr(e, "__notes__", [])]])

    def _set_aside(self, steps: list[int]) -> None:
        """Move unreadable steps out of the manager's folder (kept for inspection, not
        deleted) so the resumed run can write those step numbers again."""
        aside = self.directory.rstrip("/") + "_unreadable"
        paths.makedirs(aside)
        for step in steps:
            dst = paths.join(aside, str(step))
            n = 0
            while paths.exists(dst):
                n += 1
                dst = paths.join(aside, f"{step}.{n}")
            paths.replace(paths.join(self.directory, str(step)), dst)
            logging.warning("moved unreadable checkpoint %d to %s", step, dst)
        self._manager.reload()

    def close(self, *, quiet: bool = False) -> None:
        """Wait for the save in flight, then close. Its failure is raised, or with `quiet`
        (the caller is already stopping on an error of its own) logged."""
        error = None
        try:
            self.wait()
        except CheckpointError as e:
            error = e
        with _Held(replay=error is None and not quiet):  # Orbax repeats a failed finalize
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - reported above, or the caller's error is
                if error is None and not quiet:
                    raise
        if error is not None:
            if not quiet:
                raise error
            logging.warning("%s", error)


def _noted(error: CheckpointError, notes: list[str]) -> CheckpointError:
    """`error` with `notes` (tracebacks, held library output) as its detail."""
    for text in notes:
        error.add_note(text.rstrip())
    return error


def load_params(directory: str, abstract_params: Any, *, step: int | None = None
                ) -> tuple[Any, int]:
    """(params, step) of a trainer checkpoint folder (WORKDIR/checkpoints), parameters only.

    `abstract_params` gives the structure, shapes and shardings (e.g. the run's initial
    policy); `step=None` takes the newest complete step. CheckpointError when the folder
    holds no checkpoint or the step does not fit `abstract_params` (another model shape);
    NoSuchStep, listing the steps there, when it holds no `step`.
    """
    ckpt = Checkpointer(directory)
    try:
        steps = ckpt.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {directory}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise NoSuchStep(f"no checkpoint step {step} in {ckpt.directory}; steps there: "
                             f"{', '.join(map(str, steps))}")
        return ckpt.restore_params(step, abstract_params), step
    finally:
        ckpt.close()
