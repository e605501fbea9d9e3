"""The two sides of whoever samples the policy's tokens (docs/design.md §1, §6e): the sampling side
(`Backend`) that the samplers ask for tokens, and the sync side (`Sync`) through which the rollout
source keeps what samples on the learner's current weights.

Every kind of sampler (single-turn completions: rl/rollout/completions.py `CompletionSampler`; episodes against an
environment: rl/rollout/episodes.py; agent programs through the endpoint: rl/rollout/programs.py) takes a
`Backend` and asks it for tokens in one of three shapes; the backend decides how they are computed:

- `complete(prompts, generators, return_kv)`: G samples after each prompt (a rollout round's groups);
- `play(starts, generators, turn, ...)`: episodes, each a sequence of turns the backend samples and
  the sampler's `turn(k, completion)` continues (the tokens it inserts) or ends (None);
- `generate(ids, max_tokens, seed, key)`: one request after exactly `ids`, from any thread (an agent
  program's), batched with the requests in flight; `key` names its session (a pool of servers sends
  a session's requests to one server).

Each answer is a `Completion` (rl/records.py, with the version convention of every record). Two
backends: rl/backends/local/backend.py (the in-process decoder) and rl/backends/vllm/backend.py (a pool of vLLM
servers); tests bring fakes of both protocols.

The sync side: `sync(model, step)` makes the backend sample `model`'s current weights, those of the
learner's step `step` (a server's: published when they changed; the versions its tokens record).
How weights travel is the sync's alone (rl/backends/vllm/weights/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from backstream.checks import UserError
from backstream.rl.records import Completion, Played


@dataclass(kw_only=True)
class SamplingParams:
    """What a backend samples with: the sampling keys of `[rollout]` (rl/rollout/source.py `RolloutConfig`
    is the section: these, and how many samples per prompt, who samples and how far ahead). A caller of
    the decoder says how many tokens: `max_new_tokens` has no default here, the run's is the section's."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens holding at least this mass; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 turns it off."""
    max_new_tokens: int
    """Most tokens sampled per completion (a completion cut here has finish_reason "length")."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends right after the token that completes one (needs a tokenizer)."""

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad(self, "temperature", "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(self, "top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad(self, "top_k", "an integer >= 0 (0 = off)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad(self, "max_new_tokens", "an integer >= 1")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad(self, "stop", "a list of non-empty strings")

    def sampling(self) -> SamplingParams:
        """These parameters alone (of a `RolloutConfig`: without the section's other keys)."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)})


def bad(config, name: str, allowed: str):
    raise UserError(f"rollout.{name}: got {getattr(config, name)!r}, expected {allowed}")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Backend(Protocol):
    """What a sampler asks of whoever samples (see the module docstring)."""

    in_process: bool
    """True: the learner's own model samples in this process (its K/V can be handed to the engine, an
    episode's tools run between its rounds, and nothing samples while the learner trains)."""
    metric_keys: tuple[str, ...]
    """The keys `metrics` adds to a step's line."""

    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None) -> list[Completion]:
        """`group_size` samples after each prompt, group j drawn from `generators[j]`, in order."""

    def play(self, starts: list[list[int]], generators: list, turn: Callable, budget: Callable[[int], int],
             max_turns: int, return_kv: bool = False) -> list[Played]:
        """Episodes from `starts` (one per episode; episode k draws from `generators[k]`): each turn is
        sampled after the episode's ids so far with `budget(length)` tokens at most, then
        `turn(k, completion)` returns the tokens to feed before its next turn, or None when it is over."""

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str | None = None) -> Completion:
        """One request after exactly `ids` (thread-safe), drawn with `seed`; `key`: its session."""

    def round(self, episodes: int):
        """A context in which a round's `episodes` agent programs send requests (`generate`); its value's
        `done()` says one episode is over (a local backend batches on who still plays)."""

    def metrics(self, versions: list[Tensor]) -> dict[str, float]:
        """The backend's metrics of a rollout's per-sample token versions (`metric_keys`)."""

    def close(self) -> None:
        """Let go of what the sampling side holds (requests in flight on a server of your own)."""


class Sync(Protocol):
    """The sync side: what samples holds the policy's weights (see the module docstring)."""

    def need_context(self, tokens: int, why: str) -> None:
        """A sampler's longest sequence, `why` naming what sets it (a server's context must hold it)."""

    def check(self, model) -> None:
        """What sampling needs of the policy, before the run folder is written (a server's context)."""

    def view(self, model):
        """A context in which `model` is as the sampler reads it (FSDP's parameters gathered, for one
        that samples in process; a server's sync gathers what it publishes itself)."""

    def sync(self, model, step: int, progress=None) -> float:
        """Sample `model`'s current weights, those of the learner's step `step`, from now on (a server:
        started at the first call, published when they changed); the seconds spent publishing.
        `progress(seconds)` while a server starts."""

    def idle(self) -> None:
        """Sampling is over until the next sync (a server on the learner's GPU sleeps: vllm.colocate)."""

    def kernels(self) -> dict[str, str]:
        """What the sampler's low-bit kernels compute, for the learner to copy ({"int8_gemm": name} or {})."""

    def check_aligned(self, model) -> None:
        """QaRL: refuse a sampler whose quantized forward differs from the learner's (after `kernels`)."""

    def close(self) -> None:
        """Stop what the sync side started (servers), and what it wrote."""


class Done:
    """The value of a round that needs no bookkeeping: `done()` does nothing."""

    def done(self) -> None:
        """Nothing: requests are taken whenever they come."""


@contextlib.contextmanager
def no_rounds(episodes: int):
    """`Backend.round` of a backend that takes requests whenever they come and batches what is in flight
    itself (a server, a test's fake): nothing to open, close or count."""
    yield Done()
