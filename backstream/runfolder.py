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

`Run` is the lifecycle of one run around the trainer, so that the trainer only trains: the lock,
config.toml and its change history, the fingerprints of the files it read, error.log, SIGINT/SIGTERM,
the checkpoint cadence and how the run ends (`Interrupted`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback

from backstream.checks import UserError
from backstream.lifetime import alive
from backstream.log import log

LOCK = ".lock"
ERROR_LOG = "error.log"
# what a run writes before its first step and its first checkpoint: a folder holding only these (and
# no metrics line, no checkpoint) holds nothing of value
_EARLY = {LOCK, "config.toml", "metrics.jsonl", "episodes.jsonl", ERROR_LOG, "error-previous.log", "tensorboard",
          "wandb", "wandb_id.txt", "fingerprints.json", "config_changes.jsonl", "checkpoints", "vllm", "vllm.log"}


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
            if host == me["host"] and isinstance(pid, int) and not alive(pid) or pid == me["pid"]:
                os.remove(path)  # stale: its process is gone (or it is ours, from an earlier Trainer)
                continue
            raise UserError(
                f"train.output_dir: {run_dir} is in use by process {pid} on host {host} (since "
                f"{owner.get('started', '?')}; lock file {path}). Wait for it to finish, or remove the lock file if "
                "that process is gone") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return RunLock(path)
    raise UserError(f"train.output_dir: could not take the lock {path}")


def claim(run_dir: str, *, resume: bool, overwrite: bool = False) -> RunLock:
    """Make `run_dir` this run's folder and lock it; refuse what would mix two runs."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserError(f"train.output_dir: {run_dir} is a file, not a folder; choose another train.output_dir")
    if not resume and os.path.isdir(run_dir) and stopped_early(run_dir):
        lock = _take_lock(run_dir)  # refuse a folder another process is writing
        for name in set(os.listdir(run_dir)) - {LOCK}:
            path = os.path.join(run_dir, name)
            if name == ERROR_LOG:
                os.replace(path, os.path.join(run_dir, "error-previous.log"))
            elif name != "error-previous.log":
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        log.info(f"{run_dir} held a run that stopped before saving anything (no checkpoint, no metrics line); "
                 "starting anew in it" + (" (its error: error-previous.log)" if os.path.exists(
                     os.path.join(run_dir, "error-previous.log")) else ""))
        return lock
    if not resume and os.path.isdir(run_dir) and [n for n in os.listdir(run_dir) if n != LOCK]:
        if not overwrite:
            raise UserError(
                f"train.output_dir: {run_dir} already holds a run; continue it with `backstream train --resume "
                f"{run_dir}`, choose a new train.output_dir, or pass --overwrite to move the old folder aside")
        _take_lock(run_dir).release()  # refuse to move a folder another process is writing
        aside = f"{run_dir.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while os.path.exists(aside):
            aside, n = f"{aside.rsplit('~', 1)[0]}~{n}", n + 1
        os.rename(run_dir, aside)
        log.info(f"moved the earlier run in {run_dir} aside to {aside}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        return _take_lock(run_dir)
    except OSError as e:
        raise UserError(f"train.output_dir: cannot create the run folder {run_dir} ({e.strerror or e}); set "
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
        raise UserError("--resume: " + "; ".join(changed) + ". Resuming would train on other data or rewards than "
                         "the checkpoints were trained on. Restore the file(s), or pass --allow-changed-files to "
                         "resume with them as they are now (the change is recorded in the run folder)")
    if changed:
        record_fingerprints(run_dir, {f: old["key"] for f, old in known.items() if os.path.exists(f)})
    return changed


def record_changes(run_dir: str, step: int, changes: list[tuple[str, object, object]]) -> None:
    """Append what a resume changed (key, old value, new value) to the run's change log."""
    from backstream.config import SECRETS  # noqa: PLC0415  (config imports the whole RL loop)

    when = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(os.path.join(run_dir, CHANGES), "a") as f:
        for key, old, new in changes:
            if key in SECRETS:
                old, new = (v and "<not written>" for v in (old, new))
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


# -- the lifecycle of one run -------------------------------------------------------------------------


class Interrupted(Exception):
    """The run stopped on SIGINT or SIGTERM: after finishing and saving its step (`saved`), or at once
    on a second one (the last complete checkpoint stays). `exit_code` is the shell's 128 + signal."""

    def __init__(self, signum: int, step: int, run_dir: str, last: str | None, saved: bool):
        self.signum, self.step, self.run_dir, self.last, self.saved = int(signum), step, run_dir, last, saved
        self.exit_code = 128 + self.signum
        name = signal.Signals(self.signum).name
        where = (f"after step {step}, saved" if saved else
                 f"at once during step {step + 1}; the last checkpoint stays ({last or 'none'})")
        resume = f"resume with: backstream train --resume {run_dir}" if last else "no checkpoint to resume from"
        super().__init__(f"interrupted ({name}) {where}; {resume}")


def checkpoint_step(path: str | None) -> int:
    """The step of a checkpoint folder `.../step-N` (0 for none)."""
    return int(os.path.basename(path).split("-", 1)[1]) if path else 0


class Run:
    """One run's folder and lifecycle (rank 0 owns the folder; every rank holds one of these): `open`
    claims and records it, `guard` turns an error into error.log and a released lock, `signals` makes a
    first SIGINT/SIGTERM finish the step and a second stop at once, `checkpoint_due` keeps the cadence.
    `cfg` is the resolved RunConfig, `dp` the data parallelism (rl/parallel/)."""

    def __init__(self, cfg, run_dir: str, dp, *, resume: bool, overwrite: bool):
        self.cfg, self.dir, self.dp, self.resume = cfg, run_dir, dp, resume
        self.stop = 0  # the signal that asked the run to stop, 0 while none did
        self.step = 0  # the trainer's last finished step
        self.in_step = False  # a step is under way (`next_step` to `step_done`), not its line or checkpoint
        self.stop_after: int | None = None  # the step a first signal lets the run finish
        self.last_save = time.monotonic()
        self.lock = dp.on_main(lambda: claim(run_dir, resume=resume, overwrite=overwrite))

    def open(self, changes: list, allow_changed_files: bool) -> None:
        """After the lock: a new run writes its config and fingerprints; a resume checks the
        fingerprints and records what it changed (rank 0)."""
        self.dp.check_shared(self.dir, os.path.join(self.dir, LOCK))
        if self.resume:
            self.dp.on_main(lambda: self._record_resume(changes, allow_changed_files))
        else:
            self.dp.on_main(self._start)

    def _start(self) -> None:
        self.write_config()
        record_fingerprints(self.dir, self.cfg.files_read())

    def _record_resume(self, changes: list, allow_changed_files: bool) -> None:
        """The files the run read must be unchanged (or allowed); what the resume changed is logged
        with its step and time, and config.toml rewritten to say what the run now is."""
        from backstream import checkpoint  # noqa: PLC0415  (torch: only where a run is resumed)

        changed = check_fingerprints(self.dir, allow_changed_files)
        step = checkpoint_step(checkpoint.latest_intact(self.dir))
        changes = changes + [("file", None, c) for c in changed]
        if changes:
            record_changes(self.dir, step, changes)
            self.write_config()

    def resume_point(self) -> str:
        """The latest intact checkpoint (rank 0 looks, every rank gets it), or an error that says why
        there is none and what to do."""
        from backstream import checkpoint  # noqa: PLC0415  (torch: only where a run is resumed)

        path = self.dp.broadcast(self.dp.on_main(lambda: checkpoint.latest_intact(self.dir)))
        if path is None:
            tc = self.cfg.train
            cadence = (f"train.save_every_minutes = {tc.save_every_minutes}, train.save_every = {tc.save_every}: a "
                       "checkpoint after step 1 and then at that cadence" if tc.periodic_checkpoints else
                       "train.save_every = train.save_every_minutes = 0: checkpoints only at the end or on Ctrl-C")
            raise UserError(f"--resume: {self.dir} holds no complete checkpoint ({cadence}); the run stopped before "
                            "its first one, so there is nothing to resume: start it again with `backstream train "
                            "CONFIG` (the folder is taken over, as it holds nothing of value), and keep "
                            "train.save_every_minutes > 0 so that a kill can be resumed")
        return path

    def write_config(self) -> None:
        from backstream.config import to_toml  # noqa: PLC0415  (config imports the whole RL loop)

        notes = [f"resumed at step {c['step']} ({c['time']}): {c['key']} {c['old']!r} -> {c['new']!r}"
                 for c in read_changes(self.dir)]
        with open(os.path.join(self.dir, "config.toml"), "w") as f:
            f.write(to_toml(self.cfg.public_dict(), notes))

    def record_error(self, e: BaseException) -> None:
        """The error that stopped the run, with its traceback, in RUN_DIR/error.log (rank 0, a folder
        this run claimed)."""
        if not self.dp.main or isinstance(e, (KeyboardInterrupt, Interrupted)):
            return
        if os.path.isdir(self.dir) and os.path.exists(os.path.join(self.dir, "config.toml")):
            path = record_error(self.dir, "".join(traceback.format_exception(e)))
            if path is not None:
                log.info(f"the error and its traceback are in {path}")

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @contextlib.contextmanager
    def guard(self):
        """An error inside goes to error.log and releases the lock (set-up before training)."""
        try:
            yield
        except BaseException as e:
            self.record_error(e)
            self.release()
            raise

    def last(self) -> str | None:
        from backstream import checkpoint  # noqa: PLC0415

        return checkpoint.latest(self.dir)

    def _signal(self, signum, frame):
        """First SIGINT/SIGTERM: finish the step under way, save, stop; between steps (the last one's
        line, evaluation or checkpoint) no other step starts. A second: stop at once (a checkpoint
        being written is left unpublished; the last complete one stays)."""
        if self.stop:
            raise KeyboardInterrupt
        self.stop = signum
        self.stop_after = self.step + 1 if self.in_step else self.step  # what the message below promises
        sys.stderr.write("\n")  # off a progress bar's line
        what = (f"finishing step {self.stop_after} and saving" if self.in_step else
                f"step {self.step} is done: saving it and stopping")
        log.info(f"{signal.Signals(signum).name} received: {what}; press Ctrl-C again to stop now (the last "
                 f"checkpoint stays: {self.last() or 'none yet'})")

    def next_step(self) -> bool:
        """Does the trainer start another step (then `step_done` when it has finished it)? Not once a
        signal asked the run to stop before this call (on any rank: every rank stops at the same step
        boundary). The step is marked under way before the question is asked, so that a signal in
        between promises it, and it runs; the run's last line and checkpoint are not a step."""
        self.in_step = True
        if self.dp.any(self.stop_after is not None and self.step >= self.stop_after):
            self.in_step = False  # a signal now is a second one: it stops at once
            return False
        return True

    def step_done(self, step: int) -> None:
        self.step = step  # before the step is no longer under way: a signal between must not see the old step
        self.in_step = False

    @contextlib.contextmanager
    def training(self, step: int):
        """Around the training loop: the signal handlers; a second Ctrl-C as `Interrupted`; any other
        error in error.log (under torchrun the other ranks are told); the lock released at the end."""
        self.step = step
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.last_save = time.monotonic()
        try:
            yield self
        except KeyboardInterrupt:  # a second Ctrl-C, or one outside the handler's reach
            raise Interrupted(self.stop or signal.SIGINT, self.step, self.dir, self.last(), saved=False) from None
        except BaseException as e:
            if not isinstance(e, Interrupted):
                self.record_error(e)
                self.dp.failed(e)  # under torchrun: say so now, leave the group so that the others stop too
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.release()

    def ended(self) -> None:
        """After the last save: `Interrupted` if a signal stopped the run."""
        stop = self.dp.broadcast(self.stop)
        if stop:
            raise Interrupted(stop, self.step, self.dir, self.last(), saved=True)

    def checkpoint_due(self) -> bool:
        """After step 1, every train.save_every steps, and when train.save_every_minutes have passed
        since the last checkpoint (rank 0's clock decides for every rank)."""
        tc, step = self.cfg.train, self.step
        due = tc.periodic_checkpoints and step == 1
        due |= bool(tc.save_every) and step % tc.save_every == 0
        due |= tc.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * tc.save_every_minutes
        return self.dp.broadcast(due)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def finished(self) -> None:
        """A resume of a run that already reached train.steps: say so, release the folder."""
        self.release()
        log.info(f"the run in {self.dir} is finished (step {self.step} of train.steps = {self.cfg.train.steps}); to "
                 f"train on, resume it with --set train.steps=N (N > {self.step})")
