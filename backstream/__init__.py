"""backstream: exact streamed backward over shared-prefix token trees for RL post-training."""

from backstream.stream.engine import StreamResult, StreamStats, logprobs, stream_backward
from backstream.stream.objective import BlockView, Objective, TokenWeights, flat_offsets
from backstream.stream.planner import Plan, estimate
from backstream.stream.reference import reference_backward
# the module imports nothing heavy until the function is called
from backstream.stream.verify import VerifyReport, verify


def train(config=None, overrides=(), resume=None, model=None, tokenizer=None, overwrite=False) -> str:
    """Run an RL job (see `backstream.trainer.train`); imported lazily, the engine needs none of it."""
    from backstream.trainer import train as _train  # noqa: PLC0415

    return _train(config, overrides, resume=resume, model=model, tokenizer=tokenizer, overwrite=overwrite)


__all__ = [
    "BlockView", "Objective", "Plan", "StreamResult", "StreamStats", "TokenWeights", "VerifyReport", "estimate",
    "flat_offsets", "logprobs", "reference_backward", "stream_backward", "train", "verify",
]
