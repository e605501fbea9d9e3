"""What a sampler is (docs/design.md §1, §6d): the one protocol the rollout source talks to, whichever
backend samples. The run has one backend (rl/backends/: `LocalBackend` in process, `ServerBackend` on
a vLLM server) and `Samplers.build` puts one kind of sampler over it for the training data and one
for the evaluation's: `rollout.CompletionSampler` (G single-turn completions per prompt),
`agent.episodes.EpisodeSampler` (G multi-turn episodes per task against `[env]`) or
`agent.programs.AgentSampler` (an agent program's episodes through the run's endpoint).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import Samples


class Sampler(Protocol):
    """A sampler as the rollout source uses it."""

    metric_keys: tuple[str, ...]
    """The keys `metrics` adds to a step's line."""
    environment: object
    """The run's `Environment` (its get_reward is a reward), or None."""
    needs: tuple[int, str] | None
    """The longest sequence it samples and what sets it (a server's context must hold it), or None."""

    def check_prompts(self, examples: list[dict]) -> int:
        """Render every example's prompt once before the run (a mistake fails now); the longest."""

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Samples:
        """G samples for each example `indices[j]` (the data's row `rows[j]`), group j drawn with
        `generators[j]`, by the backend at the weights it was last synced with; `progress(done, n)`
        after each group. Thread-safe: an asynchronous source samples groups from threads of its own."""

    def reward_inputs(self, r: Samples, rows: list[dict]) -> tuple[list, list, dict]:
        """(completions, prompts, extra keyword arguments) as TRL passes them to reward functions."""

    def metrics(self, r: Samples) -> dict[str, float]:
        """The rollout's own metrics (`metric_keys`)."""

    def timings(self, r: Samples) -> dict[str, float]:
        """Seconds of sampling `r` spent in phases of their own (an episode's tools: "tool")."""

    def release(self, r: Samples | None = None) -> None:
        """Let go of what the samples of `r` (None: every sample so far) held for their reward functions,
        once they are scored (an episode's environment)."""

    def close(self) -> None:
        """Stop what the sampler started (worker processes, an endpoint)."""


class Samplers:
    """The run's samplers (training, evaluation) over its one backend's sampling side (`backend`);
    `sync`: its sync side. `close` stops them and what the backend started."""

    def __init__(self, cfg, tokenizer, eos: list[int], context: int | None, backend, sync):
        self.cfg, self.tok, self.eos, self.context = cfg, tokenizer, eos, context
        self.backend, self.sync = backend, sync
        self.built: list[Sampler] = []

    def build(self, config: SamplingParams, group_size: int, prompts: list[Tensor], prompt_text: list[str],
              return_kv: bool) -> Sampler:
        """The run's kind of sampler, `group_size` samples per prompt of `prompts`."""
        env = self.cfg.env
        if env.program:
            from backstream.rl.rollout.programs import AgentSampler  # noqa: PLC0415  (the agent room)

            sampler = AgentSampler(config, group_size, env, self.tok, self.eos, self.context, self.backend)
        elif env.enabled:
            from backstream.rl.rollout.episodes import EpisodeSampler  # noqa: PLC0415

            sampler = EpisodeSampler(config, group_size, env, self.tok, self.eos, return_kv, self.context, self.backend)
        else:
            from backstream.rl.rollout.completions import CompletionSampler  # noqa: PLC0415

            sampler = CompletionSampler(config, group_size, self.tok, self.eos, return_kv, prompts, prompt_text,
                                        self.backend)
        self.built.append(sampler)
        return sampler

    def check(self, model) -> None:
        """What the backend needs of the policy, checked once every sampler is built (they tell the
        longest sequence the run samples) and before the run folder is written: a vLLM server's
        context and K/V cache; nothing locally."""
        for sampler in self.built:
            if sampler.needs is not None:
                self.sync.need_context(*sampler.needs)
        self.sync.check(model)

    def close(self) -> None:
        for sampler in self.built:
            sampler.close()
        self.backend.close()
        self.sync.close()
