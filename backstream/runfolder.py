"""A run folder belongs to one run, and to one process at a time.

- A new run refuses a folder that already holds a run (it would mix its metrics and checkpoints with
  the old run's); `overwrite` moves the old folder aside to `<folder>.old-<time>`, never deletes it.
- A run that stopped before it saved anything of value (no checkpoint, no metrics line: a reward or
  data error at step 1, say) does not block the fix: the next plain `train` takes its folder over,
  keeping its error log as `error-previous.log`.
- `--resume` continues the run in its own folder.
- While a process trains, `<folder>/.lock` names it (pid, host). A second process is refused; a lock
  whose process is gone (same host, pid not alive) is stale and taken over.
- `error.log`: the last error that stopped the run, with its traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time

LOCK = ".lock"
ERROR_LOG = "error.log"
# what a run writes before its first step and its first checkpoint: a folder holding only these (and
# no metrics line, no checkpoint) holds nothing of value
_EARLY = {LOCK, "config.toml", "metrics.jsonl", ERROR_LOG, "error-previous.log", "tensorboard", "wandb",
          "wandb_id.txt", "fingerprints.json", "config_changes.jsonl", "checkpoints"}


def has_value(run_dir: str) -> bool:
    """Does the run folder hold what a run produced: a metrics line or a checkpoint?"""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        return True
    ckpts = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(ckpts) and any(n.startswith("step-") for n in os.listdir(ckpts))


def stopped_early(run_dir: str) -> bool:
    """A folder a run wrote (its config.toml and its empty metrics.jsonl are there: a user's own
    folder is never taken for one) that holds nothing of value and nothing else."""
    names = set(os.listdir(run_dir))
    return {"config.toml", "metrics.jsonl"} <= names and names <= _EARLY and not has_value(run_dir)


def record_error(run_dir: str, text: str) -> str | None:
    """Write `text` (the error and its traceback) to the run's error log; its path, or None when the
    folder cannot take it."""
    path = os.path.join(run_dir, ERROR_LOG)
    try:
        with open(path, "w") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}")
    except OSError:
        return None
    return path


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
    if not resume and os.path.isdir(run_dir) and stopped_early(run_dir):
        lock = _take_lock(run_dir)  # refuse a folder another process is writing
        for name in set(os.listdir(run_dir)) - {LOCK}:
            path = os.path.join(run_dir, name)
            if name == ERROR_LOG:
                os.replace(path, os.path.join(run_dir, "error-previous.log"))
            elif name != "error-previous.log":
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"backstream: {run_dir} held a run that stopped before saving anything (no checkpoint, no metrics "
              "line); starting anew in it" + (" (its error: error-previous.log)" if os.path.exists(
                  os.path.join(run_dir, "error-previous.log")) else ""))
        return lock
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
    try:
        os.makedirs(run_dir, exist_ok=True)
        return _take_lock(run_dir)
    except OSError as e:
        raise ValueError(f"train.output_dir: cannot create the run folder {run_dir} ({e.strerror or e}); set "
                         "train.output_dir to a folder you can write (e.g. runs/NAME)") from None


# -- a self-contained run: the files it reads, fingerprinted ------------------------------------

FINGERPRINTS = "fingerprints.json"
CHANGES = "config_changes.jsonl"


def fingerprint(path: str) -> dict:
    """Size and sha256 of a file, or of every file of a folder (a `datasets` folder), by relative name."""
    if os.path.isdir(path):
        files = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names)
        parts = {name: fingerprint(os.path.join(path, name)) for name in files}
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        return {"size": sum(p["size"] for p in parts.values()), "sha256": digest, "files": len(parts)}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def record_fingerprints(run_dir: str, files: dict[str, str]) -> None:
    """`files`: absolute path → what it is to the run (the config key that names it)."""
    out = {path: {"key": key, **fingerprint(path)} for path, key in files.items() if os.path.exists(path)}
    _write_json(os.path.join(run_dir, FINGERPRINTS), out)


def check_fingerprints(run_dir: str, allow_changed: bool) -> list[str]:
    """On resume: every file the run read must be as it was when the run started. Raises a ValueError
    naming each file and what changed, unless `allow_changed` (then the new fingerprints replace the old
    ones and the changes are returned, for the run's record)."""
    path = os.path.join(run_dir, FINGERPRINTS)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        known = json.load(f)
    changed = []
    for file, old in known.items():
        if not os.path.exists(file):
            changed.append(f"{old['key']}: {file} no longer exists")
            continue
        new = fingerprint(file)
        if new["sha256"] != old["sha256"]:
            changed.append(f"{old['key']}: {file} changed since the run started (size {old['size']} -> {new['size']} "
                           f"bytes, sha256 {old['sha256'][:12]}… -> {new['sha256'][:12]}…)")
    if changed and not allow_changed:
        raise ValueError("--resume: " + "; ".join(changed) + ". Resuming would train on other data or rewards than "
                         "the checkpoints were trained on. Restore the file(s), or pass --allow-changed-files to "
                         "resume with them as they are now (the change is recorded in the run folder)")
    if changed:
        record_fingerprints(run_dir, {f: old["key"] for f, old in known.items() if os.path.exists(f)})
    return changed


def record_changes(run_dir: str, step: int, changes: list[tuple[str, object, object]]) -> None:
    """Append what a resume changed (key, old value, new value) to the run's change log."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(os.path.join(run_dir, CHANGES), "a") as f:
        for key, old, new in changes:
            f.write(json.dumps({"time": when, "step": step, "key": key, "old": old, "new": new}) + "\n")


def read_changes(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, CHANGES)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
