"""Two `backstream vllm serve default` servers for the session's tests that can share them (servers of your
own: runs connect with vllm.urls and publish their weights to them first, so none sees another's): the
pool that runs of several servers are tested on (LoRA-enabled, rank 8, so that a LoRA policy's runs take
them too). The tests about what a run's own servers do (their start-up, their context, their death and
restart) start their own. `served_by`: a `Served` (tests/vllm_helpers.py) over them."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from helpers import KEY, children, vllm_python
from vllm_helpers import Served


@dataclass
class Pool:
    urls: list[str]
    procs: list


@pytest.fixture(scope="session")
def vllm_served(tmp_path_factory):
    """Two `backstream vllm serve default --api-key KEY --lora-rank 8` servers, each in a session of its
    own, their cwd elsewhere than the tests' (test_a_run_folder_the_server_cannot_see_is_refused), started
    side by side; killed outright (SIGKILL) after the session, which must leave nothing of them behind:
    they run under the guard a run's server has."""
    from backstream.rl.backends.vllm.server import _group_alive, free_port

    procs, urls, logs = [], [], []
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    for i in range(2):
        cwd = tmp_path_factory.mktemp(f"serve-cwd-{i}")
        port = free_port()
        out = open(cwd / "serve.log", "w+")
        cores = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
        procs.append(subprocess.Popen([sys.executable, "-m", "backstream", "vllm", "serve", "default", "--port",
                                       str(port), "--api-key", KEY, "--lora-rank", "8", "--python", vllm_python()],
                                      cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**env, **cores}))
        urls.append(f"http://127.0.0.1:{port}")
        logs.append(cwd / "serve.log")
    try:
        t0 = time.monotonic()
        for proc, url, log in zip(procs, urls, logs):
            while f'url = "{url}"' not in log.read_text():  # printed once it answers
                assert proc.poll() is None and time.monotonic() - t0 < 300, log.read_text()[-3000:]
                time.sleep(0.5)
        yield Pool(urls, procs)
    finally:
        guards = [g for p in procs for g in children(p.pid)]  # each guard leads its server's own process group
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert len(guards) == 2
    deadline = time.monotonic() + 30
    while any(_group_alive(g) for g in guards) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_group_alive(g) for g in guards)  # API servers, engines, workers: gone with the commands


@pytest.fixture
def served_by(tmp_path):
    """`served_by(model, tok, *overrides)`: a `Served` over the session's two servers (vllm.urls), closed
    after the test."""
    made = []

    def make(model, tok, *overrides, quant=None):
        s = Served(tok, str(tmp_path / f"run-{len(made)}"), model, *overrides, quant=quant)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
