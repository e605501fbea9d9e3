"""`[update]`: how the update phase uses a collected batch: `epochs` × `minibatches` optimizer steps, and
the frozen reference policy of the KL term; where π_old and π_ref come from (`BeforeUpdate`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from backstream.checks import at_least
from backstream.stream import fsdp


@dataclass(kw_only=True)
class UpdateConfig:
    epochs: int = 1
    """PPO epochs over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per epoch (the rollout batch is split in this many groups-aligned parts)."""
    kl_reference: bool = False
    """Keep a frozen copy of the initial policy for the KL term (loss.kl_coef > 0 needs it)."""

    def __post_init__(self):
        at_least("update.epochs", self.epochs, 1)
        at_least("update.minibatches", self.minibatches, 1)


class BeforeUpdate:
    """The policy before the update, as the run's objective needs it: where π_old and π_ref come from,
    chosen once from [update] and engine.reuse_rollout_kv (so that the trainer's step has no branch on it). π_old: the
    sampler's log-probs when the engine reuses the rollout's K/V (`engine.reuse_rollout_kv`: the same
    weights and numerics, so they are the current policy's too: `old_is_current`); one no-grad pass
    before the first optimizer step when several follow (epochs × minibatches > 1); else none before
    the update, as the engine's own prefill at the first (and only) step gives it. π_ref: the frozen
    `ref` policy's, or with LoRA (`ref` None) the base model under the adapters."""

    def __init__(self, update: UpdateConfig, reuse_rollout_kv: bool):
        self.old_is_current = reuse_rollout_kv
        self.old_pass = not self.old_is_current and update.epochs * update.minibatches > 1
        self.kl_reference = update.kl_reference

    def logprobs(self, engine, model, ref, seqs: list[Tensor], mask: list[Tensor],
                 sampler_lp: list[Tensor]) -> tuple[list | None, list | None]:
        """(π_old, π_ref) of `seqs` where the objective needs them before the update, else None."""
        old = sampler_lp if self.old_is_current else None
        ref_lp = None
        if self.old_pass:
            with fsdp.gathered(model):
                old = engine.logprobs(model, seqs, mask)
        if self.kl_reference:
            if ref is not None:
                ref_lp = engine.logprobs(ref, seqs, mask)
            else:
                with model.disable_adapter(), fsdp.gathered(model):  # LoRA: the base model is the reference
                    ref_lp = engine.logprobs(model, seqs, mask)
        return old, ref_lp

    def learner_at_sampling(self, old: list | None, first_step: list) -> list:
        """The learner's log-probs at the weights that sampled, which the sampler's are measured
        against (`mismatch/*`): π_old where a pass computed it, else the engine's own at the first
        optimizer step (`first_step`); with the rollout's K/V π_old *is* the sampler's, and the
        mismatch would be measured against itself."""
        return old if self.old_pass else first_step
