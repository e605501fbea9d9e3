"""What a sampler is (docs/design.md §1, §6d): the one protocol the trainer's step talks to, whichever
backend plays the rollout. `build_sampler` picks the run's: `rollout.Sampler` (G single-turn
completions per prompt, in process) or `agent.episodes.EpisodeSampler` (G multi-turn episodes per
task against `[env]`). A rollout served by another engine (vLLM) is one more implementation.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from backstream.rl.rollout import Rollout, SamplingConfig


class RolloutSampler(Protocol):
    """A sampler as the trainer uses it."""

    metric_keys: tuple[str, ...]
    """The keys `metrics` adds to a step's line."""
    environment: object
    """The run's `Environment` (its get_reward is a reward), or None."""

    def check_prompts(self, examples: list[dict]) -> int:
        """Render every example's prompt once before the run (a mistake fails now); the longest."""

    def sample(self, model, rows: list[dict], indices: list[int], generators: list, progress=None) -> Rollout:
        """G samples for each example `indices[j]` (the data's row `rows[j]`), group j drawn with
        `generators[j]`; `progress(done, n)` after each group."""

    def reward_inputs(self, r: Rollout, rows: list[dict]) -> tuple[list, list, dict]:
        """(completions, prompts, extra keyword arguments) as TRL passes them to reward functions."""

    def metrics(self, r: Rollout) -> dict[str, float]:
        """The rollout's own metrics (`metric_keys`)."""

    def timings(self) -> dict[str, float]:
        """Seconds of the last `sample` spent in phases of their own (an episode's tools: "tool")."""

    def release(self) -> None:
        """Let go of what the last `sample` held for its reward functions."""

    def close(self) -> None:
        """Stop what the sampler started (worker processes, a server)."""


def build_sampler(env_cfg, config: SamplingConfig, tokenizer, eos: list[int], return_kv: bool,
                  prompts: list[Tensor], prompt_text: list[str], context: int | None) -> RolloutSampler:
    """The run's sampler: episodes against `[env]` when it names an environment or tools, else
    single-turn completions."""
    if env_cfg.enabled:
        from backstream.rl.agent.episodes import EpisodeSampler  # noqa: PLC0415  (the agent room)

        return EpisodeSampler(config, env_cfg, tokenizer, eos, return_kv, context)
    from backstream.rl.rollout import Sampler  # noqa: PLC0415

    return Sampler(config, tokenizer, eos, return_kv, prompts, prompt_text)


def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a turn: the tokenizer's EOS and the model's generation config's (a chat
    model's end-of-turn token, <|im_end|> say, is often only there)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
    return list(dict.fromkeys(ids))
