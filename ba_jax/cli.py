"""How the commands end when something is wrong: one line naming the cause and the fix.

`python -m ba_jax.main`, `python -m ba_jax.evaluate` and `python -m ba_jax.models.convert_hf`
print an error a user can act on as `<command>: <message>` and exit with status 1. The full
detail (the traceback, and what libraries logged on the way: checkpoint.py keeps Orbax's in
the error's notes) goes to `error.log` in the command's folder when it has one (the run's
WORKDIR), named on a second line, and to the terminal with `--verbose`. Flag errors (a config
file that does not exist, a misspelled `--config.` override, a config variant that
`get_config` refuses) are one line too.

Lives here: `fail`, `message`, `resume_hint` (a failed write during a run: what is intact
and how to resume), `absl_flags_parser`, `VERBOSE_HELP`. Not here: the messages
themselves, which are written where each error is found.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from ba_jax import paths

LOG_NAME = "error.log"
VERBOSE_HELP = ("on an error, print the full traceback (otherwise one line; the detail goes "
                "to error.log in the run's folder when there is one)")


def message(e: BaseException) -> str:
    """The text of `e` a user reads (a KeyError's own text, without the quotes of its repr)."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]
    return str(e)


def _has_detail(e: BaseException) -> bool:
    """Whether a traceback would tell more than the message: a cause, or notes."""
    return bool(e.__cause__ or getattr(e, "__notes__", None)
                or (e.__context__ and not e.__suppress_context__))


def _write_log(folder: str | None, text: str) -> str | None:
    """Append `text` under a header to FOLDER/error.log (a `gs://` folder too: paths.py);
    its path, or None when the folder does not exist or cannot be written (a full disk)."""
    try:
        if not folder or not paths.isdir(folder):
            return None
        path = paths.join(folder, LOG_NAME)
        paths.append_text(path, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                          f"{' '.join(sys.argv)}\n{text}\n")
    except Exception:  # noqa: BLE001 - OSError, or a remote file system's own error
        return None
    return path


def _divert_stragglers(log_dir: str | None) -> None:
    """What libraries still print while the process ends (finalised coroutines of a failed
    save or restore, never-retrieved task errors) goes to the log, or nowhere, rather than
    under the message. The file is opened now: at interpreter shutdown `open` is gone. A
    URL folder (`gs://`) gets none of them: nothing can be uploaded at shutdown."""
    if log_dir and paths.is_remote(log_dir):
        log_dir = None
    try:
        log = open(os.path.join(log_dir, LOG_NAME), "a") if log_dir and os.path.isdir(
            log_dir) else None
    except OSError:
        log = None

    def unraisable(u) -> None:
        try:
            if log is not None:
                log.write("".join(traceback.format_exception(
                    u.exc_type, u.exc_value, u.exc_traceback)))
                log.flush()
        except BaseException:  # noqa: BLE001 - a full disk, or the interpreter shutting down
            pass

    sys.unraisablehook = unraisable
    # The loggers only once the process ends (a caller that catches SystemExit keeps them).
    atexit.register(lambda: [logging.getLogger(name).addFilter(
        lambda record: record.levelno < logging.ERROR) for name in ("absl", "asyncio")])


def fail(prog: str, e: BaseException, *, verbose: bool = False,
         log_dir: str | None = None) -> NoReturn:
    """Print `prog: <message of e>` (and where its detail is) and exit with status 1.

    The detail goes to `log_dir`/error.log when that folder exists, and with `verbose` to
    the terminal before the message; a second line names the log when the error has more
    to tell than its message (a cause, notes)."""
    if not verbose:
        _divert_stragglers(log_dir)
    detail = "".join(traceback.format_exception(e))
    log = _write_log(log_dir, detail)
    lines = [f"{prog}: {message(e)}"]
    if verbose:
        sys.stderr.write(detail)
    elif _has_detail(e):
        lines.append(f"  (full detail in {log}; --verbose prints it)" if log
                     else "  (--verbose prints the full detail)")
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(1)


def resume_hint(e: OSError, workdir: str) -> RuntimeError:
    """A write that failed while a run was going (a full disk at a metrics line) as one line
    that says what is intact and how to go on: the newest checkpoint in WORKDIR/checkpoints
    (Orbax commits a step only when it is complete, so it is whole) and the same command."""
    folder = paths.join(workdir, "checkpoints")
    try:
        steps = sorted(int(name) for name in paths.listdir(folder) if name.isdigit())
    except Exception:  # noqa: BLE001 - OSError, or a remote file system's own error
        steps = []
    fix = "free disk space" if e.errno == errno.ENOSPC else "fix the cause"
    then = (f"the newest checkpoint (step {steps[-1]} in {folder}) is intact: {fix} and run the "
            "same command again to resume from it" if steps else
            f"no checkpoint was written yet: {fix} and run the same command again")
    error = RuntimeError(f"{message(e)}: writing to --workdir={workdir!r} failed during the "
                         f"run; {then}")
    error.__cause__ = e
    return error


# ------------------------------------------------------------------ flags of the absl commands


def _override_error(e: BaseException, argv: Sequence[str]) -> str | None:
    """A `--config.a.b=v` that names no key: the flag, the missing key, ml_collections' guess."""
    text = str(e).replace("\\'", "'")  # ml_collections nests a KeyError's repr in a repr
    missing = re.search(r"'(\w+)'", text)
    if not missing:
        return None
    key = missing[1]
    guess = re.search(r'Did you mean "([^"]+)"', text)
    for arg in argv:
        path = arg.split("=", 1)[0]
        if path.startswith("--config.") and key in path[len("--config."):].split("."):
            parts = path[2:].split(".")
            parent = ".".join(parts[:parts.index(key)])
            hint = f"; did you mean {guess[1]!r}?" if guess else ""
            return (f"{arg}: {parent} has no key {key!r}{hint} (the config is locked: an "
                    "override must name an existing key)")
    return None


def _flag_error(e: BaseException, argv: Sequence[str]) -> str:
    """One line for an error raised while parsing the command line or loading --config."""
    from absl import flags

    if isinstance(e, (KeyError, AttributeError)):
        found = _override_error(e, argv)
        if found:
            return found
    text = message(e)
    if isinstance(e, OSError) and "config" in text.lower():
        why = re.search(r"\[Errno \d+\][^\n]*", text)
        return (f"--config: the config file cannot be read: {why[0] if why else text}; "
                "pass a file such as --config=configs/default.py")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(e, flags.Error):
        if "Traceback (most recent call last)" in text:  # get_config raised: its own message
            flag = re.sub(r"^flag |: Error whilst parsing config file:$", "", lines[0])
            return f"{flag}: {re.sub(r'^(ValueError|TypeError): ', '', lines[-1])}"
        return f"{lines[0] if lines else text} (--helpshort lists the flags)"
    return f"{type(e).__name__}: {lines[-1] if lines else text}"


def absl_flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
    """A `flags_parser` for `absl.app.run` that reports flag and config-file errors as one
    line (`--verbose` anywhere on the line: with the traceback) and loads --config at once,
    since ml_collections would otherwise defer a load error to the config's first use."""

    def parse(argv: list[str]) -> list[str]:
        from absl import flags

        try:
            rest = flags.FLAGS(argv)
            if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
                getattr(flags.FLAGS.config, "to_dict")  # a config that failed to load raises
            return rest
        except Exception as e:  # noqa: BLE001 - every parse error becomes one line
            if "--verbose" in argv:
                traceback.print_exc()
            print(f"{prog}: {_flag_error(e, argv)}", file=sys.stderr)
            sys.exit(1)

    return parse
