"""Nothing a run starts outlives it (standard library only): the one place for process lifetime.

- `guarded(python, command)`: `command` started under a guard, a tiny process (this module run as
  `python -m backstream.lifetime FD COMMAND...`) that leads a session and process group of its own and
  ends the whole group once the trainer is gone, however the trainer ended. A run's vLLM server
  (rl/backends/vllm/server.py, serve.py) and an agent command (rl/agent/runner.py) run under it.
- `stop(proc, grace, group)`: the one way a process is ended (a server's group with a grace period,
  an agent command's group at once, an environment's worker or its zygote); `kill_group(proc)` is
  `stop(proc, group=True)`.
- `die_with_parent()`: this process gets SIGKILL when its parent dies (an environment's worker,
  rl/agent/process.py).

Why a guard. vLLM's API server starts an engine-core process, which starts a worker. A trainer killed
outright (kill -9, the OOM killer, a preemption) runs no clean-up, and a parent-death signal reaches
the API server alone: its children, re-parented to init, kept ~1.7 GB and a core. So the trainer starts
this guard instead, in a session and process group of its own (setsid), and the guard starts the
command as its child in that group. The guard holds the read end of a pipe whose write end only the
trainer holds: however the trainer ends, the kernel closes that end, the guard reads EOF and ends the
group (SIGTERM, a grace period, SIGKILL). It also ends the group when the command exits (a server's
engine would live on) or when it gets SIGTERM (`Server.stop`), and exits with the command's status,
so that the trainer sees the command's end as the guard's.

The guard runs with the vLLM environment's python too, found on the same PYTHONPATH as the worker
extension, and this module imports nothing but the standard library (the package's `__init__`
imports nothing).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 5.0  # how long the group has to exit after SIGTERM before SIGKILL


def others(pgid: int) -> list[int] | None:
    """The live processes of group `pgid` other than this one (zombies are gone for this purpose:
    they hold no memory and wait for their parent to reap them); None where /proc cannot tell."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z" and pid != os.getpid():
            out.append(pid)
    return out


def end_group(grace: float = GRACE_S) -> None:
    """SIGTERM to the whole group (this process ignores it), a grace period for vLLM to shut down,
    then SIGKILL to whatever is left: each other process (so that the guard lives on to report the
    server's status), or the whole group, this process included, where /proc cannot tell them."""
    pgid = os.getpgrp()
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if others(pgid) == []:
            return
        time.sleep(0.1)
    for _ in range(10):  # a process forked meanwhile is met on the next round
        left = others(pgid)
        if left is None:
            break
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)


def guarded(python: str, command: list[str], **popen) -> tuple[subprocess.Popen, int]:
    """`command` started under a guard run by `python` (see the module docstring): the guard leads a
    session and process group of its own (Ctrl-C is the trainer's to handle; stopping the guard ends the
    whole group), starts `command` in it, and ends the group when the trainer is gone, however it ended.
    Returns the guard's process and the write end of its pipe, which the trainer holds until it stops
    the command (closing it ends the group too). `popen`: Popen's other arguments (output, environment)."""
    read, write = os.pipe()  # neither end inheritable: only the guard gets `read`, nothing else `write`
    popen.setdefault("stdin", subprocess.DEVNULL)
    try:
        proc = subprocess.Popen([python, "-m", "backstream.lifetime", str(read), *command], pass_fds=(read,),
                                start_new_session=True, **popen)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return proc, write


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` is still running."""
    return _signalled(os.killpg, pgid)


def alive(pid: int) -> bool:
    """Whether process `pid` is still running (someone else's too)."""
    return _signalled(os.kill, pid)


def _signalled(kill, target: int) -> bool:
    try:
        kill(target, 0)  # signal 0: delivered nowhere, but refused for a process (group) that is gone
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def stop(target: subprocess.Popen | int, grace: float = 0.0, group: bool = False) -> None:
    """The one way a process the package started is ended: `target` (a Popen, reaped; or a pid), or with
    `group` the whole process group it leads (a guarded server's guard, API server, engine and worker;
    an agent command and what it started). With `grace` > 0: SIGTERM first and that long to exit (vLLM
    shuts down cleanly), then SIGKILL to whatever is left; gone already is fine."""
    pid = target if isinstance(target, int) else target.pid
    send = os.killpg if group else os.kill
    if grace > 0:
        try:
            send(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + grace
        popen = isinstance(target, subprocess.Popen)
        while time.monotonic() < deadline:
            # (the leader reaped first: a zombie leader keeps its group "alive" to killpg, and the whole
            # grace was waited after every server had exited)
            exited = popen and target.poll() is not None
            gone = not group_alive(pid) if group else exited
            if gone:
                break
            time.sleep(0.1)
    try:
        send(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if isinstance(target, subprocess.Popen):
        target.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group `proc` leads (a guarded command and whatever it started), reaped."""
    stop(proc, group=True)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a tool stuck in C code cannot outlive
    the trainer); elsewhere a closed pipe ends it at its next request."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    fd, command = int(argv[0]), argv[1:]
    stopping = []
    # a handler, not SIG_IGN: an ignored signal would stay ignored in the server after exec
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    child = subprocess.Popen(command)  # the same group and output (the run's vllm.log); not the pipe
    why = "the server exited"
    while child.poll() is None:
        if stopping:
            why = "stopped by the run"
            break
        try:
            ready, _, _ = select.select([fd], [], [], 0.5)
        except InterruptedError:
            continue
        if ready and not os.read(fd, 1):
            why = "the trainer is gone"  # every copy of the pipe's write end is closed
            break
    try:
        print(f"backstream guard: {why}; ending the server's process group", file=sys.stderr, flush=True)
    except OSError:  # its output was a pipe to the trainer, now gone: the group is ended all the same
        pass
    end_group()
    code = child.wait()
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
