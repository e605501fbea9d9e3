"""What a sampler is (docs/design.md §1, §6d): the one protocol the rollout source and the collect phase
talk to, whichever backend samples; three kinds implement it (rl/rollout/__init__.py `build_sampler`
picks the run's): `CompletionSampler` (G single-turn completions per prompt, rl/rollout/completions.py),
`EpisodeSampler` (G multi-turn episodes per task against `[env]`, rl/rollout/episodes.py) and
`AgentSampler` (an agent program's episodes through the run's endpoint, rl/rollout/programs.py). What
every kind reports of its samples: `response_metrics`; what an episode's reward functions get:
`episode_reward_inputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from backstream.rl.records import EpisodeInfo, Round, Samples

RESPONSE_KEYS = ("response_length/mean", "response/truncated")


class Sampler(Protocol):
    """A sampler as the rollout source and the collect phase use it."""

    needs: tuple[int, str] | None
    """The longest sequence it samples and what sets it (a server's context must hold it), or None."""
    metric_keys: tuple[str, ...]
    """The keys `metrics` adds to a step's line."""

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Round:
        """G samples for each example `indices[j]` (the data's row `rows[j]`), group j drawn with
        `generators[j]`, by the backend at the weights it was last synced with; `progress(done, n)`
        after each group. Thread-safe: an asynchronous source samples groups from threads of its own."""

    def reward_inputs(self, r: Samples, rows: list[dict]) -> tuple[list, list, dict]:
        """(completions, prompts, extra keyword arguments) as TRL passes them to reward functions."""

    def metrics(self, r: Samples) -> dict[str, float]:
        """The samples' own metrics (`metric_keys`): their lengths, an episode's turns and tools."""


def response_metrics(r: Samples) -> dict[str, float]:
    """What every kind of sample has: the policy's tokens per sample (of an episode: its sampled turns),
    and the share that ran to the token limit."""
    n = max(1, len(r))
    return {"response_length/mean": float(sum(r.sampled_tokens()) / n),
            "response/truncated": sum(x == "length" for x in r.finish_reason) / n}


def episode_metric_keys(means: dict) -> tuple[str, ...]:
    """The keys of `episode_metrics` with the table `means`."""
    return (*RESPONSE_KEYS, *means, "episode/truncated")


def episode_metrics(r: Samples, means: dict[str, Callable[[EpisodeInfo], float]],
                    ended: tuple[str, ...]) -> dict[str, float]:
    """What every kind of sample has (`response_metrics`), the mean over the samples of each of `means`
    (key → a number of an episode's `EpisodeInfo`), and episode/truncated: the share of the episodes that
    ended for one of the reasons `ended` (a token limit, the turn limit)."""
    n, e = max(1, len(r)), r.episodes or []
    return {**response_metrics(r), **{k: sum(value(x) for x in e) / n for k, value in means.items()},
            "episode/truncated": sum(x in ended for x in r.finish_reason) / n}


def episode_reward_inputs(r: Samples) -> tuple[list, list, dict]:
    """(completions, prompts, extra keyword arguments) of episodes as TRL passes them with an environment:
    each episode's messages after the prompt (the last assistant message says how the episode ended:
    `finish_reason`), its prompt (messages for chat data, text otherwise; reset's text in it), its
    environment (an agent program's: its outcome), its completion's ids."""
    return ([e.messages for e in r.episodes], [e.prompt for e in r.episodes],
            {"completion_ids": [c.tolist() for c in r.completion_ids], "environments": [e.env for e in r.episodes]})
