"""backstream: exact streamed backward over shared-prefix token trees for RL post-training."""

from backstream.engine import StreamResult, StreamStats, logprobs, stream_backward
from backstream.objective import BlockView, Objective, TokenWeights, flat_offsets
from backstream.planner import Plan, estimate
from backstream.reference import reference_backward
# the function shadows its module's name on the package (`from backstream.verify import miniature` still works);
# the module imports nothing heavy until it is called
from backstream.verify import VerifyReport, verify


def train(config=None, overrides=(), resume=None, model=None, tokenizer=None, overwrite=False) -> str:
    """Run an RL job (see `backstream.trainer.train`); imported lazily, the engine needs none of it."""
    from backstream.trainer import train as _train  # noqa: PLC0415

    return _train(config, overrides, resume=resume, model=model, tokenizer=tokenizer, overwrite=overwrite)


__all__ = [
    "BlockView", "Objective", "Plan", "StreamResult", "StreamStats", "TokenWeights", "VerifyReport", "estimate",
    "flat_offsets", "logprobs", "reference_backward", "stream_backward", "train", "verify",
]
