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
    PPOClipConfig(aggregation="seq-mean-token-sum-norm", max_len_norm="minibatch", kl_coef=0.3, kl_estimator="k1"),
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


# -- Dr.GRPO's normaliser and the advantage's ε (issue 56) ------------------------------------------------

def drgrpo_problem(tail: int):
    """Two sequences of 3 prompt tokens: A's 4 completion tokens with advantage 1.5, B's `tail` with
    advantage 0 (B only changes the minibatch's lengths). float64 logits, one row a position."""
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]  # A the same whatever B's length
    lens = [3 + 4, 3 + tail]
    seqs = [torch.randint(0, V, (n,), generator=g) for n, g in zip(lens, gens)]
    logits = [torch.randn(n, V, generator=g, dtype=torch.float64) for n, g in zip(lens, gens)]
    mask = [torch.arange(n) >= 3 for n in lens]
    return seqs, logits, mask, torch.tensor([1.5, 0.0], dtype=torch.float64)


def grad_of_a(cfg, tail: int) -> torch.Tensor:
    """The gradient of the loss at A's logits, the loss streamed in blocks (`streamed`, as the engine
    runs it) against the textbook one (`naive_loss`), which must agree."""
    seqs, logits, mask, adv = drgrpo_problem(tail)
    leaf = [x.clone().requires_grad_(True) for x in logits]
    (want,) = torch.autograd.grad(naive_loss(cfg, leaf, seqs, mask, adv), leaf[0])
    pos_index = [torch.arange(len(s)) + sum(len(t) for t in seqs[:i]) for i, s in enumerate(seqs)]
    flat = torch.cat(logits).requires_grad_(True)
    got, _ = streamed(cfg, flat, seqs, pos_index, mask, adv, None, None, 2, torch.Generator().manual_seed(0))
    (g_flat,) = torch.autograd.grad(got, flat)
    assert torch.allclose(g_flat[:len(seqs[0])], want, atol=1e-13, rtol=0)
    return want


def test_dr_grpo_gradient_of_a_completion_does_not_move_when_another_grows():
    """seq-mean-token-sum-norm divides by a constant (the generation budget): A's gradient is the same
    whether B, in the same minibatch, has 2 or 9 completion tokens; with "minibatch" (the longest
    completion of the minibatch, the old default) it shrinks as B grows past A, 4/9 of itself."""
    const = PPOClipConfig(aggregation="seq-mean-token-sum-norm", max_len_norm=16)
    assert torch.equal(grad_of_a(const, 2), grad_of_a(const, 9))
    old = PPOClipConfig(aggregation="seq-mean-token-sum-norm", max_len_norm="minibatch")
    short, long = grad_of_a(old, 2), grad_of_a(old, 9)
    assert torch.allclose(long, short * 4 / 9, atol=1e-15, rtol=1e-12)


def test_dr_grpo_unset_is_the_generation_budget_and_equals_trls_dr_grpo():
    """A run with max_len_norm unset divides by rollout.max_new_tokens, stated in its config (an episode:
    env.max_turns x rollout.max_new_tokens, at most env.max_episode_tokens); the loss is TRL's dr_grpo,
    Σ per-token loss / (sequences × max_completion_length), written out here from TRL's formula."""
    from backstream import config

    cfg = config.load(None, ['loss.aggregation="seq-mean-token-sum-norm"', "rollout.max_new_tokens=12"])
    assert cfg.loss.max_len_norm is None and cfg.with_run_defaults().loss.max_len_norm == 12
    assert config.load(None).with_run_defaults().loss.max_len_norm is None  # token-mean: nothing to state
    episodes = config.load(None, ['loss.aggregation="seq-mean-token-sum-norm"', 'data.task="toolcalc"'])
    assert episodes.generation_budget() == 4 * 32  # toolcalc's env.max_turns x its rollout.max_new_tokens
    capped = config.load(None, ['data.task="toolcalc"', "env.max_episode_tokens=100"])
    assert capped.generation_budget() == 100
    seqs, logits, mask, _ = drgrpo_problem(6)
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    noise = torch.Generator().manual_seed(5)
    old = []  # π_old of token t, 0.3 away from π in log space: some ratios clip on each side
    for x, s in zip(logits, seqs):
        o = torch.zeros(len(s), dtype=torch.float64)
        o[1:] = torch.log_softmax(x[:-1], -1).gather(-1, s[1:, None])[:, 0]
        old.append(o + 0.3 * torch.randn(len(s), generator=noise, dtype=torch.float64))
    got = naive_loss(cfg.with_run_defaults().loss, logits, seqs, mask, adv, old)
    # TRL: per_token_loss = -min(ρA, clip(ρ)A); (per_token_loss * completion_mask).sum() / (B * max_completion_length)
    total = 0.0
    for x, s, m, a, o in zip(logits, seqs, mask, adv, old):
        t = torch.nonzero(m).flatten()
        logp = torch.log_softmax(x[t - 1], -1).gather(-1, s[t, None])[:, 0]
        ratio = torch.exp(logp - o[t])
        total += (-torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)).sum()
    assert abs(float(got) - float(total / (2 * 12))) < 1e-14


def test_dr_grpo_built_by_hand_without_its_length_is_refused():
    seqs, logits, mask, adv = drgrpo_problem(2)
    with pytest.raises(ValueError, match="loss.max_len_norm"):
        naive_loss(PPOClipConfig(aggregation="seq-mean-token-sum-norm"), logits, seqs, mask, adv)
    for bad in (0, "longest", 2.5):
        with pytest.raises(ValueError, match="loss.max_len_norm"):
            PPOClipConfig(aggregation="seq-mean-token-sum-norm", max_len_norm=bad)


def test_the_advantage_eps_is_a_key_of_algorithm():
    """algorithm.eps is grpo's ε: at a group std of 1e-3, TRL's 1e-4 gives an advantage 10% below 1e-6's."""
    from backstream.rl.scoring.advantages import AlgorithmConfig

    r = torch.tensor([0.0, 0.0, 0.0, 0.002])  # std 1e-3
    ours, trls = AlgorithmConfig().advantages(r, 4), AlgorithmConfig(eps=1e-4).advantages(r, 4)
    std = float(r.std())
    assert AlgorithmConfig().eps == 1e-6 and abs(float(ours[3]) - 0.0015 / (std + 1e-6)) < 1e-4
    assert abs(float(trls[3]) - 0.0015 / (std + 1e-4)) < 1e-4 and 0.08 < 1 - float(trls[3] / ours[3]) < 0.1
    assert torch.equal(AlgorithmConfig(advantage="drgrpo", eps=1.0).advantages(r, 4), drgrpo_advantages(r, 4))
    for bad in (0, -1e-6, True):
        with pytest.raises(ValueError, match="algorithm.eps"):
            AlgorithmConfig(eps=bad)
