"""RL objectives, written as per-block terms (docs/design.md §3); advantages are in `backstream.rl.scoring.advantages`.

One module per concept:
  base      the fields every variant shares (KL, entropy, temperature, mismatch correction), the
            KL estimators, the normalisers, `PolicyObjective` (the bookkeeping: an objective
            returns its metrics, the base sums them)
  ppo       token-level PPO-clip (GRPO, DAPO, Dr.GRPO) and its mismatch-corrected variant
  sequence  losses of the sequence ratio s_i (`SequenceRatioObjective`) and GSPO
  tbpo      TBPO (QaRL), a sequence-ratio loss with its own mismatch weight and trust bands
  naive     every objective's naive full-sequence formula, the reference of the tests
The variants are registered here only: `LOSS_TYPES` maps the `type` key of [loss] to its config.
"""

from __future__ import annotations

from backstream.rl.update.losses.base import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LossConfigBase,
    Normalisers,
    PolicyObjective,
    SetupObjective,
    flat,
)
from backstream.rl.update.losses.naive import naive_loss
from backstream.rl.update.losses.ppo import PPOClipConfig, PPOClipISObjective, PPOClipObjective
from backstream.rl.update.losses.sequence import GSPOConfig, GSPOObjective, SequenceRatioObjective
from backstream.rl.update.losses.tbpo import TBPOConfig, TBPOObjective

LossConfig = PPOClipConfig | GSPOConfig | TBPOConfig
LOSS_TYPES: dict[str, type] = {"ppo_clip": PPOClipConfig, "gspo": GSPOConfig, "tbpo": TBPOConfig}  # by `type`

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "LOSS_TYPES", "GSPOConfig", "GSPOObjective", "LossConfig",
           "LossConfigBase", "Normalisers", "PPOClipConfig", "PPOClipISObjective", "PPOClipObjective",
           "PolicyObjective", "SequenceRatioObjective", "SetupObjective", "TBPOConfig", "TBPOObjective",
           "build_objective", "flat", "naive_loss"]


def build_objective(config, *, sequences, completion_mask, advantages, old_logprobs=None,
                    ref_logprobs=None, rollout_logprobs=None, old_is_current=False,
                    normalisers: Normalisers | None = None) -> PolicyObjective:
    """The objective of `config` (a loss config of `LOSS_TYPES`) over one minibatch; each config
    builds its own objective (`config.build`). Per sequence, aligned to it (NaN at the prompt tokens):
    old_logprobs  π_old; None = the current policy (from the engine's prefill);
    ref_logprobs  π_ref of the KL term (needed when loss.kl_coef > 0);
    rollout_logprobs  the sampler's μ (needed by loss.is_level != 'none' and by TBPO, ignored else);
    old_is_current  old_logprobs are at the current weights and numerics (the aligned sampler's, when
                    the engine takes the rollout's K/V and runs no prefill): the sequence ratios
                    (GSPO, TBPO) are then 1 without a prefill;
    normalisers   the counts the loss is divided by (`Normalisers`); None = those of these sequences.
                  Data parallelism passes the global minibatch's, so that the gradients of the ranks
                  sum to the single-process one."""
    if not isinstance(config, LossConfigBase):
        raise TypeError(f"config: expected a loss config ({', '.join(c.__name__ for c in LOSS_TYPES.values())}), "
                        f"got {type(config).__name__}")
    return config.build(sequences=sequences, completion_mask=completion_mask, advantages=advantages,
                        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                        old_is_current=old_is_current, normalisers=normalisers)
