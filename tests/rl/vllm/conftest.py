"""One `backstream vllm serve default` server for the session's tests that can share it (a server of
your own: runs connect with vllm.url and publish their weights to it first, so none sees another's).
The tests about what a run's own server does (its start-up, its context, its death) start their own."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import KEY, children, vllm_python


@pytest.fixture(scope="session")
def vllm_served(tmp_path_factory):
    """`backstream vllm serve default --api-key KEY` in a session of its own, its cwd elsewhere than the
    tests' (test_a_run_folder_the_server_cannot_see_is_refused); killed outright (SIGKILL) after the
    session, which must leave nothing of the server behind: it runs under the guard a run's server has.
    Yields (url, the command's process)."""
    from backstream.rl.vllm.server import _group_alive, free_port

    cwd = tmp_path_factory.mktemp("serve-cwd")
    port = free_port()
    out = open(cwd / "serve.log", "w+")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "backstream", "vllm", "serve", "default", "--port", str(port),
                             "--api-key", KEY, "--python", vllm_python()], cwd=cwd, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while f'url = "{url}"' not in (cwd / "serve.log").read_text():  # printed once it answers
            assert proc.poll() is None and time.monotonic() - t0 < 300, (cwd / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield url, proc
    finally:
        guards = children(proc.pid)  # the guard leads the server's own process group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert len(guards) == 1
    deadline = time.monotonic() + 30
    while _group_alive(guards[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(guards[0])  # the API server, its engine and worker: gone with the command
