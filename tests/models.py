"""Tiny random models of several HF families, built from configs (no download), for float64 tests.

HF's RMSNorm (and the Qwen3-MoE router's softmax) compute in float32 even in a float64 model;
`exact_norms` patches them to keep the input dtype, so that a real 1e-7 error cannot hide under that noise (DESIGN §2).
"""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def exact_norms(model):
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))

            def forward(x, mod=mod, eps=eps):
                return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

            mod.forward = forward
        elif type(mod).__name__.endswith("TopKRouter"):
            # the router's softmax is also forced to float32: same float32 noise, same fix

            def route(h, mod=mod):
                h = h.reshape(-1, mod.hidden_dim)
                logits = torch.nn.functional.linear(h, mod.weight)
                top, idx = torch.topk(torch.softmax(logits, dim=-1), mod.top_k, dim=-1)
                if getattr(mod, "norm_topk_prob", True):  # Mixtral's router always normalises
                    top = top / top.sum(dim=-1, keepdim=True)
                return logits, top, idx

            mod.forward = route
    return model


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
