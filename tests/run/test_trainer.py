"""The RL loop: streamed vs reference engine give the same run, resume is bitwise, checkpoints are
atomic, bad input stops before anything that looks like a run is written, the demo runs."""

import json
import os
import signal
import warnings

import pytest
import torch
from helpers import no_run_written, rel, run_cfg, tiny, tiny_moe, weights
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from backstream import checkpoint, config, trainer
from backstream.rl.update.learner import Updated

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.mark.parametrize("extra", [[], ["loss.type=\"gspo\""], ["update.epochs=2", "update.minibatches=2"]])
def test_streamed_and_reference_runs_agree_float64(tmp_path, extra):
    results = {}
    for backward in ("stream", "reference"):
        model, tok = tiny()
        trainer.train(run_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=3", *extra),
                      model=model, tokenizer=tok)
        results[backward] = weights(model)
    start = weights(tiny()[0])
    assert rel(results["stream"], start) > 1e-4  # the runs did train
    assert rel(results["stream"], results["reference"]) <= 1e-10


def test_engine_kernel_math_runs_the_naive_attention_and_agrees_float64(tmp_path, monkeypatch):
    """engine.kernel = "math" reaches the engine (its prefill and backward attend on the naive path,
    the way back from a fused kernel that misbehaves) and trains the same weights as "auto"."""
    from backstream.stream import attention

    calls = {"math": 0}
    naive = attention.merged_attention_math

    def counted(*a, **kw):
        calls["math"] += 1
        return naive(*a, **kw)

    monkeypatch.setattr(attention, "merged_attention_math", counted)
    results = {}
    for kernel in ("auto", "math"):
        calls["math"] = 0
        model, tok = tiny()
        trainer.train(run_cfg(tmp_path, kernel, f'engine.kernel="{kernel}"', "engine.block_size=3"),
                      model=model, tokenizer=tok)
        results[kernel] = (weights(model), calls["math"])
    assert results["auto"][1] == 0 and results["math"][1] > 0  # CPU: fused for auto, naive for math
    assert rel(results["math"][0], weights(tiny()[0])) > 1e-4
    assert rel(results["math"][0], results["auto"][0]) <= 1e-10


def test_moe_router_loss_runs_agree_float64(tmp_path):
    """The MoE load-balancing loss in the loop: streamed and reference engines, same weights."""
    results, logged = {}, {}
    for backward in ("stream", "reference"):
        model, tok = tiny_moe()
        run = trainer.train(run_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=3",
                                    "loss.router_aux_coef=0.5"), model=model, tokenizer=tok)
        results[backward] = weights(model)
        logged[backward] = [json.loads(x)["loss/router_aux"] for x in open(os.path.join(run, "metrics.jsonl"))]
    assert rel(results["stream"], weights(tiny_moe()[0])) > 1e-4
    assert rel(results["stream"], results["reference"]) <= 1e-10
    assert len(logged["stream"]) == 3 and all(v > 1.0 for v in logged["stream"])
    assert max(abs(a - b) for a, b in zip(logged["stream"], logged["reference"])) <= 1e-10


def test_router_loss_on_a_dense_model_is_refused(tmp_path):
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', "loss.router_aux_coef=0.01")
    with pytest.raises(ValueError, match="loss.router_aux_coef: Qwen3ForCausalLM is not a mixture-of-experts"):
        trainer.train(cfg, model=model, tokenizer=tok)
    assert no_run_written(tmp_path / "run")
    cfg = run_cfg(tmp_path, "run", "loss.router_aux_coef=0.01", "engine.reuse_rollout_kv=true")
    with pytest.raises(ValueError, match="router_aux_coef.*reuse_rollout_kv = false"):
        trainer.train(cfg, model=tiny_moe()[0], tokenizer=tok)
    assert no_run_written(tmp_path / "run")


def test_rollout_kv_reuse_gives_the_same_run(tmp_path):
    results = {}
    for reuse in ("false", "true"):
        model, tok = tiny()
        trainer.train(run_cfg(tmp_path, reuse, f"engine.reuse_rollout_kv={reuse}"), model=model, tokenizer=tok)
        results[reuse] = weights(model)
    assert rel(results["true"], results["false"]) <= 1e-10


def test_resume_is_bitwise(tmp_path):
    model, tok = tiny(torch.float32)
    common = ['model.dtype="float32"', "train.save_every=2"]
    trainer.train(run_cfg(tmp_path, "straight", "train.steps=4", *common), model=model, tokenizer=tok)
    straight = weights(model)
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "split", "train.steps=2", *common), model=model, tokenizer=tok)
    model, tok = tiny(torch.float32)  # a fresh process would start from the initial weights too
    run = trainer.train(resume=str(tmp_path / "split"), overrides=["train.steps=4"], model=model, tokenizer=tok)
    for k, v in weights(model).items():
        assert torch.equal(v, straight[k]), k
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_kill_during_checkpoint_leaves_the_previous_one(tmp_path, monkeypatch):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "r", 'model.dtype="float32"', "train.steps=1"), model=model, tokenizer=tok)
    before = checkpoint.latest(run)
    real = torch.save

    def dying_save(obj, path, *a, **kw):
        real(obj, path, *a, **kw)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(run, 2, model, tok, {"step": 2})
    monkeypatch.setattr(checkpoint.torch, "save", real)
    assert checkpoint.latest(run) == before
    assert checkpoint.load_state(before)["step"] == 1
    assert Qwen3ForCausalLM.from_pretrained(before) is not None


@pytest.mark.parametrize("rows, overrides, match", [
    ([{"question": "1+1="}], [], "no `prompt` column"),
    ([], [], "holds no examples"),
    ([{"prompt": "x" * 300, "answer": "1"}], [], "exceeds the model's context"),
    ([{"prompt": "x" * 30, "answer": "1"}], ["data.max_prompt_tokens=10"], "max_prompt_tokens=10"),
    ([{"prompt": "1+1=", "answer": "2"}], ["loss.kl_coef=0.1"], "kl_reference"),
    ([{"prompt": "1+1=", "answer": "2"}], ["rollout.group_size=1"], "group_size"),
    ([{"prompt": "1+1=", "answer": "2"}], ["engine.reuse_rollout_kv=true", "update.epochs=2"], "reuse_rollout_kv"),
])
def test_bad_input_writes_nothing(tmp_path, rows, overrides, match):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', f'data.path="{data}"', *overrides)
    with pytest.raises(ValueError, match=match):
        trainer.train(cfg, model=model, tokenizer=tok)
    assert no_run_written(out)


def test_broken_reward_function_stops_without_a_checkpoint(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward(completions, **kw):\n    raise RuntimeError('boom')\n")
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', f"reward.functions=['{bad}:reward']")
    with pytest.raises(ValueError, match="reward"):
        trainer.train(cfg, model=model, tokenizer=tok)
    assert checkpoint.latest(str(tmp_path / "run")) is None


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    from backstream.cli import main

    assert main(["demo", "--steps", "2", "--output", str(tmp_path / "demo"), "--set", "train.prompts_per_step=2"]) == 0
    out = capsys.readouterr().out
    assert "mean reward" in out and "checkpoint:" in out
    rows = [json.loads(x) for x in open(tmp_path / "demo" / "metrics.jsonl")]
    assert len(rows) == 2
    for key in ("step", "reward/mean", "response_length/mean", "time/step", "time/rollout", "time/backward",
                "mismatch/logprob_abs"):
        assert key in rows[0], key
    assert rows[0]["mismatch/logprob_abs"] < 1e-4  # sampler and learner agree (same weights, fp32)
    # the local sampler runs the current weights: no token behind the learner
    assert all(r["rollout/staleness_mean"] == 0 and r["rollout/staleness_max"] == 0 for r in rows)
    ckpt = checkpoint.latest(str(tmp_path / "demo"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(ckpt) is not None and AutoTokenizer.from_pretrained(ckpt) is not None
    # `backstream plot RUN_DIR`: one PNG per curve; a folder that is no run is a usage error, not a traceback
    assert main(["plot", str(tmp_path / "demo")]) == 0
    pngs = capsys.readouterr().out.split()
    assert "reward.png" in [os.path.basename(p) for p in pngs] and all(os.path.getsize(p) > 1000 for p in pngs)
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "is not a run folder (it has no metrics.jsonl)" in capsys.readouterr().err


@pytest.mark.slow
def test_reward_rises_on_the_default_model(tmp_path):
    """Integration: the demo's GRPO run (shipped default model, arith task, 16 prompts × 8 samples),
    shortened to 20 steps at lr 5e-4. The mean reward of the last 5 steps is clearly above that of
    the first 5, and the sampler and the learner agree on the sampled tokens' log-probs throughout.
    Seeds 0-4 rose by 0.14-0.21 (from about 0.2); the threshold leaves room for other CPUs' numerics."""
    from backstream.cli import DEMO
    from backstream.metrics import read

    cfg = config.load(None, ["train.steps=20", "optim.lr=5e-4", "train.seed=0", "train.progress=false",
                             f'train.output_dir="{tmp_path / "run"}"'], base=DEMO)
    rows = read(trainer.train(cfg))
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.08, (first, last)
    assert max(r["mismatch/logprob_abs"] for r in rows) < 1e-4


def test_shots_sit_once_in_the_shared_prompt_of_a_group(tmp_path):
    """data.shots = 3 on a tiny model: a group's prompt, its solved examples included, is one branch of the
    token tree that its G samples share, so the engine holds it once: tree/tokens_unique is at most the
    total less G − 1 copies of each prompt (fewer where completions share prefixes too), and at least
    each prompt once (but for what the two groups' prompts share; an entropy term keeps every sequence
    in the tree). The run folder's config.toml states the shots."""
    from backstream.rl.data.prompts import DataConfig, encode_prompts

    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "shots", 'model.dtype="float32"', "data.shots=3", "data.num_examples=2",
                                "train.steps=1", "update.minibatches=1", "loss.entropy_coef=0.01"),
                        model=model, tokenizer=tok)
    p0, p1 = encode_prompts(DataConfig(task="arith", num_examples=2, shots=3, format="plain").build(0), tok, 4096)
    assert min(len(p0), len(p1)) > 3 * 9  # three "a+b=c\n" lines and the question
    common = next(i for i, (a, b) in enumerate(zip(p0.tolist(), p1.tolist())) if a != b)
    (row,) = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    G, total, unique, held = 4, row["tree/tokens_total"], row["tree/tokens_unique"], len(p0) + len(p1)
    assert held - common <= unique <= total - (G - 1) * held, (held, common, unique, total)
    assert config.load(os.path.join(run, "config.toml")).data.shots == 3


def test_streamed_and_reference_runs_agree_float32_20_steps(tmp_path):
    results = {}
    for backward in ("stream", "reference"):
        model, tok = tiny(torch.float32)
        trainer.train(run_cfg(tmp_path, backward, 'model.dtype="float32"', f'engine.backward="{backward}"',
                              "engine.block_size=4", "train.steps=20", "optim.lr=3e-3"), model=model, tokenizer=tok)
        results[backward] = weights(model)
    assert rel(results["stream"], tiny(torch.float32)[0].state_dict()) > 1e-3
    assert rel(results["stream"], results["reference"]) <= 1e-4


def test_dapo_dynamic_sampling_and_overlong(tmp_path):
    """Groups without signal are dropped and refilled; overlong filtering zeroes the truncated ones."""
    model, tok = tiny(torch.float32)
    data = tmp_path / "data.jsonl"  # a data file: no stop (the built-in arith task stops at a newline)
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    run = trainer.train(run_cfg(tmp_path, "dapo", 'model.dtype="float32"', "rollout.dynamic_sampling=true",
                                f'data.path="{data}"',
                                'reward.overlong="filter"', "rollout.max_new_tokens=3", "loss.eps_high=0.28",
                                "train.steps=2"), model=model, tokenizer=tok)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert all(r["batch/groups"] == 2 for r in rows)  # refilled to prompts_per_step
    # every completion of a random model runs to max_new_tokens: all filtered, no gradient
    assert all(r["batch/zero_adv_frac"] == 1.0 for r in rows)
    # each refill round replaces groups that were dropped, within rollout.max_refills (4)
    assert all(0 <= r["dapo/refill_rounds"] <= min(4, r["dapo/groups_dropped"]) for r in rows)


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_sampling_drops_a_zero_variance_group(tmp_path, dynamic):
    """4 prompts, 4 per step; the reward is flat on the samples of "1+1=" and varies on the others.
    The first round draws all four: dynamic sampling drops the flat group, keeps the other three and
    the last round (max_refills = 1) refills one; without it the flat group stays in the batch."""
    from rewards_for_tests import FLAT_PROMPT

    others = ["2+2=", "3+3=", "4+4="]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in [FLAT_PROMPT, *others]))
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "run", 'model.dtype="float32"', f'data.path="{data}"', "train.prompts_per_step=4",
                  f"rollout.dynamic_sampling={str(dynamic).lower()}", "rollout.max_refills=1",
                  "reward.functions=['rewards_for_tests:flat_for_one_prompt']")
    t = trainer.Trainer(cfg, model=model, tokenizer=tok)
    batch = t.collect()
    t.logger.close()
    G = cfg.rollout.group_size
    # the step's line says what dynamic sampling did: one refill round, for the one group it dropped
    assert (batch.refill_rounds, batch.groups_dropped) == ((1, 1) if dynamic else (0, 0))
    m = t.metrics(batch, t.advantages(batch.rewards), Updated({}, {}, 0), step_time=1.0)
    assert (m.get("dapo/refill_rounds"), m.get("dapo/groups_dropped")) == ((1, 1) if dynamic else (None, None))
    assert ({"dapo/refill_rounds", "dapo/groups_dropped"} <= set(t.metric_keys())) == dynamic
    groups = [t.parts.examples[i]["prompt"] for i in batch.samples.prompt_index[::G]]
    assert len(batch.samples) == len(batch.rewards) == 4 * G
    if dynamic:
        assert sorted(groups[:3]) == others  # the first round's groups with a signal, the flat one dropped
        assert t.parts.source.stream.position == 5 and len(batch.scored) == 5 * G  # one prompt drawn to refill
        assert all(batch.rewards[g * G:(g + 1) * G].std() > 0 for g in range(3))
    else:
        assert sorted(groups) == sorted([FLAT_PROMPT, *others])
        assert t.parts.source.stream.position == 4 and len(batch.scored) == 4 * G
        flat = groups.index(FLAT_PROMPT)
        assert (t.advantages(batch.rewards)[flat * G:(flat + 1) * G] == 0).all()  # what it would have cost


def test_overlong_penalty_values():
    from backstream.rl.records import Samples
    from backstream.rl.scoring import shaping

    r = Samples(prompt_index=[0, 0, 0], prompt_ids=[torch.tensor([1])] * 3,
                completion_ids=[torch.zeros(n, dtype=torch.long) for n in (4, 7, 8)],
                logprobs=[torch.zeros(n) for n in (4, 7, 8)], finish_reason=["eos", "eos", "length"], group_size=3)
    shaping_cfg = config.RewardConfig(overlong="penalty", overlong_buffer=4)
    # max_new 8, buffer 4: no penalty up to 4 tokens, then −(len − 4)/4
    shaped, keep = shaping.overlong_shaping(r, torch.ones(3), shaping_cfg, 8)
    assert torch.allclose(shaped, torch.tensor([1.0, 0.25, 0.0])) and keep.all()


def test_lora_run_resumes_bitwise(tmp_path):
    common = ['model.dtype="float32"', "model.lora_r=4", "train.save_every=1", "optim.lr=1e-2"]
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "straight", "train.steps=2", *common), model=model, tokenizer=tok)
    straight = weights(model)
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "split", "train.steps=1", *common), model=model, tokenizer=tok)
    model, tok = tiny(torch.float32)
    trainer.train(resume=str(tmp_path / "split"), overrides=["train.steps=2"], model=model, tokenizer=tok)
    resumed = weights(model)
    assert any("lora_" in k for k in resumed)
    for k, v in resumed.items():
        assert torch.equal(v, straight[k]), k
    assert os.path.exists(tmp_path / "split" / "checkpoints" / "step-2" / "adapter_model.safetensors")


def test_sigterm_checkpoints_at_the_next_step_boundary(tmp_path, capsys):
    killer = tmp_path / "killer.py"
    killer.write_text(
        "import os, signal\nn = [0]\n"
        "def reward(completions, **kw):\n"
        "    n[0] += 1\n"
        "    if n[0] == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return [c.count('1') / max(1, len(c)) for c in completions]\n")
    model, tok = tiny(torch.float32)
    with pytest.raises(trainer.Interrupted) as stopped:  # the run stops non-zero, saying where to resume
        trainer.train(run_cfg(tmp_path, "sig", 'model.dtype="float32"', "train.steps=10",
                              f"reward.functions=['{killer}:reward']"), model=model, tokenizer=tok)
    run = stopped.value.run_dir
    assert stopped.value.exit_code == 143 and stopped.value.saved and "--resume" in str(stopped.value)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert len(rows) == 2  # the step in flight finished, then the run stopped
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == 2
    assert "SIGTERM received: finishing step 2 and saving" in capsys.readouterr().err


def test_a_sigint_between_steps_says_that_no_other_step_runs(tmp_path, monkeypatch, capsys):
    """A SIGINT while step 1's checkpoint is written, after its line (issue 32: the run said it was
    finishing step 2, then stopped after step 1): the message says what happens, step 1 is saved and
    no step 2 starts. A SIGINT inside a step still finishes that step."""
    save, calls = trainer.Trainer.save, []

    def interrupted_save(self):
        calls.append(self.step)
        if calls == [1]:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs now, before the checkpoint is written
        return save(self)

    monkeypatch.setattr(trainer.Trainer, "save", interrupted_save)
    model, tok = tiny(torch.float32)
    with pytest.raises(trainer.Interrupted) as stopped:
        trainer.train(run_cfg(tmp_path, "run", 'model.dtype="float32"', "train.steps=10"), model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert "SIGINT received: step 1 is done: saving it and stopping" in err and "finishing step" not in err
    assert stopped.value.exit_code == 130 and stopped.value.saved and stopped.value.step == 1
    run = stopped.value.run_dir
    assert [json.loads(x)["step"] for x in open(os.path.join(run, "metrics.jsonl"))] == [1]
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == 1


@pytest.mark.parametrize("name", ["rmsprop", "muon"])
def test_other_optimizers(tmp_path, name):
    if name == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    model, tok = tiny(torch.float32)
    extra = ["model.lora_r=4"] if name == "muon" else []  # Muon takes 2-D weights only
    before = weights(model)
    trainer.train(run_cfg(tmp_path, name, 'model.dtype="float32"', f'optim.name="{name}"', "train.steps=2",
                          "reward.functions=['rewards_for_tests:count_digits']", *extra), model=model, tokenizer=tok)
    after = weights(model)
    if name == "muon":  # LoRA B starts at zero: any update shows
        assert any(float(v.abs().sum()) > 0 for k, v in after.items() if "lora_B" in k)
    else:
        assert rel(after, before) > 0


@pytest.mark.parametrize("lora", [0, 4])
def test_kl_to_the_reference_policy(tmp_path, lora):
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, f"kl{lora}", 'model.dtype="float32"', "update.kl_reference=true",
                                "loss.kl_coef=0.1", f"model.lora_r={lora}", "train.steps=3",
                                "reward.functions=['rewards_for_tests:count_digits']"), model=model, tokenizer=tok)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert rows[-1]["loss/kl"] > 0


@pytest.mark.slow
def test_hub_id_loads_through_the_hub_cache(tmp_path):
    """`model.name = "org/name"` goes through the Hub as for any user; here the Hub is a local cache
    with HF_HUB_OFFLINE=1 (no network in tests), in a fresh process so the Hub settings apply."""
    import subprocess
    import sys

    model, tok = tiny(torch.float32)
    repo = tmp_path / "hub" / "models--acme--tiny-rl"
    snap = repo / "snapshots" / ("0" * 40)
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "backstream.cli", "train", "--set", 'model.name="acme/tiny-rl"',
           "--set", 'model.dtype="float32"', "--set", "train.steps=1", "--set", "train.prompts_per_step=2",
           "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=4", "--set", "train.progress=false",
           "--set", f'train.output_dir="{out}"']
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert 'name = "acme/tiny-rl"' in (out / "config.toml").read_text()
    assert Qwen3ForCausalLM.from_pretrained(checkpoint.latest(str(out))) is not None
    # a hub id that is not in the cache: a clear error naming the key, nothing written
    cmd[5] = 'model.name="acme/missing"'
    cmd[-1] = f'train.output_dir="{tmp_path / "run2"}"'
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "model.name: cannot load 'acme/missing'" in res.stderr
    assert no_run_written(tmp_path / "run2")


class _RunsCode:
    """Unpickling this would call os.system: what a checkpoint from anywhere could hide."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/backstream_pwned",))


def test_trainer_state_loads_plain_data_only(tmp_path):
    """A trainer_state.pt that holds code is refused by name, and the code never runs."""
    from backstream import checkpoint

    marker = "/tmp/backstream_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    folder = tmp_path / "step-1"
    folder.mkdir()
    torch.save({"step": 1, "evil": _RunsCode()}, folder / checkpoint.STATE)
    with pytest.raises(ValueError, match="resume: .*trainer_state.pt holds objects other than tensors"):
        checkpoint.load_state(str(folder))
    assert not os.path.exists(marker)
    torch.save({"step": 1, "rng": {"python": (3, tuple(range(5)), None), "torch": torch.zeros(3, dtype=torch.uint8)}},
               folder / checkpoint.STATE)
    assert checkpoint.load_state(str(folder))["step"] == 1


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    """optim.lr = 1e30 turns the weights to inf after one step: the following steps' gradient norms
    are NaN/inf, skipped and counted, and `max_nonfinite_steps` of them in a row stop the run with a
    message naming the key, the step and the causes; no checkpoint is written from the bad weights.
    The seed is one whose groups still differ in reward after the blow-up (the overflowed policy can
    also turn deterministic: every advantage 0, no step to skip, which the trainer warns about)."""
    model, tok = tiny(torch.float32)
    cfg = run_cfg(tmp_path, "nan", 'model.dtype="float32"', "optim.lr=1e30", "optim.max_grad_norm=0",
                  "train.steps=10", "train.save_every=1", "optim.max_nonfinite_steps=2", "train.seed=1")
    with pytest.raises(trainer.NonFiniteError, match=r"optim.max_nonfinite_steps: 2 optimizer steps in a row .*"
                                                      r"NaN/inf.*optim.lr = 1e\+30"):
        trainer.train(cfg, model=model, tokenizer=tok)
    run = tmp_path / "nan"
    for ck in checkpoint.list_checkpoints(str(run)):  # every checkpoint written holds finite weights
        weights = load_file(os.path.join(ck, "model.safetensors"))
        assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert rows and all("optim/skipped_nonfinite" in r for r in rows)


def test_no_checkpoint_from_nonfinite_weights(tmp_path):
    model, tok = tiny(torch.float32)
    t = trainer.Trainer(run_cfg(tmp_path, "w", 'model.dtype="float32"'), model=model, tokenizer=tok)
    with torch.no_grad():
        next(t.model.parameters())[0, 0] = float("nan")
    with pytest.raises(trainer.NonFiniteError, match="hold NaN/inf at step 0; no checkpoint is written"):
        t.save()
    assert checkpoint.list_checkpoints(str(tmp_path / "w")) == []
    t.logger.close()


def test_model_weights_from_safetensors_only(tmp_path):
    """A folder whose weights are a pickled pytorch_model.bin is refused (loading it could run code)."""
    model, tok = tiny(torch.float32)
    folder = tmp_path / "bin_only"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    os.remove(folder / "model.safetensors")  # the same weights, pickled
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert (folder / "pytorch_model.bin").exists() and not (folder / "model.safetensors").exists()
    cfg = run_cfg(tmp_path, "b", 'model.dtype="float32"', f'model.name="{folder}"')
    with pytest.raises(ValueError, match="model.name: cannot load"):
        trainer.train(cfg)
    assert not (tmp_path / "b").exists()  # refused before the run folder was made


def test_a_saved_adapter_names_its_base_and_loads_alone(tmp_path, recwarn):
    """A LoRA run's checkpoint: adapter_config.json names the base model (here the built-in one's
    folder), AutoPeftModelForCausalLM loads it with nothing else said, and no warning claims the base
    was renamed."""
    from peft import AutoPeftModelForCausalLM

    from backstream.default_model import DEFAULT_MODEL_DIR

    run = trainer.train(run_cfg(tmp_path, "lora", 'model.name="default"', 'model.dtype="float32"', "model.lora_r=4",
                                "train.steps=1"))
    assert not [w for w in recwarn if "renamed" in str(w.message)]
    ckpt = checkpoint.latest(run)
    with open(os.path.join(ckpt, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == str(DEFAULT_MODEL_DIR)
    loaded = AutoPeftModelForCausalLM.from_pretrained(ckpt)
    assert any("lora_A" in n for n, _ in loaded.named_parameters())


@pytest.mark.slow
def test_one_sample_from_the_step_to_the_streamed_backward_visits_no_module_twice(tmp_path):
    """Data goes down, never down and back up (issue 58): on the call stack of a whole step, the
    package's modules (consecutive frames of one module counted once) never repeat, from the trainer
    through the rollout source, the sampler, the backend, the decoder, the rewards, the learner and
    the streamed backward. What a module hands down and is called back through (a lambda or nested
    function: a progress line, an episode's `turn`, the engine's FSDP wrapper; a method of an object it
    hands down: the engine's block batch the attention adapter reads) runs as its own code again; the
    objective the engine is handed (stream/objective.py's contract) is a plug-in whose calls are not
    followed. A function of a module above on the path, called by name, is what fails: rollout.py's
    Sampler → backends/local.py → rollout.py's generate did."""
    import sys

    from backstream.stream.objective import Objective

    model, tok = tiny(torch.float64)
    t = trainer.Trainer(run_cfg(tmp_path, "trace", "train.steps=1"), model=model, tokenizer=tok)
    paths: set[tuple[str, ...]] = set()

    def path_of(frame) -> tuple[str, ...]:
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        path: list[str] = []
        for f in reversed(frames):
            name, code = f.f_globals.get("__name__", ""), f.f_code
            if not name.startswith("backstream"):
                continue
            if code.co_varnames[:1] == ("self",) and isinstance(f.f_locals.get("self"), Objective):
                break
            called_back = code.co_name == "<lambda>" or "<locals>" in code.co_qualname or \
                code.co_varnames[:1] in (("self",), ("cls",))
            if called_back and name in path[:-1]:  # a callable it handed down: its own module's code again
                del path[len(path) - path[::-1].index(name):]
                continue
            if not path or path[-1] != name:
                path.append(name)
        return tuple(path)

    def watch(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("backstream"):
            paths.add(path_of(frame))

    sys.setprofile(watch)
    try:
        t.train_step()
    finally:
        sys.setprofile(None)
        t.close()
        t.run_folder.release()
    seen = {m for p in paths for m in p}
    assert {"backstream.trainer", "backstream.rl.rollout.source", "backstream.rl.backends.local.decode",
            "backstream.rl.scoring.rewards", "backstream.rl.update.learner", "backstream.stream.engine"} <= seen
    assert max(map(len, paths)) >= 6  # the walk saw the sampler's path down to the decoder
    twice = sorted(p for p in paths if len(p) != len(set(p)))
    assert not twice, "\n".join(" > ".join(p) for p in twice[:6])
