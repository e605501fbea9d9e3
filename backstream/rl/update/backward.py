"""`[engine]`: how the trainer computes a minibatch's gradient, chosen once by `engine.backward`
(`BACKWARDS`): the exact streamed backward, or the naive full-sequence reference it is compared with.
Both take an objective and return the engine's `StreamResult`, and both compute log-probs alone."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from backstream.checks import UserError, at_least, literals
from backstream.stream import fsdp, vision
from backstream.stream.adapter import probe_layout
from backstream.stream.attention import KERNELS
from backstream.stream.engine import StreamResult, logprobs, stream_backward
from backstream.stream.hf import base_model
from backstream.stream.reference import reference_backward

GRAD_ACCUM_DTYPES = {"float32": torch.float32, "param": None}  # engine.grad_accum_dtype → stream_backward's grad_dtype


class StreamedBackward:
    """engine.backward = "stream": the exact streamed backward (docs/design.md §2), which times its own
    prefill and backward; log-probs alone from its prefill pass."""

    def __init__(self, ec: EngineConfig, device: torch.device):
        self.kw = {"grad_dtype": GRAD_ACCUM_DTYPES[ec.grad_accum_dtype], "kernel": ec.kernel}
        if ec.block_size:
            self.kw["block_size"] = ec.block_size
        if ec.memory_budget_mb:
            self.kw["memory_budget"] = ec.memory_budget_mb * 2**20

    def backward(self, model, sequences: list[Tensor], objective, kv: list | None, progress=None,
                 pictures: list | None = None) -> StreamResult:
        return stream_backward(model, sequences, objective=objective, kv=kv, progress=progress,
                               images=_images(model, sequences, pictures, grad=True), **self.kw)

    def logprobs(self, model, sequences: list[Tensor], mask: list[Tensor],
                 pictures: list | None = None) -> list[Tensor]:
        return logprobs(model, sequences, mask, kernel=self.kw["kernel"],
                        images=_images(model, sequences, pictures, grad=False))


class ReferenceBackward:
    """engine.backward = "reference": one full-sequence forward and backward per sample, the
    baseline the streamed backward is compared with (it ignores the rollout's K/V)."""

    def __init__(self, ec: EngineConfig, device: torch.device):
        self.device = device

    def backward(self, model, sequences: list[Tensor], objective, kv: list | None, progress=None,
                 pictures: list | None = None) -> StreamResult:
        t = time.perf_counter()
        res = reference_backward(model, sequences, objective=objective,
                                 images=_images(model, sequences, pictures, grad=True))
        res.stats.backward_s = time.perf_counter() - t  # the reference does not time itself
        return res

    def logprobs(self, model, sequences: list[Tensor], mask: list[Tensor],
                 pictures: list | None = None) -> list[Tensor]:
        """Plain full-sequence forwards, no grad; NaN outside `mask`."""
        out = []
        images = _images(model, sequences, pictures, grad=False)
        with torch.no_grad(), fsdp.gathered(model):  # no per-forward all-gather under FSDP
            for i, (s, m) in enumerate(zip(sequences, mask)):
                if images is None:
                    logits = model(input_ids=s[None].to(self.device), use_cache=False).logits[0, :-1]
                else:
                    logits = model(inputs_embeds=images.sequence_embeds(images.embed_module(model), i,
                                                                        s.to(self.device)),
                                   position_ids=images.position_ids(i, self.device), use_cache=False).logits[0, :-1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                lp = torch.full((len(s),), math.nan, dtype=logits.dtype)
                lp[1:] = torch.log_softmax(logits, -1).gather(-1, s[1:, None].to(self.device))[:, 0].cpu()
                lp[~m] = math.nan
                out.append(lp)
        return out


def _images(model, sequences: list[Tensor], pictures: list | None, grad: bool):
    """The engine's `Images` of sequences whose prompts hold `pictures` (None: none do): each distinct
    image encoded once, with its graph when the backward takes a gradient and the tower trains
    (`model.freeze_vision = false`), else the round's embeddings of the frozen tower reused."""
    if not pictures or not any(pictures):
        return None
    return vision.images_for(model, sequences, pictures, grad=grad and vision.tower_trains(model))


BACKWARDS = {"stream": StreamedBackward, "reference": ReferenceBackward}


@dataclass(kw_only=True)
class EngineConfig:
    backward: Literal[tuple(BACKWARDS)] = "stream"
    """stream (the exact streamed backward) or reference (one full-sequence backward per sample)."""
    block_size: int = 0
    """Tokens per block; 0 = the engine's default (or the planner's choice under memory_budget_mb)."""
    memory_budget_mb: int = 0
    """Let the planner pick the block size and rows per batch for this many MiB; 0 = off."""
    reuse_rollout_kv: bool = False
    """Hand the rollout's K/V to the engine (no prefill); only when epochs = minibatches = 1. Saves the
    prefill (a sixth of a step on a 2.4K-token chat prompt) at the cost of each row's copy of its
    prompt's K/V until the update (0.3-0.9 GiB more at the peak there): bench/README.md."""
    grad_accum_dtype: Literal[tuple(GRAD_ACCUM_DTYPES)] = "float32"
    """stream backward, bfloat16/float16 models: "float32" gathers each parameter's gradient over the
    block batches in a float32 buffer (4 bytes per trainable parameter during the backward) and
    rounds it into .grad once; "param" adds every block batch straight into .grad (one rounding per
    block batch: the error grows with the number of blocks). No effect in float32/float64."""
    kernel: Literal[KERNELS] = "auto"
    """The streamed backward's attention (stream/attention.py): "auto" = the fused kernel where one
    exists for the device and dtype (CPU flash; CUDA flash for fp16/bf16, memory-efficient for fp32;
    the naive path for float64 and soft-capping), "flash" = the fused one or an error, "math" = the naive
    reference path everywhere (stores [queries × keys] scores; the way back if a fused kernel misbehaves)."""
    verify: bool = True
    """Before training, check on a tiny random copy of the model's architecture (seconds, config only)
    that the streamed backward gives the exact gradient (`backstream verify`); stop unless it does.
    Only with backward = "stream"."""

    def __post_init__(self):
        literals(self, "engine")
        at_least("engine.block_size", self.block_size, 0)
        at_least("engine.memory_budget_mb", self.memory_budget_mb, 0)

    @property
    def streamed(self) -> bool:
        """Whether the backward is the streamed one (which engine.verify checks)."""
        return BACKWARDS[self.backward] is StreamedBackward

    def build(self, device: torch.device) -> StreamedBackward | ReferenceBackward:
        return BACKWARDS[self.backward](self, device)

    def check_model(self, model) -> None:
        """What the model itself rules out: a model whose layers keep recurrent or convolution state has
        no rollout K/V that holds it at each block boundary (docs/design.md §2b)."""
        if self.reuse_rollout_kv and probe_layout(model).states:
            layers = sorted(probe_layout(model).state_layers)
            raise UserError(f"engine.reuse_rollout_kv: {type(base_model(model)).__name__} keeps recurrent or "
                             f"convolution state in layers {layers}, which the rollout's K/V do not hold at each "
                             "block boundary (the engine's prefill computes it); set it to false")


_VERIFIED: dict = {}  # architecture → VerifyReport: a process checks each architecture once


def verify_engine(model) -> None:
    """engine.verify: the streamed backward must be exact on a miniature of `model`'s architecture
    (same config, same LoRA config, same train/eval mode; `backstream.stream.verify`), else stop before
    the run folder is written."""
    from backstream.stream.verify import Verdict, verify  # noqa: PLC0415  (loads the miniature builder)

    base = base_model(model)
    peft = getattr(model, "peft_config", None)
    # what saving a checkpoint writes into the config (architectures, dtype) is not architecture
    arch = {k: v for k, v in base.config.to_dict().items()
            if k not in ("architectures", "dtype", "_name_or_path", "transformers_version")}
    key = (json.dumps(arch, sort_keys=True, default=str), repr(peft), model.training)
    report = _VERIFIED.get(key)
    if report is None:
        report = _VERIFIED[key] = verify(model)
    if not report.ok:
        detail = f"{report.verdict} ({report.reason})" if report.kind is Verdict.WRONG else report.verdict
        raise UserError("engine.verify: the streamed backward is not exact on a miniature of this model's "
                         f"architecture ({report.model_type}): {detail}. `backstream verify` prints the details; set "
                         "engine.backward = \"reference\" to train with the naive backward, or engine.verify = false "
                         "to skip this check")
