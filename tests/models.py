"""Tiny random models of several HF families, built from configs (no download), for float64 tests.

HF's RMSNorm (and the Qwen3-MoE router's softmax) compute in float32 even in a float64 model;
`exact_norms` (backstream/stream/miniature.py) runs them in float64, so that a real 1e-7 error cannot hide
under that noise (docs/design.md §2).
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from backstream.stream.miniature import exact_norms

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def make(family: str, dtype=torch.float64, seed: int = 0, window: int = 4):
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON))
    elif family == "qwen3-mixed-window":  # per-layer windows: layer 0 sliding, layer 1 full
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=window,
                                             layer_types=["sliding_attention", "full_attention"]))
    elif family == "mistral-window":
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=window))
    elif family == "qwen3-moe":
        cfg = Qwen3MoeConfig(**{**COMMON, "intermediate_size": 32}, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, decoder_sparse_step=1)
        cfg._experts_implementation = "eager"  # grouped_mm has no float64 CPU kernel
        model = Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = MixtralConfig(**{**COMMON, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2)
        cfg._experts_implementation = "eager"
        model = MixtralForCausalLM(cfg)
    else:
        raise KeyError(family)
    model = model.to(dtype).eval()
    # random init of norms too, so that a missed norm weight would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return exact_norms(model) if dtype == torch.float64 else model


def lora(model, r: int = 4, seed: int = 1, layers=None):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # no k_proj: K of every layer stays frozen, so some K/V roots need no gradient; with
    # `layers`, the layers below are frozen entirely
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                          layers_to_transform=layers, init_lora_weights=False))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(next(model.parameters()).dtype)
    return pm


FAMILIES = ["llama", "qwen3", "qwen3-mixed-window", "mistral-window", "qwen3-moe", "mixtral"]
MOE = ["qwen3-moe", "mixtral"]


# ---------------------------------------------------------------------------------------------
# The wider family matrix (tests/test_families.py): tiny configs of more HF families, each with
# the feature that sets it apart switched on, so that an engine assuming Llama would show.

SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the vocabulary
BOS, EOS = SPECIAL["bos_token_id"], SPECIAL["eos_token_id"]
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # wavelengths 6, 63, 628, 6283: kept, smoothed, scaled
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)
GEMMA3_WINDOW = 5
GEMMA3_QUERY_SCALAR = 12  # scaling 12^-0.5, not head_dim^-0.5
GRANITE_ATTENTION = 0.2  # scaling 0.2, not 8^-0.5 ≈ 0.354


def _family_model(family: str):
    """The float32 model of `family`, with HF's own numerics (nothing patched)."""
    import transformers as tf

    common = {**COMMON, **SPECIAL}
    mha = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}  # head_dim 32/4 = 8
    if family == "qwen2":  # q/k/v biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "qwen2-tied":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    if family == "gemma3":  # layer 0 sliding (local RoPE), layer 1 full; (1 + w) norms, on q/k too; tied
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=GEMMA3_QUERY_SCALAR,
            layer_types=["sliding_attention", "full_attention"]))
    if family == "olmo2":  # RMSNorm on the whole q and k projections, post-norm blocks
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))
    if family == "gpt-neox":  # rotary on half of each head, parallel residual, LayerNorm, biases
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**mha, partial_rotary_factor=0.5))
    if family == "gpt2":  # learned positions, Conv1D with biases, LayerNorm, tied; layer l scaled by 1/(l+1)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                                scale_attn_by_inverse_layer_idx=True, **SPECIAL))
    if family == "granite":
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, attention_multiplier=GRANITE_ATTENTION,
                                                      embedding_multiplier=4.0, residual_multiplier=0.5,
                                                      logits_scaling=2.0))
    if family == "starcoder2":  # LayerNorm with biases, sliding window on every layer, tied
        return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**common, sliding_window=6))
    if family == "phi3":  # fused qkv and gate_up projections, plain RoPE
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common))
    if family == "llama-rope-llama3":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=LLAMA3_ROPE))
    if family == "llama-rope-yarn":  # yarn also scales cos/sin (its attention factor)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=YARN_ROPE))
    raise KeyError(family)


def _is_norm(mod) -> bool:
    return isinstance(mod, torch.nn.LayerNorm) or "norm" in type(mod).__name__.lower()


def make_family(family: str, dtype=torch.float64, seed: int = 0):
    """Tiny random model of `family` in `dtype`; norm weights random in 0.5..1.5 and every bias
    random (so that a missed one would show); in float64 the RMSNorms (Gemma's (1 + w) form, OLMo 2's
    on q and k) keep their formula and compute in float64, as test_families checks."""
    torch.manual_seed(seed)
    model = _family_model(family).to(dtype).eval()
    with torch.no_grad():
        for mod in model.modules():
            if _is_norm(mod) and getattr(mod, "weight", None) is not None:
                mod.weight.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
    return exact_norms(model) if dtype == torch.float64 else model


def same_weights(family: str, model, dtype):
    """A fresh, unpatched copy of `make_family(family)`'s weights in another dtype (HF's own
    numerics). Not `copy.deepcopy`: a patched norm's forward would still use the original module."""
    other = _family_model(family).to(dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "phi3": ["qkv_proj", "o_proj"], "gpt-neox": ["query_key_value", "dense"]}


def lora_family(model, family: str, r: int = 4, seed: int = 1):
    """PEFT LoRA on the family's attention projections (names differ by family)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = LORA_TARGETS.get(family, ["q_proj", "v_proj", "o_proj"])
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                          fan_in_fan_out=family == "gpt2"))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(next(model.parameters()).dtype)
    return pm


FAMILY_MATRIX = ["qwen2", "qwen2-tied", "gemma3", "olmo2", "gpt-neox", "gpt2", "granite", "starcoder2", "phi3",
                 "llama-rope-llama3", "llama-rope-yarn"]
