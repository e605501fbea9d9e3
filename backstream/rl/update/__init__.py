"""Who learns: the RL objectives (`losses`), the off-policy weights, the backward chosen by `[engine]`
and the optimizer step."""
