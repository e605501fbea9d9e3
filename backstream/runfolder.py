"""A run folder belongs to one run, and to one process at a time.

- A new run refuses a folder that already holds files (it would mix its metrics and checkpoints with
  the old run's); `overwrite` moves the old folder aside to `<folder>.old-<time>`, never deletes it.
- `--resume` continues the run in its own folder.
- While a process trains, `<folder>/.lock` names it (pid, host). A second process is refused; a lock
  whose process is gone (same host, pid not alive) is stale and taken over.
"""

from __future__ import annotations

import json
import os
import socket
import time

LOCK = ".lock"


class RunLock:
    def __init__(self, path: str):
        self.path = path

    def release(self) -> None:
        try:
            with open(self.path) as f:
                mine = json.load(f).get("pid") == os.getpid()
        except (OSError, ValueError):
            return
        if mine:
            os.remove(self.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _take_lock(run_dir: str) -> RunLock:
    path = os.path.join(run_dir, LOCK)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                owner = {}
            pid, host = owner.get("pid"), owner.get("host")
            if host == me["host"] and isinstance(pid, int) and not _alive(pid) or pid == me["pid"]:
                os.remove(path)  # stale: its process is gone (or it is ours, from an earlier Trainer)
                continue
            raise ValueError(
                f"train.output_dir: {run_dir} is in use by process {pid} on host {host} (since "
                f"{owner.get('started', '?')}; lock file {path}). Wait for it to finish, or remove the lock file if "
                "that process is gone") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return RunLock(path)
    raise ValueError(f"train.output_dir: could not take the lock {path}")


def claim(run_dir: str, *, resume: bool, overwrite: bool = False) -> RunLock:
    """Make `run_dir` this run's folder and lock it; refuse what would mix two runs."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"train.output_dir: {run_dir} is a file, not a folder; choose another train.output_dir")
    if not resume and os.path.isdir(run_dir) and [n for n in os.listdir(run_dir) if n != LOCK]:
        if not overwrite:
            raise ValueError(
                f"train.output_dir: {run_dir} already holds a run; continue it with `backstream train --resume "
                f"{run_dir}`, choose a new train.output_dir, or pass --overwrite to move the old folder aside")
        _take_lock(run_dir).release()  # refuse to move a folder another process is writing
        aside = f"{run_dir.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while os.path.exists(aside):
            aside, n = f"{aside.rsplit('~', 1)[0]}~{n}", n + 1
        os.rename(run_dir, aside)
        print(f"backstream: moved the earlier run in {run_dir} aside to {aside}")
    os.makedirs(run_dir, exist_ok=True)
    return _take_lock(run_dir)
