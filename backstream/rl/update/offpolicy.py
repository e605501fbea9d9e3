"""Training–inference mismatch: importance weights that correct for it, and telemetry that shows it.

The sampler μ (the rollout engine: other kernels, a quantized model) and the learner's policy before
the update π_old differ slightly even at the same weights (QaRL, docs/design.md §6). Decoupled PPO (Hilton
et al. 2022) corrects for it by weighting each policy-gradient term with the detached ratio π_old/μ:

  token level     w_t = exp(log π_old,t − log μ_t)
  sequence level  w_i = exp(Σ_t (log π_old,t − log μ_t))     (the product of the token ratios, as
                                                              verl's rollout correction "sequence")
  truncate (TIS, Yao et al. 2025)   w ← clamp(w, cap_low, cap_high)
  mask     (MIS, Liu et al. 2025)   w ← w if cap_low ≤ w ≤ cap_high else 0   (the unit is rejected)

Everything is computed in log space and exp'd only after clamping to ≤ log cap_high, so a sequence
whose Σ log-ratio is in the thousands neither overflows nor turns into NaN.

Telemetry, over the completion tokens where both the learner and the sampler computed a log-prob,
with log r_t = log π_learner,t − log μ_t (tokens sampled from μ):
  mismatch/kl                 mean_t k3 = mean_t (r_t − 1 − log r_t), an unbiased, non-negative
                              estimate of KL(μ‖π_learner) per token (E_μ[r] = 1)
  mismatch/abs_log_ratio/mean mean_t |log r_t|
  mismatch/logprob_abs        the same per response, then averaged over responses (each counts once)
  mismatch/ratio/max          max_t r_t
  mismatch/tokens             how many tokens the above are over
and the share of responses holding "error tokens" (QaRL §3.2: a long response whose tail turns
into a repetitive, garbled loop), detected as a repeated n-gram.

This module imports nothing from the rest of backstream: the losses package imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.checks import UserError


@dataclass(frozen=True)
class ISLevel:
    """A level of the mismatch weight (loss.is_level): one weight per token, or one per sequence."""

    per_token: bool
    unit: str  # the weighted unit in the metric names: is/{unit}_masked_frac


@dataclass(frozen=True)
class ISMode:
    """What becomes of a weight outside [cap_low, cap_high] (loss.is_mode)."""

    masks: bool  # True: it is 0, the unit rejected (MIS); False: it is clamped to the caps (TIS)


# loss.is_level and loss.is_mode, parsed: "none" is no correction at all
IS_LEVELS: dict[str, ISLevel | None] = {"none": None, "token": ISLevel(per_token=True, unit="token"),
                                        "sequence": ISLevel(per_token=False, unit="seq")}
IS_MODES: dict[str, ISMode] = {"truncate": ISMode(masks=False), "mask": ISMode(masks=True)}


def _check_known(x_flat: Tensor, name: str, offsets: list[int], sel: Tensor) -> None:
    bad = torch.nonzero(torch.isnan(x_flat.detach().cpu()) & sel).flatten()
    if len(bad):
        i = max(k for k, o in enumerate(offsets) if o <= int(bad[0]))
        raise UserError(f"{name}: NaN at token {int(bad[0]) - offsets[i]} of sequence {i}, a token of the loss")


_REDUCE = {"sum": Tensor.sum, "mean": Tensor.mean}


def sequence_log_ratios(num_flat: Tensor, den_flat: Tensor, offsets: list[int], lengths: list[int],
                        mask: list[Tensor], *, reduce: str = "sum",
                        names: tuple[str, str] = ("num", "den")) -> Tensor:
    """Per sequence, Σ_t (or the mean over t) of num − den over its tokens in `mask`, from two
    [T] log-prob tensors in the flat layout: [N] float64, 0 for a sequence with no such token.
    A NaN at a token in `mask` is a ValueError naming the input (`names`)."""
    if reduce not in _REDUCE:
        raise UserError(f"reduce: got {reduce!r}, expected 'sum' or 'mean'")
    fold = _REDUCE[reduce]
    sel = torch.cat([m.to("cpu", torch.bool).reshape(-1) for m in mask]) if mask else torch.zeros(0, dtype=torch.bool)
    assert sel.shape == num_flat.shape == den_flat.shape, "flat layouts disagree"
    _check_known(num_flat, names[0], offsets, sel)
    _check_known(den_flat, names[1], offsets, sel)
    d = num_flat.detach().double().cpu() - den_flat.detach().double().cpu()
    out = torch.zeros(len(lengths), dtype=torch.float64)
    for i, (o, L) in enumerate(zip(offsets, lengths)):
        x = d[o:o + L][sel[o:o + L]]
        if len(x):
            out[i] = fold(x)
    return out


def mismatch_weights(old_flat: Tensor, rollout_flat: Tensor, offsets: list[int], lengths: list[int],
                     mask: list[Tensor], *, level: str, mode: str, cap_low: float,
                     cap_high: float) -> tuple[Tensor, dict[str, float]]:
    """The detached mismatch weight of every token, in the flat per-token layout of
    `objective.flat_offsets` (sequence i at [offsets[i], offsets[i] + lengths[i])).

    old_flat, rollout_flat: [T] log π_old and log μ in that layout (NaN where unknown).
    mask: per sequence, a bool tensor of its length: the tokens whose loss the weight multiplies
      (a sequence-level weight is over these tokens); both log-probs must be known there.
    level: "token" or "sequence"; mode: "truncate" or "mask"; 0 ≤ cap_low < cap_high.
    Returns the [T] float64 weights (1 outside `mask`) and the metrics over the weighted units
    (tokens, or sequences with at least one token in `mask`): is/weight_mean, the share masked
    (is/token_masked_frac or is/seq_masked_frac, 0 in truncate mode) and the share truncated
    (is/truncated_frac, 0 in mask mode); no metrics when there is no unit.
    """
    lvl, how = IS_LEVELS.get(level), IS_MODES.get(mode)
    if lvl is None:
        raise UserError(f"level: got {level!r}, expected 'token' or 'sequence'")
    if how is None:
        raise UserError(f"mode: got {mode!r}, expected one of {tuple(IS_MODES)}")
    if not (0 <= cap_low < cap_high and math.isfinite(cap_high)):
        raise UserError(f"cap_low / cap_high: expected 0 <= cap_low < cap_high < inf, got {cap_low}, {cap_high}")
    sel = torch.cat([m.to("cpu", torch.bool).reshape(-1) for m in mask]) if mask else torch.zeros(0, dtype=torch.bool)
    has = [bool(m.any()) for m in mask]
    if lvl.per_token:
        assert sel.shape == old_flat.shape == rollout_flat.shape, "flat layouts disagree"
        _check_known(old_flat, "old_logprobs", offsets, sel)
        _check_known(rollout_flat, "rollout_logprobs", offsets, sel)
        log_w = (old_flat.detach().double().cpu() - rollout_flat.detach().double().cpu())[sel]  # log(π_old/μ)
    else:  # one log-weight per sequence with weighted tokens: the sum of its token log-ratios
        log_w = sequence_log_ratios(old_flat, rollout_flat, offsets, lengths, mask,
                                    names=("old_logprobs", "rollout_logprobs"))[torch.tensor(has, dtype=torch.bool)]
    log_lo = math.log(cap_low) if cap_low > 0 else -math.inf
    log_hi = math.log(cap_high)
    outside = (log_w < log_lo) | (log_w > log_hi)
    if how.masks:
        w = torch.where(outside, torch.zeros_like(log_w), torch.exp(log_w.clamp(max=log_hi)))
    else:
        w = torch.exp(log_w.clamp(min=log_lo, max=log_hi))
    out = torch.ones(len(sel), dtype=torch.float64)
    if lvl.per_token:
        out[sel] = w
    else:
        for k, i in enumerate(i for i, h in enumerate(has) if h):
            o, L = offsets[i], lengths[i]
            out[o:o + L][sel[o:o + L]] = w[k]
    if len(w) == 0:
        return out, {}
    share = float(outside.double().mean())
    return out, {"is/weight_mean": float(w.mean()),
                 f"is/{lvl.unit}_masked_frac": share if how.masks else 0.0,
                 "is/truncated_frac": 0.0 if how.masks else share}


MISMATCH_KEYS = ("mismatch/kl", "mismatch/abs_log_ratio/mean", "mismatch/logprob_abs", "mismatch/ratio/max",
                 "mismatch/tokens", "mismatch/error_token_share")  # what a step's line reports of it


def mismatch_metrics(learner: list[Tensor | None], sampler: list[Tensor], mask: list[Tensor]) -> dict[str, float]:
    """CompletionSampler/learner agreement over the completion tokens (`mask`) where both log-probs are
    finite (the learner leaves NaN where it computed nothing; a None entry is skipped). See the
    module docstring for the keys; with no such token, only {"mismatch/tokens": 0}."""
    parts = []
    for a, b, m in zip(learner, sampler, mask):
        if a is None:
            continue
        log_r = (a.detach().double().cpu() - b.detach().double().cpu())[m.cpu().bool()]
        log_r = log_r[torch.isfinite(log_r)]
        if len(log_r):
            parts.append(log_r)
    if not parts:
        return {"mismatch/tokens": 0.0}
    log_r = torch.cat(parts)
    k3 = torch.expm1(log_r) - log_r  # e^x − 1 − x, without the cancellation of exp(x) − 1 near 0
    return {"mismatch/kl": float(k3.mean()), "mismatch/abs_log_ratio/mean": float(log_r.abs().mean()),
            "mismatch/logprob_abs": float(torch.stack([x.abs().mean() for x in parts]).mean()),
            "mismatch/ratio/max": math.exp(min(float(log_r.max()), 709.0)), "mismatch/tokens": float(len(log_r))}


STALENESS_KEYS = ("rollout/staleness_mean", "rollout/staleness_max")


def staleness_mismatch_keys(k: int) -> list[str]:
    """The keys of `staleness_mismatch` for rollout.max_staleness = k (none for the synchronous loop)."""
    return [f"mismatch/kl_staleness_{s}" for s in range(k + 1)] if k else []


def staleness_mismatch(learner: list[Tensor | None], sampler: list[Tensor], mask: list[Tensor],
                       behind: list[Tensor], k: int) -> dict[str, float | None]:
    """`mismatch/kl` (the k3 estimate of KL(μ ‖ π_old), `mismatch_metrics`) over the tokens sampled s
    versions behind the weights the update starts from, for each s in 0..k (`behind`: per sample, over
    its sequence positions): the gap that staleness adds to the numerics' own. None where no token of
    the step is s behind."""
    out = {}
    for key, s in zip(staleness_mismatch_keys(k), range(k + 1)):
        out[key] = mismatch_metrics(learner, sampler, [m & (b == s) for m, b in zip(mask, behind)]).get("mismatch/kl")
    return out


def staleness_metrics(behind: list[Tensor], mask: list[Tensor]) -> dict:
    """How many versions behind the weights the update starts from the step's sampled tokens were
    sampled: `rollout/staleness_mean` and `rollout/staleness_max` over every token with a loss (`behind`
    and `mask` per sequence: rl/records.py `TrainingRows`; in process, every token is 0 behind)."""
    behind = torch.cat([b[m] for b, m in zip(behind, mask)]) if behind else torch.zeros(0, dtype=torch.long)
    if behind.numel() == 0:
        return dict.fromkeys(STALENESS_KEYS, 0.0)
    return {"rollout/staleness_mean": float(behind.double().mean()), "rollout/staleness_max": float(behind.max())}


# A degenerate loop of period p (≤ 16) shows a 16-gram 4 times within 16 + 3p ≤ 64 tokens, so the
# shortest completions can be flagged; natural text (a 16K-token chain of thought included) seldom
# repeats a whole 16-token span — a sentence, an equation line — four times, while an error-token
# tail repeats its loop until the length limit, tens to hundreds of times.
ERROR_NGRAM = 16
ERROR_MIN_COUNT = 4


def repeated_ngram(ids: Tensor, n: int = ERROR_NGRAM, min_count: int = ERROR_MIN_COUNT,
                   hash_mult: Tensor | None = None) -> bool:
    """Does the token sequence `ids` hold some n-gram at least `min_count` times (overlaps count)?
    `hash_mult`: the multipliers of the windows' hash (default fixed random ones); with all zeros every
    window hashes alike and the exact comparison alone decides (what the tests check)."""
    if n < 1 or min_count < 2:
        raise UserError(f"n / min_count: expected n >= 1 and min_count >= 2, got {n}, {min_count}")
    ids = ids.reshape(-1).to("cpu", torch.long)
    if len(ids) < n + min_count - 1:  # min_count n-grams need at least that many tokens
        return False
    grams_GN = ids.unfold(0, n, 1)  # [G = L − n + 1, n], every window (a view)
    # a 1-D sort of one hash per window instead of a row-wise unique (10× faster on 16K tokens);
    # hashing can merge n-grams, never split them, so only windows whose hash reaches min_count are
    # compared exactly. Each term < 2^31 (mod a prime), so the sum cannot overflow int64.
    mult = _HASH_MULT if hash_mult is None else hash_mult
    mult_N = mult[torch.arange(n) % len(mult)]
    key_G = ((grams_GN % _HASH_P) * mult_N % _HASH_P).sum(1)
    _, inv_G, counts = torch.unique(key_G, return_inverse=True, return_counts=True)
    for c in torch.nonzero(counts >= min_count).flatten():
        _, exact = torch.unique(grams_GN[inv_G == c], dim=0, return_counts=True)
        if exact.max() >= min_count:
            return True
    return False


_HASH_P = 2_147_483_647  # 2^31 − 1
_HASH_MULT = torch.randint(1, _HASH_P, (64,), generator=torch.Generator().manual_seed(0))


def error_token_share(completions: list[Tensor], n: int = ERROR_NGRAM, min_count: int = ERROR_MIN_COUNT) -> float:
    """Share of the completions (token ids, prompt excluded) flagged by `repeated_ngram`; 0 if none."""
    if not completions:
        return 0.0
    return sum(repeated_ngram(c, n, min_count) for c in completions) / len(completions)
