"""The producer's bound and order without a server (rl/producer.py); the real-server runs are in
test_vllm_async.py.

A stand-in sampler labels each token with the weight version "the server" holds when the token is
drawn, drawing slowly, so that groups are in flight across publishes; the loop takes P groups a step,
plus refills (as DAPO does) on some steps, and publishes after each. Checked: the groups come in the
stream's order with their own generators, every token of a step's batch is at most k versions behind
the weights the update starts from, and tokens k behind do occur (the bound is reached, not just
kept). k = 0 (`Rounds`) is the synchronous loop, bitwise the same run as without the key; the local
backend with k >= 1 is refused before the run folder.
"""

import threading
import time

import pytest
import torch
from helpers import no_run_written, run_cfg, tiny

from backstream import trainer
from backstream.rl.data import PromptStream
from backstream.rl.parallel import group_generator
from backstream.rl.producer import Producer
from backstream.rl.rollout import Rollout


class Server:
    """Weights of a version; a publish changes it."""

    def __init__(self):
        self.version, self.lock = 0, threading.Lock()


class SlowSampler:
    def __init__(self, server: Server, tokens: int = 6, seconds: float = 0.004):
        self.server, self.tokens, self.seconds = server, tokens, seconds
        self.seeds: dict[int, int] = {}

    def sample(self, model, rows, indices, generators, progress=None) -> Rollout:
        assert model is None and len(indices) == 1
        self.seeds[indices[0]] = int(torch.randint(0, 2**31 - 1, (1,), generator=generators[0]))
        versions = []
        for _ in range(self.tokens):  # one token at a time, each with the weights of the moment
            time.sleep(self.seconds)
            versions.append(self.server.version)
        return Rollout(prompt_index=[indices[0]], prompt_ids=[torch.tensor([1])], completion_ids=[torch.arange(6)],
                       logprobs=[torch.zeros(6)], finish_reason=["length"], group_size=1,
                       weight_version=[torch.tensor(versions)])


class Labels:
    def at_step(self, step):
        pass


@pytest.mark.parametrize("k", [1, 2])
def test_every_trained_token_is_within_k_versions_and_groups_come_in_order(k):
    server, P, seed, n = Server(), 3, 7, 200  # no prompt twice in the stream: a seed per index
    stream = PromptStream(n, seed)
    sampler = SlowSampler(server)
    publishes = []

    def publish():
        publishes.append(time.perf_counter())
        server.version = len(publishes) - 1  # the first "publish" starts the server with version 0

    prod = Producer(sampler, [{}] * n, stream, lambda pos: group_generator(seed, pos), P, k, Labels(), publish)
    taken, behind = [], []
    for step in range(12):
        r = prod.take(P)
        if step % 4 == 1:  # a refill round, beyond what the bound let start
            r = Rollout.concat([r, prod.take(2, refill=True)])
        taken += r.prompt_index
        behind += [step - int(v.min()) for v in r.weight_version]
        time.sleep(0.03)  # the learner's update: slower than a group's sampling
        prod.at_step(step + 1)
    prod.close()
    assert taken == PromptStream(n, seed).take(len(taken))  # the stream's order, none twice or skipped
    assert max(behind) <= k and max(behind) == k
    # each group drew with the generator of its position, whichever thread ran it and when
    want = {}
    for pos, index in enumerate(PromptStream(n, seed).take(len(taken))):
        want.setdefault(index, int(torch.randint(0, 2**31 - 1, (1,), generator=group_generator(seed, pos))))
    assert all(sampler.seeds[i] == want[i] for i in set(taken))


def test_a_failed_group_stops_the_step_that_takes_it():
    class Failing(SlowSampler):
        def sample(self, model, rows, indices, generators, progress=None):
            raise RuntimeError("the server died")

    prod = Producer(Failing(Server()), [{}] * 8, PromptStream(8, 0), lambda pos: None, 2, 1, Labels(), lambda: None)
    with pytest.raises(RuntimeError, match="the server died"):
        prod.take(2)
    prod.close()


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
