"""A run folder belongs to one run and one process: a new run refuses a folder that holds one (or
moves it aside when asked), a second process is refused, a stale lock is taken over, nothing is
deleted."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import run_cfg, tiny

from backstream import runfolder, trainer


def test_new_run_refuses_a_folder_that_holds_one(tmp_path):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', "train.steps=2"), model=model, tokenizer=tok)
    before = open(os.path.join(run, "metrics.jsonl")).read()
    with pytest.raises(ValueError, match=r"train.output_dir: .* already holds a run; continue it with "
                                         r"`backstream train --resume .*--overwrite"):
        trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', "train.steps=1"), model=model, tokenizer=tok)
    assert open(os.path.join(run, "metrics.jsonl")).read() == before  # nothing lost
    assert not os.path.exists(os.path.join(run, runfolder.LOCK))  # released at the end of the first run


def test_overwrite_moves_the_old_run_aside(tmp_path, capsys):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    lock = runfolder.claim(str(folder), resume=False, overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("r.old-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert os.listdir(folder) == [runfolder.LOCK] and "moved the earlier run" in capsys.readouterr().err
    lock.release()
    assert os.listdir(folder) == []


def test_a_second_process_is_refused_and_a_stale_lock_taken_over(tmp_path):
    folder = str(tmp_path / "r")
    os.makedirs(folder)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with open(os.path.join(folder, runfolder.LOCK), "w") as f:
            json.dump({"pid": other.pid, "host": socket.gethostname(), "started": "then"}, f)
        with pytest.raises(ValueError, match=rf"train.output_dir: .* is in use by process {other.pid}"):
            runfolder.claim(folder, resume=True)
    finally:
        other.kill()
        other.wait()
    lock = runfolder.claim(folder, resume=True)  # its process is gone: the lock is stale
    assert json.load(open(lock.path))["pid"] == os.getpid()
    lock.release()


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="train.output_dir: .* is a file, not a folder"):
        runfolder.claim(str(tmp_path / "f"), resume=False)


def test_a_same_size_look_alike_is_refused_on_resume(tmp_path):
    """The fingerprint is the content's hash, not its size: a data file rewritten with the same number
    of bytes (one answer changed) is refused like any other change, and recorded when allowed."""
    run, data = tmp_path / "run", tmp_path / "data.jsonl"
    run.mkdir()
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    runfolder.record_fingerprints(str(run), {str(data): "data.path"})
    assert runfolder.check_fingerprints(str(run), False) == []
    data.write_text('{"prompt": "1+1=", "answer": "3"}\n')  # same size, other bytes
    assert os.path.getsize(data) == len('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match="data.path: .*data.jsonl changed since the run started"):
        runfolder.check_fingerprints(str(run), False)
    assert runfolder.check_fingerprints(str(run), True)


def test_the_servers_api_key_is_written_nowhere_in_the_run_folder(tmp_path):
    """vllm.api_key given in the config (or --set) is used, but config.toml holds it empty and
    config_changes.jsonl says "<not written>": a run folder is shared and copied, a key is not."""
    model, tok = tiny(torch.float64)
    cfg = run_cfg(tmp_path, "run", "train.steps=1", "train.save_every=1", 'vllm.api_key="sekrit-123"')
    run = trainer.train(cfg, model=model, tokenizer=tok)
    assert 'api_key = ""' in open(os.path.join(run, "config.toml")).read()
    model, tok = tiny(torch.float64)
    trainer.train(resume=run, overrides=["train.steps=2", 'vllm.api_key="other-456"'], model=model, tokenizer=tok)
    changes = [json.loads(x) for x in open(os.path.join(run, "config_changes.jsonl"))]
    assert {"key": "vllm.api_key", "old": "", "new": "<not written>"}.items() <= \
        next(c for c in changes if c["key"] == "vllm.api_key").items()
    for folder, _, files in os.walk(run):
        for name in files:
            data = open(os.path.join(folder, name), "rb").read()
            assert b"sekrit-123" not in data and b"other-456" not in data, os.path.join(folder, name)
