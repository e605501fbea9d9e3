"""TBPO: Trust-Band Policy Optimization (Gu et al., "QaRL: Samples-Aligned Quantization-Aware RL",
§3.2 and Appendix E), a sequence-level objective that drops whole responses leaving a trust band.

For response i with completion tokens t = 1..|y_i| (the completion mask), advantage A_i, learner
π_θ, learner before the update π_old and sampler μ (the rollout's log-probs):

  s_i = exp(mean_t(log π_θ,t − log π_old,t))          proximal ratio (geometric mean, as GSPO)
  w_i = clamp(exp(mean_t(log π_old,t − log μ_t)), 1/C, C)      mismatch weight, C = seq_tis_imp_ratio_cap
  M_i = 1 if A_i > 0 and s_i ≤ 1 + seq_clip_ratio_high
        1 if A_i < 0 and 1 − neg_seq_clip_ratio_low ≤ s_i ≤ 1 + neg_seq_clip_ratio_high
        0 otherwise (the response leaves its band and is masked out of the update entirely)
  ℓ_i = −M_i · w_i · s_i · A_i        (w_i, M_i detached)
  L   = (1/N) Σ_i ℓ_i + Σ_i Σ_t (kl_coef · KL_t − entropy_coef · H_t) / (N |y_i|)

A sequence-ratio objective (`sequence.SequenceRatioObjective`, as GSPO): s_i comes from the prefill
(exact: the prefill runs at the current weights; s_i = 1 when old_logprobs are not given, π_old being
the current policy), and since ∇s_i = s_i · mean_t ∇log π_t, the block term is Σ_t c_{i,t} log π_t
with c_{i,t} = −M_i w_i A_i s_i / (N |y_i|) (∂ℓ_i/∂s_i = −M_i w_i A_i).
The loss value is `policy` in the metrics; the block terms are a surrogate with its gradient.

Where the paper leaves details open, our reading:
- positive advantages: "the standard PPO-style bound" is one-sided, s_i ≤ 1 + seq_clip_ratio_high:
  PPO's min(sA, clip(s)A) with A > 0 stops the gradient only above 1 + ε (the paper: "for positive
  advantages, it constrains only the upper bound"). seq_clip_ratio_low, the lower end of that clip,
  therefore never binds; it is kept so that the paper's configuration (Appendix B) maps one to one.
- negative advantages: the dual band is two-sided as written; both ends are inclusive (at s = 1 ± ε
  PPO's clip is still the identity).
- "two-sided cap" of the mismatch weight (eq. 5): [1/C, C], truncated (not masked), so C = 2
  keeps w_i in [0.5, 2]; computed in log space.
- means are over the completion tokens of each response (the geometric mean of Appendix E); the
  policy term is averaged over the N responses of the minibatch (sequence-mean, as GSPO), masked and
  zero-advantage responses included; KL/entropy per token with weight 1/(N |y_i|), not reweighted
  by w_i or M_i (penalties on the learner's own distribution).
- A_i = 0: no policy term, no band. The tbpo/ shares and means are over the responses with a
  policy term (A_i ≠ 0, at least one completion token).
TBPO has its own mismatch weight, so loss.is_level must stay "none".

Metrics: tbpo/masked_frac (share of the responses masked), tbpo/masked_pos and tbpo/masked_neg
(the shares masked with A > 0 and A < 0: they add up to masked_frac), tbpo/weight_mean (mean w_i),
tbpo/weight_capped_frac (share with w_i at a cap), ratio_mean (mean s_i), policy (the loss value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from backstream.checks import UserError
from backstream.rl.update.losses.base import LossConfigBase, Metrics
from backstream.rl.update.losses.sequence import SequenceRatioObjective
from backstream.rl.update.offpolicy import sequence_log_ratios


@dataclass(kw_only=True)
class TBPOConfig(LossConfigBase):
    type: str = "tbpo"
    """Trust-Band Policy Optimization (QaRL): sequence ratios, responses outside their band masked."""
    METRICS = ("policy", "ratio_mean", "tbpo/masked_frac", "tbpo/masked_pos", "tbpo/masked_neg",
               "tbpo/weight_mean", "tbpo/weight_capped_frac")
    seq_clip_ratio_low: float = 3e-4
    """Lower end of PPO's clip of the sequence ratio; never binds in TBPO (positive advantages are
    bounded above only, negative ones by the neg_ band), kept to match the paper's configuration."""
    seq_clip_ratio_high: float = 4e-4
    """Positive advantages: a response with s_i > 1 + seq_clip_ratio_high is masked out."""
    neg_seq_clip_ratio_low: float = 3e-4
    """Negative advantages: a response with s_i < 1 − neg_seq_clip_ratio_low is masked out."""
    neg_seq_clip_ratio_high: float = 7e-4
    """Negative advantages (dual clip): a response with s_i > 1 + neg_seq_clip_ratio_high is masked out."""
    seq_tis_imp_ratio_cap: float = 2.0
    """C: the sequence mismatch weight exp(mean_t(log π_old − log μ)) is clamped to [1/C, C]."""

    def __post_init__(self):
        self._check("tbpo")
        if self.mismatch_level is not None:
            raise UserError(f"loss.is_level: got {self.is_level!r}; TBPO has its own sequence mismatch weight "
                             "(loss.seq_tis_imp_ratio_cap), so is_level must be 'none'")
        for name in ("seq_clip_ratio_low", "seq_clip_ratio_high", "neg_seq_clip_ratio_low", "neg_seq_clip_ratio_high"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise UserError(f"loss.{name}: got {v}, expected a finite number > 0")
        c = self.seq_tis_imp_ratio_cap
        if not (math.isfinite(c) and c >= 1):
            raise UserError(f"loss.seq_tis_imp_ratio_cap: got {c}, expected a finite number >= 1")

    def build(self, **inputs) -> TBPOObjective:
        return TBPOObjective(self, **inputs)


class TBPOObjective(SequenceRatioObjective):
    """The TBPO loss over one minibatch (see the module docstring); needs rollout_logprobs."""

    label = "TBPO"

    def __init__(self, config: TBPOConfig, *, rollout_logprobs=None, **inputs):
        if rollout_logprobs is None:
            raise UserError("rollout_logprobs: TBPO's mismatch weight needs the sampler's log-probs")
        super().__init__(config, rollout_logprobs=rollout_logprobs, **inputs)

    def sequence_terms(self, s: dict[int, float], old: Tensor) -> tuple[dict[int, float], Metrics]:
        cfg = self.cfg
        log_w = sequence_log_ratios(old, self.rollout_flat, self.offsets, self.lengths, self.pg_mask(), reduce="mean",
                                    names=("old_logprobs" if self.old_flat is not None else "prefill log-probs",
                                           "rollout_logprobs"))
        log_c = math.log(cfg.seq_tis_imp_ratio_cap)
        dl_ds, rows = {}, []  # rows: per response with a policy term, (A, s, w, capped, M)
        for i, s_i in s.items():
            A, lw = float(self.adv[i]), float(log_w[i])
            w = math.exp(min(max(lw, -log_c), log_c))
            if A > 0:
                inside = s_i <= 1 + cfg.seq_clip_ratio_high
            else:
                inside = 1 - cfg.neg_seq_clip_ratio_low <= s_i <= 1 + cfg.neg_seq_clip_ratio_high
            M = float(inside)
            dl_ds[i] = -M * w * A
            rows.append((A, s_i, w, abs(lw) > log_c, M))
        metrics = {"policy": sum(-M * w * s * A for A, s, w, _, M in rows) / self.norm.n_seq}
        if rows:
            n = self.norm.n_pg_seq  # len(rows) in one process; the global count under data parallelism
            metrics.update({"ratio_mean": sum(r[1] for r in rows) / n,
                            "tbpo/masked_frac": sum(r[4] == 0 for r in rows) / n,
                            "tbpo/masked_pos": sum(r[4] == 0 and r[0] > 0 for r in rows) / n,
                            "tbpo/masked_neg": sum(r[4] == 0 and r[0] < 0 for r in rows) / n,
                            "tbpo/weight_mean": sum(r[2] for r in rows) / n,
                            "tbpo/weight_capped_frac": sum(r[3] for r in rows) / n})
        return dl_ds, metrics
