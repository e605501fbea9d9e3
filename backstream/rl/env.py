"""`[env]`: the environment of an agentic episode, in TRL's habit (DESIGN §6d), so that an environment
written for TRL's GRPOTrainer (`environment_factory`) runs here unchanged where it uses only this:

- `factory = "file.py:Class"` (or `"module:Class"`): one instance per episode, built with no argument.
  `reset(**row) -> str | None` is called with the row's columns; text it returns is appended to the
  task's first user message. Every other public method is a tool: its JSON schema comes from
  transformers' `get_json_schema` (type hints and a docstring with an Args section), its return value
  (text, or anything JSON can encode) is the tool result. An optional `get_reward() -> float` is read
  by the built-in reward `env`. A `step(text) -> str | None` (its one parameter named `text`) is not a
  tool but the text environment's hook: called with a turn that made no tool call, it returns the next
  user message, or None to end the episode (games, feedback loops).
- `tools = ["file.py:fn", ...]`: stateless function tools, beside or instead of a class.

Limits: `env.max_turns` sampled turns, `rollout.max_new_tokens` per turn, `env.max_episode_tokens` for
the whole episode, `env.tool_timeout_s` per tool call. A malformed tool call, an unknown tool or a tool
that raises becomes an error message as the tool result (the policy sees it, the metrics count it); a
tool that hangs is stopped by its timeout (its result: an error); an environment whose `reset` raises
stops the step with an error naming the class and the row.
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from backstream.checks import at_least, choice
from backstream.rl.specs import load_object, where_in

FORMATS = ("auto", "chat", "plain")  # how turns become tokens: rl/turns.py


@dataclass(kw_only=True)
class EnvConfig:
    factory: str = ""
    """The environment class, "file.py:Class" or "package.module:Class" (one instance per episode;
    its public methods are tools, reset(**row) starts an episode); "" = none."""
    tools: list[str] = field(default_factory=list)
    """Stateless function tools, "file.py:fn" or "package.module:fn" (type hints and a docstring)."""
    max_turns: int = 8
    """Most sampled turns per episode (a turn: the policy's tokens up to its end of turn)."""
    max_episode_tokens: int = 0
    """Most tokens of an episode, prompt included; 0 = the model's context."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take; a tool that takes longer returns an error to the policy."""
    format: str = "auto"
    """How a turn becomes tokens: "chat" (the tokenizer's chat template, tools= schemas, Hermes/Qwen
    <tool_call> blocks or the tokenizer's response parser), "plain" (the default model's text format:
    a call is a turn "[name arg ...]", its result "\\n=result\\n"), "auto" = chat when the tokenizer
    has a chat template."""

    def __post_init__(self):
        for key in ("factory",):
            v = getattr(self, key)
            if not isinstance(v, str):
                raise ValueError(f"env.{key}: got {v!r}, expected a 'file.py:Class' string (or \"\")")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) and t for t in self.tools):
            raise ValueError(f"env.tools: got {self.tools!r}, expected a list of 'file.py:function' strings")
        at_least("env.max_turns", self.max_turns, 1)
        at_least("env.max_episode_tokens", self.max_episode_tokens, 0)
        if not (isinstance(self.tool_timeout_s, (int, float)) and self.tool_timeout_s > 0):
            raise ValueError(f"env.tool_timeout_s: got {self.tool_timeout_s!r}, expected a number of seconds > 0")
        choice("env.format", self.format, list(FORMATS))

    @property
    def enabled(self) -> bool:
        return bool(self.factory or self.tools)


class EnvError(ValueError):
    """An environment that cannot start an episode (its class, or `reset` on a row, failed)."""


@dataclass
class ToolCall:
    name: str
    arguments: dict | list  # keyword arguments, or positional ones (the plain format)
    error: str | None = None  # a malformed call: what was wrong (the tool is not called)


class Environment:
    """What an episode's environment offers the sampler, built from `[env]` (`load`): a fresh
    instance per episode (`new`), the tools' schemas for the prompt, `call` with errors turned into
    results, and the text hook `step`."""

    def __init__(self, cfg: EnvConfig, factory=None, functions: list | None = None):
        self.cfg, self.factory, self.functions = cfg, factory, list(functions or [])
        probe = factory() if factory is not None else None
        self.name = type(probe).__name__ if probe is not None else "tools"
        self.tool_names = [f.__name__ for f in self.functions] + [n for n, _ in _methods(probe)]
        dupes = {n for n in self.tool_names if self.tool_names.count(n) > 1}
        if dupes:
            raise ValueError(f"env: two tools are named {sorted(dupes)} (env.tools and {self.name}'s methods); "
                             "rename one")
        self.schemas = [_schema(f, f"env.tools {f.__name__}") for f in self.functions]
        self.schemas += [_schema(m, f"env.factory {self.name}.{n}") for n, m in _methods(probe)]
        self.has_step = probe is not None and _text_hook(probe) is not None

    @classmethod
    def load(cls, cfg: EnvConfig) -> Environment:
        factory = load_object(cfg.factory, "env.factory") if cfg.factory else None
        functions = [load_object(spec, "env.tools") for spec in cfg.tools]
        if factory is not None:
            try:
                probe = factory()
            except Exception as e:  # noqa: BLE001  (the user's class: named, with its file and line)
                raise EnvError(f"env.factory: {cfg.factory} could not be built with no argument: "
                               f"{where_in(e, None)}") from e
            if not callable(getattr(probe, "reset", None)):
                raise EnvError(f"env.factory: {type(probe).__name__} has no reset(**row) method; an environment "
                               "needs one (it may return None)")
        return cls(cfg, factory, functions)

    def new(self, row: dict, index: int) -> tuple[Any, str | None]:
        """A fresh instance for one episode of `row` (the `index`-th row of the data) and the text its
        reset returned (None: nothing to append)."""
        if self.factory is None:
            return None, None
        env = self.factory()
        try:
            out = _call_with_names(env.reset, row)
        except Exception as e:  # noqa: BLE001
            prompt = str(row.get("prompt", ""))[:80]
            raise EnvError(f"env.factory: {type(env).__name__}.reset raised on row {index} (prompt {prompt!r}): "
                           f"{where_in(e, None)}") from e
        if out is not None and not isinstance(out, str):
            raise EnvError(f"env.factory: {type(env).__name__}.reset returned a {type(out).__name__} on row {index}; "
                           "expected text to append to the task, or None")
        return env, out

    def call(self, env, call: ToolCall) -> tuple[str, bool, float]:
        """Run one tool call: (the result as text, whether it failed, seconds it took). An error (a
        malformed call, an unknown tool, a raise, a timeout) is a result that says so."""
        import time  # noqa: PLC0415

        if call.error is not None:
            return f"error: {call.error}", True, 0.0
        fn = self._tool(env, call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; the tools are {self.tool_names}", True, 0.0
        t = time.perf_counter()
        box: dict = {}

        def target():
            try:
                args = call.arguments
                box["value"] = fn(*args) if isinstance(args, list) else fn(**args)
            except BaseException as e:  # noqa: BLE001  (becomes the tool result)
                box["error"] = e

        thread = threading.Thread(target=target, name=f"tool:{call.name}", daemon=True)
        thread.start()
        thread.join(self.cfg.tool_timeout_s)
        seconds = time.perf_counter() - t
        if thread.is_alive():
            return f"error: {call.name} did not return within env.tool_timeout_s={self.cfg.tool_timeout_s}", True, \
                seconds
        if "error" in box:
            e = box["error"]
            return f"error: {call.name} raised {type(e).__name__}: {e}", True, seconds
        value = box.get("value")
        if isinstance(value, str):
            return value, False, seconds
        try:
            return json.dumps(value), False, seconds
        except TypeError:
            return f"error: {call.name} returned a {type(value).__name__}, which is neither text nor JSON", True, \
                seconds

    def step(self, env, text: str) -> str | None:
        """The text environment's next user message after a turn without a tool call (None: the end)."""
        hook = _text_hook(env) if env is not None else None
        if hook is None:
            return None
        out = hook(text)
        if out is not None and not isinstance(out, str):
            raise EnvError(f"env.factory: {type(env).__name__}.step returned a {type(out).__name__}; expected the "
                           "next user message (text) or None to end the episode")
        return out

    def _tool(self, env, name: str):
        for f in self.functions:
            if f.__name__ == name:
                return f
        return dict(_methods(env)).get(name) if env is not None else None


def _text_hook(env):
    """env.step when it is the text hook: a method whose one parameter is named `text`."""
    step = getattr(env, "step", None)
    if not inspect.ismethod(step):
        return None
    params = list(inspect.signature(step).parameters)
    return step if params == ["text"] else None


def _methods(env) -> list[tuple[str, Any]]:
    """The instance's tools: its public methods but reset, get_reward and the text hook."""
    if env is None:
        return []
    hook = _text_hook(env)
    return [(n, m) for n, m in inspect.getmembers(env, predicate=inspect.ismethod)
            if not n.startswith("_") and n not in ("reset", "get_reward") and not (hook is not None and n == "step")]


def _schema(fn, what: str) -> dict:
    from transformers.utils import get_json_schema  # noqa: PLC0415

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001  (transformers' DocstringParsingException / TypeHintParsingException)
        raise ValueError(f"{what} is a tool, but transformers cannot describe it ({type(e).__name__}: {e}); give it "
                         "type hints and a docstring with an Args: section (or, for a method that is no tool, a name "
                         "that starts with _)") from None


def _call_with_names(fn, row: dict):
    """fn(**row), or with only the columns it names when it takes no **kwargs (as TRL would fail on)."""
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        row = {k: v for k, v in row.items() if k in {p.name for p in params}}
    return fn(**row)
