"""Who samples the policy's tokens, as the rest of the run sees it (docs/design.md §1, §6e): the
protocols a backend implements, each as narrow as its users need it, and `Sampling`, what the run
holds of one (built by rl/backends/__init__.py `build_backend`).

- `Backend`, what the samplers ask for tokens, in one of three shapes (the backend decides how they
  are computed): `complete(prompts, ...)`, G samples after each prompt (a round's groups);
  `play(starts, ..., turn)`, episodes, each a sequence of turns the backend samples and the sampler's
  `turn(k, completion)` continues (the tokens it inserts) or ends (None); `round(episodes)`, a round of
  agent programs whose `Requests` (`generate` after exactly the ids given, from any thread; `finish`
  when a session is over) it batches or routes.
- `Weights`, what keeps the backend on the learner's weights: `sync(model, step)` (a server's:
  published when they changed; the version every token records). How weights travel is the server
  weights' alone (rl/backends/vllm/weights/).
- What only some backends have, each a protocol of its own that `Sampling` lists where it exists:
  `Preflight` (what the policy must fit, checked before the run folder is written: a server's context
  and K/V cache), `Aligned` (QaRL: a sampler's low-bit kernels the learner copies and is checked
  against), `Resting` (a server on the learner's GPU that sleeps while the learner trains) and
  `Reporter` (metrics of its own on the step's line: a pool's requests per server).

Each answer is a `Completion` (rl/records.py, with the version convention of every record). Two
backends: rl/backends/local/ (the in-process decoder) and rl/backends/vllm/ (a pool of vLLM servers);
tests bring fakes of the protocols (tests/fake_backend.py).
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
from backstream.rl.records import Completion, Played, Samples


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


class Requests(Protocol):
    """A round's requests of agent programs (`Backend.round`)."""

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
        """One request after exactly `ids` (thread-safe), drawn with `seed`; `key`: its session."""

    def finish(self, key: str) -> None:
        """Session `key` is over: no request of it comes again (a local backend batches on who still
        plays; a pool forgets which server held it)."""


class Backend(Protocol):
    """What a sampler asks of whoever samples (see the module docstring)."""

    in_process: bool
    """True: the learner's own model samples in this process (its K/V can be handed to the engine, an
    episode's tools run between its rounds, and nothing samples while the learner trains)."""

    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None, pictures: list[list] | None = None) -> list[Completion]:
        """`group_size` samples after each prompt, group j drawn from `generators[j]`, in order;
        `pictures[j]`: the images prompt j's placeholders stand for (stream/vision.py `Picture`), for a
        vision-language model."""

    def play(self, starts: list[list[int]], generators: list, turn: Callable, budget: Callable[[int], int],
             max_turns: int, return_kv: bool = False) -> list[Played]:
        """Episodes from `starts` (one per episode; episode k draws from `generators[k]`): each turn is
        sampled after the episode's ids so far with `budget(length)` tokens at most, then
        `turn(k, completion)` returns the tokens to feed before its next turn, or None when it is over."""

    def round(self, episodes: int) -> contextlib.AbstractContextManager[Requests]:
        """A context in which a round's `episodes` agent programs send their `Requests`; a request after
        it ended is refused where the model is the learner's own (it is being trained)."""


class Weights(Protocol):
    """What keeps the backend sampling the learner's current weights."""

    def sync(self, model, step: int, progress=None) -> float:
        """Sample `model`'s current weights, those of the learner's step `step`, from now on (a server:
        started at the first call, published when they changed); the seconds spent publishing.
        `progress(seconds)` while a server starts."""


class Preflight(Protocol):
    """What sampling needs of the policy, checked before the run folder is written."""

    def need_context(self, tokens: int, why: str) -> None:
        """A sampler's longest sequence, `why` naming what sets it (a server's context must hold it)."""

    def check(self, model) -> None:
        """Refuse, by name, a policy the backend cannot sample (a server's context and K/V cache)."""


class Aligned(Protocol):
    """QaRL (docs/quant.md): a sampler's low-bit kernels, which the learner's quantized forward copies."""

    def kernels(self) -> dict[str, str]:
        """What the sampler's low-bit kernels compute, for the learner to copy ({"int8_gemm": name} or {})."""

    def check_aligned(self, model) -> None:
        """Refuse a sampler whose quantized forward differs from the learner's (after `kernels`)."""


class Resting(Protocol):
    """A backend that gives the learner its device while the learner trains."""

    def rest(self) -> None:
        """The step's samples are in: sampling is over until the next sync."""


class Reporter(Protocol):
    """A part with metrics of its own on the step's line."""

    metric_keys: tuple[str, ...]
    """The keys `metrics` adds."""

    def metrics(self, samples: Samples) -> dict[str, float]:
        """Its metrics of the step (`samples`: the step's, every rank's)."""


@dataclass
class Sampling:
    """What the run samples with (`build_backend`, or a test's fakes): the backend the samplers ask, the
    weights the rollout source syncs, and what only some backends have (see the module docstring);
    `closing` stops what they started, last built first."""

    backend: Backend
    weights: Weights
    preflight: tuple[Preflight, ...] = ()
    aligned: tuple[Aligned, ...] = ()
    resting: tuple[Resting, ...] = ()
    reporters: tuple[Reporter, ...] = ()
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def close(self) -> None:
        self.closing.close()
