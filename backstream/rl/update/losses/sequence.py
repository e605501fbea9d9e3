"""Sequence-ratio objectives (GSPO, TBPO): the ratio of a whole response, one statistic per sequence
taken from the prefill (docs/design.md §3), and GSPO itself.

For response i with completion tokens t = 1..|y_i|:
  s_i = exp(mean_t(log π_t − log π_old,t))             (the geometric mean of the token ratios)
With s_i taken from the prefill (exact: the prefill runs at the current weights; s_i = 1 when
old_logprobs are not given, π_old being the current policy) and ∇s_i = s_i · mean_t ∇log π_t, the
gradient of a loss (1/N) Σ_i ℓ_i(s_i) is the one of the block term
  Σ_t c_{i,t} log π_t,   c_{i,t} = (1/N) ∂ℓ_i/∂s_i · s_i / |y_i|
(the block terms are a surrogate with the loss's gradient; the loss's value is `policy` in the
metrics). The KL and entropy terms are per token with weight 1/(N |y_i|) (sequence mean of token
means). A variant says only what ℓ_i is: `sequence_terms` returns ∂ℓ_i/∂s_i per sequence.

GSPO (Zheng et al. 2025):
  ℓ_i = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i),  loss = (1/N) Σ_i ℓ_i
  with loss.is_level = "sequence": ℓ_i ← w_i · ℓ_i, the detached mismatch weight of `base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.checks import UserError
from backstream.rl.update.losses.base import LossConfigBase, Metrics, SetupObjective, flat, logp_entropy
from backstream.rl.update.offpolicy import sequence_log_ratios
from backstream.stream.objective import BlockView


class SequenceRatioObjective(SetupObjective):
    """The per-token coefficients of a loss of the sequence ratios s_i, fixed in `setup`; a subclass
    implements `sequence_terms`."""

    label = "a sequence-ratio loss"  # how the errors name the variant

    def token_coefficients(self) -> Tensor:
        # KL / entropy per token: sequence mean of token means
        out = torch.zeros(len(self.adv_flat), dtype=torch.float64)
        for i, (o, L) in enumerate(zip(self.offsets, self.lengths)):
            out[o:o + L] = 1.0 / (self.norm.n_seq * max(1, self.n_tok[i]))
        return out

    def sequence_terms(self, s: dict[int, float], old: Tensor) -> tuple[dict[int, float], Metrics]:
        """From s_i of each sequence i with a policy-gradient term (`pg_mask`) and [T] log π_old:
        ∂ℓ_i/∂s_i of each (detached weights and masks folded in; ℓ_i before the 1/N), and the metrics."""
        raise NotImplementedError

    def setup_terms(self, logprobs: list[Tensor] | None) -> Metrics:
        logprobs = self.current(logprobs)
        if logprobs is None:
            raise UserError(f"{self.label}: needs the prefill's log-probs for its sequence ratios (do not pass "
                             "kv=, or pass old_is_current=True with old_logprobs at the current weights)")
        cur = flat(logprobs)
        pg_mask = self.pg_mask()
        # the sequences with a policy term; a zero-advantage one has none (nor log-probs when old is given)
        pg = [i for i, m in enumerate(pg_mask) if m.any()]
        if self.old_flat is None:  # π_old is the current policy
            old, s = cur, dict.fromkeys(pg, 1.0)
        else:
            old = self.old_flat
            log_s = sequence_log_ratios(cur, old, self.offsets, self.lengths, pg_mask, reduce="mean",
                                        names=("prefill log-probs", "old_logprobs"))
            s = {i: math.exp(float(log_s[i])) for i in pg}
        dl_ds, metrics = self.sequence_terms(s, old)
        self.pg_flat = torch.zeros_like(cur)  # c_{i,t} of the policy term
        for i, g in dl_ds.items():
            o, L, m = self.offsets[i], self.lengths[i], self.mask[i]
            self.pg_flat[o:o + L][m] = g * s[i] / (self.norm.n_seq * self.n_tok[i])
        return metrics

    def block_terms(self, view: BlockView) -> tuple[Tensor, Metrics]:
        logp, ent = logp_entropy(view, self.cfg.temperature, self.cfg.entropy_coef > 0)
        dev, dt = logp.device, logp.dtype
        pg = self.pg_flat.to(dev, dt)[view.flat_N]
        c = self.coef_flat.to(dev, dt)[view.flat_N]
        extras, metrics = self.extra_terms(view, logp, ent, c)
        return (pg * logp).sum() + extras, metrics


@dataclass(kw_only=True)
class GSPOConfig(LossConfigBase):
    type: str = "gspo"
    """Sequence-level ratio and clipping (GSPO)."""
    METRICS = ("policy", "ratio_mean", "clip_frac_low", "clip_frac_high")
    eps_low: float = 3e-4
    """Lower clip range of the sequence ratio."""
    eps_high: float = 4e-4
    """Upper clip range of the sequence ratio."""

    def __post_init__(self):
        self._check("gspo")
        self._check_eps()
        level = self.mismatch_level
        if level is not None and level.per_token:
            raise UserError("loss.is_level: GSPO's ratio and clip are per sequence, so is its mismatch weight; "
                             "use 'sequence' (or 'none')")

    def build(self, **inputs) -> GSPOObjective:
        return GSPOObjective(self, **inputs)


class GSPOObjective(SequenceRatioObjective):
    label = "GSPO"

    def sequence_terms(self, s: dict[int, float], old: Tensor) -> tuple[dict[int, float], Metrics]:
        cfg = self.cfg
        mismatch = self.mismatch_terms(old)
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        dl_ds, rows = {}, []  # rows: per sequence, (s_i, its ℓ_i, whether unclipped)
        for i, s_i in s.items():
            o, L, m = self.offsets[i], self.lengths[i], self.mask[i]
            A = float(self.adv[i])
            w = 1.0 if self.is_flat is None else float(self.is_flat[o:o + L][m][0])  # one weight per sequence
            # ∂ℓ/∂s: −A on the unclipped branch of min(sA, clip(s)A), 0 on the clipped one
            unclipped = s_i * A <= min(max(s_i, lo), hi) * A
            dl_ds[i] = w * (-A if unclipped else 0.0)
            rows.append((s_i, -w * min(s_i * A, min(max(s_i, lo), hi) * A), unclipped))
        n_seq, n_pg = self.norm.n_seq, self.norm.n_pg_seq
        metrics = {**mismatch, "policy": sum(loss / n_seq for _, loss, _ in rows)}
        if rows:
            metrics.update(ratio_mean=sum(s_i / n_pg for s_i, _, _ in rows),
                           clip_frac_low=sum(float(not u and s_i < lo) / n_pg for s_i, _, u in rows),
                           clip_frac_high=sum(float(not u and s_i > hi) / n_pg for s_i, _, u in rows))
        return dl_ds, metrics
