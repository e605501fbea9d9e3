"""RL objectives, written as per-block terms (DESIGN §3); advantages are in advantages.py.

Token-level PPO-clip (covers GRPO, DAPO, Dr.GRPO through the aggregation):
  ρ_t = exp(log π_t − log π_old,t)
  ℓ_t = −min(ρ_t A, clip(ρ_t, 1−ε_low, 1+ε_high) A)        (DAPO clip-higher: ε_high > ε_low)
  dual clip (Ye et al. 2020), A < 0:  ℓ_t = min(ℓ_t, −c·A)
  + kl_coef · KL_t (k1: log π − log π_ref; k3: e^{ref−log π} − (ref − log π) − 1) − entropy_coef · H_t
Aggregation (normalisers over the whole minibatch, fixed before any block runs; under data
parallelism the minibatch is the GLOBAL one, its counts passed in as `Normalisers`):
  token-mean               Σ_{i,t} ℓ / Σ_i |y_i|
  seq-mean-token-mean      (1/N) Σ_i (1/|y_i|) Σ_t ℓ
  seq-mean-token-sum-norm  (1/N) Σ_i Σ_t ℓ / L_max          (Dr.GRPO; L_max = max_len_norm)
GSPO (Zheng et al. 2025): s_i = exp(mean_t(log π_t − log π_old,t)),
  ℓ_i = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i), loss = (1/N) Σ_i ℓ_i. With s_i taken from
  the prefill (exact: the prefill runs at the current weights), the block term is
  Σ_t c_{i,t} log π_t with c_{i,t} = (1/N) ∂ℓ_i/∂s_i · s_i / |y_i|.
Zero-advantage sequences are inactive (cost nothing) unless a KL or entropy term reads them; they
still count in the normalisers, as in the per-sample computation.

Training–inference mismatch (loss.is_level, `backstream.rl.offpolicy`): decoupled PPO multiplies the
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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.checks import choice
from backstream.stream.objective import BlockView, Objective, flat_offsets
from backstream.rl.offpolicy import IS_LEVELS, IS_MODES, mismatch_weights

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
class _Common:
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (needs algorithm.kl_reference)."""
    kl_estimator: str = "k3"
    """k1 (log-ratio) or k3 (Schulman's unbiased, non-negative estimator)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    temperature: float = 1.0
    """Logits are divided by this before the softmax; must equal the sampling temperature."""
    router_aux_coef: float = 0.0
    """MoE models: weight of the router load-balancing loss over every token of the minibatch
    (transformers' aux loss; the model config's router_aux_loss_coef is the usual value). 0 = off."""
    is_level: str = "none"
    """Training–inference mismatch correction (verl's rollout correction): none, token
    (w_t = π_old,t/μ_t) or sequence (w_i = Π_t π_old,t/μ_t over the completion). The detached weight
    multiplies the policy-gradient term only (not KL/entropy); needs the sampler's log-probs."""
    is_mode: str = "truncate"
    """truncate: w ← clamp(w, is_cap_low, is_cap_high) (TIS); mask: a token or sequence whose w lies
    outside [is_cap_low, is_cap_high] gets weight 0, the others keep w (MIS)."""
    is_cap_high: float = 2.0
    """Upper cap of the mismatch weight."""
    is_cap_low: float = 0.0
    """Lower cap of the mismatch weight (0 = none); 0 ≤ is_cap_low < is_cap_high."""

    def _check(self, name: str) -> None:
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"loss.kl_estimator: got {self.kl_estimator!r}, expected 'k1' or 'k3'")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("loss.kl_coef / loss.entropy_coef: expected numbers >= 0")
        if not (self.router_aux_coef >= 0 and math.isfinite(self.router_aux_coef)):
            raise ValueError(f"loss.router_aux_coef: got {self.router_aux_coef}, expected a finite number >= 0")
        if not self.temperature > 0:
            raise ValueError(f"loss.temperature: got {self.temperature}, expected > 0")
        choice("loss.is_level", self.is_level, list(IS_LEVELS))
        choice("loss.is_mode", self.is_mode, list(IS_MODES))
        lo, hi = self.is_cap_low, self.is_cap_high
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
            raise ValueError(f"loss.is_cap_low / loss.is_cap_high: expected finite 0 <= low < high, got {lo}, {hi}")

    def _check_eps(self) -> None:
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise ValueError(f"loss.eps_low / loss.eps_high: expected >= 0, got {self.eps_low}, {self.eps_high}")

    def build(self, **inputs) -> PolicyObjective:
        """The objective of this variant over one minibatch (the keyword arguments of `build_objective`)."""
        raise NotImplementedError


@dataclass(kw_only=True)
class PPOClipConfig(_Common):
    type: str = "ppo_clip"
    """Token-level PPO clip: GRPO, DAPO (eps_high > eps_low), Dr.GRPO (seq-mean-token-sum-norm)."""
    eps_low: float = 0.2
    """Lower clip range: ρ ≥ 1 − eps_low."""
    eps_high: float = 0.2
    """Upper clip range: ρ ≤ 1 + eps_high (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None = off."""
    aggregation: str = "token-mean"
    """token-mean, seq-mean-token-mean, or seq-mean-token-sum-norm (Dr.GRPO)."""
    max_len_norm: int | None = None
    """L_max of seq-mean-token-sum-norm; None = the longest completion of the minibatch."""

    def __post_init__(self):
        if self.type != "ppo_clip":
            raise ValueError(f"loss.type: got {self.type!r} for PPOClipConfig")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation: got {self.aggregation!r}, expected one of {list(AGGREGATIONS)}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"loss.dual_clip: got {self.dual_clip}, expected a number > 1 (or none)")
        if self.max_len_norm is not None and self.max_len_norm < 1:
            raise ValueError(f"loss.max_len_norm: got {self.max_len_norm}, expected an integer >= 1")
        self._check("ppo_clip")
        self._check_eps()

    def build(self, **inputs) -> PolicyObjective:
        # the corrected variant has a `setup` (its π_old may be the prefill's); the plain one has
        # none, so the naive reference skips the extra no-grad pass it runs for objectives with one
        return (PPOClipObjective if self.is_level == "none" else PPOClipISObjective)(self, **inputs)


@dataclass(kw_only=True)
class GSPOConfig(_Common):
    type: str = "gspo"
    """Sequence-level ratio and clipping (GSPO)."""
    eps_low: float = 3e-4
    """Lower clip range of the sequence ratio."""
    eps_high: float = 4e-4
    """Upper clip range of the sequence ratio."""

    def __post_init__(self):
        if self.type != "gspo":
            raise ValueError(f"loss.type: got {self.type!r} for GSPOConfig")
        self._check("gspo")
        self._check_eps()
        if self.is_level == "token":
            raise ValueError("loss.is_level: GSPO's ratio and clip are per sequence, so is its mismatch weight; "
                             "use 'sequence' (or 'none')")

    def build(self, **inputs) -> PolicyObjective:
        return GSPOObjective(self, **inputs)


LossConfig = PPOClipConfig | GSPOConfig
LOSS_TYPES: dict[str, type] = {"ppo_clip": PPOClipConfig, "gspo": GSPOConfig}  # by the `type` key


def _logp_entropy(view: BlockView, temperature: float, need_entropy: bool):
    if temperature == 1.0:
        return view.logprobs(), (view.entropy() if need_entropy else None)
    dtype = torch.promote_types(view.logits_PV.dtype, torch.float32)
    logp_PV = torch.log_softmax(view.logits_PV.to(dtype) / temperature, dim=-1)
    logp = logp_PV[view.row_pos_N, view.target_N]
    ent = -(logp_PV.exp() * logp_PV).sum(-1)[view.row_pos_N] if need_entropy else None
    return logp, ent


def _kl(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    d = ref - logp
    return torch.exp(d) - d - 1


class PolicyObjective(Objective):
    """Shared bookkeeping: per-token statistics in the flat layout, normalisers, metrics."""

    def __init__(self, config, *, sequences, completion_mask, advantages, old_logprobs=None, ref_logprobs=None,
                 rollout_logprobs=None, old_is_current=False, normalisers: Normalisers | None = None):
        n = len(sequences)
        if old_is_current and old_logprobs is None:
            raise ValueError("old_is_current: needs old_logprobs (the log-probs at the current weights)")
        if len(completion_mask) != n or len(advantages) != n:
            raise ValueError(f"completion_mask / advantages: expected {n} entries (one per sequence)")
        for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                        ("rollout_logprobs", rollout_logprobs)):
            if x is not None and len(x) != n:
                raise ValueError(f"{name}: expected {n} entries (one per sequence)")
            if x is not None and any(len(a) != len(s) for a, s in zip(x, sequences)):
                raise ValueError(f"{name}: expected one log-prob per token of each sequence (NaN at the prompt)")
        if config.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("ref_logprobs: required when loss.kl_coef > 0")
        if config.is_level != "none" and rollout_logprobs is None:
            raise ValueError(f"rollout_logprobs: the sampler's log-probs are required when loss.is_level = "
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
        if config.is_level != "none" and old_logprobs is None:
            self.needs_prefill_logprobs = True  # π_old of the mismatch weight is the prefill's
        self.is_flat: Tensor | None = None  # the mismatch weight per token, set by `setup`
        self.coef_flat = self.token_coefficients()
        self._sums: dict[str, float] = {}

    def token_coefficients(self) -> Tensor:
        raise NotImplementedError

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

    def _mismatch_setup(self, logprobs) -> None:
        """The mismatch weights of loss.is_level (π_old: old_logprobs, else the prefill's), and their metrics."""
        if self.cfg.is_level == "none":
            return
        old = self.old_flat
        if old is None:
            if logprobs is None:
                raise ValueError("loss.is_level: the mismatch weight needs π_old: pass old_logprobs, or let the "
                                 "engine run its prefill (no kv=)")
            old = flat(logprobs)
        cfg = self.cfg
        self.is_flat, m = mismatch_weights(old, self.rollout_flat, self.offsets, self.lengths, self.pg_mask(),
                                           level=cfg.is_level, mode=cfg.is_mode, cap_low=cfg.is_cap_low,
                                           cap_high=cfg.is_cap_high)
        # the metrics are means over this minibatch's weighted units; as shares of the global count
        # they add up over ranks (a factor of exactly 1 in one process)
        units = [int(x.sum()) for x in self.pg_mask()]
        local, total = ((sum(units), self.norm.n_pg_tok) if cfg.is_level == "token"
                        else (sum(u > 0 for u in units), self.norm.n_pg_seq))
        for k, v in m.items():
            self._add(k, v * local / max(1, total) if local != total else v)

    def active(self, sequences):
        reads_all = self.cfg.kl_coef > 0 or self.cfg.entropy_coef > 0
        return [m & (bool(a != 0) or reads_all) for m, a in zip(self.mask, self.adv)]

    def _extras(self, view, logp, ent, c) -> Tensor:
        """KL and entropy terms with the same per-token coefficients."""
        out = logp.new_zeros(())
        if self.cfg.kl_coef > 0:
            kl = _kl(logp, self.ref_flat.to(logp.device, logp.dtype)[view.flat_N], self.cfg.kl_estimator)
            out = out + self.cfg.kl_coef * (c * kl).sum()
            self._add("kl", (kl.detach() * self._tokw(view)).sum())
        if self.cfg.entropy_coef > 0:
            out = out - self.cfg.entropy_coef * (c * ent).sum()
        if ent is not None:
            self._add("entropy", (ent.detach() * self._tokw(view)).sum())
        return out

    def _tokw(self, view) -> Tensor:
        """Metric weights: 1 / (total completion tokens), so sums over blocks are token means."""
        return torch.full_like(view.flat_N, 1.0, dtype=torch.float64) / max(1, self.norm.n_tok)

    def _add(self, key: str, value) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + float(value)

    def metrics(self) -> dict[str, float]:
        return dict(self._sums)


class PPOClipObjective(PolicyObjective):
    # on-policy (no old log-probs given), π_old is the current policy: the block's own log-probs,
    # detached, which equal the prefill's bitwise; so the prefill may skip the response tails
    needs_prefill_logprobs = False

    def token_coefficients(self) -> Tensor:
        weight = AGGREGATIONS[self.cfg.aggregation]
        out = torch.zeros(len(self.adv_flat), dtype=torch.float64)
        nm = self.norm
        n_total, lmax = nm.n_tok, self.cfg.max_len_norm or nm.lmax
        for i, (o, L) in enumerate(zip(self.offsets, self.lengths)):
            out[o:o + L] = weight(self.n_tok[i], n_total, nm.n_seq, lmax)
        return out

    def block_loss(self, view: BlockView) -> Tensor:
        cfg = self.cfg
        logp, ent = _logp_entropy(view, cfg.temperature, cfg.entropy_coef > 0)
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
        self._add("clip_frac_low", (((r < 1 - cfg.eps_low) & (A < 0)).double() * w).sum())
        self._add("clip_frac_high", (((r > 1 + cfg.eps_high) & (A > 0)).double() * w).sum())
        self._add("ratio_mean", (r.double() * w).sum())
        self._add("policy", (loss_t.detach().double() * c.double()).sum())
        return (c * loss_t).sum() + self._extras(view, logp, ent, c)


class PPOClipISObjective(PPOClipObjective):
    """PPO-clip with the mismatch weights of loss.is_level, computed once in `setup`."""

    def setup(self, logprobs):
        self._mismatch_setup(logprobs)


class GSPOObjective(PolicyObjective):
    def token_coefficients(self) -> Tensor:
        # KL / entropy per token: sequence mean of token means
        out = torch.zeros(len(self.adv_flat), dtype=torch.float64)
        for i, (o, L) in enumerate(zip(self.offsets, self.lengths)):
            out[o:o + L] = 1.0 / (self.norm.n_seq * max(1, self.n_tok[i]))
        return out

    def setup(self, logprobs):
        logprobs = self.current(logprobs)
        if logprobs is None:
            raise ValueError("GSPO: needs the prefill's log-probs for its sequence ratios (do not pass kv=, "
                             "or pass old_is_current=True with old_logprobs at the current weights)")
        old_given = self.old_flat is not None
        cur = torch.cat([x.double().reshape(-1) for x in logprobs])
        if not old_given:
            self.old_flat = cur
        cfg = self.cfg
        self._mismatch_setup(None)  # π_old is old_flat by now
        self.pg_flat = torch.zeros_like(cur)
        self._add("policy", 0.0)
        pg = [i for i in range(self.n_seq) if self.n_tok[i] > 0 and self.adv[i] != 0]
        for i in pg:  # a zero-advantage sequence has no term (and no log-probs when old is given)
            o, L, m = self.offsets[i], self.lengths[i], self.mask[i]
            d = (cur[o:o + L] - self.old_flat[o:o + L])[m]
            s = math.exp(float(d.mean())) if old_given else 1.0
            A = float(self.adv[i])
            w = 1.0 if self.is_flat is None else float(self.is_flat[o:o + L][m][0])  # one weight per sequence
            # ∂ℓ/∂s: −A on the unclipped branch of min(sA, clip(s)A), 0 on the clipped one
            lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
            unclipped = s * A <= min(max(s, lo), hi) * A
            g = -A if unclipped else 0.0
            n_seq, n_pg = self.norm.n_seq, self.norm.n_pg_seq
            self.pg_flat[o:o + L][m] = w * g * s / (n_seq * self.n_tok[i])
            self._add("ratio_mean", s / n_pg)
            self._add("clip_frac_low", float(not unclipped and s < lo) / n_pg)
            self._add("clip_frac_high", float(not unclipped and s > hi) / n_pg)
            self._add("policy", -w * min(s * A, min(max(s, lo), hi) * A) / n_seq)

    def block_loss(self, view: BlockView) -> Tensor:
        logp, ent = _logp_entropy(view, self.cfg.temperature, self.cfg.entropy_coef > 0)
        dev, dt = logp.device, logp.dtype
        pg = self.pg_flat.to(dev, dt)[view.flat_N]
        c = self.coef_flat.to(dev, dt)[view.flat_N]
        return (pg * logp).sum() + self._extras(view, logp, ent, c)


def build_objective(config, *, sequences, completion_mask, advantages, old_logprobs=None,
                    ref_logprobs=None, rollout_logprobs=None, old_is_current=False,
                    normalisers: Normalisers | None = None) -> PolicyObjective:
    """The objective of `config` (a loss config: PPOClipConfig, GSPOConfig, tbpo.TBPOConfig) over
    one minibatch; each config builds its own objective (`config.build`), so variants defined
    elsewhere need no entry here. Per sequence, aligned to it (NaN at the prompt tokens):
    old_logprobs  π_old; None = the current policy (from the engine's prefill);
    ref_logprobs  π_ref of the KL term (needed when loss.kl_coef > 0);
    rollout_logprobs  the sampler's μ (needed by loss.is_level != 'none' and by TBPO, ignored else);
    old_is_current  old_logprobs are at the current weights and numerics (the aligned sampler's, when
                    the engine takes the rollout's K/V and runs no prefill): the sequence ratios
                    (GSPO, TBPO) are then 1 without a prefill;
    normalisers   the counts the loss is divided by (`Normalisers`); None = those of these sequences.
                  Data parallelism passes the global minibatch's, so that the gradients of the ranks
                  sum to the single-process one."""
    if not isinstance(config, _Common):
        raise TypeError(f"config: expected a loss config (PPOClipConfig, GSPOConfig, TBPOConfig), "
                        f"got {type(config).__name__}")
    return config.build(sequences=sequences, completion_mask=completion_mask, advantages=advantages,
                        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                        old_is_current=old_is_current, normalisers=normalisers)


def _naive_mismatch_weight(config, old: Tensor, rollout: Tensor) -> Tensor:
    """loss.is_level's weight over one sequence's completion tokens, straight from the definition."""
    w = torch.exp(old - rollout) if config.is_level == "token" else torch.exp((old - rollout).sum())
    lo, hi = config.is_cap_low, config.is_cap_high
    if config.is_mode == "truncate":
        return torch.clamp(w, lo, hi)
    return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))


def reference_loss(config, logits_list, sequences, completion_mask, advantages, old_logprobs=None,
                   ref_logprobs=None, rollout_logprobs=None) -> Tensor:
    """The same losses the textbook way, from full per-sequence logits [len_i, V] (position t−1
    predicts token t). The naive reference of the tests."""
    N = len(sequences)
    total_tok = sum(int(m.sum()) for m in completion_mask)
    lmax = getattr(config, "max_len_norm", None) or max(int(m.sum()) for m in completion_mask)
    gspo = isinstance(config, GSPOConfig)
    weight = None if gspo else AGGREGATIONS[config.aggregation]
    loss = 0.0
    for i in range(N):
        m = completion_mask[i].clone()
        m[0] = False
        if not m.any():
            continue
        t = torch.nonzero(m).flatten()
        lp_all = torch.log_softmax(logits_list[i][t - 1] / config.temperature, -1)
        logp = lp_all.gather(-1, sequences[i][t, None])[:, 0]
        old = logp.detach() if old_logprobs is None else old_logprobs[i][t].to(logp.dtype)
        A = float(advantages[i])
        n = len(t)
        is_w = 1.0
        if config.is_level != "none" and A != 0:
            is_w = _naive_mismatch_weight(config, old.detach(), rollout_logprobs[i][t].to(logp.dtype))
        if gspo:
            s = torch.exp((logp - old).mean())
            term = -is_w * torch.min(s * A, torch.clamp(s, 1 - config.eps_low, 1 + config.eps_high) * A) / N
            w = torch.full((n,), 1.0 / (N * n), dtype=logp.dtype)
        else:
            ratio = torch.exp(logp - old)
            lt = -torch.min(ratio * A, torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high) * A)
            if config.dual_clip is not None and A < 0:
                lt = torch.min(lt, torch.full_like(lt, -config.dual_clip * A))
            w = torch.full((n,), weight(n, total_tok, N, lmax), dtype=logp.dtype)
            term = (w * is_w * lt).sum()
        if config.kl_coef > 0:
            ref = ref_logprobs[i][t].to(logp.dtype)
            d = ref - logp
            kl = (logp - ref) if config.kl_estimator == "k1" else torch.exp(d) - d - 1
            term = term + config.kl_coef * (w * kl).sum()
        if config.entropy_coef > 0:
            ent = -(lp_all.exp() * lp_all).sum(-1)
            term = term - config.entropy_coef * (w * ent).sum()
        loss = loss + term
    return loss
