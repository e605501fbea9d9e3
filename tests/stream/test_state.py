"""Layer state that is not K/V (issue 39, docs/design.md §2b): the recurrent states of Gated DeltaNet and
Mamba 2 layers and the states of short convolutions, streamed exactly.

Every hybrid and state-space family transformers ships that the engine drives is checked here in float64
(its miniature, `keep_float64` so that the layers' float32 kernels add no 1e-7 noise) on a token tree with
a shared 70-token prompt, unequal responses, a second turn, a branch one token after the prompt and a
one-token response, at block sizes shorter than a convolution's window (2: its state spans blocks),
that cut Mamba 2's 8-token chunks and Gated DeltaNet's 64-token chunks (37, 100); Mamba 1's (Mamba,
Falcon-Mamba, Jamba), whose transformers scan drops the state it is handed, through the engine's own
continued scan (stream/scan.py) on a smaller tree at block sizes 1, 3 and 16 (without it the family
is refused by name: tests/stream/test_contract.py). (Block 5, a window cut once, ran
here before: its cases are covered by 2 and 37, and it cost a quarter of the module's time.)

The gradient of a state read by several blocks is the sum over its readers (the shared-prefix rule,
`BoundaryState._deposit`). Inside one block batch autograd sums it already; only readers in different
batches reach the sum the engine keeps. So every family also runs with one row per batch
(`batch_tokens=1`: the prompt's four responses in four batches), and a group of twelve runs with the
default batch of eight rows: a deposit that overwrote instead of adding would be 7.8% off there.
(K/V's twin, `KVStore.add_grad`, is guarded by tests/stream/test_engine.py's one-row batches.)"""

import pytest
import torch
from helpers import relative_errors
from transformers import AutoConfig

from backstream import reference_backward, stream_backward
from backstream.stream.adapter import probe_layout
from backstream.stream.engine import measured_activations
from backstream.stream.family import ModelContractError
from backstream.stream.miniature import keep_float64, miniature, miniature_config
from backstream.stream.planner import boundaries, plan
from backstream.stream.schedule import batches, chunks, read_later
from backstream.stream.tree import TokenTree

# model_type → config overrides (LFM2's default config has no convolution layer: give it two)
HYBRIDS = {
    "qwen3_5_text": {}, "qwen3_5_moe_text": {}, "qwen3_next": {}, "nemotron_h": {}, "granitemoehybrid": {},
    "bamba": {}, "mamba2": {}, "falcon_h1": {}, "zamba2": {},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3},
    "lfm3": {}, "kimi_linear": {}, "olmo_hybrid": {}, "bailing_hybrid": {}, "lara_mini": {}, "zaya": {},
}
# transformers' Mamba 1 scan (`mamba_selective_scan`) takes no initial state: stream/scan.py continues it
MAMBA1 = ("mamba", "falcon_mamba", "jamba")
BLOCKS = (2, 37, 100)
ONE_ROW = (37, 1)  # (block_size, batch_tokens): one row per batch, so a state's readers span batches


def hybrid(model_type: str, seed: int = 0, **extra):
    """The float64 miniature of `model_type` with room for 200 positions."""
    kw = {**HYBRIDS.get(model_type, {}), **extra}
    cfg = miniature_config(AutoConfig.for_model(model_type, **kw) if kw else model_type)
    cfg.get_text_config().max_position_embeddings = 512
    return miniature(cfg, seed=seed)


def tree(seed: int = 0, vocab=(7, 55)):
    """A GRPO group on a 70-token prompt (responses of 30, 81, 1 and 45 tokens), a second turn on top of
    the 81-token response, a sequence branching 40 tokens into the prompt, one branching one token after
    it (a one-token node at the branch point); no loss on the first 60 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(*vocab, (n,), generator=g)  # noqa: E731
    P = ids(70)
    seqs = [torch.cat([P, ids(n)]) for n in (30, 81, 1, 45)]
    seqs.append(torch.cat([seqs[1], ids(12)]))
    seqs.append(torch.cat([P[:40], ids(9)]))
    seqs.append(torch.cat([seqs[0][:71], ids(5)]))
    weights = [torch.randn(len(s), generator=g, dtype=torch.float64) for s in seqs]
    for w in weights:
        w[:60] = 0
    return seqs, weights


def grads(model, fn, seqs, weights, **kw):
    model.zero_grad(set_to_none=True)
    with keep_float64():
        res = fn(model, seqs, weights, **kw)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, res


def assert_exact(model, seqs, weights, blocks=BLOCKS, one_row=(), **kw):
    """Streamed = reference at every block size of `blocks` (default batches) and every (block_size,
    batch_tokens) of `one_row`."""
    g_ref, r_ref = grads(model, reference_backward, seqs, weights)
    assert g_ref and max(float(x.norm()) for x in g_ref.values()) > 0
    runs = [(b, None) for b in blocks] + list(one_row)
    for b, rows in runs:
        g, r = grads(model, stream_backward, seqs, weights, block_size=b, batch_tokens=rows, **kw)
        assert g.keys() == g_ref.keys()
        for n, err in relative_errors(g, g_ref).items():
            assert err <= 1e-10, f"block {b}, batch_tokens {rows}: {n}: relative error {err:.3g}"
        for i, (a, b_) in enumerate(zip(r.logprobs, r_ref.logprobs)):
            m = weights[i] != 0
            assert torch.allclose(a[m], b_[m], atol=1e-12, rtol=0), f"block {b}: log-probs of sequence {i}"


# the inner loop (`-m "not slow"`) streams two hybrids of a few seconds each (Gated DeltaNet beside attention;
# a short convolution): every family is the full run's
FAST_HYBRIDS = ("qwen3_5_text", "lfm2")


@pytest.mark.parametrize("model_type", [m if m in FAST_HYBRIDS else pytest.param(m, marks=pytest.mark.slow)
                                        for m in HYBRIDS])
def test_hybrid_family_streamed_exactly(model_type):
    """stream_backward = reference_backward to 1e-10 on every family that keeps state, the layers that
    keep it found by the probe (a family whose miniature has no such layer would prove nothing)."""
    model = hybrid(model_type)
    layout = probe_layout(model)
    assert layout.states, f"{model_type}: the miniature keeps no recurrent or convolution state"
    assert_exact(model, *tree(), one_row=[ONE_ROW])


def test_a_group_larger_than_one_batch():
    """Twelve responses of a 70-token prompt (a GRPO group of 12) at the default batch of 8 rows: the
    prompt's final states are read from two batches, and their gradients are summed across them."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(7, 55, (70,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(7, 55, (n,), generator=g)]) for n in range(30, 42)]
    weights = [torch.randn(len(s), generator=g, dtype=torch.float64) for s in seqs]
    for w in weights:
        w[:70] = 0
    t = TokenTree([s.tolist() for s in seqs], stateful=True)
    assert any(len(rows) < 12 and parent >= 0 for parent, rows in batches(t, 37, 8 * 37, stateful=True))
    assert_exact(hybrid("qwen3_5_text"), seqs, weights, blocks=(37,))


def small_tree(seed: int = 0):
    """A GRPO group of 4 on a 20-token prompt (responses of 7, 12, 1 and 9 tokens), a second turn on the
    12-token response, a branch 8 tokens into the prompt; no loss on the first 15 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(7, 55, (n,), generator=g)  # noqa: E731
    P = ids(20)
    seqs = [torch.cat([P, ids(n)]) for n in (7, 12, 1, 9)]
    seqs += [torch.cat([seqs[1], ids(5)]), torch.cat([P[:8], ids(4)])]
    weights = [torch.randn(len(s), generator=g, dtype=torch.float64) for s in seqs]
    for w in weights:
        w[:15] = 0
    return seqs, weights


@pytest.mark.parametrize("model_type", ["mamba", pytest.param("falcon_mamba", marks=pytest.mark.slow), "jamba"])
def test_mamba1_family_streamed_exactly(model_type):
    """Mamba 1 layers (issue 55): their scan continued from the state a block starts with
    (stream/scan.py), at block sizes 1, 3 and 16 (a 4-tap convolution's window cut, one-token blocks
    on the one-token path) and with one row per batch (the prompt's readers in four batches)."""
    model = hybrid(model_type)
    assert {"conv", "recurrent"} <= set(probe_layout(model).states)
    assert_exact(model, *small_tree(), blocks=(1, 3, 16), one_row=[(3, 1)])


@pytest.mark.slow
def test_lora_on_the_linear_attention_and_mamba_projections():
    """PEFT LoRA on Gated DeltaNet's projections (q/k/v, z, b, a, out) and on Mamba 2's input
    projection (PEFT itself refuses its out_proj and conv1d), beside the attention ones: exact, every
    LoRA tensor with its gradient."""
    from peft import LoraConfig, get_peft_model

    for model_type, targets in (("qwen3_5_text", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                                  "q_proj", "v_proj"]),
                                ("nemotron_h", ["in_proj", "q_proj", "o_proj"])):
        model = hybrid(model_type)
        torch.manual_seed(1)
        pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64)
        seqs, weights = tree(1)
        assert_exact(pm, seqs, weights, blocks=(5, 37))
        g, _ = grads(pm, stream_backward, seqs, weights, block_size=5)
        lora = [n for n, p in pm.named_parameters() if "lora_" in n]
        assert lora and all(n in g and float(g[n].norm()) > 0 for n in lora)


def test_kv_from_the_caller_refused_for_a_model_with_state():
    model = hybrid("qwen3_5_text")
    seqs, weights = tree()
    kv = [[(torch.zeros(2, len(s), 8, dtype=torch.float64),) * 2] * 2 for s in seqs]
    with pytest.raises(ModelContractError, match=r"^kv: .*keeps recurrent or convolution state in layers \[0\]"):
        stream_backward(model, seqs, weights, kv=kv)


def test_layout_found_by_the_probe():
    """Qwen3.5's miniature: layer 0 Gated DeltaNet (a conv state [channels, kernel] and a recurrent
    state [value heads, d_k, d_v]), layer 1 attention; Nemotron-H's MLP and MoE layers mix no tokens."""
    model = hybrid("qwen3_5_text")
    layout = probe_layout(model)
    c = model.config.get_text_config()
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    assert layout.kv_layers == {1} and layout.state_layers == {0}
    assert layout.states["conv"][(0, 0)] == ((conv_dim, c.linear_conv_kernel_dim), torch.float64)
    assert layout.states["recurrent"][(0, 0)][0] == (c.linear_num_value_heads, c.linear_key_head_dim,
                                                      c.linear_value_head_dim)
    nem = probe_layout(hybrid("nemotron_h"))
    types = hybrid("nemotron_h").config.layers_block_type
    assert nem.local_layers == {i for i, t in enumerate(types) if t in ("mlp", "moe")} != set()


# -- the tree and the schedule: no one-token block continues a state ----------------------------------


def test_chunks_take_a_one_token_remainder():
    assert chunks(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert chunks(7, 3, stateful=True) == [(0, 3), (3, 7)]
    assert chunks(1, 3, stateful=True) == [(0, 1)] and chunks(6, 3, stateful=True) == [(0, 3), (3, 6)]


def test_one_token_nodes_below_a_root_are_pushed_into_their_children():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 8], [1, 9], [1, 9, 4]]
    plain, stateful = TokenTree(seqs), TokenTree(seqs, stateful=True)
    assert any(len(n.tokens) == 1 and n.parent >= 0 and n.children for n in plain.nodes)
    assert not any(len(n.tokens) == 1 and n.parent >= 0 and n.children for n in stateful.nodes)
    for t in (plain, stateful):  # every path spells its sequence
        for s, path in zip(seqs, t.paths):
            assert sum((t.nodes[n].tokens for n in path), [])[:len(s)] == s
            assert all(t.nodes[b].parent == a for a, b in zip(path, path[1:]))
    assert stateful.num_tokens() == plain.num_tokens() + 1  # token 6 once per child of its node


def test_no_padded_row_whose_state_is_read_later():
    """A batch mixes row lengths only where the shorter rows' final states are never read (the tails of
    responses); every block with a state to continue runs at least 2 tokens."""
    seqs, _ = tree()
    t = TokenTree([s[:-1].tolist() for s in seqs], stateful=True)
    for parent, rows in batches(t, 5, 40, stateful=True):
        Q = max(r.hi - r.lo for r in rows)
        assert all(r.hi - r.lo == Q or not read_later(t, r) for r in rows)
        assert Q > 1 or parent < 0 or not any(read_later(t, r) for r in rows)


def test_the_planner_counts_the_states():
    """The boundaries a later block starts from hold one state per state layer, in the model's dtype, and
    their gradients in float32 or wider; attention layers alone hold K/V."""
    model = hybrid("qwen3_5_text")
    layout = probe_layout(model)
    seqs, _ = tree()
    t = TokenTree([s[:-1].tolist() for s in seqs], stateful=True)
    p = plan(model, t, block_size=16, batch_tokens=64, layout=layout, act_per_token=measured_activations(model, layout))
    assert p.breakdown["block_activations"] == 64 * measured_activations(model, layout) > 0
    n = boundaries(t, 16)
    assert n > 0 and p.breakdown["state_store"] == n * layout.bytes_per_row()
    assert p.breakdown["state_grads"] == n * layout.bytes_per_row(acc=True)
    plain = plan(model, t, block_size=16, batch_tokens=64)
    assert p.breakdown["kv_store"] == plain.breakdown["kv_store"] // model.config.num_hidden_layers
