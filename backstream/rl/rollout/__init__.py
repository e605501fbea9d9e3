"""Who asks for samples: `[rollout]` and the rollout source that owns a step's rounds (`source`), the
collect phase (`collect`), the sampler protocol (`sampler`) and its three kinds side by side
(`completions`, `episodes`, agent `programs`), the evaluation (`evaluate`), and `build_sampler`, the
run's kind."""

from __future__ import annotations

import contextlib


def build_sampler(env, params, group_size: int, *, tokenizer, eos: list[int], context: int | None,
                  backend, examples: list[dict], prompts: list, prompt_text: list[str], return_kv: bool,
                  closing: contextlib.ExitStack, pictures: list | None = None, vision=None):
    """The run's kind of sampler for `[env]` `env` over `backend`, `group_size` samples per example of
    `examples` (their token ids `prompts`, text `prompt_text` and images `pictures`; `vision`: a
    vision-language policy's `Pictures`, rl/data/images.py, for its episodes); what it starts is stopped by
    `closing`. Returns (the sampler, what the reward 'env' reads: an environment's get_reward or an
    agent program's reward, None for completions)."""
    if env.program:
        from backstream.rl.rollout.programs import AgentSampler  # noqa: PLC0415  (the agent room)

        sampler = AgentSampler(params, group_size, env, tokenizer, eos, context, backend, vision=vision)
        closing.callback(sampler.close)
        return sampler, sampler.environment
    if env.enabled:
        from backstream.rl.agent.env import Environment  # noqa: PLC0415
        from backstream.rl.rollout.episodes import EpisodeSampler  # noqa: PLC0415

        environment = Environment.load(env)
        closing.callback(environment.close)
        sampler = EpisodeSampler(params, group_size, env, environment, tokenizer, eos, return_kv, context, backend,
                                 examples, vision=vision, pictures=pictures)
        closing.callback(sampler.close)
        return sampler, environment
    from backstream.rl.rollout.completions import CompletionSampler  # noqa: PLC0415

    return CompletionSampler(params, group_size, tokenizer, eos, return_kv, prompts, prompt_text, backend,
                             pictures), None
