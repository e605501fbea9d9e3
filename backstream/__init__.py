"""backstream: exact streamed backward over shared-prefix token trees for RL post-training."""

from backstream.engine import StreamResult, StreamStats, logprobs, stream_backward
from backstream.objective import BlockView, Objective, TokenWeights, flat_offsets
from backstream.planner import Plan, estimate
from backstream.reference import reference_backward

__all__ = [
    "BlockView", "Objective", "Plan", "StreamResult", "StreamStats", "TokenWeights", "estimate",
    "flat_offsets", "logprobs", "reference_backward", "stream_backward",
]
