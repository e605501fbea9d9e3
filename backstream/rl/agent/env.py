"""`[env]`: the environment of an agentic episode, in TRL's habit (docs/design.md §6d), so that an
environment written for TRL's GRPOTrainer (`environment_factory`) runs here unchanged where it uses only
this:

- `factory = "file.py:Class"` (or `"module:Class"`): one instance per episode, built with no argument.
  `reset(**row) -> str | None` is called with the row's columns; text it returns is appended to the
  task's last user message (TRL's place), or is the whole prompt of a row without a `prompt` column
  (an environment that owns its data). Every other public method is a tool: its JSON schema comes
  from transformers' `get_json_schema` (type hints and a docstring with an Args section), its return
  value is the tool result (text as it is, JSON where JSON encodes it, `str()` otherwise; an image, or
  a dict with "image" and "text", is an image the policy sees: `env.images`); `async def`
  tools are awaited. An optional `get_reward() -> float` (or `async def`) is the built-in reward
  `env`, added with weight 1 when `reward.functions` does not name it. An optional
  `env_response(text) -> str | None` is no tool but the text environment's hook: called with a turn
  that made no tool call, it returns the next user message, or None to end the episode (games,
  feedback loops). A method named `step` is a tool like any other.
- `tools = ["file.py:fn", ...]`: stateless function tools, beside or instead of a class.

Every episode's environment lives in a worker process of its own (rl/agent/process.py), so that
`env.tool_timeout_s` really stops a tool or a `reset`: the worker is killed, the environment discarded,
the episode ends with a counted error. One instance is built in the trainer's own process, once,
before the run (`Environment.load` checks that the class builds with no argument and has a `reset`):
a constructor runs there with no time limit. Limits: `env.max_turns` sampled turns,
`rollout.max_new_tokens` per turn, `env.max_episode_tokens` for the whole episode,
`env.max_result_tokens` per tool result (longer ones are cut, with a marker the policy sees). An
episode that reaches a limit right after a tool call does not run the call: the policy's call is its
last message. A malformed tool call, an unknown tool or a tool that raises becomes an error message as
the tool result (the policy sees it, the metrics count it); an environment whose `reset` raises or
overruns stops the step with an error naming the class and the row.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from backstream.checks import UserError, at_least, literals
from backstream.rl.agent.process import EnvHandle, EnvTimeout, RemoteError, WorkerPool, as_result
from backstream.usercode import load_object, where_in

TEXT_HOOK = "env_response"  # the text environment's hook: not a tool
NOT_TOOLS = ("reset", "get_reward", TEXT_HOOK)
CHARS_PER_TOKEN = 32  # a worker sends at most env.max_result_tokens × this many characters of a result


@dataclass(kw_only=True)
class EnvConfig:
    factory: str = ""
    """The environment class, "file.py:Class" or "package.module:Class" (one instance per episode, in a
    worker process; its public methods are tools, reset(**row) starts an episode); "" = none."""
    tools: list[str] = field(default_factory=list)
    """Stateless function tools, "file.py:fn" or "package.module:fn" (type hints and a docstring)."""
    max_turns: int = 8
    """Most sampled turns per episode (a turn: the policy's tokens up to its end of turn)."""
    max_episode_tokens: int = 0
    """Most tokens of an episode, prompt included; 0 = the model's context."""
    max_result_tokens: int = 2048
    """Most tokens of one tool result; a longer one is cut and ends with a marker the policy reads
    ("[... N more characters cut]"), and the cut is counted (episode/results_cut)."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call, reset, text hook or read of the environment may take; past it the
    environment's worker process is killed, the environment discarded and its episode ended (a
    counted error; a reset that overruns stops the step)."""
    format: Literal["auto", "chat", "plain"] = "auto"
    """How a turn becomes tokens: "chat" (the tokenizer's chat template, tools= schemas, Hermes/Qwen
    <tool_call> blocks or the tokenizer's response parser), "plain" (the default model's text format:
    a call is a turn "[name arg ...]", its result "\\n=result\\n"), "auto" = chat when the tokenizer
    has a chat template."""
    chat_template: str = ""
    """A chat template to use instead of the tokenizer's (a .jinja file, or the template itself): for
    a family whose stock template renders earlier turns differently once a conversation goes on
    (Qwen3's drops earlier reasoning), which the start-up check refuses (an agent program's episodes
    take any template: a rewritten history is a branch). "" = the tokenizer's."""
    images: bool = False
    """The environment's tools (or its env_response), or an agent program's requests (`image_url`
    parts with data URLs), hold images, a screenshot each turn: the policy is loaded as a
    vision-language model (its image-text class and processor) even where the data holds none. A tool
    result is an image when it is a PIL image, a dict with "image" (or "images") beside its "text",
    or a list of images and text parts; with images in the data this is implied."""
    agent: str = ""
    """An agent program to train, "file.py:function" or "module:function": called per episode as
    function(base_url, api_key, model, row) (sync or async) against the run's OpenAI-compatible
    endpoint; its return value (a number, or None) is the reward "env" (rl/rollout/programs.py). "" = none."""
    agent_command: str = ""
    """An agent program to train, as a shell command started per episode with OPENAI_BASE_URL,
    OPENAI_API_KEY and OPENAI_MODEL set and the task's row as JSON on stdin; its last line of output, if
    a number, is the reward "env". "" = none."""
    agent_timeout_s: float = 300.0
    """Seconds an agent program's episode may take; past it the episode ends with reward 0 (counted:
    episode/agent_timeouts) and a program is killed with its children."""

    def __post_init__(self):
        for key in ("factory", "chat_template", "agent", "agent_command"):
            v = getattr(self, key)
            if not isinstance(v, str):
                raise UserError(f"env.{key}: got {v!r}, expected a string (or \"\")")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) and t for t in self.tools):
            raise UserError(f"env.tools: got {self.tools!r}, expected a list of 'file.py:function' strings")
        at_least("env.max_turns", self.max_turns, 1)
        at_least("env.max_episode_tokens", self.max_episode_tokens, 0)
        at_least("env.max_result_tokens", self.max_result_tokens, 1)
        for key in ("tool_timeout_s", "agent_timeout_s"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise UserError(f"env.{key}: got {v!r}, expected a number of seconds > 0")
        if self.agent and self.agent_command:
            raise UserError("env.agent and env.agent_command: both are set; an episode runs one agent program, "
                            "give one of them")
        if self.program and (self.factory or self.tools):
            raise UserError(f"env.{'agent' if self.agent else 'agent_command'}: an agent program runs its own tools "
                            "and calls the run's endpoint; env.factory / env.tools run tools inside the trainer's "
                            "own episodes; set one or the other")
        if self.agent and ":" not in self.agent:
            raise UserError(f"env.agent: got {self.agent!r}, expected \"file.py:function\" or \"module:function\"")
        literals(self, "env")

    @property
    def enabled(self) -> bool:
        """Whether the trainer plays episodes against an environment of its own (factory or tools)."""
        return bool(self.factory or self.tools)

    def token_limit(self, context: int | None) -> int | None:
        """An episode's most tokens, prompt included: the lower of env.max_episode_tokens and the model's
        `context` (0 / None: no limit from it); None without either."""
        return min(filter(None, (self.max_episode_tokens, context)), default=None)

    @property
    def program(self) -> bool:
        """Whether episodes are an agent program's (env.agent or env.agent_command)."""
        return bool(self.agent or self.agent_command)


class EnvError(UserError):
    """An environment that cannot start an episode (its class, or `reset` on a row, failed)."""


@dataclass
class ToolCall:
    name: str
    arguments: dict | list  # keyword arguments, or positional ones (the plain format)
    error: str | None = None  # a malformed call: what was wrong (the tool is not called)


class ToolResult(NamedTuple):
    content: str  # what the policy reads (an error says so)
    failed: bool  # a malformed call, an unknown tool, a raise, a timeout
    seconds: float
    length: int  # characters of the whole result (more than len(content) when the worker cut it)
    timed_out: bool = False  # the environment was discarded: its episode ends here
    images: tuple = ()  # the images it returned, encoded (process.py `as_result`): a screenshot


class Environment:
    """What an episode's environment offers the sampler, built from `[env]` (`load`): a fresh
    instance per episode in a worker process (`new`), the tools' schemas for the prompt, `call` with
    errors turned into results, and the text hook `respond`."""

    def __init__(self, cfg: EnvConfig, factory=None, functions: list | None = None):
        self.cfg, self.functions = cfg, list(functions or [])
        probe = factory() if factory is not None else None
        self.name = type(probe).__name__ if probe is not None else "tools"
        self.tool_names = [f.__name__ for f in self.functions] + [n for n, _ in _methods(probe)]
        dupes = {n for n in self.tool_names if self.tool_names.count(n) > 1}
        if dupes:
            raise UserError(f"env: two tools are named {sorted(dupes)} (env.tools and {self.name}'s methods); "
                             "rename one")
        self.schemas = [_schema(f, f"env.tools {f.__name__}") for f in self.functions]
        self.schemas += [_schema(m, f"env.factory {self.name}.{n}") for n, m in _methods(probe)]
        self.has_response = probe is not None and callable(getattr(probe, TEXT_HOOK, None))
        self.has_reward = probe is not None and callable(getattr(probe, "get_reward", None))
        self.pool = WorkerPool(cfg.factory, cfg.tools)

    @classmethod
    def load(cls, cfg: EnvConfig) -> Environment:
        factory = load_object(cfg.factory, "env.factory") if cfg.factory else None
        functions = [load_object(spec, "env.tools") for spec in cfg.tools]
        if factory is not None:
            try:
                probe = factory()
            except Exception as e:
                raise EnvError(f"env.factory: {cfg.factory} could not be built with no argument: "
                               f"{where_in(e, None)}") from e
            if not callable(getattr(probe, "reset", None)):
                raise EnvError(f"env.factory: {type(probe).__name__} has no reset(**row) method; an environment "
                               "needs one (it may return None)")
        return cls(cfg, factory, functions)

    def new(self, row: dict, index: int) -> tuple[EnvHandle, str | None]:
        """A fresh instance for one episode of `row` (the `index`-th row of the data), in a worker
        process, and the text its reset returned (None: nothing to append)."""
        env = EnvHandle(self.pool, self.cfg.tool_timeout_s, self.name)
        prompt = str(row.get("prompt", ""))[:80]
        try:
            out = env.reset(row)
        except EnvTimeout:
            raise EnvError(f"env.factory: {self.name}.reset did not return within env.tool_timeout_s = "
                           f"{self.cfg.tool_timeout_s} on row {index} (prompt {prompt!r}); its worker was stopped. "
                           "Raise env.tool_timeout_s or make reset faster") from None
        except RemoteError as e:
            raise EnvError(f"env.factory: {self.name}.reset raised on row {index} (prompt {prompt!r}): {e}") from None
        if out is not None and not isinstance(out, str):
            env.release()
            raise EnvError(f"env.factory: {self.name}.reset returned a {type(out).__name__} on row {index}; "
                           "expected text to append to the task, or None")
        return env, out

    def call(self, env: EnvHandle, call: ToolCall) -> ToolResult:
        """Run one tool call in the episode's worker. An error (a malformed call, an unknown tool, a
        raise, a timeout) is a result that says so; after a timeout the environment is discarded."""
        if call.error is not None:
            return ToolResult(f"error: {call.error}", True, 0.0, 0)
        if call.name not in self.tool_names:
            return ToolResult(f"error: unknown tool {call.name!r}; the tools are {self.tool_names}", True, 0.0, 0)
        t = time.perf_counter()
        try:
            text, length, images = env.tool(call.name, call.arguments, self.cfg.max_result_tokens * CHARS_PER_TOKEN)
        except EnvTimeout:
            return ToolResult(f"error: {call.name} did not return within env.tool_timeout_s={self.cfg.tool_timeout_s}",
                              True, time.perf_counter() - t, 0, timed_out=True)
        except RemoteError as e:
            return ToolResult(f"error: {call.name} raised {e.short}", True, time.perf_counter() - t, 0)
        return ToolResult(text, False, time.perf_counter() - t, length, images=tuple(images))

    def respond(self, env: EnvHandle, text: str) -> tuple[str | None, bool]:
        """The text environment's next user message after a turn without a tool call (None: the end),
        and whether the hook overran its time (the environment is then discarded). A message with
        images comes as (its text, its images encoded) in place of the text (process.py `as_result`)."""
        if not self.has_response:
            return None, False
        try:
            out = env.call_method(TEXT_HOOK, text)
        except EnvTimeout:
            return None, True
        except RemoteError as e:
            raise EnvError(f"env.factory: {self.name}.{TEXT_HOOK} raised: {e}") from None
        if out is None or isinstance(out, str):
            return out, False
        try:
            text, images = as_result(out)
        except TypeError as e:
            raise EnvError(f"env.factory: {self.name}.{TEXT_HOOK}: {e}") from None
        if not images:
            raise EnvError(f"env.factory: {self.name}.{TEXT_HOOK} returned a {type(out).__name__}; expected the "
                           "next user message (text, or an image or a dict with \"image\" and \"text\") or None "
                           "to end the episode")
        return (text, images), False

    def close(self) -> None:
        self.pool.close()


def _methods(env) -> list[tuple[str, object]]:
    """The instance's tools: its public methods but reset, get_reward and the text hook."""
    if env is None:
        return []
    return [(n, m) for n, m in inspect.getmembers(env, predicate=inspect.ismethod)
            if not n.startswith("_") and n not in NOT_TOOLS]


def _schema(fn, what: str) -> dict:
    from transformers.utils import get_json_schema  # noqa: PLC0415

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001  (transformers' DocstringParsingException / TypeHintParsingException)
        raise UserError(f"{what} is a tool, but transformers cannot describe it ({type(e).__name__}: {e}); give it "
                         "type hints and a docstring with an Args: section (or, for a method that is no tool, a name "
                         "that starts with _)") from None
