"""The exact accounting of live tensor bytes (backstream.stream.memory) on known allocation
patterns, and what it says about the streamed backward: deterministic, at the floor per token,
and the planner's estimate within ±20% of it (counted, never timed)."""

import pytest
import torch
from helpers import make
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from backstream import reference_backward, stream_backward
from backstream.stream import planner
from backstream.stream.memory import LiveBytes, label, tag
from backstream.stream.tree import TokenTree


def test_counts_a_known_pattern_exactly():
    with LiveBytes() as m:
        a = torch.zeros(1000)  # 4000 B
        with label("x"):
            b = torch.ones(250, dtype=torch.float64)  # 2000 B under "x"
        v = a[10:]  # a view: no new storage
        a.add_(1)  # in place: none either
        c = a * 2  # 4000 B: the peak, 10000 B
        del a  # its storage lives on in v
        peak_set = dict(m.by_cat)
        del c
        d = torch.empty(500)  # 2000 B
        del v  # a's storage goes
    assert m.peak == 10_000 and m.at_peak == {"other": 8000, "x": 2000} == peak_set
    assert m.live == 4000 and {k: n for k, n in m.by_cat.items() if n} == {"x": 2000, "other": 2000}
    assert sorted(x[1] for x in m.live_set()) == [2000, 2000]
    del b, d
    assert m.live == 0  # frees after the block are still seen


def test_autograd_saved_tensors_and_gradients_are_counted():
    x = torch.randn(100, 100, requires_grad=True)  # before the block: not counted
    with LiveBytes() as m:
        y = (x * 2).sin()  # x * 2 is saved by sin: 40000 B, y 40000 B
        with label("bwd"):
            y.sum().backward()  # x.grad: 40000 B, allocated inside the backward
        tag(x.grad, "grad")
    assert m.live == 80_000 and m.by_cat["grad"] == 40_000
    assert m.saved_at_peak == 40_000  # the saved product, alive when the peak was reached
    assert m.peak >= 120_000


def test_parameters_count_from_the_start_and_grads_are_tagged():
    model = make("qwen3", dtype=torch.float32)
    w = sum(p.numel() * 4 for p in model.parameters())
    seq = torch.arange(1, 21)
    weights = torch.ones(20)
    weights[0] = 0
    model.zero_grad(set_to_none=True)
    with LiveBytes(model) as m:
        stream_backward(model, [seq], [weights], block_size=8)
    assert m.by_cat["weights"] == w
    assert m.by_cat["grad"] == sum(p.numel() * 4 for p in model.parameters() if p.grad is not None) > 0
    assert m.live == m.by_cat["weights"] + m.by_cat["grad"] + m.by_cat["other"]  # nothing else outlives the call
    assert m.by_cat["other"] < 1024  # the returned log-probs


def counted(model, seqs, weights, **kw):
    model.zero_grad(set_to_none=True)
    with LiveBytes(model) as m:
        r = stream_backward(model, seqs, weights, **kw)
    model.zero_grad(set_to_none=True)
    return m, r


def trajectory(n, vocab, prompt, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    w[:prompt] = 0
    return torch.randint(0, vocab, (n,), generator=g), w


def qwen3(vocab=512):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=4096)).eval()


def qwen3_moe():
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=48, max_position_embeddings=4096)).eval()


def test_the_same_numbers_twice():
    """A model's first call also runs one-off probes (family checks): first calls agree with first
    calls, later calls with later calls."""
    seq, w = trajectory(300, 512, 100)
    numbers = lambda m: (m.peak, m.at_peak, m.saved_at_peak, m.ops)  # noqa: E731
    model_a, model_b = qwen3(), qwen3()
    for _ in range(2):
        a, b = (numbers(counted(model, [seq], [w], block_size=64)[0]) for model in (model_a, model_b))
        assert a == b


def test_a_trajectory_costs_its_kv_and_their_gradients_per_token():
    """Past one block, every extra token costs exactly its K/V (model dtype) and their float32
    accumulators: no history copy, no gradient kept past its layer, nothing for the last block."""
    model = qwen3()
    kv_tok = 2 * 2 * 2 * 16 * 4  # layers · (K, V) · kv heads · head_dim · float32
    peaks = {}
    for n in (513, 1025):
        seq, w = trajectory(n, 512, 100)
        m, _ = counted(model, [seq], [w], block_size=128)
        peaks[n] = m.peak
        assert m.at_peak["kv"] == m.at_peak["gkv"] == (n - 1 - 128) * kv_tok  # the last block is never read
        assert "history" not in m.at_peak and "history grad" not in m.at_peak
    # besides: per-token bookkeeping of the call (log-probs, masks), a few bytes per token
    assert 512 * 2 * kv_tok <= peaks[1025] - peaks[513] <= 512 * (2 * kv_tok + 32)


@pytest.mark.parametrize("build", [qwen3, lambda: qwen3(vocab=4096), qwen3_moe],
                         ids=["small-vocab", "large-vocab", "moe"])
@pytest.mark.parametrize("block", [64, 256])
def test_planner_estimate_within_20_percent(build, block):
    model = build()
    seq, w = trajectory(700, model.config.vocab_size, 200)
    m, r = counted(model, [seq], [w], block_size=block)
    assert abs(r.stats.peak_bytes_predicted / m.peak - 1) <= 0.2, (r.stats.peak_bytes_predicted, m.peak)


def test_planner_estimate_within_20_percent_for_a_group_and_a_budget():
    model = qwen3()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (200,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, 512, (150 + 30 * i,), generator=g)]) for i in range(4)]
    weights = [torch.cat([torch.zeros(200), torch.randn(len(s) - 200, generator=g)]) for s in seqs]
    m, r = counted(model, seqs, weights, block_size=64)
    assert abs(r.stats.peak_bytes_predicted / m.peak - 1) <= 0.2, (r.stats.peak_bytes_predicted, m.peak)
    # a budget: the planner's choice, its estimate, and the counted peak within it
    tree = TokenTree([s[:-1].tolist() for s in seqs])
    budget = planner.plan(model, tree, block_size=128, batch_tokens=128).peak_bytes
    m, r = counted(model, seqs, weights, memory_budget=budget)
    assert r.stats.peak_bytes_predicted <= budget
    assert abs(r.stats.peak_bytes_predicted / m.peak - 1) <= 0.2, (r.stats.peak_bytes_predicted, m.peak)


def test_the_planner_counts_the_logits_of_the_targets_a_batch_has():
    """A GRPO group of 4 short completions (16 tokens) on a 1,500-token prompt, a 4,096-token vocabulary:
    a batch computes the logits of its targets only (none in the prompt's blocks, 4 x 16 in the
    completions'), and keeps the activations of its own tokens: the estimate counts those, not rows x
    block size of each (the estimate was 11x the counted peak; it is 1.12x)."""
    model = qwen3(vocab=4096)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 4096, (1500,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, 4096, (16,), generator=g)]) for _ in range(4)]
    weights = [torch.cat([torch.zeros(1500), torch.randn(16, generator=g)]) for _ in seqs]
    m, r = counted(model, seqs, weights, block_size=512)
    assert abs(r.stats.peak_bytes_predicted / m.peak - 1) <= 0.2, (r.stats.peak_bytes_predicted, m.peak)
    tree = TokenTree([s[:-1].tolist() for s in seqs])
    tree.add_targets([s for s in seqs], [w != 0 for w in weights])
    # the completions (15 inputs each), the prompt's last chunk (its last token predicts 4 first tokens), its first
    assert planner.batch_sizes(tree, 512, 8 * 512) == [(60, 60), (476, 4), (512, 0)]


@pytest.mark.parametrize("tied", [True, False])
def test_no_vocabulary_sized_gradient_per_block(tied):
    """A large vocabulary: each block batch's backward hands the input embedding the rows of its tokens
    (`grads.SparseEmbeddingGrad`) and adds the LM head's weight gradient in place (`grads.HeadGradInPlace`):
    no dense [vocab × hidden] tensor is in flight besides `.grad` (two or three were, with a tied head);
    `.grad` ends dense and exact, the modules as they were."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg).double().eval()
    table = 50000 * 32 * 8
    seq = torch.randint(0, 50000, (64,), generator=torch.Generator().manual_seed(1))
    w = torch.randn(64, dtype=torch.float64)
    w[0] = 0
    m, _ = counted(model, [seq], [w], block_size=8)
    logits = 8 * 50000 * 8  # one block's [8 × vocab] float64 logits gradient
    assert m.at_peak.get("backward", 0) <= 2 * logits + 2**16 < table  # a table (or three) before
    model.zero_grad(set_to_none=True)
    stream_backward(model, [seq], [w], block_size=8)
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert not any(x.is_sparse for x in g.values())
    model.zero_grad(set_to_none=True)
    reference_backward(model, [seq], [w])
    for n, p in model.named_parameters():
        assert torch.allclose(g[n], p.grad, rtol=1e-10, atol=1e-14), n
    assert model.get_input_embeddings().weight is model.model.embed_tokens.weight  # restored
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert "forward" not in model.lm_head.__dict__ and not model.model.embed_tokens.sparse


def test_a_bfloat16_embedding_gathers_its_rows_in_float32():
    """bf16 with the float32 gradient buffer (GradAccumulator): the sparse rows start a dense buffer, the
    LM head's products go into its buffer."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=3000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    seq = torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(1))
    w = torch.randn(40)
    w[0] = 0
    stream_backward(model, [seq], [w], block_size=8)
    g = model.model.embed_tokens.weight.grad
    assert g is not None and not g.is_sparse and g.dtype == torch.bfloat16
    rows = torch.unique(seq[:-1])
    assert (g[rows].abs().sum(-1) > 0).all() and int((g.abs().sum(-1) > 0).sum()) == len(rows)
    # the head's gradient, summed in place into the float32 buffer, is the reference's to bf16 rounding
    head = model.lm_head.weight.grad.float()
    model.zero_grad(set_to_none=True)
    reference_backward(model, [seq], [w])
    ref = model.lm_head.weight.grad.float()
    assert float((head - ref).norm() / ref.norm()) < 2e-2
