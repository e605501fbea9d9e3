"""The family contract (docs/design.md §6b): every way the engine can meet a model ends in the exact
gradient or a clear error. One tiny config per category: supported features exact in float64
against `reference_backward`, refused ones with a `model:` error that names the feature."""

import warnings

import pytest
import torch
from helpers import assert_same, group_batch, rand_ids
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache

from backstream import stream_backward
from backstream.stream import adapter, planner
from backstream.stream.family import Unsupported
from backstream.stream.hf import cache_arg
from backstream.stream.miniature import exact_norms

warnings.filterwarnings("ignore", category=FutureWarning)
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


def build(model_type, **kw):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **kw})
    cfg._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "sinks" in name:
                p.normal_()  # zero-initialised: make them matter
    return exact_norms(model)


def check_exact(model, block_sizes=(1, 3, 64), **kw):
    seqs, weights = group_batch(torch.Generator().manual_seed(1))
    for b in block_sizes:
        assert_same(model, seqs, weights, block_size=b, **kw)


def check_refused(model, match, exc=Unsupported, seqs=None, **kw):
    seqs = seqs or group_batch(torch.Generator().manual_seed(1))[0]
    weights = [torch.ones(len(s), dtype=torch.float64) * (torch.arange(len(s)) > 0) for s in seqs]
    with pytest.raises(exc, match=r"^model: .*" + match):
        stream_backward(model, seqs, weights, block_size=3)


@pytest.fixture
def float64_softmax(monkeypatch):
    """Eager attention takes its softmax in float32 (`dtype=torch.float32`); keep float64 so that
    the reference of the soft-capped family is float64 throughout."""
    real = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return real(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


# -- (a) attention keywords: implemented (soft-capping, sinks) or refused ----------------------


def test_softcapping_gemma2_exact(float64_softmax):
    """Gemma 2: logits soft-capped at 0.5 (far inside tanh's bend), alternating window 4 / full,
    query_pre_attn_scalar ≠ head_dim (the scale is not head_dim^-0.5)."""
    model = build("gemma2", attn_logit_softcapping=0.5, final_logit_softcapping=3.0, sliding_window=4,
                  query_pre_attn_scalar=12)
    check_exact(model)


def test_softcapping_ignored_would_fail(float64_softmax, monkeypatch):
    """The test above can fail: an engine that drops `softcap` is off by far more than 1e-10."""
    model = build("gemma2", attn_logit_softcapping=0.5, sliding_window=4)
    real = adapter.merged_attention
    monkeypatch.setattr(adapter, "merged_attention", lambda *a, softcap=None, **k: real(*a, **k))
    with pytest.raises(AssertionError, match="relative error"):
        check_exact(model, block_sizes=(3,))


@pytest.mark.parametrize("use_lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sinks_gpt_oss_exact(use_lora):
    """GPT-OSS: a learned sink logit per head (the sinks get their gradient), sliding/full layers, MoE."""
    model = build("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    if use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.double()
            if "sinks" in n:
                p.requires_grad_(True)  # trained with the adapters (modules_to_save-like)
    check_exact(model)
    sinks = [p for n, p in model.named_parameters() if "sinks" in n]
    model.zero_grad()
    seqs, weights = group_batch(torch.Generator().manual_seed(1))
    stream_backward(model, seqs, weights, block_size=3)
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in sinks)


def _wrap_attention(monkeypatch, change):
    """Route the engine's attention through `change(module, q, k, v, mask, kwargs)` first: a stand-in
    for a model that passes other arguments than the families at hand."""
    real = adapter.attention

    def wrapped(module, q, k, v, mask, **kwargs):
        q, k, v, mask = change(module, q, k, v, mask, kwargs)
        return real(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, adapter.ATTN_NAME, wrapped)


def test_unknown_attention_keyword_refused(monkeypatch):
    def change(module, q, k, v, mask, kwargs):
        kwargs["position_bias"] = torch.zeros(1)
        return q, k, v, mask

    _wrap_attention(monkeypatch, change)
    check_refused(build("llama"), "keyword 'position_bias'")


def test_bidirectional_flag_refused(monkeypatch):
    def change(module, q, k, v, mask, kwargs):
        kwargs["is_causal"] = False
        return q, k, v, mask

    _wrap_attention(monkeypatch, change)
    check_refused(build("llama"), "is_causal=False")


# -- (b) the mask --------------------------------------------------------------------------------


def test_chunked_attention_refused_when_a_chunk_is_crossed():
    """Llama 4 with chunk 4 < the sequences: the mask is not causal/window, refused (a single-query
    block sees exactly its chunk, but larger blocks cannot)."""
    model = build("llama4_text", attention_chunk_size=4, num_local_experts=4, intermediate_size_mlp=48,
                  no_rope_layers=[1, 0], use_qk_norm=False)
    check_refused(model, "not causal")


def test_chunked_attention_longer_than_every_sequence_exact(monkeypatch):
    """The same family with a chunk longer than every sequence is plain causal: exact. (Llama 4
    rotates q/k in complex64 even in a float64 model: keep complex128 for the comparison.)"""
    from transformers.models.llama4 import modeling_llama4

    def rotate(xq, xk, freqs_cis):
        out = [torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs_cis[:, :, None, :])
               for x in (xq, xk)]
        return out[0].flatten(3).type_as(xq), out[1].flatten(3).type_as(xk)

    monkeypatch.setattr(modeling_llama4, "apply_rotary_emb", rotate)
    model = build("llama4_text", attention_chunk_size=64, num_local_experts=4, intermediate_size_mlp=48,
                  no_rope_layers=[1, 0], use_qk_norm=False, moe_layers=[])
    check_exact(model)


def test_window_from_the_mask_when_the_keyword_is_missing(monkeypatch):
    """A layer that builds a sliding-window mask but does not pass `sliding_window`: the engine
    reads the window off the mask and stays exact."""
    def change(module, q, k, v, mask, kwargs):
        kwargs.pop("sliding_window", None)
        return q, k, v, mask

    model = build("mistral", sliding_window=4)
    _wrap_attention(monkeypatch, change)
    check_exact(model, block_sizes=(3, 64))


def test_window_keyword_disagreeing_with_the_mask_refused(monkeypatch):
    def change(module, q, k, v, mask, kwargs):
        kwargs["sliding_window"] = 2
        return q, k, v, mask

    _wrap_attention(monkeypatch, change)
    check_refused(build("mistral", sliding_window=4), "sliding_window=2 but its mask")


def test_missing_mask_refused(monkeypatch):
    _wrap_attention(monkeypatch, lambda module, q, k, v, mask, kwargs: (q, k, v, None))
    check_refused(build("llama"), "without a mask")


# -- (c) the K/V the attention reads -------------------------------------------------------------


def test_kv_the_engine_cannot_place_refused(monkeypatch):
    """Keys that are neither the cache's output nor history ⊕ block (here: one position dropped
    after the update) cannot be given their positions: refused, not silently wrong."""
    def change(module, q, k, v, mask, kwargs):
        return q, k[:, :, 1:], v[:, :, 1:], mask

    _wrap_attention(monkeypatch, change)
    check_refused(build("llama"), "not the ones `cache.update` returned")


@pytest.mark.parametrize("use_lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_multi_head_latent_attention_exact(use_lora):
    """DeepSeek-V3's MLA caches a latent and expands it into K (rope 4 + nope 8) and V (6) after the
    update: those layers run with history ⊕ block from the cache, exact, and kv_b_proj (which only
    the expansion reaches) gets its gradient."""
    model = build("deepseek_v3", kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                  v_head_dim=6, head_dim=4, num_key_value_heads=4, first_k_dense_replace=2,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16)
    if use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["kv_b_proj", "o_proj"], init_lora_weights=False))
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.double()
    check_exact(model)
    check_exact(model, block_sizes=(2,), batch_tokens=2)  # one row per batch: private history only


# -- (d) positions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [
    dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0, 3.0, 4.0, 5.0],
         original_max_position_embeddings=8, rope_theta=10000.0),  # (Phi-3 also reads it from the config)
    dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
])
def test_length_dependent_rope(rope):
    """longrope / dynamic NTK switch frequencies with the longest position of a forward: refused
    once a sequence reaches the threshold (8 positions), exact below it."""
    kw = dict(rope_parameters=rope)
    if rope["rope_type"] == "dynamic":
        kw["max_position_embeddings"] = 8
    else:
        kw.update(max_position_embeddings=64, original_max_position_embeddings=8)
    model = build("phi3" if rope["rope_type"] == "longrope" else "llama", **kw)
    check_refused(model, f"rope_type '{rope['rope_type']}'")
    gen = torch.Generator().manual_seed(3)
    P = rand_ids(3, gen)
    seqs = [torch.cat([P, rand_ids(n, gen)]) for n in (4, 2, 3)]  # at most 7 tokens
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) * (torch.arange(len(s)) >= 3) for s in seqs]
    for b in (1, 2, 5):
        assert_same(model, seqs, weights, block_size=b)


# -- (e) determinism ---------------------------------------------------------------------------------


def test_dropout_in_training_mode_refused():
    """Hidden dropout (GPT-2's resid/embd dropout modules) in train(): refused; eval(): exact."""
    model = build("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
                  attn_pdrop=0.0)
    model.train()
    check_refused(model, "dropout is active", exc=ValueError)
    model.eval()
    check_exact(model, block_sizes=(3,))


def test_lora_dropout_in_training_mode_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"]))
    model.train()
    check_refused(model, "lora_dropout", exc=ValueError)


def test_gradient_checkpointing_in_training_mode_refused():
    model = build("llama")
    model.gradient_checkpointing_enable()
    model.train()
    check_refused(model, "gradient checkpointing", exc=ValueError)


# -- state that is not K/V, crashes inside transformers --------------------------------------------


def test_state_dropped_by_the_multi_token_path_refused(monkeypatch):
    """A multi-token path that drops the state it is handed (transformers' Mamba 1 scan, without the
    engine's continued scan, stream/scan.py): a forward continued from the cache's state differs from
    the full forward, so the family is refused by name rather than streamed wrong (the continuation
    contract, docs/design.md §6b (f))."""
    from backstream.stream import scan

    monkeypatch.setattr(scan, "install", lambda model: 0)
    model = build("mamba")
    check_refused(model, "ignores or mishandles the state it is handed")


# -- kv= and the planner -------------------------------------------------------------------------------


def test_kv_cache_with_several_rows_refused():
    model = build("llama")
    seqs = [rand_ids(6, torch.Generator().manual_seed(0)) for _ in range(2)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.stack(seqs), use_cache=True, **{cache_arg(model): cache})
    weights = [torch.ones(6, dtype=torch.float64) * (torch.arange(6) > 0) for _ in seqs]
    with pytest.raises(ValueError, match=r"^kv\[0\]: a Cache of batch \[2\]"):
        stream_backward(model, seqs, weights, kv=[cache, cache])


def test_kv_of_another_shape_refused():
    model = build("llama")
    seq = rand_ids(6, torch.Generator().manual_seed(0))
    w = torch.ones(6, dtype=torch.float64) * (torch.arange(6) > 0)
    wrong = [(torch.zeros(2, 6, 4, dtype=torch.float64), torch.zeros(2, 6, 4, dtype=torch.float64))] * 2
    with pytest.raises(ValueError, match=r"^kv: layer 0's K has shape \[2, length, 4\]"):
        stream_backward(model, [seq], [w], kv=[wrong], block_size=3)


def test_planner_per_layer_intermediate_sizes():
    """A config whose intermediate_size is a list (one per layer) is planned with the widest."""
    model = build("llama")
    object.__setattr__(model.config, "intermediate_size", [48, 96])  # past the config's own type check
    plan = planner.estimate(model, tree_tokens=100, longest_path=50, block_size=16, rows=2)
    object.__setattr__(model.config, "intermediate_size", 96)
    assert plan.peak_bytes == planner.estimate(model, tree_tokens=100, longest_path=50, block_size=16,
                                               rows=2).peak_bytes


def test_positions_counted_from_padding_idx_refused():
    """RoBERTa-style embeddings number positions from padding_idx + 1 when none are given, so the
    full-sequence forward and the blocks (which pass 0, 1, 2, …) would disagree: refused."""
    model = build("roberta", is_decoder=True, max_position_embeddings=64, type_vocab_size=1)
    check_refused(model, "does not number positions 0, 1, 2")
