"""Faults end to end: kill -9 at points of a run and resume (no metrics line lost or doubled,
weights bitwise those of an uninterrupted run), a full disk while writing a checkpoint, a damaged
checkpoint on resume, a reward function that hangs."""

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import run_cfg, tiny
from safetensors.torch import load_file

from backstream import checkpoint, trainer
from backstream.rl.scoring.rewards import RewardError, Rewards

STEPS = 5
ARGS = ["--set", f"train.steps={STEPS}", "--set", "train.save_every=1", "--set", "train.keep_checkpoints=10",
        "--set", "train.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=8",
        "--set", "train.progress=false", "--set", "engine.verify=false", "--set", "train.plots=false"]
CLI = [sys.executable, "-c", "import sys; from backstream.cli import main; sys.exit(main(sys.argv[1:]))"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(run, *extra, wait=True):
    cmd = CLI + ["train", *ARGS, "--set", f'train.output_dir="{run}"', *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    if wait:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    return p


def _lines(run):
    path = os.path.join(run, "metrics.jsonl")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _kill_after(run, lines, delay):
    """Start (or resume) a run, kill -9 it `delay` seconds after metrics.jsonl reaches `lines` lines."""
    resume = checkpoint.latest(str(run)) is not None
    p = subprocess.Popen(CLI + ["train", "--resume", str(run)] if resume else
                         CLI + ["train", *ARGS, "--set", f'train.output_dir="{run}"'],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    t0 = time.time()
    while len(_lines(run)) < lines and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.02)
    time.sleep(delay)
    p.kill()
    p.wait()


@pytest.mark.slow
def test_kill_9_and_resume_is_bitwise_with_every_metrics_line_once(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _train(straight)
    # kills: just after a metrics line (before or while its checkpoint is written), mid-step
    for lines, delay in ((1, 0.0), (2, 0.15), (3, 0.4)):
        _kill_after(cut, lines, delay)
    if checkpoint.latest(str(cut)) is None:
        _train(cut, "--overwrite")
    else:
        p = subprocess.run(CLI + ["train", "--resume", str(cut)], capture_output=True, env=ENV, timeout=300)
        assert p.returncode == 0, p.stderr.decode()[-2000:]
    steps = [json.loads(x)["step"] for x in _lines(cut)]
    assert steps == list(range(1, STEPS + 1))  # none lost, none doubled
    a = load_file(os.path.join(checkpoint.latest(str(straight)), "model.safetensors"))
    b = load_file(os.path.join(checkpoint.latest(str(cut)), "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_disk_while_writing_a_checkpoint(tmp_path, monkeypatch):
    model, tok = tiny(torch.float32)
    calls = []
    real = torch.save

    def save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:  # the second checkpoint's trainer state
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    cfg = run_cfg(tmp_path, "full", 'model.dtype="float32"', "train.steps=3", "train.save_every=1")
    with pytest.raises(OSError, match=r"checkpoint: writing step 2 failed \(No space left on device\); nothing was "
                                      r"replaced, the latest checkpoint is still .*step-1"):
        trainer.train(cfg, model=model, tokenizer=tok)
    ckpts = checkpoint.list_checkpoints(str(tmp_path / "full"))
    assert [os.path.basename(c) for c in ckpts] == ["step-1"] and checkpoint.damage(ckpts[0]) is None
    assert not [n for n in os.listdir(tmp_path / "full" / "checkpoints") if n.startswith(".tmp")]


def test_damaged_checkpoint_is_skipped_on_resume(tmp_path):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "d", 'model.dtype="float32"', "train.steps=2", "train.save_every=1",
                                "train.keep_checkpoints=5"), model=model, tokenizer=tok)
    newest = checkpoint.latest(run)
    path = os.path.join(newest, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # a write cut short
    assert "model.safetensors has" in checkpoint.damage(newest)
    model, tok = tiny(torch.float32)
    with pytest.warns(UserWarning, match="skipping the damaged checkpoint .*step-2"):
        trainer.train(resume=run, overrides=["train.steps=3"], model=model, tokenizer=tok)
    steps = [json.loads(x)["step"] for x in _lines(run)]
    assert steps == [1, 2, 3]  # resumed from step 1: step 2 ran again, its line once


def test_a_reward_function_that_hangs_is_stopped(tmp_path):
    def hangs(completions, **kw):
        time.sleep(30)
        return [0.0] * len(completions)

    t = time.time()
    with pytest.raises(RewardError, match="did not return within timeout_s=0.5"):
        Rewards([(hangs, 1.0)], timeout_s=0.5)(["a", "b"], ["p", "p"], {})
    assert time.time() - t < 10
