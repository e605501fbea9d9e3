"""Low-bit rollouts aligned with the learner (QaRL, DESIGN §6): the formats with vLLM's numerics, the
quantized linear layer with a straight-through backward, and `backstream export` to compressed-tensors."""
