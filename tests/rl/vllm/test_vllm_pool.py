"""Rollouts past one server (issue 47): a pool of vLLM servers, the weights by vLLM's weight-transfer
engine, on real servers.

- two servers the run starts: both serve (`vllm/requests/<i>` > 0 on each), every group's samples come
  from one server (one request each), the sampler's log-probs are the learner's at every step
  (`mismatch/kl` <= 1e-9, float32); one killed with SIGKILL mid-run: the run says so and goes on with
  the other, the dead one is restarted and rejoins with the current weights; nothing outlives the run;
- the session's two servers (vllm.urls): a LoRA policy (its adapter) and toolcalc episodes, exact at
  every step, on both servers; a publish whose servers drop the weights is an error naming them;
- torchrun, 2 ranks, the two servers, the transfer, one step ahead (rollout.max_staleness = 1).
"""

import json
import logging
import os
import signal
import time

import pytest
import torch
from helpers import run_cfg
from vllm_helpers import Served, urls_of

from backstream import logprobs, trainer
from backstream.default_model import load_default
from backstream.lifetime import group_alive
from backstream.rl.backends.vllm.weights.sync import PublishError

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
EXACT = 1e-9  # mismatch/kl of a server that samples the learner's weights (float32: ~1e-13 here)


def _run(tmp_path, name, *extra):
    return run_cfg(tmp_path, name, 'model.name="default"', 'model.dtype="float32"', 'rollout.backend="vllm"',
                   'data.task="arith"', "data.num_examples=64", "rollout.max_new_tokens=6",
                   "train.prompts_per_step=4", "rollout.group_size=4", *extra)


def _exact(row) -> bool:
    return row["batch/zero_adv_frac"] == 1 or (row["mismatch/kl"] is not None and row["mismatch/kl"] <= EXACT)


def test_two_servers_the_run_starts_share_its_groups_and_one_killed_comes_back(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="backstream")
    from helpers import vllm_python

    t = trainer.Trainer(_run(tmp_path, "run", "vllm.servers=2", f'vllm.python="{vllm_python()}"', "train.steps=30",
                             "vllm.start_timeout_s=300"))
    pool = t.parts.sampling.weights.pool
    try:
        first = t.train_step()
        assert t.parts.sampling.weights.kind == "transfer" and "by transfer" in caplog.text
        assert first["vllm/servers_alive"] == 2 and first["vllm/requests/0"] > 0 and first["vllm/requests/1"] > 0
        assert first["vllm/requests/0"] + first["vllm/requests/1"] == 4  # a group is one request: one server
        assert _exact(first), first["mismatch/kl"]
        logs = [m.server.log_path for m in pool.members]
        assert [os.path.basename(x) for x in logs] == ["vllm.log", "vllm-1.log"]
        dead = pool.members[1].server.proc.pid
        os.killpg(dead, signal.SIGKILL)  # the guard, the API server, its engine and worker
        rows, deadline = [], time.monotonic() + 300
        while not rows or rows[-1]["vllm/servers_alive"] < 2 or rows[-1]["vllm/requests/1"] == 0:
            assert time.monotonic() < deadline, rows
            rows.append(t.train_step())
        assert f"vLLM server 1 (its log: {logs[1]}) died or stopped answering" in caplog.text
        assert "restarted with the current weights" in caplog.text and "is back" in caplog.text
        assert rows[0]["vllm/servers_alive"] == 1 and rows[0]["vllm/requests/1"] == 0  # the other served the step
        assert all(_exact(r) for r in rows), [r["mismatch/kl"] for r in rows]  # the restarted one got the weights
        assert pool.members[1].server.proc.pid != dead and not group_alive(dead)
    finally:
        procs = [m.server.proc for m in pool.members]
        t.close()
    assert not any(group_alive(p.pid) for p in procs)  # nothing the run started outlives it


def test_a_lora_policy_and_episodes_on_two_servers_of_your_own(tmp_path, vllm_served):
    """The session's two servers (vllm.urls): a LoRA policy publishes its adapter to both, toolcalc
    episodes play on both (each episode's turns on one), every step exact. The servers first hold
    another run's trained weights: the LoRA run's adapter must sit on its own base (it sampled 1.6 off
    its learner on the other's, before the base was published to servers of your own)."""
    other, tok = load_default()
    srv = Served(tok, str(tmp_path / "other"), other, *urls_of(vllm_served))
    try:
        srv.step(other, 0.5)
        srv.publish(other)
    finally:
        srv.close()
    lora = trainer.train(_run(tmp_path, "lora", *urls_of(vllm_served), "model.lora_r=4", "train.steps=2",
                              "optim.lr=1e-2"))
    episodes = trainer.train(_run(tmp_path, "toolcalc", *urls_of(vllm_served), 'data.task="toolcalc"',
                                  "train.steps=2", "rollout.max_new_tokens=32"))
    for run in (lora, episodes):
        rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2] and all(_exact(r) for r in rows), rows
        assert all(r["vllm/requests/0"] > 0 and r["vllm/requests/1"] > 0 for r in rows)
        assert all(r["vllm/servers_alive"] == 2 for r in rows)


def test_a_publish_whose_servers_drop_the_weights_is_an_error(tmp_path, vllm_served):
    """The servers' engine receives every byte and loads none (what vLLM does not notice: it answers 200 and
    keeps the old weights): the publish fails, naming the servers and what they did not load."""
    model, tok = load_default()
    srv = Served(tok, str(tmp_path), model, *urls_of(vllm_served))
    try:
        srv.publish(model)
        srv.weights.load = False
        srv.step(model)
        with pytest.raises(PublishError, match=r"did not land: vLLM server 0 \(the server at http://127.0.0.1:\d+\) "
                           r"did not receive \d+ of the \d+ tensors sent.*vLLM server 1"):
            srv.publish(model)
        srv.weights.load = True
        srv.publish(model)  # the same servers, the weights again: they land
    finally:
        srv.close()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_many_buckets_through_shared_memory_and_over_the_group(tmp_path, vllm_served, monkeypatch, shared_memory):
    """Buckets of 64 KiB (a run's are 256 MiB: the default model is one), through the shared file (one host)
    and over the group itself (between hosts): every tensor of every bucket reaches both servers' models as
    sent (the ledger's check of each publish), and the servers sample the learner's log-probs."""
    from backstream.rl.backends.vllm.weights import transfer

    monkeypatch.setattr(transfer, "BUCKET_BYTES", 1 << 16)
    model, tok = load_default()
    model.eval()
    srv = Served(tok, str(tmp_path), model, *urls_of(vllm_served))
    srv.weights.shared_memory = shared_memory
    try:
        srv.step(model)
        srv.publish(model)  # raises PublishError where a server's ledger differs from what was sent
        assert len(srv.weights.group.buckets) > 10 and bool(srv.weights.group.shm_path) == shared_memory
        prompts = [torch.tensor(tok(p, add_special_tokens=True)["input_ids"]) for p in ("12+34=", "7+8=")]
        r = srv.sample(srv.sampler(prompts, G=4, max_new=8), model, [{}] * 2, [0, 1],
                       [torch.Generator().manual_seed(i) for i in range(2)])
        seqs, mask = r.sequences(), r.completion_mask()
        learner = logprobs(model, seqs, mask)
        gap = max(float((a[m].double() - b[m].double()).abs().max())
                  for a, b, m in zip(learner, r.aligned_logprobs(), mask))
        assert gap <= 1e-4, gap
    finally:
        srv.close()


@pytest.mark.distributed
def test_two_ranks_two_servers_a_step_ahead(tmp_path, vllm_served):
    """torchrun, 2 gloo ranks, the session's two servers, the weights by transfer (one group: the learner's
    rank 0 and both servers' workers), sampling one step ahead: every rank samples from both servers,
    every trained token within one version."""
    import dist
    import distributed_workers as workers

    cfg = [*urls_of(vllm_served), 'rollout.backend="vllm"', "train.steps=3", "train.prompts_per_step=4",
           "rollout.group_size=4", "rollout.max_staleness=1", "train.progress=false", "train.plots=false",
           "distributed.timeout_s=300"]
    two = dist.run(workers.vllm_job, 2, str(tmp_path / "two"), cfg, init=False)
    rows = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(r["mismatch/kl_staleness_0"] is None or r["mismatch/kl_staleness_0"] <= EXACT for r in rows), rows
    assert [x["kind"] for x in two] == ["transfer", "transfer"] and two[0]["urls"] == two[1]["urls"] == vllm_served.urls
    # rank 0's requests on each server (counted when they were sent: a step ahead of the row they are in)
    assert sum(r["vllm/requests/0"] for r in rows) > 0 and sum(r["vllm/requests/1"] for r in rows) > 0
