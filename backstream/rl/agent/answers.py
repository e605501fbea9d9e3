"""The in-process backend behind the agent endpoint (rl/agent/endpoint.py, rl/agent/programs.py):
the learner's model answers the requests of a round's episodes, batched as they arrive."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from backstream.rl.agent.endpoint import Answer
from backstream.rl.decode import Rows, decode, prefill
from backstream.rl.rollout import SamplingConfig
from backstream.stream.hf import takes_logits_to_keep

# how long a batch waits for the requests of episodes still playing: until every one has sent its
# request, no request came for GATHER_S, or GATHER_MAX_S in all
GATHER_S, GATHER_MAX_S = 0.02, 0.25
REUSE_MIN = 256  # the shortest history whose K/V a request continues instead of prefilling it


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    seed: int
    answer: Answer | None = None
    error: BaseException | None = None


class LocalAnswers:
    """The in-process backend behind the endpoint: the learner's model, between `begin(model)` and
    `end()`. A request that arrives while the model decodes waits; the requests that waited are then
    decoded together (rl/decode.py), so the episodes of a round batch. A request whose ids extend at
    least `reuse_min` tokens that an earlier request of the round was fed and sampled (an agent that
    appends to its conversation) prefills only its new tokens after that request's K/V, which it takes
    over; any other request is prefilled whole, requests of one length as one batch (a row prefilled
    after its own history is a forward of its own: for short histories the batched prefill is faster).
    Every request draws with its own seeded generator: its tokens depend on its seed, not on its
    batch-mates. Outside `begin`/`end` (a program still running after its episode ended) a request is
    refused: the model is being trained."""

    def __init__(self, config: SamplingConfig, eos: list[int], tokenizer):
        self.config, self.eos, self.tok = config, set(eos), tokenizer
        self.model = None
        self.cond = threading.Condition()
        self.queue: list[_Request] = []
        self.decoding = False
        self.batches: list[int] = []  # requests per decode batch, this round
        self.live = 0  # episodes playing: each may send a request
        self.prefixes: list[tuple[list[int], list]] = []  # this round's (ids fed, their K/V), each taken once
        self.reused = 0  # tokens of this round's requests not prefilled again
        self.reuse_min = REUSE_MIN
        self.in_process = True  # samples at the learner's current weights (no versions)
        self.failure: BaseException | None = None  # the first decode that failed this round (`end` raises it)

    def begin(self, model, progress=None, n: int = 0) -> None:
        with self.cond:
            self.model, self.batches, self.failure, self.prefixes, self.reused = model, [], None, [], 0

    def end(self) -> None:
        with self.cond:
            while self.decoding:
                self.cond.wait()
            self.model, self.live, self.prefixes = None, 0, []
            for r in self.queue:
                r.error = RuntimeError("the episode's round is over")
            self.queue = []
            self.cond.notify_all()
            failure, self.failure = self.failure, None
        if failure is not None:  # the sampler failed, not the agent: the step stops
            raise failure

    def __call__(self, ids: list[int], max_tokens: int, seed: int) -> Answer:
        req = _Request(list(ids), max_tokens, seed)
        with self.cond:
            if self.model is None:
                raise RuntimeError("no round is being sampled: this episode is over")
            self.queue.append(req)
            while req.answer is None and req.error is None:
                if self.decoding:
                    self.cond.wait()
                    continue
                self.decoding = True
                self._gather()
                batch, self.queue, model = self.queue, [], self.model
                self.cond.release()
                try:
                    self._decode(model, batch)
                except BaseException as e:  # noqa: BLE001  (each waiting request gets the error)
                    self.failure = self.failure or e
                    for r in batch:
                        r.error = r.error or e
                finally:
                    self.cond.acquire()
                    self.decoding = False
                    self.cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.answer

    def playing(self, n: int) -> None:
        """n more episodes are playing (n < 0: fewer): a batch waits for their requests (`_gather`)."""
        with self.cond:
            self.live += n
            self.cond.notify_all()

    def _gather(self) -> None:
        """Before a batch: wait for the requests of the episodes still playing, while they keep coming
        (`GATHER_S` apart at most, `GATHER_MAX_S` in all): episodes whose previous answers came in one
        batch send their next requests together, and a batch of one is not decoded while the others'
        requests are on their way."""
        deadline = time.monotonic() + GATHER_MAX_S
        while len(self.queue) < self.live and time.monotonic() < deadline:
            n = len(self.queue)
            self.cond.wait(GATHER_S)
            if len(self.queue) == n:
                return

    @torch.no_grad()
    def _decode(self, model, batch: list[_Request]) -> None:
        self.batches.append(len(batch))
        keep_last = takes_logits_to_keep(model)
        device = next(model.parameters()).device
        parts, fresh = [], []
        for i, r in enumerate(batch):
            fed, kv = self._prefix(r.ids)
            if kv is None:
                fresh.append(i)
                continue
            self.reused += len(fed)
            cache, logits = prefill(model, [r.ids[len(fed):]], device, keep_last, history=kv)
            parts.append(([i], cache, logits))
        if fresh:
            parts += Rows.prefilled(model, [batch[i].ids for i in fresh], keep_last, fresh)
        rows = Rows.stack(parts, len(batch), max(r.max_tokens for r in batch))
        del parts
        gens = [torch.Generator().manual_seed(r.seed) for r in batch]
        out = decode(model, rows, self.config, self.eos, self.tok, gens, keep_last, [r.max_tokens for r in batch],
                     keep_kv=True)
        for r, ids, lp, reason, kv in zip(batch, out.tokens, out.logprobs, out.reasons, out.caches):
            r.answer = Answer(ids, lp.tolist(), None, reason)
            with self.cond:
                self.prefixes.append((r.ids + ids[:-1], kv))

    def _prefix(self, ids: list[int]) -> tuple[list[int], list | None]:
        """The longest ids fed this round that `ids` extend by at least one token, and their K/V, taken
        (a branch that starts there later is prefilled whole); ([], None) if none."""
        with self.cond:
            best = max((k for k, (fed, _) in enumerate(self.prefixes) if self.reuse_min <= len(fed) < len(ids)
                        and ids[len(fed) - 1] == fed[-1] and ids[:len(fed)] == fed),
                       key=lambda k: len(self.prefixes[k][0]), default=None)
            return self.prefixes.pop(best) if best is not None else ([], None)
