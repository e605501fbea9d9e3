"""A run you can trust to resume and to stop (issue 19): self-contained run folders, settings a
resume applies or refuses (never ignores), greedy sampling refused, checkpoints by default, a failed
first step that does not block the fix, Ctrl-C that answers, no tracebacks for a user's mistakes and
messages that name the key."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import run_cfg, tiny

from backstream import checkpoint, cli, config, runfolder, trainer
from backstream.rl.scoring.advantages import ZeroAdvantageWatch
from backstream.rl.scoring.rewards import RewardError

CLI = [sys.executable, "-c", "import sys; from backstream.cli import main; sys.exit(main(sys.argv[1:]))"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
QUICK = ["--set", "train.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.max_new_tokens=6",
         "--set", "engine.verify=false", "--set", "train.progress=false", "--set", "train.plots=false"]


def _write(path, text):
    path.write_text(text)
    return path


# -- 1. a run folder is self-contained ------------------------------------------------------------


def test_resume_from_another_directory_uses_the_runs_own_files(tmp_path, monkeypatch):
    """A run started with relative paths stores them absolute; resumed from another directory that
    holds look-alike files of the same names, it uses its own. A file it read that changed is refused
    by name, unless the user allows it (then the change is recorded)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _write(a / "data.jsonl", "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                                     for i in range(8)))
    _write(a / "myreward.py", "def reward(completions, **kw):\n    return [c.count('1') / 9 for c in completions]\n")
    _write(b / "data.jsonl", json.dumps({"prompt": "look-alike", "answer": "0"}) + "\n")
    _write(b / "myreward.py", "def reward(completions, **kw):\n    raise RuntimeError('the look-alike reward')\n")
    monkeypatch.chdir(a)
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "run", 'model.dtype="float32"', "train.steps=1", 'data.path="data.jsonl"',
                                "reward.functions=['myreward.py:reward']"), model=model, tokenizer=tok)
    stored = config.load(os.path.join(run, "config.toml"))
    assert stored.data.path == str(a / "data.jsonl") and stored.reward.functions == [f"{a / 'myreward.py'}:reward"]
    monkeypatch.chdir(b)
    model, tok = tiny(torch.float32)
    trainer.train(resume=run, overrides=["train.steps=2"], model=model, tokenizer=tok)  # a's files: no error
    assert [json.loads(x)["step"] for x in open(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    with open(a / "data.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")
    model, tok = tiny(torch.float32)
    with pytest.raises(ValueError, match=r"data.path: .*a/data.jsonl changed since the run started .*"
                                         r"--allow-changed-files"):
        trainer.train(resume=run, overrides=["train.steps=3"], model=model, tokenizer=tok)
    trainer.train(resume=run, overrides=["train.steps=3"], model=model, tokenizer=tok, allow_changed_files=True)
    changes = runfolder.read_changes(run)
    assert any(c["key"] == "file" and "data.jsonl changed" in c["new"] for c in changes)


# -- 2. --resume with a config or --set: applied and written, or refused ---------------------------


def test_resume_applies_resumable_keys_and_refuses_the_others(tmp_path, capsys):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "run", 'model.dtype="float32"', "train.steps=1"), model=model, tokenizer=tok)
    before = open(os.path.join(run, "config.toml")).read()
    for overrides, words in ((["optim.lr=1.0"], "optim.lr = 1.0 (the run's: 0.01)"),
                             (["train.steps=2", "rollout.group_size=8"], "rollout.group_size = 8 (the run's: 4)")):
        model, tok = tiny(torch.float32)
        with pytest.raises(ValueError, match=r"--resume: .*" + words.replace("(", r"\(").replace(")", r"\)")):
            trainer.train(resume=run, overrides=overrides, model=model, tokenizer=tok)
        assert open(os.path.join(run, "config.toml")).read() == before  # refused: nothing changed
    other = _write(tmp_path / "other.toml", "[optim]\nlr = 0.5\n")
    assert cli.main(["train", str(other), "--resume", run]) == 2
    assert "optim.lr = 0.5" in capsys.readouterr().err
    assert cli.main(["train", "--resume", run, "--overwrite"]) == 2
    assert "--overwrite: not with --resume" in capsys.readouterr().err
    model, tok = tiny(torch.float32)
    trainer.train(resume=run, overrides=["train.steps=2", "train.save_every=1"], model=model, tokenizer=tok)
    text = open(os.path.join(run, "config.toml")).read()
    cfg = config.load(os.path.join(run, "config.toml"))
    assert cfg.train.steps == 2 and cfg.train.save_every == 1  # config.toml says what the run now is
    assert "# resumed at step 1" in text and "train.steps 1 -> 2" in text
    assert {(c["key"], c["old"], c["new"]) for c in runfolder.read_changes(run)} == {
        ("train.steps", 1, 2), ("train.save_every", 0, 1)}


def test_resume_may_move_the_vllm_server_but_not_change_what_it_samples(tmp_path):
    """A run whose server moved, or which stopped on a too short vllm.request_timeout_s, goes on with
    the new [vllm] keys; vllm.extra_args (it can change what the server samples) stays the run's."""
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "run", 'model.dtype="float32"', "train.steps=1"), model=model, tokenizer=tok)
    moved = {"vllm.url": "http://127.0.0.1:8765", "vllm.api_key": "k2", "vllm.python": sys.executable,
             "vllm.start_timeout_s": 60.0,
             "vllm.request_timeout_s": 1800.0, "vllm.kv_cache_gb": 4, "vllm.max_model_len": 512}
    sets = [f"{k}={v!r}".replace("'", '"') for k, v in moved.items()]
    model, tok = tiny(torch.float32)
    with pytest.raises(ValueError, match=r"--resume: vllm.extra_args = \['--dtype', 'half'\] \(the run's: \[\]\)\. "):
        trainer.train(resume=run, overrides=["train.steps=2", *sets, "vllm.extra_args=['--dtype', 'half']"],
                      model=model, tokenizer=tok)
    trainer.train(resume=run, overrides=["train.steps=2", *sets], model=model, tokenizer=tok)
    assert [json.loads(x)["step"] for x in open(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    # the key is used, never written (config.SECRETS)
    assert {k: v for k, v in config.load(os.path.join(run, "config.toml")).flat().items() if k in moved} == \
        {**moved, "vllm.api_key": ""}
    assert {c["key"] for c in runfolder.read_changes(run)} == {"train.steps", *moved}


def test_the_resume_table_of_the_docs_is_the_codes():
    """docs/runs.md's table of the keys a resume may change names exactly config.RESUMABLE (`eval.*`:
    every key of [eval]), and every one of them is a key of the config."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text()
    table = text.split("| keys | why they may change |")[1].split("\n\n")[0]
    keys = config.RunConfig().flat()
    documented = set()
    for key in re.findall(r"`([a-z_]+\.[a-z_*]+)`", table):
        documented |= {k for k in keys if k.startswith(key[:-1])} if key.endswith(".*") else {key}
    assert documented == set(config.RESUMABLE)
    assert set(config.RESUMABLE) <= set(keys)


# -- 3. greedy sampling refused; a run that learns nothing says why --------------------------------


def test_greedy_sampling_with_a_group_estimator_is_refused(tmp_path):
    model, tok = tiny(torch.float32)
    with pytest.raises(ValueError, match=r"rollout.temperature: 0 samples greedily.*rollout.temperature > 0"):
        trainer.train(run_cfg(tmp_path, "g", 'model.dtype="float32"', "rollout.temperature=0.0"), model=model,
                      tokenizer=tok)
    assert not os.path.exists(tmp_path / "g")


def test_steps_with_every_advantage_zero_warn(tmp_path, capsys):
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "z", 'model.dtype="float32"', f"train.steps={ZeroAdvantageWatch.STEPS}",
                          "reward.functions=['rewards_for_tests:constant']"), model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert f"steps 1-{ZeroAdvantageWatch.STEPS} had every advantage 0" in err
    assert "rollout.dynamic_sampling" in err and err.count("had every advantage 0") == 1
    assert "never stopped" not in err  # the tiny model's samples end with its EOS at times


def test_a_model_that_never_stops_is_named_in_the_warning():
    """Every sample of the five steps ran to the token limit: the warning says the model never stopped and
    names rollout.stop; one step with a stopped sample among them does not."""
    watch = ZeroAdvantageWatch()
    assert [watch.saw(True, s, all_cut=True) for s in range(1, 6)] == [False] * 4 + [True]
    assert "the model never stopped: set rollout.stop" in watch.warning
    other = ZeroAdvantageWatch()
    cut = [True, True, False, True, True]
    assert [other.saw(True, s, all_cut=c) for s, c in zip(range(1, 6), cut)][-1]
    assert "never stopped" not in other.warning


# -- 4. checkpoints by default ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_kill_with_the_default_settings_resumes(tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen(CLI + ["train", *QUICK, "--set", "train.steps=50", "--set", f'train.output_dir="{run}"'],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    t0 = time.time()
    while checkpoint.latest(str(run)) is None and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    p.kill()
    p.wait()
    assert checkpoint.latest(str(run)) is not None  # step 1 is checkpointed without any save setting
    done = subprocess.run(CLI + ["train", "--resume", str(run), "--set", "train.steps=3"], capture_output=True,
                          env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [1, 2, 3]


def test_resume_without_a_checkpoint_says_how_to_get_one(tmp_path):
    bad = _write(tmp_path / "bad.py", "def reward(completions, **kw):\n    raise OSError('reward server down')\n")
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "r", 'model.dtype="float32"', f"reward.functions=['{bad}:reward']")
    with pytest.raises(RewardError):
        trainer.train(cfg, model=model, tokenizer=tok)
    with pytest.raises(ValueError, match=r"no complete checkpoint .*save_every_minutes = 10.0.*start it again"):
        trainer.train(resume=str(tmp_path / "r"), model=model, tokenizer=tok)


# -- 5. a failed first step does not block the fix -------------------------------------------------


def test_a_failed_first_step_leaves_its_error_and_no_obstacle(tmp_path, capsys):
    bad = _write(tmp_path / "bad.py", "def reward(completions, **kw):\n    return [1 / 0 for _ in completions]\n")
    model, tok = tiny(torch.float32)
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', f"reward.functions=['{bad}:reward']"),
                      model=model, tokenizer=tok)
    log = tmp_path / "r" / "error.log"
    assert "ZeroDivisionError" in log.read_text() and "Traceback" in log.read_text()
    assert str(log) in capsys.readouterr().err  # the user is told where it is
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', "train.steps=1"), model=model, tokenizer=tok)
    assert "stopped before saving anything" in capsys.readouterr().err  # diagnostics: stderr
    assert [json.loads(x)["step"] for x in open(os.path.join(run, "metrics.jsonl"))] == [1]
    assert "ZeroDivisionError" in (tmp_path / "r" / "error-previous.log").read_text()
    assert not (tmp_path / "r" / "error.log").exists()


# -- 6. Ctrl-C that answers --------------------------------------------------------------------------


def _start(run, steps=200):
    p = subprocess.Popen(CLI + ["train", *QUICK, "--set", f"train.steps={steps}", "--set", "train.save_every_minutes=0",
                                "--set", f'train.output_dir="{run}"'],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    t0 = time.time()
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert p.poll() is None and time.time() - t0 < 120, p.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    return p


@pytest.mark.slow
def test_one_sigint_finishes_the_step_saves_and_exits_130(tmp_path):
    run = tmp_path / "run"
    p = _start(run)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, err[-2000:]
    # the signal lands in a step (it is finished) or between two (no other starts): the message says which
    assert ("SIGINT received: finishing step" in err or "is done: saving it and stopping" in err) and \
        "press Ctrl-C again to stop now" in err
    last = err.strip().splitlines()[-1]
    assert "interrupted (SIGINT) after step" in last and f"resume with: backstream train --resume {run}" in last
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl")]
    assert checkpoint.load_state(checkpoint.latest(str(run)))["step"] == steps[-1]  # the step it finished, saved
    # a finished run says so
    done = subprocess.run(CLI + ["train", "--resume", str(run), "--set", f"train.steps={steps[-1]}"],
                          capture_output=True, env=ENV, timeout=300)
    assert done.returncode == 0 and "is finished (step" in done.stderr.decode()


@pytest.mark.slow
def test_a_second_sigint_stops_at_once_and_leaves_nothing_half_written(tmp_path):
    run = tmp_path / "run"
    p = _start(run)
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    err = err.decode()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "interrupted (SIGINT)" in err.strip().splitlines()[-1]
    for ckpt in checkpoint.list_checkpoints(str(run)):  # every visible checkpoint is whole
        assert checkpoint.damage(ckpt) is None


# -- 7 and 8. no tracebacks for a user's mistakes; messages that name the key ------------------------


def _cli(capsys, *args):
    code = cli.main(["train", *args, "--set", "engine.verify=false", "--set", "train.progress=false"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_user_mistakes_exit_2_with_the_file_and_the_fix(tmp_path, capsys):
    out = f'train.output_dir="{tmp_path / "run"}"'
    code, err = _cli(capsys, str(tmp_path / "absent.toml"))
    assert code == 2 and "config: no file" in err and "absent.toml" in err
    code, err = _cli(capsys, "--set", 'train.output_dir="/proc/x/run"')
    assert code == 2 and "train.output_dir: cannot create the run folder /proc/x/run" in err
    syntax = _write(tmp_path / "syntax.py", "def reward(completions, **kw):\n    return [0.0 for c in completions\n")
    code, err = _cli(capsys, "--set", out, "--set", f"reward.functions=['{syntax}:reward']")
    assert code == 2 and f"{syntax}, line" in err and "SyntaxError" in err
    failing = _write(tmp_path / "failing.py", "import math\n\nx = 1 / 0\n")
    code, err = _cli(capsys, "--set", out, "--set", f"reward.functions=['{failing}:reward']")
    assert code == 2 and f"{failing}, line 3: ZeroDivisionError" in err
    code, err = _cli(capsys, "--set", out, "--set", "reward.functions=[exact_match]")
    assert code == 2 and "strings inside a list need quotes" in err
    code, err = _cli(capsys, "--set", out, "--set", "rollout.group_size=0")
    assert code == 2 and "rollout.group_size: got 0" in err


def test_model_names_that_are_not_models_are_named(tmp_path, capsys):
    out = f'train.output_dir="{tmp_path / "run"}"'
    code, err = _cli(capsys, "--set", out, "--set", 'model.name="./no/such/model"')
    assert code == 2 and "model.name: './no/such/model' is no folder here" in err
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    code, err = _cli(capsys, "--set", out, "--set", f'model.name="{tmp_path / "tok"}"')
    assert code == 2 and "holds no config.json, so it is not a Hugging Face model folder" in err
    code, err = _cli(capsys, "--set", out, "--set", "model.lora_r=4", "--set", "model.lora_targets=['nope']")
    assert code == 2 and "model.lora_targets: ['nope'] match no module" in err and "q_proj" in err
    t = time.time()
    assert cli.main(["verify", "lama"]) == 2  # neither a folder nor a model_type, the Hub unreachable: at once
    assert time.time() - t < 10 and "the nearest model types: llama" in capsys.readouterr().out


def test_an_empty_chat_prompt_names_its_row(tmp_path):
    path = _write(tmp_path / "d.jsonl", json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"})
                  + "\n" + json.dumps({"prompt": [], "answer": "0"}) + "\n")
    model, tok = tiny(torch.float32)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"data: the prompt \(example 1\) is an empty list of chat messages"):
        trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', f'data.path="{path}"'), model=model,
                      tokenizer=tok)


OLD_RUN = [  # tests/data/run-b845907's settings (written by b845907, before rl/'s new layout: issue 58)
    'model.dtype="float32"', "train.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
    "data.num_examples=32", "optim.lr=1e-2", "train.progress=false", "reward.functions=['format:.*1.*']",
    "train.plots=false", "train.save_every=1", "train.keep_checkpoints=1", "update.minibatches=2"]


@pytest.mark.slow
def test_a_run_folder_written_before_the_new_layout_resumes_bitwise(tmp_path, caplog):
    """tests/data/run-b845907 was written by b845907 (2 steps, its [algorithm] holding minibatches = 2, the
    tiny Qwen3 of helpers.tiny in float32): it resumes, its old keys read with their new names (said),
    and its steps, the two it had and the two it adds, are an uninterrupted run of this version: the
    same metrics and the same weights, bitwise."""
    import logging
    import shutil

    caplog.set_level(logging.WARNING, logger="backstream")
    config._SAID.clear()
    old = shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "data", "run-b845907"), tmp_path / "old")
    model, tok = tiny(torch.float32)
    trainer.train(resume=str(old), overrides=["train.steps=4"], model=model, tokenizer=tok)
    assert "config: algorithm.minibatches is now update.minibatches" in caplog.text
    straight, tok = tiny(torch.float32)
    run = trainer.train(config.load(None, [*OLD_RUN, "train.steps=4", f'train.output_dir="{tmp_path / "new"}"']),
                        model=straight, tokenizer=tok)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), straight.state_dict().values()))
    drop = ("time/", "throughput/", "memory/")

    def rows(folder):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(drop)}
                for x in open(os.path.join(folder, "metrics.jsonl"))]

    assert [r["step"] for r in rows(old)] == [1, 2, 3, 4]
    assert rows(old) == rows(run)
