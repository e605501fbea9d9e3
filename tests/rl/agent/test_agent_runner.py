"""The user's agent program for an episode (rl/agent/runner.py): a function, sync or async, or a
command, talking to the endpoint with the `openai` client; its reward; an agent that raises, exits
non-zero or hangs ends its episode with an error, and a hung program is killed with its children."""

import os
import sys
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from agents_for_tests import Scripted, async_agent, calculator_agent, raising_agent, sleeping_agent

from backstream.default_model import load_default
from backstream.rl.agent.endpoint import Endpoint
from backstream.rl.agent.runner import run_command, run_function
from backstream.rl.agent.turns import PlainFormat

ROW = {"prompt": "12+34+56=", "answer": "102", "task": "toolcalc"}


@pytest.fixture
def endpoint():
    tok = load_default()[1]
    policy = Scripted(tok, ["[add 12 34]", "[add 46 56]", "102"] * 4)
    ep = Endpoint(lambda tools: PlainFormat(tok, tools), policy, tok.eos_token_id, max_new_tokens=32)
    ep.start()
    yield ep
    ep.stop()


@pytest.mark.parametrize("agent, reward", [(calculator_agent, 1.0), (async_agent, 0.5)])
def test_a_function_agent_plays_its_episode_and_returns_its_reward(endpoint, agent, reward):
    s = endpoint.open()
    out = run_function(agent, s.base_url, s.key, "policy", ROW, timeout=30)
    assert out.error is None and not out.timed_out and out.reward == reward
    assert s.transcript.requests == (3 if agent is calculator_agent else 1)


def test_an_agent_that_raises_or_hangs_ends_its_episode_with_an_error(endpoint):
    s = endpoint.open()
    out = run_function(raising_agent, s.base_url, s.key, "policy", ROW, timeout=30)
    assert out.reward is None and "raising_agent raised KeyError" in out.error
    t0 = time.monotonic()
    out = run_function(sleeping_agent, s.base_url, s.key, "policy", ROW, timeout=0.5)
    assert out.timed_out and "did not return within 0.5 s" in out.error and time.monotonic() - t0 < 5


@pytest.mark.slow
def test_a_command_agent_gets_the_episode_in_its_environment_and_prints_its_reward(endpoint, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(__file__)))!r})\n"
        "from agents_for_tests import calculator_agent\n"
        "row = json.load(sys.stdin)\n"
        "print('working...')\n"
        "print(calculator_agent(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY'],\n"
        "                       os.environ['OPENAI_MODEL'], row))\n")
    s = endpoint.open()
    out = run_command(f"{sys.executable} {script}", s.base_url, s.key, "policy", ROW, timeout=60)
    assert out.error is None and out.reward == 1.0 and s.transcript.requests == 3
    out = run_command(f"{sys.executable} -c 'import sys; print(\"oops\", file=sys.stderr); sys.exit(3)'",
                      s.base_url, s.key, "policy", ROW, timeout=60)
    assert out.reward is None and out.error == "env.agent_command exited with code 3: oops"
    out = run_command("echo no reward here", s.base_url, s.key, "policy", ROW, timeout=60)
    assert out.error is None and out.reward is None


@pytest.mark.slow
def test_a_hung_command_is_killed_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    out = run_command(f"sleep 60 & echo $! > {pids}; sleep 60", "http://127.0.0.1:9/v1", "k", "policy", ROW,
                      timeout=1)
    assert out.timed_out and "process group was killed" in out.error
    if not _gone(int(pids.read_text()), seconds=5):
        pytest.fail("the agent's child outlived it")


def _gone(pid: int, seconds: float) -> bool:
    """Whether process `pid` ends within `seconds` (it is killed if it does not)."""
    for _ in range(int(seconds / 0.05)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.kill(pid, 9)
    return False


@pytest.mark.slow
def test_a_command_does_not_outlive_a_trainer_killed_outright(tmp_path):
    """kill -9 of the process that started an agent command (no clean-up runs): its guard ends the
    command's process group, its children too."""
    import signal
    import subprocess

    pids = tmp_path / "pids"
    command = f"sleep 60 & echo $! > {pids}; sleep 60"
    script = (f"import sys; sys.path[:0] = {sys.path!r}\n"
              "from backstream.rl.agent.runner import run_command\n"
              f"run_command({command!r}, 'http://127.0.0.1:9/v1', 'k', 'policy', {{}}, 300)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script])
    for _ in range(200):
        if pids.exists() and pids.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pids.read_text())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    if not _gone(child, seconds=10):
        pytest.fail("the agent's child outlived the killed trainer")
