"""Asynchronous training on a real vLLM server (issue 33): rollout.max_staleness = k >= 1.

- a publish in the middle of a request: every token records the weight version it was sampled with
  (the server's own labels); with rollout.in_flight = "resume" the request is aborted and resumed from
  its tokens so far, each part's log-probs those of the weights that sampled it; with "keep" it goes
  on with the new weights after the old K/V;
- a run with k = 1 against a slowed server: every trained token within the bound (the producer checks
  each one, the metrics show the steps' maxima), tokens one step behind do occur, the prompts trained
  are the stream's in order, none twice or skipped, also across a checkpoint and `--resume` (the
  groups the producer had started beyond the checkpoint are re-sampled), and a server killed with
  groups in flight stops the step that takes them with the error naming vllm.log;
- episodes (toolcalc) with k = 1 and in_flight = "keep": tool calls of the next step run while the
  learner trains, per-token versions within the bound.
"""

import copy
import dataclasses
import json
import os
import threading
import time

import pytest
import torch
from helpers import KEY, kill_the_server_then_step, run_cfg
from vllm_helpers import Served

from backstream import config, logprobs, trainer
from backstream.default_model import load_default
from backstream.rl.backends import build_backend
from backstream.rl.backends.vllm.setup import default_dir, python_of, setup
from backstream.rl.data.prompts import PromptStream

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python():
    python = python_of(default_dir())
    return str(python if python.is_file() else setup())


def _learner_logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    seq = torch.tensor(prompt + ids)
    mask = torch.arange(len(seq)) >= len(prompt)
    with torch.no_grad():
        return logprobs(model, [seq], [mask])[0][len(prompt):].double()


@pytest.mark.parametrize("in_flight", ["resume", "keep"])
def test_a_publish_mid_request_labels_every_token_with_its_version(tmp_path, vllm_python, in_flight):
    """On a server of its own, the request the first long one it serves (3,000 tokens in 2-5 s here). On
    a server that had served one before, this process stalls on 2 shared cores until the request ends,
    so the publish came after it (measured: the main thread's 0.1-s sleep took 3-5 s, with the request
    in a thread of this process, urllib or curl alike; no stall with the request in another process,
    nor in another process's sleep; cause not found): the session's server is not used."""
    model, tok = load_default()
    model.eval()
    srv = Served(tok, str(tmp_path), model, f'vllm.python="{vllm_python}"', "rollout.max_staleness=1",
                 f'rollout.in_flight="{in_flight}"')
    try:
        srv.publish(model)  # started, with the initial weights
        old = copy.deepcopy(model)
        prompt = tok("12+34=", add_special_tokens=True)["input_ids"]
        params = {"max_tokens": 3000, "temperature": 1.0, "ignore_eos": True}
        out = {}
        member = srv.pool.alive()[0]
        request = threading.Thread(target=lambda: out.update(
            x=srv.backend.requests.generate(member, prompt, params, 1, 5, [])[0]))
        request.start()
        time.sleep(1.0)  # some hundred tokens into the request
        srv.step(model)
        srv.publish(model)  # the publish, with the request in flight
        request.join()
    finally:
        srv.close()
    x = out["x"]
    assert len(x.ids) == 3000 and x.reason == "length"
    switch = int((x.versions == 0).sum())
    assert 0 < switch < 3000, "the publish came after the request ended: nothing was tested"
    assert torch.equal(x.versions, torch.cat([torch.zeros(switch), torch.ones(3000 - switch)]).long())
    before = _learner_logprobs(old, prompt, x.ids)
    after = _learner_logprobs(model, prompt, x.ids)
    lp = x.logprobs.double()
    # the tokens before the publish are the old weights' (the first tokens, whose K/V nothing but the
    # old weights computed)
    assert float((lp[:switch] - before[:switch]).abs().max()) <= 1e-4
    if in_flight == "resume":  # re-prefilled with the new weights: exactly the new policy's after the switch
        assert float((lp[switch:] - after[switch:]).abs().max()) <= 1e-4
    else:  # kept: the new weights over the old K/V, which neither policy computes alone
        gap_new = float((lp[switch:] - after[switch:]).abs().median())
        gap_old = float((lp[switch:] - before[switch:]).abs().median())
        assert gap_new < gap_old


def _async_run(tmp_path, name, *extra, url: str = ""):
    """k = 1 on the server at `url` (the session's, conftest.py), or one the run starts."""
    where = [f'vllm.url="{url}"', f'vllm.api_key="{KEY}"'] if url else []
    return run_cfg(tmp_path, name, 'model.name="default"', 'model.dtype="float32"', 'rollout.backend="vllm"',
                   "data.num_examples=64", "rollout.max_staleness=1", "train.log_episodes=1000", *where, *extra)


def _trained_prompts(run) -> list[list[int]]:
    """Per step, the prompt indices of the samples the step trained (episodes.jsonl)."""
    steps: dict[int, list[int]] = {}
    for line in open(os.path.join(run, "episodes.jsonl")):
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row["prompt_index"])
    return [steps[s] for s in sorted(steps)]


class Slowed:
    """The run's server backend, each group's request 0.3 s late: a server slower than the learner, so that
    groups are in flight across publishes."""

    def __init__(self, cfg, run_dir: str):
        tok = load_default()[1]
        self.sampling = build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=cfg.train.seed,
                                      tokenizer=tok, eos=[tok.eos_token_id], run_dir=run_dir, model=None)
        self.inner = self.sampling.backend

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def complete(self, *args, **kw):
        time.sleep(0.3)
        return self.inner.complete(*args, **kw)

    def sides(self):
        return dataclasses.replace(self.sampling, backend=self)


def test_a_run_one_step_ahead_keeps_the_bound_and_resumes_without_taking_a_prompt_twice(tmp_path, vllm_python,
                                                                                       vllm_served):
    cfg = _async_run(tmp_path, "run", 'data.task="arith"', "train.steps=2", "train.save_every=2",
                     "rollout.max_new_tokens=6", url=vllm_served.urls[0])
    run = trainer.train(cfg, backend=Slowed(cfg, cfg.train.output_dir).sides())
    more = ["train.steps=4", f'vllm.api_key="{KEY}"']  # a run folder keeps no key: given again to resume
    resumed = config.load(os.path.join(run, "config.toml"), more)
    run = trainer.train(resume=run, overrides=more, backend=Slowed(resumed, run).sides())
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert any(r["rollout/staleness_max"] == 1 for r in rows), "no token was a step behind: nothing was tested"
    assert all(r["mismatch/kl_staleness_0"] is None or r["mismatch/kl_staleness_0"] < 1e-4 for r in rows)
    # the stream's prompts in order, each step's P groups of G samples: none twice, none skipped, though
    # the producer had started step 3's groups (and 4's) when step 2's checkpoint was written
    P, G = cfg.train.prompts_per_step, cfg.rollout.group_size
    order = PromptStream(64, cfg.train.seed).take(4 * P)
    assert _trained_prompts(run) == [[i for i in order[s * P:(s + 1) * P] for _ in range(G)] for s in range(4)]
    assert not os.path.exists(os.path.join(run, "vllm"))
    # the server dies with groups in flight: the step that takes them stops with the error naming vllm.log
    # on a server the run starts (the session's must live on): it dies with groups in flight
    again = config.load(os.path.join(run, "config.toml"), ["train.steps=6", 'vllm.url=""', 'vllm.api_key=""',
                                                           f'vllm.python="{vllm_python}"'])
    t = trainer.Trainer(again, run_dir=run, resume=True, backend=Slowed(again, run).sides())
    step5 = t.train_step()
    assert step5["step"] == 5 and step5["vllm/weight_version"] == 4  # started with the checkpoint's weights
    kill_the_server_then_step(t)


def test_episodes_one_step_ahead_with_requests_kept_across_publishes(tmp_path, vllm_served):
    cfg = _async_run(tmp_path, "run", 'data.task="toolcalc"', "train.steps=3", 'rollout.in_flight="keep"',
                     "train.prompts_per_step=4", "rollout.group_size=4", url=vllm_served.urls[0])
    run = trainer.train(cfg)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(r["episode/turns/mean"] >= 1 for r in rows)
    P, G = 4, 4
    order = PromptStream(64, cfg.train.seed).take(3 * P)
    assert _trained_prompts(run) == [[i for i in order[s * P:(s + 1) * P] for _ in range(G)] for s in range(3)]


def test_an_agent_program_one_step_ahead(tmp_path, vllm_served):
    """toolcalc played by the shipped agent program (the `openai` client, through the run's endpoint)
    with the server sampling a step ahead: every trained token within one version, the trained prompts
    the stream's in order, no agent error."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "toolcalc_agent.py")
    cfg = _async_run(tmp_path, "run", 'data.task="toolcalc"', "train.steps=3",
                     f'env.agent="{os.path.abspath(example)}:agent"', 'env.format="plain"', "env.max_turns=4",
                     "rollout.max_new_tokens=32", "train.prompts_per_step=4", "rollout.group_size=4",
                     url=vllm_served.urls[0])
    run = trainer.train(cfg)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1 and r["episode/agent_errors"] == 0 for r in rows)
    assert all(r["episode/requests/mean"] >= 1 for r in rows)
    P, G = 4, 4
    order = PromptStream(64, cfg.train.seed).take(3 * P)
    assert _trained_prompts(run) == [[i for i in order[s * P:(s + 1) * P] for _ in range(G)] for s in range(3)]
