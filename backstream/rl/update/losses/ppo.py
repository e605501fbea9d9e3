"""Token-level PPO-clip (covers GRPO, DAPO, Dr.GRPO through the aggregation), as per-block terms:
  ρ_t = exp(log π_t − log π_old,t)
  ℓ_t = −min(ρ_t A, clip(ρ_t, 1−ε_low, 1+ε_high) A)        (DAPO clip-higher: ε_high > ε_low)
  dual clip (Ye et al. 2020), A < 0:  ℓ_t = min(ℓ_t, −c·A)
  + kl_coef · KL_t − entropy_coef · H_t                     (`base`)
Aggregation (normalisers over the whole minibatch, fixed before any block runs):
  token-mean               Σ_{i,t} ℓ / Σ_i |y_i|
  seq-mean-token-mean      (1/N) Σ_i (1/|y_i|) Σ_t ℓ
  seq-mean-token-sum-norm  (1/N) Σ_i Σ_t ℓ / L_max          (Dr.GRPO; L_max = max_len_norm, a constant:
                                                           the generation budget, as the paper and TRL)
Every term is per token, so the block term is the loss itself restricted to the block's tokens.
With loss.is_level, decoupled PPO: ℓ_t ← w · ℓ_t, the detached mismatch weight of `base` (per token,
or per sequence), fixed in `setup`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.checks import UserError
from backstream.rl.update.losses.base import (
    AGGREGATIONS,
    LossConfigBase,
    Metrics,
    PolicyObjective,
    SetupObjective,
    flat,
    logp_entropy,
)
from backstream.stream.objective import BlockView


@dataclass(kw_only=True)
class PPOClipConfig(LossConfigBase):
    type: str = "ppo_clip"
    """Token-level PPO clip: GRPO, DAPO (eps_high > eps_low), Dr.GRPO (seq-mean-token-sum-norm)."""
    METRICS = ("policy", "ratio_mean", "clip_frac_low", "clip_frac_high")
    eps_low: float = 0.2
    """Lower clip range: ρ ≥ 1 − eps_low."""
    eps_high: float = 0.2
    """Upper clip range: ρ ≤ 1 + eps_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None = off."""
    aggregation: str = "token-mean"
    """token-mean, seq-mean-token-mean, or seq-mean-token-sum-norm (Dr.GRPO)."""
    max_len_norm: int | str | None = None
    """L_max of seq-mean-token-sum-norm (Dr.GRPO): a number of tokens; unset = the generation budget, which
    a run resolves and writes in its config.toml (rollout.max_new_tokens; an episode's env.max_turns ×
    rollout.max_new_tokens, at most env.max_episode_tokens), as Dr.GRPO and TRL's `max_completion_length`
    do; "minibatch" = the longest completion of the minibatch (the default before 2026-12-04, which a run
    folder written then keeps on resume): a scale that moves with the lengths in the batch."""

    def __post_init__(self):
        self._check("ppo_clip")
        self._check_eps()
        if self.aggregation not in AGGREGATIONS:
            raise UserError(f"loss.aggregation: got {self.aggregation!r}, expected one of {list(AGGREGATIONS)}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise UserError(f"loss.dual_clip: got {self.dual_clip}, expected a number > 1 (or none)")
        m = self.max_len_norm
        if not (m is None or m == "minibatch" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)):
            raise UserError(f"loss.max_len_norm: got {m!r}, expected an integer >= 1 (tokens), \"minibatch\", or "
                             "unset (the generation budget)")

    def norm_length(self, lmax: int) -> int:
        """L_max of seq-mean-token-sum-norm, given the minibatch's longest completion `lmax` (which the other
        aggregations do not read)."""
        if self.aggregation != "seq-mean-token-sum-norm" or self.max_len_norm == "minibatch":
            return lmax
        if self.max_len_norm is None:
            raise UserError("loss.max_len_norm: seq-mean-token-sum-norm divides by a constant, the generation "
                             "budget, which a run sets from rollout.max_new_tokens; a loss config built by hand "
                             "names it: an integer (e.g. the max_new_tokens its samples had), or \"minibatch\"")
        return self.max_len_norm

    def build(self, **inputs) -> PolicyObjective:
        # the corrected variant has a `setup` (its π_old may be the prefill's); the plain one has
        # none, so the naive reference skips the extra no-grad pass it runs for objectives with one
        return (PPOClipObjective if self.mismatch_level is None else PPOClipISObjective)(self, **inputs)


class PPOClipObjective(PolicyObjective):
    # on-policy (no old log-probs given), π_old is the current policy: the block's own log-probs,
    # detached, which equal the prefill's bitwise; so the prefill may skip the response tails
    needs_prefill_logprobs = False

    def token_coefficients(self) -> Tensor:
        weight = AGGREGATIONS[self.cfg.aggregation]
        out = torch.zeros(len(self.adv_flat), dtype=torch.float64)
        nm = self.norm
        n_total, lmax = nm.n_tok, self.cfg.norm_length(nm.lmax)
        for i, (o, L) in enumerate(zip(self.offsets, self.lengths)):
            out[o:o + L] = weight(self.n_tok[i], n_total, nm.n_seq, lmax)
        return out

    def block_terms(self, view: BlockView) -> tuple[Tensor, Metrics]:
        cfg = self.cfg
        logp, ent = logp_entropy(view, cfg.temperature, cfg.entropy_coef > 0)
        dev, dt = logp.device, logp.dtype
        A = self.adv_flat.to(dev, dt)[view.flat_N]
        old = logp.detach() if self.old_flat is None else self.old_flat.to(dev, dt)[view.flat_N]
        c = self.coef_flat.to(dev, dt)[view.flat_N]
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
        loss_t = -torch.min(ratio * A, clipped * A)
        if cfg.dual_clip is not None:
            loss_t = torch.where(A < 0, torch.min(loss_t, -cfg.dual_clip * A), loss_t)
        if self.is_flat is not None:  # decoupled PPO: the detached mismatch weight, PG term only
            loss_t = self.is_flat.to(dev, dt)[view.flat_N] * loss_t
        # ratio statistics over the tokens with a policy-gradient term (as GSPO's and the is/ ones)
        w = (A != 0).double() / max(1, self.norm.n_pg_tok)
        r = ratio.detach()
        extras, extra_metrics = self.extra_terms(view, logp, ent, c)
        metrics = {"clip_frac_low": (((r < 1 - cfg.eps_low) & (A < 0)).double() * w).sum(),
                   "clip_frac_high": (((r > 1 + cfg.eps_high) & (A > 0)).double() * w).sum(),
                   "ratio_mean": (r.double() * w).sum(),
                   "policy": (loss_t.detach().double() * c.double()).sum(), **extra_metrics}
        return (c * loss_t).sum() + extras, metrics


class PPOClipISObjective(PPOClipObjective, SetupObjective):
    """PPO-clip with the mismatch weights of loss.is_level, computed once in `setup`."""

    def setup_terms(self, logprobs: list[Tensor] | None) -> Metrics:
        old = self.old_flat
        if old is None:
            if logprobs is None:
                raise UserError("loss.is_level: the mismatch weight needs π_old: pass old_logprobs, or let the "
                                 "engine run its prefill (no kv=)")
            old = flat(logprobs)
        return self.mismatch_terms(old)
