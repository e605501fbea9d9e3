"""Calling the user's code one way, whoever calls it (reward functions, environments, tools): with the
keyword arguments it names (all of them when it takes **kwargs, as TRL passes them), awaited when it
is an `async def`, and, where a caller asks, with a deadline. (An environment's deadline is enforced
by its worker process, rl/agent/worker.py, which can be killed; a thread cannot, so `with_deadline`
only stops waiting.) Imports nothing heavy: environment workers use it."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any


def params(fn) -> list[inspect.Parameter] | None:
    """fn's parameters; None when it has no signature (a builtin: it takes what it gets)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def named(fn, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes: all of them when it has **kwargs (or no signature), else
    those it names."""
    ps = params(fn)
    if ps is None or any(p.kind == p.VAR_KEYWORD for p in ps):
        return kwargs
    names = {p.name for p in ps}
    return {k: v for k, v in kwargs.items() if k in names}


def call(fn, args: tuple | list = (), kwargs: dict | None = None, *, names_only: bool = False) -> Any:
    """fn(*args, **kwargs) (only the keywords it names with `names_only`); a coroutine is awaited in
    this thread's own event loop."""
    kwargs = kwargs or {}
    out = fn(*args, **(named(fn, kwargs) if names_only else kwargs))
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def with_deadline(thunk: Callable[[], Any], seconds: float | None, what: str) -> Any:
    """thunk() in a daemon thread, waiting at most `seconds` (None: in this thread, no limit); past it
    a TimeoutError naming `what`. The thread is not stopped (Python cannot), but it does not block
    the exit; its error is raised here."""
    if seconds is None:
        return thunk()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = thunk()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = e

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
