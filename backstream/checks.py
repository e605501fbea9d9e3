"""The checks the config dataclasses share, so that every error names the key to change, the value
it got and what it expected (`optim.name: got 'sgd', expected one of [...]`)."""

from __future__ import annotations

import typing


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


def literals(obj, section: str) -> None:
    """Every field of the dataclass `obj` typed `Literal[...]` holds one of its values (a string
    choice's values are written once: in its type, often built from the registry it names)."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        if typing.get_origin(hint) is typing.Literal:
            choice(f"{section}.{name}", getattr(obj, name), list(typing.get_args(hint)))
