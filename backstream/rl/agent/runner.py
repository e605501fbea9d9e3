"""Running the user's agent program for one episode (issue 34, docs/agentic.md): a Python function
(`[env] agent = "file.py:function"`), sync or async, called as `function(base_url, api_key, model,
row)`; or a program (`[env] agent_command = "..."`) started per episode with OPENAI_BASE_URL,
OPENAI_API_KEY and OPENAI_MODEL set and the task's row as JSON on stdin. Either may give a reward:
the function's return value (a number or None), the program's last line of output when it is a
number.

An agent that raises, exits non-zero or overruns its time ends its episode with an error (its reward
0, counted by the caller); a program that overran is killed with its whole process group (its
children too), and a function's thread is left to fail on its next request, which the endpoint
refuses once the episode is finished. A program runs under the guard of backstream/lifetime.py, which ends
its process group once the trainer is gone however it ended (kill -9 included).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from backstream import usercode
from backstream.lifetime import guarded, kill_group


@dataclass
class AgentResult:
    """How an agent's episode ended: its reward (None: it gave none), the error that ended it (None:
    it finished), whether it overran its time, and its seconds."""

    reward: float | None
    error: str | None
    timed_out: bool
    seconds: float


def _reward(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} returned {value!r}; an agent's reward is a finite number or None")
    return float(value)


def run_function(fn, base_url: str, api_key: str, model: str, row: dict, timeout: float) -> AgentResult:
    """`fn(base_url, api_key, model, row)` (awaited if it is a coroutine function), at most `timeout`
    seconds."""
    t0 = time.monotonic()
    name = getattr(fn, "__name__", "the agent")
    try:
        value = usercode.with_deadline(lambda: usercode.call(fn, (base_url, api_key, model, dict(row))), timeout,
                                       f"env.agent {name}")
        return AgentResult(_reward(value, f"env.agent {name}"), None, False, time.monotonic() - t0)
    except TimeoutError as e:
        return AgentResult(None, f"{e} (env.agent_timeout_s)", True, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001  (the user's agent failed: its episode ends, the run goes on)
        return AgentResult(None, f"env.agent {name} raised {type(e).__name__}: {e}", False, time.monotonic() - t0)


def run_command(command: str, base_url: str, api_key: str, model: str, row: dict, timeout: float) -> AgentResult:
    """`command` (a shell command line) with the episode's OPENAI_* variables and `row` as JSON on stdin,
    at most `timeout` seconds; past it its process group is killed."""
    t0 = time.monotonic()
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model}
    proc, lifeline = guarded(sys.executable, ["/bin/sh", "-c", command], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(json.dumps(row, default=str), timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return AgentResult(None, f"env.agent_command did not exit within {timeout} s (env.agent_timeout_s); its "
                                 "process group was killed", True, time.monotonic() - t0)
    finally:
        kill_group(proc)  # children it left behind
        os.close(lifeline)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = [line for line in (err or "").strip().splitlines() if not line.startswith("backstream guard:")][-3:]
        return AgentResult(None, f"env.agent_command exited with code {proc.returncode}"
                                 f"{': ' + ' / '.join(tail) if tail else ''}", False, seconds)
    lines = [line.strip() for line in (out or "").splitlines() if line.strip()]
    try:
        reward = float(lines[-1]) if lines else None
        reward = reward if reward is None or math.isfinite(reward) else None
    except ValueError:
        reward = None  # its last line is no number: it gave no reward
    return AgentResult(reward, None, False, seconds)
