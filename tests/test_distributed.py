"""Data parallelism (torchrun, FSDP2, gloo on CPU): 2 ranks give the update of one process on the same
global batch, reduce once per FSDP unit and optimizer step, resume from their sharded checkpoints
(on 2 ranks or on 1), refuse a batch that does not split, and stop together when one rank fails;
`python -m torch.distributed.run ... -m backstream train` works end to end.

"One process" here is the same trainer under a process group of one rank: a plain process draws
its samples from one generator, a torchrun job from one generator per prompt group (so that the
samples do not depend on the rank that draws them), so their samples differ.
Few launches on purpose: each costs seconds of imports per rank.
"""

import json
import os
import subprocess
import sys

import dist
import distributed_workers as workers
import pytest
import torch

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
    refills, w8a8 QaRL: the weights are the same on both ranks and equal those of one process on the
    same global batch (measured: ≤ 1e-15 relative)."""
    tmp, ranks, one = job
    start = workers.full_weights(workers.tiny()[0])
    for name in workers.CASES:
        w0, w1 = ranks[0][name]["weights"], ranks[1][name]["weights"]
        assert all(torch.equal(w0[k], w1[k]) for k in w0), name
        assert rel(w0, one[name]) <= 1e-10, name
        if name != "lora":  # LoRA's weights carry the adapters: compared with the start via the base below
            assert rel(w0, start) > 1e-3, name  # it did train
    lora = ranks[0]["lora"]["weights"]
    assert any(float(v.abs().sum()) > 0 for k, v in lora.items() if "lora_B" in k)
    # the run folders: rank 0 wrote one line per step, and every metric but time and memory is the one
    # process's (rewards of the global batch; loss terms, ratios, clip and TBPO shares summed over ranks)
    for name in workers.CASES:
        rows = [json.loads(x) for x in open(tmp / name / "metrics.jsonl")]
        ref = [json.loads(x) for x in open(tmp / f"one-{name}" / "metrics.jsonl")]
        assert [r["step"] for r in rows] == list(range(1, workers.STEPS + 1))
        for a, b in zip(rows, ref):
            assert a.keys() == b.keys(), name
            for k in a:
                if not k.startswith(("time/", "throughput/", "memory/")):
                    assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), (name, k)
    # DAPO: the groups without signal were dropped and refilled, the same on 2 ranks as on one
    drawn = ranks[0]["dapo_tbpo"]["prompts_drawn"]
    assert drawn > 2 * workers.STEPS
    assert drawn == ranks[1]["dapo_tbpo"]["prompts_drawn"] == one["dapo_tbpo/prompts_drawn"]
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
    # rank 1's reward function raised at step 2: rank 0 stops within seconds (not the timeout), saying why
    assert "reward server unreachable" in ranks[1]["failure"]
    assert "rank 0 of 2 stopped during step 2: another rank failed" in ranks[0]["failure"]
    assert ranks[0]["failure_s"] < 60
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(str(tmp / "fails"))] == ["step-1"]


def test_a_process_group_that_cannot_start(monkeypatch):
    """Rank 1 of 2 whose MASTER_ADDR:PORT answers nothing: an error that says what to check, after
    distributed.timeout_s."""
    from backstream import distributed

    for k, v in dist.env(1, 2, dist.free_port()).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match=r"torchrun: rank 1 of 2 could not start the gloo process group at "
                                           r"127.0.0.1:\d+ within distributed.timeout_s=2 .* MASTER_ADDR"):
        distributed.init(distributed.DistributedConfig(timeout_s=2), torch.device("cpu"))
    assert not distributed.active()


def test_torchrun_end_to_end(tmp_path):
    """`python -m torch.distributed.run --nproc_per_node 2 -m backstream train` on the built-in model."""
    out = tmp_path / "run"
    sets = ["train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.progress=false", "data.num_examples=16", f'train.output_dir="{out}"']
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "backstream", "train"] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = "\n".join(x for x in res.stderr.splitlines() if "Writing model shards" not in x)  # no progress bars
    assert res.returncode == 0, log[-4000:]
    assert res.stdout.count("run folder:") == 1  # rank 0 only
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)
    assert (out / "config.toml").exists() and not (out / ".lock").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(checkpoint.latest(str(out))) is not None
