"""Who asks for samples: the rollout source that owns a step's rounds, the collect phase, the three
kinds of sampler side by side (completions, episodes, agent programs) and the evaluation."""
