"""The checks the config dataclasses share, so that every error names the key to change, the value
it got and what it expected (`optim.name: got 'sgd', expected one of [...]`)."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the input (a config key, a file, a model, a reward function, an environment): the
    CLI prints its message and exits 2, without a traceback. Anything else that escapes is a bug, and
    the CLI says so. A ValueError, so that `except ValueError` and existing callers still hold."""


def choice(key: str, value, allowed: list) -> None:
    if value not in allowed:
        raise UserError(f"{key}: got {value!r}, expected one of {allowed}")


def at_least(key: str, value, lo: int) -> None:
    if value < lo:
        raise UserError(f"{key}: got {value}, expected an integer >= {lo}")
