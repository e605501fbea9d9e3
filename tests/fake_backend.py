"""A fake of the backend protocols (rl/backends/base.py: `Backend`, `Weights`, `Reporter`) for the rollout
layer's tests: it samples without a model, so what is tested is the rollout source, the samplers and
the trainer around it (`sides()`: the `Sampling` a trainer takes as `backend=`).

Each group's tokens are drawn from the seed its generator gives (as a server's would be), never the
end-of-sequence token, with fixed log-probs; every token is labelled with the weight version synced at
the moment it is drawn, `seconds` apart (slow enough, when asked, that groups are in flight across
syncs). `fail`: every request raises it (a dead server)."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from backstream.rl.backends.base import Sampling
from backstream.rl.records import Completion, Played, oldest


class FakeBackend:
    in_process = False
    metric_keys = ("fake/weight_version",)

    def __init__(self, vocab: int, eos: int | None = None, seconds: float = 0.0, fail: str | None = None):
        self.vocab, self.eos, self.seconds, self.fail = vocab, eos, seconds, fail
        self.step = 0  # the learner's (`at_step`)
        self.version = 0  # the weights "the server" holds (`sync`)
        self.syncs = 0
        self.finished = 0  # agent sessions over (`finish`)
        self.seeds: dict[int, int] = {}  # a prompt's first token -> the seed its group drew with
        self.lock = threading.Lock()

    def sides(self) -> Sampling:
        """What a trainer samples with: the fake is its backend, its weights and a reporter."""
        return Sampling(backend=self, weights=self, reporters=(self,))

    def sync(self, model, step: int, progress=None) -> float:
        self.step = step
        self.version, self.syncs = step, self.syncs + 1
        return 0.0

    def metrics(self, samples) -> dict:
        return {"fake/weight_version": oldest(samples.weight_version)}

    def _tokens(self, g: torch.Generator, n: int) -> Completion:
        ids = torch.randint(0, self.vocab, (n,), generator=g)
        if self.eos is not None:
            ids = torch.where(ids == self.eos, (self.eos + 1) % self.vocab, ids)
        versions = []
        for _ in range(n):  # one token at a time, each with the weights of the moment
            if self.seconds:
                time.sleep(self.seconds)
            versions.append(self.version)
        return Completion(ids.tolist(), -(ids % 5 + 1).float() / 4, torch.tensor(versions), "length")

    def complete(self, prompts, group_size, max_tokens, generators, return_kv=False, progress=None, pictures=None):
        if self.fail:
            raise RuntimeError(self.fail)
        out = []
        for j, (p, gen) in enumerate(zip(prompts, generators)):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            with self.lock:
                self.seeds[int(p[0])] = seed
            g = torch.Generator().manual_seed(seed)
            out += [self._tokens(g, max_tokens) for _ in range(group_size)]
            if progress is not None:
                progress(j + 1, len(prompts))
        return out

    def play(self, starts, generators, turn, budget, max_turns, return_kv=False):
        if self.fail:
            raise RuntimeError(self.fail)
        played = []
        for k, start in enumerate(starts):
            seeds = torch.randint(0, 2**31 - 1, (max_turns,), generator=generators[k]).tolist()
            ids, t = list(start), 0
            while True:
                c = self._tokens(torch.Generator().manual_seed(seeds[min(t, max_turns - 1)]), budget(len(ids)))
                fed, inserted = ids + c.ids[:-1], turn(k, c)
                if inserted is None:
                    played.append(Played(fed))
                    break
                ids, t = ids + c.ids + list(inserted), t + 1
        return played

    @contextlib.contextmanager
    def round(self, episodes):
        yield self

    def generate(self, ids, max_tokens, seed, key):
        if self.fail:
            raise RuntimeError(self.fail)
        return self._tokens(torch.Generator().manual_seed(seed), max_tokens)

    def finish(self, key) -> None:
        self.finished += 1
