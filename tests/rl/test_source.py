"""The rollout source (rl/rollout/source.py) over a fake of the backend protocol (tests/fake_backend.py); the
real-server runs are in test_vllm_async.py, two ranks in tests/distributed/.

The fake labels each token with the weight version it holds when the token is drawn, drawing slowly,
so that groups are in flight across syncs; the loop takes P groups a step, plus refills (as DAPO does)
on some steps, and syncs after each. Checked: the groups come in the stream's order with their own
generators, every token of a step's batch is at most k versions behind the weights the update starts
from, and tokens k behind do occur (the bound is reached, not just kept); a failed group stops the step
that takes it; the synchronous source syncs before each round and applies the backend's kernels. k = 0
is the synchronous loop, bitwise the same run as without the key; the local backend with k >= 1 is
refused before the run folder.
"""

import dataclasses
import time

import pytest
import torch
from fake_backend import FakeBackend
from helpers import no_run_written, run_cfg, tiny

from backstream import trainer
from backstream.quant.linear import QuantConfig, quant_linears, quantize_model
from backstream.rl.backends.base import SamplingParams
from backstream.rl.data.prompts import PromptStream
from backstream.rl.parallel.dataparallel import DataParallel
from backstream.rl.parallel.placement import group_generator
from backstream.rl.records import Samples
from backstream.rl.rollout.completions import CompletionSampler
from backstream.rl.rollout.source import AsyncSource, Source


def _source(backend, n: int, seed: int, P: int = 3, k: int | None = None, sampling=None):
    """A source over `n` examples, example i's prompt the token i (the fake records each group's seed
    by it), one sample per group, 6 tokens each."""
    model, _ = tiny(torch.float32)
    sampler = CompletionSampler(SamplingParams(max_new_tokens=6), 1, None, [0], False,
                                [torch.tensor([i]) for i in range(n)], [""] * n, backend)
    args = (sampler, sampling or backend.sides(), [{}] * n, PromptStream(n, seed), DataParallel(seed), model,
            QuantConfig())
    return AsyncSource(*args, per_step=P, k=k) if k else Source(*args)


@pytest.mark.parametrize("k", [1, 2])
def test_every_trained_token_is_within_k_versions_and_groups_come_in_order(k):
    P, seed, n = 3, 7, 200  # no prompt twice in the stream: a seed per index
    backend = FakeBackend(vocab=50, seconds=0.004)
    source = _source(backend, n, seed, P, k)
    taken, behind = [], []
    for step in range(12):
        r = source.take(P).samples
        if step % 4 == 1:  # a refill round, beyond what the bound let start
            r = Samples.concat([r, source.take(2, refill=True).samples])
        taken += r.prompt_index
        behind += [step - int(v.min()) for v in r.weight_version]
        time.sleep(0.03)  # the learner's update: slower than a group's sampling
        source.at_step(step + 1)
    source.close()
    assert taken == PromptStream(n, seed).take(len(taken))  # the stream's order, none twice or skipped
    assert max(behind) <= k and max(behind) == k
    assert backend.syncs == 13  # once at the start, then at every step boundary
    # each group drew with the generator of its position, whichever thread ran it and when
    want = {}
    for pos, index in enumerate(PromptStream(n, seed).take(len(taken))):
        want.setdefault(index, int(torch.randint(0, 2**31 - 1, (1,), generator=group_generator(seed, pos))))
    assert all(backend.seeds[i] == want[i] for i in set(taken))


@pytest.mark.parametrize("k", [0, 1])
def test_a_failed_group_stops_the_step_that_takes_it(k):
    source = _source(FakeBackend(vocab=50, fail="the server died"), 8, 0, P=2, k=k)
    with pytest.raises(RuntimeError, match="the server died"):
        source.take(2)
    if k:
        source.close()


def test_the_synchronous_source_syncs_before_each_round_and_sets_the_backends_kernels():
    """Every round samples the learner's current weights (a sync, then the samples carry its version);
    at the first sync the backend's int8 GEMM is set on the learner's w8a8 layers, before the backend's
    alignment check sees the learner."""
    class Kernels:  # a low-bit sampler's QaRL side (rl/backends/base.py `Aligned`)
        def kernels(self):
            return {"int8_gemm": "int16-pairs"}

        def check_aligned(self, model):
            self.gemms = {m.gemm for m in quant_linears(model).values()}

    backend, aligned = FakeBackend(vocab=50), Kernels()
    source = _source(backend, 8, 0, sampling=dataclasses.replace(backend.sides(), aligned=(aligned,)))
    quant = QuantConfig(rollout="w8a8", aligned=True)
    quantize_model(source.model, quant)
    source.quant = quant
    assert {m.gemm for m in quant_linears(source.model).values()} == {"exact"}
    for step in range(3):
        source.at_step(step)
        r = source.take(2).samples
        assert all(int(v.min()) == step for v in r.weight_version)
    assert backend.syncs == 3 and aligned.gemms == {"int16-pairs"}


def test_max_staleness_0_is_the_synchronous_run_bitwise(tmp_path):
    runs = []
    for name, extra in (("without", []), ("k0", ["rollout.max_staleness=0"])):
        model, tok = tiny(torch.float64)
        t = trainer.Trainer(run_cfg(tmp_path, name, "train.steps=2", *extra), model=model, tokenizer=tok)
        rows = [t.train_step() for _ in range(2)]
        t.close()
        t.run_folder.release()
        runs.append((rows, {k: v.clone() for k, v in t.model.state_dict().items()}))
    (rows_a, w_a), (rows_b, w_b) = runs
    drop = ("time/", "throughput/", "memory/")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows_a] == \
        [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows_b]
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_a_trainer_samples_ahead_through_any_backend_of_the_protocol(tmp_path):
    """k = 1 over the fake backend in one process: the run trains, its tokens are at most 1 version
    behind and some are 1 behind, the bound's metrics are on every line."""
    import json
    import os

    model, tok = tiny(torch.float64)
    backend = FakeBackend(vocab=len(tok), eos=tok.eos_token_id)
    run = trainer.train(run_cfg(tmp_path, "ahead", "train.steps=3", "rollout.max_staleness=1"), model=model,
                        tokenizer=tok, backend=backend.sides())
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("time/sampler_idle" in r for r in rows)
    assert [r["fake/weight_version"] for r in rows] == [0, 0, 1]  # step 2 trains groups sampled at step 0's weights
    assert backend.syncs == 4  # at the start, then at each of the 3 step boundaries


def test_the_local_backend_ahead_of_the_learner_is_refused_before_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.max_staleness = 1: the local sampler .* rollout.backend = "
                                         r"\"vllm\""):
        trainer.train(run_cfg(tmp_path, "bad", "rollout.max_staleness=1"))
    assert no_run_written(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"rollout.max_staleness: got -1, expected an integer >= 0"):
        trainer.train(run_cfg(tmp_path, "bad", "rollout.max_staleness=-1"))
    with pytest.raises(ValueError, match=r"rollout.in_flight"):
        trainer.train(run_cfg(tmp_path, "bad", 'rollout.in_flight="drop"'))
    assert no_run_written(tmp_path / "bad")
