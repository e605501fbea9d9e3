"""RL objectives: summed block terms over random partitions == the textbook loss (values for the
token-level losses, gradients for all), advantage estimators by hand."""

import math

import pytest
import torch
from helpers import current_logprobs, problem
from hypothesis import given, settings
from hypothesis import strategies as st

from backstream.rl.scoring.advantages import drgrpo_advantages, grpo_advantages, rloo_advantages
from backstream.rl.update.losses import GSPOConfig, PPOClipConfig, build_objective, naive_loss
from backstream.stream.objective import BlockView, flat_offsets

V = 7


def streamed(cfg, logits_leaf, seqs, pos_index, mask, adv, old, ref, parts, g, temperature_logits=None):
    obj = build_objective(cfg, sequences=seqs, completion_mask=mask, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    active = obj.active(seqs)
    obj.setup(current_logprobs(logits_leaf.detach() / cfg.temperature, seqs, pos_index, active))
    offsets = flat_offsets([len(s) for s in seqs])
    targets = [(i, t) for i, a in enumerate(active) for t in torch.nonzero(a).flatten().tolist()]
    order = torch.randperm(len(targets), generator=g).tolist()
    cuts = sorted(torch.randint(0, len(targets) + 1, (parts - 1,), generator=g).tolist())
    total = 0.0
    for a, b in zip([0] + cuts, cuts + [len(targets)]):
        chunk = [targets[k] for k in order[a:b]]
        if not chunk:
            continue
        pos = [int(pos_index[i][t - 1]) for i, t in chunk]
        uniq = sorted(set(pos))  # a shared position appears once in the view's logits
        view = BlockView(
            logits_PV=logits_leaf[uniq], row_pos_N=torch.tensor([uniq.index(p) for p in pos]),
            target_N=torch.tensor([int(seqs[i][t]) for i, t in chunk]), seq_N=torch.tensor([i for i, _ in chunk]),
            tok_N=torch.tensor([t for _, t in chunk]), flat_N=torch.tensor([offsets[i] + t for i, t in chunk]))
        total = total + obj.block_loss(view)
    return total, obj


CONFIGS = [
    PPOClipConfig(),
    PPOClipConfig(eps_low=0.2, eps_high=0.28),
    PPOClipConfig(aggregation="seq-mean-token-mean", dual_clip=3.0, eps_low=0.1, eps_high=0.1),
    PPOClipConfig(aggregation="seq-mean-token-sum-norm", max_len_norm=8),
    PPOClipConfig(aggregation="seq-mean-token-sum-norm", kl_coef=0.3, kl_estimator="k1"),
    PPOClipConfig(kl_coef=0.2, kl_estimator="k3", entropy_coef=0.05, temperature=0.7),
    GSPOConfig(),
    GSPOConfig(eps_low=0.05, eps_high=0.05, kl_coef=0.1, entropy_coef=0.02),
]


@pytest.mark.parametrize("cfg", CONFIGS,
                         ids=lambda c: f"{c.type}-{getattr(c, 'aggregation', '')}-{c.kl_coef}-{c.entropy_coef}")
@pytest.mark.parametrize("use_old", [False, True])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), parts=st.integers(1, 6))
def test_block_terms_match_the_textbook_loss(cfg, use_old, seed, parts):
    seqs, pos_index, mask, logits, adv, old_noise, ref_noise, g = problem(seed)
    base = current_logprobs(logits / cfg.temperature, seqs, pos_index, [m.clone() for m in mask])
    old = [torch.nan_to_num(b) + n for b, n in zip(base, old_noise)] if use_old else None
    ref = [torch.nan_to_num(b) + n for b, n in zip(base, ref_noise)]
    leaf = logits.clone().requires_grad_(True)
    want = naive_loss(cfg, [leaf[p] for p in pos_index], seqs, mask, adv, old, ref)
    (g_ref,) = torch.autograd.grad(want, leaf)
    leaf2 = logits.clone().requires_grad_(True)
    got, _ = streamed(cfg, leaf2, seqs, pos_index, mask, adv, old, ref, parts, g)
    (g_got,) = torch.autograd.grad(got, leaf2)
    assert torch.allclose(g_got, g_ref, atol=1e-12, rtol=1e-10)
    if cfg.type == "ppo_clip":  # GSPO's block terms are a surrogate with the same gradient
        assert abs(float(got.detach()) - float(want.detach())) < 1e-12


def test_zero_advantage_sequences_are_inactive():
    seqs, pos_index, mask, logits, adv, *_ = problem(0)
    act = build_objective(PPOClipConfig(), sequences=seqs, completion_mask=mask, advantages=adv).active(seqs)
    assert not act[2].any() and act[0].any()
    obj = build_objective(PPOClipConfig(entropy_coef=0.1), sequences=seqs, completion_mask=mask, advantages=adv)
    act = obj.active(seqs)
    assert act[2].any()  # an entropy term reads it


def test_one_sequence_two_tokens_by_hand():
    """PPO, token-mean, A = 2, ε = 0.2. Token 1: log π = log 0.5, old = log 0.25 → ρ = 2,
    clipped to 1.2: ℓ = −min(4, 2.4) = −2.4. Token 2: log π = log 0.5, old = log 0.5 → ρ = 1:
    ℓ = −2. Mean over 2 tokens: −2.2."""
    seq = torch.tensor([0, 1, 1])
    logits = torch.zeros(3, 2, dtype=torch.float64)  # uniform over 2 tokens: π = 0.5
    old = [torch.tensor([0.0, math.log(0.25), math.log(0.5)], dtype=torch.float64)]
    mask = [torch.tensor([False, True, True])]
    loss = naive_loss(PPOClipConfig(), [logits], [seq], mask, torch.tensor([2.0]), old)
    assert abs(float(loss) + 2.2) < 1e-12


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0])
    # group 1: mean 1/3, unbiased std sqrt(1/3): (2/3)/0.57735 = 1.1547; group 2: mean 7/3
    a = grpo_advantages(r, 3, eps=0.0)
    assert torch.allclose(a[:3], torch.tensor([1.1547005, -0.5773503, -0.5773503]), atol=1e-6)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -4 / 3, 2 / 3, 2 / 3])
    assert torch.allclose(drgrpo_advantages(r, 3), expected, atol=1e-6)
    # RLOO: 1 − (0+0)/2 = 1; 0 − (1+0)/2 = −0.5
    assert torch.allclose(rloo_advantages(r, 3)[:3], torch.tensor([1.0, -0.5, -0.5]))
    assert torch.equal(grpo_advantages(torch.ones(4), 2), torch.zeros(4))  # no signal, no NaN
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(r, 4)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(r, 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"aggregation": "mean"}, "loss.aggregation"), ({"dual_clip": 0.5}, "loss.dual_clip"),
    ({"kl_estimator": "k2"}, "loss.kl_estimator"), ({"temperature": 0.0}, "loss.temperature"),
    ({"eps_low": -0.1}, "eps_low"),
])
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOClipConfig(**kwargs)


def test_kl_needs_reference_logprobs():
    seqs, pos_index, mask, logits, adv, *_ = problem(1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        build_objective(PPOClipConfig(kl_coef=0.1), sequences=seqs, completion_mask=mask, advantages=adv)
