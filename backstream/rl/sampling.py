"""What a sampler is (docs/design.md §1, §6d): the one protocol the trainer's step talks to, whichever
backend plays the rollout. `Samplers.build` picks the run's (the trainer's and the evaluation's): on
`rollout.backend = "vllm"` rl/vllm's `VLLMSampler` or `VLLMEpisodeSampler`, which share one server;
otherwise `build_sampler`'s in-process ones, `rollout.Sampler` (G single-turn completions per
prompt) or `agent.episodes.EpisodeSampler` (G multi-turn episodes per task against `[env]`).
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
        `generators[j]`; `progress(done, n)` after each group, `progress(done, n, what)` to say what a
        long wait is (a server starting). Under torchrun every rank calls it at
        every round, with an empty share too (a server's weight sync is a collective). `model`: the
        learner; a server's samplers also take None, from an asynchronous run's producer, which
        publishes the weights itself (rl/producer.py) and calls `sample` from threads of its own."""

    def reward_inputs(self, r: Rollout, rows: list[dict]) -> tuple[list, list, dict]:
        """(completions, prompts, extra keyword arguments) as TRL passes them to reward functions."""

    def metrics(self, r: Rollout) -> dict[str, float]:
        """The rollout's own metrics (`metric_keys`)."""

    def timings(self) -> dict[str, float]:
        """Seconds of the last `sample` spent in phases of their own (an episode's tools: "tool")."""

    def release(self, r: Rollout | None = None) -> None:
        """Let go of what the samples of `r` (None: every sample so far) held for their reward functions,
        once they are scored (an episode's environment)."""

    def close(self) -> None:
        """Stop what the sampler started (worker processes, a server)."""


def build_sampler(env_cfg, config: SamplingConfig, tokenizer, eos: list[int], return_kv: bool,
                  prompts: list[Tensor], prompt_text: list[str], context: int | None) -> RolloutSampler:
    """The in-process sampler: episodes against `[env]` when it names an environment or tools, else
    single-turn completions."""
    if env_cfg.enabled:
        from backstream.rl.agent.episodes import EpisodeSampler  # noqa: PLC0415  (the agent room)

        return EpisodeSampler(config, env_cfg, tokenizer, eos, return_kv, context)
    from backstream.rl.rollout import Sampler  # noqa: PLC0415

    return Sampler(config, tokenizer, eos, return_kv, prompts, prompt_text)


class Samplers:
    """The run's samplers (training, evaluation) on its backend, `rollout.backend`, and what they
    share: nothing for "local"; for "vllm", one server and its weight publisher (rl/vllm/), shared by
    every rank of a torchrun job (`dp`: the run's rl/parallel.py object). `close` stops what the
    backend started."""

    def __init__(self, cfg, tokenizer, eos: list[int], context: int | None, run_dir: str, dp=None):
        self.cfg, self.tok, self.eos, self.context, self.run_dir = cfg, tokenizer, eos, context, run_dir
        self.publisher = None
        if cfg.rollout.backend == "vllm":
            from backstream.rl.vllm.sampler import WeightPublisher  # noqa: PLC0415  (only a vLLM run needs it)
            from backstream.rl.vllm.server import logprobs_mode  # noqa: PLC0415

            mode = logprobs_mode(cfg.rollout.top_p, cfg.rollout.top_k)
            in_flight = cfg.rollout.in_flight if cfg.rollout.max_staleness else "wait"
            self.publisher = WeightPublisher(cfg.vllm, tokenizer, run_dir, cfg.train.seed, dp, mode, cfg.quant,
                                             cfg.model, in_flight)
        self.built: list[RolloutSampler] = []

    def build(self, config: SamplingConfig, prompts: list[Tensor], prompt_text: list[str],
              return_kv: bool) -> RolloutSampler:
        if self.cfg.env.program:
            sampler = self._agent_sampler(config)
        elif self.publisher is not None and self.cfg.env.enabled:
            from backstream.rl.vllm.sampler import VLLMEpisodeSampler  # noqa: PLC0415

            sampler = VLLMEpisodeSampler(config, self.cfg.env, self.tok, self.eos, self.context, self.publisher)
        elif self.publisher is not None:
            from backstream.rl.vllm.sampler import VLLMSampler  # noqa: PLC0415

            sampler = VLLMSampler(config, self.tok, self.eos, prompts, prompt_text, self.publisher)
        else:
            sampler = build_sampler(self.cfg.env, config, self.tok, self.eos, return_kv, prompts, prompt_text,
                                    self.context)
        self.built.append(sampler)
        return sampler

    def _agent_sampler(self, config: SamplingConfig) -> RolloutSampler:
        """An agent program's episodes through the run's endpoint, the backend's answers behind it."""
        from backstream.rl.agent.answers import LocalAnswers  # noqa: PLC0415  (the agent room)
        from backstream.rl.agent.programs import AgentSampler  # noqa: PLC0415

        env = self.cfg.env
        limit = env.token_limit(self.context)
        if self.publisher is not None:
            from backstream.rl.vllm.sampler import ServerAnswers  # noqa: PLC0415

            why = (f"env.max_episode_tokens = {env.max_episode_tokens}" if limit == env.max_episode_tokens else
                   "the model's context (an agent's conversation may grow to it; env.max_episode_tokens bounds it)")
            answers = ServerAnswers(config, self.eos, self.publisher, limit, why)
        else:
            answers = LocalAnswers(config, self.eos, self.tok)
        return AgentSampler(config, env, self.tok, self.eos, self.context, answers)

    def at_step(self, step: int) -> None:
        """The learner's weights are now those of `step` (0: the initial ones): the version a server's
        samples record (rl/vllm `WeightPublisher.at_step`); nothing locally, where the sampler always
        runs the current weights."""
        if self.publisher is not None:
            self.publisher.at_step(step)

    def publish(self, model) -> None:
        """A server's weights made `model`'s now (the server started first, if it was not): an
        asynchronous run's producer publishes at each step boundary (rl/producer.py)."""
        if self.publisher is not None:
            self.publisher.ensure(model)

    def check(self, model) -> None:
        """What the backend needs of the policy, checked once every sampler is built (they tell the
        longest sequence the run samples) and before the run folder is written: a vLLM server's
        context and K/V cache (`WeightPublisher.check`); nothing locally."""
        if self.publisher is not None:
            self.publisher.check(model)

    def close(self) -> None:
        for sampler in self.built:
            sampler.close()
        if self.publisher is not None:
            self.publisher.close()


def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a turn: the tokenizer's EOS and the model's generation config's (a chat
    model's end-of-turn token, <|im_end|> say, is often only there)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
    return list(dict.fromkeys(ids))
