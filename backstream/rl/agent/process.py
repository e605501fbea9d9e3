"""Environments in worker processes, where a timeout really stops a tool (docs/design.md §6d).

A Python thread cannot be stopped: a tool that overran `env.tool_timeout_s` in a thread kept running,
kept mutating its environment (whose `get_reward` then scored the damage) and kept the GIL from the
trainer for the rest of the run. So each episode's environment lives in a process of its own: its
`reset`, its tools, its text hook and whatever a reward function reads of it are requests over a pipe,
each with a deadline. A request past its deadline kills the process; the environment is discarded
(nothing can touch it again) and the episode ends with a counted error.

Processes come from a zygote: one clean, single-threaded interpreter per trainer process that has
imported the environments' modules once and forks a worker on request. A new worker costs a fork, not
an interpreter start; none inherits the trainer's threads or memory, and, unlike multiprocessing's
spawn and forkserver, nothing re-imports the user's main script. A `WorkerPool` keeps the processes of
finished episodes and hands them to the next ones; only a killed process is replaced. Workers die
with the zygote and the zygote with the trainer (Linux: PR_SET_PDEATHSIG; elsewhere at their pipe's
end).

What crosses the pipe is pickled: tool arguments (JSON values), tool results (text: a result that is
not text is JSON-encoded, or `str()`-ed where JSON cannot encode it, as TRL does), the values a reward
function reads of an environment. `async def` tools and methods are awaited in the worker.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from backstream import usercode
from backstream.checks import UserError
from backstream.lifetime import die_with_parent, stop
from backstream.usercode import load_object, where_in

STARTUP_TIMEOUT_S = 120.0  # the zygote imports the environments' modules (torch, say) once


class EnvTimeout(Exception):
    """A request to an environment overran its deadline: the worker was killed, the environment is gone."""


class EnvDiscarded(RuntimeError):
    """A request to an environment that was discarded (its worker was killed after a timeout)."""


class RemoteError(Exception):
    """The environment's code raised: str() is `file, line N: Type: text` (specs.where_in); `short` is
    `Type: text`."""

    def __init__(self, where: str, type_name: str, text: str = ""):
        super().__init__(where)
        self.type_name, self.short = type_name, f"{type_name}: {text}"


# -- the worker process -------------------------------------------------------------------------


def as_text(value: Any) -> str:
    """A tool's result as the text the policy reads: text as it is, JSON where JSON encodes it,
    `str()` otherwise (numpy scalars, custom objects: TRL's habit)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _image_bytes(value: Any) -> bytes | None:
    """An image a tool returned, as encoded bytes (a PIL image as PNG; bytes as they are, read by the
    trainer, which refuses what does not decode); None for anything else."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    image_mod = sys.modules.get("PIL.Image")  # a PIL image only where the tool's code imported PIL
    if image_mod is not None and isinstance(value, image_mod.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    return None


def as_result(value: Any) -> tuple[str, list[bytes]]:
    """A tool's result as (the text the policy reads, the images it sees, encoded): a PIL image (or
    encoded image bytes) is an image; a dict with "image" or "images" holds them beside its "text" (or
    "content"); a list of such values and OpenAI-style parts ({"type": "image", "image": ...},
    {"type": "text", "text": ...}) is their text joined and their images in order; anything else is
    text (`as_text`)."""
    one = _image_bytes(value)
    if one is not None:
        return "", [one]
    if isinstance(value, dict) and ("image" in value or "images" in value):
        found = [value["image"]] if "image" in value else list(value["images"] or [])
        images = [_image_bytes(v) for v in found]
        if any(b is None for b in images):
            bad = next(type(v).__name__ for v, b in zip(found, images) if b is None)
            raise TypeError(f"a tool result's image must be a PIL image or encoded image bytes, got {bad}")
        text = value.get("text", value.get("content", ""))
        return as_text(text) if text is not None else "", images
    if isinstance(value, list) and value and any(
            _image_bytes(v) is not None or (isinstance(v, dict) and v.get("type") == "image") for v in value):
        texts, images = [], []
        for v in value:
            if isinstance(v, dict) and v.get("type") == "image":
                v = v.get("image")
            elif isinstance(v, dict) and v.get("type") == "text":
                texts.append(as_text(v.get("text", "")))
                continue
            b = _image_bytes(v)
            if b is None:
                texts.append(as_text(v))
            else:
                images.append(b)
        return "".join(texts), images
    return as_text(value), []


def _serve(conn, factory_spec: str, tool_specs: list[str]) -> None:
    """The worker's loop: one environment at a time (`new` builds it and resets it), requests on it
    until `release`; answers ("ok", value) or ("error", message, type name)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
    factory = load_object(factory_spec, "env.factory") if factory_spec else None
    functions = {f.__name__: f for f in (load_object(s, "env.tools") for s in tool_specs)}
    env, env_id = None, None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op = msg[0]
        if op == "exit":
            return
        try:
            if op == "new":
                _, env_id, row = msg
                env = factory() if factory is not None else None
                out = usercode.call(env.reset, kwargs=row, names_only=True) if env is not None else None
            elif op == "release":
                env, env_id, out = None, None, None
            else:
                if msg[1] != env_id:
                    raise EnvDiscarded("this environment's episode is over (its worker serves another episode now)")
                if op == "tool":
                    _, _, name, args, max_chars = msg
                    fn = functions.get(name) or getattr(env, name)
                    positional = isinstance(args, list)  # the plain format's calls are positional
                    text, images = as_result(usercode.call(fn, args) if positional else usercode.call(fn, kwargs=args))
                    out = (text[:max_chars], len(text), images)
                elif op == "getattr":
                    value = getattr(env, msg[2])
                    out = ("method",) if inspect.ismethod(value) or inspect.isfunction(value) else ("value", value)
                elif op == "method":
                    _, _, name, args, kwargs = msg
                    out = usercode.call(getattr(env, name), args, kwargs)
                else:
                    raise UserError(f"unknown request {op!r}")
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001  (the environment's error goes back as a result)
            conn.send(("error", where_in(e, None), type(e).__name__, str(e)))


def zygote_main(fd: int) -> None:
    """The zygote's loop (`python -c ...` with the control socket's fd): set sys.path, import specs,
    fork workers; answers ("ok", value) or ("error", where, type name, text)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they exit
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        try:
            if msg[0] == "path":
                sys.path[:] = msg[1]
                out = None
            elif msg[0] == "preload":
                for spec in msg[1]:
                    load_object(spec, msg[2])
                out = None
            elif msg[0] == "fork":
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                pid = os.fork()
                if pid == 0:  # the worker
                    sock.close()
                    conn.close()
                    die_with_parent()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    try:
                        _serve(Connection(fds[0]), msg[1], msg[2])
                    finally:
                        os._exit(0)
                os.close(fds[0])
                out = pid
            else:
                raise UserError(f"unknown request {msg[0]!r}")
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001  (an import error of the user's module: back to the trainer)
            conn.send(("error", where_in(e, None), type(e).__name__, str(e)))


class Zygote:
    """The trainer process's zygote (see the module docstring); `get()` starts it once."""

    _the: Zygote | None = None

    def __init__(self):
        ours, theirs = socket.socketpair()
        code = "import sys; from backstream.rl.agent.process import zygote_main; zygote_main(int(sys.argv[1]))"
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.conn = ours, Connection(os.dup(ours.fileno()))
        self.preloaded: set[str] = set()
        self._ask(("path", list(sys.path)), STARTUP_TIMEOUT_S)

    @classmethod
    def get(cls) -> Zygote:
        if cls._the is None or cls._the.proc.poll() is not None:
            cls._the = Zygote()
        return cls._the

    def _ask(self, msg: tuple, timeout: float):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            stop(self.proc)
            raise EnvTimeout(f"the environments' zygote did not answer within {timeout:g} s")
        answer = self.conn.recv()
        if answer[0] == "error":
            raise RemoteError(*answer[1:])
        return answer[1]

    def preload(self, specs: list[str], key: str) -> None:
        """Import the modules of `specs` once, so that every worker forked after has them."""
        todo = [s for s in specs if s and s not in self.preloaded]
        if todo:
            self._ask(("preload", todo, key), STARTUP_TIMEOUT_S)
            self.preloaded.update(todo)

    def fork(self, factory_spec: str, tool_specs: list[str]) -> tuple[int, Connection]:
        """A new worker: its pid and the trainer's end of its pipe."""
        ours, theirs = socket.socketpair()
        self.conn.send(("fork", factory_spec, tool_specs))
        socket.send_fds(self.sock, [b"w"], [theirs.fileno()])
        theirs.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            raise EnvTimeout("the environments' zygote did not fork a worker")
        answer = self.conn.recv()
        if answer[0] == "error":
            raise RemoteError(*answer[1:])
        return answer[1], Connection(ours.detach())


class Worker:
    """One worker process and the trainer's end of its pipe."""

    def __init__(self, factory_spec: str, tool_specs: list[str]):
        self.pid, self.conn = Zygote.get().fork(factory_spec, tool_specs)
        self.alive = True

    def running(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def request(self, msg: tuple, timeout: float) -> Any:
        """Send `msg`, wait for the answer at most `timeout` seconds; raises EnvTimeout (the process
        is killed), RemoteError, or EnvDiscarded."""
        if not self.alive:
            raise EnvDiscarded("this environment was discarded after a request to it timed out")
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            self.kill()
            raise EnvTimeout(f"no answer within {timeout:g} s")
        try:
            answer = self.conn.recv()
        except EOFError:  # the worker died (os._exit in a tool, a segfault, ...)
            self.kill()
            raise RemoteError("the environment's process died", "ProcessDied", "its process died") from None
        if answer[0] == "error":
            if answer[2] == "EnvDiscarded":
                raise EnvDiscarded(answer[3])
            raise RemoteError(*answer[1:])
        return answer[1]

    def kill(self) -> None:
        self.alive = False
        stop(self.pid)  # a child of the zygote, which reaps it
        self.conn.close()

    def close(self) -> None:
        if self.alive:
            try:
                self.conn.send(("exit",))
            except (OSError, ValueError):
                pass
            self.alive = False
            self.conn.close()


class WorkerPool:
    """Worker processes for the environments of one `Environment`: `acquire` a process (an idle one,
    or a new one), `release` it when its episode is scored; a killed process is not reused."""

    def __init__(self, factory_spec: str, tool_specs: list[str]):
        self.factory_spec, self.tool_specs = factory_spec, list(tool_specs)
        self.idle: list[Worker] = []
        # the zygote starts now, in the thread that builds the environment (the trainer's): Linux ties
        # its PR_SET_PDEATHSIG to the thread that forked it, not the process, and an asynchronous run
        # starts its episodes' environments from threads that end (the zygote and every worker died
        # with the first such thread)
        Zygote.get()

    def acquire(self) -> Worker:
        while self.idle:
            w = self.idle.pop()
            if w.alive and w.running():
                return w
        zygote = Zygote.get()
        zygote.preload([self.factory_spec], "env.factory")
        zygote.preload(self.tool_specs, "env.tools")
        return Worker(self.factory_spec, self.tool_specs)

    def release(self, w: Worker, timeout: float) -> None:
        if not w.alive:
            return
        try:
            w.request(("release",), timeout)
        except (EnvTimeout, RemoteError, EnvDiscarded):
            w.kill()
            return
        self.idle.append(w)

    def close(self) -> None:
        for w in self.idle:
            w.close()
        self.idle = []


_NEXT_ID = [0]


class EnvHandle:
    """The trainer's side of one episode's environment: what its sampler and its reward functions see.

    Reading an attribute asks the worker (a method comes back as a function that calls it there), so a
    reward function written for TRL (`env.get_reward()`, `env.reward`, `env._counter`) runs unchanged.
    Every request has the deadline `timeout`; one that overruns it kills the worker and `discarded`
    turns True: the episode ends there, and reading the environment afterwards raises EnvDiscarded.
    """

    def __init__(self, pool: WorkerPool, timeout: float, class_name: str):
        _NEXT_ID[0] += 1
        object.__setattr__(self, "_state", {"pool": pool, "worker": pool.acquire(), "id": _NEXT_ID[0],
                                            "timeout": timeout, "class_name": class_name, "released": False})

    @property
    def discarded(self) -> bool:
        """True once a request to the environment timed out (its worker was killed)."""
        return not self._state["worker"].alive and not self._state["released"]

    def _request(self, msg: tuple, timeout: float | None = None) -> Any:
        st = self._state
        if st["released"]:
            raise EnvDiscarded(f"the {st['class_name']} environment of a finished episode was released")
        return st["worker"].request(msg, st["timeout"] if timeout is None else timeout)

    def reset(self, row: dict) -> Any:
        return self._request(("new", self._state["id"], row))

    def tool(self, name: str, arguments: dict | list, max_chars: int) -> tuple[str, int, list[bytes]]:
        """(the result as text, cut at `max_chars`; the length of the whole text; its images, encoded:
        `as_result`)."""
        return self._request(("tool", self._state["id"], name, arguments, max_chars))

    def call_method(self, name: str, *args, **kwargs) -> Any:
        return self._request(("method", self._state["id"], name, args, kwargs))

    @property
    def released(self) -> bool:
        """Whether its worker went back to the pool (`release`)."""
        return self._state["released"]

    def release(self) -> None:
        st = self._state
        if not st["released"]:
            st["released"] = True
            st["pool"].release(st["worker"], st["timeout"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        st = self._state
        if self.discarded:
            raise EnvDiscarded(f"the {st['class_name']} environment was discarded after a request to it overran "
                               f"env.tool_timeout_s = {st['timeout']}; its episode ended with an error. A reward "
                               "function can test `env.discarded` first")
        try:
            out = self._request(("getattr", st["id"], name))
        except RemoteError as e:
            if e.type_name == "AttributeError":
                raise AttributeError(str(e)) from None
            raise
        if out[0] == "value":
            return out[1]
        return lambda *args, **kwargs: self.call_method(name, *args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the {self._state['class_name']} environment lives in a worker process; its "
                             f"attribute {name!r} cannot be set from the trainer")

    def __repr__(self) -> str:
        st = self._state
        state = "discarded" if self.discarded else "released" if st["released"] else "live"
        return f"<{st['class_name']} environment in a worker process ({state})>"


def wait_dead(handle: EnvHandle, seconds: float = 5.0) -> bool:
    """True once the handle's worker process has exited (tests: a killed tool stops for real)."""
    worker = handle._state["worker"]
    end = time.monotonic() + seconds
    while worker.running() and time.monotonic() < end:
        time.sleep(0.01)
    return not worker.running()
