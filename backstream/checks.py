"""The checks the config dataclasses share, so that every error names the key to change, the value
it got and what it expected (`optim.name: got 'sgd', expected one of [...]`)."""

from __future__ import annotations


def choice(key: str, value, allowed: list) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: got {value!r}, expected one of {allowed}")


def at_least(key: str, value, lo: int) -> None:
    if value < lo:
        raise ValueError(f"{key}: got {value}, expected an integer >= {lo}")
