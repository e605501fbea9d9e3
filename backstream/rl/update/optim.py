"""The optimizer and its learning-rate schedule, built once from `[optim]`: AdamW, RMSprop or Muon,
linear warm-up then constant. Gradient clipping (`max_grad_norm`) is applied by the trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from backstream.checks import UserError, at_least, literals
from backstream.stream import fsdp


def _adamw(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay)


def _rmsprop(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=c.lr, weight_decay=c.weight_decay)


def _muon(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Muon"):
        raise UserError("optim.name: 'muon' needs a torch with torch.optim.Muon; use adamw or rmsprop")
    bad = [tuple(p.shape) for p in params if p.dim() != 2]
    if bad:
        raise UserError(f"optim.name: Muon optimizes 2-D weights only, and {len(bad)} trainable tensors are not 2-D "
                         f"(e.g. {bad[0]}); use LoRA (model.lora_r > 0) or adamw")
    return torch.optim.Muon(params, lr=c.lr, weight_decay=c.weight_decay)


OPTIMIZERS = {"adamw": _adamw, "rmsprop": _rmsprop, "muon": _muon}
DEFAULT_MODEL_LR = 1e-4  # optim.lr unset: the shipped default model's (tiny, trained from scratch)
PRETRAINED_LR = 1e-6  # a pretrained model's, full fine-tuning: TRL's GRPOConfig and verl's actor default
ADAPTER_LR = 1e-5  # its LoRA adapter's: an adapter learns at about 10x a full model's rate (examples/*lora*)


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal[tuple(OPTIMIZERS)] = "adamw"
    """adamw, rmsprop, or muon (torch.optim.Muon, where the installed torch has it; 2-D weights only)."""
    lr: float | None = None
    """Peak learning rate; unset = the model's: 1e-4 for the shipped default model, 1e-6 for a pretrained
    one (TRL's GRPOConfig and verl's actor default), 1e-5 for its LoRA adapter (model.lora_r > 0); the
    run folder's config.toml states it."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps, then constant."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 turns it off."""
    max_nonfinite_steps: int = 3
    """An optimizer step whose gradient norm is NaN/inf is skipped (and counted as
    optim/skipped_nonfinite); this many in a row stop the run with an error."""

    def __post_init__(self):
        literals(self, "optim")
        at_least("optim.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"optim.lr: got {self.lr}, expected a number > 0")

    def build(self, params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over the trainable tensors of `params`, and its schedule (stepped once per
        optimizer step)."""
        if self.lr is None:
            raise UserError("optim.lr: unset; a run sets the model's (RunConfig.with_run_defaults), an optimizer built "
                             "by hand names it")
        opt = OPTIMIZERS[self.name]([p for p in params if p.requires_grad], self)
        warm = self.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
        return opt, sched


class NonFiniteError(UserError):
    """Training produced NaN/inf (gradients or weights): the run stops before writing from them."""


class Stepper:
    """One optimizer step: clip by the global gradient norm, step, schedule, zero. A NaN/inf loss term
    or gradient norm skips the step instead (`skipped` counts them), and `optim.max_nonfinite_steps` of
    them in a row raise NonFiniteError. `quantized`: layers whose low-bit codes follow the master
    weights (re-derived after each step); `last_checkpoint()`: the run's last checkpoint, for the message."""

    def __init__(self, cfg: OptimConfig, model, opt, sched, quantized: list, last_checkpoint=lambda: None):
        self.cfg, self.model, self.opt, self.sched = cfg, model, opt, sched
        self.quantized, self.last_checkpoint = quantized, last_checkpoint
        self.skipped = 0  # optimizer steps skipped for a NaN/inf gradient norm, this process
        self.in_a_row = 0

    def step(self, loss_finite: bool = True, done: int = 0) -> float:
        """Returns the gradient norm (before clipping); `done`: the training steps done (the error's)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        fsdp.reshard(self.model)  # no gathered copy outlives the step (the next forward re-gathers)
        gn = fsdp.grad_norm(params, self.cfg.max_grad_norm)  # global: every rank decides alike
        if not (math.isfinite(gn) and loss_finite):
            self.opt.zero_grad(set_to_none=True)
            self.skipped += 1
            self.in_a_row += 1
            if self.in_a_row >= self.cfg.max_nonfinite_steps:
                raise NonFiniteError(
                    f"optim.max_nonfinite_steps: {self.in_a_row} optimizer steps in a row had a NaN/inf loss or "
                    f"gradient norm (training step {done + 1}); the run stopped without writing a checkpoint. Last "
                    f"good checkpoint: {self.last_checkpoint() or 'none'}. Usual causes: a learning rate too high "
                    f"(optim.lr = {self.cfg.lr}), bfloat16 overflow (model.dtype), or a reward function returning "
                    "NaN/inf")
            return gn
        self.in_a_row = 0
        self.opt.step()
        for m in self.quantized:  # new master weights: new codes (a fused optimizer may not bump versions)
            m.invalidate()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return gn


def check_finite_weights(model, dp, step: int, last) -> None:
    """NonFiniteError when a parameter holds NaN/inf (over every rank's shards): no checkpoint is
    written from them. `last()`: the last checkpoint, for the message (looked up only then)."""
    local = [n for n, p in model.named_parameters() if not bool(torch.isfinite(fsdp.local(p.detach())).all())]
    bad = sorted({n for part in dp.gather(local) for n in part})
    if bad:
        raise NonFiniteError(f"train: parameters {bad[:3]}{' …' if len(bad) > 3 else ''} hold NaN/inf at step {step}; "
                             f"no checkpoint is written from them. Last good checkpoint: {last() or 'none'}")
