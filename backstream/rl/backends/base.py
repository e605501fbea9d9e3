"""The backend protocol: who samples the policy's tokens (docs/design.md §1, §6e).

Every kind of sampler (single-turn completions: rl/rollout.py `Sampler`; episodes against an
environment: rl/agent/episodes.py; agent programs through the endpoint: rl/agent/programs.py) takes a
`Backend` and asks it for tokens in one of three shapes; the backend decides how they are computed:

- `complete(prompts, generators, return_kv)`: G samples after each prompt (a rollout round's groups);
- `play(starts, generators, turn, ...)`: episodes, each a sequence of turns the backend samples and
  the sampler's `turn(k, completion)` continues (the tokens it inserts) or ends (None);
- `generate(ids, max_tokens, seed)`: one request after exactly `ids`, from any thread (an agent
  program's), batched with the requests in flight.

Each answer is a `Completion`: token ids, the log-probs of the learner's convention and the weight
version of every token. `sync(model)` makes the backend sample the policy's current weights (the
rollout source calls it inside the policy view: quantized, gathered), `at_step(step)` says which step
made them. Two backends: rl/backends/local.py (the in-process decoder) and rl/backends/server.py
(a vLLM server); tests bring fakes of this protocol.

One version convention: a sampled token carries the learner step whose weights sampled it (0: the
initial weights); a token the sampler inserted (a tool result, a template token) carries -1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

CONTEXT = -1  # the weight version of a token no policy sampled (inserted, prompt)


@dataclass
class Completion:
    """One sample after some token ids: its tokens, their log-probs under softmax(logits / T) before
    truncation, the weight version each was sampled with, how it ended ("eos", "stop" for a stop string,
    "length"), and in process with `return_kv` the K/V of every position of the sequence but its last."""

    ids: list[int]
    logprobs: Tensor  # float, one per token
    versions: Tensor  # int64, one per token
    reason: str
    kv: object = None


def at_version(ids: list[int], logprobs: Tensor, version: int, reason: str, kv=None) -> Completion:
    """A completion whose every token was sampled with the weights of `version`."""
    return Completion(list(ids), logprobs, torch.full((len(ids),), version, dtype=torch.long), reason, kv)


class Backend(Protocol):
    """What a sampler asks of whoever samples (see the module docstring)."""

    in_process: bool
    """True: samples the learner's model in this process (its K/V can be handed to the engine)."""
    metric_keys: tuple[str, ...]
    """The keys `metrics` adds to a step's line."""

    def need_context(self, tokens: int, why: str) -> None:
        """A sampler's longest sequence, `why` naming what sets it (a server's context must hold it)."""

    def check(self, model) -> None:
        """What the backend needs of the policy, before the run folder is written."""

    def at_step(self, step: int) -> None:
        """The learner's weights are now those of `step`: the version the next tokens record."""

    def sync(self, model, progress=None) -> float:
        """Sample `model`'s current weights from now on (a server: published if they changed; started at
        the first call); returns the seconds spent publishing. `progress(seconds)` while a server starts."""

    def kernels(self) -> dict[str, str]:
        """What the backend's low-bit kernels compute, for the learner to copy ({"int8_gemm": name} or {})."""

    def check_aligned(self, model) -> None:
        """QaRL: refuse a backend whose quantized forward differs from the learner's (after `kernels`)."""

    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None) -> list[Completion]:
        """`group_size` samples after each prompt, group j drawn from `generators[j]`, in order."""

    def play(self, starts: list[list[int]], generators: list, turn: Callable, budget: Callable[[int], int],
             max_turns: int, return_kv: bool = False) -> list[Played]:
        """Episodes from `starts` (one per episode; episode k draws from `generators[k]`): each turn is
        sampled after the episode's ids so far with `budget(length)` tokens at most, then
        `turn(k, completion)` returns the tokens to feed before its next turn, or None when it is over."""

    def generate(self, ids: list[int], max_tokens: int, seed: int) -> Completion:
        """One request after exactly `ids` (thread-safe), drawn with `seed`."""

    def start_round(self) -> None:
        """Requests (`generate`) may come now, from a round's agent programs."""

    def end_round(self) -> None:
        """The round's requests are over: any that still comes is refused."""

    def playing(self, n: int) -> None:
        """n more episodes may send requests (n < 0: fewer); a local backend batches on it."""

    def metrics(self, versions: list[Tensor]) -> dict[str, float]:
        """The backend's metrics of a rollout's per-sample token versions (`metric_keys`)."""

    def close(self) -> None:
        """Stop what the backend started."""


class NoRounds:
    """The request rounds of a backend that takes requests whenever they come and batches what is in
    flight itself (a server, a test's fake): nothing to open, close or count."""

    def start_round(self) -> None:
        """Nothing: requests are taken whenever they come."""

    def end_round(self) -> None:
        """Nothing: a request after its episode ended is the endpoint's to refuse."""

    def playing(self, n: int) -> None:
        """Nothing: what is in flight is batched as it comes."""


@dataclass
class Played:
    """An episode as the backend played it: every token it fed the model, in order (for the fidelity
    test), and with `return_kv` the K/V of every position but the last."""

    fed: list[int]
    kv: object = None


def oldest(versions: list[Tensor] | None) -> float:
    """The oldest weight version any sampled token of a rollout holds (NaN: no token)."""
    mins = [int(v[v >= 0].min()) for v in versions or [] if (v >= 0).any()]
    return float(min(mins)) if mins else math.nan
