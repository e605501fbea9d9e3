"""Training–inference mismatch: importance weights (token/sequence × truncate/mask) by hand, PPO-clip
and GSPO with them against the naive reference (values and gradients, over random block
partitions and through the streamed engine in float64), the mismatch telemetry by hand, the
error-token detector, and the config errors."""

import math
import warnings

import pytest
import torch
from helpers import (
    assert_streamed_equals_reference,
    current_logprobs,
    engine_problem,
    make,
    problem,
    streamed_total,
)

from backstream.rl.update.losses import (
    GSPOConfig,
    PPOClipConfig,
    PPOClipISObjective,
    PPOClipObjective,
    build_objective,
    naive_loss,
)
from backstream.rl.update.offpolicy import (
    error_token_share,
    mismatch_metrics,
    mismatch_weights,
    repeated_ngram,
    sequence_log_ratios,
)
from backstream.stream.engine import logprobs as engine_logprobs
from backstream.stream.objective import Objective

warnings.filterwarnings("ignore", category=FutureWarning)
NAN = math.nan
LN = math.log


# --- the weights by hand ------------------------------------------------------------------------

# Two sequences, flat layout [0, 4) and [4, 7); completion tokens 1..3 and 1..2. log π_old − log μ:
#   sequence 0: log 3, log 0.5, 0   → token weights 3, 0.5, 1    → product 1.5
#   sequence 1: log 0.1, log 1.5    → token weights 0.1, 1.5     → product 0.15
OLD = torch.tensor([NAN, LN(0.3), LN(0.25), LN(0.4), NAN, LN(0.01), LN(0.6)], dtype=torch.float64)
MU = torch.tensor([NAN, LN(0.1), LN(0.5), LN(0.4), NAN, LN(0.1), LN(0.4)], dtype=torch.float64)
MASK = [torch.tensor([False, True, True, True]), torch.tensor([False, True, True])]
OFFSETS, LENGTHS = [0, 4], [4, 3]


@pytest.mark.parametrize("level, mode, weights, metrics", [
    # caps [0.2, 2]: 3 → 2 and 0.1 → 0.2 truncated (2 of 5); mean (2 + 0.5 + 1 + 0.2 + 1.5)/5 = 1.04
    ("token", "truncate", [2, 0.5, 1, 0.2, 1.5], {"is/weight_mean": 1.04, "is/token_masked_frac": 0.0,
                                                  "is/truncated_frac": 0.4}),
    # the same two tokens rejected instead: mean (0 + 0.5 + 1 + 0 + 1.5)/5 = 0.6
    ("token", "mask", [0, 0.5, 1, 0, 1.5], {"is/weight_mean": 0.6, "is/token_masked_frac": 0.4,
                                            "is/truncated_frac": 0.0}),
    # products 1.5 (inside) and 0.15 → 0.2: mean 0.85, one sequence of two truncated
    ("sequence", "truncate", [1.5, 1.5, 1.5, 0.2, 0.2], {"is/weight_mean": 0.85, "is/seq_masked_frac": 0.0,
                                                         "is/truncated_frac": 0.5}),
    # 0.15 rejected: mean (1.5 + 0)/2 = 0.75
    ("sequence", "mask", [1.5, 1.5, 1.5, 0, 0], {"is/weight_mean": 0.75, "is/seq_masked_frac": 0.5,
                                                 "is/truncated_frac": 0.0}),
])
def test_weights_by_hand(level, mode, weights, metrics):
    w, m = mismatch_weights(OLD, MU, OFFSETS, LENGTHS, MASK, level=level, mode=mode, cap_low=0.2, cap_high=2.0)
    want = torch.tensor([1, *weights[:3], 1, *weights[3:]], dtype=torch.float64)  # 1 outside the mask
    assert torch.allclose(w, want, rtol=1e-12, atol=0)
    assert m.keys() == metrics.keys()
    for k, v in metrics.items():
        assert abs(m[k] - v) < 1e-12, k


def test_weights_lower_cap_off_and_partial_mask():
    # cap_low = 0 (the default): nothing is below it; 0.1 is kept, 3 truncated to 2
    w, m = mismatch_weights(OLD, MU, OFFSETS, LENGTHS, MASK, level="token", mode="truncate", cap_low=0.0, cap_high=2.0)
    assert torch.allclose(w[[1, 5]], torch.tensor([2.0, 0.1], dtype=torch.float64)) and m["is/truncated_frac"] == 0.2
    # only sequence 1 weighted (sequence 0 has no policy-gradient term): its product 0.15, sequence 0 left at 1;
    # NaN outside the mask is allowed (the prefill leaves it at tokens it did not compute)
    old = OLD.clone()
    old[1:4] = NAN
    w, m = mismatch_weights(old, MU, OFFSETS, LENGTHS, [torch.zeros(4, dtype=torch.bool), MASK[1]],
                            level="sequence", mode="mask", cap_low=0.1, cap_high=2.0)
    assert torch.allclose(w, torch.tensor([1, 1, 1, 1, 1, 0.15, 0.15], dtype=torch.float64))
    assert m == pytest.approx({"is/weight_mean": 0.15, "is/seq_masked_frac": 0.0, "is/truncated_frac": 0.0})
    # nothing weighted: weights 1, no metrics
    none = [torch.zeros(4, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)]
    w, m = mismatch_weights(OLD, MU, OFFSETS, LENGTHS, none, level="sequence", mode="mask", cap_low=0.1, cap_high=2.0)
    assert torch.equal(w, torch.ones(7, dtype=torch.float64)) and m == {}


def test_sequence_weight_does_not_overflow():
    """A sequence whose Σ log-ratio is 5000 (e^5000 overflows float64) or −5000: computed in log space."""
    old = torch.tensor([NAN] + [10.0 - 20.0] * 500, dtype=torch.float64)
    mu = torch.tensor([NAN] + [-20.0] * 500, dtype=torch.float64)
    mask = [torch.arange(501) >= 1]
    for sign, trunc, kept in ((1, 2.0, 0.0), (-1, 0.5, 0.0)):
        o = mu + sign * (old - mu)
        w, m = mismatch_weights(o, mu, [0], [501], mask, level="sequence", mode="truncate", cap_low=0.5, cap_high=2.0)
        assert float(w[1]) == trunc and all(math.isfinite(v) for v in m.values())
        w, m = mismatch_weights(o, mu, [0], [501], mask, level="sequence", mode="mask", cap_low=0.5, cap_high=2.0)
        assert float(w[1]) == kept and m["is/seq_masked_frac"] == 1.0


def test_sequence_log_ratios():
    # sequence 0: log 3 + log 0.5 + 0 = log 1.5, mean log(1.5)/3; sequence 1: log 0.15, mean log(0.15)/2
    s = sequence_log_ratios(OLD, MU, OFFSETS, LENGTHS, MASK)
    assert torch.allclose(s, torch.tensor([LN(1.5), LN(0.15)], dtype=torch.float64))
    m = sequence_log_ratios(OLD, MU, OFFSETS, LENGTHS, MASK, reduce="mean")
    assert torch.allclose(m, torch.tensor([LN(1.5) / 3, LN(0.15) / 2], dtype=torch.float64))
    with pytest.raises(ValueError, match="rollout_logprobs: NaN at token 2 of sequence 1"):
        mu = MU.clone()
        mu[6] = NAN
        sequence_log_ratios(OLD, mu, OFFSETS, LENGTHS, MASK, names=("old_logprobs", "rollout_logprobs"))


# --- PPO-clip and GSPO with the weights ----------------------------------------------------------

def test_ppo_with_weights_by_hand():
    """PPO, token-mean, A = 2, ε = 0.2, π = 0.5 at both tokens. Token 1: old = log 0.25 → ρ = 2, clipped
    to 1.2: ℓ = −min(4, 2.4) = −2.4; μ = log(0.25/3) → w = 3. Token 2: old = log 0.5 → ρ = 1: ℓ = −2;
    μ = log 1 → w = 0.5.
      token truncate [0, 2]:  (2·(−2.4) + 0.5·(−2)) / 2 = −2.9
      token mask [0, 2]:      (0 + 0.5·(−2)) / 2 = −0.5          (the rejected token still counts in the 2)
      sequence (w = 1.5):     1.5·(−2.4 − 2) / 2 = −3.3   (mask or truncate: inside)"""
    seq = torch.tensor([0, 1, 1])
    logits = torch.zeros(3, 2, dtype=torch.float64)
    old = [torch.tensor([NAN, LN(0.25), LN(0.5)], dtype=torch.float64)]
    mu = [torch.tensor([NAN, LN(0.25 / 3), 0.0], dtype=torch.float64)]
    mask = [torch.tensor([False, True, True])]
    adv = torch.tensor([2.0])
    for level, mode, want in (("token", "truncate", -2.9), ("token", "mask", -0.5), ("sequence", "truncate", -3.3),
                              ("sequence", "mask", -3.3), ("none", "truncate", -2.2)):
        cfg = PPOClipConfig(is_level=level, is_mode=mode)
        got = naive_loss(cfg, [logits], [seq], mask, adv, old, rollout_logprobs=mu)
        assert abs(float(got) - want) < 1e-12, (level, mode)
        obj = build_objective(cfg, sequences=[seq], completion_mask=mask, advantages=adv, old_logprobs=old,
                              rollout_logprobs=mu)
        total = streamed_total(obj, logits.clone(), [seq], [torch.arange(3)], 2, torch.Generator().manual_seed(0))
        assert abs(float(total) - want) < 1e-12, (level, mode)


IS_CONFIGS = [
    PPOClipConfig(is_level="token", is_cap_low=0.8, is_cap_high=1.25),
    PPOClipConfig(is_level="token", is_mode="mask", is_cap_low=0.8, is_cap_high=1.25, dual_clip=3.0),
    PPOClipConfig(is_level="sequence", is_cap_low=0.5, aggregation="seq-mean-token-mean", kl_coef=0.1,
                  entropy_coef=0.05),
    PPOClipConfig(is_level="sequence", is_mode="mask", is_cap_low=0.5, aggregation="seq-mean-token-sum-norm",
                  max_len_norm=16),
    GSPOConfig(is_level="sequence", is_cap_low=0.5, eps_low=0.1, eps_high=0.1, kl_coef=0.1),
    GSPOConfig(is_level="sequence", is_mode="mask", is_cap_low=0.5, eps_low=0.1, eps_high=0.1, entropy_coef=0.05),
]
CFG_ID = lambda c: f"{c.type}-{c.is_level}-{c.is_mode}"  # noqa: E731


@pytest.mark.parametrize("cfg", IS_CONFIGS, ids=CFG_ID)
@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_terms_match_the_naive_loss(cfg, use_old, seed):
    """Advantages +0.7, −1.3, 0, +0.4; μ = π_old + noise of std 0.3 per token (some weights inside the caps,
    some outside); block terms over random partitions vs naive_loss: gradient (and value for PPO)."""
    seqs, pos_index, mask, logits, adv, old_noise, ref_noise, g = problem(seed)
    base = current_logprobs(logits, seqs, pos_index, [m.clone() for m in mask])
    old = [torch.nan_to_num(b) + 0.1 * n for b, n in zip(base, old_noise)] if use_old else None
    ref = [torch.nan_to_num(b) + n for b, n in zip(base, ref_noise)]
    pi_old = old or base
    mu = [torch.where(m, o - torch.randn(len(o), generator=g, dtype=torch.float64) * 0.3, NAN)
          for o, m in zip(pi_old, mask)]
    leaf = logits.clone().requires_grad_(True)
    want = naive_loss(cfg, [leaf[p] for p in pos_index], seqs, mask, adv, old, ref, rollout_logprobs=mu)
    (g_ref,) = torch.autograd.grad(want, leaf)
    obj = build_objective(cfg, sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old,
                          ref_logprobs=ref, rollout_logprobs=mu)
    assert obj.needs_prefill_logprobs == (cfg.type == "gspo" or not use_old)
    leaf2 = logits.clone().requires_grad_(True)
    got = streamed_total(obj, leaf2, seqs, pos_index, 1 + seed * 2, g)
    (g_got,) = torch.autograd.grad(got, leaf2)
    assert torch.allclose(g_got, g_ref, atol=1e-12, rtol=1e-10)
    if cfg.type == "ppo_clip":
        assert abs(float(got.detach()) - float(want.detach())) < 1e-12
    m = obj.metrics()
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["is/weight_mean"] > 0 and 0 <= m["is/truncated_frac"] <= 1


def test_zero_advantage_sequences_keep_metrics_finite():
    """GSPO/PPO with old_logprobs given and a zero-advantage sequence (never computed by the prefill):
    no NaN in the metrics (the trainer skips a step whose loss terms are not finite)."""
    seqs, pos_index, mask, logits, adv, old_noise, _, g = problem(3)
    base = current_logprobs(logits, seqs, pos_index, [m.clone() for m in mask])
    old = [torch.nan_to_num(b) + 0.01 * n for b, n in zip(base, old_noise)]
    for cfg in (GSPOConfig(), GSPOConfig(is_level="sequence"), PPOClipConfig(is_level="sequence")):
        obj = build_objective(cfg, sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old,
                              rollout_logprobs=old)
        streamed_total(obj, logits.clone(), seqs, pos_index, 2, g)
        m = obj.metrics()
        assert all(math.isfinite(v) for v in m.values()), (cfg, m)
    assert m["is/weight_mean"] == 1.0  # μ = π_old: every weight is 1
    # on-policy ratios are 1: their mean is over the tokens with a policy term, not diluted by the others
    obj = build_objective(PPOClipConfig(), sequences=seqs, completion_mask=mask, advantages=adv)
    streamed_total(obj, logits.clone(), seqs, pos_index, 2, g)
    assert obj.metrics()["ratio_mean"] == pytest.approx(1.0, rel=1e-12)


def test_plain_ppo_needs_no_setup():
    """Without a mismatch correction PPO has no `setup`, so the naive reference skips its extra pass."""
    seqs, _, mask, _, adv, *_ = problem(0)
    obj = build_objective(PPOClipConfig(), sequences=seqs, completion_mask=mask, advantages=adv, rollout_logprobs=None)
    assert type(obj) is PPOClipObjective and type(obj).setup is Objective.setup and not obj.needs_prefill_logprobs
    obj = build_objective(PPOClipConfig(is_level="token"), sequences=seqs, completion_mask=mask, advantages=adv,
                          rollout_logprobs=[torch.zeros(len(s)) for s in seqs])
    assert type(obj) is PPOClipISObjective and obj.needs_prefill_logprobs
    with pytest.raises(ValueError, match="old_logprobs"):
        obj.setup(None)  # the caller supplied the K/V: no prefill, and no π_old given


# --- the streamed engine against the naive backward, float64 -------------------------------------


ENGINE_CONFIGS = [
    PPOClipConfig(is_level="token", is_cap_low=0.8, is_cap_high=1.25),
    PPOClipConfig(is_level="token", is_mode="mask", is_cap_low=0.8, is_cap_high=1.25),
    PPOClipConfig(is_level="sequence", is_cap_low=0.5),
    PPOClipConfig(is_level="sequence", is_mode="mask", is_cap_low=0.5),
    GSPOConfig(is_level="sequence", is_cap_low=0.5, eps_low=0.2, eps_high=0.2),
    GSPOConfig(is_level="sequence", is_mode="mask", is_cap_low=0.5, eps_low=0.2, eps_high=0.2),
]


@pytest.mark.parametrize("cfg", ENGINE_CONFIGS, ids=CFG_ID)
def test_stream_backward_matches_reference(cfg):
    """Qwen3 (float64): π_old from the prefill (PPO, GSPO) and given (PPO); μ shifted per sequence by
    log-weights +1.5, −0.1, +0.2, −2.0, +0.4 spread over its tokens (caps [0.5, 2]: two sequences
    outside) plus per-token noise of std 0.3 (caps [0.8, 1.25]: tokens on both sides)."""
    model = make("qwen3")
    seqs, mask, adv, gen = engine_problem()
    cur = engine_logprobs(model, seqs, mask)
    for old in ([None] if cfg.type == "gspo" else [None, [c + 0.05 for c in cur]]):
        base = cur if old is None else old
        mu = []
        for b, m, shift in zip(base, mask, (1.5, -0.1, 0.2, -2.0, 0.4)):
            noise = torch.randn(len(b), generator=gen, dtype=torch.float64) * 0.3
            noise[m] -= noise[m].mean()  # Σ over the completion: exactly the shift
            mu.append(torch.where(m, b - shift / int(m.sum()) - noise, NAN))
        m = assert_streamed_equals_reference(model, cfg, seqs, completion_mask=mask, advantages=adv,
                                             old_logprobs=old, rollout_logprobs=mu)
        share = m.get("is/truncated_frac", 0.0) + m.get("is/token_masked_frac", 0.0) + m.get("is/seq_masked_frac", 0.0)
        assert 0 < share < 1, m  # some weights inside the caps, some outside


# --- telemetry -----------------------------------------------------------------------------------

def test_mismatch_metrics_by_hand():
    """Sequence 0: completion tokens 1..3; token 3 not computed by the learner (NaN). log r = log 2 and 0:
    k3 = (2 − 1 − log 2) and 0 → mean 0.1534264; |log r| mean log(2)/2; max ratio 2. Sequence 1: the
    sampler's −inf is not finite, left out; its other token log r = −log 2: k3 = 0.5 − 1 + log 2.
    Sequence 2: None (no learner log-probs), skipped."""
    learner = [torch.tensor([NAN, LN(0.5), LN(0.25), NAN]), torch.tensor([NAN, LN(0.2), LN(0.25)]), None]
    sampler = [torch.tensor([NAN, LN(0.25), LN(0.25), LN(0.5)]), torch.tensor([NAN, -math.inf, LN(0.5)]),
               torch.tensor([0.0, 0.0])]
    mask = [torch.tensor([False, True, True, True]), torch.tensor([False, True, True]), torch.tensor([False, True])]
    m = mismatch_metrics(learner, sampler, mask)
    k3 = [2 - 1 - LN(2), 0.0, 0.5 - 1 + LN(2)]
    assert m["mismatch/tokens"] == 3
    assert abs(m["mismatch/kl"] - sum(k3) / 3) < 1e-7  # float32 inputs
    assert abs(m["mismatch/abs_log_ratio/mean"] - 2 * LN(2) / 3) < 1e-7
    assert abs(m["mismatch/logprob_abs"] - (LN(2) / 2 + LN(2)) / 2) < 1e-7  # per response, then over responses
    assert abs(m["mismatch/ratio/max"] - 2.0) < 1e-6
    assert mismatch_metrics([None], sampler[:1], mask[:1]) == {"mismatch/tokens": 0.0}
    same = mismatch_metrics(sampler[:1], sampler[:1], mask[:1])
    assert same["mismatch/kl"] == 0.0 and same["mismatch/ratio/max"] == 1.0


def test_repeated_ngram():
    loop = torch.tensor([5, 6, 7] * 4)  # (5,6,7) occurs 4 times, (6,7,5) 3 times
    assert repeated_ngram(loop, n=3, min_count=4) and repeated_ngram(loop, n=3, min_count=3)
    assert not repeated_ngram(loop, n=3, min_count=5)
    assert not repeated_ngram(torch.tensor([1, 2, 3, 9, 1, 2, 3]), n=3, min_count=3)  # twice only
    assert repeated_ngram(torch.tensor([4] * 10), n=8, min_count=3)  # 3 overlapping windows of 8
    assert not repeated_ngram(torch.tensor([4] * 9), n=8, min_count=3)  # 2 windows
    assert not repeated_ngram(torch.tensor([1, 2]), n=8, min_count=3)  # shorter than n
    # the defaults (n = 16, 4 times): a garbled loop of period 12 in a 64-token completion is found; a
    # 16K-token text that never repeats a 16-gram 4 times is not, though it repeats 8-grams
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(100, 200, (12,), generator=gen)
    looped = torch.cat([torch.randint(0, 100, (10,), generator=gen), head.repeat(5)[:54]])
    assert len(looped) == 64 and repeated_ngram(looped)
    phrase = torch.arange(1000, 1008)  # an 8-token phrase said 3 times per 1K tokens
    text = torch.randint(0, 50_000, (16_000,), generator=gen)
    for k in range(0, 16_000, 350):
        text[k:k + 8] = phrase
    assert repeated_ngram(text, n=8, min_count=3) and not repeated_ngram(text)
    assert error_token_share([looped, text, torch.tensor([1])]) == pytest.approx(1 / 3)
    assert error_token_share([]) == 0.0
    with pytest.raises(ValueError, match="min_count"):
        repeated_ngram(loop, n=3, min_count=1)


def test_repeated_ngram_is_exact_under_hash_collisions():
    """Every window hashed alike: the exact comparison of the candidates still decides."""
    zero = torch.zeros(64, dtype=torch.long)
    assert not repeated_ngram(torch.arange(100), n=4, min_count=3, hash_mult=zero)
    assert not repeated_ngram(torch.tensor([1, 2, 3, 9, 1, 2, 3]), n=3, min_count=3, hash_mult=zero)
    assert repeated_ngram(torch.tensor([7, 5, 6, 7, 5, 6, 7, 5, 6, 7]), n=3, min_count=3, hash_mult=zero)


# --- config and input errors ---------------------------------------------------------------------

@pytest.mark.parametrize("cls, kwargs, match", [
    (PPOClipConfig, {"is_level": "tok"}, "loss.is_level"),
    (PPOClipConfig, {"is_level": "token", "is_mode": "clip"}, "loss.is_mode"),
    (PPOClipConfig, {"is_cap_low": 2.0, "is_cap_high": 2.0}, "loss.is_cap_low"),
    (PPOClipConfig, {"is_cap_low": -0.1}, "loss.is_cap_low"),
    (PPOClipConfig, {"is_cap_high": math.inf}, "loss.is_cap_high"),
    (PPOClipConfig, {"is_cap_high": math.nan}, "loss.is_cap_high"),
    (GSPOConfig, {"is_level": "token"}, "loss.is_level"),
    (GSPOConfig, {"is_cap_low": 3.0}, "loss.is_cap_low"),
])
def test_config_errors_name_the_field(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_input_errors():
    seqs, _, mask, _, adv, *_ = problem(0)
    kw = dict(sequences=seqs, completion_mask=mask, advantages=adv)
    with pytest.raises(ValueError, match="rollout_logprobs.*is_level"):
        build_objective(PPOClipConfig(is_level="token"), **kw)
    with pytest.raises(ValueError, match="rollout_logprobs: expected 4 entries"):
        build_objective(GSPOConfig(is_level="sequence"), **kw, rollout_logprobs=[torch.zeros(3)])
    with pytest.raises(ValueError, match="rollout_logprobs: expected one log-prob per token"):
        build_objective(GSPOConfig(is_level="sequence"), **kw, rollout_logprobs=[torch.zeros(3) for _ in seqs])
    # a NaN where the weight is needed (sequence 0, completion token 5)
    mu = [torch.zeros(len(s), dtype=torch.float64) for s in seqs]
    mu[0][5] = NAN
    obj = build_objective(PPOClipConfig(is_level="sequence"), **kw, rollout_logprobs=mu)
    with pytest.raises(ValueError, match="rollout_logprobs: NaN at token 5 of sequence 0"):
        obj.setup([torch.full((len(s),), -1.0, dtype=torch.float64) for s in seqs])
    with pytest.raises(TypeError, match="config"):
        build_objective(object(), **kw)


def test_staleness_counts_the_versions_behind_over_the_sampled_tokens():
    """rollout/staleness_*: learner_version − version over every token the policy sampled (inserted
    episode tokens and prompts left out), by hand: sample 0 sampled at versions 3, 3, 2 (the learner at
    4: 1, 1, 2 behind); sample 1 at 4, 4 with its middle token inserted (0, 0): 5 tokens, mean 4/5, max 2.
    A fork (an agent's branch) counts its own sampled tokens. In process (no versions): 0 behind."""
    from backstream.rl.records import Fork, Samples
    from backstream.rl.update.offpolicy import staleness_metrics

    r = Samples(prompt_index=[0, 0], prompt_ids=[torch.tensor([5]), torch.tensor([5, 6])],
                completion_ids=[torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])], logprobs=[torch.zeros(3)] * 2,
                finish_reason=["eos"] * 2, group_size=2,
                sampled=[torch.tensor([True, True, True]), torch.tensor([True, False, True])],
                weight_version=[torch.tensor([3, 3, 2]), torch.tensor([4, 1, 4])])
    rows = r.training(4)
    assert staleness_metrics(rows.behind, rows.mask) == {"rollout/staleness_mean": 4 / 5,
                                                         "rollout/staleness_max": 2.0}
    r.forks = [[Fork(torch.tensor([5, 1, 9]), torch.tensor([False, False, True]), torch.zeros(3),
                     torch.tensor([-1, -1, 1]))], []]
    rows = r.training(4)
    assert rows.owner == [0, 1, 0] and rows.rows_of(2) == [[0, 2], [1]]
    assert staleness_metrics(rows.behind, rows.mask) == {"rollout/staleness_mean": 7 / 6,
                                                         "rollout/staleness_max": 3.0}
    r.weight_version, r.forks = None, None
    assert staleness_metrics(*(lambda x: (x.behind, x.mask))(r.training(7))) == {
        "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    assert staleness_metrics([], [])["rollout/staleness_max"] == 0.0


def test_mismatch_per_staleness_against_a_per_token_loop():
    """mismatch/kl_staleness_s: the k3 estimate e^x − 1 − x (x = log π_old − log μ) averaged over the
    tokens s versions behind, against a float64 loop over the tokens; None where no token is s behind;
    the prompt (behind −1), masked tokens and NaN log-probs (the learner's gaps) are left out."""
    from backstream.rl.records import Samples
    from backstream.rl.update.offpolicy import staleness_mismatch

    gen = torch.Generator().manual_seed(3)
    r = Samples(prompt_index=[0, 0, 1], prompt_ids=[torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([3])],
                completion_ids=[torch.arange(5), torch.arange(3), torch.arange(4)],
                logprobs=[-torch.rand(n, generator=gen, dtype=torch.float64) for n in (5, 3, 4)],
                finish_reason=["eos"] * 3, group_size=1,
                weight_version=[torch.tensor([5, 5, 6, 6, 6]), torch.tensor([6, 6, 6]), torch.tensor([4, 4, 5, 5])])
    behind = r.behind(6)
    assert [b.tolist() for b in behind] == [[-1, -1, 1, 1, 0, 0, 0], [-1, -1, 0, 0, 0], [-1, 2, 2, 1, 1]]
    sampler, mask = r.aligned_logprobs(), r.completion_mask()
    mask[0][3] = False  # a token without loss (an inserted one)
    learner = [s + 0.1 * torch.randn(len(s), generator=gen, dtype=torch.float64) for s in sampler]
    learner[1][3] = math.nan  # the learner computed nothing there
    got = staleness_mismatch(learner, sampler, mask, behind, 3)
    for s in range(4):
        terms = [math.expm1(float(a[t] - b[t])) - float(a[t] - b[t])
                 for a, b, m, bh in zip(learner, sampler, mask, behind) for t in range(len(a))
                 if m[t] and bh[t] == s and math.isfinite(float(a[t] - b[t]))]
        want = sum(terms) / len(terms) if terms else None
        assert (got[f"mismatch/kl_staleness_{s}"] is None) == (want is None)
        if want is not None:
            assert got[f"mismatch/kl_staleness_{s}"] == pytest.approx(want, rel=1e-12, abs=0)
    assert got["mismatch/kl_staleness_3"] is None and staleness_mismatch(learner, sampler, mask, behind, 0) == {}
