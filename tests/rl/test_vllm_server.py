"""The vLLM server's process handling without vLLM (rl/vllm/server.py): a stand-in process group."""

import subprocess
import sys
import time

from backstream.rl.vllm.server import Server, _group_alive


def test_stop_ends_the_whole_group_when_its_leader_is_already_gone():
    # vLLM's API server leads a group with its engine and worker; if it dies first (a crash, an OOM
    # kill), stopping the run must still end the others, which would live on orphaned
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            "time.sleep(0.5)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc.wait(30)  # the leader exits; its child (the "engine") keeps running in the group
    assert _group_alive(proc.pid)
    Server("http://127.0.0.1:9", proc, None, 1).stop()
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(proc.pid)

