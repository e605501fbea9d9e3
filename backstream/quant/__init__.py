"""Low-bit rollouts aligned with the learner (QaRL, docs/design.md §6): the formats with vLLM's numerics, one
class each (formats.py), the quantized linear layer with a straight-through backward (linear.py), and
`backstream export` to compressed-tensors (export.py)."""
