"""The server backend (rl/backends/base.py's protocol): a vLLM server samples, token ids in and out,
with the learner's weights published to it (rl/vllm/publisher.py `WeightPublisher`).

- `complete`: one request per group (`n = G`), all of a call's groups in flight at once so the server
  batches them. A group's request carries a seed drawn from its generator (the one the local
  backend would use), so a resumed run samples what it would have.
- `play`: every episode in a thread of its own, each turn a request whose prompt is exactly the
  episode's ids so far (sampled and inserted tokens, never re-rendered text: the server echoes them
  and they are checked), so all the episodes' turns are in flight at once and the server batches
  them; its prefix cache keeps each episode's history. Episode k's turn t draws with the t-th of
  `max_turns` seeds drawn from its generator.
- `generate`: one /inference/v1/generate call after exactly the ids.

The server hands no K/V (engine.reuse_rollout_kv is refused): the engine runs its prefill.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import Tensor

from backstream.rl.backends.base import Completion, NoRounds, Played, oldest
from backstream.rl.rollout import SamplingConfig
from backstream.rl.vllm.publisher import WeightPublisher, starting
from backstream.rl.vllm.requests import ServerRequests, sampling_args


class ServerBackend(NoRounds):
    """A vLLM server as the run's backend (see the module docstring); `publisher`: the server and the
    weights on it, shared by the run's samplers; `config`: the run's sampling settings."""

    in_process = False
    metric_keys = ("vllm/weight_version",)

    def __init__(self, config: SamplingConfig, eos: list[int], publisher: WeightPublisher):
        self.config, self.eos, self.publisher = config, list(eos), publisher
        self.requests = ServerRequests(publisher)  # the generate calls

    def _params(self, max_tokens: int) -> dict:
        c = self.config
        return {"max_tokens": max_tokens, "temperature": c.temperature, "stop_token_ids": self.eos, **sampling_args(c)}

    # -- the policy ---------------------------------------------------------------------------------
    def need_context(self, tokens: int, why: str) -> None:
        self.publisher.context.need_context(tokens, why)

    def check(self, model) -> None:
        self.publisher.context.check(model)

    def at_step(self, step: int) -> None:
        self.publisher.at_step(step)

    def sync(self, model, progress=None) -> float:
        self.publisher.ensure(model, starting(progress, 0))
        return self.publisher.sync_s

    def kernels(self) -> dict[str, str]:
        return self.publisher.kernels()

    def check_aligned(self, model) -> None:
        self.publisher.check_aligned(model)

    def metrics(self, versions: list[Tensor]) -> dict[str, float]:
        return {"vllm/weight_version": oldest(versions)}

    def close(self) -> None:
        self.requests.abort()
        self.publisher.close()

    # -- sampling -------------------------------------------------------------------------------------
    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None) -> list[Completion]:
        assert not return_kv, "a server hands no K/V (config.validate refuses engine.reuse_rollout_kv)"
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=g)) for g in generators]
        params, done = self._params(max_tokens), [0]

        def request(j: int) -> list[Completion]:
            out = self.requests.generate(prompts[j].tolist(), params, group_size, seeds[j], self.eos)
            done[0] += 1
            if progress is not None:
                progress(done[0], len(prompts))
            return out

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return [c for group in pool.map(request, range(len(prompts))) for c in group]

    def play(self, starts: list[list[int]], generators: list, turn, budget, max_turns: int,
             return_kv: bool = False) -> list[Played]:
        assert not return_kv, "a server hands no K/V"
        seeds = [torch.randint(0, 2**31 - 1, (max_turns,), generator=g).tolist() for g in generators]
        played = [Played(fed=list(s)) for s in starts]

        def episode(k: int) -> None:
            ids, t = list(starts[k]), 0
            while True:
                (c,) = self.requests.generate(ids, self._params(budget(len(ids))), 1, seeds[k][min(t, max_turns - 1)],
                                               self.eos)
                played[k].fed = ids + c.ids[:-1]
                inserted = turn(k, c)
                if inserted is None:
                    return
                ids, t = ids + c.ids + list(inserted), t + 1

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(128, max(1, len(starts)))) as pool:
            for f in [pool.submit(episode, k) for k in range(len(starts))]:
                f.result()
        return played

    def generate(self, ids: list[int], max_tokens: int, seed: int) -> Completion:
        (c,) = self.requests.generate(list(ids), self._params(max_tokens), 1, seed, self.eos)
        return c
