"""TBPO: bands, masks, mismatch weights and gradients against a naive per-sequence formula (autograd
through s_i = exp(mean(log π − log π_old)) with M_i and w_i detached), for every band case; the
streamed engine against the naive backward in float64; the input and config errors."""

import math
import warnings

import pytest
import torch
from helpers import assert_streamed_equals_reference, current_logprobs, engine_problem, make, streamed_total

from backstream.rl.update.losses import TBPOConfig, TBPOObjective, build_objective, naive_loss
from backstream.stream.engine import logprobs as engine_logprobs

warnings.filterwarnings("ignore", category=FutureWarning)
NAN = math.nan
V = 7


# Eight unrelated sequences of 6 tokens (prompt 0..1, completion 2..5). π_old = π − δ_i on the
# completion, so s_i = exp(δ_i); μ = π_old − γ_i, so w_i = clamp(exp(γ_i), 1/2, 2). Bands (defaults):
# A > 0: s ≤ 1.0004; A < 0: 0.9997 ≤ s ≤ 1.0007.
CASES = [  # (A, δ, γ, masked, w)
    (+1.0, 2e-4, 0.0, False, 1.0),          # A > 0 inside, w = 1
    (+1.0, 6e-4, 0.3, True, math.exp(0.3)),  # A > 0 above 1 + 4e-4: masked
    (+1.0, -0.5, 1.0, False, 2.0),          # A > 0 far below 1: the band is one-sided, kept; w capped at 2
    (-1.0, -2e-4, -1.0, False, 0.5),        # A < 0 inside; w capped at 1/2
    (-1.0, -5e-4, 0.0, True, 1.0),          # A < 0 below 1 − 3e-4: masked
    (-1.0, 1e-3, 0.0, True, 1.0),           # A < 0 above 1 + 7e-4 (dual clip): masked
    (-1.0, 5e-4, 0.3, False, math.exp(0.3)),  # A < 0 inside (between 1 + 4e-4 and 1 + 7e-4)
    (0.0, 0.0, 0.0, False, 1.0),            # A = 0: no term at all
]


def band_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (6,), generator=g) for _ in CASES]
    pos_index = [torch.arange(6 * i, 6 * i + 6) for i in range(len(CASES))]
    mask = [torch.arange(6) >= 2 for _ in CASES]
    logits = torch.randn(6 * len(CASES), V, generator=g, dtype=torch.float64)
    cur = current_logprobs(logits, seqs, pos_index, mask)
    old = [c - d for c, (_, d, *_) in zip(cur, CASES)]
    mu = [o - gm for o, (_, _, gm, *_) in zip(old, CASES)]
    adv = torch.tensor([a for a, *_ in CASES], dtype=torch.float64)
    return seqs, pos_index, mask, logits, adv, old, mu, g


def test_bands_masks_and_weights_by_hand():
    seqs, pos_index, mask, logits, adv, old, mu, g = band_problem()
    cfg = TBPOConfig()
    obj = build_objective(cfg, sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old,
                          rollout_logprobs=mu)
    assert isinstance(obj, TBPOObjective) and obj.needs_prefill_logprobs
    leaf = logits.clone().requires_grad_(True)
    got = streamed_total(obj, leaf, seqs, pos_index, 3, g)
    # per sequence: the coefficient −M w A s / (N |y|) on each completion token
    for i, (A, d, _, masked, w) in enumerate(CASES):
        coef = obj.pg_flat[6 * i + 2:6 * i + 6]
        want = 0.0 if masked else -w * A * math.exp(d) / (8 * 4)
        assert torch.allclose(coef, torch.full((4,), want, dtype=torch.float64), rtol=1e-12, atol=0), i
    # 7 responses with a policy term: 3 masked (1 positive, 2 negative), 2 weights at a cap
    m = obj.metrics()
    assert m["tbpo/masked_frac"] == pytest.approx(3 / 7) and m["tbpo/masked_pos"] == pytest.approx(1 / 7)
    assert m["tbpo/masked_neg"] == pytest.approx(2 / 7) and m["tbpo/weight_capped_frac"] == pytest.approx(2 / 7)
    assert m["tbpo/weight_mean"] == pytest.approx(sum(c[4] for c in CASES[:7]) / 7, rel=1e-12)
    assert m["ratio_mean"] == pytest.approx(sum(math.exp(c[1]) for c in CASES[:7]) / 7, rel=1e-12)
    # policy = (1/8) Σ −M w s A over the kept: −(1·1·e^2e-4) − (2·e^−0.5) + (0.5·e^−2e-4) + (e^0.3·e^5e-4)
    policy = -(math.exp(2e-4) + 2 * math.exp(-0.5) - 0.5 * math.exp(-2e-4) - math.exp(0.3) * math.exp(5e-4)) / 8
    assert m["policy"] == pytest.approx(policy, rel=1e-12)
    # gradients against the naive formula
    leaf2 = logits.clone().requires_grad_(True)
    want = naive_loss(cfg, [leaf2[p] for p in pos_index], seqs, mask, adv, old, None, mu)
    assert abs(float(want.detach()) - policy) < 1e-12
    (g_ref,) = torch.autograd.grad(want, leaf2)
    (g_got,) = torch.autograd.grad(got, leaf)
    assert g_ref.abs().max() > 0 and torch.allclose(g_got, g_ref, atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("cfg", [
    TBPOConfig(),
    TBPOConfig(seq_clip_ratio_high=0.05, neg_seq_clip_ratio_low=0.05, neg_seq_clip_ratio_high=0.1, kl_coef=0.2,
               entropy_coef=0.05, temperature=0.8, seq_tis_imp_ratio_cap=1.5),
], ids=["paper", "wide-kl-entropy"])
@pytest.mark.parametrize("seed", range(4))
def test_random_partitions_match_the_naive_formula(cfg, seed):
    """Random δ_i (s_i on both sides of every band edge) and γ_i (w_i inside and outside the cap); the
    block terms over random partitions have the naive formula's gradient."""
    seqs, pos_index, mask, logits, adv, _, _, g = band_problem(seed)
    adv = torch.randn(len(seqs), generator=g, dtype=torch.float64)
    adv[-1] = 0.0
    cur = current_logprobs(logits / cfg.temperature, seqs, pos_index, mask)
    scale = 1e-3 if cfg.seq_clip_ratio_high < 0.01 else 0.1
    old = [c - scale * float(torch.randn((), generator=g)) for c in cur]
    mu = [o - float(torch.randn((), generator=g)) - 0.2 * torch.randn(6, generator=g, dtype=torch.float64) for o in old]
    ref = [c + 0.3 * torch.randn(6, generator=g, dtype=torch.float64) for c in cur]
    leaf = logits.clone().requires_grad_(True)
    want = naive_loss(cfg, [leaf[p] for p in pos_index], seqs, mask, adv, old, ref, mu)
    (g_ref,) = torch.autograd.grad(want, leaf)
    obj = build_objective(cfg, sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old,
                          ref_logprobs=ref, rollout_logprobs=mu)
    leaf2 = logits.clone().requires_grad_(True)
    got = streamed_total(obj, leaf2, seqs, pos_index, 1 + seed, g, temperature=cfg.temperature)
    (g_got,) = torch.autograd.grad(got, leaf2)
    assert torch.allclose(g_got, g_ref, atol=1e-14, rtol=1e-10)
    assert all(math.isfinite(v) for v in obj.metrics().values())


def test_weight_is_one_when_the_sampler_is_the_learner():
    """μ = π_old (an aligned learner at the sampler's weights): w_i = 1 exactly; on-policy (no
    old_logprobs, π_old = the prefill) s_i = 1 too, so every response with A ≠ 0 is kept."""
    seqs, pos_index, mask, logits, adv, old, _, g = band_problem()
    for o, mu in ((old, old), (None, current_logprobs(logits, seqs, pos_index, mask))):
        obj = build_objective(TBPOConfig(), sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=o,
                              rollout_logprobs=mu)
        streamed_total(obj, logits.clone(), seqs, pos_index, 2, g)
        m = obj.metrics()
        assert m["tbpo/weight_mean"] == 1.0 and m["tbpo/weight_capped_frac"] == 0.0
    assert m["ratio_mean"] == 1.0 and m["tbpo/masked_frac"] == 0.0
    assert m["policy"] == pytest.approx(-float(adv.sum()) / 8)


@pytest.mark.parametrize("extra", [{}, {"kl_coef": 0.1, "entropy_coef": 0.05}], ids=["pg", "kl-entropy"])
def test_stream_backward_matches_reference(extra):
    """Qwen3 (float64), a shared prompt: δ = 2e-4 (A > 0, kept), −5e-4 (A < 0, masked), A = 0,
    5e-4 (A < 0, kept), 1e-3 (A > 0, masked); γ = 1, 0, 0, −1, 0.2 (two weights at a cap)."""
    model = make("qwen3")
    seqs, mask, adv, gen = engine_problem()
    cur = engine_logprobs(model, seqs, mask)
    old = [c - d for c, d in zip(cur, (2e-4, -5e-4, 0.0, 5e-4, 1e-3))]
    mu = [o - gm for o, gm in zip(old, (1.0, 0.0, 0.0, -1.0, 0.2))]
    ref = [c + 0.2 * torch.randn(len(c), generator=gen, dtype=torch.float64) for c in cur]
    cfg = TBPOConfig(**extra)
    m = assert_streamed_equals_reference(model, cfg, seqs, completion_mask=mask, advantages=adv, old_logprobs=old,
                                         rollout_logprobs=mu, ref_logprobs=ref if cfg.kl_coef else None)
    assert m["tbpo/masked_pos"] == 0.25 and m["tbpo/masked_neg"] == 0.25 and m["tbpo/weight_capped_frac"] == 0.5


@pytest.mark.parametrize("kwargs, match", [
    ({"is_level": "sequence"}, "loss.is_level"),
    ({"seq_tis_imp_ratio_cap": 0.5}, "loss.seq_tis_imp_ratio_cap"),
    ({"seq_tis_imp_ratio_cap": math.inf}, "loss.seq_tis_imp_ratio_cap"),
    ({"seq_clip_ratio_high": 0.0}, "loss.seq_clip_ratio_high"),
    ({"neg_seq_clip_ratio_low": -1e-4}, "loss.neg_seq_clip_ratio_low"),
    ({"neg_seq_clip_ratio_high": math.nan}, "loss.neg_seq_clip_ratio_high"),
    ({"type": "gspo"}, "loss.type"),
    ({"kl_estimator": "k2"}, "loss.kl_estimator"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TBPOConfig(**kwargs)


def test_input_errors():
    seqs, pos_index, mask, logits, adv, old, mu, _ = band_problem()
    kw = dict(sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        build_objective(TBPOConfig(), **kw)
    obj = build_objective(TBPOConfig(), **kw, rollout_logprobs=mu)
    with pytest.raises(ValueError, match="prefill"):
        obj.setup(None)  # K/V from the caller: no prefill, no s_i
    bad = [x.clone() for x in mu]
    bad[1][3] = NAN
    obj = build_objective(TBPOConfig(), **kw, rollout_logprobs=bad)
    with pytest.raises(ValueError, match="rollout_logprobs: NaN at token 3 of sequence 1"):
        obj.setup(current_logprobs(logits, seqs, pos_index, mask))
