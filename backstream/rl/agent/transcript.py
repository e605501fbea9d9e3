"""An agent program's episode as branches of one token tree (issue 34, docs/agentic.md).

An agent written against an OpenAI-compatible endpoint sends its whole conversation at every turn;
rendered with the chat template, those ids may extend what the episode holds so far, or not: a
template that strips earlier reasoning (Qwen3's), a tool result re-tokenized, a history the agent
summarised or edited. A `Transcript` takes each request's ids as they are:
  - ids that extend a branch (its tokens are a prefix of them) continue that branch: the new tokens
    are context (no loss), and the answer's sampled tokens follow;
  - ids that extend none start a new branch: the longest prefix they share with any branch, then the
    rest as context.
Every sampled token carries its loss on the branch it was sampled on, in the context it was sampled
in (the request's ids and the answer's tokens before it). A later branch that holds the same token
(forked after it) holds it as context only, so it is trained once; the engine's token tree computes
the shared prefix once whatever the branches.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field


@dataclass
class Branch:
    """One sequence of the episode: every token, and per token whether its loss is here (a token this
    branch sampled), the sampler's log-prob (NaN for context) and the weight version (-1 for context)."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def context(self, ids: list[int]) -> None:
        self.ids += ids
        self.sampled += [False] * len(ids)
        self.logprobs += [math.nan] * len(ids)
        self.versions += [-1] * len(ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Transcript:
    """The branches of one episode (see the module docstring); thread-safe: an agent may send requests
    concurrently, and a request that would extend a branch whose answer is still being sampled starts
    a branch of its own."""

    def __init__(self):
        self.branches: list[Branch] = []
        self.requests = 0
        self.pending: set[int] = set()  # branches whose answer is being sampled
        self.last: int | None = None  # the branch of the last answer (the agent's final conversation)
        self.conversation: list[dict] = []  # the last answer's request messages and the answer, as given
        self.closed = False  # the episode is over: answers that arrive now are not recorded
        self.lock = threading.Lock()

    def request(self, ids: list[int]) -> int:
        """The branch the answer to a request of `ids` is sampled on, marked pending until `answer`: the
        longest branch whose tokens are a prefix of `ids`, extended by the rest as context; else a new
        branch of `ids`, all context (what it shares with other branches is trained where it was
        sampled; the engine's tree computes it once). Returns its index."""
        with self.lock:
            self.requests += 1
            extend = [i for i, b in enumerate(self.branches)
                      if i not in self.pending and common_prefix(b.ids, ids) == len(b.ids)]
            if extend:
                i = max(extend, key=lambda j: len(self.branches[j].ids))
                self.branches[i].context(ids[len(self.branches[i].ids):])
            else:
                self.branches.append(Branch())
                i = len(self.branches) - 1
                self.branches[i].context(list(ids))
            self.pending.add(i)
            return i

    def answer(self, i: int, ids: list[int], logprobs: list[float], versions: list[int],
               conversation: list[dict] | None = None) -> bool:
        """The tokens sampled on branch i after its request, with their log-probs and weight versions
        and, as the rewards will see it, the conversation they end. False, and nothing recorded, once the
        transcript is closed."""
        with self.lock:
            if self.closed:
                return False
            b = self.branches[i]
            b.ids += ids
            b.sampled += [True] * len(ids)
            b.logprobs += list(logprobs)
            b.versions += list(versions)
            self.pending.discard(i)
            self.last = i
            if conversation is not None:
                self.conversation = conversation
            return True

    def close(self) -> None:
        """The episode is over: what it holds now is what is trained."""
        with self.lock:
            self.closed = True

    def divergences(self) -> int:
        """Branches after the first: how many times the agent's history extended none."""
        return max(0, len(self.branches) - 1)
