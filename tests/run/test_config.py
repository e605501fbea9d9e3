"""Run config: TOML + overrides, validation that names the key, help rendered from the docs."""

import os

import pytest
from helpers import REPO

from backstream import config


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[optim]\nlr = 3e-4\n[rollout]\ngroup_size = 4\nstop = ["\\n"]\n[loss]\ntype = "gspo"\n')
    cfg = config.load(str(p), ["optim.lr=1e-3", "train.output_dir=runs/x", "rollout.temperature=0.7"])
    assert cfg.optim.lr == 1e-3 and cfg.rollout.group_size == 4 and cfg.rollout.stop == ["\n"]
    assert cfg.train.output_dir == "runs/x" and cfg.rollout.temperature == 0.7
    assert type(cfg.loss).__name__ == "GSPOConfig"
    assert config.load().rollout.group_size == 8  # the run's default, not the sampler's


@pytest.mark.parametrize("overrides, match", [
    (["optim.lrr=1"], r"optim.lrr: unknown key; the keys of \[optim\] are"),
    (["optimizer.lr=1"], r"\[optimizer\]: unknown section"),
    (["optim.lr=fast"], r"optim.lr: got 'fast' \(str\), expected float"),
    (["optim.name=sgd"], r"optim.name: got 'sgd', expected one of \['adamw', 'rmsprop', 'muon'\]"),
    (["engine.backward=full"], r"engine.backward: got 'full'"),
    (["loss.type=ppo"], r"loss.type: got 'ppo', expected one of"),
    (["rollout.top_p=2"], r"top_p"),
    (["train.steps=0"], r"train.steps: got 0"),
    (["optim.betas=0.9"], r"optim.betas: got 0.9, expected a list"),
    (["optim"], r"expected section.key=value"),
])
def test_bad_values_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        config.load(None, overrides)


@pytest.mark.parametrize("overrides, match", [
    (["engine.reuse_rollout_kv=true", "update.epochs=2"], r"engine.reuse_rollout_kv: .* update.epochs"),
    (["engine.reuse_rollout_kv=true", "loss.router_aux_coef=0.1"],
     r"loss.router_aux_coef > 0 .* engine.reuse_rollout_kv = false"),
    (["loss.kl_coef=0.1"], r"loss.kl_coef > 0 needs update.kl_reference"),
    (["rollout.temperature=0.7"], r"loss.temperature: got 1.0, but rollout.temperature is 0.7"),
    (["rollout.group_size=1", "algorithm.advantage=rloo"], r"rollout.group_size: got 1; group advantages \(rloo\)"),
    (["update.minibatches=3"], r"update.minibatches: 3 does not divide train.prompts_per_step=8"),
])
def test_cross_section_checks_name_the_keys(overrides, match):
    cfg = config.load(None, overrides)  # each section is valid on its own
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_vllm_under_torchrun_waits_for_rank_0s_server():
    """torchrun with the vLLM backend: one server shared by every rank; the others wait for rank 0 to
    start it in a collective, so distributed.timeout_s must cover vllm.start_timeout_s."""
    vllm = ['rollout.backend="vllm"', "distributed.timeout_s=300", "vllm.start_timeout_s=300"]
    for world in (None, 1, 2, 8):
        config.load(None, vllm).validate(world_size=world)
    cfg = config.load(None, [*vllm, "distributed.timeout_s=60"])
    cfg.validate(world_size=1)  # one rank waits for no one
    with pytest.raises(ValueError, match=r"distributed.timeout_s = 60 is shorter than vllm.start_timeout_s = 300"):
        cfg.validate(world_size=2)
    config.load(None, [*vllm, "distributed.timeout_s=60", 'vllm.url="http://127.0.0.1:8000"']).validate(world_size=2)


def test_defaults_and_examples_pass_the_cross_section_checks():
    config.load().validate()
    for name in sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".toml")):
        config.load(os.path.join(EXAMPLES, name)).validate()


def test_bad_toml_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[optim\nlr=1")
    with pytest.raises(ValueError, match="not valid TOML"):
        config.load(str(p))


def test_help_lists_every_key_with_its_doc():
    text = config.describe()
    for section, cls in config.SECTIONS.items():
        assert f"[{section}]" in text
    assert "lr = (unset)" in text and "Peak learning rate; unset = the model's" in text
    assert "group_size" in text and 'type = "gspo"' in text
    # every key has its line of documentation, inherited ones (the losses' common keys) included
    import dataclasses

    for section, cls in config.SECTIONS.items():
        for c in (config.LOSSES.values() if section == "loss" else [cls]):
            docs = config.field_docs(c)
            missing = [f.name for f in dataclasses.fields(c) if not docs.get(f.name)]
            assert not missing, f"[{section}] {c.__name__}: no doc for {missing}"
    assert "Weight of the KL penalty" in text and "router load-balancing loss" in text


def test_resolved_config_round_trips(tmp_path):
    from backstream.config import to_toml

    cfg = config.load(None, ["optim.lr=2e-4", "rollout.stop=['#']", "loss.type=gspo"])
    # a built-in task's plain stop (a newline), quotes, a backslash, a tab, a non-ASCII character
    cfg.rollout.stop = ["\n", '"', "\\", "\t", "é"]
    p = tmp_path / "config.toml"
    p.write_text(to_toml(cfg.to_dict()))
    again = config.load(str(p))
    assert again.to_dict() == cfg.to_dict()


def test_cli_train_help_lists_the_keys(capsys):
    from backstream.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--set SECTION.KEY=VALUE" in out and "[engine]" in out and "memory_budget_mb" in out


def test_help_lists_the_tasks_of_the_registry(capsys):
    """`train --help` names every built-in task (it named arith and kvlookup, not toolcalc: the list
    was written by hand), and an unknown one is refused by its key."""
    from backstream.cli import main
    from backstream.rl.data.tasks import TASKS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  task = ")]
    assert line.endswith(f"(one of: {', '.join(TASKS)})") and "toolcalc" in TASKS
    with pytest.raises(ValueError, match=r"data.task: got 'toolkalc', expected one of \['arith', 'kvlookup', "):
        config.load(None, ['data.task="toolkalc"'])


def test_cli_reports_config_errors_without_a_traceback(capsys):
    from backstream.cli import main

    assert main(["train", "--set", "optim.lr=fast"]) == 2
    assert "optim.lr: got 'fast'" in capsys.readouterr().err


def test_a_transformers_older_than_the_floor_is_refused_by_name(monkeypatch, capsys):
    """Run from a source tree beside an older transformers (a GPU image's 5.17; `DummyLayer` came in
    5.23), the package stopped inside an import; now the floor is named with the fix, by the library
    and by the CLI (exit 2, no traceback), and pyproject.toml asks for the same."""
    import transformers

    from backstream.cli import main
    from backstream.stream.hf import MIN_TRANSFORMERS, require_transformers

    with pytest.raises(ImportError, match=r"needs transformers >= 5\.23, this environment has 5\.17\.0: "
                                          r"pip install -U 'transformers>=5\.23,<5\.25'"):
        require_transformers("5.17.0")
    for fine in ("5.23.0", "5.24.0.dev0", "5.30.1", "a-local-build"):
        require_transformers(fine)
    require_transformers()  # this environment's
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert main(["train", "--set", "train.steps=1"]) == 2
    assert "needs transformers >= 5.23, this environment has 5.17.0" in capsys.readouterr().err
    floor = ".".join(map(str, MIN_TRANSFORMERS))
    assert f'"transformers>={floor},<5.25"' in (REPO / "pyproject.toml").read_text()


def test_a_transformers_whose_state_cache_api_is_unknown_is_named(monkeypatch):
    """transformers 5.25 changed the Cache API of layers with recurrent or convolution state, on which
    every hybrid fails inside transformers (refused, never streamed wrong): the refusal then names the
    versions to install; pyproject.toml asks for one of them."""
    import transformers

    from backstream.stream.hf import STATE_API_UNKNOWN, state_api_hint

    assert STATE_API_UNKNOWN == (5, 25)
    for known in ("5.23.0", "5.24.0"):
        monkeypatch.setattr(transformers, "__version__", known)
        assert state_api_hint() == ""
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    assert "transformers 5.25.0 changed the Cache API" in state_api_hint()
    assert "pip install 'transformers>=5.23,<5.25'" in state_api_hint()


EXAMPLES = str(REPO / "examples")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".toml")))
def test_example_configs_are_valid(name):
    """The shipped examples parse and validate (every key known, every value allowed)."""
    cfg = config.load(os.path.join(EXAMPLES, name))
    assert cfg.train.steps >= 1 and cfg.reward.functions


def test_example_reward_function(monkeypatch):
    from backstream.rl.scoring.builtin import load_reward

    monkeypatch.chdir(os.path.dirname(EXAMPLES))
    fn = load_reward("examples/my_reward.py:length_penalised_match")
    out = fn(["the answer is 42", "no idea"], prompts=["q", "q"], answer=["42", "42"])
    assert out == pytest.approx([1.0 - 0.016, -0.007])
    spec = config.load(os.path.join(EXAMPLES, "dapo_math_lora.toml")).reward.functions[1]
    from backstream.rl.scoring.builtin import format_reward

    assert format_reward(spec[len("format:"):])([r"so \boxed{7}", "7"]) == [1.0, 0.0]


def test_relative_paths_in_a_run_file_name_files_beside_it(tmp_path, monkeypatch):
    """A relative path in a run file names the file beside the run file when one is there (the shipped
    examples run from any directory); else it is the current directory's, as before."""
    sub = tmp_path / "runs"
    sub.mkdir()
    (sub / "r.py").write_text("def ok(completions, **kw):\n    return [1.0] * len(completions)\n")
    (sub / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (sub / "run.toml").write_text('[data]\npath = "data.jsonl"\n[reward]\nfunctions = ["r.py:ok", "exact_match"]\n')
    monkeypatch.chdir(tmp_path)
    cfg = config.load(str(sub / "run.toml"))
    assert cfg.data.path == str(sub / "data.jsonl") and cfg.reward.functions == [f"{sub}/r.py:ok", "exact_match"]
    (tmp_path / "data.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')  # one here too: the current dir's
    assert config.load(str(sub / "run.toml")).data.path == "data.jsonl"
    monkeypatch.chdir(EXAMPLES)  # the shipped example from inside its folder and from the repository
    assert config.load("toolcalc_agent.toml").env.agent == "toolcalc_agent.py:agent"  # here: the current dir's
    monkeypatch.chdir(os.path.dirname(EXAMPLES))
    assert config.load("examples/toolcalc_agent.toml").env.agent == f"{EXAMPLES}/toolcalc_agent.py:agent"


def test_a_renamed_key_keeps_its_old_spelling_with_a_line_that_names_the_new_one(tmp_path, caplog):
    """[algorithm] is the advantage's alone: its other keys moved to [update], [rollout] and [reward]. The
    old spellings still work, in a run file and with --set, each said once with its new name; both
    spellings of one key are refused by name."""
    import logging

    caplog.set_level(logging.WARNING, logger="backstream")
    config._SAID.clear()
    path = tmp_path / "old.toml"
    path.write_text("[algorithm]\nadvantage = \"rloo\"\nepochs = 2\nminibatches = 2\nkl_reference = true\n"
                    "dynamic_sampling = true\nmax_refills = 3\noverlong = \"penalty\"\noverlong_buffer = 4\n")
    cfg = config.load(str(path), ["algorithm.max_refills=5"])
    assert cfg.algorithm.advantage == "rloo"
    assert (cfg.update.epochs, cfg.update.minibatches, cfg.update.kl_reference) == (2, 2, True)
    assert (cfg.rollout.dynamic_sampling, cfg.rollout.max_refills) == (True, 5)
    assert (cfg.reward.overlong, cfg.reward.overlong_buffer) == ("penalty", 4)
    said = [r.message for r in caplog.records if "old spelling" in r.message]
    assert len(said) == len(config.RENAMED) == 7
    assert "config: algorithm.epochs is now update.epochs (the old spelling still works; write update.epochs)" in said
    assert config.load(None, ["algorithm.epochs=3"]).update.epochs == 3  # said once a process: no new line
    assert len([r for r in caplog.records if "old spelling" in r.message]) == 7
    with pytest.raises(ValueError, match=r"algorithm.epochs and update.epochs: both are set; .* keep update.epochs"):
        config.load(None, ["algorithm.epochs=2", "update.epochs=2"])
    # a built-in reward or task class named by a module that moved
    moved = config.load(None, ["reward.functions=['backstream.rl.rewards:exact_match']",
                               'env.factory="backstream.rl.tasks:Calculator"'])
    assert moved.reward.functions == ["backstream.rl.scoring.builtin:exact_match"]
    assert moved.env.factory == "backstream.rl.data.tasks:Calculator"
    # the resolved config states the new spellings only
    assert "epochs" not in config.to_toml(cfg.to_dict()).split("[algorithm]")[1].split("[")[0]


class _Tok:
    def __init__(self, template=None):
        self.chat_template = template


def test_a_resume_keeps_what_the_run_decided_when_it_started(tmp_path, caplog):
    """A run folder written before 2026-12-04 with seq-mean-token-sum-norm states no loss.max_len_norm: it
    resumes dividing by the minibatch's longest completion, as it began, and says so. A run since states
    what it decided (the generation budget, a base model's shots, the format, the stop): a resume given
    the run file, which leaves them unset, takes the run's and is not refused for them."""
    import logging

    norm = 'loss.aggregation="seq-mean-token-sum-norm"'
    old = tmp_path / "old"
    old.mkdir()
    before = config.load(None, [norm, "optim.lr=1e-4"])  # a run of then stated every lr
    (old / "config.toml").write_text(config.to_toml(before.public_dict()))  # max_len_norm None: not written
    assert "max_len_norm" not in (old / "config.toml").read_text()
    with caplog.at_level(logging.WARNING, logger="backstream"):
        kept = config.kept_on_resume(str(old), before)
    assert kept.loss.max_len_norm == "minibatch" and "as it began (loss.max_len_norm = \"minibatch\")" in caplog.text
    assert kept.with_run_defaults().loss.max_len_norm == "minibatch"
    assert config.resume_changes(str(old), kept) == []

    new = tmp_path / "new"
    new.mkdir()
    run_file = config.load(None, [norm, 'model.name="some/base-model"'])
    started = run_file.for_tokenizer(_Tok()).with_run_defaults()
    (new / "config.toml").write_text(config.to_toml(started.public_dict()))
    with pytest.raises(ValueError, match="data.format"):  # what a resume with the run file met before
        config.resume_changes(str(new), run_file)
    caplog.clear()
    kept = config.kept_on_resume(str(new), run_file)
    budget = run_file.rollout.max_new_tokens
    decided = (kept.loss.max_len_norm, kept.data.shots, kept.data.format, kept.rollout.stop, kept.optim.lr)
    assert decided == (budget, 3, "plain", ["\n"], 1e-6)
    assert config.resume_changes(str(new), kept) == [] and "minibatch" not in caplog.text
    with pytest.raises(ValueError, match=rf"loss.max_len_norm = 9 \(the run's: {budget}\)"):  # a change: refused
        config.resume_changes(str(new), config.kept_on_resume(str(new), config.load(None, [
            norm, 'model.name="some/base-model"', "loss.max_len_norm=9"])))


def test_an_unset_learning_rate_is_the_models(caplog):
    """optim.lr unset: the shipped default model's 1e-4 (as before), a pretrained model's 1e-6 (TRL's and
    verl's default: 1e-4 wrecks a 270M base model after its first update) and its LoRA adapter's 1e-5, said
    and stated; a number set is kept, and an optimizer built by hand without one is refused."""
    import logging

    import torch

    from backstream.rl.update.optim import OptimConfig

    assert config.load(None).optim.lr is None and config.load(None).with_run_defaults().optim.lr == 1e-4
    with caplog.at_level(logging.INFO, logger="backstream"):
        assert config.load(None, ['model.name="some/model"']).with_run_defaults().optim.lr == 1e-6
    assert "optim.lr: 1e-06 for a pretrained model (unset; the shipped default model's is 0.0001)" in caplog.text
    assert config.load(None, ['model.name="some/model"', "model.lora_r=8"]).with_run_defaults().optim.lr == 1e-5
    assert config.load(None, ['model.name="some/model"', "optim.lr=3e-5"]).with_run_defaults().optim.lr == 3e-5
    with pytest.raises(ValueError, match="optim.lr: unset"):
        OptimConfig().build([torch.nn.Parameter(torch.zeros(2))])
