"""The RL loop's parts, used by `backstream.trainer`: prompts (data, tasks), the policy (model, optim),
the sampler (rollout), rewards, advantages, the RL objectives (the losses package, offpolicy, shaping) and data
parallelism under torchrun (parallel). They use the streamed-backward library, never the reverse."""
