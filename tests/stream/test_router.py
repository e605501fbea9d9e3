"""The MoE router load-balancing loss: the naive form against transformers' own, and the streamed
engine (shared prefixes counted once per sequence that contains them) against the reference."""

import pytest
import torch
from helpers import MOE, VOCAB, group_batch, lora, make
from transformers.models.qwen3_moe import modeling_qwen3_moe

from backstream import TokenWeights, reference_backward, stream_backward
from backstream.stream.hf import returned_cache
from backstream.stream.router import load_balancing_loss, load_balancing_sums
from backstream.stream.verify import relative_errors

TOL = 1e-10


def run(fn, model, seqs, weights, coef, **kw):
    model.zero_grad(set_to_none=True)
    res = fn(model, seqs, objective=TokenWeights(weights, router_aux_coef=coef), **kw)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, res


def assert_close(g, g_ref, tol=TOL):
    assert g.keys() == g_ref.keys() and g
    for n, err in relative_errors(g, g_ref).items():
        assert err <= tol, f"{n}: relative error {err:.3g}"


def test_naive_loss_is_transformers_loss():
    """Our textbook form = transformers' `load_balancing_loss_func` = the model's own aux_loss on a
    padded batch (float32: transformers accumulates in float32)."""
    model = make("qwen3-moe", dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 12, 4)]
    per_seq = [model(input_ids=s[None], output_router_logits=True).router_logits for s in seqs]
    cat = tuple(torch.cat(layer) for layer in zip(*per_seq))
    ours = load_balancing_loss(cat, 4, 2).detach()
    theirs = modeling_qwen3_moe.load_balancing_loss_func(cat, 4, 2).detach()
    L = max(len(s) for s in seqs)
    ids = torch.stack([torch.nn.functional.pad(s, (0, L - len(s))) for s in seqs])
    mask = torch.stack([torch.arange(L) < len(s) for s in seqs]).long()
    padded = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.detach()
    assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    assert abs(float(ours) - float(padded)) <= 1e-5 * float(theirs)
    assert float(ours) > 1.0  # E·Σ f·P ≥ top_k·… > 1 unless perfectly balanced: a real value, not 0


def test_summed_form_is_the_naive_loss_in_one_process():
    """load_balancing_sums (the form whose counts an all-reduce can sum over ranks) gives, in one
    process, the naive loss's value and gradient; with no rows it contributes nothing."""
    model = make("qwen3-moe")
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 5, 11)]
    grads = []
    for form in ("naive", "sums"):
        model.zero_grad(set_to_none=True)
        per_seq = [model(input_ids=s[None], output_router_logits=True).router_logits for s in seqs]
        cat = tuple(torch.cat(layer) for layer in zip(*per_seq))
        if form == "naive":
            loss = 0.7 * load_balancing_loss(cat, 4, 2)
            value = float(loss.detach()) / 0.7
        else:
            loss, got = load_balancing_sums(cat, 4, 2, 0.7)
            assert abs(got - value) <= 1e-14 * value and abs(float(loss.detach()) - 0.7 * value) <= 1e-14
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_close(grads[1], grads[0], 1e-12)
    assert any("gate" in n for n in grads[0])
    empty, _ = load_balancing_sums((), 4, 2, 0.7)
    assert float(empty) == 0.0


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_streamed_router_loss_matches_reference(family, use_lora, block_size):
    """Groups, a duplicate, a second turn, a one-token and zero-weight sequences: every token of
    every sequence counts, shared ones once per sequence."""
    model = make(family)
    if use_lora:
        model = lora(model)
    gen = torch.Generator().manual_seed(5)
    seqs, weights = group_batch(gen)
    seqs.append(seqs[0][:6].clone())  # a strict prefix of another sequence: its path ends inside a node
    weights.append(torch.zeros(6, dtype=torch.float64))
    g_ref, r_ref = run(reference_backward, model, seqs, weights, 0.7)
    g, r = run(stream_backward, model, seqs, weights, 0.7, block_size=block_size)
    assert_close(g, g_ref)
    assert abs(r.stats.router_aux_loss - r_ref.stats.router_aux_loss) <= 1e-12
    # the router term changes the gradient (the test would pass vacuously otherwise)
    g0, _ = run(stream_backward, model, seqs, weights, 0.0, block_size=block_size)
    diff = max(float((g[n] - g0[n]).norm() / g[n].norm()) for n in g if n in g0)
    assert diff > 1e-3
    # zero-weight sequences are forwarded now: their router logits carry gradient
    assert r.stats.backward_tokens == r.stats.tree_tokens


def test_router_loss_alone_counts_shared_prompt_per_sequence():
    """Only the router loss (all weights 0): G responses to one prompt must weigh the prompt G times,
    and dropping the multiplicity would be caught: compare with a tree where the prompt is shared once."""
    model = make("qwen3-moe")
    gen = torch.Generator().manual_seed(8)
    P = torch.randint(0, VOCAB, (10,), generator=gen)
    seqs = [torch.cat([P, torch.randint(0, VOCAB, (n,), generator=gen)]) for n in (3, 5, 2, 4)]
    weights = [torch.zeros(len(s), dtype=torch.float64) for s in seqs]
    g_ref, r_ref = run(reference_backward, model, seqs, weights, 1.0)
    g, r = run(stream_backward, model, seqs, weights, 1.0, block_size=4)
    assert_close(g, g_ref)
    assert r.stats.tree_tokens == 10 + 3 + 5 + 2 + 4  # the prompt is forwarded once
    # the value itself, from the naive form over the concatenated per-sequence logits
    with torch.no_grad():
        per_seq = [model(input_ids=s[None], output_router_logits=True).router_logits for s in seqs]
    naive = load_balancing_loss(tuple(torch.cat(layer) for layer in zip(*per_seq)), 4, 2)
    assert abs(r.stats.router_aux_loss - float(naive)) <= 1e-12


def test_router_loss_refuses_bad_input():
    dense = make("llama")
    seqs = [torch.arange(1, 6)]
    w = [torch.tensor([0.0, 1, 1, 1, 1], dtype=torch.float64)]
    with pytest.raises(ValueError, match="router_aux_coef.*not a mixture-of-experts"):
        stream_backward(dense, seqs, objective=TokenWeights(w, router_aux_coef=0.1))
    with pytest.raises(ValueError, match="router_aux_coef.*not a mixture-of-experts"):
        reference_backward(dense, seqs, objective=TokenWeights(w, router_aux_coef=0.1))
    moe = make("qwen3-moe")
    with pytest.raises(ValueError, match="router_aux_coef: expected a finite number"):
        stream_backward(moe, seqs, objective=TokenWeights(w, router_aux_coef=-1.0))
    for fn in (stream_backward, reference_backward):  # one validation: both refuse NaN alike
        with pytest.raises(ValueError, match="router_aux_coef: expected a finite number"):
            fn(moe, seqs, objective=TokenWeights(w, router_aux_coef=float("nan")))
    with torch.no_grad():
        cache = returned_cache(moe(input_ids=seqs[0][None], use_cache=True))
    with pytest.raises(ValueError, match="kv: the router load-balancing loss"):
        stream_backward(moe, seqs, objective=TokenWeights(w, router_aux_coef=0.1), kv=[cache])
    assert all(p.grad is None for p in moe.parameters())
