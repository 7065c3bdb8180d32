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
on the next start.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored."""


class Checkpointer:
    """Save and restore (state pytree, JSON metadata) pairs under `directory`."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=False,  # a save returns only once it is durable
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
        """Write `state` (arrays) and `meta` (JSON-serialisable) as checkpoint `step`."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def _restore(self, step: int, args: ocp.args.Composite):
        try:
            return self._manager.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 - re-raised with the folder named
            path = os.path.join(self.directory, str(step))
            raise CheckpointError(
                f"checkpoint {path} cannot be restored into this run's state "
                f"({type(e).__name__}: {str(e)[:400]}). It may come from another model "
                "shape or be damaged; use another workdir, or set "
                "--config.checkpoint.fallback_to_previous=True to resume from an older step."
            ) from e

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore checkpoint `step` into the shapes/shardings of `abstract_state`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._restore(step, ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only `state["params"]` of checkpoint `step`, in the shapes/shardings of
        `abstract_params`; the optimizer state and the side-car are not read.

        An Orbax partial restore: the target names the `params` subtree alone, and
        `partial_restore=True` leaves every other saved array on disk.
        """
        abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)}
        out = self._restore(step, ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True)))
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
                    logging.warning("resumed from step %d; skipped: %s", step, errors)
                    self._set_aside(bad)
                return step, state, meta
            except CheckpointError as e:
                if not fallback_to_previous:
                    raise
                errors.append(str(e))
                bad.append(step)
        raise CheckpointError("no checkpoint could be restored:\n" + "\n".join(errors))

    def _set_aside(self, steps: list[int]) -> None:
        """Move unreadable steps out of the manager's folder (kept for inspection, not
        deleted) so the resumed run can write those step numbers again."""
        aside = self.directory.rstrip("/") + "_unreadable"
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            dst = os.path.join(aside, str(step))
            n = 0
            while os.path.exists(dst):
                n += 1
                dst = os.path.join(aside, f"{step}.{n}")
            os.rename(os.path.join(self.directory, str(step)), dst)
            logging.warning("moved unreadable checkpoint %d to %s", step, dst)
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()


def load_params(directory: str, abstract_params: Any, *, step: int | None = None
                ) -> tuple[Any, int]:
    """(params, step) of a trainer checkpoint folder (WORKDIR/checkpoints), parameters only.

    `abstract_params` gives the structure, shapes and shardings (e.g. the run's initial
    policy); `step=None` takes the newest complete step. CheckpointError when the folder
    holds no checkpoint or the step does not fit `abstract_params` (another model shape).
    """
    ckpt = Checkpointer(directory)
    try:
        if step is None:
            step = ckpt.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {directory}")
        return ckpt.restore_params(step, abstract_params), step
    finally:
        ckpt.close()
