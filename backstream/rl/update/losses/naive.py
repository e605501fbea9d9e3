"""Every objective's naive reference: its loss the textbook way, from full per-sequence logits
[len_i, V] (position t−1 predicts token t), one sequence at a time, autograd through everything —
no prefill, no detached statistics, no blocks. The streamed objectives (`ppo`, `sequence`, `tbpo`)
must agree with it: in value for the token-level losses (PPO-clip), in gradient for all (GSPO's and
TBPO's block terms are a surrogate with the loss's gradient). The formulas are in the docstrings of
those modules; `naive_loss` picks the one of the config's type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.rl.update.losses.base import AGGREGATIONS, LossConfigBase
from backstream.rl.update.losses.ppo import PPOClipConfig
from backstream.rl.update.losses.sequence import GSPOConfig
from backstream.rl.update.losses.tbpo import TBPOConfig


@dataclass(frozen=True)
class Seq:
    """One sequence's completion tokens t (those the loss reads), aligned: [n] tensors."""

    logp: Tensor  # log π_t, with grad
    old: Tensor  # log π_old,t (π itself, detached, when no old_logprobs are given)
    rollout: Tensor | None  # log μ_t of the sampler, if given
    adv: float  # A_i


@dataclass(frozen=True)
class Batch:
    n_seq: int  # N
    n_tok: int  # Σ_i |y_i|
    lmax: int  # the longest completion


def mismatch_weight(config: LossConfigBase, seq: Seq) -> Tensor | float:
    """loss.is_level's weight over one sequence's completion tokens, straight from the definition."""
    level = config.mismatch_level
    if level is None or seq.adv == 0:
        return 1.0
    old, rollout = seq.old.detach(), seq.rollout
    w = torch.exp(old - rollout) if level.per_token else torch.exp((old - rollout).sum())
    lo, hi = config.is_cap_low, config.is_cap_high
    if config.mismatch_mode.masks:
        return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    return torch.clamp(w, lo, hi)


# Each variant's policy term of one sequence, and the per-token weights of its KL and entropy terms.

def ppo_clip(config: PPOClipConfig, seq: Seq, batch: Batch) -> tuple[Tensor, Tensor]:
    logp, A = seq.logp, seq.adv
    ratio = torch.exp(logp - seq.old)
    lt = -torch.min(ratio * A, torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high) * A)
    if config.dual_clip is not None and A < 0:
        lt = torch.min(lt, torch.full_like(lt, -config.dual_clip * A))
    weight = AGGREGATIONS[config.aggregation](len(logp), batch.n_tok, batch.n_seq, config.norm_length(batch.lmax))
    w = torch.full((len(logp),), weight, dtype=logp.dtype)
    return (w * mismatch_weight(config, seq) * lt).sum(), w


def gspo(config: GSPOConfig, seq: Seq, batch: Batch) -> tuple[Tensor, Tensor]:
    logp, A, N = seq.logp, seq.adv, batch.n_seq
    s = torch.exp((logp - seq.old).mean())
    term = -mismatch_weight(config, seq) * torch.min(s * A, torch.clamp(s, 1 - config.eps_low, 1 + config.eps_high) * A)
    return term / N, torch.full((len(logp),), 1.0 / (N * len(logp)), dtype=logp.dtype)


def tbpo(config: TBPOConfig, seq: Seq, batch: Batch) -> tuple[Tensor | float, Tensor]:
    logp, A, N, C = seq.logp, seq.adv, batch.n_seq, config.seq_tis_imp_ratio_cap
    w_t = torch.full((len(logp),), 1.0 / (N * len(logp)), dtype=logp.dtype)
    if A == 0:
        return 0.0, w_t  # no policy term, no band
    s = torch.exp((logp - seq.old).mean())
    w = torch.clamp(torch.exp((seq.old - seq.rollout).mean()), 1 / C, C)
    sd = float(s.detach())
    if A > 0:
        M = float(sd <= 1 + config.seq_clip_ratio_high)
    else:
        M = float(1 - config.neg_seq_clip_ratio_low <= sd <= 1 + config.neg_seq_clip_ratio_high)
    return -M * w * s * A / N, w_t


POLICY_TERMS: dict[type, Callable[..., tuple[Tensor | float, Tensor]]] = {
    PPOClipConfig: ppo_clip, GSPOConfig: gspo, TBPOConfig: tbpo}


def naive_loss(config, logits_list, sequences, completion_mask, advantages, old_logprobs=None,
               ref_logprobs=None, rollout_logprobs=None) -> Tensor:
    """The loss of `config` from full per-sequence logits, with the inputs of `build_objective`
    (per sequence, aligned to it); rollout_logprobs are needed by loss.is_level and TBPO."""
    policy_term = next((f for cls, f in POLICY_TERMS.items() if isinstance(config, cls)), None)
    if policy_term is None:
        raise TypeError(f"config: expected a loss config ({', '.join(c.__name__ for c in POLICY_TERMS)}), "
                        f"got {type(config).__name__}")
    n_tok = [int(m.sum()) for m in completion_mask]
    batch = Batch(n_seq=len(sequences), n_tok=sum(n_tok), lmax=max(n_tok, default=0))
    loss = 0.0
    for i in range(len(sequences)):
        m = completion_mask[i].clone()
        m[0] = False
        if not m.any():
            continue
        t = torch.nonzero(m).flatten()
        lp_all = torch.log_softmax(logits_list[i][t - 1] / config.temperature, -1)
        logp = lp_all.gather(-1, sequences[i][t, None])[:, 0]
        old = logp.detach() if old_logprobs is None else old_logprobs[i][t].to(logp.dtype)
        rollout = None if rollout_logprobs is None else rollout_logprobs[i][t].to(logp.dtype)
        term, w = policy_term(config, Seq(logp=logp, old=old, rollout=rollout, adv=float(advantages[i])), batch)
        if config.kl_coef > 0:
            term = term + config.kl_coef * (w * config.kl_estimate(logp, ref_logprobs[i][t].to(logp.dtype))).sum()
        if config.entropy_coef > 0:
            ent = -(lp_all.exp() * lp_all).sum(-1)
            term = term - config.entropy_coef * (w * ent).sum()
        loss = loss + term
    return loss
