"""stream_backward against reference_backward in float64, on several HF families, with and without
LoRA, over hand-made and random token trees; and the skips, the K/V hand-over, the planner."""

import math
import warnings

import pytest
import torch
from helpers import FAMILIES, VOCAB, assert_same, grads, group_batch, lora, make, rand_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backstream import Objective, TokenWeights, reference_backward, stream_backward
from backstream.stream import adapter, family
from backstream.stream.hf import returned_cache

warnings.filterwarnings("ignore", category=FutureWarning)
TOL = 1e-10


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_lora", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_equivalence_families(family, use_lora, block_size):
    model = make(family)
    if use_lora:
        model = lora(model)
    gen = torch.Generator().manual_seed(1)
    seqs, weights = group_batch(gen)
    assert_same(model, seqs, weights, block_size=block_size)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_transformers_without_logits_masks_takes_the_blocks_logits(family, monkeypatch):
    """Before transformers 5.2x a model slices `logits_to_keep` as plain positions, and the engine's
    [B, Q] mask failed inside it (5.17: IndexError). Where the model's module has no
    `slice_logits_to_keep`, the engine passes no mask and keeps its positions itself: the same exact
    gradient and log-probs (float64)."""
    from backstream.stream import hf

    model = make(family)
    monkeypatch.setattr(hf, "_slices_by_mask", lambda cls: False)  # as 5.17's modeling files
    assert not hf.takes_logits_mask(model)
    seqs, weights = group_batch(torch.Generator().manual_seed(4))
    assert_same(model, seqs, weights, block_size=3)


def test_lora_frozen_lower_layer():
    """LoRA on layer 1 only: layer 0's K/V need no gradient at all and are left out of the roots."""
    model = lora(make("qwen3"), layers=[1])
    seqs, weights = group_batch(torch.Generator().manual_seed(2))
    assert_same(model, seqs, weights, block_size=4)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("batch_tokens", [4, 1000])
def test_kernels_and_row_caps(kernel, batch_tokens):
    """Both attention kernels, one row per batch and all siblings in one batch."""
    model = make("mistral-window")
    seqs, weights = group_batch(torch.Generator().manual_seed(3), prompt=11, lens=(9, 13, 2, 13, 6))
    assert_same(model, seqs, weights, block_size=4, batch_tokens=batch_tokens, kernel=kernel)


@st.composite
def trees(draw):
    """Random trees: roots, branching continuations, duplicates, prefixes of others."""
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    seqs = [rand_ids(draw(st.integers(1, 12)), gen) for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(0, 6))):
        base = seqs[draw(st.integers(0, len(seqs) - 1))]
        kind = draw(st.sampled_from(["branch", "duplicate", "prefix", "extend"]))
        cut = draw(st.integers(1, len(base)))
        if kind == "branch":
            seqs.append(torch.cat([base[:cut], rand_ids(draw(st.integers(1, 8)), gen)]))
        elif kind == "duplicate":
            seqs.append(base.clone())
        elif kind == "prefix":
            seqs.append(base[:cut].clone())
        else:
            seqs.append(torch.cat([base, rand_ids(draw(st.integers(1, 8)), gen)]))
    weights = []
    for s in seqs:
        mode = draw(st.sampled_from(["dense", "sparse", "zero", "tail"]))
        w = torch.randn(len(s), generator=gen, dtype=torch.float64)
        if mode == "sparse":
            w = w * (torch.rand(len(s), generator=gen) < 0.3)
        elif mode == "zero":
            w.zero_()
        elif mode == "tail":
            w[: len(s) // 2] = 0
        w[0] = 0
        weights.append(w)
    return seqs, weights


_MODELS = {}


def _cached(family):
    if family not in _MODELS:
        _MODELS[family] = make(family)
    return _MODELS[family]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees(), family=st.sampled_from(["qwen3", "mistral-window", "qwen3-mixed-window"]),
       block_size=st.integers(1, 7), batch_tokens=st.integers(1, 30))
def test_random_trees(tree, family, block_size, batch_tokens):
    seqs, weights = tree
    if all((w == 0).all() for w in weights):
        weights[0][-1] = 1.0 if len(weights[0]) > 1 else 0.0
    if all((w == 0).all() for w in weights):
        return
    assert_same(_cached(family), seqs, weights, block_size=block_size, batch_tokens=batch_tokens)


class CountTokens:
    """Counts the tokens the model forwards (all passes of stream_backward), after its once-per-model
    layout probe (`adapter.probe_layout`)."""

    def __init__(self, model):
        adapter.probe_layout(model)
        self.tokens = 0
        self.calls = 0
        model.get_input_embeddings().register_forward_hook(self.hook)

    def hook(self, mod, inp, out):
        self.calls += 1
        self.tokens += inp[0].numel()


def test_zero_weight_sequences_cost_nothing():
    model = make("qwen3")
    gen = torch.Generator().manual_seed(4)
    seqs = [rand_ids(20, gen) for _ in range(3)]
    weights = [torch.zeros(20, dtype=torch.float64) for _ in range(3)]
    weights[1][5:] = torch.randn(15, generator=gen, dtype=torch.float64)
    family.check_default_positions(model, seqs[0])  # the once-per-model probe, before counting
    counter = CountTokens(model)
    r = stream_backward(model, seqs, weights, block_size=8)
    # only sequence 1 is read: its 19 inputs in the backward, and in the prefill all but its last
    # chunk [16, 19), whose K/V no later block reads (token weights need no log-probs in advance)
    assert counter.tokens == 16 + 19
    assert r.stats.active_sequences == 1 and r.stats.prefill_tokens == 16
    assert torch.isnan(r.logprobs[0]).all() and torch.isnan(r.logprobs[2]).all()
    model.zero_grad(set_to_none=True)
    counter.tokens = 0
    r = stream_backward(model, seqs, [torch.zeros(20, dtype=torch.float64)] * 3)
    assert counter.tokens == 0 and r.stats.tree_tokens == 0
    assert all(p.grad is None for p in model.parameters())


def test_trailing_tokens_after_last_loss_are_never_forwarded():
    model = make("qwen3")
    gen = torch.Generator().manual_seed(5)
    seq = rand_ids(64, gen)
    w = torch.zeros(64, dtype=torch.float64)
    w[3:10] = 1.0  # last loss token at index 9: inputs 0..8 only
    family.check_default_positions(model, seq)  # the once-per-model probe, before counting
    counter = CountTokens(model)
    r = stream_backward(model, [seq], [w], block_size=4)
    assert counter.tokens == 8 + 9  # prefill [0, 8) (the tail [8, 9) is read by no one), backward [0, 9)
    assert r.stats.tree_tokens == 9 and r.stats.backward_tokens == 9
    # an objective that reads every log-prob in setup gets a prefill of the whole tree
    model.zero_grad(set_to_none=True)
    counter.tokens = 0
    r = stream_backward(model, [seq], objective=EntropyAndSeqRatio([seq]), block_size=4)
    assert r.stats.prefill_tokens == 63 and counter.tokens == 2 * 63  # inputs 0..62


def test_sliding_window_skips_history_it_cannot_see():
    """Loss on the last tokens only: with window 4 and 2 layers, gradient reaches back at most
    2·(4−1) positions; the blocks before that do nothing, and the result is still exact."""
    model = make("mistral-window")
    gen = torch.Generator().manual_seed(6)
    seq = rand_ids(40, gen)
    w = torch.zeros(40, dtype=torch.float64)
    w[-3:] = torch.randn(3, generator=gen, dtype=torch.float64)
    r = assert_same(model, [seq], [w], block_size=4)
    assert r.stats.blocks_skipped >= 6
    assert r.stats.skipped_tokens >= 24
    # with full attention every block receives gradient and none is skipped
    r_full = assert_same(make("qwen3"), [seq], [w], block_size=4)
    assert r_full.stats.blocks_skipped == 0


def test_shared_prefix_is_one_copy_in_the_batch(monkeypatch):
    """A batch of G rows reads the prompt's K/V as one batch-1 tensor, never G copies."""
    model = make("qwen3")
    gen = torch.Generator().manual_seed(7)
    P = rand_ids(16, gen)
    G = 6
    seqs = [torch.cat([P, rand_ids(5, gen)]) for _ in range(G)]
    weights = [torch.cat([torch.zeros(16), torch.randn(5, generator=gen)]).double() for _ in range(G)]
    seen = []
    real = adapter.merged_attention

    def spy(q, parts, *a, **kw):
        seen.append((q.shape[0], [(p.shared, p.k.shape[0], p.k.shape[2]) for p in parts if p.k.shape[2]]))
        return real(q, parts, *a, **kw)

    monkeypatch.setattr(adapter, "merged_attention", spy)
    assert_same(model, seqs, weights, block_size=8)
    group_calls = [parts for B, parts in seen if B == G]
    assert group_calls, "the G responses never ran as one batch"
    for parts in group_calls:
        shared = [p for p in parts if p[0]]
        assert shared == [(True, 1, 16)]


def test_logits_only_for_predicting_positions():
    """Neither pass materialises [tokens × vocab] logits beyond the targets of one block batch."""
    model = make("qwen3")
    gen = torch.Generator().manual_seed(8)
    seqs = [rand_ids(50, gen) for _ in range(2)]
    weights = []
    for _ in seqs:
        w = torch.zeros(50, dtype=torch.float64)
        w[30:] = 1.0
        weights.append(w)
    rows = []
    family.check_default_positions(model, seqs[0])  # the once-per-model probes, before counting
    adapter.probe_layout(model)
    model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.reshape(-1, o.shape[-1]).shape[0]))
    stream_backward(model, seqs, weights, block_size=8, batch_tokens=8)
    assert max(rows) <= 8  # one row × one block
    # 20 targets per sequence in the backward; the prefill skips each sequence's last chunk [48, 49),
    # whose K/V no block reads, and with it the one target it predicts
    assert sum(rows) == 2 * 20 + 2 * 19


def test_kv_from_caller_skips_the_prefill():
    model = make("qwen3")
    gen = torch.Generator().manual_seed(9)
    seqs, weights = group_batch(gen)
    with torch.no_grad():
        caches = [returned_cache(model(input_ids=s[None], use_cache=True)) for s in seqs]
    assert_same(model, seqs, weights, block_size=3, kv=caches)
    family.check_default_positions(model, seqs[0])  # the once-per-model probe, before counting
    counter = CountTokens(model)
    r = stream_backward(model, seqs, weights, block_size=3, kv=caches)
    assert r.stats.prefill_tokens == 0 and counter.calls == r.stats.batches_run  # one pass only
    # the list-of-(K, V) form, as the rollout returns it
    kv_lists = [[(layer.keys[0], layer.values[0]) for layer in c.layers] for c in caches]
    assert_same(model, seqs, weights, block_size=5, kv=kv_lists)


def test_kv_too_short_is_refused():
    model = make("qwen3")
    seq = torch.arange(10)
    w = torch.zeros(10, dtype=torch.float64)
    w[-1] = 1
    with torch.no_grad():
        cache = returned_cache(model(input_ids=seq[None, :4], use_cache=True))
    with pytest.raises(ValueError, match=r"kv\[0\]\[0\]: covers 4 positions"):
        stream_backward(model, [seq], [w], kv=[cache])


class EntropyAndSeqRatio(Objective):
    """Per-token terms on logits (entropy) plus a sequence-level coefficient from the prefill:
    exercises the objective hook beyond token weights."""

    def __init__(self, seqs):
        self.seqs = seqs
        self.mask = [torch.arange(len(s)) >= 2 for s in seqs]

    def active(self, sequences):
        return self.mask

    def setup(self, logprobs):
        # coefficient per sequence from the detached current log-probs (like GSPO's ratio)
        self.coef = torch.cat([torch.full((len(lp),), float(torch.nanmean(lp).exp())) for lp in logprobs]).double()

    def block_loss(self, view):
        c = self.coef[view.flat_N]
        return (c * view.logprobs() - 0.1 * view.entropy()).sum()


def test_objective_hook_matches_reference():
    model = make("llama")
    gen = torch.Generator().manual_seed(10)
    seqs, _ = group_batch(gen)
    obj = EntropyAndSeqRatio(seqs)
    model.zero_grad(set_to_none=True)
    reference_backward(model, seqs, objective=obj)
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stream_backward(model, seqs, objective=EntropyAndSeqRatio(seqs), block_size=3)
    for a, b in zip((p.grad for p in model.parameters()), g_ref):
        assert (a - b).norm() <= TOL * b.norm()


def test_memory_budget_plans_and_refuses():
    model = make("qwen3")
    gen = torch.Generator().manual_seed(11)
    seqs, weights = group_batch(gen, prompt=30, lens=(40, 40, 40, 40))
    r = stream_backward(model, seqs, weights, memory_budget=2**30)
    assert r.stats.peak_bytes_predicted <= 2**30 and r.stats.block_size >= 16
    small = stream_backward(model, seqs, weights, memory_budget=r.stats.peak_bytes_predicted - 1)
    assert small.stats.peak_bytes_predicted < r.stats.peak_bytes_predicted
    with pytest.raises(ValueError, match="memory_budget"):
        stream_backward(model, seqs, weights, memory_budget=1000)
    assert_same(model, seqs, weights, memory_budget=small.stats.peak_bytes_predicted)


def test_unreadable_config_sizes_only_stop_a_memory_budget(monkeypatch):
    """A config whose sizes cannot be read globally (per-layer attributes): the estimate is only a
    report without a memory budget (the exact gradient, no estimate), and a budget is refused."""
    from backstream.stream import planner

    def unreadable(c):
        raise AttributeError("'num_attention_heads' is a per-layer attribute")

    monkeypatch.setattr(planner, "_read_dims", unreadable)
    model = make("qwen3")
    gen = torch.Generator().manual_seed(12)
    seqs, weights = group_batch(gen, prompt=12, lens=(9, 7))
    assert_same(model, seqs, weights, block_size=4)
    assert stream_backward(model, seqs, weights, block_size=4).stats.peak_bytes_predicted == 0
    with pytest.raises(ValueError, match=r"memory_budget: the memory planner cannot read the config's sizes "
                                         r"\(AttributeError: .*per-layer.*\); pass block_size and batch_tokens"):
        stream_backward(model, seqs, weights, memory_budget=2**30)


def _w(n, first=0.0):
    w = torch.ones(n, dtype=torch.float64)
    w[0] = first
    return w


class NotAnLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("call, err, match", [
    (lambda m: stream_backward(m, [], []), ValueError, "sequences: expected a non-empty list"),
    (lambda m: stream_backward(m, [torch.arange(5)], [_w(4)]), ValueError, r"weights\[0\]: shape \(4,\)"),
    (lambda m: stream_backward(m, [torch.arange(5)], [_w(5), _w(5)]), ValueError, "weights: expected a list of 1"),
    (lambda m: stream_backward(m, [torch.arange(5.0)], [_w(5)]), TypeError,
     r"sequences\[0\]: token ids must be an integer"),
    (lambda m: stream_backward(m, [[1, 2, 3]], [_w(3)]), TypeError, r"sequences\[0\]: expected a torch.Tensor"),
    (lambda m: stream_backward(m, [torch.arange(5)], [_w(5, first=1.0)]), ValueError, r"weights\[0\]\[0\]"),
    (lambda m: stream_backward(m, [torch.tensor([1, VOCAB])], [_w(2)]), ValueError, "outside the vocabulary"),
    (lambda m: stream_backward(m, [torch.tensor([1, -1])], [_w(2)]), ValueError, "outside the vocabulary"),
    (lambda m: stream_backward(m, [torch.arange(5)], [_w(5)], block_size=0), ValueError,
     "block_size: expected a positive"),
    (lambda m: stream_backward(m, [torch.arange(5)], [_w(5)], kernel="fast"), ValueError, "kernel"),
    (lambda m: stream_backward(m, [torch.arange(5)], [torch.arange(5)]), TypeError,
     r"weights\[0\]: expected a floating"),
    (lambda m: stream_backward(m, [torch.arange(3)], [torch.tensor([0, math.nan, 1.0])]), ValueError, "NaN"),
    (lambda m: stream_backward(m, [torch.arange(5)]), ValueError, "exactly one"),
    (lambda m: stream_backward(NotAnLM(), [torch.arange(5)], [_w(5)]), TypeError, "model:"),
    (lambda m: reference_backward(m, [torch.arange(5)], [_w(4)]), ValueError, r"weights\[0\]: shape"),
])
def test_bad_input_names_the_argument_and_touches_nothing(call, err, match):
    model = make("qwen3")
    with pytest.raises(err, match=match):
        call(model)
    assert all(p.grad is None for p in model.parameters())


def test_token_weights_is_the_default_contract():
    model = make("qwen3")
    seqs, weights = group_batch(torch.Generator().manual_seed(12))
    g1, _ = grads(model, stream_backward, seqs, weights, block_size=4)
    model.zero_grad(set_to_none=True)
    stream_backward(model, seqs, objective=TokenWeights(weights), block_size=4)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, g1[n])


def test_logprobs_pass_matches_the_reference_and_touches_no_grad():
    from backstream import logprobs

    model = make("mistral-window")
    seqs, weights = group_batch(torch.Generator().manual_seed(13))
    mask = [w != 0 for w in weights]
    lps = logprobs(model, seqs, mask, block_size=3)
    ref = reference_backward(model, seqs, weights).logprobs
    model.zero_grad(set_to_none=True)
    for a, b, m in zip(lps, ref, mask):
        assert torch.isnan(a[~m]).all()
        assert torch.allclose(a[m], b[m], atol=1e-12, rtol=0)
    lps = logprobs(model, seqs)  # default: every position t >= 1
    assert all(not torch.isnan(x[1:]).any() and torch.isnan(x[0]) for x in lps)
    assert all(p.grad is None for p in model.parameters())


# -- memory per token (issue 20): the history is read as views of the K/V store ------------------


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("window", [None, 5])
def test_per_row_private_parts_equal_one_stacked_part(kernel, window):
    """Each row's private history as its own batch-1 part (a view of the store, `row=r`) gives the
    output and the gradients of the same keys stacked into one [B, …] part."""
    from backstream.stream.attention import Part, merged_attention

    torch.manual_seed(0)
    B, H, Hkv, D, Q, Ls, Lp = 3, 4, 2, 8, 5, 6, 7
    leaf = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, ks, vs = leaf(B, H, Q, D), leaf(1, Hkv, Ls, D), leaf(1, Hkv, Ls, D)
    rows_k = [leaf(1, Hkv, Lp, D) for _ in range(B)]
    rows_v = [leaf(1, Hkv, Lp, D) for _ in range(B)]
    kb, vb = leaf(B, Hkv, Q, D), leaf(B, Hkv, Q, D)
    qpos, ppos = torch.arange(Ls + Lp, Ls + Lp + Q), torch.arange(Ls, Ls + Lp)
    shared, block = Part(ks, vs, torch.arange(Ls), shared=True), Part(kb, vb, qpos, causal=True)
    per_row = [shared, *(Part(k, v, ppos, row=r) for r, (k, v) in enumerate(zip(rows_k, rows_v))), block]
    stacked = [shared, Part(torch.cat(rows_k), torch.cat(rows_v), ppos), block]
    inputs = [q, ks, vs, *rows_k, *rows_v, kb, vb]
    probe = torch.randn(B, H, Q, D, dtype=torch.float64)
    outs, gs = [], []
    for parts in (per_row, stacked):
        out = merged_attention(q, parts, qpos, 0.3, window, kernel=kernel)
        outs.append(out)
        gs.append(torch.autograd.grad((out * probe).sum(), inputs))
    assert (outs[0] - outs[1]).abs().max() < 1e-13
    for a, b in zip(*gs):
        assert (a - b).abs().max() < 1e-13


def test_history_is_read_from_the_store_without_a_copy(monkeypatch):
    """Every history part the attention receives shares its memory with the K/V store: no batch,
    layer or row concatenates or stacks a copy that autograd would keep."""
    from backstream.stream import engine

    stores, seen = [], []

    class Recorded(engine.KVStore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            stores.append(self)

    real = adapter.merged_attention

    def spy(q, parts, *a, **kw):
        held = {x.untyped_storage().data_ptr() for s in stores for per_node in s.kv.values()
                for kv in per_node.values() for x in kv}
        seen.extend(p.k.untyped_storage().data_ptr() in held and p.v.untyped_storage().data_ptr() in held
                    for p in parts if not p.causal and p.k.shape[2])
        return real(q, parts, *a, **kw)

    monkeypatch.setattr(engine, "KVStore", Recorded)
    monkeypatch.setattr(adapter, "merged_attention", spy)
    model = make("qwen3")
    gen = torch.Generator().manual_seed(14)
    P = rand_ids(12, gen)
    seqs = [torch.cat([P, rand_ids(11 + i, gen)]) for i in range(3)] + [rand_ids(20, gen)]
    weights = [torch.cat([torch.zeros(12), torch.randn(len(s) - 12, generator=gen)]).double() for s in seqs[:3]]
    weights.append(torch.cat([torch.zeros(1), torch.randn(19, generator=gen)]).double())
    assert_same(model, seqs, weights, block_size=4)
    assert len(seen) > 20 and all(seen)
