"""The RL loop's parts, each folder answering one question (the trainer, backstream/trainer.py, calls them
phase by phase; backstream/parts.py builds them). They use the streamed-backward library
(backstream/stream/), never the reverse.

    records.py   what a round's samples are (`Samples`, `Completion`, `Round`, ...), the bottom floor
    policy.py    the policy to train ([model]: the default model, a Hub id or a folder, LoRA)
    data/        where prompts come from ([data]: files, the built-in tasks)
    parallel/    who runs where (torchrun: the process group, the batch split by whole groups)
    backends/    who computes the samples (the protocols, the in-process decoder, a pool of vLLM servers)
    agent/       what an episode is played against (environments, tools, turns; an agent program's endpoint)
    rollout/     who asks for samples (the source, the collect phase, the three kinds of sampler, [eval])
    scoring/     who scores (the reward functions, the overlong shaping, the advantages)
    update/      who learns (the objectives, the off-policy weights, the backward, the optimizer step)
"""
