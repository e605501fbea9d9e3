"""Low-bit rollouts aligned with the learner (QaRL, docs/design.md §6): the formats with vLLM's numerics, one
class each (`formats`), the quantized linear layer with a straight-through backward (`linear`), and a
quantized model as the compressed-tensors folder a sampler loads (`compressed`; `backstream export`,
backstream/export.py, writes a run's checkpoint so)."""
