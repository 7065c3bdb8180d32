"""`ConfigError` (a configuration that cannot run; the message names the option) and
`require`: the one error type of every config check (run_config.py, update_config.py),
kept apart so the checks' modules import it without importing each other."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the option."""


def require(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`."""
    if not ok:
        raise ConfigError(msg)
