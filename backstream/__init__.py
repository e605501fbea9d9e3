"""backstream: exact streamed backward over shared-prefix token trees for RL post-training.

The names below are imported on first use (PEP 562), so that a process that needs only a leaf module
(an environment's worker, say) does not import torch and transformers for them."""

import importlib

_NAMES = {
    "StreamResult": "backstream.stream.engine", "StreamStats": "backstream.stream.engine",
    "logprobs": "backstream.stream.engine", "stream_backward": "backstream.stream.engine",
    "BlockView": "backstream.stream.objective", "Objective": "backstream.stream.objective",
    "TokenWeights": "backstream.stream.objective", "flat_offsets": "backstream.stream.objective",
    "Plan": "backstream.stream.planner", "estimate": "backstream.stream.planner",
    "reference_backward": "backstream.stream.reference",
    "VerifyReport": "backstream.stream.verify", "verify": "backstream.stream.verify",
}


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'backstream' has no attribute {name!r}")


def train(config=None, overrides=(), resume=None, model=None, tokenizer=None, overwrite=False) -> str:
    """Run an RL job (see `backstream.trainer.train`); imported lazily, the engine needs none of it."""
    from backstream.trainer import train as _train  # noqa: PLC0415

    return _train(config, overrides, resume=resume, model=model, tokenizer=tokenizer, overwrite=overwrite)


__all__ = [
    "BlockView", "Objective", "Plan", "StreamResult", "StreamStats", "TokenWeights", "VerifyReport", "estimate",
    "flat_offsets", "logprobs", "reference_backward", "stream_backward", "train", "verify",
]
