"""Agent programs trained through the run's endpoint (rl/rollout/programs.py): every sampled token is
trained once, in exactly the context it was sampled in, across the branches a rewritten history makes
(float64: the learner's log-probs of the trained sequences equal the sampler's); the whole loop with
a thinking template, streamed = reference; agents that fail; the config's refusals."""

import copy
import json
import os

import pytest
import torch

pytest.importorskip("openai")  # the extras `agent` and `agent-test` (.ci/run installs them)
pytest.importorskip("fastapi")

from helpers import rel, run_cfg, tiny, weights
from test_endpoint import THINKING

from backstream import config, trainer
from backstream.checks import UserError
from backstream.rl.agent.env import EnvConfig
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.backend import LocalBackend
from backstream.rl.rollout.programs import AgentSampler
from backstream.stream.engine import logprobs


class Recorder(LocalBackend):
    """The local backend, recording what each request was fed and what it answered."""

    def __init__(self, *a):
        super().__init__(*a)
        self.calls = []

    def _request(self, model, version, ids, max_tokens, seed):
        out = super()._request(model, version, ids, max_tokens, seed)
        self.calls.append((list(ids), list(out.ids)))
        return out


def _chat_tiny():
    model, tok = tiny(torch.float64)
    tok = copy.copy(tok)
    tok.chat_template = THINKING
    return model, tok


def test_every_sampled_token_is_trained_once_in_the_context_it_was_sampled_in():
    """4 episodes of an agent that rewrites its history (reasoning stripped by the template, a summary):
    each request's answer appears in exactly one trained sequence, right after exactly the ids the
    sampler was fed, with its loss there and nowhere else; the learner's float64 log-probs over every
    trained sequence equal the sampler's at every trained token; branches are counted."""
    model, tok = _chat_tiny()
    cfg = SamplingParams(max_new_tokens=5)
    eos = [tok.eos_token_id]
    answers = Recorder(cfg, eos, tok)
    answers.weights.sync(model, 0)
    sampler = AgentSampler(cfg, 2, EnvConfig(agent="agents_for_tests:rewriting_agent", format="chat"), tok, eos, 256,
                           answers)
    try:
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        r = sampler.sample([{"prompt": "12+3="}, {"prompt": "7+70="}], [0, 1], gens).samples
    finally:
        sampler.close()
    assert len(r) == 4 and len(answers.calls) == 12
    assert all(e.turns == 3 and e.branches >= 1 for e in r.episodes)  # the summary at least diverges
    assert sampler.metrics(r)["episode/branches/mean"] >= 1
    view = r.training(0)
    assert sum(int(m.sum()) for m in view.mask) == sum(len(a) for _, a in answers.calls)  # each token once
    for fed, answer in answers.calls:
        where = [(s, len(fed)) for s, seq in enumerate(view.seqs)
                 if seq[:len(fed)].tolist() == fed and seq[len(fed):len(fed) + len(answer)].tolist() == answer
                 and bool(view.mask[s][len(fed):len(fed) + len(answer)].all())]
        assert len(where) == 1, (fed, answer, where)
    learner = logprobs(model, view.seqs, view.mask)
    for lp, mine, m in zip(view.logprobs, learner, view.mask):
        assert torch.isnan(lp[~m]).all()
        assert (lp[m] - mine[m]).abs().max() <= 1e-10
    # what the rewards get: the final conversation after the prompt, the answer last with its finish_reason
    completions, prompts, extra = sampler.reward_inputs(r, [])
    assert prompts == ["12+3=", "12+3=", "7+70=", "7+70="]
    assert all(c[-1]["role"] == "assistant" and "finish_reason" in c[-1] for c in completions)
    assert [e.get_reward() for e in extra["environments"]] == [e.env.reward for e in r.episodes]


def _agent_cfg(tmp_path, name, *extra):
    return run_cfg(tmp_path, name, 'env.agent="agents_for_tests:rewriting_agent"', 'env.format="chat"',
                   "env.max_turns=4", "reward.functions=['env']", "rollout.max_new_tokens=5", *extra)


@pytest.mark.slow
def test_the_loop_trains_an_agent_programs_branches_streamed_as_the_reference(tmp_path):
    """Two steps of the whole loop on the rewriting agent with a thinking template: the streamed and the
    reference backward make the same update (float64), the forks included; the metrics count requests
    and branches, and the sampler/learner mismatch is float64 noise."""
    results = {}
    for backward in ("stream", "reference"):
        model, tok = _chat_tiny()
        trainer.train(_agent_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=4",
                                 "train.steps=2"), model=model, tokenizer=tok)
        results[backward] = weights(model)
    assert rel(results["stream"], weights(tiny()[0])) > 1e-4
    assert rel(results["stream"], results["reference"]) <= 1e-10
    rows = [json.loads(x) for x in open(os.path.join(str(tmp_path / "stream"), "metrics.jsonl"))]
    for row in rows:
        assert row["episode/requests/mean"] == 3 and row["episode/branches/mean"] >= 1
        assert row["episode/agent_errors"] == 0 and row["mismatch/kl"] < 1e-12
        assert 0 < row["tree/tokens_unique"] < row["tree/tokens_total"]


def test_a_failing_agent_scores_zero_and_the_run_goes_on(tmp_path):
    model, tok = _chat_tiny()
    run = trainer.train(run_cfg(tmp_path, "fail", 'env.agent="agents_for_tests:failing_agent"', 'env.format="chat"',
                                "reward.functions=['env']", "train.steps=1", "data.task=\"arith\""),
                        model=model, tokenizer=tok)
    (row,) = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    episodes = [json.loads(x) for x in open(os.path.join(run, "episodes.jsonl"))] if os.path.exists(
        os.path.join(run, "episodes.jsonl")) else []
    assert 0 < row["episode/agent_errors"] < 1 and row["episode/agent_timeouts"] == 0
    assert row["reward/env"] == pytest.approx(1 - row["episode/agent_errors"])  # 0 for each failed one
    assert all(e["reward"] in (0.0, 1.0) for e in episodes)


def test_an_agent_whose_tools_the_template_drops_stops_before_step_one(tmp_path):
    """Every episode's requests carry tools that the chat template renders no trace of: the run stops with
    the template, the tools, the fix and the episode count, before anything is trained."""
    model, tok = _chat_tiny()
    with pytest.raises(UserError, match=r"^env: 4 of 4 agent episodes had requests refused: the request's tools "
                       r"\(add\) are not in the prompt: .*\"plain\".* Every episode of the round failed so"):
        trainer.train(run_cfg(tmp_path, "dropped", 'env.agent="agents_for_tests:calculator_agent"',
                              'env.format="chat"', "train.prompts_per_step=1", 'data.task="arith"'),
                      model=model, tokenizer=tok)
    metrics = tmp_path / "dropped" / "metrics.jsonl"
    assert not os.path.exists(metrics) or not open(metrics).read().strip()  # no step was trained


@pytest.mark.parametrize("extra, words", [
    (['env.agent="agents_for_tests:rewriting_agent"', 'env.agent_command="python a.py"'], "both are set"),
    (['env.agent="agents_for_tests:rewriting_agent"', 'env.tools=["envs_for_tests:double"]'],
     "runs its own tools"),
    (['env.agent="agents_for_tests:rewriting_agent"', "engine.reuse_rollout_kv=true"], "hand no K/V"),
    (['env.agent="agents_for_tests:rewriting_agent"', 'env.agent_timeout_s=0'], "env.agent_timeout_s: got 0"),
    (['env.agent="rewriting_agent"'], "expected \"file.py:function\""),
])
def test_bad_agent_configs_are_refused_by_name(tmp_path, extra, words):
    with pytest.raises(UserError, match=words):
        run_cfg(tmp_path, "bad", *extra).validate()


def test_toolcalc_with_an_agent_program_drops_the_tasks_own_environment():
    cfg = config.load(None, ['data.task="toolcalc"', 'env.agent="examples/toolcalc_agent.py:agent"'])
    assert cfg.env.factory == "" and cfg.env.max_turns == 4


@pytest.mark.slow
def test_an_agents_sdk_program_trains_on_toolcalc_with_the_default_model(tmp_path):
    """One step of the built-in toolcalc task on the built-in model, played by an OpenAI Agents SDK
    agent through the endpoint: requests and tool calls counted, no agent error, the sampler's and the
    learner's log-probs agree (the trained contexts are the sampled ones)."""
    pytest.importorskip("agents")
    cfg = config.load(None, ['data.task="toolcalc"', 'env.agent="agents_for_tests:sdk_agent"', 'env.format="plain"',
                             "train.steps=1", "train.prompts_per_step=4", "rollout.group_size=4",
                             "train.progress=false", "train.plots=false", f'train.output_dir="{tmp_path / "sdk"}"'])
    run = trainer.train(cfg)
    (row,) = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert row["episode/requests/mean"] >= 1 and row["episode/agent_errors"] == 0
    assert row["mismatch/kl"] < 1e-6 and row["reward/exact_match"] is not None


@pytest.mark.parametrize("env_kw, counted", [
    ({"agent": "agents_for_tests:sleeping_agent", "agent_timeout_s": 1}, "episode/agent_timeouts"),
    ({"agent_command": "python -c 'import sys; sys.exit(3)'"}, "episode/agent_errors"),
    ({"agent_command": "echo no number; echo 0.25"}, None),
])
def test_programs_that_fail_or_hang_end_their_episode_with_reward_zero(env_kw, counted):
    """A function that overruns env.agent_timeout_s, a command that exits non-zero: reward 0 as "env",
    counted, the round ends; a command's last line is its reward."""
    model, tok = _chat_tiny()
    cfg = SamplingParams(max_new_tokens=4)
    backend = LocalBackend(cfg, [tok.eos_token_id], tok)
    backend.weights.sync(model, 0)
    sampler = AgentSampler(cfg, 2, EnvConfig(format="chat", **env_kw), tok, [tok.eos_token_id], 256, backend)
    try:
        r = sampler.sample([{"prompt": "1+1="}], [0], [torch.Generator().manual_seed(0)]).samples
    finally:
        sampler.close()
    m = sampler.metrics(r)
    rewards = [e.env.get_reward() for e in r.episodes]
    if counted is None:
        assert rewards == [0.25, 0.25] and m["episode/agent_errors"] == m["episode/agent_timeouts"] == 0
    else:
        assert rewards == [0.0, 0.0] and m[counted] == 1.0 and all(e.env.discarded for e in r.episodes)
        assert r.finish_reason == ["timeout" if "timeout" in counted else "error"] * 2
    assert len(r) == 2 and all(len(c) == 0 for c in r.completion_ids)  # no request: nothing to train


def test_a_request_that_extends_the_last_one_continues_its_kv_exactly():
    """An agent that appends (the calculator agent, four requests): each later request prefills only its
    new tokens after the K/V of the one before (reuse on, from 1 token); the sampler's float64 log-probs
    still equal the learner's on the trained sequence, and nothing branches."""
    model, tok = tiny(torch.float64)
    cfg = SamplingParams(max_new_tokens=6)
    answers = LocalBackend(cfg, [tok.eos_token_id], tok)
    answers.weights.sync(model, 0)
    answers.reuse_min = 1
    sampler = AgentSampler(cfg, 2, EnvConfig(agent="agents_for_tests:appending_agent", format="plain"), tok,
                           [tok.eos_token_id], 256, answers)
    try:
        r = sampler.sample([{"prompt": "12+34="}], [0], [torch.Generator().manual_seed(3)]).samples
    finally:
        sampler.close()
    assert answers.reused > 0 and all(e.turns == 4 and e.branches == 0 for e in r.episodes)
    view = r.training(0)
    assert len(view.seqs) == 2  # one sequence per episode: no fork
    learner = logprobs(model, view.seqs, view.mask)
    for lp, mine, m in zip(view.logprobs, learner, view.mask):
        assert (lp[m] - mine[m]).abs().max() <= 1e-10
