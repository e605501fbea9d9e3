"""What every RL objective shares (docs/design.md §3): the config fields common to all variants, the KL
estimators, the normalisers, and `PolicyObjective`, the bookkeeping between a loss and the engine.

Every variant adds, to its policy-gradient term, per-token penalties with the variant's per-token
coefficients c_{i,t} (its aggregation weights):
  + kl_coef · KL_t − entropy_coef · H_t
  KL_t  k1: log π − log π_ref;   k3: e^{ref−log π} − (ref − log π) − 1   (Schulman's, ≥ 0, unbiased)
  H_t   the entropy of the predicting distribution (logits divided by loss.temperature)
Zero-advantage sequences are inactive (cost nothing) unless a KL or entropy term reads them; they
still count in the normalisers, as in the per-sample computation. Normalisers are those of the whole
minibatch, fixed before any block runs; under data parallelism the minibatch is the GLOBAL one, its
counts passed in as `Normalisers`.

Training–inference mismatch (loss.is_level, `backstream.rl.update.offpolicy`): decoupled PPO multiplies the
policy-gradient term by the detached weight w = π_old/μ of the sampler μ (rollout_logprobs), per
token (w_t) or per sequence (w_i = Π_t w_t), truncated (TIS) or masked (MIS) at the caps:
  PPO-clip  ℓ_t ← w · ℓ_t        GSPO  ℓ_i ← w_i · ℓ_i   (sequence level only)
The KL and entropy terms are not reweighted (they are penalties on the learner's own distribution,
not estimates under the sampler's), and the normalisers stay those of the whole minibatch: a masked
token (w = 0) still counts, like a zero-advantage one. π_old is old_logprobs when given, else the
prefill's log-probs at the current weights.
The ratio statistics (ratio_mean, clip fractions) and the is/ metrics are over the tokens or
sequences with a policy-gradient term (advantage ≠ 0, at least one completion token): the ones a
clip or a weight acts on; the others are not computed at all unless a KL or entropy term reads them.

Metrics are returned, never written in passing: an objective's `block_terms(view)` returns the
block's loss and its metrics, `setup_terms(logprobs)` the metrics of the statistics it fixes;
`PolicyObjective` alone sums them over blocks (`metrics()`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from backstream.checks import UserError, literals
from backstream.rl.update.offpolicy import IS_LEVELS, IS_MODES, ISLevel, ISMode, mismatch_weights
from backstream.stream.objective import BlockView, Objective, flat_offsets


def kl_k1(logp: Tensor, ref: Tensor) -> Tensor:
    """log π − log π_ref: unbiased, can be negative."""
    return logp - ref


def kl_k3(logp: Tensor, ref: Tensor) -> Tensor:
    """e^d − d − 1 with d = log π_ref − log π: unbiased and non-negative (Schulman)."""
    d = ref - logp
    return torch.exp(d) - d - 1


# loss.kl_estimator: per-token KL(π‖π_ref) estimate from the two log-probs
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}

# The weight of each of sequence i's token losses, by aggregation, from the normalisers of the whole
# minibatch: (n_i completion tokens of sequence i, n_total of all, n_seq sequences, lmax) -> weight
AGGREGATIONS: dict[str, Callable[[int, int, int, int], float]] = {
    "token-mean": lambda n_i, n_total, n_seq, lmax: 1.0 / max(1, n_total),
    "seq-mean-token-mean": lambda n_i, n_total, n_seq, lmax: 1.0 / (n_seq * max(1, n_i)),
    "seq-mean-token-sum-norm": lambda n_i, n_total, n_seq, lmax: 1.0 / (n_seq * lmax),
}


@dataclass(frozen=True)
class Normalisers:
    """The counts of a minibatch that normalise the loss and its metrics, fixed before any block
    runs. By default those of the sequences the objective is built on; under data parallelism the
    trainer passes those of the GLOBAL minibatch (every rank's share), so that the sum over ranks of
    each rank's gradient (and metric) is the one of a single process on the whole minibatch."""

    n_seq: int  # N: sequences
    n_tok: int  # Σ_i |y_i|: completion tokens
    lmax: int  # the longest completion (≥ 1): L_max of seq-mean-token-sum-norm when max_len_norm is None
    n_pg_seq: int  # sequences with a policy-gradient term (advantage ≠ 0, ≥ 1 completion token)
    n_pg_tok: int  # completion tokens of the sequences with advantage ≠ 0

    @staticmethod
    def of(completion_mask: list[Tensor], advantages) -> Normalisers:
        n_tok = [int(m.sum()) for m in completion_mask]
        adv = torch.as_tensor(advantages, dtype=torch.float64).flatten().cpu()
        return Normalisers(n_seq=len(n_tok), n_tok=sum(n_tok), lmax=max(max(n_tok, default=0), 1),
                           n_pg_seq=sum(1 for n, a in zip(n_tok, adv) if n > 0 and a != 0),
                           n_pg_tok=sum(n for n, a in zip(n_tok, adv) if a != 0))


def flat(per_sequence: list[Tensor]) -> Tensor:
    """Per-sequence tensors (log-probs aligned to each sequence) as one detached float64 CPU tensor in
    the flat per-token layout (`objective.flat_offsets`)."""
    return torch.cat([x.detach().double().cpu().reshape(-1) for x in per_sequence])


@dataclass(kw_only=True)
class LossConfigBase:
    """The fields and checks every loss variant shares; a variant adds its `type` and its own fields,
    and builds its objective (`build`)."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (needs update.kl_reference)."""
    kl_estimator: str = "k3"
    """k1 (log-ratio) or k3 (Schulman's unbiased, non-negative estimator)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    temperature: float = 1.0
    """Logits are divided by this before the softmax; must equal the sampling temperature."""
    router_aux_coef: float = 0.0
    """MoE models: weight of the router load-balancing loss over every token of the minibatch
    (transformers' aux loss; the model config's router_aux_loss_coef is the usual value). 0 = off."""
    is_level: Literal[tuple(IS_LEVELS)] = "none"
    """Training–inference mismatch correction (verl's rollout correction): none, token
    (w_t = π_old,t/μ_t) or sequence (w_i = Π_t π_old,t/μ_t over the completion). The detached weight
    multiplies the policy-gradient term only (not KL/entropy); needs the sampler's log-probs."""
    is_mode: Literal[tuple(IS_MODES)] = "truncate"
    """truncate: w ← clamp(w, is_cap_low, is_cap_high) (TIS); mask: a token or sequence whose w lies
    outside [is_cap_low, is_cap_high] gets weight 0, the others keep w (MIS)."""
    is_cap_high: float = 2.0
    """Upper cap of the mismatch weight."""
    is_cap_low: float = 0.0
    """Lower cap of the mismatch weight (0 = none); 0 ≤ is_cap_low < is_cap_high."""

    def _check(self, type_: str) -> None:
        """The checks of the shared fields; `type_` is the variant's own `type`."""
        if self.type != type_:
            raise UserError(f"loss.type: got {self.type!r} for {type(self).__name__}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise UserError(f"loss.kl_estimator: got {self.kl_estimator!r}, expected 'k1' or 'k3'")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise UserError("loss.kl_coef / loss.entropy_coef: expected numbers >= 0")
        if not (self.router_aux_coef >= 0 and math.isfinite(self.router_aux_coef)):
            raise UserError(f"loss.router_aux_coef: got {self.router_aux_coef}, expected a finite number >= 0")
        if not self.temperature > 0:
            raise UserError(f"loss.temperature: got {self.temperature}, expected > 0")
        literals(self, "loss")
        lo, hi = self.is_cap_low, self.is_cap_high
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
            raise UserError(f"loss.is_cap_low / loss.is_cap_high: expected finite 0 <= low < high, got {lo}, {hi}")

    def _check_eps(self) -> None:
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise UserError(f"loss.eps_low / loss.eps_high: expected >= 0, got {self.eps_low}, {self.eps_high}")

    # the string fields, parsed (table look-ups, so a field edited after construction is read anew)
    @property
    def kl_estimate(self) -> Callable[[Tensor, Tensor], Tensor]:
        """KL_t from (log π, log π_ref), by kl_estimator."""
        return KL_ESTIMATORS[self.kl_estimator]

    @property
    def mismatch_level(self) -> ISLevel | None:
        """is_level: None when there is no mismatch correction."""
        return IS_LEVELS[self.is_level]

    @property
    def mismatch_mode(self) -> ISMode:
        return IS_MODES[self.is_mode]

    METRICS: ClassVar[tuple[str, ...]] = ()  # what a variant's objective reports when it has a term to report

    def metric_keys(self) -> list[str]:
        """Every metric this variant's objective can report (a run's metrics.jsonl holds each on every
        line, null on a step where it is undefined)."""
        keys = list(self.METRICS) + ["kl"] * (self.kl_coef > 0) + ["entropy"] * (self.entropy_coef > 0)
        level = self.mismatch_level
        if level is not None:
            keys += ["is/weight_mean", f"is/{level.unit}_masked_frac", "is/truncated_frac"]
        return keys

    def build(self, **inputs) -> PolicyObjective:
        """The objective of this variant over one minibatch (the keyword arguments of `build_objective`)."""
        raise NotImplementedError


def logp_entropy(view: BlockView, temperature: float, need_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """[N] log π of the view's targets and, if asked, [N] the entropy of each predicting distribution,
    at `temperature`."""
    if temperature == 1.0:
        return view.logprobs(), (view.entropy() if need_entropy else None)
    dtype = torch.promote_types(view.logits_PV.dtype, torch.float32)
    logp_PV = torch.log_softmax(view.logits_PV.to(dtype) / temperature, dim=-1)
    logp = logp_PV[view.row_pos_N, view.target_N]
    ent = -(logp_PV.exp() * logp_PV).sum(-1)[view.row_pos_N] if need_entropy else None
    return logp, ent


Metrics = dict[str, "float | Tensor"]  # a metric's share of this block (or setup): summed over blocks


class PolicyObjective(Objective):
    """Shared bookkeeping: per-token statistics in the flat layout, normalisers, metrics.

    A subclass implements `token_coefficients` (the per-token weights c_{i,t} of its KL/entropy
    terms) and `block_terms(view) -> (loss, metrics)`; `block_loss`, the engine's hook, sums the
    metrics it returns."""

    def __init__(self, config, *, sequences, completion_mask, advantages, old_logprobs=None, ref_logprobs=None,
                 rollout_logprobs=None, old_is_current=False, normalisers: Normalisers | None = None):
        n = len(sequences)
        if old_is_current and old_logprobs is None:
            raise UserError("old_is_current: needs old_logprobs (the log-probs at the current weights)")
        if len(completion_mask) != n or len(advantages) != n:
            raise UserError(f"completion_mask / advantages: expected {n} entries (one per sequence)")
        for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                        ("rollout_logprobs", rollout_logprobs)):
            if x is not None and len(x) != n:
                raise UserError(f"{name}: expected {n} entries (one per sequence)")
            if x is not None and any(len(a) != len(s) for a, s in zip(x, sequences)):
                raise UserError(f"{name}: expected one log-prob per token of each sequence (NaN at the prompt)")
        if config.kl_coef > 0 and ref_logprobs is None:
            raise UserError("ref_logprobs: required when loss.kl_coef > 0")
        corrected = config.mismatch_level is not None
        if corrected and rollout_logprobs is None:
            raise UserError(f"rollout_logprobs: the sampler's log-probs are required when loss.is_level = "
                             f"{config.is_level!r}")
        self.cfg = config
        self.router_aux_coef = config.router_aux_coef
        self.lengths = [len(s) for s in sequences]
        self.offsets = flat_offsets(self.lengths)
        self.mask = [m.to("cpu", torch.bool) for m in completion_mask]
        self.adv = torch.as_tensor(advantages, dtype=torch.float64).flatten().cpu()
        self.n_seq = n
        self.n_tok = [int(m.sum()) for m in self.mask]
        # the loss's denominators: this minibatch's counts, or the global minibatch's (data parallel)
        self.norm = normalisers if normalisers is not None else Normalisers.of(self.mask, self.adv)
        self.adv_flat = torch.cat([torch.full((L,), float(a), dtype=torch.float64)
                                   for L, a in zip(self.lengths, self.adv)])
        self.old_flat = None if old_logprobs is None else flat(old_logprobs)
        self.ref_flat = None if ref_logprobs is None else flat(ref_logprobs)
        self.rollout_flat = None if rollout_logprobs is None else flat(rollout_logprobs)
        self.old_is_current = old_is_current
        if corrected and old_logprobs is None:
            self.needs_prefill_logprobs = True  # π_old of the mismatch weight is the prefill's
        self.is_flat: Tensor | None = None  # the mismatch weight per token, set by `setup`
        self.coef_flat = self.token_coefficients()
        self._sums: dict[str, float] = {}

    def token_coefficients(self) -> Tensor:
        """[T] float64: c_{i,t}, the weight of token t of sequence i's KL and entropy terms."""
        raise NotImplementedError

    def block_terms(self, view: BlockView) -> tuple[Tensor, Metrics]:
        """The view's scalar term (its gradient is the view's share of the total) and its metrics."""
        raise NotImplementedError

    def block_loss(self, view: BlockView) -> Tensor:
        loss, metrics = self.block_terms(view)
        self._record(metrics)
        return loss

    def _record(self, metrics: Metrics) -> None:
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + float(v)

    def metrics(self) -> dict[str, float]:
        """The sums of the metrics of `setup_terms` and of every block so far."""
        return dict(self._sums)

    def pg_mask(self) -> list[Tensor]:
        """Per sequence, the tokens with a policy-gradient term: the completion of a sequence with
        advantage ≠ 0."""
        return [m & bool(a != 0) for m, a in zip(self.mask, self.adv)]

    def current(self, logprobs: list[Tensor] | None) -> list[Tensor] | None:
        """The log-probs at the current weights: the prefill's, or, when the engine ran none (the
        caller's K/V), old_logprobs if the caller vouched that they are at the current weights."""
        if logprobs is None and self.old_is_current:
            return list(self.old_flat.split(self.lengths))
        return logprobs

    def mismatch_terms(self, old: Tensor) -> Metrics:
        """Sets `is_flat`, the mismatch weights of loss.is_level with π_old = `old` ([T], the flat
        layout), and returns their metrics; {} without a correction."""
        cfg, level = self.cfg, self.cfg.mismatch_level
        if level is None:
            return {}
        self.is_flat, m = mismatch_weights(old, self.rollout_flat, self.offsets, self.lengths, self.pg_mask(),
                                           level=cfg.is_level, mode=cfg.is_mode, cap_low=cfg.is_cap_low,
                                           cap_high=cfg.is_cap_high)
        # the metrics are means over this minibatch's weighted units; as shares of the global count
        # they add up over ranks (a factor of exactly 1 in one process)
        units = [int(x.sum()) for x in self.pg_mask()]
        local, total = ((sum(units), self.norm.n_pg_tok) if level.per_token
                        else (sum(u > 0 for u in units), self.norm.n_pg_seq))
        return {k: v * local / max(1, total) if local != total else v for k, v in m.items()}

    def active(self, sequences):
        reads_all = self.cfg.kl_coef > 0 or self.cfg.entropy_coef > 0
        return [m & (bool(a != 0) or reads_all) for m, a in zip(self.mask, self.adv)]

    def extra_terms(self, view: BlockView, logp: Tensor, ent: Tensor | None, c: Tensor) -> tuple[Tensor, Metrics]:
        """The KL and entropy terms with the per-token coefficients `c`, and their metrics (token means)."""
        cfg = self.cfg
        out, metrics = logp.new_zeros(()), {}
        if cfg.kl_coef > 0:
            kl = cfg.kl_estimate(logp, self.ref_flat.to(logp.device, logp.dtype)[view.flat_N])
            out = out + cfg.kl_coef * (c * kl).sum()
            metrics["kl"] = (kl.detach() * self._tokw(view)).sum()
        if cfg.entropy_coef > 0:
            out = out - cfg.entropy_coef * (c * ent).sum()
        if ent is not None:
            metrics["entropy"] = (ent.detach() * self._tokw(view)).sum()
        return out, metrics

    def _tokw(self, view) -> Tensor:
        """Metric weights: 1 / (total completion tokens), so sums over blocks are token means."""
        return torch.full_like(view.flat_N, 1.0, dtype=torch.float64) / max(1, self.norm.n_tok)


class SetupObjective(PolicyObjective):
    """A policy objective with statistics fixed in `setup`, before any block (mismatch weights,
    sequence ratios). The plain PPO-clip is not one: with no `setup`, the naive reference skips the
    extra no-grad pass it runs for the objectives that have one."""

    def setup_terms(self, logprobs: list[Tensor] | None) -> Metrics:
        """Fixes the statistics from the prefill's log-probs (`Objective.setup`); returns their metrics."""
        raise NotImplementedError

    def setup(self, logprobs: list[Tensor] | None) -> None:
        self._record(self.setup_terms(logprobs))
