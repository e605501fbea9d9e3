"""The optimizer and its learning-rate schedule, built once from `[optim]`: AdamW, RMSprop or Muon,
linear warm-up then constant. Gradient clipping (`max_grad_norm`) is applied by the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backstream.checks import at_least, choice


def _adamw(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay)


def _rmsprop(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=c.lr, weight_decay=c.weight_decay)


def _muon(params: list, c: OptimConfig) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Muon"):
        raise ValueError("optim.name: 'muon' needs a torch with torch.optim.Muon; use adamw or rmsprop")
    bad = [tuple(p.shape) for p in params if p.dim() != 2]
    if bad:
        raise ValueError(f"optim.name: Muon optimizes 2-D weights only, and {len(bad)} trainable tensors are not 2-D "
                         f"(e.g. {bad[0]}); use LoRA (model.lora_r > 0) or adamw")
    return torch.optim.Muon(params, lr=c.lr, weight_decay=c.weight_decay)


OPTIMIZERS = {"adamw": _adamw, "rmsprop": _rmsprop, "muon": _muon}


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """adamw, rmsprop, or muon (torch.optim.Muon, where the installed torch has it; 2-D weights only)."""
    lr: float = 1e-4
    """Peak learning rate."""
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
        choice("optim.name", self.name, list(OPTIMIZERS))
        at_least("optim.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        if not self.lr > 0:
            raise ValueError(f"optim.lr: got {self.lr}, expected a number > 0")

    def build(self, params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over the trainable tensors of `params`, and its schedule (stepped once per
        optimizer step)."""
        opt = OPTIMIZERS[self.name]([p for p in params if p.requires_grad], self)
        warm = self.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
        return opt, sched
