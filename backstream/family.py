"""The family contract (DESIGN §6b): what the streamed backward may assume of a transformers model,
checked while it runs.

The engine drives a model through transformers' `Cache` and attention interface. That computes the
full-sequence gradient only if every layer's attention is softmax(scale·qkᵀ [soft-capped] + causal /
sliding-window mask [+ sink])·v over the K/V that `cache.update` returned, positions enter only
through `position_ids`, and the forward is deterministic. Each guard here checks one of those from
what the engine *sees* (attention keywords, the mask function transformers builds, tensor identity,
the RoPE type, dropout modules), not from a list of class names, so that a family no test names is
covered by the same checks. A model that fails one gets `Unsupported` (or a `ValueError` when the
user can fix it in one line), never a silently different gradient.
"""

from __future__ import annotations


class Unsupported(NotImplementedError):
    """The model uses a feature the streamed backward cannot (yet) compute exactly. The message
    starts with `model:` and names the feature and what the user can do."""
