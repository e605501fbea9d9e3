"""Optional logging backends: TensorBoard scalars equal metrics.jsonl; W&B (offline) gets the same
run id across a resume; a backend that is asked for but missing stops before anything is written."""

import glob
import importlib.util
import json
import os
import time

import pytest
import torch
from helpers import no_run_written, run_cfg, tiny

from backstream import trainer


def _rows(run):
    return [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "tb", 'model.dtype="float32"', "train.steps=2", "train.log_tensorboard=true"),
                        model=model, tokenizer=tok)
    acc = EventAccumulator(os.path.join(run, "tensorboard"))
    acc.Reload()
    rows = _rows(run)
    keys = [k for k in rows[0] if k != "step" and isinstance(rows[0][k], (int, float))]
    assert {"reward/mean", "response_length/mean", "time/step", "optim/grad_norm"} <= set(keys)
    assert set(acc.Tags()["scalars"]) == set(keys)
    for key in keys:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        for e, r in zip(events, rows):
            assert e.value == pytest.approx(r[key], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_wandb_offline_run_continues_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "wb", 'model.dtype="float32"', "train.steps=1", "train.log_wandb=true")
    run = trainer.train(cfg, model=model, tokenizer=tok)
    run_id = open(os.path.join(run, "wandb_id.txt")).read().strip()
    model, tok = tiny(torch.float32)
    # W&B names an offline run's folder by the second it started: let the resume start in a later one
    t0 = int(time.time())
    while int(time.time()) == t0:
        time.sleep(0.05)
    trainer.train(resume=run, overrides=["train.steps=2"], model=model, tokenizer=tok)
    logs = sorted(glob.glob(os.path.join(run, "wandb", "offline-run-*", f"run-{run_id}.wandb")))
    assert len(logs) == 2  # two processes' worth of the same W&B run
    # W&B's service process may still be writing a log when finish() returns on a loaded machine (CI
    # once read a file that held only its 10-byte header): wait for the records, a minute at most
    deadline = time.time() + 60
    for path in logs:
        while not _has(path, b"reward/mean", b"response_length/mean") and time.time() < deadline:
            time.sleep(0.5)
        assert _has(path, b"reward/mean", b"response_length/mean"), (path, os.path.getsize(path))


def _has(path, *keys):
    data = open(path, "rb").read()
    return all(k in data for k in keys)


def test_wandb_calls(tmp_path, monkeypatch):
    """The W&B contract without the package: init with the run id kept in the run folder (resume
    continues it), one log per step with that step, finish at the end."""
    import sys
    import types

    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", step, metrics["reward/mean"]))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real_find(name, *a))
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "wb", 'model.dtype="float32"', "train.steps=2", "train.log_wandb=true",
                                'train.wandb_project="proj"'), model=model, tokenizer=tok)
    model, tok = tiny(torch.float32)
    trainer.train(resume=run, overrides=["train.steps=3"], model=model, tokenizer=tok)
    inits = [c[1] for c in calls if c[0] == "init"]
    run_id = open(os.path.join(run, "wandb_id.txt")).read().strip()
    assert [(k["id"], k["project"], k["resume"]) for k in inits] == [(run_id, "proj", "allow")] * 2
    assert inits[0]["config"]["optim"]["lr"] == 1e-2
    rows = _rows(run)
    assert [c for c in calls if c[0] == "log"] == [("log", r["step"], r["reward/mean"]) for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(c[0] == "finish" for c in calls) == 2


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_missing_backend_stops_before_writing(tmp_path, monkeypatch, backend):
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else real_find(name, *a))
    model, tok = tiny(torch.float32)
    key = "log_tensorboard" if backend == "tensorboard" else "log_wandb"
    with pytest.raises(ValueError, match=f"train.{key}: needs `pip install {backend}`"):
        cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', f"train.{key}=true")
        trainer.train(cfg, model=model, tokenizer=tok)
    assert no_run_written(tmp_path / "run")


class _Terminal:
    """A stand-in stderr that says it is a terminal and keeps what is written."""

    def __init__(self):
        self.text = []

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_and_lines_otherwise(tmp_path, monkeypatch, capsys):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "lines", 'model.dtype="float32"', "train.steps=2", "train.progress=true"),
                        model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert "step 1/2 | reward" in err and "step 2/2 | reward" in err and "backward" in err
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    model, tok = tiny(torch.float32)
    trainer.train(resume=run, overrides=["train.steps=3"], model=model, tokenizer=tok)
    out = "".join(term.text)
    assert "\r" in out and "3/3" in out and "reward" in out and "tok/s" in out
    assert "2/3" in out  # the bar starts at the resumed step
    assert "step 3/3 |" not in out  # no plain lines on a terminal


def test_every_metrics_line_has_the_same_keys_and_a_timestamp(tmp_path):
    """Steps where every advantage is 0 leave the loss terms undefined: their keys stay, null."""
    import datetime

    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "k", 'model.dtype="float32"', "train.steps=2", "loss.kl_coef=0.0",
                                "reward.functions=['rewards_for_tests:constant', 'rewards_for_tests:count_ones']",
                                "reward.weights=[1.0, 0.0]"), model=model, tokenizer=tok)
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert len(lines) == 2 and all(list(x) == list(lines[0]) for x in lines)
    for x in lines:
        assert x["batch/zero_adv_frac"] == 1.0 and x["loss/ratio_mean"] is None and x["loss/clip_frac_low"] is None
        assert x["reward/count_ones"] is not None
        assert datetime.datetime.fromisoformat(x["time/wall"]).tzinfo is not None


@pytest.mark.slow
def test_train_writes_the_plots_with_each_reward_function(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append(k.get("label"))
                        or real(self, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda self, label, **k: drawn.append(("y", label)))
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "p", 'model.dtype="float32"', "train.steps=2", "train.plots=true",
                                "reward.functions=['rewards_for_tests:count_ones', 'rewards_for_tests:count_digits']"),
                        model=model, tokenizer=tok)
    for name in ("reward", "length"):
        assert os.path.getsize(os.path.join(run, f"{name}.png")) > 1000
    assert {"reward/mean", "reward/count_ones",
            "reward/count_digits"} <= set(drawn)  # a curve per function
    assert ("y", "reward (mean ± std over the step's samples)") in drawn
    assert not [n for n in os.listdir(run) if n.endswith(".tmp.png")]


def test_the_bar_shows_the_phase_inside_a_step(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "bar", 'model.dtype="float32"', "train.steps=1", "train.progress=true",
                          "engine.block_size=4", "reward.functions=['rewards_for_tests:flat_for_one_prompt']"),
                  model=model, tokenizer=tok)
    out = "".join(term.text)
    # the two prompts have one length: one decode batch, so the rollout reports both groups at once
    assert "step 1: rollout 2/2" in out and "step 1: backward" in out
    lines = [x for part in out.split("\r") for x in part.split("\n")]
    assert max(len(x) for x in lines) <= 100 + 2  # fits the terminal (100 columns where none is attached)
    assert "Writing model shards" not in out  # the checkpoint's save_pretrained draws no bar of its own


def test_plots_show_every_series_and_integer_steps(tmp_path, monkeypatch):
    """eval.png: reward/mean and avg@k that coincide stay apart (a line style and marker each), and the
    step axis has integer ticks (issue 25: avg@k hid reward/mean, steps read 0.5, 1.5)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from backstream import metrics

    rows = [{"step": s, "eval/reward/mean": 0.5, "eval/pass@4": 0.75, "eval/avg@4": 0.5} for s in (0, 1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = []
    real = plt.subplots

    def spy(*a, **kw):
        fig, ax = real(*a, **kw)
        made.append(ax)
        return fig, ax

    monkeypatch.setattr(plt, "subplots", spy)
    paths = metrics.plot(str(tmp_path))
    (ax,) = [a for a, p in zip(made, paths) if p.endswith("eval.png")]
    styles = [(line.get_linestyle(), line.get_marker()) for line in ax.get_lines()]
    assert len(styles) == 3 and len(set(styles)) == 3
    locator = ax.xaxis.get_major_locator()
    assert all(float(t).is_integer() for t in locator.tick_values(0, 2))
