"""Data parallelism (torchrun, FSDP2, gloo on CPU): 2 ranks give the update of one process on the same
global batch, reduce once per FSDP unit and optimizer step, resume from their sharded checkpoints
(on 2 ranks or on 1), refuse a batch that does not split, and stop together when one rank fails or
is killed; `python -m torch.distributed.run ... -m backstream train` works end to end and resumes
after SIGKILLs.

"One process" here is the same trainer under a process group of one rank: a plain process draws
its samples from one generator, a torchrun job from one generator per prompt group (so that the
samples do not depend on the rank that draws them), so their samples differ.
Few launches on purpose: each costs seconds of imports per rank.
"""

import json
import os
import re
import signal
import time

import dist
import distributed_workers as workers
import pytest
import torch
from safetensors.torch import load_file

from backstream import checkpoint


def rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    return num / sum(float(b[k].norm() ** 2) for k in b) ** 0.5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    ranks = dist.run(workers.ranks_job, 2, str(tmp), init=False)
    one = workers.single_process_reference(str(tmp), list(workers.CASES), str(tmp / "store"))
    return tmp, ranks, one


def test_two_ranks_give_the_single_process_update(job):
    """float64, 2 steps: stream and reference backward, full fine-tuning and LoRA (with the rollout's
    K/V and a KL term), token-mean, GSPO, TBPO, 2 epochs x 2 minibatches with Dr.GRPO's L_max, DAPO
    refills (also with the rollout's K/V), w8a8 QaRL, a MoE with the router load-balancing loss, a KL
    term to a sharded frozen reference, sampling a step ahead (rollout.max_staleness = 1): the weights
    are the same on both ranks and equal those of one process on the same global batch (measured:
    ≤ 1e-15 relative); in float32 to rounding (3e-7); with bf16 mixed precision within 10% of the
    update (measured 1.7%; bf16 rounding depends on each call's batch)."""
    tmp, ranks, one = job
    start = workers.full_weights(workers.tiny()[0])
    for name in workers.CASES:
        w0, w1 = ranks[0][name]["weights"], ranks[1][name]["weights"]
        assert all(torch.equal(w0[k], w1[k]) for k in w0), name
        if name == "bf16":  # bf16 rounding differs with the batch each call holds: judged against the update
            update = rel(one[name], start)
            assert rel(w0, one[name]) <= 0.1 * update, name  # measured 1.7% of the update
            assert rel(w0, one["float32"]) > 1e-5  # it did compute in bf16 (float32: 3e-7 from one process)
            continue
        assert rel(w0, one[name]) <= (1e-5 if name == "float32" else 1e-10), name  # measured 3e-7 / ≤ 1e-15
        if name not in ("lora", "moe_router"):  # LoRA's carry the adapters (checked below); MoE: another model
            assert rel(w0, start) > 1e-3, name  # it did train
    moe = ranks[0]["moe_router"]["weights"]
    assert rel(moe, workers.full_weights(workers.tiny_moe()[0])) > 1e-3
    lora = ranks[0]["lora"]["weights"]
    assert any(float(v.abs().sum()) > 0 for k, v in lora.items() if "lora_B" in k)
    # the run folders: rank 0 wrote one line per step, and every metric but time and memory is the one
    # process's (rewards of the global batch; loss terms, ratios, clip and TBPO shares summed over ranks).
    # tree/tokens_unique too is not: each rank's tree holds its own groups, and a prompt two groups
    # share is held once per rank that trains one of them. A null (undefined on a step) is null in both.
    per_rank = ("time/", "throughput/", "memory/", "tree/tokens_unique", "episode/agent_seconds")
    for name in workers.CASES:
        rows = [json.loads(x) for x in open(tmp / name / "metrics.jsonl")]
        ref = [json.loads(x) for x in open(tmp / f"one-{name}" / "metrics.jsonl")]
        assert [r["step"] for r in rows] == list(range(1, workers.STEPS + 1))
        for a, b in zip(rows, ref):
            assert a.keys() == b.keys(), name
            for k in a:
                if not k.startswith(per_rank):
                    if name == "bf16":
                        continue  # judged by its weights above
                    if a[k] is None or b[k] is None or isinstance(a[k], str):
                        assert a[k] == b[k] or isinstance(a[k], str), (name, k)
                        continue
                    tol = 1e-4 if name == "float32" else 1e-9
                    # float32: the sampler's log-probs carry rounding of the batch each rank decoded (its
                    # rows' padding): the sampler/learner gaps are noise of ~1e-7 either way
                    noise = 1e-6 if name == "float32" and k.startswith("mismatch/") else tol * 1e-3
                    assert a[k] == pytest.approx(b[k], rel=tol, abs=noise), (name, k)
    # asynchronous: step 2 trained groups sampled a step ahead, at step 0's weights, on both ranks as in
    # one process (the metrics above, the staleness ones included, are equal)
    assert [json.loads(x)["fake/weight_version"] for x in open(tmp / "async" / "metrics.jsonl")] == [0, 0]
    assert [json.loads(x)["rollout/staleness_max"] for x in open(tmp / "async" / "metrics.jsonl")] == [0, 1]
    # the agent program's episodes branched, and each rank's forks were trained (the update is the one
    # process's, above)
    assert all(json.loads(x)["episode/branches/mean"] >= 1 for x in open(tmp / "agent" / "metrics.jsonl"))
    # full fine-tuning with KL: the frozen reference is sharded as the policy is (2 layers + root), and
    # the KL term is live (the policy moved away from it)
    assert ranks[0]["kl_full"]["ref_units"] == 3 and ranks[0]["stream"]["ref_units"] == 0
    assert [json.loads(x)["loss/kl"] > 0 for x in open(tmp / "kl_full" / "metrics.jsonl")] == [False, True]
    # the router loss's value is that of the whole minibatch (per-rank counts would differ by ~1e-4)
    assert all(r["loss/router_aux"] > 1.0 for r in map(json.loads, open(tmp / "moe_router" / "metrics.jsonl")))
    # DAPO: the groups without signal were dropped and refilled, the same on 2 ranks as on one
    for name in ("dapo_tbpo", "dapo_kv"):
        drawn = ranks[0][name]["prompts_drawn"]
        assert drawn > 2 * workers.STEPS
        assert drawn == ranks[1][name]["prompts_drawn"] == one[name + "/prompts_drawn"]
    # with the rollout's K/V each rank trained the kept groups it sampled, and the refills went to the
    # rank that kept fewer: even shares (with refills split evenly: 4 and 12 sequences at step 1)
    per_call = [r["dapo_kv"]["sequences_per_call"] for r in ranks]
    assert per_call[0] == per_call[1] == [4 * 4 // 2] * workers.STEPS, per_call
    assert not (tmp / "stream" / ".lock").exists()


def test_one_gradient_reduction_per_unit_and_optimizer_step(job):
    _, ranks, _ = job
    for r in ranks:
        for name in workers.CASES:
            c = r[name]
            # full fine-tuning: 2 decoder layers + the root (embeddings, final norm); LoRA: the layers only
            assert c["units"] == (2 if name == "lora" else 3)
            assert c["counts"]["reduce_scatter"] == c["optimizer_steps"] * c["units"], (name, c)


def test_resume_from_sharded_checkpoints(job):
    """From the checkpoint of step 1, step 2 again: on 2 ranks bitwise the straight run; on 1 rank
    (DCP reshards) the same to float64 precision."""
    tmp, ranks, one = job
    straight = ranks[0]["stream"]["weights"]
    assert all(torch.equal(ranks[0]["resumed"][k], straight[k]) for k in straight)
    assert rel(one["from_two"], straight) <= 1e-10
    with open(os.path.join(checkpoint.latest(str(tmp / "stream")), "step.json")) as f:
        assert json.load(f)["world_size"] == 2


def test_bad_input_and_a_failing_rank(job):
    tmp, ranks, _ = job
    for r in ranks:
        assert "train.prompts_per_step: 3 prompts per step (the global batch) do not split" in r["bad_input"]
        assert "multiple of 2" in r["bad_input"]
        assert not r["bad_written"] and not r["group_started"]  # refused before anything started
    # a run folder that only rank 0 sees (node-local storage): refused on every rank, naming the blind one
    for r in ranks:
        assert re.search(r"train.output_dir: .*local-\d, as rank 0 \(.*\) created it, is not visible from "
                         r"rank\(s\) 1 \(.*\); .* shared file system", r["not_shared"]), r["not_shared"]
    # rank 1's reward function raised at step 2: rank 0 stops within seconds (not the timeout), saying why
    assert "reward server unreachable" in ranks[1]["failure"]
    assert "rank 0 of 2 stopped during step 2: another rank failed" in ranks[0]["failure"]
    assert ranks[0]["failure_s"] < 60
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(str(tmp / "fails"))] == ["step-1"]


def test_a_process_group_that_cannot_start(monkeypatch):
    """Rank 1 of 2 whose MASTER_ADDR:PORT answers nothing: an error that says what to check, after
    distributed.timeout_s."""
    from backstream.rl.parallel import collectives

    for k, v in dist.env(1, 2, dist.free_port()).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match=r"torchrun: rank 1 of 2 could not start the gloo process group at "
                                           r"127.0.0.1:\d+ within distributed.timeout_s=2 .* MASTER_ADDR"):
        collectives.init(2, torch.device("cpu"))
    assert not collectives.active()


def test_group_splits_over_ranks():
    """rank_groups: every group trained by one rank, rank r's part of minibatch m inside minibatch m.
    round_share: a round's groups sampled once each; a whole batch by its trainers, a refill evenly;
    with `held` (the rollout's K/V: a rank trains what it sampled) the refill evens the shares out."""
    from backstream.rl.parallel.placement import rank_groups, round_share

    for n, parts, world in ((8, 2, 2), (12, 3, 2), (12, 1, 4)):
        per = n // parts
        shares = [rank_groups(n, parts, world, r) for r in range(world)]
        assert sorted(g for s in shares for g in s) == list(range(n))
        for r, s in enumerate(shares):
            assert [sum(1 for g in s if g // per == m) for m in range(parts)] == [per // world] * parts
            assert s == [round_share(n, parts, world, q) for q in range(world)][r]
    with pytest.raises(ValueError, match="do not split into 2 minibatch"):
        rank_groups(6, 2, 2, 0)
    assert [round_share(5, 2, 2, r) for r in range(2)] == [[0, 1], [2, 3, 4]]
    for need, held in ((5, [3, 0]), (3, [2, 2, 0]), (4, [0, 0]), (2, [4, 0])):
        world = len(held)
        shares = [round_share(need, 1, world, r, held) for r in range(world)]
        assert sorted(g for s in shares for g in s) == list(range(need))
        after = [h + len(s) for h, s in zip(held, shares)]
        assert all(a == h or a <= min(after) + 1 for a, h in zip(after, held)), (need, held, after)
    assert [len(round_share(5, 1, 2, r, [3, 0])) for r in range(2)] == [1, 4]  # 4 / 4 at the end
    assert [len(round_share(2, 1, 2, r, [4, 0])) for r in range(2)] == [0, 2]  # as even as it can be


def _fake_round(groups: list[int], G: int, with_kv: bool):
    """A rank's rollout of `groups`: completion and reward of sample g·G+i are (g, i); K/V a tag."""
    from backstream.rl.records import Samples

    n = len(groups) * G
    ids = [torch.tensor([g, i]) for g in groups for i in range(G)]
    r = Samples(prompt_index=[g for g in groups for _ in range(G)], prompt_ids=[torch.tensor([7])] * n,
                completion_ids=ids, logprobs=[torch.zeros(2)] * n, finish_reason=["eos"] * n,
                kv=[f"kv{g}.{i}" for g in groups for i in range(G)] if with_kv else None, group_size=G)
    total = torch.tensor([10.0 * g + i for g in groups for i in range(G)])
    return r, total, {"f": total + 0.5}


def test_the_data_parallel_object_without_processes():
    """The split policy of `Torchrun` on 2 simulated ranks (each rank's gather answered with both
    ranks' parts, as the collective would): the joined round is every group once, in the round's order,
    with the rewards of its samples and K/V only where this rank sampled them; with the rollout's K/V
    a DAPO refill goes to the rank that keeps fewer groups, and each rank trains what it sampled. The
    one-process object hands everything through unchanged."""
    import dataclasses

    from backstream.rl.parallel.dataparallel import DataParallel, DistributedConfig, Torchrun

    G = 2
    ranks = [Torchrun(DistributedConfig(), device=torch.device("cpu"), seed=0, minibatches=1, reuse_kv=True,
                      world_size=2, this_rank=r) for r in range(2)]
    assert [r.main for r in ranks] == [True, False]
    assert ranks[0].generator(5).initial_seed() == ranks[1].generator(5).initial_seed() \
        != ranks[0].generator(6).initial_seed()

    def round_(need: int, refill: bool):
        rounds = [rk.round_groups(need, refill) for rk in ranks]
        local = [_fake_round(g, G, with_kv=True) for g in rounds]
        parts = [(g, dataclasses.replace(r, kv=None), t, f) for g, (r, t, f) in zip(rounds, local)]
        return rounds, [rk.join(parts, r.kv) for rk, (r, _, _) in zip(ranks, local)]

    for rk in ranks:
        rk.begin_step()
    rounds, joined = round_(4, refill=False)
    assert rounds == [[0, 1], [2, 3]]
    for r, (roll, total, per_fn) in enumerate(joined):
        assert [int(c[0]) for c in roll.completion_ids] == [0, 0, 1, 1, 2, 2, 3, 3]  # the round's order
        assert torch.equal(total, torch.tensor([0.0, 1, 10, 11, 20, 21, 30, 31]))
        assert torch.equal(per_fn["f"], total + 0.5)
        mine = rounds[r]
        assert [k is not None for k in roll.kv] == [g in mine for g in range(4) for _ in range(G)]
        assert ranks[r].owner == [0, 0, 1, 1]
    for rk in ranks:  # DAPO kept groups 0, 1 and 2: rank 0 holds 2 groups, rank 1 one
        rk.kept([0, 1, 2])
    rounds, _ = round_(1, refill=True)
    assert rounds == [[], [0]]  # the refill goes to the rank that keeps fewer: shares end 2 + 2
    kv = [None] * 2 + ["x"] * 2 + [None] * 2 + ["y"] * 2  # this rank's samples of groups 1 and 3
    assert ranks[1].train_groups(4, kv) == [1, 3]
    assert ranks[1].train_groups(4, None) == [2, 3]  # without K/V: its half of the minibatch
    # one process: the round is the whole batch, nothing moves
    one = DataParallel(0)
    roll, total, per_fn = _fake_round(one.round_groups(3, refill=True), G, with_kv=False)
    assert one.join_round(roll, total, per_fn) == (roll, total, per_fn)
    # one process draws a group with the generator every rank would: by its position alone
    assert one.generator(9).initial_seed() == ranks[1].generator(9).initial_seed()
    assert one.train_groups(3, None) == [0, 1, 2] and one.gather(5) == [5]
    assert one.gather_rows([0, 1], ["a", "b"], 2) == ["a", "b"] and one.on_main(lambda: 4) == 4
    one.fail_together(None)
    with pytest.raises(KeyError, match="server"):
        one.fail_together(KeyError("server"))


def _returns_3():
    return 3


def _usage_error():
    raise SystemExit(2)


def _fails():
    raise ZeroDivisionError("division by zero")


class _Exited(BaseException):
    pass


@pytest.mark.parametrize("main, code, said", [(_returns_3, 3, ""), (_usage_error, 2, ""),
                                              (_fails, 1, "ZeroDivisionError: division by zero")])
def test_a_torchrun_rank_exits_without_interpreter_teardown(monkeypatch, capsys, main, code, said):
    """Under torchrun (WORLD_SIZE set) the `backstream` command ends with os._exit once main() is over:
    no interpreter teardown, where gloo's objects once aborted a finished rank (SIGABRT, and torchrun
    called the finished job failed); main()'s exit code and an error's traceback are kept. In a plain
    process it exits as usual. (The kill/resume test runs the real thing under torchrun.)"""
    from backstream import cli

    def hard_exit(c):
        raise _Exited(c)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(cli.os, "_exit", hard_exit)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Exited) as e:
        cli.entry()
    assert e.value.args == (code,)
    assert said in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises((SystemExit, ZeroDivisionError)) as e:  # a plain process: Python's own exit
        cli.entry()
    assert (e.value.code if isinstance(e.value, SystemExit) else 1) == code


def _train_sets(out, steps: int) -> list[str]:
    sets = [f"train.steps={steps}", "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.progress=false", "train.plots=false", "data.num_examples=16", f'train.output_dir="{out}"',
            "train.save_every=1"]
    return ["train"] + [a for s in sets for a in ("--set", s)]


def _finish(p, timeout=300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, "\n".join(x for x in err.splitlines() if "Writing model shards" not in x)


def _kill_while_writing(p, run, step: int, victims) -> float:
    """Wait until the checkpoint of `step` is being written (or was just published), then SIGKILL
    victims(p) at once; returns the time of the kill."""
    ckpts = run / "checkpoints"
    deadline = time.time() + 240
    while not ((ckpts / f".tmp-step-{step}").exists() or (ckpts / f"step-{step}").exists()):
        assert p.poll() is None, _finish(p)[2][-4000:]
        assert time.time() < deadline, "the job never reached its checkpoint"
        time.sleep(0.002)
    for pid in victims(p):
        os.kill(pid, signal.SIGKILL)
    return time.time()


def test_resume_after_kills_on_two_ranks(tmp_path):
    """A 4-step job on 2 ranks with a checkpoint per step, killed twice and resumed on 2 ranks each time:
    - SIGKILL of rank 1 while the checkpoint of step 2 is written: rank 0 stops within seconds with an
      error that says so (not after distributed.timeout_s), torchrun ends the job;
    - SIGKILL of the whole job (torchrun's agent and both ranks at once: a lost node) while step 3's is
      written, which leaves a stale lock and possibly a half-written checkpoint folder.
    Neither leaves a checkpoint that resume would take for complete, and after the second resume the
    weights are bitwise those of a job never killed, with one metrics line per step."""
    straight, run = tmp_path / "straight", tmp_path / "killed"
    ref = dist.torchrun(_train_sets(straight, 4))  # alongside the first killed job (imports dominate)

    p = dist.torchrun(_train_sets(run, 4))
    t_kill = _kill_while_writing(p, run, 2, lambda p: [dist.ranks_of(p.pid)[1]])
    code, _, log = _finish(p)
    stopped = time.time() - t_kill
    assert code != 0
    assert re.search(r"rank 0 of 2 stopped during (step 3|the checkpoint of step 2): another rank failed", log), \
        log[-4000:]
    assert stopped < 60, stopped  # gloo sees the closed connection at once; torchrun then ends the job
    assert checkpoint.latest_intact(str(run)) == checkpoint.latest(str(run))

    p = dist.torchrun(["train", "--resume", str(run)])
    _kill_while_writing(p, run, 3, lambda p: [p.pid, *dist.ranks_of(p.pid).values()])
    _finish(p)
    assert (run / ".lock").exists()  # the killed rank 0's: stale now
    assert checkpoint.latest_intact(str(run)) == checkpoint.latest(str(run))
    assert int(os.path.basename(checkpoint.latest(str(run)))[5:]) in (2, 3)

    code, _, log = _finish(dist.torchrun(["train", "--resume", str(run)]))
    assert code == 0, log[-4000:]
    # the job never killed: `python -m torch.distributed.run --nproc_per_node 2 -m backstream train` end to end
    code, stdout, log = _finish(ref)
    assert code == 0, log[-4000:]
    assert stdout.count("run folder:") == 1  # rank 0 alone prints, logs and writes the run folder
    rows = [json.loads(x) for x in open(straight / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("reward/mean" in r for r in rows)
    assert (straight / "config.toml").exists() and not (straight / ".lock").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(checkpoint.latest(str(straight))) is not None
    a = load_file(str(run / "checkpoints" / "step-4" / "model.safetensors"))
    b = load_file(str(straight / "checkpoints" / "step-4" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(str(tmp_path / "straight" / "checkpoints" / "step-3" / "model.safetensors"))
    assert not all(torch.equal(a[k], first[k]) for k in a)  # the last step did change the weights
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not (run / ".lock").exists()
    assert sorted(os.listdir(run / "checkpoints")) == ["step-3", "step-4"]  # no partial folder left
