"""The user's code, one way whoever uses it (reward functions, environment classes, tools, agent
programs).

Naming it: the `file.py:name` and `package.module:name` strings of a run file, loaded with errors that
name the key, the file and the line, made absolute so that a resumed run finds the same file from any
directory, and traced to the source files a run fingerprints.

Calling it: with the keyword arguments it names (all of them when it takes **kwargs, as TRL passes
them), awaited when it is an `async def`, and, where a caller asks, with a deadline. (An environment's
deadline is enforced by its worker process, rl/agent/process.py, which can be killed; a thread cannot,
so `with_deadline` only stops waiting.) Imports nothing heavy: environment workers use it."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backstream.checks import UserError


class NotCallableSpec(UserError, TypeError):
    """A spec names something that is not callable: a mistake in the run file (ValueError), of the kind
    Python calls a TypeError."""


def is_path_spec(spec: str) -> bool:
    target, sep, name = spec.rpartition(":")
    return bool(sep and target and name.isidentifier() and target.endswith(".py"))


def is_module_spec(spec: str) -> bool:
    target, sep, name = spec.rpartition(":")
    return bool(sep and target and name.isidentifier() and not target.endswith(".py"))


def load_object(spec: str, key: str) -> Any:
    """The callable a `file.py:name` or `package.module:name` spec names; `key` (the config key or
    "reward spec") opens every error message."""
    target, _, name = spec.rpartition(":")
    if is_path_spec(spec):
        module = _from_file(spec, key, Path(target))
    elif is_module_spec(spec):
        module = _from_module(spec, key, target)
    else:
        raise UserError(f"{key} {spec!r}: expected 'path/to/file.py:name' or 'package.module:name'")
    obj = getattr(module, name, None)
    if obj is None:
        raise UserError(f"{key} {spec!r}: {target!r} has no attribute {name!r}")
    if not callable(obj):
        raise NotCallableSpec(f"{key} {spec!r}: {name!r} is a {type(obj).__name__}, not callable; name a "
                              "function (or a callable object) of that file or module")
    return obj


def _from_file(spec: str, key: str, path: Path):
    if not path.is_file():
        raise UserError(f"{key} {spec!r}: no file {str(path)!r}")
    module_name = f"backstream_user_{path.stem}_{abs(hash(str(path.resolve()))) % 10**8}"
    if module_name in sys.modules:  # the reward and the environment of one file: one module
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise UserError(f"{key} {spec!r}: {where_in(e, path)}") from e
    return module


def _from_module(spec: str, key: str, target: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise UserError(f"{key} {spec!r}: cannot import {target!r} ({e})") from e
    except Exception as e:
        raise UserError(f"{key} {spec!r}: importing {target!r} failed: {where_in(e, None)}") from e


def where_in(e: BaseException, path: Path | None) -> str:
    """An exception raised by a user's code, as `file, line N: Type: message` (the innermost frame
    in `path`, or in any file outside this package when `path` is None)."""
    if isinstance(e, SyntaxError):
        return f"{e.filename}, line {e.lineno}: SyntaxError: {e.msg}"
    here = Path(__file__).resolve().parent
    frame = None
    for f in traceback.extract_tb(e.__traceback__):
        p = Path(f.filename).resolve()
        if (path is not None and p == path.resolve()) or (path is None and here not in p.parents
                                                          and "importlib" not in f.filename):
            frame = f
    where = f"{frame.filename}, line {frame.lineno}: " if frame is not None else ""
    return f"{where}{type(e).__name__}: {e}"


def spec_files(spec: str) -> list[str]:
    """The source file a spec's function comes from, when it is the user's own (a `file.py:fn`, or a
    module outside site-packages): the files a run fingerprints, so that a resume notices a change."""
    target, _, _ = spec.rpartition(":")
    if is_path_spec(spec):
        return [os.path.abspath(target)]
    if is_module_spec(spec):
        found = importlib.util.find_spec(target.split(".")[0]) if target else None
        origin = getattr(importlib.util.find_spec(target), "origin", None) if found is not None else None
        if origin and os.path.isfile(origin) and "site-packages" not in origin and "dist-packages" not in origin \
                and not origin.startswith(os.path.dirname(os.path.abspath(__file__))):
            return [os.path.abspath(origin)]
    return []


def absolute_spec(spec: str) -> str:
    """The spec with a relative file path made absolute (a resumed run finds the same file from
    any directory); other forms as they are."""
    if is_path_spec(spec):
        target, _, name = spec.rpartition(":")
        return f"{os.path.abspath(target)}:{name}"
    if spec.startswith("reward_model:") and os.path.isdir(spec[len("reward_model:"):]):
        return "reward_model:" + os.path.abspath(spec[len("reward_model:"):])
    return spec


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
